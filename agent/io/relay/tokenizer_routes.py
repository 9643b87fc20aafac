"""The relay's ``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` handlers: a model's own
tokenizer (its vocab worker) over HTTP, as llama.cpp's server and vLLM serve it (the bodies and
answers are ``agent.core.relay.tokenizer_api``'s).

Must not import the relay's app or server.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse

from agent._proto import swarm_pb2
from agent.core.owner.chat_template import ChatTemplateError
from agent.core.relay.openai_api import ApiError
from agent.core.relay.tokenizer_api import detokenize_reply, parse_detokenize, parse_tokenize, tokenize_reply
from agent.io.worker.vocab import ModelVocab, VocabularyError

from .completion import served_context_of
from .state import RelayState

__all__ = ["detokenize", "tokenize", "tokenizer_info"]


async def _entry(state: RelayState, model: str | None) -> swarm_pb2.ModelEntry:
    if model is not None:
        return await state.model(model)
    models = await state.models()
    if len(models) != 1:
        raise ApiError(400, f"'model' is needed: this relay serves {len(models)} models", param="model")
    return models[0]


async def _vocab(state: RelayState, entry: swarm_pb2.ModelEntry) -> ModelVocab:
    try:
        return await state.vocabularies.get(entry.sha256)
    except VocabularyError as error:
        raise ApiError(503, str(error)) from None


async def tokenize(state: RelayState, body: object) -> JSONResponse:
    req = parse_tokenize(body)
    entry = await _entry(state, req.model)
    vocab = await _vocab(state, entry)
    text = req.text
    if req.messages is not None:
        if vocab.chat_template is None:
            raise ApiError(400, f"the model has no usable chat template: {vocab.chat_template_error}", param="messages")
        try:
            text = vocab.chat_template.render(list(req.messages), add_generation_prompt=req.add_generation_prompt)
        except ChatTemplateError as error:
            raise ApiError(400, str(error), param="messages") from None
    try:
        tokens = await vocab.tokenize(text or "", add_special=req.add_special)
    except VocabularyError as error:
        raise ApiError(503, str(error)) from None
    pieces = [vocab.piece(t) for t in tokens]
    context = await served_context_of(state, entry)
    return JSONResponse(tokenize_reply(tokens, pieces, max_model_len=context, with_pieces=req.with_pieces))


async def detokenize(state: RelayState, body: object) -> JSONResponse:
    model, _ = parse_detokenize(body)
    entry = await _entry(state, model)
    vocab = await _vocab(state, entry)
    _, tokens = parse_detokenize(body, vocab.n_vocab)
    text = b"".join(vocab.piece(t) for t in tokens).decode("utf-8", errors="replace")
    return JSONResponse(detokenize_reply(text))


async def tokenizer_info(state: RelayState, request: Request) -> JSONResponse:
    entry = await _entry(state, request.query_params.get("model"))
    vocab = await _vocab(state, entry)
    return JSONResponse({
        "model": entry.alias or entry.name or entry.sha256,
        "tokenizer_class": "llama.cpp",
        "bos_token": vocab.bos_token or None, "eos_token": vocab.eos_token or None, "pad_token": None,
        "add_bos_token": vocab.vocabulary.add_bos, "chat_template": vocab.chat_template_source or None,
        "model_max_length": await served_context_of(state, entry), "vocab_size": vocab.n_vocab,
    })  # fmt: skip
