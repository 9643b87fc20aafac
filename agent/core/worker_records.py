"""Plain records for what one shard worker takes and gives (``protocol/worker.proto``).

These mirror the protobuf messages in Python types (numpy rows instead of bytes) so the
core can reason about Forward batches without the generated stubs. The gRPC shell
(``agent.io.worker_client``) converts between these and the wire messages.

Pure: imports numpy only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from .ranges import LayerRange

__all__ = ["SCHEMA_VERSION", "BoundarySchemaInfo", "SeqInput", "SeqOutput", "WorkerHealth", "WorkerInfo"]

#: The worker schema version this code speaks (``SCHEMA_VERSION_CURRENT``).
SCHEMA_VERSION = 1


@dataclasses.dataclass(frozen=True)
class SeqInput:
    """One sequence's rows in a Forward batch.

    Exactly one of ``token_ids`` (the first range) or ``boundary`` (float32
    ``[n_rows, n_embd]``, any other range) is set; ``positions`` has one entry per row and
    must continue the sequence. ``logit_rows``: for the last range, the rows of this entry
    whose logits to return (None or empty: the last row only).
    """

    seq_id: int
    positions: Sequence[int]
    token_ids: Sequence[int] | None = None
    boundary: np.ndarray | None = None
    logit_rows: Sequence[int] | None = None

    @property
    def n_rows(self) -> int:
        return len(self.positions)

    def check(self) -> None:
        """Raise ValueError when the entry is inconsistent in itself (before any encoding)."""
        if (self.token_ids is None) == (self.boundary is None):
            raise ValueError(f"seq {self.seq_id}: set exactly one of token_ids or boundary")
        rows = len(self.token_ids) if self.token_ids is not None else len(self.boundary)
        if rows != len(self.positions):
            kind = "token ids" if self.token_ids is not None else "boundary rows"
            raise ValueError(f"seq {self.seq_id}: {rows} {kind} but {len(self.positions)} positions")


@dataclasses.dataclass(frozen=True)
class SeqOutput:
    """One sequence's result of a Forward.

    ``boundary`` (float32 ``[n_rows, n_embd]``) from a range that is not last, or
    ``logits`` (float32 ``[n_rows, n_vocab]``) from the last range, whose rows belong to
    the entry rows listed in ``logit_rows``. ``next_position``: positions the sequence now
    holds on that worker.
    """

    seq_id: int
    boundary: np.ndarray | None
    logits: np.ndarray | None
    logit_rows: tuple[int, ...]
    next_position: int

    @property
    def n_rows(self) -> int:
        rows = self.boundary if self.boundary is not None else self.logits
        return 0 if rows is None else int(rows.shape[0])


@dataclasses.dataclass(frozen=True)
class BoundarySchemaInfo:
    version: int
    name: str
    n_embd: int
    dtype: int


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """What a worker holds (``InfoReply``)."""

    schema_version: int
    architecture: str
    n_layer: int
    n_embd: int
    n_vocab: int
    layer_begin: int
    layer_end: int
    takes_tokens: bool
    gives_logits: bool
    boundary: BoundarySchemaInfo
    recipe_hash: str
    model_sha256: str
    llama_cpp_commit: str
    patch_series_sha256: str
    backend: str
    weight_bytes: int
    weight_buffer_bytes: int
    kv_bytes: int
    n_ctx_per_sequence: int
    n_seq_max: int
    n_batch_max: int
    model_path: str
    n_threads: int
    eog_token_ids: tuple[int, ...] = ()

    @property
    def layers(self) -> LayerRange:
        return LayerRange(self.layer_begin, self.layer_end)


@dataclasses.dataclass(frozen=True)
class WorkerHealth:
    """``HealthReply``."""

    schema_version: int
    ready: bool
    forward_calls: int
    active_sequences: int
