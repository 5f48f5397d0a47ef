"""``import peerwatch`` is cheap: no torch, no third-party package, not even the API's own
modules until first use (a DataLoader worker started by spawn re-imports the script)."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = (
    "import json, sys, peerwatch; before = sorted(sys.modules); "
    "peerwatch.install; peerwatch.Config; from peerwatch import watch, beat, paused; "
    "print(json.dumps([before, sorted(sys.modules)]))"
)


def _modules() -> tuple:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True)
    before, after = json.loads(out.stdout)
    return before, after


def test_import_loads_only_the_package_and_its_errors() -> None:
    before, after = _modules()
    ours = [m for m in before if m.startswith("peerwatch")]
    assert ours == ["peerwatch", "peerwatch._errors"]
    for heavy in ("torch", "lightning", "psutil", "watchdog", "filelock", "dataclasses"):
        assert heavy not in before, f"import peerwatch imported {heavy}"
    assert "peerwatch._api" in after and "peerwatch._config" in after
    assert "torch" not in after, "using the API imported torch"


def test_unknown_attribute_is_an_attribute_error() -> None:
    import peerwatch

    try:
        peerwatch.no_such_thing  # noqa: B018
    except AttributeError as e:
        assert "no_such_thing" in str(e)
    else:
        raise AssertionError("no AttributeError")
