"""Nothing Baton starts outlives its parent, however the parent ends (``agent.io.lifeline``).

Real processes throughout: a Python parent gives a child a lifeline (or starts a program with
``die_with_parent``), the test ends the parent, and the child must stop by itself. Then the
whole demo: ``baton demo --serve`` given SIGTERM or SIGKILL, and plain ``baton demo`` given
SIGTERM mid-generation; every process it started (tracker, nodes, relay, their workers) must be
gone, and with them their temp dirs. Waits are bounded polls of the external processes; every
process a test saw is SIGKILLed in a ``finally`` if it is still there.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import psutil
import pytest

from agent.harness.browser import chromium_available
from agent.io.lifeline import LIFELINE_ENV, die_with_parent
from agent.io.worker.process import OWNER_FILE, WORKDIR_PARENT, WORKDIR_PREFIX

pytestmark = pytest.mark.swarm

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")

START_TIMEOUT_S = 30.0
EXIT_TIMEOUT_S = 30.0  # a child's lifeline grace (10 s) plus its own stop, with room on a busy machine
DEMO_START_TIMEOUT_S = 240.0  # three nodes load their ranges on a 2-core machine shared with others

# A Baton child: watches its lifeline, writes who it is, then waits for signals. Handling
# SIGTERM it records it and exits; ignoring it, only the SIGKILL after the grace ends it.
LIFELINE_CHILD = """
import json, os, signal, sys
from agent.io.lifeline import LIFELINE_ENV, LifelineConfig, watch_lifeline

grace_s, on_term, marker = float(sys.argv[1]), sys.argv[2], sys.argv[3]
if on_term == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    def stop(signum, frame):
        with open(marker, "w") as f:
            f.write("SIGTERM")
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
fd = int(os.environ[LIFELINE_ENV])
watched = watch_lifeline(config=LifelineConfig(grace_s=grace_s))
print(json.dumps({"pid": os.getpid(), "watched": watched, "env_left": LIFELINE_ENV in os.environ,
                  "inheritable": os.get_inheritable(fd)}), flush=True)
while True:
    signal.pause()
"""

# The parent: gives the child above a lifeline (from a thread that is gone by the time the
# test acts: the lifeline follows the process, not the forking thread), then waits to be
# signalled, or exits on its own when told to (stdin closed).
LIFELINE_PARENT = """
import subprocess, sys, threading
from agent.io.lifeline import lifeline_for_child

child_script, grace_s, on_term, marker = sys.argv[1:5]

def start():
    env, fds = lifeline_for_child()
    subprocess.Popen([sys.executable, "-c", child_script, grace_s, on_term, marker], env=env, pass_fds=fds)

thread = threading.Thread(target=start)
thread.start()
thread.join()
sys.stdin.read()
"""

# A parent that starts a program that is not Baton's (sleep) with die_with_parent.
DYING_PARENT = """
import subprocess, sys
from agent.io.lifeline import die_with_parent

child = subprocess.Popen(["sleep", "600"], preexec_fn=die_with_parent())
print(child.pid, flush=True)
sys.stdin.read()
"""

# A die_with_parent made in one process and used in a fork of it: the forked process is not
# the parent it was armed for (as when the parent died before the child armed it), so the
# child must not run the program.
FOREIGN_PARENT = """
import os, subprocess, sys
from agent.io.lifeline import die_with_parent

arm = die_with_parent()
pid = os.fork()
if pid == 0:
    child = subprocess.Popen(["sleep", "600"], preexec_fn=arm)
    os._exit(child.wait())
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), flush=True)
"""

# A parent running Baton's headless-Chromium harness on a page that never loads (the test
# holds the server: one in the parent would refuse the browser once the parent is killed,
# and Chromium would exit on that alone).
BROWSER_PARENT = """
import sys, trio
from agent.harness.browser import dump_dom

print("started", flush=True)
trio.run(lambda: dump_dom(sys.argv[1], timeout_s=600))
"""


def _poll(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout_s} s")
        time.sleep(0.05)


def _running(proc: psutil.Process) -> bool:
    """True while ``proc`` (the same process: psutil checks its start time) exists and is not
    a zombie (an orphan is reaped by whoever adopts it, maybe later)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _left(procs: Iterable[psutil.Process]) -> list[str]:
    out = []
    for proc in procs:
        if _running(proc):
            with contextlib.suppress(psutil.Error):
                out.append(f"{proc.pid} {' '.join(proc.cmdline())[:160]}")
    return out


def _kill_all(procs: Iterable[psutil.Process]) -> None:
    for proc in procs:
        if _running(proc):
            with contextlib.suppress(psutil.Error):
                proc.kill()


def _family(root_pid: int) -> dict[int, psutil.Process]:
    """Every descendant of ``root_pid`` and every member of their process groups (the
    swarm's processes lead groups of their own, their workers in them)."""
    procs = {p.pid: p for p in psutil.Process(root_pid).children(recursive=True)}
    groups = set()
    for pid in procs:
        with contextlib.suppress(ProcessLookupError):
            groups.add(os.getpgid(pid))
    groups.discard(os.getpgid(0))
    for proc in psutil.process_iter():
        with contextlib.suppress(ProcessLookupError, psutil.Error):
            if proc.pid != root_pid and os.getpgid(proc.pid) in groups:
                procs.setdefault(proc.pid, proc)
    return procs


def _owned_dirs(pids: Iterable[int]) -> list[Path]:
    """The worker and node-marker temp dirs (``agent.io.worker.process``) owned by ``pids``."""
    wanted = set(pids)
    found = []
    for path in Path(WORKDIR_PARENT).glob(f"{WORKDIR_PREFIX}*"):
        with contextlib.suppress(OSError, ValueError):
            if int((path / OWNER_FILE).read_text().strip()) in wanted:
                found.append(path)
    return found


def _readline(stream, timeout_s: float, what: str) -> str:
    ready, _, _ = select.select([stream], [], [], timeout_s)
    if not ready:
        raise AssertionError(f"{what} within {timeout_s} s")
    return stream.readline()


@contextlib.contextmanager
def _parent(script: str, *args: str) -> Iterator[subprocess.Popen]:
    """A Python parent process running ``script``, in a session of its own; killed (its group
    too) on the way out."""
    argv = [sys.executable, "-c", textwrap.dedent(script), *args]
    parent = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        yield parent
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
        for stream in (parent.stdin, parent.stdout, parent.stderr):
            with contextlib.suppress(OSError):
                stream.close()


# --- the lifeline -----------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("how", "on_term"),
    [(signal.SIGKILL, "stop"), (signal.SIGTERM, "stop"), (None, "stop"), (signal.SIGKILL, "ignore")],
    ids=["parent-sigkill", "parent-sigterm", "parent-exits", "child-ignores-sigterm"],
)
def test_a_child_stops_when_its_parent_ends(tmp_path: Path, how: int | None, on_term: str) -> None:
    marker = tmp_path / "child-stopped"
    grace_s = "0.5" if on_term == "ignore" else "30"  # handling SIGTERM, it must not need the SIGKILL
    child = None
    with _parent(LIFELINE_PARENT, textwrap.dedent(LIFELINE_CHILD), grace_s, on_term, str(marker)) as parent:
        try:
            line = _readline(parent.stdout, START_TIMEOUT_S, "the child did not start")
            assert line, parent.stderr.read()
            info = json.loads(line)
            child = psutil.Process(info["pid"])
            assert info["watched"] is True
            assert info["env_left"] is False  # its own children get no stale lifeline
            assert info["inheritable"] is False
            assert child.ppid() == parent.pid and _running(child)

            if how is None:
                parent.stdin.close()  # the parent's script ends: a normal exit
            else:
                parent.send_signal(how)
            parent.wait(timeout=EXIT_TIMEOUT_S)
            _poll(lambda: not _running(child), EXIT_TIMEOUT_S, "the child outlived its parent")
            if on_term == "stop":
                assert marker.read_text() == "SIGTERM"  # it was asked to stop, not killed
            else:
                assert not marker.exists()
        finally:
            if child is not None:
                _kill_all([child])


@pytest.mark.timeout(30)
def test_a_lifeline_that_names_no_pipe_is_ignored() -> None:
    from agent.io.lifeline import watch_lifeline

    with open(os.devnull, "rb") as not_a_pipe:
        for value in ("not-a-number", "999999", str(not_a_pipe.fileno())):
            environ = {LIFELINE_ENV: value, "OTHER": "kept"}
            assert watch_lifeline(environ) is False
            assert environ == {"OTHER": "kept"}
    assert watch_lifeline({"OTHER": "x"}) is False


# --- programs that are not Baton's ------------------------------------------------------------


@linux_only
@pytest.mark.timeout(60)
def test_a_program_started_with_die_with_parent_stops_when_its_parent_is_killed() -> None:
    child = None
    with _parent(DYING_PARENT) as parent:
        try:
            line = _readline(parent.stdout, START_TIMEOUT_S, "the parent did not start sleep")
            assert line.strip(), parent.stderr.read()
            child = psutil.Process(int(line))
            assert child.ppid() == parent.pid and _running(child)
            parent.send_signal(signal.SIGKILL)
            parent.wait(timeout=EXIT_TIMEOUT_S)
            _poll(lambda: not _running(child), EXIT_TIMEOUT_S, "sleep outlived its SIGKILLed parent")
        finally:
            if child is not None:
                _kill_all([child])


@linux_only
@pytest.mark.timeout(60)
def test_die_with_parent_refuses_to_run_a_program_for_a_parent_that_is_gone() -> None:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FOREIGN_PARENT)], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"  # exited in preexec_fn, before exec: sleep never ran


@pytest.mark.timeout(30)
def test_die_with_parent_is_refused_off_the_main_thread_unless_the_thread_waits() -> None:
    caught: list[BaseException] = []
    made: list[object] = []

    def off_main() -> None:
        try:
            die_with_parent()
        except RuntimeError as error:
            caught.append(error)
        made.append(die_with_parent(waited=True))

    thread = threading.Thread(target=off_main)
    thread.start()
    thread.join()
    assert len(caught) == 1 and "main thread" in str(caught[0])
    assert len(made) == 1 and callable(made[0])


@linux_only
@pytest.mark.timeout(120)
@pytest.mark.skipif(not chromium_available(), reason="no Chromium (make deps installs it)")
def test_headless_chromium_and_its_helpers_stop_when_their_parent_is_killed() -> None:
    family: dict[int, psutil.Process] = {}
    temp_dirs: set[Path] = set()  # the harness's, left behind by the killed parent
    with (
        socket.create_server(("127.0.0.1", 0)) as server,  # never accepts: the page never loads
        _parent(BROWSER_PARENT, f"http://127.0.0.1:{server.getsockname()[1]}/") as parent,
    ):
        try:
            assert _readline(parent.stdout, START_TIMEOUT_S, "the parent did not start").strip()

            def helpers_up() -> bool:
                # the browser, its zygotes and at least one renderer: its process tree is whole
                family.update(_family(parent.pid))
                renderer = False
                for proc in family.values():
                    with contextlib.suppress(psutil.Error):
                        argv = proc.cmdline()
                        renderer |= "--type=renderer" in argv
                        data_dirs = [a.split("=", 1)[1] for a in argv if a.startswith("--user-data-dir=")]
                        temp_dirs.update(Path(d).parent for d in data_dirs)
                return renderer

            _poll(helpers_up, START_TIMEOUT_S * 2, "Chromium started no renderer")
            parent.send_signal(signal.SIGKILL)
            parent.wait(timeout=EXIT_TIMEOUT_S)
            _poll(lambda: not _left(family.values()), EXIT_TIMEOUT_S, f"left running: {_left(family.values())}")
        finally:
            _kill_all(family.values())
            for path in temp_dirs:
                if path.name.startswith("baton-chromium-"):
                    shutil.rmtree(path, ignore_errors=True)


# --- the demo ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _demo(args: list[str], workdir: Path) -> Iterator[tuple[subprocess.Popen, dict[int, psutil.Process]]]:
    """``baton demo ARGS`` in a session of its own; yields it and a dict that the test fills
    with the processes it saw. On the way out every one of them still running is SIGKILLed,
    and their temp dirs removed."""
    demo = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "demo", "--workdir", str(workdir), *args],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    seen: dict[int, psutil.Process] = {}
    try:
        yield demo, seen
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(demo.pid, signal.SIGKILL)
        _kill_all(seen.values())
        demo.wait()
        for path in _owned_dirs(seen):
            shutil.rmtree(path, ignore_errors=True)
        for stream in (demo.stdout, demo.stderr):
            stream.close()


def _logs(workdir: Path) -> str:
    logs = sorted(workdir.glob("logs/*.log"))
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in logs)


def _record_swarm(demo: subprocess.Popen, seen: dict[int, psutil.Process], workdir: Path) -> None:
    """Fill ``seen`` with the demo's processes: tracker, nodes and relay, each with a worker."""
    seen.update(_family(demo.pid))
    names = [" ".join(p.cmdline()) for p in seen.values() if _running(p)]
    roles = {role: sum(f"agent.cli {role}" in n for n in names) for role in ("tracker", "node", "relay")}
    workers = sum("baton-worker" in n for n in names)
    # a worker per node, and the relay's vocabulary worker once it has loaded it
    assert roles == {"tracker": 1, "node": 3, "relay": 1} and workers >= 3, (names, _logs(workdir))


def _assert_all_gone(demo: subprocess.Popen, seen: dict[int, psutil.Process], workdir: Path) -> None:
    _poll(lambda: not _left(seen.values()), EXIT_TIMEOUT_S, f"left running: {_left(seen.values())}\n{_logs(workdir)}")
    # each stopped cleanly, not killed: nodes and relay removed their workers' temp dirs
    assert _owned_dirs(seen) == [], _logs(workdir)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_demo_serve_leaves_nothing_running(tmp_path: Path, smollm2_path: Path, how: int) -> None:
    """``baton demo --serve`` given SIGTERM (kill, systemd, docker stop) stops its swarm and
    exits 0; given SIGKILL it cannot, and each process it started stops by itself."""
    with _demo(["--serve", "--model", str(smollm2_path)], tmp_path) as (demo, seen):
        line = _readline(demo.stdout, DEMO_START_TIMEOUT_S, "baton demo --serve printed nothing")
        assert line, f"exit {demo.poll()}: {demo.stderr.read()}\n{_logs(tmp_path)}"
        assert {"base_url", "api_key", "model"} <= set(json.loads(line))
        _record_swarm(demo, seen, tmp_path)

        demo.send_signal(how)
        code = demo.wait(timeout=EXIT_TIMEOUT_S)
        assert code == (0 if how == signal.SIGTERM else -signal.SIGKILL), demo.stderr.read()
        _assert_all_gone(demo, seen, tmp_path)


@pytest.mark.timeout(400)
def test_demo_given_sigterm_while_generating_stops_everything(tmp_path: Path, smollm2_path: Path) -> None:
    """Plain ``baton demo`` (streaming text): SIGTERM mid-generation stops the swarm, and the
    demo exits 128 + 15 as a shell reports a process a signal ended."""
    prompt = "Once upon a time"
    args = ["--model", str(smollm2_path), "--max-tokens", "1000", prompt]
    with _demo(args, tmp_path) as (demo, seen):
        streamed = ""
        deadline = time.monotonic() + DEMO_START_TIMEOUT_S
        while len(streamed) <= len(prompt):  # the prompt, then the first generated text
            remaining = deadline - time.monotonic()
            ready, _, _ = select.select([demo.stdout], [], [], max(0.0, remaining))
            assert ready, f"no generated text within {DEMO_START_TIMEOUT_S} s\n{_logs(tmp_path)}"
            piece = os.read(demo.stdout.fileno(), 4096).decode(errors="replace")
            assert piece, f"exit {demo.poll()}: {demo.stderr.read()}\n{_logs(tmp_path)}"
            streamed += piece
        _record_swarm(demo, seen, tmp_path)

        demo.send_signal(signal.SIGTERM)
        code = demo.wait(timeout=EXIT_TIMEOUT_S)
        stderr = demo.stderr.read()
        assert code == 128 + signal.SIGTERM, stderr
        assert "stopped by SIGTERM" in stderr
        _assert_all_gone(demo, seen, tmp_path)
