"""Grammar-constrained decoding: which tokens a session may draw next, from a JSON schema or a
Lark grammar, by llguidance.

Owns:
- ``GrammarTokenizer``: a model's vocabulary (the vocab worker's pieces and attributes) as
  llguidance's tokenizer, built once per model (~0.1 s for 49,152 tokens);
- ``compile_json_schema`` / ``compile_lark``: a request's schema or grammar checked and compiled
  into llguidance's grammar text, or a ``GrammarError`` saying what the engine refused;
- ``TokenConstraint``: one session's matcher: the allowed-token mask of the next draw
  (``allowed``), advanced by each accepted token (``accept``), and whether it is done.

Why llguidance (pinned in pyproject.toml): it is the grammar engine llama.cpp itself links for
its optional ``%llguidance`` path, so a schema means here what it means to llama.cpp's server;
it compiles JSON schemas (with ``strict`` semantics: no extra properties) and Lark grammars
(tool calls wrap a schema in a model's own markers), computes a mask over a 150k vocabulary in
tens of microseconds, and installs from PyPI as one self-contained wheel. xgrammar needs torch
for its masks' best path; outlines-core compiles an index per schema up front (seconds for
large schemas), which a relay serving arbitrary schemas per request cannot wait for.

Pure: llguidance and numpy, no I/O. Must not import trio, sockets, clocks or agent.io.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import llguidance
import numpy as np

from agent.core.wire.worker_records import TokenAttr, Vocabulary

__all__ = [
    "GrammarError",
    "GrammarTokenizer",
    "TokenConstraint",
    "close_objects",
    "compile_json_schema",
    "compile_lark",
    "json_schema_lark",
]

#: JSON is written compactly (``, `` and ``: `` separators, no other whitespace): a grammar
#: that allowed free whitespace would let a weak model spend its whole budget on spaces and
#: newlines and end with unfinished JSON.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """The grammar engine refused a schema or grammar; the message says why."""


class GrammarTokenizer:
    """A vocabulary as llguidance's tokenizer.

    Tokens whose piece the stream never shows (control tokens: an empty piece) are marked
    special (llguidance's 0xFF prefix), so grammar text never matches them. A user-defined
    token (Qwen's ``<tool_call>``) shows its text in the stream, so it stays text here: a
    grammar's ``"<tool_call>"`` may be written with it, as the model writes it. (llguidance's
    llama.cpp binding marks ``<...>`` user-defined tokens special; there the text a grammar
    matches is the model's, here it is the stream's.) ``eos_token_ids`` (the model's end-of-generation tokens) end a grammar that
    is complete.

    Raises:
      ValueError: the vocabulary has no end-of-generation token.
    """

    def __init__(self, vocabulary: Vocabulary) -> None:
        if not vocabulary.eog_token_ids:
            raise ValueError("constrained decoding needs an end-of-generation token; the vocabulary has none")
        tokens: list[bytes] = []
        byte_token: dict[int, int] = {}
        for token, (piece, attr) in enumerate(zip(vocabulary.pieces, vocabulary.attrs)):
            if attr & TokenAttr.CONTROL or not piece:
                tokens.append(b"\xff<special_" + str(token).encode() + b">")
                continue
            tokens.append(piece)
            if len(piece) == 1:
                byte_token.setdefault(piece[0], token)
        self.n_vocab = vocabulary.n_vocab
        self.eos_token_ids = tuple(sorted(vocabulary.eog_token_ids))

        def by_bytes(text: bytes | str) -> list[int]:
            data = text.encode("utf-8") if isinstance(text, str) else text
            return [byte_token[b] for b in data if b in byte_token]

        # llguidance tokenizes text the grammar forces and allows only that tokenization's first
        # token there, so the tokenizer must write text as a model would: the longest token
        # at each point (llguidance's own trie, built once over byte tokens) comes close to
        # the model's BPE, where byte by byte would force one token a byte
        bytewise = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_source(tokens, self.eos_token_ids[0], vocabulary.bos_token_id, by_bytes)),
            n_vocab=self.n_vocab,
            eos_token=list(self.eos_token_ids),
        )

        def longest_first(text: bytes | str) -> list[int]:
            if isinstance(text, bytes):
                try:
                    text = text.decode("utf-8")
                except UnicodeDecodeError:
                    return by_bytes(text)
            return list(bytewise.greedy_tokenize(text))

        wrapper = llguidance.TokenizerWrapper(
            _source(tokens, self.eos_token_ids[0], vocabulary.bos_token_id, longest_first)
        )
        self.llg = llguidance.LLTokenizer(wrapper, n_vocab=self.n_vocab, eos_token=list(self.eos_token_ids))


def close_objects(schema: Any) -> Any:
    """``schema`` with every object schema that lists ``properties`` but says nothing of
    others closed (``additionalProperties: false``), as llama.cpp's JSON-schema-to-grammar
    reads such a schema: what a client means by listing the fields it wants, and what keeps
    a generation from wandering into keys no one asked for."""
    if isinstance(schema, list):
        return [close_objects(item) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    closed = {key: close_objects(value) for key, value in schema.items()}
    if isinstance(schema.get("properties"), Mapping) and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


def _source(tokens: list[bytes], eos: int, bos: int | None, tokenize: Callable[[bytes | str], list[int]]) -> Any:
    """What ``llguidance.TokenizerWrapper`` reads of a tokenizer: ids, pieces and a tokenize call."""

    class Source:
        eos_token_id = eos
        bos_token_id = bos

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, text: bytes | str) -> list[int]:
            return tokenize(text)

    return Source()


def _check(grammar: str, tokenizer: GrammarTokenizer | None) -> str:
    error = llguidance.LLMatcher.validate_grammar(grammar, None if tokenizer is None else tokenizer.llg)
    if error and not error.startswith("WARNING"):
        raise GrammarError(error)
    return grammar


def compile_json_schema(schema: Mapping[str, Any] | bool, tokenizer: GrammarTokenizer | None = None) -> str:
    """llguidance's grammar for JSON values that ``schema`` accepts.

    Raises:
      GrammarError: the engine cannot compile the schema (the message says where and why).
    """
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(close_objects(schema)),
            defaults=JSON_OPTIONS,  # type: ignore[arg-type]
        )
    except (ValueError, TypeError, RuntimeError) as error:
        raise GrammarError(str(error)) from None
    return _check(grammar, tokenizer)


def json_schema_lark(schema: Mapping[str, Any]) -> str:
    """A Lark rule body that matches JSON ``schema`` accepts (llguidance's ``%json``), written
    compactly as ``compile_json_schema`` writes it; embed it in a grammar with markers."""
    return "%json " + json.dumps({"x-guidance": JSON_OPTIONS, **close_objects(schema)})


def compile_lark(lark: str, tokenizer: GrammarTokenizer | None = None) -> str:
    """llguidance's grammar for the Lark grammar ``lark`` (its ``start`` rule).

    Raises:
      GrammarError: the engine cannot compile it.
    """
    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    except (ValueError, TypeError, RuntimeError) as error:
        raise GrammarError(str(error)) from None
    return _check(grammar, tokenizer)


class TokenConstraint:
    """One session's grammar state: which tokens may come next.

    Raises:
      GrammarError: the grammar does not build a matcher on this tokenizer.
    """

    def __init__(self, tokenizer: GrammarTokenizer, grammar: str) -> None:
        self.n_vocab = tokenizer.n_vocab
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)
        self._matcher = llguidance.LLMatcher(tokenizer.llg, grammar, log_level=0)
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())

    def allowed(self) -> np.ndarray:
        """A bool mask ``[n_vocab]`` of the tokens the grammar accepts next (the model's
        end-of-generation tokens where the grammar is complete).

        Raises:
          GrammarError: the matcher is in an error state (a token it refused was accepted).
        """
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())
        words = np.frombuffer(self._matcher.compute_bitmask(), dtype="<u4")
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")
        return bits[: self.n_vocab].astype(bool)

    def accept(self, token: int) -> None:
        """Advance past ``token`` (one the mask allowed).

        Raises:
          GrammarError: the grammar refuses ``token``.
        """
        if token in self.eos_token_ids and self._matcher.is_accepting():
            self._matcher.consume_token(token)
            return
        if not self._matcher.consume_token(token):
            raise GrammarError(f"the grammar refuses token {token}: {self._matcher.get_error()}")

    def rollback(self, tokens: int) -> None:
        """Undo the last ``tokens`` accepted (tokens taken back after a failed integrity check).

        Raises:
          GrammarError: the matcher cannot go back that far.
        """
        if not self._matcher.rollback(tokens):
            raise GrammarError(f"the grammar cannot take back {tokens} tokens: {self._matcher.get_error()}")

    @property
    def accepting(self) -> bool:
        """The text so far is a complete match (an end-of-generation token may end it)."""
        return bool(self._matcher.is_accepting())

    @property
    def done(self) -> bool:
        """Nothing more may follow (the matcher stopped: complete and closed, or failed)."""
        return bool(self._matcher.is_stopped())
