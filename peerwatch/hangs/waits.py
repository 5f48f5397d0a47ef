"""How long this rank's main thread waits inside torch.distributed: the measure behind
the straggler finding (:mod:`peerwatch.hangs.straggler`, pure).

A small daemon thread (``peerwatch-waits-rank<N>``) looks at the main thread's innermost
Python frame every ``SAMPLE_S``: inside torch.distributed's own code (an ``all_reduce``
waiting for its peers) or not. It counts, and nothing else (a dict lookup and a string
test, a few microseconds, 20 times a second), and only while the job moves (its
collective counters changed in the last ``STILL_BEATS`` heartbeats): an idle or stuck
job costs no wake-up. The watcher thread closes a slot every
slot (``SLOT_BEATS`` heartbeats, on the wall clock) with the samples counted and the collectives entered in it (from
torch's counters, which it reads anyway), and the heartbeat publishes the last ``SLOTS``.

What it cannot see: a wait that happens in C++ with no Python frame of torch.distributed
above it (DDP's gradient all-reduces, waited for inside ``backward()``). For those,
:class:`EnqueueWindow` publishes when this rank entered its collectives, from torch's
flight recorder, which the judge compares between the ranks of the host (docs/stragglers.md).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import deque
from typing import Deque, Dict, List, Optional, Sequence, Tuple

from .collectives import Counters, in_torch_distributed
from .straggler import SLOT_BEATS, SLOTS, Slot, enqueued_row, row_text

logger = logging.getLogger("peerwatch")

SAMPLE_S = 0.05  # how often the main thread is looked at
# Tests only, not documented (as PEERWATCH_TEST_NO_INOTIFY): shorter slots, and a sampler as
# much faster, so an end-to-end test sees the rule's 6 to 12 slots of as many samples as a
# slot of its heartbeat would hold, in a fraction of the time (tests/harness.py).
SLOT_S_VAR = "PEERWATCH_TEST_STRAGGLER_SLOT_S"  # a slot's length, rounded to whole heartbeats
SAMPLE_S_VAR = "PEERWATCH_TEST_STRAGGLER_SAMPLE_S"  # the sampler's interval
JOIN_S = 0.5  # at most, at the interpreter's shutdown: it ends within one sample
STILL_BEATS = 5  # heartbeats (a slot) with unchanged counters after which the sampler sleeps


def _test_override(var: str) -> Optional[float]:
    try:
        value = float(os.environ.get(var, ""))
    except ValueError:
        return None
    return value if 0 < value < 3600 else None


def slot_beats(interval_s: float) -> int:
    """Heartbeats per slot: ``SLOT_BEATS``, unless a test set ``PEERWATCH_TEST_STRAGGLER_SLOT_S``."""
    slot_s = _test_override(SLOT_S_VAR)
    return SLOT_BEATS if slot_s is None else max(1, round(slot_s / interval_s))


def sample_s() -> float:
    """The sampler's interval: ``SAMPLE_S``, unless a test set ``PEERWATCH_TEST_STRAGGLER_SAMPLE_S``."""
    return _test_override(SAMPLE_S_VAR) or SAMPLE_S


class WaitSampler:
    """Counts samples of the main thread, and those waiting in a collective. Its thread
    writes ``counts`` (one tuple, replaced whole); anyone reads it."""

    def __init__(self, rank: int) -> None:
        self.counts: Tuple[int, int] = (0, 0)
        self._sample_s = sample_s()
        self._stop = threading.Event()
        self._moving = threading.Event()  # set while the job moves: a still job costs no wake-up
        self._thread = threading.Thread(target=self._run, name=f"peerwatch-waits-rank{rank}", daemon=True)

    def start(self) -> None:
        self._thread.start()
        # Ended and joined as the interpreter begins to shut down, before it finalizes: a
        # daemon thread waking 20 times a second during finalization made ranks that were
        # ending cleanly abort ("terminate called without an active exception", SIGABRT)
        # one exit in three, in jobs with gloo process groups.
        register = getattr(threading, "_register_atexit", None)  # the stdlib's own (concurrent.futures), 3.9+
        if register is not None:
            try:
                register(self._end)
            except RuntimeError:  # the interpreter is shutting down already
                self._end()

    def _end(self) -> None:
        self.stop()
        if self._thread is not threading.current_thread():
            self._thread.join(JOIN_S)

    def moving(self, yes: bool) -> None:
        """Sample while the job moves (its collective counters did lately); not while it
        stands still: an idle or stuck job pays nothing, and a phase with no collectives
        (an evaluation, a checkpoint on every rank) is not counted."""
        if yes:
            self._moving.set()
        else:
            self._moving.clear()

    def stop(self) -> None:
        """Not joined here (the interpreter's shutdown joins it): a daemon thread that holds
        nothing and ends within one sample."""
        self._stop.set()
        self._moving.set()

    def _run(self) -> None:
        try:
            self._sample()
        except Exception:  # noqa: BLE001 - never silently: the finding just stops for this rank
            logger.exception("peerwatch: the wait sampler failed; stragglers are no longer measured on this rank")

    def _sample(self) -> None:
        main = threading.main_thread()
        samples = waiting = 0
        # time.sleep, not stopped.wait(SAMPLE_S): a quarter less CPU a wake-up (no lock made
        # each time), 20 times a second; the thread ends up to one sample after stop().
        while not self._stop.is_set() and main.is_alive():
            self._moving.wait()
            time.sleep(self._sample_s)
            frame = sys._current_frames().get(main.ident or 0)
            samples += 1
            if frame is not None and in_torch_distributed(frame.f_code.co_filename):
                waiting += 1
            self.counts = (samples, waiting)


class WaitWindow:
    """The slots this rank publishes. Owned by the watcher thread (the heartbeat).

    A slot ends at the first heartbeat after the wall clock crossed a multiple of its length
    (``SLOT_BEATS`` heartbeats): every rank's slot N covers about the same time, on every
    host whose clock is about right (the judge aligns them by number)."""

    def __init__(self, interval_s: float) -> None:
        self._slot_ns = max(1, int(interval_s * slot_beats(interval_s) * 1e9))
        self._slots: Deque[Slot] = deque(maxlen=SLOTS)
        self._start: Optional[Tuple[int, int, int, int, int]] = None  # (number, mono_ns, samples, waiting, entered)

    def tick(self, counts: Tuple[int, int], counters: Counters) -> bool:
        """A heartbeat: close the slot if its time is over (True if it did)."""
        now = (time.time_ns() // self._slot_ns, time.monotonic_ns(), counts[0], counts[1],
               sum(e for _, e, _ in counters))
        start = self._start
        if start is not None and now[0] == start[0]:
            return False
        self._start = now
        if start is not None:
            self._slots.append(((now[1] - start[1]) // 1_000_000, now[2] - start[2], now[3] - start[3],
                                max(0, now[4] - start[4]), start[0]))
        return start is not None

    def slots(self) -> Tuple[Slot, ...]:
        return tuple(self._slots)


ENQ_READ_SLOTS = 2  # the flight recorder's entries are read once every this many slots (10 s by default)


class EnqueueWindow:
    """The enqueue times this rank publishes (:func:`peerwatch.hangs.straggler.lateness` judges
    them): per slot, its last collectives' enqueue times, of its busiest process group.
    Owned by the watcher thread (the heartbeat).

    The entries are read from the flight recorder once every ``ENQ_READ_SLOTS`` slots, and
    only if the job entered collectives since the last read: torch copies its whole ring
    (2000 entries: 20-50 ms, holding the GIL) whatever is asked, so the read is made rare,
    and the ring (enqueue times included) covers the slots between reads. Each read adds
    the slots closed since the last one, from the entries' own times."""

    def __init__(self, interval_s: float) -> None:
        self._slot_ns = max(1, int(interval_s * slot_beats(interval_s) * 1e9))
        self._rows: Deque[str] = deque(maxlen=SLOTS)  # as the heartbeat carries them (row_text)
        self._done = -1  # the last slot number published
        self._entered = -1  # collectives entered at the last read
        self._closed = 0  # slots closed since the last read

    def due(self, counters: Counters) -> bool:
        """A slot closed: is a read due now?"""
        self._closed += 1
        entered = sum(e for _, e, _ in counters)
        if self._closed < ENQ_READ_SLOTS or entered == self._entered:
            return False
        self._closed, self._entered = 0, entered
        return True

    def add(self, entries: Sequence[Tuple[int, int, int]], now_ns: int) -> None:
        """The recorder's (group, seq, time_ns) entries, read now: publish the slots closed
        since the last read."""
        current = now_ns // self._slot_ns
        counts: Dict[int, int] = {}
        for group, _, _ in entries:
            counts[group] = counts.get(group, 0) + 1
        if not counts:
            return
        group = max(sorted(counts), key=counts.__getitem__)  # the busiest; ties: the first made
        by_slot: Dict[int, List[Tuple[int, int]]] = {}
        for g, seq, t in entries:
            number = t // self._slot_ns
            if g == group and self._done < number < current:
                by_slot.setdefault(number, []).append((seq, t))
        for number in sorted(by_slot)[-SLOTS:]:
            row = enqueued_row(number, group, by_slot[number])
            if row is not None:
                self._rows.append(row_text(row))
        self._done = current - 1

    def rows(self) -> Tuple[str, ...]:
        return tuple(self._rows)


__all__ = [
    "ENQ_READ_SLOTS", "SAMPLE_S", "SAMPLE_S_VAR", "SLOT_S_VAR", "STILL_BEATS", "EnqueueWindow", "WaitSampler", "WaitWindow",
    "sample_s", "slot_beats",
]
