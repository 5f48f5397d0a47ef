"""The exceptions a user sees (peerwatch.core.errors): their fields, their texts, and that they
pickle (a launcher sends a rank's exception to its parent that way). Pure."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest

import peerwatch
from peerwatch.core.errors import ConfigError, PeerFailure, PeerwatchError, RunDirError

pytestmark = pytest.mark.pure  # no process, no thread, no file: conftest skips its scan for leaks

VERDICT = SimpleNamespace(rank=2, cause="signal", exit_code=137, pid=4242, signal="SIGKILL", host="vm",
                          detail="killed by SIGKILL")


def fields(e: PeerFailure) -> tuple:
    return (e.rank, e.cause, e.exit_code, e.code, e.pid, e.signal, e.host, e.detail)


def test_config_error_carries_its_fields_and_says_where_the_value_came_from() -> None:
    e = ConfigError("grace", -1.0, "PEERWATCH_GRACE", "must be >= 0")
    assert (e.option, e.value, e.source, e.reason) == ("grace", -1.0, "PEERWATCH_GRACE", "must be >= 0")
    assert str(e) == "peerwatch option grace=-1.0 (from PEERWATCH_GRACE): must be >= 0"
    assert isinstance(e, ValueError) and isinstance(e, PeerwatchError)
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is ConfigError
    assert (back.option, back.value, back.source, back.reason) == (e.option, e.value, e.source, e.reason)
    assert str(back) == str(e)


def test_run_dir_error_carries_its_fields_and_pickles() -> None:
    e = RunDirError("/tmp/peerwatch/run", "writable by others")
    assert (e.path, e.reason) == ("/tmp/peerwatch/run", "writable by others")
    assert str(e) == "peerwatch run directory /tmp/peerwatch/run: writable by others"
    assert isinstance(e, OSError) and isinstance(e, PeerwatchError)
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is RunDirError
    assert (back.path, back.reason, str(back)) == (e.path, e.reason, str(e))


def test_users_meet_the_errors_as_peerwatch_names() -> None:
    for cls in (PeerwatchError, ConfigError, RunDirError, PeerFailure):
        assert cls.__module__ == "peerwatch"
        assert getattr(peerwatch, cls.__name__) is cls


def test_peer_failure_carries_the_verdicts_fields_and_exits_with_its_code() -> None:
    e = PeerFailure(2, "exit", 3, pid=4242, signal=None, host="vm", detail="exit code 3")
    assert fields(e) == (2, "exit", 3, 3, 4242, None, "vm", "exit code 3")
    assert isinstance(e, SystemExit) and not isinstance(e, Exception)
    assert str(e) == "rank 2 failed (exit); this rank exits with code 3: exit code 3"


def test_peer_failure_without_an_exit_code_exits_with_1_and_without_detail_says_less() -> None:
    e = PeerFailure(0, "vanished")
    assert (e.exit_code, e.code) == (1, 1)
    assert str(e) == "rank 0 failed (vanished); this rank exits with code 1"
    assert (e.pid, e.signal, e.host, e.detail) == (None, None, None, "")
    assert PeerFailure(0, "exit", 0).code == 0  # a known 0 is kept, not taken for "unknown"


def test_peer_failure_from_a_verdict() -> None:
    e = PeerFailure.from_verdict(VERDICT)
    assert type(e) is PeerFailure
    assert fields(e) == (2, "signal", 137, 137, 4242, "SIGKILL", "vm", "killed by SIGKILL")


def test_peer_failure_pickles_with_every_field() -> None:
    e = PeerFailure.from_verdict(VERDICT)
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is PeerFailure
    assert fields(back) == fields(e)
    assert str(back) == str(e)


def test_a_bound_class_raised_without_arguments_carries_the_verdict() -> None:
    # PyThreadState_SetAsyncExc raises a class, constructed with no arguments.
    bound = PeerFailure.bound_to(VERDICT)
    assert issubclass(bound, PeerFailure) and bound is not PeerFailure
    assert (bound.__name__, bound.__qualname__, bound.__module__) == ("PeerFailure", "PeerFailure", "peerwatch")
    e = bound()
    assert fields(e) == (2, "signal", 137, 137, 4242, "SIGKILL", "vm", "killed by SIGKILL")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is PeerFailure and fields(back) == fields(e)
    # The fields are copied when bound (a later change to the object is not seen), and only
    # into the subclass.
    verdict = SimpleNamespace(**vars(VERDICT))
    later = PeerFailure.bound_to(verdict)
    verdict.rank = 7
    assert later().rank == 2
    assert PeerFailure._bound is None


@pytest.mark.parametrize(
    "args, kwargs, expected",
    [
        ((5,), {}, (5, None, 1, 1, None, None, None, "")),
        ((), {"cause": "exit"}, (None, "exit", 1, 1, None, None, None, "")),
        ((), {"exit_code": 9}, (None, None, 9, 9, None, None, None, "")),
        ((1, "exception", 2), {}, (1, "exception", 2, 2, None, None, None, "")),
    ],
)
def test_a_bound_class_given_any_field_uses_only_the_arguments(args: tuple, kwargs: dict, expected: tuple) -> None:
    assert fields(PeerFailure.bound_to(VERDICT)(*args, **kwargs)) == expected
