"""When the watcher wakes and what is due (peerwatch.core.schedule): pure, with a fake clock."""

from __future__ import annotations

import pytest

from peerwatch.core.schedule import RETRY_S, SAFETY_LOOK_EVERY, Schedule

pytestmark = pytest.mark.pure  # no process, no thread, no file: conftest skips its scan for leaks


def test_the_first_wake_is_immediate_and_takes_a_full_look() -> None:
    s = Schedule(10.0, beat_s=1.0)
    assert s.beat_due(10.0)
    assert s.full_look(beat=True, judging_remote=False)
    assert s.timeout(10.0, judging_remote=False) == 0.0
    assert not s.full_look(beat=False, judging_remote=False)
    assert s.timeout(10.0, judging_remote=False) == 1.0


def test_heartbeats_are_due_every_interval() -> None:
    s = Schedule(10.0, beat_s=1.0)
    assert s.beat_due(10.0)
    assert s.beat_due(10.99) is False  # a bool, as its type says
    assert s.beat_due(11.0)
    assert s.beats == 2
    s.timeout(11.0, False)
    assert s.timeout(11.25, False) == pytest.approx(0.75)


def test_a_safety_look_every_tenth_beat_only() -> None:
    s = Schedule(0.0, beat_s=1.0)
    s.timeout(0.0, False)
    looks = []
    for i in range(2 * SAFETY_LOOK_EVERY):
        beat = s.beat_due(float(i))
        looks.append(s.full_look(beat, judging_remote=False))
    assert SAFETY_LOOK_EVERY == 10
    assert [i + 1 for i, look in enumerate(looks) if look] == [10, 20]


def test_on_a_shared_filesystem_every_beat_is_a_full_look() -> None:
    s = Schedule(0.0, beat_s=1.0, remote_s=0.5)
    s.timeout(0.0, False)
    assert s.full_look(beat=True, judging_remote=False)
    assert not s.full_look(beat=False, judging_remote=False)


def test_a_remote_judge_looks_every_remote_poll() -> None:
    s = Schedule(0.0, beat_s=1.0, remote_s=0.5)
    s.beat_due(0.0)
    s.timeout(0.0, True)
    assert s.full_look(beat=False, judging_remote=True)
    assert s.timeout(0.0, judging_remote=True) == 0.5
    assert s.timeout(0.0, judging_remote=False) == 1.0


def test_remote_polling_needs_a_shared_filesystem() -> None:
    s = Schedule(0.0, beat_s=1.0)
    s.beat_due(0.0)
    s.timeout(0.0, True)
    assert s.timeout(0.0, judging_remote=True) == 1.0


def test_the_fallback_polls_and_looks_every_time() -> None:
    s = Schedule(0.0, beat_s=1.0, fallback_s=0.1)
    s.beat_due(0.0)
    s.timeout(0.0, False)
    assert s.full_look(beat=False, judging_remote=False)
    assert s.timeout(0.0, False) == 0.1


def test_a_look_that_could_not_tell_is_taken_again_soon() -> None:
    """Out of descriptors, a record or a peer's state could not be read: the next full look
    comes within RETRY_S, not only when a source fires (inotify would not fire again)."""
    s = Schedule(0.0, beat_s=1.0)
    s.beat_due(0.0)
    s.timeout(0.0, False)
    assert not s.full_look(beat=False, judging_remote=False) and s.timeout(0.0, False) == 1.0
    assert s.full_look(beat=False, judging_remote=False, unsure=True)
    assert s.timeout(0.0, False, unsure=True) == RETRY_S


def test_a_recheck_or_a_hold_shortens_the_sleep_and_is_due_when_it_comes() -> None:
    s = Schedule(0.0, beat_s=1.0)
    s.beat_due(0.0)
    s.timeout(0.0, False)
    assert not s.due(0.0)
    s.recheck = 0.3
    assert s.timeout(0.0, False) == pytest.approx(0.3)
    assert not s.due(0.29) and s.due(0.3)
    s.recheck, s.hold = None, 0.2
    assert s.timeout(0.0, False) == pytest.approx(0.2)
    assert not s.due(0.19) and s.due(0.2)
    s.recheck = 0.1
    assert s.timeout(0.0, False) == pytest.approx(0.1)


def test_a_deadline_in_the_past_means_no_sleep() -> None:
    s = Schedule(0.0, beat_s=1.0)
    s.beat_due(0.0)
    s.timeout(0.0, False)
    s.recheck = -1.0
    assert s.timeout(0.0, False) == 0.0


def test_startup_is_over_once_after_startup_timeout() -> None:
    s = Schedule(5.0, beat_s=1.0, startup_s=30.0)
    assert s.startup_over(34.9) is False
    assert s.startup_over(35.0)
    assert not s.startup_over(36.0)
    assert not Schedule(5.0, beat_s=1.0).startup_over(1e9)


def test_startup_timeout_counts_only_from_the_watchers_last_resume() -> None:
    """The watcher was stopped from 10 s to 50 s (its ranks with it, before they registered):
    startup_timeout counts again from its resume."""
    s = Schedule(5.0, beat_s=1.0, startup_s=30.0)
    assert not s.startup_over(50.0, awake_since=50.0)
    assert not s.startup_over(79.9, awake_since=50.0)
    assert s.startup_over(80.0, awake_since=50.0)
