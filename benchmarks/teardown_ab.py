"""A teardown, two checkouts, one run: N sibling ranks without torch (each only
``peerwatch.install()``, then sleeps), one SIGKILLed at random, the time until every rank
is gone. The runs alternate the checkouts (A, B, A, B...) so that load drifts hit both.

    .venv/bin/python benchmarks/teardown_ab.py --lib . --lib /tmp/before      # 3 runs each, 15 trials a run
    .venv/bin/python benchmarks/teardown_ab.py --lib . --lib /tmp/before --runs 45 --trials 1   # alternate every trial
    .venv/bin/python benchmarks/teardown_ab.py --lib . --lib /tmp/before --runs 1 --trials 5 --ranks 4

Each ``--lib`` is a checkout: its ranks are its own ``tests/rank_program.py`` with its
``peerwatch`` on PYTHONPATH. Times are taken here, with pidfds: from the kill to the last
rank gone, to the first survivor gone (and to the verdict, from the verdict record's own time, where the checkout
writes one). Prints one row per run and one per checkout over all its runs, with the
1-minute load beside each run (the figures mean little above ~4 on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import become_subreaper, load1, table  # noqa: E402

START_S = 60.0
GONE_S = 30.0


def _commit(lib: Path) -> str:
    out = subprocess.run(["git", "-C", str(lib), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or str(lib)


def trial(lib: Path, ranks: int, victim: int, workdir: Path, settle_s: float = 0.2) -> Tuple[float, float, Optional[float]]:
    """One job of ``ranks`` siblings; returns ms from the kill to the last rank gone, to the
    first survivor gone, and to the verdict."""
    run_dir, ready = workdir / "run", workdir / "ready"
    ready.mkdir()
    env = dict(os.environ, PEERWATCH_DIR=str(run_dir), PEERWATCH_GRACE="2", WORLD_SIZE=str(ranks),
               PYTHONPATH=str(lib))
    cmd = [sys.executable, str(lib / "tests" / "rank_program.py"), "--world", str(ranks), "--style", "sibling",
           "--ready", str(ready)]
    # A session of its own per rank: a trial that fails ends every rank it started.
    procs = [subprocess.Popen(cmd, env=dict(env, RANK=str(r)), stderr=subprocess.DEVNULL, start_new_session=True)
             for r in range(ranks)]
    try:
        deadline = time.monotonic() + START_S
        while sum((ready / f"rank-{r}").exists() for r in range(ranks)) < ranks:
            if time.monotonic() > deadline:
                raise RuntimeError("ranks did not start")
            time.sleep(0.01)  # polling the ready files, deadline-bounded
        pids = {r: int((ready / f"rank-{r}").read_text()) for r in range(ranks)}
        fds = [os.pidfd_open(pid) for r, pid in pids.items() if r != victim]
        first_ms = 0.0
        time.sleep(settle_s)  # every watcher past its first scan of the run directory
        killed_ns = time.time_ns()
        os.kill(pids[victim], signal.SIGKILL)
        while fds:
            ready_fds, _, _ = select.select(fds, [], [], GONE_S)
            if not ready_fds:
                raise RuntimeError("the job did not end")
            if not first_ms:
                first_ms = (time.time_ns() - killed_ns) / 1e6
            for fd in ready_fds:
                os.close(fd)
                fds.remove(fd)
        gone_ms = (time.time_ns() - killed_ns) / 1e6
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    verdict_ms = None
    try:
        verdict = json.loads((run_dir / "events" / "verdict.json").read_text())
        verdict_ms = (verdict["detected_at_ns"] - killed_ns) / 1e6
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return gone_ms, first_ms, verdict_ms


def _fmt(values: List[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lib", action="append", required=True, type=Path, help="a checkout (its peerwatch and tests/)")
    p.add_argument("--runs", type=int, default=3, help="runs per checkout, alternated")
    p.add_argument("--trials", type=int, default=15, help="trials per run")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--settle", type=float, default=0.2, help="seconds from every rank ready to the kill")
    a = p.parse_args()
    become_subreaper()
    libs = [lib.resolve() for lib in a.lib]
    names = {lib: _commit(lib) for lib in libs}
    rnd = random.Random(a.seed)
    rows: List[List[str]] = []
    every: Dict[Path, Tuple[List[float], List[float], List[float]]] = {lib: ([], [], []) for lib in libs}
    for run in range(a.runs):
        for lib in libs:
            gones: List[float] = []
            firsts: List[float] = []
            verdicts: List[float] = []
            load = load1()
            for _ in range(a.trials):
                with tempfile.TemporaryDirectory() as d:
                    gone, first, verdict = trial(lib, a.ranks, rnd.randrange(a.ranks), Path(d), a.settle)
                gones.append(gone)
                firsts.append(first)
                if verdict is not None:
                    verdicts.append(verdict)
            every[lib][0].extend(gones)
            every[lib][1].extend(verdicts)
            every[lib][2].extend(firsts)
            if a.runs <= 6:  # more runs are for alternating trial by trial: the totals say it
                rows.append([names[lib], str(run + 1), f"{load:.1f}", _fmt(verdicts), _fmt(firsts), _fmt(gones)])
            if a.runs <= 6:
                print(f"run {run + 1} {names[lib]}: all gone {_fmt(gones)} ms (load {load:.1f})", file=sys.stderr, flush=True)
    for lib in libs:
        rows.append([f"**{names[lib]}**", "all", "", _fmt(every[lib][1]), _fmt(every[lib][2]), _fmt(every[lib][0])])
    print(f"N = {a.ranks} sibling ranks (install(), sleeping), one SIGKILLed at random; "
          f"{a.trials} trials a run; ms, median (min-max)\n")
    print(table(["checkout", "run", "load (1 min)", "kill -> verdict", "kill -> first survivor gone", "kill -> all gone"], rows))


if __name__ == "__main__":
    main()
