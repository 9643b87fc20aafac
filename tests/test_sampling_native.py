"""The last hop's draw (native/src/sampling.cpp) against the owner's (agent/core/owner/sampling.py):
the same rows, parameters and uniforms give the same tokens, and the same seed and position
the same uniform, bit for bit. Fed through ``baton-sampling-tests draw`` (built beside the
worker), many random rows: ties, -inf, temperatures from cold to hot, top-k and top-p cuts,
whole rows of SmolLM2's vocabulary size (the stretch-by-stretch path) and top-K records.
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from agent.core.owner.sampling import SamplingParams, draw_token, draw_uniform
from agent.core.wire.topk import TopLogits
from agent.io.worker.process import find_worker_binary

pytestmark = [pytest.mark.worker, pytest.mark.timeout(120)]


def _native(lines: list[str]) -> list[str]:
    binary = find_worker_binary().parent / "baton-sampling-tests"
    done = subprocess.run(
        [str(binary), "draw"], input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=100, check=True
    )
    answers = done.stdout.splitlines()
    assert len(answers) == len(lines), done.stderr
    return answers


def _hex(values) -> str:
    return " ".join(float(v).hex() for v in values)


def _case_params(rng: np.random.Generator) -> SamplingParams:
    temperature = float(rng.choice([1e-3, 0.1, 0.7, 1.0, 1.5, 5.0, 100.0]))
    top_k = int(rng.choice([0, 0, 1, 2, 5, 40]))
    top_p = float(rng.choice([1.0, 1.0, 0.95, 0.8, 0.5, 0.1]))
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)


def _row(rng: np.random.Generator, n: int) -> np.ndarray:
    kind = rng.integers(4)
    if kind == 0:  # model-like: a few likely tokens over a long tail
        row = rng.standard_normal(n) * 3
    elif kind == 1:  # many exact ties
        row = rng.integers(-3, 3, n).astype(np.float64)
    elif kind == 2:  # -inf masked entries
        row = rng.standard_normal(n) * 2
        row[rng.random(n) < 0.3] = -np.inf
        row[rng.integers(n)] = 1.0
    else:  # one clear peak
        row = rng.standard_normal(n)
        row[rng.integers(n)] = 12.0
    return row.astype(np.float32)


def test_the_uniforms_are_the_same_bits() -> None:
    seeds = [0, 1, 42, 2**63, 2**64 - 1, 0x9E3779B97F4A7C15]
    cases = [(s, p) for s in seeds for p in (0, 1, 2, 100, 2**31 - 1)]
    answers = _native([f"U {s} {p}" for s, p in cases])
    assert [float.fromhex(a) for a in answers] == [draw_uniform(s, p) for s, p in cases]


def test_whole_rows_draw_the_same_tokens() -> None:
    rng = np.random.default_rng(2026)
    lines, expected = [], []
    for _ in range(600):
        n = int(rng.choice([1, 2, 3, 7, 8, 9, 64, 129, 1000]))
        row = _row(rng, n)
        params = _case_params(rng)
        uniform = float(rng.choice([0.0, 0.5, 1 - 2**-53])) if rng.random() < 0.1 else float(rng.random())
        lines.append(
            f"R {params.temperature.hex()} {params.top_k} {params.top_p.hex()} {uniform.hex()} {n} {_hex(row)}"
        )
        expected.append(str(draw_token(row, params, uniform)))
    assert _native(lines) == expected


def test_vocabulary_wide_rows_draw_the_same_tokens() -> None:
    """SmolLM2's width: no top-k cut takes the stretch-by-stretch path on both sides."""
    rng = np.random.default_rng(7)
    lines, expected = [], []
    for i in range(40):
        row = (rng.standard_normal(49_152) * 2.5).astype(np.float32)
        row[rng.integers(49_152, size=3)] = 9.0  # a tie at the peak
        params = SamplingParams(temperature=(0.7, 1.0, 1.3, 0.2)[i % 4], top_k=0, top_p=(1.0, 0.9, 1.0, 0.95)[i % 4])
        uniform = float(rng.random())
        lines.append(f"R {params.temperature.hex()} 0 {params.top_p.hex()} {uniform.hex()} {row.size} {_hex(row)}")
        expected.append(str(draw_token(row, params, uniform)))
    assert _native(lines) == expected


def test_top_k_records_draw_the_same_tokens_as_their_rows() -> None:
    rng = np.random.default_rng(11)
    lines, expected = [], []
    for _ in range(300):
        n = int(rng.choice([5, 50, 500]))
        row = _row(rng, n)
        k = int(rng.choice([1, 3, 5]))
        top = TopLogits.from_row(row, k)
        params = SamplingParams(
            temperature=float(rng.choice([0.3, 0.7, 2.0])), top_k=int(rng.integers(1, k + 1)), top_p=0.9
        )
        uniform = float(rng.random())
        lines.append(
            f"K {params.temperature.hex()} {params.top_k} {params.top_p.hex()} {uniform.hex()} {top.k} {n} "
            f"{' '.join(map(str, top.ids.tolist()))} {_hex(top.logits)}"
        )
        token = draw_token(top, params, uniform)
        assert token == draw_token(row, params, uniform)  # the record is exact for its cut
        expected.append(str(token))
    assert _native(lines) == expected


def test_what_python_refuses_native_refuses() -> None:
    cases = [
        ("R 0x1p+0 0 0x1p+0 0x1p-1 2 nan 0x1p+0", "NaN"),
        ("R 0x1p+0 0 0x1p+0 0x1p-1 2 -inf -inf", "-inf"),
        ("R 0x1p+0 0 0x1p+0 0x1p+0 2 0x1p+0 0x1p+0", "uniform"),
        ("K 0x1p+0 0 0x1p+0 0x1p-1 1 5 3 0x1p+0", "full row"),
    ]
    answers = _native([line for line, _ in cases])
    for (_, why), answer in zip(cases, answers, strict=True):
        assert answer.startswith("error: ") and why in answer
