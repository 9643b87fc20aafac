"""The libp2p peer transport: ``agent.io.net.transport.Transport`` over py-libp2p 0.8.1 (trio).

Owns: building a libp2p host from the node's Ed25519 key with the settings DESIGN.md makes
mandatory (Noise only, yamux only, one connection per peer, ping health checks that abort a
frozen connection), the per-peer pool of reused streams, and guarding every stream handler.
Framing (``uvarint(len) || payload``) and multiaddr strings come from ``agent.core.net.frames``
and ``agent.core.net.multiaddrs`` (one definition for libp2p and the direct channel); the circuit
relay's policy and py-libp2p workarounds live in ``agent.io.net.p2p_relay``; the direct data
channel in front of this transport is ``agent.io.net.channel``. The swarm protocols above it see
only ``Transport``. No nursery is kept on the transport (reservation refreshes go to a task
of ``open_p2p_transport`` through a channel).

Its parts: this module builds and runs the host (``open_p2p_transport``); the ``Transport``
over it is ``agent.io.net.p2p_transport.P2PTransport``, the framing and the stream pool's records
are ``agent.io.net.p2p_streams``.

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

import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import multiaddr
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from libp2p import new_host
from libp2p.abc import IHost
from libp2p.crypto.ed25519 import Ed25519PrivateKey as Libp2pEd25519PrivateKey
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.network.config import ConnectionConfig, RetryConfig
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.tools.anyio_service import background_trio_service

from agent.io.keys import peer_id_of, private_seed
from agent.io.net.p2p_relay import GatedRelayProtocol, NoAutoConnector, RelayPolicy
from agent.io.net.p2p_transport import P2PTransport, _run_spawned, _Spawner, _swarm
from agent.io.net.transport import TransportError

__all__ = ["RelayPolicy", "open_p2p_transport"]

DEFAULT_LISTEN_ADDRS = ("/ip4/127.0.0.1/tcp/0",)
YAMUX_OUTBOUND_STREAM_LIMIT = 256  # py-libp2p yamux: Yamux.stream_backlog_semaphore
_STREAM_HEADROOM = 16  # outbound streams left to libp2p itself (identify, ping, relay)


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
