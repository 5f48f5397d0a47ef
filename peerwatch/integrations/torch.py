"""Helpers for ``torch.distributed``: rank and world size from an initialized process group.

Importing this module imports torch (``import peerwatch`` never does). Use it when the
environment does not say which rank a process is, e.g. ranks that call
``init_process_group(init_method="tcp://...", rank=r, world_size=n)`` themselves, or a
``torch.multiprocessing.spawn`` worker::

    import torch.distributed as dist
    from peerwatch.integrations import torch as pw_torch

    def worker(i, n):
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29500", rank=i, world_size=n)
        pw_torch.install()      # rank i of n, from the process group; call it on every rank

Calling ``peerwatch.install(rank=i, world_size=n)`` first thing in the worker is better
still: it protects the rank during ``init_process_group`` too.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Optional, Tuple

import torch.distributed as dist

import peerwatch

from ..proc import identity
from ..rundir import basedir, rundir

logger = logging.getLogger("peerwatch")

_KEY_PREFIX = "pg-"  # run directory name of ranks that agreed through their process group
_KEY_RE = re.compile(r"[A-Za-z0-9._-]{1,100}")


def is_initialized() -> bool:
    """True if torch.distributed is available and its default process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank_and_world_size(group: Optional[Any] = None) -> Optional[Tuple[int, int]]:
    """``(rank, world_size)`` of this process in ``group`` (default: the default group).

    ``None`` if torch.distributed is unavailable or no process group is initialized, or
    if this process is not a member of ``group``.
    """
    if not is_initialized():
        return None
    rank = dist.get_rank(group)
    if rank < 0:  # not a member of this group
        return None
    return rank, dist.get_world_size(group)


def options_from_process_group(options: Optional[dict] = None, group: Optional[Any] = None) -> dict:
    """``options`` with ``rank`` and ``world_size`` filled in from the process group, where
    neither the options nor the environment (``RANK``, ``PEERWATCH_RANK``, ...) say.

    Returns a new dict; ``options`` is left alone. Without an initialized process group
    the options come back unchanged.
    """
    out = dict(options or {})
    found = rank_and_world_size(group)
    if found is None:
        return out
    config = peerwatch.Config.resolve(out)
    if config.rank is None:
        out["rank"] = found[0]
    if config.world_size is None:
        out["world_size"] = found[1]
    return out


def install(*, agree: Optional[bool] = None, group: Optional[Any] = None, **options: Any) -> Optional[peerwatch.Handle]:
    """:func:`peerwatch.install` for a rank that is already in a process group.

    Rank and world size come from the process group where neither ``options`` nor the
    environment say. The run directory: where the environment names none (no
    ``PEERWATCH_DIR``, torchrun, Slurm, ``MASTER_ADDR``/``MASTER_PORT``), every rank
    would otherwise start a run of its own; the ranks then agree on one through a
    broadcast from rank 0 (``agree=None``, the default). ``agree=True`` always agrees
    that way unless ``run_dir``/``PEERWATCH_DIR`` is given (used by the Lightning
    callback, which installs after the launcher has started the ranks); ``agree=False``
    never does. Agreeing is a collective: call this on every rank of ``group``, or on
    none.

    Returns the :class:`peerwatch.Handle`, or ``None`` as :func:`peerwatch.install` does. If peerwatch is
    already installed in this process, returns the running watcher and changes nothing.
    """
    running = peerwatch.current()
    if running is not None:
        return running
    options = options_from_process_group(options, group)
    config = peerwatch.Config.resolve(options)
    if config.enabled and config.run_dir is None and rank_and_world_size(group) is not None:
        if agree is None:
            _, how = basedir.resolve(None, os.environ)
            agree = how == basedir.NEW_RUN
        if agree:
            options["run_dir"] = run_dir_for(agreed_key(group))
    return peerwatch.install(**options)


def run_key() -> str:
    """This process's name for a run it would lead: host, pid and start time."""
    me = identity.self_info()
    return f"{_KEY_PREFIX}{rundir.safe_name(identity.hostname())}-{me.pid}.{me.start_ticks}"


def run_dir_for(key: str) -> str:
    """The run directory on this host of the run named ``key`` (from :func:`agreed_key`)."""
    name = key if _KEY_RE.fullmatch(key) and key.strip(".") else rundir.safe_name(key)
    return os.path.join(basedir.base_dir(), name)


def agreed_key(group: Optional[Any] = None) -> str:
    """The :func:`run_key` of rank 0 of ``group``, on every rank: a new one for every run.
    A collective call (a broadcast)."""
    key = [run_key()]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(key, src=src, group=group)
    return str(key[0])


__all__ = [
    "agreed_key", "install", "is_initialized", "options_from_process_group", "rank_and_world_size", "run_dir_for",
    "run_key",
]
