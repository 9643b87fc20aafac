"""Swarm wire basics: protocol ids, schema version, checksums, parsing, and the error
replies of the swarm's records (``protocol/swarm.proto``).

Owns:
- the libp2p protocol ids, ``MAX_BATCH_STEPS`` and ``SCHEMA_VERSION`` (every top-level record
  carries it), and how big a request each protocol takes (``request_limits``);
- checksums: ``zlib.crc32`` of the token ids as little-endian int32 bytes, of boundary bytes,
  of logits bytes;
- parsing bytes from the network into records (``parse_record``), the schema-version rule,
  and ``WireError`` (a record breaks a rule: its code and message become the reply's
  ``Error``);
- the acks and error replies (``StepAck`` / ``NodeReply`` / ``TrackerReply`` with ``Error``).

The records built on these live beside it: ``agent.core.wire.step_batch`` (``StepBatch`` and its
acks), ``agent.core.wire.step_validation`` (``RangeSpec``, ``StepInput``, ``validate_step``),
``agent.core.wire.step_requests`` (the ``StepRequest``s an owner and a hop send),
``agent.core.wire.step_results`` (the owner's ``StepResult``).

Pure: numpy, zlib and protobuf records. Must not import trio, grpc, libp2p, sockets, clocks or
agent.io, nor the step modules above (they import this one).
"""

from __future__ import annotations

import enum
import unicodedata
import zlib
from collections.abc import Sequence
from typing import Protocol, TypeVar, cast

import numpy as np
from google.protobuf.message import DecodeError

from agent._proto import swarm_pb2
from agent.core.net.request_limits import RequestLimits

__all__ = [
    "IDLE_STEP_REQUEST_BYTES",
    "MAX_ADDR_CHARS",
    "MAX_ADMISSION_REQUEST_BYTES",
    "MAX_BATCH_STEPS",
    "MAX_HEARTBEAT_PREFIX_TAGS",
    "MAX_LISTEN_ADDRS",
    "MAX_PREFIX_TAGS",
    "MAX_TRACKER_REQUEST_BYTES",
    "NODE_PROTOCOL",
    "PUNCH_PROTOCOL",
    "RESULT_PROTOCOL",
    "SCHEMA_VERSION",
    "SESSION_ID_BYTES",
    "STEPS_PROTOCOL",
    "STEP_PROTOCOL",
    "TRACKER_PROTOCOL",
    "WireError",
    "WorkerCall",
    "check_listen_addrs",
    "check_schema_version",
    "crc32",
    "error",
    "node_reply_error",
    "parse_record",
    "printable",
    "request_limits",
    "step_ack",
    "step_ack_accepts",
    "step_ack_error",
    "step_request_bytes",
    "token_bytes",
    "token_checksum",
    "tracker_reply_error",
    "worker_error_code",
]

TRACKER_PROTOCOL = "/baton/tracker/1.0.0"  # TrackerRequest -> TrackerReply
STEP_PROTOCOL = "/baton/step/1.0.0"  # StepRequest -> StepAck
STEPS_PROTOCOL = "/baton/steps/1.0.0"  # StepBatch -> StepBatchAck (a Forward's steps for one next hop)
MAX_BATCH_STEPS = 4096  # entries one StepBatch may carry (a Forward has at most n_batch_max rows)
RESULT_PROTOCOL = "/baton/result/1.0.0"  # StepResult -> StepAck
NODE_PROTOCOL = "/baton/node/1.0.0"  # NodeRequest -> NodeReply
PUNCH_PROTOCOL = "/baton/punch/1.0.0"  # PunchRequest -> PunchReply, over the circuit relay (agent.core.wire.punch)

#: The largest request a listener reads on a protocol, checked on the length prefix before a
#: byte of the body is buffered (``request_limits``). Anyone may open a stream to the tracker
#: (registration comes first), so its protocol takes what its records need (a fingerprint, a
#: heartbeat's report, a route request: kilobytes), not the 64 MiB a step's boundary rows may
#: need: ten streams of 60 MB from one unadmitted peer once took a tracker to 1.6 GB.
MAX_TRACKER_REQUEST_BYTES = 1 << 20
#: What a peer the tracker has not admitted may send it: a registration or a client hello.
MAX_ADMISSION_REQUEST_BYTES = 64 << 10
MAX_PUNCH_REQUEST_BYTES = 64 << 10
#: A node request carries no rows; the biggest is a tokenize request's text (a long prompt).
MAX_NODE_REQUEST_BYTES = 8 << 20
#: ... and from a peer whose admission the node has not seen yet (a client's first tokenize).
MAX_UNADMITTED_NODE_REQUEST_BYTES = 1 << 20
#: A step's fields beside its rows (the hops after the receiver and their addresses, the
#: owner's addresses, the admission), and a StepBatch's per-entry share of them.
STEP_FIELDS_BYTES = 64 << 10
BATCH_ENTRY_FIELDS_BYTES = 4 << 10
#: Rows a step limit allows for at least: a StepBatch holds the steps of the sender's Forward,
#: whose batch may be bigger than the receiver's own.
MIN_LIMIT_ROWS = 2048
#: A node's step limit while it serves no range (steps are refused then anyway).
IDLE_STEP_REQUEST_BYTES = 1 << 20


def step_request_bytes(row_values: int, n_batch_max: int) -> int:
    """The largest step (or StepBatch) a range takes: its rows at most, as f32, plus the fields
    of one step per row (a batch of one-row decode steps)."""
    rows = max(n_batch_max, MIN_LIMIT_ROWS)
    return rows * (row_values * 4 + BATCH_ENTRY_FIELDS_BYTES) + STEP_FIELDS_BYTES


def request_limits(max_frame_bytes: int, *, step_bytes: int | None = None) -> RequestLimits:
    """The request limits of a listener whose frames are at most ``max_frame_bytes``.

    ``step_bytes``: the largest step and StepBatch taken (a node: ``step_request_bytes`` of the
    ranges it serves, ``IDLE_STEP_REQUEST_BYTES`` before it serves one); None: the frame limit.
    A peer that is not admitted may send admission-sized requests to the tracker, a small node
    request, and steps up to the step limit (a hop's first step carries rows, and a node learns
    a peer's admission from inside its requests), at most two steps' bytes at once."""
    step = min(max_frame_bytes, step_bytes) if step_bytes is not None else max_frame_bytes
    return RequestLimits(
        default_bytes=max_frame_bytes,
        protocol_bytes={
            TRACKER_PROTOCOL: MAX_TRACKER_REQUEST_BYTES,
            PUNCH_PROTOCOL: MAX_PUNCH_REQUEST_BYTES,
            NODE_PROTOCOL: MAX_NODE_REQUEST_BYTES,
            STEP_PROTOCOL: step,
            STEPS_PROTOCOL: step,
        },
        unadmitted_bytes={
            TRACKER_PROTOCOL: MAX_ADMISSION_REQUEST_BYTES,
            NODE_PROTOCOL: MAX_UNADMITTED_NODE_REQUEST_BYTES,
        },
        unadmitted_peer_in_flight_bytes=min(max_frame_bytes, 2 * step) if step_bytes is not None else 256 << 10,
    )


def printable(text: str, max_chars: int) -> str:
    """``text`` a peer sent, made safe to show in a terminal or a log line: every control,
    format or unassigned character (ANSI escapes, newlines that forge log lines, bidi overrides)
    written as its escape (``\\x1b``, ``\\n``, ``\\u202e``), and at most ``max_chars`` kept."""
    out = []
    for ch in text[:max_chars]:
        out.append(ch.encode("unicode_escape").decode("ascii") if unicodedata.category(ch)[0] == "C" else ch)
    return "".join(out) + ("…" if len(text) > max_chars else "")


#: addresses one peer may advertise, and the length of one
MAX_LISTEN_ADDRS = 16
#: prefix tags a heartbeat may name for one range (``RangePrefixes``; 8 bytes each), and for
#: all its ranges together (a node cuts its report to fit: a heartbeat stays far below
#: ``MAX_TRACKER_REQUEST_BYTES``)
MAX_PREFIX_TAGS = 4096
MAX_HEARTBEAT_PREFIX_TAGS = 16384
MAX_ADDR_CHARS = 512


def check_listen_addrs(addrs: Sequence[str]) -> None:
    """Refuse (WireError INVALID_ARGUMENT) addresses no peer could dial and a terminal should not
    show: more than ``MAX_LISTEN_ADDRS``, longer than ``MAX_ADDR_CHARS``, or not printable
    ASCII multiaddr text."""
    if len(addrs) > MAX_LISTEN_ADDRS:
        raise WireError(Code.INVALID_ARGUMENT, f"listen_addrs lists {len(addrs)} addresses, over {MAX_LISTEN_ADDRS}")
    for i, addr in enumerate(addrs):
        if not addr.startswith("/") or len(addr) > MAX_ADDR_CHARS or not (addr.isascii() and addr.isprintable()):
            raise WireError(
                Code.INVALID_ARGUMENT,
                f"listen_addrs[{i}] {printable(addr, 80)!r} is not a multiaddr of at most {MAX_ADDR_CHARS} characters",
            )


#: The swarm schema version this code speaks (every top-level record carries it).
SCHEMA_VERSION = 1
#: A session id has exactly this many owner-chosen random bytes.
SESSION_ID_BYTES = 16

_I32 = np.dtype("<i4")

Code = swarm_pb2.Error.Code


class _Record(Protocol):
    """What ``parse_record`` needs of a message type: every wire record carries its schema version."""

    schema_version: int

    def ParseFromString(self, serialized: bytes, /) -> int: ...


M = TypeVar("M", bound=_Record)


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


def node_reply_error(code: int, message: str) -> bytes:
    return swarm_pb2.NodeReply(schema_version=SCHEMA_VERSION, error=error(code, message)).SerializeToString()


def tracker_reply_error(code: int, message: str, *, work_bits: int = 0) -> bytes:
    reply = swarm_pb2.TrackerReply(schema_version=SCHEMA_VERSION, error=error(code, message))
    reply.error.work_bits = work_bits
    return reply.SerializeToString()


class WorkerCall(enum.Enum):
    """What kind of worker call failed: whose fault its failure can be decides the swarm code
    (``worker_error_code``)."""

    #: a step's compute (a Forward, a data-plane step): the worker's own code where the swarm
    #: has it (RESOURCE_EXHAUSTED: no room; UNAVAILABLE; INVALID_ARGUMENT: the step), else INTERNAL
    COMPUTE = "compute"
    #: an owner's request the worker checks (a data-plane bind, a continuation): the request
    #: does not fit the worker's state (INVALID_ARGUMENT, FAILED_PRECONDITION), or the worker
    #: cannot take it now (anything else: UNAVAILABLE)
    OWNER_REQUEST = "owner_request"
    #: the node's own bookkeeping (unbind, trim, tokenize, ...): the worker cannot be asked
    CONTROL = "control"


#: worker (gRPC) status names a step's failure passes on as the swarm code of the same name
_PASSED_ON_CODES = ("RESOURCE_EXHAUSTED", "UNAVAILABLE", "INVALID_ARGUMENT")
#: worker (gRPC) status names that mean an owner's request does not fit the worker's state
_REQUEST_REFUSED_CODES = ("INVALID_ARGUMENT", "FAILED_PRECONDITION")


def worker_error_code(code_name: str, call: WorkerCall = WorkerCall.COMPUTE) -> int:
    """The swarm error code for a failed worker ``call`` whose gRPC status is ``code_name``
    ("" when unknown, e.g. a reply that did not decode). The one place a worker's failure
    becomes a swarm code: every node path and the owner's data plane ask it."""
    if call is WorkerCall.CONTROL:
        return Code.UNAVAILABLE
    if call is WorkerCall.OWNER_REQUEST:
        return Code.INVALID_ARGUMENT if code_name in _REQUEST_REFUSED_CODES else Code.UNAVAILABLE
    return Code.Value(code_name) if code_name in _PASSED_ON_CODES else Code.INTERNAL
