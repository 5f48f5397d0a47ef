"""Every standing-still host's stall as one value (``diag/all``): what each host's hang
diagnosis needs of the whole job, bounded whatever its size. Pure.

The aggregator (one host, peerwatch.hosts.hosts.aggregate_term) reads the summary
(:class:`~peerwatch.hangs.diagnose.Summary`) of every host whose beat says it stands still,
merges them here, and every other host reads the merge with one ``get``
(docs/multi-node.md, "Hangs across hosts"). A hang has few laggards and many ranks that
wait for them, and those wait alike:

- a host that may hold a laggard keeps its summary whole (at most ``MAX_WHOLE`` hosts and
  ``WHOLE_BYTES``): one with a rank not waiting inside a collective, or waiting
  behind another rank of its process group (a lower sequence number);
- every other host's waiting ranks join one summary, the *crowd*: grouped by what they
  published (hosts whose ranks all wait in the same all_reduce are one group, their ranks
  runs of numbers), last moved when the latest of them moved, named after its first host
  and how many more; past ``MAX_SUMMARY_RANKS`` ranks in all (80,000 waiting alike at
  10,000 hosts of 8), a group keeps its lowest ranks and counts the others.

So the diagnosis of a merge names the laggards that the diagnosis of every summary names
(the rules look at sequence numbers per process group, at the ranks behind and at what
each side entered, never at which host a waiting rank is on). A host beyond the bounds
loses its ranks' details, never the fact that they wait where they wait (counted in
``left_out`` when even that does not fit).
"""

from __future__ import annotations

import dataclasses
import json
from typing import AbstractSet, Any, Dict, List, Mapping, Optional, Tuple

from ..core.records import json_int as _int
from .diagnose import MAX_SUMMARY_BYTES, MAX_SUMMARY_RANKS, RankState, Summary, spans, unspan

MERGED_VERSION = 1
MAX_WHOLE = 16  # hosts whose summary a merge keeps whole (those that may hold a laggard first)
MAX_MERGED_BYTES = MAX_SUMMARY_BYTES  # a merge is at most this long (a longer value is not one)
WHOLE_BYTES = MAX_MERGED_BYTES // 2  # the whole summaries' share of it
OF_BYTES = 4096  # the hosts merged, as runs of indices, at most (past it: those the digest names)
CROWD_BYTES = MAX_MERGED_BYTES // 2 - OF_BYTES - 1024  # the crowd's (a few hundred bytes in a hang), less the rest
LABEL_CHARS = 64  # of the crowd's first host name and stall token (read from the store: anyone's)
MAX_CROWD_GROUPS = 64  # distinct waits in the crowd (a hang has a few: where the ranks wait, and the ranks behind)


@dataclasses.dataclass(frozen=True)
class Merged:
    """The stalls of the hosts in ``of``: some whole (by host index), the rest in ``crowd``."""

    of: Tuple[int, ...]  # the indices of the hosts merged (covered: a reader need not read again for them)
    whole: Tuple[Tuple[int, Summary], ...] = ()
    crowd: Optional[Summary] = None
    left_out: int = 0  # ranks that did not fit at all (past MAX_CROWD_GROUPS or the bytes)

    def summaries(self, me: Optional[int]) -> List[Tuple[str, Summary]]:
        """What a reader (host ``me``) hands its judges, each with a key that stays the same
        from one merge to the next (its host's index, or ``crowd``); its own host left out."""
        out = [(str(j), s) for j, s in self.whole if j != me]
        return out + ([("crowd", self.crowd)] if self.crowd is not None else [])

    def to_json(self) -> bytes:
        body = {"v": MERGED_VERSION, "of": spans(self.of), "whole": [[j, s.body()] for j, s in self.whole],
                "crowd": self.crowd.body() if self.crowd is not None else None, "out": self.left_out}
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: Optional[bytes]) -> Optional[Merged]:
        """The merge, or None: not there, too long, not one (a whole summary that is not one
        is left out, the rest kept)."""
        if data is None or len(data) > MAX_MERGED_BYTES:
            return None
        try:
            body = json.loads(data.decode("utf-8"))
            if not isinstance(body, dict) or body.get("v") != MERGED_VERSION:
                return None
            counted = [0]  # ranks named in the whole value, against MAX_SUMMARY_RANKS: runs are cheap to write
            entries = body.get("whole", ())
            if len(entries) > MAX_WHOLE:
                return None
            whole = tuple((_int(j), s) for j, s in ((j, Summary.from_body(b, counted)) for j, b in entries)
                          if s is not None)
            crowd = Summary.from_body(body["crowd"], counted) if body.get("crowd") is not None else None
            if counted[0] > MAX_SUMMARY_RANKS:  # a summary refused for it: the value is not one of ours
                return None
            return cls(unspan(body.get("of", ())), whole, crowd, max(0, _int(body.get("out", 0))))
        except (UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
            return None


def merge(stalls: Mapping[int, Summary], named: AbstractSet[int] = frozenset()) -> Merged:
    """One merge of the hosts' ``stalls`` (host index -> its summary), bounded. ``of`` names
    them all where that takes at most ``OF_BYTES``, else those in ``named`` (the hosts the
    digest names: the ones a reader looks for)."""
    of = tuple(sorted(stalls))
    if len(json.dumps(spans(of))) > OF_BYTES:
        of = tuple(j for j in of if j in named)
    top = _tops(stalls)
    suspects = sorted(j for j, s in stalls.items() if s.detailed or any(_behind(w, top) for _, w in s.waiting))
    whole: List[Tuple[int, Summary]] = []
    size = 0
    for j in suspects:  # past the bounds, a suspect's waiting ranks join the crowd
        n = len(stalls[j].to_json()) if len(whole) < MAX_WHOLE else 0
        if not n or size + n > WHOLE_BYTES:
            break
        whole.append((j, stalls[j]))
        size += n
    kept = {j for j, _ in whole}
    crowd, left_out = _crowd({j: s for j, s in stalls.items() if j not in kept}, top,
                             sum(len(s.ranks()) for _, s in whole))
    return Merged(of, tuple(whole), crowd, left_out)


def _tops(stalls: Mapping[int, Summary]) -> Dict[str, int]:
    """Per process group, the highest sequence number any rank of any host entered."""
    top: Dict[str, int] = {}
    for s in stalls.values():
        for state in [w for _, w in s.waiting] + [d for _, d in s.detailed]:
            for group, enqueued, _ in state.collectives:
                top[group] = max(top.get(group, enqueued), enqueued)
    return top


def _behind(state: RankState, top: Mapping[str, int]) -> bool:
    return any(enqueued < top[group] for group, enqueued, _ in state.collectives)


def _crowd(stalls: Mapping[int, Summary], top: Mapping[str, int], named: int) -> Tuple[Optional[Summary], int]:
    """The waiting ranks of ``stalls`` as one summary (the groups behind first, then the
    largest), and how many ranks did not fit (``named``: ranks the merge names already).
    A detailed rank of a host here (past ``MAX_WHOLE``) is left out too."""
    if not stalls:
        return None, 0
    groups: Dict[Tuple[Any, ...], Tuple[RankState, List[int]]] = {}
    for s in stalls.values():
        for ranks, state in s.waiting:  # a waiting rank is its counters and last entries alone (diagnose.summarize)
            groups.setdefault((state.collectives, state.entered), (state, []))[1].extend(ranks)
    ordered = sorted(groups.values(), key=lambda g: (not _behind(g[0], top), -len(g[1])))
    left_out = sum(len(s.detailed) for s in stalls.values())
    latest = min(stalls.items(), key=lambda kv: (kv[1].age_ms, kv[0]))[1]  # the job moved last there
    first = stalls[min(stalls)]
    host = first.host[:LABEL_CHARS]
    label = host if len(stalls) == 1 else f"{host} and {len(stalls) - 1} other hosts"
    waiting: List[Tuple[Tuple[int, ...], RankState]] = []
    size = 0
    for state, members in ordered:
        # Past MAX_SUMMARY_RANKS (80,000 ranks waiting alike at 10,000 hosts), a group keeps its
        # lowest ranks: where they wait is what the diagnosis needs, the rest are counted.
        kept = tuple(sorted(members)[:max(0, MAX_SUMMARY_RANKS - named)])
        entry = (kept, state)
        n = len(Summary("", "", 0, 0, (entry,)).to_json())  # with a summary's few fixed bytes: an upper bound
        if not kept or len(waiting) >= MAX_CROWD_GROUPS or size + n > CROWD_BYTES:
            left_out += len(members)
            continue
        waiting.append(entry)
        size, named, left_out = size + n, named + len(kept), left_out + len(members) - len(kept)
    crowd = Summary(label, latest.stall[:LABEL_CHARS], latest.age_ms, min(s.threshold_ms for s in stalls.values()), tuple(waiting))
    return crowd, left_out


__all__ = ["CROWD_BYTES", "MAX_CROWD_GROUPS", "MAX_MERGED_BYTES", "MAX_WHOLE", "MERGED_VERSION", "Merged", "WHOLE_BYTES", "merge"]
