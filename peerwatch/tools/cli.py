"""``peerwatch report [DIR]``, ``peerwatch status [DIR] [--watch]``, ``peerwatch ls``.

Without DIR, ``report`` and ``status`` take the first run directory ``ls`` lists (one
rule, :func:`_order`; :func:`_pick` says why): the live run (a rank of this host
registered there is alive, verified by pid, start time and uid) that started last, else
the one with the newest activity. Both always say on stderr, first, which directory they
read and why, and warn when several runs are live (stdout stays the report alone, pure
JSON with ``--json``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import stat
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..core.errors import RunDirError
from ..core.records import WATCHER_DEATH, Heartbeat, WatcherDeath
from ..core.terminal import printable
from ..hangs.collectives import FAILING, NONE
from ..proc import identity
from ..rundir import basedir, gc, rundir
from ..rundir.rundir import EVENTS, HEARTBEATS, RunDir, rank_file
from ..verdict import report as _report


def _open(path: str) -> RunDir:
    path = os.path.abspath(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise RunDirError(path, "is a symbolic link to nothing" if os.path.islink(path) else "does not exist") from None
    except OSError as e:  # a folder above it that this user cannot search, a loop of links...
        raise RunDirError(path, f"cannot be looked at ({e.strerror or e})") from None
    if not stat.S_ISDIR(mode):
        # Checked before access(): root may read any file, and a file is no run directory.
        raise RunDirError(path, "is not a directory, so not a peerwatch run directory")
    if not os.access(path, os.R_OK | os.X_OK):
        raise RunDirError(path, "cannot be read by this user")
    if not os.path.isdir(os.path.join(path, rundir.RANKS)):
        raise RunDirError(path, "is not a peerwatch run directory (no ranks/ folder)")
    return RunDir(path)


LIVE = "live"  # a rank registered here on this host is alive (verified, not a bare pid)
ELSEWHERE = "other host"  # no live rank of this host; one of another host or PID namespace cannot be seen
FINISHED = "finished"  # no rank is alive


@dataclasses.dataclass(frozen=True)
class Run:
    """A run directory as ``ls`` lists it."""

    path: str
    state: str  # LIVE, ELSEWHERE or FINISHED
    last_activity: float  # seconds since the epoch: the newest change to its records (gc.last_activity)
    # LIVE only: when its first live rank of this host registered (time.time_ns()). Unlike
    # last_activity, which every heartbeat moves, it stays put while the run lives, so two
    # live runs are always taken in the same order.
    started_ns: int = 0


def _run(path: str) -> Run:
    """``path``'s state and last activity; raises OSError when it cannot be read."""
    regs = gc.live_registrations(path)
    local = [r.time_ns for r in regs if identity.is_local(r)]
    state = LIVE if local else ELSEWHERE if regs else FINISHED
    return Run(path, state, gc.last_activity(path), min(local, default=0))


def _order(run: Run) -> Tuple[int, int, float, str]:
    """Live runs first, the one started last first; then the others by their last activity,
    newest first (not the folder's mtime, which a running job does not move)."""
    if run.state == LIVE:
        return (0, -run.started_ns, 0.0, run.path)
    return (1, 0, -run.last_activity, run.path)


def _runs(base: str) -> List[Run]:
    """The run directories under ``base``, in :func:`_order`; raises OSError when ``base``
    cannot be listed (it does not exist, is no directory, cannot be read)."""
    names = os.listdir(base)
    found = []
    for name in names:
        path = os.path.join(base, name)
        if name.endswith(".lock") or not os.path.isdir(os.path.join(path, rundir.RANKS)):
            continue
        try:
            found.append(_run(path))
        except OSError:
            continue
    return sorted(found, key=_order)


def _clock(time_ns: int) -> str:
    return time.strftime("%H:%M:%S", time.localtime(time_ns / 1e9))


def _pick(runs: List[Run]) -> Tuple[Run, str, Optional[str]]:
    """The run ``status`` and ``report`` read without one named: the first of ``runs``
    (in :func:`_order`, as ``ls`` lists them); why; and a warning when several are live."""
    first = runs[0]
    live = [r for r in runs if r.state == LIVE]
    if not live:
        where = "no run is live on this host" if first.state == FINISHED else "no run of this host is live"
        return first, f"{first.state}: {where}; the one with the newest activity", None
    if len(live) == 1:
        return first, "live: the only live run on this host", None
    why = f"live: the newest of the {len(live)} live runs on this host, started at {_clock(first.started_ns)}"
    others = ", ".join(f"{printable(r.path)} (started at {_clock(r.started_ns)})" for r in live)
    return first, why, f"{len(live)} runs are live on this host: {others}; name one to read another"


def _chosen(given: Optional[str]) -> RunDir:
    """The run directory named, or the one :func:`_pick` takes; says which and why on
    stderr, first."""
    warning = None
    if given:
        rd = _open(given)
        try:
            why = f"{_run(rd.path).state}, as named"
        except OSError as e:
            raise RunDirError(rd.path, f"cannot be read ({e.strerror or e})") from None
    else:
        base = basedir.base_dir()
        try:
            runs = _runs(base)
        except FileNotFoundError:
            raise RunDirError(base, "does not exist: no run has used it yet; name a run directory") from None
        except OSError as e:
            raise RunDirError(base, f"cannot be listed ({e.strerror or e}); name a run directory") from None
        if not runs:
            raise RunDirError(base, "holds no run directories; name one (peerwatch ls --base DIR lists them)")
        run, why, warning = _pick(runs)
        rd = _open(run.path)
    print(f"peerwatch: showing {printable(rd.path)} ({why})", file=sys.stderr, flush=True)
    if warning is not None:
        print(f"peerwatch: warning: {warning}", file=sys.stderr, flush=True)
    return rd


def _report_cmd(args: argparse.Namespace) -> int:
    rd = _chosen(args.dir)
    report = _report.build(rd)
    if args.timeline:
        from . import timeline

        try:
            timeline.write(rd, args.timeline)
        except OSError as e:  # a folder that does not exist, a directory given as the file...
            print(f"peerwatch: cannot write the timeline to {args.timeline}: {e.strerror or e}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_report.summary(report))
    return 0


def _status_cmd(args: argparse.Namespace) -> int:
    rd = _chosen(args.dir)
    if args.json:
        print(json.dumps(_report.build(rd), indent=2))
        return 0
    if not args.watch:
        print(printable(_status_text(rd)))
        return 0
    clear = "\033[H\033[J" if sys.stdout.isatty() else ""
    try:
        while True:
            when = time.strftime("%H:%M:%S")
            print(f"{clear}{rd.path} at {when} (every {args.interval:g}s; Ctrl-C to stop)")
            print(printable(_status_text(rd)), flush=True)
            time.sleep(args.interval)  # a person is reading: a fixed refresh, no event to wait on
    except KeyboardInterrupt:
        return 0


def _status_text(rd: RunDir) -> str:
    """The table: the heartbeat column is its age now for a running rank, at its end for
    one that ended (an ended run's ages do not grow)."""
    report = _report.build(rd)
    now = time.time_ns()
    lines = [f"{'rank':>4}  {'pid':>7}  {'host':<16} {'state':<13} {'heartbeat':>9}  {'step':>8}  {'collectives':<11}  exit"]
    blind = []
    for r in report["ranks"]:
        beat = rd.read(HEARTBEATS, rank_file("rank", r["rank"]), Heartbeat)
        end = r.get("ended_at_ns") if r["state"] != "running" else None
        age = f"{max(0, (end or now) - beat.time_ns) / 1e9:.1f}s" if beat else "-"
        step = "-" if not beat or beat.step is None else str(beat.step)
        collectives = r.get("collectives_state") or "-"
        lines.append(f"{r['rank']:>4}  {str(r['pid']):>7}  {str(r['host'])[:16]:<16} {r['state']:<13} {age:>9}  "
                     f"{step:>8}  {collectives:<11}  {_report.exit_text(r)}")
        note = _not_read(r)
        if note is not None:
            blind.append(note)
    lines.append(f"outcome: {report['outcome']}")
    d = report.get("diagnosis")
    if d is not None:
        state = f"resolved at {d['resolved_at']}" if d.get("resolved_at") else f"after {d['since']:g}s without progress"
        lines.append(f"diagnosis: {d['kind']} ({state}): {d['detail']}")
    lines.extend(_report.straggler_lines(report))
    lines.extend(blind)
    lines.extend(_watcher_deaths(rd, {r["rank"]: r["pid"] for r in report["ranks"]}))
    return "\n".join(lines)


def _not_read(r: Dict[str, Any]) -> Optional[str]:
    """A line for a rank whose collective counters were asked for and are not read: the
    hang diagnosis cannot see it, and nothing else would say so (docs/hangs.md)."""
    state = r.get("collectives_state")
    if state == NONE:
        why = "its torch has no flight recorder"
    elif state == FAILING:
        why = f"its flight recorder cannot be read ({r.get('collectives_error') or '?'}; tried again every heartbeat)"
    else:
        return None
    return (f"rank {r['rank']}: collectives not read: {why}; the hang diagnosis cannot see this rank "
            "(hang_timeout and peerwatch.beat() still can)")


def _watcher_deaths(rd: RunDir, pids: Dict[int, Any]) -> List[str]:
    """One line per rank whose watcher died (its process, as registered: not an earlier one's)."""
    lines = []
    for rank, death in sorted(rd.rank_records(EVENTS, {WATCHER_DEATH: WatcherDeath})[WATCHER_DEATH].items()):
        if pids.get(rank) not in (None, death.pid):
            continue
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(death.time_ns / 1e9))
        lines.append(f"rank {rank}: watcher died at {when}: {death.exception}: {death.message}; "
                     "this rank is unprotected")
    return lines


def _ls_cmd(args: argparse.Namespace) -> int:
    base = args.base or basedir.base_dir()
    try:
        runs = _runs(base)
    except FileNotFoundError:
        if args.base:  # a folder named that is not there: a typo, not an empty list
            print(f"peerwatch: ls: {printable(base)} does not exist", file=sys.stderr)
            return 2
        print(f"no run directories in {printable(base)} (no run has used it yet)")
        return 0
    except OSError as e:
        print(f"peerwatch: ls: {printable(base)} cannot be listed: {e.strerror or e}", file=sys.stderr)
        return 2
    rows = []
    for run in runs:
        try:
            report = _report.build(RunDir(run.path))
        except OSError:
            continue
        verdict = report["verdict"]
        what = "-" if not verdict else (f"interrupted ({verdict['signal']})" if verdict["cause"] == "interrupted"
                                         else f"rank {verdict['rank']} {verdict['cause']}")  # no rank failed
        rows.append((run, report["outcome"], len(report["ranks"]), what))
    if not rows:
        print(f"no run directories in {base}")
        return 0
    print(f"{'last activity':<19}  {'state':<10}  {'outcome':<9}  {'ranks':>9}  {'first failure':<24}  run directory")
    for run, outcome, n, what in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run.last_activity))
        ranks = f"{n} rank" + ("" if n == 1 else "s")
        print(f"{when}  {run.state:<10}  {outcome:<9}  {ranks:>9}  {what:<24}  {printable(run.path)}")
    return 0


def _gc_cmd(args: argparse.Namespace) -> int:
    from ..rundir import gc

    try:
        decisions = gc.collect(dry_run=args.dry_run)
    except ValueError as e:
        print(f"peerwatch: {e}", file=sys.stderr)
        return 2
    for line in gc.describe(decisions, args.dry_run) or [f"nothing in {basedir.base_dir()}"]:
        print(line)
    return 0


def _doctor_cmd(args: argparse.Namespace) -> int:
    from . import doctor

    return doctor.main(self_test=args.self_test, as_json=args.json)


class _Subcommand(argparse.ArgumentParser):
    """A subcommand's parser: an argument it does not know is its own error, said with its
    usage (argparse hands it up to the top-level parser, whose usage names no option of the
    subcommand)."""

    def parse_known_args(  # type: ignore[override]
        self, args: Optional[Sequence[str]] = None, namespace: Optional[argparse.Namespace] = None
    ) -> Tuple[argparse.Namespace, List[str]]:
        parsed, extra = super().parse_known_args(args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed, extra


def _interval(text: str) -> float:
    """``--interval``: seconds above 0 (an error of the ``status`` subcommand, with its usage)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be above 0 and finite, not {text}")
    return value


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="peerwatch", description="Inspect peerwatch run directories.")
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"peerwatch {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Subcommand)
    p = sub.add_parser("report", help="the root cause and what happened to every rank")
    p.add_argument("dir", nargs="?", help="a run directory (default: the live run of this host started last, else the newest)")
    p.add_argument("--json", action="store_true", help="print the report as JSON (report.json; its keys: docs/report.md) instead of text")
    p.add_argument("--timeline", metavar="FILE.svg", help="also draw the run's last seconds, one lane per rank, to FILE.svg")
    p.set_defaults(func=_report_cmd)
    p = sub.add_parser("status", help="a table of the ranks: pid, host, state, heartbeat age, step, exit")
    p.add_argument("dir", nargs="?", help="a run directory (default: the live run of this host started last, else the newest)")
    p.add_argument("--watch", action="store_true", help="refresh the table until Ctrl-C")
    p.add_argument("--json", action="store_true", help="print the report's JSON (ranks, verdict, diagnosis) once")
    p.add_argument("--interval", type=_interval, default=1.0, help="seconds between refreshes with --watch (1)")
    p.set_defaults(func=_status_cmd)
    p = sub.add_parser("ls", help="the run directories on this host: live ones first (started last first), then by last activity")
    p.add_argument("--base", help="where to look (default: this user's peerwatch folder)")
    p.set_defaults(func=_ls_cmd)
    p = sub.add_parser("gc", help="remove finished run directories under the default base (what is kept and why: --dry-run)")
    p.add_argument("--dry-run", action="store_true", help="only say what would be removed, and why")
    p.set_defaults(func=_gc_cmd)
    p = sub.add_parser("doctor", help="check what peerwatch relies on here, then a live 4-rank self-test")
    p.add_argument("--json", action="store_true", help="print a machine-readable result")
    p.add_argument("--no-self-test", dest="self_test", action="store_false", help="only the checks")
    p.set_defaults(func=_doctor_cmd)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except RunDirError as e:
        print(f"peerwatch: run directory {e.path}: {e.reason}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `peerwatch report DIR | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


__all__ = ["main"]
