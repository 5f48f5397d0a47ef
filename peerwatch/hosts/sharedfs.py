"""Shared-filesystem mode: one run directory seen by every host (NFS, Lustre, GPFS, ...).

A source, in the sense of the data flow (sources -> decide -> teardown -> report):

- :func:`detect` says whether the run directory is shared, and why: ``shared_fs=on``, or
  ``auto`` and the mount table (``/proc/self/mountinfo``, parsed by the pure
  :func:`parse_mountinfo` / :func:`mount_of`) puts it on a network or cluster filesystem.
- :class:`RemoteWatch` turns the heartbeats of ranks on *other* hosts into news for
  :class:`peerwatch.hosts.hosts.Liveness`, measured only on this host's ``CLOCK_MONOTONIC``:
  a remote heartbeat is news when its file is new (inode) or its ``(pid, seq)`` changed
  since we last read it, never by comparing its wall clock time stamp with ours (the
  hosts' clocks may disagree).

What changes in the watcher in shared mode (see ``Watcher._run``):

- inotify only sees writes made through this host's kernel, so records written by other
  hosts are found by listing the folders: the *judges* of each host (its two lowest live
  ranks) list them every :data:`POLL_S`; every rank still rescans once per heartbeat, and
  local writes (an ack, a verdict made here) still wake the local ranks through inotify;
- the judges look at the heartbeats of the remote ranks every :func:`remote_read_interval`
  (one listing of ``heartbeats/``; a file is read only when its inode did not change) and
  feed their news to the liveness rule of the store bridge too
  (:class:`peerwatch.hosts.hosts.Liveness`): a rank whose heartbeat has not moved for
  ``peer_timeout`` is lost (rule: a silent host is lost), and the judge writes its failure
  record, from which the verdict follows as from any failure;
- heartbeats are always written to a temp file, closed, then renamed into place: NFS
  gives close-to-open consistency, so a reader on another host that opens the file after
  the rename sees the whole new record, never a torn in-place write;
- only local processes are ever signalled (as everywhere: :func:`peerwatch.proc.identity.is_local`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import TYPE_CHECKING, AbstractSet, Dict, Hashable, Mapping, Optional, Tuple

from ..core.mounts import MOUNTINFO, NETWORK_FS_TYPES, Mount, is_network_fs, mount_of, parse_mountinfo
from ..core.records import Failure, Heartbeat, Registration
from ..proc.identity import is_local
from .hosts import Liveness, lost_rank_failures

if TYPE_CHECKING:
    from ..core.awake import AwakeClock
    from ..rundir.rundir import RunDir

logger = logging.getLogger("peerwatch")

POLL_S = 0.5  # judges list events/ and ranks/ this often: 2 readdirs per judge, 2 judges per host
REMOTE_READS_PER_TIMEOUT = 8  # remote heartbeats are read at least this often per peer_timeout
# Test only: behave as if inotify could not see anything (as for another host's writes on
# NFS), so the end-to-end tests exercise the polling path on one kernel. Not documented.
NO_INOTIFY_VAR = "PEERWATCH_TEST_NO_INOTIFY"

def detect(shared_fs: str, source: str, path: str, mountinfo: Optional[str] = None) -> Optional[str]:
    """Why the run directory ``path`` is shared by several hosts, or ``None`` if it is not.

    ``shared_fs`` is the option's value (``on``, ``off``, ``auto``) and ``source`` where it
    came from. With ``auto`` the mount table decides (``mountinfo``: its text; read from
    ``/proc/self/mountinfo`` when not given; unreadable: not shared).
    """
    if shared_fs == "off":
        return None
    if shared_fs == "on":
        return f"shared_fs=on ({source})"
    if mountinfo is None:
        try:
            with open(MOUNTINFO, encoding="utf-8", errors="surrogateescape") as f:
                mountinfo = f.read()
        except OSError as e:
            logger.debug("peerwatch: cannot read %s (%s); taking the run directory as local", MOUNTINFO, e)
            return None
    real = os.path.realpath(path)  # the directory may not exist yet: its existing part is resolved
    mount = mount_of(real, parse_mountinfo(mountinfo))
    if mount is None or not is_network_fs(mount.fstype):
        return None
    return f"the run directory is on {mount.fstype} ({mount.source} mounted at {mount.mount_point})"


def inotify_disabled() -> bool:
    return os.environ.get(NO_INOTIFY_VAR, "") == "1"


def remote_read_interval(heartbeat_interval: float, peer_timeout: float) -> float:
    """How often a judge reads the remote ranks' heartbeats, in seconds: once a heartbeat,
    but no more than needed to tell ``peer_timeout`` within an eighth of it. A remote rank
    is thus declared lost between ``peer_timeout`` and ``peer_timeout`` plus this."""
    return max(heartbeat_interval, peer_timeout / REMOTE_READS_PER_TIMEOUT)


_UNKNOWN = object()  # a heartbeat known to have changed, not yet read


@dataclasses.dataclass
class _Beat:
    inode: Optional[int]
    value: object


class RemoteWatch:
    """A judge's source for the other hosts' ranks: their heartbeats, read at most every
    :func:`remote_read_interval`, as news for the one liveness rule
    (:class:`peerwatch.hosts.hosts.Liveness`, keyed by rank, counted on the judge's clock ``awake``).

    A read lists ``heartbeats/`` once (not one open per rank) and notes each remote rank's
    inode (:meth:`listed`): every heartbeat is a new file renamed into place, so a new inode
    is news and the file need not be read. Only when the inode looks unchanged (a frozen
    rank; a freed inode number reused; a listing served from a client's cache) is the file
    read and its ``(pid, seq)`` passed to :meth:`observe`, which has the last word. A rank
    is seen when it is first listed.
    """

    def __init__(self, run_dir: RunDir, heartbeat_interval: float, peer_timeout: float, awake: AwakeClock,
                 exit_code: int) -> None:
        self.run_dir = run_dir
        self.liveness = Liveness(int(peer_timeout * 1e9), awake)
        self.interval_s = remote_read_interval(heartbeat_interval, peer_timeout)
        self.exit_code = exit_code  # a lost rank's failure record's
        self._beats: Dict[int, _Beat] = {}
        self._next_read = 0.0

    def read(self, registrations: Mapping[int, Registration], ended: AbstractSet[int]) -> None:
        """If due: one listing of ``heartbeats/``, then a read of each remote rank's
        heartbeat whose inode did not change. Ranks in ``ended`` (a record says how they
        ended) are dropped."""
        from ..rundir.rundir import HEARTBEATS, rank_file

        now = time.monotonic()
        if now < self._next_read:
            return
        self._next_read = now + self.interval_s
        inodes = self.run_dir.inodes(HEARTBEATS)
        now_ns = time.monotonic_ns()
        for rank, reg in list(registrations.items()):
            if is_local(reg):
                continue
            if rank in ended:
                self.forget(rank)
                continue
            name = rank_file("rank", rank)
            if self.listed(rank, inodes.get(name), now_ns):
                beat = self.run_dir.read(HEARTBEATS, name, Heartbeat)
                self.observe(rank, (beat.pid, beat.seq) if beat is not None and beat.pid == reg.pid else None, now_ns)

    def listed(self, rank: int, inode: Optional[int], now_mono_ns: int) -> bool:
        """Note the inode of rank's heartbeat file (``None``: not listed). Returns True if
        the file must be read (then pass what it says to :meth:`observe`)."""
        beat = self._beats.get(rank)
        if beat is None:
            self._beats[rank] = _Beat(inode, _UNKNOWN)
            self.liveness.seen(rank, now_mono_ns)
            return True
        if inode is not None and beat.inode is not None and inode != beat.inode:
            beat.inode, beat.value = inode, _UNKNOWN
            self.liveness.news(rank, now_mono_ns)
            return False
        if inode is not None:
            beat.inode = inode
        return True

    def observe(self, rank: int, value: Hashable, now_mono_ns: int) -> None:
        """What rank's heartbeat says now (``(pid, seq)``; ``None`` if there is none)."""
        beat = self._beats.setdefault(rank, _Beat(None, value))
        self.liveness.seen(rank, now_mono_ns)
        if beat.value is not _UNKNOWN and beat.value != value:
            self.liveness.news(rank, now_mono_ns)
        # After an inode change the value was unknown: its change is already counted.
        beat.value = value

    def forget(self, rank: int) -> None:
        self._beats.pop(rank, None)
        self.liveness.forget(rank)

    def lost(self, registrations: Mapping[int, Registration], ended: AbstractSet[int],
             judge: Registration) -> Tuple[Failure, ...]:
        """The failure records to write for the remote ranks lost now (rule: a silent host is lost)."""
        return lost_rank_failures(self.liveness, time.monotonic_ns(), time.time_ns(), registrations, ended,
                                  judge.host, self.exit_code)


__all__ = [
    "MOUNTINFO", "NETWORK_FS_TYPES", "NO_INOTIFY_VAR", "POLL_S", "Mount", "RemoteWatch", "detect",
    "inotify_disabled", "is_network_fs", "mount_of", "parse_mountinfo", "remote_read_interval",
]
