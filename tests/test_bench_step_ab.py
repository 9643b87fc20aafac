"""The pure parts of ``bench/tools/step_ab.py``: per-side medians, each round's pair, the ratio and
the markdown. No processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH_DIR))

from tools import step_ab  # noqa: E402

pytestmark = [pytest.mark.worker, pytest.mark.timeout(30)]


def _run(step_ms: float, tokens_per_s: float, nodes_ms: float) -> dict:
    return {"step_ms": step_ms, "tokens_per_s": tokens_per_s, "cpu_ms_per_token": {"node agents (Python)": nodes_ms}}


def test_summary_takes_medians_per_side_and_counts_the_rounds_head_was_ahead() -> None:
    runs = {
        "base": [[_run(20, 50, 6), _run(22, 45, 6.4)], [_run(30, 33, 8), _run(31, 32, 8.2)]],
        # ahead in round 1 on both figures; in round 2 a shorter step but fewer tokens/s
        "head": [[_run(19, 52, 5), _run(20, 50, 5.2)], [_run(29, 30, 7), _run(29, 31, 7.2)]],
    }
    summary = step_ab.summarize(runs)
    assert summary["sides"]["base"]["step_ms"] == pytest.approx(26.0)  # median of 20, 22, 30, 31
    assert summary["sides"]["head"]["step_ms"] == pytest.approx(24.5)  # median of 19, 20, 29, 29
    assert summary["ratio_head_over_base"]["step_ms"] == pytest.approx(24.5 / 26.0)
    assert summary["sides"]["head"]["cpu_ms_per_token"]["node agents (Python)"] == pytest.approx(6.1)
    assert summary["rounds"][0]["base"]["step_ms"] == pytest.approx(21.0)
    assert summary["rounds_head_ahead"] == 1


def test_markdown_shows_both_sides_and_every_round() -> None:
    runs = {"base": [[_run(20, 50, 6)], [_run(22, 48, 6)]], "head": [[_run(18, 55, 5)], [_run(19, 53, 5)]]}
    report = {
        "machine": {"cpu_model": "AMD EPYC", "cores": 2},
        "base": {"ref": "v1", "commit": "a" * 40},
        "head": {"commit": "b" * 40, "dirty": False},
        "method": {"sessions": 8, "tokens": 64, "rounds": 2, "runs_per_swarm": 1, "threads": 2, "node_args": ""},
        "summary": step_ab.summarize(runs),
    }
    text = step_ab.markdown(report)
    assert "AMD EPYC, 2 cores" in text and "`aaaaaaaaaaaa` (v1)" in text
    assert "| decode step ms (median gap) | 21.00 | 18.50 | 0.881 |" in text
    assert "| 2 | 22.00 | 19.00 | 48.0 | 53.0 |" in text
    assert "head was ahead on both step and tokens/s: 2 of 2" in text


def test_env_assignments_parse_and_a_bad_one_is_named() -> None:
    assert step_ab.parse_env(["GOMP_SPINCOUNT=20000", "BATON_CPU_POLICY=normal", "EMPTY=", "X_1=a=b"]) == {
        "GOMP_SPINCOUNT": "20000",
        "BATON_CPU_POLICY": "normal",
        "EMPTY": "",
        "X_1": "a=b",
    }
    for bad in ("NOVALUE", "=1", "1X=2", "A-B=3", "A B=4", "\u00c9=5"):
        with pytest.raises(ValueError, match="is not NAME=VALUE") as caught:
            step_ab.parse_env(["OK=1", bad])
        assert repr(bad) in str(caught.value)


def test_side_settings_default_to_the_shared_ones_and_must_differ_without_a_ref() -> None:
    sides = step_ab.side_settings(
        ref=None, threads=1, node_args="--decode-groups 1",
        base={"env": {}, "node_args": None, "threads": None},
        head={"env": {"GOMP_SPINCOUNT": "20000"}, "node_args": None, "threads": 2},
    )  # fmt: skip
    assert sides["base"] == {"env": {}, "node_args": "--decode-groups 1", "threads": 1}
    assert sides["head"] == {"env": {"GOMP_SPINCOUNT": "20000"}, "node_args": "--decode-groups 1", "threads": 2}
    alike = {"env": {}, "node_args": None, "threads": None}
    with pytest.raises(ValueError, match="nothing to compare"):
        step_ab.side_settings(ref=None, threads=1, node_args="", base=alike, head=dict(alike))
    # an explicit side setting equal to the shared one is no difference either
    with pytest.raises(ValueError, match="nothing to compare"):
        step_ab.side_settings(ref=None, threads=1, node_args="", base=alike, head={**alike, "threads": 1})
    # two checkouts may share every setting
    assert step_ab.side_settings(ref="HEAD~1", threads=1, node_args="", base=alike, head=alike)["head"]["threads"] == 1


def test_markdown_of_two_settings_names_each_sides_settings() -> None:
    runs = {"base": [[_run(20, 50, 6)]], "head": [[_run(21, 47, 6)]]}
    sides = {
        "base": {"env": {}, "node_args": "", "threads": 1},
        "head": {"env": {"GOMP_SPINCOUNT": "20000"}, "node_args": "--decode-groups 2", "threads": 1},
    }
    report = {
        "machine": {"cpu_model": "AMD EPYC", "cores": 2},
        "base": {"ref": None, "commit": "c" * 40},
        "head": {"commit": "c" * 40, "dirty": True},
        "method": {"sessions": 8, "tokens": 64, "rounds": 1, "runs_per_swarm": 1, "threads": 1, "node_args": "",
                   "sides": sides},
    }  # fmt: skip
    report["summary"] = step_ab.summarize(runs)
    text = step_ab.markdown(report)
    assert text.startswith("# Interleaved A/B of two settings of one checkout")
    assert "both sides: `cccccccccccc` with uncommitted changes." in text
    assert "base: workers of 1 thread(s); node args: `(none)`." in text
    assert "head: workers of 1 thread(s); node args: `--decode-groups 2`; environment: `GOMP_SPINCOUNT=20000`." in text
    assert "| tokens/s (aggregate) | 50.0 | 47.0 | 0.940 |" in text


def test_a_side_may_not_set_what_each_run_sets_itself() -> None:
    alike = {"env": {}, "node_args": None, "threads": None}
    for name in ("PYTHONPATH", "BATON_WORKER_BIN"):
        with pytest.raises(ValueError, match=f"--head-env cannot set {name}"):
            step_ab.side_settings(
                ref="HEAD~1", threads=1, node_args="", base=alike, head={**alike, "env": {name: "/elsewhere"}}
            )


def test_sign_test_p_values_are_the_exact_binomial_tails() -> None:
    assert step_ab.sign_test_p(0, 0) == 1.0
    assert step_ab.sign_test_p(3, 3) == 1.0
    assert step_ab.sign_test_p(6, 0) == pytest.approx(2 / 64)  # 6 of 6: 0.031
    assert step_ab.sign_test_p(0, 6) == pytest.approx(2 / 64)
    assert step_ab.sign_test_p(5, 1) == pytest.approx(2 * 7 / 64)  # 0.219: not a difference
    assert step_ab.sign_test_p(15, 5) == pytest.approx(0.04139, abs=1e-5)
    assert step_ab.sign_test_p(14, 6) > 0.05


def test_median_interval_uses_order_statistics_with_at_least_the_coverage() -> None:
    assert step_ab.median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None  # 5 values: no 95 % interval
    assert step_ab.median_interval([6.0, 1.0, 5.0, 2.0, 4.0, 3.0]) == (1.0, 6.0)  # coverage 1 - 2/64
    twenty = [float(value) for value in range(1, 21)]
    assert step_ab.median_interval(twenty) == (6.0, 15.0)  # P(Binomial(20, 1/2) <= 5) = 0.0207


def test_summary_pairs_the_rounds_and_the_markdown_says_whether_the_sides_differ() -> None:
    # head had more tokens/s in 6 of 7 rounds, by ratios 1.02 .. 1.10, and fewer in one
    base_tps = [50.0, 40.0, 60.0, 45.0, 55.0, 35.0, 50.0]
    head_tps = [51.0, 41.2, 63.0, 47.7, 59.4, 38.5, 49.0]
    runs = {
        "base": [[_run(1000 / tps, tps, 6)] for tps in base_tps],
        "head": [[_run(1000 / tps, tps, 6)] for tps in head_tps],
    }
    summary = step_ab.summarize(runs)
    pairs = summary["paired"]
    assert pairs["rounds_more_tokens_per_s"] == 6 and pairs["rounds_fewer_tokens_per_s"] == 1
    assert pairs["tokens_per_s_ratio_median"] == pytest.approx(1.05)  # 1.02 1.03 1.05 1.06 1.08 1.10, 0.98
    assert pairs["tokens_per_s_ratio_interval_95"] == pytest.approx([0.98, 1.10])
    assert pairs["sign_test_p"] == pytest.approx(2 * 8 / 128)
    report = {
        "machine": {"cpu_model": "AMD EPYC", "cores": 2},
        "base": {"ref": "v1", "commit": "a" * 40},
        "head": {"commit": "b" * 40, "dirty": False},
        "method": {"sessions": 1, "tokens": 64, "rounds": 7, "runs_per_swarm": 1, "threads": 1, "node_args": ""},
        "summary": summary,
    }
    text = step_ab.markdown(report)
    assert "median of the per-round ratios 1.050 (95 % interval of that median 0.980-1.100)" in text
    assert "more tokens/s in 6 rounds and fewer in 1: sign test p = 0.125" in text
