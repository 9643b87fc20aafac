"""agent.core.tracker.canary: when ranges are checked, what a canary sends, how outputs compare, and
what a failure leads to (pure: no processes, no clock)."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest

from agent.core.tracker.canary import (
    CanaryPolicy,
    CanarySchedule,
    FailureAction,
    after_failure,
    compare_rows,
    compare_scores,
    next_delay_s,
    plan_canary,
    scores_bytes,
)
from agent.core.wire.topk import TopLogits

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

A = ("peer-a", "m" * 64, 0, 10)
B = ("peer-b", "m" * 64, 10, 20)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"interval_s": 0}, "interval_s must be > 0"),
        ({"min_prompt_rows": 0}, "prompt rows"),
        ({"min_prompt_rows": 5, "max_prompt_rows": 4}, "prompt rows"),
        ({"min_decode_steps": 3, "max_decode_steps": 2}, "decode steps"),
        ({"refuse_after_failures": 0}, "refuse_after_failures"),
        ({"retry_s": -1}, "retry_s"),
        ({"result_top_k": -1}, "result_top_k"),
        ({"cross_recipe_rel_error": -0.1}, "cross_recipe_rel_error"),
    ],
)
def test_a_bad_policy_is_refused_naming_the_field(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CanaryPolicy(**fields)


def test_delays_are_random_within_half_to_one_and_a_half_intervals() -> None:
    policy = CanaryPolicy(interval_s=10.0)
    generator = rng()
    delays = [next_delay_s(policy, generator) for _ in range(2000)]
    assert 5.0 <= min(delays) < 5.1 and 14.9 < max(delays) <= 15.0
    assert len(set(delays)) == len(delays)  # not predictable from the last one


def test_a_newly_ready_range_is_due_at_once_and_gated_until_it_passes() -> None:
    schedule = CanarySchedule(CanaryPolicy(interval_s=100.0))
    assert schedule.next_due(0.0) is None and schedule.next_wakeup_s() is None
    assert schedule.sync_node("peer-a", [A[1:]], now_s=5.0) == [A]
    assert schedule.sync_node("peer-a", [A[1:]], now_s=6.0) == []  # already watched
    assert not schedule.cleared(A)
    assert schedule.next_due(4.9) is None and schedule.next_due(5.0) == A
    schedule.started(A)
    assert schedule.next_due(10.0) is None and schedule.next_wakeup_s() is None  # in flight
    schedule.passed(A, now_s=7.0, rng=rng())
    assert schedule.cleared(A) and schedule.passed_count(A) == 1
    due = schedule.next_wakeup_s()
    assert due is not None and 7.0 + 50.0 <= due <= 7.0 + 150.0
    assert schedule.next_due(due - 0.001) is None and schedule.next_due(due) == A


def test_urgent_checks_come_before_overdue_periodic_ones() -> None:
    schedule = CanarySchedule(CanaryPolicy(interval_s=1.0))
    schedule.sync_node("peer-a", [A[1:]], 0.0)
    schedule.started(A)
    schedule.passed(A, 0.0, rng())  # periodic, due within [0.5, 1.5]
    schedule.sync_node("peer-b", [B[1:]], 50.0)  # newly READY, due at 50
    assert schedule.next_due(100.0) == B  # A is longer overdue, but B is new
    schedule.started(B)
    schedule.passed(B, 100.0, rng())
    assert schedule.next_due(100.0) == A
    assert schedule.prioritise("peer-b", None, 100.0) == [B]
    assert schedule.next_due(100.0) == B  # a report makes it urgent again


def test_inconclusive_retries_later_failed_and_gone_ranges_are_forgotten() -> None:
    policy = CanaryPolicy(retry_s=3.0)
    schedule = CanarySchedule(policy)
    schedule.sync_node("peer-a", [A[1:]], 0.0)
    schedule.started(A)
    schedule.inconclusive(A, 1.0)
    assert schedule.next_due(3.9) is None and schedule.next_due(4.0) == A
    assert not schedule.cleared(A)  # still gated
    schedule.started(A)
    schedule.failed(A)
    assert A not in schedule and schedule.next_due(1e9) is None
    schedule.passed(A, 1.0, rng())  # a late outcome of a forgotten range changes nothing
    assert A not in schedule
    schedule.sync_node("peer-a", [A[1:], (A[1], 10, 20)], 2.0)
    schedule.sync_node("peer-a", [(A[1], 10, 20)], 3.0)  # A stopped being READY
    assert A not in schedule and len(schedule) == 1
    schedule.forget_node("peer-a")
    assert len(schedule) == 0


def test_plans_are_fresh_random_and_fit_the_context() -> None:
    policy = CanaryPolicy(min_prompt_rows=3, max_prompt_rows=9, min_decode_steps=1, max_decode_steps=4)
    generator = rng(1)
    plans = [plan_canary(policy, generator, n_vocab=1000, bos_token_id=7, n_ctx=4096) for _ in range(300)]
    assert all(p.prompt[0] == 7 and 3 <= len(p.prompt) <= 9 and 1 <= p.decode_steps <= 4 for p in plans)
    assert {len(p.prompt) for p in plans} == set(range(3, 10)) and {p.decode_steps for p in plans} == {1, 2, 3, 4}
    assert len({p.prompt for p in plans}) == len(plans)  # no canary is sent twice
    assert all(0 <= t < 1000 for p in plans for t in p.prompt) and {p.result_top_k for p in plans} == {40}
    small = plan_canary(policy, generator, n_vocab=1000, bos_token_id=None, n_ctx=4)
    assert len(small.prompt) + small.decode_steps <= 4
    assert plan_canary(policy, generator, n_vocab=10, bos_token_id=None, n_ctx=64, full_row=True).result_top_k == 0
    with pytest.raises(ValueError, match="n_vocab"):
        plan_canary(policy, generator, n_vocab=0, bos_token_id=None, n_ctx=64)
    with pytest.raises(ValueError, match="no positions"):
        plan_canary(policy, generator, n_vocab=10, bos_token_id=None, n_ctx=0)


def test_rows_must_be_equal_bit_for_bit_within_one_recipe() -> None:
    expected = rng(2).standard_normal((5, 8)).astype(np.float32)
    assert compare_rows(3, expected, expected.copy()) is None
    returned = expected.copy()
    returned[2, 4] = np.nextafter(returned[2, 4], np.float32(np.inf))  # one ulp
    mismatch = compare_rows(3, expected, returned)
    assert mismatch is not None and mismatch.step == 3 and mismatch.output == "boundary rows"
    assert mismatch.expected_sha256 == hashlib.sha256(expected.tobytes()).hexdigest()
    assert mismatch.returned_sha256 == hashlib.sha256(returned.tobytes()).hexdigest()
    assert 0 < mismatch.max_abs_diff < 1e-5 and mismatch.detail == "rows 2 of 5 differ"
    assert compare_rows(0, expected, expected[:4]).max_abs_diff == math.inf
    nan = expected.copy()
    nan[0, 0] = np.nan
    assert "NaN" in compare_rows(0, expected, nan).detail


def test_across_recipes_the_declared_bound_applies() -> None:
    expected = rng(3).standard_normal((4, 64)).astype(np.float32)
    close = (expected * 1.001).astype(np.float32)
    far = (expected + 0.5).astype(np.float32)
    assert compare_rows(0, expected, close, rel_error=0.02) is None
    mismatch = compare_rows(0, expected, far, rel_error=0.02)
    assert mismatch is not None and "exceeds the cross-recipe bound 0.02" in mismatch.detail
    assert compare_scores(0, expected[0], close[0], rel_error=0.02) is None
    assert "exceeds" in compare_scores(0, expected[0], far[0], rel_error=0.02).detail


def test_last_range_results_compare_ids_values_and_log_sum_exp() -> None:
    row = rng(4).standard_normal(100).astype(np.float32)
    top = TopLogits.from_row(row, 5)
    assert compare_scores(1, top, TopLogits.from_row(row.copy(), 5)) is None
    shifted = TopLogits(top.ids, (top.logits + np.float32(0.25)).astype(np.float32), top.log_sum_exp + 0.25, 100)
    mismatch = compare_scores(1, top, shifted)
    assert mismatch.output == "top-5 logits" and mismatch.detail == "same tokens, other values"
    assert mismatch.max_abs_diff == pytest.approx(0.25)
    assert mismatch.expected_sha256 == hashlib.sha256(scores_bytes(top)).hexdigest()
    other = row.copy()
    other[int(top.ids[-1])] = -100.0
    assert "token ids differ" in compare_scores(1, top, TopLogits.from_row(other, 5)).detail
    lse = TopLogits(top.ids, top.logits, top.log_sum_exp + 1e-12, 100)
    assert compare_scores(1, top, lse) is not None  # the log-sum-exp is compared too
    assert compare_scores(1, row, row.copy()) is None
    assert compare_scores(1, row, top).detail == "returned a top-K"
    assert compare_scores(1, top, row).detail == "returned a full row"
    assert compare_scores(1, row, row[:10]).max_abs_diff == math.inf


def test_a_failure_withdraws_the_range_and_repeated_ones_refuse_the_node() -> None:
    policy = CanaryPolicy(refuse_after_failures=2)
    assert after_failure(policy, 1) is FailureAction.WITHDRAW
    assert after_failure(policy, 2) is FailureAction.REFUSE
    assert after_failure(CanaryPolicy(refuse_after_failures=1), 1) is FailureAction.REFUSE
