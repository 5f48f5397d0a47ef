"""One rank of one of two jobs given the same run directory (tests/test_two_jobs.py), never imported.

    python two_jobs_program.py TAG SYNC_DIR

RANK, WORLD_SIZE and PEERWATCH_DIR come from the environment. The race between two
ranks claiming one slot is staged: between peerwatch's preparing the run directory and
its garbage collection (where the registration used to be published, after the lock was
let go), job A's rank 1 waits for job B's to arrive or give up, and job B's waits for A's
registration to be in place, so that B would publish last.
"""

from __future__ import annotations

import os
import sys
import time

import peerwatch
from peerwatch.rundir import gc

TAG, SYNC = sys.argv[1], sys.argv[2]
RANK = int(os.environ["RANK"])
SLOT = os.path.join(os.environ["PEERWATCH_DIR"], "ranks", "rank-00001.json")


def note(name: str, text: str = "") -> None:
    with open(os.path.join(SYNC, name + ".tmp"), "w") as f:
        f.write(text)
    os.rename(os.path.join(SYNC, name + ".tmp"), os.path.join(SYNC, name))


def wait_for(*paths: str, within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    while not any(os.path.exists(p) for p in paths) and time.monotonic() < deadline:
        time.sleep(0.02)


original_auto = gc.auto


def staged(how: str) -> None:
    if RANK == 1 and TAG == "A":
        note("prepared-A")
        wait_for(os.path.join(SYNC, "prepared-B"), os.path.join(SYNC, "installed-B"))
    elif TAG == "B":
        note("prepared-B")
        wait_for(SLOT)  # A's rank 1 has published: B's would replace it
    original_auto(how)


gc.auto = staged
handle = peerwatch.install()
note(f"installed-{TAG}{RANK if TAG == 'A' else ''}", "protected" if handle is not None else "refused")
if TAG == "B":
    wait_for(os.path.join(SYNC, "fail-B"))
    raise RuntimeError("job B's rank 1 fails")
wait_for(os.path.join(SYNC, "finish"), within=60.0)
sys.exit(0)
