"""This host's peers as processes, and what the watcher thread sleeps on.

Each local peer is watched through its pidfd, in one poll set with the wake pipe and the folder
watch (:class:`peerwatch.proc.waker.Waker`), or by a look at ``/proc``. A peer seen gone gets its
post-mortem (its exit status where we are its parent, else faulthandler's last words in its
stack file), handed to the observer. For the hang judges: how each live local rank moves (its
heartbeat and ``/proc`` state), and which began to leave.

Threads: owned by the watcher thread (:attr:`peerwatch.observer.Observer.local`), except
:meth:`LocalPeers.wake` and :meth:`LocalPeers.stop` (any thread; see the Waker).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Callable, Dict, List, Optional

from .core.awake import AwakeClock
from .core.records import ExitStatus, Failure, Heartbeat, Registration
from .core.schedule import RETRY_S
from .hangs.diagnose import RankState
from .hangs.heartbeat import OwnProgress, main_thread_position
from .proc import identity
from .proc.sources import Peer, post_mortem
from .proc.waker import Waker
from .rundir import rundir
from .rundir.rundir import EVENTS, HEARTBEATS, RANKS, RunDir, rank_file

logger = logging.getLogger("peerwatch")

STACK_DUMP_LIMIT = 1 << 20  # bytes of a dead peer's stack file read for its last words
Ended = Callable[[int, Optional[ExitStatus], Optional[Failure]], None]  # rank, what its post-mortem found


class LocalPeers:
    """The local peers watched (``peers``), those seen gone (``gone``: rank -> ``time_ns``), and
    the descriptors the watcher sleeps on. ``ended`` is told each post-mortem; ``awake`` is the
    hang judges' clock."""

    def __init__(self, run_dir: RunDir, me: Registration, use_pidfd: bool, ended: Ended, awake: AwakeClock) -> None:
        self.run_dir = run_dir
        self.me = me
        self.use_pidfd = use_pidfd
        self.peers: Dict[int, Peer] = {}
        self.gone: Dict[int, int] = {}
        self._waker = Waker(me.rank, self.peers, self.gone)  # what the watcher sleeps on
        self._ended = ended
        self._awake = awake
        self._last_beats: Dict[int, Heartbeat] = {}  # the last heartbeat read of each peer (hang judges)
        self._leaving: Dict[int, int] = {}  # rank -> when it began to leave, as its heartbeat said (see leaving)
        self._unsure_said = False  # the warning about peers that cannot be told: once, until all can
        self._unsure_told = False  # ... and a later time is said at DEBUG only

    # -- waking and sleeping (the descriptors are the Waker's) ----------------------------

    def start(self, folders_disabled: bool = False) -> bool:
        """Start inotify on ``ranks/`` and ``events/``; False if it cannot be used (the caller polls)."""
        rd = self.run_dir
        # The paths through the held descriptors, as they are when (re)made.
        return self._waker.watch_folders(lambda: [rd.at(EVENTS), rd.at(RANKS)], folders_disabled)

    def stop(self) -> None:
        """Stop the folder watch for good (any thread may call this)."""
        self._waker.stop()

    def stop_watching_folders(self) -> None:
        """No more wakes from the folders (a rank that acts on a verdict): see :class:`Waker`."""
        self._waker.stop_watching_folders()

    def wake(self) -> None:
        """Wake the watcher thread (any thread may call this)."""
        self._waker.wake()

    def wait(self, timeout: float) -> bool:
        """Sleep until a source fires or ``timeout`` s pass; True if something woke us.
        A peer whose pidfd fired is gone only if it is gone by its identity (see :class:`Waker`)."""
        woken, ended = self._waker.wait(timeout)
        for rank in ended:
            self._gone(rank)
        return woken

    def check_fds(self, every_pidfd: bool = False) -> None:
        """Check that the watcher's descriptors are still its own, and replace those that
        are not: the wake pipe, inotify's, and one pidfd (each in turn), or all of them."""
        for rank in self._waker.check_fds(every_pidfd):
            self._gone(rank)

    # -- the peers -----------------------------------------------------------------------

    def add(self, reg: Registration) -> None:
        """Watch a local peer of this run (its registration accepted by the observer)."""
        if reg.uid != os.geteuid():
            self.run_dir.warn_once(self.run_dir.join(RANKS, rank_file("rank", reg.rank)),
                                   f"belongs to uid {reg.uid}; not watched")
            return
        peer = Peer(reg, self.use_pidfd)
        self.peers[reg.rank] = peer
        if not peer.alive:
            self._gone(reg.rank)
        elif peer.pidfd is not None:
            self._waker.add(reg.rank, peer.pidfd)

    def poll(self) -> None:
        """Look at the peers without a pidfd: all of them where pidfds are not used, else
        those whose pidfd could not be had (it is tried again)."""
        for rank, peer in self.peers.items():
            if rank in self.gone or peer.pidfd is not None:
                continue
            if not peer.check_alive():
                self._gone(rank)
            elif peer.pidfd is not None:
                self._waker.add(rank, peer.pidfd)  # had at last

    def unsure(self) -> bool:
        """Whether a peer runs could not be told (EMFILE...). Said once, until every peer
        can be told again."""
        peers = [r for r, p in self.peers.items() if p.unsure and r not in self.gone]
        if peers and not self._unsure_said:
            logger.log(
                logging.WARNING if not self._unsure_told else logging.DEBUG,  # at length once, not at every flicker
                "peerwatch: rank %d cannot tell whether rank(s) %s still run (/proc or pidfd_open failed: out of file "
                "descriptors?); they are not taken for gone, and are looked at again every %gs until they can be told",
                self.me.rank, _rank_list(sorted(peers)), RETRY_S,
            )
        elif not peers and self._unsure_said:
            logger.log(logging.INFO if not self._unsure_told else logging.DEBUG,
                       "peerwatch: rank %d can tell again whether its peers run; watching them as before", self.me.rank)
            self._unsure_told = True
        self._unsure_said = bool(peers)
        return bool(peers)

    def _gone(self, rank: int) -> None:
        """A peer ended: its post-mortem, for the observer."""
        peer = self.peers.get(rank)
        if peer is None or rank in self.gone:
            return
        self.gone[rank] = time.time_ns()
        self._waker.remove(rank, peer.pidfd)
        peer.alive = False
        peer.close()
        self._ended(rank, *post_mortem(peer.reg, self.gone[rank], self.me.rank, lambda: self._stack_dump(rank)))

    def _stack_dump(self, rank: int) -> bytes:
        return self.run_dir.read_bytes(rundir.STACKS, rundir.stack_name(rank), limit=STACK_DUMP_LIMIT) or b""

    # -- for the hang judges ---------------------------------------------------------------

    def leaving(self) -> Dict[int, int]:
        """This host's ranks (ours too) whose heartbeat says they began to leave, and when,
        and the peers seen in ``exit()`` (since then: a process ended by ``_exit`` or a signal
        closes its sockets at once, while its pidfd fires only once its memory is torn down).
        Read only while an exception raised by torch.distributed is to be judged
        (rule: echo waits for the leaving): one heartbeat and one /proc look per rank not known to be leaving yet."""
        for rank in (self.me.rank, *self.peers):
            if rank in self._leaving:
                continue
            reg = self.peers[rank].reg if rank in self.peers else self.me
            beat = self.run_dir.read(HEARTBEATS, rank_file("rank", rank), Heartbeat)
            if beat is not None and beat.pid == reg.pid and beat.leaving_ns is not None:
                self._leaving[rank] = beat.leaving_ns
            elif rank != self.me.rank and rank not in self.gone and identity.exiting(reg.pid, reg.start_ticks):
                self._leaving[rank] = time.time_ns()
        return dict(self._leaving)

    def progress(self, mine: OwnProgress, stale_after_s: float, own: Optional[Heartbeat]) -> Dict[int, RankState]:
        """Every live local rank's last progress, from its heartbeat (ours: its progress
        and position from memory, its collectives as its heartbeat last published them)."""
        where, waiting = main_thread_position()
        published = RankState.of(own, "R") if own is not None else RankState(state="R")
        found = {self.me.rank: dataclasses.replace(
            published, step=mine.step, beat_mono_ns=mine.progress_ns, paused=mine.paused > 0,
            in_collective=waiting, where=where,
        )}
        for rank, peer in self.peers.items():
            if rank not in self.gone:
                found[rank] = self._peer_progress(peer.reg, stale_after_s)
        return found

    def _peer_progress(self, reg: Registration, stale_after_s: float) -> RankState:
        beat = self.run_dir.read(HEARTBEATS, rank_file("rank", reg.rank), Heartbeat)
        if beat is None:
            # Caught mid-rewrite twice (a loaded machine): the last one read still says
            # what the rank last said (inside paused(), its step); its age says the rest.
            beat = self._last_beats.get(reg.rank)
        else:
            self._last_beats[reg.rank] = beat
        try:
            info = identity.probe(reg.pid)
        except identity.Unknown:
            info = None
        state = info.state if info is not None and info.start_ticks == reg.start_ticks else "?"
        if beat is None or beat.pid != reg.pid:
            return RankState(state=state)
        # Its age counts only while this judge was awake to see it (peerwatch.core.awake).
        now_ns = time.monotonic_ns()
        age_ns = self._awake.counted_ns(now_ns - (time.time_ns() - beat.time_ns), now_ns)
        return RankState.of(beat, state, watcher_silent=age_ns > stale_after_s * 1e9)


def _rank_list(ranks: List[int], shown: int = 8) -> str:
    """"1, 4, 7" or "1, 2, ..., 8 and 40 more": a log line stays short at any scale."""
    text = ", ".join(map(str, ranks[:shown]))
    return text if len(ranks) <= shown else f"{text} and {len(ranks) - shown} more"


__all__ = ["LocalPeers"]
