"""The texts a person reads on the terminal at a failure (peerwatch.core.terminal): one spelling
of a rank, one short line per surviving rank, nothing a rank wrote can rewrite the screen.
Pure: strings in, strings out (and one file object the caller gives)."""

from __future__ import annotations

import io
from typing import List

import pytest

from peerwatch.core.terminal import (
    SHORT_CHARS,
    consequence_line,
    exception_message,
    keep_consequence,
    printable,
    short,
    stop_line,
    who,
)

pytestmark = pytest.mark.pure  # no process, no thread, no file: conftest skips its scan for leaks


def test_printable_shows_control_characters_but_keeps_tab_and_newline() -> None:
    text = "\x1b[31mred\x07\r\x00 tab\tnl\n\x7f\x9b\x9f\xa0é"
    assert printable(text) == "\\x1b[31mred\\x07\\x0d\\x00 tab\tnl\n\\x7f\\x9b\\x9f\xa0é"
    assert printable("plain text") == "plain text"


@pytest.mark.parametrize(
    "args, text",
    [
        ((2,), "rank 2"),
        ((2, 22122), "rank 2 (pid 22122)"),
        ((2, 22122, "vm"), "rank 2 (pid 22122 on vm)"),
        ((2, 22122, ""), "rank 2 (pid 22122)"),
        ((0, 0, "vm"), "rank 0 (pid 0 on vm)"),  # pid 0 is a pid, not "no pid"
        ((2, None, "vm"), "rank 2"),
    ],
)
def test_who_is_the_one_spelling_of_a_rank(args: tuple, text: str) -> None:
    assert who(*args) == text


def test_short_keeps_a_line_that_fits() -> None:
    assert SHORT_CHARS == 160
    assert short("x" * 160) == "x" * 160
    assert short("  boom  \n") == "boom"
    assert short("") == ""
    assert short(" \n \n") == ""


def test_short_cuts_a_long_line_to_the_limit() -> None:
    assert short("x" * 161) == "x" * 157 + "..."
    assert len(short("y" * 1000)) == 160
    assert short("abcdefghij", limit=8) == "abcde..."
    assert short("abcd    efghij", limit=10) == "abcd..."  # no blanks before the dots


def test_short_says_when_it_left_lines_out() -> None:
    assert short("first\nsecond") == "first..."
    assert short("first\nsecond\nthird") == "first..."
    assert short("\n\nfirst\n") == "first"


def test_stop_line() -> None:
    assert stop_line("rank 1 (pid 7 on vm)", "RuntimeError: boom\n  at line 3", "rank 0 (pid 6 on vm)", 1) == (
        "peerwatch: rank 0 (pid 6 on vm) stops with exit code 1: rank 1 (pid 7 on vm) failed first "
        "(RuntimeError: boom...)"
    )


def test_consequence_line() -> None:
    assert consequence_line("rank 0", "rank 1", "/run/stacks/rank0.txt") == (
        "peerwatch: rank 0: this exception came after rank 1 failed first; kept in /run/stacks/rank0.txt"
    )
    assert consequence_line("rank 0", "rank 1", None) == "peerwatch: rank 0: this exception came after rank 1 failed first"
    assert consequence_line("rank 0", "rank 1", None, interrupted=True) == (
        "peerwatch: rank 0: this exception came after the job was interrupted")
    assert consequence_line("rank 0", "rank 1", "") == "peerwatch: rank 0: this exception came after rank 1 failed first"


def raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as e:  # noqa: BLE001 - any, for its traceback
        return e


class Recording(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.calls: List[str] = []

    def write(self, s: str) -> int:
        self.calls.append("write")
        return super().write(s)

    def flush(self) -> None:
        self.calls.append("flush")
        super().flush()


def test_keep_consequence_appends_the_traceback_and_flushes() -> None:
    exc = raised(ConnectionError("Connection reset by peer"))
    file = Recording()
    assert keep_consequence(file, "rank 0", "rank 1", type(exc), exc, exc.__traceback__) is True
    assert file.calls == ["write", "flush"]  # flushed: faulthandler writes to the same file next
    text = file.getvalue()
    assert text.startswith(
        "peerwatch: rank 0: exception raised after rank 1 failed first (not printed; "
        "PEERWATCH_VERBOSE=1 prints it):\nTraceback (most recent call last):\n"
    )
    assert text.endswith("ConnectionError: Connection reset by peer\n\n")
    assert "in raised" in text


def test_keep_consequence_does_not_let_a_message_pass_for_a_crash() -> None:
    exc = raised(RuntimeError("Fatal Python error: Segmentation fault"))
    file = io.StringIO()
    assert keep_consequence(file, "rank 0", "rank 1", type(exc), exc, exc.__traceback__) is True
    assert "Fatal Python error: " not in file.getvalue()
    assert "RuntimeError: Fatal Python error - Segmentation fault\n" in file.getvalue()


class Broken(io.StringIO):
    def write(self, s: str) -> int:
        raise OSError(28, "No space left on device")


def test_keep_consequence_without_a_usable_file_is_false() -> None:
    exc = raised(ValueError("x"))
    assert keep_consequence(None, "rank 0", "rank 1", type(exc), exc, exc.__traceback__) is False
    closed = io.StringIO()
    closed.close()
    assert keep_consequence(closed, "rank 0", "rank 1", type(exc), exc, exc.__traceback__) is False  # ValueError
    assert keep_consequence(Broken(), "rank 0", "rank 1", type(exc), exc, exc.__traceback__) is False  # OSError


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no")


def test_exception_message() -> None:
    assert exception_message(ValueError("bad value")) == "bad value"
    assert exception_message(ValueError("x" * 3000)) == "x" * 2000
    assert exception_message(Unprintable()) == "<unprintable Unprintable>"
    assert exception_message(KeyError("k")) == "'k'"
