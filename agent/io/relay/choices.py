"""A request's choices: ``n`` choices for each of its prompts (a list of prompts is the
completions API's batch), each one ``Completion`` run on a session of its own, all at once,
as one response or one stream.

The prompt's KV is not shared between a prompt's choices: the swarm has no operation that
copies a session's cache on every hop yet (the worker's ``CopySequence`` is not reachable from
the owner), so each choice prefills its prompt again. Choice ``j`` of a seeded request draws
with seed ``seed + j`` (choice 0 as the same request with ``n`` 1 would).

Must not import the relay's app or server; the HTTP side is ``agent.io.relay.responses``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

import trio

from agent.core.relay.openai_api import CompletionRequest, usage

from .auth import Principal
from .completion import Completion, Prompt, prepare
from .state import RelayState

__all__ = ["Choices", "prepare_prompts"]


async def prepare_prompts(state: RelayState, req: CompletionRequest) -> list[Prompt]:
    """One ``Prompt`` for each of the request's prompts (a chat has one), in order."""
    prompts = req.options.prompts if req.kind == "completion" and len(req.options.prompts) > 1 else (req.prompt,)
    return [await prepare(state, dataclasses.replace(req, prompt=p)) for p in prompts]


class Choices:
    """Every choice of one request; the face of ``Completion`` that ``CompletionResponse`` uses
    (``run``, chunks, ``response``, usage), with each chunk naming its choice's index."""

    def __init__(self, state: RelayState, req: CompletionRequest, prompts: list[Prompt], principal: Principal) -> None:
        self.state = state
        self.req = req
        self.prompts = prompts
        n = req.options.n
        self.parts: list[Completion] = []
        for p, prompt in enumerate(prompts):
            given = req.prompt if len(prompts) == 1 else req.options.prompts[p]
            for j in range(n):
                seed = None if req.seed is None else (req.seed + j) % 2**64
                part = Completion(
                    state, dataclasses.replace(req, prompt=given), prompt, principal, index=p * n + j, seed=seed,
                    prompt_text=given if isinstance(given, str) else None,
                )  # fmt: skip
                self.parts.append(part)
        first = self.parts[0]
        for part in self.parts[1:]:  # one id and time for the whole response
            part.id, part.created = first.id, first.created
        self.id = first.id
        self._emitting = trio.Lock()  # one chunk at a time goes out, whichever choice made it

    @property
    def completion_tokens(self) -> int:
        return sum(part.completion_tokens for part in self.parts)

    @property
    def prompt_tokens(self) -> int:
        """As OpenAI counts them: each prompt once, however many choices it has."""
        return sum(len(prompt.tokens) for prompt in self.prompts)

    async def run(self, emit: Callable[[str, int], Awaitable[None]] | None) -> None:
        """Run every choice at once; ``emit(text, index)`` as ``Completion.run``'s. The first
        error ends them all and is raised."""

        async def one(part: Completion) -> None:
            async def part_emit(text: str) -> None:
                assert emit is not None
                async with self._emitting:
                    await emit(text, part.index)

            await part.run(part_emit if emit is not None else None)

        if len(self.parts) == 1:
            await one(self.parts[0])
            return
        try:
            async with trio.open_nursery() as nursery:
                for part in self.parts:
                    nursery.start_soon(one, part)
        except BaseExceptionGroup as group:  # (strict exception groups) the first error, as for one choice
            errors = [e for e in group.exceptions if not isinstance(e, trio.Cancelled)]
            raise (errors or list(group.exceptions))[0] from None

    def chunk(self, text: str, index: int = 0) -> dict:
        return self.parts[index].chunk(text)

    def opening_chunks(self) -> list[dict]:
        """The role deltas a chat stream opens with, one a choice (none for completions)."""
        return [part.chunk("", role=True) for part in self.parts] if self.req.kind == "chat" else []

    def closing_chunks(self) -> list[dict]:
        """Each choice's last chunks: its tool calls (``delta.tool_calls``), if any, then its
        finish reason."""
        chunks = []
        for part in self.parts:
            if (calls := part.tool_calls_chunk()) is not None:
                chunks.append(calls)
            chunks.append(part.chunk("", part.finish_reason))
        return chunks

    def usage(self) -> dict:
        """Cached tokens as prompt tokens: each prompt's once (its first choice's)."""
        n = self.req.options.n
        return usage(self.prompt_tokens, self.completion_tokens, sum(part.cached_tokens for part in self.parts[::n]))

    def usage_chunk(self) -> dict:
        chunk = self.parts[0].usage_chunk()
        chunk["usage"] = self.usage()
        return chunk

    def response(self) -> dict:
        responses = [part.response() for part in self.parts]
        body = responses[0]
        body["choices"] = [r["choices"][0] for r in responses]
        body["usage"] = self.usage()
        return body
