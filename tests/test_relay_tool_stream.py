"""The relay's app with tools against a scripted swarm client (``tests/test_relay_app.py``'s
fakes): a model's own Hermes call in ``auto`` mode comes back as ``tool_calls`` (streamed as
``delta.tool_calls``, the text before it as content, the call's own text never shown), and text
that only looked like the start of a call is sent in the end."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from test_relay_app import FakeClient, FakeWorker

from agent.core.owner.chat_template import ChatTemplate
from agent.core.relay.quotas import KeyLimits
from agent.core.wire.worker_records import Vocabulary
from agent.io.relay.metrics import RelayMetrics
from agent.io.relay.server import build_app
from agent.io.relay.state import RelayConfig, RelayState
from agent.io.relay.store import open_relay_store
from agent.io.worker.vocab import ModelVocab

pytestmark = pytest.mark.swarm

SHA = "ab" * 32
PIECES = [
    b"",
    b"Sure",
    b" <tool",
    b"_call>",
    b'\n{"name": "add", "arguments": {"a": 1}}\n',
    b"</tool_call>",
    b"",
    b" <b>",
    b"",
    b"",  # 9: end-of-generation, as the scripted client (test_relay_app) has it
]
EOG = 9
TEMPLATE = "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}<tool_call>"
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CHAT = [{"role": "user", "content": "add"}]


class Pool:
    def __init__(self) -> None:
        vocabulary = Vocabulary(1, len(PIECES), tuple(PIECES), (0,) * len(PIECES), None, False, (EOG,))
        self.vocab = ModelVocab(
            sha256=SHA, name="x", alias="x", n_layer=4, context_length=64, vocabulary=vocabulary,
            chat_template=ChatTemplate(TEMPLATE), chat_template_error="", worker=FakeWorker(),  # type: ignore[arg-type]
            request_timeout_s=1.0,
        )  # fmt: skip

    async def get(self, sha256: str) -> ModelVocab:
        return self.vocab


@pytest.fixture
def app_parts(tmp_path: Path):
    with open_relay_store(tmp_path / "relay.db") as store:
        key = store.create_key("k", KeyLimits())
        client = FakeClient()
        config = RelayConfig(tracker="/memory/t/p2p/x", db=tmp_path / "relay.db")
        state = RelayState(config, client, store, Pool(), RelayMetrics(), now_s=lambda: 1_800_000_000.0)  # type: ignore[arg-type]
        yield build_app(state), key, client


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


@pytest.mark.timeout(30)
async def test_an_auto_call_streams_as_delta_tool_calls_and_answers_as_tool_calls(app_parts) -> None:
    app, key, client = app_parts
    client.script = [1, 2, 3, 4, 5, EOG]
    body = {"model": "tiny", "messages": CHAT, "tools": TOOLS}
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://relay") as http:
        whole = (await http.post("/v1/chat/completions", json=body, headers=headers)).json()
        streamed = await http.post("/v1/chat/completions", json={**body, "stream": True}, headers=headers)
    (choice,) = whole["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "add", "arguments": '{"a": 1}'} and call["id"].startswith("call_")
    events = _events(streamed.text)
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    calls = [c for e in events if e["choices"] for c in e["choices"][0]["delta"].get("tool_calls") or []]
    assert content == "Sure"
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [(0, "add", '{"a": 1}')]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.timeout(30)
async def test_text_that_only_looked_like_a_call_is_sent_in_the_end(app_parts) -> None:
    app, key, client = app_parts
    client.script = [1, 2, 7, EOG]  # "Sure <tool <b>": no call
    body = {"model": "tiny", "messages": CHAT, "tools": TOOLS, "stream": True}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://relay") as http:
        streamed = await http.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    events = _events(streamed.text)
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert content == "Sure <tool <b>"
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
