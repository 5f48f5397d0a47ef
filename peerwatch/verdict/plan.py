"""The teardown policy, as pure functions: who enforces a verdict, whom to signal and when,
how long this rank may stay, the code it exits with, and the order of its steps.

Nothing here touches the OS or a clock; :mod:`peerwatch.executor` carries out a plan's
steps, an enforcer's share through :mod:`peerwatch.verdict.enforce`, with the OS through
:mod:`peerwatch.proc.teardown`. Its rules (the verdict's exit code, who stays, who
enforces, who reports, the ack window, whom to signal, the last resort, leaving at exit,
the blind enforcer, the step order) are those of docs/how-it-works.md, "The teardown's
rules", each cited by name where it is applied.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import AbstractSet, Iterable, Optional, Sequence, Tuple

from ..core.records import EXCEPTION, EXIT, HANG, INTERRUPTED, LOST, MISSING
from .decide import LEAVING_WAIT_NS

# Rule: who enforces. Every rank enforcing made teardown O(N^2) (N=128: 11-14 s of CPU on
# 2 cores); three keep it O(N), with spares for a frozen enforcer.
ENFORCERS = 3
ACK_STRETCH_FRACTION = 4  # rule: the ack window; it stretches to ack_window / 4 after the latest ack
ACK_STRETCH_MAX = 4  # rule: the ack window; ... never beyond 4 x ack_window
LAST_RESORT_GRACES = 3  # rule: the last resort
LAST_RESORT_EXTRA_S = 2.0  # rule: the last resort
SETTLE_S = 0.25  # how long a failing rank waits for its watcher's look at the peers (rule: leaving at exit)
LEAVE_EXTRA_S = 2.0  # rule: leaving at exit
BLIND_GRACES = 2  # rule: the blind enforcer; a blind enforcer's window is ack_window + 2 x grace
# Rule: who reports. How long after the verdict a rank that does not print the summary waits
# for it before it leaves (it waits meanwhile only once its own share of the teardown is
# done).
SUMMARY_WAIT_S = 1.0
# Rule: the step order. A rank whose launcher ends the workers early holds its launcher's
# SIGTERM back for at most this long, so that it says what happened first (torchrun's agent
# sends it about 0.1 s after it reaped the failed worker; it waits 30 s before a SIGKILL).
HOLD_SIGTERM_S = 3.0
SUMMARY_POLL_S = 0.01  # how often a waiting rank looks for the summary, for up to SUMMARY_POLL_RANKS local ranks
# Its first look comes this long after it began to wait, each next one twice as long after
# (up to summary_poll_s): the summary is usually out a few ms after the verdict, and a rank
# that looked only every 10 ms left up to 10 ms after it.
SUMMARY_FIRST_LOOK_S = 0.001
SUMMARY_POLL_RANKS = 8  # more local ranks than this look for it proportionally less often
_LEAVES_BY_ITSELF = (EXCEPTION, EXIT)  # rule: who stays; causes whose rank's main thread is already leaving
# Rule: who reports. Causes whose rank has not ended (stuck, on another host, never there):
# no launcher ends the workers on its account, so the summary waits for this rank's evidence
# (its stacks, the flight recorder's dump) rather than come at the verdict.
_STILL_THERE = (HANG, LOST, MISSING)


@dataclasses.dataclass(frozen=True)
class Situation:
    """What a rank knows when it acts on a verdict."""

    self_rank: int
    failed_rank: int
    cause: str
    verdict_exit_code: int
    own_exit_code: Optional[int]  # the code of this rank's own failure record, if it wrote one
    in_watch: bool  # the main thread runs inside watch()
    live_local_ranks: Tuple[int, ...]  # this host's ranks not gone and not finished (self included)
    wrote_verdict: bool  # this rank's watcher wrote verdict.json (first writer)
    grace_s: float
    ack_window_s: float
    ack_written: bool = True  # this rank's own acknowledgement reached the run directory (rule: the blind enforcer)
    # The failed rank, another one, recorded its own failure and is alive on this host:
    # it prints the summary itself (rule: who reports).
    failed_rank_speaks: bool = False
    # This rank's launcher ends it as soon as it has seen the failed rank, another one
    # (torchrun's agent, mp.spawn's parent: :func:`peerwatch.launchers.ends_workers_early`).
    ends_workers_early: bool = False
    other_hosts: bool = False  # the job spans hosts: this host's bridge tells the others
    on_verdict: bool = False  # an on_verdict hook is configured


class Step(enum.Enum):
    """One step of a rank's teardown (rule: the step order), carried out by :mod:`peerwatch.executor`."""

    HOLD_SIGTERM = "hold the launcher's SIGTERM back until this rank leaves (HOLD_SIGTERM_S at most)"
    ARM_EXIT_WATCH = "from now on this rank's end is recorded as it happens"
    WRITE_SUMMARY = "write the report and print the summary"
    ACK = "write this rank's acknowledgement"
    SAY_BLIND = "say that this enforcer is blind (rule: the blind enforcer)"
    STOP_WATCHING_FOLDERS = "look at the run directory no more"
    ARM_LAST_RESORT = "arm faulthandler's last resort (rule: the last resort)"
    TELL_HOSTS = "tell the other hosts, through the bridge"
    FINAL_HEARTBEAT = "write the step this rank is at, for the report"
    TELL_LAUNCHERS = "quiet Lightning's observer, call the verdict listeners"
    WRITE_REPORT = "write the report"
    START_HOOK = "start the on_verdict hook"
    DUMP_STACKS = "dump this rank's stacks"
    DUMP_FLIGHT_RECORDER = "dump torch's flight recorder"
    INTERRUPT_MAIN = "raise PeerFailure in the main thread"
    TEAR_DOWN_PEERS = "wait for the peers' acknowledgements, signal the rest (an enforcer)"
    TEAR_DOWN_CHILDREN = "end this rank's own children (the hook's spared)"
    WAIT_MAIN = "wait for the main thread to leave by itself"
    WRITE_SUMMARY_BELOW_TRACEBACK = "write the report and print the summary, without the traceback just printed"
    SAY_STOP_LINE = "say this rank's one line, once the summary is out"
    LET_LAUNCHER_SEE = "let the launcher see the failed rank first"
    SWEEP_RECORDS = "log the records not logged yet"
    FINISH_HOOK = "wait for the hook, to its bound"
    EXIT = "flush and exit with the plan's code"


@dataclasses.dataclass(frozen=True)
class Plan:
    exit_code: int
    interrupt_main: bool  # raise PeerFailure in the main thread (it is inside watch())
    stay_s: float  # how long the main thread may take to leave by itself (0: leave now)
    enforcer: bool
    write_report: bool  # now, as the teardown begins (a summary after the main thread left is written then)
    print_summary: bool
    summary_now: bool  # print it at the verdict, before the teardown (rule: who reports; not a failing rank that stays)
    # print it once this rank's stacks and flight recorder are dumped (rule: who reports; a hang)
    summary_after_dumps: bool
    stop_line: bool  # say this rank's one line, once the summary is out (rule: who reports)
    sweep_records: bool  # log the records not logged yet to the event log before leaving (rule: who reports)
    last_resort_s: float  # faulthandler ends the process after this, whatever happens
    ack_window_s: float = 0.0  # how long an enforcer waits for its peers (rules: the ack window, the blind enforcer)
    blind: bool = False  # rule: the blind enforcer; an enforcer that cannot trust a missing ack file
    # peers a blind enforcer never signals: the other enforcers (rule: the blind enforcer)
    trusted: Tuple[int, ...] = ()
    # how often this rank looks for the summary before its line (rule: who reports)
    summary_poll_s: float = SUMMARY_POLL_S
    until_ack: Tuple[Step, ...] = ()  # rule: the step order; the steps up to the acknowledgement, included
    after_ack: Tuple[Step, ...] = ()  # rule: the step order; the rest, as planned with the acknowledgement's result

    @property
    def stay(self) -> bool:
        return self.stay_s > 0


def exit_code(self_rank: int, failed_rank: int, verdict_exit_code: int, own_exit_code: Optional[int]) -> int:
    """Rule: the verdict's exit code. The code this rank exits with once the verdict is known."""
    if failed_rank == self_rank and own_exit_code:
        return own_exit_code
    return verdict_exit_code


def enforcers(live_local_ranks: Sequence[int], failed_rank: int) -> Tuple[int, ...]:
    """Rule: who enforces. The ranks of this host that enforce the verdict, in order."""
    live = sorted(live_local_ranks)
    ordered = [r for r in live if r != failed_rank] + [r for r in live if r == failed_rank]
    return tuple(ordered[:ENFORCERS])


def plan(s: Situation) -> Plan:
    """The plan of one rank: the rules of this module, applied to ``s``."""
    # An interrupted job (every rank got the same SIGINT or SIGTERM from outside) has no
    # failed rank: the verdict names the first to get it, and it is one rank among others.
    mine = s.failed_rank == s.self_rank and s.cause != INTERRUPTED
    interrupt = s.in_watch and not mine
    stay = interrupt or (mine and s.cause in _LEAVES_BY_ITSELF)
    chosen = enforcers(s.live_local_ranks, s.failed_rank)
    enforcer = s.self_rank in chosen
    blind = enforcer and not s.ack_written
    extra_s = BLIND_GRACES * s.grace_s if blind else 0.0
    speaks = s.cause in _LEAVES_BY_ITSELF and (s.own_exit_code is not None if mine else s.failed_rank_speaks)
    print_summary = (mine and speaks) or (s.wrote_verdict and not speaks)
    first_enforcer = chosen[:1] == (s.self_rank,)
    # A failing rank that stays prints its summary (and writes the report) once its main
    # thread has left; written now too only where it is the one writer of this host.
    writer_prints = print_summary and not (mine and stay)
    summary_now = writer_prints and s.cause not in _STILL_THERE
    p = Plan(
        exit_code=exit_code(s.self_rank, s.failed_rank, s.verdict_exit_code, s.own_exit_code),
        interrupt_main=interrupt,
        stay_s=s.grace_s if stay else 0.0,
        enforcer=enforcer,
        write_report=first_enforcer or writer_prints,
        print_summary=print_summary,
        summary_now=summary_now,
        summary_after_dumps=writer_prints and not summary_now,
        stop_line=not mine,
        sweep_records=first_enforcer,
        last_resort_s=s.ack_window_s + extra_s + LAST_RESORT_GRACES * s.grace_s + LAST_RESORT_EXTRA_S,
        ack_window_s=s.ack_window_s + extra_s,
        blind=blind,
        trusted=tuple(r for r in chosen if r != s.self_rank) if blind else (),
        summary_poll_s=summary_poll_s(len(s.live_local_ranks)),
    )
    return dataclasses.replace(p, until_ack=_until_ack(s, p), after_ack=_after_ack(s, p))


def summary_poll_s(local_ranks: int) -> float:
    """Rule: who reports. How often a rank waiting for the summary looks for it, with
    ``local_ranks`` live on its host (all of them look at once): every 10 ms up to 8 ranks,
    then less often in proportion, so that their looks together cost the host the same."""
    return SUMMARY_POLL_S * max(1.0, local_ranks / SUMMARY_POLL_RANKS)


def _until_ack(s: Situation, p: Plan) -> Tuple[Step, ...]:
    """Rule: the step order, up to the acknowledgement: the launcher's SIGTERM held back
    (where it comes early), the summary of a rank that ended, then the ack."""
    hold = (Step.HOLD_SIGTERM,) if s.ends_workers_early else ()
    return hold + (Step.ARM_EXIT_WATCH,) + ((Step.WRITE_SUMMARY,) if p.summary_now else ()) + (Step.ACK,)


def _after_ack(s: Situation, p: Plan) -> Tuple[Step, ...]:
    """Rule: the step order, from the acknowledgement on, planned with its result
    (rule: the blind enforcer)."""
    early = p.write_report and s.ends_workers_early  # the launcher may end this rank any moment now
    hook = p.write_report and s.on_verdict  # a writer of the report starts the hook, after it
    steps = [Step.SAY_BLIND] if p.blind else []
    steps += [] if p.enforcer else [Step.STOP_WATCHING_FOLDERS]
    steps += [Step.ARM_LAST_RESORT] + ([Step.TELL_HOSTS] if s.other_hosts else [])
    steps += [Step.FINAL_HEARTBEAT, Step.TELL_LAUNCHERS]  # after the ack, which the peers wait for
    early_hook = early and hook and not p.stay  # at once or never; its keeper runs it once this rank is gone
    if early and not p.summary_now and (early_hook or not p.summary_after_dumps):
        # Before the launcher's SIGTERM, and before the hook, which reads it; again after the
        # teardown (and after the dumps, with the summary, for a rank that has not ended).
        steps.append(Step.WRITE_REPORT)
    steps += [Step.START_HOOK] if early_hook else []
    steps += [Step.DUMP_STACKS, Step.DUMP_FLIGHT_RECORDER]
    steps += [Step.WRITE_SUMMARY] if p.summary_after_dumps else []
    steps += [Step.INTERRUPT_MAIN] if p.interrupt_main else []
    # An enforcer watches the folders for its peers' acknowledgements, then no more: a
    # process that exits still watching waits for the kernel to free the watches.
    steps += [Step.TEAR_DOWN_PEERS, Step.STOP_WATCHING_FOLDERS] if p.enforcer else []
    steps += [] if p.stay else [Step.TEAR_DOWN_CHILDREN]
    steps += [Step.WRITE_REPORT] if p.write_report else []  # while the peers are still leaving
    if p.stay:
        steps += [Step.START_HOOK] if hook else []  # while the main thread leaves
        steps.append(Step.WAIT_MAIN)
        if p.print_summary and s.failed_rank == s.self_rank:  # below its own traceback, out now
            steps.append(Step.WRITE_SUMMARY_BELOW_TRACEBACK if s.cause == EXCEPTION else Step.WRITE_SUMMARY)
        steps.append(Step.TEAR_DOWN_CHILDREN)
    steps.append(Step.FINAL_HEARTBEAT)
    steps += [Step.SAY_STOP_LINE] if p.stop_line else []
    steps += [Step.LET_LAUNCHER_SEE] if s.ends_workers_early else []
    steps += [Step.SWEEP_RECORDS] if p.sweep_records else []
    steps += [Step.START_HOOK] if hook and not p.stay and not early else []  # last (rule: the step order)
    steps += [Step.FINISH_HOOK] if hook else []
    return tuple(steps) + (Step.EXIT,)


@dataclasses.dataclass(frozen=True)
class AckWindow:
    """Rule: the ack window, as a value. When the enforcer stops waiting for acknowledgements.

    Times are seconds of one monotonic clock; ``acks`` is how many acknowledgements were
    seen at the last look (None before the first).
    """

    deadline: float
    latest: float
    window: float
    acks: Optional[int] = None

    @classmethod
    def opened(cls, now: float, window: float) -> AckWindow:
        return cls(deadline=now + window, latest=now + ACK_STRETCH_MAX * window, window=window)

    def seen(self, now: float, acks: int) -> AckWindow:
        """The window after a look at ``now`` that found ``acks`` acknowledgements."""
        deadline = self.deadline
        if self.acks is not None and acks > self.acks:
            deadline = max(deadline, min(self.latest, now + self.window / ACK_STRETCH_FRACTION))
        return dataclasses.replace(self, deadline=deadline, acks=acks)

    def left(self, now: float) -> float:
        return self.deadline - now


def pending(
    peers: Iterable[int], self_rank: int, gone: AbstractSet[int], acked: AbstractSet[int],
    trusted: AbstractSet[int] = frozenset(),
) -> Tuple[int, ...]:
    """Rules: whom to signal, the blind enforcer. The local peers still to hear from, lowest
    first (``trusted``: the ones a blind enforcer leaves to leave by themselves)."""
    return tuple(sorted(r for r in peers if r != self_rank and r not in gone and r not in acked and r not in trusted))


def verdict_wait_s(parent_wait_s: float, ack_window_s: float, hold_s: float, echo: bool = False) -> float:
    """Rule: leaving at exit. How long a failed rank waits at exit for the verdict on its
    failure (``echo``: the failure is an exception raised by torch.distributed)."""
    return parent_wait_s + ack_window_s + SETTLE_S + hold_s + (LEAVING_WAIT_NS / 1e9 if echo else 0.0)


def leave_join_s(grace_s: float, ack_window_s: float) -> float:
    """Rule: leaving at exit. How long the exiting main thread waits for the watcher's share of a teardown."""
    return grace_s + ack_window_s + LEAVE_EXTRA_S


def missing_ranks(
    local_world_size: Optional[int], world_size: Optional[int], local: AbstractSet[int], registered: AbstractSet[int],
) -> Tuple[Tuple[int, ...], str]:
    """At ``startup_timeout``: the ranks to fail on for never registering, and what to
    say (empty: all there). Expected on this host: ranks 0..local_world_size-1 when the
    launcher says how many run here, else all of world_size (one host). When this host
    runs only some of the ranks, which global ranks belong here is not known: say only."""
    expected = local_world_size or world_size
    if not expected:
        return (), "startup_timeout is set but neither LOCAL_WORLD_SIZE nor WORLD_SIZE says how many ranks to expect;"
    if len(local) >= expected:
        return (), ""
    if local_world_size and world_size and local_world_size < world_size:
        return (), f"only {len(local)} of {expected} local ranks registered (registered: {sorted(local)})"
    missing = tuple(r for r in range(expected) if r not in registered)
    return missing, f"rank(s) {', '.join(map(str, missing))} did not register"


def ask_for_stacks(rank: int, finished: AbstractSet[int]) -> bool:
    """Rule: whom to signal. A peer that wrote its success marker is leaving: no dump to ask of it."""
    return rank not in finished


__all__ = [
    "BLIND_GRACES", "ENFORCERS", "SUMMARY_FIRST_LOOK_S", "SUMMARY_POLL_RANKS", "SUMMARY_POLL_S", "SUMMARY_WAIT_S", "AckWindow", "Plan", "Situation", "Step", "ask_for_stacks", "enforcers", "exit_code", "leave_join_s", "missing_ranks",
    "pending", "plan", "verdict_wait_s",
]
