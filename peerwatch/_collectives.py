"""The collective counters torch keeps for every process group (its flight recorder),
read from the watcher thread: progress that needs no ``beat()``.

``import peerwatch`` never imports torch: these are read only once the application has
imported ``torch.distributed`` itself (it is then in ``sys.modules``), and every call is
guarded: a torch without the flight recorder, or one whose output we cannot parse, is
said once in the log, and the job is judged by ``beat()`` alone.

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
the echo of another rank's failure that rule 5 of :mod:`peerwatch._decide` holds back).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import traceback
from types import TracebackType
from typing import Any, Callable, Dict, List, Optional, Tuple

logger = logging.getLogger("peerwatch")

_C10D = "torch._C._distributed_c10d"
_DUMPS = ("_dump_fr_trace_json", "_dump_nccl_trace_json")  # gloo (and all backends); NCCL's own on CUDA builds

# (group, last enqueued seq, last completed seq), one per process group, sorted by group.
Counters = Tuple[Tuple[str, int, int], ...]
# (group, seq, op, sizes and dtypes) of the collective a rank last entered in each group.
Entered = Tuple[Tuple[str, int, str, str], ...]


class CollectiveReader:
    """Reads this process's collective counters. Owned by the watcher thread."""

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._said = False  # the one log line of a missing or failing API
        self._dumps: Optional[List[Callable[..., Any]]] = None
        self.timeout_ms: Dict[str, int] = {}  # group -> its collective timeout, as the entries say

    def available(self) -> bool:
        """True once torch.distributed is imported and has a flight recorder we can read."""
        if self._dumps is None:
            if "torch.distributed" not in sys.modules:
                return False  # the application has not imported it (yet): never import it ourselves
            module = sys.modules.get(_C10D)
            self._dumps = [getattr(module, name) for name in _DUMPS if callable(getattr(module, name, None))]
            if not self._dumps:
                self._say("torch.distributed has no flight recorder here (no _dump_fr_trace_json)")
        return bool(self._dumps)

    def counters(self) -> Optional[Counters]:
        """Every process group's counters now; None where they cannot be read."""
        if not self.available():
            return None
        groups: Dict[str, Tuple[int, int]] = {}
        for body in self._read(False):
            for group, status in (body.get("pg_status") or {}).items():
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
        for body in self._read(True):
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

    def _read(self, entries: bool) -> List[Dict[str, Any]]:
        out = []
        for dump in self._dumps or ():
            try:
                raw = dump(includeCollectives=entries, onlyActive=False)
                body = json.loads(raw)
                if isinstance(body, dict):
                    out.append(body)
            except Exception as e:  # noqa: BLE001 - torch's internals: whatever they raise, training goes on
                self._say(f"its flight recorder could not be read ({type(e).__name__}: {e})")
        return out

    def _say(self, why: str) -> None:
        if not self._said:
            self._said = True
            logger.warning(
                "peerwatch: rank %d: %s; hangs are found only with hang_timeout and peerwatch.beat()", self._rank, why,
            )


def _shape(entry: Dict[str, Any]) -> str:
    """``[[4]] Float``: what two ranks must agree on in one collective."""
    sizes = entry.get("input_sizes") or []
    dtypes = entry.get("input_dtypes") or []
    return f"{sizes} {','.join(map(str, dtypes))}".strip() if sizes or dtypes else ""


# -- inside torch.distributed ---------------------------------------------------------

# torch.distributed's own Python code: the package, and DDP's module, which is
# torch.distributed's though it lives in torch.nn.parallel (the rest of torch.nn.parallel,
# DataParallel, is one process: not distributed).
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
    """Is ``filename`` (a code object's) torch.distributed's own code?"""
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
    return in_backend_words(str(exc))


def in_backend_words(message: str) -> bool:
    """Does ``message`` say what torch.distributed's backends say when a peer is gone?"""
    return bool(_BACKEND_WORDS.search(message[:_MESSAGE_CHARS]))


__all__ = [
    "CollectiveReader", "Counters", "Entered", "in_backend_words", "in_torch_distributed", "raised_by_torch_distributed",
]
