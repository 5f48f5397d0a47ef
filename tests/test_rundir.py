"""The run directory on real files: atomic writes, tolerant reads, trust checks, preparation
(with stale directories set aside) and the resolution rule table."""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peerwatch import RunDirError
from peerwatch.core.records import MAX_RECORD_BYTES, Heartbeat, Registration, Success, Verdict, encode
from peerwatch.proc import identity
from peerwatch.proc.identity import Started
from peerwatch.rundir.basedir import base_dir, resolve
from peerwatch.rundir.prepare import prepare
from peerwatch.rundir.rundir import (
    EVENTS,
    HEARTBEATS,
    RANKS,
    STACKS,
    TMP,
    VERDICT_FILE,
    InPlace,
    RunDir,
    parse_rank_file,
    rank_file,
)
from peerwatch.rundir.trust import check_trusted

SUBDIRS = (RANKS, EVENTS, HEARTBEATS, STACKS, TMP)
DEADLINE_S = 5.0


def registration(info: identity.ProcessInfo, rank: int, **over: Any) -> Registration:
    fields: Dict[str, Any] = dict(
        rank=rank, pid=info.pid, ppid=info.ppid, start_ticks=info.start_ticks, uid=info.uid,
        host=identity.hostname(), boot_id=identity.boot_id(), pidns=identity.pid_namespace(),
        time_ns=time.time_ns(),
    )
    fields.update(over)
    return Registration(**fields)


def my_reg(rank: int = 0, **over: Any) -> Registration:
    return registration(identity.self_info(), rank, **over)


@pytest.fixture
def rd(tmp_path: Path) -> RunDir:
    run = RunDir(str(tmp_path / "run"))
    prepare(run, my_reg(), Started(time.time_ns(), None))
    return run


@pytest.fixture
def child() -> Iterator[subprocess.Popen]:
    """A live child process (cat, until its stdin closes); always reaped."""
    proc = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    assert proc.stdin is not None
    try:
        yield proc
    finally:
        proc.stdin.close()
        proc.wait(timeout=DEADLINE_S)


def dead_process_info() -> identity.ProcessInfo:
    """The identity of a process that ran and has been reaped."""
    proc = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    assert proc.stdin is not None
    try:
        info = identity.probe(proc.pid)
    finally:
        proc.stdin.close()
        proc.wait(timeout=DEADLINE_S)
    assert info is not None and identity.probe(proc.pid) is None
    return info


def warnings_about(caplog, text: str) -> List[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "peerwatch" and r.levelno == logging.WARNING
            and text in r.getMessage()]


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def set_asides(run: RunDir) -> List[str]:
    parent, name = os.path.split(run.path)
    return sorted(n for n in os.listdir(parent) if n.startswith(name + ".stale-"))


SUCCESS = encode(Success(rank=1, pid=2, time_ns=3))


# -- names ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "parsed"),
    [
        ("rank-00003.json", ("rank", 3)),
        ("failure-00012.json", ("failure", 12)),
        ("rank-00003.txt", ("rank", 3)),
        ("rank-123456789.json", ("rank", 123456789)),
        ("rank-1234567890.json", None),
        ("rank-00003.json.tmp", None),
        ("rank-abc.json", None),
        ("rank-.json", None),
        ("rank00003.json", None),
        ("rank-00003", None),
        ("verdict.json", None),
    ],
)
def test_parse_rank_file(name, parsed):
    assert parse_rank_file(name) == parsed


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(["rank", "success", "failure", "exit", "ack"]), st.integers(0, 10**9 - 1))
def test_rank_file_round_trip(prefix, rank):
    assert parse_rank_file(rank_file(prefix, rank)) == (prefix, rank)


# -- atomic writes -----------------------------------------------------------------------


def test_write_then_read(rd):
    assert rd.write(EVENTS, "success-00001.json", SUCCESS) is True
    assert rd.read(EVENTS, "success-00001.json", Success) == Success(rank=1, pid=2, time_ns=3)
    assert mode(rd.join(EVENTS, "success-00001.json")) == 0o600
    assert os.listdir(rd.join(TMP)) == []


def test_first_writer_wins_without_replace(rd):
    assert rd.write(EVENTS, VERDICT_FILE, b"first") is True
    assert rd.write(EVENTS, VERDICT_FILE, b"second") is False
    assert rd.read_bytes(EVENTS, VERDICT_FILE) == b"first"
    assert os.listdir(rd.join(TMP)) == []


def test_replace_overwrites(rd):
    assert rd.write(HEARTBEATS, "rank-00000.json", b"old") is True
    assert rd.write(HEARTBEATS, "rank-00000.json", b"new", replace=True) is True
    assert rd.read_bytes(HEARTBEATS, "rank-00000.json") == b"new"
    assert os.listdir(rd.join(TMP)) == []


def _beat(seq: int, where: str = "") -> bytes:
    return encode(Heartbeat(rank=0, pid=1, time_ns=seq, seq=seq, where=where))


def test_in_place_rewrites_one_inode_and_a_shorter_record_reads_back(rd):
    beat = InPlace(rd, HEARTBEATS, "rank-00000.json")
    beat.write(_beat(1, where="x" * 300))
    inode = os.stat(rd.join(HEARTBEATS, "rank-00000.json")).st_ino
    beat.write(_beat(2))  # shorter: padded, no stale tail
    assert os.stat(rd.join(HEARTBEATS, "rank-00000.json")).st_ino == inode
    assert rd.read(HEARTBEATS, "rank-00000.json", Heartbeat) == Heartbeat(rank=0, pid=1, time_ns=2, seq=2)
    assert os.listdir(rd.join(TMP)) == []
    beat.close()


def test_in_place_starts_a_new_file_when_its_own_is_deleted(rd):
    beat = InPlace(rd, HEARTBEATS, "rank-00000.json")
    beat.write(_beat(1))
    os.unlink(rd.join(HEARTBEATS, "rank-00000.json"))
    for seq in range(2, 2 + InPlace.CHECK_EVERY):
        beat.write(_beat(seq))
    got = rd.read(HEARTBEATS, "rank-00000.json", Heartbeat)
    assert got is not None and got.seq == 1 + InPlace.CHECK_EVERY
    beat.close()


def test_a_heartbeat_caught_half_written_is_read_again_without_a_warning(rd, monkeypatch, caplog):
    """The heartbeat is rewritten in place: a reader can catch a write half done. It reads
    again (the torn bytes are fed here: the race itself is too rare to provoke)."""
    good = _beat(7)
    torn = good[: len(good) // 2] + b" " * (len(good) - len(good) // 2)
    reads = iter([torn, good])
    monkeypatch.setattr(rd, "read_bytes", lambda sub, name, limit=MAX_RECORD_BYTES, strict=False: next(reads))
    with caplog.at_level(logging.WARNING, logger="peerwatch"):
        got = rd.read(HEARTBEATS, "rank-00000.json", Heartbeat)
    assert got is not None and got.seq == 7
    assert not caplog.records


def test_a_torn_write_once_record_is_not_read_again(rd, monkeypatch, caplog):
    """Records other than the heartbeat appear whole (link/rename): invalid is invalid."""
    good = encode(Success(rank=1, pid=2, time_ns=3))
    reads = iter([good[:5], good])
    monkeypatch.setattr(rd, "read_bytes", lambda sub, name, limit=MAX_RECORD_BYTES, strict=False: next(reads))
    with caplog.at_level(logging.WARNING, logger="peerwatch"):
        assert rd.read(EVENTS, "success-00001.json", Success) is None
    assert "not a valid peerwatch record" in caplog.text


def test_concurrent_writers_exactly_one_wins(rd):
    n = 8
    results: List[bool] = [False] * n
    start = threading.Barrier(n)

    def write(i: int) -> None:
        start.wait()
        results[i] = rd.write(EVENTS, VERDICT_FILE, f"writer {i}".encode() * 1000)

    threads = [threading.Thread(target=write, args=(i,), name=f"writer-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    assert results.count(True) == 1
    winner = results.index(True)
    assert rd.read_bytes(EVENTS, VERDICT_FILE) == f"writer {winner}".encode() * 1000
    assert os.listdir(rd.join(TMP)) == []


def test_write_does_not_follow_a_symlink_in_place_of_the_record(rd, tmp_path):
    outside = tmp_path / "outside"
    outside.write_bytes(b"precious")
    os.symlink(outside, rd.join(EVENTS, VERDICT_FILE))
    assert rd.write(EVENTS, VERDICT_FILE, b"verdict") is False  # something is already there
    os.symlink(outside, rd.join(HEARTBEATS, "rank-00000.json"))
    assert rd.write(HEARTBEATS, "rank-00000.json", b"beat", replace=True) is True
    assert outside.read_bytes() == b"precious"
    assert rd.read_bytes(HEARTBEATS, "rank-00000.json") == b"beat"


def test_write_into_a_missing_folder_raises_and_leaves_no_temp_file(rd):
    with pytest.raises(FileNotFoundError):
        rd.write("nowhere", "x.json", b"data")
    assert os.listdir(rd.join(TMP)) == []


# -- tolerant reads -------------------------------------------------------------------------


def test_missing_file_is_none_without_warning(rd, caplog):
    caplog.set_level(logging.DEBUG, logger="peerwatch")
    assert rd.read(EVENTS, "success-00001.json", Success) is None
    assert rd.read_bytes(EVENTS, "success-00001.json") is None
    assert rd.read(RANKS, "rank-00001.json", Registration) is None
    assert caplog.records == []


def test_missing_folder_is_none(tmp_path):
    assert RunDir(str(tmp_path / "absent")).read(EVENTS, VERDICT_FILE, Verdict) is None


def test_symlink_is_none_and_warned_once(rd, tmp_path, caplog):
    target = tmp_path / "elsewhere.json"
    target.write_bytes(SUCCESS)
    os.symlink(target, rd.join(EVENTS, "success-00001.json"))
    for _ in range(3):
        assert rd.read(EVENTS, "success-00001.json", Success) is None
    assert len(warnings_about(caplog, "symbolic link")) == 1


def test_directory_in_place_of_a_file_is_none(rd, caplog):
    os.mkdir(rd.join(EVENTS, VERDICT_FILE))
    for _ in range(2):
        assert rd.read(EVENTS, VERDICT_FILE, Verdict) is None
    assert len(warnings_about(caplog, VERDICT_FILE)) == 1


@pytest.mark.timeout(10)
def test_fifo_in_place_of_a_file_is_none_without_blocking(rd, caplog):
    os.mkfifo(rd.join(EVENTS, VERDICT_FILE))
    assert rd.read_bytes(EVENTS, VERDICT_FILE) is None
    assert rd.read(EVENTS, VERDICT_FILE, Verdict) is None
    assert len(warnings_about(caplog, "not a regular file")) == 1


def test_over_size_file_is_none(rd, caplog):
    with open(rd.join(EVENTS, "failure-00001.json"), "wb") as f:
        f.truncate(MAX_RECORD_BYTES + 1)
    assert rd.read_bytes(EVENTS, "failure-00001.json") is None
    assert len(warnings_about(caplog, "over the")) == 1


def test_size_limit_boundary(rd):
    with open(rd.join(EVENTS, "a.json"), "wb") as f:
        f.write(b"x" * 10)
    assert rd.read_bytes(EVENTS, "a.json", limit=10) == b"x" * 10
    assert rd.read_bytes(EVENTS, "a.json", limit=9) is None


def test_garbage_is_none_and_warned_once_per_file(rd, caplog):
    for name, data in (("success-00001.json", b"\x00garbage\xff"), ("success-00002.json", b'{"version": 1}')):
        with open(rd.join(EVENTS, name), "wb") as f:
            f.write(data)
    for _ in range(3):
        assert rd.read(EVENTS, "success-00001.json", Success) is None
        assert rd.read(EVENTS, "success-00002.json", Success) is None
    warned = warnings_about(caplog, "not a valid peerwatch record")
    assert len(warned) == 2
    assert {("success-00001.json" in r.getMessage()) for r in warned} == {True, False}


def test_record_of_another_kind_is_none(rd):
    rd.write(EVENTS, VERDICT_FILE, SUCCESS)
    assert rd.read(EVENTS, VERDICT_FILE, Verdict) is None


def test_empty_file_is_not_written_yet_and_not_warned(rd, caplog):
    open(rd.join(EVENTS, VERDICT_FILE), "wb").close()
    assert rd.read(EVENTS, VERDICT_FILE, Verdict) is None
    assert warnings_about(caplog, "") == []


@pytest.mark.parametrize("pad", [b" ", b"\0"])
def test_a_record_of_padding_alone_is_not_written_not_garbage(rd, caplog, pad):
    """An exit record of its full length in padding alone (seen after a SIGTERM to a job's
    process group): absent to a reader, with no warning, in the report too; a peer's
    record of that exit replaces it, also without calling it garbage."""
    from peerwatch.core.records import ExitStatus, decode
    from peerwatch.verdict import report

    name = rank_file("exit", 0)
    with open(rd.join(EVENTS, name), "wb") as f:
        f.write(pad * 132)
    with caplog.at_level(logging.WARNING, logger="peerwatch"):
        assert rd.read(EVENTS, name, ExitStatus) is None
        assert rd.rank_records(EVENTS, {"exit": ExitStatus})["exit"] == {}
        assert report.build(rd)["ranks"][0]["exit_code"] is None
        seen = encode(ExitStatus(rank=0, pid=os.getpid(), time_ns=1, returncode=-15, observed_by=1))
        assert rd.write(EVENTS, name, seen, valid=lambda data: decode(ExitStatus, data) is not None)
    assert rd.read_bytes(EVENTS, name) == seen
    assert warnings_about(caplog, "") == []


def test_registrations_skip_what_is_not_a_registration_of_that_rank(rd):
    rd.publish_registration(my_reg(0))
    rd.publish_registration(my_reg(3))
    rd.write(RANKS, "rank-00005.json", encode(my_reg(6)))  # says rank 6 in rank 5's file
    rd.write(RANKS, "rank-00007.json", b"garbage")
    rd.write(RANKS, "rank-abc.json", encode(my_reg(8)))
    rd.write(RANKS, "notes.txt", b"hello")
    rd.write(RANKS, "other-00009.json", encode(my_reg(9)))
    assert sorted(rd.registrations()) == [0, 3]
    assert rd.registrations()[3] == my_reg(3, time_ns=rd.registrations()[3].time_ns)


def test_entries_of_a_missing_folder_is_empty(tmp_path):
    assert list(RunDir(str(tmp_path / "absent")).entries(EVENTS)) == []


# -- trust ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dir_mode", [0o700, 0o750, 0o755, 0o500])
def test_check_trusted_accepts_own_directory_not_writable_by_others(tmp_path, dir_mode):
    d = tmp_path / "d"
    d.mkdir()
    d.chmod(dir_mode)
    check_trusted(str(d))


@pytest.mark.parametrize("dir_mode", [0o770, 0o720, 0o702, 0o777, 0o1777, 0o722])
def test_check_trusted_refuses_group_or_world_writable(tmp_path, dir_mode):
    d = tmp_path / "d"
    d.mkdir()
    d.chmod(dir_mode)
    with pytest.raises(RunDirError) as info:
        check_trusted(str(d))
    assert info.value.path == str(d)
    assert "writable" in info.value.reason


def test_check_trusted_refuses_a_symlink_to_a_good_directory(tmp_path):
    good = tmp_path / "good"
    good.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(good)
    with pytest.raises(RunDirError, match="symbolic link"):
        check_trusted(str(link))


def test_check_trusted_refuses_a_file(tmp_path):
    f = tmp_path / "f"
    f.write_text("")
    f.chmod(0o700)
    with pytest.raises(RunDirError, match="not a directory"):
        check_trusted(str(f))


def test_check_trusted_refuses_a_missing_path(tmp_path):
    with pytest.raises(RunDirError, match="cannot be read"):
        check_trusted(str(tmp_path / "missing"))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory away")
def test_check_trusted_refuses_a_directory_owned_by_someone_else(tmp_path):
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    os.chown(d, 12345, 12345)
    with pytest.raises(RunDirError, match="owned by uid 12345"):
        check_trusted(str(d))


def test_run_dir_error_is_an_os_error_with_fields():
    e = RunDirError("/x", "is odd")
    assert isinstance(e, OSError)
    assert (e.path, e.reason) == ("/x", "is odd")
    assert str(e) == "peerwatch run directory /x: is odd"


# -- prepare ----------------------------------------------------------------------------------


def test_prepare_creates_0700_folders_whatever_the_umask(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    old = os.umask(0)
    try:
        prepare(run, my_reg(), Started(time.time_ns(), None))
    finally:
        os.umask(old)
    assert mode(run.path) == 0o700
    for sub in SUBDIRS:
        assert stat.S_ISDIR(os.lstat(run.join(sub)).st_mode)
        assert mode(run.join(sub)) == 0o700, sub


def test_prepare_creates_missing_parents(tmp_path):
    run = RunDir(str(tmp_path / "a" / "b" / "run"))
    prepare(run, my_reg(), Started(time.time_ns(), None))
    assert os.path.isdir(run.join(EVENTS))


def test_prepare_is_idempotent_for_the_same_rank(rd, caplog):
    rd.publish_registration(my_reg(0))
    rd.write(EVENTS, "success-00001.json", SUCCESS)
    prepare(rd, my_reg(0), Started(time.time_ns(), None))
    assert rd.read(EVENTS, "success-00001.json", Success) is not None
    assert set_asides(rd) == []
    assert warnings_about(caplog, "earlier run") == []


@pytest.mark.parametrize("where", ["", EVENTS])
def test_prepare_refuses_a_writable_directory(rd, where):
    os.chmod(rd.join(where) if where else rd.path, 0o777)
    with pytest.raises(RunDirError, match="writable"):
        prepare(rd, my_reg(), Started(time.time_ns(), None))


def test_prepare_refuses_a_symlinked_run_directory(tmp_path):
    real = RunDir(str(tmp_path / "real"))
    prepare(real, my_reg(), Started(time.time_ns(), None))
    os.symlink(real.path, tmp_path / "link")
    with pytest.raises(RunDirError, match="symbolic link"):
        prepare(RunDir(str(tmp_path / "link")), my_reg(), Started(time.time_ns(), None))


def test_prepare_checks_the_base_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", "")  # no per-user place: the fixed name under TMPDIR
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    base = base_dir()
    assert base == str(tmp_path / f"peerwatch-{os.geteuid()}")
    prepare(RunDir(os.path.join(base, "run-1")), my_reg(), Started(time.time_ns(), None))
    assert mode(base) == 0o700
    os.chmod(base, 0o777)
    with pytest.raises(RunDirError) as info:
        prepare(RunDir(os.path.join(base, "run-2")), my_reg(), Started(time.time_ns(), None))
    assert info.value.path == base


def test_slot_held_by_a_dead_process_sets_the_directory_aside(rd, caplog):
    old = registration(dead_process_info(), rank=0)
    rd.publish_registration(old)
    rd.write(EVENTS, "failure-00002.json", b"from the old run")
    prepare(rd, my_reg(0), Started(time.time_ns(), None))
    aside = set_asides(rd)
    assert len(aside) == 1
    moved = RunDir(os.path.join(os.path.dirname(rd.path), aside[0]))
    assert moved.registrations() == {0: old}
    assert moved.read_bytes(EVENTS, "failure-00002.json") == b"from the old run"
    # A fresh directory in its place, holding only this rank's registration (prepare publishes it).
    assert set(rd.registrations()) == {0} and rd.registrations()[0].pid == os.getpid()
    assert os.listdir(rd.join(EVENTS)) == []
    assert mode(rd.path) == 0o700
    assert len(warnings_about(caplog, "earlier run")) == 1


def test_slot_held_by_a_live_other_process_is_an_error(rd, child):
    holder = registration(identity.probe(child.pid), rank=0)
    rd.publish_registration(holder)
    with pytest.raises(RunDirError) as info:
        prepare(rd, my_reg(0), Started(time.time_ns(), None))
    assert info.value.path == rd.path
    assert f"live pid {child.pid}" in info.value.reason and "rank 0" in info.value.reason
    assert set_asides(rd) == []
    assert rd.registrations() == {0: holder}


def test_slot_held_by_a_zombie_is_stale(rd, child):
    holder = registration(identity.probe(child.pid), rank=0)
    rd.publish_registration(holder)
    child.stdin.close()
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
    prepare(rd, my_reg(0), Started(time.time_ns(), None))
    assert len(set_asides(rd)) == 1


def test_slot_held_by_a_live_pid_from_an_earlier_boot_is_stale(rd, child):
    rd.publish_registration(registration(identity.probe(child.pid), rank=0, boot_id="an-earlier-boot"))
    prepare(rd, my_reg(0), Started(time.time_ns(), None))
    assert len(set_asides(rd)) == 1


def test_slot_held_by_a_pid_reused_by_another_process_is_stale(rd, child):
    info = identity.probe(child.pid)
    rd.publish_registration(registration(info, rank=0, start_ticks=info.start_ticks - 1))
    prepare(rd, my_reg(0), Started(time.time_ns(), None))
    assert len(set_asides(rd)) == 1


def test_dead_registration_of_another_rank_is_left_alone(rd):
    rd.publish_registration(registration(dead_process_info(), rank=1))
    prepare(rd, my_reg(0), Started(time.time_ns(), None))
    assert set_asides(rd) == []
    assert sorted(rd.registrations()) == [0, 1]  # its own, published by prepare


def _verdict(detected_at_ns: int) -> bytes:
    return encode(Verdict(rank=1, cause="exit", exit_code=1, failed_at_ns=detected_at_ns - 1,
                          detected_by=0, detected_at_ns=detected_at_ns))


def test_verdict_from_before_this_process_sets_the_directory_aside(rd):
    rd.write(EVENTS, VERDICT_FILE, _verdict(1000))
    prepare(rd, my_reg(0), Started(1001, None))
    assert len(set_asides(rd)) == 1
    assert rd.read_bytes(EVENTS, VERDICT_FILE) is None


def test_verdict_from_after_this_process_started_is_kept(rd):
    rd.write(EVENTS, VERDICT_FILE, _verdict(1000))
    prepare(rd, my_reg(0), Started(1000, None))
    assert set_asides(rd) == []
    assert rd.read_bytes(EVENTS, VERDICT_FILE) is not None


def test_verdict_ordered_by_the_boot_clock_not_the_wall_clock(rd):
    # The wall clock stepped back between two runs: the verdict's wall stamp reads later
    # than this process's start, its CLOCK_BOOTTIME stamp earlier. It is of an earlier run
    # (the quickstart run twice in one shell once set such a directory aside as its own).
    stepped = Verdict(rank=1, cause="exit", exit_code=1, failed_at_ns=4999, detected_by=0, detected_at_ns=5000,
                      boot_ns=1000)
    rd.write(EVENTS, VERDICT_FILE, encode(stepped))
    prepare(rd, my_reg(0), Started(wall_ns=2000, boot_ns=1001))
    assert len(set_asides(rd)) == 1


def test_verdict_made_after_start_by_the_boot_clock_is_kept(rd):
    forward = Verdict(rank=1, cause="exit", exit_code=1, failed_at_ns=999, detected_by=0, detected_at_ns=1000,
                      boot_ns=1001)
    rd.write(EVENTS, VERDICT_FILE, encode(forward))
    prepare(rd, my_reg(0), Started(wall_ns=2000, boot_ns=1000))
    assert set_asides(rd) == []


def test_verdicts_carry_the_boot_clock(tmp_path):
    # Every verdict a watcher makes is stamped with CLOCK_BOOTTIME, which the checks above
    # order runs by; so is this process's start.
    from peerwatch.verdict.decide import Observed, Policy, decide

    me = my_reg(0)
    obs = Observed(self_rank=0, now_ns=time.time_ns(), now_boot_ns=identity.boot_clock_ns(),
                   registrations={0: me, 1: dataclasses.replace(me, rank=1)}, successes=set(), failures={},
                   exit_statuses={}, gone={1: time.time_ns()})
    verdict = decide(obs, Policy(parent_wait_ns=0, default_exit_code=1)).verdict
    assert verdict is not None and verdict.boot_ns == obs.now_boot_ns
    started = identity.started()
    assert started.boot_ns is not None and 0 < started.boot_ns <= (identity.boot_clock_ns() or 0)


def test_old_verdict_is_kept_while_a_registered_peer_lives(rd, child):
    rd.publish_registration(registration(identity.probe(child.pid), rank=1))
    rd.write(EVENTS, VERDICT_FILE, _verdict(1000))
    prepare(rd, my_reg(0), Started(1001, None))
    assert set_asides(rd) == []


# -- resolve ------------------------------------------------------------------------------------


def parent_key() -> str:
    parent = identity.probe(os.getppid())
    assert parent is not None
    return f"{os.getppid()}.{parent.start_ticks}"


TORCHRUN = {"TORCHELASTIC_RUN_ID": "abc123", "TORCHELASTIC_RESTART_COUNT": "2"}
SLURM = {"SLURM_JOB_ID": "4711", "SLURM_STEP_ID": "3"}
MASTER = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


def test_resolve_explicit_run_dir_wins():
    assert resolve("/given/dir", {**TORCHRUN, **SLURM, **MASTER}) == ("/given/dir", "PEERWATCH_DIR")


@pytest.mark.parametrize(
    ("env", "name", "how"),
    [
        (TORCHRUN, "torchrun-abc123-{parent}-r2", "torchrun (TORCHELASTIC_RUN_ID)"),
        ({"TORCHELASTIC_RUN_ID": "abc123"}, "torchrun-abc123-{parent}-r0", "torchrun (TORCHELASTIC_RUN_ID)"),
        ({**TORCHRUN, **SLURM, **MASTER}, "torchrun-abc123-{parent}-r2", "torchrun (TORCHELASTIC_RUN_ID)"),
        (SLURM, "slurm-4711.3", "Slurm (SLURM_JOB_ID)"),
        ({"SLURM_JOB_ID": "4711"}, "slurm-4711.batch", "Slurm (SLURM_JOB_ID)"),
        ({**SLURM, **MASTER}, "slurm-4711.3", "Slurm (SLURM_JOB_ID)"),
        (MASTER, "master-10.0.0.1-29500-{parent}", "MASTER_ADDR/MASTER_PORT and parent process"),
        ({"MASTER_ADDR": "10.0.0.1"}, "run-{me}", "new run led by this process"),
        ({"MASTER_PORT": "29500"}, "run-{me}", "new run led by this process"),
        ({}, "run-{me}", "new run led by this process"),
        ({"TORCHELASTIC_RUN_ID": "", "SLURM_JOB_ID": ""}, "run-{me}", "new run led by this process"),
    ],
    ids=["torchrun", "torchrun-no-restart", "torchrun-first", "slurm", "slurm-batch", "slurm-before-master",
         "master", "addr-only", "port-only", "nothing", "empty-vars"],
)
def test_resolve_rule_table(env, name, how):
    me = identity.self_info()
    expected = os.path.join(base_dir(), name.format(parent=parent_key(), me=f"{me.pid}.{me.start_ticks}"))
    assert resolve(None, env) == (expected, how)


def test_resolve_sanitises_what_the_environment_says():
    path, _ = resolve(None, {"SLURM_JOB_ID": "../../etc", "SLURM_STEP_ID": "a b/c"})
    assert path == os.path.join(base_dir(), "slurm-.._.._etc.a_b_c")
    path, _ = resolve(None, {"TORCHELASTIC_RUN_ID": "x" * 200})
    assert os.path.basename(path).startswith("torchrun-" + "x" * 64 + "-")


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(["TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "MASTER_ADDR"]), st.text(min_size=1),
       st.text())
def test_resolve_always_stays_under_the_base_directory(var, value, other):
    env = {var: value, "TORCHELASTIC_RESTART_COUNT": other, "SLURM_STEP_ID": other, "MASTER_PORT": other or "1"}
    path, _ = resolve(None, env)
    assert os.path.dirname(path) == base_dir()
    name = os.path.basename(path)
    assert name not in ("", ".", "..") and "/" not in name and "\0" not in name


def test_resolve_agrees_between_siblings():
    """Two ranks started by the same parent (torchrun's agent, here the test) find the same run."""
    code = "import os, sys; from peerwatch.rundir.basedir import resolve; print(resolve(None, os.environ)[0])"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "SLURM_", "MASTER_"))}
    env.update(TORCHRUN)
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=30)
        assert p.returncode == 0
        outs.append(out.strip())
    me = identity.self_info()
    assert outs[0] == outs[1] == os.path.join(base_dir(), f"torchrun-abc123-{me.pid}.{me.start_ticks}-r2")


# -- base_dir ------------------------------------------------------------------------------------


def test_base_dir_prefers_a_private_xdg_runtime_dir(tmp_path, monkeypatch):
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert base_dir() == str(xdg / "peerwatch")


@pytest.mark.parametrize("setup", ["writable", "missing", "empty"])
def test_base_dir_falls_back_to_the_cache_home_then_tmpdir(tmp_path, monkeypatch, setup):
    xdg = tmp_path / "xdg"
    if setup == "writable":
        xdg.mkdir()
        xdg.chmod(0o777)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "" if setup == "empty" else str(xdg))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("HOME", str(home))
    assert base_dir() == str(home / ".cache" / "peerwatch") and mode(home / ".cache" / "peerwatch") == 0o700
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert base_dir() == str(tmp_path / "cache" / "peerwatch")
    home.chmod(0o777)  # others could rename .cache: not a private place
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    assert base_dir() == str(tmp_path / "tmp" / f"peerwatch-{os.geteuid()}")
    monkeypatch.setenv("HOME", "")
    monkeypatch.delenv("TMPDIR")
    assert base_dir() == f"/tmp/peerwatch-{os.geteuid()}"


def test_registration_helper_is_consistent():
    # Guard for the tests above: a registration of this process names this process.
    reg = my_reg(2)
    assert identity.is_same_process(reg.pid, reg.start_ticks, reg.uid)


@pytest.mark.parametrize("other", [{"host": "another-host"}, {"pidns": "pid:[1]"}], ids=["host", "pid namespace"])
def test_slot_held_by_another_host_is_never_judged_stale(rd, other):
    # A shared filesystem: another host's record says nothing we can check.
    holder = my_reg(0, pid=4_000_000, **other)
    rd.publish_registration(holder)
    with pytest.raises(RunDirError, match="belongs to one host"):
        prepare(rd, my_reg(0), Started(time.time_ns(), None))
    assert set_asides(rd) == []
    assert rd.registrations() == {0: holder}


def test_every_rank_a_record_names_must_be_inside_the_world(rd, caplog):
    """Not only the record's own rank: a verdict's laggards, who detected it, who observed an
    exit... one outside the world (where its size is known) makes the record ignored, warned once."""
    rd.world_size = 3
    now = time.time_ns()
    ok = Verdict(rank=1, cause="hang", exit_code=124, failed_at_ns=now, detected_by=2, detected_at_ns=now, laggards=(1, 2))
    rd.write(EVENTS, VERDICT_FILE, encode(ok))
    assert rd.read(EVENTS, VERDICT_FILE, Verdict) == ok
    for bad in (dataclasses.replace(ok, laggards=(1, 99)), dataclasses.replace(ok, detected_by=3)):
        os.unlink(rd.join(EVENTS, VERDICT_FILE))
        rd.write(EVENTS, VERDICT_FILE, encode(bad))
        with caplog.at_level(logging.WARNING, logger="peerwatch"):
            assert rd.read(EVENTS, VERDICT_FILE, Verdict) is None
            assert rd.read(EVENTS, VERDICT_FILE, Verdict) is None
    warned = [r.getMessage() for r in caplog.records if "outside this run's world size 3" in r.getMessage()]
    assert len(warned) == 2 and "names rank 99" in warned[0] and "names rank 3" in warned[1], warned  # once each
    rd.world_size = None  # unknown: not judged
    assert rd.read(EVENTS, VERDICT_FILE, Verdict) is not None


# -- the held descriptors are the only way in (issue 25.5) ------------------------------

_ARM_AND_EXIT = """
import os, sys, time
from peerwatch.proc import identity
from peerwatch.rundir import exitwatch
from peerwatch.rundir.prepare import prepare
from peerwatch.core.records import Registration
from peerwatch.proc.identity import Started
from peerwatch.rundir.rundir import RunDir
info = identity.self_info()
reg = Registration(rank=0, pid=info.pid, ppid=info.ppid, start_ticks=info.start_ticks, uid=info.uid,
                   host=identity.hostname(), boot_id=identity.boot_id(), pidns=identity.pid_namespace(),
                   time_ns=time.time_ns())
path, moved, decoy = sys.argv[1:]
rd = RunDir(path)
prepare(rd, reg, Started(time.time_ns(), None))
os.rename(path, moved)
os.symlink(decoy, path)
assert exitwatch.arm(rd, 0, write_success=True)
sys.exit(0)
"""


def _decoy(tmp_path: Path) -> Path:
    decoy = tmp_path / "decoy"
    for sub in SUBDIRS:
        (decoy / sub).mkdir(parents=True)
    return decoy


def test_a_directory_swapped_for_a_symlink_is_not_used_by_the_bridge_s_election_and_checks(rd, tmp_path):
    """Renamed away and replaced by a symlink to a decoy: the bridge's lock and flag, and
    what it checks (the verdict there, a folder's time), are still the directory checked."""
    from peerwatch.hosts import election as _election

    real = tmp_path / "moved"
    os.rename(rd.path, real)
    decoy = _decoy(tmp_path)
    os.symlink(decoy, rd.path)
    (decoy / EVENTS / VERDICT_FILE).write_bytes(b"not ours")
    election, flag = _election.Election(rd), _election.UpFlag(rd)
    try:
        assert election.take()
        flag.set(True)
        assert (real / _election.LOCK_FILE).is_file() and (real / _election.UP_FILE).is_file()
        assert not (decoy / _election.LOCK_FILE).exists() and not (decoy / _election.UP_FILE).exists()
        assert not rd.exists(EVENTS, VERDICT_FILE)
        assert rd.stat(RANKS).st_ino == os.stat(real / RANKS).st_ino
        assert rd.stat("", _election.LOCK_FILE).st_ino == os.stat(real / _election.LOCK_FILE).st_ino
        fd = rd.open_folder(EVENTS)
        try:
            assert os.fstat(fd).st_ino == os.stat(real / EVENTS).st_ino
        finally:
            os.close(fd)
    finally:
        flag.set(False)
        if election.fd is not None:
            os.close(election.fd)


def test_the_exit_watch_writes_into_the_directory_checked_not_a_symlink_put_in_its_place(tmp_path):
    from peerwatch.rundir import exitwatch

    if not exitwatch.available():
        pytest.skip("the exit-status extension is not built here")
    decoy = _decoy(tmp_path)
    path, moved = tmp_path / "run", tmp_path / "moved"
    subprocess.run([sys.executable, "-c", _ARM_AND_EXIT, str(path), str(moved), str(decoy)], check=True, timeout=60)
    assert (moved / EVENTS / rank_file("success", 0)).is_file()
    assert not (decoy / EVENTS / rank_file("success", 0)).exists()


def test_spawn_s_main_process_looks_for_its_workers_in_the_directory_checked(rd, tmp_path, monkeypatch):
    """torch.multiprocessing.spawn's main process says whether its workers were watched by
    their registrations in ``RUN/spawn/ranks``: those of the directory checked, not of a
    symlink put in its place (it would send the user to a run that is not theirs, or
    tell them their watched workers were not)."""
    import types

    from peerwatch import hooks
    from peerwatch.rundir.rundir import SPAWNED_RUN

    real = tmp_path / "moved"
    os.rename(rd.path, real)
    decoy = _decoy(tmp_path)
    os.symlink(decoy, rd.path)
    (decoy / SPAWNED_RUN / RANKS).mkdir(parents=True)
    (decoy / SPAWNED_RUN / RANKS / rank_file("rank", 0)).write_bytes(encode(my_reg(0)))
    failure = type("ProcessExitedException", (Exception,), {"__module__": "torch.multiprocessing.spawn"})
    w = types.SimpleNamespace(rank=0, me=my_reg(0), run_dir=rd)

    monkeypatch.setattr(hooks, "_spawn_noted", False)
    note = hooks.spawn_main_note(w, failure())  # type: ignore[arg-type]
    assert note is not None and "install() ran only here" in note, note

    (decoy / SPAWNED_RUN / RANKS / rank_file("rank", 0)).unlink()
    (real / SPAWNED_RUN / RANKS).mkdir(parents=True, mode=0o700)
    (real / SPAWNED_RUN / RANKS / rank_file("rank", 0)).write_bytes(encode(my_reg(0)))
    monkeypatch.setattr(hooks, "_spawn_noted", False)
    note = hooks.spawn_main_note(w, failure())  # type: ignore[arg-type]
    assert note is not None and "Its workers are watched in their own run" in note, note


def test_one_reader_of_a_folder_of_rank_files_for_the_watcher_the_report_and_the_cli(rd):
    """Issue 25.3: the report read events/ its own way (and the CLI its watcher deaths, and
    RunDir its registrations and success markers, each theirs). One reader now: each file
    read as the type its prefix names, kept only if it names the rank its file name does."""
    from peerwatch.core.records import EVENT_TYPES, Ack, Failure
    from peerwatch.verdict import report

    pid = os.getpid()
    rd.write(EVENTS, rank_file("success", 1), encode(Success(rank=1, pid=pid, time_ns=1)))
    rd.write(EVENTS, rank_file("failure", 2), encode(Failure(rank=2, pid=pid, time_ns=2, cause="exit", exit_code=3)))
    rd.write(EVENTS, rank_file("thread", 2), encode(Failure(rank=2, pid=pid, time_ns=2, cause="exception")))
    rd.write(EVENTS, rank_file("failure", 3), encode(Failure(rank=4, pid=pid, time_ns=2, cause="exit")))  # another rank's
    rd.write(EVENTS, rank_file("ack", 5), b"not a record")
    rd.write(EVENTS, rank_file("ack", 6), encode(Ack(rank=6, pid=pid, time_ns=3, deadline_ns=0)))
    rd.write(EVENTS, rank_file("junk", 7), encode(Success(rank=7, pid=pid, time_ns=1)))
    found = rd.rank_records(EVENTS, EVENT_TYPES)
    assert set(found) == set(EVENT_TYPES)
    assert {k: sorted(v) for k, v in found.items() if v} == {"success": [1], "failure": [2], "thread": [2], "ack": [6]}
    assert found["failure"][2].exit_code == 3 and found["thread"][2].cause == "exception"
    assert report._events(rd) == found
    assert rd.rank_records(EVENTS, {"success": Success}) == {"success": {1: found["success"][1]}}
    assert rd.registrations() == rd.rank_records(RANKS, {"rank": Registration})["rank"] == {0: rd.registrations()[0]}
