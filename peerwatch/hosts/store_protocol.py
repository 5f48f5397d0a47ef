"""The store protocol of the bridges: what is read and written, under which keys.

Every key lives under ``peerwatch/<run_id>/``::

    nonce        the run's nonce (with a store secret): the first host's, taken with compare_set
    hosts        a counter: each host takes its index with add(hosts, 1); while hosts are
                 missing, every host reads it (who registered, whatever the aggregator read)
    index/<id>   the index of a host (by boot id, PID namespace and run directory): a
                 successor bridge on that host takes the same one
    host/<i>     JSON: hostname, boot id, PID namespace, ranks of host i
    beat/<i>     host i's heartbeat: "<seq>", or "done:<seq>" once a rank there succeeded;
                 "<seq>s" while its ranks stand still (its summary is in diag/<i>)
    diag/<i>     host i's stall summary (peerwatch.hangs.diagnose.Summary), while its ranks stand still
    diag/all     the aggregator's merge of every diag/<i> (peerwatch.hangs.merged, bounded): what
                 every other host reads while its ranks stand still
    digest       the aggregator's (one host, elected through this key: hosts.aggregate_term):
                 its own beat, the hosts it judged lost, those that stand still, whether one
                 is done (JSON, bounded: hosts.Digest); every other host reads it alone
    strag/<i>    host i's ranks' waits in collectives (peerwatch.hangs.straggler), once a slot
    strag/found  the stragglers host 0 found in the whole job (peerwatch.hosts.stragglerwatch)
    verdict      the first verdict of the job (compare_set: the first writer wins); a value
                 there that this run may not obey (or there before this host first looked:
                 :class:`VerdictFrom`) moves it to verdict/1, then /2...
                 (:func:`verdict_key`; with a secret, names derived from it and the nonce)

With a store secret (``store_secret``, docs/security.md), ``host/<i>``, ``beat/<i>``,
``diag/<i>``, ``diag/all``, ``digest`` and the verdict hold ``pw-hmac2:<nonce>:<HMAC-SHA256 of nonce, key and value,
hex>:<value>`` (:class:`Seal`); ``nonce`` is signed the same way with an empty nonce. A
value that is not signed so, or signed for another run's nonce, is read as "not there",
with one warning per kind of key and reason.
``hosts`` and ``index/<id>`` stay unsigned (counters: whoever forges them can only make the
bridges disagree about who is who, which ends as a lost host, never as a chosen verdict).
What is read is bounded: the counter is believed up to ``MAX_HOSTS`` and at most
``READ_BATCH`` new ``host/<j>`` are looked up per interval (:mod:`.hosts`).

Each function takes a store client and immutable inputs, and returns what it read: it
runs in the client's owner thread (:mod:`.store_client`) and keeps no state, so a call
abandoned half way (the store stopped answering) changes nothing but the store.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import secrets
import threading
from typing import AbstractSet, Any, Dict, List, Mapping, Optional, Protocol, Set, Tuple

from ..core.records import Verdict, decode
from .hosts import (
    DONE,
    MAX_DIGEST_LIST,
    MAX_HOSTS,
    Digest,
    HostInfo,
    hosts_to_read,
    parse_count,
    peers_to_watch,
    roster_incomplete,
    stalled_hosts,
)

logger = logging.getLogger("peerwatch")

HOSTS, VERDICT, NONCE, DIGEST = "hosts", "verdict", "nonce", "digest"
DIAG_ALL = "diag/all"  # every standing-still host's stall, merged by the aggregator (peerwatch.hangs.merged)
# Said by a host whose rank finished cleanly, read by every host each interval with the
# digest: the job is ending, so a host (or the store) going quiet is no failure. Said in one
# hop: through the aggregator's digest it took two intervals, and a store served from the
# host that ended first could be gone before the others read it (they called it lost).
ENDING, ENDING_SAID = "ending", b"ending"
SIGNED = b"pw-hmac2:"  # a signed value: SIGNED + the run's nonce (hex) + b":" + hex digest + b":" + value
NONCE_BYTES = 16  # the run's nonce: this many random bytes, in hex
VERDICT_TRIES = 8  # verdict keys in turn: a refused value in one (forged, replayed) moves everyone to the next


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
    every host shares: HMAC-SHA256 over the run's nonce, the key and the value. Without a
    secret it changes nothing.

    The nonce (``NONCE_BYTES`` random bytes) is what makes a run's signatures its own: the
    run id, and so every key, is the same for two jobs launched alike (the same
    ``MASTER_ADDR:MASTER_PORT``), and a value recorded from one must not be obeyed in the
    other. The first host to register proposes one with ``compare_set``; every host adopts
    the one the store keeps (signed, under the secret alone) and keeps it for the run, as
    do its successor bridges (``memo``: the run directory). Any thread: its state (the
    nonce, set once, and the warnings given) is under a lock."""

    def __init__(self, secret: Optional[bytes], nonce: Optional[bytes] = None, memo: Optional[NonceMemo] = None) -> None:
        self._secret = secret
        self._nonce = nonce
        self._memo = memo
        self._warned: Set[Tuple[str, str]] = set()
        self._lock = threading.Lock()

    @property
    def on(self) -> bool:
        return self._secret is not None

    @property
    def nonce(self) -> Optional[bytes]:
        """The run's nonce, once this host knows it (always None without a secret)."""
        if self._secret is None:
            return None
        with self._lock:
            if self._nonce is None and self._memo is not None:
                kept = self._memo.load()
                self._nonce = kept if kept is not None and _is_nonce(kept) else None
            return self._nonce

    def adopt(self, nonce: bytes) -> bytes:
        """Take ``nonce`` for the run unless one is already held; the one held."""
        with self._lock:
            if self._nonce is None:
                self._nonce = nonce
                if self._memo is not None:
                    self._memo.save(nonce)
            return self._nonce

    def hidden(self, label: bytes, attempt: int) -> str:
        """A name only the job's hosts can compute (from the secret and the run's nonce)."""
        assert self._secret is not None
        nonce = self._bound("")
        return hmac.new(self._secret, label + b"\0" + nonce + b"\0" + str(attempt).encode(),
                        hashlib.sha256).hexdigest()[:32]

    def _mac(self, nonce: bytes, key: str, value: bytes) -> bytes:
        assert self._secret is not None
        return hmac.new(self._secret, nonce + b"\0" + key.encode() + b"\0" + value, hashlib.sha256).hexdigest().encode()

    def _bound(self, key: str) -> bytes:
        """The nonce a value under ``key`` is signed with (none for the nonce itself)."""
        if key.endswith("/" + NONCE):
            return b""
        nonce = self.nonce
        if nonce is None:
            raise RuntimeError(f"peerwatch: {key} cannot be signed before the run's nonce is known")
        return nonce

    def sign(self, key: str, value: bytes) -> bytes:
        """What to store under ``key`` (the full key, with its prefix)."""
        if self._secret is None:
            return value
        nonce = self._bound(key)
        return SIGNED + nonce + b":" + self._mac(nonce, key, value) + b":" + value

    def open(self, key: str, stored: Optional[bytes]) -> Optional[bytes]:
        """The value under ``key`` if it is signed with our secret for this run (or there is no
        secret); None if there is none, or it is unsigned, badly signed or signed for another
        run (one warning per kind of key and reason)."""
        if stored is None or self._secret is None:
            return stored
        stored = bytes(stored)
        nonce = self._bound(key)
        why = ("is not signed with this job's store secret; ignored (another user, or a host with another "
               "secret, wrote it)")
        if stored.startswith(SIGNED):
            theirs, sep, rest = stored[len(SIGNED):].partition(b":")
            mac, sep2, value = rest.partition(b":")
            if sep and sep2 and hmac.compare_digest(mac, self._mac(theirs, key, value)):
                if theirs == nonce:
                    return value
                why = ("is signed for another run (nonce %s..., this run's is %s...): an earlier job's value, "
                       "written back; ignored" % (theirs.decode("ascii", "replace")[:8], nonce.decode()[:8]))
        self.warn(key, why)
        return None

    def warn(self, key: str, why: str) -> None:
        """Say once per kind of key (beat, host, verdict) and reason that a value was refused."""
        parts = key.rsplit("/", 2)
        kind = parts[-2] if len(parts) > 1 and (parts[-1].isdigit() or parts[-2] == VERDICT) else parts[-1]
        with self._lock:
            if (kind, why[:20]) in self._warned:
                return
            self._warned.add((kind, why[:20]))
        logger.warning("peerwatch: the store holds a value under %s that %s; further ones under %s are ignored "
                       "without a warning", key, why, kind)


class NonceMemo(Protocol):
    """Where a host keeps what its successor bridges need (the run directory): the run's
    nonce, the first verdict key it may obey. The first save wins."""

    def load(self) -> Optional[bytes]: ...

    def save(self, nonce: bytes) -> None: ...


def _is_nonce(value: bytes) -> bool:
    return len(value) == 2 * NONCE_BYTES and all(ch in b"0123456789abcdef" for ch in value)


def _put(c: Any, seal: Seal, key: str, value: bytes) -> None:
    """Set ``key`` (the full key, with its prefix) to ``value``, signed (:meth:`Seal.sign`)."""
    c.set(key, seal.sign(key, value))


def establish_nonce(c: Any, prefix: str, seal: Seal) -> Optional[bytes]:
    """The run's nonce (None without a secret): the one this host holds, else the one the store
    holds, else ours, proposed with compare_set (the first host wins). A value there that is
    not a nonce signed with the secret (forged) is replaced by ours."""
    if not seal.on:
        return None
    held_nonce = seal.nonce
    if held_nonce is not None:
        return held_nonce
    key = prefix + NONCE
    proposed = seal.sign(key, secrets.token_hex(NONCE_BYTES).encode())
    held = bytes(c.compare_set(key, "", proposed))
    value = seal.open(key, held)
    if value is None or not _is_nonce(value):
        held = bytes(c.compare_set(key, held, proposed))
        value = seal.open(key, held)
        if value is None or not _is_nonce(value):
            raise ValueError(f"{key} is not a nonce signed with the store secret")
    return seal.adopt(value)


def verdict_key(prefix: str, seal: Seal, attempt: int = 0) -> str:
    """The ``attempt``-th key a verdict may be under. With a secret, a name derived from it and
    the run's nonce: nobody without the secret can write there before a host of the job did
    (the waiters would wake on it), nor name the next one."""
    if not seal.on:
        return prefix + VERDICT + (f"/{attempt}" if attempt else "")
    return f"{prefix}{VERDICT}/{seal.hidden(b'verdict-key', attempt)}"


def acceptable_verdict(seal: Seal, key: str, stored: Optional[bytes]) -> Optional[bytes]:
    """The verdict under ``key`` if this run may obey it: signed for this run (with a
    secret) and a valid record. No clock is read: whether it is this run's is a matter of
    the key (:class:`VerdictFrom`) and the nonce. None otherwise, with one warning per reason."""
    data = seal.open(key, stored)
    if data is None:
        return None
    if decode(Verdict, data) is None:
        seal.warn(key, "is not a valid verdict; ignored")
        return None
    return data


class VerdictFrom:
    """The first verdict key (attempt) this host may obey. A value under a verdict key when
    this host first looked at the store is not this run's (an earlier job's, in a store that
    outlived it or written back, with its nonce, before any host of this job came): the
    store's own order says so, no host's clock (the hosts' clocks differ: a verdict of this
    run made on a clock behind ours looked older than the run and was refused). Found once
    per host and kept for its successor bridges (``memo``: the run directory). Any thread:
    the store is read outside the lock, the first answer kept."""

    def __init__(self, memo: Optional[NonceMemo] = None) -> None:
        self._memo = memo
        self._first: Optional[int] = None
        self._lock = threading.Lock()

    def settle(self, c: Any, prefix: str, seal: Seal) -> int:
        """The first attempt this host may obey: kept, or the first empty key now."""
        with self._lock:
            if self._first is not None:
                return self._first
        kept = self._load()
        if kept is None:
            kept = next((a for a in range(VERDICT_TRIES) if not c.check([verdict_key(prefix, seal, a)])),
                        VERDICT_TRIES)
            for a in range(kept):
                seal.warn(verdict_key(prefix, seal, a), "was there before this host joined the run (an earlier "
                          "job's verdict); ignored")
            if self._memo is not None:
                self._memo.save(str(kept).encode())
                first = self._load()  # the first bridge of this host to save it wins
                kept = first if first is not None else kept
        with self._lock:
            if self._first is None:
                self._first = kept
            return self._first

    def _load(self) -> Optional[int]:
        value = self._memo.load() if self._memo is not None else None
        return int(value) if value is not None and value.isdigit() and int(value) <= VERDICT_TRIES else None


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
    stall: Optional[bytes] = None  # our stall summary to publish in diag/<i> (peerwatch.hangs.diagnose.Summary), or None
    # Read the other hosts' stalls: the aggregator, the summary of every host whose beat
    # says it stands still; every other host, the aggregator's merge of them (diag/all).
    read_stalls: bool = False
    covered: AbstractSet[int] = frozenset()  # the aggregator holds these hosts' summaries: the others are read at once
    merged_known: bool = False  # diag/all is there (seen once): no check before the get
    verdict_from: Optional[VerdictFrom] = None  # settled at registration: the host's first look
    # The aggregator (True) reads every host's beat (and the digest, to find another
    # writer); every other host (False) reads the digest alone, and the records of the two
    # hosts it names (its writer, rank 0's host) once.
    aggregate: bool = True
    digest_known: bool = False  # the digest key is there (seen once): no check before the get
    # Not the aggregator, and hosts the launcher announced are not counted yet: read the
    # ``hosts`` counter too (with the digest, in the same request). A host that took an index
    # has joined, whether or not the aggregator has read its beat yet: no host waits for the
    # aggregator (starved, or reading new hosts READ_BATCH at a time) to know who registered.
    count_hosts: bool = False


@dataclasses.dataclass(frozen=True)
class Seen:
    """What one interval read back."""

    index: int
    registered: bool  # the index was taken in this interval
    new_hosts: Dict[int, HostInfo]
    beats: Dict[int, Optional[bytes]]  # every watched host's beat (None: not there)
    requests: int
    stalls: Dict[int, Optional[bytes]] = dataclasses.field(default_factory=dict)  # diag/<j> of stalled hosts, if read
    digest: Optional[Digest] = None  # the digest as read (None: not there, or not one this run may obey)
    digest_there: bool = False  # the digest key exists
    count: int = 0  # the hosts counter, if read
    stalled: Tuple[int, ...] = ()  # the other hosts that stand still: by their beats, or by the digest
    ending: bool = False  # a host said the job is ending (:data:`ENDING`)
    merged: Optional[bytes] = None  # diag/all, if read (not the aggregator)
    merged_there: bool = False  # diag/all exists


def register(c: Any, prefix: str, ident: str, seal: Seal = NO_SEAL) -> int:
    """This host's index; a successor bridge (the holder's rank exited) takes the same one,
    or the old index would go silent and be judged lost. Two registrations of one host at
    once (an abandoned call finishing late) agree through compare_set: the first wins.
    With a secret, the run's nonce is settled first (:func:`establish_nonce`)."""
    establish_nonce(c, prefix, seal)
    key = prefix + index_key(ident)
    if c.check([key]):
        return int(c.get(key))
    mine = str(int(c.add(prefix + HOSTS, 1)) - 1)
    return int(c.compare_set(key, "", mine))


def read_count(c: Any, key: str, seal: Seal = NO_SEAL) -> int:
    """The ``hosts`` counter: read, not ``add(key, 0)`` (TCPStore drops the connection of an
    add on a value that is not a number); 0 if it is not there or not a count, believed up
    to ``MAX_HOSTS`` (unsigned: anyone may set it; one warning each)."""
    if not c.check([key]):
        return 0
    return believed_count(key, bytes(c.get(key)), seal)


def believed_count(key: str, value: bytes, seal: Seal = NO_SEAL) -> int:
    """The ``hosts`` counter's value as read: 0 if it is not a count (one warning)."""
    count = parse_count(value)
    if count is None:
        seal.warn(key, "is not a host count; ignored")
        return 0
    if count > MAX_HOSTS:
        seal.warn(key, f"is a host count above {MAX_HOSTS}; only the hosts below it are looked for")
    return count


def read_hosts(c: Any, prefix: str, indices: List[int], seal: Seal = NO_SEAL) -> Tuple[Dict[int, HostInfo], int]:
    """The hosts among ``indices`` that are there (``host/<j>`` and ``beat/<j>`` both: a
    multi_get waits for a missing key), and the requests made. A ``host/<j>`` this run may
    not obey (rewritten, badly signed) hides no host of the job: one whose beat is signed
    for this run is taken, known only by its index."""
    if not indices:
        return {}, 0
    pairs = {j: [prefix + host_key(j), prefix + beat_key(j)] for j in indices}
    if c.check([key for keys in pairs.values() for key in keys]):
        there, requests = list(indices), 1
    else:
        there, requests = [j for j in indices if c.check(pairs[j])], 1 + len(indices)
    if not there:
        return {}, requests
    values: List[Optional[bytes]] = c.multi_get([pairs[j][0] for j in there])
    requests += 1
    found: Dict[int, HostInfo] = {}
    for j, value in zip(there, values):
        info = seal.open(pairs[j][0], value)
        if info is None:
            requests += 1
            if seal.open(pairs[j][1], c.get(pairs[j][1])) is None:
                continue  # neither is this run's: not a host of the job (yet)
            info = b""
        found[j] = HostInfo.from_json(j, info)
    return found, requests


def exchange(c: Any, x: Exchange) -> Seen:
    """Register if need be, beat, publish our host/<i> if it changed; then, as the
    aggregator, learn new hosts and read every other host's beat (and the digest); as any
    other host, read the digest alone (docs/multi-node.md). A host that stands still reads
    the others' stalls: the aggregator, the summaries of the hosts whose beat says they
    stand still (those it does not hold yet at once, the others when ``read_stalls``);
    any other host, their merge (``diag/all``), when ``read_stalls``."""
    requests = 0
    index = x.index
    seal = x.seal
    ekey = x.prefix + ENDING
    if index is None:
        requests = 4 + (seal.on and seal.nonce is None)
        index = register(c, x.prefix, x.ident, seal)
        c.compare_set(ekey, "", seal.sign(ekey, b""))  # there before this host reads it: a multi_get waits for a missing key
        if x.verdict_from is not None:  # a verdict this run publishes from now on is one to obey
            x.verdict_from.settle(c, x.prefix, seal)
            requests += 1
    elif seal.on and seal.nonce is None:  # a successor bridge of a host whose nonce was not kept
        establish_nonce(c, x.prefix, seal)
        requests += 1
    if x.stall is not None:  # before the beat that says it is there: a multi_get waits for a missing key
        _put(c, seal, x.prefix + diag_key(index), x.stall)
        requests += 1
    send_beat(c, x.prefix, index, x.beat, seal)
    requests += 1
    if x.beat.startswith(DONE):
        say_ending(c, x.prefix, seal)
        requests += 1
    if x.me is not None:
        _put(c, seal, x.prefix + host_key(index), dataclasses.replace(x.me, index=index).to_json())
        requests += 1
    dkey = x.prefix + DIGEST
    there = x.digest_known
    if not there:  # a get (and a multi_get) waits for a missing key
        there = bool(c.check([dkey]))
        requests += 1
    new_hosts: Dict[int, HostInfo] = {}
    beats: Dict[int, Optional[bytes]] = {}
    count = 0
    raw: Optional[bytes] = None
    said: Optional[bytes] = None
    if x.aggregate:
        if roster_incomplete(x.expected, len(set(x.hosts) | {index})):
            count = read_count(c, x.prefix + HOSTS, seal)
            new_hosts, n = read_hosts(c, x.prefix, hosts_to_read(count, set(x.hosts), index), seal)
            requests += 2 + n
        others = peers_to_watch({**x.hosts, **new_hosts}, index, x.ident)
        keys = [x.prefix + beat_key(j) for j in others] + ([dkey] if there else []) + [ekey]
        values: List[Optional[bytes]] = c.multi_get(keys)
        beats = {j: seal.open(key, v) for j, key, v in zip(others, keys, values)}
        raw = values[-2] if there else None
        said = values[-1]
        requests += 1
    elif there and x.count_hosts:  # the counter is there: we took our index with add
        raw, said, counted = c.multi_get([dkey, ekey, x.prefix + HOSTS])
        count = believed_count(x.prefix + HOSTS, bytes(counted), seal)
        requests += 1
    elif there:
        raw, said = c.multi_get([dkey, ekey])
        requests += 1
    elif x.count_hosts:
        count = read_count(c, x.prefix + HOSTS, seal)
        requests += 2
    digest = Digest.from_json(seal.open(dkey, bytes(raw))) if raw is not None else None
    if not x.aggregate and digest is not None:
        # The aggregator's record (named if it is lost) and rank 0's host's (a lost store is
        # blamed on it): read once each, as soon as the digest names them.
        wanted = sorted({j for j in (digest.by, digest.rank0) if j is not None and j not in x.hosts and j != index})
        if wanted:
            found, n = read_hosts(c, x.prefix, wanted, seal)
            new_hosts.update(found)
            requests += n
    if x.aggregate:
        stalled = tuple(stalled_hosts(beats))
    else:
        stalled = tuple(j for j in (digest.stalled if digest is not None else ()) if j != index)[:MAX_DIGEST_LIST]
    # A hang's diagnosis on this host needs what the others' ranks do (docs/multi-node.md).
    stalls: Dict[int, Optional[bytes]] = {}
    wanted = [j for j in stalled if x.read_stalls or j not in x.covered] if x.aggregate else []
    if wanted:
        keys = [x.prefix + diag_key(j) for j in wanted]
        values = c.multi_get(keys)
        stalls = {j: seal.open(key, v) for j, key, v in zip(wanted, keys, values)}
        requests += 1
    merged: Optional[bytes] = None
    merged_there = x.merged_known
    if stalled and x.read_stalls and not x.aggregate:
        mkey = x.prefix + DIAG_ALL
        if not merged_there:  # a get waits for a missing key
            merged_there = bool(c.check([mkey]))
            requests += 1
        if merged_there:
            merged = seal.open(mkey, bytes(c.get(mkey)))
            requests += 1
    ending = said is not None and seal.open(ekey, bytes(said)) == ENDING_SAID
    return Seen(index, x.index is None, new_hosts, beats, requests, stalls, digest, there, count, stalled, ending,
                merged, merged_there)


def say_ending(c: Any, prefix: str, seal: Seal = NO_SEAL) -> None:
    """This host's rank finished cleanly: every host reads it at its next interval."""
    _put(c, seal, prefix + ENDING, ENDING_SAID)


def publish_digest(c: Any, prefix: str, digest: Digest, seal: Seal = NO_SEAL, merged: Optional[bytes] = None) -> None:
    """The aggregator's write for every other host: its digest, and the merge of the
    stalls (``diag/all``) first where it changed (it is there before a digest names a
    host standing still: a get waits for a missing key)."""
    if merged is not None:
        _put(c, seal, prefix + DIAG_ALL, merged)
    _put(c, seal, prefix + DIGEST, digest.to_json())


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
        _put(c, x.seal, x.prefix + strag_key(x.index), x.mine)
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
        _put(c, x.seal, key, x.found)
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
    _put(c, seal, prefix + beat_key(index), beat)


def publish_verdict(c: Any, prefix: str, data: bytes, seal: Seal = NO_SEAL,
                    verdict_from: Optional[VerdictFrom] = None) -> bool:
    """Offer our verdict; True if the store keeps it (False: another host's came first).
    A value there this run may not obey (forged, another run's, not a verdict, there before
    this host looked: ``verdict_from``) is left alone and ours offered under the next key,
    where the waiters look next (:func:`verdict_key`; after ``VERDICT_TRIES`` keys, False)."""
    establish_nonce(c, prefix, seal)
    first = verdict_from.settle(c, prefix, seal) if verdict_from is not None else 0
    for attempt in range(first, VERDICT_TRIES):
        key = verdict_key(prefix, seal, attempt)
        signed = seal.sign(key, data)
        held = bytes(c.compare_set(key, "", signed))
        if held == signed:
            return True
        if acceptable_verdict(seal, key, held) is not None:
            return False
    return False


def poll_verdict(c: Any, prefix: str, seal: Seal = NO_SEAL, verdict_from: Optional[VerdictFrom] = None) -> Optional[bytes]:
    """The job's verdict, if there is one this run may obey (for a store that cannot be
    waited on): the first acceptable one along the verdict keys, from ``verdict_from``'s."""
    establish_nonce(c, prefix, seal)
    first = verdict_from.settle(c, prefix, seal) if verdict_from is not None else 0
    for attempt in range(first, VERDICT_TRIES):
        key = verdict_key(prefix, seal, attempt)
        if not c.check([key]):
            return None
        data = acceptable_verdict(seal, key, bytes(c.get(key)))
        if data is not None:
            return data
    return None


__all__ = [
    "DIAG_ALL", "DIGEST", "ENDING", "HOSTS", "NONCE", "NO_SEAL", "SIGNED", "STRAG_FOUND", "VERDICT", "VERDICT_TRIES", "Exchange",
    "NonceMemo", "Seal", "Seen", "StraggleExchange", "acceptable_verdict", "beat_key", "believed_count", "diag_key", "establish_nonce",
    "exchange", "host_key", "publish_digest", "index_key", "poll_verdict", "publish_verdict", "read_count", "read_host", "read_hosts",
    "register", "say_ending", "send_beat",
    "strag_key", "straggle_exchange", "VerdictFrom", "verdict_key",
]
