"""What peerwatch costs at start: ``import peerwatch`` and ``install()``, each in a fresh
interpreter, many times. Used by run.py."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from typing import Callable, List

from _common import clean_env

IMPORT = """
import sys, time, json
t = time.perf_counter()
import peerwatch
dt = time.perf_counter() - t
print(json.dumps({"s": dt, "torch": "torch" in sys.modules}))
"""

INSTALL = """
import sys, time, json
import peerwatch
t = time.perf_counter()
peerwatch.install()
dt = time.perf_counter() - t
print(json.dumps({"s": dt, "torch": "torch" in sys.modules}))
"""


@dataclasses.dataclass
class Startup:
    python_ms: List[float]  # wall time of `python -c pass`
    python_import_ms: List[float]  # wall time of `python -c "import peerwatch"`
    import_ms: List[float]  # `import peerwatch`, timed inside the interpreter (bytecode cached, as installed)
    install_ms: List[float]  # `peerwatch.install()`, timed inside (a new run dir each time, 1 rank)
    torch_imported: bool


def _wall(argv: List[str], env: dict) -> float:
    t = time.perf_counter()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
    return (time.perf_counter() - t) * 1000


def _inner(code: str, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def startup(runs: int, progress: Callable[[str], None]) -> Startup:
    env = clean_env()
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    result = Startup([], [], [], [], False)
    with tempfile.TemporaryDirectory(prefix="pw-bench-") as d:
        _inner(IMPORT, env)  # writes peerwatch's bytecode if it is not there yet
        for i in range(runs):
            # Interleaved, so that a busy moment of the machine falls on every kind alike.
            result.python_ms.append(_wall([sys.executable, "-c", "pass"], env))
            result.python_import_ms.append(_wall([sys.executable, "-c", "import peerwatch"], env))
            r = _inner(IMPORT, env)
            result.import_ms.append(r["s"] * 1000)
            result.torch_imported |= r["torch"]
            r = _inner(INSTALL, dict(env, RANK="0", WORLD_SIZE="1", PEERWATCH_DIR=f"{d}/run{i}"))
            result.install_ms.append(r["s"] * 1000)
            result.torch_imported |= r["torch"]
        progress(f"startup: {runs} runs")
    return result


__all__ = ["Startup", "startup"]
