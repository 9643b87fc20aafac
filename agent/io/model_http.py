"""An HTTP server of model files with range requests (``baton tracker serve --serve-models``).

Owns: a Starlette app that serves each registered GGUF at ``/models/<sha256>.gguf`` (GET and
HEAD, ``Accept-Ranges: bytes``, one byte range per request answered 206 with
``Content-Range``, 416 for an unsatisfiable range, 404 for anything else), read in chunks in
a thread, and counters of the bytes it sent (``ModelFileServer.sent_bytes``, per file:
tests check exactly what a node fetched). Its state is bounded: one counter per served file.
Tests that need more (every request's Range header, a connection cut after N bytes) use
``agent.testing.model_http``'s subclass, through the two seams ``requested`` and
``next_chunk_bytes``. Run on Hypercorn's trio worker, in the caller's trio loop, as the relay
runs (agent/io/relay/server.py). Range parsing is the core's
(``agent.core.node.range_fetch.parse_range_header``).

Nothing listens publicly unless told: the bind address is the caller's (the CLI defaults it
to 127.0.0.1). Every byte a node receives is checked against the tracker-signed manifest, so
this server (like any mirror) need not be trusted.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

import trio

from agent.core.node.range_fetch import parse_range_header

__all__ = ["ModelFileServer", "serve_model_files"]

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20


class ModelFileServer:
    """The served files (``url name -> path``) and what was sent of each."""

    def __init__(self, files: Mapping[str, str | os.PathLike[str]]) -> None:
        self.files = {name: Path(path) for name, path in files.items()}
        self.sent_bytes: dict[str, int] = {name: 0 for name in self.files}

    def url(self, base_url: str, name: str) -> str:
        return f"{base_url.rstrip('/')}/models/{name}"

    def requested(self, name: str, range_header: str | None) -> None:
        """A GET or HEAD of served file ``name`` arrived (a seam for subclasses; nothing here)."""

    def next_chunk_bytes(self, name: str, wanted: int) -> int:
        """How many of the next ``wanted`` body bytes of ``name`` to send: all of them. A seam
        for subclasses: fewer than one ends the response as a cut connection."""
        return wanted

    def app(self):
        from starlette.applications import Starlette
        from starlette.responses import PlainTextResponse, Response, StreamingResponse
        from starlette.routing import Route

        async def model_file(request):
            name = request.path_params["name"]
            path = self.files.get(name)
            if path is None:
                return PlainTextResponse("not found\n", status_code=404)
            try:
                size = path.stat().st_size
            except OSError:
                return PlainTextResponse("not found\n", status_code=404)
            header = request.headers.get("range")
            self.requested(name, header)
            try:
                byte_range = parse_range_header(header, size)
            except ValueError as error:
                return PlainTextResponse(f"{error}\n", status_code=416, headers={"Content-Range": f"bytes */{size}"})
            start, end = byte_range if byte_range is not None else (0, size)
            headers = {"Accept-Ranges": "bytes", "Content-Length": str(end - start)}
            status = 200
            if byte_range is not None:
                status = 206
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
            if request.method == "HEAD":
                return Response(status_code=status, headers=headers, media_type="application/octet-stream")
            return StreamingResponse(
                self._body(name, path, start, end), status_code=status, headers=headers,
                media_type="application/octet-stream",
            )  # fmt: skip

        return Starlette(routes=[Route("/models/{name}", model_file, methods=["GET", "HEAD"])])

    async def _body(self, name: str, path: Path, start: int, end: int):
        f = await trio.to_thread.run_sync(open, path, "rb")
        try:
            offset = start
            while offset < end:
                n = self.next_chunk_bytes(name, min(CHUNK_BYTES, end - offset))
                if n <= 0:
                    raise ConnectionAbortedError("the response was cut")
                chunk = await trio.to_thread.run_sync(os.pread, f.fileno(), n, offset)
                if not chunk:
                    return
                offset += len(chunk)
                self.sent_bytes[name] += len(chunk)
                yield chunk
        finally:
            f.close()


async def serve_model_files(
    server: ModelFileServer,
    host: str,
    port: int,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,  # type: ignore[name-defined]  # trio-typing's stale trio stubs
) -> None:
    """Serve ``server``'s files over HTTP at ``host:port`` until cancelled; started with the
    base URL (``http://host:port``, the real port when ``port`` is 0).

    Resource handling: the listening socket is closed when this returns.
    Cancellation: cancel the enclosing scope to stop serving (open responses are dropped).
    """
    from hypercorn.config import Config as HypercornConfig
    from hypercorn.trio import serve

    hyper = HypercornConfig()
    hyper.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    hyper.accesslog = None
    hyper.errorlog = logging.getLogger("hypercorn.error")
    hyper.graceful_timeout = 0.5
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(lambda task_status: serve(server.app(), hyper, task_status=task_status))
        task_status.started(binds[0])
