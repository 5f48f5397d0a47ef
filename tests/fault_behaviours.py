"""Behaviours of ``rank_program.py`` for the hardening tests (fault matrix, fork and exec,
false positives). rank_program imports this module; nothing here imports torch until a
behaviour needs it.

Parts (combine with ``+`` like rank_program's own; they run in order, before READY):

    pg               join the gloo process group (MASTER_ADDR/MASTER_PORT), then wait until
                     every ``gloo`` rank of the job is about to enter its all_reduce
                     (READY/collective-<r>): the failure that follows finds them blocked in it
    fork:MODE        os.fork() a child that runs the child scenario MODE and ends through the
                     interpreter's normal exit paths; wait for it; note READY/fork-<rank>
                     (JSON: pid, returncode)
    sub:MODE         the same with a ``subprocess`` child (a fresh interpreter running this
                     program with ``--child MODE``): it inherits PEERWATCH_DIR and RANK;
                     note READY/sub-<rank>
    orphan_fork:MODE / orphan_sub:MODE
                     the child first waits until this rank is gone, then runs MODE; not
                     waited for (note READY/fork-<rank> / sub-<rank> with its pid only)
    loader:N         iterate N items of a torch DataLoader (2 workers, fork start method)
                     whose workers call install(), beat() and watch(); shut it down; note
                     READY/loader-<rank> (JSON: worker pids, whether install() returned None
                     in each)
    default_interrupt
                     reset peerwatch's interrupt signal to SIG_DFL (as an application that
                     resets the real-time signals does)
    reexec           os.execv() this very program once (same pid; it installs again);
                     note READY/preexec-<rank>, then (new image) READY/execed-<rank>

Actions (the last part; ``SECONDS`` as in rank_program):

    dataloader       iterate for ever over a torch DataLoader (num_workers=2, fork start
                     method); READY once the first batch arrived (the workers exist)
    noisy            finish cleanly after SECONDS of work: random sleeps and CPU bursts,
                     beat() every step (scheduling noise for the false-positive runs)
    await:NAME       finish cleanly once READY/NAME exists (another process wrote it); NAME,NAME...:
                     once each of them exists
    raise_after:NAME raise RuntimeError once READY/NAME exists
    clobber:MODE     once every rank is ready, take peerwatch's descriptors away: ``devnull``
                     dup2s /dev/null over fds 3-39, ``close`` closes them (os.closerange);
                     note READY/clobbered-<rank>, then sleep and beat()
    clobber_exit:MODE as clobber, over more descriptors (``devnull``: 3-199, ``close``:
                     os.closerange(3, 65536)), then sys.exit(0) at once
    exec_away        once every rank is ready, os.execv() a plain sleeping Python (same
                     pid, no peerwatch, the stack file closed on exec)
    setuid_away:UID  once every rank is ready, os.setuid(UID), then sleep
    starve:S         once every rank is ready and watched, run out of file descriptors (the soft
                     RLIMIT_NOFILE lowered to the numbers held since the start, see RESERVE_VAR:
                     EMFILE for every thread, peerwatch's too, whatever it closes, as with many
                     DataLoader workers); note READY/starved-<rank>; after S seconds raise the
                     limit again and finish cleanly
    starve_exit      as starve (needs RESERVE_VAR), and finish cleanly at once, still out of
                     descriptors
    starve_raise     as starve_exit, but raise RuntimeError at once
    leak_exit        once every rank is ready, under ``ulimit -n 128`` (soft = hard), open files
                     until EMFILE and hold them; note READY/starved-<rank>; finish cleanly at once

Child scenarios (MODE): ``exit0`` (sys.exit(0)), ``raise`` (uncaught RuntimeError),
``exit3`` (sys.exit(3)), ``quit5`` (the builtin exit(5)), ``raise5`` (raise SystemExit(5)),
``segv`` (segfault), ``install`` (install(), beat(), a watch()
block; notes READY/child-<rank>-<mode> with what they returned, then sys.exit(3)).
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import os
import random
import select
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

import peerwatch

KEEP_CHILDREN_VAR = "RANK_PROGRAM_KEEP_CHILDREN"
# RANK_PROGRAM_RESERVE_FDS=N: the rank holds fds 3..N+2 (/dev/null) from its start, before
# peerwatch opens any. ``starve`` lowers the soft limit to N+3: every number below it is then
# held for good (stdio, these), so nothing peerwatch closes (a dead peer's pidfd) lets it open
# anything; and poll(2), which fails (EINVAL) on more descriptors than the limit, still
# works when N covers the watcher's (world size + 1: the wake pipe, the pidfds, inotify's).
RESERVE_VAR = "RANK_PROGRAM_RESERVE_FDS"
_reserved: List[int] = []


def reserve_fds() -> None:
    """Hold the descriptors RESERVE_VAR asks for (at the start of the rank)."""
    for _ in range(int(os.environ.get(RESERVE_VAR) or 0)):
        _reserved.append(os.open(os.devnull, os.O_RDONLY))
    if _reserved != list(range(3, 3 + len(_reserved))):
        raise RuntimeError(f"{RESERVE_VAR}: fds {_reserved} are not 3..{len(_reserved) + 2}")


def reaped_on_error(children: List[Any]) -> List[Any]:
    """The children Lightning-style rank 0 reaps as it leaves by an exception: all, unless
    ``RANK_PROGRAM_KEEP_CHILDREN=1``. Reaping in the except clause (before the excepthook)
    races with rank 0's watcher reading a dead child's exit status (waitid WNOWAIT): when
    a child is killed, rank 0's gloo collective fails at the same moment, and whichever
    comes first decides whether peerwatch learns the signal. Lightning itself leaves its
    Popen objects alone until the interpreter shuts down (after the excepthook), so the
    fault matrix sets the variable."""
    return [] if os.environ.get(KEEP_CHILDREN_VAR) == "1" else children


PARTS = frozenset({"pg", "fork", "sub", "orphan_fork", "orphan_sub", "loader", "reexec", "default_interrupt"})
ACTIONS = frozenset({"dataloader", "noisy", "await", "raise_after", "clobber", "clobber_exit", "exec_away",
                     "setuid_away", "starve", "starve_exit", "starve_raise", "leak_exit"})
CLOBBERED_FDS = range(3, 40)
EXECED_VAR = "PEERWATCH_TEST_EXECED"  # set in the environment of the re-executed image

Note = Callable[[argparse.Namespace, str, str], None]


def _behaviours(items: List[str]) -> Dict[int, str]:
    out = {}
    for item in items:
        rank, _, what = item.partition("=")
        out[int(rank)] = what.partition("@")[0]
    return out


def rank_of_environment() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def _wait_files(folder: str, names: List[str], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not set(names) <= set(os.listdir(folder)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"not written within {timeout}s: {sorted(set(names) - set(os.listdir(folder)))}")
        time.sleep(0.01)


def _wait_gone(pid: int, timeout: float = 120.0) -> None:
    """Wait until process ``pid`` has ended (its pidfd polls readable)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            raise RuntimeError(f"pid {pid} still alive after {timeout}s")
    finally:
        os.close(fd)


# -- parts ------------------------------------------------------------------------------


def part(args: argparse.Namespace, rank: int, name: str, arg: str, note: Note) -> None:
    if name == "pg":
        _join_process_group(args, rank)
    elif name in ("fork", "orphan_fork"):
        _fork_child(args, rank, arg, orphan=name == "orphan_fork", note=note)
    elif name in ("sub", "orphan_sub"):
        _sub_child(args, rank, arg, orphan=name == "orphan_sub", note=note)
    elif name == "loader":
        _loader(args, rank, int(arg or 4), note)
    elif name == "reexec":
        _reexec(args, rank, note)
    elif name == "default_interrupt":
        import signal

        signal.signal(peerwatch.proc.teardown.INTERRUPT_SIGNAL, signal.SIG_DFL)


def _join_process_group(args: argparse.Namespace, rank: int) -> None:
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=args.world, timeout=datetime.timedelta(seconds=120))
    blocked = [r for r, what in _behaviours(args.behave).items() if what.split("+")[-1] == "gloo" and r != rank]
    if args.ready and blocked:
        _wait_files(args.ready, [f"collective-{r}" for r in blocked])


def _fork_child(args: argparse.Namespace, rank: int, mode: str, orphan: bool, note: Note) -> None:
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        if orphan:
            _wait_gone(parent)
        child_scenario(args, rank, mode, note)  # leaves by an exception, sys.exit or a crash
        os._exit(99)  # never reached: the child must never go on as the rank
    if orphan:
        note(args, f"fork-{rank}", json.dumps({"pid": pid}))
        return
    _, status = os.waitpid(pid, 0)
    note(args, f"fork-{rank}", json.dumps({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)}))


def _sub_child(args: argparse.Namespace, rank: int, mode: str, orphan: bool, note: Note) -> None:
    import subprocess

    argv = [sys.executable, os.path.abspath(sys.argv[0]), "--world", str(args.world), "--ready", args.ready,
            "--child", ("orphan_" if orphan else "") + mode]
    child = subprocess.Popen(argv)  # inherits the environment: PEERWATCH_DIR, RANK, ...
    if orphan:
        note(args, f"sub-{rank}", json.dumps({"pid": child.pid}))
        return
    note(args, f"sub-{rank}", json.dumps({"pid": child.pid, "returncode": child.wait()}))


def child_main(args: argparse.Namespace, note: Note) -> None:
    """``rank_program.py --child MODE``: a subprocess child of a rank (see ``sub:MODE``)."""
    mode = args.child
    if mode.startswith("orphan_"):
        mode = mode[len("orphan_"):]
        _wait_gone(os.getppid())  # the rank that started us
    child_scenario(args, rank_of_environment(), mode, note)


def child_scenario(args: argparse.Namespace, rank: int, mode: str, note: Note) -> None:
    """What a child of rank ``rank`` does; ends by an exception, sys.exit or a crash."""
    if mode == "exit0":
        sys.exit(0)
    if mode == "raise":
        raise RuntimeError(f"a child of rank {rank} failed on purpose")
    if mode == "exit3":
        sys.exit(3)
    if mode == "quit5":
        exit(5)  # the builtin: it inherits the rank's replacement, and its on_exit callback
    if mode == "raise5":
        raise SystemExit(5)
    if mode == "segv":
        ctypes.string_at(0)
    if mode == "install":
        got: Dict[str, Any] = {"pid": os.getpid()}
        try:
            got["install"] = None if peerwatch.install() is None else "a watcher"
        except Exception as e:  # noqa: BLE001 - noted for the test to judge
            got["install"] = f"raised {type(e).__name__}: {e}"
        peerwatch.beat(7)
        with peerwatch.watch() as w:
            got["watch"] = None if w is None else "a watcher"
        got["verdict"] = repr(peerwatch.api.current_verdict())
        note(args, f"child-{rank}-{mode}", json.dumps(got))
        sys.exit(3)
    raise SystemExit(f"unknown child scenario {mode!r}")


class _Probe:
    """A map-style dataset whose items are computed in DataLoader workers that try to act as the rank."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Tuple[int, bool, bool]:
        installed = peerwatch.install()
        peerwatch.beat(i)
        with peerwatch.watch() as w:
            pass
        time.sleep(0.02)  # let both workers take items
        return os.getpid(), installed is None, w is None


def _loader(args: argparse.Namespace, rank: int, n: int, note: Note) -> None:
    import psutil
    from torch.utils.data import DataLoader

    loader = DataLoader(_Probe(n), batch_size=1, num_workers=2, multiprocessing_context="fork",
                        collate_fn=lambda batch: batch[0])
    items = list(loader)  # exhausted: the workers are shut down and joined
    pids = sorted({pid for pid, _, _ in items})
    for pid in pids:
        try:
            psutil.Process(pid).wait(30)
        except psutil.NoSuchProcess:
            pass
    note(args, f"loader-{rank}", json.dumps({
        "workers": pids, "install_none": all(i for _, i, _ in items), "watch_none": all(w for _, _, w in items),
    }))


def _reexec(args: argparse.Namespace, rank: int, note: Note) -> None:
    if os.environ.get(EXECED_VAR):
        note(args, f"execed-{rank}", str(os.getpid()))
        return
    note(args, f"preexec-{rank}", str(os.getpid()))
    os.environ[EXECED_VAR] = str(os.getpid())
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.argv])


# -- actions ------------------------------------------------------------------------------


def _wait_watching(peers: int, timeout: float = 60.0) -> None:
    """Wait until this rank's watcher holds a pidfd of each of its ``peers`` local peers."""
    deadline = time.monotonic() + timeout
    while True:
        held = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                held += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]"
            except OSError:
                continue
        if held >= peers:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the watcher holds {held} pidfds, not {peers}, after {timeout}s")
        time.sleep(0.01)


def _starve(args: argparse.Namespace, rank: int, seconds: float) -> None:
    """Run out of descriptors for ``seconds`` (see ``starve`` in the module's docstring)."""
    import resource

    soft, hard, note_fd = _run_out_of_descriptors(args, rank)
    time.sleep(seconds)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    os.close(note_fd)


_leaked: List[int] = []


def _leak_until_out(args: argparse.Namespace, rank: int) -> None:
    """Under ``ulimit -n 128`` (soft = hard: no limit to raise), open /dev/null until EMFILE
    and hold every one, as a leak does; note READY/starved-<rank>."""
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
    path = os.path.join(args.ready, f"starved-{rank}")
    note_fd = os.open(f"{path}.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    while True:
        try:
            _leaked.append(os.open(os.devnull, os.O_RDONLY))
        except OSError as e:
            if e.errno != errno.EMFILE:
                raise
            break
    os.write(note_fd, str(time.time_ns()).encode())
    os.replace(f"{path}.tmp", path)  # no descriptor needed


def _run_out_of_descriptors(args: argparse.Namespace, rank: int) -> Tuple[int, int, int]:
    """Lower the soft limit to the numbers held (see RESERVE_VAR), note READY/starved-<rank>;
    returns the limits it had and the note's descriptor."""
    import resource

    if os.environ.get("PEERWATCH_PIDFD") != "0":
        _wait_watching(args.world - 1)
    else:
        time.sleep(0.5)  # the polling watcher looks every 0.1 s: its peers are registered by then
    path = os.path.join(args.ready, f"starved-{rank}")
    note_fd = os.open(f"{path}.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # written once starved
    if not _reserved:
        raise RuntimeError(f"starve needs {RESERVE_VAR}")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # A new descriptor must have a number below the soft limit: from now on every open, pipe,
    # socket... of any thread fails with EMFILE (see RESERVE_VAR).
    resource.setrlimit(resource.RLIMIT_NOFILE, (3 + len(_reserved), hard))
    os.write(note_fd, str(time.time_ns()).encode())
    os.replace(f"{path}.tmp", path)  # no descriptor needed
    return soft, hard, note_fd


class _Forever:
    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, i: int) -> int:
        time.sleep(0.002)
        return i


def _dup2_retrying(src: int, dst: int) -> None:
    """dup2 fails with EBUSY (Linux only) when ``dst`` is a slot another thread is opening
    at that instant -- peerwatch's threads open files while this loop runs. Try again, as
    an application would have to."""
    deadline = time.monotonic() + 5.0
    while True:
        try:
            os.dup2(src, dst, inheritable=False)
            return
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() >= deadline:
                raise
            time.sleep(0.001)


def act(args: argparse.Namespace, rank: int, name: str, arg: str, delay: float,
        ready: Callable[[argparse.Namespace, int], None], wait_for_all: Callable[[argparse.Namespace], None]) -> None:
    if name == "dataloader":
        from torch.utils.data import DataLoader

        loader = DataLoader(_Forever(), batch_size=4, num_workers=2, multiprocessing_context="fork")
        batches = iter(loader)
        next(batches)  # the workers run
        ready(args, rank)
        for _ in batches:
            peerwatch.beat()
            time.sleep(0.01)
    elif name == "await":
        ready(args, rank)
        _wait_files(args.ready, arg.split(","), timeout=120.0)
    elif name in ("starve", "starve_exit", "starve_raise", "leak_exit"):
        ready(args, rank)
        wait_for_all(args)
        if name == "starve":
            _starve(args, rank, float(arg))
        elif name == "leak_exit":
            _leak_until_out(args, rank)  # and finish cleanly at once, still out of them
        else:
            _run_out_of_descriptors(args, rank)  # and finish at once, still out of them
            if name == "starve_raise":
                raise RuntimeError(f"rank {rank} failed out of descriptors")
    elif name == "raise_after":
        ready(args, rank)
        _wait_files(args.ready, [arg], timeout=120.0)
        raise RuntimeError(f"rank {rank} failed on purpose")
    elif name in ("clobber", "clobber_exit", "exec_away", "setuid_away"):
        ready(args, rank)
        wait_for_all(args)
        if name == "exec_away":
            sys.stdout.flush()
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)"])
        if name == "setuid_away":
            os.setuid(int(arg))
            while True:
                time.sleep(0.05)
        _wait_watching(args.world - 1)
        fds = CLOBBERED_FDS if name == "clobber" else range(3, 200 if arg == "devnull" else 65536)
        if arg == "devnull":
            null = os.open(os.devnull, os.O_RDWR)
            for fd in fds:
                if fd != null:
                    _dup2_retrying(null, fd)
        else:
            os.closerange(fds.start, fds.stop)
        path = os.path.join(args.ready, f"clobbered-{rank}")
        with open(f"{path}.tmp", "w") as f:
            f.write(str(time.time_ns()))
        os.replace(f"{path}.tmp", path)
        if name == "clobber_exit":
            sys.exit(0)
        while True:
            time.sleep(0.05)
            peerwatch.beat()
    elif name == "noisy":
        ready(args, rank)
        if args.sync and delay:
            wait_for_all(args)
        rng = random.Random(os.getpid() ^ time.time_ns())
        end = time.monotonic() + delay
        while time.monotonic() < end:
            if rng.random() < 0.5:
                time.sleep(rng.uniform(0.0, 0.05))
            else:
                burn_until = time.monotonic() + rng.uniform(0.0, 0.03)
                while time.monotonic() < burn_until:
                    pass
            peerwatch.beat()
