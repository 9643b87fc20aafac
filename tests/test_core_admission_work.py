"""The cost of a new identity where the tracker asks for one: a proof of work
(``admission_work``) and an invite (``invites``)."""

from __future__ import annotations

import hashlib

import pytest

from agent.core.wire.admission_work import MAX_WORK_BITS, WORK_BYTES, solve_work, work_asked, work_ok
from agent.core.wire.invites import INVITE_PREFIX, InviteRow, invite_refusal, invite_sha256, new_invite

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


def test_an_invite_admits_while_it_has_uses_and_time_and_is_looked_up_by_its_hash_only() -> None:
    token = new_invite(bytes(range(32)))
    assert token.startswith(INVITE_PREFIX) and "=" not in token and len(token) == len(INVITE_PREFIX) + 43
    with pytest.raises(ValueError):
        new_invite(b"short")
    looked_up: list[str] = []

    def lookup(rows: dict[str, InviteRow]):
        def get(sha256: str) -> InviteRow | None:
            looked_up.append(sha256)
            return rows.get(sha256)

        return get

    key = invite_sha256(token)
    assert key == invite_sha256(f"  {token}\n") and len(key) == 64  # pasted with spaces: the same token
    assert invite_refusal(token, lookup({key: InviteRow(uses_left=1, expires_at_ms=0)}), 10**15) == ""
    assert invite_refusal(f" {token} ", lookup({key: InviteRow(1, 2_000)}), 1_999) == ""
    assert "expired" in invite_refusal(token, lookup({key: InviteRow(1, 2_000)}), 2_000)
    assert "used up" in invite_refusal(token, lookup({key: InviteRow(0, 0)}), 0)
    assert "not one this tracker made" in invite_refusal(token, lookup({}), 0)
    assert looked_up == [key] * 5
    # no token, or text that is not one: refused before any lookup
    assert "only with an invite" in invite_refusal("", lookup({}), 0)
    assert "not a Baton invite" in invite_refusal("hunter2", lookup({}), 0)
    assert "not a Baton invite" in invite_refusal(INVITE_PREFIX + "x" * 200, lookup({}), 0)
    assert looked_up == [key] * 5
