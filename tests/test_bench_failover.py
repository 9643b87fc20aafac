"""The pure parts of bench/failover.py: the summary over runs and the markdown it writes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH_DIR))

import failover  # noqa: E402

pytestmark = pytest.mark.unit


def _run(how: str, position: str, resume_s: float | None, ok: bool = True) -> dict:
    return {"signal": how, "position": position, "ok": ok, "resume_s": resume_s, "healthy_prefill_s": 0.5}


def test_the_summary_takes_medians_over_good_runs_and_counts_failures() -> None:
    raw = {
        "kills": [
            _run("SIGKILL", "first", 0.4), _run("SIGKILL", "first", 0.8), _run("SIGKILL", "first", 0.6),
            _run("SIGKILL", "last", None, ok=False), _run("SIGSTOP", "middle", 3.0),
        ],
        "contexts": [
            {**_run("SIGKILL", "last", 1.5), "context_positions": 128, "resume_enabled": True, "resumed": True},
            {**_run("SIGKILL", "last", 2.5), "context_positions": 128, "resume_enabled": False},
        ],
    }  # fmt: skip
    args = argparse.Namespace(contexts=[128, 512])
    summary = failover.summarize(raw, args)
    first = summary["by_signal_position"]["SIGKILL first"]
    assert (first["median_s"], first["max_s"], first["runs"], first["failed"]) == (0.6, 0.8, 3, 0)
    assert summary["by_signal_position"]["SIGKILL last"] == {"n": 0, "runs": 1, "failed": 1, "resumed": 0}
    assert summary["by_signal"]["SIGSTOP"]["max_s"] == 3.0
    assert summary["by_context"]["128"]["resume"]["median_s"] == 1.5
    assert summary["by_context"]["128"]["reprefill"]["median_s"] == 2.5
    assert summary["by_context"]["128"]["resumed"] == 1
    assert summary["by_context"]["512"]["runs"] == 0

    report = {
        "summary": summary, "machine": {"cpu_model": "cpu", "cores": 2}, "wall_time_s": 1.0,
        "config": {"threads": 1, "kills": 3, "seed": 13},
    }  # fmt: skip
    md = failover.render_markdown(report)
    assert failover.RESUME_NOTE in md  # the output says what resume is today
    assert "| SIGKILL first | 0.60 | 0.80 | 3 | 0 | 0 |" in md
    assert "| 128 | 1.50 | 1.50 | 2.50 | 2.50 | 0.50 | 2 | 0 |" in md
    assert "| 512 | - | - | - | - | - | 0 | 0 |" in md
