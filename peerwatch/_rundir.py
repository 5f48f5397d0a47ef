"""The run directory: where it is, whether to trust it, and reading/writing its records.

Layout (per host)::

    RUN/ranks/rank-00003.json       registration (pid file)
    RUN/events/success-00003.json   success marker            \\
    RUN/events/failure-00003.json   failure record             | watched by inotify;
    RUN/events/exit-00003.json      exit status seen by parent | created by link(2), so
    RUN/events/ack-00003.json       "I saw the verdict"        | they appear complete
    RUN/events/verdict.json         the verdict (first wins)  /
    RUN/heartbeats/rank-00003.json  liveness and progress (rewritten in place, see InPlace)
    RUN/stacks/rank-00003.txt       Python stacks dumped at teardown
    RUN/flight_recorder/rank_3      torch's flight recorder, as its analyzer reads it (peerwatch._frdump)
    RUN/report.json                 the report
    RUN/tmp/                        temp files; records are written here first

Records are written to ``tmp/`` and then linked (write-once records) or renamed into
place: a reader never sees half a record. The heartbeat, rewritten every second, is the
exception (:class:`InPlace`): readers re-read one they catch half written. Records in ``events/`` are
linked rather than renamed because watchdog holds back rename events for half a second
to pair them.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import stat
import sys
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Set, Tuple, Type, TypeVar

from . import _identity
from ._errors import RunDirError
from ._records import MAX_RECORD_BYTES, Registration, Success, Verdict, decode, encode, named_ranks

logger = logging.getLogger("peerwatch")

RANKS, EVENTS, HEARTBEATS, STACKS, TMP = "ranks", "events", "heartbeats", "stacks", "tmp"
VERDICT_FILE = "verdict.json"
DIAGNOSIS_FILE = "diagnosis.json"  # events/: why the job stopped moving (peerwatch._diagnose)
# This host's stall as its hang judges see it (peerwatch._summary), for the store bridge to
# publish, and the other hosts' stalls as the bridge read them, for the judges.
STALL_FILE = "stall.json"
REMOTE_STALLS_FILE = "stalls-remote.json"
# Stragglers (peerwatch._stragglerwatch): this host's ranks' waits, for the bridge to
# publish; the other hosts' as host 0's bridge read them; the finding (status, report).
STRAGGLE_FILE = "straggle.json"
STRAGGLE_HOSTS_FILE = "straggle-hosts.json"
STRAGGLERS_FILE = "stragglers.json"
# torch's flight-recorder dumps, one file per rank, named as torch's analyzer expects
# (``<prefix><rank>``, the prefix common to every file of the folder, which holds nothing else).
FLIGHT_RECORDER = "flight_recorder"
_FR_PREFIX = "rank_"
REPORT_FILE = "report.json"
# RUN/claims/summary: created by the rank that printed the summary, once it is out (the other
# ranks say their one line after it: rule 4 of peerwatch._plan).
SUMMARY_FILE = "summary"
WARN_EACH = 10  # bad files warned about one by one, per folder, record kind and reason; then one summary
_SUBDIRS = (RANKS, EVENTS, HEARTBEATS, STACKS, TMP)

R = TypeVar("R")


def rank_file(prefix: str, rank: int, suffix: str = ".json") -> str:
    return f"{prefix}-{rank:05d}{suffix}"


def stack_name(rank: int) -> str:
    """The name of rank ``rank``'s stack file in ``stacks/``: its one home."""
    return rank_file("rank", rank, ".txt")


def fr_dump_name(rank: int) -> str:
    """The name of rank ``rank``'s flight-recorder dump in ``flight_recorder/``: its one home."""
    return f"{_FR_PREFIX}{rank}"


def parse_fr_dump_name(name: str) -> Optional[int]:
    """``"rank_3"`` -> 3; anything else -> None."""
    number = name[len(_FR_PREFIX):] if name.startswith(_FR_PREFIX) else ""
    return int(number) if number.isdigit() and len(number) <= 9 else None


def parse_rank_file(name: str) -> Optional[Tuple[str, int]]:
    """``"failure-00003.json"`` -> ``("failure", 3)``; anything else -> ``None``."""
    stem, dot, ext = name.rpartition(".")
    if not dot or ext not in ("json", "txt"):
        return None
    prefix, dash, number = stem.rpartition("-")
    if not dash or not number.isdigit() or len(number) > 9:
        return None
    return prefix, int(number)


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
        if runtime and _private_dir(runtime):
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
    from . import _mounts

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
    host = _safe(_identity.hostname())
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
        if _private_dir(path):
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


def _private_dir(path: str) -> bool:
    """A real directory of ours that nobody else can write to."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


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
# The run of the multiprocessing children (mp.spawn's workers) of a process that installed
# peerwatch: <that process's run directory>/spawn.
SPAWNED_RUN = "spawn"


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
        name = f"torchrun-{_safe(env['TORCHELASTIC_RUN_ID'])}-{parent}-r{_safe(restart)}"
        return os.path.join(base, name), "torchrun (TORCHELASTIC_RUN_ID)"
    if spawned:
        return os.path.join(base, f"spawn-{parent}"), "multiprocessing child (torch.multiprocessing.spawn)"
    if env.get("SLURM_JOB_ID"):
        step = env.get("SLURM_STEP_ID", "batch")
        return os.path.join(base, f"slurm-{_safe(env['SLURM_JOB_ID'])}.{_safe(step)}"), "Slurm (SLURM_JOB_ID)"
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        name = f"master-{_safe(env['MASTER_ADDR'])}-{_safe(env['MASTER_PORT'])}-{parent}"
        return os.path.join(base, name), "MASTER_ADDR/MASTER_PORT and parent process"
    me = _identity.self_info()
    return os.path.join(base, f"run-{me.pid}.{me.start_ticks}"), NEW_RUN


MAX_RUNS_PER_NAME = 1000  # -2 ... -1000; then the last one is set aside as before


def _past_ended_runs(path: str) -> str:
    """``path``, or the first of ``path-2``, ``path-3``, ... not holding an earlier run that ended."""
    started_ns = _identity.start_time_ns()
    candidate = path
    for n in range(2, MAX_RUNS_PER_NAME + 1):
        if not _ended_before(candidate, started_ns):
            return candidate
        candidate = f"{path}-{n}"
    return candidate


def _ended_before(path: str, started_ns: int) -> bool:
    """``path`` holds a run that ended before ``started_ns``: registered ranks, none alive,
    and a verdict or every rank's success marker, from before then. Anything else (no such
    directory, a live or unfinished run, one we cannot read) is left to :meth:`RunDir.prepare`."""
    try:
        if not os.path.isdir(os.path.join(path, RANKS)) or os.path.islink(path):
            return False
        rd = RunDir(path)
        regs = rd.registrations()
        if not regs or any(_identity.seems_alive(r) for r in regs.values()):
            return False
        verdict = rd.read(EVENTS, VERDICT_FILE, Verdict)
        if verdict is not None:
            return verdict.detected_at_ns < started_ns
        successes = rd._successes()
        return all(r in successes and successes[r].time_ns < started_ns for r in regs)
    except OSError:
        return False


def process_key(pid: int) -> str:
    """``"<pid>.<start ticks>"``: names a process for as long as the machine is up."""
    info = _identity.probe(pid)
    return f"{pid}.{info.start_ticks if info else 0}"


def is_multiprocessing_child() -> bool:
    mp = sys.modules.get("multiprocessing")  # not imported: this cannot be a multiprocessing child
    return mp is not None and mp.parent_process() is not None


def _parent_key() -> str:
    return process_key(os.getppid())


def _safe(text: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "._" else "_" for c in text)
    return cleaned[:64] or "_"


def safe_name(text: str) -> str:
    """``text`` made safe for a file name: letters, digits, ``.`` and ``_``; at most 64 characters."""
    return _safe(text)


def check_trusted(path: str) -> None:
    """Raise :class:`RunDirError` unless path is a real directory, ours, not group/world-writable."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise RunDirError(path, f"cannot be read ({e.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        raise RunDirError(path, "is a symbolic link; refusing to follow it")
    _check_own_dir(path, st)


def _check_own_dir(path: str, st: os.stat_result) -> None:
    if not stat.S_ISDIR(st.st_mode):
        raise RunDirError(path, "is not a directory")
    if st.st_uid != os.geteuid():
        raise RunDirError(path, f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
    if st.st_mode & 0o022:
        raise RunDirError(path, f"is group- or world-writable (mode {stat.S_IMODE(st.st_mode):o})")


def check_ancestors(path: str) -> None:
    """Raise :class:`RunDirError` unless no other user can rename ``path`` or any folder above it.

    OpenSSH's rule for a secure path, applied to every component of ``path`` as written
    and as resolved (``realpath``): each one is owned by root or by this user, and one that
    is group- or world-writable has the sticky bit (as ``/tmp``), so that only its owner,
    root and the owner of an entry can rename that entry. A symlink on the way must be
    owned by root or by this user too (in a sticky folder its owner can replace it). A
    component that does not exist yet is skipped: it will be created by this user.
    """
    me = os.geteuid()
    absolute = os.path.abspath(path)
    seen: Set[str] = set()
    for candidate in (absolute, os.path.realpath(absolute)):
        for part in _prefixes(candidate):
            if part in seen:
                continue
            seen.add(part)
            try:
                st = os.lstat(part)
            except FileNotFoundError:
                continue
            except OSError as e:
                raise RunDirError(part, f"cannot be read ({e.strerror}), so the run directory below it cannot be trusted") from None
            if st.st_uid not in (0, me):
                raise RunDirError(
                    part,
                    f"is owned by uid {st.st_uid}, not by root or this user (uid {me}): that user could "
                    "swap the run directory below it for their own; choose a PEERWATCH_DIR under a folder of "
                    "yours (the default base, under $XDG_RUNTIME_DIR or ~/.cache, is)",
                )
            if stat.S_ISLNK(st.st_mode):
                continue
            if not stat.S_ISDIR(st.st_mode):
                raise RunDirError(part, "is not a directory")
            if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
                raise RunDirError(
                    part,
                    f"is group- or world-writable without the sticky bit (mode {stat.S_IMODE(st.st_mode):o}): "
                    "others could swap the run directory below it for their own; choose a PEERWATCH_DIR "
                    "under a folder only you can write",
                )


def _prefixes(path: str) -> List[str]:
    """``/a/b/c`` -> ``["/", "/a", "/a/b", "/a/b/c"]``."""
    out = []
    while True:
        out.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            return out[::-1]
        path = parent


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_regular(path: str, flags: int, mode: int = 0o600, dir_fd: Optional[int] = None) -> int:
    """``os.open`` for a file peerwatch keeps in a run directory: never through a symlink
    (``O_NOFOLLOW``), never blocking (``O_NONBLOCK``: a FIFO without its other end fails at
    once, ENXIO, instead of hanging the caller), and only a regular file (a FIFO, a device,
    a socket there is refused: OSError EINVAL "not a regular file"). Raises OSError."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ENXIO:  # a FIFO with no reader (or a device without its driver)
            raise OSError(errno.EINVAL, "not a regular file (a FIFO, a device or a socket)") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file (a FIFO, a device or a socket)")
    except BaseException:
        os.close(fd)
        raise
    return fd

_FD_ROOT = "/proc/self/fd"  # where a path through a held descriptor starts (Linux)
_HAVE_FD_PATHS = os.path.isdir(_FD_ROOT)


def same_job(a: Registration, b: Registration) -> bool:
    """Could ``a`` and ``b`` be ranks of one job? Not when both know the world size and
    the sizes differ (two jobs given one directory), or a rank lies outside it."""
    if a.world_size is not None and b.world_size is not None and a.world_size != b.world_size:
        return False
    size = a.world_size or b.world_size
    return size is None or (a.rank < size and b.rank < size)


def stale_because(
    reg: Registration, mine: Optional[Registration], regs: Mapping[int, Registration], live: bool,
    successes: Mapping[int, Success], process_start_ns: int, verdict: Optional[Verdict],
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
    if verdict is not None and verdict.detected_at_ns < process_start_ns:
        return "it holds a verdict from before this process started"
    if regs and all(r in successes and successes[r].time_ns < process_start_ns for r in regs):
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
    if _private_dir(os.path.dirname(path)):
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


class RunDir:
    """One run directory on this host. Reads are tolerant; writes are atomic.

    Once :meth:`prepare` has made and checked the directory, it is held by a descriptor
    (and so is each of its folders): every later read, write and listing goes through
    those descriptors, never through the path again, so a directory renamed away and
    replaced by another (by a user who can write a folder above it) is never read from or
    written to. A RunDir that was not prepared (``peerwatch report``, tests) opens the
    directory by its path for each operation, never following a symlink at its end.
    Paths that :meth:`join` and :meth:`stack_path` give are for people (logs, the report);
    code that must open something by path uses :meth:`at`, and code that needs a
    descriptor or a file's metadata :meth:`open_file`, :meth:`open_folder`, :meth:`stat`,
    :meth:`exists`, :meth:`names` and :meth:`inodes` (no module outside this one opens, lists or stats a
    path of :meth:`join`: tests/test_import.py checks).
    """

    def __init__(self, path: str, shared: Optional[str] = None) -> None:
        self.path = path
        # Why several hosts share this directory (shared-filesystem mode; see _sharedfs),
        # or None: it belongs to this host.
        self.shared = shared
        # The run's world size once known (from this rank's registration): records of
        # ranks outside it are not records of this run.
        self.world_size: Optional[int] = None
        self._warned: Set[Tuple[str, str]] = set()
        self._kinds: Dict[Tuple[str, str, str], int] = {}  # warnings given per kind (see warn_once)
        self._warn_lock = threading.Lock()
        # "" -> the run directory, "events" -> its folder...: held once prepare() checked them.
        self._fds: Dict[str, int] = {}
        self._ids: Dict[str, Tuple[int, int]] = {}  # (st_dev, st_ino) of each, as checked
        self._fd_lock = threading.RLock()

    def join(self, *parts: str) -> str:
        """The path of ``parts`` under the run directory, for people (logs, the report)."""
        return os.path.join(self.path, *parts)

    def per_host(self, name: str) -> str:
        """The name of this host's own copy of the file ``name``: ``name`` itself where the
        run directory is this host's, ``<stem>-<host>.<ext>`` where several hosts share it
        (``events.jsonl`` -> ``events-node3.jsonl``): what each host appends to or claims
        for itself (an append over NFS is not atomic across its clients)."""
        if self.shared is None:
            return name
        stem, dot, ext = name.partition(".")
        return f"{stem}-{safe_name(_identity.hostname())}{dot}{ext}"

    def at(self, *parts: str) -> str:
        """A path to ``parts`` that goes through the held directory descriptor (Linux's
        ``/proc/self/fd/N/...``): for code that must open or watch something by path.
        The directory as it was checked, even if renamed and replaced since. Before
        :meth:`prepare` (or where there is no ``/proc``), :meth:`join`."""
        try:
            fd = self._held("")
        except OSError:
            fd = -1  # held, but lost: a path that leads nowhere, never the path again
        if fd is None or not _HAVE_FD_PATHS:
            return self.join(*parts)
        return os.path.join(_FD_ROOT, str(fd), *parts)

    def stack_path(self, rank: int) -> str:
        """Where rank ``rank`` keeps its stack file (open for faulthandler as long as it runs); for people."""
        return self.join(STACKS, stack_name(rank))

    def stack_at(self, rank: int) -> str:
        """Rank ``rank``'s stack file, through the held descriptor (see :meth:`at`): to open or check it."""
        return self.at(STACKS, stack_name(rank))

    def close(self) -> None:
        """Let go of the directory descriptors (a later operation opens the path again)."""
        with self._fd_lock:
            fds = [fd for sub, fd in self._fds.items() if self._is(fd, sub)]  # others' numbers now: not ours to close
            self._fds, self._ids = {}, {}
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    # -- directory descriptors ----------------------------------------------------

    @contextlib.contextmanager
    def _dir(self, sub: str) -> Iterator[int]:
        """A descriptor of folder ``sub`` ("" for the run directory itself); OSError if it
        cannot be opened (missing, a symlink, not a directory)."""
        held = self._held(sub)
        if held is not None:
            yield held
            return
        fd = os.open(self.path, _DIR_FLAGS)
        try:
            if sub:
                top, fd = fd, -1
                try:
                    fd = os.open(sub, _DIR_FLAGS, dir_fd=top)
                finally:
                    os.close(top)
            yield fd
        finally:
            if fd >= 0:
                os.close(fd)

    def _held(self, sub: str) -> Optional[int]:
        """The held descriptor of ``sub``, or None if the directory is not held.

        The application may take a descriptor's number (``os.closerange``, ``dup2`` of
        ``/dev/null`` over it): a held descriptor that is no longer the folder that was
        checked (device and inode) is let go, never closed (the number is the
        application's now), and the folder opened again, accepted only if it is that very
        folder. OSError if it cannot be.
        """
        with self._fd_lock:
            if "" not in self._ids:
                return None
            fd = self._fds.get(sub)
            if fd is not None and self._is(fd, sub):
                return fd
            self._fds.pop(sub, None)
            top = None if not sub else self._held(sub="")
            fd = os.open(sub if sub else self.path, _DIR_FLAGS, dir_fd=top)
            st = os.fstat(fd)
            if sub not in self._ids:
                self._ids[sub] = (st.st_dev, st.st_ino)  # a folder first opened now, within the held directory
            elif not self._is(fd, sub):
                os.close(fd)
                self.warn_once(self.join(sub), "is no longer the directory that was checked; not used")
                raise OSError(errno.ESTALE, "not the directory that was checked")
            self._fds[sub] = fd
            return fd

    def _is(self, fd: int, sub: str) -> bool:
        try:
            st = os.fstat(fd)
        except OSError:
            return False
        return stat.S_ISDIR(st.st_mode) and (st.st_dev, st.st_ino) == self._ids.get(sub)

    def _hold(self, path: str) -> None:
        """Open the run directory at ``path``, check what was opened, and hold it."""
        try:
            fd = os.open(path, _DIR_FLAGS)
        except OSError as e:
            check_trusted(path)  # says why: a symlink, not a directory, missing...
            raise RunDirError(path, f"cannot be opened ({e.strerror})") from None
        try:
            _check_own_dir(path, os.fstat(fd))
        except RunDirError:
            os.close(fd)
            raise
        self.close()
        st = os.fstat(fd)
        with self._fd_lock:
            self._fds[""] = fd
            self._ids[""] = (st.st_dev, st.st_ino)

    def _hold_sub(self, sub: str) -> None:
        """Create folder ``sub`` (0700) in the held run directory, check it, and hold it."""
        top = self._fds[""]
        where = self.join(sub)
        try:
            os.mkdir(sub, 0o700, dir_fd=top)
        except FileExistsError:
            pass
        except OSError as e:
            raise RunDirError(where, f"cannot be created ({e.strerror})") from None
        try:
            fd = os.open(sub, _DIR_FLAGS, dir_fd=top)
        except OSError as e:
            try:
                st = os.lstat(sub, dir_fd=top)
            except OSError:
                st = None
            reason = "is a symbolic link; refusing to follow it" if st is not None and stat.S_ISLNK(st.st_mode) else (
                f"cannot be opened ({e.strerror})")
            raise RunDirError(where, reason) from None
        try:
            _check_own_dir(where, os.fstat(fd))
        except RunDirError:
            os.close(fd)
            raise
        st = os.fstat(fd)
        with self._fd_lock:
            old = self._fds.get(sub)
            self._fds[sub] = fd
            self._ids[sub] = (st.st_dev, st.st_ino)
        if old is not None:
            os.close(old)

    # -- creation and registration -------------------------------------------------

    def prepare(self, reg: Registration, process_start_ns: int) -> None:
        """Create the directory and its folders (0700), and register rank ``reg.rank`` in it.

        Every folder above it must be safe from other users (:func:`check_ancestors`),
        else :class:`RunDirError`. Under a lock beside the directory: a directory left by
        an earlier run (this rank's slot held by a dead process, or a verdict older than
        this process) is set aside first. A slot held by another live process means two
        jobs share the directory: :class:`RunDirError`. The registration is published
        under that same lock, so the check and the claim are one step: the first process to
        claim a slot holds it. From then on the directory is held by a descriptor (see the class).
        """
        parent = os.path.dirname(os.path.abspath(self.path))
        try:
            os.makedirs(parent, 0o700, exist_ok=True)
        except OSError as e:
            raise RunDirError(parent, f"cannot be created ({e.strerror})") from None
        check_ancestors(parent)
        if parent == base_dir():
            check_trusted(parent)
        import filelock

        lock = filelock.FileLock(lock_path(self.path), timeout=30)
        try:
            with lock:
                self.close()
                self._set_aside_if_stale(reg, process_start_ns)
                try:
                    os.mkdir(self.path, 0o700)
                except FileExistsError:
                    pass
                except OSError as e:
                    raise RunDirError(self.path, f"cannot be created ({e.strerror})") from None
                self._hold(self.path)
                for sub in _SUBDIRS:
                    self._hold_sub(sub)
                if reg.world_size is not None and reg.world_size > 0:
                    # From now on (not while judging an earlier run's records, above).
                    self.world_size = reg.world_size
                # Under the lock that covered the check: of two processes claiming one slot
                # at once, the first to take the lock registers, the second is refused above.
                self.publish_registration(reg)
        except filelock.Timeout:
            raise RunDirError(self.path, "timed out waiting for its lock file") from None

    def publish_registration(self, reg: Registration) -> None:
        """Write this rank's pid file: from now on its peers watch it. (:meth:`prepare` does,
        under its lock; anything else would race another process claiming the slot.)"""
        self.write(RANKS, rank_file("rank", reg.rank), encode(reg), replace=True)

    def withdraw_registration(self, reg: Registration) -> None:
        """Remove this rank's pid file if it is still ``reg`` (the rank could not be watched
        after all: install() failed after :meth:`prepare`). Never raises."""
        name = rank_file("rank", reg.rank)
        try:
            if self.read(RANKS, name, Registration) == reg:
                with self._dir(RANKS) as dir_fd:
                    os.unlink(name, dir_fd=dir_fd)
        except OSError:
            pass

    def _set_aside_if_stale(self, reg: Registration, process_start_ns: int) -> None:
        if not os.path.lexists(self.path):
            return
        self._hold(self.path)  # read what was checked, not what the path names a moment later
        mine = self.read(RANKS, rank_file("rank", reg.rank), Registration)
        if mine is not None and (mine.host, mine.pidns) != (reg.host, reg.pidns):
            raise self._held_by_another_host(reg, mine)
        regs = self.registrations()
        live = {r.rank: r for r in regs.values() if r.rank != reg.rank and _identity.seems_alive(r)}
        self._refuse_if_shared(reg, mine, live)
        stale_reason = stale_because(reg, mine, regs, bool(live), self._successes(), process_start_ns,
                                     self.read(EVENTS, VERDICT_FILE, Verdict))
        if stale_reason is None:
            return
        aside = f"{self.path}.stale-{time.time_ns()}"
        logger.warning("peerwatch: %s is from an earlier run (%s); moved it to %s", self.path, stale_reason, aside)
        self.close()  # the descriptors would follow it aside
        os.rename(self.path, aside)

    def _held_by_another_host(self, reg: Registration, mine: Registration) -> RunDirError:
        # Another host's (or container's) record is never judged stale: we cannot see
        # its processes. Without shared mode a run directory belongs to one host; with
        # it, a rank's slot held by another host means a directory of an earlier job.
        if self.shared is not None:
            return RunDirError(
                self.path,
                f"rank {reg.rank} is registered here by host {mine.host} ({mine.pidns}), whose processes "
                "this host cannot see: the directory is shared by the hosts (" + self.shared + "), so "
                "give each job a new PEERWATCH_DIR (e.g. with the job id in it)",
            )
        return RunDirError(
            self.path,
            f"rank {reg.rank} is registered here by host {mine.host} ({mine.pidns}): a run directory "
            "belongs to one host; on a shared filesystem give each host its own PEERWATCH_DIR, "
            "or set shared_fs=on",
        )

    def _refuse_if_shared(self, reg: Registration, mine: Optional[Registration],
                          live: Dict[int, Registration]) -> None:
        """Raise when a live process of this run or another job holds what this rank would take."""
        if mine is not None and (mine.pid, mine.start_ticks) != (reg.pid, reg.start_ticks):
            if _identity.is_same_process(mine.pid, mine.start_ticks, mine.uid) and mine.boot_id == reg.boot_id:
                raise RunDirError(
                    self.path,
                    f"rank {reg.rank} is already registered by live pid {mine.pid}: two jobs share "
                    "this run directory; give each its own PEERWATCH_DIR",
                )
            mates = sorted(r.rank for r in live.values() if same_job(r, reg))
            if mates:
                # The run lives on: this is not rank reg.rank of a new run but a process
                # (a child that outlived its rank?) claiming a dead rank's slot.
                raise RunDirError(
                    self.path,
                    f"rank {reg.rank}'s process (pid {mine.pid}) is gone but ranks {mates} of its run "
                    "still live: this process is not a new rank of this run",
                )
        others = sorted(r.rank for r in live.values() if not same_job(r, reg))
        if others:
            theirs = live[others[0]].world_size
            raise RunDirError(
                self.path,
                f"it holds a live run of world size {theirs} (ranks {others}), and this rank's world size is "
                f"{reg.world_size}: two jobs share this run directory; give each its own PEERWATCH_DIR",
            )

    # -- writing -------------------------------------------------------------------

    def write(
        self, sub: str, name: str, data: bytes, *, replace: bool = False,
        valid: Optional[Callable[[bytes], bool]] = None,
    ) -> bool:
        """Write ``data`` to ``sub/name`` atomically. Without ``replace`` the first writer wins:
        returns False if the file was already there, unless ``valid`` says the file there is
        not a valid record (garbage must not block the real one): it is then replaced, and
        the caller wins if what is there afterwards is its own data.
        Raises OSError (ENOSPC, ...) to the caller.
        """
        with self._dir(TMP) as tmp_dir, self._dir(sub) as dir_fd:
            return self._write(tmp_dir, dir_fd, sub, name, data, replace, valid)

    def _write(
        self, tmp_dir: int, dir_fd: int, sub: str, name: str, data: bytes, replace: bool,
        valid: Optional[Callable[[bytes], bool]],
    ) -> bool:
        tmp = f"{name}.{os.getpid()}.{threading.get_ident()}.{time.monotonic_ns()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=tmp_dir)
        moved = False  # renamed into place: no temp name is left to remove
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            if replace:
                os.replace(tmp, name, src_dir_fd=tmp_dir, dst_dir_fd=dir_fd)
                moved = True
                return True
            try:
                os.link(tmp, name, src_dir_fd=tmp_dir, dst_dir_fd=dir_fd, follow_symlinks=False)
                return True
            except FileExistsError:
                if valid is None:
                    return False
            existing = self.read_bytes(sub, name)
            if existing is not None and valid(existing):
                return False
            self.warn_once(self.join(sub, name), "is not a valid record; replaced by this rank's")
            os.replace(tmp, name, src_dir_fd=tmp_dir, dst_dir_fd=dir_fd)
            moved = True
            return self.read_bytes(sub, name) == data
        finally:
            if not moved:  # an unlink locks tmp/ even when it finds nothing: 128 ranks at a teardown
                try:
                    os.unlink(tmp, dir_fd=tmp_dir)
                except FileNotFoundError:
                    pass

    def claim(self, sub: str, name: str) -> bool:
        """Create the empty file ``sub/name`` (``sub`` made 0700 if missing); True for the
        one process that created it, False for every other (``O_EXCL``): who does a thing
        once per run and host. Raises OSError to the caller."""
        try:
            return self._create(sub, name)
        except FileNotFoundError:  # sub is missing: made once, not tried on every claim (a mkdir
            pass  # locks the run directory even when sub exists, and claims come 128 at once)
        self.make_folder(sub)
        return self._create(sub, name)

    def make_folder(self, sub: str) -> None:
        """Create folder ``sub`` (0700) of the run directory if it is missing (one made on
        demand, not at :meth:`prepare`). Raises OSError to the caller."""
        with self._dir("") as top:
            try:
                os.mkdir(sub, 0o700, dir_fd=top)
            except FileExistsError:
                pass

    def _create(self, sub: str, name: str) -> bool:
        with self._dir(sub) as dir_fd:
            try:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                             dir_fd=dir_fd)
            except FileExistsError:
                return False
            os.close(fd)
            return True

    def append(self, name: str, data: bytes) -> None:
        """Append ``data`` to the file ``name`` of the run directory in one ``write(2)`` on an
        ``O_APPEND`` descriptor: lines of several processes never interleave (one small
        write each). Raises OSError to the caller (a short write too)."""
        with self._dir("") as top:
            try:
                fd = open_regular(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, dir_fd=top)
            except OSError as e:
                if e.errno == errno.EINVAL:
                    self.warn_once(self.join(name), "is not a regular file (a FIFO?); nothing is appended to it")
                raise
            try:
                if os.write(fd, data) != len(data):
                    raise OSError(errno.EIO, f"short write to {name}")
            finally:
                os.close(fd)

    # -- for callers that need a descriptor or a file's metadata --------------------

    def open_file(self, name: str, flags: int, sub: str = "") -> int:
        """A descriptor of the regular file ``sub/name`` (:func:`open_regular`: never a
        symlink, FIFO or device), opened through the folder's held descriptor: a lock file,
        a flag held open. The caller closes it. Raises OSError."""
        with self._dir(sub) as dir_fd:
            return open_regular(name, flags, dir_fd=dir_fd)

    def open_folder(self, sub: str) -> int:
        """A descriptor of folder ``sub`` of its own (a dup of the held one): for code that
        keeps it, such as the C exit watch that writes records with ``openat``. The caller
        closes it. Raises OSError (missing, a symlink, no longer the folder checked)."""
        with self._dir(sub) as dir_fd:
            return os.dup(dir_fd)  # non-inheritable, as every descriptor Python makes

    def stat(self, sub: str, name: str = "") -> os.stat_result:
        """The metadata of ``sub/name`` (of folder ``sub`` itself without ``name``), never
        following a symlink. Raises OSError."""
        with self._dir(sub) as dir_fd:
            return os.stat(name, dir_fd=dir_fd, follow_symlinks=False) if name else os.fstat(dir_fd)

    def exists(self, sub: str, name: str) -> bool:
        """Is there an entry ``sub/name`` (of any kind, a symlink too)? False where the
        folder cannot be opened."""
        try:
            self.stat(sub, name)
        except OSError:
            return False
        return True

    # -- reading -------------------------------------------------------------------

    def read_bytes(self, sub: str, name: str, limit: int = MAX_RECORD_BYTES) -> Optional[bytes]:
        """The file's bytes, or None if it is missing, not a regular file, a symlink or too big."""
        path = self.join(sub, name)
        try:
            with self._dir(sub) as dir_fd:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                self.warn_once(path, "is a symbolic link; ignored")
            elif e.errno not in (errno.ENOTDIR,):
                self.warn_once(path, f"cannot be read ({e.strerror}); ignored")
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                self.warn_once(path, "is not a regular file; ignored")
                return None
            if st.st_size > limit:
                self.warn_once(path, f"is {st.st_size} bytes, over the {limit} byte limit; ignored")
                return None
            chunks = []
            while True:
                chunk = os.read(fd, limit + 1)
                if not chunk:
                    break
                chunks.append(chunk)
                if sum(map(len, chunks)) > limit:
                    self.warn_once(path, "grew over the size limit while being read; ignored")
                    return None
            return b"".join(chunks)
        except OSError as e:
            self.warn_once(path, f"cannot be read ({e.strerror}); ignored")
            return None
        finally:
            os.close(fd)

    def read(self, sub: str, name: str, cls: Type[R]) -> Optional[R]:
        """The record ``sub/name`` of type ``cls``, or None: missing, malformed, or naming a
        rank outside the run's world size (each logged once)."""
        data = self.read_bytes(sub, name)
        if data is None:
            return None
        record = decode(cls, data)
        if record is None and data and sub == HEARTBEATS:
            # Rewritten in place: we may have caught a write half done. Once more.
            data = self.read_bytes(sub, name)
            record = decode(cls, data) if data else None
        if record is None and data:
            self.warn_once(self.join(sub, name), "is not a valid peerwatch record; ignored")
            return None
        outside = self._outside_world(record) if record is not None else None
        if outside is not None:
            self.warn_once(self.join(sub, name), f"names rank {outside}, outside this run's world size {self.world_size}; ignored")
            return None
        return record

    def _outside_world(self, record: object) -> Optional[int]:
        """The first rank ``record`` names (its own, a laggard, who made it...) that is not
        inside the run's world, where the world size is known; None if every one is."""
        if isinstance(record, Registration) or self.world_size is None:
            return None  # a registration is judged with the reader's own (_rundir.same_job), which says more
        return next((r for r in named_ranks(record) if r >= self.world_size), None)

    def names(self, sub: str) -> List[str]:
        """Every name in folder ``sub``; none if it is missing or cannot be listed (warned)."""
        try:
            with self._dir(sub) as dir_fd:
                return os.listdir(dir_fd)
        except FileNotFoundError:
            return []
        except OSError as e:
            self.warn_once(self.join(sub), f"cannot be listed ({e.strerror})")
            return []

    def inodes(self, sub: str) -> Dict[str, int]:
        """Every name in folder ``sub`` with its inode, in one listing (a file replaced by a
        rename shows a new inode); none if it is missing or cannot be listed (warned)."""
        try:
            with self._dir(sub) as dir_fd, os.scandir(dir_fd) as it:
                return {entry.name: entry.inode() for entry in it}
        except FileNotFoundError:
            return {}
        except OSError as e:
            self.warn_once(self.join(sub), f"cannot be listed ({e.strerror})")
            return {}

    def entries(self, sub: str) -> Iterator[Tuple[str, int, str]]:
        """(prefix, rank, name) of the rank files in sub; other entries are skipped."""
        for name in self.names(sub):
            parsed = parse_rank_file(name)
            if parsed is not None:
                yield parsed[0], parsed[1], name

    def rank_records(self, sub: str, types: Mapping[str, type]) -> Dict[str, Dict[int, Any]]:
        """prefix -> rank -> record, for each file ``<prefix>-<rank>.json`` of folder ``sub``
        whose prefix ``types`` names, read as that type (one listing). A malformed record,
        or one that names another rank than its file name, is left out. The one reader of
        a folder of rank files: registrations, success markers, the report's events."""
        found: Dict[str, Dict[int, Any]] = {prefix: {} for prefix in types}
        for prefix, rank, name in self.entries(sub):
            cls = types.get(prefix)
            if cls is not None:
                record = self.read(sub, name, cls)
                if record is not None and getattr(record, "rank", None) == rank:
                    found[prefix][rank] = record
        return found

    def _successes(self) -> Dict[int, Success]:
        return self.rank_records(EVENTS, {"success": Success})["success"]

    def registrations(self) -> Dict[int, Registration]:
        return self.rank_records(RANKS, {"rank": Registration})["rank"]

    def warn_once(self, path: str, reason: str) -> None:
        """One warning per file and reason, and at most ``WARN_EACH`` per kind (folder, kind of
        record, reason), then one line that says the rest go unreported: a folder planted with
        20 000 junk failure records must not print 20 000 lines in every rank."""
        folder, name = os.path.split(path)
        kind = (folder, name.partition("-")[0], "".join("N" if c.isdigit() else c for c in reason))
        with self._warn_lock:
            if (path, reason) in self._warned:
                return
            self._warned.add((path, reason))
            self._kinds[kind] = n = self._kinds.get(kind, 0) + 1
        if n <= WARN_EACH:
            logger.warning("peerwatch: %s %s", path, reason)
        elif n == WARN_EACH + 1:
            logger.warning("peerwatch: more than %d files in %s are like %s (%s); further ones are ignored "
                           "without a warning each", WARN_EACH, folder, name, reason)


class InPlace:
    """A record rewritten in place, for the heartbeat: one ``pwrite(2)`` per update.

    The atomic way (a temp file, a rename, an unlink attempt) costs a journal commit on
    ext4 and was most of an idle rank's CPU (docs/performance.md). A shorter record is
    padded with spaces (JSON ignores them), so the file never holds a stale tail; a
    reader that catches a write half done sees invalid JSON and re-reads
    (:meth:`RunDir.read`). If the file is deleted or replaced, a new one is started
    within ``CHECK_EVERY`` writes. Not for a run directory shared by hosts: other clients may not see in-place
    writes until the file is closed (NFS close-to-open).
    """

    def __init__(self, run_dir: RunDir, sub: str, name: str) -> None:
        self.run_dir = run_dir
        self.sub = sub
        self.name = name
        self._fd: Optional[int] = None
        self._size = 0
        self._writes = 0

    CHECK_EVERY = 10  # writes between checks that the file is still the one at our path

    def write(self, data: bytes) -> None:
        """Raises OSError (ENOSPC, ...) to the caller."""
        self._writes += 1
        if self._fd is not None and self._writes % self.CHECK_EVERY == 0 and not self._current():
            self.close()
        if self._fd is None:
            self.run_dir.write(self.sub, self.name, data, replace=True)
            self._open(len(data))
            return
        padded = data + b" " * (self._size - len(data))
        if os.pwrite(self._fd, padded, 0) != len(padded):
            raise OSError(errno.EIO, "short write")
        self._size = len(padded)

    def _current(self) -> bool:
        """The fd still is the file at our path (not deleted, not replaced)."""
        try:
            with self.run_dir._dir(self.sub) as dir_fd:
                here = os.stat(self.name, dir_fd=dir_fd, follow_symlinks=False)
            mine = os.fstat(self._fd)  # type: ignore[arg-type]
        except OSError:
            return False
        return (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino)

    def _open(self, size: int) -> None:
        try:
            with self.run_dir._dir(self.sub) as dir_fd:
                fd = open_regular(self.name, os.O_WRONLY, dir_fd=dir_fd)
        except OSError:
            return  # written atomically this time; next time we try again
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            os.close(fd)
            return
        self._fd, self._size = fd, size

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None


__all__ = [
    "InPlace", "EVENTS", "HEARTBEATS", "NEW_RUN", "OWNER_VAR", "RANKS", "REPORT_FILE", "SUMMARY_FILE", "STACKS", "TMP", "VERDICT_FILE",
    "DIAGNOSIS_FILE", "REMOTE_STALLS_FILE", "SPAWNED_RUN", "STALL_FILE", "STRAGGLERS_FILE", "STRAGGLE_FILE", "STRAGGLE_HOSTS_FILE",
    "FLIGHT_RECORDER", "RunDir", "base_dir", "check_ancestors", "check_trusted", "fr_dump_name", "open_regular", "parse_fr_dump_name",
    "parse_rank_file", "is_multiprocessing_child", "process_key", "rank_file", "resolve", "safe_name", "stack_name",
]
