"""The pinned model files: registry hashes, cache behaviour, synthetic model determinism."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from agent import models
from agent.testing import synthetic, tiny_models

pytestmark = pytest.mark.worker

# File names fixed by docs/LAYOUT.md (cache paths are part of the contract).
LAYOUT_FILENAMES = {
    "smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3": "gemma-3-270m-q4_k_m.gguf",
    "qwen2-tiny": "tiny-qwen2.gguf",
    "qwen2-tiny-tools": "tiny-qwen2-tools.gguf",
    "qwen3-tiny": "tiny-qwen3.gguf",
    "deepseek4-tiny": "tiny-deepseek4.gguf",
}
#: every pinned model: the real ones (agent.models) and the synthetic test models
PINNED = {**models.REGISTRY, **tiny_models.TINY_MODELS}


def pinned_path(name: str) -> Path:
    return models.pinned_path(PINNED[name])


def test_registry_matches_layout():
    assert {name: spec.filename for name, spec in PINNED.items()} == LAYOUT_FILENAMES
    assert not models.REGISTRY.keys() & tiny_models.TINY_MODELS.keys()


@pytest.mark.parametrize("name", sorted(LAYOUT_FILENAMES))
def test_registry_hash_matches_file(name):
    path = pinned_path(name)

    # A full re-hash on purpose: pinned_path may have trusted its .sha256-ok marker.
    assert models.sha256_file(path) == PINNED[name].sha256
    assert path == models.cache_dir() / "models" / LAYOUT_FILENAMES[name]


@pytest.mark.parametrize("name", sorted(synthetic.CONFIGS))
def test_synthetic_model_is_byte_for_byte_reproducible(name, smollm2_path, tmp_path):
    cached = tiny_models.tiny_model_path(name)
    fresh = tmp_path / f"{name}.gguf"

    synthetic.write_tiny_model(name, fresh, tokenizer_gguf=smollm2_path)

    assert fresh.read_bytes() == cached.read_bytes()


EXPECTED_BLOCK_TENSORS = {
    # name suffix -> ggml shape (ne0, ne1), from src/models/qwen2.cpp / qwen3.cpp load_arch_tensors
    "qwen2-tiny": {
        "attn_norm.weight": (64,),
        "attn_q.weight": (64, 64),
        "attn_k.weight": (64, 32),
        "attn_v.weight": (64, 32),
        "attn_q.bias": (64,),
        "attn_k.bias": (32,),
        "attn_v.bias": (32,),
        "attn_output.weight": (64, 64),
        "ffn_norm.weight": (64,),
        "ffn_gate.weight": (64, 128),
        "ffn_down.weight": (128, 64),
        "ffn_up.weight": (64, 128),
    },
    "qwen3-tiny": {
        "attn_norm.weight": (64,),
        "attn_q.weight": (64, 64),
        "attn_k.weight": (64, 32),
        "attn_v.weight": (64, 32),
        "attn_q_norm.weight": (16,),
        "attn_k_norm.weight": (16,),
        "attn_output.weight": (64, 64),
        "ffn_norm.weight": (64,),
        "ffn_gate.weight": (64, 128),
        "ffn_down.weight": (128, 64),
        "ffn_up.weight": (64, 128),
    },
}


TOKENIZER_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    # GGUFReader takes ~2 s on a 49k-token vocabulary: read the source once.
    reader = gguf.GGUFReader(smollm2_path)
    return {key: reader.fields[key].contents() for key in TOKENIZER_KEYS}


@pytest.mark.parametrize("name", sorted(synthetic.CONFIGS))
def test_synthetic_model_has_the_loader_layout(name, smollm2_tokenizer):
    cfg = synthetic.CONFIGS[name]
    reader = gguf.GGUFReader(tiny_models.tiny_model_path(name))
    tensors = {t.name: t for t in reader.tensors}

    assert reader.fields["general.architecture"].contents() == cfg.arch
    assert reader.fields[f"{cfg.arch}.block_count"].contents() == cfg.n_layer
    expected = {"token_embd.weight": (64, 49152), "output_norm.weight": (64,)}
    if not cfg.tied_output:
        expected["output.weight"] = (64, 49152)
    for il in range(cfg.n_layer):
        expected.update({f"blk.{il}.{k}": v for k, v in EXPECTED_BLOCK_TENSORS[name.removesuffix("-tools")].items()})
    assert {n: tuple(int(d) for d in t.shape) for n, t in tensors.items()} == expected
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in tensors.values())
    assert all(np.isfinite(t.data).all() for t in tensors.values())
    # The SmolLM2 tokenizer, copied exactly.
    for key in TOKENIZER_KEYS:
        assert reader.fields[key].contents() == smollm2_tokenizer[key], key


@pytest.mark.timeout(120)
def test_synthetic_deepseek4_is_byte_for_byte_reproducible(smollm2_path, tmp_path):
    fresh = tmp_path / "deepseek4-tiny.gguf"

    synthetic.write_tiny_model("deepseek4-tiny", fresh, tokenizer_gguf=smollm2_path)

    assert models.sha256_file(fresh) == tiny_models.TINY_MODELS["deepseek4-tiny"].sha256


def test_synthetic_deepseek4_has_every_tensor_kind_the_loader_needs():
    cfg = synthetic.DEEPSEEK4_CONFIGS["deepseek4-tiny"]
    reader = gguf.GGUFReader(tiny_models.tiny_model_path("deepseek4-tiny"))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.")}
    tensors = {t.name: t for t in reader.tensors}

    assert fields["general.architecture"] == "deepseek4"
    assert fields["deepseek4.block_count"] == cfg.n_layer == 6
    # every compression kind, and a run of compressed blocks to cut inside
    assert fields["deepseek4.attention.compress_ratios"] == [0, 4, 128, 4, 128, 0]
    assert fields["deepseek4.hyper_connection.count"] == 4
    assert {n: tuple(int(d) for d in t.shape) for n, t in tensors.items()} == {
        name: ne for name, ne, _ in synthetic.deepseek4_tensor_shapes(cfg, 49152)
    }
    kinds = {(name.split(".", 2)[2] if name.startswith("blk.") else name).rsplit(".", 1)[0] for name in tensors}
    assert {
        "output_hc_fn",
        "output_hc_base",
        "output_hc_scale",
        "attn_compressor_kv",
        "attn_compressor_ape",
        "indexer_compressor_kv",
        "indexer.proj",
        "indexer.attn_q_b",
        "ffn_gate_tid2eid",
        "exp_probs_b",
        "hc_attn_fn",
        "hc_ffn_fn",
        "attn_sinks",
        "attn_output_a",
        "ffn_gate_exps",
        "ffn_up_shexp",
    } <= kinds
    # CSA blocks (ratio 4) have an indexer, HCA blocks (128) a compressor only, ratio 0 neither
    for il, ratio in enumerate(cfg.compress_ratios):
        assert (f"blk.{il}.attn_compressor_kv.weight" in tensors) == (ratio != 0)
        assert (f"blk.{il}.indexer.proj.weight" in tensors) == (ratio == 4)
    ids = tensors["blk.0.ffn_gate_tid2eid.weight"]
    assert ids.tensor_type == gguf.GGMLQuantizationType.I32
    assert ids.data.min() >= 0 and ids.data.max() < cfg.n_expert
    assert all(np.isfinite(t.data).all() for t in tensors.values())


def test_corrupt_cached_model_is_refused_and_moved_aside(tmp_path):
    bad = tmp_path / "models" / "tiny-qwen2.gguf"
    bad.parent.mkdir()
    bad.write_bytes(b"not a model")

    with pytest.raises(models.ModelError) as caught:
        tiny_models.tiny_model_path("qwen2-tiny", cache=tmp_path)

    actual = models.sha256_file(bad.with_name(bad.name + ".rejected"))
    assert actual in str(caught.value) and tiny_models.TINY_MODELS["qwen2-tiny"].sha256 in str(caught.value)
    assert not bad.exists()


def test_hash_marker_is_invalidated_by_a_change(tmp_path):
    path = tmp_path / "file.bin"
    path.write_bytes(b"abc")
    good = models.sha256_file(path)
    assert models.is_verified(path, good)
    assert Path(f"{path}.sha256-ok").is_file()

    path.write_bytes(b"abd")  # same size: only the mtime tells the marker is stale
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))

    assert not models.is_verified(path, good)


def test_unknown_model_name_is_a_key_error():
    with pytest.raises(KeyError):
        models.model_path("no-such-model")
