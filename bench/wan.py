"""Baton across a WAN: single-session speed against llama.cpp's RPC split and the ring bound, on
emulated machines (``agent.io.lab``) at 0, 10, 20 and 50 ms round trip.

Owns one benchmark, in one run, on one lab of five machines (owner, tracker, n1, n2, n3; every
pair linked with the same one-way delay, RTT/2; no loss, no rate limit):
1. The lab's accuracy, between two idle machines: a 64-byte TCP ping-pong's RTT against the
   configured one from 1 to 100 ms; the share of UDP datagrams lost against the configured
   loss; one TCP stream's payload rate against the configured link rate; the forwarder's own
   CPU time per packet.
2. At each RTT, ``--turns`` turns, the systems in rotating order, one generation each:
   - Baton 3-split and 2-split: a tracker (machine ``tracker``) and nodes on n1..n3, the owner
     (``agent.io.client``, greedy, ``--new-tokens`` after a ``--prompt-tokens`` prompt) on
     ``owner``; decode tokens/s (tokens over the decode's wall time) and time to first token;
     and the 3-split again with sampled sessions (temperature 0.7, no top_k, a fixed seed),
     whose last hop draws each token from the full row and continues the session itself;
   - llama.cpp RPC 3-split and 2-split from the same pin: ``ggml-rpc-server`` on n1..n3 (its
     weights cache on), ``llama-bench -rpc ... -ngl 99 -ts 1/1[/1] -r 1`` on ``owner``: decode
     tokens/s at the prompt's depth, and prefill time as its time to first token;
   - the unsplit model: ``llama-bench`` alone on ``owner`` (no network): the compute C of a
     token and of the prompt.
   Before the RTTs, what the 3-split's hops compute for one decode token (each worker's
   data-plane compute, gRPC Health, over a generation less a prompt-only one): the bound below
   takes the unsplit model's C, and three hops may compute more than one model does; the 3-split
   is also set against a bound with that compute in place of C.
   Next to each, the ring bound: Baton S-split decode is at best one token per C + S x (one-way
   delay) (hop 1 -> ... -> hop S -> hop 1: the last hop continues a greedy or sampled session itself), its
   first token at best the prompt's compute + (S + 1) one-way delays (owner -> hops -> owner);
   RPC pays at least a round trip to each of its S servers a token (C + S x RTT). The one-way
   delay is the lab's own measured RTT / 2 at that setting.
3. At 20 ms: 8 concurrent greedy sessions through the Baton 3-split (one owner, 8 sessions,
   nodes with 8 sequences) against one session: aggregate decode tokens/s; ``--turns`` rounds,
   each of one session, 8 sessions in decode groups (the default across machines) and 8 in
   lock-step (a second 3-split swarm whose nodes say ``--decode-groups 1``: the rule for hops
   that share one machine's cores), in alternating order. Whether lock-step still helps when
   the hops are machines apart is the question this answers (``agent.core.node.scheduler``).
   ``--only sessions`` measures this section alone and replaces it in ``--out``'s wan.json.
4. ``--only prefill`` (run alone, not part of the full run): time to first token of a
   ``--prefill-tokens`` prompt through the Baton 3-split at ``--prefill-rtt-ms``, its chunks
   pipelined down the route on the data plane against one chunk per round trip and against the
   node path (``bench/wan_prefill.py``; writes ``wan_prefill.{json,md}``).
5. ``--only wire`` (run alone): that prompt's time to first token with every link limited to
   ``--wire-rate-mbit`` (20), the session's boundary rows in f32, f16 and q8, and each lossy
   dtype's max logit difference from f32 (``bench/wan_wire.py``; writes ``wan_wire.{json,md}``).
6. ``--only speculation`` (run alone): 256 greedy tokens of a copy-heavy and a free-form task
   at ``--prefill-rtt-ms``, with speculative decoding and without (``bench/wan_speculation.py``;
   writes ``wan_speculation.{json,md}``).

Writes ``wan.json``, ``wan.md`` and ``wan.png`` (matplotlib, the ``bench`` extra) under
``--out``. Needs root (the lab), the worker (``make native``) and llama.cpp's tools (built into
``build/llama-tools`` when missing, 4-8 minutes on 2 cores). Run it alone on the machine: every
emulated machine shares this host's cores, so anything else running slows all of them.

Usage: ``sudo .venv/bin/python bench/wan.py [--rtts-ms 0,10,20,50] [--turns 3] [--new-tokens 32]
[--prompt-tokens 64] [--threads 1] [--quick] [--only sessions|prefill|prefill-chunks|wire|speculation] [--out bench/results]`` (about 25
minutes; ``--only sessions`` about 4; ``--only prefill [--prefill-tokens 1500] [--prefill-chunk-rows 128]
[--prefill-rtt-ms 20] [--turns 3]`` about 5; ``--only wire [--wire-rate-mbit 20]`` with the
prefill flags, about 5; ``--only prefill-chunks [--chunk-sweep 64,128,256,512]`` with the
prefill and wire flags, about 10; ``--only speculation [--prefill-rtt-ms 20] [--turns 3]`` about 5).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import statistics
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import _bootstrap  # noqa: F401  (first: it makes the project importable)
import trio
from common import (
    ensure_llama_tools,
    log,
    machine_info,
    make_prompt,
    publish,
    run_llama_bench,
    stamped,
    stop_processes,
)

from agent.core.lab.topology import LinkChange, LinkSpec, MachineSpec, Topology
from agent.core.owner.sampling import SamplingParams
from agent.demo.swarm_demo import node_memory_bytes, wait_for_coverage
from agent.harness.local_swarm import LocalSwarm, LocalSwarmConfig, Placement
from agent.io.client import open_swarm_client
from agent.io.cpu_policy import kernel_default
from agent.io.lab.harness import Lab, running_lab
from agent.io.lab.measure import tcp_goodput_mbit, tcp_rtt_ms, udp_loss_pct
from agent.io.lifeline import die_with_parent
from agent.models import model_path

ALIAS = "smollm2"
NODES = ("n1", "n2", "n3")
MACHINES = ("owner", "tracker", *NODES)
RPC_PORT = 50052
ACCURACY_RTTS_MS = (1, 2, 5, 10, 20, 50, 100)
ACCURACY_LOSS_PCT = (1.0, 2.0, 5.0)
ACCURACY_RATES_MBIT = (5.0, 20.0, 50.0)
CONCURRENT_SESSIONS = 8
CONCURRENT_RTT_MS = 20.0
LOCK_STEP = "3-split lock-step"  # the swarm whose nodes say --decode-groups 1
SERVER_READY_TIMEOUT_S = 30.0
COVERAGE_TIMEOUT_S = 240.0
SYSTEMS = ("baton_3", "baton_sampled_3", "baton_2", "rpc_3", "rpc_2", "unsplit")
#: the sampled sessions' temperature (no top_k: the last hop draws from the full row)
SAMPLED_TEMPERATURE = 0.7
LABELS = {
    "baton_3": "Baton 3-split",
    "baton_sampled_3": f"Baton 3-split sampled (T {SAMPLED_TEMPERATURE:g}, no top_k)",
    "baton_2": "Baton 2-split",
    "rpc_3": "llama.cpp RPC 3-split",
    "rpc_2": "llama.cpp RPC 2-split",
    "unsplit": "unsplit (llama-bench, no network)",
}


# --- the lab --------------------------------------------------------------------------------


def set_every_link(lab: Lab, change: LinkChange) -> None:
    names = lab.topology.names
    for a, b in itertools.combinations(names, 2):
        lab.link(a, b, change)


def lab_accuracy(lab: Lab, quick: bool) -> dict:
    """Configured against measured, between ``owner`` and ``n3`` (the rest of the lab idle)."""
    a, b = "owner", "n3"
    rtts = []
    for rtt_ms in ACCURACY_RTTS_MS if not quick else (2, 20):
        lab.link(a, b, LinkChange(delay_ms=rtt_ms / 2))
        samples = tcp_rtt_ms(lab, a, b, count=30 if not quick else 10)
        median = statistics.median(samples)
        tolerance = 0.1 * rtt_ms + 0.3
        rtts.append(
            {"configured_ms": rtt_ms, "median_ms": median, "min_ms": min(samples), "max_ms": max(samples),
             "error_ms": median - rtt_ms, "within": abs(median - rtt_ms) <= tolerance, "tolerance_ms": tolerance}
        )  # fmt: skip
        log(f"  RTT {rtt_ms} ms: measured {median:.3f} ms")
    losses = []
    for loss in ACCURACY_LOSS_PCT if not quick else (2.0,):
        lab.link(a, b, LinkChange(delay_ms=5.0, loss_pct=loss))
        measured = udp_loss_pct(lab, a, b, count=10000 if not quick else 2000, pace_s=0.0001, settle_s=0.5)
        losses.append({"configured_pct": loss, "measured_pct": measured, "within": abs(measured - loss) <= 1.0})
        log(f"  loss {loss} %: measured {measured:.2f} %")
    rates = []
    for rate in ACCURACY_RATES_MBIT if not quick else (20.0,):
        lab.link(a, b, LinkChange(delay_ms=5.0, loss_pct=0.0, rate_mbit=rate))
        goodput = tcp_goodput_mbit(lab, a, b, seconds=4.0 if not quick else 2.0)
        rates.append(
            {"configured_mbit": rate, "tcp_payload_mbit": goodput, "ratio": goodput / rate,
             "within": abs(goodput - rate) <= 0.1 * rate}
        )  # fmt: skip
        log(f"  rate {rate} Mbit/s: TCP payload {goodput:.2f} Mbit/s")
    lab.link(a, b, LinkChange(delay_ms=0.0, loss_pct=0.0, rate_mbit=0.0))
    stats = lab.stats()
    cpu_s = stats["cpu_user_s"] + stats["cpu_system_s"]
    return {
        "between": [a, b],
        "rtt": rtts,
        "loss": losses,
        "rate": rates,
        "forwarder": {
            "packets": stats["packets"],
            "cpu_s": cpu_s,
            "cpu_us_per_packet": 1e6 * cpu_s / max(1, stats["packets"]),
        },
    }


# --- llama.cpp RPC servers in the lab ----------------------------------------------------------


@contextlib.contextmanager
def rpc_servers_in(lab: Lab, rpc_bin: Path, threads: int, workdir: Path) -> Iterator[None]:
    """One ``ggml-rpc-server`` on each node machine, listening on its address (weights cache on,
    so a run after the first loads them locally instead of over the lab). Started from the main
    thread (they die with this process) and stopped on exit."""
    procs = []
    try:
        for name in NODES:
            argv = lab.argv_in(
                name, [str(rpc_bin), "-H", lab.address(name), "-p", str(RPC_PORT), "-t", str(threads), "-c"]
            )
            log_path = workdir / f"rpc-{name}.log"
            with open(log_path, "wb") as out:
                procs.append(
                    subprocess.Popen(
                        argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                        env={"GGML_RPC_NO_RDMA": "1", "HOME": str(workdir), "PATH": "/usr/sbin:/usr/bin:/bin"},
                        preexec_fn=die_with_parent(kernel_default),
                    )
                )  # fmt: skip
        deadline = time.monotonic() + SERVER_READY_TIMEOUT_S
        for name, proc in zip(NODES, procs):
            while not _dialable(lab, name):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"rpc-server on {name} did not start:\n{(workdir / f'rpc-{name}.log').read_text()[-2000:]}"
                    )
                time.sleep(0.05)  # polling a port that opens once the server is up
        yield
    finally:
        stop_processes(procs)


def _dialable(lab: Lab, name: str) -> bool:
    import socket

    def attempt() -> bool:
        try:
            with socket.create_connection((lab.address(name), RPC_PORT), timeout=0.5):
                return True
        except OSError:
            return False

    return lab.run_in("owner", attempt)


def rpc_args(lab: Lab, n: int) -> list[str]:
    servers = ",".join(f"{lab.address(name)}:{RPC_PORT}" for name in NODES[:n])
    return ["-rpc", servers, "-ngl", "99", "-ts", "/".join(["1"] * n)]


# --- the bounds ---------------------------------------------------------------------------------


def ring_bounds(compute_s: float, prompt_compute_s: float, one_way_s: float, hops: int) -> dict:
    """What a route of ``hops`` hops cannot beat with this token compute and link delay.

    decode: one token per compute + ``hops`` one-way delays (the last hop continues the
    session to the first); first token: the prompt's compute + ``hops + 1`` one-way delays
    (the owner sends, the last hop answers); RPC: compute + a round trip per server a token."""
    return {
        "decode_tps": 1.0 / (compute_s + hops * one_way_s),
        "first_token_s": prompt_compute_s + (hops + 1) * one_way_s,
        "rpc_decode_tps": 1.0 / (compute_s + hops * 2 * one_way_s),
    }


def where_time_goes(tps: float, compute_s: float, one_way_s: float, hops: int) -> dict:
    """A decode token's time split into compute, the ring's links and the rest (the overhead)."""
    token_s = 1.0 / tps if tps > 0 else math.inf
    links_s = hops * one_way_s
    return {"token_ms": 1000 * token_s, "compute_ms": 1000 * compute_s, "links_ms": 1000 * links_s,
            "rest_ms": 1000 * (token_s - compute_s - links_s)}  # fmt: skip


def split_compute_ms(prefill: dict, whole: dict, decode_steps: int) -> dict:
    """Each hop's compute of one decode token, ms, from its worker's data-plane compute (µs) over
    a prompt-only generation (``prefill``) and one of ``decode_steps`` more steps (``whole``),
    keyed by the hop's range: the difference is the decode steps' alone."""
    hops = {k: (whole[k] - prefill[k]) / decode_steps / 1000 for k in sorted(whole) if k in prefill}
    return {"hops_ms": [{"begin": b, "end": e, "ms": ms} for (b, e), ms in hops.items()],
            "sum_ms": sum(hops.values())}  # fmt: skip


# --- one run ------------------------------------------------------------------------------------


async def _baton_once(client, prompt_tokens: list[int], new_tokens: int, *, sampled: bool = False) -> dict:
    if sampled:  # (a fixed seed: every turn draws the same tokens)
        result = await client.generate_tokens(
            ALIAS,
            prompt_tokens,
            max_tokens=new_tokens,
            sampling=SamplingParams(temperature=SAMPLED_TEMPERATURE),
            seed=7,
        )
    else:
        result = await client.generate_tokens(ALIAS, prompt_tokens, max_tokens=new_tokens)
    if len(result.tokens) != new_tokens:
        raise RuntimeError(f"generated {len(result.tokens)} tokens, wanted {new_tokens}")
    return {"decode_tps": result.tokens_per_s, "first_token_s": result.first_token_s,
            "continued_steps": result.continued_steps, "data_plane_steps": result.data_plane_steps}  # fmt: skip


def _workers_compute_us(swarm: LocalSwarm) -> dict[tuple[int, int], int]:
    """Each range's worker's data-plane compute so far (µs), by (begin, end) (its Health, over
    the worker's Unix socket: a path, reachable from any of the lab's machines)."""
    return {(info.layer_begin, info.layer_end): health.data_plane_compute_us for info, health in swarm.worker_health()}


async def _split_compute(client, swarm: LocalSwarm, prompt_tokens: list[int], new_tokens: int) -> dict:
    """What the split's hops compute for one decode token (``split_compute_ms``): the ring bound
    takes the unsplit model's C, and three hops may compute more than one model does."""
    before = await trio.to_thread.run_sync(_workers_compute_us, swarm)
    await client.generate_tokens(ALIAS, prompt_tokens, max_tokens=1)
    middle = await trio.to_thread.run_sync(_workers_compute_us, swarm)
    await client.generate_tokens(ALIAS, prompt_tokens, max_tokens=new_tokens)
    after = await trio.to_thread.run_sync(_workers_compute_us, swarm)
    prefill = {k: middle[k] - before.get(k, 0) for k in middle}
    whole = {k: after[k] - middle.get(k, 0) for k in after}
    return split_compute_ms(prefill, whole, new_tokens - 1)


def _rpc_once(lab: Lab, bench_bin: Path, model: Path, n: int, args: argparse.Namespace) -> dict:
    figure = run_llama_bench(
        bench_bin, model, args.prompt_tokens, args.new_tokens, args.threads, 1, rpc_args(lab, n),
        prefix=lab.argv_in("owner", []),
    )  # fmt: skip
    pp = figure["prefill_tps"]["median"]
    return {"decode_tps": figure["decode_tps"]["median"], "first_token_s": args.prompt_tokens / pp}


def _unsplit_once(lab: Lab, bench_bin: Path, model: Path, args: argparse.Namespace) -> dict:
    figure = run_llama_bench(
        bench_bin, model, args.prompt_tokens, args.new_tokens, args.threads, 1, prefix=lab.argv_in("owner", [])
    )
    pp = figure["prefill_tps"]["median"]
    return {"decode_tps": figure["decode_tps"]["median"], "first_token_s": args.prompt_tokens / pp}


async def _concurrent(client, prompt_tokens: list[int], new_tokens: int, sessions: int) -> dict:
    results: list = []

    async def one() -> None:
        results.append(await client.generate_tokens(ALIAS, prompt_tokens, max_tokens=new_tokens))

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(sessions):
            nursery.start_soon(one)
    wall_s = time.perf_counter() - started
    decode_s = max(r.decode_s for r in results)
    tokens = sum(r.decode_steps for r in results)
    return {"sessions": sessions, "wall_s": wall_s, "aggregate_decode_tps": tokens / decode_s if decode_s > 0 else 0.0,
            "per_session_decode_tps": [r.tokens_per_s for r in results]}  # fmt: skip


def _summary(values: Sequence[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


async def _start_baton(stack: contextlib.AsyncExitStack, lab: Lab, swarm: LocalSwarm, key: int | str):
    """Start a swarm's tracker and nodes (``key``: 2 or 3 splits, or ``LOCK_STEP``, a 3-split whose
    nodes run lock-step); its owner's client (in ``stack``) and route once the model is covered."""
    n = 3 if key == LOCK_STEP else int(key)
    extra = ["--max-sequences", str(CONCURRENT_SESSIONS)] + (["--decode-groups", "1"] if key == LOCK_STEP else [])
    await swarm.start_tracker()
    client = await stack.enter_async_context(
        open_swarm_client(swarm.tracker_addr, listen_addrs=lab.listen_addrs("owner"))
    )
    (entry,) = [m for m in await client.list_models() if m.alias == ALIAS]
    memory = node_memory_bytes(entry.n_layer, entry.bytes_per_block, n)
    for i in range(n):
        swarm.start_node(f"node-{i + 1}", memory, extra)
    route = await wait_for_coverage(client, swarm, ALIAS, timeout_s=COVERAGE_TIMEOUT_S)
    if len(route.hops) != n:
        raise RuntimeError(f"the {key} swarm offered a {len(route.hops)}-hop route")
    log(f"Baton {key}: " + " -> ".join(f"[{h.begin}, {h.end})" for h in route.hops))
    return client, route


async def measure(
    lab: Lab, swarms: dict[int, LocalSwarm], bench_bin: Path, model: Path, args: argparse.Namespace
) -> dict:
    """Everything after the lab's accuracy, inside the owner's machine (one trio run)."""
    async with contextlib.AsyncExitStack() as stack:
        clients, routes = {}, {}
        for key, swarm in swarms.items():
            clients[key], routes[key] = await _start_baton(stack, lab, swarm, key)
        _, prompt_tokens = await make_prompt(_Tokenizer(clients[3], routes[3]), args.prompt_tokens)
        for client in clients.values():  # warm: every hop's connections made, every worker paged in
            await _baton_once(client, prompt_tokens, 4)
        split = await _split_compute(clients[3], swarms[3], prompt_tokens, args.new_tokens)
        log("the 3-split's hops compute a decode token in " + " + ".join(f"{h['ms']:.2f}" for h in split["hops_ms"])
            + f" = {split['sum_ms']:.2f} ms")  # fmt: skip

        points = []
        for rtt_ms in args.rtts_ms:
            set_every_link(lab, LinkChange(delay_ms=rtt_ms / 2))
            measured_rtt = statistics.median(await trio.to_thread.run_sync(tcp_rtt_ms, lab, "owner", "n1", 20))
            one_way_s = measured_rtt / 2 / 1000
            turns: dict[str, list[dict]] = {name: [] for name in SYSTEMS}
            for turn in range(args.turns):
                order = SYSTEMS[turn % len(SYSTEMS) :] + SYSTEMS[: turn % len(SYSTEMS)]
                for name in order:
                    if name.startswith("baton_"):
                        figure = await _baton_once(
                            clients[int(name[-1])], prompt_tokens, args.new_tokens, sampled="sampled" in name
                        )
                    elif name.startswith("rpc_"):
                        figure = await trio.to_thread.run_sync(_rpc_once, lab, bench_bin, model, int(name[-1]), args)
                    else:
                        figure = await trio.to_thread.run_sync(_unsplit_once, lab, bench_bin, model, args)
                    turns[name].append(figure)
            compute_s = 1.0 / statistics.median(f["decode_tps"] for f in turns["unsplit"])
            prompt_compute_s = statistics.median(f["first_token_s"] for f in turns["unsplit"])
            point = {"rtt_ms": rtt_ms, "measured_rtt_ms": measured_rtt, "compute_ms": 1000 * compute_s,
                     "prompt_compute_ms": 1000 * prompt_compute_s, "systems": {}}  # fmt: skip
            for name, figures in turns.items():
                tps = _summary([f["decode_tps"] for f in figures])
                entry = {
                    "decode_tps": tps,
                    "first_token_s": _summary([f["first_token_s"] for f in figures]),
                    "turns": figures,
                }
                if name != "unsplit":
                    hops = int(name[-1])
                    entry["bound"] = ring_bounds(compute_s, prompt_compute_s, one_way_s, hops)
                    entry["where_time_goes"] = where_time_goes(tps["median"], compute_s, one_way_s, hops)
                    entry["of_bound"] = tps["median"] / entry["bound"]["decode_tps"]
                    if hops == 3 and split["sum_ms"] > 0:  # the bound with the split's own compute
                        entry["split_bound_tps"] = 1.0 / (split["sum_ms"] / 1000 + hops * one_way_s)
                        entry["of_split_bound"] = tps["median"] / entry["split_bound_tps"]
                point["systems"][name] = entry
            for n in (3, 2):
                point[f"baton_{n}_over_rpc_{n}"] = (
                    point["systems"][f"baton_{n}"]["decode_tps"]["median"]
                    / point["systems"][f"rpc_{n}"]["decode_tps"]["median"]
                )
            log(
                f"RTT {rtt_ms} ms (measured {measured_rtt:.2f}): "
                + ", ".join(f"{n} {point['systems'][n]['decode_tps']['median']:.1f} t/s" for n in SYSTEMS)
            )
            points.append(point)

        concurrency = await _sessions(lab, clients[3], clients[LOCK_STEP], prompt_tokens, args)
        return {"points": points, "concurrency": concurrency, "prompt_tokens": len(prompt_tokens),
                "split_compute": split}  # fmt: skip


async def _sessions(lab: Lab, groups, lock_step, prompt_tokens: list[int], args: argparse.Namespace) -> dict:
    """Section 3: one session, 8 in decode groups and 8 in lock-step, ``args.turns`` rounds."""
    set_every_link(lab, LinkChange(delay_ms=CONCURRENT_RTT_MS / 2))
    rounds = []
    for turn in range(args.turns):
        order = ("one", "groups", "lock_step") if turn % 2 == 0 else ("lock_step", "groups", "one")
        figures = {}
        for name in order:
            client, sessions = {"one": (groups, 1), "groups": (groups, CONCURRENT_SESSIONS),
                                "lock_step": (lock_step, CONCURRENT_SESSIONS)}[name]  # fmt: skip
            figures[name] = await _concurrent(client, prompt_tokens, args.new_tokens, sessions)
        rounds.append(figures)
        log(f"{CONCURRENT_SESSIONS} sessions at {CONCURRENT_RTT_MS:g} ms, round {turn + 1}: "
            + ", ".join(f"{k} {v['aggregate_decode_tps']:.1f} t/s" for k, v in figures.items()))  # fmt: skip

    def median_of(name: str) -> float:
        return statistics.median(r[name]["aggregate_decode_tps"] for r in rounds)

    return {
        "rtt_ms": CONCURRENT_RTT_MS, "sessions": CONCURRENT_SESSIONS, "rounds": rounds,
        "one_tps": median_of("one"), "groups_tps": median_of("groups"), "lock_step_tps": median_of("lock_step"),
        "groups_over_one": statistics.median(r["groups"]["aggregate_decode_tps"] / r["one"]["aggregate_decode_tps"] for r in rounds),
        "groups_over_lock_step": statistics.median(
            r["groups"]["aggregate_decode_tps"] / r["lock_step"]["aggregate_decode_tps"] for r in rounds
        ),
        "groups_ahead_rounds": sum(r["groups"]["aggregate_decode_tps"] > r["lock_step"]["aggregate_decode_tps"] for r in rounds),
    }  # fmt: skip


async def measure_sessions(lab: Lab, swarms: dict, args: argparse.Namespace) -> dict:
    """``--only sessions``: the two 3-split swarms and section 3 alone."""
    async with contextlib.AsyncExitStack() as stack:
        clients = {}
        routes = {}
        for key, swarm in swarms.items():
            clients[key], routes[key] = await _start_baton(stack, lab, swarm, key)
        _, prompt_tokens = await make_prompt(_Tokenizer(clients[3], routes[3]), args.prompt_tokens)
        for client in clients.values():
            await _baton_once(client, prompt_tokens, 4)
        return {"concurrency": await _sessions(lab, clients[3], clients[LOCK_STEP], prompt_tokens, args)}


async def open_owner_section(stack: contextlib.AsyncExitStack, lab: Lab, swarm: LocalSwarm, prompt_tokens: int):
    """The setup of a section run alone (``--only prefill``, ``prefill-chunks``, ``wire``), in
    the owner's machine: the tracker, the owner (a client there), three nodes of a third of the
    model each (2 sequences), the 3-hop route and a prompt of ``prompt_tokens`` tokens.
    Returns ``(client, route, prompt)``."""
    await swarm.start_tracker()
    client = await stack.enter_async_context(
        open_swarm_client(swarm.tracker_addr, listen_addrs=lab.listen_addrs("owner"))
    )
    (entry,) = [m for m in await client.list_models() if m.alias == ALIAS]
    memory = node_memory_bytes(entry.n_layer, entry.bytes_per_block, 3)
    for i in range(3):
        swarm.start_node(f"node-{i + 1}", memory, ["--max-sequences", "2"])
    route = await wait_for_coverage(client, swarm, ALIAS, timeout_s=COVERAGE_TIMEOUT_S)
    if len(route.hops) != 3:
        raise RuntimeError(f"the swarm offered a {len(route.hops)}-hop route")
    _, prompt = await make_prompt(_Tokenizer(client, route), prompt_tokens)
    return client, route, prompt


class _Tokenizer:
    """``make_prompt``'s tokenizer: the swarm's, through a route."""

    def __init__(self, client, route) -> None:
        self._client, self._route = client, route

    async def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        tokens, _stop = await self._client.tokenize(self._route, text, add_special=add_special)
        return tokens


# --- the report ---------------------------------------------------------------------------------


def markdown(report: dict) -> str:
    lines = [
        "# Baton across a WAN (the lab)",
        "",
        f"{report['machine']['cpu_model']}, {report['machine']['cores']} cores; every emulated machine shares them. "
        f"SmolLM2-135M Q4_1, {report['prompt_tokens']}-token prompt, {report['new_tokens']} tokens (greedy unless sampled), "
        f"{report['threads']} thread(s) per worker / rpc-server / llama-bench, {report['turns']} turns per RTT, "
        "systems in rotating order. Ratios are of medians of the same RTT's turns.",
        "",
        "## Single-session decode (tokens/s) and the ring bound",
        "",
        "| RTT ms (measured) | " + " | ".join(LABELS[s] for s in SYSTEMS) + " | Baton 3 / RPC 3 | Baton 2 / RPC 2 |",
        "|---|" + "---|" * (len(SYSTEMS) + 2),
    ]
    for p in report["points"]:
        cells = []
        for s in SYSTEMS:
            e = p["systems"][s]
            cell = f"{e['decode_tps']['median']:.1f}"
            if "bound" in e and s.startswith("baton"):
                cell += f" (bound {e['bound']['decode_tps']:.1f}, {e['of_bound']:.2f}x)"
            elif "bound" in e:
                cell += f" (bound {e['bound']['rpc_decode_tps']:.1f})"
            cells.append(cell)
        lines.append(
            f"| {p['rtt_ms']:g} ({p['measured_rtt_ms']:.2f}) | "
            + " | ".join(cells)
            + f" | {p['baton_3_over_rpc_3']:.2f}x | {p['baton_2_over_rpc_2']:.2f}x |"
        )
    lines += [
        "",
        "Ring bound: Baton S-split decodes at best one token per C + S x one-way delay (C: the unsplit",
        "model's decode step, llama-bench in the same turns); RPC's is C + S x RTT.",
    ]
    if "split_compute" in report:
        split = report["split_compute"]
        c0 = report["points"][0]["compute_ms"]
        hops = " + ".join(f"{h['ms']:.2f}" for h in split["hops_ms"])
        at = ", ".join(
            f"{p['rtt_ms']:g} ms {s['of_split_bound']:.2f}x"
            for p in report["points"] if "of_split_bound" in (s := p["systems"]["baton_3"])
        )  # fmt: skip
        lines += [
            "",
            f"The 3-split's own compute (its workers' data-plane compute over {report['new_tokens'] - 1} decode "
            "steps, measured once before the RTTs): "
            f"{hops} = {split['sum_ms']:.2f} ms a token, {split['sum_ms'] / c0:.2f}x the unsplit C of "
            f"{c0:.2f} ms. The 3-split against a ring bound with that compute in place of C: {at}.",
        ]
    lines += [
        "",
        "## Time to first token (s)",
        "",
        "| RTT ms | " + " | ".join(LABELS[s] for s in SYSTEMS) + " |",
        "|---|" + "---|" * len(SYSTEMS),
    ]
    for p in report["points"]:
        cells = []
        for s in SYSTEMS:
            e = p["systems"][s]
            cell = f"{e['first_token_s']['median']:.3f}"
            if "bound" in e and s.startswith("baton"):
                cell += f" (bound {e['bound']['first_token_s']:.3f})"
            cells.append(cell)
        lines.append(f"| {p['rtt_ms']:g} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "RPC's and the unsplit model's first token: llama-bench's prefill time of the prompt.",
        "",
        "## Where a Baton decode token's time goes (ms, medians)",
        "",
        "| RTT ms | split | token | compute | links (S x one way) | rest |",
        "|---|---|---|---|---|---|",
    ]
    for p in report["points"]:
        for s in ("baton_3", "baton_2"):
            w = p["systems"][s]["where_time_goes"]
            lines.append(
                f"| {p['rtt_ms']:g} | {s[-1]} | {w['token_ms']:.1f} | {w['compute_ms']:.1f} | {w['links_ms']:.1f} | {w['rest_ms']:.1f} |"
            )
    lines += ["", *sessions_markdown(report["concurrency"])]
    lines += [
        "",
        "## The lab's accuracy",
        "",
        "| configured RTT ms | measured median | min | max | within 10 % + 0.3 ms |",
        "|---|---|---|---|---|",
    ]
    acc = report["accuracy"]
    for r in acc["rtt"]:
        lines.append(
            f"| {r['configured_ms']:g} | {r['median_ms']:.3f} | {r['min_ms']:.3f} | {r['max_ms']:.3f} | {'yes' if r['within'] else 'NO'} |"
        )
    lines += ["", "| configured loss % | measured | within 1 point |", "|---|---|---|"]
    for r in acc["loss"]:
        lines.append(f"| {r['configured_pct']:g} | {r['measured_pct']:.2f} | {'yes' if r['within'] else 'NO'} |")
    lines += ["", "| configured rate Mbit/s | TCP payload Mbit/s | ratio | within 10 % |", "|---|---|---|---|"]
    for r in acc["rate"]:
        lines.append(
            f"| {r['configured_mbit']:g} | {r['tcp_payload_mbit']:.2f} | {r['ratio']:.3f} | {'yes' if r['within'] else 'NO'} |"
        )
    f = acc["forwarder"]
    lines += [
        "",
        f"The forwarder's own cost over the accuracy runs: {f['cpu_s']:.2f} s of CPU for {f['packets']} packets, "
        f"{f['cpu_us_per_packet']:.1f} µs a packet (read from one TUN, scheduled, written to another).",
        "",
    ]
    return "\n".join(lines)


def sessions_markdown(c: dict) -> list[str]:
    lines = [f"## {c['sessions']} concurrent sessions at {c['rtt_ms']:g} ms (Baton 3-split)", ""]
    if "measured_at" in c:
        lines += [
            f"Measured {c['measured_at']} (`--only sessions`), {c['machine']['cpu_model']}, {c['machine']['cores']} cores.",
            "",
        ]
    lines += [
        "| round | one session t/s | 8 in decode groups t/s | 8 in lock-step t/s | groups / one | groups / lock-step |",
        "|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(c["rounds"], 1):
        one, groups, lock = (r[k]["aggregate_decode_tps"] for k in ("one", "groups", "lock_step"))
        lines.append(f"| {i} | {one:.1f} | {groups:.1f} | {lock:.1f} | {groups / one:.2f}x | {groups / lock:.2f}x |")
    lines += [
        "",
        f"Medians: {c['sessions']} sessions in decode groups **{c['groups_over_one']:.2f}x** one session; decode groups "
        f"**{c['groups_over_lock_step']:.2f}x** lock-step (ahead in {c['groups_ahead_rounds']} of {len(c['rounds'])} rounds).",
    ]
    return lines


def chart(report: dict) -> bytes:
    """Milliseconds per decode token against RTT: each system, and Baton's ring bounds."""
    import io

    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    rtts = [p["rtt_ms"] for p in report["points"]]
    styles = {"baton_3": ("tab:blue", "-"), "baton_sampled_3": ("tab:purple", "-."), "baton_2": ("tab:cyan", "-"),
              "rpc_3": ("tab:orange", "-"),
              "rpc_2": ("tab:red", "-"), "unsplit": ("grey", ":")}  # fmt: skip
    for s in SYSTEMS:
        colour, line = styles[s]
        ms = [1000 / p["systems"][s]["decode_tps"]["median"] for p in report["points"]]
        ax.plot(rtts, ms, line, marker="o", color=colour, label=LABELS[s])
    for s in ("baton_3", "baton_2"):
        colour, _ = styles[s]
        bound = [1000 / p["systems"][s]["bound"]["decode_tps"] for p in report["points"]]
        ax.plot(rtts, bound, "--", color=colour, alpha=0.6, label=f"{LABELS[s]}: ring bound")
    ax.set_xlabel("round trip between every pair of machines (ms)")
    ax.set_ylabel("ms per decode token, one session (lower is faster)")
    ax.set_title("SmolLM2-135M across emulated machines")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def baton_swarms(
    lab: Lab, stack: contextlib.ExitStack, model: Path, workdir: Path, args: argparse.Namespace, keys
) -> dict:
    """The Baton swarms (not started), closed with ``stack``: 3 and 2 splits, and ``LOCK_STEP``."""
    swarms = {}
    for key in keys:
        n = 3 if key == LOCK_STEP else key
        machines = {"tracker": "tracker", **{f"node-{i + 1}": NODES[i] for i in range(n)}}
        config = LocalSwarmConfig(
            model_path=model, model_alias=ALIAS, threads=args.threads, placement=Placement(lab, machines)
        )
        swarms[key] = LocalSwarm(config, workdir / f"swarm-{key}".replace(" ", "-"))
        stack.callback(swarms[key].close_nowait)
    return swarms


def main_sessions(args: argparse.Namespace) -> int:
    """``--only sessions``: section 3 alone, put into the report already in ``--out``."""
    import tempfile

    model = model_path(ALIAS)
    topology = Topology(tuple(MachineSpec(m) for m in MACHINES), LinkSpec())
    with running_lab(topology, "wan") as lab, contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="baton-wan-")))
        swarms = baton_swarms(lab, stack, model, workdir, args, (3, LOCK_STEP))
        section = lab.trio_run_in("owner", measure_sessions, lab, swarms, args)["concurrency"]
    stamped(section)
    print("\n".join(sessions_markdown(section)))
    if args.out is not None:
        report = json.loads((args.out / "wan.json").read_text())
        report["concurrency"] = section
        publish(args.out, "wan", report, markdown(report))
    return 0


def run_owner_section(args: argparse.Namespace, name: str, title: str, measure, markdown) -> int:
    """A section run alone on a 3-split swarm in the lab (``--only prefill``, ``--only wire``):
    ``measure(lab, swarm, wan, args)`` inside the owner's machine, its report printed by
    ``markdown(section)`` (lines) and written as ``name.{json,md}`` under ``--out``."""
    import sys
    import tempfile

    topology = Topology(tuple(MachineSpec(m) for m in MACHINES), LinkSpec())
    with running_lab(topology, "wan") as lab, contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"baton-{name}-")))
        (swarm,) = baton_swarms(lab, stack, model_path(ALIAS), workdir, args, (3,)).values()
        section = lab.trio_run_in("owner", measure, lab, swarm, sys.modules[__name__], args)
    stamped(section)
    lines = markdown(section)
    print("\n".join(lines))
    publish(args.out, name, section, "\n".join([f"# Baton across a WAN (the lab): {title}", "", *lines]))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rtts-ms", default="0,10,20,50", help="round trips to measure at, ms (default 0,10,20,50)")
    parser.add_argument("--turns", type=int, default=3, help="turns per RTT, one run of each system a turn (default 3)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated a run (default 32)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt length in tokens (default 64)")
    parser.add_argument(
        "--threads", type=int, default=1, help="threads per worker, rpc-server and llama-bench (default 1)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="RTTs 0 and 20, one turn, a short accuracy run (a smoke test)"
    )
    parser.add_argument(
        "--only",
        choices=("sessions", "prefill", "prefill-chunks", "wire", "speculation"),
        help="measure one section alone (sessions: the 8 concurrent sessions, replacing it in --out's wan.json;"
        " prefill: time to first token of a long prompt, pipelined or not, as wan_prefill.json;"
        " prefill-chunks: that prompt's time to first token by chunk size, as wan_prefill_chunks.json;"
        " wire: that prompt's time to first token with f32, f16 and q8 boundaries on slow links, as wan_wire.json;"
        " speculation: 256 greedy tokens with and without speculative decoding, as wan_speculation.json)",
    )
    parser.add_argument(
        "--wire-rate-mbit", type=float, default=20.0, help="--only wire: every link's rate in Mbit/s (default 20)"
    )
    parser.add_argument(
        "--prefill-tokens", type=int, default=1500, help="--only prefill: prompt length in tokens (default 1500)"
    )
    parser.add_argument(
        "--prefill-chunk-rows",
        dest="chunk_rows",
        type=int,
        default=128,
        help="--only prefill: rows of a prompt chunk (default 128)",
    )
    parser.add_argument(
        "--chunk-sweep",
        default="64,128,256,512",
        help="--only prefill-chunks: the chunk sizes measured, rows, comma-separated (default 64,128,256,512)",
    )
    parser.add_argument(
        "--prefill-rtt-ms", type=float, default=20.0, help="--only prefill: round trip between machines (default 20)"
    )
    parser.add_argument("--out", type=Path, help="write wan.{json,md,png} here (default: print only)")
    args = parser.parse_args()
    if args.only == "sessions":
        return main_sessions(args)
    if args.only == "prefill":
        import wan_prefill

        return run_owner_section(
            args, "wan_prefill", "prefill", wan_prefill.measure_prefill, wan_prefill.prefill_markdown
        )
    if args.only == "prefill-chunks":
        import wan_prefill_chunks

        return run_owner_section(
            args, "wan_prefill_chunks", "prefill by chunk size", wan_prefill_chunks.measure_chunks,
            wan_prefill_chunks.chunks_markdown,
        )  # fmt: skip
    if args.only == "speculation":
        import wan_speculation

        return run_owner_section(
            args, "wan_speculation", "speculative decoding", wan_speculation.measure_speculation,
            wan_speculation.speculation_markdown,
        )  # fmt: skip
    if args.only == "wire":
        import wan_wire

        return run_owner_section(
            args, "wan_wire", "boundaries sized for the link", wan_wire.measure_wire, wan_wire.wire_markdown
        )
    args.rtts_ms = [float(x) for x in args.rtts_ms.split(",")]
    if args.quick:
        args.rtts_ms, args.turns = [0.0, 20.0], 1
    started = time.perf_counter()
    bench_bin, rpc_bin, build_s = ensure_llama_tools()
    model = model_path(ALIAS)
    report: dict = {"machine": machine_info(), "tools_build_s": build_s, "new_tokens": args.new_tokens,
                    "threads": args.threads, "turns": args.turns}  # fmt: skip
    topology = Topology(tuple(MachineSpec(m) for m in MACHINES), LinkSpec())
    with running_lab(topology, "wan") as lab, contextlib.ExitStack() as stack:
        import tempfile

        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="baton-wan-")))
        log("the lab's accuracy")
        report["accuracy"] = lab_accuracy(lab, args.quick)
        stack.enter_context(rpc_servers_in(lab, rpc_bin, args.threads, workdir))
        swarms = baton_swarms(lab, stack, model, workdir, args, (3, 2, LOCK_STEP))
        report.update(lab.trio_run_in("owner", measure, lab, swarms, bench_bin, model, args))
    report["wall_time_s"] = time.perf_counter() - started
    md = markdown(report)
    publish(args.out, "wan", report, md)
    if args.out is not None:
        try:
            (args.out / "wan.png").write_bytes(chart(report))
        except ImportError:
            log("no matplotlib: wan.png not drawn (pip install -e '.[bench]')")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
