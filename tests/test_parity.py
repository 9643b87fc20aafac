"""Acceptance tests: a model split into ranges served by separate worker processes computes
the same logits as one unsplit worker (real binary, real models).

Every test starts an unsplit worker [0, n_layer) and one worker per range, runs greedy
decoding on both sides with the same batches, and compares the logits of every step (see
agent/core/owner/parity.py). Workers use one thread each: the unsplit side and the chain run
concurrently, which fills the two cores CI has.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import trio

from agent.core.owner.parity import ParityReport, Scenario
from agent.harness.parity_run import compare_workers, make_prompts, open_workers, run_parity
from agent.io.worker.client import AsyncWorkerClient

pytestmark = [pytest.mark.worker, pytest.mark.slow]

TOLERANCE = 1e-4
REPO_ROOT = Path(__file__).resolve().parent.parent

# Removal + trim in the middle of a 4-sequence run: seq 1 leaves, seq 2 loses 5 positions
# (and re-feeds them), seqs 0 and 3 carry on untouched.
MIDWAY = Scenario(after_step=12, remove_seq=1, trim_seq=2, trim_by=5)


def assert_parity(report: ParityReport, *, ranges: list[list[int]], sequences: int, steps: int) -> None:
    summary = json.dumps(report.to_json())[:2000]
    assert report.tokens_equal, summary
    assert report.max_abs_diff <= TOLERANCE, summary
    assert report.passed
    assert [r.as_list() for r in report.ranges] == ranges
    assert report.sequences == sequences and report.steps == steps
    # Every step was compared: the prefill plus `steps` decode batches.
    assert len(report.step_max_abs_diff) == steps + 1
    assert report.extras["recipe_hashes_equal"], "unsplit and range workers disagree on the recipe"


def assert_scenario_applied(report: ParityReport, scenario: Scenario, steps: int) -> None:
    for seq_id, generated in enumerate(report.tokens):
        expected = scenario.after_step + 1 if seq_id == scenario.remove_seq else steps + 1
        assert len(generated) == expected, (seq_id, generated)
    # Every worker (unsplit + each range) reported one sequence fewer after the removal.
    n_workers = len(report.ranges) + 1
    assert report.extras["active_sequences_after_edit"] == [report.sequences - 1] * n_workers


async def test_smollm2_three_ranges_one_sequence(smollm2_path: Path) -> None:
    report = await run_parity(smollm2_path, [10, 20], sequences=1, steps=32, prompt_tokens=40)
    assert_parity(report, ranges=[[0, 10], [10, 20], [20, 30]], sequences=1, steps=32)
    assert report.prompt_lengths == [40]
    assert report.extras["architecture"] == "llama" and report.extras["n_layer"] == 30
    # A real model continuing real text produces some visible text.
    assert report.text and report.text.strip()


async def test_smollm2_four_sequences_mixed_with_remove_and_trim(smollm2_path: Path) -> None:
    report = await run_parity(smollm2_path, [10, 20], sequences=4, steps=32, prompt_tokens=40, scenario=MIDWAY)
    assert_parity(report, ranges=[[0, 10], [10, 20], [20, 30]], sequences=4, steps=32)
    assert report.prompt_lengths == [40, 34, 28, 22]
    assert_scenario_applied(report, MIDWAY, 32)


async def test_gemma3_cut_off_the_sliding_window_pattern(gemma3_path: Path) -> None:
    # Cuts at 4 and 11 are not multiples of the pattern (6): ranges must keep global layer
    # numbering for the sliding-window / global attention choice.
    report = await run_parity(gemma3_path, [4, 11], sequences=1, steps=32, prompt_tokens=40)
    assert_parity(report, ranges=[[0, 4], [4, 11], [11, 18]], sequences=1, steps=32)
    assert report.extras["architecture"] == "gemma3"


async def test_gemma3_four_sequences_mixed_with_remove_and_trim(gemma3_path: Path) -> None:
    report = await run_parity(gemma3_path, [4, 11], sequences=4, steps=32, prompt_tokens=40, scenario=MIDWAY)
    assert_parity(report, ranges=[[0, 4], [4, 11], [11, 18]], sequences=4, steps=32)
    assert_scenario_applied(report, MIDWAY, 32)


@pytest.mark.parametrize("model", ["qwen2_tiny_path", "qwen3_tiny_path"])
async def test_tiny_models_one_sequence(model: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(model)
    report = await run_parity(path, [2, 4], sequences=1, steps=32, prompt_tokens=40)
    assert_parity(report, ranges=[[0, 2], [2, 4], [4, 6]], sequences=1, steps=32)


@pytest.mark.parametrize("model", ["qwen2_tiny_path", "qwen3_tiny_path"])
async def test_tiny_models_four_sequences_with_remove_and_trim(model: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(model)
    report = await run_parity(path, [2, 4], sequences=4, steps=32, prompt_tokens=40, scenario=MIDWAY)
    assert_parity(report, ranges=[[0, 2], [2, 4], [4, 6]], sequences=4, steps=32)
    assert_scenario_applied(report, MIDWAY, 32)


class _PerturbedBoundary:
    """A range worker whose boundary rows arrive slightly changed (a negative control)."""

    def __init__(self, inner: AsyncWorkerClient, delta: float) -> None:
        self._inner = inner
        self._delta = np.float32(delta)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    async def forward(self, entries):
        changed = [dataclasses.replace(e, boundary=e.boundary + self._delta) for e in entries]
        return await self._inner.forward(changed)


async def test_parity_check_notices_a_perturbed_boundary(qwen3_tiny_path: Path) -> None:
    # Negative control: the comparison must not pass when the split side computes something
    # else. The same workers pass unperturbed first, so the failure is the perturbation's.
    async with open_workers(qwen3_tiny_path, [(0, None), (0, 3), (3, None)], threads=1, ctx_size=128) as handles:
        reference, first, last = (h.client for h in handles)
        prompts = await make_prompts(reference, 1, 12)
        clean = await compare_workers(reference, [first, last], prompts, steps=3)
        assert clean.passed, clean.to_json()
        dirty = await compare_workers(reference, [first, _PerturbedBoundary(last, 0.05)], prompts, steps=3)
    assert dirty.max_abs_diff > TOLERANCE
    assert not dirty.passed


async def test_cli_parity_json(smollm2_path: Path) -> None:
    argv = [
        sys.executable, "-m", "agent.cli", "parity",
        "--model", str(smollm2_path), "--cuts", "10,20", "--steps", "6", "--prompt-tokens", "16",
        "--sequences", "2", "--json",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False, cwd=REPO_ROOT, env=env)
    stderr = result.stderr.decode(errors="replace")
    assert result.returncode == 0, stderr
    data = json.loads(result.stdout)
    assert {"max_abs_diff", "tokens_equal", "ranges"} <= data.keys()
    assert data["ranges"] == [[0, 10], [10, 20], [20, 30]]
    assert data["tokens_equal"] is True
    assert isinstance(data["max_abs_diff"], float) and data["max_abs_diff"] <= TOLERANCE
    assert data["steps"] == 6 and data["sequences"] == 2
    assert [len(t) for t in data["tokens"]] == [7, 7]


async def test_cli_parity_bad_cuts_exit_code() -> None:
    # Rejected before any worker starts (no model needed).
    argv = [sys.executable, "-m", "agent.cli", "parity", "--model", "/nonexistent.gguf", "--cuts", "20,10"]
    result = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False, cwd=REPO_ROOT)
    assert result.returncode == 2
    assert b"cuts must be sorted ascending" in result.stderr
    argv[argv.index("20,10")] = "10,20"
    result = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False, cwd=REPO_ROOT)
    assert result.returncode == 2
    assert b"baton parity: [Errno 2] No such file or directory: '/nonexistent.gguf'" in result.stderr
