"""``baton demo``: the swarm demo (default) or the local range-workers demo (``--local``).

``baton demo [--model PATH] [--max-tokens N] [--threads N] [--nodes N] [--json] [--serve] [prompt]``
starts a tracker, ``--nodes`` (3) nodes on loopback, each offered memory for about a third of
the model, and the relay; generates through the relay's OpenAI-compatible HTTP API over the
route the tracker plans, and compares with one unsplit worker. ``--json`` prints one object
with keys via ("relay"), route, text, tokens_per_s, tokens_equal_single_process (and more).
``--serve`` keeps the swarm and relay running until Ctrl-C or SIGTERM (exit 0), after printing one
JSON line ``{"base_url", "api_key", "model", "status_page"}`` for any OpenAI client. ``--local``
runs ``agent.demo.local_demo`` instead (range workers started directly, no tracker; ``--ranges``
/ ``--cuts`` apply there).
Exit status: 0 when the tokens equal the unsplit worker's, 1 when not, 2 on errors, 128 + the
signal's number when SIGTERM or Ctrl-C stopped it first. Every process it started is stopped
before it exits, and stops by itself if the demo is killed (``agent.io.lifeline``).

Only argument parsing and printing live here. ``agent.cli`` wires ``add_arguments`` / ``main``
in as the ``demo`` command.
"""

from __future__ import annotations

import argparse
import json
import sys

from agent import cli_args

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="GGUF file (default: the cached SmolLM2-135M)")
    parser.add_argument("--max-tokens", type=cli_args.positive_int, default=48, help="tokens to generate (default 48)")
    parser.add_argument("--threads", type=cli_args.positive_int, default=1, help="threads per worker (default 1)")
    parser.add_argument("--nodes", type=cli_args.positive_int, default=3, help="swarm nodes to start (default 3)")
    parser.add_argument(
        "--coverage-timeout-s", type=float, default=180.0,
        help="how long the swarm may take to cover the model (default 180)",
    )  # fmt: skip
    parser.add_argument("--workdir", help="keep keys, tracker db and process logs here (default: a temp dir)")
    parser.add_argument("--local", action="store_true", help="local range workers instead of a swarm")
    parser.add_argument(
        "--ranges", type=cli_args.positive_int, default=3, help="--local: ranges of equal size (default 3)"
    )
    parser.add_argument("--cuts", type=cli_args.cuts, help="--local: cut points instead of --ranges, e.g. 10,20")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    parser.add_argument(
        "--serve", action="store_true",
        help="keep the swarm and relay running until Ctrl-C or SIGTERM; first print one JSON line "
        "with base_url, api_key and model for any OpenAI client",
    )  # fmt: skip
    parser.add_argument("prompt", nargs="?", help="the prompt (default: a fixed one)")


def _known_errors() -> tuple[type[BaseException], ...]:
    from agent.demo.swarm_demo import RelayError
    from agent.harness.local_swarm import ProcessDied
    from agent.io.client import GenerationError, SwarmError
    from agent.io.net.transport import TransportError
    from agent.io.worker.error import WorkerError
    from agent.io.worker.process import WorkerBinaryNotFound, WorkerStartError

    return (
        GenerationError, SwarmError, ProcessDied, TransportError, WorkerError, WorkerStartError,
        WorkerBinaryNotFound, RelayError, TimeoutError, ValueError, OSError,
    )  # fmt: skip


def main(args: argparse.Namespace) -> int:
    import signal

    import trio

    from agent.demo.local_demo import DEMO_PROMPT

    if args.model is None:
        from agent.models import model_path

        args.model = str(model_path("smollm2"))
    prompt = args.prompt or DEMO_PROMPT
    if args.serve:
        return _serve(args)

    def show(text: str) -> None:
        print(text, end="", flush=True)

    on_text = None if args.json else show
    if not args.json:
        print(prompt, end="", flush=True)

    if args.local:
        from agent.demo.local_demo import run_demo

        def run():
            return run_demo(
                args.model, ranges=args.ranges, cuts=args.cuts, prompt=prompt, max_new_tokens=args.max_tokens,
                threads=args.threads, on_text=on_text,
            )  # fmt: skip
    else:
        from agent.demo.swarm_demo import run_swarm_demo

        def run():
            return run_swarm_demo(
                args.model, prompt=prompt, max_new_tokens=args.max_tokens, nodes=args.nodes, threads=args.threads,
                coverage_timeout_s=args.coverage_timeout_s, workdir=args.workdir, on_text=on_text,
            )  # fmt: skip

    from agent.io.stop_signals import run_until_stop_signal

    try:
        report, stopped_by = trio.run(run_until_stop_signal, run)
    except BaseException as caught:
        for leaf in cli_args.known_failures(caught, _known_errors()):
            print(f"\nbaton demo: {type(leaf).__name__}: {leaf}", file=sys.stderr)
        return 2
    if report is None:
        # stopped before the end, every process stopped first: the shell's code for a signal
        assert stopped_by is not None  # no report: a signal stopped it
        print(f"\nbaton demo: stopped by {signal.Signals(stopped_by).name}", file=sys.stderr)
        return 128 + stopped_by

    result = report.to_json()
    if args.json:
        print(json.dumps(result))
    else:
        route = " -> ".join(f"{hop['node']}[{hop['begin']}, {hop['end']})" for hop in result["route"])
        print()
        print(f"route:         {route}")
        print(
            f"tokens/s:      {result['tokens_per_s']:.1f} decode, {result['prefill_tokens_per_s']:.1f} prefill "
            f"(one unsplit worker: {result['single_process_tokens_per_s']:.1f} decode)"
        )
        print(f"parity:        tokens equal to one unsplit worker: {result['tokens_equal_single_process']}")
    return 0 if report.tokens_equal_single_process else 1


def _serve(args: argparse.Namespace) -> int:
    import signal

    import trio

    # Ctrl-C ends the demo even when it was started with SIGINT ignored (a job a
    # non-interactive shell put in the background inherits that, and Python then keeps it)
    signal.signal(signal.SIGINT, signal.default_int_handler)

    from agent.demo.swarm_demo import serve_swarm_demo
    from agent.io.stop_signals import run_until_stop_signal

    def ready(info: dict) -> None:
        print(json.dumps(info), flush=True)
        print(
            f"baton demo: serving until Ctrl-C or SIGTERM; point an OpenAI client at {info['base_url']} "
            f"(model {info['model']!r}), status page at {info['status_page']}",
            file=sys.stderr, flush=True,
        )  # fmt: skip

    def serve():
        return serve_swarm_demo(
            args.model, nodes=args.nodes, threads=args.threads, coverage_timeout_s=args.coverage_timeout_s,
            workdir=args.workdir, on_ready=ready,
        )  # fmt: skip

    try:
        # SIGTERM (kill, systemd, docker stop) as Ctrl-C: the swarm is stopped, then exit 0
        trio.run(run_until_stop_signal, serve)
    except KeyboardInterrupt:  # Ctrl-C before the signal receiver was in place
        return 0
    except BaseException as caught:
        for leaf in cli_args.known_failures(caught, _known_errors()):
            print(f"baton demo: {type(leaf).__name__}: {leaf}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="baton demo", description=__doc__.split("\n\n")[0])
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
