"""``/v1/responses``' ASGI response: a chat completion (``agent.io.relay.completion``) run while
the client is watched (gone: cancelled), sent as a Response object or as the Responses API's
stream events (``agent.core.relay.responses_api``).

Must not import the relay's app or server.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable, Mapping
from typing import Any

import trio

from agent.core.relay.openai_api import ApiError
from agent.core.relay.responses_api import event, response_object

from .completion import Completion
from .responses import ClientWatch, error_response

__all__ = ["ResponsesResponse"]

log = logging.getLogger(__name__)


def _sse(data: dict[str, Any]) -> bytes:
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


class ResponsesResponse:
    """Runs ``completion`` for the Responses request ``request`` (its body, for the echoed
    fields) and answers as the Responses API does. Errors before the first event get their
    status and envelope; after it, one ``error`` event."""

    def __init__(self, completion: Completion, request: Mapping[str, Any], release: Callable[[bool], None]) -> None:
        self.completion = completion
        self.request = request
        self.release = release
        self.status = 200
        self.id = f"resp_{secrets.token_hex(12)}"
        self.message_id = f"msg_{secrets.token_hex(12)}"
        self._sequence = 0

    def _response(self, status: str, *, final: bool) -> dict[str, Any]:
        completion = self.completion
        if not final:
            return response_object(id_=self.id, created_at=completion.created, request=self.request, status=status)
        calls = [
            {"id": f"fc_{secrets.token_hex(12)}", "call_id": call["id"], "name": call["function"]["name"],
             "arguments": call["function"]["arguments"]}
            for call in completion.tool_calls
        ]  # fmt: skip
        text = completion.content if completion.tool_calls else completion.text.text
        return response_object(
            id_=self.id, created_at=completion.created, request=self.request, status=status, text=text,
            message_id=self.message_id, calls=calls, usage=(len(completion.prompt.tokens), completion.completion_tokens),
            incomplete=completion.finish_reason == "length",
        )  # fmt: skip

    def _event(self, kind: str, **fields: Any) -> bytes:
        self._sequence += 1
        return _sse(event(kind, self._sequence - 1, **fields))

    async def __call__(self, scope, receive, send) -> None:
        completion = self.completion
        metrics = completion.state.metrics
        started = message_open = done = False
        client = ClientWatch()
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}

        async def body(data: bytes, more: bool = True) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": more})

        async def start() -> None:
            nonlocal started
            started = True
            headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                       (b"x-accel-buffering", b"no")]  # fmt: skip
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await body(self._event("response.created", response=self._response("in_progress", final=False)))

        async def open_message() -> None:
            nonlocal message_open
            message_open = True
            item = {
                "type": "message",
                "id": self.message_id,
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            await body(self._event("response.output_item.added", output_index=0, item=item))
            part = {"type": "output_text", "text": "", "annotations": []}
            await body(self._event("response.content_part.added", part=part, **where))

        async def emit(text: str) -> None:
            if not started:
                await start()
            if text:
                if not message_open:
                    await open_message()
                await body(self._event("response.output_text.delta", delta=text, **where))

        async def finish_stream() -> None:
            if not started:
                await start()
            final = self._response("completed", final=True)
            for index, item in enumerate(final["output"]):
                if item["type"] == "message":
                    if not message_open:
                        await open_message()
                    text = item["content"][0]["text"]
                    await body(self._event("response.output_text.done", text=text, **where))
                    await body(self._event("response.content_part.done", part=item["content"][0], **where))
                else:
                    await body(self._event("response.output_item.added", output_index=index,
                                           item={**item, "arguments": "", "status": "in_progress"}))  # fmt: skip
                    await body(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                           output_index=index, delta=item["arguments"]))  # fmt: skip
                    await body(self._event("response.function_call_arguments.done", item_id=item["id"],
                                           output_index=index, arguments=item["arguments"]))  # fmt: skip
                await body(self._event("response.output_item.done", output_index=index, item=item))
            kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
            await body(self._event(kind, response=final), more=False)

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.watch, receive, nursery.cancel_scope)
                streaming = bool(self.request.get("stream"))
                try:
                    await completion.run(emit if streaming else None)
                except ApiError as error:
                    done = True
                    metrics.observe_request("/v1/responses", error.status)
                    if not started:
                        self.status = error.status
                        await error_response(error)(scope, receive, send)
                    else:
                        failure = {"type": "error", "sequence_number": self._sequence, "code": error.code,
                                   "message": error.message, "param": error.param}  # fmt: skip
                        await body(_sse(failure), more=False)
                    nursery.cancel_scope.cancel()
                    return
                done = True
                metrics.observe_request("/v1/responses", 200)
                if streaming:
                    await finish_stream()
                else:
                    payload = json.dumps(self._response("completed", final=True), ensure_ascii=False).encode()
                    headers = [(b"content-type", b"application/json")]
                    await send({"type": "http.response.start", "status": 200, "headers": headers})
                    await body(payload, more=False)
                nursery.cancel_scope.cancel()
        finally:
            self.release(client.gone and not done)
            if client.gone and not done:
                log.info("%s: the client went away; its session was ended", self.id)
                metrics.observe_request("/v1/responses", 499)
