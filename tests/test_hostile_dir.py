"""Issue 14: strangers signalled through a hostile parent directory.

Another user who can write a folder above the run directory can rename it away after it
was checked and put one of their own in its place, holding forged records. Three layers:
the whole path is checked (and the directory is held by a descriptor from then on), a
record out of range is no record, and only a regular stack file vouches for a process.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

from peerwatch import RunDirError
from peerwatch.core.records import Registration, Verdict, encode
from peerwatch.proc import identity
from peerwatch.proc.identity import Started
from peerwatch.proc.teardown import holds_file, stack_file_problem
from peerwatch.rundir.prepare import prepare
from peerwatch.rundir.rundir import EVENTS, HEARTBEATS, RANKS, STACKS, VERDICT_FILE, RunDir, rank_file
from peerwatch.rundir.trust import check_ancestors

STRANGER_UID = 12345  # no such user here: "another user" owning what the test made
GONE_S = 6.0


def _reg(rank: int, pid: int, world_size: Optional[int] = 4) -> Registration:
    info = identity.probe(pid)
    assert info is not None
    return Registration(
        rank=rank, pid=pid, ppid=info.ppid, start_ticks=info.start_ticks, uid=info.uid,
        host=identity.hostname(), boot_id=identity.boot_id(), pidns=identity.pid_namespace(),
        time_ns=time.time_ns(), world_size=world_size,
    )


def _hostile_parent(tmp_path: Path) -> Path:
    """``/tmp/shared`` as in the issue: a folder of another user, mode 1777."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chown(shared, STRANGER_UID, STRANGER_UID)
    shared.chmod(0o1777)
    return shared


def _decoy_holding_dev_null() -> subprocess.Popen:
    """A process of this user that is no rank, with /dev/null open (its stdin)."""
    return subprocess.Popen(
        [sys.executable, "-c", "import sys, time; print('up', flush=True); time.sleep(120)"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
    )


def _wait_up(decoy: subprocess.Popen) -> None:
    assert decoy.stdout is not None
    ready, _, _ = select.select([decoy.stdout], [], [], 10)
    assert ready and decoy.stdout.readline() == b"up\n", "the decoy did not start"


def _wait_for(what: str, done, timeout: float, logs=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {timeout}s\n{logs()}")
        time.sleep(0.02)


def _wait_heartbeat(run_dir: Path, rank: int, timeout: float = 10.0) -> None:
    """Wait until rank writes a heartbeat newer than now (a full loop of its watcher ran)."""
    path = run_dir / HEARTBEATS / rank_file("rank", rank)
    start = time.time_ns()

    def newer() -> bool:
        try:
            return path.stat().st_mtime_ns > start
        except FileNotFoundError:
            return False

    _wait_for(f"a new heartbeat of rank {rank}", newer, timeout)


# -- 1. the whole path is checked; the directory is held ------------------------------


def test_a_run_directory_under_another_users_sticky_folder_is_refused(tmp_path: Path) -> None:
    shared = _hostile_parent(tmp_path)
    rd = RunDir(str(shared / "alice-run"))
    with pytest.raises(RunDirError) as info:
        prepare(rd, _reg(0, os.getpid()), Started(time.time_ns(), None))
    assert info.value.path == str(shared)
    assert f"owned by uid {STRANGER_UID}" in info.value.reason
    assert not (shared / "alice-run").exists(), "nothing is created under a hostile folder"


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o755 | 0o020])
def test_a_folder_above_writable_by_others_without_the_sticky_bit_is_refused(tmp_path: Path, mode: int) -> None:
    above = tmp_path / "above"
    above.mkdir()
    above.chmod(mode)
    with pytest.raises(RunDirError, match="without the sticky bit") as info:
        prepare(RunDir(str(above / "x" / "run")), _reg(0, os.getpid()), Started(time.time_ns(), None))
    assert info.value.path == str(above)


def test_a_sticky_world_writable_folder_of_our_own_or_roots_is_fine(tmp_path: Path) -> None:
    # As /tmp: only an entry's owner (and the folder's, and root) can rename it.
    tmp_like = tmp_path / "tmp-like"
    tmp_like.mkdir()
    tmp_like.chmod(0o1777)
    check_ancestors(str(tmp_like / "run"))
    prepare(RunDir(str(tmp_like / "run")), _reg(0, os.getpid()), Started(time.time_ns(), None))


def test_a_symlink_of_another_user_on_the_way_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    os.chown(link, STRANGER_UID, STRANGER_UID, follow_symlinks=False)
    with pytest.raises(RunDirError, match=f"owned by uid {STRANGER_UID}") as info:
        check_ancestors(str(link / "run"))
    assert info.value.path == str(link)


def test_a_folder_of_another_user_below_a_symlink_is_refused(tmp_path: Path) -> None:
    # The path as written looks fine; where it leads is not.
    theirs = _hostile_parent(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(theirs)
    with pytest.raises(RunDirError, match=f"owned by uid {STRANGER_UID}"):
        check_ancestors(str(link / "run"))


@pytest.mark.timeout(60)
def test_install_under_a_hostile_folder_is_unprotected_with_an_error_or_raises_with_strict(tmp_path: Path) -> None:
    shared = _hostile_parent(tmp_path)
    env = dict(os.environ, PEERWATCH_DIR=str(shared / "alice-run"), RANK="0", WORLD_SIZE="1")
    code = "import peerwatch; print('handle', peerwatch.install())"
    plain = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=50)
    assert plain.returncode == 0, plain.stderr
    assert "handle None" in plain.stdout
    assert "is NOT protected" in plain.stderr and str(shared) in plain.stderr, plain.stderr
    strict = subprocess.run([sys.executable, "-c", code], env=dict(env, PEERWATCH_STRICT="1"),
                            capture_output=True, text=True, timeout=50)
    assert strict.returncode != 0
    assert "RunDirError" in strict.stderr and f"owned by uid {STRANGER_UID}" in strict.stderr, strict.stderr


def test_a_run_directory_swapped_after_prepare_is_never_read_or_written(tmp_path: Path) -> None:
    # What a user who can write the parent does once the checks passed: rename the run
    # directory away and put their own, with forged records, in its place.
    run = tmp_path / "run"
    rd = RunDir(str(run))
    me = _reg(0, os.getpid(), world_size=2)
    prepare(rd, me, Started(time.time_ns(), None))
    rd.publish_registration(me)
    os.rename(run, tmp_path / "moved")
    forged = RunDir(str(run))
    prepare(forged, _reg(1, os.getpid(), world_size=2), Started(time.time_ns(), None))  # their own, laid out as ours
    forged_verdict = Verdict(rank=1, cause="exit", exit_code=1, failed_at_ns=1, detected_by=1, detected_at_ns=1)
    assert forged.write(EVENTS, VERDICT_FILE, encode(forged_verdict))
    forged.publish_registration(_reg(1, os.getpid(), world_size=2))
    forged.close()

    assert rd.read(EVENTS, VERDICT_FILE, Verdict) is None
    assert set(rd.registrations()) == {0}
    assert [name for _, _, name in rd.entries(RANKS)] == [rank_file("rank", 0)]
    assert rd.write(EVENTS, rank_file("success", 0), b"{}")
    assert (tmp_path / "moved" / EVENTS / rank_file("success", 0)).exists()
    assert not (run / EVENTS / rank_file("success", 0)).exists()
    # Paths for code that opens by path lead to the directory that was checked.
    assert os.path.samefile(rd.at(EVENTS), tmp_path / "moved" / EVENTS)
    assert os.path.samefile(os.path.dirname(rd.stack_at(0)), tmp_path / "moved" / STACKS)
    # Paths for people still name it as the user did.
    assert rd.join(EVENTS) == str(run / EVENTS)
    rd.close()


# -- 2. a forged verdict out of range ------------------------------------------------


@pytest.mark.timeout(90)
def test_a_forged_verdict_with_exit_code_256_tears_nothing_down(make_job) -> None:
    # 256 & 0xFF == 0: on main, every rank of a healthy job was torn down and exited 0.
    job = make_job(world=2, env={"PEERWATCH_HEARTBEAT": "0.2"}).start()
    job.wait_ready()
    forged = Verdict(rank=1, cause="exit", exit_code=256, failed_at_ns=time.time_ns(), detected_by=1,
                     detected_at_ns=time.time_ns())
    rd = RunDir(str(job.run_dir))
    assert rd.write(EVENTS, VERDICT_FILE, encode(forged))
    verdict_path = str(job.run_dir / EVENTS / VERDICT_FILE)
    ended, _, _ = select.select([p.pidfd for p in job.ranks.values()], [], [], 2.0)  # ten heartbeats
    if ended:
        job.wait_gone(within=GONE_S)
        raise AssertionError(f"ranks ended on a forged verdict, exit codes {job.exit_codes()}\n{job.logs()}")
    _wait_for("every rank warned about the forged verdict",
              lambda: all(f"{verdict_path} is not a valid peerwatch record" in job.log_path(r).read_text(errors="replace")
                          for r in range(2)), 20, job.logs)
    # A real failure still takes the job down, with its own exit code (never 0).
    job.kill(1)
    job.wait_gone(within=GONE_S)
    verdict = job.report()["verdict"]
    assert verdict["rank"] == 1
    assert job.exit_codes()[0] == verdict["exit_code"] != 0, job.logs()


# -- 3. only a regular stack file vouches for a process --------------------------------


def test_a_symlinked_stack_file_vouches_for_nobody(tmp_path: Path) -> None:
    decoy = _decoy_holding_dev_null()
    try:
        _wait_up(decoy)
        link = tmp_path / "rank-00009.txt"
        link.symlink_to("/dev/null")
        assert not holds_file(decoy.pid, str(link))
        assert stack_file_problem(str(link)) == "is a symbolic link"
        assert stack_file_problem("/dev/null") == "is not a regular file"
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        assert stack_file_problem(str(fifo)) == "is not a regular file"
        # A hard link to a file the process holds: the same inode, but not a stack file of ours.
        held = tmp_path / "held.txt"
        with open(held, "w"):
            os.link(held, tmp_path / "hard.txt")
            assert not holds_file(os.getpid(), str(tmp_path / "hard.txt"))
            assert stack_file_problem(str(tmp_path / "hard.txt")) == "has 2 hard links"
        theirs = tmp_path / "theirs.txt"
        with open(theirs, "w"):
            os.chown(theirs, STRANGER_UID, STRANGER_UID)
            assert not holds_file(os.getpid(), str(theirs))
    finally:
        decoy.kill()
        decoy.wait()
        assert decoy.stdout is not None
        decoy.stdout.close()


@pytest.mark.timeout(90)
def test_a_forged_rank_with_a_symlinked_stack_file_is_never_signalled(make_job) -> None:
    # Ranks 0 and 1 of 3 run; rank 2's slot is forged: an unrelated process of this user,
    # right pid, start time and uid, and a stack file that is a symlink to /dev/null,
    # which that process holds open.
    decoy = _decoy_holding_dev_null()
    try:
        _wait_up(decoy)
        job = make_job(world=3, sync=False, env={"PEERWATCH_HEARTBEAT": "0.2", "PEERWATCH_ACK_WINDOW": "0.2"})
        job.start(ranks=[0, 1])
        job.wait_ready(ranks=[0, 1])
        rd = RunDir(str(job.run_dir))
        os.symlink("/dev/null", job.run_dir / STACKS / rank_file("rank", 2, ".txt"))
        rd.write(RANKS, rank_file("rank", 2), encode(_reg(2, decoy.pid, world_size=3)), replace=True)
        reg_path = str(job.run_dir / RANKS / rank_file("rank", 2))
        job.kill(1)
        job.wait_gone(within=GONE_S)
        assert decoy.poll() is None, f"the decoy was signalled: {decoy.returncode}\n{job.logs()}"
        log = job.log_path(0).read_text(errors="replace")
        assert f"{reg_path} names pid {decoy.pid}, but rank 2's stack file is a symbolic link" in log, job.logs()
    finally:
        decoy.kill()
        decoy.wait()
        assert decoy.stdout is not None
        decoy.stdout.close()


@pytest.mark.timeout(90)
def test_the_issues_forged_rank_9_of_3_is_never_signalled(make_job) -> None:
    # The issue's example: rank 9 of a world of 3, its stack file a symlink to /dev/null.
    decoy = _decoy_holding_dev_null()
    try:
        _wait_up(decoy)
        job = make_job(world=3, env={"PEERWATCH_HEARTBEAT": "0.2", "PEERWATCH_ACK_WINDOW": "0.2"}).start()
        job.wait_ready()
        rd = RunDir(str(job.run_dir))
        os.symlink("/dev/null", job.run_dir / STACKS / rank_file("rank", 9, ".txt"))
        rd.write(RANKS, rank_file("rank", 9), encode(_reg(9, decoy.pid, world_size=None)), replace=True)
        reg_path = str(job.run_dir / RANKS / rank_file("rank", 9))
        _wait_heartbeat(job.run_dir, 0)  # a full loop of rank 0's watcher ran since
        job.kill(1)
        job.wait_gone(within=GONE_S)
        assert decoy.poll() is None, f"the decoy was signalled: {decoy.returncode}\n{job.logs()}"
        assert job.report()["verdict"]["rank"] == 1
        assert f"{reg_path} registers rank 9 of a job of world size None (pid {decoy.pid})" in job.logs()
        assert "neither watched nor ever signalled" in job.logs()
    finally:
        decoy.kill()
        decoy.wait()
        assert decoy.stdout is not None
        decoy.stdout.close()
