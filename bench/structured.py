"""What constrained decoding costs through the swarm: decode speed of a ``json_schema`` answer and
of a forced tool call against unconstrained generations, on the same route in one run.

A local 3-node swarm of SmolLM2 (tracker and nodes on loopback, 1 thread a worker), ``--rounds``
rounds (a first one warms up and is not counted), each one generation per kind in turn (the
order alternates from round to round):
- ``greedy``: unconstrained greedy (top-40 results, continued on the data plane by the last hop);
- ``sampled``: unconstrained at temperature 1, no top-k (the relay's default: the full row comes
  back to the owner each step);
- ``json_schema``: greedy under a JSON schema (``agent.core.owner.grammar``): the full row each
  step, masked by llguidance and drawn at the owner;
- ``tool_call``: greedy under a forced call to one of two tools, in the Hermes format.

Decode tokens/s per generation (prefill excluded), and each kind's ratio to the round's greedy
and sampled runs. The issue's bar: constrained kinds at >= 0.8x the unconstrained one. Also the
owner's mask time per token (median over the run's constrained steps).

Writes ``structured.json`` and ``structured.md`` under ``--out`` (printed only without it; pass
``--out bench/results`` to keep them). Run it alone on the machine (about 2 minutes).

Usage: ``.venv/bin/python bench/structured.py [--rounds 5] [--tokens 64] [--out DIR]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import _bootstrap  # noqa: F401  (first: it makes the project importable)
import numpy as np
import trio
from common import machine_info, open_covered_swarm, publish

from agent.core.owner.grammar import GrammarTokenizer, TokenConstraint, compile_json_schema, compile_lark
from agent.core.owner.sampling import SamplingParams
from agent.core.owner.tool_calls import call_schema, forced_call_lark
from agent.models import model_path

PROMPT = "List eight colours, then describe the weather in Paris in a few words each. " * 2
SCHEMA = {
    "type": "object",
    "properties": {
        "colours": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 8, "maxItems": 8},
        "summary": {"type": "string", "maxLength": 200},
    },
    "required": ["colours", "summary"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40}, "details": {"type": "string", "maxLength": 200},
        "days": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 4, "maxItems": 4}},
        "required": ["city", "details", "days"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
]  # fmt: skip
KINDS = ("greedy", "sampled", "json_schema", "tool_call")


class _TimedConstraint:
    """A ``TokenConstraint`` that records how long each mask took."""

    def __init__(self, constraint: TokenConstraint, mask_s: list[float]) -> None:
        self.constraint = constraint
        self.mask_s = mask_s

    def allowed(self) -> np.ndarray:
        started = time.perf_counter()
        mask = self.constraint.allowed()
        self.mask_s.append(time.perf_counter() - started)
        return mask

    def accept(self, token: int) -> None:
        self.constraint.accept(token)

    def rollback(self, tokens: int) -> None:
        self.constraint.rollback(tokens)


async def _vocabulary_and_prompt(model: Path):
    from agent.io.worker.process import open_worker

    async with open_worker(model, 0, None, vocab_only=True) as worker:
        vocabulary = await worker.client.vocabulary()
        tokens = await worker.client.tokenize(PROMPT, add_special=True, parse_special=True)
    return vocabulary, tokens


async def bench_swarm(model: Path, rounds: int, n_tokens: int) -> dict:
    vocabulary, prompt = await _vocabulary_and_prompt(model)
    tokenizer = GrammarTokenizer(vocabulary)
    grammars = {
        "json_schema": compile_json_schema(SCHEMA, tokenizer),
        "tool_call": compile_lark(forced_call_lark(call_schema(TOOLS, "hermes"), "hermes", parallel=False), tokenizer),
    }
    eog = sorted(vocabulary.eog_token_ids)
    runs: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    mask_s: list[float] = []
    async with open_covered_swarm(model, "smollm2", 3, 1) as (client, route, _memory, _ready_s):
        for round_index in range(rounds + 1):  # the first round warms up
            kinds = list(KINDS) if round_index % 2 else list(reversed(KINDS))
            for kind in kinds:
                constraint = None
                sampling = SamplingParams(temperature=1.0) if kind == "sampled" else SamplingParams()
                if kind in grammars:
                    constraint = _TimedConstraint(TokenConstraint(tokenizer, grammars[kind]), mask_s)
                result = await client.generate_tokens(
                    "smollm2", prompt, max_tokens=n_tokens, stop_tokens=eog, sampling=sampling, seed=1,
                    route=route, constraint=constraint,
                )  # fmt: skip
                if round_index and result.decode_steps:
                    text = vocabulary.piece_bytes([t for t in result.tokens if t not in eog]).decode("utf-8", "replace")
                    runs[kind].append({
                        "decode_tps": result.decode_steps / result.decode_s, "tokens": len(result.tokens),
                        "continued_steps": result.continued_steps, "text": text[:120],
                    })  # fmt: skip
    report = {}
    for kind, kind_runs in runs.items():
        figures = {
            "decode_tps_median": statistics.median(run["decode_tps"] for run in kind_runs),
            "tokens": [run["tokens"] for run in kind_runs],
            "continued_steps": [run["continued_steps"] for run in kind_runs],
            "first_text": kind_runs[0]["text"],
        }
        for base in ("greedy", "sampled"):
            ratios = [r["decode_tps"] / b["decode_tps"] for r, b in zip(kind_runs, runs[base], strict=True)]
            figures[f"ratio_to_{base}_by_round"] = ratios
            figures[f"ratio_to_{base}_median"] = statistics.median(ratios)
        report[kind] = figures
    return {"kinds": report, "mask_us_median": 1e6 * statistics.median(mask_s) if mask_s else None}


def markdown(report: dict) -> str:
    lines = [
        "# Constrained decoding through the swarm (`bench/structured.py`)",
        "",
        f"Machine: {report['machine']['summary']}. Baton checkout `{report['machine'].get('baton_commit', '?')}`.",
        "",
        f"A local 3-node swarm of SmolLM2, {report['rounds']} rounds, at most {report['tokens']} tokens a generation.",
        "",
        "| kind | decode t/s (median) | ratio to greedy (median) | ratio to sampled (median) | tokens | continued |",
        "|---|---|---|---|---|---|",
    ]
    for kind, f in report["swarm"]["kinds"].items():
        lines.append(
            f"| {kind} | {f['decode_tps_median']:.1f} | {f['ratio_to_greedy_median']:.2f} | "
            f"{f['ratio_to_sampled_median']:.2f} | {', '.join(map(str, f['tokens']))} | "
            f"{', '.join(map(str, f['continued_steps']))} |"
        )
    mask = report["swarm"]["mask_us_median"]
    lines += [
        "",
        f"The owner's grammar mask: {mask:.0f} us a token (median)." if mask is not None else "",
        "",
        "Constrained sessions ask for the full row every step and draw at the owner (the mask applies "
        "to every token), as unconstrained sampling with no top-k does; greedy unconstrained sessions "
        "get the top-40 and are continued by the last hop.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    started = time.perf_counter()
    swarm = trio.run(bench_swarm, model_path("smollm2"), args.rounds, args.tokens)
    info = machine_info()
    report = {
        "machine": {**info, "summary": _summary(info)},
        "rounds": args.rounds,
        "tokens": args.tokens,
        "swarm": swarm,
        "wall_s": time.perf_counter() - started,
    }
    publish(args.out, "structured", report, markdown(report))
    return 0


def _summary(info: dict) -> str:
    return (
        f"{info['cpu_model']}, {info['cores']} cores, {info['ram_gib']:.1f} GiB RAM, {info['platform']}, "
        f"Python {info['python']}; load average before {info['loadavg_before']}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
