"""The store secret (issue 14): TCPStore has no authentication, so anyone who can reach it
could write a verdict that ends the job with an exit code of their choice. With
``store_secret`` set, peerwatch signs what it writes there (HMAC-SHA256 over key and
value) and ignores, with one warning, what is not signed with it. Without a secret,
nothing changes. The store is a real TCPStore; the forger is another client of it."""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Tuple

import pytest

from peerwatch import Config, ConfigError
from peerwatch._config import SECRET_SHOWN
from peerwatch._hosts import HostInfo
from peerwatch._records import Verdict, decode, encode
from peerwatch._rundir import EVENTS, TMP, VERDICT_FILE, RunDir
from peerwatch._store_protocol import SIGNED, Exchange, Seal, exchange, publish_verdict

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


def test_a_signed_value_opens_only_under_its_key_with_its_secret(caplog):
    seal = Seal(SECRET.encode())
    signed = seal.sign(PREFIX + "beat/1", b"42")
    assert signed.startswith(SIGNED) and seal.open(PREFIX + "beat/1", signed) == b"42"
    with caplog.at_level(logging.WARNING, logger="peerwatch"):
        assert seal.open(PREFIX + "beat/2", signed) is None  # replayed under another key
        assert Seal(b"another-secret-of-16-bytes").open(PREFIX + "beat/1", signed) is None
        assert seal.open(PREFIX + "beat/1", signed[:-1] + b"3") is None  # value changed
        assert seal.open(PREFIX + "beat/1", b"43") is None  # unsigned
        assert seal.open(PREFIX + "verdict", b"{}") is None
    warned = [r for r in caplog.records if "not signed with this job's store secret" in r.getMessage()]
    assert len(warned) == 3, [r.getMessage() for r in warned]  # once per kind of key and Seal: beat, beat, verdict


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


def _waiter(run_dir: RunDir, port_client: Callable[[], Any], secret: Any) -> Tuple[Any, threading.Event, Any]:
    """A verdict waiter of a host whose store is the test's, started in its own thread."""
    from peerwatch._bridge import _Link, _TorchGate, _VerdictWaiter
    from peerwatch._config import LauncherFacts
    from peerwatch._store_client import StoreClient

    config = Config.resolve({"heartbeat_interval": 0.1, "peer_timeout": 1.0, "store_secret": secret}, env={})
    probe = port_client()
    facts = LauncherFacts(wants_store=True, spans_hosts=True, store=probe, run_id="secret-test")
    stopped = threading.Event()
    client = StoreClient(lambda t: port_client(), 1.0, "test-store-owner")
    link = _Link(config, run_dir, facts, client, stopped, Seal(config.store_secret))
    gate = _TorchGate()
    gate.open(loud=True)
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
    return run_dir.read(EVENTS, VERDICT_FILE, Verdict)


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
        client().set(PREFIX + "verdict", encode(_verdict(rank=3, exit_code=77)))  # a stranger's
        _wait("the verdict taken", lambda: _local_verdict(run_dir) is not None, 20.0)
        assert _local_verdict(run_dir).exit_code == 77
    finally:
        _stop(stopped, parts)


def test_with_a_secret_a_forged_verdict_is_ignored_and_a_signed_one_taken(store, tmp_path: Path, caplog):
    _, client = store
    run_dir = _run_dir(tmp_path)
    caplog.set_level(logging.WARNING, logger="peerwatch")
    waiter, stopped, parts = _waiter(run_dir, client, SECRET)
    try:
        forger = client()
        forged = encode(_verdict(rank=3, exit_code=77))
        forger.set(PREFIX + "verdict", forged)
        _wait("a warning about the forged verdict",
              lambda: "not signed with this job's store secret" in caplog.text, 20.0)
        assert _local_verdict(run_dir) is None and waiter.from_store is None
        # A host of the job publishes its verdict: it replaces the forged one.
        real = _verdict(rank=1, exit_code=9)
        host = client()
        assert publish_verdict(host, PREFIX, encode(real), Seal(SECRET.encode()))
        _wait("the signed verdict taken", lambda: _local_verdict(run_dir) is not None, 20.0)
        assert _local_verdict(run_dir) == real
        assert decode(Verdict, waiter.from_store) == real
        # Once by the waiter (however often it looked), once by the host that replaced it.
        assert caplog.text.count("not signed with this job's store secret") == 2
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
