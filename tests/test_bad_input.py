"""Bad input, end to end: a live job whose run directory receives garbage.

The parser and the reader are unit-tested in test_records.py and test_rundir.py; here the
garbage lands in the run directory of a running 3-rank job, where every watcher reads it
(inotify wakes them, the rescan reads every new entry), and then a rank is killed:

- the job keeps running: no teardown, no rank crashes, every watcher keeps looping (a
  heartbeat newer than the last garbage), no traceback and no "NOT protected" in any log;
- every bad record is logged once per file and process, never more (an unknown file: not
  at all; an empty one: at most once);
- then a rank is SIGKILLed and the job is torn down exactly as without the garbage.

Also: the run directory deleted while the job runs (docs/security.md: rescans and
heartbeats fail with one warning each; the pidfds keep watching), and a full disk (a small
tmpfs) when a rank writes its success marker (it is taken for failed by its peers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import random
import re
import select
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import pytest
from harness import Job, by_rank

from peerwatch.core import records
from peerwatch.core.records import MAX_RECORD_BYTES, ExitStatus, Failure, Registration, Success, Verdict, encode

pytestmark = pytest.mark.timeout(120)

WORLD = 3
VICTIM = 1
GRACE_S = 1.0
ACK_S = 1.5  # PEERWATCH_ACK_WINDOW: three times the default, for a loaded machine (see test_fault_matrix)
BOUND_S = ACK_S + 1.0  # kill -> every process gone, every survivor leaving by itself
ENV = {"PEERWATCH_ACK_WINDOW": str(ACK_S)}
CHURN_S = 1.5  # how long files are created and deleted at a high rate
DEADLINE_S = 15.0  # for the watchers to have read (and warned about) what was planted

NOT_PROTECTED = "NOT protected"


def _record(record: object, **over: object) -> bytes:
    """``encode(record)`` with some JSON fields replaced (wrong version, wrong types...)."""
    body = json.loads(encode(record))
    body.update(over)
    return json.dumps(body).encode()


def _failure(rank: int, pid: int) -> Failure:
    return Failure(rank=rank, pid=pid, time_ns=time.time_ns(), cause="exception", exit_code=7,
                   exception="RuntimeError", message="planted", traceback="planted")


def _wait_until(what: str, done, timeout: float, job: Job) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {timeout}s\n{job.logs()}")
        time.sleep(0.02)


def _log(job: Job, rank: int) -> str:
    return job.log_path(rank).read_text(errors="replace")


def _warnings_about(log: str, path: Path) -> List[str]:
    """peerwatch's warn-once lines about ``path`` ("peerwatch: <path> <reason>")."""
    return [line for line in log.splitlines() if line.startswith(f"peerwatch: {path} ")]


def _heartbeat_ns(job: Job, rank: int) -> int:
    try:
        return (job.run_dir / "heartbeats" / f"rank-{rank:05d}.json").stat().st_mtime_ns
    except FileNotFoundError:
        return 0


def _heartbeat(job: Job, rank: int) -> Optional[dict]:
    try:
        return json.loads((job.run_dir / "heartbeats" / f"rank-{rank:05d}.json").read_bytes())
    except (OSError, ValueError):
        return None


def _wait_watchers_know_everyone(job: Job) -> None:
    """Wait until every watcher has rescanned ranks/ since every rank registered: a
    heartbeat written after that (the loop began after the registrations were there),
    then the next one (that loop's rescan is done)."""
    registered_ns = time.time_ns()  # every rank is READY: each registered before
    first: Dict[int, int] = {}

    def done() -> bool:
        for rank in range(WORLD):
            beat = _heartbeat(job, rank)
            if beat is None:
                return False
            if rank not in first:
                if beat["time_ns"] <= registered_ns:
                    return False
                first[rank] = beat["seq"]
            if beat["seq"] <= first[rank]:
                return False
        return True

    _wait_until("every watcher rescanned since every rank registered", done, DEADLINE_S, job)


def _assert_alive_and_calm(job: Job, since_ns: int) -> None:
    """No teardown: every rank alive, no verdict; every watcher wrote a heartbeat after
    ``since_ns`` (it still loops); no traceback and no lost watcher in any log."""
    _wait_until("every watcher beat after the garbage",
                lambda: all(_heartbeat_ns(job, r) > since_ns for r in range(WORLD)), DEADLINE_S, job)
    gone = [p.label for p in job.ranks.values() if p.gone()]
    assert not gone, f"ended while the garbage was read: {gone}\n{job.logs()}"
    assert not (job.run_dir / "events" / "verdict.json").exists(), job.logs()
    for rank in range(WORLD):
        log = _log(job, rank)
        assert "Traceback" not in log and NOT_PROTECTED not in log, f"rank {rank}:\n{log}"


def _kill_and_check_teardown(job: Job, pids: Dict[int, int]) -> dict:
    killed_ns = time.time_ns()
    job.kill(VICTIM)
    job.wait_gone(within=BOUND_S + ACK_S + 3 * GRACE_S + 5.0)
    codes = job.all_returncodes()
    want = {r: (-signal.SIGKILL if r == VICTIM else 1) for r in range(WORLD)}
    assert codes == want, f"returncodes {codes}, expected {want}\n{job.logs()}"
    report = job.report()
    v = report["verdict"]
    assert v is not None, f"report without a verdict: {report}\n{job.logs()}"
    assert (v["rank"], v["cause"], v["exit_code"], v["pid"]) == (VICTIM, "vanished", 1, pids[VICTIM]), v
    ranks = by_rank(report)
    assert ranks[VICTIM]["state"] == "failed"
    for r in range(WORLD):
        if r != VICTIM:
            assert (ranks[r]["state"], ranks[r]["exit_code"], ranks[r]["acked_verdict"]) == ("torn_down", 1, True), ranks[r]
    took = (job.gone_at_ns - killed_ns) / 1e9  # type: ignore[operator]
    assert took < BOUND_S, f"the job took {took:.2f}s to go after the kill\n{job.logs()}"
    return report


# -- garbage ------------------------------------------------------------------------------


@dataclasses.dataclass
class Planted:
    path: Path
    what: str
    # True: logged once per process; False: silently ignored; None: at most once (an empty
    # record: docs/security.md says "one warning", the reader treats it as "not written yet"
    # without one, and test_rundir.py asserts that)
    warned: Optional[bool]


def _plant(job: Job, pids: Dict[int, int], outside: Path) -> List[Planted]:
    """Garbage where the records of a live job are read. Every slot is one that would
    change the outcome if it were taken for a record: a failure or exit status of a live
    rank (teardown), a success marker of the rank about to be killed (no teardown)."""
    run, ev, rk = job.run_dir, job.run_dir / "events", job.run_dir / "ranks"
    rng = random.Random(8)
    reg0 = Registration(rank=0, pid=pids[0], ppid=os.getpid(), start_ticks=1, uid=os.geteuid(), host="h",
                        boot_id="b", pidns="p", time_ns=time.time_ns())
    valid_exit = outside / "exit-00002.json"
    valid_exit.write_bytes(encode(ExitStatus(rank=2, pid=pids[2], time_ns=time.time_ns(), returncode=9, observed_by=0)))
    planted: List[Planted] = []

    def put(path: Path, what: str, warned: bool, data: Optional[bytes] = None) -> None:
        if data is not None:
            tmp = run / "tmp" / f"planted-{path.name}"
            tmp.write_bytes(data)
            os.replace(tmp, path)  # appears complete, like a record
        planted.append(Planted(path, what, warned))

    failure0 = encode(_failure(0, pids[0]))
    put(ev / "failure-00000.json", "huge: a valid failure record padded with spaces to 1.5 MiB", True,
        failure0 + b" " * (MAX_RECORD_BYTES + MAX_RECORD_BYTES // 2))
    put(ev / "failure-00001.json", "empty", None, b"")
    put(ev / "failure-00002.json", "truncated: the first half of a valid failure record", True,
        encode(_failure(2, pids[2]))[: len(failure0) // 2])
    put(ev / "exit-00000.json", "wrong types: an exit status whose returncode is a string", True,
        _record(ExitStatus(rank=0, pid=pids[0], time_ns=1, returncode=9, observed_by=1), returncode="9"))
    put(ev / "exit-00001.json", "binary: 4 KiB of random bytes", True, bytes(rng.randrange(256) for _ in range(4096)))
    os.symlink(valid_exit, ev / "exit-00002.json")
    put(ev / "exit-00002.json", "a symlink to a valid exit status of rank 2 (returncode 9)", True)
    (ev / "success-00000.json").mkdir()
    put(ev / "success-00000.json", "a directory", True)
    put(ev / "success-00001.json", "wrong version: rank 1's success marker with version 2", True,
        _record(Success(rank=1, pid=pids[1], time_ns=time.time_ns()), version=2))
    os.mkfifo(ev / "success-00002.json")
    put(ev / "success-00002.json", "a FIFO (a blocking open would hang the watcher)", True)
    os.symlink("/dev/zero", ev / "ack-00001.json")
    put(ev / "ack-00001.json", "a symlink to /dev/zero", True)
    put(ev / "failure-1.json", "another name for rank 1's failure slot, JSON but not an object", True, b"[1, 2, 3]")
    put(rk / "rank-00003.json", "binary registration", True, bytes(rng.randrange(256) for _ in range(300)))
    put(rk / "rank-00004.json", "truncated registration", True, encode(reg0)[:40])
    os.symlink(rk / "rank-00000.json", rk / "rank-00005.json")
    put(rk / "rank-00005.json", "a symlink to rank 0's registration", True)
    (rk / "rank-00006.json").mkdir()
    put(rk / "rank-00006.json", "a directory", True)
    put(rk / "rank-00007.json", "wrong version registration", True,
        _record(dataclasses.replace(reg0, rank=7), version=0))
    put(rk / "rank-00008.json", "wrong kind: a success marker in place of a registration", True,
        encode(Success(rank=8, pid=pids[0], time_ns=1)))
    for where, name in [(ev, "README.txt"), (ev, "failure-00001.json.bak"), (ev, ".hidden"), (ev, "verdict.json~"),
                        (ev, "failure-abc.json"), (rk, "notes"), (rk, "rank-1234567890.json"), (run, "junk.bin"),
                        (run / "heartbeats", "rank-00009.json"), (run / "stacks", "rank-00009.txt"),
                        (run / "tmp", "junk")]:
        put(where / name, "an unknown file", False, b"\x00garbage\xff" * 10)
    return planted


def _churn(job: Job, until: float, counts: Dict[str, int]) -> None:
    """Files created and deleted at once, for CHURN_S: garbage under record names (of
    ranks that are not in the job), via rename and via plain create, huge ones, symlinks,
    directories. Readers find them gone between listing and reading."""
    rng = random.Random(9)
    ev, rk, tmp = job.run_dir / "events", job.run_dir / "ranks", job.run_dir / "tmp"
    names = [ev / f"{p}-{r:05d}.json" for p in ("failure", "exit", "success", "ack") for r in range(3, 9)]
    names += [rk / f"rank-{r:05d}.json" for r in range(9, 15)] + [ev / "unknown.json", rk / "unknown"]
    while time.monotonic() < until:
        path = rng.choice(names)
        kind = rng.choice(["rename", "create", "huge", "symlink", "dir"])
        try:
            if kind == "rename":
                staged = tmp / f"churn-{counts['n']}"
                staged.write_bytes(bytes(rng.randrange(256) for _ in range(rng.randrange(0, 200))))
                os.replace(staged, path)
            elif kind == "create":
                path.write_bytes(b'{"version": 1, "kind": "failure", "rank": ')  # written in two steps
                path.write_bytes(b'{"version": 1, "kind": "failure", "rank": "x"}')
            elif kind == "huge":
                path.write_bytes(b" " * (MAX_RECORD_BYTES + 1))
            elif kind == "symlink":
                os.symlink("/etc/passwd", path)
            else:
                path.mkdir()
        except FileExistsError:
            pass
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        counts["n"] += 1


def test_garbage_in_a_live_run_directory(make_job, tmp_path: Path) -> None:
    job = make_job(world=WORLD, grace=GRACE_S, env=ENV).start()
    pids = job.wait_ready()
    outside = tmp_path / "outside"
    outside.mkdir()
    planted = _plant(job, pids, outside)
    counts = {"n": 0}
    churner = threading.Thread(target=_churn, args=(job, time.monotonic() + CHURN_S, counts), name="churn")
    churner.start()
    churner.join()
    churned_ns = time.time_ns()
    assert counts["n"] > 100, counts

    # Every watcher read every bad record (and said so) ...
    expected = [p for p in planted if p.warned]
    _wait_until("warned about every bad record in every rank",
                lambda: all(_warnings_about(_log(job, r), p.path) for r in range(WORLD) for p in expected),
                DEADLINE_S, job)
    # ... and the job goes on, its watchers alive.
    _assert_alive_and_calm(job, churned_ns)

    _kill_and_check_teardown(job, pids)
    for rank in range(WORLD):
        log = _log(job, rank)
        for p in planted:
            lines = _warnings_about(log, p.path)
            if p.warned:
                assert len(lines) == 1, f"rank {rank} warned {len(lines)} times about {p.what}: {lines}"
            elif p.warned is None:
                assert len(lines) <= 1, f"rank {rank} warned {len(lines)} times about {p.what}: {lines}"
            else:
                assert not lines, f"rank {rank} warned about {p.what}: {lines}"
        if rank != VICTIM:
            assert "Traceback" not in log and NOT_PROTECTED not in log, f"rank {rank}:\n{log}"


def test_garbage_in_place_of_the_verdict(make_job) -> None:
    """A bad events/verdict.json (truncated) before anything failed: no teardown; when a
    rank is then killed the job is torn down, and the report names the real failure.

    (Regression: the garbage used to block the real verdict, link(2) failing with EEXIST;
    every watcher then acted on a verdict of its own, nobody logged the summary, and
    report.json said outcome "running", verdict null.)"""
    job = make_job(world=WORLD, grace=GRACE_S, env=ENV).start()
    pids = job.wait_ready()
    verdict = Verdict(rank=0, cause="exception", exit_code=7, failed_at_ns=time.time_ns(), detected_by=2,
                      detected_at_ns=time.time_ns())
    path = job.run_dir / "events" / "verdict.json"
    staged = job.run_dir / "tmp" / "planted-verdict"
    staged.write_bytes(encode(verdict)[:50])
    os.replace(staged, path)
    planted_ns = time.time_ns()
    _wait_until("warned about the bad verdict in every rank",
                lambda: all(_warnings_about(_log(job, r), path) for r in range(WORLD)), DEADLINE_S, job)
    gone = [p.label for p in job.ranks.values() if p.gone()]
    assert not gone, f"ended after a bad verdict: {gone}\n{job.logs()}"
    _wait_until("every watcher beat after the garbage",
                lambda: all(_heartbeat_ns(job, r) > planted_ns for r in range(WORLD)), DEADLINE_S, job)
    _kill_and_check_teardown(job, pids)


def test_a_diagnosis_naming_a_rank_outside_the_world_is_not_obeyed(make_job) -> None:
    """A diagnosis of a hang whose laggard is rank 99 in a 3-rank job, under
    hang_timeout=auto: ignored with one warning in every rank, no teardown; a real failure
    then ends the job as usual. (Before: obeyed, every rank exited 124.)"""
    job = make_job(world=WORLD, grace=GRACE_S, env=dict(ENV, PEERWATCH_HANG_TIMEOUT="auto")).start()
    pids = job.wait_ready()
    now = time.time_ns()
    diagnosis = records.Diagnosis(finding=records.HANG, laggards=(99,), entered=(0, 1, 2), since_ns=10**9, stalled_at_ns=now - 10**9,
                          time_ns=now, made_by=0, detail="planted: rank 99 never entered gloo:all_reduce")
    path = job.run_dir / "events" / "diagnosis.json"
    staged = job.run_dir / "tmp" / "planted-diagnosis"
    staged.write_bytes(encode(diagnosis))
    os.replace(staged, path)
    planted_ns = time.time_ns()

    def warned_or_gone() -> bool:
        return any(p.gone() for p in job.ranks.values()) or all(_warnings_about(_log(job, r), path) for r in range(WORLD))

    _wait_until("warned about the diagnosis in every rank (or a rank gone)", warned_or_gone, DEADLINE_S, job)
    _assert_alive_and_calm(job, planted_ns)
    for rank in range(WORLD):
        lines = _warnings_about(_log(job, rank), path)
        assert len(lines) == 1 and "rank 99" in lines[0] and "world size 3" in lines[0], f"rank {rank}: {lines}"
    _kill_and_check_teardown(job, pids)


def test_garbage_in_place_of_a_success_marker(make_job) -> None:
    """A bad events/success-00001.json (binary) before rank 1 finishes: every rank still
    finishes cleanly, and nobody is torn down (the garbage is "ignored", docs/security.md).

    (Regression: the garbage used to block rank 1's real marker, silently; its peers then
    tore the clean job down.)"""
    job = make_job(world=WORLD, behave=["0=succeed@1.5", "1=succeed@0.5", "2=succeed@2.0"], grace=GRACE_S, env=ENV).start()
    job.wait_ready()
    path = job.run_dir / "events" / "success-00001.json"
    staged = job.run_dir / "tmp" / "planted-success"
    staged.write_bytes(b"\x00\x01garbage\xfe")
    os.replace(staged, path)
    job.wait_gone(within=10.0)
    codes = job.all_returncodes()
    assert codes == {r: 0 for r in range(WORLD)}, f"returncodes {codes}\n{job.logs()}"
    assert not (job.run_dir / "events" / "verdict.json").exists(), job.logs()


# -- the run directory deleted ---------------------------------------------------------------


LOST_DIR = "is NOT protected any more: its run directory"


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_run_directory_deleted_mid_run(make_job, how: str) -> None:
    """rm -rf of the run directory while the job runs (or a move aside and a new, empty
    directory in its place): no crash, no teardown; every rank says once, at ERROR, that
    it is not protected any more, and how (removed, or replaced), and stops judging
    (nothing can be written or read there: a peer's end proves nothing). A rank killed
    afterwards is therefore not acted on (protection lost, said loudly): its peers keep
    running."""
    job = make_job(world=WORLD, grace=GRACE_S, env={**ENV, "PEERWATCH_HEARTBEAT": "0.2"}).start()
    job.wait_ready()
    _wait_watchers_know_everyone(job)
    if how == "removed":
        shutil.rmtree(job.run_dir)
    else:
        os.rename(job.run_dir, job.run_dir.with_name("run.moved"))
        os.mkdir(job.run_dir, 0o700)
    _wait_until("every rank said it is not protected any more",
                lambda: all(LOST_DIR in _log(job, r) for r in range(WORLD)), DEADLINE_S, job)
    # Ten more heartbeat periods: no rank ends, still one error each.
    ended, _, _ = select.select([p.pidfd for p in job.ranks.values()], [], [], 10 * 0.2)
    assert not ended, f"a rank ended after its run directory was deleted\n{job.logs()}"
    for rank in range(WORLD):
        log = _log(job, rank)
        assert log.count(LOST_DIR) == 1, f"rank {rank}:\n{log}"
        said = "was removed" if how == "removed" else "was replaced by another directory"
        assert f"{job.run_dir} {said}" in log, f"rank {rank}:\n{log}"
        assert "Traceback" not in log, f"rank {rank}:\n{log}"

    job.kill(VICTIM)
    survivors = [p.pidfd for r, p in job.ranks.items() if r != VICTIM]
    ended, _, _ = select.select(survivors, [], [], BOUND_S + 1.0)
    assert not ended, f"a survivor was torn down though nobody judges any more\n{job.logs()}"
    job.kill_all()  # the survivors, named above: nothing ends them now
    for rank in range(WORLD):
        assert "vanished" not in _log(job, rank), f"rank {rank}:\n{_log(job, rank)}"


def test_run_directory_deleted_then_ranks_finish_apart(make_job) -> None:
    """Issue 14: a /tmp cleaner removes the run directory; then the ranks finish cleanly 2 s
    apart. No success marker can be written, and none is needed: every watcher stopped
    judging when the directory went, so the first rank to finish is not taken for a
    vanished one and nobody is torn down. Every rank exits 0."""
    job = make_job(world=WORLD, grace=GRACE_S, behave=["0=succeed@2.0", "1=succeed@4.0", "2=succeed@4.0"],
                   env={**ENV, "PEERWATCH_HEARTBEAT": "0.2"}).start()
    job.wait_ready()
    _wait_watchers_know_everyone(job)
    shutil.rmtree(job.run_dir)
    job.wait_gone(within=4.0 + BOUND_S + 10.0)
    codes = job.all_returncodes()
    assert codes == {r: 0 for r in range(WORLD)}, f"returncodes {codes}\n{job.logs()}"
    for rank in range(WORLD):
        log = _log(job, rank)
        assert log.count(LOST_DIR) == 1, f"rank {rank}:\n{log}"
        assert "vanished" not in log and "Traceback" not in log, f"rank {rank}:\n{log}"


# -- a full disk ------------------------------------------------------------------------------


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs (root only); unmounted after the test."""
    where = tmp_path / "tiny"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(where)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(folder: Path) -> int:
    """Fill the file system of ``folder`` until ENOSPC: returns the bytes written."""
    written = 0
    try:
        fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
        return 0
    try:
        while True:
            written += os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)
    return written


def test_disk_full_when_a_rank_writes_its_success_marker(make_job, tiny_tmpfs: Path) -> None:
    """The run directory's file system is full when rank 1 finishes cleanly: its success
    marker cannot be written (an error in its log, no crash); its peers take it for failed
    (exited is not succeeded) and the job is torn down, with exit code 1, within the bound."""
    world = 2
    run_dir = tiny_tmpfs / "run"
    job = make_job(world=world, behave=["0=sleep", "1=succeed@1.0"], grace=GRACE_S,
                   env={**ENV, "PEERWATCH_DIR": str(run_dir)})
    job.run_dir = run_dir
    job.start()
    job.wait_ready()
    _fill(tiny_tmpfs)
    job.wait_gone(within=1.0 + ACK_S + 3 * GRACE_S + 5.0)
    codes = job.all_returncodes()
    assert codes == {0: 1, 1: 0}, f"returncodes {codes}\n{job.logs()}"
    log1 = _log(job, 1)
    assert re.search(r"rank 1 could not write success-00001\.json: .*No space left on device", log1), log1
    for rank in range(world):
        assert "Traceback" not in _log(job, rank), _log(job, rank)
    assert re.search(r"rank 1 .*ended without a success marker", _log(job, 0)), _log(job, 0)
    assert not (run_dir / "events" / "success-00001.json").exists()


def test_disk_full_teardown_signals_no_rank_that_acted_on_the_verdict(make_job, tiny_tmpfs: Path) -> None:
    """Issue 14: the disk is full when rank 2 fails. Neither its failure record nor the
    verdict nor any acknowledgement can be written. Before, the enforcers (ranks 0 and 1)
    saw no ack file from each other and SIGTERMed each other (exit 143). Now an enforcer
    that could not write its own ack does not take a missing one for "not leaving"
    (rule: the blind enforcer): ranks 0 and 1 both leave by themselves with the verdict's exit code, and
    each says once that protection is degraded."""
    run_dir = tiny_tmpfs / "run"
    job = make_job(world=WORLD, behave=["0=sleep", "1=sleep", "2=raise@1.0"], grace=GRACE_S,
                   env={**ENV, "PEERWATCH_DIR": str(run_dir)})
    job.run_dir = run_dir
    job.start()
    job.wait_ready()
    _fill(tiny_tmpfs)
    job.wait_gone(within=1.0 + ACK_S + 6 * GRACE_S + 10.0)
    codes = job.all_returncodes()
    assert codes[2] == 1, f"returncodes {codes}\n{job.logs()}"
    assert codes[0] == codes[1] and codes[0] not in (None, 0, -signal.SIGTERM, -signal.SIGKILL), \
        f"returncodes {codes}: a rank that acted on the verdict was signalled\n{job.logs()}"
    for rank in range(WORLD):
        log = _log(job, rank)
        assert "Traceback" not in log or rank == 2, f"rank {rank}:\n{log}"
        assert log.count("protection degraded: cannot write to") == 1, f"rank {rank}:\n{log}"
        assert re.search(r"protection degraded: cannot write to \S+: No space left on device", log), log
    for rank in (0, 1):
        assert "could not write its acknowledgement" in _log(job, rank), _log(job, rank)
        assert "did not leave by itself" not in _log(job, rank), _log(job, rank)
