"""``agent.io.local_host.is_this_host``: whether an address is this machine's, asked of the
kernel (a node runs a route lock-step when its next hop shares this machine)."""

from __future__ import annotations

import socket

import pytest

from agent.io.local_host import is_this_host

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def _own_address() -> str | None:
    """An address of one of this host's interfaces other than loopback: the source the kernel
    picks for a route out (a UDP connect sends nothing), or None without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("198.51.100.1", 9))
        except OSError:
            return None
        return probe.getsockname()[0]


def test_loopback_and_own_interfaces_are_this_host() -> None:
    assert is_this_host("127.0.0.1")
    assert is_this_host("127.0.0.2"), "all of 127/8 is loopback"
    assert is_this_host("::1")
    own = _own_address()
    if own is not None and own != "0.0.0.0":
        assert is_this_host(own), own


def test_other_addresses_and_names_are_not() -> None:
    assert not is_this_host("198.51.100.77"), "TEST-NET-2: no interface of a test machine has it"
    assert not is_this_host("2001:db8::77")
    assert not is_this_host("0.0.0.0"), "unspecified: anyone's"
    assert not is_this_host("224.0.0.1")
    assert not is_this_host("localhost"), "names are not resolved"
    assert not is_this_host("")
    assert not is_this_host("not an address")
