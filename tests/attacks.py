"""What the adversarial tests' attackers do (not a test module): a self-admitted client opening
a one-token session on a route's first hop, as any program with its own key can."""

from __future__ import annotations

from agent._proto import swarm_pb2
from agent.core.wire.step_requests import first_step_request
from agent.core.wire.swarm_wire import STEP_PROTOCOL, parse_record
from agent.io.client import SwarmClient


async def open_one_token_session(client: SwarmClient, route: swarm_pb2.Route, session_id: bytes) -> swarm_pb2.StepAck:
    """Send step 0 of ``session_id`` (one token) to ``route``'s first hop as ``client``; the ack."""
    first = route.hops[0]
    request = first_step_request(
        session_id=session_id, step=0, hops=route.hops, token_ids=[1], first_position=0,
        recipe_hash=route.recipe_hash, model_sha256=route.model_sha256,
        owner_peer_id=client.peer_id, owner_addrs=client.transport.listen_addrs,
        sender_admission=client.admission, result_top_k=1,
    )  # fmt: skip
    raw = await client.transport.request(
        first.peer_id, list(first.addrs), STEP_PROTOCOL, request.SerializeToString(), timeout_s=30
    )
    return parse_record(swarm_pb2.StepAck, raw)
