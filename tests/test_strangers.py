"""Never a stranger: records naming processes that are not peers of the run are never
signalled, however well forged (right pid, start time, uid, host, boot id)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peerwatch.core.records import Heartbeat, Registration, encode
from peerwatch.proc import identity
from peerwatch.rundir.rundir import HEARTBEATS, RANKS, RunDir, rank_file

GONE_S = 6.0


def _decoy() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def _forged_registration(rank: int, pid: int) -> Registration:
    info = identity.probe(pid)
    assert info is not None
    return Registration(
        rank=rank, pid=pid, ppid=info.ppid, start_ticks=info.start_ticks, uid=info.uid,
        host=identity.hostname(), boot_id=identity.boot_id(), pidns=identity.pid_namespace(),
        time_ns=time.time_ns(),
    )


def _wait_watched(run_dir: Path, rank: int, timeout: float = 10.0) -> None:
    """Wait until a heartbeat newer than the forged record exists (a full watcher loop ran)."""
    path = run_dir / HEARTBEATS / rank_file("rank", rank)
    start = time.time_ns()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if path.stat().st_mtime_ns > start:
                return
        except FileNotFoundError:
            pass
        time.sleep(0.02)
    raise AssertionError(f"rank {rank} wrote no heartbeat within {timeout}s")


@pytest.mark.timeout(90)
def test_forged_pid_file_of_a_live_process_is_never_signalled(make_job) -> None:
    decoy = _decoy()
    try:
        # A long ack window: a forged "peer" never acknowledges, so it would be signalled.
        job = make_job(world=2, env={"PEERWATCH_HEARTBEAT": "0.2", "PEERWATCH_ACK_WINDOW": "0.2"}).start()
        job.wait_ready()
        rd = RunDir(str(job.run_dir))
        rd.write(RANKS, rank_file("rank", 5), encode(_forged_registration(5, decoy.pid)), replace=True)
        rd.write(RANKS, rank_file("rank", 6), encode(_forged_registration(6, 1)), replace=True)
        _wait_watched(job.run_dir, 0)
        job.kill(1)
        job.wait_gone(within=GONE_S)
        assert decoy.poll() is None, f"the decoy was signalled: {decoy.returncode}"
        assert job.report()["verdict"]["rank"] == 1
    finally:
        decoy.kill()
        decoy.wait()


@pytest.mark.timeout(90)
def test_forged_child_list_of_the_failed_rank_is_never_signalled(make_job) -> None:
    decoy = _decoy()
    try:
        job = make_job(world=2, env={"PEERWATCH_HEARTBEAT": "0.2"}).start()
        job.wait_ready()
        # Rank 1's last heartbeat claims the decoy as its child: stop rank 1 (its watcher
        # writes no more heartbeats), forge, then kill it.
        rd = RunDir(str(job.run_dir))
        info = identity.probe(decoy.pid)
        assert info is not None
        pid1 = job.pids[1]
        os.kill(pid1, signal.SIGSTOP)
        beat = Heartbeat(rank=1, pid=pid1, time_ns=time.time_ns(), seq=10**6, children=((decoy.pid, info.start_ticks),))
        rd.write(HEARTBEATS, rank_file("rank", 1), encode(beat), replace=True)
        job.kill(1)
        job.wait_gone(within=GONE_S)
        assert job.report()["verdict"]["rank"] == 1
        assert decoy.poll() is None, f"the decoy was signalled: {decoy.returncode}"
    finally:
        decoy.kill()
        decoy.wait()


def test_vouching_by_the_os(tmp_path: Path) -> None:
    # holds_file: our own open file, not a stranger's; inherited_run: the environment a
    # process was started with.
    from peerwatch.proc.teardown import holds_file, inherited_run

    path = tmp_path / "stack.txt"
    with open(path, "w"):
        assert holds_file(os.getpid(), str(path))
    assert not holds_file(os.getpid(), str(path))
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)"], env=dict(os.environ, PEERWATCH_DIR="/x/run")
    )
    try:
        deadline = time.monotonic() + 10
        while b"time.sleep(30)" not in Path(f"/proc/{child.pid}/cmdline").read_bytes():  # exec'ed yet?
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert inherited_run(child.pid, "/x/run")
        assert not inherited_run(child.pid, "/x/run2")
        assert not holds_file(child.pid, str(path))
    finally:
        child.kill()
        child.wait()
