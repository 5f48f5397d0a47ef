"""Teardown: peerwatch's own signals, stack dumps, signalling verified process trees, grace,
SIGKILL, leaving.

The signals' one home, for the rank that installs a handler (:mod:`peerwatch.rundir.stacks`,
:mod:`peerwatch.hooks`) and the one that sends them. Every signal goes through :func:`send`, which only signals a :class:`Target`: a process
verified (pid, start time, uid) when the target was made, and held by a pidfd where the
OS has them, so a pid reused in between cannot be hit.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import select
import signal
import stat
import threading
import time
from typing import AbstractSet, Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from . import identity

logger = logging.getLogger("peerwatch")

RTMIN = int(getattr(signal, "SIGRTMIN", 34))
# Signals of our own, from the real-time range that training code does not use.
INTERRUPT_SIGNAL = RTMIN + 4  # raise PeerFailure in a rank's main thread
# faulthandler dumps all stacks on it (works under a held GIL). SIGURG because its default
# action is to do nothing: a process whose handler is gone (an interpreter shutting down
# unregisters faulthandler) is not killed by a late dump request.
STACKS_SIGNAL = int(signal.SIGURG)


def signal_label(sig: int) -> str:
    """``SIGTERM``, ``SIGRTMIN+4``, or the number for one Python does not name."""
    if sig > RTMIN:
        return f"SIGRTMIN+{sig - RTMIN}"
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)


# Where a teardown's signals are recorded: ``note(event, rank, **fields)`` (the caller's
# event log; this package knows no run directory).
Note = Callable[..., None]


def _no_note(event: str, rank: Optional[int], **fields: Any) -> None:
    """Record nothing: a caller with no event log."""


_PIDFD = hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal")
_DUMP_WAIT_S = 0.5  # at most, before SIGTERM: how long targets get to write a dump asked for
_DUMP_POLL_S = 0.002  # how often /proc is read meanwhile (only while a dump is under way)


@dataclasses.dataclass
class Target:
    pid: int
    start_ticks: int
    uid: int
    label: str  # "rank 3" or "pid 812, a child of rank 3": for people
    pidfd: Optional[int] = None
    rank: Optional[int] = None  # the rank it is (not a descendant's): for the event log
    dump_asked: bool = False  # a STACKS_SIGNAL was sent to it (terminate waits for the dump)

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def make_target(pid: int, start_ticks: int, uid: int, label: str, rank: Optional[int] = None) -> Optional[Target]:
    """A target for pid if it is alive and is the process that started at start_ticks."""
    if pid <= 1 or pid == os.getpid() or uid != os.geteuid():
        return None
    pidfd = None
    if _PIDFD:
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return None
    # Verified after the pidfd is open: the fd now pins this very process.
    if not identity.is_same_process(pid, start_ticks, uid):
        if pidfd is not None:
            os.close(pidfd)
        return None
    return Target(pid, start_ticks, uid, label, pidfd, rank)


def stack_file_problem(path: str) -> Optional[str]:
    """Why the file at ``path`` cannot vouch for a process, or None if it can.

    Only a regular file of this user with one link, looked at without following a symlink
    at the end of ``path``: a symlink to ``/dev/null``, a device, a FIFO or a hard link
    to some other file would make any process holding that other file look like a rank.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "is missing"
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this user"
    if st.st_nlink != 1:
        return f"has {st.st_nlink} hard links"
    return None


def holds_file(pid: int, path: str) -> bool:
    """True if process pid has the regular file at ``path`` open (compared by device and inode).

    Every rank keeps its stack file open for faulthandler, so a process holding a rank's
    stack file is that rank (or a process it forked): a pid file naming any other process
    (pid 1, an unrelated process of ours, a forged record) is not vouched for by the OS.
    ``path`` is never followed if it is a symlink, and only a regular file of ours with
    one link vouches (:func:`stack_file_problem`).
    """
    if stack_file_problem(path) is not None:
        return False
    try:
        want = os.lstat(path)
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            st = os.stat(f"/proc/{pid}/fd/{fd}")  # follows the fd's link: the open file itself
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino) and stat.S_ISREG(st.st_mode):
            return True
    return False


def inherited_run(pid: int, run_dir: str) -> bool:
    """True if process pid was started with ``PEERWATCH_DIR=run_dir`` in its environment
    (a child that a rank started after ``install()`` exported it)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read(1 << 20)
    except OSError:
        return False
    return f"PEERWATCH_DIR={run_dir}".encode() in env.split(b"\0")


def process_tree() -> Dict[int, List[int]]:
    """parent pid -> child pids, for every process visible in /proc (one walk)."""
    tree: Dict[int, List[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return tree
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue  # gone meanwhile
        fields = data.rpartition(b")")[2].split()
        if len(fields) > 1:
            tree.setdefault(int(fields[1]), []).append(int(name))
    return tree


def descendants(
    pid: int, uid: int, exclude: Set[int], tree: Optional[Dict[int, List[int]]] = None,
    spare: AbstractSet[int] = frozenset(),
) -> List[Tuple[int, int]]:
    """(pid, start_ticks) of pid's live descendants owned by uid, minus ``exclude`` (peers).

    ``tree``: a :func:`process_tree` snapshot, to share one /proc walk between calls.
    ``spare``: processes left out with their whole subtree (the on_verdict hook's command,
    which has a bound of its own).
    """
    if pid == os.getpid() and not _has_children():
        return []  # the common case, told without walking /proc
    if tree is None:
        tree = process_tree()
    found = []
    todo, seen = list(tree.get(pid, ())), {pid}
    while todo:
        child = todo.pop()
        if child in seen or child in spare:
            continue
        seen.add(child)
        todo.extend(tree.get(child, ()))
        if child in exclude or _ends_by_itself(child):
            continue
        try:
            info = identity.probe(child)
        except identity.Unknown:
            continue  # cannot be verified: never signalled
        if info is not None and not info.dead and info.uid == uid:
            found.append((child, info.start_ticks))
    return found


_RESOURCE_TRACKER = "from multiprocessing.resource_tracker import main"


def _ends_by_itself(pid: int) -> bool:
    """multiprocessing's resource tracker ignores SIGTERM and ends once the processes that
    hold its pipe are gone; it must outlive them, to unlink the shared memory they leaked.
    Signalling it would only hold the teardown up for the grace period, then SIGKILL it."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read(1 << 16).decode("utf-8", "replace").split("\0")
    except OSError:
        return False
    return any(arg == "-c" and nxt.startswith(_RESOURCE_TRACKER) for arg, nxt in zip(cmd, cmd[1:]))


def _has_children() -> bool:
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def send(target: Target, sig: int, reason: str, note: Note = _no_note) -> bool:
    """Signal a verified target. Returns False if it is gone (or no longer the same process).
    ``note`` records the signal (the caller's event log)."""
    try:
        if target.pidfd is not None:
            signal.pidfd_send_signal(target.pidfd, sig)
        else:
            if not identity.is_same_process(target.pid, target.start_ticks, target.uid):
                return False
            os.kill(target.pid, sig)
    except ProcessLookupError:
        return False
    except OSError as e:
        logger.warning("peerwatch: could not send %s to %s: %s", signal_label(sig), _named(target), e)
        return False
    if sig == STACKS_SIGNAL:
        target.dump_asked = True
    else:
        logger.warning("peerwatch: sent %s to %s: %s", signal_label(sig), _named(target), reason)
    note("signal", target.rank, pid=target.pid, signal=signal_label(sig), target=target.label, reason=reason)
    return True


def _named(target: Target) -> str:
    """The target for people, with its pid once: ``rank 3 (pid 812)``, ``pid 901, a
    descendant of rank 3 (pid 812)`` (a label that starts with the pid says it already)."""
    if target.label.startswith(f"pid {target.pid},"):
        return target.label
    return f"{target.label} (pid {target.pid})"


def alive(target: Target) -> bool:
    """Not gone, as far as can be told: one that cannot be told now (out of descriptors...)
    is waited for, and signalled only through its pidfd or once verified (:func:`send`)."""
    if target.pidfd is not None:
        ready, _, _ = select.select([target.pidfd], [], [], 0)
        if ready:
            return False
    return identity.same_process(target.pid, target.start_ticks, target.uid) is not False


def wait_gone(targets: Sequence[Target], deadline: float) -> List[Target]:
    """Wait until every target is gone or the monotonic deadline passes; returns the living."""
    living = [t for t in targets if alive(t)]
    while living:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        fds = [t.pidfd for t in living if t.pidfd is not None]
        if len(fds) == len(living):
            select.select(fds, [], [], left)
        else:
            time.sleep(min(left, 0.01))
        living = [t for t in living if alive(t)]
    return living


def terminate(targets: Sequence[Target], grace: float, reason: str, note: Note = _no_note) -> Tuple[int, int]:
    """SIGTERM every target (SIGCONT for stopped ones), wait ``grace`` s, SIGKILL survivors.

    One deadline for all (not one per process). Returns (signalled, killed). ``note``
    records each signal and each signalled rank seen gone.
    """
    _wait_dumps_taken(targets, time.monotonic() + min(grace, _DUMP_WAIT_S))
    signalled = [t for t in targets if send(t, signal.SIGTERM, reason, note)]
    for t in signalled:
        try:
            info = identity.probe(t.pid)
        except identity.Unknown:
            continue  # cannot tell whether it is stopped: SIGKILL ends it after grace anyway
        if info is not None and info.state in ("T", "t"):
            send(t, signal.SIGCONT, "it is stopped; SIGTERM takes effect only once it runs", note)
    survivors = wait_gone(signalled, time.monotonic() + grace)
    _log_gone((t for t in signalled if t not in survivors), note)
    for t in survivors:
        send(t, signal.SIGKILL, f"still alive {grace:g}s after SIGTERM", note)
    left = wait_gone(survivors, time.monotonic() + 1.0)
    _log_gone((t for t in survivors if t not in left), note)
    return len(signalled), len(survivors)


def _log_gone(targets: Iterable[Target], note: Note) -> None:
    """For the event log: the signalled ranks seen gone (a SIGKILLed rank writes no exit record)."""
    for t in targets:
        if t.rank is not None:
            note("gone", t.rank, pid=t.pid)


def _wait_dumps_taken(targets: Sequence[Target], deadline: float) -> None:
    """Wait until no target has a dump request (STACKS_SIGNAL) pending or being handled, or
    the deadline.

    Two pending signals are delivered lowest number first: SIGTERM (15) sent right after
    SIGURG (23), before any thread of the target ran, ends it by its default action before
    faulthandler writes a line; sent while faulthandler writes, it cuts the dump short.
    Once one was seen busy, two quiet looks in a row end the wait (between taking the
    signal and entering the handler, a thread shows neither). A target asked for a dump
    gets those two looks even if the first shows neither: it may be in that moment (a
    quiet full run once had its stack file empty). A stopped target cannot take it: not
    waited for.
    """
    waiting = [t for t in targets if t.dump_asked or _dumping(t.pid)]
    quiet = 0
    while waiting and quiet < 2 and time.monotonic() < deadline:
        time.sleep(_DUMP_POLL_S)  # no event says "dump written"; bounded, and only in teardown
        busy = [t for t in waiting if _dumping(t.pid)]
        quiet = 0 if busy else quiet + 1
        waiting = busy or waiting


def _dumping(pid: int) -> bool:
    """A STACKS_SIGNAL sent to pid is pending, or a thread of pid is in its handler (the
    signal blocked there, SIGTERM not: a thread that blocks every signal is not one). Linux."""
    urg, term = 1 << (STACKS_SIGNAL - 1), 1 << (signal.SIGTERM - 1)
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        if fields["State"].split()[0] in ("T", "t", "Z", "X"):
            return False
        if int(fields["ShdPnd"], 16) & urg:
            return True
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            blocked = int(fields["SigBlk"], 16)
            if int(fields["SigPnd"], 16) & urg or (blocked & urg and not blocked & term):
                return True
    except (OSError, KeyError, ValueError, IndexError):
        return False
    return False


_interrupt_handler: Optional[object] = None  # the INTERRUPT_SIGNAL handler peerwatch installed
_handler_gone_warned = False


def own_interrupt_handler(handler: object) -> None:
    """Say which handler of INTERRUPT_SIGNAL is peerwatch's (called where it is installed)."""
    global _interrupt_handler
    _interrupt_handler = handler


def raise_in_main_thread(exc_type: type, use_signal: bool) -> None:
    """Make the main thread raise ``exc_type`` at its next Python instruction.

    With ``use_signal`` (our handler is installed for INTERRUPT_SIGNAL) the main thread is
    also woken from blocking calls that Python retries on EINTR (sleep, select, wait...).
    The handler is looked at right before: an application that reset the signal to
    SIG_DFL (or put its own handler there) would be killed by it, or not interrupted.
    """
    global _handler_gone_warned
    main = threading.main_thread().ident
    if main is None:
        return
    if use_signal:
        current = signal.getsignal(INTERRUPT_SIGNAL)  # any thread may read it (CPython)
        if _interrupt_handler is not None and current == _interrupt_handler:
            signal.pthread_kill(main, INTERRUPT_SIGNAL)
            return
        if not _handler_gone_warned:
            _handler_gone_warned = True
            logger.warning(
                "peerwatch: %s is no longer handled by peerwatch (the application set %r); not sending it, "
                "PeerFailure is raised in the main thread without it (a main thread blocked in a call is not "
                "woken)", signal_label(INTERRUPT_SIGNAL), current,
            )
    import ctypes

    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main), ctypes.py_object(exc_type))


def close_all(targets: Iterable[Target]) -> None:
    for t in targets:
        t.close()


__all__ = [
    "INTERRUPT_SIGNAL", "RTMIN", "STACKS_SIGNAL", "Note", "Target", "alive", "close_all", "descendants", "process_tree", "holds_file", "inherited_run",
    "stack_file_problem",
    "make_target", "own_interrupt_handler", "raise_in_main_thread", "send", "signal_label", "terminate", "wait_gone",
]
