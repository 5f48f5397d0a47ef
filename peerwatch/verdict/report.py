"""The report: ``report.json`` (schema version 1) and one readable summary.

Built from the records alone, so ``peerwatch report DIR`` gives the same answer as the
watcher that wrote it; the verdict's maker and the enforcers rewrite it as they learn more.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Dict, List, Optional, Tuple

from ..core.records import (
    EVENT_TYPES,
    INTERRUPTED,
    Diagnosis,
    ExitStatus,
    Failure,
    Heartbeat,
    Interrupt,
    Registration,
    Verdict,
    returncode_exit_code,
    signal_name,
)
from ..core.terminal import interrupted_text, printable, who
from ..hangs.straggler import finding_from_json
from ..proc import identity
from ..rundir.rundir import (
    DIAGNOSIS_FILE,
    EVENTS,
    FLIGHT_RECORDER,
    HEARTBEATS,
    REPORT_FILE,
    SPAWNED_RUN,
    STRAGGLERS_FILE,
    VERDICT_FILE,
    RunDir,
    parse_fr_dump_name,
    rank_file,
)
from . import decide

REPORT_VERSION = 1

# Per-rank states.
SUCCEEDED = "succeeded"  # wrote its success marker
FAILED = "failed"  # the root cause (or failed on its own)
TORN_DOWN = "torn_down"  # saw the verdict and left (or was made to)
RUNNING = "running"  # no verdict yet, still registered and alive as far as we know
ENDED = "ended"  # gone without a marker, not (yet) judged
NOT_SIGNALLED = "not_signalled"  # a verdict, no acknowledgement, and it could not be verified: left alone
# The job was interrupted from outside (verdict cause "interrupted"): no rank failed. The
# run's outcome then is INTERRUPTED too.
INTERRUPTED_STATE = INTERRUPTED


def build(rd: RunDir) -> Dict[str, Any]:
    """The report as a dict, from what the run directory holds now. The run of
    torch.multiprocessing.spawn's main process, where install() ran at the top of the
    script, is not the job's: its workers' run (``RUN/spawn``) is reported instead, with
    ``launcher_run`` naming the one asked for, unless a watcher wrote a verdict in the main
    process's own run (its workers were not watched)."""
    report = _build(rd)
    if report["verdict"] is None or report["verdict"]["inferred"]:
        workers = _spawned_run(rd)
        if workers is not None:
            report = _build(workers)
            report["launcher_run"] = rd.path
    return report


def _spawned_run(rd: RunDir) -> Optional[RunDir]:
    """``RUN/spawn``, where it holds registered ranks (peerwatch.rundir.basedir: the run of the
    workers of torch.multiprocessing.spawn's main process that installed peerwatch)."""
    try:
        spawned = RunDir(rd.join(SPAWNED_RUN))
        return spawned if spawned.registrations() else None
    except OSError:
        return None


def verdict_of(rd: RunDir) -> Optional[Verdict]:
    """The run's verdict: the one written, or where nobody was left to write one, the one its
    records tell (:func:`verdict_from_records`); None where there is none."""
    return rd.read(EVENTS, VERDICT_FILE, Verdict) or verdict_from_records(rd, rd.registrations(), _events(rd))


def _build(rd: RunDir) -> Dict[str, Any]:
    regs = rd.registrations()
    events = _events(rd)
    written = rd.read(EVENTS, VERDICT_FILE, Verdict)
    verdict = written or verdict_from_records(rd, regs, events)
    ranks = [
        _rank_entry(rd, rank, regs.get(rank), events, verdict)
        for rank in sorted(set(regs) | set(events["failure"]) | set(events["exit"]))
    ]
    # A rank that failed after it was marked done (no teardown, by design) makes the run
    # failed too, verdict or not: its success marker is not the end of its story.
    outcome = "failed" if verdict is not None or any(r["failed_after_done"] for r in ranks) else (
        "succeeded" if ranks and all(r["state"] == SUCCEEDED for r in ranks) else "running"
    )
    if verdict is not None and verdict.cause == INTERRUPTED and not any(r["state"] == FAILED for r in ranks):
        outcome = INTERRUPTED
    report: Dict[str, Any] = {
        "version": REPORT_VERSION,
        "run_dir": rd.path,
        "outcome": outcome,
        "written_at_ns": time.time_ns(),
        "verdict": None,
        "ranks": ranks,
        "diagnosis": diagnosis_entry(rd.read(EVENTS, DIAGNOSIS_FILE, Diagnosis)),
        "stragglers": stragglers_entry(rd),
        "flight_recorder": flight_recorder_entry(rd, [r["rank"] for r in ranks]),
    }
    if verdict is not None:
        v = dataclasses.asdict(verdict)
        v["detected_at"] = _iso(verdict.detected_at_ns)
        v["failed_at"] = _iso(verdict.failed_at_ns)
        v["raised_at"] = None if verdict.raised_ns is None else _iso(verdict.raised_ns)
        stack = rd.stack_path(verdict.rank)
        v["stack_file"] = stack if _non_empty(stack) else None
        v["inferred"] = written is None
        report["verdict"] = v
    return report


def verdict_from_records(
    rd: RunDir, regs: Dict[int, Registration], events: Dict[str, Dict[int, Any]],
) -> Optional[Verdict]:
    """Where no verdict was written and no rank is left alive to write one: the verdict the
    ranks' records tell, by the watchers' own rules (peerwatch.verdict.decide). A SIGTERM to the
    whole process group ends every rank at once, each writing its exit record as it goes
    (the job was interrupted; rule: interrupts are not failures); mp.spawn's main process
    SIGTERMs the other workers as soon as it sees one end, maybe before their watchers made
    a verdict (the one that ended first is the cause;
    rules: the earliest failure is the cause, a launcher's signal never outranks). None
    where the records do not tell: a rank that ended without a record is taken for the cause
    only where it is the one such rank (when several vanished, which went first is not
    known)."""
    if not regs or any(identity.seems_alive(reg) for reg in regs.values()):
        return None  # a watcher may still judge
    recorded = set(events["success"]) | set(events["failure"]) | set(events["exit"])
    gone = {}
    for rank, reg in regs.items():
        if rank not in recorded:  # last known alive at its last heartbeat
            beat = rd.read(HEARTBEATS, rank_file("rank", rank), Heartbeat)
            gone[rank] = beat.time_ns if beat is not None else reg.time_ns
    obs = decide.Observed(
        self_rank=min(regs), now_ns=time.time_ns(), registrations=regs, successes=frozenset(events["success"]),
        failures=events["failure"], exit_statuses=events["exit"], gone=gone,
    )
    verdict = decide.decide(obs, decide.Policy(parent_wait_ns=0, default_exit_code=1)).verdict
    if verdict is None or (verdict.rank in gone and len(gone) > 1):
        return None
    return verdict


def _events(rd: RunDir) -> Dict[str, Dict[int, Any]]:
    """prefix -> rank -> record, for every record in ``events/`` that names its own rank."""
    return rd.rank_records(EVENTS, EVENT_TYPES)


def _state(rank: int, reg: Optional[Registration], events: Dict[str, Dict[int, Any]], verdict: Optional[Verdict]) -> str:
    if verdict is not None and verdict.cause == INTERRUPTED:
        return _interrupted_state(rank, events)
    if verdict is not None and verdict.rank == rank:
        return FAILED
    if rank in events["success"]:
        return FAILED if failed_after_done(rank, events) else SUCCEEDED
    if rank in events["failure"] and not echoed_verdict(rank, events, verdict):
        return FAILED
    if verdict is not None:
        if rank in events["unsignalled"] and rank not in events["ack"] and rank not in events["exit"]:
            return NOT_SIGNALLED
        return TORN_DOWN
    if rank in events["exit"] or (reg is not None and not identity.seems_alive(reg)):
        return ENDED
    return RUNNING


def _interrupted_state(rank: int, events: Dict[str, Dict[int, Any]]) -> str:
    """A rank's state in a job interrupted from outside: it finished before, it failed
    after it was marked done, or it was interrupted as the others were (its KeyboardInterrupt,
    its SIGTERM, or its teardown)."""
    if rank in events["success"]:
        return FAILED if failed_after_done(rank, events) else SUCCEEDED
    return INTERRUPTED_STATE


def echoed_verdict(rank: int, events: Dict[str, Dict[int, Any]], verdict: Optional[Verdict]) -> bool:
    """The rank's own failure is an exception torch.distributed raised (a collective's
    timeout or "Connection closed by peer") and it acknowledged the verdict on another
    rank: the echo of that failure (a hang's victims, whose collectives timed out). It is
    torn down, and exits with the verdict's code (rule: the verdict's exit code), not its own."""
    failure = events["failure"].get(rank)
    return (
        verdict is not None and verdict.rank != rank and failure is not None and failure.collective
        and rank in events["ack"]
    )


def failed_after_done(rank: int, events: Dict[str, Dict[int, Any]]) -> bool:
    """The rank wrote its success marker (``watch()`` ended, or ``mark_success()``), then
    failed all the same: a failure record of its own, or an exit status other than 0. The
    job went on (a rank that is done is not watched), but it did not succeed."""
    if rank not in events["success"]:
        return False
    status = events["exit"].get(rank)
    return rank in events["failure"] or (status is not None and status.returncode != 0)


def _exit_code(
    state: str, status: Optional[ExitStatus], failure: Optional[Failure], verdict: Optional[Verdict],
) -> Tuple[Optional[int], bool]:
    """The rank's exit code as a shell shows it, and whether someone saw it (its parent,
    a peer reading its last words, the rank itself as it left, the exit status at exit)
    rather than expected it (the code it said it would exit with, the verdict's code)."""
    if status is not None:
        return returncode_exit_code(status.returncode), True
    if state == TORN_DOWN and verdict is not None and failure is not None and not failure.observed:
        return verdict.exit_code, False  # an echo of the verdict (echoed_verdict): the verdict's code
    if failure is not None and failure.exit_code is not None:
        # Written from the exit status itself (peerwatch._exitstatus), or said beforehand.
        return failure.exit_code, failure.observed
    if state in (TORN_DOWN, INTERRUPTED_STATE) and verdict is not None:
        return verdict.exit_code, False
    if state == SUCCEEDED:
        return 0, True  # a success marker is written only for exit status 0 (docs/security.md, "Success needs evidence")
    return None, False


def _ended_at(rank: int, events: Dict[str, Dict[int, Any]]) -> Optional[int]:
    """When the rank was last known to end (ns since the epoch), or None if it has not."""
    for kind in ("exit", "success", "failure"):
        record = events[kind].get(rank)
        if record is not None:
            return int(record.time_ns)
    return None


def _rank_entry(
    rd: RunDir, rank: int, reg: Optional[Registration], events: Dict[str, Dict[int, Any]], verdict: Optional[Verdict],
) -> Dict[str, Any]:
    beat = rd.read(HEARTBEATS, rank_file("rank", rank), Heartbeat)
    stack = rd.stack_path(rank)
    status = events["exit"].get(rank)
    state = _state(rank, reg, events, verdict)
    failure = events["failure"].get(rank)
    # Its watcher's note that it got the job's signal: the one word from a rank whose own
    # KeyboardInterrupt came after the verdict (a consequence, not recorded as a failure).
    interrupt = events["interrupt"].get(rank) if state == INTERRUPTED_STATE else None
    code, observed = _exit_code(state, status, failure, verdict)
    ended_at = _ended_at(rank, events)
    if ended_at is None and state in (TORN_DOWN, NOT_SIGNALLED, INTERRUPTED_STATE) and verdict is not None:
        ended_at = verdict.detected_at_ns  # torn down from then on; how it ended was not seen
    return {
        "rank": rank,
        "pid": reg.pid if reg else (status.pid if status else None),
        "host": reg.host if reg else None,
        "state": state,
        "exit_code": code,
        "exit_observed": observed,
        "signal": _signal_of(status, failure, interrupt),
        "signalled_by": _sender_of(status, failure, interrupt),
        "stack_file": stack if _non_empty(stack) else None,
        "last_heartbeat_ns": beat.time_ns if beat else None,
        "step": beat.step if beat else None,
        # Whether its collective counters are read: a rank whose are not is invisible to the diagnosis.
        "collectives_state": (beat.collectives_state or None) if beat else None,
        "collectives_error": (beat.collectives_error or None) if beat else None,
        "ended_at_ns": ended_at,
        "acked_verdict": rank in events["ack"],
        "thread_exception": _thread_exception(events["thread"].get(rank)),
        "not_signalled": events["unsignalled"][rank].reason if state == NOT_SIGNALLED else None,
        "failed_after_done": state == FAILED and failed_after_done(rank, events),
        "unwatched": _unwatched(reg),
    }


def _signal_of(status: Optional[ExitStatus], failure: Optional[Failure], interrupt: Optional[Interrupt]) -> Optional[str]:
    """The signal the rank ended by (its exit status), or that raised its failure (SIGINT),
    or that its watcher saw it get (an interrupted job)."""
    if status is not None and status.returncode < 0:
        return signal_name(-status.returncode)
    if failure is not None and failure.signal is not None:
        return failure.signal
    return interrupt.signal if interrupt is not None else None


def _sender_of(status: Optional[ExitStatus], failure: Optional[Failure], interrupt: Optional[Interrupt]) -> Optional[int]:
    """Who sent the signal of ``_signal_of``, where known."""
    for said in (status, failure, interrupt):
        if said is not None and said.signalled_by is not None:
            return said.signalled_by
    return None


def stragglers_entry(rd: RunDir) -> List[Dict[str, Any]]:
    """The ``stragglers`` list of report.json and ``peerwatch status --json`` (docs/stragglers.md):
    the ranks the others keep waiting for, as last found; [] when the job is balanced."""
    return [{"rank": s.rank, "host": s.host, "late_ms": s.late_ms, "share": s.share, "since": _iso(s.since_ns)}
            for s in finding_from_json(rd.read_bytes("", STRAGGLERS_FILE) or b"") or ()]


def straggler_lines(report: Dict[str, Any]) -> List[str]:
    """One line per straggler, for status and the summary."""
    return [f"straggler: rank {s['rank']}{' on ' + s['host'] if s['host'] else ''} enters its collectives "
            f"{s['late_ms']} ms after its peers ({100 * s['share']:.0f}% of each step), since {s['since']}"
            for s in report.get("stragglers") or ()]


def diagnosis_entry(d: Optional[Diagnosis]) -> Optional[Dict[str, Any]]:
    """The ``diagnosis`` object of report.json and ``peerwatch status --json`` (docs/report.md)."""
    if d is None:
        return None
    return {
        "kind": d.finding,
        "laggards": list(d.laggards),
        "entered": list(d.entered),
        "collective": None if d.group is None else {"group": d.group, "seq": d.seq, "op": d.op},
        "since": round(d.since_ns / 1e9, 3),
        "detail": d.detail,
        "diagnosed_at": _iso(d.time_ns),
        "diagnosed_by": d.made_by,
        "resolved_at": None if d.resolved_ns is None else _iso(d.resolved_ns),
        "ends_at": None if d.end_at_ns is None else _iso(d.end_at_ns),
        "hosts": [{"rank": rank, "host": host} for rank, host in d.hosts],
    }


ANALYZER = "torchfrtrace"  # torch's flight-recorder analyzer (python -m torch.distributed.flight_recorder.fr_trace)


def flight_recorder_entry(rd: RunDir, ranks: List[int]) -> Optional[Dict[str, Any]]:
    """The ``flight_recorder`` object of report.json (docs/report.md): the folder of the
    ranks' flight-recorder dumps and the command that analyzes them; None without dumps."""
    dumped = sorted(r for r in map(parse_fr_dump_name, rd.names(FLIGHT_RECORDER)) if r is not None)
    if not dumped:
        return None
    path = rd.join(FLIGHT_RECORDER)
    # torch's analyzer stops at a rank without a dump, unless told to make do.
    partial = " --allow-incomplete-ranks" if set(ranks) - set(dumped) else ""
    return {"dir": path, "ranks": dumped, "analyze": f"{ANALYZER} {path}{partial}"}


def _unwatched(reg: Optional[Registration]) -> Optional[str]:
    """Why this host cannot watch or signal a rank of this host, if it cannot."""
    if reg is None or identity.is_local(reg):
        return None
    if reg.host == identity.hostname() and reg.boot_id == identity.boot_id():
        return f"another PID namespace of this host ({reg.pidns}): its pid {reg.pid} means nothing here"
    return None


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


def exit_text(r: Dict[str, Any]) -> str:
    """A rank's exit as the table shows it: ``1``, ``143 SIGTERM``, ``1 (expected)``, ``-``."""
    if r["exit_code"] is None:
        return "-"
    text = str(r["exit_code"])
    if r.get("signal"):
        text += f" {r['signal']}"
    if not r.get("exit_observed", True):
        text += " (expected)"
    return text


def summary(report: Dict[str, Any], traceback: bool = True, leaving: bool = False) -> str:
    """A short human summary: the root cause first, then what happened to every rank.
    ``traceback=False`` leaves out the failing rank's traceback (printed just above by
    the failing rank itself). ``leaving``: printed during the teardown, while the other
    ranks are still leaving (and writing what they leave, their flight-recorder dumps)."""
    v = report.get("verdict")
    late = [r for r in report["ranks"] if r.get("failed_after_done")]
    lines = _summary_head(report, v, late)
    if report.get("launcher_run"):
        lines.append(f"  the workers' run of torch.multiprocessing.spawn's main process, whose own run is {report['launcher_run']}")
    lines += _rank_table(report["ranks"])
    if late:
        lines.append("  failed after it was marked done (watch() had ended, or mark_success()): no teardown, by design; "
                     "the run did not succeed")
        if v is not None:
            lines.extend(f"  {_late_failure(r)}" for r in late)
    d = report.get("diagnosis")
    if d is not None:
        lines.append(f"  diagnosis ({d['kind']}{', resolved: the job moved again' if d.get('resolved_at') else ''}): "
                     f"{d['detail']}")
    lines.extend(f"  {line}" for line in straggler_lines(report))
    fr = report.get("flight_recorder")
    if fr:
        lines.append(flight_recorder_line(fr, leaving))
    if traceback and v is not None and v.get("traceback"):
        tb = v["traceback"].rstrip().splitlines()
        lines.append("  traceback of the failing rank (last lines):")
        lines.extend("    " + line for line in tb[-8:])
    path = os.path.join(report["run_dir"], REPORT_FILE)
    if (v is not None and not v.get("inferred")) or os.path.exists(path):  # a run without a verdict writes none
        lines.append(f"  report: {path}")
    return printable("\n".join(lines))  # a rank's message may hold escape sequences: shown, not obeyed


def flight_recorder_line(fr: Dict[str, Any], leaving: bool) -> str:
    """The summary's line for the flight-recorder dumps: those there as it is written.
    During a teardown the other ranks dump as they leave, mostly after the summary is out:
    it says so, rather than give the first dumps for all of them."""
    ranks = fr["ranks"]
    n = len(ranks)
    which = f"rank {ranks[0]}" if n == 1 else (
        f"ranks {', '.join(map(str, ranks))}" if n <= _NAMED_DUMPS else f"{n} ranks")
    more = " so far; every rank dumps its own as it leaves" if leaving else ""
    return f"  flight recorder in {fr['dir']}: {which} dumped{more} (torch's analyzer: {fr['analyze']})"


_NAMED_DUMPS = 16  # dumps a summary names by rank (more are counted)


def _summary_head(report: Dict[str, Any], v: Optional[Dict[str, Any]], late: List[Dict[str, Any]]) -> List[str]:
    """The summary's first lines: the root cause, or how the run ended without one."""
    if v is None and report["outcome"] == "succeeded":
        n = len(report["ranks"])
        return [f"peerwatch: the run in {report['run_dir']} succeeded: "
                f"{'its rank' if n == 1 else f'all {n} ranks'} finished cleanly"]
    if v is None and late:
        return [f"peerwatch: the run in {report['run_dir']} failed after it was marked done: "
                + "; ".join(_late_failure(r) for r in late)]
    if v is None:
        return [f"peerwatch: no failure recorded in {report['run_dir']} (outcome: {report['outcome']})"]
    how = v.get("detail") or v.get("cause")
    if v.get("cause") == INTERRUPTED:
        return _interrupted_head(v, str(how))
    by = (f"verdict by rank {v['detected_by']} at {_clock(v['detected_at_ns'])}" if not v.get("inferred")
          else "no watcher was left to judge: told from the ranks' records")
    extra = f"cause: {v['cause']}, ranks exit with code {v['exit_code']}"
    if v.get("signal"):
        extra += f", signal {v['signal']}"
    # When it failed: as it reached peerwatch (before the wait that tells a cause from an
    # echo), where the rank said; else when it was recorded or seen.
    failed_ns = v.get("raised_ns") or v["failed_at_ns"]
    delay_ms = (v["detected_at_ns"] - failed_ns) / 1e6
    return [
        f"peerwatch: {who(v['rank'], v.get('pid'), v.get('host'))} failed first: {how}",
        f"  {extra}",
        f"  failed at {_clock(failed_ns)}, {by}" + ("" if v.get("inferred") else f" (+{max(delay_ms, 0.0):.1f} ms)"),
    ]


def _interrupted_head(v: Dict[str, Any], how: str) -> List[str]:
    """The summary's first lines for a job interrupted from outside: no rank is named as failed."""
    return [
        f"peerwatch: {interrupted_text(how)}",
        f"  cause: interrupted, ranks exit with code {v['exit_code']}, signal {v['signal']}",
        f"  interrupted at {_clock(v['failed_at_ns'])}, " + (
            "no watcher was left to judge: told from the ranks' records" if v.get("inferred")
            else f"verdict by rank {v['detected_by']} at {_clock(v['detected_at_ns'])}"),
    ]


def _rank_table(ranks: List[Dict[str, Any]]) -> List[str]:
    """What happened to every rank, one row each, and the notes the rows need."""
    lines = [f"  {'rank':>4}  {'pid':>7}  {'state':<10} {'exit':>12}  {'step':>6}  stacks"]
    for r in ranks:
        step = "-" if r.get("step") is None else str(r["step"])
        lines.append(
            f"  {r['rank']:>4}  {str(r['pid']):>7}  {r['state']:<10} {exit_text(r):>12}  {step:>6}  {r['stack_file'] or '-'}"
        )
    if any(r["exit_code"] is not None and not r.get("exit_observed", True) for r in ranks):
        lines.append("  (expected) = the code it was to exit with; nobody could see its exit status (yet)")
    for r in ranks:
        if r.get("unwatched"):
            lines.append(f"  rank {r['rank']} cannot be watched or signalled from here: {r['unwatched']}")
        if r.get("not_signalled"):
            lines.append(f"  {who(r['rank'], r['pid'], r.get('host'))} could not be verified, not signalled: {r['not_signalled']}")
    return lines


def _late_failure(r: Dict[str, Any]) -> str:
    code = "" if r["exit_code"] is None else f" (exit code {r['exit_code']})"
    return f"{who(r['rank'], r.get('pid'), r.get('host'))} failed after its success marker{code}"


__all__ = ["REPORT_VERSION", "verdict_from_records", "verdict_of", "echoed_verdict", "failed_after_done", "build", "exit_text",
           "flight_recorder_line", "straggler_lines", "stragglers_entry", "summary", "write"]
