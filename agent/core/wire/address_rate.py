"""Rates per key in a sliding window: how many new identities one network address may bring
(the Sybil cost of a free key: per-address limits at the tracker), and how many requests of a
kind one peer may make (route requests).

Owns: the sliding-window count per key (``KeyedRate``), bounded in memory (the least recently
seen keys are forgotten first); for addresses (``NewIdentityRate``), which are exempt (the
operator's own, loopback by default). A renewal of a known identity is not a new one: the shell
counts only first admissions.

Pure: ``now_ms`` comes in. Must not import trio, grpc, libp2p or agent.io.
"""

from __future__ import annotations

import collections
import ipaddress
from collections.abc import Iterable

__all__ = ["LOOPBACK_NETWORKS", "KeyedRate", "NewIdentityRate", "counted_host", "parse_networks"]

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


class KeyedRate:
    """At most ``per_window`` events per key in any ``window_ms``.

    Args:
      per_window: events one key may have per window (0: no limit).
      window_ms: the window.
      max_keys: keys remembered at once (the least recently seen are forgotten).
    """

    def __init__(self, per_window: int, window_ms: int, *, max_keys: int = 65_536) -> None:
        if per_window < 0 or window_ms <= 0 or max_keys < 1:
            raise ValueError(f"bad limits: {per_window} per {window_ms} ms, {max_keys} keys")
        self.per_window = per_window
        self.window_ms = window_ms
        self.max_keys = max_keys
        self._seen: collections.OrderedDict[str, collections.deque[int]] = collections.OrderedDict()

    def _is_exempt(self, key: str) -> bool:
        return False

    def retry_after_ms(self, key: str, now_ms: int) -> int:
        """0 when ``key`` may have an event now, else the ms until it may."""
        if self.per_window == 0 or self._is_exempt(key):
            return 0
        times = self._seen.get(key)
        if times is None:
            return 0
        while times and now_ms - times[0] >= self.window_ms:
            times.popleft()
        if len(times) < self.per_window:
            return 0
        return times[0] + self.window_ms - now_ms

    def note(self, key: str, now_ms: int) -> None:
        """``key`` had an event at ``now_ms``."""
        if self.per_window == 0 or self._is_exempt(key):
            return
        times = self._seen.pop(key, None) or collections.deque()
        times.append(now_ms)
        while len(times) > self.per_window:
            times.popleft()
        self._seen[key] = times  # most recently seen last
        while len(self._seen) > self.max_keys:
            self._seen.popitem(last=False)

    def take(self, key: str, now_ms: int) -> int:
        """``retry_after_ms``, and the event noted when it is allowed (0)."""
        wait_ms = self.retry_after_ms(key, now_ms)
        if not wait_ms:
            self.note(key, now_ms)
        return wait_ms


class NewIdentityRate(KeyedRate):
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
        super().__init__(per_window, window_ms, max_keys=max_addresses)
        self.exempt = tuple(exempt)

    def _is_exempt(self, key: str) -> bool:
        if not key:
            return True  # unknown (an in-memory transport): nothing to count by
        try:
            address = ipaddress.ip_address(key)
        except ValueError:
            return False
        return any(address in network for network in self.exempt)
