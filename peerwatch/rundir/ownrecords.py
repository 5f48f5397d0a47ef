"""The records this process writes into ``events/`` (first writer wins), from any thread.

A rank's own records are written by whichever thread ends it: its failure (the training
thread, a thread's excepthook, the launcher watch), another thread's exception, its
success. Each is on disk before the call returns (the thread may be about to exit the
process, and the watcher thread may be dead or busy with a teardown), and the observer
reads it back like any other record (inotify wakes it). The watcher thread writes through
here too (the verdict, its acknowledgement, the exit statuses it observed), through its
:class:`peerwatch.observer.Observer`.

A rank that ran out of descriptors (EMFILE: DataLoader workers, a leak) must still be
able to say how it ended, or its peers take a clean exit for a failure and tear a healthy
job down: for the rank's own end (its success or failure), a write that finds none left is
tried again with the soft limit raised to the hard one for that write (as the record
written at exit by peerwatch._exitstatus is).

Threads: any thread may write. The one piece of state, whether a write failed (said
loudly once: records of this rank may be missing from then on), is under ``_lock``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import resource  # here, not where it is needed: an import needs a descriptor
import threading
from typing import Callable, Iterator

from ..core.records import Failure, Interrupt, Registration, Success, decode, encode
from . import eventlog
from .rundir import EVENTS, RunDir, rank_file

logger = logging.getLogger("peerwatch")


OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)


class OwnRecords:
    """Writes this process's records into the run directory's ``events/``."""

    def __init__(self, run_dir: RunDir, me: Registration) -> None:
        self.run_dir = run_dir
        self.me = me
        self._lock = threading.Lock()
        self._write_failed = False  # under _lock

    @property
    def write_failed(self) -> bool:
        """A record could not be written (a full disk, the run directory removed...)."""
        with self._lock:
            return self._write_failed

    def write(self, name: str, record: object, belongs: Callable[[object], bool], own_end: bool = False) -> bool:
        """Write ``record`` as ``events/name`` (first writer wins); False if it was not
        ours. What is there already is kept only if ``belongs`` says it is a record of
        this run (garbage, or another job's record of this rank, must not block ours).
        ``own_end``: how this rank ended; out of descriptors, the spares are given back for it.
        Never raises: a failure is logged (loudly the first time)."""
        cls = type(record)
        try:
            try:
                wrote = self.run_dir.write(EVENTS, name, encode(record), valid=lambda data: _valid(cls, data, belongs))
            except OSError as e:
                if not (own_end and e.errno in OUT_OF_DESCRIPTORS):
                    raise
                with self._more_descriptors():
                    wrote = self.run_dir.write(EVENTS, name, encode(record),
                                               valid=lambda data: _valid(cls, data, belongs))
            if wrote:
                eventlog.record(self.run_dir, EVENTS, name, record, self.me.rank)
            return wrote
        except OSError as e:
            with self._lock:
                first, self._write_failed = not self._write_failed, True
            if first:
                logger.error("peerwatch: rank %d: protection degraded: cannot write to %s: %s", self.me.rank,
                             self.run_dir.path, e.strerror or e)
            logger.error("peerwatch: rank %d could not write %s: %s", self.me.rank, name, e)
            return False

    # -- this rank's own records (any thread) --------------------------------------------

    @contextlib.contextmanager
    def _more_descriptors(self) -> Iterator[None]:
        """Out of descriptors, for the record of how this rank ended: the soft limit raised
        to the hard one for that write (where they are equal, ``ulimit -n``, nothing more
        can be done here: the write fails as before, said loudly)."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        raised = False
        if soft < hard:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
                raised = True
                logger.warning("peerwatch: rank %d is out of file descriptors; its soft limit was raised from %d "
                               "for a moment to record how it ended", self.me.rank, soft)
            except (ValueError, OSError):  # a hard limit above what the kernel allows (nr_open)
                pass
        try:
            yield
        finally:
            if raised:
                with contextlib.suppress(ValueError, OSError):
                    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    def failure(self, failure: Failure) -> bool:
        """This rank failed (first record wins)."""
        return self.write(rank_file("failure", self.me.rank), failure, self._mine, own_end=True)

    def thread_exception(self, failure: Failure) -> bool:
        """Another thread of this rank died of an exception (for the report)."""
        return self.write(rank_file("thread", self.me.rank), failure, self._mine)

    def success(self, success: Success) -> bool:
        """This rank ended cleanly."""
        return self.write(rank_file("success", self.me.rank), success, self._mine, own_end=True)

    def interrupt(self, interrupt: Interrupt) -> bool:
        """This rank got a SIGINT (the latest one replaces an earlier one's record)."""
        return self.write(rank_file("interrupt", self.me.rank), interrupt,
                          lambda r: self._mine(r) and getattr(r, "time_ns", 0) >= interrupt.time_ns)

    def _mine(self, record: object) -> bool:
        """A record of this rank there is this process's (or says no pid: another host's)."""
        return getattr(record, "pid", None) in (0, self.me.pid)


def _valid(cls: type, data: bytes, belongs: Callable[[object], bool]) -> bool:
    record = decode(cls, data)
    return record is not None and belongs(record)


__all__ = ["OwnRecords"]
