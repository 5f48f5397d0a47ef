"""on_verdict: someone is told, once per host, after the verdict and the report; bounded
by grace; its failures logged. Real jobs of ``rank_program.py``, one rank SIGKILLed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import Job

pytestmark = pytest.mark.timeout(60)

GRACE_S = 1.0  # PEERWATCH_GRACE of every job here: also the hook's bound
ACK_S = 0.5
USUAL_S = ACK_S + GRACE_S + 2.0  # a teardown that must SIGKILL someone (test_e2e_core's STUCK_S)
# The hook runs after the enforcer's share (report written) for at most grace more.
WITH_HOOK_S = USUAL_S + GRACE_S


def _line_command(out: Path) -> str:
    # One line per run of the command: who it was told about, as the variables say.
    return ('printf \'%s|%s|%s|%s|%s|%s|%s|%s\\n\' "$PEERWATCH_FAILED_RANK" "$PEERWATCH_CAUSE" "$PEERWATCH_REPORT" '
            f'"$(test -f "$PEERWATCH_REPORT" && echo report)" "${{PEERWATCH_DIR:-unset}}" "${{RANK:-unset}}" '
            f'"${{PEERWATCH_STORE_SECRET:-unset}}" "${{SLURM_JOB_ID:-unset}}" >> {out}')


@pytest.mark.parametrize("style", ["sibling", "lightning"])
def test_a_command_runs_once_per_host_with_the_verdict(make_job, tmp_path: Path, style: str) -> None:
    out = tmp_path / "told.txt"
    job: Job = make_job(world=4, style=style, env={"PEERWATCH_ON_VERDICT": _line_command(out),
                                                    "PEERWATCH_STORE_SECRET": "s3cret-s3cret-s3cret",
                                                    "SLURM_JOB_ID": "4242"}).start()
    job.wait_ready()
    job.kill(2)
    job.wait_gone(within=WITH_HOOK_S)
    lines = out.read_text().splitlines() if out.exists() else []
    assert len(lines) == 1, f"the command ran {len(lines)} times: {lines}\n{job.logs()}"
    rank, cause, report, exists, inherited, rank_var, secret, slurm_job = lines[0].split("|")
    verdict = job.report()["verdict"]
    assert (int(rank), cause) == (2, verdict["cause"])
    assert report == str(job.run_dir / "report.json") and exists == "report"
    assert inherited == "unset", "the hook must not join the run (PEERWATCH_DIR dropped)"
    # Nor join the job as a rank, nor hold its store secret; the job's id stays (a requeue).
    assert (rank_var, secret, slurm_job) == ("unset", "unset", "4242"), lines[0]


def test_a_callable_gets_the_verdict_and_the_report_path(make_job, tmp_path: Path) -> None:
    out = tmp_path / "told.jsonl"
    job: Job = make_job(world=3, env={"RP_ON_VERDICT_FILE": str(out)}).start()
    job.wait_ready()
    job.kill(1)
    job.wait_gone(within=WITH_HOOK_S)
    lines = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    assert len(lines) == 1, f"{lines}\n{job.logs()}"
    told = lines[0]
    assert told["rank"] == 1 and told["cause"] == job.report()["verdict"]["cause"]
    assert told["report"] == str(job.run_dir / "report.json") and told["report_exists"]
    assert told["by"] != 1


@pytest.mark.parametrize("api", ["install", "watch"])
def test_a_slow_command_is_cut_at_the_bound(make_job, tmp_path: Path, api: str) -> None:
    started = tmp_path / "started"
    # The sleep is in the command's process group: it must be gone too (no_leaks). Under
    # watch() its rank spares it from its own children's teardown: the bound still holds.
    command = f"touch {started}; sleep 60; echo late >> {tmp_path / 'late'}"
    job: Job = make_job(world=3, api=api, env={"PEERWATCH_ON_VERDICT": command}).start()
    job.wait_ready()
    killed_at = job.kill(0)
    job.wait_gone(within=WITH_HOOK_S)
    assert job.gone_at is not None and job.gone_at - killed_at < WITH_HOOK_S
    assert started.exists(), job.logs()
    assert not (tmp_path / "late").exists()
    assert "on_verdict" in job.logs() and "killed at its bound" in job.logs(), job.logs()


def test_a_failing_command_is_logged_and_the_job_ends_as_usual(make_job, tmp_path: Path) -> None:
    job: Job = make_job(world=3, env={"PEERWATCH_ON_VERDICT": "echo bad hook >&2; exit 3"}).start()
    job.wait_ready()
    job.kill(1)
    job.wait_gone(within=WITH_HOOK_S)
    logs = job.logs()
    assert "failed with exit status 3" in logs, logs
    codes = job.exit_codes()
    assert codes[0] == codes[2] == job.report()["verdict"]["exit_code"], codes


def test_a_bad_option_is_refused() -> None:
    import peerwatch
    from peerwatch._config import Config

    with pytest.raises(peerwatch.ConfigError):
        Config.resolve({"on_verdict": 3})
    assert Config.resolve({}, {"PEERWATCH_ON_VERDICT": "true"}).on_verdict == "true"


def test_a_command_under_watch_is_not_ended_by_its_own_rank(make_job, tmp_path: Path) -> None:
    # Under watch() the enforcer that starts the hook then tears down its own children:
    # the hook's process tree (timeout, sh, sleep) must be spared until the hook's bound.
    out = tmp_path / "told.txt"
    command = f"echo start >> {out}; sleep 0.3; echo done >> {out}"
    job: Job = make_job(world=3, api="watch", env={"PEERWATCH_ON_VERDICT": command}).start()
    job.wait_ready()
    job.kill(2)
    job.wait_gone(within=WITH_HOOK_S)
    lines = out.read_text().splitlines() if out.exists() else []
    assert lines == ["start", "done"], f"{lines}\n{job.logs()}"
    events = [json.loads(line) for line in (job.run_dir / "events.jsonl").read_text().splitlines()]
    outcomes = [e.get("outcome") for e in events if e.get("event") == "notify"]
    assert outcomes == ["ok"], f"{outcomes}\n{job.logs()}"
