"""``agent.core.owner.parity.through_wire``: boundary rows as a swarm hop hands them on in a wire
dtype (F32 unchanged, F16 rounded to the nearest float16; token entries untouched)."""

from __future__ import annotations

import numpy as np
import pytest

from agent.core.owner.parity import through_wire
from agent.core.wire.boundary import BoundaryError, WireDType
from agent.core.wire.worker_records import SeqInput

pytestmark = pytest.mark.unit


def test_through_wire_rounds_f16_and_keeps_f32() -> None:
    rows = (np.arange(2 * 8, dtype=np.float32).reshape(2, 8) + 1) / 3
    entries = [
        SeqInput(seq_id=0, positions=[0], token_ids=[5]),
        SeqInput(seq_id=1, positions=[0, 1], boundary=rows, logit_rows=[1]),
    ]
    same = through_wire(entries, WireDType.F32)
    assert same[1].boundary is rows and same[0] is entries[0]
    half = through_wire(entries, WireDType.F16)
    assert half[0] is entries[0]
    assert half[1].boundary.dtype == np.float32 and half[1].logit_rows == [1]
    np.testing.assert_array_equal(half[1].boundary, rows.astype(np.float16).astype(np.float32))
    assert 0 < np.abs(half[1].boundary - rows).max() <= np.abs(rows).max() * 2.0**-11
    with pytest.raises(BoundaryError, match="out of float16 range"):
        through_wire([SeqInput(seq_id=0, positions=[0], boundary=np.full((1, 8), 1e6, np.float32))], WireDType.F16)
