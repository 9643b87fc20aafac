"""An attack on a running tracker, made as an attacker would: many self-made keys from one
address. Real processes on loopback: a tracker told to limit loopback too
(``--limit-loopback-admissions``) admits 3 new identities from one address in an hour and refuses
the 4th with RESOURCE_EXHAUSTED and when to retry, while a key it already knows is renewed; and
a tracker that asks new identities for a proof of work (``--admission-work-bits``) and an
invite (``--require-invites``) refuses a key without one and admits a client and a node that
solve their proofs on their own and bring invites its operator made (``baton tracker invite``).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import trio

from agent.demo.swarm_demo import node_memory_bytes
from agent.harness.local_swarm import LocalSwarmConfig, open_local_swarm
from agent.io.client import SwarmClientConfig, open_swarm_client
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
async def test_new_keys_solve_the_proof_of_work_and_bring_the_invites_a_tracker_asks_for() -> None:
    config = LocalSwarmConfig(
        model_path=model_path("smollm2"), tracker_args=("--admission-work-bits", "16", "--require-invites")
    )
    async with open_local_swarm(config) as swarm:
        await swarm.start_tracker()
        with pytest.raises(SwarmError, match="admits a new key only with an invite"):
            async with open_swarm_client(swarm.tracker_addr):
                pass
        client_invite, node_invite = (_make_invite(swarm.db_path) for _ in range(2))
        # (a new key: it solved its proof and brought its invite)
        async with open_swarm_client(swarm.tracker_addr, config=SwarmClientConfig(invite=client_invite)) as client:
            (entry,) = await client.list_models()
            memory = node_memory_bytes(entry.n_layer, entry.bytes_per_block, 1)
            swarm.start_node("node-1", memory, ["--invite", node_invite])
            with trio.fail_after(120):  # a new node's key solves its own, then registers with its invite
                while not any(n.alive for n in await client.list_nodes()):
                    await trio.sleep(0.2)
        assert "asks this new key for a proof of work of 16 bits" in swarm.nodes["node-1"].log_tail()


def _make_invite(db_path) -> str:
    """``baton tracker invite`` on the running tracker's database, as its operator would."""
    made = subprocess.run(
        [sys.executable, "-m", "agent.cli", "tracker", "invite", "--db", str(db_path)],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return made.stdout.strip()
