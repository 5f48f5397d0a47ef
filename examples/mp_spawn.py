"""peerwatch with torch.multiprocessing.spawn.

How to run (CPU, gloo):

    python examples/mp_spawn.py                  # 3 workers; worker 1 is SIGKILLed at step 20
    FAIL_RANK=-1 python examples/mp_spawn.py     # nobody fails: exits 0
    FAIL_HOW=raise python examples/mp_spawn.py
    KILL_MAIN=1 python examples/mp_spawn.py      # the main process SIGKILLs itself instead

    WORLD (3), FAIL_RANK (1; -1: none), FAIL_STEP (20), FAIL_HOW (kill, raise, exit), STEPS (60)

Call ``peerwatch.install(rank=i, world_size=n)`` first thing in the worker function:
``rank=`` is what tells peerwatch that a multiprocessing child is a rank (a DataLoader
worker is not). The workers share their parent, so they agree on a run directory
(``spawn-<main pid>.<start>``) with no configuration. An ``install()`` at the top of the
script as well is harmless: in the main process it watches that process alone (its own
run), in the workers it does nothing (they are multiprocessing children without
``rank=``), and the workers' run goes in ``<main's run dir>/spawn``, so they never take
the main process for their rank 0.

What you will see when a worker fails: mp.spawn's main process sleeps on the workers'
exits and is the first to know; it stops the others (SIGTERM) and raises
``ProcessExitedException: process 1 terminated with signal SIGKILL``, as without
peerwatch (the survivors let it see the dead worker first, so it names the right one).
When the main process itself dies (KILL_MAIN=1, or the OOM killer), the workers, which
would otherwise train on or hang in a collective with nobody to reap them, log "its
launcher (multiprocessing parent ...) is gone" and are torn down within milliseconds.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import peerwatch

WORLD = int(os.environ.get("WORLD", "3"))
FAIL_RANK = int(os.environ.get("FAIL_RANK", "1"))
FAIL_STEP = int(os.environ.get("FAIL_STEP", "20"))
FAIL_HOW = os.environ.get("FAIL_HOW", "kill")
STEPS = int(os.environ.get("STEPS", "60"))
KILL_MAIN = os.environ.get("KILL_MAIN") == "1"


def worker(rank: int, world: int, main_pid: int) -> None:
    peerwatch.install(rank=rank, world_size=world)  # first thing in the worker
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=30))
    model = torch.nn.Linear(32, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, STEPS + 1):
        loss = model(torch.randn(16, 32)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        if step == FAIL_STEP and rank == 0 and KILL_MAIN:
            print(f"[rank {rank}] SIGKILLing the main process (pid {main_pid}) at step {step}", flush=True)
            os.kill(main_pid, signal.SIGKILL)
        if step == FAIL_STEP and rank == FAIL_RANK and not KILL_MAIN:
            print(f"[rank {rank}] failing at step {step} ({FAIL_HOW})", flush=True)
            if FAIL_HOW == "raise":
                raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
            if FAIL_HOW == "exit":
                sys.exit(3)
            os.kill(os.getpid(), signal.SIGKILL)
        for p in model.parameters():
            dist.all_reduce(p.grad)  # the other workers wait here for the one that failed
            p.grad /= world
        optimizer.step()
        peerwatch.beat(step)
        time.sleep(0.02)
    dist.destroy_process_group()


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(20000 + os.getpid() % 20000))
    mp.spawn(worker, args=(WORLD, os.getpid()), nprocs=WORLD, join=True)
    print("mp_spawn.py: every worker finished", flush=True)


if __name__ == "__main__":
    main()
