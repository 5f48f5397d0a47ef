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
            # A package's __init__ is its own module: ``from . import x`` in it names the
            # package itself, as in any module beside it.
            base = list(here[: len(here) - node.level])
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


# -- the layers (the table is the comment at the top of peerwatch/__init__.py) --------------

LAYERS = ("pure", "os", "stages", "wiring")

# Whole layers whose modules may import each other (the cycle test above keeps them acyclic).
SIDEWAYS_LAYERS = {
    "pure": "values and rules only: one pure module importing another brings in no I/O",
    "wiring": "the wiring calls itself: the API installs the hooks, which end the watcher; the CLI runs the doctor",
}
# Imports within the OS adapters and within the stages, each allowed for a reason.
SIDEWAYS = {
    ("_teardown", "_identity"): "a target is verified by its process identity right before it is signalled",
    ("_sources", "_identity"): "a peer's pidfd is opened only for the process that registered",
    ("_inotify", "_sources"): "inotify's descriptor is told to be ours as every other one is, by OwnedFd",
    ("_store_client", "_collectives"): "a store client uses torch.distributed as the application imported it, never importing it",
    ("_rundir", "_identity"): "a shared run directory names each host's own files by its host name",
    ("_rundir", "_dirfd"): "the records are read and written through the descriptors held since the check",
    ("_rundir", "_trust"): "a file kept open in the run directory is opened only if it is a regular file",
    ("_dirfd", "_trust"): "a directory is held only once it is checked to be ours alone",
    ("_basedir", "_identity"): "a run's directory is named by its launcher's process identity",
    ("_basedir", "_rundir"): "a directory of an earlier run that ended is told by its records, and passed over",
    ("_basedir", "_trust"): "the base is a place nobody else can write, checked as a run directory is",
    ("_prepare", "_identity"): "a stale run is told by whether its registered processes live",
    ("_prepare", "_rundir"): "preparing makes the run directory's folders and registers this rank in it",
    ("_prepare", "_basedir"): "the lock of a directory in a folder others can write lives in the base",
    ("_prepare", "_trust"): "every folder above a run directory is checked before it is made",
    ("_eventlog", "_trust"): "the event log is appended to only if it is a regular file",
    ("_stacks", "_trust"): "the stack file faulthandler writes is opened only if it is a regular file",
    ("_sharedfs", "_identity"): "local ranks are watched through pidfds, remote ones through their heartbeats",
    ("_sharedfs", "_rundir"): "remote heartbeats are listed and read through the run directory",
    ("_exitwatch", "_rundir"): "the exit watch is armed with descriptors of the run directory's folders",
    ("_eventlog", "_rundir"): "the event log is a file of the run directory",
    ("_stacks", "_rundir"): "the stack file is created through the run directory",
    ("_observer", "_heartbeat"): "this rank's own progress (OwnProgress) and position, as its heartbeat writes them",
    ("_observer", "_waker"): "the observer sleeps on the waker's descriptors (its poll set, wake pipe and folder watch)",
    ("_observer", "_ownrecords"): "the watcher thread's records are written by the one writer of this process's records",
    ("_bridge", "_election"): "the election of the host's one bridge is part of the bridge, in a module for size",
    ("_bridge", "_stragglerwatch"): "the bridge carries the stragglers' waits and finding across hosts (its relay)",
    ("_waits", "_collectives"): "whether a frame is torch.distributed's own code has one home",
    ("_timeline", "_report"): "the timeline draws the report's facts",
    ("_launchers", "_leave"): "a rank whose launcher is gone leaves the way every torn-down rank does",
    ("_leave", "_notify"): "an on_verdict command does not outlive the rank that started it",
}
# Modules of the standard library (and third-party ones) a pure module never imports.
IMPURE_IMPORTS = frozenset({
    "os", "subprocess", "socket", "select", "selectors", "threading", "multiprocessing", "ctypes", "fcntl", "time",
    "tempfile", "shutil", "faulthandler", "pathlib", "io", "mmap", "psutil", "watchdog", "filelock", "torch",
})
PURE_BUT = {"_config": ({"os", "stat"}, "Config.resolve() reads the environment and the secret file; a Config is a frozen value")}


def _layer_table() -> dict:
    """{module (without ``peerwatch.``): layer}, as the comment in peerwatch/__init__.py says."""
    table, layer = {}, None
    for line in (_ROOT / "peerwatch" / "__init__.py").read_text().splitlines():
        if not line.startswith("#   "):
            continue
        words = line[1:].split()
        if words and words[0] in LAYERS:
            layer = words[0]
        elif layer is not None and words and all(w.startswith("_") or w in ("cli", "integrations") for w in words):
            for w in words:
                assert w not in table, f"{w} is in two layers"
                table[w] = layer
    return table


def _layer_of(table: dict, module: str) -> str:
    short = module[len("peerwatch."):] if module.startswith("peerwatch.") else ""
    if module == "peerwatch":
        return "wiring"  # re-exports the API
    return table[short.split(".")[0]]


def _package_graph() -> dict:
    modules = {}
    for path in sorted((_ROOT / "peerwatch").rglob("*.py")):
        name = ".".join(path.with_suffix("").relative_to(_ROOT).parts)
        modules[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return {name: ({m for m in _imports_of(path, "peerwatch") if m in modules and m != name}, path) for name, path in modules.items()}


def test_every_module_has_a_layer() -> None:
    table = _layer_table()
    assert set(LAYERS) == set(table.values()), "the layer table in peerwatch/__init__.py did not parse"
    graph = _package_graph()
    unplaced = sorted(m for m in graph if m != "peerwatch" and m.split(".")[1] not in table)
    assert not unplaced, f"not in the layer table of peerwatch/__init__.py: {unplaced}"
    stale = sorted(m for m in table if f"peerwatch.{m}" not in graph)
    assert not stale, f"the layer table names modules that do not exist: {stale}"


def test_imports_go_only_downward() -> None:
    """Every import (top-level, lazy, TYPE_CHECKING) goes to a lower layer, or sideways where allowed."""
    table = _layer_table()
    crossings = []
    for name, (imports, _) in _package_graph().items():
        mine = _layer_of(table, name)
        for dep in sorted(imports):
            theirs = _layer_of(table, dep)
            if LAYERS.index(theirs) < LAYERS.index(mine):
                continue
            pair = (name.split(".")[-1], dep.split(".")[-1])
            if theirs == mine and (mine in SIDEWAYS_LAYERS or pair in SIDEWAYS):
                continue
            crossings.append(f"{name} ({mine}) imports {dep} ({theirs})")
    assert not crossings, "\n".join(crossings)
    used = {(a, b) for name, (imports, _) in _package_graph().items() for a, b in
            ((name.split(".")[-1], d.split(".")[-1]) for d in imports)}
    assert not set(SIDEWAYS) - used, f"allowed but no longer made: {sorted(set(SIDEWAYS) - used)}"


def _stdlib_imports_of(path: "Path") -> set:
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_pure_modules_import_nothing_impure() -> None:
    """The most important rule: a pure module imports only pure modules of peerwatch, and no
    module of the standard library that does I/O, keeps time or starts threads."""
    table = _layer_table()
    pure = {m for m, layer in table.items() if layer == "pure"}
    for name, (imports, path) in _package_graph().items():
        short = name.split(".")[-1]
        if short not in pure:
            continue
        impure = sorted(d for d in imports if d.split(".")[-1] not in pure)
        assert not impure, f"{name} is pure but imports {impure}"
        allowed = PURE_BUT.get(short, (set(), ""))[0]
        io = sorted(_stdlib_imports_of(path) & IMPURE_IMPORTS - allowed)
        assert not io, f"{name} is pure but imports {io}"


# -- the run directory's files only through its descriptors (issue 25.5) --------------------

# Calls that open, list or look at a path: given a path of RunDir.join(), they would go
# around the descriptors RunDir holds (RunDir.open_file, open_folder, stat, exists, names).
_PATH_CALLS = frozenset({
    "open", "open_regular", "os.open", "os.stat", "os.lstat", "os.listdir", "os.scandir", "os.unlink", "os.remove",
    "os.rename", "os.replace", "os.mkdir", "os.makedirs", "os.rmdir", "os.chmod", "os.utime", "os.access",
    "os.readlink", "os.symlink", "os.link", "os.path.exists", "os.path.lexists", "os.path.isfile", "os.path.isdir",
    "os.path.islink", "os.path.getmtime", "os.path.getsize", "shutil.rmtree", "shutil.move",
})


def _dotted(node: object) -> str:
    import ast

    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _joined_path(node: object) -> bool:
    """``something.join(...)`` that is not ``os.path.join`` nor ``"sep".join``: RunDir.join."""
    import ast

    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join"
            and _dotted(node.func.value) not in ("os.path", "posixpath")
            and not isinstance(node.func.value, ast.Constant))


def _under_run_dir(node: object, joined: set) -> bool:
    """A path under the run directory: ``run_dir.join(...)``, ``os.path.join(<a RunDir's
    .path>, ...)`` (``rd.path``, ``self.run_dir.path``...), the same on a name given such a
    path, or that name itself."""
    import ast

    if _joined_path(node) or (isinstance(node, ast.Name) and node.id in joined):
        return True
    if isinstance(node, ast.Call) and _dotted(node.func) in ("os.path.join", "posixpath.join") and node.args:
        first = node.args[0]
        run_dir_path = (isinstance(first, ast.Attribute) and first.attr == "path"
                        and _dotted(first.value).split(".")[-1] in ("rd", "run_dir"))
        return run_dir_path or _under_run_dir(first, joined)
    return False


def test_no_module_opens_lists_or_stats_a_path_of_run_dir_join() -> None:
    import ast

    found = []
    for path in sorted((_ROOT / "peerwatch").rglob("*.py")):
        if path.name == "_rundir.py":
            continue
        for func in ast.walk(ast.parse(path.read_text())):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            joined: set = set()  # names given a path under the run directory in this function
            assigns = [n for n in ast.walk(func) if isinstance(n, ast.Assign)]
            for _ in range(3):  # a name built on such a name, built on such a name
                joined |= {t.id for n in assigns if _under_run_dir(n.value, joined)
                           for t in n.targets if isinstance(t, ast.Name)}
            for call in ast.walk(func):
                if isinstance(call, ast.Call) and _dotted(call.func) in _PATH_CALLS:
                    for arg in call.args[:1]:
                        if _under_run_dir(arg, joined):
                            found.append(f"{path.name}:{call.lineno} {_dotted(call.func)}(a path under the run directory)")
    assert not found, "\n".join(sorted(set(found)))
