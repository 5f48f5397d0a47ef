"""A host's stall summary (peerwatch.hangs.diagnose.Summary): pure, no store."""

from __future__ import annotations

import pytest

from peerwatch.hangs.diagnose import (
    MAX_DETAILED,
    MAX_SUMMARY_BYTES,
    MAX_SUMMARY_RANKS,
    PUBLISH_FRACTION,
    RankState,
    Summary,
    diagnose,
    refresh_ns,
    remote_ranks,
    spans,
    summarize,
    unspan,
)
from peerwatch.proc.activity import Activity

S = 1_000_000_000
WAITING = RankState(collectives=(("0", 31, 30),), entered=(("0", 31, "allreduce", "[[1]] Float"),), in_collective=True,
                    moved_mono_ns=100 * S, state="S")
STUCK = RankState(collectives=(("0", 30, 30),), entered=(("0", 30, "allreduce", "[[1]] Float"),), state="S",
                  where="train.py:12 in loop", moved_mono_ns=100 * S,
                  activity=Activity(span_ms=4000, cpu_ms=0, places=1, other_cpu_ms=0, io_bytes=0, children_cpu_ms=0,
                                    samples=8))


def test_a_host_that_moves_says_nothing() -> None:
    assert summarize({0: WAITING}, "a", 100 * S + int(PUBLISH_FRACTION * 3 * S) - 1, 3 * S) is None
    assert summarize({0: RankState(moved_mono_ns=0)}, "a", 100 * S, 3 * S) is None  # no counters: not ours to say


def test_waiting_ranks_are_grouped_and_the_others_detailed_and_it_round_trips() -> None:
    ranks = {r: WAITING for r in range(8)}
    ranks[5] = STUCK
    s = summarize(ranks, "hosta", 102 * S, 3 * S)
    assert s is not None and s.age_ms == 2000 and s.threshold_ms == 3000 and s.host == "hosta"
    assert [rs for rs, _ in s.waiting] == [(0, 1, 2, 3, 4, 6, 7)] and [r for r, _ in s.detailed] == [5]
    data = s.to_json()
    assert len(data) < 1000
    back = Summary.from_json(data)
    assert back == s
    assert back.ranks() == list(range(8))


def test_garbage_is_no_summary() -> None:
    for junk in (b"", b"{}", b"[]", b'{"v":1}', b'{"v":3,"host":"a","stall":"1","age_ms":1}',
                 b'{"v":2,"host":"a","stall":"1","age_ms":true}', b"\xff", b" " * (MAX_SUMMARY_BYTES + 1),
                 b'{"v":2,"host":"a","stall":"1","age_ms":1,"ranks":[[1,{"c":[["0","x",1]]}]]}'):
        assert Summary.from_json(junk) is None, junk


def test_a_host_whose_ranks_all_lag_is_named_by_the_other() -> None:
    """Host a's ranks wait in #31 and agree; host b's stopped at #30 and agree: together,
    b's ranks are the laggards, named with their host."""
    b = summarize({2: STUCK, 3: STUCK}, "hostb", 104 * S, 3 * S)
    assert b is not None
    local = {0: WAITING, 1: WAITING}
    assert diagnose(local, 104 * S, 3 * S) is None  # alone, host a sees nothing
    remote = remote_ranks(Summary.from_json(b.to_json()), 100 * S)  # type: ignore[arg-type]
    both = {**remote, **{r: RankState(**{**WAITING.__dict__, "host": "hosta"}) for r in local}}
    found = diagnose(both, 104 * S, 3 * S)
    assert found is not None and found.kind == "hang" and found.laggards == (2, 3) and found.seq == 31
    assert "ranks 2, 3 on host hostb never entered allreduce #31 of process group 0, which ranks 0, 1 on host " \
           "hosta wait in; rank 2 (at train.py:12 in loop)" in found.detail


def test_refresh_is_a_share_of_the_threshold_at_least_a_heartbeat() -> None:
    assert refresh_ns(60_000, S) == int(7.5 * S)
    assert refresh_ns(3000, S // 2) == S // 2
    assert refresh_ns(60_000, S, stuck=True) == int(2.5 * S)  # a quarter of STUCK_S: its news stays fresh
    assert refresh_ns(60_000, 4 * S, stuck=True) == 4 * S  # at most once a heartbeat
    assert refresh_ns(8000, S, stuck=True) == S  # never slower than the threshold's own refresh


def test_a_host_standing_still_for_exactly_the_share_of_the_threshold_says_so() -> None:
    s = summarize({0: WAITING}, "a", 100 * S + int(PUBLISH_FRACTION * 3 * S), 3 * S)
    assert s is not None and s.age_ms == 1500 and s.stall == str(100 * S)


def test_at_most_max_detailed_ranks_in_full_the_lowest() -> None:
    s = summarize({r: STUCK for r in range(MAX_DETAILED + 8)}, "a", 102 * S, 3 * S)
    assert s is not None and MAX_DETAILED == 32
    assert [r for r, _ in s.detailed] == list(range(32))
    assert s.waiting == ()


def test_remote_ranks_of_waiting_and_detailed_ranks_on_the_readers_clock() -> None:
    s = summarize({0: WAITING, 1: WAITING, 2: STUCK}, "hostb", 102 * S, 3 * S)
    assert s is not None
    out = remote_ranks(s, 7 * S)
    assert sorted(out) == [0, 1, 2]
    for r in (0, 1):  # seen when the summary was made: its last move (7 s) plus its age (2 s), the reader's clock
        assert out[r] == RankState(collectives=WAITING.collectives, entered=WAITING.entered, in_collective=True,
                                   moved_mono_ns=7 * S, host="hostb", seen_mono_ns=9 * S)
    assert out[2] == RankState(collectives=STUCK.collectives, entered=STUCK.entered, state="S",
                               where="train.py:12 in loop", activity=STUCK.activity, moved_mono_ns=7 * S,
                               host="hostb", seen_mono_ns=9 * S)


def sized(n: int) -> bytes:
    """A valid summary of exactly ``n`` bytes (its host's name pads it)."""
    empty = Summary("", "1", 5, 3000).to_json()
    data = Summary("h" * (n - len(empty)), "1", 5, 3000).to_json()
    assert len(data) == n
    return data


def test_a_summary_of_64_kib_is_read_and_a_byte_more_is_not() -> None:
    back = Summary.from_json(sized(64 * 1024))
    assert back is not None and len(back.host) > 65_000 and back.age_ms == 5
    assert Summary.from_json(sized(64 * 1024 + 1)) is None


def test_ages_and_thresholds_read_as_they_were_written_never_below_zero() -> None:
    back = Summary.from_json(b'{"v":2,"host":"a","stall":"9","age_ms":0,"threshold_ms":0}')
    assert back == Summary("a", "9", 0, 0)
    assert Summary.from_json(b'{"v":2,"host":"a","stall":"9","age_ms":-5,"threshold_ms":-1}') == Summary("a", "9", 0, 0)
    assert Summary.from_json(b'{"v":2,"host":"a","stall":"9","age_ms":3}') == Summary("a", "9", 3, 0)


def test_a_detailed_ranks_state_and_place_are_cut() -> None:
    data = (b'{"v":2,"host":"a","stall":"9","age_ms":1,"ranks":[[4,{"c":[],"e":[],"s":"Dx","at":"'
            + b"w" * 400 + b'"}],[5,{"s":""}]]}')
    back = Summary.from_json(data)
    assert back is not None
    (r4, s4), (r5, s5) = back.detailed
    assert (r4, s4.state, s4.where) == (4, "D", "w" * 300)
    assert (r5, s5.state, s5.where) == (5, "?", "")


def test_ranks_are_written_as_runs_of_three_or_more_and_read_back_within_bounds() -> None:
    """``spans``: sorted ranks, each run of three or more as [first, last] (two in a row
    are two numbers); ``unspan`` reads them back, and refuses a bool, a negative rank, a
    run backwards, and more than ``MAX_SUMMARY_RANKS`` in all (``counted`` across calls)."""
    assert spans([0, 1, 2, 3, 7, 9, 10, 11]) == [[0, 3], 7, [9, 11]]
    assert spans([11, 3, 4, 9, 10]) == [3, 4, [9, 11]]
    assert spans([4, 5]) == [4, 5] and spans([]) == []
    for ranks in ([0, 1, 2, 3, 7, 9, 10, 11], [4, 5], [1, 3, 5], list(range(1000)) + [2000]):
        assert unspan(spans(ranks)) == tuple(ranks)
    assert unspan([[0, MAX_SUMMARY_RANKS - 1]]) == tuple(range(MAX_SUMMARY_RANKS))
    for bad in ([True], [[True, 3]], [-1], [[-1, 3]], [[5, 2]], [[0, MAX_SUMMARY_RANKS]], [[0, 10**9]], ["3"],
                [[0, MAX_SUMMARY_RANKS // 2], [0, MAX_SUMMARY_RANKS // 2]]):
        with pytest.raises((ValueError, TypeError)):
            unspan(bad)
    counted = [MAX_SUMMARY_RANKS - 5]
    assert unspan([[0, 4]], counted) == (0, 1, 2, 3, 4) and counted == [MAX_SUMMARY_RANKS]
    with pytest.raises(ValueError):
        unspan([7], counted)
