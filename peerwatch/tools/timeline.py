"""A picture of a teardown: ``peerwatch report DIR --timeline FILE.svg``.

One lane per rank on one time axis (milliseconds from the first failure): when the rank
failed, when it learned of the verdict, acknowledged it, was signalled (SIGTERM,
SIGKILL) and ended. Drawn from the event log (:mod:`peerwatch.rundir.eventlog`) and the
records (:func:`peerwatch.verdict.report.build`, for what the log lacks). SVG written by hand:
no dependency.
"""

from __future__ import annotations

import os
import re
import tempfile
from typing import Any, Dict, List, Optional, Tuple
from xml.sax.saxutils import escape as _xml_escape

from ..rundir import eventlog
from ..rundir.rundir import RunDir
from ..verdict import report as _report

# XML 1.0 allows no C0 control character but tab, newline and carriage return, no
# surrogate, and neither U+FFFE nor U+FFFF; C1 controls and DEL are allowed but shown as
# what they are (an exception's message may hold ESC sequences, BEL, NUL).
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff\ufffe\uffff]")
MAX_SPAN_NS = 86_400 * 10**9  # marks further than a day from the origin are left out (a bad clock, a forged line)


def escape(text: str) -> str:
    """``text`` for an SVG element or attribute: XML's specials escaped, and every
    character XML cannot hold shown as ``\\xNN`` / ``\\uNNNN``."""
    return _xml_escape(_NOT_XML.sub(_visible, text), {'"': "&quot;"})


def _visible(m: "re.Match[str]") -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"

WIDTH = 960
LANE_H = 30
LEFT = 120  # the labels' column
RIGHT = 40
TOP = 56
LEGEND_H = 64
MARGIN = 0.08  # of the span, before the failure and after the last event

# (event key) -> (colour, shape, label in the legend)
STYLE: Dict[str, Tuple[str, str, str]] = {
    "failed": ("#d62728", "x", "failed"),
    "verdict": ("#9467bd", "star", "verdict written"),
    "learned": ("#1f77b4", "circle", "learned of the verdict"),
    "ack": ("#2ca02c", "diamond", "acknowledged"),
    "SIGURG": ("#7f7f7f", "dot", "stack dump asked"),
    "SIGTERM": ("#ff7f0e", "triangle", "SIGTERM received"),
    "SIGKILL": ("#8c0000", "triangle", "SIGKILL received"),
    "exit": ("#000000", "bar", "ended"),
}


def marks(rd: RunDir) -> Tuple[Dict[int, List[Tuple[int, str, str]]], Optional[Dict[str, Any]]]:
    """rank -> [(ts, key, tooltip)], and the verdict (from the report), for the lanes."""
    report = _report.build(rd)
    verdict = report.get("verdict")
    try:
        events = eventlog.read_run(rd.path)  # events.jsonl, or each host's on a shared filesystem
    except OSError:
        events = []
    lanes: Dict[int, List[Tuple[int, str, str]]] = {r["rank"]: [] for r in report["ranks"]}
    ended: Dict[int, int] = {}

    def add(rank: Optional[int], ts: int, key: str, text: str) -> None:
        if isinstance(rank, int):
            lanes.setdefault(rank, []).append((ts, key, text))

    for e in events:
        kind, rank, ts = e["event"], e.get("rank"), e["ts"]
        if kind == "register":
            lanes.setdefault(rank, []) if isinstance(rank, int) else None
        elif kind == "verdict_seen":
            add(rank, ts, "learned", f"rank {rank} learned of the verdict" + (" (wrote it)" if e.get("wrote_verdict") else ""))
        elif kind == "ack":
            add(rank, ts, "ack", f"rank {rank} acknowledged")
        elif kind == "signal" and e.get("signal") in ("SIGTERM", "SIGKILL", "SIGURG"):
            add(rank, ts, e["signal"], f"{e['signal']} to rank {rank} by rank {e.get('by')}")
        elif kind in ("exit", "gone") and isinstance(rank, int):
            ended[rank] = min(ended.get(rank, ts), ts)
        elif kind in ("failure", "success") and isinstance(rank, int) and kind == "success":
            ended[rank] = min(ended.get(rank, ts), ts)
    for r in report["ranks"]:
        if r["rank"] not in ended and r.get("ended_at_ns") and r["state"] != "running":
            ended[r["rank"]] = r["ended_at_ns"]
    for rank, ts in ended.items():
        code = next((_report.exit_text(r) for r in report["ranks"] if r["rank"] == rank), "")
        add(rank, ts, "exit", f"rank {rank} ended: {code}")
    if verdict is not None:
        add(verdict["rank"], verdict["failed_at_ns"], "failed",
            f"rank {verdict['rank']} failed: {verdict.get('detail') or verdict['cause']}")
        add(verdict["detected_by"], verdict["detected_at_ns"], "verdict",
            f"rank {verdict['detected_by']} wrote the verdict")
    return lanes, verdict


def svg(rd: RunDir) -> str:
    """The timeline of the run in ``rd``, as an SVG document."""
    lanes, verdict = marks(rd)
    times = sorted(ts for items in lanes.values() for ts, _, _ in items)
    origin = verdict["failed_at_ns"] if verdict is not None else (times[len(times) // 2] if times else 0)
    # Bounded: a mark far from the origin (ts 9e18, a 1970 clock) would stretch the axis
    # over centuries (and its ticks loop for minutes): it is left out.
    lanes = {r: [m for m in items if abs(m[0] - origin) <= MAX_SPAN_NS] for r, items in lanes.items()}
    times = [ts for items in lanes.values() for ts, _, _ in items]
    start = min([origin] + times)
    end = max([origin] + times)
    span = max(end - start, 10_000_000)  # at least 10 ms
    t0, t1 = start - int(span * MARGIN), end + int(span * MARGIN)
    ranks = sorted(lanes)
    height = TOP + LANE_H * max(1, len(ranks)) + LEGEND_H
    plot_w = WIDTH - LEFT - RIGHT

    def x(ts: int) -> float:
        return LEFT + (ts - t0) / (t1 - t0) * plot_w

    title = f"peerwatch: {os.path.basename(rd.path)}"
    if verdict is not None:
        title += f": rank {verdict['rank']} failed ({verdict['cause']}), exit code {verdict['exit_code']}"
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">',
        f"<title>{escape(title)}</title>",
        f'<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="#ffffff"/>',
        f'<text x="{LEFT}" y="20" font-size="14" font-weight="bold">{escape(title)}</text>',
    ]
    out += _axis(x, t0, t1, origin, TOP, TOP + LANE_H * max(1, len(ranks)))
    for i, rank in enumerate(ranks):
        y = TOP + LANE_H * i + LANE_H / 2
        items = sorted(lanes[rank])
        end_ts = next((ts for ts, key, _ in items if key == "exit"), None)
        out.append(f'<g class="lane" data-rank="{rank}">')
        out.append(f'<text x="{LEFT - 10}" y="{y + 4:.1f}" text-anchor="end">rank {rank}</text>')
        lane_end = x(end_ts) if end_ts is not None else LEFT + plot_w
        out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{lane_end:.1f}" y2="{y:.1f}" stroke="#bbbbbb" stroke-width="6"/>')
        for ts, key, text in items:
            out.append(_mark(x(ts), y, key, text))
        out.append("</g>")
    out += _legend(TOP + LANE_H * max(1, len(ranks)) + 30)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _axis(x: Any, t0: int, t1: int, origin: int, top: float, bottom: float) -> List[str]:
    """Ticks in ms from the first failure, at a round step."""
    span_ms = (t1 - t0) / 1e6
    step = 1.0
    for s in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 60000):
        step = float(s)
        if span_ms / s <= 10:
            break
    while span_ms / step > 10:  # longer than the table: never more than about ten ticks
        step *= 10
    out = [f'<line x1="{LEFT}" y1="{bottom:.1f}" x2="{WIDTH - RIGHT}" y2="{bottom:.1f}" stroke="#333333"/>']
    first = int((t0 - origin) / 1e6 // step) + 1
    k = first
    while origin + k * step * 1e6 <= t1:
        ts = origin + int(k * step * 1e6)
        xx = x(ts)
        colour = "#d62728" if k == 0 else "#e5e5e5"
        out.append(f'<line x1="{xx:.1f}" y1="{top - 6}" x2="{xx:.1f}" y2="{bottom:.1f}" stroke="{colour}"/>')
        label = f"{k * step:+g} ms" if step < 1000 else f"{k * step / 1000:+g} s"
        out.append(f'<text x="{xx:.1f}" y="{top - 10}" text-anchor="middle" fill="#555555">{label}</text>')
        k += 1
    return out


def _mark(x: float, y: float, key: str, text: str) -> str:
    colour, shape, _ = STYLE[key]
    tip = f"<title>{escape(text)}</title>"
    if shape == "x":
        return (f'<g stroke="{colour}" stroke-width="3">{tip}<line x1="{x - 6:.1f}" y1="{y - 6:.1f}" x2="{x + 6:.1f}" '
                f'y2="{y + 6:.1f}"/><line x1="{x - 6:.1f}" y1="{y + 6:.1f}" x2="{x + 6:.1f}" y2="{y - 6:.1f}"/></g>')
    if shape == "circle":
        return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="5" fill="none" stroke="{colour}" stroke-width="2">{tip}</circle>'
    if shape == "dot":
        return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}">{tip}</circle>'
    if shape == "diamond":
        return (f'<polygon points="{x:.1f},{y - 6:.1f} {x + 6:.1f},{y:.1f} {x:.1f},{y + 6:.1f} {x - 6:.1f},{y:.1f}" '
                f'fill="{colour}">{tip}</polygon>')
    if shape == "triangle":
        return (f'<polygon points="{x:.1f},{y + 2:.1f} {x - 6:.1f},{y - 10:.1f} {x + 6:.1f},{y - 10:.1f}" '
                f'fill="{colour}">{tip}</polygon>')
    if shape == "star":
        return (f'<polygon points="{x:.1f},{y - 8:.1f} {x + 2.5:.1f},{y - 2:.1f} {x + 8:.1f},{y - 2:.1f} '
                f'{x + 3.5:.1f},{y + 2:.1f} {x + 5:.1f},{y + 8:.1f} {x:.1f},{y + 4.5:.1f} {x - 5:.1f},{y + 8:.1f} '
                f'{x - 3.5:.1f},{y + 2:.1f} {x - 8:.1f},{y - 2:.1f} {x - 2.5:.1f},{y - 2:.1f}" fill="{colour}">{tip}</polygon>')
    return f'<rect x="{x - 1.5:.1f}" y="{y - 9:.1f}" width="3" height="18" fill="{colour}">{tip}</rect>'


def _legend(y: float) -> List[str]:
    out = ['<g class="legend">']
    xx = float(LEFT)
    for key, (_, _, label) in STYLE.items():
        out.append(_mark(xx, y, key, label))
        out.append(f'<text x="{xx + 10:.1f}" y="{y + 4:.1f}">{escape(label)}</text>')
        xx += 12 + 7 * len(label) + 18
        if xx > WIDTH - 160:
            xx, y = float(LEFT), y + 22
    out.append("</g>")
    return out


def write(rd: RunDir, path: str) -> None:
    """Write the timeline of ``rd`` to ``path`` (atomically: a temp file, then rename)."""
    data = svg(rd).encode("utf-8")
    # mkstemp in the target's folder (O_EXCL, an unpredictable name): a predictable name
    # in a sticky /tmp could be another user's symlink, and the write would follow it.
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=os.path.dirname(path) or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fchmod(f.fileno(), 0o644)  # a picture to share, as open() would have made it
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


__all__ = ["marks", "svg", "write"]
