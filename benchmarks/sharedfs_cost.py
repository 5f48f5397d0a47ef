"""What shared-filesystem mode costs an idle job: directory listings, file opens and CPU
per rank, with shared_fs=on and off (docs/shared-filesystem.md quotes the figures).

    sudo .venv/bin/python benchmarks/sharedfs_cost.py [--hosts 2] [--ranks 4] [--seconds 10]

Starts HOSTS simulated hosts of RANKS idle ranks each (tests/sharedfs_host.py: each host
is the init of its own PID and UTS namespace; needs root for ``unshare``), all sharing
one run directory (a local one: no NFS server here, so this counts the calls the file
server would get, not their latency). Then, for SECONDS, it counts with ``strace -c`` the
getdents64 (directory listing), openat and rename calls of one judge (the lowest rank of
host 0) and one non-judge rank (its highest, when RANKS > 2), and every rank's CPU time.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import psutil

ROOT = Path(__file__).resolve().parent.parent
HOST_PROGRAM = ROOT / "tests" / "sharedfs_host.py"


def start_hosts(tmp: Path, hosts: int, ranks: int, shared: str) -> List[subprocess.Popen]:
    world = hosts * ranks
    env = dict(os.environ, PEERWATCH_DIR=str(tmp / "run"), PEERWATCH_SHARED_FS=shared,
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    (tmp / "ready").mkdir()
    procs = []
    for h in range(hosts):
        mine = ",".join(str(h * ranks + i) for i in range(ranks))
        argv = ["unshare", "--pid", "--fork", "--mount-proc", "--uts", sys.executable, str(HOST_PROGRAM),
                "--host", f"host{h}", "--ranks", mine, "--world", str(world), "--ready", str(tmp / "ready")]
        procs.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
    deadline = time.monotonic() + 60
    while not all((tmp / "ready" / f"rank-{r}").exists() for r in range(world)):
        if time.monotonic() > deadline:
            raise SystemExit("ranks not ready within 60 s")
        time.sleep(0.05)
    return procs


def rank_pids(procs: List[subprocess.Popen]) -> Dict[int, int]:
    found = {}
    for p in procs:
        for child in psutil.Process(p.pid).children(recursive=True):
            try:
                if "rank_program.py" in " ".join(child.cmdline()):
                    found[int(child.environ()["RANK"])] = child.pid
            except (psutil.Error, KeyError):
                pass
    return found


def start_strace(pid: int, out: Path) -> subprocess.Popen:
    return subprocess.Popen(["strace", "-f", "-c", "-o", str(out), "-e", "trace=getdents64,openat,rename",
                             "-p", str(pid)], stderr=subprocess.DEVNULL)


def stop_strace(tracer: subprocess.Popen, out: Path) -> Dict[str, int]:
    tracer.send_signal(signal.SIGINT)
    tracer.wait(10)
    counts = {}
    for line in out.read_text().splitlines():
        m = re.match(r"\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)$", line)
        if m and m.group(2) != "total":
            counts[m.group(2)] = int(m.group(1))
    return counts


def measure(hosts: int, ranks: int, seconds: float, shared: str) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="peerwatch-sharedfs-"))
    procs = start_hosts(tmp, hosts, ranks, shared)
    try:
        time.sleep(2.0)  # let startup settle: the first heartbeats, the first full scans
        pids = rank_pids(procs)
        cpu0 = {r: sum(psutil.Process(p).cpu_times()[:2]) for r, p in pids.items()}
        traced = {"judge (rank 0)": 0}
        if ranks > 2:
            traced[f"non-judge (rank {ranks - 1})"] = ranks - 1
        tracers = {label: (start_strace(pids[rank], tmp / f"strace-{rank}.txt"), tmp / f"strace-{rank}.txt")
                   for label, rank in traced.items()}
        time.sleep(seconds)  # the measurement window itself, not a wait for an event
        counts = {label: stop_strace(tracer, out) for label, (tracer, out) in tracers.items()}
        cpu1 = {r: sum(psutil.Process(p).cpu_times()[:2]) for r, p in pids.items()}
        cpu_ms = {r: 1000 * (cpu1[r] - cpu0[r]) / seconds for r in pids}
        print(f"\nshared_fs={shared}: {hosts} hosts x {ranks} ranks, idle, heartbeat 1 s, {seconds:g} s window")
        for label, c in counts.items():
            per_s = ", ".join(f"{name} {n / seconds:.1f}/s" for name, n in sorted(c.items()))
            print(f"  {label}: {per_s}")
        print("  CPU ms per second per rank: " + ", ".join(f"{r}: {cpu_ms[r]:.2f}" for r in sorted(cpu_ms)))
    finally:
        for p in procs:
            for child in psutil.Process(p.pid).children():
                child.kill()
            p.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    for shared in ("off", "on"):
        measure(args.hosts, args.ranks, args.seconds, shared)


if __name__ == "__main__":
    main()
