"""A trio connection to a worker's data plane (``--data-listen``; agent/core/data_frames.py).

The owner of a session opens one to the first range's worker (it sends STEPs there) and one to
the last range's (it ATTACHes there and RESULTs come back on it); tests and benchmarks use the
same. Frames are whole bytes from ``agent.core.data_frames``; this module only moves them.

Resource handling: ``open_data_link`` owns the TCP stream and closes it on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import trio

from agent._proto import worker_pb2
from agent.core.data_frames import DataFrameError, DataFrameReader

DEFAULT_MAX_FRAME_BYTES = 64 << 20
RECEIVE_BYTES = 1 << 16


class DataLinkClosed(ConnectionError):
    """The worker closed the connection (after a NOTICE that says why, when it sent one)."""


class DataLink:
    """One TCP connection to a worker's data plane: ``send`` frames, ``receive`` frames."""

    def __init__(self, stream: trio.SocketStream, max_frame_bytes: int) -> None:
        self._stream = stream
        self._reader = DataFrameReader(max_frame_bytes)
        self._send_lock = trio.Lock()

    async def send(self, frame: bytes) -> None:
        """Sends one whole frame (``agent.core.data_frames``' bytes, prefix included)."""
        async with self._send_lock:
            await self._stream.send_all(frame)

    async def receive(self) -> worker_pb2.DataFrame:
        """The next frame. Raises DataLinkClosed at the end, DataFrameError on bad bytes."""
        while (frame := self._reader.next_frame()) is None:
            data = await self._stream.receive_some(RECEIVE_BYTES)
            if not data:
                raise DataLinkClosed("the worker closed the data plane connection")
            self._reader.feed(data)
        return frame


@contextlib.asynccontextmanager
async def open_data_link(
    host: str, port: int, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> AsyncIterator[DataLink]:
    """A connection to the data plane at ``host:port`` (TCP_NODELAY, trio's default)."""
    stream = await trio.open_tcp_stream(host, port)
    try:
        yield DataLink(stream, max_frame_bytes)
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()


__all__ = ["DataFrameError", "DataLink", "DataLinkClosed", "open_data_link"]
