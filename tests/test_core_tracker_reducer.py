"""The tracker as a reducer (agent.core.tracker.reducer): registrations, heartbeats, sweeps,
suspects and withdrawals as events on a fake clock (plain ints of ms), each giving a new state
and the effects the shell performs. No trio, no store: the shell's part is
tests/test_tracker.py's."""

from __future__ import annotations

import dataclasses

import pytest

from agent._proto import swarm_pb2
from agent.core.tracker.assignment import Assignment, ModelSpec, NodeCapacity, assign
from agent.core.tracker.reducer import apply, loading_deadline_ms, ready_ranges, restore
from agent.core.tracker.state import (
    Directives,
    Effect,
    Event,
    Heartbeat,
    LoadFailed,
    Log,
    MarkDead,
    ModelsChanged,
    NodeFacts,
    NodeProven,
    NodeRefused,
    Notify,
    PeerReported,
    ProbeEnded,
    ProbePeer,
    PruneNonces,
    RangeStatus,
    RangeWithdrawn,
    Recompute,
    Refuse,
    Registered,
    ReportAnswered,
    StoreAssignments,
    StoreStatus,
    Sweep,
    TrackerRules,
    TrackerState,
)
from agent.core.wire.swarm_wire import WireError

pytestmark = pytest.mark.unit

State = swarm_pb2.AssignmentStatus.State
M = "ab" * 32
BPB = 1_000_000
TIMEOUT_MS = 5_000
RULES = TrackerRules(heartbeat_timeout_ms=TIMEOUT_MS, registration_max_age_ms=60_000, nonce_retention_ms=600_000)
MODEL = ModelSpec(M, n_layer=6, bytes_per_block=BPB)
FIRST, SECOND = Assignment(M, 0, 3, "A"), Assignment(M, 3, 6, "B")


def facts(peer: str, blocks: int = 3) -> NodeFacts:
    return NodeFacts(peer, blocks * BPB, 0.001, frozenset({M}), fetches_models=False)


def status(a: Assignment, state: int, recipe: str = "r1", error: str = "") -> swarm_pb2.AssignmentStatus:
    return swarm_pb2.AssignmentStatus(
        assignment=swarm_pb2.Assignment(model_sha256=a.model_sha256, begin=a.begin, end=a.end),
        state=state,
        recipe_hash=recipe if state == State.READY else "",
        error=error,
    )


class Tracker:
    """The reducer driven like the shell drives it: one state, events at fake times."""

    def __init__(self, state: TrackerState | None = None) -> None:
        self.state = state or restore(RULES, [], [], {}, {}, now_ms=0)
        self.state, _ = apply(self.state, ModelsChanged((MODEL,), frozenset()), 0)

    def __call__(self, event: Event, now_ms: int) -> list[Effect]:
        self.state, effects = apply(self.state, event, now_ms)
        return effects

    def beat(self, peer: str, now_ms: int, *serving: swarm_pb2.AssignmentStatus) -> list[Effect]:
        return self(Heartbeat(peer, tuple(serving)), now_ms)

    def routable(self, cleared=lambda key: True) -> list[tuple[str, int, int]]:
        return [(r.peer_id, r.begin, r.end) for r in ready_ranges(self.state, M, cleared=cleared)]


def of(effects: list[Effect], kind: type) -> list:
    return [e for e in effects if isinstance(e, kind)]


def two_ready_nodes() -> Tracker:
    """A and B registered at 0, READY on [0, 3) and [3, 6) at 100."""
    t = Tracker()
    t(Registered(facts("A"), ("/memory/A",)), 0)
    t(Registered(facts("B"), ("/memory/B",)), 0)
    assert set(t.state.assignments) == {FIRST, SECOND}
    t.beat("A", 100, status(FIRST, State.READY))
    t.beat("B", 100, status(SECOND, State.READY))
    return t


def test_a_registered_node_is_assigned_ranges_and_told_to_load_them() -> None:
    t = Tracker()
    effects = t(Registered(facts("A", blocks=6), ("/memory/A",)), 0)
    assert of(effects, StoreAssignments) == [StoreAssignments((Assignment(M, 0, 6, "A"),))]
    assert t.state.liveness.alive == {"A"} and t.state.recomputes == 1
    (directives,) = of(t.beat("A", 10), Directives)
    assert directives == Directives("A", load=(Assignment(M, 0, 6, "A"),), unload=())
    assert t.routable() == []  # nothing reported READY yet


def test_routes_name_a_nodes_addresses_at_the_host_it_was_heard_from_first() -> None:
    t = Tracker()
    listed = ("/ip4/10.0.0.9/tcp/4001/tls/p2p/A", "/memory/A", "/ip4/198.18.0.5/tcp/4001/tls/p2p/A")
    t(Registered(facts("A"), listed, seen_host="198.18.0.5"), 0)
    t(Registered(facts("B"), ("/memory/B",)), 0)
    t.beat("A", 100, status(FIRST, State.READY))
    t.beat("B", 100, status(SECOND, State.READY))
    assert t.state.seen_hosts == {"A": "198.18.0.5", "B": ""}
    (a, b) = ready_ranges(t.state, M, cleared=lambda key: True)
    assert a.addrs == ("/ip4/198.18.0.5/tcp/4001/tls/p2p/A", "/ip4/10.0.0.9/tcp/4001/tls/p2p/A", "/memory/A")
    assert b.addrs == ("/memory/B",)  # heard from nowhere known: as listed
    t(Heartbeat("A", (status(FIRST, State.READY),), seen_host="10.0.0.9"), 200)  # it moved
    assert ready_ranges(t.state, M, cleared=lambda key: True)[0].addrs[0] == "/ip4/10.0.0.9/tcp/4001/tls/p2p/A"
    t.beat("A", 300, status(FIRST, State.READY))  # a heartbeat from nowhere known keeps the host heard
    assert t.state.seen_hosts["A"] == "10.0.0.9"


def test_heartbeats_keep_a_node_alive() -> None:
    t = two_ready_nodes()
    for now_ms in range(1_000, 30_000, 1_000):  # a heartbeat a second, a sweep after each
        t.beat("A", now_ms, status(FIRST, State.READY))
        t.beat("B", now_ms, status(SECOND, State.READY))
        assert of(t(Sweep(), now_ms + 999), MarkDead) == []
    assert t.state.liveness.alive == {"A", "B"}
    assert t.routable() == [("A", 0, 3), ("B", 3, 6)]
    assert t.state.liveness.next_sweep_in_ms(29_500) == 29_000 + TIMEOUT_MS - 29_500


def test_missed_heartbeats_kill_a_node_at_its_deadline_and_withdraw_its_ranges_from_routes() -> None:
    t = two_ready_nodes()
    t.beat("A", 3_000, status(FIRST, State.READY))
    # B was last heard at 100: alive (and routed) until exactly 100 + timeout
    assert of(t(Sweep(), 100 + TIMEOUT_MS - 1), MarkDead) == []
    assert t.routable() == [("A", 0, 3), ("B", 3, 6)]
    effects = t(Sweep(), 100 + TIMEOUT_MS)
    assert of(effects, MarkDead) == [MarkDead(("B",), "nodes missed heartbeats")]
    assert t.state.liveness.alive == {"A"} and "B" not in t.state.liveness
    assert t.routable() == [("A", 0, 3)]  # B's range left the routes with it
    # the survivor keeps its range loaded (it cannot hold B's blocks too: they wait for a node)
    assert FIRST in t.state.assignments and t.state.assignments[FIRST].state == State.READY
    assert all(a.peer_id != "B" for a in t.state.assignments)
    assert of(effects, StoreAssignments) and of(effects, Notify)


def test_a_node_marked_dead_that_heartbeats_again_comes_back_and_is_routed_once_ready() -> None:
    t = two_ready_nodes()
    t.beat("A", 4_000, status(FIRST, State.READY))
    t(Sweep(), 100 + TIMEOUT_MS)
    assert "B" not in t.state.liveness
    # B never noticed (a network cut): it still reports its range READY
    effects = t.beat("B", 6_000, status(SECOND, State.READY))
    assert Log("info", "node B is back") in effects
    assert of(effects, StoreAssignments)  # its return recomputed the assignment
    assert of(effects, Directives) == [Directives("B", load=(), unload=())]
    # what it reported before it was assigned again is not recorded: routed from its next beat
    assert t.routable() == [("A", 0, 3)]
    t.beat("B", 7_000, status(SECOND, State.READY))
    assert t.routable() == [("A", 0, 3), ("B", 3, 6)]


def test_a_node_that_restarted_is_told_to_load_again_and_routed_only_when_ready() -> None:
    t = two_ready_nodes()
    effects = t.beat("B", 1_000)  # it restarted: reports nothing
    assert StoreStatus(SECOND, State.STATE_UNSPECIFIED, "", "") in effects  # its stored state goes
    assert of(effects, Directives) == [Directives("B", load=(SECOND,), unload=())]
    assert t.routable() == [("A", 0, 3)]
    t.beat("B", 2_000, status(SECOND, State.LOADING))
    assert t.routable() == [("A", 0, 3)]
    t.beat("B", 3_000, status(SECOND, State.READY))
    assert t.routable() == [("A", 0, 3), ("B", 3, 6)]


def test_routability_follows_loading_ready_and_failed() -> None:
    t = Tracker()
    t(Registered(facts("A"), ()), 0)
    t(Registered(facts("B"), ()), 0)
    t(Registered(facts("C"), ()), 0)
    a_range, b_range = sorted(a for a in t.state.assignments if a.peer_id in ("A", "B"))
    assert {a.peer_id for a in t.state.assignments} == {"A", "B"}  # C: spare capacity
    t.beat("A", 10, status(a_range, State.LOADING))
    t.beat("B", 10, status(b_range, State.LOADING))
    assert t.routable() == []
    t.beat("A", 20, status(a_range, State.READY))
    assert t.routable() == [("A", 0, 3)]  # the route planner finds no chain yet; the range is READY
    t.beat("B", 20, status(b_range, State.READY, recipe=""))
    assert t.routable() == [("A", 0, 3)]  # READY without a recipe: not routed
    t.beat("B", 30, status(b_range, State.READY))
    assert t.routable() == [("A", 0, 3), ("B", 3, 6)]
    assert t.routable(cleared=lambda key: key[0] != "B") == [("A", 0, 3)]  # the canary gate
    # B fails to load (e.g. a tensor does not match): not routed, not assigned there again
    effects = t.beat("B", 40, status(b_range, State.FAILED, error="bad tensor"))
    (failure,) = of(effects, LoadFailed)
    assert failure.peer_id == "B" and failure.status.error == "bad tensor"
    assert ("B", M) in t.state.failed and [s.error for s in t.state.load_failures["B"]] == ["bad tensor"]
    assert all(a.peer_id != "B" for a in t.state.assignments)  # its blocks went to C
    assert any(a.peer_id == "C" for a in t.state.assignments)
    assert of(effects, Directives) == [Directives("B", load=(), unload=(b_range,))]
    assert t.routable() == [("A", 0, 3)]
    # reported FAILED again: not a new failure
    assert of(t.beat("B", 50, status(b_range, State.FAILED, error="bad tensor")), LoadFailed) == []
    # registering anew forgives it
    t(Registered(facts("B"), ()), 60)
    assert ("B", M) not in t.state.failed and "B" not in t.state.load_failures


def test_a_range_that_failed_a_check_is_withdrawn_until_its_node_registers_anew() -> None:
    t = two_ready_nodes()
    effects = t(RangeWithdrawn("B", M), 200)
    assert ("B", M) in t.state.withdrawn and of(effects, StoreAssignments)
    assert all(a.peer_id != "B" for a in t.state.assignments)
    assert t.routable() == [("A", 0, 3)]
    assert of(t.beat("B", 300, status(SECOND, State.READY)), Directives) == [Directives("B", (), (SECOND,))]
    t(Registered(facts("B"), ()), 400)
    assert ("B", M) not in t.state.withdrawn and SECOND in t.state.assignments
    # refused after repeated failures: dead at once
    effects = t(NodeRefused("B", failures=2), 500)
    assert of(effects, MarkDead) == [MarkDead(("B",), "node failed 2 integrity checks")]
    assert "B" not in t.state.liveness
    assert of(t(NodeRefused("B", failures=3), 600), MarkDead) == []  # dead already


def test_a_suspect_reported_by_an_owner_is_probed_once_and_dead_only_when_it_does_not_answer() -> None:
    t = two_ready_nodes()
    assert t(PeerReported("B", "owner", "connection reset"), 200) == [ProbePeer("B")]
    assert t.state.suspects == {"B"}
    assert t(PeerReported("B", "owner-2", "silent"), 210) == []  # shares the probe under way
    assert t.routable() == [("A", 0, 3), ("B", 3, 6)]  # a report alone removes nobody
    assert t(ProbeEnded("B", answered=True), 250) == [] and t.state.suspects == frozenset()
    assert "B" in t.state.liveness
    t(PeerReported("B", "owner", "connection reset"), 300)
    assert t(ProbeEnded("B", answered=None), 320) == [] and "B" in t.state.liveness  # cancelled
    t(PeerReported("B", "owner", "connection reset"), 400)
    effects = t(ProbeEnded("B", answered=False, reporter="owner", reason="connection reset"), 450)
    assert of(effects, MarkDead) == [
        MarkDead(("B",), "owner lost it (connection reset) and it does not answer a probe")
    ]
    assert "B" not in t.state.liveness and t.routable() == [("A", 0, 3)] and t.state.suspects == frozenset()
    # once dead: answered at once, without a probe
    assert t(PeerReported("B", "owner", "again"), 500) == [ReportAnswered("B", True, "not a live node")]
    assert t(PeerReported("Z", "owner", "who?"), 500) == [ReportAnswered("Z", False, "not a live node")]
    assert of(t(PeerReported("", "owner", ""), 500), Refuse)


def test_a_bad_report_is_refused_and_changes_nothing() -> None:
    t = two_ready_nodes()
    before = t.state
    effects = t.beat("B", 200, status(Assignment(M, 3, 3, "B"), State.READY))
    assert [type(e) for e in effects] == [Refuse] and t.state is before


def test_apply_never_changes_the_state_it_is_given() -> None:
    t = two_ready_nodes()
    before = t.state
    snapshot = (dict(before.assignments), before.liveness, before.withdrawn, dict(before.heard_at_ms))
    after, _ = apply(before, Sweep(), 100 + TIMEOUT_MS)
    after, _ = apply(after, RangeWithdrawn("A", M), 100 + TIMEOUT_MS)
    assert (dict(before.assignments), before.liveness, before.withdrawn, dict(before.heard_at_ms)) == snapshot
    assert after.liveness.alive == set() and before.liveness.alive == {"A", "B"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.recomputes = 0  # type: ignore[misc]


def test_after_a_restart_nodes_are_pending_kept_assigned_and_not_routed_until_heard() -> None:
    stored = {FIRST: RangeStatus(State.READY, "r1"), SECOND: RangeStatus(State.READY, "r1")}
    t = Tracker(restore(RULES, [facts("A"), facts("B")], ["A", "B"], {}, stored, now_ms=50_000))
    t(Recompute(), 50_000)
    assert t.state.liveness.pending == {"A", "B"} and set(t.state.assignments) == {FIRST, SECOND}
    assert t.routable() == []
    effects = t.beat("A", 50_100, status(FIRST, State.READY))
    assert of(effects, StoreAssignments) == []  # not a revival: its ranges were kept
    assert t.routable() == [("A", 0, 3)]
    assert of(t(Sweep(), 50_000 + TIMEOUT_MS), MarkDead) == [MarkDead(("B",), "nodes missed heartbeats")]


def test_nonces_are_pruned_once_per_registration_age() -> None:
    t = Tracker()  # restored at 0: the first sweep prunes
    assert of(t(Sweep(), 0), PruneNonces) == [PruneNonces(0 - RULES.nonce_retention_ms)]
    assert of(t(Sweep(), RULES.registration_max_age_ms - 1), PruneNonces) == []
    assert of(t(Sweep(), RULES.registration_max_age_ms), PruneNonces) != []


def test_a_heartbeats_error_text_is_kept_printable_and_a_report_too_big_or_garbled_is_refused() -> None:
    from agent.core.tracker.heartbeat import MAX_REPORTED_RANGES, read_report

    failed = swarm_pb2.AssignmentStatus(
        assignment=swarm_pb2.Assignment(model_sha256="ab" * 32, begin=0, end=10),
        state=swarm_pb2.AssignmentStatus.FAILED,
        error="out of memory\x1b[2J\nINFO tracker: node ok",
    )
    report = read_report("peer", [failed], [])
    (kept,) = report.serving
    assert kept.error == "out of memory\\x1b[2J\\nINFO tracker: node ok"
    assert next(iter(report.reported.values())).error == kept.error and failed.error.startswith("out")
    too_many = [failed] * (MAX_REPORTED_RANGES + 1)
    with pytest.raises(WireError, match="over 256"):
        read_report("peer", too_many, [])
    garbled = swarm_pb2.AssignmentStatus()
    garbled.CopyFrom(failed)
    garbled.recipe_hash = "\x1b[31m"
    with pytest.raises(WireError, match="is not a printable token"):
        read_report("peer", [garbled], [])


# --- hostile nodes: loading deadlines, proven nodes, ranges given back -----------------------------

FAKE_FACTS = NodeFacts("F", 5 * BPB, 0.001, frozenset({M}), fetches_models=False)  # claims 5 of 6 blocks


def test_the_loading_deadline_is_a_base_plus_the_ranges_bytes_at_the_slowest_rate() -> None:
    assert loading_deadline_ms(RULES, FIRST, BPB) == 120_000 + 3 * 1000  # 3 MB at 1 MB/s
    assert loading_deadline_ms(dataclasses.replace(RULES, loading_base_ms=0), FIRST, BPB) == 0  # off


def test_a_range_not_ready_by_its_deadline_is_taken_back_and_its_node_not_given_the_model_again() -> None:
    t = two_ready_nodes()
    t(Registered(FAKE_FACTS, ()), 200)  # a node that claims memory and will never load
    deadline = loading_deadline_ms(RULES, SECOND, BPB)
    t.beat("A", 1_000, status(FIRST, State.READY))
    t(Sweep(), 100 + TIMEOUT_MS)  # B died: its gap goes to the only node with room, F
    assert Assignment(M, 3, 6, "F") in t.state.assignments
    taken = Assignment(M, 3, 6, "F")
    for now in range(1_000, deadline + 100 + TIMEOUT_MS + 2_000, 1_000):  # F says LOADING for ever
        t.beat("A", now, status(FIRST, State.READY))
        t.beat("F", now, status(taken, State.LOADING))
        effects = t(Sweep(), now)
        if taken not in t.state.assignments:
            break
    assert taken not in t.state.assignments, "F held the range past its loading deadline"
    assert now - (100 + TIMEOUT_MS) <= deadline + 1_000, "taken back at the deadline, not later"
    (failed,) = of(effects, LoadFailed)
    assert failed.peer_id == "F" and "not READY within 123 s" in failed.status.error
    assert ("F", M) in t.state.failed and all(a.peer_id != "F" for a in t.state.assignments)
    t(Registered(facts("C"), ()), now + 1)  # an honest node joins: it gets the gap
    assert Assignment(M, 3, 6, "C") in t.state.assignments


def test_a_node_back_from_the_dead_gets_its_range_back_from_a_node_still_loading_it() -> None:
    t = two_ready_nodes()
    t(Registered(FAKE_FACTS, ()), 200)
    t.beat("A", 1_000, status(FIRST, State.READY))
    t(Sweep(), 100 + TIMEOUT_MS)  # B missed heartbeats for a moment: F is given its blocks
    taken = Assignment(M, 3, 6, "F")
    assert taken in t.state.assignments
    t.beat("F", 5_500, status(taken, State.LOADING))
    effects = t.beat("B", 6_000, status(SECOND, State.READY))  # B is back, still serving
    assert SECOND in t.state.assignments and taken not in t.state.assignments
    (directives,) = of(effects, Directives)
    assert directives.load == () and directives.unload == ()  # B keeps what it has loaded
    (told,) = of(t.beat("F", 6_500, status(taken, State.LOADING)), Directives)
    assert told.unload == (taken,)
    t.beat("B", 7_000, status(SECOND, State.READY))
    assert t.routable() == [("A", 0, 3), ("B", 3, 6)]


def test_a_ready_replacement_keeps_its_range_when_the_old_node_comes_back() -> None:
    t = two_ready_nodes()
    t(Registered(FAKE_FACTS, ()), 200)
    t(Sweep(), 100 + TIMEOUT_MS)  # A and B both missed heartbeats; F takes over everything it can
    assert {a.peer_id for a in t.state.assignments} <= {"F"}
    t(Registered(facts("C", blocks=6), ()), 5_200)
    ready = sorted(t.state.assignments)
    for a in ready:
        t.beat(a.peer_id, 5_300, status(a, State.READY))
    t.beat("B", 6_000, status(SECOND, State.READY))
    assert set(ready) <= set(t.state.assignments), "READY replacements are kept"


def test_gaps_go_to_proven_nodes_before_nodes_that_only_claim_memory() -> None:
    a = NodeCapacity("A", 3 * BPB, 0.001, frozenset({M}))
    p = NodeCapacity("P", 3 * BPB, 0.001, frozenset({M}))  # proven, less room than F
    f = NodeCapacity("F", 5 * BPB, 0.001, frozenset({M}), proven=False)
    assert assign([MODEL], [a, p, f], [FIRST]) == (FIRST, Assignment(M, 3, 6, "P"))
    unproven_p = dataclasses.replace(p, proven=False)  # all unproven: the most room first, as before
    assert assign([MODEL], [a, unproven_p, f], [FIRST]) == (FIRST, Assignment(M, 3, 6, "F"))


def test_a_ready_report_proves_a_node() -> None:
    t = two_ready_nodes()
    assert t.state.proven == {"A", "B"}


def test_a_passed_check_proves_a_node_where_checks_gate_routes() -> None:
    t = Tracker(restore(dataclasses.replace(RULES, proven_needs_check=True), [], [], {}, {}, now_ms=0))
    t(Registered(facts("A", blocks=6), ()), 0)
    whole = Assignment(M, 0, 6, "A")
    t.beat("A", 100, status(whole, State.READY))
    assert "A" not in t.state.proven, "READY alone does not prove it while checks gate routes"
    t(NodeProven("A"), 200)
    assert "A" in t.state.proven
    t(RangeWithdrawn("A", M), 300)
    assert "A" not in t.state.proven


def test_prefix_tags_of_a_heartbeat_reach_the_routable_ranges_until_the_node_registers_anew() -> None:
    t = two_ready_nodes()

    def prefixes(a: Assignment, *tags: int) -> swarm_pb2.RangePrefixes:
        return swarm_pb2.RangePrefixes(
            assignment=swarm_pb2.Assignment(model_sha256=a.model_sha256, begin=a.begin, end=a.end), tags=tags
        )

    def held() -> dict[str, frozenset[int]]:
        return {r.peer_id: r.prefix_tags for r in ready_ranges(t.state, M, cleared=lambda key: True)}

    t(Heartbeat("A", (status(FIRST, State.READY),), prefixes=(prefixes(FIRST, 7, 8),)), 200)
    assert held() == {"A": frozenset({7, 8}), "B": frozenset()}
    t(Heartbeat("A", (status(FIRST, State.READY),), prefixes=(prefixes(FIRST, 9),)), 300)  # the latest report only
    assert held()["A"] == frozenset({9})
    # a report over the bound refuses the heartbeat, naming the entry; the last report stays
    refused = t(Heartbeat("A", (status(FIRST, State.READY),), prefixes=(prefixes(FIRST, *range(5000)),)), 400)
    assert "prefixes[0] has 5000 tags" in of(refused, Refuse)[0].message
    assert held()["A"] == frozenset({9})
    t(Registered(facts("A"), ("/memory/A",)), 500)  # restarted: its caches are empty
    assert "A" not in t.state.prefix_tags
