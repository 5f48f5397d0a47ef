"""Success needs evidence (issue 14): a rank that exits with a non-zero status, however
Python was told to exit, is a failure with that exit code; its peers are torn down and
the report names it. A success marker means the rank's exit status is 0.

``raise SystemExit(3)`` reaching the top of the program is seen by no Python hook (CPython
handles it after finalizing the interpreter): only the exit-status extension
(``peerwatch._exitstatus``, glibc's on_exit) can tell it from success. On glibc Linux the
extension must be built (``pip install -e .`` builds it): these tests fail, not skip,
when it is missing there.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys

import pytest
from harness import by_rank
from test_exit_codes import CPYTHON_STATUS

from peerwatch.hooks import exit_status
from peerwatch.rundir import exitwatch
from peerwatch.rundir.rundir import EVENTS

pytestmark = pytest.mark.timeout(90)

GRACE_S = 1.0
# Failure -> every process gone; the failing rank is seen by its pidfd and its record.
GONE_S = 0.5 + GRACE_S + 3.0
WORLD = 3
FAILING = 1
GLIBC = sys.platform == "linux" and platform.libc_ver()[0] == "glibc"


def test_the_extension_is_there_on_glibc() -> None:
    if not GLIBC:
        pytest.skip("no glibc: the extension is optional here (a SystemExit at the top reads as success)")
    assert exitwatch.available(), "peerwatch._exitstatus is not built: run `pip install -e .` (./dev setup)"


@pytest.mark.parametrize("status, expected", CPYTHON_STATUS, ids=[repr(s)[:20] for s, _ in CPYTHON_STATUS])
def test_exit_status_matches_the_interpreter(status: object, expected: int) -> None:
    """exit_status(x) is the status a real interpreter exits with after sys.exit(x)."""
    out = subprocess.run([sys.executable, "-c", f"import sys; sys.exit({status!r})"],
                         capture_output=True, timeout=30)
    assert (out.returncode, exit_status(status)) == (expected, expected), out.stderr


def _success_files(job) -> list:
    return sorted(n for n in os.listdir(job.run_dir / EVENTS) if n.startswith("success-"))


@pytest.mark.parametrize("style", ["sibling", "lightning"])
@pytest.mark.parametrize("how, code", [("raise_exit:3", 3), ("builtin_exit:3", 3), ("exit_pow2:100", 255)])
def test_a_non_zero_exit_is_a_failure_however_it_is_asked_for(make_job, style: str, how: str, code: int) -> None:
    """Rank 1 leaves with ``raise SystemExit(3)`` (at the top), ``exit(3)`` (the builtin) or
    ``sys.exit(2**100)`` (exits 255): no success marker for it, its peers are torn down with
    its exit code, and the report names it."""
    if how.startswith("raise_exit") and not GLIBC:
        pytest.skip("a SystemExit at the top is only seen through glibc's on_exit")
    job = make_job(world=WORLD, style=style, grace=GRACE_S, behave=[f"{FAILING}={how}@0.3"]).start()
    job.wait_ready()
    job.wait_gone(within=GONE_S)

    assert f"success-{FAILING:05d}.json" not in _success_files(job), job.logs()
    codes = job.all_returncodes()
    report = job.cli_report()
    entries = by_rank(report)
    # A rank starved of the CPU (a loaded host) that could not acknowledge the verdict within
    # the ack window is ended by its peers' SIGTERM, by design: then its code is 143, and the
    # report says so, seen, with a peer as the sender.
    pids = {e["pid"] for e in entries.values()}
    terminated = {r for r, c in codes.items() if r != FAILING and c == -signal.SIGTERM and not entries[r]["acked_verdict"]
                  and entries[r]["signal"] == "SIGTERM" and entries[r]["exit_observed"] and entries[r]["signalled_by"] in pids}
    assert codes == {r: -signal.SIGTERM if r in terminated else code for r in range(WORLD)}, \
        f"returncodes {codes}\n{job.logs()}"
    v = report["verdict"]
    assert (v["rank"], v["cause"], v["exit_code"]) == (FAILING, "exit", code), f"{v}\n{job.logs()}"
    for rank, entry in entries.items():
        if rank == FAILING:
            assert entry["state"] == "failed", entry
        else:
            assert (entry["state"], entry["exit_code"]) == ("torn_down", 143 if rank in terminated else code), entry


@pytest.mark.parametrize("how", ["raise_exit:0", "builtin_exit:0", "exit:0", "succeed"])
def test_a_clean_exit_still_succeeds(make_job, how: str) -> None:
    """A healthy job ends with every rank succeeded, whichever way a rank asks for status 0
    (with the extension, rank 1's success marker is written from its exit status)."""
    job = make_job(world=WORLD, grace=GRACE_S, behave=["0=succeed@0.2", f"1={how}@0.3", "2=succeed@0.4"]).start()
    pids = job.wait_ready()
    job.wait_gone(within=20.0)
    assert job.all_returncodes() == {r: 0 for r in range(WORLD)}, job.logs()
    assert _success_files(job) == [f"success-{r:05d}.json" for r in range(WORLD)], job.logs()
    assert not (job.run_dir / EVENTS / "verdict.json").exists(), job.logs()
    report = job.cli_report()
    assert report["outcome"] == "succeeded", report
    assert {r["rank"]: r["pid"] for r in report["ranks"]} == pids


@pytest.mark.parametrize("style", ["sibling", "lightning"])
def test_a_sigterm_before_any_verdict_is_recorded_with_its_sender(make_job, style: str) -> None:
    """Rank 2 is SIGTERMed by someone outside the job (here the test; a launcher, a
    scheduler) while nothing has failed: its exit record says SIGTERM and who sent it,
    written by the rank itself as the signal arrived, so the verdict and the report say
    'killed by SIGTERM', exit code 143, seen. Before, only a teardown armed that record: a
    launcher's SIGTERM that came before this rank's watcher had acted left nothing, and
    the report said 'vanished' (or, for a torn-down rank, its expected code)."""
    job = make_job(world=WORLD, style=style, grace=GRACE_S, behave=["0=sleep", "1=sleep", "2=sleep"]).start()
    job.wait_ready()
    job.kill(2, signal.SIGTERM)
    job.wait_gone(within=GONE_S)
    assert job.all_returncodes() == {0: 143, 1: 143, 2: -signal.SIGTERM}, job.logs()
    report = job.report()
    v = report["verdict"]
    assert (v["rank"], v["cause"], v["signal"], v["exit_code"]) == (2, "signal", "SIGTERM", 143), f"{v}\n{job.logs()}"
    entry = by_rank(report)[2]
    assert (entry["exit_code"], entry["exit_observed"], entry["signalled_by"]) == (143, True, os.getpid()), entry


# -- a launcher's SIGTERM, held back while the rank says what happened --------------------

HELD = r"""
import os, sys, time
import peerwatch
from peerwatch.rundir import exitwatch
from peerwatch.verdict import leave
peerwatch.install()
print("held" if exitwatch.hold_sigterm(float(sys.argv[1])) else "not held", flush=True)
sys.stdin.readline()  # the parent's SIGTERM comes before this line does
print("still here", flush=True)
how = sys.argv[2]
if how == "leave":
    leave.flush_and_exit(3)
elif how == "exit":
    sys.exit(0)
time.sleep(60)  # the hold runs out
"""


def _held_rank(tmp_path, hold_s: float, how: str) -> "tuple[subprocess.Popen, dict]":
    env = dict(os.environ, PEERWATCH_DIR=str(tmp_path / "run"), WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    proc = subprocess.Popen([sys.executable, "-c", HELD, str(hold_s), how], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    return proc, env


@pytest.mark.skipif(not GLIBC, reason="the exit-status extension is built on glibc Linux")
@pytest.mark.parametrize("how", ["leave", "exit", "hold runs out"])
def test_a_held_sigterm_ends_the_rank_by_sigterm_once_it_is_done_or_the_hold_runs_out(tmp_path, how: str) -> None:
    """Under torchrun the agent's SIGTERM comes about 0.1 s after it reaped the failed
    worker: a rank acting on the verdict holds it back (and so prints the summary first),
    then ends by it, as it would have at once, with the record saying who sent it."""
    # The hold must outlast the test's reading "held", its SIGTERM and "go", and the rank's
    # answer: seconds, not a fraction of one, on a loaded machine.
    proc, _ = _held_rank(tmp_path, 5.0 if how != "hold runs out" else 3.0, how)
    try:
        assert proc.stdout.readline().strip() == "held"
        proc.send_signal(signal.SIGTERM)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "still here"  # the SIGTERM was held
        assert proc.wait(timeout=20) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    record = json.loads((tmp_path / "run" / EVENTS / "exit-00000.json").read_text())
    assert (record["returncode"], record["signalled_by"]) == (-signal.SIGTERM, os.getpid()), record


@pytest.mark.skipif(not GLIBC, reason="the exit-status extension is built on glibc Linux")
def test_without_a_hold_a_sigterm_ends_the_rank_at_once(tmp_path) -> None:
    proc, _ = _held_rank(tmp_path, 0.0, "leave")
    try:
        assert proc.stdout.readline().strip() == "held"  # for no time at all
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == -signal.SIGTERM
        assert proc.stdout.read() == ""  # it never got to "still here"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# The exit record prepared again, over and over, in another thread (the watcher arming the
# teardown's record at a verdict), while the SIGTERM's handler runs in the main thread.
REARMED = """
import os, signal, threading, time
import peerwatch
from peerwatch.rundir import exitwatch
from peerwatch.rundir.rundir import rank_file
peerwatch.install()
native = exitwatch._module()
args = (rank_file("exit", 0).encode(), *exitwatch.exit_template(0, os.getpid()))
def arm():
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])  # the handler runs in the main thread
    for _ in range(1000):  # the main thread asleep by now
        native.arm_leaving(*args, False)
    print("ready", flush=True)
    while True:
        native.arm_leaving(*args, False)
threading.Thread(target=arm, daemon=True).start()
time.sleep(60)  # the GIL free for the arming thread; the SIGTERM comes here
"""


@pytest.mark.skipif(not GLIBC, reason="the exit-status extension is built on glibc Linux")
def test_a_sigterm_while_another_thread_arms_the_exit_record_still_writes_it_whole(tmp_path) -> None:
    """A launcher's SIGTERM at the verdict, as the watcher thread arms the teardown's exit
    record: the record was copied again over the one the handler was writing (an exit
    record of 132 NULs, seen after a SIGTERM to a job's group; or none, the handler finding
    it half prepared), and the handler, installed again, could catch the very SIGTERM it
    raised to end the process. Six tries: each failed before, six times in ten."""
    wrong = []
    for i in range(6):
        run = tmp_path / f"run{i}"
        env = dict(os.environ, PEERWATCH_DIR=str(run), WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
        proc = subprocess.Popen([sys.executable, "-c", REARMED], env=env, stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                wrong.append((i, "it did not end by its SIGTERM"))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        path = run / EVENTS / "exit-00000.json"
        data = path.read_bytes() if path.exists() else b"no record"
        if not data.startswith(b"{") or proc.returncode != -signal.SIGTERM:
            wrong.append((i, proc.returncode, data[:40]))
        else:
            record = json.loads(data)
            assert (record["returncode"], record["signalled_by"]) == (-signal.SIGTERM, os.getpid()), record
    assert not wrong, wrong
