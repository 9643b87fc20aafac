"""Start and stop the native shard worker binary (``build/native/baton-worker``).

Owns the worker's process lifetime: argv, a private 0700 temp dir for its socket and log,
waiting until it answers Health, noticing when it dies while starting, and terminate /
kill on the way out. Talks to the worker only through ``agent.io.worker.client``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import trio

from agent.core.node.worker_wait import AUTO, worker_environment
from agent.core.wire.ranges import format_layers
from agent.core.wire.worker_records import WorkerInfo
from agent.io.cpu_policy import apply_cpu_policy, cpu_policy_from_env
from agent.io.log_tail import LOG_TAIL_BYTES
from agent.io.log_tail import log_tail as read_log_tail
from agent.io.settings import to_argv
from agent.io.worker.client import AsyncWorkerClient, ClientConfig
from agent.io.worker.config import WorkerConfig
from agent.io.worker.error import WorkerError

__all__ = [
    "WorkerBinaryNotFound",
    "WorkerHandle",
    "WorkerStartError",
    "count_computing_workers",
    "count_other_nodes",
    "find_worker_binary",
    "open_node_marker",
    "open_worker",
    "wait_environment",
    "worker_argv",
]

#: the checkout this package is in (agent/io/worker/process.py is three folders down)
REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_BINARY = REPO_ROOT / "build" / "native" / "baton-worker"
BINARY_ENV = "BATON_WORKER_BIN"

#: Unix socket paths are limited to 107 bytes + NUL (sun_path).
MAX_SOCKET_PATH_BYTES = 107

#: How much of the worker's log a start error shows.


class WorkerBinaryNotFound(FileNotFoundError):
    """The worker binary is missing (not built, or a wrong ``$BATON_WORKER_BIN``)."""


class WorkerStartError(RuntimeError):
    """The worker exited or did not become ready; carries its exit code and log tail."""

    def __init__(self, message: str, *, exit_code: int | None, log_tail: str) -> None:
        full = message if not log_tail else f"{message}\n--- worker log (tail) ---\n{log_tail}"
        super().__init__(full)
        self.exit_code = exit_code
        self.log_tail = log_tail


WORKDIR_PARENT = "/tmp"  # short: the socket path must fit sun_path
WORKDIR_PREFIX = "baton-"
OWNER_FILE = "owner.pid"  # the pid of the process that made the dir (it removes it on exit)
VOCAB_ONLY_FILE = "vocab-only"  # present in the dir of a --vocab-only worker (it computes nothing)
NODE_FILE = "node"  # present in a node agent's marker dir (``open_node_marker``): no worker in it


def _worker_dirs(parent: str) -> list[tuple[str, int]]:
    """This user's worker temp dirs under ``parent`` and the pid that made each. Never raises."""
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return []
    uid = os.getuid()
    found = []
    for entry in entries:
        if not entry.name.startswith(WORKDIR_PREFIX):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != uid:
                continue
            with open(os.path.join(entry.path, OWNER_FILE)) as owner:
                found.append((entry.path, int(owner.read().strip())))
        except (OSError, ValueError):
            continue  # not ours, or not a worker dir written by this version
    return found


def remove_stale_workdirs(parent: str = WORKDIR_PARENT) -> list[str]:
    """Remove this user's worker temp dirs whose owner process is gone (a node killed with
    SIGKILL cannot remove its own). Returns the dirs removed. Never raises."""
    removed = []
    for path, pid in _worker_dirs(parent):
        if _owner_alive(pid):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _census(parent: str, own_marker: str | None = None) -> tuple[int, int]:
    """``(computing workers, node agents other than own_marker's)`` of this user on this host
    now, from one scan of the live owned dirs under ``parent``. Never raises."""
    workers = nodes = 0
    for path, pid in _worker_dirs(parent):
        if not _owner_alive(pid):
            continue
        if os.path.exists(os.path.join(path, NODE_FILE)):
            nodes += path != own_marker
        elif not os.path.exists(os.path.join(path, VOCAB_ONLY_FILE)):
            workers += 1
    return workers, nodes


def count_computing_workers(parent: str = WORKDIR_PARENT) -> int:
    """How many workers that compute (not ``--vocab-only``) this user runs on this host now,
    by their temp dirs whose owner is alive (this process's own included). Never raises."""
    return _census(parent)[0]


def count_other_nodes(own_marker: str | None = None, parent: str = WORKDIR_PARENT) -> int:
    """How many Baton node agents of this user run on this host now, other than the one whose
    marker dir is ``own_marker`` (``open_node_marker``; nodes in one process count each other).
    Never raises."""
    return _census(parent, own_marker)[1]


def _new_owned_dir(parent: str, prefix: str, kind_file: str | None = None) -> str:
    """A fresh 0700 temp dir under ``parent`` owned by this process (``OWNER_FILE``), with the
    empty ``kind_file`` (``VOCAB_ONLY_FILE``, ``NODE_FILE``) written first, so that no scan
    ever takes it for a computing worker; stale dirs of dead owners are removed first."""
    remove_stale_workdirs(parent)
    path = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        if kind_file is not None:
            open(os.path.join(path, kind_file), "w").close()
        with open(os.path.join(path, OWNER_FILE), "w") as owner:
            owner.write(f"{os.getpid()}\n")
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path


@contextlib.contextmanager
def open_node_marker(parent: str = WORKDIR_PARENT) -> Iterator[str]:
    """Mark this host as running a Baton node agent while the block runs (a 0700 temp dir
    beside the workers', with ``owner.pid`` and ``NODE_FILE``); yields its path. Other nodes'
    ``auto`` wait policy sees it before this node's worker starts (``count_other_nodes``).
    Removed on exit; a SIGKILLed node's is removed by the next ``remove_stale_workdirs``."""
    marker = _new_owned_dir(parent, f"{WORKDIR_PREFIX}node-", NODE_FILE)
    try:
        yield marker
    finally:
        shutil.rmtree(marker, ignore_errors=True)


def wait_environment(requested: str = AUTO, *, node_marker: str | None = None) -> tuple[dict[str, str], str]:
    """This process's environment with the OpenMP wait policy ``agent.core.node.worker_wait`` picks
    for a worker started now (``requested``: auto, spin or sleep), and why, for the log.
    ``node_marker``: the starting node's own marker (``open_node_marker``), not counted."""
    workers, nodes = _census(WORKDIR_PARENT, node_marker)
    return worker_environment(requested, other_workers=workers, other_nodes=nodes, environment=os.environ)


def _owner_alive(pid: int) -> bool:
    """Whether the process that made a worker dir still runs (this one included)."""
    return pid == os.getpid() or _process_exists(pid)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


def find_worker_binary() -> Path:
    """The worker binary: ``$BATON_WORKER_BIN`` if set, else ``<repo>/build/native/baton-worker``.

    Raises:
      WorkerBinaryNotFound: the file is missing or not executable; the message says how
        to build it.
    """
    override = os.environ.get(BINARY_ENV)
    if override:
        path = Path(override)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise WorkerBinaryNotFound(f"${BINARY_ENV} = {override!r} is not an executable file")
        return path
    if not (DEFAULT_BINARY.is_file() and os.access(DEFAULT_BINARY, os.X_OK)):
        raise WorkerBinaryNotFound(
            f"worker binary not found at {DEFAULT_BINARY}: run `make native` in {REPO_ROOT} "
            f"(or set ${BINARY_ENV} to a built baton-worker)"
        )
    return DEFAULT_BINARY


def worker_argv(
    binary: str | os.PathLike,
    model_path: str | os.PathLike,
    begin: int,
    end: int | None,
    socket_path: str,
    *,
    vocab_only: bool = False,
    config: WorkerConfig | None = None,
    extra_args: Sequence[str] = (),
    **flags: Any,
) -> list[str]:
    """The worker's command line (``baton-worker --help``): ``config`` (default: every flag
    left to the binary's default) with the model, range and socket given here and ``flags``
    (``WorkerConfig`` field names: ``threads=2``, ``forward_socket=...``) over it.

    ``vocab_only``: ``--vocab-only`` instead of ``--layers`` (the worker holds no blocks, so
    ``begin, end`` must be ``0, None``).

    Raises:
      ValueError: ``vocab_only`` with a layer range other than ``0, None``.
      TypeError: a name in ``flags`` that is not a ``WorkerConfig`` field.
    """
    if vocab_only and (begin, end) != (0, None):
        raise ValueError(f"a vocab-only worker holds no layers: pass begin=0, end=None, not {begin}, {end}")
    launch: dict[str, Any] = {
        "model": str(model_path), "socket": socket_path, "vocab_only": vocab_only,
        "layers": None if vocab_only else format_layers(begin, end),
    }  # fmt: skip
    config = dataclasses.replace(config or WorkerConfig(**launch), **launch, **flags)
    return [str(binary), *to_argv(config), *extra_args]


@dataclasses.dataclass
class WorkerHandle:
    """A running, ready worker (yielded by ``open_worker``)."""

    client: AsyncWorkerClient
    info: WorkerInfo
    process: trio.Process
    socket_path: str
    log_path: str

    def log_tail(self, max_bytes: int = LOG_TAIL_BYTES) -> str:
        return read_log_tail(self.log_path, max_bytes)


async def _stop(process: trio.Process, grace_s: float) -> None:
    if process.returncode is None:
        process.terminate()
        with trio.move_on_after(grace_s):
            await process.wait()
    if process.returncode is None:
        process.kill()
        await process.wait()


async def _wait_ready(
    process: trio.Process,
    client: AsyncWorkerClient,
    socket_path: str,
    log_path: str,
    ready_timeout_s: float,
    poll_s: float,
) -> WorkerInfo:
    # Polling is the only way to learn that an external process finished loading its model;
    # the short, growing delay keeps startup latency low without spinning.
    delay_s = min(0.01, poll_s)
    with trio.move_on_after(ready_timeout_s):
        while True:
            if process.poll() is not None:
                raise WorkerStartError(
                    f"worker exited with code {process.returncode} while starting",
                    exit_code=process.returncode,
                    log_tail=read_log_tail(log_path),
                )
            if os.path.exists(socket_path):
                try:
                    health = await client.health(timeout_s=max(1.0, poll_s * 4))
                    if health.ready:
                        return await client.info()
                except WorkerError as error:
                    if error.code_name not in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
                        raise WorkerStartError(
                            f"worker answered Health with {error}",
                            exit_code=process.poll(),
                            log_tail=read_log_tail(log_path),
                        ) from error
            await trio.sleep(delay_s)
            delay_s = min(delay_s * 2, poll_s)
    raise WorkerStartError(
        f"worker not ready after {ready_timeout_s} s", exit_code=process.poll(), log_tail=read_log_tail(log_path)
    )


@contextlib.asynccontextmanager
async def open_worker(
    model_path: str | os.PathLike,
    begin: int,
    end: int | None,
    *,
    socket_path: str | None = None,
    config: WorkerConfig | None = None,
    vocab_only: bool = False,
    extra_args: Sequence[str] = (),
    ready_timeout_s: float = 120.0,
    stop_grace_s: float = 5.0,
    poll_s: float = 0.1,
    client_config: ClientConfig | None = None,
    binary: str | os.PathLike | None = None,
    forward_stream: bool = True,
    environment: Mapping[str, str] | None = None,
    **flags: Any,
) -> AsyncIterator[WorkerHandle]:
    """Start a worker for blocks ``[begin, end)`` of ``model_path`` and wait until it is ready.

    Args:
      model_path: the GGUF file.
      begin, end: the layer range; ``end=None`` means to the last block.
      socket_path: where the worker listens; default ``worker.sock`` in a fresh private
        temp dir (``/tmp/baton-XXXX``, mode 0700, short enough for ``sun_path``).
      config: the worker's flags (``WorkerConfig``; None: every one left to the binary's
        default); the model, range, socket and vocab-only mode given here replace its own.
      flags: ``WorkerConfig`` fields over ``config`` (``threads=1``, ``model_sha256=...``,
        ``data_listen="HOST:PORT"``: the data plane, port 0: any free one, which
        ``.info.data_port`` reports).
      vocab_only: start ``--vocab-only`` (no ``--layers``; pass ``begin=0, end=None``): the
        worker loads only the vocabulary, so a metadata-only sparse GGUF
        (``agent.io.gguf_sparse``) serves; it answers Info, Health, Tokenize, Detokenize and
        Vocabulary, and refuses Forward and the sequence calls (FAILED_PRECONDITION). The
        file is not hashed: Info's ``model_sha256`` is the one given here, else empty.
      extra_args: appended to the command line.
      ready_timeout_s: how long loading may take before giving up.
      stop_grace_s: how long SIGTERM may take before SIGKILL.
      poll_s: the longest pause between two readiness probes.
      client_config: deadlines and limits of the gRPC client.
      binary: the worker binary; default ``find_worker_binary()``.
      forward_stream: also start the worker's Forward stream (``forward.sock`` in the temp
        dir) and send Forward over it (``AsyncWorkerClient``); False: Forward over gRPC.
      environment: the worker's environment (None: this process's), for instance with the
        OpenMP wait policy of ``agent.core.node.worker_wait``.

    Yields:
      A ``WorkerHandle`` with ``.client`` (``AsyncWorkerClient``), ``.info`` (its Info),
      ``.process``, ``.socket_path`` and ``.log_path`` (its stdout + stderr).

    Raises:
      WorkerBinaryNotFound: no binary.
      WorkerStartError: the worker exited while starting (exit code + log tail), refused
        Health, or was not ready within ``ready_timeout_s``.
      ValueError: ``socket_path`` is too long for a Unix socket, ``vocab_only`` with a
        layer range, or the environment's ``BATON_CPU_POLICY`` is not one Baton knows
        (``agent.io.cpu_policy``).

    Resource handling:
      Owns the process, its temp dir (log, default socket) and the client's channel. On
      exit, normal or not, the client is closed, the process gets SIGTERM, then SIGKILL
      after ``stop_grace_s``, is waited for, and the socket file and temp dir are removed.

    Cancellation:
      Startup may be cancelled at any point. Shutdown runs shielded from cancellation and
      takes at most ``stop_grace_s`` plus the time a SIGKILLed process needs to exit.
    """
    binary = Path(binary) if binary is not None else find_worker_binary()
    workdir = _new_owned_dir(WORKDIR_PARENT, WORKDIR_PREFIX, VOCAB_ONLY_FILE if vocab_only else None)
    try:
        socket_path = socket_path or os.path.join(workdir, "worker.sock")
        forward_socket_path = os.path.join(workdir, "forward.sock") if forward_stream else None
        for path in (socket_path, forward_socket_path):
            if path is not None and len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
                raise ValueError(f"socket path {path!r} is longer than {MAX_SOCKET_PATH_BYTES} bytes")
        log_path = os.path.join(workdir, "worker.log")
        argv = worker_argv(
            binary, model_path, begin, end, socket_path, vocab_only=vocab_only, config=config,
            extra_args=extra_args, forward_socket=forward_socket_path, **flags,
        )  # fmt: skip
        with open(log_path, "wb") as log:
            # the worker stops when this process exits, even by SIGKILL (Linux; native/src/main.cpp)
            env = {**(os.environ if environment is None else environment), "BATON_WORKER_PARENT_PID": str(os.getpid())}
            cpu_policy = cpu_policy_from_env(env)  # (a bad value is refused before anything starts)
            process = await trio.lowlevel.open_process(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env)
        # the worker is Baton's whoever starts it (a node agent, a test, a benchmark's harness)
        apply_cpu_policy(process.pid, cpu_policy)
        try:
            client = AsyncWorkerClient(socket_path, client_config, forward_socket_path=forward_socket_path)
            try:
                info = await _wait_ready(process, client, socket_path, log_path, ready_timeout_s, poll_s)
                yield WorkerHandle(
                    client=client, info=info, process=process, socket_path=socket_path, log_path=log_path
                )
            finally:
                with trio.CancelScope(shield=True):
                    await client.aclose()
        finally:
            with trio.CancelScope(shield=True):
                await _stop(process, stop_grace_s)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(socket_path)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
