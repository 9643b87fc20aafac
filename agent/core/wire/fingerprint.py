"""A node's fingerprint: the versioned record of its hardware and runtime it registers with.

Owns building the ``Fingerprint`` record from measured values (``HostProbe``, filled in by
``agent.io.node.probe``) plus what only the node agent knows (peer id, listen addresses, the
models it has, the memory it offers, a creation time and a nonce), and signing it.

Signing is ``agent.core.wire.admission.sign_fingerprint`` (Ed25519 over the exact serialized bytes,
serialized deterministically); the tracker checks it with ``verify_signed_fingerprint``.

Pure: ``created_at_ms`` and ``nonce`` come in as arguments (no clock, no randomness, no I/O).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent._proto import swarm_pb2
from agent.core.wire.admission import NONCE_BYTES, sign_fingerprint

__all__ = [
    "FINGERPRINT_SCHEMA_VERSION",
    "DeviceInfo",
    "HostProbe",
    "build_fingerprint",
    "parse_fingerprint",
    "serialize_fingerprint",
    "signed_fingerprint",
]

#: The Fingerprint schema version this code writes.
FINGERPRINT_SCHEMA_VERSION = 1


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    backend: str
    name: str
    total_bytes: int
    free_bytes: int


@dataclasses.dataclass(frozen=True)
class HostProbe:
    """What the probe measured on this machine (see ``agent.io.node.probe``).

    ``decode_s_per_block`` and ``bandwidth_bytes_per_s`` are proxies, measured by the probe in
    a documented way; the tracker uses them to weigh nodes against each other, not as exact
    predictions.
    """

    os: str
    cpu_model: str
    cpu_cores: int
    ram_total_bytes: int
    ram_available_bytes: int
    devices: tuple[DeviceInfo, ...]
    llama_cpp_commit: str
    patch_series_sha256: str
    architectures: tuple[str, ...]
    decode_s_per_block: float
    bandwidth_bytes_per_s: float


def build_fingerprint(
    probe: HostProbe,
    *,
    peer_id: str,
    listen_addrs: Sequence[str],
    model_sha256s: Sequence[str],
    usable_memory_bytes: int,
    created_at_ms: int,
    nonce: bytes,
    fetches_models: bool = False,
) -> swarm_pb2.Fingerprint:
    """The ``Fingerprint`` record of a node.

    Args:
      probe: measured host values.
      peer_id: the node's libp2p peer id (of the key that signs the fingerprint).
      listen_addrs: multiaddrs the node can be dialled at.
      model_sha256s: sha256 hex of the GGUF files the node has.
      usable_memory_bytes: what the node offers for weights + KV.
      created_at_ms: unix time in ms (the tracker refuses stale ones).
      nonce: 16 random bytes (the tracker refuses a nonce it has seen from this peer).
      fetches_models: the node downloads the ranges it is assigned of models with a source.

    Raises:
      ValueError: the nonce does not have 16 bytes, or a count is negative.
    """
    if len(nonce) != NONCE_BYTES:
        raise ValueError(f"the nonce must have {NONCE_BYTES} bytes, got {len(nonce)}")
    if usable_memory_bytes < 0 or created_at_ms < 0:
        raise ValueError("usable_memory_bytes and created_at_ms must be >= 0")
    return swarm_pb2.Fingerprint(
        fetches_models=fetches_models,
        schema_version=FINGERPRINT_SCHEMA_VERSION,
        peer_id=peer_id,
        os=probe.os,
        cpu_model=probe.cpu_model,
        cpu_cores=probe.cpu_cores,
        ram_total_bytes=probe.ram_total_bytes,
        ram_available_bytes=probe.ram_available_bytes,
        devices=[
            swarm_pb2.Device(backend=d.backend, name=d.name, total_bytes=d.total_bytes, free_bytes=d.free_bytes)
            for d in probe.devices
        ],
        llama_cpp_commit=probe.llama_cpp_commit,
        patch_series_sha256=probe.patch_series_sha256,
        architectures=list(probe.architectures),
        decode_s_per_block=probe.decode_s_per_block,
        bandwidth_bytes_per_s=probe.bandwidth_bytes_per_s,
        created_at_ms=created_at_ms,
        nonce=nonce,
        listen_addrs=list(listen_addrs),
        model_sha256s=list(model_sha256s),
        usable_memory_bytes=usable_memory_bytes,
    )


def serialize_fingerprint(fingerprint: swarm_pb2.Fingerprint) -> bytes:
    """The exact bytes that are signed (deterministic serialization)."""
    return fingerprint.SerializeToString(deterministic=True)


def parse_fingerprint(data: bytes) -> swarm_pb2.Fingerprint:
    fingerprint = swarm_pb2.Fingerprint()
    fingerprint.ParseFromString(data)
    return fingerprint


def signed_fingerprint(
    private_key: Ed25519PrivateKey, fingerprint: swarm_pb2.Fingerprint
) -> swarm_pb2.SignedFingerprint:
    """``fingerprint`` signed by the node key: what ``RegisterRequest`` carries."""
    return sign_fingerprint(private_key, fingerprint)
