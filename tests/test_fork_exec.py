"""Fork and exec safety, end to end.

- A child forked by a rank (``os.fork``; a DataLoader worker with the fork start method)
  is never taken for the rank and never writes its markers, however it ends (sys.exit(0),
  an uncaught exception, sys.exit(3), a segfault) and whatever it calls (``install()``,
  ``beat()``, ``watch()``): the run directory's ``events/`` and ``ranks/`` say nothing
  about it, after it ended and after the job ended cleanly.
- ``install()`` in a forked child is harmless: returns None, no crash, the registration is
  the rank's, no teardown.
- A ``subprocess`` child of a rank (a fresh interpreter) that inherits PEERWATCH_DIR and
  RANK and calls ``install()`` does not take over the rank's slot, neither while the rank
  lives nor after it finished (while its peers still run).
- A rank that ``os.execv``s itself (and installs again in the new image) keeps being
  watched: killing it afterwards tears the job down, and it still tears itself down when
  a peer is killed.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Dict, List

import pytest
from harness import Job, by_rank

from peerwatch.core.records import ExitStatus, Registration, Success, decode
from peerwatch.rundir.rundir import EVENTS, RANKS

pytestmark = pytest.mark.timeout(120)

WORLD = 3
GRACE_S = 1.0
ACK_S = 1.5  # PEERWATCH_ACK_WINDOW: three times the default, for a loaded machine (see test_fault_matrix)
BOUND_S = ACK_S + 1.0  # failure -> all gone when every survivor leaves by itself (see test_fault_matrix)
ENV = {"PEERWATCH_ACK_WINDOW": str(ACK_S)}
CLEAN_END_S = 20.0  # how long a clean finish may take (start of torch workers included)

# How a forked child ends -> its returncode.
CHILD_MODES = {"exit0": 0, "raise": 1, "exit3": 3, "quit5": 5, "raise5": 5, "segv": -signal.SIGSEGV, "install": 3}


def _note(job: Job, name: str) -> dict:
    job.wait_noted([name], timeout=60.0)
    return json.loads((job.ready_dir / name).read_text())


def _event_files(job: Job) -> List[str]:
    return sorted(os.listdir(job.run_dir / EVENTS))


def _read(job: Job, sub: str, name: str, cls: type) -> object:
    return decode(cls, (job.run_dir / sub / name).read_bytes())


def _registration(job: Job, rank: int) -> Registration:
    reg = _read(job, RANKS, f"rank-{rank:05d}.json", Registration)
    assert isinstance(reg, Registration), f"rank {rank}'s registration is unreadable"
    return reg


def _assert_only_the_ranks_wrote(job: Job, pids: Dict[int, int]) -> None:
    """ranks/ holds one registration per rank, each naming the rank's own pid; events/
    holds nothing but the records of a clean run: success markers written by the ranks
    themselves, and (Lightning style) rank 0's note that a child rank exited with 0."""
    assert sorted(os.listdir(job.run_dir / RANKS)) == [f"rank-{r:05d}.json" for r in range(WORLD)]
    for rank, pid in pids.items():
        assert _registration(job, rank).pid == pid
    for name in _event_files(job):
        if name.startswith("exit-") and job.style == "lightning":
            status = _read(job, EVENTS, name, ExitStatus)
            assert isinstance(status, ExitStatus), name
            assert (status.pid, status.returncode, status.observed_by) == (pids[status.rank], 0, 0), status
            continue
        assert name.startswith("success-"), f"events/{name} written during a clean run: {_event_files(job)}\n{job.logs()}"
        record = _read(job, EVENTS, name, Success)
        assert isinstance(record, Success), name
        assert record.pid == pids[record.rank], f"{name} written by pid {record.pid}, not by rank {record.rank}"


def _assert_clean_end(job: Job, pids: Dict[int, int]) -> None:
    job.wait_gone(within=CLEAN_END_S)
    codes = job.all_returncodes()
    assert codes == {r: 0 for r in range(WORLD)}, f"returncodes {codes}\n{job.logs()}"
    assert not (job.run_dir / EVENTS / "verdict.json").exists(), job.logs()
    successes = [n for n in _event_files(job) if n.startswith("success-")]
    assert successes == [f"success-{r:05d}.json" for r in range(WORLD)], _event_files(job)
    _assert_only_the_ranks_wrote(job, pids)
    report = job.cli_report()
    assert report["outcome"] == "succeeded", report
    assert {r["rank"]: r["pid"] for r in report["ranks"]} == pids


def _assert_torn_down(job: Job, victim: int, killed_ns: int, code: int, cause: str) -> None:
    job.wait_gone(within=BOUND_S + ACK_S + 3 * GRACE_S + 5.0)
    codes = job.all_returncodes()
    want = {r: (-signal.SIGKILL if r == victim else code) for r in range(WORLD)}
    assert codes == want, f"returncodes {codes}, expected {want}\n{job.logs()}"
    report = job.report()
    v = report["verdict"]
    assert (v["rank"], v["cause"], v["exit_code"]) == (victim, cause, code), f"{v}\n{job.logs()}"
    for rank, entry in by_rank(report).items():
        if rank != victim:
            assert (entry["state"], entry["exit_code"], entry["acked_verdict"]) == ("torn_down", code, True), entry
    took = (job.gone_at_ns - killed_ns) / 1e9  # type: ignore[operator]
    assert took < BOUND_S, f"the job took {took:.2f}s to go after the kill"


# -- os.fork ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(CHILD_MODES))
def test_forked_child_never_writes_the_ranks_markers(make_job, mode: str) -> None:
    """Rank 1 forks a child that ends in ``mode`` (``install``: install(), beat(), watch(),
    then sys.exit(3)); rank 1 waits for it. Nothing in the run directory comes from the
    child, nobody is torn down, and the job ends cleanly with the ranks' own markers."""
    behave = ["0=succeed@1.0", f"1=fork:{mode}+succeed@1.5", "2=succeed@1.2"]
    job = make_job(world=WORLD, behave=behave, grace=GRACE_S, env=ENV).start()
    pids = job.wait_ready()
    forked = _note(job, "fork-1")
    assert forked["returncode"] == CHILD_MODES[mode], f"{forked}\n{job.logs()}"
    # The child ended before rank 1 was ready: nothing of it may be in the run directory.
    _assert_only_the_ranks_wrote(job, pids)
    if mode == "install":
        got = _note(job, "child-1-install")
        assert got["pid"] == forked["pid"]
        assert (got["install"], got["watch"], got["verdict"]) == (None, None, "None"), got
    _assert_clean_end(job, pids)


@pytest.mark.parametrize("mode", ["raise", "exit3", "install"])
def test_rank_killed_after_its_forked_child_failed_is_judged_by_its_own_death(make_job, mode: str) -> None:
    """The child's failure is not the rank's: when rank 1 is later SIGKILLed, the verdict
    is that (nobody knows how it died: ``vanished``), not the child's exception or exit."""
    job = make_job(world=WORLD, behave=[f"1=fork:{mode}"], grace=GRACE_S, env=ENV).start()
    job.wait_ready()
    assert _note(job, "fork-1")["returncode"] == CHILD_MODES[mode]
    assert _event_files(job) == [], _event_files(job)
    killed_ns = time.time_ns()
    job.kill(1)
    _assert_torn_down(job, 1, killed_ns, code=1, cause="vanished")


def test_rank_killed_after_its_forked_child_segfaulted_is_judged_by_its_own_death(make_job) -> None:
    job = make_job(world=WORLD, behave=["1=fork:segv"], grace=GRACE_S, env=ENV).start()
    job.wait_ready()
    assert _note(job, "fork-1")["returncode"] == -signal.SIGSEGV
    assert _event_files(job) == [], _event_files(job)
    killed_ns = time.time_ns()
    job.kill(1)
    try:
        _assert_torn_down(job, 1, killed_ns, code=1, cause="vanished")
    finally:
        job.kill_all()


# -- DataLoader workers (fork start method) -------------------------------------------------


@pytest.mark.parametrize("style", ["sibling", "lightning"])
def test_dataloader_workers_are_never_the_rank(make_job, style: str) -> None:
    """Every rank iterates a DataLoader (num_workers=2, fork) whose workers call install(),
    beat() and watch() for every item, then shuts it down. The workers are not ranks: their
    install() returns None, they write nothing, and the job ends cleanly."""
    pytest.importorskip("torch")
    behave = [f"{r}=loader:6+succeed@{0.5 + 0.3 * r}" for r in range(WORLD)]
    job = make_job(world=WORLD, style=style, behave=behave, grace=GRACE_S, env=ENV).start()
    pids = job.wait_ready(timeout=90.0)
    workers = set()
    for rank in range(WORLD):
        got = _note(job, f"loader-{rank}")
        assert got["install_none"] and got["watch_none"], got
        assert len(got["workers"]) == 2 and not set(got["workers"]) & set(pids.values()), got
        workers |= set(got["workers"])
    # The workers ended before their rank was ready.
    _assert_only_the_ranks_wrote(job, pids)
    _assert_clean_end(job, pids)


# -- install() in a child --------------------------------------------------------------------


@pytest.mark.parametrize("how", ["fork", "sub"])
def test_install_in_a_child_of_a_live_rank_is_harmless(make_job, how: str) -> None:
    """A forked child, or a subprocess child inheriting PEERWATCH_DIR and RANK, calls
    install() while its rank lives: None, the registration stays the rank's (same bytes),
    its sys.exit(3) is no failure of the rank, and the job ends cleanly."""
    behave = ["0=succeed@1.0", f"1={how}:install+succeed@1.5", "2=succeed@1.2"]
    job = make_job(world=WORLD, behave=behave, grace=GRACE_S, env=ENV).start()
    pids = job.wait_ready()
    child = _note(job, f"{how}-1")
    got = _note(job, "child-1-install")
    assert got["pid"] == child["pid"] != pids[1]
    assert (got["install"], got["watch"], got["verdict"]) == (None, None, "None"), f"{got}\n{job.logs()}"
    assert child["returncode"] == 3, child
    _assert_only_the_ranks_wrote(job, pids)
    _assert_clean_end(job, pids)


@pytest.mark.parametrize("how", ["orphan_fork", "orphan_sub"])
def test_install_in_a_child_that_outlived_its_rank_does_not_take_over_the_run(make_job, how: str) -> None:
    """Rank 1 finishes cleanly first; its child (forked, or a subprocess inheriting
    PEERWATCH_DIR and RANK) then calls install() while ranks 0 and 2 still run. The child
    must not take rank 1's slot nor set the live run directory aside: ranks 0 and 2 finish
    cleanly, in the same run directory, with no teardown.

    (Regression: the child's install() used to move the live run directory aside as "from
    an earlier run", create a new one at the same path and return a watcher.)"""
    # Ranks 0 and 2 finish once the child has noted what install() did: it ran while they lived.
    behave = ["0=await:child-1-install", f"1={how}:install+succeed@0.2", "2=await:child-1-install"]
    job = make_job(world=WORLD, behave=behave, grace=GRACE_S, env=ENV).start()
    pids = job.wait_ready()
    try:
        got = _note(job, "child-1-install")  # written once rank 1 is gone
        stale = [p.name for p in job.run_dir.parent.iterdir() if p.name.startswith(job.run_dir.name + ".stale")]
        assert not stale, f"the live run directory was set aside: {stale}\n{job.logs()}"
        assert _registration(job, 1).pid == pids[1], "the child took rank 1's slot"
        assert got["install"] is None, f"install() in the child returned {got['install']}\n{job.logs()}"
        _assert_clean_end(job, pids)
    finally:
        job.kill_all()


# -- exec -----------------------------------------------------------------------------------


@pytest.mark.parametrize("victim", [1, 0], ids=["the-execed-rank-killed", "a-peer-killed"])
@pytest.mark.parametrize("style", ["sibling", "lightning"])
def test_rank_that_execs_itself_keeps_being_watched(make_job, style: str, victim: int) -> None:
    """Rank 1 installs, then os.execv()s its own program (same pid), which installs again.
    It is still a watched peer: killing it tears the job down; and it is still a watcher:
    killing a peer tears it down with the verdict's code."""
    job = make_job(world=WORLD, style=style, behave=["1=reexec"], grace=GRACE_S, env=ENV).start()
    pids = job.wait_ready()
    before, after = (int((job.ready_dir / f"{n}-1").read_text()) for n in ("preexec", "execed"))
    assert before == after == pids[1]
    reg = _registration(job, 1)
    assert reg.pid == pids[1] and "rank_program.py" in reg.argv
    assert _event_files(job) == [], _event_files(job)
    killed_ns = time.time_ns()
    job.kill(victim)
    parent_knows = style == "lightning" and victim != 0
    code, cause = (128 + signal.SIGKILL, "signal") if parent_knows else (1, "vanished")
    _assert_torn_down(job, victim, killed_ns, code=code, cause=cause)
