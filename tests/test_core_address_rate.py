"""New identities per source address (agent.core.wire.address_rate): the sliding window, the
exempt networks, the memory bound; a fake clock of plain ints."""

from __future__ import annotations

import pytest

from agent.core.wire.address_rate import LOOPBACK_NETWORKS, KeyedRate, NewIdentityRate, parse_networks

pytestmark = pytest.mark.unit

HOUR_MS = 3_600_000


def test_an_address_brings_at_most_n_new_identities_in_any_window() -> None:
    rate = NewIdentityRate(2, HOUR_MS)
    assert rate.retry_after_ms("198.18.0.5", 0) == 0
    rate.note("198.18.0.5", 0)
    rate.note("198.18.0.5", 1_000)
    assert rate.retry_after_ms("198.18.0.5", 2_000) == HOUR_MS - 2_000, "the first one frees a slot"
    assert rate.retry_after_ms("198.18.0.6", 2_000) == 0, "another address is not limited by it"
    assert rate.retry_after_ms("198.18.0.5", HOUR_MS) == 0
    rate.note("198.18.0.5", HOUR_MS)
    assert rate.retry_after_ms("198.18.0.5", HOUR_MS + 1) == 1_000 - 1


def test_exempt_networks_unknown_addresses_and_a_zero_limit_are_not_limited() -> None:
    rate = NewIdentityRate(1, HOUR_MS, parse_networks([*LOOPBACK_NETWORKS, "198.18.0.0/15"]))
    for host in ("127.0.0.1", "::1", "198.19.255.1", ""):
        rate.note(host, 0)
        rate.note(host, 0)
        assert rate.retry_after_ms(host, 1) == 0, host
    rate.note("203.0.113.7", 0)
    assert rate.retry_after_ms("203.0.113.7", 1) > 0
    off = NewIdentityRate(0, HOUR_MS)
    off.note("203.0.113.7", 0)
    assert off.retry_after_ms("203.0.113.7", 1) == 0


def test_memory_is_bounded_by_forgetting_the_least_recently_seen_address() -> None:
    rate = NewIdentityRate(1, HOUR_MS, max_addresses=2)
    rate.note("198.18.0.1", 0)
    rate.note("198.18.0.2", 1)
    rate.note("198.18.0.3", 2)  # 198.18.0.1 is forgotten
    assert rate.retry_after_ms("198.18.0.1", 3) == 0
    assert rate.retry_after_ms("198.18.0.3", 3) > 0


def test_a_bad_network_is_named() -> None:
    with pytest.raises(ValueError, match=r"'10\.0\.0\.0/33'"):
        parse_networks(["10.0.0.0/33"])


def test_a_keyed_rate_takes_an_event_only_when_it_is_allowed() -> None:
    rate = KeyedRate(2, 1000)
    assert rate.take("peer", 0) == 0 and rate.take("peer", 10) == 0
    assert rate.take("peer", 20) == 980, "refused: not counted"
    assert rate.take("peer", 1000) == 0, "the first one left the window"
    assert rate.take("other", 20) == 0
