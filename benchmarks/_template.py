"""A template process: imports heavy modules once, then forks one child per request.

    python _template.py torch.distributed peerwatch ...      (started by Template below)

Importing torch (or Lightning) takes about 2 s of CPU; a benchmark that starts hundreds of
torch processes would spend most of its time there. A child forked from this template has
the modules already (nothing had started a thread: fork is safe) and runs ``module:function``
with the environment it is given, as a fresh interpreter would: an uncaught exception goes
through ``sys.excepthook`` (peerwatch's), the atexit handlers run, then the process exits.

Requests on stdin, one JSON object a line: {"target", "args", "env", "log"}; the reply on
stdout is the child's pid. The template ignores SIGCHLD (its children and the orphans it
inherits as a subreaper are reaped by the kernel); children get the default back.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import traceback
from typing import Any, Dict, List, Mapping, Optional, Sequence

_PR_SET_CHILD_SUBREAPER = 36


def _child(request: Dict[str, Any]) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    devnull = os.open(os.devnull, os.O_RDWR)
    log = os.open(request.get("log") or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.clear()
    os.environ.update(request["env"])
    module, _, name = request["target"].partition(":")
    sys.argv = [request["target"], *map(str, request.get("args", []))]
    code = 0
    try:
        getattr(importlib.import_module(module), name)(*request.get("args", []))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - as the interpreter does with an uncaught exception
        sys.excepthook(*sys.exc_info())
        code = 1
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(modules: Sequence[str]) -> None:
    for module in modules:
        importlib.import_module(module)
    assert threading.active_count() == 1, "an import started a thread: forking would not be safe"
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                _child(request)
            except BaseException:  # noqa: BLE001 - never return into the template's loop
                traceback.print_exc()
            os._exit(1)
        print(pid, flush=True)


class Template:
    """The benchmark's handle on a template process."""

    def __init__(self, modules: Sequence[str], env: Mapping[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, *modules], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(env),
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"the template process did not start (it said {line!r})")

    def fork(self, target: str, env: Mapping[str, str], args: Sequence[Any] = (), log: Optional[str] = None) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        request = {"target": target, "args": list(args), "env": dict(env), "log": log}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    serve(sys.argv[1:])

__all__: List[str] = ["Template", "serve"]
