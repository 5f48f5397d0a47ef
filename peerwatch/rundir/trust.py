"""Whether a directory can be trusted with a run's records, opening a file safely in it, and
holding it by descriptors once checked (:class:`HeldDir`).

A run directory, and every folder above it, must be safe from other users: ours, not
group- or world-writable, never reached through a symlink another user could swap
(docs/security.md, "The path to the run directory"). Files in it are opened never through a symlink, never blocking
on a FIFO, and only when regular (:func:`open_regular`).

Once checked, a run directory is held by a descriptor, and so is each of its folders: every
later operation goes through those descriptors, so a directory renamed away and replaced by
another (by a user who can write a folder above it) is never read from or written to.
:class:`peerwatch.rundir.rundir.RunDir` reads and writes the records through them.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
from typing import Dict, Iterator, List, Optional, Set, Tuple

from ..core.errors import RunDirError

logger = logging.getLogger("peerwatch")


def private_dir(path: str) -> bool:
    """A real directory of ours that nobody else can write to."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def check_trusted(path: str) -> None:
    """Raise :class:`RunDirError` unless path is a real directory, ours, not group/world-writable."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise RunDirError(path, f"cannot be read ({e.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        raise RunDirError(path, "is a symbolic link; refusing to follow it")
    check_own_dir(path, st)


def check_own_dir(path: str, st: os.stat_result) -> None:
    """Raise :class:`RunDirError` unless ``st`` (of ``path``, as opened) is a directory of ours
    that nobody else can write to."""
    if not stat.S_ISDIR(st.st_mode):
        raise RunDirError(path, "is not a directory")
    if st.st_uid != os.geteuid():
        raise RunDirError(path, f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
    if st.st_mode & 0o022:
        raise RunDirError(path, f"is group- or world-writable (mode {stat.S_IMODE(st.st_mode):o})")


def check_ancestors(path: str) -> None:
    """Raise :class:`RunDirError` unless no other user can rename ``path`` or any folder above it.

    OpenSSH's rule for a secure path, applied to every component of ``path`` as written
    and as resolved (``realpath``): each one is owned by root or by this user, and one that
    is group- or world-writable has the sticky bit (as ``/tmp``), so that only its owner,
    root and the owner of an entry can rename that entry. A symlink on the way must be
    owned by root or by this user too (in a sticky folder its owner can replace it). A
    component that does not exist yet is skipped: it will be created by this user.
    """
    me = os.geteuid()
    absolute = os.path.abspath(path)
    seen: Set[str] = set()
    for candidate in (absolute, os.path.realpath(absolute)):
        for part in _prefixes(candidate):
            if part in seen:
                continue
            seen.add(part)
            try:
                st = os.lstat(part)
            except FileNotFoundError:
                continue
            except OSError as e:
                raise RunDirError(part, f"cannot be read ({e.strerror}), so the run directory below it cannot be trusted") from None
            if st.st_uid not in (0, me):
                raise RunDirError(
                    part,
                    f"is owned by uid {st.st_uid}, not by root or this user (uid {me}): that user could "
                    "swap the run directory below it for their own; choose a PEERWATCH_DIR under a folder of "
                    "yours (the default base, under $XDG_RUNTIME_DIR or ~/.cache, is)",
                )
            if stat.S_ISLNK(st.st_mode):
                continue
            if not stat.S_ISDIR(st.st_mode):
                raise RunDirError(part, "is not a directory")
            if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
                raise RunDirError(
                    part,
                    f"is group- or world-writable without the sticky bit (mode {stat.S_IMODE(st.st_mode):o}): "
                    "others could swap the run directory below it for their own; choose a PEERWATCH_DIR "
                    "under a folder only you can write",
                )


def _prefixes(path: str) -> List[str]:
    """``/a/b/c`` -> ``["/", "/a", "/a/b", "/a/b/c"]``."""
    out = []
    while True:
        out.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            return out[::-1]
        path = parent


def open_regular(path: str, flags: int, mode: int = 0o600, dir_fd: Optional[int] = None) -> int:
    """``os.open`` for a file peerwatch keeps in a run directory: never through a symlink
    (``O_NOFOLLOW``), never blocking (``O_NONBLOCK``: a FIFO without its other end fails at
    once, ENXIO, instead of hanging the caller), and only a regular file (a FIFO, a device,
    a socket there is refused: OSError EINVAL "not a regular file"). Raises OSError."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ENXIO:  # a FIFO with no reader (or a device without its driver)
            raise OSError(errno.EINVAL, "not a regular file (a FIFO, a device or a socket)") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file (a FIFO, a device or a socket)")
    except BaseException:
        os.close(fd)
        raise
    return fd


# -- a directory held by descriptors -------------------------------------------------------

WARN_EACH = 10  # bad files warned about one by one, per folder, record kind and reason; then one summary
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FD_ROOT = "/proc/self/fd"  # where a path through a held descriptor starts (Linux)
_HAVE_FD_PATHS = os.path.isdir(_FD_ROOT)


class WarnOnce:
    """Warnings about the files found in one directory: one per file and reason, and at most
    ``WARN_EACH`` per kind (folder, kind of record, reason), then one line that says the rest
    go unreported: a folder planted with 20 000 junk failure records must not print 20 000
    lines in every rank. Safe to call from any thread."""

    def __init__(self) -> None:
        self._warned: Set[Tuple[str, str]] = set()
        self._kinds: Dict[Tuple[str, str, str], int] = {}  # warnings given per kind
        self._lock = threading.Lock()

    def __call__(self, path: str, reason: str) -> None:
        folder, name = os.path.split(path)
        kind = (folder, name.partition("-")[0], "".join("N" if c.isdigit() else c for c in reason))
        with self._lock:
            if (path, reason) in self._warned:
                return
            self._warned.add((path, reason))
            self._kinds[kind] = n = self._kinds.get(kind, 0) + 1
        if n <= WARN_EACH:
            logger.warning("peerwatch: %s %s", path, reason)
        elif n == WARN_EACH + 1:
            logger.warning("peerwatch: more than %d files in %s are like %s (%s); further ones are ignored "
                           "without a warning each", WARN_EACH, folder, name, reason)


class HeldDir:
    """A directory reached through descriptors held since it was checked (:meth:`hold`).

    Once held, so is each of its folders (:meth:`hold_folder`, or the first time one is
    used): every later operation goes through those descriptors (:meth:`_dir`), never
    through the path again. One that was not held (``peerwatch report``, tests) is opened
    by its path for each operation, never following a symlink at its end. Paths that
    :meth:`join` gives are for people (logs, the report); code that must open something by
    path uses :meth:`at`.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.warn_once = WarnOnce()  # what is wrong with the files found here, said once each
        # "" -> the directory, "events" -> its folder...: held once hold() checked them.
        self._fds: Dict[str, int] = {}
        self._ids: Dict[str, Tuple[int, int]] = {}  # (st_dev, st_ino) of each, as checked
        self._paths: Dict[str, str] = {}  # lost()'s paths, joined once (it looks on every turn)
        self._fd_lock = threading.RLock()

    def join(self, *parts: str) -> str:
        """The path of ``parts`` under the directory, for people (logs, the report)."""
        return os.path.join(self.path, *parts)

    def at(self, *parts: str) -> str:
        """A path to ``parts`` that goes through the held directory descriptor (Linux's
        ``/proc/self/fd/N/...``): for code that must open or watch something by path.
        The directory as it was checked, even if renamed and replaced since. Before
        :meth:`hold` (or where there is no ``/proc``), :meth:`join`."""
        try:
            fd = self._held("")
        except OSError:
            fd = -1  # held, but lost: a path that leads nowhere, never the path again
        if fd is None or not _HAVE_FD_PATHS:
            return self.join(*parts)
        return os.path.join(_FD_ROOT, str(fd), *parts)

    def close(self) -> None:
        """Let go of the directory descriptors (a later operation opens the path again)."""
        with self._fd_lock:
            fds = [fd for sub, fd in self._fds.items() if self._is(fd, sub)]  # others' numbers now: not ours to close
            self._fds, self._ids = {}, {}
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    # -- directory descriptors ----------------------------------------------------

    @contextlib.contextmanager
    def _dir(self, sub: str) -> Iterator[int]:
        """A descriptor of folder ``sub`` ("" for the directory itself); OSError if it
        cannot be opened (missing, a symlink, not a directory)."""
        held = self._held(sub)
        if held is not None:
            yield held
            return
        fd = os.open(self.path, _DIR_FLAGS)
        try:
            if sub:
                top, fd = fd, -1
                try:
                    fd = os.open(sub, _DIR_FLAGS, dir_fd=top)
                finally:
                    os.close(top)
            yield fd
        finally:
            if fd >= 0:
                os.close(fd)

    def _held(self, sub: str) -> Optional[int]:
        """The held descriptor of ``sub``, or None if the directory is not held.

        The application may take a descriptor's number (``os.closerange``, ``dup2`` of
        ``/dev/null`` over it): a held descriptor that is no longer the folder that was
        checked (device and inode) is let go, never closed (the number is the
        application's now), and the folder opened again, accepted only if it is that very
        folder. OSError if it cannot be.
        """
        with self._fd_lock:
            if "" not in self._ids:
                return None
            fd = self._fds.get(sub)
            if fd is not None and self._is(fd, sub):
                return fd
            self._fds.pop(sub, None)
            top = None if not sub else self._held(sub="")
            fd = os.open(sub if sub else self.path, _DIR_FLAGS, dir_fd=top)
            st = os.fstat(fd)
            if sub not in self._ids:
                self._ids[sub] = (st.st_dev, st.st_ino)  # a folder first opened now, within the held directory
            elif not self._is(fd, sub):
                os.close(fd)
                self.warn_once(self.join(sub), "is no longer the directory that was checked; not used")
                raise OSError(errno.ESTALE, "not the directory that was checked")
            self._fds[sub] = fd
            return fd

    def _is(self, fd: int, sub: str) -> bool:
        try:
            st = os.fstat(fd)
        except OSError:
            return False
        return stat.S_ISDIR(st.st_mode) and (st.st_dev, st.st_ino) == self._ids.get(sub)

    def hold(self) -> None:
        """Open the directory at its path, check what was opened (:func:`check_own_dir`), and
        hold it: from now on it is reached through this descriptor. RunDirError if it
        cannot be opened or is not ours alone."""
        path = self.path
        try:
            fd = os.open(path, _DIR_FLAGS)
        except OSError as e:
            check_trusted(path)  # says why: a symlink, not a directory, missing...
            raise RunDirError(path, f"cannot be opened ({e.strerror})") from None
        try:
            check_own_dir(path, os.fstat(fd))
        except RunDirError:
            os.close(fd)
            raise
        self.close()
        st = os.fstat(fd)
        with self._fd_lock:
            self._fds[""] = fd
            self._ids[""] = (st.st_dev, st.st_ino)

    def lost(self, sub: str) -> Optional[str]:
        """How the held directory was lost, as its path and its folder ``sub`` show (removed, or
        replaced by another one); None while it is there, where that cannot be told, or when
        not held. Nothing written there from now on reaches a peer, and nothing a peer writes
        (success markers included) reaches us: a peer's end proves nothing any more."""
        top, held = self._ids.get(""), self._ids.get(sub)
        if top is None or held is None:
            return None
        path = self._paths.get(sub)
        if path is None:
            path = self._paths[sub] = self.join(sub)
        try:
            now = _dir_id(path)
            if now == held:
                return None
            top_now = _dir_id(self.path)
        except OSError:
            return None  # cannot tell: judged as before
        if top_now is not None and top_now != top:
            return "was replaced by another directory"  # moved aside, or removed, and made anew
        return "was removed" if now is None else "was replaced by another directory"

    def hold_folder(self, sub: str) -> None:
        """Create folder ``sub`` (0700) in the held directory, check it, and hold it. RunDirError
        if it cannot be made, is a symlink or is not ours alone."""
        top = self._fds[""]
        where = self.join(sub)
        try:
            os.mkdir(sub, 0o700, dir_fd=top)
        except FileExistsError:
            pass
        except OSError as e:
            raise RunDirError(where, f"cannot be created ({e.strerror})") from None
        try:
            fd = os.open(sub, _DIR_FLAGS, dir_fd=top)
        except OSError as e:
            try:
                st = os.lstat(sub, dir_fd=top)
            except OSError:
                st = None
            reason = "is a symbolic link; refusing to follow it" if st is not None and stat.S_ISLNK(st.st_mode) else (
                f"cannot be opened ({e.strerror})")
            raise RunDirError(where, reason) from None
        try:
            check_own_dir(where, os.fstat(fd))
        except RunDirError:
            os.close(fd)
            raise
        st = os.fstat(fd)
        with self._fd_lock:
            old = self._fds.get(sub)
            self._fds[sub] = fd
            self._ids[sub] = (st.st_dev, st.st_ino)
        if old is not None:
            os.close(old)


def _dir_id(path: str) -> Optional[Tuple[int, int]]:
    """(st_dev, st_ino) of the directory at ``path``; None if there is none there (gone, or
    something else in its place). Raises OSError when it cannot be told (EACCES...)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return None
        raise
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


__all__ = ["WARN_EACH", "HeldDir", "WarnOnce", "check_ancestors", "check_own_dir", "check_trusted", "open_regular",
           "private_dir"]
