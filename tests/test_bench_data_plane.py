"""The pure parts of ``bench/data_plane.py``: the per-hop overhead paired step by step, the
workers' accounts per decode step, and the "Where the time goes" table. No processes."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH_DIR))

import data_plane  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

RANGES = [(0, 10), (10, 20), (20, 30)]


def _rep(unsplit: list[float], dp1: list[float], dp3: list[float], chain: list[float]) -> dict:
    one = [{"compute_ms": 10.0, "in_worker_ms": 10.2, "own_ms": 0.2}]
    three = [{"compute_ms": 3.5, "in_worker_ms": 3.6, "own_ms": 0.1}] * 2 + [
        {"compute_ms": 3.4, "in_worker_ms": 3.6, "own_ms": 0.2}
    ]
    return {
        "step_ms": {"worker_unsplit": unsplit, "data_plane_1": dp1, "data_plane_3": dp3, "chain_3": chain},
        "tokens": [1, 2, 3],
        "workers": {"data_plane_1": one, "data_plane_3": three},
    }


def test_the_per_hop_overhead_is_paired_within_each_step() -> None:
    # the machine's speed moves between steps (step 2 is 5 ms slower for everyone): pairing cancels it
    rep = _rep([10.0, 15.0, 10.0], [10.1, 15.1, 10.1], [10.8, 15.8, 10.5], [12.0, 17.0, 12.0])
    s = data_plane.summary([rep, rep, rep], [9.0, 10.0, 11.0])
    assert s["per_hop_ms"] == pytest.approx(0.8 / 3) and s["per_hop_ms_by_rep"] == pytest.approx([0.8 / 3] * 3)
    assert s["per_hop_python_chain_ms"] == pytest.approx(2 / 3)
    assert s["data_plane_own_ms"] == pytest.approx(0.1)
    assert s["per_hop_vs_data_plane_1_ms"] == pytest.approx(0.7 / 3)
    assert s["step_ms"]["data_plane_3"] == pytest.approx(10.8) and s["mean_step_ms"]["data_plane_3"] == pytest.approx(
        37.1 / 3
    )
    assert s["split_vs_llama_bench"] == pytest.approx(10.0 / 10.8)
    assert s["hop_target_met"] is True and s["split_target_met"] is True
    slow = data_plane.summary([_rep([10.0], [10.1], [12.0], [12.0])], [10.0])
    assert slow["per_hop_ms"] == pytest.approx(2 / 3) and slow["hop_target_met"] is False


def test_a_workers_account_is_per_decode_step() -> None:
    totals = [types.SimpleNamespace(compute_us=30_000, in_worker_us=33_000, steps=10)]
    assert data_plane.worker_profile(totals) == [
        {"compute_ms": pytest.approx(3.0), "in_worker_ms": pytest.approx(3.3), "own_ms": pytest.approx(0.3)}
    ]


def test_where_the_time_goes_adds_up_to_the_step() -> None:
    rep = _rep([10.0], [10.5], [11.4], [12.0])
    lines = data_plane.profile_lines(data_plane.summary([rep], [10.0]), RANGES)
    text = "\n".join(lines)
    assert "| the step, as the owner sees it | 10.500 | 11.400 |" in text
    assert "| worker 1 [0, 10): its Forward | 10.000 (the whole model) | 3.500 |" in text
    assert "| worker 3 [20, 30): its Forward | | 3.400 |" in text
    # outside the workers = step - the workers' time: 10.5 - 10.2 and 11.4 - 10.8
    assert (
        "| outside the workers: the owner's Python, the sends and messages, waking the processes | 0.300 | 0.600 |"
        in text
    )
    # per hop: (11.4 - 10.5) / 3 = 0.3 = cutting (10.4 - 10.0) / 3 + own (0.4 - 0.2) / 3 + outside (0.3) / 3
    assert "0.300 ms = cutting the model (more, smaller Forwards) 0.133" in text
    assert "the workers' own handling 0.067" in text and "wake-ups of the processes that take them) 0.100" in text
