"""How long a generation pauses when a hop dies or freezes, on loopback.

Owns one command that starts a swarm of real processes (``agent.harness.local_swarm``: a
tracker and six nodes of ten blocks of SmolLM2, so every range has two copies and a route has a
first, a middle and a last hop; heartbeat timeout 15 s, so only the fast path (the owner names
the lost peer, the tracker probes it) explains a quick resume) and measures:

1. for each hop position (first, middle, last) ``--kills`` SIGKILLed and ``--stops`` SIGSTOPped
   generations (greedy) with that hop signalled after a seeded number of decode tokens: the
   resume time, from the last token before the signal to the first token after it; median and
   max, and whether the tokens equal an undisturbed run's;
2. the resume time against the context length: the last hop SIGKILLed at 128, 512 and 2048
   positions (prompt + tokens so far), resumed (the survivors keep their caches, only the lost
   range is rebuilt from the rows the hop before it kept), next to the same kill with resume
   off (``SwarmClientConfig.resume=False``: the owner re-prefills the whole new route), and to
   a healthy run's time to its first token at that length.

After each signalled run the victim is SIGKILLed, restarted with the same key, and the next
run waits until every range has two ready copies again.

Writes ``failover.json`` and ``failover.md`` under ``--out`` (default bench/results), with the
machine described as ``bench/compare.py`` describes it. Run it alone on the machine.

Usage: ``.venv/bin/python bench/failover.py [--kills 20] [--quick] [--out bench/results]``
(``--kills 20 --stops 7``: 81 signalled runs plus 2 x ``--context-kills`` per context length;
roughly 45 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import time
from pathlib import Path

import trio
from _bootstrap import BENCH_DIR  # first: it makes the project importable
from common import machine_info

ALIAS = "smollm2"
NODES = 6
BLOCKS_EACH = 10
HEARTBEAT_TIMEOUT_MS = 15_000
POSITIONS = {"first": 0, "middle": 1, "last": 2}
SIGNALS = ("SIGKILL", "SIGSTOP")
CONTEXTS = (128, 512, 2048)
# the resume-time targets, shown next to what was measured
TARGETS_S = {"SIGKILL": {"median": 1.0, "max": 2.0}, "SIGSTOP": {"max": 3.0}}
TEXT = (
    "Volunteer computing works because many people lend a little of their spare time and their "
    "machines to a common project. The machines come and go without warning: a laptop lid "
    "closes, a home router restarts, a game takes the GPU. "
)
RESUME_NOTE = (
    "resume = the lost hop's range is replaced and rebuilt from the rows the hop before it kept "
    "(the owner's tokens for a first hop), the surviving hops keep their caches; a loss before any "
    "step was answered re-prefills a new route (counted as 'resumed: no')"
)


def log(message: str) -> None:
    print(f"[failover] {message}", file=sys.stderr, flush=True)


def _stats(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    return {"n": len(values), "median_s": statistics.median(values), "min_s": min(values), "max_s": max(values)}


class Bench:
    def __init__(self, swarm, client, memory_bytes: int, rng: random.Random, reprefill_client=None) -> None:
        self.swarm = swarm
        self.c = client
        self.reprefill_client = reprefill_client  # resume off: a replan re-prefills the whole route
        self.memory_bytes = memory_bytes
        self.rng = rng
        self.references: dict[int, tuple[list[int], float]] = {}  # prompt length -> (tokens, first_token_s)

    def name_of(self, peer_id: str) -> str:
        (name,) = [name for name, proc in self.swarm.nodes.items() if proc.peer_id == peer_id]
        return name

    async def reference(self, prompt: list[int], max_tokens: int, stop: list[int]) -> tuple[list[int], float]:
        key = (len(prompt), max_tokens)
        if key not in self.references:
            run = await self.c.generate_tokens(ALIAS, prompt, max_tokens=max_tokens, stop_tokens=stop)
            self.references[key] = (run.tokens, run.first_token_s)
        return self.references[key]

    async def signalled_run(
        self,
        how: str,
        position: str,
        prompt: list[int],
        stop: list[int],
        *,
        max_tokens: int,
        at_token: int,
        resume: bool = True,
    ) -> dict:
        """One generation with the hop at ``position`` signalled after ``at_token`` tokens; the
        victim is then restarted and the swarm waited for."""
        from agent.demo.swarm_demo import wait_for_copies

        expected, healthy_first_token_s = await self.reference(prompt, max_tokens, stop)
        route = await self.c.route(ALIAS)
        victim_id = route.hops[POSITIONS[position]].peer_id
        victim = self.swarm.nodes[self.name_of(victim_id)]
        times: list[float] = []
        signalled_at: list[float] = []
        signalled_after: list[int] = []

        async def on_token(token: int, _logits, _route) -> bool:
            times.append(time.perf_counter())
            if len(times) == at_token:
                victim.signal_group(getattr(signal, how))
                signalled_at.append(time.perf_counter())
                signalled_after.append(len(times))
            return False

        record = {
            "signal": how, "position": position, "positions_at_signal": len(prompt) + at_token, "victim": victim_id,
            "resume_enabled": resume,
        }  # fmt: skip
        client = self.c if resume else self.reprefill_client
        try:
            result = await client.generate_tokens(
                ALIAS, prompt, max_tokens=max_tokens, stop_tokens=stop, on_token=on_token, route=route
            )
        except Exception as error:  # a failed generation is a result of this benchmark, not its end
            record.update(ok=False, error=f"{type(error).__name__}: {error}")
        else:
            n = signalled_after[0] if signalled_after else 0
            record.update(
                ok=result.tokens == expected and bool(signalled_at),
                tokens_equal=result.tokens == expected,
                replans=result.replans,
                resumed=bool(result.resumes),
                resume_s=times[n] - times[n - 1] if n and len(times) > n else None,
                healthy_step_s=(times[n - 1] - times[n - 2]) if n >= 2 else None,
                healthy_prefill_s=healthy_first_token_s,
            )
        await self.swarm.kill_node(victim.name)
        self.swarm.start_node(victim.name, self.memory_bytes)
        await wait_for_copies(self.c, self.swarm, 2, timeout_s=120.0)
        return record


async def run(args: argparse.Namespace) -> dict:
    from agent.demo.swarm_demo import wait_for_copies, wait_for_coverage
    from agent.harness.local_swarm import LocalSwarmConfig, open_local_swarm
    from agent.io.client import SwarmClientConfig, open_swarm_client
    from agent.models import model_path

    rng = random.Random(args.seed)
    config = LocalSwarmConfig(
        model_path=model_path(ALIAS), model_alias=ALIAS, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS, threads=args.threads
    )  # a private temp work dir, removed at the end
    client_config = SwarmClientConfig(replan_attempts=2, replan_wait_s=30.0)
    reprefill_config = SwarmClientConfig(replan_attempts=2, replan_wait_s=30.0, resume=False)
    kills: list[dict] = []
    contexts: list[dict] = []
    async with open_local_swarm(config) as swarm:
        await swarm.start_tracker()
        async with open_swarm_client(swarm.tracker_addr, config=client_config) as c:
            (entry,) = [m for m in await c.list_models() if m.alias == ALIAS]
            memory = BLOCKS_EACH * entry.bytes_per_block + entry.bytes_per_block // 2
            for i in range(NODES):
                swarm.start_node(f"node-{i + 1}", memory)
            route = await wait_for_coverage(c, swarm, ALIAS, timeout_s=300.0)
            await wait_for_copies(c, swarm, 2, timeout_s=300.0)
            text_tokens, stop = await c.tokenize(route, TEXT * 40)
            async with open_swarm_client(swarm.tracker_addr, config=reprefill_config) as c_reprefill:
                bench = Bench(swarm, c, memory, rng, c_reprefill)
                await _measure(bench, args, rng, text_tokens, stop, kills, contexts)
    return {"kills": kills, "contexts": contexts}


async def _measure(bench, args, rng, text_tokens, stop, kills, contexts) -> None:
    """Part 1 (signals at each hop position), then part 2 (context lengths), into the lists."""
    prompt = text_tokens[:48]
    log(f"swarm up: {NODES} nodes x {BLOCKS_EACH} blocks; {args.kills} runs per signal and position")

    runs = {"SIGKILL": args.kills, "SIGSTOP": args.stops}
    plan = [(how, position) for how in SIGNALS for position in POSITIONS for _ in range(runs[how])]
    rng.shuffle(plan)
    for i, (how, position) in enumerate(plan):
        record = await bench.signalled_run(
            how, position, prompt, stop, max_tokens=args.max_tokens, at_token=rng.randint(3, args.max_tokens - 4)
        )
        kills.append(record)
        log(f"{i + 1}/{len(plan)} {how} {position}: resume {record.get('resume_s')} ok={record['ok']}")

    for n_ctx in args.contexts:
        # signalled at n_ctx - 4 positions; the run ends at n_ctx (2048: the workers' context)
        at_token = 4
        n_prompt = n_ctx - 2 * at_token
        ctx_prompt = (text_tokens * (n_prompt // len(text_tokens) + 1))[:n_prompt]
        for _ in range(args.context_kills):
            for resume in (True, False):
                record = await bench.signalled_run(
                    "SIGKILL", "last", ctx_prompt, stop, max_tokens=2 * at_token, at_token=at_token,
                    resume=resume,
                )  # fmt: skip
                record["context_positions"] = n_ctx
                contexts.append(record)
                log(f"context {n_ctx} resume={resume}: {record.get('resume_s')} ok={record['ok']}")


def summarize(raw: dict, args: argparse.Namespace) -> dict:
    by_signal_position = {}
    for how in SIGNALS:
        for position in POSITIONS:
            runs = [r for r in raw["kills"] if r["signal"] == how and r["position"] == position]
            gaps = [r["resume_s"] for r in runs if r.get("ok") and r.get("resume_s") is not None]
            by_signal_position[f"{how} {position}"] = {
                **_stats(gaps), "runs": len(runs), "failed": sum(not r.get("ok") for r in runs),
                "resumed": sum(bool(r.get("resumed")) for r in runs),
            }  # fmt: skip
    by_signal = {}
    for how in SIGNALS:
        gaps = [
            r["resume_s"] for r in raw["kills"] if r["signal"] == how and r.get("ok") and r.get("resume_s") is not None
        ]
        by_signal[how] = {**_stats(gaps), "target_s": TARGETS_S[how]}
    by_context = {}
    for n_ctx in args.contexts:
        runs = [r for r in raw["contexts"] if r["context_positions"] == n_ctx]

        def gaps(resume: bool, runs=runs) -> list[float]:
            return [
                r["resume_s"] for r in runs
                if r.get("resume_enabled", True) == resume and r.get("ok") and r.get("resume_s") is not None
            ]  # fmt: skip

        prefill = [r["healthy_prefill_s"] for r in runs if r.get("healthy_prefill_s") is not None]
        by_context[str(n_ctx)] = {
            "resume": _stats(gaps(True)),
            "reprefill": _stats(gaps(False)),
            "healthy_prefill_s": statistics.median(prefill) if prefill else None,
            "resumed": sum(bool(r.get("resumed")) for r in runs if r.get("resume_enabled", True)),
            "runs": len(runs),
            "failed": sum(not r.get("ok") for r in runs),
        }
    return {"by_signal": by_signal, "by_signal_position": by_signal_position, "by_context": by_context}


def _f(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def render_markdown(report: dict) -> str:
    s = report["summary"]
    m = report["machine"]
    lines = [
        "# Failover: resume time after a hop dies or freezes",
        "",
        f"Machine: {m.get('cpu_model')}, {m.get('cores')} cores, {m.get('ram_gib', 0):.1f} GiB, {m.get('platform')}; "
        f"load before: {m.get('loadavg_before')}; Baton {m.get('baton_commit', '?')}, llama.cpp {m.get('llama_cpp_commit', '?')[:12]}.",
        f"Swarm: {NODES} nodes x {BLOCKS_EACH} blocks of SmolLM2 on loopback (two copies of each range), "
        f"heartbeat timeout {HEARTBEAT_TIMEOUT_MS} ms, {report['config']['threads']} thread(s) per worker; "
        f"{report['config']['kills']} SIGKILL and {report['config'].get('stops', report['config']['kills'])} SIGSTOP runs "
        f"per hop position, seed {report['config']['seed']}.",
        "",
        f"Note: {RESUME_NOTE}.",
        "",
        "Resume time = last token before the signal -> first token after it.",
        "",
        "| signal | median s | max s | runs ok | target |",
        "|---|---|---|---|---|",
    ]
    for how, row in s["by_signal"].items():
        target = ", ".join(f"{k} <= {v} s" for k, v in row["target_s"].items())
        lines.append(f"| {how} | {_f(row.get('median_s'))} | {_f(row.get('max_s'))} | {row['n']} | {target} |")
    lines += [
        "",
        "| signal, hop | median s | max s | runs | failed | resumed (survivors kept their caches) |",
        "|---|---|---|---|---|---|",
    ]
    for key, row in s["by_signal_position"].items():
        lines.append(
            f"| {key} | {_f(row.get('median_s'))} | {_f(row.get('max_s'))} | {row['runs']} | {row['failed']} | "
            f"{row.get('resumed', 0)} |"
        )
    lines += [
        "",
        "Resume time against context length (last hop SIGKILLed at that many positions): resumed "
        "(only the lost range rebuilt) next to resume off (the whole new route re-prefilled), and a "
        "healthy run's time to its first token at that length:",
        "",
        "| positions | resume median s | resume max s | re-prefill median s | re-prefill max s | healthy prefill s | runs | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n_ctx, row in s["by_context"].items():
        r, p = row["resume"], row["reprefill"]
        lines.append(
            f"| {n_ctx} | {_f(r.get('median_s'))} | {_f(r.get('max_s'))} | {_f(p.get('median_s'))} | "
            f"{_f(p.get('max_s'))} | {_f(row['healthy_prefill_s'])} | {row['runs']} | {row['failed']} |"
        )
    lines += ["", f"Wall time: {report['wall_time_s']:.0f} s.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20, help="SIGKILLed runs per hop position (default 20)")
    parser.add_argument("--stops", type=int, default=7, help="SIGSTOPped runs per hop position (default 7)")
    parser.add_argument("--context-kills", type=int, default=5, help="SIGKILLed runs per context length (default 5)")
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS), help="context lengths (positions)")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens per generation of part 1")
    parser.add_argument("--threads", type=int, default=1, help="threads of every worker (default 1)")
    parser.add_argument("--seed", type=int, default=13, help="seeds the order of runs and the signal points")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results", help="where failover.{json,md} go")
    parser.add_argument("--quick", action="store_true", help="a smoke pass: 1 run each, contexts 128 and 512")
    args = parser.parse_args(argv)
    if args.quick:
        args.kills, args.stops, args.context_kills, args.contexts, args.max_tokens = 1, 1, 1, [128, 512], 12
    if args.kills < 1 or args.context_kills < 0 or args.max_tokens < 8:
        parser.error("--kills must be >= 1, --context-kills >= 0 and --max-tokens >= 8")
    machine = machine_info()
    started = time.perf_counter()
    raw = trio.run(run, args)
    report = {
        "benchmark": "failover",
        "machine": machine,
        "config": {
            "kills": args.kills,
            "stops": args.stops,
            "context_kills": args.context_kills,
            "contexts": args.contexts,
            "max_tokens": args.max_tokens,
            "threads": args.threads,
            "seed": args.seed,
            "quick": args.quick,
            "nodes": NODES,
            "blocks_each": BLOCKS_EACH,
            "heartbeat_timeout_ms": HEARTBEAT_TIMEOUT_MS,
            "resume_definition": "last token before the signal -> first token after it",
            "note": RESUME_NOTE,
        },
        "summary": summarize(raw, args),
        "runs": raw,
    }
    report["wall_time_s"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    md = render_markdown(report)
    (args.out / "failover.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "failover.md").write_text(md)
    print(md)
    log(f"wrote {args.out / 'failover.json'} and failover.md in {report['wall_time_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
