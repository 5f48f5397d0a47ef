"""The user's side: install(), watch(), beat(), paused(), current(), and the read-only
:class:`Handle` they return; the public functions integrations use.

The process's state is one :class:`peerwatch.hooks.Registry` (the watcher of this
process, whether ``install()`` was called); the process hooks live in :mod:`peerwatch.hooks`.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from types import TracebackType
from typing import Any, Callable, Optional, Type

from . import hooks, launchers
from .core import terminal
from .core.config import Config, unknown_variables
from .core.errors import PeerFailure, RunDirError
from .core.records import Registration, Verdict
from .ending import Ending
from .hosts import sharedfs
from .proc import identity
from .rundir import basedir, eventlog, prepare, rundir
from .rundir.rundir import REPORT_FILE, RunDir
from .rundir.stacks import StackFile
from .watcher import Watcher

logger = logging.getLogger("peerwatch")

_registry = hooks.Registry()
_warned_variables: set[str] = set()  # each unknown PEERWATCH_* variable is warned about once per process


class Handle:
    """A read-only view of this rank's watcher, returned by :func:`install`,
    :func:`watch` and :func:`current`.

    ``rank``, ``run_dir`` (the run directory's path), ``report_path``, ``verdict`` (the
    :class:`Verdict` acted on, or ``None`` while there is none; its fields: ``rank``,
    ``cause``, ``exit_code``, ``pid``, ``host``, ``signal``, ``detail``, ...), and
    :meth:`wait_verdict`.
    """

    __slots__ = ("_w",)

    def __init__(self, watcher: Watcher) -> None:
        self._w = watcher

    @property
    def rank(self) -> int:
        return self._w.rank

    @property
    def run_dir(self) -> str:
        return self._w.run_dir.path

    @property
    def report_path(self) -> str:
        return self._w.run_dir.join(REPORT_FILE)

    @property
    def verdict(self) -> Optional[Verdict]:
        return self._w.ending.verdict

    @property
    def watching(self) -> bool:
        """The watcher thread runs and has not been stopped."""
        return self._w.thread.is_alive() and not self._w.ending.done.is_set()

    def wait_verdict(self, timeout: Optional[float] = None) -> Optional[Verdict]:
        """Block until a verdict is known (or ``timeout`` seconds pass); the verdict or None."""
        self._w.ending.verdict_seen.wait(timeout)
        return self._w.ending.verdict

    def __repr__(self) -> str:
        return f"<peerwatch.Handle rank={self.rank} run_dir={self.run_dir!r} verdict={self.verdict!r}>"


def install(**options: Any) -> Optional[Handle]:
    """Start watching this rank's peers. Idempotent: returns the running watcher's handle.

    Call it at the top of the training script, before a launcher spawns more ranks.
    Options (each also a ``PEERWATCH_*`` variable; see :class:`Config`) override the
    environment. Returns ``None`` when disabled (``PEERWATCH_DISABLE=1``), in a
    multiprocessing child that is not given ``rank=`` (a DataLoader worker), or when the
    run directory cannot be used; in that last case training goes on unprotected and
    the reason is logged as an error, unless ``strict=True``, which raises
    :class:`RunDirError` instead. A bad option raises :class:`ConfigError`.
    """
    with _registry.lock:
        _registry.explicit = True
        handle = _install(options)
        hooks.arm_exit_status(_registry)  # now with success: install() was called (watch() may have come first)
        return handle


def current() -> Optional[Handle]:
    """The handle of this process's watcher, or None if peerwatch is not installed here."""
    w = _registry.active()
    return Handle(w) if w is not None else None


def _install(options: Any) -> Optional[Handle]:
    with _registry.lock:
        running = _registry.active()
        if running is not None:
            return Handle(running)
        config = Config.resolve(options)
        if not config.enabled:
            logger.info("peerwatch: disabled (%s)", config.source_of("enabled"))
            return None
        if basedir.is_multiprocessing_child() and "rank" not in options:
            logger.debug("peerwatch: a multiprocessing child without rank=; not a rank, not watching")
            return None
        _warn_unknown_variables()
        try:
            watcher = _start(config)
        except (RunDirError, OSError) as e:
            if config.strict:
                raise
            logger.error("peerwatch: rank %d is NOT protected: %s", config.effective_rank, e)
            return None
        _registry.set(watcher)
        hooks.install_hooks(_registry)
        hooks.arm_exit_status(_registry)
        watcher.start()
        return Handle(watcher)


def _warn_unknown_variables() -> None:
    """A ``PEERWATCH_*`` variable peerwatch does not read is most likely a misspelt option,
    which would be ignored without a word: one warning each, never an error (as pytest
    warns of an unknown option)."""
    for name, near in unknown_variables(os.environ):
        if name in _warned_variables:
            continue
        _warned_variables.add(name)
        hint = f"; did you mean {near}?" if near else ""
        logger.warning("peerwatch: the environment variable %s is not one of peerwatch's and is ignored%s "
                       "(the variables: docs/configuration.md)", name, hint)


def _start(config: Config) -> Watcher:
    me = identity.self_info()
    rank = config.effective_rank
    path, how = basedir.resolve(config.run_dir, os.environ)
    shared = sharedfs.detect(config.shared_fs, config.source_of("shared_fs"), path)
    if shared is not None:
        logger.info(
            "peerwatch: rank %d: shared-filesystem mode, as %s: other hosts' records are found by "
            "polling, their ranks judged lost after peer_timeout=%gs of silence", rank, shared, config.peer_timeout,
        )
    rd = RunDir(path, shared=shared)
    reg = Registration(
        rank=rank, pid=me.pid, ppid=me.ppid, start_ticks=me.start_ticks, uid=me.uid,
        host=identity.hostname(), boot_id=identity.boot_id(), pidns=identity.pid_namespace(),
        time_ns=time.time_ns(), world_size=config.world_size, local_rank=config.local_rank,
        argv=" ".join(sys.argv)[:500],
    )
    prepare.prepare(rd, reg, identity.started())  # registers this rank: the first claim of a slot wins
    try:
        from .rundir import gc  # old run directories under the default base: once per process, never raises

        gc.auto(how)
        stacks = StackFile.open(rd, rank)
        # Children started from here on (Lightning's ranks 1..N-1) join this run.
        os.environ["PEERWATCH_DIR"] = path
        watcher = Watcher(config, rd, reg, stacks, hooks.install_interrupt_handler(_registry))
    except BaseException:
        rd.withdraw_registration(reg)  # not watched after all: its peers must not wait on it
        raise
    eventlog.bind(rd, rank)
    eventlog.record(rd, rundir.RANKS, rundir.rank_file("rank", rank), reg, rank)
    logger.info("peerwatch: %s is watching its peers in %s (%s)", terminal.who(rank, reg.pid, reg.host), path, how)
    return watcher


def current_verdict() -> Optional[Verdict]:
    """The verdict this process acts on, or None."""
    e = _registry.ending()
    return e.verdict if e is not None else None


# -- watch() ------------------------------------------------------------------------


class watch:
    """Context manager around the work that must finish on every rank.

    Installs peerwatch if needed and gives its :class:`Handle` (or None, as
    :func:`install`). A clean exit writes this rank's success marker; an exception
    writes a failure record with its traceback, then propagates. If a peer fails
    meanwhile, the main thread gets :class:`PeerFailure` (a ``SystemExit`` carrying the
    failed rank's exit code) and must leave within the grace period, or the process
    exits hard.
    """

    def __init__(self, **options: Any) -> None:
        self._options = options
        self._ending: Optional[Ending] = None

    def __enter__(self) -> Optional[Handle]:
        handle = _install(self._options)
        self._ending = _registry.ending() if handle is not None else None
        if self._ending is not None:
            self._ending.enter_watch(+1)
        return handle

    def __exit__(
        self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        e = self._ending
        if e is None or _registry.ending() is not e:
            return
        e.enter_watch(-1)
        if exc is None or (isinstance(exc, SystemExit) and exc.code in (None, 0) and not isinstance(exc, PeerFailure)):
            e.record_success()
        elif not isinstance(exc, PeerFailure):
            verdict = _failing(e, exc, tb)
            if verdict is not None:
                raise PeerFailure.from_verdict(verdict) from exc


def _failing(e: Ending, exc: BaseException, tb: Optional[TracebackType]) -> Optional[Verdict]:
    """The verdict on a peer if ``exc`` is the consequence of its failure; else ``exc`` is
    recorded as this rank's failure, and None."""
    seen_ns = time.time_ns()  # the failure's time: before the settle wait
    verdict = hooks.consequence_of_peer_failure(e, exc)
    if verdict is None:
        hooks.record_exception(e, exc, tb, seen_ns)
    return verdict


# -- progress -----------------------------------------------------------------------


def beat(step: Optional[int] = None) -> None:
    """Tell peerwatch the training made progress. Cheap (no I/O): call it every step.

    ``step`` is the training step (the rank with the lowest step is named first when the
    job hangs); without it, an internal counter goes up by one. A beat is movement, as a
    collective entered is: it resets the hang diagnosis's clock (on by default, from
    torch's collective counters, so ``beat()`` is optional there) and is the progress
    ``hang_timeout=SECONDS`` measures (where it is needed for jobs without collectives).
    The Lightning callback calls it for you.
    """
    w = _registry.active()
    if w is not None:
        w.progress.beat(step)


class paused:
    """Context manager for a long phase without steps (checkpointing, evaluation on one rank).

    While any rank is inside ``paused()``, no hang is diagnosed and no hang verdict is
    given; entering and leaving count as progress.
    """

    def __enter__(self) -> None:
        _pause(+1)

    def __exit__(self, *exc: object) -> None:
        _pause(-1)


def _pause(delta: int) -> None:
    w = _registry.active()
    if w is not None:
        w.progress.pause(delta)
        w.publish_heartbeat()


# -- for integrations ---------------------------------------------------------------


def mark_success() -> None:
    """Record that this rank finished its work cleanly (as leaving ``watch()`` does).
    Nothing happens without a watcher, or once a verdict is known."""
    e = _registry.ending()
    if e is not None:
        e.record_success()


def record_exception(exc: BaseException) -> Optional[Verdict]:
    """This rank is failing with ``exc``. If it is the consequence of a peer's failure
    (gloo's "connection reset" after a peer died), returns the verdict on that peer and
    records nothing; otherwise records ``exc`` as this rank's failure, so that its peers
    learn it at once, and returns None. Nothing happens without a watcher."""
    e = _registry.ending()
    if e is None or isinstance(exc, PeerFailure):
        return None
    if isinstance(exc, SystemExit) and exc.code in (None, 0):
        return None
    return _failing(e, exc, exc.__traceback__)


def add_verdict_listener(listener: Callable[[Verdict], None]) -> None:
    """Call ``listener(verdict)`` in the watcher thread once this rank acts on a verdict,
    before its teardown. It must be quick; its exceptions are logged and ignored."""
    launchers.add_verdict_listener(listener)


def remove_verdict_listener(listener: Callable[[Verdict], None]) -> None:
    launchers.remove_verdict_listener(listener)


__all__ = [
    "Handle", "add_verdict_listener", "beat", "current", "current_verdict", "install", "mark_success", "paused",
    "record_exception", "remove_verdict_listener", "watch",
]
