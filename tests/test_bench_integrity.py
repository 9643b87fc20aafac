"""The pure parts of bench/integrity.py: the shares at the default rates and the markdown."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH_DIR))

import integrity  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def _phase(name: str, tokens_per_s: float, **fields) -> dict:
    base = {
        "name": name,
        "tokens": int(tokens_per_s * 10),
        "elapsed_s": 10.0,
        "tokens_per_s": tokens_per_s,
        "rows": 1000,
    }
    base.update({"generations": 5, "shadow_rows": 0, "spot_sessions": 0, "spot_mismatches": 0, "canaries": 0})
    return {**base, "canary_failures": 0, **fields}


def test_shares_are_measured_and_extrapolated_to_the_default_rates() -> None:
    raw = {
        "phases": [
            _phase("baseline", 40.0),
            _phase("spot default", 39.0, spot_sessions=1),
            _phase("spot all", 20.0, shadow_rows=1000, spot_sessions=5),
            _phase("canaries default", 40.0),
            _phase("canaries fast", 30.0, canaries=20),
            _phase("baseline again", 40.0),
        ]
    }
    summary = integrity.summarize(raw, argparse.Namespace(canary_max_prompt_rows=31))
    assert summary["baseline_tokens_per_s"] == 40.0 and summary["baseline_noise"] == 0.0
    spot, canary = summary["spot"], summary["canaries"]
    assert spot["measured_loss_at_default"] == pytest.approx(0.025)
    assert spot["loss_checking_every_generation"] == pytest.approx(0.5)
    assert spot["extrapolated_loss_at_default"] == pytest.approx(0.005)
    assert spot["work_share_every_generation"] == 1.0 and spot["work_share_at_default"] == pytest.approx(0.01)
    assert canary["fast_rate_per_s"] == 2.0 and canary["default_rate_per_s"] == pytest.approx(4 / 300)
    assert canary["loss_at_fast_rate"] == pytest.approx(0.25)
    assert canary["extrapolated_loss_at_default"] == pytest.approx(0.25 * (4 / 300) / 2.0)
    # a canary: 16 prompt rows and 2.5 decode rows on average, against 100 rows/s of traffic
    assert canary["work_share_at_default"] == pytest.approx((4 / 300) * 18.5 / 100)
    report = {
        "summary": summary, "raw": raw, "machine": {"cpu_model": "cpu", "cores": 2, "ram_gib": 1.0},
        "args": {"concurrency": 2, "max_tokens": 32, "duration_s": 10.0, "canary_max_prompt_rows": 31},
    }  # fmt: skip
    md = integrity.render_markdown(report)
    assert "| spot all | 20.0 | 5 | 0 | 5 |" in md
    assert "+0.50 % (checking every generation: +50.00 %)" in md and "at 2.00 canaries/s: +25.00 %" in md
