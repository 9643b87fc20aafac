"""Tools and structured output of a chat request: ``tools``, ``tool_choice``,
``parallel_tool_calls`` and ``response_format`` checked (a 400 naming the field otherwise), and
what they ask of the generation: the grammar it keeps to, if any, and whether its text is read
back as tool calls.

Owns:
- ``parse_output``: the request's fields as an ``OutputSpec`` (schemas compiled once here, so
  a schema the engine refuses is a 400 before any model is asked);
- ``OutputSpec.grammar(fmt)``: llguidance's grammar for the request in a template's tool-call
  format (``agent.core.owner.tool_calls``): a JSON schema (``json_schema``, ``json_object``), a
  forced call (``tool_choice`` ``required`` or a named function), or None (free text);
- ``template_messages``: assistant ``tool_calls`` with their arguments as objects, as
  transformers' chat templates read them (OpenAI sends them as JSON text);
- ``tool_call_records``: parsed calls as OpenAI's ``tool_calls`` (ids passed in).

Pure: json and the grammar compiler. Must not import trio, HTTP, sockets, clocks or agent.io.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from agent.core.owner.grammar import GrammarError, compile_json_schema, compile_lark
from agent.core.owner.tool_calls import ParsedCall, call_schema, forced_call_lark

__all__ = [
    "OutputSpec",
    "StructuredError",
    "parse_output",
    "template_messages",
    "tool_call_records",
]

_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class StructuredError(ValueError):
    """A field of the request is wrong: ``param`` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclasses.dataclass(frozen=True)
class OutputSpec:
    """What a chat request asks of its output beyond free text.

    ``tools``: the OpenAI tool records offered (empty: none); ``tool_choice``: ``auto``,
    ``none``, ``required`` or a function's name (``forced_name``); ``schema``: the JSON schema
    the answer must match (``json_object``: any object), None for free text.
    """

    tools: tuple[Mapping[str, Any], ...] = ()
    tool_choice: str = "auto"
    forced_name: str | None = None
    parallel_tool_calls: bool = True
    schema: Mapping[str, Any] | None = None

    @property
    def tool_names(self) -> list[str]:
        return [str(tool["function"]["name"]) for tool in self.tools]

    @property
    def parses_calls(self) -> bool:
        """The generated text is read back as tool calls (tools offered, ``tool_choice`` not none)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forces_call(self) -> bool:
        return bool(self.tools) and self.tool_choice in ("required", "function")

    def grammar(self, fmt: str) -> str | None:
        """llguidance's grammar text for this request in tool-call format ``fmt``, or None.

        Raises:
          StructuredError: the grammar does not compile (``tools``' parameters schemas).
        """
        if self.forces_call:
            schema = call_schema(self.tools, fmt, self.forced_name)
            try:
                return compile_lark(forced_call_lark(schema, fmt, parallel=self.parallel_tool_calls))
            except GrammarError as error:
                raise StructuredError(f"the tools' parameters cannot be enforced: {error}", "tools") from None
        if self.schema is not None:
            return compile_json_schema(self.schema)
        return None


def _tools(value: object) -> tuple[Mapping[str, Any], ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise StructuredError("'tools' must be a list of tools", "tools")
    names: set[str] = set()
    tools = []
    for i, tool in enumerate(value):
        param = f"tools[{i}]"
        if (
            not isinstance(tool, Mapping)
            or tool.get("type") != "function"
            or not isinstance(tool.get("function"), Mapping)
        ):
            raise StructuredError(f"{param} must be {{'type': 'function', 'function': {{...}}}}", param)
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
            raise StructuredError(f"{param}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
                                  f"{param}.function.name")  # fmt: skip
        if name in names:
            raise StructuredError(f"{param}.function.name {name!r} is offered twice", f"{param}.function.name")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, Mapping):
                raise StructuredError(f"{param}.function.parameters must be a JSON schema object",
                                      f"{param}.function.parameters")  # fmt: skip
            try:
                compile_json_schema(parameters)
            except GrammarError as error:
                raise StructuredError(f"{param}.function.parameters is not a schema the grammar engine can "
                                      f"enforce: {error}", f"{param}.function.parameters") from None  # fmt: skip
        tools.append(
            {"type": "function", "function": {key: function[key] for key in ("name", "description", "parameters",
                                                                            "strict") if key in function}}
        )  # fmt: skip
    return tuple(tools)


def _tool_choice(value: object, tools: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    if value is None:
        return ("auto", None)
    if not tools:
        raise StructuredError("'tool_choice' is only allowed when 'tools' are given", "tool_choice")
    if value in ("auto", "none", "required"):
        return (str(value), None)
    if isinstance(value, Mapping) and value.get("type") == "function" and isinstance(value.get("function"), Mapping):
        name = value["function"].get("name")
        known = [tool["function"]["name"] for tool in tools]
        if name not in known:
            raise StructuredError(f"'tool_choice' names the function {name!r}, which is not among the tools "
                                  f"({', '.join(known)})", "tool_choice")  # fmt: skip
        return ("function", str(name))
    raise StructuredError("'tool_choice' must be 'auto', 'none', 'required' or "
                          "{'type': 'function', 'function': {'name': ...}}", "tool_choice")  # fmt: skip


def _response_format(value: object) -> Mapping[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise StructuredError("'response_format' must be an object", "response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise StructuredError(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                              "response_format.type")  # fmt: skip
    spec = value.get("json_schema")
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
        raise StructuredError("'response_format.json_schema' must be an object with a 'name' and a 'schema'",
                              "response_format.json_schema")  # fmt: skip
    schema = spec.get("schema", {})
    if not isinstance(schema, Mapping):
        raise StructuredError("'response_format.json_schema.schema' must be a JSON schema object",
                              "response_format.json_schema.schema")  # fmt: skip
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise StructuredError("'response_format.json_schema.strict' must be a boolean",
                              "response_format.json_schema.strict")  # fmt: skip
    try:
        compile_json_schema(schema)
    except GrammarError as error:
        raise StructuredError(f"'response_format.json_schema.schema' cannot be enforced by the grammar engine: "
                              f"{error}", "response_format.json_schema.schema") from None  # fmt: skip
    return schema


def parse_output(body: Mapping[str, Any]) -> OutputSpec | None:
    """The tools and structured output a chat request asks for, or None for plain text.

    Raises:
      StructuredError: a field is wrong (``param`` names it), a schema does not compile, or
        ``tool_choice`` names a function the tools do not offer.
    """
    tools = _tools(body.get("tools"))
    tool_choice, forced_name = _tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise StructuredError(f"'parallel_tool_calls' must be a boolean, got {parallel!r}", "parallel_tool_calls")
    schema = _response_format(body.get("response_format"))
    if not tools and schema is None:
        return None
    return OutputSpec(tools, tool_choice, forced_name, parallel, schema)


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates read them: an assistant's ``tool_calls`` with arguments as
    objects (transformers' templates write ``arguments | tojson``; OpenAI sends JSON text)."""
    out = []
    for message in messages:
        entry = dict(message)
        calls = entry.get("tool_calls")
        if isinstance(calls, list):
            converted = []
            for call in calls:
                call = dict(call)
                function = dict(call.get("function") or {})
                if isinstance(function.get("arguments"), str):
                    with contextlib.suppress(json.JSONDecodeError):  # else kept as the client wrote it
                        function["arguments"] = json.loads(function["arguments"])
                call["function"] = function
                converted.append(call)
            entry["tool_calls"] = converted
        out.append(entry)
    return out


def tool_call_records(calls: Sequence[ParsedCall], ids: Sequence[str]) -> list[dict[str, Any]]:
    """OpenAI's ``message.tool_calls`` for ``calls``, with ``ids``."""
    return [
        {"id": id_, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        for call, id_ in zip(calls, ids, strict=True)
    ]
