"""The ``baton`` command line (entry point ``main``).

Commands:
  ``baton worker``  exec the native shard worker with the given flags;
  ``baton parity``  check that a model split at ``--cuts`` computes what the unsplit model
                    computes (logits at every greedy step, several sequences per batch);
  ``baton tracker``, ``baton node``, ``baton generate``, ``baton demo``: the swarm;
  ``baton relay``   the OpenAI-compatible relay: serve, API keys, ledger
                    (these two lines: the modules named in ``_DELEGATED``).

Only argument parsing and printing live here: the work is in ``agent.io`` / ``agent.core``.
Every command stops when the Baton process that started it ends, however it ends, if that
process gave it a lifeline (``agent.io.lifeline``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence

from agent import cli_args
from agent.io.cpu_policy import apply_cpu_policy
from agent.io.lifeline import watch_lifeline
from agent.io.process_memory import keep_freed_memory
from agent.io.settings import add_flags, settings_from_args
from agent.io.worker.config import WorkerConfig

__all__ = ["build_parser", "main"]

# Commands whose module provides ``add_arguments(parser)`` and ``main(args) -> int``.
_DELEGATED = {
    "tracker": ("agent.io.tracker.cli", "run the tracker (serve) or list its models"),
    "node": ("agent.io.node.cli", "serve layer ranges as a swarm node"),
    "generate": ("agent.io.client.cli", "generate text through the swarm"),
    "relay": ("agent.io.relay.cli", "the OpenAI-compatible relay: serve, API keys, ledger"),
    "demo": (
        "agent.demo.cli",
        "a tracker, three nodes and the relay on loopback, a generation through them (the quick start)",
    ),
    "lab": ("agent.io.lab.cli", "emulated machines on this host linked by an emulated WAN (needs root)"),
}


DESCRIPTION = """\
Baton runs GGUF language models too big for one machine by cutting them into layer ranges
served by volunteer machines, behind an OpenAI-compatible API."""
EPILOG = """\
start here:
  baton demo                      a tracker, three nodes and the relay on loopback, one generation
  baton demo --serve              the same, kept running for any OpenAI client
  baton node install --tracker A  volunteer this machine (builds the worker, installs a service)

Every command's options: baton COMMAND [SUBCOMMAND] --help, or docs/CLI.md.
Environment: BATON_CACHE (download cache, default ~/.cache/baton), BATON_WORKER_BIN (the worker
binary, default build/native/baton-worker), BATON_CPU_POLICY (batch or normal, default batch).
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="baton", description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    worker = commands.add_parser("worker", help="run the native shard worker for one layer range")
    add_flags(worker, WorkerConfig)

    parity = commands.add_parser("parity", help="compare a split model against the unsplit one")
    parity.add_argument("--model", required=True, help="GGUF file")
    parity.add_argument("--cuts", required=True, type=cli_args.cuts, help="cut points, e.g. 10,20")
    parity.add_argument("--sequences", type=cli_args.positive_int, default=1, help="sequences per batch (default 1)")
    parity.add_argument("--steps", type=cli_args.non_negative_int, default=32, help="greedy decode steps (default 32)")
    parity.add_argument(
        "--prompt-tokens", type=cli_args.positive_int, default=40, help="prompt length of sequence 0 (default 40)"
    )
    parity.add_argument("--threads", type=cli_args.positive_int, default=1, help="threads per worker (default 1)")
    parity.add_argument(
        "--tolerance", type=float, default=1e-4, help="largest max abs logits difference (default 1e-4)"
    )
    parity.add_argument(
        "--edit-after-step", type=cli_args.non_negative_int, help="scenario: edit sequences after this step"
    )
    parity.add_argument("--remove-seq", type=cli_args.non_negative_int, help="scenario: sequence to remove")
    parity.add_argument("--trim-seq", type=cli_args.non_negative_int, help="scenario: sequence to trim")
    parity.add_argument(
        "--trim-by", type=cli_args.positive_int, default=1, help="scenario: positions to trim (default 1)"
    )
    parity.add_argument(
        "--ready-timeout", type=float, default=120.0, help="seconds a worker may take to load (default 120)"
    )
    parity.add_argument("--json", action="store_true", help="print one JSON object")

    for name, (module, help_text) in _DELEGATED.items():
        sub = commands.add_parser(name, help=help_text)
        importlib.import_module(module).add_arguments(sub)
    _describe_commands(parser)
    return parser


def _describe_commands(parser: argparse.ArgumentParser) -> None:
    """Give every (sub)command without a description its one-line help as one, so that
    ``baton COMMAND --help`` says what the command does, as ``baton --help`` lists it."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                if sub.description is None and (help_ := helps.get(name)):
                    sub.description = help_[0].upper() + help_[1:] + "."
                _describe_commands(sub)


def _run_worker(args: argparse.Namespace) -> int:
    from agent.io.settings import to_argv
    from agent.io.worker.process import WorkerBinaryNotFound, find_worker_binary

    try:
        binary = find_worker_binary()
    except WorkerBinaryNotFound as error:
        print(f"baton worker: {error}", file=sys.stderr)
        return 2
    argv = [str(binary), *to_argv(WorkerConfig(**settings_from_args(WorkerConfig, args)))]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)
    return 0  # not reached


def _run_parity(args: argparse.Namespace) -> int:
    import trio

    from agent.core.owner.parity import Scenario
    from agent.harness.parity_run import run_parity
    from agent.io.worker.error import WorkerError
    from agent.io.worker.process import WorkerBinaryNotFound, WorkerStartError

    scenario = None
    if args.edit_after_step is not None:
        scenario = Scenario(
            after_step=args.edit_after_step,
            remove_seq=args.remove_seq,
            trim_seq=args.trim_seq,
            trim_by=args.trim_by if args.trim_seq is not None else 0,
        )
    elif args.remove_seq is not None or args.trim_seq is not None:
        print("baton parity: --remove-seq / --trim-seq need --edit-after-step", file=sys.stderr)
        return 2

    try:
        report = trio.run(
            lambda: run_parity(
                args.model,
                args.cuts,
                sequences=args.sequences,
                steps=args.steps,
                prompt_tokens=args.prompt_tokens,
                scenario=scenario,
                threads=args.threads,
                tolerance=args.tolerance,
                ready_timeout_s=args.ready_timeout,
            )
        )
    except (ValueError, OSError) as error:
        print(f"baton parity: {error}", file=sys.stderr)
        return 2
    except BaseExceptionGroup as group:
        known, rest = group.split(
            (WorkerError, WorkerStartError, WorkerBinaryNotFound, ValueError, OSError, RuntimeError)
        )
        if rest is not None or known is None:
            raise
        for leaf in cli_args.leaf_errors(known):
            print(f"baton parity: {type(leaf).__name__}: {leaf}", file=sys.stderr)
        return 2

    if args.json:
        print(json.dumps(report.to_json()))
    else:
        verdict = "PASS" if report.passed else "FAIL"
        print(f"ranges:        {' '.join(f'[{r.begin}, {r.end})' for r in report.ranges)}")
        print(f"workload:      {report.sequences} sequence(s), prompts {report.prompt_lengths}, {report.steps} steps")
        print(f"max_abs_diff:  {report.max_abs_diff:.3g} (tolerance {report.tolerance:g})")
        print(f"tokens_equal:  {report.tokens_equal} ({report.mismatch_count} mismatched steps)")
        print(f"sequence 0:    {report.text!r}")
        print(verdict)
    return 0 if report.passed else 1


def main(argv: Sequence[str] | None = None) -> int:
    # First: a parent that dies while this one is still parsing or loading must stop it too
    watch_lifeline()
    args = build_parser().parse_args(argv)
    keep_freed_memory()  # every role moves megabyte buffers per step; see process_memory
    try:
        apply_cpu_policy()  # every role wakes the next one per step; see cpu_policy
    except ValueError as error:
        print(f"baton: {error}", file=sys.stderr)
        return 2
    if args.command == "worker":
        return _run_worker(args)
    if args.command in _DELEGATED:
        return importlib.import_module(_DELEGATED[args.command][0]).main(args)
    return _run_parity(args)


if __name__ == "__main__":
    sys.exit(main())
