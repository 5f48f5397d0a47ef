"""Telling someone: the ``on_verdict`` hook, run once per host after a verdict.

A shell command (``PEERWATCH_ON_VERDICT``, or ``install(on_verdict="...")``) with
``PEERWATCH_REPORT``, ``PEERWATCH_FAILED_RANK``, ``PEERWATCH_CAUSE`` (and
``PEERWATCH_EXIT_CODE``, ``PEERWATCH_RUN_DIR``, ``PEERWATCH_HOST``) in its environment, or a
callable ``f(verdict, report_path)`` (a keyword argument).

Who: an enforcer of the verdict on this host, once it has written the report; of those,
the one that creates ``RUN/claims/notified`` (``O_EXCL``). So once per host and run, whichever
enforcer gets there first (an enforcer always exists while a rank of the host lives).

Bounded: the hook gets ``grace`` seconds from its start, while its rank finishes its own
share of the teardown (which spares the command's tree: :attr:`Hook.pid`); then a command's process group is SIGKILLed (it runs in a new
session, under ``timeout(1)`` where there is one, so it is ended at the bound even if its
rank is killed first), and a callable (in a daemon thread) is left behind as the rank
exits. Its failures are logged (WARNING), never raised.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from typing import Any, Optional

from ._records import Verdict
from ._rundir import REPORT_FILE, RunDir
from ._terminal import exception_message

logger = logging.getLogger("peerwatch")

NOTIFIED_FILE = "notified"  # RUN/notified: created by the rank that runs the hook on this host
CLAIMS = "claims"  # the folder of once-per-run markers
_KILL_WAIT_S = 1.0  # after the SIGKILL of a command's group, how long its leader is waited for
# Variables of the rank that would make the hook join the run as if it were one of its
# processes (a Python hook calling install(), the teardown vouching for it).
# Not passed to the hook: what would make a Python hook that calls install() join (or sign
# for) the job it reports on. The job's own identity stays (SLURM_JOB_ID, for a requeue).
_DROPPED_ENV = frozenset((
    "PEERWATCH_DIR", "PEERWATCH_DIR_OWNER", "PEERWATCH_ON_VERDICT", "PEERWATCH_STORE_SECRET",
    "PEERWATCH_STORE_SECRET_FILE", "PEERWATCH_STORE",
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
    "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_RANK", "PMI_SIZE",
))

_running: Optional["Hook"] = None  # the hook this process started, if any (killed as it leaves)
_running_lock = threading.Lock()


class Hook:
    """A hook under way: :meth:`finish` waits for it until its deadline, then ends it."""

    def __init__(self, what: str, deadline: float, rank: int, rd: RunDir) -> None:
        self.what = what  # for people: the command, or the callable's name
        self.deadline = deadline  # time.monotonic()
        self.rank = rank
        self.rd = rd
        self.started = time.monotonic()
        self.popen: Optional[subprocess.Popen] = None
        self.thread: Optional[threading.Thread] = None
        self.error: Optional[str] = None  # the callable's exception, as text

    def finish(self) -> str:
        """Wait until the hook ends or its deadline; end a command that is still running.
        Returns what happened (logged). Never raises."""
        try:
            outcome = self._finish()
        except Exception as e:  # noqa: BLE001 - a hook must never stop a teardown
            outcome = f"could not be waited for: {e}"
        took = time.monotonic() - self.started
        if outcome == "ok":
            logger.info("peerwatch: rank %d: on_verdict %s ended in %.2fs", self.rank, self.what, took)
        else:
            logger.warning("peerwatch: rank %d: on_verdict %s %s (after %.2fs)", self.rank, self.what, outcome, took)
        from . import _eventlog

        _eventlog.append(self.rd, "notify", self.rank, hook=self.what, outcome=outcome, took_s=round(took, 3))
        global _running
        with _running_lock:
            if _running is self:
                _running = None
        return outcome

    def _finish(self) -> str:
        left = max(0.0, self.deadline - time.monotonic())
        if self.thread is not None:
            self.thread.join(left)
            if self.thread.is_alive():
                return f"did not return within its bound ({round(self.bound_s, 1):g}s); left behind as the rank exits"
            return f"raised {self.error}" if self.error else "ok"
        assert self.popen is not None
        try:
            code = self.popen.wait(left)
        except subprocess.TimeoutExpired:
            self.kill(f"still running at its bound ({round(self.bound_s, 1):g}s)")
            return f"was killed at its bound ({round(self.bound_s, 1):g}s)"
        if code == 124 or code == -signal.SIGKILL or code == 128 + signal.SIGKILL:
            # timeout(1)'s codes: it ended the command at the bound.
            return f"was killed at its bound ({round(self.bound_s, 1):g}s, exit status {code})"
        return "ok" if code == 0 else f"failed with exit status {code}"

    @property
    def pid(self) -> Optional[int]:
        """The command's leader (its process tree is the hook's), while it is not reaped."""
        p = self.popen
        return p.pid if p is not None and p.returncode is None else None

    @property
    def bound_s(self) -> float:
        return self.deadline - self.started

    def kill(self, reason: str) -> None:
        """SIGKILL the command's process group. Safe: its leader is our child and not yet
        reaped, so its pid (the group's id) cannot be anyone else's."""
        p = self.popen
        if p is None or p.returncode is not None:
            return
        logger.warning("peerwatch: rank %d: sent SIGKILL to the process group %d of on_verdict %s: %s",
                       self.rank, p.pid, self.what, reason)
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            p.wait(_KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            pass


def claim(rd: RunDir) -> bool:
    """True for the one process of this host and run that runs the hook."""
    try:
        return rd.claim(CLAIMS, NOTIFIED_FILE)
    except OSError as e:
        logger.warning("peerwatch: cannot create %s (%s): on_verdict is not run", rd.join(CLAIMS, NOTIFIED_FILE), e)
        return False


def start_hook(hook: Any, rd: RunDir, verdict: Verdict, rank: int, bound_s: float) -> Optional[Hook]:
    """Start the hook (a command or a callable) if this process is the one to; None if
    not, or if it could not be started (logged). Never raises."""
    global _running
    if hook is None or not claim(rd):
        return None
    report = rd.join(REPORT_FILE)
    try:
        if callable(hook):
            h = Hook(getattr(hook, "__qualname__", repr(hook)), time.monotonic() + bound_s, rank, rd)
            h.thread = threading.Thread(target=_call, args=(h, hook, verdict, report),
                                        name=f"peerwatch-notify-rank{rank}", daemon=True)
            h.thread.start()
        else:
            h = Hook(repr(str(hook)), time.monotonic() + bound_s, rank, rd)
            h.popen = _spawn(str(hook), _env(rd, verdict, report), bound_s)
    except Exception as e:  # noqa: BLE001 - a hook must never stop a teardown
        logger.warning("peerwatch: rank %d: on_verdict %r could not be started: %s", rank, hook, e)
        from . import _eventlog

        _eventlog.append(rd, "notify", rank, hook=repr(hook), outcome=f"could not be started: {e}", took_s=0.0)
        return None
    logger.info("peerwatch: rank %d runs on_verdict %s (at most %gs)", rank, h.what, round(bound_s, 1))
    with _running_lock:
        _running = h
    return h


def _call(h: Hook, hook: Any, verdict: Verdict, report: str) -> None:
    try:
        hook(verdict, report)
    except BaseException as e:  # noqa: BLE001 - logged by finish(), never raised

        h.error = f"{type(e).__name__}: {exception_message(e)}"
        logger.warning("peerwatch: rank %d: on_verdict %s raised", h.rank, h.what, exc_info=True)


def _env(rd: RunDir, verdict: Verdict, report: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
    env.update(
        PEERWATCH_REPORT=report, PEERWATCH_FAILED_RANK=str(verdict.rank), PEERWATCH_CAUSE=verdict.cause,
        PEERWATCH_EXIT_CODE=str(verdict.exit_code), PEERWATCH_RUN_DIR=rd.path, PEERWATCH_HOST=verdict.host or "",
    )
    return env


def _spawn(command: str, env: dict, bound_s: float) -> subprocess.Popen:
    """``sh -c command`` in a new session (its own process group), under ``timeout -s KILL``
    where coreutils has it: the bound holds even if this rank is SIGKILLed first."""
    argv = ["/bin/sh", "-c", command]
    timeout = shutil.which("timeout")
    if timeout is not None:
        # timeout(1) runs in the new group and kills the whole group at the bound.
        argv = [timeout, "-s", "KILL", f"{bound_s:.3f}s"] + argv
    return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True)


def kill_running() -> None:
    """This process is leaving now: end a hook still running (called by flush_and_exit)."""
    with _running_lock:
        h = _running
    if h is not None:
        h.kill("its rank is leaving")


__all__ = ["CLAIMS", "NOTIFIED_FILE", "Hook", "claim", "kill_running", "start_hook"]
