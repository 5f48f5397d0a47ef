"""End to end: the flight-recorder dumps peerwatch leaves are read by torch's own
analyzer (``python -m torch.distributed.flight_recorder.fr_trace``), whose finding agrees
with peerwatch's diagnosis (3 ranks, gloo on CPU; the jobs of tests/test_diagnosis.py).

Every wait has a deadline; the analyzer runs as a subprocess with a timeout.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List

import pytest
from test_diagnosis import AT_STEP, HEARTBEAT_S, START_S, WARN_S, DiagJob

pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.timeout(90)

ANALYZER = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace"]
ANALYZER_TIMEOUT_S = 60.0  # it imports torch: seconds on 2 loaded cores
DUMPED_S = 10.0  # every rank has dumped this long after the diagnosis (it learns of it by inotify)


@pytest.fixture
def jobs(tmp_path: Path, no_leaks: str) -> Iterator[List[DiagJob]]:
    made: List[DiagJob] = []
    yield made
    for job in made:
        job.close()


def start(jobs: List[DiagJob], tmp: Path, behave: str, **env: str) -> DiagJob:
    full = {"PEERWATCH_HEARTBEAT": f"{HEARTBEAT_S:g}", "PEERWATCH_HANG_WARN": f"{WARN_S:g}", **env}
    job = DiagJob(tmp, 0, 0.02, 120.0, [], behave=[behave], env=full, name=f"job{len(jobs)}")
    jobs.append(job)
    job.start()
    job.wait_ready(timeout=START_S)
    return job


def dumps_logged(job: DiagJob, why: str) -> Dict[int, dict]:
    """rank -> its last ``flight_recorder`` line of the event log made at ``why``."""
    found: Dict[int, dict] = {}
    try:
        lines = (job.run_dir / "events.jsonl").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue  # the line being written
        if event.get("event") == "flight_recorder" and event.get("why") == why:
            found[event["rank"]] = event
    return found


def wait_dumps(job: DiagJob, why: str) -> Dict[int, dict]:
    deadline = time.monotonic() + DUMPED_S
    while len(found := dumps_logged(job, why)) < job.world:
        assert time.monotonic() < deadline, f"dumps at the {why}: {sorted(found)}\n{job.logs()}"
        time.sleep(0.05)  # a line in a file: no event to poll on here; the deadline bounds it
    return found


def analyze(folder: Path) -> str:
    out = subprocess.run([*ANALYZER, str(folder)], capture_output=True, text=True, timeout=ANALYZER_TIMEOUT_S)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    return text


def test_torchs_analyzer_names_the_laggard_peerwatch_named_from_the_teardown_dumps(tmp_path, jobs) -> None:
    """A rank blocks on a lock while the others wait in all_reduce; hang_timeout=auto makes
    the diagnosis the verdict, and every rank dumps as it leaves."""
    job = start(jobs, tmp_path, f"1=lock@{AT_STEP}", PEERWATCH_HANG_TIMEOUT="auto")
    job.wait_gone(within=START_S)
    assert job.exit_codes() == {0: 124, 1: 124, 2: 124}, job.logs()
    d = job.diagnosis_record()
    assert d is not None and (d["finding"], d["laggards"], d["seq"]) == ("hang", [1], AT_STEP + 1), d
    dumped = wait_dumps(job, "teardown")
    assert all(e["bytes"] > 0 and e["groups"] == 1 for e in dumped.values()), dumped

    folder = job.run_dir / "flight_recorder"
    assert sorted(p.name for p in folder.iterdir()) == ["rank_0", "rank_1", "rank_2"]
    found = analyze(folder)
    # torch's words: the collective peerwatch named, and the rank that never joined it.
    m = re.search(r"Not all ranks joining collective, sequence number: (\d+)\n(?:.*\n)*?missing ranks: \{([\d, ]+)\}",
                  found)
    assert m is not None, found
    assert int(m.group(1)) == d["seq"] and [int(r) for r in m.group(2).split(",")] == d["laggards"], found
    assert "collective: gloo:all_reduce" in found, found

    # The report names the folder, and the command.
    report = json.loads((job.run_dir / "report.json").read_text())
    assert report["flight_recorder"]["dir"] == str(folder), report["flight_recorder"]
    rebuilt = job.cli_report()["flight_recorder"]
    assert rebuilt == {"dir": str(folder), "ranks": [0, 1, 2], "analyze": f"torchfrtrace {folder}"}, rebuilt
    said = job.lines("flight recorder in")
    assert said and all(str(folder) in line for line in said), job.logs()
    # Printed while the ranks leave: the dumps there then, and that more come (never the
    # first ones passed for all of them).
    assert all("so far; every rank dumps its own as it leaves" in line or "ranks 0, 1, 2 dumped" in line
               for line in said), said


def test_torchs_analyzer_finds_the_mismatch_peerwatch_diagnosed_from_the_diagnosis_dumps(tmp_path, jobs) -> None:
    """A rank calls all_reduce with 1 float where the others send 4; the diagnosis only
    warns, and every rank dumps when it appears."""
    job = start(jobs, tmp_path, f"1=size@{AT_STEP}")
    d = job.wait_diagnosis()
    assert (d["kind"], d["laggards"], d["entered"]) == ("mismatch", [1], [0, 2]), d
    wait_dumps(job, "diagnosis")
    found = analyze(job.run_dir / "flight_recorder")
    job.kill_all()

    m = re.search(r"Collective sequence number: (\d+) has errors", found)
    assert m is not None, found
    assert int(m.group(1)) == d["collective"]["seq"], found
    # The analyzer compares every rank with the first dump it reads (the folder's order):
    # it names rank 1 as the culprit, or, when it read rank 1 first, the two others.
    culprits = {int(r) for r in re.findall(r"Culprit rank (\d+); Error type: SIZE_OR_SYNTAX_MISMATCH", found)}
    assert culprits in ({1}, {0, 2}), found
    assert "[[4]]" in found and "[[1]]" in found, found
