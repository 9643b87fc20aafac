"""A node's per-range step queue: which pending steps go into the next worker Forward.

Owns the batching rule of one served range. Steps of *different* sessions waiting for the same
worker are merged into one Forward, because a decode step costs about the same for one row as
for a few dozen (the weights are read once). Rules, in order:

- FIFO fairness: the oldest pending step is always in the next batch, so no step waits behind
  later arrivals for more than one batch per step ahead of it;
- then later steps, in arrival order, while the batch stays within ``n_batch_max`` rows and
  ``max_entries`` entries (the worker's sequence count); a step that does not fit is left
  for a later batch, and smaller later steps may still fill the room;
- at most one entry per session: a session's next step is never merged with its previous one
  (the worker takes one entry per sequence, and a step must see the previous step's KV);
- the chosen steps are laid out in a canonical order, ascending by key, not by arrival. The
  node keys steps by worker sequence id (one live session per sequence id in a range): that is
  the order in which llama.cpp's per-sequence KV streams take rows, and measured on the pinned
  CPU build, a batch given in any other order comes out different in the last bits, while
  batches in ascending order give the same numbers whichever session holds which id. So every
  hop lays out the same sessions the same way, whatever order the network delivered them in.

Generic over the queued item (the node queues ``agent.core.swarm_wire.StepInput``).

Pure: no trio, no clock; the shell pushes, pops and runs the batches.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Generic, TypeVar

__all__ = ["StepScheduler"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class _Pending(Generic[T]):
    session: Any  # hashable and orderable (the node uses the worker sequence id)
    n_rows: int
    item: T


class StepScheduler(Generic[T]):
    """The queue of one range. ``push`` steps as they are accepted; ``next_batch`` pops the
    steps of one Forward.

    Args:
      n_batch_max: most rows one Forward may carry (the worker's ``n_batch_max``).
      max_entries: most entries one Forward may carry (the worker's sequence count).
    """

    def __init__(self, n_batch_max: int, max_entries: int) -> None:
        if n_batch_max < 1 or max_entries < 1:
            raise ValueError(f"n_batch_max ({n_batch_max}) and max_entries ({max_entries}) must be >= 1")
        self.n_batch_max = n_batch_max
        self.max_entries = max_entries
        self._queue: collections.deque[_Pending[T]] = collections.deque()
        self._rows = 0

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def pending_rows(self) -> int:
        return self._rows

    def push(self, item: T, *, session: Any, n_rows: int) -> None:
        """Queue ``item`` (a step of ``session`` with ``n_rows`` rows) at the end.

        Raises:
          ValueError: ``n_rows`` is not in ``[1, n_batch_max]`` (it could never run).
        """
        if not 1 <= n_rows <= self.n_batch_max:
            raise ValueError(f"a step of {n_rows} rows can never run (batch limit {self.n_batch_max} rows)")
        self._queue.append(_Pending(session, n_rows, item))
        self._rows += n_rows

    def next_batch(self) -> list[T]:
        """Pop the steps of the next Forward (empty when nothing is pending), chosen oldest
        first and ordered by session key."""
        taken: list[_Pending[T]] = []
        kept: collections.deque[_Pending[T]] = collections.deque()
        sessions: set[Any] = set()
        rows = 0
        for pending in self._queue:
            fits = (
                len(taken) < self.max_entries
                and rows + pending.n_rows <= self.n_batch_max
                and pending.session not in sessions
            )
            if fits:
                taken.append(pending)
                sessions.add(pending.session)
                rows += pending.n_rows
            else:
                # Once a session has a step left behind, its later steps stay behind it too.
                sessions.add(pending.session)
                kept.append(pending)
        self._queue = kept
        self._rows -= rows
        taken.sort(key=lambda p: p.session)
        return [p.item for p in taken]

    def drop_session(self, session: Any) -> list[T]:
        """Remove and return every pending step of ``session`` (it ended or failed)."""
        dropped = [p.item for p in self._queue if p.session == session]
        if dropped:
            self._queue = collections.deque(p for p in self._queue if p.session != session)
            self._rows = sum(p.n_rows for p in self._queue)
        return dropped

    def drain(self) -> list[T]:
        """Remove and return every pending step (the range is going away)."""
        items = [p.item for p in self._queue]
        self._queue.clear()
        self._rows = 0
        return items
