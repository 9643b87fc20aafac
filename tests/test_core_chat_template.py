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
