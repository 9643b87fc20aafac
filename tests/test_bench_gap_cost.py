"""The pure parts of ``bench/gap_cost.py``: the owner's step it times is the owner's real work
(a RESULT taken, the next STEP sealed), and the folding of rounds into ratios. No processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH_DIR))

import gap_cost  # noqa: E402

from agent._proto import worker_pb2  # noqa: E402
from agent.core import data_frames  # noqa: E402

pytestmark = pytest.mark.timeout(30)


def test_the_timed_owner_step_takes_a_result_and_seals_the_next_step() -> None:
    owner = gap_cost.OwnerSteps(3)
    first_key = owner.owner.keys.first_step_key
    for step in range(3):
        frame = owner.step()
        reader = data_frames.DataFrameReader(1 << 20)
        reader.feed(frame)
        sealed = reader.next_frame()
        assert sealed is not None and sealed.kind == data_frames.STEP
        plain = data_frames.open_sealed(first_key, data_frames.STEP, sealed.session_id, sealed.counter, sealed.sealed)
        data_step = worker_pb2.DataStep.FromString(plain)
        # the prompt's 3 tokens, then one token a step at the next position, chosen from the top-40
        assert data_step.step == step + 1 and list(data_step.positions) == [3 + step]
        assert list(data_step.token_ids) == [owner.session.tokens[-1]] and data_step.top_k == gap_cost.TOP_K
    assert len(owner.session.generated) == 3


def _round(scale: float) -> dict:
    return {
        "sleep": {"0.0": 10.0 * scale, "2.0": 20.0 * scale, "4.0": 50.0 * scale},
        "spin": {"2.0": 15.0 * scale, "4.0": 40.0 * scale},  # (no spin of 0: it is the sleep of 0)
    }


def test_rounds_fold_into_medians_and_ratios_to_the_same_rounds_back_to_back_figure() -> None:
    # the second round ran on a machine twice as slow: the ratios do not see it
    folded = gap_cost.summarize([_round(1.0), _round(2.0), _round(1.1)], [_round(1.0)])
    owner = folded["owner_step_us"]
    assert owner["sleep"]["4.0"] == {"value": pytest.approx(55.0), "ratio": pytest.approx(5.0)}
    assert owner["spin"]["4.0"]["ratio"] == pytest.approx(4.0)
    assert owner["spin"]["0.0"] == owner["sleep"]["0.0"] == {"value": pytest.approx(11.0), "ratio": pytest.approx(1.0)}
    report = {
        "machine": {"cpu_model": "cpu", "cores": 2, "platform": "linux", "baton_commit": "abc"},
        "rounds": 3,
        "python_steps": 150,
        "summary": folded,
    }
    text = gap_cost.markdown(report)
    assert "| 4 | 55.0 (5.00x) | 44.0 (4.00x) |" in text
    assert "| 0 | 11.0 (1.00x) | 11.0 (1.00x) |" in text
    # the reading: the Forward's extra time after the longest gap, asleep and spinning
    assert "After a gap of 2 ms, a range's Forward takes +10.000 ms against back to back (+5.000 ms" in text
    assert "after 4 ms, +40.000 ms (+30.000 ms spinning)" in text
    assert "5.00x (4.00x spinning) after 4 ms" in text and "33.3-133.3x issue 8's whole per-hop target" in text
