"""Two nodes behind NAT punch a direct path across the lab: each machine takes inbound packets
only on flows it opened (the forwarder's stateful filter), and the nodes, started with
``--listen none --relay``, hold SmolLM2's two ranges between them. The first hop reaches the
second through the tracker's relay, asks it to punch (``agent.io.net.punch``) without waiting on
it, and after the TCP simultaneous open its steps go straight to the second hop's machine: a
second generation, once the first hop reports the punch, goes direct. The greedy tokens of both
equal one unsplit worker's; the forwarder saw packets between the two NAT'd machines; the
first hop's heartbeats report the share of its step messages that went direct; and the filter
still drops a connection nobody asked for.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from agent._proto import swarm_pb2
from agent.core.lab.topology import LinkSpec, MachineSpec, Topology
from agent.core.wire.punch import PunchConfig
from agent.core.wire.swarm_wire import STEP_PROTOCOL, STEPS_PROTOCOL
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
PUNCH_TIMEOUT_S = 120.0
PUNCH_BACKOFF_S = PunchConfig().backoff_initial_s  # a failed punch waits this long before the next
HOMES = ("home1", "home2")  # the NAT'd machines


def test_two_nodes_behind_nat_punch_a_direct_path(tmp_path: Path) -> None:
    path = model_path(ALIAS)
    prompt_tokens, reference = trio.run(unsplit_greedy, path, PROMPT, NEW_TOKENS)
    machines = (MachineSpec("tracker"), *(MachineSpec(home, nat=True) for home in HOMES))
    with running_lab(Topology(machines, LinkSpec(delay_ms=10.0))) as lab:
        placement = Placement(lab, {m.name: m.name for m in machines})
        swarm = LocalSwarm(LocalSwarmConfig(model_path=path, model_alias=ALIAS, placement=placement), tmp_path)

        async def body():
            await swarm.start_tracker()
            async with open_swarm_client(swarm.tracker_addr, listen_addrs=lab.listen_addrs("tracker")) as c:
                (entry,) = [m for m in await c.list_models() if m.alias == ALIAS]
                memory = node_memory_bytes(entry.n_layer, entry.bytes_per_block, 2)
                for home in HOMES:
                    swarm.start_node(home, memory, listen="none", relay=True)
                await wait_for_coverage(c, swarm, ALIAS, timeout_s=SETUP_TIMEOUT_S)
                # the first generation finds the hops reachable only through the relay: its steps
                # go relayed while the punch runs beside them (nothing waits on it)
                warm = await c.generate_tokens(ALIAS, prompt_tokens, max_tokens=NEW_TOKENS)
                first, second = (hop["node"] for hop in warm.route)

                async def path_now() -> swarm_pb2.PeerPath:
                    # the first hop's heartbeats report how its steps reached the second
                    (node,) = [n for n in await c.list_nodes() if n.peer_id == first]
                    paths = {p.peer_id: p for p in node.peer_paths}
                    return paths.get(second, swarm_pb2.PeerPath(peer_id=second))

                async def path_to_second(done: Callable[[swarm_pb2.PeerPath], bool]) -> swarm_pb2.PeerPath:
                    with trio.fail_after(REPORT_TIMEOUT_S):
                        while not done(path := await path_now()):
                            await trio.sleep(0.2)
                        return path

                # A punch that fails (its SYNs or its coordination over the relay late on a loaded
                # host) is tried again by the next relayed step after its backoff: generate again
                # until the first hop reports a punch that made a connection.
                retries = 0
                with trio.fail_after(PUNCH_TIMEOUT_S):
                    while (punched := await path_now()).punches_succeeded == 0:
                        if punched.punches_failed > retries:
                            retries += 1
                            await trio.sleep(PUNCH_BACKOFF_S)
                            again = await c.generate_tokens(ALIAS, prompt_tokens, max_tokens=NEW_TOKENS)
                            assert again.tokens == reference
                        await trio.sleep(0.2)
                sent = punched.direct_messages + punched.relayed_messages
                # the second generation, once the punch made a connection, goes straight across
                before = lab.stats()
                result = await c.generate_tokens(ALIAS, prompt_tokens, max_tokens=NEW_TOKENS)
                after = lab.stats()
                assert [hop["node"] for hop in result.route] == [first, second]
                # the owner (on the tracker's machine, dialable) punched toward the first hop too
                owner_to_first = c.transport.path_counts([STEP_PROTOCOL, STEPS_PROTOCOL]).get(first, (0, 0))
                ended = await path_to_second(lambda p: p.direct_messages + p.relayed_messages >= sent + NEW_TOKENS)
                return before, after, warm, result, first, second, punched, ended, owner_to_first

        try:
            before, after, warm, result, first, second, punched, ended, owner_to_first = lab.trio_run_in(
                "tracker", body
            )

            # the filter is still real: nobody can open a connection into a NAT'd machine,
            # not even the other NAT'd one
            for home, dialler in ((HOMES[0], HOMES[1]), (HOMES[1], "tracker")):
                listener = lab.run_in(home, lambda home=home: socket.create_server((lab.address(home), 0)))
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

    assert warm.tokens == reference
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

    # step messages from the first hop to the second, in the first generation (and the punch's
    # time after it) and in the second
    warm_direct, warm_relayed = punched.direct_messages, punched.relayed_messages
    direct = ended.direct_messages - warm_direct
    relayed = ended.relayed_messages - warm_relayed
    share = direct / (direct + relayed)
    print(
        f"\n{one} -> {two} step messages: first generation {warm_direct} direct, {warm_relayed} relayed; "
        f"once punched {direct} direct, {relayed} relayed ({share:.0%} direct); "
        f"punches: {ended.punches_succeeded} made a connection, {ended.punches_failed} failed; "
        f"owner -> {one}: {owner_to_first[0]} direct, {owner_to_first[1]} relayed"
    )
    assert warm_relayed > 0  # the prompt's step went through the relay while the punch ran: nothing waited on it
    assert share >= 0.9
    for home in HOMES:  # the dials above met the filter
        assert final["machines"][index[home]]["nat_drops"] > after["machines"][index[home]]["nat_drops"]
