"""A worker does not outlive the process that started it (Linux: PR_SET_PDEATHSIG).

Real processes: a Python parent starts a real ``baton-worker`` and is then SIGKILLed (as a node
agent can be); the worker must stop on its own. Two ways of starting it: from a thread that has
already exited when the worker runs (trio forks from cached threads that retire after 10 s
idle, and the parent-death signal fires when the *forking thread* exits, so the worker must
tell that apart from its parent process dying), and through ``open_worker`` itself (what the
node agent does). Waits are bounded polls of the external processes.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

pytestmark = [
    pytest.mark.worker,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only"),
]

START_TIMEOUT_S = 60.0
EXIT_TIMEOUT_S = 10.0

# Starts the worker from a thread that exits before the worker is even loaded.
FROM_A_THREAD = """
import os, subprocess, sys, threading
from agent.io.worker.process import find_worker_binary, worker_argv

model, socket_path, log_path = sys.argv[1:4]
argv = worker_argv(find_worker_binary(), model, 0, None, socket_path, threads=1, max_sequences=1)
env = {**os.environ, "BATON_WORKER_PARENT_PID": str(os.getpid())}
started = {}

def spawn():
    with open(log_path, "wb") as log:
        started["worker"] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env)

thread = threading.Thread(target=spawn)
thread.start()
thread.join()  # the forking thread is gone
print(started["worker"].pid, log_path, flush=True)
sys.stdin.read()  # until killed
"""

# The node agent's own way: open_worker (trio forks from a thread of its cache).
THROUGH_OPEN_WORKER = """
import sys, trio
from agent.io.worker.process import open_worker

model, socket_path = sys.argv[1:3]

async def main():
    async with open_worker(model, 0, None, threads=1, max_sequences=1, socket_path=socket_path) as handle:
        print(handle.process.pid, handle.log_path, flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


def _poll(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout_s} s")
        time.sleep(0.02)


def _running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (the worker is not our child: whoever
    adopts it reaps it, maybe later)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("script", [FROM_A_THREAD, THROUGH_OPEN_WORKER], ids=["from-a-thread", "open_worker"])
def test_a_worker_stops_when_its_parent_is_killed(tmp_path: Path, qwen2_tiny_path: Path, script: str) -> None:
    socket_path = tmp_path / "w.sock"
    log_path = tmp_path / "worker.log"
    argv = [sys.executable, "-c", textwrap.dedent(script), str(qwen2_tiny_path), str(socket_path), str(log_path)]
    worker_pid = None
    with subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as parent:
        try:
            line = parent.stdout.readline()  # open_worker prints once the worker answers
            assert line.strip(), parent.stderr.read() if parent.poll() is not None else "no output"
            pid_text, log_text = line.split()
            worker_pid, log_path = int(pid_text), Path(log_text)
            assert psutil.Process(worker_pid).ppid() == parent.pid
            # Up and serving: it outlived the thread that forked it.
            _poll(socket_path.exists, START_TIMEOUT_S, "the worker did not bind its socket")
            assert _running(worker_pid), log_path.read_text(errors="replace")

            parent.send_signal(signal.SIGKILL)
            parent.wait(timeout=EXIT_TIMEOUT_S)
            _poll(lambda: not _running(worker_pid), EXIT_TIMEOUT_S, "the worker outlived its SIGKILLed parent")
            log = log_path.read_text(errors="replace")
            assert f"parent process {parent.pid} exited, stopping" in log, log
            assert not socket_path.exists()  # the clean shutdown path removed it
        finally:
            if parent.poll() is None:
                parent.kill()
            if worker_pid is not None and _running(worker_pid):
                os.kill(worker_pid, signal.SIGKILL)
            if log_path.parent != tmp_path:  # open_worker's own work dir (its parent was killed)
                shutil.rmtree(log_path.parent, ignore_errors=True)


def test_a_worker_whose_parent_is_already_gone_does_not_start(tmp_path: Path, qwen2_tiny_path: Path) -> None:
    from agent.io.worker.process import find_worker_binary, worker_argv

    argv = worker_argv(find_worker_binary(), qwen2_tiny_path, 0, None, str(tmp_path / "w.sock"), threads=1)
    # BATON_WORKER_PARENT_PID names the process that meant to start it; this one is not it.
    gone = subprocess.run(
        argv, env={**os.environ, "BATON_WORKER_PARENT_PID": str(os.getpid() + 1_000_000)},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert gone.returncode == 1
    assert "exited before the worker started" in gone.stderr
    assert not (tmp_path / "w.sock").exists()


def test_worker_dirs_of_dead_owners_are_removed_at_the_next_start(tmp_path: Path) -> None:
    from agent.io.worker.process import OWNER_FILE, WORKDIR_PREFIX, remove_stale_workdirs

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)  # reaped: no such process any more
    dirs = {}
    for name, pid in (("dead", dead_pid), ("alive", os.getpid()), ("parent", os.getppid())):
        path = tmp_path / f"{WORKDIR_PREFIX}{name}"
        path.mkdir()
        (path / OWNER_FILE).write_text(f"{pid}\n")
        (path / "worker.sock").write_text("")
        dirs[name] = path
    unowned = tmp_path / f"{WORKDIR_PREFIX}no-owner-file"  # being made right now, or not ours
    unowned.mkdir()
    other = tmp_path / "something-else"
    other.mkdir()
    (other / OWNER_FILE).write_text(f"{dead_pid}\n")
    assert remove_stale_workdirs(str(tmp_path)) == [str(dirs["dead"])]
    assert not dirs["dead"].exists()
    assert dirs["alive"].exists() and dirs["parent"].exists() and unowned.exists() and other.exists()
