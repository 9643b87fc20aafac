"""Whose requests share the hops' prefix caches: the salt the relay mixes into a request's
prefix block hashes (``agent.core.owner.prefix_blocks.prefix_seed``).

Whether a prefix is cached can be learnt by timing a request (a hit skips its prefill), and a
node answers a prefix lookup for any hashes it is sent; so a caller who can name another
caller's blocks learns what that caller asked. Hashes under a salt only the relay knows cannot
be named by anyone else, and two requests share cached blocks only when their salts are equal:

- a private key (the default): ``HMAC(secret, "key" || key's sha256)``, its own;
- a key an operator marked shareable (``baton relay keys add --shareable-prefixes``): one salt
  common to every such key (a public system prompt is computed once across them), never equal
  to a private key's;
- requests without a key (``--anonymous-tokens-per-day``): one salt of their own, shared by
  every anonymous caller (they cannot be told apart) and by no key.

``secret``: the relay's own random bytes (kept in its database, which only its owner may read):
without it, a salt cannot be computed from a key's name or hash.

Pure: no I/O, clock or randomness (the secret is made by the store).
"""

from __future__ import annotations

import hashlib
import hmac

__all__ = ["MIN_SECRET_BYTES", "SECRET_BYTES", "anonymous_salt", "key_salt"]

#: the secret's length when the relay makes one
SECRET_BYTES = 32
#: shorter secrets are refused: the salt would be guessable
MIN_SECRET_BYTES = 16

_DOMAIN = b"baton-prefix-salt/1\x00"


def key_salt(secret: bytes, key_sha256: str, *, shareable: bool) -> bytes:
    """The salt of an API key's requests: its own, or the one all shareable keys have.

    Raises:
      ValueError: a secret under ``MIN_SECRET_BYTES``, or no key hash for a private key.
    """
    if shareable:
        return _salt(secret, b"shared")
    if not key_sha256:
        raise ValueError("a private key's salt needs the key's sha256")
    return _salt(secret, b"key\x00" + key_sha256.encode())


def anonymous_salt(secret: bytes) -> bytes:
    """The salt of requests without an API key (shared by all of them and by no key)."""
    return _salt(secret, b"anonymous")


def _salt(secret: bytes, message: bytes) -> bytes:
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the prefix salt secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
    # (the kinds differ in their first bytes and "key" is followed by a NUL, so no message of
    # one kind is a message of another)
    return hmac.new(secret, _DOMAIN + message, hashlib.sha256).digest()
