"""The pure part of bench/wire_bounds.py (its markdown) and of bench/wan_prefill_chunks.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH_DIR))

import wan_prefill_chunks  # noqa: E402
import wire_bounds  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_the_table_has_a_cell_per_length_and_the_declared_bound() -> None:
    rows = [
        {"model": "smollm2", "prompt_tokens": 40, "wire": "F16S", "max_abs_diff": 1.125},
        {"model": "gemma3", "prompt_tokens": 1500, "wire": "Q8", "max_abs_diff": 3.871},
    ]
    md = wire_bounds.markdown({"lengths": [40, 1500], "steps": 32, "rows": rows, "bounds": {"F16S": 6.5, "Q8": 9.0}})
    assert "| smollm2 | F16S | 1.12 | - | 6.5 |" in md
    assert "| gemma3 | Q8 | - | 3.87 | 9 |" in md


def test_the_chunk_table_gives_each_size_over_the_largest() -> None:
    section = {"unlimited": {"measured_rtt_ms": 20.6, "first_token_s": {"64": 7.2, "512": 8.0},
                             "over_largest": {"64": 0.9, "512": 1.0}, "tokens_agree": True}}  # fmt: skip
    md = "\n".join(
        wan_prefill_chunks.chunks_markdown({"prompt_tokens": 1500, "chunk_rows": [64, 512], "links": section})
    )
    assert "| unlimited | 20.6 | 7.200 (0.90x) | 8.000 (1.00x) | True |" in md
