"""The bridge's beat thread against a real TCPStore whose answers the test can withhold:
one slow or failed interval on a loaded host is not a lost store. Until the store has been
silent for peer_timeout, the host stays connected (its ``bridge.up`` raised), so an
exception of a local rank is still held back as a possible echo of a death elsewhere."""

from __future__ import annotations

import datetime
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, List

import pytest

pytest.importorskip("torch")

from harness import free_port  # noqa: E402

from peerwatch.core.config import Config, LauncherFacts  # noqa: E402
from peerwatch.core.records import Registration  # noqa: E402
from peerwatch.hosts.bridge import _BeatLoop, _Link, _TorchGate  # noqa: E402
from peerwatch.hosts.store_client import StoreClient  # noqa: E402
from peerwatch.proc import identity  # noqa: E402
from peerwatch.rundir.rundir import RunDir  # noqa: E402

PEER_TIMEOUT_S = 3.0
HEARTBEAT_S = 0.2


class _Withheld:
    """A store client whose every request fails while ``withhold`` is set."""

    def __init__(self, store: Any, withhold: threading.Event, failures: List[float]) -> None:
        self._store, self._withhold, self._failures = store, withhold, failures

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if self._withhold.is_set():
                self._failures.append(time.monotonic())
                raise RuntimeError("the store did not answer in time")
            return attr(*args, **kwargs)

        return call


def _wait(what: str, cond: Callable[[], bool], within: float) -> None:
    deadline = time.monotonic() + within
    while not cond():
        assert time.monotonic() < deadline, f"not within {within}s: {what}"
        time.sleep(0.01)


def test_one_failed_interval_keeps_the_host_connected_until_peer_timeout(tmp_path: Path) -> None:
    import torch.distributed as dist

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    withhold, failures = threading.Event(), []  # type: ignore[var-annotated]
    client = StoreClient(lambda t: _Withheld(dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                                           timeout=datetime.timedelta(seconds=t)),
                                             withhold, failures), 1.0, "test-store-owner")
    config = Config.resolve({"heartbeat_interval": HEARTBEAT_S, "peer_timeout": PEER_TIMEOUT_S}, env={})
    facts = LauncherFacts(wants_store=True, spans_hosts=True, store=f"127.0.0.1:{port}", run_id="beat-loop-test")
    run_dir = RunDir(str(tmp_path))
    stopped = threading.Event()
    link = _Link(config, run_dir, facts, client, stopped)
    me = Registration(rank=0, pid=os.getpid(), ppid=os.getppid(), start_ticks=0, uid=os.getuid(),
                      host=identity.hostname(), boot_id=identity.boot_id(), pidns=identity.pid_namespace(),
                      time_ns=time.time_ns())
    seq = iter(range(1, 1_000_000))
    loop = _BeatLoop(link, me, "ident", lambda: next(seq), threading.Event(), lambda: False, _TorchGate())
    thread = threading.Thread(target=loop.run, name="test-beat", daemon=True)
    thread.start()
    try:
        _wait("the first exchange", lambda: loop._up._fd is not None, 30.0)
        withhold.set()
        # Two failed intervals (the first one handled before the second is tried), well
        # inside peer_timeout: the host is still connected, its flag still raised.
        _wait("two failed intervals", lambda: len(failures) >= 2, 10.0)
        if time.monotonic() - failures[0] < PEER_TIMEOUT_S / 2:
            assert loop._up._fd is not None, "a failed interval lowered the host's up flag"
            assert loop.connected
        _wait("the store judged lost after peer_timeout", lambda: not loop.connected, PEER_TIMEOUT_S + 5.0)
        assert loop._up._fd is None
    finally:
        stopped.set()
        client.close(time.monotonic() + 5.0)
        thread.join(10.0)
        del server
    assert not thread.is_alive()
