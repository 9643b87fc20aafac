"""A prompt's prefix blocks for the hops' prefix caches (``--prefix-cache-bytes``): the prompt's
whole blocks of ``block_tokens`` tokens, each named by a chained hash, and how many of them a new
session copies from the caches instead of prefilling.

``H_i = sha256(H_{i-1} || block i's token ids as int32 LE)``, ``H_{-1}`` the seed: the model, the
recipe (what makes the numbers identical), the block size, the prompt's chunk size (a row's last
bits depend on the chunk it was computed in: blocks filled in chunks of another size are not the
numbers this session's own chunks would give) and a salt (so that two callers' prefixes are kept
apart: ``owner_salt`` for an owner's own generations, the relay's per API key,
``agent.core.relay.prefix_salt``). A chained hash names the whole prefix up to its block; a
worker holds one range of one recipe, so (worker, ``H_i``) names the KV of positions
``[0, (i + 1) * block_tokens)`` of that range exactly, and the same hashes serve every hop.

Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import struct
from collections.abc import Sequence

__all__ = ["PrefixPlan", "block_hashes", "owner_salt", "prefix_seed", "prefix_tag", "route_tags", "usable_blocks"]

_DOMAIN = b"baton-prefix/2\n"
_OWNER_SALT_DOMAIN = b"baton-prefix-owner-salt/1"


def prefix_seed(model_sha256: str, recipe_hash: str, block_tokens: int, chunk_rows: int, salt: bytes = b"") -> bytes:
    """``H_{-1}``: what the chain of a prompt's block hashes starts from, for a prompt that goes
    in chunks of ``chunk_rows`` rows."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    h = hashlib.sha256(_DOMAIN)
    sizes = struct.pack("<II", block_tokens, chunk_rows)
    for part in (model_sha256.encode(), recipe_hash.encode(), sizes, salt):
        h.update(struct.pack("<I", len(part)))
        h.update(part)
    return h.digest()


def owner_salt(owner_secret: bytes) -> bytes:
    """The salt of an owner's own generations (``baton generate``, a library caller that names
    none), from a secret of the owner's (its private key's bytes): per owner, not unsalted,
    because any client the tracker admits may ask a node whether it holds a prefix (or time a
    generation): unsalted hashes of a guessed prompt would tell it whether another owner sent
    that prompt lately. An owner with a key file (``--key``) keeps its salt, and so its cached
    prefixes, from run to run; a run with a new key shares nothing with an earlier one."""
    if not owner_secret:
        raise ValueError("the owner's salt needs a secret")
    return hmac.new(owner_secret, _OWNER_SALT_DOMAIN, hashlib.sha256).digest()


def block_hashes(tokens: Sequence[int], block_tokens: int, seed: bytes) -> list[bytes]:
    """The chained hashes of the whole blocks of ``tokens`` (a partial last block has none)."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    hashes: list[bytes] = []
    previous = seed
    for at in range(0, len(tokens) - block_tokens + 1, block_tokens):
        block = struct.pack(f"<{block_tokens}i", *tokens[at : at + block_tokens])
        previous = hashlib.sha256(previous + block).digest()
        hashes.append(previous)
    return hashes


def prefix_tag(block_hash: bytes) -> int:
    """A block hash's tag: its first 8 bytes, little-endian (as a worker reports what it holds,
    worker.proto ``HealthReply.prefix_tags``). Enough to prefer a route: a collision misplaces a
    preference only, since the hops compare whole hashes before they copy."""
    return int.from_bytes(block_hash[:8], "little")


def route_tags(hashes: Sequence[bytes], max_tags: int) -> list[tuple[int, int]]:
    """``(blocks, tag)`` pairs a route request names a prompt's prefix by: at most ``max_tags``
    of its block hashes, evenly spaced and ending at the deepest (every one when they fit), so
    that a long prompt is named to its end and a range's held depth is known within the
    spacing. Deepest first."""
    if max_tags < 1 or not hashes:
        return []
    stride = -(-len(hashes) // max_tags)
    return [(index + 1, prefix_tag(hashes[index])) for index in range(len(hashes) - 1, -1, -stride)]


def usable_blocks(held: int, prompt_len: int, block_tokens: int, chunk_rows: int | None) -> int:
    """The blocks a new session copies when every hop holds ``held`` leading ones: at least the
    prompt's last token is left to compute (its row gives the first token), and, when the prompt
    goes in chunks of ``chunk_rows``, the copied positions end on a chunk boundary, so that the
    rest is computed in the very chunks a session without the cache computes (and the cached
    part was computed in them too): a chunk's rows can differ in their last bits from the same
    rows in other chunks, and the tokens must be the same with the cache as without."""
    blocks = max(0, min(held, (prompt_len - 1) // block_tokens))
    if chunk_rows:
        while blocks > 0 and (blocks * block_tokens) % chunk_rows:
            blocks -= 1
    return blocks


@dataclasses.dataclass(frozen=True)
class PrefixPlan:
    """What a session opens with on every hop: its prompt's block hashes (kept by each hop at
    the session's end) and the leading blocks copied from the caches."""

    hashes: tuple[bytes, ...]
    block_tokens: int
    blocks: int

    @property
    def positions(self) -> int:
        return self.blocks * self.block_tokens
