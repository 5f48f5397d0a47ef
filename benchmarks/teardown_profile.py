"""Where a teardown's CPU goes: per rank, from the moment it learns of the death to its exit.

    .venv/bin/python benchmarks/teardown_profile.py --ranks 32 --trials 3 [--cprofile 25] [--lib PATH]

Runs :func:`teardown_latency.trial` (Lightning-style ranks sleeping in Python, one SIGKILLed;
``--style sibling``: every rank started by the benchmark)
with a ``sitecustomize`` on the ranks' path that notes each rank's CPU time (``process_time``)
from the moment it takes a peer for gone (or its verdict, whichever is first) and from
``Watcher._act`` to ``leave.flush_and_exit``. On 2 cores the teardown's length is the sum
of that CPU over the ranks, divided by two, plus the interpreters' exits. ``--cprofile K``
also profiles those spans (``time.thread_time``, the watcher thread) and prints the K
heaviest functions of rank 0 (the report's writer) and of the other ranks together; the
profiler slows pure Python several times, so read its figures as shares, not times.
``--lib`` points the ranks at another checkout's ``peerwatch``, for a before and after.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import teardown_latency  # noqa: E402

# Runs in every rank (and in this process, where PWPROF_DIR is unset: it does nothing).
_SITECUSTOMIZE = '''
import os
if os.environ.get("PWPROF_DIR"):
    import cProfile, json, sys, time
    import peerwatch.verdict.leave as leave, peerwatch.peers as peers, peerwatch.watcher as watcher
    _state = {}

    def _threads():
        # CPU (ns, from the scheduler) per thread name: which threads a teardown pays for.
        import threading
        names = {t.native_id: t.name for t in threading.enumerate()}
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open("/proc/self/task/%s/schedstat" % tid) as f:
                    ns = int(f.read().split()[0])
            except (OSError, ValueError):
                continue
            name = names.get(int(tid), "other")
            name = name.split("-rank")[0]
            out[name] = out.get(name, 0) + ns
        return out

    def _begin(where):
        if "p0" in _state:
            return
        _state.update(p0=time.process_time_ns(), where=where, threads0=_threads())
        if os.environ.get("PWPROF_CPROF"):
            _state["prof"] = cProfile.Profile(time.thread_time)
            _state["prof"].enable()

    _peer_gone = peers.LocalPeers._gone
    def peer_gone(self, rank):
        _begin("peer gone")
        return _peer_gone(self, rank)

    _act = watcher.Watcher._act
    def act(self, verdict):
        _state.update(rank=self.rank, a0=time.process_time_ns())
        _begin("verdict")
        return _act(self, verdict)

    _flush_and_exit = leave.flush_and_exit
    def flush_and_exit(code):
        prof, now = _state.get("prof"), time.process_time_ns()
        if prof is not None:
            prof.disable()
        if "p0" in _state:
            out = os.path.join(os.environ["PWPROF_DIR"], "r%d" % os.getpid())
            t0, t1 = _state["threads0"], _threads()
            threads = {k: (v - t0.get(k, 0)) / 1e6 for k, v in t1.items()}
            threads["(threads that ended meanwhile)"] = (now - _state["p0"]) / 1e6 - sum(threads.values())
            with open(out + ".json", "w") as f:
                json.dump({"rank": _state.get("rank"), "from_death_ms": (now - _state["p0"]) / 1e6,
                           "in_act_ms": (now - _state.get("a0", now)) / 1e6, "threads_ms": threads}, f)
            if prof is not None:
                prof.dump_stats(out + ".prof")
        return _flush_and_exit(code)

    peers.LocalPeers._gone = peer_gone
    watcher.Watcher._act = act
    leave.flush_and_exit = flush_and_exit
'''


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=32)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--cprofile", type=int, default=0, metavar="K", help="print the K heaviest functions")
    p.add_argument("--style", choices=["lightning", "sibling"], default="lightning")
    p.add_argument("--lib", default=os.path.join(HERE, ".."), help="the checkout whose peerwatch the ranks import")
    args = p.parse_args()
    site = tempfile.mkdtemp(prefix="pw-teardown-profile-")
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(_SITECUSTOMIZE)
    os.environ["PYTHONPATH"] = os.pathsep.join([site, os.path.abspath(args.lib)])
    if args.cprofile:
        os.environ["PWPROF_CPROF"] = "1"
    print("| trial | N | all gone ms | ranks' CPU from the death, ms (sum) | of it in _act | rank 0 | other ranks, median |")
    print("|---|---|---|---|---|---|---|")
    outs = []
    for i in range(args.trials):
        out = os.environ["PWPROF_DIR"] = tempfile.mkdtemp(prefix="pw-teardown-profile-")
        outs.append(out)
        _, gone_ms, _ = teardown_latency.trial(args.ranks, args.style, args.ranks // 2, tempfile.mkdtemp())
        recs = [json.load(open(path)) for path in glob.glob(os.path.join(out, "*.json"))]
        rank0 = [r["from_death_ms"] for r in recs if r["rank"] == 0]
        others = [r["from_death_ms"] for r in recs if r["rank"] != 0]
        print(f"| {i} | {args.ranks} | {gone_ms:.1f} | {sum(r['from_death_ms'] for r in recs):.1f} "
              f"| {sum(r['in_act_ms'] for r in recs):.1f} | {rank0[0] if rank0 else float('nan'):.1f} "
              f"| {statistics.median(others):.2f} |", flush=True)
    _print_threads(outs)
    if args.cprofile:
        _print_profiles(outs, args.cprofile)


def _print_threads(outs: list) -> None:
    """The ranks' CPU from the death to the exit, by thread (summed over every rank and trial)."""
    total: dict = {}
    for out in outs:
        for path in glob.glob(os.path.join(out, "*.json")):
            with open(path) as f:
                for name, ms in json.load(f).get("threads_ms", {}).items():
                    total[name] = total.get(name, 0.0) + ms
    print("\n| thread (every rank, every trial) | CPU ms |\n|---|---|")
    for name, ms in sorted(total.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {ms:.1f} |")


def _print_profiles(outs: list, top: int) -> None:
    import pstats

    rank0, others = [], []
    for out in outs:
        for path in glob.glob(os.path.join(out, "*.json")):
            with open(path) as f:
                (rank0 if json.load(f)["rank"] == 0 else others).append(path[: -len(".json")] + ".prof")
    for title, files in (("rank 0 (writes the report)", rank0), ("the other ranks, together", others)):
        files = [f for f in files if os.path.exists(f)]
        if files:
            print(f"\n## {title}")
            pstats.Stats(*files).sort_stats("tottime").print_stats(top)


if __name__ == "__main__":
    main()
