"""The store protocol of the bridges: what is read and written, under which keys.

Every key lives under ``peerwatch/<run_id>/``::

    hosts        a counter: each host takes its index with add(hosts, 1)
    index/<id>   the index of a host (by boot id, PID namespace and run directory): a
                 successor bridge on that host takes the same one
    host/<i>     JSON: hostname, boot id, PID namespace, ranks of host i
    beat/<i>     host i's heartbeat: "<seq>", or "done:<seq>" once a rank there succeeded;
                 "<seq>s" while its ranks stand still (its summary is in diag/<i>)
    diag/<i>     host i's stall summary (peerwatch._summary), while its ranks stand still
    strag/<i>    host i's ranks' waits in collectives (peerwatch._straggler), once a slot
    strag/found  the stragglers host 0 found in the whole job (peerwatch._stragglerwatch)
    verdict      the first verdict of the job (compare_set: the first writer wins)

With a store secret (``store_secret``, docs/security.md), ``host/<i>``, ``beat/<i>``,
``diag/<i>`` and ``verdict`` hold ``pw-hmac1:<HMAC-SHA256 of key and value, hex>:<value>`` (:class:`Seal`);
a value that is not signed so is read as "not there", with one warning per kind of key.
``hosts`` and ``index/<id>`` stay unsigned (counters: whoever forges them can only make the
bridges disagree about who is who, which ends as a lost host, never as a chosen verdict).

Each function takes a store client and immutable inputs, and returns what it read: it
runs in the client's owner thread (:mod:`._store_client`) and keeps no state, so a call
abandoned half way (the store stopped answering) changes nothing but the store.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import threading
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

from ._hosts import HostInfo, hosts_to_read, peers_to_watch, roster_incomplete, stalled_hosts

logger = logging.getLogger("peerwatch")

HOSTS, VERDICT = "hosts", "verdict"
SIGNED = b"pw-hmac1:"  # a value signed with the store secret: SIGNED + hex digest + b":" + value


def index_key(ident: str) -> str:
    return f"index/{ident}"


def host_key(index: int) -> str:
    return f"host/{index}"


def beat_key(index: int) -> str:
    return f"beat/{index}"


def diag_key(index: int) -> str:
    return f"diag/{index}"


class Seal:
    """Signs what this host writes to the store and checks what it reads, with a secret that
    every host shares (HMAC-SHA256 over the key, which names the run, and the value). Without
    a secret it changes nothing. Any thread: its only state is the warnings given, under a lock."""

    def __init__(self, secret: Optional[bytes]) -> None:
        self._secret = secret
        self._warned: Set[str] = set()
        self._lock = threading.Lock()

    @property
    def on(self) -> bool:
        return self._secret is not None

    def _mac(self, key: str, value: bytes) -> bytes:
        assert self._secret is not None
        return hmac.new(self._secret, key.encode() + b"\0" + value, hashlib.sha256).hexdigest().encode()

    def sign(self, key: str, value: bytes) -> bytes:
        """What to store under ``key`` (the full key, with its prefix)."""
        if self._secret is None:
            return value
        return SIGNED + self._mac(key, value) + b":" + value

    def open(self, key: str, stored: Optional[bytes]) -> Optional[bytes]:
        """The value under ``key`` if it is signed with our secret (or there is no secret);
        None if there is none, or it is unsigned or badly signed (one warning per kind of key)."""
        if stored is None or self._secret is None:
            return stored
        stored = bytes(stored)
        if stored.startswith(SIGNED):
            mac, sep, value = stored[len(SIGNED):].partition(b":")
            if sep and hmac.compare_digest(mac, self._mac(key, value)):
                return value
        parts = key.rsplit("/", 2)
        kind = parts[-2] if parts[-1].isdigit() and len(parts) > 1 else parts[-1]  # beat, host, verdict
        with self._lock:
            if kind in self._warned:
                return None
            self._warned.add(kind)
        logger.warning("peerwatch: the store holds a value under %s that is not signed with this job's store "
                       "secret; ignored (another user, or a host with another secret, wrote it; further ones "
                       "under %s are ignored without a warning)", key, kind)
        return None


NO_SEAL = Seal(None)


@dataclasses.dataclass(frozen=True)
class Exchange:
    """One interval's work, as the beat thread planned it."""

    prefix: str
    index: Optional[int]  # None: register first
    ident: str
    beat: bytes
    me: Optional[HostInfo]  # our host/<i> to (re)write (its index is filled in), or None
    hosts: Mapping[int, HostInfo]  # the hosts known so far (a copy)
    expected: Optional[int]  # how many hosts the launcher says the job has
    seal: Seal = NO_SEAL
    stall: Optional[bytes] = None  # our stall summary to publish in diag/<i> (peerwatch._summary), or None
    read_stalls: bool = False  # read the summaries of the hosts whose beat says they stand still


@dataclasses.dataclass(frozen=True)
class Seen:
    """What one interval read back."""

    index: int
    registered: bool  # the index was taken in this interval
    new_hosts: Dict[int, HostInfo]
    beats: Dict[int, Optional[bytes]]  # every watched host's beat (None: not there)
    requests: int
    stalls: Dict[int, Optional[bytes]] = dataclasses.field(default_factory=dict)  # diag/<j> of stalled hosts, if read


def register(c: Any, prefix: str, ident: str) -> int:
    """This host's index; a successor bridge (the holder's rank exited) takes the same one,
    or the old index would go silent and be judged lost. Two registrations of one host at
    once (an abandoned call finishing late) agree through compare_set: the first wins."""
    key = prefix + index_key(ident)
    if c.check([key]):
        return int(c.get(key))
    mine = str(int(c.add(prefix + HOSTS, 1)) - 1)
    return int(c.compare_set(key, "", mine))


def exchange(c: Any, x: Exchange) -> Seen:
    """Register if need be, beat, publish our host/<i> if it changed, learn new hosts,
    read every other host's beat."""
    requests = 0
    index = x.index
    if index is None:
        index, requests = register(c, x.prefix, x.ident), 3
    seal = x.seal
    if x.stall is not None:  # before the beat that says it is there: a multi_get waits for a missing key
        key = x.prefix + diag_key(index)
        c.set(key, seal.sign(key, x.stall))
        requests += 1
    key = x.prefix + beat_key(index)
    c.set(key, seal.sign(key, x.beat))
    requests += 1
    if x.me is not None:
        key = x.prefix + host_key(index)
        c.set(key, seal.sign(key, dataclasses.replace(x.me, index=index).to_json()))
        requests += 1
    new_hosts: Dict[int, HostInfo] = {}
    if roster_incomplete(x.expected, len(set(x.hosts) | {index})):
        count = int(c.add(x.prefix + HOSTS, 0))
        requests += 1
        for j in hosts_to_read(count, set(x.hosts), index):
            # host/<j> is written after beat/<j>: once it exists both do.
            key = x.prefix + host_key(j)
            if c.check([key]):
                info = seal.open(key, c.get(key))
                if info is not None:  # badly signed: not there yet
                    new_hosts[j] = HostInfo.from_json(j, info)
            requests += 1
    others = peers_to_watch({**x.hosts, **new_hosts}, index, x.ident)
    beats: Dict[int, Optional[bytes]] = {}
    if others:
        keys = [x.prefix + beat_key(j) for j in others]
        values: List[Optional[bytes]] = c.multi_get(keys)
        beats = {j: seal.open(key, v) for j, key, v in zip(others, keys, values)}
        requests += 1
    stalls: Dict[int, Optional[bytes]] = {}
    stalled = stalled_hosts(beats) if x.read_stalls else []
    if stalled:  # a hang's diagnosis on this host needs what the others' ranks do (docs/multi-node.md)
        keys = [x.prefix + diag_key(j) for j in stalled]
        values = c.multi_get(keys)
        stalls = {j: seal.open(key, v) for j, key, v in zip(stalled, keys, values)}
        requests += 1
    return Seen(index, x.index is None, new_hosts, beats, requests, stalls)


def strag_key(index: int) -> str:
    return f"strag/{index}"


STRAG_FOUND = "strag/found"


@dataclasses.dataclass(frozen=True)
class StraggleExchange:
    """One slot's straggler work: publish our host's waits; on host 0, read the others' and
    publish the finding; elsewhere, read the finding."""

    prefix: str
    index: int
    mine: Optional[bytes]  # our host's profiles (None: none to publish)
    others: List[int]  # host 0: the hosts whose profiles to read; [] elsewhere
    found: Optional[bytes]  # host 0: the finding to publish (None: unchanged)
    read_found: bool  # not host 0: read the finding
    seal: Seal = NO_SEAL


def straggle_exchange(c: Any, x: StraggleExchange) -> Tuple[Dict[int, bytes], Optional[bytes], int]:
    """The other hosts' profiles that are there, the finding (if read), the requests made.
    Keys are checked before they are read: a multi_get waits for a missing one."""
    requests = 0
    if x.mine is not None:
        key = x.prefix + strag_key(x.index)
        c.set(key, x.seal.sign(key, x.mine))
        requests += 1
    profiles: Dict[int, bytes] = {}
    keys = [x.prefix + strag_key(j) for j in x.others]
    if keys:
        there = [j for j, key in zip(x.others, keys) if c.check([key])] if not c.check(keys) else list(x.others)
        requests += 1 + (len(keys) if len(there) < len(keys) else 0)
        wanted = [x.prefix + strag_key(j) for j in there]
        values: List[Optional[bytes]] = c.multi_get(wanted) if wanted else []
        requests += 1 if wanted else 0
        for j, key, value in zip(there, wanted, values):
            opened = x.seal.open(key, value)
            if opened is not None:
                profiles[j] = opened
    found: Optional[bytes] = None
    key = x.prefix + STRAG_FOUND
    if x.found is not None:
        c.set(key, x.seal.sign(key, x.found))
        requests += 1
    if x.read_found:
        requests += 1
        if c.check([key]):
            found = x.seal.open(key, c.get(key))
            requests += 1
    return profiles, found, requests


def read_host(c: Any, prefix: str, index: int, seal: Seal = NO_SEAL) -> HostInfo:
    """host/<index>; a badly signed one raises ValueError (the caller names the ranks it knows)."""
    key = prefix + host_key(index)
    info = seal.open(key, c.get(key))
    if info is None:
        raise ValueError(f"{key} is not signed with the store secret")
    return HostInfo.from_json(index, info)


def send_beat(c: Any, prefix: str, index: int, beat: bytes, seal: Seal = NO_SEAL) -> None:
    key = prefix + beat_key(index)
    c.set(key, seal.sign(key, beat))


def publish_verdict(c: Any, prefix: str, data: bytes, seal: Seal = NO_SEAL) -> bool:
    """Offer our verdict; True if the store keeps it (False: another host's came first).
    With a secret, a value there that is not signed with it (forged) is replaced by ours."""
    key = prefix + VERDICT
    signed = seal.sign(key, data)
    held = c.compare_set(key, "", signed)
    if held != signed and seal.on and seal.open(key, held) is None:
        held = c.compare_set(key, held, signed)
    return bool(held == signed)


def poll_verdict(c: Any, prefix: str, seal: Seal = NO_SEAL) -> Optional[bytes]:
    """The job's verdict, if there is one (for a store that cannot be waited on); with a
    secret, only one signed with it."""
    key = prefix + VERDICT
    if c.check([key]):
        return seal.open(key, bytes(c.get(key)))
    return None


__all__ = [
    "HOSTS", "NO_SEAL", "SIGNED", "VERDICT", "Exchange", "Seal", "Seen", "beat_key", "diag_key", "exchange", "host_key", "index_key", "poll_verdict",
    "STRAG_FOUND", "StraggleExchange", "publish_verdict", "read_host", "register", "send_beat", "strag_key",
    "straggle_exchange",
]
