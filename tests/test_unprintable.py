"""An exception whose ``__str__`` raises: recorded with its type and a placeholder message,
never an error of peerwatch's own. Real jobs of ``rank_program.py``."""

from __future__ import annotations

import pytest
from harness import Job

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("api", ["install", "watch"])
def test_an_unprintable_exception_keeps_its_type(make_job, api: str) -> None:
    job: Job = make_job(world=2, api=api, behave=["1=raise_unprintable@0.2"]).start()
    job.wait_ready()
    job.wait_gone(within=10.0)
    logs = job.logs()
    verdict = job.report()["verdict"]
    assert verdict["rank"] == 1 and verdict["cause"] == "exception", f"{verdict}\n{logs}"
    assert verdict["exception"] == "Unprintable", f"{verdict}\n{logs}"
    assert verdict["message"] == "<unprintable Unprintable>", f"{verdict}\n{logs}"
    assert "Error in sys.excepthook" not in logs and "hooks.py" not in logs, logs
    assert "this exception has no message" not in str(verdict), verdict
    assert job.exit_codes() == {0: 1, 1: 1}, logs
