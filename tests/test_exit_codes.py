"""The exit status the interpreter makes of ``sys.exit(x)``, and the records the exit-status
extension writes at exit: pure, no process (tests/test_exit_status.py checks both against
real processes)."""

from __future__ import annotations

import pytest

from peerwatch.core.records import EXIT, Failure, Success, decode, encode
from peerwatch.hooks import exit_status
from peerwatch.rundir import exitwatch

pytestmark = pytest.mark.pure  # no process, no thread, no file: conftest skips its scan for leaks

# sys.exit(x) -> the status CPython exits with (handle_system_exit: PyLong_AsLong, then exit()).
CPYTHON_STATUS = [
    (None, 0), (0, 0), (3, 3), (255, 255), (256, 0), (-1, 255), (True, 1), (False, 0),
    (2**31, 0), (2**63 - 1, 255), (-(2**63), 0), (2**63, 255), (-(2**63) - 1, 255), (2**100, 255),
    ("bye", 1), (3.0, 1), ((3,), 1),
]


@pytest.mark.parametrize("status, expected", CPYTHON_STATUS, ids=[repr(s)[:20] for s, _ in CPYTHON_STATUS])
def test_exit_status_is_cpythons(status: object, expected: int) -> None:
    assert exit_status(status) == expected


@pytest.mark.parametrize("time_ns, code", [(1, 1), (1_700_000_000_123_456_789, 3), (2**62, 255)])
def test_templates_make_the_records_encode_makes(time_ns: int, code: int) -> None:
    """What the C callback writes (pieces around two decimal numbers) is byte for byte what
    peerwatch.core.records encodes, and decodes as this rank's record."""
    head, tail = exitwatch.success_template(7, 4242)
    data = head + str(time_ns).encode() + tail
    assert data == encode(Success(rank=7, pid=4242, time_ns=time_ns))
    assert decode(Success, data) == Success(rank=7, pid=4242, time_ns=time_ns)

    head, mid, tail = exitwatch.failure_template(7, 4242)
    data = head + str(time_ns).encode() + mid + str(code).encode() + tail
    want = Failure(rank=7, pid=4242, time_ns=time_ns, cause=EXIT, exit_code=code, message=exitwatch.EXIT_MESSAGE,
                   observed=True)
    assert data == encode(want)
    assert decode(Failure, data) == want
