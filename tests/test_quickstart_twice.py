"""Issue 15, point 3: the quickstart (docs/index.md) run twice in one shell, a crash and
then a clean run. Each run keeps its own run directory: the first run's printed report
path still holds its report, and `peerwatch report` on the newest run says plainly that
it succeeded, naming no file that does not exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import free_port

import peerwatch

DOCS = Path(__file__).parents[1] / "docs" / "index.md"


def quickstart_script() -> str:
    text = DOCS.read_text()
    after = text.split("Save this as `train.py`", 1)[1]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


def _why_set_aside(base: Path) -> str:
    """What the first run left, for a failure's message: each run directory's verdict and
    registrations, and the clocks now (its verdict is compared with the second run's start)."""
    lines = [f"\nnow: time_ns {time.time_ns()}, CLOCK_BOOTTIME {time.clock_gettime_ns(time.CLOCK_BOOTTIME)}"]
    for run in sorted((base / "peerwatch").iterdir()):
        for name in ("events/verdict.json", "ranks/rank-00000.json", "ranks/rank-00001.json"):
            path = run / name
            lines.append(f"{path}: {path.read_text() if path.exists() else 'missing'}")
    return "\n".join(lines)


@pytest.mark.timeout(120)
def test_two_quickstart_runs_in_one_shell_keep_their_own_evidence(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(quickstart_script())
    base = tmp_path / "xdg"
    base.mkdir(mode=0o700)
    python = sys.executable
    shell = f"""
export MASTER_ADDR=127.0.0.1 MASTER_PORT={free_port()} WORLD_SIZE=2
RANK=0 {python} train.py &
RANK=1 CRASH=1 {python} train.py
wait $!; echo "first run, rank 0: $?"
RANK=0 {python} train.py &
RANK=1 {python} train.py
wait $!; echo "second run, rank 0: $?"
"""
    env = {k: v for k, v in os.environ.items()
           if k == "PEERWATCH_TEST_ID" or not k.startswith(("PEERWATCH_", "RANK", "WORLD_SIZE", "MASTER_"))}
    env.update(XDG_RUNTIME_DIR=str(base), PYTHONPATH=str(Path(peerwatch.__file__).parents[1]))
    out = subprocess.run(["bash", "-c", shell], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    log = out.stdout + out.stderr
    assert "first run, rank 0: 1" in log and "second run, rank 0: 0" in log, log
    assert "moved it to" not in log, log + _why_set_aside(base)  # no earlier run set aside
    printed = re.findall(r"report: (\S+)", log)
    assert len(printed) == 1, log
    first = Path(printed[0])
    assert first.exists(), log
    runs = sorted(p for p in (base / "peerwatch").iterdir() if p.is_dir())
    assert len(runs) == 2 and not any(".stale-" in p.name for p in runs), runs
    assert runs[1].name == runs[0].name + "-2", runs
    cli_env = dict(env)
    report = subprocess.run([python, "-m", "peerwatch", "report"], env=cli_env, capture_output=True, text=True,
                            timeout=30)
    assert report.returncode == 0, report.stderr
    assert "succeeded" in report.stdout.splitlines()[0], report.stdout
    for path in re.findall(r"report: (\S+)", report.stdout):
        assert Path(path).exists(), report.stdout
    again = subprocess.run([python, "-m", "peerwatch", "report", str(first.parent)], env=cli_env,
                           capture_output=True, text=True, timeout=30)
    assert "rank 1" in again.stdout.splitlines()[0] and "failed first" in again.stdout, again.stdout
