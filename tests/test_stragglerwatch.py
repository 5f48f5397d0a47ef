"""The straggler finding carried out (peerwatch.hosts.stragglerwatch): written and logged once,
by whichever judge; copied from the store on the other hosts. A real run directory."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from peerwatch.core.records import Registration
from peerwatch.hangs.straggler import SLOT_BEATS, SLOTS, Profile, find, finding_json, host_json
from peerwatch.hangs.waits import SAMPLE_S, SAMPLE_S_VAR, SLOT_S_VAR, sample_s, slot_beats
from peerwatch.hosts.store_protocol import NO_SEAL
from peerwatch.hosts.stragglerwatch import StraggleRelay, StragglerWatch, read_finding
from peerwatch.rundir.rundir import STRAGGLE_HOSTS_FILE, RunDir

NOW = 1_700_000_000_000_000_000
ME = Registration(rank=0, pid=os.getpid(), ppid=1, start_ticks=1, uid=os.getuid(), host="h", boot_id="b", pidns="p",
                  time_ns=1)


def profiles(slow: bool) -> dict:
    return {r: Profile(tuple([20 if slow and r == 2 else 300] * SLOTS), 300, "h", tuple(range(SLOTS)))
            for r in range(4)}


@pytest.fixture
def run_dir(tmp_path: Path) -> RunDir:
    path = tmp_path / "run"
    path.mkdir(mode=0o700)
    for sub in ("ranks", "events", "heartbeats", "stacks", "tmp"):
        (path / sub).mkdir(mode=0o700)
    return RunDir(str(path))


def lines(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records)


def test_a_straggler_is_written_and_logged_once_and_cleared_once(run_dir: RunDir, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="peerwatch")
    watch = StragglerWatch(run_dir, ME, 1.0, spans_hosts=False)
    for i in range(3):
        watch.judge(profiles(slow=True), NOW + i)
    found = read_finding(run_dir)
    assert found is not None and [(s.rank, s.since_ns) for s in found] == [(2, NOW)]
    assert lines(caplog, "straggler: rank 2 (on h) enters its collectives 84 ms after its peers (28% of each step)") == 1
    # Another judge takes over (the lowest rank ended): it knows, and says nothing again.
    StragglerWatch(run_dir, ME, 1.0, spans_hosts=False).judge(profiles(slow=True), NOW + 5)
    assert lines(caplog, "straggler: rank 2") == 1
    watch.judge(profiles(slow=False), NOW + 6)
    watch.judge(profiles(slow=False), NOW + 7)
    assert read_finding(run_dir) == ()
    assert lines(caplog, "rank 2 (on h) is no longer a straggler") == 1


def test_a_judge_of_a_host_not_judging_the_job_writes_no_finding(run_dir: RunDir) -> None:
    # Across hosts, only the host whose bridge wrote straggle-hosts.json (host 0) judges.
    watch = StragglerWatch(run_dir, ME, 0.01, spans_hosts=True)
    for _ in range(10):
        watch.tick(None, {})
    assert read_finding(run_dir) is None and os.path.exists(run_dir.join("straggle.json"))
    other = host_json("hostb", profiles(slow=True)).decode()
    run_dir.write("", STRAGGLE_HOSTS_FILE, json.dumps({"hosts": [other]}).encode(), replace=True)
    for _ in range(5):
        watch.tick(None, {})
    assert [(s.rank, s.host) for s in read_finding(run_dir) or ()] == [(2, "hostb")]


def test_another_host_copies_the_finding_and_logs_it_once(run_dir: RunDir, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="peerwatch")
    relay = StraggleRelay(run_dir, 1.0)
    x = relay.plan("p/", 1, [0, 1], NO_SEAL)
    assert x is not None and x.read_found and x.others == [] and relay.plan("p/", 1, [0, 1], x.seal) is None
    found = finding_json(find(profiles(slow=True), {}, NOW), NOW)
    relay.take(x, {}, found)
    relay.take(x, {}, found)
    assert [s.rank for s in read_finding(run_dir) or ()] == [2]
    assert lines(caplog, "straggler: rank 2") == 1
    relay.take(x, {}, b"garbage")  # not a finding: the one copied stands
    assert [s.rank for s in read_finding(run_dir) or ()] == [2]


def test_the_sampler_counts_only_while_the_job_moves() -> None:
    import threading
    import time

    from peerwatch.hangs.waits import SAMPLE_S, WaitSampler

    sampler = WaitSampler(0)
    sampler.start()
    try:
        time.sleep(6 * SAMPLE_S)  # not told the job moves: no wake-up, no sample
        assert sampler.counts == (0, 0)
        sampler.moving(True)
        deadline = time.monotonic() + 10.0
        while sampler.counts[0] < 3:
            assert time.monotonic() < deadline, sampler.counts
            time.sleep(SAMPLE_S)  # a counter in memory: nothing to wait on; the deadline bounds it
        # This thread (the "main" one here) runs Python: not waiting in a collective.
        assert sampler.counts[1] == 0
        sampler.moving(False)
        time.sleep(2 * SAMPLE_S)
        still = sampler.counts
        time.sleep(6 * SAMPLE_S)
        assert sampler.counts == still
    finally:
        sampler.stop()
        thread = next(t for t in threading.enumerate() if t.name == "peerwatch-waits-rank0")
        thread.join(5.0)
        assert not thread.is_alive()


def test_the_tests_private_override_shortens_the_slots_and_the_sampling(run_dir: RunDir,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # The end-to-end straggler tests run on 1 s slots (tests/harness.py); a user never does.
    from harness import STRAGGLER_VARS, straggler_env

    assert STRAGGLER_VARS == (SLOT_S_VAR, SAMPLE_S_VAR)
    for var in STRAGGLER_VARS:
        monkeypatch.delenv(var, raising=False)
    assert (slot_beats(0.5), sample_s()) == (SLOT_BEATS, SAMPLE_S)
    for junk in ("", "x", "0", "-1", "nan", "1e9"):
        monkeypatch.setenv(SLOT_S_VAR, junk)
        monkeypatch.setenv(SAMPLE_S_VAR, junk)
        assert (slot_beats(0.5), sample_s()) == (SLOT_BEATS, SAMPLE_S), junk
    for var, value in straggler_env().items():
        monkeypatch.setenv(var, value)
    assert (slot_beats(0.5), sample_s()) == (2, 0.02)
    assert slot_beats(5.0) == 1  # never less than a heartbeat
    # The judge gathers once a (shortened) slot: here every second heartbeat.
    watch = StragglerWatch(run_dir, ME, 0.5, spans_hosts=True)
    watch.tick(None, {})
    assert not os.path.exists(run_dir.join("straggle.json"))
    watch.tick(None, {})
    assert os.path.exists(run_dir.join("straggle.json"))


def test_the_line_logged_says_what_the_finding_says(run_dir: RunDir, caplog) -> None:
    """Two collectives a step, the waits naming the straggler before the enqueue times have
    slots enough to: the line says the lateness the finding (and ``peerwatch status``) says,
    the enqueue times' 100 ms, not the waits' per-collective 50."""
    caplog.set_level(logging.WARNING, logger="peerwatch")
    few = 3
    slow = {r: Profile(tuple([20 if r == 2 else 330] * SLOTS), 150, "h", tuple(range(SLOTS)),
                       (330 if r == 2 else 0,) * few, tuple(range(few)), 100 if r == 2 else 0) for r in range(4)}
    StragglerWatch(run_dir, ME, 1.0, spans_hosts=False).judge(slow, NOW)
    found = read_finding(run_dir)
    assert found is not None and [(s.rank, s.late_ms) for s in found] == [(2, 100)], found
    assert lines(caplog, "straggler: rank 2 (on h) enters its collectives 100 ms after its peers") == 1
