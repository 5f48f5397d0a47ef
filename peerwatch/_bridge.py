"""The store bridge: a source that turns facts from other hosts into local records.

One rank per host (the holder of ``RUN/bridge.lock``) runs it; it is a client of a
``torch.distributed`` store (by default the job's own TCPStore at ``MASTER_ADDR:MASTER_PORT``)
and keeps, under ``peerwatch/<run_id>/``::

    hosts        a counter: each host takes its index with add(hosts, 1)
    host/<i>     JSON: hostname, boot id, PID namespace, ranks of host i
    beat/<i>     host i's heartbeat: "<seq>", or "done:<seq>" once a rank there succeeded
    verdict      the first verdict of the job (compare_set: the first writer wins)

Per heartbeat interval a bridge makes one ``set`` (its beat) and one ``multi_get`` (every
host's beat): the store sees O(hosts) requests per interval, not O(ranks^2). A second
thread, with its own connection, blocks in ``wait`` on the verdict key, so a verdict made
on any host reaches this one in one round trip; it is written into the local
``events/verdict.json`` and the local watchers act on it as on a local one.

What the bridge writes locally is only ever a record (a verdict from the store, or a
``Failure`` with cause ``lost`` when a host or the store falls silent for ``peer_timeout``);
the decision stays in :mod:`._decide`, and only local processes are ever signalled.

torch is imported here, in the bridge thread, and only when a store is to be used.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import fcntl
import hashlib
import json
import logging
import os
import socket
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Set, Tuple

from . import _identity
from ._config import Config
from ._records import EXCEPTION, EXIT, LOST, Failure, Registration, Verdict, decode, encode
from ._rundir import EVENTS, RANKS, VERDICT_FILE, RunDir, rank_file
from ._sources import is_local

logger = logging.getLogger("peerwatch")

LOCK_FILE = "bridge.lock"  # lockf(3) on it: the holder runs this host's bridge
STATE_FILE = "bridge.json"  # what the bridge sees (for people and tests); replaced in place
KEY_ROOT = "peerwatch"
CONNECT_BACKOFF_MAX_S = 5.0  # between connection attempts, doubling from heartbeat_interval
WAIT_CHUNK_S = 3600.0  # the verdict waiter's blocking wait, renewed (a timeout logs in torch's C++)
PUBLISH_BUDGET_S = 1.0  # the teardown never waits longer than this for the store
# A local exception may be the echo of a failure on another host (a collective that lost
# its peer raises within milliseconds): that host's verdict, already on its way through the
# store (one round trip: ~5-30 ms, much more on loaded hosts), gets this long to arrive
# before ours is made. The same 1 s as the one-host rule (_decide.CONSEQUENCE_WINDOW_NS).
REMOTE_SETTLE_S = 1.0
DONE = b"done:"


# -- pure parts -------------------------------------------------------------------------


def spans_hosts(config: Config, env: Mapping[str, str]) -> bool:
    """Does the job run on more than one host, as far as the launcher says?"""
    if config.world_size and config.local_world_size and config.world_size > config.local_world_size:
        return True
    for var in ("SLURM_NNODES", "SLURM_JOB_NUM_NODES", "GROUP_WORLD_SIZE"):
        value = env.get(var, "")
        if value.isdigit() and int(value) > 1:
            return True
    return False


def resolve_store(config: Config, env: Mapping[str, str]) -> Tuple[Any, str]:
    """``(endpoint, why)``: endpoint is ``"host:port"``, a Store object, or None (no bridge)."""
    store = config.store
    if store == "off":
        return None, f"store=off ({config.source_of('store')})"
    if store is not None:
        return store, config.source_of("store")
    if not spans_hosts(config, env):
        return None, "the job runs on one host"
    addr, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
    if not addr or not port.isdigit():
        return None, "the job spans hosts but MASTER_ADDR/MASTER_PORT are not set (set PEERWATCH_STORE)"
    return f"{addr.strip('[]')}:{int(port)}", "MASTER_ADDR/MASTER_PORT (the job spans hosts)"


def resolve_run_id(config: Config, env: Mapping[str, str]) -> Optional[str]:
    """The job's name, the same on every host. A torchrun restart is a new run: the agent's
    store outlives it, so its keys must not be found by the next attempt."""
    if config.run_id:
        return config.run_id
    if env.get("TORCHELASTIC_RUN_ID"):
        return f"torchrun-{env['TORCHELASTIC_RUN_ID']}-r{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if env.get("SLURM_JOB_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', 'batch')}"
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return f"master-{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    return None


def key_prefix(run_id: str) -> str:
    return f"{KEY_ROOT}/{run_id}/"


@dataclasses.dataclass(frozen=True)
class HostInfo:
    """What a host says of itself in ``host/<i>``."""

    index: int
    hostname: str
    boot_id: str = ""
    pidns: str = ""
    ranks: Tuple[int, ...] = ()
    ident: str = ""  # boot id, PID namespace and run directory, hashed: the same for a successor bridge

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, index: int, data: bytes) -> HostInfo:
        try:
            body = json.loads(data.decode("utf-8"))
            ranks = tuple(sorted(int(r) for r in body.get("ranks", ()) if not isinstance(r, bool)))
            return cls(index, str(body.get("hostname", f"host {index}")), str(body.get("boot_id", "")),
                       str(body.get("pidns", "")), ranks, str(body.get("ident", "")))
        except (UnicodeDecodeError, ValueError, TypeError, AttributeError):
            return cls(index, f"host {index}")

    def describe(self) -> str:
        return f"host {self.hostname} ({ranks_text(self.ranks)})"


def ranks_text(ranks: Tuple[int, ...]) -> str:
    if not ranks:
        return "ranks unknown"
    if len(ranks) > 1 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class Liveness:
    """Which hosts have stopped beating, judged on this host's monotonic clock only.

    A host is lost when its beat value has not changed for ``timeout_ns`` of our own
    observations. No clock is compared across hosts. If we ourselves were not running for
    a while (frozen, starved), that gap is not held against anyone: the clock restarts.
    Hosts whose beat says ``done`` are never lost (the job is ending).
    """

    def __init__(self, timeout_ns: int) -> None:
        self.timeout_ns = timeout_ns
        self.values: Dict[int, bytes] = {}
        self.changed_ns: Dict[int, int] = {}
        self.done: Set[int] = set()
        self._last_ns: Optional[int] = None

    def observe(self, now_ns: int, beats: Mapping[int, Optional[bytes]]) -> None:
        if self._last_ns is not None and now_ns - self._last_ns > self.timeout_ns // 2:
            for host in self.changed_ns:
                self.changed_ns[host] = now_ns  # we were not looking: judge from now on
        self._last_ns = now_ns
        for host, value in beats.items():
            if value is None:
                continue
            if value.startswith(DONE):
                self.done.add(host)
            if self.values.get(host) != value or host not in self.changed_ns:
                self.values[host] = value
                self.changed_ns[host] = now_ns

    def lost(self, now_ns: int, exclude: Set[int] = frozenset()) -> List[int]:  # type: ignore[assignment]
        return sorted(
            h for h, t in self.changed_ns.items()
            if h not in self.done and h not in exclude and now_ns - t >= self.timeout_ns
        )

    def silent_s(self, host: int, now_ns: int) -> float:
        return (now_ns - self.changed_ns.get(host, now_ns)) / 1e9


def lost_host_failure(info: HostInfo, silent_s: float, config: Config, now_ns: int) -> Failure:
    """The record a bridge writes for a host that fell silent: on that host's lowest rank."""
    return Failure(
        rank=info.ranks[0] if info.ranks else 0, pid=0, time_ns=now_ns, cause=LOST, exit_code=config.exit_code,
        message=f"{info.describe()} lost: its heartbeat in the store has not advanced for {silent_s:.1f}s "
        f"(peer_timeout {config.peer_timeout:g}s): the host froze, crashed or was cut off",
        host=info.hostname,
    )


def lost_store_failure(
    store: str, hosts: Mapping[int, HostInfo], me: HostInfo, silent_s: float, config: Config, now_ns: int
) -> Failure:
    """The record a bridge writes when the store has been unreachable for peer_timeout.

    Named after the host of rank 0 (whose node serves ``MASTER_ADDR``'s store under
    init_process_group and torchrun), or the lowest remote rank known: never one of ours,
    since the local ranks are alive and only being cut off.
    """
    remote = [h for h in hosts.values() if h.index != me.index and h.ranks]
    holder = next((h for h in remote if 0 in h.ranks), None) or min(remote, key=lambda h: h.ranks[0], default=None)
    rank = holder.ranks[0] if holder is not None else 0
    where = f"; the store is served from {holder.describe()}" if holder is not None and 0 in holder.ranks else ""
    return Failure(
        rank=rank, pid=0, time_ns=now_ns, cause=LOST, exit_code=config.exit_code,
        message=f"the store at {store} has been unreachable for {silent_s:.1f}s (peer_timeout "
        f"{config.peer_timeout:g}s){where}: its host died, or {me.describe()} is cut off from it",
        host=holder.hostname if holder is not None else None,
    )


# -- the bridge -------------------------------------------------------------------------


class Bridge:
    """This rank's part in the exchange between hosts. Every rank has one; only the rank
    holding ``RUN/bridge.lock`` runs its threads. The watcher calls :meth:`tick` every
    heartbeat, :meth:`on_verdict` when it acts on a verdict, :meth:`on_success` when its
    rank finished cleanly."""

    def __init__(
        self, config: Config, run_dir: RunDir, me: Registration, endpoint: Any = None, run_id: Optional[str] = None
    ) -> None:
        self.config = config
        self.run_dir = run_dir
        self.me = me
        self.endpoint: Any = None
        self.address = ""
        self.run_id = ""
        self.prefix = ""
        self._created = time.monotonic()
        self._unresolved_warned = False
        self._set_target(endpoint, run_id)
        self.stopped = threading.Event()
        self.running = False
        self.index: Optional[int] = None
        self.hosts: Dict[int, HostInfo] = {}
        self.job_ending = False
        self.from_store: Optional[bytes] = None  # the verdict we took from the store
        self.published = False
        self.reachable = False  # the last interval's store requests all succeeded
        self.requests = 0  # store requests made by the beat thread (for the load test)
        self._lock_fd: Optional[int] = None
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._ranks: Tuple[int, ...] = ()
        self._ranks_mtime: Optional[int] = None
        self._seq = 0
        self._state: Dict[str, Any] = {}
        self._disabled = False
        self._lost_reported: Set[int] = set()
        self._store_lost_reported = False
        self._op_timeout = max(0.5, min(config.peer_timeout / 3, 10.0))
        self.liveness = Liveness(int(config.peer_timeout * 1e9))
        self._threads: List[threading.Thread] = []
        self._waiter_missing = False  # the user's store cannot clone(): the beat thread polls the verdict
        self._register_lock = threading.Lock()
        self._torch_imported = threading.Event()  # the waiter imports nothing before the beat thread did
        self.ident = hashlib.sha1(
            f"{_identity.boot_id()}|{_identity.pid_namespace()}|{run_dir.path}".encode()
        ).hexdigest()[:16]

    @classmethod
    def for_config(cls, config: Config, run_dir: RunDir, me: Registration, env: Optional[Mapping[str, str]] = None) -> Optional[Bridge]:
        """A bridge if the job spans hosts (or a store is set); its store and run id may
        still be unknown (resolved again at each heartbeat). None: no bridge needed."""
        env = os.environ if env is None else env
        if config.store == "off" or (config.store is None and not spans_hosts(config, env)):
            return None
        endpoint, _ = resolve_store(config, env)
        return cls(config, run_dir, me, endpoint, resolve_run_id(config, env))

    def _set_target(self, endpoint: Any, run_id: Optional[str]) -> None:
        if endpoint is not None and run_id:
            self.endpoint, self.run_id, self.prefix = endpoint, run_id, key_prefix(run_id)
            self.address = endpoint if isinstance(endpoint, str) else type(endpoint).__name__

    def _resolve_late(self) -> bool:
        """Where the launcher sets MASTER_ADDR/MASTER_PORT after install() (Lightning under
        Slurm does, in the training script), look again each heartbeat; warn once if the
        store stays unknown for peer_timeout."""
        if self.endpoint is not None:
            return True
        endpoint, why = resolve_store(self.config, os.environ)
        run_id = resolve_run_id(self.config, os.environ)
        self._set_target(endpoint, run_id)
        if self.endpoint is None and not self._unresolved_warned and (
            time.monotonic() - self._created >= self.config.peer_timeout
        ):
            self._unresolved_warned = True
            reason = why if endpoint is None else "nothing names the job on every host (set PEERWATCH_RUN_ID)"
            logger.warning("peerwatch: rank %d: no store bridge yet: %s; a failure on another host will not "
                           "reach this one", self.me.rank, reason)
        return self.endpoint is not None

    # -- called by the watcher ------------------------------------------------------------

    def tick(self) -> None:
        """Once per heartbeat: become this host's bridge if nobody is (the holder exited)."""
        if self.running or self._disabled or self.stopped.is_set():
            return
        if not self._resolve_late() or not self._take_lock():
            return
        self.running = True
        for target, name in ((self._beat_loop, "beat"), (self._wait_loop, "wait")):
            t = threading.Thread(target=self._guarded(target), name=f"peerwatch-bridge-{name}-rank{self.me.rank}", daemon=True)
            self._threads.append(t)
            t.start()

    def on_verdict(self, verdict: Verdict) -> None:
        """The watcher acts on ``verdict``: make sure the other hosts learn it (bounded)."""
        if self.from_store is not None or self.published:
            return
        local = {r for r, reg in self.run_dir.registrations().items() if is_local(reg)}
        if verdict.detected_by not in local:
            return  # made on another host: it came through the store
        data = encode(verdict)
        if self.running and not self.reachable:
            logger.info("peerwatch: the store at %s is unreachable: the verdict stays on this host", self.address)
            return
        if not self.running:
            # The holder may be the rank that just died: if the lock is free, we are the
            # bridge now, for as long as it takes to publish (torch must be loaded already).
            if self._disabled or not _torch_loaded() or not self._resolve_late() or not self._take_lock():
                return
        _bounded(lambda: self._publish(data), PUBLISH_BUDGET_S, "publish the verdict")

    hold_s = REMOTE_SETTLE_S  # the longest hold_until_ns() gives, in seconds

    def hold_until_ns(self, verdict: Verdict) -> Optional[int]:
        """Until when (``time.time_ns()``) the watcher should hold ``verdict`` back, deciding
        again meanwhile; None: act now. An exception (or an exit) on this host, while it is
        connected to the others, may be the echo of a death on another host (a collective
        that lost its peer raises within milliseconds), or of a local one whose pidfd has not
        fired yet: for ``REMOTE_SETTLE_S`` after it, a verdict from another host (one store
        round trip away) or a death seen meanwhile comes first."""
        if verdict.cause not in (EXCEPTION, EXIT) or verdict.detected_by != self.me.rank or not self._connected():
            return None
        return verdict.failed_at_ns + int(REMOTE_SETTLE_S * 1e9)

    def hold_until(self, verdict: Verdict) -> Optional[float]:
        """:meth:`hold_until_ns` as a ``time.monotonic()`` deadline."""
        until_ns = self.hold_until_ns(verdict)
        return None if until_ns is None else time.monotonic() + (until_ns - time.time_ns()) / 1e9

    def _connected(self) -> bool:
        """Is this host's bridge (run by any local rank) connected to the store?"""
        if self.running:
            return self.reachable
        try:
            with open(self.run_dir.join(STATE_FILE), "rb") as f:
                return json.loads(f.read(1 << 16)).get("connected") is True
        except (OSError, ValueError, AttributeError):
            return False

    def on_success(self) -> None:
        """This rank finished cleanly: the job is ending; tell the other hosts (bounded)."""
        self.job_ending = True
        if self.running and self._client is not None:
            _bounded(self._send_beat, PUBLISH_BUDGET_S, "mark this host done")

    def stop(self) -> None:
        self.stopped.set()

    # -- the lock ---------------------------------------------------------------------

    def _take_lock(self) -> bool:
        if self._lock_fd is not None:
            return True
        try:
            fd = os.open(self.run_dir.join(LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            self.run_dir.warn_once(self.run_dir.join(LOCK_FILE), f"cannot be opened ({e.strerror}); no store bridge")
            self._disabled = True
            return False
        try:
            # lockf: a POSIX lock belongs to this process (not to a forked DataLoader worker)
            # and the kernel drops it when the process ends, however it ends.
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EACCES, errno.EAGAIN):
                self.run_dir.warn_once(self.run_dir.join(LOCK_FILE), f"cannot be locked ({e.strerror}); no store bridge")
                self._disabled = True
            return False
        self._lock_fd = fd
        return True

    # -- the store connection -----------------------------------------------------------

    def _connect(self, timeout: float) -> Any:
        """A new client of the store, or the user's Store; raises on failure."""
        import torch.distributed as dist  # the bridge's thread only: `import peerwatch` stays light

        if not isinstance(self.endpoint, str):
            return self.endpoint
        host, _, port = self.endpoint.rpartition(":")
        # Probe with a plain socket first: torch's client logs a C++ stack trace per failed
        # attempt, and the store does not exist before init_process_group.
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
        return dist.TCPStore(
            host, int(port), is_master=False, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout),
        )

    def _waiter_client(self) -> Any:
        if isinstance(self.endpoint, str):
            return self._connect(self._op_timeout)
        clone = getattr(self.endpoint, "clone", None)
        return clone() if clone is not None else None

    # -- the beat thread ---------------------------------------------------------------

    def _beat_loop(self) -> None:
        """Supervises the store I/O, which runs in a worker thread: torch's client does not
        honour its timeout on a silent peer (a partition: no RST, no answer), so a store
        request can block forever. A worker that overruns its deadline is abandoned with
        its connection, and the store counts as unreachable."""
        interval = self.config.heartbeat_interval
        deadline_s = min(2 * self._op_timeout, self.config.peer_timeout / 2)
        backoff = interval
        try:
            # Here, not in the worker: importing torch takes seconds on a busy host, and
            # is no sign of an unreachable store.
            _import_torch()
        except ImportError as e:
            self._disabled = True
            level = logging.WARNING if self.config.store is not None else logging.INFO
            logger.log(level, "peerwatch: no store bridge (torch.distributed cannot be imported: %s); "
                       "failures on other hosts will not reach this one", e)
            return
        finally:
            self._torch_imported.set()
        last_ok: Optional[float] = None
        worker: Optional[_Worker] = None
        while not self.stopped.is_set():
            started = time.monotonic()
            if worker is None:
                worker = _Worker(f"peerwatch-bridge-io-rank{self.me.rank}")
            try:
                worker.run(self._io, deadline_s + (2 * self._op_timeout if self._client is None else 0.0))
                self.reachable = True
                last_ok = time.monotonic()
                backoff = interval
            except Exception as e:  # noqa: BLE001 - the store's errors are many (DistError, OSError, ...)
                logger.debug("peerwatch: store %s: %r", self.address, e)
                self.reachable = False
                if isinstance(e, _Overrun):
                    worker.stop()  # it ends when (if ever) the store answers: a daemon meanwhile
                    worker = None
                if isinstance(self.endpoint, str):
                    self._client = None
                self._write_state(connected=False)
                now = time.monotonic()
                if last_ok is not None and now - last_ok >= self.config.peer_timeout:
                    self._store_lost(now - last_ok)
                if self.stopped.wait(backoff):
                    break
                backoff = min(backoff * 2, CONNECT_BACKOFF_MAX_S, max(interval, self.config.peer_timeout / 4))
                continue
            self.stopped.wait(max(0.0, interval - (time.monotonic() - started)))
        if worker is not None:
            worker.stop()

    def _io(self) -> None:
        """One interval's store work (in the worker): connect if need be, beat, look."""
        if self._client is None:
            self._client = self._connect(self._op_timeout)
        if self.index is None:
            self._register()
            logger.info("peerwatch: rank %d bridges host %s (index %s) to the store at %s (run %s)",
                        self.me.rank, _identity.hostname(), self.index, self.address, self.run_id)
        self._interval()

    def _register(self) -> None:
        """Take this host's index; a successor (the holder's rank exited) takes the same one,
        or the old index would go silent and be judged lost."""
        c = self._client
        # An abandoned worker (the store was slow) may still be registering: one at a time.
        if not self._register_lock.acquire(timeout=self._op_timeout):
            raise TimeoutError("another registration is still under way")
        try:
            if self.index is not None:
                return
            key = self.prefix + f"index/{self.ident}"
            index = int(c.get(key)) if c.check([key]) else None
            if index is None:
                index = int(c.add(self.prefix + "hosts", 1)) - 1
                c.set(key, str(index))
            self.index = index
        finally:
            self._register_lock.release()
        self._send_beat()
        self._publish_host(force=True)
        self.requests += 1

    def _publish_host(self, force: bool = False) -> None:
        """(Re)write host/<i> when the set of local ranks changed."""
        try:
            mtime = os.stat(self.run_dir.join(RANKS)).st_mtime_ns
        except OSError:
            mtime = None
        if not force and mtime == self._ranks_mtime:
            return
        self._ranks_mtime = mtime
        ranks = tuple(sorted(r for r, reg in self.run_dir.registrations().items() if is_local(reg)))
        if not force and ranks == self._ranks:
            return
        self._ranks = ranks
        me = self._me_info()
        self._client.set(self.prefix + f"host/{self.index}", me.to_json())
        self.requests += 1
        self.hosts[me.index] = me

    def _me_info(self) -> HostInfo:
        return HostInfo(self.index if self.index is not None else -1, _identity.hostname(), _identity.boot_id(),
                        _identity.pid_namespace(), self._ranks, self.ident)

    def _send_beat(self) -> None:
        with self._client_lock:
            self._seq += 1
            value = (DONE if self.job_ending else b"") + str(self._seq).encode()
        self._client.set(self.prefix + f"beat/{self.index}", value)
        self.requests += 1

    def _interval(self) -> None:
        c = self._client
        if not self.job_ending and self._local_success():
            self.job_ending = True
        self._send_beat()
        self._publish_host()
        expected = self._expected_hosts()
        if expected is None or len(self.hosts) < expected:
            count = int(c.add(self.prefix + "hosts", 0))
            self.requests += 1
            for j in range(count):
                if j not in self.hosts and j != self.index:
                    # host/<j> is written after beat/<j>: once it exists both do.
                    if c.check([self.prefix + f"host/{j}"]):
                        self.hosts[j] = HostInfo.from_json(j, c.get(self.prefix + f"host/{j}"))
                    self.requests += 1
        # Never judge ourselves: an index of our own (a registration that raced) is no peer.
        others = sorted(j for j, h in self.hosts.items() if j != self.index and h.ident != self.ident)
        if others:
            values = c.multi_get([self.prefix + f"beat/{j}" for j in others])
            self.requests += 1
            now_ns = time.monotonic_ns()
            self.liveness.observe(now_ns, dict(zip(others, values)))
            if self.liveness.done:
                self.job_ending = True
            if not self.job_ending and not self._verdict_known():
                for j in self.liveness.lost(now_ns, exclude=self._lost_reported):
                    self._host_lost(j, self.liveness.silent_s(j, now_ns))
        if self._waiter_missing:
            if c.check([self.prefix + "verdict"]):
                self._take_store_verdict(c.get(self.prefix + "verdict"))
            self.requests += 1
        self._write_state(connected=True)

    def _expected_hosts(self) -> Optional[int]:
        """How many hosts the job has, when the launcher says: then we stop looking for more."""
        w, lw = self.config.world_size, self.config.local_world_size
        if w and lw:
            return -(-w // lw)
        for var in ("SLURM_NNODES", "SLURM_JOB_NUM_NODES", "GROUP_WORLD_SIZE"):
            value = os.environ.get(var, "")
            if value.isdigit() and int(value) > 0:
                return int(value)
        return None

    def _local_success(self) -> bool:
        try:
            return any(name.startswith("success-") for name in os.listdir(self.run_dir.join(EVENTS)))
        except OSError:
            return False

    # -- the waiter thread -------------------------------------------------------------

    def _wait_loop(self) -> None:
        key = self.prefix + "verdict"
        backoff = self.config.heartbeat_interval
        client = None
        while not self._torch_imported.wait(1.0):
            if self.stopped.is_set():
                return
        if self._disabled:
            return
        while not self.stopped.is_set() and self.from_store is None:
            try:
                if client is None:
                    client = self._waiter_client()
                    if client is None:
                        self._waiter_missing = True
                        return
                client.wait([key], datetime.timedelta(seconds=WAIT_CHUNK_S))
                self._take_store_verdict(client.get(key))
                return
            except ImportError:
                return
            except Exception as e:  # noqa: BLE001
                logger.debug("peerwatch: waiting on the store %s: %s", self.address, e)
                client = None
                if self.stopped.wait(backoff):
                    return
                backoff = min(backoff * 2, CONNECT_BACKOFF_MAX_S)

    def _take_store_verdict(self, data: bytes) -> None:
        verdict = decode(Verdict, data)
        if verdict is None:
            logger.error("peerwatch: the store holds a verdict for run %s that is not a valid record; ignored", self.run_id)
            return
        self.from_store = data
        try:
            written = self.run_dir.write(EVENTS, VERDICT_FILE, data, valid=lambda d: decode(Verdict, d) is not None)
        except OSError as e:
            logger.error("peerwatch: the verdict from another host cannot be written into %s: %s", self.run_dir.path, e)
            return
        if written:
            where = f" (pid {verdict.pid} on {verdict.host})" if verdict.pid else (f" (on {verdict.host})" if verdict.host else "")
            logger.error("peerwatch: verdict from another host: rank %d%s %s; cause: %s. Tearing down the ranks "
                         "of host %s.", verdict.rank, where, verdict.detail, verdict.cause, _identity.hostname())

    # -- verdicts going out ------------------------------------------------------------

    def _publish(self, data: bytes) -> None:
        client = self._client
        if client is None:
            client = self._connect(min(self._op_timeout, PUBLISH_BUDGET_S))
        key = self.prefix + "verdict"
        current = client.compare_set(key, "", data)
        self.published = True
        if current != data:
            logger.info("peerwatch: the store already held another host's verdict for run %s", self.run_id)

    def _host_lost(self, j: int, silent_s: float) -> None:
        self._lost_reported.add(j)
        info = self.hosts[j]
        if self._client is not None:
            try:  # its ranks may have registered after we first read host/<j>
                info = HostInfo.from_json(j, self._client.get(self.prefix + f"host/{j}"))
            except Exception as e:  # noqa: BLE001
                logger.debug("peerwatch: host/%d cannot be read again (%s); naming the ranks known", j, e)
        self._write_failure(lost_host_failure(info, silent_s, self.config, time.time_ns()))

    def _verdict_known(self) -> bool:
        return self.from_store is not None or self.published or os.path.lexists(self.run_dir.join(EVENTS, VERDICT_FILE))

    def _store_lost(self, silent_s: float) -> None:
        if self._store_lost_reported or self.job_ending or self._local_success() or self._verdict_known():
            return
        self._store_lost_reported = True
        self._write_failure(lost_store_failure(self.address, self.hosts, self._me_info(), silent_s, self.config, time.time_ns()))

    def _write_failure(self, failure: Failure) -> None:
        logger.error("peerwatch: %s", failure.message)
        try:
            self.run_dir.write(EVENTS, rank_file("failure", failure.rank), encode(failure),
                               valid=lambda d: decode(Failure, d) is not None)
        except OSError as e:
            logger.error("peerwatch: cannot record that %s: %s", failure.message, e)

    # -- state for people and tests ------------------------------------------------------

    def _write_state(self, connected: bool) -> None:
        state = {
            "rank": self.me.rank, "pid": os.getpid(), "store": self.address, "run_id": self.run_id,
            "connected": connected, "index": self.index, "ranks": list(self._ranks),
            "hosts": {str(j): h.hostname for j, h in sorted(self.hosts.items())},
            "lost": sorted(self._lost_reported), "job_ending": self.job_ending,
        }
        if state == self._state:
            return
        self._state = state
        try:
            self.run_dir.write("", STATE_FILE, json.dumps(state).encode(), replace=True)
        except OSError as e:
            logger.debug("peerwatch: cannot write %s: %s", STATE_FILE, e)  # for people only: no harm

    def _guarded(self, target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException:  # noqa: BLE001 - never die silently
                logger.exception("peerwatch: the store bridge of rank %d failed; failures on other hosts may "
                                 "not reach this one", self.me.rank)
        return run


def _torch_loaded() -> bool:
    """torch and torch.distributed are imported, completely (not under way in another thread)."""
    for name in ("torch", "torch.distributed"):
        module = sys.modules.get(name)
        if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
            return False
    return True


def _import_torch() -> None:
    """Import torch.distributed from a bridge thread without breaking the application's own
    import of torch. ``import torch.distributed`` would take the submodule's import lock
    and then wait for ``torch``'s: if the main thread is importing torch at that moment,
    torch's own __init__ needs the submodule (torch._jit_internal imports
    torch.distributed.rpc), Python sees a deadlock and hands out half-initialised modules
    ("'torch._C' is not a package"). ``import torch`` alone holds nothing while it waits
    for another thread's import to finish; torch.distributed is then already there."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401


class _Overrun(Exception):
    """The store did not answer within the deadline."""


class _Worker:
    """One thread that runs the bridge's store I/O, so that its caller can give up on it."""

    def __init__(self, name: str) -> None:
        self._job: Optional[Callable[[], None]] = None
        self._error: Optional[BaseException] = None
        self._go = threading.Event()
        self._done = threading.Event()
        self._quit = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def run(self, job: Callable[[], None], timeout: float) -> None:
        """Run ``job`` in the worker; re-raise its exception; raise _Overrun after ``timeout``."""
        self._job, self._error = job, None
        self._done.clear()
        self._go.set()
        if not self._done.wait(timeout):
            raise _Overrun(f"no answer within {timeout:.2f}s")
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        self._quit = True
        self._go.set()

    def _main(self) -> None:
        while True:
            self._go.wait()
            self._go.clear()
            if self._quit:
                return
            try:
                assert self._job is not None
                self._job()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                self._error = e
            self._done.set()


def _bounded(fn: Callable[[], None], budget_s: float, what: str) -> None:
    """Run ``fn`` in a helper thread and wait at most ``budget_s``: a store that does not
    answer must not hold up the teardown."""
    def run() -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            logger.warning("peerwatch: could not %s through the store: %s", what, e)
    t = threading.Thread(target=run, name="peerwatch-bridge-publish", daemon=True)
    try:
        t.start()
    except RuntimeError:  # at interpreter shutdown (atexit, Python 3.12+): no new threads
        run()
        return
    t.join(budget_s)
    if t.is_alive():
        logger.warning("peerwatch: could not %s through the store within %gs", what, budget_s)


__all__ = [
    "Bridge", "HostInfo", "Liveness", "key_prefix", "lost_host_failure", "lost_store_failure", "ranks_text",
    "resolve_run_id", "resolve_store", "spans_hosts",
]
