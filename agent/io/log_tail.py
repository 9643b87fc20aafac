"""The end of a process's log file, for error messages (one reader for every harness)."""

from __future__ import annotations

import os

__all__ = ["LOG_TAIL_BYTES", "log_tail"]

LOG_TAIL_BYTES = 4000


def log_tail(path: str | os.PathLike[str], max_bytes: int = LOG_TAIL_BYTES) -> str:
    """The last ``max_bytes`` of the file at ``path`` as text ("" if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""
