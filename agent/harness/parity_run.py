"""Parity driver: one unsplit worker against a chain of range workers, step by step.

Owns the I/O of a parity run: starting the workers (concurrently), tokenizing the prompt
text, sending each step's batch to the unsplit worker and through the chain (boundary rows
of range i are the input of range i + 1), and applying scenario edits on every worker.
Every decision (what a batch holds, what is compared, which token comes next, when to
edit) is made by ``agent.core.owner.parity.ParityRun``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import AsyncIterator, Sequence

import trio

from agent.core.owner.parity import (
    ParityError,
    ParityReport,
    ParityRun,
    Scenario,
    build_prompts,
    next_hop_entries,
    prompt_lengths,
    through_wire,
)
from agent.core.wire.boundary import WireDType
from agent.core.wire.ranges import ranges_from_cuts
from agent.core.wire.worker_records import SeqInput, SeqOutput
from agent.io.worker.client import AsyncWorkerClient
from agent.io.worker.process import WorkerHandle, open_worker
from agent.models import cached_sha256

__all__ = ["DEFAULT_PROMPT_TEXT", "compare_workers", "make_prompts", "open_workers", "run_parity"]

DEFAULT_PROMPT_TEXT = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a "
    "single step. In the beginning the universe was created; this has made a lot of people very "
    "angry and been widely regarded as a bad move. Once upon a time, in a small village by the sea,"
)

#: Positions of context each sequence gets beyond prompt + generated tokens.
CTX_SLACK = 16


@contextlib.asynccontextmanager
async def open_workers(
    model_path: str | os.PathLike, layers: Sequence[tuple[int, int | None]], **worker_options
) -> AsyncIterator[list[WorkerHandle]]:
    """Start one worker per ``(begin, end)`` concurrently; yield their handles in order.

    ``worker_options`` go to every ``open_worker`` call.

    Raises:
      ExceptionGroup: of ``WorkerStartError`` / ``WorkerBinaryNotFound`` when any worker
        fails to start (the others are stopped).

    Resource handling:
      Every worker lives until this context exits; then all are stopped (concurrently).

    Cancellation:
      Cancelling startup stops the workers already started.
    """
    handles: list[WorkerHandle | None] = [None] * len(layers)
    stop = trio.Event()

    async def hold(begin: int, end: int | None, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with open_worker(model_path, begin, end, **worker_options) as handle:
            task_status.started(handle)
            await stop.wait()

    async with trio.open_nursery() as holders:

        async def start_one(i: int) -> None:
            handles[i] = await holders.start(hold, *layers[i])

        try:
            async with trio.open_nursery() as starters:
                for i in range(len(layers)):
                    starters.start_soon(start_one, i)
            yield [h for h in handles if h is not None]
        finally:
            stop.set()


async def make_prompts(
    client: AsyncWorkerClient, sequences: int, prompt_tokens: int, text: str = DEFAULT_PROMPT_TEXT
) -> list[list[int]]:
    """Deterministic prompts of ``prompt_lengths(sequences, prompt_tokens)`` tokens: the
    tokenizer's special prefix (BOS, if the model adds one) then ``text`` repeated."""
    prefix = await client.tokenize("", add_special=True)
    body = await client.tokenize(text, add_special=False)
    if not body:
        raise ParityError(f"the worker's tokenizer gave no tokens for {text[:40]!r}...")
    return build_prompts(prefix, body, prompt_lengths(sequences, prompt_tokens))


async def _step(
    reference: AsyncWorkerClient,
    chain: Sequence[AsyncWorkerClient],
    names: Sequence[str],
    run: ParityRun,
    entries: Sequence[SeqInput],
    boundary_dtype: int = WireDType.F32,
) -> tuple[list[SeqOutput], list[SeqOutput]]:
    """One batch on both sides, concurrently: the unsplit worker, and the chain hop by hop
    (boundary rows between hops as they arrive after a swarm hop in ``boundary_dtype``)."""
    results: dict[str, list[SeqOutput]] = {}

    async def reference_step() -> None:
        results["reference"] = await reference.forward(entries)

    async def chain_step() -> None:
        hop = list(entries)
        for i, client in enumerate(chain):
            out = await client.forward(hop)
            if i + 1 < len(chain):
                run.check_outputs(names[i], out, logits=False)
                hop = through_wire(next_hop_entries(hop, out), boundary_dtype)
        results["chain"] = out

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reference_step)
        nursery.start_soon(chain_step)
    return results["reference"], results["chain"]


async def compare_workers(
    reference: AsyncWorkerClient,
    chain: Sequence[AsyncWorkerClient],
    prompts: Sequence[Sequence[int]],
    *,
    steps: int,
    scenario: Scenario | None = None,
    tolerance: float = 1e-4,
    boundary_dtype: int = WireDType.F32,
) -> ParityReport:
    """Run ``prompts`` through ``reference`` (one worker for all blocks) and through
    ``chain`` (range workers in order, the first taking tokens, the last giving logits),
    comparing logits at every step. ``boundary_dtype``: the swarm wire dtype the boundary
    rows cross each cut in (F16: rounded as ``agent.core.owner.parity.through_wire`` says).
    Sequence ids are 0..len(prompts)-1 and must be empty on
    every worker; they are removed again at the end.

    Cancellation:
      Safe to cancel between or during steps; the workers' sequences are then in an
      unknown state (remove them before reuse).
    """
    run = ParityRun(prompts, steps, scenario, tolerance=tolerance)
    ref_info = reference.cached_info or await reference.info()
    chain_infos = [c.cached_info or await c.info() for c in chain]
    ranges = [info.layers for info in chain_infos]
    if not chain or ranges[0].begin != 0 or ranges[-1].end != ref_info.n_layer:
        raise ParityError(f"the chain {[str(r) for r in ranges]} does not cover [0, {ref_info.n_layer})")
    for a, b in itertools.pairwise(ranges):
        if a.end != b.begin:
            raise ParityError(f"the chain has a gap or overlap between {a} and {b}")
    ref_name = f"unsplit worker {ref_info.layers}"
    names = [f"worker {r}" for r in ranges]
    active_after_edit: list[int] = []

    while not run.finished:
        entries = run.batch()
        ref_out, chain_out = await _step(reference, chain, names, run, entries, boundary_dtype)
        ref_rows = run.check_outputs(ref_name, ref_out, logits=True)
        cand_rows = run.check_outputs(names[-1], chain_out, logits=True)
        run.record(ref_rows, cand_rows)

        edit = run.pending_edit()
        if edit is not None:
            for client, name in ((reference, ref_name), *zip(chain, names)):
                for seq_id in edit.remove:
                    held = await client.remove_sequence(seq_id)
                    if held != 0:
                        raise ParityError(f"{name}: seq {seq_id} holds {held} positions after RemoveSequence")
                for seq_id, keep in edit.trim:
                    held = await client.trim_sequence(seq_id, keep)
                    if held != keep:
                        raise ParityError(f"{name}: seq {seq_id} holds {held} positions after trimming to {keep}")
                active_after_edit.append((await client.health()).active_sequences)
            run.apply_edit(edit)

    for client in (reference, *chain):
        for seq_id in run.live_seq_ids:
            await client.remove_sequence(seq_id)
    # (bytes: the run may end inside a character; shown with U+FFFD for the unfinished one)
    text = (await reference.detokenize(run.generated(0))).decode("utf-8", "replace")
    return run.report(
        ranges,
        text=text,
        architecture=ref_info.architecture,
        n_layer=ref_info.n_layer,
        recipe_hashes_equal=len({ref_info.recipe_hash, *(i.recipe_hash for i in chain_infos)}) == 1,
        active_sequences_after_edit=active_after_edit,
        boundary_dtype=WireDType(boundary_dtype).name,
    )


async def run_parity(
    model_path: str | os.PathLike,
    cuts: Sequence[int],
    *,
    sequences: int = 1,
    steps: int = 32,
    prompt_tokens: int = 40,
    scenario: Scenario | None = None,
    threads: int = 1,
    tolerance: float = 1e-4,
    prompt_text: str = DEFAULT_PROMPT_TEXT,
    ctx_size: int | None = None,
    batch_size: int | None = None,
    boundary_dtype: int = WireDType.F32,
    **worker_options,
) -> ParityReport:
    """Start an unsplit worker and one worker per range of ``cuts`` (all concurrently),
    run ``sequences`` prompts of different lengths for ``steps`` greedy steps on both sides
    (see ``agent.core.owner.parity``) and report how close they were.

    Args:
      model_path: the GGUF file.
      cuts: where to cut, e.g. ``[10, 20]`` for three ranges of a 30-block model.
      sequences, steps, prompt_tokens: the workload; prompts are mixed in every batch.
      scenario: remove / trim sequences in the middle of the run (``Scenario``).
      threads: threads per worker.
      tolerance: the largest max abs logits difference that passes.
      prompt_text: text the prompts are cut from.
      ctx_size, batch_size: worker limits; by default just enough for the workload.
      boundary_dtype: the wire dtype of boundary rows at each cut (``compare_workers``).
      worker_options: more ``open_worker`` keywords (``ready_timeout_s``, ``binary``, ...).

    Raises:
      ValueError: bad cuts, scenario or sizes (before anything starts, where possible).
      ExceptionGroup: of ``WorkerStartError``, ``WorkerError`` or ``ParityError``.

    Resource handling:
      Every worker process started here is stopped before this returns or raises.

    Cancellation:
      May be cancelled at any point; the workers are then stopped (see ``open_worker``).
    """
    cuts = list(cuts)
    # The cut rules that do not need n_layer, checked before any process starts.
    ranges_from_cuts(max(cuts, default=0) + 1, cuts)
    lengths = prompt_lengths(sequences, prompt_tokens)
    if scenario is not None:
        scenario.check(sequences, steps)
    if ctx_size is None:
        ctx_size = -(-(max(lengths) + steps + 1 + CTX_SLACK) // 64) * 64
    if batch_size is None and sum(lengths) > 512:
        batch_size = sum(lengths)
    sha256 = await trio.to_thread.run_sync(cached_sha256, model_path)
    ends: list[int | None] = [*cuts, None]
    layers: list[tuple[int, int | None]] = [(0, None), *zip([0, *cuts], ends)]
    async with open_workers(
        model_path,
        layers,
        threads=threads,
        ctx_size=ctx_size,
        max_sequences=sequences,
        batch_size=batch_size,
        model_sha256=sha256,
        **worker_options,
    ) as handles:
        reference, *chain = handles
        ranges_from_cuts(reference.info.n_layer, cuts)
        prompts = await make_prompts(reference.client, sequences, prompt_tokens, prompt_text)
        report = await compare_workers(
            reference.client,
            [h.client for h in chain],
            prompts,
            steps=steps,
            scenario=scenario,
            tolerance=tolerance,
            boundary_dtype=boundary_dtype,
        )
    report.extras["model_path"] = str(model_path)
    report.extras["threads"] = threads
    return report
