"""The store bridge's parts that need threads or processes but no store: the client's owner
thread and its bounded calls (``store_client``), and the lock election (``election``)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, List

import pytest

from peerwatch.hosts.election import Election, UpFlag, connected_elsewhere
from peerwatch.hosts.store_client import MAX_RETIRED, StoreClient, StoreOverrun
from peerwatch.rundir.rundir import RunDir

# -- one owner thread per client ----------------------------------------------------------


class _Conn:
    """A client that records which thread made and used it."""

    def __init__(self, made: List["_Conn"]) -> None:
        self.made_by = threading.current_thread()
        self.used_by: List[threading.Thread] = []
        made.append(self)

    def use(self, result: Any = None) -> Any:
        self.used_by.append(threading.current_thread())
        return result


def test_the_client_is_made_and_used_only_by_its_owner_thread() -> None:
    made: List[_Conn] = []
    client = StoreClient(lambda t: _Conn(made), 1.0, "test-owner")
    results = []

    def caller(i: int) -> None:
        results.append(client.call(lambda c: c.use(i), 5.0))

    callers = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert sorted(results) == [0, 1, 2, 3]
    assert len(made) == 1 and made[0].made_by.name == "test-owner"
    assert set(made[0].used_by) == {made[0].made_by}
    assert client.close(time.monotonic() + 5.0) == []
    assert not made[0].made_by.is_alive()


def test_the_connection_is_made_with_a_request_timeout() -> None:
    timeouts: List[float] = []
    client = StoreClient(lambda t: timeouts.append(t) or object(), 2.5, "test-owner")
    client.call(lambda c: None, 5.0)
    client.call(lambda c: None, 5.0)
    assert timeouts == [2.5]  # once: the connection is kept
    client.close(time.monotonic() + 5.0)


def test_an_error_is_raised_to_the_caller_and_the_connection_is_made_again() -> None:
    made: List[_Conn] = []
    client = StoreClient(lambda t: _Conn(made), 1.0, "test-owner")

    def fail(c: _Conn) -> None:
        raise ConnectionResetError("gone")

    with pytest.raises(ConnectionResetError):
        client.call(fail, 5.0)
    assert client.call(lambda c: c.use(1), 5.0) == 1
    assert len(made) == 2 and made[0].made_by is made[1].made_by  # same owner, new connection
    client.close(time.monotonic() + 5.0)


def test_a_call_that_overruns_retires_its_owner_and_the_next_call_gets_a_new_one() -> None:
    made: List[_Conn] = []
    client = StoreClient(lambda t: _Conn(made), 1.0, "test-owner")
    release = threading.Event()
    started = time.monotonic()
    with pytest.raises(StoreOverrun):
        client.call(lambda c: release.wait(10.0), 0.2)
    assert 0.2 <= time.monotonic() - started < 2.0
    assert client.call(lambda c: c.use(2), 5.0) == 2
    assert len(made) == 2 and made[0].made_by is not made[1].made_by
    release.set()
    made[0].made_by.join(5.0)
    assert not made[0].made_by.is_alive()  # the retired owner ends once its call returns
    client.close(time.monotonic() + 5.0)


def test_owners_stuck_in_a_request_do_not_pile_up_per_retry() -> None:
    """A store that never answers: each overrun retired its owner (a thread and a connection,
    blocked for good) and the next call started another, without end (a bridge grew by
    hundreds of MB in a minute). At most MAX_RETIRED are left; then calls fail at once, and
    once the store answers again a call gets a new owner."""
    made: List[_Conn] = []
    client = StoreClient(lambda t: _Conn(made), 1.0, "test-owner-stuck")
    release = threading.Event()
    try:
        for _ in range(3 * MAX_RETIRED):
            with pytest.raises(StoreOverrun):
                client.call(lambda c: release.wait(30.0), 0.05)
        alive = [t for t in threading.enumerate() if t.name == "test-owner-stuck"]
        assert len(made) == MAX_RETIRED and len(alive) == MAX_RETIRED
    finally:
        release.set()
        for conn in made:
            conn.made_by.join(5.0)
    assert client.call(lambda c: c.use(3), 5.0) == 3
    assert len(made) == MAX_RETIRED + 1
    client.close(time.monotonic() + 5.0)


def _hangs(entered: threading.Event, release: threading.Event) -> Callable[[object], None]:
    """A store request that says it has begun, then hangs until released (10 s at most)."""

    def request(c: object) -> None:
        entered.set()
        release.wait(10.0)

    return request


def test_calls_queued_behind_a_hung_one_fail_when_it_is_given_up() -> None:
    client = StoreClient(lambda t: object(), 1.0, "test-owner")
    release, entered = threading.Event(), threading.Event()
    behind: List[BaseException] = []

    def queued() -> None:
        try:
            client.call(lambda c: None, 10.0)
        except StoreOverrun as e:
            behind.append(e)

    # Given up after 2 s: the call behind it must be queued by then (a loaded machine).
    hung = threading.Thread(target=lambda: pytest.raises(StoreOverrun, client.call, _hangs(entered, release), 2.0))
    hung.start()
    assert entered.wait(5.0)
    waiter = threading.Thread(target=queued)
    waiter.start()
    waiter.join(5.0)
    assert not waiter.is_alive() and len(behind) == 1
    release.set()
    hung.join()
    client.close(time.monotonic() + 5.0)


def test_connecting_gets_its_allowance_only_when_there_is_no_connection() -> None:
    client = StoreClient(lambda t: time.sleep(0.3) or object(), 1.0, "test-owner")
    assert client.call(lambda c: 1, 0.1, connect_s=2.0) == 1  # 0.3 s to connect: within the allowance
    with pytest.raises(StoreOverrun):
        client.call(lambda c: time.sleep(0.3), 0.1, connect_s=2.0)  # connected: no allowance
    client.close(time.monotonic() + 5.0)


def test_close_fails_waiting_callers_at_once_and_joins_idle_owners() -> None:
    client = StoreClient(lambda t: object(), 1.0, "test-owner")
    release, entered = threading.Event(), threading.Event()
    errors: List[BaseException] = []

    def caller() -> None:
        try:
            client.call(_hangs(entered, release), 30.0)
        except StoreOverrun as e:
            errors.append(e)

    t = threading.Thread(target=caller)
    t.start()
    assert entered.wait(5.0)
    started = time.monotonic()
    stuck = client.close(time.monotonic() + 0.3)
    t.join(5.0)
    assert errors and time.monotonic() - started < 2.0
    assert [s.name for s in stuck] == ["test-owner"]  # still in its call: not joinable
    release.set()
    stuck[0].join(5.0)
    assert not stuck[0].is_alive()
    with pytest.raises(StoreOverrun):
        client.call(lambda c: None, 1.0)  # closed


# -- lock election ---------------------------------------------------------------------------

_HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.lockf(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


def _holder(path: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"held\n"
    return proc


def _release(proc: subprocess.Popen) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(10)
    assert proc.stdout is not None
    proc.stdout.close()


def test_one_process_wins_the_election_and_a_successor_takes_over(tmp_path: Path) -> None:
    rd = RunDir(str(tmp_path))
    other = _holder(str(tmp_path / "bridge.lock"))
    try:
        election = Election(rd)
        assert not election.take() and not election.take()  # tried again, still taken
        assert election.fd is None and not election.broken
    finally:
        _release(other)  # its process ends: the kernel drops the lock
    assert election.take() and election.fd is not None
    assert election.take()  # held: no second claim
    os.close(election.fd)


def test_an_election_that_cannot_lock_gives_up_once(tmp_path: Path) -> None:
    rd = RunDir(str(tmp_path))
    (tmp_path / "elsewhere").write_text("")
    os.symlink(tmp_path / "elsewhere", tmp_path / "bridge.lock")  # never followed
    election = Election(rd)
    assert not election.take() and election.broken
    assert not election.take()


def test_the_up_flag_is_seen_by_other_processes_only_while_raised(tmp_path: Path) -> None:
    rd = RunDir(str(tmp_path))
    assert not connected_elsewhere(rd)  # never raised: no file
    other = _holder(str(tmp_path / "bridge.up"))  # another process's bridge, connected
    try:
        assert connected_elsewhere(rd)
        flag = UpFlag(rd)
        flag.set(True)  # a second bridge cannot raise it while the first holds it
        assert flag._fd is None
    finally:
        _release(other)
    assert not connected_elsewhere(rd)  # its process ended: not connected, nothing stale
    flag.set(True)
    assert flag._fd is not None
    flag.set(True)  # raised twice: one lock
    flag.set(False)
    assert flag._fd is None
    flag.set(False)
