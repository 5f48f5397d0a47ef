"""When the watcher wakes, and what is due when it does. No OS, no clock: every method
takes ``now`` (seconds of ``time.monotonic()``), so the timing rules are unit-tested.

The watcher sleeps in ``poll(2)`` until a source fires or the earliest of:
1. the next heartbeat (``heartbeat_interval``);
2. where pidfds or inotify are missing, the polling fallback (``fallback_s``), and
   while a look could not tell (``unsure``: out of descriptors...), ``RETRY_S``;
3. in shared-filesystem mode, while this rank is a judge, the remote poll (``remote_s``);
4. the time at which :func:`peerwatch.verdict.decide.decide` said the answer could change
   (``recheck``), or the end of a multi-host hold of an exception verdict (``hold``).
The first wake is immediate: every peer may have registered before our inotify watch
began. A full look at the run directory is taken on every wake that a source caused,
on the first, in the fallback, on every beat in shared-filesystem mode, and otherwise
every ``SAFETY_LOOK_EVERY`` beats (inotify and pidfds wake us for every change; this
look is the safety net).
"""

from __future__ import annotations

from typing import Optional

SAFETY_LOOK_EVERY = 10  # heartbeats between full looks at the run directory that nothing asked for
RETRY_S = 0.1  # a look that could not tell (EMFILE...) is taken again this soon


class Schedule:
    """Owned by the watcher thread."""

    def __init__(
        self, now: float, beat_s: float, fallback_s: Optional[float] = None, remote_s: Optional[float] = None,
        startup_s: Optional[float] = None,
    ) -> None:
        self.beat_s = beat_s
        self.fallback_s = fallback_s  # None: pidfds and inotify work
        self.remote_s = remote_s  # None: not a shared filesystem
        self.next_beat = now
        self.beats = 0
        self.first = True
        self.recheck: Optional[float] = None
        self.hold: Optional[float] = None
        self.startup: Optional[float] = now + startup_s if startup_s else None
        self._startup_s = startup_s or 0.0

    def beat_due(self, now: float) -> bool:
        """True (and the beat counted) if a heartbeat is due."""
        if now < self.next_beat:
            return False
        self.next_beat = now + self.beat_s
        self.beats += 1
        return True

    def full_look(self, beat: bool, judging_remote: bool, unsure: bool = False) -> bool:
        if self.first or self.fallback_s is not None or judging_remote or unsure:
            return True
        return beat and (self.remote_s is not None or self.beats % SAFETY_LOOK_EVERY == 0)

    def timeout(self, now: float, judging_remote: bool, unsure: bool = False) -> float:
        """How long to sleep from ``now``; the first call answers 0. ``unsure``: a look
        could not tell (see the module's docstring)."""
        if self.first:
            self.first = False
            return 0.0
        timeout = self.next_beat - now
        for deadline in (self.recheck, self.hold):
            if deadline is not None:
                timeout = min(timeout, deadline - now)
        if judging_remote and self.remote_s is not None:
            timeout = min(timeout, self.remote_s)
        if self.fallback_s is not None:
            timeout = min(timeout, self.fallback_s)
        if unsure:
            timeout = min(timeout, RETRY_S)
        return max(0.0, timeout)

    def due(self, now: float) -> bool:
        """A recheck or the end of a hold has come."""
        recheck, hold = self.recheck, self.hold  # (no generator: asked on every turn of the loop)
        return (recheck is not None and now >= recheck) or (hold is not None and now >= hold)

    def startup_over(self, now: float, awake_since: float = 0.0) -> bool:
        """True once, when ``startup_timeout`` has passed, counted from ``awake_since`` at
        the earliest: when the watcher last resumed (peerwatch.core.awake; the ranks it waits
        for may have been stopped with it)."""
        if self.startup is None or now < max(self.startup, awake_since + self._startup_s):
            return False
        self.startup = None
        return True


__all__ = ["RETRY_S", "SAFETY_LOOK_EVERY", "Schedule"]
