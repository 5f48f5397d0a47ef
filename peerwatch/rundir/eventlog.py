"""The event log, and the records this process writes into ``events/``.

The event log, ``RUN/events.jsonl`` (``events-<host>.jsonl`` where hosts share the run
directory), is the one docs/events.md describes: its schema, and how it is written (one
``write(2)`` a line on an ``O_APPEND`` descriptor, :meth:`RunDir.append`). A record of
``events/`` is logged once per run, by the one process that creates
``logged/<folder>.<name>`` (``O_EXCL``): its writer at once; one written where Python
cannot log it (at exit, by :mod:`peerwatch._exitstatus`) by the peers that read it, by
the enforcers' sweeps, and by the leaving rank itself, which knows its own code. Never
raises: a log that cannot be written is said once at DEBUG; the teardown goes on.

:class:`OwnRecords` writes this process's own records into ``events/`` (first writer wins),
and logs them. They are written by whichever thread ends the rank: its failure (the training
thread, a thread's excepthook, the launcher watch), another thread's exception, its success.
Each is on disk before the call returns (the thread may be about to exit the process, and
the watcher thread may be dead or busy with a teardown), and the observer reads it back like
any other record (inotify wakes it). The watcher thread writes through it too (the verdict,
its acknowledgement, the exit statuses it observed), through its
:class:`peerwatch.observer.Observer`.

A rank that ran out of descriptors (EMFILE: DataLoader workers, a leak) must still be
able to say how it ended, or its peers take a clean exit for a failure and tear a healthy
job down: for the rank's own end (its success or failure), a write that finds none left is
tried again with the soft limit raised to the hard one for that write (as the record
written at exit by peerwatch._exitstatus is).

Threads: any thread may write. An OwnRecords' one piece of state, whether a write failed
(said loudly once: records of this rank may be missing from then on), is under its ``_lock``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import resource  # here, not where it is needed: an import needs a descriptor
import threading
import time
from typing import AbstractSet, Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

from ..core.records import (
    EVENT_TYPES,
    Ack,
    ExitStatus,
    Failure,
    Interrupt,
    NotSignalled,
    Registration,
    Success,
    Verdict,
    WatcherDeath,
    decode,
    encode,
    returncode_exit_code,
    signal_name,
)
from .rundir import EVENTS, RANKS, VERDICT_FILE, RunDir, parse_rank_file, rank_file
from .trust import open_regular

logger = logging.getLogger("peerwatch")

EVENT_LOG = "events.jsonl"
MAX_LOG_BYTES = 64 << 20  # read back at most this much of it (a run logs a few hundred bytes per event)
LOGGED = "logged"  # folder of claim markers: logged/<folder>.<file name> of each record logged
SCHEMA_VERSION = 1  # the "v" of every line
MAX_TEXT_CHARS = 500  # a message or reason longer than this is cut (lines stay one small write)

_lock = threading.Lock()
_bound: Optional[RunDir] = None  # the run directory of this process's rank (bind)
_bound_rank: Optional[int] = None
_bound_pid: Optional[int] = None  # a forked child inherits the binding, and must not log as the rank
_failed_once = False


def bind(rd: RunDir, rank: int) -> None:
    """This process is rank ``rank`` of the run in ``rd``: events it sees are logged there."""
    global _bound, _bound_rank, _bound_pid
    with _lock:
        _bound, _bound_rank, _bound_pid = rd, rank, os.getpid()


def bound() -> Optional[RunDir]:
    """The run directory this process logs to, or None (not a rank, or a forked child)."""
    return _bound if _bound_pid == os.getpid() else None


def bound_rank() -> Optional[int]:
    return _bound_rank if _bound_pid == os.getpid() else None


def append(rd: RunDir, event: str, rank: Optional[int], ts: Optional[int] = None, **fields: Any) -> None:
    """Append one line. Never raises."""
    body: Dict[str, Any] = {"v": SCHEMA_VERSION, "ts": time.time_ns() if ts is None else int(ts), "event": event,
                            "rank": rank}
    for key, value in fields.items():
        if isinstance(value, str) and len(value) > MAX_TEXT_CHARS:
            value = value[:MAX_TEXT_CHARS] + "..."
        elif isinstance(value, tuple):
            value = list(value)
        body[key] = value
    try:
        rd.append(rd.per_host(EVENT_LOG), (json.dumps(body, separators=(",", ":"), default=str) + "\n").encode())
    except (OSError, ValueError) as e:
        _failed(rd, e)


def _failed(rd: RunDir, e: BaseException) -> None:
    global _failed_once
    if not _failed_once:
        _failed_once = True
        logger.debug("peerwatch: cannot append to the event log %s: %s", rd.join(EVENT_LOG), e)


def log(event: str, rank: Optional[int], ts: Optional[int] = None, **fields: Any) -> None:
    """Append a line to this process's run's log (nothing if it is not bound). Never raises."""
    rd = bound()
    if rd is not None:
        append(rd, event, rank, ts, **fields)


def note(event: str, rank: Optional[int], **fields: Any) -> None:
    """:func:`log`, by this process's rank: the ``note`` a teardown records its signals with."""
    log(event, rank, by=bound_rank(), **fields)


def record(rd: RunDir, sub: str, name: str, rec: object, by: Optional[int]) -> bool:
    """Log the record ``rec`` of ``sub/name`` unless someone has (``by``: the rank logging
    it). True if this call logged it. Never raises."""
    line = describe(rec)
    if line is None or not _claim(rd, f"{sub}.{name}"):
        return False
    event, rank, ts, fields = line
    if name.startswith("thread-"):
        event = "thread_exception"
    append(rd, event, rank, ts, logged_by=by, **fields)
    return True


def _claim(rd: RunDir, key: str) -> bool:
    """This process is the one to log ``key`` (a folder and a record's name). Never raises."""
    try:
        return rd.claim(LOGGED, key)
    except OSError as e:
        _failed(rd, e)
        return False


# Each logged record's event, the attribute that says when, and its fields in order: each
# copied from the record, or worked out from it where _WORKED_OUT names it.
_LOGGED: Dict[type, Tuple[str, str, Tuple[str, ...]]] = {
    Registration: ("register", "time_ns", ("pid", "host", "world_size", "local_rank")),
    Success: ("success", "time_ns", ("pid",)),
    Failure: ("failure", "time_ns", ("pid", "cause", "exit_code", "exception", "message", "thread", "host")),
    ExitStatus: ("exit", "time_ns", ("pid", "returncode", "exit_code", "signal", "observed_by", "signalled_by")),
    Ack: ("ack", "time_ns", ("pid",)),
    Verdict: ("verdict", "detected_at_ns", ("cause", "exit_code", "pid", "host", "signal", "exception", "detail",
                                            "failed_at_ns", "detected_by", "oom_suspected", "laggards")),
    NotSignalled: ("not_signalled", "time_ns", ("pid", "reason", "observed_by")),
    Interrupt: ("interrupt", "time_ns", ("pid", "signal", "signalled_by")),
    WatcherDeath: ("watcher_death", "time_ns", ("pid", "exception", "message")),
}
_WORKED_OUT: Dict[Tuple[type, str], Callable[[Any], Any]] = {
    (ExitStatus, "exit_code"): lambda rec: returncode_exit_code(rec.returncode),
    (ExitStatus, "signal"): lambda rec: signal_name(-rec.returncode) if rec.returncode < 0 else None,
    (Verdict, "detail"): lambda rec: rec.detail or None,
    (Verdict, "laggards"): lambda rec: list(rec.laggards),
}


def describe(rec: object) -> Optional[tuple]:
    """(event, rank, ts, fields) of a record; None for what is not logged."""
    for cls, (event, when, names) in _LOGGED.items():
        if isinstance(rec, cls):
            fields = {n: _WORKED_OUT[cls, n](rec) if (cls, n) in _WORKED_OUT else getattr(rec, n) for n in names}
            return event, getattr(rec, "rank"), getattr(rec, when), fields  # noqa: B009
    return None


def sweep(rd: RunDir, by: Optional[int]) -> int:
    """Log every record of ``events/`` (and the registrations) not logged yet; how many
    this call logged. For an enforcer, whose peers' last records were written where
    Python could not log them. Never raises."""
    logged = 0
    try:
        for name, rec in _records(rd, set(rd.names(LOGGED))):
            sub = RANKS if isinstance(rec, Registration) else EVENTS
            logged += record(rd, sub, name, rec, by)
    except OSError as e:
        _failed(rd, e)
    return logged


def _records(rd: RunDir, claimed: AbstractSet[str]) -> List[Tuple[str, object]]:
    """The records of ranks/ and events/ whose claim marker is not in ``claimed``: a record
    claimed already is neither read nor claimed again (one listing, where a claim tried on
    each costs a locked create: hundreds at N=128)."""
    found: List[Tuple[str, object]] = []
    for prefix, rank, name in rd.entries(RANKS):
        if prefix == "rank" and f"{RANKS}.{name}" not in claimed:
            reg = rd.read(RANKS, name, Registration)
            if reg is not None and reg.rank == rank:
                found.append((name, reg))
    for prefix, rank, name in rd.entries(EVENTS):
        cls = EVENT_TYPES.get(prefix)
        if cls is None or f"{EVENTS}.{name}" in claimed:
            continue
        rec = rd.read(EVENTS, name, cls)
        if rec is not None and getattr(rec, "rank", None) == rank:
            found.append((name, rec))
    verdict = rd.read(EVENTS, VERDICT_FILE, Verdict) if f"{EVENTS}.{VERDICT_FILE}" not in claimed else None
    if verdict is not None:
        found.append((VERDICT_FILE, verdict))
    return found


def wanted_from_scan(name: str, rec: object) -> bool:
    """A record a peer read that its writer could not log: written at exit by the C
    extension (a success marker, an exit-status failure, an exit record of its own)."""
    parsed = parse_rank_file(name)
    if parsed is None:
        return False
    if isinstance(rec, Success):
        return True
    if isinstance(rec, ExitStatus):
        return rec.observed_by == rec.rank
    return isinstance(rec, Failure) and rec.observed


def leaving(code: int) -> None:
    """This rank is leaving now with ``code`` (``os._exit``): its exit, as it will be
    recorded (the C extension writes the record itself, where Python cannot log it)."""
    rd, rank = bound(), bound_rank()
    if rd is None or rank is None:
        return
    if not _claim(rd, f"{EVENTS}.{rank_file('exit', rank)}"):
        return
    append(rd, "exit", rank, pid=os.getpid(), returncode=code, exit_code=code, signal=None, observed_by=rank,
           signalled_by=None, logged_by=rank)


def read(path: str) -> list:
    """The events of the log at ``path``, one dict per good line (a torn or foreign line is
    skipped), sorted by ``ts``; at most its first MAX_LOG_BYTES. Raises OSError if it cannot
    be read, or is not a regular file (a symlink is never followed: one to /dev/zero would
    never end; a FIFO would block)."""
    events = []
    fd = open_regular(path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_LOG_BYTES)
    if len(data) == MAX_LOG_BYTES:
        data = data[:data.rfind(b"\n") + 1]  # the cap cut a line: drop it
    for raw in data.splitlines():
        if raw:
            try:
                item = json.loads(raw)
            except ValueError:
                continue
            if isinstance(item, dict) and isinstance(item.get("ts"), int) and isinstance(item.get("event"), str):
                events.append(item)
    events.sort(key=lambda e: e["ts"])
    return events


def log_names(names: Iterable[str]) -> List[str]:
    """Of the file names of a run directory, its event logs: ``events.jsonl`` and the
    per-host ``events-<host>.jsonl`` of a run directory shared by several hosts."""
    stem, _, ext = EVENT_LOG.partition(".")
    return sorted(n for n in names if n == EVENT_LOG or (n.startswith(f"{stem}-") and n.endswith(f".{ext}")))


def read_run(directory: str) -> list:
    """The events of every event log of the run directory ``directory`` (:func:`log_names`),
    merged and sorted by ``ts``. Raises OSError if the directory cannot be listed, or if
    none of its logs can be read (:func:`read`); a log that cannot be read beside others
    that can is left out."""
    files = log_names(os.listdir(directory))
    if not files:
        raise FileNotFoundError(errno.ENOENT, "no event log", os.path.join(directory, EVENT_LOG))
    events: list = []
    error: Optional[OSError] = None
    read_any = False
    for name in files:
        try:
            events.extend(read(os.path.join(directory, name)))
            read_any = True
        except OSError as e:
            error = e
    if not read_any and error is not None:
        raise error
    events.sort(key=lambda e: e["ts"])
    return events


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

    def write(self, name: str, rec: object, belongs: Callable[[object], bool], own_end: bool = False) -> bool:
        """Write ``rec`` as ``events/name`` (first writer wins); False if it was not
        ours. What is there already is kept only if ``belongs`` says it is a record of
        this run (garbage, or another job's record of this rank, must not block ours).
        ``own_end``: how this rank ended; out of descriptors, the spares are given back for it.
        Never raises: a failure is logged (loudly the first time)."""
        cls = type(rec)
        try:
            try:
                wrote = self.run_dir.write(EVENTS, name, encode(rec), valid=lambda data: _valid(cls, data, belongs))
            except OSError as e:
                if not (own_end and e.errno in OUT_OF_DESCRIPTORS):
                    raise
                with self._more_descriptors():
                    wrote = self.run_dir.write(EVENTS, name, encode(rec),
                                               valid=lambda data: _valid(cls, data, belongs))
            if wrote:
                record(self.run_dir, EVENTS, name, rec, self.me.rank)
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


__all__ = ["EVENT_LOG", "LOGGED", "MAX_LOG_BYTES", "SCHEMA_VERSION", "OwnRecords", "append", "bind", "bound", "bound_rank", "describe", "leaving", "note",
           "log", "log_names", "read", "read_run", "record", "sweep", "wanted_from_scan"]
