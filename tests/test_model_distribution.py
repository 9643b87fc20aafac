"""Models come from the swarm, by range, end to end: a real tracker and three real node
processes on loopback; the node that is assigned SmolLM2's blocks [10, 20) has no model file
and fetches only the metadata and its range's tensors, by HTTP range requests, from a real
HTTP server (``agent.io.model_http`` on Hypercorn, in this test's trio loop) that counts
what it sent; its disk holds only those bytes, and the route's output equals one unsplit
worker's. The tracker's own ``--serve-models`` is a second source."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
import trio

from agent.core.node.range_fetch import range_pieces
from agent.core.wire.manifest import verify_manifest
from agent.demo.local_demo import generate_through
from agent.demo.swarm_demo import wait_for_coverage
from agent.harness.local_swarm import LocalSwarm, LocalSwarmConfig
from agent.io.client import open_swarm_client
from agent.io.model_http import ModelFileServer, serve_model_files
from agent.io.worker.process import open_worker
from agent.models import model_path, sha256_file

pytestmark = [pytest.mark.swarm, pytest.mark.slow]

ALIAS = "smollm2"
PROMPT = "The capital of France is"
NEW_TOKENS = 24
SETUP_TIMEOUT_S = 240.0


async def _single_worker_tokens(path: Path, sha256: str) -> tuple[list[int], list[int]]:
    async with open_worker(path, 0, None, threads=1, max_sequences=1, model_sha256=sha256) as single:
        tokens = await single.client.tokenize(PROMPT, add_special=True)
        run = await generate_through([single.client], tokens, NEW_TOKENS, stop_tokens=single.info.eog_token_ids)
    return tokens, run.tokens


@pytest.mark.timeout(400)
async def test_a_node_without_the_file_fetches_exactly_its_range_and_serves_it(tmp_path: Path) -> None:
    path = model_path("smollm2")
    sha256 = await trio.to_thread.run_sync(sha256_file, path)
    server = ModelFileServer({"smollm2.gguf": path})
    async with trio.open_nursery() as nursery:
        base = await nursery.start(serve_model_files, server, "127.0.0.1", 0)
        source = server.url(base, "smollm2.gguf")
        config = LocalSwarmConfig(
            model_path=path, model_alias=ALIAS, workdir=tmp_path,
            tracker_args=("--model-source", f"{ALIAS}={source}", "--serve-models", "127.0.0.1:0"),
        )  # fmt: skip
        swarm = LocalSwarm(config, tmp_path)
        try:
            await swarm.start_tracker()
            names = ["node-1", "node-2", "node-3"]
            fetcher = sorted(names, key=swarm.peer_id)[1]  # ranges go to nodes in peer id order
            models_dir = tmp_path / "fetched"
            async with open_swarm_client(swarm.tracker_addr) as client:
                (entry,) = [m for m in await client.list_models() if m.alias == ALIAS]
                assert entry.has_source
                memory = 10 * entry.bytes_per_block + entry.bytes_per_block // 2  # exactly 10 blocks each
                for name in names:
                    if name == fetcher:
                        swarm.start_node(name, memory, ["--models-dir", str(models_dir)], model=False)
                    else:
                        swarm.start_node(name, memory)
                route = await wait_for_coverage(client, swarm, ALIAS, timeout_s=SETUP_TIMEOUT_S)
                assert [(h.begin, h.end) for h in route.hops] == [(0, 10), (10, 20), (20, 30)]
                assert route.hops[1].peer_id == swarm.nodes[fetcher].peer_id

                # the manifest is the tracker's, and names both sources
                reply = await client.model_metadata(ALIAS)
                manifest = verify_manifest(reply.manifest, client.tracker_public_key, sha256)
                assert next(iter(reply.source_urls)) == source and len(reply.source_urls) == 2

                # exactly the metadata and the range's tensors came over HTTP, and that is the disk use
                pieces = range_pieces(manifest, 10, 20)
                need = sum(p.size for p in pieces)
                assert server.sent_bytes["smollm2.gguf"] == need, (server.sent_bytes, need)
                local = models_dir / f"{sha256}.gguf"
                assert local.stat().st_size == path.stat().st_size
                disk = os.stat(local).st_blocks * 512
                assert need <= disk <= need + 64 * 1024, (disk, need)
                print(f"fetched {need} of {path.stat().st_size} bytes; disk use {disk} bytes")

                # the route through the fetched range gives the unsplit worker's tokens
                prompt_tokens, expected = await _single_worker_tokens(path, sha256)
                result = await client.generate(ALIAS, PROMPT, max_tokens=NEW_TOKENS)
                assert result.prompt_tokens == prompt_tokens
                assert result.tokens == expected

                # the tracker's own model server (--serve-models) answers range requests too
                tracker_url = list(reply.source_urls)[1]
                piece = pieces[1]
                async with httpx.AsyncClient() as http:
                    got = await http.get(tracker_url, headers={"Range": f"bytes={piece.offset}-{piece.end - 1}"})
                assert got.status_code == 206
                with open(path, "rb") as f:
                    f.seek(piece.offset)
                    assert got.content == f.read(piece.size)
            swarm.check_alive()
        finally:
            with trio.CancelScope(shield=True):
                await swarm.aclose()
            nursery.cancel_scope.cancel()
