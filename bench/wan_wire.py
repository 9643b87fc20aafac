"""``bench/wan.py --only wire``: time to first token of a long prompt through the Baton 3-split
across the lab with every link limited to ``--wire-rate-mbit`` (20 by default) at
``--prefill-rtt-ms``, the session's boundary rows on the wire in f32, f16 and q8
(``SwarmClientConfig.wire``), in one run, and how far each lossy dtype's logits are from f32's.

One owner (a client of one swarm: tracker on ``tracker``, nodes on n1..n3, the owner on
``owner``, its config switched per variant), the same ``--prefill-tokens`` prompt in chunks of
``--prefill-chunk-rows`` rows, pipelined on the data plane (the default), each time:
``--turns`` turns in rotating order, one greedy generation of ``WIRE_NEW_TOKENS`` tokens each.
The figures: the client's ``first_token_s`` (medians; target f16 <= 0.6x f32), and the max
|logit difference| of each generated token's top-K logits against the f32 run's (the tokens
both runs rank in their top-K), against the declared bound
(``agent.core.wire.boundary.WIRE_LOGIT_BOUNDS``, measured on the unsplit worker's full rows).
Next to it the bytes: a prompt's boundary rows per link in each dtype, and their time at the
link's rate.

Owns no lab or swarm helper (``wan`` does); ``wan`` imports it only for ``--only wire``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import numpy as np
import trio
from common import log

from agent.core.lab.topology import LinkChange
from agent.core.wire.boundary import WIRE_LOGIT_BOUNDS, WireDType, wire_bytes
from agent.core.wire.topk import TopLogits
from agent.io.client import SwarmClientConfig
from agent.io.lab.harness import Lab
from agent.io.tracker.gguf_info import read_gguf_facts
from agent.models import model_path

VARIANTS = ("f32", "f16", "q8")
WIRE_NEW_TOKENS = 8
TARGET_RATIO = 0.6  # f16 / f32 time to first token, the goal for a 1,500-token prompt at 20 Mbit/s
_DTYPES = {"f32": WireDType.F32, "f16": WireDType.F16S, "q8": WireDType.Q8}


def _config(name: str, chunk_rows: int) -> SwarmClientConfig:
    return SwarmClientConfig(prefill_chunk_tokens=chunk_rows, wire=name)


def _max_top_diff(a: list[dict[int, float]], b: list[dict[int, float]]) -> float:
    """Max |logit difference| over the tokens both runs rank in their top-K, position by
    position, while the two runs' tokens agree (after a different token the rows differ)."""
    worst = 0.0
    for row_a, row_b in zip(a, b):
        shared = row_a.keys() & row_b.keys()
        if shared:
            worst = max(worst, max(abs(row_a[t] - row_b[t]) for t in shared))
    return worst


async def measure_wire(lab: Lab, swarm, wan, args: argparse.Namespace) -> dict:
    """The section, inside the owner's machine (one trio run)."""
    wan.set_every_link(lab, LinkChange(delay_ms=0.0, rate_mbit=0.0))  # the setup's many small calls, quickly
    async with contextlib.AsyncExitStack() as stack:
        first, route, prompt = await wan.open_owner_section(stack, lab, swarm, args.prefill_tokens)
        configs = {name: _config(name, args.chunk_rows) for name in VARIANTS}
        wan.set_every_link(lab, LinkChange(delay_ms=args.prefill_rtt_ms / 2, rate_mbit=args.wire_rate_mbit))
        measured_rtt = statistics.median(await trio.to_thread.run_sync(wan.tcp_rtt_ms, lab, "owner", "n1", 20))

        async def run(name: str) -> tuple[dict, list[dict[int, float]]]:
            first.config = configs[name]
            scores: list[dict[int, float]] = []

            async def on_token(token: int, logits, _route) -> bool:
                if isinstance(logits, TopLogits):
                    scores.append({int(t): float(v) for t, v in zip(logits.ids, logits.logits)})
                else:
                    top = np.argsort(-logits)[:16]
                    scores.append({int(t): float(logits[t]) for t in top})
                return False

            result = await first.generate_tokens(wan.ALIAS, prompt, max_tokens=WIRE_NEW_TOKENS, on_token=on_token)
            return {"first_token_s": result.first_token_s, "tokens": list(result.tokens)}, scores

        for name in VARIANTS:  # warm: connections made, workers paged in
            await run(name)
        turns: dict[str, list[dict]] = {name: [] for name in VARIANTS}
        diffs: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for turn in range(args.turns):
            order = VARIANTS[turn % len(VARIANTS) :] + VARIANTS[: turn % len(VARIANTS)]
            scores: dict[str, list[dict[int, float]]] = {}
            for name in order:
                turns[name].append((figures := await run(name))[0])
                scores[name] = figures[1]
            for name in VARIANTS:
                diffs[name].append(_max_top_diff(scores[name], scores["f32"]))
            log(f"wire turn {turn + 1}: " + ", ".join(f"{n} {turns[n][-1]['first_token_s']:.3f} s" for n in VARIANTS))
    medians = {name: statistics.median(f["first_token_s"] for f in figures) for name, figures in turns.items()}
    width = read_gguf_facts(model_path(wan.ALIAS)).n_embd
    prompt_bytes = {name: wire_bytes(_DTYPES[name], len(prompt), width) for name in VARIANTS}
    return {
        "rtt_ms": args.prefill_rtt_ms, "measured_rtt_ms": measured_rtt, "rate_mbit": args.wire_rate_mbit,
        "prompt_tokens": len(prompt), "chunk_rows": args.chunk_rows, "turns": turns, "first_token_s": medians,
        "f16_over_f32": medians["f16"] / medians["f32"], "q8_over_f32": medians["q8"] / medians["f32"],
        "max_abs_logit_diff": {name: max(d) for name, d in diffs.items()},
        "declared_bound": {name: WIRE_LOGIT_BOUNDS.get(int(_DTYPES[name]), 0.0) for name in VARIANTS},
        "prompt_bytes_per_link": prompt_bytes,
        "prompt_link_s": {name: b * 8 / (args.wire_rate_mbit * 1e6) for name, b in prompt_bytes.items()},
        "f32_tokens_same": len({tuple(f["tokens"]) for f in turns["f32"]}) == 1, "target_ratio": TARGET_RATIO,
        "route": [[h.begin, h.end] for h in route.hops],
    }  # fmt: skip


def wire_markdown(p: dict) -> list[str]:
    lines = [
        f"## Boundaries sized for the link: a {p['prompt_tokens']}-token prompt at {p['rate_mbit']:g} Mbit/s,"
        f" {p['rtt_ms']:g} ms (Baton 3-split)",
        "",
    ]
    if "measured_at" in p:
        lines += [
            f"Measured {p['measured_at']} (`--only wire`), {p['machine']['cpu_model']}, {p['machine']['cores']} cores;"
            f" chunks of {p['chunk_rows']} rows, measured RTT {p['measured_rtt_ms']:.1f} ms.",
            "",
        ]
    lines += ["| turn | f32 s | f16 s | q8 s |", "|---|---|---|---|"]
    for i in range(len(p["turns"]["f32"])):
        cells = " | ".join(f"{p['turns'][n][i]['first_token_s']:.3f}" for n in VARIANTS)
        lines.append(f"| {i + 1} | {cells} |")
    met = "met" if p["f16_over_f32"] <= p["target_ratio"] else "missed"
    lines += ["", "| wire | prompt bytes a link | at the link's rate s | max abs logit diff (top-K) | declared bound |",
              "|---|---|---|---|---|"]  # fmt: skip
    for name in VARIANTS:
        lines.append(
            f"| {name} | {p['prompt_bytes_per_link'][name]:,} | {p['prompt_link_s'][name]:.2f}"
            f" | {p['max_abs_logit_diff'][name]:.3g} | {p['declared_bound'][name]:g} |"
        )
    lines += [
        "",
        f"Medians: f16 **{p['f16_over_f32']:.2f}x** f32's time to first token (target <= {p['target_ratio']:.1f}x:"
        f" {met}), q8 **{p['q8_over_f32']:.2f}x**; f32's tokens the same every run: {p['f32_tokens_same']}.",
    ]
    return lines
