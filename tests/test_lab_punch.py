"""Two nodes behind NAT punch a direct path across the lab: each machine takes inbound packets
only on flows it opened (the forwarder's stateful filter), and the nodes, started with
``--listen none --relay``, hold SmolLM2's two ranges between them. The first hop reaches the
second through the tracker's relay, asks it to punch (``agent.io.punch``), and after the TCP
simultaneous open its steps go straight to the second hop's machine. The greedy tokens equal
one unsplit worker's; the forwarder saw packets between the two NAT'd machines; the first
hop's heartbeats report the share of its step messages that went direct; and the filter still
drops a connection nobody asked for.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import trio

from agent.core.lab.topology import LinkSpec, MachineSpec, Topology
from agent.core.swarm_wire import STEP_PROTOCOL, STEPS_PROTOCOL
from agent.demo.local_demo import unsplit_greedy
from agent.demo.swarm_demo import node_memory_bytes, wait_for_coverage
from agent.harness.local_swarm import LocalSwarm, LocalSwarmConfig, Placement
from agent.io.client import open_swarm_client
from agent.io.lab.harness import running_lab
from agent.models import model_path

pytestmark = [pytest.mark.lab, pytest.mark.slow, pytest.mark.timeout(400)]

ALIAS = "smollm2"
PROMPT = "The three primary colors are"
NEW_TOKENS = 32
SETUP_TIMEOUT_S = 240.0
REPORT_TIMEOUT_S = 30.0
HOMES = ("home1", "home2")  # the NAT'd machines



def test_two_nodes_behind_nat_punch_a_direct_path(tmp_path: Path) -> None:
    path = model_path(ALIAS)
    prompt_tokens, reference = trio.run(unsplit_greedy, path, PROMPT, NEW_TOKENS)
    machines = (MachineSpec("tracker"), *(MachineSpec(home, nat=True) for home in HOMES))
    with running_lab(Topology(machines, LinkSpec(delay_ms=10.0))) as lab:
        placement = Placement(lab, {m.name: m.name for m in machines})
        swarm = LocalSwarm(LocalSwarmConfig(model_path=path, model_alias=ALIAS, placement=placement), tmp_path)

        async def body():  # noqa: ANN202
            await swarm.start_tracker()
            async with open_swarm_client(swarm.tracker_addr, listen_addrs=lab.listen_addrs("tracker")) as c:
                (entry,) = [m for m in await c.list_models() if m.alias == ALIAS]
                memory = node_memory_bytes(entry.n_layer, entry.bytes_per_block, 2)
                for home in HOMES:
                    swarm.start_node(home, memory, listen="none", relay=True)
                await wait_for_coverage(c, swarm, ALIAS, timeout_s=SETUP_TIMEOUT_S)
                before = lab.stats()
                result = await c.generate_tokens(ALIAS, prompt_tokens, max_tokens=NEW_TOKENS)
                after = lab.stats()
                first, second = (hop["node"] for hop in result.route)
                # the owner (on the tracker's machine, dialable) punched toward the first hop too
                owner_to_first = c.transport.path_counts([STEP_PROTOCOL, STEPS_PROTOCOL]).get(first, (0, 0))
                # the first hop's heartbeats report how its steps reached the second
                with trio.fail_after(REPORT_TIMEOUT_S):
                    while True:
                        (node,) = [n for n in await c.list_nodes() if n.peer_id == first]
                        paths = {p.peer_id: p for p in node.peer_paths}
                        if second in paths and paths[second].direct_messages + paths[second].relayed_messages >= NEW_TOKENS:
                            break
                        await trio.sleep(0.2)
                return before, after, result, first, second, paths[second], owner_to_first

        try:
            before, after, result, first, second, path_to_second, owner_to_first = lab.trio_run_in("tracker", body)

            # the filter is still real: nobody can open a connection into a NAT'd machine,
            # not even the other NAT'd one
            for home, dialler in ((HOMES[0], HOMES[1]), (HOMES[1], "tracker")):
                listener = lab.run_in(home, lambda: socket.create_server((lab.address(home), 0)))
                with listener:

                    def dial(port: int = listener.getsockname()[1], home: str = home) -> bool:
                        try:
                            with socket.create_connection((lab.address(home), port), timeout=1.0):
                                return True
                        except OSError:
                            return False

                    assert not lab.run_in(dialler, dial), f"{dialler} opened a connection into {home}"
            final = lab.stats()
        finally:
            swarm.close_nowait()

    assert result.tokens == reference
    names = {swarm.nodes[home].peer_id: home for home in HOMES}
    assert set(names) == {first, second}
    assert result.data_plane_steps == 0  # hops reached through the relay keep the node path

    # the two NAT'd machines talked straight to each other: packets on the link between them
    index = {name: i for i, name in enumerate(lab.topology.names)}

    def delivered(stats: dict, a: str, b: str) -> int:
        (row,) = [r for r in stats["links"] if (r["src"], r["dst"]) == (index[a], index[b])]
        return row["delivered"]

    one, two = names[first], names[second]
    assert delivered(after, one, two) - delivered(before, one, two) >= NEW_TOKENS // 2
    assert delivered(after, two, one) - delivered(before, two, one) > 0

    direct, relayed = path_to_second.direct_messages, path_to_second.relayed_messages
    share = direct / (direct + relayed)
    print(
        f"\n{one} -> {two} step messages: {direct} direct, {relayed} relayed ({share:.0%} direct); "
        f"punches: {path_to_second.punches_succeeded} made a connection, {path_to_second.punches_failed} failed; "
        f"owner -> {one}: {owner_to_first[0]} direct, {owner_to_first[1]} relayed"
    )
    assert path_to_second.punches_succeeded >= 1
    assert direct > 0 and share > 0.5
    assert relayed > 0  # the prompt's step went through the relay while the punch ran: nothing waited on it
    for home in HOMES:  # the dials above met the filter
        assert final["machines"][index[home]]["nat_drops"] > after["machines"][index[home]]["nat_drops"]
