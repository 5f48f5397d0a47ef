"""What a bridge reads from the store is bounded, and a host of the job is never silently
left unwatched: a real TCPStore, written by a stranger (another client of it). The
``hosts`` counter is unsigned: anyone who can reach the store may set it to anything."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, List, Tuple

import pytest

pytest.importorskip("torch")


from harness import free_port  # noqa: E402

from peerwatch.core.config import Config, LauncherFacts  # noqa: E402
from peerwatch.core.records import LOST, Failure, Registration, encode  # noqa: E402
from peerwatch.hosts.hosts import JOIN_TIMEOUTS, READ_BATCH, HostInfo  # noqa: E402
from peerwatch.hosts.store_protocol import Exchange, Seal, exchange  # noqa: E402
from peerwatch.proc import identity  # noqa: E402
from peerwatch.rundir.rundir import _SUBDIRS, EVENTS, RANKS, RunDir, rank_file  # noqa: E402

pytestmark = pytest.mark.timeout(90)

PREFIX = "peerwatch/bounds-test/"
SECRET = b"s3cret-shared-by-every-host-of-the-job"


class _Counted:
    """A client of the store that counts its requests, and refuses more than ``limit`` (the
    unbounded loop it would otherwise be in runs for hours)."""

    def __init__(self, store: Any, limit: int = 10_000) -> None:
        self._store, self._limit, self.requests = store, limit, 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.requests += 1
            if self.requests > self._limit:
                raise RuntimeError(f"more than {self._limit} store requests in one exchange")
            return attr(*args, **kwargs)

        return call


def _two_hosts(client: Callable[[], Any]) -> Tuple[Any, HostInfo]:
    """Hosts a (index 0) and b (index 1) registered; a's client, b's record."""
    a, b = client(), client()
    me = HostInfo(0, "host-a", ranks=(0, 1), ident="ident-a")
    assert exchange(a, Exchange(PREFIX, None, "ident-a", b"1", me, {}, None)).index == 0
    other = HostInfo(1, "host-b", ranks=(2, 3), ident="ident-b")
    assert exchange(b, Exchange(PREFIX, None, "ident-b", b"5", other, {}, None)).index == 1
    return a, other


def test_a_hosts_counter_of_millions_costs_a_bounded_number_of_requests(store) -> None:
    """The counter set to 3,000,000: a request per index (the interval never ended, a
    stuck owner thread per retry, hundreds of MB per rank, no host ever learnt). Now at
    most READ_BATCH indices are looked up per interval; the real host is found at once."""
    a, other = _two_hosts(store)
    store().set(PREFIX + "hosts", b"3000000")
    me = HostInfo(0, "host-a", ranks=(0, 1), ident="ident-a")
    counted = _Counted(a)
    seen = exchange(counted, Exchange(PREFIX, 0, "ident-a", b"2", None, {0: me}, None))
    assert seen.new_hosts == {1: other} and seen.beats == {1: b"5"}
    assert counted.requests <= 2 * READ_BATCH + 8, counted.requests
    for beat in (b"3", b"4"):  # every later interval too, while the roster looks incomplete
        counted = _Counted(a)
        exchange(counted, Exchange(PREFIX, 0, "ident-a", beat, None, {0: me, 1: other}, None))
        assert counted.requests <= 2 * READ_BATCH + 8, counted.requests


def test_a_hosts_counter_that_is_not_a_number_is_unknown_with_one_warning(store, caplog) -> None:
    """TCPStore's add on such a value drops the connection: every interval failed, and the
    store was judged lost. It is read as no news, with one warning."""
    caplog.set_level(logging.WARNING, logger="peerwatch")
    a, other = _two_hosts(store)
    store().set(PREFIX + "hosts", b"\xffgarbage")
    me = HostInfo(0, "host-a", ranks=(0, 1), ident="ident-a")
    for beat in (b"2", b"3"):
        seen = exchange(a, Exchange(PREFIX, 0, "ident-a", beat, None, {0: me, 1: other}, None))
        assert seen.beats == {1: b"5"} and seen.new_hosts == {}
    assert caplog.text.count("is not a host count") == 1


def test_a_rewritten_host_record_does_not_unwatch_a_host_of_the_job(store, caplog) -> None:
    """With a secret, host/1 rewritten (unsigned) before host a read it: host b was never
    watched, and its death went unnoticed. Its beat is signed for this run: it is watched,
    known by its index, and the rewrite is warned about."""
    caplog.set_level(logging.WARNING, logger="peerwatch")
    seal_a, seal_b = Seal(SECRET), Seal(SECRET)
    c = store()
    me = HostInfo(0, "host-a", ranks=(0, 1), ident="ident-a")
    assert exchange(c, Exchange(PREFIX, None, "ident-a", b"1", me, {}, 2, seal_a)).index == 0
    other = HostInfo(1, "host-b", ranks=(2, 3), ident="ident-b")
    exchange(store(), Exchange(PREFIX, None, "ident-b", b"5", other, {}, 2, seal_b))
    store().set(PREFIX + "host/1", HostInfo(1, "evil", ranks=(9,), ident="ident-a").to_json())
    seen = exchange(c, Exchange(PREFIX, 0, "ident-a", b"2", None, {0: me}, 2, seal_a))
    assert list(seen.new_hosts) == [1] and seen.new_hosts[1].hostname == "host 1"
    assert seen.beats == {1: b"5"}
    assert "host/1 that is not signed" in caplog.text
    # A stranger's index, whose host and beat are both unsigned, is no host of the job.
    forger = store()
    forger.add(PREFIX + "hosts", 1)
    forger.set(PREFIX + "beat/2", b"7")
    forger.set(PREFIX + "host/2", HostInfo(2, "evil").to_json())
    seen = exchange(c, Exchange(PREFIX, 0, "ident-a", b"3", None, {0: me}, 3, seal_a))
    assert sorted(seen.new_hosts) == [1]


# -- a host the launcher announced that never joins -------------------------------------------------


def _registration(rank: int) -> Registration:
    return Registration(rank=rank, pid=os.getpid(), ppid=os.getppid(), start_ticks=0, uid=os.getuid(),
                        host=identity.hostname(), boot_id=identity.boot_id(), pidns=identity.pid_namespace(),
                        time_ns=time.time_ns())


def _lost(run_dir: RunDir) -> List[Failure]:
    found = [run_dir.read(EVENTS, rank_file("failure", r), Failure) for r in range(4)]
    return [f for f in found if f is not None and f.cause == LOST]


def test_an_announced_host_that_never_joins_is_an_error_then_lost(store, tmp_path: Path, caplog) -> None:
    """The launcher says two hosts; the other one never registers (another secret, a
    forged counter, its ranks never started): it was never watched, and the job ran on
    as if protected. It is an error after peer_timeout, a lost record after
    JOIN_TIMEOUTS peer_timeouts, naming the ranks no host announced."""
    from peerwatch.hosts.bridge import _BeatLoop, _Link, _TorchGate
    from peerwatch.hosts.store_client import StoreClient

    caplog.set_level(logging.INFO, logger="peerwatch")
    peer_timeout = 0.5
    config = Config.resolve({"heartbeat_interval": 0.1, "peer_timeout": peer_timeout, "world_size": 4,
                             "local_world_size": 2}, env={})
    owner = StoreClient(lambda t: store(), 2.0, "test-store-owner")
    facts = LauncherFacts(wants_store=True, spans_hosts=True, store="test", run_id="bounds-test", expected_hosts=2)
    run_dir = RunDir(str(tmp_path / "run"))
    os.makedirs(run_dir.path)
    for sub in _SUBDIRS:
        os.mkdir(run_dir.join(sub))
    for rank in (0, 1):  # this host's ranks, announced in its host/<i>
        run_dir.write(RANKS, rank_file("rank", rank), encode(_registration(rank)), replace=True)
    stopped = threading.Event()
    seq = iter(range(1, 1_000_000))
    loop = _BeatLoop(_Link(config, run_dir, facts, owner, stopped), _registration(0), "ident-a", lambda: next(seq),
                     threading.Event(), lambda: False, _TorchGate())
    thread = threading.Thread(target=loop.run, name="test-beat", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + JOIN_TIMEOUTS * peer_timeout + 30.0
        while not _lost(run_dir):
            assert time.monotonic() < deadline, "the missing host was never judged"
            time.sleep(0.05)
        assert "1 of the 2 hosts the launcher announced have not joined" in caplog.text
        (failure,) = _lost(run_dir)
        assert failure.rank == 2 and failure.pid == 0  # the lowest rank no host announced
        assert "1 of the 2 hosts the launcher announced never joined" in (failure.message or "")
        assert "ranks 2-3" in (failure.message or "")
    finally:
        stopped.set()
        owner.close(time.monotonic() + 5.0)
        thread.join(10.0)
    assert not thread.is_alive()


# -- verdicts are ordered by the store, not by the hosts' clocks -------------------------------------


def _bridge_host(tmp: Path, port: int, secret: Any = None) -> Any:
    """A host's bridge (ranks 0 and 1 registered now) on the test's store, started."""
    from peerwatch.hosts.bridge import Bridge

    run_dir = RunDir(str(tmp / "host-a"))
    os.makedirs(run_dir.path)
    for sub in _SUBDIRS:
        os.mkdir(run_dir.join(sub))
    regs = [_registration(rank) for rank in (0, 1)]
    for reg in regs:
        run_dir.write(RANKS, rank_file("rank", reg.rank), encode(reg), replace=True)
    config = Config.resolve({"store": f"127.0.0.1:{port}", "run_id": "bounds-test", "heartbeat_interval": 0.1,
                             "peer_timeout": 2.0, "store_secret": secret}, env={})
    bridge = Bridge.for_config(config, run_dir, regs[0], env={})
    assert bridge is not None
    bridge.tick()
    return bridge


def _skewed(rank: int, exit_code: int, skew_s: float) -> Any:
    from peerwatch.core.records import Verdict

    at = time.time_ns() + int(skew_s * 1e9)  # the clock of the host that made it
    return Verdict(rank=rank, cause="exit", exit_code=exit_code, failed_at_ns=at, detected_by=rank, detected_at_ns=at)


def _until(what: str, cond: Callable[[], bool], within: float = 20.0) -> None:
    deadline = time.monotonic() + within
    while not cond():
        assert time.monotonic() < deadline, f"not within {within}s: {what}"
        time.sleep(0.02)


@pytest.mark.parametrize("secret", [None, SECRET.decode()])
@pytest.mark.parametrize("skew_s", [-60.0, -3600.0, 3600.0])
def test_a_verdict_of_this_run_is_obeyed_whatever_the_clock_of_the_host_that_made_it(
        store, tmp_path: Path, secret: Any, skew_s: float) -> None:
    """Host B's clock 60 s behind ours: its verdict looked "made before this run started"
    and was refused; this host learnt of the failure only as a lost host, after
    peer_timeout, with the wrong exit code. A verdict published after this host looked at
    the store (and, with a secret, signed for this run's nonce) is obeyed."""
    from peerwatch.core.records import Verdict, decode
    from peerwatch.hosts.store_protocol import publish_verdict

    port = int(store().port)
    bridge = _bridge_host(tmp_path, port, secret)
    try:
        _until("host a connected", lambda: bridge.connected and bridge.index is not None)
        _until("host a waiting for a verdict", lambda: bridge._waiter is not None and bridge._waiter.waiting)
        made = _skewed(rank=3, exit_code=7, skew_s=skew_s)
        assert publish_verdict(store(), PREFIX, encode(made), Seal(secret.encode() if secret else None))
        _until("the verdict taken", lambda: bridge.from_store is not None)
        assert decode(Verdict, bridge.from_store) == made
    finally:
        bridge.stop()


@pytest.mark.parametrize("secret", [None, SECRET.decode()])
def test_a_verdict_in_the_store_before_the_host_looked_is_an_earlier_jobs(
        store, tmp_path: Path, secret: Any, caplog) -> None:
    """An earlier job's verdict under the same keys (a store that outlived it, or written
    back with its nonce before any host of this job came): made on a clock ahead of ours,
    it passed the age check. A verdict already there when this host first looked is not
    this run's: refused with a warning; this run's own verdict, under the next key, is
    obeyed."""
    from peerwatch.core.records import Verdict, decode
    from peerwatch.hosts.store_protocol import VerdictFrom, publish_verdict

    caplog.set_level(logging.WARNING, logger="peerwatch")
    seal = Seal(secret.encode() if secret else None)
    earlier = _skewed(rank=3, exit_code=77, skew_s=600.0)
    assert publish_verdict(store(), PREFIX, encode(earlier), seal)
    bridge = _bridge_host(tmp_path, int(store().port), secret)
    try:
        _until("host a connected", lambda: bridge.connected and bridge.index is not None)
        _until("host a waiting for a verdict", lambda: bridge._waiter is not None and bridge._waiter.waiting)
        assert bridge.from_store is None
        assert "before this host" in caplog.text
        real = _skewed(rank=1, exit_code=9, skew_s=0.0)  # published by another host of this job
        assert publish_verdict(store(), PREFIX, encode(real), Seal(secret.encode() if secret else None), VerdictFrom())
        _until("this run's verdict taken", lambda: bridge.from_store is not None)
        assert decode(Verdict, bridge.from_store) == real
    finally:
        bridge.stop()


def test_a_host_started_with_another_secret_is_lost_not_silently_unwatched(store, tmp_path: Path, caplog) -> None:
    """Host b has another store secret: a reads b's records as forged (and b a's), so
    neither ever watched the other, and the job ran on with a warning blaming "another
    user". Each is an announced host that never joined: an error, then lost."""
    from peerwatch.hosts.bridge import Bridge

    caplog.set_level(logging.WARNING, logger="peerwatch")
    port = int(store().port)
    bridges = []
    for name, ranks, secret in (("a", (0, 1), SECRET.decode()), ("b", (2, 3), "another-secret-of-16-bytes-or-more")):
        run_dir = RunDir(str(tmp_path / name))
        os.makedirs(run_dir.path)
        for sub in _SUBDIRS:
            os.mkdir(run_dir.join(sub))
        regs = [_registration(rank) for rank in ranks]
        for reg in regs:
            run_dir.write(RANKS, rank_file("rank", reg.rank), encode(reg), replace=True)
        config = Config.resolve({"store": f"127.0.0.1:{port}", "run_id": "bounds-test", "heartbeat_interval": 0.1,
                                 "peer_timeout": 0.5, "store_secret": secret, "world_size": 4,
                                 "local_world_size": 2}, env={})
        bridge = Bridge.for_config(config, run_dir, regs[0], env={})
        assert bridge is not None and bridge.facts.expected_hosts == 2
        bridge.tick()
        bridges.append(bridge)
    try:
        a, b = bridges
        _until("host a judged host b", lambda: bool(_lost(a.run_dir)), JOIN_TIMEOUTS * 0.5 + 30.0)
        _until("host b judged host a", lambda: bool(_lost(b.run_dir)), 10.0)
        assert [f.rank for f in _lost(a.run_dir)] == [2] and [f.rank for f in _lost(b.run_dir)] == [0]
        assert "not signed with this job's store secret" in caplog.text
        assert "have not joined through the store" in caplog.text
    finally:
        for bridge in bridges:
            bridge.stop()


class _Memo:
    """The run directory of one host, as VerdictFrom sees it: the first save wins."""

    def __init__(self) -> None:
        self.value: Any = None

    def load(self) -> Any:
        return self.value

    def save(self, value: bytes) -> None:
        self.value = self.value if self.value is not None else value


def test_a_successor_bridge_keeps_the_first_verdict_key_its_host_found(store) -> None:
    """The bridge's rank exited and another local rank took over: a verdict this run
    published meanwhile is not "there before the host looked"."""
    from peerwatch.hosts.store_protocol import VerdictFrom, publish_verdict

    memo = _Memo()
    assert VerdictFrom(memo).settle(store(), PREFIX, Seal(None)) == 0
    assert publish_verdict(store(), PREFIX, encode(_skewed(rank=1, exit_code=9, skew_s=0.0)), Seal(None), VerdictFrom(memo))
    assert VerdictFrom(memo).settle(store(), PREFIX, Seal(None)) == 0  # the successor, same host
    assert VerdictFrom(_Memo()).settle(store(), PREFIX, Seal(None)) == 1  # a host that looks only now
    assert VerdictFrom().settle(store(), PREFIX, Seal(None)) == 1


def test_a_bridge_still_connecting_publishes_the_verdict_it_is_told_of(tmp_path: Path) -> None:
    """The host's bridge rank died; the survivor took the bridge over at its heartbeat and
    learnt of the death in the same instant, before its first exchange came back. It read
    "running, not connected" as cut off and kept the verdict on its host: the other hosts
    learnt of it only as this host lost, after peer_timeout (seen beside 8 busy loops).
    Here the store answers only 0.3 s after the bridge started: the verdict must still
    reach it."""
    import torch.distributed as dist

    from peerwatch.core.records import Verdict, decode
    from peerwatch.hosts.store_protocol import poll_verdict

    port = free_port()
    bridge = _bridge_host(tmp_path, port)  # its threads started: connecting to nothing yet
    server: List[Any] = []
    late = threading.Timer(0.3, lambda: server.append(dist.TCPStore("127.0.0.1", port, is_master=True,
                                                                      wait_for_workers=False)))
    late.start()
    try:
        assert not bridge.connected
        made = dataclasses.replace(_skewed(rank=1, exit_code=7, skew_s=0.0), detected_by=0)  # this host's rank 0 saw it
        bridge.on_verdict(made)
        assert bridge.published, "the verdict stayed on this host"
        late.join()
        client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
        assert decode(Verdict, poll_verdict(client, PREFIX, Seal(None))) == made
    finally:
        late.cancel()
        bridge.stop()
        server.clear()
