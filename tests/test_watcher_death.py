"""A watcher that dies never leaves its rank silently unprotected (issue 14): it logs the
failure at ERROR with its traceback, records it in the run directory, and
``peerwatch status`` says "rank N: watcher died at ...: <error>; this rank is unprotected".

The failure is injected in a real rank process by replacing its watcher's heartbeat writer
(peerwatch's own code, not the OS): after the configuration bounds, no setting is left that
kills the watcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from peerwatch.core.records import Registration, WatcherDeath, encode
from peerwatch.rundir.rundir import EVENTS, RANKS, TMP, RunDir, rank_file
from peerwatch.tools import cli
from peerwatch.watcher import record_death

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parent.parent
DEADLINE_S = 30.0

RANK = textwrap.dedent("""
    import logging, sys, time
    import peerwatch
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    handle = peerwatch.install(heartbeat_interval=0.2)

    def fail(*args, **kwargs):
        raise RuntimeError("injected: the heartbeat cannot be written")

    handle._w.heartbeat.write = fail  # the watcher's next heartbeat raises
    open(sys.argv[1], "w").close()
    time.sleep(60)  # the training goes on
""")


def _status(run_dir: Path) -> str:
    out = subprocess.run([sys.executable, "-m", "peerwatch", "status", str(run_dir)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=30, check=True,
                         cwd=run_dir)
    return out.stdout


def test_a_dying_watcher_is_logged_recorded_and_shown_by_status(tmp_path: Path) -> None:
    run_dir, ready, log = tmp_path / "run", tmp_path / "ready", tmp_path / "rank.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PEERWATCH_DIR": str(run_dir), "RANK": "0", "WORLD_SIZE": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", RANK, str(ready)], env=env, stdout=out, stderr=subprocess.STDOUT,
                                cwd=tmp_path)  # not the checkout: PYTHONPATH says which peerwatch
    try:
        note = run_dir / EVENTS / rank_file("watcher", 0)
        deadline = time.monotonic() + DEADLINE_S
        while not note.exists():
            assert proc.poll() is None, f"the rank ended ({proc.returncode}):\n{log.read_text()}"
            assert time.monotonic() < deadline, f"no {note} within {DEADLINE_S}s:\n{log.read_text()}"
            time.sleep(0.02)
        text = log.read_text()
        assert "ERROR peerwatch: the watcher of rank 0 failed; this rank is NOT protected" in text, text
        assert "Traceback" in text and "RuntimeError: injected: the heartbeat cannot be written" in text, text
        status = _status(run_dir)
        lines = [line for line in status.splitlines() if line.startswith("rank 0: watcher died at ")]
        assert len(lines) == 1, status
        assert lines[0].endswith("RuntimeError: injected: the heartbeat cannot be written; this rank is unprotected")
        assert proc.poll() is None, "the training must go on"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)


def _run_dir(tmp_path: Path, pid: int) -> RunDir:
    for sub in (RANKS, EVENTS, TMP):
        os.makedirs(tmp_path / "run" / sub, mode=0o700)
    rd = RunDir(str(tmp_path / "run"))
    reg = Registration(rank=2, pid=pid, ppid=1, start_ticks=1, uid=os.geteuid(), host="h", boot_id="b", pidns="p",
                       time_ns=time.time_ns())
    rd.write(RANKS, rank_file("rank", 2), encode(reg))
    return rd


def test_status_shows_only_the_death_of_the_registered_process(tmp_path: Path, capsys) -> None:
    rd = _run_dir(tmp_path, pid=os.getpid())
    assert cli.main(["status", rd.path]) == 0
    assert "watcher died" not in capsys.readouterr().out
    record_death(rd, 2, OSError(9, "Bad file descriptor"))
    assert cli.main(["status", rd.path]) == 0
    out = capsys.readouterr().out
    assert "rank 2: watcher died at " in out and "OSError: [Errno 9] Bad file descriptor; this rank is unprotected" in out
    # An earlier process's note (another pid), and junk, are not shown.
    old = WatcherDeath(rank=2, pid=os.getpid() + 1, time_ns=1, exception="E", message="m")
    rd.write(EVENTS, rank_file("watcher", 2), encode(old), replace=True)
    (Path(rd.path) / EVENTS / rank_file("watcher", 3)).write_bytes(b"\x00junk")
    assert cli.main(["status", rd.path]) == 0
    assert "watcher died" not in capsys.readouterr().out


def test_recording_a_death_never_raises(tmp_path: Path, caplog) -> None:
    rd = RunDir(str(tmp_path / "gone"))  # no such directory
    record_death(rd, 0, RuntimeError("x"))
    assert "could not record" in caplog.text
