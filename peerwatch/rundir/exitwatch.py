"""This rank's last record, made from its exit status: success only with status 0.

Python does not see every exit status. On Python <= 3.11 a ``SystemExit`` that reaches
the top (``raise SystemExit(main())``, the builtin ``exit(n)`` when not replaced, a
``SystemExit`` raised in C) is handled by CPython after the interpreter is finalized:
``Py_FinalizeEx`` (atexit runs, seeing nothing) and then ``exit(n)``. Nor does Python see
a C library calling ``exit(n)``, or the 120 of a failed flush at shutdown.

The optional C extension :mod:`peerwatch._exitstatus` registers a glibc ``on_exit(3)``
callback, which receives the status given to ``exit()``. Everything it needs is prepared
here, while Python runs: directory fds of ``events/`` and ``tmp/``, the records encoded by
:mod:`peerwatch.core.records` around the two numbers only known at exit (the time, the exit
code), and the rank's pid (a forked child inherits the callback and must do nothing). At
exit it writes the success marker if the status is 0 (and ``install()`` was called and no
failure is recorded), else a failure record with the exit code; first writer wins.

Where the extension is missing (no compiler at install time, a libc without ``on_exit``
such as musl), :func:`arm` returns False and the caller falls back to writing the success
marker at ``atexit`` when it saw no failure: a ``raise SystemExit(n)`` at the top is then
taken for success (logged once at INFO).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional, Tuple

from ..core.records import EXIT, ExitStatus, Failure, Success, encode
from .rundir import EVENTS, TMP, RunDir, rank_file

logger = logging.getLogger("peerwatch")

# Stand-ins for the numbers the C callback writes at exit; never a real time or code.
TIME_SENTINEL = 7_151_151_151_151_151_151
CODE_SENTINEL = 6_242_242_242_242_242_242
SENDER_SENTINEL = 5_333_333_333_333_333_333

EXIT_MESSAGE = (
    "the process exited with this status, seen only as it ended (a SystemExit that reached "
    "the top, such as raise SystemExit(n), or exit() called from C): no traceback"
)

_native: Optional[Any] = None  # the module, once imported; False if it cannot be
_warned = False


def _module() -> Optional[Any]:
    global _native
    if _native is None:
        try:
            from .. import _exitstatus  # type: ignore[attr-defined]

            _native = _exitstatus
        except ImportError:
            _native = False
    return _native or None


def available() -> bool:
    """The C extension can be loaded here."""
    return _module() is not None


def _split(data: bytes, *sentinels: int) -> Tuple[bytes, ...]:
    """``data`` cut around each sentinel's decimal form, each found once and in order."""
    pieces = []
    rest = data
    for s in sentinels:
        head, found, rest = rest.partition(str(s).encode())
        if not found or str(s).encode() in head or str(s).encode() in rest:
            raise ValueError(f"sentinel {s} not found exactly once in {data!r}")
        pieces.append(head)
    pieces.append(rest)
    return tuple(pieces)


def success_template(rank: int, pid: int) -> Tuple[bytes, bytes]:
    """(head, tail): ``head + str(time_ns) + tail`` is ``encode(Success(rank, pid, time_ns))``."""
    head, tail = _split(encode(Success(rank=rank, pid=pid, time_ns=TIME_SENTINEL)), TIME_SENTINEL)
    return head, tail


def failure_template(rank: int, pid: int) -> Tuple[bytes, bytes, bytes]:
    """(head, mid, tail): ``head + str(time_ns) + mid + str(code) + tail`` is the encoded
    ``Failure(cause=EXIT, exit_code=code, message=EXIT_MESSAGE, observed=True)`` of this rank."""
    failure = Failure(
        rank=rank, pid=pid, time_ns=TIME_SENTINEL, cause=EXIT, exit_code=CODE_SENTINEL, message=EXIT_MESSAGE,
        observed=True,
    )
    head, mid, tail = _split(encode(failure), TIME_SENTINEL, CODE_SENTINEL)
    return head, mid, tail


def exit_template(rank: int, pid: int) -> Tuple[bytes, bytes, bytes, bytes]:
    """(head, mid, mid2, tail): ``head + str(time_ns) + mid + str(returncode) + mid2 + sender
    + tail`` is the encoded ``ExitStatus`` this rank writes of itself as it leaves, where
    ``sender`` is the signal sender's pid or ``null``."""
    status = ExitStatus(
        rank=rank, pid=pid, time_ns=TIME_SENTINEL, returncode=CODE_SENTINEL, observed_by=rank,
        signalled_by=SENDER_SENTINEL,
    )
    head, mid, mid2, tail = _split(encode(status), TIME_SENTINEL, CODE_SENTINEL, SENDER_SENTINEL)
    return head, mid, mid2, tail


def arm_leaving(rank: int, teardown: bool = True) -> bool:
    """This rank is being torn down: whichever way it ends from now on (the verdict's code
    through :func:`leave`, ``exit()``, or a SIGTERM from its launcher) writes
    ``events/exit-<rank>.json`` with what really happened. With ``teardown`` false (at
    :func:`arm`, from install() on) only a SIGTERM does: a launcher that saw another rank
    end may stop this one before its watcher has seen why, and the record then still says
    it was a SIGTERM and who sent it. True if a SIGTERM will be recorded (SIGTERM had its
    default action: an application's handler is left alone). False where the extension is
    not armed in this process."""
    native = _module()
    if native is None or native.armed() != os.getpid():
        return False
    try:
        return bool(native.arm_leaving(rank_file("exit", rank).encode(), *exit_template(rank, os.getpid()), teardown))
    except (RuntimeError, ValueError) as e:
        logger.debug("peerwatch: rank %d: its exit will not be recorded (%s)", rank, e)
        return False


def hold_sigterm(seconds: float) -> bool:
    """A rank acting on a verdict: for the next ``seconds``, a SIGTERM (its launcher's,
    sent once it saw the failed worker end) is held back, so that the summary of the
    failure is printed before the rank goes. The rank then ends by that SIGTERM at
    :func:`leave` or at exit, as it would have at once, or when the hold runs out; its exit
    record still says SIGTERM and who sent it. False where nothing is held (no extension,
    or SIGTERM is the application's)."""
    native = _module()
    if native is None or native.armed() != os.getpid():
        return False
    try:
        return bool(native.hold_term(float(seconds)))
    except (AttributeError, ValueError):
        return False  # an extension built before hold_term


def leave(code: int) -> None:
    """End this process now with ``code`` (``os._exit``), recording it first if
    :func:`arm_leaving` armed this process. Never returns."""
    native = _module()
    if native is not None and native.armed() == os.getpid():
        native.leave(code)
    os._exit(code)


def arm(run_dir: RunDir, rank: int, write_success: bool) -> bool:
    """Let the exit status of this process write its last record (see the module doc).

    True if the C callback is armed for this process; False where the extension is
    missing or the run directory's folders cannot be opened (then the caller writes the
    success marker itself at exit, as before). Call again to change ``write_success``.
    """
    native = _module()
    if native is None:
        _say_unavailable()
        return False
    pid = os.getpid()
    if native.armed() == pid:
        native.set_success(write_success)
        return True
    fds = []
    try:
        for sub in (EVENTS, TMP):
            fds.append(run_dir.open_folder(sub))  # the folders as checked, even if the path now names others
        native.arm(
            fds[0], fds[1], pid,
            rank_file("success", rank).encode(), *success_template(rank, pid),
            rank_file("failure", rank).encode(), *failure_template(rank, pid),
            write_success, f"peerwatch: rank {rank} could not write ".encode(),
            os.fsencode(run_dir.join(EVENTS)), os.fsencode(run_dir.join(TMP)),
        )
    except (OSError, ValueError, TypeError) as e:  # TypeError: an extension built from older sources
        for fd in fds:
            os.close(fd)
        hint = " (the extension was built from other sources: reinstall peerwatch)" if isinstance(e, TypeError) else ""
        logger.warning("peerwatch: rank %d: cannot watch its own exit status (%s)%s; a SystemExit that "
                       "reaches the top will be taken for success", rank, e, hint)
        return False
    arm_leaving(rank, teardown=False)
    _watch_interrupts(native)
    return True


def _watch_interrupts(native: Any) -> None:
    """Note who sends SIGINT from now on (for :func:`interrupt_sender`)."""
    try:
        native.watch_interrupts()
    except AttributeError:
        pass  # an extension built before watch_interrupts


def last_interrupt() -> Optional[Tuple[int, Optional[int]]]:
    """When this process's last SIGINT came (``time.monotonic_ns()``; the first of a burst
    within a second) and the pid that sent it (None where not known: a terminal's Ctrl-C
    comes from the kernel); None where none came, the extension is missing, or SIGINT is
    the application's own."""
    native = _module()
    try:
        seen = native.last_interrupt() if native is not None else None
    except AttributeError:
        return None  # an extension built before last_interrupt
    if seen is None:
        return None
    at_ns, sender = seen
    return int(at_ns), (int(sender) if sender > 0 else None)


def interrupt_sender() -> Optional[int]:
    """The pid that sent this process's last SIGINT; None where not known."""
    seen = last_interrupt()
    return seen[1] if seen is not None else None


def set_success(flag: bool) -> None:
    """Whether an exit status of 0 writes the success marker (if armed in this process)."""
    native = _module()
    if native is not None and native.armed() == os.getpid():
        native.set_success(flag)


def armed() -> bool:
    """The C callback will write this process's last record."""
    native = _module()
    return native is not None and native.armed() == os.getpid()


def _say_unavailable() -> None:
    global _warned
    if not _warned:
        _warned = True
        logger.info(
            "peerwatch: the exit-status extension (peerwatch._exitstatus) is not available here: a "
            "SystemExit that reaches the top of the program (raise SystemExit(n)) cannot be told from "
            "success; sys.exit(n) and exit(n) are still recorded",
        )


__all__ = ["CODE_SENTINEL", "EXIT_MESSAGE", "SENDER_SENTINEL", "TIME_SENTINEL", "arm", "arm_leaving", "armed",
           "available", "exit_template", "failure_template", "interrupt_sender", "last_interrupt", "leave", "set_success", "success_template"]
