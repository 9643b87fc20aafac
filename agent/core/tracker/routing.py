"""Route planning: which READY ranges a session's steps go through, in order.

Owns the routing rule of the shared swarm semantics (docs/ARCHITECTURE.md): from the ranges nodes
report READY, all with one recipe hash, choose hops that chain exactly (hop i ends where hop
i+1 begins) from block 0 to n_layer, minimising the estimated step time
``sum(blocks * decode_s_per_block) + hop_latency_s`` per hop, over ranges that still have
room for a session. Sessions are *packed*, not spread: among routes of equal cost (costs are
compared in units of ``cost_resolution_s``, so that two nodes measured a hair apart count as
equally fast) the one already carrying the most live sessions wins, so compatible sessions
share a route and merge into one Forward at every hop (continuous batching); a range whose
live sessions reach its capacity (its worker's sequences, or the tracker's per-route cap)
is full, and a route through a full range is taken only when every route has one (its
owner then waits for a sequence). So a redundant route opens when the first is full, or for
a session that must avoid a peer. Then the smaller peer ids.

Prefixes (``RoutePrefix``): a session names its prompt's prefix blocks by tags, and each range
says which tags its worker's prefix cache holds (its node's heartbeats). A route's shared
prefix is the fewest leading blocks any of its hops holds (every hop copies as many: a hop
that holds none makes the others' copies useless). A route holding ``k`` blocks of ``t``
tokens ranks as if its step cost were less by ``min(prefix_discount_max, k * t *
prefix_discount_per_token)`` of itself (at equal ranks, the deeper prefix first). Relative,
because what a cached token saves (its prefill on every hop) grows with the route's own cost,
and because nodes' measured speeds differ by more than any fixed bonus between copies on like
machines; capped, so that a route far slower than the others does not win every session by
holding a long prefix. Full ranges still rank first, so a busy hop's load outweighs any prefix
(the session goes elsewhere and fills a cache there). Packing comes after cost: of two equal
copies of every range, the one holding the prefix wins even when the other carries more
sessions. The preference is all a report decides: the owner asks every hop before it copies,
so a stale report is a miss, never a wrong answer.

Pure: no I/O, no clock. The tracker passes the live sessions nodes report and the routes it
handed out since.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence

__all__ = ["MAX_ROUTE_PREFIX_TAGS", "Hop", "NoRoute", "ReadyRange", "RoutePlan", "RoutePrefix", "plan_route"]

#: prefix tags one route request may name (an owner sends a few dozen)
MAX_ROUTE_PREFIX_TAGS = 256


@dataclasses.dataclass(frozen=True)
class ReadyRange:
    """A range a live node serves READY."""

    peer_id: str
    addrs: tuple[str, ...]
    begin: int
    end: int
    recipe_hash: str
    decode_s_per_block: float
    sessions: int = 0  # live sessions on this range (the node's last heartbeat)
    capacity: int = 0  # sessions it can hold at once (0: unknown, never full)
    prefix_tags: frozenset[int] = frozenset()  # prefix blocks its cache holds (RoutePrefix)

    def full(self, extra: int = 0) -> bool:
        return self.capacity > 0 and self.sessions + extra >= self.capacity


@dataclasses.dataclass(frozen=True)
class Hop:
    peer_id: str
    addrs: tuple[str, ...]
    begin: int
    end: int


@dataclasses.dataclass(frozen=True)
class RoutePlan:
    model_sha256: str
    n_layer: int
    hops: tuple[Hop, ...]
    recipe_hash: str
    estimated_step_s: float
    prefix_blocks: int = 0  # leading blocks of the session's prefix every hop reported holding


@dataclasses.dataclass(frozen=True)
class RoutePrefix:
    """A session's prompt prefix as a route request names it: ``(blocks, tag)`` pairs, each the
    tag of the hash of block ``blocks - 1`` (a chained hash: it names all ``blocks`` leading
    blocks of ``block_tokens`` tokens). Any subset of a prompt's blocks will do: a range's
    depth is the longest named prefix it holds."""

    tags: tuple[tuple[int, int], ...]
    block_tokens: int

    @classmethod
    def read(cls, tags: Sequence[int], blocks: Sequence[int], block_tokens: int) -> RoutePrefix | None:
        """From a ``RouteRequest``'s fields; None when it names none.

        Raises:
          ValueError: the counts differ, too many tags, a block count of 0, or no block size.
        """
        if not tags and not blocks:
            return None
        if len(tags) != len(blocks):
            raise ValueError(f"prefix_tags has {len(tags)} tags but prefix_tag_blocks {len(blocks)} counts")
        if len(tags) > MAX_ROUTE_PREFIX_TAGS:
            raise ValueError(f"prefix_tags has {len(tags)} tags, over {MAX_ROUTE_PREFIX_TAGS}")
        if block_tokens < 1:
            raise ValueError("prefix_block_tokens is 0 while prefix_tags are given")
        if any(b < 1 for b in blocks):
            raise ValueError("prefix_tag_blocks has a 0 (a tag names at least one block)")
        return cls(tuple(zip(blocks, tags, strict=True)), block_tokens)

    def held_blocks(self, held: frozenset[int]) -> int:
        """The longest of these prefixes, in blocks, whose tag is in ``held`` (0: none)."""
        return max((blocks for blocks, tag in self.tags if tag in held), default=0)


class NoRoute(Exception):
    """No chain of READY ranges with one recipe covers the model; the message says why."""


def plan_route(
    model: str,
    model_sha256: str,
    n_layer: int,
    ranges: Sequence[ReadyRange],
    *,
    load: Mapping[str, int] | None = None,
    hop_latency_s: float = 0.002,
    cost_resolution_s: float = 1e-4,
    avoid: Collection[str] = (),
    begin: int = 0,
    end: int | None = None,
    recipe_hash: str = "",
    prefix: RoutePrefix | None = None,
    prefix_discount_per_token: float = 0.0,
    prefix_discount_max: float = 0.5,
) -> RoutePlan:
    """The cheapest exact chain of ``ranges`` over ``[begin, end)`` (default: the whole
    model, ``[0, n_layer)``).

    Args:
      model: the name the caller asked for (used in the error message).
      load: sessions each peer id took on that its ranges' ``sessions`` do not count yet (routes
        handed out since its last heartbeat; missing: 0).
      avoid: peers the route must not go through (an owner lost them).
      hop_latency_s: estimated link latency added per hop.
      cost_resolution_s: costs are compared in whole units of this.
      begin, end: plan only blocks ``[begin, end)`` (a replacement for a lost range, between
        hops that keep their caches); the plan's hops then cover just that part.
      recipe_hash: only ranges of this recipe (the one the rest of the route runs); "" any.
      prefix: the session's prompt prefix: routes whose every hop holds more of it rank as if
        their step cost ``prefix_discount_per_token`` of itself less per token held, at most
        ``prefix_discount_max`` of it (full ranges first).

    Raises:
      NoRoute: "no route for model X: blocks [a, b) have no ready node" when some blocks
        are not served READY by anyone, or "...: ready ranges do not chain ..." when every block
        is served but no exact chain with one recipe reaches the end.
    """
    load = load or {}
    avoid = frozenset(avoid)
    end = n_layer if end is None else end
    if not 0 <= begin < end <= n_layer:
        raise NoRoute(f"no route for model {model}: blocks [{begin}, {end}) are not a part of its {n_layer} blocks")
    valid = [
        r
        for r in ranges
        if begin <= r.begin < r.end <= end
        and r.peer_id not in avoid
        and (not recipe_hash or r.recipe_hash == recipe_hash)
    ]
    held = {id(r): prefix.held_blocks(r.prefix_tags) if prefix is not None else 0 for r in valid}
    # (full ranges, discounted cost units, minus the prefix's depth, minus the sessions, peer ids)
    best: tuple[tuple[int, int, int, int, tuple[str, ...]], list[ReadyRange], int] | None = None
    for recipe in sorted({r.recipe_hash for r in valid}):
        of_recipe = [r for r in valid if r.recipe_hash == recipe]
        # each prefix depth some range holds: the best chain whose every hop holds that much,
        # its cost less the depth's discount (a chain holding more is found at its own depth too)
        for depth in sorted({0} | {held[id(r)] for r in of_recipe}):
            candidate = _best_chain(
                begin, end, [r for r in of_recipe if held[id(r)] >= depth], load, hop_latency_s, cost_resolution_s
            )
            if candidate is None:
                continue
            (full, cost, minus_sessions, peers), chain = candidate
            tokens = depth * (prefix.block_tokens if prefix is not None else 0)
            discount = min(max(prefix_discount_max, 0.0), tokens * max(prefix_discount_per_token, 0.0))
            deeper = -depth if prefix_discount_per_token > 0 else 0  # (0: no preference at all)
            key = (full, round(cost * (1.0 - discount)), deeper, minus_sessions, peers)
            if best is None or key < best[0]:
                best = (key, chain, depth)
    if best is None:
        why = _why_no_route(model, begin, end, valid)
        if recipe_hash:
            why += f" (of recipe {recipe_hash[:12]})"
        if avoid:
            why += f" (without {', '.join(sorted(avoid))})"
        raise NoRoute(why)
    _, chain, depth = best
    estimated = sum((r.end - r.begin) * max(r.decode_s_per_block, 0.0) + hop_latency_s for r in chain)
    return RoutePlan(
        model_sha256=model_sha256,
        n_layer=n_layer,
        hops=tuple(Hop(r.peer_id, tuple(r.addrs), r.begin, r.end) for r in chain),
        recipe_hash=chain[0].recipe_hash,
        estimated_step_s=estimated,
        prefix_blocks=depth,
    )


# A chain's rank, smallest best: (full ranges, cost units, minus the sessions carried, peer ids).
_ChainKey = tuple[int, int, int, tuple[str, ...]]


def _best_chain(
    begin: int,
    end: int,
    ranges: Sequence[ReadyRange],
    load: Mapping[str, int],
    hop_latency_s: float,
    cost_resolution_s: float,
) -> tuple[_ChainKey, list[ReadyRange]] | None:
    """Dynamic programme over block boundaries: best[b] = the best chain from ``begin`` ending
    at b, keyed (full ranges, cost units, minus the sessions carried, peer ids); ranges only go
    forward, so boundaries in increasing order are a topological order."""
    by_begin: dict[int, list[ReadyRange]] = {}
    for r in sorted(ranges, key=lambda r: (r.begin, r.end, r.peer_id)):
        by_begin.setdefault(r.begin, []).append(r)
    best: dict[int, tuple[_ChainKey, list[ReadyRange]]] = {begin: ((0, 0, 0, ()), [])}
    for boundary in range(begin, end):
        if boundary not in best:
            continue
        (full, cost, minus_sessions, peers), chain = best[boundary]
        for r in by_begin.get(boundary, ()):
            units = round(((r.end - r.begin) * max(r.decode_s_per_block, 0.0) + hop_latency_s) / cost_resolution_s)
            extra = load.get(r.peer_id, 0)
            key = (full + r.full(extra), cost + units, minus_sessions - (r.sessions + extra), (*peers, r.peer_id))
            if r.end not in best or key < best[r.end][0]:
                best[r.end] = (key, [*chain, r])
    return best.get(end)


def _why_no_route(model: str, begin: int, end: int, ranges: Sequence[ReadyRange]) -> str:
    covered = [False] * end
    for r in ranges:
        for block in range(r.begin, r.end):
            covered[block] = True
    gaps = []
    start = None
    for block in range(begin, end + 1):
        gap = block < end and not covered[block]
        if gap and start is None:
            start = block
        elif not gap and start is not None:
            gaps.append(f"[{start}, {block})")
            start = None
    if gaps:
        listed = gaps[0] if len(gaps) == 1 else ", ".join(gaps[:-1]) + " and " + gaps[-1]
        return f"no route for model {model}: blocks {listed} have no ready node"
    return (
        f"no route for model {model}: every block has a ready node, but no chain of ready ranges "
        f"with one recipe hash leads from block {begin} to {end}"
    )
