"""Integrity at the session owner: sampled spot checks of live traffic, and taking
back what a withdrawn peer computed.

Owns the owner's decisions:
- whether a session is spot-checked (``sample``: each with probability ``rate``), which hop
  the check routes around (``hop_to_avoid``), the shadow's ``StepRequest`` for each step of
  the session (``shadow_request``: the same rows at the same positions, through a route of the
  same recipe that avoids that hop), and whether the two results agree (``compare_results``:
  bit for bit, ``agent.core.tracker.canary.compare_scores``). Routes of one recipe give the unsplit
  model's bytes wherever they cut it, so any disagreement means a hop of one of them computed
  wrong; which one is for the tracker's canaries to say (the owner reports the mismatch);
- which tokens of a generation to take back when a peer its routes went through failed an
  integrity check (``rollback_point``): everything from the first session whose route held
  such a peer (its outputs cannot be told apart from honest ones after the fact).

Pure: protobuf records and numpy; the random generator comes in as an argument. Must not
import trio, grpc, libp2p, sockets, clocks or agent.io.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

from agent._proto import swarm_pb2
from agent.core.tracker.canary import OutputMismatch, compare_scores, scores_bytes
from agent.core.wire.step_results import result_scores

__all__ = [
    "RouteSegment",
    "compare_results",
    "hop_to_avoid",
    "result_digest",
    "rollback_point",
    "sample",
    "shadow_request",
]


def sample(rate: float, rng: np.random.Generator) -> bool:
    """Whether to spot-check one session (``rate`` in [0, 1])."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"a spot-check rate is in [0, 1], got {rate}")
    return rate > 0.0 and float(rng.random()) < rate


def hop_to_avoid(route: swarm_pb2.Route, rng: np.random.Generator) -> str:
    """The peer a spot check routes around: one hop of ``route``, drawn uniformly."""
    if not route.hops:
        raise ValueError("the route has no hops")
    return route.hops[int(rng.integers(0, len(route.hops)))].peer_id


def shadow_request(original: swarm_pb2.StepRequest, session_id: bytes, route: swarm_pb2.Route) -> swarm_pb2.StepRequest:
    """The shadow session's copy of ``original`` (a step to the first hop): the same rows,
    positions, step number and K, sent as session ``session_id`` along ``route``.

    Raises:
      ValueError: ``route`` has no hops, or is of another model or recipe than the step.
    """
    if not route.hops:
        raise ValueError("the shadow route has no hops")
    if route.model_sha256 != original.model_sha256 or route.recipe_hash != original.recipe_hash:
        raise ValueError("a shadow route must be of the step's model and recipe (only those agree bit for bit)")
    shadow = swarm_pb2.StepRequest()
    shadow.CopyFrom(original)
    first = route.hops[0]
    shadow.session_id = session_id
    shadow.begin, shadow.end = first.begin, first.end
    del shadow.rest[:]
    shadow.rest.extend(route.hops[1:])
    return shadow


def result_digest(result: swarm_pb2.StepResult) -> str:
    """sha256 hex of a successful result's scores (``agent.core.tracker.canary.scores_bytes``)."""
    return hashlib.sha256(scores_bytes(result_scores(result))).hexdigest()


def compare_results(step: int, original: swarm_pb2.StepResult, shadow: swarm_pb2.StepResult) -> OutputMismatch | None:
    """None when the shadow's result is the original's, bit for bit.

    Raises:
      ValueError: a result is malformed (``result_scores``): not a comparison.
    """
    return compare_scores(step, result_scores(original), result_scores(shadow))


@dataclasses.dataclass(frozen=True)
class RouteSegment:
    """One session of a generation: it began when the generation had ``first_token`` tokens
    and went through ``peers``."""

    first_token: int
    peers: frozenset[str]


def rollback_point(segments: Sequence[RouteSegment], withdrawn: Iterable[str]) -> int | None:
    """How many generated tokens to keep when ``withdrawn`` peers failed integrity checks:
    those before the first session whose route went through one of them (None: none did)."""
    bad = set(withdrawn)
    for segment in segments:
        if segment.peers & bad:
            return segment.first_token
    return None
