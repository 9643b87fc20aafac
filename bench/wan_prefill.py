"""``bench/wan.py --only prefill``: time to first token of a long prompt through the Baton
3-split across the lab at one RTT, with the prompt's chunks pipelined down the route against the
same route without pipelining, in one run.

One owner (a client of one swarm: tracker on ``tracker``, nodes on n1..n3, the owner on
``owner``, its config switched per variant), the same ``--prefill-tokens`` prompt in chunks of ``--prefill-chunk-rows`` rows each time:
- ``pipelined``: the prompt on the workers' data plane, every chunk sent at once
  (``prefill_chunks_in_flight`` 64): hop i computes chunk j + 1 while hop i + 1 computes chunk j;
- ``one_by_one``: on the data plane, one chunk per round trip (``prefill_chunks_in_flight`` 1);
- ``node_path``: the prompt through the node agents, one chunk per round trip, as before the
  prompt went on the data plane (``prefill_on_data_plane`` False).
``--turns`` turns in rotating order, one generation of 2 tokens each (greedy); the figure is the
client's ``first_token_s`` (first step sent to first token). Next to it the bound: the slowest
hop's share of the prompt plus one trip, owner -> hops -> owner ((S + 1) one-way delays), with
the hop's share measured as the unsplit prompt compute / S.

Owns no lab or swarm helper (``wan`` does); ``wan`` imports it only for ``--only prefill``.
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

VARIANTS = ("pipelined", "one_by_one", "node_path")
PREFILL_NEW_TOKENS = 2
TARGET_RATIO = 0.6  # pipelined / without pipelining, the goal for a 1,500-token prompt at 20 ms


def _config(name: str, chunk_rows: int) -> SwarmClientConfig:
    fields = {
        "pipelined": {"prefill_chunks_in_flight": 64},
        "one_by_one": {"prefill_chunks_in_flight": 1},
        "node_path": {"prefill_on_data_plane": False},
    }[name]
    return SwarmClientConfig(prefill_chunk_tokens=chunk_rows, **fields)


async def measure_prefill(lab: Lab, swarm, wan, args: argparse.Namespace) -> dict:
    """The section, inside the owner's machine (one trio run)."""
    wan.set_every_link(lab, LinkChange(delay_ms=0.0))  # the setup's many small calls, quickly
    async with contextlib.AsyncExitStack() as stack:
        # one owner, its config switched per variant (read at each generation)
        first, route, prompt = await wan.open_owner_section(stack, lab, swarm, args.prefill_tokens)
        configs = {name: _config(name, args.chunk_rows) for name in VARIANTS}
        wan.set_every_link(lab, LinkChange(delay_ms=args.prefill_rtt_ms / 2))
        measured_rtt = statistics.median(await trio.to_thread.run_sync(wan.tcp_rtt_ms, lab, "owner", "n1", 20))
        for name in VARIANTS:  # warm: connections made, workers paged in
            first.config = configs[name]
            await first.generate_tokens(wan.ALIAS, prompt, max_tokens=PREFILL_NEW_TOKENS)
        turns: dict[str, list[dict]] = {name: [] for name in VARIANTS}
        for turn in range(args.turns):
            order = VARIANTS[turn % len(VARIANTS) :] + VARIANTS[: turn % len(VARIANTS)]
            for name in order:
                first.config = configs[name]
                result = await first.generate_tokens(wan.ALIAS, prompt, max_tokens=PREFILL_NEW_TOKENS)
                turns[name].append(
                    {
                        "first_token_s": result.first_token_s,
                        "data_plane_steps": result.data_plane_steps,
                        "tokens": list(result.tokens),
                    }
                )
            log(
                f"prefill turn {turn + 1}: " + ", ".join(f"{n} {turns[n][-1]['first_token_s']:.3f} s" for n in VARIANTS)
            )
    medians = {name: statistics.median(f["first_token_s"] for f in figures) for name, figures in turns.items()}
    tokens = {tuple(f["tokens"]) for figures in turns.values() for f in figures}
    return {
        "rtt_ms": args.prefill_rtt_ms, "measured_rtt_ms": measured_rtt, "prompt_tokens": len(prompt),
        "chunk_rows": args.chunk_rows, "turns": turns, "first_token_s": medians,
        "pipelined_over_node_path": medians["pipelined"] / medians["node_path"],
        "pipelined_over_one_by_one": medians["pipelined"] / medians["one_by_one"],
        "same_tokens": len(tokens) == 1, "target_ratio": TARGET_RATIO,
        "route": [[h.begin, h.end] for h in route.hops],
    }  # fmt: skip


def prefill_markdown(p: dict) -> list[str]:
    lines = [f"## Time to first token of a {p['prompt_tokens']}-token prompt at {p['rtt_ms']:g} ms (Baton 3-split)", ""]
    if "measured_at" in p:
        lines += [
            f"Measured {p['measured_at']} (`--only prefill`), {p['machine']['cpu_model']}, {p['machine']['cores']} cores;"
            f" chunks of {p['chunk_rows']} rows, measured RTT {p['measured_rtt_ms']:.1f} ms.",
            "",
        ]
    lines += ["| turn | pipelined s | one chunk per round trip s | node path s |", "|---|---|---|---|"]
    for i in range(len(p["turns"]["pipelined"])):
        cells = " | ".join(f"{p['turns'][n][i]['first_token_s']:.3f}" for n in VARIANTS)
        lines.append(f"| {i + 1} | {cells} |")
    met = "met" if p["pipelined_over_node_path"] <= p["target_ratio"] else "missed"
    lines += [
        "",
        f"Medians: pipelined **{p['pipelined_over_node_path']:.2f}x** the node path's time to first token"
        f" (target <= {p['target_ratio']:.1f}x: {met}), **{p['pipelined_over_one_by_one']:.2f}x** one chunk per"
        f" round trip on the data plane; the same tokens every run: {p['same_tokens']}.",
    ]
    return lines
