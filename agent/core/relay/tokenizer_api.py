"""``/tokenize``, ``/detokenize`` and ``/tokenizer_info``, as llama.cpp's server and vLLM answer
them (lm-evaluation-harness's remote tokenizer reads vLLM's; llama.cpp's clients its own).

Owns: which bodies are valid (an ``ApiError`` 400 naming the field) and the answers' shapes.
A body may name its ``model``; without one, a relay serving one model uses it.

- ``/tokenize``: vLLM's ``{"prompt", "add_special_tokens": true}`` or ``{"messages",
  "add_generation_prompt": true}``, or llama.cpp's ``{"content", "add_special": false,
  "with_pieces": false}``; answered ``{"tokens", "count", "max_model_len", "token_strs"}``
  (``tokens`` as llama.cpp's ``[{"id", "piece"}]`` when ``with_pieces``).
- ``/detokenize``: ``{"tokens": [ids]}``; answered ``{"prompt", "content"}`` (vLLM's, llama.cpp's).
- ``/tokenizer_info``: the special tokens' texts, the chat template, the served context.

Pure: the standard library. Must not import trio, HTTP, sockets, clocks or agent.io.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from agent.core.relay.openai_api import ApiError, parse_request

__all__ = ["TokenizeRequest", "detokenize_reply", "parse_detokenize", "parse_tokenize", "tokenize_reply"]

#: the most token ids one /detokenize takes
MAX_DETOKENIZE_TOKENS = 1 << 20


@dataclasses.dataclass(frozen=True)
class TokenizeRequest:
    """``text`` or ``messages`` (rendered with the chat template first); ``add_special``: BOS
    if the model adds one; ``with_pieces``: llama.cpp's ``[{"id", "piece"}]`` answer."""

    model: str | None
    text: str | None
    messages: tuple[dict[str, Any], ...] | None
    add_special: bool
    add_generation_prompt: bool
    with_pieces: bool


def _bad(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, param=param)


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(f"'{name}' must be a boolean, got {value!r}", name)
    return value


def _model(body: Mapping[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise _bad("'model' must be a non-empty string", "model")
    return model


def parse_tokenize(body: object) -> TokenizeRequest:
    """Raises ApiError 400 naming the field."""
    if not isinstance(body, Mapping):
        raise _bad("the request body must be a JSON object", None)
    messages = body.get("messages")
    text_field = "prompt" if "prompt" in body else "content"
    text = body.get(text_field)
    if messages is not None:
        checked = parse_request({"model": "-", "messages": messages}, "chat").messages
        return TokenizeRequest(
            _model(body), None, checked, _flag(body, "add_special_tokens", False),
            _flag(body, "add_generation_prompt", True), _flag(body, "with_pieces", False),
        )  # fmt: skip
    if not isinstance(text, str):
        raise _bad("'prompt' (or 'content') must be a string, or 'messages' a list of messages", "prompt")
    # vLLM adds special tokens unless told not to; llama.cpp's /tokenize does not unless told to
    add_special = (
        _flag(body, "add_special_tokens", True) if text_field == "prompt" else _flag(body, "add_special", False)
    )
    return TokenizeRequest(_model(body), text, None, add_special, False, _flag(body, "with_pieces", False))


def parse_detokenize(body: object, n_vocab: int | None = None) -> tuple[str | None, list[int]]:
    """``(model, tokens)``. Raises ApiError 400 naming the field (an id outside ``n_vocab``)."""
    if not isinstance(body, Mapping):
        raise _bad("the request body must be a JSON object", None)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise _bad("'tokens' must be a list of token ids", "tokens")
    if len(tokens) > MAX_DETOKENIZE_TOKENS:
        raise _bad(f"'tokens' holds at most {MAX_DETOKENIZE_TOKENS} ids, got {len(tokens)}", "tokens")
    outside = [t for t in tokens if t < 0 or (n_vocab is not None and t >= n_vocab)]
    if outside:
        raise _bad(f"token id {outside[0]} is outside the vocabulary of {n_vocab} tokens", "tokens")
    return _model(body), tokens


def tokenize_reply(
    tokens: Sequence[int], pieces: Sequence[bytes], *, max_model_len: int, with_pieces: bool
) -> dict[str, Any]:
    """``pieces[i]``: the bytes of ``tokens[i]`` (a piece that is not whole UTF-8 is shown as
    llama.cpp's server shows it: its bytes as a list of numbers)."""
    listed: list[Any] = list(tokens)
    if with_pieces:
        listed = [{"id": t, "piece": _piece(p)} for t, p in zip(tokens, pieces, strict=True)]
    return {"tokens": listed, "count": len(tokens), "max_model_len": max_model_len, "token_strs": None}


def _piece(piece: bytes) -> str | list[int]:
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)


def detokenize_reply(text: str) -> dict[str, Any]:
    return {"prompt": text, "content": text}
