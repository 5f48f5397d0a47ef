"""The diagnosis of a job that stopped moving: pure (no I/O, no clock; times are passed in).

Every rank's watcher publishes torch's collective counters with its heartbeat (per process
group, the sequence number of the last collective it entered), and, once they stop
moving, the op and sizes of its last collectives. From those the judges say, when nothing
has moved for the warning threshold:

1. No diagnosis while any rank is inside ``paused()``, or when no rank publishes counters
   (the ranks never imported torch.distributed: ``beat()`` and ``hang_timeout`` remain).
2. A frozen rank (state T or D) or one whose watcher went silent is a laggard first.
3. In a process group where the ranks' last sequence numbers differ, the ranks at the
   highest one *entered* it and wait; the others never reached it: they are the
   laggards (``hang``, with the group, seq and op).
4. Ranks that entered the same sequence number with another op, other sizes or dtypes:
   ``mismatch``; the laggards are the smaller side (a tie: the side without the lowest rank).
5. Everyone at the same sequence number, agreeing, nobody frozen: nothing to name (all
   ranks are outside collectives: evaluation, checkpointing, data loading on every
   rank), no diagnosis.

The threshold (:class:`Threshold`) is learnt from the job's own intervals between two
movements (any rank's counters or ``beat()``): after ``WARMUP_GAPS`` of them, it is
``FACTOR`` times the longest seen, at least ``FLOOR_S``, and at most ``CAP_FRACTION`` of the
process group's collective timeout (so it comes well before the timeout kills the job).
Before the warm-up it is the cap. Why it does not fire on slow steps, evaluation or
checkpointing: a step is one interval, so slow steps raise the threshold as they come
(a step would have to get five times longer than the longest so far, and over a
minute, at once); a phase without collectives on every rank is rule 5 (nothing to
name); a phase on one rank while the others wait (rank 0 saving a checkpoint at a
barrier) is judged like a hang only if it lasts longer than the threshold, and once it
ends its interval is learnt, so a recurring one fires at most once. ``paused()`` is rule 1.
And a diagnosis only warns, unless ``hang_timeout=auto``.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ._records import HANG, MISMATCH

FACTOR = 5  # as NVIDIA's resiliency extension: 5x the longest interval seen
FLOOR_S = 60.0  # never below a minute (unless the collective timeout is shorter)
CAP_FRACTION = 0.5  # at most half the process group's collective timeout
DEFAULT_CAP_S = 300.0  # when the timeout is not known
WARMUP_GAPS = 10  # intervals seen before the learnt value is trusted
FROZEN_STATES = {"T": "stopped (SIGSTOP)", "t": "stopped by a debugger", "D": "in uninterruptible sleep (I/O)"}


@dataclasses.dataclass(frozen=True)
class RankState:
    """What one live rank last published (its heartbeat), as the judge saw it."""

    collectives: Tuple[Tuple[str, int, int], ...] = ()  # (group, last enqueued seq, last completed)
    entered: Tuple[Tuple[str, int, str, str], ...] = ()  # (group, seq, op, sizes) of its last collectives
    moved_mono_ns: Optional[int] = None  # when its counters last changed
    beat_mono_ns: Optional[int] = None  # its last beat()
    paused: bool = False
    state: str = "?"
    watcher_silent: bool = False
    in_collective: bool = False
    where: str = ""


@dataclasses.dataclass(frozen=True)
class Found:
    """A diagnosis, before it is written (the record is peerwatch._records.Diagnosis)."""

    kind: str
    laggards: Tuple[int, ...]
    entered: Tuple[int, ...]
    since_ns: int
    detail: str
    group: Optional[str] = None
    seq: Optional[int] = None
    op: Optional[str] = None


def last_move(ranks: Mapping[int, RankState]) -> Optional[int]:
    """When the job last moved (any rank's counters or beat), CLOCK_MONOTONIC; None if unknown."""
    times = [t for s in ranks.values() for t in (s.moved_mono_ns, s.beat_mono_ns) if t is not None]
    return max(times, default=None)


def diagnose(ranks: Mapping[int, RankState], now_mono_ns: int, threshold_ns: int) -> Optional[Found]:
    """The diagnosis if nothing has moved for ``threshold_ns``; None otherwise."""
    if threshold_ns <= 0 or not ranks or any(s.paused for s in ranks.values()):
        return None
    counted = {r: s for r, s in ranks.items() if s.collectives}
    last = last_move(ranks)
    if not counted or last is None:
        return None
    since = now_mono_ns - last
    if since < threshold_ns:
        return None
    frozen = sorted(r for r, s in ranks.items() if s.state in FROZEN_STATES or s.watcher_silent)
    mismatch = _mismatch(counted)
    if mismatch is not None:
        return dataclasses.replace(mismatch, since_ns=since)
    stuck = _stuck(counted)
    if stuck is None and not frozen:
        return None
    group, seq, entered, behind = stuck if stuck is not None else (None, None, (), ())
    laggards = tuple(frozen) + tuple(r for r in behind if r not in frozen)
    if not laggards:
        return None  # every rank entered it and none is frozen: nothing to name
    op = _op_at(counted, entered, group, seq)
    return Found(
        kind=HANG, laggards=laggards, entered=tuple(r for r in entered if r not in frozen), since_ns=since,
        detail=_hang_detail(ranks, laggards, entered, group, seq, op, since), group=group, seq=seq, op=op,
    )


def _seqs(counted: Mapping[int, RankState]) -> Dict[str, Dict[int, int]]:
    """group -> rank -> last enqueued seq."""
    out: Dict[str, Dict[int, int]] = {}
    for rank, s in counted.items():
        for group, enqueued, _ in s.collectives:
            out.setdefault(group, {})[rank] = enqueued
    return out


def _stuck(counted: Mapping[int, RankState]) -> Optional[Tuple[str, int, Tuple[int, ...], Tuple[int, ...]]]:
    """The group whose ranks' sequence numbers differ: (group, highest seq, ranks at it,
    ranks behind, most behind first). Of several groups, the one with the most ranks behind."""
    best = None
    for group, by_rank in sorted(_seqs(counted).items()):
        top = max(by_rank.values())
        behind = tuple(sorted((r for r, e in by_rank.items() if e < top), key=lambda r: (by_rank[r], r)))
        if behind and (best is None or len(behind) > len(best[3])):
            best = (group, top, tuple(sorted(r for r, e in by_rank.items() if e == top)), behind)
    return best


def _entry(s: RankState, group: Optional[str], seq: Optional[int]) -> Optional[Tuple[str, str]]:
    for g, q, op, shape in s.entered:
        if g == group and q == seq:
            return op, shape
    return None


def _op_at(counted: Mapping[int, RankState], ranks: Sequence[int], group: Optional[str], seq: Optional[int]) -> Optional[str]:
    for r in ranks:
        found = _entry(counted[r], group, seq)
        if found is not None:
            return found[0]
    return None


def _mismatch(counted: Mapping[int, RankState]) -> Optional[Found]:
    """Rule 4: at some (group, seq) that every rank of the group has published, two sides
    disagree on op, sizes or dtypes."""
    seqs = _seqs(counted)
    for group, by_rank in sorted(seqs.items()):
        # The seq the job is stuck at in this group: the lowest last enqueued seq (a rank
        # that went past with a mismatched op has it among its last entries).
        seq = min(by_rank.values())
        sides: Dict[Tuple[str, str], List[int]] = {}
        for rank in sorted(by_rank):
            found = _entry(counted[rank], group, seq)
            if found is None:
                return None if len(sides) < 2 else _mismatch_found(group, seq, sides)
            sides.setdefault(found, []).append(rank)
        if len(sides) >= 2:
            return _mismatch_found(group, seq, sides)
    return None


def _mismatch_found(group: str, seq: int, sides: Dict[Tuple[str, str], List[int]]) -> Found:
    ordered = sorted(sides.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    (major_key, major), rest = ordered[0], ordered[1:]
    odd = tuple(sorted(r for _, ranks in rest for r in ranks))
    parts = [f"{_ranks(ranks)} {op} {shape}".rstrip() for (op, shape), ranks in ordered]
    detail = (f"ranks disagree on collective #{seq} of process group {group}: " + "; ".join(parts)
              + f": {_ranks(odd)} called another collective (skipped or reordered one?)")
    return Found(kind=MISMATCH, laggards=odd, entered=tuple(major), since_ns=0, detail=detail,
                 group=group, seq=seq, op=major_key[0])


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _hang_detail(
    ranks: Mapping[int, RankState], laggards: Sequence[int], entered: Sequence[int], group: Optional[str],
    seq: Optional[int], op: Optional[str], since_ns: int,
) -> str:
    first = ranks[laggards[0]]
    why = []
    if first.state in FROZEN_STATES:
        why.append(f"its process is {FROZEN_STATES[first.state]}")
    if first.watcher_silent:
        why.append("its watcher cannot run (the GIL is held?)")
    if first.where:
        why.append(f"at {first.where}" + (" (inside torch.distributed)" if first.in_collective else ""))
    where = f" ({', '.join(why)})" if why else ""
    text = f"nothing moved for {since_ns / 1e9:.1f}s: {_ranks(laggards)} never entered"
    if group is None:
        return f"nothing moved for {since_ns / 1e9:.1f}s: {_ranks(laggards)} holds the job up{where}"
    text += f" {op or 'collective'} #{seq} of process group {group}"
    if entered:
        text += f", which {_ranks(entered)} wait in"
    return text + f"; rank {laggards[0]}{where or ' is elsewhere'}"


class Threshold:
    """The warning threshold, learnt from the job's intervals between movements. Owned by
    one judge (the watcher thread); pure: times are passed in."""

    def __init__(self, fixed_s: Optional[float] = None) -> None:
        self.fixed_s = fixed_s  # hang_warn in seconds; None: learnt
        self.longest_ns = 0
        self.gaps = 0
        self._last: Optional[int] = None

    def observe(self, last_move_ns: Optional[int]) -> None:
        """The job's last movement as now seen; a new one closes an interval."""
        if last_move_ns is None:
            return
        if self._last is not None and last_move_ns > self._last:
            self.longest_ns = max(self.longest_ns, last_move_ns - self._last)
            self.gaps += 1
        if self._last is None or last_move_ns > self._last:
            self._last = last_move_ns

    def value_ns(self, timeout_ms: int) -> int:
        """The threshold now, given the shortest collective timeout (ms; 0: unknown)."""
        if self.fixed_s is not None:
            return int(self.fixed_s * 1e9)
        cap_ns = int(timeout_ms * 1e6 * CAP_FRACTION) if timeout_ms > 0 else int(DEFAULT_CAP_S * 1e9)
        if self.gaps < WARMUP_GAPS:
            return cap_ns
        return min(max(FACTOR * self.longest_ns, int(FLOOR_S * 1e9)), cap_ns)


__all__ = ["CAP_FRACTION", "FACTOR", "FLOOR_S", "Found", "RankState", "Threshold", "WARMUP_GAPS", "diagnose", "last_move"]
