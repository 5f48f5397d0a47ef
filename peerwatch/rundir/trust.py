"""Whether a directory can be trusted with a run's records, and opening a file safely in it.

A run directory, and every folder above it, must be safe from other users: ours, not
group- or world-writable, never reached through a symlink another user could swap
(docs/security.md, "The path to the run directory"). Files in it are opened never through a symlink, never blocking
on a FIFO, and only when regular (:func:`open_regular`).
"""

from __future__ import annotations

import errno
import os
import stat
from typing import List, Optional, Set

from ..core.errors import RunDirError


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


__all__ = ["check_ancestors", "check_own_dir", "check_trusted", "open_regular", "private_dir"]
