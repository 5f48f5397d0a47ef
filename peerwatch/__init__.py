"""peerwatch: when one rank of a multi-process training job fails or hangs, every rank
learns it within milliseconds and the whole job is torn down, with a report naming the
first failure and its exit code.

    import peerwatch
    peerwatch.install()            # at the top of the training script

    with peerwatch.watch():        # or around the work that must finish on every rank
        trainer.fit(model)

Importing peerwatch is cheap and never imports torch.
"""

# The layers (tests/test_import.py checks every import, lazy and TYPE_CHECKING ones too,
# against this table: a module imports only from a lower layer, or from its own layer where
# that test's SIDEWAYS table allows it, with the reason):
#
#   pure     no I/O, no clock, no threads: values and the rules over them
#            _errors _records _signals _mounts _config _terminal _schedule _decide
#            _diagnose _plan _hosts _summary _straggler _awake
#   os       adapters to the OS, one concern each: processes, signals, the run directory
#            _identity _activity _collectives _keeper _store_client _store_protocol
#            _sources _inotify _teardown _sharedfs _exitwatch _eventlog _stacks _waits
#            _trust _dirfd _rundir _basedir _prepare
#   stages   one step of the data flow each, built on the adapters, called by the wiring
#            _observer _waker _ownrecords _heartbeat _diagnoser _enforce _leave _notify
#            _bridge _election _launchers _frdump _report _timeline _gc _stragglerwatch
#   wiring   the watcher thread and its verdict's executor, the hooks, the API and the tools
#            _watcher _verdict _hooks _api cli _doctor __main__ integrations
#
# A lower layer that needs something done above it is passed a callable or a value (the
# teardown records its signals through the ``note`` its caller passes), never imports it.

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._errors import ConfigError, PeerFailure, PeerwatchError, RunDirError

if TYPE_CHECKING:
    from ._api import (
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
    from ._config import Config
    from ._records import Verdict

_API = frozenset({
    "Handle", "add_verdict_listener", "beat", "current", "install", "mark_success", "paused", "record_exception",
    "remove_verdict_listener", "watch",
})

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """The API is imported on first use (PEP 562): ``import peerwatch`` alone stays cheap,
    e.g. in every DataLoader worker that re-imports the training script."""
    if name in _API:
        from . import _api as module
    elif name == "Config":
        from . import _config as module  # type: ignore[no-redef]
    elif name == "Verdict":
        from . import _records as module  # type: ignore[no-redef]
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
