"""A node behind NAT across the lab: its machine takes inbound packets only on flows it opened
(the forwarder's stateful filter), so nobody can dial it. Started with ``--listen none
--relay``, it reserves a slot on the tracker's circuit relay and serves the middle range of
SmolLM2 through it: the hop before reaches it only through the tracker's machine, and the
greedy tokens equal one unsplit worker's. It runs with ``--no-punch``, so that the relay
carries every step (hole punching is tests/test_lab_punch.py).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import trio

from agent.core.lab.topology import LinkSpec, MachineSpec, Topology
from agent.demo.local_demo import unsplit_greedy
from agent.demo.swarm_demo import node_memory_bytes, wait_for_coverage
from agent.harness.local_swarm import LocalSwarm, LocalSwarmConfig, Placement
from agent.io.client import open_swarm_client
from agent.io.lab.harness import running_lab
from agent.models import model_path

pytestmark = [pytest.mark.lab, pytest.mark.slow, pytest.mark.timeout(400)]

ALIAS = "smollm2"
PROMPT = "The three primary colors are"
NEW_TOKENS = 16
SETUP_TIMEOUT_S = 240.0
HOME = "home"  # the NAT'd machine


def test_a_node_behind_nat_serves_through_the_tracker_relay(tmp_path: Path) -> None:
    path = model_path(ALIAS)
    prompt_tokens, reference = trio.run(unsplit_greedy, path, PROMPT, NEW_TOKENS)
    machines = (MachineSpec("tracker"), MachineSpec("a"), MachineSpec("b"), MachineSpec(HOME, nat=True))
    with running_lab(Topology(machines, LinkSpec(delay_ms=10.0))) as lab:
        placement = Placement(lab, {m.name: m.name for m in machines})
        swarm = LocalSwarm(LocalSwarmConfig(model_path=path, model_alias=ALIAS, placement=placement), tmp_path)

        async def body():
            await swarm.start_tracker()
            async with open_swarm_client(swarm.tracker_addr, listen_addrs=lab.listen_addrs("tracker")) as c:
                (entry,) = [m for m in await c.list_models() if m.alias == ALIAS]
                memory = node_memory_bytes(entry.n_layer, entry.bytes_per_block, 3)
                swarm.start_node("a", memory)
                swarm.start_node("b", memory)
                swarm.start_node(HOME, memory, ["--no-punch"], listen="none", relay=True)
                await wait_for_coverage(c, swarm, ALIAS, timeout_s=SETUP_TIMEOUT_S)
                before = lab.stats()
                result = await c.generate_tokens(ALIAS, prompt_tokens, max_tokens=NEW_TOKENS)
                return before, result

        try:
            before, result = lab.trio_run_in("tracker", body)
            after = lab.stats()

            # the filter is real: a machine of the lab cannot open a connection into HOME
            listener = lab.run_in(HOME, lambda: socket.create_server((lab.address(HOME), 0)))
            with listener:

                def dial() -> bool:
                    try:
                        with socket.create_connection((lab.address(HOME), listener.getsockname()[1]), timeout=1.0):
                            return True
                    except OSError:
                        return False

                assert not lab.run_in("a", dial)
            assert lab.stats()["machines"][3]["nat_drops"] > 0
        finally:
            swarm.close_nowait()

    assert result.tokens == reference
    home_id = swarm.nodes[HOME].peer_id
    assert home_id in [h["node"] for h in result.route]
    assert result.data_plane_steps == 0  # a hop reached through the relay keeps the node path

    # HOME's steps came through the tracker's machine: its link to the tracker carried them
    names = lab.topology.names

    def delivered(stats: dict, a: str, b: str) -> int:
        (row,) = [r for r in stats["links"] if (names[r["src"]], names[r["dst"]]) == (a, b)]
        return row["delivered"]

    assert delivered(after, "tracker", HOME) - delivered(before, "tracker", HOME) >= NEW_TOKENS
