"""The diagnosis of a job that stopped moving: pure (no I/O, no clock; times are passed in).

From every rank's published collective counters (per process group, the last sequence
number entered, and the op and sizes of its last collectives), its process state and its
signs of work, once nothing has moved for the threshold, the judges name the laggards. The
rules (paused or uncounted, frozen first, the ranks behind, mismatched collectives,
agreement names nobody, busy or stuck, plainly stuck) are those of docs/how-it-works.md,
"The hang diagnosis"; the thresholds (:class:`Threshold`: learnt from the job's own
intervals, and the stuck threshold ``STUCK_S``) are explained in docs/hangs.md.

Ranks of other hosts come in as the ranks of this one, each with its host: every host
says, while its ranks stand still, what the diagnosis needs of them, per host and not per
rank (:class:`Summary`, docs/multi-node.md "Hangs across hosts"). Its age is an AGE (ms),
never a timestamp: the hosts' clocks differ, and the reader turns it into its own
``CLOCK_MONOTONIC`` once per stall (the ``stall`` token names one), so that the job's last
move does not jitter from one look to the next (it would read as "it moved again").
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..core.records import BUSY, HANG, MISMATCH, Activity, Heartbeat
from ..core.records import json_int as _int

FACTOR = 5  # as NVIDIA's resiliency extension: 5x the longest interval seen
FLOOR_S = 60.0  # never below a minute (unless the collective timeout is shorter)
CAP_FRACTION = 0.5  # at most half the process group's collective timeout
DEFAULT_CAP_S = 300.0  # when the timeout is not known
WARMUP_GAPS = 10  # intervals seen before the learnt value is trusted
ASSUMED_TIMEOUT_S = 2 * DEFAULT_CAP_S  # the collective timeout, when no rank has said it
BUSY_END_FRACTION = 0.9  # hang_timeout=auto ends busy laggards at this share of the collective timeout
# Signs of work (rule: busy or stuck), over a laggard's last samples (peerwatch.proc.activity.WINDOW):
BUSY_SAMPLES = 3  # fewer samples than this: too early to tell (the judge waits)
BUSY_CPU_SHARE = 0.05  # the main thread on the CPU this share of the time (at any number of places)
BUSY_MAIN_IO_BYTES = 1  # or bytes read or written by its main thread (a slow read: a few a second)
BUSY_OTHER_SHARE = 0.10  # or its other threads (torch's intra-op pool...) on the CPU this share of a core
BUSY_IO_BYTES = 256 * 1024  # or bytes read or written by all its threads (more than a monitor's polls)
BUSY_CHILDREN_SHARE = 0.10  # or its descendants (data loader workers...) on the CPU this share of a core
# The stuck threshold (rule: plainly stuck): a laggard with no sign of work at all is named
# this soon, whatever the learnt threshold, once its samples cover a whole window.
STUCK_S = 10.0  # of the judge's awake time since the job last moved
STUCK_SAMPLES = 8  # samples with no sign of work, a whole window (peerwatch.proc.activity.WINDOW)
STUCK_MARGIN_BEATS = 2  # beats over the window: its first sample, and the judge's look
# A process state (/proc's) in which a rank cannot be making progress, and how to say it.
FROZEN_STATES = {"T": "stopped (SIGSTOP)", "t": "stopped by a debugger", "D": "in uninterruptible sleep (I/O)"}
STOPPED_STATES = ("T", "t")  # stopped: its watcher is stopped too, and no I/O is under way


@dataclasses.dataclass(frozen=True)
class RankState:
    """What one live rank last published (its heartbeat) and its process state, as a judge
    saw it: the one shape of a rank's progress, for the hang rule (peerwatch.verdict.decide), the
    diagnosis and a host's :class:`Summary`. Made from a heartbeat by :meth:`of`
    only; a field the judges need is added here, to :class:`Heartbeat` and to :meth:`of`."""

    step: Optional[int] = None  # its last beat()'s step (None: it never said)
    beat_mono_ns: Optional[int] = None  # its last beat(), CLOCK_MONOTONIC (one clock per host)
    paused: bool = False  # inside paused()
    state: str = "?"  # from /proc: R, S, D, T, ...
    watcher_silent: bool = False  # its watcher has not written a heartbeat for a while (GIL held?)
    in_collective: bool = False  # its main thread waits inside torch.distributed
    where: str = ""  # its main thread's innermost frame outside torch.distributed
    collectives: Tuple[Tuple[str, int, int], ...] = ()  # (group, last enqueued seq, last completed)
    entered: Tuple[Tuple[str, int, str, str], ...] = ()  # (group, seq, op, sizes) of its last collectives
    moved_mono_ns: Optional[int] = None  # when its counters last changed, CLOCK_MONOTONIC
    timeout_ms: int = 0  # the shortest collective timeout it saw (0: unknown)
    activity: Optional[Activity] = None  # its signs of work while its counters stand still
    host: str = ""  # its host, where ranks of several hosts are judged together (:class:`Summary`)
    # A rank of another host: when its host's judges saw it (its summary made), on the judge's
    # clock as the bridge can tell (its first read of that stall, plus the age since); None: seen now.
    seen_mono_ns: Optional[int] = None

    @classmethod
    def of(cls, beat: Heartbeat, state: str = "?", watcher_silent: bool = False) -> RankState:
        """The rank as its heartbeat ``beat`` says, in process ``state``."""
        return cls(
            step=beat.step, beat_mono_ns=beat.progress_ns, paused=beat.paused, state=state,
            watcher_silent=watcher_silent, in_collective=beat.in_collective, where=beat.where,
            collectives=beat.collectives, entered=beat.entered, moved_mono_ns=beat.moved_ns,
            timeout_ms=beat.pg_timeout_ms, activity=Activity.of(beat.activity),
        )


@dataclasses.dataclass(frozen=True)
class Found:
    """A diagnosis, before it is written (the record is peerwatch.core.records.Diagnosis)."""

    kind: str
    laggards: Tuple[int, ...]
    entered: Tuple[int, ...]
    since_ns: int
    detail: str
    group: Optional[str] = None
    seq: Optional[int] = None
    op: Optional[str] = None
    end_after_ns: int = 0  # hang_timeout=auto ends the job this long after the last move (busy: near the timeout)
    busy: Tuple[int, ...] = ()  # the laggards that show signs of work


def last_move(ranks: Mapping[int, RankState]) -> Optional[int]:
    """When the job last moved (any rank's counters or beat), CLOCK_MONOTONIC; None if unknown."""
    times = [t for s in ranks.values() for t in (s.moved_mono_ns, s.beat_mono_ns) if t is not None]
    return max(times, default=None)


def diagnose(
    ranks: Mapping[int, RankState], now_mono_ns: int, threshold_ns: int, timeout_ms: int = 0, awake_since_ns: int = 0,
    stuck_ns: int = 0,
) -> Optional[Found]:
    """The diagnosis if nothing has moved for ``threshold_ns``; None otherwise.
    ``timeout_ms``: the shortest collective timeout (0: unknown), for the end of a busy
    laggard (rule: busy or stuck).
    ``awake_since_ns``: when the judge last resumed (peerwatch.core.awake): only the time since
    counts (a judge that was stopped with the ranks sees their stale heartbeats first).
    ``stuck_ns``: the shorter threshold (rule: plainly stuck; 0: none): from then on, a
    ``hang`` or ``mismatch`` whose every laggard is plainly stuck (:func:`plainly_stuck`) is named."""
    if threshold_ns <= 0 or not ranks or any(s.paused for s in ranks.values()):
        return None
    counted = {r: s for r, s in ranks.items() if s.collectives}
    last = last_move(ranks)
    if not counted or last is None:
        return None
    since = now_mono_ns - max(last, awake_since_ns)
    early = 0 < stuck_ns <= since < threshold_ns  # only a plainly stuck laggard is named (rule: plainly stuck)
    if since < threshold_ns and not early:
        return None
    found = _found(ranks, counted, since, timeout_ms)
    if early and (found is None or not _named_early(found, ranks, now_mono_ns, stuck_ns)):
        return None  # a sign of work, too few samples yet, a wait on others, or old news: the learnt threshold
    return found


def plainly_stuck(s: RankState) -> bool:
    """Rule: plainly stuck. The rank cannot be working: stopped, or a whole window of
    samples (``STUCK_SAMPLES``) with no sign of work at all (in D state too). Not a silent
    watcher alone: the GIL held for long is as often a garbage collection or a C call that
    computes as a deadlock, and nobody sampled it meanwhile (the learnt threshold judges
    it)."""
    if s.state in STOPPED_STATES:
        return True
    if s.watcher_silent:
        return False
    a = s.activity
    return a is not None and a.samples >= STUCK_SAMPLES and busy_evidence(s) == ""


def _named_early(found: Found, ranks: Mapping[int, RankState], now_mono_ns: int, fresh_ns: int) -> bool:
    """Rule: plainly stuck. A hang or mismatch whose every laggard is plainly stuck. A
    hang's laggard that waits in another collective (not stopped) waits for someone else,
    who may be working (a pipeline stage computing): named early only if no rank of the job
    shows a sign of work either. A rank of another host counts only as its host's judges saw
    it less than ``fresh_ns`` (the stuck threshold) ago: older news waits for the learnt
    threshold (a host's summary is refreshed at most every :func:`refresh_ns`)."""
    def stuck(s: RankState) -> bool:
        return plainly_stuck(s) and _fresh(s, now_mono_ns, fresh_ns)

    if found.kind not in (HANG, MISMATCH) or not all(stuck(ranks[r]) for r in found.laggards):
        return False
    waiting = [r for r in found.laggards if ranks[r].in_collective and ranks[r].state not in STOPPED_STATES]
    return found.kind == MISMATCH or not waiting or all(
        busy_evidence(s) == "" and _fresh(s, now_mono_ns, fresh_ns) for s in ranks.values())


def _fresh(s: RankState, now_mono_ns: int, fresh_ns: int) -> bool:
    """A rank of this host (seen now), or of another host seen less than ``fresh_ns`` ago."""
    return s.seen_mono_ns is None or now_mono_ns - s.seen_mono_ns < fresh_ns


def _found(ranks: Mapping[int, RankState], counted: Mapping[int, RankState], since: int, timeout_ms: int) -> Optional[Found]:
    """The finding, once nothing has moved for ``since``.

    Rules: frozen first, the ranks behind, mismatched collectives, agreement names nobody, busy or stuck.
    """
    evidence = {r: busy_evidence(s) for r, s in ranks.items()}
    frozen = sorted(r for r, s in ranks.items() if _frozen(s, evidence[r]))
    mismatch = _mismatch(counted, ranks)
    if mismatch is not None:
        return dataclasses.replace(mismatch, since_ns=since)
    stuck = _stuck(counted)
    if stuck is None and not frozen:
        return None
    group, seq, entered, behind = stuck if stuck is not None else (None, None, (), ())
    laggards = tuple(frozen) + tuple(r for r in behind if r not in frozen)
    if not laggards:
        return None  # every rank entered it and none is frozen: nothing to name
    if any(evidence[r] is None for r in laggards):
        return None  # a laggard has too few samples to tell busy from stuck yet: look again
    op = _op_at(counted, entered, group, seq)
    busy = tuple(r for r in laggards if evidence[r])
    detail = _hang_detail(ranks, laggards, entered, group, seq, op, since)
    if busy:
        detail += "; " + "; ".join(f"{_ranks([r], ranks)} is busy, not stuck ({evidence[r]})" for r in busy)
    return Found(
        kind=BUSY if busy else HANG, laggards=laggards, entered=tuple(r for r in entered if r not in frozen),
        since_ns=since, detail=detail, group=group, seq=seq, op=op, busy=busy,
        end_after_ns=int(BUSY_END_FRACTION * _timeout_ns(timeout_ms)) if busy else 0,
    )


def busy_evidence(s: RankState) -> Optional[str]:
    """Rule: busy or stuck. What shows that a rank works while its counters stand still (""
    if nothing does: it is stuck); None if it has published too few samples to tell yet."""
    a = s.activity
    if s.state in STOPPED_STATES or s.watcher_silent or a is None:
        return ""  # frozen, unseen, or a rank that publishes no samples (not judged by them)
    if a.samples < BUSY_SAMPLES or a.span_ms <= 0:
        return None
    signs = []
    # The main thread on a CPU is work, at however few places: a long op (a forward, cdist)
    # is seen at one or two lines, as an endless loop is, and nobody can tell them apart.
    if a.cpu_ms >= BUSY_CPU_SHARE * a.span_ms:
        at = f"{a.places} place" + ("s" if a.places != 1 else "")
        signs.append(f"its main thread on a CPU (or ready for one) {_share(a.cpu_ms, a.span_ms)} of the time, at {at}")
    if a.other_cpu_ms >= BUSY_OTHER_SHARE * a.span_ms:
        signs.append(f"its other threads on a CPU (or ready for one), {_share(a.other_cpu_ms, a.span_ms)} of a core")
    # Other threads poll while the rank is stuck (NCCL's monitor thread checks the store for
    # other ranks' signals, loggers flush): only many bytes count there. The main thread's
    # figure is its own, and any byte is a read or a write moving on.
    if a.io_bytes >= BUSY_IO_BYTES:
        signs.append(f"{_size(a.io_bytes)} read or written")
    elif a.main_io_bytes >= BUSY_MAIN_IO_BYTES:
        signs.append(f"{_size(a.main_io_bytes)} read or written by its main thread")
    if a.children_cpu_ms >= BUSY_CHILDREN_SHARE * a.span_ms:
        signs.append(f"its child processes on a CPU (or ready for one), {_share(a.children_cpu_ms, a.span_ms)} of a core")
    return ", ".join(signs) + f" in the last {a.span_ms / 1000:.0f}s" if signs else ""


def _frozen(s: RankState, evidence: Optional[str]) -> bool:
    """Rule: frozen first. Stopped, or in uninterruptible sleep with nothing moving, or unseen."""
    return s.state in STOPPED_STATES or s.watcher_silent or (s.state == "D" and not evidence)


def _timeout_ns(timeout_ms: int) -> int:
    return int(timeout_ms * 1e6) if timeout_ms > 0 else int(ASSUMED_TIMEOUT_S * 1e9)


def _share(part_ms: int, whole_ms: int) -> str:
    return f"{100 * part_ms / whole_ms:.0f}%"


def _size(n: int) -> str:
    if n < 1000:
        return f"{n} B"
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.0f} kB"


def _seqs(counted: Mapping[int, RankState]) -> Dict[str, Dict[int, int]]:
    """group -> rank -> last enqueued seq."""
    out: Dict[str, Dict[int, int]] = {}
    for rank, s in counted.items():
        for group, enqueued, _ in s.collectives:
            out.setdefault(group, {})[rank] = enqueued
    return out


def _stuck(counted: Mapping[int, RankState]) -> Optional[Tuple[str, int, Tuple[int, ...], Tuple[int, ...]]]:
    """Rule: the ranks behind. The group whose ranks' sequence numbers differ: (group, highest seq, ranks at it,
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


def _mismatch(counted: Mapping[int, RankState], ranks: Mapping[int, RankState]) -> Optional[Found]:
    """Rule: mismatched collectives. At some (group, seq) that every rank of the group has
    published, two sides disagree on op, sizes or dtypes."""
    for group, by_rank in sorted(_seqs(counted).items()):
        # The seq the job is stuck at in this group: the lowest last enqueued seq (a rank
        # that went past with a mismatched op has it among its last entries).
        seq = min(by_rank.values())
        sides = _sides(counted, group, seq, sorted(by_rank))
        if len(sides) >= 2:
            return _mismatch_found(group, seq, sides, ranks)
    return None


def _sides(counted: Mapping[int, RankState], group: str, seq: int, in_order: List[int]) -> Dict[Tuple[str, str], List[int]]:
    """What the ranks entered at ``seq`` of ``group`` (op and shape -> ranks), up to the first
    rank whose entry is not read yet (entries are read at different beats): the sides known
    so far. Another group is still looked at."""
    sides: Dict[Tuple[str, str], List[int]] = {}
    for rank in in_order:
        found = _entry(counted[rank], group, seq)
        if found is None:
            break
        sides.setdefault(found, []).append(rank)
    return sides


def _mismatch_found(
    group: str, seq: int, sides: Dict[Tuple[str, str], List[int]], states: Mapping[int, RankState],
) -> Found:
    ordered = sorted(sides.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    (major_key, major), rest = ordered[0], ordered[1:]
    odd = tuple(sorted(r for _, ranks in rest for r in ranks))
    parts = [f"{_ranks(ranks, states)} {op} {shape}".rstrip() for (op, shape), ranks in ordered]
    detail = (f"ranks disagree on collective #{seq} of process group {group}: " + "; ".join(parts)
              + f": {_ranks(odd, states)} called another collective (skipped or reordered one?)")
    return Found(kind=MISMATCH, laggards=odd, entered=tuple(major), since_ns=0, detail=detail,
                 group=group, seq=seq, op=major_key[0])


MAX_NAMED = 16  # ranks a finding lists by number in one place (the others are counted)


def _ranks(ranks: Sequence[int], states: Optional[Mapping[int, RankState]] = None) -> str:
    """"ranks 2, 3", or, where ranks carry their host, "ranks 2, 3 on host b and rank 0 on host a"."""
    by_host: Dict[str, List[int]] = {}
    for r in ranks:
        s = states.get(r) if states is not None else None
        by_host.setdefault(s.host if s is not None else "", []).append(r)
    parts = []
    for host, rs in by_host.items():
        listed = ", ".join(map(str, rs[:MAX_NAMED])) + (f" and {len(rs) - MAX_NAMED} more" if len(rs) > MAX_NAMED else "")
        parts.append(("rank " if len(rs) == 1 else "ranks ") + listed + (f" on host {host}" if host else ""))
    return " and ".join(parts)


def explain(s: RankState, context: Sequence[str] = ()) -> List[str]:
    """Why a laggard holds the job up, as far as its own state says: frozen, its watcher
    unable to run, then ``context`` (what its caller knows: its step, the others waiting
    for it), then where its main thread is. The one wording of a hang's laggard, for the
    diagnosis and for the hang_timeout verdict (peerwatch.verdict.decide)."""
    why = []
    if s.state in FROZEN_STATES and (s.state != "D" or not busy_evidence(s)):  # D with bytes moving: busy
        why.append(f"its process is {FROZEN_STATES[s.state]}")
    if s.watcher_silent and s.state not in STOPPED_STATES:  # a stopped process's watcher is stopped too
        why.append("its watcher cannot run (the GIL is held, e.g. by C code)")
    why.extend(context)
    if s.where:
        why.append(f"at {s.where}" + (" (inside torch.distributed)" if s.in_collective else ""))
    return why


def _hang_detail(
    ranks: Mapping[int, RankState], laggards: Sequence[int], entered: Sequence[int], group: Optional[str],
    seq: Optional[int], op: Optional[str], since_ns: int,
) -> str:
    """The finding's words. ``entered``: every rank at ``seq``, frozen ones included: a
    frozen rank that entered it is a laggard, named as one that entered, not as one that
    waits nor as one that never entered."""
    why = explain(ranks[laggards[0]])
    where = f" ({', '.join(why)})" if why else ""
    if group is None:
        return f"nothing moved for {since_ns / 1e9:.1f}s: {_ranks(laggards, ranks)} holds the job up{where}"
    never = [r for r in laggards if r not in entered]
    waiting = [r for r in entered if r not in laggards]
    frozen_in = [r for r in entered if r in laggards]
    text = f"nothing moved for {since_ns / 1e9:.1f}s: {_ranks(never, ranks)} never entered"
    text += f" {op or 'collective'} #{seq} of process group {group}"
    joined = []
    if waiting:
        joined.append(f"{_ranks(waiting, ranks)} {'waits' if len(waiting) == 1 else 'wait'} in")
    if frozen_in:
        joined.append(f"{_ranks(frozen_in, ranks)} entered")
    if joined:
        text += ", which " + " and ".join(joined)
    return text + f"; rank {laggards[0]}{where or ' is elsewhere'}"


class Threshold:
    """The warning threshold, learnt from the job's intervals between movements. Owned by
    one judge (the watcher thread); pure: times are passed in."""

    def __init__(self, fixed_s: Optional[float] = None) -> None:
        self.fixed_s = fixed_s  # hang_warn in seconds; None: learnt
        self.longest_ns = 0
        self.gaps = 0
        self._last: Optional[int] = None

    def observe(self, last_move_ns: Optional[int], awake_since_ns: int = 0) -> None:
        """The job's last movement as now seen; a new one closes an interval. One that began
        before the judge last resumed (``awake_since_ns``, peerwatch.core.awake) is not learnt:
        it holds time nobody saw pass (the job suspended, the judge with it)."""
        if last_move_ns is None:
            return
        if self._last is not None and last_move_ns > self._last and self._last >= awake_since_ns:
            self.longest_ns = max(self.longest_ns, last_move_ns - self._last)
            self.gaps += 1
        if self._last is None or last_move_ns > self._last:
            self._last = last_move_ns

    def stuck_ns(self, timeout_ms: int, interval_s: float = 1.0) -> int:
        """The stuck threshold (rule: plainly stuck): ``STUCK_S``, or long enough for a
        whole window of samples at heartbeats of ``interval_s``; never over
        :meth:`value_ns`. 0 (none) under a fixed threshold: hang_warn set in seconds is the
        one threshold."""
        if self.fixed_s is not None:
            return 0
        window_ns = int((STUCK_SAMPLES + STUCK_MARGIN_BEATS) * interval_s * 1e9)
        return min(max(int(STUCK_S * 1e9), window_ns), self.value_ns(timeout_ms))

    def value_ns(self, timeout_ms: int) -> int:
        """The threshold now, given the shortest collective timeout (ms; 0: unknown)."""
        if self.fixed_s is not None:
            return int(self.fixed_s * 1e9)
        cap_ns = int(timeout_ms * 1e6 * CAP_FRACTION) if timeout_ms > 0 else int(DEFAULT_CAP_S * 1e9)
        if self.gaps < WARMUP_GAPS:
            return min(int(FLOOR_S * 1e9), cap_ns)
        return min(max(FACTOR * self.longest_ns, int(FLOOR_S * 1e9)), cap_ns)


# -- a host's stall, as the other hosts' judges need it ------------------------------------

SUMMARY_VERSION = 2  # 2: runs of ranks as [first, last] (a host's 8 ranks, a merge's thousands)
# A host says it stands still from this share of the warning threshold on: a slow step
# never reaches the store, and the other hosts have it well before the threshold. Sooner,
# from the stuck threshold, only where its summary holds a plainly stuck rank
# (:attr:`Summary.stuck`), or another host's does (the bridge's echo, peerwatch.hosts.bridge).
PUBLISH_FRACTION = 0.5
# While it stands still, a host's summary is published (and the others' read) at most this
# often, as a share of the threshold (and at most once a heartbeat): the judges need it
# once, before the threshold, and its signs of work as they grow.
REFRESH_FRACTION = 1 / 8
# While a summary holds a plainly stuck rank, this share of STUCK_S instead: a remote rank
# counts as plainly stuck only while its news is younger than the stuck threshold, and the
# news crosses three refreshes (its host publishes, the aggregator reads and merges, every
# other host reads the merge): 3 x 2.5 s and a heartbeat stay under 10 s. It lasts seconds:
# fresh news of a plainly stuck laggard ends the job.
STUCK_REFRESH_FRACTION = 1 / 4
MAX_DETAILED = 32  # ranks of one host described in full (the others waiting in a collective are grouped)
MAX_SUMMARY_BYTES = 64 * 1024  # a larger value in the store is not a summary of ours
MAX_SUMMARY_RANKS = 65_536  # ranks one summary (or a merge of many, peerwatch.hangs.merged) may name, at most


def spans(ranks: Sequence[int]) -> List[Any]:
    """Sorted ``ranks`` as JSON, each run of three or more as ``[first, last]``: a host's
    ranks are a run, and so are thousands of ranks waiting alike across hosts."""
    out: List[Any] = []
    i, ranks = 0, sorted(ranks)
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.extend([[ranks[i], ranks[j]]] if j - i >= 2 else ranks[i:j + 1])
        i = j + 1
    return out


def unspan(items: Any, counted: Optional[List[int]] = None) -> Tuple[int, ...]:
    """The ranks of :func:`spans`' output; ValueError past ``MAX_SUMMARY_RANKS`` in all
    (``counted``: ranks read before, in the same value): a run is cheap to write and
    costly to expand."""
    counted = counted if counted is not None else [0]
    out: List[int] = []
    for item in items:
        first, last = (_int(item[0]), _int(item[1])) if isinstance(item, list) and len(item) == 2 else (_int(item),) * 2
        counted[0] += last - first + 1
        if first < 0 or last < first or counted[0] > MAX_SUMMARY_RANKS:
            raise ValueError("not a run of ranks, or too many")
        out.extend(range(first, last + 1))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Summary:
    """One host's stall."""

    host: str
    stall: str  # names this stall (the host's last move, on its own clock): a new token, a new stall
    age_ms: int  # how long ago its ranks last moved (counters or beat()) when it was made
    threshold_ms: int  # its judges' warning threshold (sets how often the summary is refreshed)
    waiting: Tuple[Tuple[Tuple[int, ...], RankState], ...] = ()  # ranks inside a collective, grouped
    detailed: Tuple[Tuple[int, RankState], ...] = ()  # the others, in full
    # A detailed rank is plainly stuck (rule: plainly stuck) past the stuck threshold, by this
    # host's own samples: the summary is published then, not only from PUBLISH_FRACTION of the
    # threshold. It says when to publish and read, never what to name: every reader's
    # judges apply the rule to the ranks' published samples themselves.
    stuck: bool = False

    def to_json(self) -> bytes:
        return json.dumps(self.body(), separators=(",", ":")).encode()

    def body(self) -> Dict[str, Any]:
        """The summary as JSON values (:meth:`to_json`; a merge of several holds these)."""
        body: Dict[str, Any] = {
            "v": SUMMARY_VERSION, "host": self.host, "stall": self.stall, "age_ms": self.age_ms,
            "threshold_ms": self.threshold_ms,
            "waiting": [[spans(ranks), _state_out(s, full=False)] for ranks, s in self.waiting],
            "ranks": [[r, _state_out(s, full=True)] for r, s in self.detailed],
        }
        if self.stuck:
            body["stuck"] = True
        return body

    @classmethod
    def from_json(cls, data: bytes) -> Optional[Summary]:
        """A summary; None for anything else (another version, garbage, too big)."""
        if len(data) > MAX_SUMMARY_BYTES:
            return None
        try:
            return cls.from_body(json.loads(data.decode("utf-8")))
        except (UnicodeDecodeError, ValueError, RecursionError):
            return None

    @classmethod
    def from_body(cls, body: Any, counted: Optional[List[int]] = None) -> Optional[Summary]:
        """:meth:`from_json` of a value already parsed (its size checked by the caller);
        ``counted``: the ranks named so far in the same value (a merge of several), which
        may name ``MAX_SUMMARY_RANKS`` in all."""
        try:
            if not isinstance(body, dict) or body.get("v") != SUMMARY_VERSION:
                return None
            counted = counted if counted is not None else [0]
            waiting = tuple((unspan(ranks, counted), _state_in(s)) for ranks, s in body.get("waiting", ()))
            detailed = tuple((_int(r), _state_in(s)) for r, s in body.get("ranks", ()))
            return cls(str(body["host"]), str(body["stall"]), max(0, _int(body["age_ms"])),
                       max(0, _int(body.get("threshold_ms", 0))), waiting, detailed, body.get("stuck") is True)
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            return None

    def ranks(self) -> List[int]:
        return sorted([r for ranks, _ in self.waiting for r in ranks] + [r for r, _ in self.detailed])

    def public(self) -> bool:
        """Published (``diag/<i>``, the beat's ``s``) by its own right: it holds a plainly
        stuck rank, or its ranks have stood still for ``PUBLISH_FRACTION`` of the threshold.
        Before that it is this host's judges' alone: they read the other hosts' published
        summaries with it (peerwatch.hosts.bridge)."""
        return self.stuck or self.age_ms >= PUBLISH_FRACTION * self.threshold_ms


def summarize(
    ranks: Mapping[int, RankState], host: str, now_mono_ns: int, threshold_ns: int, awake_since_ns: int = 0,
    stuck_ns: int = 0,
) -> Optional[Summary]:
    """This host's summary, if its ranks have stood still for ``PUBLISH_FRACTION`` of the
    threshold, or for the stuck threshold ``stuck_ns`` (0: none; :meth:`Summary.public`
    says which); None otherwise, or when no rank counts collectives. Their age counts from
    ``awake_since_ns`` at the earliest: the judge's last resume (peerwatch.core.awake).
    :attr:`Summary.stuck` once past ``stuck_ns``, a detailed rank is plainly stuck and no
    rank is paused."""
    if not any(s.collectives for s in ranks.values()):
        return None
    last = last_move(ranks)
    if last is None:
        return None
    age_ns = now_mono_ns - max(last, awake_since_ns)
    past_stuck = 0 < stuck_ns <= age_ns
    if age_ns < PUBLISH_FRACTION * threshold_ns and not past_stuck:
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
    stuck = past_stuck and not any(s.paused for s in ranks.values()) and any(plainly_stuck(s) for _, s in detailed)
    return Summary(host, str(last), age_ns // 1_000_000, threshold_ns // 1_000_000, waiting,
                   tuple(detailed), stuck)


def remote_ranks(summary: Summary, moved_mono_ns: int) -> Dict[int, RankState]:
    """The host's ranks as the diagnosis takes them: their last move ``moved_mono_ns`` (the
    summary's age, on the reader's clock, fixed per stall), their host named, seen when the
    summary was made (its last move plus its age: the reader's clock too)."""
    seen = moved_mono_ns + summary.age_ms * 1_000_000
    out: Dict[int, RankState] = {}
    for ranks, s in summary.waiting:  # one state for a group (thousands of ranks in a merge's crowd)
        out.update(dict.fromkeys(ranks, dataclasses.replace(s, moved_mono_ns=moved_mono_ns, host=summary.host,
                                                            seen_mono_ns=seen)))
    for r, s in summary.detailed:
        out[r] = dataclasses.replace(s, moved_mono_ns=moved_mono_ns, host=summary.host, seen_mono_ns=seen)
    return out


def refresh_ns(threshold_ms: int, interval_ns: int, stuck: bool = False) -> int:
    """How often a standing-still host's summary is published, and the others' read;
    ``stuck``: the summary (or one read) holds a plainly stuck rank."""
    every = max(interval_ns, int(threshold_ms * 1e6 * REFRESH_FRACTION))
    return min(every, max(interval_ns, int(STUCK_S * 1e9 * STUCK_REFRESH_FRACTION))) if stuck else every


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


__all__ = [
    "BUSY_END_FRACTION", "CAP_FRACTION", "FACTOR", "FLOOR_S", "FROZEN_STATES", "Found", "RankState", "STOPPED_STATES",
    "STUCK_S", "STUCK_SAMPLES", "Threshold", "WARMUP_GAPS", "busy_evidence", "diagnose", "explain", "last_move",
    "plainly_stuck", "MAX_DETAILED", "MAX_SUMMARY_BYTES", "MAX_SUMMARY_RANKS", "PUBLISH_FRACTION", "REFRESH_FRACTION",
    "Summary", "refresh_ns", "remote_ranks", "spans", "summarize", "unspan",
]
