"""The tracker's view of which nodes are alive, as a state machine over heartbeats and ``now``.

Owns, for ``agent.io.tracker.service``:
- every alive node has a deadline (its last heartbeat or registration + the heartbeat
  timeout); past it, a sweep names it dead;
- *confirmed* nodes were heard from since this tracker started; nodes the store knew alive
  before a restart are *pending* until their first heartbeat (kept in the assignment so
  their ranges are not moved, but not routed through);
- a heartbeat from a node not alive here (dead, or unknown since a restart) *revives* it;
- when the next sweep is due (the earliest deadline).

Pure: ``now_ms`` comes in. Must not import trio, grpc, libp2p or agent.io.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

__all__ = ["Heard", "Liveness"]


@dataclasses.dataclass(frozen=True)
class Heard:
    revived: bool  # it was not alive here: the assignment must be recomputed
    newly_confirmed: bool  # its first word since this tracker started


class Liveness:
    """Args:
    timeout_ms: how long a node stays alive after it was last heard from.
    """

    def __init__(self, timeout_ms: int) -> None:
        if timeout_ms <= 0:
            raise ValueError(f"timeout_ms must be > 0, got {timeout_ms}")
        self.timeout_ms = timeout_ms
        self.deadline_ms: dict[str, int] = {}  # alive or pending peer -> when it must be heard again
        self.confirmed: set[str] = set()

    def restore(self, peer_ids: Iterable[str], now_ms: int) -> None:
        """Nodes alive before a restart: pending, with a full timeout to be heard."""
        for peer_id in peer_ids:
            self.deadline_ms[peer_id] = now_ms + self.timeout_ms

    @property
    def live(self) -> set[str]:
        """Alive or pending: the nodes the assignment counts."""
        return set(self.deadline_ms)

    @property
    def alive(self) -> set[str]:
        """Confirmed and within their deadline: the nodes routes go through."""
        return set(self.deadline_ms) & self.confirmed

    @property
    def pending(self) -> set[str]:
        return set(self.deadline_ms) - self.confirmed

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self.deadline_ms

    def heard(self, peer_id: str, now_ms: int, *, stored_alive: bool = True) -> Heard:
        """A registration or heartbeat of ``peer_id`` (``stored_alive``: whether the durable
        store still has it alive; False after it was marked dead)."""
        revived = not stored_alive or peer_id not in self.deadline_ms
        newly_confirmed = peer_id not in self.confirmed
        self.deadline_ms[peer_id] = now_ms + self.timeout_ms
        self.confirmed.add(peer_id)
        return Heard(revived=revived, newly_confirmed=newly_confirmed)

    def sweep(self, now_ms: int) -> list[str]:
        """The nodes past their deadline, sorted, now forgotten (dead)."""
        dead = sorted(peer for peer, deadline in self.deadline_ms.items() if now_ms >= deadline)
        for peer in dead:
            self.forget(peer)
        return dead

    def forget(self, peer_id: str) -> None:
        self.deadline_ms.pop(peer_id, None)
        self.confirmed.discard(peer_id)

    def next_sweep_in_ms(self, now_ms: int) -> float:
        """Ms until the earliest deadline (0 when one passed; inf with no live node)."""
        if not self.deadline_ms:
            return math.inf
        return max(0, min(self.deadline_ms.values()) - now_ms)
