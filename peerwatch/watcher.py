"""The watcher thread: the one place that wires sources -> decide -> teardown -> report.

Its loop only wires: wait for a source (:class:`peerwatch.observer.Observer`), observe,
decide (:func:`peerwatch.verdict.decide.decide`, pure), act on a verdict (a plan of ordered steps
from :mod:`peerwatch.verdict.plan`, pure, carried out by :mod:`peerwatch.executor`), report. When it
wakes and what is due is :class:`peerwatch.core.schedule.Schedule`'s answer.

Threads: the watcher thread (``peerwatch-rank<N>``) owns the observer, the schedule, the
per-beat chores and the flight-recorder dumps; how this rank ends is :attr:`Watcher.ending`'s
(:class:`peerwatch.ending.Ending` says who writes what). Threads talk through its events, its
settle condition and the wake pipe. :meth:`Watcher.stop` stops and joins every thread it started.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from functools import partial
from typing import Callable, List, Optional, Tuple

from . import executor, launchers
from .core.awake import AwakeClock
from .core.config import Config
from .core.records import (
    WATCHER_DEATH,
    Registration,
    Verdict,
    WatcherDeath,
    encode,
)
from .core.records import warm as warm_record_types
from .core.schedule import Schedule
from .diagnoser import Diagnoser
from .ending import Ending
from .hangs.frdump import FlightRecorderDump
from .hangs.heartbeat import HeartbeatWriter, OwnProgress
from .hosts import bridge, sharedfs
from .hosts.stragglerwatch import StragglerWatch
from .observer import Observer
from .proc.identity import local_ranks
from .proc.sources import pidfd_supported
from .rundir.eventlog import OwnRecords
from .rundir.eventlog import log as log_event
from .rundir.rundir import EVENTS, VERDICT_FILE, RunDir, rank_file
from .rundir.stacks import StackFile
from .verdict import decide, plan

logger = logging.getLogger("peerwatch")

POLL_FALLBACK_S = 0.1  # where pidfds or inotify are missing: how often we look instead
HANG_JUDGES = 2  # the lowest live local ranks judge hangs: O(N) heartbeat reads per host, not N^2
STALE_BEATS = 3  # a peer whose heartbeat is this many intervals old has a silent watcher


class Watcher:
    """Watches the local peers of one rank. Created and started by :func:`peerwatch.install`."""

    def __init__(
        self, config: Config, run_dir: RunDir, me: Registration, stacks: StackFile, interrupt_installed: bool,
    ) -> None:
        self.config = config
        self.run_dir = run_dir
        self.me = me
        self.rank = me.rank
        self.stacks = stacks
        self.interrupt_installed = interrupt_installed  # our signal handler raises PeerFailure in the main thread
        self.progress = OwnProgress(on_first_beat=self._arm_gil_watchdog)
        use_pidfd = config.use_pidfd and pidfd_supported()
        awake = AwakeClock.every(config.heartbeat_interval)  # its judges' clock (peerwatch.core.awake)
        remote = (sharedfs.RemoteWatch(run_dir, config.heartbeat_interval, config.peer_timeout, awake, config.exit_code)
                  if run_dir.shared else None)
        # This rank's own records (failure, success...) are written by whichever thread ends
        # it (see Ending), through their own writer, and read back by the observer like any other record.
        own_records = OwnRecords(run_dir, me)
        self.observer = Observer(run_dir, me, use_pidfd, remote, own_records, awake)
        self.heartbeat = HeartbeatWriter(run_dir, me, self.progress, with_position=config.hang_timeout.on,
                                         read_collectives=config.reads_collectives,
                                         measure_waits=config.stragglers, interval_s=config.heartbeat_interval)
        self._diagnoser = (Diagnoser(self.rank, config.hang_warn.seconds, self.observer, config.hang_timeout.auto,
                                     config.heartbeat_interval) if config.diagnoses_hangs else None)
        self._flight_recorder = FlightRecorderDump(run_dir, self.rank)  # evidence torch's analyzer reads
        self.thread = threading.Thread(target=self._main, name=f"peerwatch-rank{self.rank}", daemon=True)
        self._launcher_watch: Optional[launchers.LauncherWatch] = None  # set by start()
        self.bridge = bridge.Bridge.for_config(config, run_dir, me)  # other hosts, through the store
        self._policy = decide.Policy.from_config(config, other_hosts=bool(run_dir.shared) or self.bridge is not None)
        # What the watcher thread does on each heartbeat besides judging, in this order: Lightning's
        # observer gives way (rank 0 under Lightning), the bridge's turn, the straggler finding.
        self._chores: List[Callable[[], object]] = [partial(launchers.defer_lightning_observer, self.thread.is_alive)]
        if self.bridge is not None:
            self._chores.append(self.bridge.tick)
        if config.stragglers:
            watch = StragglerWatch(run_dir, me, config.heartbeat_interval, self.bridge is not None)
            self._chores.append(partial(_judge_stragglers, watch, self.rank, self.heartbeat, self.observer))
        self.ending = Ending(config, me, own_records, self.heartbeat, self.bridge, self.thread, self.observer.local.wake,
                             self.observer.local_pids)

    # -- control from other threads ------------------------------------------------

    def start(self) -> None:
        self.thread.start()
        self._launcher_watch = launchers.after_install(self.ending, self.config.exit_code)

    def children_changed(self) -> None:
        """This process forked (called right after, in the parent): list its children now."""
        self.heartbeat.children_changed.set()
        self.observer.local.wake()

    def publish_heartbeat(self) -> None:
        """Write this rank's heartbeat now (paused() calls it: the judges must not miss a pause)."""
        self.heartbeat.write(self.observer.local_pids)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop watching (this rank is done). Safe to call from any thread, more than once;
        joins the threads it started (not itself)."""
        e = self.ending
        if not e.done.is_set() and not e.verdict_seen.is_set():
            e.final_heartbeat()  # the step it finished at
        e.done.set()
        self.observer.local.wake()
        if self.config.gil_timeout is not None and not e.verdict_seen.is_set():
            self.stacks.cancel_timer()
        if self.bridge is not None:
            self.bridge.stop()
        self.heartbeat.stop()
        self.observer.local.stop()
        if self._launcher_watch is not None:
            self._launcher_watch.stop()
        if threading.current_thread() is not self.thread and self.thread.is_alive():
            self.thread.join(timeout)

    def left_in_store(self) -> bool:
        """After :meth:`stop`: is a thread of the store bridge still inside a store request
        (torch's C++ client, the GIL released)? It must not wake while Python finalizes."""
        return self.bridge is not None and bool(self.bridge.left_in_store)

    # -- the thread ----------------------------------------------------------------

    def _main(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - the watcher must never die silently
            logger.exception(
                "peerwatch: the watcher of rank %d failed; this rank is NOT protected any more "
                "(training goes on)", self.rank,
            )
            record_death(self.run_dir, self.rank, e)

    def _run(self) -> None:
        obs = self.observer
        sched = self._schedule()
        warm_record_types()  # now, not at a teardown
        while not self.ending.done.is_set():
            now = time.monotonic()
            beat = sched.beat_due(now)
            judge_hang = judge_remote = False
            if beat:
                judge_hang, judge_remote = self._on_beat()
            unsure = obs.local.unsure() or obs.unread  # a peer or a record could not be told (EMFILE...): soon again
            full_look = sched.full_look(beat, judge_remote, unsure)
            requested = self.ending.looks_asked()
            woken = obs.local.wait(sched.timeout(now, judge_remote, unsure))
            if self.ending.done.is_set():
                break
            obs.awake.tick(time.monotonic_ns())  # a turn that took too long: this thread was not running
            self.ending.note_interrupt()
            if self.heartbeat.children_changed.is_set():
                self.heartbeat.write(obs.local_pids)
            lost = self.run_dir.lost(EVENTS)  # on every turn: a rank must say at once that it is unprotected
            if lost is not None:
                self._stop_judging(lost)
                return
            looked, now = woken or full_look, time.monotonic()
            # Not while the registrations could not all be read: one may be among those missed.
            missing = self._missing_ranks() if not obs.unread and sched.startup_over(now, obs.awake.since_ns / 1e9) else ()
            # An idle turn (a heartbeat, nothing seen, nothing due) has nothing to judge.
            if looked or judge_hang or missing or sched.due(now):
                if looked:
                    obs.scan()
                verdict = self._judge(sched, judge_hang, judge_remote, missing)
                if verdict is not None:
                    self._act(verdict)
                    return
                self._flight_recorder.on_diagnosis(obs.diagnosis())  # a stall: each rank dumps, once
                obs.flush()
                self.ending.peer_failure_known = obs.peer_failed()
            self.ending.looked(requested)

    def _stop_judging(self, how: str) -> None:
        """The run directory is gone: no success marker, failure record or acknowledgement
        can be written or read any more, so a peer's end proves nothing. Judging on would
        tear down a healthy job (a rank that finished cleanly could not say so); stop, and
        say loudly that this rank is unprotected."""
        if self.config.gil_timeout is not None:
            self.stacks.cancel_timer()
        logger.error(
            "peerwatch: rank %d is NOT protected any more: its run directory %s %s while the job runs (a /tmp "
            "cleaner?). No record can be written or read there, so this rank stops watching its peers (a peer that "
            "ends from now on is not taken for failed, and a failure is not acted on); training goes on. Give the job "
            "a PEERWATCH_DIR that nothing cleans up while it runs.", self.rank, self.run_dir.path, how,
        )

    def _schedule(self) -> Schedule:
        """Start the folder watch; when the loop wakes follows from what it can watch."""
        shared = self.observer.remote is not None
        inotify = self.observer.local.start(folders_disabled=shared and sharedfs.inotify_disabled())
        use_pidfd = self.observer.local.use_pidfd
        if not use_pidfd:
            logger.info("peerwatch: pidfd is unavailable; rank %d checks its peers every %gs", self.rank, POLL_FALLBACK_S)
        # Shared filesystem: inotify is blind to other hosts anyway; the judges poll and
        # every rank rescans once a heartbeat, with or without inotify.
        fallback = not use_pidfd or (not inotify and not shared)
        return Schedule(
            time.monotonic(), self.config.heartbeat_interval, fallback_s=POLL_FALLBACK_S if fallback else None,
            remote_s=sharedfs.POLL_S if shared else None, startup_s=self.config.startup_timeout,
        )

    def _arm_gil_watchdog(self) -> None:
        """gil_timeout's watchdog, (re-)armed every heartbeat from the rank's first step on,
        and at its first ``beat()`` by the training thread itself (its next step may hold
        the GIL before the watcher runs again). Not before: a rank that imports and loads
        holds the GIL in one call for seconds on a loaded machine (``import torch``)."""
        if self.config.gil_timeout is not None and not self.ending.verdict_seen.is_set():
            self.stacks.arm_gil_watchdog(self.config.gil_timeout)

    def _on_beat(self) -> Tuple[bool, bool]:
        """Heartbeat, GIL watchdog, the chores; whether this rank judges hangs and other hosts."""
        self.heartbeat.write(self.observer.local_pids, read_counters=True)
        if self.heartbeat.training():
            self._arm_gil_watchdog()
        for chore in self._chores:
            chore()
        # Diagnosis: judged only once this rank's collectives count (torch.distributed in use).
        diagnosing = self._diagnoser is not None and self.heartbeat.counts_collectives()
        hang, remote = self.config.hang_timeout.on or diagnosing, self.observer.remote is not None
        if not (hang or remote):
            return False, False  # nothing to judge: no need to know who the judges are
        judge = self.rank in self.observer.live_local_ranks()[:HANG_JUDGES]
        return hang and judge, remote and judge

    def _judge(self, sched: Schedule, judge_hang: bool, judge_remote: bool, missing: Tuple[int, ...]) -> Optional[Verdict]:
        """Decide from what was observed; the verdict to act on."""
        self.observer.judge_remote(read=judge_remote)
        # decide() is pure, and tells us when the mere passing of time could change its
        # answer (recheck_at_ns, on the wall clock: converted to our monotonic one).
        observed = self._observed(judge_hang, missing)
        if judge_hang and self._diagnoser is not None:
            observed = dataclasses.replace(observed, diagnosis=self._diagnoser.look(observed))
        decision = decide.decide(observed, self._policy)
        sched.recheck = _monotonic(decision.recheck_at_ns)
        verdict = decision.verdict
        # Across hosts, an exception may be the echo of a death elsewhere: hold it back
        # a moment (deciding again meanwhile) for that host's verdict through the store.
        sched.hold = self.bridge.hold_until(verdict) if self.bridge is not None and verdict else None
        if sched.hold is not None and time.monotonic() < sched.hold:
            return None
        return verdict

    def _observed(self, judge_hang: bool, missing: Tuple[int, ...]) -> decide.Observed:
        stale = STALE_BEATS * self.config.heartbeat_interval
        own = self.heartbeat.published() if judge_hang else None
        return self.observer.observed(self.progress if judge_hang else None, missing, stale, own)

    def _missing_ranks(self) -> Tuple[int, ...]:
        """Ranks expected on this host that have not registered by startup_timeout (to fail
        on with startup_action=fail; logged either way)."""
        c = self.config
        regs = self.observer.registrations
        missing, why = plan.missing_ranks(c.local_world_size, c.world_size, set(local_ranks(regs)), set(regs))
        if why:
            logger.warning("peerwatch: %s within startup_timeout=%gs%s", why, c.startup_timeout,
                           "; failing the job (startup_action=fail)" if missing and c.startup_action == "fail" else "")
        return missing if c.startup_action == "fail" else ()

    # -- the verdict ---------------------------------------------------------------

    def _act(self, verdict: Verdict) -> None:
        """Publish the verdict, plan this rank's share of the teardown (pure), carry it out."""
        verdict, wrote = self._publish(verdict)
        log_event("verdict_seen", self.rank, failed_rank=verdict.rank, wrote_verdict=wrote)
        c = self.config
        situation = plan.Situation(
            self_rank=self.rank, failed_rank=verdict.rank, cause=verdict.cause, verdict_exit_code=verdict.exit_code,
            own_exit_code=self.ending.failed_code, in_watch=self.ending.in_watch > 0,
            live_local_ranks=tuple(self.observer.live_local_ranks()), wrote_verdict=wrote,
            grace_s=c.grace, ack_window_s=c.ack_window,
            failed_rank_speaks=executor.failed_rank_speaks(self.observer, self.rank, verdict),
            ends_workers_early=launchers.ends_workers_early(self.me, verdict),
            other_hosts=self.bridge is not None, on_verdict=c.on_verdict is not None,
        )
        executor.carry_out(executor.Teardown(
            on_verdict=c.on_verdict, on_verdict_timeout_s=c.on_verdict_timeout, run_dir=self.run_dir, me=self.me,
            observer=self.observer, stacks=self.stacks, flight_recorder=self._flight_recorder, bridge=self.bridge, main_left=self.ending.main_left,
            interrupt_installed=self.interrupt_installed, heartbeat=self.heartbeat,
            verdict=verdict, situation=situation, plan=plan.plan(situation),
        ))

    def _publish(self, verdict: Verdict) -> Tuple[Verdict, bool]:
        """Write the verdict (first writer wins) and make it known in this process."""
        obs = self.observer
        wrote = False
        if not isinstance(obs.events.get(VERDICT_FILE), Verdict):
            wrote = obs.write_event(VERDICT_FILE, verdict)
            if not wrote:
                existing = self.run_dir.read(EVENTS, VERDICT_FILE, Verdict)
                verdict = existing if existing is not None else verdict
        obs.flush()  # how the dead rank ended, for its peers and the report
        self.ending.known(verdict)
        return verdict, wrote


def record_death(run_dir: RunDir, rank: int, error: BaseException) -> None:
    """Say in the run directory that rank ``rank``'s watcher died of ``error``, for
    ``peerwatch status`` (and people): the log may be long gone when someone looks. Never
    raises: the watcher is already dying, and the training must go on."""
    try:
        death = WatcherDeath(rank=rank, pid=os.getpid(), time_ns=time.time_ns(), exception=type(error).__name__,
                             message=str(error)[:2000])
        run_dir.write(EVENTS, rank_file(WATCHER_DEATH, rank), encode(death), replace=True)
    except Exception as e:  # noqa: BLE001
        logger.error("peerwatch: rank %d could not record in %s that its watcher died: %s", rank, run_dir.path, e)


def _judge_stragglers(watch: StragglerWatch, rank: int, heartbeat: HeartbeatWriter, observer: Observer) -> None:
    """A chore: once a slot, on the lowest live local rank, who the others wait for."""
    if not heartbeat.counts_collectives():
        return
    live = observer.live_local_ranks()
    if live[:1] == [rank]:
        watch.tick(heartbeat.published(), {r: observer.peers[r].reg for r in live[1:] if r in observer.peers})


def _monotonic(wall_ns: Optional[int]) -> Optional[float]:
    """A ``time.time_ns()`` deadline as a ``time.monotonic()`` one."""
    if wall_ns is None:
        return None
    return time.monotonic() + (wall_ns - time.time_ns()) / 1e9


__all__ = ["Watcher", "record_death"]
