"""Several hosts on this machine: each a PID + UTS namespace of its own (``unshare``), one
of them optionally in a network namespace of its own (for the partition), a real TCPStore
served by the first host, real ranks with peerwatch installed, a run directory per host.

Each simulated host is ``tests/multihost_program.py host`` as PID 1 of its namespace: the
hosts' pids mean nothing to each other, so only the store bridge can carry a failure from
one to another. Needs root (namespaces); skipped otherwise.

The bridge's pure parts are unit-tested in test_hosts.py and test_launcher_facts.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import psutil
import pytest
from harness import _FOREIGN_ENV, free_port

from peerwatch.core.config import Config
from peerwatch.core.records import LOST, Failure, Registration, decode, encode
from peerwatch.hosts.bridge import Bridge
from peerwatch.hosts.hosts import REMOTE_SETTLE_S
from peerwatch.rundir.rundir import RunDir

PROGRAM = Path(__file__).with_name("multihost_program.py")
HEARTBEAT_S = 0.5
PEER_TIMEOUT_S = 2.5
GRACE_S = 1.0
START_S = 30.0  # a later step of the ranks once connected (torch imported, a process group joined), on 2 cores
# Every host's first rank through its import of torch.distributed: the machine's pace, not
# peerwatch's (the host that serves the store imports torch twice in series, its agent's
# and its rank's: 22 s at load 20 on these 2 cores, past 30 s beside a full suite).
IMPORT_S = 45.0
# From then, every bridge connected and counting every host: peerwatch's part (a watcher's
# tick, the first requests' spread, a connection, a heartbeat or two: 0.2-1.5 s at load 20).
CONNECT_S = 10.0
# A failure on one host -> every process of the other hosts gone: the verdict crosses in
# one store round trip, then the usual local teardown (ack window, grace for a stuck rank).
CROSS_S = 4.0
# A host (or the store) silent -> the others gone: peer_timeout, a heartbeat for the
# aggregator to notice, one for the others to read its digest (docs/multi-node.md's bound),
# one for loaded intervals (before the digest, the second heartbeat was that margin), the teardown.
LOST_S = PEER_TIMEOUT_S + 3 * HEARTBEAT_S + CROSS_S
# How a torn-down rank ends: with the verdict's exit code, or, if its own watcher was too
# slow to acknowledge the verdict (2 loaded cores), SIGTERMed by a peer after the ack window.
TORN_DOWN = {1, -signal.SIGTERM}


def _config(**kw: object) -> Config:
    return Config.resolve(kw, env={})


def test_a_bridge_finds_its_store_late(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning under Slurm sets MASTER_ADDR/MASTER_PORT after install(): looked up again."""
    for var in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PEERWATCH_STORE"):
        monkeypatch.delenv(var, raising=False)
    me = Registration(rank=0, pid=1, ppid=0, start_ticks=0, uid=0, host="h", boot_id="b", pidns="p", time_ns=0)
    rd = RunDir(str(tmp_path))
    assert Bridge.for_config(_config(world_size=4, local_world_size=4), rd, me, env={}) is None
    assert Bridge.for_config(_config(world_size=8, local_world_size=4, store="off"), rd, me, env={}) is None
    b = Bridge.for_config(_config(world_size=8, local_world_size=4), rd, me, env={})
    assert b is not None and not b._resolve_late()
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert b._resolve_late() and b.address == "node0:29500" and b.prefix == "peerwatch/master-node0:29500/"


# -- two bridges in this process, through a Store object (no root needed) --------------------


def _in_process_host(tmp: Path, name: str, ranks: Sequence[int], store: object, **options: object) -> Bridge:
    """A bridge for a 'host' whose ranks are registered in its own run directory."""
    from peerwatch.proc import identity
    from peerwatch.rundir.rundir import _SUBDIRS, RANKS, rank_file

    rd = RunDir(str(tmp / name))
    os.makedirs(rd.path)
    for sub in _SUBDIRS:
        os.mkdir(rd.join(sub))
    me = identity.self_info()
    regs = [
        Registration(rank=r, pid=me.pid, ppid=me.ppid, start_ticks=me.start_ticks, uid=me.uid, host=name,
                     boot_id=identity.boot_id(), pidns=identity.pid_namespace(), time_ns=time.time_ns())
        for r in ranks
    ]
    for reg in regs:
        rd.write(RANKS, rank_file("rank", reg.rank), encode(reg), replace=True)
    config = _config(store=store, run_id="inproc", heartbeat_interval=0.2, peer_timeout=1.0, **options)
    bridge = Bridge.for_config(config, rd, regs[0], env={})
    assert bridge is not None
    bridge.tick()
    return bridge


def _wait_for(cond, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not {what} within {timeout}s"
        time.sleep(0.02)  # a deadline-bounded look at files


class _NoClone:
    """A store without clone(): the bridge cannot block in a wait, so it polls the verdict."""

    def __init__(self, store: object) -> None:
        self._store = store

    def __getattr__(self, name: str) -> object:
        if name in ("set", "get", "add", "check", "multi_get", "compare_set"):
            return getattr(self._store, name)
        raise AttributeError(name)


@pytest.mark.parametrize("clone", [True, False], ids=["waits", "polls"])
def test_bridges_through_a_store_object(tmp_path: Path, clone: bool) -> None:
    """install(store=obj): a verdict crosses; a host that stops beating is lost; one that
    said done is not. Real bridges, real threads, a torch HashStore shared in-process
    (with clone(): the verdict arrives by a blocking wait; without: by a check per beat)."""
    dist = pytest.importorskip("torch.distributed")
    hash_store = dist.HashStore()
    store = hash_store if clone else _NoClone(hash_store)
    a = _in_process_host(tmp_path, "hosta", [0, 1], store)
    b = _in_process_host(tmp_path, "hostb", [2, 3], store)
    c = _in_process_host(tmp_path, "hostc", [4, 5], store)
    try:
        # One host aggregates (the first to register); the others read its digest, which says 3 joined.
        _wait_for(lambda: all(x.joined == 3 for x in (a, b, c)), 10.0, "every host seen")
        # b goes quiet without a word: lost after peer_timeout, named by its lowest rank.
        b.stop()
        failure_b = a.run_dir.join("events", "failure-00002.json")
        _wait_for(lambda: os.path.exists(failure_b), 5.0, "host b judged lost by host a")
        f = decode(Failure, Path(failure_b).read_bytes())
        assert f is not None and (f.rank, f.cause) == (2, LOST) and "ranks 2-3) lost" in (f.message or "")
        # c finishes cleanly: its beat says done, and the job is ending for everyone.
        c.on_success()
        c.stop()
        _wait_for(lambda: a.job_ending, 5.0, "host c seen done by host a (itself, or through the digest)")
        assert c.index not in a.liveness.lost(time.monotonic_ns() + 10**12)  # never lost, however long
        # A verdict published by a reaches the waiters of the others' store (first writer wins).
        from peerwatch.core.records import Verdict

        now = time.time_ns()
        v = Verdict(rank=0, cause="exception", exit_code=1, failed_at_ns=now, detected_by=1, detected_at_ns=now,
                    host="hosta", detail="raised RuntimeError")
        a.on_verdict(v)
        assert hash_store.get("peerwatch/inproc/verdict") == encode(v)
        _wait_for(lambda: a.from_store is not None, 5.0, "the verdict back through a's waiter")
    finally:
        for x in (a, b, c):
            x.stop()


class _Silent:
    """A store without clone() that stops answering while ``silent`` is set (each request
    blocks until ``answer`` is set), as a stopped store server does."""

    def __init__(self, store: object, silent: threading.Event, answer: threading.Event) -> None:
        self._store, self._silent, self._answer = store, silent, answer

    def __getattr__(self, name: str) -> object:
        if name not in ("set", "get", "add", "check", "multi_get", "compare_set"):
            raise AttributeError(name)
        method = getattr(self._store, name)

        def call(*args: object) -> object:
            if self._silent.is_set():
                self._answer.wait(60.0)
            return method(*args)

        return call


def test_a_store_that_does_not_answer_is_asked_once_to_mark_the_host_done(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """Leaving watch() and then the exit both say that the rank succeeded: the done beat is
    sent once, its wait bounded; a store that did not answer is not waited for again."""
    dist = pytest.importorskip("torch.distributed")
    silent, answer = threading.Event(), threading.Event()
    a = _in_process_host(tmp_path, "hosta", [0, 1], _Silent(dist.HashStore(), silent, answer))
    try:
        _wait_for(lambda: a.connected and a.index is not None, 10.0, "host a connected")
        silent.set()
        with caplog.at_level(logging.WARNING, logger="peerwatch"):
            a.on_success()
            a.on_success()
        said = [r for r in caplog.records if "could not mark this host done" in r.getMessage()]
        assert len(said) == 1, [r.getMessage() for r in said]
    finally:
        answer.set()
        a.stop()


def test_bridges_with_a_store_secret_sign_what_they_write_and_replace_a_forged_verdict(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """store_secret on every host: they see each other through signed host records and beats;
    a verdict forged in the store before anything failed is ignored, and replaced by the
    first real one, which every host takes (docs/security.md)."""
    dist = pytest.importorskip("torch.distributed")
    from peerwatch.core.records import Verdict
    from peerwatch.hosts.store_protocol import SIGNED, verdict_key

    caplog.set_level(logging.WARNING, logger="peerwatch")
    hash_store = dist.HashStore()
    secret = "a-secret-every-host-of-the-job-shares"
    a = _in_process_host(tmp_path, "hosta", [0, 1], hash_store, store_secret=secret)
    b = _in_process_host(tmp_path, "hostb", [2, 3], hash_store, store_secret=secret)
    try:
        _wait_for(lambda: all(x.joined == 2 for x in (a, b)), 10.0, "every host seen")
        assert hash_store.get("peerwatch/inproc/beat/0").startswith(SIGNED)
        # One nonce for the run, kept in each host's run directory for a successor bridge there.
        from peerwatch.hosts.bridge import NONCE_FILE, _Kept
        from peerwatch.hosts.store_protocol import Seal

        assert a._seal.nonce is not None and a._seal.nonce == b._seal.nonce
        assert Path(a.run_dir.join(NONCE_FILE)).read_bytes() == a._seal.nonce
        assert Seal(secret.encode(), memo=_Kept(a.run_dir, NONCE_FILE)).nonce == a._seal.nonce
        now = time.time_ns()
        forged = Verdict(rank=3, cause="exception", exit_code=77, failed_at_ns=now, detected_by=3, detected_at_ns=now)
        hash_store.set("peerwatch/inproc/verdict", encode(forged))  # where it was before the store's nonce
        # and where this run's verdict goes (named from the secret and the run's nonce)
        hash_store.set(verdict_key("peerwatch/inproc/", a._seal), encode(forged))
        unsigned = "not signed with this job's store secret"
        _wait_for(lambda: caplog.text.count(unsigned) >= 2, 5.0, "both waiters rejecting the forged verdict")
        assert a.from_store is None and b.from_store is None
        assert not os.path.exists(b.run_dir.join("events", "verdict.json"))
        now = time.time_ns()
        v = Verdict(rank=0, cause="exception", exit_code=1, failed_at_ns=now, detected_by=1, detected_at_ns=now,
                    host="hosta", detail="raised RuntimeError")
        a.on_verdict(v)
        assert a.published
        _wait_for(lambda: b.from_store is not None, 5.0, "the signed verdict taken by host b")
        assert decode(Verdict, b.from_store) == v
    finally:
        for x in (a, b):
            x.stop()


# -- simulated hosts -------------------------------------------------------------------------

_NEEDS = "simulated hosts need root (unshare --pid --uts, ip netns) and util-linux's unshare"
_can_simulate = os.geteuid() == 0 and shutil.which("unshare") is not None and shutil.which("ip") is not None
multihost = pytest.mark.skipif(not _can_simulate, reason=_NEEDS)


class Host:
    """A simulated host: ``multihost_program.py host`` as PID 1 of new PID/UTS namespaces."""

    def __init__(self, tmp: Path, name: str, ranks: Sequence[int]) -> None:
        self.name = name
        self.ranks = list(ranks)
        self.dir = tmp / name
        self.ready = self.dir / "ready"
        self.run = self.dir / "run"
        self.ready.mkdir(parents=True)
        self.popen: Optional[subprocess.Popen] = None
        self.netns: Optional[str] = None
        self.pidfds: Dict[int, int] = {}  # global pid -> pidfd of every process of this host
        self.roles: Dict[int, str] = {}  # global pid -> 'init' / 'rank <r>'
        self.gone_ns: Optional[int] = None

    def start(self, argv: List[str], env: Dict[str, str]) -> None:
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        cmd = [*prefix, "unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--uts", *argv]
        with open(self.dir / "host.log", "wb") as log:
            self.popen = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

    def processes(self) -> Dict[str, psutil.Process]:
        """'init' (PID 1 of the namespace) and 'rank <r>', found by their environment."""
        found = {}
        assert self.popen is not None
        try:
            tree = psutil.Process(self.popen.pid).children(recursive=True)
        except psutil.Error:
            return found
        for proc in tree:
            try:
                env = proc.environ()
            except (psutil.Error, OSError):
                continue
            if env.get("MULTIHOST_HOST") != self.name:
                continue
            found[f"rank {env['MULTIHOST_RANK']}" if "MULTIHOST_RANK" in env else "init"] = proc
        return found

    def hold(self) -> None:
        for role, proc in self.processes().items():
            if proc.pid not in self.pidfds:
                with contextlib.suppress(ProcessLookupError):
                    self.pidfds[proc.pid] = os.pidfd_open(proc.pid)
                    self.roles[proc.pid] = role

    def still_living(self) -> str:
        """Which of its processes are alive, and where each thread sleeps (for a failure's message)."""
        out = []
        for pid, fd in self.pidfds.items():
            if select.select([fd], [], [], 0)[0]:
                continue
            threads = []
            with contextlib.suppress(OSError):
                for task in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
                    with contextlib.suppress(OSError):
                        state = Path(f"/proc/{pid}/task/{task}/stat").read_text().rsplit(")", 1)[1].split()[0]
                        wchan = Path(f"/proc/{pid}/task/{task}/wchan").read_text() or "-"
                        threads.append(f"{state}:{wchan}")
            out.append(f"{self.name} {self.roles.get(pid, '?')} (pid {pid}): {' '.join(threads) or 'gone'}")
        return "; ".join(out)

    def pid_of(self, what: str) -> int:
        return self.processes()[what].pid

    def signal(self, what: str, sig: int) -> None:
        """Send sig to 'init' / 'rank <r>' / 'ranks' of this host (held by pidfd: no pid reuse)."""
        self.hold()
        targets = [p for k, p in self.processes().items() if (k.startswith("rank") if what == "ranks" else k == what)]
        assert targets, f"{what} of {self.name} not found"
        for proc in targets:
            signal.pidfd_send_signal(self.pidfds[proc.pid], sig)

    def living(self) -> List[int]:
        out = [fd for fd in self.pidfds.values() if not select.select([fd], [], [], 0)[0]]
        if self.popen is not None and self.popen.poll() is None:
            out.append(-1)
        return out

    def bridge_state(self) -> dict:
        try:
            return json.loads((self.run / "bridge.json").read_text())
        except (OSError, ValueError):
            return {}

    def verdict(self) -> Optional[dict]:
        try:
            return json.loads((self.run / "events" / "verdict.json").read_text())
        except (OSError, ValueError):
            return None

    def verdict_written_ns(self) -> int:
        return (self.run / "events" / "verdict.json").stat().st_mtime_ns

    def exit_codes(self) -> Dict[int, Optional[int]]:
        codes: Dict[int, Optional[int]] = {}
        for rank in self.ranks:
            try:
                codes[rank] = int((self.ready / f"exit-{rank}").read_text())
            except (OSError, ValueError):
                codes[rank] = None
        return codes

    def logs(self) -> str:
        out = []
        for path in sorted(self.ready.glob("log-*")) + [self.dir / "host.log"]:
            with contextlib.suppress(OSError):
                out.append(f"--- {self.name}: {path.name} ---\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(out)

    def close(self) -> None:
        for fd in self.pidfds.values():
            os.close(fd)
        self.pidfds.clear()
        if self.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=5)


class Cluster:
    """Three hosts of two ranks each by default; host ``a`` serves the store."""

    def __init__(self, tmp: Path, names: Sequence[str] = ("a", "b", "c"), per_host: int = 2,
                 isolated: Optional[str] = None) -> None:
        self.tmp = tmp
        self.world = per_host * len(names)
        self.hosts = {n: Host(tmp, f"host{n}", range(i * per_host, (i + 1) * per_host)) for i, n in enumerate(names)}
        self.port = free_port()
        self.run_id = uuid.uuid4().hex[:12]
        self.isolated = isolated
        self._veth = ""
        self.outer = self.inner = ""
        self.netns: List[str] = []
        self._make_netns(isolated)

    def _make_netns(self, isolated: Optional[str]) -> None:
        """Every host runs in network namespaces made here, never in the machine's: no
        packet leaves (torch's client asks DNS for the name of each peer address it
        connects to; without a route, that fails at once rather than timing out)."""
        tag = self.run_id[:6]
        cluster = f"pwc-{tag}"
        steps = [["ip", "netns", "add", cluster], ["ip", "-n", cluster, "link", "set", "lo", "up"]]
        self.netns.append(cluster)
        for host in self.hosts.values():
            host.netns = cluster
        if isolated is not None:
            # The isolated host: its own namespace, a veth pair to the cluster's, a private /30.
            alone, self._veth = f"pwp-{tag}", f"pw{tag}a"
            self.hosts[isolated].netns = alone
            self.netns.append(alone)
            subnet = int(self.run_id[6:8], 16)
            self.outer, self.inner = f"10.213.{subnet}.1", f"10.213.{subnet}.2"
            steps += [
                ["ip", "netns", "add", alone],
                ["ip", "-n", cluster, "link", "add", self._veth, "type", "veth", "peer", "name", f"pw{tag}b",
                 "netns", alone],
                ["ip", "-n", cluster, "addr", "add", f"{self.outer}/30", "dev", self._veth],
                ["ip", "-n", cluster, "link", "set", self._veth, "up"],
                ["ip", "-n", alone, "addr", "add", f"{self.inner}/30", "dev", f"pw{tag}b"],
                ["ip", "-n", alone, "link", "set", f"pw{tag}b", "up"],
                ["ip", "-n", alone, "link", "set", "lo", "up"],
            ]
        for step in steps:
            out = subprocess.run(step, capture_output=True, text=True, timeout=10)
            if out.returncode != 0:
                self.close()
                pytest.skip(f"cannot build network namespaces ({' '.join(step)}: {out.stderr.strip()})")

    def partition(self) -> None:
        """Cut the isolated host off: the cluster's end of its link goes down."""
        subprocess.run(["ip", "-n", self.netns[0], "link", "set", self._veth, "down"], check=True, timeout=10)

    def start(self, behave: Sequence[str] = (), serve: bool = True, env: Optional[Dict[str, str]] = None,
              hold: str = "") -> Cluster:
        base = {k: v for k, v in os.environ.items() if k not in _FOREIGN_ENV}
        base.update(
            PEERWATCH_HEARTBEAT=str(HEARTBEAT_S), PEERWATCH_PEER_TIMEOUT=str(PEER_TIMEOUT_S),
            PEERWATCH_GRACE=str(GRACE_S), PEERWATCH_RUN_ID=self.run_id, PYTHONUNBUFFERED="1",
            MASTER_PORT=str(self.port), GLOO_SOCKET_IFNAME="lo",
        )
        base.update(env or {})
        first = next(iter(self.hosts.values()))
        for key, host in self.hosts.items():
            env = dict(base, PEERWATCH_DIR=str(host.run), MULTIHOST_HOST=host.name,
                       MASTER_ADDR=self.outer if key == self.isolated else "127.0.0.1")
            argv = [sys.executable, str(PROGRAM), "host", "--name", host.name, "--world", str(self.world),
                    "--ranks", ",".join(map(str, host.ranks)), "--ready", str(host.ready)]
            for item in behave:
                argv += ["--behave", item]
            if host is first and serve:
                argv += ["--serve", str(self.port)] + (["--hold", hold] if hold else [])
            host.start(argv, env)
        return self

    def wait_connected(self) -> None:
        """Every rank registered and every host's bridge sees every host with all its ranks:
        first a rank of every host through its import of torch.distributed (``IMPORT_S``:
        the machine's pace), then every bridge connected and counting every host within
        ``CONNECT_S`` (peerwatch's part, bounded on its own)."""
        n = len(self.hosts)

        def ready(h: Host) -> bool:
            s = h.bridge_state()
            return (
                all((h.ready / f"rank-{r}").exists() for r in h.ranks)
                and s.get("connected") is True and s.get("joined") == n and s.get("ranks") == h.ranks
                and s.get("rank0") is not None  # whom a lost store is blamed on (through the digest)
            )

        def state() -> str:
            return "\n".join(
                f"{h.name}: ready {[r for r in h.ranks if (h.ready / f'rank-{r}').exists()]} of {list(h.ranks)}; "
                f"torch.distributed imported by {[r for r in h.ranks if (h.ready / f'imported-{r}').exists()]}; "
                f"bridge.json {h.bridge_state()}" for h in self.hosts.values()
            )

        self._wait(lambda: all(any(h.ready.glob("imported-*")) for h in self.hosts.values()), IMPORT_S,
                   "torch.distributed imported on every host (the machine's pace, before any bridge)", state,
                   alive=True)
        self._wait(lambda: all(ready(h) for h in self.hosts.values()), CONNECT_S,
                   "every host connected once torch.distributed was imported on every host", state, alive=True)
        for h in self.hosts.values():
            h.hold()

    def _wait(self, cond, timeout: float, what: str, state=None, alive: bool = False) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while not cond():
            for h in self.hosts.values():
                if alive and h.popen is not None and h.popen.poll() is not None:
                    raise AssertionError(f"{h.name} ended before {what}\n{self.logs()}")
            if time.monotonic() >= deadline:
                seen = f"{state()}\n" if state is not None else ""
                raise AssertionError(f"not {what} within {timeout}s\n{seen}{self.logs()}")
            time.sleep(0.02)  # a deadline-bounded look at files; nothing to poll(2) on here

    def wait_gone(self, names: Sequence[str], within: float) -> float:
        """Wait until every process of these hosts is gone; returns the seconds it took."""
        start = time.monotonic()
        hosts = [self.hosts[n] for n in names]
        poller = select.poll()
        fds = {fd for h in hosts for fd in h.living() if fd >= 0}
        for fd in fds:
            poller.register(fd, select.POLLIN)
        deadline = start + within
        while fds:
            left = deadline - time.monotonic()
            if left <= 0:
                alive = "; ".join(h.still_living() for h in hosts)
                raise AssertionError(f"hosts {names} still alive {within}s after the wait began: {alive}\n{self.logs()}")
            for fd, _ in poller.poll(int(left * 1000) + 1):
                poller.unregister(fd)
                fds.discard(fd)
            for h in hosts:
                if h.gone_ns is None and not [fd for fd in h.living() if fd >= 0]:
                    h.gone_ns = time.time_ns()
        for h in hosts:
            if h.popen is not None:
                h.popen.wait(timeout=5)
            if h.gone_ns is None:
                h.gone_ns = time.time_ns()
        return time.monotonic() - start

    def logs(self) -> str:
        return "\n".join(h.logs() for h in self.hosts.values())

    def close(self) -> None:
        """Never kills: a host still alive is a leak for ``no_leaks`` to report. The
        namespaces lose their names here and vanish with their last process."""
        for h in self.hosts.values():
            h.close()
        for name in self.netns:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)


@pytest.fixture
def cluster(tmp_path: Path, no_leaks: str):  # type: ignore[no-untyped-def]
    made: List[Cluster] = []

    def make(**kw: object) -> Cluster:
        c = Cluster(tmp_path, **kw)  # type: ignore[arg-type]
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def _lost_detail(h: Host) -> str:
    v = h.verdict()
    assert v is not None, f"no verdict on {h.name}"
    assert v["cause"] == LOST, v
    return str(v["detail"])


@multihost
@pytest.mark.timeout(90)
def test_a_rank_killed_on_host_b_tears_down_hosts_a_and_c(cluster) -> None:  # type: ignore[no-untyped-def]
    c = cluster().start()
    c.wait_connected()
    a, b, hc = c.hosts["a"], c.hosts["b"], c.hosts["c"]
    holder = b.bridge_state()["rank"]
    victim = next(r for r in b.ranks if r != holder)  # the bridge's own rank dying: see the next test
    b.signal(f"rank {victim}", signal.SIGKILL)
    c.wait_gone(["a", "b", "c"], within=CROSS_S + 2 * GRACE_S)
    for h in (a, hc):
        v = h.verdict()
        assert v is not None, h.logs()
        assert (v["rank"], v["host"], v["cause"]) == (victim, "hostb", "vanished"), v
        codes = h.exit_codes()
        assert set(codes.values()) <= TORN_DOWN, f"{codes}\n{h.logs()}"
        report = json.loads((h.run / "report.json").read_text())
        assert report["verdict"]["rank"] == victim and report["verdict"]["host"] == "hostb"
    assert b.exit_codes()[holder] in TORN_DOWN and b.exit_codes()[victim] == -signal.SIGKILL
    # One clock (this machine's): B's verdict was made at detected_at_ns; a rank acting
    # on a verdict writes its ack record at once; the test sees the processes go.
    made = b.verdict()["detected_at_ns"]  # type: ignore[index]
    seen = {h.name: (min(_ack_times(h)) - made) / 1e6 for h in (a, hc)}
    torn = {h.name: (h.gone_ns - made) / 1e6 for h in (a, hc)}  # type: ignore[operator]
    print(f"\ncross-host: verdict made on hostb -> first rank acting on it {seen} ms; "
          f"-> every process gone {torn} ms")


def _ack_times(h: Host) -> List[int]:
    return [json.loads(p.read_text())["time_ns"] for p in (h.run / "events").glob("ack-*.json")]


@multihost
@pytest.mark.timeout(90)
def test_an_exception_on_host_b_tears_down_every_host(cluster) -> None:  # type: ignore[no-untyped-def]
    """A genuine exception: held back 1 s (it might have been an echo), then every host's
    verdict names it, and every rank exits with code 1."""
    c = cluster().start(behave=["3=raise_on:go"])
    c.wait_connected()
    b = c.hosts["b"]
    (b.ready / "go").write_text("")
    c.wait_gone(["a", "b", "c"], within=REMOTE_SETTLE_S + CROSS_S + 2 * GRACE_S)
    for h in c.hosts.values():
        v = h.verdict()
        assert v is not None and (v["rank"], v["host"], v["cause"]) == (3, "hostb", "exception"), f"{v}\n{h.logs()}"
        assert "RuntimeError" in v["detail"]
    assert set(c.hosts["a"].exit_codes().values()) <= TORN_DOWN and b.exit_codes()[3] == 1


@multihost
@pytest.mark.timeout(120)  # six ranks importing torch and joining a group: slow on 2 loaded cores
def test_a_gloo_job_names_the_dead_rank_not_the_collectives_that_lost_it(cluster) -> None:  # type: ignore[no-untyped-def]
    """A real gloo process group across the hosts, its store served by rank 0 (the default
    store of the bridges). A rank SIGKILLed on host B makes the all_reduce of every other
    rank raise within milliseconds, on every host: those exceptions are echoes; every host's
    verdict must name the dead rank on host B."""
    c = cluster().start(behave=[f"{r}=gloo" for r in range(6)], serve=False)
    c.wait_connected()
    c._wait(lambda: all((h.ready / f"pg-{r}").exists() for h in c.hosts.values() for r in h.ranks),
            START_S + 10, "every rank in the process group")
    b = c.hosts["b"]
    victim = next(r for r in b.ranks if r != b.bridge_state()["rank"])
    b.signal(f"rank {victim}", signal.SIGKILL)
    c.wait_gone(["a", "b", "c"], within=CROSS_S + 2 * GRACE_S)
    for h in c.hosts.values():
        v = h.verdict()
        assert v is not None, h.logs()
        assert (v["rank"], v["host"], v["cause"]) == (victim, "hostb", "vanished"), f"{v}\n{h.logs()}"


@multihost
@pytest.mark.timeout(90)
def test_the_bridge_rank_itself_killed_still_ends_every_host(cluster) -> None:  # type: ignore[no-untyped-def]
    """The holder dies with its store connection. Its host's survivor, torch loaded as in a
    training script, takes the lock over and publishes its verdict. (Without torch in the
    survivor, the host goes silent and is declared lost after peer_timeout, as a frozen
    host is: see below.)"""
    c = cluster().start(behave=["2=torch", "3=torch"])
    c.wait_connected()
    b = c.hosts["b"]
    c._wait(lambda: all((b.ready / f"torch-{r}").exists() for r in b.ranks), START_S, "torch loaded on host b")
    holder = b.bridge_state()["rank"]
    b.signal(f"rank {holder}", signal.SIGKILL)
    c.wait_gone(["a", "b", "c"], within=CROSS_S + 2 * GRACE_S)
    for name in ("a", "c"):
        v = c.hosts[name].verdict()
        assert v is not None and (v["rank"], v["host"], v["cause"]) == (holder, "hostb", "vanished"), v


@multihost
@pytest.mark.timeout(90)
def test_the_store_host_dies(cluster) -> None:  # type: ignore[no-untyped-def]
    c = cluster().start()
    c.wait_connected()
    c.hosts["a"].signal("init", signal.SIGKILL)  # PID 1: the kernel kills its whole namespace
    took = c.wait_gone(["a", "b", "c"], within=LOST_S)
    for name in ("b", "c"):
        h = c.hosts[name]
        detail = _lost_detail(h)
        assert f"the store at 127.0.0.1:{c.port} has been unreachable" in detail, detail
        assert h.verdict()["rank"] == 0 and h.verdict()["host"] == "hosta"  # type: ignore[index]
        assert set(h.exit_codes().values()) <= TORN_DOWN, h.logs()
    print(f"\nstore host killed -> hosts b and c gone in {took:.2f}s (peer_timeout {PEER_TIMEOUT_S}s)")


@multihost
@pytest.mark.timeout(90)
def test_a_frozen_host_is_lost_after_peer_timeout(cluster) -> None:  # type: ignore[no-untyped-def]
    c = cluster().start()
    c.wait_connected()
    hc = c.hosts["c"]
    hc.signal("ranks", signal.SIGSTOP)
    stopped_ns = time.time_ns()
    c.wait_gone(["a", "b"], within=LOST_S)
    for name in ("a", "b"):
        h = c.hosts[name]
        detail = _lost_detail(h)
        assert "host hostc (ranks 4-5) lost" in detail, detail
        assert (h.verdict()["rank"], h.verdict()["host"]) == (4, "hostc")  # type: ignore[index]
        assert (h.verdict_written_ns() - stopped_ns) / 1e9 >= PEER_TIMEOUT_S - HEARTBEAT_S  # its last beat came before
    hc.signal("ranks", signal.SIGCONT)  # back to life, it learns the job is over and ends too
    c.wait_gone(["c"], within=LOST_S)
    assert hc.verdict() is not None


@multihost
@pytest.mark.timeout(90)
def test_the_aggregator_frozen_is_lost_on_every_other_host(cluster) -> None:  # type: ignore[no-untyped-def]
    """The host that reads every beat and publishes the digest freezes: the others, which read
    only its digest, judge it by that digest (it carries its beat), as they would any host."""
    c = cluster().start()
    c.wait_connected()
    states = {name: h.bridge_state() for name, h in c.hosts.items()}
    (name,) = [n for n, s in states.items() if s.get("index") is not None and s.get("aggregator") == s.get("index")]
    agg = c.hosts[name]
    others = [n for n in c.hosts if n != name]
    agg.signal("ranks", signal.SIGSTOP)
    stopped_ns = time.time_ns()
    c.wait_gone(others, within=LOST_S)
    first = min(agg.ranks)
    for n in others:
        h = c.hosts[n]
        assert f"host {agg.name} (ranks {first}-{max(agg.ranks)}) lost" in _lost_detail(h)
        assert (h.verdict()["rank"], h.verdict()["host"]) == (first, agg.name)  # type: ignore[index]
        assert (h.verdict_written_ns() - stopped_ns) / 1e9 >= PEER_TIMEOUT_S - HEARTBEAT_S
    agg.signal("ranks", signal.SIGCONT)  # back to life, it learns the job is over and ends too
    c.wait_gone([name], within=LOST_S)
    assert agg.verdict() is not None


@multihost
@pytest.mark.timeout(90)
def test_a_partitioned_host_ends_in_a_verdict_everywhere(cluster) -> None:  # type: ignore[no-untyped-def]
    c = cluster(isolated="c").start()
    c.wait_connected()
    c.partition()
    cut_ns = time.time_ns()
    c.wait_gone(["a", "b", "c"], within=LOST_S + PEER_TIMEOUT_S)
    for name in ("a", "b"):
        assert "host hostc (ranks 4-5) lost" in _lost_detail(c.hosts[name])
    assert "unreachable" in _lost_detail(c.hosts["c"])  # the cut-off side ends on its own
    for h in c.hosts.values():
        assert (h.verdict_written_ns() - cut_ns) / 1e9 >= PEER_TIMEOUT_S - HEARTBEAT_S
        assert set(h.exit_codes().values()) <= TORN_DOWN, h.logs()


@multihost
@pytest.mark.timeout(90)
def test_a_clean_end_gives_no_verdict_even_when_the_store_host_ends_first(cluster) -> None:  # type: ignore[no-untyped-def]
    """Host a's ranks (rank 0's, and the store's host) finish first; the store goes with
    host a once the others know the job is ending (that they learn it in one read of the
    store is tests/test_digest.py's to show; this checks the consequence). Then the
    others, finding the store gone, finish: no verdict anywhere, every rank exits 0."""
    c = cluster().start(behave=[f"{r}=succeed_on:go" for r in range(6)], hold="release")
    c.wait_connected()
    a = c.hosts["a"]
    (a.ready / "go").write_text("")
    c._wait(lambda: all((a.ready / f"exit-{r}").exists() for r in a.ranks), 10.0, "host a's ranks ended")
    c._wait(lambda: all(c.hosts[n].bridge_state().get("job_ending") for n in ("b", "c")), 10.0,
            "hosts b and c know the job is ending", lambda: str({n: h.bridge_state() for n, h in c.hosts.items()}))
    (a.ready / "release").write_text("")
    c.wait_gone(["a"], within=10.0)  # the store is gone with it
    for name in ("b", "c"):
        (c.hosts[name].ready / "go").write_text("")
    c.wait_gone(["b", "c"], within=10.0)
    for h in c.hosts.values():
        assert h.verdict() is None, f"{h.verdict()}\n{h.logs()}"
        assert h.exit_codes() == {r: 0 for r in h.ranks}, h.logs()
