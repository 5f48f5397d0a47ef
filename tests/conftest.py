"""Isolation for every test under tests/: a fresh run directory, and nothing left behind.

``no_leaks`` (autouse) gives each test a unique ``PEERWATCH_TEST_ID`` and a fresh
``PEERWATCH_DIR`` in its environment, so every process the test starts inherits both.
After the test it finds every process that still carries the id (orphans included),
SIGKILLs it and fails the test naming it; it also fails a test that left a non-daemon
thread running in the test process.
"""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, List

import psutil
import pytest
from harness import Job, free_port, set_child_subreaper
from hypothesis import settings

# Property tests run with hypothesis's budget (100 examples) by default. benchmarks/mutation.py
# selects "mutation" (HYPOTHESIS_PROFILE=mutation): it runs the tests once per mutant, hundreds
# of times, so few examples, always the same ones (a mutant survives or not on every run), and
# no example database shared between the copies it runs in.
settings.register_profile("mutation", max_examples=10, derandomize=True, database=None, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

TEST_ID_VAR = "PEERWATCH_TEST_ID"
KILL_WAIT_S = 5.0  # how long killed leaks get to disappear before we give up reaping them


def _reap_own_zombies() -> None:
    """Collect our children that have ended: a zombie's environment cannot be read,
    and an ended child of ours is not a leak."""
    try:
        children = psutil.Process().children()
    except psutil.Error:
        return
    for child in children:
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(child.pid, os.WNOHANG)
        except (psutil.Error, OSError):
            pass


def _carrying(test_id: str) -> List[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if proc.environ().get(TEST_ID_VAR) == test_id:
                found.append(proc)
        except (psutil.Error, OSError):
            continue  # gone, a zombie, or not ours to read
    return found


def _describe(proc: psutil.Process) -> str:
    try:
        with proc.oneshot():
            ppid = proc.ppid()
            parent = {1: "orphan of init", os.getpid(): "child of the test"}.get(ppid, f"ppid {ppid}")
            cmd = " ".join(proc.cmdline())[:200]
            return f"pid {proc.pid} ({parent}, {proc.status()}): {cmd}"
    except psutil.Error:
        return f"pid {proc.pid} (gone while being described)"


def kill_leaks(test_id: str) -> List[str]:
    """SIGKILL every process carrying test_id; returns their descriptions."""
    _reap_own_zombies()
    leaks = _carrying(test_id)
    described = [_describe(p) for p in leaks]
    for proc in leaks:
        try:
            proc.send_signal(signal.SIGKILL)  # psutil checks the pid still is that process
        except psutil.Error:
            pass
    # Wait until each is gone or a zombie (an orphan of init may stay one for a while).
    deadline = time.monotonic() + KILL_WAIT_S
    while leaks and time.monotonic() < deadline:
        _reap_own_zombies()
        leaks = [p for p in leaks if _running(p)]
        if leaks:
            psutil.wait_procs(leaks, timeout=0.02)
    return described


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Fail the test if it leaves a process or a non-daemon thread behind. Yields the test id.

    A module marked ``pure`` (``pytestmark = pytest.mark.pure``: pure functions, no process,
    no thread, no file) skips the scan of every process on the machine after each test: it
    was most of those modules' run time, which benchmarks/mutation.py repeats per mutant."""
    if request.node.get_closest_marker("pure") is not None:
        yield "pure"
        return
    test_id = uuid.uuid4().hex
    monkeypatch.setenv(TEST_ID_VAR, test_id)
    monkeypatch.setenv("PEERWATCH_DIR", str(tmp_path / "run"))
    threads_before = set(threading.enumerate())
    # Orphans of the test's processes (Lightning-style ranks whose rank 0 died) become our
    # children: we can read how they ended, and reap them.
    subreaper = set_child_subreaper(True)
    try:
        yield test_id
    finally:
        leaks = kill_leaks(test_id)
        if subreaper:
            set_child_subreaper(False)
    threads = [t for t in threading.enumerate() if t not in threads_before and not t.daemon and t.is_alive()]
    problems = []
    if leaks:
        problems.append("processes left running (now SIGKILLed):\n  " + "\n  ".join(leaks))
    if threads:
        problems.append("non-daemon threads left running: " + ", ".join(t.name for t in threads))
    if problems:
        pytest.fail("the test leaked " + "\n".join(problems), pytrace=False)


@pytest.fixture
def make_job(tmp_path: Path, no_leaks: str) -> Iterator[Callable[..., Job]]:
    """``make_job(world=4, style="lightning", behave=[...])`` -> a :class:`harness.Job`
    (not started) in its own folder under tmp_path; closed (never killed) after the test."""
    jobs: List[Job] = []

    def make(**kwargs: object) -> Job:
        job = Job(tmp_path, name=f"job{len(jobs)}", **kwargs)  # type: ignore[arg-type]
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.close()


@pytest.fixture
def store() -> Iterator[Callable[[], Any]]:
    """A TCPStore server on a free port; yields a function that makes a client of it
    (torch.distributed imported by the test that asks). Modules with a store of another
    shape define their own fixture of this name."""
    import torch.distributed as dist

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)

    def client() -> Any:
        return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=10))

    yield client
    del server


def pytest_configure(config: pytest.Config) -> None:
    """SIGINT as at a terminal. A non-interactive shell starts a background job (``./dev test &``,
    a CI script's ``cmd &``) with SIGINT ignored, every process it starts inherits that across
    exec, and Python then installs no KeyboardInterrupt handler: the ranks of the interrupt
    tests ignored the SIGINT sent to them. The ranks start with its default (handlers are
    reset by exec; an ignored signal is not)."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
