"""End to end: hangs diagnosed with no configuration and no ``beat()`` (3 ranks, gloo on CPU).

Every rank runs ``collective_program.py``: all_reduce, a short sleep; it never calls
``peerwatch.beat()``, so what the judges know comes from torch's collective counters,
read by each watcher. One rank stops taking part (a Python loop, a skipped collective,
another size, SIGSTOP) and the others wait for it, as in a real job. See docs/hangs.md.

A diagnosis only warns by default, so a job that stays stuck is ended by the test
(``kill_all``) once it has checked the diagnosis; the jobs that are expected to end do so
by themselves, within deadlines. Every wait has a deadline.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import jsonschema
import pytest
from harness import Job

import peerwatch
from peerwatch.hangs.diagnose import FLOOR_S, STUCK_S

pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.timeout(120)

PROGRAM = Path(__file__).with_name("collective_program.py")
WORLD = 3
WARN_S = 3.0  # PEERWATCH_HANG_WARN of most jobs here
HEARTBEAT_S = 1.0
START_S = 40.0  # three ranks importing torch and joining a gloo group on 2 loaded cores
# The diagnosis comes WARN_S after the last movement, give or take the heartbeats that
# carry the counters and the judges' look (one heartbeat each), and a loaded machine.
DIAGNOSED_S = WARN_S + 3 * HEARTBEAT_S + 5.0
AT_STEP = 20


class DiagJob(Job):
    def __init__(self, tmp: Path, steps: int, step_s: float, timeout_s: float, flags: Sequence[str],
                 world: int = WORLD, **kw: object):
        super().__init__(tmp, world=world, style="sibling", gloo=True, grace=1.0, **kw)  # type: ignore[arg-type]
        self.steps, self.step_s, self.timeout_s, self.flags = steps, step_s, timeout_s, list(flags)

    def _argv(self) -> List[str]:
        argv = [sys.executable, str(PROGRAM), "--world", str(self.world), "--ready", str(self.ready_dir),
                "--steps", str(self.steps), "--step-s", str(self.step_s), "--timeout", str(self.timeout_s), *self.flags]
        for item in self.behave:
            argv += ["--behave", item]
        return argv

    def diagnosis_record(self) -> Optional[dict]:
        try:
            return dict(json.loads((self.run_dir / "events" / "diagnosis.json").read_text()))
        except (OSError, ValueError):
            return None

    def wait_diagnosis(self, within: float = DIAGNOSED_S) -> dict:
        """The diagnosis, as ``peerwatch status --json`` shows it, once one is written."""
        deadline = time.monotonic() + within
        while self.diagnosis_record() is None:
            ended = [p.label for p in self.all_procs() if p.gone()]
            assert not ended, f"{', '.join(ended)} ended before a diagnosis\n{self.logs()}"
            assert time.monotonic() < deadline, f"no diagnosis within {within}s\n{self.logs()}"
            time.sleep(0.05)  # a file in a folder: no event to poll on here; the deadline bounds it
        out = subprocess.run([sys.executable, "-m", "peerwatch", "status", str(self.run_dir), "--json"],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        return dict(json.loads(out.stdout)["diagnosis"])

    def lines(self, text: str) -> List[str]:
        found = []
        for rank in range(self.world):
            found += [line for line in self.log_path(rank).read_text(errors="replace").splitlines() if text in line]
        return found

    def verdict(self) -> dict:
        path = self.run_dir / "events" / "verdict.json"
        assert path.exists(), f"no verdict was written\n{self.logs()}"
        return dict(json.loads(path.read_text()))


@pytest.fixture
def make_job(tmp_path: Path, no_leaks: str) -> Iterator[Callable[..., DiagJob]]:
    jobs: List[DiagJob] = []

    def make(behave: Sequence[str] = (), steps: int = 0, step_s: float = 0.02, timeout_s: float = 120.0,
             env: Optional[Dict[str, str]] = None, flags: Sequence[str] = (), world: int = WORLD) -> DiagJob:
        full = {"PEERWATCH_HEARTBEAT": f"{HEARTBEAT_S:g}", "PEERWATCH_HANG_WARN": f"{WARN_S:g}", **(env or {})}
        job = DiagJob(tmp_path, steps, step_s, timeout_s, flags, world=world, behave=behave, env=full,
                      name=f"job{len(jobs)}")
        jobs.append(job)
        job.start()
        return job

    yield make
    for job in jobs:
        job.close()


def _stuck_then_ended(job: DiagJob) -> None:
    """The diagnosis only warned: the job is still stuck, every rank alive. End it."""
    assert not any(p.gone() for p in job.all_procs()), job.logs()
    assert not (job.run_dir / "events" / "verdict.json").exists(), job.logs()
    job.kill_all()


# -- a rank stops taking part ------------------------------------------------------------


def test_a_stuck_rank_is_named_by_the_collective_the_others_wait_in(make_job) -> None:
    job = make_job(behave=[f"1=lock@{AT_STEP}"])
    job.wait_ready(timeout=START_S)
    d = job.wait_diagnosis()
    assert (d["kind"], d["laggards"], d["entered"]) == ("hang", [1], [0, 2]), d
    assert d["collective"] == {"group": "0", "seq": AT_STEP + 1, "op": "gloo:all_reduce"}, d
    assert WARN_S <= d["since"] < WARN_S + 3 * HEARTBEAT_S, d
    assert "collective_program.py" in d["detail"] and "in main" in d["detail"], d
    # One line per job, not per rank: every "hang:" line comes from one judge. (That judge
    # may say it again after a "moved again": seen once under load, to be hunted; see
    # docs/hangs.md's limits.)
    judges = {re.search(r"diagnosed by rank (\d+)", line).group(1)  # type: ignore[union-attr]
              for line in job.lines("peerwatch: hang:")}
    assert len(judges) == 1, job.logs()
    status = subprocess.run([sys.executable, "-m", "peerwatch", "status", str(job.run_dir)],
                            capture_output=True, text=True, timeout=30).stdout
    assert "diagnosis: hang" in status and "rank 1 never entered gloo:all_reduce" in status, status
    _stuck_then_ended(job)


def test_a_rank_that_skipped_one_collective_is_named_as_a_mismatch(make_job) -> None:
    """It reaches the final barrier while the others are in their last all_reduce: the
    same sequence number, another op."""
    steps = 40
    job = make_job(behave=[f"1=skip@{AT_STEP}"], steps=steps)
    job.wait_ready(timeout=START_S)
    d = job.wait_diagnosis()
    assert (d["kind"], d["laggards"], d["entered"]) == ("mismatch", [1], [0, 2]), d
    assert d["collective"] == {"group": "0", "seq": steps, "op": "gloo:all_reduce"}, d
    assert "gloo:barrier" in d["detail"], d
    _stuck_then_ended(job)


def test_a_rank_calling_all_reduce_with_another_size_is_named_as_a_mismatch(make_job) -> None:
    job = make_job(behave=[f"1=size@{AT_STEP}"])
    job.wait_ready(timeout=START_S)
    d = job.wait_diagnosis()
    assert (d["kind"], d["laggards"], d["entered"]) == ("mismatch", [1], [0, 2]), d
    assert d["collective"] == {"group": "0", "seq": AT_STEP + 1, "op": "gloo:all_reduce"}, d
    assert "[[1]]" in d["detail"] and "[[4]]" in d["detail"], d
    _stuck_then_ended(job)


def test_a_sigstopped_rank_is_the_laggard(make_job) -> None:
    job = make_job()
    job.wait_ready(timeout=START_S)
    job.kill(2, signal.SIGSTOP)
    d = job.wait_diagnosis()
    assert d["kind"] == "hang" and d["laggards"][0] == 2, d
    assert "stopped (SIGSTOP)" in d["detail"], d
    job.kill_all()


def test_the_gloo_timeout_after_a_diagnosis_names_the_laggard_not_its_victims(make_job) -> None:
    """The others' 10 s gloo timeout fires: before, the verdict named the first of them,
    cause exception. The laggard loops in Python: busy (nobody can tell a loop from a
    computation), not ended, and still named at the timeout."""
    job = make_job(behave=[f"1=loop@{AT_STEP}"], timeout_s=10.0)
    job.wait_ready(timeout=START_S)
    job.wait_diagnosis()
    job.wait_gone(within=10.0 + 10.0)
    v = job.verdict()
    assert (v["rank"], v["cause"], v["exit_code"], v["laggards"]) == (1, "hang", 124, [1]), v
    assert "then failed waiting for it" in v["detail"] and "Timed out" in v["detail"], v


def test_hang_timeout_auto_ends_the_job_at_the_diagnosis(make_job) -> None:
    job = make_job(behave=[f"1=lock@{AT_STEP}"], env={"PEERWATCH_HANG_TIMEOUT": "auto"})
    job.wait_ready(timeout=START_S)
    job.wait_gone(within=START_S)  # well before the 120 s gloo timeout
    v = job.verdict()
    assert (v["rank"], v["cause"], v["exit_code"], v["laggards"]) == (1, "hang", 124, [1]), v
    assert job.exit_codes() == {0: 124, 1: 124, 2: 124}, job.logs()


def test_hang_timeout_in_seconds_works_without_beat(make_job) -> None:
    """The collectives entered are progress: before, without beat() there was nothing to
    judge by and the job waited for gloo's timeout."""
    job = make_job(behave=[f"1=loop@{AT_STEP}"], env={"PEERWATCH_HANG_TIMEOUT": "4", "PEERWATCH_HANG_WARN": "off"})
    job.wait_ready(timeout=START_S)
    job.wait_gone(within=START_S)
    v = job.verdict()
    assert (v["rank"], v["cause"], v["exit_code"]) == (1, "hang", 124), v
    assert job.diagnosis_record() is None


def test_a_stall_that_ends_is_resolved_and_the_job_goes_on(make_job) -> None:
    """Rank 1 sleeps 7 s once, outside paused() (an unannounced checkpoint): diagnosed at
    3 s, then resolved when it moves again; the job finishes cleanly."""
    job = make_job(behave=["1=sleep:7@10"], steps=200)  # ~4 s of steps after: the judges look again
    job.wait_ready(timeout=START_S)
    job.wait_gone(within=7.0 + 20.0)
    assert job.returncodes() == {0: 0, 1: 0, 2: 0}, job.logs()
    d = job.diagnosis_record()
    assert d is not None and d["laggards"] == [1] and d["resolved_ns"] is not None, d
    assert len(job.lines("it was slow, not stuck")) == 1, job.logs()
    report = json.loads(subprocess.run([sys.executable, "-m", "peerwatch", "report", str(job.run_dir), "--json"],
                                       capture_output=True, text=True, timeout=30).stdout)
    assert report["diagnosis"]["resolved_at"] is not None and report["verdict"] is None, report


# -- rule: busy or stuck ------------------------------------------------------------------

AUTO = {"PEERWATCH_HANG_TIMEOUT": "auto"}


@pytest.mark.parametrize("behaviour, evidence", [
    ("checkpoint:12", "read or written"),  # rank 1 writes a file alone, CPU and bytes
    ("evaluate:12", "other threads on a CPU"),  # rank 1 evaluates a model alone: torch computes, no I/O
    ("workers:12", "child processes"),  # rank 1 waits for a worker process that computes
])
def test_a_busy_laggard_is_reported_busy_and_auto_lets_the_job_finish(make_job, behaviour: str, evidence: str) -> None:
    """Before, hang_timeout=auto ended these jobs (exit 124) at the diagnosis, and the log
    line said "the job goes on"."""
    job = make_job(behave=[f"1={behaviour}@{AT_STEP}"], steps=200, env=AUTO)
    job.wait_ready(timeout=START_S)
    job.wait_gone(within=12.0 + 30.0)
    assert job.returncodes() == {0: 0, 1: 0, 2: 0}, job.logs()
    d = job.diagnosis_record()
    assert d is not None and (d["finding"], d["laggards"]) == ("busy", [1]), d
    assert d["resolved_ns"] is not None and evidence in d["detail"], d
    said = job.lines("peerwatch: busy:")
    assert said and all("hang_timeout=auto ends it at" in line and "the job goes on" in line for line in said), said
    assert not (job.run_dir / "events" / "verdict.json").exists()
    report = json.loads(subprocess.run([sys.executable, "-m", "peerwatch", "report", str(job.run_dir), "--json"],
                                       capture_output=True, text=True, timeout=30).stdout)
    jsonschema.validate(report, json.loads((Path(peerwatch.__file__).parent / "schemas" / "report-v1.schema.json").read_text()))
    assert report["diagnosis"]["kind"] == "busy" and report["diagnosis"]["ends_at"] is not None, report["diagnosis"]


@pytest.mark.parametrize("behaviour, evidence", [
    ("compute:15", "its main thread on a CPU"),  # one torch op in a loop, one thread: 1-2 places
    ("spin:15", "its main thread on a CPU"),  # a Python loop: as an endless one would be
    ("trickle:15", "read or written by its main thread"),  # a slow read: a few bytes a second
    ("subprocess:15", "its child processes on a CPU"),  # a child the rank waits for, started by subprocess
])
def test_a_rank_computing_or_reading_alone_is_busy_and_auto_lets_it_finish(make_job, behaviour: str, evidence: str) -> None:
    """Two ranks: rank 0 (a judge itself) works alone, rank 1 waits in all_reduce. Before,
    CPU at under 4 places (or a few bytes a second) was no work: the diagnosis said hang,
    and hang_timeout=auto ended with 124 a job that computed (nanoGPT's rank-0 evaluation)."""
    job = make_job(behave=[f"0={behaviour}@{AT_STEP}"], steps=200, env=AUTO, world=2)
    job.wait_ready(timeout=START_S)
    job.wait_gone(within=15.0 + 30.0)
    assert job.returncodes() == {0: 0, 1: 0}, job.logs()
    assert not (job.run_dir / "events" / "verdict.json").exists(), job.logs()
    d = job.diagnosis_record()
    assert d is not None and (d["finding"], d["laggards"]) == ("busy", [0]), d
    assert d["resolved_ns"] is not None and evidence in d["detail"], d
    assert not job.lines("peerwatch: hang:"), job.logs()


def test_a_laggard_blocked_on_a_lock_is_stuck_and_auto_ends_it_at_once(make_job) -> None:
    job = make_job(behave=[f"1=lock@{AT_STEP}"], env=AUTO)
    job.wait_ready(timeout=START_S)
    job.wait_gone(within=DIAGNOSED_S + 10.0)
    v = job.verdict()
    assert (v["rank"], v["cause"], v["exit_code"], v["laggards"]) == (1, "hang", 124, [1]), v
    assert "busy" not in v["detail"], v
    said = job.lines("peerwatch: hang:")
    assert said and all("hang_timeout=auto ends the job now" in line for line in said), said


def test_a_busy_laggard_is_ended_by_auto_before_the_collective_timeout(make_job) -> None:
    """A checkpoint longer than the collective timeout: ended at 90 % of it, naming the
    laggard, before gloo's timeout makes victims of the others."""
    timeout_s = 25.0
    job = make_job(behave=[f"1=checkpoint:600@{AT_STEP}"], timeout_s=timeout_s, env=AUTO)
    job.wait_ready(timeout=START_S)
    job.wait_gone(within=timeout_s + 20.0)
    v = job.verdict()
    assert (v["rank"], v["cause"], v["exit_code"], v["laggards"]) == (1, "hang", 124, [1]), v
    assert "busy, not stuck" in v["detail"], v
    d = job.diagnosis_record()
    assert d is not None and d["finding"] == "busy", d
    assert d["end_at_ns"] - d["stalled_at_ns"] == pytest.approx(0.9 * timeout_s * 1e9, rel=0.01), d


# -- a stuck laggard is named in seconds with no configuration (rule: plainly stuck; issue 34) ---

NO_CONFIG = {"PEERWATCH_HANG_WARN": "auto"}  # the default: the fixture's 3 s taken back


def _named_before_the_floor(job: DiagJob) -> dict:
    """The diagnosis, arrived before the learnt threshold's floor could have fired: its own
    ``since`` (the judge's awake time since the job last moved, under a minute) and the
    wall clock from the laggard's ``doing`` marker. Before the rule "plainly stuck", ``since`` was at least
    FLOOR_S whatever the load."""
    d = job.wait_diagnosis(within=FLOOR_S + DIAGNOSED_S + 10.0)
    onset = (job.ready_dir / "doing-1").stat().st_mtime  # written right before it blocks
    assert d["since"] < FLOOR_S, d
    assert time.time() - onset < FLOOR_S, d  # onset to naming, measured by the test, loose
    return d


def test_a_hang_right_after_the_start_is_named_in_seconds_with_no_configuration(make_job) -> None:
    """Rank 1 blocks after 30 collectives, gloo's default 30-minute timeout, nothing set:
    before, the threshold was half the timeout until 10 movements were learnt (900 s), then
    the floor (a minute); now a laggard with a whole window of nothing is named at STUCK_S."""
    job = make_job(behave=["1=lock@30"], timeout_s=1800.0, env=NO_CONFIG)
    job.wait_ready(timeout=START_S)
    d = _named_before_the_floor(job)
    assert (d["kind"], d["laggards"], d["entered"]) == ("hang", [1], [0, 2]), d
    assert d["collective"] == {"group": "0", "seq": 31, "op": "gloo:all_reduce"}, d
    assert STUCK_S <= d["since"], d
    assert "collective_program.py" in d["detail"] and "in main" in d["detail"], d
    _stuck_then_ended(job)


def test_a_sigstopped_rank_is_named_in_seconds_with_no_configuration(make_job) -> None:
    job = make_job(timeout_s=1800.0, env=NO_CONFIG)
    job.wait_ready(timeout=START_S)
    job.kill(2, signal.SIGSTOP)
    d = job.wait_diagnosis(within=FLOOR_S + DIAGNOSED_S + 10.0)
    assert d["kind"] == "hang" and d["laggards"][0] == 2 and "stopped (SIGSTOP)" in d["detail"], d
    assert STUCK_S <= d["since"] < FLOOR_S, d
    assert time.monotonic() - job.killed_at < FLOOR_S, d  # onset to naming, loose
    job.kill_all()


def test_hang_timeout_auto_ends_a_stuck_rank_in_seconds_with_nothing_else_set(make_job) -> None:
    job = make_job(behave=[f"1=lock@{AT_STEP}"], timeout_s=1800.0, env={**NO_CONFIG, **AUTO})
    job.wait_ready(timeout=START_S)
    job.wait_gone(within=FLOOR_S + DIAGNOSED_S + 10.0)
    v = job.verdict()
    assert (v["rank"], v["cause"], v["exit_code"], v["laggards"]) == (1, "hang", 124, [1]), v
    assert job.exit_codes() == {0: 124, 1: 124, 2: 124}, job.logs()
    d = job.diagnosis_record()
    assert d is not None and d["finding"] == "hang" and STUCK_S * 1e9 <= d["since_ns"] < FLOOR_S * 1e9, d


@pytest.mark.timeout(180)
@pytest.mark.parametrize("behaviour, evidence", [
    ("spin:25", "its main thread on a CPU"),  # a Python loop (as an endless one would be): busy, not stuck
    ("workers:25", "child processes"),  # waiting for a data loader worker that computes
])
def test_a_busy_laggard_over_the_stuck_window_is_not_named_and_auto_lets_it_finish(
        make_job, behaviour: str, evidence: str) -> None:
    """Rank 0 works alone for 25 s (well past STUCK_S, under the learnt floor) while rank 1
    waits in all_reduce, hang_timeout=auto and nothing else set: no hang, nothing ended."""
    job = make_job(behave=[f"0={behaviour}@{AT_STEP}"], steps=200, timeout_s=1800.0, env={**NO_CONFIG, **AUTO},
                   world=2)
    job.wait_ready(timeout=START_S)
    job.wait_gone(within=25.0 + 60.0)
    assert job.returncodes() == {0: 0, 1: 0}, job.logs()
    assert not (job.run_dir / "events" / "verdict.json").exists(), job.logs()
    assert not job.lines("peerwatch: hang:") and not job.lines("peerwatch: mismatch:"), job.logs()
    d = job.diagnosis_record()
    assert d is None or (d["finding"] == "busy" and evidence in d["detail"]), d


# -- no diagnosis -----------------------------------------------------------------------


def _ends_cleanly(job: DiagJob, within: float) -> None:
    job.wait_ready(timeout=START_S)
    job.wait_gone(within=within)
    assert job.returncodes() == {0: 0, 1: 0, 2: 0}, job.logs()
    assert job.diagnosis_record() is None, job.diagnosis_record()
    assert not job.lines("peerwatch: hang:") and not job.lines("peerwatch: mismatch:"), job.logs()


def test_no_diagnosis_for_a_slow_but_moving_job_with_the_learnt_threshold(make_job) -> None:
    """Steps of 2 s, a 10 s collective timeout: the threshold is at most 5 s, and the job
    moves every 2 s."""
    job = make_job(steps=8, step_s=2.0, timeout_s=10.0, env={"PEERWATCH_HANG_WARN": "auto"})
    _ends_cleanly(job, within=8 * 2.0 + 20.0)


def test_no_diagnosis_while_a_rank_is_in_a_long_paused_phase(make_job) -> None:
    job = make_job(behave=["1=paused:8@10"], steps=30)
    _ends_cleanly(job, within=8.0 + 20.0)


def test_no_diagnosis_for_ranks_that_never_import_torch(make_job) -> None:
    job = make_job(steps=300, flags=["--no-torch"])
    _ends_cleanly(job, within=6.0 + 20.0)
    for rank in range(WORLD):
        assert (job.ready_dir / f"done-{rank}").read_text() == "torch not imported", job.logs()


def test_no_diagnosis_for_a_job_without_collectives(make_job) -> None:
    job = make_job(steps=300, flags=["--no-collectives"])
    _ends_cleanly(job, within=6.0 + 20.0)


# -- a scheduler suspends the job and resumes it ------------------------------------------

SUSPEND_BEAT_S = 0.2  # the heartbeat interval of the suspended jobs (the judges look this often)
SUSPEND_WARN_S = 4.0  # their hang_warn: well under the stop, well over rank 0's head start
STOP_S = 6.0  # how long every rank stays stopped
HEAD_START_BEATS = 5  # rank 0 resumes first, for this many of its heartbeats (about a second)


def _heartbeat(job: DiagJob, rank: int) -> Optional[dict]:
    """The rank's last heartbeat (None: not written yet, or caught mid-rewrite)."""
    try:
        beat = json.loads((job.run_dir / "heartbeats" / f"rank-{rank:05d}.json").read_text())
    except (OSError, ValueError):
        return None
    return beat if isinstance(beat, dict) and beat.get("pid") == job.pids[rank] else None


def _wait_heartbeats(job: DiagJob, what: str, done: Callable[[Dict[int, dict]], bool], within: float) -> None:
    """Wait until ``done`` holds of every rank's last heartbeat; fail with the logs after ``within`` s."""
    deadline = time.monotonic() + within
    while True:
        beats = {r: _heartbeat(job, r) for r in range(WORLD)}
        if all(b is not None for b in beats.values()) and done(beats):  # type: ignore[arg-type]
            return
        assert not any(p.gone() for p in job.all_procs()), f"a rank ended while waiting until {what}\n{job.logs()}"
        assert time.monotonic() < deadline, f"not {what} within {within}s\n{job.logs()}"
        time.sleep(0.05)  # files in a folder: no event to poll on here; the deadline bounds it


def test_a_job_suspended_and_resumed_by_its_scheduler_goes_on(make_job) -> None:
    """Every rank SIGSTOPped for longer than the thresholds, then resumed, rank 0 a second
    before the others (a scheduler's suspend): the judges were stopped too, and count a
    silence only while they were awake to see it. Before, rank 0's judge read everyone's
    stale heartbeats as a hang and hang_timeout=auto ended the job (124, -15, -15)."""
    job = make_job(steps=120, step_s=0.05, env={
        "PEERWATCH_HEARTBEAT": f"{SUSPEND_BEAT_S:g}", "PEERWATCH_HANG_WARN": f"{SUSPEND_WARN_S:g}",
        "PEERWATCH_HANG_TIMEOUT": "auto",
    })
    job.wait_ready(timeout=START_S)
    # Mid-training: every rank's heartbeat carries its collective counters (the judges judge).
    _wait_heartbeats(job, "every rank published its collectives", lambda b: all(x["collectives"] for x in b.values()),
                     within=10.0)
    for rank in range(WORLD):
        job.kill(rank, signal.SIGSTOP)
    _wait_heartbeats(job, f"every heartbeat is {STOP_S:g}s old",
                     lambda b: time.time_ns() - max(x["time_ns"] for x in b.values()) >= STOP_S * 1e9,
                     within=STOP_S + 5.0)
    seq = _heartbeat(job, 0)["seq"]  # type: ignore[index]
    job.kill(0, signal.SIGCONT)
    _wait_heartbeats(job, f"rank 0 wrote {HEAD_START_BEATS} heartbeats since it resumed",
                     lambda b: b[0]["seq"] >= seq + HEAD_START_BEATS, within=10.0)
    for rank in range(1, WORLD):
        job.kill(rank, signal.SIGCONT)
    job.wait_gone(within=30.0)
    assert job.returncodes() == {0: 0, 1: 0, 2: 0}, job.logs()
    assert job.diagnosis_record() is None, job.diagnosis_record()
    assert not (job.run_dir / "events" / "verdict.json").exists(), job.logs()
    assert not job.lines("peerwatch: hang:") and not job.lines("peerwatch: busy:"), job.logs()
