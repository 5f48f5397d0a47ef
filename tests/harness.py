"""A job of N ranks of ``tests/rank_program.py`` for end-to-end tests.

    job = Job(tmp_path, world=4, style="lightning", behave=["2=raise@0.5"]).start()
    job.wait_ready()
    job.kill(1)
    job.wait_gone(within=3.0)
    assert job.returncodes() == {...}
    report = job.report()

The straggler rule (peerwatch.hangs.straggler) judges slots of 5 heartbeats, 6 to 12 of them: at
the tests' 0.5 s heartbeat, 15 s before a first finding and 30 s for a window. The tests
shorten the slots with two private variables, read by peerwatch.hangs.waits and documented only
here (as ``PEERWATCH_TEST_NO_INOTIFY``): ``PEERWATCH_TEST_STRAGGLER_SLOT_S`` (a slot's length,
rounded to whole heartbeats) and ``PEERWATCH_TEST_STRAGGLER_SAMPLE_S`` (the wait sampler's
interval, shortened as much, so a slot holds as many samples: the rule's noise is unchanged).
:func:`straggler_env` sets both.

Every wait is event-driven with a deadline: pidfds for processes (poll(2)), and the
READY folder read every ``READY_POLL_S``. Nothing here kills what it did not start, and
:meth:`Job.close` never kills: a job process still alive at the end of a test is a leak
for the ``no_leaks`` fixture to find, kill and report.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, TypeVar

import psutil

RANK_PROGRAM = Path(__file__).with_name("rank_program.py")
READY_POLL_S = 0.015  # how often the READY folder is read while waiting for ranks
READY_TIMEOUT_S = 20.0  # python start + import; generous for torch on 2 loaded cores
_PR_SET_CHILD_SUBREAPER = 36
# Not imported from peerwatch.hangs.waits: conftest imports this module, and nothing of the
# product is imported at collection (test_stragglerwatch checks the names agree).
STRAGGLER_VARS = ("PEERWATCH_TEST_STRAGGLER_SLOT_S", "PEERWATCH_TEST_STRAGGLER_SAMPLE_S")
STRAGGLER_SLOT_S = 1.0  # 2 heartbeats of 0.5 s: a first finding after 6 s, a window of 12 s
STRAGGLER_SAMPLE_S = 0.02  # 50 samples a slot, as 5 heartbeats of 0.5 s at the default 20 Hz

T = TypeVar("T")

# Inherited variables that would make a rank join something other than its test job.
_FOREIGN_ENV = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
    "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_RANK", "PMI_SIZE",
)


def set_child_subreaper(on: bool) -> bool:
    """Make this process the reaper of its orphaned descendants (Linux ``prctl``).

    A Lightning-style rank 0 dies without reaping ranks 1..N-1; as their subreaper the
    test can still read how each of them ended. Returns False where unsupported.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1 if on else 0, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def straggler_env() -> Dict[str, str]:
    """The environment that shortens the straggler rule's slots (see the module's docstring)."""
    return dict(zip(STRAGGLER_VARS, (f"{STRAGGLER_SLOT_S:g}", f"{STRAGGLER_SAMPLE_S:g}")))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_read(path: Path, parse: Callable[[str], T], within: float, writer: Optional[subprocess.Popen] = None) -> T:
    """What ``parse`` makes of ``path`` once it exists and parses; waits at most ``within`` s.

    Absent or unparsable (a writer that does not write atomically) reads as "not yet".
    Fails at once if ``writer`` ends first. Waits on the writer's pidfd between reads, so its
    end is seen at once; a folder has no event we can poll on without inotify plumbing.
    """
    deadline = time.monotonic() + within
    pidfd = os.pidfd_open(writer.pid) if writer is not None and writer.poll() is None else None
    try:
        while True:
            ended = writer is not None and writer.poll() is not None  # before the read: it is the last
            try:
                return parse(Path(path).read_text())
            except (OSError, ValueError):
                pass
            if ended:
                assert writer is not None
                raise AssertionError(f"{path} not written: its writer ended with {writer.returncode}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{path} not written within {within}s")
            select.select([pidfd] if pidfd is not None else [], [], [], min(left, READY_POLL_S))
    finally:
        if pidfd is not None:
            os.close(pidfd)


def exit_code(returncode: Optional[int]) -> Optional[int]:
    """A subprocess returncode as a shell shows it: -N (signal N) -> 128+N."""
    if returncode is None:
        return None
    return 128 - returncode if returncode < 0 else returncode


class Proc:
    """One process of the job, held by a pidfd so a reused pid is never mistaken for it."""

    def __init__(self, pid: int, label: str, popen: Optional[subprocess.Popen] = None) -> None:
        self.pid = pid
        self.label = label
        self.popen = popen
        self.pidfd: Optional[int] = None
        with contextlib.suppress(ProcessLookupError):
            self.pidfd = os.pidfd_open(pid)  # gone already (and reaped): nothing to wait for
        self.returncode: Optional[int] = None
        self.gone_at: Optional[float] = None  # time.monotonic() when wait_gone saw it go

    def gone(self) -> bool:
        if self.pidfd is None:
            return True
        ready, _, _ = select.select([self.pidfd], [], [], 0)
        return bool(ready)

    def reap(self) -> Optional[int]:
        """Our child (started by us, or an orphan we inherited as subreaper): collect it."""
        if self.returncode is not None:
            return self.returncode
        if self.popen is not None:
            self.returncode = self.popen.poll()
            return self.returncode
        if self.pidfd is None:
            return None
        try:
            result = os.waitid(os.P_PIDFD, self.pidfd, os.WEXITED | os.WNOHANG)
        except ChildProcessError:
            return None  # not our child: its own parent reaps it
        if result is None:
            return None
        if result.si_code == os.CLD_EXITED:
            self.returncode = result.si_status
        else:
            self.returncode = -result.si_status
        return self.returncode

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


class Job:
    """N ranks of ``rank_program.py`` sharing one run directory under ``tmp``.

    ``style="lightning"``: the test starts rank 0, which starts ranks 1..N-1.
    ``style="sibling"``: the test starts every rank with RANK/WORLD_SIZE.
    ``behave``: ``RANK=WHAT[@SECONDS]`` items for ``--behave`` (see rank_program.py).
    """

    def __init__(
        self,
        tmp: Path,
        world: int,
        style: str = "sibling",
        behave: Sequence[str] = (),
        api: str = "install",
        grace: float = 1.0,
        env: Optional[Mapping[str, Optional[str]]] = None,  # None: the variable is unset
        gloo: bool = False,
        sync: bool = True,
        name: str = "job",
        own_group: bool = False,
    ) -> None:
        assert style in ("lightning", "sibling"), style
        self.tmp = Path(tmp) / name
        self.world = world
        self.style = style
        self.behave = list(behave)
        self.api = api
        self.grace = grace
        self.extra_env = dict(env or {})
        self.gloo = gloo
        self.sync = sync  # behaviours' delays count from when every rank is ready
        # The ranks in a process group of their own, led by the first started (signal_group):
        # as a terminal's foreground job, which Ctrl-C signals as a whole.
        self.own_group = own_group
        self.pgid: Optional[int] = None
        self.run_dir = self.tmp / "run"
        self.ready_dir = self.tmp / "ready"
        self.started: Dict[int, Proc] = {}  # rank -> process the test started
        self.ranks: Dict[int, Proc] = {}  # rank -> process, once READY
        self.others: Dict[int, Proc] = {}  # pid -> a descendant of a rank (not a rank)
        self.killed_at: Optional[float] = None  # time.monotonic() of the last kill()
        self.gone_at: Optional[float] = None  # time.monotonic() when the last process went
        self.gone_at_ns: Optional[int] = None  # the same, as time.time_ns()
        self._env_cache: Optional[Dict[str, str]] = None

    # -- starting ------------------------------------------------------------------

    def _env(self) -> Dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _FOREIGN_ENV}
        env.update(
            PEERWATCH_DIR=str(self.run_dir),
            PEERWATCH_GRACE=str(self.grace),
            PYTHONUNBUFFERED="1",
        )
        if self.gloo:
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), GLOO_SOCKET_IFNAME="lo")
        env.update({k: v for k, v in self.extra_env.items() if v is not None})
        return {k: v for k, v in env.items() if self.extra_env.get(k, "") is not None}

    def _argv(self) -> List[str]:
        argv = [sys.executable, str(RANK_PROGRAM), "--world", str(self.world), "--style", self.style,
                "--api", self.api, "--ready", str(self.ready_dir)]
        for item in self.behave:
            argv += ["--behave", item]
        if self.sync:
            argv.append("--sync")
        return argv

    def start(self, ranks: Optional[Sequence[int]] = None) -> Job:
        """Start the job: rank 0 (lightning), or ``ranks`` (sibling; default: all of them).

        Call it again with other ranks to start a sibling job in stages.
        """
        self.ready_dir.mkdir(parents=True, exist_ok=True)
        if self.style == "lightning":
            assert ranks in (None, [0], (0,)), "a Lightning-style job is started through its rank 0"
        if self._env_cache is None:
            self._env_cache = self._env()  # one MASTER_PORT for every stage
        env = self._env_cache
        starts = [0] if self.style == "lightning" else (range(self.world) if ranks is None else ranks)
        for rank in starts:
            assert rank not in self.started, f"rank {rank} was started already"
            rank_env = dict(env)
            if self.style == "sibling":
                rank_env.update(RANK=str(rank), WORLD_SIZE=str(self.world), LOCAL_RANK=str(rank))
            group = self.pgid or 0
            with open(self.log_path(rank), "wb") as log:
                popen = subprocess.Popen(
                    self._argv(), env=rank_env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    cwd=str(self.tmp), preexec_fn=functools.partial(os.setpgid, 0, group) if self.own_group else None,
                )
            if self.own_group and self.pgid is None:
                self.pgid = popen.pid
            self.started[rank] = Proc(popen.pid, f"rank {rank} (pid {popen.pid}, started by the test)", popen)
        return self

    def log_path(self, rank: int) -> Path:
        return self.tmp / f"rank-{rank}.log"

    def logs(self, limit: int = 4000) -> str:
        out = []
        for rank in sorted(self.started):
            try:
                text = self.log_path(rank).read_text(errors="replace")
            except OSError:
                continue
            out.append(f"--- log of the process started as rank {rank} (last {limit} chars) ---\n{text[-limit:]}")
        return "\n".join(out)

    # -- waiting -------------------------------------------------------------------

    def wait_ready(self, ranks: Optional[Sequence[int]] = None, timeout: float = READY_TIMEOUT_S) -> Dict[int, int]:
        """Wait until every rank (or each of ``ranks``) wrote ``READY/rank-<i>``; returns rank -> pid.

        Fails early, with the logs, if a process the test started ends first.
        """
        wanted = set(range(self.world) if ranks is None else ranks)
        deadline = time.monotonic() + timeout
        while True:
            for rank in wanted - set(self.ranks):
                self._adopt(rank)
            if wanted <= set(self.ranks):
                self.snapshot_tree()
                return self.pids
            ended = [p for p in self.started.values() if p.gone()]
            if ended:
                # Let the rest of the job end first: what survives a bounded wait is a leak.
                with contextlib.suppress(AssertionError):
                    self.snapshot_tree()
                    self.wait_gone(5.0)
                raise AssertionError(
                    f"{', '.join(p.label for p in ended)} ended before all ranks were ready "
                    f"(ready: {sorted(self.ranks)})\n{self.logs()}"
                )
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"ranks {sorted(wanted - set(self.ranks))} not ready within {timeout}s\n{self.logs()}"
                )
            # The READY folder has no event source we can poll on alongside the pidfds
            # without inotify plumbing; a short read interval with a deadline is enough.
            time.sleep(READY_POLL_S)

    def _adopt(self, rank: int) -> None:
        try:
            pid = int((self.ready_dir / f"rank-{rank}").read_text())
        except (OSError, ValueError):
            return
        started = self.started.get(rank)
        if started is not None and started.pid == pid:
            self.ranks[rank] = started
            return
        self.ranks[rank] = Proc(pid, f"rank {rank} (pid {pid})")

    def wait_noted(self, names: Sequence[str], timeout: float = 10.0) -> None:
        """Wait until a rank wrote each of ``names`` in the READY folder (see rank_program)."""
        deadline = time.monotonic() + timeout
        while not all((self.ready_dir / name).exists() for name in names):
            if time.monotonic() >= deadline:
                missing = [n for n in names if not (self.ready_dir / n).exists()]
                raise AssertionError(f"not written within {timeout}s: {missing}\n{self.logs()}")
            time.sleep(READY_POLL_S)

    def wait_holding_gil(self, rank: int, timeout: float = 10.0) -> None:
        """Wait until rank's main thread sleeps in C with every signal blocked (``gil``).

        READY comes just before: a failure sent in between would find a rank that can
        still act. Linux only: reads the main thread's signal mask and current syscall.
        """
        pid = self.ranks[rank].pid
        deadline = time.monotonic() + timeout
        while True:
            try:
                with open(f"/proc/{pid}/task/{pid}/status") as f:
                    blocked = int(next(ln for ln in f if ln.startswith("SigBlk:")).split()[1], 16)
                with open(f"/proc/{pid}/task/{pid}/syscall") as f:
                    syscall = f.read().split()[0]
            except (OSError, StopIteration, ValueError, IndexError):
                blocked, syscall = 0, ""
            # nanosleep / clock_nanosleep: 35 / 230 on x86_64, 101 / 115 on aarch64
            if blocked & (1 << (signal.SIGTERM - 1)) and syscall in ("35", "230", "101", "115"):
                return
            if time.monotonic() >= deadline:
                raise AssertionError(f"rank {rank} (pid {pid}) is not holding the GIL in C after {timeout}s")
            time.sleep(READY_POLL_S)

    @property
    def pids(self) -> Dict[int, int]:
        return {rank: p.pid for rank, p in sorted(self.ranks.items())}

    def snapshot_tree(self) -> None:
        """Hold every live descendant of every rank, and every rank not ready yet (found by
        the READY folder in its command line), so that waits cover them too."""
        rank_pids = {p.pid for p in self.ranks.values()} | {p.pid for p in self.started.values()}
        marker = str(self.ready_dir)
        for proc in psutil.process_iter(["cmdline"]):
            if proc.pid in rank_pids or proc.pid in self.others or marker not in (proc.info["cmdline"] or ()):
                continue
            self.others[proc.pid] = Proc(proc.pid, f"pid {proc.pid}, a rank of this job not ready yet")
        for proc in list(self.ranks.values()):
            try:
                children = psutil.Process(proc.pid).children(recursive=True)
            except psutil.Error:
                continue
            for child in children:
                if child.pid in rank_pids or child.pid in self.others:
                    continue
                self.others[child.pid] = Proc(child.pid, f"pid {child.pid}, a descendant of {proc.label}")

    def all_procs(self) -> List[Proc]:
        procs = {id(p): p for p in [*self.started.values(), *self.ranks.values(), *self.others.values()]}
        return list(procs.values())

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> float:
        """Send ``sig`` to rank ``rank`` (through its pidfd); returns time.monotonic() of the kill."""
        self.snapshot_tree()
        proc = self.ranks[rank]
        assert proc.pidfd is not None and not proc.gone(), f"{proc.label} is already gone"
        signal.pidfd_send_signal(proc.pidfd, sig)
        self.killed_at = time.monotonic()
        return self.killed_at

    def signal_group(self, sig: int) -> float:
        """Send ``sig`` to the job's own process group (``own_group``), as a terminal's Ctrl-C
        or ``kill -TERM -PGID`` does; returns time.monotonic() of the kill."""
        assert self.pgid is not None, "the job was not started in its own process group (own_group=True)"
        self.snapshot_tree()
        os.killpg(self.pgid, sig)
        self.killed_at = time.monotonic()
        return self.killed_at

    def kill_all(self) -> None:
        """SIGKILL every process of the job still alive, and wait for them (at most 5 s).

        Only for tests that name the survivors themselves (several jobs at once, or an
        expected failure): elsewhere a survivor is a leak for ``no_leaks`` to report."""
        self.snapshot_tree()
        for p in self.all_procs():
            if p.pidfd is not None and not p.gone():
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(p.pidfd, signal.SIGKILL)
        self.wait_gone(5.0)

    def wait_gone(self, within: float) -> float:
        """Wait until every process of the job is gone; returns how long it took, in seconds.

        Raises AssertionError naming the survivors (and showing the logs) after ``within`` s.
        """
        start = time.monotonic()
        deadline = start + within
        poller = select.poll()
        living = {p.pidfd: p for p in self.all_procs() if p.pidfd is not None and not p.gone()}
        for fd in living:
            poller.register(fd, select.POLLIN)
        while living:
            left = deadline - time.monotonic()
            if left <= 0:
                names = ", ".join(p.label for p in living.values())
                raise AssertionError(f"still alive {within}s after the wait began: {names}\n{self.logs()}")
            for fd, _ in poller.poll(max(1, int(left * 1000))):
                poller.unregister(fd)
                living.pop(fd).gone_at = time.monotonic()
        self.gone_at = time.monotonic()
        self.gone_at_ns = time.time_ns()
        for p in self.all_procs():
            p.reap()
        return self.gone_at - start

    # -- results -------------------------------------------------------------------

    def returncodes(self) -> Dict[int, Optional[int]]:
        """rank -> returncode (subprocess style: -N for signal N) of the processes the test started."""
        return {rank: p.reap() for rank, p in sorted(self.started.items())}

    def all_returncodes(self) -> Dict[int, Optional[int]]:
        """rank -> returncode of every rank, where it can be known: the test's children,
        orphans the test inherited as subreaper, and ranks reaped by Lightning-style rank 0
        (which notes them in READY/exit-<i>). None where nobody could tell."""
        codes: Dict[int, Optional[int]] = {}
        for rank in range(self.world):
            proc = self.ranks.get(rank) or self.started.get(rank)
            code = proc.reap() if proc is not None else None
            if code is None:
                try:
                    code = int((self.ready_dir / f"exit-{rank}").read_text())
                except (OSError, ValueError):
                    pass
            codes[rank] = code
        return codes

    def exit_codes(self) -> Dict[int, Optional[int]]:
        """all_returncodes() as a shell shows them (signal N -> 128+N)."""
        return {rank: exit_code(code) for rank, code in self.all_returncodes().items()}

    def report(self) -> dict:
        with open(self.run_dir / "report.json") as f:
            return json.load(f)

    def cli_report(self) -> dict:
        """What ``peerwatch report RUN --json`` says now (built from the records; works
        when no watcher wrote report.json, as after a clean run)."""
        out = subprocess.run(
            [sys.executable, "-m", "peerwatch", "report", str(self.run_dir), "--json"],
            capture_output=True, text=True, timeout=30,
        )
        assert out.returncode == 0, f"peerwatch report failed ({out.returncode}): {out.stderr}"
        return json.loads(out.stdout)

    def peer_failures(self) -> Dict[int, dict]:
        """rank -> the PeerFailure fields a rank noted as its watch() block ended in one."""
        found = {}
        for rank in range(self.world):
            path = self.ready_dir / f"peerfailure-{rank}"
            if path.exists():
                found[rank] = json.loads(path.read_text())
        return found

    def close(self) -> None:
        """Reap what can be reaped and close the pidfds. Never kills: survivors are leaks."""
        for p in self.all_procs():
            with contextlib.suppress(OSError):
                p.reap()
            p.close()

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def by_rank(report: dict) -> Dict[int, dict]:
    """The report's per-rank entries, keyed by rank."""
    return {r["rank"]: r for r in report["ranks"]}


__all__ = ["STRAGGLER_SAMPLE_S", "STRAGGLER_SLOT_S", "STRAGGLER_VARS", "Job", "by_rank", "exit_code", "free_port", "set_child_subreaper",
           "straggler_env", "wait_read"]
