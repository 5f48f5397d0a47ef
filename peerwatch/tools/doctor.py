"""``peerwatch doctor``: what peerwatch relies on, checked on this machine as this user,
then a live self-test: a real 4-rank job, one rank SIGKILLed, the teardown timed.

Each check is one line: ``ok``, ``warn`` (peerwatch works, on a slower or narrower path;
the line says which) or ``fail`` (peerwatch cannot do its job here), what it means for
peerwatch and the fix. torch is never imported by the checks in the doctor's own process:
importing it takes 5-60 s on a loaded machine. What the torch and GPU lines need is asked of
a child process (:func:`torch_facts`), once, under a time limit; only the self-test's GPU
memory check imports it here.

The self-test's ranks are this module run as ``python -m peerwatch.tools.doctor --rank``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import json
import os
import platform
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..core.errors import RunDirError
from ..core.mounts import MOUNTINFO, is_network_fs, mount_of, parse_mountinfo
from ..hangs import collectives
from ..proc import identity
from ..rundir import basedir, rundir, trust

OK, WARN, FAIL = "ok", "warn", "fail"
WORLD = 4
VICTIM = 2  # the rank the self-test SIGKILLs
READY_TIMEOUT_S = 120.0  # start, import torch, form the group: 4 ranks on 2 loaded cores
GONE_TIMEOUT_S = 30.0  # from the kill to every rank gone, at most
GONE_WARN_S = 2.0  # a teardown slower than this is a warning (measured: about 0.1 s)
GPU_BACK_TIMEOUT_S = 15.0  # from the kill to the GPU memory given back, at most
GPU_HOLD_BYTES = 256 << 20  # what each GPU rank holds
GPU_SLACK_BYTES = 64 << 20  # "given back": free memory within this of what it was before
POLL_S = 0.02
ID_VAR = "PEERWATCH_DOCTOR_ID"  # carried by every process of the self-test: how leftovers are found
_FOREIGN_ENV = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID",
    "PEERWATCH_DIR", "PEERWATCH_DIR_OWNER", "PEERWATCH_RANK", "PEERWATCH_RUN_DIR",
)


@dataclasses.dataclass
class Check:
    name: str
    status: str  # OK, WARN or FAIL
    detail: str  # what was found
    meaning: str = ""  # what it means for peerwatch (which path it takes)
    fix: str = ""  # what to do, when there is something to do


# -- the checks ------------------------------------------------------------------------


def check_pidfd() -> Check:
    fallback = ("peerwatch falls back to looking at /proc every 0.1 s to see a peer end, and to "
                "signalling by pid after checking its start time (a small window for pid reuse)")
    fix = "Linux >= 5.3 and Python >= 3.9; in a container, a seccomp profile that allows pidfd_open (Docker >= 20.10)"
    if not hasattr(os, "pidfd_open") or not hasattr(signal, "pidfd_send_signal"):
        return Check("pidfd", WARN, "os.pidfd_open or signal.pidfd_send_signal is missing from this Python", fallback, fix)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdin=subprocess.DEVNULL)
    try:
        try:
            fd = os.pidfd_open(child.pid)
        except OSError as e:
            return Check("pidfd", WARN, f"pidfd_open failed: {e.strerror} (errno {e.errno})", fallback, fix)
        try:
            start = time.monotonic()
            signal.pidfd_send_signal(fd, signal.SIGKILL)
            readable, _, _ = select.select([fd], [], [], 5.0)
            took_ms = (time.monotonic() - start) * 1e3
        except OSError as e:
            return Check("pidfd", WARN, f"pidfd_send_signal failed: {e.strerror} (errno {e.errno})", fallback, fix)
        finally:
            os.close(fd)
        if not readable:
            return Check("pidfd", WARN, "a pidfd did not become readable when its process ended", fallback, fix)
        return Check("pidfd", OK, f"pidfd_open, pidfd_send_signal and poll work (a child killed and seen gone in {took_ms:.1f} ms)",
                     "a peer's end wakes its watchers at once; signals reach only the process verified")
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def inotify_in_use(uid: int) -> Tuple[int, int]:
    """(inotify instances held by this uid's processes, processes whose fds could not be read)."""
    count = unreadable = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            fds = os.listdir(f"/proc/{name}/fd")
        except OSError:
            unreadable += 1
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{name}/fd/{fd}") == "anon_inode:inotify":
                    count += 1
            except OSError:
                continue
    return count, unreadable


def check_inotify() -> Check:
    fallback = "without it each rank reads the run directory every 0.1 s instead of being woken (slower, costlier)"
    fix = "raise the limit: sysctl fs.inotify.max_user_instances=1024 (or find what holds them: the count is per user)"
    try:
        limit = int(_read("/proc/sys/fs/inotify/max_user_instances"))
    except (OSError, ValueError):
        limit = -1
    used, _ = inotify_in_use(os.geteuid())
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.inotify_init1(os.O_CLOEXEC)
        err = ctypes.get_errno()
    except (OSError, AttributeError) as e:
        return Check("inotify", WARN, f"inotify cannot be called ({e})", fallback, "Linux with inotify")
    if fd < 0:
        why = "the per-user limit is reached" if err == errno.EMFILE else os.strerror(err)
        return Check("inotify", WARN, f"inotify_init1 failed: {why}; {used} in use of {limit}", fallback, fix)
    os.close(fd)
    if limit < 0:
        return Check("inotify", OK, f"works; {used} instances in use by this user (limit unknown)", "each rank takes one instance")
    free = limit - used
    detail = f"works; {used} of {limit} instances (fs.inotify.max_user_instances) in use by this user, {free} free"
    if free < 16:
        return Check("inotify", WARN, detail, "each rank takes one instance; ranks beyond the limit " + fallback[13:], fix)
    return Check("inotify", OK, detail, "each rank takes one instance; a record written in the run directory wakes its peers")


def _identify(pid: int) -> Optional[identity.ProcessInfo]:
    """:func:`peerwatch.proc.identity.probe`, None also where it cannot tell (out of descriptors...):
    the checks then say /proc cannot be read, and nothing is taken for a process of the self-test."""
    try:
        return identity.probe(pid)
    except identity.Unknown:
        return None


def check_proc() -> Check:
    fix = "mount /proc (proc(5)); hidepid is fine: peers are this user's processes"
    me = _identify(os.getpid())
    if me is None or not os.path.exists("/proc/self/stat"):
        return Check("/proc", FAIL, "this process's /proc/self/stat cannot be read",
                     "peerwatch identifies processes by pid and start time read from /proc; psutil is tried instead", fix)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdin=subprocess.DEVNULL)
    try:
        other = _identify(child.pid)
    finally:
        child.kill()
        child.wait()
    options = ""
    for line in _read("/proc/mounts").splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[1] == "/proc":
            options = fields[3]
    hidden = [o for o in options.split(",") if o.startswith("hidepid")]
    if other is None or other.uid != os.geteuid():
        return Check("/proc", FAIL, "another process of this user cannot be read in /proc",
                     "peers cannot be verified: peerwatch never signals a process it cannot verify", fix)
    note = f" ({hidden[0]}: other users' processes hidden, which peerwatch does not need)" if hidden else ""
    return Check("/proc", OK, f"readable for uid {os.geteuid()}: pid, start time, uid and state of this user's processes{note}",
                 "every peer is verified (pid + start time + uid + boot id) right before it is signalled")


def check_namespace() -> Check:
    hints = []
    if os.path.exists("/.dockerenv"):
        hints.append("/.dockerenv")
    if os.path.exists("/run/.containerenv"):
        hints.append("/run/.containerenv (podman)")
    try:
        cgroup = _read("/proc/1/cgroup")
        for word in ("docker", "kubepods", "containerd", "lxc", "libpod"):
            if word in cgroup:
                hints.append(f"cgroup of pid 1 mentions {word}")
                break
    except OSError:
        pass
    try:
        comm = _read("/proc/1/comm").strip()
    except OSError:
        comm = "?"
    try:
        for line in _read("/proc/self/status").splitlines():
            if line.startswith("NSpid:"):
                nspid = line.split(":", 1)[1].split()
                if len(nspid) > 1:
                    hints.append(f"a nested PID namespace (this pid is {' -> '.join(nspid)} from the outside in)")
    except OSError:
        pass
    ns = identity.pid_namespace()
    where = ("a container (" + "; ".join(hints) + ")") if hints else "no container"
    return Check("namespace", OK, f"PID namespace {ns}, pid 1 is {comm!r}, {where}",
                 "ranks in another PID namespace (another container) are treated as another host: never signalled "
                 "from here, watched through the store or a shared filesystem",
                 "run all ranks of a host in one container (or --pid=host) for the fast local path" if hints else "")


def check_base() -> Check:
    base = basedir.base_dir()
    fix_move = "point XDG_RUNTIME_DIR (or XDG_CACHE_HOME) at a local disk, or give each job a PEERWATCH_DIR"
    existing = base
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    try:
        mounts = parse_mountinfo(_read(MOUNTINFO))
    except OSError:
        mounts = []
    mount = mount_of(os.path.realpath(existing), mounts)
    fstype = mount.fstype if mount else "unknown"
    try:
        vfs = os.statvfs(existing)
        free = vfs.f_bavail * vfs.f_frsize
    except OSError:
        free = -1
    parts = [f"{base} on {fstype}" + (f" ({mount.mount_point})" if mount else "")]
    parts.append(f"{free / 2**30:.1f} GiB free" if free >= 0 else "free space unknown")
    if mount and "noexec" in mount.options:
        parts.append("noexec (peerwatch runs nothing from there)")
    if existing == base:
        st = os.lstat(base)
        parts.append(f"owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}")
        try:
            trust.check_trusted(base)
        except RunDirError as e:
            return Check("run dir base", FAIL, "; ".join(parts), f"install() refuses it: {e}",
                         f"remove it (it is recreated 0700) or {fix_move}")
    cannot = _write_fails(existing)
    if cannot is not None:
        # A real write: the mode bits and access(2) do not show every refusal (a read-only
        # mount for the base itself, a full quota, an immutable folder, an LSM).
        return Check("run dir base", FAIL, "; ".join(parts) + f"; a file cannot be written in {existing}: {cannot}",
                     "install() cannot create or write its run directory: ranks run unprotected", fix_move)
    if existing != base:
        parts.append(f"not created yet ({existing} is writable)")
    detail = "; ".join(parts)
    if 0 <= free < 1 << 20:
        return Check("run dir base", FAIL, detail, "records cannot be written: ranks fail to register",
                     "free some space (`peerwatch gc` removes finished run directories)")
    if is_network_fs(fstype):
        return Check("run dir base", WARN, detail,
                     "a run directory there is taken as shared by hosts: other hosts' records are polled, and two "
                     "hosts choosing the same name collide", fix_move)
    if 0 <= free < 100 << 20:
        return Check("run dir base", WARN, detail, "little room for records and stack dumps", "free some space (`peerwatch gc`)")
    kind = "local, in memory" if fstype in ("tmpfs", "ramfs") else "local"
    return Check("run dir base", OK, detail, f"{kind}: records are written atomically and inotify sees them")


def _write_fails(folder: str) -> Optional[str]:
    """Why a file cannot be made, written and removed in ``folder`` (None: it can). The
    file has an unpredictable name (mkstemp: O_EXCL, 0600) and is removed at once."""
    try:
        fd, path = tempfile.mkstemp(prefix=".peerwatch-doctor-", dir=folder)
    except OSError as e:
        return e.strerror or str(e)
    try:
        os.write(fd, b"peerwatch doctor\n")
        os.fsync(fd)
    except OSError as e:
        return e.strerror or str(e)
    finally:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
    return None


TORCH_PROBE_TIMEOUT_S = 120.0  # the child that imports torch: 5-60 s measured on 2 loaded cores
# Run as ``python -c`` in a child: what the torch and GPU lines need, as one JSON line.
_TORCH_PROBE = '''
import json
facts = {"installed": True}
try:
    import torch
except ImportError:
    facts["installed"] = False
except Exception as e:
    facts["error"] = str(e) or type(e).__name__
else:
    facts["version"] = str(torch.__version__)
    try:
        facts["gpus"] = int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception:
        facts["gpus"] = 0
    try:
        import torch.distributed as dist
    except Exception as e:
        facts["dist_error"] = str(e) or type(e).__name__
    else:
        facts["dist"] = bool(dist.is_available())
        if facts["dist"]:
            facts["gloo"] = bool(dist.is_gloo_available())
            facts["nccl"] = bool(dist.is_nccl_available())
            c10d = getattr(torch._C, "_distributed_c10d", None)
            names = ("_dump_fr_trace_json", "_dump_nccl_trace_json", "_dump_nccl_trace", "_dump_fr_trace")
            facts["fr"] = [n for n in names if callable(getattr(c10d, n, None))]
print(json.dumps(facts))
'''
_torch_facts: Optional[Dict[str, Any]] = None
_probe: Optional[subprocess.Popen] = None  # the child, started early (start_torch_probe) while other checks run


def start_torch_probe() -> None:
    """Start the child that imports torch now, so that it works while the other checks run."""
    global _probe
    if _probe is None and _torch_facts is None:
        try:
            _probe = subprocess.Popen([sys.executable, "-c", _TORCH_PROBE], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        except OSError:
            _probe = None  # torch_facts() says why


def torch_facts() -> Dict[str, Any]:
    """What this machine's torch is (version, torch.distributed, its backends and flight
    recorder, the GPUs it sees), asked of a child process once, within
    :data:`TORCH_PROBE_TIMEOUT_S`: ``{"installed": False}`` without torch; an ``"error"``
    key where importing it failed or took too long. Never raises."""
    global _torch_facts
    if _torch_facts is None:
        _torch_facts = _probe_torch()
    return _torch_facts


def _probe_torch() -> Dict[str, Any]:
    global _probe
    start_torch_probe()
    child, _probe = _probe, None
    if child is None:
        return {"installed": True, "error": "no child process could be started to import it in"}
    try:
        stdout, stderr = child.communicate(timeout=TORCH_PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        return {"installed": True, "error": f"importing it took more than {TORCH_PROBE_TIMEOUT_S:g}s "
                "(in a child process; not checked)"}
    lines = stdout.strip().splitlines()
    try:
        facts = json.loads(lines[-1]) if lines else None
    except ValueError:
        facts = None
    if not isinstance(facts, dict):
        tail = (stderr.strip().splitlines() or [f"exit status {child.returncode}"])[-1]
        return {"installed": True, "error": f"importing it ended its process: {tail}"}
    return facts


def check_torch() -> Check:
    facts = torch_facts()
    if not facts.get("installed", True):
        return Check("torch", OK, "not installed", "peerwatch watches plain processes; without torch.distributed there is "
                     "no store bridge (a multi-host job's hosts do not learn of each other's failures)")
    if "error" in facts:  # a broken install is the finding
        return Check("torch", WARN, f"import torch failed: {facts['error']}",
                     "no store bridge; hangs are not placed in a collective", "repair the torch installation")
    parts = [f"torch {facts.get('version', '?')}"]
    if "dist_error" in facts or not facts.get("dist"):
        why = (f"torch.distributed cannot be imported ({facts['dist_error']})" if "dist_error" in facts
               else "built without torch.distributed")
        return Check("torch", WARN, f"{parts[0]}; {why}",
                     "no store bridge: a multi-host job's hosts do not learn of each other's failures", "a torch build with distributed")
    parts.append("gloo " + ("yes" if facts.get("gloo") else "no"))
    parts.append("nccl " + ("yes" if facts.get("nccl") else "no"))
    # What the hang diagnosis reads every heartbeat (collectives), and what each rank
    # leaves beside the report for torch's analyzer (frdump).
    fr = [str(n) for n in facts.get("fr", [])]
    reads: List[str] = [n for n in ("_dump_fr_trace_json", "_dump_nccl_trace_json") if n in fr]
    dumps: List[str] = [n for n in ("_dump_nccl_trace", "_dump_fr_trace") if n in fr]
    parts.append("flight recorder " + (f"yes ({', '.join(reads + dumps)})" if reads or dumps else "no"))
    if not reads:
        return Check("torch", WARN, ", ".join(parts),
                     "the hang diagnosis reads the flight recorder's counters: without them it cannot "
                     "name the rank a hung job waits for; the store bridge still carries verdicts between hosts",
                     "a newer torch (one with torch.distributed's flight recorder), or hang_timeout with peerwatch.beat()")
    return Check("torch", OK, ", ".join(parts),
                 "the hang diagnosis reads the flight recorder's counters every heartbeat (which rank never reached "
                 "which collective), and each rank leaves its dump in RUN/flight_recorder for torch's analyzer; "
                 "the store bridge carries verdicts between hosts")


def gpu_count() -> int:
    """GPUs torch can use here (0 without torch or CUDA), asked of a child (:func:`torch_facts`)."""
    try:
        return int(torch_facts().get("gpus", 0))
    except (TypeError, ValueError):
        return 0


def check_gpus() -> Check:
    listed: List[str] = []
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
            listed = [line.strip() for line in out.stdout.splitlines() if line.startswith("GPU ")]
        except (OSError, subprocess.SubprocessError):
            pass
    n = gpu_count()
    names = "; ".join(listed)
    if listed and not n:
        return Check("gpus", WARN, f"nvidia-smi lists {len(listed)} ({names}) but torch sees none",
                     "the self-test runs on CPU; a rank's GPU memory is not checked", "a CUDA build of torch")
    if not n:
        return Check("gpus", OK, "none visible", "the self-test runs on CPU (gloo)")
    return Check("gpus", OK, f"{n} visible to torch" + (f": {names}" if names else ""),
                 "the self-test's ranks hold GPU memory" + (" and use NCCL" if n >= 2 else ""))


def check_store() -> Check:
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return Check("store", OK, "MASTER_ADDR/MASTER_PORT not set",
                     "nothing to reach now; in a job that sets them, the store bridge connects to the job's TCPStore")
    try:
        start = time.monotonic()
        with socket.create_connection((addr, int(port)), timeout=2.0):
            took_ms = (time.monotonic() - start) * 1e3
    except (OSError, ValueError) as e:
        return Check("store", WARN, f"{addr}:{port} cannot be reached ({e})",
                     "normal before the job's store starts; during a job, hosts would not learn of each other's failures",
                     "check MASTER_ADDR/MASTER_PORT and the firewall between the hosts")
    return Check("store", OK, f"{addr}:{port} accepts a TCP connection ({took_ms:.1f} ms)", "the store bridge can reach it")


CHECKS: List[Callable[[], Check]] = [
    check_pidfd, check_inotify, check_proc, check_namespace, check_base, check_torch, check_gpus, check_store,
]


def run_checks() -> List[Check]:
    start_torch_probe()  # torch is imported in a child meanwhile
    results = []
    for fn in CHECKS:
        name = fn.__name__[len("check_"):]
        try:
            results.append(fn())
        except Exception as e:  # noqa: BLE001 - a check that breaks is reported, not raised
            results.append(Check(name, FAIL, f"the check itself failed: {type(e).__name__}: {e}"))
    return results


# -- the self-test ---------------------------------------------------------------------


def _rank_main(mode: str, ready: str) -> None:
    """One rank of the self-test: install, join the group, then take part until torn down."""
    import peerwatch

    peerwatch.install()
    rank = int(os.environ["RANK"])

    def say_ready() -> None:
        tmp = os.path.join(ready, f".rank-{rank}")
        with open(tmp, "w") as f:
            f.write(str(os.getpid()))
        os.replace(tmp, os.path.join(ready, f"rank-{rank}"))

    if mode == "python":
        say_ready()
        while True:
            time.sleep(0.05)
            peerwatch.beat()
    import datetime

    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if mode in ("cuda", "nccl"):
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        held = torch.empty(GPU_HOLD_BYTES, dtype=torch.uint8, device=device)  # held until the end
        held.fill_(1)
    backend = "nccl" if mode == "nccl" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=300))
    t = torch.ones(1, device=device)
    dist.all_reduce(t)
    t.item()
    say_ready()
    step = 0
    while True:
        dist.all_reduce(t)  # the peers block here once a rank is gone
        t.fill_(1.0).item()
        step += 1
        peerwatch.beat(step)
        time.sleep(0.01)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gpu_free() -> List[int]:
    import torch

    return [int(torch.cuda.mem_get_info(i)[0]) for i in range(torch.cuda.device_count())]


def _carrying(token: str) -> List[int]:
    """Pids of live processes (not zombies) whose environment carries the self-test's id."""
    needle = f"{ID_VAR}={token}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        info = _identify(int(name))
        if needle in env and info is not None and not info.dead:
            found.append(int(name))
    return found


def _self_test_mode() -> Tuple[int, str, str]:
    """The GPUs, the self-test's mode and its label: the most this machine can run."""
    facts = torch_facts()
    torch_here = facts.get("installed", True) and "error" not in facts
    gpus = gpu_count() if torch_here else 0
    mode = "nccl" if gpus >= 2 else "cuda" if gpus == 1 else "gloo" if torch_here else "python"
    label = {"nccl": f"NCCL on {gpus} GPUs", "cuda": "gloo, ranks holding CUDA memory on 1 GPU",
             "gloo": "gloo on CPU", "python": "plain Python ranks (no torch)"}[mode]
    return gpus, mode, label


class _SelfTest:
    """One run of the self-test: its files, its ranks and its result, shared by its steps."""

    def __init__(self, world: int, victim: int) -> None:
        self.world, self.victim = world, victim
        self.gpus, self.mode, label = _self_test_mode()
        self.tmp = tempfile.mkdtemp(prefix="peerwatch-doctor-")
        self.run, self.ready = os.path.join(self.tmp, "run"), os.path.join(self.tmp, "ready")
        os.mkdir(self.ready)
        self.token = uuid.uuid4().hex
        self.env = {k: v for k, v in os.environ.items() if k not in _FOREIGN_ENV}
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.env.update({
            ID_VAR: self.token, "PEERWATCH_DIR": self.run, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
            "WORLD_SIZE": str(world), "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])]),
        })
        self.result: Dict[str, Any] = {"mode": self.mode, "label": label, "world": world, "killed_rank": victim,
                                       "run_dir": self.run}
        self.checks: List[Check] = []
        self.result["checks"] = self.checks
        self.before = _gpu_free() if self.gpus else []
        self.procs: Dict[int, subprocess.Popen] = {}
        self.pidfds: Dict[int, int] = {}
        self.log = open(os.path.join(self.tmp, "ranks.log"), "wb")

    def start_ranks(self) -> None:
        """Start the ranks, each with a pidfd where the kernel has them."""
        # Filled in place: a rank that fails to start still leaves the ones before it to close().
        for rank in range(self.world):
            self.procs[rank] = subprocess.Popen(
                [sys.executable, "-m", "peerwatch.tools.doctor", "--rank", self.mode, self.ready],
                env=dict(self.env, RANK=str(rank), LOCAL_RANK=str(rank)), stdin=subprocess.DEVNULL,
                stdout=self.log, stderr=self.log,
            )
            if hasattr(os, "pidfd_open"):
                try:
                    self.pidfds[rank] = os.pidfd_open(self.procs[rank].pid)
                except OSError:
                    pass

    def wait_ready(self) -> bool:
        """Wait for every rank to say it is ready; False (and a ``start`` failure) if one does not."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while len([n for n in os.listdir(self.ready) if n.startswith("rank-")]) < self.world:
            ended = {r: p.returncode for r, p in self.procs.items() if p.poll() is not None}
            if ended or time.monotonic() > deadline:
                why = f"ranks ended early: {ended}" if ended else f"not every rank was ready within {READY_TIMEOUT_S:.0f} s"
                self.checks.append(Check("start", FAIL, f"the job did not start: {why} (log: {self.log.name})",
                                         "the self-test could not run", "read the log; run `peerwatch doctor --no-self-test`"))
                return False
            select.select(list(self.pidfds.values()), [], [], POLL_S)
        return True

    def kill_victim(self) -> float:
        """SIGKILL the victim; returns when, on the monotonic clock."""
        # The victim is our own child, not yet reaped: its pid (and pidfd) is still it.
        killed_at = time.monotonic()
        if self.victim in self.pidfds:
            signal.pidfd_send_signal(self.pidfds[self.victim], signal.SIGKILL)
        else:
            self.procs[self.victim].send_signal(signal.SIGKILL)
        return killed_at

    def wait_gone(self, killed_at: float) -> Dict[int, float]:
        """When each rank ended (pidfd readable, or polled without one), until all did or the timeout."""
        gone_at: Dict[int, float] = {}
        deadline = killed_at + GONE_TIMEOUT_S
        without_pidfd = [r for r in self.procs if r not in self.pidfds]
        while len(gone_at) < self.world and time.monotonic() < deadline:
            waiting = {fd: r for r, fd in self.pidfds.items() if r not in gone_at}
            polling = any(r not in gone_at for r in without_pidfd)
            timeout = POLL_S if polling else min(0.5, max(0.0, deadline - time.monotonic()))
            readable, _, _ = select.select(list(waiting), [], [], timeout)
            now = time.monotonic()
            for fd in readable:
                gone_at[waiting[fd]] = now
            for r in without_pidfd:
                if r not in gone_at and self.procs[r].poll() is not None:
                    gone_at[r] = now
        return gone_at

    def reap(self, gone_at: Dict[int, float]) -> Tuple[List[int], Dict[int, int]]:
        """Kill the ranks still running, wait for every rank: the survivors and the exit codes."""
        survivors = [r for r in self.procs if r not in gone_at]
        for r in survivors:
            self.procs[r].kill()  # our children: the test failed, clean up
        codes = {r: p.wait() for r, p in self.procs.items()}
        self.result["exit_codes"] = {str(r): c for r, c in codes.items()}
        return survivors, codes

    def check_teardown(self, survivors: List[int], gone_at: Dict[int, float], killed_at: float) -> Check:
        """Every rank gone after the kill, and how fast; records the times in the result."""
        if survivors:
            self.result["teardown_ms"] = None
            return Check("teardown", FAIL, f"ranks {survivors} were still running {GONE_TIMEOUT_S:.0f} s after rank "
                         f"{self.victim} was killed (now killed by the doctor)", "peerwatch did not tear the job down here",
                         f"read {self.log.name} and report it")
        last = max(gone_at.values()) - killed_at
        self.result["teardown_ms"] = round(last * 1e3, 1)
        self.result["gone_ms"] = {str(r): round((t - killed_at) * 1e3, 1) for r, t in sorted(gone_at.items())}
        status = OK if last <= GONE_WARN_S else WARN
        return Check("teardown", status, f"every rank gone {last * 1e3:.0f} ms after rank {self.victim} was SIGKILLed",
                     "without peerwatch the others would wait in the collective for its timeout (minutes)",
                     "" if status == OK else "the machine may be overloaded; run it again")

    def check_leftovers(self) -> Check:
        left = _carrying(self.token)
        for pid in left:  # carries our unique id: started by this self-test, nothing else
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.result["leftover_pids"] = left
        return Check("leftovers", FAIL if left else OK,
                     f"processes left: {left} (now killed)" if left else "no process of the job left",
                     "" if not left else "a rank or a child of one outlived the teardown", "" if not left else "report it")

    def close(self) -> None:
        """Close the pidfds, kill what still runs, close the log; keep the files only when a check failed."""
        for fd in self.pidfds.values():
            os.close(fd)
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        self.log.close()
        if all(c.status != FAIL for c in self.checks) and self.checks:
            shutil.rmtree(self.tmp, ignore_errors=True)
        else:
            self.result["kept"] = self.tmp


def run_self_test(world: int = WORLD, victim: int = VICTIM) -> Dict[str, Any]:
    """Run the job, SIGKILL rank ``victim``, measure. Returns the result with its checks."""
    test = _SelfTest(world, victim)
    checks = test.checks
    try:
        test.start_ranks()
        if not test.wait_ready():
            return test.result
        held = _gpu_free() if test.gpus else []
        killed_at = test.kill_victim()
        gone_at = test.wait_gone(killed_at)
        survivors, codes = test.reap(gone_at)
        checks.append(test.check_teardown(survivors, gone_at, killed_at))
        report_check, verdict = _check_report(test.run, victim)
        checks.append(_check_exit_codes(codes, victim, verdict))
        checks.append(report_check)
        checks.append(test.check_leftovers())
        if test.gpus:
            checks.append(_check_gpu_memory(test.before, held, killed_at, test.result))
        return test.result
    finally:
        test.close()


def _check_report(run: str, victim: int) -> Tuple[Check, Dict[str, Any]]:
    path = os.path.join(run, rundir.REPORT_FILE)
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError) as e:
        return Check("report", FAIL, f"{path} not written ({e})", "the job's end is not explained", "report it"), {}
    verdict = report.get("verdict") or {}
    message = str(verdict.get("message") or "")
    if verdict.get("rank") != victim and verdict.get("cause") == "exception" and collectives.in_backend_words(message):
        # Rank N's collective saw the dead rank's sockets close before the kernel reported it
        # gone (it closes a process's files before it notifies its exit): peerwatch took the
        # echo for the cause. The job was torn down all the same; the report names the wrong rank.
        return Check("report", WARN, f"report.json names rank {verdict.get('rank')} (its gloo error: {message[:60]}...), "
                     f"not rank {victim}", "rank {}'s collective error raced rank {}'s death, and peerwatch took the echo "
                     "for the root cause; the teardown is unaffected".format(verdict.get("rank"), victim),
                     "a known peerwatch race (see docs/doctor.md); run the doctor again to see the usual answer"), verdict
    if verdict.get("rank") != victim:
        return Check("report", FAIL, f"report.json names {verdict.get('rank')!r}, not rank {victim}", "the root cause is wrong",
                     "report it"), verdict
    return Check("report", OK, f"report.json names rank {victim} (cause {verdict.get('cause')}, exit code {verdict.get('exit_code')})",
                 "`peerwatch report DIR` explains the job's end"), verdict


def _check_exit_codes(codes: Dict[int, int], victim: int, verdict: Dict[str, Any]) -> Check:
    """The killed rank: -SIGKILL. The others: the verdict's exit code. The self-test's ranks
    are siblings (as under torchrun or Slurm): no rank is the killed one's parent, so how it
    ended is unknown to them, the cause is ``vanished`` and the code is ``exit_code`` (1)."""
    text = ", ".join(f"rank {r}: {c}" for r, c in sorted(codes.items()))
    want = verdict.get("exit_code")
    wrong = {r: c for r, c in codes.items() if c != (-signal.SIGKILL if r == victim else want)}
    if wrong or want in (None, 0):
        return Check("exit codes", FAIL, text, f"expected -9 from rank {victim} and the verdict's exit code ({want}) from the others",
                     "read the ranks' log")
    how = ("(no rank is its parent, so how it ended is unknown: the documented exit_code)" if verdict.get("cause") == "vanished"
           else f"({verdict.get('cause')})")
    return Check("exit codes", OK, f"{text}; -9 is the SIGKILL, {want} the verdict's exit code {how}",
                 "no rank exits 0: the scheduler sees the job failed")


def _check_gpu_memory(before: List[int], held: List[int], killed_at: float, result: Dict[str, Any]) -> Check:
    deadline = killed_at + GPU_BACK_TIMEOUT_S
    while True:
        now_free = _gpu_free()
        back = all(n >= b - GPU_SLACK_BYTES for n, b in zip(now_free, before))
        if back or time.monotonic() > deadline:
            break
        time.sleep(POLL_S)
    took = time.monotonic() - killed_at
    held_mib = [round((b - h) / 2**20) for b, h in zip(before, held)]
    result["gpu"] = {"free_before": before, "free_held": held, "free_after": now_free,
                     "memory_back_ms": round(took * 1e3, 1) if back else None}
    if not back:
        return Check("gpu memory", FAIL, f"not given back {GPU_BACK_TIMEOUT_S:.0f} s after the kill (free before "
                     f"{[b >> 20 for b in before]} MiB, now {[n >> 20 for n in now_free]} MiB)",
                     "a process still holds GPU memory", "look for it with nvidia-smi")
    return Check("gpu memory", OK, f"{held_mib} MiB held by the ranks, given back {took * 1e3:.0f} ms after the kill",
                 "the GPUs are free for the next job at once")


# -- output ----------------------------------------------------------------------------


def _line(c: Check) -> List[str]:
    out = [f"{c.status:<5} {c.name:<13} {c.detail}"]
    if c.meaning:
        out.append(f"{'':<19}-> {c.meaning}")
    if c.fix:
        out.append(f"{'':<19}fix: {c.fix}")
    return out


def main(self_test: bool = True, as_json: bool = False) -> int:
    """Run the checks (and the self-test); print them. 1 when something fails, else 0."""
    from .. import __version__

    checks = run_checks()
    if not as_json:
        print(f"peerwatch doctor: peerwatch {__version__}, Python {platform.python_version()}, "
              f"{platform.system()} {platform.release()}, uid {os.geteuid()}")
        for c in checks:
            print("\n".join(_line(c)))
        sys.stdout.flush()
    test: Optional[Dict[str, Any]] = None
    if self_test:
        if not as_json:
            print(f"\nself-test: a {WORLD}-rank job, rank {VICTIM} SIGKILLed ...", flush=True)
        test = run_self_test(WORLD, VICTIM)
        if not as_json:
            print(f"self-test: {test['label']}")
            for c in test["checks"]:
                print("\n".join(_line(c)))
            if test.get("kept"):
                print(f"{'':<19}(its files are kept in {test['kept']})")
    every = checks + (test["checks"] if test else [])
    failed = [c.name for c in every if c.status == FAIL]
    warned = [c.name for c in every if c.status == WARN]
    if as_json:
        if test is not None:
            test = dict(test, checks=[dataclasses.asdict(c) for c in test["checks"]])
        print(json.dumps({
            "version": 1, "peerwatch": __version__, "ok": not failed,
            "checks": [dataclasses.asdict(c) for c in checks], "self_test": test,
        }, indent=2))
    else:
        verdict = "FAIL: " + ", ".join(failed) if failed else "ok" + (f" (warnings: {', '.join(warned)})" if warned else "")
        print(f"\nresult: {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--rank":
        _rank_main(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())


__all__ = ["TORCH_PROBE_TIMEOUT_S", "Check", "gpu_count", "inotify_in_use", "main", "run_checks", "run_self_test", "start_torch_probe", "torch_facts"]
