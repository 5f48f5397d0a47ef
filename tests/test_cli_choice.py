"""Issue 23, point 4: which run directory ``peerwatch status``/``report`` read without one
named, and the order ``peerwatch ls`` lists them in.

A live run (a rank of this host registered there, alive, verified by pid, start time and
uid) comes before any other, the one started last first (not the one that changed last:
two running jobs beat in turn, and status and report would read different ones); then the
run whose records changed last (not the folder's mtime, which a running job does not
move). Both commands say first, on stderr, which directory they read and why, and warn
when several runs are live, so ``--json``'s stdout stays pure JSON. The live run here is a real
job of ``rank_program.py`` ranks; a run registered under one of its pids with another
start time is another process's, and is not live.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List

import pytest
from harness import Job
from test_gc import age, dead_pid, make_run, registration

from peerwatch.proc import identity
from peerwatch.rundir import basedir

ROOT = Path(__file__).resolve().parent.parent
CLI_TIMEOUT_S = 60.0
NO_LIVE_RUN = "finished: no run is live on this host; the one with the newest activity"


@pytest.fixture
def base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    b = Path(basedir.base_dir())
    assert b == runtime / "peerwatch"
    b.mkdir(mode=0o700)
    return b


def cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "peerwatch", *args], env=env, capture_output=True, text=True,
                          timeout=CLI_TIMEOUT_S)


def said(result: subprocess.CompletedProcess) -> str:
    """The first line on stderr: which run directory the command read."""
    assert result.returncode == 0, result.stderr
    return result.stderr.splitlines()[0]


def listed(base: Path) -> List[List[str]]:
    """``peerwatch ls``'s rows, each split into its columns."""
    result = cli("ls")
    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.splitlines()
    assert header.startswith("last activity") and " state " in header, header
    return [row.split() for row in rows]


def finished(path: Path, idle_s: float) -> Path:
    return make_run(path, [registration(0, dead_pid(), 1)], idle_s)


@pytest.mark.timeout(120)
def test_status_and_report_read_the_live_run_first_and_say_which(base: Path, tmp_path: Path, no_leaks: str) -> None:
    with Job(tmp_path, world=2) as job:
        job.run_dir = base / "run-hung"
        job.start()
        try:
            pids: Dict[int, int] = job.wait_ready()
            live = str(job.run_dir)
            # Runs whose records are all newer than the live one's heartbeats (dated a minute
            # or two ahead): by activity alone, either would be read.
            newer = str(finished(base / "run-newer", -120))
            rank0 = identity.probe(pids[0])
            assert rank0 is not None
            impostor = str(make_run(base / "run-reused-pid", [registration(0, pids[0], rank0.start_ticks + 1)], -60))
            old = str(finished(base / "run-old", 3600))

            for command in ("status", "report"):
                text = cli(command)
                assert said(text) == f"peerwatch: showing {live} (live: the only live run on this host)", text.stderr
                as_json = cli(command, "--json")
                assert said(as_json) == f"peerwatch: showing {live} (live: the only live run on this host)", as_json.stderr
                assert json.loads(as_json.stdout)["run_dir"] == live  # stdout is the JSON alone
            assert "running" in cli("status").stdout

            rows = listed(base)
            assert [row[-1] for row in rows] == [live, newer, impostor, old], rows
            assert [row[2] for row in rows] == ["live", "finished", "finished", "finished"], rows
            # A peer's death ends the job: peerwatch tears rank 0 down.
            job.kill(1, signal.SIGKILL)
            job.wait_gone(30.0)
        finally:
            job.kill_all()  # only if an assertion above left it running
    assert said(cli("status")) == f"peerwatch: showing {newer} ({NO_LIVE_RUN})"
    assert all(row[2] == "finished" for row in listed(base))


@pytest.fixture
def sleepers() -> Iterator[List[subprocess.Popen]]:
    """Two live processes, each to be registered as the rank of its own run."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for _ in range(2)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def live_run(path: Path, proc: subprocess.Popen, started_s_ago: float, idle_s: float) -> str:
    """A run whose rank 0 is ``proc`` (alive: pid, start time and uid check out), registered
    ``started_s_ago`` seconds ago, every mtime in it ``idle_s`` in the past."""
    me = identity.probe(proc.pid)
    assert me is not None
    reg = registration(0, proc.pid, me.start_ticks, time_ns=time.time_ns() - int(started_s_ago * 1e9))
    return str(make_run(path, [reg], idle_s))


@pytest.mark.timeout(120)
def test_two_live_runs_status_and_report_read_the_one_started_last_and_warn(
        base: Path, sleepers: List[subprocess.Popen], no_leaks: str) -> None:
    # The run started first changed last (its records dated a minute ahead): read by
    # activity, it would be taken; and with two jobs beating, which one changed last flips
    # from one second to the next, so status and report read different runs.
    older = live_run(base / "run-older", sleepers[0], started_s_ago=600, idle_s=-60)
    newer = live_run(base / "run-newer", sleepers[1], started_s_ago=60, idle_s=30)
    finished(base / "run-done", -120)  # the newest activity of all, but no rank of it lives
    for args in (("status",), ("report",), ("status", "--json"), ("report", "--json")):
        result = cli(*args)
        lines = result.stderr.splitlines()
        assert lines[0].startswith(f"peerwatch: showing {newer} (live: the newest of the 2 live runs on this host, "
                                "started at "), result.stderr
        warning = lines[1]
        assert warning.startswith("peerwatch: warning: 2 runs are live on this host: "), result.stderr
        assert f"{newer} (started at " in warning and f"{older} (started at " in warning, warning
        assert warning.endswith("; name one to read another"), warning
        if "--json" in args:
            assert json.loads(result.stdout)["run_dir"] == newer
    rows = listed(base)
    assert [row[-1] for row in rows][:2] == [newer, older], rows  # ls lists them in the same order
    assert said(cli("status", older)) == f"peerwatch: showing {older} (live, as named)"


@pytest.mark.timeout(60)
def test_ls_orders_by_the_newest_record_not_the_folder(base: Path, no_leaks: str) -> None:
    # Its folder has not changed for three days (a running job's does not), but a heartbeat
    # was written an hour ago; everything of the other, folder included, is two hours old.
    beating = finished(base / "run-beating", 3 * 86400)
    beat = beating / "heartbeats" / "rank-0.json"
    beat.write_text("{}")
    age(beating, 3 * 86400)
    age(beat, 3600)
    quiet = finished(base / "run-quiet", 2 * 3600)
    rows = listed(base)
    assert [row[-1] for row in rows] == [str(beating), str(quiet)], rows
    assert said(cli("status")) == f"peerwatch: showing {beating} ({NO_LIVE_RUN})"


@pytest.mark.timeout(60)
def test_a_named_directory_is_said_too(base: Path, no_leaks: str) -> None:
    run = finished(base / "run-named", 60)
    result = cli("report", str(run), "--json")
    assert said(result) == f"peerwatch: showing {run} (finished, as named)"
    assert json.loads(result.stdout)["run_dir"] == str(run)
