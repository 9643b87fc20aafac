"""A worker starts with the wait policy its node chose, and a node can count the Baton workers
already computing on its host (``agent.io.worker.process``; the choice is
``agent.core.node.worker_wait``'s).

Real workers on the tiny qwen2 model; the count reads the same temp dirs the workers run in.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from agent.core.node.worker_wait import SLEEP, SLEEP_SPIN_COUNT, worker_environment
from agent.io.worker.process import (
    OWNER_FILE,
    VOCAB_ONLY_FILE,
    WORKDIR_PREFIX,
    count_computing_workers,
    count_other_nodes,
    open_node_marker,
    open_worker,
    remove_stale_workdirs,
    wait_environment,
)

pytestmark = [pytest.mark.worker, pytest.mark.timeout(120)]


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.decode().split("=", 1) for item in raw.split(b"\0") if b"=" in item)


def test_workers_are_counted_by_their_live_dirs_and_vocab_only_ones_are_not(tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)  # reaped: no such process any more
    for name, pid, vocab_only in (
        ("mine", os.getpid(), False),
        ("parent", os.getppid(), False),
        ("dead", dead_pid, False),
        ("vocab", os.getpid(), True),
    ):
        path = tmp_path / f"{WORKDIR_PREFIX}{name}"
        path.mkdir()
        (path / OWNER_FILE).write_text(f"{pid}\n")
        if vocab_only:
            (path / VOCAB_ONLY_FILE).write_text("")
    (tmp_path / f"{WORKDIR_PREFIX}no-owner-file").mkdir()
    other = tmp_path / "something-else"
    other.mkdir()
    (other / OWNER_FILE).write_text(f"{os.getpid()}\n")
    assert count_computing_workers(str(tmp_path)) == 2  # mine and parent
    assert count_computing_workers(str(tmp_path / "missing")) == 0


def test_a_worker_runs_with_the_environment_it_is_given_and_counts_while_it_runs(qwen2_tiny_path: Path) -> None:
    async def main() -> None:
        before = count_computing_workers()
        environment, _ = worker_environment(SLEEP, other_workers=before, environment=os.environ)
        async with open_worker(qwen2_tiny_path, 0, None, threads=2, environment=environment) as handle:
            env = _environ(handle.process.pid)
            assert env["GOMP_SPINCOUNT"] == str(SLEEP_SPIN_COUNT) and "OMP_WAIT_POLICY" not in env
            assert env["BATON_WORKER_PARENT_PID"] == str(os.getpid())
            assert count_computing_workers() == before + 1
        assert count_computing_workers() == before
        async with open_worker(qwen2_tiny_path, 0, None, threads=1) as handle:
            assert "OMP_WAIT_POLICY" not in _environ(handle.process.pid) or "OMP_WAIT_POLICY" in os.environ
        async with open_worker(qwen2_tiny_path, 0, None, vocab_only=True):
            assert count_computing_workers() == before  # loads no weights, computes nothing
        async with open_worker(qwen2_tiny_path, 0, None, threads=1):
            # auto, with a worker computing: sleep, unless the user's environment says otherwise
            environment, why = wait_environment()
            if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ):
                assert environment["GOMP_SPINCOUNT"] == str(SLEEP_SPIN_COUNT), why
                assert why == f"sleep ({before + 1} other Baton worker(s) on this host)"

    trio.run(main)


def test_the_trackers_reference_workers_wait_as_canary_worker_wait_says(tmp_path: Path, qwen2_tiny_path: Path) -> None:
    """``baton tracker serve --canary-worker-wait`` reaches the verifier's reference workers
    (a tracker on a host with nodes must be able to keep its workers off their cores)."""
    import hashlib

    from agent.io.tracker.cli import build_parser, tracker_config, verifier_config
    from agent.io.tracker.reference import ReferencePool
    from agent.io.tracker.verifier_api import VerifierConfig

    serve = ["serve", "--db", str(tmp_path / "t.db"), "--key", str(tmp_path / "t.key")]
    assert verifier_config(tracker_config(build_parser().parse_args(serve))).worker_wait == "auto"
    args = build_parser().parse_args([*serve, "--canary-worker-wait", "sleep", "--canary-threads", "2"])
    config = verifier_config(tracker_config(args))
    assert (config.worker_wait, config.threads) == ("sleep", 2)
    with pytest.raises(SystemExit):
        build_parser().parse_args([*serve, "--canary-worker-wait", "busy"])
    with pytest.raises(ValueError, match="worker_wait must be one of auto, spin, sleep, got 'busy'"):
        VerifierConfig(worker_wait="busy")

    sha256 = hashlib.sha256(qwen2_tiny_path.read_bytes()).hexdigest()

    async def main() -> None:
        for wait, expected in (("sleep", str(SLEEP_SPIN_COUNT)), ("spin", None)):
            async with trio.open_nursery() as nursery:
                pool = ReferencePool(nursery, VerifierConfig(threads=2, worker_wait=wait), ctx_size=64, batch_size=8)
                handle = await pool.get(str(qwen2_tiny_path), sha256, 0, None)
                env = _environ(handle.process.pid)
                assert env.get("GOMP_SPINCOUNT") == expected, (wait, env.get("GOMP_SPINCOUNT"))
                assert "OMP_WAIT_POLICY" not in env, wait
                nursery.cancel_scope.cancel()

    if {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ):
        pytest.skip("the environment sets the wait policy: spin would keep it")
    trio.run(main)


def test_a_node_marks_the_host_for_the_other_nodes_not_for_itself_and_not_as_a_worker(tmp_path: Path) -> None:
    parent = str(tmp_path)
    with open_node_marker(parent) as first, open_node_marker(parent) as second:
        assert os.path.isdir(first) and os.stat(first).st_mode & 0o777 == 0o700
        assert count_other_nodes(first, parent) == 1  # the second, even in this one process
        assert count_other_nodes(second, parent) == 1
        assert count_other_nodes(None, parent) == 2  # a tracker or a test: every node counts
        assert count_computing_workers(parent) == 0  # a marker is not a worker
    assert not os.path.exists(first) and not os.path.exists(second)  # removed on exit
    # a node killed with SIGKILL leaves its marker: it no longer counts, and is cleaned up
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    with open_node_marker(parent) as stale:
        Path(stale, OWNER_FILE).write_text(f"{int(dead.stdout)}\n")
        assert count_other_nodes(None, parent) == 0
        assert remove_stale_workdirs(parent) == [stale]


def test_auto_sleeps_for_a_worker_started_while_another_node_runs_on_the_host() -> None:
    if {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ):
        pytest.skip("the environment sets the wait policy: auto keeps it")
    with open_node_marker() as other, open_node_marker() as mine:
        environment, why = wait_environment(node_marker=mine)  # the default /tmp, as nodes use
        assert environment["GOMP_SPINCOUNT"] == str(SLEEP_SPIN_COUNT), why
        assert count_other_nodes(mine) >= 1 and other != mine


async def test_a_one_row_forward_may_take_fewer_threads_and_gives_the_same_bits(qwen2_tiny_path) -> None:
    """``--threads-decode``: a Forward whose micro-batch is one row (a lone session's decode
    step) runs on that many threads, larger ones on ``--threads`` (llama.cpp's n_threads and
    n_threads_batch); Info reports both, and the logits do not depend on it."""
    from agent.core.wire.worker_records import SeqInput

    async def run(**threads: int) -> tuple[tuple[int, int], list[bytes]]:
        async with open_worker(qwen2_tiny_path, 0, None, ctx_size=64, max_sequences=2, **threads) as worker:
            prompt = [1, 17, 42, 99, 7, 3]
            outs = [(await worker.client.forward([SeqInput(0, list(range(len(prompt))), prompt)]))[0]]
            for i in range(4):  # one row each, then two sequences' rows in one Forward
                outs.append((await worker.client.forward([SeqInput(0, [len(prompt) + i], [5 + i])]))[0])
            outs += await worker.client.forward([SeqInput(0, [len(prompt) + 4], [9]), SeqInput(1, [0], [9])])
            return (worker.info.n_threads, worker.info.n_threads_decode), [o.logits.tobytes() for o in outs]

    with trio.fail_after(60):
        default, bits = await run(threads=2)
        fewer, fewer_bits = await run(threads=2, threads_decode=1)
    assert default == (2, 2) and fewer == (2, 1)
    assert fewer_bits == bits
