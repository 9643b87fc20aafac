"""Admission: who may take part in the swarm, decided by the tracker and checked by every peer.

Owns the rules of the shared swarm semantics (docs/ARCHITECTURE.md):
- a node's ``SignedFingerprint`` (signature over the exact fingerprint bytes, key <-> claimed
  peer id <-> the transport-authenticated peer id): ``verify_signed_fingerprint``;
- the tracker's decision on a verified fingerprint (pin, patch series, schema, freshness,
  replay, memory, backend): ``decide_admission``; a client hello: ``verify_client_hello`` +
  ``decide_client_admission``;
- the tracker-signed ``SignedAdmission`` every peer shows: ``issue_admission`` (tracker) and
  ``verify_admission`` (nodes and clients, before accepting a step / result / node request).

Refusal reasons start with a fixed prefix (``REASON_*``), so peers and tests can match them;
the rest of the text says what exactly was wrong.

Pure: protobuf records and cryptography's Ed25519 only; ``now_ms`` and nonces come in as
arguments (no clock, no randomness, no I/O). Must not import trio, grpc, libp2p or agent.io.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from google.protobuf.message import DecodeError

from agent._proto import swarm_pb2
from agent.core.net.identity import ED25519_KEY_BYTES, peer_id_from_public_key, sign, verify
from agent.core.wire.swarm_wire import WireError, check_listen_addrs

__all__ = [
    "ADMISSION_SCHEMA_VERSION",
    "NONCE_BYTES",
    "REASON_BAD_ADDRESSES",
    "REASON_BAD_SIGNATURE",
    "REASON_NO_BACKEND",
    "REASON_PATCH",
    "REASON_PEER_MISMATCH",
    "REASON_PIN",
    "REASON_REPLAYED",
    "REASON_SCHEMA",
    "REASON_STALE",
    "REASON_TOO_LITTLE_MEMORY",
    "AdmissionError",
    "AdmissionPolicy",
    "AdmissionVerifier",
    "Decision",
    "check_admission_record",
    "client_hello_payload",
    "decide_admission",
    "decide_client_admission",
    "fingerprint_sha256",
    "issue_admission",
    "make_client_hello",
    "public_key_bytes",
    "sign_fingerprint",
    "verify_admission",
    "verify_client_hello",
    "verify_signed_fingerprint",
]

#: AdmissionRecord / Fingerprint schema version this code speaks.
ADMISSION_SCHEMA_VERSION = 1
#: A registration / hello nonce has exactly this many bytes.
NONCE_BYTES = 16

# Refusal reason prefixes (the wire text starts with one of these).
REASON_BAD_SIGNATURE = "bad signature"
REASON_PEER_MISMATCH = "peer id mismatch"
REASON_SCHEMA = "unsupported fingerprint schema"
REASON_PIN = "wrong llama.cpp pin"
REASON_PATCH = "wrong patch series"
REASON_STALE = "stale registration"
REASON_REPLAYED = "replayed registration"
REASON_TOO_LITTLE_MEMORY = "too little memory"
REASON_NO_BACKEND = "no usable backend"
REASON_BAD_ADDRESSES = "bad listen addresses"


class AdmissionError(Exception):
    """A signed record failed a check; ``reason`` says which (starts with a ``REASON_*`` prefix
    for fingerprints / hellos, or with "bad tracker signature", "admission peer id mismatch",
    "admission expired", "malformed admission" for ``verify_admission``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class AdmissionPolicy:
    """What the tracker requires of a node.

    ``min_bytes_per_block``: the smallest ``bytes_per_block`` among the registered models (a
    node must hold at least one block of some model); None when no model is registered (no
    memory check). ``registration_max_age_ms``: a fingerprint / hello timestamp must be within
    this many ms of the tracker's clock, in either direction.
    """

    llama_cpp_commit: str
    patch_series_sha256: str
    schema_versions: frozenset[int] = frozenset({ADMISSION_SCHEMA_VERSION})
    registration_max_age_ms: int = 60_000
    min_bytes_per_block: int | None = None


@dataclasses.dataclass(frozen=True)
class Decision:
    admitted: bool
    reason: str = ""


_ADMITTED = Decision(True, "")


def public_key_bytes(private_key: Ed25519PrivateKey) -> bytes:
    """The raw 32-byte public key of ``private_key`` (what goes on the wire)."""
    return private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


# --------------------------------------------------------------------------------------------
# Fingerprints (node -> tracker)


def sign_fingerprint(private_key: Ed25519PrivateKey, fingerprint: swarm_pb2.Fingerprint) -> swarm_pb2.SignedFingerprint:
    """Serialize ``fingerprint`` and sign those exact bytes (what a node registers with)."""
    data = fingerprint.SerializeToString(deterministic=True)
    return swarm_pb2.SignedFingerprint(
        fingerprint=data, public_key=public_key_bytes(private_key), signature=sign(private_key, data)
    )


def verify_signed_fingerprint(signed: swarm_pb2.SignedFingerprint, remote_peer_id: str) -> swarm_pb2.Fingerprint:
    """Check a node's signed fingerprint and return the parsed ``Fingerprint``.

    Checks: the public key is a 32-byte Ed25519 key, the signature over the exact fingerprint
    bytes is valid, the fingerprint's peer_id is the key's peer id, and that peer id is the one
    the transport authenticated (``remote_peer_id``).

    Raises:
      AdmissionError: reason starts with "bad signature", "peer id mismatch" or
        "unsupported fingerprint schema" (bytes that do not parse as a Fingerprint).
    """
    key = bytes(signed.public_key)
    if len(key) != ED25519_KEY_BYTES:
        raise AdmissionError(f"{REASON_BAD_SIGNATURE}: public_key has {len(key)} bytes, expected {ED25519_KEY_BYTES}")
    if not verify(key, bytes(signed.fingerprint), bytes(signed.signature)):
        raise AdmissionError(f"{REASON_BAD_SIGNATURE}: the signature does not verify over the fingerprint bytes")
    key_peer_id = peer_id_from_public_key(key)
    if key_peer_id != remote_peer_id:
        raise AdmissionError(
            f"{REASON_PEER_MISMATCH}: the key belongs to {key_peer_id}, the connection is from {remote_peer_id}"
        )
    fingerprint = swarm_pb2.Fingerprint()
    try:
        fingerprint.ParseFromString(bytes(signed.fingerprint))
    except DecodeError:
        raise AdmissionError(f"{REASON_SCHEMA}: the fingerprint bytes are not a Fingerprint record") from None
    if fingerprint.peer_id != key_peer_id:
        raise AdmissionError(
            f"{REASON_PEER_MISMATCH}: the fingerprint names {fingerprint.peer_id!r}, the key belongs to {key_peer_id}"
        )
    return fingerprint


def _freshness(created_at_ms: int, now_ms: int, max_age_ms: int, what: str) -> str | None:
    skew = created_at_ms - now_ms
    if skew > max_age_ms:
        return f"{REASON_STALE}: {what} created_at_ms is {skew} ms in the future (limit {max_age_ms} ms)"
    if -skew > max_age_ms:
        return f"{REASON_STALE}: {what} created_at_ms is {-skew} ms old (limit {max_age_ms} ms)"
    return None


def decide_admission(
    fingerprint: swarm_pb2.Fingerprint, policy: AdmissionPolicy, now_ms: int, seen_nonce: bool
) -> Decision:
    """The tracker's decision on a verified fingerprint (see ``verify_signed_fingerprint``).

    ``seen_nonce``: whether this peer already registered with ``fingerprint.nonce``.
    Checks, in order: schema version, llama.cpp pin, patch series, freshness, nonce (length and
    replay), memory (at least one block of the smallest registered model), backend (at least
    one device with a backend), listen addresses (printable multiaddrs, a few: they are shown).
    """
    if fingerprint.schema_version not in policy.schema_versions:
        supported = ", ".join(str(v) for v in sorted(policy.schema_versions))
        return Decision(
            False, f"{REASON_SCHEMA}: version {fingerprint.schema_version} (this tracker speaks {supported})"
        )
    if fingerprint.llama_cpp_commit != policy.llama_cpp_commit:
        return Decision(
            False,
            f"{REASON_PIN}: node runs {fingerprint.llama_cpp_commit!r}, tracker expects {policy.llama_cpp_commit!r}",
        )
    if fingerprint.patch_series_sha256 != policy.patch_series_sha256:
        return Decision(
            False,
            f"{REASON_PATCH}: node has {fingerprint.patch_series_sha256!r}, "
            f"tracker expects {policy.patch_series_sha256!r}",
        )
    refused = _fresh_and_unseen(fingerprint.created_at_ms, fingerprint.nonce, now_ms, policy, seen_nonce, "fingerprint")
    if refused is not None:
        return refused
    if policy.min_bytes_per_block is not None and fingerprint.usable_memory_bytes < policy.min_bytes_per_block:
        return Decision(
            False,
            f"{REASON_TOO_LITTLE_MEMORY}: usable_memory_bytes {fingerprint.usable_memory_bytes} is less than one "
            f"block of the smallest registered model ({policy.min_bytes_per_block} bytes)",
        )
    if not any(device.backend for device in fingerprint.devices):
        return Decision(False, f"{REASON_NO_BACKEND}: the fingerprint lists no device with a backend")
    try:
        check_listen_addrs(fingerprint.listen_addrs)
    except WireError as error:
        return Decision(False, f"{REASON_BAD_ADDRESSES}: {error.message}")
    return _ADMITTED


# --------------------------------------------------------------------------------------------
# Client hello (client -> tracker)


def client_hello_payload(public_key: bytes, created_at_ms: int, nonce: bytes) -> bytes:
    """The bytes a client signs: public_key || created_at_ms (8 bytes big-endian) || nonce."""
    return bytes(public_key) + int(created_at_ms).to_bytes(8, "big") + bytes(nonce)


def make_client_hello(private_key: Ed25519PrivateKey, created_at_ms: int, nonce: bytes) -> swarm_pb2.ClientHelloRequest:
    """A signed ``ClientHelloRequest`` (``nonce``: 16 random bytes chosen by the caller)."""
    key = public_key_bytes(private_key)
    return swarm_pb2.ClientHelloRequest(
        public_key=key,
        created_at_ms=created_at_ms,
        nonce=nonce,
        signature=sign(private_key, client_hello_payload(key, created_at_ms, nonce)),
    )


def verify_client_hello(hello: swarm_pb2.ClientHelloRequest, remote_peer_id: str) -> str:
    """Check a client hello's signature and key; return the client's peer id.

    Raises:
      AdmissionError: "bad signature ..." or "peer id mismatch ...".
    """
    key = bytes(hello.public_key)
    if len(key) != ED25519_KEY_BYTES:
        raise AdmissionError(f"{REASON_BAD_SIGNATURE}: public_key has {len(key)} bytes, expected {ED25519_KEY_BYTES}")
    if not verify(key, client_hello_payload(key, hello.created_at_ms, hello.nonce), bytes(hello.signature)):
        raise AdmissionError(f"{REASON_BAD_SIGNATURE}: the signature does not verify over the hello")
    peer_id = peer_id_from_public_key(key)
    if peer_id != remote_peer_id:
        raise AdmissionError(
            f"{REASON_PEER_MISMATCH}: the key belongs to {peer_id}, the connection is from {remote_peer_id}"
        )
    return peer_id


def decide_client_admission(
    hello: swarm_pb2.ClientHelloRequest, policy: AdmissionPolicy, now_ms: int, seen_nonce: bool
) -> Decision:
    """Freshness and replay rules for a verified client hello (same as for fingerprints)."""
    refused = _fresh_and_unseen(hello.created_at_ms, hello.nonce, now_ms, policy, seen_nonce, "hello")
    return refused if refused is not None else _ADMITTED


def _fresh_and_unseen(
    created_at_ms: int, nonce: bytes, now_ms: int, policy: AdmissionPolicy, seen_nonce: bool, what: str
) -> Decision | None:
    """The refusal for a stale or replayed signed record, or None when it is fresh and new."""
    stale = _freshness(created_at_ms, now_ms, policy.registration_max_age_ms, what)
    if stale is not None:
        return Decision(False, stale)
    if len(nonce) != NONCE_BYTES:
        return Decision(False, f"{REASON_REPLAYED}: nonce has {len(nonce)} bytes, expected {NONCE_BYTES}")
    if seen_nonce:
        return Decision(False, f"{REASON_REPLAYED}: nonce {nonce.hex()} was already used by this peer")
    return None


# --------------------------------------------------------------------------------------------
# SignedAdmission (tracker -> every peer)


def fingerprint_sha256(signed: swarm_pb2.SignedFingerprint) -> str:
    """The hex sha256 of the exact signed fingerprint bytes (AdmissionRecord.fingerprint_sha256)."""
    return hashlib.sha256(bytes(signed.fingerprint)).hexdigest()


def issue_admission(tracker_key: Ed25519PrivateKey, record: swarm_pb2.AdmissionRecord) -> swarm_pb2.SignedAdmission:
    """Sign ``record`` with the tracker key (deterministic: Ed25519 draws no randomness)."""
    data = record.SerializeToString(deterministic=True)
    return swarm_pb2.SignedAdmission(record=data, signature=sign(tracker_key, data))


def verify_admission(
    signed: swarm_pb2.SignedAdmission,
    tracker_public_key: bytes,
    remote_peer_id: str,
    now_ms: int,
    *,
    roles: Iterable[int] | None = None,
) -> swarm_pb2.AdmissionRecord:
    """Check an admission a peer presents and return its record.

    Args:
      signed: the ``SignedAdmission`` the peer sent (e.g. ``StepRequest.sender_admission``).
      tracker_public_key: raw 32-byte key learnt at registration / hello.
      remote_peer_id: the transport-authenticated peer id of the sender.
      now_ms: the checker's unix time in ms.
      roles: if given, the record's role must be one of these (``swarm_pb2.ROLE_NODE`` ...).

    Raises:
      AdmissionError: reason starts with "malformed admission" (missing, unparseable, wrong
        schema, wrong tracker), "bad tracker signature", "admission peer id mismatch",
        "admission expired" or "admission role".
    """
    return check_admission_record(_signed_record(signed, tracker_public_key), remote_peer_id, now_ms, roles=roles)


def _signed_record(signed: swarm_pb2.SignedAdmission, tracker_public_key: bytes) -> swarm_pb2.AdmissionRecord:
    """The checks that depend only on the signed bytes and the tracker key (memoizable)."""
    if not signed.record:
        raise AdmissionError("malformed admission: no admission record")
    if len(tracker_public_key) != ED25519_KEY_BYTES:
        raise AdmissionError(
            f"malformed admission: tracker public key has {len(tracker_public_key)} bytes, expected {ED25519_KEY_BYTES}"
        )
    if not verify(bytes(tracker_public_key), bytes(signed.record), bytes(signed.signature)):
        raise AdmissionError("bad tracker signature: the admission was not signed by this tracker")
    record = swarm_pb2.AdmissionRecord()
    try:
        record.ParseFromString(bytes(signed.record))
    except DecodeError:
        raise AdmissionError("malformed admission: the record bytes are not an AdmissionRecord") from None
    if record.schema_version != ADMISSION_SCHEMA_VERSION:
        raise AdmissionError(
            f"malformed admission: schema_version {record.schema_version} is not supported "
            f"(this peer speaks {ADMISSION_SCHEMA_VERSION})"
        )
    tracker_peer_id = peer_id_from_public_key(bytes(tracker_public_key))
    if record.tracker_peer_id != tracker_peer_id:
        raise AdmissionError(
            f"malformed admission: issued for tracker {record.tracker_peer_id!r}, not {tracker_peer_id}"
        )
    return record


def check_admission_record(
    record: swarm_pb2.AdmissionRecord, remote_peer_id: str, now_ms: int, *, roles: Iterable[int] | None = None
) -> swarm_pb2.AdmissionRecord:
    """The checks of a tracker-signed record that depend on who sends it, and when."""
    if record.peer_id != remote_peer_id:
        raise AdmissionError(
            f"admission peer id mismatch: the admission is for {record.peer_id!r}, the sender is {remote_peer_id}"
        )
    if now_ms >= record.expires_at_ms:
        raise AdmissionError(
            f"admission expired: expires_at_ms {record.expires_at_ms} <= now {now_ms} "
            f"({now_ms - record.expires_at_ms} ms ago)"
        )
    if roles is not None:
        allowed = set(roles)
        if record.role not in allowed:
            names = ", ".join(_role_name(r) for r in sorted(allowed))
            raise AdmissionError(f"admission role {_role_name(record.role)} is not allowed here ({names})")
    return record


class AdmissionVerifier:
    """``verify_admission`` for one tracker key, remembering signatures it has checked.

    A peer presents the same ``SignedAdmission`` bytes on every step until it is re-issued,
    so the Ed25519 verification (~0.1 ms) is done once per distinct admission; who sends it,
    its expiry and its role are still checked on every call. At most ``max_entries``
    admissions are remembered (the oldest is forgotten first), and as many peers that showed
    one (``admitted``).
    """

    def __init__(self, tracker_public_key: bytes, max_entries: int = 4096) -> None:
        self.tracker_public_key = bytes(tracker_public_key)
        self.max_entries = max_entries
        self._verified: dict[tuple[bytes, bytes], swarm_pb2.AdmissionRecord] = {}
        self._admitted_until: dict[str, int] = {}  # peer id -> when the admission it showed expires (ms)

    def verify(
        self,
        signed: swarm_pb2.SignedAdmission,
        remote_peer_id: str,
        now_ms: int,
        *,
        roles: Iterable[int] | None = None,
    ) -> swarm_pb2.AdmissionRecord:
        key = (bytes(signed.record), bytes(signed.signature))
        record = self._verified.get(key)
        if record is None:
            record = _signed_record(signed, self.tracker_public_key)  # raises: nothing is remembered
            if len(self._verified) >= self.max_entries:
                del self._verified[next(iter(self._verified))]
            self._verified[key] = record
        checked = check_admission_record(record, remote_peer_id, now_ms, roles=roles)
        self._admitted_until.pop(remote_peer_id, None)  # (re)inserted last: the newest is kept longest
        if len(self._admitted_until) >= self.max_entries:
            del self._admitted_until[next(iter(self._admitted_until))]
        self._admitted_until[remote_peer_id] = checked.expires_at_ms
        return checked

    def admitted(self, peer_id: str, now_ms: int) -> bool:
        """Whether ``peer_id`` showed an admission here that has not expired at ``now_ms`` (a
        transport lets such a peer send bigger requests than a stranger)."""
        return now_ms < self._admitted_until.get(peer_id, 0)


def _role_name(role: int) -> str:
    try:
        return swarm_pb2.Role.Name(role)
    except ValueError:
        return str(role)
