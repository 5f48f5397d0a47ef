"""The keeper of an ``on_verdict`` command, run as its own program (a rank imports only its codes).

    python -I -S keeper.py BOUND_S /bin/sh -c COMMAND

It is the command's parent and a child subreaper (``PR_SET_CHILD_SUBREAPER``): whatever the
command leaves running in the background (``nohup x &``, ``setsid x &``, a double fork)
is reparented to the keeper when its own parent ends, so the whole process tree of the
hook stays below it, and nothing else ever is. It waits until that tree has ended or
``BOUND_S`` has passed (or it is sent SIGTERM: its rank is leaving), then SIGKILLs what is
left, its own children only, level by level (a child's pid cannot be reused before the
keeper reaps it), and exits:

- with the command's status (a signal N as 128 + N) when the whole tree ended in time;
- with :data:`KILLED_AT_BOUND` when something was still running at the bound;
- with :data:`ENDED_EARLY` when it was told to end the tree before the bound.

Standard library only, and few modules of it (not even ``typing``: each import delays the
hook): it runs in isolated mode, without peerwatch on its path.
"""

from __future__ import annotations

import os
import signal
import sys
import time

KILLED_AT_BOUND = 124  # as timeout(1) says it
ENDED_EARLY = 128 + signal.SIGTERM
_PR_SET_CHILD_SUBREAPER = 36
_KILL_ROUNDS = 1000  # levels of a tree ended one by one: far beyond any real hook


def _subreaper() -> None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except Exception:  # noqa: BLE001, S110 - without it, a process that left the tree is not ended
        pass


def _children() -> list[int]:
    """The keeper's own children (reaped by nobody else: their pids are safe to signal)."""
    me = os.getpid()
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{me}/task")
    except OSError:
        tasks = []
    for tid in tasks:
        try:
            with open(f"/proc/{me}/task/{tid}/children") as f:
                found.extend(int(p) for p in f.read().split())
        except (OSError, ValueError):
            return _children_by_scan(me)
    return found


def _children_by_scan(me: int) -> list[int]:
    found: list[int] = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            if int(stat[stat.rindex(")") + 2:].split()[1]) == me:
                found.append(int(name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _reap(leader: int, status: list[int | None]) -> bool:
    """Reap every child that has ended; True when the keeper has no child left."""
    while True:
        try:
            pid, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return True
        if pid == 0:
            return False
        if pid == leader:
            status[0] = os.waitstatus_to_exitcode(st)
        # Another one: a background process of the command, ended (or reparented here, then ended).


def _end_tree(leader: int, status: list[int | None]) -> None:
    for _ in range(_KILL_ROUNDS):
        if _reap(leader, status):
            return
        for pid in _children():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        # A killed child's own children are reparented to the keeper: the next round ends them.
        try:
            pid, st = os.waitpid(-1, 0)
            if pid == leader:
                status[0] = -signal.SIGKILL
        except ChildProcessError:
            return


def main(argv: list[str]) -> int:
    bound_s = float(argv[0])
    command = argv[1:]
    deadline = time.monotonic() + bound_s
    _subreaper()
    wake = [signal.SIGCHLD, signal.SIGTERM]
    signal.pthread_sigmask(signal.SIG_BLOCK, wake)  # taken by sigtimedwait below, never lost
    leader = os.fork()
    if leader == 0:
        try:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, wake)
            os.execv(command[0], command)
        finally:
            os._exit(127)
    status: list[int | None] = [None]
    while not _reap(leader, status):
        left = deadline - time.monotonic()
        if left <= 0:
            _end_tree(leader, status)
            return KILLED_AT_BOUND
        info = signal.sigtimedwait(wake, left)
        if info is not None and info.si_signo == signal.SIGTERM:
            _end_tree(leader, status)
            return ENDED_EARLY
    code = status[0] if status[0] is not None else 0
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
