"""The event log, RUN/events.jsonl, from real jobs: one JSON object per line, every event
of the run's life, each record logged once."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import List

import pytest
from harness import Job

pytestmark = pytest.mark.timeout(60)

GRACE_S = 1.0
ACK_S = 0.5
STUCK_S = ACK_S + GRACE_S + 2.0


def _lines(job: Job) -> List[dict]:
    path = job.run_dir / "events.jsonl"
    raw = path.read_bytes()
    assert raw.endswith(b"\n")
    lines = []
    for line in raw.splitlines():
        item = json.loads(line)  # every line parses on its own
        assert isinstance(item, dict) and isinstance(item["ts"], int) and isinstance(item["event"], str), item
        assert item["v"] == 1 and "rank" in item
        lines.append(item)
    return lines


def _of(lines: List[dict], event: str) -> List[dict]:
    return [e for e in lines if e["event"] == event]


def test_a_killed_rank_and_a_stuck_one_give_the_whole_story(make_job) -> None:
    # Rank 3 is SIGKILLed; rank 1 holds the GIL with SIGTERM blocked: it cannot acknowledge,
    # so it is sent SIGTERM, then SIGKILL after grace.
    job: Job = make_job(world=4, behave=["1=ignore_term+gil"]).start()
    job.wait_ready()
    job.wait_holding_gil(1)
    job.kill(3)
    job.wait_gone(within=STUCK_S + 2.0)
    lines = _lines(job)
    events = Counter(e["event"] for e in lines)

    assert sorted(e["rank"] for e in _of(lines, "register")) == [0, 1, 2, 3]
    (verdict,) = _of(lines, "verdict")
    assert verdict["rank"] == 3 and verdict["cause"] == job.report()["verdict"]["cause"]
    assert {e["rank"] for e in _of(lines, "verdict_seen")} >= {0, 2}
    assert {e["rank"] for e in _of(lines, "ack")} >= {0, 2}
    assert 1 not in {e["rank"] for e in _of(lines, "ack")}
    signals = {(e["rank"], e["signal"]) for e in _of(lines, "signal")}
    assert {(1, "SIGTERM"), (1, "SIGKILL")} <= signals, signals
    assert all(e["by"] in (0, 2) for e in _of(lines, "signal"))
    assert _of(lines, "report")
    exits = {e["rank"]: e for e in _of(lines, "exit")}
    assert {0, 2} <= set(exits), exits  # the survivors that left by themselves
    assert exits[0]["exit_code"] == verdict["exit_code"]
    # Each record once: one line per (event, rank) for the records of events/.
    for kind in ("register", "verdict", "ack", "exit", "failure", "success"):
        ranks = [e["rank"] for e in _of(lines, kind)]
        assert len(ranks) == len(set(ranks)), (kind, ranks)
    # In time order: registered, then the verdict, then the acks and signals.
    first_verdict = verdict["ts"]
    assert max(e["ts"] for e in _of(lines, "register")) < first_verdict
    assert all(e["ts"] >= first_verdict for e in _of(lines, "signal") + _of(lines, "ack"))
    assert events["verdict"] == 1


def test_a_clean_run_logs_its_registrations_and_successes(make_job) -> None:
    job: Job = make_job(world=2, api="watch", behave=["0=succeed@0.2", "1=succeed@0.2"]).start()
    job.wait_ready()
    job.wait_gone(within=10.0)
    assert job.returncodes() == {0: 0, 1: 0}
    lines = _lines(job)
    assert sorted(e["rank"] for e in _of(lines, "register")) == [0, 1]
    assert sorted(e["rank"] for e in _of(lines, "success")) == [0, 1]
    assert not _of(lines, "verdict")


def test_the_log_is_read_back_in_time_order(make_job, tmp_path: Path) -> None:
    from peerwatch.rundir import eventlog

    job: Job = make_job(world=3).start()
    job.wait_ready()
    job.kill(1)
    job.wait_gone(within=STUCK_S)
    events = eventlog.read(str(job.run_dir / "events.jsonl"))
    assert [e["ts"] for e in events] == sorted(e["ts"] for e in events)
    assert {e["event"] for e in events} >= {"register", "verdict", "verdict_seen", "ack", "report"}


# -- files that are not files (issue 22.6) ---------------------------------------------------


@pytest.mark.parametrize("when", ["before install", "mid-run"])
def test_a_fifo_in_place_of_the_log_blocks_nothing(make_job, when: str) -> None:
    """A FIFO at RUN/events.jsonl (a log shipper's) before install(), or put there mid-run:
    install() is not blocked, and a SIGKILLed rank is acted on as usual. Nothing is written
    into it: it is not a regular file, and the log says so once."""
    import os
    import threading

    job: Job = make_job(world=3)
    fifo = job.run_dir / "events.jsonl"
    if when == "before install":
        job.run_dir.mkdir(parents=True, mode=0o700)
        os.mkfifo(fifo, 0o600)
    job.start()
    job.wait_ready(timeout=15.0)
    if when == "mid-run":
        os.unlink(fifo)
        os.mkfifo(fifo, 0o600)
    # A reader on the FIFO: a writer that opens it then blocks on a full pipe would hang too.
    stop = threading.Event()
    got: List[bytes] = []

    def drain() -> None:
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        try:
            while not stop.wait(0.01):
                try:
                    got.append(os.read(fd, 65536))
                except BlockingIOError:
                    pass
        finally:
            os.close(fd)

    reader = threading.Thread(target=drain, name="fifo-reader")
    reader.start()
    try:
        job.kill(1)
        job.wait_gone(within=STUCK_S + 3.0)
    finally:
        stop.set()
        reader.join(5.0)
    assert job.report()["verdict"]["rank"] == 1, job.logs()
    assert not b"".join(got), "something was written into the FIFO"
    assert "is not a regular file" in job.logs(), job.logs()


def test_reading_a_log_that_is_not_a_regular_file(tmp_path: Path) -> None:
    """eventlog.read never blocks on a FIFO, never follows a symlink (to /dev/zero, which
    would exhaust memory), and reads at most its size cap."""
    import os

    from peerwatch.rundir import eventlog

    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo, 0o600)
    link = tmp_path / "zero.jsonl"
    os.symlink("/dev/zero", link)
    for path in (fifo, link):
        with pytest.raises(OSError):
            eventlog.read(str(path))
    big = tmp_path / "big.jsonl"
    line = b'{"v":1,"ts":1,"event":"x","rank":0}\n'
    big.write_bytes(line * (eventlog.MAX_LOG_BYTES // len(line) + 100))
    assert len(eventlog.read(str(big))) <= eventlog.MAX_LOG_BYTES // len(line)


def test_hosts_sharing_a_run_directory_append_to_their_own_logs_merged_on_reading(tmp_path: Path) -> None:
    # Issue 22.14: O_APPEND is not atomic across NFS clients, so hosts sharing the run
    # directory must not append to one file. Each appends to events-<host>.jsonl; the
    # readers (the timeline, peerwatch report) merge them by ts.
    from peerwatch.proc.identity import hostname
    from peerwatch.rundir import eventlog
    from peerwatch.rundir.rundir import RunDir, safe_name

    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    shared = RunDir(str(run), shared="test: shared_fs=on")
    eventlog.append(shared, "ack", 1, ts=30, pid=11)
    eventlog.append(shared, "ack", 0, ts=10, pid=10)
    mine = f"events-{safe_name(hostname())}.jsonl"
    assert sorted(p.name for p in run.iterdir()) == [mine], "a shared run directory's host appended to another file"
    # Another host's log, and one from a host-local run: all read, in time order.
    (run / "events-otherhost.jsonl").write_text('{"v":1,"ts":20,"event":"ack","rank":2}\n')
    (run / "events.jsonl").write_text('{"v":1,"ts":5,"event":"register","rank":0}\n')
    (run / "events-notes.txt").write_text("not a log\n")
    assert [(e["ts"], e["rank"]) for e in eventlog.read_run(str(run))] == [(5, 0), (10, 0), (20, 2), (30, 1)]
    # A host-local run directory keeps its one events.jsonl.
    local = tmp_path / "local"
    local.mkdir(mode=0o700)
    eventlog.append(RunDir(str(local)), "ack", 0, ts=1, pid=10)
    assert [p.name for p in local.iterdir()] == ["events.jsonl"]
    with pytest.raises(OSError):
        eventlog.read_run(str(tmp_path / "missing"))
