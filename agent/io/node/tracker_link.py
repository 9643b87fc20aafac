"""A node's link to its tracker (``TrackerLink``): registration with a signed fingerprint
(refused -> ``NodeRefused``), the relay reservation, what each heartbeat reports besides the
ranges' statuses (advertised addresses, peer paths, the workers' data plane counts), manifests,
and the tracker's node list for checking a data plane hop.

The decisions are ``agent.core.node.link``'s (registration and heartbeat replies) and
``agent.core.wire.fingerprint``'s. Must not import the node's other mixins or ``agent``: it builds
on ``agent.io.node.state`` only.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

import trio

from agent._proto import swarm_pb2
from agent.core.net.multiaddrs import circuit_multiaddr
from agent.core.node.link import RegistrationInvalid, RegistrationRefused, read_registration_reply
from agent.core.node.range_states import range_name
from agent.core.wire.admission_work import solve_work, work_asked
from agent.core.wire.fingerprint import HostProbe, build_fingerprint, signed_fingerprint
from agent.core.wire.manifest import verify_manifest
from agent.core.wire.swarm_wire import (
    MAX_HEARTBEAT_PREFIX_TAGS,
    MAX_PREFIX_TAGS,
    RESULT_PROTOCOL,
    SCHEMA_VERSION,
    STEP_PROTOCOL,
    STEPS_PROTOCOL,
    TRACKER_PROTOCOL,
    WireError,
    parse_record,
)
from agent.io.net.transport import TransportError
from agent.io.worker.error import WorkerError

from .config import NodeError, NodeRefused, TrackerUnreachable
from .fetch import FetchError
from .state import NodeState, ServedRange, unix_ms

__all__ = ["NODE_LIST_REUSE_S", "TrackerLink"]

log = logging.getLogger(__name__)

Code = swarm_pb2.Error.Code
State = swarm_pb2.AssignmentStatus.State


#: How long a bind's next-hop check reuses the tracker's entry of that peer, seconds: binds
#: toward one hop come together (an entry that refuses is asked for again before the bind is
#: refused).
NODE_LIST_REUSE_S = 2.0


class TrackerLink(NodeState):
    """The node's calls to its tracker (a part of ``agent.io.node.agent.Node``)."""

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
        work = b""
        while True:
            fingerprint = build_fingerprint(
                probe,
                peer_id=self.peer_id,
                listen_addrs=self.advertised_addrs(),
                model_sha256s=sorted(self.models),
                usable_memory_bytes=self.config.memory_bytes
                if self.config.memory_bytes is not None
                else probe.ram_available_bytes,
                created_at_ms=unix_ms(),
                nonce=os.urandom(16),
                fetches_models=self.config.models_dir is not None,
            )
            signed = signed_fingerprint(self.key, fingerprint)
            request = swarm_pb2.TrackerRequest(
                schema_version=SCHEMA_VERSION,
                register=swarm_pb2.RegisterRequest(fingerprint=signed, work=work, invite=self.config.invite),
            )
            try:
                reply = await self._tracker_call(request)
            except TransportError as err:
                raise TrackerUnreachable(f"tracker {self.tracker_peer_id} unreachable: {err}") from err
            except WireError as err:
                raise NodeError(f"tracker answered a malformed reply: {err}") from err
            try:
                registered = read_registration_reply(
                    reply, tracker_peer_id=self.tracker_peer_id, peer_id=self.peer_id, now_ms=unix_ms(),
                    own_heartbeat_interval=self.config.heartbeat_interval_ms is not None,
                )  # fmt: skip
                break
            except RegistrationRefused as err:
                if work or not work_asked(err.work_bits):
                    raise NodeRefused(err.reason) from None
                # a new identity where the operator asks for work: solved once, then registered again
                log.info("the tracker asks this new key for a proof of work of %d bits", err.work_bits)
                work = await trio.to_thread.run_sync(solve_work, bytes(signed.public_key), err.work_bits)
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

    def _prefix_tags_max(self) -> int:
        """Tags of its prefix cache each worker names (``prefix_report_tags``, at most what a
        tracker takes; 0 without a cache)."""
        return min(self.config.prefix_report_tags, MAX_PREFIX_TAGS) if self.config.prefix_cache_bytes else 0

    def range_prefixes(self) -> list[swarm_pb2.RangePrefixes]:
        """Which prefix blocks each READY range's cache holds, as its worker said before this
        heartbeat (``_read_worker_counts``), at most ``MAX_HEARTBEAT_PREFIX_TAGS`` in all
        (each range's most recently used first)."""
        reports = []
        room = MAX_HEARTBEAT_PREFIX_TAGS
        for served in self.ranges.values():
            if served.state != State.READY or served.worker_health is None or not served.worker_health.prefix_tags:
                continue
            tags = served.worker_health.prefix_tags[:room]
            room -= len(tags)
            if tags:
                model_sha256, begin, end = served.key
                assignment = swarm_pb2.Assignment(model_sha256=model_sha256, begin=begin, end=end)
                reports.append(swarm_pb2.RangePrefixes(assignment=assignment, tags=tags))
        return reports

    async def _read_worker_counts(self) -> None:
        """Each READY range's worker's data plane and prefix cache counts and the prefix blocks
        its cache holds (``ServedRange.worker_health``); a worker that does not answer keeps its
        last (its exit is noticed elsewhere)."""
        for served in list(self.ranges.values()):
            info = served.info
            if served.state != State.READY or served.client is None or info is None:
                continue
            if not (info.data_port or info.prefix_cache_bytes):
                continue
            try:
                served.worker_health = await served.client.health(
                    timeout_s=self.config.worker_call_timeout_s, prefix_tags_max=self._prefix_tags_max()
                )
            except WorkerError as err:
                log.debug("%s: worker counts: %s", range_name(served.key), err)

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

    async def _check_listed_hop(
        self, served: ServedRange, peer_id: str, refusal: Callable[[Sequence[swarm_pb2.NodeEntry]], str | None]
    ) -> None:
        """Refuse (REFUSED, its reason) unless ``refusal`` passes ``peer_id``'s entry in the
        tracker's node list: fetched within NODE_LIST_REUSE_S, it serves; one that refuses is
        fetched again first (the hop may have become READY since)."""
        cached = self._next_hops.get(peer_id)
        if cached is not None and trio.current_time() - cached[0] <= NODE_LIST_REUSE_S and refusal(cached[1]) is None:
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
