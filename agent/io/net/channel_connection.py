"""One direct channel connection and the exchanges multiplexed on it: ``_Connection``.

Owns: the exchanges in flight on one authenticated TLS connection, either way (``_Pending``;
``agent.core.net.frames``: REQUEST / QUIET_REQUEST / REPLY / ERROR / TAKEN frames with exchange
ids), sending frames with or without waiting (the connection's writer takes what could not go
at once), confirming quiet requests in TAKEN frames, deadlines and failure of the exchanges,
and the reply frame a handler's answer becomes. Split out of ``agent.io.net.channel``, which
dials, accepts and reads connections and runs their handlers.

Must not import ``agent.io.net.channel`` (the transport above) or libp2p.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import trio

from agent.core.net.frames import (
    CHANNEL_HEAD_BYTES,
    ERROR,
    MAX_TAKEN_IDS,
    QUIET_REQUEST,
    REPLY,
    REQUEST,
    FrameReader,
    FrameTooLarge,
    error_header,
    frame_prefix,
    peek_channel_head,
    reply_header,
    request_header,
    taken_frame_body,
)
from agent.io.net.channel_tls import ALPN, _TlsStream
from agent.io.net.request_gate import RequestGate
from agent.io.net.transport import TransportError

__all__ = ["OnReply"]

# the channel's logger, as before the split
log = logging.getLogger("agent.io.net.channel")

_SINGLE_WRITE_BYTES = 64 * 1024  # below this, prefix + header + payload go out as one write
#: A reply to an exchange this side is not waiting for (it gave up on it) is read and dropped
#: up to this size; a bigger one closes the connection (an unasked reply must not be a way
#: around the request limits).
UNASKED_REPLY_BYTES = 64 << 10


def _frame_parts(header: bytes, payload: bytes) -> tuple[bytes, ...]:
    """A frame as the parts of one stream write: one buffer when small, else the payload
    apart (not copied into one buffer; still one unit on the stream)."""
    prefix = frame_prefix(len(header) + len(payload))
    if len(payload) <= _SINGLE_WRITE_BYTES:
        return (prefix + header + payload,)
    return (prefix + header, payload)


#: Called with a request's reply, or the TransportError that ended it (``request_soon``).
OnReply = Callable[[bytes | TransportError], None]


@dataclass(eq=False)
class _Pending:
    """An exchange in flight: awaited by its requester (``done``), or answered through a
    callback (``on_reply``) by whichever task learns its outcome."""

    done: trio.Event | None = field(default_factory=trio.Event)
    kind: int = 0
    payload: bytes = b""
    on_reply: OnReply | None = None
    deadline: float = math.inf  # trio time; callbacks only (an awaiting requester has its own)
    protocol_id: str = ""
    quiet: bool = False  # a QUIET_REQUEST: a TAKEN frame may end it, with no callback


#: What the connection's writer sends: a frame, or the rest of a send already begun (the
#: stream is held for it).
_BacklogItem = tuple[bytes, bytes] | list[memoryview]


class _Connection:
    """One authenticated channel connection and the exchanges in flight on it (either way)."""

    def __init__(
        self, stream: _TlsStream, peer_id: str, max_frame_bytes: int, *, outbound: bool, gate: RequestGate | None = None
    ) -> None:
        self.stream = stream
        self.peer_id = peer_id
        self.outbound = outbound
        # the peer speaks channel version 2: quiet requests and TAKEN frames
        self.quiet_requests = stream.selected_alpn_protocol() == ALPN
        self.max_frame_bytes = max_frame_bytes
        #: the host's request limits: a request frame is checked on its head, and its payload
        #: counted in flight (``receiving_bytes`` while it arrives) until it is answered
        self.gate = gate
        self.receiving_bytes = 0
        self.reader = (
            FrameReader(max_frame_bytes)
            if gate is None
            else FrameReader(max_frame_bytes, check_head=self._check_head, head_bytes=CHANNEL_HEAD_BYTES)
        )
        self.pending: dict[int, _Pending] = {}
        # odd ids from the dialler, even from the listener: never the same id both ways
        self._next_id = 1 if outbound else 2
        self.closed: str | None = None
        # what the sends that may not wait (send_frame_soon, request_soon) left to the
        # connection's writer (serve_backlog), in order: a frame that found the stream held,
        # or the rest of one the kernel did not take at once (the stream stays held for it).
        # While anything is left there, those sends queue behind it: a send that went ahead
        # and left a rest would hold the stream that the writer waits for, rest behind it.
        self._backlog_in, self._backlog = trio.open_memory_channel[_BacklogItem](math.inf)
        self._backlog_items = 0  # queued, or being sent by the writer
        # quiet requests this side took, not yet confirmed (serve_acceptances sends them)
        self._taken: list[int] = []
        self._taken_waiting = trio.Event()
        self.taken_frames_received = 0
        self.acceptances_confirmed = 0  # this side's quiet requests that TAKEN frames ended
        self.requests_in_tasks = 0  # requests being answered in tasks (ChannelConfig.max_requests_in_flight)
        self.last_read_at = trio.current_time()  # which accepted connection has been idle longest

    def _check_head(self, length: int, head: memoryview) -> bool:
        """Whether to take a frame, from its head: a request over its protocol's limit for its
        peer, or a big reply nobody here waits for, closes the connection (FrameTooLarge); a
        request over the bytes its peer (or everyone) may have in flight is dropped as it
        arrives and answered ERROR. An accepted request's payload counts as in flight."""
        assert self.gate is not None
        kind, exchange_id, protocol_id, payload_bytes = peek_channel_head(length, head)
        if kind in (REQUEST, QUIET_REQUEST):
            if protocol_id is None:
                return True  # malformed: parse_channel_frame refuses it
            refusal = self.gate.take(self.peer_id, protocol_id, payload_bytes)
            if refusal is not None:
                if refusal.too_large:
                    raise FrameTooLarge(refusal.reason)
                log.warning("refused a request on %s from %s: %s", protocol_id, self.peer_id, refusal.reason)
                self.send_frame_soon(error_header(exchange_id), f"refused: {refusal.reason}".encode())
                return False
            self.receiving_bytes = payload_bytes
        elif kind in (REPLY, ERROR) and exchange_id not in self.pending and length > UNASKED_REPLY_BYTES:
            raise FrameTooLarge(f"a reply of {length} bytes to exchange {exchange_id}, which is not awaited here")
        return True

    def took_request(self) -> int:
        """The payload bytes of the request frame just taken, counted in flight until
        ``answered`` is called with them."""
        held, self.receiving_bytes = self.receiving_bytes, 0
        return held

    def answered(self, held: int) -> None:
        if self.gate is not None and held:
            self.gate.give_back(self.peer_id, held)

    async def send_frame(self, header: bytes, payload: bytes) -> None:
        try:
            await self.stream.send_all(*_frame_parts(header, payload))
        finally:
            if self.stream.broken is not None:  # e.g. cancelled half-way: nothing more goes on it
                self.fail(self.stream.broken)

    async def send_frame_quietly(self, header: bytes, payload: bytes) -> None:
        """``send_frame``; a failure marks the connection failed instead of raising."""
        try:
            await self.send_frame(header, payload)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
            self.fail(f"send failed: {type(error).__name__}: {error}")

    def send_frame_soon(self, header: bytes, payload: bytes) -> None:
        """Send a frame without waiting: at once when the stream can take it, else (another
        send holds the stream, or the kernel's buffer is full) the rest from the connection's
        writer (``serve_backlog``). For the frame reader, which must never wait on a write:
        two peers whose readers each waited to write to the other, neither reading, would
        never move again."""
        self.send_frames_soon(((header, payload),))

    def send_frames_soon(self, frames: Sequence[tuple[bytes, bytes]]) -> None:
        """``send_frame_soon`` for several frames, in order, as one write when the stream
        takes them at once (the replies of one read: one system call, not one each)."""
        if self._backlog_items:
            for frame in frames:
                self._to_backlog(frame)
            return
        if len(frames) == 1:
            parts = _frame_parts(*frames[0])
        else:
            parts = (b"".join(part for frame in frames for part in _frame_parts(*frame)),)
        try:
            rest = self.stream.send_nowait(*parts)
        except trio.WouldBlock:
            for frame in frames:
                self._to_backlog(frame)
            return
        except trio.BrokenResourceError as error:
            self.fail(f"send failed: {error}")
            return
        if rest is not None:
            self._to_backlog(rest)

    def note_taken(self, exchange_id: int) -> None:
        """The handler took the quiet request ``exchange_id``: confirm it with the others in
        the next TAKEN frame (at once when a frame's worth is waiting)."""
        self._taken.append(exchange_id)
        if len(self._taken) >= MAX_TAKEN_IDS:
            self._send_taken()
        else:
            self._taken_waiting.set()

    def _send_taken(self) -> None:
        ids, self._taken = self._taken, []
        self._taken_waiting = trio.Event()
        if ids:
            self.send_frame_soon(taken_frame_body(ids), b"")

    async def serve_acceptances(self, delay_s: float) -> None:
        """Send the confirmations of taken quiet requests, ``delay_s`` after the first of each
        lot was taken, until cancelled (with the connection)."""
        while True:
            await self._taken_waiting.wait()
            await trio.sleep(delay_s)
            self._send_taken()

    def settle_taken(self, exchange_ids: list[int]) -> None:
        """A TAKEN frame came: end those quiet exchanges, with no callback (an id that is not
        a quiet exchange in flight, e.g. one past its deadline, is passed over)."""
        self.taken_frames_received += 1
        pending = self.pending
        for exchange_id in exchange_ids:
            waiter = pending.get(exchange_id)
            if waiter is not None and waiter.quiet:
                del pending[exchange_id]
                self.acceptances_confirmed += 1

    def _to_backlog(self, item: _BacklogItem) -> None:
        self._backlog_items += 1
        self._backlog_in.send_nowait(item)

    async def serve_backlog(self) -> None:
        """The connection's writer: sends what ``send_frame_soon`` and ``request_soon`` could
        not, in order, until cancelled (with the connection)."""
        async for item in self._backlog:
            try:
                if isinstance(item, list):
                    await self._finish_quietly(item)
                else:
                    await self.send_frame_quietly(*item)
            finally:
                self._backlog_items -= 1

    async def _finish_quietly(self, rest: list[memoryview]) -> None:
        try:
            await self.stream.finish_send(rest)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
            self.fail(f"send failed: {type(error).__name__}: {error}")
        finally:
            if self.stream.broken is not None:
                self.fail(self.stream.broken)

    def _take_exchange_id(self) -> int:
        exchange_id = self._next_id
        self._next_id = (self._next_id + 2) % (1 << 32) or (1 if self.outbound else 2)
        return exchange_id

    async def request(self, protocol_id: str, payload: bytes) -> bytes:
        if self.closed is not None:
            raise TransportError(self.peer_id, f"channel closed ({self.closed})")
        exchange_id = self._take_exchange_id()
        waiter = _Pending()
        assert waiter.done is not None
        self.pending[exchange_id] = waiter
        try:
            try:
                await self.send_frame(request_header(exchange_id, protocol_id), payload)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
                self.fail(f"send failed: {type(error).__name__}: {error}")
            await waiter.done.wait()
        finally:
            self.pending.pop(exchange_id, None)
        outcome = self._outcome(waiter)
        if isinstance(outcome, TransportError):
            raise outcome
        return outcome

    def request_soon(
        self, protocol_id: str, payload: bytes, *, deadline: float, on_reply: OnReply, quiet: bool = False
    ) -> bool:
        """``ChannelTransport.request_soon`` on this connection."""
        if self.closed is not None:
            return False
        if self._backlog_items:  # the writer has frames to send first (send_frame_soon)
            return False
        exchange_id = self._take_exchange_id()
        quiet = quiet and self.quiet_requests
        self.pending[exchange_id] = _Pending(
            None, on_reply=on_reply, deadline=deadline, protocol_id=protocol_id, quiet=quiet
        )
        try:
            header = request_header(exchange_id, protocol_id, quiet=quiet)
            rest = self.stream.send_nowait(*_frame_parts(header, payload))
        except trio.WouldBlock:  # another send holds the stream: nothing was sent
            del self.pending[exchange_id]
            return False
        except trio.BrokenResourceError as error:
            del self.pending[exchange_id]
            self.fail(f"send failed: {error}")
            return False
        if rest is not None:
            self._to_backlog(rest)
        return True

    def _outcome(self, waiter: _Pending) -> bytes | TransportError:
        if waiter.kind == REPLY:
            return waiter.payload
        if waiter.kind == ERROR:
            return TransportError(self.peer_id, f"stream reset ({waiter.payload.decode('utf-8', 'replace')})")
        return TransportError(self.peer_id, f"channel closed ({self.closed})")

    def settle(self, exchange_id: int, kind: int, payload: bytes) -> None:
        """A REPLY or ERROR frame for ``exchange_id`` came: hand it to its requester (nothing
        when it gave up: cancelled, or its deadline passed)."""
        waiter = self.pending.get(exchange_id)
        if waiter is None:
            return
        waiter.kind, waiter.payload = kind, payload
        if waiter.on_reply is None:
            assert waiter.done is not None
            waiter.done.set()
            return
        del self.pending[exchange_id]
        _call_back(waiter.on_reply, self._outcome(waiter))

    def expire(self, now: float) -> None:
        """End the callback exchanges whose deadline has passed, with a TransportError."""
        for exchange_id, waiter in list(self.pending.items()):
            if waiter.on_reply is not None and waiter.deadline <= now:
                del self.pending[exchange_id]
                _call_back(waiter.on_reply, TransportError(self.peer_id, f"no reply on {waiter.protocol_id} in time"))

    def fail(self, reason: str) -> None:
        """Mark the connection dead and end every exchange in flight on it."""
        if self.closed is None:
            self.closed = reason
        for exchange_id, waiter in list(self.pending.items()):
            if waiter.on_reply is None:
                assert waiter.done is not None
                waiter.done.set()
            elif self.pending.pop(exchange_id, None) is not None:
                _call_back(waiter.on_reply, self._outcome(waiter))


def _call_back(on_reply: OnReply, outcome: bytes | TransportError) -> None:
    """``on_reply(outcome)``; a bug in it is logged, never raised into the channel."""
    try:
        on_reply(outcome)
    except Exception:
        log.exception("a reply callback failed")


def _answered(
    connection: _Connection, protocol_id: str, answer: Callable[[str, bytes], bytes], payload: bytes
) -> bytes | Exception:
    """What an ``ImmediateHandler``'s ``answer`` returned, or the exception it raised (logged)."""
    try:
        return bytes(answer(connection.peer_id, payload))
    except Exception as error:
        log.exception("handler for %s failed on a request from %s", protocol_id, connection.peer_id)
        return error


def _reply_frame(
    connection: _Connection, exchange_id: int, protocol_id: str, answer: bytes | Exception | None
) -> tuple[bytes, bytes]:
    """``(header, payload)`` answering a request: the handler's reply, or an ERROR frame when
    there was no handler (None), it failed (its exception), or its reply is too big."""
    if answer is None:
        return error_header(exchange_id), f"protocol {protocol_id} not supported".encode()
    if isinstance(answer, Exception):
        return error_header(exchange_id), f"handler failed ({type(answer).__name__})".encode()
    if len(answer) > connection.max_frame_bytes:
        log.error("handler for %s returned %d bytes, over max_frame_bytes", protocol_id, len(answer))
        return error_header(exchange_id), b"reply over max_frame_bytes"
    return reply_header(exchange_id), answer
