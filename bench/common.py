"""What the benchmarks share: the machine they ran on, llama.cpp's own tools built from the
pinned tree, a prompt of an exact length, a covered local swarm, and where a report goes.

Owns no benchmark. A benchmark script imports it after ``_bootstrap`` (which makes the project
importable); nothing here imports a benchmark, so no two benchmarks import each other through it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import compare_report
from _bootstrap import REPO_ROOT
from results_io import publish  # standard library only: gpu_check.py runs without the project

from agent.io.cpu_policy import kernel_default
from agent.io.lifeline import die_with_parent

__all__ = [
    "COVERAGE_TIMEOUT_S",
    "PROMPT_SOURCE",
    "TOOLS_CMAKE_FLAGS",
    "TOOLS_DIR",
    "chain_step",
    "ensure_llama_tools",
    "log",
    "machine_info",
    "make_prompt",
    "open_covered_swarm",
    "publish",
    "run_llama_bench",
]

TOOLS_DIR = REPO_ROOT / "build" / "llama-tools"
LLAMA_SRC = REPO_ROOT / "build" / "llama.cpp"
LLAMA_STAMP = REPO_ROOT / "build" / "llama.cpp.stamp"
TOOLS_STAMP = TOOLS_DIR / ".baton-tools-stamp"
TOOLS_CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_RPC=ON",
    "-DGGML_RPC_RDMA=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_CURL=OFF",
    # as build/native (the worker): same instruction set and static linking on both sides
    "-DGGML_NATIVE=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
]
TOOLS_TARGETS = ("llama-bench", "ggml-rpc-server", "llama-batched-bench")  # the last for bench/batching.py
PROMPT_SOURCE = (
    "Volunteer computing lets many people lend the spare capacity of their own machines to a shared task. "
    "Each machine runs a small part of the work and passes its result on to the next one, so that together "
    "they can run a model that none of them could hold alone. The hard parts are trust, failures and the "
    "time spent moving data between machines, which this benchmark measures on one computer by comparing "
    "a model run in one piece with the same model cut into two or three pieces and connected through the "
    "network stack of the swarm, step after step, token after token, for as long as the answer keeps going."
)
COVERAGE_TIMEOUT_S = 180.0
LLAMA_BENCH_TIMEOUT_S = 300.0


def stop_processes(procs: Sequence[subprocess.Popen], timeout_s: float = 5.0) -> None:
    """SIGTERM every process, then wait for each; one still running after ``timeout_s`` is
    killed (an rpc-server mid-request can ignore SIGTERM for a while)."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def log(message: str) -> None:
    """A timestamped progress line on stdout, named after the running script."""
    print(f"[{Path(sys.argv[0]).stem} {time.strftime('%H:%M:%S')}] {message}", flush=True)


# --- machine ---------------------------------------------------------------------------------


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _ram_bytes() -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def stamped(report: dict) -> dict:
    """``report`` with the machine it ran on and when (``machine``, ``measured_at`` in UTC)."""
    report["machine"] = machine_info()
    report["measured_at"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return report


def machine_info() -> dict:
    from agent.runtime import expected_pin, worker_runtime

    commit, patch_hash = expected_pin()
    info = {
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "ram_bytes": _ram_bytes(),
        "ram_gib": _ram_bytes() / 2**30,
        "python": platform.python_version(),
        "llama_cpp_commit": commit,
        "patch_series_sha256": patch_hash,
        "loadavg_before": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
    with contextlib.suppress(OSError, ValueError):
        info["llama_tree_stamp"] = json.loads(LLAMA_STAMP.read_text())
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        git = ["git", "-C", str(REPO_ROOT)]
        info["baton_commit"] = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, check=True
        ).stdout
        info["baton_modified_files"] = [line[3:] for line in status.splitlines()]
    runtime = worker_runtime()
    info["worker_runtime"] = {
        "llama_cpp_commit": runtime.llama_cpp_commit,
        "patch_series_sha256": runtime.patch_series_sha256,
        "backends": list(runtime.backends),
    }
    return info


# --- llama.cpp tools -------------------------------------------------------------------------


def _tools_stamp() -> str:
    return LLAMA_STAMP.read_text() if LLAMA_STAMP.exists() else "no stamp"


def ensure_llama_tools() -> tuple[Path, Path, float]:
    """``(llama-bench, ggml-rpc-server, seconds spent building)``; builds them from the pinned,
    patched tree when missing or built from another tree state (idempotent)."""
    bench_bin, rpc_bin = TOOLS_DIR / "bin" / "llama-bench", TOOLS_DIR / "bin" / "ggml-rpc-server"
    stamp = _tools_stamp()
    built = all((TOOLS_DIR / "bin" / target).exists() for target in TOOLS_TARGETS)
    if built and TOOLS_STAMP.exists() and TOOLS_STAMP.read_text() == stamp:
        return bench_bin, rpc_bin, 0.0
    if not (LLAMA_SRC / "include" / "llama.h").exists():
        raise SystemExit(f"no llama.cpp tree at {LLAMA_SRC}: run `make native` first")
    started = time.perf_counter()
    log(f"building {', '.join(TOOLS_TARGETS)} into {TOOLS_DIR} (4-8 min on 2 cores the first time)")
    flags = list(TOOLS_CMAKE_FLAGS)
    with contextlib.suppress(FileNotFoundError, subprocess.CalledProcessError):
        subprocess.run(["ccache", "--version"], capture_output=True, check=True)
        flags += ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
    subprocess.run(["cmake", "-S", str(LLAMA_SRC), "-B", str(TOOLS_DIR), *flags], check=True, stdout=subprocess.DEVNULL)
    jobs = str(os.cpu_count() or 2)
    subprocess.run(
        ["cmake", "--build", str(TOOLS_DIR), "-j", jobs, "--target", *TOOLS_TARGETS],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    TOOLS_STAMP.write_text(stamp)
    return bench_bin, rpc_bin, time.perf_counter() - started


def layer_placement(log_text: str) -> dict:
    """Which blocks llama.cpp put on which device (``-v`` log): ``{device: [first, last]}``, and
    the per-device model buffer lines."""
    blocks: dict[str, list[int]] = {}
    buffers = []
    for line in log_text.splitlines():
        match = re.search(r"layer\s+(\d+) assigned to device (\S+?),", line)
        if match:
            blocks.setdefault(match.group(2), []).append(int(match.group(1)))
        elif "model buffer size" in line or "offloading output layer" in line:
            buffers.append(line.split(":", 1)[1].strip())
    return {"blocks": {dev: [min(v), max(v)] for dev, v in blocks.items()}, "log": buffers}


def run_llama_bench(
    bench_bin: Path,
    model: Path,
    n_prompt: int,
    n_gen: int,
    threads: int,
    runs: int,
    extra: Sequence[str] = (),
    verbose: bool = False,
    prefix: Sequence[str] = (),
) -> dict:
    """Prefill at depth 0; decode after ``n_prompt`` cached positions (``-d 0,P``), as Baton's
    decode steps follow the prompt: flash attention on the CPU skips the masked positions, so
    a decode from position 0 does less attention work than one after the prompt (measured:
    3.4 M of 107 M instructions a step for SmolLM2 at depth 64)."""
    argv = [
        *prefix,
        str(bench_bin),
        "-m",
        str(model),
        "-p",
        str(n_prompt),
        "-n",
        str(n_gen),
        "-t",
        str(threads),
        "-r",
        str(runs),
        "-d",
        f"0,{n_prompt}",
        "-o",
        "json",
        *extra,
        *(["-v"] if verbose else []),
    ]
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=LLAMA_BENCH_TIMEOUT_S,
        check=False,
        preexec_fn=die_with_parent(kernel_default, waited=True),
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    entries = json.loads(proc.stdout)
    pp = next(e for e in entries if e["n_prompt"] == n_prompt and e["n_gen"] == 0 and e.get("n_depth", 0) == 0)
    tg = next(e for e in entries if e["n_gen"] == n_gen and e["n_prompt"] == 0 and e.get("n_depth", 0) == n_prompt)
    tg0 = next((e for e in entries if e["n_gen"] == n_gen and e["n_prompt"] == 0 and e.get("n_depth", 0) == 0), None)
    return {
        "prefill_tps": compare_report.summarize(pp["samples_ts"]),
        "decode_tps": compare_report.summarize(tg["samples_ts"]),
        "decode_depth": n_prompt,
        **({"decode_tps_at_depth_0": compare_report.summarize(tg0["samples_ts"])} if tg0 else {}),
        "argv": [os.path.relpath(a, REPO_ROOT) if a.startswith(str(REPO_ROOT)) else a for a in argv],
        "llama_bench": {
            k: tg.get(k)
            for k in (
                "build_commit",
                "cpu_info",
                "backends",
                "n_threads",
                "flash_attn",
                "n_gpu_layers",
                "tensor_split",
                "type_k",
                "n_ubatch",
            )
        },
        **({"placement": layer_placement(proc.stderr)} if verbose else {}),
    }


# --- Baton -----------------------------------------------------------------------------------


async def make_prompt(client, n_tokens: int) -> tuple[str, list[int]]:
    """A prefix of ``PROMPT_SOURCE`` (padded with " and") that tokenizes, with special tokens
    as the swarm's first hop does, to exactly ``n_tokens`` tokens."""
    words = PROMPT_SOURCE.split()
    base = ""
    for k in range(1, len(words) + 1):
        text = " ".join(words[:k])
        tokens = await client.tokenize(text, add_special=True)
        if len(tokens) == n_tokens:
            return text, tokens
        if len(tokens) > n_tokens:
            break
        base = text
    text = base
    while True:
        tokens = await client.tokenize(text, add_special=True)
        if len(tokens) == n_tokens:
            return text, tokens
        if len(tokens) > n_tokens:
            raise RuntimeError(f"cannot build a prompt of exactly {n_tokens} tokens")
        text += " and"


@contextlib.asynccontextmanager
async def open_covered_swarm(model: Path, alias: str, n_nodes: int, threads: int):
    """Tracker + ``n_nodes`` nodes of ``model`` on loopback (``threads`` per worker), each
    node given memory for an even share of the blocks, and a client: yields ``(client,
    route, node_memory_bytes, ready_s)`` once the tracker offers an ``n_nodes``-hop route
    (``ready_s``: from start to that route). Everything is stopped on exit."""
    from agent.demo.swarm_demo import node_memory_bytes, wait_for_coverage
    from agent.harness.local_swarm import LocalSwarmConfig, open_local_swarm
    from agent.io.client import open_swarm_client

    started = time.perf_counter()
    async with open_local_swarm(LocalSwarmConfig(model_path=model, model_alias=alias, threads=threads)) as swarm:
        await swarm.start_tracker()
        async with open_swarm_client(swarm.tracker_addr) as client:
            entries = [e for e in await client.list_models() if alias in (e.alias, e.name)]
            if not entries:
                raise RuntimeError(f"the tracker has no model {alias!r}")
            memory = node_memory_bytes(entries[0].n_layer, entries[0].bytes_per_block, n_nodes)
            for i in range(n_nodes):
                swarm.start_node(f"node-{i + 1}", memory)
            route = await wait_for_coverage(client, swarm, alias, timeout_s=COVERAGE_TIMEOUT_S)
            if len(route.hops) != n_nodes:
                raise RuntimeError(f"expected a {n_nodes}-hop route, got {len(route.hops)} hops")
            ready_s = time.perf_counter() - started
            log(
                f"{n_nodes}-split route ready after {ready_s:.1f} s: "
                + " -> ".join(f"[{h.begin}, {h.end})" for h in route.hops)
            )
            yield client, route, memory, ready_s


async def chain_step(clients, gens) -> None:
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
