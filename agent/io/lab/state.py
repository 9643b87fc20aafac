"""Where running labs are written down, and the sweep of labs whose owner is gone.

Owns: ``/run/baton-lab/<name>/`` (mode 0700: ``lab.json``, the forwarder's control socket and
log), reading and writing a lab's ``LabRecord`` (written before any namespace is made, so a
namespace of a live lab always has a record naming its owner), whether a record's owner still
runs (pid and start time), and the sweep: every process inside the lab's namespaces killed,
the namespaces removed, the record's directory removed.

/run is a tmpfs: a reboot forgets every lab, as it forgets the namespaces.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path

import psutil

from agent.core.lab.topology import NETNS_PREFIX, LabError, LabRecord, namespace_name

from .netns import delete_namespace, kill_namespace_processes, list_namespaces

__all__ = [
    "LAB_STATE_DIR",
    "lab_dir",
    "live_record",
    "owner_alive",
    "read_record",
    "remove_record",
    "sweep_lab",
    "sweep_stale_labs",
    "write_record",
]

log = logging.getLogger(__name__)

LAB_STATE_DIR = Path(os.environ.get("BATON_LAB_STATE_DIR", "/run/baton-lab"))
RECORD_FILE = "lab.json"
OWNER_START_FILE = "owner.start"


def lab_dir(name: str) -> Path:
    return LAB_STATE_DIR / name


def _process_start(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


def write_record(record: LabRecord) -> None:
    """Write ``record`` with its owner's start time (so that a reused pid is not taken for
    it). The directory appears whole (made aside, then renamed), so the sweep never meets a
    lab that is half written down."""
    LAB_STATE_DIR.mkdir(parents=True, exist_ok=True)
    os.chmod(LAB_STATE_DIR, 0o700)
    directory = lab_dir(record.name)
    aside = LAB_STATE_DIR / f".{record.name}.{os.getpid()}.tmp"
    shutil.rmtree(aside, ignore_errors=True)
    aside.mkdir(mode=0o700)
    (aside / OWNER_START_FILE).write_text(repr(_process_start(record.owner_pid)))
    (aside / RECORD_FILE).write_text(record.to_json())
    try:
        aside.rename(directory)
    except OSError as err:
        shutil.rmtree(aside, ignore_errors=True)
        raise LabError(f"lab {record.name} is already written down at {directory} ({err.strerror})") from None


def read_record(name: str) -> LabRecord | None:
    """The record of lab ``name``, or None when there is none (or it is unreadable)."""
    try:
        return LabRecord.from_json((lab_dir(name) / RECORD_FILE).read_text())
    except (FileNotFoundError, LabError):
        return None


def owner_alive(name: str, record: LabRecord | None = None) -> bool:
    """Whether the process that made lab ``name`` still runs."""
    record = record or read_record(name)
    if record is None:
        return False
    start = _process_start(record.owner_pid)
    if start is None:
        return False
    try:
        written = (lab_dir(name) / OWNER_START_FILE).read_text().strip()
    except FileNotFoundError:
        return False
    return written == repr(start)


def live_record(name: str) -> LabRecord | None:
    """The record of lab ``name`` if its owner still runs."""
    record = read_record(name)
    return record if record is not None and owner_alive(name, record) else None


def remove_record(name: str) -> None:
    shutil.rmtree(lab_dir(name), ignore_errors=True)


def _lab_namespaces(name: str) -> list[str]:
    prefix = namespace_name(name, "")
    return [ns for ns in list_namespaces() if ns.startswith(prefix) and "-" not in ns[len(prefix) :]]


def sweep_lab(name: str) -> list[str]:
    """Switch lab ``name`` off whatever its state: kill what runs in its machines, remove its
    namespaces and its record. Returns the namespaces removed."""
    namespaces = _lab_namespaces(name)
    record = read_record(name)
    if record is not None:
        namespaces = sorted(
            set(namespaces) | {m.netns for m in record.machines if (Path("/run/netns") / m.netns).exists()}
        )
    for ns in namespaces:
        kill_namespace_processes(ns)
    for ns in namespaces:
        delete_namespace(ns)
    remove_record(name)
    return namespaces


def sweep_stale_labs() -> list[str]:
    """Sweep every lab whose owner is gone (a crash, SIGKILL), and every ``baton-*`` namespace
    no live lab claims. Returns the names of the labs swept."""
    swept = []
    live = set()
    with contextlib.suppress(FileNotFoundError):
        for entry in sorted(LAB_STATE_DIR.iterdir()):
            if not entry.is_dir() or entry.name.startswith("."):
                continue
            if owner_alive(entry.name):
                live.add(entry.name)
            else:
                sweep_lab(entry.name)
                swept.append(entry.name)
    for ns in list_namespaces():
        if not ns.startswith(NETNS_PREFIX) or "-" not in ns[len(NETNS_PREFIX) :]:
            continue
        lab = ns[len(NETNS_PREFIX) :].rsplit("-", 1)[0]
        if lab not in live and lab not in swept:
            log.info("sweeping namespaces of lab %s (no live owner)", lab)
            sweep_lab(lab)
            swept.append(lab)
    return swept
