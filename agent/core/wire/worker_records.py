"""Plain records for what one shard worker takes and gives (``protocol/worker.proto``).

These mirror the protobuf messages in Python types (numpy rows instead of bytes) so the
core can reason about Forward batches without the generated stubs. The gRPC shell
(``agent.io.worker.client``) converts between these and the wire messages.

Pure: imports numpy only.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Iterable, Sequence

import numpy as np

from agent.core.wire.boundary import BoundarySchema
from agent.core.wire.ranges import LayerRange
from agent.core.wire.topk import TopLogits

__all__ = [
    "SCHEMA_VERSION",
    "BoundarySchemaInfo",
    "ForwardTiming",
    "SeqInput",
    "SeqOutput",
    "TokenAttr",
    "Vocabulary",
    "WorkerHealth",
    "WorkerInfo",
]

#: The worker schema version this code speaks (``SCHEMA_VERSION_CURRENT``).
SCHEMA_VERSION = 1


@dataclasses.dataclass(frozen=True)
class SeqInput:
    """One sequence's rows in a Forward batch.

    Exactly one of ``token_ids`` (the first range) or ``boundary`` (float32
    ``[n_rows, n_embd]``, any other range) is set; ``positions`` has one entry per row and
    must continue the sequence. ``logit_rows``: for the last range, the rows of this entry
    whose logits to return (None or empty: the last row only). ``top_k``: for the last
    range, > 0 asks for each such row's top-K and log-sum-exp (``SeqOutput.top``) instead of
    the row (0: the full rows).
    """

    seq_id: int
    positions: Sequence[int] | np.ndarray
    token_ids: Sequence[int] | np.ndarray | None = None
    boundary: np.ndarray | None = None
    logit_rows: Sequence[int] | None = None
    #: the schema ``boundary`` follows; None: the receiving worker's own (rows that came out
    #: of a range of the same model). Checked against the receiver's before sending.
    boundary_schema: BoundarySchema | None = None
    top_k: int = 0
    #: ``boundary`` as float32 wire bytes, already checked (finite, whole rows) where they
    #: came from: sent as they are, not encoded again (a hop's rows pass through as bytes)
    boundary_bytes: bytes | None = None

    @property
    def n_rows(self) -> int:
        return len(self.positions)

    def check(self) -> None:
        """Raise ValueError when the entry is inconsistent in itself (before any encoding)."""
        if (self.token_ids is None) == (self.boundary is None):
            raise ValueError(f"seq {self.seq_id}: set exactly one of token_ids or boundary")
        payload = self.token_ids if self.token_ids is not None else self.boundary
        assert payload is not None  # exactly one is set (checked above)
        rows = len(payload)
        if rows != len(self.positions):
            kind = "token ids" if self.token_ids is not None else "boundary rows"
            raise ValueError(f"seq {self.seq_id}: {rows} {kind} but {len(self.positions)} positions")


@dataclasses.dataclass(frozen=True)
class SeqOutput:
    """One sequence's result of a Forward.

    ``boundary`` (float32 ``[n_rows, streams * n_embd]``) from a range that is not last, or
    ``logits`` (float32 ``[n_rows, n_vocab]``) from the last range, whose rows belong to
    the entry rows listed in ``logit_rows``. ``next_position``: positions the sequence now
    holds on that worker. ``top``: when the entry asked for ``top_k`` > 0, one
    ``TopLogits`` per row of ``logit_rows`` (and ``logits`` is None).
    """

    seq_id: int
    boundary: np.ndarray | None
    logits: np.ndarray | None
    logit_rows: tuple[int, ...]
    next_position: int
    #: the schema of ``boundary`` as the worker declared it (None without boundary rows)
    boundary_schema: BoundarySchema | None = None
    top: tuple[TopLogits, ...] = ()
    #: the float32 bytes ``boundary`` views, as the worker sent them (checked finite); None
    #: when the rows were converted from another dtype
    boundary_bytes: bytes | None = None

    @property
    def n_rows(self) -> int:
        rows = self.boundary if self.boundary is not None else self.logits
        if rows is None:
            return len(self.top)
        return int(rows.shape[0])


@dataclasses.dataclass(frozen=True)
class ForwardTiming:
    """One Forward's time, microseconds: ``compute_us`` as the worker measured it
    (``ForwardReply.compute_us``: the ranged graph and the outputs; 0 from a worker that does
    not measure it) and ``call_us`` as the caller measured the whole call (request encoded,
    sent, the worker's time, the reply read and decoded). ``call_us - compute_us`` is what
    the call itself cost: the socket, waking both sides, encoding and decoding."""

    compute_us: int
    call_us: int


@dataclasses.dataclass(frozen=True)
class BoundarySchemaInfo:
    """``BoundarySchema`` of an InfoReply. A worker older than schema 2 leaves streams and
    row_values 0: read them as 1 and n_embd."""

    version: int
    name: str
    n_embd: int
    dtype: int
    streams: int = 1
    row_values: int = 0

    @functools.cached_property  # read for every entry of every Forward
    def schema(self) -> BoundarySchema:
        return BoundarySchema.declared(self.version, self.streams, self.n_embd)

    @functools.cached_property
    def width(self) -> int:
        """Values per boundary row."""
        return self.row_values or self.schema.row_values


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """What a worker holds (``InfoReply``).

    ``vocab_only``: the worker holds the vocabulary and no tensors (``--vocab-only``); then
    only ``architecture``, ``n_vocab``, ``eog_token_ids``, ``model_path``, the build's fields
    and a ``model_sha256`` it was given are set, the rest is 0 / empty.
    """

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
    vocab_only: bool = False
    data_port: int = 0  # the data plane's TCP port (--data-listen); 0: none
    n_threads_decode: int = 0  # threads of a one-row micro-batch (--threads-decode); 0: an old worker
    prefix_cache_sequences: int = 0  # spare sequences of the prefix cache (--prefix-cache-bytes); 0: off
    prefix_cache_bytes: int = 0  # the KV bytes they take (in kv_bytes)

    def prefix_cache_bytes_of(self, positions: int) -> int:
        """The KV bytes ``positions`` positions of the prefix cache take (its bytes are its
        spare sequences', ``n_ctx_per_sequence`` positions each)."""
        held = self.prefix_cache_sequences * self.n_ctx_per_sequence
        return positions * self.prefix_cache_bytes // held if held else 0

    @property
    def layers(self) -> LayerRange:
        """The blocks this worker serves. Raises ValueError for a vocab-only worker."""
        if self.vocab_only:
            raise ValueError("a vocab-only worker holds no layers")
        return LayerRange(self.layer_begin, self.layer_end)


@dataclasses.dataclass(frozen=True)
class WorkerHealth:
    """``HealthReply``."""

    schema_version: int
    ready: bool
    forward_calls: int
    active_sequences: int
    data_plane_forwards: int = 0  # see HealthReply
    data_plane_steps: int = 0
    data_plane_compute_us: int = 0
    forward_rows: int = 0  # rows of every Forward (a prefix cache hit's copied rows are not)
    prefix_lookups: int = 0  # the prefix cache's counters (HealthReply)
    prefix_hits: int = 0
    prefix_hit_positions: int = 0
    prefix_kept: int = 0
    prefix_evicted: int = 0
    prefix_entries: int = 0
    prefix_positions: int = 0
    #: the blocks its cache holds, as tags, most recently used first (as many as asked)
    prefix_tags: tuple[int, ...] = ()


class TokenAttr(enum.IntFlag):
    """``llama_token_attr`` bit flags (llama.h) of ``Vocabulary.attrs``."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    NORMALIZED = 1 << 6
    LSTRIP = 1 << 7
    RSTRIP = 1 << 8
    SINGLE_WORD = 1 << 9


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    """A model's whole vocabulary (``VocabularyReply``), enough to detokenize a stream.

    ``pieces[t]``: the bytes llama.cpp appends to a stream for token ``t``
    (``llama_token_to_piece`` with ``lstrip=0, special=False``): possibly part of one UTF-8
    character, empty for control tokens. ``attrs[t]``: its ``TokenAttr`` flags.
    ``bos_token_id``: None when the vocabulary has none; ``add_bos``: Tokenize with
    ``add_special`` prepends it.
    """

    schema_version: int
    n_vocab: int
    pieces: tuple[bytes, ...]
    attrs: tuple[int, ...]
    bos_token_id: int | None
    add_bos: bool
    eog_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if not (len(self.pieces) == len(self.attrs) == self.n_vocab):
            raise ValueError(
                f"a vocabulary of {self.n_vocab} tokens needs as many pieces and attrs, "
                f"got {len(self.pieces)} and {len(self.attrs)}"
            )

    def piece_bytes(self, token_ids: Iterable[int]) -> bytes:
        """The concatenated pieces of ``token_ids`` (decode with an incremental UTF-8 decoder
        when the ids arrive one at a time). Raises IndexError for an id outside the vocabulary."""
        pieces = self.pieces
        out = []
        for t in token_ids:
            if not 0 <= t < self.n_vocab:
                raise IndexError(f"token id {t} is outside [0, {self.n_vocab})")
            out.append(pieces[t])
        return b"".join(out)
