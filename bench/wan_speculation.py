"""``bench/wan.py --only speculation``: speculative decoding across the lab's Baton 3-split at
``--prefill-rtt-ms``, against the same sessions without it, in one run.

One owner (a client of one swarm: tracker on ``tracker``, nodes on n1..n3, the owner on
``owner``, its config switched per variant), greedy, ``SPECULATION_NEW_TOKENS`` tokens, two
tasks:
- copy-heavy: a code block, then the request to write it again with one name changed (the
  output copies its input: prompt-lookup drafts should be accepted);
- free-form: a story's opening (drafts rarely match: the draft length must back off).
Each ``--turns`` turns in rotating order, without speculation (the default: the last hop
continues the session itself) and with ``speculate_tokens`` = ``SPECULATE_TOKENS`` (the owner
drafts, one trip verifies). The figures: decode tokens/s (the client's, tokens over the
decode's wall time), drafted and accepted tokens, trips (data-plane steps), and whether the
two variants' tokens are identical (they must be). Targets: copy-heavy >= 2x without
speculation, free-form >= 0.95x.

Owns no lab or swarm helper (``wan`` does); ``wan`` imports it only for ``--only speculation``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import trio
from common import log

from agent.core.lab.topology import LinkChange
from agent.io.client import SwarmClientConfig
from agent.io.lab.harness import Lab
from agent.models import model_path

SPECULATION_NEW_TOKENS = 256
SPECULATE_TOKENS = 8
VARIANTS = ("plain", "speculative")
ROWS_MEASURED = (1, 2, 3, 5, 9)  # a verification step's rows: the last token and 0, 1, 2, 4, 8 drafts
ROWS_REPEATS = 8
ALIAS = "smollm2"
COPY_TARGET = 2.0  # speculative / plain decode tokens/s on the copy-heavy task
FREE_TARGET = 0.95  # ... and on the free-form one

_CODE = '''def summarize_orders(orders, tax_rate, currency="EUR"):
    """Totals per customer, with tax, rounded to cents."""
    totals = {}
    for order in orders:
        customer = order["customer"]
        amount = sum(line["price"] * line["quantity"] for line in order["lines"])
        amount = amount * (1 + tax_rate)
        totals[customer] = totals.get(customer, 0.0) + amount
    report = []
    for customer, amount in sorted(totals.items()):
        report.append(f"{customer}: {amount:.2f} {currency}")
    return "\\n".join(report)


def largest_customer(orders, tax_rate):
    """The customer who spent the most, with tax."""
    best, best_amount = None, 0.0
    for order in orders:
        amount = sum(line["price"] * line["quantity"] for line in order["lines"]) * (1 + tax_rate)
        if amount > best_amount:
            best, best_amount = order["customer"], amount
    return best
'''

TASKS = {
    "copy-heavy": (
        "Here is a Python module:\n\n```python\n" + _CODE + "```\n\n"
        "Rewrite the module with one change: the parameter tax_rate is renamed vat_rate everywhere. "
        "Keep everything else exactly as it is.\n\n```python\n"
    ),
    "free-form": "Write a short story about a lighthouse keeper who finds a message in a bottle.\n\n",
}


async def measure_speculation(lab: Lab, swarm, wan, args: argparse.Namespace) -> dict:
    """The section, inside the owner's machine (one trio run)."""
    wan.set_every_link(lab, LinkChange(delay_ms=0.0))  # the setup's many small calls, quickly
    async with contextlib.AsyncExitStack() as stack:
        client, route, _ = await wan.open_owner_section(stack, lab, swarm, 16)
        prompts = {}
        for task, text in TASKS.items():
            prompts[task], _stop = await client.tokenize(route, text, add_special=True)
        configs = {"plain": SwarmClientConfig(), "speculative": SwarmClientConfig(speculate_tokens=SPECULATE_TOKENS)}
        wan.set_every_link(lab, LinkChange(delay_ms=args.prefill_rtt_ms / 2))
        measured_rtt = statistics.median(await trio.to_thread.run_sync(wan.tcp_rtt_ms, lab, "owner", "n1", 20))

        async def run(task: str, variant: str, new_tokens: int) -> dict:
            client.config = configs[variant]
            result = await client.generate_tokens(wan.ALIAS, prompts[task], max_tokens=new_tokens)
            return {
                "decode_tps": result.tokens_per_s, "first_token_s": result.first_token_s,
                "tokens": list(result.tokens), "drafted": result.drafted_tokens, "accepted": result.accepted_tokens,
                "trips": result.data_plane_steps, "continued": result.continued_steps,
            }  # fmt: skip

        for task in TASKS:  # warm: connections made, workers paged in
            for variant in VARIANTS:
                await run(task, variant, 8)
        turns: dict[str, dict[str, list[dict]]] = {task: {v: [] for v in VARIANTS} for task in TASKS}
        for turn in range(args.turns):
            for task in TASKS:
                order = VARIANTS[turn % 2 :] + VARIANTS[: turn % 2]
                for variant in order:
                    figure = await run(task, variant, SPECULATION_NEW_TOKENS)
                    turns[task][variant].append(figure)
                log(
                    f"speculation turn {turn + 1} {task}: "
                    + ", ".join(f"{v} {turns[task][v][-1]['decode_tps']:.1f} t/s" for v in VARIANTS)
                    + f" (accepted {turns[task]['speculative'][-1]['accepted']}"
                    f" of {turns[task]['speculative'][-1]['drafted']})"
                )
        rows_ms = await _rows_compute_ms(args.threads)
    tasks = {}
    for task, by_variant in turns.items():
        medians = {v: statistics.median(f["decode_tps"] for f in figures) for v, figures in by_variant.items()}
        tokens = {tuple(f["tokens"]) for figures in by_variant.values() for f in figures}
        tasks[task] = {
            "turns": {v: [{k: x for k, x in f.items() if k != "tokens"} for f in fs] for v, fs in by_variant.items()},
            "decode_tps": medians,
            "speculative_over_plain": medians["speculative"] / medians["plain"],
            "tokens_identical": len(tokens) == 1,
            "generated_tokens": len(next(iter(tokens))),
            "prompt_tokens": len(prompts[task]),
        }
    return {
        "rtt_ms": args.prefill_rtt_ms, "measured_rtt_ms": measured_rtt, "new_tokens": SPECULATION_NEW_TOKENS,
        "speculate_tokens": SPECULATE_TOKENS, "tasks": tasks, "rows_compute_ms": rows_ms,
        "targets": {"copy-heavy": COPY_TARGET, "free-form": FREE_TARGET},
        "route": [[h.begin, h.end] for h in route.hops],
    }  # fmt: skip


async def _rows_compute_ms(threads: int) -> dict[int, float]:
    """What a verification step's rows cost to compute here: the unsplit worker's Forward of
    ``rows`` rows (every row's top-K) after a 100-token context, the median of
    ``ROWS_REPEATS``. On a GPU a row more is nearly free; on a CPU core it is not."""
    from agent.core.wire.worker_records import SeqInput
    from agent.io.worker.process import open_worker

    out = {}
    async with open_worker(model_path(ALIAS), 0, None, threads=threads, max_sequences=1) as worker:
        client = worker.client
        context = list(range(100, 200))
        await client.forward([SeqInput(seq_id=0, positions=list(range(100)), token_ids=context, top_k=40)])
        for rows in ROWS_MEASURED:
            times = []
            for _ in range(ROWS_REPEATS):
                await client.forward([
                    SeqInput(seq_id=0, positions=list(range(100, 100 + rows)), token_ids=context[:rows],
                             logit_rows=list(range(rows)), top_k=40)
                ])  # fmt: skip
                times.append(client.last_forward.compute_us / 1000)
                await client.trim_sequence(0, 100)
            out[rows] = statistics.median(times)
    return out


def speculation_markdown(p: dict) -> list[str]:
    lines = [
        f"## Speculative decoding: {p['new_tokens']} greedy tokens at {p['rtt_ms']:g} ms (Baton 3-split,"
        f" drafts of up to {p['speculate_tokens']} tokens from the context)",
        "",
    ]
    if "measured_at" in p:
        lines += [
            f"Measured {p['measured_at']} (`--only speculation`), {p['machine']['cpu_model']},"
            f" {p['machine']['cores']} cores; measured RTT {p['measured_rtt_ms']:.1f} ms.",
            "",
        ]
    lines += [
        "| task | turn | plain t/s | speculative t/s | drafted | accepted | trips (speculative) |",
        "|---|---|---|---|---|---|---|",
    ]
    for task, t in p["tasks"].items():
        for i, (plain, spec) in enumerate(zip(t["turns"]["plain"], t["turns"]["speculative"])):
            lines.append(
                f"| {task} | {i + 1} | {plain['decode_tps']:.1f} | {spec['decode_tps']:.1f} | {spec['drafted']}"
                f" | {spec['accepted']} | {spec['trips']} |"
            )
    lines.append("")
    for task, t in p["tasks"].items():
        target = p["targets"][task]
        met = "met" if t["speculative_over_plain"] >= target else "missed"
        lines.append(
            f"- {task} ({t['prompt_tokens']}-token prompt, {t['generated_tokens']} tokens generated): speculative"
            f" **{t['speculative_over_plain']:.2f}x** plain (target >= {target:g}x: {met}); tokens identical"
            f" in every run: {t['tokens_identical']}."
        )
    rows = p["rows_compute_ms"]
    one = rows.get("1", rows.get(1))
    lines += [
        "",
        "What a verification step's rows cost to compute here (the unsplit worker, every row's top-K):",
        "",
        "| rows | " + " | ".join(str(r) for r in rows) + " |",
        "|---|" + "---|" * len(rows),
        "| compute ms | " + " | ".join(f"{v:.1f}" for v in rows.values()) + " |",
        "| of one row | " + " | ".join(f"{v / one:.2f}x" for v in rows.values()) + " |",
    ]
    return lines
