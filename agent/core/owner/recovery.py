"""The session owner's recovery rules: what a generation does after a step of one of its
sessions fails, and how long a step may take before the owner looks for a silent hop.

Owns the decisions ``agent.io.client.swarm.SwarmClient.generate_tokens`` and
``agent.io.client.steps.StepClient`` act on:
- the plan after a failed step (``on_failure(failure, now, budget) -> Resume | Replan |
  WaitFor | ContextFull | Fail``): *resume* the live session around the peer it names
  (``resumable``: a peer that is gone or silent, not a live peer's refusal, while a replan is
  left), or, once the session has failed for good (``after_failure``), wait for a free
  sequence (with its backoff), end with the context full, give up as busy, fail, or replan a
  new route around the failed peer;
- whom a first hop's answer to a step blames (``step_ack_failure``: the first hop, with the
  code it answered, or none when it was unreachable or its answer did not parse);
- a step's deadline (``step_deadline_s``, from the measured decode step time:
  ``decode_step_average``).

Pure: times come in as arguments (``now``, the measured step times). Must not import trio,
clocks or agent.io (the deadlines are read through the ``StepDeadlines`` Protocol, which
``agent.io.client.config.SwarmClientConfig`` satisfies).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Protocol

from google.protobuf.message import DecodeError

from agent._proto import swarm_pb2

__all__ = [
    "AfterFailure",
    "ContextFull",
    "Fail",
    "Failure",
    "Plan",
    "RecoveryBudget",
    "Replan",
    "Resume",
    "StepDeadlines",
    "StepFailed",
    "WaitFor",
    "after_failure",
    "decode_step_average",
    "on_failure",
    "replan_left",
    "resumable",
    "step_ack_failure",
    "step_deadline_s",
]


class AfterFailure(enum.Enum):
    """What a generation does once a session has failed (``after_failure``)."""

    #: every sequence of some range is in use at the first step: wait, then try any route
    WAIT_FOR_SEQUENCE = "wait_for_sequence"
    #: the context of the route's sequences is full: the generation ends there
    CONTEXT_FULL = "context_full"
    #: still no free sequence when the queue time ran out: the swarm is busy (not a failed hop)
    BUSY = "busy"
    #: no replan is left, or no peer was named: the failure is the generation's
    FAIL = "fail"
    #: one more replan: a new route around the failed peer, which joins the peers avoided
    REPLAN = "replan"
    #: a new route, the replan counted and the peer avoided already by the resume that failed
    REPLAN_AFTER_RESUME = "replan_after_resume"


def replan_left(replans: int, replan_attempts: int) -> bool:
    """Whether a generation that has replanned ``replans`` times may move to a new route again."""
    return replans < replan_attempts


def resumable(failed_peer_id: str, code: int) -> bool:
    """Whether a step that failed with ``code`` (a ``swarm_pb2.Error.Code``; 0: none, e.g. a
    timeout) naming ``failed_peer_id`` may be resumed with that peer replaced: a peer was named
    and it is gone or silent (nothing more waits on it), not a live peer's refusal."""
    return bool(failed_peer_id) and code in (0, swarm_pb2.Error.UNAVAILABLE)


def after_failure(
    *,
    code: int,
    step: int | None,
    failed_peer_id: str,
    resume_failed: bool,
    replans: int,
    replan_attempts: int,
    now: float,
    busy_until: float,
) -> AfterFailure:
    """What a generation does after a session failed with ``code`` at ``step`` (None: unknown),
    naming ``failed_peer_id`` ("" when nobody was named).

    ``resume_failed``: a resume around the failed peer was tried (so counted as a replan, the
    peer avoided) and failed. ``now`` / ``busy_until``: the owner's clock, and until when a
    generation waits for a free sequence (its queue timeout).
    """
    exhausted = code == swarm_pb2.Error.RESOURCE_EXHAUSTED
    if exhausted and step == 0 and now < busy_until:
        return AfterFailure.WAIT_FOR_SEQUENCE
    if exhausted and step:
        return AfterFailure.CONTEXT_FULL
    if exhausted:
        return AfterFailure.BUSY
    if resume_failed:
        return AfterFailure.REPLAN_AFTER_RESUME
    if not replan_left(replans, replan_attempts) or not failed_peer_id:
        return AfterFailure.FAIL
    return AfterFailure.REPLAN


@dataclasses.dataclass(frozen=True)
class Failure:
    """A session's failure as recovery sees it: ``code`` (a ``swarm_pb2.Error.Code``; 0: none,
    e.g. a timeout), the ``step`` (None: unknown) and the peer it names ("" : nobody)."""

    code: int
    step: int | None
    failed_peer_id: str


@dataclasses.dataclass(frozen=True)
class RecoveryBudget:
    """What a generation has left to recover with.

    Fields:
      replans, replan_attempts: replans used, and allowed.
      busy_until: until when (the owner's clock) it waits for a free sequence.
      busy_wait_s: the next wait for one; each wait doubles it, up to ``busy_wait_max_s``.
      session_alive: the failed session still runs (so it may be resumed in place).
      resume_failed: a resume around the failed peer was tried (its replan counted, the peer
        avoided) and failed.
    """

    replans: int
    replan_attempts: int
    busy_until: float
    busy_wait_s: float
    busy_wait_max_s: float = 1.0
    session_alive: bool = False
    resume_failed: bool = False


@dataclasses.dataclass(frozen=True)
class Resume:
    """Resume the live session with ``peer_id`` replaced (a replan spent, the peer avoided)."""

    peer_id: str


@dataclasses.dataclass(frozen=True)
class Replan:
    """A new route around ``peer_id``; ``count``: spend a replan and avoid the peer (False: the
    resume that failed did both already)."""

    peer_id: str
    count: bool


@dataclasses.dataclass(frozen=True)
class WaitFor:
    """No free sequence yet: wait ``delay_s``, then take any route; the next wait is
    ``next_delay_s``."""

    delay_s: float
    next_delay_s: float


@dataclasses.dataclass(frozen=True)
class ContextFull:
    """The context of the route's sequences is full: the generation ends there."""


@dataclasses.dataclass(frozen=True)
class Fail:
    """The failure is the generation's; ``busy``: no free sequence within the queue time (the
    swarm is busy, not a failed hop)."""

    busy: bool = False


Plan = Resume | Replan | WaitFor | ContextFull | Fail


def on_failure(failure: Failure, now: float, budget: RecoveryBudget) -> Plan:
    """What a generation does after ``failure`` at ``now`` (the owner's clock)."""
    if (
        budget.session_alive
        and resumable(failure.failed_peer_id, failure.code)
        and replan_left(budget.replans, budget.replan_attempts)
    ):
        return Resume(failure.failed_peer_id)
    then = after_failure(
        code=failure.code, step=failure.step, failed_peer_id=failure.failed_peer_id,
        resume_failed=budget.resume_failed and not budget.session_alive, replans=budget.replans,
        replan_attempts=budget.replan_attempts, now=now, busy_until=budget.busy_until,
    )  # fmt: skip
    if then is AfterFailure.WAIT_FOR_SEQUENCE:
        return WaitFor(budget.busy_wait_s, min(budget.busy_wait_s * 2, budget.busy_wait_max_s))
    if then is AfterFailure.CONTEXT_FULL:
        return ContextFull()
    if then is AfterFailure.REPLAN:
        return Replan(failure.failed_peer_id, count=True)
    if then is AfterFailure.REPLAN_AFTER_RESUME:
        return Replan(failure.failed_peer_id, count=False)
    return Fail(busy=then is AfterFailure.BUSY)


@dataclasses.dataclass(frozen=True)
class StepFailed:
    """A step the first hop did not take: why, and whom it blames."""

    message: str
    failed_peer_id: str
    step: int
    code: int = 0


def step_ack_failure(first_peer_id: str, step: int, ack: bytes, *, unreachable: str | None = None) -> StepFailed | None:
    """What the first hop's answer to ``step`` means (its ``StepAck`` bytes, or ``unreachable``:
    the transport error that ended the exchange): None when the hop took the step. The first
    hop is blamed either way: unreachable or answering what does not parse, it is gone or
    broken (code 0: resumable); refusing, it is alive, and its code says why."""
    if unreachable is not None:
        return StepFailed(f"step {step}: first hop unreachable: {unreachable}", first_peer_id, step)
    reply = swarm_pb2.StepAck()
    try:
        reply.ParseFromString(ack)
    except DecodeError:
        return StepFailed(f"step {step}: malformed StepAck from {first_peer_id}", first_peer_id, step)
    if reply.error.code == swarm_pb2.Error.CODE_UNSPECIFIED:
        return None
    try:
        name = swarm_pb2.Error.Code.Name(reply.error.code)
    except ValueError:
        name = f"code {reply.error.code}"
    return StepFailed(
        f"step {step}: first hop {first_peer_id} refused the step: {name}: {reply.error.message}",
        first_peer_id,
        step,
        reply.error.code,
    )


class StepDeadlines(Protocol):
    """The owner's step deadlines (``SwarmClientConfig``'s)."""

    @property
    def step_timeout_s(self) -> float: ...
    @property
    def probe_interval_s(self) -> float: ...
    @property
    def step_deadline_factor(self) -> float: ...
    @property
    def min_step_deadline_s(self) -> float: ...
    @property
    def min_data_plane_step_deadline_s(self) -> float: ...


def decode_step_average(average_s: float | None, elapsed_s: float) -> float:
    """The moving average of decode step time after a step that took ``elapsed_s`` (``average_s``
    None: none measured yet)."""
    return elapsed_s if average_s is None else 0.8 * average_s + 0.2 * elapsed_s


def step_deadline_s(
    deadlines: StepDeadlines, decode_step_s: float | None, *, prefill: bool, data_plane: bool = False
) -> float:
    """How long a step may take before the owner looks for a silent hop: a multiple of the
    measured decode step time ``decode_step_s`` (``step_deadline_factor``, at least
    ``min_step_deadline_s``, or ``min_data_plane_step_deadline_s`` for a step that goes worker
    to worker); a prefill (chunk), or a decode before anything was measured, ``probe_interval_s``
    (its time is unknown, so it is watched by probes rather than bounded). Never past
    ``step_timeout_s``."""
    if prefill or decode_step_s is None:
        return min(deadlines.probe_interval_s, deadlines.step_timeout_s)
    floor = deadlines.min_data_plane_step_deadline_s if data_plane else deadlines.min_step_deadline_s
    deadline = max(floor, deadlines.step_deadline_factor * decode_step_s)
    return min(deadline, deadlines.step_timeout_s)
