"""Whether an address is this machine's: a fact a node's decisions need
(``agent.core.node.scheduler.decode_mode`` runs a route lock-step when its next hop shares this
machine's cores).

Owns one question, asked of the kernel rather than guessed from names: an IP address is this
host's when it is a loopback address or a socket can bind to it (the kernel lets a socket
bind only to an address of one of its own interfaces). A name (not an IP address) is not
resolved here: the swarm advertises addresses, and a lookup would block the event loop.
"""

from __future__ import annotations

import functools
import ipaddress
import socket

__all__ = ["is_this_host"]


@functools.lru_cache(maxsize=256)  # asked on the scheduling path; interfaces seldom change under a node
def is_this_host(host: str) -> bool:
    """True when ``host`` (an IPv4 or IPv6 address) is this machine's: loopback, or bound to
    one of its interfaces. False for a name, the unspecified address or anything else."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if ip.is_loopback:
        return True
    if ip.is_unspecified or ip.is_multicast:
        return False
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((str(ip), 0))  # EADDRNOTAVAIL unless an interface of this host has it
    except OSError:
        return False
    return True
