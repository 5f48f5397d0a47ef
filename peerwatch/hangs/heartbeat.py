"""This rank's heartbeat: that its watcher runs, how far its training got, its children.

Threads:
- :class:`OwnProgress` is written by the training thread only (``beat()``, ``paused()``) and
  read by the watcher thread (single ints: no torn reads). Its first ``beat()`` calls
  ``on_first_beat`` in the training thread (the GIL watchdog is armed there).
- :class:`HeartbeatWriter` writes from three threads: the watcher thread every
  ``heartbeat_interval``, the training thread when it enters or leaves ``paused()`` (the
  judges must not miss a pause), and whichever thread ends the rank (its last heartbeat,
  ``leaving()``); its one lock serialises them.
- ``children_changed`` is set by whichever thread forked, cleared by the writer.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import AbstractSet, Any, Callable, Dict, Optional, Tuple

from ..core.records import Heartbeat, Registration, encode
from ..proc import teardown
from ..proc.activity import ActivitySampler
from ..rundir.rundir import HEARTBEATS, InPlace, RunDir, rank_file
from .collectives import FAILING, OFF, CollectiveReader, Counters, Entered, in_torch_distributed
from .waits import STILL_BEATS, EnqueueWindow, WaitSampler, WaitWindow

logger = logging.getLogger("peerwatch")

CHILDREN_SCAN_EVERY = 10  # heartbeats between snapshots of our own descendants (costs a /proc walk)
# Heartbeats with unchanged collective counters before the flight recorder's entries are
# read (tens of ms once its ring is full): once per stall, after at least this many and
# twice the longest quiet spell seen so far, so never on a job that keeps moving, however
# slow its steps.
ENTRIES_AFTER_BEATS = 2
ENTRIES_WARMUP_MOVES = 10  # quiet spells before this many movements (start-up, compiling) are not learnt
ENTRIES_KEPT = 3  # per process group, the last collectives published (a mismatch shows one back)


class OwnProgress:
    """What the training said of itself. Written by the training thread only."""

    def __init__(self, on_first_beat: Optional[Callable[[], None]] = None) -> None:
        self.step: Optional[int] = None
        self._on_first_beat = on_first_beat  # called by the training thread at its first beat()
        self.progress_ns: Optional[int] = None  # time.monotonic_ns() of the last beat()
        self.paused = 0  # depth of nested paused()

    def beat(self, step: Optional[int]) -> None:
        first = self.step is None
        self.step = (self.step or 0) + 1 if step is None else step
        self.progress_ns = time.monotonic_ns()
        if first and self._on_first_beat is not None:
            self._on_first_beat()

    def pause(self, delta: int) -> None:
        # Progress first: a heartbeat written in between must not say "not paused" with
        # the progress of before a long pause (a hang judge would see no progress for the
        # whole pause; seen under load at the end of a paused() phase).
        self.progress_ns = time.monotonic_ns()
        self.paused = max(0, self.paused + delta)


def main_thread_position() -> Tuple[str, bool]:
    """Where the main thread is ("file:line in function" of its innermost frame outside
    torch.distributed), and whether it is waiting inside torch.distributed."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    waiting = False
    while frame is not None:
        filename = frame.f_code.co_filename
        if in_torch_distributed(filename):
            waiting = True
        elif not filename.startswith("<"):
            return f"{os.path.basename(filename)}:{frame.f_lineno} in {frame.f_code.co_name}", waiting
        frame = frame.f_back
    return "", waiting


class HeartbeatWriter:
    """Writes this rank's heartbeat record.

    On a shared filesystem the record is replaced (temp file + rename): other hosts read it
    through NFS close-to-open consistency, and an in-place write could be seen torn or
    stale. On a local one it is rewritten in place with one pwrite (readers re-read a torn
    record), which keeps an idle watcher cheap.
    """

    def __init__(
        self, run_dir: RunDir, me: Registration, progress: OwnProgress, with_position: bool, read_collectives: bool = True,
        measure_waits: bool = False, interval_s: float = 1.0,
    ) -> None:
        self._run_dir = run_dir
        self._me = me
        self._progress = progress
        self._with_position = with_position  # where the main thread is: only the hang judges use it
        self._lock = threading.Lock()
        self._ending = False  # the rank is ending: its heartbeats are written whole (see write)
        self._last_step: Optional[int] = None  # the step of the last heartbeat written while ending
        self._leaving_ns: Optional[int] = None  # see leaving(); guarded by _lock
        self._unsaid = False  # leaving() has news for the next last heartbeat, whatever its step
        self._file = InPlace(run_dir, HEARTBEATS, rank_file("rank", me.rank))
        self._seq = 0  # guarded by _lock
        self._children: Tuple[Tuple[int, int], ...] = ()  # guarded by _lock
        self.children_changed = threading.Event()
        # torch's collective counters: read by the watcher thread only (write(read_counters=True)),
        # where the diagnosis or hang_timeout needs them (read_collectives).
        self._read_collectives = read_collectives
        self._reader = CollectiveReader(me.rank)
        self._counters: Counters = ()  # guarded by _lock, as the rest below
        self._moved_ns: Optional[int] = None
        self._still = 0  # heartbeats since the counters last changed
        self._longest_still = 0  # the most heartbeats the counters stayed unchanged before moving again
        self._moves = 0  # how many times they moved
        self._entered: Entered = ()
        self._timeouts_read: set = set()  # groups whose collective timeout was looked for
        self._activity = ActivitySampler()  # sampled while the counters stand still (busy or stuck?)
        self._published: Optional[Heartbeat] = None  # the last record written, guarded by _lock
        self._stamped: Optional[Stamped] = None  # the last record written in place, to write again
        # The straggler's measure: sampled once the counters are read (torch.distributed in use).
        self._sampler: Optional[WaitSampler] = WaitSampler(me.rank) if measure_waits and read_collectives else None
        self._sampling = False
        self._waits = WaitWindow(interval_s)
        self._enqueued = EnqueueWindow(interval_s)  # the enqueue measure (waits inside C++: DDP's)

    def stop(self) -> None:
        """Stop the wait sampler's thread (the rank is done)."""
        if self._sampler is not None:
            self._sampler.stop()

    def published(self) -> Optional[Heartbeat]:
        """This rank's heartbeat as last written (its collectives and signs of work, for
        a judge judging itself); None before the first one."""
        with self._lock:
            if self._published is None and self._stamped is not None:
                self._published = self._stamped.last()
            return self._published

    def training(self) -> bool:
        """The rank began its steps: a ``beat()``, or a collective entered (read by the
        watcher thread, which counts them). Before that it imports and loads: ``import
        torch`` holds the GIL for seconds in one call on a loaded machine."""
        return self._progress.step is not None or self._moves > 0

    def counts_collectives(self) -> bool:
        """True once torch's collective counters were read (the watcher thread, which
        writes them: no lock needed)."""
        return bool(self._counters)

    def _read_counters(self) -> None:
        """Read the counters (the watcher thread, once a heartbeat); the entries once per stall."""
        counters = self._reader.counters()
        if counters is None:
            if self._reader.state == FAILING and self._counters:
                # Counters no longer read must not look like counters that stopped: the
                # judges would take this rank for a laggard. Unread, it is left out.
                self._counters, self._entered, self._still = (), (), 0
            return
        # Movement is a rank entering a collective: a completion alone is not (a collective
        # that fails with the timeout completes too).
        entered_one = [(g, e) for g, e, _ in counters] != [(g, e) for g, e, _ in self._counters]
        self._counters = counters
        # Sampled while moving: a job whose steps are longer than STILL_BEATS heartbeats
        # keeps its sampler going between collectives (twice its longest quiet spell).
        self._measure_waits(entered_one or self._still + 1 < max(STILL_BEATS, 2 * self._longest_still + 1))
        if entered_one:
            self._moves += 1
            if self._moves > ENTRIES_WARMUP_MOVES:
                self._longest_still = max(self._longest_still, self._still)
            self._moved_ns, self._still, self._entered = time.monotonic_ns(), 0, ()
            self._activity.reset()
            new = {g for g, e, _ in counters if e > 0} - self._timeouts_read
            if new:  # a new group: its timeout, while the recorder's ring is still short
                self._timeouts_read |= new
                self._reader.entered(counters, ENTRIES_KEPT)
            return
        self._still += 1
        if self._still == max(ENTRIES_AFTER_BEATS, 2 * self._longest_still):
            self._entered = self._reader.entered(counters, ENTRIES_KEPT)

    def _measure_waits(self, moving: bool) -> None:
        if self._sampler is None:
            return
        self._sampler.moving(moving)
        if not self._sampling:
            self._sampling = True
            self._sampler.start()
        if self._waits.tick(self._sampler.counts, self._counters) and self._enqueued.due(self._counters):
            self._enqueued.add(self._reader.enqueued(), time.time_ns())

    def write(self, peer_pids: Callable[[], AbstractSet[int]], read_counters: bool = False, last: bool = False) -> None:
        """Write the heartbeat now. ``peer_pids``: the local peers' pids (not our children to
        list), asked for only when the children are listed again. ``read_counters``: read
        torch's collective counters first (the watcher thread's heartbeat only). ``last``:
        the rank is ending (the step it stopped at, for the report): written whole, by temp
        file and rename, since the process may end in the middle of an in-place rewrite."""
        with self._lock:
            if last and self._ending and self._progress.step == self._last_step and not self._unsaid:
                return  # already written at this step (a whole-file write costs a few ms at teardown)
            self._unsaid = False
            self._seq += 1
            if read_counters and self._read_collectives:
                self._read_counters()
            sampling = read_counters and self._still > 0
            # While the counters stand still, every beat: a child started then (subprocess's
            # fork runs no Python at-fork hook) is work the hang judges must see at once.
            if self.children_changed.is_set() or self._seq % CHILDREN_SCAN_EVERY == 1 or sampling:
                self.children_changed.clear()
                self._children = tuple(teardown.descendants(os.getpid(), os.geteuid(), set(peer_pids())))
            if sampling:
                self._activity.sample(self._children)
            self._ending = self._ending or last  # from now on, whole files only
            fields = self._fields()
            if self._ending:
                self._last_step = fields["step"]
            self._write(fields, atomic=self._ending)

    def write_last(self, peer_pids: Callable[[], AbstractSet[int]]) -> None:
        """The step this rank stopped at, for the report and ``peerwatch status``: the last
        heartbeat (``write(last=True)``). Never raises: it must never stop a teardown or an exit."""
        try:
            self.write(peer_pids, last=True)
        except Exception:  # noqa: BLE001
            logger.debug("peerwatch: rank %d could not write its last heartbeat", self._me.rank, exc_info=True)

    def leaving(self, peer_pids: Callable[[], AbstractSet[int]]) -> None:
        """The rank's program has ended with no outcome recorded, and its interpreter is about
        to finalize: say so (``leaving_ns``) in a heartbeat written whole, now, before the
        sockets close. It costs nothing more: that is the rank's last heartbeat (``stop()``'s
        at atexit is then skipped, at the same step), and only a peer judging an exception
        raised by torch.distributed reads it."""
        with self._lock:
            if self._leaving_ns is not None:
                return
            self._leaving_ns, self._unsaid = time.time_ns(), True
        self.write(peer_pids, last=True)

    def _fields(self) -> Dict[str, Any]:
        """Every field of the next record but ``time_ns`` and ``seq``: what it says."""
        # Where the main thread is: for the hang judges, and once the counters stop moving.
        stalled = self._still > 0 and bool(self._counters)
        where, waiting = main_thread_position() if self._with_position or stalled else ("", False)
        activity = self._activity.current()
        p = self._progress
        return dict(
            rank=self._me.rank, pid=os.getpid(), step=p.step,
            progress_ns=p.progress_ns, paused=p.paused > 0, children=self._children, where=where,
            in_collective=waiting, collectives=self._counters, moved_ns=self._moved_ns, entered=self._entered,
            pg_timeout_ms=min(self._reader.timeout_ms.values(), default=0),
            activity=activity.as_tuple() if stalled and activity is not None else (),
            collectives_state=self._reader.state if self._read_collectives else OFF, collectives_error=self._reader.error,
            leaving_ns=self._leaving_ns, waits=self._waits.slots(), enqueued=self._enqueued.rows(),
        )

    def _write(self, fields: Dict[str, Any], atomic: bool = False) -> None:
        """Write the record of ``fields``, now. A record that says what the last one said (an
        idle rank's, beat after beat) is the last one's bytes with a new time and seq: one
        ``pwrite`` and no encoding (:class:`Stamped`)."""
        rd = self._run_dir
        now = time.time_ns()
        try:
            if rd.shared or atomic:
                self._stamped = None
                self._published = Heartbeat(time_ns=now, seq=self._seq, **fields)
                rd.write(HEARTBEATS, rank_file("rank", self._me.rank), encode(self._published), replace=True)
                return
            stamped = self._stamped
            if stamped is None or stamped.fields != fields:
                stamped = self._stamped = Stamped(fields)
            self._published = None  # made from _stamped when asked for (published())
            self._file.write(stamped.at(now, self._seq))
        except OSError as e:
            rd.warn_once(rd.join(HEARTBEATS), f"heartbeat cannot be written ({e.strerror})")


class Stamped:
    """A heartbeat's encoding, kept to be written again with a new ``time_ns`` and ``seq``
    while every other field stays as it is (``fields``: all of them but those two)."""

    def __init__(self, fields: Dict[str, Any]) -> None:
        self.fields = fields
        self._time_ns, self._seq = 0, 0
        data = encode(self.last())
        head, found, tail = data.partition(b'"time_ns":0,"seq":0')
        # Found in the encoding itself: a record whose two fields are not side by side there
        # (another encoding) is encoded whole every time, never written wrong.
        self._parts = (head + b'"time_ns":', b',"seq":', tail) if found else None

    def at(self, time_ns: int, seq: int) -> bytes:
        """The record's bytes with this time and seq."""
        self._time_ns, self._seq = time_ns, seq
        if self._parts is None:
            return encode(self.last())
        head, middle, tail = self._parts
        return b"%s%d%s%d%s" % (head, time_ns, middle, seq, tail)

    def last(self) -> Heartbeat:
        """The record last made by :meth:`at`."""
        return Heartbeat(time_ns=self._time_ns, seq=self._seq, **self.fields)

__all__ = ["CHILDREN_SCAN_EVERY", "HeartbeatWriter", "OwnProgress", "Stamped", "main_thread_position"]
