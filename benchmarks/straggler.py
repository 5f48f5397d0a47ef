"""The straggler, named with no configuration: how fast, how rarely wrong, at what cost.

    .venv/bin/python benchmarks/straggler.py                         (everything, ~25 min)
    .venv/bin/python benchmarks/straggler.py --only detect --runs 3
    .venv/bin/python benchmarks/straggler.py --only detect --runs 3 --ddp
    .venv/bin/python benchmarks/straggler.py --only balanced --minutes 10 --hogs 2
    .venv/bin/python benchmarks/straggler.py --only cost --pairs 12
    .venv/bin/python benchmarks/straggler.py --only cost --cost-step ddp --pairs 20 --block-s 2 --in-jobs
    .venv/bin/python benchmarks/straggler.py --only enqueue-cost --pairs 20

1. **Detect.** 4 ranks of tests/collective_program.py (all_reduce, then a sleep as the
   "compute"), the default heartbeat (1 s, slots of 5 s), three computing 0.20 s a step and
   rank 2 0.30 s: the seconds from the first step to RUN/stragglers.json naming it, and
   whom it names.
2. **Balanced / checkpoint.** 4 ranks at 0.20 s a step for ``--minutes``, with ``--hogs``
   busy-looping processes loading the machine; then the same with rank 0 sleeping 2 s every
   300 steps (a checkpoint every ~a minute). Counted: the straggler lines logged (none
   expected), and the largest median gap the rule saw (from the last heartbeats).
3. **Cost.** In one process, blocks of a Python-heavy step (~5 ms) with the wait sampler
   running and not, alternated in random order (``--pairs`` x 10 pairs of 0.3 s): what the
   training thread pays, wall and its own CPU. Then two 2-rank gloo jobs, both with
   peerwatch, ``stragglers`` on and off, running blocks of steps in turn (A/B in random
   order, one run): a Python-heavy step and an all_reduce of 1000 floats (the whole of it:
   sampler, slots, judge; noisier: two processes each, on a shared machine); with
   ``--cost-step ddp``, a DDP step instead (a small model's forward and backward, its
   gradient all-reduce in C++), which adds the enqueue measure's reads of the flight
   recorder (one every 2 slots, the ring full after the first ~20 s).
4. **Reads.** In-process: one sample of the main thread (20 a second), one heartbeat's
   slot bookkeeping, and one judge's slot (read 8 heartbeats, judge 8 ranks; judge 1024);
   the enqueue measure's read of a full flight recorder (a one-rank gloo group, 2000
   entries), and its judge's slot (8 ranks' rows).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PROGRAM = os.path.join(ROOT, "tests", "collective_program.py")
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
from _common import clean_env, free_port, machine, peerwatch_commit, table  # noqa: E402

WORLD = 4
STEP_S = 0.20
SLOW_S = 0.10  # the straggler's extra compute: 0.30 s a step
START_TIMEOUT_S = 120.0


class Job:
    """WORLD ranks of collective_program.py, started now; ``close()`` kills and reaps them."""

    def __init__(self, workdir: str, behave: List[str], env_extra: Optional[Dict[str, str]] = None,
                 flags: Optional[List[str]] = None) -> None:
        self.run, self.ready, self.workdir = os.path.join(workdir, "run"), os.path.join(workdir, "ready"), workdir
        os.makedirs(self.ready)
        port = str(free_port())
        self.procs = []
        for rank in range(WORLD):
            env = clean_env(PEERWATCH_DIR=self.run, RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PYTHONPATH=ROOT, **(env_extra or {}))
            argv = [sys.executable, PROGRAM, "--world", str(WORLD), "--ready", self.ready, "--step-s", str(STEP_S),
                    *(flags or [])]
            for item in behave:
                argv += ["--behave", item]
            with open(os.path.join(workdir, f"rank-{rank}.log"), "wb") as log:
                self.procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))

    def wait_started(self) -> float:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(os.path.exists(os.path.join(self.ready, f"rank-{r}")) for r in range(WORLD)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"the job did not start: {self.logs()}")
            time.sleep(0.05)
        return time.monotonic()

    def found(self) -> Optional[List[dict]]:
        try:
            with open(os.path.join(self.run, "stragglers.json")) as f:
                return list(json.load(f)["stragglers"])
        except (OSError, ValueError, KeyError):
            return None

    def lines(self, text: str) -> List[str]:
        out = []
        for rank in range(WORLD):
            with open(os.path.join(self.workdir, f"rank-{rank}.log"), errors="replace") as f:
                out += [line for line in f if text in line]
        return out

    def logs(self) -> str:
        return "".join(open(os.path.join(self.workdir, f"rank-{r}.log"), errors="replace").read()[-2000:]
                       for r in range(WORLD))

    def largest_gap(self) -> Tuple[float, int]:
        """The largest median gap over the ranks' last windows (and whose), as the rule computes
        it; (0, -1) while it would not judge (fewer than MIN_SLOTS slots)."""
        from peerwatch.hangs.straggler import MIN_SLOTS, aligned, gaps, profile_of

        profiles = {}
        for rank in range(WORLD):
            with open(os.path.join(self.run, "heartbeats", f"rank-{rank:05d}.json")) as f:
                p = profile_of([tuple(s) for s in json.load(f)["waits"]])
            if p is not None:
                profiles[rank] = p
        shares = aligned(profiles)
        if len(shares) < WORLD or min(len(v) for v in shares.values()) < MIN_SLOTS:
            return 0.0, -1  # the rule does not judge yet (a slot or two at the start say nothing)
        g = {r: statistics.median(v) for r, v in gaps(shares).items()}
        rank = max(g, key=lambda r: g[r])
        return g[rank], rank

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()


def detect(runs: int, ddp: bool = False) -> List[List[str]]:
    rows = []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            job = Job(tmp, [f"2=slow:{SLOW_S}@0"], flags=["--ddp"] if ddp else [])
            try:
                t0 = job.wait_started()
                while not job.found() and time.monotonic() - t0 < 300:
                    time.sleep(0.1)
                took = time.monotonic() - t0
                found = job.found() or []
            finally:
                job.close()
        rows.append([f"{'DDP, data loading ' if ddp else ''}{STEP_S:.2f} s x3, {STEP_S + SLOW_S:.2f} s on rank 2",
                     f"{took:.1f} s",
                     ", ".join(f"rank {s['rank']} ({s['late_ms']} ms, {100 * s['share']:.0f} %)" for s in found)
                     or "nobody"])
    return rows


def hog() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def watch(minutes: float, hogs: int, behave: List[str], name: str) -> List[str]:
    load = [hog() for _ in range(hogs)]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            job = Job(tmp, behave)
            try:
                t0 = job.wait_started()
                worst = (0.0, -1)
                named = set()
                while time.monotonic() - t0 < minutes * 60:
                    time.sleep(5.0)  # a long watch: a look every slot is enough
                    named |= {s["rank"] for s in job.found() or []}
                    try:
                        worst = max(worst, job.largest_gap())
                    except (OSError, ValueError, KeyError, statistics.StatisticsError):
                        pass
                lines = job.lines("straggler")
                load1 = os.getloadavg()[0]
            finally:
                job.close()
    finally:
        for p in load:
            p.kill()
            p.wait()
    return [name, f"{minutes:g} min", f"{hogs} (load {load1:.1f})", str(len(lines)),
            ", ".join(map(str, sorted(named))) or "nobody", f"{worst[0]:.3f} (rank {worst[1]})"]


COST_RANK = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
import peerwatch
peerwatch.install()
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1000)
if sys.argv[2] == "ddp":
    torch.set_num_threads(1)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))

def ddp_step(state):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()

def step(state):
    if sys.argv[2] == "ddp":
        return ddp_step(state)
    rows = [{"id": i, "text": f"token-{(i * 7919 + state[0]) % 1000}", "w": i % 13} for i in range(7500)]
    counts = {}
    for row in rows:
        counts[row["text"]] = counts.get(row["text"], 0) + row["w"]
    state[0] += 1
    dist.all_reduce(t)

state = [0]
print(json.dumps({"ready": os.getpid()}), flush=True)
for line in sys.stdin:
    cmd = line.split()
    if not cmd or cmd[0] == "quit":
        break
    n = int(cmd[1])
    step(state)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        step(state)
    print(json.dumps({"ms": (time.perf_counter() - t0) * 1000 / n, "cpu_ms": (time.process_time() - c0) * 1000 / n}),
          flush=True)
"""


class CostJob:
    def __init__(self, workdir: str, on: bool, kind: str = "python") -> None:
        port = str(free_port())
        env = clean_env(PEERWATCH_DIR=os.path.join(workdir, f"run-{on}"), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=port, PEERWATCH_STRAGGLERS="1" if on else "0")
        self.procs = [subprocess.Popen([sys.executable, "-c", COST_RANK, ROOT, kind], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for r in range(2)]
        for p in self.procs:
            assert p.stdout is not None
            json.loads(p.stdout.readline())

    def block(self, steps: int) -> Tuple[float, float]:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(f"run {steps}\n")
            p.stdin.flush()
        replies = [json.loads(p.stdout.readline()) for p in self.procs if p.stdout is not None]
        return statistics.mean(r["ms"] for r in replies), statistics.mean(r["cpu_ms"] for r in replies)

    def close(self) -> None:
        for p in self.procs:
            try:
                assert p.stdin is not None
                p.stdin.write("quit\n")
                p.stdin.close()
            except OSError:
                pass
        for p in self.procs:
            p.wait(timeout=60)


def cost(pairs: int, block_s: float, kind: str = "python") -> List[List[str]]:
    with tempfile.TemporaryDirectory() as tmp:
        jobs = {on: CostJob(tmp, on, kind) for on in (False, True)}
        try:
            warm = statistics.mean(jobs[on].block(50)[0] for on in (False, True))
            steps = max(50, int(block_s * 1000 / warm))
            # Past two slots: the sampler runs, and a judge has judged; for DDP, past 25 s: the
            # flight recorder's ring is full (its reads cost the most from then on).
            time.sleep(12.0 if kind == "python" else 25.0)
            res: Dict[bool, List[Tuple[float, float]]] = {False: [], True: []}
            for _ in range(pairs):
                for on in random.sample([False, True], 2):
                    res[on].append(jobs[on].block(steps))
        finally:
            for job in jobs.values():
                job.close()
    diffs = [(b[0] - a[0]) / a[0] * 100 for a, b in zip(res[False], res[True])]
    cpu = [(b[1] - a[1]) / a[1] * 100 for a, b in zip(res[False], res[True])]
    half = 2.2 * statistics.stdev(diffs) / len(diffs) ** 0.5
    what = "Python step + all_reduce(1000), 2 ranks" if kind == "python" else "DDP step (256-512-10 MLP), 2 ranks"
    return [[what, f"{pairs} x {steps}",
             f"{statistics.mean(a for a, _ in res[False]):.3f}", f"{statistics.mean(a for a, _ in res[True]):.3f}",
             f"**{statistics.mean(diffs):+.2f} % ± {half:.2f} %**", f"{statistics.mean(cpu):+.2f} %"]]


def _python_step(n: int = 7500) -> None:
    rows = [{"id": i, "text": f"token-{(i * 7919) % 1000}", "w": i % 13} for i in range(n)]
    counts: Dict[str, int] = {}
    for row in rows:
        counts[row["text"]] = counts.get(row["text"], 0) + row["w"]  # type: ignore[call-overload]


def sampler_cost(pairs: int, block_s: float) -> List[List[str]]:
    """In one process: blocks of a Python-heavy step with the wait sampler off, sampling
    (the job moves), and started but asleep (the job stands still: the control, which
    should cost nothing), in random order; the sampler started before and ended after each
    block (not timed). What the training thread pays for the 20 samples a second."""
    from peerwatch.hangs.waits import WaitSampler

    t0 = time.perf_counter()
    for _ in range(20):
        _python_step()
    steps = max(10, int(block_s / ((time.perf_counter() - t0) / 20)))
    res: Dict[str, List[Tuple[float, float]]] = {"off": [], "on": [], "asleep": []}
    for _ in range(pairs):
        for how in random.sample(list(res), 3):
            sampler = WaitSampler(0) if how != "off" else None
            if sampler is not None:
                sampler.moving(how == "on")
                sampler.start()
            time.sleep(0.06)  # the same pause before every block (the sampler's first sample is due)
            w0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(steps):
                _python_step()
            res[how].append(((time.perf_counter() - w0) * 1000 / steps, (time.thread_time() - c0) * 1000 / steps))
            if sampler is not None:
                sampler.stop()
                sampler._thread.join()
    rows = []
    for how in ("on", "asleep"):
        cells = []
        for i in (0, 1):
            d = [(b[i] - a[i]) / a[i] * 100 for a, b in zip(res["off"], res[how])]
            cells.append(f"{statistics.mean(d):+.2f} % ± {1.97 * statistics.stdev(d) / len(d) ** 0.5:.2f} %")
        rows.append([f"Python step, one process, sampler {'sampling' if how == 'on' else 'asleep (control)'}",
                     f"{pairs} x {steps}", f"{statistics.mean(a[0] for a in res['off']):.3f}",
                     f"{statistics.mean(b[0] for b in res[how]):.3f}", f"**{cells[0]}**", cells[1]])
    return rows


def reads() -> List[List[str]]:
    import threading

    from peerwatch.hangs.collectives import in_torch_distributed
    from peerwatch.hangs.straggler import SLOTS, Profile, find
    from peerwatch.hangs.waits import WaitWindow

    main = threading.main_thread()
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        frame = sys._current_frames().get(main.ident or 0)
        in_torch_distributed(frame.f_code.co_filename if frame is not None else "")
    sample_us = (time.perf_counter() - t0) / n * 1e6
    window = WaitWindow(1.0)
    counters = (("0", 10, 10),)
    t0 = time.perf_counter()
    for i in range(n):
        window.tick((i, i // 3), counters)
    tick_us = (time.perf_counter() - t0) / n * 1e6
    rng = random.Random(1)

    def judge_ms(ranks: int, times: int) -> float:
        profiles = {r: Profile(tuple(rng.randrange(250, 350) for _ in range(SLOTS)), 200, "h",
                               tuple(range(SLOTS))) for r in range(ranks)}
        t = time.perf_counter()
        for _ in range(times):
            find(profiles, {}, 0)
        return (time.perf_counter() - t) / times * 1000

    read_ms = _read_heartbeats_ms(8)
    thread_share = _sampler_share(5.0)
    fr_ms, add_ms, late_ms = _enqueue_ms()
    return [
        ["one sample's work (a frame lookup and a name test)", f"{sample_us:.1f} µs", ""],
        ["the sampler thread, 20 samples a second (its CPU time: wake-ups included)",
         f"{thread_share * 1e6 / 20:.1f} µs a sample", f"{100 * thread_share:.3f} % of a core"],
        ["slot bookkeeping, per heartbeat (every rank)", f"{tick_us:.2f} µs", ""],
        ["judge's slot: read 8 heartbeats (lowest local rank, once a slot)", f"{read_ms:.2f} ms", ""],
        ["judge's slot: the rule over 8 ranks", f"{judge_ms(8, 200):.2f} ms", ""],
        ["judge's slot: the rule over 1024 ranks (host 0 of a large job)", f"{judge_ms(1024, 5):.1f} ms", ""],
        ["enqueue measure: read a full flight recorder (2000 entries; GIL held), every 2 slots",
         f"{fr_ms:.1f} ms", f"{fr_ms / 10_000 * 100:.2f} % of 10 s"],
        ["enqueue measure: the read's entries into slots' rows", f"{add_ms:.2f} ms", ""],
        ["enqueue measure: judge's slot, 8 ranks' rows (12 slots of 24)", f"{late_ms:.2f} ms", ""],
    ]


def enqueue_cost(pairs: int, block_s: float) -> List[List[str]]:
    """In one process (a one-rank gloo group, its recorder's ring full): blocks of DDP steps
    with a thread reading the flight recorder once a second (ten times the real rate: the
    effect is measurable) and without, in random order. What the training thread pays per
    read, and so at the real rate (one read every 10 s at the default heartbeat)."""
    import threading

    import torch
    import torch.distributed as dist

    from peerwatch.hangs.collectives import CollectiveReader
    from peerwatch.hangs.waits import EnqueueWindow

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    reading, stop = threading.Event(), threading.Event()
    reads = [0]

    def reader_thread() -> None:
        reader, window = CollectiveReader(0), EnqueueWindow(1.0)
        while not stop.is_set():
            reading.wait()
            if stop.is_set():
                return
            window.add(reader.enqueued(), time.time_ns())
            reads[0] += 1
            stop.wait(1.0)

    try:
        for _ in range(2100):  # the ring full: the costliest read
            step()
        t0 = time.perf_counter()
        for _ in range(50):
            step()
        steps = max(50, int(block_s / ((time.perf_counter() - t0) / 50)))
        thread = threading.Thread(target=reader_thread, daemon=True)
        thread.start()
        res: Dict[bool, List[float]] = {False: [], True: []}
        on_s = 0.0
        for _ in range(pairs):
            for on in random.sample([False, True], 2):
                if on:
                    reading.set()
                w0 = time.perf_counter()
                for _ in range(steps):
                    step()
                took = time.perf_counter() - w0
                reading.clear()
                on_s += took if on else 0.0
                res[on].append(took * 1000 / steps)
                time.sleep(1.1)  # the reader's last read of an "on" block is over
        stop.set()
        reading.set()
        thread.join()
    finally:
        dist.destroy_process_group()
    d = [(b - a) / a * 100 for a, b in zip(res[False], res[True])]
    mean, half = statistics.mean(d), 1.97 * statistics.stdev(d) / len(d) ** 0.5
    rate = reads[0] / on_s  # reads a second while "on"
    return [["DDP step, one process, a full recorder read every second (10x the real rate)", f"{pairs} x {steps}",
             f"{statistics.mean(res[False]):.3f}", f"{statistics.mean(res[True]):.3f}",
             f"**{mean:+.2f} % ± {half:.2f} %**", f"at the real rate (1 read / 10 s): {mean / (10 * rate):+.3f} %"]]


def _enqueue_ms() -> Tuple[float, float, float]:
    """A full flight recorder read (a one-rank gloo group, 2100 all_reduces), its entries
    made into rows, and the lateness of 8 ranks' rows: median ms of each."""
    import torch
    import torch.distributed as dist

    from peerwatch.hangs.collectives import CollectiveReader
    from peerwatch.hangs.straggler import lateness, row_from_text
    from peerwatch.hangs.waits import EnqueueWindow

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        t = torch.ones(4)
        for _ in range(2100):
            dist.all_reduce(t)
        reader = CollectiveReader(0)
        reads, adds = [], []
        entries: list = []
        for _ in range(10):
            t0 = time.perf_counter()
            entries = reader.enqueued()
            reads.append((time.perf_counter() - t0) * 1000)
            window = EnqueueWindow(0.001)  # slots of 5 ms: the 2000 entries fill many
            t0 = time.perf_counter()
            window.add(entries, time.time_ns())
            adds.append((time.perf_counter() - t0) * 1000)
    finally:
        dist.destroy_process_group()
    rows = [row_from_text(r) for r in window.rows()]
    ranks = {r: [tuple(v if i != 3 else v + r for i, v in enumerate(row)) for row in rows if row] for r in range(8)}
    t0 = time.perf_counter()
    for _ in range(10):
        lateness(ranks)
    return statistics.median(reads), statistics.median(adds), (time.perf_counter() - t0) * 100


def _sampler_share(seconds: float) -> float:
    """The sampler thread's CPU time over ``seconds``, as a share of one core (schedstat: ns)."""
    from peerwatch.hangs.waits import WaitSampler

    sampler = WaitSampler(0)
    sampler.moving(True)
    sampler.start()
    try:
        time.sleep(0.5)
        tid = sampler._thread.native_id
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            before = int(f.read().split()[0])
        time.sleep(seconds)  # the main thread sleeps: the sampler's cost alone
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            after = int(f.read().split()[0])
    finally:
        sampler.stop()
    return (after - before) / 1e9 / seconds


def _read_heartbeats_ms(n: int) -> float:
    from peerwatch.core.records import Heartbeat, encode
    from peerwatch.rundir.rundir import HEARTBEATS, RunDir, rank_file

    with tempfile.TemporaryDirectory() as tmp:
        rd = RunDir(os.path.join(tmp, "run"))
        os.makedirs(rd.join(HEARTBEATS), mode=0o700)
        for r in range(n):
            beat = Heartbeat(rank=r, pid=1, time_ns=1, seq=1, waits=tuple((5000, 100, 30, 25, i) for i in range(12)))
            with open(rd.join(HEARTBEATS, rank_file("rank", r)), "wb") as f:
                f.write(encode(beat))
        t0 = time.perf_counter()
        for _ in range(50):
            for r in range(n):
                assert rd.read(HEARTBEATS, rank_file("rank", r), Heartbeat) is not None
        return (time.perf_counter() - t0) / 50 * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=["detect", "balanced", "cost", "reads", "enqueue-cost"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--hogs", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--block-s", type=float, default=3.0)
    parser.add_argument("--in-process", action="store_true", help="cost: the in-process A/B only (no jobs)")
    parser.add_argument("--in-jobs", action="store_true", help="cost: the jobs' A/B only (not in-process)")
    parser.add_argument("--cost-step", choices=["python", "ddp"], default="python")
    parser.add_argument("--ddp", action="store_true", help="detect: DDP steps (waits in C++: the enqueue measure)")
    args = parser.parse_args()
    print(f"peerwatch {peerwatch_commit()}, {machine()}, {datetime.datetime.now():%Y-%m-%d %H:%M}\n")
    if args.only in (None, "detect"):
        print("Detect: 4 ranks, default heartbeat; seconds from the first step to the finding\n")
        print(table(["job", "named after", "named"], detect(args.runs, args.ddp)), "\n", flush=True)
    if args.only in (None, "balanced"):
        rows = [watch(args.minutes, args.hogs, [], "balanced, 0.20 s a step"),
                watch(args.minutes, args.hogs, ["0=every:2/300@0"], "rank 0 sleeps 2 s every 300 steps")]
        print(f"No false finding: 4 ranks, {args.hogs} busy-looping processes beside them\n")
        print(table(["job", "watched", "hogs", "straggler lines", "named", "largest median gap seen"], rows), "\n",
              flush=True)
    if args.only in (None, "cost"):
        print("Cost: stragglers on vs off (both with peerwatch), blocks alternated in one run\n")
        rows = (sampler_cost(args.pairs * 10, 0.3) if not args.in_jobs else []) + \
            (cost(args.pairs, args.block_s, args.cost_step) if not args.in_process else [])
        print(table(["loop", "pairs x steps", "step ms off", "on", "wall difference (95 %)", "CPU difference"], rows), "\n",
              flush=True)
    if args.only in (None, "enqueue-cost"):
        print("Cost of the enqueue measure's reads (in-process, alternated)\n")
        print(table(["loop", "pairs x steps", "step ms off", "on", "wall difference (95 %)", "scaled"],
                    enqueue_cost(args.pairs, 2.0)), "\n", flush=True)
    if args.only in (None, "reads"):
        print("Reads (in-process, this machine)\n")
        print(table(["what", "cost", "share"], reads()))


if __name__ == "__main__":
    main()
