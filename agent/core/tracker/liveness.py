"""The tracker's view of which nodes are alive: an immutable value over heartbeats and ``now``.

Owns, for ``agent.core.tracker.reducer`` (the tracker's state holds one ``Liveness``):
- every alive node has a deadline (its last heartbeat or registration + the heartbeat
  timeout); past it, a sweep names it dead;
- *confirmed* nodes were heard from since this tracker started; nodes the store knew alive
  before a restart are *pending* until their first heartbeat (kept in the assignment so
  their ranges are not moved, but not routed through);
- a heartbeat from a node not alive here (dead, or unknown since a restart) *revives* it;
- when the next sweep is due (the earliest deadline).

A value, not an object to mutate: every change returns a new ``Liveness`` (the reducer's
state is frozen, so an old state handed to a test or a log never changes under it).

Pure: ``now_ms`` comes in. Must not import trio, grpc, libp2p or agent.io.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping

__all__ = ["Heard", "Liveness"]


@dataclasses.dataclass(frozen=True)
class Heard:
    revived: bool  # it was not alive here: the assignment must be recomputed
    newly_confirmed: bool  # its first word since this tracker started


@dataclasses.dataclass(frozen=True)
class Liveness:
    """Fields:
    timeout_ms: how long a node stays alive after it was last heard from.
    deadline_ms: alive or pending peer -> when it must be heard again (never mutated).
    confirmed: the peers heard from since this tracker started.
    """

    timeout_ms: int
    deadline_ms: Mapping[str, int] = dataclasses.field(default_factory=dict)
    confirmed: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.timeout_ms <= 0:
            raise ValueError(f"timeout_ms must be > 0, got {self.timeout_ms}")

    def restored(self, peer_ids: Iterable[str], now_ms: int) -> Liveness:
        """Nodes alive before a restart: pending, with a full timeout to be heard."""
        deadlines = dict(self.deadline_ms)
        deadlines.update((peer_id, now_ms + self.timeout_ms) for peer_id in peer_ids)
        return dataclasses.replace(self, deadline_ms=deadlines)

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

    def heard(self, peer_id: str, now_ms: int) -> tuple[Liveness, Heard]:
        """A registration or heartbeat of ``peer_id``: the new value, and what it changed."""
        heard = Heard(revived=peer_id not in self.deadline_ms, newly_confirmed=peer_id not in self.confirmed)
        deadlines = {**self.deadline_ms, peer_id: now_ms + self.timeout_ms}
        return dataclasses.replace(self, deadline_ms=deadlines, confirmed=self.confirmed | {peer_id}), heard

    def swept(self, now_ms: int) -> tuple[Liveness, tuple[str, ...]]:
        """The value without the nodes past their deadline, and those nodes (dead), sorted."""
        dead = tuple(sorted(peer for peer, deadline in self.deadline_ms.items() if now_ms >= deadline))
        return self.without(dead), dead

    def without(self, peer_ids: Iterable[str]) -> Liveness:
        """The value with ``peer_ids`` forgotten (dead)."""
        gone = set(peer_ids)
        if not gone & set(self.deadline_ms) and not gone & self.confirmed:
            return self
        deadlines = {peer: deadline for peer, deadline in self.deadline_ms.items() if peer not in gone}
        return dataclasses.replace(self, deadline_ms=deadlines, confirmed=self.confirmed - gone)

    def next_sweep_in_ms(self, now_ms: int) -> float:
        """Ms until the earliest deadline (0 when one passed; inf with no live node)."""
        if not self.deadline_ms:
            return math.inf
        return max(0, min(self.deadline_ms.values()) - now_ms)
