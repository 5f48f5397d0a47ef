"""The shape of peerwatch's code, for the redesign's before/after figures.

    .venv/bin/python benchmarks/code_shape.py [PACKAGE_DIR]

Prints the longest functions, the largest classes (lines, methods, attributes set on
``self``) and the accesses to private names across modules:
``from .mod import _name``, ``mod._name`` where ``mod`` is a peerwatch module, and
``obj._name`` where ``obj`` is not ``self``/``cls`` (a private attribute of another object).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import List, Tuple


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def shape(root: Path) -> None:
    functions: List[Tuple[int, str]] = []
    classes: List[Tuple[int, int, int, str]] = []
    private: List[str] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        tree = ast.parse(path.read_text())
        modules = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                for alias in node.names:
                    if node.module is None:
                        modules.add(alias.asname or alias.name)
                    elif _private(alias.name):
                        private.append(f"{rel}:{node.lineno} from .{node.module} import {alias.name}")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append((node.end_lineno - node.lineno + 1, f"{rel}:{node.lineno} {node.name}"))
            elif isinstance(node, ast.ClassDef):
                methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                attrs = {
                    t.attr for n in ast.walk(node) if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))
                    for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                }
                classes.append((node.end_lineno - node.lineno + 1, len(methods), len(attrs), f"{rel}:{node.lineno} {node.name}"))
            elif isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name):
                owner = node.value.id
                if owner in modules or owner not in ("self", "cls") and owner not in ("os", "sys", "signal"):
                    private.append(f"{rel}:{node.lineno} {owner}.{node.attr}")
    functions.sort(reverse=True)
    classes.sort(reverse=True)
    print("longest functions (lines):")
    for n, where in functions[:5]:
        print(f"  {n:4d}  {where}")
    print("largest classes (lines, methods, attributes):")
    for n, m, a, where in classes[:5]:
        print(f"  {n:4d} {m:3d} {a:3d}  {where}")
    print(f"functions over 50 lines: {sum(1 for n, _ in functions if n > 50)}")
    print(f"accesses to private names of other objects or modules: {len(private)}")
    for line in private:
        print(f"  {line}")


if __name__ == "__main__":
    shape(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "peerwatch")
