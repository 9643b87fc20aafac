"""Local vocabularies for session owners (the relay, ``baton generate``): one vocab-only worker
per model, from the model's metadata alone.

Owns: fetching a model's GGUF metadata from the tracker (``model_metadata``), writing it into
a sparse file of the GGUF's size in the owner's cache (``agent.io.gguf_sparse``: the disk
holds only the metadata), starting a ``baton-worker --vocab-only`` on it, and reading once its
token pieces (so detokenizing a streamed token is a table lookup, with no round trip), its
end-of-generation tokens and, from the metadata, the chat template and the BOS / EOS texts.

``serve_vocabularies`` holds the workers for the relay's lifetime (its nursery, never one on
an object); ``VocabularyPool.get`` loads a model's vocabulary on first use (once, however many
requests ask at the same time) and hands it out after.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import trio

from agent.core.owner.chat_template import ChatTemplate, ChatTemplateError
from agent.core.wire.worker_records import Vocabulary
from agent.io.gguf_sparse import write_sparse_gguf
from agent.io.worker.client import AsyncWorkerClient
from agent.io.worker.error import WorkerError
from agent.io.worker.process import open_worker

__all__ = ["ModelVocab", "VocabularyError", "VocabularyPool", "serve_vocabularies"]

log = logging.getLogger(__name__)


class VocabularyError(Exception):
    """A model's vocabulary could not be loaded; the message says why."""


@dataclasses.dataclass
class ModelVocab:
    """What the relay needs of one model to turn text into tokens and back.

    ``chat_template`` is None when the GGUF has none (or it does not compile:
    ``chat_template_error`` says why).
    """

    sha256: str
    name: str
    alias: str
    n_layer: int
    context_length: int
    vocabulary: Vocabulary
    chat_template: ChatTemplate | None
    chat_template_error: str
    worker: AsyncWorkerClient
    request_timeout_s: float
    #: the texts of the BOS / EOS tokens in the GGUF ("" if none), and its template's source
    bos_token: str = ""
    eos_token: str = ""
    chat_template_source: str = ""

    @property
    def n_vocab(self) -> int:
        return self.vocabulary.n_vocab

    @property
    def eog_token_ids(self) -> frozenset[int]:
        return frozenset(self.vocabulary.eog_token_ids)

    def piece(self, token: int) -> bytes:
        return self.vocabulary.pieces[token] if 0 <= token < len(self.vocabulary.pieces) else b""

    async def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        """Token ids of ``text``, with BOS if the model adds it (unless ``add_special`` is
        False), special tokens parsed (as llama.cpp's server tokenizes a prompt).

        Raises:
          VocabularyError: the vocab worker failed (the pool loads it again on next use).
        """
        try:
            return await self.worker.tokenize(
                text, add_special=add_special, parse_special=True, timeout_s=self.request_timeout_s
            )
        except WorkerError as error:
            raise VocabularyError(f"the tokenizer of model {self.sha256[:12]} failed: {error}") from None


def _strftime_now(fmt: str) -> str:
    return time.strftime(fmt)


def _read_template_facts(path: Path) -> tuple[str | None, str, str]:
    """(chat template, BOS text, EOS text) from the GGUF metadata at ``path``."""
    from gguf import GGUFReader  # lazy: numpy-heavy

    reader = GGUFReader(path)

    def field(key: str):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    template = field("tokenizer.chat_template")
    tokens = reader.fields.get("tokenizer.ggml.tokens")

    def token_text(key: str) -> str:
        index = field(key)
        if index is None or tokens is None:
            return ""
        index = int(index)
        if not 0 <= index < len(tokens.data):
            return ""
        return tokens.contents(index)

    return (
        str(template) if template else None,
        token_text("tokenizer.ggml.bos_token_id"),
        token_text("tokenizer.ggml.eos_token_id"),
    )


class VocabularyPool:
    """Vocabularies by model sha256 (made by ``serve_vocabularies``)."""

    def __init__(self, send: trio.MemorySendChannel, request_timeout_s: float) -> None:
        self._send = send
        self._loaded: dict[str, ModelVocab] = {}
        self._loading: dict[str, trio.Event] = {}
        self._errors: dict[str, str] = {}
        self.request_timeout_s = request_timeout_s

    def loaded(self) -> dict[str, ModelVocab]:
        return dict(self._loaded)

    async def get(self, sha256: str) -> ModelVocab:
        """The vocabulary of model ``sha256``, loading it on first use.

        Raises:
          VocabularyError: it could not be loaded (the next call tries again).
        """
        if sha256 in self._loaded:
            return self._loaded[sha256]
        event = self._loading.get(sha256)
        if event is None:
            event = self._loading[sha256] = trio.Event()
            self._errors.pop(sha256, None)
            await self._send.send((sha256, event))
        await event.wait()
        if sha256 in self._loaded:
            return self._loaded[sha256]
        raise VocabularyError(self._errors.get(sha256, f"the vocabulary of {sha256} could not be loaded"))

    def _done(self, sha256: str, vocab: ModelVocab | None, error: str = "") -> None:
        if vocab is not None:
            self._loaded[sha256] = vocab
        else:
            self._errors[sha256] = error
        event = self._loading.pop(sha256, None)
        if event is not None:
            event.set()

    def _dropped(self, sha256: str) -> None:
        self._loaded.pop(sha256, None)


async def _hold_vocabulary(
    pool: VocabularyPool,
    sha256: str,
    fetch_metadata: Callable,
    cache_dir: Path,
    ready_timeout_s: float,
) -> None:
    """Load one model's vocabulary and keep its worker until cancelled."""
    try:
        meta = await fetch_metadata(sha256)
        path = cache_dir / f"{meta.model_sha256}.vocab.gguf"
        current = path.exists() and path.stat().st_size == meta.size_bytes
        if current:
            with open(path, "rb") as f:
                current = f.read(len(meta.metadata)) == bytes(meta.metadata)
        if not current:
            await trio.to_thread.run_sync(write_sparse_gguf, bytes(meta.metadata), meta.size_bytes, path)
        template_source, bos_text, eos_text = await trio.to_thread.run_sync(_read_template_facts, path)
    except Exception as error:
        log.warning("vocabulary of %s: %s", sha256, error)
        pool._done(sha256, None, f"the vocabulary of model {sha256} could not be fetched: {error}")
        return
    try:
        async with open_worker(
            path, 0, None, vocab_only=True, model_sha256=meta.model_sha256, ready_timeout_s=ready_timeout_s
        ) as handle:
            vocabulary = await handle.client.vocabulary(timeout_s=pool.request_timeout_s)
            template: ChatTemplate | None = None
            template_error = (
                "" if template_source else "the model's GGUF has no chat template (tokenizer.chat_template)"
            )
            if template_source:
                try:
                    template = ChatTemplate(
                        template_source, bos_token=bos_text, eos_token=eos_text, add_bos=vocabulary.add_bos,
                        strftime_now=_strftime_now,
                    )  # fmt: skip
                except ChatTemplateError as error:
                    template_error = str(error)
            pool._done(
                sha256,
                ModelVocab(
                    sha256=meta.model_sha256, name=meta.name, alias=meta.alias, n_layer=meta.n_layer,
                    context_length=meta.context_length, vocabulary=vocabulary, chat_template=template,
                    chat_template_error=template_error, worker=handle.client, request_timeout_s=pool.request_timeout_s,
                    bos_token=bos_text, eos_token=eos_text, chat_template_source=template_source or "",
                ),
            )  # fmt: skip
            log.info("vocabulary of %s loaded (%d tokens)", meta.model_sha256[:12], vocabulary.n_vocab)
            try:
                await handle.process.wait()  # normally never: held until the relay stops
                log.warning("vocabulary worker of %s exited: %s", sha256[:12], handle.log_tail(400))
            finally:
                pool._dropped(sha256)  # the next request loads it again
    except Exception as error:
        log.warning("vocabulary worker of %s: %s", sha256, error)
        pool._dropped(sha256)
        pool._done(sha256, None, f"the vocabulary worker of model {sha256} failed: {error}")


async def serve_vocabularies(
    fetch_metadata: Callable,
    cache_dir: str | os.PathLike,
    *,
    request_timeout_s: float = 10.0,
    ready_timeout_s: float = 60.0,
    task_status: trio.TaskStatus[VocabularyPool] = trio.TASK_STATUS_IGNORED,  # type: ignore[name-defined]  # trio-typing's stale trio stubs
) -> None:
    """Serve vocabularies until cancelled; ``task_status.started`` gives the pool.

    Args:
      fetch_metadata: ``async (sha256) -> swarm_pb2.ModelMetadataReply`` (the tracker's).
      cache_dir: where the metadata-only GGUFs live (made owner-only if new).

    Resource handling:
      Every vocab worker is stopped when this is cancelled.
    """
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True, mode=0o700)
    send, receive = trio.open_memory_channel(64)
    pool = VocabularyPool(send, request_timeout_s)
    async with trio.open_nursery() as nursery:
        task_status.started(pool)
        async with receive:
            async for sha256, _event in receive:
                nursery.start_soon(_hold_vocabulary, pool, sha256, fetch_metadata, cache, ready_timeout_s)
