"""decide(): observed state -> verdict or nothing. Pure, so tested exhaustively and fast."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Set, Tuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peerwatch.core.config import HangSetting
from peerwatch.core.records import (
    BUSY,
    EXCEPTION,
    EXIT,
    HANG,
    HANG_EXIT_CODE,
    INTERRUPTED,
    LOST,
    MISSING,
    SIGNAL,
    VANISHED,
    Diagnosis,
    ExitStatus,
    Failure,
    Interrupt,
    Registration,
    Verdict,
)
from peerwatch.hangs.diagnose import FROZEN_STATES, RankState
from peerwatch.verdict.decide import (
    COLLECTIVE_SETTLE_NS,
    CONSEQUENCE_WINDOW_NS,
    INTERRUPT_WINDOW_NS,
    LEAVING_WAIT_NS,
    REMOTE_SETTLE_NS,
    UNREAD_RECHECK_NS,
    Decision,
    Observed,
    Policy,
    decide,
    exit_code_for,
)

WAIT_NS = 100_000_000
POLICY = Policy(parent_wait_ns=WAIT_NS, default_exit_code=7)
BOOT = "boot-a"
PIDNS = "pid:[4026531836]"

pytestmark = pytest.mark.pure  # no process, no thread, no file: conftest skips its scan for leaks



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


def status(rank: int, t: int, returncode: int, pid: Optional[int] = None, sender: Optional[int] = None) -> ExitStatus:
    return ExitStatus(rank=rank, pid=1000 + rank if pid is None else pid, time_ns=t,
                      returncode=returncode, observed_by=0, signalled_by=sender)


def observed(*, self_rank: int = 0, now: int = 10_000_000_000, registrations=None, successes=(),
             failures=(), statuses=(), gone=None, verdict=None, leaving=None, unread=False) -> Observed:
    return Observed(
        self_rank=self_rank, now_ns=now,
        registrations=registrations if registrations is not None else {r: reg(r) for r in range(4)},
        successes=frozenset(successes),
        failures={f.rank: f for f in failures},
        exit_statuses={s.rank: s for s in statuses},
        gone=dict(gone or {}),
        verdict=verdict,
        leaving=dict(leaving or {}),
        unread=unread,
    )


def lightning_regs(n: int = 4) -> Dict[int, Registration]:
    """Rank 0 is the parent of ranks 1..n-1 (Lightning's subprocess launcher)."""
    regs = {0: reg(0, ppid=1)}
    for r in range(1, n):
        regs[r] = reg(r, ppid=regs[0].pid)
    return regs


def test_what_a_watcher_was_not_told_is_empty_or_zero():
    """Observed's defaults: no verdict, no OOM kill, no progress, no monotonic time, nothing
    missing, no diagnosis, nobody leaving."""
    o = Observed(self_rank=0, now_ns=1, registrations={}, successes=frozenset(), failures={}, exit_statuses={}, gone={})
    assert (o.verdict, o.oom_kills, dict(o.progress), o.now_mono_ns, o.missing, o.diagnosis,
            dict(o.leaving)) == (None, 0, {}, 0, (), None, {})
    assert decide(o, POLICY) == Decision(None)


# -- rule: a verdict stands ------------------------------------------------------------


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


# -- rule: success is final --------------------------------------------------------------


def test_success_then_failure_exit_and_gone_gives_no_verdict():
    obs = observed(successes={2}, failures=[failure(2, t=10)], statuses=[status(2, 11, -9)], gone={2: 12})
    assert decide(obs, POLICY) == Decision(None, None)


@pytest.mark.parametrize("returncode", [0, 1, -9, -15])
def test_success_then_exit_status_gives_no_verdict(returncode):
    assert decide(observed(successes={1}, statuses=[status(1, 10, returncode)]), POLICY).verdict is None


def test_success_of_one_rank_does_not_hide_the_failure_of_another():
    obs = observed(successes={1}, failures=[failure(1, t=1), failure(2, t=5)])
    assert decide(obs, POLICY).verdict.rank == 2


# -- rule: exited is not succeeded; a failure record ---------------------------------------


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


# -- rule: exited is not succeeded; an exit status seen by the parent -----------------------


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


# -- rules: held back for the parent, held back while unread --------------------------------


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


def test_gone_while_records_could_not_be_read_is_held_back_until_they_are():
    """Out of descriptors, events/ could not be listed (or a record read): the peer seen gone
    may have a success marker there. Its end is not a failure until the look succeeds."""
    obs = observed(gone={2: 1000}, now=1001, unread=True)
    assert decide(obs, POLICY) == Decision(None, recheck_at_ns=1001 + UNREAD_RECHECK_NS)
    assert decide(dataclasses.replace(obs, unread=False), POLICY).verdict.cause == VANISHED
    assert decide(dataclasses.replace(obs, unread=False, successes=frozenset({2})), POLICY) == Decision(None)


def test_a_failure_read_before_an_end_not_known_yet_is_acted_on():
    """What could not be read holds back only the ends it may explain: a failure record read,
    earlier than the death seen, is the root cause whatever that death turns out to be."""
    # not the death an exception may echo (rule: a death outranks an exception)
    seen = 500 + 2 * CONSEQUENCE_WINDOW_NS
    obs = observed(failures=[failure(1, 500)], gone={2: seen}, now=seen + 1, unread=True)
    assert decide(obs, POLICY).verdict.rank == 1


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


# -- rules: the earliest failure is the cause, a launcher's signal never outranks --------


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


@pytest.mark.parametrize("other", ["gone", "status", "failure"])
def test_a_rank_its_launcher_signalled_never_outranks_another_failure(other):
    # torchrun's agent (pid 77, every rank's parent) reaped rank 2 and SIGTERMed rank 0
    # before rank 1's watcher had seen rank 2 end: rank 0's record is stamped first.
    regs = {r: reg(r, ppid=77) for r in range(4)}
    kw: Dict[str, Any] = {
        "gone": {"gone": {2: 500}},
        "status": {"statuses": [status(0, 100, -15, sender=77), status(2, 500, 1)]},
        "failure": {"failures": [failure(2, t=500)]},
    }[other]
    kw.setdefault("statuses", [status(0, 100, -15, sender=77)])
    v = decide(observed(registrations=regs, now=10**12, self_rank=1, **kw), POLICY).verdict
    assert v.rank == 2, v
    # A SIGTERM from anyone else is a failure like any other: the earliest wins.
    kw["statuses"] = [status(0, 100, -15, sender=4242)] + [s for s in kw["statuses"] if s.rank != 0]
    v = decide(observed(registrations=regs, now=10**12, self_rank=1, **kw), POLICY).verdict
    assert (v.rank, v.signal) == (0, "SIGTERM"), v
    # Alone, it is the cause.
    v = decide(observed(registrations=regs, now=10**12, self_rank=1, statuses=[status(0, 100, -15, sender=77)]),
               POLICY).verdict
    assert (v.rank, v.signal) == (0, "SIGTERM"), v


def test_a_rank_its_launcher_signalled_waits_for_a_death_held_back_for_its_parent_however_late():
    """Lightning's rank 0 (the parent of ranks 1..3) saw rank 2 die and SIGTERMed rank 1;
    rank 3's watcher has rank 1's status but saw rank 2 gone only later (a loaded host), and
    only rank 0 can say how rank 2 ended: rank 1 is no cause, so wait for rank 2's parent."""
    regs = lightning_regs()
    seen = 5_000 + 2 * ONE_S  # past any window: a horizon would not wait for it
    obs = observed(self_rank=3, registrations=regs, statuses=[status(1, 5_000, -15, sender=regs[0].pid)],
                   gone={2: seen}, now=seen + 1)
    assert decide(obs, POLICY) == Decision(None, recheck_at_ns=seen + WAIT_NS)
    v = decide(dataclasses.replace(obs, now_ns=seen + WAIT_NS), POLICY).verdict
    assert v is not None and (v.rank, v.cause) == (2, VANISHED), v
    # A SIGTERM from anyone else is the cause at once, as any earlier failure.
    other = observed(self_rank=3, registrations=regs, statuses=[status(1, 5_000, -15, sender=4242)],
                     gone={2: seen}, now=seen + 1)
    d = decide(other, POLICY)
    assert d.verdict is not None and (d.verdict.rank, d.verdict.signal, d.recheck_at_ns) == (1, "SIGTERM", None), d


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


# -- rules: a death outranks an exception, a collective exception settles, echo waits for the leaving ---
# The window is documented as 1 s; these tests spell it out rather than import it, so that they
# notice if it changes.

ONE_S = 1_000_000_000


@pytest.mark.parametrize("death", ["status", "gone"])
def test_a_death_exactly_one_second_after_an_exception_is_still_the_cause(death):
    at = 1_000_000 + ONE_S
    kw = {"statuses": [status(2, at, -9)]} if death == "status" else {"gone": {2: at}}
    obs = observed(failures=[failure(1, t=1_000_000)], now=10**12, **kw)
    assert decide(obs, POLICY).verdict.rank == 2


def test_a_held_back_death_within_a_second_of_an_exception_makes_decide_wait():
    # Rank 1's collective fails; rank 2 (a child of rank 0) is seen gone just under a second
    # later, and only its parent can say how: it may be the cause, so wait for the parent.
    for seen in (1_000 + ONE_S - 1, 1_000 + ONE_S):
        obs = observed(self_rank=3, registrations=lightning_regs(), gone={2: seen},
                       failures=[failure(1, t=1_000)], now=seen + 1)
        assert decide(obs, POLICY) == Decision(None, recheck_at_ns=seen + WAIT_NS)
        # ... and once its parent stayed silent for parent_wait, the death is the cause.
        later = decide(dataclasses.replace(obs, now_ns=seen + WAIT_NS), POLICY).verdict
        assert (later.rank, later.cause) == (2, VANISHED)


def test_a_held_back_death_more_than_a_second_after_an_exception_does_not_delay_it():
    seen = 1_000 + ONE_S + 1
    obs = observed(self_rank=3, registrations=lightning_regs(), gone={2: seen},
                   failures=[failure(1, t=1_000)], now=seen + 1)
    d = decide(obs, POLICY)
    assert d.recheck_at_ns is None
    assert (d.verdict.rank, d.verdict.cause) == (1, EXCEPTION)


@pytest.mark.parametrize("cause", ["status", "exit record"])
def test_a_held_back_death_after_another_death_does_not_delay_it(cause):
    # A death has no consequence window: a death seen after it can never be the cause.
    first = {"statuses": [status(3, 5_000, -9)]} if cause == "status" else {
        "failures": [failure(3, t=5_000, cause=EXIT, exception=None, message=None, exit_code=2)]}
    obs = observed(self_rank=1, registrations=lightning_regs(), gone={2: 5_001}, now=5_002, **first)
    d = decide(obs, POLICY)
    assert d.recheck_at_ns is None
    assert d.verdict.rank == 3


def test_a_held_back_death_at_the_same_time_as_another_death_makes_decide_wait():
    # Same time: the lower rank would win the tie, so its parent must be heard first.
    obs = observed(self_rank=1, registrations=lightning_regs(), gone={2: 5_000},
                   statuses=[status(3, 5_000, -9)], now=5_001)
    assert decide(obs, POLICY) == Decision(None, recheck_at_ns=5_000 + WAIT_NS)
    later = decide(dataclasses.replace(obs, now_ns=5_000 + WAIT_NS), POLICY).verdict
    assert (later.rank, later.cause) == (2, VANISHED)


def test_an_exception_is_never_blamed_over_a_death_seen_right_after_it():
    # Every rank's collective fails within milliseconds of rank 3's SIGKILL, some stamped
    # before the kill is seen: whatever the order, the killed rank is the cause.
    fails = [failure(r, t=10_000 + 1_000 * r) for r in (0, 1, 2)]
    for death_at in (10_000, 12_500, 10_000 + ONE_S):
        obs = observed(failures=fails, statuses=[status(3, death_at, -9)], now=10**12)
        v = decide(obs, POLICY).verdict
        assert (v.rank, v.cause, v.signal) == (3, SIGNAL, "SIGKILL")


def test_an_exception_raised_by_torch_distributed_waits_for_the_failure_it_may_echo():
    # Rank 0's all_reduce fails at t: the death that closed the socket (or the exit status
    # of a rank finalizing after raise SystemExit) may only show up a moment later.
    t = 10_000_000_000
    echo = failure(0, t=t, collective=True)
    early = decide(observed(failures=[echo], now=t + 1_000_000), POLICY)
    assert early == Decision(None, recheck_at_ns=t + COLLECTIVE_SETTLE_NS)
    # What it echoed shows up: the death, stamped after the exception, is the cause.
    seen = observed(failures=[echo], gone={3: t + 40_000_000}, now=t + 41_000_000)
    v = decide(seen, POLICY).verdict
    assert (v.rank, v.cause) == (3, VANISHED)
    exit3 = failure(1, t=t + 30_000_000, cause=EXIT, exit_code=3, exception=None, message="SystemExit(3)")
    v = decide(observed(failures=[echo, exit3], now=t + 31_000_000), POLICY).verdict
    assert (v.rank, v.cause, v.exit_code) == (1, EXIT, 3)
    # Nothing else shows up: the exception itself is the cause, once the wait is over.
    v = decide(observed(failures=[echo], now=t + COLLECTIVE_SETTLE_NS), POLICY).verdict
    assert (v.rank, v.cause) == (0, EXCEPTION)
    # An exception of the application's own is judged at once.
    v = decide(observed(failures=[failure(0, t=t)], now=t + 1_000_000), POLICY).verdict
    assert (v.rank, v.cause) == (0, EXCEPTION)


# The survivors' all_reduce fails at T: rank 1's sockets closed while its interpreter
# finalized after `raise SystemExit(3)`; it had begun to leave 50 ms before, and its exit
# status (exit 3, written at exit()) comes only when finalizing is over.
T = 10_000_000_000
LEFT = T - 50_000_000


def _echoes(*ranks: int, t: int = T) -> List[Failure]:
    return [failure(r, t=t + r, collective=True, message="Connection closed by peer") for r in ranks]


def _exit3(t: int) -> Failure:
    return failure(1, t=t, cause=EXIT, exit_code=3, exception=None, message="exited with this status")


def test_a_collective_exception_waits_for_a_rank_that_is_leaving_to_end():
    obs = observed(failures=_echoes(0, 2), now=T + COLLECTIVE_SETTLE_NS)
    early = decide(dataclasses.replace(obs, leaving={1: LEFT}), POLICY)
    assert early == Decision(None, recheck_at_ns=LEFT + LEAVING_WAIT_NS)
    # Without knowing that rank 1 is leaving, the echo would be judged now: the old answer.
    assert (decide(obs, POLICY).verdict.rank, decide(obs, POLICY).verdict.cause) == (0, EXCEPTION)


@pytest.mark.parametrize("ended_after_s", [0.1, 1.5, 14.9])
def test_a_rank_that_was_leaving_and_exits_with_a_failure_is_the_cause_however_late(ended_after_s):
    """Its exit status comes after the echoes, maybe beyond CONSEQUENCE_WINDOW_NS (a slow
    finalization): it is the cause all the same, with its own exit code."""
    end = T + int(ended_after_s * ONE_S)
    obs = observed(failures=[*_echoes(0, 2), _exit3(end)], now=end + 1)
    v = decide(dataclasses.replace(obs, leaving={1: LEFT}), POLICY).verdict
    assert (v.rank, v.cause, v.exit_code) == (1, EXIT, 3)


@pytest.mark.parametrize("how", ["SIGKILL", "vanished"])
def test_a_rank_that_was_leaving_and_died_is_the_cause_however_late(how):
    end = T + 3 * ONE_S
    died = {"statuses": [status(1, end, -9)]} if how == "SIGKILL" else {"gone": {1: end}}
    obs = observed(failures=_echoes(0, 2), now=end + 1, leaving={1: LEFT}, **died)
    v = decide(obs, POLICY).verdict
    assert (v.rank, v.cause) == (1, SIGNAL if how == "SIGKILL" else VANISHED)


def test_a_rank_that_was_leaving_and_succeeded_leaves_the_echo_the_cause():
    obs = observed(failures=_echoes(0), successes={1}, now=T + COLLECTIVE_SETTLE_NS, leaving={1: LEFT})
    v = decide(obs, POLICY).verdict
    assert (v.rank, v.cause) == (0, EXCEPTION)


def test_a_rank_that_never_ends_holds_the_echo_for_leaving_wait_only():
    obs = observed(failures=_echoes(0), now=LEFT + LEAVING_WAIT_NS, leaving={1: LEFT})
    v = decide(obs, POLICY).verdict
    assert (v.rank, v.cause) == (0, EXCEPTION)


def test_a_rank_that_began_to_leave_long_before_or_after_an_echo_is_not_what_it_echoes():
    for began in (T - LEAVING_WAIT_NS - 1, T + COLLECTIVE_SETTLE_NS + 1):
        obs = observed(failures=_echoes(0), now=T + COLLECTIVE_SETTLE_NS, leaving={1: began})
        assert decide(obs, POLICY).verdict.rank == 0
        late = observed(failures=[*_echoes(0), _exit3(T + 2 * ONE_S)], now=T + 3 * ONE_S, leaving={1: began})
        assert decide(late, POLICY).verdict.rank == 0
    # Its edges belong to it: exactly LEAVING_WAIT_NS before, exactly COLLECTIVE_SETTLE_NS after.
    for began in (T - LEAVING_WAIT_NS, T + COLLECTIVE_SETTLE_NS):
        late = observed(failures=[*_echoes(0), _exit3(T + 2 * ONE_S)], now=T + 3 * ONE_S, leaving={1: began})
        assert decide(late, POLICY).verdict.rank == 1, began
    # Within the window after it (an atexit handler destroyed the process group first, then
    # the rank's program ended): the echo waits for it.
    obs = observed(failures=_echoes(0), now=T + COLLECTIVE_SETTLE_NS, leaving={1: T + COLLECTIVE_SETTLE_NS})
    assert decide(obs, POLICY).recheck_at_ns == T + COLLECTIVE_SETTLE_NS + LEAVING_WAIT_NS


def test_an_applications_own_exception_is_no_echo_of_a_rank_leaving():
    """Only an exception raised by torch.distributed waits for, or yields to, a leaving rank."""
    own = failure(0, t=T)
    obs = observed(failures=[own], now=T + 1, leaving={1: LEFT})
    assert (decide(obs, POLICY).verdict.rank, decide(obs, POLICY).verdict.cause) == (0, EXCEPTION)
    late = observed(failures=[own, _exit3(T + 2 * ONE_S)], now=T + 3 * ONE_S, leaving={1: LEFT})
    assert decide(late, POLICY).verdict.rank == 0


def test_a_leaving_rank_gone_late_and_held_for_its_parent_keeps_the_echo_waiting():
    """Lightning: rank 0 is rank 2's parent. Rank 2 was leaving and is seen gone 2 s after
    the echo (beyond the horizon of CONSEQUENCE_WINDOW_NS): its parent may say how it ended."""
    gone_at = T + 2 * ONE_S
    obs = observed(self_rank=3, registrations=lightning_regs(), failures=_echoes(1), gone={2: gone_at},
                   now=gone_at + 1, leaving={2: LEFT})
    assert decide(obs, POLICY) == Decision(None, recheck_at_ns=gone_at + WAIT_NS)
    later = decide(dataclasses.replace(obs, now_ns=gone_at + WAIT_NS), POLICY).verdict
    assert (later.rank, later.cause) == (2, VANISHED)


# -- the verdict's details for other kinds of record ----------------------------------------------


def test_a_hang_record_written_by_the_gil_watchdog_is_a_hang_verdict():
    f = failure(2, t=50, cause=HANG, exit_code=None, exception=None, message="watcher silent for 30s")
    v = decide(observed(failures=[f]), POLICY).verdict
    assert (v.rank, v.cause, v.exit_code, v.failed_at_ns, v.laggards) == (2, HANG, HANG_EXIT_CODE, 50, (2,))
    assert v.detail == "hung: watcher silent for 30s"
    bare = dataclasses.replace(f, message=None)
    assert decide(observed(failures=[bare]), POLICY).verdict.detail == "hung"


def test_a_failure_of_a_rank_on_another_host_names_that_host():
    f = failure(5, t=1, host="host-b")
    v = decide(observed(failures=[f]), POLICY).verdict
    assert (v.rank, v.host, v.pid) == (5, "host-b", None)
    # A registered rank's own host comes from its registration.
    v = decide(observed(failures=[failure(1, t=1, host="elsewhere")]), POLICY).verdict
    assert v.host == "host-a"


def test_a_failure_with_an_exception_but_no_message_names_the_exception():
    v = decide(observed(failures=[failure(1, t=1, message=None)]), POLICY).verdict
    assert v.detail == "raised builtins.RuntimeError"


# -- out-of-memory -------------------------------------------------------------------------------


def oom(obs: Observed, kills: int) -> Observed:
    return dataclasses.replace(obs, oom_kills=kills)


@pytest.mark.parametrize("kind", ["gone", "SIGKILL"])
def test_a_silent_death_during_oom_kills_is_suspected_to_be_one(kind):
    obs = observed(gone={2: 5}) if kind == "gone" else observed(statuses=[status(2, 5, -9)])
    v = decide(oom(obs, 1), POLICY).verdict
    assert v.rank == 2 and v.oom_suspected
    assert v.detail.endswith("; likely killed by the OOM killer (1 OOM kill(s) during the run)")
    assert v.detail.startswith("ended without" if kind == "gone" else "killed by SIGKILL")
    plain = decide(obs, POLICY).verdict
    assert not plain.oom_suspected and "OOM killer (" not in plain.detail


@pytest.mark.parametrize("obs", [observed(statuses=[status(2, 5, -15)]), observed(statuses=[status(2, 5, 1)]),
                                 observed(failures=[failure(2, t=5)])], ids=["SIGTERM", "exit 1", "exception"])
def test_a_death_that_says_how_it_ended_is_not_blamed_on_the_oom_killer(obs):
    v = decide(oom(obs, 3), POLICY).verdict
    assert not v.oom_suspected and "OOM killer (" not in v.detail


# -- rule: a rank that never registered ---------------------------------------------------------


def test_ranks_that_never_registered_give_a_missing_verdict():
    obs = dataclasses.replace(observed(self_rank=0, now=777), missing=(2, 3))
    v = decide(obs, POLICY).verdict
    assert (v.rank, v.cause, v.exit_code, v.failed_at_ns, v.detected_by) == (2, MISSING, 7, 777, 0)
    assert v.detail == "never started: rank(s) 2, 3 did not register within startup_timeout"


def test_a_real_failure_is_the_cause_rather_than_a_missing_rank():
    obs = dataclasses.replace(observed(failures=[failure(1, t=5)]), missing=(2,))
    assert (decide(obs, POLICY).verdict.rank, decide(obs, POLICY).verdict.cause) == (1, EXCEPTION)


def test_a_missing_rank_waits_for_a_held_back_death():
    obs = dataclasses.replace(observed(self_rank=3, registrations=lightning_regs(), gone={2: 1000}, now=1001),
                              missing=(1,))
    assert decide(obs, POLICY) == Decision(None, recheck_at_ns=1000 + WAIT_NS)


# -- rule: no rank moved -------------------------------------------------------------------------

HANG_S = 10 * ONE_S
HANG_POLICY = Policy(parent_wait_ns=WAIT_NS, default_exit_code=7, hang_timeout=HangSetting(seconds=HANG_S / ONE_S))
MONO = 500 * ONE_S  # this host's monotonic clock when decide runs
WALL = 2_000 * ONE_S  # ... and its wall clock


def prog(step: Optional[int] = 5, silent_s: float = 12.0, **kw: Any) -> RankState:
    """A live rank whose last beat() was ``silent_s`` before MONO."""
    return RankState(step=step, beat_mono_ns=MONO - int(silent_s * ONE_S), **kw)


def hang(progress: Dict[int, RankState], policy: Policy = HANG_POLICY, **kw: Any) -> Optional[Verdict]:
    obs = dataclasses.replace(observed(now=WALL, **kw), progress=progress, now_mono_ns=MONO)
    d = decide(obs, policy)
    assert d.recheck_at_ns is None
    return d.verdict


def test_a_job_in_which_no_rank_moved_for_hang_timeout_is_hung():
    v = hang({0: prog(7, 12.5), 1: prog(5, 12.0), 2: prog(7, 15.0)})
    assert (v.rank, v.cause, v.exit_code) == (1, HANG, HANG_EXIT_CODE)
    assert v.failed_at_ns == WALL - 12 * ONE_S  # when the last rank last moved, by the wall clock
    assert (v.detected_by, v.detected_at_ns, v.pid, v.host) == (0, WALL, 1001, "host-a")
    assert v.detail == "no rank made progress for 12.0s; rank 1 holds the job up (step 5)"
    assert v.laggards == (1,)


def test_the_hang_text_reads_the_silence_in_tenths_of_a_second_rounded():
    assert hang({0: prog(silent_s=12.05)}).detail.startswith("no rank made progress for 12.1s; ")


def test_hang_timeout_is_a_boundary_not_a_suggestion():
    assert hang({0: prog(silent_s=10.0), 1: prog(silent_s=11.0)}).cause == HANG
    # Off is no seconds at all; the shortest timeout there is, 1 ns, is on.
    assert hang({0: prog(silent_s=1.0)}, policy=dataclasses.replace(HANG_POLICY, hang_timeout=HangSetting(seconds=1e-9))).cause == HANG
    assert hang({0: prog(silent_s=1.0)}, policy=dataclasses.replace(HANG_POLICY, hang_timeout=HangSetting())) is None
    assert hang({0: prog(silent_s=10.0 - 1e-9), 1: prog(silent_s=11.0)}) is None


def test_one_rank_moving_means_no_hang_however_long_the_others_wait():
    assert hang({0: prog(silent_s=3600.0), 1: prog(silent_s=3600.0), 2: prog(silent_s=1.0)}) is None


def test_no_hang_detection_without_hang_timeout():
    assert hang({0: prog(silent_s=3600.0)}, policy=POLICY) is None


def test_no_hang_while_any_rank_is_paused():
    assert hang({0: prog(silent_s=60.0), 1: prog(silent_s=60.0, paused=True)}) is None


def test_no_hang_before_any_rank_reported_progress():
    assert hang({0: prog(None, silent_s=60.0), 1: RankState()}).rank == 1
    assert hang({0: RankState()}) is None
    assert hang({}) is None


def test_a_rank_that_finished_neither_holds_the_job_up_nor_keeps_it_alive():
    # Rank 2 wrote its success marker and is still exiting; its last beat was recent, and it
    # is paused. The others have not moved for a minute: they are hung, and rank 2 is not blamed.
    ranks = {0: prog(8, 60.0), 1: prog(8, 61.0), 2: prog(0, 1.0, paused=True)}
    v = hang(ranks, successes={2})
    assert (v.cause, v.rank, v.laggards) == (HANG, 1, (1, 0))


@pytest.mark.parametrize("state", ["T", "t", "D"])
def test_a_frozen_rank_is_the_laggard_before_anything_else(state):
    ranks = {0: prog(1, 20.0, watcher_silent=True), 1: prog(9, 12.0, state=state, in_collective=True)}
    v = hang(ranks)
    assert v.rank == 1
    assert f"its process is {FROZEN_STATES[state]}" in v.detail


def test_a_rank_whose_watcher_went_silent_is_the_laggard_before_one_that_is_not_waiting():
    ranks = {0: prog(1, 20.0, in_collective=False), 1: prog(9, 12.0, watcher_silent=True, in_collective=True),
             2: prog(9, 12.0, in_collective=True)}
    v = hang(ranks)
    assert v.rank == 1
    assert "its watcher cannot run (the GIL is held, e.g. by C code)" in v.detail
    assert "wait for it" not in v.detail


def test_the_rank_the_others_wait_for_in_a_collective_is_the_laggard():
    ranks = {0: prog(9, 12.0, in_collective=True), 1: prog(9, 12.0, in_collective=True),
             2: prog(12, 11.0, where="train.py:41 in load_batch")}
    v = hang(ranks)
    assert v.rank == 2
    assert v.detail.endswith("rank 2 holds the job up (the others wait for it in torch.distributed, step 12, "
                             "at train.py:41 in load_batch)")
    assert v.laggards == (2,)


def test_a_rank_outside_a_collective_is_not_said_to_be_waited_for_when_nobody_waits():
    v = hang({0: prog(3, 12.0), 1: prog(4, 12.0)})
    assert v.rank == 0 and "wait for it" not in v.detail


def test_the_rank_with_the_lowest_step_is_the_laggard_then_the_one_silent_longest():
    assert hang({0: prog(5, 30.0), 1: prog(4, 12.0)}).rank == 1
    assert hang({0: prog(4, 12.0), 1: prog(4, 30.0)}).rank == 1
    assert hang({0: prog(4, 12.0), 1: prog(4, 12.0)}).rank == 0


def test_a_rank_that_never_reported_a_step_is_behind_every_rank_that_did():
    v = hang({0: prog(0, 12.0), 1: prog(None, 12.0)})
    assert v.rank == 1
    assert "it never reported progress" in v.detail


def test_every_rank_as_far_behind_is_named_most_likely_first():
    ranks = {0: prog(7, 12.0), 1: prog(3, 12.0), 2: prog(3, 14.0), 3: prog(3, 13.0, in_collective=True),
             4: prog(3, 16.0)}
    v = hang(ranks)
    assert v.laggards == (4, 2, 1)  # same step, none in a collective: silent longest first
    assert v.rank == 4
    assert v.detail.endswith("; also behind: ranks 2, 1")


def test_a_hang_is_not_judged_while_a_death_is_held_back_and_a_death_beats_it():
    ranks = {0: prog(5, 60.0), 1: prog(5, 60.0), 3: prog(5, 60.0)}
    obs = dataclasses.replace(observed(self_rank=3, registrations=lightning_regs(), gone={2: WALL - 1}, now=WALL),
                              progress=ranks, now_mono_ns=MONO)
    assert decide(obs, HANG_POLICY) == Decision(None, recheck_at_ns=WALL - 1 + WAIT_NS)
    v = decide(dataclasses.replace(obs, now_ns=WALL + WAIT_NS), HANG_POLICY).verdict
    assert (v.rank, v.cause) == (2, VANISHED)


# -- rule: a silent host is lost (judged by peerwatch.hosts.hosts.Liveness: its record is a failure) --------

PEER_S = 30 * ONE_S


def two_hosts(n_remote: int = 2) -> Dict[int, Registration]:
    """Ranks 0, 1 on host-a (this host); ranks 2.. on host-b."""
    regs = {r: reg(r) for r in range(2)}
    for r in range(2, 2 + n_remote):
        regs[r] = dataclasses.replace(reg(r), host="host-b", boot_id="boot-b")
    return regs


def lost_record(rank: int, t: int) -> Failure:
    return failure(rank, t=t, cause=LOST, exception=None, message="host host-b lost: no heartbeat of rank 2 for 31.0s "
                   "(...)", traceback=None, exit_code=7)


def test_a_lost_record_is_the_verdict_with_its_message():
    d = decide(observed(now=WALL, registrations=two_hosts(), failures=[lost_record(2, WALL - 31 * ONE_S)]), POLICY)
    assert (d.verdict.rank, d.verdict.cause, d.verdict.exit_code, d.verdict.host) == (2, LOST, 7, "host-b")
    assert d.verdict.detail == "host host-b lost: no heartbeat of rank 2 for 31.0s (...)"


def test_an_earlier_failure_is_the_cause_not_a_rank_lost_since():
    failures = [failure(1, t=WALL - 2 * PEER_S), lost_record(2, WALL - PEER_S)]
    d = decide(observed(now=WALL, registrations=two_hosts(), failures=failures), POLICY)
    assert (d.verdict.rank, d.verdict.cause) == (1, EXCEPTION)


# -- rules: the diagnosis is the verdict, victims are not blamed ----------------------------------

AUTO = dataclasses.replace(POLICY, hang_timeout=HangSetting(auto=True))
STALLED_AT = 5_000_000_000
DIAGNOSED_AT = 8_000_000_000


def diagnosis(laggards: Tuple[int, ...] = (2,), resolved_ns: Optional[int] = None) -> Diagnosis:
    return Diagnosis(
        finding=HANG, laggards=laggards, entered=(0, 1, 3), since_ns=3_000_000_000, stalled_at_ns=STALLED_AT,
        time_ns=DIAGNOSED_AT, made_by=0, detail="rank 2 never entered all_reduce #7", resolved_ns=resolved_ns,
    )


def diagnosed(d: Optional[Diagnosis] = None, **kw: Any) -> Observed:
    return dataclasses.replace(observed(**kw), diagnosis=diagnosis() if d is None else d)


def test_a_current_diagnosis_is_the_verdict_under_hang_auto():
    v = decide(diagnosed(), AUTO).verdict
    assert v is not None
    assert (v.rank, v.pid, v.cause, v.exit_code, v.failed_at_ns) == (2, 1002, HANG, HANG_EXIT_CODE, STALLED_AT)
    assert (v.detail, v.laggards, v.detected_by) == ("rank 2 never entered all_reduce #7", (2,), 0)


def test_the_first_laggard_is_named():
    v = decide(diagnosed(diagnosis(laggards=(3, 1))), AUTO).verdict
    assert v is not None and v.rank == 3 and v.laggards == (3, 1)


@pytest.mark.parametrize("d", [diagnosis(resolved_ns=9_000_000_000), diagnosis(laggards=())],
                         ids=["resolved", "no-laggard"])
def test_a_diagnosis_that_is_over_or_names_nobody_is_no_verdict(d):
    assert decide(diagnosed(d), AUTO).verdict is None


def test_a_diagnosis_is_no_verdict_without_hang_auto_or_once_its_laggard_finished():
    assert decide(diagnosed(), POLICY).verdict is None
    assert decide(diagnosed(successes=[2]), AUTO).verdict is None


def test_a_busy_laggard_is_ended_only_from_the_diagnosis_end_on_and_the_detail_says_after_how_long():
    """hang_timeout=auto ends busy laggards near the collective timeout (end_at_ns), not at once."""
    end = STALLED_AT + 90_500_000_001  # seconds are rounded: 90.5 s and a nanosecond is 91 s
    busy = dataclasses.replace(diagnosis(), finding=BUSY, end_at_ns=end)
    assert decide(diagnosed(busy, now=end - 1), AUTO) == Decision(None, recheck_at_ns=end)
    v = decide(diagnosed(busy, now=end), AUTO).verdict
    assert v is not None and (v.rank, v.cause, v.failed_at_ns, v.detected_at_ns) == (2, HANG, STALLED_AT, end)
    assert v.detail == ("rank 2 never entered all_reduce #7; ended by hang_timeout=auto after 91s,"
                        " before the collective timeout")
    # A stuck laggard's diagnosis (a hang) says nothing of the kind.
    v = decide(diagnosed(dataclasses.replace(diagnosis(), end_at_ns=end), now=end), AUTO).verdict
    assert v is not None and v.detail == "rank 2 never entered all_reduce #7"


def _victim(first: Observed) -> Optional[Verdict]:
    return decide(first, AUTO).verdict


def test_a_rank_failing_in_a_collective_after_the_diagnosis_is_its_victim():
    f = failure(1, DIAGNOSED_AT + 1_000_000, collective=True, message="Connection closed by peer")
    v = _victim(diagnosed(failures=[f]))
    assert v is not None and (v.rank, v.cause, v.exit_code, v.failed_at_ns) == (2, HANG, HANG_EXIT_CODE, STALLED_AT)
    assert v.laggards == (2,) and v.detail.startswith("rank 2 never entered all_reduce #7; rank 1 then failed")
    assert "a consequence" in v.detail


def test_a_victim_at_the_moment_of_the_diagnosis_is_still_one_and_before_it_is_not():
    at = failure(1, DIAGNOSED_AT, collective=True)
    v = _victim(diagnosed(failures=[at]))
    assert v is not None and v.rank == 2
    before = failure(1, DIAGNOSED_AT - 1, collective=True)
    v = _victim(diagnosed(failures=[before]))
    assert v is not None and (v.rank, v.cause) == (1, EXCEPTION)


def test_an_exception_outside_a_collective_is_its_own_cause():
    v = _victim(diagnosed(failures=[failure(1, DIAGNOSED_AT + 1)]))
    assert v is not None and (v.rank, v.cause) == (1, EXCEPTION)


def test_the_laggard_failing_itself_is_named_with_its_own_cause():
    v = _victim(diagnosed(failures=[failure(2, DIAGNOSED_AT + 1, collective=True)]))
    assert v is not None and (v.rank, v.cause) == (2, EXCEPTION)


@pytest.mark.parametrize(("returncode", "victim"), [(-6, True), (134, True), (-9, False), (135, False), (1, False)],
                         ids=["SIGABRT", "exit-134", "SIGKILL", "exit-135", "exit-1"])
def test_nccls_abort_is_a_victims_death_other_deaths_are_causes(returncode, victim):
    """NCCL's watchdog aborts the process at the collective timeout: SIGABRT, or 134
    through a shell. Any other death is its own cause."""
    v = _victim(diagnosed(statuses=[status(1, DIAGNOSED_AT + 1, returncode)]))
    assert v is not None
    assert (v.rank == 2 and v.cause == HANG) if victim else (v.rank == 1 and v.cause != HANG)


def test_a_victims_detail_says_how_it_died():
    v = _victim(diagnosed(statuses=[status(1, DIAGNOSED_AT + 1, -6)]))
    assert v is not None and "rank 1 then failed waiting for it (killed by SIGABRT" in v.detail


def test_a_resolved_diagnosis_has_no_victims():
    f = failure(1, DIAGNOSED_AT + 1, collective=True)
    v = _victim(diagnosed(diagnosis(resolved_ns=DIAGNOSED_AT), failures=[f]))
    assert v is not None and (v.rank, v.cause) == (1, EXCEPTION)


def test_the_documented_windows_have_their_documented_values():
    """The windows the tests above compute from, as verdict/decide.py's comments state them (1 s,
    0.5 s, 15 s), and the frozen states' words users read in a hang's detail."""
    assert (CONSEQUENCE_WINDOW_NS, COLLECTIVE_SETTLE_NS, LEAVING_WAIT_NS) == (10**9, 5 * 10**8, 15 * 10**9)
    assert FROZEN_STATES == {"T": "stopped (SIGSTOP)", "t": "stopped by a debugger", "D": "in uninterruptible sleep (I/O)"}


# -- the policy and the hang settings, from Config (issue 25.4) --------------------------


def _config(**options: Any) -> Any:
    from peerwatch.core.config import Config

    return Config.resolve(options, env={})


@pytest.mark.parametrize(("hang_timeout", "seconds", "auto"), [
    (None, None, False), (0, None, False), ("0", None, False),  # off (hang_timeout's word for it is 0)
    ("auto", None, True), (" AUTO ", None, True),  # the diagnosis's learnt threshold
    (12.5, 12.5, False), ("7", 7.0, False),  # seconds
])
def test_policy_from_config_takes_hang_timeout_as_parsed(hang_timeout: Any, seconds: Optional[float], auto: bool):
    p = Policy.from_config(_config(hang_timeout=hang_timeout))
    assert p.hang_timeout == HangSetting(auto=auto, seconds=seconds)


def test_policy_from_config_sets_every_field():
    assert {f.name for f in dataclasses.fields(Policy)} == {  # a new field: set it in from_config, test it here
        "parent_wait_ns", "default_exit_code", "hang_timeout", "collective_settle_ns"}
    c = _config(parent_wait=0.25, exit_code=7, hang_timeout=30, peer_timeout=45)
    assert Policy.from_config(c) == Policy(parent_wait_ns=250_000_000, default_exit_code=7,
                                           hang_timeout=HangSetting(seconds=30.0),
                                           collective_settle_ns=COLLECTIVE_SETTLE_NS)
    # A job that spans hosts gives a collective exception longer to turn out an echo
    # (rule: a collective exception settles).
    assert Policy.from_config(c, other_hosts=True).collective_settle_ns == REMOTE_SETTLE_NS == 2 * 10**9


def test_a_collective_exception_waits_longer_for_an_echo_where_the_job_spans_hosts():
    # Rank 1's all_reduce failed at t=1 s; rank 2 (on another host) died and its host's
    # verdict is slow to come: at 1.6 s one host judges, the multi-host policy waits.
    obs = observed(failures=[failure(1, t=10**9, collective=True)], now=16 * 10**8)
    assert decide(obs, POLICY).verdict is not None
    remote = dataclasses.replace(POLICY, collective_settle_ns=REMOTE_SETTLE_NS)
    d = decide(obs, remote)
    assert d.verdict is None and d.recheck_at_ns == 10**9 + REMOTE_SETTLE_NS, d
    assert Policy.from_config(_config()) == Policy(parent_wait_ns=100_000_000, default_exit_code=1,
                                                   hang_timeout=HangSetting())


@pytest.mark.parametrize(("hang_timeout", "hang_warn", "expected"), [
    # (hang_timeout on, diagnoses_hangs, hang_warn seconds, hang_timeout auto, reads_collectives)
    (None, None, (False, True, None, False, True)),  # the defaults: a learnt diagnosis that only warns
    ("0", "off", (False, False, None, False, False)),  # nothing about hangs: torch's counters unread
    ("auto", "off", (True, True, None, True, True)),  # auto needs the diagnosis, whatever hang_warn says
    ("auto", "12", (True, True, 12.0, True, True)),
    ("30", "off", (True, False, None, False, True)),  # beat() and the counters as progress, no diagnosis
    (0, "12", (False, True, 12.0, False, True)),
])
def test_what_the_hang_settings_judge_by(hang_timeout: Any, hang_warn: Any, expected: Tuple[Any, ...]):
    c = _config(hang_timeout=hang_timeout, hang_warn=hang_warn)
    assert (c.hang_timeout.on, c.diagnoses_hangs, c.hang_warn.seconds, c.hang_timeout.auto, c.reads_collectives) == expected


# -- rule: interrupts are not failures -----------------------------------------------------


def interrupt(rank: int, t: int, sender: Optional[int] = None) -> Failure:
    """Rank's KeyboardInterrupt, as the hooks record it: the SIGINT and who sent it."""
    return failure(rank, t, exit_code=130, exception="KeyboardInterrupt", message="", signal="SIGINT",
                   signalled_by=sender)


def test_every_rank_interrupted_by_the_same_sigint_is_an_interrupted_job_not_a_failure():
    # Ctrl-C: the terminal sends SIGINT to the whole process group (no sender pid).
    obs = observed(failures=[interrupt(r, 1_000 + r) for r in range(4)], now=2_000)
    v = decide(obs, POLICY).verdict
    assert v is not None and (v.cause, v.exit_code, v.signal, v.signalled_by) == (INTERRUPTED, 130, "SIGINT", None), v
    assert v.detail == "SIGINT from outside the job; all 4 ranks got it, none failed", v
    assert v.failed_at_ns == 1_000 and v.rank == 0  # the first to get it: named, not blamed


def test_every_rank_sigtermed_by_the_same_outsider_is_an_interrupted_job():
    # kill -TERM -PGID (or a scheduler): each rank's own exit record says SIGTERM and who sent it.
    obs = observed(statuses=[status(r, 500 + r, -15, sender=4242) for r in range(4)], now=600)
    v = decide(obs, POLICY).verdict
    assert v is not None and (v.cause, v.exit_code, v.signal, v.signalled_by) == (INTERRUPTED, 143, "SIGTERM", 4242), v
    assert v.detail == "SIGTERM from outside the job, pid 4242; all 4 ranks got it, none failed", v


def test_a_launcher_passing_a_sigterm_on_to_every_worker_is_an_interrupted_job():
    # torchrun's agent got SIGTERM and stops every worker with one: the job was stopped, not failed.
    regs = {r: reg(r, ppid=77) for r in range(4)}
    obs = observed(registrations=regs, statuses=[status(r, 500 + r, -15, sender=77) for r in range(4)], now=600)
    v = decide(obs, POLICY).verdict
    assert v is not None and v.cause == INTERRUPTED, v
    assert v.detail.startswith("SIGTERM from outside the job, through the launcher, pid 77;"), v


@pytest.mark.parametrize("how", ["sigint", "sigterm"])
def test_one_rank_interrupted_alone_waits_for_the_others_then_is_blamed(how: str):
    """A signal to one rank only (kill -TERM PID) is that rank's failure: the decision waits
    INTERRUPT_WINDOW_NS for the other ranks to show the same signal, then blames it."""
    kw: Dict[str, Any] = {"failures": [interrupt(1, 1_000)]} if how == "sigint" else {
        "statuses": [status(1, 1_000, -15, sender=4242)]}
    assert decide(observed(now=1_001, **kw), POLICY) == Decision(None, recheck_at_ns=1_000 + INTERRUPT_WINDOW_NS)
    v = decide(observed(now=1_000 + INTERRUPT_WINDOW_NS, **kw), POLICY).verdict
    assert v is not None and v.rank == 1 and v.cause == (EXCEPTION if how == "sigint" else SIGNAL), v
    assert v.exit_code == (130 if how == "sigint" else 143), v


def test_a_sigint_passed_on_by_a_launcher_is_the_same_interrupt():
    # Ctrl-C reaches torchrun's workers from the terminal and again from their agent (pid 77):
    # whichever came first, it is one interrupt. A SIGTERM must come from one sender.
    regs = {r: reg(r, ppid=77) for r in range(4)}
    obs = observed(registrations=regs, failures=[interrupt(r, 1_000 + r, sender=77 if r % 2 else None) for r in range(4)],
                   now=2_000)
    v = decide(obs, POLICY).verdict
    assert v is not None and (v.cause, v.signalled_by) == (INTERRUPTED, None), v


def test_ranks_whose_watcher_saw_the_sigint_arrive_got_it_too():
    """Rank 0 raised KeyboardInterrupt; ranks 1-3 wait in a collective for it, their main
    threads in C, unable to raise: their watchers saw the SIGINT arrive (an interrupt record,
    not a failure). Only one within the window counts: an old Ctrl-C, caught and gone on
    from, is no evidence of this one."""
    seen = {r: Interrupt(rank=r, pid=1000 + r, time_ns=1_000 + r, signal="SIGINT") for r in (1, 2, 3)}
    obs = dataclasses.replace(observed(failures=[interrupt(0, 1_000)], now=1_500), interrupts=seen)
    v = decide(obs, POLICY).verdict
    assert v is not None and (v.rank, v.cause, v.exit_code) == (0, INTERRUPTED, 130), v
    assert v.detail.endswith("all 4 ranks got it, none failed"), v
    seen[3] = Interrupt(rank=3, pid=1003, time_ns=1_000 - INTERRUPT_WINDOW_NS - 1, signal="SIGINT")
    obs = dataclasses.replace(obs, interrupts=seen)
    assert decide(obs, POLICY) == Decision(None, recheck_at_ns=1_000 + INTERRUPT_WINDOW_NS)
    v = decide(dataclasses.replace(obs, now_ns=1_000 + INTERRUPT_WINDOW_NS), POLICY).verdict
    assert v is not None and (v.rank, v.cause) == (0, EXCEPTION), v


def test_a_rank_that_finished_need_not_get_the_signal():
    obs = observed(successes={3}, failures=[interrupt(r, 1_000) for r in range(3)], now=1_001)
    v = decide(obs, POLICY).verdict
    assert v is not None and v.cause == INTERRUPTED, v


def test_a_sigterm_sent_by_a_rank_is_a_teardown_not_an_interrupt():
    # pid 1000 is rank 0's: peerwatch's own SIGTERM, never taken for one from outside.
    obs = observed(statuses=[status(r, 500, -15, sender=1000) for r in range(1, 4)], gone={0: 400}, now=10**12)
    v = decide(obs, POLICY).verdict
    assert v is not None and v.cause != INTERRUPTED, v


@pytest.mark.parametrize("other", ["sender", "failure", "signal"])
def test_anything_but_one_signal_from_one_sender_is_judged_as_before(other: str):
    # Rank 2 was SIGTERMed from outside; its launcher (pid 77) then stopped the others: a
    # failure of rank 2, not an interrupt. Likewise with another failure among them, or
    # with ranks that got different signals.
    regs = {r: reg(r, ppid=77) for r in range(4)}
    statuses = [status(r, 600 + r, -15, sender=77) for r in (0, 1, 3)] + [status(2, 500, -15, sender=4242)]
    failures: List[Failure] = []
    if other == "failure":
        statuses = [status(r, 500 + r, -15, sender=4242) for r in (0, 1, 3)]
        failures = [failure(2, t=400)]
    if other == "signal":
        statuses = [status(r, 500 + r, -15, sender=4242) for r in (0, 1, 3)]
        failures = [interrupt(2, 400, sender=4242)]
    v = decide(observed(registrations=regs, statuses=statuses, failures=failures, now=10**12), POLICY).verdict
    assert v is not None and v.cause != INTERRUPTED, v
    assert v.rank == (2 if other == "sender" else 0), v  # else: a death outranks an exception just before it
