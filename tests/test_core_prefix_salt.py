"""Whose prompts share the hops' prefix caches (agent.core.relay.prefix_salt, and
agent.core.owner.prefix_blocks.owner_salt): a private key's salt is its own, every shareable
key has one common salt that no private key has, anonymous callers one of their own; none can
be computed without the relay's secret."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from agent.core.owner.prefix_blocks import block_hashes, owner_salt, prefix_seed
from agent.core.relay.prefix_salt import MIN_SECRET_BYTES, anonymous_salt, key_salt

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

SECRET = bytes(range(32))
ALICE, BOB, CAROL = ("a1" * 32, "b0" * 32, "c4" * 32)


def test_a_private_key_s_salt_is_its_own_and_stable() -> None:
    alice = key_salt(SECRET, ALICE, shareable=False)
    assert alice == key_salt(SECRET, ALICE, shareable=False)
    assert len(alice) == 32
    assert alice != key_salt(SECRET, BOB, shareable=False)


def test_shareable_keys_share_one_salt_that_no_private_key_or_anonymous_caller_has() -> None:
    shared = key_salt(SECRET, BOB, shareable=True)
    assert shared == key_salt(SECRET, CAROL, shareable=True) == key_salt(SECRET, "", shareable=True)
    private = {key_salt(SECRET, key, shareable=False) for key in (ALICE, BOB, CAROL)}
    assert len(private) == 3 and shared not in private
    anonymous = anonymous_salt(SECRET)
    assert anonymous not in private | {shared}
    # a key hash crafted to spell another kind's message still gets a salt of its own
    assert key_salt(SECRET, "shared", shareable=False) != shared
    assert key_salt(SECRET, "anonymous", shareable=False) != anonymous


def test_a_salt_needs_the_relay_s_secret() -> None:
    other = bytes(32)
    assert key_salt(other, ALICE, shareable=False) != key_salt(SECRET, ALICE, shareable=False)
    assert key_salt(other, ALICE, shareable=True) != key_salt(SECRET, ALICE, shareable=True)
    assert anonymous_salt(other) != anonymous_salt(SECRET)
    # nor is it the key's hash under a plain hash or an empty secret
    assert key_salt(SECRET, ALICE, shareable=False) not in {
        hashlib.sha256(ALICE.encode()).digest(),
        hmac.new(b"", ALICE.encode(), hashlib.sha256).digest(),
    }
    with pytest.raises(ValueError, match=f"at least {MIN_SECRET_BYTES} bytes"):
        key_salt(b"short", ALICE, shareable=False)
    with pytest.raises(ValueError, match="key's sha256"):
        key_salt(SECRET, "", shareable=False)


def test_different_salts_give_different_block_names_for_the_same_prompt() -> None:
    prompt = list(range(64))
    names = {
        tuple(block_hashes(prompt, 16, prefix_seed("ab" * 32, "cd" * 32, 16, 64, salt)))
        for salt in (key_salt(SECRET, ALICE, shareable=False), key_salt(SECRET, BOB, shareable=False), b"")
    }
    assert len(names) == 3


def test_an_owner_s_salt_comes_from_its_own_secret() -> None:
    assert owner_salt(b"k" * 32) == owner_salt(b"k" * 32)
    assert owner_salt(b"k" * 32) != owner_salt(b"j" * 32)
    assert owner_salt(b"k" * 32) != key_salt(b"k" * 32, ALICE, shareable=False)
    with pytest.raises(ValueError, match="secret"):
        owner_salt(b"")
