"""``baton demo``: a real model through three local range workers, as the README runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agent.demo.local_demo import even_cuts

pytestmark = pytest.mark.swarm


def test_even_cuts() -> None:
    assert even_cuts(30, 3) == [10, 20]
    assert even_cuts(18, 4) == [4, 9, 14]
    assert even_cuts(5, 1) == []
    with pytest.raises(ValueError, match="cannot cut"):
        even_cuts(2, 3)


@pytest.mark.timeout(180)
def test_demo_json_through_three_ranges(smollm2_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "agent.cli", "demo", "--local", "--model", str(smollm2_path), "--max-tokens", "12", "--json",
         "The capital of France is"],
        capture_output=True, text=True, timeout=170, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert [(hop["begin"], hop["end"]) for hop in report["route"]] == [(0, 10), (10, 20), (20, 30)]
    assert report["tokens_equal_single_process"] is True
    assert report["tokens_per_s"] > 0
    assert 1 <= len(report["tokens"]) <= 12
    assert "Paris" in report["text"]
