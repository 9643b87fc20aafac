"""What the tracker makes of one node's heartbeat: its report checked, and the directives back.

Owns, for ``agent.io.tracker.service`` (which stores the report and sends the reply):
- the report's validation: every status names a model range (``end > begin``) in a state a
  node reports (LOADING, READY, FAILED), with a recipe hash that is a printable token; at most
  ``MAX_REPORTED_RANGES`` of them and ``swarm_wire.MAX_LISTEN_ADDRS`` printable addresses (``check_listen_addrs``); otherwise the
  whole heartbeat is refused with INVALID_ARGUMENT naming the entry. A node's error text is
  kept, shortened and with its control characters escaped (``swarm_wire.printable``): it is
  shown in ``baton tracker nodes`` and logged, where escapes would clear screens and forge lines;
- which models the node newly FAILED to load (not assigned to it again until it registers
  anew: each of them recomputes the assignment);
- the assignments it holds here but did not report (not loaded: e.g. the node restarted):
  their stored state is cleared;
- the LOAD/UNLOAD diff: LOAD every range assigned and not reported, UNLOAD every range
  reported and not assigned, in range order;
- the ranges READY with a recipe that are assigned (what the canary schedule checks);
- whether the node's admission is refreshed now (less than half its lifetime left);
- the prefix tags each of its ranges holds (``read_prefixes``: at most ``MAX_REPORTED_RANGES``
  ranges of at most ``swarm_wire.MAX_PREFIX_TAGS`` tags, else INVALID_ARGUMENT naming the entry), kept for
  routes only (``agent.core.tracker.routing.RoutePrefix``).

Pure: ``now_ms`` comes in. Must not import trio, grpc, libp2p or agent.io.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from agent._proto import swarm_pb2
from agent.core.tracker.assignment import Assignment
from agent.core.wire.swarm_wire import MAX_PREFIX_TAGS, WireError, printable

__all__ = [
    "MAX_ERROR_CHARS",
    "MAX_REPORTED_RANGES",
    "AssignmentDiff",
    "Report",
    "admission_due",
    "diff_assignment",
    "read_prefixes",
    "read_report",
]

Code = swarm_pb2.Error.Code
State = swarm_pb2.AssignmentStatus.State
_REPORTED_STATES = (State.LOADING, State.READY, State.FAILED)

#: ranges one heartbeat may report (a node serves a few; the tracker keeps what it is told)
MAX_REPORTED_RANGES = 256
#: the error text kept of one range's status
MAX_ERROR_CHARS = 1024
#: a recipe hash is a digest's hex (compared, stored and shown)
MAX_RECIPE_CHARS = 128

#: (model sha256, begin, end) -> the prefix tags that range holds
RangePrefixTags = dict[tuple[str, int, int], frozenset[int]]


@dataclasses.dataclass(frozen=True)
class Report:
    reported: dict[Assignment, swarm_pb2.AssignmentStatus]
    newly_failed: frozenset[str]  # model sha256s this node newly reported FAILED
    serving: tuple[swarm_pb2.AssignmentStatus, ...] = ()  # the statuses as kept (error texts made printable)


def read_report(peer_id: str, serving: Sequence[swarm_pb2.AssignmentStatus], failed_models: Iterable[str]) -> Report:
    """Check what a heartbeat of ``peer_id`` reports serving; ``failed_models``: the models
    it already reported FAILED since it registered.

    Raises:
      WireError(INVALID_ARGUMENT): a status that is not a model range in a reportable state.
    """
    if len(serving) > MAX_REPORTED_RANGES:
        raise WireError(Code.INVALID_ARGUMENT, f"serving lists {len(serving)} ranges, over {MAX_REPORTED_RANGES}")
    reported: dict[Assignment, swarm_pb2.AssignmentStatus] = {}
    kept: list[swarm_pb2.AssignmentStatus] = []
    for i, status in enumerate(serving):
        recipe = status.recipe_hash
        if len(recipe) > MAX_RECIPE_CHARS or not (recipe.isascii() and recipe.isprintable()) or " " in recipe:
            raise WireError(
                Code.INVALID_ARGUMENT, f"serving[{i}]: recipe_hash {printable(recipe, 80)!r} is not a printable token"
            )
        clean = printable(status.error, MAX_ERROR_CHARS)
        if clean != status.error:
            copy = swarm_pb2.AssignmentStatus()
            copy.CopyFrom(status)
            copy.error = clean
            status = copy
        kept.append(status)
        a = status.assignment
        if not a.model_sha256 or a.end <= a.begin:
            raise WireError(
                Code.INVALID_ARGUMENT,
                f"serving[{i}]: assignment {a.model_sha256!r} [{a.begin}, {a.end}) is not a model range",
            )
        if status.state not in _REPORTED_STATES:
            raise WireError(
                Code.INVALID_ARGUMENT, f"serving[{i}]: state {status.state} is not LOADING, READY or FAILED"
            )
        reported[Assignment(a.model_sha256, a.begin, a.end, peer_id)] = status
    failed_now = frozenset(a.model_sha256 for a, s in reported.items() if s.state == State.FAILED)
    return Report(reported=reported, newly_failed=failed_now - set(failed_models), serving=tuple(kept))


def read_prefixes(prefixes: Sequence[swarm_pb2.RangePrefixes]) -> RangePrefixTags:
    """The prefix tags a heartbeat reports per range (ranges without tags left out).

    Raises:
      WireError(INVALID_ARGUMENT): too many ranges, or a range with too many tags.
    """
    if len(prefixes) > MAX_REPORTED_RANGES:
        raise WireError(Code.INVALID_ARGUMENT, f"prefixes lists {len(prefixes)} ranges, over {MAX_REPORTED_RANGES}")
    held: RangePrefixTags = {}
    for i, reported in enumerate(prefixes):
        if len(reported.tags) > MAX_PREFIX_TAGS:
            raise WireError(
                Code.INVALID_ARGUMENT, f"prefixes[{i}] has {len(reported.tags)} tags, over {MAX_PREFIX_TAGS}"
            )
        a = reported.assignment
        if reported.tags:
            held[(a.model_sha256, a.begin, a.end)] = frozenset(reported.tags)
    return held


@dataclasses.dataclass(frozen=True)
class AssignmentDiff:
    load: tuple[Assignment, ...]
    unload: tuple[Assignment, ...]
    unreported: tuple[Assignment, ...]  # assigned with a stored state, not reported: clear it
    ready: tuple[tuple[str, int, int], ...]  # assigned and READY with a recipe hash


def diff_assignment(
    reported: dict[Assignment, swarm_pb2.AssignmentStatus], assigned: Iterable[tuple[Assignment, bool]]
) -> AssignmentDiff:
    """The directives for a node from what it reported and what it is assigned now (each
    assignment with whether a state is stored for it), in range order."""
    assigned = list(assigned)
    should = {a for a, _stored in assigned}
    return AssignmentDiff(
        load=tuple(sorted(should - set(reported))),
        unload=tuple(sorted(set(reported) - should)),
        unreported=tuple(a for a, stored in assigned if stored and a not in reported),
        ready=tuple(
            (a.model_sha256, a.begin, a.end)
            for a, s in reported.items()
            if a in should and s.state == State.READY and s.recipe_hash
        ),
    )


def admission_due(expires_at_ms: int, now_ms: int, ttl_ms: int) -> bool:
    """Whether a node's admission is refreshed with this heartbeat's reply."""
    return expires_at_ms - now_ms < ttl_ms // 2
