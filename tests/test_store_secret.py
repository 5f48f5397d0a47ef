"""The store secret (issue 14): TCPStore has no authentication, so anyone who can reach it
could write a verdict that ends the job with an exit code of their choice. With
``store_secret`` set, peerwatch signs what it writes there (HMAC-SHA256 over key and
value) and ignores, with one warning, what is not signed with it. Without a secret,
nothing changes. The store is a real TCPStore; the forger is another client of it."""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Tuple

import pytest

from peerwatch import Config, ConfigError
from peerwatch.core.config import SECRET_SHOWN
from peerwatch.core.records import Verdict, decode, encode
from peerwatch.hosts.hosts import HostInfo
from peerwatch.hosts.store_protocol import SIGNED, Exchange, Seal, VerdictFrom, exchange, publish_verdict
from peerwatch.rundir.rundir import EVENTS, TMP, VERDICT_FILE, RunDir

pytestmark = pytest.mark.timeout(60)

SECRET = "s3cret-shared-by-every-host-of-the-job"
PREFIX = "peerwatch/secret-test/"


def _verdict(rank: int, exit_code: int) -> Verdict:
    now = time.time_ns()
    return Verdict(rank=rank, cause="exception", exit_code=exit_code, failed_at_ns=now, detected_by=rank,
                   detected_at_ns=now)


def _wait(what: str, cond: Callable[[], bool], within: float) -> None:
    deadline = time.monotonic() + within
    while not cond():
        assert time.monotonic() < deadline, f"not within {within}s: {what}"
        time.sleep(0.01)


# -- the setting ---------------------------------------------------------------------------------


def test_no_secret_by_default_and_the_secret_is_never_shown():
    assert Config.resolve({}, env={}).store_secret is None
    config = Config.resolve({}, env={"PEERWATCH_STORE_SECRET": SECRET})
    assert config.store_secret == SECRET.encode()
    assert config.source_of("store_secret") == "environment variable PEERWATCH_STORE_SECRET"
    assert SECRET not in repr(config)
    assert Config.resolve({"store_secret": SECRET.encode()}, env={}).store_secret == SECRET.encode()


def test_a_short_secret_is_refused_without_showing_it():
    with pytest.raises(ConfigError) as info:
        Config.resolve({}, env={"PEERWATCH_STORE_SECRET": "hunter2"})
    assert info.value.option == "store_secret" and "at least 16 bytes" in str(info.value)
    assert "hunter2" not in str(info.value) and info.value.value == SECRET_SHOWN


def test_the_secret_from_a_file(tmp_path: Path):
    path = tmp_path / "secret"
    path.write_bytes(SECRET.encode() + b"\n")
    path.chmod(0o600)
    config = Config.resolve({}, env={"PEERWATCH_STORE_SECRET_FILE": str(path)})
    assert config.store_secret == SECRET.encode()
    assert config.source_of("store_secret") == "environment variable PEERWATCH_STORE_SECRET_FILE"
    assert Config.resolve({"store_secret_file": path}, env={}).store_secret == SECRET.encode()


@pytest.mark.parametrize(("mode", "content", "reason"), [
    (0o644, SECRET.encode(), "others may read"),
    (0o620, SECRET.encode(), "others may read or change"),
    (0o600, b"short\n", "at least 16 bytes"),
    (0o600, b"x" * 5000, "over 4096 bytes"),
])
def test_a_secret_file_others_can_read_or_that_holds_no_secret_is_refused(tmp_path: Path, mode, content, reason):
    path = tmp_path / "secret"
    path.write_bytes(content)
    path.chmod(mode)
    with pytest.raises(ConfigError) as info:
        Config.resolve({}, env={"PEERWATCH_STORE_SECRET_FILE": str(path)})
    assert info.value.option == "store_secret_file" and reason in str(info.value)


def test_a_missing_secret_file_and_two_secrets_are_refused(tmp_path: Path):
    with pytest.raises(ConfigError, match="cannot be read"):
        Config.resolve({}, env={"PEERWATCH_STORE_SECRET_FILE": str(tmp_path / "nope")})
    path = tmp_path / "secret"
    path.write_bytes(SECRET.encode())
    path.chmod(0o600)
    with pytest.raises(ConfigError, match="set one of them"):
        Config.resolve({"store_secret": SECRET}, env={"PEERWATCH_STORE_SECRET_FILE": str(path)})


# -- the seal ------------------------------------------------------------------------------------


def test_without_a_secret_values_are_stored_as_they_are():
    seal = Seal(None)
    assert seal.sign(PREFIX + "verdict", b"v") == b"v"
    assert seal.open(PREFIX + "verdict", b"anything") == b"anything"


NONCE_1, NONCE_2 = b"1" * 32, b"2" * 32


def test_a_signed_value_opens_only_under_its_key_with_its_secret(caplog):
    seal = Seal(SECRET.encode(), nonce=NONCE_1)
    signed = seal.sign(PREFIX + "beat/1", b"42")
    assert signed.startswith(SIGNED) and seal.open(PREFIX + "beat/1", signed) == b"42"
    with caplog.at_level(logging.WARNING, logger="peerwatch"):
        assert seal.open(PREFIX + "beat/2", signed) is None  # replayed under another key
        assert Seal(b"another-secret-of-16-bytes", nonce=NONCE_1).open(PREFIX + "beat/1", signed) is None
        assert seal.open(PREFIX + "beat/1", signed[:-1] + b"3") is None  # value changed
        assert seal.open(PREFIX + "beat/1", b"43") is None  # unsigned
        assert seal.open(PREFIX + "verdict", b"{}") is None
    warned = [r for r in caplog.records if "not signed with this job's store secret" in r.getMessage()]
    assert len(warned) == 3, [r.getMessage() for r in warned]  # once per kind of key and Seal: beat, beat, verdict
    # The same secret, key and value, signed for another run (its nonce): not this run's.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="peerwatch"):
        assert Seal(SECRET.encode(), nonce=NONCE_2).open(PREFIX + "beat/1", signed) is None
    assert "signed for another run" in caplog.text


def test_the_nonce_is_settled_once_in_the_store_and_a_forged_one_replaced(store):
    from peerwatch.hosts.store_protocol import establish_nonce

    _, client = store
    forger = client()
    forger.set(PREFIX + "nonce", b"0" * 32)  # unsigned
    first, second = Seal(SECRET.encode()), Seal(SECRET.encode())
    nonce = establish_nonce(client(), PREFIX, first)
    assert nonce is not None and len(nonce) == 32 and nonce != b"0" * 32
    assert establish_nonce(client(), PREFIX, second) == nonce == second.nonce  # the store's, not a new one
    forger.set(PREFIX + "nonce", Seal(SECRET.encode(), nonce=NONCE_1).sign(PREFIX + "nonce", NONCE_1))
    assert establish_nonce(client(), PREFIX, first) == nonce  # a host keeps the one it adopted


# -- a real TCPStore -----------------------------------------------------------------------------


@pytest.fixture
def store() -> Iterator[Tuple[Any, Callable[[], Any]]]:
    """(the server, a function making another client of it)."""
    pytest.importorskip("torch")
    import torch.distributed as dist
    from harness import free_port

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)

    def client() -> Any:
        return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=10))

    yield server, client
    del server


def _waiter(run_dir: RunDir, port_client: Callable[[], Any], secret: Any,
            heartbeat_s: float = 0.1) -> Tuple[Any, threading.Event, Any]:
    """A verdict waiter of a host whose store is the test's, started in its own thread."""
    from peerwatch.core.config import LauncherFacts
    from peerwatch.hosts.bridge import _Link, _TorchGate, _VerdictWaiter
    from peerwatch.hosts.store_client import StoreClient

    config = Config.resolve({"heartbeat_interval": heartbeat_s, "peer_timeout": max(1.0, 2 * heartbeat_s),
                             "store_secret": secret}, env={})
    probe = port_client()
    facts = LauncherFacts(wants_store=True, spans_hosts=True, store=probe, run_id="secret-test")
    stopped = threading.Event()
    client = StoreClient(lambda t: port_client(), 1.0, "test-store-owner")
    link = _Link(config, run_dir, facts, client, stopped, Seal(config.store_secret))
    gate = _TorchGate()
    gate.open(threading.Event(), loud=True)
    waiter = _VerdictWaiter(link, gate)
    thread = threading.Thread(target=waiter.run, name="test-waiter", daemon=True)
    thread.start()
    return waiter, stopped, (client, thread)


def _stop(stopped: threading.Event, parts: Any) -> None:
    client, thread = parts
    stopped.set()
    client.close(time.monotonic() + 5.0)
    thread.join(10.0)
    assert not thread.is_alive()


def _local_verdict(run_dir: RunDir) -> Any:
    """The verdict the bridge wrote here, without the stamp of this host's boot clock it adds."""
    verdict = run_dir.read(EVENTS, VERDICT_FILE, Verdict)
    if verdict is not None:
        assert verdict.boot_ns is not None
        verdict = dataclasses.replace(verdict, boot_ns=None)
    return verdict


def _run_dir(tmp_path: Path) -> RunDir:
    for sub in (EVENTS, TMP):
        os.makedirs(tmp_path / "run" / sub, mode=0o700)
    return RunDir(str(tmp_path / "run"))


def test_without_a_secret_a_verdict_anyone_wrote_is_taken(store, tmp_path: Path):
    """Unchanged behaviour, and the threat: the store has no authentication."""
    _, client = store
    run_dir = _run_dir(tmp_path)
    waiter, stopped, parts = _waiter(run_dir, client, None)
    try:
        # Once the host looked (a verdict there before it did is an earlier job's).
        _wait("the waiter blocked in the store's wait", lambda: waiter.waiting, 20.0)
        client().set(PREFIX + "verdict", encode(_verdict(rank=3, exit_code=77)))  # a stranger's
        _wait("the verdict taken", lambda: _local_verdict(run_dir) is not None, 20.0)
        assert _local_verdict(run_dir).exit_code == 77
    finally:
        _stop(stopped, parts)


def test_with_a_secret_a_forged_verdict_is_ignored_and_the_waiter_keeps_waiting_the_fast_way(
        store, tmp_path: Path, caplog):
    """Issue 22.4 (b): a value under the verdict key that is not signed used to drop the
    waiter to polling once a heartbeat for the rest of the run. It is ignored, and the
    waiter stays blocked in the store's wait: a real verdict arrives in one round trip."""
    from peerwatch.hosts.store_protocol import establish_nonce, verdict_key

    _, client = store
    run_dir = _run_dir(tmp_path)
    caplog.set_level(logging.WARNING, logger="peerwatch")
    heartbeat_s = 30.0  # a waiter that fell back to polling would look again only after this
    waiter, stopped, parts = _waiter(run_dir, client, SECRET, heartbeat_s=heartbeat_s)
    try:
        forger = client()
        _wait("the waiter blocked in the store's wait", lambda: waiter.waiting, 20.0)
        forged = encode(_verdict(rank=3, exit_code=77))
        forger.set(PREFIX + "verdict", forged)
        # One who learned where this run's verdict goes (the store lists its keys once a
        # verdict is there) writes there too, unsigned.
        probe = Seal(SECRET.encode())
        establish_nonce(client(), PREFIX, probe)
        forger.set(verdict_key(PREFIX, probe), forged)
        _wait("a warning about the forged verdict",
              lambda: "not signed with this job's store secret" in caplog.text, 20.0)
        _wait("the waiter waiting again", lambda: waiter.waiting, 5.0)
        assert _local_verdict(run_dir) is None and waiter.from_store is None
        # A host of the job publishes its verdict: taken at once, not at the next poll.
        real = _verdict(rank=1, exit_code=9)
        published = time.monotonic()
        assert publish_verdict(client(), PREFIX, encode(real), Seal(SECRET.encode()))
        _wait("the signed verdict taken", lambda: _local_verdict(run_dir) is not None, 5.0)
        assert time.monotonic() - published < heartbeat_s / 3
        assert _local_verdict(run_dir) == real
        assert decode(Verdict, waiter.from_store) == real
        assert waiter.requests == 0  # never polled
    finally:
        _stop(stopped, parts)


def test_with_a_secret_forged_beats_and_host_records_are_not_there(store):
    _, client = store
    seal = Seal(SECRET.encode())
    me = HostInfo(0, "host-a", "boot-a", "ns-a", (0, 1), "ident-a")
    c = client()
    seen = exchange(c, Exchange(PREFIX, None, "ident-a", b"1", me, {}, 2, seal))
    assert seen.index == 0
    # A stranger registers host 1 and beats for it, unsigned.
    forger = client()
    forger.add(PREFIX + "hosts", 1)
    forger.set(PREFIX + "host/1", HostInfo(1, "evil", "b", "n", (2, 3), "ident-evil").to_json())
    forger.set(PREFIX + "beat/1", b"done:7")  # "done": would keep host 1 from ever being lost
    seen = exchange(c, Exchange(PREFIX, 0, "ident-a", b"2", None, {0: me}, 2, seal))
    assert seen.new_hosts == {}
    # A real host 1 signs its own: learned, and its beat read.
    other = HostInfo(1, "host-b", "boot-b", "ns-b", (2, 3), "ident-b")
    exchange(client(), Exchange(PREFIX, 1, "ident-b", b"5", other, {}, 2, seal))
    seen = exchange(c, Exchange(PREFIX, 0, "ident-a", b"3", None, {0: me}, 2, seal))
    assert seen.new_hosts == {1: other} and seen.beats == {1: b"5"}
    forger.set(PREFIX + "beat/1", b"done:8")
    seen = exchange(c, Exchange(PREFIX, 0, "ident-a", b"4", None, {0: me, 1: other}, 2, seal))
    assert seen.beats == {1: None}  # not there: no change, no "done"


# -- replays: values recorded from the store, written back (issue 22.4) ------------------------


def _record(reader: Any) -> dict:
    """Every key the store holds and its value, as one who can reach it may record them."""
    return {key: bytes(reader.get(key)) for key in reader.list_keys() if key.startswith(PREFIX)}


def _job_one_failed(client: Callable[[], Any]) -> dict:
    """Job 1 (two hosts, signed): host 1's rank 3 failed a minute ago; what its store held."""
    seal_a, seal_b = Seal(SECRET.encode()), Seal(SECRET.encode())
    a, b = client(), client()
    exchange(a, Exchange(PREFIX, None, "ident-a", b"1", HostInfo(0, "host-a", ranks=(0, 1), ident="ident-a"), {}, 2,
                         seal_a))
    exchange(b, Exchange(PREFIX, None, "ident-b", b"1", HostInfo(1, "host-b", ranks=(2, 3), ident="ident-b"), {}, 2,
                         seal_b))
    before = time.time_ns() - 60 * 10**9
    old = Verdict(rank=3, cause="exception", exit_code=77, failed_at_ns=before, detected_by=3, detected_at_ns=before)
    assert publish_verdict(b, PREFIX, encode(old), seal_b)
    return _record(client())


def _two_jobs() -> Tuple[dict, Any, Callable[[], Any]]:
    """Job 1's store as recorded after its failure (job 1 is gone), and job 2's store (keep
    it referenced: it is the server) with a factory of clients of it."""
    pytest.importorskip("torch")
    import torch.distributed as dist
    from harness import free_port

    port_1 = free_port()
    job_1 = dist.TCPStore("127.0.0.1", port_1, is_master=True, wait_for_workers=False)
    recorded = _job_one_failed(lambda: dist.TCPStore("127.0.0.1", port_1, is_master=False, wait_for_workers=False))
    del job_1
    port_2 = free_port()
    job_2 = dist.TCPStore("127.0.0.1", port_2, is_master=True, wait_for_workers=False)

    def client() -> Any:
        return dist.TCPStore("127.0.0.1", port_2, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=10))

    return recorded, job_2, client


def test_a_verdict_recorded_in_one_job_is_not_obeyed_in_the_next(tmp_path: Path, caplog):
    """Job 2 has the same run id and secret as job 1 (launched alike: the same
    MASTER_ADDR:MASTER_PORT, no rendezvous id). Job 1's store, recorded and written into
    job 2's once job 2's hosts are there, must not end job 2: it did, naming job 1's rank."""
    caplog.set_level(logging.WARNING, logger="peerwatch")
    recorded, job_2, client = _two_jobs()

    run_dir = _run_dir(tmp_path)
    seal = Seal(SECRET.encode())
    exchange(client(), Exchange(PREFIX, None, "ident-a", b"1", HostInfo(0, "host-a", ranks=(0, 1), ident="ident-a"),
                                {}, 2, seal))
    waiter, stopped, parts = _waiter(run_dir, client, SECRET)
    try:
        _wait("the waiter blocked in the store's wait", lambda: waiter.waiting, 20.0)
        replayer = client()
        for key, value in recorded.items():
            if not key.endswith("/nonce"):  # job 2 has its own by now
                replayer.set(key, value)
        time.sleep(1.0)  # a replayed verdict would be taken within a round trip
        assert _local_verdict(run_dir) is None and waiter.from_store is None
        # Job 2's own failure is taken.
        real = _verdict(rank=1, exit_code=9)
        assert publish_verdict(client(), PREFIX, encode(real), Seal(SECRET.encode()))
        _wait("job 2's verdict taken", lambda: _local_verdict(run_dir) is not None, 20.0)
        assert _local_verdict(run_dir) == real
    finally:
        _stop(stopped, parts)
        del job_2


def test_a_recorded_nonce_and_verdict_written_first_are_refused_as_there_before_the_host(tmp_path: Path, caplog):
    """The replayer is quicker: job 1's nonce and verdict are in job 2's store before any host
    of job 2 registers, so job 2 adopts job 1's nonce. The verdict was in the store before
    the host first looked (the store's order, not a clock's): refused, with a warning that
    says so; job 2's own verdict goes under the next key."""
    caplog.set_level(logging.WARNING, logger="peerwatch")
    recorded, job_2, client = _two_jobs()

    replayer = client()
    for key, value in recorded.items():
        replayer.set(key, value)
    run_dir = _run_dir(tmp_path)
    waiter, stopped, parts = _waiter(run_dir, client, SECRET)
    try:
        _wait("a warning about the old verdict", lambda: "before this host joined" in caplog.text, 20.0)
        _wait("the waiter waiting again", lambda: waiter.waiting, 5.0)
        assert _local_verdict(run_dir) is None and waiter.from_store is None
        real = _verdict(rank=1, exit_code=9)
        assert publish_verdict(client(), PREFIX, encode(real), Seal(SECRET.encode()), VerdictFrom())
        _wait("job 2's verdict taken", lambda: _local_verdict(run_dir) is not None, 20.0)
        assert _local_verdict(run_dir) == real
    finally:
        _stop(stopped, parts)
        del job_2


def test_two_recorded_beats_written_back_in_turn_do_not_keep_a_dead_host_alive(store, tmp_path: Path):
    """Host 1 beat twice and died; a replayer writes its two recorded (signed) beats back in
    turn. Its sequence number does not grow: host 1 is lost after peer_timeout (it was kept
    "alive" for as long as the replay went on)."""
    from peerwatch.core.config import LauncherFacts
    from peerwatch.core.records import Registration
    from peerwatch.hosts.bridge import _BeatLoop, _Link, _TorchGate
    from peerwatch.hosts.store_client import StoreClient
    from peerwatch.proc import identity

    _, client = store
    peer_timeout = 2.0
    dead = client()
    dead_seal = Seal(SECRET.encode())
    info = HostInfo(0, "host-dead", ranks=(2, 3), ident="ident-dead")
    beats = []
    for seq in (1, 2):
        exchange(dead, Exchange(PREFIX, None if seq == 1 else 0, "ident-dead", str(seq).encode(),
                                info if seq == 1 else None, {}, 2, dead_seal))
        beats.append(bytes(dead.get(PREFIX + "beat/0")))
    config = Config.resolve({"heartbeat_interval": 0.2, "peer_timeout": peer_timeout, "store_secret": SECRET}, env={})
    facts = LauncherFacts(wants_store=True, spans_hosts=True, store=client(), run_id="secret-test")
    stopped = threading.Event()
    owner = StoreClient(lambda t: client(), 1.0, "test-store-owner")
    link = _Link(config, _run_dir(tmp_path), facts, owner, stopped, Seal(config.store_secret))
    me = Registration(rank=0, pid=os.getpid(), ppid=os.getppid(), start_ticks=0, uid=os.getuid(),
                      host=identity.hostname(), boot_id=identity.boot_id(), pidns=identity.pid_namespace(),
                      time_ns=time.time_ns())
    seq = iter(range(1, 1_000_000))
    loop = _BeatLoop(link, me, "ident-alive", lambda: next(seq), threading.Event(), lambda: False, _TorchGate())
    thread = threading.Thread(target=loop.run, name="test-beat", daemon=True)
    replaying = threading.Event()

    def replay() -> None:
        replayer = client()
        for n in itertools.count():  # each value for a few of the watcher's looks: every change is seen
            replayer.set(PREFIX + "beat/0", beats[n % 2])
            if replaying.wait(0.5):
                return

    replayer_thread = threading.Thread(target=replay, name="test-replayer", daemon=True)
    thread.start()
    replayer_thread.start()
    try:
        _wait("host 0 watched", lambda: 0 in loop.hosts, 20.0)
        _wait("the dead host judged lost", lambda: 0 in loop._lost_reported, peer_timeout + 10.0)
    finally:
        replaying.set()
        stopped.set()
        owner.close(time.monotonic() + 5.0)
        thread.join(10.0)
        replayer_thread.join(10.0)
    assert not thread.is_alive() and not replayer_thread.is_alive()
