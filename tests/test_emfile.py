"""Out of file descriptors ("Too many open files", common with DataLoader workers): a look
that fails tells nothing. A peer that cannot be probed is "cannot tell", never "gone"; a
record that cannot be read is "not known", never "no success marker". Real processes under
a real RLIMIT_NOFILE, no mocks."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(90)

STARVE_S = 1.5  # how long the starving ranks hold every descriptor
STUCK_S = 20.0  # the job ends well within this (its ranks' own time, and python's start)

# Run in a child: lowers its own soft RLIMIT_NOFILE, takes every free descriptor, and says
# (as JSON) what probe() and friends answered about a live process (argv[1]) and a pid that
# is not there (argv[2]) while starved, then after giving the descriptors back.
_STARVED_PROBE = r"""
import errno, json, os, resource, sys
from peerwatch.proc import identity

live, dead = int(sys.argv[1]), int(sys.argv[2])
info = identity.probe(live)

def look(pid):
    try:
        got = identity.probe(pid)
        probed = "none" if got is None else "info"
    except identity.Unknown as e:
        probed = "unknown:" + errno.errorcode.get(e.errno, str(e.errno))
    return {"probe": probed, "same": identity.same_process(pid, info.start_ticks, info.uid),
            "is_same": identity.is_same_process(pid, info.start_ticks, info.uid)}

import psutil  # imported before the starvation: the fallback's import needs descriptors too
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 4, hard))
held = []
try:
    while True:
        held.append(os.dup(0))
except OSError as e:
    assert e.errno == errno.EMFILE, e
starved = {"live": look(live), "dead": look(dead)}
for fd in held:
    os.close(fd)
after = {"live": look(live), "dead": look(dead)}
print(json.dumps({"starved": starved, "after": after}))
"""


def test_probe_out_of_descriptors_cannot_tell(tmp_path: Path) -> None:
    """EMFILE while probing: probe() said "no such process" (None) of a live peer, and the
    psutil fallback did the same, so the peer was taken for dead. Now it raises Unknown;
    same_process() says None (cannot tell), is_same_process() still False (never signal
    what cannot be verified). A pid with no /proc entry is gone even then (a stat needs no
    descriptor). Once descriptors are back, the answers are as before."""
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        done = subprocess.run([sys.executable, "-c", _STARVED_PROBE, str(live.pid), str(dead.pid)],
                              capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    finally:
        assert live.stdin is not None
        live.stdin.close()
        live.wait(timeout=10)
    assert done.returncode == 0, done.stdout + done.stderr
    got = json.loads(done.stdout)
    assert got["starved"]["live"] == {"probe": "unknown:EMFILE", "same": None, "is_same": False}, got
    assert got["starved"]["dead"] == {"probe": "none", "same": False, "is_same": False}, got
    assert got["after"]["live"] == {"probe": "info", "same": True, "is_same": True}, got
    assert got["after"]["dead"] == {"probe": "none", "same": False, "is_same": False}, got


@pytest.mark.parametrize("pidfd", ["1", "0"], ids=["pidfd", "polling"])
def test_ranks_out_of_descriptors_while_a_peer_ends_well_end_well(make_job, pidfd: str) -> None:
    """Ranks 0 and 1 run out of descriptors for 1.5 s (EMFILE for their watchers too);
    meanwhile rank 2 finishes cleanly. Their watchers could neither probe rank 2 nor read
    its success marker: they took it for dead ("ended without a success marker") and the
    healthy job was torn down, with pidfds and with polling (PEERWATCH_PIDFD=0). Now what
    they cannot tell they look at again: every rank exits 0, and there is no verdict."""
    job = make_job(world=3, behave=[f"0=starve:{STARVE_S}", f"1=starve:{STARVE_S}", "2=await:starved-0,starved-1"],
                   env={"PEERWATCH_PIDFD": pidfd, "RANK_PROGRAM_RESERVE_FDS": "8"}).start()
    job.wait_ready()
    job.wait_gone(within=STUCK_S)
    assert job.returncodes() == {0: 0, 1: 0, 2: 0}, job.logs()
    assert not (job.run_dir / "events" / "verdict.json").exists(), job.logs()
    # Rank 2 finished while both were out of descriptors (what the test is about).
    starved_ns = max(int((job.ready_dir / f"starved-{r}").read_text()) for r in (0, 1))
    success_ns = json.loads((job.run_dir / "events" / "success-00002.json").read_text())["time_ns"]
    assert starved_ns <= success_ns < starved_ns + STARVE_S * 1e9, job.logs()


@pytest.mark.parametrize("how", ["starve_exit", "leak_exit"], ids=["soft-limit", "ulimit-leak"])
def test_a_rank_that_ends_out_of_descriptors_still_says_it_succeeded(make_job, how: str) -> None:
    """Rank 2 runs out of descriptors and finishes cleanly at once, still out of them: its
    success marker could not be written, and its peers took its clean exit for a failure
    ("ended without a success marker") and tore the healthy job down. For that record the
    soft limit is raised to the hard one (``soft-limit``). Under ``ulimit -n`` (soft = hard)
    with a leak (``ulimit-leak``), what peerwatch's own watching held is given back first,
    at exit, and the record is written: every rank exits 0."""
    job = make_job(world=3, behave=["0=await:gone-2", "1=await:gone-2", f"2={how}"],
                   env={"RANK_PROGRAM_RESERVE_FDS": "8"}).start()
    job.wait_ready()
    assert select.select([job.ranks[2].pidfd], [], [], STUCK_S)[0], job.logs()  # rank 2 ended
    (job.ready_dir / "gone-2").write_text("")
    job.wait_gone(within=STUCK_S)
    assert job.returncodes() == {0: 0, 1: 0, 2: 0}, job.logs()
    assert not (job.run_dir / "events" / "verdict.json").exists(), job.logs()
    assert (job.run_dir / "events" / "success-00002.json").exists(), job.logs()



def test_a_rank_that_fails_out_of_descriptors_is_blamed_for_its_exception(make_job) -> None:
    """Rank 2 runs out of descriptors and raises: its failure record (the exception) could
    not be written, and its peers learnt only its exit code. It is written with the soft
    limit raised for that write: the verdict names the exception."""
    job = make_job(world=3, behave=["0=await:never", "1=await:never", "2=starve_raise"],
                   env={"RANK_PROGRAM_RESERVE_FDS": "8"}).start()
    job.wait_ready()
    job.wait_gone(within=STUCK_S)
    verdict = json.loads((job.run_dir / "events" / "verdict.json").read_text())
    assert (verdict["rank"], verdict["cause"], verdict["exception"]) == (2, "exception", "RuntimeError"), verdict
    assert "failed out of descriptors" in verdict["message"], verdict
