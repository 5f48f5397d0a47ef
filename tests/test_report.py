"""The root-cause report: what each failure kind leaves in report.json, the stack files,
the schema, and the CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jsonschema
import pytest
from harness import by_rank, wait_read

SCHEMA = json.loads((Path(__file__).parents[1] / "peerwatch" / "schemas" / "report-v1.schema.json").read_text())
GONE_S = 4.0  # grace (1 s) + generous slack on two loaded cores


def _validate(report: dict) -> None:
    jsonschema.validate(report, SCHEMA)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "peerwatch", *args], capture_output=True, text=True, timeout=30)


@pytest.mark.timeout(60)
def test_exception_is_reported_with_type_message_and_traceback(make_job) -> None:
    job = make_job(world=3, behave=["2=raise@0.3"]).start()
    job.wait_ready()
    job.wait_gone(within=10.0)
    report = job.report()
    _validate(report)
    v = report["verdict"]
    assert (v["rank"], v["cause"], v["exit_code"]) == (2, "exception", 1)
    assert v["exception"] == "RuntimeError"
    assert v["message"] == "rank 2 failed on purpose"
    assert 'raise RuntimeError(f"rank {rank} failed on purpose")' in v["traceback"]
    assert by_rank(report)[2]["state"] == "failed"
    assert {by_rank(report)[r]["state"] for r in (0, 1)} == {"torn_down"}


@pytest.mark.timeout(60)
def test_segfault_is_named_by_its_peers_without_being_their_child(make_job) -> None:
    # Sibling style: no rank is the failing rank's parent; faulthandler's last words tell.
    job = make_job(world=3, behave=["1=segv@0.3"]).start()
    job.wait_ready()
    job.wait_gone(within=GONE_S + 3)
    report = job.report()
    _validate(report)
    v = report["verdict"]
    assert (v["rank"], v["cause"], v["signal"], v["exit_code"]) == (1, "signal", "SIGSEGV", 139)
    assert v["stack_file"] and "Segmentation fault" in Path(v["stack_file"]).read_text()
    assert job.exit_codes() == {0: 139, 1: 139, 2: 139}


@pytest.mark.timeout(60)
def test_sys_exit_seven_everywhere(make_job) -> None:
    job = make_job(world=3, style="lightning", behave=["1=exit:7@0.3"]).start()
    job.wait_ready()
    job.wait_gone(within=GONE_S)
    v = job.report()["verdict"]
    assert (v["rank"], v["cause"], v["exit_code"], v["returncode"]) == (1, "exit", 7, 7)
    codes = job.exit_codes()
    assert codes[0] == 7 and codes[2] == 7


@pytest.mark.timeout(60)
def test_stack_files_show_where_each_survivor_was(make_job) -> None:
    # Rank 2 holds the GIL in C: only a signal-driven faulthandler dump can show it.
    job = make_job(world=3, behave=["2=ignore_term+gil"]).start()
    job.wait_ready()
    job.wait_holding_gil(2)
    job.kill(1)
    job.wait_gone(within=GONE_S + 2)
    report = job.report()
    _validate(report)
    ranks = by_rank(report)
    sleeping = Path(ranks[0]["stack_file"]).read_text()
    assert "rank_program.py" in sleeping and "in behave" in sleeping
    stuck = Path(ranks[2]["stack_file"]).read_text()
    assert "in hold_gil" in stuck or "in behave" in stuck, stuck


PARENT = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, time
    from pathlib import Path
    import peerwatch
    out = sys.argv[1]
    # The ready file is written under a temporary name, then renamed: the test polls for it
    # and must never read it half written.
    child = subprocess.Popen([sys.executable, "-c",
        "import os, time, peerwatch; from pathlib import Path; peerwatch.install(rank=1);"
        "ready = os.environ['CHILD_READY']; Path(ready + '.tmp').write_text(str(os.getpid()));"
        "os.replace(ready + '.tmp', ready); time.sleep(60)"])
    try:
        with peerwatch.watch(rank=0):
            time.sleep(60)  # not child.wait(): that would reap the child itself
    except peerwatch.PeerFailure as e:
        # The watcher read the status without reaping: Popen still gets it.
        Path(out + ".tmp").write_text(json.dumps({"popen": child.wait(), "cause": e.cause, "code": e.exit_code}))
        os.replace(out + ".tmp", out)
        raise
    """
)


@pytest.mark.timeout(60)
def test_parent_reads_exit_status_and_popen_still_gets_it(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    ready = tmp_path / "child_ready"
    env = dict(os.environ, CHILD_READY=str(ready), PEERWATCH_GRACE="2")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(out)], env=env)
    try:
        os.kill(wait_read(ready, int, within=30, writer=parent), signal.SIGKILL)
        assert parent.wait(timeout=15) == 137
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    assert json.loads(out.read_text()) == {"popen": -9, "cause": "signal", "code": 137}


@pytest.mark.timeout(60)
def test_cli_report_status_and_ls(make_job) -> None:
    job = make_job(world=2, behave=["1=exit:5@0.3"]).start()
    job.wait_ready()
    job.wait_gone(within=GONE_S)
    text = _cli("report", str(job.run_dir))
    assert text.returncode == 0
    assert "rank 1" in text.stdout and "failed first: exited with code 5" in text.stdout
    as_json = json.loads(_cli("report", str(job.run_dir), "--json").stdout)
    _validate(as_json)
    assert as_json["verdict"]["exit_code"] == 5
    status = _cli("status", str(job.run_dir))
    assert status.returncode == 0 and "outcome: failed" in status.stdout
    assert status.stdout.splitlines()[0].split() == ["rank", "pid", "host", "state", "heartbeat", "step", "collectives",
                                                   "exit"]
    listing = _cli("ls", "--base", str(job.tmp))
    assert listing.returncode == 0 and str(job.run_dir) in listing.stdout and "rank 1 exit" in listing.stdout


@pytest.mark.parametrize("make_path", [
    lambda tmp: tmp / "missing",
    lambda tmp: (tmp / "a-file").write_text("x") and tmp / "a-file",
    lambda tmp: (tmp / "empty").mkdir() or tmp / "empty",
], ids=["missing", "a file", "not a run directory"])
def test_cli_says_what_is_wrong_with_the_directory(tmp_path: Path, make_path) -> None:
    path = make_path(tmp_path)
    for command in ("report", "status"):
        out = _cli(command, str(path))
        assert out.returncode == 2
        assert out.stderr.startswith("peerwatch: run directory ") and str(path) in out.stderr
        assert not out.stderr.startswith("peerwatch: peerwatch") and len(out.stderr.splitlines()) == 1, out.stderr
        assert "Traceback" not in out.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["record", "fail"])
def test_exception_in_another_thread(make_job, mode: str) -> None:
    """By default a thread's death is recorded for the report, not judged (the process goes
    on); thread_exceptions=fail makes it the rank's failure."""
    job = make_job(
        world=2, behave=["0=succeed@1.0", "1=thread_raise+succeed@1.0"], env={"PEERWATCH_THREAD_EXCEPTIONS": mode}
    ).start()
    job.wait_ready()
    job.wait_gone(within=10.0)
    report = job.cli_report()
    _validate(report)
    noted = by_rank(report)[1]["thread_exception"]
    if mode == "record":
        assert report["verdict"] is None and job.exit_codes() == {0: 0, 1: 0}
        assert noted["thread"] == "prefetcher" and noted["exception"] == "ValueError"
        assert "a helper thread of rank 1 failed" in noted["traceback"]
    else:
        v = report["verdict"]
        assert (v["rank"], v["cause"], v["exception"]) == (1, "exception", "ValueError")
        assert "in thread prefetcher" in v["detail"]


@pytest.mark.timeout(60)
def test_cli_status_watch_refreshes_until_ctrl_c_and_ls_reads_well(make_job) -> None:
    import select
    import time

    job = make_job(world=2, behave=["0=succeed@0.2", "1=succeed@0.2"]).start()
    job.wait_ready()
    job.wait_gone(within=GONE_S)
    listing = _cli("ls", "--base", str(job.tmp)).stdout.splitlines()
    assert listing[0].split()[:5] == ["last", "activity", "state", "outcome", "ranks"], listing
    assert " 2 ranks " in listing[1] and "ranks ranks" not in listing[1], listing
    # SIGINT as at a terminal: a shell runs a background job (a CI script's, say) with it
    # ignored, and the child would inherit that and never see Ctrl-C.
    watch = subprocess.Popen([sys.executable, "-m", "peerwatch", "status", str(job.run_dir), "--watch", "--interval",
                              "0.1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        tables, seen = 0, ""
        deadline = time.monotonic() + 20
        while tables < 3 and time.monotonic() < deadline:
            if select.select([watch.stdout], [], [], deadline - time.monotonic())[0]:
                line = watch.stdout.readline()  # type: ignore[union-attr]
                seen += line
                tables += line.startswith("outcome: succeeded")
        assert tables >= 3, seen
        watch.send_signal(signal.SIGINT)
        # Read what is left meanwhile: a full pipe would hold its last write (and its exit).
        _, err = watch.communicate(timeout=30)
        assert watch.returncode == 0, err
        assert "Traceback" not in err, err
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()


def test_a_hangs_victims_whose_collectives_timed_out_are_torn_down_with_the_verdicts_code(tmp_path: Path) -> None:
    """Issue 22.15: after a collective-timeout end the summary listed the victims (their
    collectives' timeouts recorded as failures, exit code 1) as `failed`, "1 (expected)",
    under "ranks exit with code 124"; they exit with 124 (rule: the verdict's exit code), as a later
    `peerwatch report` showed. One truth: torn down, 124 (expected), until seen."""

    from peerwatch.core.records import EXCEPTION, HANG, HANG_EXIT_CODE, Ack, ExitStatus, Failure, Verdict, encode
    from peerwatch.proc import identity
    from peerwatch.rundir.rundir import EVENTS, VERDICT_FILE, rank_file
    from peerwatch.verdict import report as _report

    me = identity.self_info()
    rd, now = _run_of_this_process(tmp_path, 3)
    rd.write(EVENTS, VERDICT_FILE, encode(Verdict(
        rank=2, cause=HANG, exit_code=HANG_EXIT_CODE, failed_at_ns=now, detected_by=0, detected_at_ns=now, pid=me.pid,
        detail="hung", laggards=(2,))))
    for rank in (0, 1):  # torch's collective timeout, raised before the verdict; then the ack
        rd.write(EVENTS, rank_file("failure", rank), encode(Failure(
            rank=rank, pid=me.pid, time_ns=now, cause=EXCEPTION, exit_code=1, exception="RuntimeError",
            message="[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read timeout", collective=True)))
        rd.write(EVENTS, rank_file("ack", rank), encode(Ack(rank=rank, pid=me.pid, time_ns=now, deadline_ns=0)))
    ranks = by_rank(_report.build(rd))
    for rank in (0, 1):
        assert (ranks[rank]["state"], ranks[rank]["exit_code"], ranks[rank]["exit_observed"]) == (
            "torn_down", HANG_EXIT_CODE, False), ranks[rank]
    summary = _report.summary(_report.build(rd))
    assert "ranks exit with code 124" in summary and "1 (expected)" not in summary, summary
    # Once seen, the code is the one seen.
    rd.write(EVENTS, rank_file("exit", 1), encode(ExitStatus(rank=1, pid=me.pid, time_ns=now, returncode=124,
                                                             observed_by=0)))
    assert (by_rank(_report.build(rd))[1]["exit_code"], by_rank(_report.build(rd))[1]["exit_observed"]) == (124, True)


def test_an_exit_is_observed_by_the_records_field_not_by_its_message(tmp_path: Path) -> None:
    """Issue 25.3: whether a failure's exit code was seen is the record's ``observed``
    field; a record that only repeats the exit watch's words was not seen."""

    from peerwatch.core.records import EXIT, Failure, encode
    from peerwatch.proc import identity
    from peerwatch.rundir import exitwatch
    from peerwatch.rundir.rundir import EVENTS, rank_file
    from peerwatch.verdict import report as _report

    me = identity.self_info()
    rd, now = _run_of_this_process(tmp_path, 2)
    said = Failure(rank=1, pid=me.pid, time_ns=now, cause=EXIT, exit_code=3, message=exitwatch.EXIT_MESSAGE)
    rd.write(EVENTS, rank_file("failure", 1), encode(said))
    assert (by_rank(_report.build(rd))[1]["exit_code"], by_rank(_report.build(rd))[1]["exit_observed"]) == (3, False)
    head, mid, tail = exitwatch.failure_template(1, me.pid)
    rd.write(EVENTS, rank_file("failure", 1), head + str(now).encode() + mid + b"3" + tail, replace=True)
    assert (by_rank(_report.build(rd))[1]["exit_code"], by_rank(_report.build(rd))[1]["exit_observed"]) == (3, True)


def test_a_rank_whose_keyboardinterrupt_came_after_the_verdict_still_shows_the_signal(tmp_path: Path) -> None:
    """Ctrl-C under load: rank 0 raised its KeyboardInterrupt at once; ranks 1 and 2 were noted
    by their watchers as having got the SIGINT, and the job was judged interrupted before their
    main threads raised theirs (a consequence then, not recorded as a failure). Their entries
    said signal None (CI: {'SIGINT', None}); their watchers' notes say SIGINT, and who sent it."""
    from peerwatch.core.records import EXCEPTION, INTERRUPTED, ExitStatus, Failure, Interrupt, Verdict, encode
    from peerwatch.proc import identity
    from peerwatch.rundir.rundir import EVENTS, VERDICT_FILE, rank_file
    from peerwatch.verdict import report as _report

    me, sender = identity.self_info(), 4242
    rd, now = _run_of_this_process(tmp_path, 3)
    rd.write(EVENTS, VERDICT_FILE, encode(Verdict(
        rank=0, cause=INTERRUPTED, exit_code=130, failed_at_ns=now, detected_by=0, detected_at_ns=now, pid=me.pid,
        signal="SIGINT", signalled_by=sender, detail="SIGINT from outside the job, pid 4242; all 3 ranks got it")))
    rd.write(EVENTS, rank_file("failure", 0), encode(Failure(
        rank=0, pid=me.pid, time_ns=now, cause=EXCEPTION, exit_code=130, exception="KeyboardInterrupt",
        signal="SIGINT", signalled_by=sender)))
    for rank in (1, 2):
        rd.write(EVENTS, rank_file("interrupt", rank), encode(Interrupt(
            rank=rank, pid=me.pid, time_ns=now, signal="SIGINT", signalled_by=sender)))
    for rank in range(3):
        rd.write(EVENTS, rank_file("exit", rank), encode(ExitStatus(rank=rank, pid=me.pid, time_ns=now, returncode=130,
                                                                    observed_by=rank)))
    report = json.loads(json.dumps(_report.build(rd)))
    _validate(report)
    assert {r: (e["state"], e["exit_code"], e["signal"], e["signalled_by"]) for r, e in by_rank(report).items()} == {
        r: ("interrupted", 130, "SIGINT", sender) for r in range(3)}, report["ranks"]


def _run_of_this_process(tmp_path: Path, ranks: int):
    """A run directory whose ``ranks`` ranks are all this process (rank 0 prepared it); and when."""
    import time

    from peerwatch.core.records import Registration, encode
    from peerwatch.proc import identity
    from peerwatch.proc.identity import Started
    from peerwatch.rundir.prepare import prepare
    from peerwatch.rundir.rundir import RANKS, RunDir, rank_file

    me, now = identity.self_info(), time.time_ns()
    rd = RunDir(str(tmp_path / "run"))
    regs = [Registration(rank=r, pid=me.pid, ppid=me.ppid, start_ticks=me.start_ticks, uid=me.uid,
                         host=identity.hostname(), boot_id=identity.boot_id(), pidns=identity.pid_namespace(),
                         time_ns=now) for r in range(ranks)]
    prepare(rd, regs[0], Started(now, None))
    for reg in regs[1:]:
        rd.write(RANKS, rank_file("rank", reg.rank), encode(reg))
    return rd, now


def test_a_run_nobody_was_left_to_judge_is_told_from_its_records(tmp_path: Path) -> None:
    """mp.spawn's main process SIGTERMs the other workers as soon as it sees one end; where
    that comes before their watchers judge, nobody writes a verdict, and `peerwatch report`
    said "no failure recorded (outcome: running)". Once no rank is alive, the report tells
    the verdict from the records by the watchers' own rules (`inferred`): the worker that
    ended without a word, not the one its launcher stopped. Where two ended without a word,
    which went first is not known: no verdict is made up."""
    from peerwatch.core.records import ExitStatus, encode
    from peerwatch.rundir.rundir import EVENTS, rank_file
    from peerwatch.verdict import report as _report

    for ranks in (2, 3):
        rd, now, regs = _ended_run(tmp_path / str(ranks), ranks, launcher=4242)
        rd.write(EVENTS, rank_file("exit", 0), encode(ExitStatus(
            rank=0, pid=regs[0].pid, time_ns=now, returncode=-signal.SIGTERM, observed_by=0, signalled_by=4242)))
        report = json.loads(json.dumps(_report.build(rd)))  # as report.json and `peerwatch report --json` hold it
        _validate(report)
        v = report["verdict"]
        if ranks == 3:
            assert v is None and report["outcome"] == "running", report
            continue
        assert report["outcome"] == "failed" and v is not None, report
        assert (v["rank"], v["cause"], v["inferred"]) == (1, "vanished", True), v
        assert "no watcher was left to judge: told from the ranks' records" in _report.summary(report)


def _ended_run(tmp_path: Path, ranks: int, launcher: int):
    """A run directory of ``ranks`` ranks, children of ``launcher``, that have all ended (their
    registrations name a process that is gone: this pid, with another start time)."""
    import dataclasses

    from peerwatch.core.records import encode
    from peerwatch.rundir.rundir import RANKS, rank_file

    rd, now = _run_of_this_process(tmp_path, ranks)
    regs = []
    for rank, reg in sorted(rd.registrations().items()):
        gone = dataclasses.replace(reg, ppid=launcher, start_ticks=reg.start_ticks + 1)
        rd.write(RANKS, rank_file("rank", rank), encode(gone), replace=True)
        regs.append(gone)
    return rd, now, regs
