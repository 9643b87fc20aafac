"""The pure core of model distribution: manifest signatures, which pieces a range reads, the
requests for what is missing (resume), keep / refetch / refuse, HTTP ranges."""

from __future__ import annotations

import hashlib

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent._proto import swarm_pb2
from agent.core.net.identity import peer_id_from_public_key
from agent.core.node.range_fetch import (
    METADATA_PIECE,
    FetchState,
    Piece,
    Verdict,
    fetched_bytes,
    parse_range_header,
    plan_requests,
    range_pieces,
    tensor_verdict,
)
from agent.core.wire.admission import public_key_bytes
from agent.core.wire.manifest import ManifestError, TensorFacts, build_manifest, sign_manifest, verify_manifest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

H = hashlib.sha256(b"x").hexdigest()
KEY = Ed25519PrivateKey.generate()


def manifest(tied: bool = True) -> swarm_pb2.ModelManifest:
    names = [
        "token_embd.weight",
        *(f"blk.{i}.attn_q.weight" for i in range(4)),
        "output_norm.weight",
        "rope_freqs.weight",
    ]
    if not tied:
        names.append("output.weight")
    tensors, offset = [], 100
    for name in names:
        tensors.append(TensorFacts(name, offset, 10, H))
        offset += 16  # 6 bytes of alignment padding after each tensor
    return build_manifest(
        model_sha256="a" * 64, size_bytes=offset, metadata_size=100, metadata_sha256=H, architecture="llama",
        n_layer=4, tensors=tensors, tracker_peer_id=peer_id_from_public_key(public_key_bytes(KEY)), now_ms=5,
    )  # fmt: skip


def test_a_manifest_is_accepted_only_with_the_trackers_signature() -> None:
    signed = sign_manifest(KEY, manifest())
    assert verify_manifest(signed, public_key_bytes(KEY), "a" * 64).n_layer == 4
    other = Ed25519PrivateKey.generate()
    with pytest.raises(ManifestError, match="not the tracker's"):
        verify_manifest(signed, public_key_bytes(other))
    # the last byte flipped (XOR: never the byte it was)
    changed = signed.manifest[:-1] + bytes([signed.manifest[-1] ^ 0x07])
    tampered = swarm_pb2.SignedManifest(manifest=changed, signature=signed.signature)
    with pytest.raises(ManifestError, match="not the tracker's"):
        verify_manifest(tampered, public_key_bytes(KEY))
    with pytest.raises(ManifestError, match="describes model"):
        verify_manifest(signed, public_key_bytes(KEY), "b" * 64)
    with pytest.raises(ManifestError, match="no manifest"):
        verify_manifest(swarm_pb2.SignedManifest(), public_key_bytes(KEY))


def test_inconsistent_facts_are_refused() -> None:
    with pytest.raises(ManifestError, match="overlaps"):
        build_manifest(
            model_sha256="a" * 64, size_bytes=200, metadata_size=100, metadata_sha256=H, architecture="llama",
            n_layer=1, tensors=[TensorFacts("t", 90, 10, H)], tracker_peer_id="p", now_ms=0,
        )  # fmt: skip


def names(begin: int, end: int, tied: bool = True) -> list[str]:
    return [p.name for p in range_pieces(manifest(tied), begin, end)]


def test_pieces_follow_the_loaders_ownership_rules() -> None:
    assert names(0, 2) == [
        METADATA_PIECE,
        "token_embd.weight",
        "blk.0.attn_q.weight",
        "blk.1.attn_q.weight",
        "rope_freqs.weight",
    ]
    assert names(1, 3) == [METADATA_PIECE, "blk.1.attn_q.weight", "blk.2.attn_q.weight", "rope_freqs.weight"]
    # tied embeddings: the last range loads token_embd as its head
    assert names(2, 4) == [METADATA_PIECE, "token_embd.weight", "blk.2.attn_q.weight", "blk.3.attn_q.weight",
                           "output_norm.weight", "rope_freqs.weight"]  # fmt: skip
    assert "token_embd.weight" not in names(2, 4, tied=False) and "output.weight" in names(2, 4, tied=False)
    with pytest.raises(ValueError):
        range_pieces(manifest(), 3, 5)


def test_requests_merge_adjacent_pieces_skip_padding_and_resume() -> None:
    pieces = [Piece("a", 0, 10, H), Piece("b", 10, 10, H), Piece("c", 26, 10, H)]
    state = FetchState("m")
    assert [(r.start, r.end, r.pieces) for r in plan_requests(pieces, state, 1000)] == [
        (0, 20, ("a", "b")), (26, 36, ("c",)),
    ]  # fmt: skip
    assert [(r.start, r.end) for r in plan_requests(pieces, state, 8)] == [
        (0, 8),
        (8, 10),
        (10, 18),
        (18, 20),
        (26, 34),
        (34, 36),
    ]
    state.verified.add("a")
    state.written.update(a=10, b=4)
    assert [(r.start, r.end, r.header) for r in plan_requests(pieces, state, 1000)] == [
        (14, 20, "bytes=14-19"), (26, 36, "bytes=26-35"),
    ]  # fmt: skip
    assert fetched_bytes(pieces, state) == 14
    # a sidecar round trip keeps it; another manifest's sidecar is ignored
    again = FetchState.from_json(state.to_json(), "m")
    assert again.written == state.written and again.verified == state.verified
    assert FetchState.from_json(state.to_json(), "other").written == {}
    assert FetchState.from_json({"schema_version": 99}, "m").written == {}


def test_a_bad_piece_is_fetched_again_then_refused() -> None:
    piece = Piece("blk.1.ffn_up.weight", 0, 10, H)
    state = FetchState("m", written={piece.name: 10})
    assert tensor_verdict(piece, "0" * 64, state, max_attempts=2) is Verdict.REFETCH
    assert state.written.get(piece.name) is None  # from its first byte again
    assert plan_requests([piece], state, 100)[0].start == 0
    assert tensor_verdict(piece, "0" * 64, state, max_attempts=2) is Verdict.REFUSE
    good = FetchState("m")
    assert tensor_verdict(piece, H, good, max_attempts=2) is Verdict.KEEP and piece.name in good.verified
    assert plan_requests([piece], good, 100) == []


def test_range_headers() -> None:
    assert parse_range_header(None, 100) is None
    assert parse_range_header("bytes=10-19", 100) == (10, 20)
    assert parse_range_header("bytes=90-", 100) == (90, 100)
    assert parse_range_header("bytes=-5", 100) == (95, 100)
    assert parse_range_header("bytes=90-500", 100) == (90, 100)
    for bad in ("bytes=100-", "bytes=5-1", "items=1-2", "bytes=1-2,4-5", "bytes=x-"):
        with pytest.raises(ValueError):
            parse_range_header(bad, 100)
