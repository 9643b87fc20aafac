"""A trio connection to a worker's data plane (``--data-listen``; agent/core/wire/data_frames.py).

The owner of a session opens one to the first range's worker (it sends STEPs there) and one to
the last range's (it ATTACHes there and RESULTs come back on it); tests and benchmarks use the
same. Frames are whole bytes from ``agent.core.wire.data_frames``; this module only moves them, on the
raw socket (``agent.io.net.raw_socket``): a send the kernel takes at once is one system call, and a
receive waits only when nothing is there, without the scheduler passes ``trio.SocketStream``
makes around each (a decode step crosses this connection twice).

Resource handling: ``open_data_link`` owns the socket and closes it on exit.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator

import trio

from agent._proto import worker_pb2
from agent.core.wire.data_frames import DataFrameError, DataFrameReader
from agent.io.net import raw_socket

DEFAULT_MAX_FRAME_BYTES = 64 << 20
RECEIVE_BYTES = 1 << 16


class DataLinkClosed(ConnectionError):
    """The worker closed the connection (after a NOTICE that says why, when it sent one)."""


class DataLink:
    """One TCP connection to a worker's data plane: ``send`` frames, ``receive`` frames.

    Cancellation: ``receive`` may be cancelled at any point (what was read stays buffered for
    the next call); a cancelled ``send`` may leave part of a frame on the wire, after which the
    connection must not be used."""

    def __init__(self, sock: socket.socket, max_frame_bytes: int) -> None:
        self._sock = sock
        self._reader = DataFrameReader(max_frame_bytes)
        self._send_lock = trio.Lock()
        self._buffer = bytearray(RECEIVE_BYTES)

    async def send(self, frame: bytes) -> None:
        """Sends one whole frame (``agent.core.wire.data_frames``' bytes, prefix included)."""
        await raw_socket.acquire(self._send_lock)
        try:
            await raw_socket.send_all(self._sock, frame)
        finally:
            self._send_lock.release()

    async def receive(self) -> worker_pb2.DataFrame:
        """The next frame. Raises DataLinkClosed at the end, DataFrameError on bad bytes."""
        waited = False
        while (frame := self._reader.next_frame()) is None:
            n, waited_now = await raw_socket.receive_into(self._sock, memoryview(self._buffer))
            waited = waited or waited_now
            if not n:
                raise DataLinkClosed("the worker closed the data plane connection")
            self._reader.feed(self._buffer[:n])
        if not waited:
            await trio.lowlevel.checkpoint()  # a receive is a checkpoint, waiting or not
        return frame


@contextlib.asynccontextmanager
async def open_data_link(
    host: str, port: int, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> AsyncIterator[DataLink]:
    """A connection to the data plane at ``host:port`` (TCP_NODELAY, trio's default)."""
    stream = await trio.open_tcp_stream(host, port)
    sock = raw_socket.adopt(stream)
    try:
        yield DataLink(sock, max_frame_bytes)
    finally:
        sock.close()


__all__ = ["DataFrameError", "DataLink", "DataLinkClosed", "open_data_link"]
