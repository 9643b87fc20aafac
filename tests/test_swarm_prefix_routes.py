"""Prefix-aware routes end to end: a real tracker and four real node processes on loopback,
two copies of each half of SmolLM2 (four routes), every worker with a prefix cache.

Each round, a first session of a new prompt is sent through one of the four routes, chosen by
the test (around the other copies: ``avoid_peers``), so that its hops' caches keep its prompt
blocks. Once the hops' nodes have sent heartbeats naming them, a second session whose prompt
starts with the first's asks the tracker for a plain route: it must land on the first session's
hops and copy their blocks (its cached tokens, and the workers' hit counters). Without the
preference the tracker's choice would not depend on the prompt: one route in four would match.
The rounds go through each route twice. Every process is stopped at the end.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import trio

from agent._proto import swarm_pb2
from agent.demo.swarm_demo import wait_for_copies, wait_for_coverage
from agent.harness.local_swarm import LocalSwarm, LocalSwarmConfig, open_local_swarm
from agent.io.client import SwarmClientConfig, open_swarm_client
from agent.io.worker.client import WorkerClient
from agent.io.worker.error import WorkerError
from agent.models import model_path

pytestmark = [pytest.mark.swarm, pytest.mark.slow]

ALIAS = "smollm2"
BLOCKS_EACH = 15  # two nodes for [0, 15), two for [15, 30)
BLOCK_TOKENS = 64
PROMPT_BLOCKS = 8
NEW_TOKENS = 4
ROUNDS = 8
CACHE_BYTES = 64 << 20
SETUP_TIMEOUT_S = 300.0
TEXT = (
    "Volunteer computing works because many people lend a little of their spare time and their "
    "machines to a common project. The machines come and go without warning: a laptop lid "
    "closes, a home router restarts, a game takes the GPU. A good system therefore keeps every "
    "piece of work small, checks what comes back, and moves on when a machine disappears. "
) * 10
FOLLOW_UP = " And what happens to the work a machine was doing when it disappears?"


def _counts(swarm: LocalSwarm, peer_ids: list[str]) -> list[tuple[int, int, int]]:
    """Per peer: its worker's (prefix hits, prefix sessions kept, sequences in use), summed over
    the workers that answer (one READY range each here)."""
    by_peer = {proc.peer_id: proc for proc in swarm.nodes.values()}
    found = []
    for peer_id in peer_ids:
        hits = kept = active = 0
        for socket in by_peer[peer_id].worker_sockets():
            with WorkerClient(socket, timeout_s=10.0) as worker, contextlib.suppress(WorkerError):
                health = worker.health()
                hits, kept, active = (
                    hits + health.prefix_hits,
                    kept + health.prefix_kept,
                    active + health.active_sequences,
                )
        found.append((hits, kept, active))
    return found


async def _heartbeats_after(c, peer_ids: list[str], beats: int = 2) -> None:
    """Until each of ``peer_ids`` sent ``beats`` more heartbeats (the tracker's node list): the
    later one read its worker's cache after what the caller waited for."""

    async def heard() -> dict[str, int]:
        return {n.peer_id: n.last_heartbeat_ms for n in await c.list_nodes() if n.peer_id in peer_ids}

    seen = {p: [ms] for p, ms in (await heard()).items()}
    with trio.fail_after(30):
        while any(len(set(seen.get(p, []))) <= beats for p in peer_ids):
            await trio.sleep(0.1)
            for p, ms in (await heard()).items():
                seen.setdefault(p, []).append(ms)


@pytest.mark.timeout(900)
async def test_a_prompt_lands_where_its_prefix_is_cached(tmp_path: Path) -> None:
    # Four nodes starting at once on one machine measure their speeds (their fingerprints'
    # decode_s_per_block) while the others load: seen 7x apart. By default a prefix takes at
    # most half a route's cost off (a route measured 2x faster wins, by design: core tests),
    # so here it takes nearly all of it: the test is about the reports and the preference.
    config = LocalSwarmConfig(
        model_path=model_path(ALIAS), model_alias=ALIAS, heartbeat_timeout_ms=15_000, workdir=tmp_path,
        node_args=("--prefix-cache-bytes", str(CACHE_BYTES)),
        tracker_args=("--prefix-discount-per-token", "0.01", "--prefix-discount-max", "0.99"),
    )  # fmt: skip
    client_config = SwarmClientConfig(prefill_chunk_tokens=BLOCK_TOKENS, prefix_block_tokens=BLOCK_TOKENS)
    async with open_local_swarm(config) as swarm:
        await swarm.start_tracker()
        async with open_swarm_client(swarm.tracker_addr, config=client_config) as c:
            (entry,) = [m for m in await c.list_models() if m.alias == ALIAS]
            memory = BLOCKS_EACH * entry.bytes_per_block + entry.bytes_per_block // 2
            for i in range(4):
                swarm.start_node(f"node-{i + 1}", memory)
            route = await wait_for_coverage(c, swarm, ALIAS, timeout_s=SETUP_TIMEOUT_S)  # (the recipe, for tags)
            nodes = await wait_for_copies(c, swarm, 2, timeout_s=SETUP_TIMEOUT_S)
            halves: dict[int, list[str]] = {}
            for node in nodes:
                for status in node.serving:
                    if status.state == swarm_pb2.AssignmentStatus.READY:
                        halves.setdefault(status.assignment.begin, []).append(node.peer_id)
            firsts, seconds = sorted(halves[0]), sorted(halves[BLOCKS_EACH])
            assert len(firsts) == len(seconds) == 2, halves
            combos = [(a, b) for a in firsts for b in seconds]
            text, stop = await c.tokenize(route, TEXT)
            follow_up, _ = await c.tokenize(route, FOLLOW_UP)

            landed = []
            for round_ in range(ROUNDS):
                first_hop, last_hop = combos[round_ % len(combos)]
                marker, _ = await c.tokenize(route, f"Round {round_}:")  # a prompt no cache holds yet
                prompt = (marker + text)[: PROMPT_BLOCKS * BLOCK_TOKENS + 10]
                assert len(prompt) == PROMPT_BLOCKS * BLOCK_TOKENS + 10
                forced = await c.route(
                    ALIAS, avoid_peers=[p for p in firsts + seconds if p not in (first_hop, last_hop)]
                )
                assert [h.peer_id for h in forced.hops] == [first_hop, last_hop]
                first = await c.generate_tokens(ALIAS, prompt, max_tokens=NEW_TOKENS, stop_tokens=stop, route=forced)
                assert first.cached_tokens == 0
                # the hops keep its blocks when they remove its sequence; then their nodes tell the tracker
                with trio.fail_after(30):
                    while any(
                        active
                        for _h, _k, active in await trio.to_thread.run_sync(_counts, swarm, [first_hop, last_hop])
                    ):
                        await trio.sleep(0.05)
                await _heartbeats_after(c, [first_hop, last_hop])
                before = await trio.to_thread.run_sync(_counts, swarm, [first_hop, last_hop])
                second = await c.generate_tokens(
                    ALIAS, prompt[: PROMPT_BLOCKS * BLOCK_TOKENS] + follow_up[1:], max_tokens=NEW_TOKENS, stop_tokens=stop
                )  # fmt: skip
                after = await trio.to_thread.run_sync(_counts, swarm, [first_hop, last_hop])
                landed.append(
                    ([h["node"] for h in second.route] == [first_hop, last_hop], second.cached_tokens,
                     [a[0] - b[0] for a, b in zip(after, before, strict=True)])
                )  # fmt: skip
            assert landed == [(True, PROMPT_BLOCKS * BLOCK_TOKENS, [1, 1])] * ROUNDS, landed
