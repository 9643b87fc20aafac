"""The direct data channel: ``Transport`` over one long-lived TLS 1.3 connection per peer pair.

Owns: listening for and dialling channel connections (``/ip4/<h>/tcp/<p>/tls/p2p/<id>``,
``agent.core.multiaddrs``), their TLS 1.3 handshake with libp2p-TLS certificates
(``agent.core.peer_cert``: an ephemeral P-256 certificate whose extension carries the peer's
Ed25519 key and its signature over the certificate key; mutual: both sides present one and
both check it), binding each connection to the peer id it proved, the exchanges multiplexed
on it (``agent.core.frames``: REQUEST / REPLY / ERROR frames with exchange ids, so requests
are pipelined: many in flight, answered in any order), the fallback to libp2p, and taking in
the connections hole punching makes (``agent.io.punch``).

``ChannelTransport.request`` goes over the channel when the peer advertises a channel address
(and the dial works: a refused or failed dial falls back before anything is sent); anything
else (the tracker, a peer reachable only through the circuit relay, a peer without a channel)
goes to the wrapped libp2p transport. Handlers are installed on both, so a peer is served the
same way whichever path a request took. A request that had to go through the relay to a peer
with no direct address sets off a hole punch in the background (``ChannelConfig.punch``): once
it connects, that connection is the channel's to the peer, and later requests take it. There is
no plaintext mode: a connection that does not complete the TLS 1.3 handshake with a valid peer
certificate is closed before a frame is read.

Bad input from the network (a frame over ``max_frame_bytes``, a truncated frame, garbage,
a reply to no request) closes that connection only: its pending requests fail with
``TransportError``; other connections and their sessions are untouched.

Must not import libp2p: the fallback is any ``Transport``.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import logging
import math
import os
import secrets
import select
import socket
import ssl
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.core.connection_slots import room_for_one_more
from agent.core.frames import (
    ERROR,
    MAX_TAKEN_IDS,
    QUIET_REQUEST,
    REPLY,
    REQUEST,
    TAKEN,
    FrameError,
    FrameReader,
    error_header,
    frame_prefix,
    parse_channel_frame,
    read_taken_ids,
    reply_header,
    request_header,
    taken_frame_body,
)
from agent.core.multiaddrs import channel_multiaddr, parse_channel_multiaddr
from agent.core.punch import PunchConfig
from agent.io import raw_socket
from agent.io.keys import peer_id_of
from agent.io.peer_cert import ISSUER_CERT_PEM, PeerCertError, make_peer_certificate, verify_peer_certificate
from agent.io.punch import Puncher
from agent.io.transport import Handler, ImmediateHandler, Transport, TransportError

__all__ = ["ALPN", "ALPN_VERSIONS", "ChannelConfig", "ChannelTransport", "open_channel_transport", "tls_contexts"]

log = logging.getLogger(__name__)

#: Negotiated by ALPN, newest first: a peer that speaks none of these fails the handshake.
#: Version 2 adds QUIET_REQUEST and TAKEN frames (``agent.core.frames``); a connection to a
#: version 1 peer sends every request as a plain REQUEST, answered one by one.
ALPN_VERSIONS = ("baton-channel/2", "baton-channel/1")
ALPN = ALPN_VERSIONS[0]
_RECEIVE_BYTES = 256 * 1024
_SINGLE_WRITE_BYTES = 64 * 1024  # below this, prefix + header + payload go out as one write
_READS_PER_CHECKPOINT = 16  # receives that did not wait, at most, between two scheduler checkpoints


@dataclass(frozen=True)
class ChannelConfig:
    """Limits and timeouts of the channel.

    ``listen_host``: where the channel listens (None: no listener: this peer dials out only,
    e.g. a node behind NAT that is reached through the relay). ``listen_port``: 0 picks one.
    ``advertise_host``: the host put in the advertised address (default ``listen_host``).
    ``max_frame_bytes``: the largest frame read or written. ``connect_timeout_s``: TCP connect
    + TLS handshake. ``cert_lifetime_s``: validity of the ephemeral certificate.
    ``deadline_check_interval_s``: how often the deadlines of ``request_soon`` exchanges are
    checked (one ends at most this much after its deadline). ``ack_delay_s``: how long this
    peer holds the confirmations of the quiet requests it took before it sends them, in one
    TAKEN frame: a requester hears of an acceptance at most this late, so its deadlines must
    be longer; a connection that breaks fails the exchanges not yet confirmed, some of which
    the peer may have taken (steps of the last ``ack_delay_s``: their owners are told of a
    failure they may already have moved past, and ignore it).

    What peers may hold here (anyone can make a key and its certificate, so these bound
    every peer, admitted or not): ``max_handshakes``: accepted connections still in their TLS
    handshake (beyond it a new TCP connection is closed at once); ``max_inbound_connections``
    and ``max_inbound_per_peer``: accepted connections in all and of one peer id. A new one
    over either bound takes the slot of the one idle longest among those it counts against
    when that one has been idle ``idle_evict_s`` (a connection left by a session that ended, or
    by a peer that reconnected); otherwise the new one is closed: before its handshake when
    over the bound in all (its dialler then falls back to libp2p), after it when over its
    peer's (its first request fails). A connection in use is never closed for a newer one.
    ``max_requests_in_flight``: requests of one connection being answered in tasks, beyond
    which a request is answered "busy" at once (an ERROR frame) instead of starting one more.

    ``punch``: hole punching toward peers reached only through the relay, and answering
    theirs (``agent.core.punch.PunchConfig``; ``enabled=False``: neither).
    """

    listen_host: str | None = "127.0.0.1"
    listen_port: int = 0
    advertise_host: str | None = None
    max_frame_bytes: int = 64 << 20
    connect_timeout_s: float = 5.0
    cert_lifetime_s: float = 30 * 24 * 3600.0
    deadline_check_interval_s: float = 1.0
    # a decode step every ~20 ms: one TAKEN frame stands for ~10 acks; a broken connection
    # fails at most a quarter second of steps that were in fact taken
    ack_delay_s: float = 0.25
    max_handshakes: int = 64
    # a tracker holds one per node and client of its swarm (its open-file limit must allow them)
    max_inbound_connections: int = 4096
    max_inbound_per_peer: int = 8
    idle_evict_s: float = 30.0
    max_requests_in_flight: int = 1024
    punch: PunchConfig = PunchConfig()

    def __post_init__(self) -> None:
        for name in (
            "max_frame_bytes", "max_handshakes", "max_inbound_connections", "max_inbound_per_peer",
            "max_requests_in_flight",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in (
            "connect_timeout_s",
            "cert_lifetime_s",
            "deadline_check_interval_s",
            "ack_delay_s",
            "idle_evict_s",
        ):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")


def tls_contexts(key: Ed25519PrivateKey, cert_lifetime_s: float) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """``(server, client)`` TLS 1.3 contexts presenting a fresh certificate for ``key``.

    Both require the peer's certificate (signed by the public issuer: see
    ``agent.core.peer_cert``); the peer id is checked after the handshake.
    """
    now = datetime.datetime.now(datetime.UTC)
    cert_pem, key_pem = make_peer_certificate(
        key,
        ec.generate_private_key(ec.SECP256R1()),
        serial_number=secrets.randbits(63) + 1,
        not_before=now - datetime.timedelta(hours=1),  # clock skew between peers
        not_after=now + datetime.timedelta(seconds=cert_lifetime_s),
    )
    contexts = []
    for purpose in (ssl.PROTOCOL_TLS_SERVER, ssl.PROTOCOL_TLS_CLIENT):
        context = ssl.SSLContext(purpose)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.check_hostname = False  # peers are named by peer id, checked after the handshake
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cadata=ISSUER_CERT_PEM.decode("ascii"))
        context.set_alpn_protocols(list(ALPN_VERSIONS))
        if purpose == ssl.PROTOCOL_TLS_SERVER:
            context.num_tickets = 0  # no resumption: one long-lived connection per peer pair
        # load_cert_chain reads files only: a private 0600 file that lives for this call
        with tempfile.TemporaryDirectory(prefix="baton-tls-") as folder:
            cert_path, key_path = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
            for path, data in ((cert_path, cert_pem), (key_path, key_pem)):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as file:
                    file.write(data)
            context.load_cert_chain(cert_path, key_path)
        contexts.append(context)
    return contexts[0], contexts[1]


class _TlsStream:
    """TLS over a TCP socket: an ``ssl.SSLSocket`` on the non-blocking socket, awaited through
    trio's low-level waits.

    Why not ``trio.SSLStream`` (or ``ssl.SSLObject`` and memory BIOs, which this stream used
    before): every byte then crosses two memory BIOs, a copy each way, and each decrypted
    record becomes a fresh bytes object, copied again into the frame reader: ~0.6 ms of a
    1 MiB round trip here. OpenSSL reads and writes the socket itself here: a frame is
    encrypted straight to the socket and decrypted straight into the frame reader's buffer
    (``receive_into``). One SSL object is read by the frame reader while a writer may be
    part-way through a send: TLS 1.3 keeps the two directions apart (no renegotiation), and
    a post-handshake message met while reading (a key update) is answered by OpenSSL.

    Why a raw non-blocking socket rather than ``trio.SocketStream``: every message of a
    decode step crosses this stream twice, and a send or receive that the kernel can take at
    once is then one system call, not a scheduler pass as well. The reader checkpoints at
    least every ``_READS_PER_CHECKPOINT`` receives, so a peer that never lets it block still
    cannot starve the other tasks or hide a cancellation.
    """

    def __init__(self, tcp: trio.SocketStream, context: ssl.SSLContext, *, server_side: bool) -> None:
        # the TCP socket leaves trio's stream (TCP_NODELAY stays set on it); this object owns
        # it. suppress_ragged_eofs=False: a stream cut without close_notify is an error, not
        # an end (a frame may be missing its end)
        plain = raw_socket.adopt(tcp)
        raw_socket.keep_alive(plain)  # an idle connection to a vanished peer ends (raw_socket)
        self._sock = context.wrap_socket(
            plain, server_side=server_side, do_handshake_on_connect=False, suppress_ragged_eofs=False
        )
        # a semaphore, not a Lock: a send started in the frame reader (send_nowait) may be
        # finished, and the stream released, by another task (finish_send)
        self._send_lock = trio.Semaphore(1)
        # whether the socket has bytes, asked without reading: a read that finds none costs
        # an SSLWantReadError (~4 us here, twice per message: before waiting and after the frame)
        self._poll = select.poll()
        self._poll.register(self._sock.fileno(), select.POLLIN)
        self._reads_since_checkpoint = 0
        self._tls_closed = False  # the peer's close_notify came
        self._failed: str | None = None  # why the incoming stream ended badly
        self.broken: str | None = None  # why the outgoing byte stream can no longer be trusted

    def close_soon(self, reason: str) -> None:
        """End the connection from outside its reader: the reader then sees it end."""
        self._break(reason)

    def _break(self, reason: str) -> None:
        if self.broken is None:
            self.broken = reason
            # the plain socket's shutdown: SSLSocket.shutdown would also drop the TLS
            # state that the reader still uses to report the end
            with contextlib.suppress(OSError):
                socket.socket.shutdown(self._sock, socket.SHUT_RDWR)

    async def do_handshake(self) -> None:
        while True:
            try:
                self._sock.do_handshake()
                return
            except ssl.SSLWantReadError:
                await trio.lowlevel.wait_readable(self._sock)  # type: ignore[arg-type]  # trio-typing's stale trio stubs
            except ssl.SSLWantWriteError:
                await trio.lowlevel.wait_writable(self._sock)  # type: ignore[arg-type]  # trio-typing's stale trio stubs
            except ssl.SSLEOFError:
                raise trio.BrokenResourceError("the peer closed the connection during the TLS handshake") from None

    def _write(self, view: memoryview) -> memoryview:
        """Encrypt and send what the socket takes now; what is left of ``view`` (empty: all
        of it went). A part left over must be written again, from its first byte, before
        anything else (OpenSSL has taken its first records already and expects the rest)."""
        while view:
            try:
                view = view[self._sock.send(view) :]
            except (ssl.SSLWantWriteError, ssl.SSLWantReadError, BlockingIOError):
                return view
            except OSError as error:  # ssl.SSLError too
                self._break(f"a send was cut short ({type(error).__name__})")
                raise trio.BrokenResourceError(f"send failed: {error}") from error
        return view

    async def _send_parts(self, parts: Sequence[memoryview]) -> None:
        """All of ``parts`` to the socket, waiting while it is full; the send lock is held.

        A send cut short (cancelled, or a socket error) may leave half a frame on the wire:
        the stream is marked broken and the socket shut, so the peer sees a truncated stream,
        never a corrupt frame."""
        try:
            for part in parts:
                while part := self._write(part):
                    await trio.lowlevel.wait_writable(self._sock)  # type: ignore[arg-type]  # trio-typing's stale trio stubs
        except BaseException as error:
            self._break(f"a send was cut short ({type(error).__name__})")
            raise

    async def send_all(self, *parts: bytes) -> None:
        """Encrypt ``parts`` and send them, as one unit: no other send comes between them."""
        await raw_socket.acquire(self._send_lock)
        try:
            if self.broken is not None:
                raise trio.BrokenResourceError(self.broken)
            await self._send_parts([memoryview(part) for part in parts])
        finally:
            self._send_lock.release()

    def send_nowait(self, *parts: bytes) -> list[memoryview] | None:
        """Encrypt ``parts`` and give the socket what it takes now, without waiting.

        Returns None when all of it went out. Otherwise returns what is still to send: the
        stream stays held for it (no other send may come between), and the caller must hand
        it to ``finish_send``.

        Raises:
          trio.WouldBlock: another send holds the stream (nothing was done).
          trio.BrokenResourceError: the stream is broken (it was, or this send broke it).
        """
        self._send_lock.acquire_nowait()
        rest: list[memoryview] | None = None
        try:
            if self.broken is not None:
                raise trio.BrokenResourceError(self.broken)
            for index, part in enumerate(parts):
                if left := self._write(memoryview(part)):
                    rest = [left, *(memoryview(later) for later in parts[index + 1 :])]
                    return rest
            return None
        finally:
            if rest is None:
                self._send_lock.release()

    async def finish_send(self, rest: list[memoryview]) -> None:
        """Send what ``send_nowait`` left, and release the stream."""
        try:
            await self._send_parts(rest)
        finally:
            self._send_lock.release()

    async def receive_into(self, buffer: memoryview, max_bytes: int = _RECEIVE_BYTES) -> int:
        """Decrypt into ``buffer`` what has come, ``max_bytes`` at most, waiting for at least
        one byte: how many bytes; 0 at a clean end (the peer's close_notify), then again on
        every call. Raises BrokenResourceError on an unclean end or a TLS error (after the
        bytes before it were returned), and again on every later call.

        ``max_bytes`` bounds the work between two of the reader's checkpoints (at most
        ``_READS_PER_CHECKPOINT`` receives): a 64 MiB frame arriving as fast as it decrypts
        must not hold the event loop (another session's decode step) for all of it."""
        if self._reads_since_checkpoint >= _READS_PER_CHECKPOINT:
            self._reads_since_checkpoint = 0
            await trio.lowlevel.checkpoint()
        filled = 0
        limit = min(len(buffer), max_bytes)
        waited = False
        woken = False  # wait_readable just returned: the socket has something
        while filled < limit:
            if self._failed is not None:
                if filled:
                    break
                raise trio.BrokenResourceError(self._failed)
            if self._tls_closed:
                break
            # OpenSSL reads no further ahead than the record it decrypts (Python never turns
            # read-ahead on): with no decrypted bytes left over, only the socket can have more
            if not woken and not self._sock.pending() and not self._poll.poll(0):
                if filled:
                    break
                waited = woken = True
                await trio.lowlevel.wait_readable(self._sock)  # type: ignore[arg-type]  # trio-typing's stale trio stubs
                continue
            woken = False
            try:
                # one record at most per call (OpenSSL's read); the rest of a big frame's
                # records follow in the same loop, into the same buffer
                # typeshed: read() returns bytes, but into a buffer it returns the count read
                received: int = self._sock.read(limit - filled, buffer[filled:])  # type: ignore[assignment]
            except ssl.SSLWantReadError:
                if filled:
                    break
                waited = True
                await trio.lowlevel.wait_readable(self._sock)  # type: ignore[arg-type]  # trio-typing's stale trio stubs
                continue
            except ssl.SSLWantWriteError:  # a post-handshake reply (key update) waits to go out
                if filled:
                    break
                waited = True
                await trio.lowlevel.wait_writable(self._sock)  # type: ignore[arg-type]  # trio-typing's stale trio stubs
                continue
            except ssl.SSLZeroReturnError:
                self._tls_closed = True
                break
            except (ssl.SSLError, OSError) as error:  # EOF without close_notify, garbage, a reset
                self._failed = f"TLS stream ended uncleanly ({error})"
                continue
            if not received:  # the peer's close_notify
                self._tls_closed = True
                break
            filled += received
        self._reads_since_checkpoint = 0 if waited else self._reads_since_checkpoint + 1
        return filled

    async def receive_some(self, max_bytes: int = _RECEIVE_BYTES) -> bytes:
        """Decrypted bytes, at most ``max_bytes``; b"" at a clean end (trio's
        ``receive_some``, for tests)."""
        buffer = bytearray(max_bytes)
        return bytes(buffer[: await self.receive_into(memoryview(buffer), max_bytes)])

    def getpeercert(self, binary_form: bool = True) -> bytes | None:
        return self._sock.getpeercert(binary_form=True)

    def selected_alpn_protocol(self) -> str | None:
        return self._sock.selected_alpn_protocol()

    async def aclose(self) -> None:
        """Close the socket (no close_notify: every frame is length-prefixed, so a cut is seen)."""
        if self._sock.fileno() != -1:
            trio.lowlevel.notify_closing(self._sock)  # type: ignore[arg-type]  # trio-typing's stale trio stubs
            self._sock.close()
        await trio.lowlevel.checkpoint()


def _peer_of(stream: _TlsStream) -> str:
    """The authenticated peer id of a finished handshake. Raises PeerCertError."""
    if stream.selected_alpn_protocol() not in ALPN_VERSIONS:
        raise PeerCertError(f"the peer did not negotiate any of {', '.join(ALPN_VERSIONS)}")
    der = stream.getpeercert(binary_form=True)
    if not der:
        raise PeerCertError("the peer presented no certificate")
    return verify_peer_certificate(der)


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

    def __init__(self, stream: _TlsStream, peer_id: str, max_frame_bytes: int, *, outbound: bool) -> None:
        self.stream = stream
        self.peer_id = peer_id
        self.outbound = outbound
        # the peer speaks channel version 2: quiet requests and TAKEN frames
        self.quiet_requests = stream.selected_alpn_protocol() == ALPN
        self.max_frame_bytes = max_frame_bytes
        self.reader = FrameReader(max_frame_bytes)
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


class ChannelTransport:
    """``Transport``: the direct channel where the peer has one, else ``fallback`` (libp2p).

    Made by ``open_channel_transport`` only. Counters (tests, benchmarks): ``channel_requests``
    (requests sent over the channel), ``requests_sent_soon`` (those of them sent by
    ``request_soon``), ``fallback_requests`` (sent through ``fallback``),
    ``connections_dialled``, ``connections_accepted``, ``connections_refused`` (inbound
    handshakes or peer certificates that failed, or over ``max_handshakes``),
    ``connections_evicted`` (accepted ones closed to make room, ``ChannelConfig``),
    ``frames_refused`` (connections closed for a bad frame), ``requests_refused_busy``,
    ``connections_punched`` (hole-punched connections that passed the TLS handshake);
    ``requests_by_path`` counts requests sent by (peer id, protocol id, over the channel),
    for ``path_counts``. Hole punching: ``puncher`` (``agent.io.punch.Puncher``).
    """

    def __init__(
        self,
        key: Ed25519PrivateKey,
        fallback: Transport,
        config: ChannelConfig,
        client_context: ssl.SSLContext,
        spawn: trio.MemorySendChannel,
        server_context: ssl.SSLContext | None = None,
    ) -> None:
        self._key = key
        self._peer_id = peer_id_of(key)
        if fallback.peer_id != self._peer_id:
            raise ValueError(f"the fallback transport is peer {fallback.peer_id}, the key is {self._peer_id}")
        self.fallback = fallback
        self.config = config
        self._client_context = client_context
        self._server_context = server_context  # a punched connection's TLS server side
        self._spawn = spawn  # to the task that runs connections (the nursery stays in open_*)
        self._handlers: dict[str, Handler] = {}
        self._connections: dict[str, _Connection] = {}
        self._inbound: set[_Connection] = set()  # accepted and serving
        self._handshakes = 0  # accepted, in their handshake
        self._dial_locks: dict[str, trio.Lock] = {}
        self.channel_addrs: list[str] = []
        self.channel_requests = 0
        self.requests_sent_soon = 0
        self.fallback_requests = 0
        self.connections_dialled = 0
        self.connections_accepted = 0
        self.connections_refused = 0
        self.connections_evicted = 0
        self.frames_refused = 0
        self.requests_refused_busy = 0
        self.connections_punched = 0
        self.requests_by_path: collections.Counter[tuple[str, str, bool]] = collections.Counter()
        self.puncher = Puncher(self._peer_id, fallback, config.punch, self._adopt_punched, self._has_connection)

    @property
    def handshakes_in_progress(self) -> int:
        """Accepted connections in their TLS handshake now (``ChannelConfig.max_handshakes``)."""
        return self._handshakes

    # -- Transport ---------------------------------------------------------------------------

    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def listen_addrs(self) -> list[str]:
        return list(self.channel_addrs) + list(self.fallback.listen_addrs)

    def set_handler(self, protocol_id: str, handler: Handler) -> None:
        self._handlers[protocol_id] = handler
        self.fallback.set_handler(protocol_id, handler)

    async def keep_relay_reservation(self, relay_addr: str) -> str:
        """The fallback's (libp2p) relay reservation; see ``P2PTransport.keep_relay_reservation``."""
        keep = getattr(self.fallback, "keep_relay_reservation", None)
        if keep is None:
            raise TransportError("?", "the fallback transport cannot hold relay reservations")
        return await keep(relay_addr)

    async def request(
        self, peer_id: str, addrs: Sequence[str], protocol_id: str, payload: bytes, *, timeout_s: float
    ) -> bytes:
        """Send ``payload`` to ``peer_id`` on ``protocol_id``; its reply. Raises TransportError.

        The channel when ``addrs`` name one (or a connection to the peer is open), else, or
        when every channel dial fails, the fallback with the other addresses; a peer reached
        only through the relay gets a hole punch started toward it (``agent.io.punch``), which
        this request does not wait for.

        Cancellation: the exchange is abandoned (its reply, if it comes, is dropped); the
        connection stays up for the others.
        """
        if len(payload) > self.config.max_frame_bytes:
            raise TransportError(
                peer_id, f"request of {len(payload)} bytes is over max_frame_bytes={self.config.max_frame_bytes}"
            )
        if peer_id == self._peer_id:
            raise TransportError(peer_id, "a peer cannot send a request to itself")
        channel_targets, others = [], []
        for addr in addrs:
            parsed = parse_channel_multiaddr(addr)
            if parsed is None:
                others.append(addr)
            elif parsed[2] != peer_id:
                raise TransportError(peer_id, f"channel address {addr} names another peer ({parsed[2]})")
            else:
                channel_targets.append(parsed)
        with trio.move_on_after(timeout_s) as scope:
            connection = self._connections.get(peer_id)
            if connection is not None and connection.closed is not None:
                connection = None  # failed, its reader not yet done with it: dial anew
            if connection is None and channel_targets:
                connection = await self._connect(peer_id, channel_targets)
            if connection is not None:
                self.channel_requests += 1
                self.requests_by_path[peer_id, protocol_id, True] += 1
                return await connection.request(protocol_id, payload)
        if scope.cancelled_caught:
            raise TransportError(peer_id, f"no reply on {protocol_id} within {timeout_s} s")
        self.fallback_requests += 1
        self.requests_by_path[peer_id, protocol_id, False] += 1
        if not channel_targets:
            self.puncher.punch_soon(peer_id, others)
        return await self.fallback.request(peer_id, others, protocol_id, payload, timeout_s=timeout_s)

    def request_soon(
        self,
        peer_id: str,
        protocol_id: str,
        payload: bytes,
        *,
        timeout_s: float,
        on_reply: OnReply,
        quiet: bool = False,
    ) -> bool:
        """Send ``payload`` to ``peer_id`` without waiting, over the channel connection already
        open to it, and have ``on_reply`` called with the reply, or with a TransportError when
        the connection fails or ``timeout_s`` passes (deadlines are checked every
        ``deadline_check_interval_s``).

        Why: a node pushes a step's output on and goes back to its worker; a task per push,
        there only to wait for the next hop's ack, cost a scheduler pass and a task start on
        every hop of every step. The reply is taken in the frame reader, with no task woken.

        ``on_reply`` runs in the frame reader or whichever task ends the exchange: it must
        neither await nor raise (start a task in a nursery of its own for anything more).

        ``quiet``: the requester needs to hear only what is not a plain acceptance. To a peer
        of channel version 2 the request goes as a QUIET_REQUEST: when the peer's handler
        counts its reply as an acceptance (``ImmediateHandler.is_acceptance``), no reply is
        sent and ``on_reply`` is never called; the peer confirms it in a TAKEN frame within
        its ``ack_delay_s``, which ends the exchange (so ``timeout_s`` must be longer). A
        refusal still comes at once, and a failed connection or a passed deadline still
        calls ``on_reply`` with a TransportError.

        Returns False, with nothing sent and no callback to come, when no connection is open
        to the peer, the payload is over ``max_frame_bytes``, or another send holds the stream:
        use ``request`` then. The rest of a send the kernel did not take at once goes out from
        the connection's writer.
        """
        connection = self._connections.get(peer_id)
        if connection is None or len(payload) > self.config.max_frame_bytes:
            return False
        deadline = trio.current_time() + timeout_s
        if not connection.request_soon(protocol_id, payload, deadline=deadline, on_reply=on_reply, quiet=quiet):
            return False
        self.channel_requests += 1
        self.requests_sent_soon += 1
        self.requests_by_path[peer_id, protocol_id, True] += 1
        return True

    def path_counts(self, protocol_ids: Sequence[str]) -> dict[str, tuple[int, int]]:
        """By peer id, ``(over the channel, through the fallback)``: the requests sent on
        ``protocol_ids`` (each request counts once, whatever it carries)."""
        wanted = set(protocol_ids)
        counts: dict[str, list[int]] = {}
        for (peer_id, protocol_id, direct), n in self.requests_by_path.items():
            if protocol_id in wanted:
                counts.setdefault(peer_id, [0, 0])[0 if direct else 1] += n
        return {peer_id: (direct, relayed) for peer_id, (direct, relayed) in counts.items()}

    def _has_connection(self, peer_id: str) -> bool:
        connection = self._connections.get(peer_id)
        return connection is not None and connection.closed is None

    async def _adopt_punched(self, peer_id: str, tcp: trio.SocketStream, tls_client: bool) -> bool:
        """A hole-punched TCP connection to ``peer_id`` as a channel connection: the TLS 1.3
        handshake in the role ``tls_client`` says (both sides dialled), the peer certificate
        checked against ``peer_id`` as for any connection, then served; it becomes this side's
        connection to the peer unless one is open already (then it is served as an accepted
        one). Whether it passed the handshake."""
        context = self._client_context if tls_client else self._server_context
        if context is None:
            await tcp.aclose()
            return False
        stream = _TlsStream(tcp, context, server_side=not tls_client)
        try:
            with trio.fail_after(self.config.connect_timeout_s):
                await stream.do_handshake()
            remote = _peer_of(stream)
            if remote != peer_id:
                raise PeerCertError(f"the punched peer proved to be {remote}, not {peer_id}")
        except (trio.TooSlowError, trio.BrokenResourceError, ssl.SSLError, PeerCertError, OSError) as error:
            log.info("punched connection to %s refused: %s: %s", peer_id, type(error).__name__, error)
            with trio.CancelScope(shield=True):
                await stream.aclose()
            return False
        except BaseException:
            with trio.CancelScope(shield=True):
                await stream.aclose()
            raise
        connection = _Connection(stream, peer_id, self.config.max_frame_bytes, outbound=tls_client)
        if self._has_connection(peer_id):
            self._inbound.add(connection)
        else:
            self._connections[peer_id] = connection
        self.connections_punched += 1
        try:
            await self._spawn.send(connection)  # its reader runs in open_channel_transport's nursery
        except BaseException:
            self._inbound.discard(connection)
            if self._connections.get(peer_id) is connection:
                del self._connections[peer_id]
            with trio.CancelScope(shield=True):
                await stream.aclose()
            raise
        return True

    async def serve_deadlines(self) -> None:
        """End the ``request_soon`` exchanges that are past their deadline, every
        ``deadline_check_interval_s`` (a backstop: a peer that fails is noticed by its
        connection failing, at once)."""
        while True:
            await trio.sleep(self.config.deadline_check_interval_s)
            now = trio.current_time()
            for connection in list(self._connections.values()):
                connection.expire(now)

    # -- dialling ----------------------------------------------------------------------------

    async def _connect(self, peer_id: str, targets: list[tuple[str, int, str]]) -> _Connection | None:
        """A live connection to ``peer_id``, dialling ``targets`` in turn; None when all fail."""
        lock = self._dial_locks.setdefault(peer_id, trio.Lock())
        async with lock:  # concurrent requests share one dial
            connection = self._connections.get(peer_id)
            if connection is not None and connection.closed is None:
                return connection
            for host, port, _ in targets:
                try:
                    with trio.fail_after(self.config.connect_timeout_s):
                        connection = await self._dial(peer_id, host, port)
                except (OSError, trio.TooSlowError, trio.BrokenResourceError, ssl.SSLError, PeerCertError) as error:
                    log.info("channel to %s at %s:%d failed: %s: %s", peer_id, host, port, type(error).__name__, error)
                    continue
                self._connections[peer_id] = connection
                return connection
        return None

    async def _dial(self, peer_id: str, host: str, port: int) -> _Connection:
        stream = _TlsStream(await trio.open_tcp_stream(host, port), self._client_context, server_side=False)
        try:
            await stream.do_handshake()
            remote = _peer_of(stream)
        except BaseException:
            with trio.CancelScope(shield=True):
                await stream.aclose()
            raise
        if remote != peer_id:
            await stream.aclose()
            raise PeerCertError(f"the peer at {host}:{port} proved to be {remote}, not {peer_id}")
        connection = _Connection(stream, peer_id, self.config.max_frame_bytes, outbound=True)
        self.connections_dialled += 1
        try:
            await self._spawn.send(connection)  # its reader runs in open_channel_transport's nursery
        except BaseException:
            with trio.CancelScope(shield=True):
                await stream.aclose()
            raise
        return connection

    # -- serving a connection (both directions) ----------------------------------------------

    async def run_connection(self, connection: _Connection) -> None:
        """Read frames until the connection ends; requests are answered in their own tasks.
        Never raises (but Cancelled): a bad frame closes this connection only."""
        try:
            async with trio.open_nursery() as handlers:
                handlers.start_soon(connection.serve_backlog)
                handlers.start_soon(connection.serve_acceptances, self.config.ack_delay_s)
                try:
                    await self._read_frames(connection, handlers)
                except FrameError as error:
                    self.frames_refused += 1
                    log.warning("channel from %s: %s; closing the connection", connection.peer_id, error)
                    connection.fail(f"bad frame: {error}")
                except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError) as error:
                    connection.fail(f"{type(error).__name__}: {error}")
                handlers.cancel_scope.cancel()
        finally:
            connection.fail(connection.closed or "closed")
            if self._connections.get(connection.peer_id) is connection:
                del self._connections[connection.peer_id]
            self._inbound.discard(connection)  # (a punched one served as accepted)
            with trio.CancelScope(shield=True):
                await connection.stream.aclose()

    async def _read_frames(self, connection: _Connection, handlers: trio.Nursery) -> None:
        reader = connection.reader
        stream = connection.stream
        while True:
            try:
                # straight into the reader's buffer (room for all of a frame whose length is
                # known), _RECEIVE_BYTES at most a call
                with reader.space(max(reader.needed(), _RECEIVE_BYTES)) as free:
                    received = await stream.receive_into(free)
            except trio.BrokenResourceError:
                if not reader.at_frame_boundary:  # the peer went away inside a frame
                    raise reader.truncation_error() from None
                raise
            if not received:
                if not reader.at_frame_boundary:
                    raise reader.truncation_error()
                connection.fail("the peer closed the connection")
                return
            reader.commit(received)
            connection.last_read_at = trio.current_time()
            later: list[tuple[bytes, bytes]] = []  # replies sent once the tasks they woke ran
            while (frame := reader.take_frame(parse_channel_frame)) is not None:
                kind = frame.kind
                if kind in (REQUEST, QUIET_REQUEST):
                    handler = self._handlers.get(frame.protocol_id)
                    if isinstance(handler, ImmediateHandler):  # answered here, no task
                        answer = _answered(connection, frame.protocol_id, handler.answer, frame.payload)
                        if (
                            kind == QUIET_REQUEST
                            and handler.is_acceptance is not None
                            and isinstance(answer, bytes)
                            and handler.is_acceptance(answer)
                        ):
                            connection.note_taken(frame.exchange_id)  # confirmed in bulk, later
                            continue
                        reply = _reply_frame(connection, frame.exchange_id, frame.protocol_id, answer)
                        if handler.reply_later:
                            later.append(reply)
                        else:
                            connection.send_frame_soon(*reply)
                    elif connection.requests_in_tasks >= self.config.max_requests_in_flight:
                        self.requests_refused_busy += 1
                        connection.send_frame_soon(
                            error_header(frame.exchange_id),
                            f"busy: {connection.requests_in_tasks} requests of this connection are being "
                            f"answered; send fewer at once".encode(),
                        )
                    else:
                        connection.requests_in_tasks += 1
                        handlers.start_soon(
                            self._answer, connection, handler, frame.exchange_id, frame.protocol_id, frame.payload
                        )
                elif kind == TAKEN:
                    connection.settle_taken(read_taken_ids(frame.payload))
                else:
                    connection.settle(frame.exchange_id, kind, frame.payload)
            if later:
                # the tasks these frames woke (a serving task starting a Forward) run before
                # the replies' system call, then every reply of this read goes in one write
                # (``ImmediateHandler.reply_later``). Two passes: trio runs the tasks of one
                # pass in any order, and the woken ones are in the next pass with this one.
                await trio.lowlevel.checkpoint()
                await trio.lowlevel.checkpoint()
                connection.send_frames_soon(later)

    async def _answer(
        self, connection: _Connection, handler: Handler | None, exchange_id: int, protocol_id: str, payload: bytes
    ) -> None:
        try:
            if handler is None:
                answer: bytes | Exception | None = None
            else:
                try:
                    answer = bytes(await handler(connection.peer_id, payload))
                except Exception as error:
                    log.exception("handler for %s failed on a request from %s", protocol_id, connection.peer_id)
                    answer = error
            await connection.send_frame_quietly(*_reply_frame(connection, exchange_id, protocol_id, answer))
        finally:
            connection.requests_in_tasks -= 1

    async def serve_inbound(self, server_context: ssl.SSLContext, tcp: trio.SocketStream) -> None:
        """One accepted TCP connection: handshake, check the peer's certificate, serve it."""
        if self._handshakes >= self.config.max_handshakes or not self._room_for(None):
            self.connections_refused += 1
            await tcp.aclose()
            return
        self._handshakes += 1
        stream = _TlsStream(tcp, server_context, server_side=True)
        try:
            with trio.fail_after(self.config.connect_timeout_s):
                await stream.do_handshake()
            remote = _peer_of(stream)
        except (trio.TooSlowError, trio.BrokenResourceError, ssl.SSLError, PeerCertError, OSError) as error:
            self.connections_refused += 1
            log.info("refused a channel connection: %s: %s", type(error).__name__, error)
            await stream.aclose()
            return
        finally:
            self._handshakes -= 1
        if not self._room_for(remote):
            self.connections_refused += 1
            log.info("refused a channel connection from %s: %d of its connections are in use", remote,
                     self.config.max_inbound_per_peer)  # fmt: skip
            await stream.aclose()
            return
        self.connections_accepted += 1
        connection = _Connection(stream, remote, self.config.max_frame_bytes, outbound=False)
        self._inbound.add(connection)
        try:
            await self.run_connection(connection)
        finally:
            self._inbound.discard(connection)

    def _room_for(self, peer_id: str | None) -> bool:
        """Whether a new accepted connection may be served, by the bound in all (``peer_id``
        None, before its handshake) or its peer's (``agent.core.connection_slots``); closes
        the idle connection it replaces."""
        bound = self.config.max_inbound_connections if peer_id is None else self.config.max_inbound_per_peer
        held = [c for c in self._inbound if c.closed is None and (peer_id is None or c.peer_id == peer_id)]
        room = room_for_one_more([c.last_read_at for c in held], bound, trio.current_time(), self.config.idle_evict_s)
        if room.close_first is not None:
            idle = held[room.close_first]
            self.connections_evicted += 1
            log.info("closing a channel connection from %s, idle, to make room for a newer one", idle.peer_id)
            idle.fail("closed to make room for a newer connection")
            idle.stream.close_soon("closed to make room for a newer connection")
        return room.take


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


@asynccontextmanager
async def open_channel_transport(
    key: Ed25519PrivateKey, fallback: Transport, config: ChannelConfig | None = None
) -> AsyncIterator[ChannelTransport]:
    """The direct channel for ``key`` in front of ``fallback`` (libp2p, same key).

    Resource handling: the listener and every connection close on exit; ``fallback`` is left
    open (its owner closes it).
    Cancellation: cancelling the enclosing scope closes the channel.
    """
    config = config or ChannelConfig()
    server_context, client_context = tls_contexts(key, config.cert_lifetime_s)
    spawn_send, spawn_receive = trio.open_memory_channel[_Connection](0)
    transport = ChannelTransport(key, fallback, config, client_context, spawn_send, server_context)

    async def run_dialled() -> None:
        async with trio.open_nursery() as connections:
            async for connection in spawn_receive:
                connections.start_soon(transport.run_connection, connection)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_dialled)
        nursery.start_soon(transport.serve_deadlines)
        await nursery.start(transport.puncher.serve)
        if config.listen_host is not None:
            listeners = await trio.open_tcp_listeners(config.listen_port, host=config.listen_host)
            nursery.start_soon(
                trio.serve_listeners, lambda tcp: transport.serve_inbound(server_context, tcp), listeners
            )
            host = config.advertise_host or config.listen_host
            port = listeners[0].socket.getsockname()[1]
            transport.channel_addrs.append(channel_multiaddr(host, port, transport.peer_id))
        try:
            yield transport
        finally:
            nursery.cancel_scope.cancel()
