"""The store bridge's rules about other hosts (``peerwatch/hosts/hosts.py``): pure and fast.

Every rule and every boundary has a case here (a flipped comparison, an off-by-one
constant or a deleted statement in ``hosts/hosts.py`` fails one of them).
"""

from __future__ import annotations

import json
from typing import AbstractSet, Dict, Optional, Tuple

import pytest

from peerwatch.core.awake import AwakeClock
from peerwatch.core.config import Config
from peerwatch.core.records import (
    EXCEPTION,
    EXIT,
    LOST,
    SIGNAL,
    VANISHED,
    Failure,
    Registration,
    Verdict,
    decode,
    encode,
)
from peerwatch.hosts.hosts import (
    CONNECT_BACKOFF_MAX_S,
    DONE,
    MAX_HOST_BYTES,
    MAX_HOSTS,
    READ_BATCH,
    REMOTE_SETTLE_S,
    Absence,
    HostInfo,
    Liveness,
    beat_seq,
    beat_value,
    connect_allowance_s,
    host_ident,
    hosts_missing,
    hosts_to_declare_lost,
    hosts_to_read,
    interval_deadline_s,
    lost_host_failure,
    lost_rank_failures,
    lost_store_failure,
    may_be_echo,
    missing_hosts_failure,
    next_backoff_s,
    op_timeout_s,
    parse_count,
    peers_to_watch,
    ranks_text,
    report_store_lost,
    roster_incomplete,
    settle_deadline,
    stalled_hosts,
    store_holder,
    store_silent_for,
    unannounced_ranks,
)
from peerwatch.verdict.decide import Observed, Policy, decide

pytestmark = pytest.mark.pure  # no process, no thread, no file: conftest skips its scan for leaks

S = 1_000_000_000  # ns


def _config(**kw: object) -> Config:
    return Config.resolve(kw, env={})


# -- host records -------------------------------------------------------------------------


def test_host_info_round_trip_and_garbage() -> None:
    info = HostInfo(2, "node2", "boot", "pid:[1]", (8, 9, 10, 11), "abc")
    assert HostInfo.from_json(2, info.to_json()) == info
    assert HostInfo.from_json(3, b"\xff not json") == HostInfo(3, "host 3")
    assert HostInfo.from_json(3, b"[1, 2]") == HostInfo(3, "host 3")  # not an object
    assert HostInfo.from_json(3, b'{"ranks": "x"}').ranks == ()
    assert HostInfo.from_json(3, b"{}") == HostInfo(3, "host 3")
    # Ranks are sorted; booleans are not ranks; the index is the reader's, not the writer's.
    body = json.dumps({"index": 9, "hostname": "n", "ranks": [5, True, 4]}).encode()
    assert HostInfo.from_json(1, body) == HostInfo(1, "n", ranks=(4, 5))


def test_host_info_describes_host_and_ranks() -> None:
    assert HostInfo(0, "node0", ranks=(0, 1)).describe() == "host node0 (ranks 0-1)"
    assert HostInfo(0, "node0").describe() == "host node0 (ranks unknown)"


def test_ranks_text() -> None:
    assert ranks_text(()) == "ranks unknown"
    assert ranks_text((3,)) == "rank 3"
    assert ranks_text((1, 2)) == "ranks 1-2"
    assert ranks_text((8, 9, 10, 11)) == "ranks 8-11"
    assert ranks_text((1, 5)) == "ranks 1, 5"
    assert ranks_text((1, 2, 4)) == "ranks 1, 2, 4"


def test_host_ident_names_boot_pidns_and_run_dir() -> None:
    ident = host_ident("boot", "pid:[1]", "/run/a")
    assert len(ident) == 16 and int(ident, 16) >= 0
    assert ident == host_ident("boot", "pid:[1]", "/run/a")
    others = {host_ident("boot2", "pid:[1]", "/run/a"), host_ident("boot", "pid:[2]", "/run/a"),
              host_ident("boot", "pid:[1]", "/run/b")}
    assert ident not in others and len(others) == 3


def test_beat_values() -> None:
    assert beat_value(7, done=False) == b"7"
    assert beat_value(7, done=True) == DONE + b"7" == b"done:7"


# -- liveness -----------------------------------------------------------------------------


def test_liveness_judges_on_the_local_clock_only() -> None:
    live = Liveness(timeout_ns=3 * S)
    live.observe(0, {1: b"1", 2: b"1"})
    live.observe(1 * S, {1: b"2", 2: b"1"})
    live.observe(2 * S, {1: b"3", 2: b"1"})
    assert live.lost(2 * S) == []
    live.observe(3 * S, {1: b"4", 2: b"1"})
    assert live.lost(3 * S) == [2]
    assert live.lost(3 * S, exclude={2}) == []
    assert live.silent_ns(2, 3 * S) == 3 * S
    assert live.silent_ns(1, 3 * S) == 0


def test_a_look_a_few_ms_short_of_the_timeout_judges_with_looks_a_heartbeat_apart() -> None:
    """Looks a heartbeat apart, each timed after its exchange with the store: the one that
    saw the last beat took 4 ms, the fifth after it 1 ms, so it finds 4.997 s of silence
    with a timeout of 5 s. It judges (within a tenth of a heartbeat); without the
    heartbeat given, the next look would, a whole heartbeat later (measured: a lost host
    known at peer_timeout plus two heartbeats). A silence shorter by more is not judged."""
    ms = S // 1000
    regular = Liveness(timeout_ns=5 * S, look_ns=S)
    strict = Liveness(timeout_ns=5 * S)
    for live in (regular, strict):
        live.observe(4 * ms, {1: b"1"})
        for k in range(1, 5):
            live.observe(k * S + ms, {1: b"1"})
    assert regular.lost(5 * S + ms) == [1] and strict.lost(5 * S + ms) == []
    early = Liveness(timeout_ns=5 * S, look_ns=S)
    early.observe(0, {1: b"1"})
    assert early.lost(5 * S - S // 10 - 1) == [] and early.lost(5 * S - S // 10) == [1]


def test_liveness_lost_at_exactly_the_timeout_not_before() -> None:
    live = Liveness(timeout_ns=4)
    live.observe(0, {1: b"1", 2: b"1"})
    live.observe(2, {1: b"1", 2: b"1"})
    assert live.lost(3) == []
    assert live.lost(4) == [1, 2]  # sorted


def test_liveness_forgives_a_gap_of_our_own() -> None:
    """We were frozen (or starved) ourselves: nobody is lost for our gap."""
    live = Liveness(timeout_ns=3 * S)
    live.observe(0, {1: b"1"})
    live.observe(10 * S, {1: b"1"})  # we did not look for 10 s
    assert live.lost(10 * S) == [] and live.silent_ns(1, 10 * S) == 0
    live.observe(11 * S, {1: b"1"})
    live.observe(12 * S, {1: b"1"})
    assert live.lost(12 * S) == []
    live.observe(13 * S, {1: b"1"})
    assert live.lost(13 * S) == [1]


def test_liveness_a_gap_of_half_the_timeout_is_not_forgiven_one_ns_more_is() -> None:
    live = Liveness(timeout_ns=10)
    live.observe(0, {1: b"1"})
    live.observe(5, {1: b"1"})  # exactly half: we were looking
    live.observe(10, {1: b"1"})
    assert live.lost(10) == [1]
    live = Liveness(timeout_ns=10)
    live.observe(0, {1: b"1"})
    live.observe(6, {1: b"1"})  # one more: our gap, the clock restarts
    assert live.lost(10) == [] and live.silent_ns(1, 10) == 4


def test_liveness_a_gap_restarts_every_host_and_the_last_look_counts() -> None:
    live = Liveness(timeout_ns=10)
    live.observe(0, {1: b"1", 2: b"1"})
    live.observe(4, {1: b"1"})
    live.observe(8, {1: b"1"})  # gaps of 4: no restart, host 2 unseen since 0
    live.observe(14, {1: b"1"})  # a gap of 6: both restart
    assert live.lost(23) == [] and live.lost(24) == [1, 2]


def test_liveness_a_done_host_is_never_lost() -> None:
    live = Liveness(timeout_ns=2 * S)
    live.observe(0, {1: b"5", 2: b"5"})
    live.observe(1 * S, {1: DONE + b"6", 2: b"6"})
    live.observe(2 * S, {1: DONE + b"6", 2: b"7"})
    live.observe(3 * S, {1: DONE + b"6", 2: b"8"})
    live.observe(4 * S, {1: DONE + b"6", 2: b"9"})
    assert live.lost(4 * S) == [] and live.done == {1}
    live.observe(5 * S, {1: None, 2: b"10"})  # unknown this time: no change
    assert live.lost(5 * S) == [] and live.seqs[1] == 6 and live.changed_ns[1] == 1 * S


def test_liveness_an_unknown_beat_is_no_sign_of_life() -> None:
    live = Liveness(timeout_ns=4)
    live.observe(0, {1: b"1"})
    live.observe(2, {1: None, 3: None})
    assert 3 not in live.changed_ns and 3 not in live.seqs
    assert live.lost(4) == [1]


def test_liveness_old_beats_written_back_in_turn_are_no_sign_of_life() -> None:
    """Issue 22.4: two recorded beats of a dead host, replayed alternately, kept it alive."""
    live = Liveness(timeout_ns=4)
    live.observe(0, {1: b"7"})
    live.observe(1, {1: b"8"})
    for t, value in ((2, b"7"), (3, b"8"), (4, b"7"), (5, DONE + b"8")):
        live.observe(t, {1: value})
    assert live.lost(5) == [1] and live.done == set() and live.seqs == {1: 8}
    live.observe(6, {1: b"9s"})  # a real new beat (stalled) is news again
    assert live.lost(6) == [] and live.seqs == {1: 9}


def test_beat_seq_reads_every_form_of_a_beat_and_nothing_else() -> None:
    assert [beat_seq(v) for v in (b"7", DONE + b"7", b"7s", DONE + b"7s")] == [7, 7, 7, 7]
    assert [beat_seq(v) for v in (b"", b"s", b"done:", b"x7", b"-1", b"1" * 31)] == [None] * 6
    assert beat_seq(b"1" * 30) == int("1" * 30)  # 30 digits is the longest a beat may have


def test_stalled_hosts_are_those_whose_last_beat_ends_in_s() -> None:
    beats = {3: b"5s", 1: b"5", 2: None, 0: DONE + b"7s", 4: b"done:5"}
    assert stalled_hosts(beats) == [0, 3]
    assert stalled_hosts({}) == [] and stalled_hosts({1: None}) == []


def test_liveness_a_host_whose_beat_is_never_readable_is_lost_from_when_it_was_seen() -> None:
    live = Liveness(timeout_ns=4)
    live.observe(1, {1: b"garbage", 2: b"1"})
    assert live.changed_ns == {1: 1, 2: 1} and live.seqs == {2: 1}
    live.observe(3, {1: b"still garbage", 2: b"2"})
    assert live.changed_ns == {1: 1, 2: 3}  # not news: the silence still counts from the first look
    assert live.lost(4) == [] and live.lost(5) == [1]


def test_liveness_a_new_value_restarts_the_clock_of_that_host_only() -> None:
    live = Liveness(timeout_ns=4)
    live.observe(0, {1: b"1", 2: b"1"})
    live.observe(2, {1: b"2", 2: b"1"})
    assert live.changed_ns == {1: 2, 2: 0} and live.seqs == {1: 2, 2: 1}
    assert live.lost(4) == [2] and live.lost(6) == [1, 2]


def test_liveness_news_restarts_a_silence_seen_only_starts_one() -> None:
    """What a shared filesystem's heartbeats tell (peerwatch.hosts.sharedfs.RemoteWatch)."""
    live = Liveness(timeout_ns=4)
    live.seen(2, 1)
    live.seen(2, 3)  # seen again: no news
    assert live.silent_ns(2, 5) == 4 and live.lost(5) == [2]
    live.news(2, 5)
    assert live.silent_ns(2, 8) == 3 and live.lost(8) == [] and live.lost(9) == [2]
    live.forget(2)
    assert live.lost(100) == [] and live.silent_ns(2, 100) == 0


def test_liveness_counts_on_the_clock_it_is_given() -> None:
    """A shared filesystem's judge counts on its watcher's clock, ticked by its owner: a gap
    of its own (more than its cap between two ticks) restarts every silence."""
    clock = AwakeClock(cap_ns=2)
    live = Liveness(timeout_ns=10, awake=clock)
    live.seen(1, 0)
    clock.tick(0)
    clock.tick(5)  # the judge was not running from 0 to 5
    assert live.silent_ns(1, 9) == 4 and live.lost(15) == [1] and live.lost(14) == []


# -- the lost ranks of a shared filesystem (rule: a silent host is lost) -----------------------

PEER_S = 30 * S
NOW = 1000 * S  # the judge's monotonic clock
WALL = 5000 * S  # the records' time


def _rank(rank: int, host: str) -> Registration:
    return Registration(rank=rank, pid=1000 + rank, ppid=1, start_ticks=5, uid=0, host=host, boot_id=f"boot-{host}",
                        pidns=f"pid:[{host}]", time_ns=0)


def _two_hosts(n_remote: int = 2) -> Dict[int, Registration]:
    """Ranks 0, 1 on host-a (the judge's); ranks 2.. on host-b."""
    return {r: _rank(r, "host-a" if r < 2 else "host-b") for r in range(2 + n_remote)}


def _lost(silence: Dict[int, int], registrations: Optional[Dict[int, Registration]] = None,
          ended: AbstractSet[int] = frozenset()) -> Tuple[Failure, ...]:
    live = Liveness(PEER_S)
    for rank, silent_ns in silence.items():
        live.seen(rank, NOW - silent_ns)
    return lost_rank_failures(live, NOW, WALL, registrations or _two_hosts(), ended, "host-a", 7)


def test_a_remote_rank_silent_for_peer_timeout_is_lost_and_written_up() -> None:
    message = ("host host-b lost: no heartbeat of rank 2 for 30.0s, rank 3 for 20.0s (peer_timeout 30s, "
               "by the clock of host host-a): the host is down, cut off, or its ranks are frozen")
    failure = Failure(rank=2, pid=1002, time_ns=WALL - PEER_S, cause=LOST, exit_code=7, message=message)
    assert _lost({2: PEER_S, 3: 20 * S}) == (failure,)
    obs = Observed(self_rank=0, now_ns=WALL, registrations=_two_hosts(), successes=set(), failures={2: failure},
                   exit_statuses={}, gone={})
    v = decide(obs, Policy(parent_wait_ns=0, default_exit_code=1)).verdict  # a failure like any other
    assert v is not None and (v.rank, v.cause, v.exit_code, v.failed_at_ns, v.host, v.detail) == (
        2, LOST, 7, WALL - PEER_S, "host-b", message)


def test_peer_timeout_is_a_boundary() -> None:
    assert _lost({2: PEER_S - 1}) == ()
    assert [f.rank for f in _lost({2: PEER_S})] == [2]


def test_a_rank_silent_for_half_of_peer_timeout_is_named_but_not_lost() -> None:
    half = PEER_S // 2
    lost = _lost({2: PEER_S + 5, 3: half})
    assert [f.rank for f in lost] == [2] and "rank 3 for 15.0s" in lost[0].message
    assert "rank 3" not in _lost({2: PEER_S + 5, 3: half - 1})[0].message
    # Silences read in tenths of a second, rounded: 30.05 s is 30.1 s.
    assert "no heartbeat of rank 2 for 30.1s (" in _lost({2: PEER_S + 50_000_000})[0].message


def test_every_rank_of_a_lost_host_is_lost_each_from_when_it_fell_silent() -> None:
    lost = _lost({2: PEER_S + 2 * S, 3: PEER_S + S, 4: PEER_S + 3 * S}, _two_hosts(3))
    assert [(f.rank, f.time_ns) for f in lost] == [(2, WALL - PEER_S - 2 * S), (3, WALL - PEER_S - S),
                                                  (4, WALL - PEER_S - 3 * S)]


def test_two_lost_hosts_are_written_up_each_with_its_own_ranks() -> None:
    regs = _two_hosts(1)
    regs[3] = _rank(3, "host-c")
    lost = _lost({2: PEER_S, 3: PEER_S + 1}, regs)
    assert [(f.rank, f.message.split(":")[0]) for f in lost] == [(2, "host host-b lost"), (3, "host host-c lost")]
    assert "rank 3" not in lost[0].message and "rank 2" not in lost[1].message


def test_a_remote_rank_known_to_have_ended_is_neither_lost_nor_named() -> None:
    """A success marker, a failure record (another judge's lost record too), an exit status."""
    assert _lost({2: 10 * PEER_S}, ended={2}) == ()
    lost = _lost({2: 10 * PEER_S, 3: 10 * PEER_S}, ended={2})
    assert [f.rank for f in lost] == [3] and "rank 2" not in lost[0].message


def test_an_unregistered_remote_rank_is_not_judged() -> None:
    regs = _two_hosts()
    del regs[2]
    assert _lost({2: 10 * PEER_S}, regs) == ()


# -- which hosts to look at --------------------------------------------------------------


def test_roster_incomplete_until_the_expected_count() -> None:
    assert roster_incomplete(None, 5)
    assert roster_incomplete(3, 2)
    assert not roster_incomplete(3, 3)
    assert not roster_incomplete(3, 4)


def test_hosts_to_read_skips_known_and_ourselves() -> None:
    assert hosts_to_read(5, {0, 2}, 3) == [1, 4]
    assert hosts_to_read(0, set(), 0) == []
    assert hosts_to_read(2, {0, 1}, 5) == []


def test_hosts_to_read_is_bounded_however_high_the_counter() -> None:
    """The counter is unsigned: set to 3,000,000 it made a request per index, every interval."""
    assert hosts_to_read(3_000_000, {0, 1}, 2) == list(range(3, 3 + READ_BATCH))
    assert hosts_to_read(10**30, set(), 0, limit=3) == [1, 2, 3]
    known = set(range(MAX_HOSTS - 1))
    assert hosts_to_read(3_000_000, known, 5) == [MAX_HOSTS - 1]  # never at or above MAX_HOSTS


def test_the_counter_is_a_decimal_number_or_unknown() -> None:
    assert parse_count(b"3") == 3 and parse_count(b"0") == 0 and parse_count(b"-4") == 0
    assert parse_count(b"3000000") == 3_000_000
    for junk in (b"", b"x", b"3 ", b"1e9", b"-", b"\xff", b"9" * 21, b"--1"):
        assert parse_count(junk) is None, junk


def test_a_host_record_too_long_is_garbage() -> None:
    body = HostInfo(3, "a", ranks=(1,)).to_json()
    assert HostInfo.from_json(3, body + b" " * (MAX_HOST_BYTES - len(body))).hostname == "a"
    assert HostInfo.from_json(3, body + b" " * (MAX_HOST_BYTES - len(body) + 1)) == HostInfo(3, "host 3")


def test_hosts_missing_counts_the_announced_hosts_that_did_not_join() -> None:
    assert hosts_missing(None, 0) == 0  # the launcher says nothing: nothing is missing
    assert hosts_missing(3, 0) == 2 and hosts_missing(3, 1) == 1 and hosts_missing(3, 2) == 0
    assert hosts_missing(2, 5) == 0
    assert hosts_missing(1, 0) == 0


def test_absence_counts_only_while_we_look_and_ends_when_nobody_is_missing() -> None:
    a = Absence(timeout_ns=10)
    assert a.since_ns is None and a.waited_s(5) == 0.0  # before any look: nobody missing yet
    a.observe(0, 0)
    assert a.waited_s(100) == 0.0
    a.observe(1, 2)
    a.observe(6, 2)
    assert a.waited_s(6) == 5 / 1e9
    a.observe(11, 1)  # a gap of exactly half the timeout is ours to count
    assert a.since_ns == 1
    a.observe(17, 1)  # one ns more: we were not looking, the count restarts
    assert a.since_ns == 17
    a.observe(18, 0)
    assert a.since_ns is None and a.waited_s(30) == 0.0


def test_a_host_that_never_joined_becomes_a_lost_verdict_on_a_rank_nobody_announced() -> None:
    hosts = {0: HostInfo(0, "a", ranks=(0, 1)), 2: HostInfo(2, "c", ranks=(4, 5))}
    assert unannounced_ranks(hosts, 6) == [2, 3] and unannounced_ranks(hosts, None) == []
    f = missing_hosts_failure(1, 3, 300.0, hosts, _config(world_size=6, exit_code=9), 5 * S)
    assert (f.rank, f.pid, f.cause, f.exit_code, f.time_ns) == (2, 0, LOST, 9, 5 * S)
    assert "1 of the 3 hosts the launcher announced never joined" in (f.message or "")
    assert "ranks 2-3" in (f.message or "") and "300.0s" in (f.message or "")
    f = missing_hosts_failure(1, 2, 300.0, hosts, _config(), 5 * S)
    assert f.rank == 0 and "not announced" not in (f.message or "")


def test_peers_to_watch_never_ourselves() -> None:
    hosts = {2: HostInfo(2, "b", ident="B"), 0: HostInfo(0, "me", ident="ME"), 1: HostInfo(1, "a", ident="A"),
             3: HostInfo(3, "me again", ident="ME")}  # a registration of ours that raced
    assert peers_to_watch(hosts, 0, "ME") == [1, 2]
    assert peers_to_watch(hosts, None, "X") == [0, 1, 2, 3]
    assert peers_to_watch(hosts, 1, "X") == [0, 2, 3]


# -- when a silence is a failure -----------------------------------------------------------


def test_silent_hosts_are_lost_unless_the_job_is_ending_or_judged() -> None:
    live = Liveness(timeout_ns=4)
    live.observe(0, {1: b"1", 2: b"1"})
    assert hosts_to_declare_lost(live, 4, set(), job_ending=False, verdict_known=False) == [1, 2]
    assert hosts_to_declare_lost(live, 4, {1}, job_ending=False, verdict_known=False) == [2]
    assert hosts_to_declare_lost(live, 4, set(), job_ending=True, verdict_known=False) == []
    assert hosts_to_declare_lost(live, 4, set(), job_ending=False, verdict_known=True) == []
    assert hosts_to_declare_lost(live, 3, set(), job_ending=False, verdict_known=False) == []


def test_the_store_is_lost_after_peer_timeout_of_silence_once_it_answered() -> None:
    assert store_silent_for(None, 100.0, 30.0) is None  # never reached: it may not exist yet
    assert store_silent_for(70.5, 100.0, 30.0) is None
    assert store_silent_for(70.0, 100.0, 30.0) == 30.0
    assert store_silent_for(60.0, 100.0, 30.0) == 40.0


@pytest.mark.parametrize("already", [False, True])
@pytest.mark.parametrize("ending", [False, True])
@pytest.mark.parametrize("known", [False, True])
def test_a_lost_store_is_reported_once_and_only_if_nothing_else_explains_it(
    already: bool, ending: bool, known: bool
) -> None:
    assert report_store_lost(already, ending, known) == (not already and not ending and not known)


# -- timing ----------------------------------------------------------------------------------


@pytest.mark.parametrize("peer_timeout, op", [(0.6, 0.5), (1.5, 0.5), (3.0, 1.0), (30.0, 10.0), (60.0, 10.0)])
def test_a_store_request_times_out_after_a_third_of_peer_timeout_within_bounds(peer_timeout: float, op: float) -> None:
    assert op_timeout_s(peer_timeout) == pytest.approx(op)


@pytest.mark.parametrize("peer_timeout, deadline", [(1.2, 0.6), (3.0, 1.5), (30.0, 15.0), (60.0, 20.0)])
def test_an_interval_may_take_two_requests_or_half_peer_timeout(peer_timeout: float, deadline: float) -> None:
    assert interval_deadline_s(peer_timeout) == pytest.approx(deadline)
    assert connect_allowance_s(peer_timeout) == pytest.approx(2 * op_timeout_s(peer_timeout))


def test_backoff_doubles_within_its_caps() -> None:
    assert next_backoff_s(0.5, 0.5, 30.0) == 1.0
    assert next_backoff_s(4.0, 0.5, 30.0) == CONNECT_BACKOFF_MAX_S == 5.0
    assert next_backoff_s(4.0, 0.5, 10.0) == 2.5  # a quarter of peer_timeout
    assert next_backoff_s(2.0, 3.0, 4.0) == 3.0  # never below one interval (unless 5 s is)
    assert next_backoff_s(2.0, 6.0, 4.0) == 4.0


# -- holding an exception back --------------------------------------------------------------


def _verdict(cause: str, detected_by: int = 1, failed_at_ns: int = 0) -> Verdict:
    return Verdict(rank=3, cause=cause, exit_code=1, failed_at_ns=failed_at_ns, detected_by=detected_by,
                   detected_at_ns=failed_at_ns)


def test_only_our_own_exception_or_exit_verdict_while_connected_may_be_an_echo() -> None:
    assert may_be_echo(_verdict(EXCEPTION), me=1, connected=True)
    assert may_be_echo(_verdict(EXIT), me=1, connected=True)
    assert not may_be_echo(_verdict(EXCEPTION), me=1, connected=False)
    assert not may_be_echo(_verdict(EXCEPTION, detected_by=2), me=1, connected=True)
    for cause in (SIGNAL, VANISHED, LOST):
        assert not may_be_echo(_verdict(cause), me=1, connected=True)


def test_the_hold_ends_remote_settle_after_the_failure_on_the_monotonic_clock() -> None:
    assert REMOTE_SETTLE_S == 1.0
    assert settle_deadline(failed_at_ns=10 * S, now_ns=10 * S + S // 4, now_s=500.0) == pytest.approx(500.75)
    assert settle_deadline(10 * S, 10 * S, 500.0) == 501.0
    assert settle_deadline(10 * S, 11 * S, 500.0) == 500.0  # already over: act now
    assert settle_deadline(10 * S, 20 * S, 500.0) == 500.0
    assert settle_deadline(10 * S, 9 * S, 500.0) == 501.0  # a failure "in the future" (clock step): one window


# -- the records a bridge writes ------------------------------------------------------------


def test_a_lost_host_becomes_a_lost_verdict_naming_the_host() -> None:
    config = _config(exit_code=3, peer_timeout=30)
    failure = lost_host_failure(HostInfo(1, "node1", ranks=(4, 5, 6, 7)), 31.0, config, now_ns=123)
    assert decode(Failure, encode(failure)) == failure
    assert (failure.rank, failure.pid, failure.time_ns, failure.cause, failure.exit_code, failure.host) == (
        4, 0, 123, LOST, 3, "node1")
    assert failure.message == ("host node1 (ranks 4-7) lost: its heartbeat in the store has not advanced for 31.0s "
                               "(peer_timeout 30s): the host froze, crashed or was cut off")
    obs = Observed(self_rank=0, now_ns=200, registrations={}, successes=set(), failures={4: failure},
                   exit_statuses={}, gone={})
    verdict = decide(obs, Policy(parent_wait_ns=0, default_exit_code=1)).verdict
    assert verdict is not None
    assert (verdict.rank, verdict.cause, verdict.host, verdict.exit_code, verdict.pid) == (4, LOST, "node1", 3, None)
    assert "host node1 (ranks 4-7) lost" in verdict.detail
    assert lost_host_failure(HostInfo(1, "node1"), 1.0, config, 0).rank == 0  # ranks unknown


def test_a_lost_store_is_blamed_on_the_host_of_rank_0() -> None:
    config = _config(exit_code=4, peer_timeout=30)
    me = HostInfo(1, "node1", ranks=(2, 3))
    # Rank 0 by name, whichever host comes first or holds the lowest other rank.
    hosts = {2: HostInfo(2, "node2", ranks=(1, 4)), 0: HostInfo(0, "node0", ranks=(0, 5)), 1: me}
    f = lost_store_failure("node0:29500", hosts, me, 30.5, config, now_ns=7)
    assert (f.rank, f.host, f.cause, f.exit_code, f.pid, f.time_ns) == (0, "node0", LOST, 4, 0, 7)
    assert f.message == ("the store at node0:29500 has been unreachable for 30.5s (peer_timeout 30s); the store is "
                         "served from host node0 (ranks 0, 5): its host died, or host node1 (ranks 2-3) is cut off "
                         "from it")


def test_without_rank_0_the_lowest_remote_rank_is_blamed_never_ours() -> None:
    config = _config()
    me = HostInfo(1, "node1", ranks=(0, 1))  # we hold rank 0: still not ours to blame
    hosts = {1: me, 3: HostInfo(3, "node3", ranks=(5, 6)), 2: HostInfo(2, "node2", ranks=(4, 9)),
             4: HostInfo(4, "node4")}
    assert store_holder(hosts, me) == hosts[2]  # by its lowest rank
    f = lost_store_failure("x:1", hosts, me, 30.0, config, 1)
    assert (f.rank, f.host) == (4, "node2") and "served from" not in (f.message or "")
    one = {1: me, 2: HostInfo(2, "node2", ranks=(1, 4))}  # rank 1 is no store's host
    assert "served from" not in (lost_store_failure("x:1", one, me, 30.0, config, 1).message or "")
    # Rank 0 on a host not known here (a host that reads the digest knows few records):
    # rank 0 is blamed, its host unnamed, not the lowest rank that happens to be known.
    other = HostInfo(1, "node1", ranks=(2, 3))
    f = lost_store_failure("x:1", {1: other, 3: HostInfo(3, "node3", ranks=(4, 5))}, other, 30.0, config, 1)
    assert (f.rank, f.host) == (0, None) and "served from" not in (f.message or "")
    # Nothing known of the others: rank 0, no host.
    f = lost_store_failure("x:1", {1: me}, me, 30.0, config, 1)
    assert (f.rank, f.host) == (0, None) and store_holder({1: me}, me) is None
    assert store_holder({4: HostInfo(4, "node4")}, me) is None  # a host without ranks names none


# -- the digest: one aggregator, its successor ------------------------------------------------

from peerwatch.hosts.hosts import (  # noqa: E402
    FIRST_SPREAD_PER_HOST_S,
    MAX_DIGEST_BYTES,
    MAX_DIGEST_LIST,
    Digest,
    DigestWatch,
    aggregate_term,
    bounded,
    first_spread_s,
    successor_distance,
    takeover_ns,
)


def test_first_requests_spread_with_the_hosts_announced_at_most_a_heartbeat() -> None:
    """Three hosts start together, not up to a heartbeat late; a thousand spread over a
    heartbeat; a job whose size is unknown spreads over a heartbeat."""
    assert first_spread_s(1.0, 3) == pytest.approx(3 * FIRST_SPREAD_PER_HOST_S) and first_spread_s(1.0, 3) < 0.01
    assert first_spread_s(1.0, 1024) == 1.0 and first_spread_s(0.5, 10_000) == 0.5
    assert first_spread_s(1.0, None) == 1.0
    assert first_spread_s(1.0, 0) == FIRST_SPREAD_PER_HOST_S


def test_a_digest_round_trips_and_garbage_is_unknown() -> None:
    d = Digest(2, 3, b"done:123s", count=9, joined=8, lost=(4, 7), stalled=(1,), ending=True, rank0=0, more_lost=1)
    assert Digest.from_json(d.to_json()) == d and d.seq == 123
    for bad in (None, b"", b"[]", b"{}", b"\xff", b'{"by":-1,"t":0,"b":"1"}', b'{"by":0,"t":0,"b":"x"}',
                b'{"by":true,"t":0,"b":"1"}', b'{"by":0,"t":0,"b":"1","l":"1"}', b" " * (MAX_DIGEST_BYTES + 1),
                json.dumps({"by": 0, "t": 0, "b": "1", "l": list(range(MAX_DIGEST_LIST + 1))}).encode()):
        assert Digest.from_json(bad) is None, bad


def test_a_digest_names_a_bounded_number_of_hosts_whatever_the_job() -> None:
    lost, more = bounded(list(range(10_000, 0, -1)))
    assert lost == tuple(range(1, MAX_DIGEST_LIST + 1)) and more == 10_000 - MAX_DIGEST_LIST
    d = Digest(0, 0, b"1", count=10_000, joined=10_000, lost=lost, stalled=lost, more_lost=more)
    assert len(d.to_json()) <= MAX_DIGEST_BYTES and Digest.from_json(d.to_json()) == d


def test_the_successor_is_the_next_host_not_lost_cyclically() -> None:
    assert successor_distance(0, 1, 4, set()) == 1
    assert successor_distance(0, 2, 4, {1}) == 1
    assert successor_distance(0, 3, 4, set()) == 3
    assert successor_distance(3, 0, 4, set()) == 1  # after the last, the first
    assert successor_distance(2, 1, 4, {3}) == 2


def test_who_aggregates() -> None:
    t = takeover_ns(2.0, 0.2)
    assert t == 1_000_000_000 and takeover_ns(1.0, 0.5) == 1_000_000_000
    assert aggregate_term(0, None, None, 0, t) == 0  # no digest: host 0 at once
    assert aggregate_term(2, None, None, 2 * t - 1, t) is None and aggregate_term(2, None, None, 2 * t, t) == 0
    d = Digest(0, 0, b"5")
    assert aggregate_term(0, d, None, 0, t) == 0  # ours: a successor bridge on our host goes on
    assert aggregate_term(1, d, None, t - 1, t) is None  # the writer's successor waits for silence
    assert aggregate_term(1, d, None, t, t) == 1  # ...then takes over, with the next term
    assert aggregate_term(2, d, None, t, t) is None and aggregate_term(2, d, None, 2 * t, t) == 1
    taken = Digest(1, 1, b"9")
    assert aggregate_term(0, taken, 0, 0, t) is None  # the old writer, resumed, yields to the higher term
    assert aggregate_term(1, Digest(0, 1, b"9"), 1, 0, t) is None  # same term: the lower index wins
    assert aggregate_term(0, Digest(1, 1, b"9"), 1, 0, t) == 1


def test_the_digest_watch_counts_only_while_we_look() -> None:
    w = DigestWatch(timeout_ns=1000)
    w.observe(0, None)
    w.observe(400, None)
    assert w.silent_ns(400) == 400  # no digest: from our first look
    w.observe(500, Digest(0, 0, b"7"))
    assert w.silent_ns(900) == 400
    w.observe(900, Digest(0, 0, b"7"))  # the same: no news
    assert w.silent_ns(900) == 400
    w.observe(2000, Digest(0, 0, b"7"))  # we were not looking for 1100 ns: that gap is nobody's
    assert w.silent_ns(2000) == 0
    w.observe(2100, Digest(1, 1, b"3"))  # a new writer (lower sequence: another host's clock) is news
    assert w.silent_ns(2100) == 0


def test_past_the_bound_a_digest_names_the_laggard_candidates_first() -> None:
    from peerwatch.hosts.hosts import stalled_for_digest

    many = list(range(1000))
    named = stalled_for_digest(many, {900, 5})
    assert len(named) == MAX_DIGEST_LIST and named[:2] == (5, 900) and named[2:5] == (0, 1, 2)
    assert stalled_for_digest([3, 1, 2], set()) == (1, 2, 3)
