"""Shared-filesystem mode (docs/shared-filesystem.md): several hosts, one run directory.

Unit tests: the mount-table parser and detection, the remote heartbeats as news for the
liveness rule (the rule and its records: tests/test_hosts.py), the run directory's rules
when another host holds a slot.

End to end: two simulated hosts on this machine, each a real separate PID namespace
(``unshare --pid --fork --mount-proc``) with its own hostname (``--uts``), sharing one
run directory. No NFS server is available here, so the directory is a local one with
``shared_fs=on`` forced; and since one kernel's inotify does see both "hosts'" writes,
host A runs with inotify off (``PEERWATCH_TEST_NO_INOTIFY=1``): it learns of host B's
records only by polling, as it would on NFS. Pids collide across the two namespaces
(both hosts have a pid 2, 3, ...), so a host signalling by the other host's pids would
hit its own ranks: the tests check that nobody does.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import psutil
import pytest

from peerwatch.core.awake import AwakeClock
from peerwatch.core.errors import RunDirError
from peerwatch.core.records import LOST, Registration, encode
from peerwatch.hosts import sharedfs
from peerwatch.proc.identity import Started
from peerwatch.rundir.prepare import prepare
from peerwatch.rundir.rundir import RANKS, RunDir, rank_file

pytestmark = pytest.mark.timeout(60)

HOST_PROGRAM = Path(__file__).with_name("sharedfs_host.py")
HEARTBEAT_S = 0.5
PEER_TIMEOUT_S = 2.5
EXIT_CODE = 42  # PEERWATCH_EXIT_CODE of every rank: tells a verdict's code from a default 1
READY_TIMEOUT_S = 20.0
POLL_S = 0.02  # how often the test looks at the READY folder (it has no event source)
S = 1_000_000_000

# -- the mount table -------------------------------------------------------------------

MOUNTINFO = r"""22 27 0:21 / /proc rw,relatime shared:12 - proc proc rw
27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
40 27 0:45 / /mnt/nfs rw,relatime shared:30 - nfs4 filer:/export rw,vers=4.2
41 40 0:46 / /mnt/nfs/local rw,relatime - ext4 /dev/vdb rw
42 27 0:47 / /scratch rw - lustre 10.0.0.1@o2ib:/scratch rw
43 27 0:48 / /gpfs/fs1 rw - gpfs fs1 rw
44 27 0:49 / /mnt/my\040share rw - cifs //srv/my\040share rw
45 27 0:50 / /cephfs rw - ceph 10.0.0.2:/ rw
46 27 0:51 / /nfsx rw - tmpfs tmpfs rw
47 27 0:52 / /mnt/nfs rw - tmpfs tmpfs rw
not a mountinfo line
"""


def test_parse_mountinfo_fields_and_escapes() -> None:
    mounts = sharedfs.parse_mountinfo(MOUNTINFO)
    assert len(mounts) == 10  # the malformed line is skipped
    assert mounts[2] == sharedfs.Mount("/mnt/nfs", "nfs4", "filer:/export")
    assert mounts[6] == sharedfs.Mount("/mnt/my share", "cifs", "//srv/my share")
    # No optional fields (no "shared:N") between the options and the dash.
    assert mounts[4] == sharedfs.Mount("/scratch", "lustre", "10.0.0.1@o2ib:/scratch")


@pytest.mark.parametrize(
    "path, fstype",
    [
        ("/scratch/u/run", "lustre"),
        ("/scratch", "lustre"),
        ("/gpfs/fs1/job/7", "gpfs"),
        ("/mnt/my share/run", "cifs"),
        ("/cephfs/a", "ceph"),
        ("/nfsx/run", "tmpfs"),  # a prefix of the name, not of the path: not /mnt/nfs
        ("/mnt/nfs/local/run", "ext4"),  # a local mount inside the NFS one
        ("/home/u/run", "ext4"),
    ],
)
def test_mount_of_longest_prefix(path: str, fstype: str) -> None:
    mount = sharedfs.mount_of(path, sharedfs.parse_mountinfo(MOUNTINFO))
    assert mount is not None and mount.fstype == fstype


def test_mount_of_last_mount_on_a_point_wins() -> None:
    # /mnt/nfs is mounted twice (NFS, then tmpfs over it): the later one hides the first.
    assert sharedfs.mount_of("/mnt/nfs/run", sharedfs.parse_mountinfo(MOUNTINFO)) == sharedfs.Mount(
        "/mnt/nfs", "tmpfs", "tmpfs"
    )
    text = "\n".join(ln for ln in MOUNTINFO.splitlines() if not ln.startswith("47 "))
    assert sharedfs.mount_of("/mnt/nfs/run", sharedfs.parse_mountinfo(text)) == sharedfs.Mount(
        "/mnt/nfs", "nfs4", "filer:/export"
    )


def test_detect() -> None:
    text = "\n".join(ln for ln in MOUNTINFO.splitlines() if not ln.startswith("47 "))
    why = sharedfs.detect("auto", "default", "/mnt/nfs/jobs/7/run", mountinfo=text)
    assert why == "the run directory is on nfs4 (filer:/export mounted at /mnt/nfs)"
    assert sharedfs.detect("auto", "default", "/scratch/x", mountinfo=text) == (
        "the run directory is on lustre (10.0.0.1@o2ib:/scratch mounted at /scratch)"
    )
    assert sharedfs.detect("auto", "default", "/home/u/run", mountinfo=text) is None
    assert sharedfs.detect("off", "keyword argument", "/scratch/x", mountinfo=text) is None
    assert sharedfs.detect("on", "environment variable PEERWATCH_SHARED_FS", "/home/u", mountinfo=text) == (
        "shared_fs=on (environment variable PEERWATCH_SHARED_FS)"
    )
    # This machine's own table: the tests' temporary directories are local.
    assert sharedfs.detect("auto", "default", "/tmp/peerwatch-test") is None


def test_remote_read_interval() -> None:
    assert sharedfs.remote_read_interval(1.0, 30.0) == 3.75
    assert sharedfs.remote_read_interval(0.5, 2.5) == 0.5


def test_remote_beats_by_inode_then_by_seq(tmp_path: Path) -> None:
    beats = sharedfs.RemoteWatch(RunDir(str(tmp_path)), HEARTBEAT_S, 1000.0, AwakeClock(10**12), EXIT_CODE)
    live = beats.liveness  # the judge never had a gap
    # First listed at t=0: read it.
    assert beats.listed(2, 10, 0)
    beats.observe(2, (7, 1), 0)
    # A new inode: a new heartbeat, no read needed; the clock restarts.
    assert not beats.listed(2, 11, 5)
    assert live.silent_ns(2, 6) == 1
    # Same inode (frozen, or a reused inode number): read; its first value after an inode
    # change is not a new change (already counted at t=5).
    assert beats.listed(2, 11, 8)
    beats.observe(2, (7, 4), 8)
    assert live.silent_ns(2, 9) == 4
    # Same inode, same seq: silent since t=5.
    assert beats.listed(2, 11, 12)
    beats.observe(2, (7, 4), 12)
    assert live.silent_ns(2, 20) == 15
    # An inode number reused (11 again, but the seq moved): the read tells.
    assert beats.listed(2, 11, 21)
    beats.observe(2, (7, 9), 21)
    assert live.silent_ns(2, 22) == 1
    # Not listed (no heartbeat file, or the listing failed): read; None is a value too.
    assert beats.listed(3, None, 22)
    beats.observe(3, None, 22)
    assert beats.listed(3, None, 30)
    beats.observe(3, None, 30)
    assert (live.silent_ns(2, 40), live.silent_ns(3, 40)) == (19, 18)
    # Observed before it was ever listed: seen then.
    beats.observe(4, (9, 1), 31)
    assert live.changed_ns == {2: 21, 3: 22, 4: 31}
    beats.forget(2)
    assert live.changed_ns == {3: 22, 4: 31}


def test_a_remote_ranks_silence_counts_only_from_the_judges_resume(tmp_path: Path) -> None:
    """The judge was stopped 20 s (the whole job suspended): the heartbeat it last saw 21 s
    ago has been silent 1 s that it saw, not 21 (before, lost at once on resume)."""
    clock = AwakeClock.every(HEARTBEAT_S)  # the watcher's, ticked by it
    watch = sharedfs.RemoteWatch(RunDir(str(tmp_path / "run")), HEARTBEAT_S, PEER_TIMEOUT_S, clock, EXIT_CODE)
    now = time.monotonic_ns()
    watch.observe(2, (7, 1), now - 21 * S)
    clock.tick(now - 21 * S)
    clock.tick(now - S)  # a look 20 s later: the judge was not running meanwhile
    assert clock.since_ns == now - S
    assert S <= watch.liveness.silent_ns(2, time.monotonic_ns()) < 20 * S


def test_a_judge_writes_up_a_remote_rank_silent_for_peer_timeout(tmp_path: Path) -> None:
    watch = sharedfs.RemoteWatch(RunDir(str(tmp_path / "run")), HEARTBEAT_S, PEER_TIMEOUT_S,
                                 AwakeClock.every(HEARTBEAT_S), EXIT_CODE)
    watch.observe(2, (7, 1), time.monotonic_ns() - 3 * S)
    regs = {r: Registration(rank=r, pid=100 + r, ppid=1, start_ticks=5, uid=0, host=host, boot_id=host,
                            pidns=host, time_ns=0) for r, host in ((0, "a"), (2, "b"))}
    [failure] = watch.lost(regs, set(), regs[0])
    assert (failure.rank, failure.pid, failure.cause, failure.exit_code) == (2, 102, LOST, EXIT_CODE)
    assert failure.message.startswith("host b lost: no heartbeat of rank 2 for ")
    assert "s (peer_timeout 2.5s, by the clock of host a)" in failure.message
    assert watch.lost(regs, {2}, regs[0]) == ()  # it has a record of how it ended


# -- the run directory ------------------------------------------------------------------


def test_rundir_slot_held_by_another_host(tmp_path: Path) -> None:
    """A rank's slot held by another host is never judged stale; in shared mode the
    message says to give each job a new directory."""
    me = psutil.Process()
    reg = Registration(rank=1, pid=me.pid, ppid=me.ppid(), start_ticks=0, uid=os.geteuid(), host="here",
                       boot_id="b", pidns="pid:[1]", time_ns=0)
    for shared, expected in [("shared_fs=on (test)", "give each job a new PEERWATCH_DIR"),
                             (None, "or set shared_fs=on")]:
        rd = RunDir(str(tmp_path / f"run-{bool(shared)}"), shared=shared)
        prepare(rd, reg, Started(0, None))
        other = Registration(**{**reg.__dict__, "host": "elsewhere", "pidns": "pid:[2]", "pid": 1})
        rd.write(RANKS, rank_file("rank", 1), encode(other), replace=True)
        with pytest.raises(RunDirError, match=re.escape(expected)):
            prepare(rd, reg, Started(0, None))


@pytest.mark.parametrize("shared_fs, expected", [
    ("on", "rank 0: shared-filesystem mode, as shared_fs=on (environment variable PEERWATCH_SHARED_FS): "
           "other hosts' records are found by polling, their ranks judged lost after peer_timeout=30s of silence"),
    ("auto", None),  # the test's temporary directory is on a local filesystem
])
def test_shared_mode_is_logged_once_with_its_reason(tmp_path: Path, shared_fs: str, expected: Optional[str]) -> None:
    code = "import logging; logging.basicConfig(level=logging.INFO); import peerwatch; peerwatch.install()"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PEERWATCH_DIR=str(tmp_path / "run"), PEERWATCH_SHARED_FS=shared_fs)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if "shared-filesystem mode" in ln]
    assert lines == ([f"INFO:peerwatch:peerwatch: {expected}"] if expected else []), out.stderr


# -- end to end: two hosts, one run directory --------------------------------------------

UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc", "--uts"]


def _unshare_works() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run([*UNSHARE, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


needs_unshare = pytest.mark.skipif(
    not _unshare_works(),
    reason="simulated hosts need `unshare --pid --fork --mount-proc --uts` (root, and a kernel and container "
    "that allow new PID and UTS namespaces) to get their own PID namespace and hostname",
)


class Host:
    """One simulated host: ``sharedfs_host.py`` as the init of a new PID namespace."""

    def __init__(self, tmp: Path, name: str, ranks: Sequence[int], world: int, behave: Sequence[str] = (),
                 env: Optional[Dict[str, str]] = None) -> None:
        self.name = name
        self.ranks = list(ranks)
        self.run_dir = tmp / "run"
        self.ready = tmp / "ready"
        self.ready.mkdir(exist_ok=True)
        self.log = tmp / f"{name}.log"
        drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_PROCID")
        self.env = {k: v for k, v in os.environ.items() if k not in drop}
        self.env.update(
            PEERWATCH_DIR=str(self.run_dir), PEERWATCH_SHARED_FS="on", PEERWATCH_HEARTBEAT=str(HEARTBEAT_S),
            PEERWATCH_PEER_TIMEOUT=str(PEER_TIMEOUT_S), PEERWATCH_GRACE="1", PEERWATCH_EXIT_CODE=str(EXIT_CODE),
            PYTHONUNBUFFERED="1",
        )
        self.env.update(env or {})
        self.argv = [*UNSHARE, sys.executable, str(HOST_PROGRAM),
                     "--host", name, "--ranks", ",".join(map(str, ranks)), "--world", str(world),
                     "--ready", str(self.ready)]
        for item in behave:
            self.argv += ["--behave", item]
        self.popen: Optional[subprocess.Popen] = None
        self.pidfds: Dict[int, int] = {}  # rank -> pidfd of its process (as this namespace sees it)

    def start(self) -> Host:
        with open(self.log, "wb") as log:
            self.popen = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT)
        return self

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Wait for every rank's READY note, then hold each rank's process by a pidfd."""
        assert self.popen is not None
        deadline = time.monotonic() + timeout
        while not all((self.ready / f"rank-{r}").exists() for r in self.ranks):
            if self.popen.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{self.name} not ready (exit {self.popen.poll()}):\n{self.text()}")
            time.sleep(POLL_S)
        for proc in psutil.Process(self.popen.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                rank = proc.environ().get("RANK")
                if rank is not None and int(rank) in self.ranks and "rank_program.py" in " ".join(proc.cmdline()):
                    self.pidfds[int(rank)] = os.pidfd_open(proc.pid)
        assert sorted(self.pidfds) == self.ranks, f"{self.name}: found ranks {sorted(self.pidfds)}"

    def pid(self, rank: int) -> int:
        """The rank's pid in the test's namespace (its own namespace numbers it otherwise)."""
        with open(f"/proc/self/fdinfo/{self.pidfds[rank]}") as f:
            return int(next(ln for ln in f if ln.startswith("Pid:")).split()[1])

    def signal(self, rank: int, sig: int) -> float:
        signal.pidfd_send_signal(self.pidfds[rank], sig)
        return time.monotonic()

    def wait_gone(self, within: float) -> float:
        """Wait until the host's init has ended (all its ranks reaped); returns when (monotonic)."""
        assert self.popen is not None
        try:
            self.popen.wait(within)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still running {within}s later:\n{self.text()}") from None
        return time.monotonic()

    def exit_codes(self) -> Dict[int, Optional[int]]:
        codes: Dict[int, Optional[int]] = {}
        for rank in self.ranks:
            try:
                codes[rank] = int((self.ready / f"exit-{rank}").read_text())
            except (OSError, ValueError):
                codes[rank] = None
        return codes

    def signals_sent(self) -> List[str]:
        """The ranks this host's watchers signalled (peerwatch logs every signal it sends)."""
        return re.findall(r"peerwatch: sent \S+ to rank (\d+)", self.text())

    def text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def destroy(self) -> None:
        """End the host: its init, and with it (the kernel sees to it) its whole namespace."""
        if self.popen is not None and self.popen.poll() is None:
            for child in psutil.Process(self.popen.pid).children():  # the namespace's init
                with contextlib.suppress(psutil.Error):
                    child.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(5.0)
        for fd in self.pidfds.values():
            os.close(fd)
        self.pidfds.clear()


@pytest.fixture
def hosts(tmp_path: Path):
    made: List[Host] = []

    def make(*args: object, **kwargs: object) -> Host:
        host = Host(tmp_path, *args, **kwargs)  # type: ignore[arg-type]
        made.append(host)
        return host

    yield make
    for host in made:
        host.destroy()


def _report(run_dir: Path) -> dict:
    with open(run_dir / "report.json") as f:
        return json.load(f)


def _wait_for(path: Path, within: float) -> None:
    deadline = time.monotonic() + within
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} not written within {within}s"
        time.sleep(POLL_S)


# Host A learns of host B's records only by polling (see the module docstring).
BLIND = {sharedfs.NO_INOTIFY_VAR: "1"}


@needs_unshare
def test_rank_killed_on_host_b_tears_down_host_a(hosts) -> None:
    a = hosts("hostA", [0, 1], world=4, env=BLIND).start()
    b = hosts("hostB", [2, 3], world=4).start()
    a.wait_ready()
    b.wait_ready()
    killed_at = b.signal(3, signal.SIGKILL)
    b_gone = b.wait_gone(5.0)
    a_gone = a.wait_gone(5.0)

    assert b.exit_codes() == {2: EXIT_CODE, 3: -9}, b.text()
    assert a.exit_codes() == {0: EXIT_CODE, 1: EXIT_CODE}, a.text()
    report = _report(a.run_dir)
    v = report["verdict"]
    # Only host B could see rank 3 go (its pidfd): nobody knows how, so "vanished", and
    # the configured exit code.
    assert (v["rank"], v["cause"], v["host"], v["detected_by"], v["exit_code"]) == (3, "vanished", "hostB", 2, EXIT_CODE)
    # A polls every POLL_S: it is gone shortly after B, not a heartbeat or a timeout later.
    assert a_gone - killed_at < sharedfs.POLL_S + 2.0, f"host A took {a_gone - killed_at:.2f}s"
    # Every signal was sent within its own host (the pids of the two hosts collide).
    assert set(a.signals_sent()) <= {"0", "1"} and set(b.signals_sent()) <= {"2", "3"}
    print(f"kill on B -> B gone {b_gone - killed_at:.3f}s, A gone {a_gone - killed_at:.3f}s")


@needs_unshare
def test_frozen_host_is_lost_after_peer_timeout(hosts) -> None:
    a = hosts("hostA", [0, 1], world=4, env=BLIND).start()
    b = hosts("hostB", [2, 3], world=4).start()
    a.wait_ready()
    b.wait_ready()
    frozen_at = min(b.signal(r, signal.SIGSTOP) for r in (2, 3))
    a_gone = a.wait_gone(PEER_TIMEOUT_S + 6.0)
    took = a_gone - frozen_at

    assert a.exit_codes() == {0: EXIT_CODE, 1: EXIT_CODE}, a.text()
    v = _report(a.run_dir)["verdict"]
    # Whichever of B's ranks went silent first (their last heartbeats are close together).
    assert v["rank"] in (2, 3) and (v["cause"], v["host"], v["exit_code"]) == ("lost", "hostB", EXIT_CODE)
    assert re.match(r"host hostB lost: no heartbeat of rank 2 for [\d.]+s, rank 3 for [\d.]+s \(peer_timeout 2.5s, "
                    r"by the clock of host hostA\)", v["detail"]), v["detail"]
    assert v["detected_by"] in (0, 1)
    failure = json.loads((a.run_dir / "events" / rank_file("failure", v["rank"])).read_text())
    assert (failure["cause"], failure["message"], failure["exit_code"]) == ("lost", v["detail"], EXIT_CODE)
    # Not before peer_timeout (less the heartbeat B may have written just before it froze),
    # and not much after: peer_timeout + a read interval + a poll + the teardown.
    assert PEER_TIMEOUT_S - HEARTBEAT_S <= took < PEER_TIMEOUT_S + 3.0, f"host A took {took:.2f}s"
    # Host B was never signalled by A: still stopped, nothing pending (our SIGSTOP is consumed).
    for rank in (2, 3):
        with open(f"/proc/{b.pid(rank)}/status") as f:
            status = dict(ln.split(":", 1) for ln in f if ":" in ln)
        assert status["State"].split()[0] == "T", status["State"]
        assert int(status["SigPnd"], 16) == 0 and int(status["ShdPnd"], 16) == 0, (status["SigPnd"], status["ShdPnd"])
    assert set(a.signals_sent()) <= {"0", "1"}
    print(f"B frozen -> A gone {took:.3f}s (peer_timeout {PEER_TIMEOUT_S}s)")
    b.destroy()  # the test froze it: the test ends it


@needs_unshare
def test_clean_run_on_two_hosts_has_no_verdict(hosts) -> None:
    a = hosts("hostA", [0, 1], world=4, behave=["0=succeed@0.5", "1=succeed@5.5"], env=BLIND).start()
    b = hosts("hostB", [2, 3], world=4, behave=["2=succeed@1.5", "3=succeed@2.5"]).start()
    a.wait_ready()
    b.wait_ready()
    # Rank 1 outlives every rank of host B by more than peer_timeout: finished remote ranks
    # (whose heartbeats stop) are not lost.
    b.wait_gone(10.0)
    a.wait_gone(10.0)
    assert a.exit_codes() == {0: 0, 1: 0}, a.text()
    assert b.exit_codes() == {2: 0, 3: 0}, b.text()
    assert not (a.run_dir / "events" / "verdict.json").exists(), a.text() + b.text()
    assert a.signals_sent() == [] and b.signals_sent() == []


@needs_unshare
def test_each_host_runs_on_verdict_once_and_logs_to_its_own_event_log(hosts, tmp_path: Path) -> None:
    # Issue 22.10: on a shared run directory the hook ran once per job, not once per host;
    # issue 22.14: both hosts appended to one events.jsonl (not atomic across NFS clients).
    told = tmp_path / "told.txt"
    hook = {"PEERWATCH_ON_VERDICT": f'echo "$(hostname) $PEERWATCH_FAILED_RANK" >> {told}',
            "PEERWATCH_ON_VERDICT_TIMEOUT": "2"}
    a = hosts("hostA", [0, 1], world=4, env={**BLIND, **hook}).start()
    b = hosts("hostB", [2, 3], world=4, env=hook).start()
    a.wait_ready()
    b.wait_ready()
    b.signal(3, signal.SIGKILL)
    b.wait_gone(10.0)
    a.wait_gone(10.0)
    assert sorted(told.read_text().splitlines()) == ["hostA 3", "hostB 3"], a.text() + b.text()
    logs = sorted(p.name for p in a.run_dir.glob("events*.jsonl"))
    assert logs == ["events-hostA.jsonl", "events-hostB.jsonl"], logs
    from peerwatch.rundir import eventlog

    events = eventlog.read_run(str(a.run_dir))
    assert sorted(e["rank"] for e in events if e["event"] == "register") == [0, 1, 2, 3]
    assert len([e for e in events if e["event"] == "notify"]) == 2, events
