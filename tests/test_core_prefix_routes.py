"""Prefix-aware routes: ``agent.core.tracker.routing`` prefers hops whose prefix caches hold a
session's prompt prefix (every hop of the route, balanced against cost and load), the tracker
keeps what heartbeats report (``read_prefixes``, the reducer's ``prefix_tags``), and the owner
names a prompt by a bounded set of tags (``agent.core.owner.prefix_blocks.route_tags``)."""

from __future__ import annotations

import dataclasses

import pytest

from agent._proto import swarm_pb2
from agent.core.owner.prefix_blocks import block_hashes, prefix_seed, prefix_tag, route_tags
from agent.core.tracker.heartbeat import read_prefixes
from agent.core.tracker.routing import MAX_ROUTE_PREFIX_TAGS, ReadyRange, RoutePrefix, plan_route
from agent.core.wire.swarm_wire import MAX_PREFIX_TAGS, WireError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

SHA = "aa" * 32
BLOCK = 64
SEED = prefix_seed(SHA, "recipe-1", BLOCK, BLOCK)
SYSTEM = list(range(1000, 1000 + 24 * BLOCK))  # a 1,536-token system prompt: 24 blocks
TAGS = [prefix_tag(h) for h in block_hashes([*SYSTEM, *range(7, 7 + 8 * BLOCK)], BLOCK, SEED)]  # 32 blocks


def rr(peer: str, begin: int, end: int, held: int = 0, *, decode_s: float = 0.01, sessions: int = 0,
       capacity: int = 0) -> ReadyRange:  # fmt: skip
    """A range whose cache holds the first ``held`` blocks of the prompt."""
    return ReadyRange(peer, (f"/memory/{peer}",), begin, end, "recipe-1", decode_s, sessions, capacity,
                      prefix_tags=frozenset(TAGS[:held]))  # fmt: skip


def prompt(blocks: int = 32, max_tags: int = 64) -> RoutePrefix:
    tags = route_tags(block_hashes([*SYSTEM, *range(7, 7 + 8 * BLOCK)][: blocks * BLOCK], BLOCK, SEED), max_tags)
    prefix = RoutePrefix.read([t for _b, t in tags], [b for b, _t in tags], BLOCK)
    assert prefix is not None
    return prefix


def peers(plan) -> list[str]:
    return [h.peer_id for h in plan.hops]


def plan(ranges, prefix=None, discount: float = 0.001, **kw):
    return plan_route("m", SHA, 30, ranges, prefix=prefix, prefix_discount_per_token=discount, **kw)


def test_the_copy_holding_the_prefix_wins_over_the_packed_one():
    # A+B carry sessions (packing would draw the next there); C+D hold the prompt's prefix
    ranges = [rr("A", 0, 15, sessions=2, capacity=8), rr("B", 15, 30, sessions=2, capacity=8),
              rr("C", 0, 15, 24, capacity=8), rr("D", 15, 30, 24, capacity=8)]  # fmt: skip
    assert peers(plan(ranges)) == ["A", "B"]  # no prefix named: packed
    chosen = plan(ranges, prompt())
    assert peers(chosen) == ["C", "D"] and chosen.prefix_blocks == 24
    assert peers(plan(ranges, prompt(), discount=0.0)) == ["A", "B"]  # the preference off


def test_every_hop_must_hold_the_prefix():
    # A holds it, but its only partner of [15, 30) that does too is D: A+D beats A+B and C+D
    ranges = [rr("A", 0, 15, 24), rr("B", 15, 30, 0, sessions=3), rr("C", 0, 15, 0, sessions=3), rr("D", 15, 30, 10)]
    chosen = plan(ranges, prompt())
    assert peers(chosen) == ["A", "D"] and chosen.prefix_blocks == 10
    # a route is only as deep as its shallowest hop: A's 30 blocks count 4 beside B
    ranges = [rr("A", 0, 15, 30), rr("B", 15, 30, 4), rr("C", 0, 15, 12), rr("D", 15, 30, 12)]
    chosen = plan([r for r in ranges if r.peer_id != "D"], prompt())
    assert peers(chosen) == ["A", "B"] and chosen.prefix_blocks == 4
    chosen = plan(ranges, prompt())
    assert peers(chosen) == ["A", "D"] and chosen.prefix_blocks == 12


def test_the_longest_shared_prefix_wins():
    ranges = [rr("A", 0, 15, 24), rr("B", 15, 30, 24), rr("C", 0, 15, 32), rr("D", 15, 30, 32)]
    chosen = plan(ranges, prompt())
    assert peers(chosen) == ["C", "D"] and chosen.prefix_blocks == 32
    # a prompt that shares only the system prompt with both finds them equal: packing, then peer ids
    other = RoutePrefix.read(
        [prefix_tag(h) for h in block_hashes([*SYSTEM, *range(99, 99 + BLOCK)], BLOCK, SEED)],
        list(range(1, 26)), BLOCK,
    )  # fmt: skip
    assert other is not None
    chosen = plan(ranges, other)
    assert peers(chosen) == ["A", "B"] and chosen.prefix_blocks == 24


def test_a_full_hop_outweighs_the_prefix():
    ranges = [rr("A", 0, 15, capacity=4), rr("B", 15, 30, capacity=4),
              rr("C", 0, 15, 24, sessions=4, capacity=4), rr("D", 15, 30, 24, capacity=4)]  # fmt: skip
    chosen = plan(ranges, prompt())
    assert peers(chosen) == ["A", "B"] and chosen.prefix_blocks == 0


def test_the_discount_is_a_share_of_the_route_cost_and_capped():
    # 2 blocks = 128 tokens take 0.128 of the slow route's cost: not enough against 20 % faster
    slow = [rr("A", 0, 15, 2, decode_s=0.012), rr("B", 15, 30, 2, decode_s=0.012)]
    fast = [rr("C", 0, 15, decode_s=0.01), rr("D", 15, 30, decode_s=0.01)]
    assert peers(plan([*slow, *fast], prompt())) == ["C", "D"]
    # 24 blocks = 1,536 tokens take the most, half: enough against 20 % faster ...
    slow = [dataclasses.replace(r, prefix_tags=frozenset(TAGS[:24])) for r in slow]
    assert peers(plan([*slow, *fast], prompt())) == ["A", "B"]
    # ... never against a route more than twice as fast
    slower = [dataclasses.replace(r, decode_s_per_block=0.021) for r in slow]
    assert peers(plan([*slower, *fast], prompt())) == ["C", "D"]
    assert peers(plan([*slower, *fast], prompt(), prefix_discount_max=0.6)) == ["A", "B"]


def test_a_prompt_named_by_a_few_tags_finds_the_depth_within_their_spacing():
    # 32 blocks named by at most 8 tags: every 4th block, ending at the deepest
    prefix = prompt(max_tags=8)
    assert [b for b, _t in prefix.tags] == [32, 28, 24, 20, 16, 12, 8, 4]
    assert prefix.held_blocks(frozenset(TAGS[:26])) == 24
    assert prefix.held_blocks(frozenset(TAGS[:3])) == 0
    assert prefix.held_blocks(frozenset(TAGS)) == 32


def test_route_tags_are_bounded_and_end_at_the_deepest_block():
    hashes = block_hashes(SYSTEM, BLOCK, SEED)
    assert route_tags(hashes, 0) == [] and route_tags([], 8) == []
    every = route_tags(hashes, 64)
    assert [b for b, _t in every] == list(range(24, 0, -1))
    few = route_tags(hashes, 5)
    assert len(few) <= 5 and few[0] == (24, prefix_tag(hashes[-1]))
    assert prefix_tag(bytes([1, 0, 0, 0, 0, 0, 0, 0x80, 0xFF])) == 0x8000000000000001


def test_a_bad_route_prefix_is_refused_with_what_was_wrong():
    assert RoutePrefix.read([], [], 0) is None
    with pytest.raises(ValueError, match="2 tags but prefix_tag_blocks 1"):
        RoutePrefix.read([1, 2], [1], BLOCK)
    with pytest.raises(ValueError, match="prefix_block_tokens is 0"):
        RoutePrefix.read([1], [1], 0)
    with pytest.raises(ValueError, match="has a 0"):
        RoutePrefix.read([1], [0], BLOCK)
    n = MAX_ROUTE_PREFIX_TAGS + 1
    with pytest.raises(ValueError, match=f"{n} tags, over"):
        RoutePrefix.read(list(range(n)), [1] * n, BLOCK)


def test_heartbeat_prefixes_are_read_per_range_and_bounded():
    def report(model: str, begin: int, end: int, tags) -> swarm_pb2.RangePrefixes:
        return swarm_pb2.RangePrefixes(
            assignment=swarm_pb2.Assignment(model_sha256=model, begin=begin, end=end), tags=tags
        )

    held = read_prefixes([report(SHA, 0, 15, [1, 2, 3]), report(SHA, 15, 30, [])])
    assert held == {(SHA, 0, 15): frozenset({1, 2, 3})}
    with pytest.raises(WireError, match=r"prefixes\[1\] has 4097 tags"):
        read_prefixes([report(SHA, 0, 15, [1]), report(SHA, 15, 30, range(MAX_PREFIX_TAGS + 1))])
