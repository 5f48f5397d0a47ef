"""The process hooks: excepthook, threading.excepthook, sys.exit, atexit, at-fork, and the
signal handler that raises :class:`PeerFailure` in the main thread.

Installed once per process by :func:`install_hooks`; they act only through the
:class:`Registry` given, which answers for the process that installed the watcher: a
forked child (a DataLoader worker) never writes the rank's records. How the rank ends is
recorded, judged and awaited on its :class:`peerwatch.ending.Ending` (:meth:`Registry.ending`).

``sys.exit`` and the builtins ``exit``/``quit`` are replaced so that a non-zero exit of
the main thread is recorded with where it came from. What no Python hook sees (a
``SystemExit`` raised at the top, ``raise SystemExit(main())``) is told by the exit status
itself (:mod:`peerwatch.rundir.exitwatch`, where its C extension is available): then the success
marker is written at exit only if the status is 0, and never at ``atexit``.
"""

from __future__ import annotations

import atexit
import builtins
import dis
import logging
import os
import signal
import struct
import sys
import threading
import time
import traceback
from types import FrameType, TracebackType
from typing import Any, Callable, Optional, Tuple, Type

from .core import terminal
from .core.errors import PeerFailure
from .core.records import EXCEPTION, EXIT, INTERRUPTED, MAX_TRACEBACK_CHARS, Failure, Verdict
from .core.terminal import exception_message
from .ending import Ending
from .hangs.collectives import raised_by_torch_distributed
from .proc import teardown
from .rundir import exitwatch, stacks
from .rundir.rundir import RANKS, SPAWNED_RUN, SUMMARY_FILE, RunDir
from .verdict import leave, report
from .verdict.notify import CLAIMS, start_hook
from .verdict.plan import SETTLE_S
from .watcher import Watcher

logger = logging.getLogger("peerwatch")


_original_sys_exit: Callable[..., Any] = sys.exit


class Registry:
    """The watcher of this process, and whether the user called install() (not only
    watch()). Written under its lock by install(); cleared in a forked child."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._watcher: Optional[Watcher] = None
        self._owner_pid: Optional[int] = None
        self.explicit = False
        self.hooks_installed = False
        # How the program ends, for take_exit_status(): the __main__ module's frame (kept
        # from install() on), and the last sys.exit/exit/quit of the main thread (its status,
        # and where that frame was then).
        self.main_frame: Optional[FrameType] = None
        self.exit_call: Optional[Tuple[Any, int]] = None

    def set(self, watcher: Watcher) -> None:
        self._watcher, self._owner_pid = watcher, os.getpid()

    def active(self) -> Optional[Watcher]:
        """The watcher of this very process (not one inherited through fork)."""
        w = self._watcher
        return w if w is not None and self._owner_pid == os.getpid() else None

    def ending(self) -> Optional[Ending]:
        """How this very process's rank ends: what the hooks record, judge and await."""
        w = self.active()
        return w.ending if w is not None else None

    def forget(self) -> None:
        self._watcher = None

    def on_interrupt(self, signum: int, frame: Any) -> None:
        """The INTERRUPT_SIGNAL handler: PeerFailure in the main thread, inside watch()."""
        e = self.ending()
        v = e.peer_verdict if e is not None else None
        if e is not None and v is not None and e.in_watch > 0:
            raise PeerFailure.from_verdict(v)


# -- judging an exception -----------------------------------------------------------


def consequence_of_peer_failure(e: Ending, exc: Optional[BaseException] = None) -> Optional[Verdict]:
    """If a peer failed before this rank's exception ``exc``, the verdict on that peer; else None.

    When a peer dies, the survivors' collectives fail within milliseconds ("Connection
    reset by peer"): those exceptions are consequences, not root causes. The pidfd of the
    dead peer has fired before the exception was raised, so one look by the watcher
    settles which came first. A KeyboardInterrupt is no consequence (peerwatch never sends
    SIGINT): it is recorded at once, so that where every rank got the same SIGINT (Ctrl-C)
    each says so before the verdict, which then blames none (rule: interrupts are not failures).
    """
    if e.verdict is not None:
        return e.peer_verdict
    if isinstance(exc, KeyboardInterrupt):
        return None
    e.settle(SETTLE_S)
    if not e.peer_failed():
        return None
    e.verdict_seen.wait(e.config.parent_wait + SETTLE_S)
    return e.peer_verdict


_C_LONG_MAX = (1 << (8 * struct.calcsize("l") - 1)) - 1


def exit_status(status: Any) -> int:
    """The exit status the interpreter makes of ``sys.exit(status)``, as CPython does:
    ``None`` -> 0; an int (``True`` and ``False`` too) -> its C ``long`` value, which the
    OS cuts to 8 bits, or 255 when it does not fit one (``PyLong_AsLong`` fails, -1);
    anything else is printed and -> 1."""
    if status is None:
        return 0
    if isinstance(status, int):
        return status & 0xFF if -_C_LONG_MAX - 1 <= status <= _C_LONG_MAX else 255
    return 1  # sys.exit("message") prints it and exits 1


def record_exception(e: Ending, exc: BaseException, tb: Optional[TracebackType], seen_ns: Optional[int] = None) -> None:
    """Record ``exc`` as this rank's failure (unless a verdict on a peer is known already).
    ``seen_ns``: when it reached us (``time.time_ns()``), before any wait of ours; the
    failure's own time, as near to its raise as peerwatch can see (``raised_ns``)."""
    if e.peer_verdict is not None:
        return  # we are being torn down: what we raise now is a consequence, not a cause
    if isinstance(exc, SystemExit):
        code = exit_status(exc.code)
        if code == 0:
            return
        text = "".join(traceback.format_exception(type(exc), exc, tb))
        e.record_failure(_failure(e.rank, EXIT, code, text, seen_ns, message=f"SystemExit({exc.code!r})"))
        return
    e.record_failure(exception_failure(e.rank, exc, tb, 130 if isinstance(exc, KeyboardInterrupt) else 1, seen_ns))


def exception_failure(
    rank: int, exc: BaseException, tb: Optional[TracebackType], code: int, seen_ns: Optional[int] = None,
) -> Failure:
    """Rank ``rank``'s failure record for ``exc``, leaving with exit code ``code``; ``seen_ns``
    is when it reached peerwatch, before any wait of ours (its ``raised_ns``)."""
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    interrupt = isinstance(exc, KeyboardInterrupt)
    return _failure(
        rank, EXCEPTION, code, text, seen_ns, exception=qualified_name(type(exc)), message=exception_message(exc),
        collective=raised_by_torch_distributed(exc, tb), signal="SIGINT" if interrupt else None,
        signalled_by=exitwatch.interrupt_sender() if interrupt else None,
    )


def _failure(rank: int, cause: str, code: int, text: str, seen_ns: Optional[int], **fields: Any) -> Failure:
    """This process's failure record, made now in this thread (unless ``fields`` name
    another), with the end of ``text`` as its traceback."""
    fields.setdefault("thread", threading.current_thread().name)
    return Failure(rank=rank, pid=os.getpid(), time_ns=time.time_ns(), raised_ns=seen_ns, cause=cause, exit_code=code,
                   traceback=text[-MAX_TRACEBACK_CHARS:], **fields)


# torch.multiprocessing.spawn's worker wrapper, ``_wrap``: it catches the worker function's
# exception, sends its traceback to the main process (which prints it) and calls sys.exit(1).
_SPAWN_WRAPPER_FILE = os.sep + os.path.join("torch", "multiprocessing", "spawn.py")
_SPAWN_WRAPPER_FUNCTION = "_wrap"


def spawn_wrapped(caller: Optional[FrameType]) -> Optional[Exception]:
    """The worker's exception that torch.multiprocessing.spawn's wrapper turns into the
    ``sys.exit(1)`` it calls from ``caller`` (it becomes the SystemExit's ``__context__``);
    None for any other caller.

    Only torch's wrapper: elsewhere an exit inside an ``except`` block is the program's
    own choice of how to end (``except ConfigError: sys.exit(2)``), whose code is its
    contract, and its context may be an exception handled long before.
    """
    if caller is None:
        return None
    code = caller.f_code
    if code.co_name != _SPAWN_WRAPPER_FUNCTION or not code.co_filename.endswith(_SPAWN_WRAPPER_FILE):
        return None
    handled = sys.exc_info()[1]  # what the wrapper's "except Exception:" is handling
    return handled if isinstance(handled, Exception) else None


# What torch.multiprocessing.spawn's main process raises when a worker fails (named, not
# imported: import peerwatch never imports torch).
_SPAWN_FAILURES = frozenset((
    "torch.multiprocessing.spawn.ProcessExitedException", "torch.multiprocessing.spawn.ProcessRaisedException",
))
_spawn_noted = False  # spawn_main_note() says it once per process


def spawn_main_note(w: Watcher, exc: BaseException) -> Optional[str]:
    """What to say, once, when ``exc`` tells that this process is torch.multiprocessing.spawn's
    main process (a worker failed), not a rank of the job: whether its workers were watched
    (their own run, ``RUN/spawn``) or not (install() ran only here). None otherwise."""
    global _spawn_noted
    if _spawn_noted or qualified_name(type(exc)) not in _SPAWN_FAILURES:
        return None
    _spawn_noted = True
    head = (f"peerwatch: pid {w.me.pid} on {w.me.host} is torch.multiprocessing.spawn's main process, not one of its "
            f"workers: what it raised is a worker's failure")
    workers = w.run_dir.join(SPAWNED_RUN)  # for people; looked at through the held descriptor
    if watched_workers(w, exc) is not None:
        return f"{head}. Its workers are watched in their own run: peerwatch report {workers} names the one that failed first"
    return (f"{head}. install() ran only here: its workers were not watched (none was ended at once, no report "
            "names the worker). Call peerwatch.install(rank=i, world_size=nprocs) at the start of the worker function")


def watched_workers(w: Watcher, exc: BaseException) -> Optional[RunDir]:
    """The run of this process's workers (``RUN/spawn``), if ``exc`` is torch.multiprocessing.spawn's
    main process telling that a worker failed and the workers are watched there; else None."""
    if qualified_name(type(exc)) not in _SPAWN_FAILURES:
        return None
    try:
        # Looked at through the held descriptor: a symlink put in the run directory's place
        # never vouches for workers. Used by its path (the report and the summary name its
        # files, as people read them) only while that path is the same directory.
        held = RunDir(w.run_dir.at(SPAWNED_RUN))
        if not any(name.startswith("rank-") for name in held.names(RANKS)):
            return None
        by_path = RunDir(w.run_dir.join(SPAWNED_RUN))
        same = os.path.samestat(os.stat(held.path), os.lstat(by_path.path))
        return by_path if same else held
    except OSError:
        return None


def tell_workers_failure(w: Watcher, exc: BaseException, workers: RunDir) -> None:
    """This process is mp.spawn's main process and a watched worker failed: not this
    process's failure (no record, no verdict in its own run, no second summary). It says
    what it is and where the workers' run is; and, where no worker could print that run's
    summary (the main process SIGTERMs the survivors as soon as it sees one worker end,
    maybe before their watchers made a verdict), prints it, told from the workers' records,
    and runs the on_verdict hook where no worker did (claimed in the workers' run)."""
    note = spawn_main_note(w, exc)
    if note is not None:
        logger.warning("%s", note)
    try:
        verdict = report.verdict_of(workers)
        if verdict is not None and workers.claim(CLAIMS, SUMMARY_FILE):  # else a worker printed it
            logger.error("%s", report.summary(report.write(workers)))  # report.json too: nobody wrote it
        hook = None if verdict is None else start_hook(
            w.config.on_verdict, workers, verdict, w.rank, w.config.on_verdict_timeout)
        if hook is not None:
            hook.finish()
    except Exception:  # noqa: BLE001 - an excepthook of ours must never raise
        logger.debug("peerwatch: could not tell the workers' failure", exc_info=True)


def qualified_name(cls: type) -> str:
    module = cls.__module__
    return cls.__qualname__ if module in ("builtins", "__main__") else f"{module}.{cls.__qualname__}"


# -- the hooks ----------------------------------------------------------------------


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


def install_hooks(registry: Registry) -> None:
    """Install the process hooks once (under the registry's lock)."""
    if registry.hooks_installed:
        return
    registry.hooks_installed = True
    registry.main_frame = main_module_frame()
    logger.addHandler(_StderrFallback())
    sys.excepthook = _excepthook(registry, sys.excepthook)
    threading.excepthook = _threading_excepthook(registry, threading.excepthook)
    sys.exit = _sys_exit(registry)  # type: ignore[assignment]
    for name in ("exit", "quit"):  # site's Quitter raises SystemExit itself, not through sys.exit
        original = getattr(builtins, name, None)
        if original is not None and callable(original):
            setattr(builtins, name, _Quitter(registry, name, original))
    atexit.register(_at_exit, registry)
    _at_shutdown(_leaving, registry)

    def forked() -> None:
        registry.forget()
        stacks.after_fork_in_child()

    def forked_parent() -> None:
        # A new child (a DataLoader worker, forked): the heartbeat lists it now, not at the
        # next 10-heartbeat snapshot, so that if this rank dies its peers can end it.
        w = registry.active()
        if w is not None:
            w.children_changed()

    os.register_at_fork(after_in_child=forked, after_in_parent=forked_parent)


def _excepthook(registry: Registry, previous: Callable[..., Any]) -> Callable[..., None]:
    def excepthook(exc_type: Type[BaseException], exc: BaseException, tb: Optional[TracebackType]) -> None:
        seen_ns = time.time_ns()  # the failure's time: before the settle wait below (up to SETTLE_S)
        w = registry.active()
        if w is None or isinstance(exc, PeerFailure):
            previous(exc_type, exc, tb)
            return
        workers = watched_workers(w, exc)
        if workers is not None:  # mp.spawn's main process: a worker's failure, told in the workers' run
            previous(exc_type, exc, tb)
            tell_workers_failure(w, exc, workers)
            return
        verdict = consequence_of_peer_failure(w.ending, exc)
        if verdict is None:
            record_exception(w.ending, exc, tb, seen_ns)
            verdict = echoed(w.ending)
        if verdict is None:
            previous(exc_type, exc, tb)
            note = spawn_main_note(w, exc)
            if note is not None:
                logger.warning("%s", note)  # below the traceback, above the summary (printed as the process leaves)
            return
        # A peer failed first. The watcher has said so in one line and ends the process
        # with the verdict's code (no exit from here: a hook up the chain, torch's, may
        # have swapped sys.stderr and prints only when we return).
        tell_consequence(w, verdict, exc_type, exc, tb, previous)

    return excepthook


def echoed(e: Ending) -> Optional[Verdict]:
    """This rank's exception, just recorded, was raised by torch.distributed (``e.echo``):
    the verdict on another rank, if the verdict names one, else None. Waits for the
    verdict, as the rank would at exit (rule: a collective exception settles), so that an
    echo is not printed as a cause: the sockets of a dying peer close a moment before its
    pidfd fires, and a rank leaving with ``raise SystemExit(3)`` closes them while it
    finalizes, so the first look after the exception can find no failure yet."""
    if not e.echo:
        return None
    e.await_own_verdict()
    return e.peer_verdict


def tell_consequence(
    w: Watcher, verdict: Verdict, exc_type: Type[BaseException], exc: BaseException, tb: Optional[TracebackType],
    previous: Callable[..., Any],
) -> None:
    """A surviving rank's uncaught exception after the failure of ``verdict.rank``.

    What a collective raises then (gloo's "Connection reset by peer") is an echo of that
    failure: its traceback goes to this rank's stack file, and is printed only with
    ``verbose``. Any other exception may be a fault of its own: it is printed, followed
    (in the same stream, so below it whatever buffers it) by a line that says what it
    came after.
    """
    me = terminal.who(w.rank, w.me.pid, w.me.host)
    failed = terminal.who(verdict.rank, verdict.pid, verdict.host)
    interrupted = verdict.cause == INTERRUPTED  # nobody failed: no rank is named
    kept = terminal.keep_consequence(w.stacks.file, me, failed, exc_type, exc, tb, interrupted)
    if raised_by_torch_distributed(exc, tb) and not w.config.verbose:
        return
    previous(exc_type, exc, tb)
    stream = sys.stderr if sys.stderr is not None else sys.__stderr__
    if stream is not None:
        try:
            kept_in = w.run_dir.stack_path(w.rank) if kept else None
            stream.write(terminal.consequence_line(me, failed, kept_in, interrupted) + "\n")
            stream.flush()
        except (OSError, ValueError):
            pass


def _threading_excepthook(registry: Registry, previous: Callable[[Any], Any]) -> Callable[[Any], None]:
    def threading_excepthook(args: Any) -> None:
        e = registry.ending()
        if e is not None and args.exc_value is not None and not isinstance(args.exc_value, SystemExit):
            _record_thread_exception(e, args)
        previous(args)

    return threading_excepthook


def _record_thread_exception(e: Ending, args: Any) -> None:
    """An uncaught exception in a thread other than the main one. The process goes on, so
    by default it is recorded for the report (``events/thread-<rank>.json``, the first
    one), not judged; ``thread_exceptions="fail"`` makes it this rank's failure."""
    exc = args.exc_value
    thread = args.thread.name if args.thread is not None else "?"
    text = "".join(traceback.format_exception(type(exc), exc, args.exc_traceback))
    failure = _failure(e.rank, EXCEPTION, 1, text, None, exception=qualified_name(type(exc)),
                       message=exception_message(exc), thread=thread)
    if e.config.thread_exceptions == "fail" and e.verdict is None:
        e.record_failure(failure)
    else:
        e.record_thread_exception(failure)


def _record_exit_call(registry: Registry, status: Any, call: str, caller: Optional[FrameType]) -> None:
    """``sys.exit(status)`` or ``exit(status)`` is about to raise SystemExit: record a
    non-zero exit of the main thread (outside watch(), whose __exit__ sees it) as this
    rank's failure, with the stack of the caller (``call`` names the call, ``caller`` is
    the frame it was made from)."""
    seen_ns = time.time_ns()  # the exit's time: before the settle wait of consequence_of_peer_failure
    if threading.current_thread() is threading.main_thread() and registry.main_frame is not None:
        registry.exit_call = (status, registry.main_frame.f_lasti)
    e = registry.ending()
    if e is None or threading.current_thread() is not threading.main_thread() or e.in_watch:
        return
    code = exit_status(status)
    # torch.multiprocessing.spawn turns a worker's exception into sys.exit(1): gloo's
    # "connection reset" after a peer died is a consequence here too, not a cause.
    if code == 0 or e.verdict is not None or consequence_of_peer_failure(e) is not None:
        return
    raised = spawn_wrapped(caller)
    if raised is not None:
        # The exception is the cause (its type, message and traceback), judged as if it had
        # reached the excepthook: one raised by torch.distributed is an echo
        # (rule: echo waits for the leaving). The exit code is the one the process exits with.
        e.record_failure(exception_failure(e.rank, raised, raised.__traceback__, code, seen_ns))
        return
    e.record_failure(_failure(e.rank, EXIT, code, "".join(traceback.format_stack(caller)), seen_ns, message=call))


def _sys_exit(registry: Registry) -> Callable[..., None]:
    def exit(status: Any = None) -> None:
        """``sys.exit`` that first records a non-zero exit of the main thread as this rank's failure."""
        _record_exit_call(registry, status, f"sys.exit({status!r})", sys._getframe(1))
        _original_sys_exit(status)

    return exit


class _Quitter:
    """The builtin ``exit``/``quit`` (site's Quitter), recording like our ``sys.exit``."""

    def __init__(self, registry: Registry, name: str, original: Callable[..., Any]) -> None:
        self._registry, self._name, self._original = registry, name, original

    def __repr__(self) -> str:
        return repr(self._original)

    def __call__(self, code: Any = None) -> None:
        _record_exit_call(self._registry, code, f"{self._name}({code!r})", sys._getframe(1))
        self._original(code)


def arm_exit_status(registry: Registry) -> bool:
    """Let this process's exit status write its last record (:mod:`peerwatch.rundir.exitwatch`);
    under the registry's lock, again whenever ``install()`` is called. False where that
    cannot be done here: the success marker is then written at ``atexit``."""
    w = registry.active()
    return w is not None and exitwatch.arm(w.run_dir, w.rank, write_success=registry.explicit)


def _at_shutdown(call: Callable[[Registry], None], registry: Registry) -> None:
    """Have ``call(registry)`` run once the main thread has ended, before the interpreter
    finalizes: at threading's shutdown, which comes before every atexit handler (one the
    application registered after install() runs before ours, and may destroy the process
    group); at atexit, before ours, where threading has no such hook."""
    register = getattr(threading, "_register_atexit", None)  # the stdlib's own (concurrent.futures), 3.9+
    if register is not None:
        try:
            register(call, registry)
            return
        except RuntimeError:
            pass  # the interpreter is shutting down already
    atexit.register(call, registry)


def _leaving(registry: Registry) -> None:
    """The main thread has ended and nothing is recorded of how this rank ends: when the
    exit status will tell (a ``raise SystemExit(3)`` that reached the top, or success),
    say that the rank is leaving, before its sockets close while Python finalizes (its
    peers' collectives then fail: echoes of how it ends; rule: echo waits for the leaving)."""
    try:
        e = registry.ending()
        if e is not None and exitwatch.armed():
            e.record_leaving()  # unless its end is known already
    except Exception:  # noqa: BLE001 - an exit hook of threading's: it must never raise
        logger.exception("peerwatch: could not record that this rank is leaving")


def _at_exit(registry: Registry) -> None:
    """At a normal interpreter exit: the rank finished cleanly unless we know otherwise."""
    status = take_exit_status(registry)
    w = registry.active()
    if w is None:
        return
    e = w.ending
    if e.verdict is None and e.failed_code is not None:
        # This rank failed. Its peers may be unable to leave by themselves (the GIL held
        # in C code), and its watcher may be the only one left to end them: stay until
        # the verdict is made and our share of the teardown is done.
        e.await_own_verdict()
    if e.verdict is not None:
        # Being torn down: the watcher is the one to end the process, with the verdict's
        # exit code, once its share of the teardown is done. Tell it we are leaving.
        e.leave()
        leave.flush_and_exit(e.exit_code())
        return
    succeeded = e.failed_code is None and registry.explicit
    if succeeded:
        if exitwatch.armed():
            # The exit status decides, once the interpreter is done: a SystemExit(3) that
            # reached the top has not been seen by any hook. Other hosts are told the job
            # is ending (as before): what this rank's peers act on is the local record.
            e.tell_hosts_succeeded()
        else:
            e.record_success()
    else:
        exitwatch.set_success(False)
    w.stop(timeout=1.0)
    if w.left_in_store():
        _leave_before_finalizing(e, status, succeeded)


def _leave_before_finalizing(e: Ending, status: Optional[int], succeeded: bool) -> None:
    """A thread of the store bridge is still inside a store request (torch's C++ client,
    the GIL released: the store did not answer, or the verdict waiter's ``wait``). If
    Python finalized under it, the thread would be torn down the moment the store answers
    (std::terminate: "terminate called without an active exception", SIGABRT) and its
    client destroyed while in use (SIGSEGV): a rank that succeeded would end in a crash.
    So the process ends here, as a torn-down rank does (flushed, then ``os._exit``), with
    the status Python would have given it, and its success marker written first; what
    Python's exit would have done outside the process is done first (multiprocessing's
    children, logging, open files flushed), but the atexit handlers registered before
    install() and the objects' finalizers do not run. Where that status cannot be told (a
    ``raise SystemExit(n)`` that reached the top is seen by no hook), the exit goes on as
    before: the status must stay true."""
    if status is None:
        logger.info("peerwatch: rank %d: its exit status cannot be told here; Python finalizes with a store "
                    "request in flight", e.rank)
        return
    if status == 0 and succeeded and exitwatch.armed():
        e.record_success()  # what the exit status would have written
    leave.end_like_python(status)


def main_module_frame() -> Optional[FrameType]:
    """The frame of the ``__main__`` module's code, if this thread is running it (the
    outermost such frame on the stack); None elsewhere (another thread, an embedding)."""
    main = getattr(sys.modules.get("__main__"), "__dict__", None)
    found = None
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is main:
            found = frame
        frame = frame.f_back
    return found


def take_exit_status(registry: Registry) -> Optional[int]:
    """At exit: the status the process will exit with, where peerwatch can tell it: 0 if
    the ``__main__`` module ran to its end (its frame's last instruction is its return),
    the status of the ``sys.exit``/``exit``/``quit`` whose SystemExit ended it (the frame
    stopped where it stood at that call); None otherwise (an uncaught exception, a
    ``raise SystemExit(n)``, a program not run as ``__main__``). The frame is let go: it
    holds the module's globals, which Python's finalization must destroy as usual."""
    frame, registry.main_frame = registry.main_frame, None
    if frame is None or frame.f_lasti < 0:
        return None
    code = frame.f_code.co_code
    name = dis.opname[code[frame.f_lasti]] if frame.f_lasti < len(code) else ""
    if name.endswith(("RETURN_VALUE", "RETURN_CONST")):
        return 0
    if registry.exit_call is not None and registry.exit_call[1] == frame.f_lasti:
        return exit_status(registry.exit_call[0])
    return None


# -- PeerFailure in the main thread -------------------------------------------------


def install_interrupt_handler(registry: Registry) -> bool:
    """Our handler wakes the main thread out of sleep/select/wait to raise PeerFailure."""
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        if signal.getsignal(teardown.INTERRUPT_SIGNAL) not in (signal.SIG_DFL, None, registry.on_interrupt):
            return False
        signal.signal(teardown.INTERRUPT_SIGNAL, registry.on_interrupt)
        teardown.own_interrupt_handler(registry.on_interrupt)
        return True
    except (OSError, ValueError):
        return False


__all__ = [
    "Registry", "arm_exit_status", "consequence_of_peer_failure", "echoed", "exception_failure", "exit_status", "install_hooks",
    "install_interrupt_handler", "qualified_name", "record_exception", "spawn_main_note", "spawn_wrapped", "tell_consequence",
    "tell_workers_failure", "watched_workers",
]
