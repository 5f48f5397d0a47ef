"""Identity and signals (issue 14): a rank that takes peerwatch's descriptors away, one
that can no longer be verified (exec, setuid), one in another PID namespace of this host,
and one that resets peerwatch's interrupt signal. Real jobs of ``rank_program.py``."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from harness import Job, Proc, by_rank

from peerwatch.proc.identity import hostname
from peerwatch.rundir.rundir import HEARTBEATS, rank_file

pytestmark = pytest.mark.timeout(90)

BEAT_S = 0.2  # PEERWATCH_HEARTBEAT of the jobs that watch the watcher go round
ACK_S = 0.5
GRACE_S = 1.0
STUCK_S = ACK_S + GRACE_S + 3.0


def _heartbeat_ns(job: Job, rank: int) -> int:
    try:
        return int(json.loads((job.run_dir / HEARTBEATS / rank_file("rank", rank)).read_text())["time_ns"])
    except (OSError, ValueError, KeyError):
        return 0


def _wait_heartbeat_after(job: Job, rank: int, after_ns: int, within: float = 10.0) -> None:
    """Wait until rank's watcher wrote a heartbeat after ``after_ns``: it went round its loop."""
    deadline = time.monotonic() + within
    while _heartbeat_ns(job, rank) <= after_ns:
        if time.monotonic() >= deadline:
            raise AssertionError(f"rank {rank}'s watcher wrote no heartbeat after {after_ns}\n{job.logs()}")
        proc = job.ranks[rank]
        ready, _, _ = select.select([proc.pidfd], [], [], 0.02)  # ends early if the rank does
        if ready:
            raise AssertionError(f"{proc.label} ended\n{job.logs()}")


def _verdict(job: Job) -> Path:
    return job.run_dir / "events" / "verdict.json"


# -- 1. descriptors taken away -------------------------------------------------------------


@pytest.mark.parametrize("mode", ["devnull", "close"])
def test_a_rank_that_takes_its_descriptors_away_stays_protected(make_job, mode: str) -> None:
    """/dev/null over fds 3-39 made rank 0's watcher take rank 1 for dead at once (poll
    on /dev/null says readable); os.closerange killed the watcher (EBADF). Either way it
    must go on watching: no verdict while rank 1 lives, and rank 1's death is seen."""
    job = make_job(world=2, behave=[f"0=clobber:{mode}"], env={"PEERWATCH_HEARTBEAT": str(BEAT_S)}).start()
    job.wait_ready()
    job.wait_noted(["clobbered-0"])
    clobbered_ns = int((job.ready_dir / "clobbered-0").read_text())
    _wait_heartbeat_after(job, 0, clobbered_ns + int(2 * BEAT_S * 1e9))
    assert not _verdict(job).exists(), f"a verdict with every rank alive\n{job.logs()}"
    killed_at = job.kill(1)
    job.wait_gone(within=STUCK_S)
    report = job.report()
    v = report["verdict"]
    assert (v["rank"], v["cause"]) == (1, "vanished"), v
    assert v["detected_by"] == 0
    assert job.returncodes() == {0: 1, 1: -9}, job.logs()
    assert job.gone_at is not None and job.gone_at - killed_at < STUCK_S
    log = job.log_path(0).read_text()
    assert "closed or replaced by the application" in log, log


@pytest.mark.parametrize("mode", ["devnull", "close"])
def test_a_rank_that_took_its_descriptors_away_and_exits_0_succeeded(make_job, mode: str) -> None:
    """Rank 1 dup2s /dev/null over fds 3-199 (or closes 3-65535), then exits 0: its success
    marker could not be written ("could not write success-00001.json: Bad file descriptor",
    through the directory fds kept since install()), its peers took it for failed and
    exited 1, and peerwatch's own atexit raised EBADF from watchdog. Issue 22.2."""
    job = make_job(world=3, behave=[f"1=clobber_exit:{mode}", "0=await:go", "2=await:go"],
                   env={"PEERWATCH_HEARTBEAT": str(BEAT_S)}).start()
    job.wait_ready()
    job.wait_noted(["clobbered-1"])
    proc = job.ranks[1]
    deadline = time.monotonic() + STUCK_S
    while not proc.gone() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.gone(), job.logs()
    time.sleep(1.0)  # the peers see it go at once (pidfd): time to (wrongly) judge it
    (job.ready_dir / "go").write_text("")
    job.wait_gone(within=STUCK_S)
    assert job.returncodes() == {0: 0, 1: 0, 2: 0}, job.logs()
    assert not _verdict(job).exists(), job.logs()
    log = job.log_path(1).read_text()
    assert "Bad file descriptor" not in log and "Traceback" not in log, log


# -- 4. the interrupt signal reset by the application -------------------------------------


def test_a_rank_that_reset_the_interrupt_signal_is_not_killed_by_it(make_job) -> None:
    """Rank 0 is inside watch() and reset peerwatch's interrupt signal to SIG_DFL: the
    signal killed it (-38) while the report said exit code 1. Now the signal is not sent;
    PeerFailure is raised without it and the rank leaves with the verdict's code."""
    job = make_job(world=2, api="both", behave=["0=default_interrupt+sleep", "1=raise@0.3"]).start()
    job.wait_ready()
    job.wait_gone(within=STUCK_S)
    assert job.returncodes() == {0: 1, 1: 1}, job.logs()
    assert job.peer_failures()[0]["rank"] == 1
    assert "is no longer handled by peerwatch" in job.log_path(0).read_text()


# -- 2. a rank that can no longer be verified --------------------------------------------


def _wait_procs_gone(job: Job, ranks: list, within: float) -> None:
    deadline = time.monotonic() + within
    for rank in ranks:
        proc = job.ranks[rank]
        left = max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([proc.pidfd], [], [], left)
        assert ready, f"{proc.label} still alive\n{job.logs()}"


def test_a_rank_that_execed_is_reported_not_signalled(make_job) -> None:
    """Rank 2 exec'd a plain program (same pid, its stack file closed on exec): it cannot
    be verified, so it is not signalled; the report said torn_down. Now it says so."""
    job = make_job(world=3, behave=["1=raise_after:go", "2=exec_away"]).start()
    job.wait_ready()
    pid = job.pids[2]
    deadline = time.monotonic() + 20
    while "time.sleep(600)" not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
        assert time.monotonic() < deadline, "rank 2 did not exec"
        time.sleep(0.01)
    (job.ready_dir / "go").write_text("")
    try:
        _wait_procs_gone(job, [0, 1], STUCK_S)
        entry = by_rank(job.report())[2]
        assert job.ranks[2].pidfd is not None and not job.ranks[2].gone(), "rank 2 was signalled"
    finally:
        job.kill_all()
    assert entry["state"] == "not_signalled", entry
    assert "stack file" in entry["not_signalled"], entry
    assert f"rank 2 (pid {pid} on {hostname()}) could not be verified, not signalled" in job.log_path(0).read_text()


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                    reason="needs unshare(1) and root for a PID namespace")
def test_a_rank_in_another_pid_namespace_of_this_host_is_named_not_silently_unwatched(tmp_path: Path) -> None:
    """Rank 1 runs in a PID namespace of its own (it registers as pid 1): rank 0 cannot
    watch or signal it, and must say so (WARNING, and the report's ``unwatched``) rather
    than let it go unwatched in silence. Rank 0 then fails: rank 1 learns the verdict
    from the run directory and leaves by itself."""
    job = Job(tmp_path, world=2, behave=["0=exit:3@1"])
    with job:
        job.start([0])
        env = dict(job._env_cache or {}, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1")
        with open(job.log_path(1), "wb") as log:
            popen = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", *job._argv()], env=env,
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=str(job.tmp))
        job.started[1] = Proc(popen.pid, f"rank 1 in its own PID namespace (unshare pid {popen.pid})", popen)
        job.wait_noted(["rank-0", "rank-1"], timeout=30.0)
        deadline = time.monotonic() + 30.0
        for proc in job.started.values():
            assert proc.popen is not None
            proc.popen.wait(max(0.1, deadline - time.monotonic()))
        # Whoever wrote the report (either side) could not watch the other: it says so.
        entries = by_rank(job.report())
        assert any("namespace" in (e.get("unwatched") or "") for e in entries.values()), entries
        assert "registered from another PID namespace of this host" in job.logs(), job.logs()
        assert job.started[1].popen is not None and job.started[1].popen.returncode != 0
