"""torch's flight recorder, dumped where torch's own analyzer reads it: evidence a user can
check peerwatch's finding with (``torchfrtrace RUN/flight_recorder``, docs/hangs.md).

Each rank writes ``RUN/flight_recorder/rank_<N>`` (:func:`peerwatch.rundir.rundir.fr_dump_name`):
once per diagnosis of a stall (when the diagnosis record appears in ``events/``, whoever
made it), and when it acts on a verdict, before it leaves (the later dump replaces the
earlier). The bytes are torch's ``_dump_fr_trace`` pickle (``_dump_nccl_trace`` on a CUDA
build whose NCCL recorder has process groups): the analyzer reads pickles only.

Only the watcher thread dumps, and only once the application has imported
``torch.distributed`` (peerwatch never imports torch). torch's call holds the GIL while it
copies the ring (2000 entries at most): with a full ring it took 10 ms on a quiet host,
and held the training thread 16-52 ms (median of a run) on 2 cores loaded 7-12
(benchmarks/fr_dump.py, docs/hangs.md). Without stack traces: torch's first dump with
them spends 2-5 s symbolizing, which a teardown cannot wait for (every thread's Python
stack is in ``stacks/`` anyway).

torch 2.13's gloo recorder registers a process group before Python names it: its
``pg_config`` holds one group named ``""`` (the last one made) instead of ``"0"``,
``"1"``..., and the analyzer stops with a ``KeyError``. The groups torch.distributed knows
(name, description, global ranks) are added where the dump lacks them, and the dump says
so under the key ``peerwatch`` (the analyzer ignores it): what peerwatch added is marked.

Failures (a torch without the API, a dump it cannot make, a full disk) are logged once and
never raised: evidence is a help, never a reason for a rank to fail.
"""

from __future__ import annotations

import logging
import pickle
import pickletools
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..core.records import Diagnosis
from ..rundir.eventlog import log as log_event
from ..rundir.rundir import FLIGHT_RECORDER, RunDir, fr_dump_name
from .collectives import c10d, imported

logger = logging.getLogger("peerwatch")

_DUMPS = ("_dump_nccl_trace", "_dump_fr_trace")  # NCCL's recorder (CUDA builds) first; gloo's and the rest
ADDED_WHY = "torch's recorder did not name these process groups; added from torch.distributed's own"


class FlightRecorderDump:
    """This rank's flight-recorder dumps. Owned by the watcher thread."""

    def __init__(self, run_dir: RunDir, rank: int) -> None:
        self._run_dir = run_dir
        self._rank = rank
        self._diagnosis: Optional[Tuple[int, int]] = None  # (made_by, time_ns) of the one dumped for
        self._said = False  # the one log line of a failure

    def on_diagnosis(self, diagnosis: Optional[Diagnosis]) -> None:
        """Dump once for a diagnosis of a stall going on (not for one resolved)."""
        if diagnosis is None or diagnosis.resolved_ns is not None:
            return
        key = (diagnosis.made_by, diagnosis.time_ns)
        if key != self._diagnosis:
            self._diagnosis = key
            self.dump("diagnosis")

    def dump(self, why: str) -> bool:
        """Write this rank's dump now; False where there is none to write (torch.distributed
        not imported, no process group) or it failed (logged once). Never raises."""
        try:
            started = time.perf_counter()
            found = _read()
            if found is None:
                return False
            data, groups = found
            name = fr_dump_name(self._rank)
            try:
                self._run_dir.write(FLIGHT_RECORDER, name, data, replace=True)
            except FileNotFoundError:  # the folder is made by the first dump of the run on this host
                self._run_dir.make_folder(FLIGHT_RECORDER)
                self._run_dir.write(FLIGHT_RECORDER, name, data, replace=True)
            took_ms = (time.perf_counter() - started) * 1e3
            log_event("flight_recorder", self._rank, why=why, path=self._run_dir.join(FLIGHT_RECORDER, name),
                      bytes=len(data), groups=groups, took_ms=round(took_ms, 1))
            logger.debug("peerwatch: rank %d wrote its flight recorder (%d bytes, %.1f ms, at the %s)",
                         self._rank, len(data), took_ms, why)
            return True
        except Exception as e:  # noqa: BLE001 - torch's internals, the disk: whatever they raise, the rank goes on
            if not self._said:
                self._said = True
                logger.warning("peerwatch: rank %d could not dump its flight recorder to %s (%s: %s); "
                               "the job goes on without it", self._rank, self._run_dir.join(FLIGHT_RECORDER),
                               type(e).__name__, e)
            return False


def _read() -> Optional[Tuple[bytes, int]]:
    """The dump as the analyzer reads it, and its number of process groups; None where
    there is nothing to dump. Raises what torch raises."""
    module = c10d()
    if module is None:
        return None
    chosen: Optional[Tuple[Callable[..., bytes], Dict[str, Any]]] = None
    error: Optional[Exception] = None
    for name in _DUMPS:
        dump = getattr(module, name, None)
        if not callable(dump):
            continue
        try:
            # The recorder's groups and counters alone (no entries): a fraction of a millisecond.
            # Unpickled: bytes torch made in this very process, not read from anywhere.
            head = pickle.loads(dump(includeCollectives=False, includeStackTraces=False, onlyActive=False))
        except Exception as e:  # noqa: BLE001 - one recorder failing leaves the other
            error = error or e
            continue
        if isinstance(head, dict) and (head.get("pg_status") or head.get("pg_config")):
            chosen = (dump, head)
            break  # NCCL's, where it has groups; else the generic one (gloo)
    if chosen is None:
        if error is not None:
            raise error
        return None  # no process group: nothing to analyze
    dump, head = chosen
    groups = _groups()
    data = dump(includeCollectives=True, includeStackTraces=False, onlyActive=False)
    config = head.get("pg_config")
    return with_groups(data, config if isinstance(config, dict) else {}, groups), len(groups)


def _groups() -> Dict[str, Dict[str, str]]:
    """Every process group torch.distributed knows, as the recorder's ``pg_config`` says
    one: name -> {name, desc, ranks (global, in group-rank order, as a string)}."""
    module = imported("torch.distributed.distributed_c10d")
    world = getattr(module, "_world", None)
    if world is None:
        return {}
    names = dict(world.pg_names)  # copied at once: the training thread may make a group meanwhile
    ranks = dict(world.pg_group_ranks)
    found = {}
    for pg, name in names.items():
        members: Dict[int, int] = dict(ranks.get(pg) or {})  # global rank -> rank in the group
        ordered: List[int] = sorted(members, key=lambda r: members[r])
        found[str(name)] = {"name": str(name), "desc": str(getattr(pg, "group_desc", "") or ""), "ranks": str(ordered)}
    return found


def missing_groups(config: Dict[str, Any], groups: Dict[str, Dict[str, str]]) -> Optional[Dict[str, Any]]:
    """``config`` (a dump's ``pg_config``) with the groups it lacks, and without the
    recorder's unnamed one (torch 2.13's gloo, see the module's docstring); None if it
    lacks none."""
    added = {name: g for name, g in groups.items() if name not in config}
    if not added:
        return None
    fixed = {name: g for name, g in config.items() if name != "" or "" in groups}
    fixed.update(added)
    return fixed


def with_groups(data: bytes, config: Dict[str, Any], groups: Dict[str, Dict[str, str]]) -> bytes:
    """torch's pickled dump ``data``, its ``pg_config`` (``config``) completed with
    ``groups`` (:func:`missing_groups`), and the names added under ``peerwatch``.

    The entries (up to 2000 dicts) are not unpickled: unpickling and pickling them again
    held the training thread 44 ms (median) and up to 150 ms on a loaded host (the objects
    made set off the garbage collector: up to 84 ms with it, 9 ms without). The stream is
    continued instead: torch's ends with its dict (the first object it made, at the bottom
    of the stack) and a STOP; before the STOP, SETITEM sets each key on it again (a reader
    gets the last value of a key). Where the stream is not the one expected (protocol 2,
    a dict first), it is unpickled and pickled."""
    fixed = missing_groups(config, groups)
    if fixed is None:
        return data
    marker = {"pg_config_added": sorted(set(fixed) - set(config)), "why": ADDED_WHY}
    if data.startswith(b"\x80\x02}") and data.endswith(b"."):
        items = b"".join(_ops(key) + _ops(value) + b"s" for key, value in (("pg_config", fixed), ("peerwatch", marker)))
        return data[:-1] + items + b"."
    body = pickle.loads(data)
    body["pg_config"], body["peerwatch"] = fixed, marker
    return pickle.dumps(body, protocol=2)


def _ops(value: object) -> bytes:
    """The pickle opcodes that push ``value`` (protocol 2, no header, no STOP). Its memo
    indices may reuse torch's: nothing after them refers to torch's memo."""
    return pickletools.optimize(pickle.dumps(value, protocol=2))[2:-1]


__all__ = ["FlightRecorderDump", "missing_groups", "with_groups"]
