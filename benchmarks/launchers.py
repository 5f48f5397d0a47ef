"""Per launcher: time from a death to every process of the job gone, with and without peerwatch.

    .venv/bin/python benchmarks/launchers.py                 # every scenario once, markdown table
    .venv/bin/python benchmarks/launchers.py --repeat 3      # median of 3
    .venv/bin/python benchmarks/launchers.py --only torchrun --cap 30

Real launchers on CPU with gloo (the programs are tests/launcher_program.py): Lightning's
subprocess launcher (Trainer(strategy="ddp", devices=3)), torchrun --nproc-per-node 4,
torch.multiprocessing.spawn (3 workers), and 3 ranks started by hand. One process is
SIGKILLed mid-training (or a rank raises before init_process_group); the clock runs from
the kill (or the crash) to the last process of the job gone, every process held by a
pidfd. Runs without peerwatch are capped (``--cap``, 20 s): what is still alive then is
SIGKILLed and the cell says "> cap". "exit" is what the person who started the job
sees: the exit code of the launcher (rank 0 for Lightning), or of every rank by hand.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from launcher_jobs import PROGRAM, TORCHRUN, LauncherJob, exit_code, free_port  # noqa: E402

GRACE_S = 2.0


@dataclasses.dataclass
class Scenario:
    key: str
    launcher: str
    dies: str
    blocked_in: str
    make: Callable[[Path, bool], LauncherJob]
    victim: Callable[[LauncherJob, Dict[int, int]], Optional[int]]  # pid to SIGKILL; None: a rank crashes


@dataclasses.dataclass
class Result:
    seconds: Optional[float]  # None: still running at the cap
    exit: str


def lightning(env: Dict[str, str]) -> Callable[[Path, bool], LauncherJob]:
    def make(folder: Path, pw: bool) -> LauncherJob:
        job = LauncherJob(folder, [sys.executable, str(PROGRAM), "lightning"], world=3, env=env, peerwatch=pw,
                          grace=GRACE_S)
        job.start()
        return job
    return make


def torchrun(env: Dict[str, str]) -> Callable[[Path, bool], LauncherJob]:
    def make(folder: Path, pw: bool) -> LauncherJob:
        argv = [TORCHRUN, "--standalone", "--nproc-per-node", "4", str(PROGRAM), "worker"]
        job = LauncherJob(folder, argv, world=4, env=env, peerwatch=pw, grace=GRACE_S)
        job.start()
        return job
    return make


def spawn(folder: Path, pw: bool) -> LauncherJob:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    job = LauncherJob(folder, [sys.executable, str(PROGRAM), "spawn"], world=3, env=env, peerwatch=pw, grace=GRACE_S)
    job.start()
    return job


def by_hand(env: Dict[str, str]) -> Callable[[Path, bool], LauncherJob]:
    def make(folder: Path, pw: bool) -> LauncherJob:
        full = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "3", **env}
        job = LauncherJob(folder, [sys.executable, str(PROGRAM), "worker"], world=3, env=full, peerwatch=pw,
                          grace=GRACE_S)
        for rank in range(3):
            job.start(env={"RANK": str(rank), "LOCAL_RANK": str(rank)})
        return job
    return make


def rank(r: int) -> Callable[[LauncherJob, Dict[int, int]], Optional[int]]:
    return lambda job, ranks: ranks[r]


def the_launcher(job: LauncherJob, ranks: Dict[int, int]) -> Optional[int]:
    assert job.launcher is not None
    return job.launcher.pid


def crash(job: LauncherJob, ranks: Dict[int, int]) -> Optional[int]:
    return None


STORE = {"LP_BLOCK": "store"}
SCENARIOS = [
    Scenario("lightning", "Lightning ddp (3)", "rank 1 SIGKILLed", "all_reduce", lightning({}), rank(1)),
    Scenario("lightning-store", "Lightning ddp (3)", "rank 1 SIGKILLed", "store.wait", lightning(STORE), rank(1)),
    Scenario("lightning-rank0", "Lightning ddp (3)", "rank 0 SIGKILLed", "store.wait", lightning(STORE), rank(0)),
    Scenario("torchrun", "torchrun (4)", "worker 2 SIGKILLed", "all_reduce", torchrun({}), rank(2)),
    Scenario("torchrun-term", "torchrun (4)", "worker 2 SIGKILLed", "store.wait, SIGTERM caught",
             torchrun({**STORE, "LP_TERM_HANDLER": "1"}), rank(2)),
    Scenario("torchrun-agent", "torchrun (4)", "the agent SIGKILLed", "all_reduce", torchrun({}), the_launcher),
    Scenario("spawn", "mp.spawn (3)", "worker 1 SIGKILLed", "all_reduce", spawn, rank(1)),
    Scenario("spawn-main", "mp.spawn (3)", "the main process SIGKILLed", "all_reduce", spawn, the_launcher),
    Scenario("hand-crash", "by hand (3)", "rank 1 raises before init_process_group", "rendezvous",
             by_hand({"LP_CRASH_RANK": "1"}), crash),
    Scenario("hand-store", "by hand (3)", "rank 1 SIGKILLed", "store.wait", by_hand(STORE), rank(1)),
]


def run(scenario: Scenario, pw: bool, cap: float) -> Result:
    with tempfile.TemporaryDirectory(prefix="peerwatch-bench-") as tmp:
        job = scenario.make(Path(tmp), pw)
        try:
            ranks = job.wait_ready()
            pid = scenario.victim(job, ranks)
            if pid is None:
                job.wait_died(ranks[1], timeout=60)
                crashed_at = job.noted("crashed-at")
                job.killed_at = float(crashed_at) if crashed_at else job.killed_at
            else:
                job.kill(pid)
            try:
                seconds: Optional[float] = job.wait_all_gone(cap)
            except AssertionError:
                seconds = None
                job.kill_all()
            return Result(seconds, _exit(job, ranks) if seconds is not None else "(killed at the cap)")
        finally:
            job.kill_all()
            job.close()


def _exit(job: LauncherJob, ranks: Dict[int, int]) -> str:
    if len(job.started()) == 1:
        assert job.launcher is not None
        code = exit_code(job.launcher.reap())
        return "-" if code is None else str(code)
    codes = [exit_code(job.returncode(pid)) for _, pid in sorted(ranks.items())]
    return "/".join("-" if c is None else str(c) for c in codes)


def fmt(results: List[Result], cap: float) -> str:
    times = [r.seconds for r in results]
    if any(t is None for t in times):
        capped = sum(t is None for t in times)
        return f"> {cap:g} s" + (f" ({capped}/{len(times)} runs)" if len(times) > 1 else "")
    median = statistics.median(t for t in times if t is not None)
    return f"{median * 1000:.0f} ms" if median < 1 else f"{median:.2f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--cap", type=float, default=20.0, help="seconds a run without peerwatch may take")
    parser.add_argument("--only", default="", help="run the scenarios whose key contains this")
    args = parser.parse_args()
    # Orphans (ranks whose launcher died) become ours: we can wait for them and reap them.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    print(f"CPU, gloo, {os.cpu_count()} cores; PEERWATCH_GRACE={GRACE_S:g}; median of {args.repeat}; "
          f"runs without peerwatch capped at {args.cap:g} s\n")
    print("| launcher | what dies | survivors blocked in | all gone, with peerwatch | exit | "
          "all gone, without | exit |")
    print("|---|---|---|---|---|---|---|")
    for scenario in SCENARIOS:
        if args.only and args.only not in scenario.key:
            continue
        cells = []
        for pw in (True, False):
            results = [run(scenario, pw, args.cap if not pw else 20.0) for _ in range(args.repeat)]
            cells += [fmt(results, args.cap), results[-1].exit]
        print(f"| {scenario.launcher} | {scenario.dies} | {scenario.blocked_in} | " + " | ".join(cells) + " |",
              flush=True)


if __name__ == "__main__":
    main()
