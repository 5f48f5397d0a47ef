"""Cooperation with the launcher that started this rank.

The watcher calls in here at three fixed points; nothing here imports torch or Lightning
(their modules are looked up in ``sys.modules``, never imported).

``after_install``
    Marks ``PEERWATCH_DIR`` as exported by this process (so that a multiprocessing child
    of a process that installed peerwatch, an ``mp.spawn`` worker, does not take its
    parent for a peer: see :func:`peerwatch._rundir.resolve`), and watches the launcher.
    Under torchrun and ``torch.multiprocessing.spawn`` the rank's parent is a launcher
    that is not a rank: the agent, the main process. If it dies (SIGKILL, OOM killer),
    its workers are orphans that nothing will restart, reap or report; they are peers of
    each other, so their own watchers see nothing wrong, and they train on or hang in a
    collective. The launcher's death is therefore this rank's failure (cause ``lost``),
    and the usual teardown follows. The launcher is the parent process at ``install()``.
    (mp.spawn's own answer, SIGINT on the parent's death, is dropped: its wrapper turns
    the KeyboardInterrupt into a clean exit 0, and a rank blocked in C never sees it.)

``on_verdict``
    Quiets Lightning's ``_ChildProcessObserver`` in this process (rank 0 under Lightning's
    subprocess launcher). Every 5 s it polls rank 0's children; seeing one exit non-zero
    (as torn-down ranks do) it SIGKILLs rank 0 and all the children: rank 0 would then exit
    137 whatever the verdict's code, and maybe before writing the report. Once there is a
    verdict, peerwatch tears the job down itself. Under torchrun and mp.spawn it writes
    the report at once (see ``before_exit``). Then it runs the verdict listeners (the Lightning callback
    reports through Lightning's logging).

``before_exit``
    Under torchrun and mp.spawn, a surviving worker lets the launcher see the failed
    worker first: it waits (at most ``AGENT_WAIT_S``) until the launcher has reaped it.
    The launcher then stops the other workers itself (SIGTERM, as without peerwatch), and
    names the right root cause. Survivors that left first would be reaped in the same
    poll: torchrun would name the lowest local rank as the root cause (its timestamps
    have a one-second resolution), mp.spawn whichever sentinel it looks at first.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import select
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable, List, Mapping, Optional

from . import _identity, _report, _rundir, _teardown
from ._records import LOST, Failure, Registration, Verdict
from ._sources import is_local

if TYPE_CHECKING:
    from ._watcher import Watcher

logger = logging.getLogger("peerwatch")

AGENT_WAIT_S = 1.0  # how long a surviving worker waits for its launcher to reap the failed one
AGENT_POLL_S = 0.005  # how often it looks meanwhile (only during a teardown)
LAUNCHER_POLL_S = 0.1  # where pidfds are missing: how often the launcher is checked
VERDICT_WAIT_S = 2.0  # after the launcher's death, how long to wait for the verdict before leaving anyway
LAUNCHER_GONE = "peerwatch.LauncherGone"  # the "exception" named in the failure record
MP_PARENT = "multiprocessing parent (torch.multiprocessing.spawn)"

_OBSERVER_MODULES = (
    "lightning.fabric.strategies.launchers.subprocess_script",
    "lightning_fabric.strategies.launchers.subprocess_script",
)

VerdictListener = Callable[["Watcher", Verdict], None]
_listeners: List[VerdictListener] = []
_listeners_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Launcher:
    pid: int
    start_ticks: int
    uid: int
    kind: str  # for people: "torchrun agent"


# -- after install -------------------------------------------------------------------


def after_install(watcher: Watcher) -> None:
    """Called by install() once the watcher runs. Never raises."""
    try:
        os.environ[_rundir.OWNER_VAR] = _rundir.process_key(os.getpid())
        launcher = launcher_of(watcher.me, os.environ)
        if launcher is not None:
            if launcher.kind == MP_PARENT:
                _drop_sigint_on_parent_death()
            threading.Thread(
                target=_watch_launcher, args=(watcher, launcher), name=f"peerwatch-launcher-rank{watcher.rank}",
                daemon=True,
            ).start()
    except Exception:  # noqa: BLE001 - training goes on; the rank is still watched by its peers
        logger.exception("peerwatch: rank %d cannot watch its launcher", watcher.rank)


def launcher_of(me: Registration, env: Mapping[str, str]) -> Optional[Launcher]:
    """The launcher to watch: this rank's parent, under torchrun or as a multiprocessing
    child (``mp.spawn``); ``None`` otherwise (Lightning's ranks 1..N-1 have rank 0, a
    peer, for parent; hand-started ranks a shell; Slurm's the step daemon, which ends
    its tasks itself)."""
    if env.get("TORCHELASTIC_RUN_ID"):
        kind = "torchrun agent"
    elif _rundir.is_multiprocessing_child():
        kind = MP_PARENT
    else:
        return None
    info = _identity.probe(me.ppid)
    if info is None or info.dead:
        return Launcher(me.ppid, 0, me.uid, kind)  # already gone
    return Launcher(info.pid, info.start_ticks, info.uid, kind)


_PR_SET_PDEATHSIG, _PR_GET_PDEATHSIG = 1, 2


def _drop_sigint_on_parent_death() -> None:
    """torch.multiprocessing.spawn's workers get SIGINT when their parent dies, and its
    wrapper swallows the KeyboardInterrupt: the worker then ends with status 0, as if it
    had finished, or not at all if its main thread is blocked in C (a collective). Since
    peerwatch watches the parent, the parent's death becomes a failure instead."""
    try:
        import ctypes  # not at import time: import peerwatch stays cheap

        libc = ctypes.CDLL(None, use_errno=True)
        current = ctypes.c_int(0)
        if libc.prctl(_PR_GET_PDEATHSIG, ctypes.byref(current), 0, 0, 0) != 0:
            return
        if current.value == signal.SIGINT:
            libc.prctl(_PR_SET_PDEATHSIG, 0, 0, 0, 0)
            logger.debug("peerwatch: the parent's death is watched; SIGINT on its death dropped")
    except (OSError, AttributeError):
        pass  # not Linux: no PDEATHSIG to drop


def _watch_launcher(w: Watcher, launcher: Launcher) -> None:
    try:
        if _wait_gone(w, launcher):
            _launcher_gone(w, launcher)
    except Exception:  # noqa: BLE001 - the watcher must never die silently
        logger.exception("peerwatch: rank %d stopped watching its launcher (pid %d)", w.rank, launcher.pid)


def _wait_gone(w: Watcher, launcher: Launcher) -> bool:
    """Block until the launcher is gone (True) or this rank's watcher stops (False)."""
    pidfd = None
    if hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(launcher.pid)
        except OSError:
            pidfd = None
    try:
        # Verified after the pidfd is open: from now on it refers to that very process.
        if not _identity.is_same_process(launcher.pid, launcher.start_ticks, launcher.uid):
            return True
        while not w.stopped.is_set():
            if pidfd is not None:
                # No wake-up needed: a daemon thread, and a rank that is done ignores the news.
                ready, _, _ = select.select([pidfd], [], [], None)
                if ready:
                    return True
            elif w.stopped.wait(LAUNCHER_POLL_S) or not _identity.is_same_process(
                launcher.pid, launcher.start_ticks, launcher.uid
            ):
                return not w.stopped.is_set()
        return False
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _launcher_gone(w: Watcher, launcher: Launcher) -> None:
    if w.verdict is not None or w.succeeded or w.stopped.is_set():
        return  # being torn down already, or done: the launcher's end is no news
    message = (
        f"its launcher ({launcher.kind}, pid {launcher.pid}) is gone; nothing would restart, "
        "reap or report this rank"
    )
    logger.error("peerwatch: rank %d (pid %d): %s. Failing this rank.", w.rank, os.getpid(), message)
    w.record_failure(Failure(
        rank=w.rank, pid=os.getpid(), time_ns=time.time_ns(), cause=LOST, exit_code=w.config.exit_code,
        exception=LAUNCHER_GONE, message=message,
    ))
    if not w.verdict_seen.wait(VERDICT_WAIT_S):
        logger.error("peerwatch: rank %d has no verdict %gs after losing its launcher; exiting", w.rank, VERDICT_WAIT_S)
        _teardown.flush_and_exit(w.config.exit_code)
    verdict = w.verdict
    if verdict is not None and verdict.rank == w.rank:
        # The watcher waits for a failing rank's main thread to leave; this one is not
        # leaving (it lost its launcher, it did not raise). Tell the watcher to go on.
        w.stopped.set()
        w.wake()


# -- on verdict ----------------------------------------------------------------------


def add_verdict_listener(listener: VerdictListener) -> None:
    """Call ``listener(watcher, verdict)`` in the watcher thread when a verdict is known,
    before the teardown. It must be quick; its exceptions are logged and ignored."""
    with _listeners_lock:
        if listener not in _listeners:
            _listeners.append(listener)


def remove_verdict_listener(listener: VerdictListener) -> None:
    with _listeners_lock:
        if listener in _listeners:
            _listeners.remove(listener)


def on_verdict(watcher: Watcher, verdict: Verdict) -> None:
    """Called by the watcher thread once it acts on a verdict. Never raises."""
    try:
        quiet_lightning_observer()
    except Exception:  # noqa: BLE001
        logger.exception("peerwatch: could not quiet Lightning's child process observer")
    if verdict.rank != watcher.rank and launcher_of(watcher.me, os.environ) is not None:
        # torchrun's agent and mp.spawn's main process SIGTERM the surviving workers as soon
        # as they have seen the failed one: the report cannot wait for our teardown's end.
        try:
            _report.write(watcher.run_dir)
        except Exception:  # noqa: BLE001
            logger.exception("peerwatch: rank %d could not write the report", watcher.rank)
    with _listeners_lock:
        listeners = list(_listeners)
    for listener in listeners:
        try:
            listener(watcher, verdict)
        except Exception:  # noqa: BLE001 - a listener must never stop the teardown
            logger.exception("peerwatch: verdict listener %r failed", listener)


def quiet_lightning_observer() -> int:
    """Stop Lightning's ``_ChildProcessObserver`` threads in this process from killing
    anything; returns how many were quieted. Only meant for once there is a verdict."""
    found = (getattr(sys.modules.get(name), "_ChildProcessObserver", None) for name in _OBSERVER_MODULES)
    classes = tuple(c for c in found if isinstance(c, type))
    if not classes:
        return 0
    quieted = 0
    for thread in threading.enumerate():
        if isinstance(thread, classes) and thread.is_alive():
            # Its loop is `sleep(5); self._finished = self._run()`: a _run that reports
            # "finished" ends it without it looking at (and reaping) the children again.
            thread._run = lambda: True  # type: ignore[attr-defined]
            thread._terminate_all = lambda: None  # type: ignore[attr-defined]
            quieted += 1
    if quieted:
        logger.debug("peerwatch: quieted Lightning's child process observer: peerwatch tears the job down")
    return quieted


# -- before exit ---------------------------------------------------------------------


def before_exit(watcher: Watcher, verdict: Verdict) -> None:
    """Called by the watcher thread right before this rank exits. Never raises."""
    try:
        _let_agent_see_first(watcher, verdict)
    except Exception:  # noqa: BLE001
        logger.exception("peerwatch: rank %d could not wait for its agent", watcher.rank)


def _let_agent_see_first(w: Watcher, verdict: Verdict) -> None:
    if verdict.rank == w.rank or launcher_of(w.me, os.environ) is None:
        return
    failed = w.run_dir.read(_rundir.RANKS, _rundir.rank_file("rank", verdict.rank), Registration)
    if failed is None or not is_local(failed) or failed.ppid != w.me.ppid:
        return  # not a sibling: our launcher has nothing to see
    agent = _identity.probe(w.me.ppid)
    if agent is None or agent.dead:
        return
    deadline = time.monotonic() + AGENT_WAIT_S
    while time.monotonic() < deadline:
        info = _identity.probe(failed.pid)
        if info is None or info.start_ticks != failed.start_ticks:
            logger.debug("peerwatch: rank %d: the agent reaped rank %d", w.rank, verdict.rank)
            return  # reaped: the agent saw it and is stopping the workers now
        time.sleep(AGENT_POLL_S)
    logger.debug("peerwatch: rank %d: the agent did not reap rank %d within %gs", w.rank, verdict.rank, AGENT_WAIT_S)


__all__ = [
    "AGENT_WAIT_S", "LAUNCHER_GONE", "Launcher", "add_verdict_listener", "after_install", "before_exit",
    "launcher_of", "on_verdict", "quiet_lightning_observer", "remove_verdict_listener",
]
