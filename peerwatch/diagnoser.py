"""A hang judge's diagnosis, carried out: learn the threshold, diagnose (pure, in
:mod:`peerwatch.hangs.diagnose`), write ``events/diagnosis.json`` (first writer wins, so the
job logs it once), and say when the job moved again. Owned by the watcher thread.

It writes no one else's state: the diagnosis is recorded through its observer
(:meth:`peerwatch.observer.Observer.record_diagnosis`, the one writer of what the observer
knows), which says whether this judge's record was written or another judge's stands.

Across hosts: while this host's ranks stand still, the judge writes their summary
(:class:`peerwatch.hangs.diagnose.Summary`) into ``RUN/stall.json`` for the store bridge to publish, and
judges the other hosts' ranks beside its own from ``RUN/stalls-remote.json``, which the
bridge writes from the summaries it read (their last move already on this host's clock).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Dict, Optional, Protocol

from .core.records import BUSY, HANG, Diagnosis
from .hangs import diagnose
from .proc import activity, identity
from .rundir.rundir import REMOTE_STALLS_FILE, STALL_FILE, RunDir
from .verdict import decide

logger = logging.getLogger("peerwatch")
REMOTE_FRESH_S = 10.0  # stalls-remote.json older than this (plus two refreshes) is the past: left out


class Recorder(Protocol):
    """What a diagnoser needs of the watcher's observer (:class:`peerwatch.observer.Observer`
    has it): passed down, so this stage does not import the one that observes."""

    run_dir: RunDir

    def diagnosis(self) -> Optional[Diagnosis]: ...
    def record_diagnosis(self, record: Diagnosis, replace: bool) -> bool: ...


class Diagnoser:
    def __init__(
        self, rank: int, fixed_s: Optional[float], observer: Recorder, auto: bool = False, interval_s: float = 1.0,
    ) -> None:
        self._rank = rank
        self._interval_ns = int(interval_s * 1e9)
        self._stall_written = False  # RUN/stall.json says this host stands still
        self._observer = observer
        self._auto = auto  # hang_timeout=auto: the diagnosis ends the job (at its end_at_ns)
        self.threshold = diagnose.Threshold(fixed_s)
        self._mine: Optional[Diagnosis] = None  # the one this judge wrote, until resolved
        self._mine_last: Optional[int] = None  # the job's last move when it was written (CLOCK_MONOTONIC)
        self._window_ns = activity.WINDOW * self._interval_ns  # the samples a rank's signs of work cover
        self._idle_since: Optional[int] = None  # a busy finding's laggards first looked stuck (CLOCK_MONOTONIC)

    def look(self, obs: decide.Observed) -> Optional[Diagnosis]:
        """Diagnose from what the hang judges observed; the diagnosis of the stall going
        on (written by this judge or another one of this host), or None. A busy finding
        is looked at again every time: its laggard may stop working (a hang, once it has shown
        no work for a whole window more)."""
        timeout_ms = min((p.timeout_ms for p in obs.progress.values() if p.timeout_ms > 0), default=0)
        stuck_ns = self.threshold.stuck_ns(timeout_ms, self._interval_ns / 1e9)
        # This host's summary is written from the stuck threshold, for the bridge: it is
        # published from half the learnt threshold as before, or from the stuck one where it
        # holds a plainly stuck rank (Summary.public), so that a whole host behind is named
        # by the others as soon as by its own judges; the others' are read with it.
        ranks = self._with_other_hosts(self.ranks(obs), obs, self.threshold.value_ns(timeout_ms), stuck_ns)
        last = diagnose.last_move(ranks)
        self.threshold.observe(last, obs.awake_since_ns)
        self._resolve(last, obs.now_ns)
        current = self._observer.diagnosis()
        if current is not None and current.resolved_ns is None and current.finding != BUSY:
            return current
        found = diagnose.diagnose(ranks, obs.now_mono_ns, self.threshold.value_ns(timeout_ms), timeout_ms,
                                   obs.awake_since_ns, stuck_ns)
        busy = current is not None and current.resolved_ns is None and current.finding == BUSY
        if not busy or (found is not None and found.kind == BUSY):
            self._idle_since = None
        if found is None or (busy and (found.kind == BUSY or self._dip(found, ranks, obs))):
            return current  # nothing, still busy, or not stuck for long enough: the record written stands
        stalled_at_ns = obs.now_ns - found.since_ns
        record = Diagnosis(
            finding=found.kind, laggards=found.laggards, entered=found.entered, since_ns=found.since_ns,
            stalled_at_ns=stalled_at_ns, time_ns=obs.now_ns, made_by=self._rank,
            detail=found.detail, group=found.group, seq=found.seq, op=found.op,
            end_at_ns=self._end_at(found, stalled_at_ns, obs.now_ns),
            hosts=tuple((r, ranks[r].host) for r in found.laggards if ranks[r].host),
        )
        # An earlier stall's, resolved, or a busy laggard now stuck: this one replaces it.
        # Else the first judge's stands (the observer then knows that one).
        if self._observer.record_diagnosis(record, replace=current is not None):
            self._mine, self._mine_last = record, last
            logger.warning("peerwatch: %s: %s (diagnosed by rank %d; %s)", found.kind, found.detail, self._rank,
                           self._what_next(record))
        return self._observer.diagnosis()

    def _dip(self, found: diagnose.Found, ranks: Dict[int, diagnose.RankState], obs: decide.Observed) -> bool:
        """True while busy laggards that now show no work have shown none for less than a
        whole window more: a window with a dip (a loaded host's late samples, a pause for
        data, a watcher late once) does not make a hang of a rank that worked. Stopped
        (SIGSTOP) is stuck at once."""
        if found.kind != HANG or any(ranks[r].state in diagnose.STOPPED_STATES for r in found.laggards if r in ranks):
            return False
        if self._idle_since is None:
            self._idle_since = obs.now_mono_ns
        return obs.now_mono_ns - max(self._idle_since, obs.awake_since_ns) < self._window_ns  # awake time only

    def _end_at(self, found: diagnose.Found, stalled_at_ns: int, now_ns: int) -> Optional[int]:
        """When hang_timeout=auto ends the job (busy: near the collective timeout; else at
        once); None without auto: nothing will end it, and the record says no time."""
        if not self._auto:
            return None
        return stalled_at_ns + found.end_after_ns if found.kind == BUSY else now_ns

    def _with_other_hosts(
        self, local: Dict[int, diagnose.RankState], obs: decide.Observed, threshold_ns: int, stuck_ns: int,
    ) -> Dict[int, diagnose.RankState]:
        """This host's ranks, and, while they stand still, the other hosts' that do too
        (each rank with its host named). Says the former to the bridge (RUN/stall.json)."""
        host = identity.hostname()
        summary = diagnose.summarize(local, host, obs.now_mono_ns, threshold_ns, obs.awake_since_ns, stuck_ns)
        if summary is None:
            if self._stall_written:  # it moved again: the bridge stops saying it stands still
                self._stall_written = not self._observer.run_dir.write_or_log(STALL_FILE, b"{}")
            return local
        written = self._observer.run_dir.write_or_log(STALL_FILE, summary.to_json())  # else the other hosts miss it
        self._stall_written = written or self._stall_written
        remote = self._remote(summary.threshold_ms)
        if not remote:
            return local
        remote.update({r: dataclasses.replace(s, host=host) for r, s in local.items()})
        return remote

    def _remote(self, threshold_ms: int) -> Dict[int, diagnose.RankState]:
        """The other hosts' ranks, from RUN/stalls-remote.json (the bridge's); {} if there is
        none, or it is stale (the bridge stopped), or it is not ours."""
        run_dir = self._observer.run_dir
        path = run_dir.join(REMOTE_STALLS_FILE)
        fresh_ns = int(REMOTE_FRESH_S * 1e9) + 2 * diagnose.refresh_ns(threshold_ms, self._interval_ns)
        if not run_dir.recent(REMOTE_STALLS_FILE, fresh_ns):
            return {}
        data = run_dir.read_bytes("", REMOTE_STALLS_FILE)
        out: Dict[int, diagnose.RankState] = {}
        try:
            hosts = json.loads(data.decode("utf-8"))["hosts"] if data else []
            for moved_mono_ns, text in hosts:
                summary = diagnose.Summary.from_json(str(text).encode())
                if summary is not None and isinstance(moved_mono_ns, int):
                    out.update(diagnose.remote_ranks(summary, moved_mono_ns))
        except (UnicodeDecodeError, ValueError, TypeError, KeyError):
            run_dir.warn_once(path, "is not a list of other hosts' stalls; ignored")
            return {}
        return out

    def _what_next(self, record: Diagnosis) -> str:
        """What the log line promises: the job goes on, or when it ends."""
        if not self._auto:
            return "the job goes on; hang_timeout=auto would end it"
        if record.finding != BUSY:
            return "hang_timeout=auto ends the job now"
        at = time.strftime("%H:%M:%S", time.localtime((record.end_at_ns or record.time_ns) / 1e9))
        return f"the job goes on; hang_timeout=auto ends it at {at} if nothing moves, before the collective timeout"

    def _resolve(self, last: Optional[int], now_ns: int) -> None:
        """The job moved after this judge's diagnosis: say it was slow, not stuck."""
        mine = self._mine
        if mine is None or last is None:
            return
        # Compared on the one clock the moves are stamped with: converted to the wall
        # clock, the same instant differed by however long the thread was descheduled
        # between reading the two clocks (over 1 ms on a loaded host: a false "moved").
        if self._mine_last is not None and last <= self._mine_last:
            return
        resolved = dataclasses.replace(mine, resolved_ns=now_ns)
        if self._observer.record_diagnosis(resolved, replace=True):
            logger.warning("peerwatch: the job moved again %.1fs after it stopped: %s (%s)",
                           (now_ns - mine.stalled_at_ns) / 1e9,
                           "it was busy, as diagnosed" if mine.finding == BUSY else "it was slow, not stuck", mine.detail)
        self._mine = None

    @staticmethod
    def ranks(obs: decide.Observed) -> Dict[int, diagnose.RankState]:
        return obs.live_progress()


__all__ = ["Diagnoser"]
