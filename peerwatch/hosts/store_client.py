"""A store client owned by one thread, and the one way to call it with a deadline.

torch's TCPStore client does not honour its timeout when the peer goes silent (a
partition: no reset, no answer): a request can block forever. So the client lives in a
thread of its own (its *owner*), which alone creates it, uses it and drops it; every other
thread hands it work through a queue and waits for the answer with a deadline
(:meth:`StoreClient.call`). An owner that overruns a deadline is retired with its
connection (it ends when, if ever, the store answers); the next call starts a new owner
with a new connection. At most ``MAX_RETIRED`` retired owners may still be running: while
that many are stuck, a call fails at once (the store is not answering) instead of starting
yet another thread and connection per retry.

Mutable state: each ``_Owner``'s ``client`` is its own thread's alone; a ``_Call``'s
``result``/``error`` are written by the owner before it sets ``done``, and read by the
caller after; ``StoreClient._owner``/``_owners`` are guarded by ``StoreClient._lock``
(any thread may call), nothing else is shared.
"""

from __future__ import annotations

import datetime
import functools
import logging
import queue
import socket
import threading
import time
from typing import Any, Callable, Generic, List, Optional, Set, TypeVar

from ..hangs.collectives import imported

logger = logging.getLogger("peerwatch")

T = TypeVar("T")

# Retired owners still blocked in a request, at most: each holds a thread and a connection
# (and torch's client its buffers) until the store answers, if ever; a retry loop that
# started one per overrun grew a process by hundreds of MB.
MAX_RETIRED = 4


class StoreOverrun(Exception):
    """The store did not answer within the deadline (or the client was closed meanwhile)."""


class _Call(Generic[T]):
    def __init__(self, fn: Callable[[Any], T]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: Optional[T] = None
        self.error: Optional[BaseException] = None

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()


class _Owner:
    """One thread, one connection: runs queued calls until it is retired."""

    def __init__(self, connect: Callable[[], Any], name: str) -> None:
        self.connect = connect  # the owner's own: makes this thread's connection
        self.jobs: queue.SimpleQueue[Optional[_Call[Any]]] = queue.SimpleQueue()
        self.has_client = False  # written by the owner thread only; a hint for deadlines
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)

    def _main(self) -> None:
        client: Any = None
        while True:
            call = self.jobs.get()
            if call is None:
                return  # retired: the connection goes with this frame
            try:
                if client is None:
                    client = self.connect()
                    self.has_client = True
                call.result = call.fn(client)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                call.error = e
                client, self.has_client = None, False  # a failed connection may be out of step: a new one
            call.done.set()


class StoreClient:
    """Calls into the store, each bounded; the client is made by ``connect(timeout_s)``
    in the owner thread, with ``connect_timeout`` (a request's timeout)."""

    def __init__(self, connect: Callable[[float], Any], connect_timeout: float, name: str) -> None:
        self._connect = connect
        self._connect_timeout = connect_timeout
        self._name = name
        self._lock = threading.Lock()
        self._owner: Optional[_Owner] = None
        self._owners: List[_Owner] = []  # every owner started, for stop() to join
        self._pending: Set[_Call[Any]] = set()
        self._closed = False

    def call(self, fn: Callable[[Any], T], timeout: float, connect_s: float = 0.0) -> T:
        """``fn(client)`` in the owner thread; its result, or its exception re-raised.
        Raises :class:`StoreOverrun` after ``timeout`` seconds (plus ``connect_s`` when a
        connection must be made first): the owner is then retired with its connection."""
        call: _Call[T] = _Call(fn)
        owner = self._enqueue(call)
        if owner is None:  # no thread can be started (interpreter shutdown): the caller is the only user
            return fn(self._connect(min(timeout, self._connect_timeout)))
        if not owner.has_client:
            timeout += connect_s
        try:
            if not call.done.wait(timeout):
                self._retire(owner)
                raise StoreOverrun(f"no answer within {timeout:.2f}s")
        finally:
            with self._lock:
                self._pending.discard(call)
        if call.error is not None:
            raise call.error
        return call.result  # type: ignore[return-value]

    def _enqueue(self, call: _Call[Any]) -> Optional[_Owner]:
        with self._lock:
            if self._closed:
                raise StoreOverrun("the store client is closed")
            owner = self._owner
            if owner is None:
                self._owners = [o for o in self._owners if o.thread.is_alive()]
                if len(self._owners) >= MAX_RETIRED:
                    raise StoreOverrun(f"{len(self._owners)} earlier store requests are still unanswered")
                owner = _Owner(functools.partial(self._connect, self._connect_timeout), self._name)
                try:
                    owner.thread.start()
                except RuntimeError:  # at interpreter shutdown (Python 3.12+): no new threads
                    return None
                self._owner = owner
                self._owners.append(owner)
            self._pending.add(call)
            owner.jobs.put(call)
            return owner

    def _retire(self, owner: _Owner) -> None:
        with self._lock:
            if self._owner is owner:
                self._owner = None
        # Calls queued behind the one that hung would wait for it: they fail now.
        while True:
            try:
                queued = owner.jobs.get_nowait()
            except queue.Empty:
                break
            if queued is not None:
                queued.fail(StoreOverrun("the store connection was abandoned"))
        owner.jobs.put(None)  # the owner ends after the call it is stuck in, if that ever returns

    def close(self, deadline: float) -> List[threading.Thread]:
        """No more calls; every caller still waiting gets :class:`StoreOverrun` at once;
        every owner thread is joined until ``deadline`` (``time.monotonic()``). Returns the
        threads still running then (blocked in a store request that never ends)."""
        with self._lock:
            self._closed = True
            owners, self._owner = list(self._owners), None
            pending, self._pending = list(self._pending), set()
        for call in pending:
            call.fail(StoreOverrun("the store client is closed"))
        for owner in owners:
            owner.jobs.put(None)
        for owner in owners:
            if owner.thread is not threading.current_thread():
                owner.thread.join(max(0.0, deadline - time.monotonic()))
        return [o.thread for o in owners if o.thread.is_alive()]


def connect(endpoint: Any, timeout: float) -> Any:
    """A new client of the store at ``"host:port"``, or the user's Store itself; raises on
    failure. Only in a thread that owns it, once the application has imported
    torch.distributed (``collectives.torch_loaded()``): peerwatch never imports torch."""
    if not isinstance(endpoint, str):
        return endpoint
    dist = imported("torch.distributed")
    if dist is None:
        raise ImportError("torch.distributed is not imported (yet) by the application")
    host, _, port = endpoint.rpartition(":")
    # Probe with a plain socket first: torch's client logs a C++ stack trace per failed
    # attempt, and the store does not exist before init_process_group.
    with socket.create_connection((host, int(port)), timeout=timeout):
        pass
    return dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout))


__all__ = ["MAX_RETIRED", "StoreClient", "StoreOverrun", "connect"]
