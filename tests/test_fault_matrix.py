"""The fault matrix: {launch style} x {victim} x {how it fails} x {what the survivors are doing}.

For every cell, a 3-rank job of ``rank_program.py`` where one rank (the victim) fails and
the two others (the survivors) are busy in one way; then:

- every process of the job (ranks, and the survivors' DataLoader workers) is gone within
  ``BOUND_S`` of the failure;
- every rank's exit code is right: the victim's own, and the survivors' the one of the
  exit code table in docs/how-it-works.md (which depends on who can know how the victim
  ended: only its parent, Lightning-style rank 0, reads an exit status; faulthandler's
  last words name a segfault to everyone);
- report.json names the victim, the cause and the exit code; every survivor is
  ``torn_down`` with that code and acknowledged the verdict (it left by itself);
- nothing is left in the process table (``no_leaks``; and no unreaped child of the test);
- a decoy process of the same user, started once for the module outside any job, is never
  signalled (it records every catchable signal it gets; SIGKILL shows as its death).

Dimensions:

- style: ``lightning`` (the test starts rank 0, which starts ranks 1 and 2: their parent
  learns how they end) and ``sibling`` (the test starts every rank);
- victim: rank 0, 1 (middle) or 2 (last);
- how: ``sigkill`` (the test sends SIGKILL), ``segv`` (a real segfault), ``exception``
  (uncaught RuntimeError), ``exit`` (``sys.exit(3)``), ``os_exit`` (``os._exit(5)``);
- survivors: ``sleep`` (sleeping in Python), ``gloo`` (blocked in a gloo all_reduce that
  the victim never joins; the victim is in the process group), ``ignore_term`` (SIGTERM
  ignored), ``dataloader`` (iterating over a torch DataLoader, num_workers=2, fork start
  method: two worker children each).

The full matrix (120 cells) runs with ``PEERWATCH_FULL_MATRIX=1``: 5 to 8 minutes on 2
cores shared with other work. By default, the 20 cells of ``DEFAULT_CELLS`` (about a
minute): every value of every dimension, and every pair of (style, how) and of (how,
survivors), at least once.

The false-positive check (clean runs, zero teardowns) is in test_false_positives.py.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List, NamedTuple, Optional, Tuple

import psutil
import pytest
from fault_behaviours import KEEP_CHILDREN_VAR
from harness import Job, by_rank, wait_read

WORLD = 3
GRACE_S = 1.0  # PEERWATCH_GRACE of every job here
# PEERWATCH_ACK_WINDOW of every job here: three times the default (0.5 s). A survivor that
# does not acknowledge the verdict within it is SIGTERMed (exit code 143, and the test
# fails); on 2 cores shared with another benchmark (load average above 40), a survivor
# blocked in gloo once missed the default window: its watcher thread needs the GIL and a
# CPU.
ACK_S = 1.5
FAIL_AFTER_S = 0.3  # a behaviour's failure comes this long after every rank is ready
# Failure -> every process of the job gone. Every survivor leaves by itself (its exit
# code proves it acknowledged within the ack window); a survivor with DataLoader workers
# first ends them (SIGTERM, they die at once). Typically 0.1-0.5 s; the bound is the
# ack window (a survivor may acknowledge at its very end) plus one second to leave.
BOUND_S = ACK_S + 1.0
TIMES_VAR = "PEERWATCH_MATRIX_TIMES"  # if set: a file to append "cell-id seconds" lines to
READY_TIMEOUT_S = 90.0  # three interpreters importing torch on 2 loaded cores
EXIT_N = 3  # sys.exit(EXIT_N)
OS_EXIT_N = 5  # os._exit(OS_EXIT_N)

STYLES = ("lightning", "sibling")
VICTIMS = (0, 1, 2)
HOWS = ("sigkill", "segv", "exception", "exit", "os_exit")
SURVIVORS = ("sleep", "gloo", "ignore_term", "dataloader")


class Cell(NamedTuple):
    style: str
    victim: int
    how: str
    survivors: str

    @property
    def id(self) -> str:
        return f"{self.style}-victim{self.victim}-{self.how}-{self.survivors}"


# Every (how, survivors) pair once (20 cells); styles alternate so that every (style, how)
# pair is there too, and victims rotate. Exit code paths covered: a parent that knows
# (lightning, victim 1 or 2) and nobody who knows (sibling, or lightning rank 0) for both
# SIGKILL and os._exit; segfault named by the parent and by faulthandler's last words.
DEFAULT_CELLS = [
    Cell("lightning", 1, "sigkill", "sleep"),
    Cell("sibling", 2, "sigkill", "gloo"),
    Cell("lightning", 0, "sigkill", "ignore_term"),
    Cell("sibling", 1, "sigkill", "dataloader"),
    Cell("sibling", 0, "segv", "sleep"),
    Cell("lightning", 2, "segv", "gloo"),
    Cell("sibling", 1, "segv", "ignore_term"),
    Cell("lightning", 0, "segv", "dataloader"),
    Cell("lightning", 2, "exception", "sleep"),
    Cell("sibling", 0, "exception", "gloo"),
    Cell("lightning", 1, "exception", "ignore_term"),
    Cell("sibling", 2, "exception", "dataloader"),
    Cell("sibling", 1, "exit", "sleep"),
    Cell("lightning", 0, "exit", "gloo"),
    Cell("sibling", 2, "exit", "ignore_term"),
    Cell("lightning", 1, "exit", "dataloader"),
    Cell("lightning", 0, "os_exit", "sleep"),
    Cell("sibling", 1, "os_exit", "gloo"),
    Cell("lightning", 2, "os_exit", "ignore_term"),
    Cell("sibling", 0, "os_exit", "dataloader"),
]
FULL = os.environ.get("PEERWATCH_FULL_MATRIX", "") == "1"
CELLS = [Cell(*c) for c in itertools.product(STYLES, VICTIMS, HOWS, SURVIVORS)] if FULL else DEFAULT_CELLS


def test_default_cells_cover_the_matrix() -> None:
    cells = DEFAULT_CELLS
    assert len(set(cells)) == len(cells)
    for values, field in ((STYLES, "style"), (VICTIMS, "victim"), (HOWS, "how"), (SURVIVORS, "survivors")):
        assert {getattr(c, field) for c in cells} == set(values), field
    assert {(c.style, c.how) for c in cells} == set(itertools.product(STYLES, HOWS))
    assert {(c.how, c.survivors) for c in cells} == set(itertools.product(HOWS, SURVIVORS))


# -- the decoy -------------------------------------------------------------------------------

DECOY_PROGRAM = r"""
import signal, sys, time
log = sys.argv[1]
def record(signum, frame):
    with open(log, "a") as f:
        f.write(f"{signum}\n")
for s in signal.valid_signals():
    if s in (signal.SIGKILL, signal.SIGSTOP):
        continue
    try:
        signal.signal(s, record)
    except (OSError, ValueError, RuntimeError):
        pass
open(log + ".ready", "w").close()
while True:
    time.sleep(3600)
"""


class Decoy:
    """A plain sleeping python of the same user, outside any job (no PEERWATCH_* nor test
    id in its environment), in the test's own session and process group. It records every
    catchable signal it receives (peerwatch's real-time signals included)."""

    def __init__(self, folder: Path) -> None:
        self.log = folder / "decoy-signals.txt"
        env = {k: v for k, v in os.environ.items() if not k.startswith("PEERWATCH_")}
        self.proc = subprocess.Popen([sys.executable, "-c", DECOY_PROGRAM, str(self.log)], env=env,
                                     stdin=subprocess.DEVNULL)
        wait_read(Path(str(self.log) + ".ready"), str, within=30, writer=self.proc)  # empty: being there says it

    def signals(self) -> List[str]:
        try:
            return [signal.Signals(int(s)).name if int(s) in signal.Signals._value2member_map_ else s
                    for s in self.log.read_text().split()]
        except FileNotFoundError:
            return []

    def check(self) -> None:
        assert self.proc.poll() is None, f"the decoy died: returncode {self.proc.returncode}"
        assert not self.signals(), f"the decoy was signalled: {self.signals()}"

    def end(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def decoy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Decoy]:
    d = Decoy(tmp_path_factory.mktemp("decoy"))
    try:
        yield d
        d.check()  # after the whole module: it survived every cell, never signalled
    finally:
        d.end()


# -- one cell ------------------------------------------------------------------------------


class Expected(NamedTuple):
    cause: str
    signal: Optional[str]
    code: int  # every survivor's exit code, and the verdict's
    victim_returncode: int  # subprocess style: -N for signal N


def expected(cell: Cell) -> Expected:
    """docs/how-it-works.md's exit code table: who can know how the victim ended."""
    parent_knows = cell.style == "lightning" and cell.victim != 0  # rank 0 is its parent
    if cell.how == "sigkill":
        return Expected("signal", "SIGKILL", 137, -9) if parent_knows else Expected("vanished", None, 1, -9)
    if cell.how == "segv":  # the parent, or faulthandler's "Fatal Python error: Segmentation fault"
        return Expected("signal", "SIGSEGV", 139, -11)
    if cell.how == "exception":
        return Expected("exception", None, 1, 1)
    if cell.how == "exit":
        return Expected("exit", None, EXIT_N, EXIT_N)
    assert cell.how == "os_exit"
    return Expected("exit", None, OS_EXIT_N, OS_EXIT_N) if parent_knows else Expected("vanished", None, 1, OS_EXIT_N)


def behaviours(cell: Cell) -> List[str]:
    failing = {
        "sigkill": "sleep", "segv": f"segv@{FAIL_AFTER_S}", "exception": f"raise@{FAIL_AFTER_S}",
        "exit": f"exit:{EXIT_N}@{FAIL_AFTER_S}", "os_exit": f"os_exit:{OS_EXIT_N}@{FAIL_AFTER_S}",
    }[cell.how]
    if cell.survivors == "gloo":
        failing = "pg+" + failing  # in the group, never in the all_reduce
    return [f"{r}={failing if r == cell.victim else cell.survivors}" for r in range(WORLD)]


def unreaped_children(exclude: Tuple[int, ...]) -> List[str]:
    """Children of the test process (zombies included) other than ``exclude``."""
    found = []
    for child in psutil.Process().children():
        if child.pid in exclude:
            continue
        try:
            found.append(f"pid {child.pid} ({child.status()}): {' '.join(child.cmdline())[:120]}")
        except psutil.Error:
            found.append(f"pid {child.pid}")
    return found


def run_cell(job: Job, cell: Cell) -> Dict[str, object]:
    """Start the job, make the victim fail, wait until every process is gone; check it all.
    Returns what was measured."""
    torch_used = cell.survivors in ("gloo", "dataloader")
    if torch_used:
        pytest.importorskip("torch")
    job.start()
    job.wait_ready(timeout=READY_TIMEOUT_S if torch_used else 30.0)
    survivors = [r for r in range(WORLD) if r != cell.victim]
    if cell.survivors == "gloo":
        job.wait_noted([f"collective-{r}" for r in survivors], timeout=30.0)
    if cell.survivors == "dataloader":
        assert len(job.others) >= 2 * len(survivors), f"DataLoader workers missing: {[p.label for p in job.others.values()]}"
    failed_ns: Optional[int] = None
    if cell.how == "sigkill":
        failed_ns = time.time_ns()
        job.kill(cell.victim)
    job.wait_gone(within=FAIL_AFTER_S + ACK_S + 3 * GRACE_S + 5.0)  # the hard stop; the bound is below

    exp = expected(cell)
    codes = job.all_returncodes()
    want = {r: (exp.victim_returncode if r == cell.victim else exp.code) for r in range(WORLD)}
    assert codes == want, f"returncodes {codes}, expected {want}\n{job.logs()}"

    report = job.report()
    v = report["verdict"]
    assert report["outcome"] == "failed", report
    assert (v["rank"], v["cause"], v["signal"], v["exit_code"]) == (cell.victim, exp.cause, exp.signal, exp.code), v
    assert v["pid"] == job.pids[cell.victim], v
    if cell.how == "exception":
        assert v["exception"] == "RuntimeError" and v["message"] == f"rank {cell.victim} failed on purpose", v
    ranks = by_rank(report)
    assert ranks[cell.victim]["state"] == "failed", ranks[cell.victim]
    for r in survivors:
        assert (ranks[r]["state"], ranks[r]["exit_code"], ranks[r]["acked_verdict"]) == ("torn_down", exp.code, True), ranks[r]

    if failed_ns is None:
        failed_ns = v["failed_at_ns"]
    assert job.gone_at_ns is not None
    took = (job.gone_at_ns - failed_ns) / 1e9
    assert took < BOUND_S, f"every process of the job gone {took:.2f}s after the failure (bound {BOUND_S}s)\n{job.logs()}"
    return {"took": took}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("cell", CELLS, ids=[c.id for c in CELLS])
def test_cell(make_job, decoy: Decoy, cell: Cell) -> None:
    job = make_job(world=WORLD, style=cell.style, behave=behaviours(cell), grace=GRACE_S, gloo=cell.survivors == "gloo",
                   env={KEEP_CHILDREN_VAR: "1", "PEERWATCH_ACK_WINDOW": str(ACK_S)})
    try:
        took = run_cell(job, cell)["took"]
        if os.environ.get(TIMES_VAR):
            with open(os.environ[TIMES_VAR], "a") as f:
                f.write(f"{cell.id} {took:.3f}\n")
    finally:
        job.close()  # reaps what it can: orphans we inherited included
    assert not unreaped_children(exclude=(decoy.proc.pid,)), unreaped_children(exclude=(decoy.proc.pid,))
    decoy.check()


# -- the victim's own DataLoader workers ------------------------------------------------------


def _heartbeat_children(job: Job, rank: int) -> List[List[int]]:
    try:
        beat = json.loads((job.run_dir / "heartbeats" / f"rank-{rank:05d}.json").read_text())
    except (OSError, ValueError):
        return []
    return list(beat.get("children", []))


def _kill_victim_with_workers(job: Job) -> float:
    """SIGKILL rank 1 (which iterates a DataLoader); returns the seconds until every process
    of the job, its two workers included, is gone. Survivors leave with 1 (vanished)."""
    killed_ns = time.time_ns()
    job.kill(1)
    job.wait_gone(within=ACK_S + 3 * GRACE_S + 10.0)  # torch's own worker watchdog: 5 s
    codes = job.all_returncodes()
    assert codes == {0: 1, 1: -9, 2: 1}, f"returncodes {codes}\n{job.logs()}"
    assert job.report()["verdict"]["rank"] == 1
    return (job.gone_at_ns - killed_ns) / 1e9  # type: ignore[operator]


@pytest.mark.timeout(120)
def test_victims_dataloader_workers_listed_in_its_heartbeat_are_torn_down(make_job, decoy: Decoy) -> None:
    """The killed rank's DataLoader workers outlive it (orphans); once its heartbeat lists
    them (children are snapshotted every 10 heartbeats: 1 s here), its peers end them."""
    pytest.importorskip("torch")
    job = make_job(world=WORLD, behave=["1=dataloader"], grace=GRACE_S,
                   env={"PEERWATCH_HEARTBEAT": "0.1", "PEERWATCH_ACK_WINDOW": str(ACK_S)})
    job.start()
    pids = job.wait_ready(timeout=READY_TIMEOUT_S)
    workers = [p.pid for p in job.others.values()]
    assert len(workers) == 2, [p.label for p in job.others.values()]
    deadline = time.monotonic() + 10.0
    while {pid for pid, _ in _heartbeat_children(job, 1)} != set(workers):
        assert time.monotonic() < deadline, f"rank 1 ({pids[1]}) never listed its workers {workers}"
        time.sleep(0.05)
    took = _kill_victim_with_workers(job)
    assert took < BOUND_S, f"every process gone {took:.2f}s after the kill (bound {BOUND_S}s)\n{job.logs()}"
    decoy.check()


@pytest.mark.timeout(120)
def test_victims_dataloader_workers_are_torn_down_right_after_they_start(make_job, decoy: Decoy) -> None:
    """Killed right after its DataLoader started (long before the 10-heartbeat snapshot of
    its children): the fork itself made the rank list its workers (an at-fork hook wakes
    the watcher), so its peers end them, not torch's own 5 s worker watchdog."""
    pytest.importorskip("torch")
    job = make_job(world=WORLD, behave=["1=dataloader"], grace=GRACE_S, env={"PEERWATCH_ACK_WINDOW": str(ACK_S)})
    job.start()
    job.wait_ready(timeout=READY_TIMEOUT_S)
    assert len(job.others) == 2, [p.label for p in job.others.values()]
    took = _kill_victim_with_workers(job)
    decoy.check()
    assert took < BOUND_S, f"every process gone {took:.2f}s after the kill (bound {BOUND_S}s)\n{job.logs()}"


def test_the_decoy_survived_the_whole_module(decoy: Decoy) -> None:
    """Last in the module (and checked again as the module ends): the decoy is alive and
    was never signalled. A test of its own, so that a failure here is never taken for the
    expected failure of an xfail test before it."""
    decoy.check()
