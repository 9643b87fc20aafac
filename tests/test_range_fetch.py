"""Fetching a layer range by HTTP range requests: exactly the range's bytes, into a sparse
file, every tensor checked; a cut download resumes, a bad tensor is fetched again, then
refused with its name and source. A real HTTP server (``agent.io.model_http``, Hypercorn on
trio) serves the file and counts what it sent."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.core.net.identity import peer_id_from_public_key
from agent.core.node.range_fetch import METADATA_PIECE, FetchRefused, range_pieces
from agent.core.wire.admission import public_key_bytes
from agent.core.wire.manifest import build_manifest, sign_manifest, verify_manifest
from agent.io.model_http import serve_model_files
from agent.io.node.fetch import FetchConfig, FetchError, fetch_range
from agent.io.tracker.gguf_info import read_registered_file
from agent.models import cached_sha256
from agent.testing.model_http import RecordingModelFileServer

pytestmark = [pytest.mark.worker, pytest.mark.timeout(120)]


def make_manifest(path: Path, key: Ed25519PrivateKey):
    import hashlib

    from agent.io.tracker.gguf_info import read_gguf_facts

    facts = read_gguf_facts(path)
    metadata, tensors = read_registered_file(path, cached_sha256(path), path.stat().st_size)
    manifest = build_manifest(
        model_sha256=cached_sha256(path), size_bytes=path.stat().st_size, metadata_size=len(metadata),
        metadata_sha256=hashlib.sha256(metadata).hexdigest(), architecture=facts.architecture, n_layer=facts.n_layer, tensors=tensors,
        tracker_peer_id=peer_id_from_public_key(public_key_bytes(key)), now_ms=1,
    )  # fmt: skip
    return verify_manifest(sign_manifest(key, manifest), public_key_bytes(key), cached_sha256(path))


@pytest.fixture(scope="module")
def smollm2_manifest(smollm2_path: Path):
    return make_manifest(smollm2_path, Ed25519PrivateKey.generate())


@contextlib.asynccontextmanager
async def serving(files: dict[str, Path]) -> AsyncIterator[tuple[RecordingModelFileServer, str]]:
    server = RecordingModelFileServer(files)
    async with trio.open_nursery() as nursery:
        base = await nursery.start(serve_model_files, server, "127.0.0.1", 0)
        yield server, base
        nursery.cancel_scope.cancel()


def disk_bytes(path: Path) -> int:
    return os.stat(path).st_blocks * 512


QUIET = FetchConfig(show_progress=False, retry_delay_s=0.0)


async def test_a_range_fetches_exactly_its_bytes_into_a_sparse_file(
    smollm2_path: Path, smollm2_manifest, tmp_path: Path
) -> None:
    manifest = smollm2_manifest
    pieces = range_pieces(manifest, 10, 20)
    need = sum(p.size for p in pieces)
    names = {p.name for p in pieces}
    assert METADATA_PIECE in names and "blk.10.attn_q.weight" in names and "blk.19.ffn_down.weight" in names
    assert not names & {"token_embd.weight", "output_norm.weight", "blk.9.attn_q.weight", "blk.20.attn_q.weight"}
    dest = tmp_path / "m.gguf"
    async with serving({"m.gguf": smollm2_path}) as (server, base):
        await fetch_range(manifest, [(10, 20)], server.url(base, "m.gguf"), dest, config=QUIET)
    assert server.sent_bytes["m.gguf"] == need
    assert dest.stat().st_size == smollm2_path.stat().st_size
    # disk use: the fetched bytes, rounded up to file system blocks per contiguous run
    assert need <= disk_bytes(dest) <= need + 64 * 1024
    assert disk_bytes(dest) < smollm2_path.stat().st_size / 2
    with open(dest, "rb") as got, open(smollm2_path, "rb") as want:
        for piece in pieces:
            got.seek(piece.offset)
            want.seek(piece.offset)
            assert got.read(piece.size) == want.read(piece.size), piece.name


async def test_first_and_last_ranges_take_embeddings_and_head(smollm2_manifest) -> None:
    first = {p.name for p in range_pieces(smollm2_manifest, 0, 10)}
    last = {p.name for p in range_pieces(smollm2_manifest, 20, 30)}
    assert "token_embd.weight" in first and "output_norm.weight" not in first
    # SmolLM2 ties its embeddings: the last range loads token_embd as the head
    assert {"output_norm.weight", "token_embd.weight"} <= last
    assert not any(t.name == "output.weight" for t in smollm2_manifest.tensors)


async def test_a_cut_download_resumes_without_fetching_again(
    smollm2_path: Path, smollm2_manifest, tmp_path: Path
) -> None:
    need = sum(p.size for p in range_pieces(smollm2_manifest, 10, 20))
    dest = tmp_path / "m.gguf"
    async with serving({"m.gguf": smollm2_path}) as (server, base):
        url = server.url(base, "m.gguf")
        server.cut_after_bytes = need // 2
        with pytest.raises(FetchError):
            await fetch_range(
                smollm2_manifest, [(10, 20)], url, dest,
                config=FetchConfig(show_progress=False, max_network_retries=0, max_request_bytes=need),
            )  # fmt: skip
        first_run = server.sent_bytes["m.gguf"]
        assert first_run == need // 2
        server.cut_after_bytes = None
        seen = []
        await fetch_range(smollm2_manifest, [(10, 20)], url, dest, config=QUIET, on_progress=seen.append)
    assert server.sent_bytes["m.gguf"] == need  # the second run fetched only the other half
    assert seen[0].done_bytes >= need // 2 - 2 * 1024 * 1024 and seen[-1].done_bytes == seen[-1].total_bytes == need
    # a third run fetches nothing: every tensor is already there (and hashed again)
    async with serving({"m.gguf": smollm2_path}) as (server, base):
        await fetch_range(smollm2_manifest, [(10, 20)], server.url(base, "m.gguf"), dest, config=QUIET)
        assert server.sent_bytes["m.gguf"] == 0


async def test_a_bad_tensor_is_fetched_again_then_refused_by_name(
    smollm2_path: Path, smollm2_manifest, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.gguf"
    shutil.copyfile(smollm2_path, bad)
    (victim,) = [t for t in smollm2_manifest.tensors if t.name == "blk.12.ffn_up.weight"]
    with open(bad, "r+b") as f:
        f.seek(victim.offset + victim.size // 2)
        byte = f.read(1)
        f.seek(victim.offset + victim.size // 2)
        f.write(bytes([byte[0] ^ 0x01]))
    dest = tmp_path / "m.gguf"
    async with serving({"bad.gguf": bad}) as (server, base):
        url = server.url(base, "bad.gguf")
        with pytest.raises(FetchRefused) as caught:
            await fetch_range(smollm2_manifest, [(10, 20)], url, dest, config=QUIET)
        ranges = [h for name, h in server.requests]
    assert caught.value.piece == "blk.12.ffn_up.weight" and caught.value.source == url
    assert "blk.12.ffn_up.weight" in str(caught.value) and url in str(caught.value)
    # fetched twice: once within the range, once on its own
    assert f"bytes={victim.offset}-{victim.offset + victim.size - 1}" in ranges


async def test_a_damaged_local_file_is_noticed_before_ready(
    smollm2_path: Path, smollm2_manifest, tmp_path: Path
) -> None:
    dest = tmp_path / "m.gguf"
    async with serving({"m.gguf": smollm2_path}) as (server, base):
        url = server.url(base, "m.gguf")
        await fetch_range(smollm2_manifest, [(10, 20)], url, dest, config=QUIET)
        (victim,) = [t for t in smollm2_manifest.tensors if t.name == "blk.15.attn_k.weight"]
        with open(dest, "r+b") as f:
            f.seek(victim.offset)
            f.write(b"\xff")
        before = server.sent_bytes["m.gguf"]
        await fetch_range(smollm2_manifest, [(10, 20)], url, dest, config=QUIET)
        assert server.sent_bytes["m.gguf"] - before == victim.size
        assert server.requests[-1] == ("m.gguf", f"bytes={victim.offset}-{victim.offset + victim.size - 1}")


async def test_a_source_that_ignores_ranges_is_refused(smollm2_manifest, tmp_path: Path) -> None:
    import httpx

    def whole_file(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"x" * 100)

    async with httpx.AsyncClient(transport=httpx.MockTransport(whole_file)) as client:
        with pytest.raises(FetchError, match="ignores HTTP range requests"):
            await fetch_range(
                smollm2_manifest, [(10, 20)], "http://mirror.invalid/m.gguf", tmp_path / "m.gguf", config=QUIET,
                http_client=client,
            )  # fmt: skip
