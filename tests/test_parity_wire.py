"""Lossy boundaries on the wire stay within their declared bounds: SmolLM2 and Gemma-3 split
into three worker processes, the boundary rows crossing each cut as a swarm hop sends them in
F16S or Q8 (``agent.core.owner.parity.through_wire``: encoded, then decoded as the next hop
does), against one unsplit worker, 4 sequences with a removal and a trim, 32 greedy steps; and
one 1,500-token prompt on Gemma-3 (the error grows with the prompt).

The bound is ``agent.core.wire.boundary.WIRE_LOGIT_BOUNDS``: the largest max |logit difference|
against F32 (bit-identical to the unsplit worker: tests/test_parity.py) a route may show; how it
was chosen is in docs/PERFORMANCE.md, "Boundaries sized for the link". Greedy tokens may differ
where two candidates are nearly tied (Gemma-3 has such steps), so they are not asserted: the
logits are. Plain F16 cannot carry Gemma-3's residual (9.1e4 at block 11, past 65504): it is
refused by name, which is why a session's "f16" is F16S.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.core.owner.parity import Scenario
from agent.core.wire.boundary import WIRE_LOGIT_BOUNDS, BoundaryError, WireDType
from agent.harness.parity_run import run_parity

pytestmark = [pytest.mark.worker, pytest.mark.slow, pytest.mark.timeout(900)]

MIDWAY = Scenario(after_step=12, remove_seq=1, trim_seq=2, trim_by=5)
CUTS = {"smollm2_path": [10, 20], "gemma3_path": [4, 11]}


@pytest.mark.parametrize("wire", [WireDType.F16S, WireDType.Q8], ids=["f16s", "q8"])
@pytest.mark.parametrize("model", ["smollm2_path", "gemma3_path"])
async def test_lossy_wire_stays_within_its_declared_bound(
    model: str, wire: WireDType, request: pytest.FixtureRequest
) -> None:
    bound = WIRE_LOGIT_BOUNDS[wire]
    report = await run_parity(
        request.getfixturevalue(model), CUTS[model], sequences=4, steps=32, prompt_tokens=40, scenario=MIDWAY,
        boundary_dtype=wire, tolerance=bound,
    )  # fmt: skip
    summary = json.dumps({k: v for k, v in report.to_json().items() if k != "tokens"})[:2000]
    assert report.extras["boundary_dtype"] == wire.name
    assert 0.0 < report.max_abs_diff <= bound, summary  # > 0: the rows were rounded
    assert report.sequences == 4 and len(report.step_max_abs_diff) == 33


@pytest.mark.parametrize("wire", [WireDType.F16S, WireDType.Q8], ids=["f16s", "q8"])
async def test_a_long_prompt_stays_within_the_bound_too(wire: WireDType, gemma3_path: Path) -> None:
    # the error grows with the prompt (bench/results/wire_bounds.md): Gemma-3's most at 1,500 tokens
    bound = WIRE_LOGIT_BOUNDS[wire]
    report = await run_parity(
        gemma3_path, CUTS["gemma3_path"], sequences=1, steps=8, prompt_tokens=1500, boundary_dtype=wire,
        tolerance=bound, ctx_size=1536,
    )  # fmt: skip
    assert 0.0 < report.max_abs_diff <= bound, report.step_max_abs_diff


async def test_plain_f16_refuses_gemma3s_residual_by_name(gemma3_path: Path) -> None:
    with pytest.RaisesGroup(pytest.RaisesExc(BoundaryError, match="out of float16 range"), flatten_subgroups=True):
        await run_parity(gemma3_path, [4, 11], sequences=1, steps=1, prompt_tokens=40, boundary_dtype=WireDType.F16)
