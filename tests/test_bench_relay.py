"""The pure parts of bench/relay.py: ratios to one client, the sustained part's figures, the markdown."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH_DIR))

import relay  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_scaling_gives_each_configuration_its_ratio_to_one_client(monkeypatch: pytest.MonkeyPatch) -> None:
    speed = {1: 50.0, 3: 100.0, 8: 120.0}

    def fake_run(_chats, n: int, temperature: float, per_client: int) -> dict:
        tps = speed[n] * (0.9 if temperature else 1.0)
        return {"clients": n, "temperature": temperature, "chats": n * per_client, "failed": 0, "failures": [],
                "tokens": 32 * n * per_client, "wall_s": 1.0, "tokens_per_s": tps, "first_token_s_median": 0.2}  # fmt: skip

    monkeypatch.setattr(relay, "run_clients", fake_run)
    monkeypatch.setattr(relay, "_cpu_by_role", lambda _groups: {"relay": 0.0, "nodes": 0.0, "clients": 0.0})
    scaling = relay.bench_scaling(None, {}, rounds=2, per_client=1)
    configs = scaling["configs"]
    assert configs["0.0/3"]["ratio_to_one_client_median"] == pytest.approx(2.0)
    assert configs["0.0/3"]["met"] is True, ">= 1.8x"
    assert configs["0.7/8"]["ratio_to_one_client_median"] == pytest.approx(2.4)
    assert configs["0.7/8"]["met"] is False, "< 2.5x"
    assert configs["0.0/1"]["met"] is None, "one client has no target"
    report = {"machine": {"summary": "a test machine"}, "tokens": 32, "rounds": 2, "chats": 1, "scaling": scaling}
    text = relay.markdown(report)
    assert "| 0.7 | 8 | 108.0 | 2.40x | 2.40, 2.40 | >= 2.5x: MISSED |" in text
    assert "| 0.7 | 8 | 0.00 | 0.00 | 0.00 |" in text, "the CPU a token, by role"


def test_sustain_counts_the_503s_and_the_wait_percentiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relay, "_cpu_by_role", lambda _groups: {"relay": 0.0})

    class FakeChats:
        def __init__(self) -> None:
            self.calls = 0

        def chat(self, index: int, temperature: float) -> dict:
            self.calls += 1
            if index % 1000 == 0 and index // 1000 == 0:  # client 0's chats: busy
                return {"ok": False, "status": 503, "error": "the swarm is busy", "tokens": 0, "started": 0.0,
                        "first_token_s": None, "total_s": 0.0}  # fmt: skip
            return {"ok": True, "status": 200, "tokens": 32, "started": 0.0, "first_token_s": 1.0, "total_s": 2.0}

    sustain = relay.bench_sustain(FakeChats(), {}, n_clients=2, duration_s=0.05)
    assert sustain["status_503"] >= 1 and sustain["other_errors"] == 0
    assert sustain["wait_s_p99"] == sustain["wait_s_mean"] == pytest.approx(1.0)
    assert sustain["met"] is False, "a 503 misses the target"
    assert relay._percentile([1.0, 2.0, 3.0, 100.0], 50) in (2.0, 3.0)
    text = relay.markdown({"machine": {"summary": "m"}, "tokens": 32, "rounds": 1, "chats": 1, "sustain": sustain})
    assert "MISSED" in text and "the swarm is busy" in text
