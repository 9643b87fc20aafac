"""The OpenAI API's records: request validation, responses, stream chunks, errors, logprobs.

Owns what the relay's HTTP shell must not decide itself:
- which request bodies of ``/v1/completions`` and ``/v1/chat/completions`` are valid, as a
  ``CompletionRequest`` (or an ``ApiError`` naming the field, ``param``, and what was wrong);
- the JSON of responses, SSE chunks and usage, in OpenAI's shapes;
- the error envelope ``{"error": {"message", "type", "param", "code"}}`` and each status's type;
- logprobs of a chosen token and the most likely alternatives, from a logits row.

Pure: numpy and the standard library's math. Must not import trio, HTTP, sockets, clocks or
agent.io; ids and times come in as arguments.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

import numpy as np

from agent.core.relay.generation_options import GenerationOptions, OptionError, parse_options, tool_history
from agent.core.relay.structured import OutputSpec, StructuredError, parse_output
from agent.core.wire.topk import TopLogits

__all__ = [
    "MAX_STOP_STRINGS",
    "MAX_TOP_LOGPROBS",
    "ApiError",
    "CompletionRequest",
    "chat_chunk",
    "chat_response",
    "check_json_content_type",
    "completion_chunk",
    "completion_response",
    "error_envelope",
    "logprob_entry",
    "parse_request",
    "token_logprobs",
    "usage",
]

MAX_STOP_STRINGS = 4  # as OpenAI
MAX_TOP_LOGPROBS = 20  # as OpenAI's chat API
MAX_COMPLETION_LOGPROBS = 5  # the completions API's ``logprobs`` integer

# Fields a client may send that this relay ignores: they change nothing or only bookkeeping.
_IGNORED = frozenset({"user", "metadata", "store", "service_tier", "stream_options", "suffix"})
# Chat fields ``agent.core.relay.structured`` reads; a completions request may not send them.
_CHAT_OUTPUT_FIELDS = ("tools", "tool_choice", "response_format", "parallel_tool_calls")
# Fields whose non-default values this relay does not implement: refused, never silently dropped.
_UNSUPPORTED_UNLESS_DEFAULT: dict[str, Any] = {
    "functions": None,
    "function_call": None,
    "best_of": 1,
    "modalities": None,
    "audio": None,
    "prediction": None,
}

_ERROR_TYPES = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "model_not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("invalid_request_error", "request_timeout"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    500: ("server_error", None),
    503: ("server_error", "service_unavailable"),
    504: ("server_error", "timeout"),
}


class ApiError(Exception):
    """An API error: HTTP ``status`` and OpenAI's envelope fields.

    ``retry_after_s``: for 429 / 503, when to try again (the ``Retry-After`` header).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        default_type, default_code = _ERROR_TYPES.get(
            status, ("server_error" if status >= 500 else "invalid_request_error", None)
        )
        self.type = default_type
        self.code = code if code is not None else default_code
        self.retry_after_s = retry_after_s

    def envelope(self) -> dict[str, Any]:
        return error_envelope(self.message, type_=self.type, param=self.param, code=self.code)


def error_envelope(message: str, *, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    """A valid completion request.

    ``kind``: "completion" (``prompt``) or "chat" (``messages``). ``prompt`` is text or token
    ids. ``max_tokens`` None: until the context or an end-of-generation token. ``top_logprobs``
    None: no logprobs. ``return_token_ids`` (vLLM's extension): the response also carries the
    prompt's and the choice's token ids.
    """

    kind: str
    model: str
    prompt: str | tuple[int, ...] | None
    messages: tuple[dict[str, Any], ...] | None
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    top_logprobs: int | None
    user: str | None
    return_token_ids: bool = False
    options: GenerationOptions = dataclasses.field(default_factory=GenerationOptions)
    output: OutputSpec | None = None

    @property
    def logprobs(self) -> bool:
        return self.top_logprobs is not None


def _bad(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, param=param)


def check_json_content_type(content_type: str | None) -> None:
    """Refuse a request body that its sender did not label as JSON (415).

    No ``Content-Type`` at all is taken as JSON. Any other label must be ``application/json``
    or a ``+json`` type (parameters such as ``charset`` are allowed). Why: a web page may send
    ``text/plain``, ``application/x-www-form-urlencoded`` or ``multipart/form-data`` to any
    address from a visitor's browser without asking the server first (no CORS preflight), so
    a relay that parsed those as JSON would run completions for any page its users visit,
    where anonymous access is on, from their address (the cross-site request that
    CVE-2021-32677 closed in FastAPI). ``application/json`` forces that preflight, which the
    relay does not grant (it sends no CORS headers).
    """
    if content_type is None:
        return
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json")):
        return
    shown = content_type.strip()[:80] or "(empty)"
    raise ApiError(
        415,
        f"The request body must be JSON sent as Content-Type: application/json, not {shown}.",
    )


def check_unicode(body: object) -> None:
    """Refuse text that is not Unicode anywhere in a decoded JSON body: JSON's ``\\uD800``
    escapes decode to lone surrogates, which no tokenizer, log or UTF-8 stream can take.
    (A loop, not recursion: any nesting json.loads accepts is walked.)

    Raises:
      ApiError: 400 naming where (``messages[0].content``), the character and its index.
    """
    pending: list[tuple[object, str]] = [(body, "")]
    while pending:
        value, path = pending.pop()
        if isinstance(value, str):
            _refuse_surrogates(value, path or "the request body", path or None)
        elif isinstance(value, Mapping):
            for key, item in value.items():
                _refuse_surrogates(str(key), "a field name", path or None)
                pending.append((item, f"{path}.{key}" if path else str(key)))
        elif isinstance(value, list):
            pending.extend((item, f"{path}[{index}]") for index, item in enumerate(value))


def _refuse_surrogates(text: str, where: str, param: str | None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise _bad(
            f"{where} is not valid Unicode text: a lone surrogate (\\u{ord(text[error.start]):04x}) "
            f"at character {error.start}",
            param,
        ) from None


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


def _optional_int(body: Mapping[str, Any], name: str, *, minimum: int, maximum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or value < minimum or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        raise _bad(f"'{name}' must be an integer {bounds}, got {value!r}", name)
    return value


#: ``top_k`` travels as a protobuf uint32; any value past a vocabulary's size means "no top-k"
MAX_TOP_K = 2**31 - 1


def _seed(seed: Any) -> int | None:
    """A request's ``seed``: any 64-bit integer, as OpenAI takes it. -1 asks for a random seed, as
    llama.cpp's server reads it (clients written for it send -1); other negative seeds are taken
    as their unsigned 64-bit value, since the generator wants a non-negative one."""
    if seed is None or (seed == -1 and _is_int(seed)):
        return None
    if not _is_int(seed) or not -(2**63) <= seed < 2**64:
        raise _bad(f"'seed' must be a 64-bit integer, got {seed!r}", "seed")
    return int(seed) % 2**64


def _number(
    body: Mapping[str, Any], name: str, default: float, *, low: float, high: float, low_open: bool = False
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value) or value > high or value < low or (low_open and value == low):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise _bad(f"'{name}' must be a number in {interval}, got {value!r}", name)
    return float(value)


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad(f"'stop' must be a string or a list of strings, got {type(value).__name__}", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise _bad(f"'stop' holds at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    if any(s == "" for s in stops):
        raise _bad("'stop' strings must not be empty", "stop")
    return tuple(stops)


def _content_text(content: object, index: int) -> str:
    param = f"messages[{index}].content"
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise _bad(f"{param}[{j}]: only text parts are supported, got {kind!r}", param)
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"{param} must be a string or a list of text parts, got {type(content).__name__}", param)


_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def _messages(body: Mapping[str, Any]) -> tuple[dict[str, Any], ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list of messages", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise _bad(f"messages[{i}] must be an object with 'role' and 'content'", f"messages[{i}]")
        role = message.get("role")
        if role not in _ROLES:
            raise _bad(f"messages[{i}].role must be one of {sorted(_ROLES)}, got {role!r}", f"messages[{i}].role")
        text = _content_text(message.get("content"), i)
        entry: dict[str, Any] = {"role": role, "content": text}
        if isinstance(message.get("name"), str):
            entry["name"] = message["name"]
        try:
            entry.update(tool_history(message, i))
        except OptionError as error:
            raise _bad(error.message, error.param) from None
        out.append(entry)
    return tuple(out)


def _output(body: Mapping[str, Any], kind: str) -> OutputSpec | None:
    if kind != "chat":
        for name in _CHAT_OUTPUT_FIELDS:
            if body.get(name) not in (None, [], {}):
                raise _bad(f"'{name}' is a chat field: send it to /v1/chat/completions", name)
        return None
    try:
        return parse_output(body)
    except StructuredError as error:
        raise _bad(error.message, error.param) from None


def parse_request(body: object, kind: str, *, max_choices: int | None = None) -> CompletionRequest:
    """Validate a decoded JSON body of ``/v1/completions`` (kind "completion") or
    ``/v1/chat/completions`` (kind "chat").

    Raises:
      ApiError: 400 naming the field that is wrong and why (``n`` times the prompts above
        ``max_choices``, None: ``generation_options.DEFAULT_MAX_CHOICES``, among them).
    """
    if kind not in ("completion", "chat"):
        raise ValueError(f"unknown request kind {kind!r}")
    if not isinstance(body, Mapping):
        raise _bad("the request body must be a JSON object", None)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' must be a non-empty string", "model")
    for name, default in _UNSUPPORTED_UNLESS_DEFAULT.items():
        value = body.get(name)
        if value is not None and value != default and not (default is None and value in ([], {})):
            raise _bad(f"'{name}' is not supported by this relay", name)
    try:
        generation = (
            parse_options(body, kind) if max_choices is None else parse_options(body, kind, max_choices=max_choices)
        )
    except OptionError as error:
        raise _bad(error.message, error.param) from None
    # echo with max_tokens 0 scores the prompt alone (lm-eval's loglikelihood asks that way)
    max_tokens = _optional_int(body, "max_tokens", minimum=0 if generation.echo else 1)
    if kind == "chat":
        max_completion = _optional_int(body, "max_completion_tokens", minimum=1)
        if max_completion is not None:
            max_tokens = max_completion if max_tokens is None else min(max_tokens, max_completion)
    elif max_tokens is None:
        max_tokens = 16  # the completions API's documented default
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad(f"'stream' must be a boolean, got {stream!r}", "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, Mapping):
            raise _bad("'stream_options' must be an object", "stream_options")
        if not stream:
            raise _bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
        value = options.get("include_usage", False)
        if not isinstance(value, bool):
            raise _bad("'stream_options.include_usage' must be a boolean", "stream_options.include_usage")
        include_usage = value
    seed = _seed(body.get("seed"))
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("'user' must be a string", "user")
    return_token_ids = body.get("return_token_ids", False)
    if return_token_ids is None:
        return_token_ids = False
    if not isinstance(return_token_ids, bool):
        raise _bad(f"'return_token_ids' must be a boolean, got {return_token_ids!r}", "return_token_ids")
    top_logprobs: int | None = None
    if kind == "chat":
        logprobs = body.get("logprobs", False)
        if logprobs is not None and not isinstance(logprobs, bool):
            raise _bad(f"'logprobs' must be a boolean, got {logprobs!r}", "logprobs")
        top = _optional_int(body, "top_logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS)
        if top is not None and not logprobs:
            raise _bad("'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
        if logprobs:
            top_logprobs = top or 0
    else:
        top_logprobs = _optional_int(body, "logprobs", minimum=0, maximum=MAX_COMPLETION_LOGPROBS)
    return CompletionRequest(
        kind=kind,
        model=model,
        prompt=generation.prompts[0] if kind == "completion" else None,
        messages=_messages(body) if kind == "chat" else None,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, low=0.0, high=2.0),
        top_p=_number(body, "top_p", 1.0, low=0.0, high=1.0, low_open=True),
        top_k=_optional_int(body, "top_k", minimum=0, maximum=MAX_TOP_K) or 0,
        seed=seed,
        stop=_stop(body),
        stream=stream,
        include_usage=include_usage,
        top_logprobs=top_logprobs,
        user=user,
        return_token_ids=return_token_ids,
        options=generation,
        output=_output(body, kind),
    )


# --- responses ---------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage; ``cached_tokens``: of the prompt tokens, those the hops' prefix caches held."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_response(
    *,
    id_: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str,
    usage_: dict[str, Any],
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": id_,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}],
        "usage": usage_,
    }


def chat_response(
    *,
    id_: str,
    created: int,
    model: str,
    text: str | None,
    finish_reason: str,
    usage_: dict[str, Any],
    logprobs: list[dict[str, Any]] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """``text`` None: no content (a message of tool calls only)."""
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "id": id_,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish_reason,
                "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
            }
        ],
        "usage": usage_,
    }


def completion_chunk(
    *, id_: str, created: int, model: str, text: str = "", finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None, usage_: dict[str, Any] | None = None, final_usage: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """One SSE chunk of a streamed completion; ``final_usage``: the usage-only last chunk."""
    choices = [] if final_usage else [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}]
    chunk = {"id": id_, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if usage_ is not None or final_usage:
        chunk["usage"] = usage_
    return chunk


def chat_chunk(
    *, id_: str, created: int, model: str, delta: dict[str, Any] | None = None, finish_reason: str | None = None,
    logprobs: list[dict[str, Any]] | None = None, usage_: dict[str, Any] | None = None, final_usage: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """One SSE chunk of a streamed chat completion; ``final_usage``: the usage-only last chunk."""
    if final_usage:
        choices = []
    else:
        choices = [
            {
                "index": 0,
                "delta": delta or {},
                "finish_reason": finish_reason,
                "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
            }
        ]
    chunk = {"id": id_, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
    if usage_ is not None or final_usage:
        chunk["usage"] = usage_
    return chunk


# --- logprobs ----------------------------------------------------------------------------------


def token_logprobs(logits: np.ndarray | TopLogits, token: int, top_n: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of ``token`` under ``logits`` (softmax at temperature 1, as OpenAI
    reports it), and the ``top_n`` most likely tokens with theirs (ties by token id).

    ``logits``: the full row, or the top-K the last hop returned with the row's log-sum-exp:
    then exact for the K tokens (the chosen token always is one: greedy and top-k <= K pick
    among them); ``top_n`` is cut to K (the owner asks for K >= ``MAX_TOP_LOGPROBS``).

    Raises:
      ValueError: ``token`` is outside the row, or (top-K) not among the K.
    """
    if isinstance(logits, TopLogits):
        logprob = logits.logprob(token)
        n = min(max(top_n, 0), logits.k)
        lse = logits.log_sum_exp
        return logprob, [(int(i), float(np.float64(v) - lse)) for i, v in zip(logits.ids[:n], logits.logits[:n])]
    row = np.asarray(logits, dtype=np.float64)
    if not 0 <= token < row.size:
        raise ValueError(f"token {token} is outside a row of {row.size} logits")
    peak = float(row.max())
    log_sum = peak + math.log(float(np.exp(row - peak).sum()))
    top: list[tuple[int, float]] = []
    if top_n > 0:
        n = min(top_n, row.size)
        ids = np.argpartition(-row, n - 1)[:n]
        ids = ids[np.lexsort((ids, -row[ids]))]
        top = [(int(i), float(row[i] - log_sum)) for i in ids]
    return float(row[token] - log_sum), top


def logprob_entry(
    token_text: str, token_bytes: bytes, logprob: float, top: Sequence[tuple[str, bytes, float]]
) -> dict[str, Any]:
    """One entry of a chat response's ``logprobs.content``."""
    return {
        "token": token_text,
        "logprob": logprob,
        "bytes": list(token_bytes),
        "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(b)} for t, b, lp in top],
    }
