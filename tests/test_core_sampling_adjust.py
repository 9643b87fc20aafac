"""agent.core.owner.sampling: penalties, logit_bias and min_p, and where such draws happen."""

from __future__ import annotations

import numpy as np
import pytest

from agent.core.owner.sampling import (
    SamplingParams,
    adjust_logits,
    adjusts_logits,
    choose_token,
    draw_token,
    draw_uniform,
    draws_at_owner,
    result_top_k_for,
    sample_token,
    sampling_candidates,
)
from agent.core.wire.topk import DEFAULT_RESULT_TOP_K, TopLogits

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_logit_bias_is_added_and_lifts_a_token_from_outside_any_top_k() -> None:
    row = np.linspace(5.0, -5.0, 1000).astype(np.float32)  # token 0 most likely, 999 least
    params = SamplingParams(logit_bias=((999, 100.0), (0, -100.0)))
    out = adjust_logits(row, params, [1, 2], 2)
    assert out[999] == pytest.approx(95.0) and out[0] == pytest.approx(-95.0) and out[5] == row[5]
    assert choose_token(row, params, 0.0) == 999  # greedy over the adjusted row
    assert row[999] == np.float32(-5.0)  # the caller's row is left as it was
    with pytest.raises(ValueError, match="full logits row"):
        choose_token(TopLogits.from_row(row, 40), params, 0.0)
    with pytest.raises(ValueError, match="outside a row"):
        adjust_logits(row, SamplingParams(logit_bias=((1000, 1.0),)), [], 0)


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits_over_the_last_n() -> None:
    row = np.array([2.0, -2.0, 4.0, 1.0], dtype=np.float32)
    params = SamplingParams(repeat_penalty=2.0, repeat_last_n=3)
    # context 3, 0, 1, 1: the last three are 0, 1, 1 (token 3 is outside the window)
    out = adjust_logits(row, params, [3, 0, 1, 1], 4)
    assert out.tolist() == [1.0, -4.0, 4.0, 1.0]
    everything = adjust_logits(row, SamplingParams(repeat_penalty=2.0, repeat_last_n=-1), [3, 0], 2)
    assert everything.tolist() == [1.0, -2.0, 4.0, 0.5]
    assert not adjusts_logits(SamplingParams(repeat_penalty=2.0, repeat_last_n=0))


def test_frequency_and_presence_penalties_count_generated_tokens_only() -> None:
    row = np.zeros(5, dtype=np.float32)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    # prompt 4, 4 | generated 1, 1, 1, 2
    out = adjust_logits(row, params, [4, 4, 1, 1, 1, 2], 2)
    assert out.tolist() == [0.0, -2.5, -1.5, 0.0, 0.0]
    negative = adjust_logits(row, SamplingParams(presence_penalty=-2.0), [3], 0)
    assert negative[3] == 2.0


def test_adjusting_sessions_ask_for_the_full_row_and_the_others_for_the_top_k() -> None:
    plain = SamplingParams(temperature=0.0)
    assert not adjusts_logits(plain) and result_top_k_for(plain) == DEFAULT_RESULT_TOP_K
    assert result_top_k_for(SamplingParams(temperature=0.7, top_k=40)) == max(40, DEFAULT_RESULT_TOP_K)
    assert result_top_k_for(SamplingParams(temperature=1.0)) == 0  # no top-k cut: the row, as before
    for adjusted in (
        SamplingParams(logit_bias=((3, -1.0),)),
        SamplingParams(presence_penalty=0.1),
        SamplingParams(frequency_penalty=-0.1),
        SamplingParams(repeat_penalty=1.1),
    ):
        assert adjusts_logits(adjusted) and result_top_k_for(adjusted, at_least=20) == 0
    assert not adjusts_logits(SamplingParams(min_p=0.2))  # a cut of the candidates, as top_p
    assert draws_at_owner(SamplingParams(temperature=1.0, min_p=0.2))  # but no last hop makes it
    assert draws_at_owner(SamplingParams(presence_penalty=0.1))
    assert not draws_at_owner(SamplingParams(temperature=0.7, top_k=40, top_p=0.9))


def test_min_p_keeps_tokens_with_at_least_that_share_of_the_peak_probability() -> None:
    row = np.log(np.array([0.5, 0.3, 0.1, 0.06, 0.04])).astype(np.float32)
    ids, probs = sampling_candidates(row, SamplingParams(temperature=1.0, min_p=0.15))
    assert ids.tolist() == [0, 1, 2]  # 0.1 >= 0.15 * 0.5 = 0.075 > 0.06
    assert probs.sum() == pytest.approx(1.0) and probs[0] == pytest.approx(0.5 / 0.9, rel=1e-5)
    top = TopLogits.from_row(row, 5)
    assert sampling_candidates(top, SamplingParams(temperature=1.0, top_k=5, min_p=0.15))[0].tolist() == [0, 1, 2]
    # the full-row draw (no top-k cut) never picks below the cut, and matches the candidates' odds
    rng = np.random.default_rng(5)
    draws = [sample_token(row, SamplingParams(temperature=1.0, min_p=0.15), rng) for _ in range(3000)]
    counts = np.bincount(draws, minlength=5)
    assert counts[3] == counts[4] == 0
    assert counts[0] / 3000 == pytest.approx(0.5 / 0.9, abs=0.04)
    assert sample_token(row, SamplingParams(temperature=1.0, min_p=1.0), rng) == 0


def test_adjusted_draws_take_their_positions_uniform_and_a_seed_repeats_them() -> None:
    row = np.random.default_rng(1).normal(size=200).astype(np.float32)
    params = SamplingParams(temperature=0.8, top_p=0.9, presence_penalty=0.7, logit_bias=((3, 2.0),))

    def run(seed: int) -> list[int]:
        tokens = [9, 9]
        for _ in range(12):
            tokens.append(choose_token(row, params, draw_uniform(seed, len(tokens)), tokens, 2))
        return tokens[2:]

    first = run(11)
    assert first == run(11) != run(12)
    assert len(set(first)) > 1
    # the same uniform as an unadjusted draw of the adjusted row: only the logits change
    tokens = [9, 9, *first[:5]]
    adjusted = adjust_logits(row, params, tokens, 2)
    unadjusted_params = SamplingParams(temperature=0.8, top_p=0.9)
    assert choose_token(row, params, draw_uniform(11, 7), tokens, 2) == draw_token(
        adjusted, unadjusted_params, draw_uniform(11, 7)
    )
