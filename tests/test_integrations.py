"""The launcher side in one process: resolve() for mp.spawn workers, the launcher a rank
watches, quieting Lightning's child observer, the torch helpers. The real launchers are
in test_launchers.py."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
from typing import Any, Dict, Tuple

import pytest

from peerwatch import launchers
from peerwatch.rundir import basedir


def _resolve_in_child(env: Dict[str, str], queue: Any) -> None:
    queue.put((basedir.resolve(env.get("PEERWATCH_DIR"), env), basedir.process_key(os.getppid())))


def resolve_in_mp_child(env: Dict[str, str]) -> Tuple[Tuple[str, str], str]:
    """resolve() as a multiprocessing child of this process sees it; and its parent key."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_resolve_in_child, args=(env, queue))
    child.start()
    try:
        return queue.get(timeout=30)
    finally:
        child.join(30)


def test_spawn_worker_resolves_to_its_parent() -> None:
    (path, how), parent = resolve_in_mp_child({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    assert path == os.path.join(basedir.base_dir(), f"spawn-{parent}")
    assert parent == basedir.process_key(os.getpid())
    assert "spawn" in how


def test_spawn_worker_of_a_parent_that_installed_takes_the_spawn_subfolder(tmp_path: Any) -> None:
    given = str(tmp_path / "run")
    env = {"PEERWATCH_DIR": given, basedir.OWNER_VAR: basedir.process_key(os.getpid())}
    (path, _), _ = resolve_in_mp_child(env)
    assert path == os.path.join(given, "spawn")


def test_spawn_worker_keeps_a_directory_it_was_given(tmp_path: Any) -> None:
    given = str(tmp_path / "run")
    (path, how), _ = resolve_in_mp_child({"PEERWATCH_DIR": given})  # set by the user: no owner mark
    assert (path, how) == (given, "PEERWATCH_DIR")
    other = {"PEERWATCH_DIR": given, basedir.OWNER_VAR: "1.2"}  # exported by someone else
    (path, _), _ = resolve_in_mp_child(other)
    assert path == given


def test_torchrun_comes_before_the_spawn_rule() -> None:
    (path, _), parent = resolve_in_mp_child({"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "1"})
    assert os.path.basename(path) == f"torchrun-abc-{parent}-r1"


def test_no_launcher_outside_torchrun_and_multiprocessing() -> None:
    from peerwatch.core.records import Registration
    from peerwatch.proc import identity

    me = identity.self_info()
    reg = Registration(rank=0, pid=me.pid, ppid=me.ppid, start_ticks=me.start_ticks, uid=me.uid, host="h",
                       boot_id="b", pidns="p", time_ns=0)
    assert launchers.launcher_of(reg, {}) is None
    found = launchers.launcher_of(reg, {"TORCHELASTIC_RUN_ID": "x"})
    assert found is not None and found.pid == me.ppid and found.kind == "torchrun agent"


def test_deepspeed_launcher_is_known_by_its_command_line() -> None:
    """`deepspeed` starts `python -u -m deepspeed.launcher.launch ...` on each host; that
    process, and no other, is a DeepSpeed launcher (a real process with such arguments)."""
    assert not launchers.is_deepspeed_launcher(os.getpid())
    argv = [sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()", "-m",
            "deepspeed.launcher.launch", "--world_info=x"]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        # Once it speaks it has exec'd: before, its command line is still this process's
        # (seen under load: the child not yet exec'd when Popen returned).
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        assert launchers.is_deepspeed_launcher(proc.pid)
    finally:
        proc.communicate(timeout=30)  # stdin closed: it ends
    assert not launchers.is_deepspeed_launcher(2**22 + 1)  # no such process


def test_quiet_lightning_observer() -> None:
    pytest.importorskip("lightning")
    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

    class Failed:
        pid, returncode = 0, 1

        def poll(self) -> int:
            return 1

        def send_signal(self, sig: int) -> None:
            raise AssertionError("the quieted observer signalled a child")

    observer = _ChildProcessObserver(main_pid=os.getpid(), child_processes=[Failed()], sleep_period=3600)
    observer.start()  # asleep for an hour: we only look at what it would do on waking
    try:
        assert launchers.quiet_lightning_observer() == 1
        assert observer._run() is True  # "finished": it would stop looking, and kill nothing
        observer._terminate_all()
    finally:
        observer._finished = True
    assert isinstance(observer, threading.Thread) and observer.daemon


def test_rank_and_world_size_from_a_process_group(tmp_path: Any) -> None:
    code = (
        "import torch.distributed as dist, sys\n"
        "from peerwatch.integrations import torch as t\n"
        "assert t.rank_and_world_size() is None\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, world_size=1)\n"
        "print(t.rank_and_world_size(), t.options_from_process_group({}), t.options_from_process_group({'rank': 0}))\n"
        "sys.stdout.flush()\n"
        "dist.destroy_process_group()\n"  # not left to the exit: gloo can abort there (test_collectives)
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "PEERWATCH_RANK")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "(0, 1) {'rank': 0, 'world_size': 1} {'rank': 0, 'world_size': 1}"


def test_importing_the_package_imports_neither_torch_nor_lightning() -> None:
    code = "import sys, peerwatch, peerwatch.integrations; print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr
