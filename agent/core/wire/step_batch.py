"""Step batches: the ``StepBatch`` a hop pushes on ``/baton/steps`` (a Forward's steps for one
next hop) and its ``StepBatchAck``, and the choice between one step on ``/baton/step`` and a
batch (``push_message``, ``read_push_acks``).

Owns the batch limit's use (``MAX_BATCH_STEPS`` is a protocol constant of
``agent.core.wire.swarm_wire``) and the byte-for-byte "all taken" acks a hop's path compares
instead of parsing.

Pure: protobuf records. Must not import trio, grpc, libp2p, sockets, clocks or agent.io.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from agent._proto import swarm_pb2
from agent.core.wire.swarm_wire import (
    MAX_BATCH_STEPS,
    SCHEMA_VERSION,
    STEP_PROTOCOL,
    STEPS_PROTOCOL,
    Code,
    WireError,
    parse_record,
    step_ack,
)

__all__ = [
    "all_steps_taken",
    "answer_step_batch",
    "batch_ack_accepts",
    "push_message",
    "read_push_acks",
    "read_step_batch",
    "read_step_batch_ack",
    "step_batch",
    "step_batch_ack",
]

#: ``step_ack()``, byte for byte (protobuf's serialization of it is deterministic)
_STEP_TAKEN = step_ack()


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
