"""agent.core.net.connection_slots: one more connection under a bound, by idleness."""

from __future__ import annotations

import pytest

from agent.core.net.connection_slots import Room, room_for_one_more

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def test_under_the_bound_it_is_taken() -> None:
    assert room_for_one_more([], 1, now=100.0, idle_evict_s=30.0) == Room(take=True)
    assert room_for_one_more([99.0, 98.0], 3, now=100.0, idle_evict_s=30.0) == Room(take=True)


def test_at_the_bound_it_replaces_the_longest_idle_once_idle_long_enough() -> None:
    held = [90.0, 60.0, 95.0]  # the second has been idle 40 s at 100
    assert room_for_one_more(held, 3, now=100.0, idle_evict_s=30.0) == Room(take=True, close_first=1)
    assert room_for_one_more(held, 3, now=100.0, idle_evict_s=40.0) == Room(take=True, close_first=1)  # exactly


def test_at_the_bound_with_every_connection_in_use_it_is_refused() -> None:
    assert room_for_one_more([90.0, 75.0, 95.0], 3, now=100.0, idle_evict_s=30.0) == Room(take=False)
    assert room_for_one_more([99.0], 1, now=100.0, idle_evict_s=30.0) == Room(take=False)
