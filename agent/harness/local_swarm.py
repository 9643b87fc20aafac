"""A swarm of real processes on loopback: a tracker, several nodes and a relay, for the demo and tests.

Owns the processes' lifetimes and command lines (built as each role's config, its flags
rendered by ``agent.io.settings.to_argv``, so no flag is spelled here): a private
work dir with one key file per process, the tracker's SQLite db, one log per process; starting
the tracker and waiting for the address it writes to ``--addr-file``; starting, killing
(SIGKILL, as a vanished machine) and restarting nodes and the tracker (same db, key and port);
stopping everything with terminate, then kill. Readiness is learnt by polling (the address
file, then the tracker's routes through a client) while watching for the process dying.
Every process gets a lifeline (``agent.io.lifeline``): if the process that holds the swarm
ends without stopping it (SIGKILL, a crash), each one stops by itself.

The commands go through ``baton`` run by the current interpreter (``python -m agent.cli
tracker serve ...`` / ``... node ...``; ``command_prefix``).

Where each process runs is a ``Placement``: by default all on this host's loopback; on a lab
(``agent.io.lab``) each named process inside its machine, listening on the machine's address.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import trio

from agent.core.node.worker_wait import SLEEP
from agent.io.keys import load_or_create_key, peer_id_of
from agent.io.lifeline import lifeline_for_child
from agent.io.log_tail import LOG_TAIL_BYTES
from agent.io.log_tail import log_tail as read_log_tail
from agent.io.node.config import NodeConfig
from agent.io.relay.config import RelayConfig
from agent.io.settings import to_argv
from agent.io.tracker.config import TrackerConfig

if TYPE_CHECKING:
    from agent.core.wire.worker_records import WorkerHealth, WorkerInfo

__all__ = [
    "LocalSwarm",
    "LocalSwarmConfig",
    "Machines",
    "Placement",
    "ProcessDied",
    "SwarmProcess",
    "command_prefix",
    "open_local_swarm",
]


class ProcessDied(RuntimeError):
    """A swarm process exited (or never became ready); the message carries its log tail."""


def command_prefix(command: str) -> list[str]:
    """The argv that runs ``baton <command>`` with the current interpreter."""
    return [sys.executable, "-m", "agent.cli", command]


@dataclasses.dataclass
class SwarmProcess:
    """One process of the swarm, leading its own process group (with its worker children)."""

    name: str
    argv: list[str]
    process: subprocess.Popen
    log_path: Path
    key_path: Path
    peer_id: str

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def log_tail(self, max_bytes: int = LOG_TAIL_BYTES) -> str:
        return read_log_tail(self.log_path, max_bytes)

    def died(self, what: str) -> ProcessDied:
        return ProcessDied(
            f"{self.name} {what} (exit code {self.process.poll()})\n--- {self.name} log (tail) ---\n{self.log_tail()}"
        )

    def worker_sockets(self) -> list[str]:
        """The Unix sockets of the (not vocab-only) workers this process started: its process
        group's, read from /proc (a test's way to ask a hop's worker for its counters)."""
        sockets = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            with contextlib.suppress(OSError):
                if os.getpgid(int(entry)) != self.process.pid:
                    continue
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
                if b"--socket" in argv and b"--vocab-only" not in argv:
                    sockets.append(argv[argv.index(b"--socket") + 1].decode())
        return sockets

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the process and every process it started (its group)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signum)

    async def stop(self, grace_s: float) -> None:
        """SIGTERM the group, SIGKILL it after ``grace_s``, and reap the process."""
        self.signal_group(signal.SIGTERM)
        deadline = trio.current_time() + grace_s
        while self.alive and trio.current_time() < deadline:
            await trio.sleep(0.02)
        self.signal_group(signal.SIGKILL)  # also reaches children that outlived their parent
        await trio.to_thread.run_sync(self.process.wait)

    def stop_nowait(self, grace_s: float) -> None:
        """``stop`` for synchronous code (test fixtures)."""
        self.signal_group(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=grace_s)
        self.signal_group(signal.SIGKILL)
        self.process.wait()


LOOPBACK = "127.0.0.1"


class Machines(Protocol):
    """What a placement uses of a lab (``agent.io.lab.harness.Lab``; not imported, so that the
    demo does not load the lab's namespaces and libc bindings)."""

    def address(self, name: str) -> str:
        """The address of machine ``name``."""
        ...

    def argv_in(self, machine: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``machine``."""
        ...


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where each process of a swarm runs: ``machines`` maps a process name (``tracker``,
    ``relay``, a node's name) to a machine of ``lab``; a process not named (or no lab) runs on
    this host and listens on loopback."""

    lab: Machines | None = None
    machines: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def host(self, name: str) -> str:
        """The address process ``name`` listens on."""
        machine = self.machines.get(name)
        return self.lab.address(machine) if self.lab is not None and machine else LOOPBACK

    def argv(self, name: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run where process ``name`` belongs."""
        machine = self.machines.get(name)
        return self.lab.argv_in(machine, argv) if self.lab is not None and machine else list(argv)


@dataclasses.dataclass(frozen=True)
class LocalSwarmConfig:
    """A loopback swarm's settings.

    ``model_path`` is registered with the tracker as ``model_alias`` and offered by every node.
    ``heartbeat_timeout_ms``: after this long without heartbeats the tracker drops a node.
    ``start_timeout_s``: how long the tracker may take to write its address.
    ``stop_grace_s``: SIGTERM -> SIGKILL delay. ``threads``: per node's worker.
    ``worker_wait``: every node's ``--worker-wait``; ``sleep`` by default here, because every
    node of a local swarm shares this machine's cores (``agent.core.node.worker_wait``; ``auto``
    would find the other workers only once they run, and nodes start their workers at once).
    ``workdir``: keys, db and logs (default: a fresh temp dir, removed on close).
    ``tracker_args`` / ``node_args`` / ``relay_args``: appended to every tracker / node / relay
    command line.
    ``canary_interval_s``: the tracker's ``--canary-interval-s``; 0 (the default here, not the
    CLI's): no canary checks, so that a READY range is routed at once and the tracker starts no
    workers of its own (tests that check integrity set it, or pass it in ``tracker_args``).
    ``placement``: where each process runs (default: all on loopback).
    ``max_sequences``: every node's ``--max-sequences`` (None: the worker's default).
    ``trust_relay``: every node trusts the relay's peer id (``--trusted-owner``), as an operator
    who runs both would: the relay, one owner for many users, may hold a range's sequences
    beyond one owner's share. Off by default: a trusted owner that never comes would keep a
    reserve of every range from the other owners of a test.
    """

    model_path: Path
    model_alias: str = "smollm2"
    heartbeat_timeout_ms: int = 5000
    threads: int = 1
    worker_wait: str = SLEEP
    start_timeout_s: float = 60.0
    stop_grace_s: float = 5.0
    workdir: Path | None = None
    tracker_args: tuple[str, ...] = ()
    node_args: tuple[str, ...] = ()
    relay_args: tuple[str, ...] = ()
    canary_interval_s: float = 0.0
    placement: Placement = Placement()
    max_sequences: int | None = None
    trust_relay: bool = False


class LocalSwarm:
    """The processes of a loopback swarm (made by ``open_local_swarm``)."""

    def __init__(self, config: LocalSwarmConfig, workdir: Path) -> None:
        self.config = config
        self.workdir = workdir
        self.tracker: SwarmProcess | None = None
        self.tracker_addr = ""
        self.nodes: dict[str, SwarmProcess] = {}
        self.relay: SwarmProcess | None = None
        self.relay_url = ""
        self._relay_listen = f"{config.placement.host('relay')}:0"
        self._tracker_listen = f"/ip4/{config.placement.host('tracker')}/tcp/0"
        self._killed: set[str] = set()

    def worker_health(self) -> list[tuple[WorkerInfo, WorkerHealth]]:
        """Every node's (not vocab-only) workers that answer now: each one's Info and Health
        (a benchmark's or test's way to read the hops' counters; blocking gRPC calls)."""
        from agent.io.worker.client import WorkerClient
        from agent.io.worker.error import WorkerError

        found = []
        for node in self.nodes.values():
            for socket in node.worker_sockets():
                with WorkerClient(socket, timeout_s=10.0) as worker, contextlib.suppress(WorkerError):
                    found.append((worker.info(), worker.health()))
        return found

    # --- paths and keys ------------------------------------------------------------------------

    def key_path(self, name: str) -> Path:
        return self.workdir / "keys" / f"{name}.key"

    def peer_id(self, name: str) -> str:
        """The peer id of process ``name`` (its key is created on first use)."""
        return peer_id_of(load_or_create_key(self.key_path(name)))

    @property
    def db_path(self) -> Path:
        return self.workdir / "tracker.db"

    @property
    def addr_file(self) -> Path:
        return self.workdir / "tracker.addr"

    @property
    def relay_db_path(self) -> Path:
        return self.workdir / "relay.db"

    @property
    def relay_addr_file(self) -> Path:
        return self.workdir / "relay.addr"

    # --- command lines (each role's config, rendered) ------------------------------------------

    def relay_config(self) -> RelayConfig:
        """The relay's settings in this swarm (its work dir's db, key, address file and cache)."""
        return RelayConfig(
            tracker=self.tracker_addr,
            listen=self._relay_listen,
            p2p_listen=f"/ip4/{self.config.placement.host('relay')}/tcp/0",
            db=self.relay_db_path,
            key=self.key_path("relay"),
            addr_file=self.relay_addr_file,
            cache_dir=self.workdir / "relay-cache",
        )

    def relay_argv(self, extra_args: Sequence[str] = ()) -> list[str]:
        return [
            *command_prefix("relay"), "serve", *to_argv(self.relay_config()), *self.config.relay_args, *extra_args
        ]  # fmt: skip

    def tracker_config(self) -> TrackerConfig:
        """The tracker's settings in this swarm (its work dir's db, key and address file; what
        nodes must run is the tracker process's own checkout's)."""
        c = self.config
        return TrackerConfig(
            db=str(self.db_path),
            key_file=str(self.key_path("tracker")),
            listen=self._tracker_listen,
            addr_file=str(self.addr_file),
            register_model=(f"{c.model_path}:{c.model_alias}",),
            heartbeat_timeout_ms=c.heartbeat_timeout_ms,
            canary_interval_s=c.canary_interval_s,
        )

    def tracker_argv(self) -> list[str]:
        return [*command_prefix("tracker"), "serve", *to_argv(self.tracker_config()), *self.config.tracker_args]

    def node_argv(
        self,
        name: str,
        memory_bytes: int,
        extra_args: Sequence[str] = (),
        *,
        listen: str | None = None,
        relay: bool = False,
        model: bool = True,
        command: Sequence[str] | None = None,
    ) -> list[str]:
        c = self.config
        if listen is None and c.placement.host(name) != LOOPBACK:
            listen = f"/ip4/{c.placement.host(name)}/tcp/0"
        config = NodeConfig(
            tracker=self.tracker_addr,
            key_file=str(self.key_path(name)),
            model_files=(str(c.model_path),) if model else (),
            memory_bytes=memory_bytes,
            threads=c.threads,
            worker_wait=c.worker_wait,
            relay=relay,
            listen=NodeConfig.listen if listen is None else listen,
            max_sequences=c.max_sequences,
            trusted_owners=(self.peer_id("relay"),) if c.trust_relay else (),
        )
        prefix = list(command) if command is not None else command_prefix("node")
        return [*prefix, *to_argv(config), *c.node_args, *extra_args]

    # --- processes -----------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> SwarmProcess:
        argv = self.config.placement.argv(name, argv)
        log_path = self.workdir / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        peer_id = self.peer_id(name)
        with open(log_path, "ab") as log:
            log.write(f"\n=== {' '.join(argv)}\n".encode())
            log.flush()
            # a lifeline: it stops when this process ends, even by SIGKILL, though in a session
            # of its own no signal to this one's group reaches it
            env, lifeline = lifeline_for_child({**os.environ, "PYTHONUNBUFFERED": "1"})
            # its own process group: killing a "machine" kills its workers too
            process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                env=env, pass_fds=lifeline,
            )  # fmt: skip
        return SwarmProcess(name, argv, process, log_path, self.key_path(name), peer_id)

    async def start_tracker(self) -> str:
        """Start the tracker (again: same db, key and port) and return its multiaddr.

        Raises:
          ProcessDied: it exited, or wrote no address within ``start_timeout_s``.
        """
        if self.tracker is not None and self.tracker.alive:
            raise RuntimeError("the tracker is already running")
        with contextlib.suppress(FileNotFoundError):
            self.addr_file.unlink()
        self.tracker = self._spawn("tracker", self.tracker_argv())
        addr = await self._wait_addr_file(self.tracker)
        if not self.tracker_addr:
            # restarts listen on the same port, so nodes and clients keep the address
            self._tracker_listen = addr.rpartition("/p2p/")[0]
        self.tracker_addr = addr
        return addr

    async def _wait_addr_file(self, proc: SwarmProcess) -> str:
        delay_s = 0.01
        with trio.move_on_after(self.config.start_timeout_s):
            while True:
                if not proc.alive:
                    raise proc.died("exited while starting")
                try:
                    lines = self.addr_file.read_text().split()
                except FileNotFoundError:
                    lines = []
                mine = [line for line in lines if line.endswith(f"/p2p/{proc.peer_id}")]
                if mine:
                    return mine[0]
                await trio.sleep(delay_s)
                delay_s = min(delay_s * 2, 0.2)
        raise proc.died(f"wrote no address to {self.addr_file} within {self.config.start_timeout_s} s")

    async def stop_tracker(self, *, kill: bool = True) -> None:
        """SIGKILL (default) or terminate the tracker and wait for it."""
        if self.tracker is None:
            return
        if kill:
            self.tracker.signal_group(signal.SIGKILL)
        await self.tracker.stop(self.config.stop_grace_s)

    async def start_relay(self, extra_args: Sequence[str] = (), *, command: Sequence[str] | None = None) -> str:
        """Start the relay (again: same db, key and port) and return its base URL.

        ``command``: the argv prefix of another program that takes ``baton relay``'s arguments
        (None: ``baton relay``); a benchmark profiles the relay this way.

        Raises:
          ProcessDied: it exited, or wrote no address within ``start_timeout_s``.
        """
        if not self.tracker_addr:
            raise RuntimeError("start the tracker first")
        if self.relay is not None and self.relay.alive:
            raise RuntimeError("the relay is already running")
        with contextlib.suppress(FileNotFoundError):
            self.relay_addr_file.unlink()
        argv = self.relay_argv(extra_args)
        if command is not None:
            argv = [*command, *argv[len(command_prefix("relay")) :]]
        self.relay = self._spawn("relay", argv)
        delay_s = 0.01
        url = ""
        with trio.move_on_after(self.config.start_timeout_s):
            while not url:
                if not self.relay.alive:
                    raise self.relay.died("exited while starting")
                with contextlib.suppress(FileNotFoundError):
                    url = self.relay_addr_file.read_text().strip()
                if not url:
                    await trio.sleep(delay_s)
                    delay_s = min(delay_s * 2, 0.2)
        if not url:
            raise self.relay.died(f"wrote no address to {self.relay_addr_file} within {self.config.start_timeout_s} s")
        self._relay_listen = url.removeprefix("http://")  # restarts keep the port
        self.relay_url = url
        return url

    async def stop_relay(self, *, kill: bool = False) -> None:
        """Terminate (or SIGKILL) the relay and wait for it."""
        if self.relay is None:
            return
        if kill:
            self.relay.signal_group(signal.SIGKILL)
        await self.relay.stop(self.config.stop_grace_s)

    def add_relay_key(self, name: str, *, shareable_prefixes: bool = False, **limits: int | None) -> str:
        """A new API key of the relay's db (``tokens_per_day``, ``requests_per_minute``,
        ``max_concurrent``, ``--shareable-prefixes``), as ``baton relay keys add`` makes it; an
        existing key of that name is revoked first."""
        from agent.core.relay.quotas import KeyLimits
        from agent.io.relay.store import KeyExistsError, open_relay_store

        key_limits = KeyLimits(
            limits.get("tokens_per_day"), limits.get("requests_per_minute"), limits.get("max_concurrent")
        )
        with open_relay_store(self.relay_db_path) as store:
            try:
                return store.create_key(name, key_limits, shareable_prefixes=shareable_prefixes)
            except KeyExistsError:  # a kept work dir: the old key was printed once and is gone
                store.revoke_key(name)
                return store.create_key(name, key_limits, shareable_prefixes=shareable_prefixes)

    def start_node(
        self,
        name: str,
        memory_bytes: int,
        extra_args: Sequence[str] = (),
        *,
        listen: str | None = None,
        relay: bool = False,
        model: bool = True,
        command: Sequence[str] | None = None,
    ) -> SwarmProcess:
        """Start node ``name`` (its key: ``key_path(name)``) offering ``memory_bytes``.

        ``listen``: its ``--listen`` (None: the default, loopback; ``"none"``: no direct
        address). ``relay``: reachable through the tracker's circuit relay (``--relay``).
        ``model=False``: without ``--model`` (pass ``--models-dir DIR`` in ``extra_args``: it
        fetches the ranges it is assigned).
        ``command``: the argv prefix of another program that takes ``baton node``'s arguments
        (None: ``baton node``); tests start a cheating node this way
        (``agent.testing.faulty_node.FAULTY_NODE_COMMAND``, with its own flags in ``extra_args``).
        It registers by itself; wait for its ranges through the tracker's routes.
        """
        if not self.tracker_addr:
            raise RuntimeError("start the tracker first")
        if name in self.nodes and self.nodes[name].alive:
            raise RuntimeError(f"node {name} is already running")
        argv = self.node_argv(name, memory_bytes, extra_args, listen=listen, relay=relay, model=model, command=command)
        proc = self._spawn(name, argv)
        self.nodes[name] = proc
        self._killed.discard(name)  # a restarted node that dies is a failure again
        return proc

    async def kill_node(self, name: str) -> None:
        """SIGKILL node ``name`` and its workers (a machine that vanished) and reap it."""
        await trio.to_thread.run_sync(self.kill_node_nowait, name)

    def kill_node_nowait(self, name: str) -> None:
        """``kill_node`` for synchronous code (benchmarks' chaos timelines)."""
        proc = self.nodes[name]
        proc.signal_group(signal.SIGKILL)
        proc.process.wait()
        self._killed.add(name)

    def check_alive(self) -> None:
        """Raise ``ProcessDied`` for the first process that exited without being killed here."""
        for name, proc in [("tracker", self.tracker), ("relay", self.relay), *self.nodes.items()]:
            if proc is not None and not proc.alive and name not in self._killed:
                raise proc.died("exited")

    def logs(self) -> str:
        """Every process's log tail (for failure messages)."""
        procs = [p for p in [self.tracker, self.relay, *self.nodes.values()] if p is not None]
        return "\n".join(f"--- {p.name} ({p.peer_id}, exit {p.process.poll()}) ---\n{p.log_tail()}" for p in procs)

    def _procs(self) -> list[SwarmProcess]:
        return [p for p in [self.relay, *self.nodes.values(), self.tracker] if p is not None]

    async def aclose(self) -> None:
        """Stop every process (terminate, then kill after ``stop_grace_s``), concurrently."""
        async with trio.open_nursery() as nursery:
            for proc in self._procs():
                nursery.start_soon(proc.stop, self.config.stop_grace_s)

    def close_nowait(self) -> None:
        """``aclose`` for synchronous code (module-scoped test fixtures)."""
        procs = self._procs()
        for proc in procs:
            proc.signal_group(signal.SIGTERM)
        for proc in procs:
            proc.stop_nowait(self.config.stop_grace_s)


@contextlib.asynccontextmanager
async def open_local_swarm(config: LocalSwarmConfig) -> AsyncIterator[LocalSwarm]:
    """A ``LocalSwarm`` in ``config.workdir`` (or a fresh private temp dir).

    Resource handling:
      Every process started through it is stopped on exit (shielded from cancellation); a
      temp dir made here is removed.
    """
    made = config.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="baton-swarm-")) if config.workdir is None else Path(config.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    os.chmod(workdir, 0o700)
    swarm = LocalSwarm(config, workdir)
    try:
        yield swarm
    finally:
        with trio.CancelScope(shield=True):
            await swarm.aclose()
        if made:
            shutil.rmtree(workdir, ignore_errors=True)
