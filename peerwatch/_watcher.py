"""The watcher thread: the one place that wires sources -> decide -> teardown -> report.

It sleeps in ``poll(2)`` on the pidfds of its local peers and on a wake pipe that the
inotify observer (and the API) write to. Every wake rescans what changed in the run
directory, asks :func:`decide`, and on a verdict runs the teardown.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import select
import sys
import threading
import time
from typing import IO, Dict, List, Optional, Set, Tuple

from . import _bridge, _decide, _identity, _launchers, _report, _rundir, _sharedfs, _teardown
from ._config import Config
from ._records import (
    HANG,
    MAX_TRACEBACK_CHARS,
    Ack,
    ExitStatus,
    Failure,
    Heartbeat,
    Registration,
    Success,
    Verdict,
    decode,
    encode,
)
from ._rundir import EVENTS, HEARTBEATS, RANKS, VERDICT_FILE, RunDir, rank_file
from ._sources import (
    FolderWatch,
    Peer,
    child_returncode,
    fatal_signal_in,
    gil_timeout_in,
    is_local,
    oom_kill_count,
    pidfd_supported,
)

logger = logging.getLogger("peerwatch")

POLL_FALLBACK_S = 0.1  # where pidfds or inotify are missing: how often we look instead
CHILDREN_SCAN_EVERY = 10  # heartbeats between snapshots of our own descendants (costs a /proc walk)
SAFETY_LOOK_EVERY = 10  # heartbeats between full looks at the run directory that nothing asked for
HANG_JUDGES = 2  # the lowest live local ranks judge hangs: O(N) heartbeat reads per host, not N^2
# After a verdict, the lowest live local ranks (not the failed one) enforce it: signal the
# peers that did not acknowledge, and rewrite the report. Every rank doing so made the
# teardown O(N^2) (N=128: 11-14 s of CPU on 2 cores); three keep it O(N) with spares for a
# frozen enforcer.
ENFORCERS = 3

_EVENT_TYPES = {"success": Success, "failure": Failure, "exit": ExitStatus, "ack": Ack}


class Watcher:
    """Watches the local peers of one rank. Created and started by :func:`peerwatch.install`."""

    def __init__(self, config: Config, run_dir: RunDir, me: Registration, stack_file: Optional[IO[str]]) -> None:
        self.config = config
        self.run_dir = run_dir
        self.me = me
        self.rank = me.rank
        self.stack_file = stack_file
        self.verdict: Optional[Verdict] = None
        self.verdict_seen = threading.Event()
        self.stopped = threading.Event()
        self.in_watch = 0
        self.interrupt_installed = False
        self.own_exit_code: Optional[int] = None  # set when this rank records its own failure
        self.succeeded = False
        # Progress, written by beat() in the training thread; published by the heartbeat.
        self.step: Optional[int] = None
        self.progress_ns: Optional[int] = None
        self.paused = 0
        self._use_pidfd = config.use_pidfd and pidfd_supported()
        self._policy = _decide.Policy(
            parent_wait_ns=int(config.parent_wait * 1e9), default_exit_code=config.exit_code,
            hang_timeout_ns=int(config.hang_timeout * 1e9),
            peer_timeout_ns=int(config.peer_timeout * 1e9) if run_dir.shared else 0,
        )
        # Shared-filesystem mode (_sharedfs): the judges' view of the other hosts' heartbeats.
        self._remote: Optional[_sharedfs.RemoteWatch] = (
            _sharedfs.RemoteWatch(run_dir, config.heartbeat_interval, config.peer_timeout) if run_dir.shared else None
        )
        self._heartbeat_lock = threading.Lock()
        self._beat_file = _rundir.InPlace(run_dir, HEARTBEATS, rank_file("rank", me.rank))
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
            os.set_inheritable(fd, False)
        self._poller = select.poll()
        self._poller.register(self._wake_r, select.POLLIN)
        self._fd_rank: Dict[int, int] = {}
        self._peers: Dict[int, Peer] = {}
        self._gone: Dict[int, int] = {}
        self._registrations: Dict[int, Registration] = {me.rank: me}
        self._seen: Dict[str, Dict[str, int]] = {RANKS: {}, EVENTS: {}}  # name -> inode
        self._events: Dict[str, object] = {}
        self._oom_kills_at_start = oom_kill_count()
        self._heartbeat_seq = 0
        # Exit statuses learnt in the main loop, written after deciding: the parent of a dead
        # rank is the one that can judge at once, and the write would only delay it.
        self._unwritten: List[Tuple[str, ExitStatus]] = []
        self._children: tuple = ()
        self._children_dirty = False  # set from the forking thread: list our children again now
        self._folders: Optional[FolderWatch] = None
        # settle(): the training thread asks for one full look before it judges an exception.
        self._cond = threading.Condition()
        self._settle_requested = 0
        self._settled = 0
        self.thread = threading.Thread(target=self._main, name=f"peerwatch-rank{self.rank}", daemon=True)
        self.bridge = _bridge.Bridge.for_config(config, run_dir, me)  # other hosts, through the store

    # -- control from other threads ------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is full: the watcher will wake anyway

    def children_changed(self) -> None:
        """This process forked (called right after, in the parent): refresh the heartbeat's
        child list now. Cheap: a flag and a byte down the wake pipe."""
        self._children_dirty = True
        self.wake()

    def settle(self, timeout: float) -> None:
        """Wait until the watcher has taken one full look at its sources (or has a verdict).

        Called from the training thread when it is about to fail: a peer that died just
        before (its pidfd already fired) is then known, so the exception can be told
        apart as a consequence (gloo's "connection reset") rather than a root cause.
        """
        if threading.current_thread() is self.thread or not self.thread.is_alive():
            return
        with self._cond:
            self._settle_requested += 1
            wanted = self._settle_requested
        self.wake()
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._settled < wanted and not self.verdict_seen.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)

    def peer_failed(self) -> bool:
        """True if this watcher knows of a failure of another rank (judged or not yet)."""
        if self.verdict is not None:
            return self.verdict.rank != self.rank
        if self._gone:
            return True
        return any(
            isinstance(r, (Failure, ExitStatus)) and r.rank != self.rank for r in list(self._events.values())
        )

    def stop(self, timeout: float = 5.0) -> None:
        """Stop watching (this rank is done). Safe to call from any thread, more than once."""
        self.stopped.set()
        self.wake()
        if self.bridge is not None:
            self.bridge.stop()
        if self.config.gil_timeout and not self.verdict_seen.is_set():
            faulthandler.cancel_dump_traceback_later()
        if self._folders is not None:
            self._folders.stop()
        if threading.current_thread() is not self.thread and self.thread.is_alive():
            self.thread.join(timeout)

    # -- the thread ----------------------------------------------------------------

    def _main(self) -> None:
        try:
            self._run()
        except BaseException:  # noqa: BLE001 - the watcher must never die silently
            logger.exception(
                "peerwatch: the watcher of rank %d failed; this rank is NOT protected any more "
                "(training goes on)", self.rank,
            )

    def _run(self) -> None:
        rd = self.run_dir
        self._folders = FolderWatch(
            [rd.join(EVENTS), rd.join(RANKS)], self.wake, name=f"peerwatch-inotify-rank{self.rank}",
            disabled=self._remote is not None and _sharedfs.inotify_disabled(),
        )
        fallback = not (self._folders.active and self._use_pidfd)
        if self._remote is not None and self._use_pidfd:
            # Shared filesystem: inotify is blind to other hosts anyway; the judges poll
            # (below) and every rank rescans once a heartbeat, with or without inotify.
            fallback = False
        if not self._use_pidfd:
            logger.info("peerwatch: pidfd is unavailable; rank %d checks its peers every %gs", self.rank, POLL_FALLBACK_S)
        recheck_ns: Optional[int] = None
        next_beat = 0.0
        beats = 0
        # Look at once: every peer may have registered before our inotify watch began,
        # and nothing would wake us until the first heartbeat.
        first_look = True
        startup_deadline = time.monotonic() + self.config.startup_timeout if self.config.startup_timeout else None
        judge_remote = False  # shared filesystem: this rank polls for the other hosts' records
        while not self.stopped.is_set():
            now = time.monotonic()
            judge_hang = full_look = False
            if now >= next_beat:
                self._heartbeat()
                self._arm_gil_watchdog()
                if self.bridge is not None:
                    self.bridge.tick()
                next_beat = now + self.config.heartbeat_interval
                judge_hang = self._is_hang_judge()
                judge_remote = self._remote is not None and self._is_local_judge()
                beats += 1
                # inotify and pidfds wake us for every change; this look is the safety net.
                # On a shared filesystem inotify is blind to the other hosts: every beat.
                full_look = self._remote is not None or beats % SAFETY_LOOK_EVERY == 0
            full_look = full_look or fallback or judge_remote
            timeout = next_beat - now
            if judge_remote:
                timeout = min(timeout, _sharedfs.POLL_S)
            if recheck_ns is not None:
                timeout = min(timeout, (recheck_ns - time.time_ns()) / 1e9)
            if fallback:
                timeout = min(timeout, POLL_FALLBACK_S)
            if first_look:
                timeout, first_look, full_look = 0.0, False, True
            with self._cond:
                requested = self._settle_requested
            woken = self._poll(timeout, defer_writes=True)
            if self.stopped.is_set():
                break
            if self._children_dirty:
                self._heartbeat()
            if woken or full_look:
                self._scan()
            missing: Tuple[int, ...] = ()
            if startup_deadline is not None and time.monotonic() >= startup_deadline:
                startup_deadline = None
                missing = self._missing_ranks()
            if judge_remote and self._remote is not None:
                self._remote.read(self._registrations, self._ended_ranks())
            due = recheck_ns is not None and time.time_ns() >= recheck_ns
            if woken or full_look or judge_hang or missing or due:
                # Nothing else changes what decide() answers: it is pure, and tells us when
                # the mere passing of time could change its answer (recheck_at_ns).
                decision = _decide.decide(self._observed(judge_hang, missing), self._policy)
                if decision.lost:
                    # Shared filesystem: say on the lost ranks' behalf that they are lost
                    # (first record wins), then decide again from what is written.
                    self._record_lost(decision.lost)
                    decision = _decide.decide(self._observed(judge_hang, missing), self._policy)
                recheck_ns = decision.recheck_at_ns
                # Across hosts, an exception may be the echo of a death elsewhere: hold it back
                # a moment (deciding again meanwhile) for that host's verdict through the store.
                verdict = decision.verdict
                hold = self.bridge.hold_until(verdict) if self.bridge is not None and verdict else None
                if hold is not None and time.monotonic() < hold:
                    hold_ns = time.time_ns() + int((hold - time.monotonic()) * 1e9)  # recheck_ns: wall clock still
                    recheck_ns = hold_ns if recheck_ns is None else min(recheck_ns, hold_ns)
                elif verdict is not None:
                    self._act(verdict)
                    return
            self._write_unwritten()
            with self._cond:
                self._settled = max(self._settled, requested)
                self._cond.notify_all()

    def _poll(self, timeout: float, defer_writes: bool = False) -> bool:
        """Sleep until a source fires or ``timeout``; True if something woke us."""
        events = self._poller.poll(max(0, int(timeout * 1000) + 1))
        for fd, _ in events:
            if fd == self._wake_r:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            elif fd in self._fd_rank:
                self._peer_gone(self._fd_rank[fd], defer_writes)
        return bool(events)

    def _peer_gone(self, rank: int, defer_writes: bool = False) -> None:
        peer = self._peers.get(rank)
        if peer is None or rank in self._gone:
            return
        self._gone[rank] = time.time_ns()
        if peer.pidfd is not None:
            self._poller.unregister(peer.pidfd)
            self._fd_rank.pop(peer.pidfd, None)
        peer.alive = False
        peer.close()
        # Only a parent can learn how its child ended; failing that, faulthandler's last
        # words in the rank's stack file name a fatal signal. Tell everyone.
        returncode = child_returncode(peer.reg.pid) if peer.reg.ppid == os.getpid() else None
        dump = b""
        if returncode is None:
            dump = self.run_dir.read_bytes(_rundir.STACKS, rank_file("rank", rank, ".txt"), limit=1 << 20) or b""
            signum = fatal_signal_in(dump)
            returncode = -signum if signum else None
        starved = gil_timeout_in(dump) if returncode is None else None
        if starved is not None:
            # Its own GIL watchdog ended it: the rank was stuck with the GIL held.
            failure = Failure(
                rank=rank, pid=peer.reg.pid, time_ns=self._gone[rank], cause=HANG,
                message=f"its watcher could not run for {starved} (the GIL was held, e.g. by C code); "
                "faulthandler's gil_timeout watchdog ended it",
                traceback=dump.decode("utf-8", "replace")[-MAX_TRACEBACK_CHARS:],
            )
            self._write_event(rank_file("failure", rank), failure)
            self._events.setdefault(rank_file("failure", rank), failure)
        if returncode is not None:
            status = ExitStatus(
                rank=rank, pid=peer.reg.pid, time_ns=self._gone[rank], returncode=returncode, observed_by=self.rank,
            )
            self._events.setdefault(rank_file("exit", rank), status)
            self._unwritten.append((rank_file("exit", rank), status))
            if not defer_writes:
                self._write_unwritten()

    def _write_unwritten(self) -> None:
        while self._unwritten:
            name, record = self._unwritten.pop(0)
            self._write_event(name, record)

    def _scan(self) -> None:
        rd = self.run_dir
        for name in self._changed(RANKS):
            parsed = _rundir.parse_rank_file(name)
            if parsed is None or parsed[0] != "rank" or parsed[1] == self.rank:
                continue
            reg = rd.read(RANKS, name, Registration)
            if reg is not None and reg.rank == parsed[1]:
                self._add_peer(reg)
        for name in self._changed(EVENTS):
            if name == VERDICT_FILE:
                record: object = rd.read(EVENTS, name, Verdict)
            else:
                parsed = _rundir.parse_rank_file(name)
                cls = _EVENT_TYPES.get(parsed[0]) if parsed else None
                if parsed is None or cls is None:
                    continue
                record = rd.read(EVENTS, name, cls)
                if record is not None and getattr(record, "rank", None) != parsed[1]:
                    rd.warn_once(rd.join(EVENTS, name), "names another rank than its file name; ignored")
                    record = None
            if record is not None:
                self._events[name] = record
        if not self._use_pidfd:
            for rank, peer in self._peers.items():
                if rank not in self._gone and not peer.check_alive():
                    self._peer_gone(rank)

    def _changed(self, sub: str) -> List[str]:
        seen = self._seen[sub]
        changed = []
        try:
            with os.scandir(self.run_dir.join(sub)) as it:
                for entry in it:
                    if seen.get(entry.name) != entry.inode():
                        seen[entry.name] = entry.inode()
                        changed.append(entry.name)
        except OSError as e:
            self.run_dir.warn_once(self.run_dir.join(sub), f"cannot be listed ({e.strerror})")
        return changed

    def _add_peer(self, reg: Registration) -> None:
        old = self._registrations.get(reg.rank)
        if old is not None and (old.pid, old.start_ticks) == (reg.pid, reg.start_ticks):
            return
        if reg.rank in self._peers:
            self.run_dir.warn_once(
                self.run_dir.join(RANKS, rank_file("rank", reg.rank)),
                f"re-registered rank {reg.rank} as pid {reg.pid}; keeping the first registration (pid {old.pid if old else '?'})",
            )
            return
        self._registrations[reg.rank] = reg
        if not is_local(reg):
            return  # another host's rank: not ours to watch through the OS
        if reg.uid != os.geteuid():
            self.run_dir.warn_once(
                self.run_dir.join(RANKS, rank_file("rank", reg.rank)), f"belongs to uid {reg.uid}; not watched"
            )
            return
        peer = Peer(reg, self._use_pidfd)
        self._peers[reg.rank] = peer
        if not peer.alive:
            self._peer_gone(reg.rank)
        elif peer.pidfd is not None:
            self._fd_rank[peer.pidfd] = reg.rank
            self._poller.register(peer.pidfd, select.POLLIN)

    def _missing_ranks(self) -> Tuple[int, ...]:
        """Ranks expected on this host that have not registered. Expected: ranks
        0..local_world_size-1 when the launcher says how many run here, else all of
        world_size (one host)."""
        expected = self.config.local_world_size or self.config.world_size
        if not expected:
            logger.warning("peerwatch: startup_timeout is set but neither LOCAL_WORLD_SIZE nor WORLD_SIZE says how many ranks to expect")
            return ()
        local = {r for r, reg in self._registrations.items() if is_local(reg)}
        if len(local) >= expected:
            return ()
        if self.config.local_world_size and self.config.world_size and self.config.local_world_size < self.config.world_size:
            logger.warning(
                "peerwatch: only %d of %d local ranks registered within %gs (registered: %s)",
                len(local), expected, self.config.startup_timeout, sorted(local),
            )
            return ()  # which global ranks belong here is not known: warn only
        missing = tuple(r for r in range(expected) if r not in self._registrations)
        logger.warning(
            "peerwatch: rank(s) %s did not register within startup_timeout=%gs%s",
            ", ".join(map(str, missing)), self.config.startup_timeout,
            "; failing the job (startup_action=fail)" if self.config.startup_action == "fail" else "",
        )
        return missing if self.config.startup_action == "fail" else ()

    def _live_local_ranks(self) -> List[int]:
        """This host's ranks (ours included) not gone and not finished, lowest first."""
        finished = {r.rank for r in self._events.values() if isinstance(r, Success)}
        return sorted(
            r for r in self._registrations
            if r not in self._gone and r not in finished and (r == self.rank or r in self._peers)
        )

    def _is_hang_judge(self) -> bool:
        return bool(self.config.hang_timeout) and self.rank in self._live_local_ranks()[:HANG_JUDGES]

    # -- shared filesystem (_sharedfs) ------------------------------------------------

    def _is_local_judge(self) -> bool:
        """One of the two lowest live local ranks not yet finished: they poll for the other
        hosts' records and judge their heartbeats (two readers per host, whatever its size)."""
        return self.rank in self._live_local_ranks()[:HANG_JUDGES]

    def _ended_ranks(self) -> Set[int]:
        """Ranks with a record of how they ended (success, failure, exit status)."""
        return {r.rank for r in self._events.values() if isinstance(r, (Success, Failure, ExitStatus))}

    def _record_lost(self, lost: Tuple[Failure, ...]) -> None:
        for failure in lost:
            name = rank_file("failure", failure.rank)
            if self._write_event(name, failure):
                logger.error("peerwatch: rank %d declares rank %d lost: %s", self.rank, failure.rank, failure.message)
                self._events.setdefault(name, failure)
            else:
                existing = self.run_dir.read(EVENTS, name, Failure)
                if existing is not None:
                    self._events[name] = existing

    def _remote_silence(self) -> Dict[int, int]:
        return self._remote.silence() if self._remote is not None else {}

    # -----------------------------------------------------------------------------------

    def _progress(self) -> Dict[int, _decide.Progress]:
        """Every live local rank's last progress, from its heartbeat (ours from memory)."""
        where, waiting = main_thread_position()
        found = {
            self.rank: _decide.Progress(
                self.step, self.progress_ns, self.paused > 0, "R", in_collective=waiting, where=where
            )
        }
        for rank, peer in self._peers.items():
            if rank in self._gone:
                continue
            beat = self.run_dir.read(HEARTBEATS, rank_file("rank", rank), Heartbeat)
            info = _identity.probe(peer.reg.pid)
            state = info.state if info is not None and info.start_ticks == peer.reg.start_ticks else "?"
            if beat is None or beat.pid != peer.reg.pid:
                found[rank] = _decide.Progress(None, None, False, state)
            else:
                silent = time.time_ns() - beat.time_ns > 3e9 * self.config.heartbeat_interval
                found[rank] = _decide.Progress(
                    beat.step, beat.progress_ns, beat.paused, state,
                    in_collective=beat.in_collective, watcher_silent=silent, where=beat.where,
                )
        return found

    def _arm_gil_watchdog(self) -> None:
        """With gil_timeout: if this thread cannot run for that long, faulthandler's C thread
        dumps every stack into our stack file and ends the process."""
        if self.config.gil_timeout and self.stack_file is not None and not self.verdict_seen.is_set():
            faulthandler.dump_traceback_later(self.config.gil_timeout, exit=True, file=self.stack_file)

    def _observed(self, with_progress: bool = False, missing: Tuple[int, ...] = ()) -> _decide.Observed:
        successes: Set[int] = set()
        failures: Dict[int, Failure] = {}
        statuses: Dict[int, ExitStatus] = {}
        verdict = None
        for record in self._events.values():
            if isinstance(record, Success):
                successes.add(record.rank)
            elif isinstance(record, Failure):
                failures[record.rank] = record
            elif isinstance(record, ExitStatus):
                statuses[record.rank] = record
            elif isinstance(record, Verdict):
                verdict = record
        return _decide.Observed(
            self_rank=self.rank, now_ns=time.time_ns(), registrations=self._registrations,
            successes=successes, failures=failures, exit_statuses=statuses, gone=self._gone,
            verdict=verdict, oom_kills=self._oom_kills_since_start(),
            progress=self._progress() if with_progress else {}, now_mono_ns=time.monotonic_ns(), missing=missing,
            remote_silence=self._remote_silence(),
        )

    def _oom_kills_since_start(self) -> int:
        if self._oom_kills_at_start is None or not (self._gone or self._events):
            return 0
        now = oom_kill_count()
        return 0 if now is None else max(0, now - self._oom_kills_at_start)

    def _write_event(self, name: str, record: object) -> bool:
        cls = type(record)
        try:
            return self.run_dir.write(
                EVENTS, name, encode(record), valid=lambda data: decode(cls, data) is not None
            )
        except OSError as e:
            logger.error("peerwatch: rank %d could not write %s: %s", self.rank, name, e)
            return False

    def publish_heartbeat(self) -> None:
        """Write this rank's heartbeat now (paused() calls it: the judges must not miss a pause)."""
        self._heartbeat()

    def _heartbeat(self) -> None:
        with self._heartbeat_lock:
            self._write_heartbeat()

    def _write_heartbeat(self) -> None:
        self._heartbeat_seq += 1
        if self._children_dirty or self._heartbeat_seq % CHILDREN_SCAN_EVERY == 1:
            self._children_dirty = False
            exclude = {r.pid for r in self._registrations.values() if is_local(r)}
            self._children = tuple(_teardown.descendants(os.getpid(), os.geteuid(), exclude))
        where, waiting = main_thread_position() if self.config.hang_timeout else ("", False)
        beat = Heartbeat(
            rank=self.rank, pid=os.getpid(), time_ns=time.time_ns(), seq=self._heartbeat_seq,
            step=self.step, progress_ns=self.progress_ns, paused=self.paused > 0, children=self._children,
            where=where, in_collective=waiting,
        )
        try:
            if self._remote is not None:
                # Shared filesystem: temp file + close + rename. Other hosts read it through
                # NFS close-to-open consistency: a reader that opens it after the rename sees
                # the whole new record; an in-place write could be seen torn or stale.
                self.run_dir.write(HEARTBEATS, rank_file("rank", self.rank), encode(beat), replace=True)
            else:
                self._beat_file.write(encode(beat))
        except OSError as e:
            self.run_dir.warn_once(self.run_dir.join(HEARTBEATS), f"heartbeat cannot be written ({e.strerror})")

    # -- the verdict ---------------------------------------------------------------

    def _act(self, verdict: Verdict) -> None:
        made = False
        if not isinstance(self._events.get(VERDICT_FILE), Verdict):
            made = self._write_event(VERDICT_FILE, verdict)
            if not made:
                existing = self.run_dir.read(EVENTS, VERDICT_FILE, Verdict)
                verdict = existing if existing is not None else verdict
        self._write_unwritten()  # how the dead rank ended, for its peers and the report
        self.verdict = verdict
        self.verdict_seen.set()
        with self._cond:
            self._cond.notify_all()
        started = time.monotonic()
        self._arm_last_resort()
        mine = verdict.rank == self.rank
        in_watch = self.in_watch > 0 and not mine
        # The main thread leaves by itself (its own exception, or PeerFailure): we only
        # enforce a deadline. A hung rank's main thread is stuck: it does not stay.
        stay = (mine and verdict.cause != HANG) or in_watch
        deadline = started + (self.config.grace if stay else 0.0)
        code = (self.own_exit_code or verdict.exit_code) if mine else verdict.exit_code
        self._write_event(
            rank_file("ack", self.rank),
            Ack(rank=self.rank, pid=os.getpid(), time_ns=time.time_ns(), deadline_ns=int(deadline * 1e9)),
        )
        if self.bridge is not None:
            self.bridge.on_verdict(verdict)  # other hosts tear down too (at most ~1 s; after our ack)
        if not mine:
            logger.error(
                "peerwatch: rank %d%s %s; cause: %s. Tearing down rank %d (pid %d), exit code %d.",
                verdict.rank, f" (pid {verdict.pid} on {verdict.host})" if verdict.pid else "",
                verdict.detail, verdict.cause, self.rank, os.getpid(), code,
            )
        _launchers.on_verdict(self, verdict)  # Lightning's observer must not SIGKILL us meanwhile
        self._dump_own_stacks()
        if in_watch:
            _teardown.raise_in_main_thread(_peer_failure_type(), self.interrupt_installed)
        enforcer = self._is_enforcer(verdict)
        if enforcer:
            self._tear_down_peers(verdict)
        if not stay:
            self._tear_down_own_children()
        if enforcer or made:
            self._finish(verdict, made)
        if stay:
            # The main thread is leaving by itself (PeerFailure, or its own exception);
            # at exit it sets `stopped` and waits for us. If it is stuck, we end it.
            if not self.stopped.wait(max(0.0, deadline - time.monotonic())):
                logger.error(
                    "peerwatch: rank %d did not leave within %gs of the verdict; exiting with code %d",
                    self.rank, self.config.grace, code,
                )
            self._tear_down_own_children()
        _launchers.before_exit(self, verdict)  # under torchrun: let the agent see the failed worker first
        _teardown.flush_and_exit(code)

    def _arm_last_resort(self) -> None:
        """Once teardown has begun this process ends, even if this thread never runs again
        (the main thread holding the GIL in C): faulthandler's C thread needs no GIL."""
        if self.stack_file is None:
            return
        budget = self.config.ack_window + 3 * self.config.grace + 2.0
        try:
            faulthandler.dump_traceback_later(budget, exit=True, file=self.stack_file)
        except (OSError, ValueError, RuntimeError):
            pass

    def _dump_own_stacks(self) -> None:
        if self.stack_file is None:
            return
        try:
            faulthandler.dump_traceback(self.stack_file, all_threads=True)
            self.stack_file.flush()
        except (OSError, ValueError):
            pass

    def _is_enforcer(self, verdict: Verdict) -> bool:
        """One of the lowest live local ranks; the failing rank (it may be stuck, or about
        to go) only when too few others are left."""
        live = self._live_local_ranks()
        ordered = [r for r in live if r != verdict.rank] + [r for r in live if r == verdict.rank]
        return self.rank in ordered[:ENFORCERS]

    def _tear_down_peers(self, verdict: Verdict) -> None:
        """Give live peers ``ack_window`` to say they are leaving; signal those that do not.

        While acknowledgements keep coming in, the machine is busy rather than the peers
        stuck (128 ranks on 2 cores take a while to all be scheduled): the window is
        stretched, ``ack_window / 4`` after the latest one, up to 4 x ``ack_window``.
        """
        start = time.monotonic()
        window = self.config.ack_window
        deadline, latest = start + window, start + 4 * window
        acks_seen = -1
        while True:
            self._scan()
            acked = {r.rank for r in self._events.values() if isinstance(r, Ack)}
            pending = [
                p for r, p in self._peers.items() if r not in self._gone and r not in acked and r != self.rank
            ]
            now = time.monotonic()
            if len(acked) > acks_seen >= 0:
                deadline = max(deadline, min(latest, now + window / 4))
            acks_seen = len(acked)
            left = deadline - now
            if not pending or left <= 0:
                break
            self._poll(left)
        targets: List[_teardown.Target] = []
        peer_pids = {r.pid for r in self._registrations.values() if is_local(r)}
        finished = {r.rank for r in self._events.values() if isinstance(r, Success)}
        tree = _teardown.process_tree() if pending else {}
        for peer in pending:
            reg = peer.reg
            target = _teardown.make_target(reg.pid, reg.start_ticks, reg.uid, f"rank {reg.rank}")
            if target is None:
                continue
            if not _teardown.holds_file(reg.pid, self._stack_path(reg.rank)):
                self.run_dir.warn_once(
                    self.run_dir.join(RANKS, rank_file("rank", reg.rank)),
                    f"names pid {reg.pid}, which does not hold rank {reg.rank}'s stack file: not a verified "
                    "peer, not signalled",
                )
                target.close()
                continue
            if reg.rank not in finished:  # a finished rank is leaving: no dump to ask of it
                _teardown.send(target, _teardown.STACKS_SIGNAL, "dump stacks")
            targets.append(target)
            for pid, started in _teardown.descendants(reg.pid, reg.uid, peer_pids, tree):
                child = _teardown.make_target(pid, started, reg.uid, f"pid {pid}, a descendant of rank {reg.rank}")
                if child is not None:
                    targets.append(child)
        targets.extend(self._orphans_of(verdict, peer_pids))
        if targets:
            reason = f"rank {verdict.rank} failed ({verdict.cause}) and this process did not leave by itself"
            _teardown.terminate(targets, self.config.grace, reason)
            _teardown.close_all(targets)

    def _orphans_of(self, verdict: Verdict, peer_pids: Set[int]) -> List[_teardown.Target]:
        """Descendants of the failed rank (from its last heartbeat) that outlived it."""
        reg = self._registrations.get(verdict.rank)
        beat = self.run_dir.read(HEARTBEATS, rank_file("rank", verdict.rank), Heartbeat)
        if reg is None or beat is None or beat.pid != reg.pid or not is_local(reg):
            return []
        found = []
        for pid, start in beat.children:
            if pid in peer_pids:
                continue
            target = _teardown.make_target(pid, start, reg.uid, f"pid {pid}, left behind by rank {verdict.rank}")
            if target is None:
                continue
            # Vouched for by the OS: it inherited the run directory from the rank (a child
            # started after install()), or the rank's stack file (a forked worker).
            if _teardown.inherited_run(pid, self.run_dir.path) or _teardown.holds_file(
                pid, self._stack_path(verdict.rank)
            ):
                found.append(target)
            else:
                target.close()
                logger.info("peerwatch: pid %d, named as a child of rank %d, is not vouched for; not signalled",
                            pid, verdict.rank)
        return found

    def _stack_path(self, rank: int) -> str:
        return self.run_dir.join(_rundir.STACKS, rank_file("rank", rank, ".txt"))

    def _tear_down_own_children(self) -> None:
        peer_pids = {r.pid for r in self._registrations.values() if is_local(r)}
        targets = [
            t for t in (
                _teardown.make_target(pid, start, os.geteuid(), f"pid {pid}, a descendant of rank {self.rank}")
                for pid, start in _teardown.descendants(os.getpid(), os.geteuid(), peer_pids)
            ) if t is not None
        ]
        if targets:
            _teardown.terminate(targets, self.config.grace, f"rank {self.rank} is being torn down")
            _teardown.close_all(targets)

    def _finish(self, verdict: Verdict, made: bool) -> None:
        try:
            report = _report.write(self.run_dir)
            if made:
                logger.error("%s", _report.summary(report))
        except OSError as e:
            logger.error("peerwatch: rank %d could not write the report: %s", self.rank, e)
        except Exception:  # noqa: BLE001 - a report must never stop the teardown
            logger.exception("peerwatch: rank %d could not write the report", self.rank)

    # -- called from the training thread -------------------------------------------

    def record_failure(self, failure: Failure) -> None:
        """This rank failed: say so before it goes (first record wins)."""
        self.own_exit_code = failure.exit_code if failure.exit_code else 1
        self._write_event(rank_file("failure", self.rank), failure)
        self.wake()

    def record_thread_exception(self, failure: Failure) -> None:
        """For the report only: another thread of this rank died of an exception."""
        self._write_event(rank_file("thread", self.rank), failure)
        logger.warning(
            "peerwatch: rank %d: thread %s died of %s: %s (recorded; set thread_exceptions=fail to fail the rank)",
            self.rank, failure.thread, failure.exception, failure.message,
        )

    def record_success(self) -> None:
        if self.succeeded or self.verdict is not None:
            return
        self.succeeded = True
        self._write_event(rank_file("success", self.rank), Success(rank=self.rank, pid=os.getpid(), time_ns=time.time_ns()))
        if self.bridge is not None:
            self.bridge.on_success()  # the job is ending: other hosts going quiet is no failure


_COLLECTIVE_PATHS = (os.sep + os.path.join("torch", "distributed") + os.sep,)


def main_thread_position() -> Tuple[str, bool]:
    """Where the main thread is ("file:line in function" of its innermost frame outside
    torch.distributed), and whether it is waiting inside torch.distributed."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    waiting = False
    while frame is not None:
        filename = frame.f_code.co_filename
        if any(p in filename for p in _COLLECTIVE_PATHS):
            waiting = True
        elif not filename.startswith("<"):
            return f"{os.path.basename(filename)}:{frame.f_lineno} in {frame.f_code.co_name}", waiting
        frame = frame.f_back
    return "", waiting


def _peer_failure_type() -> type:
    from ._errors import PeerFailure

    return PeerFailure


__all__ = ["Watcher"]
