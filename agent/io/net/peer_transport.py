"""The transport a node or a session owner runs: libp2p with the direct channel in front.

Owns one choice: which channel listener goes with which libp2p listen addresses (the same
host, a port of its own; none when the peer listens nowhere, e.g. a node reached through the
relay: it still dials out over the channel). Everything else is ``agent.io.net.p2p`` (control,
discovery, circuit relay) and ``agent.io.net.channel`` (steps and results).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.core.net.multiaddrs import tcp_hosts
from agent.core.wire.punch import PunchConfig
from agent.io.net.channel import open_channel_transport
from agent.io.net.channel_config import ChannelConfig
from agent.io.net.transport import Transport

__all__ = ["channel_host_for", "open_peer_transport"]


def channel_host_for(listen_addrs: Sequence[str]) -> str | None:
    """The host of the first ``/ip4|ip6/<host>/tcp/<port>`` listen address, or None."""
    return next(iter(tcp_hosts(listen_addrs)), None)


@asynccontextmanager
async def open_peer_transport(
    key: Ed25519PrivateKey,
    listen_addrs: Sequence[str],
    *,
    channel: bool = True,
    punch: bool = True,
    channel_config: ChannelConfig | None = None,
    **p2p_options: Any,
) -> AsyncIterator[Transport]:
    """libp2p on ``listen_addrs`` and (``channel``) the direct channel in front of it.

    ``channel_config``: default: listen on the host of the first TCP listen address, or not at
    all when there is none, and hole-punch toward peers reached only through the relay unless
    ``punch`` is False. ``p2p_options`` go to ``open_p2p_transport``.

    Resource handling: both close on exit (the channel first).
    """
    from agent.io.net.p2p import open_p2p_transport

    async with open_p2p_transport(key, listen_addrs=tuple(listen_addrs), **p2p_options) as p2p:
        if not channel:
            yield p2p
            return
        config = channel_config or ChannelConfig(
            listen_host=channel_host_for(listen_addrs), punch=PunchConfig(enabled=punch)
        )
        async with open_channel_transport(key, p2p, config) as transport:
            yield transport
