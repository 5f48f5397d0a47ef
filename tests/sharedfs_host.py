"""One simulated host of a multi-host job, for tests/test_shared_fs.py. Never imported.

    unshare --pid --fork --mount-proc --uts python sharedfs_host.py --host hostB \\
        --ranks 2,3 --world 4 --ready DIR [--behave 3=raise@0.3 ...]

Runs as the init (pid 1) of its own PID namespace, with its own hostname (UTS namespace):
its ranks' pids mean nothing to the other hosts, as on real separate machines. It starts
its ranks (``rank_program.py``, sibling style, every one a child of this process), waits
for them, and notes how each ended in ``READY/exit-<rank>`` (only a parent can know).
When it ends, the kernel ends whatever is left in its namespace.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

RANK_PROGRAM = Path(__file__).with_name("rank_program.py")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", required=True)
    parser.add_argument("--ranks", required=True, help="global ranks on this host, comma-separated")
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--ready", required=True)
    parser.add_argument("--behave", action="append", default=[])
    args = parser.parse_args()
    socket.sethostname(args.host)
    # As the init of a PID namespace we get no default signal actions: SIGTERM from the
    # test would be ignored. Take it to mean "end the host" (the kernel then ends the rest).
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
    ranks = [int(r) for r in args.ranks.split(",")]
    children = {}
    for local, rank in enumerate(ranks):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.world), LOCAL_RANK=str(local),
                   LOCAL_WORLD_SIZE=str(len(ranks)))
        argv = [sys.executable, str(RANK_PROGRAM), "--world", str(args.world), "--ready", args.ready, "--sync"]
        for item in args.behave:
            argv += ["--behave", item]
        children[rank] = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)
    for rank, child in children.items():
        code = child.wait()
        path = os.path.join(args.ready, f"exit-{rank}")
        tmp = f"{path}.{os.getpid()}.tmp"  # per process: two writers never share it
        with open(tmp, "w") as f:
            f.write(str(code))
        os.replace(tmp, path)


if __name__ == "__main__":
    main()
