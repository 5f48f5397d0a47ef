"""on_verdict: someone is told, once per host, after the verdict and the report; bounded
by grace; its failures logged. Real jobs of ``rank_program.py``, one rank SIGKILLed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import Job

pytestmark = pytest.mark.timeout(60)

GRACE_S = 1.0  # PEERWATCH_GRACE of every job here
HOOK_S = 1.0  # PEERWATCH_ON_VERDICT_TIMEOUT, the hook's bound, unless a test says otherwise
ACK_S = 0.5
USUAL_S = ACK_S + GRACE_S + 2.0  # a teardown that must SIGKILL someone (test_e2e_core's STUCK_S)
# The hook runs after the enforcer's share (report written) for at most its bound more
# (plus the second its keeper may take to end the tree).
WITH_HOOK_S = USUAL_S + HOOK_S + 1.0
BOUND = {"PEERWATCH_ON_VERDICT_TIMEOUT": str(HOOK_S)}


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
                                                    "SLURM_JOB_ID": "4242", **BOUND}).start()
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
    job: Job = make_job(world=3, api=api, env={"PEERWATCH_ON_VERDICT": command, **BOUND}).start()
    job.wait_ready()
    killed_at = job.kill(0)
    job.wait_gone(within=WITH_HOOK_S)
    assert job.gone_at is not None and job.gone_at - killed_at < WITH_HOOK_S
    assert started.exists(), job.logs()
    assert not (tmp_path / "late").exists()
    assert "on_verdict" in job.logs() and "killed at its bound" in job.logs(), job.logs()


def test_a_failing_command_is_logged_and_the_job_ends_as_usual(make_job, tmp_path: Path) -> None:
    job: Job = make_job(world=3, env={"PEERWATCH_ON_VERDICT": "echo bad hook >&2; exit 3", **BOUND}).start()
    job.wait_ready()
    job.kill(1)
    job.wait_gone(within=WITH_HOOK_S)
    logs = job.logs()
    assert "failed with exit status 3" in logs, logs
    codes = job.exit_codes()
    assert codes[0] == codes[2] == job.report()["verdict"]["exit_code"], codes


def test_a_bad_option_is_refused() -> None:
    import peerwatch
    from peerwatch.core.config import Config

    with pytest.raises(peerwatch.ConfigError):
        Config.resolve({"on_verdict": 3})
    assert Config.resolve({}, {"PEERWATCH_ON_VERDICT": "true"}).on_verdict == "true"
    # Its bound is its own (issue 22.10): above 0, 10 s unless set, whatever grace is.
    with pytest.raises(peerwatch.ConfigError):
        Config.resolve({"on_verdict_timeout": 0})
    assert Config.resolve({"grace": 0}, {}).on_verdict_timeout == 10.0
    assert Config.resolve({}, {"PEERWATCH_ON_VERDICT_TIMEOUT": "2.5"}).on_verdict_timeout == 2.5


def test_a_command_under_watch_is_not_ended_by_its_own_rank(make_job, tmp_path: Path) -> None:
    # Under watch() the enforcer that starts the hook then tears down its own children:
    # the hook's process tree (timeout, sh, sleep) must be spared until the hook's bound.
    out = tmp_path / "told.txt"
    command = f"echo start >> {out}; sleep 0.3; echo done >> {out}"
    job: Job = make_job(world=3, api="watch", env={"PEERWATCH_ON_VERDICT": command, **BOUND}).start()
    job.wait_ready()
    job.kill(2)
    job.wait_gone(within=WITH_HOOK_S)
    lines = out.read_text().splitlines() if out.exists() else []
    assert lines == ["start", "done"], f"{lines}\n{job.logs()}"
    events = [json.loads(line) for line in (job.run_dir / "events.jsonl").read_text().splitlines()]
    outcomes = [e.get("outcome") for e in events if e.get("event") == "notify"]
    assert outcomes == ["ok"], f"{outcomes}\n{job.logs()}"


def _notify_outcomes(job: Job) -> list:
    events = [json.loads(line) for line in (job.run_dir / "events.jsonl").read_text().splitlines()]
    return [e.get("outcome") for e in events if e.get("event") == "notify"]


@pytest.mark.parametrize("style", ["sibling", "lightning"])
def test_the_rank_running_a_slow_command_stops_training_at_the_verdict(make_job, tmp_path: Path, style: str) -> None:
    # Issue 23.3: the rank that ran a 'sleep 2' hook trained 20-38 more steps meanwhile.
    # The command notes the step its rank (rank 0, the first enforcer) stood at when it
    # started; by the end the rank may have taken at most the one step in flight.
    out = tmp_path / "told.txt"
    step_file = tmp_path / "job0" / "ready" / "step-0"
    command = f"cat {step_file} > {tmp_path / 'step-at-start'}; sleep 1.5; echo done >> {out}"
    job: Job = make_job(world=3, style=style, env={"PEERWATCH_ON_VERDICT": command, "RP_NOTE_STEPS": "1",
                                                   "PEERWATCH_ON_VERDICT_TIMEOUT": "5"}).start()
    job.wait_ready()
    job.wait_noted(["step-0"])
    job.kill(2)
    job.wait_gone(within=WITH_HOOK_S + 5)
    at_start = int((tmp_path / "step-at-start").read_text())
    at_end = int(step_file.read_text())
    assert at_end - at_start <= 1, f"rank 0 trained {at_end - at_start} steps while its hook ran\n{job.logs()}"
    assert out.read_text().splitlines() == ["done"], job.logs()
    assert _notify_outcomes(job) == ["ok"], job.logs()


def test_the_hook_has_its_own_bound_whatever_the_grace(make_job, tmp_path: Path) -> None:
    # Issue 22.10: grace=0 killed the hook at once. Its bound is on_verdict_timeout.
    out = tmp_path / "told.txt"
    command = f"echo start >> {out}; sleep 0.5; echo done >> {out}"
    job: Job = make_job(world=3, grace=0.0, env={"PEERWATCH_ON_VERDICT": command,
                                                 "PEERWATCH_ON_VERDICT_TIMEOUT": "5"}).start()
    job.wait_ready()
    job.kill(1)
    job.wait_gone(within=USUAL_S + 5)
    assert out.read_text().splitlines() == ["start", "done"], job.logs()
    assert _notify_outcomes(job) == ["ok"], job.logs()


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_a_commands_background_processes_end_at_its_bound(make_job, tmp_path: Path) -> None:
    # Issue 22.10: what a hook leaves in the background (nohup, setsid, a double fork out of
    # its session) outlived the job. Each notes its pid, then sleeps far beyond the bound.
    import time

    pids = tmp_path / "pids"
    out = tmp_path / "told.txt"

    def bg(seconds: int) -> str:
        return f"sh -c 'echo $$ >> {pids}; exec sleep {seconds}'"

    command = (f"nohup {bg(60)} >/dev/null 2>&1 & setsid {bg(61)} >/dev/null 2>&1 & "
               f"(setsid {bg(62)} >/dev/null 2>&1 &); echo started >> {out}")
    job: Job = make_job(world=3, env={"PEERWATCH_ON_VERDICT": command, **BOUND}).start()
    job.wait_ready()
    job.kill(1)
    job.wait_gone(within=WITH_HOOK_S)
    assert out.read_text().splitlines() == ["started"], job.logs()
    noted = [int(p) for p in pids.read_text().split()]
    assert len(noted) == 3, noted
    deadline = time.monotonic() + 2.0
    while any(_running(p) for p in noted) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in noted if _running(p)], f"the hook's background processes outlived the job\n{job.logs()}"
    assert "killed at its bound" in str(_notify_outcomes(job)), job.logs()


def test_on_a_shared_run_directory_each_host_claims_the_hook_once(tmp_path: Path) -> None:
    # Issue 22.10: on a run directory shared by the hosts, one claim file made the hook run
    # once per job; an operator's host-local action (upload this host's stacks) needs one
    # per host. Another host's claim (notified-<its host>) does not stop this host's.
    from peerwatch.rundir.rundir import RunDir
    from peerwatch.verdict.notify import CLAIMS, claim

    run = tmp_path / "run"
    (run / CLAIMS).mkdir(parents=True, mode=0o700)
    (run / CLAIMS / "notified-otherhost").touch()
    (run / CLAIMS / "notified").touch()  # a host-local run's claim, as an older version made it
    shared = RunDir(str(run), shared="test: shared_fs=on")
    assert claim(shared) and not claim(shared)
    assert not claim(RunDir(str(run)))  # a host-local run directory: one claim, taken


def test_the_nested_run_s_claim_is_taken_in_the_directory_checked_not_a_symlink_in_its_place(tmp_path: Path) -> None:
    # Issue 25.5: the claim in a nested run (mp.spawn's workers) went through the run
    # directory's path; renamed away and replaced by a symlink, the claim landed elsewhere.
    import os
    import time

    from peerwatch.core.records import Registration
    from peerwatch.proc import identity
    from peerwatch.proc.identity import Started
    from peerwatch.rundir.prepare import prepare
    from peerwatch.rundir.rundir import SPAWNED_RUN, RunDir
    from peerwatch.verdict.notify import CLAIMS, NOTIFIED_FILE, claim

    info = identity.self_info()
    reg = Registration(rank=0, pid=info.pid, ppid=info.ppid, start_ticks=info.start_ticks, uid=info.uid,
                       host=identity.hostname(), boot_id=identity.boot_id(), pidns=identity.pid_namespace(),
                       time_ns=time.time_ns())
    rd = RunDir(str(tmp_path / "run"))
    prepare(rd, reg, Started(time.time_ns(), None))
    (tmp_path / "run" / SPAWNED_RUN).mkdir(mode=0o700)
    os.rename(tmp_path / "run", tmp_path / "moved")
    (tmp_path / "decoy" / SPAWNED_RUN).mkdir(parents=True)
    os.symlink(tmp_path / "decoy", tmp_path / "run")
    try:
        assert claim(rd) and not claim(rd)
        assert (tmp_path / "moved" / SPAWNED_RUN / CLAIMS / NOTIFIED_FILE).is_file()
        assert not (tmp_path / "decoy" / SPAWNED_RUN / CLAIMS).exists()
    finally:
        rd.close()


def test_the_keeper_ends_the_whole_tree_at_its_bound_and_only_it(tmp_path: Path) -> None:
    # The keeper alone: its command's status when the tree ends in time; 124 when
    # something was left at the bound, after SIGKILLing it (a setsid'd orphan included);
    # 143 when its rank asks it to end early (SIGTERM). A process outside the tree lives.
    import signal
    import subprocess
    import sys
    import time

    from peerwatch.verdict import notify

    keeper = [sys.executable, "-I", "-S", notify._KEEPER]
    assert subprocess.run([*keeper, "5", "/bin/sh", "-c", "exit 3"], timeout=30).returncode == 3
    pids = tmp_path / "pids"
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        started = time.monotonic()
        tree = f"(setsid sh -c 'echo $$ >> {pids}; exec sleep 60' &); sh -c 'echo $$ >> {pids}; exec sleep 61' & exit 0"
        # A bound of 2 s: both shells must have written their pids by then (a loaded machine).
        assert subprocess.run([*keeper, "2", "/bin/sh", "-c", tree], timeout=30).returncode == 124
        assert time.monotonic() - started < 10.0  # the bound, not the sleeps' 60 s
        noted = [int(p) for p in pids.read_text().split()]
        assert len(noted) == 2 and not [p for p in noted if _running(p)], noted
        assert bystander.poll() is None, "the keeper ended a process outside its tree"
        early = subprocess.Popen([*keeper, "30", "/bin/sh", "-c", f"touch {tmp_path / 'up'}; exec sleep 60"])
        deadline = time.monotonic() + 10
        while not (tmp_path / "up").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        early.send_signal(signal.SIGTERM)
        assert early.wait(10) == 128 + signal.SIGTERM
    finally:
        bystander.kill()
        bystander.wait()
