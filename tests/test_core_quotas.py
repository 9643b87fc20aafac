"""Unit tests of the relay's quota and ledger arithmetic (agent.core.relay.quotas): every limit, the
retry-after values, UTC day boundaries and the credit a node earns per completion."""

from __future__ import annotations

import math

import pytest

from agent.core.relay.quotas import (
    ADMITTED,
    LIMIT_TOKENS_PER_DAY,
    RPM_WINDOW_S,
    SECONDS_PER_DAY,
    HopRows,
    KeyLimits,
    NodeCredit,
    QuotaDecision,
    TokenBudget,
    budget_tokens,
    charged_tokens,
    credit_for_hops,
    day_of,
    decide,
    next_day_start_s,
    requests_in_window,
    tokens_left,
)

pytestmark = pytest.mark.unit

# 2023-11-14 22:13:20 UTC: 6400 s before the next UTC midnight.
NOW_S = 1_700_000_000.0
MIDNIGHT_AFTER_NOW_S = 1_700_006_400.0


def _decide(limits: KeyLimits, *, tokens_today=0, request_times_s=(), concurrent=0, now_s=NOW_S, **kw):
    return decide(
        limits, tokens_today=tokens_today, request_times_s=request_times_s, concurrent=concurrent, now_s=now_s, **kw
    )


# --- KeyLimits --------------------------------------------------------------------------------


def test_unlimited_key_is_admitted_whatever_its_usage() -> None:
    decision = _decide(KeyLimits(), tokens_today=10**12, request_times_s=[NOW_S] * 10_000, concurrent=10_000)
    assert decision == ADMITTED
    assert decision.admitted and decision.limit is None and decision.retry_after_s == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tokens_per_day": 0}, r"tokens_per_day must be >= 1 \(or None: unlimited\), got 0"),
        ({"requests_per_minute": -5}, r"requests_per_minute must be >= 1"),
        ({"max_concurrent": 1.5}, r"max_concurrent must be an int or None, got 1.5"),
        ({"max_concurrent": True}, r"max_concurrent must be an int or None, got True"),
    ],
)
def test_limits_must_be_positive_ints_or_none(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        KeyLimits(**kwargs)


def test_limits_as_dict() -> None:
    assert KeyLimits(1000, None, 2).as_dict() == {
        "tokens_per_day": 1000,
        "requests_per_minute": None,
        "max_concurrent": 2,
    }


# --- tokens_per_day ---------------------------------------------------------------------------


def test_tokens_below_the_limit_are_admitted() -> None:
    assert _decide(KeyLimits(tokens_per_day=1000), tokens_today=999) == ADMITTED


def test_tokens_at_the_limit_are_refused_until_utc_midnight() -> None:
    decision = _decide(KeyLimits(tokens_per_day=1000), tokens_today=1000)
    assert decision == QuotaDecision(
        admitted=False,
        limit="tokens_per_day",
        message="tokens_per_day limit of 1000 reached (1000 used today; resets at 00:00 UTC)",
        retry_after_s=6400.0,
    )
    assert NOW_S + decision.retry_after_s == MIDNIGHT_AFTER_NOW_S


def test_tokens_over_the_limit_name_the_usage() -> None:
    decision = _decide(KeyLimits(tokens_per_day=1000), tokens_today=1234)
    assert decision.message == "tokens_per_day limit of 1000 reached (1234 used today; resets at 00:00 UTC)"


def test_token_retry_after_one_second_before_and_at_midnight() -> None:
    limits = KeyLimits(tokens_per_day=1)
    assert _decide(limits, tokens_today=1, now_s=MIDNIGHT_AFTER_NOW_S - 1).retry_after_s == 1.0
    # At midnight exactly, a new day has begun: a full day to wait (with that day's usage).
    assert _decide(limits, tokens_today=1, now_s=MIDNIGHT_AFTER_NOW_S).retry_after_s == SECONDS_PER_DAY


def test_tokens_left() -> None:
    assert tokens_left(KeyLimits(), 10**9) is None
    assert tokens_left(KeyLimits(tokens_per_day=1000), 400) == 600
    assert tokens_left(KeyLimits(tokens_per_day=1000), 1500) == 0


# --- requests_per_minute ----------------------------------------------------------------------


def test_requests_below_the_limit_are_admitted() -> None:
    assert _decide(KeyLimits(requests_per_minute=3), request_times_s=[NOW_S - 50, NOW_S - 10]) == ADMITTED


def test_requests_at_the_limit_wait_for_the_oldest_to_leave_the_minute() -> None:
    decision = _decide(KeyLimits(requests_per_minute=3), request_times_s=[NOW_S - 10, NOW_S - 50, NOW_S - 30])
    assert decision == QuotaDecision(
        admitted=False,
        limit="requests_per_minute",
        message="requests_per_minute limit of 3 reached (3 requests in the last minute)",
        retry_after_s=10.0,  # NOW_S - 50 leaves the window at NOW_S + 10
    )
    # ... and at that moment the request is admitted.
    later = NOW_S + decision.retry_after_s
    assert _decide(
        KeyLimits(requests_per_minute=3), request_times_s=[NOW_S - 10, NOW_S - 50, NOW_S - 30], now_s=later
    ).admitted


def test_requests_over_the_limit_wait_until_enough_have_left() -> None:
    # Four in the window, limit 2: admitted once only one remains, i.e. when the third oldest
    # (NOW_S - 30) leaves at NOW_S + 30.
    times = [NOW_S - 50, NOW_S - 40, NOW_S - 30, NOW_S - 20]
    decision = _decide(KeyLimits(requests_per_minute=2), request_times_s=times)
    assert decision.limit == "requests_per_minute"
    assert decision.retry_after_s == 30.0
    assert decision.message == "requests_per_minute limit of 2 reached (4 requests in the last minute)"
    assert _decide(KeyLimits(requests_per_minute=2), request_times_s=times, now_s=NOW_S + 30).admitted
    assert not _decide(KeyLimits(requests_per_minute=2), request_times_s=times, now_s=NOW_S + 29.5).admitted


def test_requests_outside_the_window_do_not_count() -> None:
    limits = KeyLimits(requests_per_minute=1)
    # Exactly one minute old has left the window; older ones and (skewed) future ones never count.
    stale = [NOW_S - RPM_WINDOW_S, NOW_S - 61, NOW_S - 3600, NOW_S + 5]
    assert _decide(limits, request_times_s=stale) == ADMITTED
    assert requests_in_window([*stale, NOW_S, NOW_S - 59.5], NOW_S) == [NOW_S - 59.5, NOW_S]


def test_a_request_at_now_counts_for_a_whole_minute() -> None:
    decision = _decide(KeyLimits(requests_per_minute=1), request_times_s=[NOW_S])
    assert decision.retry_after_s == RPM_WINDOW_S


# --- max_concurrent ---------------------------------------------------------------------------


def test_concurrency_below_the_limit_is_admitted() -> None:
    assert _decide(KeyLimits(max_concurrent=2), concurrent=1) == ADMITTED


def test_concurrency_at_the_limit_is_refused_with_a_short_retry() -> None:
    decision = _decide(KeyLimits(max_concurrent=2), concurrent=2)
    assert decision == QuotaDecision(
        admitted=False,
        limit="max_concurrent",
        message="max_concurrent limit of 2 reached (2 requests in flight)",
        retry_after_s=1.0,
    )
    assert _decide(KeyLimits(max_concurrent=2), concurrent=3, concurrency_retry_after_s=0.25).retry_after_s == 0.25


# --- several limits at once -------------------------------------------------------------------


def test_the_limit_that_frees_last_is_reported() -> None:
    limits = KeyLimits(tokens_per_day=10, requests_per_minute=1, max_concurrent=1)
    everything = {"tokens_today": 10, "request_times_s": [NOW_S - 20], "concurrent": 1}
    assert _decide(limits, **everything).limit == "tokens_per_day"  # 6400 s > 40 s > 1 s
    # Five seconds before midnight, the minute window frees later than the day.
    near_midnight = MIDNIGHT_AFTER_NOW_S - 5
    decision = _decide(limits, **{**everything, "request_times_s": [near_midnight - 20]}, now_s=near_midnight)
    assert (decision.limit, decision.retry_after_s) == ("requests_per_minute", 40.0)
    # Only concurrency and the minute: the minute.
    assert _decide(limits, request_times_s=[NOW_S - 59], concurrent=1).limit == "requests_per_minute"
    # A tie goes to tokens, then the minute.
    tie = _decide(
        KeyLimits(requests_per_minute=1, max_concurrent=1),
        request_times_s=[NOW_S - 59],
        concurrent=1,
        concurrency_retry_after_s=1.0,
    )
    assert (tie.limit, tie.retry_after_s) == ("requests_per_minute", 1.0)


def test_now_must_be_finite() -> None:
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError, match="now_s must be finite"):
            _decide(KeyLimits(), now_s=bad)
        with pytest.raises(ValueError, match="now_s must be finite"):
            day_of(bad)


# --- UTC days ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("now_s", "day"),
    [
        (0.0, "1970-01-01"),
        (86_399.999, "1970-01-01"),
        (86_400.0, "1970-01-02"),
        (-0.001, "1969-12-31"),
        (NOW_S, "2023-11-14"),
        (MIDNIGHT_AFTER_NOW_S - 0.001, "2023-11-14"),
        (MIDNIGHT_AFTER_NOW_S, "2023-11-15"),
        (1_709_164_800.0, "2024-02-29"),  # leap day, 00:00:00 UTC
        (1_709_251_199.0, "2024-02-29"),
        (1_709_251_200.0, "2024-03-01"),
        (1_735_689_599.0, "2024-12-31"),
        (1_735_689_600.0, "2025-01-01"),
        (4_102_444_800.0, "2100-01-01"),  # 2100 is not a leap year...
        (4_107_542_400.0, "2100-03-01"),  # ... so 28 Feb is followed by 1 Mar
    ],
)
def test_day_of_is_the_utc_day(now_s: float, day: str) -> None:
    assert day_of(now_s) == day


def test_next_day_start() -> None:
    assert next_day_start_s(NOW_S) == MIDNIGHT_AFTER_NOW_S
    assert next_day_start_s(MIDNIGHT_AFTER_NOW_S) == MIDNIGHT_AFTER_NOW_S + SECONDS_PER_DAY
    assert next_day_start_s(0.0) == 86_400.0
    assert next_day_start_s(-1.0) == 0.0
    assert day_of(next_day_start_s(NOW_S)) == "2023-11-15"


# --- ledger credit ----------------------------------------------------------------------------


def test_credit_is_rows_times_the_share_of_the_model() -> None:
    # SmolLM2: 30 blocks cut in three; the first hop saw the prompt (12 rows) and 4 decode rows.
    hops = [("n1", 0, 10, 16), ("n2", 10, 20, 16), ("n3", 20, 30, 16)]
    assert credit_for_hops(hops, 30) == [
        NodeCredit("n1", 16, 160 / 30),
        NodeCredit("n2", 16, 160 / 30),
        NodeCredit("n3", 16, 160 / 30),
    ]
    assert sum(c.credit for c in credit_for_hops(hops, 30)) == pytest.approx(16.0)


def test_uneven_ranges_earn_by_their_width() -> None:
    credits = credit_for_hops([HopRows("a", 0, 4, 10), HopRows("b", 4, 18, 10)], 18)
    assert [tuple(c) for c in credits] == [("a", 10, 40 / 18), ("b", 10, 140 / 18)]


def test_one_node_for_the_whole_model_earns_one_per_row() -> None:
    assert credit_for_hops([("solo", 0, 30, 7)], 30) == [("solo", 7, 7.0)]


def test_a_node_on_several_hops_gets_one_entry_in_first_appearance_order() -> None:
    # "b" lost [10, 20) after 3 rows; "c" took it over for the remaining 5 ("b" also serves [20, 30)).
    hops = [("a", 0, 10, 8), ("b", 10, 20, 3), ("c", 10, 20, 5), ("b", 20, 30, 8)]
    assert credit_for_hops(hops, 30) == [("a", 8, 80 / 30), ("b", 11, 110 / 30), ("c", 5, 50 / 30)]


def test_zero_rows_and_no_hops() -> None:
    assert credit_for_hops([("a", 0, 30, 0)], 30) == [("a", 0, 0.0)]
    assert credit_for_hops([], 30) == []


@pytest.mark.parametrize(
    ("hops", "n_layer", "message"),
    [
        ([("a", 0, 10, 1)], 0, r"n_layer must be an int >= 1, got 0"),
        ([("a", 0, 10, 1)], 10.0, r"n_layer must be an int >= 1, got 10.0"),
        ([("a", 0, 31, 1)], 30, r"hop #0: range \[0, 31\) is not inside \[0, 30\)"),
        ([("a", 0, 10, 1), ("b", 10, 10, 1)], 30, r"hop #1: range \[10, 10\) is not inside"),
        ([("a", -1, 10, 1)], 30, r"hop #0: range \[-1, 10\)"),
        ([("a", 0, 10, -1)], 30, r"hop #0: rows must be >= 0, got -1"),
        ([("", 0, 10, 1)], 30, r"hop #0: peer_id must be a non-empty str"),
        ([("a", 0, 10, 1.0)], 30, r"hop #0: rows must be an int, got 1.0"),
    ],
)
def test_credit_refuses_bad_hops(hops, n_layer, message) -> None:
    with pytest.raises(ValueError, match=message):
        credit_for_hops(hops, n_layer)


# --- budgets: what an admitted request may spend, and what it is charged -----------------------

BUDGET_NOW_S = 1_800_000_000.0


def test_an_unlimited_key_keeps_its_max_tokens_and_holds_prompt_plus_max() -> None:
    budget = budget_tokens(
        KeyLimits(), tokens_today=10**9, tokens_reserved=10**9, prompt_tokens=7, max_tokens=50, now_s=BUDGET_NOW_S
    )
    assert budget == TokenBudget(max_tokens=50, reserved_tokens=57)


def test_max_tokens_is_capped_by_what_is_left_after_the_prompt_and_the_held_tokens() -> None:
    limits = KeyLimits(tokens_per_day=100)
    budget = budget_tokens(
        limits, tokens_today=60, tokens_reserved=15, prompt_tokens=5, max_tokens=400, now_s=BUDGET_NOW_S
    )
    assert budget == TokenBudget(max_tokens=20, reserved_tokens=25)  # 100 - 60 - 15 = 25 left
    # well inside the limit, max_tokens stands
    budget = budget_tokens(
        limits, tokens_today=0, tokens_reserved=0, prompt_tokens=5, max_tokens=30, now_s=BUDGET_NOW_S
    )
    assert budget == TokenBudget(max_tokens=30, reserved_tokens=35)


def test_a_prompt_that_leaves_no_token_to_generate_is_refused_until_midnight() -> None:
    limits = KeyLimits(tokens_per_day=100)
    refusal = budget_tokens(
        limits, tokens_today=80, tokens_reserved=10, prompt_tokens=10, max_tokens=5, now_s=BUDGET_NOW_S
    )
    assert isinstance(refusal, QuotaDecision) and not refusal.admitted
    assert refusal.limit == LIMIT_TOKENS_PER_DAY
    assert "needs at least 11 tokens" in refusal.message and "10 are left" in refusal.message
    assert "10 of them held by requests in flight" in refusal.message
    assert refusal.retry_after_s == next_day_start_s(BUDGET_NOW_S) - BUDGET_NOW_S
    # one more token left is enough for one generated token
    budget = budget_tokens(
        limits, tokens_today=79, tokens_reserved=10, prompt_tokens=10, max_tokens=5, now_s=BUDGET_NOW_S
    )
    assert budget == TokenBudget(max_tokens=1, reserved_tokens=11)


@pytest.mark.parametrize(("prompt", "max_tokens"), [(0, 5), (5, 0), (-1, 5)])
def test_a_budget_of_no_prompt_or_no_tokens_is_a_programming_error(prompt: int, max_tokens: int) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        budget_tokens(
            KeyLimits(),
            tokens_today=0,
            tokens_reserved=0,
            prompt_tokens=prompt,
            max_tokens=max_tokens,
            now_s=BUDGET_NOW_S,
        )


@pytest.mark.parametrize(
    ("completion", "client_left", "charged"),
    [
        (12, False, (30, 12)),  # finished, or the swarm failed after 12 tokens: all of it
        (12, True, (30, 12)),  # the client closed the stream after 12 tokens: what it was sent
        (0, True, (30, 0)),  # the client left during the prefill: the prompt it had computed
        (0, False, (0, 0)),  # the swarm failed before the first token: nothing, as a refusal
    ],
)
def test_what_a_request_is_charged_however_it_ends(completion: int, client_left: bool, charged: tuple) -> None:
    assert charged_tokens(30, completion, client_left=client_left) == charged


def test_negative_counts_are_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        charged_tokens(-1, 0, client_left=False)
