"""Store traffic at scale: N simulated hosts speaking the real bridge protocol to one TCPStore.

    sudo PYTHONPATH=. python benchmarks/store_scale.py [--hosts 64,256,1024] [--before REV]
        [--before-hosts 64,256] [--procs 4] [--interval 1] [--peer-timeout 5] [--seconds 15]
        [--stall-seconds 15]

One TCPStore server on 127.0.0.1 in a process of its own. Each simulated host is the
bridge's real beat loop (``peerwatch.hosts.bridge._BeatLoop``: its exchange with the store, its
judgement of the other hosts, its records in a run directory of its own) with a real
TCPStore connection of its own, and a real verdict waiter (``_VerdictWaiter``, a second
connection blocked in ``wait``). To be light, the hosts of a process share one loop thread
(each host's interval at its own phase, as its own beat thread would run it; the store
client is called in that thread, not through an owner thread per host); the waiters are
one thread each, blocked in C. Hosts are spread over ``--procs`` processes.

Measured per protocol and number of hosts, the steady state for ``--seconds``: the store
requests the hosts made (counted by each beat loop), the bytes the store server read and
wrote (its /proc io counters: every byte of every request and answer), the server's CPU;
the startup (every host counted: the time from the first registration, and the hosts judged
lost meanwhile, which must be none); then a whole host behind (below); then one host stops
beating (its loop is no longer called) and the time until every other host knows it is
lost, by either way the news travels: the ``lost`` record a host writes from its own
judgement or from the digest, or the verdict on it. As in a real job, the first host to
write that record publishes the verdict (its watchers decide, its bridge offers it with
``compare_set``; here at once, from a connection opened beforehand), unless a verdict came
first; the table gives the time from the kill to that first judgement, and from the
verdict's publication to every host's waiter. "before" is the protocol at ``--before`` (a
git revision: its ``peerwatch/``, extracted to a temporary directory, with this tree's
built C extension; it must have this tree's package layout, dec8ddb or later, since the
hosts are driven through its modules), "after" this tree's. Prints one markdown table, and
one for the stall.

A whole host behind (``--stall-seconds``, 0: none): every host's ranks stand still, as if
for the stuck threshold already (``STALL_AGE_MS``). The loop thread plays each host's hang
judges: before each of its intervals it rewrites the host's ``RUN/stall.json`` (a
:class:`peerwatch.hangs.diagnose.Summary`, built by the code under test, aged as of now),
the file the bridge publishes from. Every host's ranks wait inside all_reduce #31, but the
laggard's (one host mid-range, not an aggregator), stuck before it, at #30, not in a
collective, with a whole window of samples and no work (``diagnose.plainly_stuck``): its
summary is public at once, and the others' follow as they read it. After each interval the
loop thread reads the host's ``RUN/stalls-remote.json`` (what the bridge hands the judges)
when it was replaced. Measured: the store's load from ``STALL_SETTLE_S`` into the stall,
for ``--stall-seconds`` (requests and server bytes per host, server CPU, as above; best a
multiple of the summaries' refresh, 7.5 s: each host publishes and reads once a refresh);
the time from the stall's start until each other host's file holds the laggard's ranks in
detail (those that have it by ``STALL_DEADLINE_S`` are counted); and, at the end, the
diagnosis one reader host's judges would make (``diagnose.diagnose`` over its own ranks and
the summaries in its file): does it name the laggard's ranks, and if not, why. Then the
ranks move again (``{}`` in stall.json) a few intervals before the host is frozen. Neither
protocol's store keys are touched: only the two files, which both keep.

As root, runs itself in a network namespace of its own with only loopback (see
benchmarks/bridge_load.py: torch's client asks DNS about every address it connects to).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import heapq
import json
import multiprocessing as mp
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import psutil
from _common import end_workers  # the benchmarks folder: sys.path[0] when run as a script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUP_TIMEOUT_S = 240.0
# The stall phase: every host's ranks stand still, one host's behind the others.
STALL_AGE_MS = 10_000  # the stall began this long before the phase: the stuck threshold (diagnose.STUCK_S)
STALL_THRESHOLD_MS = 60_000  # the judges' warning threshold in the summaries (diagnose.FLOOR_S)
STALL_SETTLE_S = 5.0  # the stall's measured window starts this long after the stall (past its first reads)
STALL_DEADLINE_S = 60.0  # from the stall's start: every host has the laggard's summary by then, or is counted without

SERVER = """
import sys, datetime, torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
print(s.port, flush=True)
sys.stdin.read()  # until the benchmark closes our stdin
"""


class _Direct:
    """The store client as the beat loop sees it, called in the caller's thread (one loop
    thread serves the hosts of a process; the bridge gives each its own owner thread)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def call(self, fn: Any, timeout: float, connect_s: float = 0.0) -> Any:
        return fn(self.store)


def worker(first: int, count: int, args: Dict[str, Any], port: int, base: str, conn: Any) -> None:
    """Hosts first..first+count-1 in this process, driven by one loop thread."""
    import datetime
    import logging

    sys.path.insert(0, args["root"])  # the protocol measured (spawn hands the child our sys.path)
    import torch.distributed as dist

    import peerwatch.hosts.bridge as bridge_mod
    from peerwatch.core.config import Config, LauncherFacts
    from peerwatch.core.records import Registration, Verdict, encode
    from peerwatch.hangs import diagnose
    from peerwatch.hosts.store_protocol import NO_SEAL, VerdictFrom, publish_verdict
    from peerwatch.proc import identity
    from peerwatch.rundir.rundir import _SUBDIRS, RANKS, REMOTE_STALLS_FILE, STALL_FILE, RunDir, rank_file

    logging.getLogger("peerwatch").setLevel(logging.CRITICAL)
    lost_at: Dict[Tuple[int, int], float] = {}  # (host, failed rank) -> monotonic time recorded
    verdict_at: Dict[int, float] = {}
    original_write = bridge_mod._write_failure

    published: Dict[str, Any] = {}  # the verdict this process offered: when, and whether it was first

    def publish(failure: Any) -> None:
        v = Verdict(rank=failure.rank, cause=failure.cause, exit_code=1, failed_at_ns=time.time_ns(), detected_by=0,
                    detected_at_ns=time.time_ns(), host="sim", detail="lost (benchmark)")
        sent = time.monotonic()
        won = publish_verdict(pub_store, facts.key_prefix, encode(v))
        published.update(sent=sent, won=won)

    def write_failure(run_dir: Any, failure: Any) -> None:
        host = int(os.path.basename(run_dir.path)[4:])
        lost_at.setdefault((host, failure.rank), time.monotonic())
        original_write(run_dir, failure)
        if host not in verdict_at and "started" not in published:  # no verdict here yet: decide and offer one
            published["started"] = True
            threading.Thread(target=publish, args=(failure,), daemon=True).start()

    bridge_mod._write_failure = write_failure
    ranks, hosts, interval = args["ranks"], args["hosts"], args["interval"]
    config = Config.resolve({
        "world_size": ranks * hosts, "local_world_size": ranks, "heartbeat_interval": interval,
        "peer_timeout": args["peer_timeout"], "store": f"127.0.0.1:{port}", "run_id": args["run_id"],
        "stragglers": False,
    }, env={})
    facts = LauncherFacts.resolve(config, {})
    me = identity.self_info()
    pub_store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=30))  # a bridge's connection, open beforehand
    stopped = threading.Event()
    loops: Dict[int, Any] = {}
    waiters: List[threading.Thread] = []
    for h in range(first, first + count):
        rd = RunDir(os.path.join(base, f"host{h:05d}"))
        os.makedirs(rd.path, 0o700)
        for sub in _SUBDIRS:
            os.mkdir(rd.join(sub), 0o700)
        regs = []
        for local in range(ranks):
            reg = Registration(rank=h * ranks + local, pid=me.pid, ppid=me.ppid, start_ticks=me.start_ticks,
                               uid=me.uid, host=f"sim{h:05d}", boot_id=identity.boot_id(),
                               pidns=identity.pid_namespace(), time_ns=time.time_ns())
            rd.write(RANKS, rank_file("rank", reg.rank), encode(reg), replace=True)
            regs.append(reg)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=30))
        link = bridge_mod._Link(config, rd, facts, _Direct(store), stopped, NO_SEAL, VerdictFrom())
        gate = bridge_mod._TorchGate()
        gate.usable = True
        gate._decided.set()
        seq = bridge_mod._BeatSeq()
        loop = bridge_mod._BeatLoop(link, regs[0], f"ident-{args['run_id']}-{h}", seq, threading.Event(),
                                    lambda: False, gate)
        loop.sim = h
        loops[h] = loop

        def deliver(data: bytes, h: int = h) -> None:
            verdict_at.setdefault(h, time.monotonic())

        waiter = bridge_mod._VerdictWaiter(link, gate, deliver)
        t = threading.Thread(target=waiter.run, name=f"wait-{h}", daemon=True)
        t.start()
        waiters.append(t)
    conn.send({"connected": True})
    conn.recv()  # go: every host's first interval at a random point of its first heartbeat
    frozen: set = set()
    failures = [0]
    go = time.monotonic()
    due = [(go + random.uniform(0.0, interval), h) for h in loops]
    heapq.heapify(due)
    last_ok: Dict[int, Optional[float]] = {h: None for h in loops}
    # The stall phase, while it lasts (set by the main thread, read by the loop thread). The
    # loop thread plays each host's hang judges too: before each of the host's intervals it
    # rewrites RUN/stall.json (the bridge takes it only while it is recent), with its age as
    # of now; after it, it looks at RUN/stalls-remote.json (what the bridge hands the judges)
    # for the laggard's summary, so the time it is seen is the time the bridge wrote it.
    stalling: List[Optional[Dict[str, Any]]] = [None]
    stall_files: set = set()  # the loop thread's: hosts whose stall.json says they stand still

    def host_ranks(h: int) -> Tuple[int, ...]:
        return tuple(range(h * ranks, (h + 1) * ranks))

    def summary(h: int, st: Dict[str, Any]) -> Any:
        """Host h's stall as its judges would write it now. Built by the code under test (an
        older Summary without a field leaves it out: its hosts publish as that code does)."""
        fields = {"host": f"sim{h:05d}", "stall": st["token"], "threshold_ms": STALL_THRESHOLD_MS,
                  "age_ms": (time.monotonic_ns() - st["start_ns"]) // 1_000_000 + STALL_AGE_MS}
        if h == st["laggard"]:  # behind, not in a collective, plainly stuck: described rank by rank
            fields.update(detailed=tuple((r, st["behind"]) for r in host_ranks(h)), stuck=True)
        else:  # waiting in the collective the laggard never entered: grouped
            fields.update(waiting=((host_ranks(h), st["waiting"]),), stuck=False)
        known = {f.name for f in dataclasses.fields(diagnose.Summary)}
        return diagnose.Summary(**{k: v for k, v in fields.items() if k in known})

    def judges_write(h: int, st: Optional[Dict[str, Any]]) -> None:
        run_dir = loops[h].link.run_dir
        if st is not None:
            run_dir.write_or_log(STALL_FILE, summary(h, st).to_json())
            stall_files.add(h)
        elif h in stall_files:  # the ranks move again: the judges say so ("{}" is no stall to the bridge)
            run_dir.write_or_log(STALL_FILE, b"{}")
            stall_files.discard(h)

    def look(h: int, st: Dict[str, Any]) -> None:
        """Has host h's bridge handed its judges the laggard's summary (its ranks in detail)?
        Read again only when the file was replaced (the bridge renames a new one in)."""
        path = os.path.join(loops[h].link.run_dir.path, REMOTE_STALLS_FILE)
        try:
            info = os.stat(path)
            key = (info.st_ino, info.st_mtime_ns)
            if st["looked"].get(h) == key:
                return
            st["looked"][h] = key
            with open(path, "rb") as fh:
                entries = json.loads(fh.read())["hosts"]
        except (OSError, ValueError, KeyError, TypeError):
            return
        first = host_ranks(st["laggard"])[0]
        for _, text in entries:
            s = diagnose.Summary.from_json(str(text).encode())
            if s is not None and first in [r for r, _ in s.detailed]:
                st["seen"][h] = time.monotonic()
                return

    def run() -> None:
        while not stopped.is_set():
            at, h = heapq.heappop(due)
            wait = at - time.monotonic()
            if wait > 0 and stopped.wait(wait):
                return
            if h not in frozen:
                loop = loops[h]
                st = stalling[0]
                judges_write(h, st)
                try:
                    loop._interval()
                    last_ok[h] = time.monotonic()
                except Exception as e:  # noqa: BLE001 - as the beat thread does
                    failures[0] += 1
                    loop._unreachable(e, last_ok[h])
                if st is not None and h != st["laggard"] and h not in st["seen"]:
                    look(h, st)
            heapq.heappush(due, (max(at + interval, time.monotonic()), h))

    runner = threading.Thread(target=run, name="sim-loop", daemon=True)
    runner.start()

    def joined(loop: Any) -> int:
        return int(getattr(loop, "joined", None) or len(loop.hosts))  # the old protocol: every host knows all

    def cpu() -> float:
        t = psutil.Process().cpu_times()
        return t.user + t.system

    def start_stall(start_ns: int, laggard: int) -> Dict[str, Any]:
        """Every host's ranks stand still from ``start_ns`` on; ``laggard``'s are behind."""
        idle = diagnose.Activity(**{f.name: 0 for f in dataclasses.fields(diagnose.Activity)})
        idle = dataclasses.replace(idle, span_ms=7000, samples=8)  # a whole window, a second apart: no work
        st = {
            "start_ns": start_ns, "token": f"stall-{start_ns}", "laggard": laggard, "seen": {}, "looked": {},
            "waiting": diagnose.RankState(collectives=(("0", 31, 30),), entered=(("0", 31, "all_reduce", "[1024]"),),
                                          in_collective=True),
            "behind": diagnose.RankState(collectives=(("0", 30, 30),), entered=(("0", 30, "all_reduce", "[1024]"),),
                                         state="S", in_collective=False, where="train.py:42 in step", activity=idle),
        }
        stalling[0] = st
        rule = getattr(diagnose, "plainly_stuck", None)  # the laggard's ranks must be stuck by the rule under test
        return {"plainly_stuck": rule(st["behind"]) if rule is not None else None}

    def diagnose_at(h: int) -> Dict[str, Any]:
        """The diagnosis host h's judges would make now, over its own ranks and the other
        hosts' summaries its bridge handed them (as peerwatch.diagnoser does); why not, if
        it does not name the laggard's ranks."""
        st = stalling[0]
        if st is None:
            return {"reader": h, "named": False, "why": "no stall"}
        out: Dict[str, Any] = {"reader": h, "named": False}
        try:
            lagging = host_ranks(st["laggard"])
            # Its own ranks, seen now: their last move is the stall's (what the judges' summary ages from).
            moved = st["start_ns"] - STALL_AGE_MS * 1_000_000
            view = {r: dataclasses.replace(s, moved_mono_ns=moved, seen_mono_ns=None)
                    for r, s in diagnose.remote_ranks(summary(h, st), moved).items()}
            with open(os.path.join(loops[h].link.run_dir.path, REMOTE_STALLS_FILE), "rb") as fh:
                entries = json.loads(fh.read())["hosts"]
            for moved_ns, text in entries:
                s = diagnose.Summary.from_json(str(text).encode())
                if s is not None:
                    view.update({r: x for r, x in diagnose.remote_ranks(s, moved_ns).items() if r not in view})
            now = time.monotonic_ns()
            out.update(hosts_read=len(entries), ranks_seen=len(view), laggard_seen=lagging[0] in view,
                       since_s=round((now - diagnose.last_move(view)) / 1e9, 1))
            found = diagnose.diagnose(view, now, threshold_ns=STALL_THRESHOLD_MS * 1_000_000, timeout_ms=0,
                                      awake_since_ns=0, stuck_ns=STALL_AGE_MS * 1_000_000)
            if found is None:
                out["why"] = "no finding" + ("" if lagging[0] in view else ": the laggard's summary is not in its view")
                return out
            out.update(kind=found.kind, laggards=list(found.laggards), detail=found.detail[:200],
                       named=tuple(sorted(found.laggards)) == lagging)
            if not out["named"]:
                out["why"] = "names other ranks"
        except Exception as e:  # noqa: BLE001 - said in the figures, not a crash
            out["why"] = repr(e)
        return out

    while True:
        msg = conn.recv()
        if msg == "status":
            conn.send({"joined_min": min(joined(x) for x in loops.values()), "lost": len(lost_at),
                       "requests": sum(x.requests for x in loops.values()), "cpu_s": cpu(),
                       "code": bridge_mod.__file__, "failures": failures[0], "aggregating": [h for h, x in loops.items() if getattr(x, "term", None)
                                                              is not None]})
        elif msg[0] == "freeze":
            frozen.add(msg[1])
            conn.send({"frozen_at": time.monotonic()})
        elif msg[0] == "stall":
            conn.send(start_stall(msg[1], msg[2]))
        elif msg == "stall_seen":
            st = stalling[0]
            conn.send({"at": dict(st["seen"]) if st is not None else {}})
        elif msg[0] == "stall_diagnose":
            conn.send(diagnose_at(msg[1]))
        elif msg == "stall_end":
            stalling[0] = None
            conn.send({"ended": True})
        elif msg[0] == "lost":
            victim_rank = msg[1] * ranks
            conn.send({"at": {h: t for (h, r), t in lost_at.items() if r == victim_rank}})
        elif msg == "verdicts":
            conn.send({"at": dict(verdict_at), "published": {k: v for k, v in published.items() if k != "started"}})
        elif msg == "stop":
            stopped.set()
            runner.join(10)
            conn.send({"stopped": True})
            return


def _pick(hosts: int, first: int, avoid: List[int]) -> int:
    """The first host from ``first`` on (wrapping) that is none of ``avoid``."""
    return next(h % hosts for h in range(first, first + hosts) if h % hosts not in avoid)


def stall_phase(hosts: int, a: argparse.Namespace, ask: Any, owner: Any, use: Any,
                avoid: List[int]) -> Dict[str, Any]:
    """A whole host behind: every host's ranks stand still, the laggard's at the collective
    before the others'. The figures: the store's load meanwhile, when each other host's
    bridge handed its judges the laggard's summary, and a reader's diagnosis at the end.
    ``owner(h)``: the connection to the worker of host h; ``use()``: the server's (CPU s,
    bytes); ``avoid``: hosts neither the laggard nor the reader may be (the aggregators,
    the host frozen afterwards)."""
    laggard = _pick(hosts, hosts // 2 + 3, avoid)
    reader = _pick(hosts, hosts // 4 + 1, avoid + [laggard])
    start_ns = time.monotonic_ns()
    start = start_ns / 1e9  # the workers' time.monotonic() (one clock for every process of the machine)
    if any(r["plainly_stuck"] is False for r in ask(("stall", start_ns, laggard))):
        raise SystemExit("the laggard's ranks are not plainly stuck by the rule under test: fix the benchmark")
    time.sleep(max(0.0, start + STALL_SETTLE_S - time.monotonic()))
    s0, io0 = use()
    st0, t0 = ask("status"), time.monotonic()
    time.sleep(a.stall_seconds)  # the measured window: the hosts stand still and exchange their summaries
    s1, io1 = use()
    st1, t1 = ask("status"), time.monotonic()
    secs = t1 - t0
    others = [h for h in range(hosts) if h != laggard]
    deadline = start + max(STALL_DEADLINE_S, STALL_SETTLE_S + a.stall_seconds)
    while True:
        seen: Dict[int, float] = {}
        for r in ask("stall_seen"):
            seen.update(r["at"])
        if all(h in seen for h in others) or time.monotonic() > deadline:
            break
        time.sleep(0.2)  # polling the workers, deadline-bounded
    at = sorted(seen[h] - start for h in others if h in seen)
    c = owner(reader)
    c.send(("stall_diagnose", reader))
    diagnosis = c.recv()
    ask("stall_end")
    # The ranks move again: past the bridges' next intervals, their beats no longer say 's'.
    time.sleep(3 * a.interval)
    return {
        "laggard": laggard, "seconds": secs,
        "requests_per_host_s": (sum(s["requests"] for s in st1) - sum(s["requests"] for s in st0)) / hosts / secs,
        "bytes_per_host_s": (io1 - io0) / hosts / secs,
        "server_cpu_pct": 100 * (s1 - s0) / secs,
        "sim_cpu_pct": 100 * (sum(s["cpu_s"] for s in st1) - sum(s["cpu_s"] for s in st0)) / secs,
        "failed_intervals": sum(s["failures"] for s in st1) - sum(s["failures"] for s in st0),
        "known_by": len(at), "of": len(others),
        "median_s": statistics.median(at) if at else None,
        "all_s": max(at) if len(at) == len(others) else None,
        "max_s": max(at) if at else None,
        "missing": [h for h in others if h not in seen][:20],
        "diagnosis": diagnosis,
    }


def run_one(variant: str, root: str, hosts: int, a: argparse.Namespace) -> Dict[str, Any]:
    """One protocol (the code under ``root``), ``hosts`` simulated hosts: the figures."""
    env = dict(os.environ, PYTHONPATH=root)
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    old_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = root  # the spawned workers import peerwatch from there
    base = tempfile.mkdtemp(prefix="peerwatch-store-scale-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    args = {"hosts": hosts, "ranks": a.ranks, "interval": a.interval, "peer_timeout": a.peer_timeout,
            "run_id": f"scale-{variant}-{hosts}-{os.getpid()}", "root": root}
    fig: Dict[str, Any] = {"variant": variant, "hosts": hosts}
    try:
        port = int(server.stdout.readline())  # type: ignore[union-attr]
        sproc = psutil.Process(server.pid)
        procs_n = min(a.procs, hosts)
        per = -(-hosts // procs_n)
        for i in range(procs_n):
            first, count = i * per, min(per, hosts - i * per)
            if count <= 0:
                break
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker, args=(first, count, args, port, base, child), daemon=True)
            p.start()
            procs.append(p)
            conns.append(parent)
        for c in conns:
            if not c.poll(SETUP_TIMEOUT_S):
                raise SystemExit("a worker did not connect its hosts in time")
            c.recv()

        def ask(msg: Any) -> List[Dict[str, Any]]:
            for c in conns:
                c.send(msg)
            return [c.recv() for c in conns]

        start = time.monotonic()
        for c in conns:
            c.send("go")
        deadline = start + SETUP_TIMEOUT_S
        while True:
            st = ask("status")
            if min(s["joined_min"] for s in st) >= hosts:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"{variant} {hosts}: not every host counted in time: {st}")
            time.sleep(0.2)  # polling the workers, deadline-bounded
        fig["startup_s"] = time.monotonic() - start
        fig["lost_at_startup"] = sum(s["lost"] for s in st)
        time.sleep(2 * a.interval)  # past the first registrations and roster reads

        def server_use() -> Tuple[float, int]:
            io = sproc.io_counters()
            t = sproc.cpu_times()
            return t.user + t.system, io.read_chars + io.write_chars

        s0, io0 = server_use()
        st0, t0 = ask("status"), time.monotonic()
        time.sleep(a.seconds)  # the measured window: the hosts beat on their own meanwhile
        s1, io1 = server_use()
        st1, t1 = ask("status"), time.monotonic()
        secs = t1 - t0
        requests = sum(s["requests"] for s in st1) - sum(s["requests"] for s in st0)
        fig.update({
            "seconds": secs,
            "requests_per_host_s": requests / hosts / secs,
            "bytes_per_host_s": (io1 - io0) / hosts / secs,
            "server_cpu_pct": 100 * (s1 - s0) / secs,
            "sim_cpu_pct": 100 * (sum(s["cpu_s"] for s in st1) - sum(s["cpu_s"] for s in st0)) / secs,
            "failed_intervals": sum(s["failures"] for s in st1) - sum(s["failures"] for s in st0),
            "aggregators": sorted(h for s in st1 for h in s["aggregating"]),
            "code": st1[0]["code"],
        })
        if not os.path.realpath(fig["code"]).startswith(os.path.realpath(root) + os.sep):
            raise SystemExit(f"{variant}: the hosts ran {fig['code']}, not the code under {root} (a --before "
                             "revision must have the layout of this tree: peerwatch/hosts/, since dec8ddb)")
        victim = hosts - 1
        # A whole host behind, before the freeze (every host still beats; it ends with the ranks moving again).
        fig["stall"] = stall_phase(hosts, a, ask, lambda h: conns[h // per], server_use,
                                   fig["aggregators"] + [victim]) if a.stall_seconds > 0 else None
        # A host goes silent (not an aggregator: the aggregator's own loss is judged by its digest).
        owner = victim // per
        conns[owner].send(("freeze", victim))
        frozen_at = conns[owner].recv()["frozen_at"]
        deadline = time.monotonic() + a.peer_timeout + 10 * a.interval + 30.0
        while True:
            seen: Dict[int, float] = {}
            for r in ask(("lost", victim)):
                seen.update(r["at"])
            got: Dict[int, float] = {}
            sent: Optional[float] = None
            for r in ask("verdicts"):
                got.update(r["at"])
                if r["published"].get("won"):
                    sent = r["published"]["sent"]
            others = [h for h in range(hosts) if h != victim]
            if all(h in got for h in others) or time.monotonic() > deadline:
                break
            time.sleep(0.2)  # polling the workers, deadline-bounded
        known = sorted(min(t for t in (seen.get(h), got.get(h)) if t is not None) - frozen_at
                       for h in others if h in seen or h in got)
        fig["lost_known_by"] = len(known)
        fig["lost_median_s"] = statistics.median(known) if known else None
        fig["lost_all_s"] = max(known) if len(known) >= hosts - 1 else None
        fig["first_judged_s"] = min(seen.values()) - frozen_at if seen else None
        fig["by_digest"] = sum(1 for h in others if h in seen and (h not in got or seen[h] <= got[h]))
        vd = sorted(got[h] - sent for h in others if h in got) if sent is not None else []
        fig["verdict_known_by"] = len(vd)
        fig["verdict_median_ms"] = 1000 * statistics.median(vd) if vd else None
        fig["verdict_all_ms"] = 1000 * max(vd) if len(vd) >= hosts - 1 else None
        ask("stop")
    finally:
        if old_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_path
        end_workers(procs, server, 15)
        shutil.rmtree(base, ignore_errors=True)
    return fig


def extract(rev: str) -> str:
    """``rev``'s peerwatch/ in a temporary directory, with this tree's built C extension."""
    where = tempfile.mkdtemp(prefix="peerwatch-before-")
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "peerwatch"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", where], input=archive, check=True)
    for so in glob.glob(os.path.join(ROOT, "peerwatch", "*.so")):
        shutil.copy(so, os.path.join(where, "peerwatch"))
    return where


def _isolate() -> None:
    if os.environ.get("PEERWATCH_LOAD_ISOLATED") == "1" or os.geteuid() != 0 or "--no-netns" in sys.argv:
        return
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return
    os.environ["PEERWATCH_LOAD_ISOLATED"] = "1"
    os.execvp("unshare", ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$0" "$@"',
                          sys.executable, *sys.argv])


def _fmt(v: Optional[float], spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main() -> None:
    _isolate()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", default="64,256,1024", help="the numbers of hosts of the new protocol")
    parser.add_argument("--before", default="", help="a git revision to compare, with this tree's layout ('' for none; "
                        "the O(hosts^2) protocol, fb1c56d, predates it: its figures are in docs/performance.md)")
    parser.add_argument("--before-hosts", default="64,256",
                        help="the numbers of hosts of the old protocol (each reads every beat: 1024 does not keep up)")
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=8, help="ranks per host (registered in its run directory)")
    parser.add_argument("--interval", type=float, default=1.0, help="heartbeat_interval")
    parser.add_argument("--peer-timeout", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=15.0, help="steady state measured")
    parser.add_argument("--stall-seconds", type=float, default=15.0,
                        help="a whole host behind: the stall measured, from %gs into it (0: no stall phase); best a "
                        "multiple of the summaries' refresh (%gs, an eighth of their threshold: each host publishes "
                        "its summary and reads the others' once a refresh)" % (STALL_SETTLE_S, STALL_THRESHOLD_MS / 8000))
    parser.add_argument("--json", default="")
    parser.add_argument("--no-netns", action="store_true")
    a = parser.parse_args()
    runs: List[Tuple[str, str, int]] = []
    old = extract(a.before) if a.before else ""
    runs += [(f"before ({a.before})", old, int(n)) for n in a.before_hosts.split(",") if n and old]
    runs += [("after", ROOT, int(n)) for n in a.hosts.split(",") if n]
    figs = []
    try:
        for variant, root, n in runs:
            print(f"... {variant}, {n} hosts", file=sys.stderr, flush=True)
            figs.append(run_one(variant.split()[0], root, n, a))
            print(json.dumps(figs[-1]), file=sys.stderr, flush=True)
    finally:
        if old:  # the extracted revision
            shutil.rmtree(old, ignore_errors=True)
    print(f"\n## Store traffic: simulated hosts x {a.ranks} ranks, one TCPStore on loopback, heartbeat "
          f"{a.interval:g}s, peer_timeout {a.peer_timeout:g}s, {a.seconds:g}s measured, {os.cpu_count()} CPUs\n")
    print("| protocol | hosts | requests/s per host | server bytes/s per host | server CPU | startup: all counted "
          "(lost meanwhile) | dead host: first judged | dead host known everywhere (median) | its verdict at every "
          "host (median) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for f, (variant, _, _) in zip(figs, runs):
        print(f"| {variant} | {f['hosts']} | {f['requests_per_host_s']:.2f} | {f['bytes_per_host_s']:.0f} B/s | "
              f"{f['server_cpu_pct']:.1f} % | {f['startup_s']:.1f} s ({f['lost_at_startup']}) | "
              f"{_fmt(f['first_judged_s'], '.2f')} s | "
              f"{_fmt(f['lost_all_s'], '.2f')} s ({_fmt(f['lost_median_s'], '.2f')} s) | "
              f"{_fmt(f['verdict_all_ms'], '.0f')} ms ({_fmt(f['verdict_median_ms'], '.0f')} ms) |")
    after = [f for f in figs if f["variant"] == "after"]
    if len(after) >= 2:
        lo, hi = after[0], after[-1]
        print(f"\nper-host bytes/s, {hi['hosts']} hosts against {lo['hosts']}: "
              f"{hi['bytes_per_host_s'] / lo['bytes_per_host_s']:.2f}x; requests/s per host: "
              f"{hi['requests_per_host_s'] / lo['requests_per_host_s']:.2f}x")
    cpus = ", ".join("%.0f %%" % f["sim_cpu_pct"] for f in figs)
    failed = ", ".join(str(f["failed_intervals"]) for f in figs)
    print(f"(simulator CPU, all hosts, per row: {cpus}; failed intervals: {failed})")
    stalls = [(f, variant) for f, (variant, _, _) in zip(figs, runs) if f.get("stall")]
    if stalls:
        print(f"\n## A whole host behind: every host's ranks stand still, one host's at the collective before "
              f"(plainly stuck); {a.stall_seconds:g}s measured from {STALL_SETTLE_S:g}s into the stall\n")
        print("| protocol | hosts | stall: requests/s per host | server bytes/s per host | server CPU | laggard's "
              "summary at every host (median) | hosts that had it | a reader's diagnosis names the laggard |")
        print("|---|---|---|---|---|---|---|---|")
        for f, variant in stalls:
            s, d = f["stall"], f["stall"]["diagnosis"]
            named = f"yes ({d['kind']})" if d["named"] else f"no ({d.get('why', '')})"
            print(f"| {variant} | {f['hosts']} | {s['requests_per_host_s']:.2f} | {s['bytes_per_host_s']:.0f} B/s | "
                  f"{s['server_cpu_pct']:.1f} % | {_fmt(s['all_s'], '.1f')} s ({_fmt(s['median_s'], '.1f')} s) | "
                  f"{s['known_by']} of {s['of']} | {named} |")
        cpus = ", ".join("%.0f %%" % f["stall"]["sim_cpu_pct"] for f, _ in stalls)
        failed = ", ".join(str(f["stall"]["failed_intervals"]) for f, _ in stalls)
        print(f"(simulator CPU in the stall, per row: {cpus}; failed intervals: {failed})")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(figs, fh, indent=2)


if __name__ == "__main__":
    main()
