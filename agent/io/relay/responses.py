"""The relay's ASGI responses: OpenAI's error envelope (``error_response``, with
``retry-after``), and ``CompletionResponse``, which runs a completion while it watches for
the client going away (then cancels it) and sends it as JSON or server-sent events.

Must not import the relay's app or server.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable

import trio
from starlette.responses import JSONResponse

from agent.core.relay.openai_api import ApiError

from .choices import Choices

__all__ = ["ClientWatch", "CompletionResponse", "error_response"]

log = logging.getLogger(__name__)


def error_response(error: ApiError) -> JSONResponse:
    headers = {}
    if error.retry_after_s is not None:
        headers["retry-after"] = str(max(1, math.ceil(error.retry_after_s)))
    return JSONResponse(error.envelope(), status_code=error.status, headers=headers)


def _sse(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


class ClientWatch:
    """Whether an HTTP client went away while its answer was made (``gone``): ``watch`` reads
    the ASGI receive channel until ``http.disconnect``, then cancels ``scope`` (the generation),
    so that its session ends and it is charged what it was sent."""

    def __init__(self) -> None:
        self.gone = False

    async def watch(self, receive: Callable, scope: trio.CancelScope) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.gone = True
                scope.cancel()
                return


class CompletionResponse:
    """Runs a completion while it watches for the client going away (then cancels it).

    Streaming: headers go out with the first event, so an error before any text still gets its
    status and envelope; an error after that is one ``data: {"error": ...}`` event.
    """

    def __init__(self, completion: Choices, endpoint: str, release: Callable[[bool], None]) -> None:
        self.completion = completion
        self.endpoint = endpoint
        self.release = release
        self.status = 200

    async def __call__(self, scope, receive, send) -> None:
        completion = self.completion
        metrics = completion.state.metrics
        started = False
        client = ClientWatch()
        done = False

        async def start(status: int, content_type: bytes, extra: list | None = None) -> None:
            nonlocal started
            started = True
            self.status = status
            headers = [(b"content-type", content_type), (b"cache-control", b"no-cache")] + (extra or [])
            await send({"type": "http.response.start", "status": status, "headers": headers})

        async def body(data: bytes, more: bool) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": more})

        async def emit(text: str, index: int = 0) -> None:
            if not started:
                await start(200, b"text/event-stream; charset=utf-8", [(b"x-accel-buffering", b"no")])
                await body(b"".join(_sse(chunk) for chunk in completion.opening_chunks()), True)
            await body(_sse(completion.chunk(text, index)), True)

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.watch, receive, nursery.cancel_scope)
                try:
                    await completion.run(emit if completion.req.stream else None)
                except ApiError as error:
                    done = True
                    metrics.observe_request(self.endpoint, error.status)
                    if not started:
                        response = error_response(error)
                        self.status = error.status
                        await response(scope, receive, send)
                    else:
                        await body(_sse(error.envelope()), False)
                    nursery.cancel_scope.cancel()
                    return
                # the generation is done: the client may go away while the last bytes are sent
                done = True
                metrics.observe_request(self.endpoint, 200)
                if completion.req.stream:
                    if not started:
                        await emit("")
                    await body(b"".join(_sse(chunk) for chunk in completion.closing_chunks()), True)
                    if completion.req.include_usage:
                        await body(_sse(completion.usage_chunk()), True)
                    await body(_sse("[DONE]"), False)
                else:
                    payload = json.dumps(completion.response(), ensure_ascii=False).encode()
                    await start(200, b"application/json")
                    await body(payload, False)
                nursery.cancel_scope.cancel()
        finally:
            # charged however it ended: a client that went away pays for what it was sent
            self.release(client.gone and not done)
            if client.gone and not done:
                log.info("%s: the client went away; its session was ended", completion.id)
                metrics.observe_request(self.endpoint, 499)
