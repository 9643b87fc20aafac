"""The swarm end to end: a real tracker and real node processes on loopback, SmolLM2 split
across them, driven by the real client over libp2p.

One three-node swarm (each node offered memory for a third of the model) is shared by the
tests of this module that do not break it; the healing test and the demo start their own.
The tracker-restart test runs last on the shared swarm. Every process is stopped at the end
(terminate, then kill), and each test has its own timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent._proto import swarm_pb2
from agent.core.net.multiaddrs import is_channel_multiaddr
from agent.core.wire.admission import issue_admission, sign_fingerprint
from agent.core.wire.swarm_wire import NODE_PROTOCOL, STEP_PROTOCOL, TRACKER_PROTOCOL, crc32, token_checksum
from agent.demo.local_demo import generate_through
from agent.demo.swarm_demo import node_memory_bytes, wait_for_coverage
from agent.harness.local_swarm import LocalSwarm, LocalSwarmConfig
from agent.io.client import SwarmClientConfig, open_swarm_client
from agent.io.keys import peer_id_of
from agent.io.net.p2p import open_p2p_transport
from agent.io.net.transport import TransportError
from agent.io.worker.process import open_worker
from agent.models import model_path, sha256_file
from agent.runtime import expected_pin

pytestmark = [pytest.mark.swarm, pytest.mark.slow]

ALIAS = "smollm2"
PROMPTS = (
    "The capital of France is",
    "Volunteer computing works because",
    "def fibonacci(n):",
)
NEW_TOKENS = 48
SETUP_TIMEOUT_S = 240.0
REQUEST_TIMEOUT_S = 10.0


# --- the shared swarm ----------------------------------------------------------------------------


@dataclasses.dataclass
class RunningSwarm:
    swarm: LocalSwarm
    model_path: Path
    model_sha256: str
    n_layer: int
    bytes_per_block: int

    @property
    def addr(self) -> str:
        return self.swarm.tracker_addr

    def node_ids(self) -> dict[str, str]:
        return {name: proc.peer_id for name, proc in self.swarm.nodes.items()}


async def _start(swarm: LocalSwarm, nodes: int, blocks_each: int | None = None) -> tuple[int, int]:
    await swarm.start_tracker()
    async with open_swarm_client(swarm.tracker_addr) as client:
        (entry,) = [m for m in await client.list_models() if m.alias == ALIAS]
        if blocks_each is None:
            memory = node_memory_bytes(entry.n_layer, entry.bytes_per_block, nodes)
        else:
            memory = blocks_each * entry.bytes_per_block + entry.bytes_per_block // 2
        for i in range(nodes):
            swarm.start_node(f"node-{i + 1}", memory)
        await wait_for_coverage(client, swarm, ALIAS, timeout_s=SETUP_TIMEOUT_S)
    return entry.n_layer, entry.bytes_per_block


def _new_swarm(workdir: Path, heartbeat_timeout_ms: int) -> LocalSwarm:
    config = LocalSwarmConfig(
        model_path=model_path("smollm2"), model_alias=ALIAS, heartbeat_timeout_ms=heartbeat_timeout_ms
    )
    return LocalSwarm(config, workdir)


@contextlib.contextmanager
def running_swarm(workdir: Path, nodes: int) -> Iterator[RunningSwarm]:
    """For module fixtures: the processes outlive the ``trio.run`` that starts them."""
    swarm = _new_swarm(workdir, 5000)
    try:
        n_layer, bpb = trio.run(_start, swarm, nodes, None)
        path = swarm.config.model_path
        yield RunningSwarm(swarm, path, sha256_file(path), n_layer, bpb)
    finally:
        swarm.close_nowait()


@contextlib.asynccontextmanager
async def running_swarm_async(
    workdir: Path, nodes: int, *, blocks_each: int | None = None, heartbeat_timeout_ms: int = 5000
) -> AsyncIterator[RunningSwarm]:
    """For one test: started and stopped inside its trio run."""
    swarm = _new_swarm(workdir, heartbeat_timeout_ms)
    try:
        n_layer, bpb = await _start(swarm, nodes, blocks_each)
        path = swarm.config.model_path
        yield RunningSwarm(swarm, path, await trio.to_thread.run_sync(sha256_file, path), n_layer, bpb)
    finally:
        with trio.CancelScope(shield=True):
            await swarm.aclose()


@pytest.fixture(scope="module")
def swarm3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningSwarm]:
    """Tracker + three nodes, each able to hold a third of SmolLM2."""
    with running_swarm(tmp_path_factory.mktemp("swarm3"), 3) as running:
        yield running


@pytest.fixture(scope="module")
def reference(swarm3: RunningSwarm) -> dict[str, tuple[list[int], list[int]]]:
    """prompt -> (prompt tokens, greedy tokens of one unsplit worker)."""

    async def compute() -> dict[str, tuple[list[int], list[int]]]:
        out = {}
        async with open_worker(
            swarm3.model_path, 0, None, threads=1, max_sequences=1, model_sha256=swarm3.model_sha256
        ) as single:
            for prompt in PROMPTS:
                tokens = await single.client.tokenize(prompt, add_special=True)
                run = await generate_through([single.client], tokens, NEW_TOKENS, stop_tokens=single.info.eog_token_ids)
                out[prompt] = (tokens, run.tokens)
        return out

    return trio.run(compute)


def client(running: RunningSwarm, **config):
    return open_swarm_client(running.addr, config=SwarmClientConfig(**config) if config else None)


def assert_swarm_alive(running: RunningSwarm) -> None:
    running.swarm.check_alive()


# --- healing -----------------------------------------------------------------------------------------


async def _routes_without(c, peer_id: str, timeout_s: float) -> list[str]:
    """Poll plain route requests (no avoid list) until the tracker's routes leave ``peer_id``."""
    with trio.fail_after(timeout_s):
        while True:
            with contextlib.suppress(Exception):
                route = await c.route(ALIAS)
                hops = [h.peer_id for h in route.hops]
                if peer_id not in hops:
                    return hops
            await trio.sleep(0.05)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
async def test_a_lost_node_is_named_and_routed_around_before_its_heartbeat_timeout(tmp_path: Path, how: str) -> None:
    # long enough that only the fast path (the owner names the peer, the tracker probes it)
    # can explain a quick recovery
    heartbeat_timeout_ms = 15000
    # killed: a sampled generation, whose lost last hop was drawing its tokens (a seed gives the
    # same tokens through the resume, whoever draws them); stopped: a greedy one
    sampling = {"temperature": 0.8, "seed": 3} if how == "SIGKILL" else {}
    async with running_swarm_async(tmp_path, 4, blocks_each=15, heartbeat_timeout_ms=heartbeat_timeout_ms) as running:
        async with client(running, replan_attempts=1, replan_wait_s=30.0) as c:
            route = await c.route(ALIAS)
            reference_run = await c.generate(ALIAS, PROMPTS[0], max_tokens=NEW_TOKENS, **sampling)
            by_peer = {proc.peer_id: name for name, proc in running.swarm.nodes.items()}
            victim_id = route.hops[-1].peer_id
            victim = by_peer[victim_id]
            assert len(route.hops) == 2  # two nodes of 15 blocks per copy, two copies

            # lost between two steps of a running generation: the client replans around it
            pieces = 0
            lost_at: list[float] = []
            gaps: list[float] = []
            last_piece = [0.0]

            def lose_after_five(text: str) -> None:
                nonlocal pieces
                pieces += 1
                now = trio.current_time()
                if lost_at and len(gaps) == 0:
                    gaps.append(now - last_piece[0])  # last token before the loss -> first after
                last_piece[0] = now
                if pieces == 5:
                    running.swarm.nodes[victim].signal_group(getattr(signal, how))
                    lost_at.append(now)

            result = await c.generate(
                ALIAS, PROMPTS[0], max_tokens=NEW_TOKENS, on_text=lose_after_five, route=route, **sampling
            )
            assert result.replans == 1
            assert victim_id not in [h["node"] for h in result.route]
            assert result.tokens == reference_run.tokens
            assert gaps and gaps[0] < 5.0, gaps  # named by the step deadline and a probe, not a 30 s timeout
            # the tracker took it out of routes for everyone, well before its heartbeat timeout
            hops = await _routes_without(c, victim_id, timeout_s=1.0)
            assert trio.current_time() - lost_at[0] < heartbeat_timeout_ms / 1000 / 2, (lost_at, trio.current_time())
            assert victim_id not in hops
            again = await c.generate(ALIAS, PROMPTS[0], max_tokens=NEW_TOKENS, **sampling)
            assert again.tokens == reference_run.tokens
            assert victim_id not in [h["node"] for h in again.route]
        if how == "SIGSTOP":
            running.swarm.nodes[victim].signal_group(signal.SIGCONT)
        await running.swarm.kill_node(victim)
        running.swarm.check_alive()


@pytest.mark.timeout(400)
def test_baton_generate_survives_its_first_hop_being_killed(tmp_path: Path) -> None:
    """The case that used to exit 2: the first hop dies mid-generation. Tokenizing and
    detokenizing are local now, so only the steps replan."""

    async def main() -> None:
        async with running_swarm_async(tmp_path, 4, blocks_each=15, heartbeat_timeout_ms=15000) as running:
            argv = [
                sys.executable, "-m", "agent.cli", "generate", "--tracker", running.addr, "--model", ALIAS,
                # long enough that the kill lands mid-generation: the victim is known from the
                # nodes' heartbeats (1 s apart), and 160 tokens over the data plane took ~2.5 s,
                # which a late heartbeat could outlast (the kill then came after the last step)
                "--max-tokens", "400", "--cache-dir", str(tmp_path / "client-cache"), PROMPTS[1],
            ]  # fmt: skip
            undisturbed = await trio.run_process(argv, capture_stdout=True, capture_stderr=True)
            reference_text = undisturbed.stdout.decode().split("\nroute:")[0]
            by_peer = {proc.peer_id: name for name, proc in running.swarm.nodes.items()}

            def first_hop_starts(nodes) -> dict[str, int]:
                return {
                    node.peer_id: status.sessions_started
                    for node in nodes for status in node.serving if status.assignment.begin == 0
                }  # fmt: skip

            async with client(running) as c:  # (the undisturbed run's start is in these: it ran for seconds)
                started_before = first_hop_starts(await c.list_nodes())
            async with trio.open_nursery() as nursery:
                process = await nursery.start(
                    partial(trio.run_process, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, check=False)
                )
                output = b""
                while len(output) < 20:  # some text streamed: it is decoding
                    chunk = await process.stdout.receive_some(1024)
                    assert chunk, "baton generate ended before streaming any text"
                    output += chunk
                async with client(running) as c:
                    with trio.fail_after(10):
                        victim_id = None
                        while victim_id is None:  # the first hop that started its session (nodes report it)
                            nodes = await c.list_nodes()
                            for peer_id, started in first_hop_starts(nodes).items():
                                in_use = [s.sequences_in_use for n in nodes if n.peer_id == peer_id for s in n.serving]
                                # another copy's report may still show the undisturbed run's session
                                if started > started_before.get(peer_id, 0) and any(in_use):
                                    victim_id = peer_id
                            await trio.sleep(0.1)
                running.swarm.nodes[by_peer[victim_id]].signal_group(signal.SIGKILL)
                async for chunk in process.stdout:
                    output += chunk
                errors = b"".join([chunk async for chunk in process.stderr]).decode()
                await process.wait()
            assert process.returncode == 0, errors
            text = output.decode()
            assert text.split("\nroute:")[0] == reference_text
            assert f"replacing {victim_id}" in errors, (len(text), errors)
            assert victim_id not in text.split("\nroute:")[1]
            # only the lost first hop was rebuilt (from the owner's tokens); the others kept their caches
            assert "recovered:     1 lost hop(s); 1 replaced with the other hops' caches kept" in text, text
            await running.swarm.kill_node(by_peer[victim_id])

    trio.run(main)


# --- circuit relay through the tracker --------------------------------------------------------------


async def _single_worker_tokens(path: Path, sha256: str, prompt: str) -> tuple[list[int], list[int]]:
    """(prompt tokens, greedy tokens) of one unsplit worker."""
    async with open_worker(path, 0, None, threads=1, max_sequences=1, model_sha256=sha256) as single:
        tokens = await single.client.tokenize(prompt, add_special=True)
        run = await generate_through([single.client], tokens, NEW_TOKENS, stop_tokens=single.info.eog_token_ids)
    return tokens, run.tokens


@contextlib.asynccontextmanager
async def _swarm_with_odd_middle_node(
    tmp_path: Path, *, extra_args: list[str] | None = None, **start_options: object
) -> AsyncIterator[tuple[LocalSwarm, swarm_pb2.Route, RunningSwarm, str]]:
    """Tracker + 3 nodes, the one the middle range goes to started with ``extra_args`` and
    ``start_options`` (``LocalSwarm.start_node``'s); yields the swarm, its route, the
    ``RunningSwarm`` and the odd node's name. The swarm is closed on exit."""
    swarm = _new_swarm(tmp_path, 5000)
    try:
        await swarm.start_tracker()
        names = ["node-1", "node-2", "node-3"]
        odd = sorted(names, key=swarm.peer_id)[1]  # ranges go to nodes in peer id order
        async with open_swarm_client(swarm.tracker_addr) as c:
            (entry,) = [m for m in await c.list_models() if m.alias == ALIAS]
            memory = node_memory_bytes(entry.n_layer, entry.bytes_per_block, len(names))
            for name in names:
                if name == odd:
                    swarm.start_node(name, memory, extra_args or [], **start_options)
                else:
                    swarm.start_node(name, memory)
            route = await wait_for_coverage(c, swarm, ALIAS, timeout_s=SETUP_TIMEOUT_S)
        path = swarm.config.model_path
        sha256 = await trio.to_thread.run_sync(sha256_file, path)
        yield swarm, route, RunningSwarm(swarm, path, sha256, entry.n_layer, entry.bytes_per_block), odd
    finally:
        with trio.CancelScope(shield=True):
            await swarm.aclose()


@pytest.mark.timeout(400)
async def test_a_node_that_cannot_be_dialled_is_reached_through_the_tracker_relay(tmp_path: Path) -> None:
    """Tracker + 3 nodes; the one serving the middle range listens nowhere (``--listen none
    --relay``): the node before it and the tracker's relay carry its traffic. Output equals
    one unsplit worker, before and after a tracker restart (the node reserves again). Only
    admitted peers may reserve a slot on the relay or open circuits through it."""
    async with _swarm_with_odd_middle_node(tmp_path, listen="none", relay=True) as (swarm, route, running, hidden):
        path = swarm.config.model_path
        hidden_id = swarm.nodes[hidden].peer_id
        circuit = f"{swarm.tracker_addr}/p2p-circuit/p2p/{hidden_id}"
        assert [(h.begin, h.end) for h in route.hops] == [(0, 10), (10, 20), (20, 30)]
        assert route.hops[1].peer_id == hidden_id
        assert list(route.hops[1].addrs) == [circuit]  # its only address
        assert f"listening on {circuit}" in swarm.nodes[hidden].log_tail(20_000)

        prompt_tokens, expected = await _single_worker_tokens(path, running.model_sha256, PROMPTS[0])
        async with client(running, replan_attempts=0) as c:
            result = await c.generate(ALIAS, PROMPTS[0], max_tokens=NEW_TOKENS)
            # the others have direct channels: the last hop pushed its results over one
            assert all(is_channel_multiaddr(a) for a in (route.hops[0].addrs[0], route.hops[2].addrs[0]))
            assert c.transport.connections_accepted >= 1 and c.transport.channel_requests >= NEW_TOKENS
        assert result.data_plane_steps == 0, "a hop reached only through the relay keeps the route on the node path"
        assert result.prompt_tokens == prompt_tokens
        assert result.tokens == expected
        assert [h["node"] for h in result.route][1] == hidden_id

        # The relay serves admitted peers only.
        key = Ed25519PrivateKey.generate()
        with pytest.raises(TransportError, match="refused the reservation"):
            async with open_p2p_transport(key, relay_addrs=[swarm.tracker_addr]):
                pass
        async with open_p2p_transport(key) as stranger:
            with pytest.raises(TransportError, match="could not connect"):
                await stranger.request(hidden_id, [circuit], NODE_PROTOCOL, b"", timeout_s=REQUEST_TIMEOUT_S)
            await admitted_node(stranger, key, running)  # now an admitted node
            assert await stranger.keep_relay_reservation(swarm.tracker_addr) == (
                f"{swarm.tracker_addr}/p2p-circuit/p2p/{stranger.peer_id}"
            )
            raw = await stranger.request(
                hidden_id, [circuit], NODE_PROTOCOL, b"\xff\x01junk", timeout_s=REQUEST_TIMEOUT_S
            )
            assert swarm_pb2.NodeReply.FromString(raw).error.code == swarm_pb2.Error.INVALID_ARGUMENT

        # A restarted tracker has no reservations: the node makes its own again.
        await swarm.stop_tracker(kill=True)
        await swarm.start_tracker()
        async with client(running, replan_attempts=0) as c:
            after = await wait_for_coverage(c, swarm, ALIAS, timeout_s=60)
            assert list(after.hops[1].addrs) == [circuit]
            again = await c.generate(ALIAS, PROMPTS[0], max_tokens=NEW_TOKENS)
        assert again.tokens == expected
        swarm.check_alive()


@pytest.mark.timeout(300)
async def test_a_route_with_a_node_without_the_data_plane_stays_on_the_node_path(tmp_path: Path) -> None:
    """Tracker + 3 nodes, the middle one with ``--no-data-plane``: the owner binds the last hop,
    is refused by the middle one, unbinds the last hop again and decodes through the nodes:
    output equals one unsplit worker, and every hop counts every row."""
    async with _swarm_with_odd_middle_node(tmp_path, extra_args=["--no-data-plane"]) as (swarm, route, running, plain):
        assert route.hops[1].peer_id == swarm.nodes[plain].peer_id
        prompt_tokens, expected = await _single_worker_tokens(swarm.config.model_path, running.model_sha256, PROMPTS[0])
        async with client(running, replan_attempts=0) as c:
            result = await c.generate(ALIAS, PROMPTS[0], max_tokens=NEW_TOKENS)
        assert result.tokens == expected and result.replans == 0
        assert result.data_plane_steps == 0, "one hop without the data plane keeps the route on the node path"
        assert {h["rows"] for h in result.node_rows} == {len(prompt_tokens) + len(result.tokens) - 1}
        swarm.check_alive()


# --- the demo ------------------------------------------------------------------------------------------


@pytest.mark.timeout(400)
def test_baton_demo_json_runs_the_swarm_end_to_end(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "agent.cli", "demo", "--max-tokens", "12", "--workdir", str(tmp_path), "--json",
         "The capital of France is"],
        capture_output=True, text=True, timeout=380, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + "\n" + _logs(tmp_path)
    report = json.loads(done.stdout)
    assert {"route", "text", "tokens_per_s", "tokens_equal_single_process"} <= set(report)
    assert report["via"] == "relay" and report["base_url"].startswith("http://127.0.0.1:")
    assert report["usage"]["completion_tokens"] == len(report["tokens"]) == 12
    assert [(hop["begin"], hop["end"]) for hop in report["route"]] == [(0, 10), (10, 20), (20, 30)]
    assert len({hop["node"] for hop in report["route"]}) == 3
    assert report["tokens_equal_single_process"] is True
    assert report["tokens_per_s"] > 0
    assert "Paris" in report["text"]
    # every process it started is gone
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True, check=False)
    assert leftovers.stdout.strip() == "", leftovers.stdout


@pytest.mark.timeout(400)
def test_baton_demo_serve_prints_what_an_openai_client_needs(tmp_path: Path) -> None:
    import openai

    process = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "demo", "--serve", "--workdir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        line = process.stdout.readline()  # blocks until the swarm and relay are up (or it exits)
        assert line, f"baton demo --serve printed nothing (exit {process.poll()})\n{_logs(tmp_path)}"
        info = json.loads(line)
        assert set(info) >= {"base_url", "api_key", "model"}
        client = openai.OpenAI(base_url=info["base_url"], api_key=info["api_key"], max_retries=0, timeout=120)
        assert info["model"] in [m.id for m in client.models.list().data]
        response = client.chat.completions.create(
            model=info["model"], messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0
        )
        assert response.usage.completion_tokens >= 1 and response.choices[0].message.content
        assert process.poll() is None  # still serving
    finally:
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C
        try:
            code = process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            code = process.wait()
        process.stdout.close()
    assert code == 0
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True, check=False)
    assert leftovers.stdout.strip() == "", leftovers.stdout


def _logs(workdir: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(workdir.glob("logs/*.log"))
    )


# --- generation --------------------------------------------------------------------------------


@pytest.mark.timeout(300)
async def test_greedy_through_three_nodes_equals_one_unsplit_worker(swarm3: RunningSwarm, reference) -> None:
    async with client(swarm3) as c:
        for prompt in PROMPTS:
            pieces: list[str] = []
            result = await c.generate(ALIAS, prompt, max_tokens=NEW_TOKENS, on_text=pieces.append)
            prompt_tokens, expected = reference[prompt]
            assert result.prompt_tokens == prompt_tokens
            assert result.tokens == expected, prompt
            assert "".join(pieces) == result.text
            # the tracker split the model three ways, one range per node
            assert [(h["begin"], h["end"]) for h in result.route] == [(0, 10), (10, 20), (20, 30)]
            assert sorted(h["node"] for h in result.route) == sorted(swarm3.node_ids().values())
            assert result.tokens_per_s > 0
            # the prompt (one chunk) and every decode step worker to worker (the data plane)
            assert result.data_plane_steps == len(result.tokens), result.data_plane_steps
            assert {h["rows"] for h in result.node_rows} == {len(prompt_tokens) + len(result.tokens) - 1}
            # greedy: after the first data plane step, the last hop sends each next step to the
            # first hop itself (the owner's copies come second and are dropped); no step past
            # the owner's end was computed (the rows above)
            assert 1 <= result.continued_steps <= result.data_plane_steps - 1, result.continued_steps
        # every node advertises a direct channel (the workers' data planes listen on its host)
        route = await c.route(ALIAS)
        assert all(any(is_channel_multiaddr(a) for a in hop.addrs) for hop in route.hops)
    # the prompt through the node agents (prefill_on_data_plane False): the same tokens, its
    # result pushed back to the owner over the direct channel
    async with client(swarm3, prefill_on_data_plane=False) as c:
        _, expected = reference[PROMPTS[0]]
        result = await c.generate(ALIAS, PROMPTS[0], max_tokens=NEW_TOKENS)
        assert result.tokens == expected
        assert result.data_plane_steps == len(result.tokens) - 1, result.data_plane_steps
        assert c.transport.connections_accepted >= 1
    assert "Paris" in (await _text(swarm3, PROMPTS[0]))
    assert_swarm_alive(swarm3)


# The model copies the list a third time (for 15 tokens), then goes its own way; under one
# prompt chunk (64 rows): the unsplit reference computes the prompt in one step too.
COPY_PROMPT = "\n".join(
    ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"] * 2 + ["one", "two"]
)


@pytest.mark.timeout(300)
async def test_speculative_decoding_through_three_nodes_equals_one_unsplit_worker(swarm3: RunningSwarm) -> None:
    """Drafts from the context, verified a trip at a time, rejected rows cut on every hop: the
    same tokens as one unsplit worker decoding one token a step (``agent.core.owner.speculation``)."""
    async with open_worker(
        swarm3.model_path, 0, None, threads=1, max_sequences=1, model_sha256=swarm3.model_sha256
    ) as single:
        expected = {}
        for prompt in (COPY_PROMPT, *PROMPTS):
            tokens = await single.client.tokenize(prompt, add_special=True)
            run = await generate_through([single.client], tokens, NEW_TOKENS, stop_tokens=single.info.eog_token_ids)
            expected[prompt] = run.tokens
    async with client(swarm3, speculate_tokens=6) as c:
        copied = await c.generate(ALIAS, COPY_PROMPT, max_tokens=NEW_TOKENS)
        assert copied.tokens == expected[COPY_PROMPT]
        # the copy is drafted from the prompt, and most of it accepted: fewer trips than tokens
        assert copied.accepted_tokens >= 8, (copied.drafted_tokens, copied.accepted_tokens)
        assert copied.drafted_tokens >= copied.accepted_tokens
        # each accepted token is a trip saved: the prompt's, then a step per token less those
        assert copied.data_plane_steps == 1 + len(copied.tokens) - 1 - copied.accepted_tokens, copied.data_plane_steps
        for prompt in PROMPTS:  # free-form: drafts rejected (the rows cut away) change no token
            result = await c.generate(ALIAS, prompt, max_tokens=NEW_TOKENS)
            assert result.tokens == expected[prompt], prompt
            assert result.accepted_tokens <= result.drafted_tokens
            # between drafts the last hop continues the session by itself, a run at a time
            assert result.continued_steps > 0, prompt
    assert_swarm_alive(swarm3)


def forged_peer_id(peer_id: str) -> str:
    """``peer_id`` with its last character changed: always another id (a fixed replacement
    would change nothing for an id that already ends in it)."""
    return peer_id[:-1] + ("y" if peer_id.endswith("x") else "x")


@pytest.mark.timeout(240)
async def test_a_node_pushes_a_session_only_to_the_next_hop_the_tracker_lists(
    swarm3: RunningSwarm, reference, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An owner that names another host or port for a hop's output (a worker would dial it) is
    refused by that hop's node, which checks the bind against the tracker's node list: the
    session stays on the node path, its output unchanged."""
    import agent.io.client.session_run as client_run

    honest = client_run.bind_request
    prompt_tokens, expected = reference[PROMPTS[0]]
    for change, refusal in (
        (lambda r: setattr(r, "next_host", "127.0.0.2"), "'127.0.0.2' is not an address of the next hop"),
        (lambda r: setattr(r, "next_port", r.next_port + 1), "with its data plane at port"),
    ):

        def dishonest(*args, change=change, **kwargs):
            request = honest(*args, **kwargs)
            if request.next_port:
                change(request)
            return request

        monkeypatch.setattr(client_run, "bind_request", dishonest)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="agent.io.client.session_run"):
            async with client(swarm3) as c:
                result = await c.generate(ALIAS, PROMPTS[0], max_tokens=NEW_TOKENS)
        assert result.tokens == expected and result.prompt_tokens == prompt_tokens
        assert result.data_plane_steps == 0, "refused: the route stayed on the node path"
        assert "stays on the node path" in caplog.text and refusal in caplog.text, caplog.text
    monkeypatch.setattr(client_run, "bind_request", honest)
    async with client(swarm3) as c:
        result = await c.generate(ALIAS, PROMPTS[0], max_tokens=NEW_TOKENS)
    assert result.tokens == expected and result.data_plane_steps == len(result.tokens)  # (the prompt too)

    # The same for continuation: the last hop's node sends its steps only to the first
    # hop the tracker lists; refused, the owner's own steps carry the session, unchanged.
    honest_continue = client_run.continue_request
    for change, refusal in (
        (lambda r: setattr(r, "first_host", "127.0.0.2"), "'127.0.0.2' is not an address of the first hop"),
        (lambda r: setattr(r, "first_port", r.first_port + 1), "with its data plane at port"),
        (lambda r: setattr(r, "first_peer_id", forged_peer_id(r.first_peer_id)), "is not a live node of the tracker"),
    ):

        def dishonest_continue(*args, change=change, **kwargs):
            request = honest_continue(*args, **kwargs)
            change(request)
            return request

        monkeypatch.setattr(client_run, "continue_request", dishonest_continue)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="agent.io.client.session_run"):
            async with client(swarm3) as c:
                result = await c.generate(ALIAS, PROMPTS[0], max_tokens=NEW_TOKENS)
        assert result.tokens == expected and result.data_plane_steps == len(result.tokens)  # (the prompt too)
        assert result.continued_steps == 0, "refused: every step was the owner's"
        assert "no continuation" in caplog.text and refusal in caplog.text, caplog.text
    assert_swarm_alive(swarm3)


async def _text(running: RunningSwarm, prompt: str) -> str:
    async with client(running) as c:
        return (await c.generate(ALIAS, prompt, max_tokens=8)).text


@pytest.mark.timeout(240)
async def test_seeded_sampling_through_the_swarm_is_reproducible_whoever_draws(swarm3: RunningSwarm) -> None:
    """A sampled session's last hop draws its tokens with the owner's parameters and seed and
    continues it as a greedy one (the default); the owner drawing them itself (the switch off)
    gives the same tokens for the same seed, with top-k / top-p cuts and with none (the full
    row, which then stays on the last hop)."""
    runs = {}
    for last_hop_draws in (True, False):
        async with client(swarm3, last_hop_draws=last_hop_draws) as c:
            runs[last_hop_draws] = [
                await c.generate(ALIAS, PROMPTS[1], max_tokens=16, temperature=0.9, top_k=40, top_p=0.95, seed=seed)
                for seed in (5, 5, 6)
            ] + [await c.generate(ALIAS, PROMPTS[1], max_tokens=16, temperature=0.7, seed=seed) for seed in (5, 6)]
    for results in runs.values():
        tokens = [r.tokens for r in results]
        assert tokens[0] == tokens[1]
        assert tokens[0] != tokens[2] and tokens[3] != tokens[4]  # the seed matters: it samples
    assert [r.tokens for r in runs[True]] == [r.tokens for r in runs[False]]
    assert all(r.data_plane_steps > 0 for r in runs[True] + runs[False])
    # drawn at the last hop: continued worker to worker; drawn by the owner: every step its own
    assert sum(r.continued_steps for r in runs[True]) >= len(runs[True])
    assert all(r.continued_steps == 0 for r in runs[False])


@pytest.mark.timeout(120)
async def test_concurrent_sessions_do_not_disturb_each_other(swarm3: RunningSwarm, reference) -> None:
    results = {}
    async with client(swarm3) as c:

        async def one(prompt: str) -> None:
            results[prompt] = await c.generate(ALIAS, prompt, max_tokens=NEW_TOKENS)

        async with trio.open_nursery() as nursery:
            for prompt in PROMPTS:
                nursery.start_soon(one, prompt)
    for prompt in PROMPTS:
        assert results[prompt].tokens == reference[prompt][1], prompt


@pytest.mark.timeout(120)
def test_baton_generate_cli(swarm3: RunningSwarm, reference) -> None:
    command = [sys.executable, "-m", "agent.cli", "generate", "--tracker", swarm3.addr, "--model", ALIAS]
    done = subprocess.run(
        [*command, "--max-tokens", str(NEW_TOKENS), "--json", PROMPTS[0]],
        capture_output=True, text=True, timeout=100, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["tokens"] == reference[PROMPTS[0]][1]
    assert [(h["begin"], h["end"]) for h in report["route"]] == [(0, 10), (10, 20), (20, 30)]
    assert report["tokens_per_s"] > 0 and "Paris" in report["text"]
    # the decode's rate over its wall time, the first token's latency; speculation on by default
    assert report["first_token_s"] > 0 and report["decode_tokens_per_s"] > 0
    assert 0 <= report["accepted_tokens"] <= report["drafted_tokens"]

    streamed = subprocess.run(
        [*command, "--max-tokens", "8", "--speculate-tokens", "0", PROMPTS[0]],
        capture_output=True, text=True, timeout=100, check=False,
    )  # fmt: skip
    assert streamed.returncode == 0, streamed.stderr
    lines = streamed.stdout.splitlines()
    assert "Paris" in lines[0]
    assert lines[-2].startswith("route:") and "[0, 10) -> " in lines[-2]
    assert lines[-1].startswith("tokens/s:")

    unknown = subprocess.run(
        [sys.executable, "-m", "agent.cli", "generate", "--tracker", swarm3.addr, "--model", "no-such-model", "hi"],
        capture_output=True, text=True, timeout=100, check=False,
    )  # fmt: skip
    assert unknown.returncode == 2
    assert "no-such-model" in unknown.stderr

    # argv bytes that are not UTF-8: a clear refusal before anything is sent
    not_utf8 = subprocess.run(
        [os.fsencode(part) for part in command] + [b"bad \xff byte"], capture_output=True, timeout=100, check=False
    )
    assert not_utf8.returncode == 2, not_utf8.stderr
    assert b"the prompt is not valid UTF-8 text: byte 0xff at character 4" in not_utf8.stderr, not_utf8.stderr


# --- admission over the real transport ---------------------------------------------------------------


def fingerprint(peer_id: str, transport, **overrides) -> swarm_pb2.Fingerprint:
    commit, patch_hash = expected_pin()
    fields = dict(
        schema_version=1, peer_id=peer_id, os="Linux", cpu_model="test", cpu_cores=2,
        ram_total_bytes=8 << 30, ram_available_bytes=4 << 30,
        devices=[swarm_pb2.Device(backend="CPU", name="cpu", total_bytes=8 << 30, free_bytes=4 << 30)],
        llama_cpp_commit=commit, patch_series_sha256=patch_hash, architectures=["llama"],
        decode_s_per_block=0.001, bandwidth_bytes_per_s=1e9, created_at_ms=time.time_ns() // 1_000_000,
        nonce=os.urandom(16), listen_addrs=transport.listen_addrs, model_sha256s=[],
        usable_memory_bytes=1 << 30,
    )  # fmt: skip
    fields.update(overrides)
    return swarm_pb2.Fingerprint(**fields)


async def tracker_call(
    transport, running: RunningSwarm, request: swarm_pb2.TrackerRequest | bytes
) -> swarm_pb2.TrackerReply:
    tracker_id = running.addr.rpartition("/p2p/")[2]
    payload = request if isinstance(request, bytes) else request.SerializeToString()
    raw = await transport.request(tracker_id, [running.addr], TRACKER_PROTOCOL, payload, timeout_s=REQUEST_TIMEOUT_S)
    return swarm_pb2.TrackerReply.FromString(raw)


def register_request(signed: swarm_pb2.SignedFingerprint) -> swarm_pb2.TrackerRequest:
    return swarm_pb2.TrackerRequest(schema_version=1, register=swarm_pb2.RegisterRequest(fingerprint=signed))


async def admitted_node(transport, key: Ed25519PrivateKey, running: RunningSwarm) -> swarm_pb2.RegisterReply:
    """Register a node that holds no model (it gets no ranges) and return its reply."""
    reply = await tracker_call(
        transport, running, register_request(sign_fingerprint(key, fingerprint(transport.peer_id, transport)))
    )
    assert not reply.error.code, reply.error.message
    return reply.register


@pytest.mark.timeout(120)
async def test_registrations_are_refused_with_their_reason(swarm3: RunningSwarm) -> None:
    key = Ed25519PrivateKey.generate()
    other = Ed25519PrivateKey.generate()
    async with open_p2p_transport(key) as transport:
        me = transport.peer_id
        now = time.time_ns() // 1_000_000

        def signed(**overrides) -> swarm_pb2.SignedFingerprint:
            return sign_fingerprint(key, fingerprint(me, transport, **overrides))

        forged = signed()
        forged.signature = bytes(64)
        stranger = sign_fingerprint(other, fingerprint(peer_id_of(other), transport))
        cases = {
            "bad signature": forged,
            "peer id mismatch": stranger,  # another peer's registration sent from this connection
            "wrong llama.cpp pin": signed(llama_cpp_commit="0" * 40),
            "wrong patch series": signed(patch_series_sha256="f" * 64),
            "stale registration": signed(created_at_ms=now - 10 * 60_000),
            "too little memory": signed(usable_memory_bytes=1000),
            "no usable backend": signed(devices=[]),
        }
        for reason, registration in cases.items():
            reply = await tracker_call(transport, swarm3, register_request(registration))
            assert reply.error.code == swarm_pb2.Error.REFUSED, (reason, reply)
            assert reply.error.message.startswith(reason), (reason, reply.error.message)

        once = signed()
        first = await tracker_call(transport, swarm3, register_request(once))
        assert not first.error.code, first.error.message
        assert first.register.admission.record and first.register.heartbeat_timeout_ms == 5000
        again = await tracker_call(transport, swarm3, register_request(once))
        assert again.error.code == swarm_pb2.Error.REFUSED
        assert again.error.message.startswith("replayed registration")

        v2 = register_request(signed())
        v2.schema_version = 2
        reply = await tracker_call(transport, swarm3, v2)
        assert reply.error.code == swarm_pb2.Error.INVALID_ARGUMENT
        assert "schema_version 2 is not supported" in reply.error.message
        reply = await tracker_call(transport, swarm3, b"\xff\xffnot a protobuf")
        assert reply.error.code == swarm_pb2.Error.INVALID_ARGUMENT
    assert_swarm_alive(swarm3)


@pytest.mark.timeout(120)
async def test_a_node_process_offering_too_little_memory_is_refused(swarm3: RunningSwarm) -> None:
    proc = swarm3.swarm.start_node("tiny", memory_bytes=1000)
    try:
        with trio.fail_after(90):
            while proc.alive:
                await trio.sleep(0.1)
    finally:
        del swarm3.swarm.nodes["tiny"]  # not part of the swarm (and not a process that died on it)
        proc.stop_nowait(1.0)
    log = proc.log_tail()
    assert proc.returncode == 3, log
    assert "node refused: too little memory" in log
    assert_swarm_alive(swarm3)


@pytest.mark.timeout(120)
async def test_steps_from_peers_without_a_valid_admission_are_refused(swarm3: RunningSwarm) -> None:
    async with client(swarm3) as c:
        route = await c.route(ALIAS)
        first, second = route.hops[0], route.hops[1]
        key = Ed25519PrivateKey.generate()
        async with open_p2p_transport(key) as transport:
            registered = await admitted_node(transport, key, swarm3)
            foreign_tracker = Ed25519PrivateKey.generate()
            record = swarm_pb2.AdmissionRecord.FromString(registered.admission.record)
            forged = issue_admission(foreign_tracker, record)  # same record, another tracker's signature
            garbage = swarm_pb2.SignedAdmission(record=b"\xff\xff not a record", signature=bytes(64))

            boundary = np.zeros((1, 576), np.float32).tobytes()
            base = swarm_pb2.StepRequest(
                schema_version=1, session_id=os.urandom(16), step=0, begin=second.begin, end=second.end,
                positions=[0], boundary=boundary, dtype=swarm_pb2.DTYPE_F32, n_embd=576,
                recipe_hash=route.recipe_hash, rest=list(route.hops[2:]), owner_peer_id=transport.peer_id,
                owner_addrs=transport.listen_addrs, checksum=crc32(boundary), model_sha256=route.model_sha256,
            )  # fmt: skip
            cases = {
                "none": (None, "admission"),
                "foreign tracker": (forged, "bad tracker signature"),
                "garbage": (garbage, "admission"),
            }
            for name, (admission, text) in cases.items():
                request = swarm_pb2.StepRequest()
                request.CopyFrom(base)
                if admission is not None:
                    request.sender_admission.CopyFrom(admission)
                ack = await step(transport, second, request)
                assert ack.error.code == swarm_pb2.Error.REFUSED, (name, ack)
                assert text in ack.error.message, (name, ack.error.message)

            # a client (its own valid admission) may only send to first hops
            request = swarm_pb2.StepRequest()
            request.CopyFrom(base)
            request.owner_peer_id = c.peer_id
            request.sender_admission.CopyFrom(c.admission)
            ack = await step(c.transport, second, request)
            assert ack.error.code == swarm_pb2.Error.REFUSED, ack
            assert "ROLE_CLIENT" in ack.error.message or "client" in ack.error.message.lower(), ack.error.message

            # the client's own admission presented by another peer
            stolen = swarm_pb2.StepRequest(
                schema_version=1, session_id=os.urandom(16), step=0, begin=first.begin, end=first.end,
                positions=[0], token_ids=[1], recipe_hash=route.recipe_hash, rest=list(route.hops[1:]),
                owner_peer_id=transport.peer_id, owner_addrs=transport.listen_addrs, checksum=token_checksum([1]),
                sender_admission=c.admission, model_sha256=route.model_sha256,
            )  # fmt: skip
            ack = await step(transport, first, stolen)
            assert ack.error.code == swarm_pb2.Error.REFUSED
            assert "peer id mismatch" in ack.error.message
    assert_swarm_alive(swarm3)


async def step(transport, hop: swarm_pb2.Hop, request: swarm_pb2.StepRequest | bytes) -> swarm_pb2.StepAck:
    payload = request if isinstance(request, bytes) else request.SerializeToString()
    raw = await transport.request(hop.peer_id, list(hop.addrs), STEP_PROTOCOL, payload, timeout_s=REQUEST_TIMEOUT_S)
    return swarm_pb2.StepAck.FromString(raw)


# --- bad input at the network boundaries ------------------------------------------------------------


@pytest.mark.timeout(180)
async def test_bad_input_gets_error_replies_and_disturbs_no_other_session(swarm3: RunningSwarm, reference) -> None:
    prompt = PROMPTS[2]
    bad_replies: dict[str, tuple[int, str]] = {}
    async with client(swarm3) as c:
        route = await c.route(ALIAS)
        first, second = route.hops[0], route.hops[1]
        key = Ed25519PrivateKey.generate()
        async with open_p2p_transport(key, max_frame_bytes=80 << 20) as transport:
            admission = (await admitted_node(transport, key, swarm3)).admission
            n_embd = 576

            def boundary_step(rows: np.ndarray, **overrides) -> swarm_pb2.StepRequest:
                data = rows.astype(np.float32).tobytes()
                fields = dict(
                    schema_version=1, session_id=os.urandom(16), step=0, begin=second.begin, end=second.end,
                    positions=list(range(rows.shape[0])), boundary=data, dtype=swarm_pb2.DTYPE_F32, n_embd=n_embd,
                    recipe_hash=route.recipe_hash, rest=list(route.hops[2:]), owner_peer_id=transport.peer_id,
                    owner_addrs=transport.listen_addrs, checksum=crc32(data), sender_admission=admission,
                    model_sha256=route.model_sha256,
                )  # fmt: skip
                fields.update(overrides)
                return swarm_pb2.StepRequest(**fields)

            good_rows = np.random.default_rng(0).standard_normal((2, n_embd)).astype(np.float32)
            nan_rows = good_rows.copy()
            nan_rows[1, 7] = np.nan
            narrow = np.zeros((2, n_embd - 1), np.float32)

            async def probe_all() -> None:
                await started.wait()
                cases = {
                    "malformed protobuf": b"\x0a\xff\xff\xff\xff\x0f garbage",
                    "wrong width": boundary_step(narrow, n_embd=n_embd - 1),
                    "wrong byte length": boundary_step(
                        good_rows, boundary=good_rows.tobytes()[:-4], checksum=crc32(good_rows.tobytes()[:-4])
                    ),
                    "NaN rows": boundary_step(nan_rows),
                    "bad checksum": boundary_step(good_rows, checksum=12345),
                    "unknown session": boundary_step(good_rows[:1], step=5, positions=[40]),
                    "wrong recipe": boundary_step(good_rows, recipe_hash="not-the-recipe"),
                    "wrong schema": boundary_step(good_rows, schema_version=7),
                    "wrong range": boundary_step(good_rows, begin=11, end=20),
                    "bad dtype": boundary_step(good_rows, dtype=9),
                }
                for name, request in cases.items():
                    ack = await step(transport, second, request)
                    bad_replies[name] = (ack.error.code, ack.error.message)
                # a frame over the node's limit (64 MiB): the stream is refused, the node stays up
                try:
                    await step(transport, second, boundary_step(np.zeros(((65 << 20) // (4 * n_embd) + 1, n_embd))))
                except TransportError as error:
                    bad_replies["oversize frame"] = (-1, str(error))
                else:
                    bad_replies["oversize frame"] = (0, "accepted")
                node_raw = await transport.request(
                    first.peer_id, list(first.addrs), NODE_PROTOCOL, b"\xff\x01junk", timeout_s=REQUEST_TIMEOUT_S
                )
                reply = swarm_pb2.NodeReply.FromString(node_raw)
                bad_replies["malformed node request"] = (reply.error.code, reply.error.message)
                tracker_reply = await tracker_call(transport, swarm3, b"\xff\x01junk")
                bad_replies["malformed tracker request"] = (tracker_reply.error.code, tracker_reply.error.message)

            started = trio.Event()
            results = {}

            async def generate() -> None:
                def first_piece(text: str) -> None:
                    started.set()

                results["clean"] = await c.generate(ALIAS, prompt, max_tokens=NEW_TOKENS, on_text=first_piece)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(generate)
                nursery.start_soon(probe_all)

    invalid = swarm_pb2.Error.INVALID_ARGUMENT
    for name in ("malformed protobuf", "wrong width", "wrong byte length", "NaN rows", "bad checksum",
                 "wrong recipe", "wrong schema", "bad dtype",
                 "malformed node request", "malformed tracker request"):  # fmt: skip
        code, message = bad_replies[name]
        assert code == invalid, (name, code, message)
        assert message, name
    assert "n_embd" in bad_replies["wrong width"][1]
    assert "finite" in bad_replies["NaN rows"][1].lower() or "nan" in bad_replies["NaN rows"][1].lower()
    assert "checksum" in bad_replies["bad checksum"][1]
    assert "recipe" in bad_replies["wrong recipe"][1]
    assert "schema_version 7" in bad_replies["wrong schema"][1]
    code, message = bad_replies["wrong range"]
    assert code == swarm_pb2.Error.NOT_FOUND and "[11, 20)" in message, (code, message)
    code, message = bad_replies["unknown session"]
    assert code in (swarm_pb2.Error.NOT_FOUND, invalid), message
    assert "session" in message
    assert bad_replies["oversize frame"][0] != 0, bad_replies["oversize frame"]
    # the session that ran meanwhile is exactly what it is alone
    assert results["clean"].tokens == reference[prompt][1]
    assert_swarm_alive(swarm3)
    async with client(swarm3) as c:
        assert (await c.generate(ALIAS, prompt, max_tokens=NEW_TOKENS)).tokens == reference[prompt][1]


# --- tracker restart (last on the shared swarm) -----------------------------------------------------


@pytest.mark.timeout(180)
async def test_a_restarted_tracker_keeps_models_nodes_and_assignments(swarm3: RunningSwarm, reference) -> None:
    async with client(swarm3) as c:
        before = await c.route(ALIAS)
        models_before = [(m.sha256, m.alias, m.n_layer) for m in await c.list_models()]
    swarm = swarm3.swarm
    await swarm.stop_tracker(kill=True)
    assert not swarm.tracker.alive
    await swarm.start_tracker()  # same db, key and port
    async with client(swarm3) as c:
        assert [(m.sha256, m.alias, m.n_layer) for m in await c.list_models()] == models_before
        # nodes come back with their next heartbeat, with the ranges they had
        after = await wait_for_coverage(c, swarm, ALIAS, timeout_s=60)
        assert [(h.peer_id, h.begin, h.end) for h in after.hops] == [(h.peer_id, h.begin, h.end) for h in before.hops]
        result = await c.generate(ALIAS, PROMPTS[0], max_tokens=NEW_TOKENS)
    assert result.tokens == reference[PROMPTS[0]][1]
    assert_swarm_alive(swarm3)
