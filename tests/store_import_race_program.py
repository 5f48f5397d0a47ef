"""One rank with a store configured (``PEERWATCH_STORE``, ``PEERWATCH_RUN_ID``) that calls
``peerwatch.install()`` and then ``import torch.distributed`` (the README's order), at the
worst moment for a store bridge that imports torch in its own thread: as soon as torch
appears in ``sys.modules`` (a bridge thread is inside ``import torch``), or, if it never
does, once the watcher has ticked ``--ticks`` times (a bridge would have started by then).
Started by tests/test_store_import.py, never imported.

    PEERWATCH_DIR=RUN PEERWATCH_STORE=127.0.0.1:PORT PEERWATCH_RUN_ID=ID \\
        python store_import_race_program.py --heartbeat 0.01 --ticks 5 --wait 30

It prints one JSON line: ``bridge_first`` (torch was being imported by another thread when
the main thread started its own import) and ``connected`` (the bridge then connected to the
store within ``--wait`` seconds, as ``bridge.json`` says). With ``--no-import`` it never
imports torch: it waits for ``--ticks`` heartbeats and prints whether torch was imported
(``torch``) and whether a bridge thread is running (``bridge``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any, Callable

import peerwatch

POLL_S = 0.0005  # the main thread looks at sys.modules this often: the bridge's import takes seconds


def _heartbeat_seq(path: str) -> int:
    from peerwatch.core.records import Heartbeat, decode

    try:
        with open(path, "rb") as f:
            beat = decode(Heartbeat, f.read())
    except OSError:
        return 0
    return beat.seq if beat is not None else 0  # caught mid-rewrite: 0, looked at again


def _until(done: Callable[[], Any], within: float) -> Any:
    deadline = time.monotonic() + within
    while True:
        result = done()
        if result or time.monotonic() >= deadline:
            return result
        time.sleep(POLL_S)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--heartbeat", type=float, required=True)
    parser.add_argument("--ticks", type=int, required=True)
    parser.add_argument("--wait", type=float, required=True)
    parser.add_argument("--no-import", action="store_true")
    args = parser.parse_args()
    handle = peerwatch.install(heartbeat_interval=args.heartbeat, rank=0, world_size=1, local_world_size=1)
    assert handle is not None
    from peerwatch.rundir.rundir import HEARTBEATS, rank_file

    beat_path = os.path.join(handle.run_dir, HEARTBEATS, rank_file("rank", 0))
    _until(lambda: "torch" in sys.modules or _heartbeat_seq(beat_path) >= args.ticks, args.wait)
    bridge_first = "torch" in sys.modules
    if args.no_import:
        running = any(t.name.startswith("peerwatch-bridge") for t in threading.enumerate())
        print(json.dumps({"torch": bridge_first, "bridge": running}))
        return

    import torch.distributed  # noqa: F401 - the application's own import, raced

    def connected() -> bool:
        try:
            with open(os.path.join(handle.run_dir, "bridge.json")) as f:
                return bool(json.load(f).get("connected"))
        except (OSError, ValueError):
            return False

    print(json.dumps({"bridge_first": bridge_first, "connected": bool(_until(connected, args.wait))}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
