"""Framing: the one place where bytes on a stream become frames, and channel frames become
exchanges.

Owns:
- the unsigned varint (``encode_uvarint`` / ``decode_uvarint``, at most 10 bytes);
- a frame on any Baton stream (libp2p streams and the direct channel alike):
  ``uvarint(len(body)) || body``; ``FrameReader`` is the sans-I/O reader (``feed`` bytes,
  take whole frames, bounded by ``max_frame_bytes``: a prefix announcing a bigger frame is an
  error before anything is allocated);
- the direct channel's exchange layer (``agent.io.net.channel``): one connection carries many
  exchanges at once, each a REQUEST answered by exactly one REPLY or ERROR with the same
  exchange id. A channel frame body is::

      kind (1 byte) || exchange id (4 bytes, big-endian) || rest
      REQUEST:       len(protocol id) (1 byte, 1..255) || protocol id (ASCII) || payload
      QUIET_REQUEST: as REQUEST (channel version 2)
      REPLY:         payload
      ERROR:         UTF-8 text (the handler failed; the requester raises it)
      TAKEN:         exchange id 0 || the exchange ids of QUIET_REQUESTs taken, 4 bytes each
                     (big-endian; 1..MAX_TAKEN_IDS of them) (channel version 2)

  Requests are pipelined: a requester writes request after request without waiting; replies
  come back in any order. A QUIET_REQUEST is one whose requester needs to hear back only
  when the handler did not simply take it (a refusal, an error): that answer comes as a REPLY
  or ERROR at once, while the plain acceptances are confirmed in bulk, in TAKEN frames a
  little later (a step's ack cost each of the two peers a wake-up and a frame on every hop
  of every decode step, for a message that said nothing but "taken").

Errors say who is at fault: ``FrameError`` (and ``FrameTooLarge``) are the remote peer's
(``RemoteProtocolError`` in h11's terms): the connection that produced them is closed, and
nothing else is touched.

Pure: no sockets, trio, clocks or randomness. Must not import agent.io.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable, Sequence
from typing import TypeVar

__all__ = [
    "CHANNEL_HEAD_BYTES",
    "ERROR",
    "MAX_PROTOCOL_ID_BYTES",
    "MAX_TAKEN_IDS",
    "QUIET_REQUEST",
    "REPLY",
    "REQUEST",
    "TAKEN",
    "ChannelFrame",
    "FrameError",
    "FrameReader",
    "FrameTooLarge",
    "decode_uvarint",
    "encode_uvarint",
    "error_header",
    "frame_prefix",
    "parse_channel_frame",
    "peek_channel_head",
    "read_taken_ids",
    "reply_header",
    "request_header",
    "taken_frame_body",
]

_T = TypeVar("_T")

MAX_VARINT_BYTES = 10  # a 64-bit unsigned varint
MAX_PROTOCOL_ID_BYTES = 255

REQUEST = 1
REPLY = 2
ERROR = 3
QUIET_REQUEST = 4
TAKEN = 5
_KINDS = {REQUEST: "REQUEST", REPLY: "REPLY", ERROR: "ERROR", QUIET_REQUEST: "QUIET_REQUEST", TAKEN: "TAKEN"}
_HEADER_BYTES = 5  # kind + exchange id
_EXCHANGE_ID_BYTES = 4
#: the most exchange ids one TAKEN frame lists (16 KiB of ids: a sender with more sends more frames)
MAX_TAKEN_IDS = 4096


class FrameError(Exception):
    """The bytes on a stream are not a well-formed frame (the remote peer's fault)."""


class FrameTooLarge(FrameError):
    """A frame's length prefix is over the reader's limit (the frame is not read)."""


def encode_uvarint(value: int) -> bytes:
    if value < 0:
        raise ValueError(f"a uvarint is not negative, got {value}")
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def decode_uvarint(
    data: bytes | bytearray | memoryview, start: int = 0, stop: int | None = None
) -> tuple[int, int] | None:
    """``(value, bytes used)`` of the uvarint at ``data[start:stop]``; None if incomplete.

    Raises:
      FrameError: a varint longer than 10 bytes.
    """
    value = 0
    available = len(data) if stop is None else stop
    end = min(available, start + MAX_VARINT_BYTES)
    for index in range(start, end):
        byte = data[index]
        value |= (byte & 0x7F) << (7 * (index - start))
        if not byte & 0x80:
            return value, index - start + 1
    if available - start >= MAX_VARINT_BYTES:
        raise FrameError(f"length prefix longer than {MAX_VARINT_BYTES} bytes")
    return None


def frame_prefix(body_bytes: int) -> bytes:
    """The length prefix of a frame whose body has ``body_bytes`` bytes."""
    return encode_uvarint(body_bytes)


class FrameReader:
    """Sans-I/O frame reader: ``feed`` what the stream gave (or let the stream write into
    ``space`` and ``commit`` it), take whole frames with ``next_frame`` / ``take_frame``.

    A prefix over ``max_frame_bytes`` raises ``FrameTooLarge`` as soon as the prefix is
    complete; the reader is then unusable (the stream has lost framing) and raises again.

    The buffer keeps its size between frames (up to ``keep_bytes``): a stream that decrypts
    into ``space`` writes a big frame where it is parsed, with no copy in between and no
    fresh allocation (page faults) per frame.
    """

    def __init__(
        self,
        max_frame_bytes: int,
        *,
        keep_bytes: int = 8 << 20,
        check_head: Callable[[int, memoryview], bool] | None = None,
        head_bytes: int = 0,
    ) -> None:
        if max_frame_bytes < 1:
            raise ValueError(f"max_frame_bytes must be positive, got {max_frame_bytes}")
        self.max_frame_bytes = max_frame_bytes
        self._keep_bytes = keep_bytes
        # ``check_head(length, first bytes)``: asked once per frame, as soon as its first
        # ``head_bytes`` (or all of a shorter frame) are in, before room is made for the rest
        # (a channel frame's kind and protocol id say which limit applies). It returns False to
        # drop the frame (its bytes are let go as they arrive, never buffered whole), or raises
        # FrameError (or FrameTooLarge) to refuse it: the reader is broken then.
        self._check_head = check_head
        self._head_bytes = head_bytes if check_head is not None else 0
        self._head_checked = check_head is None  # of the next frame
        self._dropping = 0  # bytes of a dropped frame still to let go
        self.frames_dropped = 0
        self._buffer = bytearray()
        self._start = 0  # frames before this offset were taken
        self._end = 0  # bytes fed end here; the buffer after it is free space
        self._broken: FrameError | None = None

    @property
    def buffered(self) -> int:
        """Bytes fed and not yet returned in a frame."""
        return self._end - self._start

    @property
    def at_frame_boundary(self) -> bool:
        """True when no partial frame is buffered (a clean place for the stream to end)."""
        return self._end == self._start and not self._dropping

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        size = len(data)
        with self.space(size) as free:
            free[:size] = data
        self.commit(size)

    def space(self, at_least: int) -> memoryview:
        """A writable view of the free space after what was fed, ``at_least`` bytes or more:
        a stream receives into it, then ``commit`` counts what it wrote as fed. The caller
        releases the view before it calls ``feed``, ``space`` or ``commit``."""
        if self._start == self._end:
            self._start = self._end = 0
            if len(self._buffer) > self._keep_bytes >= at_least:
                self._buffer = bytearray(self._keep_bytes)  # let a rare huge frame's memory go
        free = len(self._buffer) - self._end
        if free < at_least and self._start:  # move the partial frame to the front
            size = self._end - self._start
            self._buffer[:size] = self._buffer[self._start : self._end]
            self._start, self._end = 0, size
            free = len(self._buffer) - size
        if free < at_least:
            self._buffer.extend(bytes(max(at_least - free, len(self._buffer))))
        return memoryview(self._buffer)[self._end :]

    def commit(self, size: int) -> None:
        """Count the first ``size`` bytes of the last ``space`` as fed."""
        if not 0 <= size <= len(self._buffer) - self._end:
            raise ValueError(f"cannot commit {size} bytes: {len(self._buffer) - self._end} are free")
        self._end += size
        if self._dropping:
            self._drop()

    def _drop(self) -> None:
        """Let go of what has arrived of a dropped frame."""
        n = min(self._dropping, self._end - self._start)
        self._start += n
        self._dropping -= n
        if self._start == self._end:
            self._start = self._end = 0
        if not self._dropping:
            self._head_checked = self._check_head is None  # the frame after it

    def needed(self) -> int:
        """At least how many more bytes the next frame needs (1 while the prefix is incomplete).

        Raises what ``next_frame`` raises (a stream sizes its next receive by this: a prefix
        announcing more than ``max_frame_bytes`` must never size a buffer)."""
        if self._dropping:
            return 1
        prefix = self._next_prefix()
        if prefix is None:
            return 1
        length, used = prefix
        if self._dropping:  # dropped as its head came in
            return 1
        if not self._head_checked:
            return max(1, used + min(length, self._head_bytes) - self.buffered)
        return max(1, used + length - self.buffered)

    def _next_prefix(self) -> tuple[int, int] | None:
        """``(body length, prefix bytes)`` of the next frame; None while its prefix is
        incomplete. Raises FrameTooLarge / FrameError (and the reader stays broken)."""
        if self._broken is not None:
            raise self._broken
        try:
            decoded = decode_uvarint(self._buffer, self._start, self._end)
        except FrameError as error:
            self._broken = error
            raise
        if decoded is not None and decoded[0] > self.max_frame_bytes:
            self._broken = FrameTooLarge(
                f"frame of {decoded[0]} bytes is over the limit of {self.max_frame_bytes} bytes"
            )
            raise self._broken
        if decoded is not None and not self._head_checked:
            length, used = decoded
            head_end = self._start + used + min(length, self._head_bytes)
            if head_end <= self._end:
                assert self._check_head is not None
                try:
                    with memoryview(self._buffer) as view, view[self._start + used : head_end] as head:
                        take = self._check_head(length, head)
                except FrameError as error:
                    self._broken = error
                    raise
                self._head_checked = True
                if not take:
                    self.frames_dropped += 1
                    self._dropping = used + length
                    self._drop()
                    return None
        return decoded

    def next_frame(self) -> bytes | None:
        """The next whole frame body, or None until more bytes are fed.

        Raises:
          FrameTooLarge: the next frame announces more than ``max_frame_bytes``.
          FrameError: the length prefix is malformed.
        """
        return self.take_frame(bytes)

    def take_frame(self, parse: Callable[[memoryview], _T]) -> _T | None:
        """``parse`` of the next whole frame body, or None until more bytes are fed.

        ``parse`` gets a view into the reader's buffer, valid during the call only: what it
        keeps it copies (so a frame's payload is copied once, not once for the body and again
        for the payload). The frame is taken even when ``parse`` raises.

        Raises what ``next_frame`` raises, and what ``parse`` raises.
        """
        while True:
            if (self._broken is None and self._start == self._end) or self._dropping:
                return None
            dropped = self.frames_dropped
            prefix = self._next_prefix()
            if prefix is not None:
                break
            if self.frames_dropped == dropped or self._dropping:
                return None
            # a frame dropped whole: the next one may be in already
        length, used = prefix
        begin = self._start + used
        end = begin + length
        if end > self._end or not self._head_checked:
            return None
        self._head_checked = self._check_head is None  # the frame after this one
        try:
            with memoryview(self._buffer) as view, view[begin:end] as body:  # no export left behind
                return parse(body)
        finally:
            self._start = end
            if self._start == self._end:
                self._start = self._end = 0

    def truncation_error(self) -> FrameError:
        """What to raise when the stream ends with a partial frame buffered."""
        decoded = None
        try:
            decoded = decode_uvarint(self._buffer, self._start, self._end)
        except FrameError as error:
            return error
        if decoded is None:
            return FrameError("stream ended inside a length prefix")
        length, used = decoded
        return FrameError(f"stream ended {used + length - self.buffered} bytes before the end of a frame")


# --- channel exchanges ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ChannelFrame:
    """One parsed channel frame. ``protocol_id`` is set for (QUIET_)REQUEST only; ``payload``
    is the request or reply bytes, the error text's UTF-8 bytes, or a TAKEN frame's ids
    (``read_taken_ids``)."""

    kind: int
    exchange_id: int
    protocol_id: str
    payload: bytes

    @property
    def kind_name(self) -> str:
        return _KINDS.get(self.kind, str(self.kind))


def _header(kind: int, exchange_id: int) -> bytes:
    return bytes((kind,)) + _exchange_id_bytes(exchange_id)


def _exchange_id_bytes(exchange_id: int) -> bytes:
    if not 0 <= exchange_id < 1 << 32:
        raise ValueError(f"exchange id {exchange_id} does not fit in 32 bits")
    return exchange_id.to_bytes(_EXCHANGE_ID_BYTES, "big")


def request_header(exchange_id: int, protocol_id: str, *, quiet: bool = False) -> bytes:
    """The body's head of a REQUEST, or of a QUIET_REQUEST when ``quiet`` (the payload
    follows it in the same frame)."""
    name = protocol_id.encode("ascii")
    if not 1 <= len(name) <= MAX_PROTOCOL_ID_BYTES:
        raise ValueError(f"a protocol id has 1..{MAX_PROTOCOL_ID_BYTES} bytes, got {len(name)}")
    return _header(QUIET_REQUEST if quiet else REQUEST, exchange_id) + bytes((len(name),)) + name


def reply_header(exchange_id: int) -> bytes:
    return _header(REPLY, exchange_id)


def error_header(exchange_id: int) -> bytes:
    return _header(ERROR, exchange_id)


def taken_frame_body(exchange_ids: Sequence[int]) -> bytes:
    """A whole TAKEN frame body confirming ``exchange_ids`` (1..MAX_TAKEN_IDS of them)."""
    if not 0 < len(exchange_ids) <= MAX_TAKEN_IDS:
        raise ValueError(f"a TAKEN frame lists 1..{MAX_TAKEN_IDS} exchange ids, got {len(exchange_ids)}")
    return _header(TAKEN, 0) + b"".join(_exchange_id_bytes(exchange_id) for exchange_id in exchange_ids)


def read_taken_ids(payload: bytes) -> list[int]:
    """The exchange ids a TAKEN frame's payload lists.

    Raises:
      FrameError: not a whole number of ids, none, or more than MAX_TAKEN_IDS.
    """
    count, rest = divmod(len(payload), _EXCHANGE_ID_BYTES)
    if rest or not 0 < count <= MAX_TAKEN_IDS:
        raise FrameError(
            f"a TAKEN frame lists 1..{MAX_TAKEN_IDS} exchange ids of {_EXCHANGE_ID_BYTES} bytes, "
            f"got {len(payload)} bytes"
        )
    return list(struct.unpack(f">{count}I", payload))


#: the most of a channel frame's body that says what it is (kind, exchange id, protocol id)
CHANNEL_HEAD_BYTES = _HEADER_BYTES + 1 + 255


def peek_channel_head(length: int, head: bytes | memoryview) -> tuple[int, int, str | None, int]:
    """What a channel frame of ``length`` bytes is, from its first bytes (at least
    ``min(length, CHANNEL_HEAD_BYTES)``): ``(kind, exchange id, protocol id, payload bytes)``;
    the protocol id None for a frame that is no request, or one too malformed to name it
    (``parse_channel_frame`` refuses it once it is in)."""
    if len(head) < _HEADER_BYTES:
        return -1, 0, None, length
    kind = head[0]
    exchange_id = int.from_bytes(head[1:5], "big")
    if kind not in (REQUEST, QUIET_REQUEST):
        return kind, exchange_id, None, length - _HEADER_BYTES
    if len(head) < _HEADER_BYTES + 1:
        return kind, exchange_id, None, length
    n = head[_HEADER_BYTES]
    start = _HEADER_BYTES + 1
    if n == 0 or start + n > len(head):
        return kind, exchange_id, None, length
    protocol_id = bytes(head[start : start + n]).decode("ascii", "replace")
    return kind, exchange_id, protocol_id, length - start - n


def parse_channel_frame(body: bytes | memoryview) -> ChannelFrame:
    """Split a channel frame body into its parts (the payload is copied out of a view).

    Raises:
      FrameError: too short, an unknown kind, a malformed protocol id, or a TAKEN frame
        with an exchange id.
    """
    if len(body) < _HEADER_BYTES:
        raise FrameError(f"a channel frame has at least {_HEADER_BYTES} bytes, got {len(body)}")
    kind = body[0]
    exchange_id = int.from_bytes(body[1:5], "big")
    if kind in (REQUEST, QUIET_REQUEST):
        name = _KINDS[kind]
        if len(body) < _HEADER_BYTES + 1:
            raise FrameError(f"a {name} frame ends before its protocol id")
        n = body[_HEADER_BYTES]
        start = _HEADER_BYTES + 1
        if n == 0 or start + n > len(body):
            raise FrameError(f"a {name} frame's protocol id of {n} bytes does not fit in the frame")
        try:
            protocol_id = bytes(body[start : start + n]).decode("ascii")
        except UnicodeDecodeError:
            raise FrameError(f"a {name} frame's protocol id is not ASCII") from None
        return ChannelFrame(kind, exchange_id, protocol_id, bytes(body[start + n :]))
    if kind == TAKEN and exchange_id:
        raise FrameError(f"a TAKEN frame names exchange id 0, got {exchange_id}")
    if kind in (REPLY, ERROR, TAKEN):
        return ChannelFrame(kind, exchange_id, "", bytes(body[_HEADER_BYTES:]))
    raise FrameError(f"unknown channel frame kind {kind}")
