"""decide(): observed state -> verdict or nothing. Pure, so tested exhaustively and fast."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Set, Tuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peerwatch._decide import CONSEQUENCE_WINDOW_NS, Decision, Observed, Policy, decide, exit_code_for
from peerwatch._records import (
    EXCEPTION,
    EXIT,
    SIGNAL,
    VANISHED,
    ExitStatus,
    Failure,
    Registration,
    Verdict,
)

WAIT_NS = 100_000_000
POLICY = Policy(parent_wait_ns=WAIT_NS, default_exit_code=7)
BOOT = "boot-a"
PIDNS = "pid:[4026531836]"


def reg(rank: int, *, pid: Optional[int] = None, ppid: int = 1, boot_id: str = BOOT,
        pidns: str = PIDNS) -> Registration:
    return Registration(
        rank=rank, pid=1000 + rank if pid is None else pid, ppid=ppid, start_ticks=500 + rank,
        uid=1000, host="host-a", boot_id=boot_id, pidns=pidns, time_ns=1,
    )


def failure(rank: int, t: int, **kw: Any) -> Failure:
    fields: Dict[str, Any] = dict(rank=rank, pid=1000 + rank, time_ns=t, cause=EXCEPTION, exit_code=1,
                  exception="builtins.RuntimeError", message="boom", traceback="Traceback ...")
    fields.update(kw)
    return Failure(**fields)


def status(rank: int, t: int, returncode: int, pid: Optional[int] = None) -> ExitStatus:
    return ExitStatus(rank=rank, pid=1000 + rank if pid is None else pid, time_ns=t,
                      returncode=returncode, observed_by=0)


def observed(*, self_rank: int = 0, now: int = 10_000_000_000, registrations=None, successes=(),
             failures=(), statuses=(), gone=None, verdict=None) -> Observed:
    return Observed(
        self_rank=self_rank, now_ns=now,
        registrations=registrations if registrations is not None else {r: reg(r) for r in range(4)},
        successes=frozenset(successes),
        failures={f.rank: f for f in failures},
        exit_statuses={s.rank: s for s in statuses},
        gone=dict(gone or {}),
        verdict=verdict,
    )


def lightning_regs(n: int = 4) -> Dict[int, Registration]:
    """Rank 0 is the parent of ranks 1..n-1 (Lightning's subprocess launcher)."""
    regs = {0: reg(0, ppid=1)}
    for r in range(1, n):
        regs[r] = reg(r, ppid=regs[0].pid)
    return regs


# -- rule 1: an existing verdict is followed -------------------------------------------


def test_nothing_observed_means_no_verdict_and_no_recheck():
    assert decide(observed(), POLICY) == Decision(None, None)


def test_an_existing_verdict_is_followed_whatever_else_is_seen():
    written = Verdict(rank=3, cause=SIGNAL, exit_code=137, failed_at_ns=50, detected_by=2,
                      detected_at_ns=60, signal="SIGKILL")
    obs = observed(verdict=written, failures=[failure(1, t=10)], statuses=[status(2, 5, 1)],
                   gone={0: 1})
    assert decide(obs, POLICY) == Decision(written)


def test_an_existing_verdict_is_followed_even_if_its_rank_has_a_success_marker():
    written = Verdict(rank=1, cause=EXIT, exit_code=3, failed_at_ns=5, detected_by=0, detected_at_ns=6)
    assert decide(observed(verdict=written, successes={0, 1, 2, 3}), POLICY).verdict is written


# -- rule 2: success is final ------------------------------------------------------------


def test_success_then_failure_exit_and_gone_gives_no_verdict():
    obs = observed(successes={2}, failures=[failure(2, t=10)], statuses=[status(2, 11, -9)], gone={2: 12})
    assert decide(obs, POLICY) == Decision(None, None)


@pytest.mark.parametrize("returncode", [0, 1, -9, -15])
def test_success_then_exit_status_gives_no_verdict(returncode):
    assert decide(observed(successes={1}, statuses=[status(1, 10, returncode)]), POLICY).verdict is None


def test_success_of_one_rank_does_not_hide_the_failure_of_another():
    obs = observed(successes={1}, failures=[failure(1, t=1), failure(2, t=5)])
    assert decide(obs, POLICY).verdict.rank == 2


# -- rule 3: failure record ----------------------------------------------------------------


def test_failure_record_becomes_the_verdict_with_its_details():
    f = failure(2, t=123, exit_code=3, exception="builtins.ValueError", message="bad input",
                traceback="Traceback (most recent call last):\n  ...\nValueError: bad input\n")
    obs = observed(self_rank=1, now=999, failures=[f])
    v = decide(obs, POLICY).verdict
    assert v is not None
    assert (v.rank, v.cause, v.exit_code, v.returncode) == (2, EXCEPTION, 3, 3)
    assert (v.exception, v.message, v.traceback) == (f.exception, f.message, f.traceback)
    assert v.failed_at_ns == 123
    assert (v.detected_by, v.detected_at_ns) == (1, 999)
    assert (v.pid, v.host) == (1002, "host-a")
    assert v.detail == "raised builtins.ValueError: bad input"


def test_failure_record_of_an_unregistered_rank_has_no_pid_or_host():
    v = decide(observed(registrations={}, failures=[failure(5, t=1)]), POLICY).verdict
    assert (v.rank, v.pid, v.host) == (5, None, None)


def test_failure_detail_names_a_thread_other_than_main():
    v = decide(observed(failures=[failure(1, t=1, thread="loader", message=None)]), POLICY).verdict
    assert v.detail == "raised builtins.RuntimeError (in thread loader)"
    v = decide(observed(failures=[failure(1, t=1, thread="MainThread")]), POLICY).verdict
    assert "thread" not in v.detail


def test_failure_without_exception_says_its_exit_code():
    f = failure(1, t=1, cause=EXIT, exit_code=4, exception=None, message=None, traceback=None)
    v = decide(observed(failures=[f]), POLICY).verdict
    assert (v.cause, v.exit_code, v.detail) == (EXIT, 4, "exited with code 4")


@pytest.mark.parametrize(
    ("code", "expected"),
    [(None, 7), (0, 7), (1, 1), (255, 255), (256, 7), (-9, 137), (-15, 143), (-200, 7)],
)
def test_failure_record_exit_code_is_mapped_into_1_to_255(code, expected):
    v = decide(observed(failures=[failure(1, t=1, exit_code=code)]), POLICY).verdict
    assert v.exit_code == expected
    assert v.returncode == code


def test_failure_record_wins_over_an_exit_status_of_the_same_rank():
    obs = observed(failures=[failure(1, t=20)], statuses=[status(1, 10, -9)], gone={1: 5})
    v = decide(obs, POLICY).verdict
    assert (v.cause, v.failed_at_ns) == (EXCEPTION, 20)


# -- rule 3: exit status seen by the parent -------------------------------------------------


@pytest.mark.parametrize(("returncode", "code", "name"), [(-9, 137, "SIGKILL"), (-15, 143, "SIGTERM"),
                                                          (-6, 134, "SIGABRT"), (-11, 139, "SIGSEGV")])
def test_negative_returncode_is_a_signal(returncode, code, name):
    v = decide(observed(statuses=[status(3, 40, returncode, pid=4242)]), POLICY).verdict
    assert (v.rank, v.cause, v.exit_code, v.signal, v.returncode) == (3, SIGNAL, code, name, returncode)
    assert v.pid == 4242  # the status's pid, not the registration's
    assert v.failed_at_ns == 40
    assert v.detail == f"killed by {name}"


def test_unknown_signal_number_still_gives_a_verdict():
    v = decide(observed(statuses=[status(1, 1, -99)]), POLICY).verdict
    assert (v.cause, v.signal, v.exit_code) == (SIGNAL, "signal 99", 227)


@pytest.mark.parametrize("returncode", [1, 2, 42, 255])
def test_nonzero_returncode_is_an_exit(returncode):
    v = decide(observed(statuses=[status(2, 9, returncode)]), POLICY).verdict
    assert (v.cause, v.exit_code, v.signal) == (EXIT, returncode, None)
    assert v.detail == f"exited with code {returncode}"


def test_exit_zero_without_success_marker_is_a_failure_with_the_default_code():
    v = decide(observed(statuses=[status(2, 9, 0)]), POLICY).verdict
    assert (v.rank, v.cause, v.returncode, v.exit_code) == (2, EXIT, 0, POLICY.default_exit_code)
    assert "without a success marker" in v.detail


def test_exit_status_wins_over_gone_even_while_the_parent_is_alive():
    obs = observed(registrations=lightning_regs(), statuses=[status(2, 50, -9)], gone={2: 40}, now=41)
    d = decide(obs, POLICY)
    assert d.recheck_at_ns is None
    assert (d.verdict.cause, d.verdict.failed_at_ns) == (SIGNAL, 50)


# -- rule 4: gone, held back while a live parent may report the status ----------------------


def test_gone_with_live_parent_is_held_back_until_parent_wait():
    obs = observed(self_rank=3, registrations=lightning_regs(), gone={2: 1000}, now=1000 + WAIT_NS - 1)
    assert decide(obs, POLICY) == Decision(None, recheck_at_ns=1000 + WAIT_NS)


def test_gone_with_live_parent_becomes_vanished_once_parent_wait_is_over():
    obs = observed(self_rank=3, registrations=lightning_regs(), gone={2: 1000}, now=1000 + WAIT_NS)
    v = decide(obs, POLICY).verdict
    assert (v.rank, v.cause, v.exit_code, v.failed_at_ns) == (2, VANISHED, 7, 1000)
    assert (v.pid, v.detected_by, v.detected_at_ns) == (1002, 3, 1000 + WAIT_NS)
    assert v.returncode is None and v.signal is None


def test_gone_whose_parent_is_self_is_not_held_back():
    # The watcher is the parent: it would have read the status itself if it could.
    obs = observed(self_rank=0, registrations=lightning_regs(), gone={2: 1000}, now=1001)
    assert decide(obs, POLICY).verdict.cause == VANISHED


def test_gone_whose_parent_is_gone_too_is_not_held_back():
    obs = observed(self_rank=3, registrations=lightning_regs(), gone={2: 1000, 0: 2000}, now=2001)
    v = decide(obs, POLICY).verdict
    assert (v.rank, v.cause) == (2, VANISHED)


def test_gone_whose_parent_is_not_a_rank_is_not_held_back():
    # torchrun: the agent is the parent; no rank can read the status.
    obs = observed(self_rank=0, gone={2: 1000}, now=1001)
    assert decide(obs, POLICY).verdict.cause == VANISHED


def test_gone_without_registration_is_not_held_back():
    regs = lightning_regs()
    del regs[2]
    obs = observed(self_rank=3, registrations=regs, gone={2: 1000}, now=1001)
    v = decide(obs, POLICY).verdict
    assert (v.rank, v.cause, v.pid, v.host) == (2, VANISHED, None, None)


@pytest.mark.parametrize("field", ["boot_id", "pidns"])
def test_parent_pid_in_another_boot_or_namespace_is_not_the_parent(field):
    regs = lightning_regs()
    regs[0] = dataclasses.replace(regs[0], **{field: "elsewhere"})
    obs = observed(self_rank=3, registrations=regs, gone={2: 1000}, now=1001)
    assert decide(obs, POLICY).verdict.cause == VANISHED


# -- rule 5: earliest failure wins, ties to the lowest rank ------------------------------


def test_earliest_failure_wins():
    obs = observed(failures=[failure(1, t=300), failure(3, t=100)])
    assert decide(obs, POLICY).verdict.rank == 3
    far = CONSEQUENCE_WINDOW_NS
    obs = observed(failures=[failure(1, t=3 * far), failure(3, t=far)], statuses=[status(2, 2 * far + 1, 1)])
    assert decide(obs, POLICY).verdict.rank == 3


@pytest.mark.parametrize("death", ["status", "gone"])
def test_a_death_outranks_an_exception_just_before_it(death):
    # Rank 2 is SIGKILLed; rank 1's all_reduce fails with "Connection closed by peer" and
    # its record is stamped before a watcher sees rank 2 gone: rank 2 is the root cause.
    kw = {"statuses": [status(2, 1_000_500, -9)]} if death == "status" else {"gone": {2: 1_000_500}}
    obs = observed(failures=[failure(1, t=1_000_000)], now=10**12, **kw)
    assert decide(obs, POLICY).verdict.rank == 2
    # ... but not one seen more than the window later.
    late = 1_000_000 + CONSEQUENCE_WINDOW_NS + 1
    kw = {"statuses": [status(2, late, -9)]} if death == "status" else {"gone": {2: late}}
    obs = observed(failures=[failure(1, t=1_000_000)], now=10**12, **kw)
    assert decide(obs, POLICY).verdict.rank == 1


def test_earliest_wins_across_kinds():
    obs = observed(failures=[failure(1, t=300)], statuses=[status(2, 200, 1)], gone={3: 150}, now=10**12)
    v = decide(obs, POLICY).verdict
    assert (v.rank, v.cause) == (3, VANISHED)


def test_ties_go_to_the_lowest_rank():
    obs = observed(failures=[failure(3, t=100)], statuses=[status(2, 100, -9)], gone={1: 100}, now=10**12)
    assert decide(obs, POLICY).verdict.rank == 1
    obs = observed(failures=[failure(3, t=100), failure(2, t=100)])
    assert decide(obs, POLICY).verdict.rank == 2


def test_held_back_failure_earlier_than_a_found_one_makes_decide_wait():
    obs = observed(self_rank=3, registrations=lightning_regs(), gone={2: 1000},
                   failures=[failure(1, t=1500)], now=1600)
    assert decide(obs, POLICY) == Decision(None, recheck_at_ns=1000 + WAIT_NS)
    later = dataclasses.replace(obs, now_ns=1000 + WAIT_NS)
    assert decide(later, POLICY).verdict.rank == 2


def test_held_back_failure_at_the_same_time_as_a_found_one_makes_decide_wait():
    obs = observed(self_rank=3, registrations=lightning_regs(), gone={2: 1500},
                   failures=[failure(1, t=1500)], now=1600)
    assert decide(obs, POLICY).verdict is None


def test_held_back_failure_later_than_a_found_one_does_not_delay_the_verdict():
    far = CONSEQUENCE_WINDOW_NS
    obs = observed(self_rank=3, registrations=lightning_regs(), gone={2: 3 * far},
                   failures=[failure(1, t=far)], now=3 * far + 1)
    d = decide(obs, POLICY)
    assert d.recheck_at_ns is None
    assert d.verdict.rank == 1


def test_several_held_back_recheck_at_the_first_deadline():
    obs = observed(self_rank=3, registrations=lightning_regs(), gone={1: 3000, 2: 1000}, now=3001)
    assert decide(obs, POLICY) == Decision(None, recheck_at_ns=1000 + WAIT_NS)


# -- exit_code_for ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("returncode", "expected"),
    [(None, 9), (0, 9), (1, 1), (255, 255), (256, 9), (-1, 129), (-9, 137), (-127, 255), (-128, 9)],
)
def test_exit_code_for(returncode, expected):
    assert exit_code_for(returncode, Policy(parent_wait_ns=0, default_exit_code=9)) == expected


# -- properties over random observations -----------------------------------------------------


@dataclasses.dataclass
class Scenario:
    obs: Observed
    policy: Policy

    @property
    def failing(self) -> Set[int]:
        o = self.obs
        return (set(o.failures) | set(o.exit_statuses) | set(o.gone)) - set(o.successes)

    def failed_at(self, rank: int) -> int:
        o = self.obs
        if rank in o.failures:
            return o.failures[rank].time_ns
        if rank in o.exit_statuses:
            return o.exit_statuses[rank].time_ns
        return o.gone[rank]

    @property
    def all_waits_over_ns(self) -> int:
        return max(self.obs.gone.values(), default=0) + self.policy.parent_wait_ns


times = st.integers(min_value=0, max_value=10_000)
exit_codes = st.none() | st.integers(min_value=-300, max_value=300)


@st.composite
def scenarios(draw, all_succeed: Optional[bool] = None) -> Scenario:
    n = draw(st.integers(min_value=1, max_value=6))
    ranks = list(range(n))
    # Each rank's parent: an outside process, or another rank (Lightning-like trees).
    regs: Dict[int, Registration] = {}
    for r in ranks:
        if draw(st.booleans()):  # some ranks never registered
            continue
        parent = draw(st.sampled_from([None] + [p for p in ranks if p != r]))
        ppid = 1 if parent is None else 1000 + parent
        regs[r] = reg(r, ppid=ppid)
    if all_succeed is None:
        successes = draw(st.sets(st.sampled_from(ranks)))
    else:
        successes = set(ranks) if all_succeed else draw(st.sets(st.sampled_from(ranks), max_size=n - 1))
    failures = {r: failure(r, t=draw(times), exit_code=draw(exit_codes))
                for r in draw(st.sets(st.sampled_from(ranks)))}
    statuses = {r: status(r, draw(times), draw(st.integers(min_value=-64, max_value=300)))
                for r in draw(st.sets(st.sampled_from(ranks)))}
    gone = {r: draw(times) for r in draw(st.sets(st.sampled_from(ranks)))}
    if all_succeed is False:
        # At least one rank without a success marker failed somehow.
        culprit = draw(st.sampled_from(sorted(set(ranks) - successes)))
        kind = draw(st.sampled_from(["failure", "status", "gone"]))
        if kind == "failure":
            failures[culprit] = failure(culprit, t=draw(times), exit_code=draw(exit_codes))
        elif kind == "status":
            statuses[culprit] = status(culprit, draw(times), draw(st.integers(-64, 300)))
        else:
            gone[culprit] = draw(times)
    policy = Policy(parent_wait_ns=draw(st.integers(0, 5_000)), default_exit_code=draw(st.integers(1, 255)))
    obs = Observed(
        self_rank=draw(st.sampled_from(ranks)), now_ns=draw(st.integers(0, 20_000)),
        registrations=regs, successes=frozenset(successes), failures=failures,
        exit_statuses=statuses, gone=gone,
    )
    return Scenario(obs, policy)


def shuffled(draw, mapping):
    keys = draw(st.permutations(sorted(mapping)))
    return {k: mapping[k] for k in keys}


@settings(deadline=None)
@given(scenarios(all_succeed=True))
def test_no_verdict_when_every_rank_has_a_success_marker(sc):
    for now in (sc.obs.now_ns, sc.all_waits_over_ns):
        d = decide(dataclasses.replace(sc.obs, now_ns=now), sc.policy)
        assert d == Decision(None, None)


@settings(deadline=None)
@given(scenarios(all_succeed=False))
def test_a_verdict_once_all_parent_waits_are_over(sc):
    obs = dataclasses.replace(sc.obs, now_ns=max(sc.obs.now_ns, sc.all_waits_over_ns))
    v = decide(obs, sc.policy).verdict
    assert v is not None
    assert v.rank in sc.failing
    assert 1 <= v.exit_code <= 255
    # The root cause is the earliest failure, ties to the lowest rank; but an exception
    # never outranks a death (no record) seen within the consequence window.
    o = sc.obs
    deaths = [sc.failed_at(r) for r in sc.failing if r not in o.failures]

    def key(r: int) -> tuple:
        t = sc.failed_at(r)
        consequence = r in o.failures and any(d <= t + CONSEQUENCE_WINDOW_NS for d in deaths)
        return (consequence, t, r)

    assert v.rank == min(sc.failing, key=key)


@settings(deadline=None)
@given(scenarios())
def test_any_verdict_names_a_failed_rank_with_an_exit_code_in_range(sc):
    d = decide(sc.obs, sc.policy)
    if d.verdict is not None:
        assert d.verdict.rank in sc.failing
        assert d.verdict.rank not in sc.obs.successes
        assert 1 <= d.verdict.exit_code <= 255
        assert d.recheck_at_ns is None
    elif sc.failing:
        # Nothing yet only while something is held back; decide says when to look again.
        assert d.recheck_at_ns is not None and d.recheck_at_ns > sc.obs.now_ns
    else:
        assert d == Decision(None, None)


@settings(deadline=None)
@given(scenarios())
def test_following_recheck_at_always_ends_in_a_verdict(sc):
    obs = sc.obs
    for _ in range(len(obs.gone) + 1):
        d = decide(obs, sc.policy)
        if d.recheck_at_ns is None:
            break
        assert d.recheck_at_ns > obs.now_ns
        obs = dataclasses.replace(obs, now_ns=d.recheck_at_ns)
    else:
        pytest.fail("decide kept asking to recheck")
    assert (d.verdict is not None) == bool(sc.failing)


@settings(deadline=None)
@given(scenarios(), st.integers(min_value=0, max_value=50_000))
def test_a_verdict_does_not_change_as_time_passes(sc, extra_ns):
    first = decide(sc.obs, sc.policy).verdict
    later = decide(dataclasses.replace(sc.obs, now_ns=sc.obs.now_ns + extra_ns), sc.policy).verdict
    if first is not None:
        assert later is not None
        assert (later.rank, later.cause, later.failed_at_ns, later.exit_code) == (
            first.rank, first.cause, first.failed_at_ns, first.exit_code)


@settings(deadline=None)
@given(st.data())
def test_the_order_events_were_seen_in_does_not_matter(data):
    sc = data.draw(scenarios())
    o = sc.obs
    reordered = dataclasses.replace(
        o,
        registrations=shuffled(data.draw, o.registrations),
        failures=shuffled(data.draw, o.failures),
        exit_statuses=shuffled(data.draw, o.exit_statuses),
        gone=shuffled(data.draw, o.gone),
        successes=frozenset(data.draw(st.permutations(sorted(o.successes)))),
    )
    assert decide(reordered, sc.policy) == decide(o, sc.policy)


@settings(deadline=None)
@given(scenarios(), st.data())
def test_a_success_marker_silences_its_rank_whatever_else_it_did(sc, data):
    o = sc.obs
    victims = data.draw(st.sets(st.sampled_from(sorted(sc.failing)))) if sc.failing else set()
    silenced = dataclasses.replace(o, successes=frozenset(set(o.successes) | victims))
    v = decide(dataclasses.replace(silenced, now_ns=10**9), sc.policy).verdict
    assert (v is None) == (not (sc.failing - victims))
    if v is not None:
        assert v.rank not in victims


def _tree(draw) -> Tuple[Dict[int, Registration], List[int]]:
    n = draw(st.integers(2, 6))
    return {r: reg(r, ppid=1000 if r else 1) for r in range(n)}, list(range(n))


@settings(deadline=None)
@given(st.data())
def test_gone_children_of_a_live_watching_parent_are_held_exactly_parent_wait(data):
    regs, ranks = _tree(data.draw)
    child = data.draw(st.sampled_from(ranks[1:]))
    watcher = data.draw(st.sampled_from([r for r in ranks if r != 0]))
    seen = data.draw(times)
    wait = data.draw(st.integers(1, 5_000))
    now = data.draw(st.integers(seen, seen + 2 * wait))
    obs = Observed(self_rank=watcher, now_ns=now, registrations=regs, successes=frozenset(),
                   failures={}, exit_statuses={}, gone={child: seen})
    d = decide(obs, Policy(parent_wait_ns=wait, default_exit_code=1))
    if now < seen + wait:
        assert d == Decision(None, recheck_at_ns=seen + wait)
    else:
        assert d.verdict is not None and d.verdict.cause == VANISHED and d.verdict.rank == child
