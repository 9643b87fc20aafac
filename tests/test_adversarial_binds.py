"""An attack on a running swarm, made as an attacker would: a client with a self-made key opens
a session on a route's first hop and asks that node to bind it on its worker's data plane toward
a host and port of the client's choosing (to make a volunteer's worker connect and send bytes
anywhere). Real processes on loopback: a tracker and two nodes; the attacker's "target" is a
listener in this test that counts connections. The node checks the next hop against the
tracker's assignment and refuses; nothing ever connects to the target.
"""

from __future__ import annotations

import os

import pytest
import trio
from attacks import open_one_token_session

from agent._proto import swarm_pb2
from agent.core.wire.swarm_wire import NODE_PROTOCOL, SCHEMA_VERSION, parse_record
from agent.demo.swarm_demo import node_memory_bytes, wait_for_coverage
from agent.harness.local_swarm import LocalSwarmConfig, open_local_swarm
from agent.io.client import open_swarm_client
from agent.models import model_path

pytestmark = [pytest.mark.swarm, pytest.mark.slow, pytest.mark.adversarial]

ALIAS = "smollm2"


@pytest.mark.timeout(300)
async def test_a_worker_never_dials_a_host_and_port_the_tracker_did_not_assign() -> None:
    connected = []

    async def count(stream: trio.SocketStream) -> None:
        connected.append(stream)
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        target_port = listeners[0].socket.getsockname()[1]
        nursery.start_soon(trio.serve_listeners, count, listeners)
        config = LocalSwarmConfig(model_path=model_path("smollm2"), model_alias=ALIAS)
        async with open_local_swarm(config) as swarm, trio.open_nursery():
            await swarm.start_tracker()
            async with open_swarm_client(swarm.tracker_addr) as attacker:
                (entry,) = [m for m in await attacker.list_models() if m.alias == ALIAS]
                memory = node_memory_bytes(entry.n_layer, entry.bytes_per_block, 2)
                swarm.start_node("node-1", memory)
                swarm.start_node("node-2", memory)
                await wait_for_coverage(attacker, swarm, ALIAS, timeout_s=240)
                route = await attacker.route(ALIAS)
                first, second = route.hops
                session_id = os.urandom(16)
                assert (await open_one_token_session(attacker, route, session_id)).error.code == 0

                async def bind(**fields) -> swarm_pb2.NodeReply:
                    request = swarm_pb2.NodeRequest(schema_version=SCHEMA_VERSION, sender_admission=attacker.admission)
                    request.data_plane_bind.CopyFrom(
                        swarm_pb2.DataPlaneBindRequest(
                            session_id=session_id, model_sha256=route.model_sha256, begin=first.begin, end=first.end,
                            step_key=os.urandom(32), next_step_key=os.urandom(32), route_hops=2, **fields,
                        )
                    )  # fmt: skip
                    raw = await attacker.transport.request(
                        first.peer_id, list(first.addrs), NODE_PROTOCOL, request.SerializeToString(), timeout_s=30
                    )
                    return parse_record(swarm_pb2.NodeReply, raw)

                for fields, why in [
                    (dict(next_host="127.0.0.1", next_port=target_port), "names no next hop"),
                    (
                        dict(next_host="127.0.0.1", next_port=target_port, next_peer_id=second.peer_id),
                        f"at port {target_port}",
                    ),
                    (
                        dict(next_host="127.0.0.1", next_port=target_port, next_peer_id=attacker.peer_id),
                        "is not a live node",
                    ),
                ]:
                    reply = await bind(**fields)
                    assert reply.error.code != 0, reply
                    assert why in reply.error.message, reply.error.message
                assert connected == [], "a worker connected where the tracker assigned nothing"
        nursery.cancel_scope.cancel()
