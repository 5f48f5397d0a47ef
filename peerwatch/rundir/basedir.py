"""Where run directories live on this host (:func:`base_dir`), and which one is this run's
(:func:`resolve`): every rank of a run computes the same, with no configuration.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import sys
from typing import Dict, Mapping, Optional, Set, Tuple

from ..core.errors import RunDirError
from ..core.records import Verdict
from ..proc import identity
from .rundir import EVENTS, RANKS, SPAWNED_RUN, VERDICT_FILE, RunDir, safe_name
from .trust import check_ancestors, check_trusted, private_dir

logger = logging.getLogger("peerwatch")


def base_dir() -> str:
    """Where run directories live on this host when nothing says otherwise: a place no
    other user can make, take or hold first, and the same for every rank of this user on
    this host (they all compute it). In order:

    1. ``$XDG_RUNTIME_DIR/peerwatch`` (or systemd's ``/run/user/<uid>``) where there is one
       of ours that nobody else can write;
    2. ``$XDG_CACHE_HOME/peerwatch`` (``~/.cache/peerwatch``), created 0700, where it is
       ours alone, its path safe from other users, and on a local filesystem (a home on
       NFS is shared by hosts: a run directory there would be taken for a shared one);
    3. a directory under ``$TMPDIR`` (or ``/tmp``) with an unpredictable name
       (``peerwatch-<uid>-<random>``, made 0700 by ``mkdtemp``), recorded per host in that
       per-user place (``<place>/bases/<host>-<n>``, first writer wins), so every rank
       finds the same one; one that another user took since (a ``/tmp`` cleaner removed it
       and they made its name) is passed over for the next record;
    4. only where no per-user place can be had (no usable home): the fixed names
       ``$TMPDIR/peerwatch-<uid>``, then ``-2`` ... ``-4``, with a warning naming a squatter.
    """
    return _choose_base(os.geteuid(), os.environ)


_squatters: Dict[str, str] = {}  # a base name another user took first -> why it cannot be used
_warned_bases: Set[str] = set()
TMP_BASES = 8  # records of /tmp bases tried per host before the fixed names
_LOCAL_FUSE = frozenset({"fuse-overlayfs", "fuse.fuse-overlayfs"})


def _choose_base(uid: int, env: Mapping[str, str]) -> str:
    for runtime in (env.get("XDG_RUNTIME_DIR", ""), f"/run/user/{uid}"):
        if runtime and private_dir(runtime):
            return os.path.join(runtime, "peerwatch")
    tmp = env.get("TMPDIR", "") or "/tmp"
    place = _user_place(env)
    if place is not None:
        if _local_fs(place):
            return place
        recorded = _recorded_tmp_base(place, tmp, uid)
        if recorded is not None:
            return recorded
    first = os.path.join(tmp, f"peerwatch-{uid}")
    for path in [first] + [f"{first}-{n}" for n in range(2, 5)]:
        why = _squatted(path)
        if why is None:
            if path != first:
                _warn_base_once(first, path)
            return path
        _squatters[path] = why
    return first  # every name taken: prepare() says why, loudly


def _user_place(env: Mapping[str, str]) -> Optional[str]:
    """``$XDG_CACHE_HOME/peerwatch`` (``$HOME/.cache/peerwatch``), made 0700 if need be; None
    if it cannot be ours alone (no home, a home others can rename, a read-only one)."""
    cache = env.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(cache):
        home = env.get("HOME", "")
        if not os.path.isabs(home):
            return None
        cache = os.path.join(home, ".cache")
    place = os.path.join(cache, "peerwatch")
    try:
        for folder in (cache, place):
            try:
                os.mkdir(folder, 0o700)
            except FileExistsError:
                pass
        check_ancestors(place)
        check_trusted(place)
    except (OSError, RunDirError) as e:
        logger.debug("peerwatch: %s cannot hold run directories: %s", place, e)
        return None
    return place


def _local_fs(path: str) -> bool:
    """Is ``path`` on a filesystem of this host alone (not NFS, Lustre, a FUSE mount...)?"""
    from ..core import mounts as _mounts

    try:
        with open(_mounts.MOUNTINFO) as f:
            mounts = _mounts.parse_mountinfo(f.read())
    except OSError:
        return True  # no mount table (not Linux): as before, a home is taken as local
    mount = _mounts.mount_of(os.path.realpath(path), mounts)
    if mount is None:
        return True
    fstype = mount.fstype
    return not (_mounts.is_network_fs(fstype) or (fstype.startswith("fuse") and fstype not in _LOCAL_FUSE))


def _recorded_tmp_base(place: str, tmp: str, uid: int) -> Optional[str]:
    """This host's base under ``tmp``, by an unpredictable name recorded in ``place`` (the
    first record of this host whose directory is ours, or can be made again); None if
    none can be had."""
    records = os.path.join(place, "bases")
    host = safe_name(identity.hostname())
    try:
        os.mkdir(records, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    for n in range(TMP_BASES):
        record = os.path.join(records, f"{host}-{n}")
        path = _read_base_record(record)
        if path is None:
            path = _propose_base(records, record, tmp, uid)
            if path is None:
                return None
        try:
            os.mkdir(path, 0o700)  # removed since (a /tmp cleaner, a reboot): the same name again
        except FileExistsError:
            pass
        except OSError:
            continue
        if private_dir(path):
            return path
        why = _squatted(path) or "cannot be used"
        if path not in _warned_bases:
            _warned_bases.add(path)
            logger.warning("peerwatch: the run directory base %s %s (another user made it after it was "
                           "removed); passing over it", path, why)
    return None


def _read_base_record(record: str) -> Optional[str]:
    try:
        fd = os.open(record, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.read(fd, 4096).decode("utf-8", "replace").strip()
    finally:
        os.close(fd)
    return data if os.path.isabs(data) and "\0" not in data else None


def _propose_base(records: str, record: str, tmp: str, uid: int) -> Optional[str]:
    """Make a directory by an unpredictable name under ``tmp`` and record it as this host's
    (link(2): the first writer wins); the one recorded."""
    import tempfile

    try:
        made = tempfile.mkdtemp(prefix=f"peerwatch-{uid}-", dir=tmp)
    except OSError as e:
        logger.debug("peerwatch: cannot make a run directory base under %s: %s", tmp, e)
        return None
    temp = None
    try:
        fd, temp = tempfile.mkstemp(dir=records, prefix=".record-")
        with os.fdopen(fd, "wb") as f:
            f.write(made.encode() + b"\n")
        os.link(temp, record)
        return made
    except FileExistsError:
        os.rmdir(made)  # another rank of ours recorded one first: that one
        return _read_base_record(record)
    except OSError as e:
        logger.debug("peerwatch: cannot record the run directory base %s in %s: %s", made, records, e)
        os.rmdir(made)
        return None
    finally:
        if temp is not None:
            with contextlib.suppress(OSError):
                os.unlink(temp)


def _squatted(path: str) -> Optional[str]:
    """Why ``path`` cannot be our base (None: it is ours, or free for us to make)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return f"is a symbolic link owned by uid {st.st_uid}"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}"
    if st.st_mode & 0o022:
        return f"is group- or world-writable (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _warn_base_once(first: str, chosen: str) -> None:
    if chosen in _warned_bases:
        return
    _warned_bases.add(chosen)
    logger.warning("peerwatch: %s %s (another user made it first); run directories go to %s instead. Set "
                   "XDG_RUNTIME_DIR or PEERWATCH_DIR to a directory of yours to avoid this",
                   first, _squatters.get(first, "cannot be used"), chosen)


NEW_RUN = "new run led by this process"  # resolve()'s `how` when nothing in the environment names a run
OWNER_VAR = "PEERWATCH_DIR_OWNER"  # "<pid>.<start ticks>" of the install() that exported PEERWATCH_DIR


def resolve(run_dir: Optional[str], env: Mapping[str, str]) -> Tuple[str, str]:
    """Pick this run's directory so that all ranks of one run agree, with no configuration.

    Returns ``(path, how)``. The rule, first match wins:

    ======================================  ==================================================
    what the environment says               run directory (under :func:`base_dir`)
    ======================================  ==================================================
    ``PEERWATCH_DIR`` / ``run_dir=``        that directory (also how rank 0 tells its children)
    the same, exported by ``install()`` in  ``<that directory>/spawn``: the parent launched
    the parent of a multiprocessing child   this rank (``mp.spawn``); it is not one of its peers
    torchrun: ``TORCHELASTIC_RUN_ID``       ``torchrun-<run id>-<agent pid>.<agent start>-r<restart>``
    a multiprocessing child (``mp.spawn``)  ``spawn-<parent pid>.<parent start>``
    Slurm: ``SLURM_JOB_ID``                 ``slurm-<job id>.<step id>``
    ``MASTER_ADDR`` and ``MASTER_PORT``     ``master-<addr>-<port>-<parent pid>.<parent start>``
    nothing                                 ``run-<pid>.<start>``: a new run led by this process
    ======================================  ==================================================

    A multiprocessing child only gets this far when it was given ``rank=`` (a DataLoader
    worker never installs), so it is a rank started by ``torch.multiprocessing.spawn`` (or
    Lightning's ``ddp_spawn``), and its siblings share its parent.

    A derived name already holding an earlier run that ended before this process started
    (a verdict, or every rank's success marker, and none of its processes alive) gets
    ``-2``, ``-3``, ...: two runs from one shell keep their own evidence, and every rank
    of the new run, judging the same directories, lands in the same one.
    """
    path, how = _derived(run_dir, env)
    if how in ("PEERWATCH_DIR", "multiprocessing child of a launcher that installed peerwatch"):
        return path, how
    return _past_ended_runs(path), how


def _derived(run_dir: Optional[str], env: Mapping[str, str]) -> Tuple[str, str]:
    spawned = is_multiprocessing_child()
    if run_dir:
        if spawned and env.get(OWNER_VAR) == _parent_key() and env.get("PEERWATCH_DIR") == run_dir:
            return os.path.join(run_dir, SPAWNED_RUN), "multiprocessing child of a launcher that installed peerwatch"
        return run_dir, "PEERWATCH_DIR"
    base = base_dir()
    parent = _parent_key()
    if env.get("TORCHELASTIC_RUN_ID"):
        restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
        name = f"torchrun-{safe_name(env['TORCHELASTIC_RUN_ID'])}-{parent}-r{safe_name(restart)}"
        return os.path.join(base, name), "torchrun (TORCHELASTIC_RUN_ID)"
    if spawned:
        return os.path.join(base, f"spawn-{parent}"), "multiprocessing child (torch.multiprocessing.spawn)"
    if env.get("SLURM_JOB_ID"):
        step = env.get("SLURM_STEP_ID", "batch")
        return os.path.join(base, f"slurm-{safe_name(env['SLURM_JOB_ID'])}.{safe_name(step)}"), "Slurm (SLURM_JOB_ID)"
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        name = f"master-{safe_name(env['MASTER_ADDR'])}-{safe_name(env['MASTER_PORT'])}-{parent}"
        return os.path.join(base, name), "MASTER_ADDR/MASTER_PORT and parent process"
    me = identity.self_info()
    return os.path.join(base, f"run-{me.pid}.{me.start_ticks}"), NEW_RUN


MAX_RUNS_PER_NAME = 1000  # -2 ... -1000; then the last one is set aside as before


def _past_ended_runs(path: str) -> str:
    """``path``, or the first of ``path-2``, ``path-3``, ... not holding an earlier run that ended."""
    started = identity.started()
    candidate = path
    for n in range(2, MAX_RUNS_PER_NAME + 1):
        if not _ended_before(candidate, started):
            return candidate
        candidate = f"{path}-{n}"
    return candidate


def _ended_before(path: str, started: identity.Started) -> bool:
    """``path`` holds a run that ended before this process ``started``: registered ranks, none
    alive, and a verdict or every rank's success marker, from before then (or all of them of
    an earlier boot). Anything else (no such
    directory, a live or unfinished run, one we cannot read) is left to :func:`peerwatch.rundir.prepare.prepare`."""
    try:
        if not os.path.isdir(os.path.join(path, RANKS)) or os.path.islink(path):
            return False
        rd = RunDir(path)
        regs = rd.registrations()
        if not regs or any(identity.seems_alive(r) for r in regs.values()):
            return False
        if all(r.boot_id != identity.boot_id() for r in regs.values()):
            return True
        verdict = rd.read(EVENTS, VERDICT_FILE, Verdict)
        if verdict is not None:
            return verdict.made_before(*started)
        successes = rd.successes()
        return all(r in successes and successes[r].time_ns < started.wall_ns for r in regs)
    except OSError:
        return False


def process_key(pid: int) -> str:
    """``"<pid>.<start ticks>"``: names a process for as long as the machine is up."""
    info = identity.probe(pid)
    return f"{pid}.{info.start_ticks if info else 0}"


def is_multiprocessing_child() -> bool:
    """A process started by multiprocessing (an ``mp.spawn`` worker, a DataLoader worker).

    Also while it is being prepared, before its target runs: a child started by "spawn" or
    "forkserver" imports the parent's main module again (as ``__mp_main__``), so an
    ``install()`` at the top of the script runs there before ``parent_process()`` is set
    (multiprocessing sets ``_inheriting`` on the process meanwhile)."""
    mp = sys.modules.get("multiprocessing")  # not imported: this cannot be a multiprocessing child
    if mp is None:
        return False
    return mp.parent_process() is not None or bool(getattr(mp.current_process(), "_inheriting", False))


def _parent_key() -> str:
    return process_key(os.getppid())


__all__ = ["NEW_RUN", "OWNER_VAR", "base_dir", "is_multiprocessing_child", "process_key", "resolve"]
