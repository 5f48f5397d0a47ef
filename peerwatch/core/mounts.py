"""The mount table: which filesystem holds a path, and whether other hosts may write it.

Pure: parses the text of ``/proc/self/mountinfo`` that the caller read. Used by the run
directory (is it local?), the shared-filesystem mode and ``peerwatch doctor``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, List, Optional, Tuple

MOUNTINFO = "/proc/self/mountinfo"  # the path a caller reads the table from

# Filesystem types (the mount table's) whose files other hosts may write: inotify cannot
# see those writes. Network filesystems, and cluster filesystems on shared disks.
NETWORK_FS_TYPES = frozenset({
    "nfs", "nfs4",  # NFS (v2/v3 show as nfs)
    "lustre",
    "gpfs",  # IBM Spectrum Scale
    "ceph", "fuse.ceph-fuse",  # CephFS: kernel client, FUSE client
    "beegfs",
    "glusterfs", "fuse.glusterfs",
    "cifs", "smb3",  # SMB
    "afs", "orangefs", "pvfs2", "wekafs", "fuse.juicefs",
    "gfs2", "ocfs2",  # shared-disk cluster filesystems
})


@dataclasses.dataclass(frozen=True)
class Mount:
    """One line of ``/proc/self/mountinfo``: where, what type, from where, its options."""

    mount_point: str
    fstype: str
    source: str
    options: Tuple[str, ...] = dataclasses.field(default=(), compare=False)


_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    """The kernel writes space, tab, newline and backslash in paths as ``\\040`` etc."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> List[Mount]:
    """The mounts listed in a ``/proc/<pid>/mountinfo`` text, in order (later mounts last).

    Format (proc(5)): ``id parent major:minor root mount_point options [optional...] -
    fstype source super_options``. Malformed lines are skipped.
    """
    mounts = []
    for line in text.splitlines():
        fields = line.split(" ")
        try:
            dash = fields.index("-", 6)
        except ValueError:
            continue
        if len(fields) < dash + 3:
            continue
        mounts.append(Mount(_unescape(fields[4]), fields[dash + 1], _unescape(fields[dash + 2]),
                            tuple(fields[5].split(","))))
    return mounts


def mount_of(path: str, mounts: Iterable[Mount]) -> Optional[Mount]:
    """The mount holding absolute ``path``: the longest mount point that is a prefix of it
    (whole components only); of equal ones, the last mounted (it hides the others)."""
    best: Optional[Mount] = None
    for m in mounts:
        point = m.mount_point.rstrip("/") or "/"
        if point == "/" or path == point or path.startswith(point + "/"):
            if best is None or len(point) >= len(best.mount_point.rstrip("/") or "/"):
                best = m
    return best


def is_network_fs(fstype: str) -> bool:
    return fstype in NETWORK_FS_TYPES


__all__ = ["MOUNTINFO", "NETWORK_FS_TYPES", "Mount", "is_network_fs", "mount_of", "parse_mountinfo"]
