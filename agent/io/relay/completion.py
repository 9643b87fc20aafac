"""One completion of the relay: the prompt prepared (``prepare``: model, vocabulary, chat
template, tokens, context limit), the generation over the swarm (``Completion.run``: text
with stop strings, logprobs, token ids, usage, the ledger's credit), and the OpenAI bodies it
gives (a response, or stream chunks).

Decisions are the core's (``agent.core.relay.openai_api``, ``chat_template``, ``text_stream``,
``quotas``); the swarm client samples.

Must not import the relay's app or server; the HTTP side of a completion is
``agent.io.relay.responses``.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import trio

from agent._proto import swarm_pb2
from agent.core.owner.chat_template import ChatTemplateError
from agent.core.owner.grammar import GrammarError, GrammarTokenizer, TokenConstraint
from agent.core.owner.sampling import SamplingParams
from agent.core.owner.text_stream import TextStream
from agent.core.owner.tool_calls import call_start, parse_tool_calls, tool_call_format
from agent.core.relay.generation_options import GenerationOptions
from agent.core.relay.openai_api import (
    ApiError,
    CompletionRequest,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    logprob_entry,
    token_logprobs,
    usage,
)
from agent.core.relay.served_context import served_context
from agent.core.relay.structured import StructuredError, template_messages, tool_call_records
from agent.io.client import GenerationError, SwarmError
from agent.io.net.transport import TransportError
from agent.io.worker.vocab import ModelVocab, VocabularyError

from .auth import Principal
from .state import RelayState

__all__ = ["Completion", "Prompt", "prepare", "sampling_params", "served_context_of"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Prompt:
    """``grammar``: what the tokens keep to (structured output, a forced tool call; each
    choice its own matcher over ``grammar_tokenizer``); ``tool_format``: the template's
    tool-call format, where calls are parsed."""

    tokens: list[int]
    vocab: ModelVocab
    entry: swarm_pb2.ModelEntry
    max_tokens: int
    grammar: str | None = None
    grammar_tokenizer: GrammarTokenizer | None = None
    tool_format: str = "generic"


#: a model's vocabulary as the grammar engine's tokenizer (0.3 s to build for 49k tokens), by sha256
_GRAMMAR_TOKENIZERS: dict[str, GrammarTokenizer] = {}


async def _grammar_tokenizer(vocab: ModelVocab) -> GrammarTokenizer:
    tokenizer = _GRAMMAR_TOKENIZERS.get(vocab.sha256)
    if tokenizer is None:
        tokenizer = await trio.to_thread.run_sync(GrammarTokenizer, vocab.vocabulary)
        _GRAMMAR_TOKENIZERS[vocab.sha256] = tokenizer
    return tokenizer


async def _grammar(req: CompletionRequest, vocab: ModelVocab, fmt: str) -> tuple[str | None, GrammarTokenizer | None]:
    """The request's grammar and the model's tokenizer for it, checked by building a matcher
    once (a grammar the engine refuses on this vocabulary is the client's 400)."""
    if req.output is None:
        return None, None
    try:
        grammar = req.output.grammar(fmt)
        if grammar is None:
            return None, None
        tokenizer = await _grammar_tokenizer(vocab)
        TokenConstraint(tokenizer, grammar)
        return grammar, tokenizer
    except StructuredError as error:
        raise ApiError(400, error.message, param=error.param) from None
    except (GrammarError, ValueError) as error:
        param = "tools" if req.output.forces_call else "response_format"
        raise ApiError(400, f"the grammar engine cannot enforce this request on '{req.model}': {error}",
                       param=param) from None  # fmt: skip


async def prepare(state: RelayState, req: CompletionRequest) -> Prompt:
    entry = await state.model(req.model)
    try:
        vocab = await state.vocabularies.get(entry.sha256)
    except VocabularyError as error:
        raise ApiError(503, str(error)) from None
    try:
        tokens = await _prompt_tokens(req, vocab)
    except VocabularyError as error:
        raise ApiError(503, str(error)) from None
    outside = [t for t, _ in req.options.logit_bias if t >= vocab.n_vocab]
    if outside:
        raise ApiError(400, f"logit_bias token {outside[0]} is outside the vocabulary of {vocab.n_vocab} tokens",
                       param="logit_bias")  # fmt: skip
    if not tokens:
        raise ApiError(
            400, "the prompt tokenizes to no tokens", param="prompt" if req.kind == "completion" else "messages"
        )
    context = await served_context_of(state, entry)
    if context and len(tokens) >= context:
        raise ApiError(400, f"This model's maximum context length is {context} tokens; the prompt has {len(tokens)}.",
                       param="messages" if req.kind == "chat" else "prompt", code="context_length_exceeded")  # fmt: skip
    limit = req.max_tokens if req.max_tokens is not None else state.config.default_max_tokens
    if context:  # the last token is never forwarded: a full context gives one more
        limit = min(limit, context - len(tokens) + 1)
    fmt = tool_call_format(vocab.chat_template.source) if vocab.chat_template is not None else "generic"
    grammar, tokenizer = await _grammar(req, vocab, fmt)
    return Prompt(tokens=tokens, vocab=vocab, entry=entry, max_tokens=max(1, limit), grammar=grammar,
                  grammar_tokenizer=tokenizer, tool_format=fmt)  # fmt: skip


async def served_context_of(state: RelayState, entry: swarm_pb2.ModelEntry) -> int:
    """The positions a session of ``entry`` can hold on the swarm (``served_context``); the
    GGUF's when the tracker's node list cannot be had."""
    try:
        nodes = await state.nodes()
    except (SwarmError, TransportError) as error:
        log.warning("no node list for the served context of %s: %s", entry.sha256[:12], error)
        return entry.context_length
    return served_context(entry, nodes)


async def _prompt_tokens(req: CompletionRequest, vocab: ModelVocab) -> list[int]:
    if req.kind == "chat":
        if vocab.chat_template is None:
            raise ApiError(400, f"The model '{req.model}' has no usable chat template: {vocab.chat_template_error}; "
                           "use /v1/completions with your own prompt", param="messages")  # fmt: skip
        tools = list(req.output.tools) if req.output is not None and req.output.tools else None
        if tools and not vocab.chat_template.takes_tools:
            raise ApiError(400, f"The model '{req.model}' cannot take tools: its chat template never shows them "
                           "to the model", param="tools")  # fmt: skip
        try:
            messages = template_messages(req.messages or ())
            text = vocab.chat_template.render(messages, add_generation_prompt=True, tools=tools)
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


def sampling_params(req: CompletionRequest) -> SamplingParams:
    """How the request's tokens are drawn (penalties and ``logit_bias`` make the owner draw
    them from the full row: ``agent.core.owner.sampling.adjusts_logits``)."""
    options: GenerationOptions = req.options
    return SamplingParams(
        temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, min_p=options.min_p,
        presence_penalty=options.presence_penalty, frequency_penalty=options.frequency_penalty,
        repeat_penalty=options.repeat_penalty, repeat_last_n=options.repeat_last_n, logit_bias=options.logit_bias,
    )  # fmt: skip


def _token_text(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


class Completion:
    """One completion's run: generation, text, logprobs, and its events for a stream."""

    def __init__(
        self, state: RelayState, req: CompletionRequest, prompt: Prompt, principal: Principal, *,
        index: int = 0, seed: int | None = None, prompt_text: str | None = None,
    ) -> None:  # fmt: skip
        """``index``: the choice's index in the response; ``seed``: its draws' (default the
        request's); ``prompt_text``: what ``echo`` shows (default the prompt's pieces)."""
        self.state = state
        self.req = req
        self.prompt = prompt
        self.principal = principal
        self.index = index
        self.seed = req.seed if seed is None else seed
        prefix = "chatcmpl" if req.kind == "chat" else "cmpl"
        self.id = f"{prefix}-{secrets.token_hex(12)}"
        self.created = int(state.now_s())
        options = req.options
        self.echo = req.kind == "completion" and options.echo
        if self.echo and prompt_text is None:
            prompt_text = _token_text(b"".join(prompt.vocab.piece(t) for t in prompt.tokens))
        self.echo_text = (prompt_text or "") if self.echo else ""
        self._echo_unsent = self.echo
        self.score_only = self.echo and req.max_tokens == 0  # the prompt's logprobs, no new token
        self._prompt_scores: dict[int, tuple[float, dict[str, float]]] = {}
        self.text = TextStream(req.stop)
        self.logprob_entries: list = []  # chat: entries; completion: (token, logprob, top dict)
        self._unsent_logprobs: list = []
        self.completion_tokens = 0
        self.cached_tokens = 0  # of the prompt, copied from the hops' prefix caches
        self.token_ids: list[int] = []
        self._unsent_token_ids: list[int] = []
        self._sent_prompt_ids = False
        self.finish_reason = "length"
        # tool calls: text from where a call may begin is held back until the end
        self._parses_calls = req.output is not None and req.output.parses_calls
        self._released = ""  # text the stop strings let through
        self._shown = 0  # characters of it sent
        self.tool_calls: list[dict] = []
        self.content: str | None = None  # the message's content once run (tool calls parsed out)
        # this choice's own matcher: n choices of one prompt each keep to the grammar
        self.constraint = (
            TokenConstraint(prompt.grammar_tokenizer, prompt.grammar)
            if prompt.grammar is not None and prompt.grammar_tokenizer is not None
            else None
        )

    def _showable(self, text: str, final: bool) -> str:
        """Of ``text`` newly released, what a stream may send now: all of it, unless it may be
        part of a tool call (``call_start``); at the end (``final``), the text left."""
        self._released += text
        if not self._parses_calls:
            return text
        if final:
            end = len(self._released) if not self.tool_calls else len(self.content or "")
        else:
            start = call_start(self._released, self.prompt.tool_format)
            # trailing whitespace waits too: before a call it is not part of the content
            end = len(self._released.rstrip()) if start is None else len(self._released[:start].rstrip())
        shown, self._shown = self._released[self._shown : max(end, self._shown)], max(end, self._shown)
        return shown

    def _parse_calls(self) -> None:
        self.content = self.text.text
        if not self._parses_calls:
            return
        assert self.req.output is not None
        content, calls = parse_tool_calls(self.text.text, self.prompt.tool_format, self.req.output.tool_names)
        if calls and not self.req.output.parallel_tool_calls:
            calls = calls[:1]  # at most one call was asked for
        if calls:
            self.content = content
            self.tool_calls = tool_call_records(calls, [f"call_{secrets.token_hex(12)}" for _ in calls])

    def tool_calls_chunk(self) -> dict | None:
        """The stream's chunk of the parsed tool calls (``delta.tool_calls``), or None."""
        if not self.tool_calls:
            return None
        delta = {"tool_calls": [dict(call, index=i) for i, call in enumerate(self.tool_calls)]}
        chunk = chat_chunk(id_=self.id, created=self.created, model=self.req.model, delta=delta)
        chunk["choices"][0]["index"] = self.index
        return chunk

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

    def _score_prompt(self, position: int, logits) -> None:
        """Keep the logprob of the prompt token after ``position`` (``echo`` with ``logprobs``)."""
        tokens = self.prompt.tokens
        if position + 1 < len(tokens):
            logprob, top = token_logprobs(logits, tokens[position + 1], self.req.top_logprobs or 0)
            pieces = {_token_text(self.prompt.vocab.piece(t)): lp for t, lp in top}
            self._prompt_scores[position + 1] = (logprob, pieces)

    def _prompt_entries(self) -> list:
        """The prompt's logprob entries in the legacy format (the first token has none)."""
        if not self.req.logprobs:
            return []
        entries = []
        for i, token in enumerate(self.prompt.tokens):
            logprob, top = self._prompt_scores.get(i, (None, None))
            entries.append((_token_text(self.prompt.vocab.piece(token)), logprob, top))
        return entries

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
        offset = len(self.echo_text) + len(self.text.text) - len(text)
        logprobs = None if role else self._take_unsent_logprobs(offset)
        if self._echo_unsent and not role:  # the first chunk of an echoed completion starts with the prompt
            self._echo_unsent = False
            text = self.echo_text + text
            if logprobs is not None:
                shown = self._completion_logprobs(self._prompt_entries(), 0)
                logprobs = {key: shown[key] + logprobs[key] for key in shown}
        if self.req.kind == "chat":
            delta: dict = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            chunk = chat_chunk(id_=self.id, created=self.created, model=self.req.model, delta=delta,
                               finish_reason=finish_reason, logprobs=logprobs)  # fmt: skip
        else:
            chunk = completion_chunk(id_=self.id, created=self.created, model=self.req.model, text=text,
                                     finish_reason=finish_reason, logprobs=logprobs)  # fmt: skip
        if chunk["choices"]:
            chunk["choices"][0]["index"] = self.index
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
        return usage(len(self.prompt.tokens), self.completion_tokens, self.cached_tokens)

    def usage_chunk(self) -> dict:
        build = chat_chunk if self.req.kind == "chat" else completion_chunk
        return build(id_=self.id, created=self.created, model=self.req.model, usage_=self.usage(), final_usage=True)

    def response(self) -> dict:
        response = self._response()
        response["choices"][0]["index"] = self.index
        if self.req.return_token_ids:
            response["prompt_token_ids"] = list(self.prompt.tokens)
            response["choices"][0]["token_ids"] = list(self.token_ids)
        return response

    def _response(self) -> dict:
        if self.req.kind == "chat":
            return chat_response(
                id_=self.id, created=self.created, model=self.req.model,
                text=self.content if self.tool_calls else self.text.text,
                finish_reason=self.finish_reason, usage_=self.usage(),
                logprobs=self.logprob_entries if self.req.logprobs else None, tool_calls=self.tool_calls or None,
            )  # fmt: skip
        entries = self._prompt_entries() + self.logprob_entries if self.echo else self.logprob_entries
        return completion_response(
            id_=self.id, created=self.created, model=self.req.model, text=self.echo_text + self.text.text,
            finish_reason=self.finish_reason, usage_=self.usage(),
            logprobs=self._completion_logprobs(entries, 0) if self.req.logprobs else None,
        )  # fmt: skip

    async def run(self, emit: Callable[[str], Awaitable[None]] | None) -> None:
        """Generate; ``emit`` (streaming) is awaited with each new piece of text.

        Raises:
          ApiError: 503 (no route, the swarm busy or failing), 504 (no answer in time).
        """
        state, req, vocab = self.state, self.req, self.prompt.vocab
        sampling = sampling_params(req)
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
            if self.score_only:
                return True  # (the one token a session must make is not shown or counted)
            self.completion_tokens += 1
            self.token_ids.append(token)
            self._unsent_token_ids.append(token)
            if token in eog:
                return False  # the session ends on it by itself; its text is not shown
            self._logprobs(token, logits)
            text = self._showable(self.text.feed(vocab.piece(token)), final=False)
            if emit is not None and (
                text or self._unsent_logprobs or (self._unsent_token_ids and req.return_token_ids)
            ):
                await emit(text)
            return self.text.stopped

        state.metrics.session_started()
        state.live_sessions += 1
        try:
            # in line with every other request for a free sequence, first come, first served
            with trio.fail_after(state.config.generation_timeout_s), state.queue.ticket() as ticket:
                result = await state.client.generate_tokens(
                    self.prompt.entry.sha256, self.prompt.tokens, max_tokens=1 if self.score_only else self.prompt.max_tokens,
                    stop_tokens=[] if req.options.ignore_eos else sorted(eog), sampling=sampling, seed=self.seed,
                    on_token=on_token, queue=ticket, constraint=self.constraint,
                    prompt_scores=self._score_prompt if self.echo and req.logprobs else None,
                    prefix_salt=self.principal.prefix_salt,  # its key's prefixes only, unless shareable
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
        self.cached_tokens = result.cached_tokens
        released = self.text.finish()
        self._parse_calls()
        tail = self._showable(released, final=True)
        if emit is not None and tail:
            await emit(tail)
        if emit is not None and self._echo_unsent:
            await emit("")  # an echo with nothing generated after it
        stopped = self.text.stopped or result.stopped_by_token
        self.finish_reason = (
            "tool_calls" if self.tool_calls else "stop" if stopped and not self.score_only else "length"
        )
        now = state.now_s()
        hops = [(h["node"], h["begin"], h["end"], h["rows"]) for h in result.hop_rows]
        state.store.credit(self.id, result.model_sha256, hops, self.prompt.entry.n_layer, now)
        state.metrics.observe_tokens(len(self.prompt.tokens), self.completion_tokens)
        state.metrics.record_completion_tokens(self.completion_tokens, now)
