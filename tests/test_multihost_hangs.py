"""Hangs across hosts: every host's diagnosis names the laggards of every other host.

Two simulated hosts (tests/test_multihost.py's ``cluster``: PID + UTS namespaces, a run
directory each, one TCPStore served by rank 0), one gloo process group of four ranks, two
per host. Both ranks of host B stop at step 30 and loop in Python (asleep, no beat), while
host A's ranks wait in all_reduce #31. Each host alone sees nothing wrong: its own ranks
agree. Through the store (docs/multi-node.md, "Hangs across hosts"), both diagnose it.
And a host of one rank blocked on a lock, with nothing set: both hosts name it at the
stuck threshold, not from half the learnt one (issue 34).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Iterator, Optional

import pytest
from test_multihost import START_S, Cluster, Host, multihost

from peerwatch.core.records import HANG, HANG_EXIT_CODE

STEP = 30
BEHAVE = [f"{r}=gloo" for r in (0, 1)] + [f"{r}=gloo:loop_at={STEP}" for r in (2, 3)]
WARN_S = 3.0
# The stall -> a diagnosis on both hosts: the warning threshold, the samples that tell busy
# from stuck (3 heartbeats), a summary through the store (a heartbeat each way), on 2 loaded cores.
DIAGNOSED_S = WARN_S + 15.0
# A whole host plainly stuck -> named on both hosts: the stuck threshold (10 s), a summary
# each way through the store; well under the learnt threshold (60 s), on 2 loaded cores.
# A bound, not a measure: the timing belongs to benchmarks/hang_hosts.py.
STUCK_HOST_S = 40.0
TORN_DOWN = {HANG_EXIT_CODE, -signal.SIGTERM}  # a rank too slow to act on the verdict is SIGTERMed by a peer


def _diagnosis(h: Host) -> Optional[dict]:
    try:
        return json.loads((h.run / "events" / "diagnosis.json").read_text())
    except (OSError, ValueError):
        return None


@pytest.fixture
def two_hosts(tmp_path: Path, no_leaks: str) -> Iterator[Cluster]:
    """Hosts a (ranks 0, 1) and b (ranks 2, 3), not started yet; closed (never killed) after."""
    c = Cluster(tmp_path, names=("a", "b"))
    yield c
    c.close()


def _start(c: Cluster, **env: str) -> Cluster:
    c.start(behave=BEHAVE, serve=False, env={"PEERWATCH_HANG_WARN": str(WARN_S), **env})
    c.wait_connected()
    b = c.hosts["b"]
    c._wait(lambda: all((b.ready / f"doing-{r}").exists() for r in (2, 3)), START_S + 10,
            f"host b's ranks looping at step {STEP}")
    return c


@multihost
@pytest.mark.timeout(120)
def test_every_host_names_the_laggards_on_another_host(two_hosts: Cluster) -> None:
    """hang_warn only: both hosts' events/diagnosis.json name ranks 2 and 3 on host b,
    host A's (whose ranks all wait in the same all_reduce) included."""
    c = _start(two_hosts)
    a, b = c.hosts["a"], c.hosts["b"]

    def both() -> bool:
        return all((d := _diagnosis(h)) is not None and d["laggards"] == [2, 3] for h in (a, b))

    c._wait(both, DIAGNOSED_S, "both hosts naming ranks 2 and 3",
            lambda: "\n".join(f"{h.name}: {_diagnosis(h)}" for h in (a, b)))
    for h in (a, b):
        d = _diagnosis(h)
        assert d is not None and d["finding"] == HANG and d["seq"] == STEP + 1, d
        assert d["entered"] == [0, 1], d
        assert "ranks 2, 3 on host hostb never entered" in d["detail"], d
    for h in (a, b):  # hang_warn only warns: the job would wait for gloo's timeout
        h.signal("init", signal.SIGKILL)
    c.wait_gone(["a", "b"], within=10.0)


@multihost
@pytest.mark.timeout(120)
def test_hang_timeout_auto_ends_every_host_naming_the_laggard_on_another(two_hosts: Cluster) -> None:
    """hang_timeout=auto: whichever host diagnoses it first, its verdict (rank 2 on host b,
    cause hang) reaches the other through the store, and every rank exits 124."""
    c = _start(two_hosts, PEERWATCH_HANG_TIMEOUT="auto")
    c.wait_gone(["a", "b"], within=DIAGNOSED_S + 10)
    for h in c.hosts.values():
        v = h.verdict()
        assert v is not None, h.logs()
        assert (v["rank"], v["cause"], v["host"]) == (2, HANG, "hostb"), f"{v}\n{h.logs()}"
        assert set(h.exit_codes().values()) <= TORN_DOWN, f"{h.exit_codes()}\n{h.logs()}"
    assert HANG_EXIT_CODE in c.hosts["a"].exit_codes().values()


@multihost
@pytest.mark.timeout(180)
def test_a_whole_host_stuck_is_named_by_the_other_at_the_stuck_threshold(tmp_path: Path, no_leaks: str) -> None:
    """Issue 34: host b's one rank blocked on a lock (no CPU, no I/O) at step 30, host a's
    waiting in all_reduce #31: each host alone sees nothing. With nothing set (the learnt
    threshold, a minute; gloo's timeout 10 minutes, so no cap shortens it), b's summary
    says it is plainly stuck from the stuck threshold, and both hosts name rank 1 on host b
    well before the learnt threshold (before: from half of it, 30 s, at the earliest)."""
    c = Cluster(tmp_path, names=("a", "b"), per_host=1)
    try:
        c.start(behave=["0=gloo", f"1=gloo:lock_at={STEP}"], serve=False, env={"MULTIHOST_GLOO_TIMEOUT_S": "600"})
        c.wait_connected()
        a, b = c.hosts["a"], c.hosts["b"]
        doing = b.ready / "doing-1"
        c._wait(doing.exists, START_S + 10, f"host b's rank stuck at step {STEP}")
        onset_ns = doing.stat().st_mtime_ns

        def both() -> bool:
            return all((d := _diagnosis(h)) is not None and d["laggards"] == [1] for h in (a, b))

        c._wait(both, STUCK_HOST_S, "both hosts naming rank 1 on host b",
                lambda: "\n".join(f"{h.name}: {_diagnosis(h)}" for h in (a, b)))
        for h in (a, b):
            d = _diagnosis(h)
            assert d is not None and d["finding"] == HANG and d["seq"] == STEP + 1 and d["entered"] == [0], d
            assert "rank 1 on host hostb never entered" in d["detail"], d
            print(f"host {h.name}: named {(d['time_ns'] - onset_ns) / 1e9:.1f}s after the onset")
        for h in (a, b):  # hang_warn only warns: the job would wait for gloo's timeout
            h.signal("init", signal.SIGKILL)
        c.wait_gone(["a", "b"], within=10.0)
    finally:
        c.close()
