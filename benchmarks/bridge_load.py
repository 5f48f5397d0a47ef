"""Load test of the store bridge: many simulated hosts against one real TCPStore.

    PYTHONPATH=. python benchmarks/bridge_load.py [--hosts 128] [--ranks 8] [--procs 4]
                                                  [--seconds 40] [--interval 1.0]
                                                  [--stall-seconds 20] [--stall-threshold 8]

One TCPStore server on 127.0.0.1 in a process of its own (as torchrun's agent or rank 0
serves it). ``--hosts`` simulated hosts, grouped in ``--procs`` processes: each is a real
:class:`peerwatch.hosts.bridge.Bridge` with its own run directory holding ``--ranks``
registrations, running its real threads (beat + the store client's owner + verdict waiter, two
connections to the store). After every host sees every other, the steady state is measured
for ``--seconds``: store requests (counted by each bridge), bytes the store server reads
and writes (its /proc io counters: every byte of every request and answer), CPU of the bridge
processes and of the store server. Then every host stands still (a hang: each host's
``RUN/stall.json`` says its ``--ranks`` ranks wait in one all_reduce, as its judges would
write it, with a warning threshold of ``--stall-threshold`` s, which sets how often the
summaries are refreshed) and the same is measured for ``--stall-seconds``. Then one host publishes a verdict (the real ``on_verdict`` path) and
every other host's waiter writes it into its run directory: the delay of each is the
cross-host detection time. Prints a markdown table, the budget, and whether it is met.
Loopback only; stops by itself (every wait has a deadline).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List

import psutil
from _common import end_workers  # the benchmarks folder: sys.path[0] when run as a script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# The budget, per host: the steady state makes 2 requests per heartbeat interval (one set,
# one get of the digest; the aggregator's multi_get of every beat and set of the digest are
# one more per interval for the whole job), plus one long-lived blocking wait per host; bridge CPU stays under
# 2 ms per host per interval (7.2 s per host per hour at 1 s); a verdict reaches every
# other host's run directory within 100 ms (p90) on loopback.
BUDGET_REQUESTS_PER_HOST_INTERVAL = 2.0
BUDGET_CPU_MS_PER_HOST_INTERVAL = 2.0
BUDGET_DETECT_P90_MS = 100.0
SETUP_TIMEOUT_S = 120.0

SERVER = """
import sys, datetime, torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
print(s.port, flush=True)
sys.stdin.read()  # until the benchmark closes our stdin
"""


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def worker(first: int, count: int, args: Dict[str, Any], port: int, base: str, conn: Any) -> None:
    """Run ``count`` simulated hosts (indices first..first+count-1) in this process."""
    import logging

    import torch.distributed  # noqa: F401 - as the application does: the bridges start only once it is imported

    import peerwatch.hosts.bridge as bridge_mod
    from peerwatch.core.config import Config, LauncherFacts
    from peerwatch.core.records import Registration, Verdict, encode
    from peerwatch.proc import identity
    from peerwatch.rundir.rundir import _SUBDIRS, RANKS, RunDir, rank_file

    logging.getLogger("peerwatch").setLevel(logging.CRITICAL)  # 127 hosts each saying it got the verdict
    seen_ns: Dict[int, int] = {}

    class Timed(bridge_mod.Bridge):
        def _take_store_verdict(self, data: bytes) -> None:
            seen_ns[self.sim] = time.time_ns()
            super()._take_store_verdict(data)

    ranks, hosts = args["ranks"], args["hosts"]
    config = Config.resolve({
        "world_size": ranks * hosts, "local_world_size": ranks, "heartbeat_interval": args["interval"],
        "peer_timeout": max(30.0, 4 * args["interval"]), "store": f"127.0.0.1:{port}", "run_id": args["run_id"],
    }, env={})
    me = identity.self_info()
    bridges: List[Any] = []
    for h in range(first, first + count):
        rd = RunDir(os.path.join(base, f"host{h:03d}"))
        os.makedirs(rd.path, 0o700)
        for sub in _SUBDIRS:
            os.mkdir(rd.join(sub), 0o700)
        regs = []
        for local in range(ranks):
            reg = Registration(
                rank=h * ranks + local, pid=me.pid, ppid=me.ppid, start_ticks=me.start_ticks, uid=me.uid,
                host=f"sim{h:03d}", boot_id=identity.boot_id(), pidns=identity.pid_namespace(), time_ns=time.time_ns(),
            )
            rd.write(RANKS, rank_file("rank", reg.rank), encode(reg), replace=True)
            regs.append(reg)
        b = Timed(config, rd, regs[0], LauncherFacts.resolve(config, {}))
        b.sim = h
        b.tick()
        bridges.append(b)
        # Hosts of a real job come up over seconds, not in one instant; torch's TCPStore
        # client drops connections in a burst of hundreds (see docs/multi-node.md).
        time.sleep(args["stagger"])
    deadline = time.monotonic() + SETUP_TIMEOUT_S
    while any(b.joined < hosts for b in bridges):  # counted by the digest (or read, on the aggregator)
        if time.monotonic() > deadline:
            conn.send({"error": f"hosts counted: {sorted(b.joined for b in bridges)[:5]}"})
            return
        time.sleep(0.05)
    conn.send({"ready": True})
    conn.recv()  # start measuring
    cpu0, req0, t0 = _cpu_s(), sum(b.requests for b in bridges), time.monotonic()
    conn.recv()  # stop measuring
    cpu1, req1, t1 = _cpu_s(), sum(b.requests for b in bridges), time.monotonic()
    conn.send({"cpu_s": cpu1 - cpu0, "requests": req1 - req0, "seconds": t1 - t0,
               "threads": len(__import__("threading").enumerate())})
    conn.recv()  # every host stands still from now on
    stalled = threading.Event()

    def stall() -> None:  # as the judges of every host would write it, once a heartbeat
        t0 = time.monotonic()
        threshold_ms = int(args["stall_threshold"] * 1000)
        while not stalled.is_set():
            for b in bridges:
                # Past half the threshold from the start: a summary the bridge publishes
                # (Summary.public; a younger one, not stuck, is the judges' alone).
                body = {"v": 1, "host": f"sim{b.sim:03d}", "stall": "1", "age_ms": int((time.monotonic() - t0) * 1000)
                        + max(10_000, threshold_ms // 2), "threshold_ms": threshold_ms,
                        "waiting": [[list(range(b.sim * ranks, (b.sim + 1) * ranks)),
                                     {"c": [["0", 31, 30]], "e": [["0", 31, "allreduce", "[[1024]] Float"]]}]],
                        "ranks": []}
                b.run_dir.write("", "stall.json", json.dumps(body, separators=(",", ":")).encode(), replace=True)
            stalled.wait(args["interval"] / 2)

    writer = threading.Thread(target=stall, daemon=True)
    writer.start()
    conn.recv()  # start measuring
    cpu0, req0, t0 = _cpu_s(), sum(b.requests for b in bridges), time.monotonic()
    conn.recv()  # stop measuring
    cpu1, req1, t1 = _cpu_s(), sum(b.requests for b in bridges), time.monotonic()
    stalled.set()
    writer.join()
    conn.send({"cpu_s": cpu1 - cpu0, "requests": req1 - req0, "seconds": t1 - t0})
    order = conn.recv()  # publish (the host named) or only wait
    if order["publisher"] in range(first, first + count):
        b = bridges[order["publisher"] - first]
        v = Verdict(rank=b.me.rank, cause="signal", exit_code=137, failed_at_ns=time.time_ns(),
                    detected_by=b.me.rank, detected_at_ns=time.time_ns(), host=f"sim{order['publisher']:03d}",
                    detail="killed by SIGKILL (load test)")
        sent = time.time_ns()
        b.on_verdict(v)
        conn.send({"sent_ns": sent})
    deadline = time.monotonic() + 10.0
    expect = {b.sim for b in bridges if b.sim != order["publisher"]}
    while not expect <= set(seen_ns) and time.monotonic() < deadline:
        time.sleep(0.01)
    conn.send({"seen_ns": dict(seen_ns), "missing": sorted(expect - set(seen_ns))})
    for b in bridges:
        b.stop()


def pct(values: List[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def _isolate() -> None:
    """Re-run in a network namespace of our own (root only) with just loopback: no packet
    leaves, and torch's client, which asks DNS for the name of every address it connects
    to, gets an immediate "no route" instead of a resolver's timeout (5 s, for one
    connection in ~25 in a sandbox whose resolver throttles)."""
    if os.environ.get("PEERWATCH_LOAD_ISOLATED") == "1" or os.geteuid() != 0 or "--no-netns" in sys.argv:
        return
    import shutil

    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return
    os.environ["PEERWATCH_LOAD_ISOLATED"] = "1"
    os.execvp("unshare", ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$0" "$@"',
                          sys.executable, *sys.argv])


def main() -> None:
    _isolate()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=128)
    parser.add_argument("--ranks", type=int, default=8, help="ranks per host")
    parser.add_argument("--procs", type=int, default=4, help="processes the simulated hosts are grouped in")
    parser.add_argument("--seconds", type=float, default=40.0, help="steady state measured (bounded to 60 s)")
    parser.add_argument("--interval", type=float, default=1.0, help="heartbeat_interval")
    parser.add_argument("--stagger", type=float, default=0.05, help="seconds between two hosts' starts in a process")
    parser.add_argument("--stall-seconds", type=float, default=20.0, help="every host standing still, measured")
    parser.add_argument("--stall-threshold", type=float, default=8.0,
                        help="the judges' warning threshold while standing still, s (sets the refresh: 1/8 of it)")
    parser.add_argument("--json", default="", help="also write the figures here")
    parser.add_argument("--no-netns", action="store_true", help="stay in this network namespace")
    a = parser.parse_args()
    a.seconds = min(a.seconds, 60.0)
    args = {"hosts": a.hosts, "ranks": a.ranks, "interval": a.interval, "run_id": f"load-{os.getpid()}",
            "stagger": a.stagger, "stall_threshold": a.stall_threshold}
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    try:
        port = int(server.stdout.readline())  # type: ignore[union-attr]
        base = tempfile.mkdtemp(prefix="peerwatch-bridge-load-")
        per = -(-a.hosts // a.procs)
        for i in range(a.procs):
            first, count = i * per, min(per, a.hosts - i * per)
            if count <= 0:
                break
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker, args=(first, count, args, port, base, child), daemon=True)
            p.start()
            procs.append(p)
            conns.append(parent)
        setup_start = time.monotonic()
        for c in conns:
            if not c.poll(SETUP_TIMEOUT_S):
                raise SystemExit("a worker did not get ready in time")
            msg = c.recv()
            if "error" in msg:
                raise SystemExit(f"a worker failed to connect every host: {msg['error']}")
        setup_s = time.monotonic() - setup_start
        sproc = psutil.Process(server.pid)

        def server_use() -> tuple:
            io = sproc.io_counters()
            return sum(sproc.cpu_times()[:2]), io.read_chars + io.write_chars

        s0, io0 = server_use()
        for c in conns:
            c.send("start")
        time.sleep(a.seconds)  # the measured window: the bridges work on their own meanwhile
        for c in conns:
            c.send("stop")
        s1, io1 = server_use()
        results = [c.recv() for c in conns]
        for c in conns:
            c.send("stall")
        time.sleep(3 * a.interval)  # every host says it stands still, has published and read once
        t_stall0, (ss0, sio0) = time.monotonic(), server_use()
        for c in conns:
            c.send("start")
        time.sleep(a.stall_seconds)
        for c in conns:
            c.send("stop")
        ss1, sio1 = server_use()
        stall_wall = time.monotonic() - t_stall0
        stall_results = [c.recv() for c in conns]
        publisher = 0
        for c in conns:
            c.send({"publisher": publisher})
        sent_ns = None
        seen: Dict[int, int] = {}
        missing: List[int] = []
        for c in conns:
            if not c.poll(20.0):
                raise SystemExit("a worker did not report the verdict in time")
            msg = c.recv()
            if "sent_ns" in msg:
                sent_ns = msg["sent_ns"]
                msg = c.recv()
            seen.update({int(k): v for k, v in msg["seen_ns"].items()})
            missing += msg["missing"]
    finally:
        end_workers(procs, server, 10)
    seconds = statistics.mean(r["seconds"] for r in results)
    intervals = seconds / a.interval
    requests = sum(r["requests"] for r in results)
    cpu = sum(r["cpu_s"] for r in results)
    req_per_host_interval = requests / a.hosts / intervals
    cpu_ms_host_interval = cpu * 1000 / a.hosts / intervals
    delays = [(t - sent_ns) / 1e6 for h, t in seen.items() if h != publisher] if sent_ns else []
    fig = {
        "hosts": a.hosts, "ranks_per_host": a.ranks, "procs": a.procs, "interval_s": a.interval, "seconds": seconds,
        "setup_s": setup_s, "requests_per_s": requests / seconds, "requests_per_host_interval": req_per_host_interval,
        "waits_open": a.hosts, "bridge_cpu_ms_per_host_interval": cpu_ms_host_interval,
        "bridge_cpu_s_per_host_hour": cpu_ms_host_interval * (3600 / a.interval) / 1000,
        "bridge_cpu_percent_of_a_core": 100 * cpu / seconds, "server_cpu_percent_of_a_core": 100 * (s1 - s0) / seconds,
        "detect_ms": {"n": len(delays), "median": statistics.median(delays) if delays else None,
                      "p90": pct(delays, 0.9) if delays else None, "max": max(delays) if delays else None},
        "missed_verdict": missing, "cpus": os.cpu_count(),
        "store_bytes_per_s": (io1 - io0) / seconds,
        "stall": {
            "seconds": stall_wall, "threshold_s": a.stall_threshold,
            "requests_per_s": sum(r["requests"] for r in stall_results) / stall_wall,
            "store_bytes_per_s": (sio1 - sio0) / stall_wall,
            "server_cpu_percent_of_a_core": 100 * (ss1 - ss0) / stall_wall,
            "bridge_cpu_ms_per_host_interval": sum(r["cpu_s"] for r in stall_results) * 1000 / a.hosts
            / (stall_wall / a.interval),
        },
    }
    d = fig["detect_ms"]
    ok_req = req_per_host_interval <= BUDGET_REQUESTS_PER_HOST_INTERVAL + 0.01
    ok_cpu = cpu_ms_host_interval <= BUDGET_CPU_MS_PER_HOST_INTERVAL
    ok_det = bool(delays) and not missing and d["p90"] <= BUDGET_DETECT_P90_MS  # type: ignore[operator]
    print(f"## Store bridge load: {a.hosts} hosts x {a.ranks} ranks, one TCPStore on loopback, "
          f"heartbeat {a.interval:g}s, {seconds:.0f}s measured, {os.cpu_count()} CPUs\n")
    print("| figure | measured | budget | met |")
    print("|---|---|---|---|")
    print(f"| store requests per second (all hosts) | {requests / seconds:.0f} | "
          f"{BUDGET_REQUESTS_PER_HOST_INTERVAL * a.hosts / a.interval:.0f} | {'yes' if ok_req else 'NO'} |")
    print(f"| requests per host per interval | {req_per_host_interval:.2f} (+1 open wait) | "
          f"{BUDGET_REQUESTS_PER_HOST_INTERVAL:g} (+1 open wait) | {'yes' if ok_req else 'NO'} |")
    print(f"| bridge CPU per host per interval | {cpu_ms_host_interval:.3f} ms | "
          f"{BUDGET_CPU_MS_PER_HOST_INTERVAL:g} ms | {'yes' if ok_cpu else 'NO'} |")
    print(f"| bridge CPU per host per hour | {fig['bridge_cpu_s_per_host_hour']:.2f} s | "
          f"{BUDGET_CPU_MS_PER_HOST_INTERVAL * 3.6 / a.interval:.1f} s | {'yes' if ok_cpu else 'NO'} |")
    print(f"| store server CPU | {fig['server_cpu_percent_of_a_core']:.1f} % of a core | - | - |")
    st = fig["stall"]
    print(f"| store bytes per second (read + written by the server) | {fig['store_bytes_per_s'] / 1e3:.0f} kB/s | - | - |")
    print(f"| every host standing still ({a.stall_seconds:g}s, threshold {a.stall_threshold:g}s): requests per second "
          f"| {st['requests_per_s']:.0f} | - | - |")
    print(f"| every host standing still: store bytes per second | {st['store_bytes_per_s'] / 1e3:.0f} kB/s | - | - |")
    print(f"| every host standing still: store server CPU, bridge CPU per host per interval | "
          f"{st['server_cpu_percent_of_a_core']:.1f} % of a core, {st['bridge_cpu_ms_per_host_interval']:.3f} ms | - | - |")
    if delays:
        print(f"| cross-host detection (verdict published -> every other host's run dir), n={len(delays)} | "
              f"median {d['median']:.1f} ms, p90 {d['p90']:.1f} ms, max {d['max']:.1f} ms | "
              f"p90 {BUDGET_DETECT_P90_MS:g} ms | {'yes' if ok_det else 'NO'} |")
    if missing:
        print(f"\nhosts that never saw the verdict: {missing}")
    print(f"\n(all hosts connected and seeing each other {setup_s:.1f}s after start; all bridges "
          f"together used {fig['bridge_cpu_percent_of_a_core']:.1f} % of a core)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(fig, f, indent=2)
    sys.exit(0 if ok_req and ok_cpu and ok_det else 1)


if __name__ == "__main__":
    main()
