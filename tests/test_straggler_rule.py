"""The straggler rule (peerwatch.hangs.straggler), pure: shares in, stragglers out."""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peerwatch.hangs import straggler
from peerwatch.hangs.straggler import APPEAR_SHARE, CLEAR_SHARE, MIN_SLOTS, SLOTS, Profile, Straggler, find

NOW = 1_700_000_000_000_000_000


def job(shares: dict, period_ms: int = 300, host: str = "h") -> dict:
    return {r: Profile(tuple(s), period_ms, host) for r, s in shares.items()}


def test_the_rank_its_peers_wait_for_is_named_with_its_lateness() -> None:
    # 0.20 s against 0.30 s: the peers wait ~0.10 s of each 0.30 s step, the straggler ~0.
    found = find(job({0: [333] * 8, 1: [340] * 8, 2: [20] * 8, 3: [330] * 8}), {}, NOW)
    assert [(s.rank, s.host, s.since_ns) for s in found] == [(2, "h", NOW)]
    assert abs(found[0].share - 0.313) < 0.01 and abs(found[0].late_ms - 94) <= 1


def test_nobody_before_min_slots_nor_with_one_rank() -> None:
    assert find(job({0: [333] * (MIN_SLOTS - 1), 1: [0] * (MIN_SLOTS - 1)}), {}, NOW) == ()
    assert find(job({0: [0] * SLOTS}), {}, NOW) == ()


def test_a_one_off_phase_is_not_a_straggler() -> None:
    # Rank 0 checkpoints during two slots of twelve: the others wait for it then only.
    base = {r: [300] * SLOTS for r in range(4)}
    for r in (1, 2, 3):
        base[r][4] = base[r][5] = 900
    base[0][4] = base[0][5] = 0
    assert find(job(base), {}, NOW) == ()


def test_hysteresis_a_named_rank_stays_until_its_gap_falls_under_clear() -> None:
    between = [300] * SLOTS
    mid = [300 - round(1000 * (APPEAR_SHARE + CLEAR_SHARE) / 2)] * SLOTS
    shares = {0: between, 1: between, 2: mid}
    assert find(job(shares), {}, NOW) == ()  # not named from nothing ...
    kept = find(job(shares), {2: NOW - 5}, NOW)
    assert [(s.rank, s.since_ns) for s in kept] == [(2, NOW - 5)]  # ... but kept, with its first time
    assert find(job({0: between, 1: between, 2: between}), {2: NOW - 5}, NOW) == ()


def test_a_faster_rank_is_not_named_and_two_stragglers_both_are() -> None:
    assert find(job({0: [600] * 8, 1: [300] * 8, 2: [300] * 8}), {}, NOW) == ()
    found = find(job({0: [300] * 8, 1: [300] * 8, 2: [300] * 8, 3: [10] * 8, 4: [12] * 8}), {}, NOW)
    assert [s.rank for s in found] == [3, 4]


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 40), st.integers(0, 2**32 - 1), st.integers(100, 800))
def test_balanced_ranks_with_sampling_noise_are_not_named(n: int, seed: int, mean: int) -> None:
    # 100 samples a slot: binomial noise around the same share for everyone.
    rng = random.Random(seed)
    shares = {r: [sum(rng.random() < mean / 1000 for _ in range(100)) * 10 for _ in range(SLOTS)] for r in range(n)}
    assert find(job(shares), {}, NOW) == ()


def test_many_ranks_use_the_median_of_all() -> None:
    shares = {r: [300] * 8 for r in range(200)}
    shares[77] = [0] * 8
    assert [s.rank for s in find(job(shares), {}, NOW)] == [77]


def test_profile_of_slots() -> None:
    p = straggler.profile_of([(5000, 100, 30, 25, 7), (5000, 5, 0, 0, 8), (5000, 100, 40, 25, 9)], "h")
    assert p == Profile((300, 400), 200, "h", (7, 9))  # the slot of 5 samples says nothing
    assert straggler.profile_of([]) is None and straggler.profile_of([(0, 0, 0, 0, 1)]) is None


def test_slots_are_aligned_by_number_when_the_clocks_agree_by_position_when_not() -> None:
    a = Profile(tuple(range(10)), 1, "", tuple(range(100, 110)))
    b = Profile(tuple(range(50, 58)), 1, "", tuple(range(101, 109)))  # one slot late, one missing at the end
    assert straggler.aligned({0: a, 1: b}) == {0: tuple(range(1, 9)), 1: tuple(range(50, 58))}
    far = Profile(tuple(range(50, 58)), 1, "", tuple(range(900, 908)))  # a clock far off: the last ones
    assert straggler.aligned({0: a, 1: far}) == {0: tuple(range(2, 10)), 1: tuple(range(50, 58))}


def test_the_host_summary_and_the_finding_round_trip_and_garbage_is_nothing() -> None:
    profiles = {3: Profile((1, 2, 3), 250, "node-b", (4, 5, 6)), 5: Profile((1000, 0), 250, "node-b")}
    assert straggler.host_from_json(straggler.host_json("node-b", profiles)) == profiles
    for junk in (b"", b"{", b"[]", b'{"v":2}', b'{"v":1,"host":"h","ranks":[[1,2,[2000],[]]]}',
                 b'{"v":1,"host":"h","ranks":[[1,2,[20],[1,2]]]}', b"x" * 70000):
        assert straggler.host_from_json(junk) == {}
    found = (Straggler(3, "node-b", 90, 0.3, NOW),)
    assert straggler.finding_from_json(straggler.finding_json(found, NOW)) == found
    assert straggler.finding_from_json(b'{"v":1,"stragglers":[{"rank":true}]}') is None


def test_changes_say_who_appeared_and_who_cleared() -> None:
    a, b = Straggler(1, "", 9, 0.2, NOW), Straggler(2, "", 9, 0.2, NOW)
    assert straggler.changes([a], [b]) == ([b], [a])
    assert straggler.changes([a], [a]) == ([], [])


# -- the enqueue measure (waits inside C++: DDP's all-reduces in backward) --------------

SLOT_NS = 5_000_000_000


def enqueue_rows(late_ms: dict, step_ms: float = 90.0, buckets: int = 2, slots: int = SLOTS, jitter_ms: float = 0.0,
                 seed: int = 0, offset_ns: dict = {}, phase: dict = {}) -> dict:  # noqa: B006 - read only
    """Every rank's published rows for a synchronous job: each step, ``buckets`` collectives
    1 ms apart, entered ``late_ms[rank]`` after the step began (plus jitter); ``phase``:
    {slot index: {rank: extra ms}} (a checkpoint); ``offset_ns``: a rank's clock's offset."""
    rng = random.Random(seed)
    times: dict = {r: {} for r in late_ms}
    t, seq = 0.0, 1
    while t < slots * SLOT_NS / 1e6:
        extra = phase.get(int(t * 1e6 // SLOT_NS), {})
        for b in range(buckets):
            for r, late in late_ms.items():
                ms = t + late + extra.get(r, 0.0) + b + rng.uniform(0, jitter_ms)
                times[r][seq] = int(ms * 1e6) + offset_ns.get(r, 0)
            seq += 1
        t += step_ms + max(extra.values(), default=0.0)
    rows = {}
    for r, by_seq in times.items():
        slots_of: dict = {}
        for s, ns in by_seq.items():
            slots_of.setdefault(ns // SLOT_NS, []).append((s, ns))
        rows[r] = [straggler.enqueued_row(n, 0, entries) for n, entries in sorted(slots_of.items())]
    return rows


def late_profiles(rows: dict, host: str = "h") -> dict:
    return {r: Profile((), 0, host, (), g, n, ms) for r, (g, n, ms) in straggler.lateness(rows).items()}


def test_the_rank_that_enqueues_last_is_named_with_its_lateness_and_share() -> None:
    # DDP: two buckets a step, entered together; rank 2 loads its data 30 ms longer.
    rows = enqueue_rows({0: 0, 1: 0, 2: 30, 3: 0}, jitter_ms=1.0)
    found = find(late_profiles(rows), {}, NOW)
    assert [(s.rank, s.host) for s in found] == [(2, "h")]
    assert abs(found[0].late_ms - 30) <= 2 and abs(found[0].share - 30 / 90) < 0.05, found


def test_one_collective_a_step_and_a_late_phase_of_the_step() -> None:
    found = find(late_profiles(enqueue_rows({0: 0, 1: 5, 2: 0, 3: 40}, buckets=1)), {}, NOW)
    # Rank 3 enters 40 ms after its peers' median (rank 1's 5 ms is a twentieth: under the rule).
    assert [s.rank for s in found] == [3] and abs(found[0].share - 40 / 90) < 0.05 and found[0].late_ms == 40


def test_slot_lateness_unions_the_buckets_of_a_step() -> None:
    # Three buckets a step, all 30 ms late: waited for once a step, not three times.
    step = [0, 10, 20]
    times = {r: [100 * i + s + (30 if r == 1 else 0) for i in range(5) for s in step] for r in range(3)}
    out = straggler.slot_lateness(times)
    assert out is not None and abs(out[1][0] - 30 / 100) < 0.02 and out[1][1] == 30 and out[0] == (0.0, 0.0)
    # Twenty buckets 10 ms apart in a 400 ms step, 3 ms late: waited for 3 ms a step, not 20 times.
    times = {r: [400 * i + 10 * b + (3 if r == 0 else 0) for i in range(4) for b in range(20)] for r in range(3)}
    out = straggler.slot_lateness(times)
    assert out is not None and abs(out[0][0] - 3 / 400) < 0.002 and out[0][1] == 3
    # Fewer than two steps' ends in the span: no share.
    assert straggler.slot_lateness({0: [0, 10, 20, 100, 110, 120], 1: [3, 13, 23, 103, 113, 123]}) is None


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 16), st.integers(0, 2**32 - 1), st.sampled_from([20.0, 90.0, 300.0]), st.integers(1, 3))
def test_balanced_ranks_with_jitter_are_not_named_by_their_enqueue_times(n: int, seed: int, step: float,
                                                                          buckets: int) -> None:
    # Jitter of up to a fifth of the step (a loaded machine) on every rank's every collective.
    rows = enqueue_rows({r: 0.0 for r in range(n)}, step_ms=step, buckets=buckets, jitter_ms=step / 5, seed=seed)
    assert find(late_profiles(rows), {}, NOW) == ()


def test_a_faster_rank_or_a_one_off_phase_is_not_named() -> None:
    assert find(late_profiles(enqueue_rows({0: 30, 1: 30, 2: 0})), {}, NOW) == ()  # the two that one fast rank waits for
    checkpoint = {4: {0: 2000.0}, 5: {0: 2000.0}}  # rank 0 checkpoints 2 s in two slots of twelve
    assert find(late_profiles(enqueue_rows({r: 0.0 for r in range(4)}, phase=checkpoint, jitter_ms=1)), {}, NOW) == ()


def test_enqueue_times_are_compared_within_a_host_so_its_clock_offset_does_not_matter() -> None:
    # Host b's clock is 3.7 s ahead of host a's: each host judges its own ranks' times, and
    # its summary carries gaps, never a time.
    a = enqueue_rows({0: 0, 1: 0}, jitter_ms=1, seed=1)
    b = enqueue_rows({2: 0, 3: 25}, jitter_ms=1, seed=2, offset_ns={2: 3_700_000_000, 3: 3_700_000_000})
    same = straggler.lateness(enqueue_rows({2: 0, 3: 25}, jitter_ms=1, seed=2))
    assert {r: (round(statistics.median(v[0]), -1), v[2]) for r, v in straggler.lateness(b).items()} == \
        {r: (round(statistics.median(v[0]), -1), v[2]) for r, v in same.items()}  # slots cut elsewhere
    hosts = {**straggler.host_from_json(straggler.host_json("a", late_profiles(a, "a"))),
             **straggler.host_from_json(straggler.host_json("b", late_profiles(b, "b")))}
    found = find(hosts, {}, NOW)
    assert [(s.rank, s.host) for s in found] == [(3, "b")] and abs(found[0].late_ms - 25) <= 2


def test_the_two_measures_combine_either_names_and_the_enqueue_figures_win() -> None:
    waits = job({0: [300] * 8, 1: [300] * 8, 2: [300] * 8, 3: [0] * 8})  # the waits name rank 3
    late = late_profiles(enqueue_rows({0: 0, 1: 0, 2: 30, 3: 0}))  # the enqueue times, rank 2
    both = {r: dataclasses.replace(waits[r], late=p.late, late_numbers=p.late_numbers, late_ms=p.late_ms)
            for r, p in late.items()}
    found = find(both, {}, NOW)
    assert [s.rank for s in found] == [2, 3]
    assert found[0].late_ms == 30 and found[1].late_ms == 90  # each measure's own figures
    # Named by the enqueue times, it stays while they keep it above CLEAR_SHARE, as the waits do.
    fading = late_profiles(enqueue_rows({0: 0, 1: 0, 2: 7.5, 3: 0}, jitter_ms=0.5))
    assert find(fading, {}, NOW) == () and [s.rank for s in find(fading, {2: NOW - 5}, NOW)] == [2]


def test_enqueued_rows_keep_the_last_contiguous_run() -> None:
    entries = [(s, 1_000_000_000 + s * 10_000_000) for s in list(range(1, 5)) + list(range(7, 40))]
    row = straggler.enqueued_row(3, 1, entries)
    assert row is not None and row[:4] == (3, 1, 40 - straggler.ENQ_KEYS, (1_000_000_000 + (40 - 24) * 10_000_000) // 100_000)
    assert len(row) == 4 + straggler.ENQ_KEYS - 1 and set(row[4:]) == {100 * i for i in range(1, 24)}
    gap = [(s, s) for s in (1, 2, 3, 10, 11)]
    assert straggler.enqueued_row(0, 0, gap)[2] == 10 and straggler.enqueued_row(0, 0, []) is None  # type: ignore[index]


# -- exact values, edges and codecs (each pins a decision a mutation could change unseen) ----

DOC = Path(__file__).resolve().parent.parent / "docs" / "stragglers.md"


def test_the_constants_are_the_documented_ones() -> None:
    doc = " ".join(DOC.read_text().split())
    assert f"every {straggler.SLOT_BEATS} heartbeats (a **slot**" in doc and straggler.SLOT_BEATS == 5
    assert f"publishes the last {SLOTS} slots" in doc and SLOTS == 12
    assert f"over at least **{MIN_SLOTS} slots** of every rank" in doc and MIN_SLOTS == 6
    assert f"its gap is at least **{APPEAR_SHARE:.2f}**" in doc and APPEAR_SHARE == 0.10
    assert "at least **3/4** of its slots" in doc and straggler.MOST == 3 / 4
    assert f"falls under **{CLEAR_SHARE}**" in doc and f"a gap of {CLEAR_SHARE} or more" in doc and CLEAR_SHARE == 0.05
    assert f"the last **{straggler.ENQ_KEYS}** collectives" in doc and straggler.ENQ_KEYS == 24
    assert "in tenths of a millisecond" in doc and straggler.ENQ_UNIT_NS == 100_000
    # Not in the user's docs, but part of the format or the rule: pinned here.
    assert (straggler.ENQ_MIN_KEYS, straggler.EXACT_PEERS, straggler.MIN_SAMPLES) == (8, 64, 10)
    assert (straggler.MAX_HOST_BYTES, straggler.SUMMARY_VERSION) == (65536, 1)
    assert Profile((1,), 1).late_ms == 0 and Profile((1,), 1).late == () == Profile((1,), 1).late_numbers


def test_profile_of_keeps_slots_of_enough_samples_and_caps_the_share() -> None:
    slots = [(1, 10, 0, 0, 5),  # 1 ms, exactly MIN_SAMPLES: kept
             (0, 100, 50, 1, 6),  # no time: dropped
             (100, 30, 20, 1, 7),  # 2000 // 3 = 666 permille
             (1000, 10, 20, 1, 8)]  # more waiting than samples: capped at 1000
    assert straggler.profile_of(slots, "h") == Profile((0, 666, 1000), (1 + 100 + 1000) // 2, "h", (5, 7, 8))
    assert straggler.profile_of([(100, 10, 0, 0, 1)]) == Profile((0,), 0, "", (1,))  # none entered: no period
    assert straggler.profile_of([(100, 10, 0, 1, 1)]) == Profile((0,), 100, "", (1,))


def test_aligned_by_number_from_exactly_min_slots_in_common() -> None:
    a = Profile(tuple(range(7)), 1, "", tuple(range(99, 106)))
    b = Profile(tuple(range(50, 57)), 1, "", (*range(100, 106), 107))  # 6 numbers in common
    assert straggler.aligned({0: a, 1: b}) == {0: tuple(range(1, 7)), 1: tuple(range(50, 56))}


def test_gaps_exact_values_and_the_cap_at_twice_the_job_median() -> None:
    assert straggler.gaps({0: [600], 1: [300], 2: [200]}) == {
        0: [pytest.approx(-0.6)], 1: [pytest.approx(0.0)], 2: [pytest.approx(0.2)]}


def test_gaps_leave_each_rank_out_up_to_exact_peers_ranks_and_use_everyone_above() -> None:
    at64 = straggler.gaps({r: [300 if r < 32 else 0] for r in range(64)})  # each one's peers' median
    assert at64[0] == [pytest.approx(-0.3)] and at64[63] == [pytest.approx(0.3)]
    at65 = straggler.gaps({r: [300 if r < 33 else 0] for r in range(65)})  # everyone's median
    assert at65[0] == [pytest.approx(0.0)] and at65[64] == [pytest.approx(0.3)]


def test_two_ranks_over_exactly_min_slots_are_judged() -> None:
    found = find(job({0: [300] * MIN_SLOTS, 1: [0] * MIN_SLOTS}), {}, NOW)
    assert found == (Straggler(1, "h", 90, 0.3, NOW),)


def test_the_period_is_the_median_of_the_ranks_that_entered_collectives() -> None:
    shares = {0: [300] * 6, 1: [300] * 6, 2: [300] * 6, 3: [0] * 6}
    profiles = {r: Profile(tuple(s), period, "h") for (r, s), period in zip(shares.items(), (0, 1, 100, 300))}
    assert find(profiles, {}, NOW) == (Straggler(3, "h", 30, 0.3, NOW),)  # median of 1, 100, 300
    none_entered = job({0: [1000] * 6, 1: [1000] * 6, 2: [1000] * 6, 3: [0] * 6}, period_ms=0)
    assert find(none_entered, {}, NOW) == (Straggler(3, "h", 0, 1.0, NOW),)


def test_the_share_is_rounded_to_three_places() -> None:
    # Slots' gaps alternate 0.3 and 0.303: their median, 0.3015 (in floats 0.30149...), is said as 0.301.
    found = find(job({0: [300, 303] * 3, 1: [300, 303] * 3, 2: [300, 303] * 3, 3: [0] * 6}), {}, NOW)
    assert [(s.rank, s.late_ms, s.share) for s in found] == [(3, 90, 0.301)]


def test_named_at_the_thresholds_exactly() -> None:
    named = straggler._named
    assert named([0.2, 0.2, 0.2, 0.0], False)  # 3 of 4 slots: MOST exactly
    assert not named([0.2, 0.2, 0.2, 0.0, 0.0], False)  # 3 of 5: not most
    assert named([CLEAR_SHARE, CLEAR_SHARE, 0.2, 0.2], False)  # a slot at CLEAR_SHARE counts
    assert named([APPEAR_SHARE] * 6, False)  # a gap of APPEAR_SHARE names
    assert named([CLEAR_SHARE] * 6, True) and not named([CLEAR_SHARE] * 6, False)  # ... and CLEAR_SHARE keeps
    assert not named([0.049] * 6, True)


def test_enqueued_row_of_a_last_entry_alone() -> None:
    assert straggler.enqueued_row(9, 3, [(1, 100_000), (2, 200_000), (5, 512_345)]) == (9, 3, 5, 5)
    assert straggler.enqueued_row(9, 3, [(2, 250_000), (1, 100_000), (3, 390_000)]) == (9, 3, 1, 1, 1, 2)


def test_row_text_round_trip_and_malformed_text() -> None:
    full = tuple(range(100, 100 + straggler.ENQ_KEYS + 3))
    assert straggler.row_text((1, 2, 3, 4, 5)) == "1,2,3,4,5"
    for row in ((1, 2, 3, 4), (1, 2, 3, 4, 5), full):
        assert straggler.row_from_text(straggler.row_text(row)) == row
    too_long = ",".join(map(str, range(straggler.ENQ_KEYS + 4)))
    for junk in ("", "1,2,3", "1,x,3,4", "1,2,,4", "1.5,2,3,4", too_long, too_long + ",5"):
        assert straggler.row_from_text(junk) is None, junk


def test_times_of_rows_skip_short_ones() -> None:
    rows = [(1, 2, 3), (5, 0, 10, 100, 2, 4), (6, 1, 7, 300)]
    assert straggler._times(rows) == {(0, 10): (100, 5), (0, 11): (102, 5), (0, 12): (104, 5), (1, 7): (300, 6)}


def test_slot_lateness_exact_values() -> None:
    sl = straggler.slot_lateness
    # Three steps of one collective, 1 unit apart: three bursts, nobody late.
    assert sl({r: [0, 1, 2] for r in range(3)}) == {r: (0.0, 0.0) for r in range(3)}
    # Rank 2 is 2 after the job's median, 7 after its peers': late by twice the first, 4.
    out = sl({0: [0, 100, 200], 1: [10, 110, 210], 2: [12, 112, 212]})
    assert out == {0: (0.0, 0.0), 1: (0.0, 0.0), 2: (pytest.approx(12 / 300), 4.0)}
    # Gaps of 100, 50 (half the largest: ends a burst), 100, 40 (does not), 100: five
    # bursts over 390 * 5 / 4. Rank 2 is late in the first two (10, then 1): the median
    # of its late bursts is 5.5, the zeros left out.
    on_time = [0, 100, 150, 250, 290, 390]
    late = [10, 1, 0, 0, 0, 0]
    out = sl({0: on_time, 1: on_time, 2: [t + d for t, d in zip(on_time, late)]})
    assert out == {0: (0.0, 0.0), 1: (0.0, 0.0), 2: (pytest.approx(11 / 487.5), 5.5)}
    # Nothing to tell: one rank, one collective, all at once.
    assert sl({0: [0, 100, 200, 300]}) is None and sl({0: [5], 1: [6]}) is None and sl({}) is None
    assert sl({0: [7] * 4, 1: [7] * 4}) is None


def row(number: int, first: int, times: list) -> tuple:
    return (number, 0, first, times[0], *(t - times[0] for t in times[1:]))


def test_lateness_exact_per_slot_and_what_is_skipped() -> None:
    three_steps = [0, 1, 2, 1000, 1001, 2000, 2001, 2002]  # 8 collectives (ENQ_MIN_KEYS): span 3003
    two_steps = [0, 1, 2, 3, 1000, 1001, 1002, 1003]  # 8, but two bursts: says nothing
    seven = [0, 1000, 1001, 2000, 2001, 2002, 3000]  # 7: too few
    rows = {r: [row(5, 1, two_steps), row(6, 9, [10_000 + t for t in seven]),
                row(7, 16, [20_000 + t + (615 if r == 2 else 0) for t in three_steps])] for r in range(3)}
    # Rank 2 enters 615 units (61.5 ms) late in each of 3 steps: 1845 / 3003 of the slot.
    want = {0: ((0,), (7,), 0), 1: ((0,), (7,), 0), 2: ((614,), (7,), 62)}
    assert straggler.lateness(rows) == want
    assert straggler.lateness({**rows, 3: [], 4: [(1, 2, 3)]}) == want  # ranks with nothing are left out
    assert straggler.lateness({}) == {} and straggler.lateness({0: rows[0]}) == {}
    # A rank late by more than the slot: its gap is capped at 1000 permille.
    rows = {r: [row(7, 1, [t + (5000 if r == 2 else 0) for t in three_steps])] for r in range(3)}
    assert straggler.lateness(rows)[2] == ((1000,), (7,), 500)


def test_lateness_names_from_exactly_min_slots_with_its_own_figures() -> None:
    def late(values: tuple) -> Profile:
        return Profile((), 0, "h", (), values, tuple(range(len(values))), 25)

    assert find({5: late((600,) * MIN_SLOTS)}, {}, NOW) == (Straggler(5, "h", 25, 0.6, NOW),)
    assert find({5: late((600,) * (MIN_SLOTS - 1))}, {}, NOW) == ()
    found = find({5: late((600, 600, 600, 603, 603, 603))}, {}, NOW)  # median 0.6015 (in floats 0.60149...)
    assert found == (Straggler(5, "h", 25, 0.601, NOW),)


def padded(data: bytes, size: int) -> bytes:
    return data + b" " * (size - len(data))  # JSON allows trailing blanks


def test_host_summary_size_limit_and_version() -> None:
    profiles = {3: Profile((1, 2, 3), 250, "node-b", (4, 5, 6))}
    data = straggler.host_json("node-b", profiles)
    assert straggler.host_from_json(padded(data, 65536)) == profiles
    assert straggler.host_from_json(padded(data, 65537)) == {}
    assert straggler.host_from_json(b'{"v":1,"host":"h","ranks":[[1,2,[20],[]]]}') == {1: Profile((20,), 2, "h")}
    assert straggler.host_from_json(b'{"v":2,"host":"h","ranks":[[1,2,[20],[]]]}') == {}


def test_host_summary_keeps_what_is_in_range_and_drops_the_rest() -> None:
    host = "x" * 300
    body = {"v": 1, "host": host,
            "ranks": [[0, 0, [0, 1000], [1, 2]], [1, -5, [5], []], [2, 300, [1001], []], [-1, 300, [5], []]],
            "late": [[0, -3, [0, 1000], [1, 2]], [4, 0, [500], [9]], [5, 10, [1001], [9]], [-1, 10, [500], [9]],
                     [6, 10, [500], []], [7, 10, [-1], [9]]]}
    h = "x" * 255
    assert straggler.host_from_json(json.dumps(body).encode()) == {
        0: Profile((0, 1000), 0, h, (1, 2), (0, 1000), (1, 2), 0),
        1: Profile((5,), 0, h),
        4: Profile((), 0, h, (), (500,), (9,), 0),
    }
    for bad in ('[true,1,[5],[]]', '["1",1,[5],[]]', '[1,1.5,[5],[]]', '[1,1,[false],[]]', '[1,1,[5],[null]]'):
        assert straggler.host_from_json(b'{"v":1,"host":"h","ranks":[%s]}' % bad.encode()) == {}, bad


def test_finding_size_limit_version_host_and_types() -> None:
    found = (Straggler(3, "node-b", 90, 0.3, NOW),)
    data = straggler.finding_json(found, NOW)
    assert straggler.finding_from_json(padded(data, 65536)) == found
    assert straggler.finding_from_json(padded(data, 65537)) is None
    one = {"rank": 3, "host": "x" * 300, "late_ms": 90, "share": 0.3, "since_ns": NOW}
    assert straggler.finding_from_json(json.dumps({"v": 1, "stragglers": [one]}).encode()) == (
        Straggler(3, "x" * 255, 90, 0.3, NOW),)
    assert straggler.finding_from_json(json.dumps({"v": 2, "stragglers": [one]}).encode()) is None
    assert straggler.finding_from_json(b'[{"v":1}]') is None
    for key, value in (("rank", True), ("rank", "3"), ("late_ms", 9.0), ("since_ns", False), ("share", "x")):
        bad = json.dumps({"v": 1, "stragglers": [{**one, key: value}]}).encode()
        assert straggler.finding_from_json(bad) is None, (key, value)


def test_a_rank_the_waits_name_first_takes_the_lateness_the_enqueue_times_measure() -> None:
    """Two collectives a step (its gradients, then its loss): the waits' figure is derived
    per collective (the period is half the step), half the lateness; the enqueue times,
    on fewer slots than they name on, already measure it. The finding says theirs from the
    first look, so the one line logged then says what the finding says a slot later."""
    waits = job({0: [333] * 8, 1: [340] * 8, 2: [20] * 8, 3: [330] * 8}, period_ms=150)
    assert find(waits, {}, NOW)[0].late_ms == 47  # the waits alone: 0.313 of 150 ms
    few = MIN_SLOTS - 3
    seen = {r: dataclasses.replace(p, late=(330 if r == 2 else 0,) * few, late_numbers=tuple(range(few)),
                                   late_ms=100 if r == 2 else 0) for r, p in waits.items()}
    found = find(seen, {}, NOW)
    assert [(s.rank, s.late_ms) for s in found] == [(2, 100)] and abs(found[0].share - 0.313) < 0.01
    # The enqueue times see it on time (its whole host late, say): the waits' own figure.
    on_time = {r: dataclasses.replace(p, late=(10,) * few, late_numbers=tuple(range(few)), late_ms=2)
               for r, p in waits.items()}
    assert [(s.rank, s.late_ms) for s in find(on_time, {}, NOW)] == [(2, 47)]
