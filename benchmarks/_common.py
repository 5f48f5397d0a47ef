"""Shared by the benchmarks: statistics, pidfd waits, process trees, tables, the machine."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import math
import os
import platform
import select
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
POLL_S = 0.01  # how often a READY folder is read while waiting for processes to start
START_TIMEOUT_S = 120.0  # N=128 fresh interpreters on 2 busy cores take a while
_PR_SET_CHILD_SUBREAPER = 36

# Inherited variables that would make a process join something other than its job.
FOREIGN_ENV = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
    "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
    "PEERWATCH_DIR", "PEERWATCH_DIR_OWNER", "PEERWATCH_RANK", "PEERWATCH_WORLD_SIZE", "PEERWATCH_DISABLE",
)


def clean_env(**extra: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in FOREIGN_ENV}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def become_subreaper() -> None:
    """Orphans of the jobs (ranks whose rank 0 or agent was killed) become ours to reap."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def reap(pids: Iterable[int]) -> None:
    """Reap those of ``pids`` that are our children (orphans we inherited) and have ended."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


# -- statistics ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Summary:
    n: int
    median: float
    p90: float
    p99: float
    max: float


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile: the smallest value with at least ``q`` of the values at or below it.

    With 30 trials p99 is the maximum; the table says so through its trial count.
    """
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summarize(values: Sequence[float]) -> Optional[Summary]:
    if not values:
        return None
    return Summary(len(values), statistics.median(values), quantile(values, 0.9), quantile(values, 0.99), max(values))


def fmt_ms(ms: Optional[float]) -> str:
    if ms is None:
        return "-"
    if ms >= 10_000:
        return f"{ms / 1000:.1f} s"
    if ms >= 100:
        return f"{ms:.0f}"
    if ms >= 10:
        return f"{ms:.1f}"
    return f"{ms:.2f}"


def fmt_summary(s: Optional[Summary]) -> str:
    """median / p90 / p99 / max, in ms."""
    if s is None:
        return "-"
    return " / ".join(fmt_ms(v) for v in (s.median, s.p90, s.p99, s.max))


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# -- processes -------------------------------------------------------------------------


class Pidfds:
    """Processes held by pidfds: waiting for all of them to end, and signalling them safely."""

    def __init__(self, pids: Iterable[int]) -> None:
        self.fds: Dict[int, int] = {}  # pid -> pidfd
        for pid in pids:
            self.add(pid)

    def add(self, pid: int) -> None:
        if pid in self.fds:
            return
        with contextlib.suppress(ProcessLookupError):
            self.fds[pid] = os.pidfd_open(pid)
        # gone already (and reaped): nothing to wait for

    def alive(self) -> List[int]:
        return [pid for pid, fd in self.fds.items() if not select.select([fd], [], [], 0)[0]]

    def wait_all_gone(self, timeout: float) -> Optional[int]:
        """time.time_ns() when the last one ended (as seen by poll), or None at the timeout."""
        waiting = {fd: pid for pid, fd in self.fds.items()}
        deadline = time.monotonic() + timeout
        gone_ns = time.time_ns()
        poller = select.poll()
        for fd in waiting:
            poller.register(fd, select.POLLIN)
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            events = poller.poll(left * 1000)
            gone_ns = time.time_ns()
            for fd, _ in events:
                poller.unregister(fd)
                waiting.pop(fd, None)
        return gone_ns

    def kill_all(self) -> int:
        """SIGKILL every one still alive (through its pidfd: a reused pid is never hit)."""
        killed = 0
        for fd in self.fds.values():
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
                killed += 1
        return killed

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def tree(pid: int) -> List[int]:
    """``pid`` and all its descendants, now."""
    try:
        proc = psutil.Process(pid)
        return [pid] + [c.pid for c in proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def wait_files(folder: Path, names: Sequence[str], timeout: float = START_TIMEOUT_S,
               watch: Sequence[subprocess.Popen] = ()) -> Dict[str, str]:
    """Wait until every file of ``names`` exists in ``folder``; returns name -> content."""
    deadline = time.monotonic() + timeout
    wanted = set(names)
    while not wanted <= set(os.listdir(folder)):
        if time.monotonic() > deadline:
            missing = sorted(wanted - set(os.listdir(folder)))
            raise TimeoutError(f"not written within {timeout:g} s: {missing[:5]} ({len(missing)} missing)")
        for p in watch:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args!r} ended early with {p.returncode}")
        time.sleep(POLL_S)
    return {name: (folder / name).read_text() for name in names}


def cpu_ns(pid: int) -> Optional[int]:
    """CPU time of every thread of ``pid`` (ns, from the scheduler; exact, unlike clock ticks)."""
    total = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                    total += int(f.read().split()[0])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return total


# -- the machine -----------------------------------------------------------------------


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def machine() -> Dict[str, str]:
    versions = {}
    for name in ("torch", "lightning", "peerwatch"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            versions[name] = version(name)
    return {
        "nproc": str(os.cpu_count()),
        "cpu": cpu_model(),
        "memory": f"{psutil.virtual_memory().total / 2**30:.0f} GiB",
        "kernel": platform.release(),
        "python": platform.python_version(),
        **versions,
        "commit": peerwatch_commit(),
    }


def peerwatch_commit() -> str:
    """The commit of the peerwatch being measured, and whether peerwatch/ has local changes."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "peerwatch"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" (peerwatch/ has uncommitted changes)" if dirty else "")


def load1() -> float:
    return os.getloadavg()[0]


def end_workers(procs: Sequence, server: subprocess.Popen, join_s: float) -> None:
    """Join the worker processes (multiprocessing), killing any still running after
    ``join_s``; then end the store server by closing its stdin (it reads until EOF)."""
    for p in procs:
        p.join(join_s)
        if p.is_alive():
            p.kill()
            p.join(5)
    if server.stdin:
        server.stdin.close()
    server.wait(10)


__all__ = [
    "FOREIGN_ENV", "HERE", "ROOT", "TORCHRUN", "Pidfds", "Summary", "become_subreaper", "clean_env", "cpu_model",
    "cpu_ns", "end_workers", "fmt_ms", "fmt_summary", "free_port", "load1", "machine", "peerwatch_commit", "quantile", "reap", "summarize", "table",
    "tree", "wait_files",
]

