"""The digest across hosts (docs/multi-node.md, "One aggregator"): real bridges, each with its
own run directory and its own connections, on one real TCPStore served in this process.

One host (the aggregator) reads every host's beat and publishes one ``digest`` key; every
other host reads that key alone each heartbeat. Each host's client here is a counting
wrapper of a real TCPStore client: what a host reads per beat is counted at the client,
not assumed. When the aggregator goes silent, every other host judges it lost by its
digest, and its successor takes over: a host killed after that is still seen lost by all.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest

pytest.importorskip("torch")


from peerwatch.core.config import Config  # noqa: E402
from peerwatch.core.records import LOST, Failure, Registration, encode  # noqa: E402
from peerwatch.hangs.diagnose import RankState, Summary  # noqa: E402
from peerwatch.hosts.bridge import Bridge  # noqa: E402
from peerwatch.proc import identity  # noqa: E402
from peerwatch.proc.activity import Activity  # noqa: E402
from peerwatch.rundir.rundir import _SUBDIRS, EVENTS, RANKS, REMOTE_STALLS_FILE, STALL_FILE, RunDir, rank_file  # noqa: E402

pytestmark = pytest.mark.timeout(120)

HEARTBEAT_S = 0.2
PEER_TIMEOUT_S = 2.0
START_S = 30.0  # every host connected and counted by the aggregator (2 loaded cores)
# A silent host known to every other one: peer_timeout, a heartbeat to judge it, one to read
# the digest; the rest is slack for a loaded machine (speed is the benchmark's business).
LOST_S = PEER_TIMEOUT_S + 2 * HEARTBEAT_S + 15.0


class _Counting:
    """A client of the store (a real TCPStore client) that counts what its host asks: the
    requests, the beats it sets, and every key it reads, by kind (``beat``, ``digest``,
    ``host``...). ``clone()`` (the verdict waiter's connection, one open wait) is not counted."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._lock = threading.Lock()
        self.requests = 0
        self.beats = 0
        self.read: Dict[str, int] = {}

    def reset(self) -> None:
        with self._lock:
            self.requests, self.beats, self.read = 0, 0, {}

    def _count(self, reads: List[str]) -> None:
        with self._lock:
            self.requests += 1
            for key in reads:
                kind = key.split("/")[2] if key.count("/") >= 2 else key
                kind = "diag/all" if key.endswith("/diag/all") else kind  # the merge apart from diag/<j>
                self.read[kind] = self.read.get(kind, 0) + 1

    def set(self, key: str, value: Any) -> None:
        self._count([])
        if "/beat/" in key:
            with self._lock:
                self.beats += 1
        self._store.set(key, value)

    def get(self, key: str) -> Any:
        self._count([key])
        return self._store.get(key)

    def multi_get(self, keys: List[str]) -> Any:
        self._count(list(keys))
        return self._store.multi_get(keys)

    def check(self, keys: List[str]) -> Any:
        self._count([])  # existence only: no value comes back
        return self._store.check(keys)

    def add(self, key: str, n: int) -> Any:
        self._count([])
        return self._store.add(key, n)

    def compare_set(self, key: str, expected: Any, desired: Any) -> Any:
        self._count([key])
        return self._store.compare_set(key, expected, desired)

    def clone(self) -> Any:
        return self._store.clone()


def _host(tmp: Path, n: int, store: Any, run_id: str, **options: Any) -> Bridge:
    """Host ``n`` (ranks 2n and 2n+1 registered in its own run directory), its bridge started."""
    rd = RunDir(str(tmp / f"host{n}"))
    os.makedirs(rd.path)
    for sub in _SUBDIRS:
        os.mkdir(rd.join(sub))
    me = identity.self_info()
    regs = [Registration(rank=r, pid=me.pid, ppid=me.ppid, start_ticks=me.start_ticks, uid=me.uid, host=f"host{n}",
                         boot_id=identity.boot_id(), pidns=identity.pid_namespace(), time_ns=time.time_ns())
            for r in (2 * n, 2 * n + 1)]
    for reg in regs:
        rd.write(RANKS, rank_file("rank", reg.rank), encode(reg), replace=True)
    config = Config.resolve({"store": store, "run_id": run_id, "heartbeat_interval": HEARTBEAT_S,
                             "peer_timeout": PEER_TIMEOUT_S, "stragglers": False, **options}, env={})
    bridge = Bridge.for_config(config, rd, regs[0], env={})
    assert bridge is not None
    bridge.tick()
    return bridge


def _until(what: str, cond: Callable[[], bool], within: float, state: Callable[[], str] = lambda: "") -> None:
    deadline = time.monotonic() + within
    while not cond():
        assert time.monotonic() < deadline, f"not within {within}s: {what}\n{state()}"
        time.sleep(0.02)  # a deadline-bounded look at the bridges' state


def _state(bridges: List[Bridge]) -> str:
    return "\n".join(f"index {b.index}: joined {b.joined}, aggregating {b.aggregating}, connected {b.connected}"
                     for b in bridges)


def _lost_here(b: Bridge, rank: int) -> bool:
    f = b.run_dir.read(EVENTS, rank_file("failure", rank), Failure)
    return f is not None and f.cause == LOST


def _failures(bridge: Any) -> list:
    """The failure records (a host judged lost) in a bridge's run directory."""
    return [n for n in bridge.run_dir.names(EVENTS) if n.startswith("failure-")]


@pytest.mark.parametrize("hosts", [3, 8])
def test_a_host_reads_one_key_per_beat_whatever_the_number_of_hosts_and_none_is_lost_at_start(store, tmp_path: Path, hosts: int) -> None:
    """Every bridge read every host's beat every heartbeat: O(hosts) keys per host, O(hosts^2)
    for the store. Now the aggregator alone reads the beats; every other host reads the
    digest and the job's ``ending`` key (two keys, one request) besides its own beat (one
    set), with 3 hosts as with 8."""
    counters = [_Counting(store()) for _ in range(hosts)]
    bridges = [_host(tmp_path, n, counters[n], f"digest-count-{hosts}") for n in range(hosts)]
    try:
        _until("every host counted by the digest", lambda: all(b.joined == hosts and b.connected for b in bridges),
               START_S, lambda: _state(bridges))
        aggregators = [b for b in bridges if b.aggregating]
        assert len(aggregators) == 1, _state(bridges)
        for c in counters:
            c.reset()
        _until("20 beats of every host", lambda: all(c.beats >= 20 for c in counters), 60.0,
               lambda: " ".join(str(c.beats) for c in counters))
        for b, c in zip(bridges, counters):
            with c._lock:
                beats, requests, read = c.beats, c.requests, dict(c.read)
            if b.aggregating:
                assert read.get("beat", 0) >= (hosts - 1) * (beats - 2), (read, beats)
                continue
            # One read of the digest and the ending key per beat (a host record the digest
            # names, read once, may fall in the window); never another host's beat.
            assert read.get("beat", 0) == 0, read
            assert beats - 2 <= read.get("digest", 0) <= beats + 2, (read, beats)
            assert read.get("ending", 0) == read.get("digest", 0), (read, beats)
            assert sum(read.values()) <= 2 * beats + 4, (read, beats)
            assert requests <= 2 * beats + 4, (requests, beats)
        # Started together (each first request at a random point of its first heartbeat):
        # no host was judged lost while the job started, nor since.
        for b in bridges:
            assert not _failures(b), b.index
    finally:
        for b in bridges:
            b.stop()


def test_the_aggregators_death_is_seen_and_its_successor_takes_over(store, tmp_path: Path) -> None:
    """The aggregator goes silent: every other host judges it lost by its digest, which no
    longer advances; the next host takes over the digest, and a host that dies after that
    is still seen lost by every host left."""
    bridges = [_host(tmp_path, n, f"127.0.0.1:{int(store().port)}", "digest-successor") for n in range(4)]
    try:
        _until("every host counted by the digest", lambda: all(b.joined == 4 and b.connected for b in bridges),
               START_S, lambda: _state(bridges))
        (first,) = [b for b in bridges if b.aggregating]
        assert first.index == 0
        rest = [b for b in bridges if b is not first]
        first.stop()  # silent, without a word (no done beat): as a frozen or cut-off host
        _until("the aggregator judged lost by every other host",
               lambda: all(_lost_here(b, first.me.rank) for b in rest), LOST_S, lambda: _state(bridges))
        (successor,) = [b for b in rest if b.index == 1]
        _until("its successor aggregates", lambda: successor.aggregating and not any(
            b.aggregating for b in rest if b is not successor), LOST_S, lambda: _state(bridges))
        victim = next(b for b in rest if b is not successor)
        left = [b for b in rest if b is not victim]
        victim.stop()
        _until("a host lost after the takeover judged lost by every host left",
               lambda: all(_lost_here(b, victim.me.rank) for b in left), LOST_S, lambda: _state(bridges))
        for b in left:  # every host left names it from its record, and the first aggregator too
            failure = b.run_dir.read(EVENTS, rank_file("failure", victim.me.rank), Failure)
            assert failure is not None and f"ranks {victim.me.rank}-{victim.me.rank + 1}) lost" in (failure.message or "")
            assert _lost_here(b, first.me.rank)
    finally:
        for b in bridges:
            b.stop()


def test_an_aggregator_that_ends_well_first_is_not_lost(store, tmp_path: Path) -> None:
    """The aggregator's rank finishes cleanly and its host goes away first: the other hosts,
    which read nothing but its digest, learn from it that the job is ending (its done beat
    is in the digest too), and none judges it lost when its digest stands still."""
    bridges = [_host(tmp_path, n, f"127.0.0.1:{int(store().port)}", "digest-ends") for n in range(3)]
    try:
        _until("every host counted by the digest", lambda: all(b.joined == 3 and b.connected for b in bridges),
               START_S, lambda: _state(bridges))
        (first,) = [b for b in bridges if b.aggregating]
        rest = [b for b in bridges if b is not first]
        first.on_success()
        first.stop()
        ended = time.monotonic()
        _until("the job ending on every other host", lambda: all(b.job_ending for b in rest), LOST_S,
               lambda: _state(bridges))
        # Past peer_timeout (and a takeover) since the aggregator went quiet: nobody judged it.
        _until("peer_timeout passed", lambda: time.monotonic() > ended + PEER_TIMEOUT_S + 4 * HEARTBEAT_S, LOST_S)
        for b in rest:
            assert not _failures(b), b.index
    finally:
        for b in bridges:
            b.stop()


def test_a_host_that_registers_is_counted_everywhere_whatever_the_aggregators_pace(store, tmp_path: Path) -> None:
    """Who joined is not left to the aggregator. Host 0 here aggregates at the pace of a
    starved one: its digest advances every heartbeat (it is alive: nobody takes over, nobody
    judges it lost) but never counts another host. The three real hosts that register
    meanwhile are counted joined by each of them all the same (they took an index), and none
    says that hosts the launcher announced have not joined."""
    from peerwatch.hosts.hosts import Digest, HostInfo, beat_value
    from peerwatch.hosts.store_protocol import HOSTS, beat_key, host_key, publish_digest

    prefix = "peerwatch/digest-pace/"
    slow = store()
    assert int(slow.add(prefix + HOSTS, 1)) == 1  # host 0: the aggregator, first to register
    slow.set(prefix + host_key(0), HostInfo(0, "host0", ranks=(0, 1)).to_json())
    stop = threading.Event()

    def aggregate() -> None:
        seq = 0
        while True:
            seq += 1
            slow.set(prefix + beat_key(0), beat_value(seq, False))
            publish_digest(slow, prefix, Digest(0, 0, beat_value(seq, False), count=1, joined=1))
            if stop.wait(HEARTBEAT_S):
                return

    pacer = threading.Thread(target=aggregate, name="test-slow-aggregator")
    pacer.start()
    bridges: List[Bridge] = []
    try:
        # Eight ranks, two a host: the launcher announces four hosts. A peer_timeout of 10 s: a
        # loaded machine that starves this test's thread for a second or two (half of it is a
        # takeover) does not change who aggregates.
        bridges = [_host(tmp_path, n, f"127.0.0.1:{int(store().port)}", "digest-pace", world_size=8,
                         local_world_size=2, peer_timeout=10.0) for n in (1, 2, 3)]
        _until("every host counted joined by every other", lambda: all(b.joined == 4 and b.connected for b in bridges),
               START_S, lambda: _state(bridges))
        assert not any(b.aggregating for b in bridges), _state(bridges)  # the premise: host 0 still aggregates
        for b in bridges:
            assert not _failures(b), b.index
    finally:
        for b in bridges:
            b.stop()
        stop.set()
        pacer.join(10.0)


def test_a_clean_end_reaches_every_host_in_one_read_without_the_aggregator(store, tmp_path: Path) -> None:
    """A host whose rank finished cleanly said so only in its beat, which the aggregator read
    and passed on in its next digest: two intervals, and a store served from that host could
    be gone before the others read it (they judged the store lost: a clean job ended in a
    verdict). The job's ``ending`` key is read by every host with the digest. Here the
    aggregator is stopped first (its digest no longer changes; peer_timeout is long, so no
    successor takes over): the other host learns that the job is ending all the same."""
    bridges = [_host(tmp_path, n, store(), "digest-ending", peer_timeout=60.0) for n in range(3)]
    try:
        _until("every host counted", lambda: all(b.joined == 3 and b.connected for b in bridges), START_S,
               lambda: _state(bridges))
        (aggregator,) = [b for b in bridges if b.aggregating]
        done, reader = [b for b in bridges if b is not aggregator]
        aggregator.stop()
        assert not reader.job_ending
        done.on_success()
        _until("the other host knows the job is ending", lambda: reader.job_ending, 20.0, lambda: _state(bridges))
    finally:
        for b in bridges:
            b.stop()


def _stall(n: int, laggard: int, age_ms: int) -> Summary:
    """Host ``n``'s summary in a hang: its two ranks wait in all_reduce #31, or, on the
    ``laggard`` host, never got past #30 (plainly stuck: a whole window with no work)."""
    ranks = (2 * n, 2 * n + 1)
    if n != laggard:
        waiting = RankState(collectives=(("0", 31, 30),), entered=(("0", 31, "allreduce", "[[1]] Float"),),
                            in_collective=True)
        return Summary(f"host{n}", "onset", age_ms, 60_000, ((ranks, waiting),))
    idle = Activity(span_ms=7000, cpu_ms=0, places=1, other_cpu_ms=0, io_bytes=0, children_cpu_ms=0, samples=8)
    stuck = RankState(collectives=(("0", 30, 30),), entered=(("0", 30, "allreduce", "[[1]] Float"),), state="S",
                      where="train.py:12 in loop", activity=idle)
    return Summary(f"host{n}", "onset", age_ms, 60_000, (), tuple((r, stuck) for r in ranks), stuck=True)


def _remote_ranks(b: Bridge) -> Dict[int, str]:
    """Rank -> host, of the other hosts' ranks that this host's judges are handed."""
    try:
        hosts = json.loads(b.run_dir.read_bytes("", REMOTE_STALLS_FILE) or b"{}").get("hosts", [])
    except ValueError:  # being replaced: looked at again
        return {}
    out: Dict[int, str] = {}
    for _, text in hosts:
        s = Summary.from_json(text.encode())
        if s is not None:
            out.update({r: s.host for ranks, _ in s.waiting for r in ranks})
            out.update({r: s.host + " (detailed)" for r, _ in s.detailed})
    return out


def test_every_host_reads_the_stalls_merged_in_one_key_and_names_a_whole_host_behind(store, tmp_path: Path) -> None:
    """Every host stands still, host 4 stuck behind the others: the aggregator reads each
    host's summary (diag/<j>) and merges them into diag/all; every other host reads that
    one key, never a diag/<j>, and hands its judges every other host's ranks, host 4's in
    full. Before, each host read up to 64 diag/<j> (a host beyond them was unseen)."""
    hosts, laggard = 6, 4
    counters = [_Counting(store()) for _ in range(hosts)]
    bridges = [_host(tmp_path, n, counters[n], "digest-merged") for n in range(hosts)]
    stop = threading.Event()

    def judges() -> None:  # each host's hang judges, rewriting its stall as it ages
        onset = time.monotonic()
        while not stop.wait(HEARTBEAT_S):
            age = int((time.monotonic() - onset) * 1000) + 10_000  # stood still for the stuck threshold already
            for n, b in enumerate(bridges):
                b.run_dir.write_or_log(STALL_FILE, _stall(n, laggard, age).to_json())

    writer = threading.Thread(target=judges, daemon=True)
    try:
        _until("every host counted by the digest", lambda: all(b.joined == hosts and b.connected for b in bridges),
               START_S, lambda: _state(bridges))
        for c in counters:
            c.reset()
        writer.start()
        everyone = {r for n in range(hosts) for r in (2 * n, 2 * n + 1)}
        _until("every host handed every other host's ranks, host 4's in full",
               lambda: all(set(_remote_ranks(b)) | {2 * n, 2 * n + 1} >= everyone
                           and _remote_ranks(b).get(2 * laggard, "").endswith("(detailed)")
                           for n, b in enumerate(bridges) if n != laggard), 30.0,
               lambda: "\n".join(f"host{n}: {_remote_ranks(b)}" for n, b in enumerate(bridges)))
        for b, c in zip(bridges, counters):
            with c._lock:
                read = dict(c.read)
            if b.aggregating:
                assert read.get("diag", 0) >= hosts - 1 and read.get("diag/all", 0) == 0, read
            else:
                assert read.get("diag", 0) == 0 and read.get("diag/all", 0) >= 1, (b.index, read)
    finally:
        stop.set()
        if writer.is_alive():
            writer.join(5)
        for b in bridges:
            b.stop()
