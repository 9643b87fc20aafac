"""What output integrity costs: canaries and spot checks as a share of swarm throughput.

Owns one command that starts a swarm of real processes (``agent.harness.local_swarm``: a tracker
and four nodes of fifteen blocks of SmolLM2, so every range has two copies, which spot checks
need) and measures greedy generation throughput (tokens/s over ``--concurrency`` concurrent
generation loops for ``--duration-s``) in phases:

1. ``baseline``: no canaries (tracker ``--canary-interval-s 0``), no spot checks;
2. ``spot default``: spot checks at the default rate (``baton relay serve --spot-check-rate``,
   0.01 of generations), and ``spot all``: every generation spot-checked (rate 1.0), which
   gives the cost of one checked generation;
3. ``canaries default``: the tracker restarted with the default ``--canary-interval-s 300``
   (its first checks of every range included), and ``canaries fast``: ``--fast-interval-s``
   (canaries back to back when 0), which gives the cost of one canary.

The shares at the default rates are given two ways: as measured in the default phases (at
these rates the effect is within the run-to-run noise of a short run), and extrapolated from the
fast phases: spot checks cost ``rate x`` the throughput loss of checking every generation, and
canaries ``(default canaries/s) / (fast canaries/s) x`` the loss at the fast rate, where the
default rate is ``ranges / interval`` (a canary per served range per interval). The work share
(rows the nodes ran for checks over rows of real traffic) is given too. Everything runs on one
machine: the tracker's reference workers (a canary runs the whole model on the tracker) compete
with the nodes for its cores, which a tracker on its own machine would not.

Writes ``integrity.json`` and ``integrity.md`` under ``--out`` (default bench/results), with the
machine described as ``bench/compare.py`` describes it. Run it alone on the machine.

Usage: ``.venv/bin/python bench/integrity.py [--duration-s 30] [--concurrency 2] [--max-tokens 32]
[--fast-interval-s 0] [--out bench/results]``; ``--quick``: 8 s phases (a smoke pass).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import trio
from _bootstrap import BENCH_DIR  # first: it makes the project importable
from common import machine_info

ALIAS = "smollm2"
NODES = 4
BLOCKS_EACH = 15
DEFAULT_INTERVAL_S = 300.0  # baton tracker serve --canary-interval-s
DEFAULT_SPOT_RATE = 0.01  # baton relay serve / baton generate --spot-check-rate
PROMPT = (
    "Volunteer computing works because many people lend a little of their spare time and their "
    "machines to a common project."
)


def log(message: str) -> None:
    print(f"[integrity {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class Phase:
    name: str
    tokens: int = 0
    generations: int = 0
    elapsed_s: float = 0.0
    rows: int = 0  # rows the nodes ran for real traffic (every hop)
    shadow_rows: int = 0  # rows of spot-check shadow sessions (their first hop's count, x hops)
    spot_sessions: int = 0
    spot_mismatches: int = 0
    canaries: int = 0  # checks passed during the phase (all nodes)
    canary_failures: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s else 0.0


async def _checks_passed(client) -> tuple[int, int]:
    nodes = await client.list_nodes()
    return sum(n.checks_passed for n in nodes), sum(len(n.integrity_failures) for n in nodes)


async def _load(client, phase: Phase, prompt: list[int], args: argparse.Namespace) -> None:
    """``--concurrency`` loops of greedy generations for ``--duration-s``."""
    deadline = trio.current_time() + args.duration_s
    spot = client.spot_checks.stats
    before = (spot.sessions, spot.rows, spot.mismatches)
    passed_before, failed_before = await _checks_passed(client)

    async def loop() -> None:
        while trio.current_time() < deadline:
            result = await client.generate_tokens(ALIAS, prompt, max_tokens=args.max_tokens, stop_tokens=[])
            phase.tokens += len(result.tokens)
            phase.generations += 1
            phase.rows += sum(hop["rows"] for hop in result.hop_rows)

    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(args.concurrency):
            nursery.start_soon(loop)
    phase.elapsed_s = trio.current_time() - started
    hops = 2  # two ranges of fifteen blocks: a shadow's row runs on both
    phase.spot_sessions = spot.sessions - before[0]
    phase.shadow_rows = (spot.rows - before[1]) * hops
    phase.spot_mismatches = spot.mismatches - before[2]
    passed_after, failed_after = await _checks_passed(client)
    phase.canaries = passed_after - passed_before
    phase.canary_failures = failed_after - failed_before
    log(
        f"{phase.name}: {phase.tokens_per_s:.1f} tokens/s ({phase.generations} generations), {phase.canaries} "
        f"canaries, {phase.spot_sessions} spot-checked sessions"
    )


async def _restart_tracker(swarm, client, interval_s: float, timeout_s: float) -> None:
    """The tracker again with ``--canary-interval-s interval_s``; back once every range has two
    READY copies that passed their first check (when checks are on)."""
    from agent.demo.swarm_demo import wait_for_copies, wait_for_coverage

    await swarm.stop_tracker()
    swarm.config = dataclasses.replace(swarm.config, canary_interval_s=interval_s)
    await swarm.start_tracker()
    await wait_for_coverage(client, swarm, ALIAS, timeout_s=timeout_s)  # every range READY (and checked)
    await wait_for_copies(client, swarm, 2, timeout_s=timeout_s, checked=True)


async def run(args: argparse.Namespace) -> dict:
    from agent.demo.swarm_demo import wait_for_copies, wait_for_coverage
    from agent.harness.local_swarm import LocalSwarmConfig, open_local_swarm
    from agent.io.client import SwarmClientConfig, open_swarm_client
    from agent.models import model_path

    config = LocalSwarmConfig(
        model_path=model_path(ALIAS), model_alias=ALIAS, canary_interval_s=0.0,
        tracker_args=("--canary-max-prompt-rows", str(args.canary_max_prompt_rows)),
    )  # fmt: skip
    phases: list[Phase] = []
    async with open_local_swarm(config) as swarm:
        await swarm.start_tracker()
        async with open_swarm_client(swarm.tracker_addr, config=SwarmClientConfig()) as client:
            (entry,) = [m for m in await client.list_models() if m.alias == ALIAS]
            memory = BLOCKS_EACH * entry.bytes_per_block + entry.bytes_per_block // 2
            for i in range(NODES):
                swarm.start_node(f"node-{i + 1}", memory)
            route = await wait_for_coverage(client, swarm, ALIAS, timeout_s=args.setup_timeout_s)
            await wait_for_copies(client, swarm, 2, timeout_s=args.setup_timeout_s)
            prompt, _ = await client.tokenize(route, PROMPT)
            await _load(client, Phase("warm-up"), prompt, argparse.Namespace(**{**vars(args), "duration_s": 3.0}))

            for name, rate in (("baseline", 0.0), ("spot default", DEFAULT_SPOT_RATE), ("spot all", 1.0)):
                client.spot_checks.rate = rate
                phases.append(Phase(name))
                await _load(client, phases[-1], prompt, args)
            client.spot_checks.rate = 0.0
            for name, interval_s in (("canaries default", DEFAULT_INTERVAL_S), ("canaries fast", args.fast_interval_s)):
                log(f"restarting the tracker with --canary-interval-s {interval_s}")
                await _restart_tracker(swarm, client, interval_s or 0.001, args.setup_timeout_s)
                phases.append(Phase(name))
                await _load(client, phases[-1], prompt, args)
            log("restarting the tracker without canaries for a second baseline")
            await _restart_tracker(swarm, client, 0.0, args.setup_timeout_s)
            phases.append(Phase("baseline again"))
            await _load(client, phases[-1], prompt, args)
    return {"phases": [dataclasses.asdict(p) | {"tokens_per_s": p.tokens_per_s} for p in phases]}


def summarize(raw: dict, args: argparse.Namespace) -> dict:
    """Shares of throughput and of node work at the default rates (pure; see the module doc)."""
    by = {p["name"]: p for p in raw["phases"]}
    base = (by["baseline"]["tokens_per_s"] + by["baseline again"]["tokens_per_s"]) / 2
    noise = abs(by["baseline"]["tokens_per_s"] - by["baseline again"]["tokens_per_s"]) / base if base else 0.0

    def loss(name: str) -> float:
        return 1.0 - by[name]["tokens_per_s"] / base if base else 0.0

    ranges = NODES  # every node serves one range
    fast = by["canaries fast"]
    fast_rate = fast["canaries"] / fast["elapsed_s"] if fast["elapsed_s"] else 0.0
    default_rate = ranges / DEFAULT_INTERVAL_S
    rows_per_canary = (1 + args.canary_max_prompt_rows) / 2 + (1 + 4) / 2  # mean prompt + decode rows
    real_rows_per_s = by["baseline"]["rows"] / by["baseline"]["elapsed_s"] if by["baseline"]["elapsed_s"] else 0.0
    spot_all = by["spot all"]
    return {
        "baseline_tokens_per_s": base,
        "baseline_noise": noise,
        "spot": {
            "default_rate": DEFAULT_SPOT_RATE,
            "measured_loss_at_default": loss("spot default"),
            "loss_checking_every_generation": loss("spot all"),
            "extrapolated_loss_at_default": DEFAULT_SPOT_RATE * loss("spot all"),
            "work_share_every_generation": spot_all["shadow_rows"] / spot_all["rows"] if spot_all["rows"] else 0.0,
            "work_share_at_default": DEFAULT_SPOT_RATE
            * (spot_all["shadow_rows"] / spot_all["rows"] if spot_all["rows"] else 0.0),
            "mismatches": sum(p["spot_mismatches"] for p in raw["phases"]),
        },
        "canaries": {
            "default_interval_s": DEFAULT_INTERVAL_S,
            "default_rate_per_s": default_rate,
            "measured_loss_at_default": loss("canaries default"),
            "fast_rate_per_s": fast_rate,
            "loss_at_fast_rate": loss("canaries fast"),
            "extrapolated_loss_at_default": loss("canaries fast") * default_rate / fast_rate if fast_rate else 0.0,
            "work_share_at_default": default_rate * rows_per_canary / real_rows_per_s if real_rows_per_s else 0.0,
            "failures": sum(p["canary_failures"] for p in raw["phases"]),
        },
    }


def _pct(x: float) -> str:
    return f"{100 * x:+.2f} %"


def render_markdown(report: dict) -> str:
    m, s, a = report["machine"], report["summary"], report["args"]
    spot, canary = s["spot"], s["canaries"]
    lines = [
        "# Integrity cost: canaries and spot checks (bench/integrity.py)",
        "",
        f"Machine: {m.get('cpu_model')}, {m.get('cores')} cores, {m.get('ram_gib', 0):.1f} GiB, {m.get('platform')}; "
        f"load average before: {m.get('loadavg_before')}. SmolLM2-135M Q4_1, {NODES} nodes x {BLOCKS_EACH} blocks "
        f"(two copies of each range), tracker, client and workers on this one machine; greedy, {a['concurrency']} "
        f"concurrent generations of {a['max_tokens']} tokens, {a['duration_s']:.0f} s a phase; canaries of 1-"
        f"{a['canary_max_prompt_rows']} prompt rows and 1-4 decode steps.",
        "",
        "| phase | tokens/s | generations | canaries | spot-checked sessions |",
        "|---|---|---|---|---|",
    ]
    for p in report["raw"]["phases"]:
        lines.append(
            f"| {p['name']} | {p['tokens_per_s']:.1f} | {p['generations']} | {p['canaries']} | {p['spot_sessions']} |"
        )
    lines += [
        "",
        f"Baseline {s['baseline_tokens_per_s']:.1f} tokens/s (the two baseline phases differ by "
        f"{100 * s['baseline_noise']:.1f} %: differences below that are noise).",
        "",
        "| at the default rates | throughput loss, measured | throughput loss, extrapolated | node work share |",
        "|---|---|---|---|",
        f"| spot checks, {spot['default_rate']:g} of generations | {_pct(spot['measured_loss_at_default'])} | "
        f"{_pct(spot['extrapolated_loss_at_default'])} (checking every generation: "
        f"{_pct(spot['loss_checking_every_generation'])}) | {_pct(spot['work_share_at_default'])} |",
        f"| canaries, every {canary['default_interval_s']:.0f} s per range ({canary['default_rate_per_s']:.4f}/s) | "
        f"{_pct(canary['measured_loss_at_default'])} | {_pct(canary['extrapolated_loss_at_default'])} (at "
        f"{canary['fast_rate_per_s']:.2f} canaries/s: {_pct(canary['loss_at_fast_rate'])}) | "
        f"{_pct(canary['work_share_at_default'])} |",
        "",
        f"Spot-check mismatches: {spot['mismatches']}; failed canaries: {canary['failures']} (all nodes honest).",
        "",
        "Measured: throughput of the phase against the baseline. Extrapolated: the loss at the fast "
        "rate scaled to the default rate (spot checks: x rate; canaries: x default / fast canaries per s). "
        "Work share: rows the nodes ran for the checks over the rows of real traffic. A canary also "
        "runs the whole model for its rows on the tracker (its reference), which here shares the "
        "nodes' cores.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=30.0, help="seconds of load a phase (default 30)")
    parser.add_argument("--concurrency", type=int, default=2, help="concurrent generation loops (default 2)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens a generation (default 32)")
    parser.add_argument(
        "--fast-interval-s", type=float, default=0.0, help="canary interval of the fast phase (default 0: back to back)"
    )
    parser.add_argument("--canary-max-prompt-rows", type=int, default=32, help="the tracker's default (32)")
    parser.add_argument("--setup-timeout-s", type=float, default=240.0)
    parser.add_argument("--quick", action="store_true", help="8 s phases: a smoke pass")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results")
    args = parser.parse_args(argv)
    if args.quick:
        args.duration_s = 8.0
    machine = machine_info()
    raw = trio.run(run, args)
    report = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": machine,
        "raw": raw,
        "summary": summarize(raw, args),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "integrity.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "integrity.md").write_text(render_markdown(report))
    print(render_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
