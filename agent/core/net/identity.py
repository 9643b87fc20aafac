"""Peer ids from Ed25519 public keys, and signatures, as libp2p defines them.

A libp2p peer id for an Ed25519 key is the base58btc of the identity multihash of the
protobuf-encoded public key (``KeyType.Ed25519 = 1``). Computing it here lets the pure core
check that a signed record's key belongs to the peer that sent it, without libp2p.

Pure: cryptography's Ed25519 (deterministic; no randomness is drawn here).
"""

from __future__ import annotations

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

__all__ = ["ED25519_KEY_BYTES", "b58encode", "peer_id_from_public_key", "sign", "verify"]

ED25519_KEY_BYTES = 32
_B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def b58encode(data: bytes) -> str:
    number = int.from_bytes(data, "big")
    digits = []
    while number:
        number, rest = divmod(number, 58)
        digits.append(_B58_ALPHABET[rest])
    leading_zeros = len(data) - len(data.lstrip(b"\0"))
    return "1" * leading_zeros + "".join(reversed(digits))


def peer_id_from_public_key(public_key: bytes) -> str:
    """The libp2p peer id (base58) of a raw 32-byte Ed25519 public key."""
    if len(public_key) != ED25519_KEY_BYTES:
        raise ValueError(f"an Ed25519 public key has {ED25519_KEY_BYTES} bytes, got {len(public_key)}")
    encoded = bytes([0x08, 0x01, 0x12, ED25519_KEY_BYTES]) + public_key  # PublicKey{Type: Ed25519, Data}
    return b58encode(bytes([0x00, len(encoded)]) + encoded)  # identity multihash


def sign(private_key: Ed25519PrivateKey, message: bytes) -> bytes:
    return private_key.sign(message)


def verify(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """True when ``signature`` is ``public_key``'s Ed25519 signature of ``message``."""
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True
