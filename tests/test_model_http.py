"""The model file server's bounds against clients that never read (agent.io.model_http): at most
``max_responses`` bodies in flight, more answered 503 at once, and a client that reads nothing
for ``send_timeout_s`` loses its connection; the server serves on meanwhile."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio

from agent.io.model_http import ModelFileServer, serve_model_files

pytestmark = [pytest.mark.worker, pytest.mark.timeout(60)]

FILE_BYTES = 64 << 20  # far more than a socket's buffers hold


async def _stalled_get(host: str, port: int, name: str) -> tuple[trio.SocketStream, bytes]:
    """A GET whose body is never read: the status line and what the first read gives."""
    stream = await trio.open_tcp_stream(host, port)
    await stream.send_all(f"GET /models/{name} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
    return stream, await stream.receive_some(4096)


async def test_clients_that_never_read_are_bounded_then_dropped_and_others_are_served(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    with path.open("wb") as f:
        f.truncate(FILE_BYTES)  # sparse
    server = ModelFileServer({"m.gguf": path}, max_responses=4, send_timeout_s=1.0)
    async with trio.open_nursery() as nursery:
        base = await nursery.start(serve_model_files, server, "127.0.0.1", 0)
        host, port = base.removeprefix("http://").rsplit(":", 1)
        stalled = []
        for _ in range(4):
            stalled.append(await _stalled_get(host, int(port), "m.gguf"))
        assert all(first.startswith(b"HTTP/1.1 200") for _, first in stalled)
        # the fifth is refused at once, and says when to retry
        busy, first = await _stalled_get(host, int(port), "m.gguf")
        assert first.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in first.lower(), first
        await busy.aclose()
        assert server.responses_in_flight == 4 and server.refused_busy == 1
        # the stalled ones are dropped after a second without reading: their connections end
        with trio.fail_after(20):
            while server.responses_in_flight:
                await trio.sleep(0.05)
            for stream, _ in stalled:
                received = 0
                with pytest.raises(trio.BrokenResourceError):  # reset by the server's kernel
                    while chunk := await stream.receive_some(1 << 20):
                        received += len(chunk)  # what was already in flight
                assert received < FILE_BYTES // 2, received
                await stream.aclose()
        # and a client that reads gets its range
        async with httpx.AsyncClient() as http:
            reply = await http.get(f"{base}/models/m.gguf", headers={"range": "bytes=0-1023"})
        assert reply.status_code == 206 and reply.content == b"\0" * 1024
        nursery.cancel_scope.cancel()


@pytest.mark.timeout(120)
async def test_ten_thousand_junk_requests_leave_the_servers_memory_flat(tmp_path: Path) -> None:
    import psutil

    path = tmp_path / "model.gguf"
    with path.open("wb") as f:
        f.truncate(1 << 20)
    server = ModelFileServer({"m.gguf": path})
    process = psutil.Process()

    def request(i: int) -> bytes:
        # distinct, long Range headers (a server that kept them would grow), good and bad, and
        # names that are not served
        if i % 4:
            return f"HEAD /models/m.gguf HTTP/1.1\r\nhost: x\r\nrange: bytes={i}-{i + 10}{',' * 3000}\r\n\r\n".encode()
        return f"HEAD /models/nothing-{i} HTTP/1.1\r\nhost: x\r\n\r\n".encode()

    async with trio.open_nursery() as nursery:
        base = await nursery.start(serve_model_files, server, "127.0.0.1", 0)
        host, port = base.removeprefix("http://").rsplit(":", 1)

        async def junk(first: int, count: int, batch: int = 50) -> None:
            # pipelined, a batch at a time on one connection: the client's cost stays small
            statuses: list[bytes] = []
            async with await trio.open_tcp_stream(host, int(port)) as stream:
                for start in range(first, first + count, batch):
                    await stream.send_all(b"".join(request(i) for i in range(start, start + batch)))
                    answered = b""
                    while answered.count(b"HTTP/1.1 ") < batch or not answered.endswith(b"\r\n\r\n"):
                        chunk = await stream.receive_some(1 << 16)
                        assert chunk, answered[-200:]
                        answered += chunk
                    statuses += [line.split()[1] for line in answered.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]
            assert set(statuses) <= {b"206", b"404", b"416"} and len(statuses) == count

        await junk(0, 1000)  # warm up: allocator pools, imports
        before = process.memory_info().rss
        async with trio.open_nursery() as clients:
            for first in range(1000, 11_000, 1000):  # (Hypercorn serves 1,000 requests a connection)
                clients.start_soon(junk, first, 1000)
        grown_mb = (process.memory_info().rss - before) / 2**20
        nursery.cancel_scope.cancel()
    assert grown_mb < 16, f"RSS grew {grown_mb:.1f} MB over 10,000 junk requests"
