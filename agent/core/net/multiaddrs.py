"""Multiaddr strings: the one place that reads and writes the addresses peers advertise.

Owns, on plain strings (no multiaddr library, no sockets):
- ``peer_id_from_multiaddr``: the peer id an address ends with (``.../p2p/<id>``);
- ``circuit_multiaddr`` / ``is_circuit`` / ``circuit_relay_host``: ``<relay addr>/p2p-circuit/p2p/<id>``,
  where a peer behind the tracker's circuit relay is reached (libp2p only), and the relay's host;
- ``tcp_hosts``: the host of each direct TCP address (``/ip4|ip6/<host>/tcp/<port>...``);
- ``same_host`` / ``seen_first`` / ``at_seen_host``: whether two IP addresses are one host, a
  peer's addresses with those at the host it was seen at first, and without the direct ones
  anywhere else;
- ``channel_multiaddr`` / ``parse_channel_multiaddr``: ``/ip4|ip6/<host>/tcp/<port>/tls/p2p/<id>``,
  the direct data channel of a peer (``agent.io.net.channel``: TLS 1.3 with libp2p-TLS
  certificates, Baton channel frames). libp2p never dials these (it would expect multistream
  after TLS); the channel dials nothing else.

Pure. Must not import agent.io.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Iterable

__all__ = [
    "at_seen_host",
    "channel_multiaddr",
    "circuit_multiaddr",
    "circuit_relay_host",
    "is_channel_multiaddr",
    "is_circuit",
    "parse_channel_multiaddr",
    "peer_id_from_multiaddr",
    "same_host",
    "seen_first",
    "tcp_hosts",
]


def peer_id_from_multiaddr(addr: str) -> str:
    """The peer id a multiaddr ends with (``.../p2p/<peer id>``).

    Raises:
      ValueError: the address has no ``/p2p/<peer id>`` part.
    """
    _head, sep, peer_id = addr.rstrip("/").rpartition("/p2p/")
    if not sep or not peer_id or "/" in peer_id:
        raise ValueError(f"multiaddr {addr!r} does not end with /p2p/<peer id>")
    return peer_id


def circuit_multiaddr(relay_addr: str, peer_id: str) -> str:
    """``<relay_addr>/p2p-circuit/p2p/<peer_id>``: where ``peer_id`` is reached through the
    circuit relay at ``relay_addr`` (which must end with ``/p2p/<relay id>``) once it holds a
    reservation there.

    Raises:
      ValueError: ``relay_addr`` has no ``/p2p/<relay id>``.
    """
    peer_id_from_multiaddr(relay_addr)
    return f"{relay_addr.rstrip('/')}/p2p-circuit/p2p/{peer_id}"


def is_circuit(addr: str) -> bool:
    return "/p2p-circuit" in addr.split("#", 1)[0]


def circuit_relay_host(addr: str) -> str | None:
    """The relay's host of a circuit address (``/ip4|ip6/<host>/tcp/<port>/p2p/<relay>/p2p-circuit/...``),
    or None for any other address."""
    if not is_circuit(addr):
        return None
    parts = addr.strip("/").split("/")
    if len(parts) < 4 or parts[0] not in ("ip4", "ip6") or parts[2] != "tcp":
        return None
    try:
        ip = ipaddress.ip_address(parts[1])
    except ValueError:
        return None
    return parts[1] if (ip.version == 4) == (parts[0] == "ip4") else None


def channel_multiaddr(host: str, port: int, peer_id: str) -> str:
    """The direct channel address of ``peer_id`` listening on ``host:port``."""
    family = "ip6" if ":" in host else "ip4"
    return f"/{family}/{host}/tcp/{int(port)}/tls/p2p/{peer_id}"


def is_channel_multiaddr(addr: str) -> bool:
    return parse_channel_multiaddr(addr) is not None


@functools.lru_cache(maxsize=4096)  # on every request's path; a pure function of the string
def parse_channel_multiaddr(addr: str) -> tuple[str, int, str] | None:
    """``(host, port, peer id)`` of a channel address, or None for any other address
    (libp2p TCP, circuit, malformed)."""
    parts = addr.rstrip("/").split("/")
    # ['', 'ip4', host, 'tcp', port, 'tls', 'p2p', id]
    if len(parts) != 8 or parts[0] or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
        return None
    if parts[5] != "tls" or parts[6] != "p2p" or not parts[7]:
        return None
    try:
        ip = ipaddress.ip_address(parts[2])
        port = int(parts[4])
    except ValueError:
        return None
    if (ip.version == 4) != (parts[1] == "ip4") or not 0 < port < 65536:
        return None
    return parts[2], port, parts[7]


def tcp_hosts(addrs: Iterable[str]) -> list[str]:
    """The host of each direct TCP address among ``addrs`` (``/ip4|ip6/<host>/tcp/<port>...``,
    libp2p's or a channel's), in order; circuit and other addresses give none."""
    hosts = []
    for addr in addrs:
        parts = addr.strip("/").split("/")
        if len(parts) >= 4 and parts[0] in ("ip4", "ip6") and parts[2] == "tcp" and not is_circuit(addr):
            hosts.append(parts[1])
    return hosts


def same_host(a: str, b: str) -> bool:
    """Whether IP addresses ``a`` and ``b`` name one host (an IPv4-mapped IPv6 address is its
    IPv4 one); text that is not an address matches only itself."""
    try:
        return _unmapped(ipaddress.ip_address(a)) == _unmapped(ipaddress.ip_address(b))
    except ValueError:
        return a == b


def _unmapped(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return (ip.ipv4_mapped or ip) if isinstance(ip, ipaddress.IPv6Address) else ip


def seen_first(addrs: Iterable[str], seen_host: str) -> tuple[str, ...]:
    """``addrs`` with the direct ones at ``seen_host`` (where the peer was last heard from)
    first, the rest in their order: whoever dials the first direct address dials the host the
    peer was seen at. ``seen_host`` "": ``addrs`` as they are."""
    addrs = tuple(addrs)
    if not seen_host:
        return addrs

    def at_seen(addr: str) -> bool:
        hosts = tcp_hosts([addr])
        return bool(hosts) and same_host(hosts[0], seen_host)

    return tuple(sorted(addrs, key=lambda addr: not at_seen(addr)))


@functools.lru_cache(maxsize=1024)  # on each owner step's path: one owner sends the same tuple every step
def at_seen_host(addrs: tuple[str, ...], seen_host: str) -> tuple[str, ...]:
    """``addrs`` without the direct addresses at any host but ``seen_host`` (where the peer's
    connection comes from), so that whoever later dials them dials only that host: a peer
    that names another host's address has a node open a connection to it for nobody.
    Circuit addresses stay (libp2p dials their relay, which proves its own peer id first).
    ``seen_host`` loopback or not an IP address (the operator's own machine, an in-memory
    transport): ``addrs`` as they are."""
    try:
        seen = ipaddress.ip_address(seen_host)
    except ValueError:
        return addrs
    if seen.is_loopback:  # (core.net may not import core.wire's counted_host, the same rule)
        return addrs
    kept = []
    for addr in addrs:
        hosts = tcp_hosts([addr])
        if not hosts or same_host(hosts[0], seen_host):
            kept.append(addr)
    return tuple(kept)
