"""``peerwatch doctor`` as a user runs it: a real subprocess, its live self-test a real
4-rank job with one rank SIGKILLed. Every process of it inherits this test's
``PEERWATCH_TEST_ID``: the ``no_leaks`` fixture fails the test if one is left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECK_NAMES = ["pidfd", "inotify", "/proc", "namespace", "run dir base", "torch", "gpus", "store"]
SELF_TEST_NAMES = {"teardown", "exit codes", "report", "leftovers"}


def doctor(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "peerwatch", "doctor", *args], env=env, capture_output=True, text=True, timeout=timeout,
    )


def assert_checks(checks: List[Dict[str, Any]]) -> None:
    for c in checks:
        assert set(c) == {"name", "status", "detail", "meaning", "fix"}, c
        assert c["status"] in ("ok", "warn", "fail") and c["detail"], c
        assert c["status"] != "fail", c


@pytest.mark.timeout(120)
def test_the_checks_alone() -> None:
    text = doctor("--no-self-test", timeout=100)
    assert text.returncode == 0, text.stdout + text.stderr
    lines = text.stdout.splitlines()
    assert lines[0].startswith("peerwatch doctor: peerwatch ")
    assert [line[6:19].strip() for line in lines if line[:5].strip() in ("ok", "warn", "fail")] == CHECK_NAMES
    assert lines[-1].startswith("result: ok") and "self-test:" not in text.stdout

    result = json.loads(doctor("--no-self-test", "--json", timeout=100).stdout)
    assert (result["version"], result["ok"], result["self_test"]) == (1, True, None)
    assert [c["name"] for c in result["checks"]] == CHECK_NAMES
    assert_checks(result["checks"])


@pytest.mark.timeout(300)
def test_the_self_test_passes_here_and_leaves_nothing() -> None:
    out = doctor("--json", timeout=280)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout)
    assert result["ok"] is True
    assert_checks(result["checks"])
    test = result["self_test"]
    assert {c["name"] for c in test["checks"]} >= SELF_TEST_NAMES
    assert_checks(test["checks"])
    assert (test["world"], test["killed_rank"]) == (4, 2)
    assert test["exit_codes"]["2"] == -9 and len(test["exit_codes"]) == 4
    assert all(code not in (0, None) for code in test["exit_codes"].values())
    assert 0 < test["teardown_ms"] < 30_000
    assert test["leftover_pids"] == []
    assert "kept" not in test and not os.path.exists(test["run_dir"]), "a passing self-test removes its files"


@pytest.fixture
def read_only_runtime(tmp_path: Path) -> Any:
    """A private 256 MiB tmpfs (nothing is used unless written) (root only), mounted read-only, as XDG_RUNTIME_DIR: the base's parent
    exists, nothing can be written there. Unmounted after the test."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where = tmp_path / "runtime"
    where.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m,mode=0700", "tmpfs", str(where)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {out.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.parametrize("base", ["made", "not made yet"])
def test_a_read_only_base_fails_the_check(read_only_runtime: Path, monkeypatch: pytest.MonkeyPatch, base: str) -> None:
    """install() cannot write there ("Read-only file system"): the doctor must not say ok.
    It tries a real write (a file made and removed), not the mode bits nor access(2)."""
    from peerwatch.tools import doctor as _doctor

    if base == "made":
        (read_only_runtime / "peerwatch").mkdir(mode=0o700)
    remount = subprocess.run(["mount", "-o", "remount,ro", str(read_only_runtime)], capture_output=True, text=True)
    assert remount.returncode == 0, remount.stderr
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(read_only_runtime))
    check = _doctor.check_base()
    assert check.status == _doctor.FAIL, check
    assert "Read-only file system" in check.detail, check
    assert os.listdir(read_only_runtime) == (["peerwatch"] if base == "made" else [])


@pytest.mark.timeout(120)
def test_the_torch_line_says_the_hang_diagnosis_reads_the_flight_recorder() -> None:
    """Issue 23, point 6: the line said "peerwatch does not need the flight recorder", while
    the hang diagnosis reads its counters every heartbeat (docs/hangs.md)."""
    pytest.importorskip("torch.distributed")
    from peerwatch.tools import doctor as _doctor

    check = _doctor.check_torch()
    assert check.status == _doctor.OK, check
    assert "_dump_fr_trace_json" in check.detail, check
    assert "does not need" not in check.meaning and "hang diagnosis reads the flight recorder" in check.meaning, check


@pytest.mark.timeout(200)
def test_the_checks_alone_do_not_import_torch_in_the_doctors_process() -> None:
    """Issue 23.5: `doctor --no-self-test` took 5-60 s on a loaded machine, importing torch
    itself. torch is imported in a child (under a time limit), which says what the torch
    and GPU lines need; the doctor's own process never holds it."""
    code = ("import json, sys\n"
            "from peerwatch.tools import cli\n"
            "rc = cli.main(['doctor', '--no-self-test', '--json'])\n"
            "print(json.dumps({'rc': rc, 'torch': sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))}))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    lines = out.stdout.strip().splitlines()
    result, after = json.loads("\n".join(lines[:-1])), json.loads(lines[-1])
    assert after == {"rc": 0, "torch": []}, out.stdout + out.stderr
    torch_line = next(c for c in result["checks"] if c["name"] == "torch")
    try:
        import importlib.util

        installed = importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        installed = False
    if installed:  # the child's answer: the version, and what torch.distributed has
        assert torch_line["detail"].startswith("torch ") and "gloo " in torch_line["detail"], torch_line
    else:
        assert torch_line["detail"] == "not installed", torch_line
