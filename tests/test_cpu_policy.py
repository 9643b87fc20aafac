"""agent.io.cpu_policy: every Baton process (and each worker) runs in the batch class; other
programs a benchmark starts do not; ``BATON_CPU_POLICY`` says otherwise or is refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from agent.io.cpu_policy import apply_cpu_policy, cpu_policy_from_env, kernel_default
from agent.io.worker.process import open_worker

pytestmark = [
    pytest.mark.worker,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's"),
]

REPO_ROOT = Path(__file__).resolve().parent.parent
_SLEEPER = [sys.executable, "-c", "import sys; sys.stdin.read()"]  # lives until its stdin closes


def _policy_of_child(**popen) -> int:
    child = subprocess.Popen(_SLEEPER, stdin=subprocess.PIPE, **popen)
    try:
        return os.sched_getscheduler(child.pid)
    finally:
        child.communicate(timeout=30)


def test_the_policy_comes_from_the_environment_and_a_wrong_one_is_refused() -> None:
    assert cpu_policy_from_env({}) == "batch"
    assert cpu_policy_from_env({"BATON_CPU_POLICY": " Normal "}) == "normal"
    with pytest.raises(ValueError, match="BATON_CPU_POLICY='fast': expected one of batch, normal"):
        cpu_policy_from_env({"BATON_CPU_POLICY": "fast"})
    with pytest.raises(ValueError, match="expected one of"):
        apply_cpu_policy(policy="idle")


def test_a_process_is_put_in_the_batch_class_and_back() -> None:
    child = subprocess.Popen(_SLEEPER, stdin=subprocess.PIPE, preexec_fn=kernel_default)
    try:
        assert os.sched_getscheduler(child.pid) == os.SCHED_OTHER
        assert apply_cpu_policy(child.pid, "batch") is True
        assert os.sched_getscheduler(child.pid) == os.SCHED_BATCH
        assert apply_cpu_policy(child.pid, "normal") is True
        assert os.sched_getscheduler(child.pid) == os.SCHED_OTHER
    finally:
        child.communicate(timeout=30)
    assert apply_cpu_policy(child.pid, "batch") is False  # gone: no error, nothing done


def test_a_baton_process_runs_batch_and_what_it_starts_as_not_baton_runs_in_the_default_class() -> None:
    # a Baton process (agent.cli) puts itself in the batch class; a child inherits it, unless
    # started with kernel_default (the benchmarks' llama.cpp tools)
    script = (
        "import os, subprocess, sys\n"
        "from agent.io.cpu_policy import apply_cpu_policy, kernel_default\n"
        "apply_cpu_policy()\n"
        "sleeper = [sys.executable, '-c', 'import os; print(os.sched_getscheduler(0))']\n"
        "inherited = subprocess.run(sleeper, capture_output=True, text=True, check=True).stdout.strip()\n"
        "reset = subprocess.run(sleeper, capture_output=True, text=True, check=True,\n"
        "                       preexec_fn=kernel_default).stdout.strip()\n"
        "print(os.sched_getscheduler(0), inherited, reset)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("BATON_CPU_POLICY", None)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(os.SCHED_BATCH), str(os.SCHED_BATCH), str(os.SCHED_OTHER)]
    assert _policy_of_child(preexec_fn=kernel_default) == os.SCHED_OTHER


def test_a_wrong_policy_stops_the_cli_with_a_clear_message() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "BATON_CPU_POLICY": "turbo"}
    out = subprocess.run(
        [sys.executable, "-m", "agent.cli", "node"], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 2
    assert "BATON_CPU_POLICY='turbo': expected one of batch, normal" in out.stderr


@pytest.mark.parametrize(("setting", "expected"), [(None, "SCHED_BATCH"), ("normal", "SCHED_OTHER")])
async def test_a_worker_runs_in_the_policy_whoever_starts_it(
    tmp_path: Path, qwen2_tiny_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str | None, expected: str
) -> None:
    # whatever class this test process is in, the worker gets Baton's policy
    if setting is None:
        monkeypatch.delenv("BATON_CPU_POLICY", raising=False)
    else:
        monkeypatch.setenv("BATON_CPU_POLICY", setting)
    socket_path = str(tmp_path / "w.sock")
    with trio.fail_after(60):
        async with open_worker(qwen2_tiny_path, 0, None, threads=1, max_sequences=1, socket_path=socket_path) as handle:
            assert os.sched_getscheduler(handle.process.pid) == getattr(os, expected)
