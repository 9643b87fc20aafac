"""The node agent: a volunteer machine serving layer ranges to the swarm (``serve_node``).

Owns the running node: ``Node`` (its state set up, the heartbeat loop: status of every served
range; directives and admission refreshes back; "unknown node" -> register again) and
``serve_node`` (probe, first registration with backoff, handlers installed, heartbeats and the
idle-session sweep run until cancelled). ``Node`` is made of one part per job, each a module
of ``agent.io.node`` building on ``state.NodeState``:
- ``tracker_link``: registration, relay reservation, manifests, the tracker's node list;
- ``pushes``: outputs pushed on to the next hop or the owner, failures reported;
- ``batches``: one serving task per worker, one Forward per batch;
- ``ranges``: directives, fetch or verify, the worker's start and stop;
- ``data_plane``: sessions bound to a worker's data plane;
- ``sessions``: end, touch, idle sweep, resume and replay;
- ``handlers``: ``/baton/step``, ``/baton/steps`` and ``/baton/node``.
Its configuration and errors are ``agent.io.node.config``'s.

The shell only awaits and sends; every decision is made in the pure core:
``agent.core.node.range_states`` (the range lifecycle: directives, LOADING/READY/FAILED, what a
stopped range owes), ``agent.core.node.link`` (registration and heartbeat replies,
re-registration, retry backoff), ``agent.core.node.policy`` (sender and owner rules, the
failure policy), ``agent.core.wire.swarm_wire`` (codecs, validation), ``agent.core.node.scheduler``
(which steps form a batch), ``agent.core.node.sessions`` (sequence ids, step order, leases),
``agent.core.node.kept_rows``, ``agent.core.wire.fingerprint`` and ``agent.core.wire.admission``.

Nothing of ``agent.io.node`` imports this module but ``agent.io.node.cli``.
"""

from __future__ import annotations

import logging

import trio

from agent._proto import swarm_pb2
from agent.core.net.identity import peer_id_from_public_key
from agent.core.net.multiaddrs import peer_id_from_multiaddr
from agent.core.node.link import next_retry_delay_s, read_heartbeat_reply
from agent.core.node.policy import BatchPeers
from agent.core.node.range_states import RangeBook, RangeKey
from agent.core.wire.admission import AdmissionVerifier, public_key_bytes
from agent.core.wire.fingerprint import HostProbe
from agent.core.wire.step_batch import batch_ack_accepts, step_batch_ack
from agent.core.wire.swarm_wire import (
    IDLE_STEP_REQUEST_BYTES,
    NODE_PROTOCOL,
    SCHEMA_VERSION,
    STEP_PROTOCOL,
    STEPS_PROTOCOL,
    WireError,
    node_reply_error,
    request_limits,
    step_ack_accepts,
    step_ack_error,
)
from agent.io.net.transport import ImmediateHandler, Transport, TransportError
from agent.io.worker.process import open_node_marker

from .config import DEFAULT_HEARTBEAT_INTERVAL_MS, NodeConfig, NodeError, NodeRefused, OutputsFilter, TrackerUnreachable
from .handlers import RequestHandlers
from .probe import probe_host
from .ranges import RangeRunner
from .state import ServedRange, unix_ms

__all__ = ["Node", "serve_node"]

log = logging.getLogger(__name__)

Code = swarm_pb2.Error.Code


class Node(RequestHandlers, RangeRunner):
    """A running node (what ``serve_node`` hands to ``task_status.started``).

    Attributes (read-only for callers): ``peer_id``, ``admission`` (the current
    ``SignedAdmission``), ``tracker_peer_id``, ``tracker_public_key``, ``ranges`` (range key ->
    ``ServedRange``), ``registrations`` and ``heartbeats`` (counts).
    """

    def __init__(self, config: NodeConfig, transport: Transport, outputs_filter: OutputsFilter | None = None) -> None:
        if config.key is None:
            raise ValueError("NodeConfig.key is None: a node needs its key (the command reads key_file into it)")
        self.config = config
        self.key = config.key
        self.transport = transport
        self.peer_id = peer_id_from_public_key(public_key_bytes(self.key))
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
        #: the transport's request limits (``agent.io.net.request_gate``; None: a transport without):
        #: a peer counts as admitted once it has shown this node a valid admission, and steps are
        #: as big as the ranges served take (``allow_steps_of``)
        self._request_gate = getattr(transport, "request_gate", None)
        if self._request_gate is not None:
            self._request_gate.is_admitted = self.sender_admitted
            self._request_gate.limits = request_limits(
                self._request_gate.limits.default_bytes, step_bytes=IDLE_STEP_REQUEST_BYTES
            )
        self._outputs_filter = outputs_filter
        if outputs_filter is not None:
            log.warning("this node's outputs pass through a test hook: %s", type(outputs_filter).__name__)

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
        await self._read_worker_counts()
        request = swarm_pb2.TrackerRequest(
            schema_version=SCHEMA_VERSION,
            heartbeat=swarm_pb2.HeartbeatRequest(
                peer_id=self.peer_id,
                sent_at_ms=unix_ms(),
                serving=[served.status() for served in self.ranges.values()],
                listen_addrs=self.advertised_addrs(),
                peer_paths=self.peer_paths(),
                prefixes=self.range_prefixes(),
            ),
        )
        try:
            reply = await self._tracker_call(request)
        except (TransportError, WireError) as err:
            log.warning("heartbeat failed: %s", err)
            return
        self.heartbeats += 1
        outcome = read_heartbeat_reply(
            reply, tracker_public_key=self.tracker_public_key, peer_id=self.peer_id, now_ms=unix_ms()
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


def _cannot_request_soon(*_args: object, **_kwargs: object) -> bool:
    """``request_soon`` of a transport that has none (libp2p alone, in-memory tests)."""
    return False


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
      agent.io.worker.process.WorkerBinaryNotFound: probing needs the worker binary.

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
