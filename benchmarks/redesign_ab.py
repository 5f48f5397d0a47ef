"""Before/after figures for a change to the watcher, with the same benchmark code: death to
verdict and all gone at N = 8, all gone at N = 128 (a rank SIGKILLed, Lightning-style
ranks, sleeping), and idle CPU per rank-hour at N = 8, beside the floors of overhead.py.

    .venv/bin/python benchmarks/redesign_ab.py --lib /path/to/checkout-A --lib /path/to/checkout-B \\
        [--rounds 2] [--trials 10] [--large-trials 3] [--idle-seconds 30] [--heartbeat S]

Each ``--lib`` is a checkout whose ``peerwatch`` package the ranks import (through
PYTHONPATH); the rounds alternate A, B, A, B... so that load drifts hit both alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import latency  # noqa: E402
import overhead  # noqa: E402
from _common import become_subreaper, load1  # noqa: E402


def _quiet(_: str) -> None:
    pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lib", action="append", required=True, help="a checkout whose peerwatch the ranks import")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--trials", type=int, default=10, help="trials per round at N = 8")
    p.add_argument("--large-trials", type=int, default=3, help="trials per round at N = 128")
    p.add_argument("--idle-seconds", type=float, default=30.0)
    p.add_argument("--heartbeat", type=float, help="idle: the watchers' heartbeat (s) instead of 1 s, and the "
                   "CPU per beat (a short one: what a beat costs when its wakes are warm)")
    p.add_argument("--only", default="latency,idle", help="what to measure: latency, idle (comma-separated)")
    args = p.parse_args()
    become_subreaper()
    results: Dict[str, Dict[str, List[float]]] = {lib: {} for lib in args.lib}
    for rnd in range(args.rounds):
        for lib in args.lib:
            os.environ["PYTHONPATH"] = os.path.abspath(lib)
            r = results[lib]
            if "latency" in args.only:
                for t in latency.peerwatch_light(8, 4, args.trials, _quiet):
                    r.setdefault("N=8 death to verdict, ms", []).append(t.detected_ms or float("nan"))
                    r.setdefault("N=8 all gone, ms", []).append(t.gone_ms or float("nan"))
                for t in latency.peerwatch_light(128, 64, args.large_trials, _quiet):
                    r.setdefault("N=128 all gone, ms", []).append(t.gone_ms or float("nan"))
            if "idle" in args.only:
                seen = set()
                for idle in overhead.idle_cpu([8], args.idle_seconds, _quiet, args.heartbeat):
                    name = f"N=8 idle, CPU s/rank/hour, {idle.what}"
                    if name in seen:  # the second peerwatch row (its run directory on tmpfs)
                        continue
                    seen.add(name)
                    r.setdefault(name, []).append(idle.watcher_s_per_h)
                    if args.heartbeat is not None:
                        per_beat_us = idle.watcher_s_per_h / 3600 * args.heartbeat * 1e6
                        r.setdefault(f"N=8 idle, CPU µs per beat (heartbeat {args.heartbeat:g} s)", []).append(per_beat_us)
            figures = ", ".join(f"{m}: {statistics.median(xs):.2f}" for m, xs in r.items())
            print(f"round {rnd + 1} {lib}: load {load1():.1f}; medians so far: {figures}", file=sys.stderr, flush=True)
    metrics = list(next(iter(results.values())))
    print("| figure | " + " | ".join(args.lib) + " |")
    print("|---|" + "---|" * len(args.lib))
    for m in metrics:
        cells = []
        for lib in args.lib:
            xs = sorted(results[lib][m])
            cells.append(f"median {statistics.median(xs):.2f} (min {xs[0]:.2f}, max {xs[-1]:.2f}, n={len(xs)})")
        print(f"| {m} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
