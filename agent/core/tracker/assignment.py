"""Range assignment: which node serves which blocks of which model.

Owns the assignment policy of the shared swarm semantics (docs/ARCHITECTURE.md):

- A node can hold ``floor(budget / bytes_per_block)`` blocks of a model, capped at n_layer,
  where ``budget`` is its ``usable_memory_bytes`` shared equally among the registered models it
  has (and that can be covered at all; see below). Models never compete for one node's memory
  in any other way, so adding a model cannot take ranges away from another one unpredictably.
- ``copies = max(1, floor(total holdable blocks / n_layer))``. Nodes are split into ``copies``
  groups balanced by capacity (largest first, into the group with the most unmet need); each
  group covers ``[0, n_layer)`` with contiguous ranges, in peer id order, proportional to each
  node's throughput (``1 / decode_s_per_block``), bounded by what it can hold. When the
  groups cannot each cover the model, one copy fewer is tried.
- Stable: a current assignment is kept when its node is still alive, still has the model and
  the range still fits its budget; only the blocks that kept ranges leave uncovered (per copy
  level) get new ranges, from the nodes' remaining capacity (a gap goes to as few nodes as
  can hold it, proven nodes first (those that have served a range: a node that only claims
  memory cannot take a gap from one that has shown it serves), then largest free capacity;
  a whole missing copy is spread over its group).
  A node may thus hold two ranges of one model (e.g. after healing: its old range plus part
  of a dead neighbour's).
- A model whose nodes together cannot hold one copy gets no *new* ranges (a partial copy serves
  nobody). Its current ranges that still fit are kept, though: when a one-copy swarm loses a
  node, the survivors stay loaded while the lost range waits for a node, instead of unloading
  and reloading everything when one comes back. They are dropped only when the memory they
  hold is what another model needs to be covered at all.
- Deterministic for the same inputs: everything is ordered by peer id / sha256, and shares
  are computed with exact fractions.

Pure: no I/O, no clock, no randomness.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from fractions import Fraction

__all__ = ["Assignment", "ModelSpec", "NodeCapacity", "assign", "blocks_holdable", "split_proportionally"]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    sha256: str
    n_layer: int
    bytes_per_block: int


@dataclasses.dataclass(frozen=True)
class NodeCapacity:
    """A live node as the assignment sees it (from its fingerprint)."""

    peer_id: str
    usable_memory_bytes: int
    decode_s_per_block: float  # <= 0 or not finite: unmeasured (treated as the slowest measured)
    model_sha256s: frozenset[str]
    proven: bool = True  # it has served a range (gaps go to proven nodes first)


@dataclasses.dataclass(frozen=True, order=True)
class Assignment:
    """Node ``peer_id`` serves blocks ``[begin, end)`` of model ``model_sha256``."""

    model_sha256: str
    begin: int
    end: int
    peer_id: str

    @property
    def n_blocks(self) -> int:
        return self.end - self.begin


def blocks_holdable(memory_bytes: int, model: ModelSpec) -> int:
    """Blocks of ``model`` that fit in ``memory_bytes`` (at most n_layer)."""
    if model.bytes_per_block <= 0:
        return model.n_layer
    return max(0, min(model.n_layer, memory_bytes // model.bytes_per_block))


def assign(
    models: Iterable[ModelSpec], nodes: Iterable[NodeCapacity], current: Iterable[Assignment]
) -> tuple[Assignment, ...]:
    """The new assignment set for ``nodes`` (the live ones), keeping what ``current`` can.

    Returns assignments sorted by (model, begin, end, peer id).
    """
    models = sorted({m.sha256: m for m in models}.values(), key=lambda m: m.sha256)
    nodes = sorted({n.peer_id: n for n in nodes}.values(), key=lambda n: n.peer_id)
    current = sorted(set(current))
    weights = _weights(nodes)
    unproven = frozenset(n.peer_id for n in nodes if not n.proven)

    # Models whose nodes cannot hold one copy drop out, one at a time (the furthest from one
    # copy first): the memory it would have taken goes to the others, which may then fit.
    coverable = {m.sha256 for m in models}
    while True:
        budgets = _budgets(nodes, coverable)
        short = []
        for m in models:
            if m.sha256 in coverable:
                holdable = sum(blocks_holdable(budgets[n.peer_id], m) for n in nodes if m.sha256 in n.model_sha256s)
                if holdable < m.n_layer:
                    short.append((Fraction(holdable, m.n_layer), m.sha256))
        if not short:
            break
        coverable.discard(min(short)[1])

    # Uncoverable models keep what still fits of their current ranges, if the covered models
    # stay covered with those counted in the nodes' shares.
    waiting = {
        m.sha256 for m in models if m.sha256 not in coverable and any(a.model_sha256 == m.sha256 for a in current)
    }
    if waiting:
        shared = _budgets(nodes, coverable | waiting)
        if all(
            sum(blocks_holdable(shared[n.peer_id], m) for n in nodes if m.sha256 in n.model_sha256s) >= m.n_layer
            for m in models
            if m.sha256 in coverable
        ):
            budgets = shared
        else:
            waiting = set()

    result: list[Assignment] = []
    for model in models:
        if model.sha256 not in coverable and model.sha256 not in waiting:
            continue
        caps = {n.peer_id: blocks_holdable(budgets[n.peer_id], model) for n in nodes if model.sha256 in n.model_sha256s}
        caps = {peer: cap for peer, cap in caps.items() if cap > 0}
        mine = [a for a in current if a.model_sha256 == model.sha256]
        if model.sha256 in waiting:
            result.extend(_kept(model, caps, mine)[0])
        else:
            result.extend(_assign_model(model, caps, weights, mine, unproven))
    return tuple(sorted(result))


def _budgets(nodes: Sequence[NodeCapacity], models: set[str]) -> dict[str, int]:
    budgets = {}
    for node in nodes:
        count = len(node.model_sha256s & models)
        budgets[node.peer_id] = node.usable_memory_bytes // count if count else 0
    return budgets


def _weights(nodes: Sequence[NodeCapacity]) -> dict[str, Fraction]:
    """Throughput weights ``1 / decode_s_per_block``, exact; unmeasured = the slowest measured."""
    measured = [n.decode_s_per_block for n in nodes if math.isfinite(n.decode_s_per_block) and n.decode_s_per_block > 0]
    slowest = Fraction(max(measured)) if measured else Fraction(1)
    weights = {}
    for node in nodes:
        d = node.decode_s_per_block
        weights[node.peer_id] = 1 / (Fraction(d) if math.isfinite(d) and d > 0 else slowest)
    return weights


def _kept(
    model: ModelSpec, caps: dict[str, int], current: Sequence[Assignment]
) -> tuple[list[Assignment], dict[str, int]]:
    """The current ranges that stay (node alive with the model, range valid, within its cap),
    and the blocks they use per node."""
    kept: list[Assignment] = []
    used = dict.fromkeys(caps, 0)
    for a in current:
        if (
            a.peer_id in caps
            and 0 <= a.begin < a.end <= model.n_layer
            and used[a.peer_id] + a.n_blocks <= caps[a.peer_id]
        ):
            kept.append(a)
            used[a.peer_id] += a.n_blocks
    return kept, used


def _assign_model(
    model: ModelSpec,
    caps: dict[str, int],
    weights: dict[str, Fraction],
    current: Sequence[Assignment],
    unproven: frozenset[str] = frozenset(),
) -> list[Assignment]:
    total = sum(caps.values())
    if total < model.n_layer:
        return []
    kept, used = _kept(model, caps, current)
    max_copies = max(1, total // model.n_layer)
    for base in (kept, []):  # with the kept ranges first; from scratch if they fragment capacity
        base_used = used if base else dict.fromkeys(caps, 0)
        free = {peer: caps[peer] - base_used[peer] for peer in caps}
        for copies in range(max_copies, 0, -1):
            plan = _fill(model, _deficits(model.n_layer, base, copies), free, weights, unproven)
            if plan is not None:
                return [*base, *plan]
    raise AssertionError("one copy from scratch always fits when total capacity >= n_layer")


def _deficits(n_layer: int, ranges: Sequence[Assignment], copies: int) -> list[tuple[int, int]]:
    """Intervals to add so that every block is covered ``copies`` times: for each copy level j,
    the maximal runs of blocks covered fewer than j times."""
    coverage = [0] * n_layer
    for a in ranges:
        for block in range(a.begin, a.end):
            coverage[block] += 1
    intervals = []
    for level in range(1, copies + 1):
        start = None
        for block in range(n_layer + 1):
            short = block < n_layer and coverage[block] < level
            if short and start is None:
                start = block
            elif not short and start is not None:
                intervals.append((start, block))
                start = None
    return intervals


def _fill(
    model: ModelSpec,
    intervals: Sequence[tuple[int, int]],
    free: dict[str, int],
    weights: dict[str, Fraction],
    unproven: frozenset[str] = frozenset(),
) -> list[Assignment] | None:
    """New ranges covering each interval once, from nodes' ``free`` capacity (proven nodes
    first); None if it cannot."""
    if not intervals:
        return []
    groups: list[list[str]] = [[] for _ in intervals]
    unmet = [end - begin for begin, end in intervals]
    whole = [i for i, (begin, end) in enumerate(intervals) if (begin, end) == (0, model.n_layer)]
    for peer in sorted((p for p in free if free[p] > 0), key=lambda p: (p in unproven, -free[p], p)):
        # Once every interval is provided for, the remaining nodes join only whole copies (so
        # that a fresh copy is spread over all its group's throughput), not patches of a
        # gap (which would cut a healed gap into many small hops).
        candidates = range(len(intervals)) if max(unmet) > 0 else whole
        if not candidates:
            break
        target = max(candidates, key=lambda i: (unmet[i], -i))
        groups[target].append(peer)
        unmet[target] -= free[peer]
    if any(need > 0 for need in unmet):
        return None
    plan = []
    for (begin, end), group in zip(intervals, groups):
        group.sort()
        shares = split_proportionally(end - begin, [weights[p] for p in group], [free[p] for p in group])
        for peer, share in zip(group, shares):
            if share:
                plan.append(Assignment(model.sha256, begin, begin + share, peer))
                begin += share
    return plan


def split_proportionally(total: int, weights: Sequence[Fraction], caps: Sequence[int]) -> list[int]:
    """Integers ``b_i <= caps[i]`` summing to ``total``, proportional to ``weights`` where the
    caps allow (water-filling, then largest remainder; ties go to the earlier index).
    Requires ``sum(caps) >= total``."""
    n = len(weights)
    shares = [0] * n  # every index is set below: capped, or shared among the rest
    remaining = total
    active = list(range(n))
    while True:
        weight_sum = sum(weights[i] for i in active)
        capped = [i for i in active if remaining * weights[i] >= caps[i] * weight_sum]
        if not capped:
            break
        for i in capped:
            shares[i] = caps[i]
            remaining -= caps[i]
        active = [i for i in active if i not in capped]
        if not active:
            break
    if active:
        weight_sum = sum(weights[i] for i in active)
        exact = {i: remaining * weights[i] / weight_sum for i in active}
        for i in active:
            shares[i] = math.floor(exact[i])
        leftover = remaining - sum(shares[i] for i in active)
        for i in sorted(active, key=lambda i: (-(exact[i] - shares[i]), i))[:leftover]:
            shares[i] += 1
    return shares
