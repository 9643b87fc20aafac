"""How little a hop could cost on this machine: the floor under issue 8's per-hop target.

Owns one command. Baton's per-hop overhead (``bench/compare.py``: the 3-split decode step
minus the unsplit one, over 3 hops) adds up three things: cutting the model (each range is its
own Forward and graph), moving the boundary (sockets, waking the next process) and the Python
of each node agent. This measures the first two with no Python in the way, so that what is
left is known to be Python's:

- **Cutting the model**: ``baton-shard-bench --split 3`` (the worker's own model code, no
  gRPC, no Python) holds the whole model and the three ranges of an even split in one
  process and decodes the same tokens with both, step by step in turn: the whole model's
  Forward, then the ranges' in series, each given the one before's boundary rows (the last
  range's top-40 checked equal to the whole model's). Per step, the difference over 3 hops;
  timed step by step because this VM's speed drifts more between two runs than the
  difference is.
- **Moving the boundary**: ``baton-ping-pong`` (``bench/native/ping_pong.cpp``): one boundary
  row (n_embd f32 values) between two processes that block in ``read()``, as an idle hop
  does, over a socketpair and over loopback TCP: half a round trip is one message, waking its
  reader included. TLS is not in it: AES-GCM seals 2.3 KB in about a microsecond here
  (``openssl speed -evp aes-256-gcm``: 2.9 GB/s at 16 KB).

A native data plane (each hop's worker writing its boundary to the next hop's worker, the
node agents only steering) would pay about the sum per hop. Writes ``hop_floor.json`` and
``hop_floor.md`` under ``--out``. Run it alone on the machine.

Usage: ``.venv/bin/python bench/hop_floor.py [--reps 5] [--steps 64] [--out bench/results]``
(about 40 s; ``make native`` first).
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

from compare import machine_info  # noqa: E402
from results_io import publish  # noqa: E402

BUILD = REPO_ROOT / "build" / "native"
SHARD_BENCH = BUILD / "baton-shard-bench"
PING_PONG = BUILD / "baton-ping-pong"
ALIAS = "smollm2"
HOPS = 3
TOP_K = 40  # what a swarm's last hop asks its worker for, with greedy decoding
TARGET_MS = 0.3  # issue 8: per-hop overhead


def summarize(reps: list[dict], messages: dict[str, list[float]]) -> dict:
    """Per rep, what cutting the model costs a hop (the median of the per-step differences
    split - whole, over the hops); their median; the median one-way message per mode; the
    floor per hop (that split cost + the median TCP message) against the target."""
    costs = [rep["difference_ms_median"] / HOPS for rep in reps]
    one_way_ms = {mode: statistics.median(values) / 1000 for mode, values in messages.items()}
    split_ms = statistics.median(costs)
    floor_ms = split_ms + one_way_ms["tcp"]
    return {
        "split_cost_per_hop_ms": costs,
        "split_cost_per_hop_ms_median": split_ms,
        "whole_ms_median": statistics.median(rep["whole_decode_ms"] for rep in reps),
        "split_ms_median": statistics.median(rep["split_decode_ms"] for rep in reps),
        "one_way_message_ms": one_way_ms,
        "floor_per_hop_ms": floor_ms,
        "target_ms": TARGET_MS,
        "floor_under_target": floor_ms <= TARGET_MS,
    }


def _split_runs(model: Path, steps: int, reps: int) -> dict:
    argv = [str(SHARD_BENCH), str(model), "--split", str(HOPS), "--top-k", str(TOP_K), "--steps", str(steps),
            "--reps", str(reps)]  # fmt: skip
    return json.loads(subprocess.run(argv, capture_output=True, text=True, check=True, timeout=900).stdout)


def _one_way_us(mode: str, n_bytes: int) -> float:
    argv = [str(PING_PONG), mode, "--bytes", str(n_bytes), "--round-trips", "20000"]
    return json.loads(subprocess.run(argv, capture_output=True, text=True, check=True, timeout=300).stdout)["one_way_us"]


def markdown(report: dict) -> str:
    s, machine, method = report["summary"], report["machine"], report["method"]
    baton = report.get("baton_per_hop_ms")
    lines = [
        "# The floor under a hop (`bench/hop_floor.py`)",
        "",
        (
            f"Machine: {machine.get('cpu_model', '?')}, {machine.get('cores', '?')} cores, {machine.get('platform', '?')}. "
            f"Model `{method['model']}` ({method['n_layer']} blocks), 1 thread; the whole model against the ranges "
            f"{method['ranges']} in series (`baton-shard-bench --split {HOPS}`), {method['steps']} decode steps after a "
            f"64-token prompt, {method['reps']} reps after a warm-up; the last range's top-{TOP_K} equal to the whole "
            f"model's at every step: {'yes' if method['top_k_equal'] else '**no**'}. Boundary row "
            f"{method['boundary_bytes']} bytes."
        ),
        "",
        "| part of a hop | ms |",
        "|---|---|",
        (
            f"| cutting the model: per step, ranges in series - whole model, / {HOPS} (median of steps; median of reps) "
            f"| {s['split_cost_per_hop_ms_median']:.3f} |"
        ),
        f"| one message, socketpair (a node and its worker) | {s['one_way_message_ms']['unix']:.3f} |",
        f"| one message, loopback TCP (hop to hop) | {s['one_way_message_ms']['tcp']:.3f} |",
        f"| **floor per hop** (cutting + one TCP message) | **{s['floor_per_hop_ms']:.3f}** |",
        f"| issue 8's target | {s['target_ms']:.3f} |",
    ]
    if baton is not None:
        lines.append(f"| Baton's per-hop overhead in `bench/results/compare.json` (its run, not this one) | {baton:.3f} |")
    lines += [
        "",
        (
            f"Decode step, medians of reps: whole model {s['whole_ms_median']:.2f} ms, the ranges in series "
            f"{s['split_ms_median']:.2f} ms; cutting cost per hop by rep: "
            + ", ".join(f"{cost:.3f}" for cost in s["split_cost_per_hop_ms"])
            + " ms."
        ),
        "",
        (
            "So the target is within reach of a hop with no Python in it: the model cuts for almost "
            "nothing, and a message costs tens of microseconds (a real worker adds its per-message "
            "work on top: reading and checking a frame, answering). What a hop adds beyond the floor "
            "is the node agents' Python (about a millisecond of CPU a node a step) and the wake-ups "
            "of the processes it takes; a hop of ~0.3 ms needs the boundary to go from worker to worker."
            if s["floor_under_target"]
            else "So the target is below even a hop with no Python in it: cutting the model and one "
            "message already cost more here, and no data plane can meet it on this machine."
        ),
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None, help="where hop_floor.{json,md} go (default: print only)")
    args = parser.parse_args()
    if args.reps < 1 or args.steps < 1:
        parser.error("--reps and --steps must be at least 1")
    for tool in (SHARD_BENCH, PING_PONG):
        if not tool.exists():
            parser.error(f"{tool} is missing: run `make native` first")

    from agent.io.tracker.gguf_info import read_gguf_facts
    from agent.models import model_path

    model = model_path(ALIAS)
    facts = read_gguf_facts(model)
    started = time.monotonic()
    split = _split_runs(model, args.steps, args.reps)
    boundary_bytes = facts.n_embd * 4
    messages = {mode: [_one_way_us(mode, boundary_bytes) for _ in range(3)] for mode in ("unix", "tcp")}
    baton = None
    compare_json = REPO_ROOT / "bench" / "results" / "compare.json"
    if compare_json.exists():
        for figure in json.loads(compare_json.read_text()).get("headline", []):
            if figure["name"].startswith("Baton 3-split per-hop overhead (ms, issue 8)"):
                baton = figure["value"]
    report = {
        "benchmark": "hop_floor",
        "machine": machine_info(),
        "method": {
            "model": model.name, "n_layer": facts.n_layer,
            "ranges": [tuple(r) for r in split["ranges"]],  # as baton-shard-bench cut them
            "reps": args.reps, "steps": args.steps, "boundary_bytes": boundary_bytes, "threads": 1,
            "top_k_equal": split["top_k_equal"],
        },  # fmt: skip
        "split_runs": split["runs"],
        "one_way_message_us": messages,
        "summary": summarize(split["runs"], messages),
        "baton_per_hop_ms": baton,
        "wall_time_s": time.monotonic() - started,
    }
    publish(args.out, "hop_floor", report, markdown(report))
    return 0 if split["top_k_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
