"""One rank of a test job. Started by the tests (and the demo), never imported.

    python rank_program.py --world 4 --style lightning --behave 2=raise@0.3 --ready DIR

Styles: ``lightning`` (rank 0 starts ranks 1..N-1 with subprocess.Popen, as Lightning's
subprocess launcher does) and ``sibling`` (the test starts every rank; this process is
one of them). Behaviours per rank, ``RANK=WHAT[@SECONDS]``:

    sleep            sleep in Python until torn down (the default)
    succeed          finish cleanly after SECONDS
    raise_at:N       beat(1..N) (noting READY/step-<rank>), then raise RuntimeError
    succeed_at:N     beat(1..N) (noting READY/step-<rank>), then finish cleanly
    raise            raise RuntimeError after SECONDS
    done_exit:N      peerwatch.mark_success() (as Lightning's callback does at on_fit_end), then
                     sys.exit(N), after SECONDS
    raise_ctrl       raise RuntimeError whose message holds ESC, BEL and NUL, after SECONDS
    raise_unprintable  raise a ValueError subclass whose __str__ raises, after SECONDS
    exit:N           sys.exit(N) after SECONDS
    exit_pow2:K      sys.exit(2**K) after SECONDS (exits 255 when it does not fit a C long)
    raise_exit:N     raise SystemExit(N) after SECONDS: it reaches the top of the program
                     (the ``raise SystemExit(main())`` idiom), where no Python hook sees it
    builtin_exit:N   the builtin exit(N) (site's Quitter) after SECONDS
    os_exit:N        os._exit(N) after SECONDS
    segv             segfault after SECONDS
    ignore_term      ignore SIGTERM, then sleep
    gloo             join a gloo process group and block in all_reduce
    store_wait       wait in the TCPStore for a key nobody sets
    children:N       start N sleeping child processes, then sleep
    thread_raise     a thread dies of an uncaught exception (combine: thread_raise+succeed@1)
    gil              hold the GIL in C (ctypes sleep, signals blocked) for a long time
    c_wait           wait in C without the GIL (ctypes sleep, signals blocked in the main
                     thread): as a main thread waiting in a collective, it cannot raise
    slow_exit:S      at exit (an atexit handler, registered after install(): it runs before
                     peerwatch's), destroy the process group if there is one, then take S
                     seconds more, as a cleanup that uploads logs would (combine: pg+slow_exit:2+raise_exit:3)

More for the hardening tests (pg, fork:MODE, sub:MODE, loader:N, reexec, dataloader,
noisy, and ``--child MODE``): see ``fault_behaviours.py``.

Behaviours combine with ``+``: ``1=ignore_term+gil`` ignores SIGTERM, then holds the GIL.
Each rank writes ``READY/rank-<i>`` (its pid) once it is watched (and, for gloo, in the
group). With ``--api watch``/``both``, a rank whose ``watch()`` block ends in PeerFailure
writes ``READY/peerfailure-<i>`` (JSON: rank, cause, exit_code of the failure) first.
A ``gloo`` rank writes ``READY/collective-<i>`` just before its first all_reduce.
Lightning-style rank 0 writes ``READY/exit-<i>`` (the returncode) once it has reaped rank i.
With ``--sync`` (needs ``--ready``) a rank's SECONDS (and raise_at's / succeed_at's steps) count
from when every rank is ready.
(Without SECONDS there is nothing to wait for: ``gil`` holds the GIL right after READY.)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time

import fault_behaviours

import peerwatch


class Unprintable(ValueError):
    """An exception whose message cannot be made: its ``__str__`` raises."""

    def __str__(self) -> str:
        raise ValueError("this exception has no message")


def _install_options(rank: int) -> dict:
    """``RP_ON_VERDICT_FILE=PATH``: an on_verdict callable that appends a JSON line (the
    rank that ran it, the verdict's rank and cause, the report's path) to PATH."""
    path = os.environ.get("RP_ON_VERDICT_FILE")
    if not path:
        return {}

    def on_verdict(verdict: object, report_path: str) -> None:
        line = {"by": rank, "rank": getattr(verdict, "rank"), "cause": getattr(verdict, "cause"),  # noqa: B009
                "report": report_path, "report_exists": os.path.exists(report_path)}
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")

    return {"on_verdict": on_verdict}


def parse_behaviours(items: list[str]) -> dict[int, tuple[str, float]]:
    out = {}
    for item in items:
        rank, _, what = item.partition("=")
        action, _, delay = what.partition("@")
        out[int(rank)] = (action, float(delay or 0.0))
    return out


def note(args: argparse.Namespace, name: str, text: str) -> None:
    if args.ready:
        path = os.path.join(args.ready, name)
        tmp = f"{path}.{os.getpid()}.tmp"  # per process: two writers never share it
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)


def ready(args: argparse.Namespace, rank: int) -> None:
    note(args, f"rank-{rank}", str(os.getpid()))


def wait_for_all(args: argparse.Namespace, timeout: float = 60.0) -> None:
    """Wait until every rank of the job is ready (--sync): delays then count from there."""
    names = {f"rank-{r}" for r in range(args.world)}
    deadline = time.monotonic() + timeout
    while not names <= set(os.listdir(args.ready)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"not every rank was ready within {timeout}s")
        time.sleep(0.01)


def _slow_exit(seconds: float) -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_initialized():
        dist.destroy_process_group()  # the peers' collectives fail now: "Connection closed by peer"
    time.sleep(seconds)


def behave(args: argparse.Namespace, rank: int, action: str, delay: float) -> None:
    parts = action.split("+")
    for part in parts:
        name, _, arg = part.partition(":")
        if name == "ignore_term":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if name == "children":
            for _ in range(int(arg or 1)):
                subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        if name == "thread_raise":
            import threading

            def fail() -> None:
                raise ValueError(f"a helper thread of rank {rank} failed")

            worker = threading.Thread(target=fail, name="prefetcher")
            worker.start()
            worker.join()
        if name == "slow_exit":
            import atexit

            atexit.register(_slow_exit, float(arg))
        if name in fault_behaviours.PARTS:
            fault_behaviours.part(args, rank, name, arg, note)
    name, _, arg = parts[-1].partition(":")
    if name in ("gloo", "store_wait"):
        import datetime

        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=args.world, timeout=datetime.timedelta(seconds=120))
        ready(args, rank)
        if name == "gloo":
            t = torch.ones(1)
            note(args, f"collective-{rank}", "")  # next: the first all_reduce
            while True:
                dist.all_reduce(t)  # blocks as soon as any peer stops taking part
                time.sleep(0.01)
        store = dist.distributed_c10d._get_default_store()
        store.wait(["never-set"], datetime.timedelta(seconds=300))
        return
    if name in fault_behaviours.ACTIONS:
        fault_behaviours.act(args, rank, name, arg, delay, ready, wait_for_all)
        return
    ready(args, rank)
    if args.sync and (delay or name in ("raise_at", "succeed_at")):
        wait_for_all(args)  # steps, like delays, count from when every rank is ready
    if delay:
        time.sleep(delay)
    if name in ("raise_at", "succeed_at"):
        # beat(step) for steps 1..N, noting each (READY/step-<rank>), then raise or finish
        for step in range(1, int(arg) + 1):
            time.sleep(0.01)
            peerwatch.beat(step)
            note(args, f"step-{rank}", str(step))
        if name == "raise_at":
            raise RuntimeError(f"rank {rank} failed on purpose at step {arg}")
        return
    if name == "succeed":
        return
    if name == "raise":
        note(args, f"raised-{rank}", str(time.time_ns()))  # when it raised, for the report's "failed at"
        raise RuntimeError(f"rank {rank} failed on purpose")
    if name == "done_exit":
        peerwatch.mark_success()
        sys.exit(int(arg))
    if name == "raise_ctrl":
        raise RuntimeError(f"rank {rank} \x1b[31mred\x1b[0m \x07bell \x00nul")
    if name == "raise_unprintable":
        raise Unprintable()
    if name == "exit":
        sys.exit(int(arg))
    if name == "exit_pow2":
        sys.exit(2 ** int(arg))
    if name == "raise_exit":
        raise SystemExit(int(arg))
    if name == "builtin_exit":
        exit(int(arg))  # the builtin, as a script would call it
    if name == "os_exit":
        os._exit(int(arg))
    if name == "segv":
        ctypes.string_at(0)
    if name == "c_wait":
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())  # delivered to another thread
        ctypes.CDLL(None).sleep(600)  # CDLL: the GIL is released, the watcher runs
    if name == "gil":
        # Like a long computation in C: signals must not cut the call short (a handled
        # signal ends sleep() early, and Python would get the GIL back), so the main
        # thread blocks them; the kernel delivers them to another thread instead.
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        ctypes.PyDLL(None).sleep(600)  # PyDLL: the GIL stays held during the call
    step = 0
    while True:
        time.sleep(0.05)
        step += 1
        peerwatch.beat(step)
        if os.environ.get("RP_NOTE_STEPS"):
            note(args, f"step-{rank}", str(step))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--style", choices=["lightning", "sibling"], default="sibling")
    parser.add_argument("--api", choices=["install", "watch", "both"], default="install")
    parser.add_argument("--behave", action="append", default=[])
    parser.add_argument("--ready", default="")
    parser.add_argument("--sync", action="store_true", help="count delays from when every rank is ready")
    parser.add_argument("--child", default="", help="be a subprocess child of a rank (fault_behaviours.py)")
    args = parser.parse_args()
    if args.child:
        fault_behaviours.child_main(args, note)
        return
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    fault_behaviours.reserve_fds()  # before peerwatch opens any (``starve``)
    if args.api in ("install", "both"):
        peerwatch.install(**_install_options(rank))
    children = []
    if args.style == "lightning" and rank == 0:
        for child_rank in range(1, args.world):
            env = dict(os.environ, LOCAL_RANK=str(child_rank), NODE_RANK="0", WORLD_SIZE=str(args.world))
            env.pop("RANK", None)
            children.append(subprocess.Popen([sys.executable, *sys.argv], env=env))
    action, delay = parse_behaviours(args.behave).get(rank, ("sleep", 0.0))
    try:
        if args.api in ("watch", "both"):
            try:
                with peerwatch.watch():
                    behave(args, rank, action, delay)
                # RP_EXIT_AFTER_WATCH=RANK:N: that rank exits N once its watch() block ended cleanly.
                who, _, code = os.environ.get("RP_EXIT_AFTER_WATCH", "").partition(":")
                if who and int(who) == rank:
                    sys.exit(int(code))
            except peerwatch.PeerFailure as e:
                fields = {"rank": e.rank, "cause": e.cause, "exit_code": e.exit_code}
                note(args, f"peerfailure-{rank}", json.dumps(fields))
                raise
        else:
            behave(args, rank, action, delay)
    except BaseException:
        # Leaving by an exception, the Popen objects reap the children that have ended
        # (Popen.__del__ polls): say how those ended, as nobody else can learn it.
        # (Unless KEEP_CHILDREN_VAR is set: see fault_behaviours.reaped_on_error.)
        for child_rank, child in enumerate(fault_behaviours.reaped_on_error(children), start=1):
            if child.poll() is not None:
                note(args, f"exit-{child_rank}", str(child.returncode))
        raise
    for child_rank, child in enumerate(children, start=1):
        note(args, f"exit-{child_rank}", str(child.wait()))


if __name__ == "__main__":
    main()
