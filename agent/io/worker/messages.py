"""The native worker's messages: conversions between ``agent.core.wire.worker_records`` and the
generated protobuf messages (``protocol/worker.proto``).

Owns building the requests (``forward_request``, ``tokenize_request``, ``detokenize_request``)
and decoding the replies (``forward_outputs``, the Info, Health and Vocabulary replies), with
the checks of what the worker sent (``agent.core.wire.boundary``, ``TopLogits.check``). No I/O:
must not import gRPC, trio, sockets or the clients (``agent.io.worker.client``,
``agent.io.worker.stream``), which build on this.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from agent._proto import worker_pb2
from agent.core.wire.boundary import (
    RESIDUAL,
    BoundaryError,
    BoundarySchema,
    WireDType,
    check_boundary_schema,
    decode_rows,
    encode_rows,
)
from agent.core.wire.topk import TopLogits
from agent.core.wire.worker_records import (
    SCHEMA_VERSION,
    BoundarySchemaInfo,
    SeqInput,
    SeqOutput,
    Vocabulary,
    WorkerHealth,
    WorkerInfo,
)

__all__ = ["detokenize_request", "forward_outputs", "forward_request", "tokenize_request"]


def _info_from_reply(reply: worker_pb2.InfoReply) -> WorkerInfo:
    b = reply.boundary
    return WorkerInfo(
        schema_version=reply.schema_version,
        architecture=reply.architecture,
        n_layer=reply.n_layer,
        n_embd=reply.n_embd,
        n_vocab=reply.n_vocab,
        layer_begin=reply.layer_begin,
        layer_end=reply.layer_end,
        takes_tokens=reply.takes_tokens,
        gives_logits=reply.gives_logits,
        boundary=BoundarySchemaInfo(
            version=b.version,
            name=b.name,
            n_embd=b.n_embd,
            dtype=int(b.dtype),
            streams=b.streams or 1,
            row_values=b.row_values,
        ),
        recipe_hash=reply.recipe_hash,
        model_sha256=reply.model_sha256,
        llama_cpp_commit=reply.llama_cpp_commit,
        patch_series_sha256=reply.patch_series_sha256,
        backend=reply.backend,
        weight_bytes=reply.weight_bytes,
        weight_buffer_bytes=reply.weight_buffer_bytes,
        kv_bytes=reply.kv_bytes,
        n_ctx_per_sequence=reply.n_ctx_per_sequence,
        n_seq_max=reply.n_seq_max,
        n_batch_max=reply.n_batch_max,
        model_path=reply.model_path,
        n_threads=reply.n_threads,
        eog_token_ids=tuple(reply.eog_token_ids),
        vocab_only=reply.vocab_only,
        data_port=reply.data_port,
        n_threads_decode=reply.n_threads_decode,
        prefix_cache_sequences=reply.prefix_cache_sequences,
        prefix_cache_bytes=reply.prefix_cache_bytes,
    )


def _health_from_reply(reply: worker_pb2.HealthReply) -> WorkerHealth:
    return WorkerHealth(
        schema_version=reply.schema_version,
        ready=reply.ready,
        forward_calls=reply.forward_calls,
        active_sequences=reply.active_sequences,
        data_plane_forwards=reply.data_plane_forwards,
        data_plane_steps=reply.data_plane_steps,
        data_plane_compute_us=reply.data_plane_compute_us,
        forward_rows=reply.forward_rows,
        prefix_lookups=reply.prefix_lookups,
        prefix_hits=reply.prefix_hits,
        prefix_hit_positions=reply.prefix_hit_positions,
        prefix_kept=reply.prefix_kept,
        prefix_evicted=reply.prefix_evicted,
        prefix_entries=reply.prefix_entries,
        prefix_positions=reply.prefix_positions,
        prefix_tags=tuple(reply.prefix_tags),
    )


def _vocabulary_from_reply(reply: worker_pb2.VocabularyReply) -> Vocabulary:
    """Raises ValueError when the reply's pieces or attrs do not match its n_vocab."""
    return Vocabulary(
        schema_version=reply.schema_version,
        n_vocab=reply.n_vocab,
        pieces=tuple(reply.pieces),
        attrs=tuple(reply.attrs),
        bos_token_id=reply.bos_token_id if reply.bos_token_id >= 0 else None,
        add_bos=reply.add_bos,
        eog_token_ids=tuple(reply.eog_token_ids),
    )


def tokenize_request(text: str, add_special: bool, parse_special: bool) -> worker_pb2.TokenizeRequest:
    return worker_pb2.TokenizeRequest(
        schema_version=SCHEMA_VERSION, text=text, add_special=add_special, parse_special=parse_special
    )


def detokenize_request(
    token_ids: Sequence[int], remove_special: bool, unparse_special: bool
) -> worker_pb2.DetokenizeRequest:
    return worker_pb2.DetokenizeRequest(
        schema_version=SCHEMA_VERSION,
        token_ids=[int(t) for t in token_ids],
        remove_special=remove_special,
        unparse_special=unparse_special,
    )


def forward_request(entries: Sequence[SeqInput], info: WorkerInfo) -> worker_pb2.ForwardRequest:
    """Encode ``entries`` for a worker described by ``info``. An entry's ``boundary_bytes``
    (rows already checked) go as they are; other boundary rows are checked and encoded.

    Raises:
      ValueError: an entry is inconsistent in itself (``SeqInput.check``).
      agent.core.wire.boundary.BoundaryError: boundary rows are not float32 ``[n, n_embd]`` or
        hold NaN/Inf. (To send such rows on purpose, build the protobuf yourself and use
        ``WorkerClient.call``.)
    """
    request = worker_pb2.ForwardRequest(schema_version=SCHEMA_VERSION)
    expected = info.boundary.schema
    width = info.boundary.width
    for entry in entries:
        entry.check()
        msg = request.entries.add()
        msg.seq_id = entry.seq_id
        msg.positions.extend(_ints(entry.positions))
        if entry.token_ids is not None:
            msg.token_ids.extend(_ints(entry.token_ids))
        else:
            if entry.boundary_schema is not None and entry.boundary_schema != expected:
                check_boundary_schema(entry.boundary_schema, expected)
            assert entry.boundary is not None  # check(): exactly one of token_ids, boundary
            msg.boundary = encode_rows(entry.boundary, width, WireDType.F32, checked_bytes=entry.boundary_bytes)
            msg.boundary_dtype = worker_pb2.DTYPE_F32
            msg.boundary_schema_version = expected.version
            msg.boundary_streams = expected.streams
        if entry.logit_rows:
            msg.logit_rows.extend(int(r) for r in entry.logit_rows)
        if entry.top_k:
            msg.top_k = int(entry.top_k)
    return request


def _ints(values: Sequence[int] | np.ndarray) -> list[int]:
    """``values`` as Python ints (numpy's in one call, not one by one)."""
    return values.tolist() if isinstance(values, np.ndarray) else [int(v) for v in values]


def forward_outputs(reply: worker_pb2.ForwardReply, info: WorkerInfo) -> list[SeqOutput]:
    """Decode a ForwardReply (boundary rows of width n_embd or logits of width n_vocab).
    F32 boundary rows stay a view of the reply's bytes, which the outputs carry too
    (``SeqOutput.boundary_bytes``) for the next hop.

    Raises:
      agent.core.wire.boundary.BoundaryError: a byte length that does not match ``n_rows``, an
        unspecified reply dtype, or non-finite boundary rows.
    """
    outputs = []
    expected = info.boundary.schema
    width = info.boundary.width
    dtype = reply.dtype
    for out in reply.entries:
        boundary = logits = boundary_bytes = None
        schema = None
        data = out.boundary
        if data:
            version, streams = out.boundary_schema_version, out.boundary_streams
            declared = (version or RESIDUAL, streams or 1, info.n_embd)
            if declared == (expected.version, expected.streams, expected.n_embd):
                schema = expected
            else:
                schema = BoundarySchema.declared(version, streams, info.n_embd)
                check_boundary_schema(schema, expected)
            boundary = decode_rows(data, out.n_rows, width, dtype)
            if dtype == worker_pb2.DTYPE_F32:
                boundary_bytes = data
        if out.logits:
            logits = decode_rows(out.logits, out.n_rows, info.n_vocab, dtype, check_finite=False)
        outputs.append(
            SeqOutput(
                seq_id=out.seq_id,
                boundary=boundary,
                logits=logits,
                logit_rows=tuple(out.logit_rows),
                next_position=out.next_position,
                boundary_schema=schema,
                top=_top_from_output(out, info.n_vocab),
                boundary_bytes=boundary_bytes,
            )
        )
    return outputs


def _top_from_output(out: worker_pb2.SequenceOutput, n_vocab: int) -> tuple[TopLogits, ...]:
    """The per-row top-K of a SequenceOutput (empty when it carries none).

    Raises:
      BoundaryError: byte lengths that do not match ``n_rows x top_k``, or a row that is not a
        well-formed top-K (``TopLogits.check``).
    """
    if not out.top_k:
        return ()
    k, n_rows = out.top_k, out.n_rows
    if (
        len(out.top_token_ids) != n_rows * k * 4
        or len(out.top_logits) != n_rows * k * 4
        or len(out.log_sum_exp) != n_rows
    ):
        raise BoundaryError(
            f"top-{k} of {n_rows} rows: got {len(out.top_token_ids)} id bytes, {len(out.top_logits)} logit bytes "
            f"and {len(out.log_sum_exp)} log-sum-exps"
        )
    ids = np.frombuffer(out.top_token_ids, dtype="<i4").reshape(n_rows, k)
    values = np.frombuffer(out.top_logits, dtype="<f4").reshape(n_rows, k)
    rows = tuple(TopLogits(ids[r], values[r], float(out.log_sum_exp[r]), n_vocab) for r in range(n_rows))
    for row in rows:
        try:
            row.check()
        except ValueError as err:
            raise BoundaryError(f"top-{k} from the worker: {err}") from err
    return rows
