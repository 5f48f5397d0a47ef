"""peerwatch's benchmarks, in one command: markdown tables on stdout and a PNG plot.

    .venv/bin/python benchmarks/run.py            # the full run (about 25 minutes on 2 cores)
    .venv/bin/python benchmarks/run.py --quick    # a smoke run (about 2 minutes)
    ./dev bench [args]                            # the same, after setting up .venv

1. Detection and teardown latency: a rank is SIGKILLed; time to detection and to the last
   process of the job gone, for peerwatch and side by side Lightning's _ChildProcessObserver,
   torchrun's elastic agent and no watcher at all (gloo, with a capped timeout).
2. The same when rank 0 (Lightning-style) or the torchrun agent is SIGKILLed.
3. Overhead: idle CPU per rank per hour; training step time with and without, A/B.
4. Startup: ``import peerwatch`` and ``install()``.
5. The targets, met or not.

See docs/performance.md for what each figure means and the results on the reference machine.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import latency  # noqa: E402
import overhead  # noqa: E402
import startup  # noqa: E402
from _common import ROOT, become_subreaper, fmt_ms, fmt_summary, load1, machine, summarize, table  # noqa: E402
from _template import Template  # noqa: E402
from latency import Point, Trial  # noqa: E402

TEMPLATE_MODULES = ["_ranks", "lightning.fabric.strategies.launchers.subprocess_script", "torch.distributed",
                    "peerwatch"]
PLOT = ROOT / "docs" / "performance.png"
QUIET_LOAD = 1.5  # 1-minute load average under which the machine counts as quiet


FULL = {  # the defaults; --quick changes those not given on the command line
    "trials": 30, "large_trials": 5, "fixed_trials": 3, "ranks": "2,8,32,128", "torchrun_ranks": "8",
    "gloo_ranks": "2,8", "idle_seconds": 40.0, "idle_ranks": "8,128", "ab_pairs": 10, "ab_seconds": 2.0,
    "import_runs": 30,
}
QUICK = {
    "trials": 3, "large_trials": 2, "fixed_trials": 1, "ranks": "2,8", "torchrun_ranks": "2", "gloo_ranks": "2",
    "idle_seconds": 5.0, "idle_ranks": "8", "ab_pairs": 2, "ab_seconds": 0.5, "import_runs": 5,
}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smoke run: few trials, small N (about 2 minutes)")
    p.add_argument("--trials", type=int, help="trials per point (default 30)")
    p.add_argument("--large-trials", type=int,
                   help="trials per point of peerwatch with N >= 64 (default 5: each takes about 25 s here, mostly 128 interpreters starting)")
    p.add_argument("--fixed-trials", type=int,
                   help="trials of points whose outcome nobody acts on: never, or the timeout (default 3)")
    p.add_argument("--ranks", help="N for Python ranks: peerwatch, Lightning's observer (default 2,8,32,128)")
    p.add_argument("--torchrun-ranks", help="N for torchrun (default 8)")
    p.add_argument("--gloo-ranks", help="N for torch (gloo) ranks (default 2,8)")
    p.add_argument("--cap", type=float, default=5.0,
                   help="seconds: the gloo timeout without a watcher, and how long to wait for orphans (default 5)")
    p.add_argument("--idle-seconds", type=float, help="idle CPU window, per N (default 40)")
    p.add_argument("--idle-ranks", help="N for idle CPU (default 8,128)")
    p.add_argument("--ab-pairs", type=int, help="A/B pairs of step-time blocks (default 10)")
    p.add_argument("--ab-seconds", type=float, help="about how long one block runs (default 2)")
    p.add_argument("--import-runs", type=int, help="fresh interpreters for the startup figures (default 30)")
    p.add_argument("--only", default="latency,rank0,overhead,startup",
                   help="sections to run, comma-separated: latency, rank0, overhead, startup")
    p.add_argument("--plot", help="PNG to write ('' for none; default docs/performance.png, "
                   "and benchmarks/results/quick.png with --quick)")
    p.add_argument("--markdown", default="", help="also write the tables to this file")
    p.add_argument("--wait-quiet", type=float, default=0.0,
                   help=f"minutes to wait for the 1-minute load average to fall under {QUIET_LOAD} (default 0)")
    p.add_argument("-v", "--verbose", action="store_true", help="print each trial")
    args = p.parse_args(argv)
    if args.plot is None:
        args.plot = str(ROOT / "benchmarks" / "results" / "quick.png") if args.quick else str(PLOT)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.ranks = [int(n) for n in args.ranks.split(",") if n]
    args.torchrun_ranks = [int(n) for n in args.torchrun_ranks.split(",") if n]
    args.gloo_ranks = [int(n) for n in args.gloo_ranks.split(",") if n]
    args.idle_ranks = [int(n) for n in args.idle_ranks.split(",") if n]
    args.only = set(args.only.split(","))
    return args


class Output:
    """Prints as it goes; keeps the markdown for --markdown."""

    def __init__(self) -> None:
        self.parts: List[str] = []

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        self.parts.append(text)

    def text(self) -> str:
        return "\n".join(self.parts) + "\n"


def log(verbose: bool) -> Callable[[str], None]:
    def progress(text: str) -> None:
        if verbose:
            print(f"  . {text}", file=sys.stderr, flush=True)
    return progress


# -- section 1 and 2 -----------------------------------------------------------------------------


def run_latency(args: argparse.Namespace, template: Template, rank0: bool,
                progress: Callable[[str], None]) -> List[Point]:
    pts: List[Point] = []
    cap = args.cap
    light = "Python, sleeping"
    gloo = "torch, gloo all_reduce"
    store = "torch, blocked in store.wait"

    def timed(label: str, f: Callable[..., List[Trial]], *f_args: object) -> List[Trial]:
        t = time.monotonic()
        trials = f(*f_args, progress)
        print(f"  {label}: {len(trials)} trials in {time.monotonic() - t:.0f} s", file=sys.stderr, flush=True)
        return trials

    def large(n: int) -> int:
        return args.trials if n < 64 else args.large_trials

    def torchrun_name(pw: bool) -> str:
        return "torchrun + peerwatch" if pw else "torchrun agent"

    def gloo_name(pw: bool) -> str:
        return "peerwatch" if pw else "no watcher"

    if not rank0:
        for n in args.ranks:
            pts.append(Point("peerwatch", light, f"rank {n // 2}", n, timed(
                f"peerwatch N={n}", latency.peerwatch_light, n, n // 2, large(n))))
        for n in args.ranks:
            pts.append(Point("Lightning _ChildProcessObserver", light, f"rank {n // 2}", n, timed(
                f"lightning N={n}", latency.lightning_observer, template, n, False, args.trials,
                latency.TEARDOWN_TIMEOUT_S)))
        for n in args.torchrun_ranks:
            for pw in (False, True):
                pts.append(Point(torchrun_name(pw), light, f"worker {n // 2}", n, timed(
                    f"torchrun N={n} pw={pw}", latency.torchrun_worker_deaths, n, pw, args.trials), note="restarts"))
        for n in args.gloo_ranks:
            for pw in (False, True):
                pts.append(Point(gloo_name(pw), gloo, f"rank {n // 2}", n, timed(
                    f"gloo N={n} pw={pw}", latency.gloo_job, template, n, n // 2, pw, "allreduce", args.trials, cap),
                    cap_s=None if pw else cap))
        n = max(args.gloo_ranks)
        for pw in (False, True):
            pts.append(Point(gloo_name(pw), store, f"rank {n // 2}", n, timed(
                f"store N={n} pw={pw}", latency.gloo_job, template, n, n // 2, pw, "store",
                args.trials if pw else args.fixed_trials, cap), cap_s=None if pw else cap))
    else:
        for n in args.ranks:
            pts.append(Point("peerwatch", light, "rank 0 (parent)", n, timed(
                f"peerwatch rank 0 N={n}", latency.peerwatch_light, n, 0, large(n))))
        for n in args.ranks:
            pts.append(Point("Lightning _ChildProcessObserver", light, "rank 0 (parent)", n, timed(
                f"lightning rank 0 N={n}", latency.lightning_observer, template, n, True, args.fixed_trials, cap),
                cap_s=cap))
        for n in args.torchrun_ranks:
            for pw in (False, True):
                pts.append(Point(torchrun_name(pw), light, "the agent", n, timed(
                    f"torchrun agent N={n} pw={pw}", latency.torchrun_agent_death, n, pw,
                    args.trials if pw else args.fixed_trials, cap), cap_s=None if pw else cap))
        for n in args.gloo_ranks:
            for pw in (False, True):
                pts.append(Point(gloo_name(pw), gloo, "rank 0 (store host)", n, timed(
                    f"gloo rank 0 N={n} pw={pw}", latency.gloo_job, template, n, 0, pw, "allreduce", args.trials, cap),
                    cap_s=None if pw else cap))
    return pts


def gone_cell(p: Point) -> str:
    done = [t.gone_ms for t in p.trials if t.gone_ms is not None]
    never = [t for t in p.trials if t.gone_ms is None]
    if not never:
        return fmt_summary(summarize(done))
    left = max(t.left for t in never)
    total = p.n + (1 if "agent" in p.dies else 0)
    what = f"never: {left} of {total} processes still there at the cap ({p.cap_s:g} s)" if p.cap_s else "not gone"
    if not done:
        return what
    return f"{fmt_summary(summarize(done))}; {len(never)} of {len(p.trials)}: {what}"


def detected_cell(p: Point) -> str:
    done = [t.detected_ms for t in p.trials if t.detected_ms is not None]
    if not done:
        return "nobody"
    cell = fmt_summary(summarize(done))
    if len(done) < len(p.trials):
        cell += f" ({len(p.trials) - len(done)} of {len(p.trials)}: not noted)"
    return cell


def latency_table(points: List[Point]) -> str:
    rows = []
    for p in points:
        notes = []
        codes = sorted({t.code for t in p.trials if t.code is not None})
        if codes:
            notes.append("exit codes " + ", ".join(map(str, codes)))
        if p.cap_s and ("gloo" in p.ranks or "store" in p.ranks):
            notes.append(f"timeout (cap) {p.cap_s:g} s")
        if p.note == "restarts":
            notes.append("one torchrun, one attempt a trial (--max-restarts)")
        rows.append([p.contender, p.ranks, p.dies, str(p.n), str(len(p.trials)), detected_cell(p), gone_cell(p),
                     "; ".join(notes)])
    return table(["contender", "ranks", "SIGKILLed", "N", "trials", "detected, ms (median / p90 / p99 / max)",
                  "all gone, ms (median / p90 / p99 / max)", "notes"], rows)


# -- plot ----------------------------------------------------------------------------------------


def plot(points1: List[Point], points2: List[Point], path: str, cap: float) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'): no plot"
    panels = [(points1, "a rank other than 0 SIGKILLed"), (points2, "rank 0 / the launcher SIGKILLed")]
    panels = [(pts, title) for pts, title in panels if pts]
    if not panels:
        return None
    labels = sorted({f"{p.contender} ({p.ranks})" for pts, _ in panels for p in pts})
    palette = plt.get_cmap("tab10")
    color = {label: palette(i % 10) for i, label in enumerate(labels)}
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 6.2), squeeze=False, sharey=True)
    never_y = cap * 1000 * 2
    handles: Dict[str, object] = {}
    all_n = sorted({p.n for pts, _ in panels for p in pts})
    for ax, (pts, title) in zip(axes[0], panels):
        series: Dict[str, List[Point]] = {}
        for p in pts:
            series.setdefault(f"{p.contender} ({p.ranks})", []).append(p)
        for label, ps in series.items():
            ps = sorted(ps, key=lambda p: p.n)
            xs, med, lo, hi, nev = [], [], [], [], []
            for p in ps:
                done = [t.gone_ms for t in p.trials if t.gone_ms is not None]
                if len(done) < len(p.trials) or not done:
                    nev.append(p.n)
                    continue
                s = summarize(done)
                assert s is not None
                xs.append(p.n)
                med.append(s.median)
                lo.append(s.median - min(done))
                hi.append(s.p99 - s.median)
            if xs:
                h = ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, color=color[label], label=label)
                handles.setdefault(label, h)
            if nev:
                h = ax.scatter(nev, [never_y] * len(nev), marker="^", s=90, color=color[label], zorder=3,
                               label=label)
                handles.setdefault(label, h)
        ax.axhline(never_y, color="grey", lw=0.5, ls=":")
        ax.text(all_n[0], never_y * 1.12, f"never: processes left at the cap ({cap:g} s)", fontsize=8, color="grey")
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_n)
        ax.set_xticklabels([str(n) for n in all_n])
        ax.set_yscale("log")
        ax.set_ylim(top=never_y * 2.5)
        ax.set_xlabel("N ranks")
        ax.set_ylabel("SIGKILL to all gone, ms (median; bars: min to p99)")
        ax.set_title(title)
        ax.grid(True, which="both", lw=0.3)
    fig.legend(list(handles.values()), list(handles.keys()), loc="lower center", ncol=2, fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0.06 + 0.025 * math.ceil(len(handles) / 2), 1, 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return f"plot: {path}"


# -- targets -------------------------------------------------------------------------------------


def find(points: List[Point], contender: str, ranks: str, n: int) -> Optional[Point]:
    for p in points:
        if p.contender == contender and p.ranks == ranks and p.n == n:
            return p
    return None


def targets(points1: List[Point], idle: List[overhead.Idle], steps: List[overhead.Steps],
            st: Optional[startup.Startup]) -> str:
    rows = []

    def row(what: str, value: str, met: Optional[bool], info: bool = False) -> None:
        verdict = "inconclusive (noise)" if met is None else ("met" if met else "**not met**")
        rows.append([what, value, "(for reference)" if info else verdict])

    p8 = find(points1, "peerwatch", "Python, sleeping", 8)
    s8 = summarize([t.detected_ms for t in p8.trials if t.detected_ms is not None]) if p8 else None
    if s8:
        row("verdict, N = 8: median < 5 ms", f"{fmt_ms(s8.median)} ms", s8.median < 5)
        row("verdict, N = 8: p99 < 50 ms", f"{fmt_ms(s8.p99)} ms ({s8.n} trials)", s8.p99 < 50)
    g8 = summarize([t.gone_ms for t in p8.trials if t.gone_ms is not None]) if p8 else None
    if g8:
        row("all gone < 0.5 s (survivors leave on SIGTERM), N = 8",
            f"median {fmt_ms(g8.median)} ms, p99 {fmt_ms(g8.p99)} ms", g8.p99 < 500)
    for i in idle:
        if i.floor:
            row(f"idle CPU, N = {i.n}: the floor, {i.what}", f"{i.watcher_s_per_h:.2f} s", None, info=True)
        else:
            row(f"idle CPU < 1 s per rank per hour, N = {i.n}, run directory on {i.where}",
                f"{i.watcher_s_per_h:.2f} s", i.watcher_s_per_h < 1)
    for s in steps:
        d, ci = s.diff_pct(), s.ci95_pct()
        row(f"step time difference < 1 %, {s.kind} loop", f"{d:+.2f} % ± {ci:.2f} % (95 %)",
            None if ci >= 1 and abs(d) < ci else abs(d) < 1)
        d, ci = s.diff_pct(cpu=True), s.ci95_pct(cpu=True)
        row(f"CPU time per step, {s.kind} loop", f"{d:+.2f} % ± {ci:.2f} % (95 %)", None, info=True)
    if st:
        med = summarize(st.import_ms)
        assert med is not None
        row("import peerwatch < 50 ms", f"{fmt_ms(med.median)} ms median", med.median < 50)
    p128 = find(points1, "peerwatch", "Python, sleeping", 128)
    g128 = summarize([t.gone_ms for t in p128.trials if t.gone_ms is not None]) if p128 else None
    if g128:
        row("teardown of N = 128 < 2 s", f"median {g128.median / 1000:.1f} s, max {g128.max / 1000:.1f} s",
            g128.median < 2000)
    return table(["target", "measured", ""], rows)


# -- main ----------------------------------------------------------------------------------------


def wait_quiet(minutes: float) -> None:
    deadline = time.monotonic() + minutes * 60
    while load1() >= QUIET_LOAD and time.monotonic() < deadline:
        print(f"waiting for a quiet machine: load {load1():.2f}", file=sys.stderr, flush=True)
        time.sleep(30)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    # Measure peerwatch as installed, with its bytecode cached: PYTHONDONTWRITEBYTECODE=1
    # (set on some machines) would make every rank compile peerwatch again at start.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False
    become_subreaper()
    progress = log(args.verbose)
    out = Output()
    if args.wait_quiet:
        wait_quiet(args.wait_quiet)
    started = time.monotonic()
    load_start = os.getloadavg()
    m = machine()
    out("# peerwatch benchmarks" + (" (--quick: a smoke run, not for publishing)" if args.quick else ""))
    out()
    out(table(["machine", ""], [[k, v] for k, v in m.items()]))
    out()
    out(f"Load average at the start: {' / '.join(f'{x:.2f}' for x in load_start)} (1 / 5 / 15 min). "
        f"Trials per point: {args.trials} ({args.large_trials} for peerwatch at N >= 64, {args.fixed_trials} "
        f"where nobody acts); cap {args.cap:g} s.")
    out()

    points1: List[Point] = []
    points2: List[Point] = []
    if {"latency", "rank0"} & args.only:
        template = Template(TEMPLATE_MODULES, latency.template_env())
        try:
            if "latency" in args.only:
                points1 = run_latency(args, template, False, progress)
                out("## 1. A rank dies (SIGKILL): detection and teardown")
                out()
                out(latency_table(points1))
                out()
            if "rank0" in args.only:
                points2 = run_latency(args, template, True, progress)
                out("## 2. Rank 0 or the launcher dies (SIGKILL)")
                out()
                out(latency_table(points2))
                out()
        finally:
            template.close()

    idle: List[overhead.Idle] = []
    steps: List[overhead.Steps] = []
    if "overhead" in args.only:
        t = time.monotonic()
        idle = overhead.idle_cpu(args.idle_ranks, args.idle_seconds, progress)
        print(f"  idle: {time.monotonic() - t:.0f} s", file=sys.stderr, flush=True)
        out("## 3. Overhead")
        out()
        out(table(
            ["N ranks, sleeping", "watched by", "run directory on", "window, s", "CPU s/rank/hour without",
             "with it (mean / max rank)", "its share",
             "ranks polling (no inotify instance left)", "share of the ranks with inotify"],
            [[str(i.n), i.what, i.where, f"{i.seconds:.0f}", f"{i.without_s_per_h:.3f}",
              f"{i.with_s_per_h:.3f} / {i.with_max_s_per_h:.3f}", f"**{i.watcher_s_per_h:.3f}**",
              "-" if i.floor else f"{i.polling} of {i.n}", "-" if i.floor else f"{i.inotify_s_per_h:.3f}"]
             for i in idle]))
        out()
        for kind in ("torch", "python"):
            t = time.monotonic()
            steps.append(overhead.step_time(kind, args.ab_pairs, args.ab_seconds, progress))
            print(f"  steps {kind}: {time.monotonic() - t:.0f} s", file=sys.stderr, flush=True)
        out(table(
            ["loop", "pairs x steps", "step ms without (mean)", "with peerwatch", "difference (mean of pairs)",
             "block-to-block noise without", "CPU ms/step without", "with", "CPU difference"],
            [[{"torch": "torch MLP, DDP gloo, 2 ranks", "python": "Python-heavy, 2 ranks"}[s.kind],
              f"{s.pairs} x {s.steps}", f"{statistics.mean(s.without_ms):.3f}", f"{statistics.mean(s.with_ms):.3f}",
              f"**{s.diff_pct():+.2f} % ± {s.ci95_pct():.2f} %**", f"{s.noise_pct():.2f} %",
              f"{statistics.mean(s.without_cpu_ms):.3f}", f"{statistics.mean(s.with_cpu_ms):.3f}",
              f"{s.diff_pct(cpu=True):+.2f} % ± {s.ci95_pct(cpu=True):.2f} %"] for s in steps]))
        out()
        out("Differences: mean over the pairs of (with - without) / without, ± the half-width of its 95 % "
            "interval. CPU: process CPU time per step, every thread (the watcher's too).")
        out()

    st: Optional[startup.Startup] = None
    if "startup" in args.only:
        st = startup.startup(args.import_runs, progress)
        out("## 4. Startup")
        out()
        rows = [
            ["`python -c pass` (wall)", fmt_summary(summarize(st.python_ms))],
            ["`python -c 'import peerwatch'` (wall)", fmt_summary(summarize(st.python_import_ms))],
            ["`import peerwatch` (inside; bytecode cached, as installed)", fmt_summary(summarize(st.import_ms))],
            ["`peerwatch.install()` (inside, 1 rank)", fmt_summary(summarize(st.install_ms))],
        ]
        out(table([f"{args.import_runs} fresh interpreters each", "ms (median / p90 / p99 / max)"], rows))
        out()
        out(f"torch imported by peerwatch: {'**yes**' if st.torch_imported else 'no'}.")
        out()

    out("## 5. Targets")
    out()
    out(targets(points1, idle, steps, st))
    out()
    if args.plot and (points1 or points2):
        said = plot(points1, points2, args.plot, args.cap)
        if said:
            out(said)
    load_end = os.getloadavg()
    out(f"Finished in {(time.monotonic() - started) / 60:.1f} min; load average at the end: "
        f"{' / '.join(f'{x:.2f}' for x in load_end)}.")
    if args.markdown:
        Path(args.markdown).write_text(out.text())


if __name__ == "__main__":
    main()
