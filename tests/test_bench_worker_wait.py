"""The pure parts of bench/worker_wait.py: medians per policy, sleep / spin, sleep / passive,
the passive environment, and the markdown."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH_DIR))

import worker_wait  # noqa: E402


def _runs(*pairs: tuple[float, float]) -> list[dict]:
    return [{"tokens_per_s": t, "cpu_ms_per_token": c} for t, c in pairs]


def test_the_summary_takes_medians_per_policy_and_the_ratio_of_sleep_to_spin() -> None:
    runs = {
        "alone, 1 session": {"spin": _runs((80.0, 20.0), (100.0, 18.0), (60.0, 30.0)), "sleep": _runs((50.0, 25.0), (70.0, 22.0), (55.0, 27.0)), "passive": _runs((40.0, 30.0), (44.0, 31.0), (30.0, 29.0))},
        "3 in series, 1 session": {"spin": _runs((30.0, 50.0), (40.0, 45.0)), "sleep": _runs((60.0, 20.0), (80.0, 24.0)), "passive": _runs((35.0, 22.0), (35.0, 26.0))},
    }  # fmt: skip
    summary = worker_wait.summarize(runs)
    alone = summary["alone, 1 session"]
    assert alone["spin"]["tokens_per_s"] == 80.0 and alone["spin"]["cpu_ms_per_token"] == 20.0
    assert alone["sleep"]["tokens_per_s"] == 55.0 and alone["sleep"]["cpu_ms_per_token"] == 25.0
    assert alone["spin"]["runs_tokens_per_s"] == [80.0, 100.0, 60.0]  # in run order
    assert round(alone["sleep_over_spin"], 4) == round(55.0 / 80.0, 4)
    assert round(alone["sleep_over_passive"], 4) == round(55.0 / 40.0, 4)
    series = summary["3 in series, 1 session"]
    assert series["sleep_over_spin"] == 70.0 / 35.0  # medians of two: their means

    report = {
        "machine": {"cpu_model": "Test CPU", "cores": 2, "ram_gib": 23.6, "platform": "Linux", "baton_commit": "abc1234"},
        "threads": 2, "tokens": 32, "rounds": 3, "situations": summary, "wall_s": 100.0,
    }  # fmt: skip
    md = worker_wait.markdown(report)
    assert (
        "| alone, 1 session | 80.0 | 55.0 | 40.0 | 0.69x | 1.38x | 20.0; 25.0; 30.0"
        " | 80.0, 100.0, 60.0; 50.0, 70.0, 55.0; 40.0, 44.0, 30.0 |"
    ) in md
    assert (
        "| 3 in series, 1 session | 35.0 | 70.0 | 35.0 | 2.00x | 2.00x | 47.5; 22.0; 24.0"
        " | 30.0, 40.0; 60.0, 80.0; 35.0, 35.0 |"
    ) in md
    assert "`GOMP_SPINCOUNT=1000`" in md and "`OMP_WAIT_POLICY=PASSIVE`" in md
    assert "Test CPU, 2 cores" in md and "Baton abc1234" in md


def test_passive_never_spins_and_replaces_the_users_wait_variables() -> None:
    user = {"PATH": "/bin", "GOMP_SPINCOUNT": "5", "OMP_WAIT_POLICY": "ACTIVE"}
    env = worker_wait.policy_environment("passive", user)
    assert env == {"PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE"}
    assert worker_wait.policy_environment("sleep", {"PATH": "/bin"}) == {"PATH": "/bin", "GOMP_SPINCOUNT": "1000"}
