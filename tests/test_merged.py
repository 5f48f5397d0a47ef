"""The merge of every standing-still host's stall (peerwatch.hangs.merged): pure, no store.

What matters of a merge (``diag/all``): the diagnosis that a host's judges make over it
(their own ranks, plus :func:`~peerwatch.hangs.diagnose.remote_ranks` of each of
``Merged.summaries(me)``) names the same laggards, with the same kind, process group and
sequence number, as the diagnosis over every host's summary unmerged; at 1,024 hosts it is
a few kB, and whatever the job it stays under ``MAX_MERGED_BYTES`` (a longer value is not
one) and reads back as written. Garbage reads as no merge, cheaply.

The ranks' states are those of tests/test_summary.py: ``WAITING`` waits in all_reduce #31
of process group "0"; ``STUCK`` stands at #30, not in a collective, with a whole window of
samples and no sign of work (plainly stuck). Host ``j`` of a job runs ranks
``j * per .. j * per + per - 1``.
"""

from __future__ import annotations

import dataclasses
import json
import tracemalloc
from typing import Dict, Iterable, Mapping, Optional, Tuple

from peerwatch.hangs.diagnose import (
    MAX_SUMMARY_RANKS,
    Found,
    RankState,
    Summary,
    diagnose,
    remote_ranks,
    summarize,
)
from peerwatch.hangs.merged import (
    MAX_CROWD_GROUPS,
    MAX_MERGED_BYTES,
    MAX_WHOLE,
    MERGED_VERSION,
    Merged,
    merge,
)
from peerwatch.proc.activity import Activity

S = 1_000_000_000
MOVED = 100 * S  # every rank's last move (one clock: the reader's)
MADE = 110 * S  # when every host made its summary (age 10 s)
THRESHOLD = 60 * S  # the warning threshold
STUCK_NS = 10 * S  # the stuck threshold (rule: plainly stuck)
LATE = MOVED + 2 * THRESHOLD  # far past the threshold: any hang is named
EARLY = MADE + 2 * S  # past the stuck threshold only: a plainly stuck laggard is named

WAITING = RankState(collectives=(("0", 31, 30),), entered=(("0", 31, "allreduce", "[[1]] Float"),), in_collective=True,
                    moved_mono_ns=MOVED, state="S")
STUCK = RankState(collectives=(("0", 30, 30),), entered=(("0", 30, "allreduce", "[[1]] Float"),), state="S",
                  where="train.py:12 in loop", moved_mono_ns=MOVED,
                  activity=Activity(span_ms=4000, cpu_ms=0, places=1, other_cpu_ms=0, io_bytes=0, children_cpu_ms=0,
                                    samples=8))
BEHIND = dataclasses.replace(WAITING, collectives=(("0", 30, 29),), entered=(("0", 30, "allreduce", "[[1]] Float"),))
OTHER_OP = dataclasses.replace(WAITING, entered=(("0", 31, "broadcast", "[[4]] Float"),))

Job = Dict[int, Dict[int, RankState]]  # host index -> its ranks' states, as its own judges see them


def name(j: int) -> str:
    return f"node{j:04d}"


def job(hosts: Iterable[int], per: int = 8, odd: Optional[Mapping[int, RankState]] = None) -> Job:
    """Every host's ranks WAITING in all_reduce #31, but those of a host in ``odd``, in its state."""
    odd = odd or {}
    return {j: {j * per + i: odd.get(j, WAITING) for i in range(per)} for j in hosts}


def summaries(ranks: Job, now: int = MADE) -> Dict[int, Summary]:
    """Each host's summary, made at ``now`` (all of them stand still)."""
    out = {}
    for j, mine in ranks.items():
        s = summarize(mine, name(j), now, THRESHOLD, stuck_ns=STUCK_NS)
        assert s is not None
        out[j] = s
    return out


def local(mine: Mapping[int, RankState], j: int) -> Dict[int, RankState]:
    """The reader's own ranks as its judges take them: in full, with its host named."""
    return {r: dataclasses.replace(s, host=name(j)) for r, s in mine.items()}


def read(mine: Mapping[int, RankState], me: int, others: Iterable[Summary]) -> Dict[int, RankState]:
    """What host ``me``'s judges diagnose: the others' ranks, then its own (its own win)."""
    ranks: Dict[int, RankState] = {}
    for s in others:
        ranks.update(remote_ranks(s, MOVED))
    ranks.update(local(mine, me))
    return ranks


def unmerged(ranks: Job, stalls: Mapping[int, Summary], me: int) -> Dict[int, RankState]:
    return read(ranks[me], me, [s for j, s in stalls.items() if j != me])


def merged(ranks: Job, m: Merged, me: int) -> Dict[int, RankState]:
    return read(ranks[me], me, [s for _, s in m.summaries(me)])


def key(found: Optional[Found]) -> Tuple[object, ...]:
    assert found is not None
    return found.kind, found.laggards, found.group, found.seq


def both(ranks: Job, stalls: Mapping[int, Summary], m: Merged, me: int, now: int) -> Tuple[Tuple[object, ...], ...]:
    """The finding of host ``me``'s judges over every summary unmerged, and over the merge."""
    views = (unmerged(ranks, stalls, me), merged(ranks, m, me))
    return tuple(key(diagnose(r, now, THRESHOLD, stuck_ns=STUCK_NS)) for r in views)


def test_a_merge_reads_back_as_written_and_garbage_as_none() -> None:
    """``Merged.from_json(m.to_json()) == m`` for a merge with whole hosts and a crowd; bytes
    that are no merge (empty, no version, another version, too long, a run backwards, more
    ranks than a value may name) read as None, without an exception."""
    ranks = job(range(64), odd={5: STUCK, 9: BEHIND})
    m = merge(summaries(ranks))
    assert [j for j, _ in m.whole] == [5, 9] and m.crowd is not None and m.of == tuple(range(64))
    data = m.to_json()
    assert Merged.from_json(data) == m
    counted = dataclasses.replace(m, left_out=3)
    assert Merged.from_json(counted.to_json()) == counted
    assert Merged.from_json(None) is None
    body = json.loads(data)
    bad = [
        b"", b"{}", b"[]", b"\xff", b"null", json.dumps({**body, "v": MERGED_VERSION + 1}).encode(),
        b" " * (MAX_MERGED_BYTES + 1), data + b" " * (MAX_MERGED_BYTES + 1 - len(data)),
        json.dumps({**body, "of": [[5, 2]]}).encode(), json.dumps({**body, "of": [[0, 10**9]]}).encode(),
        json.dumps({**body, "of": [[0, MAX_SUMMARY_RANKS]]}).encode(), json.dumps({**body, "of": [True]}).encode(),
        json.dumps({**body, "of": [-1]}).encode(), json.dumps({**body, "of": 7}).encode(),
        json.dumps({**body, "whole": [[1]]}).encode(), json.dumps({**body, "out": "x"}).encode(),
        b"[" * 100_000 + b"]" * 100_000,
    ]
    for junk in bad:
        assert Merged.from_json(junk) is None, junk[:80]
    assert len(data + b" " * (MAX_MERGED_BYTES - len(data))) == MAX_MERGED_BYTES
    assert Merged.from_json(data + b" " * (MAX_MERGED_BYTES - len(data))) == m  # the longest one is read


def test_a_merge_never_names_more_ranks_than_a_value_may_nor_costs_much_to_read() -> None:
    """A merge of ``MAX_WHOLE`` whole summaries, each within ``MAX_SUMMARY_RANKS`` but more
    than that in all (a run is cheap to write and costly to expand: ``unspan`` counts the
    ranks of one value), is not one, and finding out takes little memory."""
    fat = {"v": 2, "host": "x", "stall": "1", "age_ms": 1, "waiting": [[[[0, MAX_SUMMARY_RANKS - 1]], {}]]}
    assert Summary.from_body(fat) is not None  # each alone is a summary
    data = json.dumps({"v": MERGED_VERSION, "of": [[0, MAX_WHOLE - 1]], "whole": [[j, fat] for j in range(MAX_WHOLE)],
                       "crowd": None, "out": 0}).encode()
    assert len(data) < 2000  # 2 kB that would expand to a million ranks
    tracemalloc.start()
    try:
        back = Merged.from_json(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(f"from_json of {MAX_WHOLE} whole summaries of {MAX_SUMMARY_RANKS} ranks: peak {peak / 1e6:.1f} MB")
    assert back is None
    assert peak < 8 * 1024 * 1024


def test_a_whole_host_behind_at_1024_hosts_is_kept_whole_and_named_as_unmerged() -> None:
    """1,023 hosts wait in all_reduce #31; host 517's 8 ranks stand at #30, plainly stuck.
    The merge keeps host 517 whole, the other 8,184 ranks in one crowd group of two runs,
    covers every host and is under 4 kB; host 3's judges over it name host 517's ranks (a
    hang at #31 of group 0), as over the 1,024 summaries unmerged: far past the threshold,
    and past the stuck threshold only."""
    ranks = job(range(1024), odd={517: STUCK})
    stalls = summaries(ranks)
    m = merge(stalls)
    size = len(m.to_json())
    print(f"a whole host behind at 1,024 hosts: the merge is {size} bytes")
    assert size < 4000
    assert m.of == tuple(range(1024)) and m.left_out == 0
    assert m.whole == ((517, stalls[517]),)
    assert m.crowd is not None and len(m.crowd.waiting) == 1
    crowded, state = m.crowd.waiting[0]
    assert crowded == tuple(r for r in range(8192) if not 517 * 8 <= r < 518 * 8) and state.collectives == WAITING.collectives
    assert Merged.from_json(m.to_json()) == m
    laggards = tuple(range(517 * 8, 518 * 8))
    for now in (LATE, EARLY):
        plain, of_merge = both(ranks, stalls, m, 3, now)
        assert plain == of_merge == ("hang", laggards, "0", 31), now
    plain, of_merge = both(ranks, stalls, m, 517, LATE)  # the laggards' host reads it too
    assert plain == of_merge == ("hang", laggards, "0", 31)


def test_a_host_waiting_behind_in_a_collective_is_kept_whole_and_named() -> None:
    """The case that a merge of only the hosts with ranks outside a collective would miss:
    host 900's ranks wait inside all_reduce #30 (grouped as waiting, not detailed) while the
    other 1,023 hosts' wait in #31. Host 900 is kept whole, and the diagnosis of the merge
    names its ranks, as unmerged, past the threshold (a waiting rank's summary carries no
    samples: it is never plainly stuck)."""
    ranks = job(range(1024), odd={900: BEHIND})
    stalls = summaries(ranks)
    assert stalls[900].detailed == () and stalls[900].waiting
    m = merge(stalls)
    print(f"a host waiting behind at 1,024 hosts: the merge is {len(m.to_json())} bytes")
    assert [j for j, _ in m.whole] == [900] and len(m.to_json()) < 4000
    laggards = tuple(range(900 * 8, 901 * 8))
    for me in (3, 900):
        plain, of_merge = both(ranks, stalls, m, me, LATE)
        assert plain == of_merge == ("hang", laggards, "0", 31), me


def test_a_host_in_another_collective_is_a_mismatch_in_the_merge_too() -> None:
    """At 256 hosts, host 40's ranks wait in #31 of group 0 as everyone's do, but in a
    broadcast of other sizes: the diagnosis of the merge says MISMATCH naming host 40's
    ranks at #31, as over the summaries unmerged."""
    ranks = job(range(256), odd={40: OTHER_OP})
    stalls = summaries(ranks)
    m = merge(stalls)
    plain, of_merge = both(ranks, stalls, m, 3, LATE)
    assert plain == of_merge == ("mismatch", tuple(range(320, 328)), "0", 31)
    plain, of_merge = both(ranks, stalls, m, 40, LATE)  # the odd host reads it too
    assert plain == of_merge == ("mismatch", tuple(range(320, 328)), "0", 31)


def test_two_thousand_suspect_hosts_fit_the_bounds() -> None:
    """2,000 hosts, each with 32 detailed ranks (every host a suspect) and 8 waiting: the
    merge is at most ``MAX_MERGED_BYTES``, keeps at most ``MAX_WHOLE`` whole (the lowest
    indices that fit), names every other host's waiting ranks in the crowd, counts their
    detailed ranks in ``left_out`` and reads back as written."""
    ranks = {j: {j * 40 + i: STUCK if i < 32 else WAITING for i in range(40)} for j in range(2000)}
    stalls = summaries(ranks)
    m = merge(stalls)
    size = len(m.to_json())
    print(f"2,000 suspect hosts: the merge is {size} bytes, {len(m.whole)} whole")
    assert size <= MAX_MERGED_BYTES
    whole = [j for j, _ in m.whole]
    assert 0 < len(whole) <= MAX_WHOLE and whole == list(range(len(whole)))
    assert m.of == tuple(range(2000))
    assert m.crowd is not None
    assert sorted(r for rs, _ in m.crowd.waiting for r in rs) == [
        j * 40 + i for j in range(len(whole), 2000) for i in range(32, 40)]
    assert m.left_out == 32 * (2000 - len(whole))
    assert Merged.from_json(m.to_json()) == m


def test_the_bound_holds_whichever_hosts_stand_still() -> None:
    """The same 2,000 suspect hosts, but every other host of a 4,000-host job (the others
    moved, or have not said yet): the merge is still at most ``MAX_MERGED_BYTES``, so that
    it is read at all."""
    hosts = range(0, 4000, 2)
    ranks = {j: {j * 40 + i: STUCK if i < 32 else WAITING for i in range(40)} for j in hosts}
    m = merge(summaries(ranks))
    size = len(m.to_json())
    print(f"2,000 suspect hosts of 4,000: the merge is {size} bytes")
    assert size <= MAX_MERGED_BYTES
    assert Merged.from_json(m.to_json()) == m


def test_many_distinct_waits_keep_the_groups_behind_first() -> None:
    """200 hosts each waiting at another seq of group 0 (host j at #300 - j): at most
    ``MAX_CROWD_GROUPS`` groups in the crowd, all of them behind the top (host 0's #300,
    which is in the crowd and left out); the ranks dropped are counted."""
    ranks = {j: {j * 8 + i: dataclasses.replace(WAITING, collectives=(("0", 300 - j, 299 - j),),
                                                entered=(("0", 300 - j, "allreduce", "[[1]] Float"),))
                 for i in range(8)} for j in range(200)}
    m = merge(summaries(ranks))
    assert [j for j, _ in m.whole] == list(range(1, MAX_WHOLE + 1))  # the hosts behind, the lowest first
    assert m.crowd is not None and len(m.crowd.waiting) == MAX_CROWD_GROUPS
    seqs = [s.collectives[0][1] for _, s in m.crowd.waiting]
    assert all(q < 300 for q in seqs)
    named = len(m.whole) * 8 + sum(len(rs) for rs, _ in m.crowd.waiting)
    assert m.left_out == 200 * 8 - named == (200 - MAX_WHOLE - MAX_CROWD_GROUPS) * 8
    assert len(m.to_json()) <= MAX_MERGED_BYTES


def test_the_crowd_is_as_old_as_its_youngest_host_and_a_reader_skips_its_own_whole_summary() -> None:
    """The crowd's age is its youngest member's (the job moved last there), its stall token
    that member's, its threshold the lowest; ``summaries(me)`` hands the reader every whole
    summary but its own, and the crowd (its own ranks there included: they are overridden
    by its own)."""
    def w(j: int) -> Tuple[Tuple[Tuple[int, ...], RankState], ...]:
        return ((tuple(range(j * 8, j * 8 + 8)), RankState(collectives=WAITING.collectives, entered=WAITING.entered,
                                                           in_collective=True)),)

    crowd = {
        8: Summary(name(8), "s8", 2000, 60_000, w(8)),  # as young as host 4: the lower index names the stall
        2: Summary(name(2), "s2", 5000, 60_000, w(2)),
        4: Summary(name(4), "s4", 2000, 30_000, w(4)),
        6: Summary(name(6), "s6", 9000, 60_000, w(6)),
    }
    stalls = summaries(job([5, 7], odd={5: STUCK, 7: STUCK}))
    m = merge({**crowd, **stalls})
    assert [j for j, _ in m.whole] == [5, 7]
    assert m.crowd is not None
    assert (m.crowd.age_ms, m.crowd.stall, m.crowd.threshold_ms) == (2000, "s4", 30_000)
    assert m.crowd.host == "node0002 and 3 other hosts"
    assert [k for k, _ in m.summaries(5)] == ["7", "crowd"]
    assert [k for k, _ in m.summaries(7)] == ["5", "crowd"]
    assert [k for k, _ in m.summaries(4)] == [k for k, _ in m.summaries(None)] == ["5", "7", "crowd"]
    assert dict(m.summaries(None))["5"] == stalls[5]


def test_a_hang_at_ten_thousand_hosts_is_still_named_from_the_merge() -> None:
    """80,000 ranks waiting alike are more than a merge may name (MAX_SUMMARY_RANKS): the
    crowd keeps the lowest of them, counts the rest, and a reader still names the host
    behind (a group dropped whole would leave nobody at #31: no finding at all)."""
    hosts, laggard = 10_000, 4_321
    waiting = RankState(collectives=(("0", 31, 30),), entered=(("0", 31, "allreduce", "[[1]] Float"),),
                        in_collective=True)
    stuck = RankState(collectives=(("0", 30, 30),), entered=(("0", 30, "allreduce", "[[1]] Float"),), state="S",
                      where="train.py:12 in loop",
                      activity=Activity(span_ms=7000, cpu_ms=0, places=1, other_cpu_ms=0, io_bytes=0,
                                        children_cpu_ms=0, samples=8))
    stalls = {h: Summary(f"h{h}", "t", 20_000, 60_000, ((tuple(range(8 * h, 8 * h + 8)), waiting),))
              for h in range(hosts) if h != laggard}
    stalls[laggard] = Summary(f"h{laggard}", "t", 20_000, 60_000, (),
                              tuple((r, stuck) for r in range(8 * laggard, 8 * laggard + 8)), stuck=True)
    m = merge(stalls)
    back = Merged.from_json(m.to_json())
    assert back is not None and back.crowd is not None
    assert sum(len(r) for r, _ in back.crowd.waiting) == MAX_SUMMARY_RANKS - 8
    assert back.left_out == 8 * hosts - MAX_SUMMARY_RANKS
    now = 1000 * S
    ranks: dict = {}
    for _, s in back.summaries(0):
        ranks.update(remote_ranks(s, now - 20 * S))
    found = diagnose(ranks, now, 60 * S, 0, 0, 10 * S)
    assert found is not None and found.laggards == tuple(range(8 * laggard, 8 * laggard + 8))
