"""The verdict's executor (peerwatch.executor) run for real on a real run directory, with
fake peers: real ``sleep`` processes this test starts and registers as ranks, each holding
its rank's stack file as a rank does (issue 25.6).

The rank that carries out the plan is a subprocess (tests/verdict_program.py): its last
step, :data:`Step.EXIT`, ends the process, and the faulthandler timers it arms would end
pytest. The test writes what the watcher that detected the failure would have (the dead
rank's exit status, the verdict), starts the rank, and checks from outside what each step
leaves: the run directory's records, the report, the event log, and how each fake peer
ended (its exit status, read by this test, its parent).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional

import pytest

from peerwatch.core.records import SIGNAL, Ack, ExitStatus, Heartbeat, NotSignalled, Registration, Verdict, encode
from peerwatch.proc import identity
from peerwatch.proc.identity import Started
from peerwatch.rundir import eventlog, prepare
from peerwatch.rundir.rundir import (
    EVENTS,
    HEARTBEATS,
    RANKS,
    REPORT_FILE,
    SUMMARY_FILE,
    VERDICT_FILE,
    RunDir,
    rank_file,
)
from peerwatch.verdict.notify import CLAIMS

PROGRAM = str(Path(__file__).with_name("verdict_program.py"))
DEADLINE_S = 8.0
GRACE_S = 0.5
FAILED = 1  # the rank that died (SIGKILL) in every scenario


def _reg(rank: int, pid: int, start_ticks_off: int = 0) -> Registration:
    info = identity.probe(pid)
    assert info is not None
    return Registration(
        rank=rank, pid=pid, ppid=info.ppid, start_ticks=info.start_ticks + start_ticks_off, uid=info.uid,
        host=identity.hostname(), boot_id=identity.boot_id(), pidns=identity.pid_namespace(),
        time_ns=time.time_ns(), world_size=8,
    )


def _until(done: Callable[[], bool], what: str, deadline_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + deadline_s
    while not done():
        assert time.monotonic() < deadline, f"not within {deadline_s}s: {what}"
        time.sleep(0.01)


class Job:
    """A run directory whose rank 1 was SIGKILLed, with the records the watcher that saw it
    would have written (its exit status, the verdict), and fake peers to add."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.procs: List[subprocess.Popen] = []
        self.dead = self._spawn(["sleep", "60"])
        self.rd = RunDir(str(tmp_path / "run"))
        prepare.prepare(self.rd, _reg(FAILED, self.dead.pid), Started(time.time_ns(), None))  # rank 1 made the directory
        self.dead.send_signal(signal.SIGKILL)  # our own child
        assert self.dead.wait(DEADLINE_S) == -9
        now = time.time_ns()
        status = ExitStatus(rank=FAILED, pid=self.dead.pid, time_ns=now, returncode=-9, observed_by=FAILED + 1)
        assert self.rd.write(EVENTS, rank_file("exit", FAILED), encode(status))
        self.verdict = Verdict(
            rank=FAILED, cause=SIGNAL, exit_code=137, failed_at_ns=now, detected_by=FAILED + 1, detected_at_ns=now,
            pid=self.dead.pid, host=identity.hostname(), returncode=-9, signal="SIGKILL", detail="killed by SIGKILL",
        )
        assert self.rd.write(EVENTS, VERDICT_FILE, encode(self.verdict))
        self.rank: Optional[subprocess.Popen] = None

    def _spawn(self, argv: List[str], fds: tuple = ()) -> subprocess.Popen:
        proc = subprocess.Popen(argv, pass_fds=fds)
        self.procs.append(proc)
        return proc

    def peer(self, rank: int, ignore_term: bool = False, holds_stack: bool = True, start_ticks_off: int = 0,
             ) -> subprocess.Popen:
        """A fake peer: ``sleep`` registered as ``rank``, holding its stack file open (or not)."""
        fds: tuple = ()
        if holds_stack:
            fds = (os.open(self.rd.stack_at(rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),)
        try:
            # A SIGTERM ignored before the exec stays ignored in sleep.
            proc = self._spawn(["sh", "-c", "trap '' TERM; exec sleep 60" if ignore_term else "exec sleep 60"], fds)
        finally:
            for fd in fds:
                os.close(fd)
        _until(lambda: _comm(proc.pid) == "sleep", f"rank {rank}'s sleep started")
        reg = _reg(rank, proc.pid, start_ticks_off)
        assert self.rd.write(RANKS, rank_file("rank", rank), encode(reg))
        return proc

    def start(self, rank: int, wrote: bool = True, child: bool = False, **options: object) -> subprocess.Popen:
        """Start the rank that carries out the verdict."""
        opts = {"grace": GRACE_S, "ack_window": 1.0, **options}
        argv = [sys.executable, PROGRAM, self.rd.path, str(rank), json.dumps(opts)]
        argv += ["--wrote"] if wrote else []
        argv += ["--child"] if child else []
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        self.rank = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(self.rank)
        return self.rank

    def finish(self) -> tuple:
        """Wait for the rank to exit: (its exit code, its steps, what it logged)."""
        assert self.rank is not None
        out, err = self.rank.communicate(timeout=DEADLINE_S)
        steps = json.loads(out.splitlines()[0]) if out.strip() else []
        return self.rank.returncode, steps, err

    def report(self) -> Dict:
        with open(self.rd.join(REPORT_FILE)) as f:
            report: Dict = json.load(f)
        return report

    def events(self) -> List[Dict]:
        return eventlog.read_run(self.rd.path)

    def signals_to(self, pid: int) -> List[str]:
        return [e["signal"] for e in self.events() if e["event"] == "signal" and e.get("pid") == pid]

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=DEADLINE_S)


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _exit_status(pid: int) -> Optional[int]:
    """How an orphan that this test (their subreaper) inherited ended: -N for signal N."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return None  # not ours to reap (no subreaper here)
        if got == pid:
            return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        time.sleep(0.01)
    return None


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    j = Job(tmp_path)
    yield j
    j.close()


def _entry(report: Dict, rank: int) -> Dict:
    return next(r for r in report["ranks"] if r["rank"] == rank)


# -- an enforcer after a peer died ---------------------------------------------------------


def test_an_enforcer_records_reports_and_ends_only_its_verified_peers(job: Job) -> None:
    """Rank 0, the first enforcer and the writer of the verdict, after rank 1 was SIGKILLed:
    the summary and its acknowledgement, its last heartbeat, its stacks; the live peers that
    gave no acknowledgement SIGTERMed (SIGKILLed after the grace where SIGTERM is ignored);
    a process that is not a verified peer never signalled; the report rewritten after the
    teardown; its own exit recorded; and it exits with the verdict's code."""
    plain = job.peer(2)
    stubborn = job.peer(3, ignore_term=True)
    not_it = job.peer(4, start_ticks_off=1)  # its registration names another process that had the pid
    exec_d = job.peer(5, holds_stack=False)  # it exec'd another program: its stack file is not held
    rank = job.start(0)
    code, steps, err = job.finish()
    assert code == 137, err
    assert steps[:3] == ["ARM_EXIT_WATCH", "WRITE_SUMMARY", "ACK"] and "TEAR_DOWN_PEERS" in steps, steps

    # The peers: ended by the teardown, in the order SIGTERM then SIGKILL; the others untouched.
    assert plain.wait(DEADLINE_S) == -signal.SIGTERM
    assert stubborn.wait(DEADLINE_S) == -signal.SIGKILL
    assert job.signals_to(stubborn.pid)[-2:] == ["SIGTERM", "SIGKILL"]
    assert not_it.poll() is None and exec_d.poll() is None
    assert job.signals_to(not_it.pid) == [] and job.signals_to(exec_d.pid) == []
    unsignalled = job.rd.read(EVENTS, rank_file("unsignalled", 5), NotSignalled)
    assert unsignalled is not None and unsignalled.pid == exec_d.pid and unsignalled.observed_by == 0

    # The run directory: the verdict untouched, this rank's ack, heartbeat, stacks, exit.
    assert job.rd.read(EVENTS, VERDICT_FILE, Verdict) == job.verdict
    ack = job.rd.read(EVENTS, rank_file("ack", 0), Ack)
    assert ack is not None and ack.pid == rank.pid
    beat = job.rd.read(HEARTBEATS, rank_file("rank", 0), Heartbeat)
    assert beat is not None and beat.pid == rank.pid
    with open(job.rd.stack_at(0)) as f:
        assert "most recent call first" in f.read()  # faulthandler's dump of its threads
    own_exit = job.rd.read(EVENTS, rank_file("exit", 0), ExitStatus)
    assert own_exit is not None and (own_exit.pid, own_exit.returncode) == (rank.pid, 137)

    # The summary was printed and marked out; then the report was rewritten after the teardown.
    assert job.rd.exists(CLAIMS, SUMMARY_FILE)
    assert "failed first: killed by SIGKILL\n  cause: signal" in err  # the summary, on its stderr
    report = job.report()
    assert report["outcome"] == "failed"
    v = report["verdict"]
    assert (v["rank"], v["signal"], v["exit_code"]) == (FAILED, "SIGKILL", 137)
    failed = _entry(report, FAILED)
    assert (failed["state"], failed["signal"], failed["exit_code"]) == ("failed", "SIGKILL", 137)
    assert failed["exit_observed"]  # from the exit status its parent wrote, not the verdict's code
    assert _entry(report, 0)["acked_verdict"]  # written after the ack: the summary's report was not
    assert _entry(report, 5)["state"] == "not_signalled"


# -- the acknowledgement window --------------------------------------------------------------


def test_a_peer_that_acks_within_the_window_is_not_signalled_and_one_that_does_not_is(job: Job) -> None:
    """Rank 2 acknowledges within the window (once rank 0 has: that is when the peers see
    the verdict), rank 3 never does: rank 3 alone is SIGTERMed, once the window is over."""
    acking = job.peer(2)
    silent = job.peer(3)
    rank = job.start(0, ack_window=2.0)
    _until(lambda: job.rd.read(EVENTS, rank_file("ack", 0), Ack) is not None, "rank 0's ack")
    ack = Ack(rank=2, pid=acking.pid, time_ns=time.time_ns(), deadline_ns=time.monotonic_ns() + 10**9)
    assert job.rd.write(EVENTS, rank_file("ack", 2), encode(ack))
    code, steps, err = job.finish()
    assert code == 137, err
    assert silent.wait(DEADLINE_S) == -signal.SIGTERM
    assert acking.poll() is None and job.signals_to(acking.pid) == []
    own = job.rd.read(EVENTS, rank_file("ack", 0), Ack)
    assert own is not None and own.pid == rank.pid
    term = [e for e in job.events() if e["event"] == "signal" and e.get("pid") == silent.pid]
    assert [e["signal"] for e in term][-1:] == ["SIGTERM"]
    # Signalled once the 2 s window was over, not at once (its clock: time_ns, as the ack's).
    assert term[-1]["ts"] - own.time_ns > 1.5e9, (term[-1]["ts"] - own.time_ns) / 1e9


# -- a rank's own children and the hook -----------------------------------------------------


def test_the_rank_ends_its_own_children_and_runs_the_hook(job: Job, tmp_path: Path) -> None:
    """TEAR_DOWN_CHILDREN ends the rank's own child (a DataLoader worker's stand-in);
    START_HOOK and FINISH_HOOK run on_verdict with the verdict in its environment, and the
    rank waits for it before it leaves."""
    hooked = tmp_path / "hooked"
    hook = f'echo "$PEERWATCH_FAILED_RANK $PEERWATCH_CAUSE $PEERWATCH_EXIT_CODE" > {hooked}'
    job.start(0, child=True, on_verdict=hook)
    code, steps, err = job.finish()
    assert code == 137, err
    assert {"START_HOOK", "FINISH_HOOK", "TEAR_DOWN_CHILDREN"} <= set(steps), steps
    child = int((tmp_path / "child.pid").read_text())
    assert "SIGTERM" in job.signals_to(child)
    assert _exit_status(child) in (-signal.SIGTERM, None)  # ours to read where we are its subreaper
    assert hooked.read_text().split() == ["1", "signal", "137"]


# -- a rank that does not enforce ---------------------------------------------------------


def test_a_rank_that_is_not_an_enforcer_acks_and_leaves_its_peers_alone(job: Job) -> None:
    """Rank 5 with three live peers below it: it acknowledges, signals nobody, writes no
    report (it did not write the verdict), and exits with the verdict's code."""
    peers = [job.peer(r) for r in (0, 2, 3)]
    rank = job.start(5, wrote=False)
    code, steps, err = job.finish()
    assert code == 137, err
    assert "TEAR_DOWN_PEERS" not in steps and "STOP_WATCHING_FOLDERS" in steps
    ack = job.rd.read(EVENTS, rank_file("ack", 5), Ack)
    assert ack is not None and ack.pid == rank.pid
    assert all(p.poll() is None for p in peers)
    assert all(job.signals_to(p.pid) == [] for p in peers)
    assert not os.path.exists(job.rd.join(REPORT_FILE))
    # Its one line, said after the summary it waited for (in vain: nobody here printed it).
    assert "stops with exit code 137: rank 1 (pid" in err


# -- the records of the run's last moments ------------------------------------------------


def test_the_first_enforcer_logs_the_records_no_one_logged_before_it_leaves(job: Job) -> None:
    """Rank 0 alone (rank 1 dead, no peer to tear down, so no sweep after signals): the
    verdict, rank 1's registration and the exit status its parent wrote reach the event
    log, by rank 0's last sweep."""
    job.start(0)
    code, steps, err = job.finish()
    assert code == 137, err
    assert "SWEEP_RECORDS" in steps, steps
    logged = {(e["event"], e.get("rank")) for e in job.events()}
    assert {("register", FAILED), ("verdict", FAILED), ("exit", FAILED)} <= logged, logged
