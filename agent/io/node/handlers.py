"""What a node answers (``RequestHandlers``): ``/baton/step/1.0.0`` and ``/baton/steps/1.0.0``
check the sender's admission and role, validate the step, admit it into the range's session
table, ack at once and queue it (a range that receives rebuild steps opens the session from
them); ``/baton/node/1.0.0`` dispatches tokenize / detokenize (through a worker) and the
session and data plane requests. Handlers never raise: errors become replies.

Must not import ``agent`` (it builds on this module).
"""

from __future__ import annotations

import dataclasses
import logging

from agent._proto import swarm_pb2
from agent.core.net.multiaddrs import at_seen_host
from agent.core.node.batching import forward_key
from agent.core.node.policy import check_step_sender, range_not_ready, worker_call_failed
from agent.core.node.range_states import RangeKey
from agent.core.node.scheduler import arrival_wakes_gatherer
from agent.core.wire.address_rate import counted_host
from agent.core.wire.admission import AdmissionError, AdmissionVerifier
from agent.core.wire.step_batch import answer_step_batch
from agent.core.wire.step_validation import validate_step
from agent.core.wire.swarm_wire import (
    SCHEMA_VERSION,
    WireError,
    WorkerCall,
    node_reply_error,
    parse_record,
    step_ack,
    step_ack_error,
)
from agent.io.net.transport import remote_host
from agent.io.worker.error import WorkerError

from .sessions import SessionControl
from .state import ServedRange, clock_ms, unix_ms

__all__ = ["RequestHandlers"]

log = logging.getLogger(__name__)

Code = swarm_pb2.Error.Code
State = swarm_pb2.AssignmentStatus.State
_READY = State.READY  # read on every step (an enum wrapper's attribute is a lookup)


class RequestHandlers(SessionControl):
    """The node's step and node-request handlers (a part of ``agent.io.node.agent.Node``)."""

    def _check_sender(self, signed: swarm_pb2.SignedAdmission, remote_peer_id: str) -> swarm_pb2.AdmissionRecord:
        if self._sender_admissions.tracker_public_key != self.tracker_public_key:
            self._sender_admissions = AdmissionVerifier(self.tracker_public_key)
        try:
            # the same admission arrives with every step: its signature is checked once
            return self._sender_admissions.verify(
                signed, remote_peer_id, unix_ms(), roles=[swarm_pb2.ROLE_NODE, swarm_pb2.ROLE_CLIENT]
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
        if step.owner_peer_id == remote_peer_id:
            # the owner's own step: its result is dialled back only at the host it came from
            owner_addrs = at_seen_host(step.owner_addrs, remote_host())
            if owner_addrs != step.owner_addrs:
                step = dataclasses.replace(step, owner_addrs=owner_addrs)
        trusted = step.owner_peer_id in self.config.trusted_owners
        if step.rebuild:
            session = served.sessions.accept_rebuild(
                step.session_id, step.resume_step, step.first_position, step.n_rows, step.owner_peer_id, clock_ms(),
                trusted=trusted,
            )  # fmt: skip
        else:
            # a client's own step 0 counts against its address's share too (a node forwarding
            # steps speaks for many owners: its address is not theirs)
            # (only a step 0 opens a session: later steps do not parse the address)
            opens = step.step == 0 and record.role == swarm_pb2.ROLE_CLIENT
            source = counted_host(remote_host()) if opens else ""
            session = served.sessions.accept(
                step.session_id, step.step, step.first_position, step.n_rows, step.owner_peer_id, clock_ms(),
                trusted=trusted, source_host=source,
            )  # fmt: skip
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
            if body == "prefix_lookup":
                return await self._prefix_lookup(request.prefix_lookup)
            raise WireError(
                Code.INVALID_ARGUMENT,
                "the NodeRequest has no body (tokenize, detokenize, end_session, resume_session, replay, touch, "
                "data_plane_bind, data_plane_unbind, data_plane_continue or prefix_lookup)",
            )
        except WireError as err:
            return node_reply_error(err.code, err.message)
        except WorkerError as err:
            failed = worker_call_failed(err.code_name, WorkerCall.CONTROL, f"worker: {err}")
            return node_reply_error(failed.code, failed.message)
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
