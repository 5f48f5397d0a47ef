"""Cooperation with the launcher that started this rank.

The watcher calls in here at three fixed points; nothing here imports torch or Lightning
(their modules are looked up in ``sys.modules``, never imported).

``after_install``
    Marks ``PEERWATCH_DIR`` as exported by this process (so that a multiprocessing child
    of a process that installed peerwatch, an ``mp.spawn`` worker, does not take its
    parent for a peer: see :func:`peerwatch.rundir.basedir.resolve`), and watches the
    launcher that is not a rank (torchrun's agent, mp.spawn's main process, DeepSpeed's
    launcher; the parent at ``install()``): if it dies, its workers are orphans that nothing
    restarts, reaps or reports, and that see nothing wrong with each other, so its death is
    this rank's failure (cause ``lost``). (mp.spawn's own answer, SIGINT on the parent's
    death, is dropped: its wrapper turns the KeyboardInterrupt into a clean exit 0, and a
    rank blocked in C never sees it.)

``on_verdict``
    Quiets Lightning's ``_ChildProcessObserver`` in this process (it would SIGKILL rank 0,
    exit 137, maybe before the report); under a launcher that is no rank, the report is
    written at once. Then the verdict listeners run.

``before_exit``
    Under such a launcher, a surviving worker lets the launcher see the failed worker
    first (at most ``AGENT_WAIT_S``; ``DEEPSPEED_AGENT_WAIT_S`` for DeepSpeed's), so that it
    names the right root cause and stops the others itself.

Why, launcher by launcher: docs/launchers.md, "The launcher's own reactions".
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
from typing import Any, Callable, Dict, List, Mapping, Optional

from .core import terminal
from .core.records import LOST, Failure, Registration, Verdict
from .ending import Ending
from .proc import identity
from .proc.identity import is_local
from .rundir import basedir, rundir
from .verdict import leave

logger = logging.getLogger("peerwatch")

AGENT_WAIT_S = 1.0  # how long a surviving worker waits for its launcher to reap the failed one
AGENT_POLL_S = 0.005  # how often it looks meanwhile (only during a teardown)
LAUNCHER_POLL_S = 0.1  # where pidfds are missing: how often the launcher is checked
VERDICT_WAIT_S = 2.0  # after the launcher's death, how long to wait for the verdict before leaving anyway
LAUNCHER_GONE = "peerwatch.LauncherGone"  # the "exception" named in the failure record
MP_PARENT = "multiprocessing parent (torch.multiprocessing.spawn)"
TORCHRUN_AGENT = "torchrun agent"
DEEPSPEED_LAUNCHER = "DeepSpeed launcher"
DEEPSPEED_MODULE = "deepspeed.launcher.launch"  # `deepspeed` runs `python -u -m <this>` per host
# DeepSpeed's launcher looks at its workers once a second (`time.sleep(1)` in its loop):
# a surviving worker waits that long, and a little more, for it to reap the failed one.
DEEPSPEED_AGENT_WAIT_S = 1.5
# Lightning's observer (rank 0: every 5 s it polls the other ranks, and SIGKILLs every
# process once one has ended) leaves the teardown to peerwatch this long first; its safety
# net stays for a rank whose watcher is not running. Without it, an observer poll that
# came right after a death (on a loaded host, before any watcher printed) lost the cause.
LIGHTNING_DEFER_S = 2.0
LIGHTNING_DEFER_POLL_S = 0.05

_OBSERVER_MODULES = (
    "lightning.fabric.strategies.launchers.subprocess_script",
    "lightning_fabric.strategies.launchers.subprocess_script",
)

VerdictListener = Callable[[Verdict], None]


_listeners: List[VerdictListener] = []
_listeners_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Launcher:
    pid: int
    start_ticks: int
    uid: int
    kind: str  # for people: "torchrun agent"


# -- after install -------------------------------------------------------------------


def after_install(link: Ending, exit_code: int) -> Optional[LauncherWatch]:
    """Called once the watcher runs: marks ``PEERWATCH_DIR`` as ours, and starts watching
    the launcher, if this rank has one. Never raises."""
    try:
        os.environ[basedir.OWNER_VAR] = basedir.process_key(os.getpid())
        launcher = launcher_of(link.me, os.environ)
        if launcher is None:
            return None
        if launcher.kind == MP_PARENT:
            _drop_sigint_on_parent_death()
        watch = LauncherWatch(link, launcher, exit_code)
        watch.start()
        return watch
    except Exception:  # noqa: BLE001 - training goes on; the rank is still watched by its peers
        logger.exception("peerwatch: rank %d cannot watch its launcher", link.me.rank)
        return None


class LauncherWatch:
    """A thread (``peerwatch-launcher-rank<N>``) that sleeps on the launcher's pidfd and a
    stop pipe; when the launcher is gone, this rank fails (cause ``lost``)."""

    def __init__(self, link: Ending, launcher: Launcher, exit_code: int) -> None:
        self.link = link
        self.launcher = launcher
        self.exit_code = exit_code
        self._stop_r, self._stop_w = os.pipe()
        self._stopped = False  # stop() was called (by the thread that stops the watcher)
        self.thread = threading.Thread(target=self._main, name=f"peerwatch-launcher-rank{link.me.rank}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 1.0) -> None:
        """Stop watching and join the thread (from another thread; once)."""
        if self._stopped:
            return
        self._stopped = True
        os.write(self._stop_w, b"\0")
        if self.thread is not threading.current_thread() and self.thread.is_alive():
            self.thread.join(timeout)
        if not self.thread.is_alive():
            os.close(self._stop_r)
            os.close(self._stop_w)

    def _main(self) -> None:
        try:
            if self._wait_gone():
                _launcher_gone(self.link, self.launcher, self.exit_code)
        except Exception:  # noqa: BLE001 - the watcher must never die silently
            logger.exception("peerwatch: rank %d stopped watching its launcher (pid %d)", self.link.me.rank,
                             self.launcher.pid)

    def _wait_gone(self) -> bool:
        """Block until the launcher is gone (True) or we are told to stop (False)."""
        launcher = self.launcher
        pidfd = None
        if hasattr(os, "pidfd_open"):
            try:
                pidfd = os.pidfd_open(launcher.pid)
            except OSError:
                pidfd = None
        try:
            # Verified after the pidfd is open: from now on it refers to that very process.
            # One that cannot be told (out of descriptors...) is not gone: looked at again.
            while identity.same_process(launcher.pid, launcher.start_ticks, launcher.uid) is not False:
                fds = [self._stop_r] if pidfd is None else [self._stop_r, pidfd]
                ready, _, _ = select.select(fds, [], [], None if pidfd is not None else LAUNCHER_POLL_S)
                if self._stop_r in ready or self.link.done.is_set():
                    return False
                if pidfd is not None and pidfd in ready:
                    return True
            return not self.link.done.is_set()
        finally:
            if pidfd is not None:
                os.close(pidfd)


def launcher_of(me: Registration, env: Mapping[str, str]) -> Optional[Launcher]:
    """The launcher to watch: this rank's parent, under torchrun, as a multiprocessing
    child (``mp.spawn``) or under DeepSpeed's per-host launcher; ``None`` otherwise (Lightning's ranks 1..N-1 have rank 0, a
    peer, for parent; hand-started ranks a shell; Slurm's the step daemon, which ends
    its tasks itself)."""
    if env.get("TORCHELASTIC_RUN_ID"):
        kind = TORCHRUN_AGENT  # also `accelerate launch --multi_gpu`: torchrun's agent in accelerate's process
    elif basedir.is_multiprocessing_child():
        kind = MP_PARENT
    elif is_deepspeed_launcher(me.ppid):
        kind = DEEPSPEED_LAUNCHER
    else:
        return None
    try:
        info = identity.probe(me.ppid)
    except identity.Unknown as e:
        logger.warning("peerwatch: rank %d does not watch its launcher (pid %d): %s", me.rank, me.ppid, e)
        return None  # not known: neither watched nor taken for gone
    if info is None or info.dead:
        return Launcher(me.ppid, 0, me.uid, kind)  # already gone
    return Launcher(info.pid, info.start_ticks, info.uid, kind)


_deepspeed_parents: Dict[int, bool] = {}  # ppid -> is DeepSpeed's launcher (read once: it may be gone later)


def is_deepspeed_launcher(pid: int) -> bool:
    """``pid`` runs ``python -m deepspeed.launcher.launch``, the process the ``deepspeed``
    command starts on each host to start and poll its workers. It sets no variable of its
    own that says so (``CROSS_RANK``, ``LOCAL_SIZE`` are generic names): its command line does."""
    known = _deepspeed_parents.get(pid)
    if known is None:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read(65536).split(b"\0")
        except OSError:
            return False  # gone, or not Linux: then it is not watched
        known = any(a == b"-m" and b == DEEPSPEED_MODULE.encode() for a, b in zip(args, args[1:]))
        _deepspeed_parents[pid] = known
    return known


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


def _launcher_gone(w: Ending, launcher: Launcher, exit_code: int) -> None:
    if w.is_over():
        return  # being torn down already, or done: the launcher's end is no news
    message = (
        f"its launcher ({launcher.kind}, pid {launcher.pid}) is gone; nothing would restart, "
        "reap or report this rank"
    )
    rank = w.me.rank
    logger.error("peerwatch: %s: %s. Failing this rank.", terminal.who(rank, os.getpid(), w.me.host), message)
    # The verdict on this failure ends the rank at once (its main thread is not leaving by
    # itself; rule: who stays).
    w.record_failure(Failure(
        rank=rank, pid=os.getpid(), time_ns=time.time_ns(), cause=LOST, exit_code=exit_code,
        exception=LAUNCHER_GONE, message=message,
    ))
    if not w.verdict_seen.wait(VERDICT_WAIT_S):
        logger.error("peerwatch: rank %d has no verdict %gs after losing its launcher; exiting", rank, VERDICT_WAIT_S)
        leave.flush_and_exit(exit_code)


# -- on verdict ----------------------------------------------------------------------


def add_verdict_listener(listener: VerdictListener) -> None:
    """Call ``listener(verdict)`` in the watcher thread when a verdict is known,
    before the teardown. It must be quick; its exceptions are logged and ignored."""
    with _listeners_lock:
        if listener not in _listeners:
            _listeners.append(listener)


def remove_verdict_listener(listener: VerdictListener) -> None:
    with _listeners_lock:
        if listener in _listeners:
            _listeners.remove(listener)


def on_verdict(verdict: Verdict) -> None:
    """Called by the watcher thread once it acts on a verdict. Never raises."""
    try:
        quiet_lightning_observer()
    except Exception:  # noqa: BLE001
        logger.exception("peerwatch: could not quiet Lightning's child process observer")
    with _listeners_lock:
        listeners = list(_listeners)
    for listener in listeners:
        try:
            listener(verdict)
        except Exception:  # noqa: BLE001 - a listener must never stop the teardown
            logger.exception("peerwatch: verdict listener %r failed", listener)


_watching: Callable[[], bool] = lambda: False  # noqa: E731 - this process's watcher runs (set below)


def defer_lightning_observer(watching: Callable[[], bool]) -> bool:
    """Have Lightning's ``_ChildProcessObserver``, once it found a rank ended, leave the job
    to peerwatch for up to :data:`LIGHTNING_DEFER_S` (while ``watching()``) before it
    SIGKILLs every process. Patched on its class, for observers started later too. True
    once Lightning's module is loaded and patched. A chore of every heartbeat: cheap, and
    once patched only ``watching`` is set again."""
    global _watching
    _watching = watching
    patched = False
    for name in _OBSERVER_MODULES:
        cls = getattr(sys.modules.get(name), "_ChildProcessObserver", None)
        if not isinstance(cls, type) or not hasattr(cls, "_terminate_all"):
            continue
        patched = True
        if not getattr(cls, "_peerwatch_defers", False):
            cls._terminate_all = _deferring(cls._terminate_all)  # type: ignore[attr-defined]
            cls._peerwatch_defers = True  # type: ignore[attr-defined]
    return patched


def _deferring(terminate_all: Callable[[Any], None]) -> Callable[[Any], None]:
    def deferred(observer: Any) -> None:
        deadline = time.monotonic() + LIGHTNING_DEFER_S
        while _watching() and time.monotonic() < deadline:
            time.sleep(LIGHTNING_DEFER_POLL_S)  # peerwatch ends this process meanwhile, as a rule
        terminate_all(observer)
    return deferred


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


def ends_workers_early(me: Registration, verdict: Verdict) -> bool:
    """Will this rank's launcher end it before its teardown is done? torchrun's agent and
    mp.spawn's main process SIGTERM the surviving workers as soon as they have seen the
    failed one: the report cannot wait for the end of the teardown."""
    return verdict.rank != me.rank and launcher_of(me, os.environ) is not None


def before_exit(me: Registration, run_dir: rundir.RunDir, verdict: Verdict) -> None:
    """Called by the watcher thread right before this rank exits. Never raises."""
    try:
        _let_agent_see_first(me, run_dir, verdict)
    except Exception:  # noqa: BLE001
        logger.exception("peerwatch: rank %d could not wait for its agent", me.rank)


def _let_agent_see_first(me: Registration, run_dir: rundir.RunDir, verdict: Verdict) -> None:
    launcher = launcher_of(me, os.environ)
    if verdict.rank == me.rank or launcher is None:
        return
    failed = run_dir.read(rundir.RANKS, rundir.rank_file("rank", verdict.rank), Registration)
    if failed is None or not is_local(failed) or failed.ppid != me.ppid:
        return  # not a sibling: our launcher has nothing to see
    if identity.same_process(me.ppid, launcher.start_ticks) is False:
        return  # the agent is gone
    wait_s = DEEPSPEED_AGENT_WAIT_S if launcher.kind == DEEPSPEED_LAUNCHER else AGENT_WAIT_S
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if _reaped(failed):
            logger.debug("peerwatch: rank %d: the agent reaped rank %d", me.rank, verdict.rank)
            return  # reaped: the agent saw it and is stopping the workers now
        time.sleep(AGENT_POLL_S)
    logger.debug("peerwatch: rank %d: the agent did not reap rank %d within %gs", me.rank, verdict.rank, wait_s)


def _reaped(reg: Registration) -> bool:
    """Its process is no more, not even a zombie: its parent has reaped it. False while that
    cannot be told (out of descriptors...)."""
    try:
        info = identity.probe(reg.pid)
    except identity.Unknown:
        return False
    return info is None or info.start_ticks != reg.start_ticks


__all__ = [
    "AGENT_WAIT_S", "DEEPSPEED_AGENT_WAIT_S", "DEEPSPEED_LAUNCHER", "LAUNCHER_GONE", "TORCHRUN_AGENT", "Launcher", "LauncherWatch", "add_verdict_listener", "after_install", "before_exit",
    "ends_workers_early", "is_deepspeed_launcher", "launcher_of", "on_verdict", "quiet_lightning_observer", "remove_verdict_listener",
]
