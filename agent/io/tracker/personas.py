"""The verifier's personas: fresh identities with tracker-signed admissions that play a
check's "owner" and "next hop" (``open_personas``), and the ``Inbox`` where they take what the
checked node pushes: boundary rows validated as a node would (``validate_step``) or a
``StepResult``; they answer node requests as a node does. ``libp2p_personas``: how they get a
transport in production.

Resource handling: ``open_personas`` closes every transport it opened on the way out.

Must not import ``agent.io.tracker.service`` or the verifier's check loop (``verifier``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager

import numpy as np
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent._proto import swarm_pb2
from agent.core.net.identity import peer_id_from_public_key
from agent.core.wire.admission import public_key_bytes
from agent.core.wire.step_batch import answer_step_batch
from agent.core.wire.step_validation import RangeSpec, validate_step
from agent.core.wire.swarm_wire import (
    NODE_PROTOCOL,
    RESULT_PROTOCOL,
    SCHEMA_VERSION,
    STEP_PROTOCOL,
    STEPS_PROTOCOL,
    WireError,
    node_reply_error,
    parse_record,
    step_ack,
    step_ack_error,
)
from agent.io.net.transport import Transport
from agent.io.tracker.verifier_api import OpenPersona

__all__ = ["Inbox", "Persona", "libp2p_personas", "open_personas"]

Code = swarm_pb2.Error.Code


class Inbox:
    """Where the personas of one check deliver what the checked node pushes: boundary rows
    (a ``StepRequest`` to the "next hop") or a ``StepResult`` (to the "owner"), by step."""

    def __init__(self, node_peer_id: str, session_id: bytes, downstream: RangeSpec | None) -> None:
        self.node_peer_id = node_peer_id
        self.session_id = session_id
        self.downstream = downstream
        self.step = -1
        self.arrived = trio.Event()
        self.rows: np.ndarray | None = None
        self.result: swarm_pb2.StepResult | None = None
        self.malformed = ""

    def expect(self, step: int) -> None:
        self.step, self.arrived = step, trio.Event()
        self.rows = self.result = None
        self.malformed = ""

    async def on_step(self, remote_peer_id: str, data: bytes) -> bytes:
        """The "next hop": validate the pushed step as a node would, take its rows, ack."""
        try:
            request = parse_record(swarm_pb2.StepRequest, data)
        except WireError as err:
            return step_ack(err)
        return self._take_step(remote_peer_id, request)

    async def on_steps(self, remote_peer_id: str, data: bytes) -> bytes:
        """``/baton/steps`` as a node answers it (a persona that did not would be a tell)."""
        return answer_step_batch(data, lambda request: self._take_step(remote_peer_id, request))

    def _take_step(self, remote_peer_id: str, request: swarm_pb2.StepRequest) -> bytes:
        """Check one pushed step, take its rows; its serialized ``StepAck``."""
        try:
            mine = remote_peer_id == self.node_peer_id and bytes(request.session_id) == self.session_id
            if not mine or self.downstream is None or request.step != self.step or self.arrived.is_set():
                raise WireError(
                    Code.NOT_FOUND, f"unknown session {bytes(request.session_id).hex()} at step {request.step}"
                )
            try:
                step = validate_step(request, self.downstream)
            except WireError as err:
                self.malformed = f"the pushed step is malformed: {err}"
                self.arrived.set()
                raise
            self.rows = np.array(step.rows, dtype=np.float32)
            self.arrived.set()
            return step_ack()
        except WireError as err:
            return step_ack(err)

    async def on_result(self, remote_peer_id: str, data: bytes) -> bytes:
        """The "owner": take the last range's result."""
        try:
            result = parse_record(swarm_pb2.StepResult, data)
        except WireError as err:
            return step_ack(err)
        if (
            remote_peer_id != self.node_peer_id
            or bytes(result.session_id) != self.session_id
            or result.step != self.step
        ):
            return step_ack_error(Code.NOT_FOUND, f"unknown session {bytes(result.session_id).hex()}")
        if not self.arrived.is_set():
            self.result = result
            self.arrived.set()
        return step_ack()


async def _on_node_request(remote_peer_id: str, data: bytes) -> bytes:
    """A persona answers node requests as a node does: a probe (no body) with the same
    INVALID_ARGUMENT, an end-session with success."""
    try:
        request = parse_record(swarm_pb2.NodeRequest, data)
    except WireError as err:
        return node_reply_error(err.code, err.message)
    body = request.WhichOneof("body")
    if body == "end_session":
        return swarm_pb2.NodeReply(schema_version=SCHEMA_VERSION).SerializeToString()
    if body is None:
        return node_reply_error(
            Code.INVALID_ARGUMENT, "the NodeRequest has no body (tokenize, detokenize or end_session)"
        )
    return node_reply_error(Code.NOT_FOUND, f"model {getattr(request, body).model_sha256!r} is not ready on this node")


@dataclasses.dataclass
class Persona:
    key: Ed25519PrivateKey
    transport: Transport

    @property
    def peer_id(self) -> str:
        return self.transport.peer_id

    def hop(self, begin: int, end: int) -> swarm_pb2.Hop:
        return swarm_pb2.Hop(peer_id=self.peer_id, addrs=list(self.transport.listen_addrs), begin=begin, end=end)


@contextlib.asynccontextmanager
async def open_personas(open_persona: OpenPersona, count: int, inbox: Inbox) -> AsyncIterator[list[Persona]]:
    async with contextlib.AsyncExitStack() as stack:
        personas = []
        for _ in range(count):
            key = Ed25519PrivateKey.generate()
            transport = await stack.enter_async_context(open_persona(key))
            if transport.peer_id != peer_id_from_public_key(public_key_bytes(key)):
                raise ValueError("open_persona returned a transport of another identity")
            transport.set_handler(STEP_PROTOCOL, inbox.on_step)
            transport.set_handler(STEPS_PROTOCOL, inbox.on_steps)
            transport.set_handler(RESULT_PROTOCOL, inbox.on_result)
            transport.set_handler(NODE_PROTOCOL, _on_node_request)
            personas.append(Persona(key, transport))
        yield personas


def libp2p_personas(listen: str) -> OpenPersona:
    """Fresh identities on libp2p with the direct channel in front, as nodes and owners run."""

    def open_persona(key: Ed25519PrivateKey) -> AbstractAsyncContextManager[Transport]:
        from agent.io.net.peer_transport import open_peer_transport

        return open_peer_transport(key, [listen])

    return open_persona
