"""What a flight-recorder dump (peerwatch.hangs.frdump) costs, and how long it holds the training thread.

    .venv/bin/python benchmarks/fr_dump.py --runs 10

One process, a one-rank gloo group, the flight recorder's ring filled (2500 all_reduces
of 1000 floats: the ring keeps 2000). A thread (as the watcher) writes the dump into a
run directory ``--runs`` times, while the main thread runs a Python loop and records
the longest gap between two of its iterations: how long it was held. The same loop
without a dump gives the baseline (the interpreter's 5 ms switch interval). Then, once,
torch's first dump *with* stack traces (which peerwatch does not take): its
symbolization is why.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Callable, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from _common import free_port, machine, peerwatch_commit, table  # noqa: E402

RING_FILL = 2500


def held(work: Callable[[], object]) -> Tuple[float, float]:
    """(ms ``work`` took on another thread, longest ms the main thread was held meanwhile)."""
    took: List[float] = []
    done = threading.Event()

    def run() -> None:
        time.sleep(0.02)  # the main thread is looping by then
        t0 = time.perf_counter()
        work()
        took.append((time.perf_counter() - t0) * 1e3)
        time.sleep(0.02)
        done.set()

    thread = threading.Thread(target=run, name="peerwatch-bench")
    longest = 0.0
    last = time.perf_counter()
    thread.start()
    while not done.is_set():
        now = time.perf_counter()
        longest = max(longest, now - last)
        last = now
        sum(range(50))  # a little Python work per iteration, as a training loop's
    thread.join()
    return took[0] if took else 0.0, longest * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import _dump_fr_trace

    from peerwatch.hangs.frdump import FlightRecorderDump
    from peerwatch.rundir.rundir import TMP, RunDir

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}",
                            timeout=datetime.timedelta(seconds=60))
    t = torch.ones(1000)
    for _ in range(RING_FILL):
        dist.all_reduce(t)
    with tempfile.TemporaryDirectory() as tmp:
        run = os.path.join(tmp, "run")
        os.makedirs(os.path.join(run, TMP), mode=0o700)
        dumper = FlightRecorderDump(RunDir(run), 0)
        baseline = [held(lambda: time.sleep(0.03))[1] for _ in range(args.runs)]
        dumps = [held(lambda: dumper.dump("teardown")) for _ in range(args.runs)]
        torch_only = [held(lambda: _dump_fr_trace(includeCollectives=True, includeStackTraces=False))
                      for _ in range(args.runs)]
        size = os.path.getsize(os.path.join(run, "flight_recorder", "rank_0"))
        first_stacks = held(lambda: _dump_fr_trace(includeCollectives=True, includeStackTraces=True))
    dist.destroy_process_group()

    def med(xs: List[float]) -> str:
        return f"{statistics.median(xs):.1f} ms (max {max(xs):.1f})"

    print(f"# flight-recorder dump, ring full (2000 entries), {args.runs} runs; {machine()}; peerwatch {peerwatch_commit()}")
    print(f"# dump file: {size} bytes")
    print(table(["what", "took (median, max)", "main thread held, longest (median, max)"], [
        ["nothing (baseline: the switch interval)", "-", med(baseline)],
        ["peerwatch's dump (torch's + groups + pickle + atomic write)", med([d[0] for d in dumps]),
         med([d[1] for d in dumps])],
        ["torch's _dump_fr_trace alone, without stack traces", med([d[0] for d in torch_only]),
         med([d[1] for d in torch_only])],
        ["torch's first _dump_fr_trace with stack traces (not taken)", f"{first_stacks[0]:.1f} ms",
         f"{first_stacks[1]:.1f} ms"],
    ]))


if __name__ == "__main__":
    main()
