"""Death-to-verdict and death-to-all-gone latency of peerwatch on one host.

    .venv/bin/python benchmarks/teardown_latency.py --ranks 4 --trials 20

Starts N real ranks (tests/rank_program.py, sleeping in Python with peerwatch.install()),
SIGKILLs one, and measures with pidfds: from the kill to the verdict (the verdict's
``detected_at_ns``) and to the last process of the job gone. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RANK_PROGRAM = os.path.join(HERE, "..", "tests", "rank_program.py")


def trial(ranks: int, style: str, victim: int, workdir: str) -> tuple:
    run_dir = os.path.join(workdir, "run")
    ready = os.path.join(workdir, "ready")
    os.makedirs(ready)
    env = dict(os.environ, PEERWATCH_DIR=run_dir, PEERWATCH_GRACE="2", WORLD_SIZE=str(ranks))
    cmd = [sys.executable, RANK_PROGRAM, "--world", str(ranks), "--style", style, "--ready", ready]
    procs = []
    starts = [0] if style == "lightning" else range(ranks)
    for r in starts:
        # A session of its own: a trial that fails ends every rank it started (Lightning-style
        # ranks are rank 0's children), not leaving them to hold the user's inotify instances.
        procs.append(subprocess.Popen(cmd, env=dict(env, RANK=str(r)), stderr=subprocess.DEVNULL, start_new_session=True))
    deadline = time.monotonic() + 60
    while sum(os.path.exists(os.path.join(ready, f"rank-{r}")) for r in range(ranks)) < ranks:
        if time.monotonic() > deadline:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            raise RuntimeError("ranks did not start")
        time.sleep(0.01)
    pids = {}
    for r in range(ranks):
        with open(os.path.join(ready, f"rank-{r}")) as f:
            pids[r] = int(f.read())
    fds = {os.pidfd_open(pid): pid for pid in pids.values()}
    time.sleep(0.2)  # let every watcher finish its first scan of the run directory
    killed_ns = time.time_ns()
    os.kill(pids[victim], signal.SIGKILL)
    while fds:
        ready_fds, _, _ = select.select(list(fds), [], [], 30)
        if not ready_fds:
            raise RuntimeError("job did not end")
        for fd in ready_fds:
            os.close(fd)
            del fds[fd]
    gone_ns = time.time_ns()
    for p in procs:
        p.wait(timeout=30)
    with open(os.path.join(run_dir, "events", "verdict.json")) as f:
        verdict = json.load(f)
    return (verdict["detected_at_ns"] - killed_ns) / 1e6, (gone_ns - killed_ns) / 1e6, verdict["exit_code"]


def quantiles(values: list) -> str:
    values = sorted(values)
    p90 = values[int(0.9 * (len(values) - 1))]
    return f"{statistics.median(values):.1f} | {p90:.1f} | {values[-1]:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--styles", default="sibling,lightning")
    args = parser.parse_args()
    print("| style | victim | N | trials | verdict ms (median / p90 / max) | all gone ms (median / p90 / max) | exit codes |")
    print("|---|---|---|---|---|---|---|")
    for style in args.styles.split(","):
        for victim in (0, args.ranks // 2, args.ranks - 1):
            verdicts, gones, codes = [], [], set()
            for _ in range(args.trials):
                with tempfile.TemporaryDirectory() as d:
                    v, g, c = trial(args.ranks, style, victim, d)
                verdicts.append(v)
                gones.append(g)
                codes.add(c)
            print(f"| {style} | {victim} | {args.ranks} | {args.trials} | {quantiles(verdicts)} | {quantiles(gones)} | {sorted(codes)} |",
                  flush=True)


if __name__ == "__main__":
    main()
