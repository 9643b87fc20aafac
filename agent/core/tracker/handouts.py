"""Routes the tracker handed out, counted as sessions on their hops until the hops' own
heartbeats show them or their owners report them ended.

Owns, for ``agent.io.tracker.service`` (which plans routes with ``agent.core.tracker.routing``):
- every route handed out has an id (``Route.handout_id``) and its requester;
- it counts as one session on each of its hops until a heartbeat of that hop sent
  ``grace_s`` after the handout (by then the session shows in the node's own count of
  sequences in use, or it never started there), for at most ``horizon_s``;
- its owner's report that the session ended (``SessionEndedRequest``) stops the count at once:
  a short generation between two heartbeats does not keep a route looking full. Only the
  requester may end a handout (another peer cannot make a route look empty).

Pure: times (trio seconds) come in. Must not import trio, grpc, libp2p or agent.io.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping, Sequence

__all__ = ["RouteHandouts"]


@dataclasses.dataclass(frozen=True)
class _Handout:
    handout_id: int
    handed_at_s: float
    peers: tuple[str, ...]
    requester: str


class RouteHandouts:
    """Args:
    grace_s: how long after a handout a hop's heartbeat must be sent to count the session
      itself.
    horizon_s: a handout older than this counts for nothing (at least ``grace_s``).
    """

    def __init__(self, grace_s: float, horizon_s: float = 60.0) -> None:
        self.grace_s = grace_s
        self.horizon_s = max(grace_s, horizon_s)
        self._handouts: collections.deque[_Handout] = collections.deque()
        self._next_id = 1

    def __len__(self) -> int:
        return len(self._handouts)

    def hand_out(self, now_s: float, peers: Sequence[str], requester: str) -> int:
        """Count a route through ``peers`` handed to ``requester``; returns its handout id."""
        handout_id = self._next_id
        self._next_id += 1
        self._handouts.append(_Handout(handout_id, now_s, tuple(peers), requester))
        return handout_id

    def end(self, handout_ids: Iterable[int], requester: str) -> int:
        """The sessions of ``handout_ids`` ended (their requester says so); returns how many
        of them still counted."""
        ending = set(handout_ids)
        kept = collections.deque(h for h in self._handouts if h.handout_id not in ending or h.requester != requester)
        ended = len(self._handouts) - len(kept)
        self._handouts = kept
        return ended

    def load(self, now_s: float, heard_at_s: Mapping[str, float]) -> dict[str, int]:
        """Handed-out sessions per peer that its own count may not show yet (``heard_at_s``:
        when each peer's last heartbeat arrived)."""
        while self._handouts and self._handouts[0].handed_at_s < now_s - self.horizon_s:
            self._handouts.popleft()
        load: dict[str, int] = {}
        for handout in self._handouts:
            for peer in handout.peers:
                if heard_at_s.get(peer, float("-inf")) < handout.handed_at_s + self.grace_s:
                    load[peer] = load.get(peer, 0) + 1
        return load
