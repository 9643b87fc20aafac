"""Frames over one libp2p stream, and the per-peer pool records of ``agent.io.net.p2p_transport``.

Owns: ``_FramedStream`` (``uvarint(len) || payload`` frames over one stream, a frame over the
reader's limit never allocated), ``_PooledStream`` and ``_PeerStreams`` (a reused stream, and
one peer's idle and busy streams), and resetting or closing a stream without holding up the
caller. Split out of ``agent.io.net.p2p``.

Must not import the transport or the host (``agent.io.net.p2p_transport``, ``agent.io.net.p2p``):
they build on this.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import trio
from libp2p.abc import INetStream

from agent.core.net.frames import FrameError, FrameTooLarge, decode_uvarint, encode_uvarint

# the libp2p transport's logger, as before the split
log = logging.getLogger("agent.io.net.p2p")

_READ_CHUNK_BYTES = 64 * 1024
_SINGLE_WRITE_BYTES = 16 * 1024  # below this, prefix and payload go out in one write
_RESET_TIMEOUT_S = 1.0  # resetting a broken stream must not hold up the caller for long


class _FramedStream:
    """Frames over one libp2p stream; keeps the bytes read past a length prefix."""

    def __init__(self, stream: INetStream) -> None:
        self.stream = stream
        self._buffer = bytearray()

    async def _read_some(self, max_bytes: int) -> bytes:
        """Up to ``max_bytes`` bytes; b"" at end of stream."""
        try:
            return await self.stream.read(max_bytes)
        except EOFError:  # libp2p's StreamEOF
            return b""

    async def wait_readable(self) -> bool:
        """Wait until a frame starts; False when the stream ended cleanly between frames."""
        if not self._buffer:
            self._buffer += await self._read_some(_READ_CHUNK_BYTES)
        return bool(self._buffer)

    async def read_frame(self, max_bytes: int) -> bytes:
        length = await self.read_length()
        if length > max_bytes:
            raise FrameTooLarge(f"frame of {length} bytes is over the limit of {max_bytes} bytes")
        return await self.read_body(length)

    async def read_length(self) -> int:
        """The next frame's length prefix (its body is read by ``read_body``, or never)."""
        while True:
            decoded = decode_uvarint(self._buffer)
            if decoded is not None:
                break
            chunk = await self._read_some(_READ_CHUNK_BYTES)
            if not chunk:
                raise FrameError("stream ended inside a length prefix" if self._buffer else "stream ended")
            self._buffer += chunk
        length, used = decoded
        del self._buffer[:used]
        return length

    async def read_body(self, length: int) -> bytes:
        """The ``length`` bytes of the body whose prefix ``read_length`` returned."""
        if len(self._buffer) >= length:
            payload = bytes(self._buffer[:length])
            del self._buffer[:length]
            return payload
        # Grows with what actually arrives: a prefix announcing a big frame allocates nothing.
        parts = [bytes(self._buffer)]
        remaining = length - len(self._buffer)
        self._buffer.clear()
        while remaining:
            chunk = await self._read_some(remaining)  # never returns more than asked
            if not chunk:
                raise FrameError(f"stream ended {remaining} bytes before the end of a frame")
            parts.append(chunk)
            remaining -= len(chunk)
        return b"".join(parts)

    async def write_frame(self, payload: bytes) -> None:
        prefix = encode_uvarint(len(payload))
        if len(payload) <= _SINGLE_WRITE_BYTES:
            await self.stream.write(prefix + payload)
        else:
            await self.stream.write(prefix)
            await self.stream.write(payload)


@dataclass(eq=False)
class _PooledStream:
    framed: _FramedStream
    protocol_id: str

    @property
    def stream(self) -> INetStream:
        return self.framed.stream

    def looks_alive(self) -> bool:
        if self.stream.is_closed:  # type: ignore[attr-defined]  # NetStream's; libp2p's INetStream lacks it
            return False
        muxed_conn = getattr(self.stream, "muxed_conn", None)
        return not bool(getattr(muxed_conn, "is_closed", False))


@dataclass(eq=False)
class _PeerStreams:
    """The outbound streams of this host to one peer (one connection: max_connections_per_peer=1)."""

    busy_slots: trio.Semaphore
    idle: dict[str, list[_PooledStream]] = field(default_factory=dict)
    dial_lock: trio.Lock = field(default_factory=trio.Lock)

    def idle_count(self) -> int:
        return sum(len(streams) for streams in self.idle.values())


async def _reset_quietly(stream: INetStream) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(_RESET_TIMEOUT_S):
        try:
            await stream.reset()
        except Exception as error:
            log.debug("resetting a stream failed: %s", error)


async def _close_quietly(stream: INetStream) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(_RESET_TIMEOUT_S):
        try:
            await stream.close()
        except Exception as error:
            log.debug("closing a stream failed: %s", error)
