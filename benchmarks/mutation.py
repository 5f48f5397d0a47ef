"""Mutation testing for peerwatch's pure modules: do their own unit tests notice a bug?

    .venv/bin/python benchmarks/mutation.py                      # every pure module vs its tests
    .venv/bin/python benchmarks/mutation.py peerwatch/verdict/decide.py tests/test_decide.py --jobs 2
    .venv/bin/python benchmarks/mutation.py peerwatch/core/config.py tests/test_config.py --list-survivors
    ./dev mutate [args]                                          # the same, after setting up .venv

Each mutant is the module with one small change made on its syntax tree:

- a comparison flipped at its boundary or negated: ``<`` <-> ``<=``, ``>`` <-> ``>=``,
  ``==`` <-> ``!=``, ``in`` <-> ``not in``, ``is`` <-> ``is not``;
- ``and`` <-> ``or``;
- the condition of an ``if``, ``while``, conditional expression, ``assert`` or
  comprehension filter negated;
- an int or float constant plus 1 (so 0 -> 1);
- a statement in a function deleted (replaced by ``pass``); a ``return x`` made ``return None``.

Docstrings, logging calls, ``__all__``, imports and annotations are left alone. For each
mutant, the mutated module is written into a private copy of the package and tests, and the
given test files run there with pytest in a subprocess (``-x -q -p no:cacheprovider``, the
``mutation`` hypothesis profile of tests/conftest.py: few examples, derandomized). A mutant is
killed when the tests fail or time out. Not run in CI: it takes minutes.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import copy
import dataclasses
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "peerwatch"
# The pure modules and the tests that must prove them (issue 13, point 9).
DEFAULT_TARGETS = [
    ("peerwatch/verdict/decide.py", ["tests/test_decide.py"]),
    ("peerwatch/core/records.py", ["tests/test_records.py"]),
    ("peerwatch/core/config.py", ["tests/test_config.py", "tests/test_launcher_facts.py"]),
    ("peerwatch/verdict/plan.py", ["tests/test_plan.py"]),
    ("peerwatch/core/schedule.py", ["tests/test_schedule.py"]),
    ("peerwatch/hosts/hosts.py", ["tests/test_hosts.py"]),
    ("peerwatch/hangs/diagnose.py", ["tests/test_diagnose.py", "tests/test_summary.py"]),
    ("peerwatch/hangs/straggler.py", ["tests/test_straggler_rule.py"]),
    ("peerwatch/core/errors.py", ["tests/test_errors.py"]),
    ("peerwatch/core/mounts.py", ["tests/test_mounts.py"]),
    ("peerwatch/core/terminal.py", ["tests/test_terminal_text.py"]),  # test_terminal.py: end to end
]
COPIED = ("peerwatch", "tests", "docs", "pyproject.toml", "setup.cfg")  # what a worker's copy holds
PYTEST_ARGS = ("-x", "-q", "-p", "no:cacheprovider")
HYPOTHESIS_PROFILE = "mutation"  # registered in tests/conftest.py
MIN_TIMEOUT_S = 10.0  # per mutant; at least this, else a multiple of the clean run's time
TIMEOUT_FACTOR = 4.0

_FLIPPED = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In,
    ast.Is: ast.IsNot, ast.IsNot: ast.Is,
}
_OP_TEXT = {
    ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=",
    ast.In: "in", ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not",
}
_LOG_METHODS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "log"}
_LOGGERS = {"logger", "log", "logging", "_logger", "_log", "LOG", "LOGGER"}
# Statements whose deletion is a mutant; definitions and imports are not (deleting one only
# breaks the import, which says nothing about the tests).
_DELETABLE = (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Raise, ast.If, ast.For, ast.While,
              ast.With, ast.Try, ast.Assert, ast.Continue, ast.Break, ast.Delete)


@dataclasses.dataclass(frozen=True)
class Mutant:
    index: int
    line: int
    kind: str
    before: str
    after: str

    def describe(self) -> str:
        return f"line {self.line}: {self.kind}: {_short(self.before)}  ->  {_short(self.after)}"


def _short(text: str, limit: int = 70) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_log_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return False
    owner = node.func.value
    return node.func.attr in _LOG_METHODS and isinstance(owner, ast.Name) and owner.id in _LOGGERS


def _is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


def _is_all(stmt: ast.stmt) -> bool:
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
    return any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets)


class _Mutator:
    """Walks a module in a fixed order, numbering every possible mutation. With ``target``
    set, it applies that one mutation to the tree (in place) as it passes it."""

    def __init__(self, target: Optional[int] = None) -> None:
        self.target = target
        self.found: List[Mutant] = []
        self._in_function = 0

    def _offer(self, node: ast.AST, kind: str, before: ast.AST, after: ast.AST) -> bool:
        """Record a mutation; True if it is the one to apply now."""
        index = len(self.found)
        self.found.append(Mutant(index, getattr(node, "lineno", 0), kind, ast.unparse(before), ast.unparse(after)))
        return index == self.target

    # -- statements --------------------------------------------------------------------------

    def body(self, stmts: List[ast.stmt]) -> None:
        for i, stmt in enumerate(stmts):
            if _is_docstring(stmt) or _is_all(stmt):
                continue
            if isinstance(stmt, (ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal)):
                continue
            if isinstance(stmt, ast.Expr) and _is_log_call(stmt.value):
                continue
            if self._in_function and isinstance(stmt, _DELETABLE):
                replacement = ast.Pass()
                if self._offer(stmt, "statement deleted", stmt, replacement):
                    stmts[i] = ast.copy_location(replacement, stmt)
                    continue
            if isinstance(stmt, ast.Return) and stmt.value is not None and not (
                isinstance(stmt.value, ast.Constant) and stmt.value.value is None
            ):
                bare = ast.Return(value=ast.Constant(None))
                if self._offer(stmt, "return value dropped", stmt, bare):
                    stmts[i] = ast.copy_location(bare, stmt)
                    continue
            self.stmt(stmt)

    def stmt(self, stmt: ast.stmt) -> None:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for deco in stmt.decorator_list:
                self.expr_field(stmt, "decorator_list", deco)
            self._arguments(stmt.args)
            self._in_function += 1
            self.body(stmt.body)
            self._in_function -= 1
            return
        if isinstance(stmt, ast.ClassDef):
            self.body(stmt.body)
            return
        if isinstance(stmt, (ast.If, ast.While)):
            self._negate(stmt, "test")
        elif isinstance(stmt, ast.Assert):
            self._negate(stmt, "test")
        for name, value in ast.iter_fields(stmt):
            if name in ("annotation", "returns", "type_comment"):
                continue
            if name == "test" and isinstance(stmt, (ast.If, ast.While, ast.Assert)):
                self.expr_field(stmt, "test", stmt.test)
                continue
            if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                self.body(value)
            elif isinstance(value, list):
                for item in value:
                    self._any(stmt, name, item)
            else:
                self._any(stmt, name, value)

    def _arguments(self, args: ast.arguments) -> None:
        for default in list(args.defaults) + [d for d in args.kw_defaults if d is not None]:
            self.expr(default)

    def _any(self, parent: ast.AST, name: str, value: object) -> None:
        if isinstance(value, ast.expr):
            self.expr_field(parent, name, value)
        elif isinstance(value, ast.ExceptHandler):
            if value.type is not None:
                self.expr(value.type)
            self.body(value.body)
        elif isinstance(value, (ast.withitem, ast.comprehension, ast.keyword, ast.arguments)):
            self.expr_holder(value)

    def _negate(self, node: ast.AST, field: str) -> None:
        test = getattr(node, field)
        negated = ast.UnaryOp(op=ast.Not(), operand=test)
        if self._offer(test, "condition negated", test, negated):
            setattr(node, field, ast.copy_location(negated, test))

    # -- expressions -------------------------------------------------------------------------

    def expr_field(self, parent: ast.AST, name: str, node: ast.expr) -> None:
        self.expr(node)

    def expr_holder(self, node: ast.AST) -> None:
        if isinstance(node, ast.comprehension):
            self.expr(node.iter)
            for i in range(len(node.ifs)):
                test = node.ifs[i]
                negated = ast.UnaryOp(op=ast.Not(), operand=test)
                if self._offer(test, "condition negated", test, negated):
                    node.ifs[i] = ast.copy_location(negated, test)
                else:
                    self.expr(test)
            return
        if isinstance(node, ast.arguments):
            self._arguments(node)
            return
        for _, value in ast.iter_fields(node):
            if isinstance(value, ast.expr):
                self.expr(value)

    def expr(self, node: ast.expr) -> None:  # noqa: C901 - one flat dispatch over node types
        if _is_log_call(node):
            return
        if isinstance(node, ast.JoinedStr):
            for part in node.values:
                if isinstance(part, ast.FormattedValue):
                    self.expr(part.value)
            return
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                flipped = _FLIPPED.get(type(op))
                if flipped is None:
                    continue
                mutated = copy.copy(node)
                mutated.ops = list(node.ops)
                mutated.ops[i] = flipped()
                kind = f"{_OP_TEXT[type(op)]} -> {_OP_TEXT[flipped]}"
                if self._offer(node, kind, node, mutated):
                    node.ops[i] = flipped()
                    break
        elif isinstance(node, ast.BoolOp):
            other = ast.Or() if isinstance(node.op, ast.And) else ast.And()
            swapped = ast.BoolOp(op=other, values=node.values)
            kind = "and -> or" if isinstance(node.op, ast.And) else "or -> and"
            if self._offer(node, kind, node, swapped):
                node.op = other
        elif isinstance(node, ast.IfExp):
            self._negate(node, "test")
        elif isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(
            node.value, bool
        ):
            bumped = node.value + 1
            if self._offer(node, "constant + 1", node, ast.Constant(bumped)):
                node.value = bumped
            return
        elif isinstance(node, ast.Lambda):
            self._in_function += 1
            self._arguments(node.args)
            self.expr(node.body)
            self._in_function -= 1
            return
        for _, value in ast.iter_fields(node):
            if isinstance(value, ast.expr):
                self.expr(value)
            elif isinstance(value, list):
                for item in value:
                    if isinstance(item, ast.expr):
                        self.expr(item)
                    elif isinstance(item, (ast.comprehension, ast.keyword)):
                        self.expr_holder(item)
            elif isinstance(value, (ast.comprehension, ast.keyword)):
                self.expr_holder(value)


def mutants(source: str) -> List[Mutant]:
    walker = _Mutator()
    walker.body(ast.parse(source).body)
    return walker.found


def mutated_source(source: str, index: int) -> str:
    tree = ast.parse(source)
    walker = _Mutator(target=index)
    walker.body(tree.body)
    ast.fix_missing_locations(tree)
    return ast.unparse(tree) + "\n"


# -- running the tests ---------------------------------------------------------------------------


class Worker:
    """A private copy of the package and its tests, in which one mutant at a time is tried."""

    def __init__(self, base: Path, number: int) -> None:
        self.root = base / f"worker{number}"
        self.root.mkdir()
        ignore = shutil.ignore_patterns("__pycache__", ".hypothesis", "*.pyc")
        for name in COPIED:
            src = ROOT / name
            if src.is_dir():
                shutil.copytree(src, self.root / name, ignore=ignore)
            elif src.exists():
                shutil.copy2(src, self.root / name)

    def env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PEERWATCH_", "PYTEST_"))}
        env["PYTHONPATH"] = str(self.root)  # the copy, not the editable install, is imported
        env["HYPOTHESIS_PROFILE"] = HYPOTHESIS_PROFILE
        return env

    def run(self, module: str, source: str, tests: Sequence[str], timeout_s: float) -> Tuple[bool, float, str]:
        """Write ``source`` as ``module`` and run ``tests``: (passed, seconds, output tail)."""
        path = self.root / module
        path.write_text(source)
        for stale in (path.parent / "__pycache__").glob(path.stem + ".*.pyc"):
            stale.unlink()  # same size and second as the last mutant: Python would trust it
        cmd = [sys.executable, "-m", "pytest", *PYTEST_ARGS, *tests]
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=self.root, env=self.env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            return False, time.monotonic() - start, f"timed out after {timeout_s:g}s"
        return proc.returncode == 0, time.monotonic() - start, out.decode(errors="replace")[-2000:]

    def imports_its_copy(self) -> bool:
        probe = [sys.executable, "-c", f"import {PACKAGE}; print({PACKAGE}.__file__)"]
        out = subprocess.run(probe, cwd=self.root, env=self.env(), capture_output=True, text=True, check=True)
        return Path(out.stdout.strip()).resolve().is_relative_to(self.root.resolve())


@dataclasses.dataclass
class Result:
    module: str
    total: int = 0
    killed: int = 0
    timed_out: int = 0
    survivors: List[Mutant] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def score(self) -> float:
        return 100.0 * self.killed / self.total if self.total else 100.0


def mutate(module: str, tests: Sequence[str], workers: "queue.Queue[Worker]", jobs: int,
           only: Optional[Sequence[int]] = None, verbose: bool = False) -> Result:
    source = (ROOT / module).read_text()
    found = mutants(source)
    if only:
        found = [m for m in found if m.index in only]
    result = Result(module, total=len(found))
    start = time.monotonic()
    worker = workers.get()
    try:
        ok, clean_s, out = worker.run(module, source, tests, timeout_s=600)
    finally:
        workers.put(worker)
    if not ok:
        raise SystemExit(f"mutation: the tests fail on the unmutated {module}; fix them first:\n{out}")
    timeout_s = max(MIN_TIMEOUT_S, TIMEOUT_FACTOR * clean_s)

    def one(m: Mutant) -> Tuple[Mutant, bool, str]:
        worker = workers.get()
        try:
            passed, _, out = worker.run(module, mutated_source(source, m.index), tests, timeout_s)
        finally:
            workers.put(worker)
        return m, passed, out

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        for m, passed, out in pool.map(one, found):
            if passed:
                result.survivors.append(m)
            else:
                result.killed += 1
                result.timed_out += out.startswith("timed out")
            if verbose:
                print(f"  {'SURVIVED' if passed else 'killed  '} #{m.index} {m.describe()}", file=sys.stderr)
    # Leave every worker's copy as it was.
    for _ in range(jobs):
        worker = workers.get()
        (worker.root / module).write_text(source)
        workers.put(worker)
    result.seconds = time.monotonic() - start
    return result


def table(results: Sequence[Result]) -> Iterator[str]:
    yield "| module | mutants | killed | survived | score | time |"
    yield "|---|---:|---:|---:|---:|---:|"
    for r in results:
        yield (f"| {r.module} | {r.total} | {r.killed} | {len(r.survivors)} | {r.score:.1f} % "
               f"| {r.seconds:.0f} s |")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("module", nargs="?", help="a module to mutate, e.g. peerwatch/verdict/decide.py "
                        "(default: every pure module, each against its own tests)")
    parser.add_argument("tests", nargs="*", help="the test files that must kill its mutants")
    parser.add_argument("--jobs", "-j", type=int, default=2, help="mutants tried at once (default 2)")
    parser.add_argument("--list-survivors", action="store_true", help="list every surviving mutant")
    parser.add_argument("--list", action="store_true", help="only list the mutants, run nothing")
    parser.add_argument("--only", type=int, nargs="+", metavar="N", help="try only these mutants (by number)")
    parser.add_argument("--show", type=int, metavar="N", help="print mutant N's module and exit")
    parser.add_argument("--verbose", "-v", action="store_true", help="print each mutant's fate as it comes")
    args = parser.parse_args(argv)
    if args.module is None:
        targets = [(m, t) for m, t in DEFAULT_TARGETS if (ROOT / m).exists()]
    elif not args.tests:
        parser.error("give the test files that must kill the module's mutants")
    else:
        targets = [(args.module, args.tests)]
    for module, _ in targets:
        if not (ROOT / module).is_file() or not module.startswith(PACKAGE + "/"):
            parser.error(f"{module}: not a module of {PACKAGE}/ (give its path from the repository root)")
    if args.show is not None or args.list:
        for module, _ in targets:
            source = (ROOT / module).read_text()
            if args.show is not None:
                print(mutated_source(source, args.show), end="")
            else:
                for m in mutants(source):
                    print(f"{module} #{m.index} {m.describe()}")
        return 0

    results = []
    with tempfile.TemporaryDirectory(prefix="peerwatch-mutation-") as base:
        workers: "queue.Queue[Worker]" = queue.Queue()
        for number in range(args.jobs):
            workers.put(Worker(Path(base), number))
        probe = workers.get()
        if not probe.imports_its_copy():
            raise SystemExit("mutation: the tests would import peerwatch from elsewhere, not from the mutated copy")
        workers.put(probe)
        for module, tests in targets:
            print(f"mutation: {module} against {' '.join(tests)} ({args.jobs} at once)", file=sys.stderr)
            results.append(mutate(module, tests, workers, args.jobs, args.only, args.verbose))
    print("\n".join(table(results)))
    for r in results:
        if r.survivors and (args.list_survivors or len(results) == 1):
            print(f"\nsurvivors in {r.module}:")
            for m in r.survivors:
                print(f"  #{m.index} {m.describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
