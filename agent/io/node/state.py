"""What a node holds: ``ServedRange`` (one range instance: its worker, sessions, queue and
counts) and ``NodeState``, the attributes every part of ``agent.io.node.agent.Node`` shares
(declared here, set by ``Node.__init__``) with the lookups of a held range.

Clocks: session leases, sweeps, batch windows and heartbeat intervals run on trio's clock
(``clock_ms``, ``trio.current_time``), so a test's ``MockClock`` drives them; admissions and
fingerprints carry unix times (``unix_ms``: the tracker signs them) and are checked against the
wall clock.

Must not import the node's mixins (``tracker_link``, ``pushes``, ``batches``, ``ranges``,
``data_plane``, ``sessions``, ``handlers``) or ``agent``: they all build on this module.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import cast

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent._proto import swarm_pb2, worker_pb2
from agent.core.node.kept_rows import KeptStore
from agent.core.node.policy import BatchPeers, check_session_owner
from agent.core.node.range_states import RangeBook, RangeEntry, RangeKey, range_name
from agent.core.node.scheduler import StepScheduler
from agent.core.node.sessions import NodeSession, SessionTable
from agent.core.wire.admission import AdmissionVerifier
from agent.core.wire.step_validation import RangeSpec, StepInput
from agent.core.wire.swarm_wire import (
    SESSION_ID_BYTES,
    STEP_PROTOCOL,
    WireError,
    request_limits,
    step_request_bytes,
)
from agent.core.wire.worker_records import WorkerHealth, WorkerInfo
from agent.io.net.request_gate import RequestGate
from agent.io.net.transport import ImmediateHandler, Transport
from agent.io.worker.client import AsyncWorkerClient
from agent.io.worker.process import WorkerHandle

from .config import LocalModel, NodeConfig, OutputsFilter
from .fetch import FetchProgress

log = logging.getLogger(__name__)

__all__ = ["NodeState", "ServedRange", "clock_ms", "unbind_request", "unix_ms"]

Code = swarm_pb2.Error.Code
State = swarm_pb2.AssignmentStatus.State


@dataclasses.dataclass(eq=False)
class ServedRange:
    """One range instance on this node (its lifecycle: ``entry``, kept by the node's
    ``agent.core.node.range_states.RangeBook``) and, once READY, its worker, sessions and queue.

    Read-only for anyone but the node (tests observe ``state``, ``forward_calls``, ...).
    """

    entry: RangeEntry
    model: LocalModel | None
    info: WorkerInfo | None = None
    handle: WorkerHandle | None = None
    spec: RangeSpec | None = None
    sessions: SessionTable | None = None
    kept: KeptStore | None = None  # output rows pushed downstream, per session
    scheduler: StepScheduler[tuple[int, StepInput]] | None = None
    fetch_progress: FetchProgress | None = None  # while its bytes are being fetched
    forward_calls: int = 0  # Forwards this node sent to the worker
    entries_forwarded: int = 0
    forward_compute_us: int = 0  # their time as the worker measured it (ForwardTiming)
    forward_call_us: int = 0  # and as this node measured the calls
    #: the worker's HealthReply, read before each heartbeat: its data plane Forwards, which the
    #: heartbeat counts with the node's own (their call time is their compute time), and its
    #: prefix cache's counters
    worker_health: WorkerHealth | None = None
    largest_batch: int = 0
    #: the batch in the worker's Forward right now: its steps are owed an error if the range
    #: stops (UNLOAD, the worker dies) before their outputs are pushed
    in_forward: list[tuple[int, StepInput]] = dataclasses.field(default_factory=list)
    cancel_scope: trio.CancelScope = dataclasses.field(default_factory=trio.CancelScope)
    wakeup: trio.Event = dataclasses.field(default_factory=trio.Event)
    #: while a first hop gathers a decode group: decode steps still to arrive before the group
    #: can be whole (``gather_arrivals_needed``), which are queued without waking the task
    quiet_decode_arrivals: int = 0
    stopped: trio.Event = dataclasses.field(default_factory=trio.Event)
    forward_done: trio.Event = dataclasses.field(default_factory=trio.Event)  # set (and renewed) after each Forward

    @property
    def key(self) -> RangeKey:
        return self.entry.key

    @property
    def state(self) -> int:
        return self.entry.state

    @property
    def error(self) -> str:
        return self.entry.error

    @property
    def client(self) -> AsyncWorkerClient | None:
        return None if self.handle is None else self.handle.client

    def status(self) -> swarm_pb2.AssignmentStatus:
        state, error = self.state, self.error
        model_sha256, begin, end = self.key
        health = self.worker_health
        status = swarm_pb2.AssignmentStatus(
            assignment=swarm_pb2.Assignment(model_sha256=model_sha256, begin=begin, end=end),
            state=cast(State, state),  # protoc's .pyi takes named values only; proto3 enums are open
            error=error,
            recipe_hash=self.entry.recipe_hash if state == State.READY else "",
            sequences_in_use=0 if self.sessions is None else self.sessions.n_seq_max - self.sessions.free_count,
            sequences_total=0 if self.sessions is None else self.sessions.n_seq_max,
            n_ctx_per_sequence=0 if self.sessions is None else self.sessions.n_ctx_per_sequence,
            fetched_bytes=0 if self.fetch_progress is None else self.fetch_progress.done_bytes,
            fetch_total_bytes=0 if self.fetch_progress is None else self.fetch_progress.total_bytes,
            fetch_bytes_per_s=0.0 if self.fetch_progress is None else self.fetch_progress.bytes_per_s,
            sessions_started=0 if self.sessions is None else self.sessions.started,
            forward_calls=self.forward_calls + (0 if health is None else health.data_plane_forwards),
            forward_steps=self.entries_forwarded + (0 if health is None else health.data_plane_steps),
            forward_compute_us=self.forward_compute_us + self._data_plane_compute_us,
            forward_call_us=self.forward_call_us + self._data_plane_compute_us,
            sessions_resumed=0 if self.sessions is None else self.sessions.resumed,
            sessions_rebuilt=0 if self.sessions is None else self.sessions.rebuilt,
            data_port=self.info.data_port if state == State.READY and self.info is not None else 0,
        )
        if state == State.READY and health is not None and self.info is not None and self.info.prefix_cache_bytes:
            status.prefix_lookups = health.prefix_lookups
            status.prefix_hits = health.prefix_hits
            status.prefix_hit_positions = health.prefix_hit_positions
            status.prefix_cache_bytes = self.info.prefix_cache_bytes
            status.prefix_cache_used_bytes = self.info.prefix_cache_bytes_of(health.prefix_positions)
        return status

    @property
    def _data_plane_compute_us(self) -> int:
        return 0 if self.worker_health is None else self.worker_health.data_plane_compute_us

    def end_session(self, session_id: bytes) -> NodeSession | None:
        """Forget ``session_id`` here (its sequence closes, its queued steps and kept rows
        go); the ended session, or None when this range did not hold it."""
        if self.sessions is None or self.scheduler is None:
            return None
        ended = self.sessions.end(session_id)
        if self.kept is not None:
            self.kept.forget(session_id)
        if ended is None:
            return None
        self.scheduler.drop_session(ended.seq_id)
        self.wakeup.set()
        return ended


def unix_ms() -> int:
    """Wall-clock ms: admissions and fingerprints carry the tracker's and node's unix times.
    Everything else of the node (session leases, sweeps, batch windows, heartbeat intervals)
    runs on trio's clock, so a test's MockClock drives it."""
    return time.time_ns() // 1_000_000


def unbind_request(session_id: bytes, *, keep_bound: bool = False) -> worker_pb2.UnbindSessionRequest:
    return worker_pb2.UnbindSessionRequest(schema_version=1, session_id=session_id, keep_bound=keep_bound)


def clock_ms() -> int:
    return int(trio.current_time() * 1000)


class NodeState:
    """The state of a node that its parts (the mixins ``agent.io.node.agent.Node`` is made of)
    share: declared here, set by ``Node.__init__``; plus the lookups of the ranges it holds."""

    config: NodeConfig
    key: Ed25519PrivateKey  # config.key, checked present
    transport: Transport
    peer_id: str
    tracker_peer_id: str
    tracker_public_key: bytes
    #: the current ``SignedAdmission``, sent with every step and request
    admission: swarm_pb2.SignedAdmission
    heartbeat_interval_ms: int
    models: dict[str, LocalModel]
    book: RangeBook
    sweeps: int
    host_marker: str | None
    registrations: int
    heartbeats: int
    handle_step: ImmediateHandler
    handle_steps: ImmediateHandler
    #: ``/baton/node/1.0.0`` (``agent.io.node.handlers.RequestHandlers.handle_node``): a hop that
    #: this node runs too is sent its messages here
    handle_node: Callable[[str, bytes], Awaitable[bytes]]
    _keep_relay_reservation: Callable[[str], Awaitable[object]] | None
    _sender_admissions: AdmissionVerifier
    _batch_peers: BatchPeers
    _request_soon: Callable[..., bool]
    _instances: dict[tuple[RangeKey, int], ServedRange]
    _fetch_locks: dict[str, trio.Lock]
    _heartbeat_wakeup: trio.Event
    _next_hops: dict[str, tuple[float, list[swarm_pb2.NodeEntry]]]
    _outputs_filter: OutputsFilter | None
    _request_gate: RequestGate | None

    def sender_admitted(self, peer_id: str) -> bool:
        """Whether ``peer_id`` has shown this node an admission that has not expired."""
        return self._sender_admissions.admitted(peer_id, unix_ms())

    def allow_steps_of(self, spec: RangeSpec) -> None:
        """Let the transport take steps as big as ``spec``'s range takes (before it is READY)."""
        gate = self._request_gate
        if gate is None:
            return
        step_bytes = step_request_bytes(spec.boundary_schema.row_values, spec.n_batch_max)
        if step_bytes > gate.limits.max_request_bytes(STEP_PROTOCOL, admitted=True):
            gate.limits = request_limits(gate.limits.default_bytes, step_bytes=step_bytes)
            log.info("steps of up to %d bytes taken (%s)", gate.limits.max_request_bytes(STEP_PROTOCOL, admitted=True),
                     spec.model_sha256[:12])  # fmt: skip

    def _held(self, key: RangeKey) -> ServedRange | None:
        """The instance of ``key`` this node holds now (the hot path's ``ranges.get``)."""
        entry = self.book.entry(key)
        return None if entry is None else self._instances.get((key, entry.epoch))

    @property
    def ranges(self) -> dict[RangeKey, ServedRange]:
        """The ranges this node holds now (loading, serving or failed), by range."""
        held = {}
        for entry in self.book:
            served = self._instances.get((entry.key, entry.epoch))
            if served is not None:
                held[entry.key] = served
        return held

    def _session_range(self, session_id: bytes, model_sha256: str, begin: int, end: int) -> ServedRange:
        if len(session_id) != SESSION_ID_BYTES:
            raise WireError(
                Code.INVALID_ARGUMENT, f"session_id has {len(session_id)} bytes, expected {SESSION_ID_BYTES}"
            )
        key: RangeKey = (model_sha256, begin, end)
        served = self._held(key)
        if served is None or served.state != State.READY or served.sessions is None or served.client is None:
            raise WireError(Code.NOT_FOUND, f"this node does not serve {range_name(key)} READY")
        return served

    @staticmethod
    def _owner_only(served: ServedRange, session_id: bytes, remote_peer_id: str, role: int) -> None:
        assert served.sessions is not None
        session = served.sessions.get(session_id)
        check_session_owner(
            role, remote_peer_id, session_id, None if session is None else session.owner_peer_id, served.key
        )
