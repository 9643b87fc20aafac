"""Hole punching between two peers that reach each other only through the circuit relay: the
decisions and the wire records (``/baton/punch/1.0.0``, ``PunchRequest`` -> ``PunchReply``).

Owns: whether to punch toward a peer (it has no channel address but a circuit one, no punch
with it is under way, its backoff has passed, fewer than ``max_in_flight`` punches run),
whether to answer a peer's punch (and which of two crossing punches goes on), which side is
the TLS client of a punched connection, how long the initiator waits after its SYNC, which
addresses a peer may make this one send SYNs to, and the backoff after a failure
(``PunchBook``). The sockets, the relayed requests and the TLS handshake are
``agent.io.net.punch`` and ``agent.io.net.channel``.

Why Baton's own punch rather than py-libp2p 0.8.1's DCUtR (``libp2p/relay/circuit_v2/dcutr.py``):
DCUtR upgrades the *libp2p* connection (Noise, yamux) and binds its SYNs to a libp2p TCP
listen address, while Baton's steps travel on the direct channel (TLS 1.3, libp2p-TLS
certificates) and a node behind NAT listens nowhere; its dials also need a second libp2p
connection to the same peer, which ``max_connections_per_peer=1`` (DESIGN.md) rules out. The
coordination is the same as DCUtR's: CONNECT (addresses, with the round trip measured), SYNC,
the initiator's SYNs half that round trip after the SYNC, bounded retries.

Pure: no trio, sockets, clocks or randomness (``now`` and punch ids are passed in).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
from collections import Counter
from collections.abc import Iterable

from agent._proto import swarm_pb2
from agent.core.net.multiaddrs import circuit_relay_host, is_channel_multiaddr, tcp_hosts
from agent.core.wire.swarm_wire import PUNCH_PROTOCOL, SCHEMA_VERSION, WireError, error, parse_record

__all__ = [
    "PUNCH_PROTOCOL",
    "PunchBook",
    "PunchConfig",
    "PunchError",
    "address_refusal",
    "connect_reply",
    "connect_request",
    "error_reply",
    "is_tls_client",
    "punch_relay_host",
    "read_punch_reply",
    "read_punch_request",
    "sync_delay_s",
    "sync_reply",
    "sync_request",
]


Code = swarm_pb2.Error.Code


class PunchError(Exception):
    """A punch that cannot go on: the peer refused it or answered something unreadable."""


@dataclasses.dataclass(frozen=True)
class PunchConfig:
    """Hole punching's switches and times (``agent.io.net.channel.ChannelConfig.punch``).

    ``enabled``: punch toward peers reached only through the relay, and answer their punches.
    ``request_timeout_s``: each relayed CONNECT / SYNC exchange. ``sync_wait_s``: how long a
    responder holds its bound port for the initiator's SYNC. ``syn_window_s``: how long each
    side keeps sending SYNs, from its start. ``syn_interval_s``: a connect attempt that has
    not completed by then is dropped and a fresh SYN sent from the same port (the kernel's
    own retransmission waits 1 s, then 3 s). ``sync_delay_max_s``: the most the initiator
    waits after its SYNC (half the CONNECT round trip, as DCUtR). ``backoff_initial_s`` /
    ``backoff_max_s``: after a failed punch toward a peer, the next one waits this long,
    doubling per failure up to the max; after a success, a new punch (the connection ended)
    waits the initial time. ``max_in_flight``: punches run at once, both roles together
    (each holds a port and sends SYNs for up to ``syn_window_s``). ``allow_loopback``: a peer
    may name a loopback address (two peers on one host: tests only; otherwise a peer could
    make this one connect to its own host's services).
    """

    enabled: bool = True
    allow_loopback: bool = False
    request_timeout_s: float = 5.0
    sync_wait_s: float = 5.0
    syn_window_s: float = 5.0
    syn_interval_s: float = 0.25
    sync_delay_max_s: float = 2.0
    backoff_initial_s: float = 10.0
    backoff_max_s: float = 600.0
    max_in_flight: int = 8

    def __post_init__(self) -> None:
        for name in (
            "request_timeout_s", "sync_wait_s", "syn_window_s", "syn_interval_s", "backoff_initial_s", "backoff_max_s",
        ):  # fmt: skip
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if not (self.sync_delay_max_s >= 0 and math.isfinite(self.sync_delay_max_s)):
            raise ValueError(f"sync_delay_max_s must be a number of seconds >= 0, got {self.sync_delay_max_s}")
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be positive, got {self.max_in_flight}")


def punch_relay_host(addrs: Iterable[str]) -> str | None:
    """Whether a peer advertising ``addrs`` is one to punch toward: the host of its relay
    (where its circuit address goes; the initiator sends from the address it reaches that
    host from), or None when it has a direct address (a channel's or libp2p's: dial it) or
    no circuit address."""
    addrs = list(addrs)
    if any(is_channel_multiaddr(addr) for addr in addrs) or tcp_hosts(addrs):
        return None
    return next((host for addr in addrs if (host := circuit_relay_host(addr)) is not None), None)


def is_tls_client(own_peer_id: str, peer_id: str) -> bool:
    """Whether this side is the TLS client of a punched connection: both sides dialled, so
    the roles come from an order both see the same way: the smaller peer id is the client."""
    return own_peer_id < peer_id


def sync_delay_s(rtt_s: float, max_s: float) -> float:
    """How long the initiator waits after sending SYNC before its first SYN: the SYNC reaches
    the responder (which starts at once) about half the measured CONNECT round trip later."""
    if not math.isfinite(rtt_s):
        return max_s
    return min(max(rtt_s / 2.0, 0.0), max_s)


def address_refusal(host: str, port: int, *, allow_loopback: bool) -> str | None:
    """Why this side must not send SYNs to ``host:port`` named by a peer, or None.

    A punch makes this side connect where the peer says: only to a unicast address, never to
    a multicast, unspecified, link-local or reserved one, nor to this host's loopback unless
    ``allow_loopback`` (``PunchConfig``: two peers of one host, in tests)."""
    if not 0 < port < 65536:
        return f"port {port} is not a TCP port"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return f"{host!r} is not an IP address"
    if ip.is_loopback:
        return None if allow_loopback else f"{host} is a loopback address"
    if ip.is_multicast or ip.is_unspecified or ip.is_link_local or ip.is_reserved:
        return f"{host} is not a unicast address one can punch to"
    return None


@dataclasses.dataclass
class _PeerState:
    failures: int = 0
    next_try_at: float = -math.inf


class PunchBook:
    """The punches of one peer: which run (as initiator, as responder), the backoff toward
    each peer, and the counts of punches that made a connection or failed, by peer."""

    def __init__(self, own_peer_id: str, config: PunchConfig) -> None:
        self.own_peer_id = own_peer_id
        self.config = config
        self._initiating: set[str] = set()
        self._answering: set[str] = set()
        self._peers: dict[str, _PeerState] = {}
        self.succeeded: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()

    @property
    def in_flight(self) -> int:
        return len(self._initiating) + len(self._answering)

    def start(self, peer_id: str, now: float) -> bool:
        """Whether to punch toward ``peer_id`` now; True marks the punch as under way (end it
        with ``initiated``)."""
        if not self.config.enabled or peer_id == self.own_peer_id:
            return False
        if peer_id in self._initiating or peer_id in self._answering or self.in_flight >= self.config.max_in_flight:
            return False
        if now < self._peers.get(peer_id, _PeerState()).next_try_at:
            return False
        self._initiating.add(peer_id)
        return True

    def answer(self, peer_id: str, now: float) -> str | None:
        """Why this side does not answer ``peer_id``'s CONNECT, or None: the punch is marked
        as under way (end it with ``answered``). Of two punches that cross (each side
        initiated one toward the other), the smaller peer id's goes on."""
        if not self.config.enabled:
            return "hole punching is off here"
        if peer_id == self.own_peer_id:
            return "a peer does not punch to itself"
        if peer_id in self._answering:
            return "a punch with this peer is already under way"
        if peer_id in self._initiating and is_tls_client(self.own_peer_id, peer_id):
            return "this peer is punching toward you already (the smaller peer id's punch goes on)"
        if self.in_flight >= self.config.max_in_flight:
            return f"busy: {self.in_flight} punches under way"
        self._answering.add(peer_id)
        return None

    def initiated(self, peer_id: str, now: float, *, connected: bool) -> None:
        """The punch this side started toward ``peer_id`` ended."""
        self._initiating.discard(peer_id)
        self._ended(peer_id, now, connected)

    def answered(self, peer_id: str, now: float, *, connected: bool) -> None:
        """The punch this side answered for ``peer_id`` ended."""
        self._answering.discard(peer_id)
        self._ended(peer_id, now, connected)

    def _ended(self, peer_id: str, now: float, connected: bool) -> None:
        state = self._peers.setdefault(peer_id, _PeerState())
        if connected:
            self.succeeded[peer_id] += 1
            state.failures = 0
            # the connection ends one day: punching again at once would retry a path that
            # just broke, in a loop
            state.next_try_at = now + self.config.backoff_initial_s
            return
        self.failed[peer_id] += 1
        state.failures += 1
        backoff_s = min(self.config.backoff_max_s, self.config.backoff_initial_s * 2.0 ** (state.failures - 1))
        state.next_try_at = max(state.next_try_at, now + backoff_s)

    def next_try_at(self, peer_id: str) -> float:
        """When a punch toward ``peer_id`` may start (-inf: now)."""
        return self._peers.get(peer_id, _PeerState()).next_try_at


# --- wire records ------------------------------------------------------------------------------


def connect_request(punch_id: int, host: str, port: int) -> bytes:
    return swarm_pb2.PunchRequest(
        schema_version=SCHEMA_VERSION, punch_id=punch_id, connect=swarm_pb2.PunchConnect(host=host, port=port)
    ).SerializeToString()


def sync_request(punch_id: int) -> bytes:
    return swarm_pb2.PunchRequest(
        schema_version=SCHEMA_VERSION, punch_id=punch_id, sync=swarm_pb2.PunchSync()
    ).SerializeToString()


def read_punch_request(data: bytes) -> swarm_pb2.PunchRequest:
    """A ``PunchRequest`` from the network.

    Raises:
      WireError: INVALID_ARGUMENT: malformed, another schema version, no body, no punch id.
    """
    request = parse_record(swarm_pb2.PunchRequest, data)
    if request.WhichOneof("body") is None:
        raise WireError(Code.INVALID_ARGUMENT, "PunchRequest has no body (connect or sync)")
    if not request.punch_id:
        raise WireError(Code.INVALID_ARGUMENT, "PunchRequest.punch_id is 0")
    return request


def connect_reply(host: str, port: int) -> bytes:
    return swarm_pb2.PunchReply(
        schema_version=SCHEMA_VERSION, connect=swarm_pb2.PunchConnect(host=host, port=port)
    ).SerializeToString()


def sync_reply() -> bytes:
    return swarm_pb2.PunchReply(schema_version=SCHEMA_VERSION).SerializeToString()


def error_reply(code: int, message: str) -> bytes:
    return swarm_pb2.PunchReply(schema_version=SCHEMA_VERSION, error=error(code, message)).SerializeToString()


def read_punch_reply(data: bytes, *, allow_loopback: bool) -> tuple[str, int] | None:
    """The responder's ``(host, port)`` from a reply to CONNECT (None: a reply without an
    address, i.e. to SYNC).

    Raises:
      PunchError: the peer refused, answered a malformed reply, or named an address this side
        must not send SYNs to (``address_refusal``).
    """
    try:
        reply = parse_record(swarm_pb2.PunchReply, data)
    except WireError as err:
        raise PunchError(f"unreadable punch reply: {err}") from None
    if reply.error.code:
        raise PunchError(f"refused: {WireError(reply.error.code, reply.error.message)}")
    if not reply.HasField("connect"):
        return None
    refusal = address_refusal(reply.connect.host, reply.connect.port, allow_loopback=allow_loopback)
    if refusal is not None:
        raise PunchError(f"the peer named an address to punch to that is not allowed: {refusal}")
    return reply.connect.host, reply.connect.port
