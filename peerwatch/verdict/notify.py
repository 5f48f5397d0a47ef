"""Telling someone: the ``on_verdict`` hook, run once per host after a verdict.

A shell command or a callable ``f(verdict, report_path)``, as docs/notify.md describes
(its environment, its bound, what it may do). Who runs it: an enforcer of the verdict on
this host, once it has written the report; of those, the one that creates
``RUN/claims/notified`` (``O_EXCL``): once per host and run, and once for mp.spawn's main
process and its workers together (:func:`claim`).

A command runs below a keeper (:mod:`peerwatch.verdict.keeper`), so its whole tree is ended
at the bound even if its rank is killed first, and its rank's teardown spares it
(:attr:`Hook.pid`). The rank waits for a command in one C call that keeps the GIL
(:meth:`Hook.finish`): it trains no more meanwhile. A callable (a daemon thread) needs the
GIL, and is left behind as the rank exits at the bound. Failures are logged, never raised.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from typing import Any, Optional, Tuple

from ..core.records import Verdict
from ..core.terminal import exception_message
from ..rundir.rundir import REPORT_FILE, SPAWNED_RUN, RunDir
from .keeper import ENDED_EARLY, KILLED_AT_BOUND

logger = logging.getLogger("peerwatch")

NOTIFIED_FILE = "notified"  # RUN/notified: created by the rank that runs the hook on this host
CLAIMS = "claims"  # the folder of once-per-run markers
_KILL_WAIT_S = 1.0  # after the SIGKILL of a command's group, how long its leader is waited for
# Beyond the bound, how long the keeper has to end the tree and exit before its rank ends it.
_KEEPER_EXTRA_S = 1.0
_KEEPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "keeper.py")
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
        self.kept = False  # the command runs below peerwatch's keeper (it ends the tree itself)

    def finish(self, hold_gil: bool = False) -> str:
        """Wait until the hook ends or its deadline; end a command that is still running.
        ``hold_gil``: wait for a command without letting any other thread of this process
        run Python meanwhile (the training thread stops at its next step; the rank is
        leaving). Returns what happened (logged). Never raises."""
        try:
            if hold_gil and self.popen is not None:
                _wait_holding_gil(self.popen.pid, max(0.0, self.deadline - time.monotonic()) + _KEEPER_EXTRA_S)
            outcome = self._finish()
        except Exception as e:  # noqa: BLE001 - a hook must never stop a teardown
            outcome = f"could not be waited for: {e}"
        took = time.monotonic() - self.started
        if outcome == "ok":
            logger.info("peerwatch: rank %d: on_verdict %s ended in %.2fs", self.rank, self.what, took)
        else:
            logger.warning("peerwatch: rank %d: on_verdict %s %s (after %.2fs)", self.rank, self.what, outcome, took)
        from ..rundir import eventlog

        eventlog.append(self.rd, "notify", self.rank, hook=self.what, outcome=outcome, took_s=round(took, 3))
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
            code = self.popen.wait(left + (_KEEPER_EXTRA_S if self.kept else 0.0))
        except subprocess.TimeoutExpired:
            self.kill(f"still running at its bound ({round(self.bound_s, 1):g}s)")
            return f"was killed at its bound ({round(self.bound_s, 1):g}s)"
        if code == KILLED_AT_BOUND or code == -signal.SIGKILL or code == 128 + signal.SIGKILL:
            # The keeper's (and timeout(1)'s) codes: it ended the command's tree at the bound.
            return f"was killed at its bound ({round(self.bound_s, 1):g}s, exit status {code})"
        if self.kept and code == ENDED_EARLY:
            return "was ended early: its rank was leaving"
        return "ok" if code == 0 else f"failed with exit status {code}"

    @property
    def pid(self) -> Optional[int]:
        """The command's leader (its process tree is the hook's), while it is not reaped."""
        p = self.popen
        return p.pid if p is not None and p.returncode is None else None

    @property
    def bound_s(self) -> float:
        return self.deadline - self.started

    def end_early(self, reason: str) -> None:
        """This rank is leaving before the hook's bound: have the keeper end the command's
        whole tree now (SIGTERM to the keeper), else SIGKILL its process group."""
        p = self.popen
        if p is None or p.returncode is not None:
            return
        if self.kept:
            logger.warning("peerwatch: rank %d: sent SIGTERM to the keeper (pid %d) of on_verdict %s: %s",
                           self.rank, p.pid, self.what, reason)
            try:
                p.send_signal(signal.SIGTERM)
                p.wait(_KILL_WAIT_S)
                return
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill(reason)

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
    """True for the one process of this host and job that runs the hook.

    A process whose multiprocessing children run as the ranks of a nested run (mp.spawn's
    main process, with ``install()`` at the top, and its workers with theirs) claims the
    hook in that nested run, not in its own: the job's two runs on this host tell once,
    whichever acts first. A run directory shared by several hosts has one claim per host
    (``notified-<host>``): each host runs it once, for its own host-local actions."""
    where = rd
    try:
        nested = stat.S_ISDIR(rd.stat("", SPAWNED_RUN).st_mode)  # a folder, not a symlink to one
    except OSError:
        nested = False
    if nested:
        # Opened through the held descriptor's path (never the run directory's path again),
        # and never through a symlink at its end.
        where = RunDir(rd.at(SPAWNED_RUN), shared=rd.shared)
    name = where.per_host(NOTIFIED_FILE)
    try:
        return where.claim(CLAIMS, name)
    except OSError as e:
        logger.warning("peerwatch: cannot create %s (%s): on_verdict is not run", where.join(CLAIMS, name), e)
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
            h.popen, h.kept = _spawn(str(hook), _env(rd, verdict, report), bound_s)
    except Exception as e:  # noqa: BLE001 - a hook must never stop a teardown
        logger.warning("peerwatch: rank %d: on_verdict %r could not be started: %s", rank, hook, e)
        from ..rundir import eventlog

        eventlog.append(rd, "notify", rank, hook=repr(hook), outcome=f"could not be started: {e}", took_s=0.0)
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


def _spawn(command: str, env: dict, bound_s: float) -> Tuple[subprocess.Popen, bool]:
    """``sh -c command`` in a new session, below the keeper (True), which ends its whole tree
    at the bound even if this rank is SIGKILLed first; without an interpreter to run the
    keeper, under ``timeout -s KILL`` where coreutils has it (False: its process group only)."""
    argv = ["/bin/sh", "-c", command]
    if sys.executable and os.path.exists(_KEEPER):
        # Isolated (-I -S): the keeper imports nothing of the job's paths, nor of peerwatch.
        argv = [sys.executable, "-I", "-S", _KEEPER, f"{bound_s:.3f}"] + argv
        kept = True
    else:
        timeout = shutil.which("timeout")
        if timeout is not None:
            argv = [timeout, "-s", "KILL", f"{bound_s:.3f}s"] + argv
        kept = False
    popen = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    return popen, kept


def _wait_holding_gil(pid: int, timeout_s: float) -> None:
    """Wait until our child ``pid`` ends, at most ``timeout_s``, in C calls that keep the GIL
    (``ctypes.PyDLL``): no other thread of this process runs Python meanwhile. Where pidfds
    are missing it returns at once (the caller then waits as usual)."""
    import ctypes

    class PollFd(ctypes.Structure):
        _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]

    try:
        fd = os.pidfd_open(pid)  # type: ignore[attr-defined,unused-ignore]
    except (AttributeError, OSError):
        return
    try:
        libc = ctypes.PyDLL(None, use_errno=True)
        poll = libc.poll
        poll.argtypes = [ctypes.POINTER(PollFd), ctypes.c_ulong, ctypes.c_int]
        poll.restype = ctypes.c_int
        pfd = PollFd(fd, select.POLLIN, 0)
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = max(0, int((deadline - time.monotonic()) * 1000) + 1)
            # A signal meant for the process may interrupt it (EINTR): wait again.
            if poll(ctypes.byref(pfd), 1, left_ms) != -1 or ctypes.get_errno() != errno.EINTR:
                return
    finally:
        os.close(fd)


def kill_running() -> None:
    """This process is leaving now: end a hook still running (called by leave.flush_and_exit)."""
    with _running_lock:
        h = _running
    if h is not None:
        h.end_early("its rank is leaving")


__all__ = ["CLAIMS", "NOTIFIED_FILE", "Hook", "claim", "kill_running", "start_hook"]
