"""The tracker-signed model manifest: what a registered GGUF's bytes are.

Owns the ``ModelManifest`` record (protocol/swarm.proto): building it from a file's facts
(metadata prefix size and sha256, each tensor's absolute offset, size and sha256), signing it
with the tracker's Ed25519 key and checking such a signature, so that a node can fetch a
range's bytes from any HTTP source (a mirror, the tracker) and trust only the tracker's word.

The signature is over a domain tag followed by the serialized record (``SIGNING_CONTEXT``):
a manifest signature can never pass as an admission signature or the other way round.

Pure: protobuf records and cryptography's Ed25519 only; ``now_ms`` is an argument. Must not
import trio, grpc, libp2p or agent.io. Hashing the file is the caller's (tracker shell).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.protobuf.message import DecodeError

from agent._proto import swarm_pb2
from agent.core.net.identity import peer_id_from_public_key, sign, verify

__all__ = [
    "MANIFEST_SCHEMA_VERSION",
    "SIGNING_CONTEXT",
    "ManifestError",
    "TensorFacts",
    "build_manifest",
    "sign_manifest",
    "verify_manifest",
]

MANIFEST_SCHEMA_VERSION = 1
SIGNING_CONTEXT = b"baton-manifest-v1\0"
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class ManifestError(Exception):
    """A manifest is malformed, not signed by the expected tracker, or not the expected model."""


@dataclasses.dataclass(frozen=True)
class TensorFacts:
    """One tensor of a GGUF: its name, absolute data offset, size in bytes and sha256 hex."""

    name: str
    offset: int
    size: int
    sha256: str


def build_manifest(
    *,
    model_sha256: str,
    size_bytes: int,
    metadata_size: int,
    metadata_sha256: str,
    architecture: str,
    n_layer: int,
    tensors: Sequence[TensorFacts],
    tracker_peer_id: str,
    now_ms: int,
) -> swarm_pb2.ModelManifest:
    """The manifest of one file (tensors in file order); checked as ``verify_manifest`` checks.

    Raises:
      ManifestError: the facts are inconsistent (overlapping tensors, out of the file, ...).
    """
    manifest = swarm_pb2.ModelManifest(
        schema_version=MANIFEST_SCHEMA_VERSION,
        model_sha256=model_sha256,
        size_bytes=size_bytes,
        metadata_size=metadata_size,
        metadata_sha256=metadata_sha256,
        architecture=architecture,
        n_layer=n_layer,
        tensors=[
            swarm_pb2.TensorRecord(name=t.name, offset=t.offset, size=t.size, sha256=t.sha256)
            for t in sorted(tensors, key=lambda t: t.offset)
        ],
        tracker_peer_id=tracker_peer_id,
        issued_at_ms=now_ms,
    )
    check_manifest(manifest)
    return manifest


def check_manifest(manifest: swarm_pb2.ModelManifest) -> None:
    """Raise ``ManifestError`` unless the record is self-consistent: schema version, hex
    digests, tensors in file order inside ``[metadata_size, size_bytes)``, none overlapping,
    unique names."""
    if manifest.schema_version != MANIFEST_SCHEMA_VERSION:
        raise ManifestError(
            f"manifest schema version {manifest.schema_version}, this node speaks {MANIFEST_SCHEMA_VERSION}"
        )
    for what, digest in (("model_sha256", manifest.model_sha256), ("metadata_sha256", manifest.metadata_sha256)):
        if not _SHA256_HEX.fullmatch(digest):
            raise ManifestError(f"manifest {what} {digest!r} is not 64 lowercase hex digits")
    if not 0 < manifest.metadata_size <= manifest.size_bytes:
        raise ManifestError(f"metadata_size {manifest.metadata_size} is not in (0, {manifest.size_bytes}]")
    end = manifest.metadata_size
    names: set[str] = set()
    for t in manifest.tensors:
        if not t.name or t.name in names:
            raise ManifestError(f"tensor name {t.name!r} is empty or repeated")
        names.add(t.name)
        if t.offset < end:
            raise ManifestError(f"tensor {t.name} at {t.offset} overlaps the bytes before it (which end at {end})")
        if t.offset + t.size > manifest.size_bytes:
            raise ManifestError(
                f"tensor {t.name} [{t.offset}, {t.offset + t.size}) runs past the file's {manifest.size_bytes} bytes"
            )
        if not _SHA256_HEX.fullmatch(t.sha256):
            raise ManifestError(f"tensor {t.name} sha256 {t.sha256!r} is not 64 lowercase hex digits")
        end = t.offset + t.size


def sign_manifest(tracker_key: Ed25519PrivateKey, manifest: swarm_pb2.ModelManifest) -> swarm_pb2.SignedManifest:
    data = manifest.SerializeToString(deterministic=True)
    return swarm_pb2.SignedManifest(manifest=data, signature=sign(tracker_key, SIGNING_CONTEXT + data))


def verify_manifest(
    signed: swarm_pb2.SignedManifest, tracker_public_key: bytes, model_sha256: str | None = None
) -> swarm_pb2.ModelManifest:
    """The manifest inside ``signed`` once its signature by ``tracker_public_key`` checks out,
    it names that tracker, is self-consistent and (if given) describes ``model_sha256``.

    Raises:
      ManifestError: what exactly is wrong.
    """
    if not signed.manifest:
        raise ManifestError("the tracker sent no manifest for this model")
    if not verify(tracker_public_key, SIGNING_CONTEXT + bytes(signed.manifest), bytes(signed.signature)):
        raise ManifestError("the manifest's signature is not the tracker's")
    try:
        manifest = swarm_pb2.ModelManifest.FromString(bytes(signed.manifest))
    except DecodeError as error:
        raise ManifestError(f"the manifest does not parse: {error}") from None
    tracker_peer_id = peer_id_from_public_key(tracker_public_key)
    if manifest.tracker_peer_id != tracker_peer_id:
        raise ManifestError(
            f"the manifest names tracker {manifest.tracker_peer_id!r}, it was signed by {tracker_peer_id}"
        )
    check_manifest(manifest)
    if model_sha256 is not None and manifest.model_sha256 != model_sha256:
        raise ManifestError(f"the manifest describes model {manifest.model_sha256}, not {model_sha256}")
    return manifest
