"""Peer certificates of the direct channel: the libp2p-TLS scheme on stdlib TLS 1.3.

Owns the certificate a peer presents on ``agent.io.net.channel`` and what makes one acceptable:
- the libp2p-TLS extension (libp2p specs, tls/tls.md): OID ``1.3.6.1.4.1.53594.1.1``, DER
  ``SignedKey ::= SEQUENCE { publicKey OCTET STRING, signature OCTET STRING }``, where
  ``publicKey`` is the libp2p ``PublicKey`` protobuf of the peer's Ed25519 identity key and
  ``signature`` its Ed25519 signature over ``b"libp2p-tls-handshake:" + SubjectPublicKeyInfo``
  of the certificate's own (ephemeral) key. TLS proves the peer holds the certificate's key;
  the extension proves the identity key vouched for that key; so the peer id taken from the
  extension is authenticated, and bound to this connection.
- a *public issuer*: the stdlib ``ssl`` module cannot accept an unknown self-signed client
  certificate (there is no verify callback), so every leaf is signed by one fixed Ed25519
  issuer whose key is derived from a public constant. It authenticates nothing (anyone can
  sign with it) and is not meant to: it only gets the leaf through OpenSSL's chain check.
  All authentication is the extension check in ``verify_peer_certificate``.

No randomness or clock here: the ephemeral key, serial and validity come in as arguments.
In ``agent.io`` rather than the core because building X.509 certificates needs calendar dates
(``datetime``), which the core does not import; the acceptance rule itself is pure.
"""

from __future__ import annotations

import datetime
import hashlib

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.x509.oid import NameOID

from agent.core.net.identity import ED25519_KEY_BYTES, peer_id_from_public_key

__all__ = [
    "ISSUER_CERT_PEM",
    "LIBP2P_TLS_OID",
    "PeerCertError",
    "make_peer_certificate",
    "verify_peer_certificate",
]

LIBP2P_TLS_OID = x509.ObjectIdentifier("1.3.6.1.4.1.53594.1.1")
_SIGNATURE_PREFIX = b"libp2p-tls-handshake:"
_ED25519_KEY_TYPE = 1  # libp2p crypto.pb KeyType.Ed25519

_ISSUER_SEED = hashlib.sha256(b"baton/channel-issuer/1: a public key, not a secret").digest()
_ISSUER_KEY = Ed25519PrivateKey.from_private_bytes(_ISSUER_SEED)
_ISSUER_NAME = x509.Name(
    [x509.NameAttribute(NameOID.COMMON_NAME, "baton channel issuer (public, authenticates nothing)")]
)


class PeerCertError(Exception):
    """A peer's certificate does not carry a valid libp2p identity (the peer's fault)."""


def _issuer_certificate() -> x509.Certificate:
    # Ed25519 signatures are deterministic: every process builds the same bytes.
    return (
        x509.CertificateBuilder()
        .subject_name(_ISSUER_NAME)
        .issuer_name(_ISSUER_NAME)
        .public_key(_ISSUER_KEY.public_key())
        .serial_number(1)
        .not_valid_before(datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC))
        .not_valid_after(datetime.datetime(9999, 12, 31, 23, 59, 59, tzinfo=datetime.UTC))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(_ISSUER_KEY, None)
    )


ISSUER_CERT_PEM: bytes = _issuer_certificate().public_bytes(serialization.Encoding.PEM)


def _der_length(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    body = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes((0x80 | len(body),)) + body


def _der(tag: int, body: bytes) -> bytes:
    return bytes((tag,)) + _der_length(len(body)) + body


def _read_der(data: bytes, at: int, tag: int) -> tuple[bytes, int]:
    if at + 2 > len(data) or data[at] != tag:
        raise PeerCertError(f"libp2p extension: expected DER tag {tag:#04x} at byte {at}")
    first = data[at + 1]
    at += 2
    if first < 0x80:
        n = first
    else:
        size = first & 0x7F
        if not 1 <= size <= 4 or at + size > len(data):
            raise PeerCertError("libp2p extension: bad DER length")
        n = int.from_bytes(data[at : at + size], "big")
        at += size
    if at + n > len(data):
        raise PeerCertError("libp2p extension: DER value runs past the end")
    return data[at : at + n], at + n


def _libp2p_public_key(raw: bytes) -> bytes:
    # protobuf PublicKey { Type = 1 (varint), Data = 2 (bytes) }
    return bytes((0x08, _ED25519_KEY_TYPE, 0x12, len(raw))) + raw


def _ed25519_from_libp2p(encoded: bytes) -> bytes:
    if len(encoded) != 4 + ED25519_KEY_BYTES or encoded[:4] != bytes(
        (0x08, _ED25519_KEY_TYPE, 0x12, ED25519_KEY_BYTES)
    ):
        raise PeerCertError("libp2p extension: the public key is not an Ed25519 libp2p PublicKey")
    return encoded[4:]


def _spki(key: ec.EllipticCurvePublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def make_peer_certificate(
    identity: Ed25519PrivateKey,
    cert_key: ec.EllipticCurvePrivateKey,
    *,
    serial_number: int,
    not_before: datetime.datetime,
    not_after: datetime.datetime,
) -> tuple[bytes, bytes]:
    """``(certificate PEM, private key PEM)`` of a leaf for ``cert_key`` (ephemeral, P-256),
    vouched for by ``identity`` through the libp2p extension, signed by the public issuer."""
    identity_raw = identity.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    signature = identity.sign(_SIGNATURE_PREFIX + _spki(cert_key.public_key()))
    signed_key = _der(0x30, _der(0x04, _libp2p_public_key(identity_raw)) + _der(0x04, signature))
    peer_id = peer_id_from_public_key(identity_raw)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, peer_id)]))
        .issuer_name(_ISSUER_NAME)
        .public_key(cert_key.public_key())
        .serial_number(serial_number)
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        # not critical: OpenSSL refuses a certificate with a critical extension it does not know
        .add_extension(x509.UnrecognizedExtension(LIBP2P_TLS_OID, signed_key), critical=False)
        .sign(_ISSUER_KEY, None)
    )
    key_pem = cert_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def verify_peer_certificate(cert_der: bytes) -> str:
    """The authenticated peer id of a certificate the peer presented in a finished TLS
    handshake (so it holds the certificate's key).

    Raises:
      PeerCertError: not a certificate, no libp2p extension, a malformed one, a key that is not
        Ed25519, or a signature that does not cover this certificate's key.
    """
    try:
        cert = x509.load_der_x509_certificate(bytes(cert_der))
    except ValueError as error:
        raise PeerCertError(f"not an X.509 certificate ({error})") from None
    try:
        extension = cert.extensions.get_extension_for_oid(LIBP2P_TLS_OID)
    except x509.ExtensionNotFound:
        raise PeerCertError("the certificate has no libp2p public key extension") from None
    value = extension.value
    data = value.value if isinstance(value, x509.UnrecognizedExtension) else b""
    body, end = _read_der(data, 0, 0x30)
    if end != len(data):
        raise PeerCertError("libp2p extension: bytes after the SignedKey")
    encoded_key, at = _read_der(body, 0, 0x04)
    signature, at = _read_der(body, at, 0x04)
    if at != len(body):
        raise PeerCertError("libp2p extension: bytes after the signature")
    identity_raw = _ed25519_from_libp2p(encoded_key)
    cert_key = cert.public_key()
    if not isinstance(cert_key, ec.EllipticCurvePublicKey):
        raise PeerCertError("the certificate key is not an EC key")
    try:
        Ed25519PublicKey.from_public_bytes(identity_raw).verify(signature, _SIGNATURE_PREFIX + _spki(cert_key))
    except InvalidSignature:
        raise PeerCertError("the identity key's signature does not cover this certificate's key") from None
    return peer_id_from_public_key(identity_raw)
