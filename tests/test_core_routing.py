"""agent.core.tracker.routing: exact chains of READY ranges, cheapest first, sessions packed onto a
route until one of its ranges is full."""

from __future__ import annotations

import pytest

from agent.core.tracker.routing import Hop, NoRoute, ReadyRange, plan_route

pytestmark = pytest.mark.unit

SHA = "aa" * 32
R1, R2 = "recipe-1", "recipe-2"


def rr(
    peer: str, begin: int, end: int, decode_s: float = 0.01, recipe: str = R1, sessions: int = 0, capacity: int = 0
) -> ReadyRange:
    return ReadyRange(peer, (f"/memory/{peer}",), begin, end, recipe, decode_s, sessions, capacity)


def hops(plan) -> list[tuple[str, int, int]]:
    return [(h.peer_id, h.begin, h.end) for h in plan.hops]


def test_single_chain():
    plan = plan_route("m", SHA, 30, [rr("B", 10, 30), rr("A", 0, 10)], hop_latency_s=0.002)
    assert hops(plan) == [("A", 0, 10), ("B", 10, 30)]
    assert plan.hops[0] == Hop("A", ("/memory/A",), 0, 10)
    assert plan.model_sha256 == SHA and plan.n_layer == 30 and plan.recipe_hash == R1
    assert plan.estimated_step_s == pytest.approx(30 * 0.01 + 2 * 0.002)


def test_avoided_peers_are_planned_around_or_named_in_the_refusal():
    ranges = [rr("A", 0, 10), rr("B", 10, 30), rr("C", 10, 30, 0.02)]
    assert hops(plan_route("m", SHA, 30, ranges)) == [("A", 0, 10), ("B", 10, 30)]
    assert hops(plan_route("m", SHA, 30, ranges, avoid={"B"})) == [("A", 0, 10), ("C", 10, 30)]
    with pytest.raises(NoRoute, match=r"blocks \[0, 10\) have no ready node \(without A\)"):
        plan_route("m", SHA, 30, ranges, avoid=["A"])


def test_picks_the_faster_chain():
    ranges = [rr("A", 0, 15, 0.01), rr("B", 15, 30, 0.01), rr("C", 0, 15, 0.005), rr("D", 15, 30, 0.02)]
    assert hops(plan_route("m", SHA, 30, ranges)) == [("C", 0, 15), ("B", 15, 30)]


def test_link_latency_prefers_fewer_hops():
    ranges = [rr("A", 0, 10), rr("B", 10, 20), rr("C", 20, 30), rr("D", 0, 30)]
    assert hops(plan_route("m", SHA, 30, ranges, hop_latency_s=0.002)) == [("D", 0, 30)]
    # Without latency the two are equal; the tie goes to the smaller peer ids.
    assert hops(plan_route("m", SHA, 30, ranges, hop_latency_s=0.0)) == [("A", 0, 10), ("B", 10, 20), ("C", 20, 30)]


def test_packs_sessions_onto_the_busiest_route_until_one_of_its_ranges_is_full():
    def ranges(a: int, b: int, c: int = 0, d: int = 0) -> list[ReadyRange]:
        return [rr("A", 0, 15, sessions=a, capacity=4), rr("B", 15, 30, sessions=b, capacity=4),
                rr("C", 0, 15, sessions=c, capacity=4), rr("D", 15, 30, sessions=d, capacity=4)]  # fmt: skip

    assert hops(plan_route("m", SHA, 30, ranges(0, 0))) == [("A", 0, 15), ("B", 15, 30)]
    # the sessions C and D carry draw the next one there: it batches with them
    assert hops(plan_route("m", SHA, 30, ranges(0, 0, 2, 2))) == [("C", 0, 15), ("D", 15, 30)]
    assert hops(plan_route("m", SHA, 30, ranges(3, 3, 1, 1))) == [("A", 0, 15), ("B", 15, 30)]
    # B is full: the route goes around it, keeping the busiest room it has
    assert hops(plan_route("m", SHA, 30, ranges(3, 4, 1, 1))) == [("A", 0, 15), ("D", 15, 30)]
    # routes handed out since the last heartbeats count too
    assert hops(plan_route("m", SHA, 30, ranges(3, 3, 1, 1), load={"B": 1})) == [("A", 0, 15), ("D", 15, 30)]
    # every route full: the cheapest anyway (its owner waits for a sequence)
    assert hops(plan_route("m", SHA, 30, ranges(4, 4, 4, 4))) == [("A", 0, 15), ("B", 15, 30)]
    # unknown capacity is never full
    assert hops(plan_route("m", SHA, 30, [rr("A", 0, 30, sessions=50), rr("B", 0, 30)])) == [("A", 0, 30)]


def test_nearly_equal_measurements_count_as_a_tie():
    ranges = [rr("A", 0, 30, 0.0100001, capacity=2), rr("B", 0, 30, 0.0100002, capacity=2)]
    assert hops(plan_route("m", SHA, 30, ranges, load={"B": 1})) == [("B", 0, 30)]
    assert hops(plan_route("m", SHA, 30, ranges, load={"B": 2})) == [("A", 0, 30)]
    # but a clear speed difference beats load
    ranges = [rr("A", 0, 30, 0.01), rr("B", 0, 30, 0.02)]
    assert hops(plan_route("m", SHA, 30, ranges, load={"B": 5})) == [("A", 0, 30)]


def test_hops_chain_exactly():
    # [0, 12) then [10, 30) overlap: not a chain. [0, 10) + [10, 30) is.
    ranges = [rr("A", 0, 12, 0.001), rr("B", 10, 30), rr("C", 12, 30, 0.05), rr("D", 0, 10)]
    plan = plan_route("m", SHA, 30, ranges)
    # A is fast, but its only continuation C is slow: D + B is cheaper (0.3 s vs 0.912 s).
    assert hops(plan) == [("D", 0, 10), ("B", 10, 30)]
    for left, right in zip(plan.hops, plan.hops[1:]):
        assert left.end == right.begin
    assert plan.hops[0].begin == 0 and plan.hops[-1].end == 30
    # overlapping ranges alone never make a route
    with pytest.raises(NoRoute, match="no chain of ready ranges"):
        plan_route("m", SHA, 30, [rr("A", 0, 12), rr("B", 10, 30)])


def test_one_recipe_hash_per_route():
    ranges = [rr("A", 0, 15, recipe=R1), rr("B", 15, 30, recipe=R2)]
    with pytest.raises(NoRoute, match="with one recipe hash"):
        plan_route("m", SHA, 30, ranges)
    ranges += [rr("C", 15, 30, 0.05, recipe=R1)]
    plan = plan_route("m", SHA, 30, ranges)
    assert hops(plan) == [("A", 0, 15), ("C", 15, 30)] and plan.recipe_hash == R1


def test_the_cheaper_recipe_wins():
    ranges = [rr("A", 0, 30, 0.02, recipe=R1), rr("B", 0, 30, 0.01, recipe=R2)]
    assert plan_route("m", SHA, 30, ranges).recipe_hash == R2


def test_no_route_names_the_uncovered_blocks():
    with pytest.raises(NoRoute) as info:
        plan_route("smollm2", SHA, 30, [rr("A", 0, 10), rr("B", 20, 25)])
    assert str(info.value) == "no route for model smollm2: blocks [10, 20) and [25, 30) have no ready node"
    with pytest.raises(NoRoute, match=r"^no route for model x: blocks \[0, 30\) have no ready node$"):
        plan_route("x", SHA, 30, [])


def test_out_of_bounds_ranges_are_ignored():
    with pytest.raises(NoRoute, match=r"blocks \[0, 30\)"):
        plan_route("m", SHA, 30, [rr("A", 0, 31), rr("B", 5, 5)])


def test_handouts_count_until_the_hops_report_them_or_their_owner_ends_them():
    from agent.core.tracker.handouts import RouteHandouts

    handouts = RouteHandouts(grace_s=2.0, horizon_s=60.0)
    a = handouts.hand_out(10.0, ["p1", "p2"], requester="owner")
    b = handouts.hand_out(11.0, ["p1"], requester="owner")
    assert a != b
    assert handouts.load(11.0, {}) == {"p1": 2, "p2": 1}
    # p1's heartbeat sent 2 s after the first handout counts that session itself; not the second
    assert handouts.load(12.5, {"p1": 12.5}) == {"p1": 1, "p2": 1}
    assert handouts.end([a], requester="someone else") == 0  # only its owner may end it
    assert handouts.end([a, 999], requester="owner") == 1
    assert handouts.load(12.5, {}) == {"p1": 1}
    assert handouts.load(71.5, {}) == {} and len(handouts) == 0  # past the horizon
