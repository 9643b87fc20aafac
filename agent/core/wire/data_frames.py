"""The data plane's frames (protocol/worker.proto, ``DataFrame``): sealing, framing and the
owner's side of a session.

A worker started with ``--data-listen`` takes a session's steps straight from the hop before
it on the route and sends its output straight to the next (``native/src/data_plane.h``). This
module is that wire in Python, for whoever talks to a worker's data plane: the session's owner
(which sends the first range its STEPs and takes RESULTs from the last), tests and benchmarks.

Owns:
- the seal: AES-256-GCM under a 32-byte session key, nonce = kind (u32 LE) || counter (u64 LE),
  associated data = ``b"baton-data/1"`` || kind (u32 LE) || session_id || counter (u64 LE),
  exactly as ``native/src/sealed.cpp`` (the tests open each side's frames with the other);
- a frame on the wire: a 4-byte little-endian length, then a serialized ``DataFrame``;
  ``DataFrameReader`` is the sans-I/O reader (bounded: a prefix over the limit is an error
  before anything is allocated);
- ``OwnerSession``: the owner's counters and keys for one session (STEP frames to the first
  range, an ATTACH to the last, RESULTs taken only if they open and are newer than the last).

Errors: ``DataFrameError`` says what was wrong with bytes from the network.

Pure: no sockets, trio, clocks or randomness (keys are made by the caller's ``random_bytes``).
"""

from __future__ import annotations

import dataclasses
import functools
import struct
from collections.abc import Callable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from agent._proto import worker_pb2

KEY_BYTES = 32
SESSION_ID_BYTES = 16
TAG_BYTES = 16
PREFIX_BYTES = 4
SCHEMA_VERSION = 1
AAD_LABEL = b"baton-data/1"

STEP = worker_pb2.DATA_FRAME_KIND_STEP
RESULT = worker_pb2.DATA_FRAME_KIND_RESULT
ATTACH = worker_pb2.DATA_FRAME_KIND_ATTACH
NOTICE = worker_pb2.DATA_FRAME_KIND_NOTICE
CONTINUE = worker_pb2.DATA_FRAME_KIND_CONTINUE
HELLO = worker_pb2.DATA_FRAME_KIND_HELLO  # proves a connection before frames with rows (worker to worker)

_KIND_NAMES: dict[int, str] = {
    STEP: "STEP", RESULT: "RESULT", ATTACH: "ATTACH", NOTICE: "NOTICE", CONTINUE: "CONTINUE", HELLO: "HELLO",
}  # fmt: skip


class DataFrameError(ValueError):
    """Bytes from the data plane that are not what they should be (says what and why)."""


def frame_aad(kind: int, session_id: bytes, counter: int) -> bytes:
    return AAD_LABEL + struct.pack("<I", kind) + session_id + struct.pack("<Q", counter)


def _nonce(kind: int, counter: int) -> bytes:
    return struct.pack("<IQ", kind, counter)


@functools.lru_cache(maxsize=256)  # a session's keys seal and open a frame on every step
def _cipher(key: bytes) -> AESGCM:
    return AESGCM(key)


def seal(key: bytes, kind: int, session_id: bytes, counter: int, plain: bytes) -> bytes:
    """``plain`` sealed (ciphertext || 16-byte tag) for a frame of ``kind`` and ``counter``."""
    return _cipher(key).encrypt(_nonce(kind, counter), plain, frame_aad(kind, session_id, counter))


def open_sealed(key: bytes, kind: int, session_id: bytes, counter: int, sealed: bytes) -> bytes:
    """What ``seal`` sealed. Raises DataFrameError when the key, a field or a byte differs."""
    try:
        return _cipher(key).decrypt(_nonce(kind, counter), sealed, frame_aad(kind, session_id, counter))
    except InvalidTag:
        raise DataFrameError(
            f"a {_KIND_NAMES.get(kind, kind)} frame of session {session_id.hex()} does not open under "
            "its key (a peer without the key, or changed bytes)"
        ) from None


def framed(frame: worker_pb2.DataFrame) -> bytes:
    body = frame.SerializeToString()
    return struct.pack("<I", len(body)) + body


def sealed_frame(kind: worker_pb2.DataFrameKind, key: bytes, session_id: bytes, counter: int, body: bytes) -> bytes:
    """A whole frame on the wire (prefix included) carrying ``body`` sealed."""
    return framed(
        worker_pb2.DataFrame(
            schema_version=SCHEMA_VERSION,
            kind=kind,
            session_id=session_id,
            counter=counter,
            sealed=seal(key, kind, session_id, counter, body),
        )
    )


class DataFrameReader:
    """Sans-I/O: ``feed`` bytes as they arrive, ``next_frame`` takes whole ``DataFrame``s."""

    def __init__(self, max_frame_bytes: int) -> None:
        self._max = max_frame_bytes
        self._buffer = bytearray()

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        self._buffer += data

    def next_frame(self) -> worker_pb2.DataFrame | None:
        """The next whole frame, or None until more bytes come. Raises DataFrameError."""
        if len(self._buffer) < PREFIX_BYTES:
            return None
        (size,) = struct.unpack_from("<I", self._buffer)
        if size > self._max:
            raise DataFrameError(f"a data frame of {size} bytes is over the limit of {self._max}")
        if len(self._buffer) < PREFIX_BYTES + size:
            return None
        body = bytes(self._buffer[PREFIX_BYTES : PREFIX_BYTES + size])
        del self._buffer[: PREFIX_BYTES + size]
        frame = worker_pb2.DataFrame()
        try:
            frame.ParseFromString(body)
        except Exception as error:  # protobuf's DecodeError, or a RuntimeWarning-free ValueError
            raise DataFrameError(f"the bytes are not a DataFrame: {error}") from None
        if frame.schema_version != SCHEMA_VERSION:
            raise DataFrameError(f"DataFrame schema_version {frame.schema_version} is not {SCHEMA_VERSION}")
        return frame


@dataclasses.dataclass
class SessionKeys:
    """The keys of one session on one route: the first range's step key and the return key
    (the nodes agree the others among themselves)."""

    session_id: bytes
    first_step_key: bytes
    return_key: bytes

    @classmethod
    def new(cls, random_bytes: Callable[[int], bytes]) -> SessionKeys:
        return cls(random_bytes(SESSION_ID_BYTES), random_bytes(KEY_BYTES), random_bytes(KEY_BYTES))


@dataclasses.dataclass
class OwnerSession:
    """The owner's side of one session on the data plane.

    Counters: STEP and ATTACH frames count up from 1; a RESULT is taken only if it opens under
    the return key and its counter is above the last one taken (a copy is refused).
    """

    keys: SessionKeys
    _step_counter: int = 0
    _attach_counter: int = 0
    _result_counter: int = 0

    @property
    def session_id(self) -> bytes:
        return self.keys.session_id

    def step_frame(self, step: worker_pb2.DataStep) -> bytes:
        self._step_counter += 1
        return sealed_frame(
            STEP, self.keys.first_step_key, self.session_id, self._step_counter, step.SerializeToString()
        )

    def attach_frame(self, next_step: int = 0) -> bytes:
        self._attach_counter += 1
        body = worker_pb2.DataAttach(step=next_step).SerializeToString()
        return sealed_frame(ATTACH, self.keys.return_key, self.session_id, self._attach_counter, body)

    def open_result(self, frame: worker_pb2.DataFrame) -> worker_pb2.DataResult:
        """The RESULT in ``frame``. Raises DataFrameError: another kind (a NOTICE says why the
        worker refused something), another session, an old counter, or it does not open."""
        if frame.kind == NOTICE:
            raise DataFrameError(f"the worker refused a frame: {frame.notice}")
        if frame.kind != RESULT:
            raise DataFrameError(f"expected a RESULT frame, got {_KIND_NAMES.get(frame.kind, frame.kind)}")
        if frame.session_id != self.session_id:
            raise DataFrameError(f"a RESULT of session {frame.session_id.hex()}, not {self.session_id.hex()}")
        if frame.counter <= self._result_counter:
            raise DataFrameError(
                f"a RESULT with counter {frame.counter}, not above the last one taken ({self._result_counter})"
            )
        plain = open_sealed(self.keys.return_key, RESULT, self.session_id, frame.counter, frame.sealed)
        result = worker_pb2.DataResult()
        try:
            result.ParseFromString(plain)
        except Exception as error:
            raise DataFrameError(f"the RESULT body is not a DataResult: {error}") from None
        self._result_counter = frame.counter
        return result
