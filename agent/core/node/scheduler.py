"""A node's per-range step queue: which pending steps go into the next worker Forward.

Owns the batching rule of one served range (continuous batching, with the chunking of prompts
done by each session's owner). Steps of *different* sessions waiting for the same worker are
merged into one Forward, because a decode step costs about the same for one row as for a few
dozen (the weights are read once). Rules:

- **what may share a Forward**: steps of one compatibility key
  (``agent.core.node.batching.forward_key``: recipe, model, blocks, boundary schema, wire dtype) and
  one *phase*. The oldest pending step's key is the next Forward's; a step of another key waits
  for a Forward of its own;
- **phases**: a step of one row is a *decode* step, a longer one a *prefill* chunk (a prompt cut
  by its owner, or a rebuild). A decode Forward takes every waiting decode step (within
  ``max_entries``, the row budget and the decode group cap below); a prefill Forward takes the
  oldest chunk and the other waiting chunks of exactly its row count. Why: llama.cpp splits a
  batch of several sequences into micro-batches that give each sequence the same number of rows
  (``split_equal``, with one KV stream per sequence), so a 64-row chunk next to a decode row is
  computed as 1 + 63 rows, and a batch of 60 rows or more takes another kernel path than a
  smaller one (logits ~0.5 apart, measured on the pinned CPU build): a chunk that shares a
  Forward with rows of another length comes out different from the same chunk alone. Within these
  rules a session's numbers do not depend on who else is served: concurrent sessions give their
  solo runs' bits;
- **bounded decode service**: while prompts and decode steps both wait, Forwards alternate
  (prefill-first after a Forward without prefill), so no decode step waits behind more than one
  Forward (decode groups at a first hop aside: below) and prompts get every other Forward; the
  row budget (``row_budget``, default ``n_batch_max``) bounds how long that Forward takes;
- at most one entry per session: a session's next step is never merged with its previous one
  (the worker takes one entry per sequence, and a step must see the previous step's KV), nor
  overtakes it;
- the chosen steps are laid out in a canonical order, ascending by key, not by arrival. The
  node keys steps by worker sequence id (one live session per sequence id in a range): that is
  the order in which llama.cpp's per-sequence KV streams take rows, and measured on the pinned
  CPU build, a batch given in any other order comes out different in the last bits, while
  batches in ascending order give the same numbers whichever session holds which id. So every
  hop lays out the same sessions the same way, whatever order the network delivered them in;
- **decode groups** (``decode_group_cap``; vLLM keeps pipeline stages + 1 batches in flight): on
  a route of S hops, sessions that start together would travel as one convoy, every decode step
  in one Forward at hop 1, then at hop 2, ..., so each hop idles while the others compute. A
  first hop (blocks from 0) therefore caps a decode Forward at ceil(decoding sessions / (S + 1))
  steps (the sessions whose last step was a decode step: one taking its prompt in chunks sends
  no decode step to wait for), the oldest by arrival: the sessions fall into S + 1 groups, one
  sampling at its owners while the S others are each at a hop, so with spare cores every hop
  computes at once (on CPU a decode Forward's cost grows nearly linearly with its rows:
  SmolLM2 unsplit, 1 row ~10.8 ms, 8 rows ~52.7 ms; so S + 1 small Forwards cost not much more
  than one large one, while the hops work at once). Only the first hop caps: downstream hops take whatever arrives, so groups keep
  their shape along the route. The price: a decode step at the first hop may now wait behind the
  Forwards of other groups, each small, and while prompts wait too each group's Forward takes
  turns with a chunk (the rule above), so there it may wait behind up to groups - 1 decode
  Forwards and as many chunks, and prompts get a larger share of the first hop. Numbers: the cap
  only makes decode Forwards smaller (a solo run's are one row), the rows are still laid out in
  canonical order, and for SmolLM2 on the pinned CPU build a decode Forward of fewer than 60
  rows computes each row as a batch of one does, so greedy tokens and logits stay those of solo
  runs (tests/test_batching.py, groups on). That is the model's and build's property, not a
  law: the 6-block test qwen2 of tests/test_node.py gives a 2-row Forward's logits 1.5e-7 apart
  from two 1-row Forwards', so a test that compares with a merged reference turns groups off;
- **lock-step** (one group, ``groups`` 1, with a gather window): the first hop holds each decode
  Forward until every decoding session's step waits (``gather_wait_ms``, at most the window), so
  all of them travel the route as one convoy, as llama-batched-bench steps its sequences. That
  is the opposite of decode groups, and it is what pays when the route's hops share one
  machine's cores (several nodes on one box): only one hop computes at a time, so each worker
  may use every core without its threads fighting another worker's for them, and each Forward
  holds every session's row. bench/results/batching.md measures both on its 2-core machine;
- **the default** (``decode_mode``): a node that names neither picks per route. Lock-step when
  the route's next hop shares this machine (its data plane on a loopback address or one of this
  host's own): hops that share cores gain nothing from computing at once and lose each Forward's
  batch (the 2-core benchmark, bench/results/batching.md: 0.62x llama-batched-bench at 8
  sessions with groups, 0.81-0.86x lock-step). Decode groups otherwise, where each hop has
  cores of its own.

Generic over the queued item (the node queues ``agent.core.wire.step_validation.StepInput``).

Pure: no trio, no clock; the shell pushes, pops and runs the batches.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Hashable
from typing import Any, Generic, TypeVar

from agent.core.node.batching import is_prefill

__all__ = [
    "LOCK_STEP_GATHER_MS",
    "StepScheduler",
    "arrival_wakes_gatherer",
    "batch_window_wait_ms",
    "decode_group_cap",
    "decode_groups",
    "decode_mode",
    "first_hop_decode",
    "gather_arrivals_needed",
    "gather_wait_ms",
]

T = TypeVar("T")


#: lock-step's gather window when a node names none (``decode_mode``): longer than two drifted
#: groups can be apart (half a decode round: ~40 ms at 8 sessions of SmolLM2 through 3 hops on the
#: 2-core benchmark machine), so a convoy that split merges again at once. It costs nothing while
#: the convoy is whole (the hold ends as the last step arrives) and bounds what a straggler costs.
LOCK_STEP_GATHER_MS = 40.0


def decode_mode(groups: int | None, gather_ms: float | None, *, next_hop_shares_host: bool) -> tuple[int | None, float]:
    """A first hop's decode groups and gather window for one route: the node's settings
    (``--decode-groups``, ``--decode-gather-ms``), with what it left unset (None) decided.

    Args:
      groups: the node's decode groups; None: lock-step (1) when ``next_hop_shares_host``, else
        None (``decode_groups``' route hops + 1).
      gather_ms: the node's gather window; None: ``LOCK_STEP_GATHER_MS`` with one group, else 0.
      next_hop_shares_host: the route's next hop runs on this machine (its cores are ours).

    Returns:
      ``(groups, gather_ms)`` for ``first_hop_decode`` and the data plane's bind.
    """
    if groups is None and next_hop_shares_host:
        groups = 1
    if gather_ms is None:
        gather_ms = LOCK_STEP_GATHER_MS if groups == 1 else 0.0
    return groups, gather_ms


def decode_groups(route_hops: int, groups: int | None) -> int:
    """How many decode groups a first hop splits its decoding sessions into (0: off).

    Args:
      route_hops: hops of the route the next decode step travels (S).
      groups: decode groups wanted; None: S + 1 when S > 1 (one hop has no pipeline to fill);
        0: off.

    Raises:
      ValueError: ``groups`` is negative.
    """
    if groups is not None and groups < 0:
        raise ValueError(f"groups must be >= 0 or None, got {groups}")
    if groups is None:
        return route_hops + 1 if route_hops > 1 else 0
    return groups


def decode_group_cap(decoding_sessions: int, route_hops: int, groups: int | None) -> int | None:
    """The most decode steps a first hop puts in one Forward (None: no cap).

    Args:
      decoding_sessions: sessions of the range whose last step was a decode step
        (``SessionTable.decoding_count``).
      route_hops, groups: as ``decode_groups``.

    Returns:
      ceil(decoding_sessions / groups), at least 1; None when off.

    Raises:
      ValueError: ``groups`` is negative.
    """
    count = decode_groups(route_hops, groups)
    if count == 0:
        return None
    return max(1, -(-decoding_sessions // count))


def gather_wait_ms(waiting_decode: int, group_size: int, waited_ms: float, window_ms: float) -> float:
    """How much longer a first hop holds a decode Forward for its group to gather (0: run it
    now): until ``group_size`` decode steps wait, for at most ``window_ms`` after it began
    holding (``waited_ms`` ago). Sessions drift apart (results reach owners at different
    times, owners send at different times), and a Forward of a drifted step alone costs
    nearly what a group's costs; so the first hop gathers a group before it runs one."""
    if window_ms <= 0 or waiting_decode >= group_size:
        return 0.0
    return max(0.0, window_ms - waited_ms)


def gather_arrivals_needed(waiting_decode: int, group_size: int) -> int:
    """How many more decode steps must arrive before a first hop holding its group
    (``gather_wait_ms`` > 0) could run it: the steps that arrive before that cannot end the
    hold, so they need not wake the serving task (each wake-up re-counts every session's
    steps, on the first hop's share of the route's critical path). At least 1: the next
    arrival is re-counted when in doubt."""
    return max(1, group_size - waiting_decode)


def arrival_wakes_gatherer(quiet_left: int, *, decode: bool) -> bool:
    """Whether a step arriving at a first hop that gathers a decode group must wake its
    serving task. ``quiet_left``: decode arrivals that still cannot complete the group
    (``gather_arrivals_needed`` - 1 when the hold began, less those that came since; 0 when
    no group is being gathered). Any other step (a prefill chunk, a rebuild) wakes it: it
    changes what runs next."""
    return quiet_left <= 0 or not decode


def batch_window_wait_ms(window_ms: float, pending_rows: int, row_budget: int) -> float:
    """How long a range waits, once a step is queued, for more to share its Forward (0: run
    now): ``window_ms`` while the queued rows (``pending_rows``) leave room in the Forward's
    ``row_budget``; a full Forward, or nothing queued, does not wait."""
    if window_ms <= 0 or not 0 < pending_rows < row_budget:
        return 0.0
    return window_ms


def first_hop_decode(
    *,
    begin: int,
    decoding_sessions: int,
    route_hops: int,
    groups: int | None,
    waiting: int,
    waited_ms: float,
    window_ms: float,
) -> tuple[int | None, float]:
    """``(cap, hold_ms)`` for a range's next decode Forward: only a first hop (``begin`` 0)
    caps it (``decode_group_cap``; None: no cap) and may hold it ``hold_ms`` longer for its
    group to gather (``gather_wait_ms``; 0: run it now). ``waiting``: the decode steps it
    would choose from (0: the next Forward is no decode one)."""
    if begin != 0 or not waiting:
        return None, 0.0
    cap = decode_group_cap(decoding_sessions, route_hops, groups)
    if cap is None:
        return None, 0.0
    return cap, gather_wait_ms(waiting, cap, waited_ms, window_ms)


@dataclasses.dataclass(frozen=True)
class _Pending(Generic[T]):
    session: Any  # hashable and orderable (the node uses the worker sequence id)
    n_rows: int
    item: T
    key: Hashable = None  # the compatibility key (agent.core.node.batching.forward_key)

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
    """

    def __init__(self, n_batch_max: int, max_entries: int, *, row_budget: int | None = None) -> None:
        if n_batch_max < 1 or max_entries < 1:
            raise ValueError(f"n_batch_max ({n_batch_max}) and max_entries ({max_entries}) must be >= 1")
        if row_budget is not None and not 1 <= row_budget <= n_batch_max:
            raise ValueError(f"row_budget must be in [1, {n_batch_max}], got {row_budget}")
        self.n_batch_max = n_batch_max
        self.max_entries = max_entries
        self.row_budget = row_budget or n_batch_max
        self._queue: collections.deque[_Pending[T]] = collections.deque()
        self._rows = 0
        self._last_was_prefill = False
        self.forwards = 0  # batches handed out
        self.prefill_forwards = 0

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

    def decode_waiting(self) -> tuple[T | None, int]:
        """``(oldest, count)``: the oldest decode step the next Forward would take (not
        popped) and how many decode steps it would choose from; ``(None, 0)`` when the next
        Forward is a prefill one or nothing waits. The node reads the oldest step's route
        for ``first_hop_decode``."""
        eligible = self._eligible()
        decode = [p for p in eligible if not p.prefill]
        if not decode or (len(decode) < len(eligible) and not self._last_was_prefill):
            return None, 0
        return decode[0].item, len(decode)

    def next_batch(self, max_decode_entries: int | None = None) -> list[T]:
        """Pop the steps of the next Forward (empty when nothing is pending), chosen by the
        rules above and ordered by session key.

        Args:
          max_decode_entries: most steps a decode Forward takes (the oldest by arrival;
            ``decode_group_cap``); None: ``max_entries``. Prefill Forwards ignore it.

        Raises:
          ValueError: ``max_decode_entries`` is below 1.
        """
        if max_decode_entries is not None and max_decode_entries < 1:
            raise ValueError(f"max_decode_entries must be >= 1, got {max_decode_entries}")
        eligible = self._eligible()
        if not eligible:
            return []
        decode = [p for p in eligible if not p.prefill]
        prefill = [p for p in eligible if p.prefill]
        max_entries = self.max_entries
        if prefill and (not decode or not self._last_was_prefill):
            rows_each = prefill[0].n_rows
            candidates = [p for p in prefill if p.n_rows == rows_each]
        else:
            candidates = decode
            if max_decode_entries is not None:
                max_entries = min(max_entries, max_decode_entries)
        taken: list[_Pending[T]] = []
        rows = 0
        for pending in candidates:
            if len(taken) < max_entries and rows + pending.n_rows <= self.row_budget:
                taken.append(pending)
                rows += pending.n_rows
        chosen = {id(p) for p in taken}
        self._queue = collections.deque(p for p in self._queue if id(p) not in chosen)
        self._rows -= rows
        self._last_was_prefill = taken[0].prefill
        self.forwards += 1
        self.prefill_forwards += self._last_was_prefill
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
