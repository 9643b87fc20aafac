"""GreedyGeneration: rows per step, token choice, stopping. Pure, no processes."""

from __future__ import annotations

import numpy as np
import pytest

from agent.core.owner.generation import GreedyGeneration
from agent.core.owner.parity import greedy_token
from agent.core.wire.worker_records import SeqOutput

pytestmark = pytest.mark.unit


def logits_output(seq_id: int, best: int, n_vocab: int = 8) -> SeqOutput:
    row = np.zeros((1, n_vocab), dtype=np.float32)
    row[0, best] = 1.0
    return SeqOutput(seq_id=seq_id, boundary=None, logits=row, logit_rows=(0,), next_position=0)


def test_prefill_sends_the_prompt_then_one_token_per_step() -> None:
    gen = GreedyGeneration(3, [5, 6, 7], max_new_tokens=3)
    first = gen.next_input()
    assert (first.seq_id, list(first.positions), list(first.token_ids)) == (3, [0, 1, 2], [5, 6, 7])
    assert gen.accept(logits_output(3, best=4)) == 4
    second = gen.next_input()
    assert (list(second.positions), list(second.token_ids)) == ([3], [4])
    gen.accept(logits_output(3, best=2))
    gen.accept(logits_output(3, best=1))
    assert gen.generated == [4, 2, 1]
    assert gen.finished
    with pytest.raises(ValueError, match="finished"):
        gen.next_input()


def test_a_stop_token_ends_generation_and_is_kept() -> None:
    gen = GreedyGeneration(0, [1], max_new_tokens=10, stop_tokens=[7])
    gen.accept(logits_output(0, best=3))
    assert not gen.finished
    gen.accept(logits_output(0, best=7))
    assert gen.finished and gen.stopped_by_token
    assert gen.generated == [3, 7]


def test_the_last_row_of_the_output_decides() -> None:
    gen = GreedyGeneration(0, [1, 2], max_new_tokens=2)
    rows = np.zeros((2, 4), dtype=np.float32)
    rows[0, 1] = 1.0  # an earlier row that must not be used
    rows[1, 3] = 1.0
    assert gen.accept(SeqOutput(seq_id=0, boundary=None, logits=rows, logit_rows=(0, 1), next_position=2)) == 3


@pytest.mark.parametrize(
    ("output", "message"),
    [
        (
            SeqOutput(seq_id=1, boundary=None, logits=np.ones((1, 4), np.float32), logit_rows=(0,), next_position=1),
            "seq 1",
        ),
        (
            SeqOutput(seq_id=0, boundary=np.ones((1, 4), np.float32), logits=None, logit_rows=(), next_position=1),
            "no logits",
        ),
    ],
)
def test_outputs_that_do_not_answer_are_refused(output: SeqOutput, message: str) -> None:
    gen = GreedyGeneration(0, [1], max_new_tokens=2)
    with pytest.raises(ValueError, match=message):
        gen.accept(output)
    assert gen.generated == []


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="no tokens"):
        GreedyGeneration(0, [], max_new_tokens=1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        GreedyGeneration(0, [1], max_new_tokens=0)


def test_top_k_asks_the_last_range_for_it_and_takes_its_first_entry() -> None:
    from agent.core.wire.topk import TopLogits

    gen = GreedyGeneration(0, [1, 2], 2, top_k=40)
    assert gen.next_input().top_k == 40
    row = np.array([0.5, 3.0, 3.0, -1.0], np.float32)  # a tie: the lowest id wins, as greedy_token
    top = (TopLogits.from_row(row, 3),)
    out = SeqOutput(seq_id=0, boundary=None, logits=None, logit_rows=(1,), next_position=2, top=top)
    assert gen.accept(out) == 1 == greedy_token(row)
    assert GreedyGeneration(0, [1], 1).next_input().top_k == 0
