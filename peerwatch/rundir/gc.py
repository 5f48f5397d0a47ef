"""Garbage collection of finished run directories under the default base.

The policy, :func:`gc_plan`, is a pure function of what a scan found; :func:`collect` scans,
plans and removes. Rules, first match wins, for each entry of :func:`basedir.base_dir`:

1. not a real directory owned by this user (a symbolic link, a file, another user's
   folder): never touched, never followed;
2. a ``.gc-trash-*`` directory (a removal that was interrupted): removed;
3. not a run directory (no ``ranks/`` folder; one set aside, ``*.stale-*``, is one): not
   ours to judge, kept;
4. the run directory named by ``PEERWATCH_DIR`` in this environment: kept;
5. a registration whose process is alive (pid + start time + uid), or one of another host
   or PID namespace (it cannot be seen, so it is taken as alive): kept;
6. activity (the newest mtime of the directory, its folders and their files) within
   ``MIN_AGE_S``: kept (a run being created has no registration yet);
7. last activity older than ``PEERWATCH_GC_AGE`` seconds (default 7 days): removed;
8. beyond the ``PEERWATCH_GC_KEEP`` newest finished runs (default 50): removed;
9. otherwise kept.

Either setting may be ``off``. Only the default base is ever collected: a run directory
given with ``PEERWATCH_DIR`` (or ``run_dir=``) is the user's to keep or remove. A lock file
(``NAME.lock``) beside no directory is removed once older than ``LOCK_AGE_S``. A directory
is removed under its lock (the one ``prepare.prepare`` takes), checked again, renamed to
``.gc-trash-*`` (from then on no run finds it by name), then deleted without following links.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import stat
import time
from typing import Iterable, List, Mapping, Optional, Sequence

from ..core.errors import RunDirError
from ..core.records import Registration
from ..proc import identity
from .basedir import base_dir
from .rundir import RANKS, RunDir
from .trust import check_trusted

logger = logging.getLogger("peerwatch")

KEEP_VAR, AGE_VAR = "PEERWATCH_GC_KEEP", "PEERWATCH_GC_AGE"
DEFAULT_KEEP = 50  # finished run directories kept, newest first
DEFAULT_AGE_S = 7 * 24 * 3600.0  # finished run directories older than this go
MIN_AGE_S = 60.0  # a directory touched this recently is never removed (a run being created)
LOCK_AGE_S = 3600.0  # an orphan lock file older than this goes
_LOCK_OF_A_DIR = "the lock of a directory that exists"  # kept with it: not said line by line
AUTO_EVERY_S = 3600.0  # install() collects at most this often per base (a stamp file says when)
STAMP = ".gc-stamp"
STALE_MARK = ".stale-"  # prepare's suffix for a directory set aside
TRASH = ".gc-trash-"  # a directory being removed is first renamed to this prefix (atomic)

REMOVE, KEEP = "remove", "keep"


@dataclasses.dataclass(frozen=True)
class Entry:
    """What a scan found about one name in the base."""

    path: str
    # "run", "stale" (set aside), "trash" (an interrupted removal), "lock", "other" (not ours
    # to judge), "link", "foreign"
    kind: str
    last_activity: float = 0.0  # newest mtime, seconds since the epoch
    live: Optional[str] = None  # why it is (or may be) in use, or None
    sibling_dir: bool = False  # for a lock file: its directory exists


@dataclasses.dataclass(frozen=True)
class GcDecision:
    path: str
    action: str  # REMOVE or KEEP
    reason: str


@dataclasses.dataclass(frozen=True)
class GcPolicy:
    keep: Optional[int] = DEFAULT_KEEP  # None: no count limit
    age_s: Optional[float] = DEFAULT_AGE_S  # None: no age limit


def policy_from_env(env: Mapping[str, str]) -> GcPolicy:
    """The policy ``PEERWATCH_GC_KEEP`` / ``PEERWATCH_GC_AGE`` say; raises ValueError naming
    the variable for a value that is neither a non-negative number nor ``off``."""

    def read(var: str, default: float) -> Optional[float]:
        text = env.get(var, "").strip()
        if not text:
            return default
        if text.lower() == "off":
            return None
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{var}={text!r}: expected a number or 'off'") from None
        if value < 0 or value != value:
            raise ValueError(f"{var}={text!r}: expected a number >= 0 or 'off'")
        return value

    keep = read(KEEP_VAR, DEFAULT_KEEP)
    return GcPolicy(keep=None if keep is None else int(keep), age_s=read(AGE_VAR, DEFAULT_AGE_S))


def _age(seconds: float) -> str:
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:.1f} days"
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:.1f} hours"
    return f"{seconds:.0f} s"


def gc_plan(entries: Sequence[Entry], policy: GcPolicy, now: float) -> List[GcDecision]:
    """The decision for every entry (rules in the module's docstring). Pure."""
    decisions = {}
    finished = []
    for e in entries:
        if e.kind == "link":
            decisions[e.path] = GcDecision(e.path, KEEP, "a symbolic link: never followed")
        elif e.kind == "foreign":
            decisions[e.path] = GcDecision(e.path, KEEP, "not a directory owned by this user")
        elif e.kind == "other":
            decisions[e.path] = GcDecision(e.path, KEEP, "not a peerwatch run directory")
        elif e.kind == "trash":
            decisions[e.path] = GcDecision(e.path, REMOVE, "left by a removal that was interrupted")
        elif e.kind == "lock":
            if e.sibling_dir:
                decisions[e.path] = GcDecision(e.path, KEEP, _LOCK_OF_A_DIR)
            elif now - e.last_activity > LOCK_AGE_S:
                decisions[e.path] = GcDecision(e.path, REMOVE, f"a lock file of no directory, unused for {_age(now - e.last_activity)}")
            else:
                decisions[e.path] = GcDecision(e.path, KEEP, "a lock file used recently")
        elif e.live is not None:
            decisions[e.path] = GcDecision(e.path, KEEP, e.live)
        elif now - e.last_activity < MIN_AGE_S:
            decisions[e.path] = GcDecision(e.path, KEEP, f"active within the last {MIN_AGE_S:.0f} s")
        else:
            finished.append(e)
    finished.sort(key=lambda e: e.last_activity, reverse=True)  # newest first
    for i, e in enumerate(finished):
        idle = now - e.last_activity
        what = "set aside" if e.kind == "stale" else "finished"
        if policy.age_s is not None and idle > policy.age_s:
            decisions[e.path] = GcDecision(e.path, REMOVE, f"{what}, idle for {_age(idle)} (over {AGE_VAR}={_age(policy.age_s)})")
        elif policy.keep is not None and i >= policy.keep:
            decisions[e.path] = GcDecision(
                e.path, REMOVE, f"{what}, idle for {_age(idle)}; {i} newer finished runs (over {KEEP_VAR}={policy.keep})"
            )
        else:
            decisions[e.path] = GcDecision(e.path, KEEP, f"{what}, idle for {_age(idle)}; within the policy")
    return [decisions[e.path] for e in entries]


# -- scanning ------------------------------------------------------------------------


def last_activity(path: str) -> float:
    """When the run at ``path`` last changed: the newest mtime of the directory, its entries
    and their entries (never followed), so a heartbeat rewritten in ``heartbeats/`` counts
    (the directory's own mtime does not move while a run only rewrites its records).
    Raises OSError when ``path`` cannot be read."""
    newest = os.lstat(path).st_mtime
    try:
        with os.scandir(path) as it:
            children = list(it)
    except OSError:
        return newest
    for child in children:
        try:
            newest = max(newest, child.stat(follow_symlinks=False).st_mtime)
            if child.is_dir(follow_symlinks=False):
                with os.scandir(child.path) as inner:
                    for grandchild in inner:
                        newest = max(newest, grandchild.stat(follow_symlinks=False).st_mtime)
        except OSError:
            continue
    return newest


def live_registrations(path: str) -> List[Registration]:
    """The registrations of the run at ``path`` (or of the run nested in its ``spawn/``)
    whose process may be in use, this host's first: a local one is alive and verified
    (pid + start time + uid, :func:`identity.seems_alive`); one of another host or PID
    namespace cannot be seen, so it is listed too (``identity.is_local`` tells them apart).
    Raises OSError when ``path`` cannot be read."""
    found: List[Registration] = []
    for where in (path, os.path.join(path, "spawn")):
        if os.path.islink(where) or not os.path.isdir(os.path.join(where, RANKS)):
            continue
        found.extend(reg for reg in RunDir(where).registrations().values() if identity.seems_alive(reg))
    return sorted(found, key=lambda reg: not identity.is_local(reg))


def _live(path: str) -> Optional[str]:
    """Why the run at ``path`` (or the run nested in its ``spawn/``) may be in use, or None."""
    for reg in live_registrations(path)[:1]:
        if identity.is_local(reg):
            return f"rank {reg.rank} (pid {reg.pid}) is alive"
        return f"rank {reg.rank} is registered from host {reg.host} ({reg.pidns}), whose processes cannot be seen from here"
    return None


def scan(base: str, env: Mapping[str, str]) -> List[Entry]:
    """Every name in ``base``, classified. ``base`` must be trusted (see :func:`collect`)."""
    current = env.get("PEERWATCH_DIR", "")
    current = os.path.abspath(current) if current else ""
    entries = []
    try:
        names = sorted(os.listdir(base))
    except FileNotFoundError:
        return []
    uid = os.geteuid()
    for name in names:
        if name == STAMP:
            continue
        path = os.path.join(base, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            entries.append(Entry(path, "link"))
            continue
        if st.st_uid != uid:
            entries.append(Entry(path, "foreign"))
            continue
        if name.endswith(".lock") and stat.S_ISREG(st.st_mode):
            entries.append(Entry(path, "lock", st.st_mtime, sibling_dir=os.path.lexists(path[: -len(".lock")])))
            continue
        if not stat.S_ISDIR(st.st_mode):
            entries.append(Entry(path, "other"))
            continue
        if name.startswith(TRASH):
            entries.append(Entry(path, "trash", st.st_mtime))
            continue
        stale = STALE_MARK in name
        if not os.path.isdir(os.path.join(path, RANKS)):
            entries.append(Entry(path, "other"))
            continue
        live = None
        if current and (current == path or current.startswith(path + os.sep)):
            live = "the run directory of this environment (PEERWATCH_DIR)"
        try:
            live = live or _live(path)
            activity = last_activity(path)
        except OSError as e:
            live, activity = f"cannot be read ({e.strerror})", time.time()
        entries.append(Entry(path, "stale" if stale else "run", activity, live))
    return entries


# -- removing ------------------------------------------------------------------------


def _trash(path: str) -> None:
    """Rename ``path`` out of the way (atomic: no run can find it by its name any more),
    then remove it; an interrupted removal leaves a ``.gc-trash-*`` for the next gc."""
    trash = os.path.join(os.path.dirname(path), f"{TRASH}{time.time_ns()}")
    os.rename(path, trash)
    shutil.rmtree(trash)  # never follows symbolic links (shutil.rmtree.avoids_symlink_attacks)


def _remove(entry: Entry, env: Mapping[str, str]) -> Optional[str]:
    """Remove ``entry``; None when done, else why it was not (it changed under us)."""
    if entry.kind == "lock":
        os.unlink(entry.path)
        return None
    if entry.kind != "run":  # set aside or trash: no run prepares it, so no lock to take
        _trash(entry.path)
        return None
    import filelock

    # The same lock prepare() holds while it creates or sets aside this directory: a run
    # starting in it now either finishes preparing first (and is seen alive below) or waits.
    lock = filelock.FileLock(entry.path + ".lock", timeout=0)
    try:
        with lock:
            again = [e for e in scan(os.path.dirname(entry.path), env) if e.path == entry.path]
            if not again or any(d.action != REMOVE for d in gc_plan(again, GcPolicy(keep=0, age_s=None), time.time())):
                return "it is in use again"
            _trash(entry.path)
    except filelock.Timeout:
        return "its lock is held"
    return None


def collect(dry_run: bool = False, env: Optional[Mapping[str, str]] = None, now: Optional[float] = None) -> List[GcDecision]:
    """Remove the finished run directories under the default base that the policy says
    go (``dry_run``: only say which). Returns every decision, the removed ones first.
    Raises :class:`RunDirError` when the base is not trusted, ValueError for a bad setting."""
    env = os.environ if env is None else env
    policy = policy_from_env(env)
    base = base_dir()
    if not os.path.lexists(base):
        return []
    check_trusted(base)
    decisions = gc_plan(scan(base, env), policy, time.time() if now is None else now)
    done = []
    for d in decisions:
        if d.action != REMOVE or dry_run:
            continue
        entries = [e for e in scan(base, env) if e.path == d.path]
        why_not = None if entries else "it is gone"
        if entries:
            try:
                why_not = _remove(entries[0], env)
            except OSError as e:
                why_not = f"removing it failed ({e.strerror})"
        if why_not is None:
            logger.info("peerwatch: gc removed %s: %s", d.path, d.reason)
            done.append(d)
        else:
            done.append(GcDecision(d.path, KEEP, f"not removed: {why_not}"))
    changed = {d.path: d for d in done}
    result = [changed.get(d.path, d) for d in decisions]
    return sorted(result, key=lambda d: d.action != REMOVE)


_auto_done = False


def auto(how: str) -> None:
    """The policy, applied once per process by ``install()`` when the run directory was
    chosen under the default base (``how`` is not ``PEERWATCH_DIR``), and at most once per
    ``AUTO_EVERY_S`` per base. Best effort: logs, never raises."""
    global _auto_done
    if _auto_done or how == "PEERWATCH_DIR":
        return
    _auto_done = True
    try:
        check_trusted(base_dir())
        stamp = os.path.join(base_dir(), STAMP)
        try:
            st = os.lstat(stamp)
            if stat.S_ISREG(st.st_mode) and time.time() - st.st_mtime < AUTO_EVERY_S:
                return
        except FileNotFoundError:
            pass
        fd = os.open(stamp, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.utime(fd)
        finally:
            os.close(fd)
        removed = [d for d in collect() if d.action == REMOVE]
        if removed:
            logger.info("peerwatch: gc removed %d finished run directories under %s", len(removed), base_dir())
    except (OSError, ValueError, RunDirError) as e:
        logger.warning("peerwatch: gc of old run directories skipped: %s", e)
    except Exception:  # noqa: BLE001 - never let housekeeping break install()
        logger.exception("peerwatch: gc of old run directories failed")


def describe(decisions: Iterable[GcDecision], dry_run: bool) -> List[str]:
    """One line per decision, for ``peerwatch gc``."""
    lines = []
    for d in decisions:
        if d.action == KEEP and d.reason == _LOCK_OF_A_DIR:
            continue  # every run has one: its directory's line says what happens to both
        verb = ("would remove" if dry_run else "removed") if d.action == REMOVE else "kept"
        lines.append(f"{verb:<12} {d.path}: {d.reason}")
    return lines


__all__ = [
    "AGE_VAR", "DEFAULT_AGE_S", "DEFAULT_KEEP", "KEEP_VAR", "Entry", "GcDecision", "GcPolicy", "auto", "collect",
    "describe", "gc_plan", "last_activity", "live_registrations", "policy_from_env", "scan",
]
