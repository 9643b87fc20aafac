"""An attack on a running swarm, made as an attacker would: a node that claims the memory for
almost the whole model waits for an honest node to miss its heartbeats, takes over its range,
and then never serves it (it says LOADING for ever).

Real processes on loopback: a tracker, two honest nodes with the model on disk, and a third
node that claims 29 of SmolLM2's 30 blocks and fetches what it is assigned from a source that
accepts connections and never answers (a fetch that stalls, as a node lying about its download
looks to the tracker). The tracker takes a range back when it is not READY by its loading
deadline, and gives a range back to the node that served it when that node returns while the
replacement is still loading.
"""

from __future__ import annotations

import time

import pytest
import trio

from agent._proto import swarm_pb2
from agent.demo.swarm_demo import node_memory_bytes, wait_for_coverage
from agent.harness.local_swarm import LocalSwarmConfig, open_local_swarm
from agent.io.client import SwarmClient, open_swarm_client
from agent.models import model_path

pytestmark = [pytest.mark.swarm, pytest.mark.slow, pytest.mark.adversarial]

ALIAS = "smollm2"
DEADLINE_S = 20.0  # the tracker's --loading-deadline-base-s (bytes at an unbounded rate add nothing)


async def _silent_source(task_status=trio.TASK_STATUS_IGNORED) -> None:
    """An HTTP "model source" that accepts connections and never answers them."""

    async def hold(stream: trio.SocketStream) -> None:
        async with stream:
            await trio.sleep_forever()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(hold, listeners)


async def _assigned(client: SwarmClient, peer_id: str) -> swarm_pb2.NodeEntry | None:
    (entry,) = [n for n in await client.list_nodes() if n.peer_id == peer_id] or [None]
    return entry


async def _poll(predicate, timeout_s: float, what: str) -> float:
    """Wait until ``await predicate()`` is true; the seconds it took."""
    started = time.monotonic()
    with trio.move_on_after(timeout_s):
        while not await predicate():
            await trio.sleep(0.2)
        return time.monotonic() - started
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s")


@pytest.mark.timeout(420)
async def test_a_node_that_never_loads_holds_no_range_past_its_deadline_nor_against_the_node_that_served_it() -> None:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(_silent_source)
        config = LocalSwarmConfig(
            model_path=model_path("smollm2"),
            model_alias=ALIAS,
            tracker_args=(
                "--model-source", f"{ALIAS}=http://127.0.0.1:{port}/smollm2.gguf",
                "--loading-deadline-base-s", str(DEADLINE_S), "--loading-min-bytes-per-s", str(10**15),
            ),
        )  # fmt: skip
        async with open_local_swarm(config) as swarm:
            await swarm.start_tracker()
            async with open_swarm_client(swarm.tracker_addr) as watcher:
                (entry,) = [m for m in await watcher.list_models() if m.alias == ALIAS]
                honest = node_memory_bytes(entry.n_layer, entry.bytes_per_block, 2)
                swarm.start_node("node-1", honest)
                swarm.start_node("node-2", honest)
                await wait_for_coverage(watcher, swarm, ALIAS, timeout_s=240)
                fake = swarm.peer_id("fake")
                swarm.start_node(
                    "fake", 29 * entry.bytes_per_block + entry.bytes_per_block // 2,
                    ["--models-dir", str(swarm.workdir / "fake-models")], model=False,
                )  # fmt: skip

                async def fake_admitted() -> bool:
                    return (await _assigned(watcher, fake)) is not None

                await _poll(fake_admitted, 120, "the fake node registered")
                assert not (await _assigned(watcher, fake)).assigned, "a covered model: nothing for it yet"

                async def fake_holds_a_range() -> bool:
                    node = await _assigned(watcher, fake)
                    return node is not None and bool(node.assigned)

                async def fake_holds_nothing() -> bool:
                    node = await _assigned(watcher, fake)
                    return node is not None and not node.assigned

                async def routable() -> bool:
                    try:
                        route = await watcher.route(ALIAS)
                    except Exception:  # (no route yet: the tracker says so)
                        return False
                    return all(hop.peer_id != fake for hop in route.hops)

                # 1. node-2 vanishes; the fake node is given its blocks; node-2 comes back while the
                #    fake one is still "loading": the range goes back to node-2 at once
                await swarm.kill_node("node-2")
                await _poll(fake_holds_a_range, 60, "the fake node given node-2's blocks")
                swarm.start_node("node-2", honest)
                await _poll(fake_holds_nothing, DEADLINE_S, "node-2's range given back to it")
                await _poll(routable, 120, "the model routable again through node-2")

                # 2. node-2 vanishes again and does not come back: the fake node holds its blocks
                #    no longer than the loading deadline
                await swarm.kill_node("node-2")
                await _poll(fake_holds_a_range, 60, "the fake node given node-2's blocks again")
                held_s = await _poll(fake_holds_nothing, DEADLINE_S + 15, "the fake node's range taken back")
                assert held_s <= DEADLINE_S + 5
                node = await _assigned(watcher, fake)
                assert any("taken back" in f.error for f in node.load_failures), node.load_failures
                assert not any(s.state == swarm_pb2.AssignmentStatus.READY for s in node.serving)
        nursery.cancel_scope.cancel()
