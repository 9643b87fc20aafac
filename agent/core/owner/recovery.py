"""The session owner's recovery rules: what a generation does after a step of one of its
sessions fails, and how long a step may take before the owner looks for a silent hop.

Owns the decisions ``agent.io.client.swarm.SwarmClient.generate_tokens`` and
``agent.io.client.steps.StepClient`` act on:
- whether a failed step may be *resumed* around the peer it names (``resumable``: a peer
  that is gone or silent, not a live peer's refusal);
- once a session has failed for good (``after_failure``): wait for a free sequence, end with
  the context full, give up as busy, fail, or replan a new route around the failed peer;
- a step's deadline (``step_deadline_s``, from the measured decode step time:
  ``decode_step_average``).

Pure: times come in as arguments (``now``, the measured step times). Must not import trio,
clocks or agent.io (the deadlines are read through the ``StepDeadlines`` Protocol, which
``agent.io.client.config.SwarmClientConfig`` satisfies).
"""

from __future__ import annotations

import enum
from typing import Protocol

from agent._proto import swarm_pb2

__all__ = [
    "AfterFailure",
    "StepDeadlines",
    "after_failure",
    "decode_step_average",
    "replan_left",
    "resumable",
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
