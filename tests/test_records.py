"""Records: encode/decode round trip, and decode() is ``None`` for anything that is not one."""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any, Dict

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from peerwatch.core.records import (
    HANG,
    HANG_EXIT_CODE,
    MAX_RECORD_BYTES,
    MAX_SIGNAL,
    MISMATCH,
    RECORD_VERSION,
    Ack,
    Diagnosis,
    ExitStatus,
    Failure,
    Heartbeat,
    NotSignalled,
    Registration,
    Success,
    Verdict,
    WatcherDeath,
    decode,
    encode,
    in_range,
    returncode_exit_code,
    signal_name,
)

RECORD_TYPES = [Registration, Success, Failure, ExitStatus, Ack, Heartbeat, Verdict]
TYPE_IDS = [cls.__name__ for cls in RECORD_TYPES]

ints = st.integers(min_value=-(2**70), max_value=2**70)
texts = st.text(max_size=40)

pytestmark = pytest.mark.pure  # no process, no thread, no file: conftest skips its scan for leaks



# The ranges decode() enforces (in_range), by field name; other int fields take any int.
NON_NEGATIVE = st.integers(min_value=0, max_value=2**70)
FIELD_INTS = {
    **dict.fromkeys(
        ["rank", "time_ns", "ppid", "start_ticks", "uid", "detected_by", "observed_by", "seq", "local_rank", "laggards"],
        NON_NEGATIVE,
    ),
    "pid": st.integers(min_value=1, max_value=2**70),
    "world_size": st.integers(min_value=1, max_value=2**70),
    "exit_code": st.integers(min_value=1, max_value=255),
    "returncode": st.integers(min_value=-MAX_SIGNAL, max_value=255),
    "children": st.tuples(st.integers(min_value=1, max_value=2**70), NON_NEGATIVE),
}


def strategy_for(tp: Any, name: str = "") -> st.SearchStrategy[Any]:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        return st.one_of(*[strategy_for(a, name) for a in typing.get_args(tp)])
    if tp is type(None):
        return st.none()
    if name == "children":
        return st.lists(FIELD_INTS[name], max_size=5).map(tuple)
    if tp is int:
        return FIELD_INTS.get(name, ints)
    if tp is bool:
        return st.booleans()
    if tp is str:
        return texts
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(strategy_for(args[0], name), max_size=5).map(tuple)
        return st.tuples(*[strategy_for(a) for a in args])
    raise AssertionError(f"no strategy for {tp!r}")


def records(cls: type) -> st.SearchStrategy[Any]:
    hints = typing.get_type_hints(cls)
    built = st.builds(cls, **{f.name: strategy_for(hints[f.name], f.name) for f in dataclasses.fields(cls)})
    return built.filter(in_range)  # left: a registration's rank below its world size


any_record = st.one_of(*[records(cls) for cls in RECORD_TYPES])


def minimal(cls: type) -> Dict[str, Any]:
    """A valid JSON body of cls with only its required fields."""
    body: Dict[str, Any] = {"version": RECORD_VERSION, "kind": cls.KIND}  # type: ignore[attr-defined]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING:
            body[f.name] = "x" if hints[f.name] is str else 3
    return body


def dumps(body: Any) -> bytes:
    return json.dumps(body).encode()


# -- round trip ------------------------------------------------------------------------


@pytest.mark.parametrize("cls", RECORD_TYPES, ids=TYPE_IDS)
@settings(deadline=None)
@given(data=st.data())
def test_round_trip(cls, data):
    record = data.draw(records(cls))
    encoded = encode(record)
    assert isinstance(encoded, bytes)
    assert decode(cls, encoded) == record


@settings(deadline=None)
@given(any_record)
def test_encoded_record_is_a_versioned_json_object_with_its_kind(record):
    body = json.loads(encode(record))
    assert body["version"] == RECORD_VERSION
    assert body["kind"] == type(record).KIND
    assert set(body) == {"version", "kind"} | {f.name for f in dataclasses.fields(record)}


@settings(deadline=None)
@given(any_record)
def test_a_record_does_not_decode_as_another_kind(record):
    for other in RECORD_TYPES:
        if other is not type(record):
            assert decode(other, encode(record)) is None


def test_heartbeat_children_come_back_as_tuples():
    hb = Heartbeat(rank=1, pid=2, time_ns=3, seq=4, children=((10, 11), (12, 13)))
    back = decode(Heartbeat, encode(hb))
    assert back == hb and isinstance(back.children, tuple) and isinstance(back.children[0], tuple)


def test_optional_fields_take_their_defaults_when_missing():
    for cls in RECORD_TYPES:
        record = decode(cls, dumps(minimal(cls)))
        assert record is not None, cls
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                assert getattr(record, f.name) == f.default


# -- unknown keys are ignored --------------------------------------------------------------


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=8,
)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(any_record, st.dictionaries(texts, json_values, max_size=4))
def test_unknown_keys_are_ignored(record, extra):
    known = {"version", "kind"} | {f.name for f in dataclasses.fields(record)}
    extra = {k: v for k, v in extra.items() if k not in known}
    body = json.loads(encode(record))
    body.update(extra)
    assert decode(type(record), dumps(body)) == record


# -- decode returns None for what is not a record ---------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b" ",
        b"\n",
        b"{",
        b"}",
        b"null",
        b"\x00\x01\x02\xff\xfe",
        b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR",
        b"\xef\xbb\xbf" + encode(Success(rank=1, pid=2, time_ns=3)),  # UTF-8 BOM
        encode(Success(rank=1, pid=2, time_ns=3)).replace(b'"success"', b'"succ\xe9ss"'),  # latin-1
        encode(Success(rank=1, pid=2, time_ns=3)) + b"\xff",
        encode(Success(rank=1, pid=2, time_ns=3)) + b"{}",  # two documents
        b"[" * 100_000 + b"]" * 100_000,  # nested too deep for the parser
        b'{"version": 1, "kind": "success", "rank": ' + b"9" * 5000 + b', "pid": 2, "time_ns": 3}',
    ],
    ids=["empty", "space", "newline", "open-brace", "close-brace", "null", "binary", "png", "bom",
         "latin-1", "trailing-ff", "two-documents", "deep-nesting", "huge-int-literal"],
)
def test_decode_rejects_what_is_not_json_of_a_record(data):
    assert decode(Success, data) is None


@settings(deadline=None)
@given(st.binary(max_size=200))
def test_decode_never_raises_on_arbitrary_bytes(data):
    for cls in RECORD_TYPES:
        assert decode(cls, data) is None


@settings(deadline=None)
@given(any_record, st.data())
def test_every_truncation_is_rejected(record, data):
    encoded = encode(record)
    cut = data.draw(st.integers(min_value=0, max_value=len(encoded) - 1))
    assert decode(type(record), encoded[:cut]) is None


@pytest.mark.parametrize("value", [[], [1, 2], "text", 3, 1.5, True, None])
def test_json_that_is_not_an_object_is_rejected(value):
    assert decode(Success, dumps(value)) is None


@pytest.mark.parametrize("version", [0, 2, -1, "1", None, [1], {"major": 1}], ids=repr)
def test_wrong_version_is_rejected(version):
    body = minimal(Success)
    body["version"] = version
    assert decode(Success, dumps(body)) is None


def test_missing_version_is_rejected():
    body = minimal(Success)
    del body["version"]
    assert decode(Success, dumps(body)) is None


@pytest.mark.parametrize("version", [True, 1.0], ids=repr)
def test_version_of_the_wrong_type_is_rejected(version):
    body = minimal(Success)
    body["version"] = version
    assert decode(Success, dumps(body)) is None


@pytest.mark.parametrize("kind", ["verdict", "Success", "", None, 1, ["success"]], ids=repr)
def test_wrong_kind_is_rejected(kind):
    body = minimal(Success)
    body["kind"] = kind
    assert decode(Success, dumps(body)) is None


def test_missing_kind_is_rejected():
    body = minimal(Success)
    del body["kind"]
    assert decode(Success, dumps(body)) is None


def _required(cls):
    return [(cls, f.name) for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]


@pytest.mark.parametrize(("cls", "name"), [p for c in RECORD_TYPES for p in _required(c)],
                         ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_missing_required_field_is_rejected(cls, name):
    body = minimal(cls)
    assert decode(cls, dumps(body)) is not None
    del body[name]
    assert decode(cls, dumps(body)) is None


def _wrong_values(tp: Any):
    """JSON values that are not of type tp."""
    options = typing.get_args(tp) if typing.get_origin(tp) is typing.Union else (tp,)
    candidates = [True, False, 0, 7, -3, 1.0, 2.5, "7", "", None, [], [1, 2], {}, {"a": 1}, [[1, 2]]]
    for value in candidates:
        if not any(_fits(value, o) for o in options):
            yield value


def _fits(value: Any, tp: Any) -> bool:
    if tp is type(None):
        return value is None
    if tp in (int, bool, str):
        return type(value) is tp
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, list):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_fits(v, args[0]) for v in value)
        return len(value) == len(args) and all(_fits(v, a) for v, a in zip(value, args))
    raise AssertionError(tp)


def _field_cases():
    for cls in RECORD_TYPES:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            yield cls, f.name, list(_wrong_values(hints[f.name]))


@pytest.mark.parametrize(("cls", "name", "bad_values"), list(_field_cases()),
                         ids=lambda v: v if isinstance(v, str) else getattr(v, "__name__", ""))
def test_wrong_field_types_are_rejected(cls, name, bad_values):
    assert bad_values
    for value in bad_values:
        body = minimal(cls)
        body[name] = value
        assert decode(cls, dumps(body)) is None, (name, value)


@pytest.mark.parametrize(
    ("field_type", "value"),
    [("int", True), ("int", False), ("int", "3"), ("int", 3.0), ("str", 3), ("str", ["x"])],
)
def test_bool_or_str_or_float_where_int_or_str_belongs(field_type, value):
    body = minimal(Registration)
    body["pid" if field_type == "int" else "host"] = value
    assert decode(Registration, dumps(body)) is None


@pytest.mark.parametrize(
    "children",
    [[1, 2], [[1]], [[1, 2, 3]], [["1", 2]], [[1, True]], [[1, 2.0]], [[1, None]], {"1": 2}, "12",
     [[1, 2], [3]], [[[1, 2]]]],
    ids=repr,
)
def test_heartbeat_children_of_the_wrong_shape_are_rejected(children):
    body = minimal(Heartbeat)
    body["children"] = children
    assert decode(Heartbeat, dumps(body)) is None


def test_non_finite_numbers_where_ints_belong_are_rejected():
    for literal in (b"NaN", b"Infinity", b"-Infinity"):
        data = b'{"version": 1, "kind": "success", "rank": 1, "pid": ' + literal + b', "time_ns": 3}'
        assert decode(Success, data) is None


def test_size_limit():
    body = encode(Success(rank=1, pid=2, time_ns=3))
    at_limit = body + b" " * (MAX_RECORD_BYTES - len(body))
    assert len(at_limit) == MAX_RECORD_BYTES
    assert decode(Success, at_limit) == Success(rank=1, pid=2, time_ns=3)
    assert decode(Success, at_limit + b" ") is None


def test_over_size_record_with_a_long_field_is_rejected():
    record = Failure(rank=1, pid=2, time_ns=3, cause="exception", traceback="x" * MAX_RECORD_BYTES)
    assert len(encode(record)) > MAX_RECORD_BYTES
    assert decode(Failure, encode(record)) is None


@settings(deadline=None)
@given(any_record)
def test_non_utf8_byte_anywhere_is_rejected(record):
    encoded = encode(record)
    # json.dumps escapes non-ASCII, so a raw high byte never belongs to a record.
    assume(encoded.isascii())
    assert decode(type(record), encoded[:-1] + b"\xff" + encoded[-1:]) is None


# -- helpers ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("returncode", "code"), [(0, 0), (1, 1), (255, 255), (-9, 137), (-15, 143), (-1, 129)])
def test_returncode_exit_code(returncode, code):
    assert returncode_exit_code(returncode) == code


@pytest.mark.parametrize(("signum", "name"), [(9, "SIGKILL"), (15, "SIGTERM"), (2, "SIGINT"), (99, "signal 99")])
def test_signal_name(signum, name):
    assert signal_name(signum) == name


# -- the format on disk, spelled out (other versions of peerwatch read it) -------------------------


def test_the_encoding_on_disk_is_compact_json_with_version_1_and_its_kind_first():
    assert encode(Success(rank=1, pid=2, time_ns=3)) == b'{"version":1,"kind":"success","rank":1,"pid":2,"time_ns":3}'
    hb = Heartbeat(rank=0, pid=5, time_ns=6, seq=7, children=((8, 9),))
    assert json.loads(encode(hb)) == {
        "version": 1, "kind": "heartbeat", "rank": 0, "pid": 5, "time_ns": 6, "seq": 7, "step": None,
        "progress_ns": None, "paused": False, "children": [[8, 9]], "where": "", "in_collective": False,
        "collectives": [], "moved_ns": None, "entered": [], "pg_timeout_ms": 0, "activity": [],
        "collectives_state": "", "collectives_error": "", "leaving_ns": None, "waits": [],
        "enqueued": [],
    }


def test_a_heartbeat_carries_the_collective_counters_and_one_without_them_still_reads():
    from peerwatch.core.records import decode

    hb = Heartbeat(rank=0, pid=5, time_ns=6, seq=7, collectives=(("0", 21, 20),), moved_ns=11,
                   entered=(("0", 21, "gloo:all_reduce", "[[4]] Float"),), pg_timeout_ms=10_000,
                   collectives_state="read")
    assert decode(Heartbeat, encode(hb)) == hb
    failing = Heartbeat(rank=0, pid=5, time_ns=6, seq=7, collectives_state="failing", collectives_error="RuntimeError: x")
    assert decode(Heartbeat, encode(failing)) == failing
    # Written by a peerwatch before collectives_state: it reads, its state unknown ("").
    older = b'{"version":1,"kind":"heartbeat","rank":0,"pid":5,"time_ns":6,"seq":7}'
    assert decode(Heartbeat, older) == Heartbeat(rank=0, pid=5, time_ns=6, seq=7)
    assert decode(Heartbeat, older).collectives_state == ""  # type: ignore[union-attr]


def test_a_diagnosis_record_round_trips_and_its_kind_is_the_record_type():
    from peerwatch.core.records import HANG, Diagnosis, decode

    d = Diagnosis(finding=HANG, laggards=(1,), entered=(0, 2), since_ns=3, stalled_at_ns=4, time_ns=7, made_by=0,
                  detail="rank 1 never entered gloo:all_reduce #21", group="0", seq=21, op="gloo:all_reduce")
    assert json.loads(encode(d))["kind"] == "diagnosis"
    assert decode(Diagnosis, encode(d)) == d
    assert decode(Diagnosis, encode(d).replace(b'"finding":"hang"', b'"finding":"bored"')) is None


def test_a_record_written_by_hand_in_the_documented_format_is_read():
    data = b'{"version": 1, "kind": "exit", "rank": 2, "pid": 40, "time_ns": 5, "returncode": -9, "observed_by": 0}'
    assert decode(ExitStatus, data) == ExitStatus(rank=2, pid=40, time_ns=5, returncode=-9, observed_by=0)
    assert decode(ExitStatus, data.replace(b'"version": 1', b'"version": 2')) is None


def test_a_record_is_at_most_one_mebibyte():
    assert MAX_RECORD_BYTES == 1024 * 1024
    record = Failure(rank=1, pid=2, time_ns=3, cause="exception", traceback="")
    fits = dataclasses.replace(record, traceback="x" * (1024 * 1024 - len(encode(record))))
    assert len(encode(fits)) == 1024 * 1024 and decode(Failure, encode(fits)) == fits
    over = dataclasses.replace(fits, traceback=fits.traceback + "x")
    assert decode(Failure, encode(over)) is None


def test_a_hang_exits_with_124_as_timeout_does():
    # docs/hangs.md and docs/report.md: the code a hung job's ranks exit with, as timeout(1)'s.
    assert HANG_EXIT_CODE == 124


def test_a_tuple_field_of_fixed_length_takes_exactly_that_many_items():
    # Heartbeat.children is a tuple of (pid, start_ticks) pairs.
    body = minimal(Heartbeat)
    body["children"] = [[1, 2], [3, 4], [5, 6]]
    assert decode(Heartbeat, dumps(body)).children == ((1, 2), (3, 4), (5, 6))
    body["children"] = []
    assert decode(Heartbeat, dumps(body)).children == ()


@dataclasses.dataclass(frozen=True)
class _Sample:
    KIND = "sample"
    ratio: float


def test_a_field_of_a_type_the_codec_does_not_check_is_never_decoded():
    # Records are strictly typed: a field type decode() cannot check (a float, say, added to a
    # record one day) makes the record unreadable rather than read unchecked.
    assert decode(_Sample, b'{"version": 1, "kind": "sample", "ratio": 0.5}') is None


# -- ranges: what a record of peerwatch can hold (issue 14: forged records) -------------


def _with(cls: type, **fields: Any) -> bytes:
    body = minimal(cls)
    body.update(fields)
    return dumps(body)


@pytest.mark.parametrize("code", [256, 0, -1, 1000, 2**40])
def test_a_verdict_exit_code_outside_1_to_255_is_rejected(code):
    # A forged verdict with exit_code 256 made every torn-down rank exit 0 (256 & 0xFF).
    assert decode(Verdict, _with(Verdict, exit_code=code)) is None
    assert decode(Verdict, _with(Verdict, exit_code=1)) is not None
    assert decode(Verdict, _with(Verdict, exit_code=255)) is not None


@pytest.mark.parametrize("code", [256, 0, -9])
def test_a_failure_exit_code_outside_1_to_255_is_rejected(code):
    assert decode(Failure, _with(Failure, exit_code=code)) is None
    assert decode(Failure, _with(Failure, exit_code=None)) is not None


@pytest.mark.parametrize("returncode", [-65, 256, -(2**31)])
def test_a_returncode_that_no_process_can_have_is_rejected(returncode):
    assert decode(ExitStatus, _with(ExitStatus, returncode=returncode)) is None
    assert decode(Verdict, _with(Verdict, returncode=returncode)) is None
    assert decode(ExitStatus, _with(ExitStatus, returncode=-9)) is not None
    assert decode(ExitStatus, _with(ExitStatus, returncode=0)) is not None


@pytest.mark.parametrize("cls", RECORD_TYPES, ids=TYPE_IDS)
def test_a_negative_rank_or_time_is_rejected(cls):
    assert decode(cls, _with(cls, rank=-1)) is None
    if "time_ns" in minimal(cls):
        assert decode(cls, _with(cls, time_ns=-5)) is None


@pytest.mark.parametrize("cls", [Registration, Success, ExitStatus, Ack, Heartbeat], ids=lambda c: c.__name__)
@pytest.mark.parametrize("pid", [0, -1])
def test_a_record_of_a_process_needs_a_positive_pid(cls, pid):
    assert decode(cls, _with(cls, pid=pid)) is None


def test_a_registration_outside_its_own_world_size_is_rejected():
    assert decode(Registration, _with(Registration, rank=9, world_size=3)) is None
    assert decode(Registration, _with(Registration, rank=2, world_size=3)) is not None
    assert decode(Registration, _with(Registration, rank=0, world_size=0)) is None


def test_heartbeat_children_must_be_processes():
    assert decode(Heartbeat, _with(Heartbeat, children=[[0, 5]])) is None
    assert decode(Heartbeat, _with(Heartbeat, children=[[7, -1]])) is None
    assert decode(Heartbeat, _with(Heartbeat, children=[[7, 5]])) is not None


# Each range at its edges: the last value in it decodes, the first one out does not.
_EDGES = [
    # (record type, field, last value in range, first value out of it)
    (Registration, "pid", 1, 0), (Registration, "ppid", 0, -1), (Registration, "start_ticks", 0, -1),
    (Registration, "uid", 0, -1), (Registration, "local_rank", 0, -1), (Registration, "rank", 0, -1),
    (Registration, "world_size", 4, 3),  # minimal()'s rank is 3: its world holds at least 4 ranks
    (Failure, "pid", 0, -1), (Failure, "exit_code", 1, 0), (Failure, "exit_code", 255, 256),
    (ExitStatus, "pid", 1, 0), (ExitStatus, "observed_by", 0, -1),
    (ExitStatus, "returncode", -MAX_SIGNAL, -MAX_SIGNAL - 1), (ExitStatus, "returncode", 255, 256),
    (Verdict, "exit_code", 1, 0), (Verdict, "exit_code", 255, 256), (Verdict, "detected_by", 0, -1),
    (Verdict, "pid", 0, -1), (Verdict, "returncode", -MAX_SIGNAL, -MAX_SIGNAL - 1), (Verdict, "returncode", 255, 256),
    (Verdict, "laggards", [0], [-1]),
    (Heartbeat, "pid", 1, 0), (Heartbeat, "seq", 0, -1), (Heartbeat, "children", [[1, 0]], [[0, 0]]),
    (Heartbeat, "children", [[1, 0]], [[1, -1]]), (Heartbeat, "time_ns", 0, -1),
    (Success, "pid", 1, 0), (Ack, "pid", 1, 0), (Success, "rank", 0, -1), (Success, "time_ns", 0, -1),
    (NotSignalled, "pid", 1, 0), (NotSignalled, "observed_by", 0, -1),
    (Diagnosis, "laggards", [0], [-1]), (Diagnosis, "entered", [0], [-1]), (Diagnosis, "finding", MISMATCH, "slow"),
]


def _edge_body(cls: type, **fields: Any) -> bytes:
    body = minimal(cls)
    if cls is Diagnosis:
        body.update(finding=HANG, laggards=[], entered=[])
    body.update(fields)
    return dumps(body)


@pytest.mark.parametrize(("cls", "name", "inside", "outside"), _EDGES,
                         ids=[f"{c.__name__}.{n}={o}" for c, n, _, o in _EDGES])
def test_each_range_holds_its_edge_and_refuses_the_next_value(cls, name, inside, outside):
    assert decode(cls, _edge_body(cls, **{name: inside})) is not None
    assert decode(cls, _edge_body(cls, **{name: outside})) is None


def test_in_range_answers_true_or_false():
    assert in_range(Success(rank=1, pid=2, time_ns=3)) is True
    assert in_range(Success(rank=-1, pid=2, time_ns=3)) is False
    assert in_range(WatcherDeath(rank=1, pid=2, time_ns=3, exception="E", message="m")) is True  # no rule of its own


def test_a_required_field_missing_is_refused_and_an_optional_one_takes_its_default():
    body = minimal(Failure)
    assert decode(Failure, dumps(body)) == Failure(**{k: v for k, v in body.items() if k not in ("version", "kind")})
    del body["cause"]
    assert decode(Failure, dumps(body)) is None


def test_warm_works_out_every_record_type():
    from peerwatch.core import records as _records

    _records._FIELDS.clear()
    _records.warm()
    assert {Registration, Success, Failure, ExitStatus, Ack, Heartbeat, Verdict, Diagnosis,
            NotSignalled} <= set(_records._FIELDS)


def test_the_same_bytes_decode_to_the_same_record_and_the_memo_stays_bounded():
    from peerwatch.core import records as _records

    data = encode(Ack(rank=3, pid=42, time_ns=5, deadline_ns=6))
    first = decode(Ack, data)
    assert first == Ack(rank=3, pid=42, time_ns=5, deadline_ns=6)
    assert decode(Ack, bytes(bytearray(data))) is first  # equal bytes, not the same object: one decode
    assert decode(Ack, bytearray(data)) == first  # not hashable: decoded all the same
    assert decode(Failure, data) is None  # the class is part of the key
    garbage = b'{"version": 1, "kind": "ack", "rank": -1, "pid": 1, "time_ns": 1, "deadline_ns": 1}'
    assert decode(Ack, garbage) is None and (Ack, garbage) not in _records._DECODED
    filler = 0
    while filler <= _records.DECODED_BYTES:  # fill it past its bound: it empties, never grows past it
        record = encode(Ack(rank=filler, pid=1, time_ns=1, deadline_ns=1))
        decode(Ack, record)
        filler += len(record)
        assert _records._decoded_bytes <= _records.DECODED_BYTES
    assert (Ack, data) not in _records._DECODED


def test_whether_a_failures_exit_code_was_observed_is_a_field_and_older_records_read_as_not_observed():
    """Issue 25.3: the report told an exit status seen at exit from a code said beforehand
    by the record's message; now by ``observed``, written where the record is made (the
    exit watch's template) and False in a record of an older peerwatch."""
    from peerwatch.rundir import exitwatch

    head, mid, tail = exitwatch.failure_template(3, 77)
    seen = decode(Failure, head + b"12" + mid + b"9" + tail)
    assert seen is not None and (seen.observed, seen.exit_code) == (True, 9)
    said = Failure(rank=3, pid=77, time_ns=12, cause="exception", exit_code=1, exception="ValueError")
    assert not said.observed and decode(Failure, encode(said)) == said
    assert decode(Failure, encode(dataclasses.replace(said, observed=True))).observed  # type: ignore[union-attr]
    older = (b'{"version":1,"kind":"failure","rank":3,"pid":77,"time_ns":12,"cause":"exit","exit_code":9,'
             b'"message":"' + exitwatch.EXIT_MESSAGE.encode() + b'"}')
    assert decode(Failure, older) == Failure(rank=3, pid=77, time_ns=12, cause="exit", exit_code=9,
                                             message=exitwatch.EXIT_MESSAGE, observed=False)


# -- exact values and edges (issue 25.6: what a mutant of core/records.py changes, a test sees) --


def test_activity_of_a_heartbeats_field_and_back() -> None:
    from peerwatch.core.records import Activity

    a = Activity.of((4000, 0, 1, 2, 3, 0, 8, 1))
    assert a == Activity(span_ms=4000, cpu_ms=0, places=1, other_cpu_ms=2, io_bytes=3, children_cpu_ms=0, samples=8,
                         main_io_bytes=1)
    assert a.as_tuple() == (4000, 0, 1, 2, 3, 0, 8, 1)
    assert a.as_tuple() == dataclasses.astuple(a)  # every field, in order (a new one must be added there)
    assert Activity.of((0,) * 8) == Activity(0, 0, 0, 0, 0, 0, 0, 0)  # zero is a figure, not a missing one
    for values in ((), (1,) * 7, (1,) * 9, (1, 1, 1, -1, 1, 1, 1, 1)):
        assert Activity.of(values) is None, values


def test_the_longest_traceback_kept_fits_a_record_whatever_its_characters() -> None:
    from peerwatch.core.records import MAX_TRACEBACK_CHARS

    worst = "\x00" * MAX_TRACEBACK_CHARS  # JSON writes each as \u0000: six bytes
    record = Failure(rank=1, pid=2, time_ns=3, cause="exception", traceback=worst, message="m" * 2000)
    data = encode(record)
    assert len(data) <= MAX_RECORD_BYTES and decode(Failure, data) == record


def test_named_ranks_are_every_rank_a_record_names() -> None:
    from peerwatch.core.records import named_ranks

    assert named_ranks(Success(rank=2, pid=1, time_ns=0)) == (2,)
    assert named_ranks(ExitStatus(rank=2, pid=1, time_ns=0, returncode=-9, observed_by=0)) == (2, 0)
    verdict = Verdict(rank=3, cause=HANG, exit_code=124, failed_at_ns=0, detected_by=1, detected_at_ns=0,
                      laggards=(3, 5))
    assert named_ranks(verdict) == (3, 1, 3, 5)
    diagnosis = Diagnosis(finding=HANG, laggards=(4,), entered=(0, 1), since_ns=0, stalled_at_ns=0, time_ns=0,
                          made_by=1, detail="")
    assert named_ranks(diagnosis) == (1, 4, 0, 1)
    assert named_ranks(object()) == ()


def test_the_events_folders_prefixes() -> None:
    from peerwatch.core.records import EVENT_TYPES, WATCHER_DEATH, Interrupt

    assert EVENT_TYPES == {"success": Success, "failure": Failure, "exit": ExitStatus, "ack": Ack, "thread": Failure,
                           "unsignalled": NotSignalled, "interrupt": Interrupt}
    assert WATCHER_DEATH == "watcher"


def _failure_of_size(n: int) -> bytes:
    base = len(encode(Failure(rank=1, pid=2, time_ns=3, cause="exit", message="")))
    data = encode(Failure(rank=1, pid=2, time_ns=3, cause="exit", message="x" * (n - base)))
    assert len(data) == n
    return data


def test_the_decode_memo_keeps_records_up_to_a_sixteenth_of_its_mebibyte(monkeypatch: pytest.MonkeyPatch) -> None:
    from peerwatch.core import records as _records

    monkeypatch.setattr(_records, "_DECODED", {})
    monkeypatch.setattr(_records, "_decoded_bytes", 0)
    assert _records.DECODED_BYTES == 1 << 20
    small, large, larger = _failure_of_size(400), _failure_of_size(65536), _failure_of_size(65537)
    for data in (small, large, larger):
        assert decode(Failure, data) is not None
    assert set(_records._DECODED) == {(Failure, small), (Failure, large)}  # both kept: no clearing while it fits
    assert _records._decoded_bytes == 400 + 65536


def test_the_decode_memo_fills_to_its_bound_exactly_then_starts_again(monkeypatch: pytest.MonkeyPatch) -> None:
    from peerwatch.core import records as _records

    first, second, third = _failure_of_size(300), _failure_of_size(301), _failure_of_size(302)
    monkeypatch.setattr(_records, "_DECODED", {})
    monkeypatch.setattr(_records, "_decoded_bytes", _records.DECODED_BYTES - 300 - 301)
    decode(Failure, first)
    decode(Failure, second)  # now exactly full: kept
    assert _records._decoded_bytes == _records.DECODED_BYTES and len(_records._DECODED) == 2
    decode(Failure, third)  # one more: the memo empties, and holds only it
    assert set(_records._DECODED) == {(Failure, third)} and _records._decoded_bytes == 302


def test_a_fresh_module_starts_with_an_empty_memo(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util
    import sys

    from peerwatch.core import records as _records

    spec = importlib.util.spec_from_file_location("_records_fresh", _records.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "_records_fresh", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    assert (module._DECODED, module._decoded_bytes) == ({}, 0)


def test_a_world_of_one_rank_holds_rank_0_only() -> None:
    body = minimal(Registration)
    body.update(rank=0, world_size=1)
    assert decode(Registration, dumps(body)) is not None
    body.update(rank=1)
    assert decode(Registration, dumps(body)) is None
    body.update(rank=0, world_size=0)
    assert decode(Registration, dumps(body)) is None
