"""The relay under concurrent clients: aggregate speed against one client, and a sustained load.

Owns one benchmark, two parts, in one run, through the demo's swarm on loopback
(``agent.demo.swarm_demo.open_demo_relay``: a tracker, three nodes splitting SmolLM2 three ways,
8 sequences a worker, the relay trusted by the nodes) driven by the real ``openai`` client
(streamed chats of ``--tokens`` tokens, ``ignore_eos`` so that every chat is that long):

1. ``scaling``: for temperatures 0 and 0.7 and 1, 3 and 8 concurrent clients, each client doing
   ``--chats`` chats back to back: aggregate tokens/s (every client's tokens over the wall time
   from the first request to the last answer), and its ratio to one client's, ``--rounds`` times
   (the configurations interleaved within a round; the medians of the rounds are reported).
   Targets: 3 clients >= 1.8x one, 8 clients >= 2.5x.
2. ``sustain``: 16 clients (``--sustain-clients``), each doing chats back to back for
   ``--sustain-s`` seconds (default 300) at temperature 0.7: time to first token (the request's
   wait: queueing, prefill, the first step) p50, p99 and mean, and how many requests got 503
   (or another error). Targets: no 503, p99 <= 3x the mean.

CPU time per generated token is reported for each configuration, by role (the relay, the node
agents with their workers, the tracker, the clients; from ``/proc``): the machine's load moves
wall-clock speed, less the CPU a token costs, and it shows which process a token's cost is in.
``--profile-relay FILE`` runs the relay under cProfile and writes its stats there.

It uses the checkout it lives in (run another checkout's ``bench/relay.py`` to compare two).
Writes ``relay.json`` and ``relay.md`` under ``--out`` (printed only without it; pass
``--out bench/results`` to keep them). Run it alone on the machine (about 8 minutes;
``--quick``: one round of one chat, 20 s sustained: a smoke pass).

Usage: ``.venv/bin/python bench/relay.py [--only scaling|sustain] [--rounds 3] [--chats 3]
[--tokens 32] [--sustain-s 300] [--quick] [--profile-relay FILE] [--out DIR]``
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import _bootstrap  # noqa: F401  (first: it makes the project importable)
import trio
from common import log, machine_info, publish

from agent.demo.swarm_demo import DEMO_MAX_SEQUENCES, demo_swarm_config, open_demo_relay

TEMPERATURES = (0.0, 0.7)
CLIENTS = (1, 3, 8)
TARGET_RATIO = {3: 1.8, 8: 2.5}
TARGET_P99_OVER_MEAN = 3.0
SUSTAIN_TEMPERATURE = 0.7
QUESTIONS = (
    "Tell me about the sea.",
    "What do bees do all day?",
    "Describe a walk in the mountains.",
    "Why is the sky blue?",
    "Write a few lines about trains.",
    "What is a good breakfast?",
    "Explain how a bicycle works.",
    "Describe a city at night.",
)


def _cpu_by_role(groups: dict[str, list[int]]) -> dict[str, float]:
    """User + system CPU seconds of every live process in each role's process groups, and of
    this process (``clients``: the ``openai`` clients). A node's group holds its workers: they
    count as ``workers``, the node agent (the group's leader) as ``nodes``."""
    role_of = {pgid: role for role, pgids in groups.items() for pgid in pgids}
    cpu = dict.fromkeys(groups, 0.0)
    if "nodes" in groups:
        cpu["workers"] = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # (it ended meanwhile)
            continue
        pgid = int(fields[2])
        role = role_of.get(pgid)
        if role == "nodes" and int(stat.parent.name) != pgid:
            role = "workers"
        if role is not None:
            cpu[role] += (int(fields[11]) + int(fields[12])) / tick
    times = os.times()
    cpu["clients"] = times.user + times.system
    return cpu


def _cpu_ms_per_token(before: dict[str, float], after: dict[str, float], tokens: int) -> dict[str, float]:
    return {role: 1000 * (after[role] - before[role]) / max(tokens, 1) for role in after}


class Chats:
    """Streamed chats through the relay with the ``openai`` client, one client object a thread."""

    def __init__(self, base_url: str, api_key: str, model: str, tokens: int) -> None:
        self.base_url, self.api_key, self.model, self.tokens = base_url, api_key, model, tokens
        self._local = threading.local()

    def _client(self):
        import openai

        if getattr(self._local, "client", None) is None:
            self._local.client = openai.OpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0, timeout=900)
        return self._local.client

    def chat(self, index: int, temperature: float) -> dict:
        """One streamed chat: ``{"ok", "status", "tokens", "started", "first_token_s", "total_s"}``
        (times in seconds, ``started`` on ``time.perf_counter``)."""
        import openai

        started = time.perf_counter()
        first = None
        tokens = 0
        try:
            stream = self._client().chat.completions.create(
                model=self.model,
                messages=[{"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]}],
                max_tokens=self.tokens,
                temperature=temperature,
                seed=index,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content and first is None:
                    first = time.perf_counter()
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
        except openai.APIStatusError as error:
            return {"ok": False, "status": error.status_code, "error": str(error)[:300], "tokens": 0,
                    "started": started, "first_token_s": None, "total_s": time.perf_counter() - started}  # fmt: skip
        except openai.APIError as error:
            return {"ok": False, "status": 0, "error": str(error)[:300], "tokens": 0,
                    "started": started, "first_token_s": None, "total_s": time.perf_counter() - started}  # fmt: skip
        ended = time.perf_counter()
        return {"ok": True, "status": 200, "tokens": tokens, "started": started,
                "first_token_s": (first or ended) - started, "total_s": ended - started, "ended": ended}  # fmt: skip


def run_clients(chats: Chats, n_clients: int, temperature: float, per_client: int) -> dict:
    """``n_clients`` threads, each ``per_client`` chats back to back: aggregate tokens/s."""
    results: list[dict] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for k in range(per_client):
            result = chats.chat(c * per_client + k, temperature)
            with lock:
                results.append(result)

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(n_clients) as pool:
        for future in [pool.submit(client, c) for c in range(n_clients)]:
            future.result()
    wall_s = time.perf_counter() - started
    tokens = sum(r["tokens"] for r in results)
    failed = [r for r in results if not r["ok"]]
    return {
        "clients": n_clients, "temperature": temperature, "chats": len(results), "failed": len(failed),
        "failures": [f"{r['status']}: {r['error']}" for r in failed[:3]], "tokens": tokens, "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "first_token_s_median": statistics.median(r["first_token_s"] for r in results if r["ok"]) if tokens else None,
    }  # fmt: skip


def bench_scaling(chats: Chats, groups: dict[str, list[int]], rounds: int, per_client: int) -> dict:
    runs: dict[str, list[dict]] = {}
    total_before, tokens = _cpu_by_role(groups), 0
    for round_index in range(rounds):
        configs = [(t, n) for t in TEMPERATURES for n in CLIENTS]
        for temperature, n in configs if round_index % 2 == 0 else reversed(configs):
            before = _cpu_by_role(groups)
            run = run_clients(chats, n, temperature, per_client)
            run["cpu_ms_per_token"] = _cpu_ms_per_token(before, _cpu_by_role(groups), run["tokens"])
            tokens += run["tokens"]
            log(
                f"round {round_index + 1}: {n} clients at temperature {temperature}: {run['tokens_per_s']:.1f} tokens/s"
            )
            runs.setdefault(f"{temperature}/{n}", []).append(run)
    cpu = _cpu_ms_per_token(total_before, _cpu_by_role(groups), tokens)
    table = {}
    for temperature in TEMPERATURES:
        one = [r["tokens_per_s"] for r in runs[f"{temperature}/1"]]
        for n in CLIENTS:
            these = runs[f"{temperature}/{n}"]
            ratios = [r["tokens_per_s"] / o for r, o in zip(these, one, strict=True) if o > 0]
            ratio = statistics.median(ratios) if ratios else 0.0
            target = TARGET_RATIO.get(n)
            table[f"{temperature}/{n}"] = {
                "temperature": temperature, "clients": n,
                "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in these),
                "tokens_per_s_by_round": [r["tokens_per_s"] for r in these],
                "ratio_to_one_client_median": ratio, "ratio_by_round": ratios,
                "first_token_s_median": statistics.median(
                    r["first_token_s_median"] for r in these if r["first_token_s_median"] is not None
                ) if any(r["first_token_s_median"] is not None for r in these) else None,
                "failed": sum(r["failed"] for r in these), "failures": [f for r in these for f in r["failures"]][:3],
                "cpu_ms_per_token_median": {
                    role: statistics.median(r["cpu_ms_per_token"][role] for r in these) for role in cpu
                },
                "target_ratio": target, "met": None if target is None else ratio >= target,
            }  # fmt: skip
    return {"configs": table, "cpu_ms_per_token": cpu}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def bench_sustain(chats: Chats, groups: dict[str, list[int]], n_clients: int, duration_s: float) -> dict:
    results: list[dict] = []
    lock = threading.Lock()
    stop_at = time.perf_counter() + duration_s

    def client(c: int) -> None:
        k = 0
        while time.perf_counter() < stop_at:
            result = chats.chat(1000 * c + k, SUSTAIN_TEMPERATURE)
            k += 1
            with lock:
                results.append(result)

    cpu_before = _cpu_by_role(groups)
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(n_clients) as pool:
        for future in [pool.submit(client, c) for c in range(n_clients)]:
            future.result()
    wall_s = time.perf_counter() - started
    cpu_after = _cpu_by_role(groups)
    ok = [r for r in results if r["ok"]]
    waits = [r["first_token_s"] for r in ok]
    busy = [r for r in results if r["status"] == 503]
    other = [r for r in results if not r["ok"] and r["status"] != 503]
    tokens = sum(r["tokens"] for r in ok)
    mean = statistics.fmean(waits) if waits else 0.0
    p99 = _percentile(waits, 99) if waits else 0.0
    return {
        "clients": n_clients, "duration_s": duration_s, "wall_s": wall_s, "temperature": SUSTAIN_TEMPERATURE,
        "requests": len(results), "ok": len(ok), "status_503": len(busy), "other_errors": len(other),
        "errors": [f"{r['status']}: {r['error']}" for r in (busy + other)[:5]],
        "tokens": tokens, "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "wait_s_p50": _percentile(waits, 50) if waits else 0.0, "wait_s_p99": p99, "wait_s_mean": mean,
        "wait_s_max": max(waits) if waits else 0.0, "p99_over_mean": p99 / mean if mean > 0 else 0.0,
        "met": not busy and mean > 0 and p99 <= TARGET_P99_OVER_MEAN * mean,
        "cpu_ms_per_token": _cpu_ms_per_token(cpu_before, cpu_after, tokens),
    }  # fmt: skip


async def bench(args: argparse.Namespace) -> dict:
    from agent.harness.local_swarm import command_prefix

    config = demo_swarm_config(threads=args.threads)
    relay_command = None
    if args.profile_relay is not None:
        relay_command = [sys.executable, "-m", "cProfile", "-o", str(args.profile_relay.resolve()),
                         *command_prefix("relay")[1:]]  # fmt: skip
    report: dict = {}
    async with open_demo_relay(config, relay_command=relay_command) as (swarm, url, api_key):
        assert swarm.relay is not None and swarm.tracker is not None
        groups = {  # (each process leads its own group)
            "relay": [swarm.relay.process.pid],
            "nodes": [node.process.pid for node in swarm.nodes.values()],
            "tracker": [swarm.tracker.process.pid],
        }
        chats = Chats(f"{url}/v1", api_key, config.model_alias, args.tokens)
        log(f"relay at {url}; warming up")
        await trio.to_thread.run_sync(run_clients, chats, 2, 0.0, 1)
        if args.only in (None, "scaling"):
            report["scaling"] = await trio.to_thread.run_sync(bench_scaling, chats, groups, args.rounds, args.chats)
        if args.only in (None, "sustain"):
            log(f"{args.sustain_clients} clients for {args.sustain_s:.0f} s")
            report["sustain"] = await trio.to_thread.run_sync(
                bench_sustain, chats, groups, args.sustain_clients, args.sustain_s
            )
    return report


def markdown(report: dict) -> str:
    machine = report["machine"]
    lines = [
        "# The relay under concurrent clients (`bench/relay.py`)",
        "",
        f"Machine: {machine['summary']}. Baton checkout `{machine.get('baton_commit', '?')}`"
        + (f" (modified: {', '.join(machine['baton_modified_files'])})" if machine.get("baton_modified_files") else "")
        + ".",
        "",
        f"The demo's swarm on loopback (three nodes split SmolLM2, {DEMO_MAX_SEQUENCES} sequences a worker, 1 thread "
        f"a worker, the relay trusted), streamed chats of {report['tokens']} tokens from the `openai` client.",
        "",
    ]
    if "scaling" in report:
        scaling = report["scaling"]
        lines += [
            f"## Aggregate speed against one client ({report['rounds']} rounds, {report['chats']} chats a client)",
            "",
            "| temperature | clients | tokens/s (median) | ratio to one client (median) | by round | target | "
            "first token s (median) | failed |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for c in scaling["configs"].values():
            target = "" if c["target_ratio"] is None else f">= {c['target_ratio']}x: {'met' if c['met'] else 'MISSED'}"
            first = "" if c["first_token_s_median"] is None else f"{c['first_token_s_median']:.2f}"
            lines.append(
                f"| {c['temperature']} | {c['clients']} | {c['tokens_per_s_median']:.1f} | "
                f"{c['ratio_to_one_client_median']:.2f}x | {', '.join(f'{r:.2f}' for r in c['ratio_by_round'])} | "
                f"{target} | {first} | {c['failed']} |"
            )
        roles = list(scaling["cpu_ms_per_token"])
        lines += [
            "",
            "CPU a generated token, ms (median of the rounds; nodes: the node agents, workers: their workers; "
            "clients: this process, the `openai` clients; the processes' idle work counts too):",
            "",
            "| temperature | clients | " + " | ".join(roles) + " |",
            "|---|---|" + "---|" * len(roles),
        ]
        for c in scaling["configs"].values():
            cpu = c["cpu_ms_per_token_median"]
            lines.append(
                f"| {c['temperature']} | {c['clients']} | " + " | ".join(f"{cpu[r]:.2f}" for r in roles) + " |"
            )
        lines.append("")
    if "sustain" in report:
        s = report["sustain"]
        lines += [
            f"## {s['clients']} clients for {s['duration_s']:.0f} s (temperature {s['temperature']})",
            "",
            "| requests | ok | 503 | other errors | tokens/s | wait p50 s | p99 s | mean s | max s | p99 / mean | "
            "target (no 503, p99 <= 3x mean) |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
            f"| {s['requests']} | {s['ok']} | {s['status_503']} | {s['other_errors']} | {s['tokens_per_s']:.1f} | "
            f"{s['wait_s_p50']:.2f} | {s['wait_s_p99']:.2f} | {s['wait_s_mean']:.2f} | {s['wait_s_max']:.2f} | "
            f"{s['p99_over_mean']:.2f} | {'met' if s['met'] else 'MISSED'} |",
            "",
            "A request's wait is its time to first token (queueing, prefill, the first step). CPU a generated "
            "token, ms: " + ", ".join(f"{role} {ms:.2f}" for role, ms in s["cpu_ms_per_token"].items()) + ".",
            "",
        ]
        if s["errors"]:
            lines += ["Errors (first five): " + "; ".join(s["errors"]), ""]
    if report.get("quick"):
        lines += ["A `--quick` smoke pass: its figures are not measurements.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("scaling", "sustain"), help="run one part only")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the scaling part (default 3)")
    parser.add_argument("--chats", type=int, default=3, help="chats a client does in a scaling run (default 3)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens a chat (default 32)")
    parser.add_argument("--threads", type=int, default=1, help="threads a worker (default 1)")
    parser.add_argument("--sustain-s", type=float, default=300.0, help="seconds of the sustained part (default 300)")
    parser.add_argument("--sustain-clients", type=int, default=16, help="clients of the sustained part (default 16)")
    parser.add_argument("--quick", action="store_true", help="one round of one chat, 20 s sustained: a smoke pass")
    parser.add_argument("--profile-relay", type=Path, help="run the relay under cProfile, its stats written here")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.chats, args.sustain_s = 1, 1, min(args.sustain_s, 20.0)
    started = time.perf_counter()
    info = machine_info()
    parts = trio.run(bench, args)
    report = {
        "machine": {**info, "summary": _summary(info)},
        "tokens": args.tokens,
        "rounds": args.rounds,
        "chats": args.chats,
        "quick": args.quick,
        "max_sequences": DEMO_MAX_SEQUENCES,
        **parts,
        "wall_s": time.perf_counter() - started,
    }
    publish(args.out, "relay", report, markdown(report))
    return 0


def _summary(info: dict) -> str:
    return (
        f"{info['cpu_model']}, {info['cores']} cores, {info['ram_gib']:.1f} GiB RAM, {info['platform']}, "
        f"Python {info['python']}; load average before {info['loadavg_before']}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
