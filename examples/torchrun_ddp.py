"""peerwatch under torchrun (also the training script of examples/by_hand.sh).

How to run (CPU, gloo):

    torchrun --standalone --nproc-per-node 4 examples/torchrun_ddp.py
    FAIL_RANK=-1 torchrun --standalone --nproc-per-node 4 examples/torchrun_ddp.py    # nobody fails
    FAIL_HOW=raise torchrun --standalone --nproc-per-node 4 examples/torchrun_ddp.py
    torchrun --standalone --nproc-per-node 4 --max-restarts 1 examples/torchrun_ddp.py

    FAIL_RANK  the rank that fails (default 2; -1: none)     FAIL_STEP  at which step (default 20)
    FAIL_HOW   kill (SIGKILL itself, as the OOM killer would; default), raise, exit (sys.exit(3))
    STEPS      steps to train (default 60)

What you will see when a rank fails: the report's summary, printed by one rank (a rank that
raised prints it itself, below its traceback; `peerwatch report DIR` prints it again), then
every other rank logs one line naming it ("peerwatch: rank 0 (pid ... on ...) stops with
exit code 1: rank 2 (pid ... on ...) failed first (ended without a success marker ...)"), and
torchrun ends as it would without peerwatch: it names rank 2 as the root cause
("Root Cause (first observed failure): ... rank 2 ... exitcode -9 (SIGKILL)") and exits
1, or, with --max-restarts, restarts the workers: a restart is a new run directory
(``torchrun-<run id>-<agent>-r1``) and only the first attempt fails here. With
peerwatch the surviving workers leave the agent to see the dead worker first (so that
torchrun names it), then go even if a SIGTERM handler of theirs would keep them.

If the agent itself is SIGKILLed (``kill -9 <torchrun's pid>``), its workers notice
within milliseconds ("its launcher (torchrun agent, pid ...) is gone") and are torn
down instead of training on, or hanging in a collective, with nobody to reap them.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time

import peerwatch

peerwatch.install()  # the one line: before anything else

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

FAIL_RANK = int(os.environ.get("FAIL_RANK", "2"))
FAIL_STEP = int(os.environ.get("FAIL_STEP", "20"))
FAIL_HOW = os.environ.get("FAIL_HOW", "kill")
STEPS = int(os.environ.get("STEPS", "60"))


def init_process_group() -> None:
    timeout = datetime.timedelta(minutes=30)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # Not peerwatch's doing: torchrun (2.13) keeps its store across restarts, and gloo
        # finds the previous attempt's addresses there ("connectFullMesh failed ... Connection
        # refused"). A prefix per attempt keeps --max-restarts working.
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]), False,
            timeout=timeout,
        )
        store = dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group(
            "gloo", store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timeout,
        )
    else:
        dist.init_process_group("gloo", timeout=timeout)  # RANK, WORLD_SIZE, MASTER_ADDR/PORT


def main() -> None:
    init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, STEPS + 1):
        x = torch.randn(16, 32)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        if rank == FAIL_RANK and step == FAIL_STEP and first_attempt:
            print(f"[rank {rank}] failing at step {step} ({FAIL_HOW})", flush=True)
            if FAIL_HOW == "raise":
                raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
            if FAIL_HOW == "exit":
                sys.exit(3)
            os.kill(os.getpid(), signal.SIGKILL)
        for p in model.parameters():
            dist.all_reduce(p.grad)  # the other ranks wait here for the one that failed
            p.grad /= world
        optimizer.step()
        peerwatch.beat(step)
        if rank == 0 and step % 10 == 0:
            print(f"[rank 0] step {step} loss {loss.item():.3f}", flush=True)
        time.sleep(0.02)
    dist.destroy_process_group()
    print(f"[rank {rank}] done", flush=True)


if __name__ == "__main__":
    main()
