"""The diagnosis of a stuck job (peerwatch.hangs.diagnose) and the verdict rules that use it
(peerwatch.verdict.decide; rules: the diagnosis is the verdict, victims are not blamed): pure, no process."""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peerwatch.core.config import HangSetting
from peerwatch.core.records import BUSY, EXCEPTION, HANG, HANG_EXIT_CODE, MISMATCH, Diagnosis, Failure, Registration
from peerwatch.hangs.diagnose import (
    BUSY_END_FRACTION,
    CAP_FRACTION,
    FACTOR,
    FLOOR_S,
    STUCK_S,
    STUCK_SAMPLES,
    WARMUP_GAPS,
    RankState,
    Summary,
    Threshold,
    busy_evidence,
    diagnose,
    remote_ranks,
    summarize,
)
from peerwatch.proc.activity import Activity
from peerwatch.verdict.decide import Observed, Policy, decide

pytestmark = pytest.mark.pure

S = 1_000_000_000
NOW = 100 * S
AR = "gloo:all_reduce"
F4 = "[[4]] Float"


def rank(seq: int, *, moved: Optional[int] = NOW - 10 * S, entered: Tuple[Tuple[int, str, str], ...] = (),
         **kw: object) -> RankState:
    """A rank whose last collective of group "0" is ``seq``; ``entered``: (seq, op, shape)."""
    return RankState(collectives=(("0", seq, seq - 1),), entered=tuple(("0", q, op, sh) for q, op, sh in entered),
                     moved_mono_ns=moved, **kw)  # type: ignore[arg-type]


def tail(last: int, op: str = AR, shape: str = F4) -> Tuple[Tuple[int, str, str], ...]:
    return tuple((q, op, shape) for q in range(last - 2, last + 1))


def test_a_rank_behind_is_the_laggard_and_the_others_entered():
    ranks = {0: rank(21, entered=tail(21)), 1: rank(20, entered=tail(20), where="train.py:9 in step"),
             2: rank(21, entered=tail(21))}
    d = diagnose(ranks, NOW, 5 * S)
    assert d is not None
    assert (d.kind, d.laggards, d.entered, d.group, d.seq, d.op) == (HANG, (1,), (0, 2), "0", 21, AR)
    assert d.since_ns == 10 * S
    assert "rank 1 never entered gloo:all_reduce #21" in d.detail and "train.py:9 in step" in d.detail


def test_nothing_before_the_threshold():
    ranks = {0: rank(21), 1: rank(20)}
    assert diagnose(ranks, NOW, 10 * S + 1) is None
    assert diagnose(ranks, NOW, 10 * S) is not None


def test_the_latest_movement_of_any_rank_counts_beats_included():
    ranks = {0: rank(21), 1: rank(20, beat_mono_ns=NOW - S)}
    assert diagnose(ranks, NOW, 5 * S) is None


def test_no_diagnosis_while_a_rank_is_paused():
    assert diagnose({0: rank(21), 1: rank(20, paused=True)}, NOW, 5 * S) is None


def test_no_diagnosis_without_counters_ranks_that_never_imported_torch():
    ranks = {0: RankState(beat_mono_ns=NOW - 50 * S), 1: RankState()}
    assert diagnose(ranks, NOW, 5 * S) is None


def test_everyone_at_the_same_collective_agreeing_is_nothing_to_name():
    """Evaluation or checkpointing on every rank, between collectives."""
    ranks = {r: rank(21, entered=tail(21)) for r in range(3)}
    assert diagnose(ranks, NOW, 5 * S) is None


def test_a_frozen_rank_is_the_laggard_even_inside_the_collective():
    ranks = {0: rank(21), 1: rank(21, state="T"), 2: rank(21)}
    d = diagnose(ranks, NOW, 5 * S)
    assert d is not None and d.laggards == (1,) and "stopped (SIGSTOP)" in d.detail


def test_an_other_op_at_the_same_seq_is_a_mismatch_naming_the_odd_rank():
    """A rank that skipped one all_reduce reaches the final barrier while the others do
    their last all_reduce: the same sequence number, another op."""
    ranks = {0: rank(30, entered=tail(30)), 2: rank(30, entered=tail(30)),
             1: rank(30, entered=tail(29) + ((30, "gloo:barrier", ""),))}
    d = diagnose(ranks, NOW, 5 * S)
    assert d is not None
    assert (d.kind, d.laggards, d.entered, d.seq, d.op) == (MISMATCH, (1,), (0, 2), 30, AR)
    assert "gloo:barrier" in d.detail


def test_other_sizes_at_a_seq_one_rank_went_past_is_a_mismatch():
    """gloo completes the smaller all_reduce on its rank: it moves on to the next one."""
    odd = tail(21)[:-2] + ((21, AR, "[[1]] Float"), (22, AR, F4))
    ranks = {0: rank(21, entered=tail(21)), 1: rank(22, entered=odd), 2: rank(21, entered=tail(21))}
    d = diagnose(ranks, NOW, 5 * S)
    assert d is not None and (d.kind, d.laggards, d.seq) == (MISMATCH, (1,), 21), d


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.integers(0, 7), st.integers(1, 50), min_size=1, max_size=8), st.integers(0, 20))
def test_laggards_are_exactly_the_ranks_behind(seqs: Dict[int, int], since_s: int):
    ranks = {r: rank(q, moved=NOW - since_s * S) for r, q in seqs.items()}
    d = diagnose(ranks, NOW, 5 * S)
    top = max(seqs.values())
    behind = {r for r, q in seqs.items() if q < top}
    if since_s < 5 or not behind:
        assert d is None
    else:
        assert d is not None and set(d.laggards) == behind and set(d.entered) == set(seqs) - behind


# -- the threshold ------------------------------------------------------------------


def test_threshold_is_the_floor_before_the_warmup_then_five_times_the_longest_interval():
    """Before the job's rhythm is learnt, a minute (an early hang is diagnosed in about a
    minute, not at half the collective timeout); busy laggards are not ended then (rule: busy or stuck)."""
    t = Threshold()
    timeout_ms = 1_800_000  # gloo's default: 30 min
    t.observe(0)
    for i in range(1, WARMUP_GAPS):
        t.observe(i * 20 * S)
    assert t.value_ns(timeout_ms) == int(FLOOR_S * S)
    assert t.value_ns(20_000) == int(20_000 * 1e6 * CAP_FRACTION)  # a short collective timeout: its half
    t.observe(WARMUP_GAPS * 20 * S)
    assert t.value_ns(timeout_ms) == FACTOR * 20 * S


def test_threshold_never_below_the_floor_nor_above_the_cap():
    t = Threshold()
    for i in range(WARMUP_GAPS + 1):
        t.observe(i * S // 10)
    assert t.value_ns(1_800_000) == int(FLOOR_S * S)
    assert t.value_ns(10_000) == 5 * S  # a 10 s collective timeout: half of it


def test_a_slow_phase_once_over_raises_the_threshold():
    t = Threshold()
    for i in range(WARMUP_GAPS + 1):
        t.observe(i * S)
    t.observe((WARMUP_GAPS + 100) * S)  # a 100 s checkpoint, then the job moved again
    assert t.value_ns(1_800_000) == FACTOR * 100 * S


def test_a_fixed_hang_warn_is_used_as_it_is():
    assert Threshold(fixed_s=7.0).value_ns(10_000) == 7 * S


# -- decide: hang_timeout=auto and victims ---------------------------------------------


def reg(r: int) -> Registration:
    return Registration(rank=r, pid=1000 + r, ppid=1, start_ticks=1, uid=1, host="h", boot_id="b", pidns="p", time_ns=1)


DIAG = Diagnosis(finding=HANG, laggards=(1,), entered=(0, 2), since_ns=5 * S, stalled_at_ns=40 * S, time_ns=45 * S,
                 made_by=0, detail="rank 1 never entered gloo:all_reduce #21", group="0", seq=21, op=AR)


def obs(diagnosis: Optional[Diagnosis] = DIAG, failures: Tuple[Failure, ...] = (), now: int = 60 * S) -> Observed:
    return Observed(self_rank=0, now_ns=now, registrations={r: reg(r) for r in range(3)}, successes=frozenset(),
                    failures={f.rank: f for f in failures}, exit_statuses={}, gone={}, diagnosis=diagnosis,
                    progress={r: RankState() for r in range(3)})


def timeout_failure(r: int, t: int = 55 * S, collective: bool = True) -> Failure:
    return Failure(rank=r, pid=1000 + r, time_ns=t, cause=EXCEPTION, exit_code=1, exception="RuntimeError",
                   message="Timed out waiting 10000ms for recv operation to complete", collective=collective)


POLICY = Policy(parent_wait_ns=S // 10, default_exit_code=1)


def test_a_victim_of_the_collective_timeout_is_not_blamed():
    v = decide(obs(failures=(timeout_failure(0),)), POLICY).verdict
    assert v is not None
    assert (v.rank, v.cause, v.exit_code, v.laggards) == (1, HANG, HANG_EXIT_CODE, (1,))
    assert "rank 0 then failed waiting for it" in v.detail


def test_without_a_diagnosis_the_timeout_is_the_verdict_as_before():
    v = decide(obs(diagnosis=None, failures=(timeout_failure(0),)), POLICY).verdict
    assert v is not None and (v.rank, v.cause) == (0, EXCEPTION)


def test_a_resolved_diagnosis_blames_nobody():
    resolved = dataclasses.replace(DIAG, resolved_ns=50 * S)
    v = decide(obs(diagnosis=resolved, failures=(timeout_failure(0),)), POLICY).verdict
    assert v is not None and (v.rank, v.cause) == (0, EXCEPTION)


def test_an_exception_not_from_torch_distributed_is_its_own_cause():
    v = decide(obs(failures=(timeout_failure(0, collective=False),)), POLICY).verdict
    assert v is not None and (v.rank, v.cause) == (0, EXCEPTION)


def test_the_laggard_failing_itself_is_the_verdict():
    v = decide(obs(failures=(timeout_failure(1),)), POLICY).verdict
    assert v is not None and (v.rank, v.cause) == (1, EXCEPTION)


def test_an_nccl_watchdog_abort_after_a_diagnosis_is_a_victim_too():
    from peerwatch.core.records import ExitStatus

    o = dataclasses.replace(obs(), exit_statuses={2: ExitStatus(rank=2, pid=1002, time_ns=55 * S, returncode=-6,
                                                                observed_by=0)})
    v = decide(o, POLICY).verdict
    assert v is not None and (v.rank, v.cause) == (1, HANG), v


def test_hang_timeout_auto_makes_the_diagnosis_the_verdict():
    assert decide(obs(), POLICY).verdict is None  # by default a diagnosis only warns
    v = decide(obs(), dataclasses.replace(POLICY, hang_timeout=HangSetting(auto=True))).verdict
    assert v is not None and (v.rank, v.cause, v.failed_at_ns, v.laggards) == (1, HANG, 40 * S, (1,))


# -- configuration -------------------------------------------------------------------


AUTO, OFF = HangSetting(auto=True), HangSetting()


@pytest.mark.parametrize(("raw", "value"), [("auto", AUTO), ("AUTO", AUTO), ("off", OFF), ("0", OFF),
                                            ("12.5", HangSetting(seconds=12.5))])
def test_hang_warn_takes_seconds_auto_or_off(raw: str, value: HangSetting):
    from peerwatch.core.config import Config

    assert Config.resolve({}, env={"PEERWATCH_HANG_WARN": raw}).hang_warn == value


def test_hang_warn_is_learnt_by_default_and_hang_timeout_takes_auto():
    from peerwatch.core.config import Config

    assert Config.resolve({}, env={}).hang_warn == AUTO
    assert Config.resolve({"hang_timeout": "auto"}, env={}).hang_timeout == AUTO
    assert Config.resolve({}, env={}).hang_timeout == OFF


@pytest.mark.parametrize("raw", ["sometimes", "-3", "inf"])
def test_a_bad_hang_warn_names_its_source(raw: str):
    from peerwatch.core.config import Config
    from peerwatch.core.errors import ConfigError

    with pytest.raises(ConfigError, match="hang_warn"):
        Config.resolve({}, env={"PEERWATCH_HANG_WARN": raw})


# -- rule: busy or stuck --------------------------------------------------------------

SPAN_MS = 7_000


def act(cpu_ms: int = 0, io_bytes: int = 0, children_cpu_ms: int = 0, places: int = 1, samples: int = 7,
        other_cpu_ms: int = 0, main_io_bytes: int = 0) -> Activity:
    return Activity(span_ms=SPAN_MS, cpu_ms=cpu_ms, places=places, other_cpu_ms=other_cpu_ms, io_bytes=io_bytes,
                    children_cpu_ms=children_cpu_ms, samples=samples, main_io_bytes=main_io_bytes)


@pytest.mark.parametrize("activity, busy", [
    (act(), False),  # blocked on a lock, asleep: no CPU, no bytes
    (act(cpu_ms=7_000, places=2), True),  # a long op, or spinning on the same lines: nobody can tell
    (act(cpu_ms=7_000, places=7), True),  # evaluating in Python: its stack moves
    (act(cpu_ms=3_000, places=2, other_cpu_ms=4_000), True),  # evaluating a model: torch's threads compute
    (act(cpu_ms=7_000, places=1, other_cpu_ms=100), True),  # one C call on the CPU (cdist, a GPU sync spinning)
    (act(cpu_ms=200, places=7), False),  # a few short wake-ups: under 5 % of the time
    (act(other_cpu_ms=100), False),  # gloo's loop waking while the rank is blocked
    (act(cpu_ms=5_000, places=1, io_bytes=300_000_000), True),  # writing a checkpoint
    (act(io_bytes=20_000), False),  # another thread polling a store, a logger: a few bytes a second
    (act(io_bytes=20, main_io_bytes=20), True),  # the main thread reading a trickle: a few bytes a second
    (act(children_cpu_ms=14_000), True),  # waiting for data loader workers that work
    (act(children_cpu_ms=100), False),  # idle workers
    (act(cpu_ms=3_000, places=3, samples=3), True),  # a short window
    (act(cpu_ms=3_000, places=1, samples=3), True),
])
def test_busy_or_stuck_from_the_signs_of_work(activity: Activity, busy: bool):
    assert bool(busy_evidence(RankState(activity=activity))) is busy


@pytest.mark.parametrize("places", [1, 2, 3])
def test_a_main_thread_on_a_cpu_is_busy_at_however_few_places(places: int):
    """A rank evaluating alone in one torch op (cdist, a Linear's forward, OMP_NUM_THREADS=1)
    or in a Python loop is seen at one to three places: before, under four places was "one
    loop", stuck, and hang_timeout=auto ended the job that computed."""
    evidence = busy_evidence(RankState(activity=act(cpu_ms=6_930, places=places, samples=8)))
    assert evidence and f"99% of the time, at {places} place" in evidence, evidence


def test_a_slow_read_by_the_main_thread_is_busy_and_says_its_bytes():
    """A few bytes a second moved by the main thread: before, under 256 kB was nothing."""
    evidence = busy_evidence(RankState(activity=act(io_bytes=21, main_io_bytes=21)))
    assert evidence == "21 B read or written by its main thread in the last 7s", evidence


def test_too_few_samples_to_tell_and_no_samples_at_all():
    assert busy_evidence(RankState(activity=act(samples=2))) is None  # wait for more
    assert busy_evidence(RankState(activity=None)) == ""  # a rank that publishes none: judged as before
    busy = act(cpu_ms=7_000, places=7, io_bytes=10**9)
    assert busy_evidence(RankState(activity=busy, state="T")) == ""  # stopped: whatever it did before
    assert busy_evidence(RankState(activity=busy, watcher_silent=True)) == ""


def test_a_busy_laggard_is_reported_busy_with_its_evidence_and_an_end_near_the_timeout():
    ranks = {0: rank(20, activity=act(cpu_ms=6_000, io_bytes=300_000_000), where="train.py:40 in save"),
             1: rank(21), 2: rank(21)}
    d = diagnose(ranks, NOW, 5 * S, timeout_ms=1_800_000)
    assert d is not None
    assert (d.kind, d.laggards, d.busy) == (BUSY, (0,), (0,)), d
    assert "rank 0 is busy, not stuck" in d.detail and "300.0 MB read or written" in d.detail, d.detail
    assert d.end_after_ns == int(BUSY_END_FRACTION * 1_800 * S)


def test_a_laggard_that_does_not_work_is_a_hang_ended_at_once():
    ranks = {0: rank(20, activity=act(cpu_ms=100, other_cpu_ms=100, io_bytes=1_000)), 1: rank(21), 2: rank(21)}
    d = diagnose(ranks, NOW, 5 * S, timeout_ms=1_800_000)
    assert d is not None and (d.kind, d.laggards, d.busy, d.end_after_ns) == (HANG, (0,), (), 0), d


def test_a_laggard_with_too_few_samples_is_waited_for():
    ranks = {0: rank(20, activity=act(samples=2)), 1: rank(21)}
    assert diagnose(ranks, NOW, 5 * S) is None


def test_uninterruptible_sleep_with_bytes_moving_is_busy_not_frozen():
    writing = act(io_bytes=50_000_000)
    d = diagnose({0: rank(20, state="D", activity=writing), 1: rank(21)}, NOW, 5 * S)
    assert d is not None and d.kind == BUSY and "uninterruptible" not in d.detail, d
    d = diagnose({0: rank(20, state="D", activity=act()), 1: rank(21)}, NOW, 5 * S)
    assert d is not None and d.kind == HANG and "uninterruptible" in d.detail, d


def _busy_diagnosis(end_at_ns: Optional[int]) -> Diagnosis:
    return Diagnosis(finding=BUSY, laggards=(0,), entered=(1,), since_ns=60 * S, stalled_at_ns=NOW - 60 * S,
                     time_ns=NOW - S, made_by=1, detail="rank 0 is busy", end_at_ns=end_at_ns)


def test_auto_ends_a_busy_laggard_only_at_its_end():
    regs = {r: Registration(rank=r, pid=100 + r, ppid=1, start_ticks=1, uid=0, host="h", boot_id="b", pidns="p",
                            time_ns=0) for r in (0, 1)}
    policy = Policy(parent_wait_ns=S, default_exit_code=1, hang_timeout=HangSetting(auto=True))

    def at(now: int, end: Optional[int]):
        obs = Observed(self_rank=1, now_ns=now, registrations=regs, successes=set(), failures={}, exit_statuses={},
                       gone={}, diagnosis=_busy_diagnosis(end))
        return decide(obs, policy)

    early = at(NOW, NOW + 100 * S)
    assert early.verdict is None and early.recheck_at_ns == NOW + 100 * S
    late = at(NOW + 100 * S, NOW + 100 * S)
    assert late.verdict is not None and (late.verdict.rank, late.verdict.cause) == (0, HANG)
    assert "before the collective timeout" in late.verdict.detail
    assert at(NOW, None).verdict is not None  # a record from before end_at_ns: at once, as then


# -- the documented numbers, the rules' edges and the texts users read (issue 25.8) ----------


def test_the_documented_constants_have_the_documented_values():
    """docs/hangs.md ("The threshold", "Busy or stuck") and README.md state these numbers; the
    tests above compute their expectations from the constants, so a change shows here."""
    from peerwatch.hangs import diagnose as _diagnose

    assert (FACTOR, WARMUP_GAPS, FLOOR_S, CAP_FRACTION, _diagnose.DEFAULT_CAP_S) == (5, 10, 60.0, 0.5, 300.0)
    assert BUSY_END_FRACTION == 0.9 and _diagnose.ASSUMED_TIMEOUT_S == 600.0
    assert (_diagnose.BUSY_SAMPLES, _diagnose.BUSY_CPU_SHARE, _diagnose.BUSY_MAIN_IO_BYTES, _diagnose.BUSY_OTHER_SHARE,
            _diagnose.BUSY_IO_BYTES, _diagnose.BUSY_CHILDREN_SHARE) == (3, 0.05, 1, 0.10, 256 * 1024, 0.10)


def test_ranks_that_read_their_entries_at_different_beats_are_no_mismatch_and_no_crash():
    """Rank 2 published its counters but not yet its entry for #21: one side known, one
    rank unknown is not a disagreement (and must not unpack a missing entry)."""
    ranks = {0: rank(21, entered=tail(21)), 1: rank(21, entered=tail(21)), 2: rank(21, entered=tail(20))}
    assert diagnose(ranks, NOW, 5 * S) is None
    ranks[3] = rank(20, entered=tail(20))
    d = diagnose(ranks, NOW, 5 * S)
    assert d is not None and (d.kind, d.laggards, d.entered, d.op) == (HANG, (3,), (0, 1, 2), AR), d


def test_two_sides_and_a_rank_not_read_yet_is_a_mismatch_still():
    ranks = {0: rank(30, entered=tail(30)), 1: rank(30, entered=tail(29) + ((30, "gloo:barrier", ""),)),
             2: rank(30, entered=tail(29))}
    d = diagnose(ranks, NOW, 5 * S)
    assert d is not None and (d.kind, d.laggards, d.entered, d.op) == (MISMATCH, (1,), (0,), AR), d


def test_a_group_whose_entry_is_not_read_yet_does_not_hide_a_mismatch_in_another_group():
    """Group "0": rank 2 has not published its entry for #5 yet (one side known). Group "1":
    rank 1 called a barrier where the others broadcast. The mismatch is named now, not a
    beat later."""
    def two(entered0: Tuple[Tuple[str, int, str, str], ...], op1: str) -> RankState:
        return RankState(collectives=(("0", 5, 4), ("1", 8, 7)), moved_mono_ns=NOW - 10 * S,
                         entered=entered0 + (("1", 8, op1, F4),))

    read, unread = (("0", 5, AR, F4),), (("0", 4, AR, F4),)
    ranks = {0: two(read, "gloo:broadcast"), 1: two(read, "gloo:barrier"), 2: two(unread, "gloo:broadcast")}
    d = diagnose(ranks, NOW, 5 * S)
    assert d is not None and (d.kind, d.group, d.seq, d.laggards, d.entered) == (MISMATCH, "1", 8, (1,), (0, 2)), d


def test_a_mismatch_tie_names_the_side_without_the_lowest_rank_and_its_text():
    barrier = tail(29) + ((30, "gloo:barrier", ""),)
    ranks = {0: rank(30, entered=tail(30)), 1: rank(30, entered=barrier), 2: rank(30, entered=barrier),
             3: rank(30, entered=tail(30))}
    d = diagnose(ranks, NOW, 5 * S)
    assert d is not None and (d.kind, d.laggards, d.entered, d.group, d.seq) == (MISMATCH, (1, 2), (0, 3), "0", 30)
    assert d.detail == ("ranks disagree on collective #30 of process group 0: ranks 0, 3 gloo:all_reduce [[4]] Float;"
                        " ranks 1, 2 gloo:barrier: ranks 1, 2 called another collective (skipped or reordered one?)")
    assert (d.since_ns, d.end_after_ns, d.busy) == (10 * S, 0, ())


def test_of_several_process_groups_the_one_with_the_most_ranks_behind_is_named():
    def two(seq0: int, seq1: int) -> RankState:
        return RankState(collectives=(("0", seq0, seq0 - 1), ("1", seq1, seq1 - 1)), moved_mono_ns=NOW - 10 * S,
                         entered=(("1", seq1, "gloo:broadcast", F4), ("0", seq0, AR, F4)))

    d = diagnose({0: two(5, 8), 1: two(4, 7), 2: two(5, 7)}, NOW, 5 * S)
    assert d is not None and (d.group, d.seq, d.laggards, d.entered, d.op) == ("1", 8, (1, 2), (0,), "gloo:broadcast")
    d = diagnose({0: two(5, 8), 1: two(4, 8), 2: two(5, 7)}, NOW, 5 * S)  # a tie: the first group by name
    assert d is not None and (d.group, d.seq, d.laggards, d.entered, d.op) == ("0", 5, (1,), (0, 2), AR)


def test_no_counters_no_diagnosis_even_with_a_frozen_rank():
    """Rule: paused or uncounted. Ranks that never imported torch.distributed are judged by beat() and hang_timeout only."""
    ranks = {0: RankState(beat_mono_ns=NOW - 50 * S), 1: RankState(beat_mono_ns=NOW - 50 * S, state="T")}
    assert diagnose(ranks, NOW, 5 * S) is None
    ranks = {0: RankState(beat_mono_ns=NOW - 50 * S), 1: RankState(watcher_silent=True)}
    assert diagnose(ranks, NOW, 5 * S) is None


def test_counters_but_no_time_of_a_move_is_no_diagnosis():
    assert diagnose({0: rank(21, moved=None), 1: rank(20, moved=None)}, NOW, 5 * S) is None


def test_a_threshold_of_zero_is_off_and_one_nanosecond_is_not():
    ranks = {0: rank(21), 1: rank(20)}
    assert diagnose(ranks, NOW, 0) is None and diagnose(ranks, NOW, -1) is None
    assert diagnose(ranks, NOW, 1) is not None
    assert diagnose({}, NOW, 5 * S) is None


def test_last_move_is_the_latest_counter_move_or_beat_of_any_rank():
    from peerwatch.hangs.diagnose import last_move

    assert last_move({0: RankState(moved_mono_ns=5, beat_mono_ns=None), 1: RankState(beat_mono_ns=7)}) == 7
    assert last_move({0: RankState(moved_mono_ns=9, beat_mono_ns=3), 1: RankState()}) == 9
    assert last_move({0: RankState()}) is None and last_move({}) is None


def test_the_hang_text_names_the_laggard_the_op_and_who_waits():
    ranks = {0: rank(21, entered=tail(21)), 1: rank(20, entered=tail(20)), 2: rank(21, entered=tail(21))}
    d = diagnose(ranks, NOW, 5 * S)
    assert d is not None and d.detail == ("nothing moved for 10.0s: rank 1 never entered gloo:all_reduce #21 of process"
                                          " group 0, which ranks 0, 2 wait in; rank 1 is elsewhere")
    ranks[1] = rank(20, where="train.py:9 in step", in_collective=True)
    d = diagnose(ranks, NOW, 5 * S)
    assert d is not None and d.detail.endswith("; rank 1 (at train.py:9 in step (inside torch.distributed))"), d.detail
    ranks[1] = rank(20, where="train.py:9 in step")
    d = diagnose(ranks, NOW, 5 * S)
    assert d is not None and d.detail.endswith("; rank 1 (at train.py:9 in step)"), d.detail


def test_the_hang_text_without_the_op_names_a_collective_and_tenths_of_a_second():
    ranks = {r: rank(q, moved=NOW - 10_050_000_000) for r, q in ((0, 21), (1, 20), (2, 19))}
    d = diagnose(ranks, NOW, 5 * S)
    assert d is not None and (d.laggards, d.op) == ((2, 1), None)
    assert d.detail == ("nothing moved for 10.1s: ranks 2, 1 never entered collective #21 of process group 0,"
                        " which rank 0 waits in; rank 2 is elsewhere")


def test_a_frozen_rank_holds_the_job_up_text():
    ranks = {0: rank(21, moved=NOW - 50_000_000), 1: rank(21, state="T", where="train.py:3 in f"), 2: rank(21)}
    d = diagnose(ranks, NOW, 10_000_000)
    assert d is not None and (d.laggards, d.entered, d.group, d.seq, d.op) == ((1,), (), None, None, None)
    assert d.detail == "nothing moved for 0.1s: rank 1 holds the job up (its process is stopped (SIGSTOP), at train.py:3 in f)"


def test_a_frozen_rank_at_the_top_is_a_laggard_not_one_that_waits():
    ranks = {0: rank(21, entered=tail(21)), 1: rank(21, state="t", entered=tail(21)), 2: rank(20)}
    d = diagnose(ranks, NOW, 5 * S)
    assert d is not None and (d.kind, d.laggards, d.entered, d.group, d.seq) == (HANG, (1, 2), (0,), "0", 21), d
    assert d.detail == ("nothing moved for 10.0s: rank 2 never entered gloo:all_reduce #21 of process group 0,"
                        " which rank 0 waits in and rank 1 entered; rank 1 (its process is stopped by a debugger)")


def test_a_frozen_laggard_is_never_listed_as_one_that_waits():
    """Two ranks stopped, one of them inside the last collective, and a third behind: the
    laggards are all three, none of them waits, and only those behind never entered it."""
    ranks = {0: rank(21), 1: rank(21, state="T"), 2: rank(22, state="T", entered=tail(22))}
    d = diagnose(ranks, NOW, 5 * S)
    assert d is not None and (d.laggards, d.entered, d.seq) == ((1, 2, 0), (), 22), d
    assert d.detail == ("nothing moved for 10.0s: ranks 1, 0 never entered gloo:all_reduce #22 of process group 0,"
                        " which rank 2 entered; rank 1 (its process is stopped (SIGSTOP))")
    assert "wait" not in d.detail, d.detail


def test_a_silent_watcher_is_a_laggard_and_the_text_says_why_unless_stopped():
    ranks = {0: rank(21), 1: rank(21, watcher_silent=True, state="S")}
    d = diagnose(ranks, NOW, 5 * S)
    assert d is not None and d.laggards == (1,)
    assert d.detail == "nothing moved for 10.0s: rank 1 holds the job up (its watcher cannot run (the GIL is held, e.g. by C code))"
    ranks[1] = rank(21, watcher_silent=True, state="T")
    d = diagnose(ranks, NOW, 5 * S)
    assert d is not None and d.detail == "nothing moved for 10.0s: rank 1 holds the job up (its process is stopped (SIGSTOP))"


def test_ranks_of_several_hosts_are_named_with_their_host():
    ranks = {0: rank(21, host="a"), 1: rank(20, host="b"), 2: rank(21, host="b"), 3: rank(20, host="b")}
    d = diagnose(ranks, NOW, 5 * S)
    assert d is not None and d.detail == ("nothing moved for 10.0s: ranks 1, 3 on host b never entered collective #21"
                                          " of process group 0, which rank 0 on host a and rank 2 on host b wait in;"
                                          " rank 1 is elsewhere")


def test_a_long_list_of_ranks_is_cut_after_sixteen():
    from peerwatch.hangs.diagnose import MAX_NAMED, _ranks

    assert MAX_NAMED == 16
    assert _ranks(range(16)) == "ranks " + ", ".join(map(str, range(16)))
    assert _ranks(range(17)) == "ranks " + ", ".join(map(str, range(16))) + " and 1 more"
    assert _ranks([2]) == "rank 2" and _ranks([2], {}) == "rank 2"


def test_sizes_read_in_kilobytes_or_megabytes():
    from peerwatch.hangs.diagnose import _size

    assert (_size(99_999), _size(100_000), _size(300_000_000)) == ("100 kB", "0.1 MB", "300.0 MB")
    # A kB is 1000 bytes and a MB 10**6, exactly: values where a divisor one off rounds otherwise.
    assert (_size(99_540), _size(123_456_789_000)) == ("100 kB", "123456.8 MB")
    assert (_size(0), _size(999), _size(1000)) == ("0 B", "999 B", "1 kB")  # a trickle, in bytes


@pytest.mark.parametrize("activity, busy", [
    (act(cpu_ms=350, places=1), True),  # 5 % of the time exactly, at any number of places
    (act(cpu_ms=349, places=7), False),
    (act(other_cpu_ms=700), True), (act(other_cpu_ms=699), False),  # 10 % of a core
    (act(io_bytes=256 * 1024), True), (act(io_bytes=256 * 1024 - 1), False),
    (act(io_bytes=1, main_io_bytes=1), True), (act(io_bytes=1), False),  # the main thread's: any byte
    (act(children_cpu_ms=700), True), (act(children_cpu_ms=699), False),
])
def test_busy_at_each_threshold_exactly(activity: Activity, busy: bool):
    assert bool(busy_evidence(RankState(activity=activity))) is busy


def test_the_evidence_text_lists_every_sign():
    a = Activity(span_ms=1_000_000, cpu_ms=1_000_000, places=7, other_cpu_ms=100_000, io_bytes=300_000_000,
                 children_cpu_ms=250_000, samples=7)
    assert busy_evidence(RankState(activity=a)) == (
        "its main thread on a CPU (or ready for one) 100% of the time, at 7 places, its other threads on a CPU (or ready for one), 10% of a core,"
        " 300.0 MB read or written, its child processes on a CPU (or ready for one), 25% of a core in the last 1000s")


def test_a_window_of_no_time_is_too_early_to_tell():
    no_time = Activity(span_ms=0, cpu_ms=5, places=5, other_cpu_ms=5, io_bytes=0, children_cpu_ms=5, samples=5)
    assert busy_evidence(RankState(activity=no_time)) is None
    one_ms = Activity(span_ms=1, cpu_ms=1, places=5, other_cpu_ms=0, io_bytes=0, children_cpu_ms=0, samples=5)
    assert busy_evidence(RankState(activity=one_ms)) == "its main thread on a CPU (or ready for one) 100% of the time, at 5 places in the last 0s"


@pytest.mark.parametrize("timeout_ms, end_s", [(0, 0.9 * 600), (1, 0.9e-3), (20_000, 18.0)])
def test_a_busy_laggard_is_ended_at_nine_tenths_of_the_timeout_or_of_the_assumed_one(timeout_ms: int, end_s: float):
    """An unknown collective timeout (no rank has said it): 600 s assumed, so auto still ends a busy job."""
    ranks = {0: rank(20, activity=act(cpu_ms=7_000, places=7)), 1: rank(21)}
    d = diagnose(ranks, NOW, 5 * S, timeout_ms=timeout_ms)
    assert d is not None and d.kind == BUSY and d.end_after_ns == int(end_s * S), d
    if timeout_ms == 0:
        assert diagnose(ranks, NOW, 5 * S) == d


def test_threshold_with_an_unknown_timeout_is_capped_at_five_minutes():
    t = Threshold()
    assert t.value_ns(0) == int(FLOOR_S * S) and t.value_ns(1) == 500_000
    for i in range(WARMUP_GAPS + 1):
        t.observe(i * 100 * S)
    assert t.value_ns(0) == 300 * S and t.value_ns(1_800_000) == FACTOR * 100 * S


def test_a_fresh_threshold_has_learnt_nothing():
    t = Threshold()
    assert (t.fixed_s, t.gaps, t.longest_ns) == (None, 0, 0)
    assert t.value_ns(1_800_000) == int(FLOOR_S * S)


def test_threshold_counts_only_new_moves():
    t = Threshold()
    t.observe(None)
    t.observe(0)
    t.observe(None)
    t.observe(20 * S)
    for _ in range(WARMUP_GAPS):
        t.observe(20 * S)  # the same move seen again
        t.observe(10 * S)  # an older one
    assert (t.gaps, t.longest_ns) == (1, 20 * S)
    assert t.value_ns(1_800_000) == int(FLOOR_S * S)


# -- one shape, one wording (issue 25.3) ------------------------------------------------


def test_a_heartbeat_becomes_a_rank_state_in_one_place_with_every_field_it_carries():
    """A rank's progress has one shape (RankState) for the hang rule, the diagnosis and the
    summary, made from a heartbeat by RankState.of only: every field but the process
    state, the watcher's silence, the host and when another host saw it (which the heartbeat
    cannot say) comes from it."""
    import dataclasses as dc

    from peerwatch.core.records import Heartbeat

    activity = Activity(samples=4, span_ms=3000, cpu_ms=900, places=4, other_cpu_ms=0, io_bytes=0, children_cpu_ms=0)
    beat = Heartbeat(rank=1, pid=5, time_ns=6, seq=7, step=42, progress_ns=11, paused=True, where="train.py:9 in step",
                     in_collective=True, collectives=(("0", 21, 20),), moved_ns=12,
                     entered=(("0", 21, AR, F4),), pg_timeout_ms=10_000, activity=activity.as_tuple())
    s = RankState.of(beat, "D", watcher_silent=True)
    assert s == RankState(step=42, beat_mono_ns=11, paused=True, state="D", watcher_silent=True, in_collective=True,
                          where="train.py:9 in step", collectives=(("0", 21, 20),), entered=(("0", 21, AR, F4),),
                          moved_mono_ns=12, timeout_ms=10_000, activity=activity)
    defaults = RankState()
    unset = [f.name for f in dc.fields(RankState) if getattr(s, f.name) == getattr(defaults, f.name)]
    assert unset == ["host", "seen_mono_ns"], f"RankState.of leaves {unset} at their defaults: a field the heartbeat carries is lost"


def test_a_rank_state_made_from_nothing_knows_nothing():
    """The defaults are the "unknown" of each field: a collective timeout of 0 is unknown
    (peerwatch.diagnoser skips it when it takes the shortest), no step, no move, no host."""
    s = RankState()
    assert (s.step, s.beat_mono_ns, s.paused, s.state, s.watcher_silent, s.in_collective, s.where) == (
        None, None, False, "?", False, False, "")
    assert (s.collectives, s.entered, s.moved_mono_ns, s.timeout_ms, s.activity, s.host) == ((), (), None, 0, None, "")


@pytest.mark.parametrize("state, silent, said", [
    ("T", False, "its process is stopped (SIGSTOP)"),
    ("D", False, "its process is in uninterruptible sleep (I/O)"),
    ("S", True, "its watcher cannot run (the GIL is held, e.g. by C code)"),
])
def test_the_hang_verdict_and_the_diagnosis_explain_a_laggard_in_the_same_words(state, silent, said):
    """The hang_timeout verdict (peerwatch.verdict.decide) and the diagnosis said why a laggard holds
    the job up in two texts, already worded differently ("the GIL is held, e.g. by C code"
    and "the GIL is held?"); one builder now (peerwatch.hangs.diagnose.explain)."""
    laggard = rank(21, state=state, watcher_silent=silent, where="train.py:3 in f", beat_mono_ns=NOW - 10 * S)
    ranks = {0: rank(21, beat_mono_ns=NOW - 10 * S), 1: laggard}
    found = diagnose(ranks, NOW, 5 * S)
    assert found is not None and found.laggards == (1,), found
    o = dataclasses.replace(obs(diagnosis=None, now=60 * S), progress=ranks, now_mono_ns=NOW)
    verdict = decide(o, Policy(parent_wait_ns=S // 10, default_exit_code=1, hang_timeout=HangSetting(seconds=5.0))).verdict
    assert verdict is not None and verdict.rank == 1, verdict
    assert f"({said}, at train.py:3 in f)" in found.detail, found.detail
    assert f"({said}, it never reported progress, at train.py:3 in f)" in verdict.detail, verdict.detail


# -- rule: plainly stuck; named at STUCK_S, not at the learnt threshold (issue 34) ----------------

LEARNT = int(FLOOR_S * S)  # the learnt threshold with no configuration, before its warm-up
STUCK = int(STUCK_S * S)
WINDOW = act(samples=STUCK_SAMPLES)  # a whole window with no sign of work


def test_the_stuck_threshold_is_ten_seconds_or_a_window_of_beats_never_over_the_learnt_one():
    from peerwatch.proc import activity as _activity

    assert (STUCK_S, STUCK_SAMPLES) == (10.0, _activity.WINDOW)
    learnt = Threshold()
    assert learnt.stuck_ns(0) == STUCK and learnt.value_ns(0) == LEARNT
    assert learnt.stuck_ns(0, interval_s=2.0) == 20 * S  # 8 samples + 2 beats of 2 s
    assert learnt.stuck_ns(8_000) == 4 * S  # a 8 s collective timeout: at most its half, as the learnt one
    assert Threshold(fixed_s=30.0).stuck_ns(0) == 0  # hang_warn in seconds: the one threshold


def test_a_laggard_with_a_whole_window_of_nothing_is_a_hang_at_the_stuck_threshold():
    ranks = {0: rank(21, moved=NOW - STUCK), 1: rank(20, moved=NOW - 20 * S, activity=WINDOW, where="t.py:3 in f"),
             2: rank(21, moved=NOW - STUCK)}
    assert diagnose(ranks, NOW, LEARNT) is None  # before: nothing until the learnt threshold (a minute)
    d = diagnose(ranks, NOW, LEARNT, stuck_ns=STUCK)
    assert d is not None and (d.kind, d.laggards, d.entered, d.seq, d.since_ns) == (HANG, (1,), (0, 2), 21, STUCK), d
    assert "t.py:3 in f" in d.detail
    assert diagnose(ranks, NOW - 1, LEARNT, stuck_ns=STUCK) is None  # not before


@pytest.mark.parametrize("laggard", [
    rank(20, activity=act(samples=STUCK_SAMPLES - 1)),  # too few samples yet: wait
    rank(20, activity=act(samples=STUCK_SAMPLES, cpu_ms=7_000, places=1)),  # one torch op, a loop: busy
    rank(20, activity=act(samples=STUCK_SAMPLES, main_io_bytes=20, io_bytes=20)),  # a slow read
    rank(20, activity=act(samples=STUCK_SAMPLES, children_cpu_ms=7_000)),  # data loader workers
    rank(20, activity=act(samples=STUCK_SAMPLES, other_cpu_ms=7_000)),  # torch's threads evaluating
    rank(20, activity=None),  # a rank that publishes no samples: judged as before
    rank(20, state="D", activity=act(samples=STUCK_SAMPLES, io_bytes=50_000_000)),  # writing, in D
    rank(20, watcher_silent=True, activity=WINDOW),  # the GIL held: a deadlock in C, or a long GC: unsampled
])
def test_a_laggard_with_any_sign_of_work_or_too_few_samples_waits_for_the_learnt_threshold(laggard: RankState):
    ranks = {0: rank(21), 1: laggard, 2: rank(21)}
    assert diagnose(ranks, NOW, LEARNT, stuck_ns=STUCK) is None
    late = diagnose(ranks, NOW + LEARNT, LEARNT, stuck_ns=STUCK)  # the learnt threshold governs it, as before
    assert late is not None or laggard.activity is not None and laggard.activity.samples < STUCK_SAMPLES


@pytest.mark.parametrize("laggard, why", [
    (rank(20, state="T"), "stopped (SIGSTOP)"),  # no samples needed: it cannot work
    (rank(20, state="D", activity=WINDOW), "uninterruptible sleep"),  # D, nothing moving for a window
])
def test_a_frozen_laggard_is_a_hang_at_the_stuck_threshold(laggard: RankState, why: str):
    d = diagnose({0: rank(21), 1: laggard, 2: rank(21)}, NOW, LEARNT, stuck_ns=STUCK)
    assert d is not None and (d.kind, d.laggards) == (HANG, (1,)) and why in d.detail, d


def test_a_laggard_waiting_in_another_collective_is_named_early_only_if_nobody_works():
    """A pipeline stage waits in a recv for a stage that computes: its silence says nothing."""
    waiting = rank(20, activity=WINDOW, in_collective=True)
    working = rank(21, activity=act(samples=STUCK_SAMPLES, cpu_ms=7_000))
    assert diagnose({0: working, 1: waiting, 2: rank(21)}, NOW, LEARNT, stuck_ns=STUCK) is None
    quiet = {0: rank(21, activity=WINDOW), 1: waiting, 2: rank(21, activity=WINDOW)}
    d = diagnose(quiet, NOW, LEARNT, stuck_ns=STUCK)
    assert d is not None and (d.kind, d.laggards) == (HANG, (1,)), d


def test_a_mismatch_of_plainly_stuck_ranks_is_named_at_the_stuck_threshold():
    ranks = {0: rank(21, entered=tail(21), activity=WINDOW),
             1: rank(21, entered=tail(21, op="gloo:barrier"), activity=WINDOW, in_collective=True),
             2: rank(21, entered=tail(21), activity=WINDOW)}
    d = diagnose(ranks, NOW, LEARNT, stuck_ns=STUCK)
    assert d is not None and (d.kind, d.laggards) == (MISMATCH, (1,)), d
    ranks[1] = dataclasses.replace(ranks[1], activity=act(samples=4))
    assert diagnose(ranks, NOW, LEARNT, stuck_ns=STUCK) is None  # its window is not whole yet


def test_everyone_at_the_same_collective_is_nothing_at_the_stuck_threshold_too():
    ranks = {r: rank(21, entered=tail(21), activity=WINDOW) for r in range(3)}
    assert diagnose(ranks, NOW, LEARNT, stuck_ns=STUCK) is None
    assert diagnose({0: rank(21), 1: rank(20, activity=WINDOW, paused=True)}, NOW, LEARNT, stuck_ns=STUCK) is None


def test_the_stuck_threshold_counts_awake_time_only():
    ranks = {0: rank(21), 1: rank(20, activity=WINDOW)}
    assert diagnose(ranks, NOW, LEARNT, awake_since_ns=NOW - STUCK + 1, stuck_ns=STUCK) is None
    assert diagnose(ranks, NOW, LEARNT, awake_since_ns=NOW - STUCK, stuck_ns=STUCK) is not None


@given(samples=st.integers(0, 20), cpu_ms=st.integers(0, 20_000), io=st.integers(0, 10**6),
       children=st.integers(0, 20_000), other=st.integers(0, 20_000), since_s=st.integers(0, 59))
@settings(max_examples=300, deadline=None)
def test_before_the_learnt_threshold_nothing_busy_is_ever_named(samples, cpu_ms, io, children, other, since_s):
    """The rule "plainly stuck" never names a laggard with a sign of work, nor one with too few samples."""
    a = Activity(span_ms=SPAN_MS, cpu_ms=cpu_ms, places=1, other_cpu_ms=other, io_bytes=io, children_cpu_ms=children,
                 samples=samples, main_io_bytes=io)
    ranks = {0: rank(21, moved=NOW - since_s * S), 1: rank(20, moved=NOW - 100 * S, activity=a)}
    d = diagnose(ranks, NOW, LEARNT, stuck_ns=STUCK)
    if d is not None:
        assert d.kind == HANG and samples >= STUCK_SAMPLES and since_s >= STUCK_S and busy_evidence(ranks[1]) == ""


# -- a whole host behind, named by the other hosts at the stuck threshold (issue 34) ----------

ONSET = NOW - STUCK  # every rank of both hosts last moved here: the stuck threshold ago


def host_a() -> Dict[int, RankState]:
    """Host a: ranks 0, 1 wait in all_reduce #21 (grouped in its summary: no samples of theirs)."""
    return {r: rank(21, moved=ONSET, entered=tail(21), in_collective=True) for r in (0, 1)}


def host_b(laggard: RankState) -> Dict[int, RankState]:
    """Host b: one rank, which never entered #21."""
    return {2: dataclasses.replace(laggard, moved_mono_ns=ONSET)}


def judged_on_a(b: Optional[Summary], now: int, read_at: int = NOW) -> Dict[int, RankState]:
    """Host a's ranks and host b's, as host a's judges take them: b's summary read through
    the store (JSON both ways) by a's bridge at ``read_at``, its last move fixed then."""
    ranks = {r: dataclasses.replace(s, host="hosta") for r, s in host_a().items()}
    if b is not None:
        back = Summary.from_json(b.to_json())
        assert back == b
        ranks.update(remote_ranks(back, read_at - back.age_ms * 1_000_000))
    return ranks


def test_a_remote_host_plainly_stuck_is_named_by_the_other_at_the_stuck_threshold():
    """Host b's one rank blocked on a lock (no CPU, no I/O for a whole window, by b's own
    samples): b's summary, made at the stuck threshold, says so and is published then;
    host a's judges, which read it with a summary of their own not published yet, name
    rank 2 on host b a beat later, as a local stuck laggard."""
    b = summarize(host_b(rank(20, activity=WINDOW, where="train.py:7 in step")), "hostb", NOW, LEARNT, stuck_ns=STUCK)
    assert b is not None and b.stuck and b.public(), b  # before: None until half the learnt threshold (30 s)
    a = summarize(host_a(), "hosta", NOW, LEARNT, stuck_ns=STUCK)
    assert a is not None and not a.stuck and not a.public(), a  # a's judges' alone: it reads, it does not publish
    assert diagnose(host_a(), NOW + S, LEARNT, stuck_ns=STUCK) is None  # alone, host a sees nothing
    d = diagnose(judged_on_a(b, NOW + S), NOW + S, LEARNT, stuck_ns=STUCK)
    assert d is not None and (d.kind, d.laggards, d.entered, d.seq) == (HANG, (2,), (0, 1), 21), d
    assert "rank 2 on host hostb never entered" in d.detail and "train.py:7 in step" in d.detail, d.detail


@pytest.mark.parametrize("laggard", [
    rank(20, activity=act(samples=STUCK_SAMPLES, cpu_ms=7_000)),  # computing (one torch op, a loop)
    rank(20, activity=act(samples=STUCK_SAMPLES, main_io_bytes=20, io_bytes=20)),  # a slow read
    rank(20, activity=act(samples=STUCK_SAMPLES, children_cpu_ms=7_000)),  # its data loader's workers compute
    rank(20, activity=act(samples=STUCK_SAMPLES - 1)),  # too few samples to tell
    rank(20, watcher_silent=True, activity=WINDOW),  # its watcher silent: unsampled
    rank(20, activity=WINDOW, paused=True),  # inside paused()
])
def test_a_remote_host_with_any_sign_of_work_is_not_named_early(laggard: RankState):
    """Its summary is not stuck, so not published before half the learnt threshold; and
    were it read, host a's judges apply the rule to its samples themselves: the learnt
    threshold governs it, as a local busy laggard."""
    b = summarize(host_b(laggard), "hostb", NOW, LEARNT, stuck_ns=STUCK)
    assert b is not None and not b.stuck and not b.public(), b
    assert diagnose(judged_on_a(b, NOW + S), NOW + S, LEARNT, stuck_ns=STUCK) is None


def test_a_remote_summary_too_old_or_absent_is_not_named_early():
    """Host b's evidence counts for the stuck threshold only while it is fresh: seen less
    than the stuck threshold ago on host a's clock. Older (its host stopped refreshing it,
    or a's judges were behind), or none at all: the learnt threshold, as before."""
    b = summarize(host_b(rank(20, activity=WINDOW)), "hostb", NOW, LEARNT, stuck_ns=STUCK)
    assert b is not None and b.stuck
    ranks = judged_on_a(b, NOW)  # seen at NOW, on a's clock
    fresh = diagnose(ranks, NOW + STUCK - 1, LEARNT, stuck_ns=STUCK)
    assert fresh is not None and fresh.laggards == (2,), fresh
    assert diagnose(ranks, NOW + STUCK, LEARNT, stuck_ns=STUCK) is None  # old news: not early
    late = diagnose(ranks, ONSET + LEARNT, LEARNT, stuck_ns=STUCK)  # the learnt threshold governs it
    assert late is not None and (late.kind, late.laggards) == (HANG, (2,)), late
    assert diagnose(judged_on_a(None, NOW + S), NOW + S, LEARNT, stuck_ns=STUCK) is None  # absent


def test_a_remote_laggard_waiting_in_another_collective_counts_others_only_while_fresh():
    """A laggard waiting in another collective is named early only if no rank shows work,
    and a rank of another host seen too long ago cannot say it does not."""
    waiting = rank(20, activity=WINDOW, in_collective=True)
    quiet = {0: rank(21, activity=WINDOW), 1: waiting,
             2: rank(21, activity=WINDOW, host="hostb", seen_mono_ns=NOW - STUCK)}
    assert diagnose(quiet, NOW, LEARNT, stuck_ns=STUCK) is None
    quiet[2] = dataclasses.replace(quiet[2], seen_mono_ns=NOW - S)
    d = diagnose(quiet, NOW, LEARNT, stuck_ns=STUCK)
    assert d is not None and d.laggards == (1,), d


def test_a_host_summarizes_from_the_stuck_threshold_publishes_from_half_the_learnt_one_unless_stuck():
    """The cost in the store: a host whose ranks all wait, or work, says nothing before half
    the learnt threshold, as before; under a fixed hang_warn (no stuck threshold) nothing
    changes at all."""
    assert summarize(host_a(), "hosta", NOW - 1, LEARNT, stuck_ns=STUCK) is None  # before the stuck threshold
    a = summarize(host_a(), "hosta", ONSET + LEARNT // 2 - S, LEARNT, stuck_ns=STUCK)
    assert a is not None and not a.public()
    a = summarize(host_a(), "hosta", ONSET + LEARNT // 2, LEARNT, stuck_ns=STUCK)
    assert a is not None and a.public() and not a.stuck
    assert summarize(host_b(rank(20, activity=WINDOW)), "hostb", NOW, LEARNT) is None  # no stuck threshold
    b = summarize(host_b(rank(20, activity=WINDOW)), "hostb", ONSET + LEARNT // 2, LEARNT)
    assert b is not None and b.public() and not b.stuck


def test_a_host_whose_judge_just_resumed_says_nothing_stuck_yet():
    """Awake time only (peerwatch.core.awake). A judge that was suspended (the host with it) counts its ranks'
    stillness from its resume: nothing is stuck, nor published, before the stuck threshold
    of awake time; nor does host a name early before its own."""
    ranks = host_b(rank(20, activity=WINDOW))
    assert summarize(ranks, "hostb", NOW, LEARNT, awake_since_ns=NOW - STUCK + 1, stuck_ns=STUCK) is None
    b = summarize(ranks, "hostb", NOW, LEARNT, awake_since_ns=NOW - STUCK, stuck_ns=STUCK)
    assert b is not None and b.stuck
    on_a = judged_on_a(b, NOW + S)
    assert diagnose(on_a, NOW + S, LEARNT, awake_since_ns=NOW + S - STUCK + 1, stuck_ns=STUCK) is None
    assert diagnose(on_a, NOW + S, LEARNT, awake_since_ns=NOW + S - STUCK, stuck_ns=STUCK) is not None
