"""The user's side: install(), watch(), beat(), paused(), and the process hooks.

Hooks (excepthook, sys.exit, atexit, at-fork) are installed once per process and act
only in the process that installed the watcher: a forked child (a DataLoader worker)
never writes the rank's records.
"""

from __future__ import annotations

import atexit
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
import traceback
from types import TracebackType
from typing import IO, Any, Callable, Optional, Type

from . import _identity, _launchers, _rundir, _sharedfs, _teardown
from ._config import Config
from ._errors import PeerFailure, RunDirError
from ._records import EXCEPTION, EXIT, MAX_TRACEBACK_CHARS, Failure, Registration, Verdict
from ._rundir import STACKS, RunDir, rank_file
from ._watcher import Watcher

logger = logging.getLogger("peerwatch")

_lock = threading.RLock()
_watcher: Optional[Watcher] = None
_owner_pid: Optional[int] = None
_hooks_installed = False
_explicit_install = False
_original_sys_exit: Callable[..., Any] = sys.exit


def install(**options: Any) -> Optional[Watcher]:
    """Start watching this rank's peers. Idempotent: returns the running watcher.

    Call it at the top of the training script, before a launcher spawns more ranks.
    Options (each also a ``PEERWATCH_*`` variable; see :class:`Config`) override the
    environment. Returns ``None`` when disabled (``PEERWATCH_DISABLE=1``), in a
    multiprocessing child that is not given ``rank=`` (a DataLoader worker), or when the
    run directory cannot be used; in that last case training goes on unprotected and
    the reason is logged as an error, unless ``strict=True``, which raises
    :class:`RunDirError` instead. A bad option raises :class:`ConfigError`.
    """
    global _explicit_install
    with _lock:
        _explicit_install = True
        return _install(options)


def _install(options: Any) -> Optional[Watcher]:
    global _watcher, _owner_pid
    with _lock:
        if _watcher is not None and _owner_pid == os.getpid():
            return _watcher
        config = Config.resolve(options)
        if not config.enabled:
            logger.info("peerwatch: disabled (%s)", config.source_of("enabled"))
            return None
        if _in_multiprocessing_child() and "rank" not in options:
            logger.debug("peerwatch: a multiprocessing child without rank=; not a rank, not watching")
            return None
        try:
            watcher = _start(config)
        except (RunDirError, OSError) as e:
            if config.strict:
                raise
            logger.error("peerwatch: rank %d is NOT protected: %s", config.effective_rank, e)
            return None
        _watcher, _owner_pid = watcher, os.getpid()
        _install_hooks(watcher)
        watcher.start()
        _launchers.after_install(watcher)
        return watcher


def _in_multiprocessing_child() -> bool:
    mp = sys.modules.get("multiprocessing")  # not imported: this cannot be a multiprocessing child
    return mp is not None and mp.parent_process() is not None


def _start(config: Config) -> Watcher:
    me = _identity.self_info()
    rank = config.effective_rank
    path, how = _rundir.resolve(config.run_dir, os.environ)
    shared = _sharedfs.detect(config.shared_fs, config.source_of("shared_fs"), path)
    if shared is not None:
        logger.info(
            "peerwatch: rank %d: shared-filesystem mode, as %s: other hosts' records are found by "
            "polling, their ranks judged lost after peer_timeout=%gs of silence", rank, shared, config.peer_timeout,
        )
    rd = RunDir(path, shared=shared)
    reg = Registration(
        rank=rank, pid=me.pid, ppid=me.ppid, start_ticks=me.start_ticks, uid=me.uid,
        host=_identity.hostname(), boot_id=_identity.boot_id(), pidns=_identity.pid_namespace(),
        time_ns=time.time_ns(), world_size=config.world_size, local_rank=config.local_rank,
        argv=" ".join(sys.argv)[:500],
    )
    started_ns = _process_start_ns()
    rd.prepare(reg, started_ns)
    stack_file = _open_stack_file(rd, rank)
    # Children started from here on (Lightning's ranks 1..N-1) join this run.
    os.environ["PEERWATCH_DIR"] = path
    watcher = Watcher(config, rd, reg, stack_file)
    watcher.interrupt_installed = _install_interrupt_handler()
    rd.publish_registration(reg)
    logger.info("peerwatch: rank %d (pid %d) is watching its peers in %s (%s)", rank, me.pid, path, how)
    return watcher


def _process_start_ns() -> int:
    """When this process started, on the wall clock (to tell records of earlier runs)."""
    import psutil

    try:
        return int(psutil.Process().create_time() * 1e9)
    except psutil.Error:
        return time.time_ns()


def _open_stack_file(rd: RunDir, rank: int) -> Optional[IO[str]]:
    """Open this rank's stack file and have faulthandler dump into it on STACKS_SIGNAL.

    faulthandler writes from its C signal handler, so the dump works even while the main
    thread holds the GIL in C code.
    """
    try:
        fd = os.open(
            rd.join(STACKS, rank_file("rank", rank, ".txt")),
            os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
        )
        stack_file = os.fdopen(fd, "w")
        faulthandler.register(_teardown.STACKS_SIGNAL, file=stack_file, all_threads=True, chain=False)
        if not faulthandler.is_enabled():
            # A rank that segfaults leaves its last words here, where its peers read
            # which signal ended it (only its parent could learn that otherwise).
            global _faulthandler_ours
            faulthandler.enable(file=stack_file, all_threads=True)
            _faulthandler_ours = True
        return stack_file
    except (OSError, RuntimeError, ValueError) as e:
        logger.warning("peerwatch: rank %d cannot arm stack dumps: %s", rank, e)
        return None


def _install_interrupt_handler() -> bool:
    """Our handler wakes the main thread out of sleep/select/wait to raise PeerFailure."""
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        if signal.getsignal(_teardown.INTERRUPT_SIGNAL) not in (signal.SIG_DFL, None, _on_interrupt):
            return False
        signal.signal(_teardown.INTERRUPT_SIGNAL, _on_interrupt)
        return True
    except (OSError, ValueError):
        return False


def _on_interrupt(signum: int, frame: Any) -> None:
    w = _active()
    if w is not None and w.verdict is not None and w.in_watch > 0 and w.verdict.rank != w.rank:
        raise PeerFailure()


def _active() -> Optional[Watcher]:
    """The watcher of this very process (not one inherited through fork)."""
    w = _watcher
    return w if w is not None and _owner_pid == os.getpid() else None


def current_verdict() -> Optional[Verdict]:
    w = _active()
    return w.verdict if w is not None else None


# -- watch() ------------------------------------------------------------------------


class watch:
    """Context manager around the work that must finish on every rank.

    Installs peerwatch if needed. A clean exit writes this rank's success marker; an
    exception writes a failure record with its traceback, then propagates. If a peer
    fails meanwhile, the main thread gets :class:`PeerFailure` (a ``SystemExit``
    carrying the failed rank's exit code) and must leave within the grace period, or
    the process exits hard.
    """

    def __init__(self, **options: Any) -> None:
        self._options = options
        self._watcher: Optional[Watcher] = None

    def __enter__(self) -> Optional[Watcher]:
        self._watcher = _install(self._options)
        if self._watcher is not None:
            self._watcher.in_watch += 1
        return self._watcher

    def __exit__(
        self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        w = self._watcher
        if w is None or _owner_pid != os.getpid():
            return
        w.in_watch -= 1
        if exc is None or (isinstance(exc, SystemExit) and exc.code in (None, 0) and not isinstance(exc, PeerFailure)):
            w.record_success()
        elif not isinstance(exc, PeerFailure):
            if _consequence_of_peer_failure(w) is not None:
                raise PeerFailure() from exc
            _record_exception(w, exc, tb)


# -- progress -----------------------------------------------------------------------


def beat(step: Optional[int] = None) -> None:
    """Tell peerwatch the training made progress. Cheap (no I/O): call it every step.

    ``step`` is the training step (the rank with the lowest step is named first when the
    job hangs); without it, an internal counter goes up by one. Only matters with
    ``hang_timeout`` set; the Lightning callback calls it for you.
    """
    w = _active()
    if w is None:
        return
    w.step = (w.step or 0) + 1 if step is None else step
    w.progress_ns = time.monotonic_ns()


class paused:
    """Context manager for a long phase without steps (checkpointing, evaluation on one rank).

    While any rank is inside ``paused()``, no hang verdict is given; entering and leaving
    count as progress.
    """

    def __enter__(self) -> None:
        w = _active()
        if w is not None:
            w.paused += 1
            w.progress_ns = time.monotonic_ns()
            w.publish_heartbeat()

    def __exit__(self, *exc: object) -> None:
        w = _active()
        if w is not None:
            w.paused = max(0, w.paused - 1)
            w.progress_ns = time.monotonic_ns()
            w.publish_heartbeat()


# -- hooks --------------------------------------------------------------------------


class _StderrFallback(logging.Handler):
    """Where peerwatch's warnings go when the application configured no logging.

    Like logging's last resort, but bound to the process's real stderr: hooks up the
    excepthook chain (torch.distributed's) swap ``sys.stderr`` for a buffer, and a line
    written there is lost when the process ends in the meantime.
    """

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return  # the application configured logging: the record propagates there
        try:
            stream = sys.__stderr__
            if stream is not None:
                stream.write(self.format(record) + "\n")
                stream.flush()
        except Exception:  # noqa: BLE001
            self.handleError(record)


def _install_hooks(w: Watcher) -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    logger.addHandler(_StderrFallback())
    previous_excepthook = sys.excepthook

    def excepthook(exc_type: Type[BaseException], exc: BaseException, tb: Optional[TracebackType]) -> None:
        w = _active()
        if w is None or isinstance(exc, PeerFailure):
            previous_excepthook(exc_type, exc, tb)
            return
        verdict = _consequence_of_peer_failure(w)
        if verdict is None:
            _record_exception(w, exc, tb)
            previous_excepthook(exc_type, exc, tb)
            return
        previous_excepthook(exc_type, exc, tb)
        # No exit from here: a hook up the chain (torch's) may have swapped sys.stderr and
        # prints only when we return. The watcher ends the process with the verdict's code.
        logger.error(
            "peerwatch: the exception above in rank %d followed the failure of rank %d (%s); "
            "exiting with code %d", w.rank, verdict.rank, verdict.detail, verdict.exit_code,
        )

    sys.excepthook = excepthook
    previous_threading_hook = threading.excepthook

    def threading_excepthook(args: Any) -> None:
        w = _active()
        if w is not None and args.exc_value is not None and not isinstance(args.exc_value, SystemExit):
            _record_thread_exception(w, args)
        previous_threading_hook(args)

    threading.excepthook = threading_excepthook
    sys.exit = _exit  # type: ignore[assignment]
    atexit.register(_at_exit)
    os.register_at_fork(after_in_child=_after_fork_in_child, after_in_parent=_after_fork_in_parent)


def _exit(status: Any = None) -> None:
    """``sys.exit`` that first records a non-zero exit of the main thread as this rank's failure."""
    w = _active()
    if w is not None and threading.current_thread() is threading.main_thread() and not w.in_watch:
        code = _exit_status(status)
        # torch.multiprocessing.spawn turns a worker's exception into sys.exit(1): gloo's
        # "connection reset" after a peer died is a consequence here too, not a cause.
        if code != 0 and w.verdict is None and _consequence_of_peer_failure(w) is None:
            stack = "".join(traceback.format_stack()[:-1])
            w.record_failure(Failure(
                rank=w.rank, pid=os.getpid(), time_ns=time.time_ns(), cause=EXIT, exit_code=code,
                message=f"sys.exit({status!r})", traceback=stack[-MAX_TRACEBACK_CHARS:],
                thread=threading.current_thread().name,
            ))
    _original_sys_exit(status)


def _exit_status(status: Any) -> int:
    if status is None:
        return 0
    if isinstance(status, int) and not isinstance(status, bool):
        return status & 0xFF
    return 1  # sys.exit("message") prints it and exits 1


SETTLE_S = 0.25  # how long a failing rank waits for its watcher's look at the peers


def _consequence_of_peer_failure(w: Watcher) -> Optional[Verdict]:
    """If a peer failed before this rank's exception, the verdict on that peer; else None.

    When a peer dies, the survivors' collectives fail within milliseconds ("Connection
    reset by peer"): those exceptions are consequences, not root causes. The pidfd of the
    dead peer has fired before the exception was raised, so one look by the watcher
    settles which came first.
    """
    if w.verdict is not None:
        return w.verdict if w.verdict.rank != w.rank else None
    w.settle(SETTLE_S)
    if not w.peer_failed():
        return None
    w.verdict_seen.wait(w.config.parent_wait + SETTLE_S)
    return w.verdict if w.verdict is not None and w.verdict.rank != w.rank else None


def _record_exception(w: Watcher, exc: BaseException, tb: Optional[TracebackType]) -> None:
    if w.verdict is not None and w.verdict.rank != w.rank:
        return  # we are being torn down: what we raise now is a consequence, not a cause
    if isinstance(exc, SystemExit):
        code = _exit_status(exc.code)
        if code == 0:
            return
        cause, name, message = EXIT, None, f"SystemExit({exc.code!r})"
    else:
        code = 130 if isinstance(exc, KeyboardInterrupt) else 1
        cause, name, message = EXCEPTION, _qualified_name(type(exc)), str(exc)[:2000]
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    w.record_failure(Failure(
        rank=w.rank, pid=os.getpid(), time_ns=time.time_ns(), cause=cause, exit_code=code,
        exception=name, message=message, traceback=text[-MAX_TRACEBACK_CHARS:],
        thread=threading.current_thread().name,
    ))


def _record_thread_exception(w: Watcher, args: Any) -> None:
    """An uncaught exception in a thread other than the main one. The process goes on, so
    by default it is recorded for the report (``events/thread-<rank>.json``, the first
    one), not judged; ``thread_exceptions="fail"`` makes it this rank's failure."""
    exc = args.exc_value
    thread = args.thread.name if args.thread is not None else "?"
    text = "".join(traceback.format_exception(type(exc), exc, args.exc_traceback))
    failure = Failure(
        rank=w.rank, pid=os.getpid(), time_ns=time.time_ns(), cause=EXCEPTION, exit_code=1,
        exception=_qualified_name(type(exc)), message=str(exc)[:2000], traceback=text[-MAX_TRACEBACK_CHARS:],
        thread=thread,
    )
    if w.config.thread_exceptions == "fail" and w.verdict is None:
        w.record_failure(failure)
    else:
        w.record_thread_exception(failure)


def _qualified_name(cls: type) -> str:
    module = cls.__module__
    return cls.__qualname__ if module in ("builtins", "__main__") else f"{module}.{cls.__qualname__}"


def _at_exit() -> None:
    """At a normal interpreter exit: the rank finished cleanly unless we know otherwise."""
    w = _active()
    if w is None:
        return
    if w.verdict is None and w.own_exit_code is not None:
        # This rank failed. Its peers may be unable to leave by themselves (the GIL held
        # in C code), and its watcher may be the only one left to end them: stay until
        # the verdict is made and our share of the teardown is done.
        held = w.bridge.hold_s if w.bridge is not None else 0.0  # multi-host: an exception is held back
        w.verdict_seen.wait(w.config.parent_wait + w.config.ack_window + SETTLE_S + held)
    if w.verdict is not None:
        # Being torn down: the watcher is the one to end the process, with the verdict's
        # exit code, once its share of the teardown is done. Tell it we are leaving.
        w.stopped.set()
        w.wake()
        w.thread.join(w.config.grace + w.config.ack_window + 2.0)
        code = w.verdict.exit_code if w.verdict.rank != w.rank else (w.own_exit_code or w.verdict.exit_code)
        _teardown.flush_and_exit(code)
        return
    if w.own_exit_code is None and _explicit_install:
        w.record_success()
    w.stop(timeout=1.0)


_faulthandler_ours = False  # we enabled faulthandler into the rank's stack file


def _after_fork_in_parent() -> None:
    """A new child (a DataLoader worker, forked): the heartbeat lists it now, not at the next
    10-heartbeat snapshot, so that if this rank dies its peers can end it."""
    w = _active()
    if w is not None:
        w.children_changed()


def _after_fork_in_child() -> None:
    global _watcher, _faulthandler_ours
    # The watcher thread does not exist in the child; the parent's records are not ours,
    # nor is its stack file: a forked worker that crashes must not leave its last words
    # there (its rank's peers would take them for the rank's own).
    _watcher = None
    if _faulthandler_ours:
        _faulthandler_ours = False
        try:
            faulthandler.enable()  # back to stderr, as the child would have it without us
            faulthandler.unregister(_teardown.STACKS_SIGNAL)
        except (OSError, RuntimeError, ValueError):
            pass


__all__ = ["beat", "current_verdict", "install", "paused", "watch"]
