"""How peerwatch names a signal, and which signals are its own (peerwatch.proc.teardown)."""

from __future__ import annotations

import signal
import sys

import pytest

from peerwatch.proc.teardown import INTERRUPT_SIGNAL, RTMIN, STACKS_SIGNAL, signal_label

pytestmark = pytest.mark.pure  # no process, no thread, no file: conftest skips its scan for leaks


def test_our_signals_are_the_ones_every_rank_agrees_on() -> None:
    # A rank that installs the handler and the peer that sends the signal must agree on the
    # number: the fourth real-time signal above SIGRTMIN, and SIGURG for stack dumps.
    assert RTMIN == int(signal.SIGRTMIN)
    assert INTERRUPT_SIGNAL == int(signal.SIGRTMIN) + 4
    assert STACKS_SIGNAL == int(signal.SIGURG)


@pytest.mark.parametrize(
    "sig, label",
    [
        (signal.SIGTERM, "SIGTERM"),
        (signal.SIGKILL, "SIGKILL"),
        (signal.SIGURG, "SIGURG"),
        (int(signal.SIGRTMIN), "SIGRTMIN"),  # SIGRTMIN itself, not SIGRTMIN+0
        (int(signal.SIGRTMIN) + 1, "SIGRTMIN+1"),
        (INTERRUPT_SIGNAL, "SIGRTMIN+4"),
        (0, "0"),  # one Python does not name: its number
        (32, "32"),  # glibc's own real-time signals, below SIGRTMIN
    ],
)
def test_signal_label(sig: int, label: str) -> None:
    assert signal_label(sig) == label


def test_without_sigrtmin_linux_numbering_is_assumed(monkeypatch: pytest.MonkeyPatch) -> None:
    # A Python built without SIGRTMIN (not Linux): the module still imports, with glibc's 34.
    import importlib.util

    import peerwatch.proc.teardown as real

    monkeypatch.delattr(signal, "SIGRTMIN")
    spec = importlib.util.spec_from_file_location("peerwatch.proc._without_rtmin", real.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    assert module.RTMIN == 34
    assert module.INTERRUPT_SIGNAL == 38
