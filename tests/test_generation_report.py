"""What ``baton generate --json`` reports about speed (``agent.io.client.outcome``): the first
token's latency, and the decode's rate as generated tokens over its wall time, however many
steps or trips around the route carried them; drafted / accepted tokens (0: no speculation)."""

from __future__ import annotations

import pytest

from agent.io.client import outcome
from agent.io.client.outcome import GenerationResult, Progress

pytestmark = pytest.mark.unit


def test_the_decode_rate_is_tokens_over_the_decodes_wall_time(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([10.5 + 0.1 * i for i in range(20)])  # the first token, then one every 0.1 s
    monkeypatch.setattr(outcome.time, "perf_counter", lambda: next(clock))
    progress = Progress(started_at=10.0)
    progress.add(7, 0.5, prefill=True)  # the first token, 0.5 s after the start
    for token in range(4):  # four more, 0.1 s apart on the wall (whatever each step's own time)
        progress.add(token, 0.01, prefill=False)
    assert progress.first_token_s == pytest.approx(0.5)
    assert progress.decode_wall_s == pytest.approx(0.4)
    result = GenerationResult(
        text="", tokens=list(progress.tokens), prompt_tokens=[1, 2], route=[], model_sha256="m",
        prefill_s=progress.prefill_s, decode_s=progress.decode_s, decode_steps=progress.decode_steps,
        stopped_by_token=False, first_token_s=progress.first_token_s, decode_wall_s=progress.decode_wall_s,
    )  # fmt: skip
    report = result.to_json()
    assert report["first_token_s"] == pytest.approx(0.5)
    assert report["decode_tokens_per_s"] == pytest.approx(4 / 0.4)
    assert report["drafted_tokens"] == report["accepted_tokens"] == 0


def test_one_token_has_no_decode_rate() -> None:
    result = GenerationResult(
        text="", tokens=[5], prompt_tokens=[1], route=[], model_sha256="m", prefill_s=0.2, decode_s=0.0,
        decode_steps=0, stopped_by_token=False, first_token_s=0.2,
    )  # fmt: skip
    assert result.to_json()["decode_tokens_per_s"] == 0.0
