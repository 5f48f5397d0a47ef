"""Hangs across two simulated hosts: onset to diagnosis and verdict on each host, and to
every process of both hosts gone (root: ``unshare``, ``ip netns``).

    .venv/bin/python benchmarks/hang_hosts.py --runs 1
    .venv/bin/python benchmarks/hang_diagnosis.py --only hosts     (the same)

Two simulated hosts as in tests/test_multihost.py (a small copy of its start logic: each
host is ``tests/multihost_program.py host`` as PID 1 of its own PID + UTS namespaces, a run
directory each, both in one network namespace made here), one gloo group of 4 ranks (gloo
timeout 60 s), 2 per host; rank 0 serves the job's TCPStore, which the bridges share. After
step 30 both ranks of host B become laggards (``gloo:<case>_at=30``: a Python loop, a
deadlock, SIGSTOP, a checkpoint of 600 s), while host A's ranks wait in all_reduce #31.
``PEERWATCH_HANG_TIMEOUT=auto`` and nothing else of peerwatch's settings.

Times are from the onset (host B's first ``doing-<rank>`` marker, written right before the
behaviour) to each host's events/diagnosis.json ``time_ns``, to each host's
events/verdict.json ``detected_at_ns``, and to the last process of both hosts gone (seen
through a pidfd on every one). Every wait has a deadline; whatever happens, every process
started is SIGKILLed and reaped, and the network namespace deleted.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import (  # noqa: E402
    ROOT,
    Pidfds,
    become_subreaper,
    clean_env,
    free_port,
    load1,
    machine,
    peerwatch_commit,
    quantile,
    reap,
    table,
    tree,
)

PROGRAM = ROOT / "tests" / "multihost_program.py"
STEP = 500  # several seconds of steps: both hosts' bridges are connected before the onset
PER_HOST = 2
GLOO_TIMEOUT_S = 60.0  # multihost_program.py's gloo mode
START_S = 120.0  # 4 ranks and their torch imports on 2 shared cores
ONSET_S = 60.0  # connected -> host B's ranks at step 30
GONE_S = 2 * GLOO_TIMEOUT_S  # onset -> every process gone, or the run is cut off here
POLL_S = 0.05  # a deadline-bounded look at files: nothing to poll(2) on

CASES = [
    ("a Python loop (asleep)", "loop"),
    ("a deadlock (a lock it holds)", "lock"),
    ("frozen (SIGSTOP)", "stop"),
    ("busy: a checkpoint longer than the timeout", "checkpoint"),
]


@dataclasses.dataclass
class SimHost:
    name: str
    ranks: List[int]
    dir: Path
    popen: Optional[subprocess.Popen] = None

    @property
    def ready(self) -> Path:
        return self.dir / "ready"

    @property
    def run(self) -> Path:
        return self.dir / "run"

    def record(self, name: str) -> Dict:
        try:
            return dict(json.loads((self.run / "events" / name).read_text()))
        except (OSError, ValueError):
            return {}

    def connected(self, hosts: int) -> bool:
        try:
            state = json.loads((self.run / "bridge.json").read_text())
        except (OSError, ValueError):
            return False
        return (all((self.ready / f"rank-{r}").exists() for r in self.ranks)
                and state.get("connected") is True and len(state.get("hosts", {})) == hosts)

    def exit_codes(self) -> Dict[int, Optional[int]]:
        codes: Dict[int, Optional[int]] = {}
        for rank in self.ranks:
            try:
                codes[rank] = int((self.ready / f"exit-{rank}").read_text())
            except (OSError, ValueError):
                codes[rank] = None
        return codes

    def log_lines(self, needles: tuple = ("peerwatch", "Error:", "Traceback")) -> List[str]:
        """The key lines of its ranks' logs: peerwatch's, and the errors that ended them."""
        out = []
        for path in sorted(self.ready.glob("log-*")):
            with contextlib.suppress(OSError):
                for line in path.read_text(errors="replace").splitlines():
                    if any(line.startswith(n) for n in needles) or "Error: " in line:
                        out.append(f"{self.name} {path.name}: {line.strip()[:300]}")
        return out


def _wait(cond, timeout: float, what: str, hosts: List[SimHost]) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        for h in hosts:
            if h.popen is not None and h.popen.poll() is not None:
                raise RuntimeError(f"{h.name} ended ({h.popen.returncode}) before {what}")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"not {what} within {timeout:g} s")
        time.sleep(POLL_S)


def _env(**extra: str) -> Dict[str, str]:
    env = {k: v for k, v in clean_env().items() if not k.startswith("PEERWATCH_")}
    env.update(PYTHONPATH=str(ROOT), **extra)
    return env


def trial(case: str, workdir: Path) -> Dict:
    """One run of ``case``: its times (s from the onset) and what each host wrote."""
    tag = uuid.uuid4().hex[:8]
    netns = f"pwh-{tag}"
    hosts = [SimHost(f"host{n}", list(range(i * PER_HOST, (i + 1) * PER_HOST)), workdir / n)
             for i, n in enumerate("ab")]
    world = PER_HOST * len(hosts)
    held = Pidfds(())
    out: Dict = {"case": case, "gone_s": None, "left": [], "error": None}
    onset = 0
    try:
        # Every host in a network namespace made here: no packet leaves (torch's client asks
        # DNS for each peer address; without a route that fails at once).
        for step in (["ip", "netns", "add", netns], ["ip", "-n", netns, "link", "set", "lo", "up"]):
            subprocess.run(step, check=True, capture_output=True, timeout=10)
        base = _env(PEERWATCH_HANG_TIMEOUT="auto", PEERWATCH_RUN_ID=tag, MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(free_port()))
        behave = [f"{r}=gloo" for r in hosts[0].ranks] + [f"{r}=gloo:{case}_at={STEP}" for r in hosts[1].ranks]
        for h in hosts:
            h.ready.mkdir(parents=True)
            argv = [sys.executable, str(PROGRAM), "host", "--name", h.name, "--world", str(world),
                    "--ranks", ",".join(map(str, h.ranks)), "--ready", str(h.ready)]
            for item in behave:
                argv += ["--behave", item]
            cmd = ["ip", "netns", "exec", netns, "unshare", "--pid", "--fork", "--kill-child", "--mount-proc",
                   "--uts", *argv]
            with open(h.dir / "host.log", "wb") as log:
                h.popen = subprocess.Popen(cmd, env=dict(base, PEERWATCH_DIR=str(h.run), MULTIHOST_HOST=h.name),
                                           stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
            held.add(h.popen.pid)
        _wait(lambda: all(h.connected(len(hosts)) for h in hosts), START_S, "every host connected", hosts)
        b = hosts[1]
        if any((b.ready / f"doing-{r}").exists() for r in b.ranks):
            raise RuntimeError(f"host b's ranks reached step {STEP} before the hosts' bridges were seen connected")
        for h in hosts:
            assert h.popen is not None
            for pid in tree(h.popen.pid):
                held.add(pid)
        _wait(lambda: all((b.ready / f"doing-{r}").exists() for r in b.ranks), ONSET_S,
              f"host b's ranks at step {STEP}", hosts)
        onset = min((b.ready / f"doing-{r}").stat().st_mtime_ns for r in b.ranks)
        gone_ns = held.wait_all_gone(max(1.0, GONE_S - (time.time_ns() - onset) / 1e9))
        out["gone_s"] = None if gone_ns is None else (gone_ns - onset) / 1e9
        out["left"] = _living(hosts) if gone_ns is None else []
    except (RuntimeError, TimeoutError, subprocess.SubprocessError, OSError) as e:
        out["error"] = f"{type(e).__name__}: {e}"  # reported in the table, with the logs' key lines
    finally:
        held.kill_all()
        for h in hosts:
            if h.popen is not None:
                with contextlib.suppress(OSError):
                    h.popen.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    h.popen.wait(timeout=10)
        held.wait_all_gone(10.0)
        reap(held.fds)  # ranks of a namespace whose init died first are ours (subreaper)
        held.close()
        subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=10)
    for h in hosts:  # read after the end: the hosts' inits note exit codes as they reap
        diag, verdict = h.record("diagnosis.json"), h.record("verdict.json")
        out[h.name] = {
            "diagnosis_s": (diag["time_ns"] - onset) / 1e9 if onset and "time_ns" in diag else None,
            "verdict_s": (verdict["detected_at_ns"] - onset) / 1e9 if onset and "detected_at_ns" in verdict else None,
            "finding": diag.get("finding"), "detail": diag.get("detail"),
            "verdict": (verdict.get("rank"), verdict.get("host"), verdict.get("cause")) if verdict else None,
            "verdict_detail": verdict.get("detail"),
            "exits": h.exit_codes(), "log": h.log_lines(),
        }
    return out


def _living(hosts: List[SimHost]) -> List[str]:
    """What was still alive at the cut-off: host, rank (or init), state."""
    left = []
    for h in hosts:
        if h.popen is None:
            continue
        for pid in tree(h.popen.pid):
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                env = proc.environ()
                who = f"rank {env['MULTIHOST_RANK']}" if "MULTIHOST_RANK" in env else proc.name()
                left.append(f"{h.name} {who} ({proc.status()})")
    return left


def _s(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.1f} s"


def run(runs: int, workdir: Optional[str] = None) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        raise SystemExit("simulated hosts need root (unshare --pid --uts, ip netns) and util-linux's unshare")
    become_subreaper()
    rows, notes = [], []
    load_before = load1()
    for name, case in CASES:
        for i in range(runs):
            if workdir:  # kept, to read its logs
                r = trial(case, Path(tempfile.mkdtemp(prefix=f"{case}-{i}-", dir=workdir)))
            else:
                with tempfile.TemporaryDirectory() as tmp:
                    r = trial(case, Path(tmp))
            a, b = r["hosta"], r["hostb"]
            same = a["verdict"] == b["verdict"]
            verdict = _name(a["verdict"]) if same else f"a: {_name(a['verdict'])}; b: {_name(b['verdict'])}"
            exits = ", ".join(f"{rank}: {code}" for h in (a, b) for rank, code in h["exits"].items())
            if r["error"]:
                verdict += f" (run cut short: {r['error']})"
            rows.append([name, f"{a['finding']} / {b['finding']}", _s(a["diagnosis_s"]), _s(b["diagnosis_s"]),
                         _s(a["verdict_s"]), _s(b["verdict_s"]),
                         _s(r["gone_s"]) if r["gone_s"] is not None else ("-" if r["error"] else f"not by {GONE_S:g} s"), verdict, exits])
            notes.append((name, r))
    print(f"Two simulated hosts, 2 gloo ranks each; both ranks of host b from step {STEP}; hang_timeout=auto, "
          f"nothing else set; gloo timeout {GLOO_TIMEOUT_S:g} s; times from the onset; "
          f"load {load_before:.1f} before, {load1():.1f} after\n")
    print(table(["case", "finding (a / b)", "diagnosis a", "diagnosis b", "verdict a", "verdict b", "all gone",
                 "verdict names", "exit codes"], rows))
    print()
    if runs > 1:
        print(table(["case", "runs", "diagnosis a p50 / p90 / max", "diagnosis b p50 / p90 / max",
                     "verdict a p50 / p90 / max", "verdict b p50 / p90 / max", "all gone p50 / p90 / max"],
                    [[name, str(len(rs))] + [_spread([r[h][key] for r in rs]) for key in ("diagnosis_s", "verdict_s")
                                             for h in ("hosta", "hostb")] + [_spread([r["gone_s"] for r in rs])]
                     for name, rs in _by_case(notes)]))
        print()
    for name, r in notes:
        print(f"## {name}")
        for h in ("hosta", "hostb"):
            print(f"{h} diagnosis: {r[h]['detail']}")
            print(f"{h} verdict: {r[h]['verdict_detail']}")
        if r["left"]:
            print("alive at the cut-off:", ", ".join(r["left"]))
        for h in ("hosta", "hostb"):
            for line in r[h]["log"][-12:]:
                print("   ", line)
        print()


def _by_case(notes: List[tuple]) -> List[tuple]:
    cases: Dict[str, List[Dict]] = {}
    for name, r in notes:
        cases.setdefault(name, []).append(r)
    return list(cases.items())


def _spread(values: List[Optional[float]]) -> str:
    """p50 / p90 / max of the runs that have the figure (and how many lack it)."""
    seen = [v for v in values if v is not None]
    missing = f" ({len(values) - len(seen)} without)" if len(seen) < len(values) else ""
    if not seen:
        return "-" + missing
    return f"{quantile(seen, 0.5):.1f} / {quantile(seen, 0.9):.1f} / {max(seen):.1f} s{missing}"


def _name(v: Optional[tuple]) -> str:
    return f"rank {v[0]} on {v[1]} ({v[2]})" if v else "-"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--case", choices=[c for _, c in CASES], action="append")
    parser.add_argument("--workdir", help="keep each run's folders (logs, run directories) here")
    args = parser.parse_args()
    if args.case:
        CASES[:] = [c for c in CASES if c[1] in args.case]
    print(f"peerwatch {peerwatch_commit()}, {machine()}, {datetime.datetime.now():%Y-%m-%d %H:%M}\n")
    run(args.runs, args.workdir)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a killed benchmark still cleans up
    main()
