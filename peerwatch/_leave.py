"""How a torn-down rank leaves: end its on_verdict command, flush what people must see,
record its exit, then ``os._exit``.

A stage above the OS layer: the steps belong to three modules (the hook runner, the event
log, the exit watch), and the lowest layer (:mod:`peerwatch._teardown`) imports none of them.
"""

from __future__ import annotations

import logging
import sys

from . import _eventlog, _exitwatch, _notify


def flush_and_exit(code: int) -> None:
    """Leave now with ``code``: flush what people must see, then ``os._exit``. Never returns."""
    _notify.kill_running()  # an on_verdict command outlives no rank that started it
    for handler in logging.getLogger("peerwatch").handlers + logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001, S110 - leaving must not fail
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001, S110 - leaving must not fail
            pass
    _eventlog.leaving(code)  # records how this rank ended, where a teardown armed it
    _exitwatch.leave(code)


__all__ = ["flush_and_exit"]
