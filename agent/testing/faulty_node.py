"""TEST ONLY: ``baton node`` with its outputs corrupted, as a process (``agent.testing.faulty``).

    python -m agent.testing.faulty_node <baton node's arguments> --corrupt-outputs SCALE
                                        [--corrupt-while-file PATH]

Takes every argument ``baton node`` takes (``agent.io.node.cli.add_arguments``; not its
``install`` / ``status`` subcommands) and runs the same node, with an ``OutputCorrupter``
installed through the node's ``outputs_filter`` hook: the outputs of steps it has not seen
before get noise of SCALE x their RMS, only while PATH exists if given. Tests and the harness
start it (``LocalSwarm.start_node(..., command=FAULTY_NODE_COMMAND)``) to show that the
tracker's checks catch a cheating node; the product's CLI has no such flag.

Runs as ``baton`` does (``agent.cli.main``): the lifeline first, then the process-wide
settings, then the node.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from agent import cli_args
from agent.io.cpu_policy import apply_cpu_policy
from agent.io.lifeline import watch_lifeline
from agent.io.node import cli as node_cli
from agent.io.process_memory import keep_freed_memory
from agent.testing.faulty import CorruptOutputs, OutputCorrupter

__all__ = ["FAULTY_NODE_COMMAND", "build_parser", "main"]

#: the argv prefix that runs this entry point with the current interpreter (node arguments follow)
FAULTY_NODE_COMMAND = (sys.executable, "-m", "agent.testing.faulty_node")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m agent.testing.faulty_node",
        description="TEST ONLY: baton node, corrupting the outputs of steps it has not seen before.",
    )
    node_cli.add_arguments(parser)
    parser.add_argument(
        "--corrupt-outputs", type=cli_args.positive_float, required=True, metavar="SCALE",
        help="add noise of SCALE x their RMS to the outputs of steps this node has not seen before",
    )  # fmt: skip
    parser.add_argument("--corrupt-while-file", metavar="PATH", help="corrupt only while PATH exists")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    watch_lifeline()  # first, as in agent.cli.main: a parent that dies now must stop this one too
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.node_command:
        parser.error("the node's subcommands are not for a faulty node")
    keep_freed_memory()
    try:
        apply_cpu_policy()
    except ValueError as error:
        print(f"faulty_node: {error}", file=sys.stderr)
        return 2
    while_file = os.path.abspath(args.corrupt_while_file) if args.corrupt_while_file else None
    corrupter = OutputCorrupter(CorruptOutputs(scale=args.corrupt_outputs, while_file=while_file))
    return node_cli.main(args, outputs_filter=corrupter)


if __name__ == "__main__":
    sys.exit(main())
