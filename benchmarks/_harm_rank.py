"""One rank of a healthy job for benchmarks/do_no_harm.py: never imported by the benchmark.

    python _harm_rank.py READY BEHAVIOUR SECONDS

Every rank installs peerwatch first (the README's order), notes ``READY/rank-<i>`` (its pid)
and ends with status 0, unless peerwatch (wrongly) ends it. BEHAVIOUR:

    idle          beat for SECONDS, then finish
    fdstarve      beat; after 1 s take every free descriptor (EMFILE) for 2 s, give them
                  back, and finish at SECONDS
    gloo          a gloo group of every rank, all_reduce in a loop for SECONDS, then finish
    busy:KIND     a gloo loop; after 20 steps rank 0 alone works SECONDS in KIND while the
                  others wait in the next all_reduce; then 20 more steps and finish. KIND:
                  cdist (one torch op in a loop), linear (an nn.Linear forward loop),
                  pyloop (pure Python), ccall (one GIL-free C call: pbkdf2), trickle (reads a
                  pipe fed 1 byte / 100 ms), children (waits for a child that computes),
                  checkpoint (writes 1 MiB chunks), gc (gc.collect over a large graph)
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time

from _ranks import note  # this script's folder is first on sys.path


def fdstarve(seconds: float) -> None:
    import peerwatch

    end = time.monotonic() + seconds
    time.sleep(1.0)
    taken = []
    try:
        while True:
            taken.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass  # EMFILE: every descriptor is ours now
    starve_end = time.monotonic() + 2.0
    while time.monotonic() < starve_end:
        peerwatch.beat()
        time.sleep(0.05)
    for fd in taken:
        os.close(fd)
    while time.monotonic() < end:
        peerwatch.beat()
        time.sleep(0.05)


def _pbkdf2_rounds_for(seconds: float) -> int:
    start = time.perf_counter()
    hashlib.pbkdf2_hmac("sha256", b"x", b"y", 20000)
    per_round = (time.perf_counter() - start) / 20000
    return max(1, int(seconds / per_round))


def busy(kind: str, seconds: float) -> None:
    """Work for ``seconds`` in one way, without a collective and without beat()."""
    import torch

    end = time.monotonic() + seconds
    if kind == "cdist":
        a, b = torch.randn(400, 64), torch.randn(400, 64)
        while time.monotonic() < end:
            torch.cdist(a, b)
    elif kind == "linear":
        layer, x = torch.nn.Linear(512, 512), torch.randn(64, 512)
        with torch.no_grad():
            while time.monotonic() < end:
                layer(x)
    elif kind == "pyloop":
        n = 0
        while time.monotonic() < end:
            n = (n * 31 + 7) % 1000003
    elif kind == "ccall":
        hashlib.pbkdf2_hmac("sha256", b"x", b"y", _pbkdf2_rounds_for(seconds))
    elif kind == "trickle":
        feeder = "import sys,time\nwhile True:\n    sys.stdout.write('x'); sys.stdout.flush(); time.sleep(0.1)"
        child = subprocess.Popen([sys.executable, "-c", feeder], stdout=subprocess.PIPE)
        assert child.stdout is not None
        while time.monotonic() < end:
            child.stdout.read(1)
        child.kill()
        child.wait()
    elif kind == "children":
        work = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass"
        subprocess.run([sys.executable, "-c", work], check=True)
    elif kind == "checkpoint":
        chunk = os.urandom(1 << 20)
        with open(os.path.join(os.environ["HARM_SCRATCH"], f"ckpt-{os.getpid()}"), "wb") as f:
            while time.monotonic() < end:
                f.write(chunk)
                f.seek(0)
    elif kind == "gc":
        import gc

        graph = [[i, {"k": [i]}] for i in range(2_000_000)]
        while time.monotonic() < end:
            gc.collect()
        del graph
    else:
        raise ValueError(f"unknown busy kind {kind!r}")


def gloo(ready: str, rank: int, behaviour: str, seconds: float) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    import peerwatch

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    note(ready, f"pg-{rank}", "")
    t = torch.ones(1)
    if behaviour == "gloo":
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            dist.all_reduce(t)
            time.sleep(0.02)
    else:
        kind = behaviour.partition(":")[2]
        for step in range(40):
            if step == 20 and rank == 0:
                note(ready, "busy-start", str(time.time_ns()))
                busy(kind, seconds)
                note(ready, "busy-end", str(time.time_ns()))
            dist.all_reduce(t)
            time.sleep(0.02)
    peerwatch.beat()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ready, behaviour, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    import peerwatch

    peerwatch.install()
    rank = int(os.environ["RANK"])
    note(ready, f"rank-{rank}", json.dumps({"pid": os.getpid()}))
    if behaviour == "idle":
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            peerwatch.beat()
            time.sleep(0.05)
    elif behaviour == "fdstarve":
        fdstarve(seconds)
    else:
        gloo(ready, rank, behaviour, seconds)


if __name__ == "__main__":
    main()
