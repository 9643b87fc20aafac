"""An attack on running processes, made as an attacker would: a peer that never asked for
admission opens ten streams at once to a tracker, then to a node, and sends a 60 MB request
frame on each (the frames' length prefixes are all it takes to refuse them); then many requests
just under the protocol's limit at once (the bytes a peer may have in flight refuse those).

Real processes on loopback. The attacked process's peak resident memory during the attack stays
within 100 MB of its memory before it, the refusals are logged with their reason, and the
process still answers a normal request afterwards.
"""

from __future__ import annotations

import multiaddr
import pytest
import trio
from attacks import flood_frames, peak_rss_bytes, reset_peak_rss, rss_bytes, settled_rss_bytes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from libp2p.peer.peerinfo import info_from_p2p_addr

from agent.core.net.multiaddrs import is_channel_multiaddr
from agent.core.wire.swarm_wire import STEP_PROTOCOL, TRACKER_PROTOCOL
from agent.demo.swarm_demo import node_memory_bytes, wait_for_coverage
from agent.harness.local_swarm import LocalSwarmConfig, SwarmProcess, open_local_swarm
from agent.io.client import open_swarm_client
from agent.io.net.p2p import open_p2p_transport
from agent.models import model_path

pytestmark = [pytest.mark.swarm, pytest.mark.slow, pytest.mark.adversarial]

ALIAS = "smollm2"
STREAMS = 10
FRAME_BYTES = 60_000_000
MAX_GROWTH_BYTES = 100_000_000
_MB = 1_000_000


async def _flood(
    target: SwarmProcess, addr: str, protocol_id: str, *, streams: int = STREAMS, frame_bytes: int = FRAME_BYTES
) -> tuple[int, int, list[int]]:
    """Flood ``target`` (listening at ``addr``) from a fresh key; its RSS before (settled) and its
    peak during the attack, and what each stream got written."""
    pid = target.process.pid
    before = await settled_rss_bytes(pid)
    peak_resets = reset_peak_rss(pid)
    polled = before
    async with open_p2p_transport(Ed25519PrivateKey.generate(), listen_addrs=()) as attacker:
        info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
        await attacker.host.connect(info)

        async def poll() -> None:
            nonlocal polled
            while True:  # a fallback where the kernel keeps the peak from its start
                polled = max(polled, rss_bytes(pid))
                await trio.sleep(0.05)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(poll)
            with trio.fail_after(120):
                sent = await flood_frames(
                    attacker.host, str(info.peer_id), protocol_id, streams=streams, frame_bytes=frame_bytes
                )
            nursery.cancel_scope.cancel()
    peak = max(polled, peak_rss_bytes(pid)) if peak_resets else polled
    print(
        f"{target.name}, {streams} x {frame_bytes / _MB:.0f} MB: RSS before {before / _MB:.0f} MB, peak during the "
        f"attack {peak / _MB:.0f} MB, after {rss_bytes(pid) / _MB:.0f} MB; MB written per stream: "
        f"{[round(s / _MB, 1) for s in sent]}"
    )
    return before, peak, sent


@pytest.mark.timeout(300)
async def test_an_unadmitted_peer_cannot_make_the_tracker_buffer_big_frames() -> None:
    config = LocalSwarmConfig(model_path=model_path("smollm2"), model_alias=ALIAS)
    async with open_local_swarm(config) as swarm:
        await swarm.start_tracker()
        tracker = swarm.tracker
        assert tracker is not None
        async with open_swarm_client(swarm.tracker_addr) as client:
            with trio.fail_after(120):  # its start-up work (the model's manifest) is done
                while "manifest of model" not in tracker.log_tail(1 << 20):
                    await trio.sleep(0.1)
            await client.list_models()  # warm: the tracker has answered a request before
            # frames far over any tracker limit, then many just under what an admitted peer may send
            for streams, frame_bytes in ((STREAMS, FRAME_BYTES), (100, 1_000_000)):
                before, peak, _ = await _flood(tracker, swarm.tracker_addr, TRACKER_PROTOCOL, streams=streams,
                                               frame_bytes=frame_bytes)  # fmt: skip
                assert peak - before <= MAX_GROWTH_BYTES, (
                    f"{streams} x {frame_bytes} bytes took the tracker from {before / _MB:.0f} MB to "
                    f"{peak / _MB:.0f} MB"
                )
            assert [m.alias for m in await client.list_models()] == [ALIAS]  # still serving
        async with open_swarm_client(swarm.tracker_addr) as newcomer:  # and admitting
            await newcomer.list_models()
        assert "refused a request on /baton/tracker" in tracker.log_tail(1 << 20)


@pytest.mark.timeout(420)
async def test_an_unadmitted_peer_cannot_make_a_node_buffer_big_frames() -> None:
    config = LocalSwarmConfig(model_path=model_path("smollm2"), model_alias=ALIAS)
    async with open_local_swarm(config) as swarm:
        await swarm.start_tracker()
        async with open_swarm_client(swarm.tracker_addr) as client:
            (entry,) = [m for m in await client.list_models() if m.alias == ALIAS]
            node = swarm.start_node("node-1", node_memory_bytes(entry.n_layer, entry.bytes_per_block, 1))
            route = await wait_for_coverage(client, swarm, ALIAS, timeout_s=240)
            (hop,) = route.hops
            addr = next(a for a in hop.addrs if not is_channel_multiaddr(a) and "/p2p-circuit" not in a)
            normal = await client.generate(ALIAS, "Hello", max_tokens=2)  # warm
            # frames far over a step of SmolLM2, then many just under it (12 MB: 2,048 rows and their fields)
            for streams, frame_bytes in ((STREAMS, FRAME_BYTES), (STREAMS, 12_000_000)):
                before, peak, _ = await _flood(node, addr, STEP_PROTOCOL, streams=streams, frame_bytes=frame_bytes)
                assert peak - before <= MAX_GROWTH_BYTES, (
                    f"{streams} x {frame_bytes} bytes took the node from {before / _MB:.0f} MB to {peak / _MB:.0f} MB"
                )
            again = await client.generate(ALIAS, "Hello", max_tokens=2)  # still serving
            assert again.tokens == normal.tokens
        assert "refused a request on /baton/step" in node.log_tail(1 << 20)
