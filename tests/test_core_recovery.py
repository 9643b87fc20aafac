"""agent.core.owner.recovery: what a generation does after a failed session, which failures may be
resumed around the peer they name, and a step's deadline."""

from __future__ import annotations

import dataclasses

import pytest

from agent._proto import swarm_pb2
from agent.core.owner.recovery import (
    AfterFailure,
    ContextFull,
    Fail,
    Failure,
    RecoveryBudget,
    Replan,
    Resume,
    StepFailed,
    WaitFor,
    after_failure,
    decode_step_average,
    on_failure,
    replan_left,
    resumable,
    step_ack_failure,
    step_deadline_s,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

EXHAUSTED = swarm_pb2.Error.RESOURCE_EXHAUSTED


def decide(
    *,
    code: int = 0,
    step: int | None = 3,
    failed_peer_id: str = "b",
    resume_failed: bool = False,
    replans: int = 1,
    now: float = 10.0,
) -> AfterFailure:
    """``after_failure`` with three replans allowed and the queue open until time 20; by default
    a step-3 timeout naming peer "b", one replan used, at time 10."""
    return after_failure(
        code=code, step=step, failed_peer_id=failed_peer_id, resume_failed=resume_failed, replans=replans,
        replan_attempts=3, now=now, busy_until=20.0,
    )  # fmt: skip


def test_a_gone_or_silent_peer_may_be_resumed_around_a_refusal_may_not() -> None:
    assert resumable("b", 0) and resumable("b", swarm_pb2.Error.UNAVAILABLE)
    assert not resumable("", 0), "nobody named: nobody to replace"
    for code in (swarm_pb2.Error.REFUSED, swarm_pb2.Error.INVALID_ARGUMENT, EXHAUSTED, swarm_pb2.Error.INTERNAL):
        assert not resumable("b", code), code


def test_replans_are_bounded() -> None:
    assert replan_left(0, 1) and not replan_left(1, 1) and not replan_left(0, 0)


def test_no_free_sequence_at_the_first_step_waits_until_the_queue_timeout_then_is_busy() -> None:
    assert decide(code=EXHAUSTED, step=0) is AfterFailure.WAIT_FOR_SEQUENCE
    assert decide(code=EXHAUSTED, step=0, now=20.0) is AfterFailure.BUSY
    assert decide(code=EXHAUSTED, step=None) is AfterFailure.BUSY, "no step: not a full context"
    # busy is not a failed hop: no replan is spent, even with none left
    assert decide(code=EXHAUSTED, step=0, replans=3) is AfterFailure.WAIT_FOR_SEQUENCE


def test_resource_exhausted_after_the_first_step_is_a_full_context() -> None:
    assert decide(code=EXHAUSTED, step=1) is AfterFailure.CONTEXT_FULL
    assert decide(code=EXHAUSTED, step=7, now=99.0, replans=3) is AfterFailure.CONTEXT_FULL


def test_a_named_peer_is_replanned_around_while_replans_are_left() -> None:
    assert decide() is AfterFailure.REPLAN
    assert decide(code=swarm_pb2.Error.REFUSED) is AfterFailure.REPLAN
    assert decide(replans=3) is AfterFailure.FAIL
    assert decide(failed_peer_id="") is AfterFailure.FAIL, "nobody to route around"


def test_a_failed_resume_has_counted_its_replan_already() -> None:
    assert decide(resume_failed=True) is AfterFailure.REPLAN_AFTER_RESUME
    assert decide(resume_failed=True, replans=3) is AfterFailure.REPLAN_AFTER_RESUME


def plan(code: int = 0, step: int | None = 3, peer: str = "b", now: float = 10.0, **budget) -> object:
    """``on_failure`` with three replans allowed, one used, the queue open until time 20 and a
    first wait of 0.25 s; by default a step-3 timeout naming peer "b" at time 10."""
    fields = {"replans": 1, "replan_attempts": 3, "busy_until": 20.0, "busy_wait_s": 0.25} | budget
    return on_failure(Failure(code, step, peer), now, RecoveryBudget(**fields))


def test_the_plan_after_a_failure_resumes_replans_waits_ends_or_fails() -> None:
    assert plan(session_alive=True) == Resume("b")  # a silent hop of a live session: replaced in place
    assert plan(code=swarm_pb2.Error.UNAVAILABLE, session_alive=True) == Resume("b")
    # a live peer's refusal is not resumed: a new route around it
    assert plan(code=swarm_pb2.Error.REFUSED, session_alive=True) == Replan("b", count=True)
    assert plan(session_alive=True, replans=3) == Fail()  # no replan left for a resume either
    assert plan() == Replan("b", count=True)
    assert plan(resume_failed=True) == Replan("b", count=False)  # the resume counted it
    assert plan(peer="") == Fail()
    # no free sequence at the first step: wait, each wait twice the last, at most 1 s
    assert plan(code=EXHAUSTED, step=0) == WaitFor(0.25, 0.5)
    assert plan(code=EXHAUSTED, step=0, busy_wait_s=0.75) == WaitFor(0.75, 1.0)
    assert plan(code=EXHAUSTED, step=0, now=20.0) == Fail(busy=True)
    assert plan(code=EXHAUSTED, step=5, session_alive=True) == ContextFull()


def test_a_first_hop_that_does_not_take_a_step_is_blamed_with_the_code_it_answered() -> None:
    taken = swarm_pb2.StepAck(schema_version=1).SerializeToString()
    assert step_ack_failure("first", 4, taken) is None
    refused = swarm_pb2.StepAck(schema_version=1, error=swarm_pb2.Error(code=EXHAUSTED, message="no sequence"))
    assert step_ack_failure("first", 4, refused.SerializeToString()) == StepFailed(
        "step 4: first hop first refused the step: RESOURCE_EXHAUSTED: no sequence", "first", 4, EXHAUSTED
    )
    gone = step_ack_failure("first", 4, b"", unreachable="connection reset")
    assert gone == StepFailed("step 4: first hop unreachable: connection reset", "first", 4, 0)
    assert gone is not None and resumable(gone.failed_peer_id, gone.code)  # gone: resumed around
    garbled = step_ack_failure("first", 4, b"\xff\xff\xff")
    assert garbled is not None and (garbled.failed_peer_id, garbled.code) == ("first", 0)
    assert garbled.message == "step 4: malformed StepAck from first"


@dataclasses.dataclass(frozen=True)
class Deadlines:
    step_timeout_s: float = 30.0
    probe_interval_s: float = 1.0
    step_deadline_factor: float = 10.0
    min_step_deadline_s: float = 1.0
    min_data_plane_step_deadline_s: float = 0.25


def test_a_decode_step_deadline_is_a_multiple_of_the_measured_step_time() -> None:
    d = Deadlines()
    assert step_deadline_s(d, 0.5, prefill=False) == 5.0
    assert step_deadline_s(d, 0.01, prefill=False) == 1.0, "at least min_step_deadline_s"
    assert step_deadline_s(d, 0.01, prefill=False, data_plane=True) == pytest.approx(0.25)
    assert step_deadline_s(d, 0.05, prefill=False, data_plane=True) == pytest.approx(0.5)
    assert step_deadline_s(d, 10.0, prefill=False) == 30.0, "never past step_timeout_s"


def test_a_prefill_or_an_unmeasured_decode_is_watched_by_probes() -> None:
    d = Deadlines()
    assert step_deadline_s(d, 0.5, prefill=True) == 1.0
    assert step_deadline_s(d, None, prefill=False) == 1.0
    assert step_deadline_s(Deadlines(step_timeout_s=0.5), None, prefill=True) == 0.5


def test_the_decode_step_time_is_a_moving_average() -> None:
    assert decode_step_average(None, 0.1) == 0.1
    assert decode_step_average(0.1, 0.6) == pytest.approx(0.2)
