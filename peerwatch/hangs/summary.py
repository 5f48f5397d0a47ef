"""A host's stall, as the other hosts' hang judges need it: built, read and turned back
into ranks. Pure (no I/O, no clock: times are passed in).

A hang across hosts is seen by no host alone: host B's ranks all stopped at collective #30
agree with each other, host A's all wait in #31 and agree too. So each host says, while its
ranks stand still, what the diagnosis (:mod:`peerwatch.hangs.diagnose`) needs of them, per host
and not per rank:

- how long ago the host's ranks last moved, as an AGE (ms), never a timestamp: the hosts'
  clocks differ. The reader turns it into its own ``CLOCK_MONOTONIC`` once per stall (the
  ``stall`` token names one), so the job's last move does not jitter from one look to the
  next (a jitter would read as "it moved again");
- the ranks waiting inside a collective (where a laggard is not), grouped by what they
  published (their counters and last collectives entered): one entry for a host whose
  ranks all wait in the same all_reduce, whatever its size;
- every other rank in full (its counters, last collectives, state, where it is, its signs
  of work: :class:`peerwatch.proc.activity.Activity`): the laggard candidates, at most
  ``MAX_DETAILED``;
- whether a rank is inside ``paused()`` (rule: paused or uncounted, across hosts too).

A summary is a few hundred bytes for a host whose ranks wait, plus ~250 bytes per rank
that does not. The judges of the reading host feed the ranks of :func:`remote_ranks` into
the diagnosis beside their own, each with its host's name, so a diagnosis on any host
names the laggards and their host.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..core.records import Activity
from .diagnose import FROZEN_STATES, RankState

SUMMARY_VERSION = 1
# A host says it stands still from this share of the warning threshold on: a slow step
# never reaches the store, and the other hosts have it well before the threshold.
PUBLISH_FRACTION = 0.5
# While it stands still, a host's summary is published (and the others' read) at most this
# often, as a share of the threshold (and at most once a heartbeat): the judges need it
# once, before the threshold, and its signs of work as they grow.
REFRESH_FRACTION = 1 / 8
MAX_DETAILED = 32  # ranks of one host described in full (the others waiting in a collective are grouped)
MAX_SUMMARY_BYTES = 64 * 1024  # a larger value in the store is not a summary of ours


@dataclasses.dataclass(frozen=True)
class Summary:
    """One host's stall."""

    host: str
    stall: str  # names this stall (the host's last move, on its own clock): a new token, a new stall
    age_ms: int  # how long ago its ranks last moved (counters or beat()) when it was made
    threshold_ms: int  # its judges' warning threshold (sets how often the summary is refreshed)
    waiting: Tuple[Tuple[Tuple[int, ...], RankState], ...] = ()  # ranks inside a collective, grouped
    detailed: Tuple[Tuple[int, RankState], ...] = ()  # the others, in full

    def to_json(self) -> bytes:
        body = {
            "v": SUMMARY_VERSION, "host": self.host, "stall": self.stall, "age_ms": self.age_ms,
            "threshold_ms": self.threshold_ms,
            "waiting": [[list(ranks), _state_out(s, full=False)] for ranks, s in self.waiting],
            "ranks": [[r, _state_out(s, full=True)] for r, s in self.detailed],
        }
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Optional[Summary]:
        """A summary; None for anything else (another version, garbage, too big)."""
        if len(data) > MAX_SUMMARY_BYTES:
            return None
        try:
            body = json.loads(data.decode("utf-8"))
            if not isinstance(body, dict) or body.get("v") != SUMMARY_VERSION:
                return None
            waiting = tuple(
                (tuple(_int(r) for r in ranks), _state_in(s)) for ranks, s in body.get("waiting", ())
            )
            detailed = tuple((_int(r), _state_in(s)) for r, s in body.get("ranks", ()))
            return cls(str(body["host"]), str(body["stall"]), max(0, _int(body["age_ms"])),
                       max(0, _int(body.get("threshold_ms", 0))), waiting, detailed)
        except (UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
            return None

    def ranks(self) -> List[int]:
        return sorted([r for ranks, _ in self.waiting for r in ranks] + [r for r, _ in self.detailed])


def summarize(
    ranks: Mapping[int, RankState], host: str, now_mono_ns: int, threshold_ns: int, awake_since_ns: int = 0,
) -> Optional[Summary]:
    """This host's summary, if its ranks have stood still for ``PUBLISH_FRACTION`` of the
    threshold (None otherwise, or when no rank counts collectives). Their age counts from
    ``awake_since_ns`` at the earliest: the judge's last resume (peerwatch.core.awake)."""
    if not any(s.collectives for s in ranks.values()):
        return None
    last = max((t for s in ranks.values() for t in (s.moved_mono_ns, s.beat_mono_ns) if t is not None), default=None)
    if last is None:
        return None
    age_ns = now_mono_ns - max(last, awake_since_ns)
    if age_ns < PUBLISH_FRACTION * threshold_ns:
        return None
    groups: Dict[Tuple[Any, ...], List[int]] = {}
    detailed: List[Tuple[int, RankState]] = []
    for rank, s in sorted(ranks.items()):
        if _waiting(s):
            groups.setdefault((s.collectives, s.entered), []).append(rank)
        elif len(detailed) < MAX_DETAILED:
            detailed.append((rank, _bare(s)))
    waiting = tuple(
        (tuple(rs), RankState(collectives=c, entered=e, in_collective=True)) for (c, e), rs in groups.items()
    )
    return Summary(host, str(last), age_ns // 1_000_000, threshold_ns // 1_000_000, waiting,
                   tuple(detailed))


def remote_ranks(summary: Summary, moved_mono_ns: int) -> Dict[int, RankState]:
    """The host's ranks as the diagnosis takes them: their last move ``moved_mono_ns`` (the
    summary's age, on the reader's clock), their host named."""
    out: Dict[int, RankState] = {}
    for ranks, s in summary.waiting:
        for r in ranks:
            out[r] = dataclasses.replace(s, moved_mono_ns=moved_mono_ns, host=summary.host)
    for r, s in summary.detailed:
        out[r] = dataclasses.replace(s, moved_mono_ns=moved_mono_ns, host=summary.host)
    return out


def refresh_ns(threshold_ms: int, interval_ns: int) -> int:
    """How often a standing-still host's summary is published, and the others' read."""
    return max(interval_ns, int(threshold_ms * 1e6 * REFRESH_FRACTION))


def _waiting(s: RankState) -> bool:
    """Inside a collective, waiting for the others, and nothing else to say of it."""
    return s.in_collective and not s.paused and not s.watcher_silent and s.state not in FROZEN_STATES


def _bare(s: RankState) -> RankState:
    return dataclasses.replace(s, moved_mono_ns=None, beat_mono_ns=None, host="")


def _state_out(s: RankState, full: bool) -> Dict[str, Any]:
    out: Dict[str, Any] = {"c": [list(c) for c in s.collectives], "e": [list(e) for e in s.entered]}
    if full:
        out.update(p=s.paused, s=s.state, w=s.watcher_silent, i=s.in_collective, at=s.where,
                   a=list(s.activity.as_tuple()) if s.activity is not None else [])
    return out


def _state_in(d: Any) -> RankState:
    if not isinstance(d, dict):
        raise TypeError("not a rank")
    collectives = tuple((str(g), _int(e), _int(c)) for g, e, c in d.get("c", ()))
    entered = tuple((str(g), _int(q), str(op), str(shape)) for g, q, op, shape in d.get("e", ()))
    if "s" not in d:  # waiting in a collective
        return RankState(collectives=collectives, entered=entered, in_collective=True)
    activity = tuple(_int(v) for v in d.get("a", ()))
    return RankState(
        collectives=collectives, entered=entered, paused=d.get("p") is True, state=str(d.get("s", "?"))[:1] or "?",
        watcher_silent=d.get("w") is True, in_collective=d.get("i") is True, where=str(d.get("at", ""))[:300],
        activity=Activity.of(activity) if activity else None,
    )


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError("not an int")
    return v


__all__ = ["MAX_DETAILED", "PUBLISH_FRACTION", "REFRESH_FRACTION", "Summary", "refresh_ns", "remote_ranks", "summarize"]
