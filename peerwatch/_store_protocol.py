"""The store protocol of the bridges: what is read and written, under which keys.

Every key lives under ``peerwatch/<run_id>/``::

    hosts        a counter: each host takes its index with add(hosts, 1)
    index/<id>   the index of a host (by boot id, PID namespace and run directory): a
                 successor bridge on that host takes the same one
    host/<i>     JSON: hostname, boot id, PID namespace, ranks of host i
    beat/<i>     host i's heartbeat: "<seq>", or "done:<seq>" once a rank there succeeded
    verdict      the first verdict of the job (compare_set: the first writer wins)

Each function takes a store client and immutable inputs, and returns what it read: it
runs in the client's owner thread (:mod:`._store_client`) and keeps no state, so a call
abandoned half way (the store stopped answering) changes nothing but the store.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional

from ._hosts import HostInfo, hosts_to_read, peers_to_watch, roster_incomplete

HOSTS, VERDICT = "hosts", "verdict"


def index_key(ident: str) -> str:
    return f"index/{ident}"


def host_key(index: int) -> str:
    return f"host/{index}"


def beat_key(index: int) -> str:
    return f"beat/{index}"


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


@dataclasses.dataclass(frozen=True)
class Seen:
    """What one interval read back."""

    index: int
    registered: bool  # the index was taken in this interval
    new_hosts: Dict[int, HostInfo]
    beats: Dict[int, Optional[bytes]]  # every watched host's beat (None: not there)
    requests: int


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
    c.set(x.prefix + beat_key(index), x.beat)
    requests += 1
    if x.me is not None:
        c.set(x.prefix + host_key(index), dataclasses.replace(x.me, index=index).to_json())
        requests += 1
    new_hosts: Dict[int, HostInfo] = {}
    if roster_incomplete(x.expected, len(set(x.hosts) | {index})):
        count = int(c.add(x.prefix + HOSTS, 0))
        requests += 1
        for j in hosts_to_read(count, set(x.hosts), index):
            # host/<j> is written after beat/<j>: once it exists both do.
            if c.check([x.prefix + host_key(j)]):
                new_hosts[j] = HostInfo.from_json(j, c.get(x.prefix + host_key(j)))
            requests += 1
    others = peers_to_watch({**x.hosts, **new_hosts}, index, x.ident)
    beats: Dict[int, Optional[bytes]] = {}
    if others:
        values: List[Optional[bytes]] = c.multi_get([x.prefix + beat_key(j) for j in others])
        beats = dict(zip(others, values))
        requests += 1
    return Seen(index, x.index is None, new_hosts, beats, requests)


def read_host(c: Any, prefix: str, index: int) -> HostInfo:
    return HostInfo.from_json(index, c.get(prefix + host_key(index)))


def send_beat(c: Any, prefix: str, index: int, beat: bytes) -> None:
    c.set(prefix + beat_key(index), beat)


def publish_verdict(c: Any, prefix: str, data: bytes) -> bool:
    """Offer our verdict; True if the store keeps it (False: another host's came first)."""
    return bool(c.compare_set(prefix + VERDICT, "", data) == data)


def poll_verdict(c: Any, prefix: str) -> Optional[bytes]:
    """The job's verdict, if there is one (for a store that cannot be waited on)."""
    if c.check([prefix + VERDICT]):
        return bytes(c.get(prefix + VERDICT))
    return None


__all__ = [
    "HOSTS", "VERDICT", "Exchange", "Seen", "beat_key", "exchange", "host_key", "index_key", "poll_verdict",
    "publish_verdict", "read_host", "register", "send_beat",
]
