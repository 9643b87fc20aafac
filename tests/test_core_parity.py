"""Unit tests of the parity core (agent.core.owner.parity): comparisons, the run state machine,
scenarios and the report. Fake logits stand in for workers."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from agent.core.owner.parity import (
    Edit,
    ParityError,
    ParityReport,
    ParityRun,
    Scenario,
    build_prompts,
    greedy_token,
    greedy_tokens,
    max_abs_diff,
    next_hop_entries,
    prompt_lengths,
)
from agent.core.wire.ranges import LayerRange, ranges_from_cuts
from agent.core.wire.worker_records import SeqInput, SeqOutput

pytestmark = pytest.mark.unit

VOCAB = 16


def one_hot(token: int, scale: float = 1.0) -> np.ndarray:
    row = np.zeros(VOCAB, dtype=np.float32)
    row[token] = scale
    return row


# --- comparisons ---------------------------------------------------------------------------


def test_max_abs_diff() -> None:
    a = np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32)
    b = np.array([[1.0, 2.5], [2.0, 4.0]], dtype=np.float32)
    assert max_abs_diff(a, b) == 1.0
    assert max_abs_diff(a, a) == 0.0
    assert max_abs_diff(np.zeros((0, 3)), np.zeros((0, 3))) == 0.0
    assert isinstance(max_abs_diff(a, b), float)


def test_max_abs_diff_nan_is_never_close() -> None:
    a = np.array([1.0, np.nan])
    assert max_abs_diff(a, a) == math.inf
    assert max_abs_diff(np.array([1.0, 2.0]), a) == math.inf


def test_max_abs_diff_does_not_overflow_in_f32() -> None:
    big = np.float32(3e38)
    assert max_abs_diff(np.array([big]), np.array([-big])) == pytest.approx(6e38)


def test_max_abs_diff_rejects_shape_mismatch() -> None:
    with pytest.raises(ValueError, match=r"cannot compare shapes \(2,\) and \(3,\)"):
        max_abs_diff(np.zeros(2), np.zeros(3))


def test_greedy() -> None:
    assert greedy_token(np.array([0.1, 0.7, 0.2])) == 1
    assert greedy_token(np.array([0.5, 0.5, 0.1])) == 0  # lowest index on ties
    assert greedy_tokens(np.array([[0.0, 1.0], [2.0, 1.0]])) == [1, 0]
    with pytest.raises(ValueError, match="one non-empty logits row"):
        greedy_token(np.zeros((2, 2)))
    with pytest.raises(ValueError, match=r"\[n_rows, n_vocab\]"):
        greedy_tokens(np.zeros(3))


# --- prompts -------------------------------------------------------------------------------


def test_prompt_lengths_differ_and_decrease() -> None:
    assert prompt_lengths(1, 40) == [40]
    assert prompt_lengths(4, 40) == [40, 34, 28, 22]
    assert prompt_lengths(3, 2) == [2, 1, 1]
    with pytest.raises(ValueError, match="sequences must be >= 1"):
        prompt_lengths(0, 40)
    with pytest.raises(ValueError, match="prompt_tokens must be >= 1"):
        prompt_lengths(2, 0)


def test_build_prompts_repeats_body_after_prefix() -> None:
    prompts = build_prompts([1], [10, 11, 12, 13], [7, 3])
    assert prompts[0] == [1, 10, 11, 12, 13, 10, 11]
    assert prompts[1] == [1, 13, 10]  # sequence 1 starts 3 tokens into the body
    assert build_prompts([], [5, 6], [3]) == [[5, 6, 5]]
    assert build_prompts([1, 2], [5], [1]) == [[1]]  # the prefix is cut too
    with pytest.raises(ValueError, match="no tokens"):
        build_prompts([1], [], [3])
    with pytest.raises(ValueError, match="prompt length 0 of sequence 0"):
        build_prompts([1], [5], [0])


# --- chaining ------------------------------------------------------------------------------


def test_next_hop_entries_carries_boundary_with_same_positions() -> None:
    inputs = [SeqInput(0, [0, 1], token_ids=[5, 6], logit_rows=[1]), SeqInput(3, [7], token_ids=[9])]
    b0 = np.ones((2, 4), dtype=np.float32)
    b3 = np.full((1, 4), 2.0, dtype=np.float32)
    outputs = [SeqOutput(0, b0, None, (), 2), SeqOutput(3, b3, None, (), 8)]
    entries = next_hop_entries(inputs, outputs)
    assert [e.seq_id for e in entries] == [0, 3]
    assert entries[0].positions == [0, 1] and entries[1].positions == [7]
    assert entries[0].token_ids is None and entries[0].boundary is b0
    assert entries[0].logit_rows == [1]
    entries[0].check()


def test_next_hop_entries_refuses_mismatches() -> None:
    inputs = [SeqInput(0, [0, 1], token_ids=[5, 6])]
    rows = np.ones((2, 4), dtype=np.float32)
    with pytest.raises(ParityError, match="1 entries sent but 0 returned"):
        next_hop_entries(inputs, [])
    with pytest.raises(ParityError, match="entry for seq 0 answered as seq 1"):
        next_hop_entries(inputs, [SeqOutput(1, rows, None, (), 2)])
    with pytest.raises(ParityError, match="returned no boundary rows"):
        next_hop_entries(inputs, [SeqOutput(0, None, rows, (), 2)])
    with pytest.raises(ParityError, match="sent 2 rows, got 1 boundary rows"):
        next_hop_entries(inputs, [SeqOutput(0, rows[:1], None, (), 2)])


def test_seq_input_check() -> None:
    with pytest.raises(ValueError, match="exactly one of token_ids or boundary"):
        SeqInput(0, [0]).check()
    with pytest.raises(ValueError, match="exactly one of token_ids or boundary"):
        SeqInput(0, [0], token_ids=[1], boundary=np.zeros((1, 4), np.float32)).check()
    with pytest.raises(ValueError, match="seq 2: 2 token ids but 1 positions"):
        SeqInput(2, [0], token_ids=[1, 2]).check()
    with pytest.raises(ValueError, match="seq 2: 3 boundary rows but 1 positions"):
        SeqInput(2, [0], boundary=np.zeros((3, 4), np.float32)).check()


# --- the run state machine -----------------------------------------------------------------


def drive(run: ParityRun, reference, candidate=None, log=None) -> None:
    """Play a whole run against fake workers: ``reference(step, seq_id, entry)`` gives the
    reference logits row; ``candidate`` (default: the same) the candidate's."""
    candidate = candidate or reference
    while not run.finished:
        entries = run.batch()
        if log is not None:
            log.append(("batch", run.step, [(e.seq_id, list(e.positions), list(e.token_ids)) for e in entries]))
        step = run.step
        run.record(
            {e.seq_id: reference(step, e.seq_id, e) for e in entries},
            {e.seq_id: candidate(step, e.seq_id, e) for e in entries},
        )
        edit = run.pending_edit()
        if edit is not None:
            if log is not None:
                log.append(("edit", edit))
            run.apply_edit(edit)


def test_run_batches_prefill_then_one_token_per_step() -> None:
    run = ParityRun([[1, 2, 3], [4, 5]], steps=2)
    log: list = []
    drive(run, lambda step, seq, e: one_hot((step + seq + 7) % VOCAB), log=log)
    assert log == [
        ("batch", 0, [(0, [0, 1, 2], [1, 2, 3]), (1, [0, 1], [4, 5])]),
        ("batch", 1, [(0, [3], [7]), (1, [2], [8])]),
        ("batch", 2, [(0, [4], [8]), (1, [3], [9])]),
    ]
    report = run.report(ranges_from_cuts(4, [2]))
    assert report.tokens == [[7, 8, 9], [8, 9, 10]]
    assert report.tokens_equal and report.max_abs_diff == 0.0 and report.passed
    assert report.prompt_lengths == [3, 2]
    assert report.step_max_abs_diff == [0.0, 0.0, 0.0]


def test_batch_asks_logits_of_the_last_row_only() -> None:
    run = ParityRun([[1, 2, 3]], steps=1)
    (entry,) = run.batch()
    assert entry.logit_rows == [2]


def test_reference_tokens_are_fed_even_when_candidate_disagrees() -> None:
    run = ParityRun([[1, 2]], steps=3)
    log: list = []
    drive(
        run,
        reference=lambda step, seq, e: one_hot(5),
        candidate=lambda step, seq, e: one_hot(6 if step == 1 else 5, 0.5),
        log=log,
    )
    fed = [entry[2][0][2] for entry in log]
    assert fed == [[1, 2], [5], [5], [5]]
    report = run.report([LayerRange(0, 1), LayerRange(1, 2)])
    assert not report.tokens_equal
    assert report.mismatch_count == 1
    assert report.mismatches == [{"step": 1, "seq_id": 0, "reference": 5, "candidate": 6}]
    assert report.max_abs_diff == 1.0
    assert not report.passed


def test_small_differences_are_measured_but_tokens_equal() -> None:
    run = ParityRun([[1]], steps=1, tolerance=1e-3)
    drive(run, lambda s, q, e: one_hot(3), lambda s, q, e: one_hot(3) + np.float32(5e-4))
    report = run.report([LayerRange(0, 2)])
    assert report.tokens_equal
    assert report.max_abs_diff == pytest.approx(5e-4, rel=1e-3)
    assert report.passed
    report.tolerance = 1e-4
    assert not report.passed


def test_scenario_removes_and_trims_then_refeeds_history() -> None:
    scenario = Scenario(after_step=2, remove_seq=1, trim_seq=2, trim_by=3)
    run = ParityRun([[1, 2, 3, 4], [5, 6, 7], [8, 9]], steps=4, scenario=scenario)
    log: list = []
    drive(run, lambda step, seq, e: one_hot(10 + step), log=log)
    # After steps 0..2, seq 2 holds prompt (2) + 2 fed tokens = 4 positions; trim 3 keeps 1.
    assert log[3] == ("edit", Edit(remove=(1,), trim=((2, 1),)))
    assert log[4] == ("batch", 3, [(0, [6], [12]), (2, [1, 2, 3, 4], [9, 10, 11, 12])])
    assert log[5] == ("batch", 4, [(0, [7], [13]), (2, [5], [13])])
    report = run.report([LayerRange(0, 3)])
    assert report.tokens[0] == [10, 11, 12, 13, 14]
    assert report.tokens[1] == [10, 11, 12]  # removed after step 2
    assert report.tokens[2] == [10, 11, 12, 13, 14]
    assert report.scenario == scenario


def test_pending_edit_happens_once() -> None:
    run = ParityRun([[1], [2]], steps=3, scenario=Scenario(after_step=0, remove_seq=0))
    run.record({0: one_hot(1), 1: one_hot(1)}, {0: one_hot(1), 1: one_hot(1)})
    edit = run.pending_edit()
    assert edit == Edit(remove=(0,))
    run.apply_edit(edit)
    assert run.pending_edit() is None
    assert run.live_seq_ids == [1]
    assert [e.seq_id for e in run.batch()] == [1]


def test_trim_beyond_cache_is_refused() -> None:
    run = ParityRun([[1], [2]], steps=2, scenario=Scenario(after_step=0, trim_seq=1, trim_by=5))
    run.record({0: one_hot(1), 1: one_hot(1)}, {0: one_hot(1), 1: one_hot(1)})
    with pytest.raises(ParityError, match="cannot trim 5 positions off seq 1: it holds 1"):
        run.pending_edit()


@pytest.mark.parametrize(
    ("scenario", "message"),
    [
        (Scenario(after_step=4, remove_seq=0), r"after_step 4 must be in \[0, steps = 4\)"),
        (Scenario(after_step=-1, remove_seq=0), r"after_step -1"),
        (Scenario(after_step=1, remove_seq=2), r"remove_seq 2 is not a sequence of this run \(0..1\)"),
        (Scenario(after_step=1, trim_seq=5, trim_by=1), r"trim_seq 5 is not a sequence"),
        (Scenario(after_step=1, remove_seq=1, trim_seq=1, trim_by=1), r"removes and trims the same sequence 1"),
        (Scenario(after_step=1, trim_seq=1), r"trim_by must be >= 1"),
        (Scenario(after_step=1), r"neither removes nor trims"),
    ],
)
def test_bad_scenarios(scenario: Scenario, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParityRun([[1], [2]], steps=4, scenario=scenario)


def test_bad_run_arguments() -> None:
    with pytest.raises(ValueError, match="at least one prompt"):
        ParityRun([], steps=1)
    with pytest.raises(ValueError, match="steps must be >= 0"):
        ParityRun([[1]], steps=-1)
    with pytest.raises(ValueError, match="at least one token"):
        ParityRun([[1], []], steps=1)


def test_record_refuses_missing_sequences() -> None:
    run = ParityRun([[1], [2]], steps=1)
    with pytest.raises(ParityError, match=r"step 0: logits for sequences \[0\] / \[0, 1\], expected \[0, 1\]"):
        run.record({0: one_hot(1)}, {0: one_hot(1), 1: one_hot(1)})


def test_batch_after_finish_is_refused() -> None:
    run = ParityRun([[1]], steps=0)
    run.record({0: one_hot(1)}, {0: one_hot(1)})
    assert run.finished
    with pytest.raises(ParityError, match="finished"):
        run.batch()


def test_check_outputs() -> None:
    run = ParityRun([[1, 2], [3]], steps=1)
    logits = np.zeros((1, VOCAB), dtype=np.float32)
    good = [SeqOutput(0, None, logits, (1,), 2), SeqOutput(1, None, logits, (0,), 1)]
    rows = run.check_outputs("w", good, logits=True)
    assert sorted(rows) == [0, 1] and rows[0].shape == (VOCAB,)
    assert run.check_outputs("w", good, logits=False) == {}
    with pytest.raises(ParityError, match=r"w: answered sequences \[1, 0\], expected \[0, 1\]"):
        run.check_outputs("w", good[::-1], logits=True)
    stale = [SeqOutput(0, None, logits, (1,), 1), good[1]]
    with pytest.raises(ParityError, match="w: seq 0 holds 1 positions, expected 2"):
        run.check_outputs("w", stale, logits=True)
    boundary_only = [SeqOutput(0, logits, None, (), 2), good[1]]
    with pytest.raises(ParityError, match="w: seq 0 expected one logits row, got None"):
        run.check_outputs("w", boundary_only, logits=True)


# --- the report ----------------------------------------------------------------------------


def test_report_json_keys_and_values() -> None:
    report = ParityReport(
        max_abs_diff=2.5e-5,
        tokens_equal=True,
        ranges=ranges_from_cuts(30, [10, 20]),
        steps=32,
        sequences=2,
        tokens=[[1, 2], [3, 4]],
        text="hi",
        scenario=Scenario(after_step=3, remove_seq=1),
        extras={"architecture": "llama"},
    )
    data = json.loads(json.dumps(report.to_json()))
    assert data["max_abs_diff"] == 2.5e-5
    assert data["tokens_equal"] is True
    assert data["ranges"] == [[0, 10], [10, 20], [20, 30]]
    assert data["steps"] == 32 and data["sequences"] == 2
    assert data["tokens"] == [[1, 2], [3, 4]]
    assert data["passed"] is True
    assert data["text"] == "hi"
    assert data["scenario"] == {"after_step": 3, "remove_seq": 1, "trim_seq": None, "trim_by": 0}
    assert data["architecture"] == "llama"


def test_report_json_non_finite_diff_is_null_and_fails() -> None:
    report = ParityReport(max_abs_diff=math.inf, tokens_equal=True, ranges=[], steps=0, sequences=1, tokens=[[]])
    data = report.to_json()
    assert data["max_abs_diff"] is None
    assert data["passed"] is False
    json.dumps(data, allow_nan=False)
