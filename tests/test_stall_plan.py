"""The store bridge's plan for the hang diagnosis across hosts (peerwatch.hosts.bridge._Stalls:
which interval publishes this host's summary, which reads the others'): no store, no
thread, one interval's decisions at a time (docs/multi-node.md, "Hangs across hosts")."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

from peerwatch.hangs.diagnose import FLOOR_S, STUCK_S, RankState, Summary, refresh_ns, summarize
from peerwatch.hosts.bridge import _Stalls
from peerwatch.hosts.store_protocol import Seen
from peerwatch.proc.activity import Activity
from peerwatch.rundir.rundir import REMOTE_STALLS_FILE, TMP, RunDir

S = 1_000_000_000
ONSET = 100 * S
LEARNT = int(FLOOR_S * S)
STUCK = int(STUCK_S * S)
EVERY = refresh_ns(LEARNT // 1_000_000, S)  # 7.5 s at the default threshold
STUCK_EVERY = refresh_ns(LEARNT // 1_000_000, S, stuck=True)  # 2.5 s: a summary holding a plainly stuck rank


def _loop(tmp_path: Path) -> _Stalls:
    run_dir = RunDir(str(tmp_path))
    run_dir.make_folder(TMP)
    return _Stalls(run_dir, interval_s=1.0)


def _host_a(now: int) -> Optional[Summary]:
    """Host a's ranks wait in all_reduce #21 since ONSET (no rank of its own is stuck)."""
    waiting = RankState(collectives=(("0", 21, 20),), in_collective=True, moved_mono_ns=ONSET, state="S")
    return summarize({0: waiting, 1: waiting}, "hosta", now, LEARNT, stuck_ns=STUCK)


def _host_b(cpu_ms: int) -> Summary:
    laggard = RankState(collectives=(("0", 20, 20),), moved_mono_ns=ONSET, state="S",
                        activity=Activity(span_ms=7000, cpu_ms=cpu_ms, places=1, other_cpu_ms=0, io_bytes=0,
                                          children_cpu_ms=0, samples=8))
    b = summarize({2: laggard}, "hostb", ONSET + STUCK, LEARNT, stuck_ns=STUCK)
    assert b is not None
    return b


def _read(loop: _Stalls, a: Optional[Summary], b: Summary, now: int) -> None:
    """One interval that read host b's summary (host 1, standing still by its beat), ours ``a``."""
    loop.take(a, False, Seen(index=0, registered=False, new_hosts={}, beats={}, requests=1,
                             stalls={1: b.to_json()}, stalled=(1,)), True, now)


def test_a_host_plainly_stuck_makes_every_host_standing_still_exchange_from_the_stuck_threshold(tmp_path: Path):
    """Host a's own summary is its judges' alone before half the threshold: nothing to the
    store while nobody else stands still; host b's, published because it is stuck, is read
    at once (handed to a's judges), then a publishes its own (b's judges need a's ranks)
    and both are refreshed at most every refresh, as from half the threshold."""
    loop = _loop(tmp_path)
    now = ONSET + STUCK
    a = _host_a(now)
    assert a is not None and not a.public()
    assert not loop.public(a) and loop.plan(a, False, now) == (False, False)  # nobody else: no traffic
    loop.stalled = (1,)  # host b's beat says it stands still
    assert loop.plan(a, False, now) == (False, True)  # read at once, publish nothing yet
    _read(loop, a, _host_b(cpu_ms=0), now)
    hosts = json.loads((tmp_path / REMOTE_STALLS_FILE).read_text())["hosts"]
    assert [Summary.from_json(text.encode()).host for _, text in hosts] == ["hostb"]  # type: ignore[union-attr]
    assert loop.public(a)  # the echo: b's judges need ours
    now += S
    assert loop.plan(a, True, now) == (True, False)  # ours at once; b's already read
    loop.take(a, True, Seen(index=0, registered=False, new_hosts={}, beats={}, requests=1, stalled=(1,)), False,
              now)  # published ours
    assert loop.plan(a, True, now + S) == (False, False)  # at most every refresh
    assert loop.plan(a, True, now - S + STUCK_EVERY - 1) == (False, False)
    assert loop.plan(a, True, now - S + STUCK_EVERY) == (False, True)  # b's again, sooner: it holds a stuck rank
    assert loop.plan(a, True, now + EVERY - 1) == (False, True)  # ours (nothing stuck in it) every refresh
    assert loop.plan(a, True, now + EVERY) == (True, True)


def test_a_plainly_stuck_host_publishes_every_quarter_of_the_stuck_threshold(tmp_path: Path):
    """Host b's own side: its summary holds a plainly stuck rank and host a's ranks wait
    for it in a collective, so it is published every STUCK_EVERY, not every refresh. Its
    news crosses three such refreshes (b publishes, the aggregator reads, every other host
    reads the merge) and a heartbeat, and still reaches every host younger than the stuck
    threshold (older news waits for the learnt one). Alone (nobody known to wait in a
    collective: every rank sleeping, say) it is a stall the stuck threshold names nobody
    in, refreshed as any."""
    assert STUCK_EVERY == int(2.5 * S) < EVERY and 3 * STUCK_EVERY + S < STUCK
    loop = _loop(tmp_path)
    b = _host_b(cpu_ms=0)
    assert b.stuck and loop.public(b)
    now = ONSET + STUCK
    assert loop.plan(b, True, now) == (True, True)  # a new stall: at once (and the others' read once)
    loop.take(b, True, Seen(index=1, registered=False, new_hosts={}, beats={}, requests=1, stalled=()), True, now)
    assert loop.plan(b, True, now + STUCK_EVERY) == (False, False)  # nobody waits for it (yet): every refresh
    assert loop.plan(b, True, now + EVERY) == (True, True)
    a = _host_a(now)
    assert a is not None
    loop.stalled = (0,)  # host a stands still: its ranks wait in all_reduce #21
    loop.take(b, False, Seen(index=1, registered=False, new_hosts={}, beats={}, requests=1, stalls={0: a.to_json()},
                             stalled=(0,)), True, now + S)
    assert loop.plan(b, True, now + STUCK_EVERY - 1) == (False, False)
    assert loop.plan(b, True, now + STUCK_EVERY) == (True, False)
    busy = _host_b(cpu_ms=7000)  # a sign of work: no longer plainly stuck, every refresh again
    assert not busy.stuck and busy.stall == b.stall
    assert loop.plan(busy, True, now + STUCK_EVERY) == (False, False)


def test_a_stall_with_many_stuck_hosts_is_refreshed_as_any(tmp_path: Path):
    """Host a's ranks wait; five hosts hold plainly stuck ranks: more than FAST_STUCK_HOSTS,
    so host a reads them every refresh (the merge every host reads would be large)."""
    from peerwatch.hosts.bridge import FAST_STUCK_HOSTS

    loop = _loop(tmp_path)
    now = ONSET + STUCK
    a = _host_a(now)
    assert a is not None
    b = _host_b(cpu_ms=0)
    few = {j: dataclasses.replace(b, host=f"host{j}").to_json() for j in range(1, FAST_STUCK_HOSTS + 1)}
    loop.stalled = tuple(few)
    loop.take(a, False, Seen(index=0, registered=False, new_hosts={}, beats={}, requests=1, stalls=few,
                             stalled=tuple(few)), True, now)
    assert loop.plan(a, True, now + STUCK_EVERY)[1]  # a few: sooner
    many = {**few, FAST_STUCK_HOSTS + 1: dataclasses.replace(b, host="hostmany").to_json()}
    loop.stalled = tuple(many)
    loop.take(a, False, Seen(index=0, registered=False, new_hosts={}, beats={}, requests=1, stalls=many,
                             stalled=tuple(many)), True, now)
    assert not loop.plan(a, True, now + STUCK_EVERY)[1]
    assert loop.plan(a, True, now + EVERY)[1]


def test_a_busy_host_standing_still_costs_no_more_than_before(tmp_path: Path):
    """Host b's summary published early (its own threshold is lower, say) but nothing stuck
    in it: read once, then nothing more until a's summary is public by its own right."""
    loop = _loop(tmp_path)
    now = ONSET + STUCK
    a = _host_a(now)
    assert a is not None
    loop.stalled = (1,)
    assert loop.plan(a, False, now) == (False, True)
    _read(loop, a, _host_b(cpu_ms=7000), now)
    assert not loop.public(a)
    assert loop.plan(a, False, now + EVERY) == (False, False)  # no refresh before ours is public
    half = _host_a(ONSET + LEARNT // 2)
    assert half is not None and half.public() and loop.public(half)
    assert loop.plan(half, True, ONSET + LEARNT // 2) == (True, True)  # as before: from half the threshold


def test_the_echo_ends_with_the_stuck_host_standing_still(tmp_path: Path):
    loop = _loop(tmp_path)
    now = ONSET + STUCK
    a = _host_a(now)
    loop.stalled = (1,)
    _read(loop, a, _host_b(cpu_ms=0), now)
    assert loop.public(a)
    loop.take(a, False, Seen(index=0, registered=False, new_hosts={}, beats={}, requests=1, stalled=()), False,
              now + S)  # host b moved again: its beat no longer says s
    assert not loop.public(a) and loop.remote == {}


def _merge_read(loop: _Stalls, a: Optional[Summary], stalls: dict, now: int, me: int = 0) -> None:
    """One interval that read the aggregator's merge (diag/all) of ``stalls`` (index -> summary)."""
    from peerwatch.hangs.merged import merge

    loop.take(a, False, Seen(index=me, registered=False, new_hosts={}, beats={}, requests=1, stalled=tuple(stalls),
                             merged=merge(stalls).to_json()), True, now)


def test_a_merge_read_again_keeps_every_hosts_last_move_where_it_was(tmp_path: Path):
    """A host that is not the aggregator reads the merge, not each host's summary: the
    stuck host whole (its stuck rank makes ours public: the echo), the hosts waiting as one
    crowd. Read again a refresh later, with older ages, no last move jitters (it would read
    as "moved again"); a host that starts to stand still is read at once, then covered."""
    loop = _loop(tmp_path)
    now = ONSET + STUCK
    a = _host_a(now)
    assert a is not None
    waiting = RankState(collectives=(("0", 21, 20),), in_collective=True)
    c = Summary("hostc", "c1", STUCK // 1_000_000, LEARNT // 1_000_000, (((4, 5), waiting),))
    loop.stalled = (1, 2)
    assert loop.plan(a, False, now) == (False, True)  # not covered yet: read at once
    _merge_read(loop, a, {1: _host_b(cpu_ms=0), 2: c}, now)
    assert set(loop.remote) == {"1", "crowd"} and loop.covered == {1, 2}
    assert loop.public(a)  # host b, whole in the merge, holds a stuck rank
    moved = {k: m for k, (_, m) in loop.remote.items()}
    later = now + EVERY
    made = 300  # ms before the read: each summary was made a little before it was read
    c_older = dataclasses.replace(c, age_ms=c.age_ms + EVERY // 1_000_000 - made)
    b_older = dataclasses.replace(_host_b(cpu_ms=0), age_ms=STUCK // 1_000_000 + EVERY // 1_000_000 - made)
    _merge_read(loop, a, {1: b_older, 2: c_older}, later)
    assert {k: m for k, (_, m) in loop.remote.items()} == moved
    hosts = json.loads((tmp_path / REMOTE_STALLS_FILE).read_text())["hosts"]
    assert sorted(Summary.from_json(t.encode()).host for _, t in hosts) == ["hostb", "hostc"]  # type: ignore[union-attr]
    loop.stalled = (1, 2, 3)
    assert loop.plan(a, True, later + S)[1]  # host 3 is new: read the merge again at once
    _merge_read(loop, a, {1: b_older, 2: c_older, 0: a}, later + S)  # ours merged too (in the crowd)
    assert set(loop.remote) == {"1", "crowd"} and loop.covered == {0, 1, 2}
    assert loop.plan(a, True, later + 2 * S)[1]  # host 3 is still not in it: again
