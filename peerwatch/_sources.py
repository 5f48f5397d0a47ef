"""Where observations come from: pidfds of local peers, inotify on the events folder,
and the exit status of a peer that is our own child.

Thin OS adapters; the watcher thread owns them and polls their file descriptors.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from typing import Callable, List, Optional

from . import _identity
from ._records import Registration

logger = logging.getLogger("peerwatch")

CHILD_STATUS_POLL_S = 0.001  # a child whose pidfd fired, not yet a zombie to waitid: how often to look


def pidfd_supported() -> bool:
    if not hasattr(os, "pidfd_open"):
        return False
    try:
        fd = os.pidfd_open(os.getpid())
    except OSError:
        return False
    os.close(fd)
    return True


def is_local(reg: Registration) -> bool:
    """A registration is of this host if boot id and PID namespace are ours."""
    return reg.boot_id == _identity.boot_id() and reg.pidns == _identity.pid_namespace()


class Peer:
    """A local peer we watch: its registration and, where the OS has them, a pidfd.

    The pidfd is opened and then the process is verified (start time, uid): from then on
    the fd refers to that process and no other, even if its pid is later reused.
    """

    def __init__(self, reg: Registration, use_pidfd: bool) -> None:
        self.reg = reg
        self.pidfd: Optional[int] = None
        self.alive = False
        if use_pidfd:
            try:
                self.pidfd = os.pidfd_open(reg.pid)
            except OSError as e:
                if e.errno != errno.ESRCH:
                    logger.warning("peerwatch: pidfd_open(%d) for rank %d failed: %s", reg.pid, reg.rank, e)
                return
        self.alive = _identity.is_same_process(reg.pid, reg.start_ticks, reg.uid)
        if not self.alive:
            self.close()

    def check_alive(self) -> bool:
        """Re-check without a pidfd (the polling fallback)."""
        if self.alive and not _identity.is_same_process(self.reg.pid, self.reg.start_ticks, self.reg.uid):
            self.alive = False
        return self.alive

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


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


class FolderWatch:
    """inotify (through watchdog) on the folders whose changes must wake the watcher.

    ``on_change`` is called from watchdog's thread; it must be cheap and thread-safe.
    If inotify cannot be used, :attr:`active` is False and the watcher rescans on a timer.
    """

    def __init__(self, folders: List[str], on_change: Callable[[], None], name: str, disabled: bool = False) -> None:
        self.active = False
        self._observer = None
        if disabled:
            return
        try:
            from watchdog.events import FileCreatedEvent, FileMovedEvent, FileSystemEventHandler
            from watchdog.observers.inotify import InotifyObserver
        except ImportError as e:
            logger.warning("peerwatch: watchdog's inotify observer is unavailable (%s); polling instead", e)
            return

        class Handler(FileSystemEventHandler):  # type: ignore[misc]
            def on_any_event(self, event: object) -> None:
                on_change()

        try:
            observer = InotifyObserver(timeout=5.0)
            observer.name = name
            for folder in folders:
                # Only new entries: records appear by link(2) or rename(2). Opening and
                # reading the folder (every watcher's rescan) must not wake the others.
                observer.schedule(
                    Handler(), folder, recursive=False, event_filter=[FileCreatedEvent, FileMovedEvent]
                )
            observer.start()
        except OSError as e:
            logger.warning("peerwatch: cannot watch %s with inotify (%s); polling instead", folders, e)
            return
        self._observer = observer
        self.active = True

    def stop(self, timeout: float = 1.0) -> None:
        """Stop watchdog's threads and join them (not from one of them)."""
        observer, self._observer = self._observer, None
        if observer is None:
            return
        observer.stop()
        if threading.current_thread() is not observer and observer.is_alive():
            observer.join(timeout)


__all__ = [
    "FolderWatch", "Peer", "child_returncode", "fatal_signal_in", "gil_timeout_in", "is_local", "oom_kill_count", "pidfd_supported",
]
