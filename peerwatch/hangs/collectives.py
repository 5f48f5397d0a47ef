"""The collective counters torch keeps for every process group (its flight recorder),
read from the watcher thread: progress that needs no ``beat()``.

``import peerwatch`` never imports torch: these are read only once the application has
imported ``torch.distributed`` itself, and every call is guarded. Never silently off: the
reader's :attr:`CollectiveReader.state` (``waiting``, ``read``, ``none``, ``failing``: the
table of docs/hangs.md, "Which ranks are read") goes out with every heartbeat. ``none``
is said only once torch and torch.distributed have finished importing: a heartbeat that
lands in the middle of ``import torch`` finds ``torch.distributed`` in ``sys.modules`` but
not its C module yet.

Costs, measured (torch 2.13, gloo; benchmarks/hang_diagnosis.py): the counters
(``includeCollectives=False``) take a few microseconds per heartbeat. The entries
(``includeCollectives=True``, up to 2000 per process) take tens of milliseconds once the
ring is full, so they are read only when the counters have stopped moving, once per
stall, to say which op and sizes each rank is waiting in.

Only the last enqueued count is taken as movement: gloo marks a collective completed
lazily (the last one may read as not completed long after it was), and a collective
that fails with the timeout reads as completed too.

It is also the one home of what "inside torch.distributed" means (:func:`in_torch_distributed`,
:func:`raised_by_torch_distributed`): for a main thread waiting there (the heartbeat's
``in_collective``) and for an exception raised there (a failure record's ``collective``,
the echo of another rank's failure that :mod:`peerwatch.verdict.decide` holds back;
rule: echo waits for the leaving).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import traceback
from types import TracebackType
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from ..core.terminal import exception_message

logger = logging.getLogger("peerwatch")

_C10D = "torch._C._distributed_c10d"
_DUMPS = ("_dump_fr_trace_json", "_dump_nccl_trace_json")  # gloo (and all backends); NCCL's own on CUDA builds

# (group, last enqueued seq, last completed seq), one per process group, sorted by group.
Counters = Tuple[Tuple[str, int, int], ...]
# (group, seq, op, sizes and dtypes) of the collective a rank last entered in each group.
Entered = Tuple[Tuple[str, int, str, str], ...]

# Whether this rank's collectives are read (Heartbeat.collectives_state, ``peerwatch status``).
READ = "read"  # the last read of the counters worked
WAITING = "waiting"  # torch.distributed not imported, or still importing: looked at again next heartbeat
NONE = "none"  # torch finished importing and has no flight recorder: never read
FAILING = "failing"  # the last read failed (its reason in CollectiveReader.error): tried again next heartbeat
OFF = "off"  # not asked for: hang_warn is off and there is no hang_timeout
STATES = (READ, WAITING, NONE, FAILING, OFF)
MAX_ERROR_CHARS = 120  # the reason of a failing read, as published: one short line


class CollectiveReader:
    """Reads this process's collective counters. Owned by the watcher thread (``state``
    and ``error`` too)."""

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._said: Set[str] = set()  # the states already said in the log (once each)
        # None: not known yet (torch not imported, or importing); []: no flight recorder, for good.
        self._dumps: Optional[List[Callable[..., Any]]] = None
        self.state = WAITING
        self.error = ""  # why the last read failed (state FAILING), at most MAX_ERROR_CHARS
        self.timeout_ms: Dict[str, int] = {}  # group -> its collective timeout, as the entries say

    def available(self) -> bool:
        """True once torch.distributed has finished importing and has a flight recorder we
        can call. False while it is not imported or still importing (``state`` WAITING:
        asked again next time), and for good where it has none (``state`` NONE)."""
        if self._dumps is None:
            self._dumps = flight_recorder()
            if self._dumps is None:
                return False  # the application has not imported it (yet): never import it ourselves
            if not self._dumps:
                self.state = NONE
                self._say(NONE, "torch.distributed has no flight recorder here (no _dump_fr_trace_json)")
        return bool(self._dumps)

    def counters(self) -> Optional[Counters]:
        """Every process group's counters now; None where they cannot be read (``state``
        says why: WAITING, NONE or FAILING)."""
        if not self.available():
            return None
        bodies = self._read(False)
        if bodies is None:
            return None
        groups: Dict[str, Tuple[int, int]] = {}
        for body in bodies:
            by_group = body.get("pg_status")
            for group, status in (by_group.items() if isinstance(by_group, dict) else ()):
                try:
                    groups[str(group)] = (int(status["last_enqueued_collective"]), int(status["last_completed_collective"]))
                except (KeyError, TypeError, ValueError):
                    continue
        return tuple((g, e, c) for g, (e, c) in sorted(groups.items()))

    def entered(self, counters: Counters, kept: int) -> Entered:
        """The op, sizes and dtypes of the last ``kept`` collectives entered in each group
        (up to its last enqueued seq): read only when the counters stopped moving (costly)."""
        wanted = {g: e for g, e, _ in counters if e > 0}
        found: Dict[Tuple[str, int], Tuple[str, str]] = {}
        for body in self._read(True) or ():
            for entry in body.get("entries") or ():
                try:
                    group, seq = str(entry["pg_id"]), int(entry["collective_seq_id"])
                    if entry.get("timeout_ms"):
                        self.timeout_ms[group] = int(entry["timeout_ms"])
                    last = wanted.get(group)
                    if last is not None and last - kept < seq <= last and not entry.get("is_p2p"):
                        found[(group, seq)] = (str(entry.get("profiling_name", "")), _shape(entry))
                except (KeyError, TypeError, ValueError):
                    continue
        return tuple((g, s, op, shape) for (g, s), (op, shape) in sorted(found.items()))

    def enqueued(self) -> List[Tuple[int, int, int]]:
        """(group's pg_id, seq, enqueue time_ns) of every collective in the recorder's ring,
        point-to-point ones left out: the straggler's enqueue measure. Costly (the whole
        ring: 20-50 ms with 2000 entries, holding the GIL): read once every few slots."""
        out: List[Tuple[int, int, int]] = []
        if not self.available():
            return out
        for body in self._read(True) or ():
            for entry in body.get("entries") or ():
                try:
                    if not entry.get("is_p2p"):
                        out.append((int(entry["pg_id"]), int(entry["collective_seq_id"]), int(entry["time_created_ns"])))
                except (KeyError, TypeError, ValueError):
                    continue
        return out

    def _read(self, entries: bool) -> Optional[List[Dict[str, Any]]]:
        """What each dump says; None if none could be read (``state`` FAILING, tried again
        on the next call). One that reads is enough (a CUDA build has two)."""
        out, error = [], ""
        for dump in self._dumps or ():
            try:
                body = json.loads(dump(includeCollectives=entries, onlyActive=False))
            except Exception as e:  # noqa: BLE001 - torch's internals: whatever they raise, training goes on
                error = f"{type(e).__name__}: {e}"
                continue
            if isinstance(body, dict):
                out.append(body)
            else:
                error = f"not a JSON object ({type(body).__name__})"
        if out:
            if self.state == FAILING:
                logger.info("peerwatch: rank %d: its flight recorder is read again", self._rank)
            self.state, self.error = READ, ""
            return out
        self.state, self.error = FAILING, _short(error or "no dump")
        self._say(FAILING, f"its flight recorder could not be read ({self.error}; tried again every heartbeat)")
        return None

    def _say(self, state: str, why: str) -> None:
        if state not in self._said:
            self._said.add(state)
            logger.warning(
                "peerwatch: rank %d: %s; hangs are found only with hang_timeout and peerwatch.beat()", self._rank, why,
            )


def flight_recorder() -> Optional[List[Callable[..., Any]]]:
    """The flight recorder's dump functions of the torch this process imported; None while
    ``torch`` or ``torch.distributed`` is not imported, or is still being imported (the
    watcher thread runs beside the application's ``import torch``); [] once both have
    finished importing and there are none. Never imports anything."""
    if not torch_loaded():
        return None
    c10d = sys.modules.get(_C10D) or getattr(sys.modules.get("torch._C"), "_distributed_c10d", None)
    return [getattr(c10d, name) for name in _DUMPS if callable(getattr(c10d, name, None))]


def torch_loaded() -> bool:
    """torch and torch.distributed are imported, completely (not under way in another
    thread). importlib marks a module whose code is still running (``spec._initializing``):
    it is in ``sys.modules`` from its first line, what it imports later not yet."""
    for name in ("torch", "torch.distributed"):
        module = sys.modules.get(name)
        if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
            return False
    return True


def _short(text: str) -> str:
    """One line of at most MAX_ERROR_CHARS (an exception's message may be a page)."""
    line = " ".join(text.split())
    return line if len(line) <= MAX_ERROR_CHARS else line[: MAX_ERROR_CHARS - 3] + "..."


def imported(name: str) -> Optional[Any]:
    """The module ``name`` if the application has imported it, fully; else None. Never
    imports anything: a module still being imported (by another thread) is not used yet."""
    module = sys.modules.get(name)
    if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
        return None
    return module


def c10d() -> Optional[Any]:
    """torch's C++ distributed bindings, once torch and ``torch.distributed`` are fully imported; else None."""
    if not torch_loaded():
        return None
    return sys.modules.get(_C10D) or getattr(sys.modules.get("torch._C"), "_distributed_c10d", None)


def _shape(entry: Dict[str, Any]) -> str:
    """``[[4]] Float``: what two ranks must agree on in one collective."""
    sizes = entry.get("input_sizes") or []
    dtypes = entry.get("input_dtypes") or []
    return f"{sizes} {','.join(map(str, dtypes))}".strip() if sizes or dtypes else ""


# -- inside torch.distributed ---------------------------------------------------------

# torch.distributed's own Python code: the package, and DDP's module, which is
# torch.distributed's though it lives in torch.nn.parallel (the rest of torch.nn.parallel,
# DataParallel, is one process: not distributed). DDP's module is innermost where DDP
# calls its collectives from Python: a rank whose peer is late waits at the top of DDP's
# forward, in _pre_forward (the reducer's bucket rebuild) or _distributed_broadcast_coalesced
# (the buffers' broadcast), seen with torch 2.13 and gloo. Its backward never shows it: the
# gradient all-reduces run from the reducer's C++ hooks, waited for under autograd's frame
# (torch/autograd/graph.py), in no file of torch.distributed, so they count as neither.
_TORCH_DISTRIBUTED_DIR = os.sep + os.path.join("torch", "distributed") + os.sep
_DDP_FILE = os.sep + os.path.join("torch", "nn", "parallel", "distributed.py")
# What torch.distributed's backends say when a peer is gone or does not answer: gloo's
# "Connection reset by peer", "Connection closed by peer", its timeouts (their source file
# is under gloo/transport), a broken pipe; NCCL's aborted communicator. This is what tells
# an error of DDP's reducer raised inside backward(): it comes from autograd's C++ engine,
# and its innermost Python frame is autograd's, not torch.distributed's.
_BACKEND_WORDS = re.compile(r"gloo/transport|Connection (?:reset|closed) by peer|Broken pipe|NCCL|ProcessGroup", re.I)
_MESSAGE_CHARS = 2000  # of an exception's message, read for the backend's words


def in_torch_distributed(filename: str) -> bool:
    """Is ``filename`` (a code object's) torch.distributed's own code? The one meaning of
    "inside torch.distributed": for a main thread waiting there (the heartbeat's
    ``in_collective``, the wait sampler's waits) and for an exception raised there."""
    return _TORCH_DISTRIBUTED_DIR in filename or filename.endswith(_DDP_FILE)


def raised_by_torch_distributed(exc: BaseException, tb: Optional[TracebackType]) -> bool:
    """Was ``exc`` raised by torch.distributed (a collective, DDP's reducer, the store)?

    By its type's module (``torch.distributed.DistBackendError``...), the frame it was raised
    in, or the backend's words. Only the innermost frame counts: under DDP every training
    step runs inside DDP's forward(), and a user's own exception raised there is no
    collective's; the heartbeat's "waiting inside torch.distributed" is judged the same way.
    """
    if type(exc).__module__.startswith("torch.distributed"):
        return True
    frames = list(traceback.walk_tb(tb))
    if frames and in_torch_distributed(frames[-1][0].f_code.co_filename):
        return True
    return in_backend_words(exception_message(exc))


def in_backend_words(message: str) -> bool:
    """Does ``message`` say what torch.distributed's backends say when a peer is gone?"""
    return bool(_BACKEND_WORDS.search(message[:_MESSAGE_CHARS]))


__all__ = [
    "FAILING", "MAX_ERROR_CHARS", "NONE", "OFF", "READ", "STATES", "WAITING", "CollectiveReader", "Counters", "Entered",
    "c10d", "flight_recorder", "imported", "in_backend_words", "in_torch_distributed", "raised_by_torch_distributed",
    "torch_loaded",
]
