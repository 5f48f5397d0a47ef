"""The decision: observed state -> verdict, or nothing yet. Pure: no I/O, no clock.

Its rules, named as in docs/how-it-works.md ("The decision"), where the code cites them:

- **A verdict stands.** A verdict already written is the verdict (one per run; everyone
  follows it).
- **Success is final.** A success marker is final: that rank never causes a teardown,
  whatever comes after.
- **Exited is not succeeded.** A failure record, an exit status seen by the parent, or a
  local peer seen gone (its pidfd fired, or it no longer is the registered process)
  without a success marker is a failure: exit code 0 without a marker is a failure too.
- **Held back for the parent.** A peer seen gone whose parent is a live peer is held back
  for ``parent_wait``: only the parent can read the exit status, and it usually writes it
  within a millisecond.
- **Held back while unread.** A peer seen gone is held back too while the last look at the
  run directory could not read everything (``unread``: out of descriptors...): its success
  marker may be there.
- **The earliest failure is the cause.** Of several failures, the earliest (then the lowest
  rank) is the root cause; we wait while a held-back failure might still turn out to be
  the earliest.
- **A death outranks an exception.** An exception never outranks a death without a record
  (signal, vanished, an exit status) seen within ``CONSEQUENCE_WINDOW_NS`` (1 s) of it:
  such deaths are never consequences, while the collectives of the dead rank's peers fail
  with exceptions within milliseconds, possibly stamped before the death is seen.
- **A collective exception settles.** An exception raised by ``torch.distributed``
  (``collective``) is judged only ``COLLECTIVE_SETTLE_NS`` after it was raised
  (``REMOTE_SETTLE_NS`` where the job spans hosts), unless something else is found first:
  the socket of a rank that dies closes a moment before its pidfd fires (a SIGKILLed
  rank's memory is still being torn down), and a rank leaving with ``raise SystemExit(3)``
  closes its sockets while Python finalizes, before its exit status is written (at
  ``exit(3)``). Only a collective exception with no other failure in sight pays this wait.
- **Echo waits for the leaving.** A rank that began to leave (``leaving``: its program
  ended and its interpreter is finalizing, with no outcome recorded yet; or its process is
  seen in ``exit()``, its sockets closed while its memory is torn down, its pidfd still to
  fire) up to ``LEAVING_WAIT_NS`` before a collective exception, or within
  ``COLLECTIVE_SETTLE_NS`` after it, is what that exception may echo: the exception waits
  until that rank has ended, at most ``LEAVING_WAIT_NS`` from when it began to leave, and
  if it ended in a failure (an exit status or record, a death) that failure is the cause,
  however long its finalization took. Finalizing takes as long as it takes (a loaded
  machine, an atexit handler that destroys the process group and then uploads logs), and
  the exit status is written only at its end, while the sockets close at its start.
- **A launcher's signal never outranks.** A rank killed by a signal its own parent sent
  (``signalled_by`` is its registered ``ppid``: torchrun's agent, mp.spawn's main process)
  never outranks another failure: a launcher stops its workers because it saw another one
  end, and on a loaded host it can do so before a watcher has seen that end (its "seen"
  time then comes later); so such a rank waits for every death held back for its parent,
  however late it was seen.
- **Interrupts are not failures.** When every failure found is the same signal from
  outside the job, a SIGINT (a KeyboardInterrupt: peerwatch never sends SIGINT) or a
  SIGTERM from one sender that is no rank of the job (a teardown's SIGTERMs are sent by
  ranks), and every rank of this host that has not finished got it (its failure, its exit
  record, or, for one whose main thread waits in C, its watcher's ``interrupt`` record),
  the job was interrupted: the verdict (cause ``interrupted``) names no failing rank, and
  its exit code is the signal's (130, 143). Until they all show it, the decision waits, at
  most ``INTERRUPT_WINDOW_NS`` from the first: a signal to the process group (Ctrl-C, a
  scheduler) reaches every rank at once. One rank signalled alone failed, and is blamed.
- **A rank that never registered.** With ``startup_timeout`` and no failure found, the
  ranks that did not register in time are the failure (cause ``missing``).
- **No rank moved.** Hang (only with ``hang_timeout``): when no live rank has made
  progress (``beat()``) for ``hang_timeout``, and none is in a ``paused()`` phase, the job
  is hung. The laggard is, in this order of preference: a frozen rank (state T or D); a
  rank whose watcher has gone silent (the GIL held in C code); a rank whose main thread is
  *not* waiting inside torch.distributed while others are (they wait for it); the rank
  with the lowest step; the one silent longest. A silence counts only from the judge's
  last resume (``awake_since_ns``, peerwatch.core.awake): a judge stopped with the ranks reads
  their stale heartbeats first.
- **The diagnosis is the verdict.** With ``hang_timeout=auto``, a diagnosis
  (peerwatch.hangs.diagnose, made by a judge at the learnt threshold) of a stall still going on
  is the verdict: its first laggard, cause hang, from the diagnosis' ``end_at_ns`` on (at
  once for a hang or a mismatch; for laggards that are busy, not stuck, near the
  collective timeout).
- **A silent host is lost.** Judged before the decision, by one rule whichever way news of the
  other hosts comes (:class:`peerwatch.hosts.hosts.Liveness`), whose judge writes a failure
  record (cause ``lost``) on the lost ranks' behalf: here a failure like any other.
- **Victims are not blamed.** When the root cause found by the rules above is a rank that
  died of the collective timeout (an exception raised by torch.distributed, a SIGABRT or
  exit code 134 from NCCL's watchdog) after a diagnosis of the stall still going on named
  other ranks, the verdict names the diagnosed laggard, cause hang.

Why "no rank moved" does not fire on a slow rank: in a synchronous job every rank waits
for the slowest in each collective, so the job as a whole moves exactly as fast as its
slowest rank. Judging "no rank moved" rather than "this rank is behind" means a rank that
is slow but moving, or ranks that wait for it, never trip it; only a job in which nothing
has moved for the whole timeout does. A rank in ``paused()`` (checkpointing, evaluation
on one rank) suspends the rule for everyone, since the others are expected to wait.
Entering and leaving ``paused()`` count as progress, so a pause cannot age into a hang.
"""

from __future__ import annotations

import dataclasses
import signal as _signal
from typing import AbstractSet, Dict, List, Mapping, Optional, Tuple

from ..core.config import Config, HangSetting
from ..core.records import (
    BUSY,
    EXCEPTION,
    EXIT,
    HANG,
    HANG_EXIT_CODE,
    INTERRUPTED,
    LOST,
    MISSING,
    SIGNAL,
    VANISHED,
    Diagnosis,
    ExitStatus,
    Failure,
    Interrupt,
    Registration,
    Verdict,
    returncode_exit_code,
    signal_name,
)
from ..hangs.diagnose import FROZEN_STATES, RankState, explain

# A rank that dies without a word (SIGKILL, segfault, OOM, os._exit) is never the
# consequence of another rank's exception, but the exceptions of its peers' collectives
# ("Connection closed by peer") are consequences of its death, and can be stamped before
# its death is seen: the socket closes a moment before the pidfd fires, and a watcher may
# see both in one wake-up. Within this window the death is the root cause.
CONSEQUENCE_WINDOW_NS = 1_000_000_000
# How long an exception raised by torch.distributed waits for the failure it may echo
# (rule: a collective exception settles). Within a failing rank's own wait at exit
# (plan.verdict_wait_s: 0.85 s by default).
COLLECTIVE_SETTLE_NS = 500_000_000
# The same where the job spans hosts: a rank that died on another host is known here only
# once its host's verdict comes through the store (tens of milliseconds idle; over a
# second measured with 2 cores at load 10, where 0.5 s let a victim here be blamed).
REMOTE_SETTLE_NS = 2_000_000_000
# How long, from when a rank began to leave, an exception raised by torch.distributed waits
# for that rank to end (rule: echo waits for the leaving): its interpreter's finalization,
# 0.1-0.2 s on an idle machine, measured up to 5 s (2 cores at load 11). It is waited for
# only while that rank is still finalizing: its end (exit status, pidfd) is an event. A rank
# whose own failure is such an exception waits this much longer at exit
# (plan.verdict_wait_s).
LEAVING_WAIT_NS = 15_000_000_000
_DEATHS = (SIGNAL, VANISHED, EXIT)
# A peer seen gone while records could not be read (rule: held back while unread): decide again this soon.
UNREAD_RECHECK_NS = 100_000_000
# How long, from the first rank seen to get a SIGINT or SIGTERM from outside the job, the
# decision waits for the other ranks of this host to show the same one
# (rule: interrupts are not failures): a signal to the process group reaches them all at
# once, and each says so within milliseconds (a SIGTERM's record is written by its handler,
# a KeyboardInterrupt's as it reaches the top); 2 s leaves room for a loaded host. Waited
# only while every failure found is such a signal.
INTERRUPT_WINDOW_NS = 2_000_000_000
_INTERRUPTS = ("SIGINT", "SIGTERM")

@dataclasses.dataclass(frozen=True)
class Observed:
    """What one watcher knows at ``now_ns`` (``time.time_ns()``)."""

    self_rank: int
    now_ns: int
    registrations: Mapping[int, Registration]
    successes: AbstractSet[int]
    failures: Mapping[int, Failure]
    exit_statuses: Mapping[int, ExitStatus]
    gone: Mapping[int, int]  # rank -> when this watcher saw its process gone (time_ns)
    verdict: Optional[Verdict] = None
    oom_kills: int = 0  # how many more OOM kills the kernel counts than when we started
    # This host's live ranks' progress, as their heartbeats say (hang judges only).
    progress: Mapping[int, RankState] = dataclasses.field(default_factory=dict)
    now_mono_ns: int = 0
    missing: Tuple[int, ...] = ()  # ranks that never registered by startup_timeout (to fail on)
    # Why the job stopped moving, as a judge of this host diagnosed it (peerwatch.hangs.diagnose).
    diagnosis: Optional[Diagnosis] = None
    # rank -> when it began to leave (time_ns; its heartbeat's leaving_ns): its program
    # ended with no outcome recorded, its interpreter finalizes, its exit status is to come;
    # or when its process was first seen in exit() (PF_EXITING: _exit, a signal).
    # This host's ranks, read only while a collective exception is to be judged
    # (rule: echo waits for the leaving).
    leaving: Mapping[int, int] = dataclasses.field(default_factory=dict)
    # When this judge last resumed after it was not running (CLOCK_MONOTONIC, as now_mono_ns;
    # peerwatch.core.awake): no silence counts from before then.
    awake_since_ns: int = 0
    # The last look at the run directory could not list a folder or read a record (EMFILE...):
    # a success marker may be among what was missed (rule: held back while unread).
    unread: bool = False
    # rank -> the SIGINT it got, as its watcher saw it arrive (rule: interrupts are not failures):
    # not a failure, the evidence that a rank whose main thread waits in C (a collective) got it too.
    interrupts: Mapping[int, Interrupt] = dataclasses.field(default_factory=dict)
    now_boot_ns: Optional[int] = None  # CLOCK_BOOTTIME now: a verdict's stamp (Verdict.made_before)

    def live_progress(self) -> Dict[int, RankState]:
        """The progress of the ranks neither finished nor gone: those a hang is judged by."""
        return {r: p for r, p in self.progress.items() if r not in self.successes and r not in self.gone}


@dataclasses.dataclass(frozen=True)
class Policy:
    parent_wait_ns: int
    default_exit_code: int
    # Seconds: a hang when nothing moved that long (rule: no rank moved); auto: (rule: the diagnosis is the verdict).
    hang_timeout: HangSetting = HangSetting()
    # How long a collective exception waits (rule: a collective exception settles; REMOTE_SETTLE_NS across hosts).
    collective_settle_ns: int = COLLECTIVE_SETTLE_NS

    @classmethod
    def from_config(cls, config: Config, other_hosts: bool = False) -> Policy:
        """The policy a rank's watcher decides by. ``other_hosts``: the job spans hosts (a store
        bridge, or a run directory the hosts share): a collective exception waits longer."""
        return cls(
            parent_wait_ns=_ns(config.parent_wait), default_exit_code=config.exit_code,
            hang_timeout=config.hang_timeout,
            collective_settle_ns=REMOTE_SETTLE_NS if other_hosts else COLLECTIVE_SETTLE_NS,
        )


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


@dataclasses.dataclass(frozen=True)
class Decision:
    verdict: Optional[Verdict]
    recheck_at_ns: Optional[int] = None  # decide again by then, even if nothing happens


def _held_horizon(obs: Observed, first: Optional[Verdict]) -> Optional[int]:
    """Until when a death held back for its parent may still turn out to be the root cause
    (also the end of a rank that was leaving as a collective failed: see decide). A rank
    its own launcher signalled never outranks another failure, however late it is seen (the
    launcher saw that failure first): None then, every held death is waited for."""
    if first is None or _signalled_by_its_launcher(obs, first):
        return None
    return first.failed_at_ns + (CONSEQUENCE_WINDOW_NS if first.cause == EXCEPTION else 0)


def decide(obs: Observed, policy: Policy) -> Decision:
    if obs.verdict is not None:
        return Decision(obs.verdict)
    found: List[Verdict] = []
    held: List[Tuple[int, int, int]] = []  # (rank, seen_ns, until_ns)
    for rank, failure in obs.failures.items():
        if rank not in obs.successes:
            found.append(_from_failure(obs, failure, policy))
    for rank, status in obs.exit_statuses.items():
        if rank not in obs.successes and rank not in obs.failures:
            found.append(_from_status(obs, status, policy))
    for rank, seen_ns in obs.gone.items():
        if rank in obs.successes or rank in obs.failures or rank in obs.exit_statuses:
            continue
        until_ns = seen_ns + policy.parent_wait_ns
        if obs.now_ns < until_ns and _has_live_parent(obs, rank):
            held.append((rank, seen_ns, until_ns))
            continue
        if obs.unread:  # not known how it ended: looked at again (the watcher retries soon)
            held.append((rank, seen_ns, obs.now_ns + UNREAD_RECHECK_NS))
            continue
        found.append(_vanished(obs, rank, seen_ns, policy))
    first = min(found, key=lambda v: _order(obs, v, found), default=None)
    horizon = _held_horizon(obs, first)
    echoed = () if first is None else _leavers_echoed(obs, first)
    waiting = [until for rank, seen, until in held if horizon is None or seen <= horizon or rank in echoed]
    if waiting:
        return Decision(None, recheck_at_ns=min(waiting))
    interrupted = _interrupted(obs, found)
    if interrupted is not None:
        return interrupted
    settled_ns = _collective_settled_ns(obs, first, policy.collective_settle_ns)
    if settled_ns is not None and obs.now_ns < settled_ns:
        return Decision(None, recheck_at_ns=settled_ns)
    if first is None and obs.missing:
        return Decision(_missing(obs, policy))
    if first is None:
        hang = _hang(obs, policy)
        return Decision(hang) if hang is not None else _diagnosed_hang(obs, policy)
    first = _victim_of_hang(obs, first)
    if obs.oom_kills > 0 and (first.cause == VANISHED or first.signal == "SIGKILL"):
        first = dataclasses.replace(
            first, oom_suspected=True,
            detail=f"{first.detail}; likely killed by the OOM killer ({obs.oom_kills} OOM kill(s) during the run)",
        )
    return Decision(first)


def _order(obs: Observed, v: Verdict, found: List[Verdict]) -> Tuple[bool, int, int]:
    """Earliest first, except that an exception never outranks a death seen within
    CONSEQUENCE_WINDOW_NS of it, and a collective exception never outranks the failed end
    of a rank that was leaving as it was raised, however late, and a rank its own launcher
    signalled never outranks another failure
    (rules: a death outranks an exception, echo waits for the leaving, a launcher's signal never outranks)."""
    if _signalled_by_its_launcher(obs, v):
        return (any(d.rank != v.rank for d in found), v.failed_at_ns, v.rank)
    if v.cause != EXCEPTION:
        return (False, v.failed_at_ns, v.rank)
    leavers = _leavers_echoed(obs, v)
    consequence = any(
        d.cause in _DEATHS and not _stopped_by_its_launcher(obs, d.rank)
        and (d.failed_at_ns <= v.failed_at_ns + CONSEQUENCE_WINDOW_NS or d.rank in leavers)
        for d in found
    )
    return (consequence, v.failed_at_ns, v.rank)


def _signalled_by_its_launcher(obs: Observed, v: Verdict) -> bool:
    """``v`` is a rank killed by a signal its own parent sent: it never outranks another failure."""
    return v.cause == SIGNAL and _stopped_by_its_launcher(obs, v.rank)


def _stopped_by_its_launcher(obs: Observed, rank: int) -> bool:
    """The rank's exit status says its own parent signalled it (rule: a launcher's signal never outranks)."""
    status, reg = obs.exit_statuses.get(rank), obs.registrations.get(rank)
    return status is not None and reg is not None and status.signalled_by is not None and status.signalled_by == reg.ppid


def _leavers_echoed(obs: Observed, v: Verdict) -> Tuple[int, ...]:
    """The ranks that began to leave around ``v``, if it is an exception raised by
    torch.distributed: from LEAVING_WAIT_NS before it to COLLECTIVE_SETTLE_NS after it."""
    failure = obs.failures.get(v.rank)
    if v.cause != EXCEPTION or failure is None or not failure.collective:
        return ()
    return tuple(
        rank for rank, began_ns in sorted(obs.leaving.items())
        if rank != v.rank and v.failed_at_ns - LEAVING_WAIT_NS <= began_ns <= v.failed_at_ns + COLLECTIVE_SETTLE_NS
    )


def _collective_settled_ns(obs: Observed, first: Optional[Verdict], settle_ns: int) -> Optional[int]:
    """When the root cause ``first`` may be acted on, if it is an exception raised by
    torch.distributed (rules: a collective exception settles, echo waits for the leaving): the
    failure it may echo gets COLLECTIVE_SETTLE_NS to show, and a rank leaving around it
    LEAVING_WAIT_NS from when it began to leave to end."""
    if first is None or first.cause != EXCEPTION:
        return None
    failure = obs.failures.get(first.rank)
    if failure is None or not failure.collective:
        return None
    settled_ns = first.failed_at_ns + settle_ns
    ended = set(obs.successes) | set(obs.failures) | set(obs.exit_statuses) | set(obs.gone)
    for rank in _leavers_echoed(obs, first):
        if rank not in ended:
            settled_ns = max(settled_ns, obs.leaving[rank] + LEAVING_WAIT_NS)
    return settled_ns


def _missing(obs: Observed, policy: Policy) -> Verdict:
    ranks = ", ".join(map(str, obs.missing))
    return Verdict(
        **_base(obs, obs.missing[0]), cause=MISSING, exit_code=policy.default_exit_code,
        failed_at_ns=obs.now_ns, detail=f"never started: rank(s) {ranks} did not register within startup_timeout",
    )


def _hang(obs: Observed, policy: Policy) -> Optional[Verdict]:
    timeout_s = policy.hang_timeout.seconds
    if timeout_s is None:
        return None
    live = obs.live_progress()
    if not live or any(p.paused for p in live.values()):
        return None
    # Progress: a beat(), or torch's collective counters moving (no code change needed).
    beats = [t for p in live.values() for t in (p.beat_mono_ns, p.moved_mono_ns) if t is not None]
    if not beats:
        return None  # nobody reports progress (no beat() nor collective yet): nothing to judge by
    silent_ns = obs.now_mono_ns - max(max(beats), obs.awake_since_ns)  # only time this judge saw pass
    if silent_ns < _ns(timeout_s):
        return None

    def lag(rank: int) -> Tuple[bool, bool, bool, int, int, int]:
        p = live[rank]
        return (
            p.state not in FROZEN_STATES, not p.watcher_silent, p.in_collective,
            -1 if p.step is None else p.step, p.beat_mono_ns or 0, rank,
        )

    order = sorted(live, key=lag)
    laggards = tuple(r for r in order if lag(r)[:4] == lag(order[0])[:4])
    first = order[0]
    p = live[first]
    context = []
    if not p.in_collective and any(live[r].in_collective for r in live):
        context.append("the others wait for it in torch.distributed")
    context.append("it never reported progress" if p.step is None else f"step {p.step}")
    why = explain(p, context)
    others = [r for r in laggards if r != first]
    detail = f"no rank made progress for {silent_ns / 1e9:.1f}s; rank {first} holds the job up ({', '.join(why)})"
    if others:
        detail += f"; also behind: ranks {', '.join(map(str, others))}"
    return Verdict(
        **_base(obs, first), cause=HANG, exit_code=HANG_EXIT_CODE,
        failed_at_ns=obs.now_ns - silent_ns, detail=detail, laggards=laggards,
    )


# How a rank dies of the collective timeout: gloo raises (a collective exception), NCCL's
# watchdog aborts the process (SIGABRT: returncode -6, or exit code 134 through a shell).
_TIMEOUT_SIGNALS = ("SIGABRT",)
_TIMEOUT_EXIT_CODES = (134,)


def _current(d: Optional[Diagnosis]) -> bool:
    return d is not None and d.resolved_ns is None and bool(d.laggards)


def _diagnosed_hang(obs: Observed, policy: Policy) -> Decision:
    """Rule: the diagnosis is the verdict. With hang_timeout=auto, a diagnosis of the stall
    still going on is the verdict, from its ``end_at_ns`` on (at once for a hang; near the
    collective timeout for busy laggards, so a checkpoint or an evaluation is never ended
    early)."""
    d = obs.diagnosis
    if not policy.hang_timeout.auto or d is None or not _current(d):
        return Decision(None)
    rank = d.laggards[0]
    if rank in obs.successes or rank in obs.gone:
        return Decision(None)
    if d.end_at_ns is not None and obs.now_ns < d.end_at_ns:
        return Decision(None, recheck_at_ns=d.end_at_ns)
    detail = d.detail
    if d.finding == BUSY:
        detail += f"; ended by hang_timeout=auto after {(obs.now_ns - d.stalled_at_ns) / 1e9:.0f}s, before the collective timeout"
    return Decision(_hang_verdict(obs, d, detail))


def _hang_verdict(obs: Observed, d: Diagnosis, detail: str) -> Verdict:
    """The verdict of a diagnosis: its first laggard, cause hang, failed when the stall began."""
    rank = d.laggards[0]
    return Verdict(**_base(obs, rank, dict(d.hosts).get(rank)), cause=HANG, exit_code=HANG_EXIT_CODE,
                   failed_at_ns=d.stalled_at_ns, detail=detail, laggards=d.laggards)


def _victim_of_hang(obs: Observed, first: Verdict) -> Verdict:
    """Rule: victims are not blamed. A rank that dies of the collective timeout (gloo's
    exception, NCCL's abort) after a diagnosis named another rank is its victim: the verdict
    names the laggard, cause hang, and the dead rank is a consequence."""
    d = obs.diagnosis
    if d is None or not _current(d) or first.rank in d.laggards or first.failed_at_ns < d.time_ns:
        return first
    failure = obs.failures.get(first.rank)
    timeout = (
        (first.cause == EXCEPTION and failure is not None and failure.collective)
        or first.signal in _TIMEOUT_SIGNALS
        or (first.cause == EXIT and first.returncode in _TIMEOUT_EXIT_CODES)
    )
    if not timeout:
        return first
    how = first.detail or first.cause
    return _hang_verdict(obs, d, f"{d.detail}; rank {first.rank} then failed waiting for it ({how}): a consequence")


def _interrupt_of(obs: Observed, rank: int) -> Optional[Tuple[str, Optional[int], int]]:
    """(signal, sender, when) if the rank's record says it got a SIGINT or SIGTERM from
    outside the job (rule: interrupts are not failures); None for any other end. A SIGTERM
    sent by a rank of the job (a teardown's) is not one."""
    failure = obs.failures.get(rank)
    if failure is not None:
        if failure.signal not in _INTERRUPTS:
            return None
        return failure.signal, failure.signalled_by, failure.raised_ns or failure.time_ns
    st = obs.exit_statuses.get(rank)
    if st is None or st.returncode >= 0 or signal_name(-st.returncode) not in _INTERRUPTS:
        return None
    if st.signalled_by is not None and any(r.pid == st.signalled_by for r in _local(obs).values()):
        return None
    return signal_name(-st.returncode), st.signalled_by, st.time_ns


def _got_too(obs: Observed, rank: int, sig: str, since_ns: int) -> bool:
    """The rank, alive, got ``sig`` too, within INTERRUPT_WINDOW_NS of ``since_ns``, as its
    watcher saw (its main thread may wait in C for a peer that raised already)."""
    seen = obs.interrupts.get(rank)
    return (seen is not None and seen.signal == sig and rank not in obs.failures and rank not in obs.exit_statuses
            and abs(seen.time_ns - since_ns) <= INTERRUPT_WINDOW_NS)


def _local(obs: Observed) -> Dict[int, Registration]:
    """The ranks registered on this watcher's host (its boot and PID namespace)."""
    me = obs.registrations.get(obs.self_rank)
    if me is None:
        return {}
    return {r: reg for r, reg in obs.registrations.items()
            if reg.host == me.host and reg.boot_id == me.boot_id and reg.pidns == me.pidns}


def _interrupted(obs: Observed, found: List[Verdict]) -> Optional[Decision]:
    """Rule: interrupts are not failures. The verdict that the job was interrupted, a wait
    for the other ranks of this host to show the same signal, or None (the other rules judge)."""
    got: Dict[int, Tuple[str, Optional[int], int]] = {}
    for v in found:
        seen = _interrupt_of(obs, v.rank)
        if seen is None:
            return None  # a failure of another kind: not (only) an interrupt
        got[v.rank] = seen
    # One signal; for SIGTERM, from one sender: a launcher stops the other workers with a
    # SIGTERM of its own when one ended (its kill from outside is that rank's failure). Nobody
    # sends SIGINT because a rank ended: a SIGINT is one, whoever passed it on (Ctrl-C reaches
    # torchrun's workers from the terminal, and again from their agent).
    if not got or len({(sig, sender if sig == "SIGTERM" else None) for sig, sender, _ in got.values()}) != 1:
        return None
    first = min(got, key=lambda r: (got[r][2], r))
    sig, sender, since_ns = got[first]
    others = [r for r in _local(obs) if r not in got and r not in obs.successes]
    if not all(_got_too(obs, r, sig, since_ns) for r in others):
        until_ns = since_ns + INTERRUPT_WINDOW_NS
        return Decision(None, recheck_at_ns=until_ns) if obs.now_ns < until_ns else None
    return Decision(Verdict(
        **_base(obs, first), cause=INTERRUPTED, exit_code=128 + int(_signal.Signals[sig]), failed_at_ns=since_ns,
        signal=sig, signalled_by=sender, detail=interrupt_detail(obs, first, sig, sender, len(got) + len(others)),
    ))


def interrupt_detail(obs: Observed, first: int, sig: str, sender: Optional[int], ranks: int) -> str:
    """What an interrupted job's verdict says: the signal, its sender where known (the
    ranks' launcher, which passes it on, by name), how many ranks got it."""
    reg = obs.registrations.get(first)
    if sender is None:
        by = "from outside the job"
    elif reg is not None and sender == reg.ppid:
        by = f"from outside the job, through the launcher, pid {sender}"
    else:
        by = f"from outside the job, pid {sender}"
    return f"{sig} {by}; {'its one rank' if ranks == 1 else f'all {ranks} ranks'} got it, none failed"


def _has_live_parent(obs: Observed, rank: int) -> bool:
    """True if the rank's parent is another registered rank that is not known to be gone
    and is not this watcher (which would already have read the status if it could)."""
    reg = obs.registrations.get(rank)
    if reg is None:
        return False
    for other, parent in obs.registrations.items():
        if (
            other != rank
            and parent.pid == reg.ppid
            and parent.boot_id == reg.boot_id
            and parent.pidns == reg.pidns
        ):
            return other != obs.self_rank and other not in obs.gone
    return False


def exit_code_for(returncode: Optional[int], policy: Policy) -> int:
    """The exit code torn-down ranks use: the failing rank's, but never 0."""
    if returncode is None:
        return policy.default_exit_code
    code = returncode_exit_code(returncode)
    return code if 0 < code <= 255 else policy.default_exit_code


def _base(obs: Observed, rank: int, host: Optional[str] = None) -> dict:
    """``host``: where the rank is, if it is not registered here (another host's, named by its summary)."""
    reg = obs.registrations.get(rank)
    return {
        "rank": rank,
        "pid": reg.pid if reg else None,
        "host": reg.host if reg else host,
        "detected_by": obs.self_rank,
        "detected_at_ns": obs.now_ns,
        "boot_ns": obs.now_boot_ns,
    }


def _from_failure(obs: Observed, f: Failure, policy: Policy) -> Verdict:
    if f.cause == HANG:
        # Written on the rank's behalf: its gil_timeout watchdog ended it, stuck.
        return Verdict(
            **_base(obs, f.rank), cause=HANG, exit_code=HANG_EXIT_CODE, failed_at_ns=f.time_ns,
            message=f.message, traceback=f.traceback, laggards=(f.rank,),
            detail=f"hung: {f.message}" if f.message else "hung",
        )
    if f.cause == LOST and f.message:
        detail = f.message
    elif f.exception:
        detail = f"raised {f.exception}: {f.message}" if f.message else f"raised {f.exception}"
    else:
        detail = f"exited with code {f.exit_code}"
    if f.thread and f.thread != "MainThread":
        detail += f" (in thread {f.thread})"
    base = _base(obs, f.rank)
    base["host"] = base["host"] or f.host  # a rank of another host has no registration here
    return Verdict(
        **base,
        cause=f.cause,
        exit_code=exit_code_for(f.exit_code, policy),
        failed_at_ns=f.time_ns,
        raised_ns=f.raised_ns,
        returncode=f.exit_code,
        exception=f.exception,
        message=f.message,
        traceback=f.traceback,
        detail=detail,
    )


def _from_status(obs: Observed, st: ExitStatus, policy: Policy) -> Verdict:
    base = _base(obs, st.rank)
    base["pid"] = st.pid
    if st.returncode < 0:
        name = signal_name(-st.returncode)
        return Verdict(
            **base, cause=SIGNAL, exit_code=exit_code_for(st.returncode, policy),
            failed_at_ns=st.time_ns, returncode=st.returncode, signal=name,
            detail=f"killed by {name}",
        )
    detail = f"exited with code {st.returncode}"
    if st.returncode == 0:
        detail += " without a success marker"
    return Verdict(
        **base, cause=EXIT, exit_code=exit_code_for(st.returncode, policy),
        failed_at_ns=st.time_ns, returncode=st.returncode, detail=detail,
    )


def _vanished(obs: Observed, rank: int, seen_ns: int, policy: Policy) -> Verdict:
    return Verdict(
        **_base(obs, rank), cause=VANISHED, exit_code=policy.default_exit_code,
        failed_at_ns=seen_ns,
        detail="ended without a success marker (how is known only to its parent, not a "
        "watching rank: SIGKILL, OOM killer, os._exit...)",
    )


__all__ = [
    "COLLECTIVE_SETTLE_NS", "CONSEQUENCE_WINDOW_NS", "INTERRUPT_WINDOW_NS", "REMOTE_SETTLE_NS", "LEAVING_WAIT_NS",
    "UNREAD_RECHECK_NS", "Decision", "Observed", "Policy", "decide", "exit_code_for",
]
