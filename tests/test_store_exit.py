"""Nothing left running may abort the interpreter at exit: a rank that ends cleanly while
its store bridge is inside a store request (the store stopped answering; the verdict
waiter's ``wait``) exits 0 with its success marker.

Before the fix, Python finalized under those threads: one that woke up then (its store
answered, or went away) was torn down inside torch's C++ client (std::terminate,
"terminate called without an active exception": SIGABRT), or the client was destroyed
while in use (SIGSEGV). The program makes its finalization slow (a loaded host) and the
test ends the store in that window.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Tuple

import pytest
from harness import _FOREIGN_ENV

from peerwatch.rundir.rundir import EVENTS, rank_file

PROGRAM = Path(__file__).with_name("store_exit_program.py")
SERVE = ("import datetime, sys, torch.distributed as d; "
         "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)); "
         "print(s.port, flush=True); sys.stdin.read()")
SLOW_S = 5.0  # the rank's finalization, made this slow: the store is ended inside it
START_S = 60.0  # python, peerwatch, torch and a bridge connected, on a loaded 2-core host
EXIT_S = 30.0  # from "go" to the rank gone: its bounded store work (a few seconds), or its finalization


def _end_with_the_store_silent(tmp_path: Path, end: str) -> Tuple[int, str, bool, str]:
    """Run the program to its end (``end``) with its store stopped, the store ended if the
    rank gets to finalize. (returncode, stderr, success marker written, results file)."""
    env = {k: v for k, v in os.environ.items() if k not in _FOREIGN_ENV and k != "PEERWATCH_STORE"}
    store = subprocess.Popen([sys.executable, "-c", SERVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=env)
    rank = None
    finalizing, results = tmp_path / f"finalizing-{end}", tmp_path / f"results-{end}"
    try:
        port = int(store.stdout.readline())  # type: ignore[union-attr]
        rank = subprocess.Popen(
            [sys.executable, str(PROGRAM), "--finalizing", str(finalizing), "--slow", str(SLOW_S), "--end", end,
             "--results", str(results)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=dict(env, PEERWATCH_DIR=str(tmp_path / f"run-{end}"), PEERWATCH_STORE=f"127.0.0.1:{port}",
                     PEERWATCH_RUN_ID=f"store-exit-{end}"))
        said, _, run_dir = rank.stdout.readline().strip().partition(" ")  # type: ignore[union-attr]
        assert said == "connected", f"{said} {run_dir}"
        os.kill(store.pid, signal.SIGSTOP)  # the store stops answering
        rank.stdin.write("go\n")  # type: ignore[union-attr]
        rank.stdin.flush()  # type: ignore[union-attr]
        deadline = time.monotonic() + EXIT_S
        while rank.poll() is None and not finalizing.exists():
            assert time.monotonic() < deadline, f"rank not gone {EXIT_S}s after its program ended"
            try:
                rank.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                pass
        if rank.poll() is None:  # Python finalizes: the store goes away now, its connections with it
            store.kill()
        _, err = rank.communicate(timeout=EXIT_S + SLOW_S)
    finally:
        store.kill()
        store.communicate()
        if rank is not None and rank.poll() is None:
            rank.kill()
            rank.communicate()
    written = results.read_text() if results.exists() else ""
    return rank.returncode, err, (Path(run_dir) / EVENTS / rank_file("success", 0)).exists(), written


@pytest.mark.torch
@pytest.mark.timeout(3 * (START_S + EXIT_S + SLOW_S) + 30)
def test_a_clean_exit_with_the_store_silent_is_a_success_not_a_crash(tmp_path: Path) -> None:
    """It runs to its end, or sys.exit(0): exit 0, success marker, its open file flushed.
    A ``raise SystemExit(3)`` (its status seen by no hook) is never taken for a success."""
    pytest.importorskip("torch.distributed")
    for end in ("return", "exit0"):
        code, err, succeeded, written = _end_with_the_store_silent(tmp_path, end)
        assert (code, succeeded) == (0, True), f"{end}: exit {code}, success marker {succeeded}\n{err[-3000:]}"
        assert "terminate called" not in err, err[-3000:]
        assert written == "the last result\n", f"{end}: {written!r}"
    code, err, succeeded, _ = _end_with_the_store_silent(tmp_path, "raise3")
    assert code != 0 and not succeeded, f"raise SystemExit(3): exit {code}, success marker {succeeded}\n{err[-3000:]}"
