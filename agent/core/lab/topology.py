"""A lab's shape: its machines (names, addresses, NAT, access links), the links between them,
the names its namespaces take, and the control lines that tell the forwarder about it.

Every address is in 198.18.0.0/15 (RFC 2544's benchmarking range), the only one a lab uses:
nothing outside the lab's own namespaces is ever addressed. Machine ``i`` of a lab has address
198.18.0.0 + i + 1. Links are directed: ``link(a, b)`` is what a packet from ``a`` to ``b``
meets; a full mesh gives every ordered pair the same settings.

The topology file (TOML, ``parse_topology`` takes the parsed table)::

    [defaults]            # every link not named below
    delay_ms = 10         # one way
    jitter_ms = 1
    loss_pct = 0.5
    rate_mbit = 50        # per link and direction; 0: unlimited

    [[machine]]
    name = "tracker"

    [[machine]]
    name = "home1"
    nat = true            # inbound only on flows it opened
    uplink_mbit = 5       # its access link, shared by all its links; 0: unlimited
    downlink_mbit = 20

    [[link]]
    between = ["home1", "tracker"]   # both directions; or from = "a", to = "b" for one
    delay_ms = 40

Must not import trio, sockets, subprocess, os or a clock.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "LAB_NETWORK",
    "LabError",
    "LabMachine",
    "LabRecord",
    "LinkChange",
    "LinkSpec",
    "MachineSpec",
    "Topology",
    "access_command",
    "check_lab_name",
    "forwarder_setup_commands",
    "full_mesh",
    "link_change_command",
    "machine_address",
    "namespace_name",
    "parse_topology",
]

LAB_NETWORK = ipaddress.IPv4Network("198.18.0.0/15")
#: Most machines a lab holds (addresses 198.18.0.1 up; far more than one host can run).
MAX_MACHINES = 1000
#: A lab's name and a machine's: short, so that ``baton-<lab>-<machine>`` stays a tidy netns name.
_NAME = re.compile(r"^[a-z0-9][a-z0-9_]{0,19}$")
#: Prefix of every network namespace a lab makes; the sweep of stale labs looks only at these.
NETNS_PREFIX = "baton-"
#: One way, per link: a minute is already no network anyone uses.
MAX_DELAY_MS = 60_000.0
MAX_RATE_MBIT = 100_000.0


class LabError(ValueError):
    """A lab that cannot be made as asked; the message names what was wrong."""


def check_lab_name(name: str, what: str = "lab name") -> str:
    """``name`` if it is a valid lab or machine name (lowercase letters, digits, ``_``; at most
    20 characters; starting with a letter or digit), else ``LabError``."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise LabError(f"{what} {name!r}: use 1-20 of a-z, 0-9 and _, starting with a letter or digit")
    return name


def namespace_name(lab: str, machine: str) -> str:
    """The network namespace of ``machine`` in lab ``lab``."""
    return f"{NETNS_PREFIX}{lab}-{machine}"


def machine_address(index: int) -> str:
    """The address of machine ``index`` (0-based): 198.18.0.1, 198.18.0.2, ..."""
    if not 0 <= index < MAX_MACHINES:
        raise LabError(f"machine index {index}: a lab has 0 to {MAX_MACHINES - 1}")
    address = LAB_NETWORK.network_address + index + 1
    assert address in LAB_NETWORK
    return str(address)


def _number(value: Any, field: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise LabError(f"{field}: want a number from {low:g} to {high:g}, got {value!r}")
    if not low <= value <= high:
        raise LabError(f"{field}: {value!r} is outside {low:g}-{high:g}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """What one direction of a link does: ``delay_ms`` one way, ``jitter_ms`` (each packet's
    delay is delay ± up to jitter, order kept), ``loss_pct`` (percent of packets dropped at
    random), ``rate_mbit`` (0: unlimited), ``queue_bytes`` (what waits for the rate; 0: a
    quarter second of it, at least 64 KiB), ``up`` (False: cut)."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_pct: float = 0.0
    rate_mbit: float = 0.0
    queue_bytes: int = 0
    up: bool = True

    def __post_init__(self) -> None:
        _number(self.delay_ms, "delay_ms", 0.0, MAX_DELAY_MS)
        _number(self.jitter_ms, "jitter_ms", 0.0, MAX_DELAY_MS)
        _number(self.loss_pct, "loss_pct", 0.0, 100.0)
        _number(self.rate_mbit, "rate_mbit", 0.0, MAX_RATE_MBIT)
        if (
            isinstance(self.queue_bytes, bool)
            or not isinstance(self.queue_bytes, int)
            or not 0 <= self.queue_bytes <= 1 << 30
        ):
            raise LabError(f"queue_bytes: want an integer from 0 to 2^30, got {self.queue_bytes!r}")
        if not isinstance(self.up, bool):
            raise LabError(f"up: want true or false, got {self.up!r}")

    def forwarder_fields(self) -> str:
        """All of it as the forwarder's ``key=value`` fields."""
        return LinkChange(**dataclasses.asdict(self)).forwarder_fields()


@dataclasses.dataclass(frozen=True)
class LinkChange:
    """A change to a running link: the fields given (not None) are set, the rest kept."""

    delay_ms: float | None = None
    jitter_ms: float | None = None
    loss_pct: float | None = None
    rate_mbit: float | None = None
    queue_bytes: int | None = None
    up: bool | None = None

    def __post_init__(self) -> None:
        given = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        LinkSpec(**given)  # the same checks as a whole spec

    def is_empty(self) -> bool:
        return all(v is None for v in dataclasses.asdict(self).values())

    def applied_to(self, spec: LinkSpec) -> LinkSpec:
        given = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        return dataclasses.replace(spec, **given)

    def forwarder_fields(self) -> str:
        fields = []
        if self.delay_ms is not None:
            fields.append(f"delay_us={round(self.delay_ms * 1000)}")
        if self.jitter_ms is not None:
            fields.append(f"jitter_us={round(self.jitter_ms * 1000)}")
        if self.loss_pct is not None:
            fields.append(f"loss={self.loss_pct / 100:.9g}")
        if self.rate_mbit is not None:
            fields.append(f"rate_bps={round(self.rate_mbit * 1_000_000)}")
        if self.queue_bytes is not None:
            fields.append(f"queue_bytes={self.queue_bytes}")
        if self.up is not None:
            fields.append(f"up={int(self.up)}")
        return " ".join(fields)


@dataclasses.dataclass(frozen=True)
class MachineSpec:
    """One emulated machine: ``nat`` puts it behind the NAT-like filter (inbound only on flows
    it opened); ``uplink_mbit`` / ``downlink_mbit``: its access link (0: unlimited), shared by
    all its links."""

    name: str
    nat: bool = False
    uplink_mbit: float = 0.0
    downlink_mbit: float = 0.0

    def __post_init__(self) -> None:
        check_lab_name(self.name, "machine name")
        if not isinstance(self.nat, bool):
            raise LabError(f"machine {self.name}: nat: want true or false, got {self.nat!r}")
        _number(self.uplink_mbit, f"machine {self.name}: uplink_mbit", 0.0, MAX_RATE_MBIT)
        _number(self.downlink_mbit, f"machine {self.name}: downlink_mbit", 0.0, MAX_RATE_MBIT)


@dataclasses.dataclass(frozen=True)
class Topology:
    """Machines in order (machine ``i`` has ``machine_address(i)``), the settings of every link
    not named, and the named ones (directed: ``(from, to, spec)``, later entries win)."""

    machines: tuple[MachineSpec, ...]
    default_link: LinkSpec = LinkSpec()
    links: tuple[tuple[str, str, LinkSpec], ...] = ()

    def __post_init__(self) -> None:
        if not 2 <= len(self.machines) <= MAX_MACHINES:
            raise LabError(f"a lab has 2 to {MAX_MACHINES} machines, got {len(self.machines)}")
        names = [m.name for m in self.machines]
        duplicate = sorted({n for n in names if names.count(n) > 1})
        if duplicate:
            raise LabError(f"machine names must differ: {', '.join(duplicate)} given twice")
        for a, b, _spec in self.links:
            for name in (a, b):
                if name not in names:
                    raise LabError(f"link {a} -> {b}: no machine named {name!r} (machines: {', '.join(names)})")
            if a == b:
                raise LabError(f"link {a} -> {b}: a machine has no link to itself")

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.machines]

    def index(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise LabError(f"no machine named {name!r} (machines: {', '.join(self.names)})") from None

    def address(self, name: str) -> str:
        return machine_address(self.index(name))

    def link(self, a: str, b: str) -> LinkSpec:
        """What a packet from ``a`` to ``b`` meets."""
        self.index(a), self.index(b)
        spec = self.default_link
        for src, dst, named in self.links:
            if (src, dst) == (a, b):
                spec = named
        return spec


def full_mesh(count: int, link: LinkSpec = LinkSpec(), nat: Iterable[str] = ()) -> Topology:
    """``count`` machines ``m0``..``m{count-1}``, every pair linked with ``link``; the machines
    named in ``nat`` behind the filter."""
    if not 2 <= count <= MAX_MACHINES:
        raise LabError(f"--machines: a lab has 2 to {MAX_MACHINES} machines, got {count}")
    names = [f"m{i}" for i in range(count)]
    behind = set(nat)
    unknown = sorted(behind - set(names))
    if unknown:
        raise LabError(f"--nat names {', '.join(unknown)}, not among the machines m0..m{count - 1}")
    return Topology(tuple(MachineSpec(n, nat=n in behind) for n in names), link)


_LINK_KEYS = {f.name for f in dataclasses.fields(LinkSpec)}
_MACHINE_KEYS = {f.name for f in dataclasses.fields(MachineSpec)}


def _link_spec(table: Mapping[str, Any], base: LinkSpec, where: str, extra: Sequence[str] = ()) -> LinkSpec:
    unknown = sorted(set(table) - _LINK_KEYS - set(extra))
    if unknown:
        raise LabError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(_LINK_KEYS))})")
    try:
        return dataclasses.replace(base, **{k: v for k, v in table.items() if k in _LINK_KEYS})
    except LabError as err:
        raise LabError(f"{where}: {err}") from None


def parse_topology(data: Mapping[str, Any]) -> Topology:
    """A ``Topology`` from a parsed topology file (module docstring), or ``LabError`` naming the
    section and key at fault."""
    unknown = sorted(set(data) - {"defaults", "machine", "link"})
    if unknown:
        raise LabError(f"topology: unknown section(s) {', '.join(unknown)} (defaults, machine, link)")
    defaults = data.get("defaults", {})
    if not isinstance(defaults, Mapping):
        raise LabError("topology: [defaults] must be a table")
    default_link = _link_spec(defaults, LinkSpec(), "[defaults]")
    machines = []
    raw_machines = data.get("machine", [])
    if not isinstance(raw_machines, list):
        raise LabError("topology: machines are [[machine]] tables")
    for i, table in enumerate(raw_machines):
        if not isinstance(table, Mapping):
            raise LabError(f"[[machine]] #{i + 1} must be a table")
        bad = sorted(set(table) - _MACHINE_KEYS)
        if bad:
            raise LabError(
                f"[[machine]] #{i + 1}: unknown key(s) {', '.join(bad)} (known: {', '.join(sorted(_MACHINE_KEYS))})"
            )
        if "name" not in table:
            raise LabError(f"[[machine]] #{i + 1}: needs a name")
        machines.append(MachineSpec(**table))
    links: list[tuple[str, str, LinkSpec]] = []
    raw_links = data.get("link", [])
    if not isinstance(raw_links, list):
        raise LabError("topology: links are [[link]] tables")
    for i, table in enumerate(raw_links):
        where = f"[[link]] #{i + 1}"
        if not isinstance(table, Mapping):
            raise LabError(f"{where} must be a table")
        if "between" in table and not ("from" in table or "to" in table):
            pair = table["between"]
            if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(n, str) for n in pair)):
                raise LabError(f'{where}: between = ["a", "b"], two machine names')
            a, b = pair
            directions = [(a, b), (b, a)]
        elif "from" in table and "to" in table and "between" not in table:
            a, b = table["from"], table["to"]
            if not (isinstance(a, str) and isinstance(b, str)):
                raise LabError(f"{where}: from and to name machines")
            directions = [(a, b)]
        else:
            raise LabError(f"{where}: give either between = [a, b] or from = a and to = b")
        base = default_link
        spec = _link_spec(table, base, where, extra=("between", "from", "to"))
        links += [(x, y, spec) for x, y in directions]
    return Topology(tuple(machines), default_link, tuple(links))


def forwarder_setup_commands(topology: Topology) -> list[str]:
    """The control lines that give a fresh forwarder (links all open, no delay) this
    topology: every directed link, every access link and filter that is not the default."""
    lines = []
    for i, a in enumerate(topology.names):
        for j, b in enumerate(topology.names):
            if i != j:
                lines.append(f"link {i} {j} {topology.link(a, b).forwarder_fields()}")
    for i, machine in enumerate(topology.machines):
        if machine.uplink_mbit or machine.downlink_mbit:
            lines.append(access_command(topology, machine.name, machine.uplink_mbit, machine.downlink_mbit))
        if machine.nat:
            lines.append(f"nat {i} on")
    return lines


def link_change_command(topology: Topology, a: str, b: str, change: LinkChange) -> str:
    """The control line that applies ``change`` to the link ``a`` -> ``b``."""
    if change.is_empty():
        raise LabError("nothing to change: give --delay-ms, --jitter-ms, --loss, --rate-mbit, --down or --up")
    i, j = topology.index(a), topology.index(b)
    if i == j:
        raise LabError(f"{a}: a machine has no link to itself")
    return f"link {i} {j} {change.forwarder_fields()}"


def access_command(topology: Topology, machine: str, uplink_mbit: float, downlink_mbit: float) -> str:
    """The control line that sets ``machine``'s access link (0: unlimited)."""
    spec = MachineSpec(machine, uplink_mbit=uplink_mbit, downlink_mbit=downlink_mbit)  # the same checks
    return (
        f"access {topology.index(machine)} uplink_bps={round(spec.uplink_mbit * 1_000_000)}"
        f" downlink_bps={round(spec.downlink_mbit * 1_000_000)}"
    )


@dataclasses.dataclass(frozen=True)
class LabMachine:
    """A running machine, as ``baton lab up --json`` prints it."""

    name: str
    netns: str
    address: str


@dataclasses.dataclass(frozen=True)
class LabRecord:
    """What a running lab leaves for ``baton lab exec | link | down`` and for the sweep:
    its name, the pid of the process that owns it, its machines, its forwarder's control
    socket and its topology (to name machines and links)."""

    name: str
    owner_pid: int
    control_path: str
    machines: tuple[LabMachine, ...]
    topology: Topology

    def machine(self, name: str) -> LabMachine:
        for m in self.machines:
            if m.name == name:
                return m
        raise LabError(
            f"lab {self.name} has no machine {name!r} (machines: {', '.join(m.name for m in self.machines)})"
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> LabRecord:
        try:
            raw = json.loads(text)
            topology = raw["topology"]
            return cls(
                name=raw["name"],
                owner_pid=int(raw["owner_pid"]),
                control_path=raw["control_path"],
                machines=tuple(LabMachine(**m) for m in raw["machines"]),
                topology=Topology(
                    machines=tuple(MachineSpec(**m) for m in topology["machines"]),
                    default_link=LinkSpec(**topology["default_link"]),
                    links=tuple((a, b, LinkSpec(**s)) for a, b, s in topology["links"]),
                ),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise LabError(f"not a lab record: {err}") from None
