"""The relay's app against fakes of its swarm side (agent.io.relay.server.build_app): the error
paths that a healthy three-node swarm cannot show, over real HTTP semantics (httpx's ASGI
transport), a real SQLite store and real metrics.

The fake swarm client implements the ``SwarmClient`` methods the relay uses; its generations
are scripted token by token.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import trio
import trio.lowlevel
from prometheus_client.parser import text_string_to_metric_families

from agent._proto import swarm_pb2
from agent.core.owner.chat_template import ChatTemplate
from agent.core.relay.quotas import KeyLimits
from agent.core.wire.worker_records import Vocabulary
from agent.io.client import GenerationError, GenerationResult, SwarmError
from agent.io.relay.metrics import RelayMetrics
from agent.io.relay.server import build_app
from agent.io.relay.state import RelayConfig, RelayState
from agent.io.relay.store import open_relay_store
from agent.io.worker.vocab import ModelVocab

pytestmark = pytest.mark.swarm

SHA = "ab" * 32
# token id -> bytes; 7 and 8 are the two halves of "é" (c3 a9); 9 is end-of-generation
PIECES = [b"", b"Hello", b" wor", b"ld", b"!", b" and", b" more", b"\xc3", b"\xa9", b""]
EOG = 9


@dataclasses.dataclass
class FakeWorker:
    async def tokenize(self, text: str, **_kwargs) -> list[int]:
        return [1] * max(1, len(text.split()))


class FakeClient:
    """Scripted generations; ``fail`` makes the next generation raise it."""

    peer_id = "12D3KooWFakeRelay"

    def __init__(self) -> None:
        self.script = [1, 2, 3, 4, EOG]
        self.fail: BaseException | None = None
        self.generations = 0
        self.cached_tokens = 0  # what each generation says the hops' prefix caches held
        self.prefix_salts: list[bytes | None] = []  # each generation's, as the relay named it

    async def list_models(self) -> list[swarm_pb2.ModelEntry]:
        return [
            swarm_pb2.ModelEntry(sha256=SHA, alias="tiny", name="Tiny", n_layer=4, context_length=64),
            swarm_pb2.ModelEntry(sha256="cd" * 32, alias="plain", name="Plain", n_layer=4, context_length=64),
        ]

    async def list_nodes(self) -> list[swarm_pb2.NodeEntry]:
        return []

    async def generate_tokens(
        self, model, prompt_tokens, *, max_tokens, on_token, prefix_salt=None, **_kwargs
    ) -> GenerationResult:
        self.generations += 1
        self.prefix_salts.append(prefix_salt)
        if self.fail is not None:
            raise self.fail
        tokens: list[int] = []
        logits = np.zeros(len(PIECES), dtype=np.float32)
        stopped = False
        for token in self.script[:max_tokens]:
            tokens.append(token)
            if await on_token(token, logits, None):
                stopped = True
                break
            if token == EOG:
                break
        return GenerationResult(
            text="", tokens=tokens, prompt_tokens=list(prompt_tokens), route=[], model_sha256=model, prefill_s=0.0,
            decode_s=0.0, decode_steps=0, stopped_by_token=bool(tokens) and tokens[-1] == EOG and not stopped,
            hop_rows=[{"node": "n1", "begin": 0, "end": 4, "rows": len(prompt_tokens) + len(tokens) - 1}],
            stopped_by_caller=stopped, cached_tokens=self.cached_tokens,
        )  # fmt: skip


class FakePool:
    def __init__(self) -> None:
        vocabulary = Vocabulary(
            schema_version=1, n_vocab=len(PIECES), pieces=tuple(PIECES), attrs=(0,) * len(PIECES), bos_token_id=None,
            add_bos=False, eog_token_ids=(EOG,),
        )  # fmt: skip

        def vocab(sha: str, template: ChatTemplate | None) -> ModelVocab:
            return ModelVocab(
                sha256=sha, name="x", alias="x", n_layer=4, context_length=64, vocabulary=vocabulary,
                chat_template=template, chat_template_error="" if template else "the model's GGUF has no chat template",
                worker=FakeWorker(), request_timeout_s=1.0,  # type: ignore[arg-type]
            )  # fmt: skip

        self.vocabs = {
            SHA: vocab(SHA, ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")),
            "cd" * 32: vocab("cd" * 32, None),
        }

    async def get(self, sha256: str) -> ModelVocab:
        return self.vocabs[sha256]


@pytest.fixture
def app_parts(tmp_path: Path):
    with open_relay_store(tmp_path / "relay.db") as store:
        key = store.create_key("k", KeyLimits())
        client = FakeClient()
        config = RelayConfig(tracker="/memory/t/p2p/x", db=tmp_path / "relay.db", anonymous_tokens_per_day=12)
        state = RelayState(config, client, store, FakePool(), RelayMetrics(), now_s=lambda: 1_800_000_000.0)  # type: ignore[arg-type]
        yield build_app(state), key, client, state


def _http(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://relay")


@pytest.mark.timeout(30)
async def test_a_model_without_a_chat_template_gets_a_clear_400(app_parts) -> None:
    app, key, _client, _state = app_parts
    async with _http(app) as http:
        reply = await http.post(
            "/v1/chat/completions", json={"model": "plain", "messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": f"Bearer {key}"},
        )  # fmt: skip
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert "chat template" in error["message"] and error["param"] == "messages"


@pytest.mark.timeout(30)
async def test_cached_prompt_tokens_are_reported_as_openai_does(app_parts) -> None:
    app, key, client, _state = app_parts
    client.cached_tokens = 2
    headers = {"Authorization": f"Bearer {key}"}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "a b c"}], "max_tokens": 3}
    async with _http(app) as http:
        completion = await http.post("/v1/completions", json={"model": "tiny", "prompt": "a b c"}, headers=headers)
        answer = await http.post("/v1/chat/completions", json=chat, headers=headers)
        two = await http.post("/v1/completions", json={"model": "tiny", "prompt": "a b", "n": 2}, headers=headers)
        streamed = await http.post(
            "/v1/chat/completions", json={**chat, "stream": True, "stream_options": {"include_usage": True}},
            headers=headers,
        )  # fmt: skip
    for reply in (completion, answer, two):
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}  # (one prompt: counted once)
    usages = [json.loads(line[6:]).get("usage") for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert [u for u in usages if u] and [u for u in usages if u][-1]["prompt_tokens_details"] == {"cached_tokens": 2}


@pytest.mark.timeout(30)
async def test_each_key_s_prompts_get_its_own_prefix_salt_unless_it_is_shareable(app_parts) -> None:
    app, key, client, state = app_parts
    other = state.store.create_key("other", KeyLimits())
    shared = [state.store.create_key(f"public-{i}", KeyLimits(), shareable_prefixes=True) for i in range(2)]
    salts: dict[str, bytes | None] = {}
    async with _http(app) as http:
        for name, api_key in [("k", key), ("k again", key), ("other", other), ("public-0", shared[0]),
                              ("public-1", shared[1]), ("anonymous", None)]:  # fmt: skip
            headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
            reply = await http.post("/v1/completions", json={"model": "tiny", "prompt": "a b"}, headers=headers)
            assert reply.status_code == 200, reply.text
            salts[name] = client.prefix_salts[-1]
    assert all(isinstance(salt, bytes) and len(salt) == 32 for salt in salts.values())
    assert salts["k"] == salts["k again"]  # a key reuses its own cached prefixes
    assert salts["public-0"] == salts["public-1"]  # shareable keys share theirs
    assert len({salts[name] for name in ("k", "other", "public-0", "anonymous")}) == 4  # and no one else's
    # marked private again: its own salt from its next request
    assert state.store.set_shareable_prefixes("public-1", False)
    async with _http(app) as http:
        reply = await http.post(
            "/v1/completions", json={"model": "tiny", "prompt": "a b"}, headers={"Authorization": f"Bearer {shared[1]}"}
        )
    assert reply.status_code == 200 and client.prefix_salts[-1] not in salts.values()


@pytest.mark.timeout(30)
async def test_a_stop_string_across_tokens_ends_the_generation_there(app_parts) -> None:
    app, key, client, _state = app_parts
    client.script = [1, 2, 3, 4, 5, 6, EOG]
    async with _http(app) as http:
        reply = await http.post(
            "/v1/completions", json={"model": "tiny", "prompt": "x", "stop": "orld!", "max_tokens": 10},
            headers={"Authorization": f"Bearer {key}"},
        )  # fmt: skip
    body = reply.json()
    assert reply.status_code == 200, body
    assert body["choices"][0]["text"] == "Hello w" and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 4  # the generation stopped at the token that completed it


@pytest.mark.timeout(30)
async def test_a_character_split_across_two_tokens_streams_whole(app_parts) -> None:
    app, key, client, _state = app_parts
    client.script = [1, 7, 8, 4, EOG]
    async with _http(app) as http:
        async with http.stream(
            "POST", "/v1/completions", json={"model": "tiny", "prompt": "x", "stream": True, "max_tokens": 10},
            headers={"Authorization": f"Bearer {key}"},
        ) as reply:  # fmt: skip
            lines = [line async for line in reply.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1] if json.loads(line[6:])["choices"]]
    assert "".join(texts) == "Helloé!" and "é" in texts  # never half of it


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "failure, status",
    [
        (SwarmError("t", swarm_pb2.Error.UNAVAILABLE, "blocks [10, 20) have no ready node"), 503),
        (GenerationError("no result for step 3 within 30 s"), 504),
        (GenerationError("busy", failed_peer_id="p", step=0, code=swarm_pb2.Error.RESOURCE_EXHAUSTED), 503),
        (GenerationError("hop p failed", failed_peer_id="p", step=2, code=swarm_pb2.Error.INTERNAL), 503),
    ],
)
async def test_swarm_failures_map_to_503_and_504(app_parts, failure: BaseException, status: int) -> None:
    app, key, client, _state = app_parts
    client.fail = failure
    async with _http(app) as http:
        reply = await http.post(
            "/v1/completions", json={"model": "tiny", "prompt": "x"}, headers={"Authorization": f"Bearer {key}"}
        )
        assert reply.status_code == status
        assert reply.json()["error"]["type"] == "server_error"
        client.fail = None
        again = await http.post(
            "/v1/completions", json={"model": "tiny", "prompt": "x"}, headers={"Authorization": f"Bearer {key}"}
        )
    assert again.status_code == 200  # the relay keeps serving


@pytest.mark.timeout(30)
async def test_a_lone_surrogate_or_a_too_deep_body_is_400_and_the_relay_serves_on(app_parts) -> None:
    app, key, _client, _state = app_parts
    auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    async with _http(app) as http:
        reply = await http.post(
            "/v1/chat/completions", headers=auth,
            content=b'{"model": "tiny", "messages": [{"role": "user", "content": "hi \\ud800"}]}',
        )  # fmt: skip
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == "messages[0].content" and "lone surrogate" in error["message"], error
        deep = await http.post("/v1/completions", headers=auth, content=b"[" * 100_000 + b"]" * 100_000)
        assert deep.status_code == 400 and "nested too deeply" in deep.json()["error"]["message"], deep.text
        again = await http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, headers=auth)
        assert again.status_code == 200, again.text


@pytest.mark.timeout(30)
async def test_a_body_that_trickles_past_its_timeout_is_408_and_the_relay_serves_on(app_parts, autojump_clock) -> None:
    """A client that sends its headers and then part of its body (or nothing) holds its
    request for ``body_timeout_s`` at most (trio's MockClock jumps to the deadline)."""
    app, key, _client, state = app_parts
    assert state.config.body_timeout_s == 30.0  # the default
    auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json", "Content-Length": "200"}

    async def trickle():
        yield b'{"model": "tiny", '
        await trio.sleep_forever()

    async with _http(app) as http:
        started = trio.current_time()
        reply = await http.post("/v1/completions", headers=auth, content=trickle())
        assert reply.status_code == 408, reply.text
        assert trio.current_time() - started == pytest.approx(30.0, abs=1.0)
        error = reply.json()["error"]
        assert error["code"] == "request_timeout", error
        assert error["message"] == "The request body did not arrive within 30 s (18 bytes of 200 came).", error
        again = await http.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": "x", "max_tokens": 2},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert again.status_code == 200, again.text


@pytest.mark.timeout(30)
async def test_a_prompt_over_the_context_is_400(app_parts) -> None:
    app, key, _client, _state = app_parts
    async with _http(app) as http:
        reply = await http.post(
            "/v1/completions", json={"model": "tiny", "prompt": "w " * 80}, headers={"Authorization": f"Bearer {key}"}
        )
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.timeout(30)
async def test_anonymous_access_within_its_daily_tokens_then_429(app_parts) -> None:
    app, _key, client, _state = app_parts
    async with _http(app) as http:
        first = await http.post("/v1/completions", json={"model": "tiny", "prompt": "a b c d e f"})
        assert first.status_code == 200 and first.json()["usage"]["total_tokens"] == 11
        # 1 of 12 left: a prompt of one token leaves none to generate, so it is refused, not run
        second = await http.post("/v1/completions", json={"model": "tiny", "prompt": "a"})
    assert second.status_code == 429 and int(second.headers["retry-after"]) >= 1
    message = second.json()["error"]["message"]
    assert "tokens_per_day" in message and "needs at least 2 tokens" in message and "1 are left" in message
    assert client.generations == 1


@pytest.mark.timeout(30)
async def test_max_tokens_is_capped_by_the_tokens_the_key_has_left(app_parts) -> None:
    app, _key, client, state = app_parts
    client.script = [1, 2, 3, 4, 5, 6, 2, 3, 4, EOG]
    async with _http(app) as http:
        # 12 a day, a prompt of 6: at most 6 generated although 100 were asked for
        reply = await http.post("/v1/completions", json={"model": "tiny", "prompt": "a b c d e f", "max_tokens": 100})
    assert reply.status_code == 200 and reply.json()["usage"] == {
        "prompt_tokens": 6, "completion_tokens": 6, "total_tokens": 12, "prompt_tokens_details": {"cached_tokens": 0},
    }  # fmt: skip
    assert reply.json()["choices"][0]["finish_reason"] == "length"
    assert state.store.tokens_on("anonymous", "2027-01-15") == 12 and state.reserved == {}


class GatedClient(FakeClient):
    """Generates without end, one token each time the test lets it (``allow``)."""

    def __init__(self) -> None:
        super().__init__()
        self.allowed = trio.Semaphore(0)
        self.generated = 0

    async def generate_tokens(self, model, prompt_tokens, *, max_tokens, on_token, **_kwargs) -> GenerationResult:
        logits = np.zeros(len(PIECES), dtype=np.float32)
        for i in range(max_tokens):
            await self.allowed.acquire()
            self.generated += 1
            await on_token(1 + i % 4, logits, None)
        raise AssertionError("the client's stream was meant to end first")


@pytest.mark.timeout(60)
async def test_a_stream_the_client_closes_is_charged_the_tokens_it_was_sent(tmp_path: Path) -> None:
    from hypercorn.config import Config as HypercornConfig
    from hypercorn.trio import serve

    with open_relay_store(tmp_path / "relay.db") as store:
        key = store.create_key("k", KeyLimits(tokens_per_day=300))
        client = GatedClient()
        config = RelayConfig(tracker="/memory/t/p2p/x", db=tmp_path / "relay.db")
        state = RelayState(config, client, store, FakePool(), RelayMetrics(), now_s=lambda: 1_800_000_000.0)  # type: ignore[arg-type]
        hyper = HypercornConfig()
        hyper.bind = ["127.0.0.1:0"]
        hyper.accesslog = None
        async with trio.open_nursery() as nursery:
            (url,) = await nursery.start(lambda task_status: serve(build_app(state), hyper, task_status=task_status))  # type: ignore[arg-type]
            request = {"model": "tiny", "prompt": "a b c", "max_tokens": 195, "stream": True}
            for round_ in range(3):  # three streams of 10 tokens each, every one closed by the client
                # a raw socket, as a client that closes mid-stream (or an attacker) has one
                host, port = url.removeprefix("http://").rsplit(":", 1)
                stream = await trio.open_tcp_stream(host, int(port))
                body = json.dumps(request).encode()
                await stream.send_all(
                    b"POST /v1/completions HTTP/1.1\r\nhost: relay\r\ncontent-type: application/json\r\n"
                    + f"authorization: Bearer {key}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                client.allowed.release()  # the headers go out with the first token
                seen = b""
                with trio.fail_after(10):
                    while seen.count(b"data: {") < 10:
                        chunk = await stream.receive_some()
                        assert chunk, seen
                        before = seen.count(b"data: {")
                        seen += chunk
                        for _ in range(seen.count(b"data: {") - before):
                            if seen.count(b"data: {") < 10:
                                client.allowed.release()
                assert seen.startswith(b"HTTP/1.1 200"), seen
                await stream.aclose()
                # the relay sees the client go away, ends the session and settles its charge
                with trio.fail_after(10):
                    while state.reserved or state.concurrent.get("k"):
                        await trio.sleep(0.01)
                usage = store.usage_on("k", "2027-01-15")
                # ± the last event: a token may have been generated and not yet sent
                assert usage.prompt_tokens == 3 * (round_ + 1), usage
                assert 10 * (round_ + 1) <= usage.completion_tokens <= client.generated <= 11 * (round_ + 1), usage
            nursery.cancel_scope.cancel()


@pytest.mark.timeout(30)
async def test_a_body_not_sent_as_json_is_415_and_nothing_runs(app_parts) -> None:
    """The requests a web page can make from a visitor's browser without a CORS preflight
    (text/plain, a form) run nothing, even with anonymous access on (this app's fixture)."""
    app, key, client, state = app_parts
    body = json.dumps({"model": "tiny", "prompt": "a b", "max_tokens": 2}).encode()
    async with _http(app) as http:
        for content_type in ("text/plain;charset=UTF-8", "application/x-www-form-urlencoded"):
            for headers in ({}, {"Authorization": f"Bearer {key}"}):
                reply = await http.post(
                    "/v1/completions", content=body, headers={"Content-Type": content_type, **headers}
                )
                assert reply.status_code == 415, reply.text
                error = reply.json()["error"]
                assert error["code"] == "unsupported_media_type" and content_type in error["message"], error
        assert client.generations == 0
        assert state.store.requests_since("anonymous", 0.0) == [] and state.store.requests_since("k", 0.0) == []
        assert state.store.ledger() == []
        sent_as_json = await http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        assert sent_as_json.status_code == 200, sent_as_json.text
    assert client.generations == 1


@pytest.mark.timeout(30)
async def test_unknown_paths_and_methods_get_envelopes(app_parts) -> None:
    app, key, _client, _state = app_parts
    async with _http(app) as http:
        missing = await http.get("/v1/nothing", headers={"Authorization": f"Bearer {key}"})
        wrong = await http.get("/v1/completions", headers={"Authorization": f"Bearer {key}"})
        status = await http.get("/status.json")
    assert missing.status_code == 404 and set(missing.json()["error"]) == {"message", "type", "param", "code"}
    assert wrong.status_code == 405 and "error" in wrong.json()
    assert status.status_code == 200 and [m["alias"] for m in status.json()["models"]] == ["tiny", "plain"]


@pytest.mark.timeout(30)
async def test_status_hits_share_one_tracker_lookup_and_show_only_assigned_coverage(app_parts) -> None:
    app, _key, client, _state = app_parts
    lookups = []
    honest = swarm_pb2.Assignment(model_sha256=SHA, begin=0, end=4)
    boaster = swarm_pb2.Assignment(model_sha256=SHA, begin=0, end=2)  # reported, never assigned

    async def list_nodes() -> list[swarm_pb2.NodeEntry]:
        lookups.append(trio.current_time())
        await trio.lowlevel.checkpoint()  # the other hits arrive while this one waits on the tracker
        ready = swarm_pb2.AssignmentStatus.READY
        return [
            swarm_pb2.NodeEntry(peer_id="honest", alive=True, assigned=[honest],
                                serving=[swarm_pb2.AssignmentStatus(assignment=honest, state=ready)]),
            swarm_pb2.NodeEntry(peer_id="boaster", alive=True,
                                serving=[swarm_pb2.AssignmentStatus(assignment=boaster, state=ready)]),
        ]  # fmt: skip

    client.list_nodes = list_nodes  # type: ignore[method-assign]
    replies = []
    async with _http(app) as http:

        async def hit() -> None:
            replies.append(await http.get("/status.json"))

        async with trio.open_nursery() as nursery:
            for _ in range(50):
                nursery.start_soon(hit)
    assert len(lookups) == 1 and all(r.status_code == 200 for r in replies)
    (tiny,) = [m for m in replies[0].json()["models"] if m["alias"] == "tiny"]
    assert [c["peer_id"] for c in tiny["coverage"]] == ["honest"] and tiny["covered"]


@pytest.mark.timeout(30)
async def test_metrics_and_the_status_record_show_each_range_s_prefix_cache(app_parts) -> None:
    app, _key, client, _state = app_parts
    first, second = (swarm_pb2.Assignment(model_sha256=SHA, begin=b, end=e) for b, e in ((0, 2), (2, 4)))
    ready = swarm_pb2.AssignmentStatus.READY

    async def list_nodes() -> list[swarm_pb2.NodeEntry]:
        return [
            swarm_pb2.NodeEntry(peer_id="n1", alive=True, assigned=[first], serving=[swarm_pb2.AssignmentStatus(
                assignment=first, state=ready, prefix_lookups=8, prefix_hits=6, prefix_hit_positions=768,
                prefix_cache_used_bytes=3 << 20, prefix_cache_bytes=16 << 20,
            )]),
            # no prefix cache: not listed
            swarm_pb2.NodeEntry(peer_id="n2", alive=True, assigned=[second],
                                serving=[swarm_pb2.AssignmentStatus(assignment=second, state=ready)]),
        ]  # fmt: skip

    client.list_nodes = list_nodes  # type: ignore[method-assign]
    async with _http(app) as http:
        status = (await http.get("/status.json")).json()
        metrics = (await http.get("/metrics")).text
        page = (await http.get("/")).text
    assert status["prefix_caches"] == [
        {"peer_id": "n1", "model": "tiny", "begin": 0, "end": 2, "alive": True, "lookups": 8, "hits": 6,
         "hit_tokens": 768, "hit_rate": 0.75, "used_bytes": 3 << 20, "budget_bytes": 16 << 20},
    ]  # fmt: skip
    samples = {
        (s.name, s.labels.get("peer_id")): s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name.startswith("baton_node_prefix_cache")
    }
    assert samples == {
        ("baton_node_prefix_cache_lookups_total", "n1"): 8,
        ("baton_node_prefix_cache_hits_total", "n1"): 6,
        ("baton_node_prefix_cache_hit_tokens_total", "n1"): 768,
        ("baton_node_prefix_cache_hit_ratio", "n1"): 0.75,
        ("baton_node_prefix_cache_bytes", "n1"): 3 << 20,
        ("baton_node_prefix_cache_budget_bytes", "n1"): 16 << 20,
    }
    assert 'baton_node_prefix_cache_hit_ratio{begin="0",end="2",model="tiny",peer_id="n1"} 0.75' in metrics
    assert "75.0%" in page and "3.0 MiB / 16.0 MiB" in page
