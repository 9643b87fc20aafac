"""A node's per-range step queue (``agent.core.node.scheduler``) and its session table
(``agent.core.node.sessions``): pure, so every rule is checked on plain values."""

from __future__ import annotations

import heapq

import pytest

from agent._proto import swarm_pb2
from agent.core.node.scheduler import (
    LOCK_STEP_GATHER_MS,
    StepScheduler,
    arrival_wakes_gatherer,
    batch_window_wait_ms,
    decode_group_cap,
    decode_mode,
    first_hop_decode,
    gather_arrivals_needed,
    gather_wait_ms,
)
from agent.core.node.sessions import SessionTable, trusted_reserve
from agent.core.wire.address_rate import counted_host
from agent.core.wire.swarm_wire import WireError

pytestmark = pytest.mark.unit

Code = swarm_pb2.Error.Code


def queue(n_batch_max: int = 8, max_entries: int = 4, *steps: tuple[str, int, int]) -> StepScheduler:
    """``steps``: (item name, session key, rows)."""
    scheduler: StepScheduler[str] = StepScheduler(n_batch_max, max_entries)
    for name, session, rows in steps:
        scheduler.push(name, session=session, n_rows=rows)
    return scheduler


# --- scheduler -----------------------------------------------------------------------------


def test_steps_of_different_sessions_are_merged_in_sequence_order() -> None:
    scheduler = queue(8, 4, ("s2", 2, 1), ("s0", 0, 1), ("s1", 1, 1))
    assert len(scheduler) == 3 and scheduler.pending_rows == 3
    assert scheduler.next_batch() == ["s0", "s1", "s2"], "one batch, laid out by key, not arrival"
    assert scheduler.next_batch() == [] and len(scheduler) == 0 and scheduler.pending_rows == 0


def test_a_sessions_next_step_is_never_merged_with_its_previous_one() -> None:
    scheduler = queue(8, 4, ("a0", 0, 1), ("a1", 0, 1), ("b0", 1, 1), ("a2", 0, 1))
    assert scheduler.next_batch() == ["a0", "b0"]
    assert scheduler.next_batch() == ["a1"]
    assert scheduler.next_batch() == ["a2"]


def test_row_limit_and_entry_limit() -> None:
    scheduler = queue(8, 4, ("big", 0, 6), ("six", 1, 6), ("three", 2, 3), ("three2", 3, 3), ("tiny", 4, 1))
    # The oldest chunk goes, with the chunks of its row count that fit; then the decode step
    assert scheduler.next_batch() == ["big"]
    assert scheduler.next_batch() == ["tiny"]
    assert scheduler.next_batch() == ["six"]
    assert scheduler.next_batch() == ["three", "three2"]
    scheduler = queue(100, 2, ("a", 0, 1), ("b", 1, 1), ("c", 2, 1))
    assert scheduler.next_batch() == ["a", "b"] and scheduler.next_batch() == ["c"]


def test_fifo_the_oldest_step_is_always_in_the_next_batch() -> None:
    scheduler = queue(4, 4, ("first", 0, 4))
    for i in range(1, 4):
        scheduler.push(f"small{i}", session=i, n_rows=1)
    assert scheduler.next_batch() == ["first"]
    scheduler.push("late", session=9, n_rows=4)
    assert scheduler.next_batch() == ["small1", "small2", "small3"]
    assert scheduler.next_batch() == ["late"]


def test_a_held_back_step_keeps_its_sessions_later_steps_behind_it() -> None:
    scheduler = queue(4, 4, ("x", 0, 3), ("a0", 1, 2), ("a1", 1, 1))
    # a0 does not fit next to x; a1 would, but must not overtake a0.
    assert scheduler.next_batch() == ["x"]
    assert scheduler.next_batch() == ["a0"]
    assert scheduler.next_batch() == ["a1"]


def test_drop_session_and_drain() -> None:
    scheduler = queue(8, 4, ("a0", 0, 2), ("b0", 1, 3), ("a1", 0, 1))
    assert scheduler.drop_session(0) == ["a0", "a1"] and scheduler.pending_rows == 3
    assert scheduler.drop_session(7) == []
    assert scheduler.drain() == ["b0"] and len(scheduler) == 0 and scheduler.pending_rows == 0


def test_a_step_that_can_never_run_is_refused() -> None:
    scheduler = queue(4, 2)
    for rows in (0, 5):
        with pytest.raises(ValueError, match=f"a step of {rows} rows can never run"):
            scheduler.push("x", session=0, n_rows=rows)
    with pytest.raises(ValueError):
        StepScheduler(0, 1)


# --- decode groups ---------------------------------------------------------------------------


def test_the_decode_group_cap_is_sessions_over_hops_plus_one_unless_told() -> None:
    # auto: S + 1 groups on a route of S > 1 hops
    assert [decode_group_cap(n, 3, None) for n in (1, 2, 4, 7, 8, 9)] == [1, 1, 1, 2, 2, 3]
    assert decode_group_cap(8, 2, None) == 3
    assert decode_group_cap(8, 1, None) is None, "one hop: no pipeline to fill"
    assert decode_group_cap(0, 3, None) == 1, "never below one step"
    # off, or a number of groups given
    assert decode_group_cap(8, 3, 0) is None
    assert [decode_group_cap(n, 3, 2) for n in (1, 5, 8)] == [1, 3, 4]
    assert decode_group_cap(8, 1, 4) == 2, "groups given: applied on one hop too"
    assert decode_group_cap(8, 3, 1) == 8
    with pytest.raises(ValueError, match="groups must be >= 0"):
        decode_group_cap(8, 3, -1)


def test_a_capped_decode_forward_takes_the_oldest_steps_laid_out_by_key() -> None:
    scheduler = queue(64, 8, *((f"d{s}", s, 1) for s in (5, 2, 7, 0, 3, 6, 1, 4)))
    assert scheduler.decode_waiting() == ("d5", 8) and len(scheduler) == 8, "peeking pops nothing"
    assert scheduler.next_batch(max_decode_entries=3) == ["d2", "d5", "d7"]  # the first three to arrive
    assert scheduler.next_batch(max_decode_entries=3) == ["d0", "d3", "d6"]
    assert scheduler.next_batch(max_decode_entries=3) == ["d1", "d4"]
    assert scheduler.next_batch(max_decode_entries=3) == [] and scheduler.decode_waiting() == (None, 0)
    # the worker's sequence count still bounds an uncapped or larger cap
    scheduler = queue(64, 2, ("a", 0, 1), ("b", 1, 1), ("c", 2, 1))
    assert scheduler.next_batch(max_decode_entries=5) == ["a", "b"]
    with pytest.raises(ValueError, match="max_decode_entries must be >= 1"):
        scheduler.next_batch(max_decode_entries=0)


def test_the_decode_cap_leaves_prefill_forwards_alone() -> None:
    scheduler: StepScheduler[str] = StepScheduler(64, 8)
    for s in (0, 1, 2):
        scheduler.push(f"p{s}", session=s, n_rows=16)
    for s in (3, 4, 5):
        scheduler.push(f"d{s}", session=s, n_rows=1)
    assert scheduler.decode_waiting() == (None, 0), "the chunks go first: no decode Forward next"
    assert scheduler.next_batch(max_decode_entries=1) == ["p0", "p1", "p2"]  # every chunk of its length
    assert scheduler.decode_waiting() == ("d3", 3)
    assert scheduler.next_batch(max_decode_entries=1) == ["d3"]
    scheduler.push("p0'", session=0, n_rows=16)
    assert scheduler.next_batch(max_decode_entries=1) == ["p0'"]  # still every other Forward
    assert scheduler.next_batch(max_decode_entries=1) == ["d4"]


def _decode_through_a_route(groups: int | None, sessions: int = 8, hops: int = 3, tokens: int = 12):
    """``sessions`` decode ``tokens`` tokens each through ``hops`` schedulers with a core each,
    the first capped by ``decode_group_cap``. A Forward costs 1 + rows time units (nearly linear
    in rows on CPU), sampling at the owner 1. Returns the time the last token took and each
    hop's Forwards (as sets of sessions)."""
    queues: list[StepScheduler[int]] = [StepScheduler(64, sessions) for _ in range(hops)]
    free_at = [0.0] * hops
    forwards: list[list[frozenset[int]]] = [[] for _ in range(hops)]
    events = [(0.0, s, 0, s) for s in range(sessions)]  # (time, tie-break, hop or hops: sampled, session)
    order = sessions
    made = dict.fromkeys(range(sessions), 0)
    done_at = 0.0
    while events:
        now = events[0][0]
        while events and events[0][0] == now:  # steps that arrive together are queued together
            _, _, hop, session = heapq.heappop(events)
            if hop == hops:
                made[session] += 1
                if made[session] == tokens:
                    done_at = max(done_at, now)
                    continue
                hop = 0
            if hop >= 0:
                queues[hop].push(session, session=session, n_rows=1)
        for h, hop_queue in enumerate(queues):
            if free_at[h] > now or not len(hop_queue):
                continue
            cap = decode_group_cap(sessions, hops, groups) if h == 0 else None
            batch = hop_queue.next_batch(max_decode_entries=cap)
            forwards[h].append(frozenset(batch))
            free_at[h] = now + 1 + len(batch)
            for s in [*batch, None]:  # None: this hop looks at its queue again once it is free
                order += 1
                if s is None:
                    heapq.heappush(events, (free_at[h], order, -1, -1))
                else:
                    heapq.heappush(events, (free_at[h] + (h == hops - 1), order, h + 1, s))
    assert all(n == tokens for n in made.values())
    return done_at, forwards


def test_decode_groups_keep_every_hop_of_a_route_busy() -> None:
    """Sessions that start together would travel as one convoy (each hop idle while the others
    compute); capped at the first hop, S + 1 groups are at different hops at once, and keep
    their shape downstream, where nothing caps."""
    convoy_s, convoy = _decode_through_a_route(groups=0)
    assert {len(f) for hop in convoy for f in hop} == {8}
    grouped_s, grouped = _decode_through_a_route(groups=None)
    assert {len(f) for hop in grouped for f in hop} == {2}, "ceil(8 / (3 + 1)) steps per Forward"
    first_hop_groups = set(grouped[0])
    assert len(first_hop_groups) == 4 and all(set(hop) == first_hop_groups for hop in grouped[1:])
    assert convoy_s / grouped_s > 2.0, (convoy_s, grouped_s)  # 28 vs 12 time units per 8 tokens


# --- session table -------------------------------------------------------------------------

S1, S2, S3 = (bytes([i]) * 16 for i in (1, 2, 3))


def refused(code: int, fragment: str, call, *args) -> None:
    with pytest.raises(WireError) as caught:
        call(*args)
    assert caught.value.code == code and fragment in caught.value.message, str(caught.value)


def test_sessions_get_the_lowest_free_sequence_and_run_out() -> None:
    table = SessionTable(2, 64)
    assert table.accept(S1, 0, 0, 5, "owner", now_ms=10).seq_id == 0
    assert table.accept(S2, 0, 0, 3, "owner", now_ms=10).seq_id == 1
    assert table.free_count == 0 and len(table) == 2 and S1 in table
    refused(Code.RESOURCE_EXHAUSTED, "all 2 sequences of this range are in use", table.accept, S3, 0, 0, 1, "o", 10)
    assert S3 not in table


def test_steps_must_follow_in_order() -> None:
    table = SessionTable(4, 16)
    session = table.accept(S1, 0, 0, 5, "owner", now_ms=0)
    assert (session.next_step, session.next_position, session.pending) == (1, 5, 1)
    refused(Code.INVALID_ARGUMENT, "already exists", table.accept, S1, 0, 0, 1, "owner", 0)
    refused(Code.NOT_FOUND, "unknown session", table.accept, S2, 1, 5, 1, "owner", 0)
    refused(Code.REFUSED, "belongs to owner", table.accept, S1, 1, 5, 1, "thief", 0)
    refused(Code.INVALID_ARGUMENT, "step 2 out of order (expected 1)", table.accept, S1, 2, 5, 1, "owner", 0)
    refused(Code.INVALID_ARGUMENT, "starts at position 4, expected 5", table.accept, S1, 1, 4, 1, "owner", 0)
    # Accepting reserves positions: the next step is checked against them at once.
    table.accept(S1, 1, 5, 1, "owner", now_ms=1)
    assert (session.next_step, session.next_position, session.pending) == (2, 6, 2)
    refused(Code.RESOURCE_EXHAUSTED, "exceed the context of 16 positions", table.accept, S1, 2, 6, 11, "owner", 1)
    refused(Code.RESOURCE_EXHAUSTED, "exceed the context", table.accept, S2, 0, 0, 17, "owner", 1)
    refused(Code.INVALID_ARGUMENT, "step 0 must start at position 0", table.accept, S2, 0, 3, 1, "owner", 1)
    assert table.accept(S1, 2, 6, 10, "owner", now_ms=2).next_position == 16


def test_ended_sequences_are_reused_only_after_release() -> None:
    table = SessionTable(1, 64)
    table.accept(S1, 0, 0, 2, "owner", now_ms=0)
    assert table.end(S1).seq_id == 0 and S1 not in table and table.end(S1) is None
    assert table.has_closing()
    refused(Code.RESOURCE_EXHAUSTED, "(1 being freed)", table.accept, S2, 0, 0, 1, "owner", 0)
    assert table.take_closing() == [0] and table.take_closing() == [] and not table.has_closing()
    table.release(0)
    assert table.accept(S2, 0, 0, 1, "owner", now_ms=0).seq_id == 0
    with pytest.raises(ValueError):
        table.release(5)


def test_idle_sessions_are_those_with_nothing_pending() -> None:
    table = SessionTable(4, 64)
    table.accept(S1, 0, 0, 2, "owner", now_ms=1000)
    table.accept(S2, 0, 0, 2, "owner", now_ms=1000)
    table.done(S1, now_ms=1500)
    assert table.idle(now_ms=2000, timeout_ms=1000) == [], "S2 has a step pending, S1 was used at 1500"
    assert table.idle(now_ms=2500, timeout_ms=1000) == [S1]
    table.done(S2, now_ms=2500)
    table.done(S3, now_ms=2500)  # unknown: ignored
    assert table.idle(now_ms=3500, timeout_ms=1000) == [S1, S2]
    assert table.get(S2).pending == 0 and sorted(table.session_ids()) == [S1, S2]


def test_touches_alone_cannot_keep_a_session_past_the_stall_bound() -> None:
    table = SessionTable(4, 64)
    table.accept(S1, 0, 0, 2, "owner", now_ms=1000)
    table.accept(S2, 0, 0, 2, "owner", now_ms=1000)
    table.done(S1, now_ms=1000)
    table.done(S2, now_ms=1000)
    for now in range(2000, 62_000, 2000):  # the owner touches both every 2 s
        assert table.touch(S1, "owner", now) and table.touch(S2, "owner", now)
        table.accept(S2, now // 2000, 2 + now // 2000 - 1, 1, "owner", now)  # S2 also steps
        table.done(S2, now)
    assert table.idle(now_ms=61_000, timeout_ms=5000) == [], "touched: neither is idle"
    assert table.stalled(now_ms=61_000, stall_ms=60_000) == [S1], "S1 took no step for 60 s, S2 stepped"
    assert table.stalled(now_ms=61_000, stall_ms=60_000, bound=True) == []


def test_a_session_bound_on_the_data_plane_is_stalled_only_if_its_worker_took_no_step() -> None:
    table = SessionTable(4, 64)
    table.accept(S1, 0, 0, 2, "owner", now_ms=0)
    table.done(S1, now_ms=0)
    table.bind_data_plane(S1, "owner", now_ms=0)
    assert table.stalled(now_ms=60_000, stall_ms=60_000, bound=True) == [S1]
    table.note_bound_progress(S1, worker_next_step=7, now_ms=60_000)  # the worker took steps 1..6
    assert table.stalled(now_ms=61_000, stall_ms=60_000) == []
    table.note_bound_progress(S1, worker_next_step=7, now_ms=121_000)  # nothing since
    assert table.stalled(now_ms=121_000, stall_ms=60_000) == [S1]


def test_untrusted_owners_together_never_take_the_trusted_reserve() -> None:
    assert trusted_reserve(4, 0.25, any_trusted=True) == 1
    assert trusted_reserve(4, 0.25, any_trusted=False) == 0, "no trusted owner: no reserve"
    assert trusted_reserve(1, 0.5, any_trusted=True) == 0, "one sequence: an untrusted owner may still have it"
    assert trusted_reserve(8, 0.99, any_trusted=True) == 7, "never all of them"
    table = SessionTable(4, 64, max_per_owner=3, reserve_for_trusted=1)
    table.accept(S1, 0, 0, 1, "sybil-a", 0)
    table.accept(S2, 0, 0, 1, "sybil-a", 0)
    table.accept(S3, 0, 0, 1, "sybil-b", 0)
    s4, s5 = bytes([4]) * 16, bytes([5]) * 16
    refused(Code.RESOURCE_EXHAUSTED, "kept for owners this node trusts", table.accept, s4, 0, 0, 1, "sybil-b", 0)
    table.accept(s4, 0, 0, 1, "relay", 0, trusted=True)  # the reserve is the relay's
    assert table.free_count == 0
    with pytest.raises(WireError, match="all 4 sequences"):
        table.accept(s5, 0, 0, 1, "relay", 0, trusted=True)
    table.end(S1)
    table.release(table.take_closing()[0])
    table.accept(s5, 0, 0, 1, "sybil-c", 1)  # freed by an untrusted owner: for anyone again


def test_a_trusted_owner_is_held_to_no_share() -> None:
    """The relay, one owner for many users, may take every sequence; an untrusted owner stops at its share."""
    table = SessionTable(4, 64, max_per_owner=2, reserve_for_trusted=1)
    for i in range(4):
        table.accept(bytes([10 + i]) * 16, 0, 0, 1, "relay", 0, trusted=True)
    assert table.free_count == 0
    other = SessionTable(4, 64, max_per_owner=2, reserve_for_trusted=1)
    other.accept(S1, 0, 0, 1, "client", 0)
    other.accept(S2, 0, 0, 1, "client", 0)
    refused(Code.RESOURCE_EXHAUSTED, "its share", other.accept, S3, 0, 0, 1, "client", 0)


# --- phases, row budget, compatibility key -----------------------------------------------------


def test_decode_steps_and_prefill_chunks_never_share_a_forward_and_take_turns() -> None:
    """llama.cpp would recompute a chunk next to rows of another length in other shapes (equal
    rows per sequence per micro-batch): so a Forward is all decode rows, or chunks of one length."""
    scheduler: StepScheduler[str] = StepScheduler(64, 8)
    scheduler.push("p0", session=0, n_rows=16)
    for s in (1, 2, 3):
        scheduler.push(f"d{s}", session=s, n_rows=1)
    scheduler.push("p4", session=4, n_rows=16)
    scheduler.push("p5", session=5, n_rows=10)
    assert scheduler.next_batch() == ["p0", "p4"]  # prefill first: the oldest chunk and its equals
    assert scheduler.next_batch() == ["d1", "d2", "d3"]  # then every decode step
    for s in (1, 2, 3):
        scheduler.push(f"d{s}'", session=s, n_rows=1)
    assert scheduler.next_batch() == ["p5"]  # prompts get every other Forward while both wait
    assert scheduler.next_batch() == ["d1'", "d2'", "d3'"]
    assert scheduler.next_batch() == []
    assert (scheduler.forwards, scheduler.prefill_forwards) == (4, 2)


def test_a_decode_step_waits_behind_one_forward_at_most() -> None:
    scheduler: StepScheduler[str] = StepScheduler(8, 8)
    for s in range(4):
        scheduler.push(f"p{s}", session=10 + s, n_rows=8)
    scheduler.push("d", session=0, n_rows=1)
    assert scheduler.next_batch() == ["p0"]
    assert scheduler.next_batch() == ["d"]
    scheduler.push("d'", session=0, n_rows=1)
    assert scheduler.next_batch() == ["p1"]
    assert scheduler.next_batch() == ["d'"]


def test_steps_of_another_key_never_share_a_forward() -> None:
    scheduler: StepScheduler[str] = StepScheduler(16, 8)
    scheduler.push("f32-a", session=0, n_rows=1, key="f32")
    scheduler.push("f16-b", session=1, n_rows=1, key="f16")
    scheduler.push("f32-c", session=2, n_rows=1, key="f32")
    scheduler.push("f16-d", session=3, n_rows=1, key="f16")
    assert scheduler.next_batch() == ["f32-a", "f32-c"]  # the oldest step's key
    assert scheduler.next_batch() == ["f16-b", "f16-d"]
    assert scheduler.next_batch() == []


def test_the_forward_key_is_recipe_model_blocks_schema_and_dtype_not_the_phase() -> None:
    import numpy as np

    from agent.core.node.batching import forward_key
    from agent.core.wire.boundary import WireDType
    from agent.core.wire.step_validation import StepInput

    def step(**fields) -> StepInput:
        base = dict(
            session_id=S1, step=0, begin=10, end=20, positions=np.arange(1, dtype=np.int32), token_ids=None,
            rows=np.zeros((1, 4), np.float32), dtype=int(WireDType.F32), n_embd=4, recipe_hash="r1",
            model_sha256="m1", rest=(), owner_peer_id="o", owner_addrs=(),
        )  # fmt: skip
        base.update(fields)
        return StepInput(**base)

    key = forward_key(step())
    assert forward_key(step(positions=np.arange(5, dtype=np.int32), session_id=S2)) == key  # a chunk of another session
    for other in (dict(recipe_hash="r2"), dict(model_sha256="m2"), dict(dtype=int(WireDType.F16)), dict(begin=0)):
        assert forward_key(step(**other)) != key, other


def test_bounded_service_while_a_long_prompt_is_prefilled_in_chunks() -> None:
    """A 512-token prompt in chunks of 128 arrives while 4 sessions decode, each sending its
    next step as soon as its last one left the worker (what owners do). Simulated Forwards
    cost 1 + rows/128 time units (a decode row is cheap next to weights read once)."""
    scheduler: StepScheduler[tuple[str, int]] = StepScheduler(512, 8, row_budget=160)
    now = 0.0
    waits: list[int] = []  # Forwards each decode step waited behind
    queued_at: dict[int, int] = {}
    for s in range(4):
        scheduler.push(("decode", s), session=s, n_rows=1)
        queued_at[s] = 0
    chunks_left = 4
    scheduler.push(("prefill", 0), session=99, n_rows=128)
    prompt_done_at = None
    for forward in range(1, 41):
        batch = scheduler.next_batch()
        rows = 0
        for kind, index in batch:
            if kind == "decode":
                waits.append(forward - 1 - queued_at[index])
                queued_at[index] = forward
                scheduler.push(("decode", index), session=index, n_rows=1)
                rows += 1
            else:
                rows += 128
                chunks_left -= 1
                if chunks_left:
                    scheduler.push(("prefill", 4 - chunks_left), session=99, n_rows=128)
                else:
                    prompt_done_at = forward
        now += 1 + rows / 128
    assert max(waits) <= 1, waits  # no decode step waited behind more than one Forward
    assert prompt_done_at == 7  # the prompt's 4 chunks in every other Forward: its share
    assert now > 0


def test_one_owner_cannot_take_more_than_its_share_of_a_ranges_sequences() -> None:
    table = SessionTable(4, 64, max_per_owner=2)
    table.accept(S1, 0, 0, 1, "greedy", 0)
    table.accept(S2, 0, 0, 1, "greedy", 0)
    refused(
        Code.RESOURCE_EXHAUSTED,
        "owner greedy holds 2 of this range's 4 sequences",
        table.accept,
        S3,
        0,
        0,
        1,
        "greedy",
        0,
    )
    table.accept(S3, 0, 0, 1, "other", 0)  # everyone else still gets one
    assert table.free_count == 1
    table.end(S1)
    table.release(table.take_closing()[0])
    table.accept(bytes([9]) * 16, 0, 0, 1, "greedy", 1)  # its share again once one ended


def test_a_first_hop_gathers_a_decode_group_for_at_most_its_window() -> None:
    assert gather_wait_ms(waiting_decode=1, group_size=4, waited_ms=0.0, window_ms=20.0) == 20.0
    assert gather_wait_ms(waiting_decode=3, group_size=4, waited_ms=15.0, window_ms=20.0) == 5.0
    assert gather_wait_ms(waiting_decode=3, group_size=4, waited_ms=25.0, window_ms=20.0) == 0.0, "window over"
    assert gather_wait_ms(waiting_decode=4, group_size=4, waited_ms=0.0, window_ms=20.0) == 0.0, "group full"
    assert gather_wait_ms(waiting_decode=1, group_size=4, waited_ms=0.0, window_ms=0.0) == 0.0, "off"


def test_a_gathering_first_hop_is_woken_only_by_the_step_that_can_complete_its_group() -> None:
    # 3 of a group of 8 wait: the next 4 decode steps cannot end the hold, the 5th may
    assert gather_arrivals_needed(waiting_decode=3, group_size=8) == 5
    assert gather_arrivals_needed(waiting_decode=7, group_size=8) == 1
    # a count that does not add up (the group shrank meanwhile): the next arrival re-counts
    assert gather_arrivals_needed(waiting_decode=8, group_size=8) == 1
    assert gather_arrivals_needed(waiting_decode=9, group_size=4) == 1
    # while such arrivals are left, a decode step is queued quietly; anything else wakes
    assert not arrival_wakes_gatherer(4, decode=True)
    assert arrival_wakes_gatherer(4, decode=False), "a prefill chunk or a rebuild changes what runs next"
    assert arrival_wakes_gatherer(0, decode=True), "the step that may complete the group, or no gather"


def test_decode_waiting_counts_the_decode_steps_of_the_next_forward_only() -> None:
    s: StepScheduler[str] = StepScheduler(n_batch_max=64, max_entries=8)
    assert s.decode_waiting() == (None, 0)
    s.push("d1", session=1, n_rows=1)
    s.push("d2", session=2, n_rows=1)
    s.push("d2'", session=2, n_rows=1)  # behind its session's previous step
    assert s.decode_waiting() == ("d1", 2)
    s.push("p3", session=3, n_rows=16)
    assert s.decode_waiting() == (None, 0), "after a decode Forward (none yet counts as one), the prompt goes first"
    assert s.next_batch() == ["p3"]
    assert s.decode_waiting() == ("d1", 2)


def test_only_a_first_hop_caps_and_holds_its_decode_forwards() -> None:
    plan = dict(decoding_sessions=8, route_hops=3, groups=None, waiting=1, waited_ms=5.0, window_ms=20.0)
    assert first_hop_decode(begin=0, **plan) == (2, 15.0)  # 4 groups of 2; one waits: hold the rest of 20 ms
    assert first_hop_decode(begin=0, **{**plan, "waiting": 2}) == (2, 0.0)  # its group is there
    assert first_hop_decode(begin=0, **{**plan, "window_ms": 0.0}) == (2, 0.0)  # gathering off
    assert first_hop_decode(begin=10, **plan) == (None, 0.0)  # a later hop takes what arrives
    assert first_hop_decode(begin=0, **{**plan, "waiting": 0}) == (None, 0.0)  # no decode Forward next
    assert first_hop_decode(begin=0, **{**plan, "groups": 0}) == (None, 0.0)  # groups off


def test_lock_step_holds_each_decode_forward_until_every_decoding_session_waits() -> None:
    plan = dict(decoding_sessions=8, route_hops=3, groups=1, waited_ms=10.0, window_ms=40.0)
    assert first_hop_decode(begin=0, waiting=7, **plan) == (8, 30.0), "one of the 8 is late: hold the rest of 40 ms"
    assert first_hop_decode(begin=0, waiting=8, **plan) == (8, 0.0), "all 8 there: one Forward of 8 now"
    assert first_hop_decode(begin=0, waiting=7, **{**plan, "waited_ms": 40.0}) == (8, 0.0), "window over: the 7 go"


def test_by_default_a_route_whose_next_hop_shares_this_machine_runs_lock_step() -> None:
    """Hops that share one machine's cores gain nothing by computing at once: lock-step, each
    Forward every session's row; hops on machines of their own: decode groups."""
    assert decode_mode(None, None, next_hop_shares_host=True) == (1, LOCK_STEP_GATHER_MS)
    assert decode_mode(None, None, next_hop_shares_host=False) == (None, 0.0), "groups: route hops + 1"
    plan = dict(decoding_sessions=8, route_hops=3, waited_ms=0.0)
    groups, window_ms = decode_mode(None, None, next_hop_shares_host=True)
    assert first_hop_decode(begin=0, waiting=7, groups=groups, window_ms=window_ms, **plan) == (8, LOCK_STEP_GATHER_MS)
    groups, window_ms = decode_mode(None, None, next_hop_shares_host=False)
    assert first_hop_decode(begin=0, waiting=7, groups=groups, window_ms=window_ms, **plan) == (2, 0.0)
    # what the node says stands
    assert decode_mode(0, None, next_hop_shares_host=True) == (0, 0.0), "off stays off"
    assert decode_mode(4, None, next_hop_shares_host=True) == (4, 0.0)
    assert decode_mode(1, None, next_hop_shares_host=False) == (1, LOCK_STEP_GATHER_MS), "lock-step anywhere"
    assert decode_mode(1, 10.0, next_hop_shares_host=False) == (1, 10.0)
    assert decode_mode(None, 0.0, next_hop_shares_host=True) == (1, 0.0), "a window of 0: never held"
    assert decode_mode(None, 5.0, next_hop_shares_host=False) == (None, 5.0)


def test_only_sessions_whose_last_step_was_a_decode_step_count_as_decoding() -> None:
    table = SessionTable(n_seq_max=4, n_ctx_per_sequence=256)
    table.accept(S1, 0, 0, 32, "o", 0)  # a prompt chunk
    table.accept(S2, 0, 0, 1, "o", 0)  # a one-token prompt: a decode step
    assert table.decoding_count == 1, "S1 is still taking its prompt: a decode group must not wait for it"
    table.accept(S1, 1, 32, 16, "o", 1)  # its next chunk
    assert table.decoding_count == 1
    table.accept(S1, 2, 48, 1, "o", 2)  # its first decode step
    assert table.decoding_count == 2
    table.accept_rebuild(S3, 5, 0, 40, "o", 3)  # a rebuild is a prefill
    assert table.decoding_count == 2
    table.end(S2)
    assert table.decoding_count == 1


def test_a_range_waits_its_batch_window_only_while_its_forward_has_room():
    assert batch_window_wait_ms(2.0, pending_rows=1, row_budget=512) == 2.0
    assert batch_window_wait_ms(2.0, pending_rows=512, row_budget=512) == 0.0  # full: run it now
    assert batch_window_wait_ms(2.0, pending_rows=0, row_budget=512) == 0.0  # nothing queued
    assert batch_window_wait_ms(0.0, pending_rows=1, row_budget=512) == 0.0  # off (the default)


def test_sessions_opened_from_one_address_share_one_owners_share() -> None:
    table = SessionTable(4, 64, max_per_owner=2)
    table.accept(S1, 0, 0, 1, "key-a", 0, source_host="203.0.113.7")
    table.accept(S2, 0, 0, 1, "key-b", 0, source_host="203.0.113.7")
    with pytest.raises(WireError, match=r"held from 203\.0\.113\.7"):
        table.accept(S3, 0, 0, 1, "key-c", 0, source_host="203.0.113.7")  # a third self-made key
    table.accept(S3, 0, 0, 1, "key-c", 0, source_host="198.51.100.1")  # another address
    table.accept(bytes([4]) * 16, 0, 0, 1, "relay", 0, trusted=True, source_host="203.0.113.7")
    assert counted_host("127.0.0.1") == "" and counted_host("::1") == "" and counted_host("") == ""
    assert counted_host("203.0.113.7") == "203.0.113.7"
