"""What one rank knows of its run, gathered from the sources, handed to decide() as
:class:`peerwatch.verdict.decide.Observed`.

The sources: pidfds of local peers (readable when the process ends), inotify on the
``ranks/`` and ``events/`` folders (through :class:`peerwatch.proc.sources.FolderWatch`, which
writes to the wake pipe), the heartbeats of local peers (for the hang judges), other
hosts' records on a shared filesystem, and post-mortems of a peer that ended: its exit
status where we are its parent, else faulthandler's last words in its stack file.

Threads: everything here is owned by the watcher thread, except :meth:`Observer.wake`
and :meth:`Observer.stop`, which any thread may call (see :class:`peerwatch.proc.waker.Waker`).
Nothing else writes its state: the rank's own records (failure, success...), written by
other threads, go to disk through :class:`peerwatch.rundir.eventlog.OwnRecords` and are read
back here like any other record; the hang diagnosis is recorded through
:meth:`Observer.record_diagnosis`.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import stat
import time
from typing import Dict, List, Optional, Set, Tuple, Type, TypeVar

from .core.awake import AwakeClock
from .core.records import (
    EVENT_TYPES,
    Ack,
    Diagnosis,
    ExitStatus,
    Failure,
    Heartbeat,
    Interrupt,
    Registration,
    Success,
    Verdict,
    encode,
)
from .core.schedule import RETRY_S
from .hangs.diagnose import RankState
from .hangs.heartbeat import OwnProgress, main_thread_position
from .hosts import sharedfs
from .proc import identity
from .proc.sources import Peer, oom_kill_count, post_mortem
from .proc.waker import Waker
from .rundir import eventlog, rundir
from .rundir.eventlog import OwnRecords
from .rundir.rundir import DIAGNOSIS_FILE, EVENTS, HEARTBEATS, RANKS, VERDICT_FILE, RunDir, rank_file
from .verdict import decide

logger = logging.getLogger("peerwatch")
R = TypeVar("R")

_IDENTIFIED = (Success, Failure, ExitStatus, Ack)  # a rank's records that name its process
_WATCHED_EVENTS = {k: v for k, v in EVENT_TYPES.items() if k not in ("thread", "unsignalled")}  # for the report only
STACK_DUMP_LIMIT = 1 << 20  # bytes of a dead peer's stack file read for its last words


class Observer:
    """The sources of one rank, and what they said so far."""

    def __init__(
        self, run_dir: RunDir, me: Registration, use_pidfd: bool, remote: Optional[sharedfs.RemoteWatch],
        records: Optional[OwnRecords] = None, interval_s: float = 1.0,
    ) -> None:
        self.run_dir = run_dir
        # The hang judges' clock: how long they were awake to see a silence. Ticked by the
        # watcher on every turn of its loop (``interval_s`` at most apart) and as it judges.
        self.awake = AwakeClock.every(interval_s)
        self.me = me
        self.use_pidfd = use_pidfd
        self.remote = remote  # shared-filesystem mode: other hosts' heartbeats
        self.peers: Dict[int, Peer] = {}  # local peers watched through the OS
        self.gone: Dict[int, int] = {}  # rank -> when we saw its process gone (time_ns)
        self._waker = Waker(me.rank, self.peers, self.gone)  # what the watcher sleeps on
        # Where this process's records are written (its own, from other threads, too).
        self._records = records if records is not None else OwnRecords(run_dir, me)
        self.registrations: Dict[int, Registration] = {me.rank: me}
        self._local_pids: Set[int] = {me.pid}  # of this host's registrations: kept as they come
        self._last_beats: Dict[int, Heartbeat] = {}  # the last heartbeat read of each peer (hang judges)
        self._leaving: Dict[int, int] = {}  # rank -> when it began to leave, as its heartbeat said (see _leaving_ranks)
        self.events: Dict[str, object] = {}  # file name in events/ -> record
        self._seen: Dict[str, Dict[str, int]] = {RANKS: {}, EVENTS: {}}  # name -> inode
        # The last scan could not list a folder or read a record (EMFILE...): what it missed
        # is not known (a success marker may be there), so no verdict rests on its absence.
        self.unread = False
        self._unread_said = False  # the warning about it: once, until a scan reads everything
        self._unsure_said = False  # the warning about peers that cannot be told: once, until all can
        self._unsure_told = False  # ... and a later time is said at DEBUG only
        # Exit statuses learnt while deciding, written after: the parent of a dead rank is
        # the one that can judge at once, and the write would only delay it.
        self._unwritten: List[Tuple[str, ExitStatus]] = []
        self._oom_kills_at_start = oom_kill_count()
        self._events_path = run_dir.join(EVENTS)  # stat'ed on every wake-up: joined once
        try:
            self._events_id = _dir_id(self._events_path)  # to tell when the run directory is removed
            self._run_id = _dir_id(run_dir.path)  # ... or replaced by another one
        except OSError:
            self._events_id = self._run_id = None

    def storage_lost(self) -> Optional[str]:
        """How the run directory was lost (removed, or replaced by another one), or None.

        Nothing written there from now on reaches a peer, and nothing a peer writes
        (success markers included) reaches us: a peer's end proves nothing any more.
        """
        if self._events_id is None:
            return None
        try:
            now = _dir_id(self._events_path)
            if now == self._events_id:
                return None
            run_now = _dir_id(self.run_dir.path)
        except OSError:
            return None  # cannot tell: judged as before
        if run_now is not None and run_now != self._run_id:
            return "was replaced by another directory"  # moved aside, or removed, and made anew
        return "was removed" if now is None else "was replaced by another directory"

    # -- waking and sleeping (the descriptors are the Waker's) ----------------------------

    def start(self) -> bool:
        """Start inotify on the folders; False if it cannot be used (the caller polls)."""
        disabled = self.remote is not None and sharedfs.inotify_disabled()
        rd = self.run_dir
        # The paths through the held descriptors, as they are when (re)made.
        return self._waker.watch_folders(lambda: [rd.at(EVENTS), rd.at(RANKS)], disabled)

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
            self._peer_gone(rank)
        return woken

    def check_fds(self, every_pidfd: bool = False) -> None:
        """Check that the watcher's descriptors are still its own, and replace those that
        are not: the wake pipe, inotify's, and one pidfd (each in turn), or all of them."""
        for rank in self._waker.check_fds(every_pidfd):
            self._peer_gone(rank)


    # -- looking at the run directory ------------------------------------------------

    def scan(self) -> None:
        """Read what is new in ``ranks/`` and ``events/``. What cannot be read now is read
        again at the next scan (:attr:`unread` meanwhile)."""
        self.unread = False
        for name in self._changed(RANKS):
            parsed = rundir.parse_rank_file(name)
            if parsed is None or parsed[0] != "rank" or parsed[1] == self.me.rank:
                continue
            reg = self._read(RANKS, name, Registration)
            if reg is not None and reg.rank == parsed[1]:
                self._add_peer(reg)
        # Before events/ is read: a peer seen gone here has its success marker (written before
        # it ended) read below; read the other way round, a peer that wrote its marker and ended
        # in between would be taken for gone without one.
        self._poll_peers()
        for name in self._changed(EVENTS):
            record = self._read_event(name)
            if record is not None and not self._of_registered_process(name, record):
                self.events.pop(name, None)
                continue
            if record is not None:
                self.events[name] = record
                if eventlog.wanted_from_scan(name, record):  # written at exit, where its writer could not log it
                    eventlog.record(self.run_dir, EVENTS, name, record, self.me.rank)
        self._unread_said = self._unread_said and self.unread

    def _poll_peers(self) -> None:
        """Look at the peers without a pidfd: all of them where pidfds are not used, else
        those whose pidfd could not be had (it is tried again)."""
        for rank, peer in self.peers.items():
            if rank in self.gone or peer.pidfd is not None:
                continue
            if not peer.check_alive():
                self._peer_gone(rank)
            elif peer.pidfd is not None:
                self._waker.add(rank, peer.pidfd)  # had at last

    def unsure(self) -> bool:
        """Something could not be looked at (EMFILE...): a record, or whether a peer runs.
        The watcher looks again soon, not only when a source fires. Said once, until every
        peer can be told again."""
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
        return self.unread or bool(peers)

    def _read(self, sub: str, name: str, cls: Type[R]) -> Optional[R]:
        """The record, as :meth:`RunDir.read`; one that cannot be read now (EMFILE...) is
        None, and is read again at the next scan."""
        try:
            return self.run_dir.read(sub, name, cls, strict=True)
        except OSError as e:
            self._unread(sub, name, e)
            return None

    def _unread(self, sub: str, name: str, e: OSError) -> None:
        if not self._unread_said:
            self._unread_said = True
            logger.warning("peerwatch: rank %d: %s cannot be read now (%s); read again soon, and until then no "
                           "verdict rests on what it may say", self.me.rank, self.run_dir.join(sub, name), e.strerror)
        self.unread = True
        self._seen[sub].pop(name, None)

    def _read_event(self, name: str) -> Optional[object]:
        rd = self.run_dir
        if name == VERDICT_FILE:
            return self._read(EVENTS, name, Verdict)
        if name == DIAGNOSIS_FILE:
            return self._read(EVENTS, name, Diagnosis)
        parsed = rundir.parse_rank_file(name)
        cls = _WATCHED_EVENTS.get(parsed[0]) if parsed else None
        if parsed is None or cls is None:
            return None
        record = self._read(EVENTS, name, cls)
        if record is not None and getattr(record, "rank", None) != parsed[1]:
            rd.warn_once(rd.join(EVENTS, name), "names another rank than its file name; ignored")
            return None
        return record

    def _of_registered_process(self, name: str, record: object) -> bool:
        """A rank's record (success, failure, exit status, ack) is its registered process's:
        one with another pid is another job's (two jobs given one run directory) or a stray
        process's, and is ignored, logged once. A record of a rank not registered yet, or
        one that says no pid (0: another host's, from the store bridge), is kept."""
        if self._belongs(record):
            return True
        assert isinstance(record, _IDENTIFIED)
        self.run_dir.warn_once(
            self.run_dir.join(EVENTS, name), f"is the record of pid {record.pid}, but rank {record.rank} is "
            f"registered as pid {self.registrations[record.rank].pid}: not a record of this run (two jobs share this run directory?); ignored",
        )
        return False

    def _belongs(self, record: object) -> bool:
        if not isinstance(record, _IDENTIFIED):
            return True
        reg = self.registrations.get(record.rank)
        return reg is None or record.pid in (0, reg.pid) or not identity.is_local(reg)

    def _changed(self, sub: str) -> List[str]:
        seen = self._seen[sub]
        changed = []
        try:
            with os.scandir(self.run_dir.at(sub)) as it:
                for entry in it:
                    if seen.get(entry.name) != entry.inode():
                        seen[entry.name] = entry.inode()
                        changed.append(entry.name)
        except OSError as e:
            self.run_dir.warn_once(self.run_dir.join(sub), f"cannot be listed ({e.strerror})")
            self.unread = True  # what is there is not known
        return changed

    def _add_peer(self, reg: Registration) -> None:
        old = self.registrations.get(reg.rank)
        if old is not None and (old.pid, old.start_ticks) == (reg.pid, reg.start_ticks):
            return
        where = self.run_dir.join(RANKS, rank_file("rank", reg.rank))
        if not rundir.same_job(reg, self.me):
            self.run_dir.warn_once(
                where, f"registers rank {reg.rank} of a job of world size {reg.world_size} (pid {reg.pid}), and this "
                f"rank's world size is {self.me.world_size}: two jobs share this run directory; that rank is "
                "neither watched nor ever signalled; give each job its own PEERWATCH_DIR",
            )
            return
        if reg.rank in self.peers:
            self.run_dir.warn_once(
                where, f"re-registered rank {reg.rank} as pid {reg.pid}; keeping the first registration "
                f"(pid {old.pid if old else '?'})",
            )
            return
        self.registrations[reg.rank] = reg
        for name, record in list(self.events.items()):  # read before this registration: whose are they?
            if not self._of_registered_process(name, record):
                del self.events[name]
        if not identity.is_local(reg):
            if reg.host == identity.hostname() and reg.boot_id == identity.boot_id():
                # This host, another PID namespace: its pid means nothing here.
                logger.warning(
                    "peerwatch: rank %d registered from another PID namespace of this host (%s, pid %d there; ours is "
                    "%s): it cannot be watched or signalled from rank %d. Start every rank of a host in one PID "
                    "namespace", reg.rank, reg.pidns, reg.pid, identity.pid_namespace(), self.me.rank,
                )
            return  # another host's rank: not ours to watch through the OS
        self._local_pids.add(reg.pid)
        if reg.uid != os.geteuid():
            self.run_dir.warn_once(where, f"belongs to uid {reg.uid}; not watched")
            return
        peer = Peer(reg, self.use_pidfd)
        self.peers[reg.rank] = peer
        if not peer.alive:
            self._peer_gone(reg.rank)
        elif peer.pidfd is not None:
            self._waker.add(reg.rank, peer.pidfd)

    # -- a peer ended: the post-mortem ---------------------------------------------------

    def _peer_gone(self, rank: int) -> None:
        peer = self.peers.get(rank)
        if peer is None or rank in self.gone:
            return
        self.gone[rank] = time.time_ns()
        self._waker.remove(rank, peer.pidfd)
        peer.alive = False
        peer.close()
        status, failure = post_mortem(peer.reg, self.gone[rank], self.me.rank, lambda: self._stack_dump(rank))
        if failure is not None:  # its own GIL watchdog ended it: say so on its behalf
            self.write_event(rank_file("failure", rank), failure)
            self.events.setdefault(rank_file("failure", rank), failure)
        if status is not None:
            self.events.setdefault(rank_file("exit", rank), status)
            self._unwritten.append((rank_file("exit", rank), status))

    def _stack_dump(self, rank: int) -> bytes:
        return self.run_dir.read_bytes(rundir.STACKS, rundir.stack_name(rank), limit=STACK_DUMP_LIMIT) or b""

    def flush(self) -> None:
        """Write the exit statuses learnt since the last flush."""
        while self._unwritten:
            name, record = self._unwritten.pop(0)
            self.write_event(name, record)

    def write_event(self, name: str, record: object) -> bool:
        """Write a record into ``events/`` (first writer wins); False if it was not ours."""
        return self._records.write(name, record, self._belongs)

    def write_event_replacing(self, name: str, record: object) -> bool:
        """Replace a record in ``events/`` (the diagnosis, as it is resolved); False if it failed."""
        try:
            return self.run_dir.write(EVENTS, name, encode(record), replace=True)
        except OSError as e:
            logger.error("peerwatch: rank %d could not write %s: %s", self.me.rank, name, e)
            return False

    def record_diagnosis(self, record: Diagnosis, replace: bool) -> bool:
        """Write the hang diagnosis (``replace``: over the one there; else the first writer
        wins); True if it was written. What is known follows: ``record``, or what is there
        now (another judge's)."""
        wrote = self.write_event_replacing(DIAGNOSIS_FILE, record) if replace else self.write_event(DIAGNOSIS_FILE, record)
        if wrote:
            self.events[DIAGNOSIS_FILE] = record
        else:
            self.events.pop(DIAGNOSIS_FILE, None)
            existing = self.run_dir.read(EVENTS, DIAGNOSIS_FILE, Diagnosis)
            if existing is not None:
                self.events[DIAGNOSIS_FILE] = existing
        return wrote

    def record_lost(self, lost: Tuple[Failure, ...]) -> None:
        """Shared filesystem: say on the lost ranks' behalf that they are lost (first record wins)."""
        for failure in lost:
            name = rank_file("failure", failure.rank)
            if self.write_event(name, failure):
                logger.error("peerwatch: rank %d declares rank %d lost: %s", self.me.rank, failure.rank, failure.message)
                self.events.setdefault(name, failure)
            else:
                existing = self.run_dir.read(EVENTS, name, Failure)
                if existing is not None:
                    self.events[name] = existing

    # -- what is known -------------------------------------------------------------------

    def of_kind(self, cls: type) -> Dict[int, object]:
        """rank -> record, for the records of type ``cls`` seen in ``events/``."""
        return {getattr(r, "rank"): r for r in self.events.values() if isinstance(r, cls)}  # noqa: B009

    def finished(self) -> Set[int]:
        return set(self.of_kind(Success))

    def acked(self) -> Set[int]:
        return set(self.of_kind(Ack))

    def live_local_ranks(self) -> List[int]:
        """This host's ranks (ours included) not gone and not finished, lowest first."""
        finished = self.finished()
        me = self.me.rank
        return sorted(
            r for r in self.registrations
            if r not in self.gone and r not in finished and (r == me or r in self.peers)
        )

    def local_pids(self) -> Set[int]:
        """The pids of this host's ranks, ours included (a rank's children list skips them)."""
        return set(self._local_pids)

    def ended_ranks(self) -> Set[int]:
        """Ranks with a record of how they ended (success, failure, exit status)."""
        return {getattr(r, "rank") for r in self.events.values() if isinstance(r, (Success, Failure, ExitStatus))}  # noqa: B009

    def peer_failed(self) -> bool:
        """True if a peer has failed, judged or not yet."""
        verdict = self.events.get(VERDICT_FILE)
        if isinstance(verdict, Verdict):
            return verdict.rank != self.me.rank
        if self.gone:
            return True
        return any(isinstance(r, (Failure, ExitStatus)) and r.rank != self.me.rank for r in self.events.values())

    def read_remote(self) -> None:
        """Shared filesystem, as a judge: read the other hosts' heartbeats."""
        if self.remote is not None:
            self.remote.read(self.registrations, self.ended_ranks())

    def observed(
        self, progress: Optional[OwnProgress] = None, missing: Tuple[int, ...] = (), stale_after_s: float = 0.0,
        own: Optional[Heartbeat] = None,
    ) -> decide.Observed:
        """Everything known now, for decide(). ``progress``: this rank's own (hang judges
        only; the peers' is read from their heartbeats then); ``own``: what this rank's
        heartbeat last published of its collectives."""
        self.awake.tick(time.monotonic_ns())  # before the heartbeats are read: a gap shows now
        verdict = self.events.get(VERDICT_FILE)
        failures = self.of_kind(Failure)
        return decide.Observed(
            self_rank=self.me.rank, now_ns=time.time_ns(), now_boot_ns=identity.boot_clock_ns(),
            registrations=self.registrations,
            successes=self.finished(), failures=failures,  # type: ignore[arg-type]
            exit_statuses=self.of_kind(ExitStatus),  # type: ignore[arg-type]
            gone=self.gone, verdict=verdict if isinstance(verdict, Verdict) else None,
            oom_kills=self._oom_kills_since_start(),
            progress=self._progress(progress, stale_after_s, own) if progress is not None else {},
            now_mono_ns=time.monotonic_ns(), missing=missing, diagnosis=self.diagnosis(),
            remote_silence=self.remote.silence(self.awake) if self.remote is not None else {},
            leaving=self._leaving_ranks() if not isinstance(verdict, Verdict) and _judging_an_echo(failures) else {},
            awake_since_ns=self.awake.since_ns,
            unread=self.unread,
            interrupts=self.of_kind(Interrupt),  # type: ignore[arg-type]
        )

    def _leaving_ranks(self) -> Dict[int, int]:
        """This host's ranks (ours too) whose heartbeat says they began to leave, and when,
        and the peers seen in ``exit()`` (since then: a process ended by ``_exit`` or a signal
        closes its sockets at once, while its pidfd fires only once its memory is torn down).
        Read only while an exception raised by torch.distributed is to be judged
        (rule: echo waits for the leaving): one heartbeat and one /proc look per rank not known to be leaving yet."""
        for rank in (self.me.rank, *self.peers):
            if rank in self._leaving:
                continue
            reg = self.registrations[rank]
            beat = self.run_dir.read(HEARTBEATS, rank_file("rank", rank), Heartbeat)
            if beat is not None and beat.pid == reg.pid and beat.leaving_ns is not None:
                self._leaving[rank] = beat.leaving_ns
            elif rank != self.me.rank and rank not in self.gone and identity.exiting(reg.pid, reg.start_ticks):
                self._leaving[rank] = time.time_ns()
        return dict(self._leaving)

    def _oom_kills_since_start(self) -> int:
        if self._oom_kills_at_start is None or not (self.gone or self.events):
            return 0
        now = oom_kill_count()
        return 0 if now is None else max(0, now - self._oom_kills_at_start)

    def diagnosis(self) -> Optional[Diagnosis]:
        """The diagnosis written in events/ (by any judge of this host), if any."""
        found = self.events.get(DIAGNOSIS_FILE)
        return found if isinstance(found, Diagnosis) else None

    def _progress(self, mine: OwnProgress, stale_after_s: float, own: Optional[Heartbeat]) -> Dict[int, RankState]:
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
        age_ns = self.awake.counted_ns(now_ns - (time.time_ns() - beat.time_ns), now_ns)
        return RankState.of(beat, state, watcher_silent=age_ns > stale_after_s * 1e9)


def _rank_list(ranks: List[int], shown: int = 8) -> str:
    """"1, 4, 7" or "1, 2, ..., 8 and 40 more": a log line stays short at any scale."""
    text = ", ".join(map(str, ranks[:shown]))
    return text if len(ranks) <= shown else f"{text} and {len(ranks) - shown} more"


def _judging_an_echo(failures: Dict[int, object]) -> bool:
    """A failure record is an exception raised by torch.distributed: the echo, perhaps, of
    a rank that is leaving (rule: echo waits for the leaving)."""
    return any(isinstance(f, Failure) and f.collective for f in failures.values())


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


__all__ = ["Observer"]
