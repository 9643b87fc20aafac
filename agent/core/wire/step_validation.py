"""Step validation: what one served range takes (``RangeSpec``), a validated step
(``StepInput``), and the check of a ``StepRequest`` against the range it is addressed to
(``validate_step``: recipe, range, session id, owner, the hops after the receiver
(``check_hops``), row count and batch limit, positions, checksum, payload kind, boundary
schema, dtype, width, byte length, finite values, token ids).

Every step of every hop passes here, so the checks read each field once and build nothing the
common case does not return. Tensors stay bytes: ``np.frombuffer`` in
(``agent.core.wire.boundary.decode_rows``); no per-element Python.

Pure: numpy and protobuf records. Must not import trio, grpc, libp2p, sockets, clocks or
agent.io.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from agent._proto import swarm_pb2
from agent.core.wire.boundary import (
    RESIDUAL,
    WIRE_ITEMSIZE,
    BoundaryError,
    BoundarySchema,
    WireDType,
    check_boundary_schema,
    decode_rows,
    wire_bytes,
)
from agent.core.wire.swarm_wire import SESSION_ID_BYTES, Code, WireError, crc32

__all__ = ["RangeSpec", "StepInput", "check_hops", "validate_step"]

_I32 = np.dtype("<i4")
# the hot path's constants, read once (an enum wrapper's attribute costs a lookup per read)
_INVALID_ARGUMENT = Code.INVALID_ARGUMENT
_RESOURCE_EXHAUSTED = Code.RESOURCE_EXHAUSTED
_F32_CODE = int(WireDType.F32)
_WIRE_DTYPES = frozenset(int(d) for d in WireDType if d != WireDType.UNSPECIFIED)


@dataclasses.dataclass(frozen=True)
class RangeSpec:
    """What one served range takes: the worker's model, blocks, widths, recipe and batch limit.

    ``boundary``: the boundary schema of the model (both edges of every range, as the worker
    reports it in InfoReply.boundary); None reads as schema 1, one stream of ``n_embd``."""

    model_sha256: str
    begin: int
    end: int
    n_layer: int
    n_embd: int
    n_vocab: int
    recipe_hash: str
    n_batch_max: int
    boundary: BoundarySchema | None = None

    @functools.cached_property
    def boundary_schema(self) -> BoundarySchema:
        return self.boundary or BoundarySchema(RESIDUAL, 1, self.n_embd)

    @property
    def takes_tokens(self) -> bool:
        return self.begin == 0

    @property
    def gives_logits(self) -> bool:
        return self.end == self.n_layer


@dataclasses.dataclass(frozen=True)
class StepInput:
    """A validated step, ready for the scheduler and the worker.

    Exactly one of ``token_ids`` (int32 ``[n_rows]``, first range) or ``rows`` (float32
    ``[n_rows, boundary_schema.row_values]``, a zero-copy view of the received bytes when they
    were F32) is set. ``dtype``: the session's wire dtype: the one its rows arrived in, or for
    token ids the one the owner asked its boundary rows to travel in (F32 when unset); the next
    hop gets this range's output rows in it. ``boundary_schema``: the schema of the model's boundary rows (what
    ``rows`` follow, and what this range's output rows follow).
    """

    session_id: bytes
    step: int
    begin: int
    end: int
    positions: np.ndarray
    token_ids: np.ndarray | None
    rows: np.ndarray | None
    dtype: int
    n_embd: int
    recipe_hash: str
    model_sha256: str
    rest: tuple[swarm_pb2.Hop, ...]
    owner_peer_id: str
    owner_addrs: tuple[str, ...]
    result_top_k: int = 0  # what the last hop returns: 0 the full row, else the top K
    boundary_schema: BoundarySchema | None = None  # None: schema 1, one stream of n_embd
    resume_step: int = 0  # non-zero: a rebuild step (StepRequest.resume_step)
    #: the received F32 bytes ``rows`` views (checked: checksum, length, finite), which go to
    #: the worker as they are; None for token ids or rows converted from F16 or Q8
    wire_rows: bytes | None = None

    @property
    def rebuild(self) -> bool:
        return self.resume_step > 0

    @property
    def end_position(self) -> int:
        return int(self.positions[-1]) + 1

    @property
    def schema(self) -> BoundarySchema:
        return self.boundary_schema or BoundarySchema(RESIDUAL, 1, self.n_embd)

    @property
    def n_rows(self) -> int:
        return int(self.positions.shape[0])

    @property
    def first_position(self) -> int:
        return int(self.positions[0])


def check_hops(
    hops: Sequence[swarm_pb2.Hop], begin: int, n_layer: int, what: str = "rest", *, partial: bool = False
) -> None:
    """Hops must chain exactly from ``begin`` to ``n_layer``: each hop starts where the one
    before ends, and names a peer. ``partial``: the chain may end before ``n_layer`` (the
    rebuilt part of a route).

    Raises:
      WireError: INVALID_ARGUMENT naming the first hop that breaks the chain.
    """
    at = begin
    for i, hop in enumerate(hops):
        if not hop.peer_id:
            raise WireError(Code.INVALID_ARGUMENT, f"{what}[{i}] names no peer")
        if hop.begin != at or hop.end <= hop.begin:
            raise WireError(
                Code.INVALID_ARGUMENT,
                f"{what}[{i}] covers blocks [{hop.begin}, {hop.end}), expected a non-empty range starting at {at}",
            )
        at = hop.end
    if at > n_layer or (at != n_layer and not partial):
        raise WireError(
            Code.INVALID_ARGUMENT,
            f"{what} ends at block {at}, but the model has {n_layer} blocks (nobody runs [{at}, {n_layer}))",
        )


def validate_step(request: swarm_pb2.StepRequest, spec: RangeSpec) -> StepInput:
    """Check a ``StepRequest`` (schema version already checked) against the range ``spec``
    it is addressed to, and decode its rows.

    Does not check the sender's admission, whether the session is known, or whether its
    positions continue it: those need the node's state (``agent.core.node.sessions``).

    Every step of every hop passes here: each field is read once, and the common case
    builds nothing it does not return.

    Raises:
      WireError: INVALID_ARGUMENT for a rule the request breaks, RESOURCE_EXHAUSTED for more
        rows than the worker takes in one batch; the message says what was wrong.
    """
    bad = _INVALID_ARGUMENT
    if request.model_sha256 != spec.model_sha256:
        raise WireError(
            bad, f"model_sha256 {request.model_sha256!r} is not the model of this range ({spec.model_sha256})"
        )
    begin, end = request.begin, request.end
    if begin != spec.begin or end != spec.end:
        raise WireError(bad, f"the step is for blocks [{begin}, {end}), this range is [{spec.begin}, {spec.end})")
    if request.recipe_hash != spec.recipe_hash:
        raise WireError(
            bad, f"recipe_hash {request.recipe_hash!r} does not match this node's recipe {spec.recipe_hash!r}"
        )
    session_id = request.session_id
    if len(session_id) != SESSION_ID_BYTES:
        raise WireError(bad, f"session_id has {len(session_id)} bytes, expected {SESSION_ID_BYTES}")
    owner_peer_id = request.owner_peer_id
    if not owner_peer_id:
        raise WireError(bad, "owner_peer_id is empty: nobody to send the result to")
    step_number, resume_step = request.step, request.resume_step
    rebuild = resume_step > 0
    if rebuild and step_number != resume_step:
        raise WireError(bad, f"a rebuild step is numbered resume_step ({resume_step}), got step {step_number}")
    rest = tuple(request.rest)
    check_hops(rest, spec.end, spec.n_layer, partial=rebuild)

    n_rows = len(request.positions)
    if n_rows == 0:
        raise WireError(bad, "the step has no rows (positions is empty)")
    if n_rows > spec.n_batch_max:
        raise WireError(
            _RESOURCE_EXHAUSTED, f"{n_rows} rows exceed this range's batch limit of {spec.n_batch_max} rows"
        )
    positions = np.array(request.positions, dtype=_I32)
    first = int(positions[0])
    if first < 0 or (n_rows > 1 and not np.array_equal(positions, np.arange(first, first + n_rows, dtype=_I32))):
        raise WireError(bad, f"positions must be consecutive and >= 0, got {_preview(positions)}")
    if step_number == 0 and first != 0:
        raise WireError(bad, f"step 0 (prefill) must start at position 0, got {first}")

    token_ids = rows = wire_rows = None
    dtype = request.dtype or _F32_CODE
    schema = spec.boundary_schema
    boundary = request.boundary
    if dtype not in _WIRE_DTYPES:
        try:
            wire_bytes(dtype, 0, 1)  # raises, naming the dtypes there are
        except BoundaryError as err:
            raise WireError(bad, f"dtype: {err}") from None
    if spec.takes_tokens:
        if boundary:
            raise WireError(
                bad, f"blocks [{spec.begin}, {spec.end}) take token ids, but the step carries boundary bytes"
            )
        if len(request.token_ids) != n_rows:
            raise WireError(bad, f"{len(request.token_ids)} token ids but {n_rows} positions")
        token_ids = np.array(request.token_ids, dtype=_I32)
        if request.checksum != crc32(token_ids.tobytes()):
            raise WireError(bad, f"checksum {request.checksum:#010x} does not match the token ids")
        if token_ids.min() < 0 or token_ids.max() >= spec.n_vocab:
            raise WireError(bad, f"token ids must be in [0, {spec.n_vocab}), got {_preview(token_ids)}")
    else:
        if len(request.token_ids):
            raise WireError(
                bad, f"blocks [{spec.begin}, {spec.end}) take boundary rows, but the step carries token ids"
            )
        n_embd = request.n_embd
        if n_embd != spec.n_embd:
            raise WireError(bad, f"n_embd {n_embd} does not match this model's width {spec.n_embd}")
        version, streams = request.boundary_schema_version, request.boundary_streams
        if (version or RESIDUAL, streams or 1, n_embd) != (schema.version, schema.streams, schema.n_embd):
            try:
                check_boundary_schema(BoundarySchema.declared(version, streams, n_embd), schema)
            except BoundaryError as err:
                raise WireError(bad, f"blocks [{spec.begin}, {spec.end}): {err}") from None
        width = schema.row_values
        size = WIRE_ITEMSIZE.get(dtype)
        if size is not None:
            if len(boundary) != n_rows * width * size:
                raise WireError(
                    bad,
                    f"boundary has {len(boundary)} bytes, expected {n_rows} rows x {width} x {size} bytes"
                    f" = {n_rows * width * size} (schema {schema})",
                )
        elif len(boundary) != wire_bytes(dtype, n_rows, width):
            raise WireError(
                bad,
                f"boundary has {len(boundary)} bytes, expected {wire_bytes(dtype, n_rows, width)}: {n_rows}"
                f" {WireDType(dtype).name} rows of {width} values (schema {schema})",
            )
        if request.checksum != crc32(boundary):
            raise WireError(bad, f"checksum {request.checksum:#010x} does not match the boundary bytes")
        try:
            rows = decode_rows(boundary, n_rows, width, dtype)
        except BoundaryError as err:
            raise WireError(bad, f"boundary: {err}") from None
        if dtype == _F32_CODE:
            wire_rows = boundary
    return StepInput(
        session_id=session_id,
        step=step_number,
        begin=spec.begin,
        end=spec.end,
        positions=positions,
        token_ids=token_ids,
        rows=rows,
        dtype=dtype,
        n_embd=spec.n_embd,
        recipe_hash=spec.recipe_hash,
        model_sha256=spec.model_sha256,
        rest=rest,
        owner_peer_id=owner_peer_id,
        owner_addrs=tuple(request.owner_addrs),
        result_top_k=min(request.result_top_k, spec.n_vocab),
        boundary_schema=schema,
        resume_step=resume_step,
        wire_rows=wire_rows,
    )


def _preview(values: np.ndarray, limit: int = 8) -> str:
    shown = ", ".join(str(int(v)) for v in values[:limit])
    return f"[{shown}{', ...' if len(values) > limit else ''}] ({len(values)} values)"
