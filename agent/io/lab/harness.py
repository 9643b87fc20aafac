"""``open_lab`` and ``running_lab``: a lab for tests and benchmarks, owned by the caller.

The lab is made and removed by ``agent.io.lab.up`` (the path ``baton lab up`` takes), in this
process, which is then its owner: if this process is killed, the lab's guardian removes it.

A ``Lab`` places work inside a machine two ways:
- a process: ``argv_in(machine, argv)`` prefixes ``ip netns exec``; everything it starts
  stays inside;
- code of this process: ``run_in`` / ``run_trio_in`` run a function (or a whole ``trio.run``)
  in a fresh thread that has joined the machine's network namespace, so every socket it
  makes is the machine's (the namespace is a thread's attribute; threads it starts inherit it).
  The thread is never reused, so no other code lands in the machine by accident.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import trio

from agent.core.lab.topology import LabMachine, LabRecord, LinkChange, Topology

from .forwarder import stats as forwarder_stats
from .netns import NETNS_DIR, kill_namespace_processes
from .up import RunningLab, bring_up, change_access, change_link

__all__ = ["Lab", "open_lab", "running_lab"]

T = TypeVar("T")

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _join_netns(netns: str) -> None:
    """Move the calling thread into network namespace ``netns`` (Python 3.11 has no os.setns)."""
    fd = os.open(NETNS_DIR / netns, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into {netns}: {os.strerror(errno)}")
    finally:
        os.close(fd)


def _run_in_thread(netns: str, fn: Callable[[], T]) -> T:
    result: list[Any] = []
    failure: list[BaseException] = []

    def body() -> None:
        try:
            _join_netns(netns)
            result.append(fn())
        except BaseException as err:  # handed to the caller's thread
            failure.append(err)

    thread = threading.Thread(target=body, name=f"lab-{netns}", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


@dataclass
class Lab:
    """A running lab (``open_lab`` / ``running_lab``)."""

    record: LabRecord

    @property
    def name(self) -> str:
        return self.record.name

    @property
    def topology(self) -> Topology:
        return self.record.topology

    @property
    def machines(self) -> tuple[LabMachine, ...]:
        return self.record.machines

    def machine(self, name: str) -> LabMachine:
        return self.record.machine(name)

    def address(self, name: str) -> str:
        return self.record.machine(name).address

    def argv_in(self, machine: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``machine``."""
        return ["ip", "netns", "exec", self.record.machine(machine).netns, *argv]

    def run_in(self, machine: str, fn: Callable[[], T]) -> T:
        """``fn()`` in a fresh thread inside ``machine``'s network (blocks until it returns)."""
        return _run_in_thread(self.record.machine(machine).netns, fn)

    def trio_run_in(self, machine: str, async_fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``trio.run(async_fn, *args)`` in a fresh thread inside ``machine``'s network (for
        synchronous callers: tests, benchmarks)."""
        return _run_in_thread(self.record.machine(machine).netns, lambda: trio.run(async_fn, *args))

    def listen_addrs(self, machine: str) -> list[str]:
        """A libp2p listen address on ``machine`` (any port), for an owner running there."""
        return [f"/ip4/{self.address(machine)}/tcp/0"]

    async def run_trio_in(self, machine: str, async_fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``trio.run(async_fn, *args)`` in a fresh thread inside ``machine``'s network; the
        caller's trio loop waits for it in a worker thread.

        Cancellation: the inner run is not cancelled with the caller (it ends on its own)."""
        netns = self.record.machine(machine).netns
        return await trio.to_thread.run_sync(_run_in_thread, netns, lambda: trio.run(async_fn, *args))

    def link(self, a: str, b: str, change: LinkChange, *, both_ways: bool = True) -> None:
        """Change the link ``a`` -> ``b`` (and back) while the lab runs."""
        change_link(self.record, a, b, change, both_ways=both_ways)

    def access(self, machine: str, *, uplink_mbit: float = 0.0, downlink_mbit: float = 0.0) -> None:
        """Set ``machine``'s access link in Mbit/s (0: unlimited), shared by all its links."""
        change_access(self.record, machine, uplink_mbit, downlink_mbit)

    def cut(self, a: str, b: str) -> None:
        self.link(a, b, LinkChange(up=False))

    def heal(self, a: str, b: str) -> None:
        self.link(a, b, LinkChange(up=True))

    def isolate(self, machine: str, up: bool = False) -> None:
        """Cut (``up`` False) or heal every link of ``machine``: it drops off the network."""
        for other in self.topology.names:
            if other != machine:
                self.link(machine, other, LinkChange(up=up))

    def kill_machine(self, machine: str) -> list[int]:
        """SIGKILL everything running inside ``machine`` (it was switched off); the pids."""
        return kill_namespace_processes(self.record.machine(machine).netns)

    def stats(self) -> dict[str, Any]:
        """The forwarder's counters: per link (packets, delivered, drops by cause), per
        machine, its own CPU time."""
        return forwarder_stats(self.record.control_path)


def _default_name() -> str:
    return f"t{os.getpid()}"


@contextlib.contextmanager
def running_lab(topology: Topology, name: str | None = None, *, seed: int = 1) -> Iterator[Lab]:
    """A lab of ``topology`` (synchronous code: fixtures, benchmarks).

    Resource handling:
      Removed on exit (what runs inside its machines killed first), also when the body
      raises; SIGTERM to this process is not intercepted (the guardian sweeps).
    """
    running: RunningLab = bring_up(name or _default_name(), topology, seed=seed)
    try:
        yield Lab(running.record)
    finally:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # not half removed
        try:
            running.tear_down()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.asynccontextmanager
async def open_lab(topology: Topology, name: str | None = None, *, seed: int = 1) -> AsyncIterator[Lab]:
    """A lab of ``topology`` for trio code.

    Resource handling:
      Built and removed in a worker thread (``ip`` calls block); removal is shielded from
      cancellation and happens also when the body raises.
    """
    running: RunningLab = await trio.to_thread.run_sync(lambda: bring_up(name or _default_name(), topology, seed=seed))
    try:
        yield Lab(running.record)
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(running.tear_down)
