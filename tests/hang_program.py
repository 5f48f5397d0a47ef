"""One rank of a small training job, for the hang tests. Started by tests/test_hang.py and
benchmarks/hang_detection.py, never imported.

    RANK=1 WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \\
        python hang_program.py --world 3 --ready DIR --behave 1=loop@10

Every rank installs peerwatch, joins a gloo group and trains: ``all_reduce``, then
``peerwatch.beat(step)``, then ``--step-s`` seconds of "compute". A rank that stops taking
part leaves the others waiting inside ``all_reduce``, as in a real job. Behaviours per
rank, ``RANK=WHAT@STEP`` (from step STEP on):

    loop         an infinite Python loop
    deadlock     acquire a threading.Lock it already holds
    gil          hold the GIL in C (ctypes sleep, signals blocked) for a long time
    slow:S       every step from then on takes S seconds more
    loadgil:S    before its first step (before ``import torch``), hold the GIL in C for S
                 seconds, once its watcher has beaten twice (as a slow import does), then train
    paused:S     one ``peerwatch.paused()`` phase of S seconds, then train on

Markers in ``--ready`` (written atomically): ``rank-<i>`` (the pid) after the rank's first
step; ``doing-<i>`` right before its behaviour starts. ``--steps N``: finish cleanly after
N steps (0: train until torn down).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import signal
import threading
import time

import peerwatch


def note(ready: str, name: str, text: str) -> None:
    path = os.path.join(ready, name)
    tmp = f"{path}.{os.getpid()}.tmp"  # per process: two writers never share it
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def parse_behaviours(items: list[str]) -> dict[int, tuple[str, str, int]]:
    out = {}
    for item in items:
        rank, _, what = item.partition("=")
        action, _, at = what.partition("@")
        name, _, arg = action.partition(":")
        out[int(rank)] = (name, arg, int(at or 0))
    return out


def spin() -> None:
    n = 0
    while True:  # pure Python: the interpreter switches threads, so the watcher runs
        n += 1


def deadlock() -> None:
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()


def hold_gil() -> None:
    libc = ctypes.PyDLL(None)  # PyDLL: the GIL stays held during the call
    # Like a long computation in C: a handled signal would cut sleep() short and give
    # Python the GIL back, so the main thread blocks them (other threads take them).
    signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    libc.sleep(600)


def beaten_twice(rank: int) -> bool:
    path = os.path.join(os.environ["PEERWATCH_DIR"], "heartbeats", f"rank-{rank:05d}.json")
    try:
        with open(path) as f:
            return json.loads(f.read())["seq"] >= 2
    except (OSError, ValueError, KeyError):
        return False


def hold_gil_for(seconds: float) -> None:
    libc = ctypes.PyDLL(None)  # PyDLL: the GIL stays held during the call
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    libc.usleep(int(seconds * 1e6))
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--ready", required=True)
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--step-s", type=float, default=0.02)
    parser.add_argument("--behave", action="append", default=[])
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    peerwatch.install()
    name, arg, at = parse_behaviours(args.behave).get(rank, ("", "", -1))
    if name == "loadgil":
        deadline = time.monotonic() + 60
        while not beaten_twice(rank) and time.monotonic() < deadline:
            time.sleep(0.01)
        hold_gil_for(float(arg))

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=args.world, timeout=datetime.timedelta(seconds=120))
    t = torch.ones(1)
    extra_s = 0.0
    step = 0
    while args.steps == 0 or step < args.steps:
        if step == at:
            note(args.ready, f"doing-{rank}", str(os.getpid()))
            if name == "loop":
                spin()
            elif name == "deadlock":
                deadlock()
            elif name == "gil":
                hold_gil()
            elif name == "slow":
                extra_s = float(arg)
            elif name == "paused":
                with peerwatch.paused():
                    time.sleep(float(arg))
        dist.all_reduce(t)
        peerwatch.beat(step)
        if step == 0:
            note(args.ready, f"rank-{rank}", str(os.getpid()))
        time.sleep(args.step_s + extra_s)
        step += 1
    dist.barrier()  # nobody leaves while another still needs it in a collective
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
