"""The tracker's live state, the events that change it and the effects it asks of its shell:
the records of ``agent.core.tracker.reducer.apply(state, event, now_ms)``.

Owns the vocabulary of the tracker's reducer (docs/ARCHITECTURE.md, "The house"):
- ``TrackerState``: which nodes are alive, pending or suspect, what each admitted node can
  hold, the assignment with every range's reported state, the ranges withdrawn or failed,
  the models; what the last heartbeat of each node reported (live sessions, peer paths);
- events (``Registered``, ``Heartbeat``, ``Sweep``, ``PeerReported``, ``ProbeEnded``,
  ``RangeWithdrawn``, ``NodeRefused``, ``ModelsChanged``, ``Recompute``): what happened;
- effects (replies, store writes, probes, canary bookkeeping, logs): what the shell
  (``agent.io.tracker.service``) must do, in order.

Every record is frozen and every mapping in a state is built once and never mutated: an
update makes new mappings (``dataclasses.replace``), so a state a test or the shell holds is
a snapshot. (The protobuf messages a state holds, what heartbeats reported, are mutable
objects by nature: the reducer keeps them as received and never changes one; callers must
not either.) A heartbeat copies the per-node maps (O(nodes)), which at a heartbeat a second
from each of a few thousand nodes stays far below the store write the heartbeat makes anyway.

One time base: ``now_ms``, the tracker's clock (unix ms; the shell's follows trio's monotonic
clock from a wall-clock anchor, so it never steps back). Admission times, liveness deadlines,
when nodes were last heard (for route handouts) and nonce pruning all read it. (The canary
schedule keeps trio's seconds: its due times are the verifier's trio deadlines; it is not
part of this state.)

Pure: must not import trio, grpc, libp2p or agent.io.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from agent._proto import swarm_pb2
from agent.core.tracker.assignment import Assignment, ModelSpec
from agent.core.tracker.liveness import Liveness

__all__ = [
    "ClearStatus",
    "Directives",
    "Effect",
    "Event",
    "ForgetChecks",
    "Heartbeat",
    "LoadFailed",
    "Log",
    "MarkDead",
    "ModelsChanged",
    "NodeFacts",
    "NodeProven",
    "NodeRefused",
    "Notify",
    "PeerReported",
    "ProbeEnded",
    "ProbePeer",
    "PruneNonces",
    "RangeStatus",
    "RangeWithdrawn",
    "Recompute",
    "Refuse",
    "Registered",
    "ReportAnswered",
    "StoreAssignments",
    "StoreHeartbeat",
    "StoreStatus",
    "Sweep",
    "SyncChecks",
    "TrackerRules",
    "TrackerState",
]

State = swarm_pb2.AssignmentStatus


@dataclasses.dataclass(frozen=True)
class TrackerRules:
    """The settings the reducer decides with (``TrackerConfig``'s)."""

    heartbeat_timeout_ms: int
    #: nonces are pruned once per this long (a registration older than it is stale anyway)
    registration_max_age_ms: int
    #: how long a nonce is kept
    nonce_retention_ms: int
    #: a range assigned to a node must be READY within ``loading_base_ms`` plus its bytes at
    #: ``loading_min_bytes_per_s`` (from when it was assigned, or last stopped being READY), or
    #: it is taken back (a node that says LOADING for ever holds nothing); 0: no deadline
    loading_base_ms: int = 120_000
    loading_min_bytes_per_s: int = 1_000_000
    #: whether a node is proven only by a passed canary check (``NodeProven``); False: a READY
    #: report proves it (checks off or not gating routes)
    proven_needs_check: bool = False
    #: how long a dead node's READY ranges are kept for it: back within this, it gets them
    #: back from nodes still loading them
    former_memory_ms: int = 600_000


@dataclasses.dataclass(frozen=True)
class NodeFacts:
    """What an admitted node can hold, from its fingerprint (fixed until it registers anew)."""

    peer_id: str
    usable_memory_bytes: int
    decode_s_per_block: float
    model_sha256s: frozenset[str]  # the models it has on disk
    fetches_models: bool  # it fetches models the tracker can serve


@dataclasses.dataclass(frozen=True)
class RangeStatus:
    """What a node last reported for one of its assignments (STATE_UNSPECIFIED: nothing)."""

    state: int = State.STATE_UNSPECIFIED
    recipe_hash: str = ""

    @property
    def stored(self) -> bool:
        return bool(self.state or self.recipe_hash)


@dataclasses.dataclass(frozen=True)
class TrackerState:
    """The tracker's live state. Build the first one with ``agent.core.tracker.reducer.restore``.

    Fields:
      rules: the settings.
      liveness: alive, pending and dead nodes.
      nodes: every admitted node's facts (alive or not), by peer id.
      listen_addrs: peer -> where it listens (its registration's, or its last heartbeat's).
      models, fetchable: the registered models (with blocks), and those nodes may fetch.
      assignments: the assignment, each range with what its node last reported.
      failed: (peer, model) it reported FAILED to load: not assigned to it again until it
        registers anew (in memory: a tracker restart gives it another chance).
      withdrawn: (peer, model) whose output failed a canary check: not assigned, not routed,
        until it registers anew.
      suspects: peers an owner reported lost whose probe is under way (one at a time each).
      load_failures: peer -> what it reported FAILED since it registered, for operators.
      heard_at_ms: peer -> when its last heartbeat arrived (handed-out routes count until then).
      serving: peer -> what its last heartbeat reported (live sessions for routes).
      prefix_tags: peer -> (model, begin, end) -> the prefix tags its last heartbeat said that
        range's cache holds (routes prefer them; never stored).
      peer_paths: peer -> how its steps reached its peers, from its last heartbeat.
      seen_hosts: peer -> the IP address its registration or last heartbeat came from (routes
        name its addresses at that host first; binds send workers to that host only).
      loading_since_ms: assignment -> since when it has not been READY (assigned, or left
        READY): the loading deadline counts from there; absent while READY.
      proven: peers that served a range (READY, or a passed check when checks gate routes):
        gaps go to them before nodes that never did.
      former: READY ranges of nodes that died -> when: a node back within ``former_memory_ms``
        gets its range back from nodes that are still loading it.
      pruned_at_ms: when nonces were last pruned.
      recomputes: how many times the assignment was recomputed.
    """

    rules: TrackerRules
    liveness: Liveness
    nodes: Mapping[str, NodeFacts]
    listen_addrs: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    models: tuple[ModelSpec, ...] = ()
    fetchable: frozenset[str] = frozenset()
    assignments: Mapping[Assignment, RangeStatus] = dataclasses.field(default_factory=dict)
    failed: frozenset[tuple[str, str]] = frozenset()
    withdrawn: frozenset[tuple[str, str]] = frozenset()
    suspects: frozenset[str] = frozenset()
    load_failures: Mapping[str, tuple[swarm_pb2.AssignmentStatus, ...]] = dataclasses.field(default_factory=dict)
    heard_at_ms: Mapping[str, int] = dataclasses.field(default_factory=dict)
    serving: Mapping[str, tuple[swarm_pb2.AssignmentStatus, ...]] = dataclasses.field(default_factory=dict)
    prefix_tags: Mapping[str, Mapping[tuple[str, int, int], frozenset[int]]] = dataclasses.field(default_factory=dict)
    peer_paths: Mapping[str, tuple[swarm_pb2.PeerPath, ...]] = dataclasses.field(default_factory=dict)
    seen_hosts: Mapping[str, str] = dataclasses.field(default_factory=dict)
    loading_since_ms: Mapping[Assignment, int] = dataclasses.field(default_factory=dict)
    proven: frozenset[str] = frozenset()
    former: Mapping[Assignment, int] = dataclasses.field(default_factory=dict)
    pruned_at_ms: int = 0
    recomputes: int = 0


# --- events: what happened -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Registered:
    """A node was admitted (its record is stored): it has nothing loaded yet."""

    facts: NodeFacts
    listen_addrs: tuple[str, ...] = ()
    seen_host: str = ""  # the IP address it came from ("" unknown)


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """A heartbeat of an admitted node (its peer id, admission and refusal already checked).

    ``listen_addrs``: None when it names none (the stored ones stay)."""

    peer_id: str
    serving: tuple[swarm_pb2.AssignmentStatus, ...]
    peer_paths: tuple[swarm_pb2.PeerPath, ...] = ()
    listen_addrs: tuple[str, ...] | None = None
    prefixes: tuple[swarm_pb2.RangePrefixes, ...] = ()
    seen_host: str = ""  # the IP address it came from ("" unknown)


@dataclasses.dataclass(frozen=True)
class Sweep:
    """Time passed: nodes past their deadline die; nonces are pruned when due."""


@dataclasses.dataclass(frozen=True)
class PeerReported:
    """An owner (``reporter``) lost ``peer_id`` (a transport error or a silent hop)."""

    peer_id: str
    reporter: str
    reason: str


@dataclasses.dataclass(frozen=True)
class ProbeEnded:
    """The probe of a suspect ended: it ``answered``, or not (False: then it is dead), or it
    was cancelled (None: no verdict, the peer stays as it was)."""

    peer_id: str
    answered: bool | None
    reporter: str = ""
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class RangeWithdrawn:
    """A range of ``model_sha256`` on ``peer_id`` failed a canary check."""

    peer_id: str
    model_sha256: str


@dataclasses.dataclass(frozen=True)
class NodeRefused:
    """``peer_id`` failed ``failures`` checks and is refused (the refusal is stored)."""

    peer_id: str
    failures: int


@dataclasses.dataclass(frozen=True)
class NodeProven:
    """A range of ``peer_id`` passed a canary check."""

    peer_id: str


@dataclasses.dataclass(frozen=True)
class ModelsChanged:
    """The registered models, or which of them nodes may fetch, changed (counted at the next
    recompute)."""

    models: tuple[ModelSpec, ...]
    fetchable: frozenset[str]


@dataclasses.dataclass(frozen=True)
class Recompute:
    """Bring the assignment up to date (the tracker started)."""


Event = (
    Registered
    | Heartbeat
    | Sweep
    | PeerReported
    | ProbeEnded
    | RangeWithdrawn
    | NodeRefused
    | NodeProven
    | ModelsChanged
    | Recompute
)


# --- effects: what the shell does, in order ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Refuse:
    """Answer the request with this error (the state did not change)."""

    code: int
    message: str


@dataclasses.dataclass(frozen=True)
class Directives:
    """Answer a heartbeat: LOAD and UNLOAD these, in range order."""

    peer_id: str
    load: tuple[Assignment, ...]
    unload: tuple[Assignment, ...]


@dataclasses.dataclass(frozen=True)
class ReportAnswered:
    """Answer a lost-peer report at once: the peer is not live (``confirmed``: it is a known
    node marked dead)."""

    peer_id: str
    confirmed: bool
    detail: str


@dataclasses.dataclass(frozen=True)
class ProbePeer:
    """Probe ``peer_id`` (one probe per peer: later reports wait for its ``ProbeEnded``)."""

    peer_id: str


@dataclasses.dataclass(frozen=True)
class StoreHeartbeat:
    """Store: the node is alive, heard now, serving this (and listens there, if given)."""

    peer_id: str
    listen_addrs: tuple[str, ...] | None
    serving: tuple[swarm_pb2.AssignmentStatus, ...]


@dataclasses.dataclass(frozen=True)
class StoreStatus:
    """Store: what the node reports for one of its assignments."""

    assignment: Assignment
    state: int
    recipe_hash: str
    error: str


@dataclasses.dataclass(frozen=True)
class ClearStatus:
    """Store: forget every state ``peer_id`` reported (it registered anew: nothing loaded)."""

    peer_id: str


@dataclasses.dataclass(frozen=True)
class MarkDead:
    """Store: these nodes are dead (their states cleared); forget their checks; log ``why``."""

    peer_ids: tuple[str, ...]
    why: str


@dataclasses.dataclass(frozen=True)
class StoreAssignments:
    """Store: the assignment is exactly this now (rows that stay keep their status)."""

    assignments: tuple[Assignment, ...]


@dataclasses.dataclass(frozen=True)
class PruneNonces:
    """Store: forget nonces older than ``before_ms``."""

    before_ms: int


@dataclasses.dataclass(frozen=True)
class SyncChecks:
    """The canary schedule: ``peer_id`` serves these ranges READY (model, begin, end)."""

    peer_id: str
    ready: tuple[tuple[str, int, int], ...]


@dataclasses.dataclass(frozen=True)
class ForgetChecks:
    """The canary schedule: forget ``peer_id``'s ranges."""

    peer_id: str


@dataclasses.dataclass(frozen=True)
class LoadFailed:
    """A node newly reported FAILED to load a range (logged; kept for operators)."""

    peer_id: str
    status: swarm_pb2.AssignmentStatus


@dataclasses.dataclass(frozen=True)
class Log:
    """A line for operators (``level``: "info" or "warning")."""

    level: str
    message: str


@dataclasses.dataclass(frozen=True)
class Notify:
    """Wake whoever waits for a state change (tests, the sweeper, the verifier)."""


Effect = (
    Refuse
    | Directives
    | ReportAnswered
    | ProbePeer
    | StoreHeartbeat
    | StoreStatus
    | ClearStatus
    | MarkDead
    | StoreAssignments
    | PruneNonces
    | SyncChecks
    | ForgetChecks
    | LoadFailed
    | Log
    | Notify
)
