"""A node's sessions (``SessionControl``): end_session (frees the sequence in every range here,
forwards the end along ``rest``), touch (renews the owner's lease), idle sessions freed after a
timeout, and resuming a session whose route lost a hop: every output row a range pushes
downstream is kept per session (``agent.core.node.kept_rows``, bounded in bytes);
``resume_session`` trims a surviving session back to the positions the owner keeps (its cache
stays), ``replay`` sends the kept rows as rebuild steps to the replacement of the lost next hop.

The rules are ``agent.core.node.sessions``' and ``agent.core.node.policy``'s. Must not import
``handlers`` or ``agent`` (they build on this module).
"""

from __future__ import annotations

import logging

import trio

from agent._proto import swarm_pb2
from agent.core.net.multiaddrs import at_seen_host
from agent.core.node.kept_rows import RowsNotKept
from agent.core.node.policy import check_end_session_sender, worker_call_failed
from agent.core.node.range_states import range_name
from agent.core.wire.step_requests import replay_step_request
from agent.core.wire.step_validation import check_hops
from agent.core.wire.swarm_wire import (
    NODE_PROTOCOL,
    SCHEMA_VERSION,
    SESSION_ID_BYTES,
    STEP_PROTOCOL,
    WireError,
    WorkerCall,
    parse_record,
)
from agent.io.net.transport import TransportError, remote_host
from agent.io.worker.error import WorkerError

from .data_plane import DataPlane
from .state import ServedRange, clock_ms, unbind_request

__all__ = ["SessionControl"]

log = logging.getLogger(__name__)

Code = swarm_pb2.Error.Code


class SessionControl(DataPlane):
    """Ends, renews, sweeps, resumes and replays sessions (a part of ``agent.io.node.agent.Node``)."""

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
        stall_ms = int(self.config.session_stall_timeout_s * 1000)
        while True:
            await trio.sleep(self.config.session_sweep_interval_s)
            for served in list(self.ranges.values()):
                if served.sessions is None or served.scheduler is None:
                    continue
                await self._note_bound_progress(served, stall_ms)
                now = clock_ms()
                for session_id in served.sessions.idle(now, timeout_ms):
                    log.info("%s: session %s idle, freed", range_name(served.key), session_id.hex())
                    served.end_session(session_id)
                for session_id in served.sessions.stalled(now, stall_ms):
                    log.info(
                        "%s: session %s took no step for %.0f s (touched only), freed",
                        range_name(served.key), session_id.hex(), self.config.session_stall_timeout_s,
                    )  # fmt: skip
                    served.end_session(session_id)
            self.sweeps += 1

    async def _note_bound_progress(self, served: ServedRange, stall_ms: int) -> None:
        """Ask the worker what the sessions bound on its data plane that look stalled did
        (their steps do not come through this node), so that only those that really took no
        step are freed."""
        assert served.sessions is not None
        if served.client is None:
            return
        for session_id in served.sessions.stalled(clock_ms(), stall_ms, bound=True):
            try:
                held = await served.client.call(
                    "UnbindSession",
                    unbind_request(session_id, keep_bound=True),
                    timeout_s=self.config.worker_call_timeout_s,
                )
            except WorkerError as err:  # (the worker's failure is noticed elsewhere) judge it stalled
                log.debug("progress of session %s: %s", session_id.hex(), err)
                continue
            served.sessions.note_bound_progress(session_id, held.next_step, clock_ms())

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
        now = clock_ms()
        held = [
            s.sessions.touch(session_id, remote_peer_id, now) for s in self.ranges.values() if s.sessions is not None
        ]
        if not any(held):
            raise WireError(Code.NOT_FOUND, f"no session {session_id.hex()} of {remote_peer_id} here")
        return swarm_pb2.NodeReply(schema_version=SCHEMA_VERSION).SerializeToString()

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
                unbind_request(session_id, keep_bound=True),
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
            session_id, body.keep_positions, body.next_step, remote_peer_id, clock_ms()
        )
        if trim:
            try:
                held = await served.client.trim_sequence(
                    session.seq_id, body.keep_positions, timeout_s=self.config.worker_call_timeout_s
                )
            except WorkerError as err:
                served.end_session(session_id)  # its positions on the worker are unknown now
                raise worker_call_failed(
                    err.code_name, WorkerCall.CONTROL, f"{range_name(served.key)}: could not trim: {err}"
                ) from None
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
        owner_addrs = list(at_seen_host(tuple(body.owner_addrs), remote_host()))
        for chunk in chunks:
            request = replay_step_request(
                session_id=session_id, resume_step=body.resume_step, hops=body.to, chunk=chunk,
                n_embd=served.spec.n_embd, recipe_hash=served.spec.recipe_hash, model_sha256=served.spec.model_sha256,
                owner_peer_id=remote_peer_id, owner_addrs=owner_addrs, sender_admission=self.admission,
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
