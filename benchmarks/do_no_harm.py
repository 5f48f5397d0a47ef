"""First, do no harm: healthy jobs under the conditions that made peerwatch harm them, counted.

    .venv/bin/python benchmarks/do_no_harm.py                      # every scenario, 1 trial each
    .venv/bin/python benchmarks/do_no_harm.py --trials 3 --burners 8
    .venv/bin/python benchmarks/do_no_harm.py --only busy:cdist,suspend

Every job here is healthy: each rank ends with status 0 unless peerwatch ends it. A trial
is a **false teardown** if any rank exited non-zero or a verdict was written, and a
**crash** if a rank died of a signal peerwatch did not send (SIGSEGV, SIGABRT: an abort in
the interpreter). Both counts must be 0. The scenarios:

- ``fd-limit`` / ``fd-limit-poll``: 16 sibling ranks (no torch) under ``RLIMIT_NOFILE`` 64,
  idle for 8 s, then exit 0 (with pidfds, and polling: ``PEERWATCH_PIDFD=0``);
- ``fd-starve`` / ``fd-starve-poll``: 3 ranks, each takes every free descriptor for 2 s;
- ``suspend``: 3 gloo ranks in an all_reduce loop, every rank SIGSTOPped for 20 s, then
  SIGCONT to rank 0 and, 1 s later, to the others (a scheduler's suspend and resume);
- ``quota``: 3 gloo ranks, each stopped and continued on its own 100 ms period, running
  30 % of it (a CPU quota's throttling, which a container without cgroup access cannot set);
- ``busy:KIND``: 2 gloo ranks; rank 0 alone works ``--busy-seconds`` (default 40) in one
  way (``benchmarks/_harm_rank.py``: one torch op, an nn.Linear loop, pure Python, one
  GIL-free C call, a trickle read, a computing child, a checkpoint, GC) while rank 1 waits
  in all_reduce; ``OMP_NUM_THREADS=1`` as under torchrun;
- ``load``: 4 idle ranks beside 8 extra busy loops;
- ``hosts``: 12 one-rank simulated hosts (root: own PID and UTS namespace and run
  directory each, ``tests/multihost_program.py``), one TCPStore, each ``install()`` then
  ``import torch.distributed``, started at once, finishing together (root only).

Every gloo job runs with ``PEERWATCH_HANG_TIMEOUT=auto`` and ``PEERWATCH_HANG_WARN=5``
(the hang judge on, at a short threshold, so that a wrong judgement shows within the
trial). ``--burners`` busy loops (default 4) run beside every scenario. Prints a markdown
table; exit status 0 if both counts are 0 everywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Dict, List, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import ROOT, become_subreaper, clean_env, free_port, load1, table  # noqa: E402

RANK = HERE / "_harm_rank.py"
HOST = ROOT / "tests" / "multihost_program.py"
BURNER = "while True: pass"
START_S = 120.0  # ranks importing torch on 2 busy cores
HANG_ENV = {"PEERWATCH_HANG_TIMEOUT": "auto", "PEERWATCH_HANG_WARN": "5"}
BUSY_KINDS = ("cdist", "linear", "pyloop", "ccall", "trickle", "children", "checkpoint", "gc")


@dataclasses.dataclass
class Trial:
    scenario: str
    codes: Dict[int, Optional[int]] = dataclasses.field(default_factory=dict)
    verdict: str = ""
    seconds: float = 0.0
    logs: str = ""

    @property
    def false_teardown(self) -> bool:
        return bool(self.verdict) or any(c != 0 for c in self.codes.values())

    @property
    def crash(self) -> bool:
        return any(c is not None and c in (-signal.SIGSEGV, -signal.SIGABRT, -signal.SIGBUS) for c in self.codes.values())


class Job:
    """W sibling ranks of ``_harm_rank.py`` sharing one run directory."""

    def __init__(self, tmp: Path, world: int, behaviour: str, seconds: float, env: Dict[str, str],
                 nofile: int = 0) -> None:
        self.tmp, self.world = tmp, world
        self.ready, self.run_dir = tmp / "ready", tmp / "run"
        self.ready.mkdir()
        port = free_port()
        base = {k: v for k, v in clean_env().items() if not k.startswith("PEERWATCH_")}
        base.update(PYTHONPATH=str(ROOT), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PEERWATCH_DIR=str(self.run_dir),
                    HARM_SCRATCH=str(tmp), **env)
        limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))) if nofile else None
        self.procs: List[subprocess.Popen] = []
        for rank in range(world):
            with open(tmp / f"log-{rank}", "wb") as log:
                self.procs.append(subprocess.Popen(
                    [sys.executable, str(RANK), str(self.ready), behaviour, str(seconds)],
                    env=dict(base, RANK=str(rank), LOCAL_RANK=str(rank)), stdin=subprocess.DEVNULL,
                    stdout=log, stderr=subprocess.STDOUT, preexec_fn=limit))

    def wait_ready(self, names: List[str]) -> None:
        deadline = time.monotonic() + START_S
        while not all((self.ready / n).exists() for n in names):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                return  # judged by the outcome: a rank that ended early shows in its code
            time.sleep(0.05)

    def finish(self, trial: Trial, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for rank, p in enumerate(self.procs):
            try:
                trial.codes[rank] = p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                trial.codes[rank] = None
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        trial.verdict = _verdict(self.run_dir)
        trial.logs = _logs(self.tmp)


def _verdict(run_dir: Path) -> str:
    with contextlib.suppress(OSError, ValueError):
        v = json.loads((run_dir / "events" / "verdict.json").read_text())
        return f"{v.get('cause', '?')} (rank {v.get('rank', '?')})"
    return ""


def _logs(folder: Path) -> str:
    out = []
    for path in sorted(folder.rglob("log-*")):
        with contextlib.suppress(OSError):
            text = path.read_text(errors="replace")
            if text.strip():
                out.append(f"--- {path.relative_to(folder)} ---\n{text[-1500:]}")
    return "\n".join(out)


def _signal_trees(procs: List[subprocess.Popen], sig: int) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, sig)


def run_siblings(tmp: Path, name: str, world: int, behaviour: str, seconds: float, env: Dict[str, str],
                 nofile: int = 0, during: Optional[Callable[[Job], None]] = None) -> Trial:
    trial = Trial(name)
    start = time.monotonic()
    job = Job(tmp, world, behaviour, seconds, env, nofile)
    try:
        if during is not None:
            job.wait_ready([f"pg-{r}" for r in range(world)])
            during(job)
        job.finish(trial, timeout=seconds + 120.0)
    finally:
        for p in job.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    trial.seconds = time.monotonic() - start
    return trial


def suspend(job: Job) -> None:
    time.sleep(3.0)  # a few healthy steps first
    _signal_trees(job.procs, signal.SIGSTOP)
    time.sleep(20.0)
    _signal_trees(job.procs[:1], signal.SIGCONT)
    time.sleep(1.0)
    _signal_trees(job.procs[1:], signal.SIGCONT)


def quota(job: Job, seconds: float = 30.0, period: float = 0.1, share: float = 0.3) -> None:
    def throttle(p: subprocess.Popen, phase: float) -> None:
        time.sleep(phase)
        end = time.monotonic() + seconds
        with contextlib.suppress(ProcessLookupError):
            while time.monotonic() < end and p.poll() is None:
                os.kill(p.pid, signal.SIGSTOP)
                time.sleep(period * (1 - share))
                os.kill(p.pid, signal.SIGCONT)
                time.sleep(period * share)
            os.kill(p.pid, signal.SIGCONT)

    threads = [threading.Thread(target=throttle, args=(p, i * period / len(job.procs))) for i, p in enumerate(job.procs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run_hosts(tmp: Path, hosts: int = 12, seconds: float = 15.0) -> Trial:
    """``hosts`` one-rank hosts, each in its own PID + UTS namespace, one TCPStore."""
    trial = Trial("hosts")
    start = time.monotonic()
    port, run_id = free_port(), uuid.uuid4().hex[:12]
    base = {k: v for k, v in clean_env().items() if not k.startswith("PEERWATCH_")}
    base.update(PYTHONPATH=str(ROOT), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PEERWATCH_RUN_ID=run_id)
    store = subprocess.Popen([sys.executable, "-c", (
        "import datetime, time, torch.distributed as d\n"
        f"s = d.TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False,"
        " timeout=datetime.timedelta(seconds=60))\n"
        "time.sleep(3600)")], env=base, stdin=subprocess.DEVNULL)
    procs, dirs = [], []
    try:
        for h in range(hosts):
            d = tmp / f"host{h}"
            (d / "ready").mkdir(parents=True)
            dirs.append(d)
            env = dict(base, PEERWATCH_DIR=str(d / "run"), MULTIHOST_HOST=f"host{h}")
            argv = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--uts", sys.executable, str(HOST),
                    "host", "--name", f"host{h}", "--world", str(hosts), "--ranks", str(h), "--ready", str(d / "ready"),
                    "--behave", f"{h}=torch_succeed_on:../../go"]
            with open(d / "host.log", "wb") as log:
                procs.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline and not all((d / "ready" / f"torch-{h}").exists() for h, d in enumerate(dirs)):
            if all(p.poll() is not None for p in procs):
                break
            time.sleep(0.1)
        time.sleep(seconds)  # the bridges beat while the job "trains"
        (tmp / "go").write_text("")
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(60.0)
    finally:
        for p in [*procs, store]:
            if p.poll() is None:
                p.kill()
                p.wait()
    for h, d in enumerate(dirs):
        try:
            trial.codes[h] = int((d / "ready" / f"exit-{h}").read_text())
        except (OSError, ValueError):
            trial.codes[h] = None
        trial.verdict = trial.verdict or _verdict(d / "run")
    trial.logs = _logs(tmp)
    trial.seconds = time.monotonic() - start
    return trial


def scenarios(busy_s: float) -> Dict[str, Callable[[Path], Trial]]:
    poll = {"PEERWATCH_PIDFD": "0"}
    out: Dict[str, Callable[[Path], Trial]] = {
        "fd-limit": lambda t: run_siblings(t, "fd-limit", 16, "idle", 8.0, {}, nofile=64),
        "fd-limit-poll": lambda t: run_siblings(t, "fd-limit-poll", 16, "idle", 8.0, poll, nofile=64),
        "fd-starve": lambda t: run_siblings(t, "fd-starve", 3, "fdstarve", 6.0, {}),
        "fd-starve-poll": lambda t: run_siblings(t, "fd-starve-poll", 3, "fdstarve", 6.0, poll),
        "suspend": lambda t: run_siblings(t, "suspend", 3, "gloo", 35.0, HANG_ENV, during=suspend),
        "quota": lambda t: run_siblings(t, "quota", 3, "gloo", 35.0, HANG_ENV, during=quota),
        "load": lambda t: run_siblings(t, "load", 4, "idle", 10.0, {}, during=None),
    }
    for kind in BUSY_KINDS:
        out[f"busy:{kind}"] = (lambda k: lambda t: run_siblings(t, f"busy:{k}", 2, f"busy:{k}", busy_s, HANG_ENV))(kind)
    if os.geteuid() == 0 and shutil.which("unshare"):
        out["hosts"] = lambda t: run_hosts(t)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--burners", type=int, default=4)
    parser.add_argument("--busy-seconds", type=float, default=40.0)
    parser.add_argument("--only", default="", help="comma-separated scenario names")
    parser.add_argument("--logs", action="store_true", help="print the logs of every harmed trial")
    args = parser.parse_args()
    become_subreaper()
    table_of = scenarios(args.busy_seconds)
    chosen = [s for s in args.only.split(",") if s] or list(table_of)
    unknown = [s for s in chosen if s not in table_of]
    if unknown:
        parser.error(f"unknown scenarios {unknown}; known: {', '.join(table_of)}")
    rows, harmed = [], []
    for name in chosen:
        trials: List[Trial] = []
        extra = 8 if name == "load" else 0
        burners = [subprocess.Popen([sys.executable, "-c", BURNER]) for _ in range(args.burners + extra)]
        loads = []
        try:
            for _ in range(args.trials):
                with tempfile.TemporaryDirectory(prefix="pw-harm-") as tmp:
                    trials.append(table_of[name](Path(tmp)))
                    loads.append(load1())
        finally:
            for b in burners:
                b.kill()
                b.wait()
        bad = [t for t in trials if t.false_teardown]
        harmed += bad
        codes = sorted({str(c) for t in trials for c in t.codes.values()})
        rows.append([name, str(len(trials)), str(len(bad)), str(sum(t.crash for t in trials)), ", ".join(codes),
                     "; ".join(sorted({t.verdict for t in bad if t.verdict})) or "-",
                     f"{max(t.seconds for t in trials):.0f}", f"{max(loads):.1f}"])
        print(f"{name}: {len(bad)} of {len(trials)} harmed", file=sys.stderr, flush=True)
    print(table(["scenario", "trials", "false teardowns", "crashes", "exit codes seen", "verdicts", "max s", "load1"],
                rows))
    if args.logs:
        for t in harmed:
            print(f"\n## {t.scenario}: codes {t.codes} verdict {t.verdict or '-'}\n{t.logs}")
    return 1 if harmed else 0


if __name__ == "__main__":
    sys.exit(main())
