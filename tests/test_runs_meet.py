"""Runs that meet in one run directory: never share a teardown.

Two unrelated jobs given the same ``PEERWATCH_DIR`` (or the same derived directory) must
not watch, blame or signal each other: the second is refused loudly (its ranks run
unprotected, said at ERROR). A new run in a directory left by an earlier, finished run
(``torch.multiprocessing.spawn`` called twice from one process, with different
``nprocs``) sets the old directory aside, whichever of its ranks comes first.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Optional

import pytest
from harness import _FOREIGN_ENV, Job

from peerwatch.core.records import Registration, Success, encode
from peerwatch.proc import identity
from peerwatch.proc.identity import Started
from peerwatch.rundir.prepare import stale_because
from peerwatch.rundir.rundir import HEARTBEATS, RANKS, RunDir, rank_file, same_job

# -- two jobs, one directory ------------------------------------------------------------


@pytest.mark.timeout(90)
def test_a_second_job_in_a_live_run_directory_is_refused_and_never_shares_its_teardown(tmp_path: Path) -> None:
    """Job A (2 ranks) is running; job B (3 ranks) is given A's directory. B's ranks 0
    and 1 find their slots held by A's live ranks, and B's rank 2 a run of another world
    size: all three are refused, loudly. B's rank 2 then fails: A must not notice, and
    finishes cleanly."""
    a = Job(tmp_path, world=2, behave=["0=succeed@6", "1=succeed@6"], name="a")
    b = Job(tmp_path, world=3, behave=["0=succeed@0.5", "1=succeed@0.5", "2=exit:3@0.5"], name="b", sync=False,
            env={"PEERWATCH_DIR": str(a.run_dir)})
    with a, b:
        a.start()
        a.wait_ready()
        b.start()
        within = 60.0
        deadline = time.monotonic() + within
        for proc in b.started.values():
            assert proc.popen is not None
            proc.popen.wait(max(0.1, deadline - time.monotonic()))
        logs = b.logs(limit=20_000)
        for rank in range(3):
            assert f"rank {rank} is NOT protected" in logs, logs
        assert "two jobs share this run directory" in logs, logs
        a.wait_gone(within=30.0)
        assert a.exit_codes() == {0: 0, 1: 0}, a.logs()
        ranks = {p.name for p in (a.run_dir / "ranks").iterdir()}
        assert ranks == {"rank-00000.json", "rank-00001.json"}, ranks


# -- a new run where an earlier one ended ------------------------------------------------

_SPAWN_TWICE = textwrap.dedent("""
    import multiprocessing as mp, os, sys, time

    import peerwatch

    def worker(rank, world, run, ready):
        if run == 2 and rank == 0:
            # The new run's rank 2 registers first (in the old directory, today).
            deadline = time.monotonic() + 60
            while not os.path.exists(os.path.join(ready, "run2-rank-2")):
                assert time.monotonic() < deadline, "rank 2 never registered"
                time.sleep(0.01)
        handle = peerwatch.install(rank=rank, world_size=world)
        state = "protected" if handle is not None else "unprotected"
        with open(os.path.join(ready, f"run{run}-rank-{rank}.tmp"), "w") as f:
            f.write(state)
        os.replace(os.path.join(ready, f"run{run}-rank-{rank}.tmp"), os.path.join(ready, f"run{run}-rank-{rank}"))

    if __name__ == "__main__":
        ready = sys.argv[1]
        ctx = mp.get_context("spawn")
        for run, world in ((1, 2), (2, 3)):
            procs = [ctx.Process(target=worker, args=(r, world, run, ready)) for r in range(world)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(120)
            print(f"run {run}:", [p.exitcode for p in procs], flush=True)
""")


@pytest.mark.timeout(120)
def test_a_larger_run_after_a_finished_smaller_one_protects_every_rank(tmp_path: Path) -> None:
    """One process spawns 2 ranks that finish cleanly, then 3 ranks, whose rank 2
    registers first: the old directory (two dead ranks, two success markers) is set aside
    and every rank of the second run is protected."""
    program = tmp_path / "spawn_twice.py"
    program.write_text(_SPAWN_TWICE)
    ready = tmp_path / "ready"
    ready.mkdir()
    base = tmp_path / "xdg"
    base.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if k not in _FOREIGN_ENV and k != "PEERWATCH_DIR"}
    env.update(XDG_RUNTIME_DIR=str(base), PYTHONPATH=os.pathsep.join(sys.path), PYTHONUNBUFFERED="1")
    done = subprocess.run([sys.executable, str(program), str(ready)], env=env, capture_output=True, text=True,
                          timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr
    states = {p.name: p.read_text() for p in ready.iterdir() if not p.name.endswith(".tmp")}
    assert states == {**{f"run1-rank-{r}": "protected" for r in range(2)},
                      **{f"run2-rank-{r}": "protected" for r in range(3)}}, (states, done.stderr)
    assert "is not a new rank of this run" not in done.stderr, done.stderr


@pytest.mark.timeout(90)
def test_a_rank_of_another_world_size_registered_beside_a_live_run_is_not_its_peer(tmp_path: Path) -> None:
    """Past the directory's check (two jobs starting at once can both pass it), a
    registration of another world size is not a peer: its process ending (killed, no
    success marker) must not tear the run down."""
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        a = Job(tmp_path, world=2, behave=["0=succeed@4", "1=succeed@4"], env={"PEERWATCH_HEARTBEAT": "0.2"}, name="a")
        with a:
            a.start()
            a.wait_ready()
            info = identity.probe(stranger.pid)
            assert info is not None
            forged = Registration(
                rank=2, pid=stranger.pid, ppid=info.ppid, start_ticks=info.start_ticks, uid=info.uid,
                host=identity.hostname(), boot_id=identity.boot_id(), pidns=identity.pid_namespace(),
                time_ns=time.time_ns(), world_size=3,
            )
            RunDir(str(a.run_dir)).write(RANKS, rank_file("rank", 2), encode(forged), replace=True)
            _wait_heartbeat_after(a.run_dir, 0, time.time_ns())
            stranger.kill()
            stranger.wait()
            a.wait_gone(within=30.0)
            assert a.exit_codes() == {0: 0, 1: 0}, a.logs()
            assert "two jobs share this run directory" in a.logs(), a.logs()
    finally:
        if stranger.poll() is None:
            stranger.kill()
            stranger.wait()


def _wait_heartbeat_after(run_dir: Path, rank: int, after_ns: int, timeout: float = 10.0) -> None:
    """Wait until rank ``rank`` wrote a heartbeat after ``after_ns`` (a full watcher loop ran)."""
    path = run_dir / HEARTBEATS / rank_file("rank", rank)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if path.stat().st_mtime_ns > after_ns:
                return
        except FileNotFoundError:
            pass
        assert time.monotonic() < deadline, f"rank {rank} wrote no heartbeat within {timeout}s"
        time.sleep(0.02)


# -- the rules, pure ---------------------------------------------------------------------


def _reg(rank: int, world: Optional[int], pid: int = 100) -> Registration:
    return Registration(rank=rank, pid=pid, ppid=1, start_ticks=7, uid=0, host="h", boot_id="b", pidns="p",
                        time_ns=10, world_size=world)


def test_ranks_are_of_one_job_unless_their_world_sizes_differ_or_a_rank_lies_outside() -> None:
    assert same_job(_reg(0, 2), _reg(1, 2))
    assert same_job(_reg(0, None), _reg(3, 4))  # Lightning's rank 0 may not know the size yet
    assert same_job(_reg(0, None), _reg(5, None))
    assert not same_job(_reg(0, 2), _reg(1, 3))
    assert not same_job(_reg(0, None), _reg(2, 2))  # rank 2 is outside a world of 2


def test_an_ended_earlier_run_is_stale_and_this_runs_dead_rank_is_not() -> None:
    me = _reg(2, 3, pid=300)
    old = {0: _reg(0, 2), 1: _reg(1, 2)}
    succeeded = {r: Success(rank=r, pid=100, time_ns=50) for r in old}
    assert stale_because(me, None, old, False, succeeded, Started(100, None), None) is not None
    assert stale_because(me, None, old, True, succeeded, Started(100, None), None) is None  # someone lives
    # The same run: rank 0 died (no success marker) before this rank started: not stale.
    same = {0: _reg(0, 3)}
    assert stale_because(me, None, same, False, {}, Started(100, None), None) is None
    assert stale_because(me, None, same, False, {0: Success(rank=0, pid=100, time_ns=150)}, Started(100, None), None) is None
    # Another world size: an earlier job of another size.
    assert "world size 2" in (stale_because(me, None, {0: _reg(0, 2)}, False, {}, Started(100, None), None) or "")
    # This rank's slot held by a process that is gone.
    assert stale_because(me, _reg(2, 3, pid=99), {2: _reg(2, 3, pid=99)}, False, {}, Started(100, None), None) is not None
