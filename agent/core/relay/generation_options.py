"""The request fields that change how tokens are chosen or how many choices come back, beyond
temperature / top-k / top-p: ``n``, OpenAI's ``presence_penalty`` / ``frequency_penalty`` /
``logit_bias``, vLLM's and llama.cpp's ``min_p``, llama.cpp server's ``repeat_penalty`` /
``repeat_last_n``, ``ignore_eos``, and the completions API's ``echo`` and list of prompts.

Owns their validation (an ``OptionError`` naming the field, which the caller answers with
400) and their defaults, as a ``GenerationOptions``; and the check of a chat history's tool
calls (``tool_history``: an assistant's ``tool_calls``, a tool message's ``tool_call_id``,
kept for the chat template, never dropped). ``agent.core.relay.openai_api.parse_request`` calls ``parse_options``;
the rules that apply them to a logits row are ``agent.core.owner.sampling``'s.

Pure: the standard library only. Must not import trio, HTTP, sockets, clocks or agent.io.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

__all__ = [
    "DEFAULT_MAX_CHOICES",
    "MAX_LOGIT_BIAS_ENTRIES",
    "GenerationOptions",
    "OptionError",
    "parse_options",
    "parse_prompts",
    "tool_history",
]

#: ``n`` (times the number of prompts) above this is refused: each choice is a session of its
#: own on the swarm (RelayConfig.max_choices overrides it)
DEFAULT_MAX_CHOICES = 8
#: as OpenAI: at most this many tokens in ``logit_bias``
MAX_LOGIT_BIAS_ENTRIES = 300
#: llama.cpp server's default window for ``repeat_penalty``
DEFAULT_REPEAT_LAST_N = 64
#: the most prompts one completions request may carry (lm-eval batches a few at a time)
MAX_PROMPTS = 64


@dataclasses.dataclass(frozen=True)
class GenerationOptions:
    """``n``: choices per prompt. Penalties and ``logit_bias`` (token id -> bias, sorted by id)
    as OpenAI defines them; ``repeat_penalty`` / ``repeat_last_n`` as llama.cpp's server
    (1.0: off; -1: the whole context); ``min_p`` as vLLM / llama.cpp (0: off). ``ignore_eos``:
    an end-of-generation token does not end the choice (load generators ask for exactly
    ``max_tokens``). ``echo``: the completion's text (and logprobs) start with the prompt's.
    ``prompts``: every prompt of a completions request (the request's ``prompt`` is the first)."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = DEFAULT_REPEAT_LAST_N
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    ignore_eos: bool = False
    echo: bool = False
    prompts: tuple[str | tuple[int, ...], ...] = ()


class OptionError(ValueError):
    """A field is invalid: ``param`` names it (the caller turns it into a 400)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: Mapping[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise OptionError(f"'{name}' must be a number in [{low:g}, {high:g}], got {value!r}", name)
    if not low <= value <= high:
        raise OptionError(f"'{name}' must be a number in [{low:g}, {high:g}], got {value!r}", name)
    return float(value)


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    if value is None or value == {}:
        return ()
    if not isinstance(value, Mapping):
        raise OptionError("'logit_bias' must be an object mapping token ids to biases", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise OptionError(f"'logit_bias' holds at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(value)}", "logit_bias")
    out: dict[int, float] = {}
    for key, bias in value.items():
        text = str(key)
        if not text.isdigit() or len(text) > 10:
            raise OptionError(f"'logit_bias' keys must be token ids (digits), got {key!r}", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise OptionError(f"'logit_bias[{text}]' must be a number in [-100, 100], got {bias!r}", "logit_bias")
        out[int(text)] = float(bias)
    return tuple(sorted(out.items()))


def parse_prompts(prompt: object) -> tuple[str | tuple[int, ...], ...]:
    """The completions API's ``prompt``: a string, a list of token ids, or a list of either."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
        items: list[object] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        items = list(prompt)
    else:
        raise OptionError("'prompt' must be a non-empty string, a list of token ids, or a list of those", "prompt")
    if len(items) > MAX_PROMPTS:
        raise OptionError(f"'prompt' holds at most {MAX_PROMPTS} prompts, got {len(items)}", "prompt")
    out: list[str | tuple[int, ...]] = []
    for i, item in enumerate(items):
        where = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            if not item:
                raise OptionError(f"'{where}' must not be empty", "prompt")
            out.append(item)
        elif isinstance(item, list) and item and all(_is_int(t) and t >= 0 for t in item):
            out.append(tuple(item))
        else:
            raise OptionError(f"'{where}' must be a non-empty string or a list of token ids >= 0", "prompt")
    return tuple(out)


def parse_options(body: Mapping[str, Any], kind: str, *, max_choices: int = DEFAULT_MAX_CHOICES) -> GenerationOptions:
    """The ``GenerationOptions`` of a decoded request body (``kind`` "completion" or "chat").

    Raises:
      OptionError: a field is out of range or of the wrong type; ``n`` (times the prompts) is
        above ``max_choices``; ``echo`` on a chat request.
    """
    n = body.get("n")
    if n is None:
        n = 1
    if not _is_int(n) or n < 1:
        raise OptionError(f"'n' must be an integer >= 1, got {n!r}", "n")
    prompts = parse_prompts(body.get("prompt")) if kind == "completion" else ()
    choices = n * max(1, len(prompts))
    if choices > max_choices:
        several = f" ({n} for each of {len(prompts)} prompts)" if len(prompts) > 1 else ""
        raise OptionError(
            f"'n' asks for {choices} choices{several}; this relay gives at most {max_choices} a request", "n"
        )
    echo = body.get("echo", False)
    if echo is None:
        echo = False
    if not isinstance(echo, bool):
        raise OptionError(f"'echo' must be a boolean, got {echo!r}", "echo")
    if echo and kind == "chat":
        raise OptionError("'echo' is a field of /v1/completions only", "echo")
    ignore_eos = body.get("ignore_eos", False)
    if ignore_eos is None:
        ignore_eos = False
    if not isinstance(ignore_eos, bool):
        raise OptionError(f"'ignore_eos' must be a boolean, got {ignore_eos!r}", "ignore_eos")
    last_n = body.get("repeat_last_n", DEFAULT_REPEAT_LAST_N)
    if last_n is None:
        last_n = DEFAULT_REPEAT_LAST_N
    if not _is_int(last_n) or last_n < -1:
        raise OptionError(f"'repeat_last_n' must be an integer >= -1 (-1: the whole context), got {last_n!r}",
                          "repeat_last_n")  # fmt: skip
    return GenerationOptions(
        n=n,
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repeat_penalty=_number(body, "repeat_penalty", 1.0, 0.0, 10.0) or 1.0,  # llama.cpp: 0 is off too
        repeat_last_n=last_n,
        logit_bias=_logit_bias(body.get("logit_bias")),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        ignore_eos=ignore_eos,
        echo=echo,
        prompts=prompts,
    )


def tool_history(message: Mapping[str, Any], index: int) -> dict[str, Any]:
    """An assistant message's ``tool_calls`` and a tool message's ``tool_call_id``, checked and
    kept for the chat template (never silently dropped)."""
    out: dict[str, Any] = {}
    calls = message.get("tool_calls")
    if calls is not None and calls != []:
        param = f"messages[{index}].tool_calls"
        if message.get("role") != "assistant":
            raise OptionError(f"{param}: only an assistant message carries tool calls", param)
        if not isinstance(calls, list):
            raise OptionError(f"{param} must be a list of tool calls", param)
        kept = []
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
                raise OptionError(
                    f"{param}[{j}] must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}", param
                )
            arguments = function.get("arguments", "")
            if not isinstance(arguments, (str, Mapping)):
                raise OptionError(f"{param}[{j}].function.arguments must be a JSON string", param)
            kept.append({
                "id": str(call.get("id") or ""), "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            })  # fmt: skip
        out["tool_calls"] = kept
    call_id = message.get("tool_call_id")
    if call_id is not None:
        if not isinstance(call_id, str):
            raise OptionError(f"messages[{index}].tool_call_id must be a string", f"messages[{index}].tool_call_id")
        out["tool_call_id"] = call_id
    return out
