"""A stuck rank named fast, a busy one never called a hang (issue 34): both sides, counted.

    .venv/bin/python benchmarks/detection.py                      # 20 trials a kind, 4 busy loops, 30 min balanced
    .venv/bin/python benchmarks/detection.py --trials 5 --load 4 --busy-seconds 70 --balanced-minutes 5
    .venv/bin/python benchmarks/detection.py --only stuck --kinds deadlock,sigstop --trials 3

Every job runs with ``PEERWATCH_HANG_TIMEOUT=auto`` and nothing else configured
(``hang_warn`` learnt: the default), beside ``--load`` busy loops.

1. **Stuck** (``--only stuck``). 3 gloo ranks of tests/collective_program.py (all_reduce,
   20 ms of "compute", never ``beat()``, gloo timeout 30 minutes: gloo never ends them);
   rank 1, at step 20, does one of: ``deadlock`` (blocks on a lock it holds), ``sigstop``
   (stops itself), ``dstate`` (its main thread in uninterruptible sleep for good: a
   posix_spawn whose child blocks opening a FIFO; no root needed), ``skipped`` (skips one
   all_reduce, reaches the final barrier while the others wait in their last all_reduce).
   From the onset (the ``doing-1`` marker, written right before) to the diagnosis
   (``events/diagnosis.json``'s time) and to the last process gone. A trial is right if
   the finding is ``hang`` (``mismatch`` for ``skipped``) naming rank 1, the verdict names
   rank 1, and ranks 0 and 2 exit 124 (rank 1 too, or it is killed by the teardown). A whole host behind is not run here (it needs root
   and simulated hosts: benchmarks/hang_hosts.py).
2. **Busy** (``--only busy``). The false-alarm side: 2 gloo ranks of benchmarks/_harm_rank.py,
   rank 0 alone works ``--busy-seconds`` in one way (one torch op, an nn.Linear loop, pure
   Python, one GIL-free C call, a trickle read, a computing child, a checkpoint, GC) while
   rank 1 waits in all_reduce; and 3 ranks all in the same place for 20 s (``everyone:sleep``:
   evaluation on every rank, no sign of work anywhere; ``everyone:checkpoint``: each writes,
   then the collective). Counted: ``hang``/``mismatch`` lines (must be 0), false teardowns
   (a verdict, or a rank not exiting 0: must be 0), and ``busy`` lines (allowed).
3. **Balanced** (``--only balanced``): 3 gloo ranks in an all_reduce loop (50 ms steps) for
   ``--balanced-minutes``; the same counts.

Prints markdown tables; exit status 0 if every stuck trial was right and no false alarm.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import do_no_harm  # noqa: E402
from _common import ROOT, become_subreaper, clean_env, free_port, load1, machine, peerwatch_commit, quantile, table  # noqa: E402

PROGRAM = ROOT / "tests" / "collective_program.py"
AT_STEP = 20
START_S = 180.0  # three ranks importing torch on 2 loaded cores
STUCK_KINDS = {"deadlock": "lock", "sigstop": "stop", "dstate": "dstate", "skipped": "skip"}
ENV = {"PEERWATCH_HANG_TIMEOUT": "auto"}  # and nothing else: hang_warn learnt, the default
BURNER = "while True: pass"
SAID = ("peerwatch: hang:", "peerwatch: mismatch:")


def _json(path: Path) -> Dict:
    with contextlib.suppress(OSError, ValueError):
        return dict(json.loads(path.read_text()))
    return {}


def _lines(folder: Path, text: str) -> int:
    n = 0
    for path in folder.rglob("*.log"):
        with contextlib.suppress(OSError):
            n += sum(text in line for line in path.read_text(errors="replace").splitlines())
    for path in folder.rglob("log-*"):
        with contextlib.suppress(OSError):
            n += sum(text in line for line in path.read_text(errors="replace").splitlines())
    return n


def collective_job(tmp: Path, world: int, behave: Sequence[str], steps: int, step_s: float,
                   limit_s: float) -> Tuple[Dict[int, Optional[int]], float]:
    """Run tests/collective_program.py; the ranks' exit codes (None: killed at ``limit_s``
    after the start) and when the last one ended (time.time_ns)."""
    run, ready = tmp / "run", tmp / "ready"
    ready.mkdir()
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = clean_env(PEERWATCH_DIR=str(run), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PYTHONPATH=str(ROOT),
                        **ENV)
        argv = [sys.executable, str(PROGRAM), "--world", str(world), "--ready", str(ready), "--timeout", "1800",
                "--steps", str(steps), "--step-s", str(step_s)]
        for b in behave:
            argv += ["--behave", b]
        with open(tmp / f"rank-{rank}.log", "wb") as log:
            procs.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + limit_s
    codes: Dict[int, Optional[int]] = {}
    try:
        for rank, p in enumerate(procs):
            try:
                codes[rank] = p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[rank] = None
    finally:
        end_ns = time.time_ns()
        for fifo in ready.glob("fifo-*"):  # dstate: let the child blocked opening it go
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return codes, end_ns


def stuck_trial(kind: str, tmp: Path) -> Dict:
    behaviour = STUCK_KINDS[kind]
    # skipped: the stall comes when rank 1 reaches the final barrier, the step after the skip
    steps = AT_STEP + 2 if kind == "skipped" else 0
    codes, end_ns = collective_job(tmp, 3, [f"1={behaviour}@{AT_STEP}"], steps, 0.02, START_S + 120.0)
    diag, verdict = _json(tmp / "run" / "events" / "diagnosis.json"), _json(tmp / "run" / "events" / "verdict.json")
    try:
        onset = (tmp / "ready" / "doing-1").stat().st_mtime_ns
    except OSError:
        onset = None
    want = "mismatch" if kind == "skipped" else "hang"
    # The others exit 124; the laggard too, or it is killed by the teardown (stopped, in D).
    right = (diag.get("finding") == want and diag.get("laggards") == [1] and verdict.get("rank") == 1
             and codes.get(0) == codes.get(2) == 124 and codes.get(1) in (124, -15, -9))
    return {
        "named_s": (diag["time_ns"] - onset) / 1e9 if diag and onset else None,
        "ended_s": (end_ns - onset) / 1e9 if onset and all(c is not None for c in codes.values()) else None,
        "finding": diag.get("finding", "-"), "right": right, "codes": codes,
        "detail": diag.get("detail", ""), "logs": do_no_harm._logs(tmp) if not right else "",
    }


def _stats(values: List[Optional[float]]) -> str:
    got = sorted(v for v in values if v is not None)
    if not got:
        return "-"
    missing = f" ({len(values) - len(got)} missing)" if len(got) < len(values) else ""
    return f"{quantile(got, 0.5):.1f} / {quantile(got, 0.9):.1f} / {got[-1]:.1f}{missing}"


def run_stuck(kinds: List[str], trials: int, show_logs: bool) -> bool:
    rows, ok, said = [], True, {}
    for kind in kinds:
        results, loads = [], []
        for _ in range(trials):
            with tempfile.TemporaryDirectory(prefix="pw-detect-") as tmp:
                results.append(stuck_trial(kind, Path(tmp)))
            loads.append(load1())
            r = results[-1]
            print(f"{kind}: {r['finding']} named {r['named_s']} ended {r['ended_s']} codes {r['codes']}",
                  file=sys.stderr, flush=True)
            if not r["right"] and show_logs:
                print(r["logs"], file=sys.stderr)
        right = sum(r["right"] for r in results)
        ok = ok and right == len(results)
        said[kind] = next((r["detail"] for r in results if r["detail"]), "")
        rows.append([kind, str(len(results)), str(right), ", ".join(sorted({r["finding"] for r in results})),
                     _stats([r["named_s"] for r in results]), _stats([r["ended_s"] for r in results]),
                     f"{max(loads):.1f}"])
    print("Stuck: rank 1 of 3 from step 20; hang_timeout=auto, nothing else set; seconds from the onset\n")
    print(table(["kind", "trials", "right", "finding", "named p50 / p90 / max", "all ended p50 / p90 / max", "load1"],
                rows))
    print()
    for kind, detail in said.items():
        print(f"- {kind}: {detail}")
    print()
    return ok


def busy_trial(kind: str, seconds: float, tmp: Path) -> Dict:
    if kind.startswith("everyone:"):
        what = kind.partition(":")[2]
        codes, _ = collective_job(tmp, 3, [f"{r}={what}:{seconds:g}@{AT_STEP}" for r in range(3)], 2 * AT_STEP, 0.02,
                                  START_S + seconds + 120.0)
        verdict = do_no_harm._verdict(tmp / "run")
    else:
        trial = do_no_harm.Trial(kind)
        job = do_no_harm.Job(tmp, 2, kind, seconds, ENV)
        try:
            job.finish(trial, timeout=START_S + seconds + 120.0)
        finally:
            for p in job.procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        codes, verdict = trial.codes, trial.verdict
    return {"codes": codes, "verdict": verdict, "false_teardown": bool(verdict) or any(c != 0 for c in codes.values()),
            "hang_lines": sum(_lines(tmp, s) for s in SAID), "busy_lines": _lines(tmp, "peerwatch: busy:"),
            "logs": do_no_harm._logs(tmp)}


def run_false_alarms(names: List[str], trials: int, seconds: float, show_logs: bool, title: str) -> bool:
    rows, ok = [], True
    for name in names:
        results, loads = [], []
        for _ in range(trials):
            with tempfile.TemporaryDirectory(prefix="pw-detect-") as tmp:
                if name == "balanced":
                    start = time.monotonic()
                    steps = int(seconds * 60 / 0.06)
                    codes, _ = collective_job(Path(tmp), 3, [], steps, 0.05, START_S + 3 * seconds * 60 + 120.0)
                    v = do_no_harm._verdict(Path(tmp) / "run")
                    r = {"codes": codes, "verdict": v, "false_teardown": bool(v) or any(c != 0 for c in codes.values()),
                         "hang_lines": sum(_lines(Path(tmp), s) for s in SAID),
                         "busy_lines": _lines(Path(tmp), "peerwatch: busy:"), "logs": do_no_harm._logs(Path(tmp)),
                         "minutes": (time.monotonic() - start) / 60}
                else:
                    r = busy_trial(name, seconds, Path(tmp))
            results.append(r)
            loads.append(load1())
            print(f"{name}: codes {r['codes']} hang lines {r['hang_lines']} busy lines {r['busy_lines']}",
                  file=sys.stderr, flush=True)
            if (r["false_teardown"] or r["hang_lines"]) and show_logs:
                print(r["logs"], file=sys.stderr)
        bad = sum(r["false_teardown"] for r in results)
        hangs = sum(r["hang_lines"] for r in results)
        ok = ok and not bad and not hangs
        what = f"{max(r.get('minutes', 0) for r in results):.1f} min" if name == "balanced" else f"{seconds:g} s"
        rows.append([name, what, str(len(results)), str(hangs), str(bad), str(sum(r["busy_lines"] for r in results)),
                     ", ".join(sorted({str(c) for r in results for c in r["codes"].values()})), f"{max(loads):.1f}"])
    print(title + "\n")
    print(table(["scenario", "for", "trials", "hang lines", "false teardowns", "busy lines", "exit codes", "load1"], rows))
    print()
    return ok


BUSY = [f"busy:{k}" for k in do_no_harm.BUSY_KINDS] + ["everyone:sleep", "everyone:checkpoint"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20, help="stuck trials per kind")
    parser.add_argument("--busy-trials", type=int, default=1)
    parser.add_argument("--load", type=int, default=4, help="busy loops beside every job")
    parser.add_argument("--busy-seconds", type=float, default=70.0)
    parser.add_argument("--balanced-minutes", type=float, default=30.0)
    parser.add_argument("--only", choices=["stuck", "busy", "balanced"])
    parser.add_argument("--kinds", default="", help="comma-separated stuck kinds or busy scenarios")
    parser.add_argument("--logs", action="store_true", help="print the logs of every wrong trial")
    args = parser.parse_args()
    become_subreaper()
    m = machine()
    print(f"peerwatch {peerwatch_commit()}, {m['nproc']} CPUs, torch {m.get('torch', '?')}, "
          f"{datetime.datetime.now():%Y-%m-%d %H:%M}, "
          f"{args.load} busy loops beside\n")
    chosen = [k for k in args.kinds.split(",") if k]
    burners = [subprocess.Popen([sys.executable, "-c", BURNER]) for _ in range(args.load)]
    ok = True
    try:
        if args.only in (None, "stuck"):
            kinds = [k for k in chosen if k in STUCK_KINDS] or list(STUCK_KINDS)
            ok = run_stuck(kinds, args.trials, args.logs) and ok
        if args.only in (None, "busy"):
            names = [k for k in chosen if k in BUSY] or BUSY
            ok = run_false_alarms(names, args.busy_trials, args.busy_seconds, args.logs,
                                  "Busy (false-alarm side): hang_timeout=auto, nothing else set") and ok
        if args.only in (None, "balanced"):
            ok = run_false_alarms(["balanced"], 1, args.balanced_minutes, args.logs,
                                  "Balanced: 3 gloo ranks, 50 ms steps, hang_timeout=auto, nothing else set") and ok
    finally:
        for b in burners:
            b.kill()
            b.wait()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
