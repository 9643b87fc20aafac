"""Many sessions at once through a real 3-node swarm, with ``baton generate`` as users
run it: more concurrent generations than sequences wait and all finish, each equal to its solo
run; the wait is bounded and says so; killed clients hold nothing for long.

Each test starts its own swarm of real processes: a tracker and three nodes, each a third of
SmolLM2 (the first test's workers hold 4 sequences, the worker's default, so one route holds
4 sessions at a time); the last one shows that nodes on one machine run lock-step by default."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import psutil
import pytest
import trio

from agent._proto import swarm_pb2
from agent.core.node.worker_wait import SLEEP_SPIN_COUNT
from agent.demo.swarm_demo import forward_counts, node_memory_bytes, wait_for_coverage
from agent.harness.local_swarm import LocalSwarm, LocalSwarmConfig
from agent.io.client import open_swarm_client
from agent.models import model_path

pytestmark = [pytest.mark.swarm, pytest.mark.slow]

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


async def _sequences_in_use(c) -> int:
    return sum(s.sequences_in_use for n in await c.list_nodes() for s in n.serving)


@contextlib.asynccontextmanager
async def _three_nodes(tmp_path: Path, *node_args: str) -> AsyncIterator[tuple[LocalSwarm, swarm_pb2.Route]]:
    """A tracker and three nodes (a third of SmolLM2 each, ``node_args``) and their full route;
    every process stopped on exit."""
    config = LocalSwarmConfig(model_path=model_path(ALIAS), model_alias=ALIAS, node_args=node_args)
    swarm = LocalSwarm(config, tmp_path / "swarm")
    try:
        await swarm.start_tracker()
        async with open_swarm_client(swarm.tracker_addr) as c:
            (entry,) = [m for m in await c.list_models() if m.alias == ALIAS]
            for i in range(3):
                swarm.start_node(f"node-{i + 1}", node_memory_bytes(entry.n_layer, entry.bytes_per_block, 3))
            route = await wait_for_coverage(c, swarm, ALIAS, timeout_s=240.0)
        yield swarm, route
    finally:
        with trio.CancelScope(shield=True):
            await swarm.aclose()


async def _text_tokens(swarm: LocalSwarm, route: swarm_pb2.Route) -> list[int]:
    async with open_swarm_client(swarm.tracker_addr) as c:
        return (await c.tokenize(route, TEXT))[0]


@pytest.mark.timeout(600)
async def test_more_generations_than_sequences_wait_finish_equal_and_killed_clients_free_theirs(tmp_path: Path) -> None:
    cache = tmp_path / "client-cache"
    async with _three_nodes(tmp_path) as (swarm, _route), open_swarm_client(swarm.tracker_addr) as c:
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
                    partial(
                        trio.run_process, long_argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False
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


# --- deterministic concurrency -------------------------------------------------------------------

TEXT = (
    "Volunteer computing works because many people lend a little of their spare time and their machines "
    "to a common project. The machines come and go without warning: a laptop lid closes, a home router "
    "restarts, a game takes the GPU. A good system therefore keeps every generation going, and gives the "
    "same answer whatever happens to the machines that compute it, and whoever else is using them. "
) * 4
LENGTHS = (5, 40, 90, 170, 12, 60, 130, 25)  # prompt tokens of sessions 0..7
CONCURRENT_TOKENS = 14
LOCK_STEP_TOKENS = 40  # test_lock_step_...: long enough for the chunked session to decode beside the others
CTX = 256  # positions per sequence: the context-limit session reaches it


def _scores(logits) -> tuple:
    if hasattr(logits, "ids"):
        return (logits.ids.tobytes(), logits.logits.tobytes(), float(logits.log_sum_exp))
    return (logits.tobytes(),)


async def _run(addr: str, prompt: list[int], *, max_tokens: int, started=None, stop_after: int | None = None):
    """(tokens, scores, result) of one session, its own owner. ``started`` is set at its second
    token; ``stop_after``: cancel the generation (as a dropped client) after that many tokens."""
    from agent.io.client import SwarmClientConfig, open_swarm_client

    scores: list[tuple] = []
    tokens: list[int] = []
    async with open_swarm_client(addr, config=SwarmClientConfig(queue_timeout_s=120.0, prefill_chunk_tokens=64)) as c:
        with trio.CancelScope() as scope:

            async def on_token(token: int, logits, _route) -> bool:
                tokens.append(token)
                scores.append(_scores(logits))
                if started is not None and len(tokens) == 2:
                    started.set()
                if stop_after is not None and len(tokens) == stop_after:
                    scope.cancel()
                return False

            result = await c.generate_tokens(ALIAS, prompt, max_tokens=max_tokens, on_token=on_token)
            return tokens, scores, result
    return tokens, scores, None


@pytest.mark.timeout(600)
async def test_concurrent_sessions_give_their_solo_runs_numbers_bit_for_bit(tmp_path: Path) -> None:
    """1, 2, 4 and 8 sessions with prompts of different lengths, each starting once the one
    before it decodes, so prefill chunks and decode steps share Forwards: every session's
    scores (top-K logits and log-sum-exp of every token) equal its solo run's bit for bit.
    The declared bound is 0 on CPU: a Forward computes each sequence's attention in its own KV
    stream and the weight products row by row, and the scheduler merges only rows llama.cpp then
    computes in the shapes they would have alone (decode rows with decode rows, chunks with
    chunks of their length: it splits a mixed batch into equal rows per sequence). What does
    change numbers is how a session's own rows are cut into steps, which its owner fixes
    (chunks of 64 here) whoever else is served. (Before that phase rule, this test caught a
    40-token prompt's chunk, merged with decode rows, giving other tokens.) A session cancelled mid-generation and
    one that runs into the context limit change nothing for the others; each hop's row count
    for a session is what it sent."""
    async with _three_nodes(tmp_path, "--max-sequences", "8", "--ctx-size", str(CTX)) as (swarm, route):
        text_tokens = await _text_tokens(swarm, route)
        addr = swarm.tracker_addr
        prompts = [[*text_tokens[: n - 1], text_tokens[n + 7]] for n in LENGTHS]  # distinct ends
        solo = [await _run(addr, p, max_tokens=CONCURRENT_TOKENS) for p in prompts]
        for (tokens, _, result), prompt in zip(solo, prompts):
            assert len(tokens) == CONCURRENT_TOKENS or result.stopped_by_token
            # each hop computed the prompt and every generated token but the last, by its own count too
            assert {h["rows"] for h in result.hop_rows} == {len(prompt) + len(tokens) - 1}
            assert sorted(result.node_rows, key=lambda h: h["begin"]) == sorted(
                result.hop_rows, key=lambda h: h["begin"]
            )

        async def scenario(n: int) -> list[tuple]:
            outcomes: dict[int, tuple] = {}
            async with trio.open_nursery() as nursery:
                before = None
                for i in range(n):
                    if before is not None:
                        await before.wait()  # staggered: the previous one is decoding
                    before = trio.Event()

                    async def one(i: int = i, started: trio.Event = before) -> None:
                        outcomes[i] = await _run(addr, prompts[i], max_tokens=CONCURRENT_TOKENS, started=started)

                    nursery.start_soon(one)
            return [outcomes[i] for i in range(n)]

        for n in (1, 2, 4, 8):
            runs = await scenario(n)
            for i, (tokens, scores, result) in enumerate(runs):
                assert tokens == solo[i][0], (n, i)
                assert scores == solo[i][1], (n, i)  # bit for bit
                # per-session accounting at every hop: what this session sent, nobody else's rows
                assert {h["rows"] for h in result.node_rows} == {len(prompts[i]) + len(tokens) - 1}, (n, i)
        again = await scenario(8)
        assert [r[1] for r in again] == [s[1] for s in solo[:8]]  # the same scenario twice: the same bits

        # one session cancelled after 4 tokens and one running into the context limit, among others
        long_prompt = text_tokens[: CTX - 6]
        outcomes: dict[str, tuple] = {}
        async with trio.open_nursery() as nursery:

            async def keep(name: str, **kwargs) -> None:
                outcomes[name] = await _run(addr, **kwargs)

            nursery.start_soon(lambda: keep("cancelled", prompt=prompts[3], max_tokens=CONCURRENT_TOKENS, stop_after=4))
            nursery.start_soon(lambda: keep("context", prompt=long_prompt, max_tokens=50))
            for i in (0, 1, 2):
                nursery.start_soon(lambda i=i: keep(f"s{i}", prompt=prompts[i], max_tokens=CONCURRENT_TOKENS))
        assert outcomes["cancelled"][2] is None and len(outcomes["cancelled"][0]) == 4
        tokens, _, context_run = outcomes["context"]
        assert context_run.context_full and len(long_prompt) + len(tokens) <= CTX + 1
        for i in (0, 1, 2):
            assert outcomes[f"s{i}"][1] == solo[i][1], i
        with trio.fail_after(15):  # the cancelled session was ended on every hop
            async with open_swarm_client(addr) as c:
                while sum(s.sequences_in_use for n in await c.list_nodes() for s in n.serving):
                    await trio.sleep(0.2)
        swarm.check_alive()


@pytest.mark.timeout(600)
async def test_nodes_on_one_machine_run_lock_step_by_default_every_decoding_session_in_one_forward(
    tmp_path: Path,
) -> None:
    """Three nodes on one machine, no decode flags: each route's next hop shares the first
    hop's machine, so its node runs it lock-step (``agent.core.node.scheduler.decode_mode``): the
    first hop holds each decode Forward until every decoding session's step waits, so sessions
    that start together share their decode Forwards at every hop, and still give their solo
    runs' scores bit for bit (decode rows only with decode rows, as in any mode). A session still
    taking its 170-token prompt in chunks is not waited for (only decoding sessions count), so
    the others decode meanwhile. With decode groups (route hops + 1 = 4 here, the default for
    hops on machines of their own), 3 sessions would get 1 step per decode Forward at the first
    hop; lock-step must merge them. 40 tokens a session: the workers' prefill pacing lets the
    chunked prompt in one chunk a decode round, so it joins the others late, and with 14 tokens
    the first two were often done by then."""
    node_args = ("--max-sequences", "4", "--ctx-size", str(CTX), "--threads-decode", "1")
    async with _three_nodes(tmp_path, *node_args) as (swarm, route):
        text_tokens = await _text_tokens(swarm, route)
        addr = swarm.tracker_addr
        prompts = [[*text_tokens[: n - 1], text_tokens[n + 7]] for n in (5, 40, 170)]
        solo = [await _run(addr, p, max_tokens=LOCK_STEP_TOKENS) for p in prompts]
        before = await forward_counts(addr, int(time.time() * 1000))
        runs: dict[int, tuple] = {}
        async with trio.open_nursery() as nursery:
            for i, prompt in enumerate(prompts):

                async def one(i: int = i, prompt: list[int] = prompt) -> None:
                    runs[i] = await _run(addr, prompt, max_tokens=LOCK_STEP_TOKENS)

                nursery.start_soon(one)
        after = await forward_counts(addr, int(time.time() * 1000))
        for i in range(len(prompts)):
            assert runs[i][0] == solo[i][0], i
            assert runs[i][1] == solo[i][1], i  # bit for bit
        first = next(key for key in after if key[0] == 0)
        calls, steps = (after[first][k] - before[first][k] for k in (0, 1))
        # 3 x 39 decode steps and 1 + 1 + 3 prompt chunks at the first hop: 122 steps; one
        # Forward per step would be 122 Forwards (1.0 a Forward)
        assert steps == 3 * (LOCK_STEP_TOKENS - 1) + 5, (calls, steps)
        assert steps / calls >= 1.6, f"{steps} steps in {calls} Forwards at the first hop: no convoy"
        # every hop's Forwards were timed by its worker, and the node's calls took at least that
        for key, counts in after.items():
            compute_us, call_us = counts.compute_us - before[key].compute_us, counts.call_us - before[key].call_us
            assert 0 < compute_us <= call_us, (key, counts, before[key])
        # nodes on one machine: their workers' idle threads sleep (the local swarm's --worker-wait)
        for node in swarm.nodes.values():
            workers = [p for p in psutil.Process(node.process.pid).children() if "baton-worker" in p.name()]
            assert [p.environ().get("GOMP_SPINCOUNT") for p in workers] == [str(SLEEP_SPIN_COUNT)], node.name
            assert "--threads-decode 1" in " ".join(workers[0].cmdline()), "the node's --threads-decode"
            assert "the worker's idle threads sleep (--worker-wait sleep)" in node.log_path.read_text()
        swarm.check_alive()
