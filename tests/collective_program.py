"""One rank of a small training job that never calls ``peerwatch.beat()``: the hang
diagnosis must come from torch's collective counters alone. Started by
tests/test_diagnosis.py and benchmarks/hang_diagnosis.py, never imported.

    RANK=1 WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \\
        python collective_program.py --world 3 --ready DIR --behave 1=loop@10

Every rank installs peerwatch, joins a gloo group (collective timeout ``--timeout``) and
trains: ``all_reduce`` of 4 floats, then ``--step-s`` seconds of "compute". Behaviours,
``RANK=WHAT@STEP`` (from step STEP on):

    loop         an infinite Python loop (the others wait in all_reduce)
    skip         skip this step's all_reduce (the rank reaches the final barrier one
                 collective early, while the others are in their last all_reduce)
    size         all_reduce 1 float instead of 4 at this step
    slow:S       every step from then on takes S seconds more
    every:S/N    a sleep of S seconds every N steps from then on (a periodic checkpoint)
    paused:S     one ``peerwatch.paused()`` phase of S seconds (the others wait at all_reduce)
    sleep:S      one sleep of S seconds, not in paused() (a checkpoint nobody announced)
    checkpoint:S S seconds of writing a file (CPU and bytes written), not in paused()
    evaluate:S   S seconds of evaluating a small model (its stack moves; no I/O), not in paused()
    workers:S    S seconds of waiting for a worker process that computes (a data loader's)
    compute:S    S seconds of one torch op in a loop on one thread (OMP_NUM_THREADS=1): the
                 main thread on a CPU, seen at one or two places, no other thread, no I/O
    spin:S       S seconds of a Python loop (CPU at one or two places, as an endless loop)
    trickle:S    S seconds of reading a few bytes a second (a slow socket): no CPU to speak of
    subprocess:S S seconds of waiting for a child that computes, started by subprocess (whose
                 fork runs no Python at-fork hook: nothing tells peerwatch a child came)
    lock         block forever on a lock it already holds (no CPU, no I/O: stuck)
    stop         SIGSTOP itself (frozen)
    dstate       its main thread in uninterruptible sleep (D) for good, the GIL released:
                 posix_spawn (a vfork) of a child whose first act, opening
                 ``--ready``/fifo-<rank> (a FIFO nobody writes), blocks; the parent waits
                 for its exec. No root needed; whoever ends the job opens the FIFO for
                 writing to let the child go

``--no-torch``: never import torch (a job of plain processes). ``--no-collectives``:
join the group, then only "compute". ``--ddp``: each step is a DistributedDataParallel
training step (forward, backward: its gradient all-reduces are launched and waited for
in C++, with no torch.distributed frame in Python) after the "compute" sleep (the data
loading), instead of an ``all_reduce`` from Python. Markers in ``--ready``: ``rank-<i>`` (the pid)
after the first step; ``doing-<i>`` right before the behaviour starts; ``done-<i>`` at the end.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import peerwatch


def note(ready: str, name: str, text: str) -> None:
    path = os.path.join(ready, name)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def checkpoint(path: str, seconds: float) -> None:
    """Like torch.save of a large model, without paused(): serialise (CPU), write (bytes)."""
    import torch

    end = time.monotonic() + seconds
    state = {f"layer{i}": torch.randn(256, 256) for i in range(8)}
    with open(path, "wb") as f:
        while time.monotonic() < end:
            for tensor in state.values():
                f.write(tensor.numpy().tobytes())
            f.seek(0)


def evaluate(seconds: float) -> None:
    """An evaluation loop: batches made in Python, a model's forward, a metric."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.LayerNorm(128),
                                torch.nn.Linear(128, 64), torch.nn.Tanh(), torch.nn.Linear(64, 10))
    end = time.monotonic() + seconds
    correct = 0
    with torch.no_grad():
        while time.monotonic() < end:
            batch = torch.stack([torch.full((64,), float(i % 7)) for i in range(32)])
            labels = torch.tensor([i % 10 for i in range(32)])
            out = model(batch)
            correct += int((out.argmax(dim=1) == labels).sum())


def _worker(seconds: float) -> None:
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1


def wait_for_workers(seconds: float) -> None:
    """Like a data loader's main thread: blocked, while its worker process computes."""
    worker = multiprocessing.get_context("fork").Process(target=_worker, args=(seconds,))
    worker.start()
    worker.join()


def compute(seconds: float) -> None:
    import torch

    torch.set_num_threads(1)  # as torchrun's OMP_NUM_THREADS=1: torch's pool computes nothing
    a = torch.randn(384, 384)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        torch.mm(a, a)  # in C, the GIL released: the watcher sees this line


def spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def trickle(seconds: float) -> None:
    """Read, a byte at a time, what a thread writes every 0.2 s (a slow socket or file)."""
    read_end, write_end = os.pipe()

    def write() -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            os.write(write_end, b"x")
            time.sleep(0.2)
        os.close(write_end)

    threading.Thread(target=write, name="trickle", daemon=True).start()
    with os.fdopen(read_end, "rb", buffering=0) as f:
        while f.read(1):
            pass


def computing_child(seconds: float) -> None:
    work = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"
    subprocess.run([sys.executable, "-c", work], check=True, timeout=seconds + 60)


def uninterruptible(fifo: str) -> None:
    """posix_spawn through ctypes (the GIL released, as any C call stuck in the kernel):
    glibc's vfork parent waits, in state D, for a child that blocks opening ``fifo``."""
    import ctypes

    os.mkfifo(fifo)
    libc = ctypes.CDLL(None, use_errno=True)
    actions = ctypes.create_string_buffer(256)  # a posix_spawn_file_actions_t (80 bytes on glibc x86-64)
    libc.posix_spawn_file_actions_init(actions)
    libc.posix_spawn_file_actions_addopen(actions, 3, fifo.encode(), os.O_RDONLY, 0)
    pid = ctypes.c_int()
    argv = (ctypes.c_char_p * 2)(b"/bin/true", None)
    libc.posix_spawn(ctypes.byref(pid), b"/bin/true", actions, None, argv, None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--ready", required=True)
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--step-s", type=float, default=0.02)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--behave", action="append", default=[])
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--no-collectives", action="store_true")
    parser.add_argument("--ddp", action="store_true")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    peerwatch.install()
    name, arg, at = "", "", -1
    for item in args.behave:
        r, _, what = item.partition("=")
        if int(r) == rank:
            action, _, when = what.partition("@")
            name, _, arg = action.partition(":")
            at = int(when or 0)
    if args.no_torch:
        for step in range(args.steps or 10**9):
            if step == 0:
                note(args.ready, f"rank-{rank}", str(os.getpid()))
            time.sleep(args.step_s)
        note(args.ready, f"done-{rank}", "torch imported" if "torch" in sys.modules else "torch not imported")
        return

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=args.world, timeout=datetime.timedelta(seconds=args.timeout))
    t = torch.ones(4)
    extra_s = 0.0
    ddp_step = None
    if args.ddp:
        torch.set_num_threads(1)  # four ranks on two cores: one thread each, as a GPU job's CPU side
        model = torch.nn.parallel.DistributedDataParallel(
            torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        batch, labels = torch.randn(16, 32), torch.randint(0, 4, (16,))

        def ddp_step() -> None:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(batch), labels).backward()
            optimizer.step()
    step = 0
    while args.steps == 0 or step < args.steps:
        skip = False
        if name == "every" and step > at and (step - at) % int(arg.partition("/")[2]) == 0:
            time.sleep(float(arg.partition("/")[0]))
        if step == at:
            note(args.ready, f"doing-{rank}", str(os.getpid()))
            if name == "loop":
                n = 0
                while True:  # pure Python: the interpreter switches threads, so the watcher runs
                    n += 1
            elif name == "skip":
                skip = True
            elif name == "slow":
                extra_s = float(arg)
            elif name == "sleep":
                time.sleep(float(arg))
            elif name == "checkpoint":
                checkpoint(os.path.join(args.ready, f"checkpoint-{rank}.bin"), float(arg))
            elif name == "evaluate":
                evaluate(float(arg))
            elif name == "workers":
                wait_for_workers(float(arg))
            elif name in ("compute", "spin", "trickle", "subprocess"):
                {"compute": compute, "spin": spin, "trickle": trickle, "subprocess": computing_child}[name](float(arg))
            elif name == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif name == "dstate":
                uninterruptible(os.path.join(args.ready, f"fifo-{rank}"))
            elif name == "lock":
                lock = threading.Lock()
                lock.acquire()
                lock.acquire()
            elif name == "paused":
                with peerwatch.paused():
                    time.sleep(float(arg))
        if ddp_step is not None:
            time.sleep(args.step_s + extra_s)  # the data loading, before the step's collectives
            ddp_step()
        elif not args.no_collectives and not skip:
            dist.all_reduce(torch.ones(1) if name == "size" and step == at else t)
        if step == 0:
            note(args.ready, f"rank-{rank}", str(os.getpid()))
        if ddp_step is None:
            time.sleep(args.step_s + extra_s)
        step += 1
    dist.barrier()
    note(args.ready, f"done-{rank}", "")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
