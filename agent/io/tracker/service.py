"""The tracker service: the ``/baton/tracker/1.0.0`` handler and the heartbeat sweeper.

Owns the tracker's behaviour on the wire (docs/ARCHITECTURE.md, "The swarm protocol"): registration
(admission of nodes), client hellos, heartbeats (liveness, reported range status, LOAD /
UNLOAD directives, admission refresh), routes, the model list, model metadata (a GGUF's
bytes before its tensor data, read from the registered file once and kept in memory), the
node list; and when assignments are recomputed (a node registers, dies, or comes back).
Decisions are the pure core's: admissions (``agent.core.wire.admission``), route planning
(``routing``), canaries (``canary``), and the live state as a reducer
(``agent.core.tracker.reducer.apply(state, event, now_ms)``: registrations, heartbeats,
sweeps, suspects, withdrawals, the assignment and which ranges are routable). ``Tracker``
feeds it events (``_apply``) with the one clock it was given (unix ms following trio's clock),
keeps the state it returns in ``state``, and performs its effects in order: store writes
(the SQLite store is the state's durable copy, read back at a restart), the canary
schedule's bookkeeping, logs, wake-ups; the request handlers turn the rest into replies.

Output integrity (docs/INTEGRITY.md): the tracker's part (canary outcomes, withdrawn ranges, the
gate on routes, owners' integrity requests and mismatch reports) is ``OutputIntegrity``
(``agent.io.tracker.integrity``), mixed into ``Tracker``; the registered files' metadata and
manifests are ``ModelFiles`` (``agent.io.tracker.model_files``); probes of peers an owner lost
are ``LostPeerProbes`` (``agent.io.tracker.probes``); settings are ``agent.io.tracker.config``.

Liveness: a node is alive while heartbeats (or its registration) arrive at most
``heartbeat_timeout_ms`` apart; the sweeper marks it dead at exactly that deadline, clears its
reported states and recomputes assignments (healing). After a tracker restart, nodes the
database still holds alive are *pending*: their assignments are kept (so that the first
node to heartbeat does not take over everyone's ranges) but they are in no route until they
heartbeat; one that does not within ``heartbeat_timeout_ms`` of the restart is marked dead.

Authorization: registration and heartbeats are checked against the connection's peer id (the
Noise-authenticated key); routes, the model list, model metadata and the node list change no
state and answer any peer that reaches the tracker. The node list shows at once what routes
hand out piecemeal (where admitted nodes listen, what they serve) plus their liveness and
usable memory; model metadata is the public header of a registered GGUF.

Every request gets a ``TrackerReply``; malformed input (bytes that do not parse, a wrong
schema version, no body, bad fields) gets ``error`` naming what was wrong, and an unexpected
exception is logged and answered with INTERNAL. Nothing a peer sends stops the tracker.

Resource handling: ``serve_tracker`` sets the handler on the transport it is given and runs
the sweeper; it does not own the transport or the store (callers open and close them).
Cancellation: cancelling ``serve_tracker`` stops the sweeper; the handler stays registered on
the transport (a closed transport stops calling it).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent._proto import swarm_pb2
from agent.core.net.identity import peer_id_from_public_key
from agent.core.tracker import state as ev
from agent.core.tracker.assignment import Assignment, ModelSpec
from agent.core.tracker.handouts import RouteHandouts
from agent.core.tracker.heartbeat import admission_due
from agent.core.tracker.liveness import Liveness
from agent.core.tracker.reducer import apply, next_sweep_in_ms, ready_ranges, restore
from agent.core.tracker.routing import NoRoute, RoutePrefix, plan_route
from agent.core.wire import admission
from agent.core.wire.address_rate import LOOPBACK_NETWORKS, KeyedRate, NewIdentityRate, parse_networks
from agent.core.wire.swarm_wire import (
    SCHEMA_VERSION,
    TRACKER_PROTOCOL,
    WireError,
    parse_record,
    tracker_reply_error,
)
from agent.io.net.transport import remote_host
from agent.io.tracker.admissions import Admissions, node_facts
from agent.io.tracker.config import TrackerConfig, trio_unix_clock
from agent.io.tracker.integrity import OutputIntegrity
from agent.io.tracker.model_files import ModelFiles
from agent.io.tracker.probes import LostPeerProbes
from agent.io.tracker.refusal import Refusal
from agent.io.tracker.store import TrackerStore
from agent.io.tracker.verifier_api import OpenPersona, VerifierConfig

__all__ = ["Tracker", "serve_tracker"]

log = logging.getLogger(__name__)

Code = swarm_pb2.Error
State = swarm_pb2.AssignmentStatus


class Tracker(OutputIntegrity, Admissions):
    """The tracker's live state around its store. Made by ``serve_tracker`` (handed to
    ``task_status.started``); tests read ``alive``/``pending`` and wait with ``wait_until``."""

    def __init__(
        self,
        transport,
        store: TrackerStore,
        config: TrackerConfig,
        key: Ed25519PrivateKey,
        clock: Callable[[], int],
    ) -> None:
        self.transport = transport
        self.store = store
        self.config = config
        self._key = key
        self.public_key = admission.public_key_bytes(key)
        self.peer_id = peer_id_from_public_key(self.public_key)
        #: the registered files' metadata and signed manifests, and where nodes fetch them
        self.model_files = ModelFiles(store, key, self.peer_id, clock)
        self._now_ms = clock
        now = clock()
        #: the live state (liveness, suspects, the assignment and what nodes report, withdrawn
        #: and failed ranges): only ``_apply`` replaces it; the store is its durable copy
        self.state = restore(
            ev.TrackerRules(
                config.heartbeat_timeout_ms,
                config.registration_max_age_ms,
                config.nonce_retention_ms,
                loading_base_ms=round(config.loading_deadline_base_s * 1000),
                loading_min_bytes_per_s=config.loading_min_bytes_per_s,
                proven_needs_check=config.canary is not None and config.canary.gate_new_ranges,
            ),
            (node_facts(node.peer_id, node.fingerprint) for node in store.nodes()),
            (node.peer_id for node in store.nodes() if node.alive),
            {node.peer_id: node.listen_addrs for node in store.nodes()},
            {row.assignment: ev.RangeStatus(row.state, row.recipe_hash) for row in store.assignments()},
            now,
        )
        #: new identities admitted per source address (the Sybil cost of a free key)
        exempt = (*config.admission_rate_exempt, *(() if config.limit_loopback_admissions else LOOPBACK_NETWORKS))
        self.new_identities = NewIdentityRate(
            config.new_identities_per_address_per_hour, 3_600_000, parse_networks(exempt)
        )
        #: route requests per peer (a route is a planning pass over every ready range)
        self.route_requests = KeyedRate(config.route_requests_per_peer_per_s, 1000)
        #: probes of peers an owner lost (``report_lost_peer``)
        self.lost_peers = LostPeerProbes(transport, store, config.lost_peer_probe_timeout_s, self._apply)
        self._init_integrity(config.canary)
        #: routes handed out, counted on their hops until heartbeats show them (seconds of the
        #: tracker's clock, as ``state.heard_at_ms``)
        self.handouts = RouteHandouts(config.route_handout_grace_s)
        self._changed = trio.Event()

    @property
    def pending(self) -> set[str]:
        """Nodes alive before a restart that have not heartbeat since."""
        return self.liveness.pending

    @property
    def alive(self) -> set[str]:
        return self.liveness.alive

    @property
    def liveness(self) -> Liveness:
        return self.state.liveness

    @property
    def withdrawn(self) -> frozenset[tuple[str, str]]:
        """(peer id, model sha256) whose output failed a check (not assigned, not routed)."""
        return self.state.withdrawn

    @property
    def recomputes(self) -> int:
        return self.state.recomputes

    def _apply(self, event: ev.Event) -> list[ev.Effect]:
        """Feed ``event`` to the reducer at the tracker's clock, perform the effects that are
        store writes, canary bookkeeping, logs and wake-ups; return them all (the caller
        answers with the ``Refuse``, ``Directives``, ``ReportAnswered`` or ``ProbePeer``)."""
        now = self._now_ms()
        self.state, effects = apply(self.state, event, now)
        for effect in effects:
            self._perform(effect, now)
        return effects

    def _perform(self, effect: ev.Effect, now: int) -> None:
        if isinstance(effect, ev.StoreHeartbeat):
            addrs = list(effect.listen_addrs) if effect.listen_addrs is not None else None
            self.store.record_heartbeat(effect.peer_id, now, addrs, effect.serving)
        elif isinstance(effect, ev.StoreStatus):
            self.store.set_status(effect.assignment, effect.state, effect.recipe_hash, effect.error, now)
        elif isinstance(effect, ev.ClearStatus):
            self.store.clear_status(effect.peer_id)
        elif isinstance(effect, ev.MarkDead):
            for peer in effect.peer_ids:
                self.store.clear_status(peer)
                if self.canaries is not None:
                    self.canaries.forget_node(peer)
            self.store.mark_dead(effect.peer_ids)
            log.info("%s, marked dead: %s", effect.why, ", ".join(effect.peer_ids))
        elif isinstance(effect, ev.StoreAssignments):
            self.store.replace_assignments(effect.assignments)
        elif isinstance(effect, ev.PruneNonces):
            self.store.prune_nonces(effect.before_ms)
        elif isinstance(effect, ev.SyncChecks):
            if self.canaries is not None and self.canaries.sync_node(
                effect.peer_id, list(effect.ready), trio.current_time()
            ):
                self._notify()  # the verifier checks them now
        elif isinstance(effect, ev.ForgetChecks):
            if self.canaries is not None:
                self.canaries.forget_node(effect.peer_id)
        elif isinstance(effect, ev.LoadFailed):
            a = effect.status.assignment
            log.warning(
                "node %s failed to load model %s blocks [%d, %d): %s; not assigning it there again",
                effect.peer_id, a.model_sha256, a.begin, a.end, effect.status.error,
            )  # fmt: skip
        elif isinstance(effect, ev.Log):
            log.log(logging.WARNING if effect.level == "warning" else logging.INFO, "%s", effect.message)
        elif isinstance(effect, ev.Notify):
            self._notify()
        # Refuse, Directives, ReportAnswered, ProbePeer: answered by the request's handler

    def models_changed(self) -> None:
        """Tell the reducer the registered models and which nodes may fetch (at start, and
        when the tracker starts serving its files); counted at the next recompute."""
        models = tuple(ModelSpec(m.sha256, m.n_layer, m.bytes_per_block) for m in self.store.models())
        fetchable = frozenset(m.sha256 for m in self.model_files.models() if m.has_source)
        self._apply(ev.ModelsChanged(models, fetchable))

    def set_model_base_url(self, url: str) -> None:
        """Nodes may fetch the registered files from ``url`` (``--serve-models``)."""
        self.model_files.model_base_url = url
        self.models_changed()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` is true (checked after every state change)."""
        while not predicate():
            await self._changed.wait()

    async def changed(self) -> None:
        """Return at the next state change (a heartbeat, a registration, a check's outcome)."""
        await self._changed.wait()

    # --- relay admission ------------------------------------------------------------------------

    def may_hold_relay_reservation(self, peer_id: str) -> bool:
        """Whether ``peer_id`` may be reached through the tracker's circuit relay: an admitted
        node (admission not expired) that is alive or pending. Never raises (it runs inside
        the relay's stream handler); asked on every reservation and refresh, and for the
        destination of every circuit."""
        try:
            if peer_id not in self.liveness:
                return False
            node = self.store.node(peer_id)
            return node is not None and self._now_ms() < node.expires_at_ms
        except Exception:
            log.exception("relay admission check for %s failed", peer_id)
            return False

    def may_open_relay_circuit(self, peer_id: str) -> bool:
        """Whether ``peer_id`` may open circuits through the tracker's relay: a node that
        ``may_hold_relay_reservation``, or a client whose admission has not expired. Never
        raises."""
        if self.may_hold_relay_reservation(peer_id):
            return True
        try:
            signed = self.store.client_admission(peer_id)
            if signed is None:
                return False
            record = swarm_pb2.AdmissionRecord.FromString(signed.record)
            return record.peer_id == peer_id and self._now_ms() < record.expires_at_ms
        except Exception:
            log.exception("relay circuit check for %s failed", peer_id)
            return False

    # --- requests -----------------------------------------------------------------------------

    async def handle(self, remote_peer_id: str, payload: bytes) -> bytes:
        """The TRACKER protocol handler: one TrackerRequest in, one TrackerReply out, always."""
        try:
            request = parse_record(swarm_pb2.TrackerRequest, payload)
            kind = request.WhichOneof("body")
            if kind is None:
                raise Refusal(
                    Code.INVALID_ARGUMENT,
                    "TrackerRequest has no body (expected one of register, heartbeat, route, list_models, "
                    "client_hello, model_metadata, list_nodes, report_lost_peer, integrity, report_mismatch, session_ended)",
                )
            reply = swarm_pb2.TrackerReply(schema_version=SCHEMA_VERSION)
            if kind == "register":
                reply.register.CopyFrom(self._register(remote_peer_id, request.register))
            elif kind == "heartbeat":
                reply.heartbeat.CopyFrom(self._heartbeat(remote_peer_id, request.heartbeat))
            elif kind == "route":
                reply.route.CopyFrom(self._route(remote_peer_id, request.route))
            elif kind == "session_ended":
                counted = self.handouts.end(request.session_ended.handout_ids, remote_peer_id)
                reply.session_ended.CopyFrom(swarm_pb2.SessionEndedReply(counted=counted))
            elif kind == "list_models":
                reply.list_models.CopyFrom(swarm_pb2.ListModelsReply(models=self.model_files.models()))
            elif kind == "model_metadata":
                reply.model_metadata.CopyFrom(await self.model_files.model_metadata(request.model_metadata))
            elif kind == "list_nodes":
                wanted = set(request.list_nodes.peer_ids)
                nodes = [n for n in self.node_entries() if not wanted or n.peer_id in wanted]
                reply.list_nodes.CopyFrom(swarm_pb2.ListNodesReply(nodes=nodes))
            elif kind == "report_lost_peer":
                reply.report_lost_peer.CopyFrom(await self.lost_peers.report(remote_peer_id, request.report_lost_peer))
            elif kind == "integrity":
                reply.integrity.CopyFrom(self._integrity(request.integrity))
            elif kind == "report_mismatch":
                reply.report_mismatch.CopyFrom(self._report_mismatch(remote_peer_id, request.report_mismatch))
            else:
                reply.client_hello.CopyFrom(self._client_hello(remote_peer_id, request.client_hello))
            return reply.SerializeToString()
        except WireError as error:
            return tracker_reply_error(error.code, error.message)
        except Refusal as refusal:
            return tracker_reply_error(refusal.code, refusal.message, work_bits=refusal.work_bits)
        except Exception as error:  # a bug: answer, log, keep serving
            log.exception("tracker request from %s failed", remote_peer_id)
            return tracker_reply_error(Code.INTERNAL, f"internal error: {type(error).__name__}: {error}")

    def _heartbeat(self, remote: str, beat: swarm_pb2.HeartbeatRequest) -> swarm_pb2.HeartbeatReply:
        if beat.peer_id != remote:
            raise Refusal(
                Code.REFUSED, f"peer id mismatch: the heartbeat names {beat.peer_id!r}, the connection is from {remote}"
            )
        node = self.store.node(remote)
        if node is None:
            raise Refusal(Code.NOT_FOUND, "unknown node: register first")
        if self.store.refused(remote):
            # it registers again and is refused with the reason (and stops)
            raise Refusal(Code.NOT_FOUND, "unknown node: register first (this node was refused)")
        now = self._now_ms()
        if now >= node.expires_at_ms:
            raise Refusal(Code.NOT_FOUND, "unknown node: register first (its admission expired)")
        beat_event = ev.Heartbeat(
            remote, tuple(beat.serving), tuple(beat.peer_paths), tuple(beat.listen_addrs) or None, tuple(beat.prefixes),
            remote_host(),
        )  # fmt: skip
        reply = swarm_pb2.HeartbeatReply()
        for effect in self._apply(beat_event):
            if isinstance(effect, ev.Refuse):
                raise Refusal(effect.code, effect.message)
            if isinstance(effect, ev.Directives):
                for a in effect.load:
                    reply.directives.add(kind=swarm_pb2.Directive.LOAD, assignment=_wire_assignment(a))
                for a in effect.unload:
                    reply.directives.add(kind=swarm_pb2.Directive.UNLOAD, assignment=_wire_assignment(a))
        if admission_due(node.expires_at_ms, now, self.config.admission_ttl_ms):
            fresh = self._issue(remote, swarm_pb2.ROLE_NODE, now, admission.fingerprint_sha256(node.signed_fingerprint))
            self.store.update_admission(remote, fresh, now + self.config.admission_ttl_ms)
            reply.admission.CopyFrom(fresh)
        return reply

    def _route(self, remote: str, request: swarm_pb2.RouteRequest) -> swarm_pb2.Route:
        wait_ms = self.route_requests.take(remote, self._now_ms())
        if wait_ms:
            raise Refusal(
                Code.RESOURCE_EXHAUSTED,
                f"{self.route_requests.per_window} route requests this second already: ask again in {wait_ms} ms",
            )
        if not request.model:
            raise Refusal(Code.INVALID_ARGUMENT, "RouteRequest.model is empty (give an alias, name or sha256)")
        model = self.store.find_model(request.model)
        if model is None:
            raise Refusal(Code.NOT_FOUND, f"unknown model {request.model!r}")
        ready = ready_ranges(self.state, model.sha256, cleared=self._cleared, session_cap=self.config.route_session_cap)
        try:
            prefix = RoutePrefix.read(request.prefix_tags, request.prefix_tag_blocks, request.prefix_block_tokens)
        except ValueError as error:
            raise Refusal(Code.INVALID_ARGUMENT, f"RouteRequest: {error}") from None
        now_s = self._now_ms() / 1000.0
        try:
            plan = plan_route(
                request.model,
                model.sha256,
                model.n_layer,
                ready,
                load=self.handouts.load(now_s, {p: ms / 1000.0 for p, ms in self.state.heard_at_ms.items()}),
                hop_latency_s=self.config.hop_latency_s,
                avoid=request.avoid_peers,
                begin=request.begin,
                end=request.end or None,
                recipe_hash=request.recipe_hash,
                prefix=prefix,
                prefix_discount_per_token=self.config.prefix_discount_per_token,
                prefix_discount_max=self.config.prefix_discount_max,
            )
        except NoRoute as error:
            raise Refusal(Code.UNAVAILABLE, str(error)) from None
        handout_id = self.handouts.hand_out(now_s, [h.peer_id for h in plan.hops], remote)
        return swarm_pb2.Route(
            model_sha256=plan.model_sha256,
            n_layer=plan.n_layer,
            hops=[swarm_pb2.Hop(peer_id=h.peer_id, addrs=list(h.addrs), begin=h.begin, end=h.end) for h in plan.hops],
            recipe_hash=plan.recipe_hash,
            estimated_step_s=plan.estimated_step_s,
            handout_id=handout_id,
        )

    def node_entries(self) -> list[swarm_pb2.NodeEntry]:
        """The node list as ``list_nodes`` answers it: the store's view with the running
        service's liveness, load failures and, per READY range, whether it awaits its first
        check (set here, whatever a node put in that field of its heartbeat)."""
        entries = self.store.node_entries(alive=self.alive, pending=self.pending)
        for entry in entries:
            entry.load_failures.extend(self.state.load_failures.get(entry.peer_id, ()))
            entry.peer_paths.extend(self.state.peer_paths.get(entry.peer_id, ()))
            entry.seen_host = self.state.seen_hosts.get(entry.peer_id, "")
            for status in entry.serving:
                a = status.assignment
                status.awaiting_check = status.state == State.READY and not self._cleared(
                    (entry.peer_id, a.model_sha256, a.begin, a.end)
                )
        return entries

    # --- liveness and assignment ----------------------------------------------------------------

    def _recompute(self) -> None:
        """Recompute the assignment set from the models and the alive + pending nodes."""
        self._apply(ev.Recompute())

    def sweep(self) -> float:
        """Mark nodes past their deadline dead (recomputing if any) and prune old nonces.
        Returns the ms until the next deadline (inf when none)."""
        self._apply(ev.Sweep())
        return next_sweep_in_ms(self.state, self._now_ms())

    async def run_sweeper(self) -> None:
        while True:
            wait_ms = self.sweep()
            changed = self._changed
            with trio.move_on_after(min(wait_ms, self.config.registration_max_age_ms) / 1000.0):
                await changed.wait()


def _wire_assignment(a: Assignment) -> swarm_pb2.Assignment:
    return swarm_pb2.Assignment(model_sha256=a.model_sha256, begin=a.begin, end=a.end)


async def serve_tracker(
    transport,
    store: TrackerStore,
    config: TrackerConfig,
    key: Ed25519PrivateKey,
    *,
    clock: Callable[[], int] | None = None,
    verifier: VerifierConfig | None = None,
    open_persona: OpenPersona | None = None,
    task_status: trio.TaskStatus[Tracker] = trio.TASK_STATUS_IGNORED,  # type: ignore[name-defined]  # trio-typing's stale trio stubs
) -> None:
    """Serve the TRACKER protocol on ``transport`` until cancelled.

    Args:
      transport: a ``Transport`` whose peer id is ``key``'s (libp2p or memory).
      store: the open tracker database.
      config: tracker settings.
      key: the tracker's Ed25519 key (signs admissions; its public key goes to peers).
      clock: unix time in ms; default ``trio_unix_clock()`` (follows trio's clock).
      verifier: with ``config.canary``: the verifier's workers and deadlines (default
        ``VerifierConfig()``); it runs in this call's nursery (``serve_verifier``).
      open_persona: how the verifier's fresh identities get a transport (default: libp2p).
      task_status: started with the ``Tracker`` (for tests and the CLI).

    Raises:
      ValueError: ``key`` is not the transport's identity.
    """
    tracker = Tracker(transport, store, config, key, clock or trio_unix_clock())
    if tracker.peer_id != transport.peer_id:
        raise ValueError(f"the tracker key belongs to {tracker.peer_id}, the transport is {transport.peer_id}")
    # A model registered while the tracker was down, or nodes gone: bring assignments up to date.
    tracker.models_changed()
    tracker._recompute()
    transport.set_handler(TRACKER_PROTOCOL, tracker.handle)
    task_status.started(tracker)
    async with trio.open_nursery() as nursery:
        if config.prepare_manifests_at_start:
            nursery.start_soon(tracker.model_files.prepare_manifests)
        if config.canary is not None:
            from agent.io.tracker.verifier import serve_verifier
            from agent.io.tracker.verifier_api import VerifierConfig

            await nursery.start(
                functools.partial(serve_verifier, tracker, verifier or VerifierConfig(), open_persona=open_persona)
            )
        await tracker.run_sweeper()
