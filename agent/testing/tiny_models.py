"""The synthetic test models, pinned: ``TINY_MODELS`` (name, cache file name, sha256) and
``tiny_model_path(name)``, their cached, sha256-verified file (written if missing).

The bytes are ``agent.testing.synthetic``'s (deterministic; changing the writer changes them, so
update the pins here with it); the cache, its locks and the verification are ``agent.models``'
(``pinned_path``), as for the real models. Must not import agent.io, agent.core, trio or grpc;
numpy / gguf only when a model is written.
"""

from __future__ import annotations

import functools
from pathlib import Path

from agent.models import PinnedModel, model_path, pinned_path

__all__ = ["TINY_MODELS", "tiny_model_path"]


def _write(name: str, dest: Path, cache: Path) -> None:
    from agent.testing.synthetic import write_tiny_model  # numpy + gguf: only when needed

    write_tiny_model(name, dest, tokenizer_gguf=model_path("smollm2", cache=cache))


def _tiny(name: str, filename: str, sha256: str) -> PinnedModel:
    return PinnedModel(name=name, filename=filename, sha256=sha256, write=functools.partial(_write, name))


TINY_MODELS: dict[str, PinnedModel] = {
    spec.name: spec
    for spec in (
        _tiny("qwen2-tiny", "tiny-qwen2.gguf", "a98eb03b773304abce8a64c106d647e91399c9be7c99373fa33366360c8bd56c"),
        # qwen2-tiny with Qwen2.5-Instruct's tool-aware chat template
        _tiny(
            "qwen2-tiny-tools",
            "tiny-qwen2-tools.gguf",
            "541274c67e307862ed6eca2ddf067720ce0bb9d234ea7e64bf29298cb9ef19fc",
        ),
        _tiny("qwen3-tiny", "tiny-qwen3.gguf", "68621212a9429911c01b6b3d03c31f2b2191b62527e56b92910bbde18213fbdd"),
        # DeepSeek V4 (hyper-connections, compressed KV with ratios 0 / 4 / 128): the
        # architecture whose boundary is schema 2 (agent.testing.synthetic.DEEPSEEK4_CONFIGS).
        _tiny(
            "deepseek4-tiny", "tiny-deepseek4.gguf", "652f4c966d8ab4a0c46fff91af01909712585962bc725070f936723840783435"
        ),
    )
}


def tiny_model_path(name: str, *, cache: Path | None = None) -> Path:
    """The cached, sha256-verified file of synthetic model ``name`` (``qwen2-tiny``,
    ``qwen3-tiny``, ``deepseek4-tiny``), written if missing (with SmolLM2's tokenizer, fetched
    if missing too).

    Raises:
      KeyError: unknown name.
      agent.models.ModelError: as ``agent.models.pinned_path``.
    """
    return pinned_path(TINY_MODELS[name], cache=cache)
