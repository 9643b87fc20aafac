"""agent.core.relay.openai_api: request validation, response shapes, error envelopes, logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from agent.core.relay.openai_api import (
    ApiError,
    chat_chunk,
    chat_response,
    check_json_content_type,
    check_unicode,
    parse_request,
    token_logprobs,
    usage,
)

pytestmark = pytest.mark.unit


def _chat(**fields):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def test_chat_defaults_and_fields() -> None:
    req = parse_request(
        _chat(max_completion_tokens=7, temperature=0, top_p=0.5, top_k=3, seed=9, stop="\n", stream=True,
              stream_options={"include_usage": True}, logprobs=True, top_logprobs=2, user="u", n=1),
        "chat",
    )  # fmt: skip
    assert (req.kind, req.model, req.max_tokens, req.temperature, req.top_p, req.top_k, req.seed) == (
        "chat", "m", 7, 0.0, 0.5, 3, 9,
    )  # fmt: skip
    assert req.stop == ("\n",) and req.stream and req.include_usage and req.top_logprobs == 2 and req.user == "u"
    assert req.messages == ({"role": "user", "content": "hi"},)
    plain = parse_request(_chat(), "chat")
    assert plain.max_tokens is None and plain.temperature == 1.0 and not plain.logprobs and plain.stop == ()


def test_max_tokens_and_max_completion_tokens_take_the_smaller() -> None:
    assert parse_request(_chat(max_tokens=10, max_completion_tokens=4), "chat").max_tokens == 4
    assert parse_request({"model": "m", "prompt": "x"}, "completion").max_tokens == 16


def test_content_parts_join_and_non_text_parts_are_refused() -> None:
    req = parse_request(
        _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]),
        "chat",
    )
    assert req.messages[0]["content"] == "ab"
    with pytest.raises(ApiError) as caught:
        parse_request(_chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]), "chat")
    assert caught.value.status == 400 and caught.value.param == "messages[0].content"


def test_tools_and_response_format_are_read_and_tool_history_kept() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    history = [
        {"role": "user", "content": "call f"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]  # fmt: skip
    req = parse_request(_chat(messages=history, tools=tools, tool_choice="required", parallel_tool_calls=False), "chat")
    assert req.output is not None and req.output.forces_call and not req.output.parallel_tool_calls
    assert req.output.tool_names == ["f"]
    assert req.messages is not None
    assert req.messages[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
    assert req.messages[2]["tool_call_id"] == "c1"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = parse_request(_chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                                     "strict": True}}), "chat")  # fmt: skip
    assert req.output is not None and req.output.schema == schema and not req.output.parses_calls
    assert parse_request(_chat(response_format={"type": "text"}), "chat").output is None
    with pytest.raises(ApiError, match="chat field"):
        parse_request({"model": "m", "prompt": "x", "response_format": {"type": "json_object"}}, "completion")


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"n": 9}, "n"),
        ({"n": 0}, "n"),
        ({"echo": True}, "echo"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": "x"}, "frequency_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": [1]}, "logit_bias"),
        ({"min_p": 1.5}, "min_p"),
        ({"repeat_penalty": -1}, "repeat_penalty"),
        ({"repeat_last_n": -2}, "repeat_last_n"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        (
            {
                "messages": [
                    {"role": "user", "content": "x", "tool_calls": []},
                    {"role": "user", "content": "y", "tool_calls": [{"function": {"name": "f"}}]},
                ]
            },
            "messages[1].tool_calls",
        ),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]}, "messages[0].tool_calls"),
        ({"messages": [{"role": "tool", "content": "4", "tool_call_id": 7}]}, "messages[0].tool_call_id"),
        ({"model": ""}, "model"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"temperature": 3}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"seed": 1.5}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"top_k": 2**32}, "top_k"),
        ({"top_k": -1}, "top_k"),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]},
            "tools[0].function.parameters",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "always"}, "tool_choice"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
            "response_format.json_schema.schema",
        ),
    ],
)
def test_bad_chat_fields_are_400_naming_the_field(fields: dict, param: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse_request(_chat(**fields), "chat")
    error = caught.value
    assert error.status == 400 and error.param == param
    envelope = error.envelope()["error"]
    assert set(envelope) == {"message", "type", "param", "code"}
    assert envelope["type"] == "invalid_request_error" and envelope["param"] == param


@pytest.mark.parametrize(
    ("seed", "taken"),
    [(None, None), (-1, None), (0, 0), (7, 7), (-2, 2**64 - 2), (2**64 - 1, 2**64 - 1), (-(2**63), 2**63)],
)
def test_any_64_bit_seed_is_taken_and_minus_one_is_random_as_llama_cpp_reads_it(seed, taken) -> None:
    assert parse_request(_chat(seed=seed), "chat").seed == taken


def test_completion_prompts() -> None:
    assert parse_request({"model": "m", "prompt": ["one"]}, "completion").prompt == "one"
    assert parse_request({"model": "m", "prompt": [1, 2, 3]}, "completion").prompt == (1, 2, 3)
    assert parse_request({"model": "m", "prompt": "x", "logprobs": 3}, "completion").top_logprobs == 3
    several = parse_request({"model": "m", "prompt": ["a", [5, 6]], "n": 2}, "completion")
    assert several.prompt == "a" and several.options.prompts == ("a", (5, 6)) and several.options.n == 2
    for prompt in ("", ["a", ""], [], None, [-1], ["a", [-1]], ["a"] * 65):
        with pytest.raises(ApiError) as caught:
            parse_request({"model": "m", "prompt": prompt}, "completion")
        assert caught.value.param == "prompt"


def test_a_body_that_is_not_an_object_is_400() -> None:
    with pytest.raises(ApiError) as caught:
        parse_request([1, 2], "chat")
    assert caught.value.status == 400


def test_text_that_is_not_unicode_is_400_naming_where() -> None:
    check_unicode({"model": "m", "messages": [{"role": "user", "content": "ok 😀 中文"}], "stop": ["\n"]})
    cases = [
        ({"prompt": "a\ud800b"}, "prompt", "(\\ud800) at character 1"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
         "messages[0].content[0].text", "(\\udfff) at character 0"),
        ({"stop": ["fine", "x\ud83d"]}, "stop[1]", "at character 1"),  # half of an emoji's pair
        ({"\ud800": 1}, "a field name", "at character 0"),
    ]  # fmt: skip
    for body, where, detail in cases:
        with pytest.raises(ApiError) as caught:
            check_unicode(body)
        error = caught.value
        assert error.status == 400 and error.param == (None if where == "a field name" else where), error
        assert error.message.startswith(f"{where} is not valid Unicode text: a lone surrogate"), error.message
        assert detail in error.message, error.message


def test_unicode_is_checked_at_any_depth() -> None:
    deep: object = "bad \udc80"
    for _ in range(5000):  # deeper than Python's recursion limit
        deep = [deep]
    with pytest.raises(ApiError) as caught:
        check_unicode({"prompt": deep})
    assert caught.value.param == "prompt" + "[0]" * 5000 and "(\\udc80) at character 4" in caught.value.message


@pytest.mark.parametrize(
    "content_type", [None, "application/json", "Application/JSON; charset=utf-8", "application/merge-patch+json"]
)
def test_json_content_types_are_taken(content_type: str | None) -> None:
    check_json_content_type(content_type)


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
     "", "application/jsonx", "text/json+"],
)  # fmt: skip
def test_other_content_types_are_415_naming_what_came(content_type: str) -> None:
    with pytest.raises(ApiError) as caught:
        check_json_content_type(content_type)
    assert caught.value.status == 415 and caught.value.code == "unsupported_media_type"
    assert "application/json" in caught.value.message
    assert (content_type or "(empty)") in caught.value.message


def test_error_types_by_status() -> None:
    assert ApiError(401, "x").envelope()["error"]["code"] == "invalid_api_key"
    assert ApiError(404, "x").envelope()["error"]["code"] == "model_not_found"
    limited = ApiError(429, "x", code="tokens_per_day", retry_after_s=3.2)
    assert limited.type == "rate_limit_error" and limited.code == "tokens_per_day" and limited.retry_after_s == 3.2
    assert ApiError(503, "x").type == "server_error"


def test_logprobs_are_log_softmax_and_top_sorted() -> None:
    logits = np.array([1.0, 3.0, 2.0, 3.0], dtype=np.float32)
    logprob, top = token_logprobs(logits, 2, 3)
    expected = logits.astype(np.float64) - math.log(np.exp(logits.astype(np.float64)).sum())
    assert logprob == pytest.approx(expected[2])
    assert [t for t, _ in top] == [1, 3, 2]  # ties by token id
    assert [lp for _, lp in top] == pytest.approx([expected[1], expected[3], expected[2]])
    assert sum(math.exp(v) for v in expected) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        token_logprobs(logits, 4, 1)


def test_response_shapes() -> None:
    body = chat_response(id_="c", created=1, model="m", text="hi", finish_reason="stop", usage_=usage(3, 2))
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hi", "refusal": None}
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    final = chat_chunk(id_="c", created=1, model="m", usage_=usage(1, 1), final_usage=True)
    assert final["choices"] == [] and final["usage"]["total_tokens"] == 2


def test_sampling_options_and_tool_history_are_kept() -> None:
    req = parse_request(
        _chat(n=3, presence_penalty=0.5, frequency_penalty=-1, logit_bias={"42": -100, "7": 3.5}, min_p=0.05,
              repeat_penalty=1.1, repeat_last_n=-1, ignore_eos=True, seed=3),
        "chat",
    )  # fmt: skip
    options = req.options
    assert (options.n, options.presence_penalty, options.frequency_penalty) == (3, 0.5, -1.0)
    assert options.logit_bias == ((7, 3.5), (42, -100.0)) and options.min_p == 0.05
    assert (options.repeat_penalty, options.repeat_last_n, options.ignore_eos) == (1.1, -1, True)
    history = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4"},
    ]  # fmt: skip
    messages = parse_request(_chat(messages=history), "chat").messages
    assert messages[1]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2}'}
    assert messages[1]["tool_calls"][0]["id"] == "call_1" and messages[2]["tool_call_id"] == "call_1"


def test_n_is_capped_per_request_over_every_prompt() -> None:
    assert parse_request(_chat(n=4), "chat", max_choices=4).options.n == 4
    with pytest.raises(ApiError) as caught:
        parse_request({"model": "m", "prompt": ["a", "b", "c"], "n": 2}, "completion", max_choices=4)
    assert caught.value.param == "n" and "6 choices" in caught.value.message


def test_echo_lets_max_tokens_be_zero_on_completions_only() -> None:
    req = parse_request({"model": "m", "prompt": "x", "echo": True, "max_tokens": 0, "logprobs": 1}, "completion")
    assert req.options.echo and req.max_tokens == 0 and req.top_logprobs == 1
    with pytest.raises(ApiError):
        parse_request({"model": "m", "prompt": "x", "max_tokens": 0}, "completion")
