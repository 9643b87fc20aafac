"""A model run through local range workers: ``baton demo --local``, without a swarm.

Owns the I/O of the local demo: starting one worker per range (and one unsplit worker to
compare with), pushing each step through the chain hop by hop, timing the steps, and
streaming text. Decisions (rows per step, next token, when to stop) are made by
``agent.core.owner.generation.GreedyGeneration``; range arithmetic by ``agent.core.wire.ranges``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Awaitable, Callable, Sequence

import trio

from agent.core.owner.generation import GreedyGeneration
from agent.core.owner.parity import next_hop_entries
from agent.core.owner.text_stream import whole_utf8
from agent.core.wire.ranges import LayerRange, ranges_from_cuts
from agent.core.wire.worker_records import SeqOutput
from agent.harness.parity_run import open_workers
from agent.io.worker.client import AsyncWorkerClient
from agent.io.worker.process import open_worker
from agent.models import cached_sha256

__all__ = ["DEMO_PROMPT", "ChainRun", "DemoReport", "even_cuts", "generate_through", "run_demo"]

DEMO_PROMPT = "The three most useful things to know about volunteer computing are"


def even_cuts(n_layer: int, n_ranges: int) -> list[int]:
    """Cut points giving ``n_ranges`` ranges of (nearly) equal block counts."""
    if not 1 <= n_ranges <= n_layer:
        raise ValueError(f"cannot cut {n_layer} blocks into {n_ranges} ranges")
    return [round(i * n_layer / n_ranges) for i in range(1, n_ranges)]


@dataclasses.dataclass
class ChainRun:
    """Tokens generated through one chain of workers, and how long the steps took."""

    tokens: list[int]
    prefill_tokens: int
    prefill_s: float
    decode_steps: int
    decode_s: float

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else 0.0


async def unsplit_greedy(path: str | os.PathLike, prompt: str, max_new_tokens: int) -> tuple[list[int], list[int]]:
    """``prompt``'s tokens and its greedy continuation (at most ``max_new_tokens``, to an
    end-of-generation token) from one worker holding the whole model at ``path``: what every
    split of the model must give."""
    async with open_worker(path, 0, None, threads=1, max_sequences=1, model_sha256=cached_sha256(path)) as single:
        tokens = await single.client.tokenize(prompt, add_special=True)
        run = await generate_through([single.client], tokens, max_new_tokens, stop_tokens=single.info.eog_token_ids)
    return tokens, run.tokens


async def generate_through(
    chain: Sequence[AsyncWorkerClient],
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    stop_tokens: Sequence[int] = (),
    seq_id: int = 0,
    on_token: Callable[[int], Awaitable[None]] | None = None,
    top_k: int = 0,
    run_ahead: bool = False,
) -> ChainRun:
    """Greedy generation of ``prompt`` through ``chain`` (range workers in order, the first
    taking tokens, the last giving logits): one Forward per hop per step. ``top_k`` > 0: the
    last range returns only each step's top-K (the same greedy tokens; K entries a reply, not
    n_vocab floats). ``run_ahead`` (one worker holding the whole model, ``top_k`` > 0): the
    worker decodes the steps after the prompt's by itself (``AsyncWorkerClient.forward_run_ahead``);
    the same tokens, without this task's turn between steps.

    The sequence is removed from every worker before returning.

    Cancellation:
      Safe to cancel; the sequence is then left on the workers (remove it before reuse).
    """
    gen = GreedyGeneration(seq_id, prompt, max_new_tokens, stop_tokens, top_k=top_k)
    if run_ahead:
        if len(chain) != 1 or top_k < 1:
            raise ValueError("run_ahead needs one worker holding the whole model and top_k >= 1")
        return await _generate_run_ahead(chain[0], gen, on_token)
    prefill_s = decode_s = 0.0
    steps = 0
    while not gen.finished:
        hop = [gen.next_input()]
        started = time.perf_counter()
        out: list[SeqOutput] = []
        for i, client in enumerate(chain):
            out = await client.forward(hop)
            if i + 1 < len(chain):
                hop = next_hop_entries(hop, out)
        elapsed = time.perf_counter() - started
        if steps == 0:
            prefill_s = elapsed
        else:
            decode_s += elapsed
        steps += 1
        token = gen.accept(out[0])
        if on_token is not None:
            await on_token(token)  # outside the timed part
    for client in chain:
        await client.remove_sequence(seq_id)
    return ChainRun(
        tokens=gen.generated,
        prefill_tokens=gen.prompt_len,
        prefill_s=prefill_s,
        decode_steps=steps - 1,
        decode_s=decode_s,
    )


async def _generate_run_ahead(
    client: AsyncWorkerClient, gen: GreedyGeneration, on_token: Callable[[int], Awaitable[None]] | None
) -> ChainRun:
    """``generate_through``'s loop as one run-ahead: the prompt's Forward, then the worker's
    own steps. Timed as there: prefill to the first output, decode from it to the last."""
    marks: list[float] = []

    async def on_output(out: SeqOutput) -> bool:
        token = gen.accept(out)
        marks.append(time.perf_counter())
        if on_token is not None:
            await on_token(token)  # while the worker computes the next step
        return not gen.finished

    started = time.perf_counter()
    while not gen.finished:  # once, unless the worker stopped at its context
        entry = gen.next_input()
        await client.forward_run_ahead(entry, gen.max_new_tokens - len(gen.generated) - 1, gen.stop_tokens, on_output)
    await client.remove_sequence(gen.seq_id)
    return ChainRun(
        tokens=gen.generated,
        prefill_tokens=gen.prompt_len,
        prefill_s=marks[0] - started,
        decode_steps=len(marks) - 1,
        decode_s=marks[-1] - marks[0],
    )


@dataclasses.dataclass
class DemoReport:
    ranges: list[LayerRange]
    prompt: str
    text: str
    split: ChainRun
    single: ChainRun

    @property
    def tokens_equal_single_process(self) -> bool:
        return self.split.tokens == self.single.tokens

    def to_json(self) -> dict:
        return {
            "route": [{"node": f"local-worker-{i}", "begin": r.begin, "end": r.end} for i, r in enumerate(self.ranges)],
            "prompt": self.prompt,
            "text": self.text,
            "tokens": self.split.tokens,
            "tokens_per_s": self.split.decode_tokens_per_s,
            "prefill_tokens_per_s": self.split.prefill_tokens_per_s,
            "single_process_tokens_per_s": self.single.decode_tokens_per_s,
            "tokens_equal_single_process": self.tokens_equal_single_process,
        }


async def run_demo(
    model_path: str | os.PathLike,
    *,
    ranges: int = 3,
    cuts: Sequence[int] | None = None,
    prompt: str = DEMO_PROMPT,
    max_new_tokens: int = 48,
    threads: int = 1,
    on_text: Callable[[str], None] | None = None,
    **worker_options,
) -> DemoReport:
    """Generate from ``prompt`` through range workers on this machine, then once through
    one unsplit worker, and report both (text streamed through ``on_text`` as it comes).

    Resource handling:
      Every worker started here is stopped before this returns or raises.
    """
    sha256 = await trio.to_thread.run_sync(cached_sha256, model_path)
    options = dict(threads=threads, max_sequences=1, model_sha256=sha256, **worker_options)
    async with open_workers(model_path, [(0, None)], **options) as (single,):
        n_layer = single.info.n_layer
        cut_list = list(cuts) if cuts is not None else even_cuts(n_layer, ranges)
        layer_ranges = ranges_from_cuts(n_layer, cut_list)
        prompt_tokens = await single.client.tokenize(prompt, add_special=True)
        stop = single.info.eog_token_ids
        async with open_workers(model_path, [(r.begin, r.end) for r in layer_ranges], **options) as chain:
            clients = [h.client for h in chain]
            streamed: list[int] = []
            shown = ""

            async def stream(token: int) -> None:
                # detokenize the whole suffix: a token may end in the middle of a UTF-8 character
                nonlocal shown
                streamed.append(token)
                text = whole_utf8(await clients[0].detokenize(streamed))
                if on_text is not None and text.startswith(shown) and len(text) > len(shown):
                    on_text(text[len(shown) :])
                    shown = text

            split = await generate_through(clients, prompt_tokens, max_new_tokens, stop_tokens=stop, on_token=stream)
        single_run = await generate_through([single.client], prompt_tokens, max_new_tokens, stop_tokens=stop)
        text = (await single.client.detokenize(split.tokens)).decode("utf-8", "replace")
    return DemoReport(ranges=layer_ranges, prompt=prompt, text=text, split=split, single=single_run)
