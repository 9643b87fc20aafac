"""``bench/wan.py --only prefill-chunks``: the time to first token of one long prompt through the
Baton 3-split across the lab, pipelined on the data plane, with the prompt in chunks of each of
``--chunk-sweep`` rows, at ``--prefill-rtt-ms`` with links unlimited and at
``--wire-rate-mbit``, in one run: what the owner's default chunk (``prefill_chunk_tokens``)
costs or saves on a WAN.

Why it matters: a copied prefix ends on a chunk boundary (the rest is computed in the very chunks
a session without the cache computes, so the tokens are the same), so the chunk bounds what a
prompt cache can save; the chunk also sets how well the route pipelines (hop i computes chunk
j + 1 while hop i + 1 computes chunk j) and how many rows a hop computes in one batch (on an
accelerator, fewer rows a batch use it less well).

One owner (``owner``), nodes on n1..n3, the same prompt every time; ``--turns`` turns, the chunk
sizes in rotating order each turn; the figure is the client's ``first_token_s``.

Owns no lab or swarm helper (``wan`` does); ``wan`` imports it only for ``--only prefill-chunks``.
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

NEW_TOKENS = 2


def _links(args: argparse.Namespace) -> dict[str, LinkChange]:
    """The link settings measured, by label: the RTT unlimited, and the RTT at the rate."""
    delay_ms = args.prefill_rtt_ms / 2
    return {
        "unlimited": LinkChange(delay_ms=delay_ms, rate_mbit=0.0),
        f"{args.wire_rate_mbit:g} Mbit/s": LinkChange(delay_ms=delay_ms, rate_mbit=args.wire_rate_mbit),
    }


async def measure_chunks(lab: Lab, swarm, wan, args: argparse.Namespace) -> dict:
    """The section, inside the owner's machine (one trio run)."""
    chunk_rows = [int(x) for x in args.chunk_sweep.split(",")]
    wan.set_every_link(lab, LinkChange(delay_ms=0.0, rate_mbit=0.0))  # the setup's many small calls, quickly
    links = _links(args)
    async with contextlib.AsyncExitStack() as stack:
        client, route, prompt = await wan.open_owner_section(stack, lab, swarm, args.prefill_tokens)
        configs = {
            rows: SwarmClientConfig(prefill_chunk_tokens=rows, prefill_chunks_in_flight=64) for rows in chunk_rows
        }
        sections = {}
        for label, change in links.items():
            wan.set_every_link(lab, change)
            measured_rtt = statistics.median(await trio.to_thread.run_sync(wan.tcp_rtt_ms, lab, "owner", "n1", 10))
            for rows in chunk_rows:  # warm: connections made, workers paged in
                client.config = configs[rows]
                await client.generate_tokens(wan.ALIAS, prompt, max_tokens=NEW_TOKENS)
            turns: dict[int, list[float]] = {rows: [] for rows in chunk_rows}
            tokens: set[tuple[int, ...]] = set()
            for turn in range(args.turns):
                order = chunk_rows[turn % len(chunk_rows) :] + chunk_rows[: turn % len(chunk_rows)]
                for rows in order:
                    client.config = configs[rows]
                    result = await client.generate_tokens(wan.ALIAS, prompt, max_tokens=NEW_TOKENS)
                    turns[rows].append(result.first_token_s)
                    tokens.add(tuple(result.tokens))
                log(f"{label} turn {turn + 1}: " + ", ".join(f"{r} rows {turns[r][-1]:.3f} s" for r in chunk_rows))
            medians = {rows: statistics.median(figures) for rows, figures in turns.items()}
            sections[label] = {
                "measured_rtt_ms": measured_rtt, "turns": {str(r): f for r, f in turns.items()},
                "first_token_s": {str(r): m for r, m in medians.items()},
                "over_largest": {str(r): m / medians[max(chunk_rows)] for r, m in medians.items()},
                "tokens_agree": len(tokens) == 1,
            }  # fmt: skip
    return {
        "rtt_ms": args.prefill_rtt_ms, "rate_mbit": args.wire_rate_mbit, "prompt_tokens": len(prompt),
        "chunk_rows": chunk_rows, "links": sections, "route": [[h.begin, h.end] for h in route.hops],
    }  # fmt: skip


def chunks_markdown(p: dict) -> list[str]:
    rows = p["chunk_rows"]
    lines = [
        f"## Time to first token of a {p['prompt_tokens']}-token prompt by chunk size, pipelined (Baton 3-split)",
        "",
    ]
    if "measured_at" in p:
        lines += [f"Measured {p['measured_at']} (`--only prefill-chunks`), {p['machine']['cpu_model']}, "
                  f"{p['machine']['cores']} cores; {p['rtt_ms']:g} ms RTT.", ""]  # fmt: skip
    lines += ["| links | measured RTT ms | " + " | ".join(f"{r} rows s" for r in rows) + " | same tokens |",
              "|---|---|" + "---|" * len(rows) + "---|"]  # fmt: skip
    for label, s in p["links"].items():
        cells = " | ".join(f"{s['first_token_s'][str(r)]:.3f} ({s['over_largest'][str(r)]:.2f}x)" for r in rows)
        lines.append(f"| {label} | {s['measured_rtt_ms']:.1f} | {cells} | {s['tokens_agree']} |")
    lines += ["", f"Medians over the turns; in brackets, over chunks of {max(rows)} rows. Chunk sizes give their "
              "own last bits (a chunk's rows may differ from the same rows in other chunks), so the tokens of "
              "different chunk sizes may differ; 'same tokens' says whether they did."]  # fmt: skip
    return lines
