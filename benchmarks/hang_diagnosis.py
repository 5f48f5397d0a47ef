"""Hangs found without configuration: how fast, and at what cost.

    .venv/bin/python benchmarks/hang_diagnosis.py --runs 2 --gloo-timeout 20
    .venv/bin/python benchmarks/hang_diagnosis.py --only cost
    .venv/bin/python benchmarks/hang_diagnosis.py --only cases --gloo-timeout 60
    .venv/bin/python benchmarks/hang_diagnosis.py --only hosts --runs 1     (root; benchmarks/hang_hosts.py)

1. **Detection.** A 3-rank gloo job (tests/collective_program.py: all_reduce, 20 ms of
   "compute", never ``beat()``) whose rank 1 starts an endless Python loop at step 40.
   From the onset (the ``doing-1`` marker, written right before the loop) to the
   diagnosis (events/diagnosis.json), to the verdict, and to the last process gone;
   with ``hang_warn`` 3 s (the job then dies of gloo's timeout, blamed on rank 1),
   ``hang_timeout=auto`` (the learnt threshold ends it), and peerwatch's diagnosis off
   (gloo's timeout alone: the verdict names a victim).
2. **Cases.** The same job under ``hang_timeout=auto`` and nothing else configured, rank 1
   doing one of: an endless Python loop, a deadlock (a lock it holds), SIGSTOP (frozen),
   or a checkpoint that outlasts the collective timeout (busy: CPU and bytes written).
   Stuck ranks are ended at the diagnosis; the busy one at 90 % of the collective timeout.
3. **Hosts** (``--only hosts``, not in the default run: it needs root). The same four cases
   across two simulated hosts, both ranks of host B the laggards: benchmarks/hang_hosts.py.
4. **Cost.** In a 2-rank gloo job with the flight recorder's ring full (2500
   collectives): one read of the counters (what each watcher does per heartbeat), one
   read of the entries (once per stall), and the step time of a training loop (all_reduce
   of 1000 floats) with the counter reads on and off (``hang_warn`` auto vs off), alternated.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PROGRAM = os.path.join(ROOT, "tests", "collective_program.py")
sys.path.insert(0, HERE)
from _common import clean_env, free_port, machine, peerwatch_commit, table  # noqa: E402

WORLD = 3
AT_STEP = 40
START_TIMEOUT_S = 90.0


def read_json(path: str) -> Dict:
    try:
        with open(path) as f:
            return dict(json.load(f))
    except (OSError, ValueError):
        return {}


def detection(env_extra: Dict[str, str], gloo_timeout: float, workdir: str,
              behaviour: str = "loop") -> Dict[str, Optional[float]]:
    run, ready = os.path.join(workdir, "run"), os.path.join(workdir, "ready")
    os.makedirs(ready)
    port = str(free_port())
    procs = []
    for rank in range(WORLD):
        env = clean_env(PEERWATCH_DIR=run, RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PYTHONPATH=ROOT, **env_extra)
        with open(os.path.join(workdir, f"rank-{rank}.log"), "wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, PROGRAM, "--world", str(WORLD), "--ready", ready, "--timeout", str(gloo_timeout),
                 "--behave", f"1={behaviour}@{AT_STEP}"], env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + START_TIMEOUT_S + 3 * gloo_timeout
    try:
        for p in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    end_ns = time.time_ns()
    onset = os.stat(os.path.join(ready, "doing-1")).st_mtime_ns
    diag = read_json(os.path.join(run, "events", "diagnosis.json"))
    verdict = read_json(os.path.join(run, "events", "verdict.json"))
    return {
        "diagnosis_s": (diag["time_ns"] - onset) / 1e9 if diag else None,
        "verdict_s": (verdict["detected_at_ns"] - onset) / 1e9 if verdict else None,
        "end_s": (end_ns - onset) / 1e9,
        "blamed": verdict.get("rank"), "cause": verdict.get("cause"),
        "finding": diag.get("finding"), "detail": diag.get("detail"),
    }


COST_RANK = r"""
import datetime, os, sys, time
sys.path.insert(0, sys.argv[1])
import peerwatch
peerwatch.install()
import torch, torch.distributed as dist
from peerwatch.hangs.collectives import CollectiveReader
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
t = torch.ones(1000)
for _ in range(2500):
    dist.all_reduce(t)
dist.barrier()
out = {}
if rank == 0:
    r = CollectiveReader(0)
    r.counters()
    n = 2000
    t0 = time.perf_counter_ns()
    for _ in range(n):
        c = r.counters()
    out["counters_us"] = (time.perf_counter_ns() - t0) / n / 1e3
    t0 = time.perf_counter_ns()
    for _ in range(10):
        r.entered(c, 3)
    out["entries_ms"] = (time.perf_counter_ns() - t0) / 10 / 1e6
dist.barrier()
steps = int(sys.argv[2])
t0 = time.perf_counter_ns()
for _ in range(steps):
    dist.all_reduce(t)
    time.sleep(0.001)
out["step_ms"] = (time.perf_counter_ns() - t0) / steps / 1e6
dist.barrier()
if rank == 0:
    print("RESULT", __import__("json").dumps(out), flush=True)
dist.destroy_process_group()
"""


def cost(warn: str, steps: int, workdir: str) -> Dict[str, float]:
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = clean_env(PEERWATCH_DIR=os.path.join(workdir, f"run-{warn}"), RANK=str(rank), WORLD_SIZE="2",
                        LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PEERWATCH_HANG_WARN=warn)
        procs.append(subprocess.Popen([sys.executable, "-c", COST_RANK, ROOT, str(steps)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for line in outs[0].splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[7:]))
    raise RuntimeError(outs[0][-3000:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--gloo-timeout", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--only", choices=["detection", "cases", "hosts", "cost"])
    args = parser.parse_args()
    print(f"peerwatch {peerwatch_commit()}, {machine()}, {datetime.datetime.now():%Y-%m-%d %H:%M}\n")
    if args.only == "hosts":
        import hang_hosts

        hang_hosts.run(args.runs)
        return
    if args.only in (None, "detection"):
        modes = [
            ("hang_warn=3 (warns; gloo's timeout ends the job)", {"PEERWATCH_HANG_WARN": "3"}),
            ("hang_timeout=auto (learnt threshold)", {"PEERWATCH_HANG_TIMEOUT": "auto"}),
            ("diagnosis off (gloo's timeout alone)", {"PEERWATCH_HANG_WARN": "off"}),
        ]
        rows = []
        for name, env in modes:
            for _ in range(args.runs):
                with tempfile.TemporaryDirectory() as tmp:
                    r = detection(env, args.gloo_timeout, tmp)
                fmt = lambda v: "-" if v is None else f"{v:.1f} s"  # noqa: E731
                rows.append([name, fmt(r["diagnosis_s"]), fmt(r["verdict_s"]), fmt(r["end_s"]),
                             f"rank {r['blamed']} ({r['cause']})"])
        print(f"Detection: rank 1 loops in Python from step {AT_STEP}; gloo timeout {args.gloo_timeout:g} s; "
              "times from the onset\n")
        print(table(["mode", "diagnosis", "verdict", "job ended", "verdict names"], rows))
        print()
    if args.only in (None, "cases"):
        cases(args.runs, args.gloo_timeout)
    if args.only in (None, "cost"):
        results: Dict[str, List[Dict[str, float]]] = {"auto": [], "off": []}
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(args.runs):
                for warn in ("auto", "off"):
                    results[warn].append(cost(warn, args.steps, tmp))
        reads = [r["counters_us"] for r in results["auto"] + results["off"]]
        entries = [r["entries_ms"] for r in results["auto"] + results["off"]]
        print("Cost (2 ranks, gloo, the flight recorder's ring full)\n")
        print(table(["what", "median", "runs"], [
            ["counters, one read (per heartbeat)", f"{statistics.median(reads):.1f} µs", str(len(reads))],
            ["entries, one read (once per stall)", f"{statistics.median(entries):.1f} ms", str(len(entries))],
            ["step time, hang_warn=auto (counters read, judges diagnose)", steps(results["auto"]),
             str(len(results["auto"]))],
            ["step time, hang_warn=off (no reads)", steps(results["off"]), str(len(results["off"]))],
        ]))
        print("\nstep times per run (auto, off alternated):",
              ", ".join(f"{a['step_ms']:.3f}/{o['step_ms']:.3f}" for a, o in zip(results["auto"], results["off"])))


CASES = [
    ("a Python loop", "loop"),
    ("a deadlock (a lock it holds)", "lock"),
    ("frozen (SIGSTOP)", "stop"),
    ("busy: a checkpoint longer than the timeout", "checkpoint:600"),
]


def cases(runs: int, gloo_timeout: float) -> None:
    rows, said = [], {}
    for name, behaviour in CASES:
        for _ in range(runs):
            with tempfile.TemporaryDirectory() as tmp:
                r = detection({"PEERWATCH_HANG_TIMEOUT": "auto"}, gloo_timeout, tmp, behaviour)
            fmt = lambda v: "-" if v is None else f"{v:.1f} s"  # noqa: E731
            rows.append([name, str(r["finding"]), fmt(r["diagnosis_s"]), fmt(r["verdict_s"]), fmt(r["end_s"]),
                         f"rank {r['blamed']} ({r['cause']})"])
            said[name] = r["detail"]
    print(f"Cases: rank 1 from step {AT_STEP}; hang_timeout=auto, nothing else set; gloo timeout {gloo_timeout:g} s; "
          "times from the onset\n")
    print(table(["case", "finding", "diagnosis", "verdict", "all gone", "verdict names"], rows))
    print()
    for name, detail in said.items():
        print(f"{name}: {detail}")
    print()


def steps(runs: List[Dict[str, float]]) -> str:
    values = [r["step_ms"] for r in runs]
    return f"{statistics.median(values):.3f} ms ({min(values):.3f}-{max(values):.3f})"


if __name__ == "__main__":
    main()
