"""A worker's prefix cache (``--prefix-cache-bytes``), on a real worker process with SmolLM2 (and the
same copy for qwen2, qwen3 and Gemma-3; DeepSeek V4 keeps none and says why):
an ended session's whole prompt blocks are kept in a spare sequence; a new session copies them
(``OpenPrefix``) and its tail gives the very logits of the session that computed it all; the
spares fit the byte budget; the least recently used entry makes room, and a prefix no longer
held is refused rather than half copied."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from agent._proto import worker_pb2
from agent.core.owner.prefix_blocks import block_hashes, prefix_seed
from agent.io.worker.client import SeqInput
from agent.io.worker.error import WorkerError
from agent.io.worker.process import open_worker

pytestmark = [pytest.mark.worker, pytest.mark.timeout(180)]

BLOCK = 4
CTX = 64
SEED = prefix_seed("00" * 32, "11" * 32, BLOCK, BLOCK)


def _hashes(tokens: list[int]) -> list[bytes]:
    return block_hashes(tokens, BLOCK, SEED)


async def _open(client, seq_id: int, tokens: list[int], use_blocks: int) -> int:
    request = worker_pb2.OpenPrefixRequest(
        schema_version=1, seq_id=seq_id, block_hashes=_hashes(tokens), block_tokens=BLOCK, use_blocks=use_blocks
    )
    return (await client.call("OpenPrefix", request)).next_position


async def _held(client, tokens: list[int]) -> int:
    request = worker_pb2.PrefixLookupRequest(schema_version=1, block_hashes=_hashes(tokens), block_tokens=BLOCK)
    return (await client.call("PrefixLookup", request)).blocks


async def _logits(client, seq_id: int, tokens: list[int], first: int) -> np.ndarray:
    (out,) = await client.forward([SeqInput(seq_id, list(range(first, len(tokens))), tokens[first:])])
    assert out.logits is not None
    return out.logits


async def test_a_copied_prefix_gives_the_same_logits_within_the_budget(smollm2_path: Path) -> None:
    async with open_worker(smollm2_path, 0, None, threads=1, max_sequences=2, ctx_size=CTX) as plain:
        per_sequence = plain.info.kv_bytes // 2
        assert plain.info.prefix_cache_sequences == 0
    budget = per_sequence + per_sequence // 2  # one spare
    prompt = [1, 504, 3458, 282, 4649, 314, 253, 1345, 1701, 28, 198]  # two whole blocks and 3 tokens
    other = [1, 504, 3458, 282, 9, 9, 9, 9, 9, 9]  # shares the first block only
    async with open_worker(
        smollm2_path, 0, None, threads=1, max_sequences=2, ctx_size=CTX, prefix_cache_bytes=budget
    ) as worker:
        client = worker.client
        assert worker.info.prefix_cache_sequences == 1
        assert 0 < worker.info.prefix_cache_bytes <= budget
        # a first session computes its prompt (two steps) and is kept at its end
        assert await _held(client, prompt) == 0
        assert await _open(client, 0, prompt, 0) == 0
        await _logits(client, 0, prompt[:8], 0)
        want = await _logits(client, 0, prompt, 8)
        await client.remove_sequence(0)
        assert await _held(client, prompt) == 2
        assert await _held(client, other) == 1
        # a second one copies both blocks and computes only the tail: the same logits, bit for bit
        assert await _open(client, 1, prompt, 2) == 2 * BLOCK
        got = await _logits(client, 1, prompt, 8)
        assert np.array_equal(got, want)
        before = (await client.health()).forward_rows
        await client.remove_sequence(1)
        # a prompt sharing one block copies it; the cut copy holds exactly that block
        assert await _open(client, 0, other, 1) == BLOCK
        await _logits(client, 0, other, BLOCK)
        await client.remove_sequence(0)  # kept: it replaces the least recently used entry
        health = await client.health()
        assert health.forward_rows - before == len(other) - BLOCK
        assert (health.prefix_hits, health.prefix_hit_positions) == (2, 3 * BLOCK)
        assert (health.prefix_entries, health.prefix_evicted) == (1, 1)
        assert await _held(client, prompt) == 1  # (the first block is "other"'s too)
        with pytest.raises(WorkerError) as refused:
            await _open(client, 1, prompt, 2)
        assert refused.value.code_name == "FAILED_PRECONDITION" and "holds 1 of the 2 blocks" in str(refused.value)
        with pytest.raises(WorkerError, match="use_blocks 3 exceeds"):
            await _open(client, 1, prompt, 3)


async def test_a_budget_below_one_sequence_keeps_nothing_and_says_why(smollm2_path: Path) -> None:
    async with open_worker(
        smollm2_path, 0, None, threads=1, max_sequences=1, ctx_size=CTX, prefix_cache_bytes=1000
    ) as worker:
        info = await worker.client.call("Info", worker_pb2.InfoRequest(schema_version=1))
        assert info.prefix_cache_sequences == 0 and "below one sequence's KV" in info.prefix_cache_off_reason
        prompt = list(range(1, 10))
        assert await _open(worker.client, 0, prompt, 0) == 0
        await _logits(worker.client, 0, prompt, 0)
        await worker.client.remove_sequence(0)
        assert await _held(worker.client, prompt) == 0


@pytest.mark.parametrize("model", ["qwen2_tiny_path", "qwen3_tiny_path", "gemma3_path"])
async def test_every_architecture_s_copied_prefix_gives_the_same_logits(
    model: str, request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue(model)
    prompt = [1, 504, 3458, 282, 4649, 314, 253, 1345, 1701, 28, 198]  # two whole blocks and 3 tokens
    async with open_worker(path, 0, None, threads=1, max_sequences=1, ctx_size=CTX, prefix_cache_bytes=64 << 20) as w:
        client = w.client
        assert w.info.prefix_cache_sequences >= 1, w.info
        assert await _open(client, 0, prompt, 0) == 0
        await _logits(client, 0, prompt[:8], 0)  # in the chunks the copy keeps: 8, then 3
        want = await _logits(client, 0, prompt, 8)
        await client.remove_sequence(0)
        assert await _open(client, 0, prompt, 2) == 2 * BLOCK
        assert np.array_equal(await _logits(client, 0, prompt, 8), want)


async def test_deepseek4_keeps_no_prefixes_and_says_why(deepseek4_tiny_path: Path) -> None:
    async with open_worker(
        deepseek4_tiny_path, 0, None, threads=1, max_sequences=1, ctx_size=CTX, prefix_cache_bytes=64 << 20
    ) as worker:
        info = await worker.client.call("Info", worker_pb2.InfoRequest(schema_version=1))
        assert info.prefix_cache_sequences == 0
        assert "compression-window state cannot be cut back to a block boundary" in info.prefix_cache_off_reason
        assert await _held(worker.client, list(range(1, 10))) == 0
