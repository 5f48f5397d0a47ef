"""Detection and teardown latency: a rank (or rank 0, or the launcher) is SIGKILLed; how long
until somebody knows, and until the last process of the job is gone. Used by run.py.

Contenders, each on this host:

- ``peerwatch``: N ranks of tests/rank_program.py (Python, sleeping, peerwatch installed),
  Lightning-style: rank 0 starts ranks 1..N-1. One trial is teardown_latency.trial().
- ``lightning``: Lightning's own ``_ChildProcessObserver`` (the real class) in a
  Lightning-style rank 0, over N-1 real child processes (Python, sleeping, no peerwatch).
- ``torchrun`` / ``torchrun+peerwatch``: the real torchrun (``--standalone``), N workers
  (Python, sleeping; with or without peerwatch).
- ``gloo`` / ``gloo+peerwatch``: N torch ranks in a gloo all_reduce loop, no watcher at all
  or peerwatch; the process group's timeout is the cap.

"Detected" is when the contender knew: peerwatch's verdict (``detected_at_ns``); Lightning's
observer calling ``_terminate_all``; the first SIGTERM a surviving torchrun worker gets from
the agent; without a watcher, the first survivor whose collective raised. "All gone" is when
the last process of the job ended (pidfds), measured from the SIGKILL.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from _common import HERE, ROOT, TORCHRUN, Pidfds, clean_env, free_port, tree, wait_files
from _template import Template

sys.path.insert(0, str(HERE))
import teardown_latency  # noqa: E402  (the peerwatch trial: reused as it is)

RANKS_PY = str(HERE / "_ranks.py")
OBSERVER_PERIOD_S = 5.0  # _ChildProcessObserver's sleep_period: Lightning never passes another
SETTLE_S = 0.2  # after every rank is running, before the kill (as teardown_latency does)
GRACE = "2"  # PEERWATCH_GRACE for every peerwatch job (teardown_latency's too)
TEARDOWN_TIMEOUT_S = 60.0  # a job with a watcher that is not gone by then is a failed trial


@dataclasses.dataclass
class Trial:
    detected_ms: Optional[float]  # None: nobody detected anything
    gone_ms: Optional[float]  # None: not all gone at the cap (never, without help)
    left: int = 0  # processes still alive at the cap
    code: Optional[int] = None  # the exit code the job reported (peerwatch's verdict)


@dataclasses.dataclass
class Point:
    contender: str
    ranks: str  # what the ranks are ("Python, sleeping", "torch, gloo all_reduce")
    dies: str  # what is SIGKILLed
    n: int
    trials: List[Trial]
    cap_s: Optional[float] = None  # runs stopped at this cap (never / the timeout)
    note: str = ""


def reap_orphans() -> None:
    """Orphans of killed rank 0s / agents are ours (subreaper): collect those that ended."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _ms(later_ns: Optional[int], earlier_ns: int) -> Optional[float]:
    return None if later_ns is None else (later_ns - earlier_ns) / 1e6


def _first_note(folder: Path, pattern: str) -> Optional[int]:
    times = []
    for path in glob.glob(str(folder / pattern)):
        if path.endswith(".tmp"):
            continue
        try:
            times.append(int(Path(path).read_text()))
        except (OSError, ValueError):
            pass
    return min(times) if times else None


def _verdict_ns(pattern: str) -> Optional[int]:
    import json

    for path in glob.glob(pattern):
        try:
            with open(path) as f:
                return int(json.load(f)["detected_at_ns"])
        except (OSError, ValueError, KeyError):
            pass
    return None


def _kill(pid: int) -> int:
    killed_ns = time.time_ns()
    os.kill(pid, signal.SIGKILL)
    return killed_ns


# -- peerwatch (rank_program.py through teardown_latency) -------------------------------


def peerwatch_light(n: int, victim: int, trials: int, progress: Callable[[str], None]) -> List[Trial]:
    out = []
    for i in range(trials):
        with tempfile.TemporaryDirectory(prefix="pw-bench-") as d:
            try:
                detected, gone, code = teardown_latency.trial(n, "lightning", victim, d)
            finally:
                reap_orphans()
        out.append(Trial(detected, gone, code=code))
        progress(f"peerwatch N={n} victim={victim} {i + 1}/{trials}: {detected:.1f} / {gone:.1f} ms")
    return out


# -- Lightning's _ChildProcessObserver ---------------------------------------------------


def lightning_wave(template: Template, n: int, jobs: int, kill_rank0: bool, stagger_s: float, cap_s: float,
                   workdir: Path) -> List[Trial]:
    """``jobs`` Lightning-style jobs at once; their observers start ``stagger_s`` apart, so
    that the teardowns (at the observers' ticks) never overlap. Each victim is killed at a
    random moment of its observer's period, as a real failure would be."""
    env = clean_env()
    folders = []
    for j in range(jobs):
        folder = workdir / f"job{j}"
        folder.mkdir()
        template.fork("_ranks:lightning_rank0", env, args=[str(folder), n])
        folders.append(folder)
    pidfds: List[Pidfds] = []
    try:
        victims = []
        for folder in folders:
            notes = wait_files(folder, [f"rank-{r}" for r in range(n)])
            pids = {r: int(notes[f"rank-{r}"]) for r in range(n)}
            pidfds.append(Pidfds(tree(pids[0]) + list(pids.values())))
            victims.append(pids[0] if kill_rank0 else pids[n // 2])
        time.sleep(SETTLE_S)
        base_ns = time.time_ns() + int(0.3e9)
        kills = []
        for j, folder in enumerate(folders):
            at_ns = base_ns + int(j * stagger_s * 1e9)
            (folder / "observer-at.tmp").write_text(str(at_ns))
            os.replace(folder / "observer-at.tmp", folder / "observer-at")  # rank 0 must not read half of it
            kills.append((at_ns + int(random.uniform(0.01, OBSERVER_PERIOD_S - 0.01) * 1e9), j))
        killed_ns: Dict[int, int] = {}
        gone_ns: Dict[int, Optional[int]] = {}
        poller = select.poll()
        fd_job = {}
        for j, p in enumerate(pidfds):
            for fd in p.fds.values():
                poller.register(fd, select.POLLIN)
                fd_job[fd] = j
        waiting = {j: set(p.fds.values()) for j, p in enumerate(pidfds)}
        kills.sort()
        while waiting:
            now = time.time_ns()
            while kills and kills[0][0] <= now:
                _, j = kills.pop(0)
                killed_ns[j] = _kill(victims[j])
            deadlines = [killed_ns[j] + int(cap_s * 1e9) for j in waiting if j in killed_ns]
            for j in [j for j in waiting if j in killed_ns and now >= killed_ns[j] + int(cap_s * 1e9)]:
                gone_ns[j] = None
                del waiting[j]
            if not waiting:
                break
            wake = min([k for k, _ in kills[:1]] + deadlines, default=now + int(1e9))
            for fd, _ in poller.poll(max(0.0, (wake - time.time_ns()) / 1e6)):
                poller.unregister(fd)
                j = fd_job[fd]
                if j in waiting:
                    waiting[j].discard(fd)
                    if not waiting[j]:
                        gone_ns[j] = time.time_ns()
                        del waiting[j]
        out = []
        for j, folder in enumerate(folders):
            if not (folder / "observer-started").exists():
                raise RuntimeError(f"Lightning's observer did not start in {folder}: a broken trial")
            detected = _first_note(folder, "detected")
            left = len(pidfds[j].alive())
            out.append(Trial(_ms(detected, killed_ns[j]), _ms(gone_ns[j], killed_ns[j]), left=left))
        return out
    finally:
        for p in pidfds:
            p.kill_all()
            p.wait_all_gone(10)
            p.close()
        reap_orphans()


def lightning_observer(template: Template, n: int, kill_rank0: bool, trials: int, cap_s: float,
                       progress: Callable[[str], None]) -> List[Trial]:
    jobs = 10 if n <= 32 else 5  # per wave (5 x 128 processes start at once)
    stagger_s = 0.5  # between observers: a teardown (SIGKILL of N sleepers) takes < 0.1 s
    out: List[Trial] = []
    while len(out) < trials:
        k = min(jobs, trials - len(out))
        with tempfile.TemporaryDirectory(prefix="pw-bench-") as d:
            out += lightning_wave(template, n, k, kill_rank0, stagger_s, cap_s, Path(d))
        progress(f"lightning N={n} rank0={kill_rank0}: {len(out)}/{trials}")
    return out


# -- torchrun ----------------------------------------------------------------------------


def _torchrun(n: int, use_peerwatch: bool, folder: Path, restarts: int) -> subprocess.Popen:
    ready = folder / "ready"
    ready.mkdir()
    (folder / "xdg").mkdir(mode=0o700)
    env = clean_env(XDG_RUNTIME_DIR=str(folder / "xdg"), PEERWATCH_GRACE=GRACE)
    worker = [sys.executable, RANKS_PY, "sleeper", str(ready), "torchrun"]
    if use_peerwatch:
        worker.append("--peerwatch")
    else:
        worker = [sys.executable, "-S", *worker[1:], "--note-term"]
    argv = [TORCHRUN, "--standalone", "--nproc-per-node", str(n), "--max-restarts", str(restarts),
            "--monitor-interval", "0.1", "--no-python", *worker]
    with open(folder / "torchrun.log", "wb") as log:
        return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                cwd=str(folder))


def torchrun_worker_deaths(n: int, use_peerwatch: bool, trials: int, progress: Callable[[str], None]) -> List[Trial]:
    """One torchrun with ``--max-restarts trials``: each attempt, a worker is SIGKILLed;
    the agent stops the others and starts a new attempt (the next trial). "All gone":
    every worker of the attempt (the agent lives on to restart them)."""
    out = []
    with tempfile.TemporaryDirectory(prefix="pw-bench-") as d:
        folder = Path(d)
        agent = _torchrun(n, use_peerwatch, folder, restarts=trials)
        ready = folder / "ready"
        try:
            for attempt in range(trials):
                notes = wait_files(ready, [f"w{attempt}-{r}" for r in range(n)], watch=[agent])
                pids = [int(notes[f"w{attempt}-{r}"]) for r in range(n)]
                workers = Pidfds(pids)
                try:
                    time.sleep(SETTLE_S)
                    killed = _kill(pids[n // 2])
                    gone = workers.wait_all_gone(TEARDOWN_TIMEOUT_S)
                finally:
                    workers.kill_all()
                    workers.close()
                if use_peerwatch:
                    detected = _verdict_ns(str(folder / "xdg" / "peerwatch" / f"torchrun-*-r{attempt}" / "events"
                                               / "verdict.json"))
                else:
                    detected = _first_note(ready, f"term-w{attempt}-*")
                out.append(Trial(_ms(detected, killed), _ms(gone, killed)))
                progress(f"torchrun N={n} pw={use_peerwatch} {attempt + 1}/{trials}")
        finally:
            everything = Pidfds(tree(agent.pid))
            agent.terminate()
            if everything.wait_all_gone(30) is None:
                everything.kill_all()
            everything.close()
            agent.wait()
            reap_orphans()
    return out


def torchrun_agent_death(n: int, use_peerwatch: bool, trials: int, cap_s: float,
                         progress: Callable[[str], None]) -> List[Trial]:
    """A fresh torchrun each trial; the agent is SIGKILLed."""
    out = []
    for i in range(trials):
        with tempfile.TemporaryDirectory(prefix="pw-bench-") as d:
            folder = Path(d)
            agent = _torchrun(n, use_peerwatch, folder, restarts=0)
            job: Optional[Pidfds] = None
            try:
                wait_files(folder / "ready", [f"w0-{r}" for r in range(n)], watch=[agent])
                job = Pidfds(tree(agent.pid))
                time.sleep(SETTLE_S)
                killed = _kill(agent.pid)
                gone = job.wait_all_gone(TEARDOWN_TIMEOUT_S if use_peerwatch else cap_s)
                left = len(job.alive())
                detected = _verdict_ns(str(folder / "xdg" / "peerwatch" / "torchrun-*" / "events" / "verdict.json"))
                out.append(Trial(_ms(detected, killed), _ms(gone, killed), left=left))
            finally:
                if job is not None:
                    job.kill_all()
                    job.wait_all_gone(10)
                    job.close()
                agent.wait()
                reap_orphans()
        progress(f"torchrun agent N={n} pw={use_peerwatch} {i + 1}/{trials}")
    return out


# -- gloo ranks (torch), no watcher or peerwatch -----------------------------------------


def gloo_job(template: Template, n: int, victim: int, use_peerwatch: bool, block: str, trials: int, cap_s: float,
             progress: Callable[[str], None]) -> List[Trial]:
    out = []
    for i in range(trials):
        with tempfile.TemporaryDirectory(prefix="pw-bench-") as d:
            folder = Path(d)
            ready = folder / "ready"
            ready.mkdir()
            env = clean_env(
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(n), BENCH_CAP_S=str(cap_s),
                BENCH_BLOCK=block, BENCH_PEERWATCH="1" if use_peerwatch else "0",
                PEERWATCH_DIR=str(folder / "run"), PEERWATCH_GRACE=GRACE,
            )
            for r in range(n):
                template.fork("_ranks:gloo_rank", dict(env, RANK=str(r), LOCAL_RANK=str(r)), args=[str(ready)],
                              log=str(folder / f"rank{r}.log"))
            job: Optional[Pidfds] = None
            try:
                notes = wait_files(ready, [f"rank-{r}" for r in range(n)])
                pids = [int(notes[f"rank-{r}"]) for r in range(n)]
                job = Pidfds(pids)
                time.sleep(SETTLE_S)
                killed = _kill(pids[victim])
                gone = job.wait_all_gone(cap_s + TEARDOWN_TIMEOUT_S)
                left = len(job.alive())
                if use_peerwatch:
                    detected = _verdict_ns(str(folder / "run" / "events" / "verdict.json"))
                else:
                    detected = _first_note(ready, "error-*")
                out.append(Trial(_ms(detected, killed), _ms(gone, killed), left=left))
            finally:
                if job is not None:
                    job.kill_all()
                    job.wait_all_gone(10)
                    job.close()
        progress(f"gloo N={n} victim={victim} pw={use_peerwatch} block={block} {i + 1}/{trials}")
    return out


def template_env() -> Dict[str, str]:
    return clean_env(PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT)]))


__all__ = [
    "Point", "Trial", "gloo_job", "lightning_observer", "peerwatch_light", "template_env", "torchrun_agent_death",
    "torchrun_worker_deaths",
]


def _smoke(argv: Sequence[str]) -> None:  # python latency.py: one trial of each, for development
    progress = print
    print(peerwatch_light(4, 2, 1, progress))
    template = Template(["_ranks", "lightning.fabric.strategies.launchers.subprocess_script", "torch.distributed",
                         "peerwatch"], template_env())
    try:
        print(lightning_observer(template, 4, False, 2, 3.0, progress))
        print(lightning_observer(template, 4, True, 1, 3.0, progress))
        print(gloo_job(template, 3, 2, False, "allreduce", 1, 3.0, progress))
        print(gloo_job(template, 3, 2, True, "allreduce", 1, 3.0, progress))
        print(gloo_job(template, 3, 2, False, "store", 1, 3.0, progress))
        print(gloo_job(template, 3, 0, True, "allreduce", 1, 3.0, progress))
    finally:
        template.close()
    print(torchrun_worker_deaths(2, False, 2, progress))
    print(torchrun_worker_deaths(2, True, 2, progress))
    print(torchrun_agent_death(2, False, 1, 3.0, progress))
    print(torchrun_agent_death(2, True, 1, 3.0, progress))


if __name__ == "__main__":
    from _common import become_subreaper

    become_subreaper()
    _smoke(sys.argv[1:])
