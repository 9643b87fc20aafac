"""agent.core.owner.chat_template: Hugging Face's rendering rules over a GGUF's template."""

from __future__ import annotations

import pytest

from agent.core.owner.chat_template import ChatTemplate, ChatTemplateError

pytestmark = pytest.mark.unit

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_chatml_renders_with_generation_prompt() -> None:
    text = ChatTemplate(CHATML).render(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]
    )
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 🙂<|im_end|>\n<|im_start|>assistant\n"


def test_trim_and_lstrip_blocks_as_transformers() -> None:
    # the indentation before a block tag and the newline after one are not output
    source = "{% for m in messages %}\n    {% if m.content %}[{{ m.content }}]{% endif %}\n{% endfor %}"
    assert ChatTemplate(source).render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "[a][b]"


def test_leading_bos_is_dropped_when_the_tokenizer_adds_it() -> None:
    source = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}{{ eos_token }}"
    messages = [{"role": "user", "content": "x"}]
    assert ChatTemplate(source, bos_token="<s>", eos_token="</s>", add_bos=True).render(messages) == "x</s>"
    assert ChatTemplate(source, bos_token="<s>", eos_token="</s>", add_bos=False).render(messages) == "<s>x</s>"


def test_raise_exception_and_tojson_and_loopcontrols() -> None:
    source = (
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
        "{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content | tojson }}{% endfor %}"
    )
    template = ChatTemplate(source)
    assert template.render([{"role": "user", "content": "é<"}, {"role": "user", "content": "z"}]) == '"é<"'
    with pytest.raises(ChatTemplateError, match="no tools"):
        template.render([{"role": "tool", "content": "x"}])


def test_a_broken_template_is_refused_at_compile_time() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


def test_the_sandbox_refuses_reaching_python_internals() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        template.render([{"role": "user", "content": "x"}])


# the tool-call part of Qwen2.5's template: it writes each call's arguments with tojson
TOOL_HISTORY = (
    "{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}"
    "{% for c in m.tool_calls %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    "</tool_call>{% endfor %}{% elif m.role == 'tool' %}<tool_response id={{ m.tool_call_id }}>{{ m.content }}"
    "</tool_response>{% else %}{{ m.content }}{% endif %}{% endfor %}{% if tools %}[{{ tools | length }} tools]{% endif %}"
)


def test_tool_call_history_reaches_the_template_with_arguments_decoded_as_transformers_takes_them() -> None:
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}},
                        {"id": "c2", "type": "function", "function": {"name": "raw", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "4"},
    ]  # fmt: skip
    text = ChatTemplate(TOOL_HISTORY).render(messages, tools=[{"type": "function"}])
    assert text == (
        '2+2?<tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call>'
        '<tool_call>{"name": "raw", "arguments": "not json"}</tool_call>'
        "<tool_response id=c1>4</tool_response>[1 tools]"
    )
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 2, "b": 2}'  # the caller's left as it was
