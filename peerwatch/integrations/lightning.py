"""Lightning integration: the :class:`PeerWatch` callback.

Importing this module imports Lightning (``lightning``, else ``pytorch_lightning``)
and torch; ``import peerwatch`` imports neither.

The one line alone is enough under ``Trainer(strategy="ddp")``::

    import peerwatch
    peerwatch.install()        # at the top: rank 0 runs it before Lightning starts ranks 1..N-1,
                               # which inherit PEERWATCH_DIR and join its run

The callback adds what only Lightning knows::

    from peerwatch.integrations.lightning import PeerWatch
    trainer = Trainer(strategy="ddp", devices=4, callbacks=[PeerWatch()])

- it installs peerwatch at ``setup`` if the script did not (rank and world size from
  the trainer; the ranks agree on a run directory through a broadcast from rank 0);
- progress: ``peerwatch.beat(trainer.global_step)`` after every training batch;
- success: this rank is marked as done at the end of ``fit`` (a failure after that,
  in ``trainer.test()`` say, no longer tears the job down; ``mark_success=False``
  leaves it to the end of the process or of ``peerwatch.watch()``);
- an exception in this rank is recorded as soon as Lightning sees it
  (``on_exception``), before Lightning's own teardown, so peers learn it at once.

At a failure each surviving rank says one line, peerwatch's own (``peerwatch: rank 0
(pid 812 on vm) stops with exit code 3: rank 2 (pid 815 on vm) failed first (...)``);
the callback adds none.

Lightning's own ``_ChildProcessObserver`` (rank 0 polls its children every 5 s and
SIGKILLs everything when one exited non-zero) is quieted once there is a verdict,
with or without this callback: peerwatch tears the job down itself, with the failing
rank's exit code (the observer would make rank 0 exit 137).
"""

from __future__ import annotations

from typing import Any, Optional

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the older package name
    from pytorch_lightning.callbacks import Callback  # type: ignore[no-redef,assignment]

import peerwatch

from . import torch as _pw_torch


class PeerWatch(Callback):  # type: ignore[misc]
    """Watch this rank's peers for the length of the training (see the module docstring).

    ``options`` are :func:`peerwatch.install` options (``grace=``, ``run_dir=``, ...),
    used only if peerwatch is not installed yet when the trainer sets up.
    """

    def __init__(self, *, mark_success: bool = True, **options: Any) -> None:
        super().__init__()
        peerwatch.Config.resolve({k: v for k, v in options.items() if k not in ("rank", "world_size")})  # fail early on typos
        self.mark_success = mark_success
        self.options = options
        self.watcher: Optional[peerwatch.Handle] = None

    # Trainers are pickled into ddp_spawn's workers: a watcher holds threads and files.
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["watcher"] = None
        return state

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.watcher = peerwatch.current() or self._install(trainer)

    def _install(self, trainer: Any) -> Optional[peerwatch.Handle]:
        options = {"rank": trainer.global_rank, "world_size": trainer.world_size, **self.options}
        config = peerwatch.Config.resolve(options)
        if config.enabled and config.run_dir is None and trainer.world_size > 1:
            # Installed this late, rank 0 has started its children already: PEERWATCH_DIR did
            # not reach them, and rank 0's parent is not theirs. Agree through Lightning.
            key = trainer.strategy.broadcast(_pw_torch.run_key(), src=0)
            options["run_dir"] = _pw_torch.run_dir_for(key)
        return peerwatch.install(**options)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        peerwatch.beat(trainer.global_step)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self.mark_success:
            peerwatch.mark_success()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Recorded now, before Lightning's teardown (which may wait on the peers): the
        # peers learn it at once. The excepthook later finds the record already there.
        # A consequence of a peer's failure (gloo's "connection closed") is not recorded.
        handle = peerwatch.current()
        if handle is not None and handle.verdict is None:
            peerwatch.record_exception(exception)


__all__ = ["PeerWatch"]
