"""Step results: the ``StepResult`` the last hop sends the session owner (the f32 logits of
the last row, or its top K with the row's log-sum-exp), the error and rebuilt results, and
reading the scores a result carries (``result_scores``, ``validate_step_result``).

Tensors stay bytes: ``np.frombuffer`` in, ``tobytes`` out; no per-element Python.

Pure: numpy and protobuf records. Must not import trio, grpc, libp2p, sockets, clocks or
agent.io.
"""

from __future__ import annotations

import numpy as np

from agent._proto import swarm_pb2
from agent.core.wire.boundary import BoundaryError, WireDType, decode_rows
from agent.core.wire.swarm_wire import SCHEMA_VERSION, Code, WireError, crc32, error
from agent.core.wire.topk import TopLogits, select_top_k

__all__ = [
    "result_scores",
    "step_result",
    "step_result_error",
    "step_result_rebuilt",
    "step_result_top",
    "validate_step_result",
]

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")


def step_result(
    session_id: bytes,
    step: int,
    logits: np.ndarray,
    sender_admission: swarm_pb2.SignedAdmission,
    top_k: int = 0,
) -> swarm_pb2.StepResult:
    """The owner's ``StepResult`` for one float32 row ``[n_vocab]``: the row as f32 bytes
    (``top_k`` 0, or K covering the row), or its top ``top_k`` ids and logits with the row's
    log-sum-exp (``agent.core.wire.topk.select_top_k``)."""
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
