"""Making a run directory ready for a run: created 0700 with its folders, an earlier run
left in it set aside, another job's or another host's refused, and this rank registered,
all under one lock (:func:`prepare`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from typing import Dict, Mapping, Optional

from ..core.errors import RunDirError
from ..core.records import Registration, Success, Verdict
from ..proc import identity
from .basedir import base_dir
from .rundir import EVENTS, RANKS, VERDICT_FILE, RunDir, rank_file, same_job
from .trust import check_ancestors, check_trusted, private_dir

logger = logging.getLogger("peerwatch")


def prepare(run_dir: RunDir, reg: Registration, started: identity.Started) -> None:
    """Create the directory and its folders (0700), and register rank ``reg.rank`` in it.

    Every folder above it must be safe from other users (:func:`check_ancestors`),
    else :class:`RunDirError`. Under a lock beside the directory: a directory left by
    an earlier run (this rank's slot held by a dead process, or a verdict older than
    this process) is set aside first. A slot held by another live process means two
    jobs share the directory: :class:`RunDirError`. The registration is published
    under that same lock, so the check and the claim are one step: the first process to
    claim a slot holds it. From then on the directory is held by a descriptor (see
    :class:`peerwatch.rundir.trust.HeldDir`).
    """
    parent = os.path.dirname(os.path.abspath(run_dir.path))
    try:
        os.makedirs(parent, 0o700, exist_ok=True)
    except OSError as e:
        raise RunDirError(parent, f"cannot be created ({e.strerror})") from None
    check_ancestors(parent)
    if parent == base_dir():
        check_trusted(parent)
    import filelock

    lock = filelock.FileLock(lock_path(run_dir.path), timeout=30)
    try:
        with lock:
            run_dir.close()
            _set_aside_if_stale(run_dir, reg, started)
            try:
                os.mkdir(run_dir.path, 0o700)
            except FileExistsError:
                pass
            except OSError as e:
                raise RunDirError(run_dir.path, f"cannot be created ({e.strerror})") from None
            run_dir.hold()
            run_dir.hold_folders()
            if reg.world_size is not None and reg.world_size > 0:
                # From now on (not while judging an earlier run's records, above).
                run_dir.world_size = reg.world_size
            # Under the lock that covered the check: of two processes claiming one slot
            # at once, the first to take the lock registers, the second is refused above.
            run_dir.publish_registration(reg)
    except filelock.Timeout:
        raise RunDirError(run_dir.path, "timed out waiting for its lock file") from None


def _set_aside_if_stale(run_dir: RunDir, reg: Registration, started: identity.Started) -> None:
    if not os.path.lexists(run_dir.path):
        return
    run_dir.hold()  # read what was checked, not what the path names a moment later
    mine = run_dir.read(RANKS, rank_file("rank", reg.rank), Registration)
    if mine is not None and (mine.host, mine.pidns) != (reg.host, reg.pidns):
        raise _held_by_another_host(run_dir, reg, mine)
    regs = run_dir.registrations()
    live = {r.rank: r for r in regs.values() if r.rank != reg.rank and identity.seems_alive(r)}
    _refuse_if_shared(run_dir, reg, mine, live)
    stale_reason = stale_because(reg, mine, regs, bool(live), run_dir.successes(), started,
                                 run_dir.read(EVENTS, VERDICT_FILE, Verdict))
    if stale_reason is None:
        return
    aside = f"{run_dir.path}.stale-{time.time_ns()}"
    logger.warning("peerwatch: %s is from an earlier run (%s); moved it to %s", run_dir.path, stale_reason, aside)
    run_dir.close()  # the descriptors would follow it aside
    os.rename(run_dir.path, aside)


def _held_by_another_host(run_dir: RunDir, reg: Registration, mine: Registration) -> RunDirError:
    # Another host's (or container's) record is never judged stale: we cannot see
    # its processes. Without shared mode a run directory belongs to one host; with
    # it, a rank's slot held by another host means a directory of an earlier job.
    if run_dir.shared is not None:
        return RunDirError(
            run_dir.path,
            f"rank {reg.rank} is registered here by host {mine.host} ({mine.pidns}), whose processes "
            "this host cannot see: the directory is shared by the hosts (" + run_dir.shared + "), so "
            "give each job a new PEERWATCH_DIR (e.g. with the job id in it)",
        )
    return RunDirError(
        run_dir.path,
        f"rank {reg.rank} is registered here by host {mine.host} ({mine.pidns}): a run directory "
        "belongs to one host; on a shared filesystem give each host its own PEERWATCH_DIR, "
        "or set shared_fs=on",
    )


def _refuse_if_shared(run_dir: RunDir, reg: Registration, mine: Optional[Registration],
                      live: Dict[int, Registration]) -> None:
    """Raise when a live process of this run or another job holds what this rank would take."""
    if mine is not None and (mine.pid, mine.start_ticks) != (reg.pid, reg.start_ticks):
        if identity.is_same_process(mine.pid, mine.start_ticks, mine.uid) and mine.boot_id == reg.boot_id:
            raise RunDirError(
                run_dir.path,
                f"rank {reg.rank} is already registered by live pid {mine.pid}: two jobs share "
                "this run directory; give each its own PEERWATCH_DIR",
            )
        mates = sorted(r.rank for r in live.values() if same_job(r, reg))
        if mates:
            # The run lives on: this is not rank reg.rank of a new run but a process
            # (a child that outlived its rank?) claiming a dead rank's slot.
            raise RunDirError(
                run_dir.path,
                f"rank {reg.rank}'s process (pid {mine.pid}) is gone but ranks {mates} of its run "
                "still live: this process is not a new rank of this run",
            )
    others = sorted(r.rank for r in live.values() if not same_job(r, reg))
    if others:
        theirs = live[others[0]].world_size
        raise RunDirError(
            run_dir.path,
            f"it holds a live run of world size {theirs} (ranks {others}), and this rank's world size is "
            f"{reg.world_size}: two jobs share this run directory; give each its own PEERWATCH_DIR",
        )


def stale_because(
    reg: Registration, mine: Optional[Registration], regs: Mapping[int, Registration], live: bool,
    successes: Mapping[int, Success], started: identity.Started, verdict: Optional[Verdict],
) -> Optional[str]:
    """Why the directory ``reg`` is about to register in holds an earlier, ended run (to be
    set aside), or None: it is this run's (or empty). Only when no registered process lives:
    - ``reg``'s slot is held by a process that is gone;
    - it holds a verdict from before this process started;
    - every registered rank finished cleanly before this process started (an earlier run
      that succeeded: ``torch.multiprocessing.spawn`` called again from one process);
    - its ranks were of another world size (an earlier job of another size).
    A rank of this run that died before this process started (Lightning's rank 0, after it
    started its children) is none of these: its death is this run's failure."""
    if live:
        return None
    if mine is not None and (mine.pid, mine.start_ticks) != (reg.pid, reg.start_ticks):
        return f"rank {reg.rank} was registered by pid {mine.pid}, which is gone"
    if verdict is not None and verdict.made_before(*started):
        return "it holds a verdict from before this process started"
    if regs and all(r in successes and successes[r].time_ns < started.wall_ns for r in regs):
        return f"every rank of its run (ranks {sorted(regs)}) finished before this process started"
    strangers = sorted(r.rank for r in regs.values() if not same_job(r, reg))
    if strangers:
        return f"ranks {strangers} were of a run of world size {regs[strangers[0]].world_size}"
    return None


def lock_path(path: str) -> str:
    """The lock ``prepare`` holds while it creates or sets aside the run directory ``path``:
    beside it (``<path>.lock``) where that folder is ours alone, else in the base
    (``<base>/locks/<hash of path>.lock``): in a folder others can write (a sticky
    ``/tmp``), another user could make ``<path>.lock`` first and hold it, or own it."""
    path = os.path.abspath(path)
    if private_dir(os.path.dirname(path)):
        return path + ".lock"
    base = base_dir()
    locks = os.path.join(base, "locks")
    for folder in (base, locks):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass
        except OSError as e:
            raise RunDirError(folder, f"cannot be created ({e.strerror})") from None
        check_trusted(folder)
    return os.path.join(locks, hashlib.sha256(path.encode()).hexdigest()[:32] + ".lock")


__all__ = ["lock_path", "prepare", "stale_because"]
