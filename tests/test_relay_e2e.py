"""The relay end to end: the official ``openai`` client against a real relay process over a
real three-node swarm (tracker, nodes, native workers) on loopback.

One swarm and relay are shared by this module's tests; the restart test stops and starts the
relay on the same db and port. Every process is stopped at the end (terminate, then kill), and
each test has its own timeout. Reference outputs come from one unsplit worker of the same model.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from agent.core.owner.chat_template import ChatTemplate
from agent.demo.local_demo import generate_through
from agent.demo.swarm_demo import node_memory_bytes, wait_for_coverage
from agent.harness.local_swarm import LocalSwarm, LocalSwarmConfig
from agent.io.client import open_swarm_client
from agent.io.worker.process import open_worker
from agent.models import model_path, sha256_file

pytestmark = [pytest.mark.swarm, pytest.mark.slow]

ALIAS = "smollm2"
SETUP_TIMEOUT_S = 240.0
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
# SmolLM2 answers these with CJK characters / emoji, some of whose UTF-8 bytes are split across tokens
CJK_PROMPT = "English: Hello, world!\nChinese: 你好，世界！\nEnglish: Thank you very much.\nChinese:"
EMOJI_PROMPT = "Emoji story: 🐶 meets 🐱 and they"


@dataclasses.dataclass
class Relay:
    swarm: LocalSwarm
    url: str
    key: str
    model_sha256: str
    n_layer: int
    chat_template: ChatTemplate

    clients: dict[str, openai.OpenAI] = dataclasses.field(default_factory=dict)

    def client(self, key: str | None = None) -> openai.OpenAI:
        """One client per key for the module (closed with the fixture: no socket is left to
        the garbage collector)."""
        key = key or self.key
        if key not in self.clients:
            self.clients[key] = openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=120.0)
        return self.clients[key]


async def _start(swarm: LocalSwarm) -> None:
    await swarm.start_tracker()
    async with open_swarm_client(swarm.tracker_addr) as c:
        (entry,) = [m for m in await c.list_models() if m.alias == ALIAS]
        memory = node_memory_bytes(entry.n_layer, entry.bytes_per_block, 3)
        for i in range(3):
            swarm.start_node(f"node-{i + 1}", memory)
        await wait_for_coverage(c, swarm, ALIAS, timeout_s=SETUP_TIMEOUT_S)
    await swarm.start_relay()


def _chat_template(path: Path) -> ChatTemplate:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    return ChatTemplate(str(reader.fields["tokenizer.chat_template"].contents()))


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Relay]:
    config = LocalSwarmConfig(model_path=model_path("smollm2"), model_alias=ALIAS)
    swarm = LocalSwarm(config, tmp_path_factory.mktemp("relay"))
    try:
        trio.run(_start, swarm)
        key = swarm.add_relay_key("tests")
        path = config.model_path
        running = Relay(swarm, swarm.relay_url, key, sha256_file(path), 30, _chat_template(path))
        try:
            yield running
        finally:
            for client in running.clients.values():
                client.close()
    finally:
        swarm.close_nowait()


@dataclasses.dataclass(frozen=True)
class Reference:
    prompt_tokens: list[int]
    tokens: list[int]  # greedy, an end-of-generation token that stopped it included
    text: str  # of the tokens before any end-of-generation token, piece by piece
    pieces: list[bytes]


def reference(relay: Relay, prompt: str, max_tokens: int) -> Reference:
    """Greedy tokens of one unsplit worker for ``prompt`` (tokenized as the relay does)."""

    async def run() -> Reference:
        path = relay.swarm.config.model_path
        async with open_worker(path, 0, None, threads=1, max_sequences=1, model_sha256=relay.model_sha256) as single:
            tokens = await single.client.tokenize(prompt, add_special=True, parse_special=True)
            out = await generate_through([single.client], tokens, max_tokens, stop_tokens=single.info.eog_token_ids)
            eog = set(single.info.eog_token_ids)
            shown = [t for t in out.tokens if t not in eog]
            async with open_worker(path, 0, None, vocab_only=True, model_sha256=relay.model_sha256) as vocab_worker:
                vocab = await vocab_worker.client.vocabulary()
            pieces = [vocab.pieces[t] for t in shown]
            return Reference(tokens, out.tokens, b"".join(pieces).decode("utf-8", "replace"), pieces)

    return trio.run(run)


def chat_prompt(relay: Relay, messages: list[dict]) -> str:
    return relay.chat_template.render(messages, add_generation_prompt=True)


# --- the API -----------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_models_list(relay: Relay) -> None:
    models = relay.client().models.list()
    (card,) = [m for m in models.data if m.id == ALIAS]
    extra = card.model_extra or {}
    assert extra["sha256"] == relay.model_sha256
    # the context the workers serve (2,048 positions a sequence), not the GGUF's 8,192
    assert ALIAS in extra["aliases"] and extra["n_layer"] == 30 and extra["context_length"] == 2048
    assert relay.client().models.retrieve(ALIAS).id == ALIAS


@pytest.mark.timeout(300)
def test_chat_completion_equals_one_unsplit_worker_streamed_and_not(relay: Relay) -> None:
    ref = reference(relay, chat_prompt(relay, CHAT), 24)
    client = relay.client()
    response = client.chat.completions.create(
        model=ALIAS, messages=CHAT, max_tokens=24, temperature=0, extra_body={"return_token_ids": True}
    )
    choice = response.choices[0]
    assert (choice.model_extra or {})["token_ids"] == ref.tokens
    assert choice.message.content == ref.text and choice.message.role == "assistant"
    assert choice.finish_reason == ("stop" if len(ref.tokens) < 24 else "length")
    assert response.usage.prompt_tokens == len(ref.prompt_tokens)
    assert response.usage.completion_tokens == len(ref.tokens)
    assert response.usage.total_tokens == len(ref.prompt_tokens) + len(ref.tokens)
    assert response.id.startswith("chatcmpl-") and response.model == ALIAS and response.created > 0

    stream = client.chat.completions.create(
        model=ALIAS, messages=CHAT, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.tokens)
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_tokens)


@pytest.mark.timeout(300)
def test_completion_with_a_stop_string_is_cut_exactly(relay: Relay) -> None:
    prompt = "The three primary colors are"
    ref = reference(relay, prompt, 32)
    assert len(ref.text) > 12
    stop = ref.text[5:9]  # inside the text, and may well span two tokens
    expected = ref.text[: ref.text.index(stop)]
    client = relay.client()
    response = client.completions.create(
        model=ALIAS, prompt=prompt, max_tokens=32, temperature=0, stop=[stop, "\u2603"]
    )
    assert response.choices[0].text == expected
    assert response.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=ALIAS, prompt=prompt, max_tokens=32, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected
    plain = client.completions.create(model=ALIAS, prompt=prompt, max_tokens=5, temperature=0)
    assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 5


@pytest.mark.timeout(300)
@pytest.mark.parametrize("prompt", [CJK_PROMPT, EMOJI_PROMPT], ids=["cjk", "emoji"])
def test_characters_split_across_tokens_stream_intact(relay: Relay, prompt: str) -> None:
    ref = reference(relay, prompt, 12)
    split = [p for p in ref.pieces if _not_whole_utf8(p)]
    assert split, f"the reference output {ref.text!r} splits no character across tokens: the test proves nothing"
    # the budget may end inside a character: only that last one may come out as U+FFFD
    whole = ref.text.removesuffix("\ufffd")
    assert "\ufffd" not in whole and any(ord(ch) > 0x2E80 for ch in whole)  # CJK or emoji
    client = relay.client()
    deltas = [
        c.choices[0].text
        for c in client.completions.create(model=ALIAS, prompt=prompt, max_tokens=12, temperature=0, stream=True)
        if c.choices
    ]
    assert "".join(deltas) == ref.text
    assert "\ufffd" not in "".join(deltas).removesuffix("\ufffd")
    response = client.completions.create(model=ALIAS, prompt=prompt, max_tokens=12, temperature=0)
    assert response.choices[0].text == ref.text


def _not_whole_utf8(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


@pytest.mark.timeout(300)
def test_seeded_sampling_is_reproducible_and_logprobs_come_back(relay: Relay) -> None:
    client = relay.client()

    def sample(seed: int):
        return client.chat.completions.create(
            model=ALIAS, messages=CHAT, max_tokens=16, temperature=0.9, top_p=0.95, seed=seed,
            logprobs=True, top_logprobs=3, extra_body={"top_k": 40, "return_token_ids": True},
        )  # fmt: skip

    first, again = sample(7), sample(7)
    assert (first.choices[0].model_extra or {})["token_ids"] == (again.choices[0].model_extra or {})["token_ids"]
    assert first.choices[0].message.content == again.choices[0].message.content
    content = first.choices[0].logprobs.content
    assert len(content) == first.usage.completion_tokens - (first.choices[0].finish_reason == "stop")
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-9
    # no top-k cut, hot: the last hop draws from its whole row, and a token outside the top-K it
    # returns still has its log-probability (the drawn token's own)
    free = client.chat.completions.create(
        model=ALIAS, messages=CHAT, max_tokens=16, temperature=1.8, seed=3, logprobs=True, top_logprobs=2
    )
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in free.choices[0].logprobs.content)


@pytest.mark.timeout(300)
def test_a_prompt_over_the_workers_batch_and_one_reaching_the_context_finish_cleanly(relay: Relay) -> None:
    client = relay.client()
    # ~1,500 tokens: three prefill chunks of at most 512 rows (the workers' batch), not a refusal
    long = client.completions.create(model=ALIAS, prompt="one two three four five " * 300, max_tokens=4, temperature=0)
    assert long.usage.prompt_tokens > 1400 and long.usage.completion_tokens == 4
    assert long.choices[0].finish_reason == "length"
    # 1,986 tokens of counting (the model goes on counting) and 200 more asked: the workers
    # hold 2,048 positions per sequence
    counting = ", ".join(str(i) for i in range(1, 420)) + ","
    full = client.completions.create(model=ALIAS, prompt=counting, max_tokens=200, temperature=0)
    assert full.usage.prompt_tokens == 1986
    assert full.usage.prompt_tokens + full.usage.completion_tokens == 2048 + 1  # the last token is never forwarded
    assert full.choices[0].finish_reason == "length"


# --- errors ------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_json_schema_answers_of_a_real_model_parse(relay: Relay) -> None:
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}}, "required": ["capital"]}
    response = relay.client().chat.completions.create(
        model=ALIAS, messages=CHAT, temperature=0, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
    )  # fmt: skip
    (answer,) = response.choices
    assert answer.finish_reason == "stop"
    assert set(json.loads(answer.message.content)) == {"capital"}


def _status_and_error(call) -> tuple[int, dict]:
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    body = caught.value.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return caught.value.status_code, body["error"]


@pytest.mark.timeout(300)
def test_errors_use_openai_envelopes_and_the_relay_keeps_serving(relay: Relay) -> None:
    def chat(client: openai.OpenAI, **fields):
        return lambda: client.chat.completions.create(**{"model": ALIAS, "messages": CHAT, "max_tokens": 2, **fields})

    status, error = _status_and_error(chat(relay.client(key="sk-baton-not-a-key")))
    assert status == 401
    anonymous = httpx.post(f"{relay.url}/v1/chat/completions", json={"model": ALIAS, "messages": CHAT}, timeout=30)
    assert anonymous.status_code == 401 and "API key" in anonymous.json()["error"]["message"]

    revoked = relay.swarm.add_relay_key("revoked")
    _run_cli(relay, "keys", "revoke", "revoked")
    status, error = _status_and_error(chat(relay.client(key=revoked)))
    assert status == 401 and "revoked" in error["message"]

    status, error = _status_and_error(chat(relay.client(), n=9))  # over the relay's max_choices (8)
    assert status == 400 and error["param"] == "n"
    # SmolLM2's chat template never shows tools to the model
    status, error = _status_and_error(chat(relay.client(), tools=[{"type": "function", "function": {"name": "f"}}]))
    assert status == 400 and error["param"] == "tools" and "template" in error["message"]
    status, error = _status_and_error(chat(relay.client(), model="no-such-model"))
    assert status == 404 and error["code"] == "model_not_found"
    bad = httpx.post(
        f"{relay.url}/v1/chat/completions", content=b'{"model": "smollm2", "messages": [',
        headers={"Authorization": f"Bearer {relay.key}", "Content-Type": "application/json"}, timeout=30,
    )  # fmt: skip
    assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
    huge = httpx.post(
        f"{relay.url}/v1/completions", content=b"x" * (2 << 20),
        headers={"Authorization": f"Bearer {relay.key}"}, timeout=30,
    )  # fmt: skip
    assert huge.status_code == 413 and huge.json()["error"]["type"] == "invalid_request_error"

    small = relay.swarm.add_relay_key("small", tokens_per_day=20)
    client = relay.client(key=small)
    client.completions.create(model=ALIAS, prompt="Hello there, how are you today?", max_tokens=16, temperature=0)
    with pytest.raises(openai.RateLimitError) as caught:
        client.completions.create(model=ALIAS, prompt="Again", max_tokens=2, temperature=0)
    assert "tokens_per_day" in caught.value.response.json()["error"]["message"]
    assert int(caught.value.response.headers["retry-after"]) >= 1

    one = relay.swarm.add_relay_key("one-at-a-time", max_concurrent=1)
    client = relay.client(key=one)
    stream = client.completions.create(model=ALIAS, prompt="Count: 1, 2, 3,", max_tokens=40, temperature=0, stream=True)
    next(iter(stream))  # the first one is running
    with pytest.raises(openai.RateLimitError) as caught:
        client.completions.create(model=ALIAS, prompt="Again", max_tokens=2, temperature=0)
    assert "max_concurrent" in caught.value.response.json()["error"]["message"]
    stream.close()

    ok = relay.client().completions.create(model=ALIAS, prompt="Still serving?", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens == 3


def _run_cli(relay: Relay, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "agent.cli", "relay", *args, "--db", str(relay.swarm.relay_db_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout


# --- sessions ----------------------------------------------------------------------------------------


async def _live_sessions(relay: Relay) -> dict[tuple[str, int, int], int]:
    async with open_swarm_client(relay.swarm.tracker_addr) as c:
        return {
            (n.peer_id, s.assignment.begin, s.assignment.end): s.sequences_in_use
            for n in await c.list_nodes()
            for s in n.serving
        }


async def _wait_sessions(relay: Relay, predicate, timeout_s: float) -> dict:
    """Poll the nodes' own reports (their heartbeats, through the tracker) until ``predicate``."""
    seen: dict = {}
    with trio.move_on_after(timeout_s):
        while True:
            seen = await _live_sessions(relay)
            if seen and predicate(seen):
                return seen
            await trio.sleep(0.2)
    raise AssertionError(f"the nodes did not report the expected sessions within {timeout_s} s: {seen}")


@pytest.mark.timeout(300)
def test_a_dropped_stream_frees_its_sequence_on_every_hop(relay: Relay) -> None:
    trio.run(_wait_sessions, relay, lambda s: all(v == 0 for v in s.values()), 30.0)
    client = relay.client()
    streams = [
        client.completions.create(
            model=ALIAS, prompt=f"Story {i}: once upon a time", max_tokens=200, temperature=0, stream=True
        )
        for i in range(2)
    ]
    for stream in streams:
        next(iter(stream))
    during = trio.run(_wait_sessions, relay, lambda s: len(s) == 3 and all(v >= 1 for v in s.values()), 30.0)
    assert len(during) == 3
    for stream in streams:
        stream.close()  # the client goes away mid-generation
    # well before the nodes' 300 s idle timeout: the relay ended the sessions on every hop
    trio.run(_wait_sessions, relay, lambda s: all(v == 0 for v in s.values()), 15.0)


@pytest.mark.timeout(400)
def test_eight_concurrent_streams_all_complete_correctly(relay: Relay) -> None:
    prompts = [f"Fact number {i}: the sun" for i in range(8)]
    refs = {p: reference(relay, p, 12) for p in prompts[:2]}
    client = relay.client()

    def run(prompt: str) -> tuple[str, str]:
        stream = client.completions.create(model=ALIAS, prompt=prompt, max_tokens=12, temperature=0, stream=True)
        text = "".join(c.choices[0].text for c in stream if c.choices)
        whole = client.completions.create(model=ALIAS, prompt=prompt, max_tokens=12, temperature=0)
        return text, whole.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = dict(zip(prompts, pool.map(run, prompts)))
    for prompt, (streamed, whole) in results.items():
        assert streamed == whole, prompt
        if prompt in refs:
            assert streamed == refs[prompt].text


# --- ledger, restart, status page, metrics -----------------------------------------------------------


def _ledger(relay: Relay) -> dict[str, tuple[int, float]]:
    rows = json.loads(_run_cli(relay, "ledger", "--json"))
    return {r["peer_id"]: (r["rows"], r["credit"]) for r in rows}


@pytest.mark.timeout(300)
def test_the_ledger_credits_each_node_with_its_rows_and_survives_a_restart(relay: Relay) -> None:
    before = _ledger(relay)
    client = relay.client()
    response = client.completions.create(model=ALIAS, prompt="Ledger check:", max_tokens=6, temperature=0)
    after = _ledger(relay)
    # every hop processed the prompt at step 0, then one row per further step
    rows = response.usage.prompt_tokens + response.usage.completion_tokens - 1
    nodes = {proc.peer_id for proc in relay.swarm.nodes.values()}
    assert set(after) == nodes
    for peer in nodes:
        old_rows, _old_credit = before.get(peer, (0, 0.0))
        assert after[peer][0] - old_rows == rows
    assert sum(c for _r, c in after.values()) - sum(c for _r, c in before.values()) == pytest.approx(rows)
    keys_before = json.loads(_run_cli(relay, "keys", "list", "--json"))

    trio.run(relay.swarm.stop_relay)
    url = trio.run(relay.swarm.start_relay)
    assert url == relay.url
    assert _ledger(relay) == after
    assert json.loads(_run_cli(relay, "keys", "list", "--json")) == keys_before
    again = relay.client().completions.create(model=ALIAS, prompt="Ledger check:", max_tokens=6, temperature=0)
    assert again.choices[0].text == response.choices[0].text


@pytest.mark.timeout(200)
async def test_the_status_page_renders_in_chromium_with_every_node(relay: Relay, tmp_path: Path) -> None:
    from agent.harness.browser import chromium_available, dump_dom, screenshot

    if not chromium_available():
        pytest.skip("Debian's chromium is not installed (make deps installs it)")
    dom = await dump_dom(f"{relay.url}/", timeout_s=60)
    for name, proc in relay.swarm.nodes.items():
        assert proc.peer_id in dom, name
    for begin, end in ((0, 10), (10, 20), (20, 30)):
        assert f"[{begin}, {end})" in dom
    shot = tmp_path / "status.png"
    await screenshot(f"{relay.url}/", shot, width=1200, height=900, timeout_s=60)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(120)
def test_metrics_parse_as_prometheus_text(relay: Relay) -> None:
    relay.client().completions.create(model=ALIAS, prompt="Metrics:", max_tokens=3, temperature=0)
    text = httpx.get(f"{relay.url}/metrics", timeout=30).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert "baton_relay_requests" in families and "baton_relay_time_to_first_token_seconds" in families
    requests = {
        (s.labels.get("endpoint"), s.labels.get("status")): s.value
        for s in families["baton_relay_requests"].samples
        if s.name.endswith("_total")
    }
    assert requests[("/v1/completions", "200")] >= 1
