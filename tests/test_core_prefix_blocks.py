"""The prompt's prefix blocks (``agent.core.owner.prefix_blocks``): chained block hashes, their
seed, and how many blocks a session copies; a session started after a cached prefix."""

from __future__ import annotations

import hashlib
import struct

import pytest

from agent.core.owner.prefix_blocks import PrefixPlan, block_hashes, prefix_seed, usable_blocks
from agent.core.owner.session import Session

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

SEED = prefix_seed("ab" * 32, "cd" * 32, 4, 8)


def test_hashes_are_chained_over_whole_blocks() -> None:
    tokens = list(range(11))
    hashes = block_hashes(tokens, 4, SEED)
    assert len(hashes) == 2  # the partial third block has none
    first = hashlib.sha256(SEED + struct.pack("<4i", 0, 1, 2, 3)).digest()
    assert hashes[0] == first
    assert hashes[1] == hashlib.sha256(first + struct.pack("<4i", 4, 5, 6, 7)).digest()


def test_a_shared_block_means_a_shared_prefix() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, SEED)
    b = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4, SEED)
    assert a[1] != b[1]  # the same second block after another first one: another name
    assert block_hashes([1, 2, 3, 4, 0, 0, 0, 0], 4, SEED)[0] == a[0]


def test_the_seed_separates_models_recipes_block_and_chunk_sizes_and_salts() -> None:
    seeds = {
        SEED,
        prefix_seed("ab" * 32, "ce" * 32, 4, 8),
        prefix_seed("aa" * 32, "cd" * 32, 4, 8),
        prefix_seed("ab" * 32, "cd" * 32, 8, 8),
        prefix_seed("ab" * 32, "cd" * 32, 4, 16),  # blocks filled in other chunks: other bits
        prefix_seed("ab" * 32, "cd" * 32, 4, 8, salt=b"key-1"),
    }
    assert len(seeds) == 6
    with pytest.raises(ValueError, match="block_tokens"):
        prefix_seed("", "", 0, 8)
    with pytest.raises(ValueError, match="chunk_rows"):
        prefix_seed("", "", 4, 0)


@pytest.mark.parametrize(
    ("held", "prompt_len", "chunk_rows", "expected"),
    [
        (3, 12, None, 2),  # the last token is always computed: 11 positions at most, 2 blocks
        (3, 13, None, 3),
        (1, 13, None, 1),
        (0, 13, None, 0),
        (3, 13, 8, 2),  # cut to a chunk boundary: 8 positions
        (1, 13, 8, 0),
        (5, 100, 8, 4),
    ],
)
def test_usable_blocks(held: int, prompt_len: int, chunk_rows: int | None, expected: int) -> None:
    assert usable_blocks(held, prompt_len, 4, chunk_rows) == expected
    assert PrefixPlan((), 4, expected).positions == 4 * expected


def test_a_session_starts_after_its_cached_prefix() -> None:
    session = Session(b"s" * 16, list(range(20)), max_new_tokens=2, max_step_rows=8)
    session.take_cached_prefix(8)
    assert session.cached_positions == 8
    steps = session.next_steps(4)
    assert [s.positions[0] for s in steps] == [8, 16]
    assert steps[0].step == 0
    with pytest.raises(ValueError, match="no cached prefix"):
        session.take_cached_prefix(8)


def test_a_cached_prefix_leaves_a_token() -> None:
    session = Session(b"s" * 16, list(range(8)), max_new_tokens=2)
    with pytest.raises(ValueError, match="no cached prefix"):
        session.take_cached_prefix(8)
