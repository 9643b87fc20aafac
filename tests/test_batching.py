"""Many sessions at once through a real 3-node swarm (issue 12), with ``baton generate`` as users
run it: more concurrent generations than sequences wait and all finish, each equal to its solo
run; the wait is bounded and says so; killed clients hold nothing for long.

One swarm of real processes: a tracker and three nodes, each a third of SmolLM2, each worker
with 4 sequences (the worker's default), so one route holds 4 sessions at a time."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from agent.demo.swarm_demo import node_memory_bytes, wait_for_coverage
from agent.harness.local_swarm import LocalSwarm, LocalSwarmConfig
from agent.io.client import open_swarm_client
from agent.models import model_path

pytestmark = pytest.mark.slow

ALIAS = "smollm2"
PROMPTS = [
    "The capital of France is",
    "Volunteer computing works because",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
]
NEW_TOKENS = 12
SEQUENCES = 4


def _argv(addr: str, cache: Path, prompt: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "agent.cli", "generate", "--tracker", addr, "--model", ALIAS,
        "--max-tokens", str(NEW_TOKENS), "--cache-dir", str(cache), "--json", *extra, prompt,
    ]  # fmt: skip


async def _generate(argv: list[str]) -> subprocess.CompletedProcess:
    return await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)


async def _sequences_in_use(c) -> int:  # noqa: ANN001
    return sum(s.sequences_in_use for n in await c.list_nodes() for s in n.serving)


@pytest.mark.timeout(600)
async def test_more_generations_than_sequences_wait_finish_equal_and_killed_clients_free_theirs(tmp_path: Path) -> None:
    swarm = LocalSwarm(LocalSwarmConfig(model_path=model_path(ALIAS), model_alias=ALIAS), tmp_path / "swarm")
    cache = tmp_path / "client-cache"
    try:
        await swarm.start_tracker()
        async with open_swarm_client(swarm.tracker_addr) as c:
            (entry,) = [m for m in await c.list_models() if m.alias == ALIAS]
            for i in range(3):
                swarm.start_node(f"node-{i + 1}", node_memory_bytes(entry.n_layer, entry.bytes_per_block, 3))
            await wait_for_coverage(c, swarm, ALIAS, timeout_s=240.0)
            addr = swarm.tracker_addr

            solo = {}
            for prompt in PROMPTS:  # each prompt alone (this also fills the tokenizer cache)
                done = await _generate(_argv(addr, cache, prompt))
                assert done.returncode == 0, done.stderr.decode()
                solo[prompt] = json.loads(done.stdout)["tokens"]

            # 16 at once, 4 sequences per range: 12 wait for a free sequence, none fails
            runs: dict[int, subprocess.CompletedProcess] = {}

            async def one(i: int) -> None:
                runs[i] = await _generate(_argv(addr, cache, PROMPTS[i % len(PROMPTS)]))

            with trio.fail_after(400):
                async with trio.open_nursery() as nursery:
                    for i in range(16):
                        nursery.start_soon(one, i)
            for i, done in sorted(runs.items()):
                assert done.returncode == 0, (i, done.stderr.decode()[-2000:])
                assert json.loads(done.stdout)["tokens"] == solo[PROMPTS[i % len(PROMPTS)]], i
            with trio.fail_after(15):  # every session was ended: nothing held
                while await _sequences_in_use(c):
                    await trio.sleep(0.2)

            # four long generations hold every sequence; a fifth told to wait 1 s says why it gives up
            long_argv = [*_argv(addr, cache, PROMPTS[0])]
            long_argv[long_argv.index("--max-tokens") + 1] = "1500"
            async with trio.open_nursery() as nursery:
                holders = [
                    await nursery.start(
                        lambda task_status: trio.run_process(
                            long_argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False,
                            task_status=task_status,
                        )
                    )
                    for _ in range(SEQUENCES)
                ]
                with trio.fail_after(120):
                    while await _sequences_in_use(c) < 3 * SEQUENCES:  # 4 sessions on each of 3 ranges
                        await trio.sleep(0.2)
                refused = await _generate(_argv(addr, cache, PROMPTS[1], "--queue-timeout-s", "1"))
                assert refused.returncode != 0
                assert "within the queue timeout of 1.0 s (the swarm is busy)" in refused.stderr.decode()
                # the four clients die without a word: their leases lapse within seconds, not minutes
                for holder in holders:
                    holder.send_signal(signal.SIGKILL)
                killed_at = trio.current_time()
                fresh = await _generate(_argv(addr, cache, PROMPTS[2], "--queue-timeout-s", "30"))
                took_s = trio.current_time() - killed_at
                assert fresh.returncode == 0, fresh.stderr.decode()
                assert json.loads(fresh.stdout)["tokens"] == solo[PROMPTS[2]]
                assert took_s < 15.0, took_s  # the nodes' 5 s lease, a sweep, the run itself
                print(f"a new generation finished {took_s:.1f} s after four clients were killed")
        swarm.check_alive()
    finally:
        with trio.CancelScope(shield=True):
            await swarm.aclose()
