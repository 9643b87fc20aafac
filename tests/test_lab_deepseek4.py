"""DeepSeek V4 across lab machines: the synthetic V4 (6 blocks, 4 hyper-connection streams,
compressed attention) split over three machines 20 ms apart gives one unsplit worker's greedy
tokens, and again when the middle machine is switched off mid-generation and a standby
machine takes its range over (the replacement's KV, compressor state included, rebuilt from
the rows the hop before kept).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from agent.core.lab.topology import LinkSpec, MachineSpec, Topology
from agent.demo.local_demo import generate_through
from agent.demo.swarm_demo import node_memory_bytes, wait_for_coverage
from agent.harness.local_swarm import LocalSwarm, LocalSwarmConfig, Placement
from agent.harness.parity_run import make_prompts
from agent.io.client import SwarmClientConfig, open_swarm_client
from agent.io.lab.harness import running_lab
from agent.io.worker.process import open_worker
from agent.models import sha256_file

pytestmark = [pytest.mark.lab, pytest.mark.slow, pytest.mark.timeout(600)]

ALIAS = "deepseek4-tiny"
NODES = ("n1", "n2", "n3")
SPARE = "n4"
MACHINES = ("tracker", *NODES, SPARE)
PROMPT_TOKENS = 160  # past the largest compression window (128)
NEW_TOKENS = 32
SETUP_TIMEOUT_S = 240.0


async def _reference(path: Path, sha256: str) -> tuple[list[int], list[int], list[int]]:
    async with open_worker(path, 0, None, threads=1, max_sequences=1, model_sha256=sha256) as single:
        assert single.info.boundary.version == 2 and single.info.boundary.streams == 4
        (prompt,) = await make_prompts(single.client, 1, PROMPT_TOKENS)
        eog = list(single.info.eog_token_ids)
        run = await generate_through([single.client], prompt, NEW_TOKENS, stop_tokens=eog)
    return prompt, eog, run.tokens


def test_deepseek4_over_three_lab_machines_equals_one_unsplit_worker_also_after_a_machine_dies(
    deepseek4_tiny_path: Path, tmp_path: Path
) -> None:
    sha256 = sha256_file(deepseek4_tiny_path)
    prompt, eog, reference = trio.run(_reference, deepseek4_tiny_path, sha256)
    assert len(reference) == NEW_TOKENS  # the comparison covers every step
    topology = Topology(tuple(MachineSpec(m) for m in MACHINES), LinkSpec(delay_ms=10.0))
    with running_lab(topology) as lab:
        placement = Placement(lab, {m: m for m in MACHINES})
        swarm = LocalSwarm(
            LocalSwarmConfig(model_path=deepseek4_tiny_path, model_alias=ALIAS, placement=placement), tmp_path
        )
        ids: dict[str, str] = {}

        async def body() -> tuple:
            await swarm.start_tracker()
            config = SwarmClientConfig(replan_attempts=2, replan_wait_s=60.0)
            async with open_swarm_client(
                swarm.tracker_addr, listen_addrs=lab.listen_addrs("tracker"), config=config
            ) as c:
                (entry,) = [m for m in await c.list_models() if m.alias == ALIAS]
                memory = node_memory_bytes(entry.n_layer, entry.bytes_per_block, len(NODES))
                for name in NODES:
                    ids[swarm.start_node(name, memory).peer_id] = name
                route = await wait_for_coverage(c, swarm, ALIAS, timeout_s=SETUP_TIMEOUT_S)
                assert [(h.begin, h.end) for h in route.hops] == [(0, 2), (2, 4), (4, 6)]
                whole = await c.generate_tokens(ALIAS, prompt, max_tokens=NEW_TOKENS, stop_tokens=eog)

                swarm.start_node(SPARE, memory)  # a standby: nothing to hold until a range is lost
                with trio.fail_after(SETUP_TIMEOUT_S):
                    while swarm.nodes[SPARE].peer_id not in {n.peer_id for n in await c.list_nodes() if n.alive}:
                        swarm.check_alive()
                        await trio.sleep(0.2)
                killed: list[str] = []

                async def on_token(_token: int, _logits, on_route) -> bool:
                    if len(killed) == 0 and len(seen) == 9:
                        name = ids[on_route.hops[1].peer_id]
                        lab.isolate(name)
                        await swarm.kill_node(name)
                        killed.append(name)
                    seen.append(_token)
                    return False

                seen: list[int] = []
                resumed = await c.generate_tokens(
                    ALIAS, prompt, max_tokens=NEW_TOKENS, stop_tokens=eog, on_token=on_token
                )
            return whole, resumed, killed

        try:
            whole, resumed, killed = lab.trio_run_in("tracker", body)
        finally:
            swarm.close_nowait()
    assert whole.tokens == reference
    assert len(killed) == 1 and killed[0] in NODES
    assert resumed.tokens == reference
    assert resumed.replans >= 1
    assert swarm.nodes[SPARE].peer_id in [h["node"] for h in resumed.route]
