"""The owner's control exchanges: the tracker (the hello that gets a CLIENT admission and its
renewal, routes and route parts, waiting for a route, lost-peer and mismatch reports, integrity,
listings, model metadata, the end of a generation's route handouts) and a route's first hop
(tokenize, detokenize, end session).

``ControlClient`` is the base of ``agent.io.client.swarm.SwarmClient``: it holds the transport,
the config and the admission every later layer uses (``steps``, ``session_run``, ``resume``,
``swarm``, each a subclass of the one before).

Must not import the client's session modules (``live``, ``steps``, ``session_run``, ``resume``,
``swarm``): nothing here sends a step or waits for a result.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import time
from collections.abc import Callable, Sequence

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.protobuf.message import DecodeError

from agent._proto import swarm_pb2
from agent.core.net.identity import peer_id_from_public_key
from agent.core.net.multiaddrs import peer_id_from_multiaddr
from agent.core.owner.prefix_blocks import block_hashes, owner_salt, prefix_seed, route_tags
from agent.core.owner.route_repair import end_session_request, surviving_hops
from agent.core.wire.admission import AdmissionError, make_client_hello, verify_admission
from agent.core.wire.admission_work import solve_work, work_asked
from agent.core.wire.swarm_wire import NODE_PROTOCOL, SCHEMA_VERSION, TRACKER_PROTOCOL
from agent.io.client.config import SwarmClientConfig
from agent.io.client.outcome import GenerationError, SwarmError
from agent.io.net.transport import Transport, TransportError

log = logging.getLogger(__name__)

#: the route handouts of the generation running in this task (``generate_tokens``), reported
#: to the tracker when it ends (``agent.core.tracker.handouts``)
_GENERATION_HANDOUTS: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("handouts", default=None)


def reporting_handouts(method):
    """Collect the route handouts a generation gets (``route()`` adds them) and report them
    ended to the tracker when it ends, however it ends."""

    @functools.wraps(method)
    async def generate(self, *args, **kwargs):
        route = kwargs.get("route")
        handouts = [route.handout_id] if route is not None and route.handout_id else []
        collecting = _GENERATION_HANDOUTS.set(handouts)
        try:
            return await method(self, *args, **kwargs)
        finally:
            _GENERATION_HANDOUTS.reset(collecting)
            with trio.CancelScope(shield=True):
                await self._sessions_ended(handouts)

    return generate


_NONCE_BYTES = 16


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def split_peer_addr(addr: str) -> tuple[str, list[str]]:
    """``(peer_id, [addr])`` of a multiaddr ending in ``/p2p/<peer id>``.

    Raises:
      ValueError: the address names no peer id.
    """
    return peer_id_from_multiaddr(addr), [addr]


class ControlClient:
    """The control exchanges of a client admitted by a tracker (the base of ``SwarmClient``)."""

    def __init__(
        self,
        transport: Transport,
        key: Ed25519PrivateKey,
        tracker_peer_id: str,
        tracker_addrs: Sequence[str],
        config: SwarmClientConfig,
        now_ms: Callable[[], int] = now_ms,
    ) -> None:
        self.transport = transport
        self.config = config
        self.tracker_peer_id = tracker_peer_id
        self.tracker_addrs = list(tracker_addrs)
        self.tracker_public_key = b""
        self.admission = swarm_pb2.SignedAdmission()
        self._key = key
        self._now_ms = now_ms
        self._admission_record = swarm_pb2.AdmissionRecord()
        self._last_routes: dict[str, swarm_pb2.Route] = {}  # model -> the tracker's last route
        #: (peer, begin, end) of hops that said they keep no prefix cache: not asked again
        self._no_prefix_cache: set[tuple[str, int, int]] = set()
        #: model sha256 -> its architecture (the tracker's model list, asked once a model)
        self._architectures: dict[str, str] = {}
        #: the salt of this owner's prefix block hashes where a generation names none (the
        #: relay names one per API key): see ``owner_salt`` for why per owner
        self.prefix_salt = owner_salt(key.private_bytes_raw())

    @property
    def peer_id(self) -> str:
        return self.transport.peer_id

    # --- tracker -----------------------------------------------------------------------------

    async def _exchange(self, peer_id: str, addrs: Sequence[str], protocol: str, request, reply):
        """Send ``request`` on ``protocol``, parse the answer into ``reply`` (a message of the
        expected type) and raise ``SwarmError`` for an error reply or bytes that do not parse."""
        request.schema_version = SCHEMA_VERSION
        raw = await self.transport.request(
            peer_id, list(addrs), protocol, request.SerializeToString(), timeout_s=self.config.request_timeout_s
        )
        try:
            reply.ParseFromString(raw)
        except DecodeError:
            raise SwarmError(peer_id, swarm_pb2.Error.INTERNAL, f"malformed {type(reply).__name__}") from None
        if reply.error.code != swarm_pb2.Error.CODE_UNSPECIFIED:
            raise SwarmError(peer_id, reply.error.code, reply.error.message, work_bits=reply.error.work_bits)
        return reply

    async def _tracker(self, request: swarm_pb2.TrackerRequest) -> swarm_pb2.TrackerReply:
        return await self._exchange(
            self.tracker_peer_id, self.tracker_addrs, TRACKER_PROTOCOL, request, swarm_pb2.TrackerReply()
        )

    async def hello(self) -> None:
        """Get a (new) CLIENT admission from the tracker.

        Raises:
          SwarmError: the tracker refused, or its key does not belong to its peer id.
          TransportError: the tracker could not be reached.
        """
        hello = make_client_hello(self._key, self._now_ms(), os.urandom(_NONCE_BYTES))
        hello.invite = self.config.invite
        try:
            reply = await self._tracker(swarm_pb2.TrackerRequest(client_hello=hello))
        except SwarmError as refused:
            if not work_asked(refused.work_bits):
                raise
            # a new identity where the operator asks for work: once, then a fresh hello with it
            log.info("the tracker asks this new key for a proof of work of %d bits", refused.work_bits)
            work = await trio.to_thread.run_sync(solve_work, bytes(hello.public_key), refused.work_bits)
            hello = make_client_hello(self._key, self._now_ms(), os.urandom(_NONCE_BYTES))
            hello.work, hello.invite = work, self.config.invite
            reply = await self._tracker(swarm_pb2.TrackerRequest(client_hello=hello))
        if reply.WhichOneof("body") != "client_hello":
            raise SwarmError(self.tracker_peer_id, swarm_pb2.Error.INTERNAL, "the hello reply has no admission")
        tracker_key = bytes(reply.client_hello.tracker_public_key)
        try:
            key_peer_id = peer_id_from_public_key(tracker_key)
        except ValueError as error:
            raise SwarmError(self.tracker_peer_id, swarm_pb2.Error.INTERNAL, str(error)) from None
        if key_peer_id != self.tracker_peer_id:
            raise SwarmError(
                self.tracker_peer_id,
                swarm_pb2.Error.REFUSED,
                f"the tracker's public key belongs to {key_peer_id}, not to the tracker dialled",
            )
        try:
            record = verify_admission(
                reply.client_hello.admission, tracker_key, self.peer_id, self._now_ms(), roles=[swarm_pb2.ROLE_CLIENT]
            )
        except AdmissionError as error:
            raise SwarmError(self.tracker_peer_id, swarm_pb2.Error.INTERNAL, f"unusable admission: {error}") from None
        self.tracker_public_key = tracker_key
        self.admission = reply.client_hello.admission
        self._admission_record = record

    async def _fresh_admission(self) -> None:
        """Renew the admission past its half-life. While the tracker cannot be reached, an
        admission that has not expired is used as it is (running swarms do not need the
        tracker)."""
        record = self._admission_record
        half_life_ms = (record.expires_at_ms - record.issued_at_ms) // 2
        if not record.expires_at_ms or self._now_ms() >= record.issued_at_ms + half_life_ms:
            try:
                await self.hello()
            except TransportError as error:
                if not record.expires_at_ms or self._now_ms() >= record.expires_at_ms:
                    raise
                log.warning("the tracker cannot be reached (%s): keeping the current admission", error)

    async def route(
        self,
        model: str,
        *,
        avoid_peers: Sequence[str] = (),
        part: tuple[int, int, str] | None = None,
        prompt: Sequence[int] = (),
        prefix_salt: bytes | None = None,
    ) -> swarm_pb2.Route:
        """The tracker's route for ``model`` (alias, name or sha256), around ``avoid_peers``.
        ``part``: ``(begin, end, recipe hash)``: hops for blocks ``[begin, end)`` only, of that
        recipe (a replacement for a lost range). ``prompt``: the session's prompt tokens, whose
        prefix blocks (hashed under ``prefix_salt``, as its session's will be; None: this owner's
        own, ``self.prefix_salt``) the tracker then prefers hops holding in their caches
        (``route_prefix``).

        While the tracker cannot be reached, the last (whole) route it gave for ``model`` is
        used (if it avoids ``avoid_peers``), with a warning: running swarms do not need the
        tracker.

        Raises:
          SwarmError: e.g. UNAVAILABLE when some blocks have no ready node (or none without
            ``avoid_peers``), NOT_FOUND for an unknown model.
          TransportError: the tracker could not be reached and no route for ``model`` was seen.
        """
        request = swarm_pb2.RouteRequest(model=model, avoid_peers=list(avoid_peers))
        if part is not None:
            request.begin, request.end, request.recipe_hash = part
        elif prompt:
            self.route_prefix(request, prompt, self.prefix_salt if prefix_salt is None else prefix_salt)
        try:
            reply = await self._tracker(swarm_pb2.TrackerRequest(route=request))
        except TransportError as error:
            last = self._last_routes.get(model)
            if part is not None or last is None or set(avoid_peers) & {hop.peer_id for hop in last.hops}:
                raise
            log.warning("the tracker cannot be reached (%s): using the last route it gave for %r", error, model)
            return last
        route = reply.route
        if reply.WhichOneof("body") != "route" or not route.hops:
            raise SwarmError(
                self.tracker_peer_id, swarm_pb2.Error.INTERNAL, f"the route reply for {model!r} has no hops"
            )
        if route.handout_id and (handouts := _GENERATION_HANDOUTS.get()) is not None:
            handouts.append(route.handout_id)
        if part is None:
            self._last_routes[model] = route
        return route

    def route_prefix(self, request: swarm_pb2.RouteRequest, prompt: Sequence[int], salt: bytes = b"") -> None:
        """Name ``prompt``'s prefix blocks in ``request`` (``prefix_blocks.route_tags``), hashed
        as a session's on the owner's last route of the model would be (the recipe and the
        chunk size seed the hashes): none before a first route, or with the cache or the tags off."""
        last = self._last_routes.get(request.model)
        block_tokens, max_tags = self.config.prefix_block_tokens, self.config.prefix_route_tags
        if last is None or not block_tokens or not max_tags:
            return
        seed = prefix_seed(last.model_sha256, last.recipe_hash, block_tokens, self.config.prefill_chunk_tokens, salt)
        tags = route_tags(block_hashes(prompt, block_tokens, seed), max_tags)
        request.prefix_tag_blocks.extend(blocks for blocks, _tag in tags)
        request.prefix_tags.extend(tag for _blocks, tag in tags)
        request.prefix_block_tokens = block_tokens if tags else 0

    async def report_lost_peer(self, peer_id: str, reason: str) -> bool:
        """Tell the tracker this owner lost ``peer_id``; True when the tracker confirmed it
        (its probe got no answer either) and took it out of routes. Best effort: a tracker
        that cannot be reached gives False."""
        request = swarm_pb2.ReportLostPeerRequest(peer_id=peer_id, reason=reason[:500])
        try:
            reply = await self._tracker(swarm_pb2.TrackerRequest(report_lost_peer=request))
        except (SwarmError, TransportError) as error:
            log.info("could not report the lost peer %s to the tracker: %s", peer_id, error)
            return False
        return reply.report_lost_peer.confirmed

    async def integrity(self, peer_ids: Sequence[str]) -> swarm_pb2.IntegrityReply:
        """Which of ``peer_ids`` the tracker says failed an integrity check lately."""
        reply = await self._tracker(swarm_pb2.TrackerRequest(integrity=swarm_pb2.IntegrityRequest(peer_ids=peer_ids)))
        return reply.integrity

    async def report_mismatch(self, report: swarm_pb2.ReportMismatchRequest) -> swarm_pb2.ReportMismatchReply:
        """Tell the tracker a spot check disagreed (it checks the peers the routes differ in)."""
        reply = await self._tracker(swarm_pb2.TrackerRequest(report_mismatch=report))
        return reply.report_mismatch

    async def list_models(self) -> list[swarm_pb2.ModelEntry]:
        reply = await self._tracker(swarm_pb2.TrackerRequest(list_models=swarm_pb2.ListModelsRequest()))
        self._architectures.update((m.sha256, m.architecture) for m in reply.list_models.models)
        return list(reply.list_models.models)

    async def architecture(self, model_sha256: str) -> str:
        """The architecture of the model ``model_sha256`` (the tracker's list, asked once; "" when
        it lists no such model)."""
        if model_sha256 not in self._architectures:
            await self.list_models()
        return self._architectures.get(model_sha256, "")

    async def model_metadata(self, model: str) -> swarm_pb2.ModelMetadataReply:
        """The registered GGUF's metadata bytes (everything before its tensors) and size.

        Raises:
          SwarmError: NOT_FOUND for an unknown model; UNAVAILABLE when the tracker cannot read it.
          TransportError: the tracker could not be reached.
        """
        request = swarm_pb2.TrackerRequest(model_metadata=swarm_pb2.ModelMetadataRequest(model=model))
        reply = await self._tracker(request)
        if reply.WhichOneof("body") != "model_metadata":
            raise SwarmError(
                self.tracker_peer_id, swarm_pb2.Error.INTERNAL, f"the metadata reply for {model!r} is empty"
            )
        return reply.model_metadata

    async def list_nodes(self) -> list[swarm_pb2.NodeEntry]:
        """The tracker's nodes: addresses, liveness, what each serves and was assigned."""
        reply = await self._tracker(swarm_pb2.TrackerRequest(list_nodes=swarm_pb2.ListNodesRequest()))
        return list(reply.list_nodes.nodes)

    async def wait_for_route(
        self, model: str, *, timeout_s: float, avoid_peers: Sequence[str] = (), part: tuple[int, int, str] | None = None
    ) -> swarm_pb2.Route:
        """Poll ``route(model)`` (or a ``part`` of it: see ``route``) until it succeeds
        without any of ``avoid_peers``.

        Raises:
          GenerationError: no such route within ``timeout_s`` (the last reason in the message).
        """
        avoid = set(avoid_peers)
        last = "no answer yet"
        with trio.move_on_after(timeout_s):
            while True:
                try:
                    route = await self.route(model, avoid_peers=sorted(avoid), part=part)
                except (SwarmError, TransportError) as error:
                    last = str(error)
                else:
                    bad = avoid & {hop.peer_id for hop in route.hops}
                    if not bad:
                        return route
                    last = f"the route still goes through {', '.join(sorted(bad))}"
                await trio.sleep(self.config.route_poll_interval_s)
        raise GenerationError(f"no route for {model!r} within {timeout_s} s: {last}", code=swarm_pb2.Error.UNAVAILABLE)

    # --- first hop -----------------------------------------------------------------------------

    async def _node(self, hop: swarm_pb2.Hop, request: swarm_pb2.NodeRequest) -> swarm_pb2.NodeReply:
        request.sender_admission.CopyFrom(self.admission)
        return await self._exchange(hop.peer_id, hop.addrs, NODE_PROTOCOL, request, swarm_pb2.NodeReply())

    async def tokenize(
        self, route: swarm_pb2.Route, text: str, *, add_special: bool = True
    ) -> tuple[list[int], list[int]]:
        """``(token ids, end-of-generation token ids)`` from the route's first hop."""
        reply = await self._node(
            route.hops[0],
            swarm_pb2.NodeRequest(
                tokenize=swarm_pb2.TokenizeRequest(model_sha256=route.model_sha256, text=text, add_special=add_special)
            ),
        )
        return list(reply.token_ids), list(reply.eog_token_ids)

    async def detokenize(self, route: swarm_pb2.Route, token_ids: Sequence[int]) -> bytes:
        """The tokens' pieces joined, as bytes, by the route's first hop (decode what is whole)."""
        reply = await self._node(
            route.hops[0],
            swarm_pb2.NodeRequest(
                detokenize=swarm_pb2.DetokenizeRequest(model_sha256=route.model_sha256, token_ids=list(token_ids))
            ),
        )
        return reply.text

    async def end_session(
        self, route: swarm_pb2.Route, session_id: bytes, *, lost_peers: Sequence[str] = ()
    ) -> list[swarm_pb2.SessionRows]:
        """Free ``session_id`` on every hop of ``route`` but the ``lost_peers`` (through the
        first of the others, which passes it on); the rows each hop says it computed for it."""
        hops = surviving_hops(route, lost_peers)
        if not hops:
            return []
        reply = await self._node(hops[0], end_session_request(session_id, route, self.admission, lost_peers))
        return list(reply.session_rows)

    async def _sessions_ended(self, handout_ids: list[int]) -> None:
        """Tell the tracker the routes handed out for a generation carry its session no more
        (so it stops counting them at once, not at the hops' next heartbeats); best effort."""
        if not handout_ids:
            return
        request = swarm_pb2.TrackerRequest(session_ended=swarm_pb2.SessionEndedRequest(handout_ids=handout_ids))
        with trio.move_on_after(self.config.session_ended_timeout_s):
            try:
                await self._tracker(request)
            except (SwarmError, TransportError) as error:
                log.info("could not tell the tracker the session ended: %s", error)
