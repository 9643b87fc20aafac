"""The pure parts of bench/wan.py: the ring bounds, where a token's time goes, the report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH_DIR))

import wan  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_ring_bounds_count_one_way_delays_around_the_route() -> None:
    bounds = wan.ring_bounds(compute_s=0.006, prompt_compute_s=0.25, one_way_s=0.010, hops=3)
    assert bounds["decode_tps"] == pytest.approx(1 / (0.006 + 3 * 0.010))  # hop1 -> hop2 -> hop3 -> hop1
    assert bounds["first_token_s"] == pytest.approx(0.25 + 4 * 0.010)  # owner -> 3 hops -> owner
    assert bounds["rpc_decode_tps"] == pytest.approx(1 / (0.006 + 3 * 0.020))  # a round trip per server


def test_where_time_goes_leaves_the_rest_as_overhead() -> None:
    split = wan.where_time_goes(tps=25.0, compute_s=0.006, one_way_s=0.010, hops=3)
    assert split == pytest.approx({"token_ms": 40.0, "compute_ms": 6.0, "links_ms": 30.0, "rest_ms": 4.0})


def _system(tps: float, first_s: float, hops: int | None) -> dict:
    entry = {"decode_tps": {"median": tps, "min": tps, "max": tps, "n": 1}, "first_token_s": {"median": first_s}}
    if hops:
        entry["bound"] = wan.ring_bounds(0.006, 0.25, 0.010, hops)
        entry["of_bound"] = tps / entry["bound"]["decode_tps"]
        entry["where_time_goes"] = wan.where_time_goes(tps, 0.006, 0.010, hops)
    return entry


def test_the_splits_own_compute_is_each_hops_decode_steps_alone() -> None:
    # per hop (µs): a prompt-only generation, and a whole one of the same prompt plus 4 decode steps
    prefill = {(0, 10): 130_000, (10, 20): 140_000, (20, 30): 150_000}
    whole = {(0, 10): 158_000, (10, 20): 168_000, (20, 30): 210_000}
    split = wan.split_compute_ms(prefill, whole, 4)
    assert split["hops_ms"] == [
        {"begin": 0, "end": 10, "ms": 7.0}, {"begin": 10, "end": 20, "ms": 7.0}, {"begin": 20, "end": 30, "ms": 15.0}
    ]  # fmt: skip
    assert split["sum_ms"] == 29.0


def test_the_report_names_every_system_and_marks_misses() -> None:
    point = {
        "rtt_ms": 20, "measured_rtt_ms": 20.2, "compute_ms": 6.0, "prompt_compute_ms": 250.0,
        "systems": {"baton_3": _system(26.0, 0.29, 3), "baton_sampled_3": _system(25.0, 0.29, 3), "baton_2": _system(31.0, 0.28, 2), "rpc_3": _system(12.5, 0.33, 3),
                    "rpc_2": _system(17.0, 0.30, 2), "unsplit": _system(160.0, 0.24, None)},
        "baton_3_over_rpc_3": 2.08, "baton_2_over_rpc_2": 1.82,
    }  # fmt: skip
    report = {
        "machine": {"cpu_model": "CPU", "cores": 2}, "prompt_tokens": 64, "new_tokens": 32, "threads": 1, "turns": 3,
        "points": [point],
        "concurrency": {
            "rtt_ms": 20, "sessions": 8, "one_tps": 26.0, "groups_tps": 110.0, "lock_step_tps": 90.0,
            "groups_over_one": 4.23, "groups_over_lock_step": 1.22, "groups_ahead_rounds": 1,
            "rounds": [{"one": {"aggregate_decode_tps": 26.0}, "groups": {"aggregate_decode_tps": 110.0},
                        "lock_step": {"aggregate_decode_tps": 90.0}}],
        },
        "accuracy": {
            "rtt": [{"configured_ms": 20, "median_ms": 20.2, "min_ms": 20.1, "max_ms": 20.4, "within": True},
                    {"configured_ms": 1, "median_ms": 1.5, "min_ms": 1.4, "max_ms": 1.6, "within": False}],
            "loss": [{"configured_pct": 2, "measured_pct": 1.8, "within": True}],
            "rate": [{"configured_mbit": 20, "tcp_payload_mbit": 19.3, "ratio": 0.965, "within": True}],
            "forwarder": {"cpu_s": 0.2, "packets": 7000, "cpu_us_per_packet": 28.6},
        },
    }  # fmt: skip
    point["systems"]["baton_3"]["of_split_bound"] = 0.97
    report["split_compute"] = wan.split_compute_ms({(0, 10): 0, (10, 30): 0}, {(0, 10): 93_000, (10, 30): 124_000}, 31)
    text = wan.markdown(report)
    assert "3.00 + 4.00 = 7.00 ms a token, 1.17x the unsplit C of 6.00 ms" in text
    assert "in place of C: 20 ms 0.97x." in text
    for label in wan.LABELS.values():
        assert label in text
    assert "| 20 (20.20) | 26.0 (bound 27.8, 0.94x) | 25.0 (bound 27.8, 0.90x)" in text
    assert "2.08x" in text and "**4.23x**" in text
    assert (
        "| 1 | 26.0 | 110.0 | 90.0 | 4.23x | 1.22x |" in text and "**1.22x** lock-step (ahead in 1 of 1 rounds)" in text
    )
    assert "| 1 | 1.500 | 1.400 | 1.600 | NO |" in text  # a miss says so
    json.dumps(report)
    pytest.importorskip("matplotlib")
    assert wan.chart(report).startswith(b"\x89PNG")


def test_the_wire_report_names_each_dtype_its_bytes_and_its_bound() -> None:
    import wan_wire

    turns = {name: [{"first_token_s": s, "tokens": [1, 2]}] for name, s in (("f32", 4.0), ("f16", 2.2), ("q8", 1.9))}
    section = {
        "rtt_ms": 20.0, "rate_mbit": 20.0, "prompt_tokens": 1500, "chunk_rows": 128, "turns": turns,
        "f16_over_f32": 0.55, "q8_over_f32": 0.475,
        "max_abs_logit_diff": {"f32": 0.0, "f16": 0.8, "q8": 1.1},
        "declared_bound": {"f32": 0.0, "f16": 2.5, "q8": 3.5},
        "prompt_bytes_per_link": {"f32": 3_456_000, "f16": 1_734_000, "q8": 1_107_000},
        "prompt_link_s": {"f32": 1.38, "f16": 0.69, "q8": 0.44}, "f32_tokens_same": True, "target_ratio": 0.6,
    }  # fmt: skip
    text = "\n".join(wan_wire.wire_markdown(section))
    assert "f16 **0.55x** f32's time to first token (target <= 0.6x: met)" in text
    assert "| q8 | 1,107,000 | 0.44 | 1.1 | 3.5 |" in text
    assert wan_wire._max_top_diff([{1: 2.0, 2: 1.0}], [{1: 2.5, 3: 0.0}]) == 0.5  # shared tokens only


def test_the_speculation_report_sets_each_task_against_its_target_and_shows_what_rows_cost() -> None:
    import wan_speculation

    def figure(tps: float, drafted: int = 0, accepted: int = 0, trips: int = 256) -> dict:
        return {"decode_tps": tps, "drafted": drafted, "accepted": accepted, "trips": trips}

    section = {
        "rtt_ms": 20.0, "new_tokens": 256, "speculate_tokens": 8,
        "tasks": {
            "copy-heavy": {"turns": {"plain": [figure(16.0)], "speculative": [figure(36.0, 200, 180, 76)]},
                           "speculative_over_plain": 2.25, "tokens_identical": True, "generated_tokens": 256,
                           "prompt_tokens": 290},
            "free-form": {"turns": {"plain": [figure(18.0)], "speculative": [figure(16.2, 8, 0, 256)]},
                          "speculative_over_plain": 0.90, "tokens_identical": True, "generated_tokens": 256,
                          "prompt_tokens": 17},
        },
        "targets": {"copy-heavy": 2.0, "free-form": 0.95}, "rows_compute_ms": {"1": 20.0, "2": 30.0, "9": 130.0},
    }  # fmt: skip
    text = "\n".join(wan_speculation.speculation_markdown(section))
    assert "| copy-heavy | 1 | 16.0 | 36.0 | 200 | 180 | 76 |" in text
    assert "speculative **2.25x** plain (target >= 2x: met)" in text
    assert "speculative **0.90x** plain (target >= 0.95x: missed)" in text
    assert "| of one row | 1.00x | 1.50x | 6.50x |" in text
