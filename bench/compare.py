"""Baton against llama.cpp, side by side, in one run on one machine.

Owns: one command that measures, on the same model, prompt and thread count,
1. one unsplit llama.cpp process from the same pin: (a) Baton's worker over ``[0, n_layer)``
   driven directly over its Unix socket (``agent.demo.local_demo.generate_through``), (b)
   llama.cpp's own ``llama-bench`` (``-p P -n G -t T -r R -o json``);
2. Baton split 2 and 3 ways through the whole path: a tracker and N node processes
   (``agent.harness.local_swarm``; node memory from ``swarm_demo.node_memory_bytes`` so the
   tracker must split N ways), generation through ``agent.io.client`` at temperature 0;
3. llama.cpp's RPC backend from the same pin: N ``ggml-rpc-server`` processes on loopback and
   ``llama-bench -rpc ... -ngl 99 -ts 1/1[/1]`` (layers split evenly over the N servers);
4. the boundary transport alone (``bench/tools/transport_rtt.run_benchmark``: 8 KiB and 1 MiB
   round trips, libp2p against plain TCP);
plus, to locate the per-hop cost, 3 range workers chained directly from Python (no tracker,
no libp2p) and where a decode step's time goes (``bench/data_plane.py``'s paired run).

Every figure: median, min and max over ``--runs`` runs, spread over ``--rounds`` rounds (each
system measured once per round, in turn, one warm-up each time; llama-bench's own warm-up and
``-r``), pooled: the machine's speed drifts over minutes, and rounds put every system in every
stretch of it. Writes ``compare.json``, ``compare.md`` and ``compare.png`` (matplotlib, the
``bench`` extra) under ``--out``. Builds ``llama-bench`` and ``ggml-rpc-server`` from the pinned tree into
``build/llama-tools`` first when they are missing or older than the tree.

Usage: ``.venv/bin/python bench/compare.py [--model PATH] [--runs 6] [--rounds 3] [--threads 1] [--out bench/results]``
(about 6-8 minutes on 2 cores once the tools are built; building them takes 3-4 more).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import compare_report
import data_plane
import numpy as np
import trio
from _bootstrap import BENCH_DIR  # first: it makes the project importable
from common import (
    TOOLS_CMAKE_FLAGS,
    ensure_llama_tools,
    log,
    machine_info,
    make_prompt,
    open_covered_swarm,
    run_llama_bench,
    stop_processes,
)
from tools import hop_trace, transport_rtt

from agent.io.cpu_policy import apply_cpu_policy, kernel_default
from agent.io.lifeline import die_with_parent

SERVER_READY_TIMEOUT_S = 30.0
PROFILE_REPS = 3  # bench/data_plane.py's paired generations for "Where the time goes"
PAIRED_RUNS = 3  # per round and split: the swarm's generations paired step by step with the unsplit worker
INTERLEAVED_TURNS = 10  # bench_interleaved: turns of one run each of the 3-split, the worker, llama-bench and RPC
COLORS = {"baton": "#3465a4", "llama.cpp": "#e68c28"}
CHART_LABELS = {
    "worker_unsplit": "Baton worker unsplit",
    "worker_run_ahead": "Baton worker run-ahead",
    "llama_bench": "llama-bench unsplit",
    "baton_2": "Baton 2-split",
    "baton_3": "Baton 3-split",
    "rpc_2": "RPC 2-split",
    "rpc_3": "RPC 3-split",
}


# --- the machine, shared -----------------------------------------------------------------------


class CpuWatch:
    """CPU time used by processes that are not this benchmark's while ``with
    watch.phase(name):`` runs: the machine is shared, so each figure says how busy the rest of
    it was. This benchmark's processes carry ``MARKER_ENV`` in their environment (every child,
    grandchild, node and worker inherits it), so workers orphaned at shutdown are still known
    as ours. A thread reads ``/proc`` every ``interval_s`` (a process of others that lives less
    than that is missed). ``phases[name] = {"wall_s", "others_cores"}``: others' CPU seconds
    per wall second.

    Resource handling: ``close()`` stops the thread."""

    MARKER_ENV = "BATON_BENCH_COMPARE_RUN"

    def __init__(self, interval_s: float = 0.5) -> None:
        self.phases: dict[str, dict] = {}
        token = f"{os.getpid()}-{time.time_ns()}"
        os.environ[self.MARKER_ENV] = token
        self.marker = f"{self.MARKER_ENV}={token}".encode()
        self.hz = os.sysconf("SC_CLK_TCK")
        self.interval_s = interval_s
        self._seen: dict[int, float] = {}
        self._mine: set[int] = set()
        self._others_s = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._scan(baseline=True)
        self._thread = threading.Thread(target=self._run, name="cpu-watch", daemon=True)
        self._thread.start()

    def _scan(self, baseline: bool = False) -> None:
        with self._lock:
            for entry in os.scandir("/proc"):
                if not entry.name.isdigit():
                    continue
                pid = int(entry.name)
                if pid in self._mine:
                    continue
                try:
                    with open(f"/proc/{pid}/stat", "rb") as f:
                        fields = f.read().rsplit(b")", 1)[1].split()
                    # ours: this process, a child of ours (also between fork and exec, before
                    # its environment shows the marker), or marked
                    if pid == os.getpid() or int(fields[1]) in self._mine:
                        self._mine.add(pid)
                        continue
                    with open(f"/proc/{pid}/environ", "rb") as f:
                        if self.marker in f.read():
                            self._mine.add(pid)
                            continue
                except OSError:
                    continue
                cpu = (int(fields[11]) + int(fields[12])) / self.hz  # utime + stime
                if not baseline:
                    # a process first seen now started after the watch did: all its CPU is new
                    self._others_s += max(0.0, cpu - self._seen.get(pid, 0.0))
                self._seen[pid] = cpu

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._scan()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def wait_quiet(self, max_wait_s: float, threshold_cores: float = 0.15, window_s: float = 1.0) -> float:
        """Wait (at most ``max_wait_s``) until others used less than ``threshold_cores`` over
        the last ``window_s``; returns the seconds waited."""
        started = time.monotonic()
        while True:
            self._scan()
            before, t0 = self._others_s, time.monotonic()
            time.sleep(window_s)
            self._scan()
            if (self._others_s - before) / (time.monotonic() - t0) < threshold_cores:
                return time.monotonic() - started - window_s
            if time.monotonic() - started >= max_wait_s:
                return time.monotonic() - started

    @contextlib.contextmanager
    def phase(self, name: str, wait_quiet_s: float = 0.0):
        waited = self.wait_quiet(wait_quiet_s) if wait_quiet_s > 0 else 0.0
        self._scan()
        before, t0 = self._others_s, time.monotonic()
        try:
            yield
        finally:
            self._scan()
            wall = max(time.monotonic() - t0, 1e-9)
            self.phases[name] = {
                "wall_s": wall,
                "others_cores": (self._others_s - before) / wall,
                "waited_for_quiet_s": max(0.0, waited),
            }


# --- llama.cpp tools -------------------------------------------------------------------------


# --- Baton: one worker, chained workers --------------------------------------------------------


def _chain_figure(runs, extra: dict) -> dict:
    return {
        "prefill_tps": compare_report.summarize([r.prefill_tokens_per_s for r in runs]),
        "decode_tps": compare_report.summarize([r.decode_tokens_per_s for r in runs]),
        "decode_steps": runs[0].decode_steps,
        "tokens": list(runs[0].tokens),
        **extra,
    }


async def bench_worker(
    model: Path, sha256: str, n_prompt: int, n_gen: int, runs: int, threads: int
) -> tuple[dict, dict, str, list[int], dict]:
    """Baton's worker unsplit, driven directly, one Forward a step and with the worker's greedy
    run-ahead (runs alternating): ``(figure, run-ahead figure, prompt text, prompt tokens,
    model info)``."""
    from agent.core.wire.topk import DEFAULT_RESULT_TOP_K
    from agent.demo.local_demo import generate_through
    from agent.io.worker.process import open_worker

    async with open_worker(model, 0, None, threads=threads, model_sha256=sha256) as worker:
        text, tokens = await make_prompt(worker.client, n_prompt)
        results: dict[bool, list] = {False: [], True: []}
        for i in range(runs + 1):
            for run_ahead in (False, True):
                run = await generate_through(
                    [worker.client], tokens, n_gen + 1, top_k=DEFAULT_RESULT_TOP_K, run_ahead=run_ahead
                )
                if i:  # the first run is the warm-up
                    results[run_ahead].append(run)
        info = worker.info
    extra = {"n_threads": info.n_threads, "layers": [0, info.n_layer]}
    figure = _chain_figure(results[False], extra)
    ahead = _chain_figure(results[True], extra)
    if ahead["tokens"] != figure["tokens"]:
        raise RuntimeError("the worker's run-ahead chose other tokens than one Forward a step")
    return (
        figure,
        ahead,
        text,
        tokens,
        {"n_layer": info.n_layer, "n_embd": info.n_embd, "n_vocab": info.n_vocab, "architecture": info.architecture},
    )


async def bench_chain(
    model: Path, sha256: str, tokens: list[int], n_ranges: int, n_layer: int, n_gen: int, runs: int, threads: int
) -> dict:
    """``n_ranges`` range workers chained directly from this process (no tracker, no libp2p)."""
    from agent.core.wire.ranges import ranges_from_cuts
    from agent.core.wire.topk import DEFAULT_RESULT_TOP_K
    from agent.demo.local_demo import even_cuts, generate_through
    from agent.harness.parity_run import open_workers

    ranges = ranges_from_cuts(n_layer, even_cuts(n_layer, n_ranges))
    async with open_workers(model, [(r.begin, r.end) for r in ranges], threads=threads, model_sha256=sha256) as chain:
        clients = [h.client for h in chain]
        results = []
        for i in range(runs + 1):
            run = await generate_through(clients, tokens, n_gen + 1, top_k=DEFAULT_RESULT_TOP_K)
            if i:
                results.append(run)
        hop_trace.install_worker_hooks()  # in this process; recording only for the next run
        hop_trace.start()
        await generate_through(clients, tokens, n_gen + 1, top_k=DEFAULT_RESULT_TOP_K)
        forward_ms = hop_trace.forward_times(hop_trace.stop(), len(clients))
    return _chain_figure(results, {"ranges": [[r.begin, r.end] for r in ranges], "forward_ms_per_range": forward_ms})


async def bench_one_block(model: Path, sha256: str, n_gen: int, runs: int, threads: int) -> dict:
    """The fixed cost of one Forward: a worker holding block 0 only, decode Forwards driven
    directly (median ms over ``runs`` x ``n_gen`` calls after a warm-up pass)."""
    from agent.core.wire.worker_records import SeqInput
    from agent.io.worker.process import open_worker

    times = []
    async with open_worker(model, 0, 1, threads=threads, model_sha256=sha256) as worker:
        for run in range(runs + 1):
            await worker.client.forward([SeqInput(seq_id=0, positions=list(range(8)), token_ids=list(range(100, 108)))])
            for i in range(n_gen):
                started = time.perf_counter()
                await worker.client.forward([SeqInput(seq_id=0, positions=[8 + i], token_ids=[200 + i])])
                if run:
                    times.append((time.perf_counter() - started) * 1e3)
            await worker.client.remove_sequence(0)
    return {"forward_ms": compare_report.summarize(times), "layers": [0, 1]}


def ed25519_verify_us() -> float:
    """Median µs of one ``agent.core.net.identity.verify`` (what checking an admission costs)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from agent.core.net.identity import sign, verify
    from agent.core.wire.admission import public_key_bytes

    key = Ed25519PrivateKey.generate()
    public, message = public_key_bytes(key), os.urandom(200)
    signature = sign(key, message)
    samples = []
    for _ in range(7):
        started = time.perf_counter()
        for _ in range(200):
            verify(public, message, signature)
        samples.append((time.perf_counter() - started) / 200 * 1e6)
    return sorted(samples)[3]


# --- Baton: the swarm ------------------------------------------------------------------------


@contextlib.contextmanager
def scoped_environ(**values: str | None):
    """Set (a value) or remove (None) these variables of ``os.environ`` for the block: the
    processes started in it inherit them; the old values come back after."""
    saved = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


async def _paired_swarm_runs(
    client, alias: str, route, model: Path, sha256: str, prompt_tokens: list[int], n_gen: int, runs: int, threads: int
) -> list[dict]:
    """The swarm's decode steps paired step by step with the unsplit worker's, so that the
    per-hop overhead is not the drift between runs minutes apart (this VM's speed moves by more
    than a hop costs): after each token of the swarm's generation (``on_token``), this process
    runs the same step (position, token) on a whole-model worker over its Forward stream, as
    ``bench_worker`` does, timed alone; the swarm's step is timed from that call's end to the
    next token (the owner's send, the hops, the result, the owner's checks and sampling).
    Both must choose the same tokens. One dict a run (after a warm-up): per-step ms of each
    and the run's per-hop overhead, the median over its steps of (swarm - unsplit) / hops.

    Greedy continuation is off for these runs: with it the last hop sends the next step on
    while this process runs the unsplit step, so a swarm step would not wait for the owner and
    the pairing would measure nothing. The hops' own cost is the same either way; continuation
    takes the owner's turn out of the step, which the unpaired runs show."""
    from agent.io.worker.process import open_worker

    hops = len(route.hops)
    out = []
    config = client.config
    client.config = dataclasses.replace(config, greedy_continuation=False)
    async with open_worker(model, 0, None, threads=threads, model_sha256=sha256) as whole:
        for run in range(runs + 1):
            swarm_ms: list[float] = []
            unsplit_ms: list[float] = []
            state = {"n": 0, "last": 0, "ended": 0.0}

            async def on_token(
                token: int,
                _logits,
                _route,
                state: dict = state,
                swarm_ms: list[float] = swarm_ms,
                unsplit_ms: list[float] = unsplit_ms,
            ) -> bool:
                arrived = time.perf_counter()
                n = state["n"]
                if n == 0:  # the prompt's token: the unsplit worker takes the prompt (not timed)
                    got = await data_plane._python_step([whole.client], range(len(prompt_tokens)), prompt_tokens)
                else:
                    swarm_ms.append(1000.0 * (arrived - state["ended"]))
                    started = time.perf_counter()
                    got = await data_plane._python_step([whole.client], [len(prompt_tokens) + n - 1], [state["last"]])
                    unsplit_ms.append(1000.0 * (time.perf_counter() - started))
                if got != token:
                    raise RuntimeError(f"step {n}: the swarm chose {token}, the unsplit worker {got}")
                state.update(n=n + 1, last=token, ended=time.perf_counter())
                return False

            await client.generate_tokens(alias, prompt_tokens, max_tokens=n_gen + 1, on_token=on_token, route=route)
            await whole.client.remove_sequence(1)
            if run:  # the first run is the warm-up
                per_step = [(s - u) / hops for s, u in zip(swarm_ms, unsplit_ms, strict=True)]
                out.append({
                    "per_hop_ms": float(np.median(per_step)), "swarm_step_ms": float(np.median(swarm_ms)),
                    "unsplit_step_ms": float(np.median(unsplit_ms)),
                })  # fmt: skip
    client.config = config
    return out


async def bench_swarm(
    model: Path,
    alias: str,
    n_nodes: int,
    prompt: str,
    n_gen: int,
    runs: int,
    threads: int,
    sha256: str = "",
    prompt_tokens: list[int] | None = None,
    paired_runs: int = 0,
    continuation_off: bool = False,
) -> dict:
    """Tracker + ``n_nodes`` nodes on loopback, generation through ``agent.io.client`` (the
    prompt through the node agents, the decode steps worker to worker over the data plane);
    ``continuation_off``: also as many runs without greedy continuation, alternating; then
    ``paired_runs`` generations of ``prompt_tokens`` paired step by step with an unsplit
    worker (``_paired_swarm_runs``)."""
    async with open_covered_swarm(model, alias, n_nodes, threads) as (client, route, memory, ready_s):
        results = []
        stepped = []  # greedy continuation off, runs alternating with the default's
        config = client.config
        for i in range(runs + 1):
            generation = await client.generate(alias, prompt, max_tokens=n_gen + 1, temperature=0.0, route=route)
            if i:
                results.append(generation)
            if continuation_off:
                client.config = dataclasses.replace(config, greedy_continuation=False)
                generation = await client.generate(alias, prompt, max_tokens=n_gen + 1, temperature=0.0, route=route)
                client.config = config
                if generation.continued_steps:
                    raise RuntimeError("greedy continuation was off, yet steps were continued")
                if i:
                    stepped.append(generation)
        paired = []
        if paired_runs and prompt_tokens:
            paired = await _paired_swarm_runs(
                client, alias, route, model, sha256, prompt_tokens, n_gen, paired_runs, threads
            )  # fmt: skip
    extra = {}
    if stepped:
        extra["continuation_off_decode_tps"] = compare_report.summarize([g.tokens_per_s for g in stepped])
        if any(g.tokens != results[0].tokens for g in stepped):
            raise RuntimeError("without greedy continuation the swarm chose other tokens")
    if results:
        extra["continued_steps"] = [g.continued_steps for g in results]
    if paired:
        extra |= {
            "paired_per_hop_ms": compare_report.summarize([p["per_hop_ms"] for p in paired]),
            "paired_swarm_step_ms": compare_report.summarize([p["swarm_step_ms"] for p in paired]),
            "paired_unsplit_step_ms": compare_report.summarize([p["unsplit_step_ms"] for p in paired]),
        }
    return {
        **extra,
        "prefill_tps": compare_report.summarize([g.prefill_tokens_per_s for g in results]),
        "decode_tps": compare_report.summarize([g.tokens_per_s for g in results]),
        "decode_steps": [g.decode_steps for g in results],
        "data_plane_steps": [g.data_plane_steps for g in results],
        "prompt_tokens": len(results[0].prompt_tokens),
        "tokens": list(results[0].tokens),
        "route": [[h.begin, h.end] for h in route.hops],
        "node_memory_bytes": memory,
        "startup_to_route_s": ready_s,
        "replans": sum(g.replans for g in results),
    }


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, proc: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + SERVER_READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"rpc-server on port {port} exited {proc.returncode}: {log_path.read_text()[-2000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"rpc-server on port {port} not listening after {SERVER_READY_TIMEOUT_S} s")


@contextlib.contextmanager
def rpc_servers(rpc_bin: Path, n_servers: int, threads: int):
    """``n_servers`` rpc-servers on loopback, each ready: yields llama-bench's arguments that
    offload every layer to them, evenly. Stopped on exit."""
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="baton-rpc-") as tmp:
        try:
            ports = []
            for i in range(n_servers):
                port = _free_port()
                log_path = Path(tmp) / f"rpc-{i}.log"
                with open(log_path, "wb") as out:
                    proc = subprocess.Popen(
                        [str(rpc_bin), "-H", "127.0.0.1", "-p", str(port), "-t", str(threads)],
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=out,
                        env={**os.environ, "GGML_RPC_NO_RDMA": "1"},
                        # as its users run it, not in Baton's batch class; killed if this process dies
                        preexec_fn=die_with_parent(kernel_default),
                    )
                procs.append(proc)
                _wait_listening(port, proc, log_path)
                ports.append(port)
            yield ["-rpc", ",".join(f"127.0.0.1:{p}" for p in ports), "-ngl", "99", "-ts", "/".join(["1"] * n_servers)]
        finally:
            stop_processes(procs)


def bench_rpc(
    rpc_bin: Path, bench_bin: Path, model: Path, n_servers: int, n_prompt: int, n_gen: int, threads: int, runs: int
) -> dict:
    """``n_servers`` rpc-servers on loopback; llama-bench offloads every layer to them, evenly."""
    with rpc_servers(rpc_bin, n_servers, threads) as extra:
        figure = run_llama_bench(bench_bin, model, n_prompt, n_gen, threads, runs, extra, verbose=True)
    figure["rpc_servers"] = n_servers
    return figure


async def bench_interleaved(
    model: Path,
    sha256: str,
    prompt: str,
    prompt_tokens: list[int],
    n_gen: int,
    turns: int,
    threads: int,
    bench_bin: Path,
    rpc_bin: Path,
) -> dict:
    """The speed ratio targets (``compare_report.SPEED_RATIOS``) measured seconds apart rather
    than minutes: the Baton 3-split swarm, the unsplit worker (one Forward a step, from Python), llama-bench unsplit and
    llama.cpp's RPC 3-split are all started once, then each runs one generation in turn,
    ``turns`` times after a warm-up turn, the order rotating from turn to turn. Each turn
    gives its own ratios (``compare_report.interleaved_ratios``); this VM's speed drifts by
    more over the minutes between the rounds' phases than the targets' margins. Processes not
    measuring are idle (blocked on their sockets)."""
    from agent.core.wire.topk import DEFAULT_RESULT_TOP_K
    from agent.demo.local_demo import generate_through
    from agent.io.worker.process import open_worker

    n_prompt = len(prompt_tokens)
    rows: list[dict[str, float]] = []
    with rpc_servers(rpc_bin, 3, threads) as rpc_args:
        async with (
            open_worker(model, 0, None, threads=threads, model_sha256=sha256) as worker,
            open_covered_swarm(model, "smollm2", 3, threads) as (client, route, _memory, _ready_s),
        ):
            # each a run's figures: decode t/s under the system's name, prefill t/s under
            # NAME_prefill where it is compared
            async def baton_3() -> dict[str, float]:
                generation = await client.generate(
                    "smollm2", prompt, max_tokens=n_gen + 1, temperature=0.0, route=route
                )
                return {"baton_3": generation.tokens_per_s}

            async def worker_unsplit() -> dict[str, float]:
                run = await generate_through([worker.client], prompt_tokens, n_gen + 1, top_k=DEFAULT_RESULT_TOP_K)
                return {"worker_unsplit": run.decode_tokens_per_s, "worker_unsplit_prefill": run.prefill_tokens_per_s}

            async def llama_bench() -> dict[str, float]:
                figure = await trio.to_thread.run_sync(run_llama_bench, bench_bin, model, n_prompt, n_gen, threads, 1)
                return {
                    "llama_bench": figure["decode_tps"]["median"],
                    "llama_bench_prefill": figure["prefill_tps"]["median"],
                }

            async def rpc_3() -> dict[str, float]:
                figure = await trio.to_thread.run_sync(
                    run_llama_bench, bench_bin, model, n_prompt, n_gen, threads, 1, rpc_args
                )
                return {"rpc_3": figure["decode_tps"]["median"]}

            systems = [baton_3, worker_unsplit, llama_bench, rpc_3]
            for turn in range(turns + 1):  # the first turn warms up
                row: dict[str, float] = {}
                for system in systems[turn % len(systems) :] + systems[: turn % len(systems)]:
                    row |= await system()
                if turn:
                    rows.append(row)
    return {"turns": rows, "ratios": compare_report.interleaved_ratios(rows)}


# --- report ----------------------------------------------------------------------------------


FORWARD_ALL = "Forward call, all of it (encode to decode)"
HANDOFF = "hand-off to a call thread"
HANDBACK = "hand-back to the trio task"
HANDLER = "step handler: parse, admission check, validate, queue"
WAKE = "wake the serving task"
BUILD = "build + serialize the next message"
START_PUSH = "start the push (from the serving task, or a task)"
NODE_ALL = "in the node, all of it (step handler to the next request)"
LINK_ALL = "one way, all of it"


def profile_markdown(report: dict) -> str:
    """The "Where the time goes" section: ``bench/data_plane.py``'s paired run (the swarm's decode
    path, worker to worker, beside the same workers driven from Python), with the workers' own
    account of each decode step."""
    dp = report.get("data_plane")
    lines = ["## Where the time goes", ""]
    if not dp:
        lines.append("Not measured in this run (`--no-profile`).")
        return "\n".join(lines)
    s = dp["summary"]
    lines += [
        (
            f"The swarm's decode steps go worker to worker over the data plane (the prompt through the node "
            f"agents). `bench/data_plane.py`, run here after the rounds ({dp['reps']} generations of "
            f"{dp['decode_steps']} decode steps): a whole-model worker and the three range workers, both on their "
            "data planes, stepped side by side with the same workers driven one Forward at a time from Python; "
            "each worker accounts for its own time in every step (`UnbindSessionReply`)."
        ),
        "",
        f"- Per-hop overhead over the data plane, paired step by step against the unsplit worker (compare's "
        f"reference): **{s['per_hop_ms']:.3f} ms** (by generation "
        f"{', '.join(f'{v:.3f}' for v in s['per_hop_ms_by_rep'])}; target 0.3 ms); against the whole model over "
        f"the data plane {s['per_hop_vs_data_plane_1_ms']:.3f} ms; through Python one Forward at a time "
        f"{s['per_hop_python_chain_ms']:.3f} ms.",
        f"- Decode step, ms (medians): unsplit worker {s['step_ms']['worker_unsplit']:.2f}, whole model over the "
        f"data plane {s['step_ms']['data_plane_1']:.2f}, 3-split over the data plane {s['step_ms']['data_plane_3']:.2f}, "
        f"3-split through Python {s['step_ms']['chain_3']:.2f}.",
        "",
        *data_plane.profile_lines(s, dp["ranges"]),
        "",
        "Beyond these, the swarm's owner does more per step than the paired harness (the session's checks, "
        "sampling, the lease touches once a second): the swarm's per-hop figure in the table above carries it, "
        "and the drift between the unsplit run and the swarm's runs, minutes apart.",
    ]
    return "\n".join(lines)


def chart(report: dict) -> bytes:
    """``compare.png``: decode tokens/s of every system, median with min-max whiskers, Baton's
    bars and llama.cpp's in two colours. Needs matplotlib (the ``bench`` extra)."""
    import io

    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    from matplotlib import pyplot as plt

    labels, medians, lows, highs, colours = [], [], [], [], []
    for key, _label, family, _hops, _ref in compare_report.SYSTEMS:
        fig = report["systems"].get(key)
        if fig is None:
            continue
        d = fig["decode_tps"]
        labels.append(CHART_LABELS[key])
        medians.append(d["median"])
        lows.append(d["median"] - d["min"])
        highs.append(d["max"] - d["median"])
        colours.append(COLORS[family])
    m = report["method"]
    figure, axes = plt.subplots(figsize=(8, 4.5), dpi=100)
    axes.bar(labels, medians, yerr=[lows, highs], color=colours, capsize=4, ecolor="#333333")
    axes.set_title(f"Decode tokens/s, {Path(report['model']['name']).stem[:32]}, {m['threads']} thread(s)")
    axes.set_ylabel(f"tokens/s: median, min-max over {m['runs']} runs")
    axes.tick_params(axis="x", labelrotation=25)
    for label in axes.get_xticklabels():
        label.set_horizontalalignment("right")
    axes.legend(
        handles=[plt.Rectangle((0, 0), 1, 1, color=COLORS[f]) for f in ("baton", "llama.cpp")],
        labels=["Baton", "llama.cpp"],
    )
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", metadata={"Software": None})  # no version stamp: stable bytes
    plt.close(figure)
    return buffer.getvalue()


# --- main ------------------------------------------------------------------------------------


def pool_rounds(figures: Sequence[dict]) -> dict:
    """One figure from the same measurement made in several rounds: every per-run summary (a
    dict with ``"samples"``) pooled over the rounds, the rest from the first round (a
    ``"profile"`` from the round that traced one), and ``"rounds"``."""
    out = dict(figures[0])
    for key, value in figures[0].items():
        if isinstance(value, dict) and "samples" in value:
            out[key] = compare_report.summarize([v for figure in figures for v in figure[key]["samples"]])
    if "replans" in out:
        out["replans"] = sum(figure["replans"] for figure in figures)
    if isinstance(out.get("decode_steps"), list):
        out["decode_steps"] = [n for figure in figures for n in figure["decode_steps"]]
    if "tokens" in out:  # greedy: every round must give the same tokens
        out["tokens_same_every_round"] = all(figure["tokens"] == out["tokens"] for figure in figures)
    for figure in figures:
        if "profile" in figure:
            out["profile"] = figure["profile"]
    out["rounds"] = len(figures)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", type=Path, help="GGUF file (default: SmolLM2-135M, agent.models.model_path('smollm2'))"
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=6,
        help="measured runs per figure over all rounds, after each round's warm-up (>= 5; rounded up to a "
        "multiple of --rounds, at least 2 a round)",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="every system is measured once per round, runs pooled (default 3)"
    )
    parser.add_argument("--threads", type=int, default=1, help="threads of every process (default 1)")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results", help="where compare.{json,md,png} go")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument(
        "--no-profile", action="store_true", help="skip 'Where the time goes' (bench/data_plane.py's paired run)"
    )
    parser.add_argument(
        "--wait-quiet-s",
        type=float,
        default=20.0,
        help="before each measurement, wait up to this long for other processes to leave the CPU (shared machine)",
    )
    parser.add_argument(
        "--busy-threshold", type=float, default=0.15, help="others' CPU (cores) above which a measurement is run again"
    )
    parser.add_argument("--retries", type=int, default=2, help="at most this many re-runs of a disturbed measurement")
    parser.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)  # fewer runs, for smoke tests
    args = parser.parse_args()
    from agent.io.process_memory import keep_freed_memory

    keep_freed_memory()  # the direct harnesses are Baton processes too (agent.cli does it for the rest)
    apply_cpu_policy()  # and so is the swarm's owner here; llama.cpp's tools start in the default class
    if args.runs < 5 and not args.quick:
        parser.error("--runs must be at least 5")
    if args.threads < 1:
        parser.error("--threads must be at least 1")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    started = time.perf_counter()
    from agent.models import cached_sha256, model_path

    model = args.model or model_path("smollm2")
    model = Path(model).resolve()
    bench_bin, rpc_bin, build_s = ensure_llama_tools()
    machine = machine_info()
    log(
        f"model {model.name}; {args.runs} runs; {args.threads} thread(s); {machine['cpu_model']}, {machine['cores']} cores"
    )
    sha256 = cached_sha256(model)
    runs, threads, n_prompt, n_gen = args.runs, args.threads, args.prompt_tokens, args.decode_steps
    systems: dict[str, dict] = {}
    extra: dict[str, dict] = {}

    cpu = CpuWatch()

    def measure(name: str, what: str, fn, *fn_args):
        """Run one measurement; run it again (at most ``--retries`` times) while other
        processes took more than ``--busy-threshold`` cores meanwhile; keep the quietest. Its
        phase record is the most disturbed over the rounds."""
        before = cpu.phases.get(name)
        best = None
        for attempt in range(args.retries + 1):
            log(what + (f" (again: others used {cpu.phases[name]['others_cores']:.2f} cores)" if attempt else ""))
            with cpu.phase(name, args.wait_quiet_s):
                result = fn(*fn_args)
            phase = {**cpu.phases[name], "attempts": attempt + 1}
            if best is None or phase["others_cores"] < best[1]["others_cores"]:
                best = (result, phase)
            if phase["others_cores"] <= args.busy_threshold:
                break
        result, phase = best
        phase["attempts"] = attempt + 1
        if before is not None and before["others_cores"] > phase["others_cores"]:
            phase = before
        cpu.phases[name] = phase
        return result

    transport = measure(
        "transport",
        "transport: 8 KiB / 1 MiB round trips, channel and libp2p vs TCP",
        transport_rtt.run_benchmark,
        max(runs, 5),
    )

    # Rounds: every system is measured once per round, in the same order, and its runs are
    # pooled over the rounds. This machine's speed drifts by up to ~30 % over minutes (shared
    # host), so a system measured only in one stretch of time can look 2x off another measured
    # in the next (the unsplit worker's prefill at 0.54x llama-bench in one run, equal when
    # measured side by side); spreading every system over the whole run compares like with like.
    rounds = args.rounds
    per_round = max(2, -(-runs // rounds))
    collected: dict[str, list] = {}

    def keep(name: str, figure: dict) -> None:
        collected.setdefault(name, []).append(figure)

    for round_index in range(rounds):
        log(f"round {round_index + 1} of {rounds}: {per_round} measured runs per system")
        worker, worker_ahead, prompt_text, prompt_tokens, model_info = measure(
            "worker_unsplit", "Baton worker, unsplit, direct (one Forward a step, and run-ahead)", trio.run,
            bench_worker, model, sha256, n_prompt, n_gen, per_round, threads,
        )  # fmt: skip
        keep("worker_unsplit", worker)
        keep("worker_run_ahead", worker_ahead)
        log(f"  decode {worker['decode_tps']['median']:.1f} t/s, prefill {worker['prefill_tps']['median']:.1f} t/s; "
            f"run-ahead decode {worker_ahead['decode_tps']['median']:.1f} t/s")  # fmt: skip
        keep("llama_bench", measure(
            "llama_bench", "llama-bench, unsplit", run_llama_bench, bench_bin, model, n_prompt, n_gen, threads,
            per_round,
        ))  # fmt: skip
        log(f"  decode {collected['llama_bench'][-1]['decode_tps']['median']:.1f} t/s")
        keep("chain_3", measure(
            "chain_3", "Baton, 3 range workers chained directly (no swarm)", trio.run, bench_chain,
            model, sha256, prompt_tokens, 3, model_info["n_layer"], n_gen, per_round, threads,
        ))  # fmt: skip
        log(f"  decode {collected['chain_3'][-1]['decode_tps']['median']:.1f} t/s")
        keep("one_block", measure(
            "one_block", "Baton worker holding one block: the fixed cost of a Forward", trio.run,
            bench_one_block, model, sha256, n_gen, per_round, threads,
        ))  # fmt: skip
        log(f"  {collected['one_block'][-1]['forward_ms']['median']:.2f} ms per Forward")
        for n in (2, 3):
            keep(f"baton_{n}", measure(
                f"baton_{n}", f"Baton {n}-split through the swarm", trio.run, bench_swarm,
                model, "smollm2", n, prompt_text, n_gen, per_round, threads, sha256, prompt_tokens, PAIRED_RUNS,
                n == 3,
            ))  # fmt: skip
            log(f"  decode {collected[f'baton_{n}'][-1]['decode_tps']['median']:.1f} t/s")
        for n in (2, 3):
            keep(f"rpc_{n}", measure(
                f"rpc_{n}", f"llama.cpp RPC {n}-split", bench_rpc, rpc_bin, bench_bin, model, n,
                n_prompt, n_gen, threads, per_round,
            ))  # fmt: skip
            log(f"  decode {collected[f'rpc_{n}'][-1]['decode_tps']['median']:.1f} t/s")
    for name in ("worker_unsplit", "worker_run_ahead", "llama_bench", "baton_2", "baton_3", "rpc_2", "rpc_3"):
        systems[name] = pool_rounds(collected[name])
    interleaved = measure(
        "interleaved", "Interleaved turns: Baton 3-split, the unsplit worker, llama-bench, RPC 3-split", trio.run,
        bench_interleaved, model, sha256, prompt_text, prompt_tokens, n_gen,
        INTERLEAVED_TURNS if not args.quick else 2, threads, bench_bin, rpc_bin,
    )  # fmt: skip
    log("  " + ", ".join(f"{k} {v['median']:.3f}" for k, v in interleaved["ratios"].items()))
    for name in ("chain_3", "one_block"):
        extra[name] = pool_rounds(collected[name])
    extra["one_block"]["ed25519_verify_us"] = ed25519_verify_us()
    worker = systems["worker_unsplit"]
    data_plane_profile = None
    if not args.no_profile:
        from agent.core.wire.ranges import ranges_from_cuts
        from agent.demo.local_demo import even_cuts

        cuts3 = [(r.begin, r.end) for r in ranges_from_cuts(model_info["n_layer"], even_cuts(model_info["n_layer"], 3))]
        reps = measure(
            "data_plane", "Where the time goes: bench/data_plane.py's paired run", trio.run, data_plane.bench_paired,
            model, sha256, prompt_tokens, cuts3, n_gen, PROFILE_REPS, threads,
        )  # fmt: skip
        llama_ms = [1000.0 / v for v in systems["llama_bench"]["decode_tps"]["samples"]]
        data_plane_profile = {
            "reps": PROFILE_REPS, "decode_steps": n_gen, "ranges": cuts3, "summary": data_plane.summary(reps, llama_ms),
            "tokens_equal_unsplit": reps[0]["tokens"] == worker["tokens"],
        }  # fmt: skip

    cpu.close()
    machine["loadavg_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    derived = compare_report.derive(systems)
    notes = [
        (
            "Baton figures are timed by the caller per step (prefill = the first step, the whole prompt in one "
            "Forward per hop; decode = each later step, mean over the steps of a run; through the swarm a decode "
            "step is the wall time from the token before, the owner's own work between tokens included); a run's "
            "decode t/s = steps / their summed time. Swarm steps go client -> hop 1 -> ... -> last hop -> client "
            "over the direct "
            "channel (TCP + TLS 1.3, libp2p-TLS certificates; libp2p only for the tracker) for the prompt, "
            "then worker to worker over the workers' data plane for every decode step (sealed frames, "
            "AES-256-GCM under keys the owner gave the hops' nodes), the last worker sending the top-40 "
            "logits and the row's log-sum-exp back (greedy decode) and, greedy continuation being on (the "
            "default), each next step straight to the first worker, the owner's own copy of it dropped there."
        ),
        (
            f"llama-bench: `-p {n_prompt} -n {n_gen} -t {threads} -r {runs} -d 0,{n_prompt}` (its own warm-up; "
            f"random tokens; prefill at depth 0, decode after {n_prompt} cached positions, as Baton's decode follows "
            "its prompt: flash attention skips masked positions on the CPU, so decoding from position 0 would do "
            "less work)."
        ),
        (
            "RPC: `ggml-rpc-server -t THREADS` per server, `llama-bench ... -rpc 127.0.0.1:P1,... -ngl 99 -ts 1/1[/1]`: "
            "every block (and the output head) on the servers, split evenly; token embeddings stay in llama-bench."
        ),
        (
            "Baton's direct runs ask the last range for the top-40 logits (as the swarm's last hop does for greedy "
            "decode). Worker runs use the worker's defaults (4 sequences x 2048 positions of KV, flash attention auto), the "
            "same in the unsplit worker and in every node's worker."
        ),
        (
            "Baton worker, run-ahead: the same generation, the worker decoding each next step by itself from the "
            "previous step's greedy token (protocol/worker.proto, SequenceInput.run_ahead_steps) while the caller "
            "reads the replies; runs alternate with the one-Forward-a-step runs, and the tokens are checked equal."
        ),
    ]
    for n in (2, 3):
        if f"baton_{n}" in systems and f"rpc_{n}" in systems:
            route = ", ".join(f"[{a}, {b})" for a, b in systems[f"baton_{n}"]["route"])
            rpc = systems[f"rpc_{n}"].get("placement", {}).get("blocks", {})
            rpc_text = ", ".join(f"{dev} [{a}, {b + 1})" for dev, (a, b) in rpc.items()) or "not logged"
            notes.append(
                f"{n}-split placement: Baton route {route} (the head with the last range); RPC {rpc_text} "
                "(llama.cpp counts the output head as one more layer and puts it on the last server)."
            )

    def same_tokens(figure: dict) -> bool:
        return figure["tokens"] == worker["tokens"] and figure.get("tokens_same_every_round", True)

    tokens_match = {k: same_tokens(systems[k]) for k in ("baton_2", "baton_3") if k in systems}
    tokens_match["chain_3"] = same_tokens(extra["chain_3"])
    tokens_match = {k: v and worker.get("tokens_same_every_round", True) for k, v in tokens_match.items()}
    report = {
        "benchmark": "compare",
        "model": {"name": model.name, "sha256": sha256, **model_info},
        "machine": machine,
        "method": {
            "runs": per_round * rounds,
            "rounds": rounds,
            "runs_per_round": per_round,
            "warmup_runs": 1,  # per round and system
            "threads": threads,
            "prompt_tokens": n_prompt,
            "decode_steps": n_gen,
            "prompt_text": prompt_text,
            "statistic": "per run: tokens/s of that run; reported: median/min/max over the runs of all rounds",
            "wait_quiet_s": args.wait_quiet_s,
            "busy_threshold": args.busy_threshold,
            "retries": args.retries,
            "tools_cmake_flags": TOOLS_CMAKE_FLAGS,
            "notes": notes,
        },
        "systems": systems,
        "derived": derived,
        "headline": compare_report.headline(systems, derived, transport, interleaved),
        "interleaved": interleaved,
        "transport": transport,
        "extra": extra,
        "greedy_tokens_equal_unsplit_worker": tokens_match,
        "data_plane": data_plane_profile,
        "tools_build_s": build_s,
        "cpu_used_by_other_processes": cpu.phases,
    }
    report["wall_time_s"] = time.perf_counter() - started
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    md = compare_report.render_markdown(report, profile_markdown(report))
    (out / "compare.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "compare.md").write_text(md)
    try:
        (out / "compare.png").write_bytes(chart(report))
    except ImportError:
        log("no matplotlib: compare.png not drawn (pip install -e '.[bench]')")
    print(md)
    log(f"wrote {out / 'compare.json'}, compare.md, compare.png in {report['wall_time_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
