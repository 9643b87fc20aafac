"""A hop worker to worker (the per-hop overhead target, 0.3 ms): the workers' data plane against the same workers driven
one Forward at a time from Python, and against llama-bench.

Owns one command. Four ways to decode the same greedy tokens, all open at once (a whole-model
worker and the three range workers of an even split, each with its data plane), stepped in
turn at every step (the order rotating), so that each step compares them side by side:

- ``worker_unsplit``: the whole-model worker driven from this process over its Forward stream
  (``bench/compare.py``'s reference for the per-hop overhead), sequence 1;
- ``data_plane_1``: the same worker, the step going over its data plane (the owner sends a
  sealed STEP, the worker answers a sealed RESULT), sequence 0: the data plane's own cost;
- ``data_plane_3``: the three range workers chained worker to worker over their data planes:
  the owner sends the STEP to the first, each worker pushes its boundary rows sealed to the
  next, the last sends the RESULT (top-40 and the row's log-sum-exp) back; sequence 0;
- ``chain_3``: the same three workers driven one Forward at a time from this process, the
  boundary through Python as a node agent passes it today (minus the network); sequence 1.

Why step by step: this VM's speed drifts by more between two runs than a hop costs (the
first version of this benchmark, timing each system in its own run, read 0.42 and 0.83 ms a
hop in two rounds a minute apart). The per-hop overhead is, as ``bench/compare.py`` defines
it, (3-split step - unsplit step) / 3, here the median over steps of that difference within
each step. ``llama-bench -d 0,P`` runs between repetitions for the ratio to llama.cpp (not
paired: another process). Every system's tokens must be the same, or the run fails. Writes
``data_plane.json`` and ``data_plane.md`` under ``--out``. Run it alone on the machine.

The swarm's decode steps take this path (``bench/compare.py`` measures the swarm itself);
this benchmark isolates it: no tracker and no node agents, each system stepped side by side,
and the workers' own account of each decode step (``UnbindSessionReply``) says where the time
goes. ``bench/compare.py`` runs it for its "Where the time goes" section.

Usage: ``.venv/bin/python bench/data_plane.py [--reps 5] [--decode-steps 64] [--out bench/results]``
(about a minute; ``make native`` and the llama tools, which ``bench/compare.py`` builds).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import compare_report
import numpy as np
import trio
from _bootstrap import BENCH_DIR  # first: it makes the project importable
from common import ensure_llama_tools, log, machine_info, make_prompt, publish, run_llama_bench

from agent._proto import worker_pb2
from agent.core.wire.data_frames import OwnerSession, SessionKeys
from agent.core.wire.topk import DEFAULT_RESULT_TOP_K
from agent.core.wire.worker_records import SeqInput

HOST = "127.0.0.1"
SYSTEMS = ("worker_unsplit", "data_plane_1", "data_plane_3", "chain_3")
HOP_TARGET_MS = 0.3
SPLIT_TARGET = 0.9


async def _bind(workers, seq_id: int, next_step: int) -> OwnerSession:
    keys = SessionKeys.new(os.urandom)  # fresh keys for every binding: no (key, nonce) is used twice
    step_keys = [keys.first_step_key] + [os.urandom(32) for _ in workers[1:]]
    for i, worker in enumerate(workers):
        request = worker_pb2.BindSessionRequest(
            schema_version=1, session_id=keys.session_id, seq_id=seq_id, step_key=step_keys[i], next_step=next_step
        )
        if i + 1 < len(workers):
            request.next_host, request.next_port = HOST, workers[i + 1].info.data_port
            request.next_step_key = step_keys[i + 1]
        else:
            request.return_key = keys.return_key
        await worker.client.call("BindSession", request)
    return OwnerSession(keys)


class _DataPlaneRoute:
    """One session bound over ``workers`` (seq 0), with the owner's two connections."""

    def __init__(self, workers, session: OwnerSession, to_first, from_last) -> None:
        self.workers, self.session, self.to_first, self.from_last = workers, session, to_first, from_last
        self.totals: list = []  # each worker's UnbindSessionReply, once unbound

    async def step(self, n: int, positions: Sequence[int], tokens: Sequence[int]) -> int:
        step = worker_pb2.DataStep(step=n, positions=positions, token_ids=tokens, top_k=DEFAULT_RESULT_TOP_K)
        await self.to_first.send(self.session.step_frame(step))
        result = self.session.open_result(await self.from_last.receive())
        if result.error_code:
            raise RuntimeError(f"step {n}: {result.error_message}")
        return int(np.frombuffer(result.top_token_ids, dtype="<i4")[0])


@contextlib.asynccontextmanager
async def _open_data_plane_route(workers, next_step: int):
    """Sequence 0 of ``workers`` (already holding the prompt) bound on their data planes."""
    from agent.io.net.data_link import open_data_link

    session = await _bind(workers, seq_id=0, next_step=next_step)
    route = None
    try:
        async with (
            open_data_link(HOST, workers[0].info.data_port) as to_first,
            open_data_link(HOST, workers[-1].info.data_port) as from_last,
        ):
            await from_last.send(session.attach_frame())
            route = _DataPlaneRoute(workers, session, to_first, from_last)
            yield route
    finally:
        for worker in workers:
            totals = await worker.client.call(
                "UnbindSession", worker_pb2.UnbindSessionRequest(schema_version=1, session_id=session.session_id)
            )
            if route is not None:
                route.totals.append(totals)
            await worker.client.remove_sequence(0)


def worker_profile(totals: Sequence) -> list[dict]:
    """Per worker of a route, ms per decode step: its Forward, and the rest of its time (pure)."""
    return [
        {
            "compute_ms": t.compute_us / 1000 / t.steps,
            "in_worker_ms": t.in_worker_us / 1000 / t.steps,
            "own_ms": (t.in_worker_us - t.compute_us) / 1000 / t.steps,
        }
        for t in totals
    ]


async def _python_step(clients, positions: Sequence[int], tokens: Sequence[int], seq_id: int = 1) -> int:
    from agent.demo.local_demo import next_hop_entries

    hop = [SeqInput(seq_id=seq_id, positions=list(positions), token_ids=list(tokens), top_k=DEFAULT_RESULT_TOP_K)]
    out = []
    for i, client in enumerate(clients):
        out = await client.forward(hop)
        if i + 1 < len(clients):
            hop = next_hop_entries(hop, out)
    return int(out[0].top[0].ids[0])


async def paired_rep(whole, ranges, prompt: Sequence[int], n_gen: int) -> dict:
    """One generation by all four systems, step by step in turn: ms per decode step each, and
    each data plane worker's own account of its decode steps. The prompt goes in by Forward
    calls on every system (sequence 0 for the data planes, bound after it), so that the
    workers' accounts hold decode steps only."""
    whole_c, range_c = [whole.client], [w.client for w in ranges]
    positions = range(len(prompt))
    first = {
        await _python_step(clients, positions, prompt, seq_id) for clients in (whole_c, range_c) for seq_id in (0, 1)
    }
    if len(first) != 1:
        raise RuntimeError(f"the prompt's token differs between the systems: {first}")
    times: dict[str, list[float]] = {k: [] for k in SYSTEMS}
    async with _open_data_plane_route([whole], 1) as dp1, _open_data_plane_route(ranges, 1) as dp3:
        step_fns = {
            "worker_unsplit": lambda pos, tok: _python_step(whole_c, pos, tok),
            "data_plane_1": lambda pos, tok: dp1.step(n, pos, tok),
            "data_plane_3": lambda pos, tok: dp3.step(n, pos, tok),
            "chain_3": lambda pos, tok: _python_step(range_c, pos, tok),
        }
        tokens: list[int] = [first.pop()]
        position = len(prompt)
        for n in range(1, n_gen + 1):
            order = list(SYSTEMS)
            order = order[n % len(order) :] + order[: n % len(order)]  # no system always first
            got = {}
            for key in order:
                started = time.perf_counter()
                got[key] = await step_fns[key]([position], tokens[-1:])
                times[key].append(1000.0 * (time.perf_counter() - started))
            if len(set(got.values())) != 1:
                raise RuntimeError(f"step {n}: the systems disagree on the token: {got}")
            tokens.append(got["worker_unsplit"])
            position += 1
    for client in whole_c + range_c:
        await client.remove_sequence(1)
    return {
        "step_ms": times,
        "tokens": tokens,
        "workers": {"data_plane_1": worker_profile(dp1.totals), "data_plane_3": worker_profile(dp3.totals)},
    }


async def bench_paired(model: Path, sha256: str, prompt: list[int], cuts, n_gen: int, reps: int, threads: int):
    from agent.io.worker.process import open_worker

    async with contextlib.AsyncExitStack() as stack:

        async def start(b: int, e: int):
            return await stack.enter_async_context(
                open_worker(model, b, e, threads=threads, model_sha256=sha256, data_listen=f"{HOST}:0",
                            max_sequences=2)
            )  # fmt: skip

        whole = await start(0, None)
        ranges = [await start(b, e) for b, e in cuts]
        await paired_rep(whole, ranges, prompt, min(n_gen, 8))  # warm-up
        return [await paired_rep(whole, ranges, prompt, n_gen) for _ in range(reps)]


def summary(reps: list[dict], llama_step_ms: list[float], hops: int = 3) -> dict:
    """Per-hop overheads and ratios (pure, tested): paired per step, then the median of reps."""

    def per_rep(fn) -> list[float]:
        return [
            statistics.median(fn(r["step_ms"], i) for i in range(len(r["step_ms"]["worker_unsplit"]))) for r in reps
        ]

    step_ms = {k: statistics.median(statistics.median(r["step_ms"][k]) for r in reps) for k in SYSTEMS}
    # means, to set beside the workers' accounts (sums over the same steps)
    mean_step_ms = {k: statistics.median(statistics.fmean(r["step_ms"][k]) for r in reps) for k in SYSTEMS}
    hop = per_rep(lambda t, i: (t["data_plane_3"][i] - t["worker_unsplit"][i]) / hops)
    hop_python = per_rep(lambda t, i: (t["chain_3"][i] - t["worker_unsplit"][i]) / hops)
    own = per_rep(lambda t, i: t["data_plane_1"][i] - t["worker_unsplit"][i])
    hop_dp = per_rep(lambda t, i: (t["data_plane_3"][i] - t["data_plane_1"][i]) / hops)
    llama = statistics.median(llama_step_ms)
    per_hop = statistics.median(hop)
    workers = {
        key: [
            {part: statistics.median(r["workers"][key][i][part] for r in reps) for part in reps[0]["workers"][key][i]}
            for i in range(len(reps[0]["workers"][key]))
        ]
        for key in ("data_plane_1", "data_plane_3")
    }
    return {
        "workers": workers,
        "mean_step_ms": mean_step_ms,
        "step_ms": step_ms,
        "llama_bench_step_ms": llama,
        "per_hop_ms": per_hop,
        "per_hop_ms_by_rep": hop,
        "per_hop_python_chain_ms": statistics.median(hop_python),
        "per_hop_vs_data_plane_1_ms": statistics.median(hop_dp),
        "data_plane_own_ms": statistics.median(own),
        "split_vs_llama_bench": llama / step_ms["data_plane_3"],
        "unsplit_over_data_plane_vs_llama_bench": llama / step_ms["data_plane_1"],
        "hop_target_met": per_hop <= HOP_TARGET_MS,
        "split_target_met": llama / step_ms["data_plane_3"] >= SPLIT_TARGET,
    }


def profile_lines(s: dict, ranges: Sequence[Sequence[int]]) -> list[str]:
    """'Where the time goes' of a decode step over the data plane, from the workers' own
    accounts (``UnbindSessionReply.compute_us`` / ``in_worker_us``) and the owner's step time
    (pure: ``summary``'s output in, markdown lines out)."""
    one, three = s["workers"]["data_plane_1"], s["workers"]["data_plane_3"]
    step1, step3 = s["mean_step_ms"]["data_plane_1"], s["mean_step_ms"]["data_plane_3"]
    outside1 = step1 - sum(w["in_worker_ms"] for w in one)
    outside3 = step3 - sum(w["in_worker_ms"] for w in three)
    lines = [
        "| part of a decode step (ms: means over a generation's steps, median of generations) "
        "| whole model over the data plane | 3-split over the data plane |",
        "|---|---|---|",
        f"| the step, as the owner sees it | {step1:.3f} | {step3:.3f} |",
    ]
    for i, (b, e) in enumerate(ranges):
        w = three[i]
        whole = one[0] if i == 0 else None
        lines.append(
            f"| worker {i + 1} [{b}, {e}): its Forward | {whole['compute_ms']:.3f} (the whole model) | {w['compute_ms']:.3f} |"
            if whole
            else f"| worker {i + 1} [{b}, {e}): its Forward | | {w['compute_ms']:.3f} |"
        )
        lines.append(
            f"| worker {i + 1}: the rest of its time (frame in whole to output sealed: lock, open, check, seal) | "
            + (f"{whole['own_ms']:.3f} | " if whole else "| ")
            + f"{w['own_ms']:.3f} |"
        )
    lines.append(
        f"| outside the workers: the owner's Python, the sends and messages, waking the processes | {outside1:.3f} | "
        f"{outside3:.3f} |"
    )
    hops = len(ranges)
    d_compute = sum(w["compute_ms"] for w in three) - one[0]["compute_ms"]
    d_own = sum(w["own_ms"] for w in three) - one[0]["own_ms"]
    d_outside = outside3 - outside1
    lines += [
        "",
        "A worker's own time includes whatever ran on its core meanwhile (another process it woke, the host "
        "taking the virtual CPU): on this 2-core VM the rows are a process's view, not an exclusive one.",
        "",
        f"Per hop, 3-split over the whole model (both over the data plane; means): "
        f"{(step3 - step1) / hops:.3f} ms = cutting the model (more, smaller Forwards) {d_compute / hops:.3f} "
        f"+ the workers' own handling {d_own / hops:.3f} + outside the workers (two more messages a step, and the "
        f"wake-ups of the processes that take them) {d_outside / hops:.3f}.",
    ]
    return lines


def markdown(report: dict) -> str:
    s = report["summary"]
    m = report["machine"]
    lines = [
        "# Worker to worker: the data plane's hop (`bench/data_plane.py`)",
        "",
        f"Machine: {m['cpu_model']}, {m['cores']} cores, {m['platform']}. Model `{report['model']}`, "
        f"{report['threads']} thread(s) a process, prompt {report['prompt_tokens']} tokens, "
        f"{report['decode_steps']} greedy decode steps (top-{DEFAULT_RESULT_TOP_K} back to the owner); the four "
        f"systems open at once and stepped in turn at every step (order rotating); {report['reps']} generations "
        f"after a warm-up. 3-split ranges {report['ranges']}. Every system gave the same tokens at every step "
        f"(checked as it ran); every generation the same: {'yes' if report['same_tokens'] else 'NO'}.",
        "",
        "| system | decode step ms (median of steps, median of generations) |",
        "|---|---|",
    ]
    names = {
        "worker_unsplit": "Baton worker, whole model, Forward stream from Python (compare.py's reference)",
        "data_plane_1": "Baton worker, whole model, over its data plane",
        "data_plane_3": "Baton 3-split, worker to worker over the data plane",
        "chain_3": "Baton 3-split, one Forward at a time from Python (boundary through Python)",
    }
    for key, name in names.items():
        lines.append(f"| {name} | {s['step_ms'][key]:.2f} |")
    lines.append(
        f"| llama-bench, whole model (`-d 0,{report['prompt_tokens']}`, before and after; not paired) | "
        f"{s['llama_bench_step_ms']:.2f} |"
    )
    lines += [
        "",
        f"- **Per-hop overhead, worker to worker** (3-split over the data plane - unsplit, / 3): "
        f"**{s['per_hop_ms']:.3f} ms** (target {HOP_TARGET_MS} ms: "
        f"{'met' if s['hop_target_met'] else 'missed'}; by generation "
        f"{', '.join(f'{v:.3f}' for v in s['per_hop_ms_by_rep'])}); against the whole model over the data plane "
        f"{s['per_hop_vs_data_plane_1_ms']:.3f} ms; through Python one Forward at a time: "
        f"{s['per_hop_python_chain_ms']:.3f} ms (the boundary through Python, as the node agents passed it "
        "before the data plane).",
        f"- The data plane's own cost on the whole model (its step - the Forward stream's): "
        f"{s['data_plane_own_ms']:.3f} ms.",
        f"- 3-split over the data plane vs llama-bench unsplit: **{s['split_vs_llama_bench']:.2f}x** "
        f"(the swarm's target {SPLIT_TARGET}x: {'met' if s['split_target_met'] else 'missed'} here); "
        f"the whole model over the data plane: {s['unsplit_over_data_plane_vs_llama_bench']:.2f}x.",
        "",
        "## Where the time goes",
        "",
        *profile_lines(s, report["ranges"]),
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--reps", type=int, default=5, help="paired generations after a warm-up")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results")
    args = parser.parse_args()

    from agent.core.wire.ranges import ranges_from_cuts
    from agent.demo.local_demo import even_cuts
    from agent.io.worker.process import open_worker
    from agent.models import cached_sha256, model_path

    model = Path(args.model or model_path("smollm2")).resolve()
    sha256 = cached_sha256(model)
    bench_bin, _, _ = ensure_llama_tools()
    started = time.perf_counter()

    async def prompt_and_layers() -> tuple[list[int], int]:
        async with open_worker(model, 0, None, threads=1, model_sha256=sha256) as worker:
            _, tokens = await make_prompt(worker.client, args.prompt_tokens)
            return tokens, worker.info.n_layer

    prompt, n_layer = trio.run(prompt_and_layers)
    cuts = [(r.begin, r.end) for r in ranges_from_cuts(n_layer, even_cuts(n_layer, 3))]
    llama: list[float] = []
    log("llama-bench")
    tg = run_llama_bench(bench_bin, model, args.prompt_tokens, args.decode_steps, args.threads, 3)
    llama.extend(compare_report.step_ms(tg["decode_tps"])["samples"])
    log(f"{args.reps} paired generations of {args.decode_steps} steps")
    reps = trio.run(bench_paired, model, sha256, prompt, cuts, args.decode_steps, args.reps, args.threads)
    log("llama-bench")
    tg = run_llama_bench(bench_bin, model, args.prompt_tokens, args.decode_steps, args.threads, 3)
    llama.extend(compare_report.step_ms(tg["decode_tps"])["samples"])
    report = {
        "model": model.name,
        "machine": machine_info(),
        "threads": args.threads,
        "prompt_tokens": args.prompt_tokens,
        "decode_steps": args.decode_steps,
        "reps": args.reps,
        "ranges": cuts,
        "tokens": reps[0]["tokens"],
        "same_tokens": all(r["tokens"] == reps[0]["tokens"] for r in reps),
        "reps_step_ms": [r["step_ms"] for r in reps],
        "llama_bench_step_ms": llama,
        "summary": summary(reps, llama),
        "wall_s": time.perf_counter() - started,
    }
    publish(args.out, "data_plane", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
