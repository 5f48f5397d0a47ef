"""False positives: N clean runs of a 4-rank job under scheduling noise; counts teardowns.

    .venv/bin/python benchmarks/false_positives.py --runs 500
    .venv/bin/python benchmarks/false_positives.py --runs 20 --parallel 3 --burners 4 --seed 7

Every run is a job of 4 ranks of ``tests/rank_program.py`` that all finish cleanly, at
staggered times, while the scheduler is kept busy:

- each rank works for a random 0.05-1.5 s (``noisy``: random sleeps of up to 50 ms and
  CPU bursts of up to 30 ms, ``beat()`` every step), then finishes cleanly: ranks exit in
  a random order, up to 1.5 s apart;
- launch style (Lightning-style rank 0 starting the others, or siblings started one by
  one with random gaps of up to 0.2 s), API (``install()``, ``watch()``, both) and whether
  the work starts once every rank is ready (``--sync``) are drawn at random per run;
- ``--parallel`` jobs run at once (default 2), and ``--burners`` processes (default: one
  per CPU) burn the CPU in random bursts for the whole benchmark.

A run is a **teardown** (a false positive) if peerwatch wrote a verdict or any rank
exited non-zero; a run whose processes are not all gone within ``--deadline`` s is
**stuck** (killed, counted apart). Both must be 0. Prints a markdown table (and the
failing runs' logs, if any). Exit status: 0 if both counts are 0, else 1.

``tests/test_false_positives.py`` runs a CI-sized version (10 runs).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from harness import Job, set_child_subreaper  # noqa: E402

WORLD = 4
WORK_S = (0.05, 1.5)  # each rank's random work before it finishes cleanly
START_GAP_S = 0.2  # sibling style: random gap before starting each rank
READY_TIMEOUT_S = 60.0

BURNER = r"""
import random, time
rng = random.Random()
while True:
    end = time.monotonic() + rng.uniform(0.0, 0.05)
    while time.monotonic() < end:
        pass
    time.sleep(rng.uniform(0.0, 0.05))
"""


@dataclass
class Run:
    index: int
    style: str
    api: str
    sync: bool
    seconds: float = 0.0
    codes: dict = field(default_factory=dict)
    verdict: bool = False
    stuck: bool = False
    error: str = ""
    logs: str = ""

    @property
    def teardown(self) -> bool:
        return self.verdict or any(c != 0 for c in self.codes.values())


@dataclass
class Result:
    runs: List[Run]
    wall_s: float
    parallel: int
    burners: int
    seed: int

    @property
    def teardowns(self) -> int:
        return sum(r.teardown for r in self.runs if not r.stuck and not r.error)

    @property
    def stuck(self) -> int:
        return sum(r.stuck for r in self.runs)

    @property
    def errors(self) -> int:
        return sum(bool(r.error) for r in self.runs)


def one_run(index: int, rng: random.Random, workdir: Path, deadline: float) -> Run:
    run = Run(index, style=rng.choice(["lightning", "sibling"]), api=rng.choice(["install", "watch", "both"]),
              sync=rng.random() < 0.5)
    behave = [f"{r}=noisy@{rng.uniform(*WORK_S):.3f}" for r in range(WORLD)]
    gaps = [rng.uniform(0.0, START_GAP_S) for _ in range(WORLD)]
    with tempfile.TemporaryDirectory(prefix=f"run{index}-", dir=workdir) as tmp:
        job = Job(Path(tmp), world=WORLD, style=run.style, behave=behave, api=run.api, sync=run.sync, grace=1.0)
        start = time.monotonic()
        try:
            if run.style == "lightning":
                job.start()
            else:
                for rank in range(WORLD):
                    time.sleep(gaps[rank])
                    job.start([rank])
            if run.style == "lightning":
                # Rank 0 starts the others: READY names them (rank 0 lives until they end).
                job.wait_ready(timeout=READY_TIMEOUT_S)
            # Sibling ranks were all started by us (without --sync, the first may be done
            # before the last is ready: a rank that joins a run where a peer already
            # finished must not take that peer for failed).
            try:
                job.wait_gone(within=deadline + READY_TIMEOUT_S)
            except AssertionError:
                run.stuck = True
                job.kill_all()
        except AssertionError as e:  # a rank ended before every rank was ready
            run.error = str(e).splitlines()[0]
            with contextlib.suppress(AssertionError):
                job.kill_all()
        finally:
            run.seconds = time.monotonic() - start
            run.codes = job.all_returncodes()
            run.verdict = (job.run_dir / "events" / "verdict.json").exists()
            missing = [r for r in range(WORLD) if not (job.ready_dir / f"rank-{r}").exists()]
            if missing and not run.error:
                run.error = f"ranks {missing} never ready"
            if run.teardown or run.stuck or run.error:
                run.logs = job.logs()
            job.close()
    return run


def benchmark(runs: int, parallel: int = 2, burners: Optional[int] = None, seed: Optional[int] = None,
              deadline: float = 30.0, progress: bool = False) -> Result:
    """Run ``runs`` clean jobs, ``parallel`` at a time, next to ``burners`` CPU burners."""
    seed = random.randrange(1 << 30) if seed is None else seed
    burners = (os.cpu_count() or 1) if burners is None else burners
    set_child_subreaper(True)  # orphans of a torn-down Lightning-style job become ours to reap
    burning = [subprocess.Popen([sys.executable, "-c", BURNER], stdin=subprocess.DEVNULL) for _ in range(burners)]
    lock = threading.Lock()
    done: List[Run] = []
    start = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="peerwatch-fp-") as workdir:

            def do(index: int) -> Run:
                run = one_run(index, random.Random(seed * 100003 + index), Path(workdir), deadline)
                with lock:
                    done.append(run)
                    if progress and (len(done) % 25 == 0 or run.teardown or run.stuck or run.error):
                        bad = sum(r.teardown or r.stuck or bool(r.error) for r in done)
                        print(f"  {len(done)}/{runs} runs, {bad} bad, {time.monotonic() - start:.0f} s",
                              file=sys.stderr, flush=True)
                return run

            with ThreadPoolExecutor(max_workers=parallel) as pool:
                list(pool.map(do, range(runs)))
    finally:
        for p in burning:  # by pid, through the Popen object: only what we started
            p.kill()
            p.wait()
    return Result(sorted(done, key=lambda r: r.index), time.monotonic() - start, parallel, burners, seed)


def table(result: Result) -> str:
    runs = result.runs
    per_run = statistics.median(r.seconds for r in runs) if runs else 0.0
    styles = {s: sum(r.style == s for r in runs) for s in ("lightning", "sibling")}
    apis = {a: sum(r.api == a for r in runs) for a in ("install", "watch", "both")}
    lines = [
        "| clean runs | ranks each | teardowns | stuck | never ready | wall time | per run (median) |",
        "|---|---|---|---|---|---|---|",
        f"| {len(runs)} | {WORLD} | **{result.teardowns}** | {result.stuck} | {result.errors} | "
        f"{result.wall_s:.0f} s | {per_run:.2f} s |",
        "",
        f"{result.parallel} jobs at once, {result.burners} CPU burners, seed {result.seed}; "
        f"styles {styles}; APIs {apis}; {sum(r.sync for r in runs)} runs with --sync; "
        f"each rank works {WORK_S[0]}-{WORK_S[1]} s (random sleeps and CPU bursts) then finishes cleanly; "
        f"{os.cpu_count()} CPUs.",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--parallel", type=int, default=2, help="jobs at once")
    parser.add_argument("--burners", type=int, default=None, help="CPU burner processes (default: one per CPU)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--deadline", type=float, default=30.0, help="seconds for a job to end once ready")
    args = parser.parse_args()
    result = benchmark(args.runs, args.parallel, args.burners, args.seed, args.deadline, progress=True)
    print(table(result))
    for run in result.runs:
        if run.teardown or run.stuck or run.error:
            print(f"\n### run {run.index} ({run.style}, {run.api}, sync={run.sync}): codes {run.codes}, "
                  f"verdict={run.verdict}, stuck={run.stuck} {run.error}\n```\n{run.logs}\n```")
    return 0 if result.teardowns == 0 and result.stuck == 0 and result.errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
