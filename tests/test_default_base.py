"""Another user cannot turn protection off by making a name first: the default base
(``peerwatch-<uid>`` in a world-writable ``/tmp``) and the lock file beside a run
directory in a folder others can write. Tests run as root here; "another user" is uid
12345 owning what it made (os.chown), or a process of ours standing in for theirs."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

STRANGER_UID = 12345
INSTALL = ("import sys, peerwatch; h = peerwatch.install(); "
           "print('protected' if h is not None else 'unprotected', h.run_dir if h else '', flush=True)")


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PEERWATCH_DIR", "XDG_RUNTIME_DIR", "TMPDIR", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=os.pathsep.join(sys.path), PEERWATCH_GC_AGE="off", **extra)
    return env


def _install(env: dict, cwd: Path, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", INSTALL], env=env, cwd=str(cwd), capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a directory another uid owns")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("squat", ["directory", "symlink"])
def test_a_base_another_user_made_first_is_passed_over_not_fatal(tmp_path: Path, squat: str) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    os.chmod(tmp, 0o1777)  # like /tmp
    taken = tmp / f"peerwatch-{os.geteuid()}"
    if squat == "directory":
        taken.mkdir(mode=0o777)
        os.chown(taken, STRANGER_UID, STRANGER_UID)
    else:
        (tmp / "theirs").mkdir()
        os.symlink(tmp / "theirs", taken)
        os.lchown(taken, STRANGER_UID, STRANGER_UID)
    done = _install(_env(TMPDIR=str(tmp)), tmp_path)
    assert done.returncode == 0, done.stderr
    state, _, run_dir = done.stdout.strip().partition(" ")
    assert state == "protected", done.stdout + done.stderr
    assert run_dir.startswith(f"{taken}-2/"), run_dir
    assert f"{taken} " in done.stderr and "another user made it first" in done.stderr, done.stderr
    assert os.listdir(tmp / "theirs" if squat == "symlink" else taken) == []  # nothing written into theirs


@pytest.mark.timeout(90)
def test_a_lock_file_held_in_a_shared_folder_does_not_block_the_run(tmp_path: Path) -> None:
    """PEERWATCH_DIR in a sticky, world-writable folder: someone else holds ``<dir>.lock``
    there (made first, and locked for good). The run still prepares its directory at once:
    its lock lives in the user's own base, not beside the directory."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    (shared / "run.lock").write_text("")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'r+'); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(120)", str(shared / "run.lock")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        xdg = tmp_path / "xdg"
        xdg.mkdir(mode=0o700)
        # Waiting on their lock would end, after its 30 s timeout, in "unprotected".
        done = _install(_env(PEERWATCH_DIR=str(shared / "run"), XDG_RUNTIME_DIR=str(xdg)), tmp_path, timeout=80.0)
        assert done.stdout.startswith("protected"), done.stdout + done.stderr
        with open(shared / "run.lock") as f:  # still theirs, untouched
            with pytest.raises(BlockingIOError):
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        holder.kill()
        holder.wait()
