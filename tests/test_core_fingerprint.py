"""Fingerprint records: built from probe values, signed over their exact bytes, accepted by
the tracker's checks (``agent.core.wire.admission``) and refused when altered."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent._proto import swarm_pb2
from agent.core.net.identity import peer_id_from_public_key
from agent.core.wire.admission import (
    AdmissionError,
    AdmissionPolicy,
    decide_admission,
    public_key_bytes,
    verify_signed_fingerprint,
)
from agent.core.wire.fingerprint import (
    FINGERPRINT_SCHEMA_VERSION,
    DeviceInfo,
    HostProbe,
    build_fingerprint,
    parse_fingerprint,
    serialize_fingerprint,
    signed_fingerprint,
)

pytestmark = pytest.mark.unit

PROBE = HostProbe(
    os="Linux 6.1 (x86_64)",
    cpu_model="Test CPU",
    cpu_cores=8,
    ram_total_bytes=32 << 30,
    ram_available_bytes=20 << 30,
    devices=(DeviceInfo("CPU", "CPU", 32 << 30, 20 << 30), DeviceInfo("CUDA", "RTX", 8 << 30, 7 << 30)),
    llama_cpp_commit="0c1e57098bba43ac29e6e3b677cdceebdd22334f",
    patch_series_sha256="ab" * 32,
    architectures=("llama", "qwen2"),
    decode_s_per_block=0.004,
    bandwidth_bytes_per_s=2.5e9,
)
# A fixed key: the test must not depend on randomness.
KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
PEER_ID = peer_id_from_public_key(public_key_bytes(KEY))
NONCE = bytes(range(16))


def fingerprint(**overrides) -> swarm_pb2.Fingerprint:
    fields = dict(
        peer_id=PEER_ID, listen_addrs=["/ip4/127.0.0.1/tcp/4001/p2p/" + PEER_ID], model_sha256s=["cd" * 32],
        usable_memory_bytes=16 << 30, created_at_ms=1_700_000_000_000, nonce=NONCE,
    )  # fmt: skip
    fields.update(overrides)
    return build_fingerprint(PROBE, **fields)


def test_build_fingerprint_carries_every_probe_value() -> None:
    record = fingerprint()
    assert record.schema_version == FINGERPRINT_SCHEMA_VERSION == 1
    assert (record.peer_id, record.os, record.cpu_model, record.cpu_cores) == (PEER_ID, PROBE.os, "Test CPU", 8)
    assert (record.ram_total_bytes, record.ram_available_bytes) == (32 << 30, 20 << 30)
    assert [(d.backend, d.name, d.total_bytes, d.free_bytes) for d in record.devices] == [
        ("CPU", "CPU", 32 << 30, 20 << 30), ("CUDA", "RTX", 8 << 30, 7 << 30),
    ]  # fmt: skip
    assert (record.llama_cpp_commit, record.patch_series_sha256) == (PROBE.llama_cpp_commit, "ab" * 32)
    assert list(record.architectures) == ["llama", "qwen2"]
    assert (record.decode_s_per_block, record.bandwidth_bytes_per_s) == (0.004, 2.5e9)
    assert (record.created_at_ms, record.nonce, record.usable_memory_bytes) == (1_700_000_000_000, NONCE, 16 << 30)
    assert list(record.model_sha256s) == ["cd" * 32] and len(record.listen_addrs) == 1
    assert parse_fingerprint(serialize_fingerprint(record)) == record
    assert serialize_fingerprint(record) == serialize_fingerprint(fingerprint()), "deterministic bytes"


def test_build_fingerprint_refuses_bad_inputs() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        fingerprint(nonce=b"short")
    with pytest.raises(ValueError, match=">= 0"):
        fingerprint(usable_memory_bytes=-1)


def test_signed_fingerprint_passes_the_trackers_checks() -> None:
    record = fingerprint()
    signed = signed_fingerprint(KEY, record)
    assert signed.fingerprint == serialize_fingerprint(record)
    assert signed.public_key == public_key_bytes(KEY)
    assert verify_signed_fingerprint(signed, PEER_ID) == record
    policy = AdmissionPolicy(llama_cpp_commit=PROBE.llama_cpp_commit, patch_series_sha256="ab" * 32)
    assert decide_admission(record, policy, now_ms=record.created_at_ms + 1000, seen_nonce=False).admitted


def test_an_altered_or_foreign_fingerprint_is_refused() -> None:
    signed = signed_fingerprint(KEY, fingerprint())
    altered = swarm_pb2.SignedFingerprint()
    altered.CopyFrom(signed)
    altered.fingerprint = serialize_fingerprint(fingerprint(usable_memory_bytes=1 << 40))
    with pytest.raises(AdmissionError, match="bad signature"):
        verify_signed_fingerprint(altered, PEER_ID)
    other = Ed25519PrivateKey.from_private_bytes(bytes(range(1, 33)))
    claimed = signed_fingerprint(other, fingerprint())  # signed by another key, claiming PEER_ID
    with pytest.raises(AdmissionError, match="peer id mismatch"):
        verify_signed_fingerprint(claimed, peer_id_from_public_key(public_key_bytes(other)))
