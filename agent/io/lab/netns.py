"""Network namespaces and TUN devices, through iproute2 and the kernel's own files.

Owns: making and removing named network namespaces (``ip netns``, so ``ip netns exec`` and
``ip -n`` reach them), opening TUN devices and moving them into a namespace as its ``wan0``,
listing the processes inside a namespace, and checking that a namespace's routes never leave
198.18.0.0/15. Decides nothing about a lab's shape (``agent.core.lab.topology``).

Every call is synchronous and quick (a few ``ip`` processes); needs root (CAP_NET_ADMIN and
CAP_SYS_ADMIN). Errors are ``LabSetupError`` naming the command and what it printed.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import shutil
import signal
import struct
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

from agent.core.lab.topology import LAB_NETWORK

__all__ = [
    "NETNS_DIR",
    "LabSetupError",
    "check_routes_stay_in_lab",
    "configure_machine",
    "create_namespaces",
    "delete_namespace",
    "kill_namespace_processes",
    "list_namespaces",
    "namespace_pids",
    "open_tun",
    "require_lab_privileges",
]

NETNS_DIR = Path("/run/netns")
IP_TIMEOUT_S = 30.0
#: The interface each machine reaches the lab through.
WAN_INTERFACE = "wan0"
#: Ethernet's, so that TCP segments and loss behave as on a home link.
WAN_MTU = 1500

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000


class LabSetupError(RuntimeError):
    """The lab could not be built or removed; the message names the step."""


def require_lab_privileges() -> None:
    """``LabSetupError`` unless this process can make namespaces and TUN devices."""
    if os.geteuid() != 0:
        raise LabSetupError("the lab needs root (network namespaces and TUN devices): run it as root")
    if shutil.which("ip") is None:
        raise LabSetupError("the lab needs iproute2's `ip` (apt-get install iproute2; `make deps` installs it)")
    if not os.path.exists("/dev/net/tun"):
        raise LabSetupError("the lab needs /dev/net/tun (the tun module)")


def _ip(args: Sequence[str], stdin: str | None = None) -> str:
    argv = ["ip", *args]
    try:
        done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise LabSetupError(f"{' '.join(argv)}: {err}") from None
    if done.returncode != 0:
        what = (stdin or "").strip().replace("\n", "; ")
        raise LabSetupError(
            f"{' '.join(argv)}{f' <<< {what}' if what else ''}: {done.stderr.strip() or done.returncode}"
        )
    return done.stdout


def list_namespaces() -> list[str]:
    """Names of the named network namespaces (``ip netns`` keeps them in /run/netns)."""
    try:
        return sorted(p.name for p in NETNS_DIR.iterdir())
    except FileNotFoundError:
        return []


def create_namespaces(names: Iterable[str]) -> None:
    """Make each namespace (one ``ip -batch``), with its loopback up."""
    names = list(names)
    if not names:
        return
    _ip(["-batch", "-"], "".join(f"netns add {n}\n" for n in names))
    for name in names:
        _ip(["-n", name, "link", "set", "lo", "up"])


def delete_namespace(name: str) -> None:
    """Remove namespace ``name`` (its devices go with it); a missing one is fine."""
    if not (NETNS_DIR / name).exists():
        return
    with contextlib.suppress(LabSetupError):
        _ip(["netns", "del", name])
    if (NETNS_DIR / name).exists():  # `ip netns del` failed: unmount and unlink by hand
        subprocess.run(["umount", "-l", str(NETNS_DIR / name)], capture_output=True, check=False)
        with contextlib.suppress(FileNotFoundError):
            (NETNS_DIR / name).unlink()


def open_tun() -> tuple[int, str]:
    """A new TUN device (IPv4 packets, no packet-info header): its fd and its kernel name.

    The device is not persistent: it vanishes when its last fd closes.
    """
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        request = struct.pack("16sH22x", b"", _IFF_TUN | _IFF_NO_PI)
        answer = fcntl.ioctl(fd, _TUNSETIFF, request)
    except OSError as err:
        os.close(fd)
        raise LabSetupError(f"TUNSETIFF on /dev/net/tun: {err}") from None
    name = answer[:16].rstrip(b"\0").decode()
    return fd, name


def configure_machine(namespace: str, tun_name: str, address: str) -> None:
    """Move TUN ``tun_name`` into ``namespace`` as ``wan0`` with ``address``/32 and a route to
    198.18.0.0/15 only (no default route: nothing else is reachable from inside)."""
    if ipaddress.IPv4Address(address) not in LAB_NETWORK:
        raise LabSetupError(f"{address} is outside {LAB_NETWORK}: the lab uses no other address")
    _ip(["link", "set", tun_name, "netns", namespace])
    _ip(
        ["-n", namespace, "-batch", "-"],
        f"link set {tun_name} name {WAN_INTERFACE}\n"
        f"link set {WAN_INTERFACE} mtu {WAN_MTU} up\n"
        f"addr add {address}/32 dev {WAN_INTERFACE}\n"
        f"route add {LAB_NETWORK} dev {WAN_INTERFACE} src {address}\n",
    )


def check_routes_stay_in_lab(namespace: str) -> None:
    """``LabSetupError`` if any route of ``namespace`` leads outside 198.18.0.0/15 (besides its
    own loopback)."""
    routes = json.loads(_ip(["-n", namespace, "-j", "route", "show", "table", "all"]) or "[]")
    for route in routes:
        if route.get("dev") == "lo" or route.get("type") in ("local", "broadcast", "multicast"):
            continue
        dst = route.get("dst", "")
        if dst in ("", "default"):
            raise LabSetupError(f"{namespace} has a default route ({route}): the lab refuses to start")
        try:
            network = ipaddress.ip_network(dst, strict=False)
        except ValueError:
            raise LabSetupError(f"{namespace}: a route to {dst!r} the lab cannot read") from None
        if network.version == 6:
            continue  # IPv6 is never forwarded (the forwarder drops all of it)
        if not network.subnet_of(LAB_NETWORK):
            raise LabSetupError(f"{namespace} routes {dst} outside {LAB_NETWORK}: the lab refuses to start")


def namespace_pids(name: str) -> list[int]:
    """Pids of the processes whose network namespace is ``name`` (as ``ip netns pids``)."""
    try:
        target = os.stat(NETNS_DIR / name)
    except FileNotFoundError:
        return []
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry.name}/ns/net")
        except OSError:
            continue
        if (st.st_ino, st.st_dev) == (target.st_ino, target.st_dev):
            pids.append(int(entry.name))
    return pids


def kill_namespace_processes(name: str) -> list[int]:
    """SIGKILL every process inside namespace ``name`` (a machine switched off); their pids."""
    pids = [p for p in namespace_pids(name) if p != os.getpid()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids
