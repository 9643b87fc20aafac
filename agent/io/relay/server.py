"""The relay's HTTP server: OpenAI's API over the swarm, in the same trio process as its client.

Owns the I/O of ``baton relay serve``: a Starlette app on Hypercorn's trio worker; the swarm
client (admitted by the tracker as a session owner: the relay is the only party that samples);
the vocabularies (``agent.io.vocab``); API keys, quotas, usage and the ledger
(``agent.io.relay.store``); the status page and ``/metrics``.

Decisions are the core's: which bodies are valid and what responses look like
(``agent.core.openai_api``), chat prompts (``agent.core.chat_template``), streamed text and
stop strings (``agent.core.text_stream``), quotas and credit (``agent.core.quotas``), which
results a session takes and the next token (``agent.core.session``).

Order of checks for a request, as OpenAI's: key (401), body size (413), body (400), model
(404), quota (429), then the swarm (503 no route or busy, 504 no answer in time).

A client that disconnects cancels its generation at once: the session is ended on every hop
of its route (``SwarmClient.generate_tokens``' resource handling).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from agent._proto import swarm_pb2
from agent.core import quotas
from agent.core.chat_template import ChatTemplateError
from agent.core.openai_api import (
    ApiError,
    CompletionRequest,
    chat_chunk,
    chat_response,
    check_json_content_type,
    check_unicode,
    completion_chunk,
    completion_response,
    logprob_entry,
    parse_request,
    token_logprobs,
    usage,
)
from agent.core.sampling import SamplingParams
from agent.core.text_stream import TextStream
from agent.io.client import GenerationError, SwarmClient, SwarmError
from agent.io.transport import TransportError
from agent.io.vocab import ModelVocab, VocabularyError, VocabularyPool

from .metrics import RelayMetrics
from .status_page import render_status_page
from .store import RelayStore

__all__ = ["RelayConfig", "RelayState", "build_app", "serve_main", "serve_relay"]

log = logging.getLogger(__name__)

ANONYMOUS = "anonymous"


@dataclasses.dataclass(frozen=True)
class RelayConfig:
    """A relay's settings (``baton relay serve`` flags).

    ``anonymous_tokens_per_day``: 0 switches anonymous access off (every request needs a key).
    ``max_body_bytes``: larger request bodies get 413. ``body_timeout_s``: a body that has not
    all arrived this long after its headers gets 408 (a client trickling bytes holds nothing
    for long; Hypercorn's own read timeout would also cut long streamed answers).
    ``request_timeout_s``: one request to the tracker or a node.
    ``generation_timeout_s``: a whole generation over this gets 504.
    ``default_max_tokens``: a chat request without ``max_tokens`` generates at most this many
    (and never past the model's context).
    ``models_cache_s``: how long the tracker's model list is reused.
    ``preload_timeout_s``: how long start-up waits for the registered models' vocabularies.
    ``spot_check_rate``: the share of generations replayed through a second route and
    compared (``SwarmClientConfig.spot_check_rate``, docs/INTEGRITY.md).
    """

    tracker_addr: str
    db_path: Path
    listen_host: str = "127.0.0.1"
    listen_port: int = 8000
    key_path: Path | None = None
    anonymous_tokens_per_day: int = 0
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 30.0
    request_timeout_s: float = 10.0
    step_timeout_s: float = 30.0
    queue_timeout_s: float = 60.0
    generation_timeout_s: float = 600.0
    default_max_tokens: int = 1024
    models_cache_s: float = 2.0
    preload_timeout_s: float = 60.0
    cache_dir: Path = Path(os.environ.get("BATON_CACHE", Path.home() / ".cache" / "baton")) / "relay"
    p2p_listen: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    addr_file: Path | None = None
    spot_check_rate: float = 0.01


@dataclasses.dataclass
class _Principal:
    """Who sends a request: a key's name and limits, or the anonymous pseudo-key."""

    name: str
    limits: quotas.KeyLimits


class RelayState:
    """What the app's handlers share (made by ``serve_relay``)."""

    def __init__(
        self,
        config: RelayConfig,
        client: SwarmClient,
        store: RelayStore,
        vocabularies: VocabularyPool,
        metrics: RelayMetrics,
        now_s: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.client = client
        self.store = store
        self.vocabularies = vocabularies
        self.metrics = metrics
        self.now_s = now_s
        self.concurrent: dict[str, int] = {}
        self.live_sessions = 0
        self._models: list[swarm_pb2.ModelEntry] = []
        self._models_at = -math.inf

    async def models(self) -> list[swarm_pb2.ModelEntry]:
        """The tracker's registered models (cached ``models_cache_s``).

        Raises:
          ApiError: 503 when the tracker cannot be reached and nothing is cached.
        """
        if trio.current_time() - self._models_at > self.config.models_cache_s:
            try:
                self._models = await self.client.list_models()
                self._models_at = trio.current_time()
            except (SwarmError, TransportError) as error:
                if not self._models:
                    raise ApiError(503, f"the tracker cannot be reached: {error}") from None
                log.warning("model list from the tracker failed, using the last one: %s", error)
        return self._models

    async def model(self, name: str) -> swarm_pb2.ModelEntry:
        """The registered model ``name`` (alias, name or sha256). Raises ApiError 404."""
        for entry in await self.models():
            if name in (entry.alias, entry.name, entry.sha256) and name:
                return entry
        raise ApiError(404, f"The model '{name}' does not exist", param="model")


# --- authentication and quotas -------------------------------------------------------------------


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _authenticate(state: RelayState, request: Request) -> _Principal:
    key = _bearer(request)
    if key is None:
        if state.config.anonymous_tokens_per_day > 0:
            return _Principal(ANONYMOUS, quotas.KeyLimits(state.config.anonymous_tokens_per_day, None, None))
        raise ApiError(
            401,
            "You didn't provide an API key. Send it in the Authorization header (Bearer auth): "
            "'Authorization: Bearer YOUR_KEY'; keys are made with 'baton relay keys add'.",
        )
    record = state.store.authenticate(key)
    if record is None:
        raise ApiError(401, "Incorrect API key provided.")
    if record.revoked:
        raise ApiError(401, f"The API key '{record.name}' has been revoked.")
    return _Principal(record.name, record.limits)


def _admit(state: RelayState, principal: _Principal) -> None:
    """Check and take a quota slot for one request. Raises ApiError 429."""
    now = state.now_s()
    decision = quotas.decide(
        principal.limits,
        tokens_today=state.store.tokens_on(principal.name, quotas.day_of(now)),
        request_times_s=state.store.requests_since(principal.name, now - 60.0),
        concurrent=state.concurrent.get(principal.name, 0),
        now_s=now,
    )
    if not decision.admitted:
        raise ApiError(429, decision.message, code=decision.limit, retry_after_s=decision.retry_after_s)
    state.store.record_request(principal.name, now)


# --- one completion ------------------------------------------------------------------------------


@dataclasses.dataclass
class _Prompt:
    tokens: list[int]
    vocab: ModelVocab
    entry: swarm_pb2.ModelEntry
    max_tokens: int


async def _prepare(state: RelayState, req: CompletionRequest) -> _Prompt:
    entry = await state.model(req.model)
    try:
        vocab = await state.vocabularies.get(entry.sha256)
    except VocabularyError as error:
        raise ApiError(503, str(error)) from None
    try:
        tokens = await _prompt_tokens(req, vocab)
    except VocabularyError as error:
        raise ApiError(503, str(error)) from None
    if not tokens:
        raise ApiError(
            400, "the prompt tokenizes to no tokens", param="prompt" if req.kind == "completion" else "messages"
        )
    context = vocab.context_length or 0
    if context and len(tokens) >= context:
        raise ApiError(400, f"This model's maximum context length is {context} tokens; the prompt has {len(tokens)}.",
                       param="messages" if req.kind == "chat" else "prompt", code="context_length_exceeded")  # fmt: skip
    limit = req.max_tokens if req.max_tokens is not None else state.config.default_max_tokens
    if context:
        limit = min(limit, context - len(tokens))
    return _Prompt(tokens=tokens, vocab=vocab, entry=entry, max_tokens=max(1, limit))


async def _prompt_tokens(req: CompletionRequest, vocab: ModelVocab) -> list[int]:
    if req.kind == "chat":
        if vocab.chat_template is None:
            raise ApiError(400, f"The model '{req.model}' has no usable chat template: {vocab.chat_template_error}; "
                           "use /v1/completions with your own prompt", param="messages")  # fmt: skip
        try:
            text = vocab.chat_template.render(list(req.messages or ()), add_generation_prompt=True)
        except ChatTemplateError as error:
            raise ApiError(400, str(error), param="messages") from None
        tokens = await vocab.tokenize(text)
    elif isinstance(req.prompt, tuple):
        bad = [t for t in req.prompt if t >= vocab.n_vocab]
        if bad:
            raise ApiError(
                400, f"token id {bad[0]} is outside the vocabulary of {vocab.n_vocab} tokens", param="prompt"
            )
        tokens = list(req.prompt)
    else:
        tokens = await vocab.tokenize(str(req.prompt))
    return tokens


def _token_text(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


class _Completion:
    """One completion's run: generation, text, logprobs, and its events for a stream."""

    def __init__(self, state: RelayState, req: CompletionRequest, prompt: _Prompt, principal: _Principal) -> None:
        self.state = state
        self.req = req
        self.prompt = prompt
        self.principal = principal
        prefix = "chatcmpl" if req.kind == "chat" else "cmpl"
        self.id = f"{prefix}-{secrets.token_hex(12)}"
        self.created = int(state.now_s())
        self.text = TextStream(req.stop)
        self.logprob_entries: list = []  # chat: entries; completion: (token, logprob, top dict)
        self._unsent_logprobs: list = []
        self.completion_tokens = 0
        self.token_ids: list[int] = []
        self._unsent_token_ids: list[int] = []
        self._sent_prompt_ids = False
        self.finish_reason = "length"

    def _logprobs(self, token: int, logits) -> None:
        if not self.req.logprobs or logits is None or (isinstance(logits, np.ndarray) and logits.size == 0):
            return
        vocab = self.prompt.vocab
        logprob, top = token_logprobs(logits, token, self.req.top_logprobs or 0)
        piece = vocab.piece(token)
        entry: dict[str, Any] | tuple[str, float, dict[str, float]]
        if self.req.kind == "chat":
            tops = [(_token_text(vocab.piece(t)), vocab.piece(t), lp) for t, lp in top]
            entry = logprob_entry(_token_text(piece), piece, logprob, tops)
        else:
            entry = (_token_text(piece), logprob, {_token_text(vocab.piece(t)): lp for t, lp in top})
        self.logprob_entries.append(entry)
        self._unsent_logprobs.append(entry)

    def _completion_logprobs(self, entries: list, offset: int) -> dict:
        tokens, text_offset, position = [], [], offset
        for token_text, _lp, _top in entries:
            tokens.append(token_text)
            text_offset.append(position)
            position += len(token_text)
        return {
            "tokens": tokens,
            "token_logprobs": [lp for _t, lp, _top in entries],
            "top_logprobs": [top for _t, _lp, top in entries],
            "text_offset": text_offset,
        }

    def _take_unsent_logprobs(self, offset: int):
        entries, self._unsent_logprobs = self._unsent_logprobs, []
        if not self.req.logprobs:
            return None
        return entries if self.req.kind == "chat" else self._completion_logprobs(entries, offset)

    def chunk(self, text: str, finish_reason: str | None = None, *, role: bool = False) -> dict:
        offset = len(self.text.text) - len(text)
        logprobs = None if role else self._take_unsent_logprobs(offset)
        if self.req.kind == "chat":
            delta: dict = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            chunk = chat_chunk(id_=self.id, created=self.created, model=self.req.model, delta=delta,
                               finish_reason=finish_reason, logprobs=logprobs)  # fmt: skip
        else:
            chunk = completion_chunk(id_=self.id, created=self.created, model=self.req.model, text=text,
                                     finish_reason=finish_reason, logprobs=logprobs)  # fmt: skip
        if self.req.return_token_ids and chunk["choices"]:
            if not self._sent_prompt_ids:  # the first chunk carries the prompt's ids
                chunk["prompt_token_ids"] = list(self.prompt.tokens)
                self._sent_prompt_ids = True
            if role:
                chunk["choices"][0]["token_ids"] = []
            else:
                chunk["choices"][0]["token_ids"], self._unsent_token_ids = self._unsent_token_ids, []
        return chunk

    def usage(self) -> dict:
        return usage(len(self.prompt.tokens), self.completion_tokens)

    def usage_chunk(self) -> dict:
        build = chat_chunk if self.req.kind == "chat" else completion_chunk
        return build(id_=self.id, created=self.created, model=self.req.model, usage_=self.usage(), final_usage=True)

    def response(self) -> dict:
        response = self._response()
        if self.req.return_token_ids:
            response["prompt_token_ids"] = list(self.prompt.tokens)
            response["choices"][0]["token_ids"] = list(self.token_ids)
        return response

    def _response(self) -> dict:
        if self.req.kind == "chat":
            return chat_response(
                id_=self.id, created=self.created, model=self.req.model, text=self.text.text,
                finish_reason=self.finish_reason, usage_=self.usage(),
                logprobs=self.logprob_entries if self.req.logprobs else None,
            )  # fmt: skip
        return completion_response(
            id_=self.id, created=self.created, model=self.req.model, text=self.text.text,
            finish_reason=self.finish_reason, usage_=self.usage(),
            logprobs=self._completion_logprobs(self.logprob_entries, 0) if self.req.logprobs else None,
        )  # fmt: skip

    async def run(self, emit: Callable[[str], Awaitable[None]] | None) -> None:
        """Generate; ``emit`` (streaming) is awaited with each new piece of text.

        Raises:
          ApiError: 503 (no route, the swarm busy or failing), 504 (no answer in time).
        """
        state, req, vocab = self.state, self.req, self.prompt.vocab
        sampling = SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p)
        eog = vocab.eog_token_ids
        started = time.perf_counter()
        last_token_at: float | None = None

        async def on_token(token: int, logits, _route) -> bool:
            nonlocal last_token_at
            now = time.perf_counter()
            if last_token_at is None:
                state.metrics.observe_time_to_first_token(now - started)
            else:
                state.metrics.observe_inter_token(now - last_token_at)
            last_token_at = now
            self.completion_tokens += 1
            self.token_ids.append(token)
            self._unsent_token_ids.append(token)
            if token in eog:
                return False  # the session ends on it by itself; its text is not shown
            self._logprobs(token, logits)
            text = self.text.feed(vocab.piece(token))
            if emit is not None and (
                text or self._unsent_logprobs or (self._unsent_token_ids and req.return_token_ids)
            ):
                await emit(text)
            return self.text.stopped

        state.metrics.session_started()
        state.live_sessions += 1
        try:
            with trio.fail_after(state.config.generation_timeout_s):
                result = await state.client.generate_tokens(
                    self.prompt.entry.sha256, self.prompt.tokens, max_tokens=self.prompt.max_tokens,
                    stop_tokens=sorted(eog), sampling=sampling, seed=req.seed, on_token=on_token,
                    queue_timeout_s=state.config.queue_timeout_s,
                )  # fmt: skip
        except trio.TooSlowError:
            raise ApiError(504, f"the generation did not finish within {state.config.generation_timeout_s} s") from None
        except GenerationError as error:
            if error.code == swarm_pb2.Error.RESOURCE_EXHAUSTED:
                raise ApiError(503, f"the swarm is busy: {error}", retry_after_s=5) from None
            if not error.failed_peer_id and error.code == 0:
                raise ApiError(504, f"the swarm did not answer in time: {error}") from None
            if not error.failed_peer_id:  # no node holds some range now: as a route refused at once
                raise ApiError(503, f"no route for '{req.model}' now: {error}", retry_after_s=5) from None
            raise ApiError(503, f"the swarm could not finish the generation: {error}") from None
        except SwarmError as error:
            status = 404 if error.code == swarm_pb2.Error.NOT_FOUND else 503
            raise ApiError(status, f"no route for '{req.model}': {error.message}") from None
        except TransportError as error:
            raise ApiError(503, f"the tracker or first hop cannot be reached: {error}") from None
        finally:
            state.live_sessions -= 1
            state.metrics.session_ended()
        tail = self.text.finish()
        if emit is not None and tail:
            await emit(tail)
        stopped = self.text.stopped or result.stopped_by_token
        self.finish_reason = "stop" if stopped else "length"
        now = state.now_s()
        state.store.add_usage(self.principal.name, quotas.day_of(now), len(self.prompt.tokens), self.completion_tokens)
        hops = [(h["node"], h["begin"], h["end"], h["rows"]) for h in result.hop_rows]
        state.store.credit(self.id, result.model_sha256, hops, self.prompt.entry.n_layer, now)
        state.metrics.observe_tokens(len(self.prompt.tokens), self.completion_tokens)
        state.metrics.record_completion_tokens(self.completion_tokens, now)


# --- ASGI responses ------------------------------------------------------------------------------


def _error_response(error: ApiError) -> JSONResponse:
    headers = {}
    if error.retry_after_s is not None:
        headers["retry-after"] = str(max(1, math.ceil(error.retry_after_s)))
    return JSONResponse(error.envelope(), status_code=error.status, headers=headers)


def _sse(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


class _CompletionResponse:
    """Runs a completion while it watches for the client going away (then cancels it).

    Streaming: headers go out with the first event, so an error before any text still gets its
    status and envelope; an error after that is one ``data: {"error": ...}`` event.
    """

    def __init__(self, completion: _Completion, endpoint: str, release: Callable[[], None]) -> None:
        self.completion = completion
        self.endpoint = endpoint
        self.release = release
        self.status = 200

    async def __call__(self, scope, receive, send) -> None:
        completion = self.completion
        metrics = completion.state.metrics
        started = False
        disconnected = False
        done = False

        async def start(status: int, content_type: bytes, extra: list | None = None) -> None:
            nonlocal started
            started = True
            self.status = status
            headers = [(b"content-type", content_type), (b"cache-control", b"no-cache")] + (extra or [])
            await send({"type": "http.response.start", "status": status, "headers": headers})

        async def body(data: bytes, more: bool) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": more})

        async def emit(text: str) -> None:
            if not started:
                await start(200, b"text/event-stream; charset=utf-8", [(b"x-accel-buffering", b"no")])
                await body(_sse(completion.chunk("", role=True)) if completion.req.kind == "chat" else b"", True)
            await body(_sse(completion.chunk(text)), True)

        try:
            async with trio.open_nursery() as nursery:

                async def watch() -> None:
                    nonlocal disconnected
                    while True:
                        message = await receive()
                        if message["type"] == "http.disconnect":
                            disconnected = True
                            nursery.cancel_scope.cancel()
                            return

                nursery.start_soon(watch)
                try:
                    await completion.run(emit if completion.req.stream else None)
                except ApiError as error:
                    done = True
                    metrics.observe_request(self.endpoint, error.status)
                    if not started:
                        response = _error_response(error)
                        self.status = error.status
                        await response(scope, receive, send)
                    else:
                        await body(_sse(error.envelope()), False)
                    nursery.cancel_scope.cancel()
                    return
                # the generation is done: the client may go away while the last bytes are sent
                done = True
                metrics.observe_request(self.endpoint, 200)
                if completion.req.stream:
                    if not started:
                        await emit("")
                    await body(_sse(completion.chunk("", completion.finish_reason)), True)
                    if completion.req.include_usage:
                        await body(_sse(completion.usage_chunk()), True)
                    await body(_sse("[DONE]"), False)
                else:
                    payload = json.dumps(completion.response(), ensure_ascii=False).encode()
                    await start(200, b"application/json")
                    await body(payload, False)
                nursery.cancel_scope.cancel()
        finally:
            self.release()
            if disconnected and not done:
                log.info("%s: the client went away; its session was ended", completion.id)
                metrics.observe_request(self.endpoint, 499)


# --- the app ---------------------------------------------------------------------------------------


async def _read_json(request: Request, limit: int, timeout_s: float):
    check_json_content_type(request.headers.get("content-type"))  # before a byte of the body is read
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"The request body is {declared} bytes, over the limit of {limit} bytes.")
    chunks, size = [], 0
    with trio.move_on_after(timeout_s) as deadline:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"The request body is over the limit of {limit} bytes.")
            chunks.append(chunk)
    if deadline.cancelled_caught:
        expected = f"of {declared} " if declared is not None and declared.isdigit() else ""
        raise ApiError(408, f"The request body did not arrive within {timeout_s:g} s ({size} bytes {expected}came).")
    raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ApiError(400, f"The request body is not valid JSON: {error}") from None
    except RecursionError:
        raise ApiError(400, "The request body is nested too deeply to be decoded.") from None
    check_unicode(body)
    return body


def build_app(state: RelayState) -> Starlette:
    """The relay's ASGI app over ``state``."""

    def guarded(endpoint: str, handler: Callable[[Request], Awaitable[Response]]):
        # one place turns every error into OpenAI's envelope: a handler never raises to Hypercorn
        async def wrapped(request: Request) -> Response:
            try:
                response = await handler(request)
            except ApiError as error:
                state.metrics.observe_request(endpoint, error.status)
                return _error_response(error)
            except Exception as error:
                log.exception("%s failed", endpoint)
                state.metrics.observe_request(endpoint, 500)
                return _error_response(ApiError(500, f"internal error: {type(error).__name__}"))
            if not isinstance(response, _CompletionResponse):
                state.metrics.observe_request(endpoint, response.status_code)
            return response

        return wrapped

    async def list_models(request: Request) -> Response:
        _authenticate(state, request)
        return JSONResponse({"object": "list", "data": [_model_card(e) for e in await state.models()]})

    async def get_model(request: Request) -> Response:
        _authenticate(state, request)
        entry = await state.model(request.path_params["model"])
        return JSONResponse(_model_card(entry))

    def completions(kind: str, endpoint: str):
        async def handler(request: Request) -> Response:
            principal = _authenticate(state, request)
            body = await _read_json(request, state.config.max_body_bytes, state.config.body_timeout_s)
            req = parse_request(body, kind)
            prompt = await _prepare(state, req)
            _admit(state, principal)
            state.concurrent[principal.name] = state.concurrent.get(principal.name, 0) + 1

            def release() -> None:
                state.concurrent[principal.name] -= 1

            return _CompletionResponse(_Completion(state, req, prompt, principal), endpoint, release)  # type: ignore[return-value]

        return handler

    async def status_json(_request: Request) -> Response:
        return JSONResponse(await _status(state))

    async def status_page(_request: Request) -> Response:
        return HTMLResponse(render_status_page(await _status(state)))

    async def metrics(_request: Request) -> Response:
        payload, content_type = state.metrics.render()
        return Response(payload, media_type=content_type)

    async def health(_request: Request) -> Response:
        return JSONResponse({"status": "ok", "peer_id": state.client.peer_id})

    async def not_found(request: Request, _exc) -> Response:
        return _error_response(ApiError(404, f"Unknown path {request.url.path}"))

    async def not_allowed(request: Request, _exc) -> Response:
        return _error_response(ApiError(405, f"Method {request.method} is not allowed on {request.url.path}"))

    routes = [
        Route("/v1/models", guarded("/v1/models", list_models), methods=["GET"]),
        Route("/v1/models/{model:path}", guarded("/v1/models/{model}", get_model), methods=["GET"]),
        Route(
            "/v1/completions",
            guarded("/v1/completions", completions("completion", "/v1/completions")),
            methods=["POST"],
        ),
        Route(
            "/v1/chat/completions",
            guarded("/v1/chat/completions", completions("chat", "/v1/chat/completions")),
            methods=["POST"],
        ),
        Route("/", guarded("/", status_page), methods=["GET"]),
        Route("/status.json", guarded("/status.json", status_json), methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed})


def _model_card(entry: swarm_pb2.ModelEntry) -> dict:
    return {
        "id": entry.alias or entry.name or entry.sha256,
        "object": "model",
        "created": 0,
        "owned_by": "baton",
        "name": entry.name,
        "sha256": entry.sha256,
        "aliases": [a for a in (entry.alias, entry.name, entry.sha256) if a],
        "architecture": entry.architecture,
        "n_layer": entry.n_layer,
        "context_length": entry.context_length,
        "hf_repo": entry.hf_repo,
    }


async def _status(state: RelayState) -> dict:
    try:
        models = await state.models()
        nodes = await state.client.list_nodes()
    except (SwarmError, TransportError, ApiError) as error:
        log.warning("status: the tracker cannot be reached: %s", error)
        models, nodes = [], []
    now = state.now_s()
    out_models = []
    for entry in models:
        coverage: list[dict[str, Any]] = []
        for node in nodes:
            for status in node.serving:
                if status.assignment.model_sha256 != entry.sha256:
                    continue
                coverage.append({
                    "peer_id": node.peer_id, "begin": status.assignment.begin, "end": status.assignment.end,
                    "state": swarm_pb2.AssignmentStatus.State.Name(status.state), "alive": node.alive,
                })  # fmt: skip
        coverage.sort(key=lambda c: (c["begin"], c["end"], c["peer_id"]))
        ready = sorted((c["begin"], c["end"]) for c in coverage if c["state"] == "READY" and c["alive"])
        reach = 0
        for begin, end in ready:
            if begin <= reach:
                reach = max(reach, end)
        out_models.append({
            "alias": entry.alias, "name": entry.name, "sha256": entry.sha256, "n_layer": entry.n_layer,
            "context_length": entry.context_length, "covered": entry.n_layer > 0 and reach >= entry.n_layer,
            "coverage": coverage,
        })  # fmt: skip
    credits = [
        {"peer_id": e.peer_id, "rows": e.rows, "credit": e.credit, "completions": e.completions}
        for e in state.store.ledger()
    ]
    return {
        "relay": {"peer_id": state.client.peer_id, "tracker": state.config.tracker_addr, "version": _version()},
        "models": out_models,
        "live_sessions": state.live_sessions,
        "recent_tokens_per_s": state.metrics.recent_tokens_per_s(now),
        "credits": credits,
        "updated_at_s": now,
    }


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("baton")
    except PackageNotFoundError:
        return "dev"


# --- serving ---------------------------------------------------------------------------------------


async def serve_relay(config: RelayConfig, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:  # type: ignore[name-defined]  # trio-typing's stale trio stubs
    """Run the relay until cancelled; ``task_status.started`` gives its base URL
    (``http://HOST:PORT``).

    Raises:
      SwarmError / TransportError: the tracker refused or could not be reached at start.
      OSError: the listen address is taken, or the db / key cannot be opened.

    Resource handling:
      The HTTP server, the swarm client and every vocab worker are closed when this returns.
    """
    from hypercorn.config import Config as HypercornConfig
    from hypercorn.trio import serve

    from agent.io.client import SwarmClientConfig, open_swarm_client
    from agent.io.vocab import serve_vocabularies

    from .store import open_relay_store

    key = None
    if config.key_path is not None:
        from agent.io.keys import load_or_create_key

        key = load_or_create_key(config.key_path)
    client_config = SwarmClientConfig(
        request_timeout_s=config.request_timeout_s, step_timeout_s=config.step_timeout_s,
        queue_timeout_s=config.queue_timeout_s, spot_check_rate=config.spot_check_rate,
    )  # fmt: skip
    with open_relay_store(config.db_path) as store:
        async with open_swarm_client(
            config.tracker_addr, key=key, config=client_config, listen_addrs=config.p2p_listen
        ) as client:

            async def fetch_metadata(sha256: str) -> swarm_pb2.ModelMetadataReply:
                return await client.model_metadata(sha256)

            async with trio.open_nursery() as nursery:
                pool = await nursery.start(
                    lambda task_status: serve_vocabularies(
                        fetch_metadata, config.cache_dir, request_timeout_s=config.request_timeout_s,
                        task_status=task_status,
                    )
                )  # fmt: skip
                state = RelayState(config, client, store, pool, RelayMetrics())
                await _preload_vocabularies(state, config.preload_timeout_s)
                hyper = HypercornConfig()
                hyper.bind = [f"{_bind_host(config.listen_host)}:{config.listen_port}"]
                hyper.accesslog = None
                hyper.errorlog = logging.getLogger("hypercorn.error")
                hyper.graceful_timeout = 1.0
                # (ignored) hypercorn's ASGI callable type and Starlette's __call__ disagree on
                # Scope/Receive/Send; both are ASGI 3 apps at run time
                binds = await nursery.start(lambda task_status: serve(build_app(state), hyper, task_status=task_status))  # type: ignore[arg-type]
                url = binds[0]
                if config.addr_file is not None:
                    _write_atomically(config.addr_file, url + "\n")
                log.info("relay listening on %s (peer id %s)", url, client.peer_id)
                task_status.started(url)


async def _preload_vocabularies(state: RelayState, timeout_s: float) -> None:
    """Load every registered model's vocabulary before serving (bounded; failures are logged
    and retried by the first request), so the first request does not pay for it."""
    try:
        models = await state.models()
    except ApiError as error:
        log.warning("no model list to preload vocabularies from: %s", error.message)
        return

    async def one(entry: swarm_pb2.ModelEntry) -> None:
        try:
            await state.vocabularies.get(entry.sha256)
        except VocabularyError as error:
            log.warning("%s", error)

    with trio.move_on_after(timeout_s):
        async with trio.open_nursery() as nursery:
            for entry in models:
                nursery.start_soon(one, entry)


def _bind_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _listen_arg(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"--listen must be HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def serve_main(args) -> int:
    """``baton relay serve``: run until Ctrl-C or SIGTERM (exit 0); 2 when it cannot start."""
    import sys

    level = getattr(logging, str(getattr(args, "log_level", "INFO")).upper(), logging.INFO)
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("libp2p", "multiaddr", "hypercorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        host, port = _listen_arg(args.listen)
        config = RelayConfig(
            tracker_addr=args.tracker,
            db_path=Path(args.db),
            listen_host=host,
            listen_port=port,
            key_path=Path(args.key) if args.key else None,
            anonymous_tokens_per_day=args.anonymous_tokens_per_day,
            max_body_bytes=args.max_body_bytes,
            body_timeout_s=args.body_timeout_s,
            request_timeout_s=args.request_timeout_s,
            step_timeout_s=args.step_timeout_s,
            queue_timeout_s=args.queue_timeout_s,
            cache_dir=Path(args.cache_dir) if args.cache_dir else RelayConfig.cache_dir,
            p2p_listen=tuple(args.p2p_listen) if isinstance(args.p2p_listen, (list, tuple)) else (args.p2p_listen,),
            addr_file=Path(args.addr_file) if args.addr_file else None,
            spot_check_rate=getattr(args, "spot_check_rate", RelayConfig.spot_check_rate),
        )
    except ValueError as error:
        print(f"baton relay serve: {error}", file=sys.stderr)
        return 2

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_relay, config)

    from agent.io.stop_signals import run_until_stop_signal

    try:
        # SIGTERM (kill, systemd, a parent's lifeline) as Ctrl-C: the vocabulary workers are
        # stopped and their temp dirs removed before exit 0
        trio.run(run_until_stop_signal, run)
    except KeyboardInterrupt:  # Ctrl-C before the signal receiver was in place
        return 0
    except BaseException as caught:
        from agent import cli_args

        for leaf in cli_args.known_failures(caught, (SwarmError, TransportError, OSError, ValueError)):
            print(f"baton relay serve: {leaf}", file=sys.stderr)
        return 2
    return 0
