"""peerwatch: when one rank of a multi-process training job fails or hangs, every rank
learns it within milliseconds and the whole job is torn down, with a report naming the
first failure and its exit code.

    import peerwatch
    peerwatch.install()            # at the top of the training script

    with peerwatch.watch():        # or around the work that must finish on every rank
        trainer.fit(model)

Importing peerwatch is cheap and never imports torch.
"""

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
