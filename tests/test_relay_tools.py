"""Tool calls and structured output end to end: the official ``openai`` client against a real
relay over a real three-node swarm of ``qwen2-tiny-tools`` (random weights, Qwen2.5-Instruct's
tool-aware chat template), so every answer that must keep to a schema does so only because the
draw is constrained.

Also: constrained greedy decoding through the swarm equals the same constrained decoding on one
unsplit worker, token for token; and a property test: 200 generated schemas, every answer
parses and validates.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import openai
import pydantic
import pytest
import trio

from agent.core.owner.grammar import GrammarTokenizer, TokenConstraint, compile_json_schema
from agent.core.wire.worker_records import SeqInput
from agent.demo.swarm_demo import node_memory_bytes, wait_for_coverage
from agent.harness.local_swarm import LocalSwarm, LocalSwarmConfig
from agent.io.client import open_swarm_client
from agent.io.worker.process import open_worker
from agent.models import sha256_file
from agent.testing.tiny_models import tiny_model_path

pytestmark = [pytest.mark.swarm, pytest.mark.slow]

ALIAS = "qwen2-tiny-tools"
SETUP_TIMEOUT_S = 240.0
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 999},
                "b": {"type": "integer", "minimum": -99, "maximum": 99},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@dataclasses.dataclass
class Relay:
    swarm: LocalSwarm
    url: str
    key: str
    client: openai.OpenAI


async def _start(swarm: LocalSwarm) -> None:
    await swarm.start_tracker()
    async with open_swarm_client(swarm.tracker_addr) as c:
        (entry,) = [m for m in await c.list_models() if m.alias == ALIAS]
        memory = node_memory_bytes(entry.n_layer, entry.bytes_per_block, 3)
        for i in range(3):
            swarm.start_node(f"node-{i + 1}", memory)
        await wait_for_coverage(c, swarm, ALIAS, timeout_s=SETUP_TIMEOUT_S)
    await swarm.start_relay()


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Relay]:
    config = LocalSwarmConfig(model_path=tiny_model_path(ALIAS), model_alias=ALIAS)
    swarm = LocalSwarm(config, tmp_path_factory.mktemp("relay-tools"))
    try:
        trio.run(_start, swarm)
        key = swarm.add_relay_key("tests")
        client = openai.OpenAI(base_url=f"{swarm.relay_url}/v1", api_key=key, max_retries=0, timeout=120.0)
        try:
            yield Relay(swarm, swarm.relay_url, key, client)
        finally:
            client.close()
    finally:
        swarm.close_nowait()


def _check_call(name: str, arguments: str) -> None:
    tool = {t["function"]["name"]: t for t in TOOLS}[name]
    jsonschema.validate(json.loads(arguments), tool["function"]["parameters"])


def _streamed(stream) -> tuple[str, list[dict[str, Any]], str | None]:
    """(content, tool calls, finish_reason) of a streamed chat completion."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += call.id or ""
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


# --- tools ---------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_named_function_is_called_streamed_and_not(relay: Relay) -> None:
    choice = {"type": "function", "function": {"name": "add"}}
    response = relay.client.chat.completions.create(
        model=ALIAS, messages=CHAT, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=120
    )
    (answer,) = response.choices
    assert answer.finish_reason == "tool_calls", answer.message
    assert answer.message.content is None
    (call,) = answer.message.tool_calls
    assert call.type == "function" and call.function.name == "add" and call.id.startswith("call_")
    _check_call(call.function.name, call.function.arguments)
    content, calls, finish = _streamed(
        relay.client.chat.completions.create(
            model=ALIAS, messages=CHAT, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=120, stream=True
        )
    )
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [("add", call.function.arguments)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stream", [False, True])
def test_required_makes_a_call_to_one_of_the_tools(relay: Relay, stream: bool) -> None:
    for seed in range(3):
        fields = dict(model=ALIAS, messages=CHAT, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                      temperature=1.0, seed=seed, max_tokens=160)  # fmt: skip
        if stream:
            _content, calls, finish = _streamed(relay.client.chat.completions.create(**fields, stream=True))
        else:
            (answer,) = relay.client.chat.completions.create(**fields).choices
            finish = answer.finish_reason
            calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in answer.message.tool_calls]
        assert finish == "tool_calls" and len(calls) == 1
        _check_call(calls[0]["name"], calls[0]["arguments"])


@pytest.mark.timeout(120)
def test_auto_streamed_equals_not_streamed_and_a_tool_history_renders(relay: Relay) -> None:
    history = [
        *CHAT,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]  # fmt: skip
    fields = dict(model=ALIAS, messages=history, tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=24)
    (answer,) = relay.client.chat.completions.create(**fields).choices
    content, calls, finish = _streamed(relay.client.chat.completions.create(**fields, stream=True))
    assert finish == answer.finish_reason
    if answer.message.tool_calls:
        assert finish == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in answer.message.tool_calls
        ]
    else:
        assert content == answer.message.content and finish in ("stop", "length")


@pytest.mark.timeout(60)
def test_bad_tools_get_a_400_naming_the_field_and_the_relay_keeps_serving(relay: Relay) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        relay.client.chat.completions.create(
            model=ALIAS, messages=CHAT, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}
        )
    assert caught.value.body["param"] == "tool_choice" and "nope" in caught.value.body["message"]
    bad_schema = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "a"}},
    }
    with pytest.raises(openai.BadRequestError) as caught:
        relay.client.chat.completions.create(model=ALIAS, messages=CHAT, response_format=bad_schema)
    assert caught.value.body["param"] == "response_format.json_schema.schema"
    response = relay.client.chat.completions.create(model=ALIAS, messages=CHAT, max_tokens=4, temperature=0)
    assert response.choices[0].finish_reason in ("stop", "length")


# --- structured output ---------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_strict_answers_parse_and_validate(relay: Relay, stream: bool) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(3):
        fields = dict(model=ALIAS, messages=CHAT, response_format=response_format, temperature=0.8, seed=seed,
                      max_tokens=200)  # fmt: skip
        if stream:
            content, _calls, finish = _streamed(relay.client.chat.completions.create(**fields, stream=True))
        else:
            (answer,) = relay.client.chat.completions.create(**fields).choices
            content, finish = answer.message.content, answer.finish_reason
        assert finish == "stop", content
        jsonschema.validate(json.loads(content), PERSON)


@pytest.mark.timeout(60)
def test_json_object_answers_are_objects(relay: Relay) -> None:
    (answer,) = relay.client.chat.completions.create(
        model=ALIAS, messages=CHAT, response_format={"type": "json_object"}, temperature=0, max_tokens=200
    ).choices
    if answer.finish_reason == "stop":
        assert isinstance(json.loads(answer.message.content), dict)
    else:  # a free object may run past the budget; what came is still a prefix of one
        assert answer.message.content.startswith("{")


def _unsplit_constrained_greedy(relay: Relay, prompt_tokens: list[int], schema: dict, max_tokens: int) -> list[int]:
    """Greedy decoding under ``schema`` on one unsplit worker of the model: full rows, masked."""

    async def run() -> list[int]:
        path = relay.swarm.config.model_path
        sha = sha256_file(path)
        async with open_worker(path, 0, None, vocab_only=True, model_sha256=sha) as vocab_worker:
            vocabulary = await vocab_worker.client.vocabulary()
        tokenizer = GrammarTokenizer(vocabulary)
        constraint = TokenConstraint(tokenizer, compile_json_schema(schema, tokenizer))
        eog = set(vocabulary.eog_token_ids)
        tokens = list(prompt_tokens)
        out: list[int] = []
        at = 0
        async with open_worker(path, 0, None, threads=1, max_sequences=1, model_sha256=sha) as single:
            while len(out) < max_tokens:
                (result,) = await single.client.forward(
                    [SeqInput(seq_id=0, positions=range(at, len(tokens)), token_ids=tokens[at:])]
                )
                at = len(tokens)
                row = np.where(constraint.allowed(), result.logits[-1], -np.inf)
                token = int(np.argmax(row))
                constraint.accept(token)
                out.append(token)
                tokens.append(token)
                if token in eog:
                    break
        return out

    return trio.run(run)


@pytest.mark.timeout(180)
def test_constrained_greedy_through_the_swarm_equals_one_unsplit_worker(relay: Relay) -> None:
    response = relay.client.chat.completions.create(
        model=ALIAS, messages=CHAT, temperature=0, max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    data = response.model_dump()
    swarm_tokens = data["choices"][0]["token_ids"]
    expected = _unsplit_constrained_greedy(relay, data["prompt_token_ids"], PERSON, 120)
    assert swarm_tokens == expected
    jsonschema.validate(json.loads(response.choices[0].message.content), PERSON)


def _random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A JSON schema whose every value is bounded (so a complete answer fits the budget)."""
    kinds = ["string", "integer", "number", "boolean", "enum", "const", "null"]
    if depth < 2:
        kinds += ["object", "array", "anyOf"]
    kind = rng.choice(kinds)
    if kind == "string":
        schema: dict[str, Any] = {"type": "string", "maxLength": rng.randint(0, 8)}
        if rng.random() < 0.3:
            schema["pattern"] = rng.choice([r"^[a-z]+$", r"^[0-9]{2,4}$", r"^(yes|no)$"])
            schema.pop("maxLength") if schema["pattern"] != r"^[a-z]+$" else None
        return schema
    if kind == "integer":
        low = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 5000)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 10}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, True, None], rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice(["x", 7, False])}
    if kind == "null":
        return {"type": "null"}
    if kind == "array":
        low = rng.randint(0, 2)
        return {"type": "array", "items": _random_schema(rng, depth + 1), "minItems": low, "maxItems": low + 2}
    if kind == "anyOf":
        return {"anyOf": [_random_schema(rng, depth + 1) for _ in range(rng.randint(2, 3))]}
    names = rng.sample(["a", "b", "city", "n", "ok", "items", "x_y", "Ünï"], rng.randint(1, 4))
    required = [name for name in names if rng.random() < 0.7]
    return {"type": "object", "properties": {n: _random_schema(rng, depth + 1) for n in names}, "required": required,
            "additionalProperties": False}  # fmt: skip


@pytest.mark.timeout(900)
def test_two_hundred_generated_schemas_always_parse_through_the_swarm(relay: Relay) -> None:
    rng = random.Random(20250101)
    invalid = []
    for index in range(200):
        schema = _random_schema(rng, depth=0 if index % 2 else 1)
        response_format = {
            "type": "json_schema",
            "json_schema": {"name": f"s{index}", "schema": schema, "strict": True},
        }
        (answer,) = relay.client.chat.completions.create(
            model=ALIAS, messages=CHAT, response_format=response_format, temperature=rng.choice([0, 0.7, 1.0]),
            seed=index, max_tokens=300,
        ).choices  # fmt: skip
        try:
            assert answer.finish_reason == "stop"
            jsonschema.validate(json.loads(answer.message.content), schema)
        except (AssertionError, ValueError, jsonschema.ValidationError) as error:
            invalid.append((index, schema, answer.message.content, answer.finish_reason, str(error)[:200]))
    assert invalid == []


# --- third-party clients -------------------------------------------------------------------------


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=120)


@pytest.mark.timeout(120)
def test_langchain_with_structured_output_and_bind_tools(relay: Relay) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        model=ALIAS, base_url=f"{relay.url}/v1", api_key=pydantic.SecretStr(relay.key), temperature=0,
        max_tokens=120, max_retries=0, timeout=120,
    )  # fmt: skip
    person = chat.with_structured_output(Person).invoke("Who is Ada Lovelace?")
    assert isinstance(person, Person) and 0 <= person.age <= 120
    message = chat.bind_tools([ADD], tool_choice="add").invoke("What is 2 + 3?")
    (call,) = message.tool_calls
    assert call["name"] == "add" and call["id"]
    jsonschema.validate(call["args"], ADD["function"]["parameters"])


@pytest.mark.timeout(120)
def test_the_llm_cli_with_a_schema(relay: Relay, tmp_path: Path) -> None:
    home = tmp_path / "llm"
    home.mkdir()
    (home / "extra-openai-models.yaml").write_text(
        f"- model_id: baton-tiny\n  model_name: {ALIAS}\n  api_base: {relay.url}/v1\n"
        "  api_key_name: baton\n  supports_schema: true\n"
    )
    (home / "keys.json").write_text(json.dumps({"baton": relay.key}))
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
              "rain": {"type": "boolean"}}, "required": ["city", "rain"]}  # fmt: skip
    done = subprocess.run(
        [str(Path(sys.executable).parent / "llm"), "-m", "baton-tiny", "--schema", json.dumps(schema), "--no-log",
         "-o", "temperature", "0", "-o", "max_tokens", "100", "Will it rain in Paris?"],
        env={**os.environ, "LLM_USER_PATH": str(home)}, capture_output=True, text=True, timeout=100, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    jsonschema.validate(json.loads(done.stdout), schema)


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    zip_code: str = pydantic.Field(pattern=r"^[0-9]{5}$")


class Customer(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    address: Address  # a $ref into $defs, as pydantic writes nested models


@pytest.mark.timeout(120)
def test_the_openai_parse_helper_and_an_instructor_style_forced_call_give_validated_objects(relay: Relay) -> None:
    parsed = relay.client.chat.completions.parse(
        model=ALIAS, messages=CHAT, response_format=Customer, temperature=0, max_tokens=120
    )
    customer = parsed.choices[0].message.parsed
    assert isinstance(customer, Customer) and len(customer.address.zip_code) == 5
    # instructor's TOOLS mode: the model's schema as the one tool, forced by name
    tool = {"type": "function", "function": {"name": "Customer", "description": "Correctly extracted `Customer`",
                                             "parameters": Customer.model_json_schema()}}  # fmt: skip
    response = relay.client.chat.completions.create(
        model=ALIAS, messages=CHAT, tools=[tool], tool_choice={"type": "function", "function": {"name": "Customer"}},
        temperature=0, max_tokens=120,
    )  # fmt: skip
    (call,) = response.choices[0].message.tool_calls
    assert isinstance(Customer.model_validate_json(call.function.arguments), Customer)


#: instructor's own venv (``make client-venvs``: its jiter pin cannot share the project's openai 3.x)
INSTRUCTOR_PYTHON = Path(__file__).resolve().parents[1] / "build" / "venv-instructor" / "bin" / "python"
INSTRUCTOR_SCRIPT = """
import json, os, sys
import instructor, openai, pydantic

class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    zip_code: str = pydantic.Field(pattern=r"^[0-9]{5}$")

class Customer(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    address: Address

client = instructor.from_openai(
    openai.OpenAI(base_url=os.environ["RELAY_URL"] + "/v1", api_key=os.environ["RELAY_KEY"], max_retries=0),
    mode=instructor.Mode.TOOLS,
)
customer = client.chat.completions.create(
    model=sys.argv[1], response_model=Customer, max_retries=0, temperature=0, max_tokens=120,
    messages=[{"role": "user", "content": "Extract the customer: Ann lives at 12 Rue Cler, 75007 Paris."}],
)
print(json.dumps({"type": type(customer).__name__, "value": customer.model_dump()}))
"""


@pytest.mark.timeout(180)
def test_instructor_in_its_default_tools_mode_returns_a_validated_object(relay: Relay) -> None:
    assert INSTRUCTOR_PYTHON.exists(), "instructor's venv is missing: run `make client-venvs`"
    env = {**os.environ, "RELAY_URL": relay.url, "RELAY_KEY": relay.key, "PYTHONWARNINGS": "ignore"}
    run = subprocess.run(
        [str(INSTRUCTOR_PYTHON), "-c", INSTRUCTOR_SCRIPT, ALIAS],
        capture_output=True, text=True, timeout=150, env=env, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["type"] == "Customer"
    customer = Customer.model_validate(out["value"])  # the same schema, validated here too
    assert len(customer.name) <= 10 and len(customer.address.zip_code) == 5


# --- the Responses API ---------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_responses_create_text_streamed_and_not(relay: Relay) -> None:
    response = relay.client.responses.create(model=ALIAS, input="Hello!", temperature=0, max_output_tokens=12)
    assert response.status in ("completed", "incomplete") and response.usage.output_tokens >= 1
    events = list(
        relay.client.responses.create(model=ALIAS, input="Hello!", temperature=0, max_output_tokens=12, stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == response.output_text == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


@pytest.mark.timeout(120)
def test_responses_with_a_forced_function_and_a_json_schema(relay: Relay) -> None:
    tool = {"type": "function", **ADD["function"]}
    response = relay.client.responses.create(
        model=ALIAS, input=[{"role": "user", "content": "2 + 3?"}], tools=[tool],
        tool_choice={"type": "function", "name": "add"}, temperature=0, max_output_tokens=120,
    )  # fmt: skip
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "add" and call.call_id.startswith("call_")
    _check_call("add", call.arguments)
    follow = [
        {"role": "user", "content": "2 + 3?"},
        {"type": "function_call", "call_id": call.call_id, "name": "add", "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "5"},
    ]
    stream = relay.client.responses.create(
        model=ALIAS, input=follow, tools=[tool], temperature=0, max_output_tokens=200, stream=True,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
    )  # fmt: skip
    events = list(stream)
    final = events[-1].response
    assert events[-1].type == "response.completed"
    jsonschema.validate(json.loads(final.output_text), PERSON)
    with pytest.raises(openai.BadRequestError) as caught:
        relay.client.responses.create(model=ALIAS, input="x", tools=[{"type": "web_search"}])
    assert caught.value.body["param"] == "tools[0].type"


@pytest.mark.timeout(120)
def test_each_of_n_choices_keeps_to_the_schema(relay: Relay) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    response = relay.client.chat.completions.create(
        model=ALIAS, messages=CHAT, response_format=response_format, n=3, temperature=1.0, seed=4, max_tokens=200
    )
    assert sorted(choice.index for choice in response.choices) == [0, 1, 2]
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
