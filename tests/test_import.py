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


def _imports_of(path: "Path", package: str) -> set:
    """Every peerwatch module that ``path`` imports anywhere: at the top, inside functions
    (lazily) or under ``TYPE_CHECKING``."""
    import ast

    tree = ast.parse(path.read_text())
    here = path.with_suffix("").relative_to(path.parents[len(path.relative_to(_ROOT).parts) - 1]).parts
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            base = list(here[: len(here) - node.level]) if path.name != "__init__.py" else list(here[: len(here) - node.level + 1])
            if node.module:
                base += node.module.split(".")
                found.add(".".join(base))
            else:
                found.update(".".join(base + [alias.name]) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == package:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == package)
    return found


from pathlib import Path  # noqa: E402

_ROOT = Path(__file__).resolve().parent.parent


def test_no_module_imports_a_module_that_imports_it() -> None:
    """The stages form a layered graph: no cycle, lazy and TYPE_CHECKING imports included
    (``peerwatch`` itself, which only re-exports, and the integrations, which use only the
    package's public names, are left out as importers of everything)."""
    modules = {}
    for path in sorted((_ROOT / "peerwatch").rglob("*.py")):
        name = ".".join(path.with_suffix("").relative_to(_ROOT).parts)
        if name.endswith(".__init__"):
            name = name[: -len(".__init__")]
        modules[name] = path
    graph = {
        name: {m for m in _imports_of(path, "peerwatch") if m in modules and m != "peerwatch"}
        for name, path in modules.items() if name != "peerwatch"
    }
    cycles = []
    for start in graph:
        stack = [(start, [start])]
        while stack:
            node, trail = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    cycles.append(" -> ".join(trail + [start]))
                elif nxt not in trail:
                    stack.append((nxt, trail + [nxt]))
    assert not cycles, "\n".join(sorted(set(cycles))[:10])
    assert graph["peerwatch._errors"] == set(), "_errors imports nothing else from peerwatch"
