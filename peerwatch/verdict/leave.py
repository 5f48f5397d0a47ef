"""How a torn-down rank leaves: end its on_verdict command, flush what people must see,
record its exit, then ``os._exit``; and how a clean exit ends before Python finalizes,
where it must (:func:`end_like_python`).

Not in :mod:`peerwatch.proc.teardown`: the steps belong to three modules (the hook runner,
the event log, the exit watch) of packages above it.
"""

from __future__ import annotations

import gc
import io
import logging
import sys

from ..rundir import eventlog, exitwatch
from . import notify


def flush_and_exit(code: int) -> None:
    """Leave now with ``code``: flush what people must see, then ``os._exit``. Never returns."""
    notify.kill_running()  # an on_verdict command outlives no rank that started it
    _flush_output()
    eventlog.leaving(code)  # records how this rank ended, where a teardown armed it
    exitwatch.leave(code)


def end_like_python(code: int) -> None:
    """End a clean exit now with ``code`` (``os._exit``), before Python finalizes, having
    done what Python's own exit would have done that matters outside this process: the
    multiprocessing children ended or joined (multiprocessing's exit function: it runs
    once), logging shut down (its handlers flushed and closed), every Python file still
    open flushed (finalization would have, as it destroyed them). Never returns."""
    util = sys.modules.get("multiprocessing.util")
    for step in (getattr(util, "_exit_function", None), logging.shutdown, _flush_open_files):
        try:
            if callable(step):
                step()
        except Exception:  # noqa: BLE001, S110 - leaving must not fail
            pass
    _flush_output()
    exitwatch.leave(code)


def _flush_output() -> None:
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


_BUFFERED = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)


def _flush_open_files() -> None:
    # The exact types only: isinstance() on arbitrary objects may run their code (proxies,
    # lazy modules); these are the buffers that hold what a program wrote and did not flush.
    for obj in gc.get_objects():
        if type(obj) in _BUFFERED and not obj.closed:
            try:
                obj.flush()
            except Exception:  # noqa: BLE001, S110 - one file that cannot be flushed stops nothing
                pass


__all__ = ["end_like_python", "flush_and_exit"]
