"""The pure half of ``bench/compare.py``: statistics, derived figures, headline checks, markdown.

Owns: turning per-run samples into median/min/max summaries, the ratios and per-hop overheads
derived from them, the three target checks, and the text of ``compare.md``. No processes,
clocks, files or imports from ``agent`` (``tests/test_bench_compare.py`` runs it on fixed
numbers).

Vocabulary (docs/ARCHITECTURE.md): a *hop* is one (node, range) entry of a route, so an
N-way split has N hops; each hop adds one node agent, one worker Forward and one libp2p message
into it (the last hop also pushes the result back to the client).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence

__all__ = [
    "DECODE_RATIO_TARGET",
    "PER_HOP_TARGET_MS",
    "SYSTEMS",
    "derive",
    "headline",
    "render_markdown",
    "summarize",
    "table",
]

#: the loose bounds a split must stay within (per-hop overhead, decode ratio to unsplit)
PER_HOP_TARGET_MS = 1.0
DECODE_RATIO_TARGET = 0.8

#: (key, label, family, hops, reference key): the rows of the table, in order. A split row is
#: compared with the unsplit run of the same harness: Baton rows with Baton's worker driven
#: directly, llama.cpp RPC rows with llama-bench unsplit.
SYSTEMS: tuple[tuple[str, str, str, int, str | None], ...] = (
    ("worker_unsplit", "Baton worker, unsplit (direct, Unix socket)", "baton", 0, None),
    ("worker_run_ahead", "Baton worker, unsplit, greedy run-ahead (the worker steps itself)", "baton", 0, None),
    ("llama_bench", "llama-bench, unsplit", "llama.cpp", 0, None),
    ("baton_2", "Baton 2-split (tracker, direct channel, 2 nodes)", "baton", 2, "worker_unsplit"),
    ("baton_3", "Baton 3-split (tracker, direct channel, 3 nodes)", "baton", 3, "worker_unsplit"),
    ("rpc_2", "llama.cpp RPC 2-split (2 rpc-servers)", "llama.cpp", 2, "llama_bench"),
    ("rpc_3", "llama.cpp RPC 3-split (3 rpc-servers)", "llama.cpp", 3, "llama_bench"),
)


def batched_bench_rows(output: str) -> dict[int, dict]:
    """``llama-batched-bench --output-format jsonl``'s rows (stdout and stderr together), by
    parallel count (``pl``)."""
    rows = {}
    for line in output.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            row = json.loads(line)
            rows[int(row["pl"])] = row
    return rows


def summarize(samples: Sequence[float]) -> dict:
    """``{"median", "min", "max", "runs", "samples"}`` of per-run values (at least one)."""
    values = [float(v) for v in samples]
    if not values:
        raise ValueError("no samples")
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "runs": len(values),
        "samples": values,
    }


def step_ms(tokens_per_s: Mapping) -> dict:
    """The decode step time (ms) summary matching a tokens/s summary (1000 / t/s per run)."""
    return summarize([1000.0 / v for v in tokens_per_s["samples"]])


def derive(systems: Mapping[str, Mapping]) -> dict[str, dict]:
    """Ratio to the reference and per-hop overhead for every split row present.

    ``systems[key]`` holds ``prefill_tps`` and ``decode_tps`` summaries (``summarize``).
    Per-hop overhead = (split decode step ms - reference decode step ms) / hops; its interval
    pairs the split's fastest run with the reference's slowest run and vice versa.
    """
    out: dict[str, dict] = {}
    for key, _label, _family, hops, ref in SYSTEMS:
        if key not in systems or ref is None or ref not in systems:
            continue
        split, base = systems[key], systems[ref]
        split_ms, base_ms = step_ms(split["decode_tps"]), step_ms(base["decode_tps"])
        out[key] = {
            "reference": ref,
            "hops": hops,
            "decode_ratio": split["decode_tps"]["median"] / base["decode_tps"]["median"],
            "prefill_ratio": split["prefill_tps"]["median"] / base["prefill_tps"]["median"],
            "decode_step_ms": split_ms["median"],
            "reference_step_ms": base_ms["median"],
            "per_hop_overhead_ms": {
                "median": (split_ms["median"] - base_ms["median"]) / hops,
                "min": (split_ms["min"] - base_ms["max"]) / hops,
                "max": (split_ms["max"] - base_ms["min"]) / hops,
            },
        }
        if "paired_per_hop_ms" in split:  # the swarm's steps paired with the unsplit worker's
            out[key]["paired_per_hop_overhead_ms"] = split["paired_per_hop_ms"]
    return out


#: the speed ratio targets against llama.cpp: (check name, at least, the pooled rounds' (numerator system,
#: denominator system, figure), ``interleaved_ratios``' key)
SPEED_RATIOS = (
    ("Baton 3-split decode / llama-bench unsplit decode", 0.9, ("baton_3", "llama_bench", "decode_tps"),
     "baton_3/llama_bench"),
    ("Baton 3-split decode / RPC 3-split decode", 1.15, ("baton_3", "rpc_3", "decode_tps"), "baton_3/rpc_3"),
    ("Baton worker unsplit decode / llama-bench decode", 0.97, ("worker_unsplit", "llama_bench", "decode_tps"),
     "worker_unsplit/llama_bench"),
    ("Baton worker unsplit prefill / llama-bench prefill", 0.95, ("worker_unsplit", "llama_bench", "prefill_tps"),
     "worker_unsplit_prefill/llama_bench_prefill"),
)  # fmt: skip

#: the same ratios as ``bench_interleaved`` measures them, each turn's: (numerator, denominator)
INTERLEAVED_RATIOS = tuple(tuple(key.split("/")) for *_, key in SPEED_RATIOS)


def interleaved_ratios(turns: Sequence[Mapping[str, float]]) -> dict[str, dict]:
    """Per turn of ``bench_interleaved`` (each ``{system: decode t/s}``), each of
    ``INTERLEAVED_RATIOS``; summarized over the turns (``summarize``), keyed ``"a/b"``."""
    return {
        f"{a}/{b}": summarize([turn[a] / turn[b] for turn in turns])
        for a, b in INTERLEAVED_RATIOS
        if turns and all(a in turn and b in turn for turn in turns)
    }


def _places(value: float, target: float) -> int:
    """Decimal places that show ``value`` on the right side of ``target``: 2, or 3 (then 4)
    when 2 would round a miss (or a bare pass) onto the target itself."""
    for places in (2, 3):
        if round(value, places) != round(target, places):
            return places
    return 4


def _check(name: str, value: float, target: float, higher_is_better: bool, unit: str, target_text: str) -> dict:
    met = value >= target if higher_is_better else value <= target
    places = _places(value, target)
    gap = abs(value - target)
    if met:
        miss = ""
    elif higher_is_better:
        short = (1 - value / target) * 100
        miss = f"missed by {gap:.{places}f}{unit} ({short:.{0 if short >= 1 else 1}f}% short of {target_text})"
    else:
        miss = f"missed by {gap:.{places}f}{unit} ({value / target:.1f}x the {target_text} target)"
    return {
        "name": name,
        "value": value,
        "target": target_text,
        "met": met,
        "miss": miss,
        "shown": f"{value:.{places}f}",
    }


def headline(
    systems: Mapping[str, Mapping],
    derived: Mapping[str, Mapping],
    transport: Mapping | None = None,
    interleaved: Mapping | None = None,
) -> list[dict]:
    """The target checks, each ``{"name", "value", "target", "met", "miss"}`` (``miss``: by how
    much, empty when met). Checks whose rows are missing are left out. The speed targets:
    per-hop <= 0.3 ms; 3-split >= 0.9x llama-bench unsplit and >= 1.15x RPC 3-split; the
    worker unsplit >= 0.97x llama-bench decode and >= 0.95x prefill; the channel's round
    trips within 1.5x plain TCP. With ``interleaved`` (``bench_interleaved``'s turns), its
    ratios are those ratio checks, and the pooled rounds' ones follow as "runs minutes apart"."""
    checks = []
    turned = (interleaved or {}).get("ratios") or {}
    for name, target, _pooled, key in SPEED_RATIOS:
        if key in turned:
            checks.append(
                _check(f"{name}, interleaved turn by turn", turned[key]["median"], target, True, "x", f">= {target}x")
            )
    apart = ", runs minutes apart" if turned else ""
    for name, target, (a, b, figure), _key in SPEED_RATIOS:
        if a in systems and b in systems:
            ratio = systems[a][figure]["median"] / systems[b][figure]["median"]
            checks.append(_check(f"{name}{apart}", ratio, target, True, "x", f">= {target}x"))
    bench = systems.get("llama_bench")
    if "baton_3" in derived:
        paired = derived["baton_3"].get("paired_per_hop_overhead_ms")
        if paired is not None:
            checks.append(
                _check("Baton 3-split per-hop overhead, paired step by step with the unsplit worker (ms)",
                       paired["median"], 0.3, False, " ms", "0.3 ms")
            )  # fmt: skip
        checks.append(
            _check(
                "Baton 3-split per-hop overhead, runs minutes apart (ms)",
                derived["baton_3"]["per_hop_overhead_ms"]["median"], 0.3, False, " ms", "0.3 ms",
            )
        )  # fmt: skip
    if (off := (systems.get("baton_3") or {}).get("continuation_off_decode_tps")) is not None:
        ratio = systems["baton_3"]["decode_tps"]["median"] / off["median"]
        checks.append(
            _check(
                "Baton 3-split decode, greedy continuation on / off (runs alternating)", ratio, 1.0, True, "x", "> 1x"
            )
        )
        if bench is not None:
            checks.append(_check("Baton 3-split decode, greedy continuation off / llama-bench unsplit decode",
                                 off["median"] / bench["decode_tps"]["median"], 0.9, True, "x", ">= 0.9x"))  # fmt: skip
    if bench is not None and (ahead := systems.get("worker_run_ahead")) is not None:
        ratio = ahead["decode_tps"]["median"] / bench["decode_tps"]["median"]
        checks.append(
            _check("Baton worker unsplit decode, run-ahead / llama-bench decode", ratio, 0.97, True, "x", ">= 0.97x")
        )
    for name, entry in ((transport or {}).get("results") or {}).items():
        if "ratio_channel_over_tcp" in entry:
            checks.append(
                _check(
                    f"channel {name} round trip / plain TCP", entry["ratio_channel_over_tcp"], 1.5, False, "x", "1.5x"
                )
            )
    for n in (3, 2):
        key = f"baton_{n}"
        if key in derived:
            checks.append(
                _check(
                    f"Baton {n}-split decode / unsplit decode",
                    derived[key]["decode_ratio"],
                    DECODE_RATIO_TARGET,
                    True,
                    "x",
                    f">= {DECODE_RATIO_TARGET}x",
                )
            )
    for n in (3, 2):
        if f"baton_{n}" in systems and f"rpc_{n}" in systems:
            ratio = systems[f"baton_{n}"]["decode_tps"]["median"] / systems[f"rpc_{n}"]["decode_tps"]["median"]
            checks.append(_check(f"Baton {n}-split decode / RPC {n}-split decode", ratio, 1.0, True, "x", "> 1x"))
    for n in (3, 2):
        key = f"baton_{n}"
        if key in derived:
            checks.append(
                _check(
                    f"Baton {n}-split per-hop overhead (ms)",
                    derived[key]["per_hop_overhead_ms"]["median"],
                    PER_HOP_TARGET_MS,
                    False,
                    " ms",
                    f"{PER_HOP_TARGET_MS:g} ms",
                )
            )
    return checks


# --- markdown --------------------------------------------------------------------------------


def _fmt(summary: Mapping | None, digits: int = 1) -> str:
    if summary is None:
        return "—"
    return f"{summary['median']:.{digits}f} ({summary['min']:.{digits}f}–{summary['max']:.{digits}f})"


def system_rows(systems: Mapping[str, Mapping], derived: Mapping[str, Mapping]) -> list[list[str]]:
    """The main table's rows: system, hops, prefill t/s, decode t/s, decode step ms, ratio, per-hop."""
    rows = []
    for key, label, _family, hops, ref in SYSTEMS:
        fig = systems.get(key)
        if fig is None:
            rows.append([label, str(hops or 1), "not measured", "", "", "", ""])
            continue
        d = derived.get(key)
        ratio = "1 (reference)" if ref is None else (f"{d['decode_ratio']:.2f}x" if d else "—")
        if d:
            o = d["per_hop_overhead_ms"]
            per_hop = f"{o['median']:.2f} ({o['min']:.2f}–{o['max']:.2f})"
        else:
            per_hop = "—"
        rows.append(
            [
                label,
                str(hops or 1),
                _fmt(fig.get("prefill_tps")),
                _fmt(fig.get("decode_tps")),
                _fmt(step_ms(fig["decode_tps"]), 2),
                ratio,
                per_hop,
            ]
        )
    return rows


def transport_rows(transport: Mapping) -> list[list[str]]:
    rows = []
    labels = {
        "channel": "Baton channel (TCP+TLS 1.3, libp2p-TLS certs)",
        "libp2p": "libp2p (TCP+Noise+yamux)",
        "tcp": "plain trio TCP",
    }
    for name, entry in transport.get("results", {}).items():
        for path in ("channel", "libp2p", "tcp"):
            if path not in entry:
                continue
            s = entry[path]
            ratio = "1 (reference)" if path == "tcp" else f"{entry[f'ratio_{path}_over_tcp']:.2f}x"
            if (per_run := entry.get(f"ratio_{path}_over_tcp_per_run")) is not None:
                # each run's own ratio (both paths measured in it, in turn): free of the drift
                ratio += f"; per run {per_run['median']:.2f}x ({per_run['min']:.2f}–{per_run['max']:.2f})"
            rows.append(
                [
                    f"transport {name} round trip, {labels[path]}",
                    f"{s['median_ms']:.3f} ({s['min_ms']:.3f}–{s['max_ms']:.3f})",
                    ratio,
                    f"{entry[f'{path}_throughput_MB_per_s']:.0f}",
                ]
            )
    return rows


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def render_markdown(report: Mapping, profile_md: str = "") -> str:
    """``compare.md``: what ran, the tables, the headline checks and ``profile_md`` (the
    "Where the time goes" section)."""
    m = report["machine"]
    method = report["method"]
    systems, derived = report["systems"], report["derived"]
    lines = [
        "# Baton vs llama.cpp on one machine (`bench/compare.py`)",
        "",
        (
            f"Model: `{report['model']['name']}` ({report['model']['n_layer']} blocks). Prompt {method['prompt_tokens']} "
            f"tokens, then {method['decode_steps']} greedy decode steps; "
            + (
                f"{method['rounds']} rounds (every system measured once per round, in turn: the machine's speed "
                f"drifts), {method['runs_per_round']} runs each after a warm-up, pooled: {method['runs']} runs; "
                if method.get("rounds", 1) > 1
                else f"{method['runs']} runs after a warm-up; "
            )
            + f"{method['threads']} thread(s) in every process (workers, llama-bench `-t`, rpc-server `-t`). "
            "Cells: median (min–max) over runs."
        ),
        "",
        (
            f"Machine: {m['cpu_model']}, {m['cores']} cores, {m['ram_gib']:.1f} GiB RAM, {m['platform']}, "
            f"Python {m['python']}; load average before/after {m['loadavg_before']} / {m['loadavg_after']}."
        ),
        (
            f"llama.cpp `{m['llama_cpp_commit']}` + patch series `{m['patch_series_sha256'][:16]}…` (the same tree for "
            "Baton's worker and for `llama-bench`/`rpc-server`, both built Release, static, with `GGML_NATIVE=OFF`). "
            "The patches add ranged execution (which blocks' tensors are loaded, which layers get KV cache, which "
            "blocks a graph runs, hidden states in and out at a range's edges); with the whole range, the default "
            "that llama-bench and rpc-server use and the unsplit worker asks for, every tensor and KV layer is owned "
            "and every block runs as in the pinned code: whole-model behaviour is unchanged by the patches."
        ),
        (
            f"Baton checkout `{m['baton_commit']}`"
            + (
                f", with uncommitted changes in {', '.join(f'`{f}`' for f in m['baton_modified_files'])}"
                if m.get("baton_modified_files")
                else ""
            )
            + "."
            if m.get("baton_commit")
            else ""
        ),
        f"Total wall time of this run: {report['wall_time_s']:.0f} s"
        + (
            f" (including building the llama.cpp tools: {report['tools_build_s']:.0f} s)"
            if report.get("tools_build_s")
            else ""
        )
        + ".",
        "",
        "## Tokens per second",
        "",
    ]
    lines += table(
        [
            "system",
            "hops",
            "prefill t/s",
            "decode t/s",
            "decode step ms",
            "decode ratio to unsplit",
            "per-hop overhead ms",
        ],
        system_rows(systems, derived),
    )
    lines += [
        "",
        (
            "Ratio and per-hop overhead compare each split with the unsplit run of the same harness: Baton rows with "
            "Baton's worker driven directly over its Unix socket (one Forward per step on its Forward stream, from Python), RPC rows "
            "with `llama-bench` unsplit. Per-hop overhead = (split decode step − unsplit decode step) / hops, where "
            "hops = route hops (N for an N-way split); its interval pairs the extreme runs."
        ),
    ]
    derived = report.get("derived") or {}
    paired = [(n, derived[f"baton_{n}"]["paired_per_hop_overhead_ms"]) for n in (2, 3)
              if "paired_per_hop_overhead_ms" in derived.get(f"baton_{n}", {})]  # fmt: skip
    if paired:
        lines += [
            "",
            "Paired step by step (what the per-hop target uses): after each decode step of the swarm's "
            "generation, the same step (position, token) runs on a whole-model worker over its Forward stream, "
            "timed alone, and the swarm's step is timed from that call's end to the next token, so both see the "
            "machine at the same moment (greedy continuation off for these runs: with it the last hop would send "
            "the next step on meanwhile; the other Baton rows have it on); per run the median over steps of "
            "(swarm step - unsplit step) / hops: "
            + "; ".join(
                f"{n}-split **{p['median']:.3f} ms** a hop (runs: " + ", ".join(f"{v:.3f}" for v in p["samples"]) + ")"
                for n, p in paired
            )
            + ".",
        ]
    interleaved = report.get("interleaved") or {}
    if interleaved.get("turns"):
        turns = interleaved["turns"]
        lines += [
            "",
            f"Interleaved turn by turn (what the speed ratio targets use): the Baton 3-split swarm, the unsplit "
            f"worker (one Forward a step), llama-bench unsplit (`-r 1`) and the RPC 3-split, all started once, "
            f"then one run each in turn, {len(turns)} turns after a warm-up, the order rotating, so that each "
            "turn's ratios compare runs seconds apart (the rounds above put minutes between them): "
            + "; ".join(
                f"{key.replace('/', ' / ')} **{summary['median']:.3f}** (turns: "
                + ", ".join(f"{v:.2f}" for v in summary["samples"])
                + ")"
                for key, summary in interleaved["ratios"].items()
            )
            + ". Tokens/s by turn (decode; prefill where named): "
            + "; ".join(f"{name} " + ", ".join(f"{turn[name]:.1f}" for turn in turns) for name in turns[0])
            + ".",
        ]
    others = report.get("cpu_used_by_other_processes") or {}
    if others:
        lines += [
            "",
            "The machine is shared: CPU used by processes outside this benchmark during each measurement, in "
            f"cores busy on average (of {m['cores']}): "
            + ", ".join(
                f"{k} {v['others_cores']:.2f}" + (f" ({v['attempts']} attempts)" if v.get("attempts", 1) > 1 else "")
                for k, v in others.items()
            )
            + ". A measurement disturbed by more than "
            + f"{method.get('busy_threshold', 0.15):.2f} cores is run again (the quietest attempt is kept); "
            "a figure whose value here is still above that competed for the CPU.",
        ]
    notes = method.get("notes", [])
    if notes:
        lines += [""] + [f"- {note}" for note in notes]
    if report.get("transport"):
        lines += ["", "## Boundary transport alone (`bench/tools/transport_rtt.py`)", ""]
        lines += table(
            ["path", "round trip ms", "ratio to TCP", "MB/s (both ways)"], transport_rows(report["transport"])
        )
    checks = report.get("headline", [])
    if checks:
        lines += ["", "## Headline (computed in this run)", ""]
        for c in checks:
            verdict = "met" if c["met"] else f"**MISSED**: {c['miss']}"
            lines.append(
                f"- {c['name']}: **{c.get('shown', format(c['value'], '.2f'))}** (target {c['target']}): {verdict}"
            )
        if "worker_unsplit" in systems and "llama_bench" in systems:
            worker_ms = step_ms(systems["worker_unsplit"]["decode_tps"])["median"]
            bench_ms = step_ms(systems["llama_bench"]["decode_tps"])["median"]
            line = (
                f"- For scale (no target): Baton's unsplit worker, driven directly, decodes at "
                f"{bench_ms / worker_ms:.2f}x llama-bench's speed ({worker_ms:.2f} vs {bench_ms:.2f} ms a step: Python, "
                "the Forward stream and the direct harness's own work)"
            )
            for n in (3, 2):
                if f"baton_{n}" in systems:
                    split_ms = step_ms(systems[f"baton_{n}"]["decode_tps"])["median"]
                    line += (
                        f"; measured from llama-bench instead, Baton's {n}-split per-hop overhead is "
                        f"{(split_ms - bench_ms) / n:.2f} ms"
                    )
                    break
            lines.append(line + ".")
    if profile_md:
        lines += ["", profile_md.rstrip()]
    return "\n".join(lines) + "\n"
