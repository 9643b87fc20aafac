"""``RequestGate``: what a transport asks before it reads a request's body, shared by the
libp2p transport and the direct channel in front of it.

Owns: the request bytes in flight on one host (``agent.core.net.request_limits``, which
decides), and who this host counts as admitted (set by the tracker or the node that runs the
transport: a predicate on the transport-authenticated peer id). A predicate that raises counts
the peer as not admitted (and is logged): the gate never fails a transport.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from agent.core.net.request_limits import InFlightRequests, Refusal, RequestLimits

__all__ = ["RequestGate"]

log = logging.getLogger(__name__)


def _everyone(peer_id: str) -> bool:
    return True


class RequestGate:
    """Request limits and bytes in flight of one host.

    ``limits``: replaceable (a node sizes its step limit once it knows what it serves).
    ``is_admitted``: the peer ids the host has admitted (default: everyone; the tracker and the
    nodes set theirs), asked only for requests bigger than what any peer may send.
    """

    def __init__(self, limits: RequestLimits) -> None:
        self.in_flight = InFlightRequests(limits)
        self.is_admitted: Callable[[str], bool] = _everyone

    @property
    def limits(self) -> RequestLimits:
        return self.in_flight.limits

    @limits.setter
    def limits(self, limits: RequestLimits) -> None:
        self.in_flight.limits = limits

    def admitted(self, peer_id: str) -> bool:
        try:
            return bool(self.is_admitted(peer_id))
        except Exception:
            log.exception("the admission check of %s failed; counting it as not admitted", peer_id)
            return False

    def take(self, peer_id: str, protocol_id: str, length: int) -> Refusal | None:
        """Count a request of ``length`` bytes as in flight, or why it is refused."""
        return self.in_flight.take(peer_id, protocol_id, length, lambda: self.admitted(peer_id))

    def give_back(self, peer_id: str, length: int) -> None:
        self.in_flight.give_back(peer_id, length)
