"""What one rank knows of its run, gathered from the sources, handed to decide() as
:class:`peerwatch.verdict.decide.Observed`.

The sources: the records in ``ranks/`` and ``events/`` (read here), this host's peers as
processes (``Observer.local``, :class:`peerwatch.peers.LocalPeers`, which also holds what the
watcher sleeps on), and other hosts' records on a shared filesystem.

Threads: owned by the watcher thread (:mod:`peerwatch.peers` names the calls any thread may
make). Nothing else writes its state: the rank's own records, written by other threads, go to
disk through :class:`peerwatch.rundir.eventlog.OwnRecords` and are read back here like any
other record; the hang diagnosis is recorded through :meth:`Observer.record_diagnosis`.
"""

from __future__ import annotations

import logging
import os
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
from .hangs.heartbeat import OwnProgress
from .hosts import sharedfs
from .peers import LocalPeers
from .proc import identity
from .proc.sources import oom_kill_count
from .rundir import eventlog, rundir
from .rundir.eventlog import OwnRecords
from .rundir.rundir import DIAGNOSIS_FILE, EVENTS, RANKS, VERDICT_FILE, RunDir, rank_file
from .verdict import decide

logger = logging.getLogger("peerwatch")
R = TypeVar("R")

_IDENTIFIED = (Success, Failure, ExitStatus, Ack)  # a rank's records that name its process
_WATCHED_EVENTS = {k: v for k, v in EVENT_TYPES.items() if k not in ("thread", "unsignalled")}  # for the report only


class Observer:
    """The sources of one rank, and what they said so far."""

    def __init__(
        self, run_dir: RunDir, me: Registration, use_pidfd: bool, remote: Optional[sharedfs.RemoteWatch],
        records: Optional[OwnRecords] = None, awake: Optional[AwakeClock] = None,
    ) -> None:
        self.run_dir = run_dir
        # The judges' clock (hangs, and other hosts on a shared filesystem: ``remote``'s): how
        # long they were awake to see a silence. Ticked by the watcher on every turn of its
        # loop (a heartbeat at most apart) and as it judges.
        self.awake = awake if awake is not None else AwakeClock.every(1.0)
        self.me = me
        self.remote = remote  # shared-filesystem mode: other hosts' heartbeats
        self.local = LocalPeers(run_dir, me, use_pidfd, self._post_mortem, self.awake)
        self.peers, self.gone = self.local.peers, self.local.gone  # the LocalPeers' (written there, read here)
        # Where this process's records are written (its own, from other threads, too).
        self._records = records if records is not None else OwnRecords(run_dir, me)
        self.registrations: Dict[int, Registration] = {me.rank: me}
        self._local_pids: Set[int] = {me.pid}  # of this host's registrations: kept as they come
        self.events: Dict[str, object] = {}  # file name in events/ -> record
        self._seen: Dict[str, Dict[str, int]] = {RANKS: {}, EVENTS: {}}  # name -> inode
        # The last scan could not list a folder or read a record (EMFILE...): what it missed
        # is not known (a success marker may be there), so no verdict rests on its absence.
        self.unread = False
        self._unread_said = False  # the warning about it: once, until a scan reads everything
        # Exit statuses learnt while deciding, written after: the parent of a dead rank is
        # the one that can judge at once, and the write would only delay it.
        self._unwritten: List[Tuple[str, ExitStatus]] = []
        self._oom_kills_at_start = oom_kill_count()

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
        self.local.poll()
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
        self.local.add(reg)

    def _post_mortem(self, rank: int, status: Optional[ExitStatus], failure: Optional[Failure]) -> None:
        """A local peer ended: what its post-mortem found (LocalPeers tells it)."""
        if failure is not None:  # its own GIL watchdog ended it: say so on its behalf
            self.write_event(rank_file("failure", rank), failure)
            self.events.setdefault(rank_file("failure", rank), failure)
        if status is not None:
            self.events.setdefault(rank_file("exit", rank), status)
            self._unwritten.append((rank_file("exit", rank), status))

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

    def judge_remote(self, read: bool) -> None:
        """Shared filesystem: read the other hosts' heartbeats (``read``: as a judge), then,
        while no verdict is known, say on the behalf of each remote rank lost that it is
        (rule: a silent host is lost; first record wins)."""
        if self.remote is None:
            return
        ended = self.ended_ranks()
        if read:
            self.remote.read(self.registrations, ended)
        if VERDICT_FILE in self.events:
            return
        for failure in self.remote.lost(self.registrations, ended, self.me):
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
        """This host's ranks (ours included; :func:`peerwatch.proc.identity.local_ranks`) that
        this rank watches, not gone and not finished, lowest first. One it does not watch (a
        registration under another uid) is never seen gone: it must not be taken for a judge
        or an enforcer."""
        finished, me = self.finished(), self.me.rank
        return [
            r for r in identity.local_ranks(self.registrations)
            if r not in self.gone and r not in finished and (r == me or r in self.peers)
        ]

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
            progress=self.local.progress(progress, stale_after_s, own) if progress is not None else {},
            now_mono_ns=time.monotonic_ns(), missing=missing, diagnosis=self.diagnosis(),
            leaving=self.local.leaving() if not isinstance(verdict, Verdict) and _judging_an_echo(failures) else {},
            awake_since_ns=self.awake.since_ns,
            unread=self.unread,
            interrupts=self.of_kind(Interrupt),  # type: ignore[arg-type]
        )

    def _oom_kills_since_start(self) -> int:
        if self._oom_kills_at_start is None or not (self.gone or self.events):
            return 0
        now = oom_kill_count()
        return 0 if now is None else max(0, now - self._oom_kills_at_start)

    def diagnosis(self) -> Optional[Diagnosis]:
        """The diagnosis written in events/ (by any judge of this host), if any."""
        found = self.events.get(DIAGNOSIS_FILE)
        return found if isinstance(found, Diagnosis) else None

def _judging_an_echo(failures: Dict[int, object]) -> bool:
    """A failure record is an exception raised by torch.distributed: the echo, perhaps, of
    a rank that is leaving (rule: echo waits for the leaving)."""
    return any(isinstance(f, Failure) and f.collective for f in failures.values())


__all__ = ["Observer"]
