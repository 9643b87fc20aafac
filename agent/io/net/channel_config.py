"""The direct channel's limits and timeouts: ``ChannelConfig``.

Owns the one config object of ``agent.io.net.channel`` (listener, frame size, timeouts, what peers
may hold, hole punching), and checking its values. Plain data: must not import trio, ssl or
any other part of the channel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from agent.core.wire.punch import PunchConfig

__all__ = ["ChannelConfig"]


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
    theirs (``agent.core.wire.punch.PunchConfig``; ``enabled=False``: neither).
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
