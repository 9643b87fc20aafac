"""Continuous batching through a 3-way swarm, side by side with llama.cpp's own
``llama-batched-bench`` from the pinned tree, in one run, on loopback.

Owns one command that measures:

1. aggregate decode tokens/s at 1, 2, 4 and 8 concurrent sessions: Baton through a tracker and
   three nodes (a third of SmolLM2 each, 8 sequences per worker, one thread per worker), each
   session its own owner with a prompt of ``--prompt`` tokens and ``--tokens`` greedy tokens
   in two measures: over the window in which every session is decoding (from the last
   session's first token to the first session's last: no prompt is being prefilled then), the
   quantity llama-batched-bench's S_TG is, the targets' measure; and over the whole span (the
   tokens generated after each session's first token / the time from the first of those to
   the last, which also holds the later sessions' prefills: what earlier runs reported); next
   to ``llama-batched-bench -npp P -ntg G -npl 1,2,4,8`` unsplit on the same cores (its S_TG
   t/s: every sequence decoding in lock-step, after all prompts were processed).
   Three times, on a fresh swarm each: with the nodes' defaults (workers of
   ``--default-threads``, every core, as the worker's own default; decode groups and gather
   left to the node, which runs a route lock-step when its next hop shares this machine,
   ``agent.core.node.scheduler.decode_mode``: the first hop holds each decode Forward until every
   decoding session's step waits, so the sessions travel as one convoy and one hop computes at
   a time, with every core); with decode groups (``--decode-groups 4``, the route's hops + 1,
   what a node picks when its next hop is another machine, workers of ``--threads``: the first
   hop splits the sessions into 4 groups, so that on separate machines they are at different
   hops at once); and with groups off (``--decode-groups 0``, workers of ``--threads``: every
   waiting decode step in the next Forward, no hold), side by side; in every mode the workers'
   idle threads sleep after a short spin (the local swarm's ``--worker-wait sleep``: every node
   shares this machine);
2. the inter-token gap of a decoding session while another session's long prompt
   (``--long-prompt`` tokens, in the owner's chunks of ``--chunk`` rows) is prefilled: p50 and
   p99 of the gaps that fall in that prefill, next to the same session's gaps with nothing
   else running. A decode step waits behind one chunk at each hop (the workers' prefill
   pacing), so the gap grows with the chunk's compute time and stays even;
3. where a round of 8 sessions goes in the default mode, lock-step here
   (``lock_step_rounds``): each hop's worker's own time per round on its data plane (its
   ``HealthReply`` counts) and the rest of the round (the sends, the owners, the first hop's
   gather), beside the same Forwards by bare workers in series and llama-batched-bench, run
   between the passes.

Decode steps go worker to worker over the data plane (the prompts through the nodes); the
first worker applies the node's groups (``BindSessionRequest.decode_groups``) and lock-step's
hold (``BindSessionRequest.decode_gather_us``) itself.
While a session decodes, a prompt chunk at each hop runs right after the next decode Forward
(the worker's prefill pacing), so a decoding session waits behind one chunk a hop, every time.

Part 1 runs ``--rounds`` times (llama-batched-bench and every mode in turn each round: the
machine's speed drifts from minute to minute); each figure is its median round's, and every
round's figure at 8 sessions is listed. Parts 2 and 3 run once, in the last round.

Targets: 8 sessions >= 0.8x llama-batched-bench at 8, aggregate rising with every
doubling (both for the default mode), p99 gap <= 2x p50 during the prefill (default mode).
The output says which are met and by how much, and the default / off ratio at each count.

Writes ``batching.json`` and ``batching.md`` under ``--out`` (default bench/results) with the
machine described by ``common.machine_info``. Run it alone on the machine.

Usage: ``.venv/bin/python bench/batching.py [--prompt 64] [--tokens 48] [--rounds 3] [--out bench/results]``
(about 3 minutes a round on 2 cores once ``llama-batched-bench`` is built; building it takes a few more).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import compare_report
import trio
from _bootstrap import BENCH_DIR  # first: it makes the project importable
from common import PROMPT_SOURCE, TOOLS_DIR, chain_step, ensure_llama_tools, machine_info
from tools import hop_trace

from agent.core.node.scheduler import LOCK_STEP_GATHER_MS
from agent.io.cpu_policy import apply_cpu_policy, kernel_default
from agent.io.lifeline import die_with_parent

ALIAS = "smollm2"
PARALLEL = (1, 2, 4, 8)
NODES = 3
SEQUENCES = 8
TARGET_RATIO_AT_8 = 0.8
TARGET_GAP_RATIO = 2.0
#: the nodes' flags of each mode measured (agent.core.node.scheduler): the defaults (lock-step here,
#: where every hop shares this machine), decode groups as on separate machines (route hops + 1),
#: and off
MODES = {
    "default": (),
    "groups": ("--decode-groups", str(NODES + 1)),
    "off": ("--decode-groups", "0"),
}
#: the lock-step swarm's passes of rounds (``lock_step_rounds``): this many sessions, this many
#: greedy tokens each
TRACE_SESSIONS = 8
TRACE_TOKENS = 96
#: passes, each followed by the same Forwards through bare workers (``lock_step_rounds``)
TRACE_PASSES = 3


def log(message: str) -> None:
    print(f"[batching {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_batched_bench(
    model: Path, prompt: int, tokens: int, threads: int, parallel: tuple[int, ...] = PARALLEL
) -> dict[int, dict]:
    """llama-batched-bench's rows, by parallel count (``parallel``)."""
    ensure_llama_tools()
    binary = TOOLS_DIR / "bin" / "llama-batched-bench"
    n_ctx = max(parallel) * (prompt + tokens) + 64
    argv = [
        str(binary), "-m", str(model), "-c", str(n_ctx), "-b", "2048", "-ub", "512", "-npp", str(prompt),
        "-ntg", str(tokens), "-npl", ",".join(map(str, parallel)), "-t", str(threads), "--output-format", "jsonl",
    ]  # fmt: skip
    log(" ".join(argv))
    # waited: run in a trio worker thread that blocks until it exits (agent.io.lifeline)
    preexec = die_with_parent(kernel_default, waited=True)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=True, preexec_fn=preexec)
    rows = compare_report.batched_bench_rows(done.stdout + done.stderr)
    if set(rows) != set(parallel):
        raise SystemExit(
            f"llama-batched-bench gave rows for {sorted(rows)}, expected {parallel}:\n{done.stderr[-2000:]}"
        )
    return rows


async def _prompt_tokens(client, route, n: int) -> list[int]:
    tokens, _ = await client.tokenize(route, PROMPT_SOURCE * 20)
    return tokens[:n]


async def _concurrent(addr: str, prompt: list[int], tokens: int, n: int) -> dict:
    """``n`` sessions at once, each its own owner; aggregate decode tokens/s."""
    from agent.io.client import SwarmClientConfig, open_swarm_client

    firsts: list[float] = []
    lasts: list[float] = []
    decoded = [0]
    every: list[list[float]] = []

    async def one(i: int) -> None:
        times: list[float] = []

        async def on_token(_t: int, _l, _r) -> bool:
            times.append(time.perf_counter())
            return False

        async with open_swarm_client(addr, config=SwarmClientConfig(queue_timeout_s=120.0)) as c:
            # a different last token per session: not the same sequence eight times
            result = await c.generate_tokens(
                ALIAS, [*prompt[:-1], prompt[-1] + i], max_tokens=tokens, on_token=on_token
            )
        assert len(result.tokens) == len(times)
        firsts.append(times[0])
        lasts.append(times[-1])
        decoded[0] += len(times) - 1
        every.append(times)

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    span = max(lasts) - min(firsts)
    window = all_decoding(every)
    return {
        "sessions": n, "decode_tokens": decoded[0], "span_s": span, "span_tokens_per_s": decoded[0] / span,
        "all_decoding_tokens": window[0], "all_decoding_s": window[1], "tokens_per_s": window[0] / window[1],
    }  # fmt: skip


def all_decoding(token_times: list[list[float]]) -> tuple[int, float]:
    """Tokens generated, and seconds, in the window in which every session is decoding: from
    the last session's first token (every prompt processed) to the first session's last token
    (nobody done yet); the tokens counted are those that end a step inside it.

    Raises ValueError when the window is empty (a session finished before another's first
    token): then the sessions never all decoded at once, and no such figure exists."""
    start = max(times[0] for times in token_times)
    end = min(times[-1] for times in token_times)
    if end <= start:
        raise ValueError(f"the sessions never all decoded at once (window {end - start:.3f} s)")
    tokens = sum(1 for times in token_times for t in times if start < t <= end)
    return tokens, end - start


async def _forward_counts(addr: str, after_unix_ms: int) -> dict[str, tuple[int, int, int, int]]:
    """``{"[begin:end]": (Forwards, steps, compute µs, call µs)}`` of every READY range
    (``forward_counts``)."""
    from agent.demo.swarm_demo import forward_counts

    return {f"[{b}:{e}]": tuple(counts) for (b, e), counts in (await forward_counts(addr, after_unix_ms)).items()}


def _steps_per_forward(before: dict[str, tuple[int, ...]], after: dict[str, tuple[int, ...]]) -> dict[str, float]:
    out = {}
    for key, (calls, steps, *_times) in sorted(after.items()):
        calls0, steps0, *_ = before.get(key, (0, 0))
        if calls > calls0:
            out[key] = (steps - steps0) / (calls - calls0)
    return out


def _forward_time(before: dict[str, tuple[int, ...]], after: dict[str, tuple[int, ...]]) -> dict[str, dict]:
    """Per range, between two ``_forward_counts``: the worker's own time in its Forwards and
    the node's calls, ms in all, and the calls' own cost beyond the worker's time, ms a Forward."""
    out = {}
    for key, (calls, _steps, compute_us, call_us) in sorted(after.items()):
        calls0, _steps0, compute0, call0 = before.get(key, (0, 0, 0, 0))
        if calls > calls0:
            compute_ms, call_ms = (compute_us - compute0) / 1000, (call_us - call0) / 1000
            out[key] = {
                "forwards": calls - calls0, "compute_ms": compute_ms, "call_ms": call_ms,
                "call_beyond_compute_ms_per_forward": (call_ms - compute_ms) / (calls - calls0),
            }  # fmt: skip
    return out


async def _gaps_during_prefill(addr: str, prompt: list[int], long_prompt: list[int], tokens: int, chunk: int) -> dict:
    """A decoding session's inter-token gaps alone, then while another session prefills."""
    from agent.io.client import SwarmClientConfig, open_swarm_client

    async def decode(c, on_token) -> None:
        await c.generate_tokens(ALIAS, prompt, max_tokens=tokens, on_token=on_token)

    config = SwarmClientConfig(queue_timeout_s=120.0)
    chunked = SwarmClientConfig(queue_timeout_s=120.0, prefill_chunk_tokens=chunk)
    async with open_swarm_client(addr, config=config) as a, open_swarm_client(addr, config=chunked) as b:
        alone: list[float] = []

        async def keep_alone(_t, _l, _r) -> bool:
            alone.append(time.perf_counter())
            return False

        await decode(a, keep_alone)
        during: list[float] = []
        window: list[float] = []  # [prefill start, its first token]
        started = trio.Event()

        async def keep(_t, _l, _r) -> bool:
            during.append(time.perf_counter())
            if len(during) == 8:
                started.set()
            return False

        async def prefill() -> None:
            await started.wait()
            window.append(time.perf_counter())
            first: list[float] = []

            async def first_token(_t, _l, _r) -> bool:
                first.append(time.perf_counter())
                return True  # the prefill is what matters: stop at its first token

            await b.generate_tokens(ALIAS, long_prompt, max_tokens=1, on_token=first_token)
            window.append(first[0])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(prefill)
            await decode(a, keep)
    gaps_alone = [y - x for x, y in itertools.pairwise(alone)]
    lo, hi = window
    gaps_during = [y - x for x, y in itertools.pairwise(during) if y > lo and x < hi]
    return {
        "alone": _percentiles(gaps_alone),
        "during_prefill": _percentiles(gaps_during),
        "prefill_s": hi - lo,
        "long_prompt_tokens": len(long_prompt),
        "chunk_rows": chunk,
    }


def _role(cmdline: list[str]) -> str:
    """What a process of the benchmark is, for the CPU table."""
    text = " ".join(cmdline)
    if "baton-worker" in text and "--layers" in cmdline:
        return f"worker [{cmdline[cmdline.index('--layers') + 1]}]"
    if "agent.cli node" in text:
        return "node agents (Python)"
    if "agent.cli tracker" in text:
        return "tracker"
    return "other"


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) so far of this process (the owners: every session's client
    runs here) and of everything it started (tracker, nodes, their workers)."""
    import psutil

    me = psutil.Process()
    out: dict[int, tuple[str, float]] = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            role = "owners (this process, Python)" if proc.pid == me.pid else _role(proc.cmdline())
            out[proc.pid] = (role, times.user + times.system)
        except psutil.Error:
            continue  # gone meanwhile
    return out


def cpu_during(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds spent by role between two ``cpu_seconds`` readings (processes in both;
    also used by bench/tools/step_ab.py)."""
    spent: dict[str, float] = {}
    for pid, (role, seconds) in after.items():
        if pid in before:
            spent[role] = spent.get(role, 0.0) + seconds - before[pid][1]
    return dict(sorted(spent.items()))


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"n": len(values), "p50_s": statistics.median(ordered), "p99_s": p99, "max_s": ordered[-1]}


async def run_baton(args: argparse.Namespace, mode: str, *, gaps: bool = True, rounds: bool = False) -> dict:
    """Part 1 (and part 2 when ``gaps``) on a fresh swarm whose nodes run ``mode`` (``MODES``);
    its workers take ``--default-threads`` threads in the default mode, ``--threads`` otherwise.
    With ``rounds``: then passes of lock-step rounds, each followed by the same Forwards
    through bare workers in series (``lock_step_rounds``), under ``"rounds"``."""
    from agent.demo.swarm_demo import node_memory_bytes, wait_for_coverage
    from agent.harness.local_swarm import LocalSwarmConfig, open_local_swarm
    from agent.io.client import open_swarm_client
    from agent.models import model_path

    threads = args.default_threads if mode == "default" else args.threads
    config = LocalSwarmConfig(
        model_path=model_path(ALIAS), model_alias=ALIAS, threads=threads,
        node_args=("--max-sequences", str(SEQUENCES), *MODES[mode]),
    )  # fmt: skip
    async with contextlib.AsyncExitStack() as stack:
        swarm = await stack.enter_async_context(open_local_swarm(config))
        await swarm.start_tracker()
        async with open_swarm_client(swarm.tracker_addr) as c:
            (entry,) = [m for m in await c.list_models() if m.alias == ALIAS]
            for i in range(NODES):
                swarm.start_node(f"node-{i + 1}", node_memory_bytes(entry.n_layer, entry.bytes_per_block, NODES))
            route = await wait_for_coverage(c, swarm, ALIAS, timeout_s=300.0)
            prompt = await _prompt_tokens(c, route, args.prompt)
            long_prompt = await _prompt_tokens(c, route, args.long_prompt)
        addr = swarm.tracker_addr
        await _concurrent(addr, prompt, 8, 1)  # warm-up
        rows = {}
        counts = await _forward_counts(addr, int(time.time() * 1000))
        for n in PARALLEL:
            before, started = cpu_seconds(), time.perf_counter()
            rows[n] = await _concurrent(addr, prompt, args.tokens, n)
            rows[n]["cpu_s"] = cpu_during(before, cpu_seconds())  # where the time goes
            rows[n]["wall_s"] = time.perf_counter() - started
            counts, counted = await _forward_counts(addr, int(time.time() * 1000)), counts
            rows[n]["steps_per_forward"] = _steps_per_forward(counted, counts)  # prefill included
            rows[n]["forward_time"] = _forward_time(counted, counts)
            log(
                f"baton ({mode}) {n} sessions: {rows[n]['tokens_per_s']:.1f} decode tokens/s with every session "
                f"decoding ({rows[n]['all_decoding_s']:.1f} s), {rows[n]['span_tokens_per_s']:.1f} over the whole span"
            )
        result: dict = {"parallel": rows}
        if gaps:
            result["gaps"] = await _gaps_during_prefill(addr, prompt, long_prompt, args.gap_tokens, args.chunk)
            log(f"gaps: {result['gaps']}")
        if rounds:
            result["rounds"] = await lock_step_rounds(swarm, route, prompt, threads, args.llama_threads)
            log(f"lock-step rounds: {result['rounds']}")
    return result


def _route_worker_sockets(swarm, route) -> list[str]:
    """Each hop's worker's Unix socket, in route order (its node's ``baton-worker`` child)."""
    import psutil

    by_peer = {node.peer_id: node.process.pid for node in swarm.nodes.values()}
    sockets = []
    for hop in route.hops:
        (worker,) = [p for p in psutil.Process(by_peer[hop.peer_id]).children() if "baton-worker" in p.name()]
        argv = worker.cmdline()
        sockets.append(argv[argv.index("--socket") + 1])
    return sockets


async def _data_plane_counts(clients) -> list[tuple[int, int, int]]:
    """Each worker's data plane ``(Forwards, steps, compute_us)`` so far (``HealthReply``)."""
    out = []
    for client in clients:
        health = await client.health()
        out.append((health.data_plane_forwards, health.data_plane_steps, health.data_plane_compute_us))
    return out


async def lock_step_rounds(swarm, route, prompt: list[int], threads: int, llama_threads: int) -> dict:
    """Where a lock-step round of every session's decode step goes, on the data plane:
    ``TRACE_PASSES`` passes of ``TRACE_SESSIONS`` sessions of ``TRACE_TOKENS`` tokens through
    the swarm, each followed by the same Forwards by bare workers in series (``_bare_pass``,
    timed in this process by ``hop_trace``) while the swarm idles, and by llama-batched-bench
    decoding as many sequences as far (unsplit, ``llama_threads``), so that the machine's drift
    in speed falls on all three alike. The swarm's round is ``TRACE_SESSIONS`` / its decode t/s
    with every session decoding; each hop's own time per round is its data plane's compute
    per step (the workers' ``HealthReply`` counts before and after the pass: decode steps
    only, the prompts go through the nodes) times ``TRACE_SESSIONS``; ``steps_per_forward``
    shows how whole the convoy was. Medians over the passes (bare: over every call)."""
    from agent.core.node.worker_wait import SLEEP, worker_environment
    from agent.harness.parity_run import open_workers
    from agent.io.worker.client import AsyncWorkerClient
    from agent.models import model_path

    ranges = [(hop.begin, hop.end) for hop in route.hops]
    environment = worker_environment(SLEEP, other_workers=0, environment=os.environ)[0]
    bare_events: list = []
    llama_step_ms: list[float] = []
    round_ms: list[float] = []
    compute_ms: list[list[float]] = [[] for _ in ranges]
    steps_per_forward: list[list[float]] = [[] for _ in ranges]
    async with (
        open_workers(
            model_path(ALIAS), ranges, threads=threads, max_sequences=SEQUENCES, environment=environment
        ) as chain,
        contextlib.AsyncExitStack() as stack,
    ):  # fmt: skip
        hops = []
        for path in _route_worker_sockets(swarm, route):
            client = AsyncWorkerClient(path)
            stack.push_async_callback(client.aclose)
            hops.append(client)
        clients = [handle.client for handle in chain]
        for _ in range(TRACE_PASSES):
            before = await _data_plane_counts(hops)
            run = await _concurrent(swarm.tracker_addr, prompt, TRACE_TOKENS, TRACE_SESSIONS)
            after = await _data_plane_counts(hops)
            round_ms.append(1000 * TRACE_SESSIONS / run["tokens_per_s"])
            for k, ((f0, s0, c0), (f1, s1, c1)) in enumerate(zip(before, after, strict=True)):
                if f1 > f0:
                    compute_ms[k].append((c1 - c0) / 1000 / (s1 - s0) * TRACE_SESSIONS)
                    steps_per_forward[k].append((s1 - s0) / (f1 - f0))
            bare_events += await _bare_pass(clients, prompt)
            llama = await trio.to_thread.run_sync(  # a subprocess run: off the event loop
                functools.partial(
                    run_batched_bench, model_path(ALIAS), len(prompt), TRACE_TOKENS, llama_threads, (TRACE_SESSIONS,)
                )
            )
            llama_step_ms.append(1000 * TRACE_SESSIONS / llama[TRACE_SESSIONS]["speed_tg"])
    if not all(compute_ms):
        return {"rounds": 0, "error": "a hop's worker computed no decode step on its data plane"}
    return {
        "rounds": TRACE_PASSES,
        "entries": TRACE_SESSIONS,
        "passes": TRACE_PASSES,
        "ranges": ranges,
        "round_ms": statistics.median(round_ms),
        "compute_ms": [statistics.median(v) for v in compute_ms],
        "steps_per_forward": [statistics.median(v) for v in steps_per_forward],
        "bare_exchange_ms": hop_trace.exchange_times(bare_events, len(clients)),
        "bare_compute_ms": hop_trace.compute_times(bare_events, len(clients)),
        "llama_step_ms": statistics.median(llama_step_ms),
    }


async def _bare_pass(clients, prompt: list[int]) -> list:
    """One traced pass's Forwards through the bare workers ``clients`` in series: every
    session's prefill (not recorded), then its decode steps in lock-step (recorded, in this
    process: ``hop_trace``); the sequences are freed after. Returns the recorded events."""
    from agent.core.owner.generation import GreedyGeneration
    from agent.core.wire.topk import DEFAULT_RESULT_TOP_K

    gens = [GreedyGeneration(i, prompt, TRACE_TOKENS + 1, top_k=DEFAULT_RESULT_TOP_K) for i in range(TRACE_SESSIONS)]
    for g in gens:
        await chain_step(clients, [g])  # prefill: the first token
    hop_trace.install_worker_hooks()  # in this process; recording only from here
    hop_trace.start()
    try:
        while live := [g for g in gens if not g.finished]:
            await chain_step(clients, live)
    finally:
        events = hop_trace.stop()
    for client in clients:
        for g in gens:
            await client.remove_sequence(g.seq_id)
    return events


def median_round(rows: list[dict], key: str) -> dict:
    """One figure's rows of several rounds as one: the row whose ``key`` is the median (the
    lower middle of an even count), with every round's ``key`` under ``rounds_<key>`` in
    round order."""
    chosen = sorted(rows, key=lambda row: row[key])[(len(rows) - 1) // 2]
    return {**chosen, f"rounds_{key}": [row[key] for row in rows]}


def median_run(runs: list[dict]) -> dict:
    """Several rounds' ``run_baton`` results of one mode as one: per session count, the median
    round's row (``median_round`` on decode t/s); what only one round measured (the gaps,
    the traced rounds) as that round gave it."""
    merged = {key: value for run in runs for key, value in run.items() if key != "parallel"}
    merged["parallel"] = {
        n: median_round([run["parallel"][n] for run in runs], "tokens_per_s") for n in runs[0]["parallel"]
    }
    return merged


def summarize(baton: dict, llama: dict[int, dict], baton_off: dict, groups: dict | None = None) -> dict:
    """``baton``: the default mode (lock-step here), whose numbers the targets are checked on;
    ``baton_off``: decode groups off, next to it; ``groups``: decode groups as on separate
    machines (None: not run), whose ratio and doublings are given beside the default's."""
    rows = []
    for n in PARALLEL:
        ours = baton["parallel"][n]["tokens_per_s"]
        off = baton_off["parallel"][n]["tokens_per_s"]
        theirs = llama[n]["speed_tg"]
        span = baton["parallel"][n].get("span_tokens_per_s")
        rows.append({
            "sessions": n, "llama_batched_bench_tokens_per_s": theirs,
            "baton_tokens_per_s": ours, "ratio": ours / theirs,  # the default mode, every session decoding
            "groups_off_tokens_per_s": off, "groups_off_ratio": off / theirs, "default_over_off": ours / off,
            "span_tokens_per_s": span, "span_ratio": None if span is None else span / theirs,
        })  # fmt: skip
        if groups is not None:
            grouped = groups["parallel"][n]["tokens_per_s"]
            rows[-1].update(groups_tokens_per_s=grouped, groups_ratio=grouped / theirs)
    rising = all(b["baton_tokens_per_s"] > a["baton_tokens_per_s"] for a, b in itertools.pairwise(rows))
    spans = [r["span_tokens_per_s"] for r in rows]
    span_rising = None if None in spans else all(b > a for a, b in itertools.pairwise(spans))
    during = baton["gaps"]["during_prefill"]
    gap_ratio = during["p99_s"] / during["p50_s"] if during.get("n") else None
    grouped = [r["groups_tokens_per_s"] for r in rows] if groups is not None else None
    return {
        "rows": rows,
        "groups_ratio_at_8": None if grouped is None else rows[-1]["groups_ratio"],
        "groups_rising_with_every_doubling": None
        if grouped is None
        else all(b > a for a, b in itertools.pairwise(grouped)),
        "ratio_at_8": rows[-1]["ratio"],
        "ratio_at_8_target": TARGET_RATIO_AT_8,
        "groups_off_ratio_at_8": rows[-1]["groups_off_ratio"],
        "default_over_off_at_8": rows[-1]["default_over_off"],
        "rising_with_every_doubling": rising,
        "span_ratio_at_8": rows[-1]["span_ratio"],
        "span_rising_with_every_doubling": span_rising,
        "gap_p99_over_p50_during_prefill": gap_ratio,
        "gap_ratio_target": TARGET_GAP_RATIO,
    }


def render_markdown(report: dict) -> str:
    s, m, cfg = report["summary"], report["machine"], report["config"]
    gaps = report["baton"]["gaps"]
    lines = [
        "# Continuous batching through a 3-way swarm",
        "",
        f"Machine: {m.get('cpu_model')}, {m.get('cores')} cores, {m.get('ram_gib', 0):.1f} GiB, {m.get('platform')}; "
        f"load before: {m.get('loadavg_before')}; Baton {m.get('baton_commit', '?')}, llama.cpp {m.get('llama_cpp_commit', '?')[:12]}.",
        f"Baton: tracker + {NODES} nodes of SmolLM2 on loopback, {SEQUENCES} sequences per worker, each session its "
        f"own owner; prompt {cfg['prompt']} tokens, {cfg['tokens']} greedy tokens. "
        f"llama-batched-bench: unsplit, -npp {cfg['prompt']} -ntg {cfg['tokens']}, {cfg['llama_threads']} threads.",
        "Decode steps go worker to worker over the workers' data plane (prompts through the nodes). Three modes, each "
        "on a fresh swarm: the nodes' defaults (workers of "
        f"{cfg.get('default_threads', '?')} threads, the cores; each route's next hop shares this machine, so its "
        "first node runs it lock-step, `agent.core.node.scheduler.decode_mode`: the first worker holds each decode Forward "
        f"until every decoding session's step waits, at most {LOCK_STEP_GATHER_MS:g} ms, so the sessions travel as one "
        "convoy and one hop computes at a time), decode groups (`--decode-groups 4`, the route's hops + 1, what a node "
        "picks when its next hop is another machine: the first worker's decode Forward takes at most ceil(decoding "
        "sessions / 4) steps, the rest the Forward right after, so that on separate machines the groups are at "
        f"different hops at once; workers of {cfg['threads']} thread(s)) and off (`--decode-groups 0`: every queued "
        f"decode step in the next Forward; workers of {cfg['threads']} thread(s)). Every worker's idle threads sleep "
        "after a short spin (`--worker-wait sleep`, as in every local swarm). Ratios are to "
        f"llama-batched-bench. {cfg.get('rounds', 1)} round(s), each running llama-batched-bench and every mode in turn "
        "(the machine's speed drifts); each cell is its median round's.",
        "Decode t/s: the aggregate while every session decodes (from the last session's first token to the "
        "first session's last: no prompt is prefilled then), as llama-batched-bench's S_TG counts; the whole-span "
        "column is the same runs over the whole span, which also holds the later sessions' prefills.",
        "",
        "| sessions | llama-batched-bench S_TG t/s | Baton, default: decode t/s | ratio "
        "| Baton, groups off: decode t/s | ratio | default / off | default, whole span: t/s (ratio) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    grouped = s.get("groups_ratio_at_8") is not None
    if grouped:
        lines[-2] += " Baton, groups of 4: decode t/s | ratio |"
        lines[-1] += "---|---|"
    for row in s["rows"]:
        span = row.get("span_tokens_per_s")
        span_cell = "—" if span is None else f"{span:.1f} ({row['span_ratio']:.2f}x)"
        lines.append(
            f"| {row['sessions']} | {row['llama_batched_bench_tokens_per_s']:.1f} | {row['baton_tokens_per_s']:.1f} | "
            f"{row['ratio']:.2f}x | {row['groups_off_tokens_per_s']:.1f} | {row['groups_off_ratio']:.2f}x | "
            f"{row['default_over_off']:.2f}x | {span_cell} |"
            + (f" {row['groups_tokens_per_s']:.1f} | {row['groups_ratio']:.2f}x |" if grouped else "")
        )
    lines += _rounds_line(report)
    shortfall = s["ratio_at_8_target"] - s["ratio_at_8"]
    verdict = "met" if shortfall <= 0 else f"missed by {shortfall:.2f}x"
    lines += [
        "",
        f"- 8 sessions, default: {s['ratio_at_8']:.2f}x llama-batched-bench (target >= {s['ratio_at_8_target']}x): "
        f"{verdict}; groups off: {s['groups_off_ratio_at_8']:.2f}x; default / off: {s['default_over_off_at_8']:.2f}x.",
        f"- aggregate rising with every doubling (default): {'yes' if s['rising_with_every_doubling'] else 'no'}.",
    ]
    if grouped:
        short = s["ratio_at_8_target"] - s["groups_ratio_at_8"]
        lines.append(
            f"- decode groups (as on separate machines): {s['groups_ratio_at_8']:.2f}x at 8 sessions ("
            + ("above the target" if short <= 0 else f"{short:.2f}x under the target")
            + f"), rising with every doubling: {'yes' if s['groups_rising_with_every_doubling'] else 'no'}."
        )
    if s.get("span_ratio_at_8") is not None:
        lines.append(
            f"- over the whole span instead: {s['span_ratio_at_8']:.2f}x at 8 sessions, rising with every doubling: "
            f"{'yes' if s['span_rising_with_every_doubling'] else 'no'}."
        )
    d, a = gaps["during_prefill"], gaps["alone"]
    if d.get("n"):
        ratio = s["gap_p99_over_p50_during_prefill"]
        lines.append(
            f"- inter-token gap of a decoding session while a {gaps['long_prompt_tokens']}-token prompt is prefilled "
            f"in chunks of {gaps.get('chunk_rows')} "
            f"({gaps['prefill_s']:.2f} s, {d['n']} gaps): p50 {d['p50_s'] * 1000:.1f} ms, p99 {d['p99_s'] * 1000:.1f} ms "
            f"= {ratio:.2f}x p50 (target <= {s['gap_ratio_target']}x: {'met' if ratio <= s['gap_ratio_target'] else 'missed'}); "
            f"alone: p50 {a['p50_s'] * 1000:.1f} ms, p99 {a['p99_s'] * 1000:.1f} ms."
        )
    lines += _cpu_table(report)
    lines += _forward_time_table(report)
    lines += _steps_table(report)
    lines += _rounds_table(report)
    lines += ["", f"Wall time: {report['wall_time_s']:.0f} s.", ""]
    return "\n".join(lines)


def _rounds_line(report: dict) -> list[str]:
    """Every round's t/s at 8 sessions, when there were several (``median_round``)."""
    series = [("llama-batched-bench", report.get("llama_batched_bench", {}).get("8", {}).get("rounds_speed_tg"))]
    series += [
        (label, report[key]["parallel"].get("8", {}).get("rounds_tokens_per_s"))
        for label, key in _REPORT_MODES
        if key in report
    ]  # fmt: skip
    if not all(values and len(values) > 1 for _label, values in series):
        return []  # one round (or a report of an older run)
    shown = "; ".join(f"{label} " + ", ".join(f"{v:.1f}" for v in values) for label, values in series)
    return ["", f"- each round at 8 sessions, t/s in round order: {shown}."]


def _rounds_table(report: dict) -> list[str]:
    """Where a lock-step round goes: each hop's own time per round and the rest, in the swarm
    (data plane) beside bare workers in series and llama-batched-bench (``lock_step_rounds``)."""
    rounds = (report.get("baton") or {}).get("rounds") or {}
    if not rounds.get("rounds"):
        return [] if not rounds else ["", f"Lock-step rounds: not measured ({rounds.get('error', 'no round found')})."]
    ranges = [f"[{b}:{e}]" for b, e in rounds["ranges"]]
    n = rounds["entries"]
    computed, bare_computed, bare = rounds["compute_ms"], rounds["bare_compute_ms"], rounds["bare_exchange_ms"]

    def cell(value: float | None) -> str:
        return "—" if value is None else f"{value:.2f}"

    ours, theirs, bare_round = sum(computed), sum(bare_computed), sum(bare)
    lines = [
        "",
        f"Where a lock-step round goes ({n} sessions of {TRACE_TOKENS} tokens, {rounds['passes']} passes; ms, medians): "
        f"the swarm's round is {n} / its decode t/s with every session decoding, each hop's own time its data "
        f"plane's compute per decode step (the workers' `HealthReply` counts) times {n}; beside it, the same Forwards "
        "by bare workers in series (the same ranges, threads and wait policy, one Forward at a time from this "
        "process's Python), run after each pass while the swarm idles, then llama-batched-bench (unsplit) as many "
        "sequences as far, so that the machine's drift in speed falls on all alike.",
        "",
        "| part of the round | swarm (data plane) | bare workers in series |",
        "|---|---|---|",
    ]
    for k, name in enumerate(ranges):
        steps = rounds["steps_per_forward"][k]
        lines.append(
            f"| worker {name}: its Forwards' own time (swarm: {steps:.2f} steps a Forward) | {cell(computed[k])} | "
            f"{cell(bare_computed[k])} |"
        )
    lines += [
        f"| the rest: swarm, the sends from worker to worker and back to the owners, sampling, the next steps, the "
        f"first hop's gather; bare, the Python calls | {cell(rounds['round_ms'] - ours)} | {cell(bare_round - theirs)} |",
        f"| the round | {cell(rounds['round_ms'])} | {cell(bare_round)} |",
        f"| llama-batched-bench unsplit: a step of {n} sequences as far (interleaved) | — | {cell(rounds['llama_step_ms'])} |",
        "",
        f"- The swarm's round is {rounds['llama_step_ms'] / rounds['round_ms']:.2f}x llama-batched-bench's speed, the "
        f"bare workers' {rounds['llama_step_ms'] / bare_round:.2f}x; the workers' own time is {ours:.1f} ms a round in "
        f"the swarm against {theirs:.1f} bare ({ours / theirs:.2f}x) and {rounds['llama_step_ms']:.1f} for "
        f"llama-batched-bench's whole step.",
    ]
    return lines


#: (label, report key) of each mode measured, in the tables' order
_REPORT_MODES = (
    ("default", "baton"),
    ("groups off", "baton_decode_groups_off"),
    ("groups of 4", "baton_decode_groups"),
)


def _steps_table(report: dict) -> list[str]:
    """Steps per worker Forward at each hop (from the nodes' heartbeats), by sessions."""
    modes = [(label, report[key]) for label, key in _REPORT_MODES if key in report]
    keys = sorted(
        {k for _m, r in modes for run in r.get("parallel", {}).values() for k in run.get("steps_per_forward", {})}
    )
    if not keys:
        return []  # (a report of an older run)
    lines = [
        "",
        "Steps per worker Forward at each hop (the nodes' own counts; prefill chunks included):",
        "",
        "| sessions | " + " | ".join(f"{m}: {k}" for m, _r in modes for k in keys) + " |",
        "|---|" + "---|" * (len(keys) * len(modes)),
    ]
    for n in PARALLEL:
        cells = []
        for _m, r in modes:
            got = r.get("parallel", {}).get(str(n), r.get("parallel", {}).get(n, {})).get("steps_per_forward", {})
            cells += [f"{got[k]:.2f}" if k in got else "—" for k in keys]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return lines


def _cpu_table(report: dict) -> list[str]:
    """Where the CPU of the 8-session runs went, per token generated (prompt included), next
    to llama-batched-bench's over its whole 8-sequence run, prompt included as well (its
    threads busy for all of it: an upper bound)."""
    modes = [(label, report[key]["parallel"].get("8")) for label, key in _REPORT_MODES if key in report]
    labels, runs = [label for label, _r in modes], [run for _l, run in modes]
    if len(runs) < 2 or not all(run is not None and "cpu_s" in run for run in runs):
        return []  # (a report of an older run)
    llama = report["llama_batched_bench"]["8"]
    llama_ms = report["config"]["llama_threads"] * 1000 * (llama["t_pp"] + llama["t_tg"]) / (llama["pl"] * llama["tg"])
    lines = [
        "",
        "Where the CPU goes at 8 sessions (CPU ms per generated token, whole run incl. prefill; "
        f"llama-batched-bench: {llama_ms:.1f} ms with its {report['config']['llama_threads']} threads busy for its"
        " prefill and decode):",
        "",
        "| process | " + " | ".join(labels) + " |",
        "|---|" + "---|" * len(labels),
    ]
    roles = sorted(set().union(*(run["cpu_s"] for run in runs)))
    tokens = [run["decode_tokens"] + run["sessions"] for run in runs]
    for role in roles:
        cells = [f"{run['cpu_s'].get(role, 0.0) * 1000 / n:.1f}" for run, n in zip(runs, tokens)]
        lines.append(f"| {role} | " + " | ".join(cells) + " |")
    totals = [sum(run["cpu_s"].values()) for run in runs]
    lines.append("| all | " + " | ".join(f"{t * 1000 / n:.1f}" for t, n in zip(totals, tokens)) + " |")
    cores = [t / run["wall_s"] for t, run in zip(totals, runs)]
    lines.append("| cores busy on average | " + " | ".join(f"{c:.2f}" for c in cores) + " |")
    return lines


def _forward_time_table(report: dict) -> list[str]:
    """The 8-session runs' worker Forwards at each hop, from the nodes' heartbeats: the
    workers' own time (``ForwardReply.compute_us``) per generated token, and what a call cost
    the node beyond it (the socket, waking both sides, encoding, a node busy when the reply
    came), per Forward."""
    modes = [(label, report[key]["parallel"].get("8")) for label, key in _REPORT_MODES if key in report]
    modes = [(label, run) for label, run in modes if run is not None and run.get("forward_time")]
    if not modes:
        return []  # (a report of an older run)
    keys = sorted({k for _l, run in modes for k in run["forward_time"]})
    lines = [
        "",
        "The workers' Forwards at 8 sessions, as the nodes timed them (whole run incl. prefill): the worker's own "
        "time (`ForwardReply.compute_us`, wall clock) in ms per generated token, and a call's cost beyond it "
        "(the socket, waking both sides, encoding, the node busy when the reply came) in ms per Forward:",
        "",
        "| hop | "
        + " | ".join(f"{label}: worker ms / token | {label}: call beyond it, ms / Forward" for label, _r in modes)
        + " |",
        "|---|" + "---|---|" * len(modes),
    ]
    for key in keys:
        cells = []
        for _label, run in modes:
            got = run["forward_time"].get(key)
            tokens = run["decode_tokens"] + run["sessions"]
            cells += ["—", "—"] if got is None else [
                f"{got['compute_ms'] / tokens:.2f}", f"{got['call_beyond_compute_ms_per_forward']:.2f}"
            ]  # fmt: skip
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per session (default 64)")
    parser.add_argument("--tokens", type=int, default=48, help="greedy tokens per session (default 48)")
    parser.add_argument("--long-prompt", type=int, default=1500, help="the prompt prefilled in part 2 (default 1500)")
    parser.add_argument("--gap-tokens", type=int, default=160, help="tokens of the decoding session of part 2")
    parser.add_argument("--chunk", type=int, default=128, help="the long prompt's chunk rows (default 128)")
    parser.add_argument("--threads", type=int, default=1, help="threads per Baton worker (default 1)")
    parser.add_argument(
        "--llama-threads", type=int, default=2, help="llama-batched-bench threads (default 2: the cores)"
    )
    parser.add_argument(
        "--default-threads", type=int, default=os.cpu_count() or 1,
        help="threads per worker in the default mode (default: the cores, as the worker's own default)",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=int, default=3,
        help="rounds, each running llama-batched-bench and every mode in turn; each figure is its median round's"
        " (default 3: the machine's speed drifts from minute to minute)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results", help="where batching.{json,md} go")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    from agent.models import model_path

    apply_cpu_policy()  # this process holds the sessions' owners, as `baton generate` would (agent.cli)
    machine = machine_info()
    started = time.perf_counter()
    llamas, defaults, offs, groups = [], [], [], []
    for r in range(args.rounds):
        last = r == args.rounds - 1  # the gaps and the trace: once, in the last round
        log(f"round {r + 1} of {args.rounds}")
        llamas.append(run_batched_bench(model_path(ALIAS), args.prompt, args.tokens, args.llama_threads))
        defaults.append(trio.run(functools.partial(run_baton, args, "default", gaps=last, rounds=last)))
        offs.append(trio.run(functools.partial(run_baton, args, "off", gaps=False)))
        groups.append(trio.run(functools.partial(run_baton, args, "groups", gaps=False)))
    llama = {n: median_round([rounds[n] for rounds in llamas], "speed_tg") for n in PARALLEL}
    baton, baton_off, baton_groups = median_run(defaults), median_run(offs), median_run(groups)
    report = {
        "benchmark": "batching",
        "machine": machine,
        "config": {
            "prompt": args.prompt,
            "tokens": args.tokens,
            "long_prompt": args.long_prompt,
            "gap_tokens": args.gap_tokens,
            "threads": args.threads,
            "llama_threads": args.llama_threads,
            "nodes": NODES,
            "sequences": SEQUENCES,
            "chunk": args.chunk,
            "default_threads": args.default_threads,
            "rounds": args.rounds,
        },
        "llama_batched_bench": {str(k): v for k, v in llama.items()},
        "baton": {
            "node_args": list(MODES["default"]),
            "threads": args.default_threads,
            "parallel": {str(k): v for k, v in baton["parallel"].items()},
            "gaps": baton["gaps"],
            "rounds": baton.get("rounds"),
        },
        "baton_decode_groups_off": {
            "node_args": list(MODES["off"]),
            "threads": args.threads,
            "parallel": {str(k): v for k, v in baton_off["parallel"].items()},
        },
        "baton_decode_groups": {
            "node_args": list(MODES["groups"]),
            "threads": args.threads,
            "parallel": {str(k): v for k, v in baton_groups["parallel"].items()},
        },
        "summary": summarize(baton, llama, baton_off, baton_groups),
    }
    report["wall_time_s"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    md = render_markdown(report)
    (args.out / "batching.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "batching.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
