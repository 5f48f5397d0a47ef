"""The straggler finding, carried out: gather the ranks' waits, judge (pure, in
:mod:`peerwatch.hangs.straggler`), write ``RUN/stragglers.json``, and log once when a straggler
appears and once when it clears. Owned by the watcher thread of the lowest live local rank.

Every ``SLOT_BEATS`` heartbeats, that rank reads its host's heartbeats (one per local rank)
and makes the host's profiles. On one host it judges them. Across hosts it writes them into
``RUN/straggle.json``; the store bridge publishes that file, per host, in ``strag/<i>``;
host 0's bridge reads every host's into ``RUN/straggle-hosts.json``, host 0's judge judges
the whole job and writes the finding, which its bridge publishes in ``strag/found``; the
other hosts' bridges copy it into their own ``RUN/stragglers.json`` (and log it). The store
sees one small value per host and one read of them all per slot: O(hosts), not O(ranks).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ..core.records import Heartbeat, Registration
from ..hangs.straggler import (
    Enqueued,
    Profile,
    Straggler,
    changes,
    find,
    finding_from_json,
    finding_json,
    host_from_json,
    host_json,
    lateness,
    profile_of,
    row_from_text,
)
from ..hangs.waits import slot_beats
from ..proc import identity
from ..rundir.rundir import HEARTBEATS, STRAGGLE_FILE, STRAGGLE_HOSTS_FILE, STRAGGLERS_FILE, RunDir, rank_file
from .store_protocol import Seal, StraggleExchange

logger = logging.getLogger("peerwatch")

HOSTS_FRESH_SLOTS = 3  # straggle-hosts.json older than this many slots: host 0's bridge stopped


class StragglerWatch:
    def __init__(self, run_dir: RunDir, me: Registration, interval_s: float, spans_hosts: bool) -> None:
        self._run_dir = run_dir
        self._me = me
        self._slot_beats = slot_beats(interval_s)
        self._slot_s = interval_s * self._slot_beats
        self._spans_hosts = spans_hosts
        self._beats = 0
        self._found: Optional[Tuple[Straggler, ...]] = None  # None: not read from stragglers.json yet

    def tick(self, own: Optional[Heartbeat], peers: Mapping[int, Registration]) -> None:
        """A heartbeat of the judging rank: once a slot, gather and judge. ``own``: this
        rank's heartbeat as published; ``peers``: the live local peers' registrations."""
        self._beats += 1
        if self._beats % self._slot_beats:
            return
        host = identity.hostname()
        profiles = self._local_profiles(own, peers, host)
        if self._spans_hosts:
            self._run_dir.write_or_log(STRAGGLE_FILE, host_json(host, profiles))  # not written: the next slot
            remote = self._remote()
            if remote is None:
                return  # not host 0 (its bridge brings the finding), or its bridge is not up yet
            profiles = {**remote, **profiles}
        self.judge(profiles, time.time_ns())

    def judge(self, profiles: Mapping[int, Profile], now_ns: int) -> Tuple[Straggler, ...]:
        """Judge, and write and log the finding if it changed."""
        before = self._previous()
        found = find(profiles, {s.rank: s.since_ns for s in before}, now_ns)
        if [(s.rank, s.late_ms, s.share) for s in found] != [(s.rank, s.late_ms, s.share) for s in before]:
            self._run_dir.write_or_log(STRAGGLERS_FILE, finding_json(found, now_ns))  # not written: the next slot
        log_changes(before, found)
        self._found = found
        return found

    def _previous(self) -> Tuple[Straggler, ...]:
        if self._found is None:  # a judge taking over: what was found before it was already logged
            self._found = read_finding(self._run_dir) or ()
        return self._found

    def _local_profiles(self, own: Optional[Heartbeat], peers: Mapping[int, Registration],
                        host: str) -> Dict[int, Profile]:
        beats = [own] if own is not None else []
        for rank, reg in peers.items():
            beat = self._run_dir.read(HEARTBEATS, rank_file("rank", rank), Heartbeat)
            if beat is not None and beat.pid == reg.pid:
                beats.append(beat)
        out = {}
        for beat in beats:
            profile = profile_of(beat.waits, host)
            if profile is not None:
                out[beat.rank] = profile
        # The enqueue measure: compared between this host's ranks only (one clock).
        for rank, (late, numbers, late_ms) in lateness({b.rank: _rows(b) for b in beats}).items():
            out[rank] = dataclasses.replace(out.get(rank) or Profile((), 0, host), late=late, late_numbers=numbers,
                                            late_ms=late_ms)
        return out

    def _remote(self) -> Optional[Dict[int, Profile]]:
        """The other hosts' profiles (host 0's bridge wrote them); None where this host does
        not judge the job (the file is not there, or stale)."""
        path = self._run_dir.join(STRAGGLE_HOSTS_FILE)
        if not self._run_dir.recent(STRAGGLE_HOSTS_FILE, HOSTS_FRESH_SLOTS * self._slot_s * 1e9):
            return None
        data = self._run_dir.read_bytes("", STRAGGLE_HOSTS_FILE, limit=64 * 1024 * 1024)
        out: Dict[int, Profile] = {}
        try:
            for text in json.loads(data.decode("utf-8"))["hosts"] if data else []:
                out.update(host_from_json(str(text).encode()))
        except (UnicodeDecodeError, ValueError, TypeError, KeyError):
            self._run_dir.warn_once(path, "is not a list of other hosts' waits; ignored")
            return None
        return out


class StraggleRelay:
    """The store bridge's share (its beat thread owns it): once a slot, publish this host's
    profiles (``RUN/straggle.json``, fresh) in ``strag/<i>``; on host 0, hand the others'
    to its judge (``RUN/straggle-hosts.json``) and publish its finding in ``strag/found``;
    on the other hosts, copy that finding into ``RUN/stragglers.json`` and log it."""

    def __init__(self, run_dir: RunDir, interval_s: float) -> None:
        self._run_dir = run_dir
        self._slot_ns = int(interval_s * slot_beats(interval_s) * 1e9)
        self._last_ns: Optional[int] = None
        self._published: Optional[bytes] = None  # host 0: the finding last put in the store
        self._copied: Optional[bytes] = None  # elsewhere: the finding last copied from it

    def plan(self, prefix: str, index: Optional[int], hosts: Iterable[int], seal: Seal) -> Optional[StraggleExchange]:
        """This interval's exchange, if a slot has passed since the last one (None: nothing)."""
        now = time.monotonic_ns()
        if index is None or (self._last_ns is not None and now - self._last_ns < self._slot_ns):
            return None
        self._last_ns = now
        fresh = self._run_dir.recent(STRAGGLE_FILE, HOSTS_FRESH_SLOTS * self._slot_ns)
        mine = self._run_dir.read_bytes("", STRAGGLE_FILE) if fresh else None
        if index != 0:
            return StraggleExchange(prefix, index, mine, [], None, True, seal)
        found = self._run_dir.read_bytes("", STRAGGLERS_FILE)
        return StraggleExchange(prefix, index, mine, sorted(j for j in hosts if j != 0),
                                found if found != self._published else None, False, seal)

    def take(self, x: StraggleExchange, profiles: Mapping[int, bytes], found: Optional[bytes]) -> None:
        """What the exchange read: hand it to the judges (host 0) or copy the finding."""
        if x.index == 0:
            if x.found is not None:
                self._published = x.found
            body = {"hosts": [v.decode("utf-8", "replace") for _, v in sorted(profiles.items())]}
            self._run_dir.write_or_log(STRAGGLE_HOSTS_FILE, json.dumps(body).encode())
            return
        if found is None or found == self._copied:
            return
        after = finding_from_json(found)
        if after is None:
            return
        before = read_finding(self._run_dir) if self._copied is None else finding_from_json(self._copied)
        if self._run_dir.write_or_log(STRAGGLERS_FILE, found):
            log_changes(before or (), after)
            self._copied = found


def _rows(beat: Heartbeat) -> List[Enqueued]:
    return [row for row in map(row_from_text, beat.enqueued) if row is not None]


def read_finding(run_dir: RunDir) -> Optional[Tuple[Straggler, ...]]:
    """The stragglers named in RUN/stragglers.json; None if there is no finding."""
    data = run_dir.read_bytes("", STRAGGLERS_FILE)
    return finding_from_json(data) if data else None


def log_changes(before: Sequence[Straggler], after: Sequence[Straggler]) -> None:
    """One line when a straggler appears, one when it clears."""
    named, cleared = changes(before, after)
    for s in named:
        logger.warning(
            "peerwatch: straggler: rank %d%s enters its collectives %d ms after its peers (%.0f%% of each step): the "
            "whole job runs at its pace (docs/stragglers.md)", s.rank, _on(s.host), s.late_ms, 100 * s.share,
        )
    for s in cleared:
        logger.warning("peerwatch: rank %d%s is no longer a straggler (named %.0fs ago)", s.rank, _on(s.host),
                       max(0.0, (time.time_ns() - s.since_ns) / 1e9))


def _on(host: str) -> str:
    return f" (on {host})" if host else ""


__all__ = ["StraggleRelay", "StragglerWatch", "log_changes",
           "read_finding"]
