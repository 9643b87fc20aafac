"""agent.core.wire.admission: signed fingerprints, admission decisions, tracker-signed admissions."""

from __future__ import annotations

import dataclasses

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent._proto import swarm_pb2
from agent.core.net.identity import peer_id_from_public_key
from agent.core.wire import admission as adm

pytestmark = pytest.mark.unit

NOW_MS = 1_700_000_000_000
PIN = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
PATCH = "ab" * 32


def _key(seed: int) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(bytes([seed]) * 32)


def _peer(key: Ed25519PrivateKey) -> str:
    return peer_id_from_public_key(adm.public_key_bytes(key))


NODE_KEY, OTHER_KEY, TRACKER_KEY = _key(1), _key(2), _key(3)
NODE, OTHER, TRACKER = _peer(NODE_KEY), _peer(OTHER_KEY), _peer(TRACKER_KEY)
TRACKER_PUB = adm.public_key_bytes(TRACKER_KEY)

POLICY = adm.AdmissionPolicy(
    llama_cpp_commit=PIN, patch_series_sha256=PATCH, registration_max_age_ms=60_000, min_bytes_per_block=1000
)


def _fingerprint(**overrides) -> swarm_pb2.Fingerprint:
    fields = {
        "schema_version": 1,
        "peer_id": NODE,
        "llama_cpp_commit": PIN,
        "patch_series_sha256": PATCH,
        "created_at_ms": NOW_MS,
        "nonce": b"\x07" * 16,
        "usable_memory_bytes": 10_000,
        "devices": [swarm_pb2.Device(backend="CPU", name="CPU", total_bytes=1 << 30, free_bytes=1 << 30)],
        "decode_s_per_block": 0.001,
    }
    fields.update(overrides)
    return swarm_pb2.Fingerprint(**fields)


# --- signed fingerprints ------------------------------------------------------------------------


def test_signed_fingerprint_round_trip():
    signed = adm.sign_fingerprint(NODE_KEY, _fingerprint())
    assert adm.verify_signed_fingerprint(signed, NODE) == _fingerprint()


def test_signed_fingerprint_tampered_bytes_is_bad_signature():
    signed = adm.sign_fingerprint(NODE_KEY, _fingerprint())
    signed.fingerprint = _fingerprint(usable_memory_bytes=1 << 40).SerializeToString()
    with pytest.raises(adm.AdmissionError, match=r"^bad signature") as info:
        adm.verify_signed_fingerprint(signed, NODE)
    assert info.value.reason.startswith(adm.REASON_BAD_SIGNATURE)


def test_signed_fingerprint_short_key_is_bad_signature():
    signed = adm.sign_fingerprint(NODE_KEY, _fingerprint())
    signed.public_key = b"\x01" * 31
    with pytest.raises(adm.AdmissionError, match=r"^bad signature: public_key has 31 bytes"):
        adm.verify_signed_fingerprint(signed, NODE)


def test_signed_fingerprint_from_another_connection_is_peer_mismatch():
    signed = adm.sign_fingerprint(NODE_KEY, _fingerprint())
    with pytest.raises(adm.AdmissionError, match=r"^peer id mismatch: the key belongs to .* the connection is from"):
        adm.verify_signed_fingerprint(signed, OTHER)


def test_signed_fingerprint_claiming_another_peer_id_is_peer_mismatch():
    signed = adm.sign_fingerprint(NODE_KEY, _fingerprint(peer_id=OTHER))
    with pytest.raises(adm.AdmissionError, match=r"^peer id mismatch: the fingerprint names"):
        adm.verify_signed_fingerprint(signed, NODE)


def test_signed_fingerprint_garbage_bytes_is_schema_refusal():
    data = b"\xff\xff\xff"
    signed = swarm_pb2.SignedFingerprint(
        fingerprint=data, public_key=adm.public_key_bytes(NODE_KEY), signature=NODE_KEY.sign(data)
    )
    with pytest.raises(adm.AdmissionError, match=r"^unsupported fingerprint schema"):
        adm.verify_signed_fingerprint(signed, NODE)


# --- decisions ------------------------------------------------------------------------------------


def test_admits_a_good_fingerprint():
    assert adm.decide_admission(_fingerprint(), POLICY, NOW_MS, seen_nonce=False) == adm.Decision(True, "")


@pytest.mark.parametrize(
    ("overrides", "seen", "prefix", "detail"),
    [
        ({"schema_version": 2}, False, "unsupported fingerprint schema", "version 2"),
        ({"llama_cpp_commit": "deadbeef"}, False, "wrong llama.cpp pin", "'deadbeef'"),
        ({"patch_series_sha256": "cd" * 32}, False, "wrong patch series", "cd" * 32),
        ({"created_at_ms": NOW_MS - 60_001}, False, "stale registration", "60001 ms old"),
        ({"created_at_ms": NOW_MS + 60_001}, False, "stale registration", "60001 ms in the future"),
        ({}, True, "replayed registration", "07" * 16),
        ({"nonce": b"\x01" * 15}, False, "replayed registration", "15 bytes"),
        ({"usable_memory_bytes": 999}, False, "too little memory", "999"),
        ({"devices": []}, False, "no usable backend", "no device"),
        ({"devices": [swarm_pb2.Device(backend="", name="x")]}, False, "no usable backend", "no device"),
        ({"listen_addrs": ["/ip4/1.2.3.4/tcp/1\x1b[2J"]}, False, "bad listen addresses", "\\x1b[2J"),
        ({"listen_addrs": ["x"]}, False, "bad listen addresses", "listen_addrs[0] 'x'"),
        ({"listen_addrs": [f"/ip4/1.2.3.4/tcp/{i}" for i in range(17)]}, False, "bad listen addresses", "17 addresses"),
    ],
)
def test_refusals_name_the_reason(overrides, seen, prefix, detail):
    decision = adm.decide_admission(_fingerprint(**overrides), POLICY, NOW_MS, seen_nonce=seen)
    assert not decision.admitted
    assert decision.reason.startswith(prefix + ": ")
    assert detail in decision.reason


def test_freshness_window_is_inclusive():
    for created in (NOW_MS - 60_000, NOW_MS + 60_000):
        assert adm.decide_admission(_fingerprint(created_at_ms=created), POLICY, NOW_MS, False).admitted


def test_memory_exactly_one_block_is_enough_and_no_models_means_no_memory_check():
    assert adm.decide_admission(_fingerprint(usable_memory_bytes=1000), POLICY, NOW_MS, False).admitted
    no_models = dataclasses.replace(POLICY, min_bytes_per_block=None)
    assert adm.decide_admission(_fingerprint(usable_memory_bytes=0), no_models, NOW_MS, False).admitted


# --- client hello ---------------------------------------------------------------------------------


def test_client_hello_round_trip_and_refusals():
    hello = adm.make_client_hello(OTHER_KEY, NOW_MS, b"\x05" * 16)
    assert hello.signature == OTHER_KEY.sign(adm.public_key_bytes(OTHER_KEY) + NOW_MS.to_bytes(8, "big") + b"\x05" * 16)
    assert adm.verify_client_hello(hello, OTHER) == OTHER
    assert adm.decide_client_admission(hello, POLICY, NOW_MS, seen_nonce=False).admitted
    assert adm.decide_client_admission(hello, POLICY, NOW_MS, seen_nonce=True).reason.startswith(
        "replayed registration"
    )
    assert adm.decide_client_admission(hello, POLICY, NOW_MS + 60_001, False).reason.startswith("stale registration")
    with pytest.raises(adm.AdmissionError, match=r"^peer id mismatch"):
        adm.verify_client_hello(hello, NODE)
    hello.created_at_ms += 1
    with pytest.raises(adm.AdmissionError, match=r"^bad signature"):
        adm.verify_client_hello(hello, OTHER)


# --- SignedAdmission --------------------------------------------------------------------------------


def _record(**overrides) -> swarm_pb2.AdmissionRecord:
    fields = {
        "schema_version": 1,
        "peer_id": NODE,
        "role": swarm_pb2.ROLE_NODE,
        "tracker_peer_id": TRACKER,
        "issued_at_ms": NOW_MS,
        "expires_at_ms": NOW_MS + 600_000,
    }
    fields.update(overrides)
    return swarm_pb2.AdmissionRecord(**fields)


def test_admission_round_trip_is_deterministic():
    signed = adm.issue_admission(TRACKER_KEY, _record())
    assert signed == adm.issue_admission(TRACKER_KEY, _record())
    assert adm.verify_admission(signed, TRACKER_PUB, NODE, NOW_MS + 599_999) == _record()


def test_admission_role_filter():
    signed = adm.issue_admission(TRACKER_KEY, _record(role=swarm_pb2.ROLE_CLIENT))
    assert adm.verify_admission(signed, TRACKER_PUB, NODE, NOW_MS, roles=[swarm_pb2.ROLE_CLIENT, swarm_pb2.ROLE_NODE])
    with pytest.raises(adm.AdmissionError, match=r"^admission role ROLE_CLIENT is not allowed here \(ROLE_NODE\)"):
        adm.verify_admission(signed, TRACKER_PUB, NODE, NOW_MS, roles=[swarm_pb2.ROLE_NODE])


def test_admission_signed_by_another_key_is_refused():
    signed = adm.issue_admission(OTHER_KEY, _record())
    with pytest.raises(adm.AdmissionError, match=r"^bad tracker signature"):
        adm.verify_admission(signed, TRACKER_PUB, NODE, NOW_MS)


def test_admission_tampered_record_is_refused():
    signed = adm.issue_admission(TRACKER_KEY, _record())
    signed.record = _record(expires_at_ms=NOW_MS * 2).SerializeToString()
    with pytest.raises(adm.AdmissionError, match=r"^bad tracker signature"):
        adm.verify_admission(signed, TRACKER_PUB, NODE, NOW_MS)


def test_admission_shown_by_another_peer_is_refused():
    signed = adm.issue_admission(TRACKER_KEY, _record())
    with pytest.raises(adm.AdmissionError, match=r"^admission peer id mismatch"):
        adm.verify_admission(signed, TRACKER_PUB, OTHER, NOW_MS)


def test_admission_expires_at_its_deadline():
    signed = adm.issue_admission(TRACKER_KEY, _record())
    with pytest.raises(adm.AdmissionError, match=r"^admission expired"):
        adm.verify_admission(signed, TRACKER_PUB, NODE, NOW_MS + 600_000)


@pytest.mark.parametrize(
    ("signed", "key", "match"),
    [
        (swarm_pb2.SignedAdmission(), TRACKER_PUB, "no admission record"),
        (adm.issue_admission(TRACKER_KEY, _record()), b"short", "tracker public key has 5 bytes"),
        (
            swarm_pb2.SignedAdmission(record=b"\xff\xff", signature=TRACKER_KEY.sign(b"\xff\xff")),
            TRACKER_PUB,
            "not an AdmissionRecord",
        ),
        (adm.issue_admission(TRACKER_KEY, _record(schema_version=2)), TRACKER_PUB, "schema_version 2 is not supported"),
        (adm.issue_admission(TRACKER_KEY, _record(tracker_peer_id=OTHER)), TRACKER_PUB, "issued for tracker"),
    ],
)
def test_malformed_admissions(signed, key, match):
    with pytest.raises(adm.AdmissionError, match=f"^malformed admission: .*{match}"):
        adm.verify_admission(signed, key, NODE, NOW_MS)


def test_admission_verifier_checks_each_signature_once_but_sender_expiry_and_role_every_time(monkeypatch):
    calls = []
    real_verify = adm.verify
    monkeypatch.setattr(adm, "verify", lambda *args: calls.append(args) or real_verify(*args))
    verifier = adm.AdmissionVerifier(TRACKER_PUB)
    signed = adm.issue_admission(TRACKER_KEY, _record())
    assert verifier.verify(signed, NODE, NOW_MS) == _record()
    assert verifier.verify(signed, NODE, NOW_MS + 1, roles=[swarm_pb2.ROLE_NODE]) == _record()
    assert len(calls) == 1
    # remembered or not, the record is still checked against who sends it and when
    with pytest.raises(adm.AdmissionError, match=r"^admission peer id mismatch"):
        verifier.verify(signed, OTHER, NOW_MS)
    with pytest.raises(adm.AdmissionError, match=r"^admission expired"):
        verifier.verify(signed, NODE, NOW_MS + 600_000)
    with pytest.raises(adm.AdmissionError, match=r"^admission role ROLE_NODE is not allowed here"):
        verifier.verify(signed, NODE, NOW_MS, roles=[swarm_pb2.ROLE_CLIENT])
    assert len(calls) == 1


def test_admission_verifier_remembers_no_refusal_and_a_bounded_number_of_admissions():
    verifier = adm.AdmissionVerifier(TRACKER_PUB, max_entries=2)
    forged = adm.issue_admission(OTHER_KEY, _record())
    for _ in range(2):  # refused every time: a bad signature is never remembered as good
        with pytest.raises(adm.AdmissionError, match=r"^bad tracker signature"):
            verifier.verify(forged, NODE, NOW_MS)
    tampered = adm.issue_admission(TRACKER_KEY, _record())
    tampered.record = _record(expires_at_ms=NOW_MS * 2).SerializeToString()
    with pytest.raises(adm.AdmissionError, match=r"^bad tracker signature"):
        verifier.verify(tampered, NODE, NOW_MS)
    for expires in (1, 2, 3):
        verifier.verify(adm.issue_admission(TRACKER_KEY, _record(expires_at_ms=NOW_MS + expires)), NODE, NOW_MS)
    assert len(verifier._verified) == 2
