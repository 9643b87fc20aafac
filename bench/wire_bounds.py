"""The lossy wire dtypes' logit error over prompt lengths: what ``WIRE_LOGIT_BOUNDS``
(``agent.core.wire.boundary``) is declared from.

For SmolLM2 (cut at blocks 10 and 20) and Gemma-3 (4 and 11), three worker processes with the
boundary rows crossing each cut in F16S or Q8 (encoded, then decoded as the next hop does:
``agent.harness.parity_run.run_parity``) against one unsplit worker, one prompt of each of
``--lengths`` tokens (cut from the parity prompt text), ``--steps`` greedy steps: the max
|logit difference| over the prompt's last row and every step's row, and the declared bound
beside it. Numerics, not speed: the figures do not depend on what else runs, but it takes a few
minutes of every core.

Usage: ``.venv/bin/python bench/wire_bounds.py [--lengths 40,250,500,1000,1500,2000] [--steps 32]
[--out bench/results]`` (about 4 minutes on 2 cores); writes ``wire_bounds.{json,md}``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import _bootstrap  # noqa: F401  (first: it makes the project importable)
import trio
from common import log, publish, stamped

from agent.core.wire.boundary import WIRE_LOGIT_BOUNDS, WireDType
from agent.harness.parity_run import run_parity
from agent.models import model_path

CUTS = {"smollm2": [10, 20], "gemma3": [4, 11]}
WIRES = (WireDType.F16S, WireDType.Q8)


async def measure(lengths: list[int], steps: int) -> dict:
    rows = []
    for name, cuts in CUTS.items():
        for tokens in lengths:
            for wire in WIRES:
                report = await run_parity(
                    model_path(name), cuts, sequences=1, steps=steps, prompt_tokens=tokens, boundary_dtype=wire,
                    tolerance=float("inf"), ctx_size=tokens + steps + 16,
                )  # fmt: skip
                rows.append({"model": name, "prompt_tokens": tokens, "wire": wire.name,
                             "max_abs_diff": report.max_abs_diff, "step_max_abs_diff": report.step_max_abs_diff})  # fmt: skip
                log(f"{name} {tokens} tokens {wire.name}: max |logit diff| {report.max_abs_diff:.3f}")
    return {"steps": steps, "lengths": lengths, "rows": rows,
            "bounds": {WireDType(w).name: b for w, b in WIRE_LOGIT_BOUNDS.items()}}  # fmt: skip


def markdown(report: dict) -> str:
    lengths = report["lengths"]
    lines = ["# Lossy boundaries: max |logit difference| against F32 by prompt length", ""]
    if "measured_at" in report:
        m = report["machine"]
        lines += [f"Measured {report['measured_at']}, {m['cpu_model']}, {m['cores']} cores; one prompt a length,"
                  f" {report['steps']} greedy steps; 3-hop splits against one unsplit worker.", ""]  # fmt: skip
    lines += ["| model | wire | " + " | ".join(f"{n} tokens" for n in lengths) + " | declared bound |",
              "|---|---|" + "---|" * len(lengths) + "---|"]  # fmt: skip
    for name in CUTS:
        for wire in WIRES:
            cells = {r["prompt_tokens"]: r["max_abs_diff"] for r in report["rows"]
                     if r["model"] == name and r["wire"] == wire.name}  # fmt: skip
            values = " | ".join(f"{cells[n]:.2f}" if n in cells else "-" for n in lengths)
            lines.append(f"| {name} | {wire.name} | {values} | {report['bounds'][wire.name]:g} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="40,250,500,1000,1500,2000", help="prompt lengths, tokens")
    parser.add_argument("--steps", type=int, default=32, help="greedy steps after each prompt (default 32)")
    parser.add_argument("--out", type=Path, help="write wire_bounds.{json,md} here (default: print only)")
    args = parser.parse_args()
    report = trio.run(measure, [int(x) for x in args.lengths.split(",")], args.steps)
    publish(args.out, "wire_bounds", stamped(report), markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
