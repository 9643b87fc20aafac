#!/usr/bin/env python3
"""The worker on a GPU: a CUDA build, the native tests on the accelerator, and the worker's
model code timed beside llama.cpp's own benchmarks from the same compiled ggml.

Two steps, so that the build (minutes) and the runs can be separate calls on a lent machine::

    python3 bench/gpu_check.py build --build-dir build/native-cuda [-- EXTRA_CMAKE_ARGS...]
    python3 bench/gpu_check.py run --build-dir build/native-cuda --model M.gguf --out DIR

``build`` configures ``native/`` with ``-DGGML_CUDA=ON -DBATON_LLAMA_TOOLS=ON`` (one compile of
the CUDA backend serves the worker, its tests, ``baton-shard-bench``, ``llama-bench`` and
``llama-batched-bench``) and records how long it took. ``run``:

1. ctest (the split-equals-whole model test, the gRPC service, vocab-only) with every block on
   the GPU (``BATON_TEST_GPU_LAYERS=-1``);
2. ``baton-shard-bench --split 3``: the whole model and an even 3-way split in one process, step
   by step: whether the split's top-K equals the whole model's on the GPU, and what cutting costs
   with no process, socket or Python between the ranges;
3. one sequence: ``baton-shard-bench`` (prompt 512, 128 decode steps) against
   ``llama-bench -p 512 -n 128 -d 0,512 -ngl 99`` (prefill against pp512 at depth 0, decode,
   which follows a 512-token prompt, against tg128 at depth 512);
4. N sequences: ``baton-shard-bench --parallel N`` against ``llama-batched-bench -npl N`` (prompt
   128, 128 steps), N = 1, 2, 4, 8.

Writes ``gpu_check.json`` and ``gpu_check.md`` to ``--out`` (``bench/results`` for a committed
run), with the GPU, driver and CUDA versions. Standard library only: a lent GPU machine has its
own Python and none of this project's environment. ``baton-shard-bench`` measures the Shard (the
worker's model code), not the gRPC service or the swarm around it: those need the project's
Python environment (``bench/compare.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "bench"))
from compare_report import batched_bench_rows  # noqa: E402 - pure: standard library only
from results_io import publish  # noqa: E402

BUILD_TARGETS = (
    "baton-worker", "baton-worker-tests", "baton-shard-bench", "baton-ping-pong", "llama-bench", "llama-batched-bench",
)  # fmt: skip
BUILD_RECORD = "gpu_check_build.json"
PARALLEL = (1, 2, 4, 8)
#: the top-K the split is compared on (llama.cpp's default top_k)
TOP_K = 40


def log(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def pinned(what: str) -> str:
    """The pinned llama.cpp commit or the patch series' sha256 (packaging/llama_source.py)."""
    script = REPO_ROOT / "packaging" / "llama_source.py"
    done = subprocess.run([sys.executable, str(script), what], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def backend_args(args: argparse.Namespace) -> list[str]:
    """``--backend cpu`` is this script's own dry run on a machine without a GPU."""
    if args.backend == "cpu":
        return []
    return ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={args.cuda_arch}"]


def build(args: argparse.Namespace) -> int:
    build_dir = Path(args.build_dir).resolve()
    llama_src = Path(args.llama_src).resolve()
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = [
        "cmake", "-S", str(REPO_ROOT / "native"), "-B", str(build_dir), *generator,
        f"-DBATON_LLAMA_SRC={llama_src}", f"-DBATON_LLAMA_COMMIT={pinned('commit')}",
        f"-DBATON_PATCH_SERIES_SHA256={pinned('series-hash')}", "-DCMAKE_BUILD_TYPE=Release",
        "-DBATON_LLAMA_TOOLS=ON", *backend_args(args), *args.cmake_args,
    ]  # fmt: skip
    log(" ".join(configure))
    started = time.monotonic()
    subprocess.run(configure, check=True)
    configured = time.monotonic()
    jobs = str(os.cpu_count() or 2)
    subprocess.run(["cmake", "--build", str(build_dir), "-j", jobs, "--target", *BUILD_TARGETS], check=True)
    finished = time.monotonic()
    record = {
        "configure_s": round(configured - started, 1),
        "build_s": round(finished - configured, 1),
        "jobs": int(jobs),
        "backend": args.backend,
        "cuda_arch": args.cuda_arch,
        "cmake_args": configure[3:],
    }
    (build_dir / BUILD_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    log(f"built {', '.join(BUILD_TARGETS)} in {record['build_s']} s (configure {record['configure_s']} s)")
    return 0


def command_output(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def machine(build_dir: Path) -> dict:
    gpu = command_output(
        ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm", "--format=csv,noheader"]
    )
    nvcc = command_output(["nvcc", "--version"]).splitlines()
    info = {
        "gpu": gpu,
        "nvcc": nvcc[-1] if nvcc else "",
        "platform": platform.platform(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "llama_cpp_commit": pinned("commit"),
        "patch_series_sha256": pinned("series-hash"),
    }
    # BATON_COMMIT first: a lent machine's copy of the tree can hold a .git whose HEAD is not
    # the tree it was sent (one run here read the session's first commit)
    head = os.environ.get("BATON_COMMIT") or command_output(
        ["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"]
    )
    if head:
        info["baton_commit"] = head
    record = build_dir / BUILD_RECORD
    if record.exists():
        info["build"] = json.loads(record.read_text())
    return info


def run_tool(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """Runs a tool to its end; RuntimeError (with its stderr's tail) when it fails."""
    log(" ".join(argv))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{Path(argv[0]).name} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done


def run_json(argv: list[str], timeout_s: float) -> dict:
    """Runs a tool that prints one JSON object on a line of stdout; that object."""
    done = run_tool(argv, timeout_s)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"{argv[0]} printed no JSON line:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


def run_ctest(build_dir: Path, model: Path) -> dict:
    env = {**os.environ, "BATON_TEST_MODEL": str(model), "BATON_TEST_GPU_LAYERS": "-1"}
    argv = ["ctest", "--test-dir", str(build_dir), "--output-on-failure"]
    log(" ".join(argv) + "  (BATON_TEST_GPU_LAYERS=-1)")
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env)
    output = done.stdout + done.stderr
    summary = [line for line in output.splitlines() if "tests passed" in line or "Passed" in line or "Failed" in line]
    return {
        "passed": done.returncode == 0,
        "exit_code": done.returncode,
        "seconds": round(time.monotonic() - started, 1),
        "summary": summary,
        "output_tail": output[-4000:],
    }


def shard_bench(build_dir: Path, model: Path, threads: int, *flags: str) -> dict:
    argv = [str(build_dir / "baton-shard-bench"), str(model), "--threads", str(threads), *flags]
    return run_json(argv, timeout_s=600)


def llama_tool(build_dir: Path, name: str) -> str:
    """Where llama.cpp's CMake put one of its tools inside this build."""
    found = sorted(p for p in build_dir.rglob(name) if p.is_file() and os.access(p, os.X_OK))
    if not found:
        raise RuntimeError(f"{name} is not in {build_dir}: run the build step first")
    return str(found[0])


def llama_bench(build_dir: Path, model: Path, threads: int, prompt: int, steps: int, reps: int) -> list[dict]:
    argv = [
        llama_tool(build_dir, "llama-bench"), "-m", str(model), "-p", str(prompt), "-n", str(steps),
        "-d", f"0,{prompt}", "-ngl", "99", "-t", str(threads), "-r", str(reps), "-o", "json",
    ]  # fmt: skip
    return json.loads(run_tool(argv, timeout_s=600).stdout)


def llama_batched_bench(build_dir: Path, model: Path, threads: int, prompt: int, steps: int) -> dict[int, dict]:
    n_ctx = max(PARALLEL) * (prompt + steps) + 64
    argv = [
        llama_tool(build_dir, "llama-batched-bench"), "-m", str(model), "-c", str(n_ctx), "-b", "2048",
        "-ub", "512", "-npp", str(prompt), "-ntg", str(steps), "-npl", ",".join(map(str, PARALLEL)),
        "-ngl", "99", "-t", str(threads), "--output-format", "jsonl",
    ]  # fmt: skip
    done = run_tool(argv, timeout_s=600)
    return batched_bench_rows(done.stdout + done.stderr)


def bench_row(rows: list[dict], n_prompt: int, n_gen: int, depth: int) -> dict | None:
    for row in rows:
        if row.get("n_prompt") == n_prompt and row.get("n_gen") == n_gen and row.get("n_depth", 0) == depth:
            return row
    return None


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def run(args: argparse.Namespace) -> int:
    build_dir = Path(args.build_dir).resolve()
    model = Path(args.model).resolve()
    threads = args.threads
    report: dict = {"machine": machine(build_dir), "model": model.name, "threads": threads, "failures": []}

    def attempt(name: str, fn):
        try:
            report[name] = fn()
        except Exception as e:
            report["failures"].append(f"{name}: {e}")
            log(f"{name} failed: {e}")

    attempt("ctest", lambda: run_ctest(build_dir, model))
    attempt(
        "split",
        lambda: shard_bench(
            build_dir, model, threads, "--split", "3", "--top-k", str(TOP_K), "--prompt", "64", "--steps", "64",
            "--reps", str(args.reps),
        ),
    )  # fmt: skip
    prompt, steps = 512, 128
    attempt(
        "shard_single",
        lambda: shard_bench(
            build_dir, model, threads, "--prompt", str(prompt), "--steps", str(steps), "--reps", str(args.reps),
            "--top-k", str(TOP_K),
        ),
    )  # fmt: skip
    attempt(
        "shard_single_full_row",
        lambda: shard_bench(
            build_dir, model, threads, "--prompt", str(prompt), "--steps", str(steps), "--reps", str(args.reps),
        ),
    )  # fmt: skip
    attempt("llama_bench", lambda: llama_bench(build_dir, model, threads, prompt, steps, args.reps))
    # the host's floor under a hop: one boundary row (SmolLM2: 576 f32) over loopback TCP, no TLS
    attempt(
        "ping_pong_tcp",
        lambda: run_json(
            [str(build_dir / "baton-ping-pong"), "tcp", "--bytes", "2304", "--round-trips", "20000"], timeout_s=120
        ),
    )
    batched_prompt, batched_steps = 128, 128
    attempt(
        "llama_batched_bench", lambda: llama_batched_bench(build_dir, model, threads, batched_prompt, batched_steps)
    )
    for n in PARALLEL:
        attempt(
            f"shard_parallel_{n}",
            lambda n=n: shard_bench(
                build_dir, model, threads, "--parallel", str(n), "--prompt", str(batched_prompt), "--steps",
                str(batched_steps), "--reps", str(args.reps), "--top-k", str(TOP_K),
            ),
        )  # fmt: skip
    report["summary"] = summarise(report, prompt, steps)
    publish(Path(args.out) if args.out else None, "gpu_check", report, render(report))
    return 0 if not report["failures"] and report.get("ctest", {}).get("passed") else 1


def summarise(report: dict, prompt: int, steps: int) -> dict:
    s: dict = {}
    split = report.get("split")
    if split:
        s["split_top_k_equal"] = split["top_k_equal"]
        s["whole_decode_ms"] = median([r["whole_decode_ms"] for r in split["runs"]])
        s["split_decode_ms"] = median([r["split_decode_ms"] for r in split["runs"]])
        s["cut_cost_ms"] = (s["split_decode_ms"] - s["whole_decode_ms"]) / 2  # two cuts in a 3-way split
    single, rows = report.get("shard_single"), report.get("llama_bench")
    if single and rows:
        pp = bench_row(rows, prompt, 0, 0)
        tg = bench_row(rows, 0, steps, prompt)
        s["shard_prefill_tps"] = median([1e3 * prompt / r["prompt_ms"] for r in single["runs"]])
        s["shard_decode_tps"] = median([1e3 / r["decode_ms"] for r in single["runs"]])
        if pp:
            s["llama_bench_pp_tps"] = pp["avg_ts"]
            s["prefill_ratio"] = s["shard_prefill_tps"] / pp["avg_ts"]
        if tg:
            s["llama_bench_tg_tps"] = tg["avg_ts"]
            s["decode_ratio"] = s["shard_decode_tps"] / tg["avg_ts"]
        full = report.get("shard_single_full_row")
        if full:
            s["shard_decode_full_row_tps"] = median([1e3 / r["decode_ms"] for r in full["runs"]])
    batched = report.get("llama_batched_bench")
    if batched:
        s["parallel"] = {}
        for n in PARALLEL:
            shard = report.get(f"shard_parallel_{n}")
            llama = batched.get(n) or batched.get(str(n))
            if not shard or not llama:
                continue
            tps = median([1e3 * n / r["decode_ms"] for r in shard["runs"]])
            s["parallel"][n] = {"shard_tps": tps, "llama_tg_tps": llama["speed_tg"], "ratio": tps / llama["speed_tg"]}
    return s


def render(report: dict) -> str:
    m, s = report["machine"], report["summary"]
    lines = [
        "# The worker on a GPU (bench/gpu_check.py)",
        "",
        f"Machine: {m['gpu']}; {m['nvcc']}; {m['cores']} CPU cores; {m['platform']}.",
        f"llama.cpp {m['llama_cpp_commit'][:12]}, patch series {m['patch_series_sha256'][:12]}; "
        f"Baton {m.get('baton_commit', '?')}; model {report['model']}; {report['threads']} CPU threads; "
        "every block offloaded (-ngl 99, gpu layers -1).",
    ]
    if "build" in m:
        b = m["build"]
        lines.append(f"{b['backend']} build (arch {b['cuda_arch']}, {b['jobs']} jobs): configure {b['configure_s']} s, "
                     f"build {b['build_s']} s.")  # fmt: skip
    ctest = report.get("ctest")
    lines += ["", "## Tests on the GPU", ""]
    if ctest:
        verdict = "passed" if ctest["passed"] else f"FAILED (exit {ctest['exit_code']})"
        lines.append(f"- ctest with `BATON_TEST_GPU_LAYERS=-1`: {verdict} in {ctest['seconds']} s.")
        lines += [f"  - {line.strip()}" for line in ctest["summary"]]
    if "split_top_k_equal" in s:
        lines.append(
            f"- `baton-shard-bench --split 3`: the 3-way split's top-{TOP_K} (ids and logits) "
            f"{'equals' if s['split_top_k_equal'] else 'DIFFERS from'} the whole model's at every step."
        )
    lines += ["", "## One sequence", ""]
    if "shard_prefill_tps" in s:
        lines += [
            "| | Baton's Shard | llama-bench | ratio |",
            "|---|---|---|---|",
            f"| prefill 512, t/s | {s['shard_prefill_tps']:.0f} | {s.get('llama_bench_pp_tps', float('nan')):.0f} | "
            f"{s.get('prefill_ratio', float('nan')):.2f}x |",
            f"| decode after 512, t/s | {s['shard_decode_tps']:.0f} | {s.get('llama_bench_tg_tps', float('nan')):.0f} | "
            f"{s.get('decode_ratio', float('nan')):.2f}x |",
        ]  # fmt: skip
    if "shard_decode_full_row_tps" in s:
        lines.append(
            f"\nThe Shard's decode returns the top-{TOP_K} and the row's log-sum-exp, as the last hop does; "
            f"returning the whole logit row instead: {s['shard_decode_full_row_tps']:.0f} t/s."
        )
    ping = report.get("ping_pong_tcp")
    if ping:
        lines.append(f"\nThis host's floor under a hop (`baton-ping-pong tcp`, {ping.get('bytes')} bytes, no TLS): "
                     f"{ping.get('one_way_us', float('nan')):.1f} us one way.")  # fmt: skip
    if "whole_decode_ms" in s:
        lines.append(
            f"\nA decode step, whole model {s['whole_decode_ms']:.3f} ms, three ranges in series "
            f"{s['split_decode_ms']:.3f} ms: {s['cut_cost_ms']:.3f} ms a cut (in one process)."
        )
    if s.get("parallel"):
        lines += [
            "",
            "## N sequences decoding together (prompt 128, 128 steps)",
            "",
            "| N | Baton's Shard, t/s | llama-batched-bench S_TG, t/s | ratio |",
            "|---|---|---|---|",
        ]
        for n, row in s["parallel"].items():
            lines.append(f"| {n} | {row['shard_tps']:.0f} | {row['llama_tg_tps']:.0f} | {row['ratio']:.2f}x |")
    if report.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {note}" for note in report["notes"]]
    if report["failures"]:
        lines += ["", "## Failures", ""] + [f"- {f}" for f in report["failures"]]
    return "\n".join(lines) + "\n"


def rerender(path: Path) -> int:
    """Writes ``path``'s .md again from its .json (after notes were added to the report)."""
    report = json.loads(path.read_text())
    path.with_suffix(".md").write_text(render(report))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="step", required=True)
    b = sub.add_parser("build", help="configure and build the CUDA worker and llama.cpp's benchmarks")
    b.add_argument("--build-dir", default=str(REPO_ROOT / "build" / "native-cuda"))
    b.add_argument("--llama-src", default=str(REPO_ROOT / "build" / "llama.cpp"))
    b.add_argument("--cuda-arch", default="90", help="CMAKE_CUDA_ARCHITECTURES (default 90: Hopper)")
    b.add_argument("--backend", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run of this script")
    b.add_argument("cmake_args", nargs="*", help="extra CMake arguments (after --)")
    r = sub.add_parser("run", help="tests and benchmarks on the built binaries")
    r.add_argument("--build-dir", default=str(REPO_ROOT / "build" / "native-cuda"))
    r.add_argument("--model", required=True, help="a GGUF (SmolLM2-135M: the ctest model test's cuts)")
    r.add_argument("--threads", type=int, default=4)
    r.add_argument("--reps", type=int, default=5)
    r.add_argument("--out", help="where gpu_check.json/.md go (bench/results for a committed run)")
    m = sub.add_parser("render", help="write a report's .md again from its .json")
    m.add_argument("json", type=Path)
    args = parser.parse_args()
    if args.step == "render":
        return rerender(args.json)
    return build(args) if args.step == "build" else run(args)


if __name__ == "__main__":
    raise SystemExit(main())
