"""How the watcher thread sleeps, and what wakes it: one poll(2) set of the wake pipe, the
local peers' pidfds, and an inotify instance on the run directory's folders
(:class:`FolderWatch`, drained here, no thread of its own).

The application shares the descriptor table: it may close our descriptors or put another
file in their place (``/dev/null`` is always readable). A descriptor that fired is
believed only if it is still ours; one that is not ours any more is replaced, never
closed; and every :data:`FD_CHECK_S` the watcher looks, unasked, at the ones that may
never fire.

The folder watch (:class:`FolderWatch`): every rank watches ``ranks/`` and ``events/`` for
new entries (a record appears there by link(2) or rename(2)), and any new entry means one
thing: look again. So the events are drained, never decoded, with no thread of their own:
``inotify_init1`` and ``inotify_add_watch`` through ctypes (the standard library has neither),
loaded on first use so that ``import peerwatch`` stays cheap. This replaced watchdog's
observer, whose three threads per rank decoded every event into objects passed through
queues: at N = 128 on 2 cores, each leaving rank's two records cost its 127 peers about
65 us each, about 60 % of the CPU of a teardown (docs/performance.md). Every inotify
instance, like every eventfd or epoll, is the same anonymous inode to fstat(2), so
:meth:`FolderWatch.intact` also asks ``/proc/self/fdinfo`` which inodes it watches: only an
instance watching our folders is ours.

Threads: owned by the watcher thread (its :class:`peerwatch.peers.LocalPeers`'), except
:meth:`Waker.wake` (any thread: one byte down a non-blocking pipe) and :meth:`Waker.stop`
(any thread). The folder watch is made, drained, swapped and closed only under
``_folders_lock`` (a repair and a stop may race: a watch made after the stop would outlive
the rank's watching; a number closed by a stop and reused by the application must not be
read), and once stopped it is never started or repaired again. ``_repaired`` is set by
either thread (a stop sets it under that lock) and reset only by the watcher, under it.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import threading
import time
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from ..core import terminal
from .sources import OwnedFd, Peer, still_running

logger = logging.getLogger("peerwatch")

IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_ONLYDIR = 0x01000000
# Only new entries. Opening and reading the folder (every watcher's rescan) must not
# wake the others, nor a record's removal.
NEW_ENTRIES = IN_CREATE | IN_MOVED_TO | IN_ONLYDIR
READ_BYTES = 65536  # one read drains this much; a queue holds at most 16384 events of 16+ bytes

_Calls = Tuple[Callable[[int], int], Callable[[int, bytes, int], int], Callable[[], int], Callable[[int, int], int]]
_calls: Optional[_Calls] = None


def _libc_calls() -> _Calls:
    """inotify_init1, inotify_add_watch, errno and inotify_rm_watch, bound once. OSError or
    AttributeError where this C library has no inotify."""
    global _calls
    if _calls is None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        init, add, rm = libc.inotify_init1, libc.inotify_add_watch, libc.inotify_rm_watch
        init.argtypes, init.restype = [ctypes.c_int], ctypes.c_int
        add.argtypes, add.restype = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32], ctypes.c_int
        rm.argtypes, rm.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        _calls = (init, add, ctypes.get_errno, rm)
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
        self._wds: List[int] = []  # the watches, as inotify_add_watch numbered them
        if not disabled:
            self._start(folders)

    def _start(self, folders: List[str]) -> None:
        try:
            init, add, last_errno, _ = _libc_calls()
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
                wd = add(fd, os.fsencode(folder), NEW_ENTRIES)
                if wd < 0:
                    err = last_errno()
                    raise OSError(err, f"{os.strerror(err)}: {folder}")
                self._wds.append(wd)
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
        inodes = watched_inodes(self._owned.fd)
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

    def release(self) -> None:
        """Watch no more, at once: the watches are removed, the number is no longer polled
        (:attr:`fd` None) but stays open, to :meth:`stop` or the process's end. Closing an
        instance that still has watches waits for the kernel to free them (an SRCU grace
        period: up to 20 ms here, where 8 ranks close theirs at once), and a teardown must
        not wait for that; the watches removed now are freed meanwhile, so a later close
        (the process's exit) finds an empty instance and costs nothing."""
        if self._owned is None or not self.intact():
            self.abandon()
            return
        try:
            rm = _libc_calls()[3]
            for wd in self._wds:
                rm(self._owned.fd, wd)
        except (OSError, AttributeError):
            self.stop()
            return
        self._inodes = []  # watching nothing now: still ours if the same kind of file
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


# How often the watcher checks, unasked, that its descriptors are still its own (the wake
# pipe, one pidfd in turn, inotify's): a few fstat calls and a read of /proc/self/fdinfo,
# O(1) however many peers. Most takeovers show at once (a closed fd polls POLLNVAL,
# /dev/null polls readable: both are checked when they fire); this look is for a pidfd
# replaced by something that never becomes readable, which blinds this rank alone (its
# peers still watch that process). Every second, it doubled the watcher's idle CPU.
FD_CHECK_S = 5.0


class Waker:
    """The descriptors the watcher thread sleeps on. ``peers`` and ``gone`` are its
    LocalPeers' (read here, written there): the pidfds to watch, and the ranks seen gone."""

    def __init__(self, rank: int, peers: Mapping[int, Peer], gone: Mapping[int, int]) -> None:
        self._rank = rank
        self._peers = peers
        self._gone = gone
        self._poller = select.poll()
        self._wake_r, self._wake_w = _new_wake_pipe()
        self._poller.register(self._wake_r.fd, select.POLLIN)
        self._repaired = False  # a descriptor was replaced: the poll set is made anew
        self._next_fd_check = time.monotonic() + FD_CHECK_S
        self._fd_turn = 0  # which peer's pidfd the next unasked check looks at
        self._fd_rank: Dict[int, int] = {}
        self._folder_args: Optional[Tuple[Callable[[], List[str]], bool]] = None
        self._folders_lock = threading.Lock()
        self._folders: Optional[FolderWatch] = None  # swapped under _folders_lock only
        self._released: Optional[FolderWatch] = None  # a watch released, its number open (under _folders_lock)
        self._stopped = False  # stop() was called: no folder watch is made any more (under _folders_lock)

    # -- the folders (inotify) -----------------------------------------------------------

    def watch_folders(self, folders: Callable[[], List[str]], disabled: bool) -> bool:
        """Start inotify on the folders ``folders()`` names (asked again at each repair);
        False if it cannot be used (the caller polls)."""
        self._folder_args = (folders, disabled)
        with self._folders_lock:
            if self._stopped:
                return False  # stopped before the watcher began: nothing to watch for
            self._folders = self._new_folder_watch()
            self._repaired = True  # the poll set takes its descriptor
            return self._folders.active

    def _new_folder_watch(self) -> FolderWatch:
        assert self._folder_args is not None
        folders, disabled = self._folder_args
        return FolderWatch(folders(), disabled=disabled)

    def stop(self) -> None:
        """Stop the folder watch for good (any thread may call this)."""
        with self._folders_lock:
            self._stopped = True
            self._close_folders()
            if self._released is not None:
                self._released.stop()
                self._released = None

    def stop_watching_folders(self) -> None:
        """No more wakes from the folders, for a rank that acts on a verdict and looks at
        them no more: every rank that leaves adds a record to ``events/`` (its
        acknowledgement, its exit), and at N = 128 each watching rank would wake and rescan
        for every one of them. The watch is released, not closed (FolderWatch.release: the
        rank leaves soon, and a close would hold its teardown); stop() closes it, if the
        process gets there."""
        with self._folders_lock:
            self._close_folders(release=True)

    def _close_folders(self, release: bool = False) -> None:
        """Under ``_folders_lock``. The watcher thread may be asleep on the number: its
        poll set is made anew, and a number it does not know any more is never read."""
        folders, self._folders = self._folders, None
        if folders is None:
            return
        if release:
            folders.release()
            self._released = folders
        else:
            folders.stop()
        self._repaired = True

    def _drain_folders(self, fd: int, flags: int) -> bool:
        """The folder watch's descriptor ``fd`` fired: drain it. False if ``fd`` is not
        the watch's (stopped or replaced meanwhile); a number found not ours is repaired."""
        with self._folders_lock:
            folders = self._folders
            if folders is None or folders.fd != fd:
                return False
            if not flags & (select.POLLNVAL | select.POLLERR) and folders.drain():
                return True
        self._repair_folders()
        return True

    def _repair_folders(self) -> None:
        with self._folders_lock:
            old = self._folders
            if old is None:
                return  # stopped meanwhile (by another thread): nothing to repair
            old.abandon()
            self._folders = new = self._new_folder_watch()
            self._repaired = True
        logger.warning(
            "peerwatch: rank %d: the watcher's inotify descriptor was closed or replaced by the application "
            "(os.closerange, dup2?); %s", self._rank,
            "watching the run directory with a new one" if new.active else "it now looks on every heartbeat",
        )

    # -- waking and sleeping ---------------------------------------------------------------

    def wake(self) -> None:
        """Wake the watcher thread (any thread may call this)."""
        w = self._wake_w
        if not w.intact():
            return  # taken over by the application: not ours to write to (the watcher repairs it)
        try:
            os.write(w.fd, b"\0")
        except OSError:
            pass  # the pipe is full (BlockingIOError): the watcher will wake anyway

    def add(self, rank: int, pidfd: int) -> None:
        """Watch a new peer's pidfd."""
        self._fd_rank[pidfd] = rank
        self._poller.register(pidfd, select.POLLIN)

    def remove(self, rank: int, pidfd: Optional[int]) -> None:
        """Watch a peer's pidfd no more (the peer is gone); before the pidfd is closed."""
        if pidfd is not None and self._fd_rank.get(pidfd) == rank:
            del self._fd_rank[pidfd]
            self._poller.unregister(pidfd)

    def wait(self, timeout: float) -> Tuple[bool, List[int]]:
        """Sleep until a source fires or ``timeout`` s pass: whether something woke us,
        and the ranks whose processes ended (by their identity, not a readiness alone)."""
        ended: List[int] = []
        now = time.monotonic()
        if now >= self._next_fd_check:
            self._next_fd_check = now + FD_CHECK_S
            ended += self.check_fds()
        if self._repaired:
            self._rebuild_poll()
        events = self._poller.poll(max(0, int(timeout * 1000) + 1))
        wake_fd = self._wake_r.fd
        for fd, flags in events:
            rank = self._fd_rank.get(fd)
            if fd == wake_fd:
                self._on_wake_ready(flags)
            elif rank is not None:
                if self._peers[rank].pidfd == fd and rank not in self._gone and rank not in ended:
                    if self._on_pidfd_ready(rank):
                        ended.append(rank)
            elif not self._drain_folders(fd, flags):
                self._repaired = True  # a number no source holds now (a stopped folder watch's)
        if self._repaired:
            self._rebuild_poll()
        return bool(events), ended

    def _rebuild_poll(self) -> None:
        """A new poll set of the descriptors that are ours now. After a repair, a number
        may have changed hands (a new pipe can get a closed pidfd's number). The flag's
        reset and the read of the folder watch are one step under ``_folders_lock``: a
        stop() that closes the watch in between sets the flag again, never lost."""
        with self._folders_lock:
            self._repaired = False
            folders = self._folders
        self._poller = select.poll()
        self._poller.register(self._wake_r.fd, select.POLLIN)
        self._fd_rank = {}
        for rank, peer in self._peers.items():
            if peer.pidfd is not None and rank not in self._gone:
                self._fd_rank[peer.pidfd] = rank
                self._poller.register(peer.pidfd, select.POLLIN)
        if folders is not None and folders.fd is not None and folders.fd not in self._fd_rank:
            self._poller.register(folders.fd, select.POLLIN)

    def _on_wake_ready(self, flags: int) -> None:
        if flags & (select.POLLNVAL | select.POLLERR) or not (self._wake_r.intact() and self._wake_w.intact()):
            self._repair_wake_pipe()
            return
        try:
            while os.read(self._wake_r.fd, 4096):
                pass
            self._repair_wake_pipe()  # EOF: the write end was closed behind our back
        except BlockingIOError:
            pass
        except OSError:
            self._repair_wake_pipe()

    def _repair_wake_pipe(self) -> None:
        old_r, old_w = self._wake_r, self._wake_w
        self._wake_r, self._wake_w = _new_wake_pipe()
        self._repaired = True
        old_r.close()  # each only if it is still ours
        old_w.close()
        logger.warning(
            "peerwatch: rank %d: the watcher's wake pipe (fds %d, %d) was closed or replaced by the application "
            "(os.closerange, dup2?); opened a new one", self._rank, old_r.fd, old_w.fd,
        )

    def _on_pidfd_ready(self, rank: int) -> bool:
        """A peer's pidfd fired: True if its process is gone."""
        peer = self._peers[rank]
        intact = peer.pidfd_intact()
        running = still_running(peer.reg)
        if running is False:
            return True  # gone by its identity (pid and start time), not by a readiness alone
        if running is None:
            # It cannot be told (out of descriptors...): not gone. A pidfd that fired stays
            # readable: it is dropped, and the peer polled until it can be told (Peer.check_alive).
            peer.cannot_tell("its pidfd fired, and /proc cannot be read")
            self._repaired = True
            return False
        # Alive by its identity: what fired was not its pidfd.
        return self._replace_pidfd(rank, "it fired while the process still runs" if intact else "closed or replaced")

    def _replace_pidfd(self, rank: int, why: str) -> bool:
        """A new pidfd for a peer whose pidfd is not ours any more: True if it ended meanwhile."""
        peer = self._peers[rank]
        fd = peer.pidfd
        self._repaired = True
        if not peer.reopen():
            return True
        logger.warning(
            "peerwatch: rank %d: its pidfd of %s, fd %s, was %s by the application (os.closerange, "
            "dup2?); rank %d %s",
            self._rank, terminal.who(rank, peer.reg.pid, peer.reg.host), fd, why, rank,
            f"still runs, so it is watched through a new pidfd (fd {peer.pidfd})" if peer.pidfd is not None else
            "is not known to be gone, so it is polled until a new pidfd can be had",
        )
        return False

    def check_fds(self, every_pidfd: bool = False) -> List[int]:
        """Check that the watcher's descriptors are still its own, and replace those that
        are not: the wake pipe, inotify's, and one pidfd (each in turn), or all of them.
        Returns the ranks whose processes ended meanwhile (found while replacing a pidfd)."""
        if not (self._wake_r.intact() and self._wake_w.intact()):
            self._repair_wake_pipe()
            every_pidfd = True  # whatever hit the pipe may have hit the rest
        with self._folders_lock:
            folders = self._folders
            taken = folders is not None and folders.active and not folders.intact()
        if taken:
            every_pidfd = True
            self._repair_folders()
        ended = []
        watched = [r for r, p in self._peers.items() if p.pidfd is not None and r not in self._gone]
        if watched and not every_pidfd:
            self._fd_turn = (self._fd_turn + 1) % len(watched)
            watched = [watched[self._fd_turn]]
        for rank in watched:
            if not self._peers[rank].pidfd_intact() and self._replace_pidfd(rank, "closed or replaced"):
                ended.append(rank)
        if self._repaired:
            self._rebuild_poll()
        return ended


def _new_wake_pipe() -> Tuple[OwnedFd, OwnedFd]:
    r, w = os.pipe()
    for fd in (r, w):
        os.set_blocking(fd, False)
        os.set_inheritable(fd, False)
    return OwnedFd(r), OwnedFd(w)


__all__ = ["FD_CHECK_S", "NEW_ENTRIES", "FolderWatch", "Waker", "watched_inodes"]
