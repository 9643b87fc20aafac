"""A node's rules about who may send what, and what a failure makes of a step.

Owns, for ``agent.io.node.agent``:
- the sender rules of ``/baton/step``: a client (ROLE_CLIENT admission) may send only steps of
  its own sessions (owner = the sender), and only to a route's first hop (begin 0; the later
  hops take boundary rows from admitted nodes); nodes forward steps of any owner;
- the owner rules of ``/baton/node``: a client may end only sessions it owns (nodes forward
  ends along a route); only the owner, as a client, may resume or replay its session;
- which of a Forward's outputs travel together: the steps going on to the same next hop, in
  one ``StepBatch`` (``push_groups``), and which next hops get single pushes instead
  (``BatchPeers``: a peer from before ``/baton/steps``);
- the failure policy: who a failed step names as the failed peer and with which code. A worker
  Forward that fails names this node and ends the batch's sessions here (their positions on
  the worker are unknown now: a later step could not continue them correctly); a push the next
  hop did not take names the next hop (unreachable or a bad answer: UNAVAILABLE; a refusal:
  the code it refused with, so "busy" stays RESOURCE_EXHAUSTED and is not a dead hop).

Pure: no I/O, no clock. Must not import trio, grpc, libp2p or agent.io.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

from agent._proto import swarm_pb2
from agent.core.node import scheduler
from agent.core.node.range_states import RangeKey, range_name
from agent.core.wire.swarm_wire import WireError, WorkerCall, worker_error_code

__all__ = [
    "MAX_DATA_PLANE_DECODE_GROUPS",
    "NO_BATCHES_MS",
    "BatchPeers",
    "StepFailure",
    "check_end_session_sender",
    "check_session_owner",
    "check_step_sender",
    "data_plane_decode_groups",
    "data_plane_gather_us",
    "forward_failure",
    "push_answered_badly",
    "push_groups",
    "push_refused",
    "push_unreachable",
    "range_not_ready",
    "sequence_not_held",
    "worker_call_failed",
]

Code = swarm_pb2.Error.Code
State = swarm_pb2.AssignmentStatus.State


def check_step_sender(role: int, remote_peer_id: str, begin: int, end: int, owner_peer_id: str) -> None:
    """Raises WireError(REFUSED) when the sender may not send this step."""
    if role != swarm_pb2.ROLE_CLIENT:
        return
    if begin != 0:
        raise WireError(
            Code.REFUSED, f"a client may only send steps to the first hop (begin 0), not to blocks [{begin}, {end})"
        )
    if owner_peer_id != remote_peer_id:
        raise WireError(Code.REFUSED, f"a client may only send steps of its own sessions (owner is {owner_peer_id!r})")


def check_end_session_sender(role: int, remote_peer_id: str, session_id: bytes, owners: list[str]) -> None:
    """``owners``: the owner of the session in each range here that holds it. Raises
    WireError(REFUSED) when a client ends a session it does not own."""
    if role != swarm_pb2.ROLE_CLIENT:
        return
    for owner in owners:
        if owner != remote_peer_id:
            raise WireError(Code.REFUSED, f"session {session_id.hex()} belongs to {owner}")


def check_session_owner(
    role: int, remote_peer_id: str, session_id: bytes, owner_peer_id: str | None, key: RangeKey
) -> None:
    """A resume or replay of a session comes from its owner, as a client. Raises WireError:
    NOT_FOUND (``owner_peer_id`` None: the range does not hold it) or REFUSED."""
    if owner_peer_id is None:
        raise WireError(Code.NOT_FOUND, f"unknown session {session_id.hex()} in {range_name(key)}")
    if role != swarm_pb2.ROLE_CLIENT or owner_peer_id != remote_peer_id:
        raise WireError(Code.REFUSED, f"session {session_id.hex()} belongs to {owner_peer_id}")


def range_not_ready(key: RangeKey, state: int | None) -> WireError:
    """The error for a step to a range this node does not serve READY (``state`` None: not
    held at all)."""
    if state is None:
        return WireError(Code.NOT_FOUND, f"this node does not serve {range_name(key)}")
    return WireError(Code.UNAVAILABLE, f"{range_name(key)} is {State.Name(state)} on this node, not READY")


@dataclasses.dataclass(frozen=True)
class StepFailure:
    """What the owner is told about a step that failed after its ack, and whether the
    session ends on this range."""

    code: int
    message: str
    failed_peer_id: str
    end_session: bool = False


def data_plane_gather_us(*, begin: int, decode_groups: int | None, decode_gather_ms: float) -> int:
    """The lock-step hold a range's worker applies to a session on its data plane
    (``BindSessionRequest.decode_gather_us``; 0: none): a first hop (``begin`` 0) of a node
    that keeps one decode group (``decode_groups`` 1) with a gather window holds each decode
    Forward until every decoding session's step waits, at most the window, as
    ``agent.core.node.scheduler.gather_wait_ms`` does for steps through the node."""
    if begin != 0 or decode_groups != 1 or decode_gather_ms <= 0:
        return 0
    return round(decode_gather_ms * 1000)


#: the most decode groups a worker takes (native/src/data_plane.h kMaxDecodeGroups): an owner
#: names its route's length, so "auto" (route hops + 1) is bounded by this
MAX_DATA_PLANE_DECODE_GROUPS = 64


def data_plane_decode_groups(*, begin: int, route_hops: int, decode_groups: int | None) -> int:
    """The decode groups a range's worker keeps for a session on its data plane
    (``BindSessionRequest.decode_groups``; 0: none): a first hop (``begin`` 0) splits its
    decoding sessions' steps into ``agent.core.node.scheduler.decode_groups`` groups, as it does for
    steps through the node, so that on a route of S machines the groups are at different hops
    at once. One group is lock-step, which the worker's hold does instead
    (``data_plane_gather_us``)."""
    if begin != 0:
        return 0
    groups = scheduler.decode_groups(route_hops, decode_groups)
    return 0 if groups <= 1 else min(groups, MAX_DATA_PLANE_DECODE_GROUPS)


def forward_failure(code_name: str, detail: str, peer_id: str) -> StepFailure:
    """A worker Forward failed (``code_name``: the worker's status name, "" when unknown)."""
    return StepFailure(worker_error_code(code_name), f"worker Forward failed: {detail}", peer_id, end_session=True)


def worker_call_failed(code_name: str, call: WorkerCall, message: str) -> WireError:
    """The node's answer when a worker ``call`` it made for a request failed with gRPC status
    ``code_name`` (``agent.core.wire.swarm_wire.worker_error_code`` picks the code)."""
    return WireError(worker_error_code(code_name, call), message)


def sequence_not_held(code_name: str) -> bool:
    """Whether a worker's refusal to free a sequence (gRPC status ``code_name``) means it
    holds nothing there (INVALID_ARGUMENT: an unknown sequence), so the sequence may be reused."""
    return code_name == "INVALID_ARGUMENT"


def push_unreachable(hop_peer_id: str, detail: str) -> StepFailure:
    return StepFailure(Code.UNAVAILABLE, f"next hop {hop_peer_id} unreachable: {detail}", hop_peer_id)


def push_answered_badly(hop_peer_id: str, detail: str) -> StepFailure:
    return StepFailure(Code.UNAVAILABLE, f"next hop {hop_peer_id} answered badly: {detail}", hop_peer_id)


def push_refused(hop_peer_id: str, code: int, message: str) -> StepFailure:
    return StepFailure(code, f"next hop {hop_peer_id} refused the step: {message}", hop_peer_id)


def push_groups(next_hops: Sequence[Hashable | None]) -> list[list[int]]:
    """The pushes of one Forward's outputs, as index groups in order of first appearance:
    ``next_hops[i]`` names where output ``i`` goes on to (the node passes the next hop's peer id
    and addresses: steps of different owners may name one peer at different addresses, and a
    batch is sent to one of them), or None when it goes back to its owner (a last range's
    result, one message per owner and step). Outputs for the same next hop form one group,
    sent as one ``StepBatch`` when it has more than one step, so that they reach that hop
    together and share its next Forward; every other output is a group of one.
    """
    groups: list[list[int]] = []
    by_hop: dict[Hashable, list[int]] = {}
    for i, hop in enumerate(next_hops):
        if hop is None:
            groups.append([i])
        elif hop in by_hop:
            by_hop[hop].append(i)
        else:
            by_hop[hop] = [i]
            groups.append(by_hop[hop])
    return groups


#: how long a next hop that failed a StepBatch but took the same steps one by one (a peer from
#: before /baton/steps) gets single pushes before a batch is tried again (it may have upgraded)
NO_BATCHES_MS = 60_000


class BatchPeers:
    """Which next hops are sent a ``StepBatch``. A failed batch is sent again step by step (not
    knowing ``/baton/steps`` reads differently on each transport); a hop that then takes every
    step does not take batches, and gets single pushes for ``hold_ms``. Times are the caller's
    clock in ms."""

    def __init__(self, hold_ms: int = NO_BATCHES_MS) -> None:
        if hold_ms < 0:
            raise ValueError(f"hold_ms must be >= 0, got {hold_ms}")
        self.hold_ms = hold_ms
        self._single_until_ms: dict[str, int] = {}

    def batches_to(self, peer_id: str, now_ms: int) -> bool:
        """True when several steps for ``peer_id`` go out as one ``StepBatch``."""
        until = self._single_until_ms.get(peer_id)
        if until is None:
            return True
        if now_ms >= until:
            del self._single_until_ms[peer_id]  # try a batch again
            return True
        return False

    def batch_failed(self, peer_id: str, *, took_every_step_singly: bool, now_ms: int) -> None:
        """A batch to ``peer_id`` failed and its steps were sent one by one; when the hop took
        them all, it is a peer without batches."""
        if took_every_step_singly:
            self._single_until_ms[peer_id] = now_ms + self.hold_ms
