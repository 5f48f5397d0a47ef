"""One rank that carries out the verdict already in a run directory, with the real executor
(:func:`peerwatch.executor.carry_out`) and real collaborators, but no watcher thread. Started
by tests/test_verdict_rundir.py, never imported.

    python verdict_program.py RUN_DIR RANK OPTIONS_JSON [--wrote] [--child]

The test has prepared RUN_DIR, registered the fake peers and written the verdict, as the
watcher that detected the failure would have (:meth:`peerwatch.watcher.Watcher._publish`).
This process registers itself as RANK, opens its stack file, arms its exit record as
``install()`` does, then builds the Situation as the watcher does and carries out the plan:
its last step ends the process with the plan's exit code. ``--wrote``: this rank wrote the
verdict. ``--child``: it starts a child of its own first (a DataLoader worker's stand-in)
and writes its pid to RUN_DIR/../child.pid.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time

from peerwatch import executor, launchers
from peerwatch.core.config import Config
from peerwatch.core.records import Registration, Verdict
from peerwatch.hangs.frdump import FlightRecorderDump
from peerwatch.hangs.heartbeat import HeartbeatWriter, OwnProgress
from peerwatch.observer import Observer
from peerwatch.proc import identity
from peerwatch.rundir import eventlog, exitwatch
from peerwatch.rundir.rundir import EVENTS, VERDICT_FILE, RunDir
from peerwatch.rundir.stacks import StackFile
from peerwatch.verdict import plan as _plan


def main() -> None:
    path, rank, options = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    info = identity.probe(os.getpid())
    assert info is not None
    me = Registration(
        rank=rank, pid=os.getpid(), ppid=info.ppid, start_ticks=info.start_ticks, uid=info.uid,
        host=identity.hostname(), boot_id=identity.boot_id(), pidns=identity.pid_namespace(),
        time_ns=time.time_ns(), world_size=options.pop("world_size", None),
    )
    rd = RunDir(path)
    rd.hold()
    rd.hold_folders()
    rd.publish_registration(me)
    stacks = StackFile.open(rd, rank)
    eventlog.bind(rd, rank)
    exitwatch.arm(rd, rank, write_success=False)
    if "--child" in sys.argv:
        # Not on our pipes: a child left alive must not hold the test waiting for their end.
        child = subprocess.Popen(["sleep", "60"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(os.path.join(os.path.dirname(path), "child.pid"), "w") as f:
            f.write(str(child.pid))
    config = Config.resolve(options)
    observer = Observer(rd, me, use_pidfd=True, remote=None)
    observer.local.start()
    observer.scan()
    verdict = rd.read(EVENTS, VERDICT_FILE, Verdict)
    assert verdict is not None, "the test writes the verdict first"
    situation = _plan.Situation(
        self_rank=rank, failed_rank=verdict.rank, cause=verdict.cause, verdict_exit_code=verdict.exit_code,
        own_exit_code=None, in_watch=False, live_local_ranks=tuple(observer.live_local_ranks()),
        wrote_verdict="--wrote" in sys.argv, grace_s=config.grace, ack_window_s=config.ack_window,
        failed_rank_speaks=executor.failed_rank_speaks(observer, rank, verdict),
        ends_workers_early=launchers.ends_workers_early(me, verdict),
        other_hosts=False, on_verdict=config.on_verdict is not None,
    )
    plan = _plan.plan(situation)
    print(json.dumps([s.name for s in plan.until_ack + plan.after_ack]), flush=True)  # for the test's messages
    executor.carry_out(executor.Teardown(
        on_verdict=config.on_verdict, on_verdict_timeout_s=config.on_verdict_timeout, run_dir=rd, me=me, observer=observer, stacks=stacks,
        flight_recorder=FlightRecorderDump(rd, rank), bridge=None, main_left=threading.Event(),
        interrupt_installed=False,
        heartbeat=HeartbeatWriter(rd, me, OwnProgress(), with_position=False, read_collectives=False),
        verdict=verdict, situation=situation, plan=plan,
    ))
    sys.exit(99)  # carry_out never returns: its last step exits


if __name__ == "__main__":
    main()
