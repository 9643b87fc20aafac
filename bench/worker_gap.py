"""Where Baton's unsplit worker loses time against llama-bench (issue 8, item 3): a short,
interleaved A/B on one machine, ms per decode step after the same prompt.

Owns one command that measures, round after round (so that a busy machine disturbs every
system alike), decode steps at positions P..P+G-1 after a P-token prompt:
1. ``llama-bench -p 0 -n G -d P`` (llama.cpp from the same pin, same depth);
2. ``baton-shard-bench`` (bench/native/shard_bench.cpp): the worker's own model code (Shard,
   the worker's KV defaults: 4 sequences x 2048 positions, non-unified, flash attention auto)
   with no gRPC and no Python: what the KV configuration and the Shard cost;
3. the worker process over its Unix socket from Python (``AsyncWorkerClient``), the last
   range returning the full logits row;
4. the same, returning the top-40 (``SequenceInput.top_k``): what the row costs.
(2)/(1) isolates the model configuration, (3)/(2) the service + gRPC + client hop.

Usage: ``.venv/bin/python bench/worker_gap.py [--rounds 4] [--prompt 64] [--steps 32]``
(about a minute on 2 cores; needs ``make native`` and ``build/llama-tools``, which
``bench/compare.py`` builds). Prints JSON: per system min and median ms a step and the
median's ratio to llama-bench.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _bootstrap import REPO_ROOT  # first: it makes the project importable

import compare  # noqa: E402
import trio  # noqa: E402

from agent.io.cpu_policy import kernel_default  # noqa: E402
from agent.io.lifeline import die_with_parent  # noqa: E402

SHARD_BENCH = REPO_ROOT / "build" / "native" / "baton-shard-bench"
TOP_K = 40


def llama_bench_ms(bench_bin: Path, model: Path, prompt: int, steps: int) -> list[float]:
    argv = [str(bench_bin), "-m", str(model), "-p", "0", "-n", str(steps), "-d", str(prompt), "-t", "1", "-r", "2",
            "-o", "json"]  # fmt: skip
    preexec = die_with_parent(kernel_default, waited=True)  # run in a trio worker thread that waits for it
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=300, preexec_fn=preexec).stdout
    entry = next(e for e in json.loads(out) if e["n_gen"] == steps)
    return [1000.0 / s for s in entry["samples_ts"]]


def shard_bench_ms(model: Path, prompt: int, steps: int) -> list[float]:
    argv = [str(SHARD_BENCH), str(model), "--prompt", str(prompt), "--steps", str(steps), "--reps", "2"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=300).stdout
    return [run["decode_ms"] for run in json.loads(out)["runs"]]


async def worker_ms(client, prompt_tokens: list[int], steps: int, top_k: int) -> float:  # noqa: ANN001
    from agent.core.parity import greedy_token
    from agent.core.worker_records import SeqInput

    n = len(prompt_tokens)
    await client.forward([SeqInput(0, list(range(n)), token_ids=prompt_tokens)])
    token = prompt_tokens[-1]
    started = time.perf_counter()
    for i in range(steps):
        out = await client.forward([SeqInput(0, [n + i], token_ids=[token], top_k=top_k)])
        token = int(out[0].top[-1].ids[0]) if top_k else greedy_token(out[0].logits[-1])
    elapsed = time.perf_counter() - started
    await client.remove_sequence(0)
    return elapsed / steps * 1000.0


async def run(args: argparse.Namespace) -> dict:
    from agent.io.worker_process import open_worker
    from agent.models import cached_sha256, model_path

    model = Path(args.model) if args.model else model_path("smollm2")
    bench_bin, _, _ = compare.ensure_llama_tools()
    results: dict[str, list[float]] = {"llama_bench": [], "shard_alone": [], "worker_full_row": [],
                                       f"worker_top{TOP_K}": []}  # fmt: skip
    async with open_worker(model, 0, None, threads=1, model_sha256=cached_sha256(model)) as worker:
        _, tokens = await compare.make_prompt(worker.client, args.prompt)
        await worker_ms(worker.client, tokens, 4, 0)  # warm-up
        for _ in range(args.rounds):
            results["llama_bench"] += await trio.to_thread.run_sync(llama_bench_ms, bench_bin, model, args.prompt,
                                                                    args.steps)  # fmt: skip
            results["shard_alone"] += await trio.to_thread.run_sync(shard_bench_ms, model, args.prompt, args.steps)
            for _ in range(2):
                results["worker_full_row"].append(await worker_ms(worker.client, tokens, args.steps, 0))
                results[f"worker_top{TOP_K}"].append(await worker_ms(worker.client, tokens, args.steps, TOP_K))
    reference = statistics.median(results["llama_bench"])
    return {
        "prompt": args.prompt,
        "steps": args.steps,
        "rounds": args.rounds,
        "ms_per_step": {
            name: {
                "min": round(min(v), 3),
                "median": round(statistics.median(v), 3),
                "speed_ratio_to_llama_bench": round(reference / statistics.median(v), 3),
            }
            for name, v in results.items()
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="GGUF (default: the pinned SmolLM2)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    from agent.io.cpu_policy import apply_cpu_policy
    from agent.io.process_memory import keep_freed_memory

    keep_freed_memory()  # the direct harnesses are Baton processes too (agent.cli does it for the rest)
    apply_cpu_policy()
    print(json.dumps(trio.run(run, args), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
