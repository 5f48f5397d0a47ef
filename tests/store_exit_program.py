"""One rank with a store configured (``PEERWATCH_STORE``, ``PEERWATCH_RUN_ID``) that ends
cleanly while its store bridge is inside store requests, on a host so slow that Python's
finalization takes seconds. Started by tests/test_store_exit.py, never imported.

    PEERWATCH_DIR=RUN PEERWATCH_STORE=127.0.0.1:PORT PEERWATCH_RUN_ID=ID \\
        python store_exit_program.py --finalizing PATH --slow 5 --end return --results FILE

It installs peerwatch, imports torch.distributed, waits (at most 60 s) for its bridge to be
connected, prints ``connected RUN_DIR`` and waits for a line on stdin; then it writes a line
to ``FILE`` (opened at the start, never closed) and its program ends as ``--end`` says:
``return`` (it runs to its end), ``exit0`` (``sys.exit(0)``) or ``raise3`` (``raise
SystemExit(3)``, which no hook sees). An object of its ``__main__`` module is destroyed as Python finalizes: it creates
``PATH`` and then takes ``--slow`` seconds (a loaded host), the window in which a bridge
thread that wakes up (its store answered, or went away) would abort the process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import peerwatch


class SlowFinalization:
    def __init__(self, path: str, seconds: float) -> None:
        self.path, self.seconds = path, seconds
        # Builtins and module globals may be gone when __del__ runs: what it calls is kept here.
        self.os_open, self.os_close, self.flags, self.sleep = os.open, os.close, os.O_CREAT | os.O_WRONLY, time.sleep

    def __del__(self) -> None:
        self.os_close(self.os_open(self.path, self.flags, 0o600))
        self.sleep(self.seconds)  # the slow finalization itself, not a wait for anything


def connected(run_dir: str) -> bool:
    try:
        with open(os.path.join(run_dir, "bridge.json")) as f:
            return bool(json.load(f).get("connected"))
    except (OSError, ValueError):
        return False


parser = argparse.ArgumentParser()
parser.add_argument("--finalizing", required=True)
parser.add_argument("--slow", type=float, required=True)
parser.add_argument("--end", choices=["return", "exit0", "raise3"], required=True)
parser.add_argument("--results", required=True)
args = parser.parse_args()
results = open(args.results, "w")  # noqa: SIM115 - never closed, as in many a script: finalization flushes it
handle = peerwatch.install(heartbeat_interval=0.1, rank=0, world_size=1, local_world_size=1)
assert handle is not None
import torch.distributed  # noqa: E402, F401 - the application's own import, after install()

deadline = time.monotonic() + 60.0
while not connected(handle.run_dir) and time.monotonic() < deadline:
    time.sleep(0.01)  # bridge.json is rewritten by the bridge: nothing to wait on
print("connected" if connected(handle.run_dir) else "not-connected", handle.run_dir, flush=True)
sys.stdin.readline()
slow = SlowFinalization(args.finalizing, args.slow)  # a global of __main__: destroyed as Python finalizes
results.write("the last result\n")
print("done", flush=True)
if args.end == "exit0":
    sys.exit(0)
if args.end == "raise3":
    raise SystemExit(3)
