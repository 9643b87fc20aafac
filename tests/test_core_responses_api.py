"""agent.core.relay.responses_api: Responses requests read as chat requests, Response objects."""

from __future__ import annotations

import pytest

from agent.core.relay.openai_api import ApiError, parse_request
from agent.core.relay.responses_api import chat_body, event, response_object

pytestmark = pytest.mark.unit


def test_a_responses_request_is_the_chat_request_it_means() -> None:
    body = {
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 20, "temperature": 0, "store": True,
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "2 + 3?"}]},
            {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2}'},
            {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a": 3}'},
            {"type": "function_call_output", "call_id": "c1", "output": "5"},
        ],
        "tools": [{"type": "function", "name": "add", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "add"},
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}},
    }  # fmt: skip
    chat = chat_body(body)
    assert chat["messages"][0] == {"role": "system", "content": "Be brief."}
    assert chat["messages"][1] == {"role": "user", "content": "2 + 3?"}
    assert [c["id"] for c in chat["messages"][2]["tool_calls"]] == ["c1", "c2"]  # one assistant message
    assert chat["messages"][3] == {"role": "tool", "tool_call_id": "c1", "content": "5"}
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "add"}}
    assert chat["response_format"]["json_schema"]["name"] == "x" and chat["max_completion_tokens"] == 20
    req = parse_request(chat, "chat")
    assert req.output is not None and req.output.forced_name == "add" and req.output.schema == {"type": "object"}
    assert chat_body({"model": "m", "input": "hi"})["messages"] == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "input"),
        ({"model": "m", "input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"model": "m", "input": [{"type": "reasoning"}]}, "input[0].type"),
        ({"model": "m", "input": "x", "frobnicate": 1}, "frobnicate"),
    ],
)
def test_bad_responses_requests_name_the_field(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as caught:
        chat_body(body)
    assert caught.value.status == 400 and caught.value.param == param


def test_a_response_object_holds_the_text_and_the_calls() -> None:
    calls = [{"id": "fc_1", "call_id": "call_1", "name": "add", "arguments": "{}"}]
    response = response_object(id_="resp_1", created_at=1, request={"model": "m"}, status="completed", text="Hi",
                               message_id="msg_1", calls=calls, usage=(3, 4), incomplete=True)  # fmt: skip
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [item["type"] for item in response["output"]] == ["message", "function_call"]
    assert response["output"][0]["content"][0]["text"] == "Hi" and response["usage"]["total_tokens"] == 7
    assert event("response.output_text.delta", 4, delta="x") == {
        "type": "response.output_text.delta", "sequence_number": 4, "delta": "x"
    }  # fmt: skip
