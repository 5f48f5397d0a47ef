"""The signals of peerwatch's own, and how a signal is named in logs and events. Pure.

One home for both the rank that installs a handler (:mod:`peerwatch.rundir.stacks`,
:mod:`peerwatch.hooks`) and the one that sends the signal (:mod:`peerwatch.proc.teardown`).
"""

from __future__ import annotations

import signal

RTMIN = int(getattr(signal, "SIGRTMIN", 34))
# Signals of our own, from the real-time range that training code does not use.
INTERRUPT_SIGNAL = RTMIN + 4  # raise PeerFailure in a rank's main thread
# faulthandler dumps all stacks on it (works under a held GIL). SIGURG because its default
# action is to do nothing: a process whose handler is gone (an interpreter shutting down
# unregisters faulthandler) is not killed by a late dump request.
STACKS_SIGNAL = int(signal.SIGURG)


def signal_label(sig: int) -> str:
    """``SIGTERM``, ``SIGRTMIN+4``, or the number for one Python does not name."""
    if sig > RTMIN:
        return f"SIGRTMIN+{sig - RTMIN}"
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)


__all__ = ["INTERRUPT_SIGNAL", "RTMIN", "STACKS_SIGNAL", "signal_label"]
