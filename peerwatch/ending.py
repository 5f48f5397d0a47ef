"""How this rank ends: its outcome, the verdict it acts on, whether its exception followed a
peer's failure, its leaving. The hooks, ``watch()`` and the launcher watch record, judge and
await it here (:attr:`peerwatch.watcher.Watcher.ending`).

Threads and what each writes:
- any thread that ends the rank (training thread, a thread's excepthook, the launcher
  watch): ``failed_code``, ``echo`` and ``succeeded``, under ``_lock`` (the first failure
  wins, as its record does), and the rank's own records (:class:`peerwatch.rundir.eventlog.OwnRecords`),
  on disk before that thread goes on;
- the watcher thread: the verdict (:meth:`Ending.known`: once, before ``verdict_seen`` is set),
  ``peer_failure_known``, the looks it took for a settle (``_settled``, under ``_settle``), and
  this rank's SIGINTs (:meth:`Ending.note_interrupt`);
- a thread about to judge its exception asks for a look (:meth:`Ending.settle`: ``_requested``,
  under ``_settle``);
- the training thread: ``in_watch`` (``watch()``), ``main_left`` (as it leaves during a teardown);
- ``done`` (stop watching: the rank is finished), set by :meth:`peerwatch.watcher.Watcher.stop`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import AbstractSet, Callable, Optional

from .core.config import Config
from .core.records import EXCEPTION, Failure, Interrupt, Registration, Success, Verdict
from .hangs.heartbeat import HeartbeatWriter
from .hosts.bridge import Bridge
from .rundir import exitwatch
from .rundir.eventlog import OwnRecords
from .verdict import plan

logger = logging.getLogger("peerwatch")


class Ending:
    """How this rank ends, as far as it is known (the module's docstring says who writes what)."""

    def __init__(
        self, config: Config, me: Registration, own_records: OwnRecords, heartbeat: HeartbeatWriter,
        bridge: Optional[Bridge], watcher: threading.Thread, wake: Callable[[], None],
        local_pids: Callable[[], AbstractSet[int]],
    ) -> None:
        self.config = config
        self.me = me
        self.rank = me.rank
        self._records, self._heartbeat, self._bridge = own_records, heartbeat, bridge
        self._watcher = watcher  # the watcher thread: it judges, and ends a torn-down rank
        self._wake = wake  # wakes the watcher thread
        self._local_pids = local_pids
        self._lock = threading.Lock()
        self.failed_code: Optional[int] = None
        self.echo = False  # the failure is an exception raised by torch.distributed
        self.succeeded = False
        self.in_watch = 0
        self.verdict_seen = threading.Event()
        self.done = threading.Event()
        self.main_left = threading.Event()
        self._verdict: Optional[Verdict] = None
        self._interrupt_noted: Optional[int] = None  # the last SIGINT said (its monotonic time): note_interrupt
        self.peer_failure_known = False  # a peer failed, judged or not yet, as the watcher last looked
        self._settle = threading.Condition()
        self._requested = self._settled = 0  # looks asked for, and taken by the watcher

    @property
    def verdict(self) -> Optional[Verdict]:
        return self._verdict if self.verdict_seen.is_set() else None

    @property
    def peer_verdict(self) -> Optional[Verdict]:
        """The verdict, if it names another rank: this rank is torn down on its account."""
        v = self.verdict
        return v if v is not None and v.rank != self.rank else None

    def known(self, verdict: Verdict) -> None:
        """The watcher thread acts on ``verdict``: made known in this process."""
        self._verdict = verdict
        self.verdict_seen.set()
        with self._settle:
            self._settle.notify_all()  # a settle waits no more

    def is_over(self) -> bool:
        """A verdict is known, or this rank is done."""
        return self.verdict_seen.is_set() or self.done.is_set() or self.succeeded

    def exit_code(self) -> int:
        """The code this rank exits with under the verdict (rule: the verdict's exit code)."""
        v = self._verdict
        assert v is not None
        return plan.exit_code(self.rank, v.rank, v.exit_code, self.failed_code)

    def peer_failed(self) -> bool:
        """True if the watcher knows of a failure of another rank (judged or not yet)."""
        v = self.verdict
        return v.rank != self.rank if v is not None else self.peer_failure_known

    # -- a settle: one full look by the watcher before an exception is judged ------------

    def settle(self, timeout: float) -> None:
        """Wait until the watcher has taken one full look at its sources (or has a verdict).

        Called from the training thread when it is about to fail: a peer that died just
        before (its pidfd already fired) is then known, so the exception can be told
        apart as a consequence (gloo's "connection reset") rather than a root cause.
        """
        if threading.current_thread() is self._watcher or not self._watcher.is_alive():
            return
        with self._settle:
            self._requested += 1
            wanted = self._requested
        self._wake()
        deadline = time.monotonic() + timeout
        with self._settle:
            while self._settled < wanted and not self.verdict_seen.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._settle.wait(left)

    def looks_asked(self) -> int:
        """The watcher thread, before it looks: how many looks were asked for so far. Read
        without the lock (on every turn): a request counted after the read wakes the
        watcher again, and is answered by its next look."""
        return self._requested

    def looked(self, upto: int) -> None:
        """The watcher thread took a full look: the settles that asked before it are answered."""
        if upto <= self._settled:  # the watcher is _settled's one writer: read without the lock
            return  # (on every turn of the loop; a request is rare)
        with self._settle:
            self._settled = max(self._settled, upto)
            self._settle.notify_all()

    def enter_watch(self, delta: int) -> None:
        """The training thread entered (+1) or left (-1) ``watch()``: it alone writes ``in_watch``."""
        self.in_watch += delta

    # -- recorded by whichever thread ends the rank --------------------------------------

    def record_failure(self, failure: Failure) -> None:
        """This rank failed: say so before it goes (first record wins)."""
        with self._lock:
            if self.failed_code is None:
                self.failed_code = failure.exit_code if failure.exit_code else 1
                self.echo = failure.cause == EXCEPTION and failure.collective
        self.final_heartbeat()
        self._records.failure(failure)
        self._wake()

    def record_leaving(self) -> None:
        """This rank's program has ended with no outcome recorded, and its interpreter is
        about to finalize: its exit status will tell. Say so before its sockets close."""
        if self.verdict_seen.is_set() or self.failed_code is not None or self.succeeded:
            return
        try:
            self._heartbeat.leaving(self._local_pids)
        except Exception:  # noqa: BLE001 - the heartbeat must never stop an exit
            logger.debug("peerwatch: rank %d could not say it is leaving", self.rank, exc_info=True)

    def record_thread_exception(self, failure: Failure) -> None:
        """For the report only: another thread of this rank died of an exception."""
        self._records.thread_exception(failure)
        logger.warning(
            "peerwatch: rank %d: thread %s died of %s: %s (recorded; set thread_exceptions=fail to fail the rank)",
            self.rank, failure.thread, failure.exception, failure.message,
        )

    def record_success(self) -> None:
        if self.verdict_seen.is_set():
            return
        with self._lock:
            if self.succeeded or self.failed_code is not None:
                return
            self.succeeded = True
        self.final_heartbeat()
        self._records.success(Success(rank=self.rank, pid=os.getpid(), time_ns=time.time_ns()))
        self.tell_hosts_succeeded()  # the job is ending: other hosts going quiet is no failure

    def tell_hosts_succeeded(self) -> None:
        """Other hosts learn that this rank is ending well (its exit status decides here)."""
        if self._bridge is not None:
            self._bridge.on_success()

    def final_heartbeat(self) -> None:
        """The step this rank stopped at: for the report and ``peerwatch status``."""
        self._heartbeat.write_last(self._local_pids)

    def note_interrupt(self) -> None:
        """A SIGINT came since the last look (the C extension notes it as it arrives): say so
        in ``events/interrupt-<rank>.json`` (rule: interrupts are not failures). Not a failure (the
        application may catch the KeyboardInterrupt): the evidence that this rank got the
        job's Ctrl-C too, where its main thread cannot raise yet (it waits in a collective
        for a peer that did). The watcher thread looks on every turn (a heartbeat apart at most);
        ``_interrupt_noted`` is its own."""
        seen = exitwatch.last_interrupt()
        if seen is None or seen[0] == self._interrupt_noted:
            return
        self._interrupt_noted = seen[0]
        at_ns = time.time_ns() - max(0, time.monotonic_ns() - seen[0])
        self._records.interrupt(Interrupt(rank=self.rank, pid=self.me.pid, time_ns=at_ns, signal="SIGINT",
                                          signalled_by=seen[1]))

    # -- leaving -------------------------------------------------------------------------

    def await_own_verdict(self) -> None:
        """This rank failed and is exiting: wait for the verdict (rule: leaving at exit)."""
        if not self._watcher.is_alive():
            return  # nobody left to judge it (the run directory was removed, or the watcher died)
        hold_s = self._bridge.hold_s if self._bridge is not None else 0.0  # multi-host: an exception is held back
        self.verdict_seen.wait(plan.verdict_wait_s(self.config.parent_wait, self.config.ack_window, hold_s, self.echo))

    def leave(self) -> None:
        """The training thread is leaving during a teardown: the watcher ends the process
        once its share of the teardown is done (rule: leaving at exit)."""
        self.main_left.set()
        self._wake()
        if threading.current_thread() is not self._watcher:
            # The watcher may have an on_verdict hook to wait for, for its own bound.
            c = self.config
            hook_s = c.on_verdict_timeout if c.on_verdict is not None else 0.0
            self._watcher.join(plan.leave_join_s(c.grace, c.ack_window) + hook_s)


__all__ = ["Ending"]
