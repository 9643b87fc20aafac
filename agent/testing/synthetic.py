"""Tiny synthetic GGUF models of real architectures, written deterministically.

Owns: the shapes and the weights of ``qwen2-tiny`` and ``qwen3-tiny`` (their pinned sha256
lives in ``agent.models``; changing anything here changes the bytes, so update both together).
Must not import agent.io, agent.core, trio or grpc.

Why synthetic models: they load in milliseconds, exercise the real llama.cpp loaders and graph
builders of architectures that have no small public checkpoint on PyPI, and cost ~13-26 MB.
The weights are random (fixed seed) and tiny (std 0.02, norms 1.0), so activations stay finite
and far from overflow; the text they generate is meaningless. The tokenizer is SmolLM2's
(gpt2 BPE, 49152 tokens), copied byte for byte, so llama.cpp tokenizes real text.

Tensor names and shapes follow the pinned tree's loaders (``src/models/qwen2.cpp``,
``src/models/qwen3.cpp``, ``load_arch_tensors``). Note the ggml shape order: a ggml tensor
``{n_embd, n_vocab}`` is a numpy array of shape ``(n_vocab, n_embd)``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

# Bump when the writer's output changes on purpose; recorded in the file.
SYNTHETIC_FORMAT_VERSION = 1


@dataclass(frozen=True)
class TinyConfig:
    """Hyperparameters of one synthetic model (all sizes in elements)."""

    arch: str
    seed: int
    n_layer: int = 6
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16
    n_ff: int = 128
    context_length: int = 2048
    rope_freq_base: float = 10000.0
    rms_eps: float = 1e-6
    init_std: float = 0.02
    # qwen2-style q/k/v biases.
    qkv_bias: bool = False
    # qwen3-style per-head RMS norms on q and k.
    qk_norm: bool = False
    # False: a separate output.weight; True: the head reuses token_embd (tied embeddings).
    tied_output: bool = True


# qwen2-tiny has tied embeddings (like SmolLM2 and Gemma3), qwen3-tiny a separate output head,
# so that both ways of loading the head are covered by one small model each.
CONFIGS: dict[str, TinyConfig] = {
    "qwen2-tiny": TinyConfig(arch="qwen2", seed=20002, qkv_bias=True, tied_output=True),
    "qwen3-tiny": TinyConfig(arch="qwen3", seed=30003, qk_norm=True, tied_output=False),
}

TOKENIZER_KEY_PREFIX = "tokenizer.ggml."


def _tensor_name(tensor: gguf.MODEL_TENSOR, suffix: str, bid: int | None = None) -> str:
    base = gguf.TENSOR_NAMES[tensor]
    return (base.format(bid=bid) if bid is not None else base) + "." + suffix


def _copy_tokenizer(writer: gguf.GGUFWriter, tokenizer_gguf: Path) -> int:
    """Copy every ``tokenizer.ggml.*`` key, byte for byte and with its type. Returns n_vocab."""
    reader = gguf.GGUFReader(tokenizer_gguf)
    n_vocab = 0
    for key, field in reader.fields.items():
        if not key.startswith(TOKENIZER_KEY_PREFIX):
            continue
        main_type = field.types[0]
        if main_type == gguf.GGUFValueType.ARRAY:
            sub_type = field.types[-1]
            if sub_type == gguf.GGUFValueType.STRING:
                # Raw bytes, not str: no decode/encode round trip can alter a token.
                value = [bytes(field.parts[i]) for i in field.data]
            else:
                value = [field.parts[i].tolist()[0] for i in field.data]
            writer.add_key_value(key, value, main_type, sub_type=sub_type)
            if key == gguf.Keys.Tokenizer.LIST:
                n_vocab = len(value)
        elif main_type == gguf.GGUFValueType.STRING:
            writer.add_key_value(key, bytes(field.parts[field.data[0]]), main_type)
        else:
            writer.add_key_value(key, field.parts[field.data[0]].tolist()[0], main_type)
    if n_vocab == 0:
        raise ValueError(f"{tokenizer_gguf} has no {gguf.Keys.Tokenizer.LIST}")
    return n_vocab


def _weights(cfg: TinyConfig, n_vocab: int) -> list[tuple[str, np.ndarray]]:
    """All tensors in file order, drawn from one generator in that same order."""
    rng = np.random.Generator(np.random.PCG64(cfg.seed))
    T = gguf.MODEL_TENSOR

    def normal(*shape: int) -> np.ndarray:
        # float32 draws scaled in float32: no float64 intermediate whose rounding could differ.
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(cfg.init_std)

    def ones(*shape: int) -> np.ndarray:
        return np.ones(shape, dtype=np.float32)

    n_q = cfg.head_dim * cfg.n_head
    n_kv = cfg.head_dim * cfg.n_head_kv
    tensors: list[tuple[str, np.ndarray]] = [
        (_tensor_name(T.TOKEN_EMBD, "weight"), normal(n_vocab, cfg.n_embd)),
        (_tensor_name(T.OUTPUT_NORM, "weight"), ones(cfg.n_embd)),
    ]
    if not cfg.tied_output:
        tensors.append((_tensor_name(T.OUTPUT, "weight"), normal(n_vocab, cfg.n_embd)))
    for il in range(cfg.n_layer):
        tensors += [
            (_tensor_name(T.ATTN_NORM, "weight", il), ones(cfg.n_embd)),
            (_tensor_name(T.ATTN_Q, "weight", il), normal(n_q, cfg.n_embd)),
            (_tensor_name(T.ATTN_K, "weight", il), normal(n_kv, cfg.n_embd)),
            (_tensor_name(T.ATTN_V, "weight", il), normal(n_kv, cfg.n_embd)),
        ]
        if cfg.qkv_bias:
            tensors += [
                (_tensor_name(T.ATTN_Q, "bias", il), normal(n_q)),
                (_tensor_name(T.ATTN_K, "bias", il), normal(n_kv)),
                (_tensor_name(T.ATTN_V, "bias", il), normal(n_kv)),
            ]
        if cfg.qk_norm:
            tensors += [
                (_tensor_name(T.ATTN_Q_NORM, "weight", il), ones(cfg.head_dim)),
                (_tensor_name(T.ATTN_K_NORM, "weight", il), ones(cfg.head_dim)),
            ]
        tensors += [
            (_tensor_name(T.ATTN_OUT, "weight", il), normal(cfg.n_embd, n_q)),
            (_tensor_name(T.FFN_NORM, "weight", il), ones(cfg.n_embd)),
            (_tensor_name(T.FFN_GATE, "weight", il), normal(cfg.n_ff, cfg.n_embd)),
            (_tensor_name(T.FFN_DOWN, "weight", il), normal(cfg.n_embd, cfg.n_ff)),
            (_tensor_name(T.FFN_UP, "weight", il), normal(cfg.n_ff, cfg.n_embd)),
        ]
    return tensors


def write_tiny_model(name: str, dest: Path, tokenizer_gguf: Path) -> None:
    """Write the synthetic model ``name`` (a key of CONFIGS) to dest.

    Deterministic: the same name and tokenizer file give the same bytes. dest is written in
    place (callers that need atomicity write to a temporary name and rename).
    """
    cfg = CONFIGS[name]
    writer = gguf.GGUFWriter(os.fspath(dest), cfg.arch)
    try:
        writer.add_name(f"baton {name} (synthetic)")
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_uint32("baton.synthetic.format_version", SYNTHETIC_FORMAT_VERSION)
        writer.add_uint32("baton.synthetic.seed", cfg.seed)
        writer.add_context_length(cfg.context_length)
        writer.add_embedding_length(cfg.n_embd)
        writer.add_block_count(cfg.n_layer)
        writer.add_feed_forward_length(cfg.n_ff)
        writer.add_head_count(cfg.n_head)
        writer.add_head_count_kv(cfg.n_head_kv)
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        writer.add_rope_dimension_count(cfg.head_dim)
        writer.add_rope_freq_base(cfg.rope_freq_base)
        writer.add_layer_norm_rms_eps(cfg.rms_eps)
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)
        n_vocab = _copy_tokenizer(writer, tokenizer_gguf)
        writer.add_vocab_size(n_vocab)
        for tensor_name, data in _weights(cfg, n_vocab):
            writer.add_tensor(tensor_name, data)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def write_metadata_only(dest: Path, arch: str, tokenizer_gguf: Path, *, n_layer: int = 4) -> None:
    """A GGUF with ``arch``'s hyperparameters and a real tokenizer but no tensors.

    llama.cpp reads hyperparameters and vocabulary before any tensor, so such a file tells
    apart what is refused before loading weights (e.g. ranged execution of an architecture
    without a ranged graph builder) from what fails while loading them (missing tensors).
    """
    cfg = TinyConfig(arch=arch, seed=0, n_layer=n_layer)
    writer = gguf.GGUFWriter(os.fspath(dest), arch)
    try:
        writer.add_name(f"baton {arch} metadata only (synthetic)")
        writer.add_context_length(cfg.context_length)
        writer.add_embedding_length(cfg.n_embd)
        writer.add_block_count(cfg.n_layer)
        writer.add_feed_forward_length(cfg.n_ff)
        writer.add_head_count(cfg.n_head)
        writer.add_head_count_kv(cfg.n_head_kv)
        writer.add_layer_norm_eps(cfg.rms_eps)
        writer.add_layer_norm_rms_eps(cfg.rms_eps)
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)
        writer.add_vocab_size(_copy_tokenizer(writer, tokenizer_gguf))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
