"""A straggler on another host: named on every host, through the store.

Two simulated hosts (tests/test_multihost.py's ``cluster``), one gloo process group of four
ranks, two per host; rank 3, on host b, computes 0.09 s a step, the others 0.06 s. Host b's
bridge publishes its ranks' waits (``strag/1``, one value per host); host a's judge judges
the four ranks and publishes the finding (``strag/found``), which host b's bridge copies.
The heartbeat is test_multihost's 0.5 s; the slots are harness.straggler_env()'s 1 s (2
heartbeats, as many samples as 2.5 s slots hold at the default rate): a first finding after 6 s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, List, Optional

import pytest
from harness import straggler_env
from test_multihost import START_S, Cluster, Host, multihost

BEHAVE = [f"{r}=gloo:step=0.06" for r in (0, 1, 2)] + ["3=gloo:step=0.09"]
NAMED_S = 40.0  # 6 slots (6 s), a slot to reach host a and one to come back, on 2 loaded cores


def _found(h: Host) -> Optional[List[dict]]:
    try:
        return list(json.loads((h.run / "stragglers.json").read_text())["stragglers"])
    except (OSError, ValueError, KeyError):
        return None


@pytest.fixture
def two_hosts(tmp_path: Path, no_leaks: str) -> Iterator[Cluster]:
    c = Cluster(tmp_path, names=("a", "b"))
    yield c
    c.close()


@multihost
@pytest.mark.timeout(150)
def test_a_straggler_on_another_host_is_named_on_every_host(two_hosts: Cluster) -> None:
    c = two_hosts
    c.start(behave=BEHAVE, serve=False, env=straggler_env())
    c.wait_connected()
    a, b = c.hosts["a"], c.hosts["b"]
    c._wait(lambda: all((h.ready / f"pg-{r}").exists() for h in (a, b) for r in h.ranks), START_S,
            "every rank in the process group")

    def both() -> bool:
        return all((f := _found(h)) and [(s["rank"], s["host"]) for s in f] == [(3, "hostb")] for h in (a, b))

    c._wait(both, NAMED_S, "both hosts naming rank 3 on host b", lambda: f"a: {_found(a)}\nb: {_found(b)}")
    for h in (a, b):
        found = _found(h)
        assert found is not None and 0.2 <= found[0]["share"] <= 0.45, found
    # The line is logged right after the finding is written: one on each host.
    c._wait(lambda: all(h.logs().count("straggler: rank 3 (on hostb)") == 1 for h in (a, b)), 10.0,
            "each host logging it once")
    for h in (a, b):
        h.signal("init", 9)
    c.wait_gone(["a", "b"], within=10.0)
