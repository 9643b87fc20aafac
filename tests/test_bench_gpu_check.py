"""The pure parts of ``bench/gpu_check.py``: the figures it derives from the tools' output (which
llama-bench row is which, t/s from the Shard's milliseconds, the ratios), its report, and where
it finds llama.cpp's tools in a build. No processes, no GPU."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH_DIR))

import gpu_check  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def _report() -> dict:
    return {
        "machine": {
            "gpu": "NVIDIA H200",
            "nvcc": "cuda 13.0",
            "cores": 16,
            "platform": "Linux",
            "llama_cpp_commit": "0c1e57098bba43ac",
            "patch_series_sha256": "5df6302b072401ec",
        },
        "model": "m.gguf",
        "threads": 4,
        "failures": [],
        "split": {
            "top_k_equal": True,
            "runs": [
                {"whole_decode_ms": 1.0, "split_decode_ms": 1.2},
                {"whole_decode_ms": 2.0, "split_decode_ms": 2.4},
                {"whole_decode_ms": 1.5, "split_decode_ms": 1.6},
            ],
        },
        # prompt 512 in 10 ms (51,200 t/s), 2 ms a decode step (500 t/s)
        "shard_single": {"runs": [{"prompt_ms": 10.0, "decode_ms": 2.0}]},
        "shard_single_full_row": {"runs": [{"prompt_ms": 10.0, "decode_ms": 2.5}]},
        "llama_bench": [
            {"n_prompt": 512, "n_gen": 0, "n_depth": 512, "avg_ts": 1.0},  # not the prefill at depth 0
            {"n_prompt": 512, "n_gen": 0, "n_depth": 0, "avg_ts": 64000.0},
            {"n_prompt": 0, "n_gen": 128, "n_depth": 0, "avg_ts": 1.0},  # not the decode after 512
            {"n_prompt": 0, "n_gen": 128, "n_depth": 512, "avg_ts": 1000.0},
        ],
        # JSON keys are strings once a report has been written and read back
        "llama_batched_bench": {"1": {"speed_tg": 1000.0}, "8": {"speed_tg": 4000.0}},
        "shard_parallel_1": {"runs": [{"decode_ms": 1.25}]},
        "shard_parallel_8": {"runs": [{"decode_ms": 4.0}, {"decode_ms": 2.0}, {"decode_ms": 8.0}]},
    }


def test_the_figures_come_from_the_matching_rows_and_runs() -> None:
    s = gpu_check.summarise(_report(), prompt=512, steps=128)
    assert s["split_top_k_equal"] is True
    # medians over the runs; two cuts in a 3-way split
    assert s["whole_decode_ms"] == 1.5 and s["split_decode_ms"] == 1.6
    assert s["cut_cost_ms"] == pytest.approx(0.05)
    assert s["shard_prefill_tps"] == pytest.approx(51200.0) and s["llama_bench_pp_tps"] == 64000.0
    assert s["prefill_ratio"] == pytest.approx(0.8)
    assert s["shard_decode_tps"] == pytest.approx(500.0) and s["llama_bench_tg_tps"] == 1000.0
    assert s["decode_ratio"] == pytest.approx(0.5)
    assert s["shard_decode_full_row_tps"] == pytest.approx(400.0)
    # N rows a step: N * 1000 / the median step ms; only the counts both tools ran
    assert set(s["parallel"]) == {1, 8}
    assert s["parallel"][1]["shard_tps"] == pytest.approx(800.0) and s["parallel"][1]["ratio"] == pytest.approx(0.8)
    assert s["parallel"][8]["shard_tps"] == pytest.approx(2000.0) and s["parallel"][8]["ratio"] == pytest.approx(0.5)


def test_a_missing_part_leaves_its_figures_out() -> None:
    report = _report()
    del report["llama_bench"], report["split"]
    s = gpu_check.summarise(report, prompt=512, steps=128)
    assert "decode_ratio" not in s and "cut_cost_ms" not in s and "shard_decode_tps" not in s
    assert s["parallel"][8]["ratio"] == pytest.approx(0.5)


def test_the_report_says_what_failed_and_what_differs(tmp_path: Path) -> None:
    report = _report()
    report["split"]["top_k_equal"] = False
    report["ctest"] = {
        "passed": False,
        "exit_code": 8,
        "seconds": 3.5,
        "summary": ["2 - model_split_equals_full (Failed)"],
    }
    report["failures"] = ["llama_batched_bench: exited 1"]
    report["notes"] = ["a note"]
    report["summary"] = gpu_check.summarise(report, prompt=512, steps=128)
    text = gpu_check.render(report)
    assert "FAILED (exit 8)" in text and "model_split_equals_full (Failed)" in text
    assert "DIFFERS from" in text and "equals" not in text.split("--split 3")[1].splitlines()[0]
    assert "| decode after 512, t/s | 500 | 1000 | 0.50x |" in text
    assert "| 8 | 2000 | 4000 | 0.50x |" in text
    assert "## Notes" in text and "- a note" in text and "- llama_batched_bench: exited 1" in text
    # render writes the .md again from a .json read back (integer keys become strings)
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps(report))
    assert gpu_check.rerender(path) == 0
    assert (tmp_path / "gpu_check.md").read_text() == gpu_check.render(json.loads(path.read_text()))


def test_batched_bench_rows_are_read_from_its_jsonl_among_log_lines() -> None:
    import compare_report

    output = "\n".join(
        [
            "llama_context: n_ctx = 2112",
            '{"n_kv_max": 2112, "pl": 1, "speed_tg": 918.4}',
            "main: done",
            '  {"n_kv_max": 2112, "pl": 8, "speed_tg": 4522.3}',
            '{"unrelated": 1}',
        ]
    )
    rows = compare_report.batched_bench_rows(output)
    assert set(rows) == {1, 8} and rows[8]["speed_tg"] == 4522.3


def test_llama_tools_are_found_where_cmake_put_them(tmp_path: Path) -> None:
    tool = tmp_path / "llama.cpp" / "bin" / "llama-bench"
    tool.parent.mkdir(parents=True)
    tool.write_text("#!/bin/sh\n")
    with pytest.raises(RuntimeError, match="llama-bench is not in"):
        gpu_check.llama_tool(tmp_path, "llama-bench")  # not executable: not a built tool
    os.chmod(tool, 0o755)
    assert gpu_check.llama_tool(tmp_path, "llama-bench") == str(tool)
    with pytest.raises(RuntimeError, match="llama-batched-bench is not in"):
        gpu_check.llama_tool(tmp_path, "llama-batched-bench")
