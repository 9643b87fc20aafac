"""Whether a listener takes one more connection, when what it holds is bounded.

Owns the rule ``agent.io.net.channel`` applies to its accepted connections (in all, and of one
peer id; ``ChannelConfig``): under the bound, take it; at the bound, take it in place of the
connection idle longest when that one has been idle ``idle_evict_s`` (a connection left by a
session that ended, or by a peer that reconnected); otherwise refuse it. A connection in use
is never closed for a newer one.

Pure: ``now`` and the connections' last-read times come in. Must not import trio or agent.io.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["Room", "room_for_one_more"]


@dataclasses.dataclass(frozen=True)
class Room:
    """``take``: whether the new connection is served; ``close_first``: the index (into the
    last-read times given) of the connection to close for it, or None."""

    take: bool
    close_first: int | None = None


def room_for_one_more(last_read_at: Sequence[float], bound: int, now: float, idle_evict_s: float) -> Room:
    """The rule above for a listener holding connections last read at ``last_read_at``."""
    if len(last_read_at) < bound:
        return Room(take=True)
    idle = min(range(len(last_read_at)), key=last_read_at.__getitem__)
    if now - last_read_at[idle] < idle_evict_s:
        return Room(take=False)
    return Room(take=True, close_first=idle)
