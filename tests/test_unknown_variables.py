"""A ``PEERWATCH_*`` variable peerwatch does not read is warned about at ``install()``.

``PEERWATCH_HANG_TIMOUT=600`` (a typo of ``PEERWATCH_HANG_TIMEOUT``) was ignored without a
word: the job ran with no hang timeout. Now ``install()`` logs one warning per such
variable and process, naming the closest variable a user sets, and goes on (never an
error). No variable that peerwatch, its tools or its tests read or set is warned about:
every ``PEERWATCH_*`` name the repository holds is checked against the known ones.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launcher_jobs import FOREIGN_ENV

from peerwatch.core.config import KNOWN_VARS, unknown_variables

ROOT = Path(__file__).resolve().parent.parent
# Names the tests use on purpose as ones peerwatch does not know.
TYPOS = {"PEERWATCH_HANG_TIMOUT", "PEERWATCH_GC_KEPP", "PEERWATCH_GRACEFUL", "PEERWATCH_XYZZY"}
WHERE = ("peerwatch", "tests", "benchmarks", "examples", "docs", "dev", ".ci", "README.md")


def test_a_misspelt_variable_is_told_the_closest_one_a_user_sets() -> None:
    env = {"PEERWATCH_HANG_TIMOUT": "600", "PEERWATCH_GC_KEPP": "3", "PEERWATCH_XYZZY": "1",
           "PEERWATCH_GRACE": "2", "PEERWATCH_TEST_ID": "x", "HANG_TIMOUT": "1", "peerwatch_grace": "1"}
    assert unknown_variables(env) == [
        ("PEERWATCH_GC_KEPP", "PEERWATCH_GC_KEEP"),
        ("PEERWATCH_HANG_TIMOUT", "PEERWATCH_HANG_TIMEOUT"),
        ("PEERWATCH_XYZZY", None),
    ]


def test_no_variable_the_project_reads_or_sets_is_unknown() -> None:
    named = set()
    for top in WHERE:
        path = ROOT / top
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
        for f in files:
            try:
                text = f.read_text()
            except (UnicodeDecodeError, OSError):
                continue  # a binary file: the extension, a picture
            named.update(re.findall(r"\bPEERWATCH_[A-Z0-9_]*[A-Z0-9]\b", text))
    assert "PEERWATCH_HANG_TIMEOUT" in named and "PEERWATCH_DIR_OWNER" in named  # the search found them
    assert unknown_variables({name: "1" for name in named - TYPOS}) == []
    assert not TYPOS & KNOWN_VARS


@pytest.mark.timeout(60)
def test_install_warns_once_of_a_misspelt_variable_and_goes_on(tmp_path: Path, no_leaks: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in FOREIGN_ENV}
    env.update(PYTHONPATH=str(ROOT), RANK="0", WORLD_SIZE="1", PEERWATCH_DIR=str(tmp_path / "run"),
               PEERWATCH_HANG_TIMOUT="600", PEERWATCH_GC_KEEP="50", PEERWATCH_TEST_WHATEVER="1")
    code = ("import peerwatch\n"
            "h = peerwatch.install()\n"
            "assert h is not None and peerwatch.install().run_dir == h.run_dir\n"
            "print('protected, hang_timeout on:', h._w.config.hang_timeout.on)\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "protected, hang_timeout on: False\n"  # the typo set nothing
    said = [line for line in done.stderr.splitlines() if "PEERWATCH_" in line]
    assert said == ["peerwatch: the environment variable PEERWATCH_HANG_TIMOUT is not one of peerwatch's and is "
                    "ignored; did you mean PEERWATCH_HANG_TIMEOUT? (the variables: docs/configuration.md)"], done.stderr
