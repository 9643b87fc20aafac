"""An attack on a running swarm, made as an attacker would: self-made client keys lock a route's
sequences by opening one-token sessions on its first hop and then only touching them.

Real processes on loopback: a tracker, one node serving the whole of SmolLM2 with 4 sequences,
a relay with a paying key; the attackers are real clients (their own keys, admitted for free by
the tracker) that speak the node protocol directly. The node trusts its relay
(``--trusted-owner``): a reserve of its sequences no self-made key can take, so the paying
request is served at its normal speed while the attack goes on; and a touch cannot hold a
session that takes no steps (``--session-stall-timeout-s``), so the attackers' sessions are
freed.
"""

from __future__ import annotations

import os
import time

import openai
import pytest
import trio
from attacks import open_one_token_session

from agent._proto import swarm_pb2
from agent.core.wire.swarm_wire import NODE_PROTOCOL, SCHEMA_VERSION, parse_record
from agent.demo.swarm_demo import node_memory_bytes, wait_for_coverage
from agent.harness.local_swarm import LocalSwarmConfig, open_local_swarm
from agent.io.client import SwarmClient, open_swarm_client
from agent.models import model_path

pytestmark = [pytest.mark.swarm, pytest.mark.slow, pytest.mark.adversarial]

ALIAS = "smollm2"
SEQUENCES = 4
STALL_S = 12.0  # the node's --session-stall-timeout-s
TOUCH_EVERY_S = 1.0  # the attackers' touches: well inside the node's 5 s idle lease


async def _open_and_hold(
    client: SwarmClient, sessions: int, opened: list[bytes], all_opened: int, held: trio.Event
) -> None:
    """Open ``sessions`` one-token sessions on the route's first hop as ``client``, then touch
    them every ``TOUCH_EVERY_S`` until none is held any more; sets ``held`` once ``opened`` (all
    attackers' sessions) has ``all_opened``."""
    route = await client.route(ALIAS)
    first = route.hops[0]
    mine: list[bytes] = []
    for _ in range(sessions):
        session_id = os.urandom(16)
        ack = await open_one_token_session(client, route, session_id)
        assert ack.error.code == 0, f"the attack could not open a session: {ack.error.message}"
        mine.append(session_id)
    opened.extend(mine)
    if len(opened) == all_opened:
        held.set()
    while mine:
        await trio.sleep(TOUCH_EVERY_S)  # (the attack's own pace, not a synchronisation)
        for session_id in list(mine):
            touch = swarm_pb2.NodeRequest(schema_version=SCHEMA_VERSION, sender_admission=client.admission)
            touch.touch.session_id = session_id
            raw = await client.transport.request(
                first.peer_id, list(first.addrs), NODE_PROTOCOL, touch.SerializeToString(), timeout_s=10
            )
            if parse_record(swarm_pb2.NodeReply, raw).error.code == swarm_pb2.Error.NOT_FOUND:
                mine.remove(session_id)  # freed by the node


@pytest.mark.timeout(420)
async def test_self_made_keys_touching_sessions_cannot_lock_out_the_relay() -> None:
    config = LocalSwarmConfig(model_path=model_path("smollm2"), model_alias=ALIAS)
    async with open_local_swarm(config) as swarm:
        await swarm.start_tracker()
        relay_peer_id = swarm.peer_id("relay")  # its key exists before the relay runs
        async with open_swarm_client(swarm.tracker_addr) as watcher:
            (entry,) = [m for m in await watcher.list_models() if m.alias == ALIAS]
            swarm.start_node(
                "node-1",
                node_memory_bytes(entry.n_layer, entry.bytes_per_block, 1),
                ["--max-sequences", str(SEQUENCES), "--owner-max-share", "0.75", "--trusted-owner", relay_peer_id,
                 "--session-stall-timeout-s", str(STALL_S)],
            )  # fmt: skip
            await wait_for_coverage(watcher, swarm, ALIAS, timeout_s=240)
        await swarm.start_relay()
        key = swarm.add_relay_key("paying")
        api = openai.OpenAI(base_url=f"{swarm.relay_url}/v1", api_key=key, max_retries=0, timeout=120.0)

        def paying_request() -> float:
            started = time.monotonic()
            reply = api.chat.completions.create(
                model=ALIAS, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0
            )
            assert reply.choices[0].finish_reason in ("stop", "length")
            return time.monotonic() - started

        try:
            normal_s = await trio.to_thread.run_sync(paying_request)  # before the attack (warm)
            opened: list[bytes] = []
            held = trio.Event()
            async with open_swarm_client(swarm.tracker_addr) as a, open_swarm_client(swarm.tracker_addr) as b:
                assert a.peer_id != b.peer_id  # two self-made keys
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_open_and_hold, a, 2, opened, 3, held)
                    nursery.start_soon(_open_and_hold, b, 1, opened, 3, held)
                    with trio.fail_after(60):
                        await held.wait()
                    # every untrusted sequence is taken (3 of 4: the 4th is the relay's reserve)
                    route = await a.route(ALIAS)
                    ack = await open_one_token_session(b, route, os.urandom(16))
                    assert ack.error.code == swarm_pb2.Error.RESOURCE_EXHAUSTED, ack
                    assert "kept for owners this node trusts" in ack.error.message

                    attacked_s = await trio.to_thread.run_sync(paying_request)  # during the attack
                    assert attacked_s < max(10.0, 4 * normal_s), (
                        f"the paying request took {attacked_s:.1f} s under attack, {normal_s:.1f} s before"
                    )
                    # touches alone cannot keep the sessions: freed after the stall bound
                    with trio.fail_after(STALL_S + 30):
                        while opened and nursery.child_tasks:
                            await trio.sleep(0.2)  # polling the attackers' tasks, which end when freed
        finally:
            api.close()
