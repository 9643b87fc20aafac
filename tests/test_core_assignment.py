"""agent.core.tracker.assignment: capacity-proportional ranges, redundancy, healing, determinism."""

from __future__ import annotations

import random
from collections import Counter
from fractions import Fraction

import pytest

from agent.core.tracker.assignment import (
    Assignment,
    ModelSpec,
    NodeCapacity,
    assign,
    blocks_holdable,
    split_proportionally,
)

pytestmark = pytest.mark.unit

BPB = 1000  # bytes per block
M = ModelSpec(sha256="aa" * 32, n_layer=30, bytes_per_block=BPB)
M2 = ModelSpec(sha256="bb" * 32, n_layer=10, bytes_per_block=BPB)


def node(peer: str, blocks: int, decode_s: float = 0.01, models=(M.sha256,)) -> NodeCapacity:
    return NodeCapacity(peer, blocks * BPB, decode_s, frozenset(models))


def ranges(assignments, model=M) -> list[tuple[str, int, int]]:
    return [(a.peer_id, a.begin, a.end) for a in assignments if a.model_sha256 == model.sha256]


def coverage(assignments, model=M) -> list[int]:
    count = [0] * model.n_layer
    for a in assignments:
        if a.model_sha256 == model.sha256:
            for block in range(a.begin, a.end):
                count[block] += 1
    return count


def test_blocks_holdable_floors_and_caps():
    assert blocks_holdable(999, M) == 0
    assert blocks_holdable(1999, M) == 1
    assert blocks_holdable(10**9, M) == 30


def test_even_split_for_equal_nodes():
    result = assign([M], [node("C", 20), node("A", 20), node("B", 20)], [])
    assert ranges(result) == [("A", 0, 10), ("B", 10, 20), ("C", 20, 30)]


def test_split_is_proportional_to_throughput():
    # B is twice as fast as A and C: it gets twice the blocks.
    result = assign([M], [node("A", 30, 0.02), node("B", 30, 0.01), node("C", 30, 0.02)], [])
    # 90 holdable blocks would make 3 copies of single nodes; cap memory so one copy is all.
    assert coverage(result) == [3] * 30
    result = assign([M], [node("A", 15, 0.02), node("B", 15, 0.01), node("C", 15, 0.02)], [])
    # Shares 7.5 / 15 / 7.5: the odd block goes to the first in peer id order.
    assert ranges(result) == [("A", 0, 8), ("B", 8, 23), ("C", 23, 30)]


def test_proportional_share_is_bounded_by_memory():
    # B is 10x faster but can only hold 5 blocks; the rest goes to A and C evenly.
    result = assign([M], [node("A", 20, 0.01), node("B", 5, 0.001), node("C", 20, 0.01)], [])
    assert ranges(result) == [("A", 0, 13), ("B", 13, 18), ("C", 18, 30)]
    assert coverage(result) == [1] * 30


def test_redundancy_four_nodes_holding_half_make_two_copies():
    result = assign([M], [node(p, 15) for p in "ABCD"], [])
    assert coverage(result) == [2] * 30
    assert ranges(result) == [("A", 0, 15), ("B", 0, 15), ("C", 15, 30), ("D", 15, 30)]


def test_copies_drop_when_groups_cannot_each_cover():
    # 25 + 25 + 15 = 65 holdable blocks = floor 2 copies, but no 2-way split covers 30 twice.
    result = assign([M], [node("A", 25), node("B", 25), node("C", 15)], [])
    assert coverage(result) == [1] * 30
    assert {a.peer_id for a in result} == {"A", "B", "C"}


def test_healing_keeps_survivors_and_covers_the_gap():
    nodes = [node("A", 20), node("B", 20), node("C", 20)]
    before = assign([M], nodes, [])
    assert ranges(before) == [("A", 0, 10), ("B", 10, 20), ("C", 20, 30)]
    after = assign([M], nodes[:2], before)  # C died
    assert coverage(after) == [1] * 30
    assert set(ranges(before)[:2]) <= set(ranges(after))  # survivors keep their ranges
    # The gap [20, 30) goes to one node (the fewest hops), not cut between both.
    assert [r for r in ranges(after) if r not in ranges(before)] == [("A", 20, 30)]


def test_healing_with_a_new_node_gives_it_the_gap():
    nodes = [node("A", 10), node("B", 10), node("C", 10)]
    before = assign([M], nodes, [])
    assert ranges(before) == [("A", 0, 10), ("B", 10, 20), ("C", 20, 30)]
    after = assign([M], [nodes[0], nodes[2], node("D", 10)], before)  # B died, D joined
    assert ranges(after) == [("A", 0, 10), ("D", 10, 20), ("C", 20, 30)]


def test_join_keeps_existing_ranges_and_adds_a_copy():
    nodes = [node(p, 15) for p in "AB"]
    before = assign([M], nodes, [])
    assert ranges(before) == [("A", 0, 15), ("B", 15, 30)]
    after = assign([M], [*nodes, node("C", 15), node("D", 15)], before)
    assert set(ranges(before)) <= set(ranges(after))
    assert coverage(after) == [2] * 30


def test_recompute_with_same_inputs_changes_nothing():
    nodes = [node("A", 12, 0.01), node("B", 17, 0.02), node("C", 9, 0.005), node("D", 30, 0.03)]
    first = assign([M], nodes, [])
    assert assign([M], nodes, first) == first


def test_node_without_the_model_never_gets_it():
    result = assign([M, M2], [node("A", 40, models=[M.sha256]), node("B", 40, models=[M2.sha256])], [])
    assert {a.peer_id for a in result if a.model_sha256 == M.sha256} == {"A"}
    assert {a.peer_id for a in result if a.model_sha256 == M2.sha256} == {"B"}


def test_too_small_nodes_get_nothing():
    result = assign(
        [M], [node("A", 20), node("B", 20), NodeCapacity("tiny", BPB - 1, 0.0001, frozenset([M.sha256]))], []
    )
    assert "tiny" not in {a.peer_id for a in result}
    assert coverage(result) == [1] * 30


def test_model_that_cannot_be_covered_gets_nothing():
    assert assign([M], [node("A", 10), node("B", 10)], []) == ()


def test_one_copy_losing_a_node_keeps_the_survivors_until_one_joins():
    nodes = [node("A", 10), node("B", 10), node("C", 10)]
    before = assign([M], nodes, [])
    assert ranges(before) == [("A", 0, 10), ("B", 10, 20), ("C", 20, 30)]
    waiting = assign([M], [nodes[0], nodes[2]], before)  # B died: no copy can be made
    assert ranges(waiting) == [("A", 0, 10), ("C", 20, 30)]  # nothing unloads, nothing new
    assert assign([M], [nodes[0], nodes[2]], waiting) == waiting
    healed = assign([M], [nodes[0], nodes[2], node("D", 10)], waiting)
    assert ranges(healed) == [("A", 0, 10), ("D", 10, 20), ("C", 20, 30)]


def test_a_waiting_partial_copy_gives_way_when_another_model_needs_the_memory():
    both = (M.sha256, M2.sha256)
    current = (Assignment(M.sha256, 0, 10, "A"),)  # M lost the node that held [10, 30)
    result = assign([M, M2], [node("A", 20, models=both)], current)
    # kept, M takes half of A's memory and M2 (10 blocks) still fits in the other half: both stay
    assert ranges(result, M) == [("A", 0, 10)] and coverage(result, M2) == [1] * 10
    tight = assign([M, M2], [node("A", 15, models=both)], current)
    # with half of A's memory (7 blocks) M2 cannot be covered: M's partial copy gives way
    assert ranges(tight, M) == [] and coverage(tight, M2) == [1] * 10


def test_a_node_shares_its_memory_among_its_models():
    both = (M.sha256, M2.sha256)
    result = assign([M, M2], [node("A", 40, models=both), node("B", 40, models=both)], [])
    assert coverage(result, M) == [1] * 30 and coverage(result, M2) == [2] * 10
    for peer in "AB":
        assert sum(a.n_blocks for a in result if a.peer_id == peer) <= 40


def test_uncoverable_model_leaves_memory_to_the_others():
    big = ModelSpec(sha256="cc" * 32, n_layer=100, bytes_per_block=BPB)
    result = assign([M, big], [node("A", 30, models=(M.sha256, big.sha256))], [])
    assert ranges(result) == [("A", 0, 30)]


def test_unmeasured_throughput_counts_as_the_slowest():
    result = assign([M], [node("A", 30, 0.0), node("B", 30, 0.02), node("C", 30, 0.01)], [])
    assert coverage(result) == [3] * 30  # three single-node copies, weights do not matter
    result = assign([M], [node("A", 15, 0.0), node("B", 15, 0.02)], [])
    assert ranges(result) == [("A", 0, 15), ("B", 15, 30)]


def test_deterministic_whatever_the_input_order():
    nodes = [node(chr(65 + i), 5 + 3 * i, 0.001 * (1 + i % 3)) for i in range(8)]
    first = assign([M, M2], nodes, [])
    rng = random.Random(0)
    for _ in range(5):
        shuffled = nodes[:]
        rng.shuffle(shuffled)
        assert assign([M2, M], shuffled, []) == first


def test_every_block_covered_and_memory_respected_on_random_swarms():
    rng = random.Random(1)
    for _ in range(200):
        nodes = [
            node(f"p{i:02d}", rng.randint(1, 40), rng.choice([0.0, 0.001, 0.002, 0.005]))
            for i in range(rng.randint(1, 9))
        ]
        current: tuple[Assignment, ...] = ()
        for _step in range(3):
            result = assign([M], nodes, current)
            holdable = sum(min(30, n.usable_memory_bytes // BPB) for n in nodes)
            if holdable >= 30:
                assert min(coverage(result)) >= 1
            else:
                assert set(result) <= set(current)  # a partial copy only keeps what it had
            used = Counter()
            for a in result:
                used[a.peer_id] += a.n_blocks
            for n in nodes:
                assert used[n.peer_id] <= min(30, n.usable_memory_bytes // BPB)
            current = result
            nodes = [n for n in nodes if rng.random() > 0.3] + [
                node(f"q{_step}{i}", rng.randint(1, 30)) for i in range(2)
            ]


def test_split_proportionally():
    assert split_proportionally(10, [Fraction(1)] * 3, [10] * 3) == [4, 3, 3]
    assert split_proportionally(10, [Fraction(1), Fraction(9)], [10, 5]) == [5, 5]
    assert split_proportionally(7, [Fraction(1), Fraction(1)], [7, 0]) == [7, 0]
    assert split_proportionally(0, [Fraction(1), Fraction(2)], [3, 3]) == [0, 0]
