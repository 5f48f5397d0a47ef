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
    assert ours == ["peerwatch", "peerwatch.core", "peerwatch.core.errors"]  # core/__init__.py imports nothing
    for heavy in ("torch", "lightning", "psutil", "watchdog", "filelock", "dataclasses"):
        assert heavy not in before, f"import peerwatch imported {heavy}"
    assert "peerwatch.api" in after and "peerwatch.core.config" in after
    assert "torch" not in after, "using the API imported torch"


def test_unknown_attribute_is_an_attribute_error() -> None:
    import peerwatch

    try:
        peerwatch.no_such_thing  # noqa: B018
    except AttributeError as e:
        assert "no_such_thing" in str(e)
    else:
        raise AssertionError("no AttributeError")


def _modules_of() -> dict:
    """{dotted name: path} of every Python module of the package (a package is its __init__)."""
    modules = {}
    for path in sorted((_ROOT / "peerwatch").rglob("*.py")):
        name = ".".join(path.with_suffix("").relative_to(_ROOT).parts)
        modules[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return modules


def _imports_of(path: "Path", modules: dict) -> set:
    """Every module of ``modules`` that ``path`` imports anywhere: at the top, inside functions
    (lazily) or under ``TYPE_CHECKING``. ``from P import x`` imports the module ``P.x`` where
    there is one, else ``P``; the native module (peerwatch/_exitstatus.c) is nobody's."""
    import ast

    here = path.with_suffix("").relative_to(_ROOT).parts
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            # A package's __init__ is its own module: ``from . import x`` in it names the
            # package itself, as in any module beside it.
            base = ".".join([*here[: len(here) - node.level], *(node.module or "").split(".")]).strip(".")
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    found.add(f"{base}.{alias.name}")
                elif not (_ROOT / base.replace(".", "/") / f"{alias.name}.c").exists():
                    found.add(base)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found & set(modules)


from pathlib import Path  # noqa: E402

_ROOT = Path(__file__).resolve().parent.parent


def _graph() -> dict:
    """{module: the modules it imports}; ``peerwatch/__main__.py`` is a program, imported by none."""
    modules = _modules_of()
    return {name: _imports_of(path, modules) - {name} for name, path in modules.items() if name != "peerwatch.__main__"}


def test_no_module_imports_a_module_that_imports_it() -> None:
    """No cycle between modules, lazy and TYPE_CHECKING imports included (``peerwatch``
    itself, which only re-exports, is left out as an importer of the API)."""
    graph = {name: deps - {"peerwatch"} for name, deps in _graph().items() if name != "peerwatch"}
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
    assert graph["peerwatch.core.errors"] == set(), "errors imports nothing else from peerwatch"


# -- the packages (the map is the comment at the top of peerwatch/__init__.py) --------------


def _package_of(module: str, modules: dict) -> str:
    return module if modules[module].name == "__init__.py" else module.rsplit(".", 1)[0]


def _declared() -> dict:
    """{package: the packages its __init__'s docstring says it imports} (``Imports: a, b.``)."""
    import ast
    import re

    declared = {}
    for path in sorted((_ROOT / "peerwatch").glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        m = re.search(r"^Imports: (.*)\.$", doc, re.M)
        assert m, f"{path.relative_to(_ROOT)}: its docstring has no line 'Imports: ...' naming the packages it imports"
        names = [] if m.group(1) == "nothing else of peerwatch" else m.group(1).split(", ")
        declared[f"peerwatch.{path.parent.name}"] = {"peerwatch" if n == "peerwatch" else f"peerwatch.{n}" for n in names}
    return declared


def _package_graph() -> dict:
    """{package: the other packages its modules import}."""
    modules = _modules_of()
    graph: dict = {}
    for name, deps in _graph().items():
        mine = _package_of(name, modules)
        graph.setdefault(mine, set()).update(_package_of(d, modules) for d in deps)
    return {package: deps - {package} for package, deps in graph.items()}


def test_each_package_imports_only_what_its_docstring_says() -> None:
    """A module imports anything in its own package; across packages, only those its
    package's __init__ declares (``peerwatch`` itself, the wiring, imports any below it)."""
    graph, declared = _package_graph(), _declared()
    wrong = [f"{p} imports {sorted(graph.get(p, set()))}, its docstring says {sorted(want)}"
             for p, want in sorted(declared.items()) if graph.get(p, set()) != want]
    assert not wrong, "\n".join(wrong)
    listed = (_ROOT / "peerwatch" / "__init__.py").read_text()
    unlisted = sorted(p for p in declared if f"#   {p.split('.')[1]}/ " not in listed)
    assert not unlisted, f"not in the package map of peerwatch/__init__.py: {unlisted}"


def test_no_package_imports_one_that_imports_it() -> None:
    """The packages form a DAG, lowest first: core, proc, rundir, hangs, then hosts and verdict,
    then the wiring (``peerwatch``), then tools and integrations."""
    graph = _package_graph()
    order: list = []
    while len(order) < len(graph):
        ready = sorted(p for p, deps in graph.items() if p not in order and deps <= set(order))
        assert ready, f"a cycle among {sorted(set(graph) - set(order))}"
        order += ready
    assert order.index("peerwatch.core") == 0 and order.index("peerwatch") < order.index("peerwatch.tools")


# The pure modules: no I/O, no clock, no threads; values and the rules over them.
PURE = frozenset({
    "core.errors", "core.records", "core.config", "core.terminal", "core.schedule", "core.awake", "core.mounts",
    "verdict.decide", "verdict.plan", "hangs.diagnose", "hangs.straggler", "hosts.hosts",
})
# Modules of the standard library (and third-party ones) a pure module never imports.
IMPURE_IMPORTS = frozenset({
    "os", "subprocess", "socket", "select", "selectors", "threading", "multiprocessing", "ctypes", "fcntl", "time",
    "tempfile", "shutil", "faulthandler", "pathlib", "io", "mmap", "psutil", "watchdog", "filelock", "torch",
})
PURE_BUT = {"core.config": ({"os", "stat"}, "Config.resolve() reads the environment and the secret file; a Config is a frozen value")}


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
    modules = _modules_of()
    assert {f"peerwatch.{m}" for m in PURE} <= set(modules), "PURE names a module that does not exist"
    for name, imports in _graph().items():
        short, path = name[len("peerwatch."):], modules[name]
        if short not in PURE:
            continue
        impure = sorted(d for d in imports if d[len("peerwatch."):] not in PURE)
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
        if path.relative_to(_ROOT).as_posix() == "peerwatch/rundir/rundir.py":
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
