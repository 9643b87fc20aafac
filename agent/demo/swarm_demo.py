"""The swarm demo: a tracker, three nodes and the relay on loopback split a real model three
ways, generate from a prompt through the relay's OpenAI-compatible HTTP API, and compare with
one unsplit worker.

Owns the demo's sequence: start the tracker (registering the model), read the model's
``bytes_per_block`` from the tracker, start the nodes offering memory for about
``1 / nodes`` of the model each (so the tracker must split it that many ways), wait (bounded)
until the tracker has a route covering every block, start the relay and give it an API key,
stream a completion from ``/v1/completions`` (as any OpenAI client would, plus
``return_token_ids`` so the tokens can be compared), stop the swarm, run the same prompt tokens
through one local unsplit worker (``agent.demo.local_demo.generate_through``), and report both.
``serve_swarm_demo`` starts the same swarm and relay and keeps them until cancelled
(``open_demo_relay``, which ``bench/relay.py`` drives too). The nodes' workers hold
``DEMO_MAX_SEQUENCES`` sequences each, and the nodes trust the relay (``--trusted-owner``), so it
serves that many clients at once. Processes
are ``agent.harness.local_swarm``'s; every one is stopped before these return or raise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import trio

from agent._proto import swarm_pb2
from agent.demo.local_demo import DEMO_PROMPT, ChainRun, generate_through
from agent.harness.local_swarm import LocalSwarm, LocalSwarmConfig, open_local_swarm
from agent.io.client import SwarmClient, SwarmClientConfig, SwarmError, open_swarm_client, route_hops
from agent.io.net.transport import TransportError
from agent.io.worker.process import open_worker
from agent.models import cached_sha256

__all__ = [
    "ForwardCounts",
    "RelayError",
    "RelayGeneration",
    "SwarmDemoReport",
    "demo_swarm_config",
    "forward_counts",
    "node_memory_bytes",
    "open_demo_relay",
    "run_swarm_demo",
    "serve_swarm_demo",
    "stream_completion",
    "wait_for_copies",
    "wait_for_coverage",
]

DEMO_KEY_NAME = "demo"
#: sequences a worker of the demo's nodes holds: the relay serves several clients at once
DEMO_MAX_SEQUENCES = 8


class RelayError(Exception):
    """The relay answered a request with an error (its OpenAI envelope's message)."""


def node_memory_bytes(n_layer: int, bytes_per_block: int, nodes: int) -> int:
    """Memory that holds ``ceil(n_layer / nodes)`` blocks and not one more: with ``nodes``
    such nodes the tracker can place exactly one copy of the model, split ``nodes`` ways."""
    if n_layer < 1 or bytes_per_block < 1 or nodes < 1:
        raise ValueError(f"need n_layer, bytes_per_block, nodes >= 1, got {n_layer}, {bytes_per_block}, {nodes}")
    return math.ceil(n_layer / nodes) * bytes_per_block + bytes_per_block // 2


async def wait_for_coverage(
    client: SwarmClient, swarm: LocalSwarm, model: str, *, timeout_s: float, poll_s: float = 0.2
):
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


class ForwardCounts(NamedTuple):
    """A READY range's worker Forwards since it went READY (``AssignmentStatus``): how many,
    the steps they carried, their time as the worker measured it and as the node measured
    its calls (µs)."""

    calls: int
    steps: int
    compute_us: int
    call_us: int


async def forward_counts(
    addr: str, after_unix_ms: int, *, timeout_s: float = 30.0
) -> dict[tuple[int, int], ForwardCounts]:
    """``{(begin, end): ForwardCounts}`` of every READY range of the tracker at ``addr``, from
    heartbeats sent after ``after_unix_ms``: how many steps the nodes' worker Forwards
    carried, and their time. Raises TooSlowError when some alive node sends no heartbeat
    within ``timeout_s``."""
    async with open_swarm_client(addr) as c:
        with trio.fail_after(timeout_s):
            while True:
                nodes = await c.list_nodes()
                if all(n.last_heartbeat_ms > after_unix_ms for n in nodes if n.alive):
                    break
                await trio.sleep(0.2)  # polling the tracker's view
    return {
        (s.assignment.begin, s.assignment.end): ForwardCounts(
            s.forward_calls, s.forward_steps, s.forward_compute_us, s.forward_call_us
        )
        for n in nodes
        if n.alive
        for s in n.serving
        if s.state == swarm_pb2.AssignmentStatus.State.READY
    }


async def wait_for_copies(
    client: SwarmClient, swarm: LocalSwarm, copies: int, *, timeout_s: float, poll_s: float = 0.1, checked: bool = False
) -> list[swarm_pb2.NodeEntry]:
    """Poll the tracker's node list until every range served has ``copies`` alive nodes with
    it READY and assigned (a swarm that lost a node and got it back is whole again), and
    (``checked``) past its first canary check; return that node list. Raise ``ProcessDied`` as
    soon as a swarm process exits, ``TimeoutError`` (with the counts seen) after ``timeout_s``."""
    last: dict[tuple[int, int], int] = {}
    with trio.move_on_after(timeout_s):
        while True:
            swarm.check_alive()
            counts: dict[tuple[int, int], int] = {}
            try:
                nodes = await client.list_nodes()
            except (SwarmError, TransportError):
                nodes = []
            for node in nodes:
                assigned = {(a.model_sha256, a.begin, a.end) for a in node.assigned}
                for status in node.serving if node.alive else ():
                    a = status.assignment
                    # a READY range the tracker no longer assigns it is being unloaded: not a copy
                    ready = status.state == swarm_pb2.AssignmentStatus.READY
                    if ready and (a.model_sha256, a.begin, a.end) in assigned:
                        key = (a.begin, a.end)
                        counts[key] = counts.get(key, 0) + (not (checked and status.awaiting_check))
            last = counts
            if counts and all(n >= copies for n in counts.values()):
                return nodes
            await trio.sleep(poll_s)
    raise TimeoutError(f"ranges not at {copies} ready copies within {timeout_s} s: {last}")


@dataclasses.dataclass
class RelayGeneration:
    """A completion streamed from the relay: its text, token ids and timing (client side)."""

    text: str
    tokens: list[int]
    prompt_tokens: list[int]
    finish_reason: str
    usage: dict
    first_token_s: float
    decode_s: float

    @property
    def tokens_per_s(self) -> float:
        return (len(self.tokens) - 1) / self.decode_s if self.decode_s > 0 and len(self.tokens) > 1 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return len(self.prompt_tokens) / self.first_token_s if self.first_token_s > 0 else 0.0


async def stream_completion(
    base_url: str,
    api_key: str,
    model: str,
    prompt: str,
    *,
    max_tokens: int,
    on_text: Callable[[str], None] | None = None,
    timeout_s: float = 300.0,
) -> RelayGeneration:
    """Stream a greedy ``/v1/completions`` from the relay at ``base_url``, as an OpenAI client
    would (SSE), asking for the token ids too (``return_token_ids``).

    Raises:
      RelayError: an error status or an error event (its message).
      httpx.HTTPError: the relay could not be reached.
    """
    import httpx

    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}, "return_token_ids": True,
    }  # fmt: skip
    tokens: list[int] = []
    prompt_tokens: list[int] = []
    text, finish, usage = [], "", {}
    started = time.perf_counter()
    first_at = last_at = None
    async with httpx.AsyncClient(timeout=timeout_s) as http:
        async with http.stream(
            "POST", f"{base_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {api_key}"}
        ) as response:
            if response.status_code != 200:
                raw = await response.aread()
                raise RelayError(f"HTTP {response.status_code}: {_error_message(raw)}")
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RelayError(chunk["error"].get("message", str(chunk["error"])))
                prompt_tokens = chunk.get("prompt_token_ids", prompt_tokens)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    ids = choice.get("token_ids") or []
                    if ids:
                        now = time.perf_counter()
                        first_at = first_at or now
                        last_at = now
                        tokens += ids
                    if choice.get("text"):
                        text.append(choice["text"])
                        if on_text is not None:
                            on_text(choice["text"])
                    finish = choice.get("finish_reason") or finish
    first_token_s = (first_at - started) if first_at else 0.0
    decode_s = (last_at - first_at) if first_at and last_at else 0.0
    return RelayGeneration("".join(text), tokens, list(prompt_tokens), finish, usage, first_token_s, decode_s)


def _error_message(raw: bytes) -> str:
    try:
        return json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return raw.decode("utf-8", "replace")[:500]


@dataclasses.dataclass
class SwarmDemoReport:
    prompt: str
    generation: RelayGeneration
    route: list[dict]
    single: ChainRun
    node_memory_bytes: int
    bytes_per_block: int
    base_url: str

    @property
    def tokens_equal_single_process(self) -> bool:
        return self.generation.tokens == self.single.tokens

    def to_json(self) -> dict:
        return {
            "via": "relay",
            "base_url": self.base_url,
            "finish_reason": self.generation.finish_reason,
            "usage": dict(self.generation.usage),
            "route": [dict(hop) for hop in self.route],
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


async def _start_swarm_and_relay(
    swarm: LocalSwarm, client: SwarmClient, model_alias: str, nodes: int, coverage_timeout_s: float,
    relay_command: Sequence[str] | None = None,
) -> tuple[swarm_pb2.ModelEntry, int, swarm_pb2.Route, str, str]:  # fmt: skip
    """Nodes, coverage, relay, key: ``(entry, node memory, route, relay URL, API key)``."""
    entry = await _model_entry(client, model_alias)
    memory = node_memory_bytes(entry.n_layer, entry.bytes_per_block, nodes)
    for i in range(nodes):
        swarm.start_node(f"node-{i + 1}", memory)
    route = await wait_for_coverage(client, swarm, model_alias, timeout_s=coverage_timeout_s)
    url = await swarm.start_relay(command=relay_command)
    api_key = swarm.add_relay_key(DEMO_KEY_NAME)
    return entry, memory, route, url, api_key


def _swarm_config(model_path, model_alias, heartbeat_timeout_ms, threads, workdir) -> LocalSwarmConfig:
    if model_path is None:
        from agent.models import model_path as cached_model

        model_path = cached_model("smollm2")
    # the nodes trust the relay (one owner for many users): it is held to no share of their sequences
    return LocalSwarmConfig(
        model_path=Path(model_path), model_alias=model_alias, heartbeat_timeout_ms=heartbeat_timeout_ms,
        threads=threads, workdir=Path(workdir) if workdir is not None else None,
        max_sequences=DEMO_MAX_SEQUENCES, trust_relay=True,
    )  # fmt: skip


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
      ProcessDied: a tracker, node or relay process exited (its log tail in the message).
      TimeoutError: the swarm did not cover the model within ``coverage_timeout_s``.
      RelayError / SwarmError: the generation failed.
      WorkerStartError: the unsplit worker did not start.

    Resource handling:
      Every process (tracker, nodes, relay, the unsplit worker) is stopped before this returns
      or raises; a temp work dir made here is removed (``workdir`` given: keys, dbs and logs stay).
    """
    config = _swarm_config(model_path, model_alias, heartbeat_timeout_ms, threads, workdir)
    async with open_local_swarm(config) as swarm:
        await swarm.start_tracker()
        async with open_swarm_client(swarm.tracker_addr, config=client_config) as client:
            entry, memory, route, url, api_key = await _start_swarm_and_relay(
                swarm, client, model_alias, nodes, coverage_timeout_s
            )
            generation = await stream_completion(
                url, api_key, model_alias, prompt, max_tokens=max_new_tokens, on_text=on_text
            )
    sha256 = await trio.to_thread.run_sync(cached_sha256, config.model_path)
    async with open_worker(config.model_path, 0, None, threads=threads, max_sequences=1, model_sha256=sha256) as single:
        single_run = await generate_through(
            [single.client], generation.prompt_tokens, max_new_tokens, stop_tokens=single.info.eog_token_ids
        )
    return SwarmDemoReport(
        prompt=prompt,
        generation=generation,
        route=route_hops(route),
        single=single_run,
        node_memory_bytes=memory,
        bytes_per_block=entry.bytes_per_block,
        base_url=url,
    )


async def serve_swarm_demo(
    model_path: str | os.PathLike | None = None,
    *,
    nodes: int = 3,
    threads: int = 1,
    model_alias: str = "smollm2",
    coverage_timeout_s: float = 180.0,
    heartbeat_timeout_ms: int = 5000,
    workdir: str | os.PathLike | None = None,
    on_ready: Callable[[dict], None],
) -> None:
    """Start the demo's swarm and relay, call ``on_ready({"base_url", "api_key", "model"})``,
    and keep them until cancelled (Ctrl-C).

    Resource handling: as ``run_swarm_demo``.
    """
    config = _swarm_config(model_path, model_alias, heartbeat_timeout_ms, threads, workdir)
    async with open_demo_relay(config, nodes=nodes, coverage_timeout_s=coverage_timeout_s) as (swarm, url, api_key):
        on_ready({"base_url": f"{url}/v1", "api_key": api_key, "model": model_alias, "status_page": f"{url}/"})
        while True:
            swarm.check_alive()
            await trio.sleep(1.0)


def demo_swarm_config(
    model_path: str | os.PathLike | None = None, *, threads: int = 1, model_alias: str = "smollm2",
    heartbeat_timeout_ms: int = 5000, workdir: str | os.PathLike | None = None,
) -> LocalSwarmConfig:  # fmt: skip
    """The settings of the demo's swarm (``DEMO_MAX_SEQUENCES`` a worker, the relay trusted)."""
    return _swarm_config(model_path, model_alias, heartbeat_timeout_ms, threads, workdir)


@contextlib.asynccontextmanager
async def open_demo_relay(
    config: LocalSwarmConfig,
    *,
    nodes: int = 3,
    coverage_timeout_s: float = 180.0,
    relay_command: Sequence[str] | None = None,
) -> AsyncIterator[tuple[LocalSwarm, str, str]]:
    """The demo's swarm and relay: yields ``(swarm, relay URL, API key)`` once the tracker has a
    route of ``nodes`` hops and the relay listens. ``relay_command``: as
    ``LocalSwarm.start_relay``'s ``command``.

    Resource handling: every process is stopped on exit.
    """
    async with open_local_swarm(config) as swarm:
        await swarm.start_tracker()
        async with open_swarm_client(swarm.tracker_addr) as client:
            _entry, _memory, _route, url, api_key = await _start_swarm_and_relay(
                swarm, client, config.model_alias, nodes, coverage_timeout_s, relay_command
            )
        yield swarm, url, api_key


async def _model_entry(client: SwarmClient, alias: str) -> swarm_pb2.ModelEntry:
    for entry in await client.list_models():
        if alias in (entry.alias, entry.name, entry.sha256):
            return entry
    raise SwarmError(
        client.tracker_peer_id, swarm_pb2.Error.NOT_FOUND, f"the tracker has no model {alias!r} registered"
    )
