"""Start a training job under a real launcher, kill one of its processes, time the end.

Used by tests/test_launchers.py and benchmarks/launchers.py. Every process of the job
(the launcher and all its descendants, snapshotted once every rank is training) is held
by a pidfd, so "all gone" is measured exactly and a reused pid is never mistaken for one
of them. Every wait has a deadline; nothing here sleeps without watching a pidfd.

The job gets a base directory of its own (``XDG_RUNTIME_DIR``), so the run directories
that peerwatch picks by its rules (torchrun, spawn, ...) land in the test's tmp folder.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

import psutil
from harness import Proc, exit_code, free_port  # shared with the core's end-to-end tests

PROGRAM = Path(__file__).with_name("launcher_program.py")
READY_POLL_S = 0.02  # how often the READY folder is read while we wait on the launcher's pidfd
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))

# Inherited variables that would make a rank join something other than its job.
FOREIGN_ENV = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
    "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
    "PEERWATCH_DIR", "PEERWATCH_DIR_OWNER", "PEERWATCH_RANK", "PEERWATCH_WORLD_SIZE",
)


class LauncherJob:
    """A job started by ``argv`` (a launcher, or rank 0 for Lightning) in ``folder``."""

    def __init__(
        self, folder: Path, argv: Sequence[str], world: int, env: Optional[Mapping[str, str]] = None,
        peerwatch: bool = True, grace: float = 2.0,
    ) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.ready_dir = self.folder / "ready"
        self.ready_dir.mkdir(exist_ok=True)
        self.base = self.folder / "xdg"
        self.base.mkdir(mode=0o700, exist_ok=True)
        self.log_path = self.folder / "out.log"
        self.argv = list(argv)
        self.world = world
        self.env = {k: v for k, v in os.environ.items() if k not in FOREIGN_ENV}
        self.env.update(
            XDG_RUNTIME_DIR=str(self.base), LP_READY=str(self.ready_dir), LP_WORLD=str(world),
            LP_PEERWATCH="1" if peerwatch else "0", PEERWATCH_GRACE=str(grace), PYTHONUNBUFFERED="1",
            GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
        )
        self.env.update(env or {})
        self.launcher: Optional[Proc] = None
        self.extra: List[Proc] = []  # more processes the test started itself (ranks by hand)
        self.procs: Dict[int, Proc] = {}  # pid -> every process of the job we know of
        self.ranks: Dict[int, int] = {}  # rank -> pid
        self.parents: Dict[int, int] = {}  # pid -> ppid, of the descendants snapshot() found
        self.killed_at: Optional[float] = None

    # -- starting and waiting ------------------------------------------------------

    def start(self, argv: Optional[Sequence[str]] = None, env: Optional[Mapping[str, str]] = None) -> Proc:
        """Start ``argv`` (default: the job's); the first start is the launcher."""
        full_env = dict(self.env, **(env or {}))
        with open(self.log_path, "ab") as log:
            popen = subprocess.Popen(
                list(argv or self.argv), env=full_env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, cwd=str(self.folder),
            )
        proc = Proc(popen.pid, f"pid {popen.pid} (started by the test: {' '.join(argv or self.argv)[:80]})", popen)
        if self.launcher is None:
            self.launcher = proc
        else:
            self.extra.append(proc)
        self.procs[proc.pid] = proc
        return proc

    def started(self) -> List[Proc]:
        return [p for p in [self.launcher, *self.extra] if p is not None]

    def wait_ready(self, timeout: float = 90.0, count: Optional[int] = None) -> Dict[int, int]:
        """Wait until ``count`` (default: all) ranks wrote READY; returns rank -> pid.

        Waits on the pidfds of the processes the test started (fails early, with the log,
        if one ends), reading the READY folder between wake-ups.
        """
        wanted = self.world if count is None else count
        deadline = time.monotonic() + timeout
        fds = [p.pidfd for p in self.started() if p.pidfd is not None]
        while True:
            self._read_ready()
            if len(self.ranks) >= wanted:
                self.snapshot()
                return dict(self.ranks)
            ended = [p for p in self.started() if p.gone()]
            if ended:
                raise AssertionError(
                    f"{', '.join(p.label for p in ended)} ended before {wanted} ranks were ready "
                    f"(ready: {sorted(self.ranks)})\n{self.log()}"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"only ranks {sorted(self.ranks)} ready after {timeout}s\n{self.log()}")
            select.select(fds, [], [], min(left, READY_POLL_S))

    def _read_ready(self) -> None:
        for path in self.ready_dir.glob("rank-*"):
            if path.name.endswith(".tmp"):
                continue
            with contextlib.suppress(OSError, ValueError):
                self.ranks[int(path.name.split("-")[1])] = int(path.read_text())

    def snapshot(self) -> None:
        """Hold every live descendant of the processes the test started, and every rank."""
        for started in self.started():
            try:
                children = psutil.Process(started.pid).children(recursive=True)
            except psutil.Error:
                continue
            for child in children:
                if child.pid not in self.procs:
                    self.procs[child.pid] = Proc(child.pid, f"pid {child.pid} ({' '.join(_cmdline(child))[:80]})")
                    with contextlib.suppress(psutil.Error):
                        self.parents[child.pid] = child.ppid()
        for rank, pid in self.ranks.items():
            if pid not in self.procs:
                self.procs[pid] = Proc(pid, f"rank {rank} (pid {pid})")
            self.procs[pid].label = f"rank {rank} (pid {pid})"

    # -- killing and timing --------------------------------------------------------

    def kill(self, pid: int, sig: int = signal.SIGKILL) -> float:
        proc = self.procs[pid]
        assert proc.pidfd is not None and not proc.gone(), f"{proc.label} is already gone"
        self.killed_at = time.monotonic()
        signal.pidfd_send_signal(proc.pidfd, sig)
        return self.killed_at

    def wait_died(self, pid: int, timeout: float) -> float:
        """Wait until ``pid`` ends on its own; returns when (time.monotonic())."""
        proc = self.procs[pid]
        assert proc.pidfd is not None
        if not select.select([proc.pidfd], [], [], timeout)[0]:
            raise AssertionError(f"{proc.label} did not end within {timeout}s\n{self.log()}")
        self.killed_at = time.monotonic()
        return self.killed_at

    def noted(self, name: str) -> Optional[str]:
        """What a rank noted in the READY folder under ``name`` (launcher_program.note)."""
        try:
            return (self.ready_dir / name).read_text()
        except OSError:
            return None

    def wait_all_gone(self, within: float, but_launcher: bool = False) -> float:
        """Wait until every process of the job is gone; returns seconds since the kill.

        Raises AssertionError naming the survivors after ``within`` seconds (from the kill).
        ``but_launcher``: not the launcher (a torchrun agent, a spawn main process, which are
        no ranks: they leave by themselves once their workers are gone; see wait_launcher),
        nor its children that are no ranks (multiprocessing's resource tracker ends with it).
        """
        assert self.killed_at is not None
        deadline = self.killed_at + within
        poller = select.poll()
        skip = set()
        if but_launcher and self.launcher is not None:
            rank_pids = set(self.ranks.values())
            skip = {self.launcher.pid} | {
                pid for pid, ppid in self.parents.items() if ppid == self.launcher.pid and pid not in rank_pids
            }
        living = {
            p.pidfd: p for p in self.procs.values() if p.pidfd is not None and not p.gone() and p.pid not in skip
        }
        for fd in living:
            poller.register(fd, select.POLLIN)
        for p in self.procs.values():
            if p.gone() and p.gone_at is None:
                p.gone_at = time.monotonic()
        while living:
            left = deadline - time.monotonic()
            if left <= 0:
                names = ", ".join(p.label for p in living.values())
                raise AssertionError(f"still alive {within}s after the death: {names}\n{self.log()}")
            for fd, _ in poller.poll(max(1, int(left * 1000))):
                poller.unregister(fd)
                living.pop(fd).gone_at = time.monotonic()
        last = max((p.gone_at or self.killed_at) for p in self.procs.values() if p.pid not in skip)
        self.reap()
        return last - self.killed_at

    def wait_launcher(self, timeout: float) -> Optional[int]:
        """Wait for the launcher the test started to end, and its children that are no ranks
        (they end with it: multiprocessing's resource tracker); ranks may outlive it."""
        assert self.launcher is not None and self.launcher.popen is not None
        deadline = time.monotonic() + timeout
        try:
            code = self.launcher.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the launcher is still running after {timeout}s\n{self.log()}") from None
        rank_pids = set(self.ranks.values())
        for pid, ppid in self.parents.items():
            proc = self.procs[pid]
            if ppid != self.launcher.pid or pid in rank_pids or proc.pidfd is None:
                continue
            if not select.select([proc.pidfd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise AssertionError(f"{proc.label}, a child of the launcher, still running after {timeout}s")
        return code

    def reap(self) -> None:
        for p in self.procs.values():
            with contextlib.suppress(OSError):
                p.reap()

    def returncode(self, pid: int) -> Optional[int]:
        return self.procs[pid].reap()

    def kill_all(self) -> None:
        """For the benchmark's capped "without" runs: SIGKILL what is left, then reap."""
        for p in self.procs.values():
            if p.pidfd is not None and not p.gone():
                with contextlib.suppress(OSError):
                    signal.pidfd_send_signal(p.pidfd, signal.SIGKILL)
        for p in self.procs.values():
            if p.pidfd is not None:
                select.select([p.pidfd], [], [], 5.0)
        self.reap()

    def close(self) -> None:
        self.reap()
        for p in self.procs.values():
            p.close()

    # -- results -------------------------------------------------------------------

    def log(self, limit: int = 6000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return f"--- job log (last {limit} chars) ---\n{text[-limit:]}"

    def run_dirs(self) -> List[Path]:
        """The run directories peerwatch created under the job's base directory (sorted)."""
        found = [Path(p) for p in glob.glob(str(self.base / "peerwatch" / "*")) if os.path.isdir(p)]
        found += [Path(p) for p in glob.glob(str(self.base / "peerwatch" / "*" / "spawn")) if os.path.isdir(p)]
        return sorted(p for p in found if ".stale-" not in p.name)

    def reports(self) -> Dict[str, dict]:
        out = {}
        for d in self.run_dirs():
            path = d / "report.json"
            if path.exists():
                out[d.name if d.name != "spawn" else f"{d.parent.name}/spawn"] = json.loads(path.read_text())
        return out

    def __enter__(self) -> LauncherJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cmdline(p: psutil.Process) -> List[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return ["?"]


__all__ = ["FOREIGN_ENV", "PROGRAM", "TORCHRUN", "LauncherJob", "Proc", "exit_code", "free_port"]
