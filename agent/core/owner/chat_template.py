"""Chat messages into a prompt with the model's own template, rendered as Hugging Face does.

Owns: compiling a GGUF's ``tokenizer.chat_template`` (a jinja2 template written for
``transformers``) in a sandboxed environment with the same settings and helpers that
``transformers`` gives it (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, the
``tojson`` filter, ``raise_exception``, ``strftime_now``), rendering ``messages`` with
``add_generation_prompt``, ``bos_token`` and ``eos_token``, and dropping a leading BOS text
when the tokenizer adds BOS itself (as llama.cpp's server does, so BOS is not doubled).
Tool-call history reaches the template as transformers' ``apply_chat_template`` takes it: an
assistant message's ``tool_calls`` with each call's ``arguments`` as a mapping (OpenAI sends a
JSON string; vLLM and llama.cpp's server decode it the same way, since templates such as
Qwen2.5's write ``arguments | tojson``), and a tool message's ``tool_call_id``.

Pure: jinja2 and json; the clock behind ``strftime_now`` is passed in. Must not import trio,
sockets, clocks or agent.io.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.sandbox

__all__ = ["ChatTemplate", "ChatTemplateError"]


class ChatTemplateError(ValueError):
    """The template does not compile, or refused the messages (its ``raise_exception``)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the messages: {message}")


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' tojson: unlike jinja2's, it does not HTML-escape
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    """A compiled chat template.

    Args:
      source: the template text (``tokenizer.chat_template``).
      bos_token, eos_token: the texts of the vocabulary's BOS / EOS tokens ("" if none).
      add_bos: whether tokenizing the prompt adds BOS itself (then a leading ``bos_token`` in
        the rendered text is dropped).
      strftime_now: ``format -> text`` of the current time (templates that print a date).

    Raises:
      ChatTemplateError: the template does not compile.
    """

    def __init__(
        self,
        source: str,
        *,
        bos_token: str = "",
        eos_token: str = "",
        add_bos: bool = False,
        strftime_now: Callable[[str], str] | None = None,
    ) -> None:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = strftime_now or (lambda _format: "")
        try:
            self._template = env.from_string(source)
            # a template that never reads ``tools`` cannot show a model the tools it may call
            self.takes_tools = "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"the model's chat template does not compile: {error}") from None
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos = add_bos

    def render(
        self, messages: Sequence[Mapping[str, object]], *, add_generation_prompt: bool = True, **context: object
    ) -> str:
        """The prompt text for ``messages`` (each ``{"role", "content", ...}``).

        ``context``: more template variables, as ``apply_chat_template``'s keyword arguments
        (``tools``, ``documents``; both None unless given).

        Raises:
          ChatTemplateError: the template raised, or failed while rendering.
        """
        try:
            variables: dict[str, object] = {"tools": None, "documents": None, **context}
            text = self._template.render(
                messages=[_template_message(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **variables,
            )
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as error:
            raise ChatTemplateError(
                f"the chat template failed on these messages: {type(error).__name__}: {error}"
            ) from None
        if self.add_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token) :]
        return text


def _template_message(message: Mapping[str, object]) -> dict[str, object]:
    """``message`` as a template reads it: each tool call's JSON-string ``arguments`` decoded to
    a mapping (a string that is not a JSON object stays as it came)."""
    out = dict(message)
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        decoded = []
        for call in calls:
            call = dict(call) if isinstance(call, Mapping) else call
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, Mapping) and isinstance(function.get("arguments"), str):
                try:
                    arguments = json.loads(str(function["arguments"]))
                except ValueError:
                    arguments = None
                if isinstance(arguments, dict):
                    call["function"] = {**function, "arguments": arguments}
            decoded.append(call)
        out["tool_calls"] = decoded
    return out
