"""The node agent: a volunteer machine serving layer ranges to the swarm (``serve_node``).

Owns the I/O of one node:
- registration with the tracker (a signed fingerprint; refused -> ``NodeRefused``) and the
  heartbeat loop (status of every served range; directives and admission refreshes back;
  "unknown node" -> register again);
- directives: LOAD starts a native worker (``agent.io.worker_process.open_worker``) for
  (model, begin, end) and reports LOADING, then READY with the worker's recipe hash, or
  FAILED with the error; UNLOAD stops it;
- ``/baton/step/1.0.0``: check the sender's admission and role, validate the step, admit it
  into the range's session table, ack at once, and queue it;
- one serving task per worker: batches from the range's scheduler, ONE worker Forward per
  batch, then the output pushed on (next hop ``StepRequest``, or the owner's ``StepResult``
  from the last range); any failure after the ack goes to the owner as a ``StepResult`` error
  naming the failed peer;
- ``/baton/node/1.0.0``: tokenize / detokenize through a worker, end_session (frees the
  sequence, forwards the end along ``rest``); idle sessions are freed after a timeout;
- resuming a session whose route lost a hop: every output row a range pushes downstream is
  kept per session (``agent.core.kept_rows``, bounded in bytes); ``resume_session`` trims a
  surviving session back to the positions the owner keeps (its cache stays), ``replay`` sends
  the kept rows as rebuild steps to the replacement of the lost next hop, and a range that
  receives rebuild steps opens the session from them and answers the owner when rebuilt.

The shell only awaits and sends; every decision is made in the pure core:
``agent.core.node_ranges`` (the range lifecycle: directives, LOADING/READY/FAILED, what a
stopped range owes), ``agent.core.node_link`` (registration and heartbeat replies,
re-registration, retry backoff), ``agent.core.node_policy`` (sender and owner rules, the
failure policy), ``agent.core.swarm_wire`` and ``agent.core.step_*`` (codecs, validation), ``agent.core.scheduler``
(which steps form a batch), ``agent.core.node_sessions`` (sequence ids, step order, leases),
``agent.core.kept_rows``, ``agent.core.fingerprint`` and ``agent.core.admission``.

Clocks: session leases, sweeps, batch windows and heartbeat intervals run on trio's clock
(``trio.current_time``), so a test's ``MockClock`` drives them; admissions and fingerprints
carry unix times (the tracker signs them) and are checked against the wall clock.

Hot path: protobuf bytes -> ``np.frombuffer`` view -> worker client; worker output ->
``tobytes``; no per-element Python, one Forward per batch.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Protocol, cast

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent._proto import swarm_pb2, worker_pb2
from agent.core.admission import AdmissionError, AdmissionVerifier, public_key_bytes
from agent.core.batching import forward_key
from agent.core.boundary import BoundaryError
from agent.core.data_route import first_hop_refusal, next_hop_refusal
from agent.core.fingerprint import HostProbe, build_fingerprint, signed_fingerprint
from agent.core.identity import peer_id_from_public_key
from agent.core.kept_rows import KeptStore, RowsNotKept
from agent.core.manifest import ManifestError, verify_manifest
from agent.core.multiaddrs import circuit_multiaddr, peer_id_from_multiaddr, tcp_hosts
from agent.core.node_link import (
    RegistrationInvalid,
    RegistrationRefused,
    next_retry_delay_s,
    read_heartbeat_reply,
    read_registration_reply,
)
from agent.core.node_policy import (
    BatchPeers,
    StepFailure,
    check_end_session_sender,
    check_session_owner,
    check_step_sender,
    data_plane_decode_groups,
    data_plane_gather_us,
    forward_failure,
    push_answered_badly,
    push_groups,
    push_refused,
    push_unreachable,
    range_not_ready,
)
from agent.core.node_ranges import (
    Action,
    FailPending,
    HeartbeatNow,
    Ignored,
    RangeBook,
    RangeEntry,
    RangeKey,
    StartRange,
    StopRange,
    range_name,
)
from agent.core.node_sessions import NodeSession, SessionTable
from agent.core.scheduler import (
    StepScheduler,
    arrival_wakes_gatherer,
    batch_window_wait_ms,
    decode_mode,
    first_hop_decode,
    gather_arrivals_needed,
)
from agent.core.step_batch import (
    all_steps_taken,
    answer_step_batch,
    batch_ack_accepts,
    push_message,
    read_push_acks,
    step_batch_ack,
)
from agent.core.step_requests import encode_step_output, next_hop_request, replay_step_request
from agent.core.step_results import step_result, step_result_error, step_result_rebuilt, step_result_top
from agent.core.step_validation import RangeSpec, StepInput, check_hops, validate_step
from agent.core.swarm_wire import (
    NODE_PROTOCOL,
    RESULT_PROTOCOL,
    SCHEMA_VERSION,
    SESSION_ID_BYTES,
    STEP_PROTOCOL,
    STEPS_PROTOCOL,
    TRACKER_PROTOCOL,
    WireError,
    node_reply_error,
    parse_record,
    step_ack,
    step_ack_accepts,
    step_ack_error,
)
from agent.core.worker_records import SeqInput, SeqOutput, WorkerHealth, WorkerInfo
from agent.core.worker_wait import AUTO
from agent.io.local_host import is_this_host
from agent.io.transport import ImmediateHandler, Transport, TransportError
from agent.io.worker_client import AsyncWorkerClient, ClientConfig
from agent.io.worker_error import WorkerError
from agent.io.worker_process import (
    WorkerBinaryNotFound,
    WorkerHandle,
    WorkerStartError,
    open_node_marker,
    open_worker,
    wait_environment,
)
from agent.models import sha256_file

from .fetch import (
    FetchConfig,
    FetchError,
    FetchProgress,
    FetchRefused,
    ModelMismatch,
    fetch_range,
    model_file_path,
    verify_local_range,
)
from .probe import ProbeConfig, probe_host

__all__ = [
    "LocalModel",
    "Node",
    "NodeConfig",
    "NodeError",
    "NodeRefused",
    "OutputsFilter",
    "ServedRange",
    "serve_node",
]

log = logging.getLogger(__name__)

Code = swarm_pb2.Error.Code
State = swarm_pb2.AssignmentStatus.State
_READY = State.READY  # read on every step (an enum wrapper's attribute is a lookup)

#: Default heartbeat interval when the tracker names none.
DEFAULT_HEARTBEAT_INTERVAL_MS = 1000
#: How long a bind's next-hop check reuses the tracker's entry of that peer, seconds: binds
#: toward one hop come together (an entry that refuses is asked for again before the bind is
#: refused).
NODE_LIST_REUSE_S = 2.0


class OutputsFilter(Protocol):
    """A hook between a range's worker and its pushes, for tests: ``agent.testing.faulty``'s
    ``OutputCorrupter`` makes a node that computes wrong numbers, to show that the swarm's
    checks catch one (``python -m agent.testing.faulty_node``). A node serves with none
    (``serve_node``'s default); nothing in the product installs one.

    ``batch_formed`` is asked once as each batch is formed; every output of the batch then goes
    through ``apply`` before it is kept and pushed."""

    def batch_formed(self) -> bool:
        """True: this batch's outputs may be altered, so a last range asks its worker for whole
        logits rows (top-K 0) and pushes the top-K of the row ``apply`` returns."""
        ...

    def apply(self, step: StepInput, output: SeqOutput, *, altering: bool) -> SeqOutput:
        """The output pushed for ``step`` (``altering``: what ``batch_formed`` said for its
        batch)."""
        ...


@dataclasses.dataclass(frozen=True)
class LocalModel:
    """A GGUF file this node has, with its sha256 hex."""

    path: str
    sha256: str


@dataclasses.dataclass(frozen=True)
class NodeConfig:
    """Everything ``serve_node`` needs; every timeout and limit of the node is here.

    Fields:
      tracker: the tracker's multiaddr, ending ``/p2p/<tracker peer id>``.
      key: the node's Ed25519 key (the same key as its transport identity).
      models: the GGUF files this node has.
      memory_bytes: usable memory offered for weights + KV; None: the probe's available RAM.
      threads, ctx_size, max_sequences, batch_size: worker flags (None: the worker's default).
      threads_decode: the worker's ``--threads-decode``, threads of a Forward whose micro-batch
        is one row (a lone session's decode step); None: ``threads``. On the 2-core benchmark
        machine, three nodes of 2-thread workers decode one session 1.32-1.59x faster with 1 here
        (the same bits); sessions that decode together are unaffected.
      heartbeat_interval_ms: None: what the tracker says at registration.
      relay: hold a reservation on the tracker's circuit relay and advertise
        ``<tracker>/p2p-circuit/p2p/<node id>`` (for a node that cannot be dialled; the
        transport may then listen nowhere). Reserved right after admission and checked after
        every heartbeat (a relay keeps a reservation only while the connection that made it
        lasts: after a tracker restart or a broken connection it is made again).
      request_timeout_s: control messages (tracker, node requests, end-session forwarding).
      step_push_timeout_s: pushing a step to the next hop or a result to the owner.
      session_idle_timeout_s: a session with nothing pending and no step for this long is
        freed (a lease its owner renews with every step, and with a ``touch`` while it waits
        longer: a prefill chunk upstream, a rebuild): an owner that crashed, or that lost the
        route and did not end it, holds its sequences this long at most.
      session_sweep_interval_s: how often idle sessions are looked for.
      owner_max_share: the share of a range's sequences one owner may hold at once (at least
        one sequence): a peer sending step-0 frames cannot take a range from everyone else.
      batch_window_ms: how long a serving task waits after the first pending step for others
        to join its batch (0: take what is queued; steps that arrive while the worker is busy
        are merged anyway, and an upstream Forward's steps arrive together in one StepBatch).
      worker_ready_timeout_s, worker_stop_grace_s, worker_call_timeout_s: worker process start,
        SIGTERM grace, and the deadline of each worker call.
      worker_binary: the baton-worker binary (None: ``find_worker_binary()``).
      worker_wait: how a worker's idle threads wait for work (``agent.core.worker_wait``):
        ``auto`` (sleep when another Baton node or worker runs on this host, else spin), ``spin`` or
        ``sleep`` (a short spin, then sleep).
      probe: measured host values; None: ``probe_host(probe_config)`` at start.
      start_retry_initial_s, start_retry_max_s, start_retry_timeout_s: a tracker that cannot
        be reached at start is tried again after ``initial``, doubling up to ``max`` between
        tries, for ``timeout`` in all (None: until it answers); each wait is logged.
      models_dir: where models this node lacks are fetched to (``<sha256>.gguf``, sparse:
        only the assigned ranges' bytes, from the sources the tracker names, each tensor
        checked against the tracker-signed manifest); None: serve only ``models``.
      verify_local_models: before serving a range of a local file (``models``), check its
        bytes for the range against the tracker's manifest, tensor by tensor.
      fetch: limits of those downloads (``agent.io.node.fetch.FetchConfig``).
      manifest_timeout_s: how long the tracker may take to send a manifest (the first one
        of a model hashes the whole file: minutes for tens of GB).
      kept_rows_max_bytes: the most bytes of output rows one session may keep per range for
        rebuilding a lost next hop (SmolLM2's 2,048 positions in f32: 4.7 MB; 0 keeps none:
        a lost hop after this one then costs a re-prefill of the whole route).
      resume_wait_s: how long a resume waits for a step of the session still in a Forward.
      data_plane_host: where each worker's data plane listens (a TCP port chosen at start):
        a session's owner may then move its steps there (``DataPlaneBindRequest``), worker to
        worker, the node only admitting, leasing and unbinding; None: no data plane (every
        step through this node). With ``decode_groups`` 1 and ``decode_gather_ms``, a first
        hop's worker holds its decode Forwards itself (lock-step:
        ``agent.core.node_policy.data_plane_gather_us``). The CLI uses the
        host of ``--listen``: the data plane is exactly as reachable as the node's own
        channel, never more.
      row_budget: rows each worker Forward is filled to (``agent.core.scheduler``); None: the
        worker's batch (``n_batch``). Steps longer than this are refused (owners chunk).
      decode_groups: a range that begins at block 0 splits its decoding sessions into this many
        decode groups, capping each decode Forward at ceil(sessions / groups) steps, so the
        groups are at different hops at once (``agent.core.scheduler.decode_group_cap``);
        0: off; 1 with a gather window: lock-step; None (the default): per route
        (``agent.core.scheduler.decode_mode``), lock-step when the route's next hop runs on this
        machine (its cores are this worker's), else the route's hops + 1 (no cap on a one-hop
        route). On the data plane the first hop's worker caps its decode Forwards the same way
        (``agent.core.node_policy.data_plane_decode_groups``).
      decode_gather_ms: how long such a first hop holds a decode Forward until a full group
        waits (``agent.core.scheduler.gather_wait_ms``: sessions drift apart, and a drifted
        step alone costs a Forward); 0: never held; None (the default):
        ``agent.core.scheduler.LOCK_STEP_GATHER_MS`` in lock-step, else 0. With one group it
        makes the route lock-step, the mode for hops that share one machine's cores
        (``agent.core.scheduler``; docs/PERFORMANCE.md, "Many sessions at once").
      replay_merge_rows: a replay joins kept decode rows into rebuild steps of at most this
        many rows, and sends every larger step as it was (``agent.core.kept_rows``: batches
        this small compute each row as a batch of one does, so the rebuild is bit-exact).
    """

    tracker: str
    key: Ed25519PrivateKey
    models: tuple[LocalModel, ...] = ()
    memory_bytes: int | None = None
    threads: int | None = None
    threads_decode: int | None = None
    ctx_size: int | None = None
    max_sequences: int | None = None
    batch_size: int | None = None
    heartbeat_interval_ms: int | None = None
    relay: bool = False
    request_timeout_s: float = 10.0
    step_push_timeout_s: float = 30.0
    session_idle_timeout_s: float = 5.0
    session_sweep_interval_s: float = 1.0
    owner_max_share: float = 0.75
    batch_window_ms: float = 0.0
    worker_ready_timeout_s: float = 120.0
    worker_stop_grace_s: float = 5.0
    worker_call_timeout_s: float = 60.0
    worker_binary: str | None = None
    worker_wait: str = AUTO
    probe: HostProbe | None = None
    probe_config: ProbeConfig = ProbeConfig()
    start_retry_initial_s: float = 0.5
    start_retry_max_s: float = 30.0
    start_retry_timeout_s: float | None = None
    models_dir: str | None = None
    verify_local_models: bool = True
    fetch: FetchConfig = FetchConfig()
    manifest_timeout_s: float = 300.0
    kept_rows_max_bytes: int = 64 * 1024 * 1024
    resume_wait_s: float = 5.0
    data_plane_host: str | None = "127.0.0.1"
    replay_merge_rows: int = 16
    row_budget: int | None = None
    decode_groups: int | None = None
    decode_gather_ms: float | None = None


class NodeError(Exception):
    """The node cannot take part (tracker unreachable or misbehaving at registration)."""


class TrackerUnreachable(NodeError):
    """The tracker could not be reached (a transport error, not an answer)."""


class NodeRefused(NodeError):
    """The tracker refused this node; ``reason`` is the tracker's text."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"refused: {reason}")
        self.reason = reason


@dataclasses.dataclass(eq=False)
class ServedRange:
    """One range instance on this node (its lifecycle: ``entry``, kept by the node's
    ``agent.core.node_ranges.RangeBook``) and, once READY, its worker, sessions and queue.

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
    #: the worker's data plane Forwards (HealthReply, read before each heartbeat): the
    #: heartbeat counts them with the node's own (their call time is their compute time)
    data_plane: WorkerHealth | None = None
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
        return swarm_pb2.AssignmentStatus(
            assignment=swarm_pb2.Assignment(model_sha256=model_sha256, begin=begin, end=end),
            state=cast(State, state),  # protoc's .pyi takes named values only; proto3 enums are open
            error=error,
            recipe_hash=self.entry.recipe_hash if state == State.READY else "",
            sequences_in_use=0 if self.sessions is None else self.sessions.n_seq_max - self.sessions.free_count,
            sequences_total=0 if self.sessions is None else self.sessions.n_seq_max,
            fetched_bytes=0 if self.fetch_progress is None else self.fetch_progress.done_bytes,
            fetch_total_bytes=0 if self.fetch_progress is None else self.fetch_progress.total_bytes,
            fetch_bytes_per_s=0.0 if self.fetch_progress is None else self.fetch_progress.bytes_per_s,
            sessions_started=0 if self.sessions is None else self.sessions.started,
            forward_calls=self.forward_calls + (0 if self.data_plane is None else self.data_plane.data_plane_forwards),
            forward_steps=self.entries_forwarded + (0 if self.data_plane is None else self.data_plane.data_plane_steps),
            forward_compute_us=self.forward_compute_us + self._data_plane_compute_us,
            forward_call_us=self.forward_call_us + self._data_plane_compute_us,
            sessions_resumed=0 if self.sessions is None else self.sessions.resumed,
            sessions_rebuilt=0 if self.sessions is None else self.sessions.rebuilt,
            data_port=self.info.data_port if state == State.READY and self.info is not None else 0,
        )

    @property
    def _data_plane_compute_us(self) -> int:
        return 0 if self.data_plane is None else self.data_plane.data_plane_compute_us

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


def _unix_ms() -> int:
    """Wall-clock ms: admissions and fingerprints carry the tracker's and node's unix times.
    Everything else of the node (session leases, sweeps, batch windows, heartbeat intervals)
    runs on trio's clock, so a test's MockClock drives it."""
    return time.time_ns() // 1_000_000


def _data_listen(host: str | None) -> str | None:
    """The worker's ``--data-listen`` for ``NodeConfig.data_plane_host`` (any free port)."""
    if host is None:
        return None
    return f"[{host}]:0" if ":" in host else f"{host}:0"


def _unbind_request(session_id: bytes, *, keep_bound: bool = False) -> worker_pb2.UnbindSessionRequest:
    return worker_pb2.UnbindSessionRequest(schema_version=1, session_id=session_id, keep_bound=keep_bound)


def _clock_ms() -> int:
    return int(trio.current_time() * 1000)


def _worker_top_k(step: StepInput, info: WorkerInfo) -> int:
    """K for the worker to select in C++: the step's ``result_top_k`` when this is the route's
    last hop and K is shorter than the row (then the reply carries K entries, not n_vocab
    floats); 0 (the full row) otherwise."""
    if step.rest or not info.gives_logits:
        return 0
    return step.result_top_k if 0 < step.result_top_k < info.n_vocab else 0


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


class Node:
    """A running node (what ``serve_node`` hands to ``task_status.started``).

    Attributes (read-only for callers): ``peer_id``, ``admission`` (the current
    ``SignedAdmission``), ``tracker_peer_id``, ``tracker_public_key``, ``ranges`` (range key ->
    ``ServedRange``), ``registrations`` and ``heartbeats`` (counts).
    """

    def __init__(self, config: NodeConfig, transport: Transport, outputs_filter: OutputsFilter | None = None) -> None:
        self.config = config
        self.transport = transport
        self.peer_id = peer_id_from_public_key(public_key_bytes(config.key))
        if transport.peer_id != self.peer_id:
            raise ValueError(f"the transport is peer {transport.peer_id}, the node key is {self.peer_id}")
        self.tracker_peer_id = peer_id_from_multiaddr(config.tracker)
        self._keep_relay_reservation = getattr(transport, "keep_relay_reservation", None)
        if config.relay and self._keep_relay_reservation is None:
            raise ValueError("relay=True needs a transport that can hold relay reservations (libp2p)")
        self.tracker_public_key = b""
        self._sender_admissions = AdmissionVerifier(b"")  # replaced once the tracker key is known
        self._batch_peers = BatchPeers()  # next hops that get single pushes
        #: pushes sent from the serving task when the transport can (``_push_now``)
        self._request_soon = getattr(transport, "request_soon", _cannot_request_soon)
        #: the step handlers, answered inline by the direct channel (``ImmediateHandler``)
        # the ack goes out after the serving task has started the step's Forward
        # an accepting ack is not sent to a sender that asked for quiet (the channel confirms it in bulk)
        self.handle_step = ImmediateHandler(self.answer_step, reply_later=True, is_acceptance=step_ack_accepts)
        self.handle_steps = ImmediateHandler(self.answer_steps, reply_later=True, is_acceptance=batch_ack_accepts)
        self.admission = swarm_pb2.SignedAdmission()
        self.heartbeat_interval_ms = config.heartbeat_interval_ms or DEFAULT_HEARTBEAT_INTERVAL_MS
        self.models = {m.sha256: m for m in config.models}
        #: the ranges' lifecycle (the decisions); ``_instances`` holds each instance's worker,
        #: sessions and queue, by (range, epoch), until its task has ended
        self.book = RangeBook(
            self.models, fetches_models=config.models_dir is not None,
            verify_local_models=config.verify_local_models, peer_id=self.peer_id,
        )  # fmt: skip
        self._instances: dict[tuple[RangeKey, int], ServedRange] = {}
        self.sweeps = 0  # idle-session sweeps done (tests wait on it)
        #: this node's marker on the host (``open_node_marker``, set by ``serve_node``): other
        #: nodes' ``auto`` wait policy counts it, this node's own does not
        self.host_marker: str | None = None
        self._fetch_locks: dict[str, trio.Lock] = {}  # one download at a time per model file
        self.registrations = 0
        self.heartbeats = 0
        self._heartbeat_wakeup = trio.Event()
        #: by peer id, the tracker's entry of a bind's next hop (none: unknown to it) and when it
        #: was fetched (trio time): binds within NODE_LIST_REUSE_S share one ``list_nodes`` call
        self._next_hops: dict[str, tuple[float, list[swarm_pb2.NodeEntry]]] = {}
        self._outputs_filter = outputs_filter
        if outputs_filter is not None:
            log.warning("this node's outputs pass through a test hook: %s", type(outputs_filter).__name__)

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

    # --- tracker -----------------------------------------------------------------------

    def advertised_addrs(self) -> list[str]:
        """Where others reach this node: the transport's addresses, plus (``config.relay``) the
        circuit address through the tracker even before the reservation is made (the node is
        in no route before its first heartbeat, which follows the reservation)."""
        addrs = list(self.transport.listen_addrs)
        if self.config.relay:
            circuit = circuit_multiaddr(self.config.tracker, self.peer_id)
            if circuit not in addrs:
                addrs.append(circuit)
        return addrs

    async def keep_relay_reservation(self) -> None:
        """(``config.relay``) Hold the reservation on the tracker's relay; a no-op while the
        connection it was made over lasts.

        Raises:
          TransportError: the tracker refused or failed the reservation.
        """
        if self.config.relay:
            assert self._keep_relay_reservation is not None
            await self._keep_relay_reservation(self.config.tracker)

    async def _tracker_call(
        self, request: swarm_pb2.TrackerRequest, timeout_s: float | None = None
    ) -> swarm_pb2.TrackerReply:
        """Raises TransportError or WireError (a malformed reply)."""
        data = await self.transport.request(
            self.tracker_peer_id,
            [self.config.tracker],
            TRACKER_PROTOCOL,
            request.SerializeToString(),
            timeout_s=self.config.request_timeout_s if timeout_s is None else timeout_s,
        )
        return parse_record(swarm_pb2.TrackerReply, data)

    async def register(self, probe: HostProbe) -> None:
        """Register with a fresh signed fingerprint; keep the admission and tracker key.

        Raises:
          NodeRefused: the tracker said REFUSED.
          NodeError: the tracker could not be reached, answered another error, or its key
            does not belong to the tracker peer id of ``config.tracker``.
        """
        fingerprint = build_fingerprint(
            probe,
            peer_id=self.peer_id,
            listen_addrs=self.advertised_addrs(),
            model_sha256s=sorted(self.models),
            usable_memory_bytes=self.config.memory_bytes
            if self.config.memory_bytes is not None
            else probe.ram_available_bytes,
            created_at_ms=_unix_ms(),
            nonce=os.urandom(16),
            fetches_models=self.config.models_dir is not None,
        )
        request = swarm_pb2.TrackerRequest(
            schema_version=SCHEMA_VERSION,
            register=swarm_pb2.RegisterRequest(fingerprint=signed_fingerprint(self.config.key, fingerprint)),
        )
        try:
            reply = await self._tracker_call(request)
        except TransportError as err:
            raise TrackerUnreachable(f"tracker {self.tracker_peer_id} unreachable: {err}") from err
        except WireError as err:
            raise NodeError(f"tracker answered a malformed reply: {err}") from err
        try:
            registered = read_registration_reply(
                reply, tracker_peer_id=self.tracker_peer_id, peer_id=self.peer_id, now_ms=_unix_ms(),
                own_heartbeat_interval=self.config.heartbeat_interval_ms is not None,
            )  # fmt: skip
        except RegistrationRefused as err:
            raise NodeRefused(err.reason) from None
        except RegistrationInvalid as err:
            raise NodeError(str(err)) from None
        self.tracker_public_key = registered.tracker_public_key
        self.admission = registered.admission
        if registered.heartbeat_interval_ms is not None:
            self.heartbeat_interval_ms = registered.heartbeat_interval_ms
        self.registrations += 1
        log.info("node %s admitted by tracker %s", self.peer_id, self.tracker_peer_id)

    def heartbeat_soon(self) -> None:
        """Send the next heartbeat now (a range changed state)."""
        self._heartbeat_wakeup.set()

    async def _heartbeat_loop(self, nursery: trio.Nursery, probe: HostProbe) -> None:
        while True:
            self._heartbeat_wakeup = trio.Event()
            await self._heartbeat_once(nursery, probe)
            with trio.move_on_after(self.heartbeat_interval_ms / 1000):
                await self._heartbeat_wakeup.wait()

    async def _heartbeat_once(self, nursery: trio.Nursery, probe: HostProbe) -> None:
        # Before the heartbeat too: after a tracker restart the reservation is back in place
        # before the tracker routes through this node again (a node it holds pending may
        # reserve). Failing here is expected when the tracker forgot or dropped the node.
        try:
            await self.keep_relay_reservation()
        except TransportError as err:
            log.debug("relay reservation before the heartbeat: %s", err)
        self._notice_worker_exits(nursery)
        await self._read_data_plane_counts()
        request = swarm_pb2.TrackerRequest(
            schema_version=SCHEMA_VERSION,
            heartbeat=swarm_pb2.HeartbeatRequest(
                peer_id=self.peer_id,
                sent_at_ms=_unix_ms(),
                serving=[served.status() for served in self.ranges.values()],
                listen_addrs=self.advertised_addrs(),
                peer_paths=self.peer_paths(),
            ),
        )
        try:
            reply = await self._tracker_call(request)
        except (TransportError, WireError) as err:
            log.warning("heartbeat failed: %s", err)
            return
        self.heartbeats += 1
        outcome = read_heartbeat_reply(
            reply, tracker_public_key=self.tracker_public_key, peer_id=self.peer_id, now_ms=_unix_ms()
        )
        if outcome.warning:
            log.warning("%s", outcome.warning)
        if outcome.register_again:
            try:
                await self.register(probe)
            except NodeRefused:
                raise
            except NodeError as err:
                log.warning("registering again failed: %s", err)
                return
            self.heartbeat_soon()
            return
        if outcome.admission is not None:
            self.admission = outcome.admission
        for directive in outcome.directives:
            self._apply_directive(directive, nursery)
        try:
            await self.keep_relay_reservation()
        except TransportError as err:
            log.warning("relay reservation on the tracker: %s", err)

    def peer_paths(self) -> list[swarm_pb2.PeerPath]:
        """How this node's step messages reached each peer (direct channel or relay) and its
        hole punches with it, from the transport's counts (none on a transport that keeps
        none: libp2p alone, in-memory tests)."""
        path_counts = getattr(self.transport, "path_counts", None)
        if path_counts is None:
            return []
        counts = path_counts((STEP_PROTOCOL, STEPS_PROTOCOL, RESULT_PROTOCOL))
        puncher = getattr(self.transport, "puncher", None)
        succeeded = {} if puncher is None else puncher.book.succeeded
        failed = {} if puncher is None else puncher.book.failed
        return [
            swarm_pb2.PeerPath(
                peer_id=peer_id,
                direct_messages=direct,
                relayed_messages=relayed,
                punches_succeeded=succeeded.get(peer_id, 0),
                punches_failed=failed.get(peer_id, 0),
            )
            for peer_id in sorted(set(counts) | set(succeeded) | set(failed))
            for direct, relayed in [counts.get(peer_id, (0, 0))]
        ]

    async def _read_data_plane_counts(self) -> None:
        """Each READY range's worker data plane counts (``ServedRange.data_plane``); a worker
        that does not answer keeps its last counts (its exit is noticed elsewhere)."""
        for served in list(self.ranges.values()):
            if served.state != State.READY or served.client is None or served.info is None or not served.info.data_port:
                continue
            try:
                served.data_plane = await served.client.health(timeout_s=self.config.worker_call_timeout_s)
            except WorkerError as err:
                log.debug("%s: data plane counts: %s", range_name(served.key), err)

    # --- directives --------------------------------------------------------------------

    def _apply_directive(self, directive: swarm_pb2.Directive, nursery: trio.Nursery) -> None:
        a = directive.assignment
        key: RangeKey = (a.model_sha256, a.begin, a.end)
        kind = swarm_pb2.Directive.Kind.Name(directive.kind) if directive.kind in (1, 2) else str(directive.kind)
        log.info("directive %s %s", kind, range_name(key))
        actions = self.book.directive(directive.kind, key)
        entry = self.book.entry(key)
        if entry is not None and (key, entry.epoch) not in self._instances:
            self._instances[(key, entry.epoch)] = ServedRange(entry=entry, model=self.models.get(a.model_sha256))
        self._perform(actions, nursery)

    def _notice_worker_exits(self, nursery: trio.Nursery) -> None:
        """A READY range whose worker died while idle (a Forward notices it at once)."""
        for served in list(self._instances.values()):
            if (
                served.state == State.READY
                and served.handle is not None
                and (reason := self._exit_reason(served.handle))
            ):
                self._perform(self.book.worker_exited(served.key, served.entry.epoch, reason), nursery)

    def _perform(self, actions: list[Action], nursery: trio.Nursery) -> None:
        """Do what the range book decided."""
        for action in actions:
            if isinstance(action, StartRange):
                nursery.start_soon(self._run_range, self._instances[(action.key, action.epoch)], action, nursery)
            elif isinstance(action, StopRange):
                if (served := self._instances.get((action.key, action.epoch))) is not None:
                    served.cancel_scope.cancel()
            elif isinstance(action, FailPending):
                if (served := self._instances.get((action.key, action.epoch))) is not None:
                    leftover = served.in_forward + (served.scheduler.drain() if served.scheduler is not None else [])
                    served.in_forward = []
                    for _seq_id, step in leftover:
                        nursery.start_soon(
                            self._guarded, self._send_error, step, Code.UNAVAILABLE, action.message, self.peer_id
                        )
            elif isinstance(action, HeartbeatNow):
                self.heartbeat_soon()
            elif isinstance(action, Ignored):
                log.warning("%s", action.warning)
        for key, epoch in list(self._instances):  # instances the book no longer knows are gone
            if self.book.instance(key, epoch) is None:
                del self._instances[(key, epoch)]

    async def _run_range(self, served: ServedRange, start: StartRange, nursery: trio.Nursery) -> None:
        """Fetch or check the model of ``served``, start its worker and serve its batches until
        cancelled (UNLOAD) or until the worker dies; the range book hears why it stopped."""
        error = ""
        try:
            with served.cancel_scope:
                if start.fetch:
                    served.model = await self._fetch_model(served)
                    self._perform(self.book.fetched(start.key, start.epoch), nursery)
                elif start.verify_local:
                    await self._verify_local_model(served)
                error = await self._load_and_serve(served, nursery)
                log.warning("FAILED %s: %s", range_name(served.key), error)
        except (FetchRefused, FetchError, ManifestError, ModelMismatch) as err:
            error = _first_line(err)
            log.warning("FAILED %s: %s", range_name(served.key), err)
        except (WorkerStartError, WorkerBinaryNotFound, WorkerError, OSError, ValueError) as err:
            error = _first_line(err)
            log.warning("FAILED %s: %s", range_name(served.key), err)
        finally:
            served.handle = None
            self._perform(self.book.stopped(start.key, start.epoch, error), nursery)
            served.stopped.set()

    async def _manifest(self, model_sha256: str) -> tuple[swarm_pb2.ModelManifest, list[str]]:
        """The model's tracker-signed manifest (checked against the tracker's key) and its
        sources.

        Raises:
          FetchError: the tracker could not be asked or refused; ManifestError: bad manifest.
        """
        request = swarm_pb2.TrackerRequest(
            schema_version=SCHEMA_VERSION,
            model_metadata=swarm_pb2.ModelMetadataRequest(model=model_sha256, without_metadata=True),
        )
        try:
            reply = await self._tracker_call(request, self.config.manifest_timeout_s)
        except (TransportError, WireError) as err:
            raise FetchError(f"the tracker did not send the manifest of model {model_sha256}: {err}") from None
        if reply.error.code:
            raise FetchError(f"the tracker refused the manifest of model {model_sha256}: {reply.error.message}")
        manifest = verify_manifest(reply.model_metadata.manifest, self.tracker_public_key, model_sha256)
        return manifest, list(reply.model_metadata.source_urls)

    async def _verify_local_model(self, served: ServedRange) -> None:
        """Before a local file's range is served: its bytes for the range must be the ones the
        tracker's manifest names (per tensor), whatever the file's size and mtime say (a cached
        whole-file hash is trusted by those alone). Without a manifest (the tracker has none
        for this model), the whole file is hashed afresh against the registered sha256.

        Raises:
          ModelMismatch: a tensor (named) or the file differs from the registered model.
        """
        model = served.model
        assert model is not None
        _, begin, end = served.key
        try:
            manifest, _sources = await self._manifest(model.sha256)
        except (FetchError, ManifestError) as err:
            log.info(
                "%s: no manifest to check %s against (%s): hashing the whole file",
                range_name(served.key),
                model.path,
                err,
            )
            digest = await trio.to_thread.run_sync(sha256_file, model.path)
            if digest != model.sha256:
                raise ModelMismatch(
                    f"{model.path} hashes to {digest}, not the registered {model.sha256}: the file changed"
                ) from None
            return
        await trio.to_thread.run_sync(verify_local_range, model.path, manifest, begin, end)
        log.info("%s: the tensors of %s match the tracker's manifest", range_name(served.key), model.path)

    async def _fetch_model(self, served: ServedRange) -> LocalModel:
        """Fetch the bytes ``served``'s range needs into ``config.models_dir`` (the manifest
        from the tracker, checked against its key; the bytes from the first source that
        delivers them); progress goes into the range's heartbeat status.

        Raises:
          ManifestError: the tracker sent no usable manifest, or names no source.
          FetchRefused: a tensor hashed wrong on every attempt (names tensor and source).
          FetchError: no source could deliver.
        """
        model_sha256, begin, end = served.key
        assert self.config.models_dir is not None
        manifest, sources = await self._manifest(model_sha256)
        if not sources:
            raise ManifestError(f"the tracker names no source to fetch model {model_sha256} from")
        dest = model_file_path(self.config.models_dir, model_sha256)

        def progress(update: FetchProgress) -> None:
            served.fetch_progress = update

        errors: list[FetchError | FetchRefused] = []
        async with self._fetch_locks.setdefault(model_sha256, trio.Lock()):
            for url in sources:
                try:
                    log.info("fetching %s from %s into %s", range_name(served.key), url, dest)
                    await fetch_range(
                        manifest, [(begin, end)], url, dest, config=self.config.fetch, on_progress=progress
                    )
                    break
                except (FetchError, FetchRefused) as err:  # this source failed: try the next one
                    log.warning("%s: %s", range_name(served.key), err)
                    errors.append(err)
            else:
                refusals = [e for e in errors if isinstance(e, FetchRefused)]
                if refusals:
                    raise refusals[0]  # names the tensor and the source
                raise FetchError("; ".join(str(e) for e in errors))
        return LocalModel(path=str(dest), sha256=model_sha256)

    async def _load_and_serve(self, served: ServedRange, pushes: trio.Nursery) -> str:
        """Run the worker of ``served``; returns why it stopped serving (the worker died).
        Outputs are pushed in ``pushes`` (the node's nursery: a push under way when the range
        stops, e.g. UNLOAD, still reaches its next hop or owner).

        Raises:
          WorkerStartError, WorkerBinaryNotFound, OSError, ValueError: it could not start.
        """
        model = served.model
        assert model is not None
        _, begin, end = served.key
        cfg = self.config
        environment, wait = wait_environment(cfg.worker_wait, node_marker=self.host_marker)
        log.info("%s: the worker's idle threads %s", range_name(served.key), wait)
        async with open_worker(
            model.path, begin, end,
            ctx_size=cfg.ctx_size, max_sequences=cfg.max_sequences, batch_size=cfg.batch_size,
            threads=cfg.threads, threads_decode=cfg.threads_decode, model_sha256=model.sha256,
            ready_timeout_s=cfg.worker_ready_timeout_s, stop_grace_s=cfg.worker_stop_grace_s,
            client_config=ClientConfig(timeout_s=cfg.worker_call_timeout_s),
            binary=cfg.worker_binary, environment=environment, data_listen=_data_listen(cfg.data_plane_host),
        ) as handle:  # fmt: skip
            info = handle.info
            if info.model_sha256 and info.model_sha256 != model.sha256:
                raise ValueError(f"worker loaded model {info.model_sha256}, expected {model.sha256}")
            if (info.layer_begin, info.layer_end) != (begin, end):
                raise ValueError(
                    f"worker serves blocks [{info.layer_begin}, {info.layer_end}), expected [{begin}, {end})"
                )
            served.handle, served.info = handle, info
            served.spec = RangeSpec(
                model_sha256=model.sha256, begin=begin, end=end, n_layer=info.n_layer, n_embd=info.n_embd,
                n_vocab=info.n_vocab, recipe_hash=info.recipe_hash, n_batch_max=min(info.n_batch_max, cfg.row_budget or info.n_batch_max),
                boundary=info.boundary.schema,
            )  # fmt: skip
            served.sessions = SessionTable(
                info.n_seq_max, info.n_ctx_per_sequence, max_per_owner=max(1, int(cfg.owner_max_share * info.n_seq_max))
            )
            served.kept = KeptStore(cfg.kept_rows_max_bytes)
            served.scheduler = StepScheduler(info.n_batch_max, info.n_seq_max, row_budget=served.spec.n_batch_max)
            self._perform(self.book.ready(served.key, served.entry.epoch, info.recipe_hash), pushes)
            log.info("READY %s (recipe %s)", range_name(served.key), info.recipe_hash[:12])
            return await self._serve_batches(served, handle, pushes)

    # --- batches -----------------------------------------------------------------------

    async def _serve_batches(self, served: ServedRange, handle: WorkerHandle, pushes: trio.Nursery) -> str:
        """Forward batches until the worker dies (returns why); pushes run in ``pushes``."""
        assert served.scheduler is not None and served.sessions is not None and served.info is not None
        scheduler, sessions, info = served.scheduler, served.sessions, served.info
        client = handle.client
        timeout_s = self.config.worker_call_timeout_s
        gather_since_s: float | None = None  # when a first hop began holding a decode group
        while True:
            while not len(scheduler) and not sessions.has_closing():
                served.wakeup = trio.Event()
                await served.wakeup.wait()
            if window_ms := batch_window_wait_ms(self.config.batch_window_ms, scheduler.pending_rows, info.n_batch_max):
                await trio.sleep(window_ms / 1000)
            # both lists before any await: a session that ends meanwhile waits for the next pass,
            # so no sequence is freed before its session is unbound (no step reaches a reused one)
            unbinding, closing = sessions.take_unbinding(), sessions.take_closing()
            for session_id, seq_id in unbinding:
                try:
                    await client.call("UnbindSession", _unbind_request(session_id), timeout_s=timeout_s)
                except WorkerError as err:
                    if (reason := self._exit_reason(handle)) is not None:
                        return reason
                    log.warning("%s: could not unbind session %s: %s", range_name(served.key), session_id.hex(), err)
                    closing.remove(seq_id)  # not reused: a step of it may still come
            for seq_id in closing:
                try:
                    await client.remove_sequence(seq_id, timeout_s=timeout_s)
                except WorkerError as err:
                    if (reason := self._exit_reason(handle)) is not None:
                        return reason
                    if err.code_name != "INVALID_ARGUMENT":  # "unknown sequence": it holds nothing
                        log.warning("%s: could not free sequence %d: %s", range_name(served.key), seq_id, err)
                        continue  # not reused: it may still hold positions
                sessions.release(seq_id)
            oldest, waiting = scheduler.decode_waiting()
            now_s = trio.current_time()
            gather_since_s = now_s if gather_since_s is None else gather_since_s
            groups, window_ms = self._decode_mode(
                tcp_hosts(oldest[1].rest[0].addrs) if oldest and oldest[1].rest else []
            )
            max_decode, hold_ms = first_hop_decode(
                begin=served.key[1], decoding_sessions=sessions.decoding_count,
                route_hops=len(oldest[1].rest) + 1 if oldest else 0,
                groups=groups, waiting=waiting, waited_ms=(now_s - gather_since_s) * 1000, window_ms=window_ms,
            )  # fmt: skip
            if hold_ms > 0:
                served.wakeup = trio.Event()
                # decode steps that cannot complete the group do not wake this task
                served.quiet_decode_arrivals = gather_arrivals_needed(waiting, max_decode or 1) - 1
                with trio.move_on_after(hold_ms / 1000):
                    await served.wakeup.wait()  # the group may be whole, or something else came: count again
                served.quiet_decode_arrivals = 0
                continue
            gather_since_s = None
            batch = scheduler.next_batch(max_decode_entries=max_decode)
            if not batch:
                continue
            altering = self._outputs_filter is not None and self._outputs_filter.batch_formed()
            entries = [
                SeqInput(
                    seq_id=seq_id,
                    positions=step.positions,
                    token_ids=step.token_ids,
                    boundary=step.rows,
                    boundary_schema=step.schema if step.rows is not None else None,
                    # (a test hook) an altered last range selects its top-K from the altered row
                    top_k=0 if altering else _worker_top_k(step, info),
                    boundary_bytes=step.wire_rows,
                )
                for seq_id, step in batch
            ]
            served.in_forward = batch
            try:
                outputs = await client.forward(entries, timeout_s=timeout_s)
                if len(outputs) != len(entries):
                    raise WorkerError(
                        "INTERNAL", f"{len(entries)} entries sent, {len(outputs)} returned", method="Forward"
                    )
            except (WorkerError, BoundaryError, ValueError) as err:
                served.in_forward = []
                now = _clock_ms()
                self._forward_finished(served)
                failure = forward_failure(getattr(err, "code_name", ""), str(err), self.peer_id)
                for _seq_id, step in batch:
                    sessions.done(step.session_id, now)
                    if failure.end_session:
                        served.end_session(step.session_id)
                    pushes.start_soon(self._guarded, self._fail, step, failure)
                if (reason := self._exit_reason(handle)) is not None:
                    return reason
                continue
            served.in_forward = []
            served.forward_calls += 1
            served.entries_forwarded += len(batch)
            if (timing := client.last_forward) is not None:
                served.forward_compute_us += timing.compute_us
                served.forward_call_us += timing.call_us
            served.largest_batch = max(served.largest_batch, len(batch))
            now = _clock_ms()
            done: list[tuple[StepInput, SeqOutput, tuple[bytes, int] | None]] = []
            for (_seq_id, step), output in zip(batch, outputs, strict=True):
                sessions.done(step.session_id, now)
                if step.session_id not in sessions:
                    continue  # ended while in the Forward: nobody wants the output
                if self._outputs_filter is not None:
                    output = self._outputs_filter.apply(step, output, altering=altering)
                done.append((step, output, self._keep_rows(served, step, output)))
            # the same peer at the same addresses: a step's addresses come from its owner's route
            next_hops = [
                (step.rest[0].peer_id, tuple(step.rest[0].addrs)) if step.rest else None for step, _o, _e in done
            ]
            for group in push_groups(next_hops):
                if self._push_now([done[i] for i in group], pushes):
                    continue
                if len(group) == 1:
                    pushes.start_soon(self._guarded, self._push, *done[group[0]])
                else:
                    pushes.start_soon(self._guarded, self._push_batch, [done[i] for i in group])
            self._forward_finished(served)

    @staticmethod
    def _forward_finished(served: ServedRange) -> None:
        served.forward_done.set()
        served.forward_done = trio.Event()

    @staticmethod
    def _keep_rows(served: ServedRange, step: StepInput, output: SeqOutput) -> tuple[bytes, int] | None:
        """Keep the output rows a non-last range produced for ``step`` (before they are
        pushed: a resume may need them whatever happens to the push); returns them encoded
        for the wire (``(bytes, dtype)``, which the push sends as they are), or None."""
        if served.kept is None or output.boundary is None or served.info is None or served.info.gives_logits:
            return None
        try:
            data, dtype = encode_step_output(step, output.boundary, output.boundary_bytes)
        except BoundaryError:
            return None  # the push reports it
        schema = step.schema
        served.kept.keep(
            step.session_id, step.first_position, step.n_rows, data,
            dtype=dtype, schema_version=schema.version, streams=schema.streams,
        )  # fmt: skip
        return data, dtype

    @staticmethod
    def _exit_reason(handle: WorkerHandle) -> str | None:
        code = handle.process.poll()
        if code is None:
            return None
        return f"worker exited with code {code}: {handle.log_tail(400)}"

    @staticmethod
    async def _guarded(fn, *args) -> None:
        """Run a push task; a bug in one must not take the node down (it is logged)."""
        try:
            await fn(*args)
        except Exception:
            log.exception("push task %s failed", getattr(fn, "__name__", fn))

    def _push_now(
        self, items: list[tuple[StepInput, SeqOutput, tuple[bytes, int] | None]], pushes: trio.Nursery
    ) -> bool:
        """Send one push group (``push_groups``) from the serving task itself: the next hop's
        steps, or a last range's top-K result to its owner. Over an open channel connection
        the message goes out at once, quiet (``ChannelTransport.request_soon``): the receiver
        answers only a refusal, and confirms what it took in bulk, so no ack wakes this
        process per step; only a refusal or a failure calls back, and starts a task to
        report it. Otherwise the message, already built, is sent from a task. False, with
        nothing done: the group takes the task path whole (a rebuild, a boundary that does
        not encode, a full logits row, a hop run by this node)."""
        step, output, _encoded = items[0]
        timeout_s = self.config.step_push_timeout_s
        if step.rest:
            hop = step.rest[0]
            if hop.peer_id == self.peer_id or (
                len(items) > 1 and not self._batch_peers.batches_to(hop.peer_id, _clock_ms())
            ):
                return False
            try:
                steps = [(s, self._next_hop_bytes(s, o, e)) for s, o, e in items]
            except BoundaryError:
                return False
            protocol, data = push_message([serialized for _s, serialized in steps])
            taken = functools.partial(self._pushed, hop, steps, pushes)
            if not self._request_soon(hop.peer_id, protocol, data, timeout_s=timeout_s, on_reply=taken, quiet=True):
                pushes.start_soon(self._guarded, self._push_steps, hop, steps)
            return True
        if step.rebuild or not output.top:
            return False
        result = step_result_top(step.session_id, step.step, output.top[-1], self.admission).SerializeToString()
        taken = functools.partial(self._result_taken, step)
        if not self._request_soon(
            step.owner_peer_id, RESULT_PROTOCOL, result, timeout_s=timeout_s, on_reply=taken, quiet=True
        ):
            pushes.start_soon(self._guarded, self._send_result, step, result)
        return True

    def _pushed(
        self,
        hop: swarm_pb2.Hop,
        steps: list[tuple[StepInput, bytes]],
        pushes: trio.Nursery,
        reply: bytes | TransportError,
    ) -> None:
        """The next hop's answer to steps sent by ``_push_now``: nothing to do when it took
        them all; a task reports anything else, as ``_push_steps`` does."""
        if isinstance(reply, TransportError):
            pushes.start_soon(self._guarded, self._push_failed, hop, steps, reply)
        elif not all_steps_taken(reply, len(steps)):
            pushes.start_soon(self._guarded, self._push_answered, hop, steps, reply)

    @staticmethod
    def _result_taken(step: StepInput, reply: bytes | TransportError) -> None:
        """The owner's answer to a result sent by ``_push_now``; logged as ``_send_result`` does."""
        if isinstance(reply, TransportError):
            log.warning("result of step %d could not reach owner %s: %s", step.step, step.owner_peer_id, reply)
            return
        _log_result_ack(step, reply)

    async def _push(self, step: StepInput, output: SeqOutput, encoded: tuple[bytes, int] | None = None) -> None:
        """Send one step's output on: to the next hop, or (last range) to the owner; what
        ``_push_now`` does not send (a top-K result always goes through it)."""
        if step.rebuild and not step.rest:  # the last rebuilt range: no logits, just "done"
            result = step_result_rebuilt(step.session_id, step.resume_step, step.end_position, self.admission)
            await self._send_result(step, result)
            return
        if not step.rest:
            if output.logits is None or output.logits.shape[0] < 1:
                await self._send_error(step, Code.INTERNAL, "the last range returned no logits", self.peer_id)
                return
            result = step_result(step.session_id, step.step, output.logits[-1], self.admission, step.result_top_k)
            await self._send_result(step, result)
            return
        data = await self._next_hop_data(step, output, encoded)
        if data is not None:
            await self._push_steps(step.rest[0], [(step, data)])

    async def _push_batch(self, items: list[tuple[StepInput, SeqOutput, tuple[bytes, int] | None]]) -> None:
        """Send several steps' outputs on to their one next hop (``push_groups``) together."""
        steps, failed = [], []
        for step, output, encoded in items:
            try:
                steps.append((step, self._next_hop_bytes(step, output, encoded)))
            except BoundaryError as err:
                failed.append((step, err))
        async with trio.open_nursery() as each:
            for step, boundary_error in failed:
                each.start_soon(self._guarded, self._boundary_failed, step, boundary_error)
            if steps:
                each.start_soon(self._guarded, self._push_steps, items[0][0].rest[0], steps)

    async def _next_hop_data(
        self, step: StepInput, output: SeqOutput, encoded: tuple[bytes, int] | None
    ) -> bytes | None:
        """The serialized ``StepRequest`` for ``step``'s next hop; None once a failure was
        reported to the owner instead."""
        try:
            return self._next_hop_bytes(step, output, encoded)
        except BoundaryError as err:
            await self._boundary_failed(step, err)
            return None

    async def _boundary_failed(self, step: StepInput, err: BoundaryError) -> None:
        await self._send_error(step, Code.INTERNAL, f"boundary for the next hop: {err}", self.peer_id)

    def _next_hop_bytes(self, step: StepInput, output: SeqOutput, encoded: tuple[bytes, int] | None) -> bytes:
        """Raises BoundaryError."""
        if output.boundary is None:
            raise BoundaryError("the worker returned no boundary rows")
        if encoded is None:
            encoded = encode_step_output(step, output.boundary, output.boundary_bytes)
        return next_hop_request(step, output.boundary, self.admission, encoded=encoded).SerializeToString()

    async def _push_steps(self, hop: swarm_pb2.Hop, steps: list[tuple[StepInput, bytes]]) -> bool:
        """Push serialized steps to ``hop``: one alone on ``/baton/step``, several in one
        ``StepBatch``; each step the hop did not take is reported to its owner. True when the
        hop took them all."""
        if len(steps) > 1 and not self._batch_peers.batches_to(hop.peer_id, _clock_ms()):
            return await self._push_each(hop, steps)
        try:
            reply = await self._send_to_hop(
                hop, *push_message([data for _step, data in steps]), self.config.step_push_timeout_s
            )
        except TransportError as err:
            return await self._push_failed(hop, steps, err)
        return await self._push_answered(hop, steps, reply)

    async def _push_failed(self, hop: swarm_pb2.Hop, steps: list[tuple[StepInput, bytes]], err: TransportError) -> bool:
        """``steps`` did not reach ``hop``: tried again one by one when they were a batch,
        else reported to their owners. True when the hop took them all after all."""
        if len(steps) > 1:
            # Not knowing /baton/steps (a peer from before it) reads differently on each
            # transport, so any failed batch is sent again step by step: each step then
            # gets the verdict a single push gets. If they all got through, the peer does
            # not take batches: it gets single pushes for a while.
            taken = await self._push_each(hop, steps)
            self._batch_peers.batch_failed(hop.peer_id, took_every_step_singly=taken, now_ms=_clock_ms())
            return taken
        failure = push_unreachable(hop.peer_id, str(err))
        await self._fail_all([step for step, _d in steps], [failure] * len(steps))
        return False

    async def _push_answered(self, hop: swarm_pb2.Hop, steps: list[tuple[StepInput, bytes]], reply: bytes) -> bool:
        """Report to their owners the steps that ``hop``'s ``reply`` refused (or all of them,
        when the reply does not read). True when it took them all."""
        try:
            acks = read_push_acks(reply, len(steps))
        except WireError as err:
            failure = push_answered_badly(hop.peer_id, str(err))
            await self._fail_all([step for step, _d in steps], [failure] * len(steps))
            return False
        refused = [(step, ack) for (step, _d), ack in zip(steps, acks, strict=True) if ack.error.code]
        await self._fail_all(
            [step for step, _a in refused],
            [push_refused(hop.peer_id, ack.error.code, ack.error.message) for _s, ack in refused],
        )
        return not refused

    async def _push_each(self, hop: swarm_pb2.Hop, steps: list[tuple[StepInput, bytes]]) -> bool:
        """Push ``steps`` one by one, concurrently; True when the hop took every one."""
        taken = []

        async def one(step: StepInput, data: bytes) -> None:
            taken.append(await self._push_steps(hop, [(step, data)]))

        async with trio.open_nursery() as each:
            for step, data in steps:
                each.start_soon(self._guarded, one, step, data)
        return len(taken) == len(steps) and all(taken)

    async def _fail_all(self, steps: list[StepInput], failures: list[StepFailure]) -> None:
        """Report each failure to its step's owner, concurrently."""
        if len(steps) == 1:
            await self._fail(steps[0], failures[0])
            return
        async with trio.open_nursery() as each:
            for step, failure in zip(steps, failures, strict=True):
                each.start_soon(self._guarded, self._fail, step, failure)

    async def _send_to_hop(self, hop: swarm_pb2.Hop, protocol: str, data: bytes, timeout_s: float) -> bytes:
        """``data`` on ``protocol`` to ``hop``: handled here when this node runs that hop too.

        Raises:
          TransportError: the hop could not be reached.
        """
        if hop.peer_id == self.peer_id:
            handlers = {STEP_PROTOCOL: self.handle_step, STEPS_PROTOCOL: self.handle_steps}
            return await handlers.get(protocol, self.handle_node)(self.peer_id, data)
        return await self.transport.request(hop.peer_id, list(hop.addrs), protocol, data, timeout_s=timeout_s)

    async def _fail(self, step: StepInput, failure: StepFailure) -> None:
        await self._send_error(step, failure.code, failure.message, failure.failed_peer_id)

    async def _send_error(self, step: StepInput, code: int, message: str, failed_peer_id: str) -> None:
        log.info("step %d of session %s failed at %s: %s", step.step, step.session_id.hex(), failed_peer_id, message)
        result = step_result_error(step.session_id, step.step, code, message, failed_peer_id, self.admission)
        await self._send_result(step, result)

    async def _send_result(self, step: StepInput, result: swarm_pb2.StepResult | bytes) -> None:
        data = result if isinstance(result, bytes) else result.SerializeToString()
        try:
            reply = await self.transport.request(
                step.owner_peer_id, list(step.owner_addrs), RESULT_PROTOCOL, data,
                timeout_s=self.config.step_push_timeout_s,
            )  # fmt: skip
        except TransportError as err:
            log.warning("result of step %d could not reach owner %s: %s", step.step, step.owner_peer_id, err)
            return
        _log_result_ack(step, reply)

    # --- sessions ----------------------------------------------------------------------

    def _end_session_here(self, session_id: bytes) -> list[swarm_pb2.SessionRows]:
        """End ``session_id`` in every range of this node; the rows each range that held it
        computed for it, in block order."""
        counted = []
        for served in sorted(self.ranges.values(), key=lambda s: s.key[1]):
            ended = served.end_session(session_id)
            if ended is not None:
                _, begin, end = served.key
                counted.append(swarm_pb2.SessionRows(
                    peer_id=self.peer_id, begin=begin, end=end, rows=ended.rows, continued_steps=ended.continued_steps
                ))  # fmt: skip
        return counted

    async def _sweep_sessions(self) -> None:
        timeout_ms = int(self.config.session_idle_timeout_s * 1000)
        while True:
            await trio.sleep(self.config.session_sweep_interval_s)
            now = _clock_ms()
            for served in list(self.ranges.values()):
                if served.sessions is None or served.scheduler is None:
                    continue
                for session_id in served.sessions.idle(now, timeout_ms):
                    log.info("%s: session %s idle, freed", range_name(served.key), session_id.hex())
                    served.end_session(session_id)
            self.sweeps += 1

    # --- handlers ----------------------------------------------------------------------

    def _check_sender(self, signed: swarm_pb2.SignedAdmission, remote_peer_id: str) -> swarm_pb2.AdmissionRecord:
        if self._sender_admissions.tracker_public_key != self.tracker_public_key:
            self._sender_admissions = AdmissionVerifier(self.tracker_public_key)
        try:
            # the same admission arrives with every step: its signature is checked once
            return self._sender_admissions.verify(
                signed, remote_peer_id, _unix_ms(), roles=[swarm_pb2.ROLE_NODE, swarm_pb2.ROLE_CLIENT]
            )
        except AdmissionError as err:
            raise WireError(Code.REFUSED, f"sender admission: {err.reason}") from None

    def answer_step(self, remote_peer_id: str, data: bytes) -> bytes:
        """``/baton/step/1.0.0`` (``handle_step``): validate and queue a step; the ack says
        accepted or why not. Never raises; awaits nothing, so the direct channel answers it
        in its frame reader, and steps that arrive together are all queued before the serving
        task looks."""
        return self._queue_step(remote_peer_id, data)

    def answer_steps(self, remote_peer_id: str, data: bytes) -> bytes:
        """``/baton/steps/1.0.0`` (``handle_steps``): ``answer_step`` for each step of a
        ``StepBatch``; one ack per step, in order (a batch that does not parse gets one ack
        with the error). Never raises."""
        return answer_step_batch(data, lambda request: self._queue_step(remote_peer_id, request))

    def _queue_step(self, remote_peer_id: str, data: bytes | swarm_pb2.StepRequest) -> bytes:
        """Validate and queue one step (serialized or parsed); its serialized ``StepAck``."""
        try:
            self._accept_step(remote_peer_id, data)
        except WireError as err:
            return step_ack(err)
        except Exception as err:
            log.exception("step handler failed")
            return step_ack_error(Code.INTERNAL, f"internal error: {type(err).__name__}")
        return step_ack()

    def _accept_step(self, remote_peer_id: str, data: bytes | swarm_pb2.StepRequest) -> None:
        request = data if isinstance(data, swarm_pb2.StepRequest) else parse_record(swarm_pb2.StepRequest, data)
        record = self._check_sender(request.sender_admission, remote_peer_id)
        check_step_sender(record.role, remote_peer_id, request.begin, request.end, request.owner_peer_id)
        key: RangeKey = (request.model_sha256, request.begin, request.end)
        served = self._held(key)
        if (
            served is None
            or served.state != _READY
            or served.spec is None
            or served.sessions is None
            or served.scheduler is None
        ):
            raise range_not_ready(key, None if served is None else served.state)
        step = validate_step(request, served.spec)
        if step.rebuild:
            session = served.sessions.accept_rebuild(
                step.session_id, step.resume_step, step.first_position, step.n_rows, step.owner_peer_id, _clock_ms()
            )
        else:
            session = served.sessions.accept(
                step.session_id, step.step, step.first_position, step.n_rows, step.owner_peer_id, _clock_ms()
            )
        served.scheduler.push((session.seq_id, step), session=session.seq_id, n_rows=step.n_rows, key=forward_key(step))
        if not arrival_wakes_gatherer(served.quiet_decode_arrivals, decode=session.decoding and not step.rebuild):
            served.quiet_decode_arrivals -= 1  # a group being gathered, not whole yet
            return
        served.wakeup.set()

    async def handle_node(self, remote_peer_id: str, data: bytes) -> bytes:
        """``/baton/node/1.0.0``: tokenize, detokenize, end_session, resume_session, replay,
        touch. Never raises."""
        try:
            request = parse_record(swarm_pb2.NodeRequest, data)
            record = self._check_sender(request.sender_admission, remote_peer_id)
            body = request.WhichOneof("body")
            if body == "tokenize":
                return await self._tokenize(request.tokenize)
            if body == "detokenize":
                return await self._detokenize(request.detokenize)
            if body == "end_session":
                return await self._end_session(request.end_session, remote_peer_id, record.role)
            if body == "resume_session":
                return await self._resume_session(request.resume_session, remote_peer_id, record.role)
            if body == "replay":
                return await self._replay(request.replay, remote_peer_id, record.role)
            if body == "touch":
                return self._touch(request.touch, remote_peer_id)
            if body == "data_plane_bind":
                return await self._bind_data_plane(request.data_plane_bind, remote_peer_id, record.role)
            if body == "data_plane_unbind":
                return await self._unbind_data_plane(request.data_plane_unbind, remote_peer_id, record.role)
            if body == "data_plane_continue":
                return await self._continue_data_plane(request.data_plane_continue, remote_peer_id, record.role)
            raise WireError(
                Code.INVALID_ARGUMENT,
                "the NodeRequest has no body (tokenize, detokenize, end_session, resume_session, replay, touch, "
                "data_plane_bind, data_plane_unbind or data_plane_continue)",
            )
        except WireError as err:
            return node_reply_error(err.code, err.message)
        except WorkerError as err:
            return node_reply_error(Code.UNAVAILABLE, f"worker: {err}")
        except Exception as err:
            log.exception("node handler failed")
            return node_reply_error(Code.INTERNAL, f"internal error: {type(err).__name__}")

    def _worker_for(self, model_sha256: str) -> ServedRange:
        ready = [s for s in self.ranges.values() if s.key[0] == model_sha256 and s.state == State.READY and s.handle]
        if not ready:
            raise WireError(Code.NOT_FOUND, f"model {model_sha256!r} is not ready on this node")
        ready.sort(key=lambda s: s.key[1])  # prefer the first range (it owns the embeddings)
        return ready[0]

    async def _tokenize(self, body: swarm_pb2.TokenizeRequest) -> bytes:
        served = self._worker_for(body.model_sha256)
        assert served.client is not None and served.info is not None
        ids = await served.client.tokenize(
            body.text, add_special=body.add_special, timeout_s=self.config.request_timeout_s
        )
        reply = swarm_pb2.NodeReply(
            schema_version=SCHEMA_VERSION, token_ids=ids, eog_token_ids=list(served.info.eog_token_ids)
        )
        return reply.SerializeToString()

    async def _detokenize(self, body: swarm_pb2.DetokenizeRequest) -> bytes:
        served = self._worker_for(body.model_sha256)
        assert served.client is not None and served.info is not None
        n_vocab = served.info.n_vocab
        bad = [t for t in body.token_ids if not 0 <= t < n_vocab]
        if bad:
            raise WireError(Code.INVALID_ARGUMENT, f"token ids must be in [0, {n_vocab}), got {bad[:8]}")
        text = await served.client.detokenize(list(body.token_ids), timeout_s=self.config.request_timeout_s)
        return swarm_pb2.NodeReply(schema_version=SCHEMA_VERSION, text=text).SerializeToString()

    async def _end_session(self, body: swarm_pb2.EndSessionRequest, remote_peer_id: str, role: int) -> bytes:
        session_id = bytes(body.session_id)
        if len(session_id) != SESSION_ID_BYTES:
            raise WireError(
                Code.INVALID_ARGUMENT, f"session_id has {len(session_id)} bytes, expected {SESSION_ID_BYTES}"
            )
        owners = [
            session.owner_peer_id
            for served in self.ranges.values()
            if served.sessions is not None and (session := served.sessions.get(session_id)) is not None
        ]
        check_end_session_sender(role, remote_peer_id, session_id, owners)
        for i, hop in enumerate(body.rest):
            if not hop.peer_id:
                raise WireError(Code.INVALID_ARGUMENT, f"rest[{i}] names no peer")
        for served in list(self.ranges.values()):  # what the workers computed counts too
            try:
                await self._unbind_if_bound(served, session_id)
            except WireError as err:  # (the session is ended here all the same) the end goes on
                log.warning("ending session %s: %s", session_id.hex(), err.message)
        counted = self._end_session_here(session_id)
        if body.rest:
            hop = body.rest[0]
            forward = swarm_pb2.NodeRequest(
                schema_version=SCHEMA_VERSION,
                sender_admission=self.admission,
                end_session=swarm_pb2.EndSessionRequest(session_id=session_id, rest=list(body.rest[1:])),
            )
            data = forward.SerializeToString()
            try:
                raw = await self._send_to_hop(hop, NODE_PROTOCOL, data, self.config.request_timeout_s)
                reply = parse_record(swarm_pb2.NodeReply, raw)
            except (TransportError, WireError) as err:
                raise WireError(Code.UNAVAILABLE, f"ended here; next hop {hop.peer_id}: {err}") from None
            if reply.error.code:
                return reply.SerializeToString()
            onward = list(reply.session_rows)
            del reply.session_rows[:]
            reply.session_rows.extend([*counted, *onward])
            return reply.SerializeToString()
        return swarm_pb2.NodeReply(schema_version=SCHEMA_VERSION, session_rows=counted).SerializeToString()

    def _touch(self, body: swarm_pb2.TouchRequest, remote_peer_id: str) -> bytes:
        """Renew the owner's lease of its session in every range here that holds it."""
        session_id = bytes(body.session_id)
        now = _clock_ms()
        held = [
            s.sessions.touch(session_id, remote_peer_id, now) for s in self.ranges.values() if s.sessions is not None
        ]
        if not any(held):
            raise WireError(Code.NOT_FOUND, f"no session {session_id.hex()} of {remote_peer_id} here")
        return swarm_pb2.NodeReply(schema_version=SCHEMA_VERSION).SerializeToString()

    # --- resume ------------------------------------------------------------------------

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

    async def _resume_session(self, body: swarm_pb2.ResumeSessionRequest, remote_peer_id: str, role: int) -> bytes:
        """Keep positions ``[0, keep_positions)`` of the session in range ``[begin, end)``; its
        next step is ``next_step`` (a hop elsewhere on its route was lost and is rebuilt)."""
        session_id = bytes(body.session_id)
        served = self._session_range(session_id, body.model_sha256, body.begin, body.end)
        self._owner_only(served, session_id, remote_peer_id, role)
        assert served.sessions is not None and served.client is not None
        session = served.sessions.get(session_id)
        if session is not None and session.data_plane:  # a resume that will be refused changes nothing
            held = await served.client.call(
                "UnbindSession",
                _unbind_request(session_id, keep_bound=True),
                timeout_s=self.config.worker_call_timeout_s,
            )
            served.sessions.check_resume_bound(
                session_id, body.keep_positions, body.next_step, remote_peer_id,
                worker_next_position=held.next_position, worker_next_step=held.next_step,
            )  # fmt: skip
        await self._unbind_if_bound(served, session_id)
        with trio.move_on_after(self.config.resume_wait_s):
            while (session := served.sessions.get(session_id)) is not None and session.pending:
                await served.forward_done.wait()  # the step of this session in a Forward finishes
        session, trim = served.sessions.resume(
            session_id, body.keep_positions, body.next_step, remote_peer_id, _clock_ms()
        )
        if trim:
            try:
                held = await served.client.trim_sequence(
                    session.seq_id, body.keep_positions, timeout_s=self.config.worker_call_timeout_s
                )
            except WorkerError as err:
                served.end_session(session_id)  # its positions on the worker are unknown now
                raise WireError(Code.UNAVAILABLE, f"{range_name(served.key)}: could not trim: {err}") from None
            if held != body.keep_positions:
                served.end_session(session_id)
                raise WireError(
                    Code.INTERNAL, f"{range_name(served.key)}: trimmed to {held} positions, not {body.keep_positions}"
                )
        if served.kept is not None:
            served.kept.trim(session_id, body.keep_positions)
        log.info(
            "%s: session %s resumed at %d positions, next step %d",
            range_name(served.key), session_id.hex(), body.keep_positions, body.next_step,
        )  # fmt: skip
        return swarm_pb2.NodeReply(schema_version=SCHEMA_VERSION).SerializeToString()

    # --- data plane ----------------------------------------------------------------------

    async def _check_next_hop(self, served: ServedRange, body: swarm_pb2.DataPlaneBindRequest) -> None:
        """Refuse a bind whose next hop is not what the tracker lists (``next_hop_refusal``): the
        worker would connect to whatever host and port the owner named."""
        if body.next_port:
            await self._check_listed_hop(served, body.next_peer_id, lambda nodes: next_hop_refusal(body, nodes))

    async def _check_listed_hop(
        self, served: ServedRange, peer_id: str, refusal: Callable[[Sequence[swarm_pb2.NodeEntry]], str | None]
    ) -> None:
        """Refuse (REFUSED, its reason) unless ``refusal`` passes ``peer_id``'s entry in the
        tracker's node list: fetched within NODE_LIST_REUSE_S, it serves; one that refuses is
        fetched again first (the hop may have become READY since)."""
        cached = self._next_hops.get(peer_id)
        fresh = cached is not None and trio.current_time() - cached[0] <= NODE_LIST_REUSE_S
        if fresh and cached is not None and refusal(cached[1]) is None:
            return
        request = swarm_pb2.TrackerRequest(
            schema_version=SCHEMA_VERSION, list_nodes=swarm_pb2.ListNodesRequest(peer_ids=[peer_id])
        )
        try:
            reply = await self._tracker_call(request)
        except (TransportError, WireError) as err:
            raise WireError(
                Code.UNAVAILABLE, f"{range_name(served.key)}: cannot check the hop {peer_id} with the tracker: {err}"
            ) from None
        entries = [n for n in reply.list_nodes.nodes if n.peer_id == peer_id]
        now = trio.current_time()
        self._next_hops = {p: c for p, c in self._next_hops.items() if now - c[0] <= NODE_LIST_REUSE_S}
        self._next_hops[peer_id] = (now, entries)
        why = refusal(entries)
        if why is not None:
            raise WireError(Code.REFUSED, f"{range_name(served.key)}: {why}")

    async def _continue_data_plane(
        self, body: swarm_pb2.DataPlaneContinueRequest, remote_peer_id: str, role: int
    ) -> bytes:
        """Greedy continuation on this last hop's worker (``DataPlaneContinueRequest``): each next
        decode step of the bound session goes from it straight to the first hop's worker, which
        must be the one the tracker lists (``first_hop_refusal``)."""
        session_id = bytes(body.session_id)
        served = self._session_range(session_id, body.model_sha256, body.begin, body.end)
        self._owner_only(served, session_id, remote_peer_id, role)
        assert served.sessions is not None and served.client is not None and served.info is not None
        session = served.sessions.get(session_id)
        if session is None or not session.data_plane:
            raise WireError(Code.INVALID_ARGUMENT, f"session {session_id.hex()} is not on the data plane here")
        if not served.info.gives_logits:
            raise WireError(
                Code.INVALID_ARGUMENT, f"{range_name(served.key)} is not the last range: it continues nothing"
            )
        await self._check_listed_hop(served, body.first_peer_id, lambda nodes: first_hop_refusal(body, nodes))
        request = worker_pb2.ContinueSessionRequest(
            schema_version=1, session_id=session_id, host=body.first_host, port=body.first_port,
            continue_key=body.continue_key, steps=body.steps, stop_token_ids=body.stop_token_ids,
            max_position=body.max_position,
        )  # fmt: skip
        try:
            await served.client.call("ContinueSession", request, timeout_s=self.config.worker_call_timeout_s)
        except WorkerError as err:
            code = Code.UNAVAILABLE if err.code_name == "UNAVAILABLE" else Code.INVALID_ARGUMENT
            raise WireError(
                code, f"{range_name(served.key)}: the worker refused the continuation: {err.message}"
            ) from None
        log.info(
            "%s: session %s continues to the first hop %s", range_name(served.key), session_id.hex(), body.first_peer_id
        )
        return swarm_pb2.NodeReply(schema_version=SCHEMA_VERSION).SerializeToString()

    def _decode_mode(self, next_hop_hosts: Sequence[str]) -> tuple[int | None, float]:
        """This node's decode groups and gather window as a first hop of a route whose next hop
        is at ``next_hop_hosts`` (none: no next hop): ``agent.core.scheduler.decode_mode``, told
        whether that hop runs on this machine."""
        shares = any(map(is_this_host, next_hop_hosts))
        return decode_mode(self.config.decode_groups, self.config.decode_gather_ms, next_hop_shares_host=shares)

    async def _bind_data_plane(self, body: swarm_pb2.DataPlaneBindRequest, remote_peer_id: str, role: int) -> bytes:
        """Bind the owner's session on this range's worker: its steps come worker to worker
        from now on (``DataPlaneBindRequest``); answers the worker's data plane port."""
        session_id = bytes(body.session_id)
        served = self._session_range(session_id, body.model_sha256, body.begin, body.end)
        self._owner_only(served, session_id, remote_peer_id, role)
        assert served.sessions is not None and served.client is not None and served.info is not None
        if not served.info.data_port:
            raise WireError(Code.INVALID_ARGUMENT, f"{range_name(served.key)}: the worker has no data plane")
        await self._check_next_hop(served, body)
        await self._unbind_if_bound(served, session_id)  # a bind again (another route part) starts afresh
        session = served.sessions.bind_data_plane(session_id, remote_peer_id, _clock_ms())
        groups, gather_ms = self._decode_mode([body.next_host] if body.next_port else [])
        request = worker_pb2.BindSessionRequest(
            schema_version=1, session_id=session_id, seq_id=session.seq_id, step_key=body.step_key,
            next_step=session.next_step, next_host=body.next_host, next_port=body.next_port,
            next_step_key=body.next_step_key, return_key=body.return_key, continue_key=body.continue_key,
            keep_rows_max_bytes=0 if served.info.gives_logits or served.kept is None else served.kept.room(session_id),
            decode_gather_us=data_plane_gather_us(begin=served.key[1], decode_groups=groups, decode_gather_ms=gather_ms),
            decode_groups=data_plane_decode_groups(begin=served.key[1], route_hops=body.route_hops, decode_groups=groups),
        )  # fmt: skip
        try:
            await served.client.call("BindSession", request, timeout_s=self.config.worker_call_timeout_s)
            held = served.sessions.get(session_id)
            if held is not session or not held.data_plane:  # it ended (or was unbound) meanwhile
                await served.client.call(
                    "UnbindSession", _unbind_request(session_id), timeout_s=self.config.worker_call_timeout_s
                )
                raise WireError(Code.NOT_FOUND, f"session {session_id.hex()} ended while it was being bound")
        except WorkerError as err:
            served.sessions.unbound(
                session_id, next_step=session.next_step, next_position=session.next_position, rows=0, now_ms=_clock_ms()
            )
            code = Code.INVALID_ARGUMENT if err.code_name == "INVALID_ARGUMENT" else Code.UNAVAILABLE
            raise WireError(code, f"{range_name(served.key)}: the worker refused the bind: {err.message}") from None
        log.info("%s: session %s on the data plane", range_name(served.key), session_id.hex())
        return swarm_pb2.NodeReply(schema_version=SCHEMA_VERSION, data_port=served.info.data_port).SerializeToString()

    async def _unbind_data_plane(self, body: swarm_pb2.DataPlaneUnbindRequest, remote_peer_id: str, role: int) -> bytes:
        """Take the owner's session back from the worker's data plane to this node."""
        session_id = bytes(body.session_id)
        served = self._session_range(session_id, body.model_sha256, body.begin, body.end)
        self._owner_only(served, session_id, remote_peer_id, role)
        await self._unbind_if_bound(served, session_id)
        return swarm_pb2.NodeReply(schema_version=SCHEMA_VERSION).SerializeToString()

    async def _unbind_if_bound(self, served: ServedRange, session_id: bytes) -> None:
        """Take ``session_id`` off the worker's data plane, if it is bound there, and into the
        session what the worker did: next step, positions, rows, and the output rows it kept
        (for rebuilding a lost next hop). A worker that cannot be asked ends the session here
        (what it holds is unknown)."""
        session = None if served.sessions is None else served.sessions.get(session_id)
        if session is None or not session.data_plane or served.client is None or served.info is None:
            return
        try:
            reply = await served.client.call(
                "UnbindSession", _unbind_request(session_id), timeout_s=self.config.worker_call_timeout_s
            )
        except WorkerError as err:
            served.end_session(session_id)
            raise WireError(Code.UNAVAILABLE, f"{range_name(served.key)}: could not unbind: {err}") from None
        assert served.sessions is not None
        served.sessions.unbound(
            session_id, next_step=reply.next_step, next_position=reply.next_position, rows=reply.rows,
            now_ms=_clock_ms(), continued_steps=reply.continued_steps if served.key[1] == 0 else 0,
        )  # fmt: skip
        if served.kept is not None and reply.kept_rows and not reply.kept_rows_lost:
            schema = served.info.boundary.schema
            row_bytes = schema.row_values * 4
            # one row a step, as the decode steps that made them were (a replay merges rows as
            # it merges the node path's steps: the rebuild computes them in the same shapes)
            for i in range(len(reply.kept_rows) // row_bytes):
                served.kept.keep(
                    session_id, reply.kept_first_position + i, 1, reply.kept_rows[i * row_bytes : (i + 1) * row_bytes],
                    dtype=swarm_pb2.DTYPE_F32, schema_version=schema.version, streams=schema.streams,
                )  # fmt: skip

    async def _replay(self, body: swarm_pb2.ReplayRequest, remote_peer_id: str, role: int) -> bytes:
        """Send the rows this range kept for positions ``[0, positions)`` of the session, as
        rebuild steps, to the replacement ``to`` of the lost next hop."""
        session_id = bytes(body.session_id)
        served = self._session_range(session_id, body.model_sha256, body.begin, body.end)
        self._owner_only(served, session_id, remote_peer_id, role)
        assert served.kept is not None and served.spec is not None
        if not body.to:
            raise WireError(Code.INVALID_ARGUMENT, "replay.to names no hop")
        check_hops(body.to, served.spec.end, served.spec.n_layer, "replay.to", partial=True)
        if body.resume_step < 1:
            raise WireError(Code.INVALID_ARGUMENT, f"replay.resume_step must be >= 1, got {body.resume_step}")
        try:
            chunks = served.kept.replay(
                session_id, body.positions, body.max_rows or served.spec.n_batch_max, self.config.replay_merge_rows
            )
        except (RowsNotKept, ValueError) as err:
            raise WireError(Code.UNAVAILABLE, f"{range_name(served.key)}: {err}") from None
        first = body.to[0]
        for chunk in chunks:
            request = replay_step_request(
                session_id=session_id, resume_step=body.resume_step, hops=body.to, chunk=chunk,
                n_embd=served.spec.n_embd, recipe_hash=served.spec.recipe_hash, model_sha256=served.spec.model_sha256,
                owner_peer_id=remote_peer_id, owner_addrs=list(body.owner_addrs), sender_admission=self.admission,
            )  # fmt: skip
            data = request.SerializeToString()
            try:
                raw = await self._send_to_hop(first, STEP_PROTOCOL, data, self.config.step_push_timeout_s)
                ack = parse_record(swarm_pb2.StepAck, raw)
            except (TransportError, WireError) as err:
                raise WireError(Code.UNAVAILABLE, f"replacement hop {first.peer_id}: {err}") from None
            if ack.error.code:
                raise WireError(
                    ack.error.code, f"replacement hop {first.peer_id} refused a rebuild step: {ack.error.message}"
                )
        log.info(
            "%s: replayed %d positions of session %s to %s in %d steps",
            range_name(served.key), body.positions, session_id.hex(), first.peer_id, len(chunks),
        )  # fmt: skip
        return swarm_pb2.NodeReply(schema_version=SCHEMA_VERSION).SerializeToString()


def _cannot_request_soon(*_args: object, **_kwargs: object) -> bool:
    """``request_soon`` of a transport that has none (libp2p alone, in-memory tests)."""
    return False


def _log_result_ack(step: StepInput, reply: bytes) -> None:
    """Log an owner's ack that refuses a result, or does not read."""
    try:
        ack = parse_record(swarm_pb2.StepAck, reply)
    except WireError as err:
        log.warning("result of step %d: owner %s answered badly: %s", step.step, step.owner_peer_id, err)
        return
    if ack.error.code:
        log.warning("owner %s refused the result of step %d: %s", step.owner_peer_id, step.step, ack.error.message)


async def _stopped_step(remote_peer_id: str, data: bytes) -> bytes:
    return step_ack_error(Code.UNAVAILABLE, "this node is shutting down")


async def _stopped_steps(remote_peer_id: str, data: bytes) -> bytes:
    return step_batch_ack([step_ack_error(Code.UNAVAILABLE, "this node is shutting down")])


async def _stopped_node(remote_peer_id: str, data: bytes) -> bytes:
    return node_reply_error(Code.UNAVAILABLE, "this node is shutting down")


async def _first_registration(node: Node, probe: HostProbe, config: NodeConfig) -> None:
    """Register, trying again with backoff while the tracker cannot be reached.

    Raises:
      TrackerUnreachable: still unreachable after ``config.start_retry_timeout_s``.
      NodeRefused / NodeError: the tracker answered with a refusal or misbehaved (not retried).
    """
    delay_s = config.start_retry_initial_s
    deadline = None if config.start_retry_timeout_s is None else trio.current_time() + config.start_retry_timeout_s
    while True:
        try:
            await node.register(probe)
            return
        except TrackerUnreachable as err:
            if deadline is not None and trio.current_time() + delay_s > deadline:
                raise
            log.warning("%s; trying again in %.1f s", err, delay_s)
        await trio.sleep(delay_s)
        delay_s = next_retry_delay_s(delay_s, config.start_retry_max_s)


async def serve_node(
    config: NodeConfig,
    transport: Transport,
    *,
    outputs_filter: OutputsFilter | None = None,
    task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED,  # type: ignore[name-defined]  # trio-typing's stale trio stubs
) -> None:
    """Run a node: probe, register, then heartbeat, load ranges and serve steps until cancelled.

    Args:
      config: the node's configuration (``NodeConfig``).
      transport: the node's peer transport; its peer id must be ``config.key``'s.
      outputs_filter: a test hook between each range's worker and its pushes
        (``OutputsFilter``); None, the default, for every real node.

    Started value (``nursery.start``): the ``Node`` (peer id, admission, served ranges), once
    the tracker admitted the node and the step and node handlers are installed.

    Raises:
      NodeRefused: the tracker refused the registration: at start (raised as is), or when the
        node registers again after the tracker forgot it (then inside an ExceptionGroup, as it
        leaves the node's nursery).
      NodeError: the tracker misbehaved at the first registration, stayed unreachable for
        ``config.start_retry_timeout_s`` (``TrackerUnreachable``; it is retried with backoff
        until then), or (``config.relay``) refused the relay reservation.
      ValueError: the transport's peer id is not the key's, ``config.tracker`` has no
        ``/p2p/<peer id>``, or ``config.relay`` with a transport that cannot hold
        reservations.
      agent.io.worker_process.WorkerBinaryNotFound: probing needs the worker binary.

    Resource handling:
      Every worker process started for a LOAD directive lives in this call's nursery and is
      stopped (SIGTERM, then SIGKILL) on UNLOAD or when this call exits. On exit the handlers
      are replaced by ones answering UNAVAILABLE.

    Cancellation:
      Cancel the enclosing scope to stop the node; workers are stopped shielded.
    """
    node = Node(config, transport, outputs_filter)
    with open_node_marker() as marker:
        node.host_marker = marker
        await _serve_node(node, config, transport, task_status)


async def _serve_node(node: Node, config: NodeConfig, transport: Transport, task_status: trio.TaskStatus[Node]) -> None:  # type: ignore[name-defined]  # trio-typing's stale trio stubs
    """``serve_node``'s body, inside the node's host marker."""
    probe = config.probe
    if probe is None:
        # a typed name of its own: the stale stubs' error on the call loses its result's type
        measured: HostProbe = await trio.to_thread.run_sync(  # type: ignore[call-arg]  # trio-typing's stale trio stubs
            lambda: probe_host(config.probe_config, binary=config.worker_binary), abandon_on_cancel=True
        )
        probe = measured
    await _first_registration(node, probe, config)
    try:
        await node.keep_relay_reservation()
    except TransportError as err:
        raise NodeError(f"could not reserve a slot on the tracker's relay: {err}") from err
    transport.set_handler(STEP_PROTOCOL, node.handle_step)
    transport.set_handler(STEPS_PROTOCOL, node.handle_steps)
    transport.set_handler(NODE_PROTOCOL, node.handle_node)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(node._heartbeat_loop, nursery, probe)
            nursery.start_soon(node._sweep_sessions)
            task_status.started(node)
    finally:
        transport.set_handler(STEP_PROTOCOL, _stopped_step)
        transport.set_handler(STEPS_PROTOCOL, _stopped_steps)
        transport.set_handler(NODE_PROTOCOL, _stopped_node)
