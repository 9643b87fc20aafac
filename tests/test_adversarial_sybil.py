"""An attack on a running tracker, made as an attacker would: many self-made keys from one
address. Real processes on loopback: a tracker told to limit loopback too
(``--limit-loopback-admissions``) admits 3 new identities from one address in an hour and refuses
the 4th with RESOURCE_EXHAUSTED and when to retry, while a key it already knows is renewed; and
a tracker that asks new identities for a proof of work (``--admission-work-bits``) admits a
client and a node that solve it on their own.
"""

from __future__ import annotations

import pytest
import trio

from agent.demo.swarm_demo import node_memory_bytes
from agent.harness.local_swarm import LocalSwarmConfig, open_local_swarm
from agent.io.client import open_swarm_client
from agent.io.client.outcome import SwarmError
from agent.models import model_path

pytestmark = [pytest.mark.swarm, pytest.mark.adversarial]


@pytest.mark.timeout(180)
async def test_one_address_brings_a_bounded_number_of_new_identities_an_hour() -> None:
    config = LocalSwarmConfig(
        model_path=model_path("smollm2"),
        tracker_args=("--new-identities-per-address-per-hour", "3", "--limit-loopback-admissions"),
    )
    async with open_local_swarm(config) as swarm:
        await swarm.start_tracker()
        async with open_swarm_client(swarm.tracker_addr) as first:
            for _ in range(2):
                async with open_swarm_client(swarm.tracker_addr):
                    pass
            with pytest.raises(SwarmError, match=r"3 new identities from 127\.0\.0\.1 this hour already"):
                async with open_swarm_client(swarm.tracker_addr):
                    pass
            await first.hello()  # a known key renews its admission: not a new identity


@pytest.mark.timeout(180)
async def test_new_keys_solve_the_proof_of_work_a_tracker_asks_for() -> None:
    config = LocalSwarmConfig(model_path=model_path("smollm2"), tracker_args=("--admission-work-bits", "16"))
    async with open_local_swarm(config) as swarm:
        await swarm.start_tracker()
        async with open_swarm_client(swarm.tracker_addr) as client:  # (a new key: it solved its proof)
            (entry,) = await client.list_models()
            swarm.start_node("node-1", node_memory_bytes(entry.n_layer, entry.bytes_per_block, 1))
            with trio.fail_after(120):  # a new node's key solves its own, then registers
                while not any(n.alive for n in await client.list_nodes()):
                    await trio.sleep(0.2)
        assert "asks this new key for a proof of work of 16 bits" in swarm.nodes["node-1"].log_tail()
