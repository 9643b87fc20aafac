"""How a worker's idle threads wait (``agent.core.node.worker_wait``): pure, so each rule is checked
on plain values."""

from __future__ import annotations

import pytest

from agent.core.node.worker_wait import AUTO, SLEEP, SLEEP_SPIN_COUNT, SPIN, worker_environment

pytestmark = pytest.mark.unit

BASE = {"PATH": "/usr/bin", "HOME": "/root"}


def test_auto_spins_for_a_worker_alone_on_its_host_and_passes_the_environment_on() -> None:
    env, why = worker_environment(AUTO, other_workers=0, environment=BASE)
    assert env == BASE
    assert why == "spin (the only Baton worker on this host)"


def test_auto_sleeps_when_other_baton_workers_share_the_host() -> None:
    env, why = worker_environment(AUTO, other_workers=2, environment=BASE)
    # a short spin, then sleep: not PASSIVE, whose futex at every barrier of a Forward costs
    # more than the wait (agent.core.node.worker_wait)
    assert env == {**BASE, "GOMP_SPINCOUNT": "1000"}
    assert "OMP_WAIT_POLICY" not in env
    assert why == "sleep (2 other Baton worker(s) on this host)"


def test_auto_sleeps_when_another_baton_node_runs_here_before_its_worker_does() -> None:
    # nodes started together load their workers one after another: the first must not spin
    env, why = worker_environment(AUTO, other_workers=0, other_nodes=2, environment=BASE)
    assert env == {**BASE, "GOMP_SPINCOUNT": str(SLEEP_SPIN_COUNT)}
    assert why == "sleep (2 other Baton node(s) on this host)"
    env, why = worker_environment(AUTO, other_workers=1, other_nodes=2, environment=BASE)
    assert why == "sleep (1 other Baton worker(s) on this host)"


@pytest.mark.parametrize("preset", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "1000"}])
def test_auto_keeps_what_the_user_set_in_the_environment(preset: dict[str, str]) -> None:
    env, why = worker_environment(AUTO, other_workers=3, environment={**BASE, **preset})
    assert env == {**BASE, **preset}
    ((name, value),) = preset.items()
    assert why == f"as the environment says ({name}={value})"


def test_an_explicit_choice_overrides_the_environment() -> None:
    preset = {**BASE, "OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "30000"}
    slept, why = worker_environment(SLEEP, other_workers=0, environment=preset)
    assert slept == {**BASE, "GOMP_SPINCOUNT": str(SLEEP_SPIN_COUNT)}  # the user's ACTIVE is dropped
    assert why == "sleep (--worker-wait sleep)"
    spun, why = worker_environment(SPIN, other_workers=5, environment=preset)
    assert spun == BASE  # libgomp's own default: spin a while, then sleep
    assert why == "spin (--worker-wait spin)"


def test_sleep_spins_for_microseconds_not_milliseconds() -> None:
    # libgomp's default is 300,000 rounds (milliseconds); 0 would be PASSIVE's futex at every
    # barrier. Between the two, and far nearer the short end.
    assert 100 <= SLEEP_SPIN_COUNT <= 10_000


def test_the_callers_environment_is_not_changed() -> None:
    preset = {**BASE, "GOMP_SPINCOUNT": "1"}
    worker_environment(SLEEP, other_workers=0, environment=preset)
    assert preset == {**BASE, "GOMP_SPINCOUNT": "1"}


def test_bad_values_are_refused_with_what_was_wrong() -> None:
    with pytest.raises(ValueError, match="worker wait must be one of auto, spin, sleep, got 'busy'"):
        worker_environment("busy", other_workers=0, environment=BASE)
    with pytest.raises(ValueError, match="other_workers must be >= 0, got -1"):
        worker_environment(AUTO, other_workers=-1, environment=BASE)
    with pytest.raises(ValueError, match="other_nodes must be >= 0, got -2"):
        worker_environment(AUTO, other_workers=0, other_nodes=-2, environment=BASE)
