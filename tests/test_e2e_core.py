"""End to end: real jobs of ``rank_program.py`` processes, one rank fails, all must go.

Both launch styles where they differ: ``lightning`` (the test starts rank 0, which starts
the other ranks, so rank 0 is their parent and learns how they end) and ``sibling``
(the test starts every rank; no rank knows how another ended). Every wait has a
deadline; every process is accounted for (the ``no_leaks`` fixture fails a test that
leaves one behind).
"""

from __future__ import annotations

import random
import signal
from typing import Dict

import pytest
from harness import Job, by_rank

pytestmark = pytest.mark.timeout(60)

GRACE_S = 1.0  # PEERWATCH_GRACE of every job here
ACK_S = 0.5  # peerwatch's default ack window: how long a peer has to say it is leaving
# Failure -> every process of the job gone, when every survivor can leave by itself.
# Typically 20-100 ms; the bound leaves room for a loaded 2-core machine, and is still
# below what a detection waiting for a timer takes here (grace, a 3 s heartbeat).
FAST_S = 2.5  # 1.7 s seen for three gloo ranks at load 12
# Failure -> every process gone, when a survivor must be SIGKILLed after the grace period.
STUCK_S = ACK_S + GRACE_S + 2.0

STYLES = ["sibling", "lightning"]


def _seconds_since(job: Job, failed_at_ns: int) -> float:
    assert job.gone_at_ns is not None
    return (job.gone_at_ns - failed_at_ns) / 1e9


def _assert_torn_down(report: dict, failed: int, code: int) -> None:
    """Every rank but ``failed`` was torn down with ``code`` and acknowledged the verdict."""
    ranks = by_rank(report)
    assert ranks[failed]["state"] == "failed", ranks[failed]
    for rank, entry in ranks.items():
        if rank != failed:
            assert entry["state"] == "torn_down", entry
            assert entry["exit_code"] == code, entry
            assert entry["acked_verdict"], entry


def _assert_exit_codes(job: Job, expected: Dict[int, int]) -> None:
    """Returncodes (-N for signal N) of every rank; shows the logs when they differ."""
    got = job.all_returncodes()
    assert got == expected, f"returncodes {got}, expected {expected}\n{job.logs()}"


# -- a rank is SIGKILLed -----------------------------------------------------------------


@pytest.mark.parametrize("victim", [0, 2, 3], ids=["first", "middle", "last"])
@pytest.mark.parametrize("style", STYLES)
def test_sigkill_of_a_rank_tears_down_the_job(make_job, style: str, victim: int) -> None:
    job = make_job(world=4, style=style).start()
    job.wait_ready()
    killed_at = job.kill(victim)
    job.wait_gone(within=STUCK_S)
    took = job.gone_at - killed_at  # type: ignore[operator]

    report = job.report()
    v = report["verdict"]
    assert report["outcome"] == "failed"
    assert v["rank"] == victim and v["pid"] == job.pids[victim]
    assert v["detected_by"] != victim
    if style == "lightning" and victim != 0:
        # Rank 0 is the killed rank's parent: it reads the signal from the exit status.
        assert (v["cause"], v["signal"], v["exit_code"], v["returncode"]) == ("signal", "SIGKILL", 137, -9)
        code = 137
    else:
        # Nobody watching can know how it ended (the test is its parent).
        assert (v["cause"], v["signal"]) == ("vanished", None)
        code = v["exit_code"]
        assert code == 1
    _assert_torn_down(report, victim, code)
    _assert_exit_codes(job, {r: (-9 if r == victim else code) for r in range(4)})
    # Killing Lightning's rank 0 orphans ranks 1-3: they must go just as fast.
    assert took < FAST_S, f"the job took {took:.2f}s to go after the kill"


def test_kill_right_after_start_is_seen_at_once(make_job) -> None:
    """A rank that dies just after every rank's install() returned is seen at once.

    Rank 1 starts (and registers) after rank 0; nothing is written to the run directory
    after that. A heartbeat of 3 s makes a detection that waits for a timer obvious.
    """
    job = make_job(world=2, env={"PEERWATCH_HEARTBEAT": "3"})
    job.start([0])
    job.wait_ready([0])
    job.start([1])
    job.wait_ready()
    killed_at = job.kill(0)
    job.wait_gone(within=6.0)
    took = job.gone_at - killed_at  # type: ignore[operator]
    _assert_exit_codes(job, {0: -9, 1: 1})
    assert took < FAST_S, f"rank 1 took {took:.2f}s to notice that rank 0 was killed"


# -- a rank fails in Python ---------------------------------------------------------------


@pytest.mark.parametrize("style, failing", [("sibling", 1), ("lightning", 0), ("lightning", 2)])
def test_uncaught_exception(make_job, style: str, failing: int) -> None:
    job = make_job(world=3, style=style, behave=[f"{failing}=raise@0.3"]).start()
    job.wait_ready()
    job.wait_gone(within=STUCK_S)

    report = job.report()
    v = report["verdict"]
    assert (v["rank"], v["cause"], v["exit_code"]) == (failing, "exception", 1)
    assert v["exception"] == "RuntimeError"
    assert v["message"] == f"rank {failing} failed on purpose"
    assert v["traceback"].startswith("Traceback (most recent call last):")
    assert "in behave" in v["traceback"]
    assert v["traceback"].rstrip().endswith(f"RuntimeError: rank {failing} failed on purpose")
    _assert_torn_down(report, failing, 1)
    _assert_exit_codes(job, {r: 1 for r in range(3)})
    assert _seconds_since(job, v["failed_at_ns"]) < FAST_S


@pytest.mark.parametrize("api", ["install", "watch"])
@pytest.mark.parametrize("style", STYLES)
def test_sys_exit_code_is_everyones_exit_code(make_job, style: str, api: str) -> None:
    """``sys.exit(3)``: through the sys.exit hook (install) or through watch()'s __exit__."""
    job = make_job(world=3, style=style, api=api, behave=["1=exit:3@0.3"]).start()
    job.wait_ready()
    job.wait_gone(within=STUCK_S)

    report = job.report()
    v = report["verdict"]
    assert (v["rank"], v["cause"], v["exit_code"], v["returncode"]) == (1, "exit", 3, 3)
    assert v["exception"] is None
    _assert_torn_down(report, 1, 3)
    _assert_exit_codes(job, {0: 3, 1: 3, 2: 3})
    assert _seconds_since(job, v["failed_at_ns"]) < FAST_S


@pytest.mark.parametrize("style", STYLES)
def test_os_exit_without_a_record(make_job, style: str) -> None:
    """``os._exit(5)`` writes nothing: only a parent can tell how the rank ended."""
    job = make_job(world=3, style=style, behave=["1=os_exit:5@0.3"]).start()
    job.wait_ready()
    job.wait_gone(within=STUCK_S)

    report = job.report()
    v = report["verdict"]
    assert v["rank"] == 1
    if style == "lightning":
        assert (v["cause"], v["exit_code"], v["returncode"]) == ("exit", 5, 5)
        code = 5
    else:
        assert (v["cause"], v["exit_code"]) == ("vanished", 1)
        code = 1
    _assert_torn_down(report, 1, code)
    _assert_exit_codes(job, {0: code, 1: 5, 2: code})
    assert _seconds_since(job, v["failed_at_ns"]) < FAST_S


# -- nobody fails -------------------------------------------------------------------------


@pytest.mark.parametrize("style", STYLES)
def test_clean_finish_at_staggered_times_never_tears_down(make_job, style: str) -> None:
    """Ranks that end cleanly, one after another over two seconds, are never a failure.

    Three jobs at once (install, watch, both), each with its own order of finishing,
    rank 0 first in one of them and last in another.
    """
    world = 4
    orders = [[0, 2, 1, 3], [3, 1, 2, 0], [1, 0, 3, 2]]
    rng = random.Random(f"{style}-staggered")
    jobs = []
    for order, api in zip(orders, ["install", "watch", "both"]):
        at = sorted(rng.uniform(0.1, 2.0) for _ in range(world))
        behave = [f"{rank}=succeed@{at[i]:.2f}" for i, rank in enumerate(order)]
        jobs.append(make_job(world=world, style=style, api=api, behave=behave).start())
    for job in jobs:
        job.wait_ready()
    for job in jobs:
        job.wait_gone(within=2.0 + STUCK_S)
    for job in jobs:
        _assert_exit_codes(job, {r: 0 for r in range(world)})
        assert not (job.run_dir / "events" / "verdict.json").exists(), job.logs()
        # A clean end writes no report.json (docs/report.md): a rank's success is known
        # only from its exit status, once its Python is gone. The report is built from
        # the records, stragglers and diagnosis included.
        assert not (job.run_dir / "report.json").exists(), job.logs()
        report = job.cli_report()
        assert report["verdict"] is None and report["stragglers"] == [] and report["diagnosis"] is None
        assert report["outcome"] == "succeeded", report
        assert {r["state"] for r in report["ranks"]} == {"succeeded"}


# -- survivors that cannot leave by themselves ----------------------------------------------


@pytest.mark.parametrize("style", STYLES)
def test_survivor_holding_the_gil_and_ignoring_sigterm_is_sigkilled(make_job, style: str) -> None:
    """Rank 1 holds the GIL in C (its watcher cannot run) and ignores SIGTERM: rank 0 ends
    it with SIGKILL once the grace period after SIGTERM is over, not before."""
    job = make_job(world=3, style=style, behave=["1=ignore_term+gil"]).start()
    job.wait_ready()
    job.wait_holding_gil(1)
    killed_at = job.kill(2)
    job.wait_gone(within=STUCK_S + 1.0)

    code = 137 if style == "lightning" else 1
    _assert_exit_codes(job, {0: code, 1: -9, 2: -9})
    stuck_for = job.ranks[1].gone_at - killed_at  # type: ignore[operator]
    assert GRACE_S <= stuck_for < STUCK_S, f"rank 1 was SIGKILLed {stuck_for:.2f}s after the failure"
    report = job.report()
    assert report["verdict"]["rank"] == 2
    assert by_rank(report)[1]["state"] == "torn_down"
    assert not by_rank(report)[1]["acked_verdict"]
    # Its stacks were dumped by faulthandler's C handler, GIL or not.
    stack_file = by_rank(report)[1]["stack_file"]
    assert stack_file is not None
    with open(stack_file) as f:
        assert "in behave" in f.read()


@pytest.mark.parametrize(
    "behaviour, returncode",
    [("gil", -signal.SIGTERM), ("ignore_term", 1)],
    ids=["gil-dies-of-sigterm", "ignore_term-leaves-by-itself"],
)
def test_survivor_that_can_half_help_itself(make_job, behaviour: str, returncode: int) -> None:
    """Holding the GIL without ignoring SIGTERM: SIGTERM (after the ack window) ends it.
    Ignoring SIGTERM with a free GIL: its own watcher ends it at once with the verdict's code."""
    job = make_job(world=3, behave=[f"1={behaviour}"]).start()
    job.wait_ready()
    if behaviour == "gil":
        job.wait_holding_gil(1)
    killed_at = job.kill(2)
    job.wait_gone(within=STUCK_S)
    _assert_exit_codes(job, {0: 1, 1: returncode, 2: -9})
    took = job.gone_at - killed_at  # type: ignore[operator]
    assert took < (ACK_S + FAST_S if behaviour == "gil" else FAST_S)


def test_stuck_survivor_whose_only_peer_is_the_failing_rank(make_job) -> None:
    """World of 2: rank 0 holds the GIL and ignores SIGTERM, rank 1 raises. Only rank 1's
    watcher can end rank 0, so rank 1 must not exit before it did.

    Three jobs at once: which of rank 1's threads wins the race at exit varies.
    """
    jobs = [make_job(world=2, behave=["0=ignore_term+gil", "1=raise@0.3"]).start() for _ in range(3)]
    left_running = []
    try:
        for job in jobs:
            job.wait_ready()
            job.wait_holding_gil(0)
        for i, job in enumerate(jobs):
            try:
                job.wait_gone(within=STUCK_S + 1.0)
            except AssertionError as e:
                left_running.append(f"job {i}: {str(e).splitlines()[0]}")
    finally:
        for job in jobs:
            job.kill_all()  # the survivors this test is about: not leaks of the test
    assert not left_running, "\n".join(left_running)
    for job in jobs:
        _assert_exit_codes(job, {0: -9, 1: 1})


# -- torch.distributed -------------------------------------------------------------------------


@pytest.mark.parametrize("style", STYLES)
def test_survivors_blocked_in_gloo_all_reduce(make_job, style: str) -> None:
    """Ranks 0 and 1 block in a gloo all_reduce that rank 2 never joins; rank 2 is then
    SIGKILLed. They are torn down with rank 2's code: their own collective errors are
    consequences, not the root cause."""
    pytest.importorskip("torch.distributed")
    world, victim = 3, 2
    job = make_job(world=world, style=style, gloo=True, behave=["0=gloo", "1=gloo", f"{victim}=store_wait"]).start()
    job.wait_ready(timeout=40.0)
    job.wait_noted(["collective-0", "collective-1"])
    killed_at = job.kill(victim)
    job.wait_gone(within=STUCK_S)
    took = job.gone_at - killed_at  # type: ignore[operator]

    report = job.report()
    v = report["verdict"]
    assert v["rank"] == victim
    code = 137 if style == "lightning" else 1
    assert (v["cause"], v["exit_code"]) == (("signal", 137) if style == "lightning" else ("vanished", 1))
    _assert_torn_down(report, victim, code)
    _assert_exit_codes(job, {r: (-9 if r == victim else code) for r in range(world)})
    assert took < FAST_S


# -- watch() --------------------------------------------------------------------------------


@pytest.mark.parametrize("style", STYLES)
def test_watch_survivors_get_peer_failure(make_job, style: str) -> None:
    """Inside ``with peerwatch.watch():`` survivors get PeerFailure in their main thread,
    carrying the failing rank, the cause and the exit code, and exit with that code."""
    failing: int
    if style == "lightning":
        failing, cause, code = 1, "signal", 137
        job = make_job(world=3, style=style, api="watch").start()
        job.wait_ready()
        job.kill(failing)
    else:
        failing, cause, code = 0, "exception", 1
        job = make_job(world=3, style=style, api="watch", behave=["0=raise@0.3"]).start()
        job.wait_ready()
    job.wait_gone(within=STUCK_S)

    survivors = [r for r in range(3) if r != failing]
    expected = {"rank": failing, "cause": cause, "exit_code": code}
    assert job.peer_failures() == {r: expected for r in survivors}, job.logs()
    _assert_exit_codes(job, {r: (code if r != failing else (-9 if cause == "signal" else 1)) for r in range(3)})
    report = job.report()
    assert (report["verdict"]["rank"], report["verdict"]["cause"]) == (failing, cause)
    _assert_torn_down(report, failing, code)


def test_a_rank_s_children_are_named_with_the_rank_s_pid(make_job) -> None:
    """Rank 0 has a child; rank 1 is SIGKILLed. Rank 0's teardown of its own child says
    whose descendant it is with that rank's pid, not the child's twice."""
    job = make_job(world=2, behave=["0=children:1"]).start()
    pids = job.wait_ready()
    job.kill(1)
    job.wait_gone(within=STUCK_S)
    log = job.log_path(0).read_text()
    lines = [line for line in log.splitlines() if "a descendant of rank 0" in line and "sent SIGTERM" in line]
    assert len(lines) == 1, log
    assert f"a descendant of rank 0 (pid {pids[0]})" in lines[0], lines[0]
