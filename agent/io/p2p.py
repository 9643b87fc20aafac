"""The libp2p peer transport: ``agent.io.transport.Transport`` over py-libp2p 0.8.1 (trio).

Owns: building a libp2p host from the node's Ed25519 key with the settings DESIGN.md makes
mandatory (Noise only, yamux only, one connection per peer, ping health checks that abort a
frozen connection), the per-peer pool of reused streams, and guarding every stream handler.
Framing (``uvarint(len) || payload``) and multiaddr strings come from ``agent.core.frames``
and ``agent.core.multiaddrs`` (one definition for libp2p and the direct channel); the circuit
relay's policy and py-libp2p workarounds live in ``agent.io.p2p_relay``; the direct data
channel in front of this transport is ``agent.io.channel``. The swarm protocols above it see
only ``Transport``. No nursery is kept on the transport (reservation refreshes go to a task
of ``open_p2p_transport`` through a channel).

Wire: a stream carries a sequence of exchanges, one at a time: the dialler writes one request
frame, the listener answers with one reply frame, and so on until either side closes the
stream. A frame is ``uvarint(len(payload)) || payload``. A frame over the reader's limit is
never allocated: the reader resets the stream (the requester sees ``TransportError``).

Why the pool: opening a yamux stream costs a round trip for multistream-select; reusing an open
stream keeps a request at one round trip. Concurrent requests to one peer take further pooled
streams, at most ``max_streams_per_peer`` busy at once (yamux in py-libp2p blocks the 257th
outbound stream of a connection: ``stream_backlog_semaphore``), plus at most
``max_idle_streams_per_peer`` kept open idle.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import multiaddr
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from libp2p import new_host
from libp2p.abc import IHost, INetConn, INetStream
from libp2p.crypto.ed25519 import Ed25519PrivateKey as Libp2pEd25519PrivateKey
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.network.config import ConnectionConfig, RetryConfig
from libp2p.network.swarm import Swarm
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as RELAY_HOP_PROTOCOL_ID
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.tools.anyio_service import background_trio_service

from agent.core.frames import FrameError, FrameTooLarge, decode_uvarint, encode_uvarint
from agent.core.multiaddrs import circuit_multiaddr, is_channel_multiaddr, peer_id_from_multiaddr
from agent.io.keys import peer_id_of, private_seed
from agent.io.p2p_relay import GatedRelayProtocol, NoAutoConnector, RelayPolicy
from agent.io.transport import Handler, TransportError

__all__ = [
    "FrameTooLarge",
    "P2PTransport",
    "RelayPolicy",
    "decode_uvarint",
    "encode_uvarint",
    "open_p2p_transport",
]

log = logging.getLogger(__name__)

DEFAULT_LISTEN_ADDRS = ("/ip4/127.0.0.1/tcp/0",)
YAMUX_OUTBOUND_STREAM_LIMIT = 256  # py-libp2p yamux: Yamux.stream_backlog_semaphore
_STREAM_HEADROOM = 16  # outbound streams left to libp2p itself (identify, ping, relay)
_READ_CHUNK_BYTES = 64 * 1024
_SINGLE_WRITE_BYTES = 16 * 1024  # below this, prefix and payload go out in one write
_RESET_TIMEOUT_S = 1.0
_PEERSTORE_ADDR_TTL_S = 600  # resetting a broken stream must not hold up the caller for long


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
        while True:
            decoded = decode_uvarint(self._buffer)
            if decoded is not None:
                break
            chunk = await self._read_some(_READ_CHUNK_BYTES)
            if not chunk:
                raise FrameError("stream ended inside a length prefix" if self._buffer else "stream ended")
            self._buffer += chunk
        length, used = decoded
        if length > max_bytes:
            raise FrameTooLarge(f"frame of {length} bytes is over the limit of {max_bytes} bytes")
        del self._buffer[:used]
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


class P2PTransport:
    """``Transport`` over a running libp2p host. Made by ``open_p2p_transport`` only.

    Counters (for tests and benchmarks): ``streams_opened`` (outbound streams this transport
    opened for requests) and ``streams_accepted`` (inbound streams its handlers served).
    """

    def __init__(
        self,
        host: IHost,
        peer_id: str,
        *,
        max_frame_bytes: int,
        connect_timeout_s: float,
        frame_timeout_s: float,
        max_streams_per_peer: int,
        max_idle_streams_per_peer: int,
    ) -> None:
        self._host = host
        self._peer_id = peer_id
        self._max_frame_bytes = max_frame_bytes
        self._connect_timeout_s = connect_timeout_s
        self._frame_timeout_s = frame_timeout_s
        self._max_streams_per_peer = max_streams_per_peer
        self._max_idle_streams_per_peer = max_idle_streams_per_peer
        self._peers: dict[str, _PeerStreams] = {}
        self._relay_addrs: list[str] = []
        self._circuit: CircuitV2Transport | None = None
        self._relay_policy = RelayPolicy.open()
        #: relay peer id -> the connection its reservation was made over
        self._reserved_over: dict[str, INetConn] = {}
        self._reservation_lock = trio.Lock()
        # py-libp2p starts reservation refreshes with ``start_soon``: they go through this
        # channel to a task of ``open_p2p_transport`` (no nursery kept on the transport)
        self._background: _Spawner | None = None
        self.streams_opened = 0
        self.streams_accepted = 0

    # -- Transport ---------------------------------------------------------------------------

    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def listen_addrs(self) -> list[str]:
        suffix = f"/p2p/{self._peer_id}"
        direct = [f"{addr}{suffix}" for addr in self._host.get_transport_addrs()]
        return direct + list(self._relay_addrs)

    @property
    def host(self) -> IHost:
        """The libp2p host (for diagnostics and tests; protocols use ``request``/``set_handler``)."""
        return self._host

    @property
    def relay_policy(self) -> RelayPolicy:
        """Who may reserve and open circuits here (only matters with ``enable_relay_hop``)."""
        return self._relay_policy

    @relay_policy.setter
    def relay_policy(self, policy: RelayPolicy) -> None:
        self._relay_policy = policy

    async def keep_relay_reservation(self, relay_addr: str) -> str:
        """Hold a reservation on the relay at ``relay_addr`` (``.../p2p/<relay id>``) and
        advertise ``<relay_addr>/p2p-circuit/p2p/<our id>`` in ``listen_addrs``; returns that address.

        Cheap when the reservation was made over the connection to the relay that is still
        open. Otherwise (first call, connection lost, relay restarted: a relay keeps a
        reservation only while the reserving peer stays connected) it connects and reserves
        again. py-libp2p refreshes a reservation before its TTL runs out.

        Raises:
          TransportError: the relay could not be reached, or refused or failed the reservation.
        """
        relay_peer_id = _p2p_component(relay_addr)
        if relay_peer_id is None:
            raise TransportError("?", f"relay address {relay_addr} has no /p2p/<relay peer id>")
        if self._circuit is None or self._background is None:
            raise TransportError(relay_peer_id, "the transport is not running")
        relay = ID.from_base58(relay_peer_id)
        async with self._reservation_lock:
            network = self._host.get_network()
            held = self._reserved_over.get(relay_peer_id)
            if held is not None and not held.is_closed and any(c is held for c in network.connections.get(relay, ())):
                return circuit_multiaddr(relay_addr, self._peer_id)
            self._reserved_over.pop(relay_peer_id, None)
            await self._ensure_connected(self._peer_streams(relay_peer_id), relay, relay_peer_id, [relay_addr])
            try:
                with trio.fail_after(self._connect_timeout_s):
                    stream = await self._host.new_stream(relay, [RELAY_HOP_PROTOCOL_ID])
                    try:
                        # (ignored) libp2p asks for a Nursery, but reserve() only calls start_soon
                        reserved = await self._circuit.reserve(stream, relay, self._background)  # type: ignore[arg-type]
                    finally:
                        await _close_quietly(stream)
            except trio.TooSlowError:
                raise TransportError(
                    relay_peer_id, f"no relay reservation within {self._connect_timeout_s} s"
                ) from None
            except Exception as error:
                raise TransportError(
                    relay_peer_id, f"relay reservation failed ({type(error).__name__}: {error})"
                ) from error
            if not reserved:
                raise TransportError(relay_peer_id, "the relay refused the reservation")
            over = [
                c for c in network.connections.get(relay, ()) if getattr(c, "muxed_conn", None) is stream.muxed_conn
            ]
            if over:
                self._reserved_over[relay_peer_id] = over[0]
            addr = circuit_multiaddr(relay_addr, self._peer_id)
            if addr not in self._relay_addrs:
                self._relay_addrs.append(addr)
            log.info("holding a relay reservation on %s", relay_peer_id)
            return addr

    def set_handler(self, protocol_id: str, handler: Handler) -> None:
        async def guarded(stream: INetStream) -> None:
            await self._serve_stream(protocol_id, handler, stream)

        self._host.set_stream_handler(TProtocol(protocol_id), guarded)

    async def request(
        self, peer_id: str, addrs: Sequence[str], protocol_id: str, payload: bytes, *, timeout_s: float
    ) -> bytes:
        """Send ``payload`` on ``protocol_id`` to ``peer_id`` and return its reply.

        Dials ``addrs`` when there is no connection to the peer (the Noise handshake checks
        that the peer holds ``peer_id``'s key). Raises ``TransportError`` for every failure:
        bad peer id or address, dial failure, protocol not supported, stream reset, a frame
        over ``max_frame_bytes`` either way, or no reply within ``timeout_s``.

        Cancellation: cancelling the caller resets the stream in use (its state is unknown);
        other pooled streams are unaffected.
        """
        if len(payload) > self._max_frame_bytes:
            raise TransportError(
                peer_id, f"request of {len(payload)} bytes is over max_frame_bytes={self._max_frame_bytes}"
            )
        if peer_id == self._peer_id:
            raise TransportError(peer_id, "a peer cannot send a request to itself")
        try:
            remote = ID.from_base58(peer_id)
        except Exception as error:
            raise TransportError(peer_id, f"not a valid peer id ({error})") from None
        try:
            with trio.fail_after(timeout_s):
                return await self._exchange(remote, peer_id, addrs, protocol_id, bytes(payload))
        except trio.TooSlowError:
            raise TransportError(peer_id, f"no reply on {protocol_id} within {timeout_s} s") from None

    # -- requester side ----------------------------------------------------------------------

    def _peer_streams(self, peer_id: str) -> _PeerStreams:
        streams = self._peers.get(peer_id)
        if streams is None:
            streams = _PeerStreams(busy_slots=trio.Semaphore(self._max_streams_per_peer))
            self._peers[peer_id] = streams
        return streams

    async def _exchange(
        self, remote: ID, peer_id: str, addrs: Sequence[str], protocol_id: str, payload: bytes
    ) -> bytes:
        peer = self._peer_streams(peer_id)
        async with peer.busy_slots:
            pooled = await self._take_idle(peer, protocol_id)
            if pooled is None:
                pooled = await self._open_stream(peer, remote, peer_id, addrs, protocol_id)
            reusable = False
            try:
                await pooled.framed.write_frame(payload)
                reply = await pooled.framed.read_frame(self._max_frame_bytes)
                reusable = True
            except FrameTooLarge as error:
                raise TransportError(peer_id, f"reply on {protocol_id} refused: {error}") from None
            except Exception as error:
                raise TransportError(
                    peer_id, f"stream on {protocol_id} failed ({type(error).__name__}: {error})"
                ) from error
            finally:
                if reusable:
                    await self._give_back(peer, pooled)
                else:
                    await _reset_quietly(pooled.stream)
            return reply

    async def _take_idle(self, peer: _PeerStreams, protocol_id: str) -> _PooledStream | None:
        idle = peer.idle.get(protocol_id)
        while idle:
            pooled = idle.pop()
            if pooled.looks_alive():
                return pooled
            await _reset_quietly(pooled.stream)
        return None

    async def _give_back(self, peer: _PeerStreams, pooled: _PooledStream) -> None:
        if not pooled.looks_alive():
            await _reset_quietly(pooled.stream)
        elif peer.idle_count() >= self._max_idle_streams_per_peer:
            await _close_quietly(pooled.stream)
        else:
            peer.idle.setdefault(pooled.protocol_id, []).append(pooled)

    async def _open_stream(
        self, peer: _PeerStreams, remote: ID, peer_id: str, addrs: Sequence[str], protocol_id: str
    ) -> _PooledStream:
        await self._ensure_connected(peer, remote, peer_id, addrs)
        try:
            stream = await self._host.new_stream(remote, [TProtocol(protocol_id)])
        except Exception as error:
            raise TransportError(
                peer_id, f"could not open a stream on {protocol_id} ({type(error).__name__}: {error})"
            ) from error
        self.streams_opened += 1
        return _PooledStream(_FramedStream(stream), protocol_id)

    async def _ensure_connected(self, peer: _PeerStreams, remote: ID, peer_id: str, addrs: Sequence[str]) -> None:
        network = _swarm(self._host)
        if network.connections.get(remote):
            return
        # a direct channel address (agent.io.channel) is TLS + Baton frames, not libp2p
        dial_addrs = [_dial_multiaddr(peer_id, addr) for addr in addrs if not is_channel_multiaddr(addr)]
        async with peer.dial_lock:  # concurrent requests share one dial
            if network.connections.get(remote):
                return
            # py-libp2p refuses to dial a peer for 60 s after a failed dial (network/swarm.py
            # _NegativePeerCache); callers here own their retry policy, and a restarted node
            # must be reachable at once.
            network.unblock_peer(remote)
            failures: list[str] = []
            try:
                with trio.fail_after(self._connect_timeout_s):
                    if not dial_addrs:  # whatever the peerstore knows (e.g. from identify)
                        await self._host.connect(PeerInfo(remote, []))
                        return
                    # Each address in turn: the swarm's dial_peer() tries at most one address
                    # per transport (network/swarm.py MAX_ADDRS_PER_PEER), skips loopback ones
                    # when others exist, and mixes in stale peerstore addresses.
                    for maddr in dial_addrs:
                        try:
                            if _is_circuit(maddr):
                                if self._circuit is None:
                                    raise TransportError(peer_id, "relay transport not running")
                                # the circuit transport looks the target up in the peerstore
                                # first (and logs a warning when it is not there)
                                self._host.get_peerstore().add_addrs(remote, [maddr], _PEERSTORE_ADDR_TTL_S)
                                conn = await self._circuit.dial(maddr)
                            else:
                                conn = await network.dial_addr(maddr, remote)
                        except Exception as error:
                            failures.append(f"{maddr}: {type(error).__name__}: {error}")
                            continue
                        started = getattr(conn, "event_started", None)
                        if started is not None:
                            await started.wait()
                        self._host.get_peerstore().add_addrs(remote, [maddr], _PEERSTORE_ADDR_TTL_S)
                        return
            except trio.TooSlowError:
                raise TransportError(peer_id, f"could not connect within {self._connect_timeout_s} s") from None
            except Exception as error:
                raise TransportError(peer_id, f"could not connect ({type(error).__name__}: {error})") from error
            raise TransportError(peer_id, f"could not connect ({'; '.join(failures)})")

    # -- listener side -----------------------------------------------------------------------

    async def _serve_stream(self, protocol_id: str, handler: Handler, stream: INetStream) -> None:
        """Answer request frames on one inbound stream until it closes. Never raises (except
        cancellation): a failure is logged and the stream reset; the host keeps serving."""
        self.streams_accepted += 1
        remote = "?"
        try:
            remote = str(stream.muxed_conn.peer_id)
            framed = _FramedStream(stream)
            while await framed.wait_readable():
                with trio.fail_after(self._frame_timeout_s):
                    request = await framed.read_frame(self._max_frame_bytes)
                try:
                    reply = bytes(await handler(remote, request))
                except Exception:
                    log.exception(
                        "handler for %s failed on a request from %s; resetting the stream", protocol_id, remote
                    )
                    await _reset_quietly(stream)
                    return
                if len(reply) > self._max_frame_bytes:
                    log.error(
                        "handler for %s returned %d bytes, over max_frame_bytes=%d; resetting the stream",
                        protocol_id,
                        len(reply),
                        self._max_frame_bytes,
                    )
                    await _reset_quietly(stream)
                    return
                await framed.write_frame(reply)
        except FrameTooLarge as error:
            log.warning("refused a request on %s from %s: %s", protocol_id, remote, error)
            await _reset_quietly(stream)
        except trio.TooSlowError:
            log.warning(
                "a request frame on %s from %s did not arrive within %s s", protocol_id, remote, self._frame_timeout_s
            )
            await _reset_quietly(stream)
        except Exception as error:  # stream reset, connection gone, malformed prefix
            log.debug("stream on %s from %s ended: %s: %s", protocol_id, remote, type(error).__name__, error)
            await _reset_quietly(stream)
        else:
            await _close_quietly(stream)


def _swarm(host: IHost) -> Swarm:
    # new_host() builds a Swarm; get_network() is typed as the INetworkService interface, which
    # lacks the swarm's dial settings and unblock_peer used here
    return cast(Swarm, host.get_network())


class _Spawner:
    """What py-libp2p's ``CircuitV2Transport.reserve`` takes as a nursery: only ``start_soon``,
    handed to the task that owns the real nursery."""

    def __init__(self, send: trio.MemorySendChannel) -> None:
        self._send = send

    def start_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        self._send.send_nowait((fn, args))


async def _run_spawned(receive: trio.MemoryReceiveChannel, nursery: trio.Nursery) -> None:
    async for fn, args in receive:
        nursery.start_soon(fn, *args)


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


def _dial_multiaddr(peer_id: str, addr: str) -> multiaddr.Multiaddr:
    """``addr`` without its ``/p2p/<id>`` suffix; refuses one naming a different peer."""
    try:
        maddr = multiaddr.Multiaddr(addr)
    except Exception as error:
        raise TransportError(peer_id, f"bad multiaddr {addr!r} ({error})") from None
    if _is_circuit(maddr):  # /.../p2p/<relay>/p2p-circuit[/p2p/<target>]: the target's id stays
        target = addr.rsplit("/p2p-circuit", 1)[1]
        if not target:
            return maddr.encapsulate(multiaddr.Multiaddr(f"/p2p/{peer_id}"))
        if target != f"/p2p/{peer_id}":
            raise TransportError(peer_id, f"relay multiaddr {addr} names another peer")
        return maddr
    try:
        named = maddr.value_for_protocol("p2p")
    except Exception:
        named = None
    if named:
        if named != peer_id:
            raise TransportError(peer_id, f"multiaddr {addr} names another peer ({named})")
        maddr = maddr.decapsulate(multiaddr.Multiaddr(f"/p2p/{named}"))
    return maddr


def _is_circuit(maddr: multiaddr.Multiaddr) -> bool:
    return any(protocol.name == "p2p-circuit" for protocol in maddr.protocols())


def _p2p_component(addr: str) -> str | None:
    """The last /p2p/<id> of a direct multiaddr."""
    try:
        return peer_id_from_multiaddr(addr)
    except ValueError:
        return None


def _libp2p_key_pair(key: Ed25519PrivateKey) -> KeyPair:
    private = Libp2pEd25519PrivateKey.new(private_seed(key))
    return KeyPair(private, private.get_public_key())


def _check_listen_addr(addr: str) -> multiaddr.Multiaddr:
    maddr = multiaddr.Multiaddr(addr)
    names = [protocol.name for protocol in maddr.protocols()]
    if len(names) != 2 or names[0] not in ("ip4", "ip6") or names[1] != "tcp":
        raise ValueError(f"listen address {addr} is not /ip4|ip6/<address>/tcp/<port>")
    return maddr


@asynccontextmanager
async def open_p2p_transport(
    key: Ed25519PrivateKey,
    *,
    listen_addrs: Sequence[str] = DEFAULT_LISTEN_ADDRS,
    max_frame_bytes: int = 64 << 20,
    connect_timeout_s: float = 5.0,
    frame_timeout_s: float = 60.0,
    ping_interval_s: float = 10.0,
    ping_timeout_s: float = 5.0,
    max_streams_per_peer: int = 128,
    max_idle_streams_per_peer: int = 16,
    close_timeout_s: float = 5.0,
    dial_retries: int = 0,
    enable_relay_hop: bool = False,
    relay_policy: RelayPolicy | None = None,
    relay_addrs: Sequence[str] = (),
    relay_max_reservations: int = 128,
    relay_max_circuits: int = 64,
    relay_circuit_duration_s: int = 3600,
    relay_circuit_bytes: int = 1 << 30,
) -> AsyncIterator[P2PTransport]:
    """A libp2p host for ``key``, listening on ``listen_addrs``, as a ``Transport``.

    Args:
        key: the node's identity; its libp2p peer id is ``agent.io.keys.peer_id_of(key)``.
        listen_addrs: TCP multiaddrs; port 0 picks a free port (see ``listen_addrs`` on the
            result). The default listens on loopback only.
            Empty: a host that accepts no direct connections (it can still dial out, and be
            reached through a relay it holds a reservation on).
        max_frame_bytes: the largest frame read or written, either direction.
        connect_timeout_s: limit on dialling a peer (TCP + Noise + yamux).
        frame_timeout_s: once a request frame has begun to arrive, the limit on the rest of it.
        ping_interval_s, ping_timeout_s: health checks; a connection whose ping fails is
            closed, so requests to a frozen peer fail instead of waiting forever.
        max_streams_per_peer: requests in flight to one peer at once (more wait their turn);
            with ``max_idle_streams_per_peer`` at most ``256 - 16`` (yamux's outbound limit,
            minus room for libp2p's own streams).
        max_idle_streams_per_peer: open streams kept for reuse per peer.
        close_timeout_s: limit on closing connections and listeners on exit.
        dial_retries: extra attempts per address when a dial fails (libp2p backs off 0.1 s,
            0.2 s, ...); 0 by default, since callers own their retry policy.
        enable_relay_hop: act as a circuit relay v2 (the tracker): peers reserve slots here
            and others reach them through ``<our addr>/p2p-circuit/p2p/<their id>``.
        relay_policy: who may reserve and open circuits here (``RelayPolicy``; default:
            anyone). Can be replaced later through ``P2PTransport.relay_policy``.
        relay_addrs: relays (``/ip4/.../tcp/N/p2p/<relay id>``) to reserve a slot on at
            start (``keep_relay_reservation``); each success adds
            ``<relay addr>/p2p-circuit/p2p/<our id>`` to ``listen_addrs``. A refused or
            failed reservation raises ``TransportError``.
        relay_max_reservations, relay_max_circuits, relay_circuit_duration_s,
            relay_circuit_bytes: limits of the relay role (py-libp2p's defaults are 4
            reservations and 8 circuits).

    Every host can dial ``/p2p-circuit`` addresses and accept relayed connections (the
    circuit is end-to-end Noise, so the relay sees only ciphertext and cannot impersonate).
    Dialling a circuit makes no reservation (py-libp2p's relay CLIENT role would take one on
    every dial); only ``relay_addrs`` / ``keep_relay_reservation`` do. py-libp2p's
    auto-connector (dials peerstore peers up to 200 connections) is off: Baton dials
    explicitly.

    Resource handling: the host, its listeners and all connections close on exit.
    Cancellation: cancelling the enclosing scope closes the host.
    """
    if max_frame_bytes < 1:
        raise ValueError(f"max_frame_bytes must be positive, got {max_frame_bytes}")
    if max_streams_per_peer < 1 or max_idle_streams_per_peer < 0:
        raise ValueError("max_streams_per_peer must be positive and max_idle_streams_per_peer not negative")
    if max_streams_per_peer + max_idle_streams_per_peer > YAMUX_OUTBOUND_STREAM_LIMIT - _STREAM_HEADROOM:
        raise ValueError(
            f"max_streams_per_peer + max_idle_streams_per_peer must be at most "
            f"{YAMUX_OUTBOUND_STREAM_LIMIT - _STREAM_HEADROOM} (yamux blocks the "
            f"{YAMUX_OUTBOUND_STREAM_LIMIT + 1}th stream of a connection)"
        )
    for value, name in (
        (connect_timeout_s, "connect_timeout_s"),
        (frame_timeout_s, "frame_timeout_s"),
        (ping_interval_s, "ping_interval_s"),
        (ping_timeout_s, "ping_timeout_s"),
        (close_timeout_s, "close_timeout_s"),
    ):
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a positive number of seconds, got {value}")
    if dial_retries < 0:
        raise ValueError(f"dial_retries must not be negative, got {dial_retries}")
    listen_maddrs = [_check_listen_addr(addr) for addr in listen_addrs]

    key_pair = _libp2p_key_pair(key)
    peer_id = peer_id_of(key)
    host = _new_host(
        key_pair,
        listen_maddrs,
        connect_timeout_s=connect_timeout_s,
        ping_interval_s=ping_interval_s,
        ping_timeout_s=ping_timeout_s,
    )
    network = _swarm(host)
    # new_host() has no retry_config parameter (new_swarm() has); the swarm reads the attribute.
    network.retry_config = RetryConfig(max_retries=dial_retries)
    network.auto_connector = NoAutoConnector(network, network.connection_config.auto_connect_interval)
    if str(host.get_id()) != peer_id:  # both derive the id from the same key; never differ
        raise RuntimeError(f"libp2p peer id {host.get_id()} differs from {peer_id}")
    transport = P2PTransport(
        host,
        peer_id,
        max_frame_bytes=max_frame_bytes,
        connect_timeout_s=connect_timeout_s,
        frame_timeout_s=frame_timeout_s,
        max_streams_per_peer=max_streams_per_peer,
        max_idle_streams_per_peer=max_idle_streams_per_peer,
    )
    if relay_policy is not None:
        transport.relay_policy = relay_policy
    relay_protocol = GatedRelayProtocol(
        host,
        policy=lambda: transport.relay_policy,
        limits=RelayLimits(
            duration=relay_circuit_duration_s,
            data=relay_circuit_bytes,
            max_circuit_conns=relay_max_circuits,
            max_reservations=relay_max_reservations,
        ),
        allow_hop=enable_relay_hop,
    )
    roles = RelayRole.STOP | (RelayRole.HOP if enable_relay_hop else RelayRole(0))
    transport._circuit = CircuitV2Transport(host, relay_protocol, RelayConfig(roles=roles))
    # Raised after every nursery has exited, so the caller gets it bare, not in a group.
    reservation_failure: TransportError | None = None
    async with host.run(listen_maddrs):
        try:
            async with background_trio_service(relay_protocol):
                await relay_protocol.event_started.wait()
                async with trio.open_nursery() as nursery:  # reservation refreshes
                    spawn_send, spawn_receive = trio.open_memory_channel[tuple](64)
                    nursery.start_soon(_run_spawned, spawn_receive, nursery)
                    transport._background = _Spawner(spawn_send)
                    try:
                        for relay_addr in relay_addrs:
                            await transport.keep_relay_reservation(relay_addr)
                    except TransportError as error:
                        reservation_failure = error
                    else:
                        try:
                            yield transport
                        finally:
                            nursery.cancel_scope.cancel()
                    nursery.cancel_scope.cancel()
                transport._background = None
        finally:
            # host.run's own exit closes connections inside an already-cancelled scope, so
            # SwarmConn.close() is cut short and dialled sockets leak (network/swarm.py, the
            # service's `finally`); Swarm.close() first, unhurried, closes them for real.
            with trio.CancelScope(shield=True), trio.move_on_after(close_timeout_s):
                await host.get_network().close()
    if reservation_failure is not None:
        raise reservation_failure


def _new_host(
    key_pair: KeyPair,
    listen_maddrs: list[multiaddr.Multiaddr],
    *,
    connect_timeout_s: float,
    ping_interval_s: float,
    ping_timeout_s: float,
) -> IHost:
    connection_config = ConnectionConfig(
        max_connections_per_peer=1,  # otherwise every dial waits 250 ms for more connections
        dial_timeout=connect_timeout_s,
        outbound_upgrade_timeout=connect_timeout_s,
        enable_health_monitoring=True,
        health_initial_delay=ping_interval_s,
        health_warmup_window=0.0,
        health_check_interval=ping_interval_s,
        ping_timeout=ping_timeout_s,
        abort_connection_on_ping_failure=True,
    )
    security: dict[TProtocol, Any] = {
        # Noise only: the default table also offers /plaintext/2.0.0 (claims any peer id), TLS
        # and SECIO.
        NOISE_PROTOCOL_ID: NoiseTransport(key_pair, noise_privkey=create_new_x25519_key_pair().private_key),
    }
    return new_host(
        key_pair=key_pair,
        sec_opt=security,
        muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},  # the default also offers mplex
        listen_addrs=listen_maddrs,
        connection_config=connection_config,
    )
