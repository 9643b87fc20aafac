"""Spin or sleep: what a CPU worker's idle threads should do (``agent.core.worker_wait``).

Owns one benchmark: the same decode through bare workers (no nodes, no network: the Python
driver hands each hop's output to the next worker, as a node would), with the workers' OpenMP
threads waiting in one of three ways: spinning for milliseconds before they sleep (libgomp's
default, ``--worker-wait spin``), spinning ``SLEEP_SPIN_COUNT`` rounds (microseconds) before they
sleep (``GOMP_SPINCOUNT``, ``--worker-wait sleep``), or never spinning (``OMP_WAIT_POLICY=PASSIVE``,
what ``sleep`` was until the short spin measured faster here); in the situations a node can be in:
- one worker alone on the machine (SmolLM2 [0:30)), one session and 8 sessions in one Forward;
- three workers sharing the machine's cores (a third of the layers each, in series), one
  session, 8 sessions travelling as one group (lock-step: one worker computes at a time), and
  8 sessions in two groups in flight (two workers compute at once).
Each run starts fresh workers of ``--threads`` threads (default 2, the machine's cores here:
1 would start no OpenMP team and measure nothing), prefills each session's 64-token prompt,
then times ``--tokens`` greedy decode steps of every session. Rounds interleave the three
policies in every situation, so a busy machine disturbs them alike. Reported per situation:
the median decode tokens/s of each policy, sleep / spin, sleep / passive, and the workers' CPU
ms a token.

Writes ``bench/results/worker_wait.{json,md}``.
Usage: ``.venv/bin/python bench/worker_wait.py [--rounds 3] [--threads 2] [--tokens 32]``
(about 8 minutes on 2 cores; needs ``make native`` and the SmolLM2 model, ``make models``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from _bootstrap import BENCH_DIR  # first: it makes the project importable

import trio  # noqa: E402

from agent.core.worker_wait import SLEEP, SLEEP_SPIN_COUNT, SPIN, worker_environment  # noqa: E402

ALIAS = "smollm2"
PROMPT_TOKENS = 64
PASSIVE = "passive"  # not a node choice: OMP_WAIT_POLICY=PASSIVE, set here, for comparison
POLICIES = (SPIN, SLEEP, PASSIVE)
ALONE = ((0, None),)
SERIES = ((0, 10), (10, 20), (20, None))
#: name -> (worker ranges, sessions, groups in flight)
SITUATIONS = {
    "alone, 1 session": (ALONE, 1, 1),
    "alone, 8 sessions": (ALONE, 8, 1),
    "3 in series, 1 session": (SERIES, 1, 1),
    "3 in series, 8 sessions lock-step": (SERIES, 8, 1),
    "3 in series, 8 sessions in 2 groups": (SERIES, 8, 2),
}


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def policy_environment(policy: str, environment: dict[str, str]) -> dict[str, str]:
    """A worker's environment under ``policy``: a node's choice (``spin``, ``sleep``), or
    ``passive``, libgomp never spinning (the user's own wait variables replaced)."""
    if policy != PASSIVE:
        return worker_environment(policy, other_workers=0, environment=environment)[0]
    env = {k: v for k, v in environment.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env


async def chain_step(clients, gens) -> None:  # noqa: ANN001
    """One step of every generation in ``gens`` through the workers ``clients`` in series: one
    Forward per worker, all of them in it, as a lock-step convoy crosses the route."""
    from agent.demo.local_demo import next_hop_entries

    hop = [g.next_input() for g in gens]
    out = []
    for i, client in enumerate(clients):
        out = await client.forward(hop)
        if i + 1 < len(clients):
            hop = next_hop_entries(hop, out)
    for g, o in zip(gens, out, strict=True):
        g.accept(o)


async def run_once(model: Path, ranges, sessions: int, groups: int, policy: str, threads: int, tokens: int) -> dict:  # noqa: ANN001
    """One fresh set of workers: decode tokens/s of ``sessions`` sessions and the workers' CPU ms
    a token."""
    from agent.core.generation import GreedyGeneration
    from agent.core.topk import DEFAULT_RESULT_TOP_K
    from agent.harness.parity_run import open_workers

    environment = policy_environment(policy, os.environ)
    async with open_workers(
        model, list(ranges), threads=threads, max_sequences=max(sessions, 1), environment=environment
    ) as chain:
        clients = [handle.client for handle in chain]

        async def decode(gens: list[GreedyGeneration]) -> None:
            while live := [g for g in gens if not g.finished]:
                await chain_step(clients, live)

        results = []
        for _ in range(2):  # a warm-up generation, then the timed one
            gens = [
                GreedyGeneration(i, [100 + i + t for t in range(PROMPT_TOKENS)], tokens + 1, top_k=DEFAULT_RESULT_TOP_K)
                for i in range(sessions)
            ]
            for g in gens:
                await chain_step(clients, [g])  # prefill: the first token
            cpu_before = [_cpu_s(h.process.pid) for h in chain]
            started = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for k in range(groups):
                    nursery.start_soon(decode, gens[k::groups])
            elapsed_s = time.perf_counter() - started
            cpu_s = sum(_cpu_s(h.process.pid) - b for h, b in zip(chain, cpu_before, strict=True))
            decoded = sum(len(g.tokens) - g.prompt_len - 1 for g in gens)
            for client in clients:
                for g in gens:
                    await client.remove_sequence(g.seq_id)
            results.append({"tokens_per_s": decoded / elapsed_s, "cpu_ms_per_token": 1000 * cpu_s / decoded})
        return results[-1]


def summarize(runs: dict[str, dict[str, list[dict]]]) -> dict[str, dict]:
    """Per situation: each policy's median tokens/s and CPU ms a token, sleep / spin and sleep /
    passive."""
    out = {}
    for name, by_policy in runs.items():
        row = {}
        for policy, results in by_policy.items():
            row[policy] = {
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in results),
                "cpu_ms_per_token": statistics.median(r["cpu_ms_per_token"] for r in results),
                "runs_tokens_per_s": [round(r["tokens_per_s"], 1) for r in results],
            }
        row["sleep_over_spin"] = row[SLEEP]["tokens_per_s"] / row[SPIN]["tokens_per_s"]
        row["sleep_over_passive"] = row[SLEEP]["tokens_per_s"] / row[PASSIVE]["tokens_per_s"]
        out[name] = row
    return out


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        "# Spin or sleep: a CPU worker's idle threads",
        "",
        f"Machine: {m.get('cpu_model')}, {m.get('cores')} cores, {m.get('ram_gib', 0):.1f} GiB, {m.get('platform')};"
        f" load before: {m.get('loadavg_before')}; Baton {m.get('baton_commit')}.",
        f"Bare workers of SmolLM2 ({report['threads']} threads each), no nodes; {PROMPT_TOKENS}-token prompts,"
        f" {report['tokens']} greedy decode steps per session; {report['rounds']} rounds, the policies interleaved;"
        " medians. spin: libgomp's default, ~300,000 spin rounds before sleeping (`--worker-wait spin`); sleep:"
        f" `GOMP_SPINCOUNT={SLEEP_SPIN_COUNT}`, a short spin, then sleep (`--worker-wait sleep`); passive:"
        " `OMP_WAIT_POLICY=PASSIVE`, never spin (what `sleep` set before). `auto`, the node's default, sleeps when"
        " another Baton worker runs on the host.",
        "",
        "| situation | spin: decode t/s | sleep: decode t/s | passive: decode t/s | sleep / spin | sleep / passive"
        " | worker CPU ms/token (spin; sleep; passive) | runs (spin; sleep; passive) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in report["situations"].items():
        cells = [row[p] for p in POLICIES]
        lines.append(
            f"| {name} | " + " | ".join(f"{c['tokens_per_s']:.1f}" for c in cells)
            + f" | {row['sleep_over_spin']:.2f}x | {row['sleep_over_passive']:.2f}x"
            + " | " + "; ".join(f"{c['cpu_ms_per_token']:.1f}" for c in cells)
            + " | " + "; ".join(", ".join(map(str, c["runs_tokens_per_s"])) for c in cells) + " |"
        )
    lines += ["", f"Wall time: {report['wall_s']:.0f} s.", ""]
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> dict:
    from agent.models import model_path

    model = model_path(ALIAS)
    runs: dict[str, dict[str, list[dict]]] = {name: {p: [] for p in POLICIES} for name in SITUATIONS}
    for round_index in range(args.rounds):
        for name, (ranges, sessions, groups) in SITUATIONS.items():
            for policy in POLICIES if round_index % 2 == 0 else reversed(POLICIES):
                result = await run_once(model, ranges, sessions, groups, policy, args.threads, args.tokens)
                runs[name][policy].append(result)
                print(f"round {round_index + 1} {name} {policy}: {result['tokens_per_s']:.1f} t/s", file=sys.stderr)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--output", type=Path, default=BENCH_DIR / "results" / "worker_wait.json")
    args = parser.parse_args()
    from compare import machine_info

    from agent.io.cpu_policy import apply_cpu_policy
    from agent.io.process_memory import keep_freed_memory

    keep_freed_memory()
    apply_cpu_policy()
    machine = machine_info()
    started = time.monotonic()
    runs = trio.run(main_async, args)
    report = {
        "machine": machine,
        "threads": args.threads,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "situations": summarize(runs),
        "wall_s": time.monotonic() - started,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    args.output.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
