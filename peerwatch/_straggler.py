"""The straggler: a rank that is alive and moving, but that its peers wait for at every
collective. Pure (no I/O, no clock: times are passed in).

The measure needs no clock shared between hosts. In a synchronous job every rank's step
takes the same time; the straggler computes longest, so it waits least inside the
collectives, and its peers wait about (its compute - theirs) more. Each rank measures, on
its own clock, the share of its time its main thread waits inside torch.distributed
(sampled, :mod:`peerwatch._waits`), slot by slot (``SLOT_BEATS`` heartbeats each), with
the collectives it entered in the slot. From the last ``SLOTS`` slots of every rank:

1. A rank's **gap** in a slot is the median wait share of its peers in the same slot minus
   its own (slots are numbered by the wall clock, so they line up on hosts whose clocks
   are about right; where they are not, the i-th last of each rank is taken, aligned
   within a slot or two, which the median below absorbs),
   and at most twice the job's median minus its own (a rank is late only if it is below
   most ranks: the two ranks one fast rank waits for are not stragglers).
   Its gap is the median of its slots' gaps: a one-off phase (a checkpoint on rank 0, an
   evaluation) fills a slot or two and does not move a median.
2. A rank is **named** when its gap is at least ``APPEAR_SHARE`` and at least ``MOST`` of
   its slots have a gap of ``CLEAR_SHARE`` or more, over at least ``MIN_SLOTS`` slots of
   every rank (30 s at the default heartbeat): the job runs at least 10 % slower than it
   would without it, for most of the last minute, not in one phase.
3. A named rank **clears** when its gap falls under ``CLEAR_SHARE`` (hysteresis: a gap
   near the threshold does not make the finding flicker).
4. ``share`` is the gap (the share of every step its peers spend waiting for it);
   ``late_ms`` is the gap times the job's period (the median, over the ranks, of the time
   per collective entered, or per step when there is one collective a step): how much
   later than its peers it typically enters a collective.

The sampling noise of a slot (100 samples at 20 Hz in 5 s) is about 0.05 of a share; a
median over 6 to 12 slots brings it to ~0.02, so 0.10 is five of those: balanced ranks are
not named, and a rank that holds the job back by a tenth is.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

SLOT_BEATS = 5  # heartbeats per slot (5 s at the default heartbeat)
SLOTS = 12  # slots a rank publishes: the last minute at the default heartbeat
MIN_SLOTS = 6  # slots every rank must have before anyone is named
APPEAR_SHARE = 0.10  # a gap this large (a tenth of the job's time) names a rank ...
MOST = 0.75  # ... when this share of its slots has a gap of CLEAR_SHARE or more
CLEAR_SHARE = 0.05  # a named rank stays named while its gap is this large
EXACT_PEERS = 64  # up to this many ranks, each one's peers' median leaves it out
MIN_SAMPLES = 10  # a slot with fewer samples says nothing (the sampler was not running)
MAX_HOST_BYTES = 64 * 1024  # a larger host summary in the store is not ours
SUMMARY_VERSION = 1

# (ms, samples, samples waiting in a collective, collectives entered, its number: the wall
# clock's time over the slot's length, the same on every host whose clock is about right)
Slot = Tuple[int, int, int, int, int]


@dataclasses.dataclass(frozen=True)
class Profile:
    """One rank's waits, as the rule needs them (and as a host publishes them)."""

    shares: Tuple[int, ...]  # per slot, oldest first: permille of its time waiting in a collective
    period_ms: int  # time per collective entered over those slots (0: none entered)
    host: str = ""
    numbers: Tuple[int, ...] = ()  # each slot's number (as shares); () where unknown


@dataclasses.dataclass(frozen=True)
class Straggler:
    rank: int
    host: str
    late_ms: int  # how much later than its peers it typically enters a collective
    share: float  # late_ms as a share of the period
    since_ns: int  # when it was first named (time.time_ns())

    def as_json(self) -> Dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "late_ms": self.late_ms, "share": self.share,
                "since_ns": self.since_ns}


def profile_of(slots: Sequence[Slot], host: str = "") -> Optional[Profile]:
    """A rank's profile from its heartbeat's slots; None while it has none that count."""
    kept = [s for s in slots if len(s) == 5 and s[1] >= MIN_SAMPLES and s[0] > 0][-SLOTS:]
    if not kept:
        return None
    entered = sum(s[3] for s in kept)
    period = sum(s[0] for s in kept) // entered if entered > 0 else 0
    return Profile(tuple(min(1000, 1000 * s[2] // s[1]) for s in kept), period, host, tuple(s[4] for s in kept))


def aligned(profiles: Mapping[int, Profile]) -> Dict[int, Tuple[int, ...]]:
    """Every rank's shares over the same slots, oldest first: the last slots that every rank
    has by number (clocks about right), else each one's last ones (clocks apart: aligned
    within a slot or two, which a median absorbs)."""
    common = set.intersection(*(set(p.numbers) for p in profiles.values()))
    if len(common) >= MIN_SLOTS and all(len(p.numbers) == len(p.shares) for p in profiles.values()):
        wanted = sorted(common)[-SLOTS:]
        return {r: tuple(dict(zip(p.numbers, p.shares))[n] for n in wanted) for r, p in profiles.items()}
    k = min(SLOTS, min(len(p.shares) for p in profiles.values()))
    return {r: p.shares[len(p.shares) - k:] for r, p in profiles.items()}


def gaps(shares: Mapping[int, Sequence[int]]) -> Dict[int, List[float]]:
    """Each rank's gap (share) in each slot, from its shares of the same slots (rule 1)."""
    last = {r: [v / 1000 for v in s] for r, s in shares.items()}
    k = min(len(s) for s in last.values())
    everyone = [statistics.median([s[i] for s in last.values()]) for i in range(k)]
    if len(last) > EXACT_PEERS:  # one rank moves the median of hundreds by nothing: O(N), not O(N^2)
        return {r: [everyone[i] - mine[i] for i in range(k)] for r, mine in last.items()}
    # Below its peers, and below the job's median too: of three ranks, the two that one
    # faster rank waits for are not stragglers (their peers' median is half theirs, half
    # the fast one's). Twice the gap to everyone's median is the gap to the other rank of two.
    return {
        r: [min(statistics.median([s[i] for p, s in last.items() if p != r]) - mine[i],
                2 * (everyone[i] - mine[i])) for i in range(k)]
        for r, mine in last.items()
    }


def find(profiles: Mapping[int, Profile], named: Mapping[int, int], now_ns: int) -> Tuple[Straggler, ...]:
    """The stragglers among ``profiles`` (every rank of the job that has one), ranks first
    to last. ``named``: the ranks named at the last look, and since when (rule 3)."""
    if len(profiles) < 2:
        return ()
    shares = aligned(profiles)
    k = min(len(s) for s in shares.values())
    if k < MIN_SLOTS:
        return ()
    periods = [p.period_ms for p in profiles.values() if p.period_ms > 0]
    period_ms = statistics.median(periods) if periods else 0
    found = []
    for r, g in sorted(gaps(shares).items()):
        gap = statistics.median(g)
        most = sum(1 for x in g if x >= CLEAR_SHARE) >= MOST * k
        if (r in named and gap >= CLEAR_SHARE) or (gap >= APPEAR_SHARE and most):
            found.append(Straggler(r, profiles[r].host, round(gap * period_ms), round(gap, 3), named.get(r, now_ns)))
    return tuple(found)


def changes(before: Sequence[Straggler], after: Sequence[Straggler]) -> Tuple[List[Straggler], List[Straggler]]:
    """The ranks newly named, and those no longer named (each logged once)."""
    old, new = {s.rank for s in before}, {s.rank for s in after}
    return [s for s in after if s.rank not in old], [s for s in before if s.rank not in new]


# -- one host's profiles, as the store carries them (per host, not per rank) ---------------

def host_json(host: str, profiles: Mapping[int, Profile]) -> bytes:
    body = {"v": SUMMARY_VERSION, "host": host,
            "ranks": [[r, p.period_ms, list(p.shares), list(p.numbers)] for r, p in sorted(profiles.items())]}
    return json.dumps(body, separators=(",", ":")).encode()


def host_from_json(data: bytes) -> Dict[int, Profile]:
    """A host's profiles; {} for anything else (another version, garbage, too big)."""
    if len(data) > MAX_HOST_BYTES:
        return {}
    try:
        body = json.loads(data.decode("utf-8"))
        if not isinstance(body, dict) or body.get("v") != SUMMARY_VERSION:
            return {}
        host = str(body["host"])[:255]
        out = {}
        for r, period, shares, numbers in body["ranks"]:
            values = tuple(_int(v) for v in shares)[-SLOTS:]
            numbered = tuple(_int(n) for n in numbers)[-SLOTS:]
            if _int(r) >= 0 and all(0 <= v <= 1000 for v in values) and len(numbered) in (0, len(values)):
                out[_int(r)] = Profile(values, max(0, _int(period)), host, numbered)
        return out
    except (UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return {}


# -- the finding (RUN/stragglers.json, and the store's copy) -------------------------------

def finding_json(found: Sequence[Straggler], time_ns: int) -> bytes:
    return json.dumps({"v": SUMMARY_VERSION, "time_ns": time_ns,
                       "stragglers": [s.as_json() for s in found]}, separators=(",", ":")).encode()


def finding_from_json(data: bytes) -> Optional[Tuple[Straggler, ...]]:
    """The stragglers of a finding; None if it is not one."""
    if len(data) > MAX_HOST_BYTES:
        return None
    try:
        body = json.loads(data.decode("utf-8"))
        if not isinstance(body, dict) or body.get("v") != SUMMARY_VERSION:
            return None
        return tuple(
            Straggler(_int(s["rank"]), str(s["host"])[:255], _int(s["late_ms"]), float(s["share"]), _int(s["since_ns"]))
            for s in body["stragglers"]
        )
    except (UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return None


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError("not an int")
    return v


__all__ = [
    "APPEAR_SHARE", "CLEAR_SHARE", "MIN_SLOTS", "MOST", "SLOTS", "SLOT_BEATS", "Profile", "Slot", "Straggler", "changes",
    "aligned", "find", "finding_from_json", "finding_json", "gaps", "host_from_json", "host_json", "profile_of",
]
