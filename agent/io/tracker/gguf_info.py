"""Reading the facts the model registry needs from a GGUF file (``gguf`` package).

Owns: opening the file with ``gguf.GGUFReader`` (memory-mapped; parsing a 100 MB model takes
a second or two, mostly its tokenizer arrays), picking the metadata keys and summing tensor
sizes into ``agent.core.tracker.registry.GgufFacts``, the file's sha256, and reading a registered
file's metadata prefix and tensor hashes back (``read_registered_file``: checked against what was
registered). Synchronous: callers in trio run it in a thread.
"""

from __future__ import annotations

import os
from pathlib import Path

from agent.core.tracker.registry import GgufFacts

__all__ = ["GgufError", "read_gguf_facts", "read_registered_file"]


class GgufError(Exception):
    """The file is not a GGUF model the registry can describe; the message says why."""


def _field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        return None
    return field.contents()


def _int(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, list):  # per-layer values (e.g. head_count_kv of some models)
        return max(int(v) for v in value) if value else None
    return int(value)


# Where GGUF writers record the model's origin (convert_hf_to_gguf.py writes the first two).
_SOURCE_REPO_KEYS = (
    "general.source.huggingface.repository",
    "general.base_model.0.repo_url",
    "general.source.url",
)


def _source_repo(reader) -> str:
    """``org/name`` of the Hugging Face repo the metadata names, or ""."""
    for key in _SOURCE_REPO_KEYS:
        value = _field(reader, key)
        if value:
            text = str(value).strip()
            return text.removeprefix("https://huggingface.co/").strip("/")
    return ""


def _gguf_reader(path: Path):
    """The GGUF at ``path``, its magic checked first (a file that is something else says so,
    not what numpy makes of it). Raises GgufError; OSError when it cannot be read."""
    from gguf import GGUFReader  # lazy: numpy-heavy import, only the tracker needs it

    from agent.io.gguf_sparse import check_gguf_magic

    try:
        check_gguf_magic(path)
    except ValueError as error:
        raise GgufError(str(error)) from None
    try:
        return GGUFReader(path)
    except (ValueError, IndexError, KeyError) as error:
        raise GgufError(f"{path}: not a readable GGUF file ({error})") from None


def read_gguf_facts(path: str | os.PathLike[str]) -> GgufFacts:
    """Metadata and block tensor bytes of the GGUF at ``path``.

    Raises:
      GgufError: not a GGUF file, or general.architecture / {arch}.block_count missing.
      OSError: the file cannot be read.
    """
    path = Path(path)
    size = path.stat().st_size
    reader = _gguf_reader(path)
    arch = _field(reader, "general.architecture")
    if not arch:
        raise GgufError(f"{path}: no general.architecture in the metadata")
    n_layer = _int(_field(reader, f"{arch}.block_count"))
    if not n_layer:
        raise GgufError(f"{path}: no {arch}.block_count in the metadata")
    n_embd = _int(_field(reader, f"{arch}.embedding_length")) or 0
    n_head = _int(_field(reader, f"{arch}.attention.head_count")) or 0
    n_head_kv = _int(_field(reader, f"{arch}.attention.head_count_kv")) or n_head
    head_dim = n_embd // n_head if n_head else 0
    key_length = _int(_field(reader, f"{arch}.attention.key_length")) or head_dim
    value_length = _int(_field(reader, f"{arch}.attention.value_length")) or head_dim
    block_bytes = sum(int(t.n_bytes) for t in reader.tensors if t.name.startswith("blk."))
    return GgufFacts(
        name=str(_field(reader, "general.name") or ""),
        source_repo=_source_repo(reader),
        architecture=str(arch),
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        key_length=key_length,
        value_length=value_length,
        block_tensor_bytes=block_bytes,
        size_bytes=size,
        context_length=_int(_field(reader, f"{arch}.context_length")) or 0,
    )


def _check_registered(path: Path, sha256: str, size_bytes: int) -> None:
    """That ``path`` is still the registered file: ``size_bytes`` long, hashing to ``sha256``
    (hashed again when its size or mtime changed since it was last hashed).

    Raises:
      GgufError: another size or sha256 than registered.
    """
    from agent.models import cached_sha256

    size = path.stat().st_size
    if size != size_bytes:
        raise GgufError(f"{path} is {size} bytes, the registered model {size_bytes}: the file changed")
    digest = cached_sha256(path)
    if digest != sha256:
        raise GgufError(f"{path} now hashes to {digest}, not the registered {sha256}: the file changed")


def read_registered_file(path: str | os.PathLike[str], sha256: str, size_bytes: int):
    """(metadata prefix, [``agent.core.wire.manifest.TensorFacts``] in file order) of the GGUF at
    ``path``, after checking that it is still the file registered (``size_bytes`` long,
    hashing to ``sha256``): one parse of the header, then
    every tensor's absolute data offset, size and sha256 (reads the whole file; seconds per GB).

    Raises:
      GgufError: another size or sha256 than registered, or not a readable GGUF.
      OSError: the file cannot be read.
    """
    import hashlib

    from agent.core.wire.manifest import TensorFacts

    path = Path(path)
    _check_registered(path, sha256, size_bytes)
    reader = _gguf_reader(path)
    data_offset = int(reader.data_offset)
    layout = sorted((int(t.data_offset), int(t.n_bytes), t.name) for t in reader.tensors)
    del reader  # its memory map
    tensors = []
    with open(path, "rb") as f:
        metadata = f.read(data_offset)
        for offset, n_bytes, name in layout:
            f.seek(offset)
            tensor_digest = hashlib.sha256()
            left = n_bytes
            while left > 0:
                chunk = f.read(min(left, 1 << 20))
                if not chunk:
                    raise GgufError(f"{path}: tensor {name} runs past the end of the file")
                tensor_digest.update(chunk)
                left -= len(chunk)
            tensors.append(TensorFacts(name, offset, n_bytes, tensor_digest.hexdigest()))
    return metadata, tensors
