"""The straggler rule (peerwatch._straggler), pure: shares in, stragglers out."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from peerwatch import _straggler
from peerwatch._straggler import APPEAR_SHARE, CLEAR_SHARE, MIN_SLOTS, SLOTS, Profile, Straggler, find

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
    p = _straggler.profile_of([(5000, 100, 30, 25, 7), (5000, 5, 0, 0, 8), (5000, 100, 40, 25, 9)], "h")
    assert p == Profile((300, 400), 200, "h", (7, 9))  # the slot of 5 samples says nothing
    assert _straggler.profile_of([]) is None and _straggler.profile_of([(0, 0, 0, 0, 1)]) is None


def test_slots_are_aligned_by_number_when_the_clocks_agree_by_position_when_not() -> None:
    a = Profile(tuple(range(10)), 1, "", tuple(range(100, 110)))
    b = Profile(tuple(range(50, 58)), 1, "", tuple(range(101, 109)))  # one slot late, one missing at the end
    assert _straggler.aligned({0: a, 1: b}) == {0: tuple(range(1, 9)), 1: tuple(range(50, 58))}
    far = Profile(tuple(range(50, 58)), 1, "", tuple(range(900, 908)))  # a clock far off: the last ones
    assert _straggler.aligned({0: a, 1: far}) == {0: tuple(range(2, 10)), 1: tuple(range(50, 58))}


def test_the_host_summary_and_the_finding_round_trip_and_garbage_is_nothing() -> None:
    profiles = {3: Profile((1, 2, 3), 250, "node-b", (4, 5, 6)), 5: Profile((1000, 0), 250, "node-b")}
    assert _straggler.host_from_json(_straggler.host_json("node-b", profiles)) == profiles
    for junk in (b"", b"{", b"[]", b'{"v":2}', b'{"v":1,"host":"h","ranks":[[1,2,[2000],[]]]}',
                 b'{"v":1,"host":"h","ranks":[[1,2,[20],[1,2]]]}', b"x" * 70000):
        assert _straggler.host_from_json(junk) == {}
    found = (Straggler(3, "node-b", 90, 0.3, NOW),)
    assert _straggler.finding_from_json(_straggler.finding_json(found, NOW)) == found
    assert _straggler.finding_from_json(b'{"v":1,"stragglers":[{"rank":true}]}') is None


def test_changes_say_who_appeared_and_who_cleared() -> None:
    a, b = Straggler(1, "", 9, 0.2, NOW), Straggler(2, "", 9, 0.2, NOW)
    assert _straggler.changes([a], [b]) == ([b], [a])
    assert _straggler.changes([a], [a]) == ([], [])
