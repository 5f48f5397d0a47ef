"""The straggler: a rank that is alive and moving, but that its peers wait for at every
collective. Pure (no I/O, no clock: times are passed in).

The measure needs no clock shared between hosts. In a synchronous job every rank's step
takes the same time; the straggler computes longest, so it waits least inside the
collectives, and its peers wait about (its compute - theirs) more. Each rank measures, on
its own clock, the share of its time its main thread waits inside torch.distributed
(sampled, :mod:`peerwatch.hangs.waits`), slot by slot (``SLOT_BEATS`` heartbeats each), with the
collectives it entered in the slot. The rules over the last ``SLOTS`` slots of every rank
(a rank's gap, naming a straggler, clearing a straggler, the straggler's figures) are those
of docs/how-it-works.md, "The straggler". Slots are numbered by the wall clock, so they line
up on hosts whose clocks are about right; where they are not, the i-th last of each rank is
taken, aligned within a slot or two, which the median over the slots absorbs.

The sampling noise of a slot (100 samples at 20 Hz in 5 s) is about 0.05 of a share; a
median over 6 to 12 slots brings it to ~0.02, so 0.10 is five of those: balanced ranks are
not named, and a rank that holds the job back by a tenth is.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..core.records import json_int as _int

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
    # The enqueue measure (:func:`lateness`, judged on the rank's host): per slot, permille of
    # the slot its local peers waited for it (already relative: a gap), the slots' numbers,
    # and how late it entered its collectives (ms, median over those slots). () where unknown.
    late: Tuple[int, ...] = ()
    late_numbers: Tuple[int, ...] = ()
    late_ms: int = 0


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
    """Each rank's gap (share) in each slot, from its shares of the same slots (rule: a rank's gap)."""
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
    to last. ``named``: the ranks named at the last look, and since when
    (rule: clearing a straggler).

    Two measures, each judged by the same rules
    (rules: naming a straggler, clearing a straggler): the waits' gaps (rule: a rank's gap;
    the ranks that have shares) and the enqueue gaps (:func:`lateness`, the ranks that have
    them). A rank is named when either names it, and stays named while either keeps it above
    ``CLEAR_SHARE``; its ``late_ms`` and ``share`` are the enqueue measure's where that one
    names it (it measures the lateness itself), else the waits' (its ``late_ms`` the enqueue
    measure's where that one sees it late on fewer slots than it names on:
    :func:`_measured`)."""
    found = []
    by_waits = _by_waits({r: p for r, p in profiles.items() if p.shares}, named)
    by_late = _by_lateness(profiles, named)
    for r in sorted(set(by_waits) | set(by_late)):
        late_ms, share = by_late.get(r) or _measured(profiles[r], by_waits[r], r in named)
        found.append(Straggler(r, profiles[r].host, late_ms, share, named.get(r, now_ns)))
    return tuple(found)


def _by_waits(profiles: Mapping[int, Profile], named: Mapping[int, int]) -> Dict[int, Tuple[int, float]]:
    """The waits' measure: rank -> (late_ms, share).

    Rules: a rank's gap, naming a straggler, clearing a straggler, the straggler's figures.
    """
    if len(profiles) < 2:
        return {}
    shares = aligned(profiles)
    k = min(len(s) for s in shares.values())
    if k < MIN_SLOTS:
        return {}
    periods = [p.period_ms for p in profiles.values() if p.period_ms > 0]
    period_ms = statistics.median(periods) if periods else 0
    out = {}
    for r, g in sorted(gaps(shares).items()):
        if _named(g, r in named):
            gap = statistics.median(g)
            out[r] = (round(gap * period_ms), round(gap, 3))
    return out


def _measured(p: Profile, waits: Tuple[int, float], before: bool) -> Tuple[int, float]:
    """The figures of a rank the waits name: its ``late_ms`` is the enqueue measure's where
    that one already sees it late on the slots it has, too few to name it on its own (it
    names up to two slots after the waits). The waits' is derived per collective: in a job
    of two collectives a step, half the lateness the enqueue times measure, and the one
    line logged when the rank is named would say half what the finding says a slot later."""
    g = [v / 1000 for v in p.late[-SLOTS:]]
    if g and p.late_ms > 0 and _named(g, before):
        return p.late_ms, waits[1]
    return waits


def _named(g: Sequence[float], before: bool) -> bool:
    """Named or not, from one rank's gaps (rules: naming a straggler, clearing a straggler)."""
    gap = statistics.median(g)
    most = sum(1 for x in g if x >= CLEAR_SHARE) >= MOST * len(g)
    return (before and gap >= CLEAR_SHARE) or (gap >= APPEAR_SHARE and most)


def changes(before: Sequence[Straggler], after: Sequence[Straggler]) -> Tuple[List[Straggler], List[Straggler]]:
    """The ranks newly named, and those no longer named (each logged once)."""
    old, new = {s.rank for s in before}, {s.rank for s in after}
    return [s for s in after if s.rank not in old], [s for s in before if s.rank not in new]


# -- the enqueue measure: when each rank entered each collective (waits inside C++) -------
#
# The waits above are seen only from Python. DDP's gradient all-reduces are launched and
# waited for inside backward(), in C++: the main thread shows no wait there. torch's flight
# recorder has, for every collective, its sequence number (per process group) and when this
# rank enqueued it (``time_created_ns``, the host's wall clock). In a synchronous job the
# rank that enqueues last is the one the others wait for, and by how much: the measure
# itself, with no model of where the waits happen. Compared only between ranks of one host
# (one clock): across hosts each host judges its own ranks, and the host's summary carries
# the result (a rank late against its own host's peers), never a time.

ENQ_KEYS = 24  # per slot, the last collectives a rank publishes (a contiguous run of one group)
ENQ_MIN_KEYS = 8  # a slot with fewer collectives that every rank published says nothing
ENQ_UNIT_NS = 100_000  # enqueue times are published in tenths of a millisecond
# (slot number, group (pg_id), first seq, its enqueue time (ENQ_UNIT_NS), then each next
# seq's time after it (ENQ_UNIT_NS)): one slot of one rank's published enqueue times.
Enqueued = Tuple[int, ...]


def enqueued_row(number: int, group: int, entries: Sequence[Tuple[int, int]]) -> Optional[Enqueued]:
    """One slot's row from its (seq, time_ns) entries of one group: the longest contiguous
    run of sequence numbers that ends at the last one, at most ``ENQ_KEYS`` long."""
    if not entries:
        return None
    run = sorted(entries)[-ENQ_KEYS:]
    start = len(run) - 1
    while start > 0 and run[start - 1][0] == run[start][0] - 1:
        start -= 1
    run = run[start:]
    base = run[0][1] // ENQ_UNIT_NS
    return (number, group, run[0][0], base, *(t // ENQ_UNIT_NS - base for _, t in run[1:]))


def row_text(row: Enqueued) -> str:
    """A row as the heartbeat carries it: its numbers, comma-separated. A heartbeat reader
    checks one string where it would check 27 numbers one by one: as numbers, twelve rows
    made a heartbeat 3.4 times longer to read (219 -> 743 us, on a loaded machine); as
    strings, no longer than without them (48 us both, quiet)."""
    return ",".join(map(str, row))


def row_from_text(text: str) -> Optional[Enqueued]:
    """A row from the heartbeat; None for anything else."""
    try:
        row = tuple(int(v) for v in text.split(",", ENQ_KEYS + 4))
    except ValueError:
        return None
    return row if 4 <= len(row) <= ENQ_KEYS + 3 else None


def _times(rows: Sequence[Enqueued]) -> Dict[Tuple[int, int], Tuple[int, int]]:
    """(group, seq) -> (time in ENQ_UNIT_NS, slot number), from one rank's rows."""
    out: Dict[Tuple[int, int], Tuple[int, int]] = {}
    for row in rows:
        if len(row) < 4:
            continue
        number, group, first, base = row[:4]
        out[(group, first)] = (base, number)
        for i, d in enumerate(row[4:], 1):
            out[(group, first + i)] = (base + d, number)
    return out


def slot_lateness(times: Mapping[int, Sequence[int]]) -> Optional[Dict[int, Tuple[float, float]]]:
    """Each rank's share of the slot its peers waited for it, and how late it entered its
    collectives (in the times' unit), from every rank's enqueue times of the same
    collectives (``times[rank][i]``: collective i). None where the collectives span fewer
    than two steps (no share can be told from them).

    1. A rank's **lateness** in a collective is its enqueue time minus its peers' median
       (at most twice its time minus everyone's median: of three ranks, the two that one
       fast rank waits for are not late; as in the rule "a rank's gap").
    2. The collectives, in the order of everyone's median time, fall into **bursts** (a
       step's): a gap of at least half the largest ends one (a slot with one outlier, a
       checkpoint, has one burst before it and one after: it says nothing). A burst is waited for as long as its largest lateness: DDP's
       buckets of a step are entered late together and waited for once, at the end of
       backward; where each collective blocks, its waits add up, and the largest is a
       lower bound. Never more than the peers waited.
    3. Its **share** is the sum over the bursts over the time they cover (the span from the
       first collective to the last, and one burst's period more: b bursts span b - 1
       periods); its lateness in time is the median over its late bursts."""
    ranks = sorted(times)
    n = min((len(times[r]) for r in ranks), default=0)
    if len(ranks) < 2 or n < 2:
        return None
    everyone = [statistics.median([times[r][i] for r in ranks]) for i in range(n)]
    order = sorted(range(n), key=everyone.__getitem__)
    between = [everyone[order[i + 1]] - everyone[order[i]] for i in range(n - 1)]
    big = max(between)
    if big <= 0:
        return None
    bursts, current = [], [order[0]]
    for i, gap in zip(order[1:], between):
        if gap >= big / 2:
            bursts.append(current)
            current = []
        current.append(i)
    bursts.append(current)
    if len(bursts) < 3:  # two steps' ends at least
        return None
    span = (everyone[order[-1]] - everyone[order[0]]) * len(bursts) / (len(bursts) - 1)
    out = {}
    for r in ranks:
        late = []
        for i in range(n):
            peers = statistics.median([times[p][i] for p in ranks if p != r])
            late.append(max(0, min(times[r][i] - peers, 2 * (times[r][i] - everyone[i]))))
        waited = [max(late[i] for i in burst) for burst in bursts]
        positive = [w for w in waited if w > 0]
        out[r] = (sum(waited) / span, float(statistics.median(positive)) if positive else 0.0)
    return out


def lateness(rows: Mapping[int, Sequence[Enqueued]]) -> Dict[int, Tuple[Tuple[int, ...], Tuple[int, ...], int]]:
    """From one host's ranks' published rows: rank -> (its gap per slot in permille, those
    slots' numbers, its lateness in ms: the median over them). Only the collectives every
    rank published are compared, each in the slot the earliest rank put it in; a rank's
    gap in a slot is its share minus its peers' median share (balanced ranks' jitter
    gives each a small share; only the rank above its peers is late)."""
    times = {r: _times(rs) for r, rs in rows.items()}
    times = {r: t for r, t in times.items() if t}
    if len(times) < 2:
        return {}
    common = set.intersection(*(set(t) for t in times.values()))
    by_slot: Dict[int, List[Tuple[int, int]]] = {}
    for key in common:
        by_slot.setdefault(min(t[key][1] for t in times.values()), []).append(key)
    found: Dict[int, Tuple[List[int], List[int], List[float]]] = {r: ([], [], []) for r in times}
    for number in sorted(by_slot)[-SLOTS:]:
        keys = sorted(by_slot[number])
        if len(keys) < ENQ_MIN_KEYS:
            continue
        slot = slot_lateness({r: [t[k][0] for k in keys] for r, t in times.items()})
        if slot is None:
            continue
        for r, (share, late) in slot.items():
            peers = statistics.median([s for p, (s, _) in slot.items() if p != r])
            found[r][0].append(max(0, min(1000, round(1000 * (share - peers)))))
            found[r][1].append(number)
            found[r][2].append(late * ENQ_UNIT_NS / 1e6)
    return {r: (tuple(g), tuple(nums), round(statistics.median(ms)) if ms else 0)
            for r, (g, nums, ms) in found.items() if g}


def _by_lateness(profiles: Mapping[int, Profile], named: Mapping[int, int]) -> Dict[int, Tuple[int, float]]:
    """The enqueue measure: rank -> (late_ms, share) (rules: naming a straggler, clearing a straggler)."""
    out = {}
    for r, p in sorted(profiles.items()):
        g = [v / 1000 for v in p.late[-SLOTS:]]
        if len(g) >= MIN_SLOTS and _named(g, r in named):
            out[r] = (p.late_ms, round(statistics.median(g), 3))
    return out


# -- one host's profiles, as the store carries them (per host, not per rank) ---------------

def host_json(host: str, profiles: Mapping[int, Profile]) -> bytes:
    body = {"v": SUMMARY_VERSION, "host": host,
            "ranks": [[r, p.period_ms, list(p.shares), list(p.numbers)] for r, p in sorted(profiles.items()) if p.shares]}
    late = [[r, p.late_ms, list(p.late), list(p.late_numbers)] for r, p in sorted(profiles.items()) if p.late]
    if late:  # a key of its own: a reader that does not know it ignores it
        body["late"] = late
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
        for r, late_ms, late, numbers in body.get("late") or ():
            values, numbered = tuple(_int(v) for v in late)[-SLOTS:], tuple(_int(n) for n in numbers)[-SLOTS:]
            if _int(r) >= 0 and all(0 <= v <= 1000 for v in values) and len(numbered) == len(values):
                out[_int(r)] = dataclasses.replace(out.get(_int(r)) or Profile((), 0, host), late=values,
                                                   late_numbers=numbered, late_ms=max(0, _int(late_ms)))
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


__all__ = [
    "APPEAR_SHARE", "CLEAR_SHARE", "ENQ_KEYS", "ENQ_MIN_KEYS", "ENQ_UNIT_NS", "MIN_SLOTS", "MOST", "SLOTS", "SLOT_BEATS",
    "Enqueued", "Profile", "Slot", "Straggler", "changes", "aligned", "enqueued_row", "find", "finding_from_json", "finding_json", "gaps", "host_from_json", "host_json", "lateness", "profile_of",
    "row_from_text", "row_text", "slot_lateness",
]
