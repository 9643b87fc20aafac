"""A node's configuration and its errors: ``NodeConfig`` (every timeout and limit of the node),
``LocalModel``, the ``OutputsFilter`` test hook, ``NodeError`` and its kinds.

Plain records, no I/O: must not import ``agent.io.node.state``, the mixins or ``agent`` (they
import this one); ``fetch`` and ``probe`` only for their configs.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent import cli_args
from agent.core.node.scheduler import LOCK_STEP_GATHER_MS
from agent.core.node.worker_wait import AUTO, WAIT_CHOICES
from agent.core.wire.fingerprint import HostProbe
from agent.core.wire.step_validation import StepInput
from agent.core.wire.worker_records import SeqOutput
from agent.io.settings import setting, shared_fields
from agent.io.worker.config import WorkerConfig

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
    "worker_config",
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeConfig:
    """Everything ``serve_node`` needs; every timeout and limit of the node is here.

    The fields made with ``setting`` are ``baton node``'s flags and its ``--config`` file's
    keys (``agent.io.settings``); a field named as a ``WorkerConfig`` field is passed to every
    worker this node starts (``worker_config``), so a worker tunable reaches the node's command
    line, its file and its workers by one line here.

    Fields:
      tracker: the tracker's multiaddr, ending ``/p2p/<tracker peer id>``.
      model_files, key_file, listen, channel, punch, data_plane: the command's (the files it
        hashes into ``models``, the key file it reads into ``key``, its transport's listen
        address, direct channel and hole punching, ``data_plane_host`` from ``listen``).
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
      session_stall_timeout_s: a session that took no step for this long is freed however often
        its owner touches it (``agent.core.node.sessions.SessionTable.stalled``; a session on the
        data plane counts the steps its worker took).
      trusted_owners, trusted_reserve_share: owners (peer ids) that may use a reserve of each
        range's sequences which no other owner can take (``SessionTable.reserve_for_trusted``).
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

    # The command line's (``baton node``; flags and TOML keys derived by ``agent.io.settings``),
    # in the order ``--help`` lists them.
    tracker: str = setting(help="the tracker's multiaddr, ending /p2p/<peer id> (required)")
    model_files: tuple[str, ...] = setting(
        (), "a GGUF file this node offers (repeatable)", flag="--model", metavar="PATH"
    )
    models_dir: str | None = setting(
        None,
        "fetch the assigned ranges of models this node lacks into DIR (only their bytes, verified)",
        metavar="DIR",
    )
    key_file: str | None = setting(
        None, "the node's Ed25519 key file (created if missing; required)", flag="--key", metavar="PATH"
    )
    invite: str = setting(
        "", "an invite from the tracker's operator, where the tracker admits new keys only with one (default: none)",
        metavar="TOKEN",
    )  # fmt: skip
    listen: str = setting(
        "/ip4/127.0.0.1/tcp/0",
        "where to listen (default %(default)s); 'none': accept no direct connections (needs --relay)",
        metavar="MULTIADDR",
    )
    channel: bool = setting(
        True,
        "send steps and results over libp2p only (no direct TLS channel; for comparisons)",
        flag="--no-channel",
    )
    relay: bool = setting(False, "be reachable through the tracker's circuit relay (for a node that cannot be dialled)")
    punch: bool = setting(
        True,
        "neither hole-punch toward peers reached through the relay nor answer their punches"
        " (they stay relayed; for comparisons)",
        flag="--no-punch",
    )
    memory_bytes: int | None = setting(
        None, "usable memory offered (default: available RAM)", parse=cli_args.positive_int, metavar="N"
    )
    threads: int | None = setting(None, "threads per worker (default: the worker's)", parse=cli_args.positive_int)
    threads_decode: int | None = setting(
        None,
        "threads of a worker Forward whose micro-batch is one row, a lone session's decode step (default:"
        " --threads). Nodes that share one machine's cores may decode a lone session faster with 1 (1.3-1.6x with"
        " three nodes of 2-thread workers on 2 cores); sessions decoding together keep --threads",
        parse=cli_args.positive_int,
        metavar="N",
    )
    prefix_cache_bytes: int | None = setting(
        None,
        "bytes of KV each worker keeps for ended sessions' prompt prefixes, so that a new session starting with"
        " one prefills only the rest (whole sequences of its context; least recently used out; default 0: off)",
        parse=cli_args.non_negative_int,
        metavar="N",
    )
    prefix_report_tags: int = setting(
        256,
        "with --prefix-cache-bytes: the most prefix blocks of one range's cache each heartbeat names to the tracker"
        " (the most recently used first), which routes prompts to the hops holding their prefix (default 256; 0: none)",
        parse=cli_args.non_negative_int,
        metavar="N",
    )
    worker_wait: str = setting(
        AUTO,
        "how a worker's idle threads wait for work: spin (quickest for a worker alone on its machine), sleep"
        " (a microseconds' spin, then sleep: for nodes that share one machine's cores, where a spinning worker holds"
        " the cores the next hop needs) or auto (the default: sleep when another Baton node or worker already runs on"
        " this host, else spin; OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment are kept)",
        choices=WAIT_CHOICES,
    )
    data_plane: bool = setting(
        True,
        "every step through this node: its workers do not take a session's steps straight from the hop before"
        " (by default they do, on the host of --listen, sealed with the session's keys)",
        flag="--no-data-plane",
    )
    ctx_size: int | None = setting(None, "positions per sequence (default: the worker's)", parse=cli_args.positive_int)
    max_sequences: int | None = setting(
        None, "sequences per worker (default: the worker's)", parse=cli_args.positive_int
    )
    gpu_layers: int | None = setting(None, "blocks on the GPU (0: none; default: all)", parse=cli_args.non_negative_int)
    session_idle_timeout_s: float = setting(
        5.0,
        "free a session's sequences after this long without a step from its owner (default 5):"
        " an owner that crashed holds them no longer",
        parse=cli_args.positive_float,
    )
    owner_max_share: float = setting(
        0.75,
        "the share of a range's sequences one session owner may hold (default 0.75, so a peer sending"
        " step-0 frames cannot lock everyone out, while a relay, one owner for many users, keeps most; at least one)",
        parse=cli_args.unit_interval,
    )
    session_stall_timeout_s: float = setting(
        60.0,
        "free a session that took no step for this long however often its owner touches it (default 60): a touch"
        " bridges a wait (a prompt chunk upstream, a rebuild), it cannot hold sequences for ever",
        parse=cli_args.positive_float,
    )
    trusted_owners: tuple[str, ...] = setting(
        (),
        "the peer id of a session owner this node trusts, e.g. its relay (repeatable): sequences are kept in"
        " reserve for them (--trusted-reserve-share)",
        flag="--trusted-owner",
        metavar="PEER_ID",
    )
    trusted_reserve_share: float = setting(
        0.25,
        "with --trusted-owner: the share of a range's sequences that only trusted owners may take (default 0.25,"
        " at least one), so that self-made client keys cannot lock a range out for them",
        parse=cli_args.unit_interval,
    )
    decode_groups: int | None = setting(
        None,
        "a first hop splits its sessions' decode steps into N groups, so that they are at different hops at"
        " once (0: off, every waiting decode step in the next Forward; 1: lock-step, with --decode-gather-ms). The"
        " default picks per route: lock-step when the route's next hop runs on this machine (nodes that share its"
        " cores gain nothing by computing at once), else the route's hops + 1",
        parse=cli_args.non_negative_int,
        metavar="N",
    )
    batch_window_ms: float = setting(
        0.0,
        "how long a range waits after a step arrives for the other steps of the upstream Forward to join it"
        " (default 0)",
        parse=cli_args.non_negative_float,
        metavar="MS",
    )
    decode_gather_ms: float | None = setting(
        None,
        "how long a first hop holds a decode Forward until a full decode group waits (0: never; default:"
        f" {LOCK_STEP_GATHER_MS:g} in lock-step, else 0); with one decode group, lock-step: every decoding"
        " session in one Forward, for nodes that share one machine's cores",
        parse=cli_args.non_negative_float,
        metavar="MS",
    )
    heartbeat_interval_ms: int | None = setting(
        None, "heartbeat interval (default: the tracker's)", parse=cli_args.positive_int, metavar="MS"
    )
    kept_rows_max_bytes: int = setting(
        64 * 1024 * 1024,
        "per session and range, the most bytes of output rows kept to rebuild a lost next hop"
        " (default 64 MiB; 0: keep none, a lost next hop then costs a re-prefill of the route)",
        parse=cli_args.non_negative_int,
        metavar="N",
    )
    # What the command resolves from its settings (the key read, the models hashed, the host
    # probed), and limits no flag sets.
    key: Ed25519PrivateKey | None = None  # None only in a config made to render flags
    models: tuple[LocalModel, ...] = ()
    batch_size: int | None = None
    request_timeout_s: float = 10.0
    step_push_timeout_s: float = 30.0
    session_sweep_interval_s: float = 1.0
    worker_ready_timeout_s: float = 120.0
    worker_stop_grace_s: float = 5.0
    worker_call_timeout_s: float = 60.0
    worker_binary: str | None = None
    probe: HostProbe | None = None
    probe_config: ProbeConfig = ProbeConfig()
    start_retry_initial_s: float = 0.5
    start_retry_max_s: float = 30.0
    start_retry_timeout_s: float | None = None
    verify_local_models: bool = True
    fetch: FetchConfig = FetchConfig()
    manifest_timeout_s: float = 300.0
    resume_wait_s: float = 5.0
    data_plane_host: str | None = "127.0.0.1"
    replay_merge_rows: int = 16
    row_budget: int | None = None


def worker_config(config: NodeConfig) -> WorkerConfig:
    """The worker flags of ``config``: its fields named as ``WorkerConfig``'s (None: the
    worker's own default)."""
    return WorkerConfig(model="", socket="", **shared_fields(config, WorkerConfig))


class NodeError(Exception):
    """The node cannot take part (tracker unreachable or misbehaving at registration)."""


class TrackerUnreachable(NodeError):
    """The tracker could not be reached (a transport error, not an answer)."""


class NodeRefused(NodeError):
    """The tracker refused this node; ``reason`` is the tracker's text."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"refused: {reason}")
        self.reason = reason
