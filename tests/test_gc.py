"""The gc policy on a real base directory: live and finished runs, set-aside runs, a
symbolic link, another user's folder, another host's run; ``peerwatch gc [--dry-run]`` as a
real subprocess, and the automatic pass in ``install()``.

The base is the real default one, moved under tmp_path through ``XDG_RUNTIME_DIR`` (what
``basedir.base_dir`` reads). Live runs are registered by real sleeping processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List

import pytest
from harness import wait_read

from peerwatch.core.errors import RunDirError
from peerwatch.core.records import Registration, encode
from peerwatch.proc import identity
from peerwatch.rundir import basedir, gc, rundir

DAY_S = 86400.0
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.delenv(gc.KEEP_VAR, raising=False)
    monkeypatch.delenv(gc.AGE_VAR, raising=False)
    b = Path(basedir.base_dir())
    assert b == runtime / "peerwatch"
    b.mkdir(mode=0o700)
    return b


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def dead_pid() -> int:
    """The pid of a process that has ended (and was reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def registration(rank: int, pid: int, start_ticks: int, **kw: object) -> Registration:
    fields: Dict[str, object] = dict(
        rank=rank, pid=pid, ppid=os.getpid(), start_ticks=start_ticks, uid=os.geteuid(),
        host=identity.hostname(), boot_id=identity.boot_id(), pidns=identity.pid_namespace(), time_ns=time.time_ns(),
    )
    fields.update(kw)
    return Registration(**fields)  # type: ignore[arg-type]


def make_run(path: Path, regs: List[Registration], idle_s: float) -> Path:
    """A run directory holding ``regs``, every mtime in it ``idle_s`` in the past."""
    for sub in ("ranks", "events", "heartbeats", "stacks", "tmp"):
        (path / sub).mkdir(parents=True, mode=0o700)
    for reg in regs:
        (path / "ranks" / rundir.rank_file("rank", reg.rank)).write_bytes(encode(reg))
    age(path, idle_s)
    return path


def age(path: Path, idle_s: float) -> None:
    t = time.time() - idle_s
    for dirpath, dirnames, filenames in os.walk(path, topdown=False):
        for name in filenames + dirnames:
            os.utime(os.path.join(dirpath, name), (t, t), follow_symlinks=False)
    os.utime(path, (t, t), follow_symlinks=False)


def finished(path: Path, idle_s: float) -> Path:
    return make_run(path, [registration(0, dead_pid(), 1)], idle_s)


@pytest.mark.timeout(60)
def test_only_finished_runs_of_this_user_under_the_default_base_go(
    base: Path, tmp_path: Path, sleeper: subprocess.Popen, monkeypatch: pytest.MonkeyPatch
) -> None:
    info = identity.probe(sleeper.pid)
    assert info is not None
    monkeypatch.setenv(gc.KEEP_VAR, "2")
    live = make_run(base / "run-live", [registration(0, dead_pid(), 1), registration(1, sleeper.pid, info.start_ticks)], 30 * DAY_S)
    live_nested = make_run(base / "spawn-nested", [], 30 * DAY_S)
    make_run(live_nested / "spawn", [registration(0, sleeper.pid, info.start_ticks)], 30 * DAY_S)
    # The same pid with another start time is another process: that run is over.
    reused = make_run(base / "run-reused", [registration(0, sleeper.pid, info.start_ticks + 1)], 30 * DAY_S)
    other_host = make_run(base / "run-other-host", [registration(0, 1, 1, host="elsewhere", boot_id="b", pidns="p")], 30 * DAY_S)
    old = finished(base / "run-old", 8 * DAY_S)
    stale = finished(base / "run-x.stale-1700000000000000000", 9 * DAY_S)
    newest = [finished(base / f"run-recent-{i}", (i + 1) * 3600) for i in range(4)]
    fresh = finished(base / "run-fresh", 1)
    not_a_run = base / "notes"
    not_a_run.mkdir()
    age(not_a_run, 30 * DAY_S)
    outside = finished(tmp_path / "elsewhere" / "run-target", 30 * DAY_S)
    link = base / "run-link"
    link.symlink_to(outside)
    foreign = finished(base / "run-foreign", 30 * DAY_S)
    os.chown(foreign, 12345, 12345)
    orphan_lock = base / "run-gone.lock"
    orphan_lock.touch()
    age(orphan_lock, 2 * DAY_S)
    used_lock = base / "run-old.lock"
    used_lock.touch()
    age(used_lock, 2 * DAY_S)
    trash = base / ".gc-trash-1"
    (trash / "ranks").mkdir(parents=True)

    decisions = {Path(d.path): d for d in gc.collect(dry_run=True)}
    assert all(p.exists() for p in decisions), "a dry run removed something"
    removed = {p for p, d in decisions.items() if d.action == gc.REMOVE}
    expected = {reused, old, stale, newest[2], newest[3], orphan_lock, trash}
    assert removed == expected, {str(p): decisions[p].reason for p in removed ^ expected}
    assert "alive" in decisions[live].reason and "alive" in decisions[live_nested].reason
    assert "cannot be seen" in decisions[other_host].reason
    assert "symbolic link" in decisions[link].reason and "owned" in decisions[foreign].reason

    gc.collect()
    for p in expected:
        assert not os.path.lexists(p), p
    for p in (live, live_nested, other_host, newest[0], newest[1], fresh, not_a_run, link, foreign, used_lock):
        assert os.path.lexists(p), p
    assert (outside / "ranks").is_dir(), "gc followed the symbolic link"
    assert not [n for n in os.listdir(base) if n.startswith(gc.TRASH)]


@pytest.mark.timeout(60)
def test_the_cli_says_what_it_would_remove_and_why(base: Path, tmp_path: Path) -> None:
    old = finished(base / "run-old", 8 * DAY_S)
    kept = finished(base / "run-kept", 3600)
    given = finished(tmp_path / "given" / "run-mine", 30 * DAY_S)  # a user-given PEERWATCH_DIR
    env = dict(os.environ, PEERWATCH_DIR=str(given), PYTHONPATH=str(ROOT))
    dry = subprocess.run([sys.executable, "-m", "peerwatch", "gc", "--dry-run"], env=env, capture_output=True, text=True, timeout=30)
    assert dry.returncode == 0, dry.stderr
    assert f"would remove {old}: finished, idle for 8.0 days" in dry.stdout, dry.stdout
    assert f"kept         {kept}: finished, idle for" in dry.stdout, dry.stdout
    assert old.exists()
    real = subprocess.run([sys.executable, "-m", "peerwatch", "gc"], env=env, capture_output=True, text=True, timeout=30)
    assert real.returncode == 0, real.stderr
    assert f"removed      {old}" in real.stdout, real.stdout
    assert not old.exists() and kept.exists() and given.exists()
    bad = subprocess.run(
        [sys.executable, "-m", "peerwatch", "gc"], env=dict(env, PEERWATCH_GC_AGE="soon"), capture_output=True, text=True, timeout=30,
    )
    assert bad.returncode == 2 and "PEERWATCH_GC_AGE='soon'" in bad.stderr


@pytest.mark.timeout(60)
def test_the_policy_settings(base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = [finished(base / f"run-{i}", (i + 2) * DAY_S) for i in range(3)]
    monkeypatch.setenv(gc.AGE_VAR, "off")
    monkeypatch.setenv(gc.KEEP_VAR, "off")
    assert not [d for d in gc.collect() if d.action == gc.REMOVE]
    monkeypatch.setenv(gc.AGE_VAR, str(3.5 * DAY_S))
    assert {Path(d.path) for d in gc.collect() if d.action == gc.REMOVE} == {runs[2]}
    monkeypatch.setenv(gc.KEEP_VAR, "0")
    assert {Path(d.path) for d in gc.collect() if d.action == gc.REMOVE} == {runs[0], runs[1]}


@pytest.mark.timeout(60)
def test_an_untrusted_base_is_not_collected(base: Path) -> None:
    old = finished(base / "run-old", 30 * DAY_S)
    base.chmod(0o777)
    try:
        with pytest.raises(RunDirError):
            gc.collect()
    finally:
        base.chmod(0o700)
    assert old.exists()


@pytest.mark.timeout(60)
def test_install_collects_once_when_it_chose_the_run_directory(base: Path, tmp_path: Path) -> None:
    old = finished(base / "run-old", 8 * DAY_S)
    ready = tmp_path / "ready"
    program = (
        "import os, peerwatch, sys\n"
        "peerwatch.install()\n"
        f"open({str(ready)!r}, 'w').write(str(sorted(os.listdir({str(base)!r}))))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PEERWATCH_DIR", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT)
    # A user-given PEERWATCH_DIR: install() leaves the base alone.
    given = subprocess.run([sys.executable, "-c", program], env=dict(env, PEERWATCH_DIR=str(tmp_path / "given")), timeout=60)
    assert given.returncode == 0 and old.exists()
    ready.unlink()
    proc = subprocess.Popen([sys.executable, "-c", program], env=env)
    try:
        names = wait_read(ready, str, within=30, writer=proc)
    finally:
        assert proc.wait(timeout=30) == 0
    assert not old.exists(), names
    assert (base / gc.STAMP).exists()
    # Within the hour, another install() does not scan again.
    again = finished(base / "run-old-2", 8 * DAY_S)
    ready.unlink()
    assert subprocess.run([sys.executable, "-c", program], env=env, timeout=60).returncode == 0
    assert again.exists()


def test_a_kept_lock_of_a_directory_is_not_a_line_of_its_own(tmp_path: Path) -> None:
    """`peerwatch gc` printed "kept ... .lock" for every run (issue 23.5)."""
    run = tmp_path / "peerwatch-run"
    run.mkdir()
    (tmp_path / "peerwatch-run.lock").write_text("")
    entries = [gc.Entry(str(run) + ".lock", "lock", time.time(), sibling_dir=True),
               gc.Entry(str(tmp_path / "orphan.lock"), "lock", time.time() - 2 * gc.LOCK_AGE_S)]
    lines = gc.describe(gc.gc_plan(entries, gc.policy_from_env({}), time.time()), dry_run=True)
    assert len(lines) == 1 and lines[0].startswith("would remove") and "orphan.lock" in lines[0], lines
