"""The verdict's executor (peerwatch.executor): it carries out the plan's steps in order, and
plans the steps after the acknowledgement again with its result (rule: the blind enforcer). The
steps themselves (each one call) are run for real by the end-to-end tests."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List

import pytest

from peerwatch import executor
from peerwatch.core.records import SIGNAL
from peerwatch.verdict.plan import Situation, Step, plan

pytestmark = pytest.mark.pure  # no process, no thread, no file: the steps are replaced by recorders

ENFORCER = Situation(
    self_rank=0, failed_rank=2, cause=SIGNAL, verdict_exit_code=137, own_exit_code=None, in_watch=False,
    live_local_ranks=(0, 1, 3), wrote_verdict=True, grace_s=5.0, ack_window_s=1.0, on_verdict=True,
)


def _run(monkeypatch: pytest.MonkeyPatch, s: Situation, ack_written: bool) -> tuple:
    done: List[Step] = []

    def recorder(step: Step) -> Callable[[Any], None]:
        def run(t: executor.Teardown) -> None:
            done.append(step)
            if step is Step.ACK:
                t.ack_written = ack_written

        return run

    monkeypatch.setattr(executor, "_STEPS", {step: recorder(step) for step in Step})
    none: Any = None
    t = executor.Teardown(
        on_verdict=None, on_verdict_timeout_s=0.0, run_dir=none, me=none, observer=none, stacks=none, flight_recorder=none, bridge=none,
        main_left=none, interrupt_installed=False, heartbeat=none, verdict=none, situation=s,
        plan=plan(s),
    )
    executor.carry_out(t)
    return tuple(done), t


def test_the_steps_are_carried_out_in_the_plans_order(monkeypatch: pytest.MonkeyPatch) -> None:
    done, t = _run(monkeypatch, ENFORCER, ack_written=True)
    p = plan(ENFORCER)
    assert done == p.until_ack + p.after_ack and t.plan == p
    assert t.acted > 0


def test_an_ack_that_could_not_be_written_makes_the_rest_of_the_plan_blind(monkeypatch: pytest.MonkeyPatch) -> None:
    done, t = _run(monkeypatch, ENFORCER, ack_written=False)
    blind = plan(dataclasses.replace(ENFORCER, ack_written=False))
    assert t.plan == blind and blind.blind
    assert done == plan(ENFORCER).until_ack + blind.after_ack
    assert done[done.index(Step.ACK) + 1] == Step.SAY_BLIND
