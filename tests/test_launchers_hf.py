"""End to end under two more launchers, as users run them on CPU: Hugging Face
Accelerate's ``accelerate launch`` and DeepSpeed's ``deepspeed``.

Same rules as tests/test_launchers.py: one process of the job dies; every process of the
job (held by pidfds) must be gone within ``WITHIN_S`` of the death, with the right exit
codes, a report that names the rank, and nothing left behind (conftest's ``no_leaks``).
Each launcher's tests skip, saying why, where it is not installed (``pip install
-e .[launchers]``).
"""

from __future__ import annotations

import importlib.util
import re
import signal
import sys
from pathlib import Path
from typing import Dict, List, Optional

import pytest
from launcher_jobs import PROGRAM, LauncherJob, exit_code, free_port

pytestmark = [pytest.mark.torch]
pytest.importorskip("torch")

WITHIN_S = 2.0  # from the death to the last rank gone
# Under DeepSpeed a survivor waits up to DEEPSPEED_AGENT_WAIT_S (1.5 s) for the launcher,
# which looks once a second, to reap the dead rank: 0.5-1.0 s measured. A deadline.
DEEPSPEED_WITHIN_S = 3.0
LAUNCHER_EXIT_S = 30.0
GRACE_S = 2.0
SIGKILL_EXIT = 128 + signal.SIGKILL
WORLD = 3
BIN = Path(sys.executable).parent

needs_accelerate = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None,
    reason="Hugging Face Accelerate is not installed (pip install -e .[launchers])",
)
needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="DeepSpeed is not installed (DS_BUILD_OPS=0 pip install deepspeed)",
)


def only_report(job: LauncherJob) -> dict:
    reports = {name: r for name, r in job.reports().items() if r.get("verdict")}
    assert len(reports) == 1, f"expected one run with a verdict, got {sorted(job.reports())}\n{job.log()}"
    return next(iter(reports.values()))


def codes(job: LauncherJob, ranks: Dict[int, int]) -> Dict[int, Optional[int]]:
    return {rank: exit_code(job.returncode(pid)) for rank, pid in sorted(ranks.items())}


def accelerate_job(tmp_path: Path, env: Optional[Dict[str, str]] = None) -> LauncherJob:
    argv: List[str] = [
        str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", str(WORLD), "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
        str(PROGRAM), "accelerate",
    ]
    # HF_HOME: no user's `accelerate config` file changes what the test runs.
    full_env = {"HF_HOME": str(tmp_path / "hf"), **(env or {})}
    return LauncherJob(tmp_path / "accelerate", argv, world=WORLD, env=full_env, grace=GRACE_S)


def deepspeed_job(tmp_path: Path, env: Optional[Dict[str, str]] = None) -> LauncherJob:
    argv = [str(BIN / "deepspeed"), "--num_gpus", str(WORLD), "--master_port", str(free_port()),
            str(PROGRAM), "deepspeed"]
    return LauncherJob(tmp_path / "deepspeed", argv, world=WORLD, env=env, grace=GRACE_S)


def torchrun_root_cause(log: str) -> int:
    section = log.split("Root Cause (first observed failure):", 1)
    assert len(section) == 2, f"torchrun printed no root cause\n{log[-3000:]}"
    found = re.search(r"rank\s*:\s*(\d+)", section[1])
    assert found is not None
    return int(found.group(1))


def launch_process(job: LauncherJob) -> int:
    """The pid of ``python -m deepspeed.launcher.launch``, the ranks' parent (a child of
    the ``deepspeed`` command the test started)."""
    assert job.launcher is not None
    (pid,) = {ppid for pid, ppid in job.parents.items() if pid in set(job.ranks.values())}
    assert job.parents.get(pid) == job.launcher.pid, job.parents
    return pid


# -- accelerate launch --multi_gpu --num_processes 3 (Accelerator(cpu=True): gloo) -------------


@needs_accelerate
@pytest.mark.timeout(180)
def test_accelerate_rank_sigkilled(tmp_path: Path) -> None:
    """`accelerate launch` runs torchrun's agent in its own process: the ranks agree on a
    torchrun run directory, are gone within WITHIN_S, and accelerate exits 1 naming rank 1."""
    with accelerate_job(tmp_path) as job:
        job.start()
        ranks = job.wait_ready()
        job.kill(ranks[1])
        assert job.wait_all_gone(WITHIN_S, but_launcher=True) <= WITHIN_S
        assert job.wait_launcher(LAUNCHER_EXIT_S) == 1
        log = job.log(limit=200_000)
        assert torchrun_root_cause(log) == 1, log[-3000:]
        assert "exitcode  : -9" in log
        assert job.launcher is not None
        names = [d.name for d in job.run_dirs()]
        assert len(names) == 1 and names[0].startswith(f"torchrun-none-{job.launcher.pid}."), names
        for report in job.reports().values():  # the agent may SIGTERM the survivors first
            assert report["verdict"]["rank"] == 1


@needs_accelerate
@pytest.mark.timeout(180)
def test_accelerate_rank_raises(tmp_path: Path) -> None:
    with accelerate_job(tmp_path, env={"LP_FAIL_RANK": "2"}) as job:
        job.start()
        ranks = job.wait_ready()
        job.wait_died(ranks[2], timeout=60)
        assert job.wait_all_gone(WITHIN_S, but_launcher=True) <= WITHIN_S
        assert job.wait_launcher(LAUNCHER_EXIT_S) == 1
        log = job.log(limit=200_000)
        assert torchrun_root_cause(log) == 2, log[-3000:]
        verdict = only_report(job)["verdict"]
        assert (verdict["rank"], verdict["cause"], verdict["exception"]) == (2, "exception", "RuntimeError")
        assert "rank 2 (pid" in log and "failed first: raised RuntimeError: rank 2 failed on purpose" in log


@needs_accelerate
@pytest.mark.timeout(180)
def test_accelerate_process_sigkilled_orphans_are_torn_down(tmp_path: Path) -> None:
    """The `accelerate` process is torchrun's agent: when it dies, its workers are torn down."""
    with accelerate_job(tmp_path) as job:
        job.start()
        ranks = job.wait_ready()
        assert job.launcher is not None
        job.kill(job.launcher.pid)
        assert job.wait_all_gone(WITHIN_S) <= WITHIN_S
        assert codes(job, ranks) == {0: 1, 1: 1, 2: 1}
        verdict = only_report(job)["verdict"]
        assert verdict["cause"] == "lost" and "torchrun agent" in verdict["message"]


# -- deepspeed --num_gpus 3 (CPU accelerator, deepspeed.init_distributed("gloo")) ---------------


@needs_deepspeed
@pytest.mark.timeout(420)  # the first run on a machine compiles DeepSpeed's shm op (about 90 s here)
def test_deepspeed_rank_sigkilled(tmp_path: Path) -> None:
    """The survivors wait for DeepSpeed's launcher (it looks once a second) to reap the
    killed rank: `deepspeed` then exits with that rank's status, -9 as sys.exit(-9): 247."""
    with deepspeed_job(tmp_path) as job:
        job.start()
        ranks = job.wait_ready(timeout=300)
        launch_process(job)
        job.kill(ranks[1])
        assert job.wait_all_gone(DEEPSPEED_WITHIN_S, but_launcher=True) <= DEEPSPEED_WITHIN_S
        assert job.wait_launcher(LAUNCHER_EXIT_S) == 256 - signal.SIGKILL
        verdict = only_report(job)["verdict"]
        assert (verdict["rank"], verdict["cause"]) == (1, "vanished")
        assert "exits with return code = -9" in job.log(limit=200_000)


@needs_deepspeed
@pytest.mark.timeout(420)
def test_deepspeed_rank_raises(tmp_path: Path) -> None:
    with deepspeed_job(tmp_path, env={"LP_FAIL_RANK": "2"}) as job:
        job.start()
        ranks = job.wait_ready(timeout=300)
        job.wait_died(ranks[2], timeout=60)
        assert job.wait_all_gone(WITHIN_S, but_launcher=True) <= WITHIN_S
        assert job.wait_launcher(LAUNCHER_EXIT_S) == 1
        verdict = only_report(job)["verdict"]
        assert (verdict["rank"], verdict["cause"], verdict["exception"]) == (2, "exception", "RuntimeError")
        log = job.log(limit=200_000)
        assert "failed first: raised RuntimeError: rank 2 failed on purpose" in log


@needs_deepspeed
@pytest.mark.timeout(420)
def test_deepspeed_launcher_sigkilled_orphans_are_torn_down(tmp_path: Path) -> None:
    """DeepSpeed's per-host launcher dies: nothing of DeepSpeed's ends its workers (they
    would train on, orphans); peerwatch's launcher watch tears them down (code 1). The
    `deepspeed` command then exits 0: it passes on only a positive status."""
    with deepspeed_job(tmp_path) as job:
        job.start()
        ranks = job.wait_ready(timeout=300)
        job.kill(launch_process(job))
        assert job.wait_all_gone(WITHIN_S, but_launcher=True) <= WITHIN_S
        assert job.wait_launcher(LAUNCHER_EXIT_S) == 0
        assert codes(job, ranks) == {0: 1, 1: 1, 2: 1}
        verdict = only_report(job)["verdict"]
        assert verdict["cause"] == "lost" and "DeepSpeed launcher" in verdict["message"]
