"""The tracker's model registry facts: a GGUF's metadata -> ``ModelEntry``.

Owns how much memory one block of a model needs (``bytes_per_block``), which admission
(``too little memory``) and assignment (blocks a node can hold) both use:

    bytes_per_block = ceil(total bytes of the blk.* tensors / n_layer)
                    + kv_tokens * (n_embd_k_gqa + n_embd_v_gqa) * 2 bytes

with ``kv_tokens = 2048 positions * 4 sequences = 8192`` by default (a worker's default
context, f16 K and V cache) and ``n_embd_k_gqa = n_head_kv * key_length`` (key_length defaults
to n_embd / n_head; likewise for V). The KV term is already per block (each block has its
own cache), so it is not divided by n_layer. Embeddings and the output head are not counted
per block: a first or last range needs a little more; ``usable_memory_bytes`` is expected to
leave room for that.

Pure: reading the file is ``agent.io.tracker.gguf_info``; this module only does arithmetic.
"""

from __future__ import annotations

import dataclasses

from agent._proto import swarm_pb2

__all__ = ["DEFAULT_KV_TOKENS", "KV_BYTES_PER_VALUE", "GgufFacts", "bytes_per_block", "model_entry"]

DEFAULT_KV_TOKENS = 2048 * 4
KV_BYTES_PER_VALUE = 2  # f16 cache


@dataclasses.dataclass(frozen=True)
class GgufFacts:
    """What the registry needs from a GGUF file."""

    name: str  # general.name ("" when absent)
    architecture: str  # general.architecture
    n_layer: int  # {arch}.block_count
    n_embd: int  # {arch}.embedding_length
    n_head: int  # {arch}.attention.head_count (max over layers when per layer)
    n_head_kv: int  # {arch}.attention.head_count_kv (defaults to n_head)
    key_length: int  # {arch}.attention.key_length (defaults to n_embd / n_head)
    value_length: int  # {arch}.attention.value_length (defaults to n_embd / n_head)
    block_tensor_bytes: int  # sum of n_bytes over tensors named blk.*
    size_bytes: int  # the file's size
    source_repo: str = ""  # the Hugging Face repo the GGUF names as its source ("" when absent)
    context_length: int = 0  # {arch}.context_length (0 when absent)


def bytes_per_block(facts: GgufFacts, kv_tokens: int = DEFAULT_KV_TOKENS) -> int:
    """Weights + KV estimate of one block (see the module docstring)."""
    if facts.n_layer < 1:
        raise ValueError(f"n_layer must be >= 1, got {facts.n_layer}")
    weights = -(-facts.block_tensor_bytes // facts.n_layer)
    kv = kv_tokens * facts.n_head_kv * (facts.key_length + facts.value_length) * KV_BYTES_PER_VALUE
    return weights + kv


def model_entry(
    facts: GgufFacts, sha256: str, alias: str, *, hf_repo: str = "", kv_tokens: int = DEFAULT_KV_TOKENS
) -> swarm_pb2.ModelEntry:
    return swarm_pb2.ModelEntry(
        sha256=sha256,
        name=facts.name,
        hf_repo=hf_repo or facts.source_repo,
        alias=alias,
        architecture=facts.architecture,
        n_layer=facts.n_layer,
        size_bytes=facts.size_bytes,
        bytes_per_block=bytes_per_block(facts, kv_tokens),
        context_length=facts.context_length,
    )
