"""No peerwatch thread imports torch while the application may be importing it.

A rank with a store configured (``PEERWATCH_STORE``) that calls ``install()`` and then
``import torch.distributed`` (the README's order): before the fix, the store bridge's beat
thread imported torch itself as soon as it started, and a main thread whose own import
began while the bridge's was under way deadlocked with it inside importlib; Python broke the
deadlock with half-initialised modules ("'torch._C' is not a package") and the process
aborted (``terminate called after throwing an instance of 'python_error'``). The program
below starts its import at that very moment; before the fix it aborted in 4 runs of 4.
Now the bridge starts only once the application's own import has finished; a rank that
never imports torch gets no bridge, and, with a store named, a warning after peer_timeout.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest
from harness import _FOREIGN_ENV

PROGRAM = Path(__file__).with_name("store_import_race_program.py")
HEARTBEAT_S = 0.01  # the bridge starts at the watcher's first tick: early, inside the main thread's window
TICKS = 5  # where no bridge thread imports torch, the main thread imports it after this many heartbeats
RUNS = 3
WAIT_S = 30.0  # the bridge connected after the import (torch takes seconds on a loaded 2-core host)
RUN_S = 90.0  # one program, start to end


@pytest.fixture
def store() -> Iterator[str]:
    """A TCPStore served by this process: ``host:port``."""
    dist = pytest.importorskip("torch.distributed")
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    yield f"127.0.0.1:{server.port}"
    del server


def _run(tmp_path: Path, store: str, name: str, ticks: int = TICKS, no_import: bool = False,
         env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    run_env = {k: v for k, v in os.environ.items() if k not in _FOREIGN_ENV and k != "PEERWATCH_STORE"}
    run_env.update(PEERWATCH_DIR=str(tmp_path / name), PEERWATCH_STORE=store, PEERWATCH_RUN_ID=f"import-{name}",
                   OMP_NUM_THREADS="1", **(env or {}))
    argv = [sys.executable, str(PROGRAM), "--heartbeat", str(HEARTBEAT_S), "--ticks", str(ticks),
            "--wait", str(WAIT_S)] + (["--no-import"] if no_import else [])
    proc = subprocess.run(argv, env=run_env, capture_output=True, text=True, timeout=RUN_S)
    lines = proc.stdout.strip().splitlines()
    return {"run": name, "rc": proc.returncode, "stderr": proc.stderr,
            **(json.loads(lines[-1]) if proc.returncode == 0 and lines else {})}


@pytest.mark.torch
@pytest.mark.timeout(RUNS * RUN_S + 30)
def test_the_application_imports_torch_while_the_bridge_could_start(tmp_path: Path, store: str) -> None:
    results: List[Dict[str, Any]] = [_run(tmp_path, store, f"run{i}") for i in range(RUNS)]
    bad = [r for r in results if r["rc"] != 0 or r.get("bridge_first") or not r.get("connected")
           or "no store bridge" in r["stderr"]]
    assert not bad, f"{len(bad)} of {len(results)} runs broken:\n" + "\n".join(
        f"{r['run']}: exit {r['rc']}, {r}\n{r['stderr'][-800:]}" for r in bad)


@pytest.mark.torch
@pytest.mark.timeout(RUN_S + 30)
def test_a_rank_that_never_imports_torch_gets_no_bridge_and_a_warning(tmp_path: Path, store: str) -> None:
    """peer_timeout 0.2 s: the warning comes within the program's 100 heartbeats (1 s)."""
    r = _run(tmp_path, store, "never", ticks=100, no_import=True, env={"PEERWATCH_PEER_TIMEOUT": "0.2"})
    assert r["rc"] == 0, r["stderr"][-2000:]
    assert (r["torch"], r["bridge"]) == (False, False), r
    assert r["stderr"].count("no store bridge yet: this process has not imported torch.distributed") == 1, r["stderr"]
