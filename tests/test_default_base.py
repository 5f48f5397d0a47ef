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
from typing import Tuple

import pytest
from harness import free_port

STRANGER_UID = 12345
INSTALL = ("import sys, peerwatch; h = peerwatch.install(); "
           "print('protected' if h is not None else 'unprotected', h.run_dir if h else '', flush=True)")


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PEERWATCH_DIR", "XDG_RUNTIME_DIR", "XDG_CACHE_HOME", "TMPDIR", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=os.pathsep.join(sys.path), PEERWATCH_GC_AGE="off", **extra)
    return env


def _install(env: dict, cwd: Path, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", INSTALL], env=env, cwd=str(cwd), capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a directory another uid owns")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("squat", ["directory", "symlink"])
def test_without_a_per_user_place_a_fixed_name_another_user_made_first_is_passed_over(tmp_path: Path, squat: str) -> None:
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
    done = _install(_env(TMPDIR=str(tmp), HOME=""), tmp_path)  # no per-user place: the fixed names, last
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


# -- no fixed names: the base is private, or unpredictable and recorded (issue 22.5) ----------------


def _squat_four(tmp: Path) -> None:
    """Another user makes every fixed name first: two directories of theirs, two symlinks."""
    first = tmp / f"peerwatch-{os.geteuid()}"
    for n, path in enumerate([first] + [Path(f"{first}-{n}") for n in range(2, 5)]):
        if n % 2 == 0:
            path.mkdir(mode=0o777)
            os.chown(path, STRANGER_UID, STRANGER_UID)
        else:
            target = tmp / f"theirs-{n}"
            target.mkdir()
            os.chown(target, STRANGER_UID, STRANGER_UID)
            os.symlink(target, path)
            os.lchown(path, STRANGER_UID, STRANGER_UID)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make directories another uid owns")
def _squatted_tmp_and_home(tmp_path: Path) -> Tuple[Path, Path]:
    """A world-writable tmp whose four fixed names another user took first, and a private home."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    os.chmod(tmp, 0o1777)
    _squat_four(tmp)
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    return tmp, home


@pytest.mark.timeout(90)
@pytest.mark.parametrize("where", ["default", "PEERWATCH_DIR in the shared tmp"])
def test_four_names_taken_in_tmp_do_not_switch_protection_off(make_job, tmp_path: Path, where: str) -> None:
    """Another user made ``peerwatch-<uid>`` and ``-2`` ... ``-4`` in the world-writable tmp
    first. Every rank still runs protected, with the default base or an explicit
    ``PEERWATCH_DIR`` in that tmp (whose lock lived in the squatted base), and a SIGKILLed
    rank is acted on: the others are torn down."""
    tmp, home = _squatted_tmp_and_home(tmp_path)
    env = {"TMPDIR": str(tmp), "HOME": str(home), "XDG_RUNTIME_DIR": None, "XDG_CACHE_HOME": None,
           "PEERWATCH_DIR": None if where == "default" else str(tmp / "x"), "PEERWATCH_GC_AGE": "off",
           # what makes ranks started by hand one run by default (their run directory's name)
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    job = make_job(world=3, env=env).start()
    try:
        job.wait_ready()
        job.kill(1)
        job.wait_gone(within=15.0)
    finally:
        job.kill_all()
    logs = job.logs()
    assert "NOT protected" not in logs, logs
    assert job.all_returncodes() == {0: 1, 1: -9, 2: 1}, logs
    for n in range(1, 5, 2):
        assert os.listdir(tmp / f"theirs-{n}") == []  # nothing written into theirs
    if where == "default":  # the run directory is in the private per-user base
        assert [p.name for p in (home / ".cache" / "peerwatch").iterdir() if p.name != "locks"], logs


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a directory another uid owns")
def test_without_a_local_home_the_tmp_base_is_unpredictable_recorded_and_passed_over_once_taken(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A home on a network filesystem cannot hold run directories (they would be taken for
    shared by hosts): the base is a directory of an unpredictable name in tmp, recorded in
    the home per host, so every rank of the host finds the same. If another user makes it
    after it was removed (a /tmp cleaner), it is passed over for a new one."""
    from peerwatch.rundir import basedir, trust

    tmp, home = _squatted_tmp_and_home(tmp_path)
    for var, value in (("TMPDIR", str(tmp)), ("HOME", str(home))):
        monkeypatch.setenv(var, value)
    for var in ("XDG_RUNTIME_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(basedir, "_local_fs", lambda path: False)  # as if the home were on NFS
    base = basedir.base_dir()
    assert os.path.dirname(base) == str(tmp) and os.path.basename(base).startswith(f"peerwatch-{os.geteuid()}-")
    assert base not in [str(tmp / f"peerwatch-{os.geteuid()}")] + [f"{tmp}/peerwatch-{os.geteuid()}-{n}" for n in range(2, 5)]
    assert trust.private_dir(base)
    assert basedir.base_dir() == base  # what every rank of this host computes
    assert len(os.listdir(home / ".cache" / "peerwatch" / "bases")) == 1
    # Ranks starting at once, before anything is recorded, agree on one.
    os.unlink(home / ".cache" / "peerwatch" / "bases" / os.listdir(home / ".cache" / "peerwatch" / "bases")[0])
    os.rmdir(base)
    code = ("from peerwatch.rundir import basedir; basedir._local_fs = lambda path: False; "
            "print(basedir.base_dir(), flush=True)")
    procs = [subprocess.Popen([sys.executable, "-c", code], env=_env(TMPDIR=str(tmp), HOME=str(home)),
                              stdout=subprocess.PIPE, text=True) for _ in range(4)]
    outs = {p.communicate(timeout=30)[0].strip() for p in procs}
    assert len(outs) == 1 and all(p.returncode == 0 for p in procs), outs
    base = outs.pop()
    assert os.path.dirname(base) == str(tmp) and trust.private_dir(base)
    fixed = {f"peerwatch-{os.geteuid()}-{n}" for n in range(2, 5)}
    assert [n for n in os.listdir(tmp) if n.startswith(f"peerwatch-{os.geteuid()}-") and n not in fixed] == \
        [os.path.basename(base)]  # the others' proposals were removed
    # Removed, and made again by another user: passed over, with a warning.
    os.rmdir(base)
    os.mkdir(base, 0o777)
    os.chown(base, STRANGER_UID, STRANGER_UID)
    with caplog.at_level("WARNING", logger="peerwatch"):
        other = basedir.base_dir()
    assert other != base and os.path.dirname(other) == str(tmp) and trust.private_dir(other)
    assert f"{base} is owned by uid {STRANGER_UID}" in caplog.text
    # Removed and not taken: made again under its name.
    os.rmdir(other)
    assert basedir.base_dir() == other and trust.private_dir(other)
