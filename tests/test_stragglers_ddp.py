"""End to end: the straggler of a DDP job, whose waits are inside C++ (4 ranks, gloo on CPU).

Every rank runs ``collective_program.py --ddp``: a "data loading" sleep of ``--step-s``,
then a DistributedDataParallel step, whose gradient all-reduce is launched and waited for
inside ``backward()``: no torch.distributed frame in Python, so the wait sampler sees no
wait on any rank. The enqueue measure (the flight recorder's enqueue times, compared
between the ranks of the host) names the rank that loads its data slower. Heartbeat
0.5 s and harness.straggler_env()'s slots of 1 s (6 of them before anyone is named, the
recorder read every 2); every wait has a deadline.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Iterator, List, Sequence

import pytest
from harness import straggler_env
from test_stragglers import START_S, StragglerJob

from peerwatch.hangs.straggler import MIN_SLOTS, lateness, row_from_text

pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.timeout(120)

WORLD = 4
HEARTBEAT_S = 0.5
STEP_S = 0.06
SLOW_S = 0.03  # the straggler's extra data loading: its peers wait ~0.03 s of every ~0.09 s step
NAMED_S = 30.0  # 6 slots of 1 s, a read every 2 slots, the judge's slot, a loaded machine
BALANCED_S = 13.0  # 12 slots of 1 s: the window, full


class DDPJob(StragglerJob):
    def _argv(self) -> List[str]:
        return [*super()._argv(), "--ddp"]


@pytest.fixture
def make_job(tmp_path: Path, no_leaks: str) -> Iterator[Callable[..., DDPJob]]:
    jobs: List[DDPJob] = []

    def make(behave: Sequence[str] = ()) -> DDPJob:
        job = DDPJob(tmp_path, behave, {"PEERWATCH_HEARTBEAT": f"{HEARTBEAT_S:g}", **straggler_env()}, f"job{len(jobs)}")
        jobs.append(job)
        job.start()
        return job

    yield make
    for job in jobs:
        job.kill_all()
        job.close()


def _beats(job: DDPJob) -> List[dict]:
    return [json.loads((job.run_dir / "heartbeats" / f"rank-{r:05d}.json").read_text()) for r in range(WORLD)]


def test_the_slow_ddp_rank_and_no_other_is_named(make_job) -> None:
    job = make_job(behave=[f"2=slow:{SLOW_S}@0"])
    job.wait_ready(timeout=START_S)
    started = time.monotonic()
    found = job.wait_named(NAMED_S)
    took = time.monotonic() - started
    assert [s["rank"] for s in found] == [2], found
    # The others wait for it ~0.03 s of each ~0.09 s step: a third; it enters ~30 ms late.
    assert 0.2 <= found[0]["share"] <= 0.5 and 20 <= found[0]["late_ms"] <= 45, found
    # What the wait sampler saw (DDP's waits are in C++: too little to name anyone; printed).
    waits = [sum(s[2] for s in b["waits"]) / max(1, sum(s[1] for s in b["waits"])) for b in _beats(job)]
    print("waits", waits)
    assert [s["rank"] for s in job.status()["stragglers"]] == [2]
    deadline = time.monotonic() + 10.0  # the line is logged right after the finding is written
    while len(job.lines("straggler: rank 2")) != 1:
        assert time.monotonic() < deadline, job.logs()
        time.sleep(0.1)  # a log file: no event to poll on; the deadline bounds it
    print(f"named after {took:.1f}s: {found}; wait shares {waits}")


def test_balanced_ddp_ranks_are_not_named(make_job) -> None:
    job = make_job()
    job.wait_ready(timeout=START_S)
    deadline = time.monotonic() + BALANCED_S
    while time.monotonic() < deadline:
        assert not job.finding(), f"{job.finding()} named\n{job.logs()}"
        ended = [p.label for p in job.all_procs() if p.gone()]
        assert not ended, f"{', '.join(ended)} ended\n{job.logs()}"
        time.sleep(0.2)  # a file in a folder: no event to poll on; the deadline bounds it
    assert job.lines("straggler") == [], job.logs()
    # The enqueue measure ran, on every rank, over the window: nobody was above the rule.
    late = lateness({b["rank"]: [row_from_text(r) for r in b["enqueued"]] for b in _beats(job)})
    assert sorted(late) == list(range(WORLD)) and all(len(v[0]) >= MIN_SLOTS for v in late.values()), late
    print({r: v[0] for r, v in late.items()})


def test_the_enqueue_window_reads_every_two_slots_while_the_job_moves_and_publishes_closed_slots() -> None:
    from peerwatch.hangs.waits import ENQ_READ_SLOTS, EnqueueWindow

    window = EnqueueWindow(1.0)  # slots of 5 s
    moving = [(("0", 10 * i, 10 * i),) for i in range(1, 5)]
    assert [window.due(c) for c in moving] == [False, True, False, True] and ENQ_READ_SLOTS == 2
    assert not window.due(moving[-1]) and not window.due(moving[-1])  # stood still: no read
    slot_ns = 5_000_000_000
    # Slots 100 and 101 closed, 102 under way: group 1 is the busiest; slot 102 waits.
    entries = [(1, s, 100 * slot_ns + s * 250_000_000) for s in range(1, 31)] + [(0, 1, 100 * slot_ns)]
    window.add(entries, 102 * slot_ns + 1)
    rows = [row_from_text(r) for r in window.rows()]
    assert [(r[0], r[1], r[2], len(r)) for r in rows if r] == [(100, 1, 1, 22), (101, 1, 20, 14)]
    window.add(entries, 102 * slot_ns + 2)  # the same slots again: nothing more
    assert len(window.rows()) == 2
