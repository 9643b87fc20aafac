"""A GGUF's metadata prefix, and files that hold only it (sparse, the GGUF's full size).

Owns: cutting a GGUF at the start of its tensor data (header, key-value metadata, tensor
infos, alignment padding: everything but the weights), and writing that prefix into a sparse
file of the original size, so that llama.cpp opens it as usual (its loader checks every
tensor against the file size) while the disk holds only the metadata. A vocab-only load
(tokenizer, chat template) reads nothing past the prefix. Synchronous: trio callers run it
in a thread.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

__all__ = ["GGUF_MAGIC", "check_gguf_magic", "gguf_metadata_prefix", "write_sparse_gguf"]

GGUF_MAGIC = b"GGUF"


def check_gguf_magic(path: str | os.PathLike[str]) -> None:
    """Raises ValueError unless the file at ``path`` starts as a GGUF does (OSError when it
    cannot be read): a cheap first check, before hashing or loading it."""
    with open(path, "rb") as f:
        start = f.read(4)
    if start != GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file (it starts with {start!r}, not {GGUF_MAGIC!r})")


def gguf_metadata_prefix(path: str | os.PathLike[str]) -> bytes:
    """The bytes of the GGUF at ``path`` before its tensor data.

    Raises:
      ValueError: not a GGUF file.
      OSError: the file cannot be read.
    """
    from gguf import GGUFReader  # lazy: numpy-heavy import

    path = Path(path)
    check_gguf_magic(path)
    try:
        data_offset = int(GGUFReader(path).data_offset)
    except (IndexError, KeyError) as error:
        raise ValueError(f"{path}: not a readable GGUF file ({error})") from None
    with open(path, "rb") as f:
        return f.read(data_offset)


def write_sparse_gguf(metadata: bytes, size_bytes: int, dest: str | os.PathLike[str]) -> Path:
    """Write ``metadata`` at the start of a sparse file of ``size_bytes`` at ``dest``.

    Written to a temp file in the same directory, then renamed: a reader never sees half a
    file.

    Raises:
      ValueError: ``metadata`` is not a GGUF prefix, or longer than ``size_bytes``.
      OSError: the file cannot be written.
    """
    if not metadata.startswith(GGUF_MAGIC):
        raise ValueError("the metadata does not start with the GGUF magic")
    if len(metadata) > size_bytes:
        raise ValueError(f"{len(metadata)} metadata bytes do not fit a file of {size_bytes} bytes")
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(metadata)
            f.truncate(size_bytes)  # the rest is a hole: no disk blocks, reads as zeros
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return dest
