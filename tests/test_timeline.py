"""``peerwatch report DIR --timeline FILE.svg`` from a real teardown: well-formed SVG, one
lane per rank, the failure, the acknowledgements, the signals and the ends drawn.

``PEERWATCH_DOCS_TIMELINE=1`` also copies the picture to docs/timeline.svg (how the one
in the docs was made)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from harness import Job

pytestmark = pytest.mark.timeout(60)

GRACE_S = 1.0
STUCK_S = 0.5 + GRACE_S + 2.0
SVG = "{http://www.w3.org/2000/svg}"
DOCS_SVG = Path(__file__).resolve().parents[1] / "docs" / "timeline.svg"


def test_the_timeline_of_a_real_teardown(make_job, tmp_path: Path) -> None:
    job: Job = make_job(world=4, behave=["1=ignore_term+gil"]).start()
    job.wait_ready()
    job.wait_holding_gil(1)
    job.kill(3)
    job.wait_gone(within=STUCK_S + 2.0)
    out = tmp_path / "timeline.svg"
    run = subprocess.run([sys.executable, "-m", "peerwatch", "report", str(job.run_dir), "--timeline", str(out)],
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    assert "failed first" in run.stdout
    root = ET.parse(out).getroot()  # well-formed XML
    assert root.tag == f"{SVG}svg"
    lanes = [g for g in root.iter(f"{SVG}g") if g.get("class") == "lane"]
    assert sorted(int(g.get("data-rank", "-1")) for g in lanes) == [0, 1, 2, 3]
    tips = {int(g.get("data-rank", "-1")): " | ".join(t.text or "" for t in g.iter(f"{SVG}title")) for g in lanes}
    assert "rank 3 failed" in tips[3]
    assert "SIGTERM to rank 1" in tips[1] and "SIGKILL to rank 1" in tips[1], tips[1]
    for rank in (0, 2):
        assert f"rank {rank} learned of the verdict" in tips[rank] and f"rank {rank} acknowledged" in tips[rank]
        assert f"rank {rank} ended" in tips[rank]
    assert "rank 1 ended" in tips[1]
    if os.environ.get("PEERWATCH_DOCS_TIMELINE") == "1":
        shutil.copyfile(out, DOCS_SVG)


def test_a_run_without_a_log_still_draws(tmp_path: Path) -> None:
    """An empty run directory (no log, no verdict): a picture with no lane, still SVG."""
    from peerwatch.rundir.rundir import RunDir
    from peerwatch.tools import timeline

    (tmp_path / "run" / "ranks").mkdir(parents=True)
    (tmp_path / "run" / "events").mkdir()
    ET.fromstring(timeline.svg(RunDir(str(tmp_path / "run"))))


def test_hostile_text_and_times_make_a_valid_picture_and_a_clean_terminal(make_job, tmp_path: Path) -> None:
    """Rank 1 raises with ESC, BEL and NUL in its message; the log gains a line at
    ts=9e18 and one at ts=1 (1970). ``peerwatch report --timeline`` ends at once with
    well-formed XML, and prints no control character to the terminal (issue 22.7)."""
    job: Job = make_job(world=2, behave=["1=raise_ctrl@0.2"]).start()
    job.wait_ready()
    job.wait_gone(within=STUCK_S + 2.0)
    with open(job.run_dir / "events.jsonl", "a") as f:
        f.write('{"v":1,"ts":9000000000000000000,"event":"ack","rank":0}\n{"v":1,"ts":1,"event":"ack","rank":1}\n')
    out = tmp_path / "pictures" / "timeline.svg"
    out.parent.mkdir()
    run = subprocess.run([sys.executable, "-m", "peerwatch", "report", str(job.run_dir), "--timeline", str(out)],
                         capture_output=True, timeout=30)
    assert run.returncode == 0, run.stderr
    assert b"failed first" in run.stdout
    controls = [c for c in run.stdout.decode() if (ord(c) < 32 and c not in "\n\t") or 0x7F <= ord(c) < 0xA0]
    assert not controls, run.stdout
    assert b"\\x1b[31mred" in run.stdout, run.stdout  # shown, escaped
    text = out.read_text()
    ET.fromstring(text)  # well-formed
    assert "\x1b" not in text and "\x07" not in text and "\x00" not in text
    assert os.listdir(out.parent) == ["timeline.svg"]


def test_the_picture_is_written_through_no_planted_temp_file(tmp_path: Path) -> None:
    """The temp file is made with mkstemp in the target's folder: a symlink planted at the
    old predictable name (``<path>.<pid>.tmp``) is not followed."""
    from peerwatch.rundir.rundir import RunDir
    from peerwatch.tools import timeline

    (tmp_path / "run" / "ranks").mkdir(parents=True)
    (tmp_path / "run" / "events").mkdir()
    precious = tmp_path / "precious"
    precious.write_text("keep")
    target = tmp_path / "timeline.svg"
    os.symlink(precious, f"{target}.{os.getpid()}.tmp")
    timeline.write(RunDir(str(tmp_path / "run")), str(target))
    assert precious.read_text() == "keep"
    ET.parse(target)


def test_a_timeline_that_cannot_be_written_is_said_in_one_line(tmp_path: Path) -> None:
    """A folder that does not exist, or a directory given as the file: one line and exit 2,
    no traceback and nothing left behind (before: a raw traceback, and a temp file)."""
    (tmp_path / "run" / "ranks").mkdir(parents=True)
    (tmp_path / "run" / "events").mkdir()
    (tmp_path / "adir").mkdir()
    for target in (tmp_path / "missing" / "x.svg", tmp_path / "adir"):
        run = subprocess.run([sys.executable, "-m", "peerwatch", "report", str(tmp_path / "run"), "--timeline", str(target)],
                             capture_output=True, text=True, timeout=30)
        assert run.returncode == 2, run
        said, *error = run.stderr.splitlines()  # first, which run directory it read
        assert said == f"peerwatch: showing {tmp_path / 'run'} (finished, as named)", run.stderr
        assert len(error) == 1 and error[0].startswith("peerwatch: cannot write the timeline to"), run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "run"]


def test_version() -> None:
    import peerwatch

    run = subprocess.run([sys.executable, "-m", "peerwatch", "--version"], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0 and run.stdout.strip() == f"peerwatch {peerwatch.__version__}", run
