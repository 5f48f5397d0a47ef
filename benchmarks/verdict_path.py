"""How far the verdict travels from ``Watcher._act``, for issue 25.1's before/after figure.

    python benchmarks/verdict_path.py REV        # e.g. 78778a0 (before) and HEAD (after)

Follows, statically, the calls of ``Watcher._act`` inside ``_watcher.py`` (``self._x()``,
the file's own functions) and, where it hands over to ``_verdict``, every function of that
module (each step of ``_STEPS``); counts the calls that leave the file, by the peerwatch
module they enter (depth 1: a module's own calls further down are not followed). A call
``self.observer.x()`` counts for ``_observer`` and so on (the ``ATTR`` table). Every call
out of ``_watcher.py`` returns into it: that is where the order lived before.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import Counter

REV = sys.argv[1]
ATTR = {"observer": "_observer", "run_dir": "_rundir", "stacks": "_stacks", "bridge": "_bridge",
        "heartbeat": "_heartbeat", "_flight_recorder": "_frdump", "flight_recorder": "_frdump", "hook": "_notify",
        "_settle": "_watcher", "_outcome": "_watcher", "verdict_seen": None, "main_left": None, "config": None}


def src(path):
    return subprocess.run(["git", "show", f"{REV}:{path}"], capture_output=True, text=True, check=True).stdout


def imports(tree):
    names = {}
    for n in tree.body:
        if isinstance(n, ast.ImportFrom) and n.level == 1:
            for a in n.names:
                names[a.asname or a.name] = a.name if n.module is None else n.module
    return names


def funcs(tree):
    out = {}
    for n in tree.body:
        if isinstance(n, ast.FunctionDef):
            out[n.name] = n
        if isinstance(n, ast.ClassDef):
            for m in n.body:
                if isinstance(m, ast.FunctionDef):
                    out[f"{n.name}.{m.name}"] = m
    return out


def walk(file, entry, follow_all=False):
    tree = ast.parse(src(f"peerwatch/{file}.py"))
    imp, fs = imports(tree), funcs(tree)
    todo = [entry] + ([k for k in fs if "." not in k] if follow_all else [])
    seen: set = set()
    calls: Counter = Counter()
    while todo:
        name = todo.pop()
        if name in seen or name not in fs:
            continue
        seen.add(name)
        for node in ast.walk(fs[name]):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            mod = None
            if isinstance(f, ast.Name):
                if f.id in fs:
                    todo.append(f.id)
                elif f.id in imp:
                    mod = imp[f.id]
            elif isinstance(f, ast.Attribute):
                if isinstance(f.value, ast.Name) and f.value.id in ("self",):
                    cls = name.split(".")[0]
                    if f"{cls}.{f.attr}" in fs:
                        todo.append(f"{cls}.{f.attr}")
                        continue
                if isinstance(f.value, ast.Name) and f.value.id in imp:
                    mod = imp[f.value.id]
                elif isinstance(f.value, ast.Attribute) and isinstance(f.value.value, ast.Name) and f.value.value.id in ("self", "t"):
                    mod = ATTR.get(f.value.attr, f"?{f.value.attr}")
                elif isinstance(f.value, ast.Name) and f.value.id in ("hook", "early_hook"):
                    mod = "_notify"
            if mod:
                calls[mod.lstrip(".")] += 1
    return seen, calls


file, entry = "_watcher", "Watcher._act"
seen, calls = walk(file, entry)
print(f"{REV}: from {entry}, functions of _watcher.py on the path: {len(seen)} ({sorted(seen)})")
print(f"  calls out of _watcher.py: {sum(calls.values())} to {len(calls)} modules: {dict(sorted(calls.items()))}")
if "_verdict" in calls:
    seen2, calls2 = walk("_verdict", "carry_out", follow_all=True)
    print(f"  then _verdict.py: {len(seen2)} functions, {sum(calls2.values())} calls to {len(calls2)} modules: {dict(sorted(calls2.items()))}")
    print(f"  calls back into _watcher.py from _verdict: {calls2.get('_watcher', 0)}")
    print(f"  distinct modules in all: {len(set(calls) | set(calls2))}")
