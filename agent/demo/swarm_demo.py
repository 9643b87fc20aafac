"""The swarm demo: a tracker and three nodes on loopback split a real model three ways,
generate from a prompt through them, and compare with one unsplit worker.

Owns the demo's sequence: start the tracker (registering the model), read the model's
``bytes_per_block`` from the tracker, start the nodes offering memory for about
``1 / nodes`` of the model each (so the tracker must split it that many ways), wait (bounded)
until the tracker has a route covering every block, generate through it with
``agent.io.client``, stop the swarm, run the same prompt tokens through one local unsplit
worker (``agent.demo.local_demo.generate_through``), and report both. Processes are
``agent.harness.local_swarm``'s; every one is stopped before this returns or raises.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from pathlib import Path

import trio

from agent._proto import swarm_pb2
from agent.models import cached_sha256

from agent.io.client import GenerationResult, SwarmClient, SwarmClientConfig, SwarmError, open_swarm_client
from agent.demo.local_demo import DEMO_PROMPT, ChainRun, generate_through
from agent.harness.local_swarm import LocalSwarm, LocalSwarmConfig, open_local_swarm
from agent.io.transport import TransportError
from agent.io.worker_process import open_worker

__all__ = ["SwarmDemoReport", "node_memory_bytes", "run_swarm_demo", "wait_for_coverage"]


def node_memory_bytes(n_layer: int, bytes_per_block: int, nodes: int) -> int:
    """Memory that holds ``ceil(n_layer / nodes)`` blocks and not one more: with ``nodes``
    such nodes the tracker can place exactly one copy of the model, split ``nodes`` ways."""
    if n_layer < 1 or bytes_per_block < 1 or nodes < 1:
        raise ValueError(f"need n_layer, bytes_per_block, nodes >= 1, got {n_layer}, {bytes_per_block}, {nodes}")
    return math.ceil(n_layer / nodes) * bytes_per_block + bytes_per_block // 2


async def wait_for_coverage(client: SwarmClient, swarm: LocalSwarm, model: str, *, timeout_s: float, poll_s: float = 0.2):
    """Poll the tracker until it has a full route for ``model``; raise ``ProcessDied`` as
    soon as a swarm process exits, ``TimeoutError`` (with every log tail) after ``timeout_s``."""
    last = "no answer yet"
    with trio.move_on_after(timeout_s):
        while True:
            swarm.check_alive()
            try:
                return await client.route(model)
            except (SwarmError, TransportError) as error:
                last = str(error)
            await trio.sleep(poll_s)
    raise TimeoutError(f"no full route for {model!r} within {timeout_s} s: {last}\n{swarm.logs()}")


@dataclasses.dataclass
class SwarmDemoReport:
    prompt: str
    generation: GenerationResult
    single: ChainRun
    node_memory_bytes: int
    bytes_per_block: int

    @property
    def tokens_equal_single_process(self) -> bool:
        return self.generation.tokens == self.single.tokens

    def to_json(self) -> dict:
        return {
            "route": [dict(hop) for hop in self.generation.route],
            "text": self.generation.text,
            "tokens_per_s": self.generation.tokens_per_s,
            "tokens_equal_single_process": self.tokens_equal_single_process,
            "prompt": self.prompt,
            "tokens": list(self.generation.tokens),
            "prefill_tokens_per_s": self.generation.prefill_tokens_per_s,
            "single_process_tokens": list(self.single.tokens),
            "single_process_tokens_per_s": self.single.decode_tokens_per_s,
            "node_memory_bytes": self.node_memory_bytes,
            "bytes_per_block": self.bytes_per_block,
        }


async def run_swarm_demo(
    model_path: str | os.PathLike | None = None,
    *,
    prompt: str = DEMO_PROMPT,
    max_new_tokens: int = 48,
    nodes: int = 3,
    threads: int = 1,
    model_alias: str = "smollm2",
    coverage_timeout_s: float = 180.0,
    heartbeat_timeout_ms: int = 5000,
    workdir: str | os.PathLike | None = None,
    client_config: SwarmClientConfig | None = None,
    on_text: Callable[[str], None] | None = None,
) -> SwarmDemoReport:
    """Run the demo (see the module docstring) and report.

    Raises:
      ProcessDied: a tracker or node process exited (its log tail in the message).
      TimeoutError: the swarm did not cover the model within ``coverage_timeout_s``.
      GenerationError / SwarmError: the generation failed.
      WorkerStartError: the unsplit worker did not start.

    Resource handling:
      Every process (tracker, nodes, the unsplit worker) is stopped before this returns or
      raises; a temp work dir made here is removed (``workdir`` given: keys, db and logs stay).
    """
    if model_path is None:
        from agent.models import model_path as cached_model

        model_path = cached_model("smollm2")
    model_path = Path(model_path)
    config = LocalSwarmConfig(
        model_path=model_path, model_alias=model_alias, heartbeat_timeout_ms=heartbeat_timeout_ms, threads=threads,
        workdir=Path(workdir) if workdir is not None else None,
    )  # fmt: skip
    async with open_local_swarm(config) as swarm:
        await swarm.start_tracker()
        async with open_swarm_client(swarm.tracker_addr, config=client_config) as client:
            entry = await _model_entry(client, model_alias)
            memory = node_memory_bytes(entry.n_layer, entry.bytes_per_block, nodes)
            for i in range(nodes):
                swarm.start_node(f"node-{i + 1}", memory)
            route = await wait_for_coverage(client, swarm, model_alias, timeout_s=coverage_timeout_s)
            generation = await client.generate(
                model_alias, prompt, max_tokens=max_new_tokens, on_text=on_text, route=route
            )
    sha256 = await trio.to_thread.run_sync(cached_sha256, model_path)
    async with open_worker(model_path, 0, None, threads=threads, max_sequences=1, model_sha256=sha256) as single:
        single_run = await generate_through(
            [single.client], generation.prompt_tokens, max_new_tokens, stop_tokens=single.info.eog_token_ids
        )
    return SwarmDemoReport(
        prompt=prompt,
        generation=generation,
        single=single_run,
        node_memory_bytes=memory,
        bytes_per_block=entry.bytes_per_block,
    )


async def _model_entry(client: SwarmClient, alias: str) -> swarm_pb2.ModelEntry:
    for entry in await client.list_models():
        if alias in (entry.alias, entry.name, entry.sha256):
            return entry
    raise SwarmError(client.tracker_peer_id, swarm_pb2.Error.NOT_FOUND, f"the tracker has no model {alias!r} registered")
