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
    from peerwatch import _timeline
    from peerwatch._rundir import RunDir

    (tmp_path / "run" / "ranks").mkdir(parents=True)
    (tmp_path / "run" / "events").mkdir()
    ET.fromstring(_timeline.svg(RunDir(str(tmp_path / "run"))))
