"""agent.core.wire.topk and sampling from top-K: equal to full-row sampling where it promises to be."""

from __future__ import annotations

import numpy as np
import pytest

from agent._proto import swarm_pb2
from agent.core.owner.sampling import SamplingParams, sample_token
from agent.core.relay.openai_api import token_logprobs
from agent.core.wire.step_results import result_scores, step_result
from agent.core.wire.topk import DEFAULT_RESULT_TOP_K, TopLogits, log_sum_exp, result_top_k, select_top_k

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def _rows(seed: int, n: int = 2000) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    rows = [rng.normal(0, 3, n).astype(np.float32) for _ in range(5)]
    tied = np.zeros(n, dtype=np.float32)  # ties everywhere: the lowest ids must win
    tied[[5, 17, 900, 1999]] = 2.0
    rows.append(tied)
    coarse = np.round(rng.normal(0, 2, n)).astype(np.float32)  # many ties across the K-th
    rows.append(coarse)
    return rows


def test_select_top_k_orders_and_breaks_ties_by_id() -> None:
    row = np.array([1, 3, 3, 0, 3, 2], dtype=np.float32)
    ids, logits, lse = select_top_k(row, 2)
    assert ids.tolist() == [1, 2] and logits.tolist() == [3, 3]
    assert lse == pytest.approx(np.log(np.exp(row.astype(np.float64)).sum()))
    assert select_top_k(row, 10)[0].tolist() == [1, 2, 4, 5, 0, 3]


def test_result_top_k() -> None:
    assert result_top_k(0.0, 0) == DEFAULT_RESULT_TOP_K  # greedy
    assert result_top_k(0.8, 100) == 100
    assert result_top_k(0.8, 5) == DEFAULT_RESULT_TOP_K
    assert result_top_k(0.8, 0) == 0  # no top-k cut: the full row
    assert result_top_k(0.0, 0, at_least=64) == 64


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_and_seeded_top_k_equal_full_row_sampling(seed: int) -> None:
    K = DEFAULT_RESULT_TOP_K
    for row in _rows(seed):
        top = TopLogits.from_row(row, K)
        top.check()
        assert sample_token(top, SamplingParams(), None) == sample_token(row, SamplingParams(), None)
        for params in (
            SamplingParams(temperature=0.7, top_k=K),
            SamplingParams(temperature=1.3, top_k=7),
            SamplingParams(temperature=1.0, top_k=1),
            SamplingParams(temperature=0.9, top_k=20, top_p=0.8),
        ):
            for draw_seed in range(20):
                full = sample_token(row, params, np.random.default_rng(draw_seed))
                from_top = sample_token(top, params, np.random.default_rng(draw_seed))
                assert full == from_top, (params, draw_seed)


def test_top_k_refuses_what_it_cannot_answer_exactly() -> None:
    row = np.random.default_rng(3).normal(size=500).astype(np.float32)
    top = TopLogits.from_row(row, 10)
    with pytest.raises(ValueError, match="needs the full row"):
        sample_token(top, SamplingParams(temperature=1.0), np.random.default_rng(0))
    with pytest.raises(ValueError, match="top_k 11 needs at least 11"):
        sample_token(top, SamplingParams(temperature=1.0, top_k=11), np.random.default_rng(0))
    with pytest.raises(ValueError, match="not among the top 10"):
        top.logprob(int(np.argmin(row)))


def test_logprobs_from_top_k_equal_the_full_row_within_k() -> None:
    row = np.random.default_rng(4).normal(0, 4, 3000).astype(np.float32)
    top = TopLogits.from_row(row, 40)
    chosen = int(top.ids[3])
    full_lp, full_top = token_logprobs(row, chosen, 20)
    top_lp, top_top = token_logprobs(top, chosen, 20)
    assert top_lp == pytest.approx(full_lp, abs=1e-9)
    assert [t for t, _ in top_top] == [t for t, _ in full_top]
    assert np.allclose([lp for _, lp in top_top], [lp for _, lp in full_top], atol=1e-9)
    assert top.log_sum_exp == pytest.approx(log_sum_exp(row))


def _result(row: np.ndarray, k: int) -> swarm_pb2.StepResult:
    parsed = swarm_pb2.StepResult()
    parsed.ParseFromString(step_result(b"s" * 16, 1, row, swarm_pb2.SignedAdmission(), k).SerializeToString())
    return parsed


def test_step_result_carries_top_k_and_is_checked() -> None:
    row = np.random.default_rng(5).normal(size=1000).astype(np.float32)
    result = _result(row, 40)
    assert not result.logits and len(result.top_token_ids) == 160 and result.n_vocab == 1000
    scores = result_scores(result)
    assert isinstance(scores, TopLogits) and scores.k == 40
    assert np.array_equal(scores.ids, select_top_k(row, 40)[0])
    full = result_scores(_result(row, 0))
    assert isinstance(full, np.ndarray) and np.array_equal(full, row)
    assert isinstance(result_scores(_result(row, 1000)), np.ndarray)  # K covering the row: the row

    tampered = _result(row, 40)
    tampered.top_logits = tampered.top_logits[:-4] + b"\x00\x00\x80\x7f"  # +inf
    with pytest.raises(ValueError, match="checksum"):
        result_scores(tampered)
    unordered = _result(row, 40)
    ids = np.frombuffer(unordered.top_token_ids, dtype="<i4")[::-1].copy()
    logits = np.frombuffer(unordered.top_logits, dtype="<f4")[::-1].copy()
    unordered.top_token_ids, unordered.top_logits = ids.tobytes(), logits.tobytes()
    from agent.core.wire.swarm_wire import crc32

    unordered.checksum = crc32(unordered.top_token_ids + unordered.top_logits)
    with pytest.raises(ValueError, match="not ordered"):
        result_scores(unordered)
