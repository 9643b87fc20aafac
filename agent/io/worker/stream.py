"""The native worker's Forward stream: ``_ForwardStream``, Forward over one Unix-socket
connection that a trio task awaits directly (``--forward-socket``; ``protocol/worker.proto``,
``ForwardStreamReply``), run-aheads included.

Owns the stream's framing (a little-endian u32 length before each message), its reply buffer,
reconnecting after a broken or stale connection, and mapping its failures onto
``WorkerError``. Used by ``agent.io.worker.client.AsyncWorkerClient`` when the worker has a
Forward socket. Must not import ``agent.io.worker.client`` (it builds on this) or gRPC's
channels: the stream carries protobuf messages, not gRPC calls.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import trio
from google.protobuf.message import DecodeError

from agent._proto import worker_pb2
from agent.core.wire.worker_records import SCHEMA_VERSION
from agent.io.net import raw_socket
from agent.io.worker.error import WorkerError

_STATUS_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}
_PREFIX_BYTES = 4  # the Forward stream's frame prefix: a little-endian u32 length
_REPLY_BUFFER_BYTES = 1 << 20  # holds a decode step's full logits row (SmolLM2: 197 KB) and more
_REPLY_BUFFER_MAX_KEPT_BYTES = 16 << 20  # a bigger buffer (a long prefill's reply) is let go after use
_RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


#: an empty request: the worker answers it at once; it ends a run-ahead (protocol/worker.proto)
_BARRIER = worker_pb2.ForwardRequest(schema_version=SCHEMA_VERSION)


def _framed(request: worker_pb2.ForwardRequest) -> bytes:
    return len(payload := request.SerializeToString()).to_bytes(_PREFIX_BYTES, "little") + payload


class _StaleConnection(Exception):
    """The Forward stream's open connection broke before any reply byte: try a fresh one."""


class _ForwardStream:
    """Forward over the worker's Forward stream (``--forward-socket``; protocol/worker.proto,
    ``ForwardStreamReply``): one Unix-socket connection that a trio task awaits directly.

    Why: the gRPC call hands each Forward to a call thread and back (two wake-ups, ~0.35 ms
    a step in bench/results/compare.md's trace) and pays gRPC's per-call work on both sides;
    here the task writes a frame and sleeps in the event loop until the reply frame is read, on
    a raw non-blocking socket (``agent.io.net.raw_socket``: no scheduler pass per send or receive
    that need not wait), into one reused buffer that the reply is parsed from in place.

    One Forward at a time (a lock; the worker runs one at a time anyway), replies in order.
    A call that times out, is cancelled or sees the connection break closes the connection
    (a late reply must not be read as the next call's), and the next call connects again.
    """

    def __init__(self, path: str, max_reply_bytes: int) -> None:
        self.path = path
        self.max_reply_bytes = max_reply_bytes
        self._lock = trio.Lock()
        self._sock: socket.socket | None = None
        # replies are read into one buffer, grown to the largest reply (and shrunk back after
        # an outsized one) and parsed in place: no copy per receive, no fresh object per reply
        self._buffer = bytearray(_REPLY_BUFFER_BYTES)
        self._filled = 0  # bytes of the buffer that hold received data

    async def _fill(self, sock: socket.socket) -> bool:
        """Receive more of the reply; whether it had to wait. Raises BrokenResourceError
        when the worker closed the connection."""
        with memoryview(self._buffer) as view:
            received, waited = await raw_socket.receive_into(sock, view[self._filled :])
        if not received:
            raise trio.BrokenResourceError("the worker closed the Forward stream")
        self._filled += received
        return waited

    def _room_for(self, n: int) -> None:
        if len(self._buffer) < n:
            grown = bytearray(max(n, 2 * len(self._buffer)))
            grown[: self._filled] = memoryview(self._buffer)[: self._filled]  # (no interim copy)
            self._buffer = grown

    async def exchange(self, request: worker_pb2.ForwardRequest, timeout_s: float) -> worker_pb2.ForwardReply:
        data = _framed(request)
        try:
            with trio.fail_after(timeout_s):  # the wait for the lock counts too
                await raw_socket.acquire(self._lock)  # free: no scheduler pass before the send
                try:
                    frame = await self._exchange_locked(data)
                finally:
                    self._lock.release()
        except trio.TooSlowError:
            raise WorkerError("DEADLINE_EXCEEDED", f"no Forward reply within {timeout_s} s", method="Forward") from None
        return await self._reply_of(frame)

    async def _reply_of(self, frame: worker_pb2.ForwardStreamReply) -> worker_pb2.ForwardReply:
        if frame.code:
            if frame.code == _RESOURCE_EXHAUSTED:  # a frame over the worker's limit: it closed the connection
                await self.close()
            raise WorkerError(_STATUS_NAMES.get(frame.code, "UNKNOWN"), frame.message, method="Forward")
        return frame.reply

    async def run_ahead(
        self,
        request: worker_pb2.ForwardRequest,
        timeout_s: float,
        on_reply: Callable[[worker_pb2.ForwardReply], Awaitable[bool]],
    ) -> int:
        """``request`` (one entry asking for a run-ahead: ``SequenceInput.run_ahead_steps``)
        and its run: ``on_reply`` gets the request's reply, then each run-ahead step's, in
        order, and returns whether to go on. When it says stop while the worker has more, an
        empty request ends the run and the frames already sent are read and dropped. Returns
        the positions the sequence holds on the worker afterwards (the run's dropped steps
        included: trim them before going on from an earlier position). ``timeout_s`` bounds
        each frame's wait. A step's error ends the run and raises; so does anything that
        leaves the connection's state unknown (a timeout, a cancellation), which closes it."""
        data = _framed(request)
        try:
            with trio.fail_after(timeout_s):
                await raw_socket.acquire(self._lock)
            try:
                return await self._run_ahead_locked(data, timeout_s, on_reply)
            finally:
                self._lock.release()
        except trio.TooSlowError:
            raise WorkerError("DEADLINE_EXCEEDED", f"no Forward reply within {timeout_s} s", method="Forward") from None

    async def _run_ahead_locked(
        self, data: bytes, timeout_s: float, on_reply: Callable[[worker_pb2.ForwardReply], Awaitable[bool]]
    ) -> int:
        with trio.fail_after(timeout_s):
            frame = await self._exchange_locked(data)
        reply = await self._reply_of(frame)
        async with self._closed_on_failure():
            position = reply.entries[0].next_position if reply.entries else 0
            more = frame.run_ahead_more
            wanted = await on_reply(reply)
            while more and wanted:
                with trio.fail_after(timeout_s):
                    frame = await self._next_frame(self._sock)
                more = frame.run_ahead_more
                if not frame.run_ahead:
                    raise WorkerError("INTERNAL", "the worker answered a request nobody sent", method="Forward")
                reply = await self._reply_of(frame)  # a step's error ends the run: its frame is the last
                position = reply.entries[0].next_position
                wanted = await on_reply(reply)
            if more:  # the caller stopped first: end the run, drop its frames up to the barrier's answer
                with trio.fail_after(timeout_s):
                    if self._sock is None:  # closed while on_reply ran: as _next_frame says it
                        raise trio.ClosedResourceError("the Forward stream is closed")
                    await raw_socket.send_all(self._sock, _framed(_BARRIER))
                    while (frame := await self._next_frame(self._sock)).run_ahead:
                        if not frame.code and frame.reply.entries:
                            position = frame.reply.entries[0].next_position
        return position

    @contextlib.asynccontextmanager
    async def _closed_on_failure(self) -> AsyncIterator[None]:
        """Around a use of the connection: any failure leaves its state unknown (a reply half
        read, a run still going), so it is closed, and the next call connects again; a socket
        error is a WorkerError UNAVAILABLE."""
        try:
            yield
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as error:
            await self.close()
            raise WorkerError("UNAVAILABLE", f"Forward stream {self.path}: {error}", method="Forward") from None
        except BaseException:
            await self.close()
            raise

    async def _exchange_locked(self, data: bytes) -> worker_pb2.ForwardStreamReply:
        """One request and its reply. A connection that was already open and turns out broken
        before any reply byte (the worker closed it meanwhile) is replaced once: the request
        is sent again on a fresh one (a Forward the worker did run would be refused there,
        its positions no longer continuing the sequence; never applied twice)."""
        try:
            return await self._exchange_once(data, may_retry=self._sock is not None)
        except _StaleConnection:
            return await self._exchange_once(data, may_retry=False)

    async def _exchange_once(self, data: bytes, *, may_retry: bool) -> worker_pb2.ForwardStreamReply:
        """``_exchange_locked`` on the open connection (or a new one). Raises _StaleConnection
        (``may_retry`` only) when it broke before any reply byte; any other failure closes it."""
        async with self._closed_on_failure():
            if self._sock is None:
                self._sock = raw_socket.adopt(await trio.open_unix_socket(self.path))
                self._filled = 0
            sock = self._sock
            try:
                await raw_socket.send_all(sock, data)
                waited = False
                while self._filled < _PREFIX_BYTES:
                    waited = await self._fill(sock) or waited
            except (OSError, trio.BrokenResourceError) as error:
                if may_retry and not self._filled:
                    raise _StaleConnection from None
                raise WorkerError("UNAVAILABLE", f"Forward stream {self.path}: {error}", method="Forward") from None
            return await self._next_frame(sock, waited=waited)

    async def _next_frame(self, sock: socket.socket | None, *, waited: bool = False) -> worker_pb2.ForwardStreamReply:
        """The next frame from the worker (its first bytes may be in the buffer already).
        Bytes after it stay in the buffer only where the frame says more follow (a run-ahead's):
        a worker sends nothing unasked otherwise."""
        if sock is None:
            raise trio.ClosedResourceError("the Forward stream is closed")
        while self._filled < _PREFIX_BYTES:
            waited = await self._fill(sock) or waited
        size = int.from_bytes(self._buffer[:_PREFIX_BYTES], "little")
        if size > self.max_reply_bytes:
            raise WorkerError(
                "RESOURCE_EXHAUSTED",
                f"a Forward stream reply of {size} bytes is over {self.max_reply_bytes}",
                method="Forward",
            )
        end = _PREFIX_BYTES + size
        self._room_for(end)
        while self._filled < end:
            waited = await self._fill(sock) or waited
        try:
            with memoryview(self._buffer) as view:
                # protobuf parses any buffer; its stubs say bytes (a copy per frame to please them)
                frame = worker_pb2.ForwardStreamReply.FromString(view[_PREFIX_BYTES:end])  # type: ignore[arg-type]
        except DecodeError:
            raise WorkerError("INTERNAL", "the Forward stream reply does not parse", method="Forward") from None
        if self._filled > end:
            if not frame.run_ahead_more:  # (the worker sends one reply per request, and the run's frames)
                raise WorkerError("INTERNAL", "the worker sent bytes after its reply", method="Forward")
            self._buffer[: self._filled - end] = self._buffer[end : self._filled]
            self._filled -= end
        else:
            self._filled = 0
            if len(self._buffer) > _REPLY_BUFFER_MAX_KEPT_BYTES:
                self._buffer = bytearray(_REPLY_BUFFER_BYTES)
        if not waited:  # the reply was there at once: still a checkpoint, as trio expects
            await trio.lowlevel.checkpoint()
        return frame

    async def close(self) -> None:
        sock, self._sock = self._sock, None
        self._filled = 0
        if sock is not None:
            sock.close()
        await trio.lowlevel.cancel_shielded_checkpoint()  # (also called while a cancellation unwinds)
