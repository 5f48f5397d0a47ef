"""Two jobs given one run directory at the same instant (issue 22.3): the second process
claiming a live rank's slot is refused (and says so), and never joins the other job; a
record that is not the registered process's is ignored, so job B cannot end job A."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

from peerwatch.core.records import Failure, encode
from peerwatch.rundir.rundir import EVENTS, VERDICT_FILE, RunDir

PROGRAM = Path(__file__).with_name("two_jobs_program.py")
ROOT = Path(__file__).resolve().parent.parent
DEADLINE_S = 30.0


def _start(tag: str, rank: int, run: Path, sync: Path, logs: Path) -> subprocess.Popen:
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", PEERWATCH_DIR=str(run), PYTHONPATH=str(ROOT))
    for var in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        env.pop(var, None)
    log = open(logs / f"{tag}{rank}.log", "w")
    return subprocess.Popen([sys.executable, str(PROGRAM), tag, str(sync)], env=env, stdout=log, stderr=log)


def _wait_for(path: Path, procs: List[subprocess.Popen], within: float = DEADLINE_S) -> str:
    deadline = time.monotonic() + within
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never came; exit codes {[p.poll() for p in procs]}"
        time.sleep(0.02)
    return path.read_text()


def test_a_second_claim_on_a_live_slot_is_refused_and_cannot_end_the_other_job(tmp_path: Path) -> None:
    run, sync, logs = tmp_path / "run", tmp_path / "sync", tmp_path / "logs"
    sync.mkdir()
    logs.mkdir()
    a0 = _start("A", 0, run, sync, logs)
    procs = [a0]
    try:
        _wait_for(sync / "installed-A0", procs)
        procs.append(_start("A", 1, run, sync, logs))
        _wait_for(sync / "prepared-A", procs)  # A's rank 1 is between the check and what follows it
        b1 = _start("B", 1, run, sync, logs)
        procs.append(b1)
        assert _wait_for(sync / "installed-A1", procs) == "protected"
        said = _wait_for(sync / "installed-B", procs)
        b_log = (logs / "B1.log").read_text()
        assert said == "refused", b_log
        assert "NOT protected" in b_log and f"already registered by live pid {procs[1].pid}" in b_log, b_log
        # A record of job B's process (as a racing job would leave) is not job A's rank 1's.
        forged = Failure(rank=1, pid=b1.pid, time_ns=time.time_ns(), cause="exception", exit_code=1,
                         message="job B's rank 1 failed")
        RunDir(str(run)).write(EVENTS, "failure-00001.json", encode(forged))
        (sync / "fail-B").write_text("")
        assert b1.wait(DEADLINE_S) == 1
        time.sleep(1.5)  # several heartbeats: time for job A to (wrongly) act on it
        assert not (run / EVENTS / VERDICT_FILE).exists(), (logs / "A0.log").read_text()
        (sync / "finish").write_text("")
        codes: Dict[str, int] = {"A0": procs[0].wait(DEADLINE_S), "A1": procs[1].wait(DEADLINE_S)}
        assert codes == {"A0": 0, "A1": 0}, (logs / "A0.log").read_text() + (logs / "A1.log").read_text()
        assert not (run / EVENTS / VERDICT_FILE).exists()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
