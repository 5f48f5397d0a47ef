"""What this host knows of the other hosts, and the rules it judges them by. Pure.

No I/O, no threads, no clock: every function takes the time it needs as an argument, so
every rule here is unit-tested (``tests/test_hosts.py``) without a store or a process.
:class:`Liveness` judges a silent host lost whichever way its news comes: through the store
(the bridge) or on a shared filesystem (:mod:`.sharedfs`).

Mutable state: a :class:`Liveness` is owned by the thread that calls it (the bridge's beat
thread; on a shared filesystem, a judge's watcher thread); everything else here is immutable.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import AbstractSet, Dict, List, Mapping, Optional, Set, Tuple

from ..core.awake import AwakeClock
from ..core.config import Config
from ..core.records import EXCEPTION, EXIT, LOST, Failure, Registration, Verdict

DONE = b"done:"  # a beat that starts so: a rank of that host finished cleanly; the job is ending
# A local exception may be the echo of a failure on another host (a collective that lost
# its peer raises within milliseconds): that host's verdict, already on its way through the
# store (one round trip: ~5-30 ms, much more on loaded hosts), gets this long to arrive
# before ours is made. The same 1 s as the one-host rule (decide.CONSEQUENCE_WINDOW_NS).
REMOTE_SETTLE_S = 1.0
CONNECT_BACKOFF_MAX_S = 5.0  # between connection attempts, doubling from heartbeat_interval
OP_TIMEOUT_MIN_S = 0.5  # one store request's timeout: peer_timeout / 3, within these bounds
OP_TIMEOUT_MAX_S = 10.0
# What is read from the store is bounded: anyone who can reach it may write there.
MAX_HOSTS = 65_536  # the `hosts` counter (unsigned) is believed up to this many hosts
READ_BATCH = 64  # host/<j> entries looked up per interval, at most
MAX_HOST_BYTES = 65_536  # a host/<j> value longer than this is garbage
# A host the launcher announces that has not joined (no beat of it read) after this many
# peer_timeouts of our looks is lost; it is an error, said once, from one peer_timeout on.
JOIN_TIMEOUTS = 10
LOOK_SLACK = 0.1  # of a heartbeat: how much short of the timeout a look's silence may be and still judge (Liveness)


@dataclasses.dataclass(frozen=True)
class HostInfo:
    """What a host says of itself in ``host/<i>``."""

    index: int
    hostname: str
    boot_id: str = ""
    pidns: str = ""
    ranks: Tuple[int, ...] = ()
    ident: str = ""  # boot id, PID namespace and run directory, hashed: the same for a successor bridge

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, index: int, data: bytes) -> HostInfo:
        """The host's own account; garbage gives a host known only by its index."""
        if len(data) > MAX_HOST_BYTES:
            return cls(index, f"host {index}")
        try:
            body = json.loads(data.decode("utf-8"))
            ranks = tuple(sorted(int(r) for r in body.get("ranks", ()) if not isinstance(r, bool)))
            return cls(index, str(body.get("hostname", f"host {index}")), str(body.get("boot_id", "")),
                       str(body.get("pidns", "")), ranks, str(body.get("ident", "")))
        except (UnicodeDecodeError, ValueError, TypeError, AttributeError):
            return cls(index, f"host {index}")

    def describe(self) -> str:
        return f"host {self.hostname} ({ranks_text(self.ranks)})"


def host_ident(boot_id: str, pidns: str, run_dir: str) -> str:
    """Names this host's bridge in the store, whichever local rank runs it."""
    return hashlib.sha1(f"{boot_id}|{pidns}|{run_dir}".encode()).hexdigest()[:16]


def ranks_text(ranks: Tuple[int, ...]) -> str:
    if not ranks:
        return "ranks unknown"
    if len(ranks) > 1 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


STALLED = b"s"  # a beat that ends so: that host's ranks stand still, its summary is in diag/<i>


def beat_value(seq: int, done: bool, stalled: bool = False) -> bytes:
    """What a host writes into ``beat/<i>``: a new value each time, ``done:`` once it ended
    well, ``s`` at the end while its ranks stand still (its stall summary is in the store)."""
    return (DONE if done else b"") + str(seq).encode() + (STALLED if stalled else b"")


def beat_seq(value: bytes) -> Optional[int]:
    """The sequence number in a beat (:func:`beat_value`), or None: not a beat."""
    body = value[len(DONE):] if value.startswith(DONE) else value
    body = body[:-len(STALLED)] if body.endswith(STALLED) else body
    return int(body) if body.isdigit() and len(body) <= 30 else None


def stalled_hosts(beats: Mapping[int, Optional[bytes]]) -> List[int]:
    """The hosts whose last beat says their ranks stand still (their summaries are to read)."""
    return sorted(j for j, v in beats.items() if v is not None and v.endswith(STALLED))


class Liveness:
    """The one rule by which a host is lost, whatever brings its news
    (rule: a silent host is lost): a peer (a host, through the store; a rank of another host,
    on a shared filesystem: :class:`peerwatch.hosts.sharedfs.RemoteWatch`) is lost when no
    news of it came for ``timeout_ns`` of our own looks since it was first seen. Its source
    says what is news (:meth:`observe`, for the store: a higher beat sequence number).
    No clock is compared across hosts, and a gap of our own counts against nobody
    (``awake``, :class:`peerwatch.core.awake.AwakeClock`; by default, more than half the
    timeout between two looks is one). A host whose beat says ``done`` is never lost.

    ``look_ns``: how far apart the looks are (a heartbeat; 0: not regular). A silence that
    falls short of the timeout by less than ``LOOK_SLACK`` of it counts as the timeout: looks
    a heartbeat apart are timed after their exchange with the store, and one whose exchange
    was a few ms quicker than the first's would otherwise wait a whole heartbeat more (a
    lost host known at peer_timeout plus two heartbeats, not one)."""

    def __init__(self, timeout_ns: int, awake: Optional[AwakeClock] = None, look_ns: int = 0) -> None:
        self.timeout_ns = timeout_ns
        self._due_ns = timeout_ns - int(LOOK_SLACK * look_ns)  # the silence judged lost
        self.seqs: Dict[int, int] = {}  # the highest sequence number seen per host
        self.changed_ns: Dict[int, int] = {}  # peer -> when its last news came (or it was first seen)
        self.done: Set[int] = set()
        self._awake = awake if awake is not None else AwakeClock(timeout_ns // 2)

    def seen(self, peer: int, now_ns: int) -> None:
        """``peer`` is known, with no news: its silence counts from when it was first seen."""
        self.changed_ns.setdefault(peer, now_ns)

    def news(self, peer: int, now_ns: int) -> None:
        """News of ``peer``: its silence starts again."""
        self.changed_ns[peer] = now_ns

    def observe(self, now_ns: int, beats: Mapping[int, Optional[bytes]]) -> None:
        """One look at every host's beat in the store (None: not known this time, no change)."""
        self._awake.tick(now_ns)
        for host, value in beats.items():
            if value is None:
                continue
            # Only a higher sequence number is news: two old beats of a host written back in
            # turn (replayed by whoever can reach the store) are not a host that beats.
            seq = beat_seq(value)
            if seq is None or (host in self.seqs and seq <= self.seqs[host]):
                self.seen(host, now_ns)
                continue
            self.seqs[host] = seq
            if value.startswith(DONE):
                self.done.add(host)
            self.news(host, now_ns)

    def forget(self, peer: int) -> None:
        """No longer judge ``peer`` here (another judge does, or it ended); a host's sequence
        number is kept: an old beat of it written back is still no news."""
        self.changed_ns.pop(peer, None)

    def lost(self, now_ns: int, exclude: AbstractSet[int] = frozenset()) -> List[int]:
        return sorted(
            p for p in self.changed_ns
            if p not in self.done and p not in exclude and self.silent_ns(p, now_ns) >= self._due_ns
        )

    def silent_ns(self, peer: int, now_ns: int) -> int:
        return self._awake.counted_ns(self.changed_ns.get(peer, now_ns), now_ns)


# -- the digest: one host reads every beat, every other host reads one key ---------------

MAX_DIGEST_LIST = 64  # hosts named in a digest's lists (lost, stalled), at most: the rest are counted
MAX_DIGEST_BYTES = 4096  # a digest longer than this is garbage (unknown: no news)
DIGEST_BEAT_BYTES = 40  # the writer's own beat in the digest, at most


@dataclasses.dataclass(frozen=True)
class Digest:
    """What the aggregator (one host, elected through the store: :func:`aggregate_term`)
    publishes each heartbeat in ``digest``, for every other host to read with one ``get``:
    its own beat (the other hosts judge the aggregator itself by it), and its judgement of
    every other host (which are lost, which stand still, whether one is done). Bounded:
    at most ``MAX_DIGEST_LIST`` hosts per list, whatever the number of hosts."""

    by: int  # the writer's index
    term: int  # grows by one at each takeover: a writer that finds a higher term (or its
    # own term with a lower writer) yields
    beat: bytes  # the writer's beat this heartbeat (:func:`beat_value`): its liveness, done, stall
    count: int = 0  # the ``hosts`` counter as the writer read it (MAX_HOSTS at most)
    joined: int = 0  # hosts whose beat the writer has read, itself included
    lost: Tuple[int, ...] = ()  # hosts silent for peer_timeout of the writer's looks
    stalled: Tuple[int, ...] = ()  # hosts whose beat says they stand still (diag/<j> is there)
    ending: bool = False  # a host's beat said done: the job is ending
    rank0: Optional[int] = None  # the host that announced rank 0 (a lost store is blamed on it)
    more_lost: int = 0  # lost hosts beyond the list

    def to_json(self) -> bytes:
        body = {"by": self.by, "t": self.term, "b": self.beat.decode("ascii", "replace"), "n": self.count,
                "j": self.joined, "l": list(self.lost[:MAX_DIGEST_LIST]), "s": list(self.stalled[:MAX_DIGEST_LIST]),
                "e": int(self.ending), "r0": self.rank0, "ml": self.more_lost}
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: Optional[bytes]) -> Optional[Digest]:
        """The digest, or None: not there, too long, not a digest (unknown, never news)."""
        if data is None or len(data) > MAX_DIGEST_BYTES:
            return None
        try:
            body = json.loads(data.decode("utf-8"))
            beat = str(body["b"]).encode("ascii")

            def index(v: object) -> int:
                if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < MAX_HOSTS:
                    raise ValueError(v)
                return v

            def indices(v: object) -> Tuple[int, ...]:
                if not isinstance(v, list) or len(v) > MAX_DIGEST_LIST:
                    raise ValueError(v)
                return tuple(sorted({index(j) for j in v}))

            r0 = body.get("r0")
            digest = cls(index(body["by"]), index(body["t"]), beat, index(body.get("n", 0)),
                         min(int(body.get("j", 0)), MAX_HOSTS), indices(body.get("l", [])),
                         indices(body.get("s", [])), bool(body.get("e", 0)), None if r0 is None else index(r0),
                         min(max(int(body.get("ml", 0)), 0), MAX_HOSTS))
        except (UnicodeError, ValueError, TypeError, KeyError, AttributeError):
            return None
        if len(beat) > DIGEST_BEAT_BYTES or beat_seq(beat) is None:
            return None
        return digest

    @property
    def seq(self) -> int:
        seq = beat_seq(self.beat)
        assert seq is not None  # from_json refuses a digest without one
        return seq


def bounded(hosts: List[int]) -> Tuple[Tuple[int, ...], int]:
    """A list for a digest: the lowest ``MAX_DIGEST_LIST`` hosts, and how many more."""
    hosts = sorted(hosts)
    return tuple(hosts[:MAX_DIGEST_LIST]), max(0, len(hosts) - MAX_DIGEST_LIST)


def stalled_for_digest(stalled: List[int], first: AbstractSet[int]) -> Tuple[int, ...]:
    """The hosts standing still that a digest names (every other host reads their merged
    summaries, ``diag/all``, again while one of them is not in it yet): at most
    ``MAX_DIGEST_LIST``, those in ``first`` first (the hosts whose summary holds ranks that
    do not wait inside a collective: the laggard candidates), then the lowest indices."""
    return tuple(sorted(set(stalled), key=lambda j: (j not in first, j))[:MAX_DIGEST_LIST])


class DigestWatch:
    """How long the digest has not advanced (a new writer or term, or a higher sequence
    number of the same writer), on this host's monotonic clock, counted only while we
    look (:class:`peerwatch.core.awake.AwakeClock`: a gap of our own restarts it). No digest
    at all counts from our first look. Owned by the beat thread."""

    def __init__(self, timeout_ns: int) -> None:
        self._awake = AwakeClock(timeout_ns // 2)
        self._key: Optional[Tuple[int, int]] = None  # (term, writer) of the last digest seen
        self._seq = -1
        self.since_ns: Optional[int] = None  # the digest last advanced then (or our first look)

    def observe(self, now_ns: int, digest: Optional[Digest]) -> None:
        self._awake.tick(now_ns)
        if self.since_ns is None:
            self.since_ns = now_ns
        if digest is None:
            return
        key = (digest.term, digest.by)
        if key != self._key or digest.seq > self._seq:
            self._key, self._seq, self.since_ns = key, digest.seq, now_ns

    def silent_ns(self, now_ns: int) -> int:
        return 0 if self.since_ns is None else self._awake.counted_ns(self.since_ns, now_ns)


# A host's first requests (its registration: about eight) come at a random point of this
# many seconds per host the launcher announces, at most a heartbeat: at ~50 us of the store's
# CPU a request, a thousand hosts registering then take under a quarter of its one event
# loop, while three hosts start at once rather than up to a heartbeat late.
FIRST_SPREAD_PER_HOST_S = 0.002


def first_spread_s(interval: float, expected: Optional[int]) -> float:
    """Over how long the first requests of the hosts are spread: ``FIRST_SPREAD_PER_HOST_S``
    per host the launcher announces, a heartbeat at most (and when it does not say)."""
    if expected is None:
        return interval
    return min(interval, max(expected, 1) * FIRST_SPREAD_PER_HOST_S)


def takeover_ns(peer_timeout: float, interval: float) -> int:
    """How long the digest may stand still before the aggregator's successor takes over:
    half of peer_timeout (at least two heartbeats, at most peer_timeout), so that it has
    judged the other hosts for a while when the aggregator itself is judged lost."""
    return int(min(peer_timeout, max(peer_timeout / 2, 2 * interval)) * 1e9)


def successor_distance(writer: int, me: int, count: int, lost: AbstractSet[int]) -> int:
    """How many hosts after ``writer`` (cyclically, over the ``count`` indices, skipping the
    lost ones) ``me`` comes: 1 for the writer's successor."""
    count = max(count, writer + 1, me + 1)
    k = 0
    for step in range(1, min(count, MAX_HOSTS) + 1):
        j = (writer + step) % count
        if j == writer:
            break
        if j in lost:
            continue
        k += 1
        if j == me:
            return k
    return max(k, 1)


def aggregate_term(me: int, digest: Optional[Digest], mine: Optional[int], silent_ns: int, takeover: int) -> Optional[int]:
    """Should this host (index ``me``) aggregate this heartbeat, and under which term?
    ``mine``: the term it aggregates under now (None: it does not); ``silent_ns``: how
    long the digest has not advanced (:class:`DigestWatch`). None: read the digest only.

    - no digest yet: host 0 at once, host ``k`` after ``k`` takeovers of silence (host 0
      may be gone before it wrote one);
    - the digest is ours (a successor bridge on this host takes it over): go on;
    - we aggregate and find another writer's digest: the higher term wins, then the lower
      index; the loser yields (a writer frozen for a while, whose successor took over,
      finds the successor's term when it resumes);
    - the writer's digest stands still for ``k`` takeovers, ``k`` our distance after it
      (1: its successor): take over with the next term."""
    if digest is None:
        if mine is not None:
            return mine
        return 0 if silent_ns >= me * takeover else None
    if digest.by == me:
        return max(digest.term, mine if mine is not None else digest.term)
    if mine is not None:
        return None if (digest.term, -digest.by) > (mine, -me) else mine
    k = successor_distance(digest.by, me, digest.count, set(digest.lost))
    return digest.term + 1 if silent_ns >= k * takeover else None


# -- which hosts to look at -------------------------------------------------------------


def roster_incomplete(expected: Optional[int], known: int) -> bool:
    """Look for more hosts (read the ``hosts`` counter)? Until as many as the launcher says."""
    return expected is None or known < expected


def parse_count(value: bytes) -> Optional[int]:
    """The ``hosts`` counter as the store keeps it (decimal, maybe negative), or None: not a count."""
    body = value[1:] if value.startswith(b"-") else value
    if not body.isdigit() or len(body) > 20:
        return None
    return max(0, int(value))


def hosts_to_read(count: int, known: AbstractSet[int], index: int, limit: int = READ_BATCH) -> List[int]:
    """The lowest indices below the ``hosts`` counter (believed up to ``MAX_HOSTS``) whose
    ``host/<j>`` we have not read (nor are), at most ``limit``: one interval's look-ups."""
    found: List[int] = []
    for j in range(min(count, MAX_HOSTS)):
        if len(found) >= limit:
            break
        if j not in known and j != index:
            found.append(j)
    return found


class Absence:
    """How long some of the hosts the launcher announced have been missing (never joined:
    no beat of theirs read), on this host's monotonic clock, counted only while we look:
    as in :class:`Liveness`, a gap of more than half ``timeout_ns`` between two looks
    (we were frozen, starved) restarts the count."""

    def __init__(self, timeout_ns: int) -> None:
        self._awake = AwakeClock(timeout_ns // 2)
        self.since_ns: Optional[int] = None  # hosts missing since then; None: none missing

    def observe(self, now_ns: int, missing: int) -> None:
        gap = self._awake.tick(now_ns)
        if missing <= 0:
            self.since_ns = None
        elif self.since_ns is None or gap:
            self.since_ns = now_ns

    def waited_s(self, now_ns: int) -> float:
        return 0.0 if self.since_ns is None else (now_ns - self.since_ns) / 1e9


def hosts_missing(expected: Optional[int], joined: int) -> int:
    """How many of the hosts the launcher announced (we are one) have not joined."""
    return 0 if expected is None else max(0, expected - 1 - joined)


def unannounced_ranks(hosts: Mapping[int, HostInfo], world_size: Optional[int]) -> List[int]:
    """The ranks of the job that no host known has announced (world_size unknown: none)."""
    announced = {r for h in hosts.values() for r in h.ranks}
    return [r for r in range(world_size or 0) if r not in announced]


def peers_to_watch(hosts: Mapping[int, HostInfo], index: Optional[int], ident: str) -> List[int]:
    """The hosts whose beats we judge: never ourselves, nor an index of our own (a
    registration that raced) under another number."""
    return sorted(j for j, h in hosts.items() if j != index and h.ident != ident)


# -- when a silence is a failure --------------------------------------------------------


def hosts_to_declare_lost(
    liveness: Liveness, now_ns: int, reported: AbstractSet[int], job_ending: bool, verdict_known: bool
) -> List[int]:
    """Silent hosts to record as lost now: none once the job is ending or has a verdict."""
    if job_ending or verdict_known:
        return []
    return liveness.lost(now_ns, exclude=reported)


def store_silent_for(last_ok_s: Optional[float], now_s: float, peer_timeout: float) -> Optional[float]:
    """How long the store has been unreachable if that makes it lost (None: not lost).
    A store never reached is not lost: it may not exist yet (before init_process_group)."""
    if last_ok_s is None or now_s - last_ok_s < peer_timeout:
        return None
    return now_s - last_ok_s


def report_store_lost(already: bool, job_ending: bool, verdict_known: bool) -> bool:
    return not (already or job_ending or verdict_known)


# -- timing -------------------------------------------------------------------------------


def op_timeout_s(peer_timeout: float) -> float:
    """One store request's timeout: a third of peer_timeout, within [0.5 s, 10 s]."""
    return max(OP_TIMEOUT_MIN_S, min(peer_timeout / 3, OP_TIMEOUT_MAX_S))


def interval_deadline_s(peer_timeout: float) -> float:
    """How long one interval's store work may take before the store counts as unreachable."""
    return min(2 * op_timeout_s(peer_timeout), peer_timeout / 2)


def connect_allowance_s(peer_timeout: float) -> float:
    """What a deadline gains when a connection must be made first: two request timeouts."""
    return 2 * op_timeout_s(peer_timeout)


def next_backoff_s(backoff: float, interval: float, peer_timeout: float) -> float:
    """The wait before the next attempt after a failed one: doubling, capped."""
    return min(backoff * 2, CONNECT_BACKOFF_MAX_S, max(interval, peer_timeout / 4))


# -- holding an exception back ----------------------------------------------------------


def may_be_echo(verdict: Verdict, me: int, connected: bool) -> bool:
    """Should ``verdict`` be held back (deciding again meanwhile)? Only an exception or an
    exit this rank judged, while this host is connected to the store: it may be the echo
    of a death on another host, whose verdict is one round trip away."""
    return verdict.cause in (EXCEPTION, EXIT) and verdict.detected_by == me and connected


def settle_deadline(failed_at_ns: int, now_ns: int, now_s: float) -> float:
    """The ``time.monotonic()`` at which ``REMOTE_SETTLE_S`` after the failure has passed.
    The failure's time is a record timestamp (wall clock): its age is read once, here,
    within [0, REMOTE_SETTLE_S], and the deadline is monotonic from then on."""
    age_s = min(max((now_ns - failed_at_ns) / 1e9, 0.0), REMOTE_SETTLE_S)
    return now_s + REMOTE_SETTLE_S - age_s


# -- the records a bridge writes ----------------------------------------------------------


def lost_host_failure(info: HostInfo, silent_s: float, config: Config, now_ns: int) -> Failure:
    """The record a bridge writes for a host that fell silent: on that host's lowest rank."""
    return Failure(
        rank=info.ranks[0] if info.ranks else 0, pid=0, time_ns=now_ns, cause=LOST, exit_code=config.exit_code,
        message=f"{info.describe()} lost: its heartbeat in the store has not advanced for {silent_s:.1f}s "
        f"(peer_timeout {config.peer_timeout:g}s): the host froze, crashed or was cut off",
        host=info.hostname,
    )


def lost_rank_failures(liveness: Liveness, now_ns: int, wall_ns: int, registrations: Mapping[int, Registration],
                       ended: AbstractSet[int], judge: str, exit_code: int) -> Tuple[Failure, ...]:
    """The records a judge writes on a shared filesystem, where ``liveness`` is kept per rank of
    the other hosts (``now_ns`` its clock, ``wall_ns`` the records' time) by a judge on host
    ``judge``: one for each rank lost and not ``ended`` (rule: a silent host is lost), with a
    message that names its host and each of that host's ranks silent for half the timeout or
    more (a frozen host's last heartbeats land at slightly different times)."""
    lost = liveness.lost(now_ns, exclude=ended)
    silent: Dict[Tuple[str, str], List[int]] = {}
    for rank in sorted(liveness.changed_ns) if lost else ():
        reg = registrations.get(rank)
        if reg is not None and rank not in ended and liveness.silent_ns(rank, now_ns) >= liveness.timeout_ns // 2:
            silent.setdefault((reg.host, reg.pidns), []).append(rank)
    found: List[Failure] = []
    for (host, _), ranks in silent.items():
        quiet = ", ".join(f"rank {r} for {liveness.silent_ns(r, now_ns) / 1e9:.1f}s" for r in ranks)
        message = (f"host {host} lost: no heartbeat of {quiet} (peer_timeout {liveness.timeout_ns / 1e9:g}s, by the "
                   f"clock of host {judge}): the host is down, cut off, or its ranks are frozen")
        found.extend(Failure(rank=r, pid=registrations[r].pid, time_ns=wall_ns - liveness.silent_ns(r, now_ns),
                             cause=LOST, exit_code=exit_code, message=message) for r in ranks if r in lost)
    return tuple(found)


def missing_hosts_failure(missing: int, expected: int, waited_s: float, hosts: Mapping[int, HostInfo],
                          config: Config, now_ns: int) -> Failure:
    """The record a bridge writes for hosts the launcher announced that never joined: on the
    lowest rank no host announced (0 when the job's size is unknown)."""
    ranks = unannounced_ranks(hosts, config.world_size)
    whose = f" (ranks not announced by any host: {ranks_text(tuple(ranks))})" if ranks else ""
    return Failure(
        rank=ranks[0] if ranks else 0, pid=0, time_ns=now_ns, cause=LOST, exit_code=config.exit_code,
        message=f"{missing} of the {expected} hosts the launcher announced never joined through the store in "
        f"{waited_s:.1f}s{whose}: their ranks did not start, do not run peerwatch, cannot reach the store, or "
        "use another store secret",
    )


def store_holder(hosts: Mapping[int, HostInfo], me: HostInfo) -> Optional[HostInfo]:
    """The host a lost store is blamed on: rank 0's (whose node serves ``MASTER_ADDR``'s
    store under init_process_group and torchrun), or, where rank 0 is ours, the lowest remote
    rank known; never ours, since the local ranks are alive and only being cut off. None
    where rank 0 is on a host not known here (a host that reads the digest knows few hosts'
    records, rank 0's once the digest names it): rank 0 is blamed, its host unnamed, rather
    than whichever host happens to be known."""
    remote = [h for h in hosts.values() if h.index != me.index and h.ranks]
    holder = next((h for h in remote if 0 in h.ranks), None)
    if holder is not None or 0 not in me.ranks:
        return holder
    return min(remote, key=lambda h: h.ranks[0], default=None)


def lost_store_failure(
    store: str, hosts: Mapping[int, HostInfo], me: HostInfo, silent_s: float, config: Config, now_ns: int
) -> Failure:
    """The record a bridge writes when the store has been unreachable for peer_timeout."""
    holder = store_holder(hosts, me)
    rank = holder.ranks[0] if holder is not None else 0
    where = f"; the store is served from {holder.describe()}" if holder is not None and 0 in holder.ranks else ""
    return Failure(
        rank=rank, pid=0, time_ns=now_ns, cause=LOST, exit_code=config.exit_code,
        message=f"the store at {store} has been unreachable for {silent_s:.1f}s (peer_timeout "
        f"{config.peer_timeout:g}s){where}: its host died, or {me.describe()} is cut off from it",
        host=holder.hostname if holder is not None else None,
    )


__all__ = [
    "CONNECT_BACKOFF_MAX_S", "DONE", "JOIN_TIMEOUTS", "MAX_HOSTS", "MAX_HOST_BYTES", "READ_BATCH", "REMOTE_SETTLE_S",
    "LOOK_SLACK", "STALLED", "MAX_DIGEST_LIST", "MAX_DIGEST_BYTES", "Absence", "Digest", "DigestWatch", "FIRST_SPREAD_PER_HOST_S", "aggregate_term", "bounded", "first_spread_s", "stalled_for_digest",
    "successor_distance", "takeover_ns", "beat_seq", "stalled_hosts", "HostInfo", "Liveness", "beat_value", "connect_allowance_s",
    "host_ident", "hosts_missing", "missing_hosts_failure", "parse_count", "unannounced_ranks",
    "hosts_to_declare_lost", "hosts_to_read", "interval_deadline_s", "lost_host_failure", "lost_rank_failures", "lost_store_failure",
    "may_be_echo", "next_backoff_s", "op_timeout_s", "peers_to_watch", "ranks_text", "report_store_lost",
    "roster_incomplete", "settle_deadline", "store_holder", "store_silent_for",
]
