"""``P2PTransport``: the libp2p ``Transport`` over a running host (made by
``agent.io.net.p2p.open_p2p_transport``).

Owns: requests over the per-peer pool of reused streams (``agent.io.net.p2p_streams``), dialling
a peer (direct or through a circuit relay; channel addresses are passed over), holding relay
reservations, and serving inbound streams with every handler guarded. Split out of
``agent.io.net.p2p``, which builds and runs the host.

Must not import ``agent.io.net.p2p`` (it builds on this) or the direct channel (``agent.io.net.channel``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, cast

import multiaddr
import trio
from libp2p.abc import IHost, INetConn, INetStream
from libp2p.custom_types import TProtocol
from libp2p.network.swarm import Swarm
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as RELAY_HOP_PROTOCOL_ID
from libp2p.relay.circuit_v2.transport import CircuitV2Transport

from agent.core.net.frames import FrameTooLarge
from agent.core.net.multiaddrs import circuit_multiaddr, is_channel_multiaddr, peer_id_from_multiaddr
from agent.core.wire.swarm_wire import request_limits
from agent.io.net.p2p_relay import RelayPolicy
from agent.io.net.p2p_streams import _close_quietly, _FramedStream, _PeerStreams, _PooledStream, _reset_quietly
from agent.io.net.request_gate import RequestGate
from agent.io.net.transport import Handler, TransportError, set_remote_host

__all__ = ["P2PTransport"]

# the libp2p transport's logger, as before the split
log = logging.getLogger("agent.io.net.p2p")

_PEERSTORE_ADDR_TTL_S = 600


class P2PTransport:
    """``Transport`` over a running libp2p host. Made by ``open_p2p_transport`` only.

    Counters (for tests and benchmarks): ``streams_opened`` (outbound streams this transport
    opened for requests) and ``streams_accepted`` (inbound streams its handlers served).
    A request is refused (its stream reset, the reason logged) on its length prefix when
    ``request_gate`` says so: over its protocol's limit for its peer, or over the bytes in
    flight its peer (or everyone) may have.
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
        #: request limits and bytes in flight of the streams served here (shared with the
        #: direct channel in front of this transport); the tracker and nodes set who is admitted
        self.request_gate = RequestGate(request_limits(max_frame_bytes))

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
        # a direct channel address (agent.io.net.channel) is TLS + Baton frames, not libp2p
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
            address = stream.get_remote_address()
            set_remote_host(address[0] if address else "")
            framed = _FramedStream(stream)
            while await framed.wait_readable():
                with trio.fail_after(self._frame_timeout_s):
                    length = await framed.read_length()
                    refusal = self.request_gate.take(remote, protocol_id, length)
                    if refusal is not None:
                        raise FrameTooLarge(refusal.reason)
                    try:
                        request = await framed.read_body(length)
                    except BaseException:
                        self.request_gate.give_back(remote, length)
                        raise
                try:
                    reply = bytes(await handler(remote, request))
                except Exception:
                    log.exception(
                        "handler for %s failed on a request from %s; resetting the stream", protocol_id, remote
                    )
                    await _reset_quietly(stream)
                    return
                finally:
                    del request  # the request's bytes are no longer held here
                    self.request_gate.give_back(remote, length)
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
