"""The report: ``report.json`` (schema version 1) and one readable summary.

Built from the records alone, so ``peerwatch report DIR`` gives the same answer as the
watcher that wrote it; the verdict's maker and the enforcers rewrite it as they learn more.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Dict, List, Optional

from . import _identity
from ._records import (
    EVENT_TYPES,
    Failure,
    Heartbeat,
    Verdict,
    returncode_exit_code,
    signal_name,
)
from ._rundir import EVENTS, HEARTBEATS, REPORT_FILE, VERDICT_FILE, RunDir, rank_file

REPORT_VERSION = 1

# Per-rank states.
SUCCEEDED = "succeeded"  # wrote its success marker
FAILED = "failed"  # the root cause (or failed on its own)
TORN_DOWN = "torn_down"  # saw the verdict and left (or was made to)
RUNNING = "running"  # no verdict yet, still registered and alive as far as we know
ENDED = "ended"  # gone without a marker, not (yet) judged


def build(rd: RunDir) -> Dict[str, Any]:
    """The report as a dict, from what the run directory holds now."""
    regs = rd.registrations()
    events: Dict[str, Dict[int, Any]] = {k: {} for k in EVENT_TYPES}
    for prefix, rank, name in rd.entries(EVENTS):
        if prefix in EVENT_TYPES:
            record = rd.read(EVENTS, name, EVENT_TYPES[prefix])
            if record is not None and record.rank == rank:  # type: ignore[attr-defined]
                events[prefix][rank] = record
    verdict = rd.read(EVENTS, VERDICT_FILE, Verdict)
    ranks: List[Dict[str, Any]] = []
    for rank in sorted(set(regs) | set(events["failure"]) | set(events["exit"])):
        reg = regs.get(rank)
        beat = rd.read(HEARTBEATS, rank_file("rank", rank), Heartbeat)
        stack = rd.stack_path(rank)
        status = events["exit"].get(rank)
        failure = events["failure"].get(rank)
        if verdict is not None and verdict.rank == rank:
            state = FAILED
        elif rank in events["success"]:
            state = SUCCEEDED
        elif failure is not None:
            state = FAILED
        elif verdict is not None:
            state = TORN_DOWN
        elif status is not None or (reg is not None and not _identity.seems_alive(reg)):
            state = ENDED
        else:
            state = RUNNING
        exit_code: Optional[int] = None
        if status is not None:
            exit_code = returncode_exit_code(status.returncode)
        elif failure is not None and failure.exit_code is not None:
            exit_code = failure.exit_code
        elif state == TORN_DOWN and verdict is not None:
            exit_code = verdict.exit_code
        elif state == SUCCEEDED:
            exit_code = 0
        ranks.append({
            "rank": rank,
            "pid": reg.pid if reg else (status.pid if status else None),
            "host": reg.host if reg else None,
            "state": state,
            "exit_code": exit_code,
            "signal": signal_name(-status.returncode) if status is not None and status.returncode < 0 else None,
            "stack_file": stack if _non_empty(stack) else None,
            "last_heartbeat_ns": beat.time_ns if beat else None,
            "step": beat.step if beat else None,
            "acked_verdict": rank in events["ack"],
            "thread_exception": _thread_exception(events["thread"].get(rank)),
        })
    outcome = "failed" if verdict is not None else (
        "succeeded" if ranks and all(r["state"] == SUCCEEDED for r in ranks) else "running"
    )
    report: Dict[str, Any] = {
        "version": REPORT_VERSION,
        "run_dir": rd.path,
        "outcome": outcome,
        "written_at_ns": time.time_ns(),
        "verdict": None,
        "ranks": ranks,
    }
    if verdict is not None:
        v = dataclasses.asdict(verdict)
        v["detected_at"] = _iso(verdict.detected_at_ns)
        v["failed_at"] = _iso(verdict.failed_at_ns)
        stack = rd.stack_path(verdict.rank)
        v["stack_file"] = stack if _non_empty(stack) else None
        report["verdict"] = v
    return report


def write(rd: RunDir) -> Dict[str, Any]:
    """Build the report and (re)write ``report.json`` atomically."""
    import json

    report = build(rd)
    rd.write("", REPORT_FILE, json.dumps(report, indent=2).encode() + b"\n", replace=True)
    return report


def _thread_exception(f: Optional[Failure]) -> Optional[Dict[str, Any]]:
    if f is None:
        return None
    return {"thread": f.thread, "exception": f.exception, "message": f.message, "traceback": f.traceback}


def _non_empty(path: str) -> bool:
    try:
        return os.path.getsize(path) > 0
    except OSError:
        return False


def _iso(ns: int) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(ns / 1e9, tz=datetime.timezone.utc).isoformat(timespec="microseconds")


def _clock(ns: Optional[int]) -> str:
    import datetime

    if ns is None:
        return "-"
    return datetime.datetime.fromtimestamp(ns / 1e9).strftime("%H:%M:%S.%f")[:-3]


def summary(report: Dict[str, Any]) -> str:
    """A short human summary: the root cause first, then what happened to every rank."""
    v = report.get("verdict")
    lines = []
    if v is None:
        lines.append(f"peerwatch: no failure recorded in {report['run_dir']} (outcome: {report['outcome']})")
    else:
        how = v.get("detail") or v.get("cause")
        where = f" (pid {v['pid']}, {v.get('host')})" if v.get("pid") else ""
        lines.append(f"peerwatch: rank {v['rank']}{where} failed first: {how}")
        extra = f"cause: {v['cause']}, ranks exit with code {v['exit_code']}"
        if v.get("signal"):
            extra += f", signal {v['signal']}"
        lines.append(f"  {extra}")
        delay_ms = (v["detected_at_ns"] - v["failed_at_ns"]) / 1e6
        lines.append(
            f"  failed at {_clock(v['failed_at_ns'])}, verdict by rank {v['detected_by']} at "
            f"{_clock(v['detected_at_ns'])} (+{max(delay_ms, 0.0):.1f} ms)"
        )
    lines.append(f"  {'rank':>4}  {'pid':>7}  {'state':<10} {'exit':>4}  stacks")
    for r in report["ranks"]:
        code = "-" if r["exit_code"] is None else str(r["exit_code"])
        lines.append(
            f"  {r['rank']:>4}  {str(r['pid']):>7}  {r['state']:<10} {code:>4}  {r['stack_file'] or '-'}"
        )
    if v is not None and v.get("traceback"):
        tb = v["traceback"].rstrip().splitlines()
        lines.append("  traceback of the failing rank (last lines):")
        lines.extend("    " + line for line in tb[-8:])
    lines.append(f"  report: {os.path.join(report['run_dir'], REPORT_FILE)}")
    return "\n".join(lines)


__all__ = ["REPORT_VERSION", "build", "summary", "write"]
