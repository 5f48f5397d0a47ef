"""One rank of a one-rank gloo job that calls ``peerwatch.install()`` before ``import
torch`` (the order the README teaches), with heartbeats every ``--heartbeat`` seconds:
some of them land while torch is still importing. Started by
tests/test_collectives_state.py, never imported.

    PEERWATCH_DIR=RUN python import_race_program.py --heartbeat 0.01 --wait 10

After one ``all_reduce`` it waits (at most ``--wait`` seconds) for its own heartbeat to
show the collective counted, then prints that heartbeat's ``collectives``,
``collectives_state`` and ``collectives_error`` as one JSON line, and whether it waited
in vain (``"counted": false``: the rank was blind).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import peerwatch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--heartbeat", type=float, required=True)
    parser.add_argument("--wait", type=float, required=True)
    args = parser.parse_args()
    handle = peerwatch.install(heartbeat_interval=args.heartbeat, rank=0, world_size=1)
    assert handle is not None

    import torch
    import torch.distributed as dist

    from peerwatch.core.records import Heartbeat, decode
    from peerwatch.rundir.rundir import HEARTBEATS, rank_file

    # A FileStore: many of these run at once, with no port to share.
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    dist.all_reduce(torch.ones(4))
    path = os.path.join(handle.run_dir, HEARTBEATS, rank_file("rank", 0))
    deadline = time.monotonic() + args.wait
    beat, counted = None, False
    while not counted and time.monotonic() < deadline:
        with open(path, "rb") as f:
            beat = decode(Heartbeat, f.read()) or beat  # caught mid-rewrite: read again
        counted = beat is not None and any(enqueued >= 1 for _, enqueued, _ in beat.collectives)
        if not counted:
            time.sleep(args.heartbeat)  # the watcher writes one every heartbeat: nothing to wait on
    print(json.dumps({
        "counted": counted, "collectives": beat.collectives if beat else None,
        "state": getattr(beat, "collectives_state", None), "error": getattr(beat, "collectives_error", None),
    }))
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
