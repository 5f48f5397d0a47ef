"""The store bridge: a source that turns facts from other hosts into local records.

One rank per host (the winner of :mod:`.election`) runs it: it is a client of a
``torch.distributed`` store (by default the job's own TCPStore at ``MASTER_ADDR:MASTER_PORT``,
as :class:`peerwatch.core.config.LauncherFacts` says) and speaks :mod:`.store_protocol` there. Per
heartbeat interval it makes one ``set`` (its beat) and one ``get`` (the ``digest``): one
host, the aggregator (elected through the digest itself, :func:`.hosts.aggregate_term`),
reads every host's beat instead (one ``multi_get``) and publishes their liveness in the
digest (one ``set``); its successor takes over when the digest stops advancing. The store
sees O(hosts) requests and bytes per interval in all, O(1) per host. A second thread,
with its own connection, blocks in ``wait`` on the verdict key, so a verdict made on any
host reaches this one in one round trip; it is written into the local
``events/verdict.json`` and the local watchers act on it as on a local one.

While this host's ranks stand still (its hang judges say so in ``RUN/stall.json``, see
:class:`peerwatch.hangs.diagnose.Summary`) and its summary is public (:meth:`~peerwatch.hangs.diagnose.Summary.public`:
from half the threshold, or from the stuck one where it holds a plainly stuck rank or another
host's does), the beat says so too (``<seq>s``), the interval also sets this host's
summary in ``diag/<i>`` (when it is new, then at most every ``refresh_ns``), and reads, as
often, the other hosts' stalls: the aggregator, the summaries of the hosts whose beat says
they stand still (one ``multi_get``), which it merges into ``diag/all``
(:mod:`peerwatch.hangs.merged`, bounded); every other host, that one key. It writes them,
each one's last move turned into this host's clock once per stall, into
``RUN/stalls-remote.json`` for the judges. Before its summary is public, it
reads the others' only once per host that starts to stand still, and every refresh while one
holds a plainly stuck rank. A job that moves costs nothing more.

What the bridge writes locally is only ever a record (a verdict from the store, or a
``Failure`` with cause ``lost`` when a host or the store falls silent for ``peer_timeout``,
by the rules of :mod:`.hosts`); the decision stays in :mod:`peerwatch.verdict.decide`, and only local
processes are ever signalled. peerwatch never imports torch: the bridge starts once the
application has imported ``torch.distributed`` itself (a job that uses a TCPStore always
does), since an import from a bridge thread while the main thread is inside its own
``import torch`` breaks both (Python hands out half-initialised modules and the process
aborts). Until then the bridge waits, and says so once after ``peer_timeout``.

The parts, and the thread that owns each one's fields (written by it alone; others only read):

- :class:`Bridge` (the watcher thread: :meth:`~Bridge.tick`, :meth:`~Bridge.on_verdict`,
  :meth:`~Bridge.hold_until`) only wires: the election, the store client (made once), the
  two loops below and their threads (started under a lock that orders them against
  :meth:`~Bridge.stop`), the publishing of this host's verdict, the settle deadlines. The
  main thread calls :meth:`~Bridge.on_success` and owns ``_succeeded`` (an Event, only ever
  set); ``stopped`` is set by :meth:`~Bridge.stop` from any thread.
- :class:`_BeatLoop` (the beat thread, ``peerwatch-bridge-beat-rank<N>``): this host's beat
  and index, what it knows of the other hosts and their liveness, whether the store answers
  (``bridge.up``, ``bridge.json``), the ``lost`` records it wrote; and the parts it calls,
  whose fields are the beat thread's too: :class:`_Stalls` (the hang diagnosis across hosts)
  and :class:`_Absentees` (the hosts announced that never joined).
- :class:`_VerdictWaiter` (the waiter thread, ``peerwatch-bridge-wait-rank<N>``): its own
  connection, blocked in the store's ``wait``, and the verdict taken from the store.
- :class:`_TorchGate`: whether torch.distributed, as the application imported it, can serve a
  store, found out by the beat thread; the waiter touches the store only after it did.
- the client's owner thread (``peerwatch-bridge-io-rank<N>``): the store client (:mod:`.store_client`).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import logging
import os
import random
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Set, Tuple

from ..core import terminal
from ..core.config import Config, LauncherFacts
from ..core.records import Failure, Registration, Verdict, decode, encode
from ..hangs import diagnose, merged
from ..hangs.collectives import imported, torch_loaded
from ..proc import identity
from ..rundir.rundir import EVENTS, RANKS, REMOTE_STALLS_FILE, STALL_FILE, VERDICT_FILE, RunDir, rank_file
from .election import Election, UpFlag, connected_elsewhere
from .hosts import (
    CONNECT_BACKOFF_MAX_S,
    JOIN_TIMEOUTS,
    MAX_HOSTS,
    REMOTE_SETTLE_S,
    Absence,
    Digest,
    DigestWatch,
    HostInfo,
    Liveness,
    aggregate_term,
    beat_value,
    bounded,
    connect_allowance_s,
    first_spread_s,
    host_ident,
    hosts_missing,
    hosts_to_declare_lost,
    interval_deadline_s,
    lost_host_failure,
    lost_store_failure,
    may_be_echo,
    missing_hosts_failure,
    next_backoff_s,
    op_timeout_s,
    report_store_lost,
    settle_deadline,
    stalled_for_digest,
    store_silent_for,
    takeover_ns,
    unannounced_ranks,
)
from .store_client import StoreClient, connect
from .store_protocol import (
    NO_SEAL,
    VERDICT_TRIES,
    Exchange,
    Seal,
    Seen,
    VerdictFrom,
    acceptable_verdict,
    establish_nonce,
    exchange,
    poll_verdict,
    publish_digest,
    publish_verdict,
    read_host,
    read_hosts,
    say_ending,
    send_beat,
    straggle_exchange,
    verdict_key,
)
from .stragglerwatch import StraggleRelay

logger = logging.getLogger("peerwatch")

STATE_FILE = "bridge.json"  # what the bridge sees, for people and tests: written, never read back
NONCE_FILE = "store-nonce"  # the run's nonce in the store (with a store secret), for a successor bridge
VERDICT_FROM_FILE = "store-verdict-from"  # the first verdict key this host may obey, for a successor bridge
WAIT_CHUNK_S = 3600.0  # the verdict waiter's blocking wait, renewed (a timeout logs in torch's C++)
PUBLISH_BUDGET_S = 1.0  # the teardown never waits longer than this for the store...
# ... plus this where it takes the bridge over (its holder died) and must connect first: a
# new TCPStore connection took over a second on a loaded 2-core host, and a verdict not
# published before peer_timeout makes the other hosts call this one lost, not its rank dead.
TAKEOVER_CONNECT_S = 1.0
STOP_BUDGET_S = 1.0  # stop() joins the bridge's threads for at most this long
GATE_POLL_S = 1.0  # how often the waiter, waiting for the beat thread's gate, looks at stopped
TORCH_POLL_S = 0.1  # how often the beat thread looks whether the application's import of torch has finished
# A stall whose plainly stuck ranks are on at most this many hosts is refreshed every quarter
# of the stuck threshold (_Stalls._nameable): the merge every host then reads keeps them whole.
FAST_STUCK_HOSTS = 4
STALL_FRESH_BEATS = 3  # RUN/stall.json older than this many heartbeats (+1 s): the judges stopped writing it


@dataclasses.dataclass(frozen=True)
class _Link:
    """What the bridge's threads share: fixed before they start, written by none."""

    config: Config
    run_dir: RunDir
    facts: LauncherFacts  # ready: names a store and a run id
    client: StoreClient
    stopped: threading.Event
    seal: Seal = NO_SEAL  # signs and checks what goes through the store (a no-op without a store secret)
    # The verdict keys that held a value when this host first looked are not this run's.
    verdict_from: VerdictFrom = dataclasses.field(default_factory=VerdictFrom)

    @property
    def op_timeout_s(self) -> float:
        return op_timeout_s(self.config.peer_timeout)

    @property
    def prefix(self) -> str:
        return self.facts.key_prefix

    @property
    def address(self) -> str:
        return self.facts.address


class _BeatSeq:
    """A beat's sequence number: strictly increasing, and across the successive bridges of
    one host too (the other hosts take only a higher one for a beat, docs/security.md), as
    it follows the host's monotonic clock (CLOCK_MONOTONIC is one for all processes of a
    boot, and a host's index is per boot). Any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = 0

    def __call__(self) -> int:
        with self._lock:
            self._last = max(self._last + 1, time.monotonic_ns() // 1000)  # microseconds
            return self._last


class _Kept:
    """What this host settled with the store once, kept in the run directory (first writer
    wins) for its successor bridges, whatever the store holds by then: the run's store
    nonce (a successor signs and checks with the one this host adopted), the first verdict
    key it may obey."""

    def __init__(self, run_dir: RunDir, name: str) -> None:
        self.run_dir, self.name = run_dir, name

    def load(self) -> Optional[bytes]:
        return self.run_dir.read_bytes("", self.name, limit=256)

    def save(self, value: bytes) -> None:
        self.run_dir.write_or_log(self.name, value, replace=False)  # not written: a successor settles it again


class _TorchGate:
    """Whether torch.distributed can serve a store here. It is never imported by peerwatch:
    the beat thread waits until the application's own import has finished (the bridge
    starts only then, :meth:`Bridge.tick`; this holds for any other caller too) and owns
    ``usable``; the waiter thread touches the store only after it decided."""

    def __init__(self) -> None:
        self._decided = threading.Event()
        self.usable = False  # torch.distributed is imported and has a store

    def open(self, stopped: threading.Event, loud: bool) -> bool:
        """The beat thread's: True once torch.distributed is imported and can serve a store;
        False if ``stopped`` first, or if it cannot (logged, at WARNING if ``loud``)."""
        try:
            while not torch_loaded():
                if stopped.wait(TORCH_POLL_S):
                    return False
            dist = imported("torch.distributed")
            if dist is None or not dist.is_available():
                logger.log(logging.WARNING if loud else logging.INFO, "peerwatch: no store bridge (this torch "
                           "has no torch.distributed); failures on other hosts will not reach this one")
                return False
            self.usable = True
            return True
        finally:
            self._decided.set()

    def wait(self, stopped: threading.Event) -> bool:
        """The waiter thread's: block until the beat thread decided; False: stopped, or unusable."""
        while not self._decided.wait(GATE_POLL_S):
            if stopped.is_set():
                return False
        return self.usable


class _Stalls:
    """The hang diagnosis across hosts, for the beat thread (which owns every field): this
    host's stall as its hang judges last wrote it (``RUN/stall.json``), which interval
    publishes it and reads the other hosts' (:meth:`plan`), and the other hosts' stalls,
    each one's last move turned into this host's clock once per stall, handed to the judges
    in ``RUN/stalls-remote.json`` (:meth:`take`). The aggregator reads every standing-still
    host's summary and merges them (:meth:`merged`: ``diag/all``); any other host reads
    that merge."""

    def __init__(self, run_dir: RunDir, interval_s: float) -> None:
        self.run_dir, self.interval_s = run_dir, interval_s
        self._token: Optional[str] = None  # our stall as last published, and when
        self._published_ns = 0
        self._read_ns = 0  # the others' last read then
        self.stalled: Tuple[int, ...] = ()  # the other hosts that stand still, as the beat thread last read
        # Key (a host's index, or "crowd" for a merge's) -> (its stall, its last move on our clock).
        self.remote: Dict[str, Tuple[diagnose.Summary, int]] = {}
        self.covered: Set[int] = set()  # the hosts whose stall the last reads hold (for a merge: all it merged)
        self._merge = False  # the last read was a merge (diag/all): kept whole until the next
        self.laggards: Set[int] = set()  # hosts whose summary has ranks not waiting in a collective (ours too)
        self._stuck: Set[str] = set()  # keys whose summary holds a plainly stuck rank (Summary.stuck)
        self._file = False  # RUN/stalls-remote.json names hosts
        self.mine: Optional[diagnose.Summary] = None  # our stall as last published (the aggregator merges it)
        self._merged: Optional[bytes] = None  # the merge as last published (the aggregator's)
        self._changed = False  # the stalls held (or ours) changed since the last merge

    def local(self) -> Optional[diagnose.Summary]:
        """This host's stall, as its hang judges last wrote it (None: its ranks move)."""
        if not self.run_dir.recent(STALL_FILE, int((STALL_FRESH_BEATS * self.interval_s + 1.0) * 1e9)):
            return None
        data = self.run_dir.read_bytes("", STALL_FILE, limit=diagnose.MAX_SUMMARY_BYTES)
        return diagnose.Summary.from_json(data) if data else None

    def public(self, stall: Optional[diagnose.Summary]) -> bool:
        """Our summary goes to the store (and our beat says ``s``): by its own right
        (:meth:`~peerwatch.hangs.diagnose.Summary.public`), or because another host's, read
        while we stand still, holds a plainly stuck rank: its judges need ours to name it too."""
        return stall is not None and (stall.public() or bool(self._stuck))

    def plan(self, stall: Optional[diagnose.Summary], public: bool, now_ns: int) -> Tuple[bool, bool]:
        """Publish our summary, read the others'? A new stall at once, then at most every
        refresh; the others' also as soon as another host starts to stand still.

        ``public``: our summary is published (from half the threshold; or from the stuck one
        where it holds a plainly stuck rank, or another host's does: then every host standing
        still publishes, so that each one's judges see the others). Before that it is our
        judges' alone: the others' are read once per host that starts to stand still, and
        every refresh only while one of them holds a plainly stuck rank. A summary holding a
        plainly stuck rank is published, and read, every quarter of the stuck threshold
        (``diagnose.refresh_ns``) while the stall is one it can name (:meth:`_nameable`):
        its news must reach every host younger than that."""
        if stall is None:
            return False, False
        interval_ns = int(self.interval_s * 1e9)
        fast = self._nameable(stall)
        publish_every = diagnose.refresh_ns(stall.threshold_ms, interval_ns, stuck=fast and stall.stuck)
        publish = public and (stall.stall != self._token or now_ns - self._published_ns >= publish_every)
        new = set(self.stalled) - self.covered
        read_every = diagnose.refresh_ns(stall.threshold_ms, interval_ns, stuck=fast and bool(self._stuck))
        due = now_ns - self._read_ns >= read_every and (public or bool(self._stuck))
        return publish, due or bool(new)

    def _nameable(self, stall: diagnose.Summary) -> bool:
        """The stall looks like a hang the stuck threshold names (a plainly stuck rank, a few
        hosts' at most, and ranks waiting inside a collective): its news is refreshed sooner.
        Not a stall in which every rank sleeps outside collectives (nobody is named), nor one
        with many stuck hosts (the merge every host reads would be large)."""
        stuck = len(self._stuck) + stall.stuck
        return 0 < stuck <= FAST_STUCK_HOSTS and (
            bool(stall.waiting) or any(s.waiting for s, _ in self.remote.values()))

    def take(self, stall: Optional[diagnose.Summary], published: bool, seen: Seen, read: bool, now_ns: int) -> None:
        """After an interval that published our ``stall`` (or not) and read the others'
        (``read``; the aggregator also reads at once the hosts that start to stand still):
        keep the other hosts' stalls and hand them to the judges."""
        if published and stall is not None:
            self._token, self._published_ns, self.mine = stall.stall, now_ns, stall
        before = dict(self.remote)
        still = set(seen.stalled) if stall is not None else set()
        merge = merged.Merged.from_json(seen.merged) if seen.merged is not None else None
        if merge is not None:  # a merge replaces every stall read before
            found = dict(merge.summaries(seen.index))
            self.remote, self.covered, self._merge = {}, set(merge.of), True
        else:
            found = {str(j): s for j, s in ((j, diagnose.Summary.from_json(d) if d else None) for j, d in seen.stalls.items())
                     if s is not None and j in still}
            if self._merge and (found or not still):  # a merge stands while anyone stands still, or until we aggregate
                self.remote, self._merge = {}, False
            if not self._merge:
                self.remote = {k: v for k, v in self.remote.items() if int(k) in still}
                self.covered = {int(k) for k in self.remote} | {int(k) for k in found}
        self.laggards &= still
        self._stuck = {k for k in self._stuck if k in self.remote or k in found}
        for key, summary in found.items():
            if key.isdigit():
                (self.laggards.add if summary.detailed else self.laggards.discard)(int(key))
            (self._stuck.add if summary.stuck else self._stuck.discard)(key)
            old = self.remote.get(key) or before.get(key)
            moved = old[1] if old is not None and old[0].stall == summary.stall else now_ns - summary.age_ms * 1_000_000
            self.remote[key] = (summary, moved)
        read = read or bool(found) or merge is not None
        if read:
            self._read_ns = now_ns
        changed = read or self.remote.keys() != before.keys()
        self._changed = self._changed or changed or published
        if not (changed or (self._file and not self.remote)):
            return
        body = {"hosts": [[moved, s.to_json().decode("utf-8", "replace")] for s, moved in self.remote.values()]}
        if self.run_dir.write_or_log(REMOTE_STALLS_FILE, json.dumps(body).encode()):  # else: the judges see ours only
            self._file = bool(self.remote)

    def merged(self, me: int, stalled: bool, named: Tuple[int, ...]) -> Optional[bytes]:
        """The aggregator's merge of every stall it holds and ours (``stalled``: ours is
        public), for ``diag/all``: None while it has not changed since it was last published.
        ``named``: the hosts standing still that the digest names."""
        if not self._changed:
            return None
        self._changed = False
        stalls = {int(k): s for k, (s, _) in self.remote.items() if k.isdigit()}
        if stalled and self.mine is not None:
            stalls[me] = self.mine
        data = merged.merge(stalls, frozenset(named)).to_json()
        if data == self._merged:
            return None
        self._merged = data
        return data


class _Absentees:
    """Hosts the launcher announced that never joined (no beat of theirs read), for the beat
    thread (which owns every field): not silence but an error, said once from peer_timeout
    on, and a ``lost`` record after ``JOIN_TIMEOUTS`` of them, unless every rank of the job is
    announced by a host that joined (the launcher's count was too high) or the job is
    ending or judged."""

    def __init__(self, link: _Link, verdict_known: Callable[[], bool]) -> None:
        self.link = link
        self._verdict_known = verdict_known
        self._absence = Absence(int(link.config.peer_timeout * 1e9))
        self._said = False  # their absence logged (an error), once
        self._settled = False  # judged: lost, or the launcher's count was too high

    def judge(self, counted: int, hosts: Dict[int, HostInfo], ending: bool, joined: Callable[[], List[int]]) -> None:
        """One look, ``counted`` hosts known to have joined (us included); ``hosts``: the
        records known (grown here by those read again), ``joined``: the hosts' indices."""
        expected = self.link.facts.expected_hosts
        if expected is None or self._settled:
            return
        now_ns = time.monotonic_ns()
        missing = hosts_missing(expected, counted - 1)
        self._absence.observe(now_ns, missing)
        waited_s, peer_timeout = self._absence.waited_s(now_ns), self.link.config.peer_timeout
        if waited_s < peer_timeout or ending or self._verdict_known():
            return
        if waited_s < JOIN_TIMEOUTS * peer_timeout:
            if not self._said:
                self._said = True
                logger.error("peerwatch: %d of the %d hosts the launcher announced have not joined through the "
                             "store at %s in %.0fs; they are judged lost after %.0fs", missing, expected,
                             self.link.address, waited_s, JOIN_TIMEOUTS * peer_timeout)
            return
        self._settled = True
        if self._all_ranks_announced(hosts, joined()):
            logger.info("peerwatch: every rank is on a host that joined: the job has fewer hosts than the %d the "
                        "launcher's variables imply", expected)
            return
        _write_failure(self.link.run_dir, missing_hosts_failure(missing, expected, waited_s, hosts,
                                                               self.link.config, time.time_ns()))

    def _all_ranks_announced(self, hosts: Dict[int, HostInfo], joined: List[int]) -> bool:
        """Read the joined hosts' ``host/<j>`` again (their ranks may have grown since): does
        every rank of the job belong to one?"""
        link = self.link
        try:
            fresh, _ = link.client.call(functools.partial(read_hosts, prefix=link.prefix, indices=joined,
                                                          seal=link.seal), link.op_timeout_s)
        except Exception as e:  # noqa: BLE001
            logger.debug("peerwatch: the hosts' records cannot be read again (%s); naming the ranks known", e)
            fresh = {}
        hosts.update({j: h for j, h in fresh.items() if h.ranks})
        return bool(link.config.world_size) and not unannounced_ranks(hosts, link.config.world_size)


class _BeatLoop:
    """The beat thread: once per heartbeat, this host's beat and the digest, or, on the
    aggregator, every host's beat (one bounded :func:`.store_protocol.exchange`) and the
    digest published; the judgement of hosts that fell silent, and of the store itself.
    Every field is the beat thread's (others only read ``index``, ``hosts``, ``term``, ``last_digest``,
    ``liveness``, ``job_ending``, ``connected``, ``counted`` and ``requests``)."""

    def __init__(self, link: _Link, me: Registration, ident: str, seq: Callable[[], int], succeeded: threading.Event,
                 verdict_known: Callable[[], bool], gate: _TorchGate) -> None:
        self.link, self.me, self.ident = link, me, ident
        self._seq = seq  # the beat's sequence number, shared with on_success (drawn atomically)
        self._succeeded = succeeded  # set by the main thread: this rank finished cleanly
        self._verdict_known = verdict_known
        self._gate = gate
        self.index: Optional[int] = None
        self.hosts: Dict[int, HostInfo] = {}
        self.liveness = Liveness(int(link.config.peer_timeout * 1e9), look_ns=int(link.config.heartbeat_interval * 1e9))
        self._absentees = _Absentees(link, verdict_known)  # announced hosts that never joined
        self.job_ending = False
        # The store has answered, and has not been silent for peer_timeout since: one slow
        # or failed interval (a loaded host) is no sign that the other hosts cannot reach us,
        # so an exception here is still held back as a possible echo, and a verdict published.
        self.connected = False
        self.answered = threading.Event()  # the store answered once: a loop that has not yet is connecting
        self.requests = 0  # store requests made so far (for the load test)
        self._lost_reported: Set[int] = set()
        self._store_lost_reported = False
        self._ranks: Tuple[int, ...] = ()  # the local ranks announced in host/<index>
        self._ranks_mtime: Optional[int] = None
        self._state: Dict[str, Any] = {}  # the last bridge.json written
        self._up = UpFlag(link.run_dir)
        self._stalls = _Stalls(link.run_dir, link.config.heartbeat_interval)  # the hang diagnosis across hosts
        self._relay = StraggleRelay(link.run_dir, link.config.heartbeat_interval) if link.config.stragglers else None
        # The digest (docs/multi-node.md): one host, the aggregator, reads every beat and
        # publishes one key; every other host reads that key alone.
        self.term: Optional[int] = None  # we aggregate under this term (None: we read the digest)
        self.digest: Optional[Digest] = None  # the digest as last read
        self.last_digest: Optional[Digest] = None  # the digest we last published (for on_success's done)
        self._digest_known = False  # the key is there: read without a check first
        self._merged_known = False  # diag/all is there: read without a check first
        self._watch = DigestWatch(int(link.config.peer_timeout * 1e9))
        self._takeover_ns = takeover_ns(link.config.peer_timeout, link.config.heartbeat_interval)
        self._writer: Optional[int] = None  # the digest's writer, judged here by its digest while we read
        self.joined = 1  # hosts whose beat was read (here, or by the aggregator: the digest), us included
        self._registered = 0  # the hosts counter, as read while not aggregating and hosts were missing
        self._count = 0  # the hosts counter, as last read here or in the digest

    @property
    def counted(self) -> int:
        """Hosts known to have joined, us included. The aggregator counts those whose beat it
        read (a host that took an index and never beat is still missing there, and judged);
        every other host also those that took an index (the ``hosts`` counter): who joined is
        never left to the aggregator's pace (starved, or reading new hosts ``READ_BATCH`` at a
        time), so no host counts another missing because the aggregator is slow."""
        return self.joined if self.term is not None else max(self.joined, self._registered)

    def run(self) -> None:
        """The beat thread's body."""
        if not self._gate.open(self.link.stopped, loud=self.link.config.store is not None):
            return
        try:
            self._loop()
        finally:
            self._up.set(False)

    def _loop(self) -> None:
        """One interval's store work per heartbeat, each bounded (:mod:`.store_client`);
        after a failure, back off, and judge the store lost after peer_timeout."""
        interval, peer_timeout = self.link.config.heartbeat_interval, self.link.config.peer_timeout
        stopped = self.link.stopped
        backoff = interval
        last_ok: Optional[float] = None
        # Many hosts start at once (a job of a thousand hosts registers in the same second):
        # each one's first request comes at a random point of a spread that grows with them.
        if stopped.wait(random.uniform(0.0, first_spread_s(interval, self.link.facts.expected_hosts))):
            return
        while not stopped.is_set():
            started = time.monotonic()
            try:
                self._interval()
            except Exception as e:  # noqa: BLE001 - the store's errors are many (DistError, OSError, ...)
                if stopped.is_set():
                    break
                self._unreachable(e, last_ok)
                if stopped.wait(backoff * random.uniform(0.75, 1.0)):  # retries spread too
                    break
                backoff = next_backoff_s(backoff, interval, peer_timeout)
                continue
            last_ok, backoff = time.monotonic(), interval
            stopped.wait(max(0.0, interval - (time.monotonic() - started)))

    def _interval(self) -> None:
        if not self.job_ending and (self._succeeded.is_set() or self._local_success()):
            self.job_ending = True
        me = self._host_to_announce()
        link = self.link
        stall = self._stalls.local()
        public = self._stalls.public(stall)
        now_ns = time.monotonic_ns()
        publish, read = self._stalls.plan(stall, public, now_ns)
        aggregating = self.term is not None
        plan = Exchange(link.prefix, self.index, self.ident,
                        beat_value(self._seq(), self.job_ending, stalled=public and self.index is not None),
                        me, dict(self.hosts), link.facts.expected_hosts, link.seal,
                        stall=stall.to_json() if stall is not None and publish else None, read_stalls=read,
                        covered=frozenset(self._stalls.covered), merged_known=self._merged_known,
                        verdict_from=link.verdict_from, aggregate=aggregating, digest_known=self._digest_known,
                        count_hosts=not aggregating and hosts_missing(link.facts.expected_hosts, self.counted - 1) > 0)
        peer_timeout = link.config.peer_timeout
        seen = link.client.call(functools.partial(exchange, x=plan), interval_deadline_s(peer_timeout),
                                connect_allowance_s(peer_timeout))
        self._learn(seen, me)
        self._digest_known = self._digest_known or seen.digest_there
        self._merged_known = self._merged_known or seen.merged_there
        self._stalls.stalled = seen.stalled
        self._count = min(max(self._count, seen.count, seen.digest.count if seen.digest else 0), MAX_HOSTS)
        if not aggregating:  # a host that took an index has joined, read by the aggregator yet or not
            self._registered = max(self._registered, min(seen.count, MAX_HOSTS))
        seen_ns = time.monotonic_ns()
        self.job_ending = self.job_ending or seen.ending
        self._watch.observe(seen_ns, seen.digest)
        if aggregating:
            self._judge(seen.beats)
        else:
            self._judge_digest(seen.digest, seen_ns)
        self._stalls.take(stall, plan.stall is not None, seen, read, now_ns)
        self._role(seen, plan.beat, stall if public else None, seen_ns)
        if self.index is not None:  # the hosts that joined: those judged here, or all below the counter
            self._absentees.judge(self.counted, self.hosts, self.job_ending, lambda: sorted(self.liveness.changed_ns)
                                  if self.term is not None else list(range(self._count)))
        self.connected = True
        self.answered.set()
        self._up.set(True)
        self._write_state(connected=True)
        self._stragglers()

    def _stragglers(self) -> None:
        """Once a slot: this host's waits out, the others' in (host 0), the finding across."""
        link = self.link
        hosts = set(self.hosts) | set(range(self._count))  # a host that reads the digest knows the count only
        plan = self._relay.plan(link.prefix, self.index, hosts, link.seal) if self._relay is not None else None
        if plan is None or self._relay is None:
            return
        peer_timeout = link.config.peer_timeout
        profiles, found, requests = link.client.call(functools.partial(straggle_exchange, x=plan),
                                                     interval_deadline_s(peer_timeout), connect_allowance_s(peer_timeout))
        self.requests += requests
        self._relay.take(plan, profiles, found)

    def _host_to_announce(self) -> Optional[HostInfo]:
        """Our host/<i>, when it is to be (re)written: first, and when the local ranks changed."""
        run_dir = self.link.run_dir
        try:
            mtime: Optional[int] = run_dir.stat(RANKS).st_mtime_ns
        except OSError:
            mtime = None
        if self.index is not None and mtime == self._ranks_mtime:
            return None
        self._ranks_mtime = mtime
        ranks = identity.local_ranks(run_dir.registrations())
        if self.index is not None and ranks == self._ranks:
            return None
        return dataclasses.replace(self._me_info(), ranks=ranks)

    def _learn(self, seen: Seen, me: Optional[HostInfo]) -> None:
        self.requests += seen.requests
        if seen.digest is not None:
            self.digest = seen.digest
        if seen.registered:
            self.index = seen.index
            logger.info("peerwatch: rank %d bridges host %s (index %s) to the store at %s (run %s)",
                        self.me.rank, identity.hostname(), self.index, self.link.address, self.link.facts.run_id)
        if me is not None:
            self._ranks = me.ranks
            self.hosts[seen.index] = dataclasses.replace(me, index=seen.index)
        self.hosts.update(seen.new_hosts)

    def _judge(self, beats: Mapping[int, Optional[bytes]]) -> None:
        """The aggregator's: every host's beat, judged here."""
        if not beats:
            return
        now_ns = time.monotonic_ns()
        self.liveness.observe(now_ns, beats)
        self.joined = max(self.joined, len(self.liveness.changed_ns) + 1)
        if self.liveness.done:
            self.job_ending = True
        for j in hosts_to_declare_lost(self.liveness, now_ns, self._lost_reported, self.job_ending,
                                       self._verdict_known()):
            self._host_lost(j, self.liveness.silent_ns(j, now_ns) / 1e9)

    def _judge_digest(self, digest: Optional[Digest], now_ns: int) -> None:
        """Any other host's: the aggregator's judgement of every host, and our own of the
        aggregator (its digest is its beat: a silent one is a lost host like any other)."""
        if digest is None or digest.by == self.index:
            self.liveness.observe(now_ns, {})  # a look all the same (our own gaps are not counted)
            return
        if self._writer is not None and self._writer != digest.by:
            self.liveness.forget(self._writer)  # its successor judges it now, by its beat
        self._writer = digest.by
        self.liveness.observe(now_ns, {digest.by: digest.beat})
        if digest.ending or self.liveness.done:
            self.job_ending = True
        self.joined = max(self.joined, digest.joined)
        if self.job_ending or self._verdict_known():
            return
        if digest.by in self.liveness.lost(now_ns, exclude=self._lost_reported):
            self._host_lost(digest.by, self.liveness.silent_ns(digest.by, now_ns) / 1e9)
        for j in digest.lost:
            if j != self.index and j not in self._lost_reported:
                self._host_lost(j, self.link.config.peer_timeout)

    def _role(self, seen: Seen, beat: bytes, stall: Optional[diagnose.Summary], now_ns: int) -> None:
        """Aggregate or read, from the next heartbeat on (:func:`.hosts.aggregate_term`);
        the aggregator publishes its digest now."""
        term = aggregate_term(seen.index, seen.digest, self.term, self._watch.silent_ns(now_ns), self._takeover_ns)
        if term is not None and self.term is None:
            logger.info("peerwatch: host %s (index %d) aggregates the beats of every host (term %d)%s",
                        identity.hostname(), seen.index, term,
                        "" if seen.digest is None else f", after host {seen.digest.by}")
        elif term is None and self.term is not None:
            by = seen.digest.by if seen.digest is not None else None
            logger.info("peerwatch: host %s (index %d) no longer aggregates: host %s does", identity.hostname(),
                        seen.index, by)
            for j in list(self.liveness.changed_ns):  # the aggregator judges them now
                if j != by:
                    self.liveness.forget(j)
            self._writer = by
        was, self.term = self.term, term
        if was is None or term is None:
            return
        lost, more = bounded(self.liveness.lost(now_ns))
        # Past MAX_DIGEST_LIST hosts standing still, the digest names the laggard candidates first.
        mine = [seen.index] if stall is not None else []
        stalls = stalled_for_digest(list(seen.stalled) + mine,
                                    self._stalls.laggards | (set(mine) if stall is not None and stall.detailed else set()))
        rank0 = next((j for j, h in self.hosts.items() if 0 in h.ranks), None)
        digest = Digest(seen.index, term, beat, self._count, self.joined, lost, stalls, self.job_ending, rank0, more)
        # Every stall we hold, merged for the hosts that read the digest (diag/all), where it changed.
        merge = self._stalls.merged(seen.index, stall is not None, stalls) if stalls else None
        link = self.link
        link.client.call(functools.partial(publish_digest, prefix=link.prefix, digest=digest, seal=link.seal,
                                           merged=merge), interval_deadline_s(link.config.peer_timeout))
        self.last_digest = digest
        self.requests += 1 + (merge is not None)

    def _unreachable(self, error: Exception, last_ok: Optional[float]) -> None:
        logger.debug("peerwatch: store %s: %r", self.link.address, error)
        self._ranks_mtime = None  # announce our ranks again once it answers, whatever failed
        silent_s = store_silent_for(last_ok, time.monotonic(), self.link.config.peer_timeout)
        if silent_s is None:
            self._write_state(connected=self.connected)  # a slow or failed interval: not yet lost
            return
        self.connected = False
        self._up.set(False)
        self._write_state(connected=False)
        self._store_lost(silent_s)

    def _me_info(self) -> HostInfo:
        return HostInfo(self.index if self.index is not None else -1, identity.hostname(), identity.boot_id(),
                        identity.pid_namespace(), self._ranks, self.ident)

    def _local_success(self) -> bool:
        return any(kind == "success" for kind, _, _ in self.link.run_dir.entries(EVENTS))

    def _host_lost(self, j: int, silent_s: float) -> None:
        self._lost_reported.add(j)
        info = self.hosts.get(j) or HostInfo(j, f"host {j}")
        link = self.link
        try:  # its ranks may have registered after we first read host/<j>
            info = link.client.call(functools.partial(read_host, prefix=link.prefix, index=j, seal=link.seal),
                                    link.op_timeout_s)
        except Exception as e:  # noqa: BLE001
            logger.debug("peerwatch: host/%d cannot be read again (%s); naming the ranks known", j, e)
        _write_failure(link.run_dir, lost_host_failure(info, silent_s, link.config, time.time_ns()))

    def _store_lost(self, silent_s: float) -> None:
        ending = self.job_ending or self._succeeded.is_set() or self._local_success()
        if not report_store_lost(self._store_lost_reported, ending, self._verdict_known()):
            return
        self._store_lost_reported = True
        link = self.link
        _write_failure(link.run_dir, lost_store_failure(link.address, self.hosts, self._me_info(), silent_s,
                                                        link.config, time.time_ns()))

    def _write_state(self, connected: bool) -> None:
        """``bridge.json``, for people and tests: nothing reads it back."""
        link = self.link
        state = {
            "rank": self.me.rank, "pid": os.getpid(), "store": link.address, "run_id": link.facts.run_id,
            "connected": connected, "index": self.index, "ranks": list(self._ranks),
            "hosts": {str(j): h.hostname for j, h in sorted(self.hosts.items())},
            "lost": sorted(self._lost_reported), "job_ending": self.job_ending, "joined": self.counted,
            "aggregator": self.index if self.term is not None else (self.digest.by if self.digest else None),
            # rank 0's host, once known here (a lost store is blamed on it; the digest names it)
            "rank0": next((h.hostname for h in self.hosts.values() if 0 in h.ranks), None),
        }
        if state == self._state:
            return
        self._state = state
        link.run_dir.write_or_log(STATE_FILE, json.dumps(state).encode())  # for people only: not written, no harm


class _VerdictWaiter:
    """The waiter thread: blocks in the store's ``wait`` on the verdict key, on a connection
    of its own (or, for a store that cannot ``clone()``, looks once a heartbeat through the
    client), and writes the verdict it finds into the local run directory. Every field is
    the waiter thread's (others only read ``from_store``, ``waiting`` and ``requests``)."""

    def __init__(self, link: _Link, gate: _TorchGate, deliver: Optional[Callable[[bytes], None]] = None) -> None:
        self.link = link
        self._gate = gate
        self._deliver = deliver if deliver is not None else self.take  # what the store held goes there
        self.from_store: Optional[bytes] = None  # the verdict we took from the store
        self.requests = 0  # verdict polls made (for the load test)
        self.waiting = False  # blocked in the store's wait (which nothing can interrupt)

    def run(self) -> None:
        """The waiter thread's body."""
        link = self.link
        if not self._gate.wait(link.stopped):
            return
        backoff = link.config.heartbeat_interval
        conn: Any = None
        attempt = 0
        while not link.stopped.is_set() and self.from_store is None:
            try:
                if conn is None:
                    conn = self._connection()
                    if conn is None:
                        return self._poll()
                establish_nonce(conn, link.prefix, link.seal)
                attempt = max(attempt, link.verdict_from.settle(conn, link.prefix, link.seal))
                if attempt >= VERDICT_TRIES:
                    return self._no_key_left()
                key = verdict_key(link.prefix, link.seal, attempt)
                self.waiting = True
                try:
                    conn.wait([key], datetime.timedelta(seconds=WAIT_CHUNK_S))
                finally:
                    self.waiting = False
                data = acceptable_verdict(link.seal, key, conn.get(key))
                if data is None:
                    # Refused (forged, another run's, not a verdict; warned): a host of the
                    # job that finds it there publishes under the next key; wait there.
                    attempt += 1
                    continue
                self._deliver(data)
                return
            except ImportError:
                return
            except Exception as e:  # noqa: BLE001
                logger.debug("peerwatch: waiting on the store %s: %s", link.address, e)
                conn = None
                if link.stopped.wait(backoff):
                    return
                backoff = min(backoff * 2, CONNECT_BACKOFF_MAX_S)

    def _no_key_left(self) -> None:
        logger.error("peerwatch: every verdict key in the store %s holds a value this run may not obey; a failure "
                     "on another host reaches this one only when that host falls silent (peer_timeout)",
                     self.link.address)

    def _connection(self) -> Any:
        """The waiter's own connection (its thread's alone), or None: the user's store cannot clone()."""
        store = self.link.facts.store
        if isinstance(store, str):
            return connect(store, self.link.op_timeout_s)
        clone = getattr(store, "clone", None)
        return clone() if clone is not None else None

    def _poll(self) -> None:
        """A store that cannot be waited on: look for the verdict once a heartbeat, through
        the client's owner thread."""
        link = self.link
        look = functools.partial(poll_verdict, prefix=link.prefix, seal=link.seal, verdict_from=link.verdict_from)
        while not link.stopped.wait(link.config.heartbeat_interval):
            try:
                data = link.client.call(look, link.op_timeout_s)
            except Exception as e:  # noqa: BLE001 - the beat thread judges the store's silence
                logger.debug("peerwatch: looking for a verdict in the store %s: %s", link.address, e)
                continue
            self.requests += 1
            if data is not None:
                self._deliver(data)
                return

    def take(self, data: bytes) -> None:
        """The waiter thread's: the verdict the store holds, written into the local run directory."""
        verdict = decode(Verdict, data)
        if verdict is None:
            logger.error("peerwatch: the store holds a verdict for run %s that is not a valid record; ignored",
                         self.link.facts.run_id)
            return
        self.from_store = data
        run_dir = self.link.run_dir
        # Stamped again on this host's CLOCK_BOOTTIME: the maker's means nothing here.
        local = encode(dataclasses.replace(verdict, boot_ns=identity.boot_clock_ns()))
        try:
            written = run_dir.write(EVENTS, VERDICT_FILE, local, valid=lambda d: decode(Verdict, d) is not None)
        except OSError as e:
            logger.error("peerwatch: the verdict from another host cannot be written into %s: %s", run_dir.path, e)
            return
        if written:
            failed = terminal.who(verdict.rank, verdict.pid, verdict.host)
            if verdict.pid is None and verdict.host:
                failed += f" (on {verdict.host})"
            logger.error("peerwatch: verdict from another host: %s %s; cause: %s. Tearing down the ranks "
                         "of host %s.", failed, verdict.detail, verdict.cause, identity.hostname())


class Bridge:
    """This rank's part in the exchange between hosts. Every rank has one; only the rank
    that wins the election runs its threads. The watcher calls :meth:`tick` every
    heartbeat, :meth:`on_verdict` when it acts on a verdict, :meth:`hold_until` before it
    acts on one; the main thread calls :meth:`on_success` when its rank finished cleanly.

    Its fields are the watcher thread's, but ``_succeeded`` (the main thread's) and
    ``stopped`` (any thread's); what the loops own it only reads, through the properties."""

    hold_s = REMOTE_SETTLE_S  # the longest hold_until() gives, in seconds

    def __init__(self, config: Config, run_dir: RunDir, me: Registration, facts: LauncherFacts) -> None:
        self.config, self.run_dir, self.me, self.facts = config, run_dir, me, facts
        self.ident = host_ident(identity.boot_id(), identity.pid_namespace(), run_dir.path)
        self.stopped = threading.Event()
        self._seq = _BeatSeq()  # any thread: a beat's sequence number
        self._succeeded = threading.Event()  # the main thread's
        self._done_sent = False  # the main thread's: on_success() sent (or tried to send) the done beat
        self._created = time.monotonic()
        self._unresolved_warned = False
        self._torch_warned = False
        self._election = Election(run_dir)
        self.running = False
        self.published = False
        self._client: Optional[StoreClient] = None
        self._life = threading.Lock()  # orders starting threads against stop()
        self._threads: List[threading.Thread] = []
        self.left_in_store: List[str] = []  # set by stop(): the threads still inside a store request
        self._beat: Optional[_BeatLoop] = None
        self._waiter: Optional[_VerdictWaiter] = None
        self._wait_thread: Optional[threading.Thread] = None
        self._settle: Dict[Tuple[int, int], float] = {}
        self._seal = Seal(config.store_secret, memo=_Kept(run_dir, NONCE_FILE))
        self._verdict_from = VerdictFrom(memo=_Kept(run_dir, VERDICT_FROM_FILE))

    @classmethod
    def for_config(
        cls, config: Config, run_dir: RunDir, me: Registration, env: Optional[Mapping[str, str]] = None,
        facts: Optional[LauncherFacts] = None,
    ) -> Optional[Bridge]:
        """A bridge if the job spans hosts (or a store is set); its store and run id may
        still be unknown (resolved again at each heartbeat). None: no bridge needed."""
        facts = LauncherFacts.resolve(config, env) if facts is None else facts
        return cls(config, run_dir, me, facts) if facts.wants_store else None

    @property
    def address(self) -> str:
        return self.facts.address

    @property
    def prefix(self) -> str:
        return self.facts.key_prefix

    # -- what the loops know (read only; empty before the threads start) -----------------

    @property
    def requests(self) -> int:
        """Store requests made so far for beats and verdict polls (for the load test)."""
        return (self._beat.requests if self._beat else 0) + (self._waiter.requests if self._waiter else 0)

    @property
    def index(self) -> Optional[int]:
        return self._beat.index if self._beat else None

    @property
    def joined(self) -> int:
        """Hosts known to have joined, this one included (:attr:`_BeatLoop.counted`)."""
        return self._beat.counted if self._beat else 0

    @property
    def aggregating(self) -> bool:
        """Does this host read every host's beat and publish the digest?"""
        return self._beat is not None and self._beat.term is not None

    @property
    def liveness(self) -> Optional[Liveness]:
        return self._beat.liveness if self._beat else None

    @property
    def job_ending(self) -> bool:
        return self._beat.job_ending if self._beat else False

    @property
    def connected(self) -> bool:
        return self._beat.connected if self._beat else False

    @property
    def from_store(self) -> Optional[bytes]:
        return self._waiter.from_store if self._waiter else None

    # -- called by the watcher ------------------------------------------------------------

    def tick(self) -> None:
        """Once per heartbeat: become this host's bridge if nobody is (the holder exited)."""
        if self.running or self.stopped.is_set():
            return
        if not self._resolve_late() or not self._torch_imported() or not self._election.take():
            return
        self.running = True
        link = _Link(self.config, self.run_dir, self.facts, self._store_client(), self.stopped, self._seal,
                     self._verdict_from)
        gate = _TorchGate()
        with self._life:
            if self.stopped.is_set():
                return
            self._beat = _BeatLoop(link, self.me, self.ident, self._seq, self._succeeded, self._verdict_known, gate)
            self._waiter = _VerdictWaiter(link, gate, self._take_store_verdict)
            for target, name in ((self._beat.run, "beat"), (self._waiter.run, "wait")):
                t = threading.Thread(target=_guarded(target, self.me.rank),
                                     name=f"peerwatch-bridge-{name}-rank{self.me.rank}", daemon=True)
                self._threads.append(t)
                t.start()
            self._wait_thread = self._threads[-1]

    def _resolve_late(self) -> bool:
        """Where the launcher sets MASTER_ADDR/MASTER_PORT after install() (Lightning under
        Slurm does, in the training script), look again each heartbeat; warn once if the
        store stays unknown for peer_timeout."""
        if self.facts.ready:
            return True
        facts = LauncherFacts.resolve(self.config, os.environ)
        if facts.ready:
            self.facts = facts
            return True
        if not self._unresolved_warned and time.monotonic() - self._created >= self.config.peer_timeout:
            self._unresolved_warned = True
            reason = facts.store_why if facts.store is None else "nothing names the job on every host (set PEERWATCH_RUN_ID)"
            logger.warning("peerwatch: rank %d: no store bridge yet: %s; a failure on another host will not "
                           "reach this one", self.me.rank, reason)
        return False

    def _torch_imported(self) -> bool:
        """Has the application imported torch.distributed (completely)? Until it has, no
        bridge: peerwatch never imports torch (the application's own import may be under
        way in the main thread). A job that uses a TCPStore imports it itself; where a store
        was named and it never does, say so once after peer_timeout, and go on waiting."""
        if torch_loaded():
            return True
        if not self._torch_warned and time.monotonic() - self._created >= self.config.peer_timeout:
            self._torch_warned = True
            logger.log(logging.WARNING if self.config.store is not None else logging.INFO,
                       "peerwatch: rank %d: no store bridge yet: this process has not imported torch.distributed "
                       "(peerwatch never imports it itself); a failure on another host will not reach this one "
                       "until it does", self.me.rank)
        return False

    def _store_client(self) -> StoreClient:
        if self._client is None:
            self._client = StoreClient(functools.partial(connect, self.facts.store), op_timeout_s(self.config.peer_timeout),
                                       f"peerwatch-bridge-io-rank{self.me.rank}")
        return self._client

    def on_verdict(self, verdict: Verdict) -> None:
        """The watcher acts on ``verdict``: make sure the other hosts learn it (bounded)."""
        if self.from_store is not None or self.published:
            return
        if verdict.detected_by not in identity.local_ranks(self.run_dir.registrations()):
            return  # made on another host: it came through the store
        if self.running and not self.connected and not self._first_answer():
            logger.info("peerwatch: the store at %s is unreachable: the verdict stays on this host", self.address)
            return
        connect_s = 0.0
        if not self.running:
            # The holder may be the rank that just died: if the lock is free, we are the
            # bridge now, for as long as it takes to publish (torch must be loaded already).
            if not torch_loaded() or not self._resolve_late() or not self._election.take():
                return
            connect_s = TAKEOVER_CONNECT_S
        publish = functools.partial(publish_verdict, prefix=self.prefix, data=encode(verdict), seal=self._seal,
                                    verdict_from=self._verdict_from)
        try:
            kept = self._store_client().call(publish, PUBLISH_BUDGET_S, connect_s=connect_s)
        except Exception as e:  # noqa: BLE001 - the store's errors are many; the teardown goes on
            logger.warning("peerwatch: could not publish the verdict through the store within %gs: %s",
                           PUBLISH_BUDGET_S, e)
            return
        self.published = True
        if not kept:
            logger.info("peerwatch: the store already held another host's verdict for run %s", self.facts.run_id)

    def _first_answer(self) -> bool:
        """A bridge that started moments ago (this rank took it over at its last heartbeat,
        from a local rank that died: the death this verdict is about) is connecting, not cut
        off: wait for the store's first answer as a takeover would. One that was answered
        before and is not connected now is cut off: no wait."""
        beat = self._beat
        return beat is not None and not beat.answered.is_set() and \
            beat.answered.wait(TAKEOVER_CONNECT_S + PUBLISH_BUDGET_S) and beat.connected

    def hold_until(self, verdict: Verdict) -> Optional[float]:
        """Until when (``time.monotonic()``) the watcher should hold ``verdict`` back, deciding
        again meanwhile; None: act now. An exception (or an exit) on this host, while it is
        connected to the others, may be the echo of a death on another host (a collective
        that lost its peer raises within milliseconds), or of a local one whose pidfd has not
        fired yet: for ``REMOTE_SETTLE_S`` after it, a verdict from another host (one store
        round trip away) or a death seen meanwhile comes first."""
        if not may_be_echo(verdict, self.me.rank, connected=True) or not self._connected():
            return None
        key = (verdict.rank, verdict.failed_at_ns)
        if key not in self._settle:
            self._settle[key] = settle_deadline(verdict.failed_at_ns, time.time_ns(), time.monotonic())
        return self._settle[key]

    def _connected(self) -> bool:
        """Is this host's bridge (run by any local rank) connected to the store?"""
        return self.connected if self.running else connected_elsewhere(self.run_dir)

    def on_success(self) -> None:
        """This rank finished cleanly: the job is ending; tell the other hosts (bounded, and
        tried once: leaving watch() and then the exit both say it, and a store that did not
        answer the first time is not waited for again)."""
        self._succeeded.set()
        index, client = self.index, self._client
        if self._done_sent or self.stopped.is_set() or not (
                self.running and self.connected and index is not None and client is not None):
            return  # the beat thread says it at its next interval, if it can
        self._done_sent = True
        # The aggregator says it in its digest too (the other hosts read nothing else): a job
        # whose aggregator ended first is ending, not missing its aggregator.
        last = self._beat.last_digest if self._beat is not None and self._beat.term is not None else None
        done = functools.partial(_send_done, prefix=self.prefix, index=index, beat=beat_value(self._seq(), True),
                                 seal=self._seal, digest=last)
        try:
            client.call(done, PUBLISH_BUDGET_S)
        except Exception as e:  # noqa: BLE001
            logger.warning("peerwatch: could not mark this host done through the store within %gs: %s",
                           PUBLISH_BUDGET_S, e)

    def stop(self) -> None:
        """Stop the bridge's threads and join them (at most ``STOP_BUDGET_S``). Any thread,
        more than once. A waiter blocked in the store's ``wait`` cannot be interrupted
        (a timeout there would leave torch's client out of step): it is a daemon, and ends
        when the verdict key is set or the process ends. The threads still inside a store
        request are named in ``left_in_store``: such a thread must not wake while Python
        finalizes (it would abort the process), so the exit ends the process first."""
        with self._life:
            self.stopped.set()
            threads = list(self._threads)
        deadline = time.monotonic() + STOP_BUDGET_S
        stuck = self._client.close(deadline) if self._client is not None else []
        blocked = self._wait_thread if self._waiter is not None and self._waiter.waiting else None
        for t in threads:
            if t is threading.current_thread() or t is blocked:
                continue
            t.join(max(0.0, deadline - time.monotonic()))
        stuck += [t for t in threads if t.is_alive()]
        self.left_in_store = sorted({t.name for t in stuck if t.is_alive()})
        if stuck:
            logger.debug("peerwatch: left in a store request: %s", ", ".join(t.name for t in stuck))

    # -- wiring the loops -------------------------------------------------------------------

    def _verdict_known(self) -> bool:
        """The beat thread's question: does this host know a verdict already (then a silent
        host or store is its consequence, not news)?"""
        return (self.from_store is not None or self.published
                or self.run_dir.exists(EVENTS, VERDICT_FILE))

    def _take_store_verdict(self, data: bytes) -> None:
        """Where the waiter thread hands what the store held (a seam: the load benchmark times it)."""
        assert self._waiter is not None
        self._waiter.take(data)


def _send_done(c: Any, prefix: str, index: int, beat: bytes, seal: Seal, digest: Optional[Digest]) -> None:
    """The done beat, and on the aggregator its last digest again with it (saying the job is ending)."""
    send_beat(c, prefix, index, beat, seal)
    say_ending(c, prefix, seal)
    if digest is not None and digest.by == index:
        publish_digest(c, prefix, dataclasses.replace(digest, beat=beat, ending=True), seal)


def _write_failure(run_dir: RunDir, failure: Failure) -> None:
    logger.error("peerwatch: %s", failure.message)
    try:
        run_dir.write(EVENTS, rank_file("failure", failure.rank), encode(failure),
                      valid=lambda d: decode(Failure, d) is not None)
    except OSError as e:
        logger.error("peerwatch: cannot record that %s: %s", failure.message, e)


def _guarded(target: Callable[[], None], rank: int) -> Callable[[], None]:
    def run() -> None:
        try:
            target()
        except BaseException:  # noqa: BLE001 - never die silently
            logger.exception("peerwatch: the store bridge of rank %d failed; failures on other hosts may "
                             "not reach this one", rank)
    return run


__all__ = ["PUBLISH_BUDGET_S", "STATE_FILE", "Bridge"]
