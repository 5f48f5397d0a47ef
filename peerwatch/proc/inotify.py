"""inotify with no thread: the watcher's own poll(2) sleeps on the descriptor.

Every rank watches ``ranks/`` and ``events/`` for new entries (a record appears there by
link(2) or rename(2)), and any new entry means one thing: look again. So the events are
drained, never decoded. This replaced watchdog's observer, whose three threads per rank
decoded every event into objects passed through queues: at N = 128 on 2 cores, each
leaving rank's two records cost its 127 peers about 65 us each, about 60 % of the CPU
of a teardown (docs/performance.md).

Thin OS adapter: ``inotify_init1`` and ``inotify_add_watch`` through ctypes (the
standard library has neither), loaded on first use so that ``import peerwatch`` stays
cheap. Owned by the watcher thread's :class:`peerwatch.proc.waker.Waker`, which polls
:attr:`FolderWatch.fd` with its other descriptors.

The application shares the descriptor table (see :class:`peerwatch.proc.sources.OwnedFd`).
Every inotify instance, like every eventfd or epoll, is the same anonymous inode to
fstat(2), so :meth:`FolderWatch.intact` also asks ``/proc/self/fdinfo`` which inodes the
instance watches: only an instance watching our folders is ours.
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Callable, List, Optional, Tuple

from .sources import OwnedFd

logger = logging.getLogger("peerwatch")

IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_ONLYDIR = 0x01000000
# Only new entries. Opening and reading the folder (every watcher's rescan) must not
# wake the others, nor a record's removal.
NEW_ENTRIES = IN_CREATE | IN_MOVED_TO | IN_ONLYDIR
READ_BYTES = 65536  # one read drains this much; a queue holds at most 16384 events of 16+ bytes

_Calls = Tuple[Callable[[int], int], Callable[[int, bytes, int], int], Callable[[], int]]
_calls: Optional[_Calls] = None


def _libc_calls() -> _Calls:
    """inotify_init1, inotify_add_watch and errno, bound once. OSError or AttributeError
    where this C library has no inotify."""
    global _calls
    if _calls is None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        init, add = libc.inotify_init1, libc.inotify_add_watch
        init.argtypes, init.restype = [ctypes.c_int], ctypes.c_int
        add.argtypes, add.restype = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32], ctypes.c_int
        _calls = (init, add, ctypes.get_errno)
    return _calls


def watched_inodes(fd: int) -> Optional[List[int]]:
    """The inode numbers an inotify descriptor watches, from ``/proc/self/fdinfo`` (its
    ``inotify wd:1 ino:1a2b ...`` lines); None if that cannot be read."""
    try:
        with open(f"/proc/self/fdinfo/{fd}") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    inodes = []
    for line in lines:
        if line.startswith("inotify "):
            for field in line.split():
                if field.startswith("ino:"):
                    try:
                        inodes.append(int(field[4:], 16))
                    except ValueError:
                        pass
    return inodes


class FolderWatch:
    """One inotify instance on ``folders``, new entries only.

    :attr:`active` is False where inotify cannot be used (disabled, no such call, the
    per-user limit of instances or watches reached): the watcher then rescans on a timer.
    """

    def __init__(self, folders: List[str], disabled: bool = False) -> None:
        self.active = False
        self.fd: Optional[int] = None
        self._owned: Optional[OwnedFd] = None
        self._inodes: List[int] = []  # of the folders, as fdinfo lists them
        if not disabled:
            self._start(folders)

    def _start(self, folders: List[str]) -> None:
        try:
            init, add, last_errno = _libc_calls()
        except (OSError, AttributeError) as e:
            logger.warning("peerwatch: inotify cannot be called (%s); polling instead", e)
            return
        fd = init(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            err = last_errno()
            why = os.strerror(err)
            if err == errno.EMFILE:
                why = "out of inotify instances (fs.inotify.max_user_instances, per user) or of descriptors"
            logger.warning("peerwatch: cannot watch the run directory with inotify (%s); polling instead", why)
            return
        try:
            for folder in folders:
                if add(fd, os.fsencode(folder), NEW_ENTRIES) < 0:
                    err = last_errno()
                    raise OSError(err, f"{os.strerror(err)}: {folder}")
                self._inodes.append(os.stat(folder).st_ino)
        except OSError as e:
            os.close(fd)
            logger.warning("peerwatch: cannot watch %s with inotify (%s); polling instead", folders, e)
            return
        self.fd = fd
        self._owned = OwnedFd(fd)
        self.active = True

    def intact(self) -> bool:
        """The number still is our instance: the same kind of file, watching our folders
        (True where ``/proc/self/fdinfo`` cannot tell)."""
        if self._owned is None or not self._owned.intact():
            return False
        assert self.fd is not None
        inodes = watched_inodes(self.fd)
        return inodes is None or all(ino in inodes for ino in self._inodes)

    def drain(self) -> bool:
        """Read and drop what is queued (the watcher rescans anyway). False if the number
        is not ours any more: closed, or another file in its place (``/dev/null`` reads as
        end of file); nothing is read from a file that is not the same kind as ours."""
        if self._owned is None or not self._owned.intact():
            return False
        assert self.fd is not None
        try:
            while os.read(self.fd, READ_BYTES):
                pass
        except BlockingIOError:
            return True  # drained
        except OSError:
            return False
        return False  # end of file: not an inotify instance

    def abandon(self) -> None:
        """Forget the number, without closing it: it was found not ours any more (closing
        it would close the application's file)."""
        self._owned = None
        self.fd = None
        self.active = False

    def stop(self) -> None:
        """Close the instance, if the number still is ours (its watches go with it)."""
        if self._owned is not None and self.intact():
            try:
                os.close(self._owned.fd)
            except OSError:
                pass
        self.abandon()


__all__ = ["FolderWatch", "NEW_ENTRIES", "watched_inodes"]
