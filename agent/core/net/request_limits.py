"""How big a request a listener takes in, by protocol and by who sends it, and how many request
bytes one peer (and all peers) may have in flight at once.

Owns the decision a transport makes on a request frame's length prefix, before a byte of its
body is buffered: take it (and count its bytes in flight until the handler has answered), or
refuse it with the reason. The transports (``agent.io.net.p2p_transport``, the direct channel)
act on it; the tracker and nodes say which peers are admitted and size the protocols' limits
(``agent.core.wire.swarm_wire.request_limits_for``).

Why: a request is read whole before its handler runs, so every stream a peer opens is a buffer
of up to the protocol's limit. Without a bound per peer, ten streams of 60 MB from one peer
that was never admitted took a tracker to 1.6 GB. A peer that is not admitted gets the smaller
of the protocol's limits and a smaller share of the bytes in flight, and all such peers
together are bounded too (keys cost nothing to make).

Pure: no clock, no I/O. Whether a peer is admitted comes in as a callable, asked only when the
decision depends on it (it may read a database).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

__all__ = ["InFlightRequests", "Refusal", "RequestLimits"]


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a request is not taken. ``too_large``: over its protocol's limit for its peer (the
    peer broke a rule: a transport may close the connection); otherwise over a bound on the
    bytes in flight (the peer may try again later: only this request is turned away)."""

    reason: str
    too_large: bool

    def __str__(self) -> str:
        return self.reason


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """The limits one listener applies.

    ``default_bytes``: the largest request of a protocol not in ``protocol_bytes`` (the
    transport's frame limit). ``protocol_bytes``: per protocol, the largest request an
    admitted peer may send; ``unadmitted_bytes``: per protocol, the largest one a peer not
    admitted may send (a protocol not listed there: as for an admitted peer).
    ``peer_in_flight_bytes`` / ``unadmitted_peer_in_flight_bytes``: request bytes one admitted /
    not admitted peer may have being read or answered at once; ``unadmitted_in_flight_bytes``:
    all peers not admitted together; ``total_in_flight_bytes``: everyone together. A single
    request is always let in when nothing of its peer is in flight and the totals have room
    (a bound below the protocol's limit must not refuse every request). A request within its
    protocol's ``unadmitted_bytes`` is taken without asking whether its peer is admitted while
    the peer has at most ``unadmitted_peer_in_flight_bytes`` in flight (a tracker's heartbeats
    cost no lookup).
    """

    default_bytes: int
    protocol_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    unadmitted_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    peer_in_flight_bytes: int = 128 << 20
    unadmitted_peer_in_flight_bytes: int = 256 << 10
    unadmitted_in_flight_bytes: int = 64 << 20
    total_in_flight_bytes: int = 512 << 20

    def __post_init__(self) -> None:
        for name in (
            "default_bytes", "peer_in_flight_bytes", "unadmitted_peer_in_flight_bytes",
            "unadmitted_in_flight_bytes", "total_in_flight_bytes",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for protocol_id, size in [*self.protocol_bytes.items(), *self.unadmitted_bytes.items()]:
            if size < 1:
                raise ValueError(f"the request limit of {protocol_id} must be positive, got {size}")

    def max_request_bytes(self, protocol_id: str, *, admitted: bool) -> int:
        """The largest request on ``protocol_id`` from an admitted peer, or one not admitted."""
        limit = min(self.default_bytes, self.protocol_bytes.get(protocol_id, self.default_bytes))
        if not admitted:
            limit = min(limit, self.unadmitted_bytes.get(protocol_id, limit))
        return limit

    def largest_request_bytes(self, *, admitted: bool) -> int:
        """The largest request on any protocol (a channel frame's limit, read before its
        protocol id is known)."""
        protocols = set(self.protocol_bytes) | set(self.unadmitted_bytes)
        sizes = [self.max_request_bytes(p, admitted=admitted) for p in protocols]
        if admitted or not sizes:
            sizes.append(self.default_bytes)
        return max(sizes)


class InFlightRequests:
    """The request bytes each peer has being read or answered, checked against ``limits``.

    ``take`` decides on a length prefix and counts the bytes; ``give_back`` once the request
    is answered (or failed). ``limits`` may be replaced at any time (a node sizes its step
    limits once it knows the models it serves); what is in flight stays counted.
    """

    def __init__(self, limits: RequestLimits) -> None:
        self.limits = limits
        self._by_peer: dict[str, int] = {}
        self._unadmitted_peers: dict[str, int] = {}  # of their bytes, those taken as not admitted
        self.total_bytes = 0
        self.unadmitted_bytes = 0
        self.refused = 0

    def peer_bytes(self, peer_id: str) -> int:
        return self._by_peer.get(peer_id, 0)

    def take(self, peer_id: str, protocol_id: str, length: int, admitted: Callable[[], bool]) -> Refusal | None:
        """Count a request of ``length`` bytes on ``protocol_id`` from ``peer_id`` as in flight;
        or refuse it: why (nothing is counted). ``admitted()`` is asked
        only when the answer depends on it."""
        refusal, unadmitted = self._decide(peer_id, protocol_id, length, admitted, self.limits)
        if refusal is not None:
            self.refused += 1
            return refusal
        self._by_peer[peer_id] = self._by_peer.get(peer_id, 0) + length
        self.total_bytes += length
        if unadmitted:
            self._unadmitted_peers[peer_id] = self._unadmitted_peers.get(peer_id, 0) + length
            self.unadmitted_bytes += length
        return None

    def give_back(self, peer_id: str, length: int) -> None:
        """A request ``take`` let in was answered (or failed): its bytes are no longer in flight."""
        left = self._by_peer.get(peer_id, 0) - length
        if left > 0:
            self._by_peer[peer_id] = left
        else:
            self._by_peer.pop(peer_id, None)
        self.total_bytes = max(0, self.total_bytes - length)
        # (a peer admitted while requests it sent before are in flight: those count first)
        unadmitted = self._unadmitted_peers.get(peer_id, 0)
        if unadmitted:
            released = min(unadmitted, length) if left > 0 else unadmitted
            self.unadmitted_bytes = max(0, self.unadmitted_bytes - released)
            if unadmitted > released:
                self._unadmitted_peers[peer_id] = unadmitted - released
            else:
                del self._unadmitted_peers[peer_id]

    def _decide(
        self, peer_id: str, protocol_id: str, length: int, admitted: Callable[[], bool], limits: RequestLimits
    ) -> tuple[Refusal | None, bool]:
        """(the reason to refuse, or None; whether the request counts as from a peer not admitted)."""
        held = self._by_peer.get(peer_id, 0)
        if self.total_bytes and self.total_bytes + length > limits.total_in_flight_bytes:
            return Refusal(
                f"{self.total_bytes} bytes of requests are in flight from all peers; {length} more would pass "
                f"the bound of {limits.total_in_flight_bytes}",
                too_large=False,
            ), False
        small = length <= limits.unadmitted_bytes.get(protocol_id, 0)
        if small and held + length <= limits.unadmitted_peer_in_flight_bytes and peer_id not in self._unadmitted_peers:
            # a request any peer may send, on a protocol that says so (the tracker's heartbeats):
            # no need to ask whether the peer is admitted
            return None, False
        is_admitted = admitted()
        limit = limits.max_request_bytes(protocol_id, admitted=is_admitted)
        who = "a peer that is admitted" if is_admitted else "a peer that is not admitted"
        if length > limit:
            return Refusal(
                f"a request of {length} bytes on {protocol_id} is over the limit of {limit} bytes for {who}",
                too_large=True,
            ), False
        bound = limits.peer_in_flight_bytes if is_admitted else limits.unadmitted_peer_in_flight_bytes
        if held and held + length > bound:
            return Refusal(
                f"{held} bytes of this peer's requests are in flight; {length} more would pass the bound of "
                f"{bound} for {who}",
                too_large=False,
            ), False
        if (
            not is_admitted
            and self.unadmitted_bytes + length > limits.unadmitted_in_flight_bytes
            and self.unadmitted_bytes
        ):
            return Refusal(
                f"{self.unadmitted_bytes} bytes of requests from peers that are not admitted are in flight; "
                f"{length} more would pass their bound of {limits.unadmitted_in_flight_bytes}",
                too_large=False,
            ), False
        return None, not is_admitted
