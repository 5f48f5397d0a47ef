"""The Observer, its Waker and the writer of this process's records, on a real run
directory with fake peers (real child processes this test starts: ``sleep``), real
pidfds and real inotify; and the Diagnoser on a real Observer (issue 25.2 and 25.8).

The races of issue 25.2, each in the order that lost before: a stop() before a folder
repair (or before the watch even started) left a folder watch running; the rank's own
records, written by other threads, went through the watcher thread's Observer.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Set

import pytest

from peerwatch.core.records import (
    BUSY,
    EXCEPTION,
    HANG,
    Activity,
    Diagnosis,
    ExitStatus,
    Failure,
    Registration,
    Success,
    encode,
)
from peerwatch.diagnoser import Diagnoser
from peerwatch.hangs.diagnose import RankState
from peerwatch.observer import Observer
from peerwatch.proc import identity
from peerwatch.proc.identity import Started
from peerwatch.rundir import prepare
from peerwatch.rundir.eventlog import OwnRecords
from peerwatch.rundir.rundir import DIAGNOSIS_FILE, EVENTS, RANKS, TMP, RunDir, rank_file
from peerwatch.verdict.decide import Observed
from peerwatch.verdict.report import build as report_build

DEADLINE_S = 5.0
S = 1_000_000_000


def _reg(rank: int, pid: int) -> Registration:
    info = identity.probe(pid)
    assert info is not None
    return Registration(
        rank=rank, pid=pid, ppid=info.ppid, start_ticks=info.start_ticks, uid=info.uid,
        host=identity.hostname(), boot_id=identity.boot_id(), pidns=identity.pid_namespace(),
        time_ns=time.time_ns(), world_size=4,
    )


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    rd = RunDir(str(tmp_path / "run"))
    prepare.prepare(rd, _reg(0, os.getpid()), Started(time.time_ns(), None))
    return rd


@pytest.fixture
def observers(run: RunDir) -> Iterator[Callable[..., Observer]]:
    """``make(rank=0)``: an Observer of ``run`` for this process as ``rank``; stopped after."""
    made: List[Observer] = []

    def make(rank: int = 0) -> Observer:
        obs = Observer(run, _reg(rank, os.getpid()), use_pidfd=True, remote=None)
        made.append(obs)
        return obs

    yield make
    for obs in made:
        obs.local.stop()


@pytest.fixture
def peers() -> Iterator[Callable[[], subprocess.Popen]]:
    """``start()``: a fake peer (``sleep``), a child of this test; killed and reaped after."""
    started: List[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        proc = subprocess.Popen(["sleep", "60"])
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=DEADLINE_S)


def _register(run: RunDir, rank: int, pid: int) -> Registration:
    reg = _reg(rank, pid)
    assert run.write(RANKS, rank_file("rank", rank), encode(reg))
    return reg


def _until(obs: Observer, done: Callable[[], bool], what: str) -> None:
    """Run the watcher's turn (wait for a source, then scan) until ``done()``."""
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        left = deadline - time.monotonic()
        assert left > 0, f"not within {DEADLINE_S}s: {what}"
        obs.local.wait(min(left, 0.5))
        obs.scan()


def _inotify_fds() -> Set[int]:
    """This process's open inotify instances (the folder watch has no thread: its
    descriptor is what a leaked watch leaves)."""
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "anon_inode:inotify":
                fds.add(int(name))
        except OSError:
            continue  # the listing's own descriptor, closed by now
    return fds


def _new_watches(before: Set[int]) -> List[int]:
    """inotify descriptors opened since ``before`` and still open."""
    return sorted(_inotify_fds() - before)


# -- the Observer on a real run directory ------------------------------------------------


def test_a_registration_wakes_the_observer_through_inotify_and_a_killed_peer_is_seen_gone(run, observers, peers):
    obs = observers()
    obs.local.start()  # inotify on ranks/ and events/ (or a poll, where inotify is out of instances)
    proc = peers()
    _register(run, 1, proc.pid)
    _until(obs, lambda: 1 in obs.peers, "rank 1's registration seen")
    assert obs.live_local_ranks() == [0, 1] and obs.local_pids() == {os.getpid(), proc.pid}
    proc.send_signal(signal.SIGKILL)  # our own child
    _until(obs, lambda: 1 in obs.gone, "rank 1 seen gone by its pidfd")
    # Its parent (this process) learnt how it ended, without reaping it.
    status = obs.events[rank_file("exit", 1)]
    assert isinstance(status, ExitStatus) and (status.rank, status.returncode, status.observed_by) == (1, -9, 0)
    assert obs.peer_failed() and obs.live_local_ranks() == [0]
    assert run.read(EVENTS, rank_file("exit", 1), ExitStatus) is None  # written after deciding...
    obs.flush()
    assert run.read(EVENTS, rank_file("exit", 1), ExitStatus) == status  # ...for the peers and the report
    assert proc.wait(timeout=DEADLINE_S) == -9
    observed = obs.observed()
    assert observed.exit_statuses == {1: status} and set(observed.gone) == {1}


def test_a_rank_registered_under_another_uid_is_never_a_live_local_rank(run, observers, peers):
    """A registration of this host under another uid is not watched (never signalled, never
    seen gone): counted live, a dead one would stay a judge or an enforcer for ever."""
    obs = observers()
    proc = peers()
    reg = _reg(1, proc.pid)
    foreign = Registration(**{**reg.__dict__, "uid": reg.uid + 1})
    assert run.write(RANKS, rank_file("rank", 1), encode(foreign))
    mine = peers()
    _register(run, 2, mine.pid)
    _until(obs, lambda: 2 in obs.peers, "rank 2's registration seen")
    assert 1 not in obs.peers and obs.live_local_ranks() == [0, 2]


def test_a_new_record_wakes_the_watcher_and_none_does_once_it_stopped_watching_folders(run, observers):
    """The folder watch sits in the watcher's own poll set: a record linked into events/
    wakes wait() at once (a poll alone would sleep the whole timeout). After
    stop_watching_folders() nothing wakes it, nor does the closed number (POLLNVAL)."""
    obs = observers()
    if not obs.local.start():
        pytest.skip("inotify is out of instances on this machine")
    assert not obs.local.wait(0)  # the folder watch's descriptor joins the poll set
    done = Success(rank=2, pid=os.getpid(), time_ns=time.time_ns())
    assert run.write(EVENTS, rank_file("success", 2), encode(done))
    assert obs.local.wait(DEADLINE_S), "a new record did not wake the watcher"
    assert not obs.local.wait(0), "the folder watch was drained"
    obs.local.stop_watching_folders()
    assert run.write(EVENTS, rank_file("success", 3), encode(Success(rank=3, pid=os.getpid(), time_ns=time.time_ns())))
    assert not obs.local.wait(0.2) and not obs.local.wait(0.2)


def test_a_pidfd_taken_over_by_the_application_is_replaced_and_the_peer_still_watched(run, observers, peers, caplog):
    obs = observers()
    obs.local.start()
    proc = peers()
    _register(run, 1, proc.pid)
    _until(obs, lambda: 1 in obs.peers, "rank 1's registration seen")
    old = obs.peers[1].pidfd
    assert old is not None
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        os.dup2(null, old)  # the application's dup2 over "its" descriptors
        obs.local.check_fds(every_pidfd=True)
        assert 1 not in obs.gone, "a pidfd taken over is no death"
        assert any("still runs, so it is watched through a new pidfd" in r.getMessage() for r in caplog.records)
        proc.send_signal(signal.SIGKILL)
        _until(obs, lambda: 1 in obs.gone, "rank 1 seen gone through its new pidfd")
    finally:
        os.close(null)
        if obs.peers[1].pidfd != old:
            os.close(old)  # the /dev/null copy: ours, not the Observer's any more


def test_a_record_of_another_process_of_a_rank_is_ignored(run, observers, peers):
    obs = observers()
    proc = peers()
    _register(run, 1, proc.pid)
    forged = Failure(rank=1, pid=proc.pid + 100000, time_ns=time.time_ns(), cause=EXCEPTION, message="another job's")
    assert run.write(EVENTS, rank_file("failure", 1), encode(forged))
    obs.scan()
    assert 1 in obs.peers and rank_file("failure", 1) not in obs.events and not obs.peer_failed()


# -- issue 25.2: the folder watch, stopped from another thread ----------------------------


def _stop_from_another_thread(obs: Observer) -> None:
    stopper = threading.Thread(target=obs.local.stop, name="test-stopper")
    stopper.start()
    stopper.join(DEADLINE_S)
    assert not stopper.is_alive()


def test_stop_then_a_folder_repair_leaves_no_watch_running(run, observers):
    """Watcher.stop() (the training thread) stops the folder watch while the watcher thread
    checks its descriptors: inotify's, closed by the stop, looked taken over, and the
    repair made a new watch that nothing would ever stop."""
    before = _inotify_fds()
    obs = observers()
    assert obs.local.start()
    _stop_from_another_thread(obs)
    obs.local.check_fds(every_pidfd=True)  # the watcher thread's next unasked look
    assert _new_watches(before) == [], "a folder watch outlived stop()"


def test_stop_before_the_watcher_started_its_folder_watch_leaves_none(run, observers):
    before = _inotify_fds()
    obs = observers()
    _stop_from_another_thread(obs)  # install() then an exit, before the watcher thread ran
    assert not obs.local.start()
    assert _new_watches(before) == [], "a folder watch started after stop()"


def _repair_thrice(obs: Observer, go: threading.Barrier) -> None:
    go.wait()
    for _ in range(3):
        obs.local._waker._repair_folders()  # what check_fds does once it found inotify's descriptors taken


def test_stop_racing_repairs_leaves_no_watch_running(run, observers):
    """The watcher thread repairs (its inotify descriptors taken over each time) while
    another thread stops: whichever comes first, nothing is left watching."""
    before = _inotify_fds()
    for _ in range(5):
        obs = observers()
        assert obs.local.start()
        go = threading.Barrier(2)
        repairer = threading.Thread(target=_repair_thrice, args=(obs, go), name="test-repairer")
        repairer.start()
        go.wait()
        obs.local.stop()
        repairer.join(DEADLINE_S)
    assert _new_watches(before) == [], "a folder watch outlived stop()"


# -- issue 25.2: the rank's own records, from many threads --------------------------------


def test_many_threads_record_while_the_watcher_scans(run, observers):
    """The training thread, excepthooks and the launcher watch record this rank's end at
    once, while the watcher thread scans: each record is on disk when its call returns,
    exactly one failure wins, and the observer reads it back like any other record."""
    own = OwnRecords(run, _reg(0, os.getpid()))
    obs = Observer(run, own.me, use_pidfd=True, remote=None, records=own)
    try:
        obs.local.start()
        n = 12
        go = threading.Barrier(n)
        won: List[int] = []

        def end(i: int) -> None:
            go.wait()
            failure = Failure(rank=0, pid=os.getpid(), time_ns=time.time_ns(), cause=EXCEPTION, message=f"thread {i}")
            if own.failure(failure):
                won.append(i)
            own.thread_exception(failure)
            assert run.read(EVENTS, rank_file("failure", 0), Failure) is not None  # on disk before it returns
            own.success(Success(rank=0, pid=os.getpid(), time_ns=time.time_ns()))

        threads = [threading.Thread(target=end, args=(i,), name=f"test-ender{i}") for i in range(n)]
        for t in threads:
            t.start()
        _until(obs, lambda: not any(t.is_alive() for t in threads) and rank_file("success", 0) in obs.events,
               "every thread recorded, and the observer read the records")
        assert len(won) == 1
        on_disk = run.read(EVENTS, rank_file("failure", 0), Failure)
        assert on_disk is not None and on_disk.message == f"thread {won[0]}"
        _until(obs, lambda: obs.events.get(rank_file("failure", 0)) == on_disk, "the failure read back")
        assert obs.finished() == {0} and not own.write_failed
    finally:
        obs.local.stop()


def test_records_that_cannot_be_written_are_said_loudly_once(run, caplog):
    own = OwnRecords(run, _reg(0, os.getpid()))
    shutil.rmtree(os.path.join(run.path, TMP))  # every write goes through tmp/: it now fails (ENOENT)
    go = threading.Barrier(8)
    results: List[bool] = []

    def record() -> None:
        go.wait()
        results.append(own.failure(Failure(rank=0, pid=os.getpid(), time_ns=time.time_ns(), cause=EXCEPTION)))

    threads = [threading.Thread(target=record, name=f"test-recorder{i}") for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    assert results == [False] * 8 and own.write_failed
    loud = [r for r in caplog.records if "protection degraded" in r.getMessage()]
    assert len(loud) == 1 and loud[0].levelno == logging.ERROR


def test_a_record_of_this_rank_left_by_another_process_does_not_block_ours(run):
    own = OwnRecords(run, _reg(0, os.getpid()))
    stale = Failure(rank=0, pid=os.getpid() + 100000, time_ns=1, cause=EXCEPTION, message="another job's")
    assert run.write(EVENTS, rank_file("failure", 0), encode(stale))
    mine = Failure(rank=0, pid=os.getpid(), time_ns=time.time_ns(), cause=EXCEPTION, message="mine")
    assert own.failure(mine)
    assert run.read(EVENTS, rank_file("failure", 0), Failure) == mine
    assert not own.failure(Failure(rank=0, pid=os.getpid(), time_ns=time.time_ns(), cause=EXCEPTION, message="2nd"))


# -- the Diagnoser on a real Observer -----------------------------------------------------


def _stalled(now_mono_ns: int, moved_mono_ns: int, activity: Optional[Activity] = None, state: str = "S") -> Observed:
    """Rank 1 never entered all_reduce #21, which ranks 0 and 2 wait in, for 10 s; its signs
    of work ``activity``, its process ``state``."""
    def progress(seq: int, **kw: object) -> RankState:
        entered = tuple(("0", q, "gloo:all_reduce", "[[4]] Float") for q in range(seq - 2, seq + 1))
        return RankState(collectives=(("0", seq, seq - 1),), entered=entered, moved_mono_ns=moved_mono_ns,
                         **{"state": "S", **kw})  # type: ignore[arg-type]

    regs = {r: _reg(r, os.getpid()) for r in range(3)}
    return Observed(self_rank=0, now_ns=time.time_ns(), registrations=regs, successes=set(), failures={},
                    exit_statuses={}, gone={},
                    progress={0: progress(21), 1: progress(20, activity=activity, state=state), 2: progress(21)},
                    now_mono_ns=now_mono_ns)


def test_two_judges_one_diagnosis_and_the_second_learns_the_first(observers, caplog):
    """The first judge's diagnosis is written (and logged) once; the second judge, whose
    write loses, knows the first one's through its own observer."""
    now = time.monotonic_ns()
    first, second = observers(0), observers(1)
    judge0 = Diagnoser(0, 5.0, first)
    judge1 = Diagnoser(1, 5.0, second)
    found = judge0.look(_stalled(now, now - 10 * S))
    assert isinstance(found, Diagnosis) and (found.finding, found.laggards, found.made_by) == (HANG, (1,), 0)
    assert first.diagnosis() == found
    again = judge1.look(_stalled(now, now - 10 * S))
    assert again == found and second.diagnosis() == found
    said = [r.getMessage() for r in caplog.records if "diagnosed by rank" in r.getMessage()]
    assert len(said) == 1 and "diagnosed by rank 0" in said[0]


def test_a_diagnosis_ends_the_job_at_a_time_only_under_hang_timeout_auto(observers, run):
    """``ends_at`` (the record's ``end_at_ns``) says when hang_timeout=auto ends the job:
    with auto off nothing will end it, and the diagnosis says no time."""
    now = time.monotonic_ns()
    off = Diagnoser(0, 5.0, observers(0)).look(_stalled(now, now - 10 * S))
    assert off is not None and off.end_at_ns is None, off
    assert report_build(run)["diagnosis"]["ends_at"] is None
    os.unlink(run.join(EVENTS, DIAGNOSIS_FILE))
    auto = Diagnoser(0, 5.0, observers(0), auto=True).look(_stalled(now, now - 10 * S))
    assert auto is not None and auto.end_at_ns == auto.time_ns, auto  # a hang: ended at once
    assert report_build(run)["diagnosis"]["ends_at"] is not None


def test_a_diagnosis_is_resolved_when_the_job_moves_again(observers, caplog, run):
    now = time.monotonic_ns()
    obs = observers()
    judge = Diagnoser(0, 5.0, obs)
    found = judge.look(_stalled(now, now - 10 * S))
    assert found is not None and found.resolved_ns is None
    assert judge.look(_stalled(now + S, now + S // 2)) is not None  # rank 1 entered: it moved
    resolved: Optional[Diagnosis] = obs.diagnosis()
    assert resolved is not None and resolved.resolved_ns is not None
    assert run.read(EVENTS, DIAGNOSIS_FILE, Diagnosis) == resolved
    assert any("the job moved again" in r.getMessage() and "slow, not stuck" in r.getMessage() for r in caplog.records)


WORKING = Activity(span_ms=7000, cpu_ms=7000, places=1, other_cpu_ms=0, io_bytes=0, children_cpu_ms=0, samples=7)
IDLE = Activity(span_ms=7000, cpu_ms=0, places=1, other_cpu_ms=0, io_bytes=0, children_cpu_ms=0, samples=7)


def _finding(judge: Diagnoser, now: int, activity: Activity, state: str = "S", moved: int = 0) -> str:
    found = judge.look(_stalled(now, moved, activity, state))
    assert found is not None
    return found.finding


def test_a_busy_laggard_turns_hang_only_after_a_whole_window_without_work(observers):
    """Rank 1 computed, then one window shows no work (a dip: a loaded host's samples late, a
    pause for data): before, that look made it a hang, and hang_timeout=auto ended a job that
    computed. It turns hang once it has shown none for a whole window (8 heartbeats) more."""
    judge = Diagnoser(0, 5.0, observers(), auto=True, interval_s=1.0)
    now = time.monotonic_ns()  # the job last moved at 0 (_finding)
    assert _finding(judge, now, WORKING) == BUSY
    assert _finding(judge, now + S, IDLE) == BUSY  # the dip: no work seen since now + 1 s
    assert _finding(judge, now + 8 * S, IDLE) == BUSY
    assert _finding(judge, now + 9 * S, WORKING) == BUSY  # working again: the count starts over
    assert _finding(judge, now + 10 * S, IDLE) == BUSY
    assert _finding(judge, now + 17 * S, IDLE) == BUSY
    assert _finding(judge, now + 18 * S, IDLE) == HANG  # nothing for 8 s more: stuck


def test_a_busy_laggard_stopped_is_a_hang_at_once(observers):
    judge = Diagnoser(0, 5.0, observers(), auto=True, interval_s=1.0)
    now = time.monotonic_ns()  # the job last moved at 0 (_finding)
    assert _finding(judge, now, WORKING) == BUSY
    assert _finding(judge, now + S, WORKING, state="T") == HANG
