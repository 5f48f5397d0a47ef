"""An idle rank's heartbeat is its last record's bytes with a new time and seq
(peerwatch.hangs.heartbeat.Stamped): the bytes must be those a whole encoding gives, and a
record must never be written again once anything but its time and seq changed."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Iterator

import pytest

from peerwatch.core.records import Heartbeat, Registration, decode, encode
from peerwatch.hangs.heartbeat import HeartbeatWriter, OwnProgress, Stamped
from peerwatch.rundir.rundir import HEARTBEATS, TMP, RunDir, rank_file

FIELDS = dict(rank=3, pid=1234, step=None, progress_ns=None, paused=False, children=(), where="", in_collective=False,
              collectives=(), moved_ns=None, entered=(), pg_timeout_ms=0, activity=(), collectives_state="off",
              collectives_error="", leaving_ns=None, waits=(), enqueued=())


@pytest.mark.parametrize("changes", [
    {},
    {"step": 41, "progress_ns": 9_000_000_001, "paused": True, "children": ((77, 12), (78, 13))},
    {"where": 'train.py:7 in "time_ns":0,"seq":0', "collectives_error": 'a "quoted" \\ error'},
    {"collectives": (("0", 5, 4),), "entered": (("0", 5, "allreduce", "[[2]] float"),), "waits": ((1, 2, 3, 4, 5),),
     "enqueued": ("1 2 3",), "activity": (1, 2, 3), "leaving_ns": 17, "moved_ns": 16, "pg_timeout_ms": 600000},
])
def test_stamped_bytes_are_the_whole_encoding(changes) -> None:
    fields = {**FIELDS, **changes}
    stamped = Stamped(fields)
    for time_ns, seq in [(0, 0), (1_733_000_000_123_456_789, 1), (5, 10**12)]:
        whole = encode(Heartbeat(time_ns=time_ns, seq=seq, **fields))
        assert stamped.at(time_ns, seq) == whole
        assert stamped.last() == Heartbeat(time_ns=time_ns, seq=seq, **fields)


def _me() -> Registration:
    return Registration(rank=0, pid=os.getpid(), ppid=os.getppid(), start_ticks=0, uid=os.getuid(), host="h",
                        boot_id="b", pidns="p", time_ns=time.time_ns())


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[HeartbeatWriter]:
    for sub in (HEARTBEATS, TMP):
        os.makedirs(tmp_path / "run" / sub, mode=0o700)
    hb = HeartbeatWriter(RunDir(str(tmp_path / "run")), _me(), OwnProgress(), with_position=False, read_collectives=False)
    yield hb
    hb._file.close()
    hb._run_dir.close()


def test_every_field_but_time_and_seq_is_compared(writer) -> None:
    """A new Heartbeat field the writer does not put in its fields would be frozen at its
    first value in every record stamped after it."""
    names = {f.name for f in dataclasses.fields(Heartbeat)} - {"time_ns", "seq"}
    assert set(FIELDS) == names
    assert set(writer._fields()) == names


def _on_disk(hb: HeartbeatWriter) -> Heartbeat:
    beat = hb._run_dir.read(HEARTBEATS, rank_file("rank", 0), Heartbeat)
    assert beat is not None
    return beat


def test_a_writer_stamps_while_nothing_changes_and_encodes_again_when_something_does(writer) -> None:
    writer.write(set)
    first = writer._stamped
    writer.write(set)
    assert writer._stamped is first  # the same fields: written again, stamped
    second = _on_disk(writer)
    assert second.seq == 2 and second.step is None
    assert writer.published() == second  # built when asked for, as written

    writer._progress.beat(7)  # the training moved: a new record, never the old bytes
    writer.write(set)
    assert writer._stamped is not first
    third = _on_disk(writer)
    assert (third.seq, third.step, third.progress_ns) == (3, 7, writer._progress.progress_ns)
    assert third.time_ns >= second.time_ns
    assert writer.published() == third


def test_the_last_heartbeat_is_written_whole_and_published(writer) -> None:
    writer.write(set)
    writer._progress.beat(3)
    writer.write_last(set)
    beat = _on_disk(writer)
    assert (beat.step, beat.seq) == (3, 2)
    assert writer.published() == beat
    raw = (Path(writer._run_dir.path) / HEARTBEATS / rank_file("rank", 0)).read_bytes()
    assert decode(Heartbeat, raw) == beat
