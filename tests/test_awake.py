"""Time counts only while the judge was awake (peerwatch.core.awake), and the judges that turn
a silence into a finding or a verdict count by it: pure, no process. The end-to-end case
(a job suspended and resumed by its scheduler) is in tests/test_diagnosis.py."""

from __future__ import annotations

import dataclasses

import pytest

from peerwatch.core.awake import CAP_INTERVALS, AwakeClock
from peerwatch.core.config import HangSetting
from peerwatch.hangs.diagnose import RankState, Threshold, diagnose, summarize
from peerwatch.verdict.decide import Observed, Policy, decide

pytestmark = pytest.mark.pure

S = 1_000_000_000
STOPPED_AT = 100 * S  # the judge's last look before it was stopped
RESUMED_AT = 120 * S  # its first look after: 20 s it did not see


def _suspended_clock() -> AwakeClock:
    """A judge looking once a second, stopped 20 s between two looks."""
    clock = AwakeClock.every(1.0)
    for t in range(90, 101):
        assert not clock.tick(t * S)
    assert clock.tick(RESUMED_AT)
    return clock


def test_a_look_within_the_cap_is_no_gap_and_one_beyond_it_is() -> None:
    clock = AwakeClock.every(1.0)
    assert clock.cap_ns == CAP_INTERVALS * S
    assert not clock.tick(10 * S) and not clock.tick(12 * S)  # exactly the cap: we were looking
    assert clock.since_ns == 0 and clock.counted_ns(5 * S, 12 * S) == 7 * S
    assert clock.tick(14 * S + 1)  # one ns more: we were not running
    assert clock.since_ns == 14 * S + 1


def test_a_silence_counts_from_the_judges_resume_not_from_its_start() -> None:
    clock = _suspended_clock()
    assert clock.counted_ns(99 * S, RESUMED_AT) == 0  # stale beats read at once: no silence yet
    assert clock.counted_ns(99 * S, RESUMED_AT + 3 * S) == 3 * S  # the time since, seen awake
    assert clock.counted_ns(RESUMED_AT + S, RESUMED_AT + 3 * S) == 2 * S  # a beat since: as before


def _stuck(moved_ns: int) -> dict:
    """Rank 1 one collective behind and stopped: a hang, if the silence is long enough."""
    return {0: RankState(collectives=(("0", 21, 20),), moved_mono_ns=moved_ns, state="S", in_collective=True),
            1: RankState(collectives=(("0", 20, 19),), moved_mono_ns=moved_ns, state="T")}


def test_no_diagnosis_from_heartbeats_gone_stale_while_the_judge_was_stopped_too() -> None:
    ranks = _stuck(moved_ns=99 * S)
    assert diagnose(ranks, RESUMED_AT, 5 * S) is not None  # as before: 21 s of silence, 20 of them unseen
    assert diagnose(ranks, RESUMED_AT, 5 * S, awake_since_ns=RESUMED_AT) is None
    assert diagnose(ranks, RESUMED_AT + 5 * S - 1, 5 * S, awake_since_ns=RESUMED_AT) is None
    found = diagnose(ranks, RESUMED_AT + 5 * S, 5 * S, awake_since_ns=RESUMED_AT)  # still stopped, seen awake
    assert found is not None and found.laggards == (1,) and found.since_ns == 5 * S


def test_no_hang_timeout_verdict_from_a_silence_the_judge_did_not_see() -> None:
    policy = Policy(parent_wait_ns=0, default_exit_code=1, hang_timeout=HangSetting(seconds=5.0))
    obs = Observed(self_rank=0, now_ns=1_000 * S, registrations={}, successes=frozenset(), failures={},
                   exit_statuses={}, gone={}, progress={0: RankState(step=3, beat_mono_ns=99 * S)},
                   now_mono_ns=RESUMED_AT + S, awake_since_ns=RESUMED_AT)
    assert decide(obs, policy).verdict is None
    v = decide(dataclasses.replace(obs, now_mono_ns=RESUMED_AT + 5 * S), policy).verdict
    assert v is not None and v.detail.startswith("no rank made progress for 5.0s")


def test_an_interval_that_spans_the_judges_gap_is_not_learnt() -> None:
    threshold = Threshold()
    threshold.observe(90 * S)
    threshold.observe(99 * S)  # 9 s, seen awake: learnt
    threshold.observe(RESUMED_AT + S, awake_since_ns=RESUMED_AT)  # 22 s, 20 of them unseen: not learnt
    threshold.observe(RESUMED_AT + 4 * S, awake_since_ns=RESUMED_AT)  # 3 s since: learnt
    assert (threshold.longest_ns, threshold.gaps) == (9 * S, 2)


def test_a_hosts_summary_says_the_age_its_judge_saw() -> None:
    ranks = {0: RankState(collectives=(("0", 21, 20),), moved_mono_ns=99 * S, in_collective=True, state="S")}
    assert summarize(ranks, "a", RESUMED_AT, 4 * S, awake_since_ns=RESUMED_AT) is None  # not standing still yet
    summary = summarize(ranks, "a", RESUMED_AT + 3 * S, 4 * S, awake_since_ns=RESUMED_AT)
    assert summary is not None and summary.age_ms == 3_000 and summary.stall == str(99 * S)
