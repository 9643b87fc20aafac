"""The direct channel's TLS: the contexts a peer presents, and the TLS stream over one socket.

Owns: ``ALPN_VERSIONS`` (the channel versions negotiated), ``tls_contexts`` (TLS 1.3 contexts
with a fresh libp2p-TLS certificate, ``agent.io.net.peer_cert``), ``_TlsStream`` (an
``ssl.SSLSocket`` on a raw non-blocking socket, awaited through trio's low-level waits) and
``_peer_of`` (the peer id a finished handshake proved). Split out of ``agent.io.net.channel``.

Must not import the channel's connections or transport (``agent.io.net.channel_connection``,
``agent.io.net.channel``): they build on this, not the other way round.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import secrets
import select
import socket
import ssl
import tempfile
from collections.abc import Sequence

import trio
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.io.net import raw_socket
from agent.io.net.peer_cert import ISSUER_CERT_PEM, PeerCertError, make_peer_certificate, verify_peer_certificate

__all__ = ["ALPN", "ALPN_VERSIONS", "tls_contexts"]

#: Negotiated by ALPN, newest first: a peer that speaks none of these fails the handshake.
#: Version 2 adds QUIET_REQUEST and TAKEN frames (``agent.core.net.frames``); a connection to a
#: version 1 peer sends every request as a plain REQUEST, answered one by one.
ALPN_VERSIONS = ("baton-channel/2", "baton-channel/1")
ALPN = ALPN_VERSIONS[0]
_RECEIVE_BYTES = 256 * 1024
_READS_PER_CHECKPOINT = 16  # receives that did not wait, at most, between two scheduler checkpoints


def tls_contexts(key: Ed25519PrivateKey, cert_lifetime_s: float) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """``(server, client)`` TLS 1.3 contexts presenting a fresh certificate for ``key``.

    Both require the peer's certificate (signed by the public issuer: see
    ``agent.io.net.peer_cert``); the peer id is checked after the handshake.
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

    def remote_host(self) -> str:
        """The peer's IP address ("" once the socket is gone)."""
        try:
            return str(self._sock.getpeername()[0])
        except OSError:
            return ""

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
