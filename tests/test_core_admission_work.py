"""The proof of work a new identity brings where the tracker asks (``admission_work``)."""

from __future__ import annotations

import hashlib

import pytest

from agent.core.wire.admission_work import MAX_WORK_BITS, WORK_BYTES, solve_work, work_asked, work_ok

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

KEY = bytes(range(32))


def test_a_solved_proof_holds_for_its_key_and_bits_only() -> None:
    work = solve_work(KEY, 12)
    assert len(work) == WORK_BYTES and work_ok(KEY, work, 12)
    digest = hashlib.sha256(b"baton-admission-work/1\n" + KEY + work).digest()
    assert int.from_bytes(digest[:2], "big") >> 4 == 0  # 12 leading zero bits, as written
    assert not work_ok(bytes(32), work, 12)  # bound to the key (fixed inputs: this never changes)
    assert not work_ok(KEY, work + b"\0", 12)  # longer than a proof: refused
    harder = solve_work(KEY, 16)
    assert work_ok(KEY, harder, 12) and work_ok(KEY, harder, 16)


def test_no_work_asked_admits_anything_and_a_requirement_is_bounded() -> None:
    assert work_ok(KEY, b"", 0) and work_ok(KEY, b"anything", 0)
    assert solve_work(KEY, 0) == bytes(WORK_BYTES)
    assert work_asked(1) and work_asked(MAX_WORK_BITS)
    assert not work_asked(0) and not work_asked(MAX_WORK_BITS + 1)  # (not asked, or hours of a core)
    with pytest.raises(ValueError, match=r"within 0\.\.32"):
        solve_work(KEY, MAX_WORK_BITS + 1)
    with pytest.raises(ValueError, match=r"within 0\.\.32"):
        solve_work(KEY, -1)
