"""The teardown policy (peerwatch.verdict.plan): pure, so every rule is checked here, fast, without
processes. The end-to-end tests (test_e2e_core, test_fault_matrix) check it is carried out."""

from __future__ import annotations

import dataclasses

import pytest

from peerwatch.core.records import EXCEPTION, EXIT, HANG, INTERRUPTED, LOST, MISSING, SIGNAL, VANISHED
from peerwatch.verdict import plan as _plan
from peerwatch.verdict.plan import SUMMARY_POLL_RANKS, SUMMARY_POLL_S, AckWindow, Situation, plan

pytestmark = pytest.mark.pure  # no process, no thread, no file: conftest skips its scan for leaks

BASE = Situation(
    self_rank=0, failed_rank=2, cause=SIGNAL, verdict_exit_code=137, own_exit_code=None, in_watch=False,
    live_local_ranks=(0, 1, 3), wrote_verdict=False, grace_s=5.0, ack_window_s=1.0,
)


def situation(**changes: object) -> Situation:
    return dataclasses.replace(BASE, **changes)  # type: ignore[arg-type]


# -- rule: the verdict's exit code ----------------------------------------------------


def test_a_torn_down_rank_exits_with_the_verdicts_code_whatever_it_recorded() -> None:
    assert plan(situation(own_exit_code=3)).exit_code == 137
    assert _plan.exit_code(self_rank=0, failed_rank=2, verdict_exit_code=137, own_exit_code=3) == 137


def test_the_failed_rank_exits_with_its_own_code_when_it_recorded_one() -> None:
    assert plan(situation(self_rank=2, failed_rank=2, verdict_exit_code=1, own_exit_code=3)).exit_code == 3


def test_the_failed_rank_without_a_record_of_its_own_exits_with_the_verdicts_code() -> None:
    assert plan(situation(self_rank=2, failed_rank=2, verdict_exit_code=124, own_exit_code=None)).exit_code == 124
    assert _plan.exit_code(2, 2, 124, 0) == 124  # 0 is no failure code


# -- rule: who stays --------------------------------------------------------------------


@pytest.mark.parametrize("cause", [EXCEPTION, EXIT])
def test_a_rank_whose_own_exception_or_exit_is_the_cause_is_given_grace_to_leave(cause: str) -> None:
    p = plan(situation(self_rank=2, failed_rank=2, cause=cause))
    assert p.stay and p.stay_s == 5.0
    assert not p.interrupt_main


@pytest.mark.parametrize("cause", [HANG, LOST, SIGNAL, VANISHED, MISSING])
def test_a_rank_blamed_for_what_its_main_thread_did_not_raise_leaves_at_once(cause: str) -> None:
    p = plan(situation(self_rank=2, failed_rank=2, cause=cause))
    assert not p.stay and p.stay_s == 0.0


def test_in_an_interrupted_job_the_rank_the_verdict_names_is_one_among_others() -> None:
    """No rank failed: the first rank to get the signal says its one line like the others,
    and the writer of the verdict prints the summary, at once (nobody prints a traceback of
    a failure to put it below)."""
    first = plan(situation(self_rank=2, failed_rank=2, cause=INTERRUPTED, verdict_exit_code=130, own_exit_code=130,
                           live_local_ranks=(0, 1, 2, 3)))
    assert first.stop_line and not first.print_summary and not first.stay and first.exit_code == 130, first
    writer = plan(situation(cause=INTERRUPTED, verdict_exit_code=130, wrote_verdict=True, failed_rank_speaks=True))
    assert writer.print_summary and writer.summary_now and writer.stop_line, writer


def test_a_survivor_inside_watch_is_interrupted_and_given_grace() -> None:
    p = plan(situation(in_watch=True))
    assert p.interrupt_main and p.stay and p.stay_s == 5.0
    short = plan(situation(in_watch=True, grace_s=0.5))
    assert short.stay and short.stay_s == 0.5


def test_a_survivor_outside_watch_leaves_at_once_without_interrupting() -> None:
    p = plan(situation(in_watch=False))
    assert not p.interrupt_main and not p.stay


def test_the_failed_rank_inside_watch_is_not_interrupted() -> None:
    p = plan(situation(self_rank=2, failed_rank=2, cause=HANG, in_watch=True))
    assert not p.interrupt_main and not p.stay


# -- rule: who enforces -----------------------------------------------------------------


def test_the_three_lowest_live_ranks_other_than_the_failed_one_enforce() -> None:
    assert _plan.enforcers((5, 0, 3, 1, 2), failed_rank=1) == (0, 2, 3)
    assert _plan.ENFORCERS == 3
    assert [r for r in range(6) if plan(situation(self_rank=r, failed_rank=1, live_local_ranks=(0, 1, 2, 3, 4, 5))).enforcer] == [0, 2, 3]


def test_the_failed_rank_enforces_only_when_too_few_others_are_left() -> None:
    assert _plan.enforcers((0, 1), failed_rank=1) == (0, 1)
    assert _plan.enforcers((1, 4, 7, 9), failed_rank=1) == (4, 7, 9)
    assert plan(situation(self_rank=1, failed_rank=1, live_local_ranks=(0, 1))).enforcer
    assert not plan(situation(self_rank=1, failed_rank=1, live_local_ranks=(0, 1, 2, 3))).enforcer


def test_a_rank_that_is_not_live_does_not_enforce() -> None:
    assert not plan(situation(self_rank=9, live_local_ranks=(0, 1, 3))).enforcer


# -- rule: who reports ------------------------------------------------------------------


def test_the_first_enforcer_writes_the_report_and_sweeps_the_log_the_verdicts_writer_prints_it() -> None:
    first = plan(situation(self_rank=0))
    assert first.write_report and first.sweep_records and not first.print_summary
    for spare in (1, 3):  # the other enforcers: signalling only (each report costs the peers CPU)
        other = plan(situation(self_rank=spare, live_local_ranks=(0, 1, 3, 4, 7)))
        assert other.enforcer and not other.write_report and not other.sweep_records
    bystander = plan(situation(self_rank=7, live_local_ranks=(0, 1, 3, 4, 7)))
    assert not bystander.enforcer and not bystander.write_report and not bystander.print_summary
    writer = plan(situation(self_rank=7, live_local_ranks=(0, 1, 3, 4, 7), wrote_verdict=True))
    assert writer.write_report and writer.print_summary and not writer.sweep_records
    spare_writer = plan(situation(self_rank=1, live_local_ranks=(0, 1, 3, 4, 7), wrote_verdict=True))
    assert spare_writer.write_report and not spare_writer.sweep_records
    # Inside watch() the writer stays (PeerFailure is raised in its main thread), but the
    # summary is not its own traceback's: it writes and prints at once.
    in_watch = plan(situation(self_rank=7, live_local_ranks=(0, 1, 3, 4, 7), wrote_verdict=True, in_watch=True))
    assert in_watch.stay and in_watch.write_report and in_watch.print_summary


def test_the_failed_rank_is_first_enforcer_only_when_alone() -> None:
    alone = plan(situation(self_rank=2, failed_rank=2, live_local_ranks=(2,)))
    assert alone.write_report and alone.sweep_records


@pytest.mark.parametrize("cause", [EXCEPTION, EXIT])
def test_a_failing_rank_that_speaks_for_itself_prints_the_summary_below_its_traceback(cause: str) -> None:
    """It recorded its own exception or exit and is leaving by itself: it prints the
    summary once its main thread has left (its traceback is out then), and the writer of
    the verdict, another rank, does not: one summary, after the cause."""
    failing = plan(situation(self_rank=2, failed_rank=2, cause=cause, own_exit_code=1, live_local_ranks=(0, 1, 2)))
    # It writes the report once its main thread has left, to build the summary: not now.
    assert failing.print_summary and not failing.write_report and failing.stay
    alone = plan(situation(self_rank=2, failed_rank=2, cause=cause, own_exit_code=1, live_local_ranks=(2,)))
    assert alone.print_summary and alone.write_report  # the one writer of its host: now too
    writer = plan(situation(cause=cause, wrote_verdict=True, failed_rank_speaks=True))
    assert writer.write_report and not writer.print_summary
    both = plan(situation(self_rank=2, failed_rank=2, cause=cause, own_exit_code=1, wrote_verdict=True))
    assert both.print_summary


@pytest.mark.parametrize("cause", [SIGNAL, VANISHED, HANG, LOST])
def test_the_writer_prints_the_summary_of_a_rank_that_cannot(cause: str) -> None:
    """A dead rank, a hung one, another host: the writer of the verdict prints it."""
    assert plan(situation(cause=cause, wrote_verdict=True, failed_rank_speaks=True)).print_summary
    assert not plan(situation(self_rank=2, failed_rank=2, cause=cause, own_exit_code=None)).print_summary


def test_the_writer_prints_the_summary_of_an_exit_seen_by_the_parent() -> None:
    """os._exit(3): the parent saw the exit status, the rank said nothing itself."""
    assert plan(situation(cause=EXIT, wrote_verdict=True, failed_rank_speaks=False)).print_summary


@pytest.mark.parametrize("cause", [EXCEPTION, EXIT, SIGNAL, VANISHED])
def test_the_summary_first_then_every_other_rank_says_its_line(cause: str) -> None:
    """Rule: who reports, the order. A failing rank that speaks prints the summary once it
    has left (not at the verdict); a writer that prints it for a rank that cannot, at once
    (before a launcher's SIGTERM); every rank but the failing one says its line after it."""
    failing = plan(situation(self_rank=2, failed_rank=2, cause=cause, own_exit_code=1))
    assert not failing.stop_line and not failing.summary_now
    speaks = cause in (EXCEPTION, EXIT)
    writer = plan(situation(cause=cause, wrote_verdict=True, failed_rank_speaks=speaks))
    assert writer.stop_line and writer.summary_now == (not speaks) == writer.print_summary
    other = plan(situation(cause=cause, wrote_verdict=False, failed_rank_speaks=speaks))
    assert other.stop_line and not other.summary_now and not other.print_summary
    assert not (failing.summary_after_dumps or writer.summary_after_dumps or other.summary_after_dumps)


@pytest.mark.parametrize("cause", [HANG, LOST, MISSING])
def test_the_summary_of_a_rank_that_has_not_ended_waits_for_the_writers_dumps(cause: str) -> None:
    """Rule: who reports. Nothing ends the workers on account of a hung rank, a lost host or
    a rank that never started: the writer prints the summary once its stacks and flight
    recorder are dumped (the summary names them), not at the verdict; it writes the
    report."""
    writer = plan(situation(cause=cause, wrote_verdict=True, failed_rank_speaks=False))
    assert writer.print_summary and writer.summary_after_dumps and not writer.summary_now and writer.write_report
    other = plan(situation(cause=cause, wrote_verdict=False, failed_rank_speaks=False))
    assert not other.summary_after_dumps and other.stop_line


# -- rule: the ack window ------------------------------------------------------------------


def test_the_ack_window_closes_after_ack_window_when_no_ack_comes() -> None:
    w = AckWindow.opened(100.0, 2.0).seen(100.0, 0)
    assert w.left(100.0) == 2.0
    assert w.seen(101.9, 0).left(101.9) == pytest.approx(0.1)
    assert w.seen(102.0, 0).left(102.0) == 0.0


def test_the_first_look_never_stretches_the_window() -> None:
    w = AckWindow.opened(100.0, 2.0).seen(101.9, 5)
    assert w.deadline == 102.0


def test_acks_arriving_stretch_the_window_to_a_quarter_after_the_latest() -> None:
    w = AckWindow.opened(100.0, 2.0).seen(100.0, 0).seen(101.9, 1)
    assert w.deadline == pytest.approx(102.4)
    assert w.seen(101.95, 1).deadline == pytest.approx(102.4)  # no new ack: no stretch
    assert w.seen(102.3, 2).deadline == pytest.approx(102.8)


def test_a_stretch_never_shortens_the_window() -> None:
    w = AckWindow.opened(100.0, 2.0).seen(100.0, 0).seen(100.1, 1)
    assert w.deadline == 102.0


def test_the_window_never_stretches_beyond_four_windows() -> None:
    w = AckWindow.opened(100.0, 2.0).seen(100.0, 0)
    for i in range(1, 40):
        w = w.seen(100.0 + i * 0.25, i)
    assert w.deadline == pytest.approx(108.0)
    assert w.latest == 108.0


# -- rule: whom to signal -----------------------------------------------------------------


def test_pending_peers_are_the_live_ones_that_gave_no_ack_lowest_first() -> None:
    assert _plan.pending([5, 0, 3, 1, 2, 4], self_rank=0, gone={1}, acked={3}) == (2, 4, 5)
    assert _plan.pending([0], self_rank=0, gone=set(), acked=set()) == ()


def test_a_finished_peer_is_not_asked_for_stacks() -> None:
    assert _plan.ask_for_stacks(3, finished={1, 2})
    assert not _plan.ask_for_stacks(2, finished={1, 2})


# -- rule: the last resort --------------------------------------------------------------------


def test_the_last_resort_fires_after_the_ack_window_three_graces_and_two_seconds() -> None:
    assert plan(situation(grace_s=5.0, ack_window_s=1.0)).last_resort_s == 18.0
    assert plan(situation(grace_s=0.5, ack_window_s=2.0)).last_resort_s == 5.5


# -- startup: ranks that never came ---------------------------------------------------------


def test_ranks_missing_at_startup_are_named_when_this_host_runs_them_all() -> None:
    assert _plan.missing_ranks(None, 4, local={0, 2}, registered={0, 2}) == ((1, 3), "rank(s) 1, 3 did not register")
    assert _plan.missing_ranks(3, 3, local={0}, registered={0, 1}) == ((2,), "rank(s) 2 did not register")


def test_all_ranks_there_at_startup_is_no_news() -> None:
    assert _plan.missing_ranks(2, 4, local={0, 1}, registered={0, 1}) == ((), "")
    assert _plan.missing_ranks(None, 2, local={0, 1, 5}, registered={0, 1, 5}) == ((), "")


def test_a_host_with_some_of_the_ranks_warns_without_naming_global_ranks() -> None:
    missing, why = _plan.missing_ranks(2, 4, local={0}, registered={0, 3})
    assert missing == ()
    assert why == "only 1 of 2 local ranks registered (registered: [0])"


def test_no_expected_count_is_said_not_guessed() -> None:
    missing, why = _plan.missing_ranks(None, None, local={0}, registered={0})
    assert missing == () and "neither LOCAL_WORLD_SIZE nor WORLD_SIZE" in why
    assert _plan.missing_ranks(0, 0, local={0}, registered={0})[0] == ()


# -- rule: leaving at exit --------------------------------------------------------------------


def test_a_failed_rank_waits_at_exit_for_parent_wait_ack_window_a_settle_and_the_hold() -> None:
    assert _plan.SETTLE_S == 0.25
    assert _plan.verdict_wait_s(parent_wait_s=0.5, ack_window_s=1.0, hold_s=0.0) == 1.75
    assert _plan.verdict_wait_s(parent_wait_s=0.5, ack_window_s=1.0, hold_s=1.0) == 2.75
    # An exception raised by torch.distributed may wait for a peer that is leaving to end
    # (rule: echo waits for the leaving): its rank waits that much longer for the verdict.
    assert _plan.verdict_wait_s(parent_wait_s=0.5, ack_window_s=1.0, hold_s=0.0, echo=True) == 1.75 + 15.0


def test_the_exiting_main_thread_gives_the_watcher_grace_the_ack_window_and_two_seconds() -> None:
    assert _plan.leave_join_s(grace_s=5.0, ack_window_s=1.0) == 8.0
    assert _plan.leave_join_s(grace_s=0.5, ack_window_s=2.0) == 4.5


# -- rule: the blind enforcer (its own acknowledgement could not be written) -------------


def test_an_enforcer_whose_ack_was_written_waits_the_ack_window_and_trusts_no_one() -> None:
    p = plan(situation())
    assert p.enforcer and not p.blind
    assert p.ack_window_s == 1.0 and p.trusted == ()


def test_a_blind_enforcer_waits_two_graces_more_and_never_signals_the_other_enforcers() -> None:
    p = plan(situation(ack_written=False, live_local_ranks=(0, 1, 3, 4, 5)))
    assert p.blind and p.enforcer
    assert p.ack_window_s == 1.0 + _plan.BLIND_GRACES * 5.0
    assert p.trusted == (1, 3)  # the other enforcers; ranks 4 and 5 must still leave or be signalled
    # Its own last resort moves out by as much: it must outlive its longer wait.
    assert p.last_resort_s == plan(situation()).last_resort_s + _plan.BLIND_GRACES * 5.0
    assert _plan.pending([0, 1, 3, 4, 5], 0, gone={4}, acked=set(), trusted=set(p.trusted)) == (5,)


def test_a_rank_that_does_not_enforce_is_never_blind() -> None:
    p = plan(situation(self_rank=4, ack_written=False, live_local_ranks=(0, 1, 3, 4)))
    assert not p.enforcer and not p.blind and p.trusted == ()
    assert p.last_resort_s == plan(situation(self_rank=4, live_local_ranks=(0, 1, 3, 4))).last_resort_s


def test_the_documented_constants_have_the_documented_values() -> None:
    """docs/security.md: a blind enforcer waits ``ack_window + 2 x grace``; docs/configuration.md
    ("Fixed values"): 0.25 s settle. Tests above compute from the constants; a change shows here."""
    assert (_plan.BLIND_GRACES, _plan.SETTLE_S, _plan.ENFORCERS) == (2, 0.25, 3)


# -- rule: the step order ---------------------------------------------------------------------

S = _plan.Step
# The actions that write the report (WRITE_SUMMARY* print the summary too).
REPORTS = (S.WRITE_REPORT, S.WRITE_SUMMARY, S.WRITE_SUMMARY_BELOW_TRACEBACK)


def steps(p: _plan.Plan) -> tuple:
    return p.until_ack + p.after_ack


def before(seq: tuple, first: object, then: object) -> bool:
    """``first`` occurs, ``then`` occurs, and the first ``first`` comes before the first ``then``."""
    return first in seq and then in seq and seq.index(first) < seq.index(then)


def test_the_failed_rank_itself_inside_watch_waits_for_its_main_thread_then_prints_below_its_traceback() -> None:
    p = plan(situation(self_rank=2, failed_rank=2, cause=EXCEPTION, own_exit_code=1, in_watch=True,
                       live_local_ranks=(0, 1, 2, 3), on_verdict=True))
    assert steps(p) == (
        S.ARM_EXIT_WATCH, S.ACK,
        S.STOP_WATCHING_FOLDERS, S.ARM_LAST_RESORT, S.FINAL_HEARTBEAT, S.TELL_LAUNCHERS, S.DUMP_STACKS,
        S.DUMP_FLIGHT_RECORDER, S.WAIT_MAIN, S.WRITE_SUMMARY_BELOW_TRACEBACK, S.TEAR_DOWN_CHILDREN,
        S.FINAL_HEARTBEAT, S.EXIT,
    )
    # Its own exit (sys.exit) printed no traceback: the summary carries it.
    exited = plan(situation(self_rank=2, failed_rank=2, cause=EXIT, own_exit_code=3, live_local_ranks=(0, 1, 2, 3)))
    assert S.WRITE_SUMMARY in exited.after_ack and S.WRITE_SUMMARY_BELOW_TRACEBACK not in steps(exited)
    assert before(steps(exited), S.WAIT_MAIN, S.WRITE_SUMMARY)


def test_the_failed_rank_alone_on_its_host_writes_the_report_starts_the_hook_then_waits_for_its_main_thread() -> None:
    p = plan(situation(self_rank=2, failed_rank=2, cause=EXCEPTION, own_exit_code=1, live_local_ranks=(2,), on_verdict=True))
    assert p.after_ack == (
        S.ARM_LAST_RESORT, S.FINAL_HEARTBEAT, S.TELL_LAUNCHERS, S.DUMP_STACKS, S.DUMP_FLIGHT_RECORDER,
        S.TEAR_DOWN_PEERS, S.STOP_WATCHING_FOLDERS, S.WRITE_REPORT, S.START_HOOK, S.WAIT_MAIN, S.WRITE_SUMMARY_BELOW_TRACEBACK,
        S.TEAR_DOWN_CHILDREN, S.FINAL_HEARTBEAT, S.SWEEP_RECORDS, S.FINISH_HOOK, S.EXIT,
    )


def test_under_torchrun_the_writer_prints_the_summary_before_its_ack_and_starts_the_hook_before_its_dumps() -> None:
    """The launcher ends the workers as soon as it sees the dead one: the cause first, at
    once; the hook at once or never; the agent is let see the failed rank before this one leaves."""
    p = plan(situation(wrote_verdict=True, ends_workers_early=True, on_verdict=True))
    assert p.until_ack == (S.HOLD_SIGTERM, S.ARM_EXIT_WATCH, S.WRITE_SUMMARY, S.ACK)
    assert p.after_ack == (
        S.ARM_LAST_RESORT, S.FINAL_HEARTBEAT, S.TELL_LAUNCHERS, S.START_HOOK, S.DUMP_STACKS,
        S.DUMP_FLIGHT_RECORDER, S.TEAR_DOWN_PEERS, S.STOP_WATCHING_FOLDERS, S.TEAR_DOWN_CHILDREN, S.WRITE_REPORT, S.FINAL_HEARTBEAT,
        S.SAY_STOP_LINE, S.LET_LAUNCHER_SEE, S.SWEEP_RECORDS, S.FINISH_HOOK, S.EXIT,
    )


def test_under_torchrun_an_enforcer_that_did_not_write_the_verdict_writes_the_report_before_the_early_hook() -> None:
    p = plan(situation(ends_workers_early=True, on_verdict=True))
    assert p.until_ack == (S.HOLD_SIGTERM, S.ARM_EXIT_WATCH, S.ACK)
    assert p.after_ack[:5] == (S.ARM_LAST_RESORT, S.FINAL_HEARTBEAT, S.TELL_LAUNCHERS, S.WRITE_REPORT, S.START_HOOK)
    assert before(p.after_ack, S.START_HOOK, S.DUMP_STACKS)
    assert p.after_ack.count(S.WRITE_REPORT) == 2  # again after the teardown, with the peers' ends


def test_an_enforcer_outside_watch_tears_down_peers_then_its_children_writes_the_report_and_starts_the_hook_last() -> None:
    p = plan(situation(on_verdict=True))
    assert steps(p) == (
        S.ARM_EXIT_WATCH, S.ACK,
        S.ARM_LAST_RESORT, S.FINAL_HEARTBEAT, S.TELL_LAUNCHERS, S.DUMP_STACKS, S.DUMP_FLIGHT_RECORDER,
        S.TEAR_DOWN_PEERS, S.STOP_WATCHING_FOLDERS, S.TEAR_DOWN_CHILDREN, S.WRITE_REPORT, S.FINAL_HEARTBEAT, S.SAY_STOP_LINE,
        S.SWEEP_RECORDS, S.START_HOOK, S.FINISH_HOOK, S.EXIT,
    )


def test_a_rank_that_does_not_enforce_stops_watching_folders_and_only_leaves() -> None:
    p = plan(situation(self_rank=7, live_local_ranks=(0, 1, 3, 4, 7), on_verdict=True))
    assert steps(p) == (
        S.ARM_EXIT_WATCH, S.ACK,
        S.STOP_WATCHING_FOLDERS, S.ARM_LAST_RESORT, S.FINAL_HEARTBEAT, S.TELL_LAUNCHERS, S.DUMP_STACKS,
        S.DUMP_FLIGHT_RECORDER, S.TEAR_DOWN_CHILDREN, S.FINAL_HEARTBEAT, S.SAY_STOP_LINE, S.EXIT,
    )


def test_a_survivor_inside_watch_is_interrupted_after_its_dumps_and_tears_down_its_children_once_its_main_thread_left() -> None:
    p = plan(situation(self_rank=7, live_local_ranks=(0, 1, 3, 4, 7), in_watch=True))
    assert p.after_ack == (
        S.STOP_WATCHING_FOLDERS, S.ARM_LAST_RESORT, S.FINAL_HEARTBEAT, S.TELL_LAUNCHERS, S.DUMP_STACKS,
        S.DUMP_FLIGHT_RECORDER, S.INTERRUPT_MAIN, S.WAIT_MAIN, S.TEAR_DOWN_CHILDREN, S.FINAL_HEARTBEAT,
        S.SAY_STOP_LINE, S.EXIT,
    )


def test_a_blind_enforcer_says_so_first_and_its_ack_changes_only_the_steps_after_it() -> None:
    """Rule: the blind enforcer. The second part is planned with the ack's result; the first
    cannot depend on it."""
    for changes in ({}, {"wrote_verdict": True}, {"self_rank": 2, "failed_rank": 2, "live_local_ranks": (2,)}):
        seen, blind = plan(situation(**changes)), plan(situation(ack_written=False, **changes))
        assert seen.until_ack == blind.until_ack and blind.until_ack[-1] == S.ACK
        assert blind.after_ack == (S.SAY_BLIND,) + seen.after_ack
    assert S.SAY_BLIND not in plan(situation(self_rank=7, live_local_ranks=(0, 1, 3, 7), ack_written=False)).after_ack


def test_other_hosts_are_told_after_the_ack_and_before_the_dumps() -> None:
    p = plan(situation(other_hosts=True))
    assert p.after_ack[:3] == (S.ARM_LAST_RESORT, S.TELL_HOSTS, S.FINAL_HEARTBEAT)
    assert S.TELL_HOSTS not in steps(plan(situation()))


@pytest.mark.parametrize("cause", [HANG, LOST, MISSING])
def test_a_hang_is_summarized_once_dumped_and_the_main_thread_interrupted_after(cause: str) -> None:
    p = plan(situation(cause=cause, wrote_verdict=True, in_watch=True))
    assert p.until_ack == (S.ARM_EXIT_WATCH, S.ACK)
    assert p.after_ack == (
        S.ARM_LAST_RESORT, S.FINAL_HEARTBEAT, S.TELL_LAUNCHERS, S.DUMP_STACKS, S.DUMP_FLIGHT_RECORDER,
        S.WRITE_SUMMARY, S.INTERRUPT_MAIN, S.TEAR_DOWN_PEERS, S.STOP_WATCHING_FOLDERS, S.WRITE_REPORT, S.WAIT_MAIN, S.TEAR_DOWN_CHILDREN,
        S.FINAL_HEARTBEAT, S.SAY_STOP_LINE, S.SWEEP_RECORDS, S.EXIT,
    )


def _every_situation() -> list:
    out = []
    for cause in (EXCEPTION, EXIT, SIGNAL, HANG, LOST):
        for self_rank, live in ((0, (0, 1, 3)), (7, (0, 1, 3, 7)), (2, (0, 1, 2, 3)), (2, (2,))):
            for flags in range(64):
                f = [bool(flags >> i & 1) for i in range(6)]
                out.append(situation(
                    self_rank=self_rank, live_local_ranks=live, cause=cause, own_exit_code=1 if f[5] else None,
                    wrote_verdict=f[0], in_watch=f[1], ends_workers_early=f[2] and self_rank != 2,
                    on_verdict=f[3], ack_written=f[4], other_hosts=f[4] and f[5], failed_rank_speaks=f[5],
                ))
    return out


def test_in_every_situation_the_order_that_matters_holds() -> None:
    for s in _every_situation():
        p = plan(s)
        seq = steps(p)
        why = f"{s}: {[x.name for x in seq]}"
        held = (S.HOLD_SIGTERM,) if s.ends_workers_early else ()  # first: the launcher's SIGTERM is coming
        assert seq[:len(held) + 1] == held + (S.ARM_EXIT_WATCH,) and seq.count(S.HOLD_SIGTERM) == len(held), why
        assert p.until_ack[-1] == S.ACK and seq.count(S.ACK) == 1, why
        assert seq[-1] == S.EXIT and seq.count(S.EXIT) == 1, why
        assert seq.count(S.FINAL_HEARTBEAT) == 2 and seq.count(S.TEAR_DOWN_CHILDREN) == 1, why
        assert before(seq, S.ARM_LAST_RESORT, S.DUMP_STACKS) and before(seq, S.DUMP_STACKS, S.DUMP_FLIGHT_RECORDER), why
        assert (S.WRITE_SUMMARY in p.until_ack) == p.summary_now, why  # the cause first, before the ack
        if p.summary_after_dumps:
            assert before(seq, S.DUMP_FLIGHT_RECORDER, S.WRITE_SUMMARY), why
        if p.interrupt_main:
            assert before(seq, S.DUMP_FLIGHT_RECORDER, S.INTERRUPT_MAIN), why
            assert before(seq, S.INTERRUPT_MAIN, S.TEAR_DOWN_PEERS if p.enforcer else S.WAIT_MAIN), why
        if p.stay:
            assert before(seq, S.WAIT_MAIN, S.TEAR_DOWN_CHILDREN), why
        if p.enforcer and p.stop_line:
            assert before(seq, S.TEAR_DOWN_PEERS, S.SAY_STOP_LINE), why
        # Every rank stops watching the folders before it exits (a process that exits with
        # inotify watches held waits for the kernel to free them), an enforcer once its
        # peers acknowledged or were signalled.
        assert seq.count(S.STOP_WATCHING_FOLDERS) == 1, why
        if p.enforcer:
            assert seq[seq.index(S.TEAR_DOWN_PEERS) + 1] == S.STOP_WATCHING_FOLDERS, why
        if p.stop_line and p.print_summary:
            summary = S.WRITE_SUMMARY if S.WRITE_SUMMARY in seq else S.WRITE_SUMMARY_BELOW_TRACEBACK
            assert before(seq, summary, S.SAY_STOP_LINE), why
        assert (S.START_HOOK in seq) == (S.FINISH_HOOK in seq) == (p.write_report and s.on_verdict), why
        if S.START_HOOK in seq:
            assert seq.count(S.START_HOOK) == 1 and before(seq, S.START_HOOK, S.FINISH_HOOK), why
            if not p.stay and not (s.ends_workers_early and p.write_report):
                assert seq[-3:] == (S.START_HOOK, S.FINISH_HOOK, S.EXIT), why  # the hook last
        if S.SAY_STOP_LINE in seq and S.LET_LAUNCHER_SEE in seq:
            assert before(seq, S.SAY_STOP_LINE, S.LET_LAUNCHER_SEE), why


def test_in_every_situation_the_report_is_written_before_the_hook_starts() -> None:
    """docs/configuration.md: on_verdict runs "once the report is written". Before, a hang, a
    lost host or a missing rank under torchrun or mp.spawn started the hook before any report."""
    for s in _every_situation():
        seq = steps(plan(s))
        if S.START_HOOK in seq:
            written = [i for i, x in enumerate(seq) if x in REPORTS]
            assert written and written[0] < seq.index(S.START_HOOK), f"{s}: {[x.name for x in seq]}"


def test_every_step_has_its_carrying_out() -> None:
    from peerwatch import executor

    assert set(executor._STEPS) == set(S)


@pytest.mark.parametrize("cause", [HANG, LOST, MISSING])
def test_under_torchrun_the_writer_of_a_hang_writes_the_report_before_the_early_hook_and_the_summary_after_its_dumps(
    cause: str,
) -> None:
    p = plan(situation(cause=cause, wrote_verdict=True, ends_workers_early=True, on_verdict=True))
    assert p.after_ack[:8] == (
        S.ARM_LAST_RESORT, S.FINAL_HEARTBEAT, S.TELL_LAUNCHERS, S.WRITE_REPORT, S.START_HOOK, S.DUMP_STACKS,
        S.DUMP_FLIGHT_RECORDER, S.WRITE_SUMMARY,
    )
    # Without a hook to start, the report waits for the summary after the dumps (one write fewer).
    quiet = plan(situation(cause=cause, wrote_verdict=True, ends_workers_early=True))
    assert quiet.after_ack[:6] == (
        S.ARM_LAST_RESORT, S.FINAL_HEARTBEAT, S.TELL_LAUNCHERS, S.DUMP_STACKS, S.DUMP_FLIGHT_RECORDER, S.WRITE_SUMMARY,
    )


def test_ranks_waiting_for_the_summary_look_for_it_less_often_the_more_they_are():
    """Rule: who reports. Up to 8 local ranks look every 10 ms; 128 look every 160 ms (their
    looks together cost the host what 8 ranks' do: 127 ranks looking every 10 ms starved the
    rank writing the summary and held a 128-rank teardown up by half)."""
    from peerwatch.verdict.plan import summary_poll_s

    assert (SUMMARY_POLL_S, SUMMARY_POLL_RANKS) == (0.01, 8)  # docs/performance.md
    assert summary_poll_s(1) == summary_poll_s(8) == pytest.approx(0.01)
    assert summary_poll_s(16) == pytest.approx(0.02) and summary_poll_s(128) == pytest.approx(0.16)
    assert plan(situation(live_local_ranks=tuple(range(128)))).summary_poll_s == pytest.approx(0.16)
    assert plan(situation(live_local_ranks=(0, 1, 2))).summary_poll_s == pytest.approx(0.01)
