"""A session on a worker's data plane (``DataPlane``): ``data_plane_bind`` moves the owner's
session onto its range's worker (its steps then go worker to worker; the node only admits,
leases and unbinds), once its next hop is the one the tracker lists
(``agent.core.owner.data_route.next_hop_refusal``); ``data_plane_unbind`` takes it back, with what the
worker did (steps, positions, kept rows); ``data_plane_continue`` starts a last hop's greedy
continuation to a first hop the tracker lists (``first_hop_refusal``).

Must not import ``sessions``, ``handlers`` or ``agent`` (they build on this module).
"""

from __future__ import annotations

import logging
from typing import cast

from agent._proto import swarm_pb2, worker_pb2
from agent.core.node.policy import data_plane_decode_groups, data_plane_gather_us, worker_call_failed
from agent.core.node.range_states import range_name
from agent.core.owner.data_route import first_hop_refusal, next_hop_refusal
from agent.core.wire.address_rate import counted_host
from agent.core.wire.boundary import wire_bytes
from agent.core.wire.swarm_wire import SCHEMA_VERSION, WireError, WorkerCall
from agent.io.net.transport import remote_host
from agent.io.worker.error import WorkerError

from .batches import BatchServing
from .state import ServedRange, State, clock_ms, unbind_request
from .tracker_link import TrackerLink

__all__ = ["DataPlane"]

log = logging.getLogger(__name__)

Code = swarm_pb2.Error.Code


class DataPlane(BatchServing, TrackerLink):
    """Binds, unbinds and continues sessions on the workers' data planes (a part of
    ``agent.io.node.agent.Node``)."""

    async def _check_next_hop(self, served: ServedRange, body: swarm_pb2.DataPlaneBindRequest) -> None:
        """Refuse a bind whose next hop is not what the tracker lists (``next_hop_refusal``): the
        worker would connect to whatever host and port the owner named."""
        if body.next_port:
            await self._check_listed_hop(served, body.next_peer_id, lambda nodes: next_hop_refusal(body, nodes))

    async def _bind_data_plane(self, body: swarm_pb2.DataPlaneBindRequest, remote_peer_id: str, role: int) -> bytes:
        """Bind the owner's session on this range's worker: its steps come worker to worker
        from now on (``DataPlaneBindRequest``); answers the worker's data plane port."""
        session_id = bytes(body.session_id)
        served = self._session_range(session_id, body.model_sha256, body.begin, body.end)
        assert served.sessions is not None and served.client is not None and served.info is not None
        if not served.info.data_port:
            raise WireError(Code.INVALID_ARGUMENT, f"{range_name(served.key)}: the worker has no data plane")
        opening = bool(body.open_rows) and session_id not in served.sessions  # the prompt comes on the data plane
        if opening:
            if role != swarm_pb2.ROLE_CLIENT:
                raise WireError(Code.REFUSED, f"only a client opens a session, not {remote_peer_id}")
            await self._check_next_hop(served, body)  # (before a sequence is leased for it)
            # the owner opens it at every hop itself: its own key and address count, and its trust
            served.sessions.open_for_data_plane(
                session_id, body.open_rows, remote_peer_id, clock_ms(),
                trusted=remote_peer_id in self.config.trusted_owners, source_host=counted_host(remote_host()),
            )  # fmt: skip
        self._owner_only(served, session_id, remote_peer_id, role)
        try:
            # (a worker without a cache has nothing to remember; blocks asked of it it refuses)
            prefix = opening and (
                body.prefix_blocks or (body.prefix_block_hashes and served.info.prefix_cache_sequences)
            )
            copied = await self._open_prefix(served, session_id, body) if prefix else 0
            reply = await self._bind_held(served, session_id, body, remote_peer_id, hop_checked=opening)
            if copied:
                parsed = swarm_pb2.NodeReply.FromString(reply)
                parsed.prefix_blocks = copied
                reply = parsed.SerializeToString()
            return reply
        except BaseException:
            if opening and (held := served.sessions.get(session_id)) is not None and not held.data_plane:
                served.end_session(session_id)  # opened for this bind only: its sequence goes back
            raise

    async def _bind_held(
        self,
        served: ServedRange,
        session_id: bytes,
        body: swarm_pb2.DataPlaneBindRequest,
        remote_peer_id: str,
        *,
        hop_checked: bool,
    ) -> bytes:
        """The bind of a session this range holds (``_bind_data_plane``; ``hop_checked``: its
        next hop was checked already)."""
        assert served.sessions is not None and served.client is not None and served.info is not None
        if not hop_checked:
            await self._check_next_hop(served, body)
        await self._unbind_if_bound(served, session_id)  # a bind again (another route part) starts afresh
        session = served.sessions.bind_data_plane(session_id, remote_peer_id, clock_ms())
        groups, gather_ms = self._decode_mode([body.next_host] if body.next_port else [])
        request = worker_pb2.BindSessionRequest(
            schema_version=1, session_id=session_id, seq_id=session.seq_id, step_key=body.step_key,
            next_step=session.next_step, next_host=body.next_host, next_port=body.next_port,
            next_step_key=body.next_step_key, return_key=body.return_key, continue_key=body.continue_key,
            keep_rows_max_bytes=0 if served.info.gives_logits or served.kept is None else served.kept.room(session_id),
            decode_gather_us=data_plane_gather_us(begin=served.key[1], decode_groups=groups, decode_gather_ms=gather_ms),
            decode_groups=data_plane_decode_groups(begin=served.key[1], route_hops=body.route_hops, decode_groups=groups),
            # (the swarm's DType numbers are the worker's; the worker checks the value)
            wire_dtype=cast(worker_pb2.DType, int(body.wire_dtype)),
        )  # fmt: skip
        try:
            await served.client.call("BindSession", request, timeout_s=self.config.worker_call_timeout_s)
            held = served.sessions.get(session_id)
            if held is not session or not held.data_plane:  # it ended (or was unbound) meanwhile
                await served.client.call(
                    "UnbindSession", unbind_request(session_id), timeout_s=self.config.worker_call_timeout_s
                )
                raise WireError(Code.NOT_FOUND, f"session {session_id.hex()} ended while it was being bound")
        except WorkerError as err:
            served.sessions.unbound(
                session_id, next_step=session.next_step, next_position=session.next_position, rows=0, now_ms=clock_ms()
            )
            raise worker_call_failed(
                err.code_name,
                WorkerCall.OWNER_REQUEST,
                f"{range_name(served.key)}: the worker refused the bind: {err.message}",
            ) from None
        log.info("%s: session %s on the data plane", range_name(served.key), session_id.hex())
        return swarm_pb2.NodeReply(schema_version=SCHEMA_VERSION, data_port=served.info.data_port).SerializeToString()

    async def _open_prefix(self, served: ServedRange, session_id: bytes, body: swarm_pb2.DataPlaneBindRequest) -> int:
        """Copy ``body.prefix_blocks`` leading blocks of the session's prompt from the worker's
        prefix cache into its new sequence (all hops copy as many: the owner asked each how many
        it holds first), and have the worker keep the prompt's blocks when the session ends.
        Returns the blocks copied; a worker that no longer holds them refuses (the bind fails)."""
        assert served.sessions is not None and served.client is not None
        session = served.sessions.get(session_id)
        assert session is not None  # (opened just before)
        request = worker_pb2.OpenPrefixRequest(
            schema_version=1, seq_id=session.seq_id, block_hashes=body.prefix_block_hashes,
            block_tokens=body.prefix_block_tokens, use_blocks=body.prefix_blocks,
        )  # fmt: skip
        try:
            reply = await served.client.call("OpenPrefix", request, timeout_s=self.config.worker_call_timeout_s)
        except WorkerError as err:
            raise worker_call_failed(
                err.code_name, WorkerCall.OWNER_REQUEST, f"{range_name(served.key)}: prefix not opened: {err.message}"
            ) from None
        served.sessions.opened_with_prefix(session_id, reply.next_position)
        return body.prefix_blocks

    async def _prefix_lookup(self, body: swarm_pb2.PrefixLookupRequest) -> bytes:
        """How many leading blocks of a prompt this range's worker caches (``PrefixLookupRequest``):
        what the owner asks each hop before opening a session there."""
        key = (body.model_sha256, body.begin, body.end)
        served = self._held(key)
        if served is None or served.state != State.READY or served.client is None or served.info is None:
            raise WireError(Code.NOT_FOUND, f"this node does not serve {range_name(key)} READY")
        if not served.info.prefix_cache_sequences:  # (the owner stops asking)
            raise WireError(Code.REFUSED, f"{range_name(key)} keeps no prefix cache (--prefix-cache-bytes)")
        request = worker_pb2.PrefixLookupRequest(
            schema_version=1, block_hashes=body.block_hashes, block_tokens=body.block_tokens
        )
        try:
            reply = await served.client.call("PrefixLookup", request, timeout_s=self.config.worker_call_timeout_s)
        except WorkerError as err:
            raise worker_call_failed(
                err.code_name, WorkerCall.OWNER_REQUEST, f"{range_name(served.key)}: prefix lookup: {err.message}"
            ) from None
        return swarm_pb2.NodeReply(schema_version=SCHEMA_VERSION, prefix_blocks=reply.blocks).SerializeToString()

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
                "UnbindSession", unbind_request(session_id), timeout_s=self.config.worker_call_timeout_s
            )
        except WorkerError as err:
            served.end_session(session_id)
            raise worker_call_failed(
                err.code_name, WorkerCall.CONTROL, f"{range_name(served.key)}: could not unbind: {err}"
            ) from None
        assert served.sessions is not None
        served.sessions.unbound(
            session_id, next_step=reply.next_step, next_position=reply.next_position, rows=reply.rows,
            now_ms=clock_ms(), continued_steps=reply.continued_steps if served.key[1] == 0 else 0,
        )  # fmt: skip
        if served.kept is not None and reply.kept_rows and not reply.kept_rows_lost:
            schema = served.info.boundary.schema
            # the rows as they were sent, in the session's wire dtype
            kept_dtype = reply.kept_rows_dtype or swarm_pb2.DTYPE_F32
            row_bytes = wire_bytes(kept_dtype, 1, schema.row_values)
            # each step's rows as the step that made them (a prompt chunk whole, a decode step's
            # row alone; one row a step from a worker that does not say): a replay merges them as
            # it merges the node path's steps, so the rebuild computes them in the same shapes
            shapes = list(reply.kept_step_rows) or [1] * (len(reply.kept_rows) // row_bytes)
            at = 0
            for n_rows in shapes:
                served.kept.keep(
                    session_id, reply.kept_first_position + at // row_bytes, n_rows,
                    reply.kept_rows[at : at + n_rows * row_bytes],
                    dtype=kept_dtype, schema_version=schema.version, streams=schema.streams,
                )  # fmt: skip
                at += n_rows * row_bytes

    async def _continue_data_plane(
        self, body: swarm_pb2.DataPlaneContinueRequest, remote_peer_id: str, role: int
    ) -> bytes:
        """Continuation on this last hop's worker (``DataPlaneContinueRequest``): each next decode
        step of the bound session goes from it straight to the first hop's worker, which must be
        the one the tracker lists (``first_hop_refusal``); a sampled session's tokens are drawn
        there with the owner's parameters and seed (passed on as they are: the worker checks)."""
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
            max_position=body.max_position, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
            draw_seed=body.draw_seed,
        )  # fmt: skip
        try:
            await served.client.call("ContinueSession", request, timeout_s=self.config.worker_call_timeout_s)
        except WorkerError as err:
            raise worker_call_failed(
                err.code_name,
                WorkerCall.OWNER_REQUEST,
                f"{range_name(served.key)}: the worker refused the continuation: {err.message}",
            ) from None
        log.info(
            "%s: session %s continues to the first hop %s", range_name(served.key), session_id.hex(), body.first_peer_id
        )
        return swarm_pb2.NodeReply(schema_version=SCHEMA_VERSION).SerializeToString()
