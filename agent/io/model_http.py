"""An HTTP server of model files with range requests (``baton tracker serve --serve-models``).

Owns: a Starlette app that serves each registered GGUF at ``/models/<sha256>.gguf`` (GET and
HEAD, ``Accept-Ranges: bytes``, one byte range per request answered 206 with
``Content-Range``, 416 for an unsatisfiable range, 404 for anything else), read in chunks in
a thread, and counters of the bytes it sent (``ModelFileServer.sent_bytes``, per file:
tests check exactly what a node fetched). Its state is bounded: one counter per served file.
Tests that need more (every request's Range header, a connection cut after N bytes) use
``agent.testing.model_http``'s subclass, through the two seams ``requested`` and
``next_chunk_bytes``. Run on Hypercorn's trio worker, in the caller's trio loop, as the relay
runs (``agent.io.http_serve``). Range parsing is the core's
(``agent.core.node.range_fetch.parse_range_header``).

Bounded for anyone who can reach it: at most ``max_responses`` bodies in flight (more are
answered 503 with Retry-After at once, before any file is opened), and a client that stops
reading for ``send_timeout_s`` loses its connection (``agent.io.http_serve``), so clients that
never read cannot hold file descriptors and buffers for ever.

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
from agent.io.http_serve import serve_asgi

__all__ = ["ModelFileServer", "serve_model_files"]

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
#: bodies sent at once; a node fetches its range with a few requests, so this serves dozens
DEFAULT_MAX_RESPONSES = 64
#: a client that takes no bytes for this long is dropped (a fetch resumes where it stopped)
DEFAULT_SEND_TIMEOUT_S = 30.0


class ModelFileServer:
    """The served files (``url name -> path``) and what was sent of each."""

    def __init__(
        self,
        files: Mapping[str, str | os.PathLike[str]],
        *,
        max_responses: int = DEFAULT_MAX_RESPONSES,
        send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
    ) -> None:
        self.files = {name: Path(path) for name, path in files.items()}
        self.sent_bytes: dict[str, int] = {name: 0 for name in self.files}
        self.max_responses = max_responses
        self.send_timeout_s = send_timeout_s
        self.responses_in_flight = 0
        self.refused_busy = 0

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
        from starlette.responses import PlainTextResponse, Response
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
            return _FileBody(self, name, path, start, end, status, headers)

        return self._bounded(Starlette(routes=[Route("/models/{name}", model_file, methods=["GET", "HEAD"])]))

    def _bounded(self, app):
        """``app`` (ASGI) with the server's bounds: ``max_responses`` and ``send_timeout_s``."""

        async def bounded(scope, receive, send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            if self.responses_in_flight >= self.max_responses:
                self.refused_busy += 1
                headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"retry-after", b"1")]
                await send({"type": "http.response.start", "status": 503, "headers": headers})
                await send({"type": "http.response.body", "body": b"too many downloads at once; retry\n"})
                return

            self.responses_in_flight += 1
            try:
                await app(scope, receive, send)
            finally:
                self.responses_in_flight -= 1

        return bounded


class _FileBody:
    """An ASGI response of bytes ``[start, end)`` of ``path``, read in chunks in a thread. The
    file is closed, and reading stops, as soon as the response ends, the client going away
    included (a generator left to the garbage collector would hold the file until then)."""

    def __init__(
        self, server: ModelFileServer, name: str, path: Path, start: int, end: int, status: int, headers: dict[str, str]
    ) -> None:
        self.server, self.name, self.path = server, name, path
        self.start, self.end, self.status, self.headers = start, end, status, headers

    async def __call__(self, scope, receive, send) -> None:
        headers = [(k.lower().encode(), v.encode()) for k, v in self.headers.items()]
        headers.append((b"content-type", b"application/octet-stream"))
        async with trio.open_nursery() as nursery:

            async def until_disconnect() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                nursery.cancel_scope.cancel()

            nursery.start_soon(until_disconnect)
            await send({"type": "http.response.start", "status": self.status, "headers": headers})
            await self._send_body(send)
            nursery.cancel_scope.cancel()

    async def _send_body(self, send) -> None:
        f = await trio.to_thread.run_sync(open, self.path, "rb")
        try:
            offset = self.start
            while offset < self.end:
                n = self.server.next_chunk_bytes(self.name, min(CHUNK_BYTES, self.end - offset))
                if n <= 0:
                    raise ConnectionAbortedError("the response was cut")
                chunk = await trio.to_thread.run_sync(os.pread, f.fileno(), n, offset)
                if not chunk:
                    raise ConnectionAbortedError(f"{self.path} ended at byte {offset}, before {self.end}")
                offset += len(chunk)
                self.server.sent_bytes[self.name] += len(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": offset < self.end})
            if self.start == self.end:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
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
    await serve_asgi(
        server.app(), host, port, send_timeout_s=server.send_timeout_s, graceful_timeout_s=0.5, task_status=task_status
    )
