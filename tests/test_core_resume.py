"""Resuming a session around a lost hop, in the pure core: what a hop keeps (agent.core.node.kept_rows),
how a surviving range goes back to the answered positions and how a replacement opens from
rebuild steps (agent.core.node.sessions), which part of a route is replaced (resume_plan), the
owner's session going on (Session.resume), route parts (plan_route begin/end), and the
rebuild step records (agent.core.wire.step_requests, agent.core.wire.step_results)."""

from __future__ import annotations

import numpy as np
import pytest

from agent._proto import swarm_pb2
from agent.core.node.kept_rows import KeptStore, ReplayChunk, RowsNotKept
from agent.core.node.sessions import SessionTable
from agent.core.owner.route_repair import resume_plan
from agent.core.owner.session import Session
from agent.core.tracker.routing import NoRoute, ReadyRange, plan_route
from agent.core.wire.boundary import WireDType
from agent.core.wire.step_requests import first_step_request, next_hop_request, replay_step_request
from agent.core.wire.step_results import step_result_rebuilt
from agent.core.wire.step_validation import RangeSpec, validate_step
from agent.core.wire.swarm_wire import WireError, crc32

pytestmark = pytest.mark.unit

SID = bytes(range(16))
ROW = 8  # bytes per kept row in these tests
N_EMBD = 2  # two f32 values: 8 bytes a row
ADMISSION = swarm_pb2.SignedAdmission(record=b"record", signature=b"sig")
F32 = int(WireDType.F32)


def rows(first: int, n: int) -> bytes:
    """Row p is 8 bytes holding p (so any chunk says which positions it carries)."""
    return b"".join(int(p).to_bytes(ROW, "little") for p in range(first, first + n))


def positions_of(chunk: ReplayChunk) -> list[int]:
    return [int.from_bytes(chunk.data[i : i + ROW], "little") for i in range(0, len(chunk.data), ROW)]


def store_with(steps: list[int], budget: int = 1 << 20) -> KeptStore:
    store = KeptStore(budget)
    at = 0
    for n in steps:
        store.keep(SID, at, n, rows(at, n), dtype=F32, schema_version=1, streams=1)
        at += n
    return store


# --- kept rows -------------------------------------------------------------------------------


def test_a_replay_keeps_prefill_steps_whole_and_joins_decode_rows() -> None:
    store = store_with([40, 40, 20] + [1] * 37)  # a prompt in chunks of 40, then 37 decoded rows
    chunks = store.replay(SID, 137, max_rows=512, merge_rows=16)
    assert [(c.first_position, c.n_rows) for c in chunks] == [
        (0, 40), (40, 40), (80, 20), (100, 16), (116, 16), (132, 5),
    ]  # fmt: skip
    for c in chunks:
        assert positions_of(c) == list(range(c.first_position, c.first_position + c.n_rows))
    # a step of merge_rows or fewer rows (a small prompt) is one of the small ones
    assert [(c.first_position, c.n_rows) for c in store_with([3, 1, 1]).replay(SID, 5, 512, 16)] == [(0, 5)]


def test_a_replay_stops_at_the_asked_position_and_cuts_to_the_receivers_batch() -> None:
    store = store_with([40] + [1] * 10)
    assert [(c.first_position, c.n_rows) for c in store.replay(SID, 44, 512, 16)] == [(0, 40), (40, 4)]
    assert [(c.first_position, c.n_rows) for c in store.replay(SID, 30, 512, 16)] == [(0, 30)]
    assert [(c.first_position, c.n_rows) for c in store.replay(SID, 50, 16, 16)] == [
        (0, 16), (16, 16), (32, 8), (40, 10),
    ]  # fmt: skip


def test_rows_not_kept_are_said_so() -> None:
    store = store_with([4, 1])
    with pytest.raises(RowsNotKept, match="rows up to position 5 are kept, 6 asked"):
        store.replay(SID, 6, 512)
    with pytest.raises(RowsNotKept, match="no rows are kept"):
        store.replay(bytes(16), 1, 512)
    with pytest.raises(ValueError, match="must be >= 1"):
        store.replay(SID, 0, 512)


def test_over_the_budget_a_session_keeps_nothing_and_says_why() -> None:
    store = store_with([4, 1], budget=5 * ROW)
    assert store.n_bytes == 5 * ROW
    store.keep(SID, 5, 1, rows(5, 1), dtype=F32, schema_version=1, streams=1)
    assert store.n_bytes == 0
    with pytest.raises(RowsNotKept, match="over the budget of 40 bytes per session"):
        store.replay(SID, 1, 512)
    # and stays lost: later rows are not kept either
    store.keep(SID, 6, 1, rows(6, 1), dtype=F32, schema_version=1, streams=1)
    with pytest.raises(RowsNotKept, match="no longer kept"):
        store.replay(SID, 1, 512)


def test_a_gap_or_a_changed_dtype_loses_the_rows() -> None:
    store = store_with([4])
    store.keep(SID, 6, 1, rows(6, 1), dtype=F32, schema_version=1, streams=1)
    with pytest.raises(RowsNotKept, match="do not follow the kept ones"):
        store.replay(SID, 4, 512)
    store = store_with([4])
    store.keep(SID, 4, 1, rows(4, 1)[:4], dtype=int(WireDType.F16), schema_version=1, streams=1)
    with pytest.raises(RowsNotKept, match="dtype or schema changed"):
        store.replay(SID, 4, 512)


def test_trim_drops_the_rows_of_the_failed_step_and_forget_drops_all() -> None:
    store = store_with([40, 1, 1])
    store.trim(SID, 41)
    assert store.n_bytes == 41 * ROW
    store.trim(SID, 30)  # within a step: its rows are cut
    (chunk,) = store.replay(SID, 30, 512)
    assert positions_of(chunk) == list(range(30))
    # the session goes on from there
    store.keep(SID, 30, 1, rows(30, 1), dtype=F32, schema_version=1, streams=1)
    assert [c.n_rows for c in store.replay(SID, 31, 512)] == [30, 1]
    store.forget(SID)
    assert SID not in store and store.n_bytes == 0


# --- the node's sessions -----------------------------------------------------------------------


def test_a_surviving_session_goes_back_to_the_answered_positions() -> None:
    table = SessionTable(2, 64)
    table.accept(SID, 0, 0, 10, "owner", 0)
    table.done(SID, 1)
    table.accept(SID, 1, 10, 1, "owner", 2)  # the step that failed further down the route
    with pytest.raises(WireError, match="has a step in a Forward") as caught:
        table.resume(SID, 10, 2, "owner", 3)
    assert caught.value.code == swarm_pb2.Error.UNAVAILABLE
    table.done(SID, 3)
    with pytest.raises(WireError, match="belongs to owner"):
        table.resume(SID, 10, 2, "intruder", 4)
    with pytest.raises(WireError, match="holds 11 positions, 12 asked"):
        table.resume(SID, 12, 2, "owner", 4)
    with pytest.raises(WireError, match="resume at step 1, but step 1 was taken"):
        table.resume(SID, 10, 1, "owner", 4)
    session, trim = table.resume(SID, 10, 2, "owner", 4)
    assert trim and (session.next_position, session.next_step) == (10, 2)
    assert (table.started, table.resumed, table.rebuilt) == (1, 1, 0)
    # the failed step is sent again under the next number, at the same position
    table.accept(SID, 2, 10, 1, "owner", 5)
    # a hop that never saw the failed step has nothing to trim
    other = SessionTable(1, 64)
    other.accept(SID, 0, 0, 10, "owner", 0)
    other.done(SID, 1)
    assert other.resume(SID, 10, 2, "owner", 2)[1] is False
    with pytest.raises(WireError, match="unknown session"):
        other.resume(bytes(16), 1, 2, "owner", 2)


def test_a_replacement_opens_from_rebuild_steps_and_continues_at_the_resume_step() -> None:
    table = SessionTable(1, 64)
    first = table.accept_rebuild(SID, 7, 0, 16, "owner", 0)
    assert first.rebuilding and (first.next_position, first.next_step) == (16, 7)
    with pytest.raises(WireError, match="rebuild rows start at position 20, expected 16"):
        table.accept_rebuild(SID, 7, 20, 4, "owner", 1)
    with pytest.raises(WireError, match="belongs to owner"):
        table.accept_rebuild(SID, 7, 16, 4, "intruder", 1)
    table.accept_rebuild(SID, 7, 16, 4, "owner", 1)
    with pytest.raises(WireError, match="already exists"):
        table.accept_rebuild(SID, 7, 0, 4, "owner", 1)
    # the owner's step 7 continues it; after that no more rebuild rows are taken
    table.accept(SID, 7, 20, 1, "owner", 2)
    with pytest.raises(WireError, match="not being rebuilt"):
        table.accept_rebuild(SID, 7, 21, 1, "owner", 3)
    assert (table.started, table.rebuilt) == (0, 1)
    # a rebuild needs a sequence like a step 0, and resumes at step >= 1
    with pytest.raises(WireError, match="all 1 sequences"):
        table.accept_rebuild(bytes(16), 3, 0, 4, "owner", 3)
    with pytest.raises(WireError, match="resumes at step >= 1"):
        table.accept_rebuild(bytes(16), 0, 0, 4, "owner", 3)


# --- the owner ---------------------------------------------------------------------------------


def hop(peer: str, begin: int, end: int) -> swarm_pb2.Hop:
    return swarm_pb2.Hop(peer_id=peer, addrs=[f"/memory/{peer}"], begin=begin, end=end)


ROUTE = swarm_pb2.Route(
    model_sha256="ab" * 32, n_layer=30, recipe_hash="r1", hops=[hop("A", 0, 10), hop("B", 10, 20), hop("C", 20, 30)]
)


def test_a_resume_plan_replaces_the_lost_hops_and_keeps_the_others() -> None:
    plan = resume_plan(ROUTE, "B", 12)
    assert plan is not None
    assert (plan.first_lost, plan.last_lost, plan.begin, plan.end, plan.keep_positions) == (1, 1, 10, 20, 12)
    assert [h.peer_id for h in plan.survivors] == ["A", "C"] and plan.feeder.peer_id == "A"
    new = plan.route_with(ROUTE, [hop("D", 10, 15), hop("E", 15, 20)])
    assert [(h.peer_id, h.begin, h.end) for h in new.hops] == [
        ("A", 0, 10), ("D", 10, 15), ("E", 15, 20), ("C", 20, 30),
    ]  # fmt: skip
    assert new.recipe_hash == "r1" and [h.peer_id for h in ROUTE.hops] == ["A", "B", "C"]  # unchanged
    with pytest.raises(ValueError, match="covers blocks \\[10, 15\\), not \\[10, 20\\)"):
        plan.route_with(ROUTE, [hop("D", 10, 15)])
    with pytest.raises(ValueError, match="does not continue at block 10"):
        plan.route_with(ROUTE, [hop("D", 0, 20)])
    # the first hop: rebuilt from the owner's tokens
    assert resume_plan(ROUTE, "A", 5).feeder is None
    # nothing answered yet, an unknown peer, a peer on two separate parts, nobody left: re-prefill
    assert resume_plan(ROUTE, "B", 0) is None
    assert resume_plan(ROUTE, "Z", 5) is None
    split = swarm_pb2.Route(n_layer=30, hops=[hop("A", 0, 10), hop("B", 10, 20), hop("A", 20, 30)])
    assert resume_plan(split, "A", 5) is None
    assert resume_plan(swarm_pb2.Route(n_layer=30, hops=[hop("A", 0, 30)]), "A", 5) is None


def test_a_failed_session_resumes_its_failed_step_under_the_next_number() -> None:
    session = Session(SID, [1, 2, 3, 4, 5], max_new_tokens=4, route_peer_ids=["A", "B", "C"], max_step_rows=2)
    first = session.next_step()
    assert first.positions == (0, 1)
    with pytest.raises(ValueError, match="only a failed session is resumed"):
        session.resume(["A", "D", "C"])
    session.fail("B is gone")
    assert session.failed and session.cached_positions == 0
    assert session.resume(["A", "D", "C"]) == 1
    again = session.next_step()
    assert (again.step, again.positions) == (1, (0, 1)) and session.route_peer_ids == ("A", "D", "C")
    assert session.failure is None


def test_a_first_hop_is_rebuilt_in_the_shapes_its_steps_had() -> None:
    session = Session(SID, list(range(10)), max_new_tokens=40, max_step_rows=4)
    # the prompt went in chunks of 4; decoded positions from 10 on went one by one
    assert session.rebuild_chunks(37, merge_rows=16) == [(0, 4), (4, 4), (8, 2), (10, 16), (26, 11)]
    assert session.rebuild_chunks(6) == [(0, 4), (4, 2)]


def ready(peer: str, begin: int, end: int, recipe: str = "r1") -> ReadyRange:
    return ReadyRange(peer, (f"/memory/{peer}",), begin, end, recipe, 0.001)


def test_a_route_part_covers_only_the_blocks_asked_for_in_the_recipe_asked_for() -> None:
    ranges = [ready("A", 0, 10), ready("B", 10, 20), ready("B2", 10, 20, "r2"), ready("D", 10, 15), ready("E", 15, 20)]
    ranges.append(ready("C", 20, 30))
    part = plan_route("m", "sha", 30, ranges, begin=10, end=20, avoid=["B"], recipe_hash="r1")
    assert [(h.peer_id, h.begin, h.end) for h in part.hops] == [("D", 10, 15), ("E", 15, 20)]
    assert (
        plan_route("m", "sha", 30, ranges, begin=10, end=20, avoid=["B", "D"], recipe_hash="r2").hops[0].peer_id == "B2"
    )
    with pytest.raises(NoRoute, match=r"blocks \[10, 15\) have no ready node \(of recipe r1\) \(without B, D\)"):
        plan_route("m", "sha", 30, ranges, begin=10, end=20, avoid=["B", "D"], recipe_hash="r1")
    with pytest.raises(NoRoute, match=r"blocks \[20, 40\) are not a part"):
        plan_route("m", "sha", 30, ranges, begin=20, end=40)
    whole = plan_route("m", "sha", 30, ranges)  # the whole model, as before
    assert (whole.hops[0].begin, whole.hops[-1].end) == (0, 30)


# --- rebuild records ---------------------------------------------------------------------------


def spec(begin: int, end: int) -> RangeSpec:
    return RangeSpec(
        model_sha256="ab" * 32, begin=begin, end=end, n_layer=30, n_embd=N_EMBD, n_vocab=100, recipe_hash="r1",
        n_batch_max=64,
    )  # fmt: skip


def test_rebuild_steps_may_stop_before_the_last_block_and_carry_their_resume_step() -> None:
    chunk = ReplayChunk(0, 3, np.arange(6, dtype="<f4").tobytes(), F32, 1, 1)
    request = replay_step_request(
        session_id=SID, resume_step=5, hops=[hop("D", 10, 15), hop("E", 15, 20)], chunk=chunk, n_embd=N_EMBD,
        recipe_hash="r1", model_sha256="ab" * 32, owner_peer_id="owner", owner_addrs=["/memory/owner"],
        sender_admission=ADMISSION,
    )  # fmt: skip
    assert (request.step, request.resume_step, request.checksum) == (5, 5, crc32(chunk.data))
    step = validate_step(request, spec(10, 15))
    assert step.rebuild and step.end_position == 3 and [h.peer_id for h in step.rest] == ["E"]
    onward = next_hop_request(step, np.ones((3, N_EMBD), np.float32), ADMISSION)
    assert onward.resume_step == 5 and not onward.rest
    assert validate_step(onward, spec(15, 20)).rebuild
    # an ordinary step must still reach the last block
    ordinary = first_step_request(
        session_id=SID, step=1, hops=[hop("A", 0, 10), hop("B", 10, 20)], token_ids=[1], first_position=3,
        recipe_hash="r1", model_sha256="ab" * 32, owner_peer_id="owner", owner_addrs=[], sender_admission=ADMISSION,
    )  # fmt: skip
    with pytest.raises(WireError, match="rest ends at block 20, but the model has 30 blocks"):
        validate_step(ordinary, spec(0, 10))
    ordinary.resume_step = 2  # numbered other than its resume step
    with pytest.raises(WireError, match="a rebuild step is numbered resume_step \\(2\\), got step 1"):
        validate_step(ordinary, spec(0, 10))
    done = step_result_rebuilt(SID, 5, 3, ADMISSION)
    assert (done.step, done.rebuilt_positions, done.logits) == (5, 3, b"")
