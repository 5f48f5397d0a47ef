"""peerwatch: when one rank of a multi-process training job fails or hangs, every rank
learns it within milliseconds and the whole job is torn down, with a report naming the
first failure and its exit code.

    import peerwatch
    peerwatch.install()            # at the top of the training script

    with peerwatch.watch():        # or around the work that must finish on every rank
        trainer.fit(model)

Importing peerwatch is cheap and never imports torch. Its API is the names exported here;
its subpackages and modules are internal.
"""

# The packages, lowest first. Each one's __init__ says what it owns and, last, which packages
# it imports: tests/test_import.py checks every import (lazy, TYPE_CHECKING) against it, and that
# no package imports one that imports it. Within a package, any import.
#   core/      errors records config terminal schedule awake mounts
#   proc/      identity activity sources waker teardown
#   rundir/    trust rundir basedir prepare eventlog exitwatch stacks gc
#   hangs/     collectives heartbeat waits diagnose straggler frdump
#   hosts/     hosts store_protocol store_client election bridge sharedfs stragglerwatch
#   verdict/   decide plan enforce notify keeper report leave
#   (here)     api hooks ending watcher observer peers diagnoser executor launchers: the wiring
#   tools/     cli doctor timeline: the command line, above the API
#   integrations/ torch lightning
# A lower package that needs something done above it is passed a callable or a value (the
# teardown records its signals through the ``note`` its caller passes), never imports it.

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .core.errors import ConfigError, PeerFailure, PeerwatchError, RunDirError

if TYPE_CHECKING:
    from .api import (
        Handle,
        add_verdict_listener,
        beat,
        current,
        install,
        mark_success,
        paused,
        record_exception,
        remove_verdict_listener,
        watch,
    )
    from .core.config import Config
    from .core.records import Verdict

_API = frozenset({
    "Handle", "add_verdict_listener", "beat", "current", "install", "mark_success", "paused", "record_exception",
    "remove_verdict_listener", "watch",
})

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """The API is imported on first use (PEP 562): ``import peerwatch`` alone stays cheap,
    e.g. in every DataLoader worker that re-imports the training script."""
    if name in _API:
        from . import api as module
    elif name == "Config":
        from .core import config as module  # type: ignore[no-redef]
    elif name == "Verdict":
        from .core import records as module  # type: ignore[no-redef]
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value
    return value

__all__ = [
    "Config",
    "ConfigError",
    "Handle",
    "PeerFailure",
    "PeerwatchError",
    "RunDirError",
    "Verdict",
    "__version__",
    "add_verdict_listener",
    "beat",
    "current",
    "install",
    "mark_success",
    "paused",
    "record_exception",
    "remove_verdict_listener",
    "watch",
]
