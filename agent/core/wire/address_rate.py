"""How many new identities one network address may bring in a window of time (the Sybil cost
of a free key: per-address limits at the tracker).

Owns: the sliding-window count of new identities per source address, bounded in memory (the
oldest addresses are forgotten first), and which addresses are exempt (the operator's own,
loopback by default). A renewal of a known identity is not a new one: the shell counts only
first admissions.

Pure: ``now_ms`` comes in. Must not import trio, grpc, libp2p or agent.io.
"""

from __future__ import annotations

import collections
import ipaddress
from collections.abc import Iterable

__all__ = ["LOOPBACK_NETWORKS", "NewIdentityRate", "counted_host", "parse_networks"]

#: the operator's own machine: not limited by default
LOOPBACK_NETWORKS = ("127.0.0.0/8", "::1/128")


def parse_networks(texts: Iterable[str]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """CIDR networks ("127.0.0.0/8", "::1/128"); raises ValueError naming a bad one."""
    networks = []
    for text in texts:
        try:
            networks.append(ipaddress.ip_network(text, strict=False))
        except ValueError:
            raise ValueError(f"not a network (CIDR, e.g. 198.18.0.0/15): {text!r}") from None
    return tuple(networks)


def counted_host(host: str) -> str:
    """The address per-address limits count ``host`` under: "" (not counted) for loopback and
    unknown addresses (the operator's own machine; an in-memory transport)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return ""
    return "" if address.is_loopback else str(address)


class NewIdentityRate:
    """At most ``per_window`` new identities per address in any ``window_ms``.

    Args:
      per_window: new identities one address may bring per window (0: no limit).
      window_ms: the window.
      exempt: networks whose addresses are not limited.
      max_addresses: addresses remembered at once (the least recently seen are forgotten).
    """

    def __init__(
        self,
        per_window: int,
        window_ms: int,
        exempt: Iterable[ipaddress.IPv4Network | ipaddress.IPv6Network] = (),
        *,
        max_addresses: int = 65_536,
    ) -> None:
        if per_window < 0 or window_ms <= 0 or max_addresses < 1:
            raise ValueError(f"bad limits: {per_window} per {window_ms} ms, {max_addresses} addresses")
        self.per_window = per_window
        self.window_ms = window_ms
        self.exempt = tuple(exempt)
        self.max_addresses = max_addresses
        self._seen: collections.OrderedDict[str, collections.deque[int]] = collections.OrderedDict()

    def _is_exempt(self, host: str) -> bool:
        if not host:
            return True  # unknown (an in-memory transport): nothing to count by
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(address in network for network in self.exempt)

    def retry_after_ms(self, host: str, now_ms: int) -> int:
        """0 when ``host`` may bring a new identity now, else the ms until it may."""
        if self.per_window == 0 or self._is_exempt(host):
            return 0
        times = self._seen.get(host)
        if times is None:
            return 0
        while times and now_ms - times[0] >= self.window_ms:
            times.popleft()
        if len(times) < self.per_window:
            return 0
        return times[0] + self.window_ms - now_ms

    def note(self, host: str, now_ms: int) -> None:
        """``host`` brought a new identity at ``now_ms``."""
        if self.per_window == 0 or self._is_exempt(host):
            return
        times = self._seen.pop(host, None) or collections.deque()
        times.append(now_ms)
        while len(times) > self.per_window:
            times.popleft()
        self._seen[host] = times  # most recently seen last
        while len(self._seen) > self.max_addresses:
            self._seen.popitem(last=False)
