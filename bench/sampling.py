"""What sampling costs an owner, and a sampled session against a greedy one through the swarm.

Owns one benchmark, two parts, in one run:
1. The owner's draw on real rows: SmolLM2's full logits rows of one greedy generation (a
   whole-model worker, full rows), each drawn from ``--draws`` times at temperatures 0.7, 1.0
   and 1.5 with no top-k (the relay's default for OpenAI clients: the full row comes back),
   by ``sample_token`` (the likeliest stretch put in order, ``agent.core.owner.sampling``) and by
   ordering every candidate (``sampling_candidates``, the definition), alternating; the tokens
   are checked equal.
2. A local 3-node swarm (tracker and nodes on loopback, 1 thread a worker): ``--rounds``
   rounds, each one generation of ``--tokens`` tokens per kind in turn: greedy (continued on
   the data plane), sampled at temperature 1 with no top-k (the full row to the owner each
   step) and sampled with top_k 40 (the top-40 and the row's log-sum-exp). Decode tokens/s per
   generation; the ratio of each kind to the round's greedy run.

Writes ``sampling.json`` and ``sampling.md`` under ``--out`` (printed only without it; pass
``--out bench/results`` to keep them). Run it alone on the machine (about 2 minutes).

Usage: ``.venv/bin/python bench/sampling.py [--rounds 5] [--tokens 48] [--draws 20] [--out DIR]``
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

from agent.core.owner.generation import GreedyGeneration
from agent.core.owner.sampling import SamplingParams, sample_token, sampling_candidates
from agent.models import model_path

PROMPT = "Write a short story about a robot who learns to paint. " * 3
TEMPERATURES = (0.7, 1.0, 1.5)
KINDS = {
    "greedy": {"temperature": 0.0},
    "sampled_full_row": {"temperature": 1.0, "seed": 1},
    "sampled_top40": {"temperature": 1.0, "top_k": 40, "seed": 1},
}


def _ordering_every_candidate(row: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    ids, probs = sampling_candidates(row, params)
    cumulative = np.cumsum(probs)
    index = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    return int(ids[min(index, ids.size - 1)])


async def _full_rows(model: Path, n_rows: int) -> np.ndarray:
    from agent.io.worker.process import open_worker

    rows = []
    async with open_worker(model, 0, None, threads=1) as worker:
        tokens = await worker.client.tokenize(PROMPT, add_special=True)
        generation = GreedyGeneration(0, tokens, n_rows, ())
        while not generation.finished:
            out = await worker.client.forward([generation.next_input()])
            rows.append(np.asarray(out[0].logits, dtype=np.float32).reshape(-1)[-worker.info.n_vocab :].copy())
            generation.accept(out[0])
    return np.stack(rows)


def bench_draws(rows: np.ndarray, draws: int) -> dict:
    figures = {}
    for temperature in TEMPERATURES:
        params = SamplingParams(temperature=temperature)
        stretch_us: list[float] = []
        ordering_us: list[float] = []
        for seed in range(draws):
            for index, row in enumerate(rows):
                draw_seed = seed * len(rows) + index
                started = time.perf_counter()
                fast = sample_token(row, params, np.random.default_rng(draw_seed))
                stretch_us.append(1e6 * (time.perf_counter() - started))
                started = time.perf_counter()
                slow = _ordering_every_candidate(row, params, np.random.default_rng(draw_seed))
                ordering_us.append(1e6 * (time.perf_counter() - started))
                if fast != slow:
                    raise RuntimeError(
                        f"row {index}, seed {draw_seed}, {params}: drew {fast}, ordering all gave {slow}"
                    )
        figures[str(temperature)] = {
            "stretch_us_median": statistics.median(stretch_us),
            "stretch_us_p90": float(np.percentile(stretch_us, 90)),
            "ordering_every_candidate_us_median": statistics.median(ordering_us),
            "speedup": statistics.median(ordering_us) / statistics.median(stretch_us),
        }
    return figures


async def bench_swarm(model: Path, rounds: int, n_tokens: int) -> dict:
    runs: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    async with open_covered_swarm(model, "smollm2", 3, 1) as (client, route, _memory, _ready_s):
        for round_index in range(rounds + 1):  # the first round warms up
            kinds = list(KINDS) if round_index % 2 else list(reversed(KINDS))
            for kind in kinds:
                result = await client.generate("smollm2", PROMPT, max_tokens=n_tokens, route=route, **KINDS[kind])
                if round_index:
                    runs[kind].append({"decode_tps": result.tokens_per_s, "continued_steps": result.continued_steps})
    greedy = [run["decode_tps"] for run in runs["greedy"]]
    return {
        kind: {
            "decode_tps_median": statistics.median(run["decode_tps"] for run in kind_runs),
            "ratio_to_greedy_by_round": [run["decode_tps"] / g for run, g in zip(kind_runs, greedy, strict=True)],
            "ratio_to_greedy_median": statistics.median(
                run["decode_tps"] / g for run, g in zip(kind_runs, greedy, strict=True)
            ),
            "continued_steps": [run["continued_steps"] for run in kind_runs],
        }
        for kind, kind_runs in runs.items()
    }


def markdown(report: dict) -> str:
    lines = [
        "# Sampling: the owner's draw, and sampled sessions through the swarm (`bench/sampling.py`)",
        "",
        f"Machine: {report['machine']['summary']}. Baton checkout `{report['machine'].get('baton_commit', '?')}`.",
        "",
        f"## The owner's draw from a full row ({report['rows']} rows of SmolLM2, {report['draws']} draws each)",
        "",
        "| temperature | stretch in order (sample_token), us median | p90 | every candidate in order, us median | speedup |",
        "|---|---|---|---|---|",
    ]
    for temperature, f in report["draws_by_temperature"].items():
        lines.append(
            f"| {temperature} | {f['stretch_us_median']:.0f} | {f['stretch_us_p90']:.0f} | "
            f"{f['ordering_every_candidate_us_median']:.0f} | {f['speedup']:.1f}x |"
        )
    lines += [
        "",
        "The same token in every draw (checked).",
        "",
        f"## Through a local 3-node swarm ({report['rounds']} rounds, {report['tokens']} tokens a generation)",
        "",
        "| kind | decode t/s (median) | ratio to the round's greedy run (median) | by round | continued steps |",
        "|---|---|---|---|---|",
    ]
    for kind, f in report["swarm"].items():
        by_round = ", ".join(f"{r:.2f}" for r in f["ratio_to_greedy_by_round"])
        lines.append(
            f"| {kind} | {f['decode_tps_median']:.1f} | {f['ratio_to_greedy_median']:.2f} | {by_round} | "
            f"{', '.join(map(str, f['continued_steps']))} |"
        )
    lines += [
        "",
        "Greedy sessions are continued on the data plane (the last worker sends each next step to the "
        "first); sampled ones wait for their owner's draw every step, and with no top-k the full row "
        "(n_vocab float32) comes back to the owner.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--draws", type=int, default=20)
    parser.add_argument("--rows", type=int, default=24)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = model_path("smollm2")
    started = time.perf_counter()
    rows = trio.run(_full_rows, model, args.rows)
    draws = bench_draws(rows, args.draws)
    swarm = trio.run(bench_swarm, model, args.rounds, args.tokens)
    info = machine_info()
    report = {
        "machine": {**info, "summary": _summary(info)},
        "rows": len(rows),
        "draws": args.draws,
        "rounds": args.rounds,
        "tokens": args.tokens,
        "draws_by_temperature": draws,
        "swarm": swarm,
        "wall_s": time.perf_counter() - started,
    }
    publish(args.out, "sampling", report, markdown(report))
    return 0


def _summary(info: dict) -> str:
    return (
        f"{info['cpu_model']}, {info['cores']} cores, {info['ram_gib']:.1f} GiB RAM, {info['platform']}, "
        f"Python {info['python']}; load average before {info['loadavg_before']}; run alone"
    )


if __name__ == "__main__":
    raise SystemExit(main())
