"""Carrying out the verdict: the steps :func:`peerwatch.verdict.plan.plan` orders (rule: the step order),
one call each, in the watcher thread.

Nothing is decided here: which steps, in which order, and with which values (the ack window,
the last resort, the exit code) is the plan's answer, pure and unit-tested; a step only reads
what an earlier one left (the acknowledgement's result, the hook it started). The plan is made
in two parts: the steps after the acknowledgement are planned again with its result (an
enforcer that could not write its own is blind; rule: the blind enforcer).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Any, Callable, Dict, Optional

from . import launchers
from .core import terminal
from .core.errors import PeerFailure
from .core.records import INTERRUPTED, Ack, Failure, Registration, Verdict
from .hangs.frdump import FlightRecorderDump
from .hangs.heartbeat import HeartbeatWriter
from .hosts.bridge import Bridge
from .observer import Observer
from .proc import teardown
from .rundir import exitwatch
from .rundir.eventlog import log as log_event
from .rundir.eventlog import sweep as sweep_events
from .rundir.rundir import REPORT_FILE, SUMMARY_FILE, RunDir, rank_file
from .rundir.stacks import StackFile
from .verdict import enforce, leave
from .verdict import plan as _plan
from .verdict import report as _report
from .verdict.notify import CLAIMS, Hook, start_hook
from .verdict.plan import Step

logger = logging.getLogger("peerwatch")


@dataclasses.dataclass
class Teardown:
    """What the steps act with (the watcher's collaborators, passed in: this module does not
    import the watcher), and what a step leaves for the later ones. Owned by the watcher thread."""

    on_verdict: Any  # the hook (a shell command or a callable), or None
    on_verdict_timeout_s: float  # its bound
    run_dir: RunDir
    me: Registration
    observer: Observer
    stacks: StackFile
    flight_recorder: FlightRecorderDump
    bridge: Optional[Bridge]
    main_left: threading.Event  # set by the training thread as it leaves (Watcher.leave)
    interrupt_installed: bool  # our signal handler raises PeerFailure in the main thread
    heartbeat: HeartbeatWriter
    verdict: Verdict
    situation: _plan.Situation
    plan: _plan.Plan
    acted: float = 0.0  # time.monotonic() when the steps began
    ack_written: bool = True  # left by Step.ACK
    hook: Optional[Hook] = None  # left by Step.START_HOOK

    @property
    def rank(self) -> int:
        return self.me.rank

    @property
    def leave_by(self) -> float:
        """When the main thread must have left (rule: who stays), as ``time.monotonic()``."""
        return self.acted + self.plan.stay_s


def carry_out(t: Teardown) -> None:
    """Carry out ``t.plan``'s steps; the last one, :data:`Step.EXIT`, never returns."""
    t.acted = time.monotonic()
    for step in t.plan.until_ack:
        _STEPS[step](t)
    # The acknowledgement's result is an input of the rest of the plan (rule: the blind enforcer).
    t.plan = _plan.plan(dataclasses.replace(t.situation, ack_written=t.ack_written))
    for step in t.plan.after_ack:
        _STEPS[step](t)


def failed_rank_speaks(observer: Observer, self_rank: int, verdict: Verdict) -> bool:
    """The failed rank (another one) recorded its own failure and is alive on this host:
    it prints the summary below its own traceback (rule: who reports)."""
    own = observer.events.get(rank_file("failure", verdict.rank))
    reg = observer.registrations.get(verdict.rank)
    return (
        verdict.rank != self_rank and isinstance(own, Failure) and reg is not None and own.pid == reg.pid
        and verdict.rank in observer.live_local_ranks()
    )


# -- the steps, in the order the plan usually gives them -----------------------------------
# A step that is one call is a line of the table at the end of this part; the others are
# functions.


def _hold_sigterm(t: Teardown) -> None:
    # Under torchrun and mp.spawn the launcher's SIGTERM comes about 0.1 s after it saw
    # the failed worker end: noted, and this rank ends by it once it said what happened.
    if exitwatch.hold_sigterm(_plan.HOLD_SIGTERM_S):
        log_event("sigterm_held", t.rank, seconds=_plan.HOLD_SIGTERM_S)


def _acknowledge(t: Teardown) -> None:
    ack = Ack(rank=t.rank, pid=os.getpid(), time_ns=time.time_ns(), deadline_ns=int(t.leave_by * 1e9))
    t.ack_written = t.observer.write_event(rank_file("ack", t.rank), ack)


def _say_blind(t: Teardown) -> None:
    logger.error(
        "peerwatch: rank %d could not write its acknowledgement to %s: it waits up to %gs for its peers "
        "to leave by themselves before it signals any (never the other enforcers, ranks %s)",
        t.rank, t.run_dir.path, t.plan.ack_window_s, ", ".join(map(str, t.plan.trusted)) or "none",
    )


def _tell_hosts(t: Teardown) -> None:
    assert t.bridge is not None  # the plan tells other hosts only where there is a bridge
    t.bridge.on_verdict(t.verdict)  # at most ~1 s, 2 s taking over


def _start_hook(t: Teardown) -> None:
    """Someone is told, once per host, for at most on_verdict_timeout (not grace), which
    this rank then waits for."""
    t.hook = start_hook(t.on_verdict, t.run_dir, t.verdict, t.rank, t.on_verdict_timeout_s)
    if t.hook is not None:
        t.stacks.arm_last_resort(t.plan.last_resort_s + t.on_verdict_timeout_s)  # the rank waits for it


def _tear_down_children(t: Teardown) -> None:
    # The hook's command is spared: its own bound (Hook.finish) ends it.
    spare = {t.hook.pid} if t.hook is not None and t.hook.pid is not None else set()
    enforce.tear_down_own_children(t.rank, t.observer.local_pids(), t.situation.grace_s, spare)


def _wait_main(t: Teardown) -> None:
    # The main thread is leaving by itself (PeerFailure, or its own exception); at exit it
    # sets `main_left` and waits for us. If it is stuck, we end it.
    if not t.main_left.wait(max(0.0, t.leave_by - time.monotonic())):
        logger.error("peerwatch: %s did not leave within %gs of the verdict; exiting with code %d",
                     terminal.who(t.rank, t.me.pid, t.me.host), t.situation.grace_s, t.plan.exit_code)


def _say_stop_line(t: Teardown) -> None:
    """The one line this rank says when a peer failed, below the summary (rule: who reports).
    Waits for the summary at most SUMMARY_WAIT_S from the verdict; past it, says its
    line all the same (the rank that was to print the summary may never get to)."""
    deadline = t.acted + _plan.SUMMARY_WAIT_S
    pause = _plan.SUMMARY_FIRST_LOOK_S  # the summary is usually out within a few ms: look soon, then less often
    while not t.run_dir.exists(CLAIMS, SUMMARY_FILE):
        left = deadline - time.monotonic()
        if left <= 0:
            logger.debug("peerwatch: rank %d: no summary within %gs of the verdict", t.rank, _plan.SUMMARY_WAIT_S)
            break
        time.sleep(min(pause, left))  # only here, during a teardown
        pause = min(2 * pause, t.plan.summary_poll_s)
    v = t.verdict
    logger.error("%s", terminal.stop_line(
        terminal.who(v.rank, v.pid, v.host), v.detail or v.cause, terminal.who(t.rank, t.me.pid, t.me.host),
        t.plan.exit_code, interrupted=v.cause == INTERRUPTED,
    ))


def _finish_hook(t: Teardown) -> None:
    if t.hook is not None:
        # This rank stays until its hook ends or its bound passes (a launcher may end what
        # is left of the job once its ranks are gone); a main thread that is not leaving by
        # itself is held off Python meanwhile.
        t.hook.finish(hold_gil=not t.plan.stay)


# Each step bound to its code (the one place that does it; what a step returns is not used).
# Every call is looked up as the step runs, so what a test patches is what runs.
_STEPS: Dict[Step, Callable[[Teardown], object]] = {
    Step.HOLD_SIGTERM: _hold_sigterm,
    # From now on this rank's end is recorded as it happens (the verdict's code, or a
    # launcher's SIGTERM).
    Step.ARM_EXIT_WATCH: lambda t: exitwatch.arm_leaving(t.rank),
    Step.ACK: _acknowledge,
    Step.SAY_BLIND: _say_blind,
    Step.STOP_WATCHING_FOLDERS: lambda t: t.observer.local.stop_watching_folders(),
    Step.ARM_LAST_RESORT: lambda t: t.stacks.arm_last_resort(t.plan.last_resort_s),
    Step.TELL_HOSTS: _tell_hosts,
    Step.FINAL_HEARTBEAT: lambda t: t.heartbeat.write_last(t.observer.local_pids),  # the step it stopped at, for the report
    Step.TELL_LAUNCHERS: lambda t: launchers.on_verdict(t.verdict),  # Lightning's observer must not SIGKILL us meanwhile
    # Written while the peers are still leaving (their exit codes expected, not yet seen):
    # waiting for them would let this rank's own training run on. ``peerwatch report``
    # rebuilds from the records, with the codes as they happened.
    Step.WRITE_REPORT: lambda t: _report_now(t, print_summary=False),
    Step.WRITE_SUMMARY: lambda t: _report_now(t, print_summary=True),
    # The rank's own traceback is out now (a hook up the chain, torch's, holds it back until
    # the main thread has left it): the summary follows it, without repeating it.
    Step.WRITE_SUMMARY_BELOW_TRACEBACK: lambda t: _report_now(t, print_summary=True, traceback=False),
    Step.START_HOOK: _start_hook,
    Step.DUMP_STACKS: lambda t: t.stacks.dump(),
    Step.DUMP_FLIGHT_RECORDER: lambda t: t.flight_recorder.dump("teardown"),
    Step.INTERRUPT_MAIN: lambda t: teardown.raise_in_main_thread(PeerFailure.bound_to(t.verdict), t.interrupt_installed),
    Step.TEAR_DOWN_PEERS: lambda t: enforce.tear_down_peers(
        t.observer, t.verdict, t.plan.ack_window_s, t.situation.grace_s, set(t.plan.trusted)),
    Step.TEAR_DOWN_CHILDREN: _tear_down_children,
    Step.WAIT_MAIN: _wait_main,
    Step.SAY_STOP_LINE: _say_stop_line,
    # under torchrun: the agent sees the failed worker first
    Step.LET_LAUNCHER_SEE: lambda t: launchers.before_exit(t.me, t.run_dir, t.verdict),
    Step.SWEEP_RECORDS: lambda t: sweep_events(t.run_dir, t.rank),  # the last records of peers that left meanwhile
    Step.FINISH_HOOK: _finish_hook,
    Step.EXIT: lambda t: leave.flush_and_exit(t.plan.exit_code),
}


# -- the report ----------------------------------------------------------------------------


def _report_now(t: Teardown, print_summary: bool, traceback: bool = True) -> None:
    """Write report.json; with ``print_summary``, print the summary and mark it out (the
    other ranks of this host say their lines then; rule: who reports). Never raises."""
    run_dir, rank = t.run_dir, t.rank
    try:
        report = _report.write(run_dir)
        log_event("report", rank, path=run_dir.join(REPORT_FILE), outcome=report["outcome"])
        if print_summary:
            logger.error("%s", _report.summary(report, traceback=traceback, leaving=True))
            _summary_out(run_dir, rank)
    except OSError as e:
        logger.error("peerwatch: rank %d could not write the report: %s", rank, e)
    except Exception:  # noqa: BLE001 - a report must never stop the teardown
        logger.exception("peerwatch: rank %d could not write the report", rank)


def _summary_out(run_dir: RunDir, rank: int) -> None:
    """The summary is out (flushed by the logger's handlers)."""
    try:
        run_dir.claim(CLAIMS, SUMMARY_FILE)
    except OSError as e:
        logger.debug("peerwatch: rank %d could not mark the summary as printed: %s", rank, e)


__all__ = ["Teardown", "carry_out", "failed_rank_speaks"]
