"""Interleaved A/B of two checkouts of Baton, or of two settings of one: the same 3-node swarm
started from each side in turn.

Owns one command. A change to the data path moves a decode step by a few percent, and this
machine's speed moves by a fifth from hour to hour (a shared VM): a benchmark run before the
change and another after it compare the hours, not the code. Here the two checkouts' swarms
take turns, round after round (the order alternating), on the same model, worker binary and
settings, and each side's figures are medians over all its runs; every round's pair is kept,
so a reader can see whether one side was ahead in every round or only on average; taken as
pairs (one per round), the rounds give a median ratio with a 95 % interval and a sign test
(``paired``): a split as even as chance would make it is not a difference.

- ``--base REF``: the other side (a git ref); checked out into a temporary git worktree, its
  gRPC stubs generated there from its own ``protocol/``. The other side is this checkout, as
  it is on disk (uncommitted changes included).
- ``--base-env``/``--head-env NAME=VALUE`` (repeatable), ``--base-node-args``/``--head-node-args``
  and ``--base-threads``/``--head-threads``: one side's environment, node flags or worker threads
  (default: ``--node-args``, ``--threads``, the environment as it is). Without ``--base`` both
  sides run this checkout, and these settings are the A/B (a scheduling class, an OpenMP spin
  count, a node flag); they must differ.
- Both sides run the worker binary built here (``build/native/baton-worker``): the A/B is of
  the Python side (nodes, owners, transport). Refs whose ``native/`` or ``patches/`` differ
  from this checkout's are refused.
- Each swarm (tracker + 3 nodes of SmolLM2 on loopback, ``--threads`` per worker, nodes
  started with ``--node-args``) serves ``--runs-per-swarm`` measured runs of ``--sessions``
  concurrent sessions (each its own owner, in the measuring process), ``--tokens`` greedy
  tokens each, after a warm-up generation.
- Per run: the median inter-token gap (ms) over every session's decode steps, aggregate
  decode tokens/s (from the first session's first token to the last session's last), and CPU
  ms per decode token by process role over the whole run, prompts included (psutil: node
  agents, owners, tracker, each worker).

Writes ``step_ab.json`` and ``step_ab.md`` under ``--out`` (default: a temporary folder,
printed; pass ``--out bench/results`` to keep them). Run it alone on the machine.

Usage: ``.venv/bin/python bench/tools/step_ab.py --base REF [--sessions 1] [--tokens 200]
[--rounds 5] [--runs-per-swarm 2] [--threads 1] [--node-args "--decode-groups 1 ..."]``, or
``bench/tools/step_ab.py --head-env GOMP_SPINCOUNT=20000 [...]`` (settings of this checkout)
(about 40 s a swarm on 2 cores: 7 minutes with the defaults).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/: _bootstrap, common
from _bootstrap import REPO_ROOT
from batching import cpu_during, cpu_seconds
from common import machine_info

ALIAS = "smollm2"
NODES = 3
SEQUENCES = 8
SIDES = ("base", "head")
#: where each side's figures come from in a run's JSON line
FIGURES = ("step_ms", "tokens_per_s")


def log(message: str) -> None:
    print(f"[step_ab {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- one side: a swarm from the current directory's checkout (child process) -----------------


async def _measure(sessions: int, tokens: int, runs: int, threads: int, node_args: Sequence[str]) -> None:
    """Start a swarm from the checkout in the current directory; print one JSON line a run."""
    sys.path.insert(0, os.getcwd())  # that checkout's agent, not this script's (_bootstrap's)
    import trio

    from agent.demo.swarm_demo import node_memory_bytes, wait_for_coverage
    from agent.harness.local_swarm import LocalSwarmConfig, open_local_swarm
    from agent.io.client import SwarmClientConfig, open_swarm_client
    from agent.models import model_path

    try:  # the owners here stand in for `baton generate`, which sets its CPU policy (agent.cli)
        from agent.io.cpu_policy import apply_cpu_policy
    except ImportError:  # a checkout from before agent.io.cpu_policy: its owners as its own ran
        pass
    else:
        apply_cpu_policy()

    config = LocalSwarmConfig(
        model_path=model_path(ALIAS), model_alias=ALIAS, threads=threads,
        node_args=("--max-sequences", str(SEQUENCES), *node_args),
    )  # fmt: skip
    client_config = SwarmClientConfig(queue_timeout_s=120.0)
    async with open_local_swarm(config) as swarm:
        await swarm.start_tracker()
        async with open_swarm_client(swarm.tracker_addr) as client:
            (entry,) = [m for m in await client.list_models() if m.alias == ALIAS]
            for i in range(NODES):
                swarm.start_node(
                    f"node-{i + 1}",
                    node_memory_bytes(entry.n_layer, entry.bytes_per_block, NODES),
                )
            route = await wait_for_coverage(client, swarm, ALIAS, timeout_s=300.0)
            prompt = (await client.tokenize(route, "The quick brown fox jumps over the lazy dog. " * 10))[0][:32]
        async with open_swarm_client(swarm.tracker_addr, config=client_config) as client:
            await client.generate_tokens(ALIAS, prompt, max_tokens=8)  # warm-up

        async def one(index: int, arrivals: list[float]) -> None:
            async def on_token(_token: int, _logits: object, _result: object) -> bool:
                arrivals.append(time.perf_counter())
                return False

            # prompts differ in their last token: no two sessions share a cache prefix
            async with open_swarm_client(swarm.tracker_addr, config=client_config) as owner:
                await owner.generate_tokens(
                    ALIAS,
                    [*prompt[:-1], prompt[-1] + index],
                    max_tokens=tokens,
                    on_token=on_token,
                )

        for _ in range(runs):
            arrivals: list[list[float]] = [[] for _ in range(sessions)]
            before = cpu_seconds()
            async with trio.open_nursery() as nursery:
                for index in range(sessions):
                    nursery.start_soon(one, index, arrivals[index])
            gaps = [b - a for times in arrivals for a, b in itertools.pairwise(times)]
            decode_tokens = sum(max(0, len(times) - 1) for times in arrivals)
            # the decode span: from the first session's first token to the last one's last
            decode_s = max(times[-1] for times in arrivals) - min(times[0] for times in arrivals)
            spent = cpu_during(before, cpu_seconds())
            print(
                json.dumps(
                    {
                        "step_ms": statistics.median(gaps) * 1e3,
                        "tokens_per_s": decode_tokens / decode_s,
                        "cpu_ms_per_token": {role: s * 1e3 / decode_tokens for role, s in spent.items()},
                    }
                ),
                flush=True,
            )


# -- the A/B (parent process) ------------------------------------------------------------------


def _git(*args: str, cwd: Path = REPO_ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def prepare_base(ref: str, folder: Path) -> str:
    """Check ``ref`` out into ``folder`` (a git worktree) with its own gRPC stubs; its commit.

    Raises SystemExit when ``ref`` is unknown or its native code differs from this checkout's
    (both sides run this checkout's worker binary)."""
    try:
        commit = _git("rev-parse", "--verify", f"{ref}^{{commit}}")
    except subprocess.CalledProcessError:
        raise SystemExit(f"step_ab: {ref!r} is not a commit of this repository") from None
    changed = _git("diff", "--name-only", commit, "--", "native", "patches")
    if changed:
        raise SystemExit(
            f"step_ab: {ref} differs from this checkout in native code ({changed.splitlines()[0]}, ...): "
            f"both sides run this checkout's worker, so the A/B would not be of {ref}"
        )
    _git("worktree", "add", "--detach", str(folder), commit)
    subprocess.run(
        [sys.executable, "packaging/gen_proto.py", "--force"],
        cwd=folder,
        check=True,
        capture_output=True,
    )
    return commit


def parse_env(assignments: Sequence[str]) -> dict[str, str]:
    """``NAME=VALUE`` strings as a dict (a later one wins).

    Raises:
      ValueError: one is not ``NAME=VALUE`` with NAME a shell variable name (the message names it).
    """
    env: dict[str, str] = {}
    for assignment in assignments:
        name, sep, value = assignment.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"{assignment!r} is not NAME=VALUE (NAME: letters, digits and _, not first a digit)")
        env[name] = value
    return env


#: what ``run_side`` sets in each side's environment itself: a side's ``--*-env`` may not
_RESERVED_ENV = frozenset({"PYTHONPATH", "BATON_WORKER_BIN"})


def side_settings(
    *, ref: str | None, threads: int, node_args: str, base: dict[str, object], head: dict[str, object]
) -> dict[str, dict]:
    """Each side's ``{"env", "node_args", "threads"}``: ``base``/``head`` hold the side's own
    (``env`` a dict; ``node_args``, ``threads`` None for the shared ``node_args``/``threads``).

    Raises:
      ValueError: a side's environment sets what each side's run sets itself (``PYTHONPATH``,
        ``BATON_WORKER_BIN``), or no ``ref`` and both sides alike: nothing to compare.
    """
    sides = {
        side: {
            "env": dict(own.get("env") or {}),
            "node_args": node_args if own.get("node_args") is None else own["node_args"],
            "threads": threads if own.get("threads") is None else own["threads"],
        }
        for side, own in (("base", base), ("head", head))
    }
    for side, settings in sides.items():
        if reserved := sorted(_RESERVED_ENV & set(settings["env"])):
            raise ValueError(
                f"--{side}-env cannot set {', '.join(reserved)}: step_ab sets it for each side "
                "(the side's checkout; --worker-bin)"
            )
    if ref is None and sides["base"] == sides["head"]:
        raise ValueError(
            "nothing to compare: give --base REF, or settings that differ between the sides "
            "(--base-env/--head-env, --base-node-args/--head-node-args, --base-threads/--head-threads)"
        )
    return sides


def run_side(checkout: Path, settings: dict, args: argparse.Namespace) -> list[dict]:
    """One swarm from ``checkout`` with one side's ``settings`` (``side_settings``): its runs' figures."""
    command = [
        sys.executable, str(Path(__file__).resolve()), "--measure",
        "--sessions", str(args.sessions), "--tokens", str(args.tokens),
        "--runs-per-swarm", str(args.runs_per_swarm), "--threads", str(settings["threads"]),
        "--node-args", settings["node_args"],
    ]  # fmt: skip
    env = {
        **os.environ,
        **settings["env"],  # the owners (this measuring child) and every process it starts inherit it
        "PYTHONPATH": str(checkout),
        "BATON_WORKER_BIN": str(args.worker_bin),
    }
    done = subprocess.run(
        command,
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=args.swarm_timeout_s,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the swarm from {checkout} failed (rc={done.returncode}): {done.stderr[-2000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def summarize(runs: dict[str, list[list[dict]]]) -> dict:
    """Medians per side over all runs, the ratio head/base of each, and each round's medians.

    ``runs[side][round]`` holds that round's runs of that side."""
    out: dict = {"sides": {}, "rounds": []}
    for side in SIDES:
        flat = [run for round_runs in runs[side] for run in round_runs]
        roles = sorted({role for run in flat for role in run["cpu_ms_per_token"]})
        out["sides"][side] = {
            "runs": len(flat),
            **{name: statistics.median(run[name] for run in flat) for name in FIGURES},
            "cpu_ms_per_token": {
                role: statistics.median(run["cpu_ms_per_token"].get(role, 0.0) for run in flat) for role in roles
            },
        }
    for round_index in range(len(runs["base"])):
        out["rounds"].append(
            {
                side: {name: statistics.median(run[name] for run in runs[side][round_index]) for name in FIGURES}
                for side in SIDES
            }
        )
    base, head = out["sides"]["base"], out["sides"]["head"]
    out["ratio_head_over_base"] = {name: head[name] / base[name] for name in FIGURES}
    # faster is a smaller step and more tokens/s: in how many rounds was head ahead on both
    out["rounds_head_ahead"] = sum(
        1
        for pair in out["rounds"]
        if pair["head"]["step_ms"] < pair["base"]["step_ms"]
        and pair["head"]["tokens_per_s"] > pair["base"]["tokens_per_s"]
    )
    out["paired"] = paired(out["rounds"])
    return out


def sign_test_p(ahead: int, behind: int) -> float:
    """Two-sided exact sign test: how likely a split at least this uneven is when neither side
    is faster (each round a coin toss; tied rounds left out)."""
    n = ahead + behind
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(ahead, behind) + 1)) / 2**n
    return min(1.0, 2 * tail)


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free interval for the median of ``values`` (order statistics, binomial
    coverage at least ``confidence``); None when there are too few values for one (fewer than 6
    at 95 %)."""
    ordered = sorted(values)
    n = len(ordered)
    # the largest j with P(Binomial(n, 1/2) < j) <= (1 - confidence) / 2: [x_(j), x_(n+1-j)]
    alpha_half, below, j = (1 - confidence) / 2, 0.0, 0
    while j < n // 2:
        below_next = below + math.comb(n, j) / 2**n
        if below_next > alpha_half:
            break
        below, j = below_next, j + 1
    if j == 0:
        return None
    return ordered[j - 1], ordered[n - j]


def paired(rounds: Sequence[dict]) -> dict:
    """The rounds as pairs: the per-round ratio head/base of tokens/s (its median and a 95 %
    interval for that median), and a sign test on the rounds in which head had more tokens/s.

    Why: the machine's speed drifts by more than the effects measured, so one side's median
    over all runs can lead by chance; pairs taken in the same round cancel the drift, and the
    sign test says how often a split as uneven would come from sides that are alike."""
    ratios = [pair["head"]["tokens_per_s"] / pair["base"]["tokens_per_s"] for pair in rounds]
    ahead = sum(1 for ratio in ratios if ratio > 1)
    behind = sum(1 for ratio in ratios if ratio < 1)
    interval = median_interval(ratios)
    return {
        "tokens_per_s_ratio_median": statistics.median(ratios) if ratios else None,
        "tokens_per_s_ratio_interval_95": list(interval) if interval else None,
        "rounds_more_tokens_per_s": ahead,
        "rounds_fewer_tokens_per_s": behind,
        "sign_test_p": sign_test_p(ahead, behind),
    }


def _describe_settings(settings: dict) -> str:
    env = " ".join(f"{name}={value}" for name, value in sorted(settings["env"].items()))
    return f"workers of {settings['threads']} thread(s); node args: `{settings['node_args'] or '(none)'}`" + (
        f"; environment: `{env}`" if env else ""
    )


def _paired_lines(pairs: dict | None) -> list[str]:
    if not pairs or pairs["tokens_per_s_ratio_median"] is None:
        return []
    interval = pairs["tokens_per_s_ratio_interval_95"]
    spread = (
        f"95 % interval of that median {interval[0]:.3f}-{interval[1]:.3f}"
        if interval
        else "too few rounds for a 95 % interval of that median (6 at least)"
    )
    return [
        "",
        (
            f"Paired by round: head/base tokens/s, median of the per-round ratios "
            f"{pairs['tokens_per_s_ratio_median']:.3f} ({spread}); head had more tokens/s in "
            f"{pairs['rounds_more_tokens_per_s']} rounds and fewer in {pairs['rounds_fewer_tokens_per_s']}: "
            f"sign test p = {pairs['sign_test_p']:.3f} (two-sided; below 0.05, the sides differ)."
        ),
    ]


def markdown(report: dict) -> str:
    summary, method = report["summary"], report["method"]
    base, head = summary["sides"]["base"], summary["sides"]["head"]
    machine = report["machine"]
    dirty = " with uncommitted changes" if report["head"]["dirty"] else ""
    if report["base"]["ref"] is None:
        what, checkouts = "two settings of one checkout", f"both sides: `{report['head']['commit'][:12]}`{dirty}."
    else:
        what = "two checkouts"
        checkouts = (
            f"base `{report['base']['commit'][:12]}` ({report['base']['ref']}), "
            f"head `{report['head']['commit'][:12]}`{dirty}."
        )
    shared = {"env": {}, "node_args": method.get("node_args", ""), "threads": method.get("threads", "?")}
    sides = method.get("sides") or {"base": shared, "head": shared}
    if sides["base"] == sides["head"]:
        settings = _describe_settings(sides["base"]) + "."
    else:
        settings = f"base: {_describe_settings(sides['base'])}. head: {_describe_settings(sides['head'])}."
    lines = [
        f"# Interleaved A/B of {what} (`bench/tools/step_ab.py`)",
        "",
        f"Machine: {machine.get('cpu_model', '?')}, {machine.get('cores', '?')} cores; {checkouts}",
        (
            f"{method['sessions']} concurrent session(s), {method['tokens']} greedy tokens each, "
            f"{method['rounds']} rounds x {method['runs_per_swarm']} runs a swarm per side, sides alternating."
        ),
        settings,
        "",
        "| figure | base | head | head / base |",
        "|---|---|---|---|",
        (
            f"| decode step ms (median gap) | {base['step_ms']:.2f} | {head['step_ms']:.2f} | "
            f"{summary['ratio_head_over_base']['step_ms']:.3f} |"
        ),
        (
            f"| tokens/s (aggregate) | {base['tokens_per_s']:.1f} | {head['tokens_per_s']:.1f} | "
            f"{summary['ratio_head_over_base']['tokens_per_s']:.3f} |"
        ),
    ]
    for role in sorted(set(base["cpu_ms_per_token"]) | set(head["cpu_ms_per_token"])):
        b, h = (
            base["cpu_ms_per_token"].get(role, 0.0),
            head["cpu_ms_per_token"].get(role, 0.0),
        )
        ratio = f"{h / b:.3f}" if b else "-"
        lines.append(f"| CPU ms per token, {role} | {b:.2f} | {h:.2f} | {ratio} |")
    lines += [
        "",
        f"Rounds in which head was ahead on both step and tokens/s: {summary['rounds_head_ahead']} of {len(summary['rounds'])}.",
        *_paired_lines(summary.get("paired")),
        "",
        "| round | base step ms | head step ms | base t/s | head t/s |",
        "|---|---|---|---|---|",
    ]
    for index, pair in enumerate(summary["rounds"], 1):
        lines.append(
            f"| {index} | {pair['base']['step_ms']:.2f} | {pair['head']['step_ms']:.2f} | "
            f"{pair['base']['tokens_per_s']:.1f} | {pair['head']['tokens_per_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="the git ref to compare this checkout with")
    parser.add_argument("--sessions", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs-per-swarm", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="threads per worker")
    parser.add_argument(
        "--node-args",
        default="",
        help="extra node flags, one string (e.g. lock-step's)",
    )
    for side in SIDES:
        parser.add_argument(
            f"--{side}-env", action="append", default=[], metavar="NAME=VALUE",
            help=f"an environment variable of the {side} side's processes (repeatable)",
        )  # fmt: skip
        parser.add_argument(f"--{side}-node-args", help=f"the {side} side's node flags (default: --node-args)")
        parser.add_argument(f"--{side}-threads", type=int, help=f"the {side} side's threads per worker")
    parser.add_argument(
        "--worker-bin",
        type=Path,
        default=REPO_ROOT / "build" / "native" / "baton-worker",
    )
    parser.add_argument("--swarm-timeout-s", type=float, default=900.0)
    parser.add_argument(
        "--out",
        type=Path,
        help="where step_ab.{json,md} go (default: a temporary folder)",
    )
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # child: one side's swarm
    args = parser.parse_args()
    if args.sessions < 1 or args.tokens < 2 or args.rounds < 1 or args.runs_per_swarm < 1:
        parser.error("--sessions, --rounds and --runs-per-swarm must be at least 1, --tokens at least 2")
    if args.measure:
        import trio

        trio.run(
            _measure,
            args.sessions,
            args.tokens,
            args.runs_per_swarm,
            args.threads,
            shlex.split(args.node_args),
        )
        return 0
    try:
        sides = side_settings(
            ref=args.base, threads=args.threads, node_args=args.node_args,
            **{
                side: {
                    "env": parse_env(getattr(args, f"{side}_env")),
                    "node_args": getattr(args, f"{side}_node_args"),
                    "threads": getattr(args, f"{side}_threads"),
                }
                for side in SIDES
            },
        )  # fmt: skip
    except ValueError as err:
        parser.error(str(err))
    if any(settings["threads"] < 1 for settings in sides.values()):
        parser.error("threads per worker must be at least 1")
    if not args.worker_bin.exists():
        parser.error(f"no worker binary at {args.worker_bin}: run `make native` first")

    out = args.out or Path(tempfile.mkdtemp(prefix="baton-step-ab-"))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="baton-step-ab-base-") as scratch:
        base_dir = Path(scratch) / "checkout"
        base_commit = prepare_base(args.base, base_dir) if args.base else _git("rev-parse", "HEAD")
        try:
            checkouts = {"base": base_dir if args.base else REPO_ROOT, "head": REPO_ROOT}
            runs: dict[str, list[list[dict]]] = {side: [] for side in SIDES}
            for round_index in range(args.rounds):
                order = SIDES if round_index % 2 == 0 else tuple(reversed(SIDES))
                for side in order:
                    log(f"round {round_index + 1} of {args.rounds}: {side}")
                    runs[side].append(run_side(checkouts[side], sides[side], args))
                    last = runs[side][-1]
                    log("  step ms " + ", ".join(f"{run['step_ms']:.2f}" for run in last))
        finally:
            if args.base:
                _git("worktree", "remove", "--force", str(base_dir))
    report = {
        "benchmark": "step_ab",
        "machine": machine_info(),
        "base": {"ref": args.base, "commit": base_commit},
        "head": {
            "commit": _git("rev-parse", "HEAD"),
            "dirty": bool(_git("status", "--porcelain", "--", "agent", "bench", "protocol")),
        },
        "method": {
            "sessions": args.sessions,
            "tokens": args.tokens,
            "rounds": args.rounds,
            "runs_per_swarm": args.runs_per_swarm,
            "threads": args.threads,
            "node_args": args.node_args,
            "sides": sides,
            "worker_bin": str(args.worker_bin),
            "statistic": (
                "per run: the median inter-token gap over every session's decode steps, decode tokens / the "
                "decode span (first token of any session to the last of any), CPU per decode token by role "
                "over the whole run (prompts included); per side: medians over all its runs"
            ),
        },
        "runs": runs,
        "summary": summarize(runs),
        "wall_time_s": time.perf_counter() - started,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_ab.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "step_ab.md").write_text(markdown(report))
    print(markdown(report))
    log(f"wrote {out / 'step_ab.json'} and step_ab.md in {report['wall_time_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
