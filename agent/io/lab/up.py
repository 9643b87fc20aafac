"""Bringing a lab up and down: the one code path behind ``baton lab up`` and ``open_lab``.

Owns the order of the steps. Up: sweep labs whose owner is gone; refuse a name that a live
lab holds; write the lab down (``state``) and start its guardian; make a namespace per
machine, a TUN device per machine moved into it as ``wan0`` with the machine's address;
refuse to go on if any namespace routes outside 198.18.0.0/15; start the forwarder on the
TUN fds and tell it the topology. Down, in reverse: kill what runs inside the machines, stop
the forwarder, remove the namespaces and the record. The process that calls ``bring_up`` is
the lab's owner; if it ends without ``tear_down`` (SIGKILL), the guardian sweeps.

Synchronous (a few hundred milliseconds of ``ip`` calls); needs root.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
from dataclasses import dataclass

from agent.core.lab.topology import (
    LabError,
    LabMachine,
    LabRecord,
    LinkChange,
    Topology,
    access_command,
    check_lab_name,
    forwarder_setup_commands,
    link_change_command,
    machine_address,
    namespace_name,
)

from .forwarder import ForwarderProcess, control_request, start_forwarder
from .guardian import start_guardian
from .netns import (
    check_routes_stay_in_lab,
    configure_machine,
    create_namespaces,
    delete_namespace,
    kill_namespace_processes,
    open_tun,
    require_lab_privileges,
)
from .state import lab_dir, live_record, remove_record, sweep_stale_labs, write_record

__all__ = ["RunningLab", "bring_up", "change_access", "change_link", "stop_owner"]

log = logging.getLogger(__name__)

CONTROL_FILE = "control.sock"
FORWARDER_LOG = "forwarder.log"


@dataclass
class RunningLab:
    """A lab this process owns (made by ``bring_up``)."""

    record: LabRecord
    forwarder: ForwarderProcess
    guardian: subprocess.Popen
    guardian_pipe: int

    def tear_down(self) -> None:
        """Kill what runs inside the machines, stop the forwarder, remove the namespaces and
        the record, and release the guardian (which then finds nothing to sweep)."""
        for machine in self.record.machines:
            kill_namespace_processes(machine.netns)
        self.forwarder.stop()
        for machine in self.record.machines:
            delete_namespace(machine.netns)
        remove_record(self.record.name)
        _release(self.guardian, self.guardian_pipe)


GUARDIAN_EXIT_TIMEOUT_S = 10.0


def _release(guardian: subprocess.Popen, pipe: int) -> None:
    """Close the guardian's pipe (it finds nothing left to sweep) and reap it."""
    with contextlib.suppress(OSError):
        os.close(pipe)
    try:
        guardian.wait(timeout=GUARDIAN_EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        guardian.kill()
        guardian.wait()


def bring_up(name: str, topology: Topology, seed: int = 1) -> RunningLab:
    """Make lab ``name`` of ``topology``, owned by this process.

    Raises:
      LabError: the name is taken by a running lab, or is not a valid name.
      LabSetupError: a step failed (not root, no iproute2, a route leaving the lab, the
        forwarder did not start); whatever was made is removed first.
    """
    require_lab_privileges()
    check_lab_name(name)
    for swept in sweep_stale_labs():
        log.info("swept stale lab %s", swept)
    running = live_record(name)
    if running is not None:
        raise LabError(f"lab {name} is running (owner pid {running.owner_pid}): `baton lab down {name}` first")
    directory = lab_dir(name)
    machines = tuple(
        LabMachine(m.name, namespace_name(name, m.name), machine_address(i)) for i, m in enumerate(topology.machines)
    )
    record = LabRecord(name, os.getpid(), str(directory / CONTROL_FILE), machines, topology)
    write_record(record)
    guardian, guardian_pipe = start_guardian(name)
    tuns: list[tuple[int, str]] = []
    forwarder = None
    try:
        create_namespaces(m.netns for m in machines)
        for machine in machines:
            fd, tun_name = open_tun()
            tuns.append((fd, machine.address))
            configure_machine(machine.netns, tun_name, machine.address)
            check_routes_stay_in_lab(machine.netns)
        forwarder = start_forwarder(directory / CONTROL_FILE, tuns, directory / FORWARDER_LOG, seed=seed)
        for line in forwarder_setup_commands(topology):
            control_request(forwarder.control_path, line)
    except BaseException:
        if forwarder is not None:
            forwarder.stop()
        for machine in machines:
            delete_namespace(machine.netns)
        remove_record(name)
        _release(guardian, guardian_pipe)
        raise
    finally:
        for fd, _ in tuns:  # the forwarder holds its own copies: the devices live as long as it
            os.close(fd)
    return RunningLab(record, forwarder, guardian, guardian_pipe)


def change_link(record: LabRecord, a: str, b: str, change: LinkChange, both_ways: bool = True) -> None:
    """Apply ``change`` to the running link ``a`` -> ``b`` (and ``b`` -> ``a``)."""
    lines = [link_change_command(record.topology, a, b, change)]
    if both_ways:
        lines.append(link_change_command(record.topology, b, a, change))
    for line in lines:
        control_request(record.control_path, line)


def change_access(record: LabRecord, machine: str, uplink_mbit: float, downlink_mbit: float) -> None:
    """Set ``machine``'s access link (its uplink and downlink, shared by all its links)."""
    control_request(record.control_path, access_command(record.topology, machine, uplink_mbit, downlink_mbit))


OWNER_STOP_GRACE_S = 15.0


def stop_owner(record: LabRecord, grace_s: float = OWNER_STOP_GRACE_S) -> bool:
    """Ask the process that owns a running lab to remove it (SIGTERM), and SIGKILL it after
    ``grace_s`` (its guardian then sweeps). True if an owner was running."""
    import signal
    import time

    from .state import owner_alive

    if not owner_alive(record.name, record):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(record.owner_pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    delay_s = 0.01
    while owner_alive(record.name, record) and time.monotonic() < deadline:
        time.sleep(delay_s)  # polling another process's end: there is no event to wait on
        delay_s = min(delay_s * 2, 0.2)
    if owner_alive(record.name, record):
        with contextlib.suppress(ProcessLookupError):
            os.kill(record.owner_pid, signal.SIGKILL)
    return True
