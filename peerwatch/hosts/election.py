"""Which local rank runs this host's store bridge, and whether it is connected: POSIX locks.

``RUN/bridge.lock``: the rank holding an exclusive ``lockf(3)`` on it runs the bridge.
``RUN/bridge.up``: the bridge holds an exclusive lock on it while the store answers it; the
other local ranks test it (``connected_elsewhere``) to know whether an exception of theirs
may be the echo of a failure on another host.

A POSIX lock belongs to the process (a forked DataLoader worker never inherits it) and the
kernel drops it when the process ends, however it ends: no lock outlives its holder, and
nothing here can be stale. One rule follows: a process must never open and close one of
these files while it holds a lock on it (closing any descriptor of a file drops the
process's locks on it), so only :class:`Election` opens ``bridge.lock``, and only a process
that is not the bridge probes ``bridge.up``.

Mutable state: an :class:`Election` is owned by the watcher thread, an :class:`UpFlag` by
the bridge's beat thread (:func:`connected_elsewhere` keeps none).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from typing import Optional

from ..rundir.rundir import RunDir

logger = logging.getLogger("peerwatch")

LOCK_FILE = "bridge.lock"  # lockf(3) on it: the holder runs this host's bridge
UP_FILE = "bridge.up"  # lockf(3) on it, held by the bridge while it is connected to the store
_BUSY = (errno.EACCES, errno.EAGAIN)  # lockf: another process holds it


def _open(run_dir: RunDir, name: str) -> int:
    return run_dir.open_file(name, os.O_RDWR | os.O_CREAT)


def _try_lock(fd: int, exclusive: bool) -> bool:
    """True: locked; False: another process holds it; raises OSError for anything else."""
    try:
        fcntl.lockf(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in _BUSY:
            return False
        raise
    return True


class Election:
    """This process's claim to ``bridge.lock``: once won, held until the process ends."""

    def __init__(self, run_dir: RunDir) -> None:
        self.run_dir = run_dir
        self.fd: Optional[int] = None
        self.broken = False  # the lock cannot be used here (warned once): no bridge on this rank

    def take(self) -> bool:
        """Are we the bridge? Tries once; never blocks."""
        if self.fd is not None:
            return True
        if self.broken:
            return False
        path = self.run_dir.join(LOCK_FILE)
        try:
            fd = _open(self.run_dir, LOCK_FILE)
        except OSError as e:
            return self._broken(path, f"cannot be opened ({e.strerror}); no store bridge")
        try:
            won = _try_lock(fd, exclusive=True)
        except OSError as e:
            os.close(fd)
            return self._broken(path, f"cannot be locked ({e.strerror}); no store bridge")
        if not won:
            os.close(fd)
            return False
        self.fd = fd
        return True

    def _broken(self, path: str, reason: str) -> bool:
        self.run_dir.warn_once(path, reason)
        self.broken = True
        return False


class UpFlag:
    """The bridge's "I am connected", raised and lowered by its beat thread."""

    def __init__(self, run_dir: RunDir) -> None:
        self.run_dir = run_dir
        self._fd: Optional[int] = None

    def set(self, up: bool) -> None:
        """Raise (tried again each call until it holds: a prober may hold it for an instant)
        or lower the flag. Never raises: the flag only shortens other ranks' waits."""
        try:
            if up and self._fd is None:
                fd = _open(self.run_dir, UP_FILE)
                if _try_lock(fd, exclusive=True):
                    self._fd = fd
                else:
                    os.close(fd)
            elif not up and self._fd is not None:
                fd, self._fd = self._fd, None
                os.close(fd)  # drops the lock
        except OSError as e:
            logger.debug("peerwatch: %s: %s", self.run_dir.join(UP_FILE), e)


def connected_elsewhere(run_dir: RunDir) -> bool:
    """Is this host's bridge, run by another local rank, connected to the store? Only for a
    process that is not the bridge itself (see the module's rule)."""
    try:
        fd = run_dir.open_file(UP_FILE, os.O_RDONLY)
    except OSError:
        return False  # never raised: no bridge has been connected on this host
    try:
        if not _try_lock(fd, exclusive=False):
            return True
        fcntl.lockf(fd, fcntl.LOCK_UN)
        return False
    except OSError:
        return False
    finally:
        os.close(fd)


__all__ = ["LOCK_FILE", "UP_FILE", "Election", "UpFlag", "connected_elsewhere"]
