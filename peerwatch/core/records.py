"""The records kept in a run directory: what each holds and how it is (de)serialised.

Pure: no I/O. Every record is a JSON object with ``version`` and ``kind``; unknown keys
are ignored, a record of another major version or with a field of the wrong type parses
to ``None`` (the caller treats it as "not written yet" and logs it once).
"""

from __future__ import annotations

import dataclasses
import json
import signal as _signal
import typing
from typing import Any, Dict, Optional, Tuple, Type, TypeVar

RECORD_VERSION = 1
MAX_RECORD_BYTES = 1 << 20  # a larger file is not a record of ours
MAX_TRACEBACK_CHARS = 32_000

# Causes of a verdict.
EXCEPTION = "exception"  # the rank raised and said so
EXIT = "exit"  # the rank exited with a non-zero code (or 0 without a success marker)
SIGNAL = "signal"  # the rank was killed by a signal (known to its parent)
VANISHED = "vanished"  # the rank's process is gone and nobody knows how
HANG = "hang"  # no rank made progress for hang_timeout; the verdict names the laggard
LOST = "lost"
MISSING = "missing"  # a rank never registered within startup_timeout (startup_action=fail)
MISMATCH = "mismatch"  # a diagnosis: ranks disagree on the collective at one sequence number
BUSY = "busy"  # a diagnosis: the laggards are working (CPU, I/O, busy children), not stuck
# Every rank of this host got the same SIGINT or SIGTERM from outside the job (Ctrl-C, a
# scheduler stopping it): no rank failed; the verdict says so, and ranks exit 128 + signal.
INTERRUPTED = "interrupted"

HANG_EXIT_CODE = 124  # as timeout(1): the job was ended for not moving


@dataclasses.dataclass(frozen=True)
class Activity:
    """A rank's signs of work over its last samples (one shape from sampler to judge)."""

    span_ms: int  # the time the figures cover
    cpu_ms: int  # CPU time of the main thread in it
    places: int  # different stacks the main thread was seen at
    other_cpu_ms: int  # CPU time of the process's other threads (not peerwatch's)
    io_bytes: int  # bytes its threads read and wrote (not peerwatch's)
    children_cpu_ms: int  # CPU time of the rank's descendants
    samples: int
    main_io_bytes: int = 0  # bytes its main thread read and wrote (a part of io_bytes)

    def as_tuple(self) -> Tuple[int, ...]:
        # Not dataclasses.astuple: it deep-copies each field (170 us a call, where a hang's
        # summaries of thousands of ranks are written).
        return (self.span_ms, self.cpu_ms, self.places, self.other_cpu_ms, self.io_bytes, self.children_cpu_ms,
                self.samples, self.main_io_bytes)

    @classmethod
    def of(cls, values: Tuple[int, ...]) -> Optional["Activity"]:
        """From a heartbeat's ``activity`` field; None when it holds none (or not ours)."""
        if len(values) != len(dataclasses.fields(cls)) or any(v < 0 for v in values):
            return None
        return cls(*values)


@dataclasses.dataclass(frozen=True)
class Registration:
    """The pid file: which process is rank ``rank`` of this run."""

    KIND = "registration"
    rank: int
    pid: int
    ppid: int
    start_ticks: int
    uid: int
    host: str
    boot_id: str
    pidns: str
    time_ns: int
    world_size: Optional[int] = None
    local_rank: Optional[int] = None
    argv: str = ""


@dataclasses.dataclass(frozen=True)
class Success:
    """The rank finished its watched work cleanly."""

    KIND = "success"
    rank: int
    pid: int
    time_ns: int


@dataclasses.dataclass(frozen=True)
class Failure:
    """What a failing rank knew about its own failure, written before it went."""

    KIND = "failure"
    rank: int
    pid: int
    time_ns: int
    cause: str
    exit_code: Optional[int] = None
    exception: Optional[str] = None  # qualified type name
    message: Optional[str] = None
    traceback: Optional[str] = None
    thread: Optional[str] = None
    host: Optional[str] = None  # the failed rank's host, when it is not this one (written by the store bridge)
    # Raised by torch.distributed (a collective, DDP's reducer, the store): most often the
    # echo of another rank's failure ("Connection reset by peer"), so judged a moment later.
    collective: bool = False
    # When the exception (or exit) reached peerwatch, before the settle wait that tells a
    # cause from an echo (up to 0.25 s): the failure's own time, for people. ``time_ns`` is
    # when it was recorded, and what the rules of decide count from.
    raised_ns: Optional[int] = None
    # ``exit_code`` was observed: written from the exit status itself as the rank ended
    # (peerwatch.rundir.exitwatch's record, at exit()), not said beforehand (the code a rank
    # expected to exit with). False in a record of an older peerwatch: not known to be seen.
    observed: bool = False
    # The failure is an interrupt: the signal that raised it (``SIGINT`` for a
    # KeyboardInterrupt), and who sent it where known (its pid; None: not known, such as a
    # terminal's Ctrl-C). peerwatch never sends SIGINT: it came from outside the job.
    signal: Optional[str] = None
    signalled_by: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class ExitStatus:
    """How a rank ended, as seen by its parent (the only process the kernel tells)."""

    KIND = "exit"
    rank: int
    pid: int
    time_ns: int
    returncode: int  # as subprocess reports it: -N for signal N
    observed_by: int  # the rank that saw it: its parent, a peer reading its last words, or itself as it left
    signalled_by: Optional[int] = None  # for a signal the rank saw arrive: the sender's pid


@dataclasses.dataclass(frozen=True)
class Interrupt:
    """The rank got a SIGINT (Ctrl-C) from outside the job, as its watcher saw it arrive:
    not a failure (the application may catch the KeyboardInterrupt and go on), but evidence
    that the whole job was interrupted, where its main thread cannot raise yet (it waits in
    a collective for a peer that did). Rewritten with the latest."""

    KIND = "interrupt"
    rank: int
    pid: int
    time_ns: int
    signal: str
    signalled_by: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class Ack:
    """A rank saw the verdict and is leaving on its own by ``deadline_ns`` (CLOCK_MONOTONIC)."""

    KIND = "ack"
    rank: int
    pid: int
    time_ns: int
    deadline_ns: int


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    KIND = "heartbeat"
    rank: int
    pid: int
    time_ns: int
    seq: int
    step: Optional[int] = None
    progress_ns: Optional[int] = None
    paused: bool = False
    children: Tuple[Tuple[int, int], ...] = ()  # (pid, start_ticks) of this rank's descendants
    where: str = ""  # the main thread's innermost frame: "file:line in function"
    in_collective: bool = False  # the main thread is inside torch.distributed (waiting for peers)
    # torch's collective counters, read by the watcher (peerwatch.hangs.collectives): per process
    # group (group, last enqueued seq, last completed seq); when they last changed
    # (CLOCK_MONOTONIC); once they stop moving, the last collectives entered
    # (group, seq, op, sizes and dtypes); the shortest collective timeout seen (ms, 0: unknown).
    collectives: Tuple[Tuple[str, int, int], ...] = ()
    moved_ns: Optional[int] = None
    entered: Tuple[Tuple[str, int, str, str], ...] = ()
    pg_timeout_ms: int = 0
    # While the counters stand still, the rank's signs of work over its last samples
    # (peerwatch.proc.activity.Activity, in its field order); () when it has none to show.
    activity: Tuple[int, ...] = ()
    # Whether those counters are read (peerwatch.hangs.collectives.STATES: "read", "waiting",
    # "none", "failing", "off"; "" in a record of an older peerwatch), and for "failing",
    # why (one short line). A rank whose counters are not read is invisible to the diagnosis.
    collectives_state: str = ""
    collectives_error: str = ""
    # When the rank's program ended (time_ns) with no outcome recorded: its interpreter is
    # finalizing, its exit status will tell. Its sockets close from then on, and its peers'
    # collectives fail: echoes of how it ends (rule: echo waits for the leaving).
    leaving_ns: Optional[int] = None
    # The straggler's measure (peerwatch.hangs.waits): the last slots, each (ms, samples of the
    # main thread, those inside a collective, collectives entered, the slot's number);
    # () when not measured.
    waits: Tuple[Tuple[int, int, int, int, int], ...] = ()
    # The enqueue measure (peerwatch.hangs.waits.EnqueueWindow): per slot, when this rank entered
    # its last collectives (peerwatch.hangs.straggler.Enqueued, as row_text writes it: numbers
    # separated by commas); () when not measured.
    enqueued: Tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The first failure of the run. Written once; every watcher acts on it."""

    KIND = "verdict"
    rank: int
    cause: str
    exit_code: int  # what every torn-down rank exits with
    failed_at_ns: int
    detected_by: int
    detected_at_ns: int
    pid: Optional[int] = None
    host: Optional[str] = None
    returncode: Optional[int] = None
    signal: Optional[str] = None
    exception: Optional[str] = None
    message: Optional[str] = None
    traceback: Optional[str] = None
    detail: str = ""
    oom_suspected: bool = False
    laggards: Tuple[int, ...] = ()  # for a hang: the ranks holding the job up, most likely first
    raised_ns: Optional[int] = None  # a failure's own time, where it said (Failure.raised_ns); failed_at_ns is its record's
    signalled_by: Optional[int] = None  # who sent ``signal``, where known (an interrupt's sender)
    # CLOCK_BOOTTIME when made or taken on this host: ordered against a process's start
    # without the wall clock, which may step between two runs (made_before).
    boot_ns: Optional[int] = None

    def made_before(self, started_ns: int, started_boot_ns: Optional[int]) -> bool:
        """Made before a process of this host (and boot) that started at ``started_ns`` on
        the wall clock, ``started_boot_ns`` on CLOCK_BOOTTIME (None where it has none): by
        CLOCK_BOOTTIME where both have it, else by the wall clock."""
        if self.boot_ns is not None and started_boot_ns is not None:
            return self.boot_ns < started_boot_ns
        return self.detected_at_ns < started_ns


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """Why the job stopped moving, said while it is stuck (events/diagnosis.json, first
    writer wins; rewritten once with ``resolved_ns`` if the job moves again)."""

    KIND = "diagnosis"
    finding: str  # HANG, MISMATCH or BUSY ("kind" in the report; a record's own "kind" says what record it is)
    laggards: Tuple[int, ...]  # the ranks holding the job up (for a mismatch: the odd side)
    entered: Tuple[int, ...]  # the ranks inside the collective, waiting
    since_ns: int  # how long nothing had moved when it was made
    stalled_at_ns: int  # when the job last moved (time_ns)
    time_ns: int  # when it was made
    made_by: int  # the rank whose watcher made it
    detail: str
    group: Optional[str] = None  # the collective it is stuck on: None where none is involved
    seq: Optional[int] = None
    op: Optional[str] = None
    resolved_ns: Optional[int] = None  # the job moved again then: it was slow, not stuck
    # When hang_timeout=auto ends the job if nothing moves (time_ns): at once for a hang or a
    # mismatch, shortly before the collective timeout for busy laggards. None: at once.
    end_at_ns: Optional[int] = None
    # (rank, host) of the laggards on other hosts, as their hosts' summaries named them
    # (peerwatch.hangs.diagnose.Summary): a verdict names the host of a rank not registered here.
    hosts: Tuple[Tuple[int, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class NotSignalled:
    """An enforcer could not verify a peer that gave no acknowledgement: not signalled."""

    KIND = "unsignalled"
    rank: int
    pid: int
    time_ns: int
    reason: str
    observed_by: int


@dataclasses.dataclass(frozen=True)
class WatcherDeath:
    """The rank's watcher thread died: this rank is no longer protected (``peerwatch status``)."""

    KIND = "watcher-death"
    rank: int
    pid: int
    time_ns: int
    exception: str  # the exception's type
    message: str


WATCHER_DEATH = "watcher"  # events/watcher-<rank>.json: a WatcherDeath (not an event the watchers act on)

# The events folder's file name prefixes (``<prefix>-<rank>.json``) and their record types.
# ``thread``: an uncaught exception in another thread of the rank (for the report).
EVENT_TYPES: Dict[str, type] = {"success": Success, "failure": Failure, "exit": ExitStatus, "ack": Ack, "thread": Failure,
                                 "unsignalled": NotSignalled, "interrupt": Interrupt}


R = TypeVar("R")


def encode(record: Any) -> bytes:
    # Fields are flat (numbers, strings, tuples of them): no need for dataclasses.asdict's
    # deep copy, which was half the cost of an idle watcher's heartbeat.
    cls = type(record)
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(record))
    body: Dict[str, Any] = {"version": RECORD_VERSION, "kind": cls.KIND}
    for name in names:
        body[name] = getattr(record, name)
    return _ENCODER.encode(body).encode()


_ENCODER = json.JSONEncoder(separators=(",", ":"))  # made once: json.dumps(separators=) makes one a call
_FIELD_NAMES: Dict[type, Tuple[str, ...]] = {}


def decode(cls: Type[R], data: bytes) -> Optional[R]:
    """Parse ``data`` as a record of ``cls``; ``None`` if it is not one.

    Decoding is pure and records are frozen with flat fields, so the same bytes give the
    same record: a teardown reads most records twice or more (the watcher's scan, then the
    report's two builds), and each decode with its field checks cost about 40 µs. The last
    ones decoded are kept, up to :data:`DECODED_BYTES` of input."""
    if type(data) is not bytes:
        return _decode(cls, bytes(data))
    key = (cls, data)
    found = _DECODED.get(key)
    if found is not None:
        return found  # type: ignore[no-any-return]
    record = _decode(cls, data)
    if record is not None and len(data) <= DECODED_BYTES // 16:
        global _decoded_bytes
        if _decoded_bytes + len(data) > DECODED_BYTES:
            _DECODED.clear()  # heartbeats change every beat: old ones go, all at once
            _decoded_bytes = 0
        _DECODED[key] = record
        _decoded_bytes += len(data)
    return record


DECODED_BYTES = 1 << 20  # the memo of decode() holds at most this much input
_DECODED: Dict[Tuple[type, bytes], Any] = {}
_decoded_bytes = 0


def _decode(cls: Type[R], data: bytes) -> Optional[R]:
    if len(data) > MAX_RECORD_BYTES:
        return None
    try:
        body = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(body, dict):
        return None
    version = body.get("version")
    if type(version) is not int or version != RECORD_VERSION or body.get("kind") != cls.KIND:  # type: ignore[attr-defined]
        return None
    values = {}
    for name, expected in _fields(cls):
        if name not in body:
            continue  # its default; a required field missing fails in cls() below
        value = _check(body[name], expected)
        if value is _INVALID:
            return None
        values[name] = value
    try:
        record = cls(**values)
    except (TypeError, ValueError):
        return None
    return record if in_range(record) else None


_INVALID = object()

MAX_SIGNAL = 64  # the highest signal number on Linux (SIGRTMAX)


def _exit_code_ok(code: Optional[int]) -> bool:
    """An exit code a failure can carry: 1-255 (0 is success; 256 would exit 0)."""
    return code is None or 1 <= code <= 255


def _returncode_ok(code: Optional[int]) -> bool:
    """As subprocess reports it: -N for signal N, else an exit status 0-255."""
    return code is None or -MAX_SIGNAL <= code <= 255


def _ranges(record: Any) -> bool:
    """Checks beyond types, per record type: what a record of ours can hold."""
    if isinstance(record, Registration):
        return (
            record.pid > 0 and record.ppid >= 0 and record.start_ticks >= 0 and record.uid >= 0
            and (record.world_size is None or (record.world_size > 0 and record.rank < record.world_size))
            and (record.local_rank is None or record.local_rank >= 0)
        )
    if isinstance(record, Failure):
        return record.pid >= 0 and _exit_code_ok(record.exit_code)  # pid 0: a host's record, written by the bridge
    if isinstance(record, ExitStatus):
        return record.pid > 0 and _returncode_ok(record.returncode) and record.observed_by >= 0
    if isinstance(record, Verdict):
        return (
            1 <= record.exit_code <= 255 and record.detected_by >= 0 and (record.pid is None or record.pid >= 0)
            and _returncode_ok(record.returncode) and all(r >= 0 for r in record.laggards)
        )
    if isinstance(record, Heartbeat):
        return (record.pid > 0 and record.seq >= 0 and all(p > 0 and t >= 0 for p, t in record.children)
                and all(v >= 0 for v in record.activity))
    if isinstance(record, NotSignalled):
        return record.pid > 0 and record.observed_by >= 0
    if isinstance(record, Diagnosis):
        return record.finding in (HANG, MISMATCH, BUSY) and all(r >= 0 for r in record.laggards + record.entered)
    if isinstance(record, (Success, Ack, Interrupt)):
        return record.pid > 0
    return True


_RANK_FIELDS = ("rank", "detected_by", "observed_by", "made_by")  # a single rank each


def named_ranks(record: Any) -> Tuple[int, ...]:
    """Every rank ``record`` names: its own, who saw or made it, the laggards and the
    ranks inside the collective (a diagnosis'). Each must be inside the run's world."""
    ranks = [v for v in (getattr(record, f, None) for f in _RANK_FIELDS) if type(v) is int]
    ranks += getattr(record, "laggards", ())
    if isinstance(record, Diagnosis):
        ranks += record.entered
    return tuple(ranks)


def in_range(record: Any) -> bool:
    """True if every field of ``record`` is in its range: ranks and times not negative,
    pids positive (0 for "no process", where a record may say so), exit codes 1-255 where
    they are a failure's, return codes -64..255. A record out of range was not written by
    peerwatch and is treated as malformed: it would otherwise make every rank exit 0 on a
    failure (exit code 256) or name a process that is no rank."""
    for name in ("rank", "time_ns"):
        value = getattr(record, name, None)
        if value is not None and value < 0:
            return False
    return _ranges(record)


def _check(value: Any, expected: Any) -> Any:
    # The plain types first: they are most fields, and get_origin costs more than the test.
    if expected is int or expected is str or expected is bool:
        return value if type(value) is expected else _INVALID
    if expected is type(None):
        return None if value is None else _INVALID
    origin = typing.get_origin(expected)
    if origin is typing.Union:
        for option in typing.get_args(expected):
            checked = _check(value, option)
            if checked is not _INVALID:
                return checked
        return _INVALID
    if origin is tuple:
        args = typing.get_args(expected)
        if not isinstance(value, list):
            return _INVALID
        if len(args) == 2 and args[1] is Ellipsis:
            items = [_check(v, args[0]) for v in value]
        elif len(args) == len(value):
            items = [_check(v, a) for v, a in zip(value, args)]
        else:
            return _INVALID
        return _INVALID if any(i is _INVALID for i in items) else tuple(items)
    return _INVALID


_FIELDS: Dict[type, Tuple[Tuple[str, Any], ...]] = {}


def _fields(cls: type) -> Tuple[Tuple[str, Any], ...]:
    """(name, type) of each field of a record class; worked out once per class
    (``get_type_hints`` costs about a millisecond: see :func:`warm`)."""
    found = _FIELDS.get(cls)
    if found is None:
        hints = typing.get_type_hints(cls)
        found = _FIELDS[cls] = tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))  # type: ignore[arg-type]
    return found


def warm() -> None:
    """Work out every record class's field types now (the watcher thread, as it starts),
    not on the first read of each: that is at a teardown, where 8 ranks on 2 cores spent
    about a millisecond each on it, while their peers waited for the CPU."""
    for cls in (*EVENT_TYPES.values(), Registration, Heartbeat, Verdict, Diagnosis):
        _fields(cls)


def json_int(v: Any) -> int:
    """``v``, read from JSON, if it is an int (a bool is not); TypeError otherwise."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError("not an int")
    return v


def returncode_exit_code(returncode: int) -> int:
    """The shell's view of a subprocess returncode: signal N -> 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def signal_name(signum: int) -> str:
    try:
        return _signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


__all__ = [
    "BUSY", "EXCEPTION", "EXIT", "HANG", "INTERRUPTED", "LOST", "MISMATCH", "MISSING", "SIGNAL", "VANISHED",
    "EVENT_TYPES", "Activity", "Ack", "Diagnosis", "ExitStatus", "Failure", "Heartbeat", "Interrupt", "NotSignalled", "Registration", "Success", "Verdict",
    "WATCHER_DEATH", "WatcherDeath",
    "HANG_EXIT_CODE", "MAX_RECORD_BYTES", "MAX_SIGNAL", "RECORD_VERSION", "decode", "encode", "in_range", "json_int", "named_ranks", "returncode_exit_code", "warm",
    "signal_name",
]
