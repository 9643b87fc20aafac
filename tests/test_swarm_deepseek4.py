"""DeepSeek V4 through a real swarm: a tracker and three node processes on loopback
split the synthetic V4 (6 blocks, 4 hyper-connection streams) three ways, and the greedy tokens
the real client gets through them equal one unsplit worker's.

Every boundary crossing a node edge is a v2 ("residual-streams") row of 4 x n_embd f32 values,
declared in the step record and checked by the receiving node (``validate_step``), then given
to its worker; any schema, width or state error at a hop fails the generation, and any
numeric difference shows as a different token. The prompt is longer than the largest
compression window (128), so the compressed state of blocks that straddle the cuts is used.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from agent.demo.local_demo import generate_through
from agent.demo.swarm_demo import node_memory_bytes, wait_for_coverage
from agent.harness.local_swarm import LocalSwarm, LocalSwarmConfig
from agent.harness.parity_run import make_prompts
from agent.io.client import open_swarm_client
from agent.io.worker.process import open_worker
from agent.models import sha256_file

pytestmark = [pytest.mark.swarm, pytest.mark.slow, pytest.mark.timeout(600)]

ALIAS = "deepseek4-tiny"
NODES = 3
PROMPT_TOKENS = 160
NEW_TOKENS = 32
SETUP_TIMEOUT_S = 240.0


async def test_deepseek4_through_three_nodes_equals_one_unsplit_worker(
    deepseek4_tiny_path: Path, tmp_path: Path
) -> None:
    sha256 = await trio.to_thread.run_sync(sha256_file, deepseek4_tiny_path)
    async with open_worker(deepseek4_tiny_path, 0, None, threads=1, max_sequences=1, model_sha256=sha256) as single:
        assert single.info.boundary.version == 2 and single.info.boundary.streams == 4
        (prompt,) = await make_prompts(single.client, 1, PROMPT_TOKENS)
        eog = single.info.eog_token_ids
        reference = await generate_through([single.client], prompt, NEW_TOKENS, stop_tokens=eog)

    swarm = LocalSwarm(LocalSwarmConfig(model_path=deepseek4_tiny_path, model_alias=ALIAS), tmp_path)
    try:
        await swarm.start_tracker()
        async with open_swarm_client(swarm.tracker_addr) as client:
            (entry,) = [m for m in await client.list_models() if m.alias == ALIAS]
            assert (entry.architecture, entry.n_layer, entry.sha256) == ("deepseek4", 6, sha256)
            memory = node_memory_bytes(entry.n_layer, entry.bytes_per_block, NODES)
            for i in range(NODES):
                swarm.start_node(f"node-{i + 1}", memory)
            route = await wait_for_coverage(client, swarm, ALIAS, timeout_s=SETUP_TIMEOUT_S)
            assert [(h.begin, h.end) for h in route.hops] == [(0, 2), (2, 4), (4, 6)]
            assert len({h.peer_id for h in route.hops}) == NODES

            result = await client.generate_tokens(ALIAS, prompt, max_tokens=NEW_TOKENS, stop_tokens=eog, route=route)
        swarm.check_alive()
    finally:
        with trio.CancelScope(shield=True):
            await swarm.aclose()

    assert result.model_sha256 == sha256
    assert [(h["begin"], h["end"]) for h in result.route] == [(0, 2), (2, 4), (4, 6)]
    assert len(reference.tokens) == NEW_TOKENS  # the comparison covers every step
    assert result.tokens == reference.tokens
