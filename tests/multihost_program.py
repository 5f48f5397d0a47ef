"""A simulated host of a multi-host job, and its ranks. Started by tests/test_multihost.py,
tests/test_multihost_hangs.py and benchmarks/hang_hosts.py.

    unshare --pid --fork --mount-proc --uts python multihost_program.py host --name hostb \\
        --ranks 2,3 --world 6 --ready DIR [--serve PORT] [--behave 3=succeed_on:go-b]

``host`` runs as PID 1 of its own PID namespace (its own UTS namespace gives it its own
hostname), like a node's agent: it optionally serves the job's TCPStore (as torchrun's
agent, or rank 0 under init_process_group, does on the first node), starts its ranks as
children with RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE, reaps them (and any orphan:
it is init here), notes each rank's returncode in ``READY/exit-<rank>``, and exits when
they are all gone (``--hold NAME``: serving the store on until ``READY/NAME`` exists).
Killing it kills the whole simulated host.

``rank`` installs peerwatch, notes ``READY/rank-<rank>`` (JSON: pid in its namespace,
host), imports torch.distributed (as a training script does; on a host's first rank,
and where the behaviour uses torch: the store bridge runs in a rank that did; it notes
``READY/imported-<rank>`` then), then behaves: ``sleep`` (the default: beat until torn down), ``succeed_on:NAME`` (finish
cleanly once ``READY/NAME`` exists; ``torch_succeed_on:NAME`` imports torch.distributed
first), ``raise_on:NAME`` (raise RuntimeError once it
exists), ``torch`` (note ``READY/torch-<rank>``, then sleep), ``gloo`` (join a gloo
process group of every rank, its timeout ``MULTIHOST_GLOO_TIMEOUT_S``, 60 s unless set, note
``READY/pg-<rank>``, all_reduce in a loop), or the same
with a laggard's behaviour after STEP all_reduces, outside the collectives its peers wait
in (``READY/doing-<rank>`` is noted right before it starts):

    gloo:loop_at=STEP        loop in Python forever, asleep, without a beat
    gloo:lock_at=STEP        block forever on a lock it already holds (a deadlock)
    gloo:stop_at=STEP        SIGSTOP itself (frozen, its watcher with it)
    gloo:checkpoint_at=STEP  write a checkpoint (CPU and bytes written) for 600 s, then go on
    gloo:step=S              compute S seconds a step (a sleep) rather than 0.01 (a straggler)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time


def note(ready: str, name: str, text: str) -> None:
    path = os.path.join(ready, name)
    tmp = f"{path}.{os.getpid()}.tmp"  # per process: two writers never share it
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def host_main(args: argparse.Namespace) -> None:
    if args.name:
        socket.sethostname(args.name)
    store = None
    if args.serve:
        import datetime

        import torch.distributed as dist

        store = dist.TCPStore("0.0.0.0", args.serve, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=60))
        note(args.ready, f"store-{args.name}", str(store.port))
    ranks = [int(r) for r in args.ranks.split(",")]
    children = {}
    for local, rank in enumerate(ranks):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.world), LOCAL_RANK=str(local),
                   LOCAL_WORLD_SIZE=str(len(ranks)), MULTIHOST_RANK=str(rank))
        argv = [sys.executable, os.path.abspath(__file__), "rank", "--ready", args.ready]
        for item in args.behave:
            argv += ["--behave", item]
        with open(os.path.join(args.ready, f"log-{rank}"), "wb") as log:
            child = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        children[child.pid] = rank
    while children:
        try:
            pid, status = os.wait()  # PID 1: orphans of this namespace come here too
        except ChildProcessError:
            break
        rank = children.pop(pid, None)
        if rank is not None:
            note(args.ready, f"exit-{rank}", str(os.waitstatus_to_exitcode(status)))
    if store is not None and args.hold:  # serve the store on until READY/<hold> exists
        while not os.path.exists(os.path.join(args.ready, args.hold)):
            time.sleep(0.02)
    # Gone with its ranks, without finalizing Python: with torch loaded and a store served
    # that took seconds of a loaded 2-core machine, and the tests time the ranks, not this.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def laggard(what: str, path: str) -> None:
    """Behave as a laggard that never enters the next collective (or only after 600 s)."""
    if what == "loop":
        while True:  # stuck in Python
            time.sleep(0.05)
    elif what == "lock":
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()  # no CPU, no I/O: stuck
    elif what == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif what == "checkpoint":  # like torch.save of a large model, without paused()
        import torch

        end = time.monotonic() + 600.0
        state = {f"layer{i}": torch.randn(256, 256) for i in range(8)}
        with open(path, "wb") as f:
            while time.monotonic() < end:
                for tensor in state.values():
                    f.write(tensor.numpy().tobytes())
                f.seek(0)
    else:
        raise ValueError(f"unknown laggard behaviour {what!r}")


def rank_main(args: argparse.Namespace) -> None:
    import peerwatch

    rank = int(os.environ["RANK"])
    peerwatch.install()
    behaviours = dict(item.split("=", 1) for item in args.behave)
    action = behaviours.get(str(rank), "sleep")
    note(args.ready, f"rank-{rank}", json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    name, _, arg = action.partition(":")
    if os.environ.get("LOCAL_RANK") == "0" or name in ("torch", "torch_succeed_on", "gloo"):
        # As a training script does, after install(): the store bridge waits for the
        # application's own import (peerwatch never imports torch). The host's first rank
        # has it (it is the host's bridge), the others only where they use torch: each
        # import costs about a second of CPU on a 2-core machine.
        import torch.distributed  # noqa: F401

        note(args.ready, f"imported-{rank}", "")  # the bridge may start from here on
    if name == "gloo":
        # A real process group across the hosts: rank 0 serves the job's TCPStore at
        # MASTER_ADDR:MASTER_PORT (the store the bridges use by default).
        import datetime

        import torch
        import torch.distributed as dist

        timeout_s = float(os.environ.get("MULTIHOST_GLOO_TIMEOUT_S", "60"))
        dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=datetime.timedelta(seconds=timeout_s))
        note(args.ready, f"pg-{rank}", "")
        what, _, at = arg.partition("_at=")
        step_s = float(what.partition("=")[2]) if what.startswith("step=") else 0.01
        t = torch.ones(1)
        step = 0
        while True:
            if at and step == int(at):
                note(args.ready, f"doing-{rank}", "")
                laggard(what, os.path.join(args.ready, f"checkpoint-{rank}.bin"))
            step += 1
            dist.all_reduce(t)  # fails within milliseconds when a peer on any host dies
            peerwatch.beat()
            time.sleep(step_s)
    if name in ("torch", "torch_succeed_on"):
        note(args.ready, f"torch-{rank}", "")
    while True:
        if name in ("succeed_on", "torch_succeed_on") and os.path.exists(os.path.join(args.ready, arg)):
            return
        if name == "raise_on" and os.path.exists(os.path.join(args.ready, arg)):
            raise RuntimeError(f"rank {rank} failed on purpose")
        peerwatch.beat()
        time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["host", "rank"])
    parser.add_argument("--name", default="")
    parser.add_argument("--ranks", default="")
    parser.add_argument("--world", type=int, default=0)
    parser.add_argument("--ready", required=True)
    parser.add_argument("--serve", type=int, default=0)
    parser.add_argument("--hold", default="")
    parser.add_argument("--behave", action="append", default=[])
    args = parser.parse_args()
    if args.mode == "host":
        host_main(args)
    else:
        rank_main(args)


if __name__ == "__main__":
    main()
