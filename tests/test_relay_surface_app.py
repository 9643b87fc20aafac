"""The relay's wider OpenAI surface against the fakes of ``test_relay_app`` (its scripted swarm
client and vocabulary): ``n`` and lists of prompts, ``echo``, sampling options reaching the
sampler, the served context, ``x-request-id``, unknown paths, and the tokenizer endpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_relay_app import EOG, SHA, FakeClient, FakePool, _http

from agent._proto import swarm_pb2
from agent.core.relay.quotas import KeyLimits
from agent.io.relay.metrics import RelayMetrics
from agent.io.relay.server import build_app
from agent.io.relay.state import RelayConfig, RelayState
from agent.io.relay.store import open_relay_store

pytestmark = pytest.mark.swarm


@pytest.fixture
def parts(tmp_path: Path):
    """As ``test_relay_app``'s: the app over a scripted client, a key, the client, the state."""
    with open_relay_store(tmp_path / "relay.db") as store:
        key = store.create_key("k", KeyLimits())
        client = FakeClient()
        config = RelayConfig(tracker="/memory/t/p2p/x", db=tmp_path / "relay.db")
        state = RelayState(config, client, store, FakePool(), RelayMetrics(), now_s=lambda: 1_800_000_000.0)  # type: ignore[arg-type]
        yield build_app(state), key, client, state


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.timeout(30)
async def test_every_answer_has_a_request_id_and_an_unknown_path_is_not_a_missing_model(parts) -> None:
    app, key, _client, _state = parts
    async with _http(app) as http:
        ok = await http.get("/v1/models", headers=_auth(key))
        refused = await http.get("/v1/models", headers=_auth("sk-wrong"))
        unknown = await http.post("/v1/embeddings", headers=_auth(key), json={})
        mine = await http.get("/health", headers={"x-request-id": "trace-42"})
    for reply in (ok, refused, unknown):
        assert reply.headers["x-request-id"].startswith("req_") and len(reply.headers["x-request-id"]) == 36
    assert len({ok.headers["x-request-id"], refused.headers["x-request-id"]}) == 2
    assert mine.headers["x-request-id"] == "trace-42"
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "unknown_url"
    assert "/v1/embeddings" in unknown.json()["error"]["message"]


@pytest.mark.timeout(30)
async def test_n_choices_each_a_session_with_its_own_seed_streamed_and_not(parts) -> None:
    app, key, client, _state = parts
    seen: list[dict] = []
    generate = client.generate_tokens

    async def recording(model, prompt_tokens, **kwargs):
        seen.append(kwargs)
        return await generate(model, prompt_tokens, **kwargs)

    client.generate_tokens = recording
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 3, "seed": 5, "max_tokens": 8}
    async with _http(app) as http:
        reply = await http.post("/v1/chat/completions", headers=_auth(key), json=body)
        async with http.stream("POST", "/v1/chat/completions", headers=_auth(key), json={**body, "stream": True,
                               "stream_options": {"include_usage": True}}) as stream:  # fmt: skip
            events = [json.loads(line[6:]) async for line in stream.aiter_lines() if line.startswith("data: {")]
        too_many = await http.post("/v1/chat/completions", headers=_auth(key), json={**body, "n": 9})
        after = await http.post("/v1/chat/completions", headers=_auth(key), json={**body, "n": 1})
    answer = reply.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == "Hello world!" for c in answer["choices"])
    assert answer["usage"] == {
        "prompt_tokens": 1,
        "completion_tokens": 15,
        "total_tokens": 16,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert sorted(kwargs["seed"] for kwargs in seen[:3]) == [5, 6, 7]  # (started in any order)
    by_index: dict[int, str] = {}
    for event in events:
        for choice in event["choices"]:
            by_index[choice["index"]] = by_index.get(choice["index"], "") + (choice["delta"].get("content") or "")
    assert by_index == {0: "Hello world!", 1: "Hello world!", 2: "Hello world!"}
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["stop"] * 3 and events[-1]["usage"]["completion_tokens"] == 15
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
    assert after.status_code == 200  # the relay serves on


@pytest.mark.timeout(30)
async def test_a_list_of_prompts_echo_and_sampling_options_reach_the_sampler(parts) -> None:
    app, key, client, _state = parts
    seen: list[dict] = []
    generate = client.generate_tokens

    async def recording(model, prompt_tokens, **kwargs):
        seen.append(kwargs)
        return await generate(model, prompt_tokens, **kwargs)

    client.generate_tokens = recording
    body = {
        "model": "tiny", "prompt": ["one two", [1, 2]], "echo": True, "max_tokens": 8, "presence_penalty": 0.5,
        "frequency_penalty": 0.25, "logit_bias": {"4": -100}, "min_p": 0.1, "repeat_penalty": 1.2, "ignore_eos": True,
    }  # fmt: skip
    async with _http(app) as http:
        reply = await http.post("/v1/completions", headers=_auth(key), json=body)
        outside = await http.post("/v1/completions", headers=_auth(key), json={**body, "logit_bias": {"99": 1}})
    answer = reply.json()
    assert reply.status_code == 200, answer
    texts = [c["text"] for c in answer["choices"]]
    assert texts == ["one twoHello world!", "Hello worHello world!"]  # the prompt (its text, or its tokens' pieces)
    sampling = seen[0]["sampling"]
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.min_p) == (0.5, 0.25, 0.1)
    assert sampling.logit_bias == ((4, -100.0),) and sampling.repeat_penalty == 1.2
    assert seen[0]["stop_tokens"] == []  # ignore_eos: an end-of-generation token does not end it
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "logit_bias"


@pytest.mark.timeout(30)
async def test_the_served_context_is_reported_and_a_longer_prompt_refused_at_once(parts) -> None:
    app, key, client, _state = parts
    status = swarm_pb2.AssignmentStatus(
        assignment=swarm_pb2.Assignment(model_sha256=SHA, begin=0, end=4), state=swarm_pb2.AssignmentStatus.READY,
        n_ctx_per_sequence=8,
    )  # fmt: skip

    async def list_nodes():
        return [swarm_pb2.NodeEntry(alive=True, serving=[status])]

    client.list_nodes = list_nodes
    async with _http(app) as http:
        models = (await http.get("/v1/models", headers=_auth(key))).json()["data"]
        long = await http.post(
            "/v1/completions", headers=_auth(key), json={"model": "tiny", "prompt": "a " * 9, "max_tokens": 2}
        )
        fits = await http.post(
            "/v1/completions", headers=_auth(key), json={"model": "tiny", "prompt": "a " * 6, "max_tokens": 16}
        )
    tiny = next(m for m in models if m["id"] == "tiny")
    assert tiny["context_length"] == 8 and tiny["max_model_len"] == 8
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
    assert client.generations == 1  # the long prompt never reached the swarm
    assert fits.json()["usage"]["completion_tokens"] == 3  # 6 + 3 = 8 positions + the one never forwarded


@pytest.mark.timeout(30)
async def test_tokenize_detokenize_and_tokenizer_info_as_vllm_and_llama_cpp_answer(parts) -> None:
    app, key, _client, _state = parts
    async with _http(app) as http:
        vllm = await http.post("/tokenize", headers=_auth(key), json={"model": "tiny", "prompt": "a b c"})
        llama = await http.post("/tokenize", headers=_auth(key),
                                json={"model": "tiny", "content": "x y", "with_pieces": True})  # fmt: skip
        chat = await http.post("/tokenize", headers=_auth(key),
                               json={"model": "tiny", "messages": [{"role": "user", "content": "p q"}]})  # fmt: skip
        back = await http.post("/detokenize", headers=_auth(key), json={"model": "tiny", "tokens": [1, 2, 3, 7, 8]})
        bad = await http.post("/detokenize", headers=_auth(key), json={"model": "tiny", "tokens": [1, 99]})
        no_model = await http.post("/tokenize", headers=_auth(key), json={"prompt": "a"})  # two models here
        info = await http.get("/tokenizer_info", headers=_auth(key), params={"model": "tiny"})
    assert vllm.json() == {"tokens": [1, 1, 1], "count": 3, "max_model_len": 64, "token_strs": None}
    assert llama.json()["tokens"] == [{"id": 1, "piece": "Hello"}, {"id": 1, "piece": "Hello"}]
    assert chat.json()["count"] == 2
    assert back.json() == {"prompt": "Hello world\u00e9", "content": "Hello world\u00e9"}
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert no_model.status_code == 400 and no_model.json()["error"]["param"] == "model"
    assert info.status_code == 200 and info.json()["model_max_length"] == 64 and info.json()["vocab_size"] == 10
    assert EOG == 9


@pytest.mark.timeout(30)
async def test_a_streamed_echo_starts_with_the_prompt_and_a_list_of_prompts_streams_each_choice(parts) -> None:
    app, key, _client, _state = parts
    body = {"model": "tiny", "prompt": ["one two", "three"], "echo": True, "stream": True, "max_tokens": 8}
    async with _http(app) as http:
        async with http.stream("POST", "/v1/completions", headers=_auth(key), json=body) as stream:
            events = [json.loads(line[6:]) async for line in stream.aiter_lines() if line.startswith("data: {")]
    texts: dict[int, str] = {}
    for event in events:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "one twoHello world!", 1: "threeHello world!"}
