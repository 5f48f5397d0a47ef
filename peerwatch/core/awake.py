"""How long a judge was awake to see a silence: the one rule by which every judge of this
package turns elapsed time into a verdict. Pure: no clock, times are passed in.

A judge looks at its sources at a known pace. If more than ``cap_ns`` passes between two
of its looks, it was not running meanwhile: the whole process stopped (SIGSTOP, a
scheduler's suspend, a debugger), the machine was starved, or its thread could not get
the GIL. What it sees when it runs again is a snapshot of peers that were perhaps stopped
with it, and resumed with it or a moment later: their heartbeats have not been refreshed
yet. So a silence counts only from the later of its start and the judge's last resume,
and every peer gets the time it needs to speak again before its silence counts.

One clock per judge (the watcher thread's, the store bridge's), owned by its thread.
"""

from __future__ import annotations

from typing import Optional

# A judge that looks once a heartbeat interval (or sooner) and finds more than this many
# intervals gone since its last look was not running meanwhile.
CAP_INTERVALS = 2


class AwakeClock:
    """When its judge last resumed after a gap of more than ``cap_ns`` between two looks."""

    @classmethod
    def every(cls, interval_s: float) -> AwakeClock:
        """The clock of a judge that looks every ``interval_s`` at most."""
        return cls(int(CAP_INTERVALS * interval_s * 1e9))

    def __init__(self, cap_ns: int) -> None:
        self.cap_ns = cap_ns
        self.since_ns = 0  # the judge has been awake since then (0: since it started)
        self._last_ns: Optional[int] = None

    def tick(self, now_ns: int) -> bool:
        """The judge looks now; True if it was not running since its last look."""
        gap = self._last_ns is not None and now_ns - self._last_ns > self.cap_ns
        if gap:
            self.since_ns = now_ns  # we were not looking: silences count from now on
        self._last_ns = now_ns
        return gap

    def counted_ns(self, start_ns: int, now_ns: int) -> int:
        """How much of the time from ``start_ns`` to ``now_ns`` counts: the part since the
        judge last resumed."""
        return now_ns - max(start_ns, self.since_ns)


__all__ = ["CAP_INTERVALS", "AwakeClock"]
