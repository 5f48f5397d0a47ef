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

from ._api import beat, install, paused, watch
from ._config import Config
from ._errors import ConfigError, PeerFailure, PeerwatchError, RunDirError

__version__ = "0.1.0"

__all__ = [
    "Config",
    "ConfigError",
    "PeerFailure",
    "PeerwatchError",
    "RunDirError",
    "__version__",
    "beat",
    "install",
    "paused",
    "watch",
]
