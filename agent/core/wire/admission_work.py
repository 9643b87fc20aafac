"""A proof of work for a new identity (``baton tracker serve --admission-work-bits``): what a
self-made key costs where an operator wants it to cost more than an address
(``--new-identities-per-address-per-hour``).

The work is bound to the key: ``sha256(DOMAIN || public key || work)`` must start with
``bits`` zero bits, so a proof admits that key only, and nothing a tracker sends makes it
fresh (a key that has one keeps it: an identity the tracker knows needs none). Each bit
doubles the expected hashes: 2^bits, about 0.7 s at 20 bits and 11 s at 24 in one CPython
thread (1.5 million a second on the 2-core test VM); the tracker checks a proof with one hash.

Pure: no clocks, randomness or I/O (the solver counts from zero).
"""

from __future__ import annotations

import hashlib

__all__ = ["MAX_WORK_BITS", "WORK_BYTES", "solve_work", "work_asked", "work_ok"]

_DOMAIN = b"baton-admission-work/1\n"

#: the largest requirement a tracker may set or a peer will try (2^32 hashes: hours)
MAX_WORK_BITS = 32
#: a proof's length: the solver's counter as 8 bytes little-endian (a tracker takes any
#: length up to this)
WORK_BYTES = 8


def _leading_zero_bits(digest: bytes) -> int:
    value = int.from_bytes(digest, "big")
    return len(digest) * 8 - value.bit_length()


def work_ok(public_key: bytes, work: bytes, bits: int) -> bool:
    """Whether ``work`` proves ``bits`` bits of work for ``public_key``."""
    if bits <= 0:
        return True
    if len(work) > WORK_BYTES:
        return False
    return _leading_zero_bits(hashlib.sha256(_DOMAIN + public_key + work).digest()) >= bits


def work_asked(work_bits: int) -> bool:
    """Whether a refusal's ``Error.work_bits`` asks for a proof a peer solves (once, then asks
    again): a requirement past ``MAX_WORK_BITS`` is not tried (hours of a core)."""
    return 0 < work_bits <= MAX_WORK_BITS


def solve_work(public_key: bytes, bits: int) -> bytes:
    """The first counter whose bytes prove ``bits`` bits of work for ``public_key`` (expected
    2^bits hashes: run it off an event loop)."""
    if not 0 <= bits <= MAX_WORK_BITS:
        raise ValueError(f"work bits must be within 0..{MAX_WORK_BITS}, got {bits}")
    prefix = hashlib.sha256(_DOMAIN + public_key)  # (the common part hashed once)
    counter = 0
    while True:
        work = counter.to_bytes(WORK_BYTES, "little")
        h = prefix.copy()
        h.update(work)
        if _leading_zero_bits(h.digest()) >= bits:
            return work
        counter += 1
