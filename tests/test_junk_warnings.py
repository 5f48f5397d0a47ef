"""A run directory flooded with junk records: every rank warns a few times per kind, not
once per file (issue 14: 20 000 junk failure-*.json printed 20 000 lines in every rank)."""

from __future__ import annotations

import os
import re
import time

import pytest
from harness import Job

from peerwatch.rundir.trust import WARN_EACH

pytestmark = pytest.mark.timeout(180)

WORLD = 2
JUNK = 20_000
DEADLINE_S = 90.0  # two ranks read 20 000 files each on a loaded 2-core machine


def _log(job: Job, rank: int) -> str:
    return job.log_path(rank).read_text(errors="replace")


def _heartbeat_ns(job: Job, rank: int) -> int:
    try:
        return (job.run_dir / "heartbeats" / f"rank-{rank:05d}.json").stat().st_mtime_ns
    except FileNotFoundError:
        return 0


def _wait_until(what: str, done, timeout: float, job: Job) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {timeout}s\n{job.logs()}")
        time.sleep(0.05)


def test_twenty_thousand_junk_failure_records_are_warned_about_a_few_times_per_rank(make_job) -> None:
    job = make_job(world=WORLD).start()
    job.wait_ready()
    events, tmp = job.run_dir / "events", job.run_dir / "tmp"
    junk = b'{"version": 1, "kind": "failure", "rank": "junk"}'
    for i in range(JUNK):  # ranks that are not in the job: nothing to act on, only to read
        staged = tmp / f"junk-{i}"
        staged.write_bytes(junk)
        os.replace(staged, events / f"failure-{100 + i:05d}.json")
    planted_ns = time.time_ns()
    summary = "further ones are ignored without a warning each"
    _wait_until("the summary line in every rank", lambda: all(summary in _log(job, r) for r in range(WORLD)),
                DEADLINE_S, job)
    # A heartbeat written after a full look: every rank has read every junk file by then.
    _wait_until("every watcher beat after the junk", lambda: all(_heartbeat_ns(job, r) > planted_ns for r in range(WORLD)),
                DEADLINE_S, job)
    last = {r: _heartbeat_ns(job, r) for r in range(WORLD)}
    _wait_until("every watcher beat twice", lambda: all(_heartbeat_ns(job, r) > last[r] for r in range(WORLD)),
                DEADLINE_S, job)
    for rank in range(WORLD):
        log = _log(job, rank)
        about_junk = [line for line in log.splitlines() if re.search(r"failure-\d+\.json", line)]
        assert len(about_junk) == WARN_EACH + 1, f"rank {rank}: {len(about_junk)} lines:\n{log[-4000:]}"
        assert log.count(summary) == 1, log[-4000:]
        assert "Traceback" not in log and "NOT protected" not in log, log[-4000:]
    gone = [p.label for p in job.ranks.values() if p.gone()]
    assert not gone, f"ended after the junk: {gone}\n{job.logs()}"
    job.kill_all()
    job.wait_gone(within=10.0)

