"""What a gap before a step costs on this machine: the same work, timed back to back and after
an idle (or busy) gap as long as a hop waits for its turn on a route.

Owns one command. A hop of a split route waits between two of its decode steps while the other
hops compute (about 10 ms of a 3-split's 15 ms step on the benchmark machine); the owner waits
the whole step. Tight loops (``bench/hop_floor.py``) time the same code with no gap. This
measures what the gap itself costs, for both kinds of code on a hop's path:

- **the owner's Python**: what ``agent.io.client`` does when a decode step's RESULT arrives,
  with no socket in the way: read the frame (``DataFrameReader``), open it
  (``OwnerSession.open_result``), take its top-40 (``Session.receive_scores``: the checks and
  the greedy choice), and seal the next STEP (``data_step``, ``OwnerSession.step_frame``);
- **a range's Forward**: ``baton-shard-bench --begin 10 --end 20 --top-k 40`` (the worker's
  model code, the middle range of a 3-split, boundary rows in), ``--gap-us G`` before each
  decode step.

Each after a gap of G ms spent asleep (the core idles, as a waiting hop's does) or spinning on
the clock (the core stays busy with this process: what remains is what the gap costs whatever
the core does meanwhile). The gaps are interleaved in rounds, so the machine's drift falls on
all of them alike. Writes ``gap_cost.json`` and ``gap_cost.md`` under ``--out``. Run it alone.

Usage: ``.venv/bin/python bench/gap_cost.py [--rounds 3] [--out bench/results]`` (about two
minutes; ``make native`` first).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from _bootstrap import REPO_ROOT  # first: it makes the project importable

import numpy as np  # noqa: E402

from agent._proto import worker_pb2  # noqa: E402
from agent.core import data_frames  # noqa: E402
from agent.core.data_frames import DataFrameReader, OwnerSession, SessionKeys  # noqa: E402
from agent.core.data_route import data_step, result_scores  # noqa: E402
from agent.core.session import Session  # noqa: E402
from agent.core.topk import select_top_k  # noqa: E402
from compare import machine_info  # noqa: E402
from results_io import publish  # noqa: E402

SHARD_BENCH = REPO_ROOT / "build" / "native" / "baton-shard-bench"
ALIAS = "smollm2"
TOP_K = 40
GAPS_MS = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0)
FORWARD_GAPS_MS = (0.0, 1.0, 2.0, 4.0, 8.0, 15.0)
MODES = ("sleep", "spin")
PYTHON_STEPS = 150  # owner steps timed per (gap, mode) and round
RANGE = (10, 20)
HOP_TARGET_MS = 0.3  # issue 8's per-hop overhead


def _spin(seconds: float) -> None:
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


class OwnerSteps:
    """The owner's work on a RESULT's arrival, for one long greedy session, with RESULT frames
    made ahead as a last worker would seal them (sampled rows of a 49,152-token vocabulary)."""

    def __init__(self, n_frames: int) -> None:
        keys = SessionKeys.new(os.urandom)
        self.owner = OwnerSession(keys)
        self.reader = DataFrameReader(1 << 20)
        self.session = Session(keys.session_id, [1, 2, 3], max_new_tokens=1 << 30, route_peer_ids=["a", "b", "c"])
        self.session.next_step()
        rng = np.random.default_rng(3)
        self.frames: list[bytes] = []
        for step in range(n_frames):
            ids, top, lse = select_top_k(rng.standard_normal(49152).astype(np.float32), TOP_K)
            result = worker_pb2.DataResult(
                step=step, n_vocab=49152, top_k=TOP_K, top_token_ids=ids.astype("<i4").tobytes(),
                top_logits=top.astype("<f4").tobytes(), log_sum_exp=lse,
            )  # fmt: skip
            self.frames.append(
                data_frames.sealed_frame(
                    data_frames.RESULT, keys.return_key, keys.session_id, step + 1, result.SerializeToString()
                )
            )  # fmt: skip
        self.taken = 0

    def step(self) -> bytes:
        """One RESULT taken and the next STEP sealed: what the owner does between the two."""
        self.reader.feed(self.frames[self.taken])
        frame = self.reader.next_frame()
        assert frame is not None
        result = self.owner.open_result(frame)
        self.session.receive_scores(result.step, lambda: result_scores(result), int(result.n_vocab), "c")
        self.taken += 1
        step_input = self.session.next_step()
        return self.owner.step_frame(
            data_step(step_input.step, step_input.positions, step_input.token_ids, self.session.result_top_k)
        )


def python_round(owner: OwnerSteps, steps: int) -> dict[str, dict[str, float]]:
    """Median us of one owner step per gap and mode, the gaps interleaved."""
    times: dict[str, dict[str, list[float]]] = {m: {str(g): [] for g in GAPS_MS if g or m == "sleep"} for m in MODES}
    waits: dict[str, Callable[[float], None]] = {"sleep": time.sleep, "spin": _spin}
    for _ in range(steps):
        for gap in GAPS_MS:
            for mode in MODES if gap else ("sleep",):  # (no gap: one figure, whatever the mode)
                if gap:
                    waits[mode](gap / 1000)
                started = time.perf_counter()
                owner.step()
                times[mode][str(gap)].append(1e6 * (time.perf_counter() - started))
    return {m: {g: statistics.median(v) for g, v in by_gap.items()} for m, by_gap in times.items()}


def forward_ms(model: Path, gap_ms: float, mode: str, steps: int) -> float:
    argv = [
        str(SHARD_BENCH), str(model), "--begin", str(RANGE[0]), "--end", str(RANGE[1]), "--top-k", str(TOP_K),
        "--steps", str(steps), "--reps", "2", "--gap-us", str(int(gap_ms * 1000)), "--gap-spin", str(int(mode == "spin")),
    ]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=300).stdout
    return statistics.median(run["decode_ms"] for run in json.loads(out)["runs"])


def forward_round(model: Path, steps: int) -> dict[str, dict[str, float]]:
    return {
        mode: {str(g): forward_ms(model, g, mode, steps) for g in FORWARD_GAPS_MS if g or mode == "sleep"}
        for mode in MODES
    }


def summarize(python_rounds: list[dict], forward_rounds: list[dict]) -> dict:
    """Per kind, mode and gap: the median over rounds, and its ratio to the back-to-back (gap
    0) figure of the same round (medians of those ratios). A spin of 0 is the sleep of 0."""

    def fold(rounds: list[dict]) -> dict:
        out: dict[str, dict[str, dict[str, float]]] = {}
        for mode in MODES:
            gaps = sorted({g for r in rounds for g in r[mode]} | {"0.0"}, key=float)
            out[mode] = {}
            for g in gaps:
                values = [r[mode].get(g, r["sleep"]["0.0"]) for r in rounds]
                ratios = [v / r["sleep"]["0.0"] for v, r in zip(values, rounds, strict=True)]
                out[mode][g] = {"value": statistics.median(values), "ratio": statistics.median(ratios)}
        return out

    return {"owner_step_us": fold(python_rounds), "forward_ms": fold(forward_rounds)}


def markdown(report: dict) -> str:
    m, s = report["machine"], report["summary"]
    lines = [
        "# What a gap before a step costs (`bench/gap_cost.py`)",
        "",
        f"Machine: {m['cpu_model']}, {m['cores']} cores, {m['platform']}; Baton `{m.get('baton_commit', '?')}`; "
        f"{report['rounds']} rounds, the gaps interleaved; medians over rounds, ratios to the same round's "
        "back-to-back figure. Asleep: the process blocks for the gap (its core idles); spinning: it spins on the "
        "clock for the gap (its core never idles).",
        "",
        f"## The owner's Python on a RESULT's arrival (us; {report['python_steps']} steps a gap and round)",
        "",
        "Read the frame, open it, take the top-40 (`Session.receive_scores`), seal the next STEP: "
        "`agent.io.client`'s work between a decode step's RESULT and its next STEP, without the sockets.",
        "",
        *_table(s["owner_step_us"], "us", 1),
        "",
        f"## A range's Forward (ms a decode step; `baton-shard-bench --begin {RANGE[0]} --end {RANGE[1]} "
        f"--top-k {TOP_K}`, 1 thread)",
        "",
        *_table(s["forward_ms"], "ms", 3),
        "",
        *_reading(s),
    ]
    return "\n".join(lines)


def _reading(s: dict) -> list[str]:
    """What the two tables say about a hop, computed from them (the two longest gaps measured,
    which bracket what a hop of a 3-split waits here)."""
    forward = s["forward_ms"]
    shorter, longest = sorted(forward["sleep"], key=float)[-2:]
    base_ms = forward["sleep"]["0.0"]["value"]

    def extra(mode: str, gap: str) -> float:
        return forward[mode][gap]["value"] - base_ms

    owner = s["owner_step_us"]
    owner_gap = max(owner["sleep"], key=float)
    return [
        f"After a gap of {float(shorter):g} ms, a range's Forward takes {extra('sleep', shorter):+.3f} ms against back to "
        f"back ({extra('spin', shorter):+.3f} ms when the process spun through the gap); after {float(longest):g} ms, "
        f"{extra('sleep', longest):+.3f} ms ({extra('spin', longest):+.3f} ms spinning). The owner's work takes "
        f"{owner['sleep'][owner_gap]['ratio']:.2f}x ({owner['spin'][owner_gap]['ratio']:.2f}x spinning) after "
        f"{float(owner_gap):g} ms. A hop of a 3-split route waits about 10 ms of every 15 ms decode step here for "
        "its turn (the other hops compute meanwhile), where a whole-model worker's Forwards follow each other: on "
        f"this machine the gap alone costs a hop {extra('sleep', shorter) / HOP_TARGET_MS:.1f}-"
        f"{extra('sleep', longest) / HOP_TARGET_MS:.1f}x issue 8's whole per-hop target of {HOP_TARGET_MS} ms. "
        "It is not the idle core waking up: a process that kept its core busy through the gap loses much of it "
        "too, so whatever runs elsewhere meanwhile (on this VM, the host) evicts what the step's code and data "
        "had in the caches. A loop that times the same code back to back (`bench/hop_floor.py`) does not see it.",
        "",
    ]


def _table(folded: dict, unit: str, digits: int) -> list[str]:
    gaps = sorted({g for mode in folded.values() for g in mode}, key=float)
    rows = ["| gap ms | " + " | ".join(f"{mode} ({unit})" for mode in MODES) + " |", "|---" * (len(MODES) + 1) + "|"]
    for g in gaps:
        cells = []
        for mode in MODES:
            cell = folded[mode].get(g)
            cells.append("" if cell is None else f"{cell['value']:.{digits}f} ({cell['ratio']:.2f}x)")
        rows.append(f"| {float(g):g} | " + " | ".join(cells) + " |")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--forward-steps", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None, help="where gap_cost.{json,md} go (default: print only)")
    args = parser.parse_args()
    if args.rounds < 1 or args.forward_steps < 1:
        parser.error("--rounds and --forward-steps must be at least 1")
    if not SHARD_BENCH.exists():
        parser.error(f"{SHARD_BENCH} is missing: run `make native` first")

    from agent.models import model_path

    model = model_path(ALIAS)
    started = time.monotonic()
    owner = OwnerSteps(args.rounds * PYTHON_STEPS * len(GAPS_MS) * len(MODES))
    python_rounds, forward_rounds = [], []
    for r in range(args.rounds):
        python_rounds.append(python_round(owner, PYTHON_STEPS))
        forward_rounds.append(forward_round(model, args.forward_steps))
        print(f"round {r + 1}/{args.rounds}: {json.dumps(python_rounds[-1])} {json.dumps(forward_rounds[-1])}", file=sys.stderr)
    report = {
        "benchmark": "gap_cost",
        "machine": machine_info(),
        "rounds": args.rounds,
        "python_steps": PYTHON_STEPS,
        "forward_steps": args.forward_steps,
        "python_rounds": python_rounds,
        "forward_rounds": forward_rounds,
        "summary": summarize(python_rounds, forward_rounds),
        "wall_time_s": time.monotonic() - started,
    }
    publish(args.out, "gap_cost", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
