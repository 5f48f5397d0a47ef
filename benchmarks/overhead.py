"""What peerwatch costs a job that is not failing. Used by run.py.

- Idle CPU: N ranks that only sleep, with and without peerwatch, side by side; the CPU time
  of every thread of every rank (scheduler nanoseconds, /proc/PID/task/*/schedstat) over a
  window, extrapolated to an hour. Beside them, two floors: N processes whose one thread
  only wakes once a second and writes a heartbeat-sized record, in Python and in C. What a
  wake costs depends on the machine (on some virtual machines every page touched after a
  second asleep costs tens of microseconds); the floors show that cost in the same run.
- Step time: two jobs of 2 ranks (one with peerwatch, one without) run blocks of training
  steps in turn, A/B interleaved in random order, so that drifts of the machine fall on both.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from _common import HERE, Pidfds, clean_env, cpu_ns, free_port, wait_files

RANKS_PY = str(HERE / "_ranks.py")
IDLE_SETTLE_S = 3.0  # after every rank is running: the first heartbeats and scans are done


TMPFS = "/dev/shm"
FLOORS = {  # mode -> what the row is
    "python-waker": "a Python thread waking once a second (poll + pwrite)",
    "c-waker": "a C program waking once a second (nanosleep + pwrite)",
}


@dataclasses.dataclass
class Idle:
    n: int
    where: str  # the run directory's filesystem
    seconds: float
    with_s_per_h: float  # CPU seconds per rank per hour, mean over the ranks
    without_s_per_h: float
    with_max_s_per_h: float
    polling: int  # ranks that got no inotify instance (the per-user limit): they poll every 0.1 s
    inotify_s_per_h: float  # mean over the ranks that have their inotify instance
    what: str = "peerwatch"  # or a floor: FLOORS' keys

    @property
    def floor(self) -> bool:
        return self.what != "peerwatch"

    @property
    def watcher_s_per_h(self) -> float:
        return self.with_s_per_h - self.without_s_per_h


def _fs(path: str) -> str:
    best, kind = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            _, mount, fstype = line.split()[:3]
            if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                best, kind = mount, fstype
    return kind


def _has_inotify(pid: int) -> bool:
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:inotify" for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False


def _idle_phase(variants: List[tuple], seconds: float, tmp: str, shm: str,
                progress: Callable[[str], None], heartbeat_s: Optional[float]) -> Dict[tuple, tuple]:
    """(n, mode) -> (CPU s/hour of each rank, whether each has an inotify instance), side by side."""
    jobs: Dict[tuple, List[subprocess.Popen]] = {}
    folders: Dict[tuple, Path] = {}
    everything = Pidfds([])
    try:
        for n, mode in variants:
            folder = Path(tmp) / f"n{n}-{mode}"
            (folder / "ready").mkdir(parents=True)
            run_dir = Path(shm if mode == "tmpfs" else folder) / f"run-{n}"
            env = clean_env(WORLD_SIZE=str(n), PEERWATCH_DIR=str(run_dir))
            if heartbeat_s is not None:
                env["PEERWATCH_HEARTBEAT"] = str(heartbeat_s)
            argv = [sys.executable, RANKS_PY, "idle", str(folder / "ready")]
            if mode == "python-waker":
                argv.append("--waker")
            elif mode == "c-waker":
                argv = [str(Path(tmp) / "waker"), str(folder / "beat")]
            elif mode != "none":
                argv.append("--peerwatch")
            jobs[n, mode] = [
                subprocess.Popen(argv, env=dict(env, RANK=str(r)), stdin=subprocess.DEVNULL) for r in range(n)
            ]
            folders[n, mode] = folder
            for p in jobs[n, mode]:
                everything.add(p.pid)
        for key, folder in folders.items():
            if key[1] != "c-waker":  # it notes nothing: started is running
                wait_files(folder / "ready", [f"rank-{r}" for r in range(key[0])], watch=jobs[key])
        time.sleep(IDLE_SETTLE_S)
        progress(f"idle: {sum(len(v) for v in jobs.values())} ranks running; measuring for {seconds:g} s")
        before = {key: [cpu_ns(p.pid) for p in procs] for key, procs in jobs.items()}
        t0 = time.monotonic()
        time.sleep(seconds)
        after = {key: [cpu_ns(p.pid) for p in procs] for key, procs in jobs.items()}
        window = time.monotonic() - t0
        inotify = {key: [_has_inotify(p.pid) for p in procs] for key, procs in jobs.items()}
        for key, procs in jobs.items():
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a rank of the idle job {key} ended while measured")
    finally:
        everything.kill_all()
        everything.wait_all_gone(30)
        everything.close()
        for procs in jobs.values():
            for p in procs:
                p.wait()
    return {
        key: ([((a or 0) - (b or 0)) / 1e9 / window * 3600 for a, b in zip(after[key], before[key])], inotify[key])
        for key in jobs
    }


def idle_cpu(ns: List[int], seconds: float, progress: Callable[[str], None],
             heartbeat_s: Optional[float] = None) -> List[Idle]:
    """For each N, a job with peerwatch and one without, side by side: what is measured is
    each process's own CPU time, not wall time. One N at a time: every peerwatch rank takes
    an inotify instance, and the per-user limit (often 128) would make the extra ones poll.

    For the smallest N, one more job keeps its run directory on tmpfs (where
    $XDG_RUNTIME_DIR usually is), to show what the filesystem costs the heartbeats, and the
    floors run beside it (the C one where a C compiler is found). ``heartbeat_s``: the
    watchers' heartbeat interval instead of the default (no floors then: they wake once a
    second); a short one shows what a beat costs when its wakes are warm.
    """
    out = []
    with tempfile.TemporaryDirectory(prefix="pw-bench-") as d, \
            tempfile.TemporaryDirectory(prefix="pw-bench-", dir=TMPFS if os.path.isdir(TMPFS) else None) as shm:
        here = _fs(d)  # the run directories' filesystem (the floors write their records there too)
        where = {"peerwatch": here, "tmpfs": _fs(shm), **{mode: here for mode in FLOORS}}
        floors = [] if heartbeat_s is not None else ["python-waker"] + (["c-waker"] if _build_waker(d) else [])
        for n in ns:
            extra = ["tmpfs"] + floors if n == min(ns) else []
            variants = [(n, mode) for mode in ["none", "peerwatch"] + extra]
            result = _idle_phase(variants, seconds, d, shm, progress, heartbeat_s)
            base = statistics.mean(result[n, "none"][0])
            for _, mode in variants[1:]:
                rates, inotify = result[n, mode]
                watched = [r for r, ok in zip(rates, inotify) if ok] or [float("nan")]
                out.append(Idle(n, where[mode], seconds, statistics.mean(rates), base, max(rates),
                                inotify.count(False), statistics.mean(watched) - base,
                                FLOORS.get(mode, "peerwatch")))
    return out


def _build_waker(folder: str) -> bool:
    """The C floor, compiled into ``folder``; False where there is no C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return False
    built = subprocess.run([cc, "-O2", "-o", os.path.join(folder, "waker"), str(HERE / "_waker.c")],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return built.returncode == 0


def _t95(n: int) -> float:
    return {2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78, 6: 2.57, 7: 2.45, 8: 2.36, 9: 2.31, 10: 2.26, 11: 2.23, 12: 2.20,
            13: 2.18, 14: 2.16, 15: 2.14, 16: 2.13, 17: 2.12, 18: 2.11, 19: 2.10, 20: 2.09}.get(n, 2.0)


@dataclasses.dataclass
class Steps:
    kind: str
    pairs: int
    steps: int
    without_ms: List[float]  # wall time per step of each block (both ranks averaged)
    with_ms: List[float]
    without_cpu_ms: List[float]  # process CPU time per step (every thread: the watcher's too)
    with_cpu_ms: List[float]

    @staticmethod
    def _diffs(a: List[float], b: List[float]) -> List[float]:
        return [(y - x) / x * 100 for x, y in zip(a, b)]

    def diff_pct(self, cpu: bool = False) -> float:
        return statistics.mean(self._diffs(*self._pair(cpu)))

    def ci95_pct(self, cpu: bool = False) -> float:
        """Half-width of the 95% interval of the mean difference (t distribution over the pairs)."""
        d = self._diffs(*self._pair(cpu))
        return float("nan") if len(d) < 2 else _t95(len(d)) * statistics.stdev(d) / len(d) ** 0.5

    def noise_pct(self) -> float:
        """Block-to-block spread of the wall time without peerwatch (coefficient of variation)."""
        if len(self.without_ms) < 2:
            return float("nan")
        return statistics.stdev(self.without_ms) / statistics.mean(self.without_ms) * 100

    def _pair(self, cpu: bool) -> tuple:
        return (self.without_cpu_ms, self.with_cpu_ms) if cpu else (self.without_ms, self.with_ms)


class _TrainJob:
    def __init__(self, kind: str, use_peerwatch: bool, folder: Path) -> None:
        env = clean_env(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                        PEERWATCH_DIR=str(folder / "run"))
        argv = [sys.executable, RANKS_PY, "train", kind] + (["--peerwatch"] if use_peerwatch else [])
        self.procs = [
            subprocess.Popen(argv, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
            for r in range(2)
        ]
        for p in self.procs:
            self._read(p)

    @staticmethod
    def _read(p: subprocess.Popen) -> Dict:
        assert p.stdout is not None
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"a training rank ended with {p.wait()}")
        return dict(json.loads(line))

    def block(self, steps: int) -> tuple:
        """(wall ms, CPU ms) per step, averaged over the ranks."""
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(f"run {steps}\n")
            p.stdin.flush()
        replies = [self._read(p) for p in self.procs]
        return statistics.mean(r["mean_ms"] for r in replies), statistics.mean(r["cpu_ms"] for r in replies)

    def close(self) -> None:
        for p in self.procs:
            try:
                assert p.stdin is not None
                p.stdin.write("quit\n")
                p.stdin.close()
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def step_time(kind: str, pairs: int, block_s: float, progress: Callable[[str], None]) -> Steps:
    """``pairs`` A/B pairs of blocks of about ``block_s`` seconds each."""
    with tempfile.TemporaryDirectory(prefix="pw-bench-") as d:
        jobs = {}
        try:
            for pw in (False, True):
                jobs[pw] = _TrainJob(kind, pw, Path(d) / ("pw" if pw else "none"))
            warm = {pw: jobs[pw].block(20)[0] for pw in (False, True)}  # warm-up, and the step time
            steps = max(20, int(block_s * 1000 / statistics.mean(warm.values())))
            results: Dict[bool, List[tuple]] = {False: [], True: []}
            for i in range(pairs):
                order = [False, True] if random.random() < 0.5 else [True, False]
                for pw in order:
                    results[pw].append(jobs[pw].block(steps))
                progress(f"step time {kind}: pair {i + 1}/{pairs}: without {results[False][-1]}, "
                         f"with {results[True][-1]}")
        finally:
            for job in jobs.values():
                job.close()
    return Steps(kind, pairs, steps, [w for w, _ in results[False]], [w for w, _ in results[True]],
                 [c for _, c in results[False]], [c for _, c in results[True]])


__all__ = ["Idle", "Steps", "idle_cpu", "step_time"]
