"""Where observations come from: pidfds of local peers, and the exit status of a peer
that is our own child (inotify on the run directory's folders: :mod:`peerwatch.proc.waker`).

Thin OS adapters; the watcher thread owns them and polls their file descriptors.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from typing import Callable, Optional, Tuple

from ..core.records import HANG, MAX_TRACEBACK_CHARS, ExitStatus, Failure, Registration
from . import identity

logger = logging.getLogger("peerwatch")

CHILD_STATUS_POLL_S = 0.001  # a child whose pidfd fired, not yet a zombie to waitid: how often to look
CHILD_STATUS_WAIT_S = 0.05  # a dead child's status, when its pidfd fired before waitid sees it: at most


def pidfd_supported() -> bool:
    if not hasattr(os, "pidfd_open"):
        return False
    try:
        fd = os.pidfd_open(os.getpid())
    except OSError:
        return False
    os.close(fd)
    return True


def fd_identity(fd: int) -> Optional[Tuple[int, int]]:
    """(device, inode) of what ``fd`` refers to now; None if it is closed."""
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def pidfd_pid(fd: int) -> Optional[int]:
    """The pid a pidfd refers to, from ``/proc/self/fdinfo`` (``Pid:``); None if the line
    is missing (not a pidfd, or a kernel that does not say)."""
    try:
        with open(f"/proc/self/fdinfo/{fd}") as f:
            for line in f:
                if line.startswith("Pid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


class OwnedFd:
    """A descriptor this watcher opened, and how to tell that the number still is it.

    The training code shares the descriptor table: it may close our descriptors
    (``os.closerange``) or ``dup2`` something over them (``/dev/null`` over 3..39), and a
    later ``open`` may reuse the number. Readiness of such a number says nothing about
    what we opened, and closing it would close the application's file: both are done only
    after :meth:`intact` said the number still refers to what we opened (same device and
    inode, and for a pidfd the same ``Pid:``; before pidfs, every pidfd shares one inode).
    """

    def __init__(self, fd: int, pid: Optional[int] = None) -> None:
        self.fd = fd
        self.pid = pid  # a pidfd's process
        self._identity = fd_identity(fd)

    def intact(self) -> bool:
        if self._identity is None or fd_identity(self.fd) != self._identity:
            return False
        if self.pid is not None:
            # -1 / 0: the process was reaped, or is not in our PID namespace: still ours.
            pid = pidfd_pid(self.fd)
            return pid is None or pid <= 0 or pid == self.pid
        return True

    def close(self) -> None:
        """Close it if it is still ours; a number taken over by the application is left alone."""
        if self.intact():
            try:
                os.close(self.fd)
            except OSError:
                pass


def still_running(reg: Registration) -> Optional[bool]:
    """Is the process of ``reg`` (pid and start time) alive, whatever its uid now (a rank
    that changed its uid is alive, only not ours to signal)? None: it cannot be told now
    (/proc cannot be read: out of descriptors...), which is not "gone"."""
    return identity.same_process(reg.pid, reg.start_ticks)


class Peer:
    """A local peer we watch: its registration and, where the OS has them, a pidfd.

    The pidfd is opened and then the process is verified (start time, uid): from then on
    the fd refers to that process and no other, even if its pid is later reused. The
    application may close or replace the fd (see :class:`OwnedFd`): :meth:`reopen`.
    A peer is gone only when its identity says so (no such pid, another start time). One
    whose pidfd cannot be had or verified (EMFILE: the application ran out of descriptors)
    is kept without one and polled (:meth:`check_alive`, which tries its pidfd again);
    ``unsure`` says so meanwhile (:meth:`cannot_tell`).
    """

    def __init__(self, reg: Registration, use_pidfd: bool) -> None:
        self.reg = reg
        self.use_pidfd = use_pidfd
        self.pidfd: Optional[int] = None
        self._owned: Optional[OwnedFd] = None
        self.unsure = False  # a look could not tell whether it runs (see cannot_tell)
        self.alive = False
        if use_pidfd and self._open() is False:
            return  # no such pid
        self.alive = self._verify(identity.same_process(reg.pid, reg.start_ticks, reg.uid))

    def _open(self) -> Optional[bool]:
        """Open its pidfd: True; False if there is no such pid; None if it cannot be had now."""
        reg = self.reg
        try:
            self.pidfd = os.pidfd_open(reg.pid)
        except OSError as e:
            if e.errno == errno.ESRCH:
                return False
            self.cannot_tell(f"pidfd_open failed: {e.strerror}")
            return None
        os.set_inheritable(self.pidfd, False)
        self._owned = OwnedFd(self.pidfd, reg.pid)
        return True

    def _verify(self, running: Optional[bool]) -> bool:
        """After a look at its identity, with its pidfd (if any) open: False if it is gone.
        A pidfd is kept only if the look verified it (else it may pin another process that
        took the pid): one that could not tell drops it, and the peer is polled."""
        if running is None:
            self.cannot_tell("/proc cannot be read")
        if not running:
            self.forget()
            return running is None
        if self.pidfd is not None or not self.use_pidfd:
            self.unsure = False
        return True

    def cannot_tell(self, why: str) -> None:
        """A look could not tell whether it runs: its pidfd (if any) is dropped, and it is
        polled until it can be told (the watcher says so, once for all its peers)."""
        self.forget()
        if not self.unsure:
            self.unsure = True
            logger.debug("peerwatch: cannot tell whether rank %d (pid %d) still runs: %s", self.reg.rank, self.reg.pid, why)

    def pidfd_intact(self) -> bool:
        """The pidfd number still refers to the pidfd we opened (see :class:`OwnedFd`)."""
        return self._owned is not None and self._owned.intact()

    def reopen(self) -> bool:
        """After the pidfd was closed or replaced by the application (or could not be had):
        forget the number (it is not ours any more) and open a new pidfd, if the process
        still runs. False if it does not (it ended meanwhile); True if it runs, or if that
        cannot be told (then without a pidfd: polled)."""
        self.forget()
        if self.use_pidfd and self._open() is False:
            return False
        # Verified after the new pidfd is open: it pins this very process.
        return self._verify(still_running(self.reg))

    def forget(self) -> None:
        """Drop the pidfd: closed if it is still ours, left alone if it is not."""
        if self._owned is not None:
            self._owned.close()
        self._owned = None
        self.pidfd = None

    def check_alive(self) -> bool:
        """Re-check without a pidfd: the polling fallback, or a peer whose pidfd could not be
        had (it is tried again). False once it is gone; a look that cannot tell keeps it."""
        if self.alive:
            self.alive = self.reopen() if self.use_pidfd else self._verify(still_running(self.reg))
        return self.alive

    def close(self) -> None:
        self.forget()


def child_returncode(pid: int, wait_s: float = 0.0) -> Optional[int]:
    """The exit status of our own child ``pid`` if it has ended, without reaping it.

    Returned as ``subprocess`` does (``-N`` for signal N), so a ``Popen.wait()`` elsewhere
    still gets the right code. ``None`` if pid is not our child, was already reaped, or
    is still running. ``wait_s``: while the kernel says it is still running, look again
    for up to this long (its pidfd can be readable a moment before ``waitid`` sees the
    zombie: seen under load, which lost the code of a SIGKILLed child).
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            result = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except (ChildProcessError, OSError):
            return None
        if result is not None:
            break
        if time.monotonic() >= deadline:
            return None
        time.sleep(CHILD_STATUS_POLL_S)
    if result.si_code == os.CLD_EXITED:
        return result.si_status
    if result.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
        return -result.si_status
    return None


_FATAL_SIGNALS = {
    b"Segmentation fault": 11,
    b"Aborted": 6,
    b"Bus error": 7,
    b"Floating point exception": 8,
    b"Illegal instruction": 4,
}


def fatal_signal_in(stack_dump: bytes) -> Optional[int]:
    """The signal named by faulthandler's last words (``Fatal Python error: Segmentation
    fault``) in a rank's stack file, or None."""
    marker = stack_dump.find(b"Fatal Python error: ")
    if marker < 0:
        return None
    line = stack_dump[marker + len(b"Fatal Python error: ") :].split(b"\n", 1)[0]
    for name, signum in _FATAL_SIGNALS.items():
        if line.startswith(name):
            return signum
    return None


def gil_timeout_in(stack_dump: bytes) -> Optional[str]:
    """"0:00:05" if the stack file ends with faulthandler's ``dump_traceback_later`` report
    (our gil_timeout watchdog fired), else None."""
    marker = stack_dump.rfind(b"Timeout (")
    if marker < 0 or (marker > 0 and stack_dump[marker - 1 : marker] != b"\n"):
        return None
    end = stack_dump.find(b")!", marker)
    return stack_dump[marker + len(b"Timeout (") : end].decode("ascii", "replace") if end > 0 else None


def post_mortem(
    reg: Registration, gone_ns: int, observed_by: int, read_stacks: Callable[[], bytes],
) -> Tuple[Optional[ExitStatus], Optional[Failure]]:
    """How a local peer that ended did, for everyone to know: its exit status where we are
    its parent (only a parent can learn it), else from faulthandler's last words in its
    stack file (``read_stacks()``): a fatal signal, or its own GIL watchdog's timeout (a
    failure: it was stuck with the GIL held, e.g. by C code). (None, None) if neither says."""
    returncode = child_returncode(reg.pid, CHILD_STATUS_WAIT_S) if reg.ppid == os.getpid() else None
    dump = b""
    if returncode is None:
        dump = read_stacks()
        signum = fatal_signal_in(dump)
        returncode = -signum if signum else None
    if returncode is not None:
        return ExitStatus(rank=reg.rank, pid=reg.pid, time_ns=gone_ns, returncode=returncode, observed_by=observed_by), None
    starved = gil_timeout_in(dump)
    if starved is None:
        return None, None
    return None, Failure(
        rank=reg.rank, pid=reg.pid, time_ns=gone_ns, cause=HANG,
        message=f"its watcher could not run for {starved} (the GIL was held, e.g. by C code); "
        "its gil_timeout watchdog ended it",
        traceback=dump.decode("utf-8", "replace")[-MAX_TRACEBACK_CHARS:],
    )


def oom_kill_count() -> Optional[int]:
    """How many processes the OOM killer has killed: in this process's cgroup (v2
    ``memory.events``, v1 ``memory.oom_control``) where the kernel says, else system-wide
    (``/proc/vmstat``). None if nothing tells."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    candidates = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            candidates.append(f"/sys/fs/cgroup{parts[2]}/memory.events")
            candidates.append(f"/sys/fs/cgroup/unified{parts[2]}/memory.events")
        elif "memory" in parts[1].split(","):
            candidates.append(f"/sys/fs/cgroup/memory{parts[2]}/memory.oom_control")
    candidates.append("/proc/vmstat")
    for path in candidates:
        try:
            with open(path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


__all__ = [
    "OwnedFd", "Peer", "child_returncode", "fatal_signal_in", "fd_identity", "gil_timeout_in",
    "oom_kill_count", "pidfd_pid", "pidfd_supported", "post_mortem", "still_running",
]
