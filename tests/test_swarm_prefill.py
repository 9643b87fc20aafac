"""The prompt on the workers' data plane, end to end: a real tracker and six real node processes
on loopback (ten blocks of SmolLM2 each: a route of three hops, and a second copy
of every range to replace a lost hop with), driven by the real client.

A new session binds its route before its first step (each hop's node opens it there), and its
prompt goes worker to worker as chunks of ``prefill_chunk_tokens`` rows, sent down the route
together (pipelined). Asserted: the greedy tokens equal one unsplit worker's, for a prompt of
several chunks and one shorter than a chunk; the chunks went on the data plane (the workers'
own counters: their node-path Forwards do not move, their data-plane steps count every chunk);
one chunk per round trip and the node path give the same tokens; and a hop killed mid-prefill
is replaced while the other hops keep their caches, with the same tokens.

The module's swarm is shared; the kill test runs last. Every process is stopped at the end.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
import trio

from agent._proto import swarm_pb2
from agent.core.owner.session import Session
from agent.demo.local_demo import generate_through
from agent.demo.swarm_demo import wait_for_copies, wait_for_coverage
from agent.harness.local_swarm import LocalSwarm, LocalSwarmConfig
from agent.io.client import SwarmClientConfig, open_swarm_client
from agent.io.worker.client import WorkerClient
from agent.io.worker.process import open_worker
from agent.models import model_path, sha256_file

pytestmark = [pytest.mark.swarm, pytest.mark.slow]

ALIAS = "smollm2"
NODES = 6
BLOCKS_EACH = 10
CHUNK_ROWS = 64
LONG_CHUNKS = 5  # the long prompt: this many whole chunks
NEW_TOKENS = 24
SETUP_TIMEOUT_S = 240.0
SHORT_PROMPT = "The capital of France is"
LONG_TEXT = (
    "Volunteer computing works because many people lend a little of their spare time and their "
    "machines to a common project. The machines come and go without warning: a laptop lid "
    "closes, a home router restarts, a game takes the GPU. A good system therefore keeps every "
    "piece of work small, checks what comes back, and moves on when a machine disappears. "
) * 6


class Prefill:
    def __init__(self, swarm: LocalSwarm, memory_bytes: int) -> None:
        self.swarm = swarm
        self.memory_bytes = memory_bytes
        self.prompts: dict[str, list[int]] = {}  # name -> prompt tokens
        self.stop_tokens: list[int] = []
        self.reference: dict[str, list[int]] = {}  # name -> greedy tokens of one unsplit worker


async def _start(swarm: LocalSwarm) -> Prefill:
    await swarm.start_tracker()
    config = SwarmClientConfig(prefill_chunk_tokens=CHUNK_ROWS)
    async with open_swarm_client(swarm.tracker_addr, config=config) as c:
        (entry,) = [m for m in await c.list_models() if m.alias == ALIAS]
        memory = BLOCKS_EACH * entry.bytes_per_block + entry.bytes_per_block // 2
        for i in range(NODES):
            swarm.start_node(f"node-{i + 1}", memory)
        route = await wait_for_coverage(c, swarm, ALIAS, timeout_s=SETUP_TIMEOUT_S)
        prefill = Prefill(swarm, memory)
        long_tokens, prefill.stop_tokens = await c.tokenize(route, LONG_TEXT)
        assert len(long_tokens) >= LONG_CHUNKS * CHUNK_ROWS
        prefill.prompts["long"] = long_tokens[: LONG_CHUNKS * CHUNK_ROWS]
        prefill.prompts["short"], _ = await c.tokenize(route, SHORT_PROMPT)
        assert len(prefill.prompts["short"]) < CHUNK_ROWS
    path = swarm.config.model_path
    async with open_worker(path, 0, None, threads=1, max_sequences=1, model_sha256=sha256_file(path)) as single:
        for name, tokens in prefill.prompts.items():
            run = await generate_through([single.client], tokens, NEW_TOKENS, stop_tokens=prefill.stop_tokens)
            prefill.reference[name] = run.tokens
    return prefill


@pytest.fixture(scope="module")
def prefill(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prefill]:
    config = LocalSwarmConfig(model_path=model_path(ALIAS), model_alias=ALIAS, heartbeat_timeout_ms=15_000)
    swarm = LocalSwarm(config, tmp_path_factory.mktemp("prefill"))
    try:
        yield trio.run(_start, swarm)
    finally:
        swarm.close_nowait()


def _client(prefill: Prefill, **overrides):
    fields: dict = dict(prefill_chunk_tokens=CHUNK_ROWS, replan_attempts=2, replan_wait_s=30.0)
    fields.update(overrides)
    return open_swarm_client(prefill.swarm.tracker_addr, config=SwarmClientConfig(**fields))


def _counts(prefill: Prefill, route: swarm_pb2.Route) -> list[tuple[int, int]]:
    """Per hop of ``route``: (Forwards its node made, steps its data plane computed), as its
    worker (the one serving the hop's range) says."""
    by_peer = {proc.peer_id: proc for proc in prefill.swarm.nodes.values()}
    counts = []
    for hop in route.hops:
        found = []
        for socket in by_peer[hop.peer_id].worker_sockets():
            with WorkerClient(socket, timeout_s=10.0) as worker:
                info = worker.info()
                if (info.layer_begin, info.layer_end) == (hop.begin, hop.end):
                    health = worker.health()
                    found.append((health.forward_calls - health.data_plane_forwards, health.data_plane_steps))
        assert len(found) == 1, (hop, found)
        counts.append(found[0])
    return counts


@pytest.mark.timeout(400)
async def test_the_prompt_goes_worker_to_worker_and_gives_the_unsplit_workers_tokens(prefill: Prefill) -> None:
    async with _client(prefill) as c:
        for name, prompt in prefill.prompts.items():
            route = await c.route(ALIAS)
            before = await trio.to_thread.run_sync(_counts, prefill, route)
            result = await c.generate_tokens(
                ALIAS, prompt, max_tokens=NEW_TOKENS, stop_tokens=prefill.stop_tokens, route=route
            )
            after = await trio.to_thread.run_sync(_counts, prefill, route)
            assert result.tokens == prefill.reference[name], name
            chunks = -(-len(prompt) // CHUNK_ROWS)
            decode_steps = len(result.tokens) - 1
            assert result.data_plane_steps == chunks + decode_steps, (name, result.data_plane_steps)
            assert not result.replans
            # on every hop: no Forward of the node's own, every chunk and decode step on the data
            # plane, and no step past the owner's end (the greedy continuation counts the token
            # the prefill gives)
            for (node_before, steps_before), (node_after, steps_after) in zip(before, after, strict=True):
                assert node_after == node_before, (name, before, after)
                assert steps_after - steps_before == chunks + decode_steps, (name, before, after)
            assert {h["rows"] for h in result.node_rows} == {len(prompt) + decode_steps}, result.node_rows


@pytest.mark.timeout(400)
async def test_one_chunk_per_round_trip_and_the_node_path_give_the_same_tokens(prefill: Prefill) -> None:
    prompt = prefill.prompts["long"]
    chunks = len(prompt) // CHUNK_ROWS
    async with _client(prefill, prefill_chunks_in_flight=1) as c:
        one_by_one = await c.generate_tokens(ALIAS, prompt, max_tokens=NEW_TOKENS, stop_tokens=prefill.stop_tokens)
    async with _client(prefill, prefill_on_data_plane=False) as c:
        node_path = await c.generate_tokens(ALIAS, prompt, max_tokens=NEW_TOKENS, stop_tokens=prefill.stop_tokens)
    assert one_by_one.tokens == node_path.tokens == prefill.reference["long"]
    assert one_by_one.data_plane_steps == chunks + len(one_by_one.tokens) - 1
    assert node_path.data_plane_steps == len(node_path.tokens) - 1  # the prompt through the node agents


@pytest.mark.timeout(400)
@pytest.mark.parametrize("wire", ["f16", "q8"])
async def test_a_lossy_wire_gives_the_same_logits_worker_to_worker_and_through_the_nodes(
    prefill: Prefill, wire: str
) -> None:
    """The workers (C++) and the nodes (Python) encode a session's boundary rows to the same
    bytes: a prompt and its decode on the data plane give bit for bit the logits they give
    through the node agents."""
    prompt = prefill.prompts["long"]
    runs = {}
    for name, overrides in (("data plane", {}), ("node path", {"data_plane": False})):
        scores: list[tuple[list[int], list[float]]] = []

        async def on_token(token: int, logits, route, scores=scores) -> bool:
            scores.append((logits.ids.tolist(), logits.logits.tolist()))  # greedy: the top-K
            return False

        async with _client(prefill, wire=wire, **overrides) as c:
            result = await c.generate_tokens(
                ALIAS, prompt, max_tokens=NEW_TOKENS, stop_tokens=prefill.stop_tokens, on_token=on_token
            )
        runs[name] = (result, scores)
    (plane, plane_scores), (nodes, node_scores) = runs["data plane"], runs["node path"]
    assert plane.data_plane_steps == len(prompt) // CHUNK_ROWS + len(plane.tokens) - 1
    assert nodes.data_plane_steps == 0
    assert plane.tokens == nodes.tokens and plane_scores == node_scores


@pytest.mark.timeout(400)
async def test_a_hop_killed_mid_prefill_is_replaced_and_the_tokens_stay_the_same(
    prefill: Prefill, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = prefill.prompts["long"]
    async with _client(prefill) as c:
        await wait_for_copies(c, prefill.swarm, 2, timeout_s=SETUP_TIMEOUT_S)  # a replacement for each hop
        route = await c.route(ALIAS)
        victim_hop = route.hops[1]  # the middle hop: rebuilt from the rows the first hop kept
        (victim,) = [p for p in prefill.swarm.nodes.values() if p.peer_id == victim_hop.peer_id]
        answered: list[int] = []
        receive_scores = Session.receive_scores

        def kill_after_two_chunks(self: Session, *args, **kwargs):
            token = receive_scores(self, *args, **kwargs)
            if token is None:  # a chunk's result: the rest of the prompt is on its way
                answered.append(self.cached_positions)
                if len(answered) == 2:
                    victim.signal_group(signal.SIGKILL)
            return token

        monkeypatch.setattr(Session, "receive_scores", kill_after_two_chunks)
        result = await c.generate_tokens(
            ALIAS, prompt, max_tokens=NEW_TOKENS, stop_tokens=prefill.stop_tokens, route=route
        )
    assert answered[:2] == [CHUNK_ROWS, 2 * CHUNK_ROWS], answered
    assert not victim.alive
    assert result.tokens == prefill.reference["long"]
    # the other hops kept their caches (what they computed past the answered chunks was trimmed),
    # the replacement was rebuilt from the rows the hop before it kept, in its chunks' shapes
    assert result.replans == 1 and result.resumes == 1, result
    assert victim.peer_id not in [h["node"] for h in result.route]
