"""The direct data channel: ``Transport`` over one long-lived TLS 1.3 connection per peer pair.

Owns: listening for and dialling channel connections (``/ip4/<h>/tcp/<p>/tls/p2p/<id>``,
``agent.core.net.multiaddrs``), their TLS 1.3 handshake with libp2p-TLS certificates
(``agent.io.net.peer_cert``: an ephemeral P-256 certificate whose extension carries the peer's
Ed25519 key and its signature over the certificate key; mutual: both sides present one and
both check it), binding each connection to the peer id it proved, the exchanges multiplexed
on it (``agent.core.net.frames``: REQUEST / REPLY / ERROR frames with exchange ids, so requests
are pipelined: many in flight, answered in any order), the fallback to libp2p, and taking in
the connections hole punching makes (``agent.io.net.punch``).

``ChannelTransport.request`` goes over the channel when the peer advertises a channel address
(and the dial works: a refused or failed dial falls back before anything is sent); anything
else (the tracker, a peer reachable only through the circuit relay, a peer without a channel)
goes to the wrapped libp2p transport. Handlers are installed on both, so a peer is served the
same way whichever path a request took. A request that had to go through the relay to a peer
with no direct address sets off a hole punch in the background (``ChannelConfig.punch``): once
it connects, that connection is the channel's to the peer, and later requests take it. There is
no plaintext mode: a connection that does not complete the TLS 1.3 handshake with a valid peer
certificate is closed before a frame is read.

Bad input from the network (a frame over ``max_frame_bytes``, a request over its protocol's
limit or its peer's bytes in flight (``request_gate``, shared with the fallback: checked on the
frame's head, before room is made for the rest), a truncated frame, garbage, a big reply to no
request) closes that connection only: its pending requests fail with
``TransportError``; other connections and their sessions are untouched.

Its parts: ``agent.io.net.channel_config`` (``ChannelConfig``), ``agent.io.net.channel_tls`` (the TLS
contexts and stream), ``agent.io.net.channel_connection`` (one connection's exchanges); this module
dials, accepts and reads connections, runs their handlers and picks the channel or the fallback.

Must not import libp2p: the fallback is any ``Transport``.
"""

from __future__ import annotations

import collections
import logging
import ssl
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.core.net.connection_slots import room_for_one_more
from agent.core.net.frames import (
    QUIET_REQUEST,
    REQUEST,
    TAKEN,
    FrameError,
    error_header,
    parse_channel_frame,
    read_taken_ids,
)
from agent.core.net.multiaddrs import channel_multiaddr, parse_channel_multiaddr
from agent.core.wire.swarm_wire import request_limits
from agent.io.keys import peer_id_of
from agent.io.net.channel_config import ChannelConfig
from agent.io.net.channel_connection import OnReply, _answered, _Connection, _reply_frame
from agent.io.net.channel_tls import _RECEIVE_BYTES, _peer_of, _TlsStream, tls_contexts
from agent.io.net.peer_cert import PeerCertError
from agent.io.net.punch import Puncher
from agent.io.net.request_gate import RequestGate
from agent.io.net.transport import Handler, ImmediateHandler, Transport, TransportError, set_remote_host

__all__ = ["ChannelTransport", "open_channel_transport"]

log = logging.getLogger(__name__)


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
    for ``path_counts``. Hole punching: ``puncher`` (``agent.io.net.punch.Puncher``).
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
        #: request limits and bytes in flight, shared with the fallback (one host, one budget)
        self.request_gate: RequestGate = getattr(fallback, "request_gate", None) or RequestGate(
            request_limits(config.max_frame_bytes)
        )
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
        only through the relay gets a hole punch started toward it (``agent.io.net.punch``), which
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
            connection = self._live_connection(peer_id)
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
        connection = self._live_connection(peer_id)
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
        return self._live_connection(peer_id) is not None

    def _live_connection(self, peer_id: str) -> _Connection | None:
        """The open connection to ``peer_id``: this side's own, else one the peer opened (an
        owner's answers go back over the owner's own connection: it may have no address a node
        can dial, and a node then dials nothing it was only told of). None: none is open (a
        failed one whose reader is not yet done with it counts as none: dial anew)."""
        connection = self._connections.get(peer_id)
        if connection is not None and connection.closed is None:
            return connection
        for accepted in self._inbound:
            if accepted.peer_id == peer_id and accepted.closed is None:
                return accepted
        return None

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
        connection = _Connection(
            stream, peer_id, self.config.max_frame_bytes, outbound=tls_client, gate=self.request_gate
        )
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
            for connection in [*self._connections.values(), *self._inbound]:  # (answers go over either)
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
        connection = _Connection(stream, peer_id, self.config.max_frame_bytes, outbound=True, gate=self.request_gate)
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
        set_remote_host(connection.stream.remote_host())
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
            connection.answered(connection.took_request())  # a request cut off as it arrived
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
                    held = connection.took_request()  # its bytes, in flight until answered
                    handler = self._handlers.get(frame.protocol_id)
                    if isinstance(handler, ImmediateHandler):  # answered here, no task
                        answer = _answered(connection, frame.protocol_id, handler.answer, frame.payload)
                        connection.answered(held)
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
                        connection.answered(held)
                        self.requests_refused_busy += 1
                        connection.send_frame_soon(
                            error_header(frame.exchange_id),
                            f"busy: {connection.requests_in_tasks} requests of this connection are being "
                            f"answered; send fewer at once".encode(),
                        )
                    else:
                        connection.requests_in_tasks += 1
                        handlers.start_soon(
                            self._answer, connection, handler, frame.exchange_id, frame.protocol_id, frame.payload, held
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
        self,
        connection: _Connection,
        handler: Handler | None,
        exchange_id: int,
        protocol_id: str,
        payload: bytes,
        held: int,
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
            connection.answered(held)

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
        connection = _Connection(stream, remote, self.config.max_frame_bytes, outbound=False, gate=self.request_gate)
        self._inbound.add(connection)
        try:
            await self.run_connection(connection)
        finally:
            self._inbound.discard(connection)

    def _room_for(self, peer_id: str | None) -> bool:
        """Whether a new accepted connection may be served, by the bound in all (``peer_id``
        None, before its handshake) or its peer's (``agent.core.net.connection_slots``); closes
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
