"""TEST ONLY: a model file server that records its requests and can cut its responses.

``RecordingModelFileServer`` is ``agent.io.model_http.ModelFileServer`` (the same app, the same
``sent_bytes``) plus what tests look at: ``requests``, every (file name, Range header) in
arrival order (a list that grows with every request: for a test's lifetime only), and
``cut_after_bytes``: once that many body bytes were sent in total, every response stops as a
cut connection (None: never). Serve it with ``agent.io.model_http.serve_model_files``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from agent.io.model_http import ModelFileServer

__all__ = ["RecordingModelFileServer"]


class RecordingModelFileServer(ModelFileServer):
    """TEST ONLY: see the module doc."""

    def __init__(self, files: Mapping[str, str | os.PathLike[str]]) -> None:
        super().__init__(files)
        self.requests: list[tuple[str, str | None]] = []  # (name, Range header) in arrival order
        self.cut_after_bytes: int | None = None

    def requested(self, name: str, range_header: str | None) -> None:
        self.requests.append((name, range_header))

    def next_chunk_bytes(self, name: str, wanted: int) -> int:
        if self.cut_after_bytes is None:
            return wanted
        return min(wanted, self.cut_after_bytes - sum(self.sent_bytes.values()))
