"""The pure parts of ``bench/hop_floor.py``: the split cost per hop, the summary's floor
against the target, and the markdown. No processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH_DIR))

import hop_floor  # noqa: E402

pytestmark = pytest.mark.timeout(30)


def _rep(whole_ms: float, split_ms: float, difference_ms: float) -> dict:
    return {"whole_decode_ms": whole_ms, "split_decode_ms": split_ms, "difference_ms_median": difference_ms}


def _report(reps: list[dict], unix_us: list[float], tcp_us: list[float], *, equal: bool = True) -> dict:
    return {
        "machine": {"cpu_model": "AMD EPYC", "cores": 2, "platform": "Linux"},
        "method": {"model": "m.gguf", "n_layer": 30, "ranges": [(0, 10), (10, 20), (20, 30)], "reps": len(reps),
                   "steps": 64, "boundary_bytes": 2304, "top_k_equal": equal},  # fmt: skip
        "summary": hop_floor.summarize(reps, {"unix": unix_us, "tcp": tcp_us}),
        "baton_per_hop_ms": 2.09,
    }


def test_summary_spreads_each_reps_step_difference_over_the_hops_and_adds_one_tcp_message() -> None:
    reps = [_rep(15.0, 15.3, 0.3), _rep(16.0, 16.9, 0.9), _rep(14.0, 13.9, -0.3)]
    summary = hop_floor.summarize(reps, {"unix": [10.0, 12.0, 11.0], "tcp": [20.0, 18.0, 40.0]})
    assert summary["split_cost_per_hop_ms"] == pytest.approx([0.1, 0.3, -0.1])
    assert summary["split_cost_per_hop_ms_median"] == pytest.approx(0.1)
    assert summary["whole_ms_median"] == pytest.approx(15.0) and summary["split_ms_median"] == pytest.approx(15.3)
    assert summary["one_way_message_ms"] == pytest.approx({"unix": 0.011, "tcp": 0.020})
    assert summary["floor_per_hop_ms"] == pytest.approx(0.12)
    assert summary["floor_under_target"] is True
    costly = hop_floor.summarize([_rep(15.0, 16.2, 1.2)], {"unix": [10.0], "tcp": [20.0]})
    assert costly["floor_per_hop_ms"] == pytest.approx(0.42) and costly["floor_under_target"] is False


def test_markdown_gives_the_floor_the_target_and_what_it_means() -> None:
    text = hop_floor.markdown(_report([_rep(15.0, 15.3, 0.3)], [11.0], [20.0]))
    assert "| **floor per hop** (cutting + one TCP message) | **0.120** |" in text
    assert "| issue 8's target | 0.300 |" in text
    assert "| Baton's per-hop overhead in `bench/results/compare.json` (its run, not this one) | 2.090 |" in text
    assert "top-40 equal to the whole model's at every step: yes" in text
    assert "the target is within reach of a hop with no Python in it" in text
    above = hop_floor.markdown(_report([_rep(15.0, 16.2, 1.2)], [11.0], [20.0], equal=False))
    assert "the target is below even a hop with no Python in it" in above
    assert "at every step: **no**" in above
