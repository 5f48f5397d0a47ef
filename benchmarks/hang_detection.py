"""How long after a rank freezes peerwatch declares the hang, against ``hang_timeout``.

    .venv/bin/python benchmarks/hang_detection.py --runs 10 --timeouts 3,5

Each run starts a 3-rank gloo training job (tests/hang_program.py: all_reduce, beat(step),
20 ms of "compute"), waits until rank 1's heartbeat carries a step, SIGSTOPs rank 1, and
waits (pidfds) for every process to go. Measured from the SIGSTOP: the verdict's
``detected_at_ns`` in RUN/events/verdict.json, and the last process gone. Prints a
markdown table of detection time minus ``hang_timeout`` (docs/hangs.md promises at most
two heartbeat intervals, 2 s by default, after the last progress).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
HANG_PROGRAM = os.path.join(HERE, "..", "tests", "hang_program.py")
WORLD = 3
VICTIM = 1
START_TIMEOUT_S = 60.0
POLL_S = 0.01  # READY and heartbeat files have no event to wait on


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(what: str, done, procs: List[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a rank ended while waiting until {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"not {what} within {timeout}s")
        time.sleep(POLL_S)


def read_json(path: str) -> Dict:
    try:
        with open(path) as f:
            return dict(json.load(f))
    except (OSError, ValueError):
        return {}


def trial(hang_timeout: float, grace: float, workdir: str) -> Tuple[float, float, float]:
    """(verdict after the stop, verdict after the last progress, all gone after the stop), s."""
    run_dir, ready = os.path.join(workdir, "run"), os.path.join(workdir, "ready")
    os.makedirs(ready)
    env = dict(
        os.environ, PEERWATCH_DIR=run_dir, PEERWATCH_GRACE=str(grace), PEERWATCH_HANG_TIMEOUT=str(hang_timeout),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), GLOO_SOCKET_IFNAME="lo", WORLD_SIZE=str(WORLD),
    )
    cmd = [sys.executable, HANG_PROGRAM, "--world", str(WORLD), "--ready", ready]
    procs = [
        subprocess.Popen(cmd, env=dict(env, RANK=str(r)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for r in range(WORLD)
    ]
    try:
        wait_until("every rank trains", lambda: all(os.path.exists(f"{ready}/rank-{r}") for r in range(WORLD)),
                   procs, START_TIMEOUT_S)
        heartbeat = os.path.join(run_dir, "heartbeats", f"rank-{VICTIM:05d}.json")
        wait_until("rank 1 published a step", lambda: read_json(heartbeat).get("step") is not None, procs, 10.0)
        fds = [os.pidfd_open(p.pid) for p in procs]
        stopped_ns = time.time_ns()
        procs[VICTIM].send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + hang_timeout + 2.0 + 3 * grace + 10.0
        while fds:
            ready_fds, _, _ = select.select(fds, [], [], max(0.0, deadline - time.monotonic()))
            if not ready_fds:
                raise RuntimeError("the job did not end")
            for fd in ready_fds:
                os.close(fd)
                fds.remove(fd)
        gone_ns = time.time_ns()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    v = read_json(os.path.join(run_dir, "events", "verdict.json"))
    if (v.get("cause"), v.get("rank")) != ("hang", VICTIM):
        raise RuntimeError(f"unexpected verdict: {v}")
    return (
        (v["detected_at_ns"] - stopped_ns) / 1e9,
        (v["detected_at_ns"] - v["failed_at_ns"]) / 1e9,
        (gone_ns - stopped_ns) / 1e9,
    )


def quantiles(values: List[float]) -> str:
    values = sorted(values)
    p90 = values[int(0.9 * (len(values) - 1))]
    return f"{statistics.median(values):.2f} / {p90:.2f} / {values[-1]:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--timeouts", default="3,5", help="hang_timeout values, comma-separated (s)")
    parser.add_argument("--grace", type=float, default=1.0)
    args = parser.parse_args()
    print("| hang_timeout s | runs | verdict after SIGSTOP − hang_timeout, s (median / p90 / max) "
          "| verdict after last progress − hang_timeout, s | all gone after SIGSTOP, s |")
    print("|---|---|---|---|---|")
    for hang_timeout in (float(t) for t in args.timeouts.split(",")):
        after_stop, after_progress, gone = [], [], []
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as d:
                s, p, g = trial(hang_timeout, args.grace, d)
            after_stop.append(s - hang_timeout)
            after_progress.append(p - hang_timeout)
            gone.append(g)
        print(f"| {hang_timeout:g} | {args.runs} | {quantiles(after_stop)} | {quantiles(after_progress)} "
              f"| {quantiles(gone)} |", flush=True)


if __name__ == "__main__":
    main()
