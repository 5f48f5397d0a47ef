"""Interrupts are not failures: a SIGINT (Ctrl-C) or a SIGTERM sent to the whole job from
outside (its process group) ends every rank with the signal's exit code, and the report and
the terminal say the job was interrupted, blaming no rank (rule: interrupts are not failures). A signal to
one rank alone is still that rank's failure.

Real sibling ranks in a process group of their own, as a terminal's foreground job.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from harness import by_rank

pytestmark = pytest.mark.timeout(90)

WORLD = 3
GRACE_S = 1.0
# The signal -> every process gone: at once for a SIGTERM; a KeyboardInterrupt's rank waits
# for the verdict (at most the decision's 2 s window where a rank did not get the signal).
GONE_S = 2.0 + GRACE_S + 5.0


def _no_blame(job, logs: str, report: dict) -> None:
    assert report["outcome"] == "interrupted", f"{report['outcome']}\n{logs}"
    assert report["verdict"]["cause"] == "interrupted", f"{report['verdict']}\n{logs}"
    assert {r["state"] for r in report["ranks"]} == {"interrupted"}, f"{report['ranks']}\n{logs}"
    assert "failed first" not in logs, logs


def test_a_sigint_to_the_whole_job_is_an_interrupt_not_a_failure(make_job) -> None:
    """Ctrl-C: every rank raises KeyboardInterrupt at once. Before, the verdict blamed one
    of them: 'rank 1 failed first: raised KeyboardInterrupt'."""
    job = make_job(world=WORLD, grace=GRACE_S, own_group=True).start()
    job.wait_ready()
    job.signal_group(signal.SIGINT)
    job.wait_gone(within=GONE_S)
    logs = job.logs()
    assert job.exit_codes() == {r: 130 for r in range(WORLD)}, logs
    report = job.report()
    _no_blame(job, logs, report)
    v = report["verdict"]
    assert (v["exit_code"], v["signal"], v["signalled_by"], v["inferred"]) == (130, "SIGINT", os.getpid(), False), v
    assert {r["signal"] for r in report["ranks"]} == {"SIGINT"}, report["ranks"]
    # One summary, whose head says it; every rank's own line says it too.
    assert logs.count("peerwatch: the job was interrupted (SIGINT from outside the job") == 1, logs
    for rank in range(WORLD):
        assert "stops with exit code 130: the job was interrupted (SIGINT" in job.log_path(rank).read_text(), logs


def test_a_sigterm_to_the_whole_job_is_an_interrupt_not_a_failure(make_job) -> None:
    """kill -TERM -PGID (a scheduler stopping the job): every rank dies of it at once, each
    writing its exit record as it goes, so no watcher is left to judge; the report tells it
    from the records. Before: 'rank 0 failed first: killed by SIGTERM'."""
    job = make_job(world=WORLD, grace=GRACE_S, own_group=True).start()
    pids = job.wait_ready()
    job.signal_group(signal.SIGTERM)
    job.wait_gone(within=GONE_S)
    logs = job.logs()
    assert job.exit_codes() == {r: 143 for r in range(WORLD)}, logs
    report = job.cli_report()
    _no_blame(job, logs, report)
    v = report["verdict"]
    assert (v["exit_code"], v["signal"], v["signalled_by"]) == (143, "SIGTERM", os.getpid()), v
    entries = by_rank(report)
    assert {r: (e["pid"], e["exit_code"], e["exit_observed"]) for r, e in entries.items()} == {
        r: (pid, 143, True) for r, pid in pids.items()}, entries
    listing = subprocess.run([sys.executable, "-m", "peerwatch", "ls", "--base", str(job.tmp)], capture_output=True,
                             text=True, timeout=30)
    assert "interrupted (SIGTERM)" in listing.stdout and "rank 0 interrupted" not in listing.stdout, listing.stdout


def test_a_sigint_to_one_rank_is_still_that_ranks_failure(make_job) -> None:
    """kill -INT PID of one rank: the others never got it; after the decision's window the
    rank is blamed as before, and the others are torn down with its code."""
    job = make_job(world=WORLD, grace=GRACE_S, own_group=True).start()
    job.wait_ready()
    job.kill(1, signal.SIGINT)
    job.wait_gone(within=GONE_S)
    logs = job.logs()
    assert job.exit_codes() == {r: 130 for r in range(WORLD)}, logs
    report = job.report()
    assert report["outcome"] == "failed", f"{report['outcome']}\n{logs}"
    v = report["verdict"]
    assert (v["rank"], v["cause"], v["exception"]) == (1, "exception", "KeyboardInterrupt"), f"{v}\n{logs}"
    assert by_rank(report)[1]["state"] == "failed", report["ranks"]
    assert "rank 1 (pid" in logs and "failed first: raised KeyboardInterrupt" in logs, logs


@pytest.mark.torch
def test_a_sigint_to_a_job_waiting_in_collectives_is_an_interrupt(make_job) -> None:
    """Ranks training in gloo's all_reduce: at Ctrl-C a rank in Python raises at once, while
    a rank inside all_reduce waits there for it, its main thread in C, unable to raise. Its
    watcher saw the SIGINT arrive and says so (``events/interrupt-<rank>.json``): the job
    was interrupted, no rank failed, and every rank exits 130."""
    pytest.importorskip("torch")
    job = make_job(world=WORLD, grace=GRACE_S, own_group=True, gloo=True,
                   behave=[f"{r}=gloo" for r in range(WORLD)]).start()
    job.wait_ready(timeout=60)
    job.wait_noted([f"collective-{r}" for r in range(WORLD)], timeout=30)
    job.signal_group(signal.SIGINT)
    job.wait_gone(within=GONE_S + 5.0)
    logs = job.logs()
    assert job.exit_codes() == {r: 130 for r in range(WORLD)}, logs
    report = job.report()
    _no_blame(job, logs, report)
    assert report["verdict"]["signal"] == "SIGINT", report["verdict"]


def test_a_sigint_to_a_job_whose_rank_waits_in_c_is_an_interrupt(make_job) -> None:
    """Rank 2's main thread waits in C (as in a collective whose peer will never come) and
    cannot raise KeyboardInterrupt; ranks 0 and 1 raise at once. Rank 2's watcher saw the
    SIGINT arrive and says so: the job was interrupted, and rank 2 is ended with the others.
    Before, nothing showed that rank 2 got it: 'rank 0 failed first: raised KeyboardInterrupt'."""
    job = make_job(world=WORLD, grace=GRACE_S, own_group=True, behave=["2=c_wait"]).start()
    job.wait_ready()
    job.signal_group(signal.SIGINT)
    job.wait_gone(within=GONE_S)
    logs = job.logs()
    assert job.exit_codes() == {r: 130 for r in range(WORLD)}, logs
    report = job.report()
    _no_blame(job, logs, report)
    assert (job.run_dir / "events" / "interrupt-00002.json").exists(), logs
    assert {r["signal"] for r in report["ranks"]} == {"SIGINT"}, report["ranks"]  # rank 2's from its watcher's note
    logged = [json.loads(line) for line in (job.run_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "interrupt" and e["rank"] == 2 and e["signal"] == "SIGINT" for e in logged), logged
