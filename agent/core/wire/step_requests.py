"""Step requests: building the ``StepRequest`` a session owner sends to its first hop
(``first_step_request``: token ids, and the wire dtype the session's rows travel in), a
rebuild's replay of kept rows (``replay_step_request``), and what a hop pushes to the next
(``next_hop_request``, ``boundary_step_request``: boundary rows in the session's wire dtype,
declaring the schema they follow).

Tensors stay bytes: ``tobytes`` out (``agent.core.wire.boundary.encode_rows``); no per-element
Python.

Pure: numpy and protobuf records. Must not import trio, grpc, libp2p, sockets, clocks or
agent.io.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import cast

import numpy as np

from agent._proto import swarm_pb2
from agent.core.wire.boundary import BoundaryError, BoundarySchema, WireDType, encode_rows
from agent.core.wire.step_validation import StepInput
from agent.core.wire.swarm_wire import SCHEMA_VERSION, crc32

__all__ = [
    "boundary_step_request",
    "encode_step_output",
    "first_step_request",
    "next_hop_request",
    "replay_step_request",
]

_I32 = np.dtype("<i4")
_F32_CODE = int(WireDType.F32)


@dataclasses.dataclass(frozen=True)
class ReplayChunk:
    """Rows ``[first_position, first_position + n_rows)`` of one session, as sent."""

    first_position: int
    n_rows: int
    data: bytes
    dtype: int
    schema_version: int
    streams: int


def first_step_request(
    *,
    session_id: bytes,
    step: int,
    hops: Sequence[swarm_pb2.Hop],
    token_ids: Sequence[int] | np.ndarray,
    first_position: int,
    recipe_hash: str,
    model_sha256: str,
    owner_peer_id: str,
    owner_addrs: Sequence[str],
    sender_admission: swarm_pb2.SignedAdmission,
    result_top_k: int = 0,
    resume_step: int = 0,
    wire_dtype: int = _F32_CODE,
) -> swarm_pb2.StepRequest:
    """The ``StepRequest`` a session owner sends to ``hops[0]`` (token ids at consecutive
    positions from ``first_position``); ``result_top_k``, ``resume_step`` (a rebuild step,
    numbered ``step == resume_step``): see ``StepRequest``; ``wire_dtype``: the dtype the
    session's boundary rows travel in between its hops (``StepRequest.dtype``)."""
    ids = np.asarray(token_ids, dtype=_I32)
    hop = hops[0]
    return swarm_pb2.StepRequest(
        schema_version=SCHEMA_VERSION,
        session_id=session_id,
        step=step,
        begin=hop.begin,
        end=hop.end,
        positions=range(first_position, first_position + len(ids)),
        token_ids=ids.tolist(),
        recipe_hash=recipe_hash,
        rest=list(hops[1:]),
        owner_peer_id=owner_peer_id,
        owner_addrs=list(owner_addrs),
        checksum=crc32(ids.tobytes()),
        sender_admission=sender_admission,
        model_sha256=model_sha256,
        result_top_k=result_top_k,
        resume_step=resume_step,
        dtype=cast(swarm_pb2.DType, wire_dtype if wire_dtype != _F32_CODE else 0),
    )


def replay_step_request(
    *,
    session_id: bytes,
    resume_step: int,
    hops: Sequence[swarm_pb2.Hop],
    chunk: ReplayChunk,
    n_embd: int,
    recipe_hash: str,
    model_sha256: str,
    owner_peer_id: str,
    owner_addrs: Sequence[str],
    sender_admission: swarm_pb2.SignedAdmission,
) -> swarm_pb2.StepRequest:
    """A rebuild ``StepRequest`` for ``hops[0]`` carrying kept rows (``chunk``) as they were
    first sent (``agent.core.node.kept_rows``)."""
    return boundary_step_request(
        session_id=session_id,
        step=resume_step,
        hops=hops,
        data=chunk.data,
        positions=range(chunk.first_position, chunk.first_position + chunk.n_rows),
        dtype=chunk.dtype,
        schema=BoundarySchema.declared(chunk.schema_version, chunk.streams, n_embd),
        recipe_hash=recipe_hash,
        model_sha256=model_sha256,
        owner_peer_id=owner_peer_id,
        owner_addrs=owner_addrs,
        sender_admission=sender_admission,
        resume_step=resume_step,
    )


def encode_step_output(step: StepInput, rows: np.ndarray, wire_bytes: bytes | None = None) -> tuple[bytes, int]:
    """``(bytes, dtype)`` of this range's output ``rows`` for ``step`` as they go on the wire:
    in the session's wire dtype (``step.dtype``: the one its rows arrived in, or the one a token
    step asked for), following ``step.schema``.
    ``wire_bytes``: the F32 bytes ``rows`` view, already checked finite (as the worker sent
    them, ``SeqOutput.boundary_bytes``): an F32 step sends them as they are.

    Raises:
      BoundaryError: rows of the wrong shape, non-finite, or out of float16 range.
    """
    dtype = step.dtype
    data = encode_rows(rows, step.schema.row_values, dtype, checked_bytes=wire_bytes)
    if rows.shape[0] != step.n_rows:
        raise BoundaryError(f"{rows.shape[0]} output rows for a step of {step.n_rows} rows")
    return data, dtype


def next_hop_request(
    step: StepInput,
    rows: np.ndarray,
    sender_admission: swarm_pb2.SignedAdmission,
    *,
    encoded: tuple[bytes, int] | None = None,
) -> swarm_pb2.StepRequest:
    """The ``StepRequest`` for ``step.rest[0]``: this range's output ``rows`` (float32
    ``[n_rows, streams * n_embd]`` of ``step.schema``) in the session's wire dtype
    (``encode_step_output``), declaring that schema; ``encoded``: those rows already encoded
    (``encode_step_output``), sent as they are.

    Raises:
      BoundaryError: rows of the wrong shape, non-finite, or out of float16 range.
    """
    data, dtype = encoded if encoded is not None else encode_step_output(step, rows)
    return boundary_step_request(
        session_id=step.session_id,
        step=step.step,
        hops=step.rest,
        data=data,
        positions=step.positions,
        dtype=dtype,
        schema=step.schema,
        recipe_hash=step.recipe_hash,
        model_sha256=step.model_sha256,
        owner_peer_id=step.owner_peer_id,
        owner_addrs=step.owner_addrs,
        sender_admission=sender_admission,
        result_top_k=step.result_top_k,
        resume_step=step.resume_step,
    )


def boundary_step_request(
    *,
    session_id: bytes,
    step: int,
    hops: Sequence[swarm_pb2.Hop],
    positions: Sequence[int] | np.ndarray,
    dtype: int,
    schema: BoundarySchema,
    recipe_hash: str,
    model_sha256: str,
    owner_peer_id: str,
    owner_addrs: Sequence[str],
    sender_admission: swarm_pb2.SignedAdmission,
    rows: np.ndarray | None = None,
    data: bytes | None = None,
    result_top_k: int = 0,
    resume_step: int = 0,
) -> swarm_pb2.StepRequest:
    """The ``StepRequest`` that hands boundary ``rows`` (float32 ``[n_rows,
    schema.row_values]``, or ``data``: those rows already encoded in ``dtype``) to
    ``hops[0]``, in ``dtype``, declaring ``schema``: what a hop pushes to the next
    (``next_hop_request``) and the tracker's verifier sends to a range it checks
    (``agent.io.tracker.verifier``).

    Raises:
      BoundaryError: rows of the wrong shape, non-finite, or out of float16 range.
    """
    hop = hops[0]
    if data is None:
        assert rows is not None, "boundary_step_request needs rows or data"
        data = encode_rows(rows, schema.row_values, dtype)
    return swarm_pb2.StepRequest(
        schema_version=SCHEMA_VERSION,
        session_id=session_id,
        step=step,
        begin=hop.begin,
        end=hop.end,
        positions=np.asarray(positions, dtype=np.int32).tolist(),
        boundary=data,
        dtype=cast(swarm_pb2.DType, dtype),
        n_embd=schema.n_embd,
        recipe_hash=recipe_hash,
        rest=list(hops[1:]),
        owner_peer_id=owner_peer_id,
        owner_addrs=list(owner_addrs),
        checksum=crc32(data),
        sender_admission=sender_admission,
        model_sha256=model_sha256,
        result_top_k=result_top_k,
        boundary_schema_version=schema.version,
        boundary_streams=schema.streams,
        resume_step=resume_step,
    )
