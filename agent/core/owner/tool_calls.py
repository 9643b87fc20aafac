"""Tool calls in a model's own format: which format a chat template speaks, the grammar that
forces a call in it, and the calls parsed back out of generated text.

Owns:
- ``tool_call_format``: the format a template's text shows it was written for: ``hermes``
  (Qwen2.5, Hermes: ``<tool_call>{json}</tool_call>``), ``llama3`` (a JSON object with
  ``name`` and ``parameters``, after an optional ``<|python_tag|>``), ``mistral``
  (``[TOOL_CALLS][{...}, ...]``), ``mistral_args`` (newer Mistral templates:
  ``[TOOL_CALLS]name[ARGS]{...}`` a call), else ``generic`` (a JSON object ``{"name", "arguments"}``
  or a list of them);
- ``call_schema`` / ``forced_call_lark``: the JSON schema of one call to any of the offered
  functions (or one named function), and the Lark grammar that makes a model write one call
  (or several, ``parallel``) in its format: ``tool_choice`` ``required`` and a named function
  are enforced by constrained decoding (``agent.core.owner.grammar``);
- ``parse_tool_calls``: the text before the calls and the calls (name, arguments as JSON
  text) from a finished generation; ``call_start``: where a call may begin in a stream (text
  before it can be sent at once).

JSON is read with the standard library's decoder. Pure: json and re only. Must not import
trio, sockets, clocks or agent.io.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from agent.core.owner.grammar import close_objects, json_schema_lark

__all__ = [
    "FORMATS",
    "ParsedCall",
    "call_schema",
    "call_start",
    "forced_call_lark",
    "parse_tool_calls",
    "tool_call_format",
]

FORMATS = ("hermes", "llama3", "mistral", "mistral_args", "generic")

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_MISTRAL_MARK = "[TOOL_CALLS]"
_MISTRAL_ARGS = "[ARGS]"
_MISTRAL_CALL_ID = "[CALL_ID]"
_PYTHON_TAG = "<|python_tag|>"


@dataclasses.dataclass(frozen=True)
class ParsedCall:
    """One call: the function's ``name`` and its ``arguments`` as JSON text (OpenAI's shape)."""

    name: str
    arguments: str


def tool_call_format(template_source: str) -> str:
    """The tool-call format a chat template's source was written for (one of ``FORMATS``)."""
    if _HERMES_OPEN in template_source:
        return "hermes"
    if _MISTRAL_MARK in template_source:
        return "mistral_args" if _MISTRAL_ARGS in template_source else "mistral"
    if _PYTHON_TAG in template_source or ("ipython" in template_source and "parameters" in template_source):
        return "llama3"
    return "generic"


def _arguments_key(fmt: str) -> str:
    return "parameters" if fmt == "llama3" else "arguments"


def _function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    function = tool.get("function")
    return function if isinstance(function, Mapping) else {}


def call_schema(tools: Sequence[Mapping[str, Any]], fmt: str, name: str | None = None) -> dict[str, Any]:
    """The JSON schema of one call in ``fmt``: to the function ``name``, or to any of ``tools``
    (OpenAI tool records, ``{"type": "function", "function": {"name", "parameters"}}``).

    Raises:
      ValueError: ``name`` is not one of ``tools``' functions, or no tool is offered.
    """
    key = _arguments_key(fmt)
    chosen = [tool for tool in tools if name is None or _function(tool).get("name") == name]
    options = []
    for index, tool in enumerate(chosen):
        function = _function(tool)
        parameters = function.get("parameters")
        if not isinstance(parameters, Mapping) or not parameters:
            parameters = {"type": "object", "properties": {}}
        if fmt != "mistral_args":  # (there each call's arguments are a grammar's root of their own)
            # the parameters' references ("#/$defs/X", pydantic's nested models) point into
            # the parameters, which now sit below the call's root
            parameters = _rebase_refs(parameters, f"/anyOf/{index}" * (len(chosen) > 1) + f"/properties/{key}")
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": function.get("name")}, key: close_objects(parameters)},
                "required": ["name", key],
                "additionalProperties": False,
            }
        )
    if not options:
        raise ValueError(f"no function named {name!r} among the tools" if name else "no tools are offered")
    return options[0] if len(options) == 1 else {"anyOf": options}


def _rebase_refs(schema: Any, prefix: str) -> Any:
    """``schema`` with its local references (``#/...``) moved below the JSON pointer ``prefix``."""
    if isinstance(schema, list):
        return [_rebase_refs(item, prefix) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {key: _rebase_refs(value, prefix) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = "#" + prefix + ref[1:]
    return out


def forced_call_lark(schema: Mapping[str, Any], fmt: str, *, parallel: bool) -> str:
    """A Lark grammar that makes a model write one call (several where ``parallel``) matching
    ``schema`` (``call_schema``) in ``fmt``, and nothing else."""
    if fmt == "mistral_args":  # the name before the arguments: one alternative per function
        options = schema.get("anyOf", [schema])
        names = [f"c{i}" for i in range(len(options))]
        rules = "".join(
            f'{rule}: "{_MISTRAL_MARK}{option["properties"]["name"]["const"]}{_MISTRAL_ARGS}" '
            f"{json_schema_lark(option['properties']['arguments'])}\n"
            for rule, option in zip(names, options, strict=True)
        )
        more = "+" if parallel else ""
        return f"start: ({' | '.join(names)}){more}\n{rules}"
    call = json_schema_lark(schema)
    if fmt == "hermes":
        more = ' ("\\n" call)*' if parallel else ""
        return f'start: call{more}\ncall: "{_HERMES_OPEN}\\n" obj "\\n{_HERMES_CLOSE}"\nobj: {call}\n'
    if fmt == "mistral":
        more = ' (", " obj)*' if parallel else ""
        return f'start: "{_MISTRAL_MARK}[" obj{more} "]"\nobj: {call}\n'
    if fmt == "generic" and parallel:
        return f'start: "[" obj (", " obj)* "]"\nobj: {call}\n'
    return f"start: obj\nobj: {call}\n"


def call_start(text: str, fmt: str) -> int | None:
    """Where in ``text`` (generated so far) a tool call begins or may yet begin: the index of
    a call's marker, or of a trailing prefix of it (more text may complete it), or 0 where
    the whole text may still be a JSON call (``llama3``, ``generic``: it starts with ``{``
    or ``[`` after whitespace); None where no call can begin before the end of ``text``."""
    if fmt in ("hermes", "mistral", "mistral_args"):
        marker = _HERMES_OPEN if fmt == "hermes" else _MISTRAL_MARK
        at = text.find(marker)
        if at >= 0:
            return at
        for size in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:size]):
                return len(text) - size
        return None
    stripped = text.lstrip()
    if not stripped:
        return 0
    if stripped.startswith(_PYTHON_TAG) or _PYTHON_TAG.startswith(stripped):
        return 0
    return 0 if stripped[0] in "{[" else None


def _decode_all(text: str) -> list[Any] | None:
    """The JSON values ``text`` holds one after another (separated by whitespace, commas or
    semicolons), or None if anything else is in it."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    at = 0
    while True:
        while at < len(text) and text[at] in " \t\r\n,;":
            at += 1
        if at >= len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        values.append(value)


def _as_call(record: object, names: frozenset[str] | None) -> ParsedCall | None:
    if not isinstance(record, Mapping):
        return None
    value: Mapping[str, Any] = record
    if isinstance(value.get("function"), Mapping):  # {"type": "function", "function": {...}}
        value = value["function"]
    name = value.get("name")
    if not isinstance(name, str) or (names is not None and name not in names):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, Mapping):
        return None
    return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


def _calls(values: Sequence[object], names: frozenset[str] | None) -> list[ParsedCall] | None:
    flat: list[object] = []
    for value in values:
        flat.extend(value if isinstance(value, list) else [value])
    calls = [_as_call(value, names) for value in flat]
    if not calls or any(call is None for call in calls):
        return None
    return [call for call in calls if call is not None]


def parse_tool_calls(text: str, fmt: str, names: Sequence[str] | None = None) -> tuple[str | None, list[ParsedCall]]:
    """``(content, calls)`` of a finished generation in ``fmt``: the text before the first
    call, less trailing whitespace (None if nothing else), and the calls, or ``(text, [])`` when it holds no well-formed call
    (a call to a function not in ``names``, where given, is not one)."""
    known = None if names is None else frozenset(names)
    if fmt == "hermes":
        calls: list[ParsedCall] = []
        first = text.find(_HERMES_OPEN)
        at = first
        while at >= 0:
            end = text.find(_HERMES_CLOSE, at)
            body = text[at + len(_HERMES_OPEN) : end if end >= 0 else len(text)]
            values = _decode_all(body.strip())
            found = _calls(values, known) if values else None
            if found is None:
                return text, []
            calls.extend(found)
            at = -1 if end < 0 else text.find(_HERMES_OPEN, end)
        return (text[:first].rstrip() or None, calls) if calls else (text, [])
    if fmt == "mistral_args":
        return _parse_mistral_args(text, known)
    if fmt == "mistral":
        first = text.find(_MISTRAL_MARK)
        if first < 0:
            return text, []
        values = _decode_all(text[first + len(_MISTRAL_MARK) :].strip())
        found = _calls(values, known) if values else None
        return (text[:first].rstrip() or None, found) if found else (text, [])
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG) :].strip()
    values = _decode_all(body)
    if values and len(values) == 1 and isinstance(values[0], Mapping) and isinstance(values[0].get("tool_calls"), list):
        values = values[0]["tool_calls"]
    found = _calls(values, known) if values else None
    return (None, found) if found else (text, [])


def _parse_mistral_args(text: str, known: frozenset[str] | None) -> tuple[str | None, list[ParsedCall]]:
    """``[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}`` calls, one after another (``[CALL_ID]`` optional)."""
    first = text.find(_MISTRAL_MARK)
    if first < 0:
        return text, []
    calls = []
    decoder = json.JSONDecoder()
    at = first
    while at < len(text):
        if not text.startswith(_MISTRAL_MARK, at):
            return text, []
        args = text.find(_MISTRAL_ARGS, at)
        if args < 0:
            return text, []
        name = text[at + len(_MISTRAL_MARK) : args].split(_MISTRAL_CALL_ID)[0].strip()
        try:
            arguments, end = decoder.raw_decode(text, args + len(_MISTRAL_ARGS))
        except json.JSONDecodeError:
            return text, []
        call = _as_call({"name": name, "arguments": arguments}, known)
        if call is None:
            return text, []
        calls.append(call)
        at = end
        while at < len(text) and text[at] in " \t\r\n":
            at += 1
    return text[:first].rstrip() or None, calls
