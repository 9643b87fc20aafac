"""A node's per-range step queue: which pending steps go into the next worker Forward.

Owns the batching rule of one served range (vLLM / Sarathi-Serve style continuous batching,
with the chunking done by each session's owner). Steps of *different* sessions waiting for
the same worker are merged into one Forward, because a decode step costs about the same for
one row as for a few dozen (the weights are read once). Rules:

- **what may share a Forward** (``forward_key``): steps that agree on their compatibility key
  (``agent.core.batching.forward_key``: recipe, model, blocks, boundary schema, wire dtype).
  The oldest pending step's key is the next Forward's; a step of another key waits for a
  Forward of its own (it is the oldest, at the latest, after the steps ahead of it);
- **phases**: a step of one row is a *decode* step; a longer one is a *prefill* chunk (the
  owner cuts prompts into chunks, so each flows down the route like a step). Each Forward has
  a row budget (``row_budget``, default ``n_batch_max``);
- **bounded decode service**: a Forward is *decode-first* (every waiting decode step, then the
  prefill chunks that fit the rest of the budget, oldest first) unless prompts wait and the
  previous Forward carried none of them: then it is *prefill-first* (the oldest chunks up to
  the budget, then the decode steps that still fit). So no decode step waits behind more than
  one Forward, and while prompts wait at least every other Forward serves them (in a
  decode-first Forward the decode rows leave ``prefill_share`` of the budget to prompts);
- at most ``max_entries`` entries (the worker's sequence count), and at most one entry per
  session: a session's next step is never merged with its previous one (the worker takes one
  entry per sequence, and a step must see the previous step's KV), nor overtakes it;
- the chosen steps are laid out in a canonical order, ascending by key, not by arrival. The
  node keys steps by worker sequence id (one live session per sequence id in a range): that is
  the order in which llama.cpp's per-sequence KV streams take rows, and measured on the pinned
  CPU build, a batch given in any other order comes out different in the last bits, while
  batches in ascending order give the same numbers whichever session holds which id. So every
  hop lays out the same sessions the same way, whatever order the network delivered them in.

Numerics: each sequence's attention runs in its own KV stream and the weight products are
row by row, so which other sessions share a Forward does not change a session's numbers
(measured: a decode row next to a 300-row prefill chunk, or next to another decode, gives the
same logits bit for bit as alone). What does change them is how one session's own rows are cut
into steps (60 rows or more take another kernel path than single rows): that is the owner's
choice (``Session.max_step_rows``), the same whoever else is served.

Generic over the queued item (the node queues ``agent.core.swarm_wire.StepInput``).

Pure: no trio, no clock; the shell pushes, pops and runs the batches.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Hashable
from typing import Any, Generic, TypeVar

from .batching import is_prefill

__all__ = ["StepScheduler"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class _Pending(Generic[T]):
    session: Any  # hashable and orderable (the node uses the worker sequence id)
    n_rows: int
    item: T
    key: Hashable = None  # the compatibility key (agent.core.batching.forward_key)

    @property
    def prefill(self) -> bool:
        return is_prefill(self.n_rows)


class StepScheduler(Generic[T]):
    """The queue of one range. ``push`` steps as they are accepted; ``next_batch`` pops the
    steps of one Forward.

    Args:
      n_batch_max: most rows one Forward may carry (the worker's ``n_batch_max``).
      max_entries: most entries one Forward may carry (the worker's sequence count).
      row_budget: rows one Forward is filled to (default and at most ``n_batch_max``).
      prefill_share: while prompts wait, the share of a decode-first Forward's budget its
        decode rows leave to them (0 to 1).
    """

    def __init__(
        self, n_batch_max: int, max_entries: int, *, row_budget: int | None = None, prefill_share: float = 0.25
    ) -> None:
        if n_batch_max < 1 or max_entries < 1:
            raise ValueError(f"n_batch_max ({n_batch_max}) and max_entries ({max_entries}) must be >= 1")
        if row_budget is not None and not 1 <= row_budget <= n_batch_max:
            raise ValueError(f"row_budget must be in [1, {n_batch_max}], got {row_budget}")
        if not 0.0 <= prefill_share <= 1.0:
            raise ValueError(f"prefill_share must be in [0, 1], got {prefill_share}")
        self.n_batch_max = n_batch_max
        self.max_entries = max_entries
        self.row_budget = row_budget or n_batch_max
        self.prefill_share = prefill_share
        self._queue: collections.deque[_Pending[T]] = collections.deque()
        self._rows = 0
        self._last_had_prefill = False
        self.forwards = 0  # batches handed out
        self.prefill_first_forwards = 0

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def pending_rows(self) -> int:
        return self._rows

    def push(self, item: T, *, session: Any, n_rows: int, key: Hashable = None) -> None:
        """Queue ``item`` (a step of ``session`` with ``n_rows`` rows, compatibility ``key``)
        at the end.

        Raises:
          ValueError: ``n_rows`` is not in ``[1, row_budget]`` (it could never run).
        """
        if not 1 <= n_rows <= self.row_budget:
            raise ValueError(f"a step of {n_rows} rows can never run (batch limit {self.row_budget} rows)")
        self._queue.append(_Pending(session, n_rows, item, key))
        self._rows += n_rows

    def _eligible(self) -> list[_Pending[T]]:
        """The steps that may go next: each session's oldest pending step, of the oldest
        step's key, in arrival order."""
        if not self._queue:
            return []
        key = self._queue[0].key
        seen: set[Any] = set()
        eligible = []
        for pending in self._queue:
            if pending.session in seen:
                continue
            seen.add(pending.session)
            if pending.key == key:
                eligible.append(pending)
        return eligible

    def next_batch(self) -> list[T]:
        """Pop the steps of the next Forward (empty when nothing is pending), chosen by the
        rules above and ordered by session key."""
        eligible = self._eligible()
        if not eligible:
            return []
        decode = [p for p in eligible if not p.prefill]
        prefill = [p for p in eligible if p.prefill]
        taken: list[_Pending[T]] = []
        rows = 0

        def take(candidates: list[_Pending[T]], limit: int) -> None:
            nonlocal rows
            for pending in candidates:
                if len(taken) < self.max_entries and rows + pending.n_rows <= limit:
                    taken.append(pending)
                    rows += pending.n_rows

        budget = self.row_budget
        prefill_first = bool(prefill) and (not self._last_had_prefill or not decode)
        if prefill_first:
            take(prefill, budget)
            take(decode, budget)
            self.prefill_first_forwards += 1
        else:
            reserved = math.ceil(self.prefill_share * budget) if prefill else 0
            take(decode, max(budget - reserved, 1))
            take(prefill, budget)
        chosen = {id(p) for p in taken}
        self._queue = collections.deque(p for p in self._queue if id(p) not in chosen)
        self._rows -= rows
        self._last_had_prefill = any(p.prefill for p in taken)
        self.forwards += 1
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
