"""Tiny synthetic GGUF models of real architectures, written deterministically.

Owns: the shapes and the weights of ``qwen2-tiny``, ``qwen3-tiny`` and ``deepseek4-tiny`` (their pinned sha256
lives in ``agent.testing.tiny_models``; changing anything here changes the bytes, so update both together).
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
    # A file under agent/testing/templates written as tokenizer.chat_template (None: no template).
    chat_template: str | None = None


# qwen2-tiny has tied embeddings (like SmolLM2 and Gemma3), qwen3-tiny a separate output head,
# so that both ways of loading the head are covered by one small model each.
CONFIGS: dict[str, TinyConfig] = {
    "qwen2-tiny": TinyConfig(arch="qwen2", seed=20002, qkv_bias=True, tied_output=True),
    "qwen3-tiny": TinyConfig(arch="qwen3", seed=30003, qk_norm=True, tied_output=False),
    # qwen2-tiny's weights with Qwen2.5-Instruct's own tool-aware chat template (copied from the
    # pinned llama.cpp tree's models/templates), so tool calling is tested through a real
    # template: the small public models here have none that shows tools to the model.
    "qwen2-tiny-tools": TinyConfig(
        arch="qwen2", seed=20002, qkv_bias=True, tied_output=True, chat_template="qwen2.5-instruct.jinja"
    ),
}

TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"

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
    """Write the synthetic model ``name`` (a key of CONFIGS or DEEPSEEK4_CONFIGS) to dest.

    Deterministic: the same name and tokenizer file give the same bytes. dest is written in
    place (callers that need atomicity write to a temporary name and rename).
    """
    if name in DEEPSEEK4_CONFIGS:
        _write_tiny_deepseek4(DEEPSEEK4_CONFIGS[name], name, dest, tokenizer_gguf)
        return
    cfg = CONFIGS[name]
    writer = gguf.GGUFWriter(os.fspath(dest), cfg.arch)
    try:
        _add_common_header(writer, cfg, name)
        writer.add_head_count_kv(cfg.n_head_kv)
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        writer.add_rope_dimension_count(cfg.head_dim)
        writer.add_rope_freq_base(cfg.rope_freq_base)
        writer.add_layer_norm_rms_eps(cfg.rms_eps)
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)
        n_vocab = _copy_tokenizer(writer, tokenizer_gguf)
        writer.add_vocab_size(n_vocab)
        if cfg.chat_template is not None:
            writer.add_chat_template((TEMPLATES_DIR / cfg.chat_template).read_text(encoding="utf-8"))
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


# ---------------------------------------------------------------------------------------------
# DeepSeek V4 (``deepseek4``): hyper-connections (hc_mult residual streams), latent MQA with a
# sliding-window raw KV, per-layer KV compression (ratio 0: none, 4: CSA + lightning indexer,
# 128: HCA), sqrt-softplus MoE with a shared expert and hash-routed first blocks.
#
# gguf 0.19.0 (the PyPI writer used here) predates deepseek4, so keys and tensor names are
# spelled out as strings; they are the pinned tree's (src/llama-arch.cpp LLM_KV_NAMES and
# LLM_TENSOR_NAMES, the same as its gguf-py constants), and the shapes are those
# src/models/deepseek4.cpp load_arch_tensors asks for.


@dataclass(frozen=True)
class TinyDeepseek4Config:
    """Hyperparameters of a synthetic DeepSeek V4 (all sizes in elements)."""

    seed: int
    # One ratio per block: 0 (raw sliding-window KV only), 4 (CSA: compressed KV + indexer),
    # 128 (HCA: heavily compressed KV). The pinned loader accepts exactly these three.
    compress_ratios: tuple[int, ...] = (0, 4, 128, 4, 128, 0)
    n_embd: int = 64
    n_head: int = 2
    head_dim: int = 128  # key = value length; the latent KV row (one KV head)
    n_rot: int = 64  # rope dims of the head (DeepSeek V4: 64 of 512)
    q_lora_rank: int = 32
    o_groups: int = 2
    o_lora_rank: int = 16
    hc_mult: int = 4  # residual streams: the boundary is hc_mult x n_embd per token
    hc_sinkhorn_iters: int = 2
    hc_eps: float = 1e-6
    n_expert: int = 4
    n_expert_used: int = 2
    n_expert_shared: int = 1
    n_ff_exp: int = 64
    n_ff: int = 128
    hash_layer_count: int = 1  # blocks [0, 1) route experts by token id (ffn_gate_tid2eid)
    indexer_n_head: int = 2
    indexer_head_dim: int = (
        64  # != head_dim, as in DeepSeek V4 (128 vs 512): only the indexer cache is Hadamard-rotated
    )
    indexer_top_k: int = 8  # < the compressed blocks of a long prompt: top-k really selects
    sliding_window: int = 16
    context_length: int = 4096
    rope_freq_base: float = 10000.0
    compress_rope_freq_base: float = 160000.0
    rms_eps: float = 1e-6
    swiglu_clamp: float = 10.0
    expert_weights_scale: float = 1.5
    init_std: float = 0.02

    @property
    def n_layer(self) -> int:
        return len(self.compress_ratios)


DEEPSEEK4_CONFIGS: dict[str, TinyDeepseek4Config] = {
    "deepseek4-tiny": TinyDeepseek4Config(seed=40004),
}

# llama_expert_gating_func_type: the pinned DeepSeek V4 loader accepts only SQRT_SOFTPLUS (4).
_GATING_SQRT_SOFTPLUS = 4


def deepseek4_tensor_shapes(cfg: TinyDeepseek4Config, n_vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """Every tensor of the model in file order: (name, ggml shape ne0..., "f32" | "i32")."""
    E, H, D = cfg.n_embd, cfg.n_head, cfg.head_dim
    hc_dim = cfg.hc_mult * E
    hc_mix = (2 + cfg.hc_mult) * cfg.hc_mult
    out: list[tuple[str, tuple[int, ...], str]] = [
        ("token_embd.weight", (E, n_vocab), "f32"),
        ("output_norm.weight", (E,), "f32"),
        ("output.weight", (E, n_vocab), "f32"),
        ("output_hc_fn.weight", (hc_dim, cfg.hc_mult), "f32"),
        ("output_hc_base.weight", (cfg.hc_mult,), "f32"),
        ("output_hc_scale.weight", (1,), "f32"),
    ]
    for il, ratio in enumerate(cfg.compress_ratios):
        b = f"blk.{il}."
        out += [
            (b + "attn_norm.weight", (E,), "f32"),
            (b + "attn_sinks.weight", (H,), "f32"),
            (b + "attn_q_a.weight", (E, cfg.q_lora_rank), "f32"),
            (b + "attn_q_a_norm.weight", (cfg.q_lora_rank,), "f32"),
            (b + "attn_q_b.weight", (cfg.q_lora_rank, H * D), "f32"),
            (b + "attn_kv.weight", (E, D), "f32"),
            (b + "attn_kv_a_norm.weight", (D,), "f32"),
            # the file keeps wo_a 2-D; the loader reshapes it to {H*D/groups, rank, groups}
            (b + "attn_output_a.weight", (H * D // cfg.o_groups, cfg.o_lora_rank * cfg.o_groups), "f32"),
            (b + "attn_output_b.weight", (cfg.o_groups * cfg.o_lora_rank, E), "f32"),
            (b + "hc_attn_fn.weight", (hc_dim, hc_mix), "f32"),
            (b + "hc_attn_base.weight", (hc_mix,), "f32"),
            (b + "hc_attn_scale.weight", (3,), "f32"),
            (b + "hc_ffn_fn.weight", (hc_dim, hc_mix), "f32"),
            (b + "hc_ffn_base.weight", (hc_mix,), "f32"),
            (b + "hc_ffn_scale.weight", (3,), "f32"),
        ]
        if ratio != 0:
            coff = 2 if ratio == 4 else 1  # CSA windows overlap: two halves per row
            out += [
                (b + "attn_compressor_kv.weight", (E, coff * D), "f32"),
                (b + "attn_compressor_gate.weight", (E, coff * D), "f32"),
                (b + "attn_compressor_ape.weight", (coff * D, ratio), "f32"),
                (b + "attn_compressor_norm.weight", (D,), "f32"),
            ]
            if ratio == 4:
                ID = cfg.indexer_head_dim
                out += [
                    (b + "indexer.proj.weight", (E, cfg.indexer_n_head), "f32"),
                    (b + "indexer.attn_q_b.weight", (cfg.q_lora_rank, cfg.indexer_n_head * ID), "f32"),
                    (b + "indexer_compressor_kv.weight", (E, 2 * ID), "f32"),
                    (b + "indexer_compressor_gate.weight", (E, 2 * ID), "f32"),
                    (b + "indexer_compressor_ape.weight", (2 * ID, ratio), "f32"),
                    (b + "indexer_compressor_norm.weight", (ID,), "f32"),
                ]
        out.append((b + "ffn_gate_inp.weight", (E, cfg.n_expert), "f32"))
        if il < cfg.hash_layer_count:
            out.append((b + "ffn_gate_tid2eid.weight", (cfg.n_expert_used, n_vocab), "i32"))
        else:
            out.append((b + "exp_probs_b.bias", (cfg.n_expert,), "f32"))
        out += [
            (b + "ffn_norm.weight", (E,), "f32"),
            (b + "ffn_gate_exps.weight", (E, cfg.n_ff_exp, cfg.n_expert), "f32"),
            (b + "ffn_down_exps.weight", (cfg.n_ff_exp, E, cfg.n_expert), "f32"),
            (b + "ffn_up_exps.weight", (E, cfg.n_ff_exp, cfg.n_expert), "f32"),
            (b + "ffn_gate_shexp.weight", (E, cfg.n_ff_exp * cfg.n_expert_shared), "f32"),
            (b + "ffn_down_shexp.weight", (cfg.n_ff_exp * cfg.n_expert_shared, E), "f32"),
            (b + "ffn_up_shexp.weight", (E, cfg.n_ff_exp * cfg.n_expert_shared), "f32"),
        ]
    return out


def _deepseek4_weights(cfg: TinyDeepseek4Config, n_vocab: int) -> list[tuple[str, np.ndarray]]:
    rng = np.random.Generator(np.random.PCG64(cfg.seed))
    tensors: list[tuple[str, np.ndarray]] = []
    for name, ne, kind in deepseek4_tensor_shapes(cfg, n_vocab):
        shape = tuple(reversed(ne))  # numpy order is ggml's reversed
        if kind == "i32":
            # each token's hash-routed experts: n_expert_used distinct ids per token
            ids = np.argsort(rng.random((n_vocab, cfg.n_expert), dtype=np.float32), axis=1)
            tensors.append((name, np.ascontiguousarray(ids[:, : cfg.n_expert_used].astype(np.int32))))
        elif name.endswith("norm.weight") or ("hc_" in name and name.endswith("scale.weight")):
            tensors.append((name, np.ones(shape, dtype=np.float32)))
        else:
            tensors.append((name, rng.standard_normal(shape, dtype=np.float32) * np.float32(cfg.init_std)))
    return tensors


def _add_common_header(writer, cfg, name: str) -> None:
    """The keys every synthetic model starts with: name, provenance, sizes."""
    writer.add_name(f"baton {name} (synthetic)")
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_uint32("baton.synthetic.format_version", SYNTHETIC_FORMAT_VERSION)
    writer.add_uint32("baton.synthetic.seed", cfg.seed)
    writer.add_context_length(cfg.context_length)
    writer.add_embedding_length(cfg.n_embd)
    writer.add_block_count(cfg.n_layer)
    writer.add_feed_forward_length(cfg.n_ff)
    writer.add_head_count(cfg.n_head)


def _write_tiny_deepseek4(cfg: TinyDeepseek4Config, name: str, dest: Path, tokenizer_gguf: Path) -> None:
    arch = "deepseek4"
    writer = gguf.GGUFWriter(os.fspath(dest), arch)
    try:
        _add_common_header(writer, cfg, name)
        writer.add_head_count_kv(1)
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        writer.add_rope_dimension_count(cfg.n_rot)
        writer.add_rope_freq_base(cfg.rope_freq_base)
        writer.add_layer_norm_rms_eps(cfg.rms_eps)
        a = arch + "."
        writer.add_uint32(a + "attention.q_lora_rank", cfg.q_lora_rank)
        writer.add_uint32(a + "attention.sliding_window", cfg.sliding_window)
        writer.add_uint32(a + "expert_count", cfg.n_expert)
        writer.add_uint32(a + "expert_used_count", cfg.n_expert_used)
        writer.add_uint32(a + "expert_shared_count", cfg.n_expert_shared)
        writer.add_uint32(a + "expert_feed_forward_length", cfg.n_ff_exp)
        writer.add_float32(a + "expert_weights_scale", cfg.expert_weights_scale)
        writer.add_bool(a + "expert_weights_norm", True)
        writer.add_uint32(a + "expert_gating_func", _GATING_SQRT_SOFTPLUS)
        writer.add_array(a + "swiglu_clamp_exp", [cfg.swiglu_clamp] * cfg.n_layer)
        writer.add_array(a + "swiglu_clamp_shexp", [cfg.swiglu_clamp] * cfg.n_layer)
        writer.add_uint32(a + "attention.indexer.head_count", cfg.indexer_n_head)
        writer.add_uint32(a + "attention.indexer.key_length", cfg.indexer_head_dim)
        writer.add_uint32(a + "attention.indexer.top_k", cfg.indexer_top_k)
        writer.add_uint32(a + "attention.output_group_count", cfg.o_groups)
        writer.add_uint32(a + "attention.output_lora_rank", cfg.o_lora_rank)
        writer.add_array(a + "attention.compress_ratios", list(cfg.compress_ratios))
        writer.add_float32(a + "attention.compress_rope_freq_base", cfg.compress_rope_freq_base)
        writer.add_uint32(a + "hyper_connection.count", cfg.hc_mult)
        writer.add_uint32(a + "hyper_connection.sinkhorn_iterations", cfg.hc_sinkhorn_iters)
        writer.add_float32(a + "hyper_connection.epsilon", cfg.hc_eps)
        writer.add_uint32(a + "hash_layer_count", cfg.hash_layer_count)
        writer.add_uint32(a + "embedding_length_out", cfg.hc_mult * cfg.n_embd)
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)
        n_vocab = _copy_tokenizer(writer, tokenizer_gguf)
        writer.add_vocab_size(n_vocab)
        for tensor_name, data in _deepseek4_weights(cfg, n_vocab):
            writer.add_tensor(tensor_name, data)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
