"""Process identity: probe() and is_same_process() on real processes, each one reaped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Callable, Iterator

import psutil
import pytest

from peerwatch.proc import identity
from peerwatch.proc.identity import ProcessInfo, is_same_process, probe, self_info

POLL_S = 0.005
DEADLINE_S = 5.0


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(POLL_S)


@pytest.fixture
def cat() -> Iterator[subprocess.Popen]:
    """A live child that stays until its stdin is closed; always reaped."""
    proc = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        if proc.returncode is None:
            try:
                proc.kill()
            except ProcessLookupError:
                pass
            proc.wait(timeout=DEADLINE_S)
        if proc.stdin:
            proc.stdin.close()


def exit_without_reaping(proc: subprocess.Popen) -> None:
    """Close the child's stdin and block until it has exited, leaving it a zombie."""
    assert proc.stdin is not None
    proc.stdin.close()
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)


def test_probe_self():
    info = probe(os.getpid())
    assert info is not None
    assert (info.pid, info.ppid, info.uid) == (os.getpid(), os.getppid(), os.getuid())
    assert info.state == "R"  # reading its own /proc/self/stat, it is running
    assert not info.dead


def test_self_info_matches_probe():
    a, b = self_info(), probe(os.getpid())
    assert (a.pid, a.ppid, a.start_ticks, a.uid) == (b.pid, b.ppid, b.start_ticks, b.uid)


def test_start_ticks_are_clock_ticks_since_boot():
    # psutil derives create_time from the same field: boot time + starttime / CLK_TCK.
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    proc = psutil.Process()
    expected = proc.create_time()
    got = psutil.boot_time() + self_info().start_ticks / ticks_per_s
    assert abs(got - expected) < 2.0 / ticks_per_s


def test_probe_of_a_live_child(cat):
    info = probe(cat.pid)
    assert info is not None
    assert (info.pid, info.ppid, info.uid) == (cat.pid, os.getpid(), os.getuid())
    # Alive: running, sleeping, or (just forked, its exec still faulting pages in from disk
    # under load) in uninterruptible sleep: 'D' was seen in a fresh-clone run with burners.
    assert info.state in ("R", "S", "D")
    assert not info.dead
    assert info.start_ticks >= self_info().start_ticks
    assert is_same_process(cat.pid, info.start_ticks, info.uid)


def test_a_live_process_is_probed_alive_while_another_thread_takes_descriptors_away(cat):
    """An application thread closes a range of descriptors, or dup2s /dev/null over it,
    while the watcher probes a peer: the probe's own descriptor may go between its open and
    its read. The probe reads again; it never says a live peer is gone (that tore a healthy
    job down), and never raises. In a program of its own: the other thread takes numbers
    that the test process's other code would use."""
    program = os.path.join(os.path.dirname(__file__), "clobber_probe_program.py")
    done = subprocess.run([sys.executable, program, str(cat.pid), "3000"], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert done.returncode == 0 and done.stdout.strip() == "wrong=0", done.stdout + done.stderr


def test_probe_of_a_reaped_child_is_none(cat):
    info = probe(cat.pid)
    cat.stdin.close()
    assert cat.wait(timeout=DEADLINE_S) == 0
    assert probe(cat.pid) is None
    assert not is_same_process(cat.pid, info.start_ticks, info.uid)


def test_zombie_is_probed_but_is_not_the_same_process(cat):
    info = probe(cat.pid)
    exit_without_reaping(cat)
    zombie = probe(cat.pid)
    assert zombie is not None
    assert zombie.state == "Z"
    assert zombie.dead
    assert (zombie.start_ticks, zombie.uid) == (info.start_ticks, info.uid)
    assert not is_same_process(cat.pid, info.start_ticks, info.uid)
    assert cat.wait(timeout=DEADLINE_S) == 0  # reap it
    assert probe(cat.pid) is None


def test_a_process_in_exit_is_seen_exiting(cat):
    """PF_EXITING, from /proc's flags: set from the start of exit() (when its sockets close)
    and kept while it is a zombie; never on a live process."""
    info = probe(cat.pid)
    assert info is not None and not info.exiting
    assert not identity.exiting(cat.pid, info.start_ticks)
    exit_without_reaping(cat)
    assert probe(cat.pid).exiting  # type: ignore[union-attr]
    assert identity.exiting(cat.pid, info.start_ticks)
    assert not identity.exiting(cat.pid, info.start_ticks + 1)  # another process's
    assert cat.wait(timeout=DEADLINE_S) == 0


def test_stopped_process_is_still_the_same_process(cat):
    info = probe(cat.pid)
    os.kill(cat.pid, signal.SIGSTOP)
    wait_for(lambda: probe(cat.pid).state == "T", "the child to stop")
    assert not probe(cat.pid).dead
    assert is_same_process(cat.pid, info.start_ticks, info.uid)
    os.kill(cat.pid, signal.SIGCONT)


def test_start_time_mismatch_is_not_the_same_process(cat):
    info = probe(cat.pid)
    assert is_same_process(cat.pid, info.start_ticks, info.uid)
    assert not is_same_process(cat.pid, info.start_ticks + 1, info.uid)
    assert not is_same_process(cat.pid, info.start_ticks - 1, info.uid)
    assert not is_same_process(cat.pid, 0, info.uid)


def test_uid_mismatch_is_not_the_same_process():
    me = self_info()
    assert is_same_process(me.pid, me.start_ticks, me.uid)
    assert not is_same_process(me.pid, me.start_ticks, me.uid + 1)


def test_another_pid_is_not_the_same_process(cat):
    me = self_info()
    assert not is_same_process(cat.pid, me.start_ticks, me.uid)


@pytest.mark.parametrize("pid", [0, -1, -os.getpid(), 2**22 + 1, 2**31 - 1], ids=["0", "-1", "minus-own-pid", "2**22+1", "2**31-1"])
def test_probe_of_no_such_pid_is_none(pid):
    assert probe(pid) is None
    assert not is_same_process(pid, 0, os.getuid())


def test_command_name_with_spaces_and_parentheses(tmp_path):
    # /proc/PID/stat puts the command name in parentheses; a name that itself holds
    # ") Z 1 (" would fool a parser that splits at the first ')'.
    tricky = tmp_path / "x) Z 1 (y"
    tricky.symlink_to(_which("cat"))
    proc = subprocess.Popen([str(tricky)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    try:
        wait_for(lambda: psutil.Process(proc.pid).name() == "x) Z 1 (y", "the child to exec")
        info = probe(proc.pid)
        assert info is not None
        assert info.state in ("R", "S", "D")  # not the "Z" of the name: alive (see test_probe_of_a_live_child)
        assert info.ppid == os.getpid()
        assert is_same_process(proc.pid, info.start_ticks, os.getuid())
    finally:
        proc.stdin.close()
        proc.wait(timeout=DEADLINE_S)


def _which(name: str) -> str:
    for d in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep):
        candidate = os.path.join(d, name)
        if os.access(candidate, os.X_OK):
            return os.path.realpath(candidate)
    pytest.skip(f"no {name} on PATH")


@pytest.mark.parametrize(("state", "dead"), [("R", False), ("S", False), ("D", False), ("T", False),
                                             ("t", False), ("Z", True), ("X", True), ("x", True)])
def test_dead_states(state, dead):
    assert ProcessInfo(pid=1, ppid=0, state=state, start_ticks=1, uid=0).dead is dead


def test_boot_id_is_this_boot_and_cached():
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert identity.boot_id() == f.read().strip()
    assert identity.boot_id() is identity.boot_id()


def test_pid_namespace():
    assert identity.pid_namespace() == os.readlink("/proc/self/ns/pid")
    assert identity.pid_namespace().startswith("pid:[")


def test_psutil_fallback_agrees_on_who_the_process_is(cat):
    via_proc, via_psutil = probe(cat.pid), identity._probe_psutil(cat.pid)
    assert via_psutil is not None
    assert (via_psutil.pid, via_psutil.ppid, via_psutil.uid) == (via_proc.pid, via_proc.ppid, via_proc.uid)
    assert not via_psutil.dead


def test_psutil_fallback_start_ticks_match_proc(cat):
    assert identity._probe_psutil(cat.pid).start_ticks == probe(cat.pid).start_ticks


def test_psutil_fallback_sees_a_zombie(cat):
    exit_without_reaping(cat)
    info = identity._probe_psutil(cat.pid)
    assert info is not None and info.dead
    cat.wait(timeout=DEADLINE_S)
    assert identity._probe_psutil(cat.pid) is None


def test_this_hosts_ranks_are_told_from_the_registrations_in_one_place():
    """Issue 25.3: the watcher (ranks missing at startup) and the store bridge (three
    times) each split the registrations into this host's ranks their own way; one
    function now, by is_local: same boot id and PID namespace, whatever the host name."""
    from peerwatch.core.records import Registration

    me = self_info()

    def reg(rank: int, boot_id: str, pidns: str, host: str = "h") -> Registration:
        return Registration(rank=rank, pid=me.pid, ppid=me.ppid, start_ticks=me.start_ticks, uid=me.uid, host=host,
                            boot_id=boot_id, pidns=pidns, time_ns=1)

    here, ns = identity.boot_id(), identity.pid_namespace()
    regs = {3: reg(3, here, ns), 0: reg(0, here, ns, host="renamed"), 1: reg(1, "another-boot", ns),
            2: reg(2, here, "pid:[1]" if ns != "pid:[1]" else "pid:[2]")}
    assert identity.local_ranks(regs) == (0, 3)
    assert identity.local_ranks({}) == ()
