"""The run directory's layout (one home for each path) and its records: written atomically,
read tolerantly, always through the descriptors held since it was checked.

Layout (per host)::

    RUN/ranks/rank-00003.json       registration (pid file)
    RUN/events/success-00003.json   success marker            \\
    RUN/events/failure-00003.json   failure record             | watched by inotify;
    RUN/events/exit-00003.json      exit status seen by parent | created by link(2), so
    RUN/events/ack-00003.json       "I saw the verdict"        | they appear complete
    RUN/events/verdict.json         the verdict (first wins)  /
    RUN/heartbeats/rank-00003.json  liveness and progress (rewritten in place, see InPlace)
    RUN/stacks/rank-00003.txt       Python stacks dumped at teardown
    RUN/flight_recorder/rank_3      torch's flight recorder, as its analyzer reads it (peerwatch.hangs.frdump)
    RUN/report.json                 the report
    RUN/tmp/                        temp files; records are written here first
    RUN/spawn/                      the run of this process's multiprocessing children (mp.spawn's workers)

Records are written to ``tmp/`` and then linked (write-once records) or renamed into
place: a reader never sees half a record. The heartbeat, rewritten every second, is the
exception (:class:`InPlace`): readers re-read one they catch half written. Records in ``events/`` are
linked rather than renamed: a link cannot replace a record already there (the first
writer wins).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple, Type, TypeVar

from ..core.records import MAX_RECORD_BYTES, Registration, Success, decode, encode, named_ranks
from ..proc import identity
from .trust import HeldDir, open_regular

RANKS, EVENTS, HEARTBEATS, STACKS, TMP = "ranks", "events", "heartbeats", "stacks", "tmp"
VERDICT_FILE = "verdict.json"
DIAGNOSIS_FILE = "diagnosis.json"  # events/: why the job stopped moving (peerwatch.hangs.diagnose)
# This host's stall as its hang judges see it (peerwatch.hangs.diagnose.Summary), for the store bridge to
# publish, and the other hosts' stalls as the bridge read them, for the judges.
STALL_FILE = "stall.json"
REMOTE_STALLS_FILE = "stalls-remote.json"
# Stragglers (peerwatch.hosts.stragglerwatch): this host's ranks' waits, for the bridge to
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
# ranks say their one line after it; rule: who reports).
SUMMARY_FILE = "summary"
# The run of the multiprocessing children (mp.spawn's workers) of a process that installed
# peerwatch: <that process's run directory>/spawn.
SPAWNED_RUN = "spawn"
_SUBDIRS = (RANKS, EVENTS, HEARTBEATS, STACKS, TMP)
# Why a file could not be read that says nothing of the file: the look failed (out of
# descriptors, of memory, interrupted). What the file says is not known, not "nothing".
NOT_NOW = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS, errno.EAGAIN, errno.EINTR))

R = TypeVar("R")
logger = logging.getLogger("peerwatch")


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


def safe_name(text: str) -> str:
    """``text`` made safe for a file name: letters, digits, ``.`` and ``_``; at most 64 characters."""
    cleaned = "".join(c if c.isalnum() or c in "._" else "_" for c in text)
    return cleaned[:64] or "_"


def same_job(a: Registration, b: Registration) -> bool:
    """Could ``a`` and ``b`` be ranks of one job? Not when both know the world size and
    the sizes differ (two jobs given one directory), or a rank lies outside it."""
    if a.world_size is not None and b.world_size is not None and a.world_size != b.world_size:
        return False
    size = a.world_size or b.world_size
    return size is None or (a.rank < size and b.rank < size)


BLANK = b" \t\r\n\0"  # a record of nothing but these (padding, NULs) says nothing


def blank(data: bytes) -> bool:
    """A record file of nothing but padding or NULs (or of nothing): not written, as an
    empty one is, rather than garbage. Such a file says nothing of what it stood for: an
    exit record of 132 NULs was left by the C exit watch when its buffer was zeroed under
    it (peerwatch/_exitstatus.c's arm_leaving, fixed), and a reader of an older run's may
    meet one. A reader takes it for absent (no warning); a writer that checks what is
    there replaces it."""
    return not data.strip(BLANK)


class HeldFiles(HeldDir):
    """The files of a held directory, nothing of what they say (:class:`RunDir` knows that):
    atomic writes (the first writer wins), size-capped reads, listings and metadata, all
    through the descriptors held since :func:`peerwatch.rundir.prepare.prepare` checked the
    directory and its folders (:class:`peerwatch.rundir.trust.HeldDir`), never through the
    path again. Paths that :meth:`join` gives are for people (logs, the report); code that
    must open something by path uses :meth:`at`, and code that needs a descriptor or a
    file's metadata :meth:`open_file`, :meth:`open_folder`, :meth:`stat`, :meth:`exists`,
    :meth:`names` and :meth:`inodes` (no module outside this one opens, lists or stats a path
    of :meth:`join`: tests/test_import.py checks)."""

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
            if existing is None or not blank(existing):  # a blank one was never written: nothing to say
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

    def write_or_log(self, name: str, data: bytes, replace: bool = True) -> bool:
        """:meth:`write` the file ``name`` of the run directory (replacing it, unless not
        ``replace``), for a file the run can do without: True if written, False where it
        was not (an OSError is logged at DEBUG, never raised)."""
        try:
            return self.write("", name, data, replace=replace)
        except OSError as e:
            logger.debug("peerwatch: cannot write %s: %s", name, e)
            return False

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
        demand, not at :func:`peerwatch.rundir.prepare.prepare`). Raises OSError to the caller."""
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

    def recent(self, name: str, max_age_ns: float) -> bool:
        """Is the file ``name`` of the run directory there, and was it last modified at most
        ``max_age_ns`` ago (``time.time_ns()``)? False where it cannot be looked at: a file
        another process rewrites, that it stopped writing."""
        try:
            return time.time_ns() - self.stat("", name).st_mtime_ns <= max_age_ns
        except OSError:
            return False

    # -- reading ----------------------------------------------------------------

    def read_bytes(self, sub: str, name: str, limit: int = MAX_RECORD_BYTES, strict: bool = False) -> Optional[bytes]:
        """The file's bytes, or None if it is missing, not a regular file, a symlink or too big.
        ``strict``: a look that failed for want of resources (EMFILE...: :data:`NOT_NOW`), which
        says nothing of the file, raises OSError instead of reading as None."""
        path = self.join(sub, name)
        try:
            with self._dir(sub) as dir_fd:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except OSError as e:
            if strict and e.errno in NOT_NOW:
                raise
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
            if strict and e.errno in NOT_NOW:
                raise
            self.warn_once(path, f"cannot be read ({e.strerror}); ignored")
            return None
        finally:
            os.close(fd)

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


class RunDir(HeldFiles):
    """One run directory on this host: its layout (:meth:`stack_path`, like :meth:`join`, is
    for people) and its records, read tolerantly (a bad one is None), written atomically."""

    def __init__(self, path: str, shared: Optional[str] = None) -> None:
        super().__init__(path)
        # Why several hosts share this directory (shared-filesystem mode; see sharedfs),
        # or None: it belongs to this host.
        self.shared = shared
        # The run's world size once known (from this rank's registration): records of
        # ranks outside it are not records of this run.
        self.world_size: Optional[int] = None

    def per_host(self, name: str) -> str:
        """The name of this host's own copy of the file ``name``: ``name`` itself where the
        run directory is this host's, ``<stem>-<host>.<ext>`` where several hosts share it
        (``events.jsonl`` -> ``events-node3.jsonl``): what each host appends to or claims
        for itself (an append over NFS is not atomic across its clients)."""
        if self.shared is None:
            return name
        stem, dot, ext = name.partition(".")
        return f"{stem}-{safe_name(identity.hostname())}{dot}{ext}"

    def stack_path(self, rank: int) -> str:
        """Where rank ``rank`` keeps its stack file (open for faulthandler as long as it runs); for people."""
        return self.join(STACKS, stack_name(rank))

    def stack_at(self, rank: int) -> str:
        """Rank ``rank``'s stack file, through the held descriptor (see :meth:`at`): to open or check it."""
        return self.at(STACKS, stack_name(rank))

    def hold_folders(self) -> None:
        """Create the run directory's folders (0700) where missing, check them, and hold
        them (the directory itself is held: :meth:`hold`). Raises RunDirError."""
        for sub in _SUBDIRS:
            self.hold_folder(sub)

    # -- registration --------------------------------------------------------------

    def publish_registration(self, reg: Registration) -> None:
        """Write this rank's pid file: from now on its peers watch it. (:func:`peerwatch.rundir.prepare.prepare`
        does, under its lock; anything else would race another process claiming the slot.)"""
        self.write(RANKS, rank_file("rank", reg.rank), encode(reg), replace=True)

    def withdraw_registration(self, reg: Registration) -> None:
        """Remove this rank's pid file if it is still ``reg`` (the rank could not be watched
        after all: install() failed after :func:`peerwatch.rundir.prepare.prepare`). Never raises."""
        name = rank_file("rank", reg.rank)
        try:
            if self.read(RANKS, name, Registration) == reg:
                with self._dir(RANKS) as dir_fd:
                    os.unlink(name, dir_fd=dir_fd)
        except OSError:
            pass

    def read(self, sub: str, name: str, cls: Type[R], strict: bool = False) -> Optional[R]:
        """The record ``sub/name`` of type ``cls``, or None: missing, malformed, or naming a
        rank outside the run's world size (each logged once). ``strict``: see :meth:`read_bytes`."""
        data = self.read_bytes(sub, name, strict=strict)
        if data is None or blank(data):
            return None  # missing, or not written (empty, or padding alone): not garbage
        record = decode(cls, data)
        if record is None and data and sub == HEARTBEATS:
            # Rewritten in place: we may have caught a write half done. Once more.
            data = self.read_bytes(sub, name, strict=strict)
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
            return None  # a registration is judged with the reader's own (rundir.same_job), which says more
        return next((r for r in named_ranks(record) if r >= self.world_size), None)

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

    def successes(self) -> Dict[int, Success]:
        """{rank: its success marker}, for the valid markers in ``events/``."""
        return self.rank_records(EVENTS, {"success": Success})["success"]

    def registrations(self) -> Dict[int, Registration]:
        return self.rank_records(RANKS, {"rank": Registration})["rank"]


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
    "BLANK", "InPlace", "EVENTS", "HEARTBEATS", "RANKS", "REPORT_FILE", "SUMMARY_FILE", "STACKS", "TMP", "VERDICT_FILE",
    "DIAGNOSIS_FILE", "REMOTE_STALLS_FILE", "SPAWNED_RUN", "STALL_FILE", "STRAGGLERS_FILE", "STRAGGLE_FILE", "STRAGGLE_HOSTS_FILE",
    "FLIGHT_RECORDER", "HeldFiles", "NOT_NOW", "RunDir", "fr_dump_name", "parse_fr_dump_name", "parse_rank_file", "rank_file", "safe_name", "same_job", "blank",
    "stack_name",
]
