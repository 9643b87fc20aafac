"""The last range's top-K selected in llama.cpp's graph (``--top-k-in-graph on``, patch 0010)
against the host path, on real models and the CPU backend: the in-graph worker's ids and
logits are ``select_top_k`` of the full row the host-path worker returns, bit for bit (ids:
but where the K-th value is tied past K, which ``ggml_top_k`` breaks as it likes), and its
log-sum-exp is within ``WORKER_GRAPH_LOG_SUM_EXP_BOUND`` of the row's; for prefill rows of
several sequences at different K, then batched decode steps of several sequences.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from agent.core.wire.topk import WORKER_GRAPH_LOG_SUM_EXP_BOUND, select_top_k
from agent.core.wire.worker_records import SeqInput, SeqOutput
from agent.io.worker.process import open_worker

pytestmark = pytest.mark.worker

PROMPTS = (
    [1, 504, 3458, 282, 2151, 28, 355, 1690],
    [1, 2000, 17, 906, 44, 3, 77, 1300, 250, 9],
    [1, 42, 4242, 12, 5],
)
PREFILL_TOP_K = (40, 5, 1)
DECODE_TOP_K = (1, 40, 1000, 40)


def check_row(got_ids: np.ndarray, got_logits: np.ndarray, got_lse: float, row: np.ndarray, k: int) -> bool:
    """Asserts the in-graph selection against ``select_top_k(row)``; True if the K-th value was
    tied past K (then ids of that value may differ)."""
    ids, logits, lse = select_top_k(row, min(k + 1, row.size))
    tie_past_k = ids.size > k and logits[k] == logits[k - 1]
    ids, logits = ids[:k], logits[:k]
    assert np.array_equal(got_logits.view(np.int32), logits.view(np.int32))  # bit for bit
    same = got_ids == ids
    assert np.all(same | (tie_past_k & (logits == logits[k - 1]))), (got_ids, ids)
    assert abs(got_lse - lse) <= WORKER_GRAPH_LOG_SUM_EXP_BOUND, (got_lse, lse)
    return bool(tie_past_k)


def full_rows(out: SeqOutput) -> np.ndarray:
    assert out.logits is not None
    return out.logits


async def compare_graph_with_host(model: Path) -> tuple[int, float]:
    """Rows compared and the largest |lse difference|."""
    async with (
        open_worker(
            model, 0, None, threads=1, ctx_size=64, max_sequences=4, extra_args=("--top-k-in-graph", "off")
        ) as host,
        open_worker(
            model, 0, None, threads=1, ctx_size=64, max_sequences=4, extra_args=("--top-k-in-graph", "on")
        ) as graph,
    ):
        n_vocab = host.info.n_vocab
        rows = [[0, len(p) // 2, len(p) - 1] for p in PROMPTS]
        full = await host.client.forward(
            [SeqInput(s, range(len(p)), token_ids=p, logit_rows=rows[s]) for s, p in enumerate(PROMPTS)]
        )
        top = await graph.client.forward(
            [
                SeqInput(s, range(len(p)), token_ids=p, logit_rows=rows[s], top_k=PREFILL_TOP_K[s])
                for s, p in enumerate(PROMPTS)
            ]
        )
        compared, worst = 0, 0.0
        for s in range(len(PROMPTS)):
            assert top[s].logits is None and len(top[s].top) == len(rows[s])
            for r, got in enumerate(top[s].top):
                assert got.k == PREFILL_TOP_K[s] and got.n_vocab == n_vocab
                check_row(got.ids, got.logits, got.log_sum_exp, full_rows(full[s])[r], got.k)
                worst = max(worst, abs(got.log_sum_exp - select_top_k(full_rows(full[s])[r], 1)[2]))
                compared += 1
        next_pos = [len(p) for p in PROMPTS]
        tokens = [int(full_rows(full[s])[-1].argmax()) for s in range(len(PROMPTS))]
        for k in DECODE_TOP_K:
            steps = [SeqInput(s, [next_pos[s]], token_ids=[tokens[s]]) for s in range(len(PROMPTS))]
            full = await host.client.forward(steps)
            top = await graph.client.forward([SeqInput(x.seq_id, x.positions, x.token_ids, top_k=k) for x in steps])
            for s in range(len(PROMPTS)):
                got = top[s].top[0]
                assert got.k == k
                check_row(got.ids, got.logits, got.log_sum_exp, full_rows(full[s])[0], k)
                worst = max(worst, abs(got.log_sum_exp - select_top_k(full_rows(full[s])[0], 1)[2]))
                compared += 1
                tokens[s], next_pos[s] = int(got.ids[0]), next_pos[s] + 1
        # an entry asking for the full row: no selection in the graph for that Forward
        mixed = await graph.client.forward(
            [
                SeqInput(0, [next_pos[0]], token_ids=[tokens[0]]),
                SeqInput(1, [next_pos[1]], token_ids=[tokens[1]], top_k=3),
            ]
        )
        assert full_rows(mixed[0]).shape == (1, n_vocab) and mixed[1].top[0].k == 3
        return compared, worst


@pytest.mark.slow
@pytest.mark.parametrize("model_fixture", ["smollm2_path", "gemma3_path"])
async def test_in_graph_top_k_equals_the_host_path(model_fixture: str, request: pytest.FixtureRequest) -> None:
    compared, worst = await compare_graph_with_host(request.getfixturevalue(model_fixture))
    assert compared == 3 * len(PROMPTS) + len(DECODE_TOP_K) * len(PROMPTS)
    print(f"{model_fixture}: {compared} rows, max |lse difference| {worst:.3g}")
