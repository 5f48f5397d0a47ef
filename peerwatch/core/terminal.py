"""What peerwatch prints on a terminal when a rank fails, and how it names a rank.

At a failure a person should read the cause once, first: the failing rank's own output
and traceback, then one peerwatch block, and from each other rank at most one short line
(rule: who reports). Every message names a rank the same way, ``rank 2 (pid 22122 on
vm)`` (:func:`who`); a surviving rank's one line is :func:`stop_line`; the exception it
raises because a peer failed goes to its stack file (:func:`keep_consequence`), and is
printed only with ``verbose``, followed by :func:`consequence_line`.

Pure but for :func:`keep_consequence`, which writes to a file it is given.
"""

from __future__ import annotations

import re
import traceback
from types import TracebackType
from typing import IO, Optional, Type

SHORT_CHARS = 160  # a failure's detail in a one-line message is cut to this many characters


_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # all but tab and newline


def printable(text: str) -> str:
    """``text`` safe for a terminal: every control character but tab and newline (ESC of a
    colour or cursor sequence, BEL, NUL, a carriage return, C1 controls) shown as ``\\xNN``,
    so what a failing rank wrote in its message cannot rewrite or hide the report."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def who(rank: int, pid: Optional[int] = None, host: Optional[str] = None) -> str:
    """``rank 2 (pid 22122 on vm)``: the one spelling of a rank in every message."""
    if pid is None:
        return f"rank {rank}"
    return f"rank {rank} (pid {pid} on {host})" if host else f"rank {rank} (pid {pid})"


def short(text: str, limit: int = SHORT_CHARS) -> str:
    """The first line of ``text``, cut to ``limit`` characters (an exception's message may
    hold a whole C++ backtrace)."""
    lines = text.strip().splitlines()
    first = lines[0] if lines else ""
    if len(first) > limit or len(lines) > 1:
        return first[: limit - 3].rstrip() + "..."
    return first


def stop_line(failed: str, detail: str, me: str, exit_code: int, interrupted: bool = False) -> str:
    """The one line a surviving rank prints when it acts on the verdict on ``failed``
    (``interrupted``: on a job interrupted from outside, where no rank failed)."""
    if interrupted:
        return f"peerwatch: {me} stops with exit code {exit_code}: {interrupted_text(detail)}"
    return f"peerwatch: {me} stops with exit code {exit_code}: {failed} failed first ({short(detail)})"


def interrupted_text(detail: str) -> str:
    """``the job was interrupted (SIGINT from outside the job, pid 4242; ...)``."""
    return f"the job was interrupted ({short(detail)})"


def consequence_line(me: str, failed: str, kept_in: Optional[str], interrupted: bool = False) -> str:
    """Printed after a surviving rank's exception that followed a peer's failure, when it
    is printed at all (``verbose``, or an exception that did not come from a collective).
    ``interrupted``: the job was interrupted from outside, and nobody failed."""
    where = f"; kept in {kept_in}" if kept_in else ""
    return f"peerwatch: {me}: this exception came after {_after(failed, interrupted)}{where}"


def _after(failed: str, interrupted: bool) -> str:
    return "the job was interrupted" if interrupted else f"{failed} failed first"


def keep_consequence(
    file: Optional[IO[str]], me: str, failed: str,
    exc_type: Type[BaseException], exc: BaseException, tb: Optional[TracebackType], interrupted: bool = False,
) -> bool:
    """Append the traceback of an exception that followed a peer's failure to this rank's
    stack file (open for writing; faulthandler dumps into it too). False if it could not."""
    if file is None:
        return False
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    # The report reads a signal's name from faulthandler's "Fatal Python error: " in this
    # file (a crash's last words): an exception's message must not look like one.
    text = text.replace("Fatal Python error: ", "Fatal Python error - ")
    try:
        file.write(f"peerwatch: {me}: exception raised after {_after(failed, interrupted)} (not printed; "
                   f"PEERWATCH_VERBOSE=1 prints it):\n{text}\n")
        file.flush()
        return True
    except (OSError, ValueError):
        return False


def exception_message(exc: BaseException) -> str:
    """``str(exc)``, cut to 2000 characters; ``<unprintable T>`` where making it raises (a
    user's ``__str__`` that fails must not become an error of peerwatch's own, nor lose
    the exception's type)."""
    try:
        return str(exc)[:2000]
    except Exception:  # noqa: BLE001 - any exception of the user's __str__
        return f"<unprintable {type(exc).__name__}>"


__all__ = ["SHORT_CHARS", "consequence_line", "exception_message", "interrupted_text", "keep_consequence", "printable", "short",
           "stop_line", "who"]
