"""No false positives: clean runs under scheduling noise are never torn down.

A CI-sized run of ``benchmarks/false_positives.py`` (which runs 500 by default): 10 clean
4-rank jobs, two at a time, next to a CPU burner; ranks finish at staggered times after
random sleeps and CPU bursts. Zero teardowns, zero stuck jobs. The seed is random per run
and printed on failure (``--seed`` reproduces it).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "false_positives.py"
RUNS = 10


def _load():
    spec = importlib.util.spec_from_file_location("false_positives", BENCHMARK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["false_positives"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(150)
def test_clean_runs_under_noise_are_never_torn_down() -> None:
    fp = _load()
    result = fp.benchmark(RUNS, parallel=2, burners=1)
    bad = [r for r in result.runs if r.teardown or r.stuck or r.error]
    details = "\n".join(
        f"run {r.index} ({r.style}, {r.api}, sync={r.sync}): codes {r.codes}, verdict={r.verdict}, "
        f"stuck={r.stuck} {r.error}\n{r.logs}" for r in bad
    )
    assert len(result.runs) == RUNS
    assert not bad, f"{len(bad)} of {RUNS} clean runs went wrong (seed {result.seed}):\n{details}\n{fp.table(result)}"
