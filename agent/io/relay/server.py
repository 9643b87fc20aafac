"""The relay's HTTP server: OpenAI's API over the swarm, in the same trio process as its client.

Owns the I/O of ``baton relay serve``: a Starlette app on Hypercorn's trio worker (its routes,
reading bodies, the status data, one place that turns errors into OpenAI's envelope); the
swarm client (admitted by the tracker as a session owner: the relay is the only party that
samples); the vocabularies (``agent.io.worker.vocab``). Beside it: settings and shared state
(``agent.io.relay.state``), keys and quotas (``auth``), one completion (``completion``), its
ASGI response (``responses``); API keys, usage and the ledger are ``agent.io.relay.store``'s,
the status page and ``/metrics`` ``status_page``'s and ``metrics``'.

Decisions are the core's: which bodies are valid and what responses look like
(``agent.core.relay.openai_api``), chat prompts (``agent.core.owner.chat_template``), streamed text and
stop strings (``agent.core.owner.text_stream``), quotas and credit (``agent.core.relay.quotas``), which
results a session takes and the next token (``agent.core.owner.session``).

Order of checks for a request, as OpenAI's: key (401), body size (413), body (400), model
(404), quota (429), then the swarm (503 no route or busy, 504 no answer in time).

A client that disconnects cancels its generation at once: the session is ended on every hop
of its route (``SwarmClient.generate_tokens``' resource handling).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from agent._proto import swarm_pb2
from agent.core.relay.coverage import model_coverage, prefix_caches
from agent.core.relay.openai_api import ApiError, check_json_content_type, check_unicode, parse_request
from agent.core.relay.responses_api import chat_body
from agent.core.relay.served_context import served_context
from agent.io.client import SwarmError
from agent.io.http_serve import serve_asgi
from agent.io.net.transport import TransportError
from agent.io.settings import load_toml, settings_from_args, shared_fields
from agent.io.worker.vocab import VocabularyError

from .auth import admit, authenticate, reserve, settle
from .choices import Choices, prepare_prompts
from .completion import Completion, prepare, served_context_of
from .config import RelayConfig, default_cache_dir
from .metrics import RelayMetrics
from .responses import CompletionResponse, error_response
from .responses_endpoint import ResponsesResponse
from .state import RelayState
from .status_page import render_status_page
from .tokenizer_routes import detokenize, tokenize, tokenizer_info

__all__ = ["build_app", "serve_main", "serve_relay"]

log = logging.getLogger(__name__)


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


def build_app(state: RelayState) -> Callable:
    """The relay's ASGI app over ``state``."""

    def guarded(endpoint: str, handler: Callable[[Request], Awaitable[Response]]):
        # one place turns every error into OpenAI's envelope: a handler never raises to Hypercorn
        async def wrapped(request: Request) -> Response:
            try:
                response = await handler(request)
            except ApiError as error:
                state.metrics.observe_request(endpoint, error.status)
                return error_response(error)
            except Exception as error:
                log.exception("%s failed", endpoint)
                state.metrics.observe_request(endpoint, 500)
                return error_response(ApiError(500, f"internal error: {type(error).__name__}"))
            if not isinstance(response, (CompletionResponse, ResponsesResponse)):
                state.metrics.observe_request(endpoint, response.status_code)
            return response

        return wrapped

    async def list_models(request: Request) -> Response:
        authenticate(state, request)
        cards = [_model_card(e, await served_context_of(state, e)) for e in await state.models()]
        return JSONResponse({"object": "list", "data": cards})

    async def get_model(request: Request) -> Response:
        authenticate(state, request)
        entry = await state.model(request.path_params["model"])
        return JSONResponse(_model_card(entry, await served_context_of(state, entry)))

    def tokenizer(handler):
        async def endpoint(request: Request) -> Response:
            authenticate(state, request)
            if request.method == "GET":
                return await tokenizer_info(state, request)
            body = await _read_json(request, state.config.max_body_bytes, state.config.body_timeout_s)
            return await handler(state, body)

        return endpoint

    async def begin(principal, req) -> tuple[Completion, Callable[[bool], None]]:
        """Admit, prepare and reserve a completion; its release settles the key's budget."""
        admit(state, principal)  # before the prompt is tokenized: a spent key costs no work
        state.concurrent[principal.name] = state.concurrent.get(principal.name, 0) + 1
        try:
            prompt = await prepare(state, req)
            budget = reserve(state, principal, len(prompt.tokens), prompt.max_tokens)
        except BaseException:
            state.concurrent[principal.name] -= 1
            raise
        prompt.max_tokens = budget.max_tokens
        completion = Completion(state, req, prompt, principal)

        def release(client_left: bool) -> None:
            state.concurrent[principal.name] -= 1
            settle(state, principal, budget, len(prompt.tokens), completion.completion_tokens, client_left=client_left)

        return completion, release

    async def responses(request: Request) -> Response:
        principal = authenticate(state, request)
        body = await _read_json(request, state.config.max_body_bytes, state.config.body_timeout_s)
        req = parse_request(chat_body(body), "chat")
        completion, release = await begin(principal, req)
        return ResponsesResponse(completion, body, release)  # type: ignore[return-value]

    def completions(kind: str, endpoint: str):
        async def handler(request: Request) -> Response:
            principal = authenticate(state, request)
            body = await _read_json(request, state.config.max_body_bytes, state.config.body_timeout_s)
            req = parse_request(body, kind, max_choices=state.config.max_choices)
            admit(state, principal)  # before the prompt is tokenized: a spent key costs no work
            state.concurrent[principal.name] = state.concurrent.get(principal.name, 0) + 1
            try:
                prompts = await prepare_prompts(state, req)
                n = req.options.n
                prompt_tokens = sum(len(p.tokens) for p in prompts)
                asked = sum(p.max_tokens for p in prompts) * n
                budget = reserve(state, principal, prompt_tokens, asked)
            except BaseException:
                state.concurrent[principal.name] -= 1
                raise
            if budget.max_tokens < asked:  # the key's day cannot hold every choice's whole budget
                share = max(1, budget.max_tokens // (n * len(prompts)))
                for p in prompts:
                    p.max_tokens = min(p.max_tokens, share)
            completion = Choices(state, req, prompts, principal)

            def release(client_left: bool) -> None:
                state.concurrent[principal.name] -= 1
                settle(
                    state, principal, budget, completion.prompt_tokens, completion.completion_tokens,
                    client_left=client_left,
                )  # fmt: skip

            return CompletionResponse(completion, endpoint, release)  # type: ignore[return-value]

        return handler

    async def status_json(_request: Request) -> Response:
        return JSONResponse(await _status(state))

    async def status_page(_request: Request) -> Response:
        return HTMLResponse(render_status_page(await _status(state)))

    async def metrics(_request: Request) -> Response:
        try:  # (the node list is cached as the status page's is: a scrape costs the tracker nothing more)
            caches = prefix_caches(await state.models(), await state.nodes())
        except (SwarmError, TransportError, ApiError) as error:
            log.warning("metrics: the tracker cannot be reached: %s", error)
            caches = []  # (no node series rather than stale ones)
        state.metrics.set_prefix_caches(caches)
        payload, content_type = state.metrics.render()
        return Response(payload, media_type=content_type)

    async def health(_request: Request) -> Response:
        return JSONResponse({"status": "ok", "peer_id": state.client.peer_id})

    async def not_found(request: Request, _exc) -> Response:
        # not model_not_found: LangChain and others read that code as a missing model
        return error_response(ApiError(404, f"Invalid URL ({request.method} {request.url.path})", code="unknown_url"))

    async def not_allowed(request: Request, _exc) -> Response:
        return error_response(ApiError(405, f"Method {request.method} is not allowed on {request.url.path}"))

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
        Route("/v1/responses", guarded("/v1/responses", responses), methods=["POST"]),
        Route("/", guarded("/", status_page), methods=["GET"]),
        Route("/status.json", guarded("/status.json", status_json), methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/tokenize", guarded("/tokenize", tokenizer(tokenize)), methods=["POST"]),
        Route("/detokenize", guarded("/detokenize", tokenizer(detokenize)), methods=["POST"]),
        Route("/tokenizer_info", guarded("/tokenizer_info", tokenizer(None)), methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed})
    return _with_request_id(app)


def _with_request_id(app: Starlette) -> Callable:
    """Every answer carries ``x-request-id`` (the OpenAI SDK reads it into ``_request_id``):
    the client's own when it sent a short printable one, else a new ``req_<hex>``."""

    async def wrapped(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"")
        request_id = given if 0 < len(given) <= 128 and given.isascii() and given.decode().isprintable() else None
        request_id = request_id or f"req_{secrets.token_hex(16)}".encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        return await app(scope, receive, send_with_id)

    return wrapped


def _model_card(entry: swarm_pb2.ModelEntry, context_length: int) -> dict:
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
        # the positions a session can hold on the swarm now (vLLM calls it max_model_len)
        "context_length": context_length,
        "max_model_len": context_length,
        "hf_repo": entry.hf_repo,
    }


async def _status(state: RelayState) -> dict:
    try:
        models = await state.models()
        nodes = await state.nodes()
    except (SwarmError, TransportError, ApiError) as error:
        log.warning("status: the tracker cannot be reached: %s", error)
        models, nodes = [], []
    now = state.now_s()
    out_models = []
    for entry in models:
        coverage, covered = model_coverage(entry, nodes)
        out_models.append({
            "alias": entry.alias, "name": entry.name, "sha256": entry.sha256, "n_layer": entry.n_layer,
            "context_length": served_context(entry, nodes), "covered": covered,
            "coverage": coverage,
        })  # fmt: skip
    credits = [
        {"peer_id": e.peer_id, "rows": e.rows, "credit": e.credit, "completions": e.completions}
        for e in state.store.ledger()
    ]
    return {
        "relay": {"peer_id": state.client.peer_id, "tracker": state.config.tracker, "version": _version()},
        "models": out_models,
        "prefix_caches": prefix_caches(models, nodes),
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
    from agent.io.client import SwarmClientConfig, open_swarm_client
    from agent.io.worker.vocab import serve_vocabularies

    from .store import open_relay_store

    key = None
    if config.key is not None:
        from agent.io.keys import load_or_create_key

        key = load_or_create_key(config.key)
    # its timeouts and spot-check rate, by name (RelayConfig declares them as the client does)
    client_config = SwarmClientConfig(**shared_fields(config, SwarmClientConfig))
    with open_relay_store(config.db) as store:
        async with open_swarm_client(
            config.tracker, key=key, config=client_config, listen_addrs=(config.p2p_listen,)
        ) as client:

            async def fetch_metadata(sha256: str) -> swarm_pb2.ModelMetadataReply:
                return await client.model_metadata(sha256)

            async with trio.open_nursery() as nursery:
                pool = await nursery.start(
                    lambda task_status: serve_vocabularies(
                        fetch_metadata, config.cache_dir or default_cache_dir(), request_timeout_s=config.request_timeout_s,
                        task_status=task_status,
                    )
                )  # fmt: skip
                state = RelayState(config, client, store, pool, RelayMetrics())
                await _preload_vocabularies(state, config.preload_timeout_s)
                # a stream nobody reads is cut after serve_asgi's send timeout, freeing its key's slot
                url = await nursery.start(
                    serve_asgi, build_app(state), config.listen_host.strip("[]"), config.listen_port
                )
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


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def serve_main(args) -> int:
    """``baton relay serve``: run until Ctrl-C or SIGTERM (exit 0); 2 when it cannot start."""
    import sys

    try:
        settings = settings_from_args(RelayConfig, args, load_toml(args.config, RelayConfig) if args.config else {})
        if not settings["tracker"] or not settings["db"]:
            raise ValueError("--tracker and --db are required (on the command line or in --config)")
        config = RelayConfig(**settings)
    except ValueError as error:  # (a SettingsError names the file and the key)
        print(f"baton relay serve: {error}", file=sys.stderr)
        return 2
    level = getattr(logging, config.log_level.upper(), logging.INFO)
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("libp2p", "multiaddr", "hypercorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

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
