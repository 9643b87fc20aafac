"""Unit tests of the wire dtype choice (agent.core.owner.wire_choice)."""

from __future__ import annotations

import pytest

from agent.core.owner.wire_choice import WIRE_CHOICES, choose_wire_dtype
from agent.core.wire.boundary import WireDType

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

THRESHOLDS = dict(f16_below_mbit=100.0, q8_below_mbit=10.0)


def test_a_named_dtype_is_taken_whatever_the_link() -> None:
    for choice, wire in (("f32", WireDType.F32), ("f16", WireDType.F16S), ("q8", WireDType.Q8)):
        assert choose_wire_dtype(choice, link_mbit=5.0, **THRESHOLDS) == wire
        assert choose_wire_dtype(choice, link_mbit=0.0, **THRESHOLDS) == wire
    assert WIRE_CHOICES == ("f32", "f16", "q8", "auto")


@pytest.mark.parametrize(
    ("link_mbit", "wire"),
    [(0.0, WireDType.F32), (1000.0, WireDType.F32), (100.0, WireDType.F32), (99.9, WireDType.F16S),
     (20.0, WireDType.F16S), (10.0, WireDType.F16S), (9.9, WireDType.Q8), (0.5, WireDType.Q8)],
)  # fmt: skip
def test_auto_goes_by_the_link_and_keeps_f32_when_it_is_not_known(link_mbit: float, wire: WireDType) -> None:
    assert choose_wire_dtype("auto", link_mbit=link_mbit, **THRESHOLDS) == wire


def test_an_unknown_choice_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="wire must be one of f32, f16, q8, auto, got 'bf16'"):
        choose_wire_dtype("bf16", link_mbit=0.0, **THRESHOLDS)
