"""peerwatch demo: a real 4-rank training job in which one rank fails.

    ./dev demo                     # rank 2 raises at step 30
    ./dev demo --failure kill      # rank 2 is SIGKILLed at step 30 (as the OOM killer would)
    ./dev demo --failure exit      # rank 2 calls sys.exit(3) at step 30

The job is launched the way Lightning's subprocess launcher does it: rank 0 starts ranks
1..3 as its own children. Every rank trains a small model on CPU with torch.distributed
(gloo), averaging gradients with all_reduce, and calls ``peerwatch.install()`` first.
When rank 2 fails, the other ranks are blocked in all_reduce; without peerwatch they
would wait for gloo's timeout. With it, every rank is gone within milliseconds, each
exits with rank 2's exit code, and the report names rank 2.

This file is both the launcher (no arguments) and the training script (``--rank-program``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time

WORLD = 4
FAILING_RANK = 2
FAIL_AT_STEP = 30


def train(failure: str) -> None:
    import peerwatch

    peerwatch.install()  # the one line; before anything spawns the other ranks

    rank = int(os.environ.get("LOCAL_RANK", "0"))
    children = []
    if rank == 0:  # Lightning-style: rank 0 is the parent of the other ranks
        for child_rank in range(1, WORLD):
            env = dict(os.environ, LOCAL_RANK=str(child_rank), NODE_RANK="0", WORLD_SIZE=str(WORLD))
            children.append(subprocess.Popen([sys.executable, *sys.argv], env=env))

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(minutes=10))
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, 10_000):
        x = torch.randn(16, 32)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        if rank == FAILING_RANK and step == FAIL_AT_STEP:
            print(f"[rank {rank}] failing now at step {step} ({failure})", flush=True)
            failed_at = os.environ["DEMO_FAILED_AT"]  # written, then renamed: never read half written
            with open(failed_at + ".tmp", "w") as f:
                f.write(str(time.time_ns()))
            os.replace(failed_at + ".tmp", failed_at)
            if failure == "raise":
                raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
            if failure == "exit":
                sys.exit(3)
            os.kill(os.getpid(), signal.SIGKILL)
        for p in model.parameters():
            dist.all_reduce(p.grad)  # the other ranks block here once rank 2 is gone
            p.grad /= WORLD
        optimizer.step()
        peerwatch.beat(step)
        if rank == 0 and step % 10 == 0:
            print(f"[rank 0] step {step} loss {loss.item():.3f}", flush=True)
        time.sleep(0.01)
    for child in children:
        child.wait()


def launch(failure: str) -> int:
    import psutil

    run_dir = tempfile.mkdtemp(prefix="peerwatch-demo-")
    os.chmod(run_dir, 0o700)
    env = dict(os.environ)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env.update(
        PEERWATCH_DIR=os.path.join(run_dir, "run"), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        DEMO_FAILED_AT=os.path.join(run_dir, "failed_at"),
    )
    env.pop("RANK", None)
    env.pop("LOCAL_RANK", None)
    print(f"demo: starting a {WORLD}-rank gloo job (rank 0 launches ranks 1-{WORLD - 1});"
          f" rank {FAILING_RANK} will fail at step {FAIL_AT_STEP} ({failure})\n", flush=True)
    rank0 = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank-program", "--failure", failure], env=env)
    # Follow every process of the job through a pidfd, to time its end exactly.
    pidfds: dict = {}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not os.path.exists(env["DEMO_FAILED_AT"]) and rank0.poll() is None:
        try:
            for p in [psutil.Process(rank0.pid), *psutil.Process(rank0.pid).children(recursive=True)]:
                if p.pid not in pidfds.values():
                    pidfds[os.pidfd_open(p.pid)] = p.pid
        except (psutil.Error, OSError):
            pass
        time.sleep(0.02)
    all_gone_ns = None
    while pidfds and time.monotonic() < deadline:
        ready, _, _ = select.select(list(pidfds), [], [], deadline - time.monotonic())
        for fd in ready:
            os.close(fd)
            del pidfds[fd]
        all_gone_ns = time.time_ns()
    alive = list(pidfds.values())
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    rank0_code = rank0.wait()
    print()
    try:
        with open(env["DEMO_FAILED_AT"]) as f:
            failed_at_ns = int(f.read())
    except (OSError, ValueError):
        failed_at_ns = None
    report = subprocess.run(
        [sys.executable, "-m", "peerwatch", "report", env["PEERWATCH_DIR"]], capture_output=True, text=True
    )
    print("demo: `peerwatch report` says:\n")
    print(report.stdout or report.stderr)
    if failed_at_ns is not None and all_gone_ns is not None:
        print(f"demo: from rank {FAILING_RANK}'s failure to the last process of the job gone: "
              f"{(all_gone_ns - failed_at_ns) / 1e6:.0f} ms")
    print(f"demo: rank 0 exited with code {rank0_code}")
    expected = {"raise": 1, "exit": 3, "kill": 128 + signal.SIGKILL}[failure]
    ok = rank0_code == expected and not alive
    print(f"demo: {'OK' if ok else 'UNEXPECTED'}: the job was torn down"
          f"{'' if not alive else f', but {len(alive)} processes were left'}; expected exit code {expected}")
    return 0 if ok else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--failure", choices=["raise", "kill", "exit"], default="raise")
    parser.add_argument("--rank-program", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_program:
        train(args.failure)
    else:
        sys.exit(launch(args.failure))


if __name__ == "__main__":
    main()
