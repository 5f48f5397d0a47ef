"""This rank's stack file, and the faulthandler timers that write into it.

Every rank holds its stack file open for as long as it runs: faulthandler dumps every
thread's stack into it on :data:`STACKS_SIGNAL` (from its C signal handler, so it works
while the main thread holds the GIL in C code), a crash leaves its last words there, and
a peer checks that a pid holds it before signalling that pid. gil_timeout's watchdog is
the C extension's thread (it counts only time it was awake to see, and has faulthandler
dump on STACKS_SIGNAL before it ends the process); the last resort is faulthandler's timer.

Threads: :meth:`StackFile.open` runs in the thread that calls ``install()``; the timers
are armed by the watcher thread and cancelled by it or by the thread that stops the
watcher. faulthandler has one timer per process, so arming and cancelling are one step
under ``_timer_lock`` with what they decide on: once the last resort is armed (a teardown
began) nothing cancels it, and once cancelled (the rank stopped watching) no GIL watchdog
is armed again. ``_faulthandler_ours`` is written at install and in a forked child only.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import threading
from typing import IO, Any, Optional

from ..proc.teardown import STACKS_SIGNAL
from .rundir import RunDir
from .trust import open_regular

logger = logging.getLogger("peerwatch")

_faulthandler_ours = False  # we enabled faulthandler into the rank's stack file


class StackFile:
    """The open stack file of this rank (``file`` is None when it could not be opened)."""

    def __init__(self, file: Optional[IO[str]]) -> None:
        self.file = file
        self._timer_lock = threading.Lock()
        self._stopped = False  # under _timer_lock: the watching stopped; no GIL watchdog from now on
        self._tearing_down = False  # under _timer_lock: the last resort is armed; never cancelled
        self._native_failed = False  # under _timer_lock: the C watchdog could not start; faulthandler's timer instead

    @classmethod
    def open(cls, rd: RunDir, rank: int) -> StackFile:
        """Open this rank's stack file and have faulthandler dump into it on STACKS_SIGNAL.
        Never raises: a rank without a stack file is still watched (and logs why)."""
        global _faulthandler_ours
        try:
            # A regular file only, opened without blocking (a FIFO there would hang install()).
            fd = open_regular(rd.stack_at(rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            file = os.fdopen(fd, "w")
            faulthandler.register(STACKS_SIGNAL, file=file, all_threads=True, chain=False)
            if not faulthandler.is_enabled():
                # A rank that segfaults leaves its last words here, where its peers read
                # which signal ended it (only its parent could learn that otherwise).
                faulthandler.enable(file=file, all_threads=True)
                _faulthandler_ours = True
            return cls(file)
        except (OSError, RuntimeError, ValueError) as e:
            logger.warning("peerwatch: rank %d cannot arm stack dumps: %s", rank, e)
            return cls(None)

    def dump(self) -> None:
        """Every thread's stack, now (for the report)."""
        if self.file is None:
            return
        try:
            faulthandler.dump_traceback(self.file, all_threads=True)
            self.file.flush()
        except (OSError, ValueError):
            pass

    def arm_gil_watchdog(self, timeout_s: float) -> None:
        """If the watcher cannot run for ``timeout_s`` (the GIL held by C code), a C thread
        dumps every stack here and ends the process. Re-armed every heartbeat; a no-op once
        the timers were cancelled, or the last resort armed (it must not be replaced).

        The C extension's watchdog counts only the time it was awake to see: a job stopped
        by a scheduler (SIGSTOP) and resumed goes on. Without the extension, faulthandler's
        timer is used, which counts the stop too."""
        if self.file is None:
            return
        with self._timer_lock:
            if self._stopped or self._tearing_down:
                return
            native = _native()
            if native is not None:
                try:
                    native.gil_watch(self.file.fileno(), STACKS_SIGNAL, timeout_s)
                    return
                except OSError as e:  # no thread can be started (a limit on tasks): the timer below
                    if not self._native_failed:
                        self._native_failed = True
                        logger.warning("peerwatch: gil_timeout's watchdog thread cannot start (%s); faulthandler's "
                                       "timer stands in (it counts the time the process is stopped)", e)
            faulthandler.dump_traceback_later(timeout_s, exit=True, file=self.file)

    def _disarm_native(self) -> None:
        native = _native()
        if native is not None and self.file is not None:
            native.gil_watch(self.file.fileno(), STACKS_SIGNAL, 0.0)

    def arm_last_resort(self, budget_s: float) -> None:
        """Once teardown has begun this process ends, even if the watcher thread never runs
        again (the main thread holding the GIL in C): faulthandler's C thread needs no GIL.
        Armed again, it replaces the budget; :meth:`cancel_timer` cannot cancel it."""
        if self.file is None:
            return
        with self._timer_lock:
            self._tearing_down = True
            self._disarm_native()  # the teardown's exit code, not the watchdog's
            try:
                faulthandler.dump_traceback_later(budget_s, exit=True, file=self.file)
            except (OSError, ValueError, RuntimeError):
                pass

    def cancel_timer(self) -> None:
        """The watching stopped (the rank is done, or cannot watch any more): cancel the GIL
        watchdog, for good. A no-op once the last resort is armed: a teardown that began
        ends the process whatever thread stops the watcher meanwhile."""
        with self._timer_lock:
            if self._tearing_down:
                return
            self._stopped = True
            self._disarm_native()
            faulthandler.cancel_dump_traceback_later()


def _native() -> Optional[Any]:
    """The C extension (its GIL watchdog), or None where it was not built."""
    try:
        from .. import _exitstatus  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _exitstatus


def after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) must not leave its last words in its rank's
    stack file: the rank's peers would take them for the rank's own."""
    global _faulthandler_ours
    if not _faulthandler_ours:
        return
    _faulthandler_ours = False
    try:
        faulthandler.enable()  # back to stderr, as the child would have it without us
        faulthandler.unregister(STACKS_SIGNAL)
    except (OSError, RuntimeError, ValueError):
        pass


__all__ = ["StackFile", "after_fork_in_child"]
