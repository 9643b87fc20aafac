"""The hops' prefix caches end to end (``--prefix-cache-bytes``): a real tracker and three real
node processes on loopback (a third of the model's blocks each: one route of three hops), with
each worker keeping ended sessions' prompt blocks, driven by the real client.

Asserted, for SmolLM2, Gemma-3 and the synthetic qwen2 and qwen3 models (DeepSeek V4 keeps no
prefixes: tests/test_worker_prefix_cache.py): the greedy tokens equal the same swarm's without the cache (and,
for the long prompt, one unsplit worker's) for a first session, a second one with the same prompt (every hop copies its cached blocks and
prefills only the tail: the workers' own row counters say so) and one whose prompt shares a
prefix that ends between two block boundaries; a cached and an uncached session batched
together each give their own tokens; a hop whose node was restarted (an empty cache) is a miss
with the same tokens; the caches stay within their byte budgets.

Through a relay on the same swarm (SmolLM2): a key's cached prefix is reused for its own next
request only, never for another key's (the hops' hit counters stay still), while two keys
marked shareable share theirs; the hits then reach the relay's ``/metrics`` through the
nodes' heartbeats.

The module's swarm is shared (one per model); every process is stopped at the end.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from agent._proto import swarm_pb2
from agent.core.owner.prefix_blocks import usable_blocks
from agent.demo.local_demo import generate_through
from agent.demo.swarm_demo import wait_for_coverage
from agent.harness.local_swarm import LocalSwarm, LocalSwarmConfig
from agent.io.client import SwarmClientConfig, open_swarm_client
from agent.io.worker.client import WorkerClient
from agent.io.worker.error import WorkerError
from agent.io.worker.process import open_worker
from agent.models import model_path, sha256_file
from agent.testing.tiny_models import TINY_MODELS, tiny_model_path

pytestmark = [pytest.mark.swarm, pytest.mark.slow]

NODES = 3
CHUNK_ROWS = 64
BLOCK_TOKENS = 64
PROMPT_BLOCKS = 5  # the long prompt: this many whole blocks
NEW_TOKENS = 12
CACHE_BYTES = 64 << 20
SETUP_TIMEOUT_S = 240.0
TEXT = (
    "Volunteer computing works because many people lend a little of their spare time and their "
    "machines to a common project. The machines come and go without warning: a laptop lid "
    "closes, a home router restarts, a game takes the GPU. A good system therefore keeps every "
    "piece of work small, checks what comes back, and moves on when a machine disappears. "
) * 6
OTHER_TAIL = " Which of these machines should run the next piece of work, and why?"


class Cached:
    def __init__(self, swarm: LocalSwarm, alias: str, memory_bytes: int) -> None:
        self.swarm = swarm
        self.alias = alias
        self.memory_bytes = memory_bytes
        self.prompts: dict[str, list[int]] = {}
        self.stop_tokens: list[int] = []
        self.reference: dict[str, list[int]] = {}


async def _start(swarm: LocalSwarm, alias: str) -> Cached:
    await swarm.start_tracker()
    async with _client_of(swarm) as c:
        (entry,) = [m for m in await c.list_models() if m.alias == alias]
        blocks_each = -(-entry.n_layer // NODES)
        memory = blocks_each * entry.bytes_per_block + entry.bytes_per_block // 2
        for i in range(NODES):
            swarm.start_node(f"node-{i + 1}", memory)
        route = await wait_for_coverage(c, swarm, alias, timeout_s=SETUP_TIMEOUT_S)
        cached = Cached(swarm, alias, memory)
        tokens, cached.stop_tokens = await c.tokenize(route, TEXT)
        assert len(tokens) >= PROMPT_BLOCKS * BLOCK_TOKENS + 10
        cached.prompts["long"] = tokens[: PROMPT_BLOCKS * BLOCK_TOKENS + 10]  # ends between two boundaries
        cached.prompts["whole"] = tokens[: PROMPT_BLOCKS * BLOCK_TOKENS]  # ends on a boundary
        tail, _ = await c.tokenize(route, OTHER_TAIL)
        # shares 2 whole blocks and part of a third with "long"
        cached.prompts["other"] = tokens[: 2 * BLOCK_TOKENS + 20] + tail[1:]
    # the references: the swarm without the cache (block_tokens 0: no hashes, nothing kept), and
    # for the long prompt one unsplit worker too
    async with _client_of(swarm, block_tokens=0) as c:
        for name, prompt in cached.prompts.items():
            run = await c.generate_tokens(alias, prompt, max_tokens=NEW_TOKENS, stop_tokens=cached.stop_tokens)
            assert run.cached_tokens == 0
            cached.reference[name] = run.tokens
    path = swarm.config.model_path
    async with open_worker(path, 0, None, threads=1, max_sequences=1, model_sha256=sha256_file(path)) as single:
        run = await generate_through(
            [single.client], cached.prompts["long"], NEW_TOKENS, stop_tokens=cached.stop_tokens
        )
        assert run.tokens == cached.reference["long"]
    return cached


@pytest.fixture(scope="module", params=["smollm2", "gemma3", "qwen2-tiny", "qwen3-tiny"])
def cached(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cached]:
    alias = request.param
    config = LocalSwarmConfig(
        model_path=tiny_model_path(alias) if alias in TINY_MODELS else model_path(alias), model_alias=alias,
        heartbeat_timeout_ms=15_000,
        node_args=("--prefix-cache-bytes", str(CACHE_BYTES)),
    )  # fmt: skip
    swarm = LocalSwarm(config, tmp_path_factory.mktemp(f"prefix-{alias}"))
    try:
        yield trio.run(_start, swarm, alias)
    finally:
        swarm.close_nowait()


def _client_of(swarm: LocalSwarm, block_tokens: int = BLOCK_TOKENS):
    config = SwarmClientConfig(prefill_chunk_tokens=CHUNK_ROWS, prefix_block_tokens=block_tokens)
    return open_swarm_client(swarm.tracker_addr, config=config)


def _health(cached: Cached, route: swarm_pb2.Route) -> list[tuple]:
    """Per hop of ``route``: (its worker's Health, its Info), the worker serving the hop's range."""
    by_peer = {proc.peer_id: proc for proc in cached.swarm.nodes.values()}
    found = []
    for hop in route.hops:
        mine = []
        for socket in by_peer[hop.peer_id].worker_sockets():
            # (a worker still loading another range does not answer yet)
            with WorkerClient(socket, timeout_s=10.0) as worker, contextlib.suppress(WorkerError):
                info = worker.info()
                if (info.layer_begin, info.layer_end) == (hop.begin, hop.end):
                    mine.append((worker.health(), info))
        assert len(mine) == 1, (hop, mine)
        found.append(mine[0])
    return found


async def _generate(cached: Cached, c, name: str, route: swarm_pb2.Route) -> tuple[object, list[int]]:
    """The generation of prompt ``name`` on ``route`` and the rows each hop's worker computed."""
    before = await trio.to_thread.run_sync(_health, cached, route)
    result = await c.generate_tokens(
        cached.alias, cached.prompts[name], max_tokens=NEW_TOKENS, stop_tokens=cached.stop_tokens, route=route
    )
    # the hops keep the session's blocks when they remove its sequence, after its end
    with trio.fail_after(10):
        while True:
            after = await trio.to_thread.run_sync(_health, cached, route)
            if all(a.active_sequences == 0 for a, _ in after):
                break
            await trio.sleep(0.05)
    rows = [a.forward_rows - b.forward_rows for (b, _), (a, _) in zip(before, after, strict=True)]
    return result, rows


@pytest.mark.timeout(600)
async def test_a_cached_prefix_is_copied_on_every_hop_and_gives_the_same_tokens(cached: Cached) -> None:
    async with _client_of(cached.swarm) as c:
        route = await c.route(cached.alias)
        first, first_rows = await _generate(cached, c, "long", route)
        assert first.tokens == cached.reference["long"]
        decode_rows = len(first.tokens) - 1
        prompt_len = len(cached.prompts["long"])
        assert first.cached_tokens == 0
        assert first_rows == [prompt_len + decode_rows] * NODES, first_rows

        second, second_rows = await _generate(cached, c, "long", route)
        assert second.tokens == cached.reference["long"]
        assert second.cached_tokens == PROMPT_BLOCKS * BLOCK_TOKENS  # every whole block of the prompt
        assert second_rows == [prompt_len - PROMPT_BLOCKS * BLOCK_TOKENS + len(second.tokens) - 1] * NODES

        # a prompt ending on a block boundary: its last block is computed (its row gives the token)
        whole, whole_rows = await _generate(cached, c, "whole", route)
        assert whole.tokens == cached.reference["whole"]
        assert whole.cached_tokens == (PROMPT_BLOCKS - 1) * BLOCK_TOKENS
        assert whole_rows == [BLOCK_TOKENS + len(whole.tokens) - 1] * NODES

        # shares two whole blocks and part of a third: two are copied
        other, other_rows = await _generate(cached, c, "other", route)
        assert other.tokens == cached.reference["other"]
        assert other.cached_tokens == 2 * BLOCK_TOKENS
        other_len = len(cached.prompts["other"])
        assert other_rows == [other_len - 2 * BLOCK_TOKENS + len(other.tokens) - 1] * NODES

        for health, info in await trio.to_thread.run_sync(_health, cached, route):
            assert 0 < info.prefix_cache_bytes <= CACHE_BYTES
            assert health.prefix_entries <= info.prefix_cache_sequences
            assert health.prefix_hits >= 3
            per_position = info.prefix_cache_bytes / (info.prefix_cache_sequences * info.n_ctx_per_sequence)
            assert health.prefix_positions * per_position <= CACHE_BYTES


@pytest.mark.timeout(600)
async def test_cached_and_uncached_sessions_batch_together_with_their_own_tokens(cached: Cached) -> None:
    async with _client_of(cached.swarm) as c, _client_of(cached.swarm, block_tokens=0) as plain:
        route = await c.route(cached.alias)
        warm, _ = await _generate(cached, c, "long", route)  # (cached everywhere by now)
        assert warm.tokens == cached.reference["long"]
        results: dict[str, object] = {}

        async def run(name: str, client) -> None:
            results[name] = await client.generate_tokens(
                cached.alias, cached.prompts[name], max_tokens=NEW_TOKENS, stop_tokens=cached.stop_tokens, route=route
            )

        for _attempt in range(3):  # until the two shared a Forward somewhere (timing decides)
            before = await trio.to_thread.run_sync(_health, cached, route)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, "long", c)  # copies its prompt's blocks
                nursery.start_soon(run, "whole", plain)  # computes all of its prompt
            after = await trio.to_thread.run_sync(_health, cached, route)
            assert results["long"].tokens == cached.reference["long"]  # type: ignore[attr-defined]
            assert results["long"].cached_tokens == PROMPT_BLOCKS * BLOCK_TOKENS  # type: ignore[attr-defined]
            assert results["whole"].tokens == cached.reference["whole"]  # type: ignore[attr-defined]
            assert results["whole"].cached_tokens == 0  # type: ignore[attr-defined]
            # a Forward that carried more than one step: the sessions were batched
            shared = sum(
                (a.data_plane_steps - b.data_plane_steps) - (a.data_plane_forwards - b.data_plane_forwards)
                for (b, _), (a, _) in zip(before, after, strict=True)
            )
            if shared > 0:
                break
        else:
            raise AssertionError("the cached and the uncached session never shared a Forward in 3 tries")


@pytest.mark.timeout(600)
async def test_a_restarted_hop_is_a_miss_with_the_same_tokens(cached: Cached) -> None:
    async with _client_of(cached.swarm) as c:
        route = await c.route(cached.alias)
        warm, _ = await _generate(cached, c, "long", route)  # (cached everywhere by now)
        assert warm.tokens == cached.reference["long"]
        lost = route.hops[1].peer_id
        (victim,) = [n for n, p in cached.swarm.nodes.items() if p.peer_id == lost]
        await cached.swarm.kill_node(victim)
        cached.swarm.start_node(f"{victim}-again", cached.memory_bytes)
        with trio.fail_after(SETUP_TIMEOUT_S):  # (until the tracker routes around the lost node)
            while lost in [hop.peer_id for hop in route.hops]:
                await trio.sleep(0.5)
                route = await wait_for_coverage(c, cached.swarm, cached.alias, timeout_s=SETUP_TIMEOUT_S)
        missed, rows = await _generate(cached, c, "long", route)
        assert missed.tokens == cached.reference["long"]
        assert missed.cached_tokens == 0  # the new hop holds nothing: every hop computes it all
        assert rows == [len(cached.prompts["long"]) + len(missed.tokens) - 1] * NODES
        again, rows = await _generate(cached, c, "long", route)
        assert again.tokens == cached.reference["long"]
        assert again.cached_tokens == PROMPT_BLOCKS * BLOCK_TOKENS


# the relay's client prefills in chunks of its default size: a copy ends on a chunk boundary
RELAY_CHUNK_ROWS = SwarmClientConfig().prefill_chunk_tokens


async def _relay_completion(cached: Cached, url: str, api_key: str, prompt: str, route: swarm_pb2.Route) -> dict:
    """One greedy completion through the relay, once every hop of ``route`` has ended it (kept its blocks)."""
    async with httpx.AsyncClient(base_url=url, timeout=120.0) as http:
        reply = await http.post(
            "/v1/completions", json={"model": cached.alias, "prompt": prompt, "max_tokens": 4, "temperature": 0},
            headers={"Authorization": f"Bearer {api_key}"},
        )  # fmt: skip
    assert reply.status_code == 200, reply.text
    with trio.fail_after(10):
        while not all(a.active_sequences == 0 for a, _ in await trio.to_thread.run_sync(_health, cached, route)):
            await trio.sleep(0.05)
    return reply.json()


def _hits(cached: Cached, route: swarm_pb2.Route) -> list[int]:
    return [health.prefix_hits for health, _ in _health(cached, route)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("cached", ["smollm2"], indirect=True)
async def test_a_key_s_cached_prefix_serves_only_that_key_unless_keys_are_shareable(cached: Cached) -> None:
    swarm = cached.swarm
    url = swarm.relay_url if swarm.relay is not None and swarm.relay.alive else await swarm.start_relay()
    alice, bob = swarm.add_relay_key("alice"), swarm.add_relay_key("bob")
    public = [swarm.add_relay_key(f"public-{i}", shareable_prefixes=True) for i in range(2)]
    async with _client_of(swarm) as c:
        route = await c.route(cached.alias)
        prompt = TEXT * 2
        tokens, _ = await c.tokenize(route, prompt)
    assert len(tokens) > RELAY_CHUNK_ROWS + BLOCK_TOKENS
    # every whole block is kept; the copy ends on the chunk boundary below the prompt's last token
    copied = usable_blocks(len(tokens) // BLOCK_TOKENS, len(tokens), BLOCK_TOKENS, RELAY_CHUNK_ROWS) * BLOCK_TOKENS
    assert copied >= RELAY_CHUNK_ROWS

    first = await _relay_completion(cached, url, alice, prompt, route)
    assert first["usage"]["prompt_tokens"] == len(tokens)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    hits_before = await trio.to_thread.run_sync(_hits, cached, route)
    other = await _relay_completion(cached, url, bob, prompt, route)
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # another key: computed again
    assert await trio.to_thread.run_sync(_hits, cached, route) == hits_before  # no hop copied a block for it
    again = await _relay_completion(cached, url, alice, prompt, route)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == copied  # its own: copied
    assert [h - b for h, b in zip(await trio.to_thread.run_sync(_hits, cached, route), hits_before, strict=True)] == [
        1
    ] * NODES

    shared_first = await _relay_completion(cached, url, public[0], prompt, route)
    assert shared_first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # not alice's cache either
    shared = await _relay_completion(cached, url, public[1], prompt, route)
    assert shared["usage"]["prompt_tokens_details"]["cached_tokens"] == copied  # shareable keys share
    texts = {r["choices"][0]["text"] for r in (first, other, again, shared_first, shared)}
    assert len(texts) == 1  # (greedy: the same text, cached or not)

    # the hits reach the relay's /metrics by the nodes' heartbeats and the tracker's node list
    hops = {(hop.peer_id, str(hop.begin), str(hop.end)) for hop in route.hops}
    with trio.fail_after(60):
        while True:
            async with httpx.AsyncClient(base_url=url, timeout=30.0) as http:
                text = (await http.get("/metrics")).text
            samples = {
                (s.name, s.labels["peer_id"], s.labels["begin"], s.labels["end"]): s.value
                for family in text_string_to_metric_families(text)
                for s in family.samples
                if s.name.startswith("baton_node_prefix_cache")
            }
            if all(samples.get(("baton_node_prefix_cache_hits_total", *hop), 0) >= 2 for hop in hops):
                break
            await trio.sleep(0.5)
    async with httpx.AsyncClient(base_url=url, timeout=30.0) as http:
        page = (await http.get("/")).text  # and on its status page, a row per hop
    table = page[page.index('<table class="prefix-caches">') : page.index("<h2>Credits</h2>")]
    assert all(f'title="{hop.peer_id}"' in table for hop in route.hops)
    for hop in hops:
        assert 0 < samples[("baton_node_prefix_cache_hit_ratio", *hop)] <= 1
        assert (
            0
            < samples[("baton_node_prefix_cache_bytes", *hop)]
            <= samples[("baton_node_prefix_cache_budget_bytes", *hop)]
        )
        assert samples[("baton_node_prefix_cache_budget_bytes", *hop)] <= CACHE_BYTES
