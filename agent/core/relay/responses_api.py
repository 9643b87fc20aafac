"""OpenAI's Responses API (``/v1/responses``) over the relay's chat completions: a request read
as the chat request it means, and the results written as a Response object or its stream events.

Owns:
- ``chat_body``: a Responses request body as a ``/v1/chat/completions`` body (``input`` text or
  items: messages, ``function_call`` and ``function_call_output`` items; ``instructions`` as a
  system message; ``tools`` and ``tool_choice`` in their flat Responses shape; ``text.format``
  as ``response_format``; ``max_output_tokens``), or a 400 naming the Responses field;
- ``response_object``: the Response for a finished (or, ``status`` "in_progress", a starting)
  generation: a ``message`` item with its ``output_text`` and a ``function_call`` item a call;
- ``event``: one stream event with its ``type`` and ``sequence_number``.

The relay keeps no responses (``store`` is accepted and ignored; ``previous_response_id`` is
refused). Pure: the standard library. Must not import trio, HTTP, sockets, clocks or agent.io.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agent.core.relay.openai_api import ApiError

__all__ = ["chat_body", "event", "response_object"]

_PASSED = ("model", "temperature", "top_p", "top_k", "seed", "stream", "parallel_tool_calls", "user")
_IGNORED = frozenset({"store", "metadata", "include", "truncation", "service_tier", "reasoning", "background"})


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param)


def _text(content: object, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
                raise _bad(f"{param}[{j}]: only text parts are supported, got {kind!r}", param)
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"{param} must be a string or a list of text parts", param)


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("'instructions' must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        return [*messages, {"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise _bad("'input' must be a string or a non-empty list of input items", "input")
    for i, item in enumerate(given):
        param = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise _bad(f"{param} must be an object", param)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"{param}.role must be user, assistant, system or developer, got {role!r}", f"{param}.role")
            messages.append({"role": role, "content": _text(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            call = {"id": str(item.get("call_id", "")), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant message
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                             "content": _text(output, f"{param}.output")})  # fmt: skip
        else:
            raise _bad(f"{param}.type {kind!r} is not supported (message, function_call, function_call_output)",
                       f"{param}.type")  # fmt: skip
    return messages


def _tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list of tools", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, Mapping) else None
            raise _bad(f"tools[{i}].type must be 'function' (built-in tools are not served), got {kind!r}",
                       f"tools[{i}].type")  # fmt: skip
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(value: object) -> object:
    if isinstance(value, Mapping) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    return value


def _response_format(text: object) -> object:
    if text is None:
        return None
    if not isinstance(text, Mapping):
        raise _bad("'text' must be an object", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping):
        raise _bad("'text.format' must be an object", "text.format")
    if fmt.get("type") == "json_schema":
        spec = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return dict(fmt)


def chat_body(body: object) -> dict[str, Any]:
    """The chat completions body a Responses request means.

    Raises:
      ApiError: 400 naming the Responses field that is wrong or not served.
    """
    if not isinstance(body, Mapping):
        raise _bad("the request body must be a JSON object", "")
    if body.get("previous_response_id") is not None:
        raise _bad("this relay keeps no responses: send the whole conversation in 'input'", "previous_response_id")
    known = {*_PASSED, *_IGNORED, "input", "instructions", "tools", "tool_choice", "text", "max_output_tokens"}
    for name in body:
        if name not in known:
            raise _bad(f"'{name}' is not supported by this relay's Responses API", name)
    chat: dict[str, Any] = {name: body[name] for name in _PASSED if name in body}
    chat["messages"] = _messages(body)
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    tools = _tools(body)
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None and tools:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    return chat


def response_object(
    *,
    id_: str,
    created_at: int,
    request: Mapping[str, Any],
    status: str,
    text: str | None = None,
    message_id: str = "",
    calls: Sequence[Mapping[str, Any]] = (),
    usage: tuple[int, int] | None = None,
    incomplete: bool = False,
) -> dict[str, Any]:
    """The Response object: ``text`` (None: no message item) in a ``message`` item, each of
    ``calls`` (``{"id", "call_id", "name", "arguments"}``) a ``function_call`` item;
    ``usage``: (input, output) tokens; ``incomplete``: the token budget ran out."""
    output: list[dict[str, Any]] = []
    if text is not None:
        output.append({"type": "message", "id": message_id, "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": text, "annotations": []}]})  # fmt: skip
    for call in calls:
        output.append({"type": "function_call", "id": call["id"], "call_id": call["call_id"], "name": call["name"],
                       "arguments": call["arguments"], "status": "completed"})  # fmt: skip
    text_format = request.get("text", {}).get("format") if isinstance(request.get("text"), Mapping) else None
    return {
        "id": id_,
        "object": "response",
        "created_at": created_at,
        "status": "incomplete" if incomplete and status == "completed" else status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete and status == "completed" else None,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "model": request.get("model"),
        "output": output,
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "temperature": request.get("temperature", 1.0),
        "top_p": request.get("top_p", 1.0),
        "tool_choice": request.get("tool_choice", "auto"),
        "tools": list(request.get("tools") or []),
        "text": {"format": text_format or {"type": "text"}},
        "metadata": {},
        "store": False,
        "usage": None if usage is None else {
            "input_tokens": usage[0], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage[1], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage[0] + usage[1],
        },
    }  # fmt: skip


def event(kind: str, sequence_number: int, **fields: Any) -> dict[str, Any]:
    """One stream event (``response.output_text.delta`` and the rest)."""
    return {"type": kind, "sequence_number": sequence_number, **fields}
