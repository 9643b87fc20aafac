"""A node's configuration and its errors: ``NodeConfig`` (every timeout and limit of the node),
``LocalModel``, the ``OutputsFilter`` test hook, ``NodeError`` and its kinds.

Plain records, no I/O: must not import ``agent.io.node.state``, the mixins or ``agent`` (they
import this one); ``fetch`` and ``probe`` only for their configs.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.core.node.worker_wait import AUTO
from agent.core.wire.fingerprint import HostProbe
from agent.core.wire.step_validation import StepInput
from agent.core.wire.worker_records import SeqOutput

from .fetch import FetchConfig
from .probe import ProbeConfig

__all__ = [
    "DEFAULT_HEARTBEAT_INTERVAL_MS",
    "LocalModel",
    "NodeConfig",
    "NodeError",
    "NodeRefused",
    "OutputsFilter",
    "TrackerUnreachable",
]

#: Default heartbeat interval when the tracker names none.
DEFAULT_HEARTBEAT_INTERVAL_MS = 1000


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
      worker_wait: how a worker's idle threads wait for work (``agent.core.node.worker_wait``):
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
        ``agent.core.node.policy.data_plane_gather_us``). The CLI uses the
        host of ``--listen``: the data plane is exactly as reachable as the node's own
        channel, never more.
      row_budget: rows each worker Forward is filled to (``agent.core.node.scheduler``); None: the
        worker's batch (``n_batch``). Steps longer than this are refused (owners chunk).
      decode_groups: a range that begins at block 0 splits its decoding sessions into this many
        decode groups, capping each decode Forward at ceil(sessions / groups) steps, so the
        groups are at different hops at once (``agent.core.node.scheduler.decode_group_cap``);
        0: off; 1 with a gather window: lock-step; None (the default): per route
        (``agent.core.node.scheduler.decode_mode``), lock-step when the route's next hop runs on this
        machine (its cores are this worker's), else the route's hops + 1 (no cap on a one-hop
        route). On the data plane the first hop's worker caps its decode Forwards the same way
        (``agent.core.node.policy.data_plane_decode_groups``).
      decode_gather_ms: how long such a first hop holds a decode Forward until a full group
        waits (``agent.core.node.scheduler.gather_wait_ms``: sessions drift apart, and a drifted
        step alone costs a Forward); 0: never held; None (the default):
        ``agent.core.node.scheduler.LOCK_STEP_GATHER_MS`` in lock-step, else 0. With one group it
        makes the route lock-step, the mode for hops that share one machine's cores
        (``agent.core.node.scheduler``; docs/PERFORMANCE.md, "Many sessions at once").
      replay_merge_rows: a replay joins kept decode rows into rebuild steps of at most this
        many rows, and sends every larger step as it was (``agent.core.node.kept_rows``: batches
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
