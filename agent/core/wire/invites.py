"""Invites (``baton tracker serve --require-invites``): a tracker that admits a new key only
when it brings a token its operator made (``baton tracker invite``), for a swarm whose members
the operator knows. A key the tracker knows (admitted before) needs none.

A token is ``baton-invite-`` and 32 random bytes in URL-safe base64; the tracker keeps only its
SHA-256 (a leaked database admits nobody), with how many new keys it may still admit and until
when. What decides whether an invite admits one more key, given its stored row, is here.

Pure: the random bytes and the time come in.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
from collections.abc import Callable

__all__ = [
    "INVITE_PREFIX",
    "INVITE_RANDOM_BYTES",
    "MAX_INVITE_CHARS",
    "MAX_NOTE_CHARS",
    "InviteRow",
    "invite_refusal",
    "invite_sha256",
    "new_invite",
]

INVITE_PREFIX = "baton-invite-"
INVITE_RANDOM_BYTES = 32
#: longer text is not a token (and is not hashed: a peer's bytes bounded before any work)
MAX_INVITE_CHARS = 128
#: an invite's note (whom the operator made it for), as ``baton tracker invites`` shows it
MAX_NOTE_CHARS = 200


@dataclasses.dataclass(frozen=True)
class InviteRow:
    """What the tracker keeps of an invite: keys it may still admit, and until when."""

    uses_left: int
    expires_at_ms: int  # 0: never


def new_invite(random_bytes: bytes) -> str:
    """A token from ``INVITE_RANDOM_BYTES`` random bytes (``os.urandom``)."""
    if len(random_bytes) != INVITE_RANDOM_BYTES:
        raise ValueError(f"an invite takes {INVITE_RANDOM_BYTES} random bytes, got {len(random_bytes)}")
    return INVITE_PREFIX + base64.urlsafe_b64encode(random_bytes).decode().rstrip("=")


def invite_sha256(token: str) -> str:
    """The hex SHA-256 the tracker stores and looks a token up by."""
    return hashlib.sha256(token.strip().encode()).hexdigest()


def invite_refusal(token: str, lookup: Callable[[str], InviteRow | None], now_ms: int) -> str:
    """Why ``token`` admits no new key now; "" when it admits one (the caller then takes one of
    its uses). ``lookup(sha256)``: the stored row of a well-formed token (None: none)."""
    token = token.strip()
    if not token:
        return "this tracker admits a new key only with an invite from its operator (--invite TOKEN)"
    if len(token) > MAX_INVITE_CHARS or not token.startswith(INVITE_PREFIX):
        return f"the invite is not a Baton invite token ({INVITE_PREFIX}...)"
    row = lookup(invite_sha256(token))
    if row is None:
        return "the invite is not one this tracker made"
    if row.expires_at_ms and now_ms >= row.expires_at_ms:
        return "the invite has expired: ask the tracker's operator for another"
    if row.uses_left <= 0:
        return "the invite has been used up: ask the tracker's operator for another"
    return ""
