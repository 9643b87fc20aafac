"""Swarm wire codecs: protocol ids, schema version, checksums, and the step / result / node
records a node takes and gives (``protocol/swarm.proto``).

Owns:
- the four libp2p protocol ids and ``SCHEMA_VERSION`` (every top-level record carries it);
- checksums: ``zlib.crc32`` of the token ids as little-endian int32 bytes, of boundary bytes,
  of logits bytes;
- parsing bytes from the network into records (``parse_record``), the schema-version rule, and
  the validation of a ``StepRequest`` against the range a node serves (``validate_step``:
  recipe, range, session id, owner, the hops after the receiver, row count and batch limit,
  positions, checksum, payload kind, boundary schema, dtype, width, byte length, finite values,
  token ids);
- building what a node sends on: the next hop's ``StepRequest`` (boundary rows in the dtype the
  step arrived in, with the schema they follow), the owner's ``StepResult`` (f32 logits of the last row), and the error
  replies (``StepAck`` / ``StepResult`` / ``NodeReply`` / ``TrackerReply`` with ``Error``).

Tensors stay bytes end to end: ``np.frombuffer`` in (``agent.core.boundary.decode_rows``),
``tobytes`` out; no per-element Python.

Pure: numpy, zlib and protobuf records. Must not import trio, grpc, libp2p, sockets, clocks or
agent.io.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar, cast

import numpy as np
from google.protobuf.message import DecodeError

from agent._proto import swarm_pb2

from .boundary import (
    RESIDUAL,
    WIRE_ITEMSIZE,
    BoundaryError,
    BoundarySchema,
    WireDType,
    check_boundary_schema,
    decode_rows,
    encode_rows,
    itemsize,
)
from .kept_rows import ReplayChunk
from .multiaddrs import circuit_multiaddr, peer_id_from_multiaddr  # re-exported: callers import them here
from .topk import TopLogits, select_top_k

__all__ = [
    "MAX_BATCH_STEPS",
    "NODE_PROTOCOL",
    "RESULT_PROTOCOL",
    "SCHEMA_VERSION",
    "SESSION_ID_BYTES",
    "STEPS_PROTOCOL",
    "STEP_PROTOCOL",
    "TRACKER_PROTOCOL",
    "RangeSpec",
    "StepInput",
    "WireError",
    "all_steps_taken",
    "answer_step_batch",
    "batch_ack_accepts",
    "boundary_step_request",
    "check_hops",
    "check_schema_version",
    "circuit_multiaddr",
    "crc32",
    "encode_step_output",
    "error",
    "first_step_request",
    "next_hop_request",
    "node_reply_error",
    "parse_record",
    "peer_id_from_multiaddr",
    "push_message",
    "read_push_acks",
    "read_step_batch",
    "read_step_batch_ack",
    "replay_step_request",
    "result_scores",
    "step_ack",
    "step_ack_accepts",
    "step_ack_error",
    "step_batch",
    "step_batch_ack",
    "step_result",
    "step_result_error",
    "step_result_rebuilt",
    "step_result_top",
    "token_bytes",
    "token_checksum",
    "tracker_reply_error",
    "validate_step",
    "validate_step_result",
]

TRACKER_PROTOCOL = "/baton/tracker/1.0.0"  # TrackerRequest -> TrackerReply
STEP_PROTOCOL = "/baton/step/1.0.0"  # StepRequest -> StepAck
STEPS_PROTOCOL = "/baton/steps/1.0.0"  # StepBatch -> StepBatchAck (a Forward's steps for one next hop)
MAX_BATCH_STEPS = 4096  # entries one StepBatch may carry (a Forward has at most n_batch_max rows)
RESULT_PROTOCOL = "/baton/result/1.0.0"  # StepResult -> StepAck
NODE_PROTOCOL = "/baton/node/1.0.0"  # NodeRequest -> NodeReply

#: The swarm schema version this code speaks (every top-level record carries it).
SCHEMA_VERSION = 1
#: A session id has exactly this many owner-chosen random bytes.
SESSION_ID_BYTES = 16

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")

Code = swarm_pb2.Error.Code


class _Record(Protocol):
    """What ``parse_record`` needs of a message type: every wire record carries its schema version."""

    schema_version: int

    def ParseFromString(self, serialized: bytes, /) -> int: ...


M = TypeVar("M", bound=_Record)
# the hot path's constants, read once (an enum wrapper's attribute costs a lookup per read)
_INVALID_ARGUMENT = Code.INVALID_ARGUMENT
_RESOURCE_EXHAUSTED = Code.RESOURCE_EXHAUSTED
_F32_CODE = int(WireDType.F32)


class WireError(Exception):
    """A record from the network breaks a rule; ``code`` (``swarm_pb2.Error.Code``) and
    ``message`` become the ``Error`` of the reply. The message names what was wrong."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = int(code)
        self.message = message

    def to_error(self) -> swarm_pb2.Error:
        # the casts in this module: protoc's .pyi takes only named values for an enum field, but
        # proto3 enums are open (any int is one)
        return swarm_pb2.Error(code=cast(Code, self.code), message=self.message)

    def __str__(self) -> str:
        return f"{_code_name(self.code)}: {self.message}"


def _code_name(code: int) -> str:
    try:
        return swarm_pb2.Error.Code.Name(code)
    except ValueError:
        return str(code)


# --- checksums -----------------------------------------------------------------------------


def crc32(data: bytes) -> int:
    """``zlib.crc32`` as an unsigned 32-bit value (the ``fixed32 checksum`` fields)."""
    return zlib.crc32(data) & 0xFFFFFFFF


def token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian int32 bytes (what their checksum covers)."""
    return np.asarray(token_ids, dtype=_I32).tobytes()


def token_checksum(token_ids: Sequence[int] | np.ndarray) -> int:
    return crc32(token_bytes(token_ids))


# --- parsing and errors --------------------------------------------------------------------


def parse_record(message_type: type[M], data: bytes) -> M:
    """Parse ``data`` as ``message_type`` and check its ``schema_version``.

    Raises:
      WireError: INVALID_ARGUMENT "malformed <Type>: ..." or "schema_version N is not
        supported (this peer speaks 1)".
    """
    record = message_type()
    try:
        record.ParseFromString(bytes(data))
    except DecodeError as err:
        raise WireError(Code.INVALID_ARGUMENT, f"malformed {message_type.__name__}: {err}") from None
    check_schema_version(record.schema_version)
    return record


def check_schema_version(version: int) -> None:
    if version != SCHEMA_VERSION:
        raise WireError(
            Code.INVALID_ARGUMENT, f"schema_version {version} is not supported (this peer speaks {SCHEMA_VERSION})"
        )


def error(code: int, message: str) -> swarm_pb2.Error:
    return swarm_pb2.Error(code=cast(Code, code), message=message)


def step_ack(err: swarm_pb2.Error | WireError | None = None) -> bytes:
    """A serialized ``StepAck``: no error (accepted) or ``err``."""
    ack = swarm_pb2.StepAck(schema_version=SCHEMA_VERSION)
    if err is not None:
        ack.error.CopyFrom(err.to_error() if isinstance(err, WireError) else err)
    return ack.SerializeToString()


def step_ack_error(code: int, message: str) -> bytes:
    return step_ack(error(code, message))


#: ``step_ack()``, byte for byte (protobuf's serialization of it is deterministic)
_STEP_TAKEN = step_ack()


def step_ack_accepts(reply: bytes) -> bool:
    """Whether ``reply`` is the plain accepting ``StepAck`` (``step_ack()``): all it says is
    "taken" (``ImmediateHandler.is_acceptance`` of the step and result handlers)."""
    return reply == _STEP_TAKEN


@functools.lru_cache(maxsize=64)
def _batch_taken(n_steps: int) -> bytes:
    """``step_batch_ack`` of ``n_steps`` accepting acks, byte for byte."""
    taken = swarm_pb2.StepAck.FromString(_STEP_TAKEN)
    return swarm_pb2.StepBatchAck(schema_version=SCHEMA_VERSION, acks=[taken] * n_steps).SerializeToString()


_BATCH_HEAD_BYTES = len(_batch_taken(0))  # the schema_version field
_BATCH_ACK_BYTES = len(_batch_taken(1)) - _BATCH_HEAD_BYTES  # each accepting ack


def batch_ack_accepts(reply: bytes) -> bool:
    """Whether ``reply`` is the ``StepBatchAck`` that ``step_batch_ack`` makes when it takes
    every step of a batch (1..MAX_BATCH_STEPS), byte for byte: nothing to parse on a hop's
    path (any other reply, even one that reads as taking them all, is just sent)."""
    n_steps, rest = divmod(len(reply) - _BATCH_HEAD_BYTES, _BATCH_ACK_BYTES)
    return not rest and 0 < n_steps <= MAX_BATCH_STEPS and reply == _batch_taken(n_steps)


def step_batch(steps: Sequence[bytes]) -> bytes:
    """A serialized ``StepBatch`` of serialized ``StepRequest``s (one next hop's, in order)."""
    return swarm_pb2.StepBatch(schema_version=SCHEMA_VERSION, steps=list(steps)).SerializeToString()


def read_step_batch(data: bytes) -> list[swarm_pb2.StepRequest | WireError]:
    """The steps of a ``StepBatch``, each parsed (``parse_record``) or the error that entry
    gets on its own (the others are still answered).

    Raises:
      WireError: INVALID_ARGUMENT, refusing the whole batch: malformed, another
        schema_version, no steps or more than ``MAX_BATCH_STEPS``, or entries carrying
        different sender admissions (a batch comes from one sender: one admission to verify,
        not one per entry).
    """
    batch = parse_record(swarm_pb2.StepBatch, data)
    if not 0 < len(batch.steps) <= MAX_BATCH_STEPS:
        raise WireError(Code.INVALID_ARGUMENT, f"a StepBatch holds 1..{MAX_BATCH_STEPS} steps, got {len(batch.steps)}")
    steps: list[swarm_pb2.StepRequest | WireError] = []
    for entry in batch.steps:
        try:
            steps.append(parse_record(swarm_pb2.StepRequest, entry))
        except WireError as err:
            steps.append(err)
    admissions = {s.sender_admission.SerializeToString() for s in steps if not isinstance(s, WireError)}
    if len(admissions) > 1:
        raise WireError(Code.INVALID_ARGUMENT, "the steps of a StepBatch carry different sender admissions")
    return steps


def answer_step_batch(data: bytes, answer: Callable[[swarm_pb2.StepRequest], bytes]) -> bytes:
    """The serialized ``StepBatchAck`` for a serialized ``StepBatch``: ``answer(step)`` (its
    serialized ``StepAck``) for each entry that parses, in order, and the entry's own error
    ack for one that does not; one error ack when the batch as a whole is refused
    (``read_step_batch``). How a node answers ``/baton/steps``, and so a canary persona too."""
    try:
        steps = read_step_batch(data)
    except WireError as err:
        return step_batch_ack([step_ack(err)])
    return step_batch_ack([step_ack(s) if isinstance(s, WireError) else answer(s) for s in steps])


def step_batch_ack(acks: Sequence[bytes]) -> bytes:
    """A serialized ``StepBatchAck`` of serialized ``StepAck``s (``step_ack``), one per step."""
    if all(ack == _STEP_TAKEN for ack in acks):  # every step taken: the common case, made once
        return _batch_taken(len(acks))
    return swarm_pb2.StepBatchAck(
        schema_version=SCHEMA_VERSION, acks=[swarm_pb2.StepAck.FromString(a) for a in acks]
    ).SerializeToString()


def read_step_batch_ack(data: bytes, n_steps: int) -> list[swarm_pb2.StepAck]:
    """The ``n_steps`` acks of a ``StepBatchAck``; a single error ack refuses the whole batch
    (the hop could not read it, or is shutting down): each step gets that error.

    Raises:
      WireError: INVALID_ARGUMENT: malformed, another schema_version, or not one ack per step.
    """
    reply = parse_record(swarm_pb2.StepBatchAck, data)
    if len(reply.acks) == 1 and reply.acks[0].error.code:
        return [reply.acks[0]] * n_steps
    if len(reply.acks) != n_steps:
        raise WireError(Code.INVALID_ARGUMENT, f"{len(reply.acks)} acks for {n_steps} steps")
    return list(reply.acks)


def push_message(steps: Sequence[bytes]) -> tuple[str, bytes]:
    """``(protocol id, payload)`` carrying serialized ``StepRequest``s to their one next hop:
    one alone on ``/baton/step``, several in one ``StepBatch`` on ``/baton/steps``."""
    if len(steps) == 1:
        return STEP_PROTOCOL, steps[0]
    return STEPS_PROTOCOL, step_batch(steps)


def read_push_acks(reply: bytes, n_steps: int) -> list[swarm_pb2.StepAck]:
    """The acks of the reply to a ``push_message`` of ``n_steps`` steps, one per step.

    Raises:
      WireError: INVALID_ARGUMENT: the reply does not read (``read_step_batch_ack``).
    """
    if n_steps == 1:
        return [parse_record(swarm_pb2.StepAck, reply)]
    return read_step_batch_ack(reply, n_steps)


def all_steps_taken(reply: bytes, n_steps: int) -> bool:
    """Whether the reply to a ``push_message`` of ``n_steps`` steps reads and takes them all."""
    try:
        return not any(ack.error.code for ack in read_push_acks(reply, n_steps))
    except WireError:
        return False


def node_reply_error(code: int, message: str) -> bytes:
    return swarm_pb2.NodeReply(schema_version=SCHEMA_VERSION, error=error(code, message)).SerializeToString()


def tracker_reply_error(code: int, message: str) -> bytes:
    return swarm_pb2.TrackerReply(schema_version=SCHEMA_VERSION, error=error(code, message)).SerializeToString()


# --- steps ---------------------------------------------------------------------------------


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
    were F32) is set. ``dtype``: the wire dtype the step arrived in; the next hop gets its rows
    in the same one. ``boundary_schema``: the schema of the model's boundary rows (what
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
    #: the worker as they are; None for token ids or rows converted from F16
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
    positions continue it: those need the node's state (``agent.core.node_sessions``).

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
        size = WIRE_ITEMSIZE.get(dtype)
        if size is None:
            try:
                size = itemsize(dtype)  # raises, naming the dtypes there are
            except BoundaryError as err:
                raise WireError(bad, f"dtype: {err}") from None
        width = schema.row_values
        if len(boundary) != n_rows * width * size:
            raise WireError(
                bad,
                f"boundary has {len(boundary)} bytes, expected {n_rows} rows x {width} x {size} bytes"
                f" = {n_rows * width * size} (schema {schema})",
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
) -> swarm_pb2.StepRequest:
    """The ``StepRequest`` a session owner sends to ``hops[0]`` (token ids at consecutive
    positions from ``first_position``); ``result_top_k``, ``resume_step`` (a rebuild step,
    numbered ``step == resume_step``): see ``StepRequest``."""
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
    first sent (``agent.core.kept_rows``)."""
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
    in the dtype the step arrived in (F32 for token input), following ``step.schema``.
    ``wire_bytes``: the F32 bytes ``rows`` view, already checked finite (as the worker sent
    them, ``SeqOutput.boundary_bytes``): an F32 step sends them as they are.

    Raises:
      BoundaryError: rows of the wrong shape, non-finite, or out of float16 range.
    """
    dtype = step.dtype if step.rows is not None else _F32_CODE
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
    ``[n_rows, streams * n_embd]`` of ``step.schema``) in the dtype the step arrived in (F32
    for token input), declaring that schema; ``encoded``: those rows already encoded
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


def step_result(
    session_id: bytes,
    step: int,
    logits: np.ndarray,
    sender_admission: swarm_pb2.SignedAdmission,
    top_k: int = 0,
) -> swarm_pb2.StepResult:
    """The owner's ``StepResult`` for one float32 row ``[n_vocab]``: the row as f32 bytes
    (``top_k`` 0, or K covering the row), or its top ``top_k`` ids and logits with the row's
    log-sum-exp (``agent.core.topk.select_top_k``)."""
    row = np.ascontiguousarray(logits, dtype=_F32).reshape(-1)
    if 0 < top_k < row.shape[0]:
        ids, top, lse = select_top_k(row, top_k)
        return step_result_top(session_id, step, TopLogits(ids, top, lse, row.shape[0]), sender_admission)
    data = row.tobytes()
    return swarm_pb2.StepResult(
        schema_version=SCHEMA_VERSION,
        session_id=session_id,
        step=step,
        logits=data,
        n_vocab=row.shape[0],
        checksum=crc32(data),
        sender_admission=sender_admission,
    )


def step_result_top(
    session_id: bytes, step: int, top: TopLogits, sender_admission: swarm_pb2.SignedAdmission
) -> swarm_pb2.StepResult:
    """The owner's ``StepResult`` from a row's top-K already selected (by the worker: the
    same ids and logits as ``select_top_k`` of the row, see ``protocol/worker.proto``)."""
    id_bytes = np.ascontiguousarray(top.ids, dtype=_I32).tobytes()
    logit_bytes = np.ascontiguousarray(top.logits, dtype=_F32).tobytes()
    return swarm_pb2.StepResult(
        schema_version=SCHEMA_VERSION,
        session_id=session_id,
        step=step,
        n_vocab=top.n_vocab,
        top_token_ids=id_bytes,
        top_logits=logit_bytes,
        log_sum_exp=top.log_sum_exp,
        checksum=crc32(id_bytes + logit_bytes),
        sender_admission=sender_admission,
    )


def step_result_error(
    session_id: bytes,
    step: int,
    code: int,
    message: str,
    failed_peer_id: str,
    sender_admission: swarm_pb2.SignedAdmission,
) -> swarm_pb2.StepResult:
    """A ``StepResult`` telling the owner that ``failed_peer_id`` could not finish the step."""
    return swarm_pb2.StepResult(
        schema_version=SCHEMA_VERSION,
        session_id=session_id,
        step=step,
        error=error(code, message),
        failed_peer_id=failed_peer_id,
        sender_admission=sender_admission,
    )


def step_result_rebuilt(
    session_id: bytes, resume_step: int, rebuilt_positions: int, sender_admission: swarm_pb2.SignedAdmission
) -> swarm_pb2.StepResult:
    """The ``StepResult`` the last hop of a rebuild sends: positions ``[0, rebuilt_positions)``
    are rebuilt (no logits)."""
    return swarm_pb2.StepResult(
        schema_version=SCHEMA_VERSION,
        session_id=session_id,
        step=resume_step,
        rebuilt_positions=rebuilt_positions,
        sender_admission=sender_admission,
    )


def result_scores(result: swarm_pb2.StepResult) -> np.ndarray | TopLogits:
    """The scores a successful ``StepResult`` carries: the full f32 row (zero-copy view, not
    checked for finite values) or a checked ``TopLogits``.

    Raises:
      ValueError: n_vocab 0, a checksum or byte length that does not match, both or neither
        of logits and top-K set, or a malformed top-K (``TopLogits.check``).
    """
    n_vocab = result.n_vocab
    if n_vocab < 1:
        raise ValueError("n_vocab is 0")
    has_top = bool(result.top_token_ids or result.top_logits)
    if has_top and result.logits:
        raise ValueError("the result carries both a logits row and top-k logits")
    if not has_top:
        data = result.logits
        if len(data) != n_vocab * _F32.itemsize:
            raise ValueError(f"{len(data)} logits bytes for n_vocab {n_vocab} (expected {n_vocab * _F32.itemsize})")
        checksum = crc32(data)
        if checksum != result.checksum:
            raise ValueError(f"logits checksum {checksum:#010x} does not match {result.checksum:#010x}")
        return np.frombuffer(data, dtype=_F32)
    id_bytes, logit_bytes = result.top_token_ids, result.top_logits
    if len(id_bytes) != len(logit_bytes) or len(id_bytes) % 4:
        raise ValueError(f"{len(id_bytes)} top-k id bytes and {len(logit_bytes)} logit bytes do not pair up")
    checksum = crc32(id_bytes + logit_bytes)
    if checksum != result.checksum:
        raise ValueError(f"top-k checksum {checksum:#010x} does not match {result.checksum:#010x}")
    top = TopLogits(
        np.frombuffer(id_bytes, dtype=_I32), np.frombuffer(logit_bytes, dtype=_F32), float(result.log_sum_exp), n_vocab
    )
    top.check()
    return top


def validate_step_result(result: swarm_pb2.StepResult, n_vocab: int | None = None) -> np.ndarray:
    """The logits row of a successful ``StepResult`` (float32 ``[n_vocab]``, zero-copy view).

    Raises:
      WireError: the result carries an error (its own code and message), or its logits do not
        match ``n_vocab`` (when given), their checksum, or their byte length.
    """
    if result.error.code:
        raise WireError(result.error.code, result.error.message)
    if n_vocab is not None and result.n_vocab != n_vocab:
        raise WireError(Code.INVALID_ARGUMENT, f"n_vocab {result.n_vocab}, expected {n_vocab}")
    if result.checksum != crc32(result.logits):
        raise WireError(Code.INVALID_ARGUMENT, f"checksum {result.checksum:#010x} does not match the logits")
    if result.n_vocab == 0:
        raise WireError(Code.INVALID_ARGUMENT, "n_vocab is 0")
    try:
        row: np.ndarray = decode_rows(result.logits, 1, result.n_vocab, WireDType.F32, check_finite=False)[0]
        return row
    except BoundaryError as err:
        raise WireError(Code.INVALID_ARGUMENT, f"logits: {err}") from None
