"""What a rank is doing while the job does not move: the signs of work the host shows.

A laggard that works (writes a checkpoint, evaluates, waits for data loader workers that
decode) and one that is stuck (blocked on a lock, spinning on the same lines, frozen)
look the same to the collective counters; they differ in what the kernel counts for
them. While this rank's counters stand still, its watcher samples once a heartbeat the
signs of work docs/hangs.md ("Busy or stuck") lists: its main thread's CPU time and the
places its stack was seen at, its other threads' CPU time and the bytes they move
(peerwatch's own threads excepted), its main thread's own bytes, its descendants' CPU
time. Each "CPU time" counts the run delay too (``/proc/.../schedstat``: on a crowded host
a working rank waits for a CPU, a stuck one does not), up to ``WAIT_CAP`` times the CPU
time used (a thread that only wakes often to sleep again waits at every wake).

The figures over the last ``WINDOW`` samples go out with the heartbeat, so a judge on any
host can tell (peerwatch.hangs.diagnose.busy_evidence, pure). A sample whose figures
cannot be read is not taken: a figure not read is unknown, never idle.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from collections import deque
from typing import Deque, Dict, Iterable, List, Optional, Set, Tuple

from ..core.records import Activity  # the record (pure); this module samples it

WINDOW = 8  # samples (heartbeats) the published figures cover
WAIT_CAP = 4  # a task's wait for a CPU counts up to this many times the CPU time it used meanwhile
_TICK_MS = 1000.0 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


@dataclasses.dataclass(frozen=True)
class _Sample:
    mono_ns: int
    cpu_ms: float
    other_cpu_ms: float
    io_bytes: int
    main_io_bytes: int
    children_cpu_ms: float
    place: int


class ActivitySampler:
    """Samples this process's signs of work. Owned by the watcher thread."""

    def __init__(self) -> None:
        self._samples: Deque[_Sample] = deque(maxlen=WINDOW + 1)
        self._tid = threading.main_thread().native_id
        self._children_cpu: Dict[Tuple[int, int], float] = {}  # child -> CPU ms last read (one that exits keeps its share)
        self._main_wait, self._other_wait, self._children_wait = _Waits(), _Waits(), _Waits()

    def reset(self) -> None:
        """The counters moved: what came before says nothing of the next stall."""
        self._samples.clear()
        self._children_cpu.clear()
        for waits in (self._main_wait, self._other_wait, self._children_wait):
            waits.clear()

    def sample(self, children: Iterable[Tuple[int, int]]) -> None:
        """Take one sample; none where a figure cannot be read (EMFILE, EACCES): a figure
        not read is unknown. Read as 0, a last sample's CPU time made the window of a rank
        that works look idle; left out, the window has a sample less (too few: the judge
        waits)."""
        for child in children:
            used = _cpu_ms(f"/proc/{child[0]}/stat", child[1])
            if used is not None:  # its main thread's run delay: a data loader worker has one thread
                self._children_cpu[child] = used
                self._children_wait.note(child, f"/proc/{child[0]}/schedstat")
        ours = _own_threads()
        self._main_wait.note(self._tid, f"/proc/self/task/{self._tid}/schedstat")
        self._note_other_waits({t for t in [*ours, self._tid] if t is not None})
        # Read last and together: what runs between two of these reads is counted once too
        # often or not at all.
        own_cpu = sum(_thread_cpu_ms(tid) or 0.0 for tid in ours)
        own_io = sum(_io_bytes(f"/proc/self/task/{tid}/io") or 0 for tid in ours)
        main, main_io = _thread_cpu_ms(self._tid), _io_bytes(f"/proc/self/task/{self._tid}/io")
        total, total_io = _process_cpu_ms(), _io_bytes("/proc/self/io")
        if main is None or main_io is None or total is None or total_io is None:
            return
        self._samples.append(_Sample(
            mono_ns=time.monotonic_ns(), cpu_ms=main + self._main_wait.total_ms,
            other_cpu_ms=total - main - own_cpu + self._other_wait.total_ms, io_bytes=total_io - own_io,
            main_io_bytes=main_io, children_cpu_ms=sum(self._children_cpu.values()) + self._children_wait.total_ms,
            place=_main_stack_key(),
        ))

    def _note_other_waits(self, not_these: Set[int]) -> None:
        """The run delay of this process's other threads, since the last sample."""
        try:
            tids = [int(t) for t in os.listdir("/proc/self/task")]
        except (OSError, ValueError):
            return
        for tid in tids:
            if tid not in not_these:
                self._other_wait.note(tid, f"/proc/self/task/{tid}/schedstat")

    def current(self) -> Optional[Activity]:
        """The figures over the samples kept; None before two of them."""
        if len(self._samples) < 2:
            return None
        first, last = self._samples[0], self._samples[-1]
        return Activity(
            span_ms=max(0, (last.mono_ns - first.mono_ns) // 1_000_000),
            cpu_ms=max(0, round(last.cpu_ms - first.cpu_ms)),
            places=len({s.place for s in list(self._samples)[1:]}),
            other_cpu_ms=max(0, round(last.other_cpu_ms - first.other_cpu_ms)),
            io_bytes=max(0, last.io_bytes - first.io_bytes),
            children_cpu_ms=max(0, round(last.children_cpu_ms - first.children_cpu_ms)),
            samples=len(self._samples) - 1,
            main_io_bytes=max(0, last.main_io_bytes - first.main_io_bytes),
        )


def _own_threads() -> List[int]:
    """Native ids of peerwatch's threads (its watcher, launcher, bridge): their /proc
    walks and heartbeats are not the rank's work."""
    return [
        t.native_id for t in threading.enumerate()
        if t.native_id is not None and t is not threading.main_thread()
        and t.name.startswith("peerwatch")
    ]


def _thread_cpu_ms(tid: Optional[int]) -> Optional[float]:
    """A thread of this process's time on a CPU, in ms: to the nanosecond from its
    ``schedstat``, in clock ticks from its ``stat`` where the kernel keeps no schedstat. Its
    utime and stime are each cut to a tick: a difference of two sums was up to 20 ms off,
    more than a thread that wakes to sleep again uses in seconds."""
    if tid is None:
        return None
    ran = _schedstat_ms(f"/proc/self/task/{tid}/schedstat")
    return ran[0] if ran is not None else _cpu_ms(f"/proc/self/task/{tid}/stat")


def _process_cpu_ms() -> Optional[float]:
    """This process's time on a CPU, every thread's, those ended too, in ms (to the
    nanosecond; in clock ticks where the clock cannot be read)."""
    try:
        return time.clock_gettime_ns(time.CLOCK_PROCESS_CPUTIME_ID) / 1e6
    except (AttributeError, OSError):
        return _cpu_ms("/proc/self/stat")


def _cpu_ms(path: str, start_ticks: Optional[int] = None) -> Optional[float]:
    """utime + stime of a task, in ms; None if it is gone (or another process now)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        fields = data[data.rfind(b")") + 2 :].split()
        if start_ticks is not None and int(fields[19]) != start_ticks:
            return None
        return (int(fields[11]) + int(fields[12])) * _TICK_MS
    except (OSError, IndexError, ValueError):
        return None


class _Waits:
    """The time tasks waited for a CPU, counted as work: per task and per interval between
    two samples, at most ``WAIT_CAP`` times the CPU time the task used in it. A task that
    computes on a crowded host waits about as long as it runs, or a few times longer; one
    that wakes only to sleep again uses next to nothing, and its waits count next to nothing."""

    def __init__(self) -> None:
        self._last: Dict[object, Tuple[float, float]] = {}  # task -> (on a CPU, waiting for one), ms, last read
        self.total_ms = 0.0  # counted so far (a task that ends keeps its share)

    def clear(self) -> None:
        self._last.clear()
        self.total_ms = 0.0

    def note(self, task: object, schedstat: str) -> None:
        now = _schedstat_ms(schedstat)
        if now is None:
            return
        before = self._last.get(task)
        self._last[task] = now
        if before is not None:
            ran, waited = now[0] - before[0], now[1] - before[1]
            self.total_ms += max(0.0, min(waited, WAIT_CAP * ran))


def _schedstat_ms(path: str) -> Optional[Tuple[float, float]]:
    """(time on a CPU, time runnable but waiting for one) of a task, in ms, from its
    ``schedstat``; None where the kernel does not say (or the task is gone)."""
    try:
        with open(path, "rb") as f:
            fields = f.read().split()
        return int(fields[0]) / 1e6, int(fields[1]) / 1e6
    except (OSError, IndexError, ValueError):
        return None


def _io_bytes(path: str) -> Optional[int]:
    """rchar + wchar of a task: every byte it read or wrote, cached or not."""
    try:
        with open(path, "rb") as f:
            total = 0
            for line in f.read().splitlines():
                if line.startswith((b"rchar:", b"wchar:")):
                    total += int(line.split()[1])
            return total
    except (OSError, IndexError, ValueError):
        return None


def _main_stack_key() -> int:
    """The main thread's whole stack (code objects and lines) as one number."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    places = []
    while frame is not None:
        places.append((id(frame.f_code), frame.f_lineno))
        frame = frame.f_back
    return hash(tuple(places))


__all__ = ["WAIT_CAP", "WINDOW", "Activity", "ActivitySampler"]
