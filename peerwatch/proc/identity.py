"""Who is this process, and is that pid still that process?

A process is identified by (boot id, PID namespace, pid, start time in clock ticks since
boot, uid). A look that fails (EMFILE, EACCES...) tells nothing: :func:`probe` raises
:class:`Unknown`, never says "no such process". Only ENOENT/ESRCH or another start time
says the process is gone. Signalling fails closed (:func:`is_same_process`: a pid that
cannot be verified is never signalled); watching fails open (:func:`same_process` says
"cannot tell", and a peer that cannot be told is kept, never taken for gone).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import os
import time
from typing import Mapping, NamedTuple, Optional, Tuple

from ..core.records import Registration


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """What ``/proc/<pid>/stat`` says of a live process (or a zombie)."""

    pid: int
    ppid: int
    state: str  # R, S, D, T, t, Z, X, ...
    start_ticks: int
    uid: int
    exiting: bool = False  # it began to exit (PF_EXITING): its descriptors close, its pidfd fires next

    @property
    def dead(self) -> bool:
        return self.state in ("Z", "X", "x")


PF_EXITING = 0x4  # /proc/<pid>/stat's flags: the process is in exit(), closing its descriptors
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@functools.lru_cache(maxsize=None)
def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        import psutil

        return f"boot-time-{int(psutil.boot_time())}"


def pid_namespace() -> str:
    # Not cached: a process can move to a new PID namespace for its children (unshare),
    # but its own namespace only changes across fork, where caches would lie.
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "pid:[unknown]"


@functools.lru_cache(maxsize=None)
def hostname() -> str:
    return os.uname().nodename  # what socket.gethostname() returns, without importing socket


class Unknown(OSError):
    """Whether a process is there cannot be told now: /proc could not be read (EMFILE when
    the descriptors run out, EACCES...). Neither alive nor gone: look again later."""


def probe(pid: int) -> Optional[ProcessInfo]:
    """Read pid's identity, or ``None`` if there is no such process (ENOENT, ESRCH).
    Raises :class:`Unknown` if it cannot be told (a failed look is not an answer)."""
    if pid <= 0:
        return None
    try:
        data = _read_stat(pid)
        if data is None:
            return None
        uid = os.stat(f"/proc/{pid}").st_uid
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError as e:
        if not _has_proc_entry(pid):
            return None  # told without a descriptor: no such process
        return _probe_psutil(pid, e)
    # The command name may hold spaces and parentheses: split after the last ')'.
    fields = data[data.rfind(b")") + 2 :].split()
    try:
        return ProcessInfo(
            pid=pid,
            ppid=int(fields[1]),
            state=fields[0].decode("ascii", "replace"),
            start_ticks=int(fields[19]),
            uid=uid,
            exiting=bool(int(fields[6]) & PF_EXITING),
        )
    except (IndexError, ValueError):
        raise Unknown(errno.EIO, f"/proc/{pid}/stat: not a stat line") from None


def _has_proc_entry(pid: int) -> bool:
    """False only if /proc says there is no such pid: a stat, which needs no descriptor
    (it answers when the descriptors have run out)."""
    try:
        os.stat(f"/proc/{pid}")
    except FileNotFoundError:
        return False
    except OSError:
        pass
    return True


STAT_READS = 20  # tries at /proc/PID/stat when what is read is not its stat line (see _read_stat)


def _read_stat(pid: int) -> Optional[bytes]:
    """``/proc/<pid>/stat``; None if there is no such process. Raises OSError if it cannot
    be read.

    Another thread of the application may take our descriptor between its open and its read
    (``os.closerange``, or ``dup2`` of /dev/null over a range of numbers, as a daemonizing
    library does). The read then fails with EBADF or returns another file's bytes, and a live
    peer would be taken for gone: a whole job torn down by mistake. So what is read must be
    pid's stat line, or it is read again. A number that is not ours any more is left open: it
    is the application's now."""
    head = b"%d (" % pid
    for _ in range(STAT_READS):
        try:
            fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, ProcessLookupError):
            return None
        try:
            data = os.read(fd, 4096)
        except ProcessLookupError:
            return None  # it ended between the open and the read
        except OSError as e:
            if e.errno != errno.EBADF:
                raise
            continue  # closed behind our back
        if data.startswith(head):
            with contextlib.suppress(OSError):  # EBADF: closed behind our back since the read
                os.close(fd)
            return data
    raise OSError(errno.EIO, f"/proc/{pid}/stat: another file's bytes {STAT_READS} times")


def _probe_psutil(pid: int, why: Optional[OSError] = None) -> Optional[ProcessInfo]:
    """Fallback where /proc cannot be read (not Linux): None if psutil says there is no
    such process; raises :class:`Unknown` if it cannot tell either (``why``: what failed
    before it, for the message)."""
    cause = why if why is not None else OSError(errno.ENOSYS, "no /proc")
    try:
        import psutil
    except (ImportError, OSError):  # OSError: the import's own descriptor taken away
        raise _unknown(pid, cause) from None
    if not hasattr(psutil, "Process"):  # its import failed half-way before: it cannot tell
        raise _unknown(pid, cause)
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            status = p.status()
            return ProcessInfo(
                pid=pid,
                ppid=p.ppid(),
                state="Z" if status == psutil.STATUS_ZOMBIE else "S",
                # The same unit as /proc's: clock ticks since boot.
                start_ticks=int(round((p.create_time() - psutil.boot_time()) * _CLOCK_TICKS)),
                uid=p.uids().real,
            )
    except psutil.NoSuchProcess:  # ZombieProcess too (its subclass): a zombie is gone as well
        return None
    except (psutil.Error, OSError) as e:
        raise _unknown(pid, e if isinstance(e, OSError) else cause) from None


def _unknown(pid: int, cause: OSError) -> Unknown:
    return Unknown(cause.errno or errno.EIO, f"cannot tell whether pid {pid} runs: {cause.strerror or cause}")


def same_process(pid: int, start_ticks: int, uid: Optional[int] = None) -> Optional[bool]:
    """Is pid alive (not a zombie) and the process that started at ``start_ticks`` (and,
    unless None, of ``uid``)? None if it cannot be told now (see :class:`Unknown`)."""
    try:
        info = probe(pid)
    except Unknown:
        return None
    return info is not None and not info.dead and info.start_ticks == start_ticks and uid in (None, info.uid)


def exiting(pid: int, start_ticks: int) -> bool:
    """pid is the process that started at ``start_ticks`` and has begun to exit (its
    sockets close now; its pidfd fires once its memory is torn down, which takes long on a
    loaded machine). False if it cannot be told."""
    try:
        info = probe(pid)
    except Unknown:
        return False
    return info is not None and info.start_ticks == start_ticks and info.exiting


def is_same_process(pid: int, start_ticks: int, uid: int) -> bool:
    """True only if pid is alive (not a zombie) and is the process that started at
    start_ticks: fails closed, for signalling (what cannot be verified is never signalled).
    Whether a peer is gone is :func:`same_process`'s answer, where "cannot tell" is not "gone"."""
    return same_process(pid, start_ticks, uid) is True


def is_local(reg: Registration) -> bool:
    """The one answer to "is this process on this host": same boot id and PID namespace."""
    return reg.boot_id == boot_id() and reg.pidns == pid_namespace()


def local_ranks(regs: Mapping[int, Registration]) -> Tuple[int, ...]:
    """This host's ranks among ``regs`` (rank -> registration), lowest first: the one way
    the run's ranks are split into this host's and the others' (by :func:`is_local`)."""
    return tuple(sorted(rank for rank, reg in regs.items() if is_local(reg)))


def seems_alive(reg: Registration) -> bool:
    """As far as this host can tell. A local process is checked; one of this host from an
    earlier boot (same host name, another boot id) is dead; another host's, or another PID
    namespace's, is assumed alive: it is not ours to see, nor is one that cannot be told now."""
    if is_local(reg):
        return same_process(reg.pid, reg.start_ticks, reg.uid) is not False
    return not (reg.host == hostname() and reg.boot_id != boot_id())


class Started(NamedTuple):
    """When a process started: on the wall clock, and on CLOCK_BOOTTIME (None where it
    cannot be told), which no clock step moves: records of this host are ordered by it."""

    wall_ns: int
    boot_ns: Optional[int]


def boot_clock_ns() -> Optional[int]:
    """CLOCK_BOOTTIME now (None without it): the clock /proc's start times count on."""
    try:
        return time.clock_gettime_ns(time.CLOCK_BOOTTIME)
    except (AttributeError, OSError):
        return None


def started() -> Started:
    """When this process started, to about a clock tick (10 ms).
    (psutil's create_time adds the boot time of /proc/stat, in whole seconds: up to a
    second early, enough to take a run that ended just before this process for one that
    ended after it started.)"""
    now = boot_clock_ns()
    try:
        info = probe(os.getpid())
        if info is None or now is None:
            raise OSError("no /proc or CLOCK_BOOTTIME")
        boot_ns = info.start_ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
        return Started(time.time_ns() - now + boot_ns, boot_ns)
    except (OSError, ValueError):
        return Started(time.time_ns(), None)  # "now" only errs towards a new run


def self_info() -> ProcessInfo:
    info = probe(os.getpid())
    if info is None:
        raise OSError("cannot read this process's own identity from /proc")
    return info


__all__ = [
    "ProcessInfo", "Started", "Unknown", "boot_clock_ns", "boot_id", "exiting", "hostname", "is_local", "is_same_process", "local_ranks", "pid_namespace",
    "probe", "same_process", "seems_alive", "self_info", "started",
]
