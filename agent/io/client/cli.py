"""``baton generate``: one generation through the swarm, streamed to stdout.

``baton generate --tracker MADDR --model ALIAS [--max-tokens N] [--temperature T] [--top-k K]
[--top-p P] [--seed S] [--json] "prompt"`` asks the tracker for a route, streams the text as it
is generated, then prints the route and tokens/s (``--json``: one object instead, with keys
text, tokens, route, tokens_per_s, first_token_s, decode_tokens_per_s (the tokens after the
first over the decode's wall time), drafted_tokens and accepted_tokens (0: no speculation
yet), ...). Exit status: 0 done, 1 the generation failed (the
message names the failed peer when one is known), 2 bad arguments or no admission / route.

Only argument parsing and printing live here; the work is in ``agent.io.client.swarm``.
``agent.cli`` wires ``add_arguments`` / ``main`` in as the ``generate`` command.
"""

from __future__ import annotations

import argparse
import json
import sys

from agent import cli_args
from agent.io.settings import add_flags, settings_from_args

from .config import SwarmClientConfig

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tracker", required=True, help="the tracker's multiaddr, ending in /p2p/<peer id>")
    parser.add_argument("--model", required=True, help="model alias, name or sha256 known to the tracker")
    parser.add_argument(
        "--max-tokens", type=cli_args.positive_int, default=48, help="tokens to generate at most (default 48)"
    )
    parser.add_argument(
        "--temperature", type=cli_args.non_negative_float, default=0.0, help="sampling temperature (default 0: greedy)"
    )
    parser.add_argument(
        "--top-k", type=cli_args.non_negative_int, default=0, help="keep the K most likely tokens (default 0: all)"
    )
    parser.add_argument(
        "--top-p", type=cli_args.unit_interval, default=1.0, help="nucleus sampling mass (default 1.0: all)"
    )
    parser.add_argument("--seed", type=int, help="random seed: the same seed and route give the same text")
    parser.add_argument("--key", help="the client's key file (default: a new key for this run)")
    parser.add_argument(
        "--listen",
        action="append",
        help="multiaddr the last hop pushes results to (repeatable; default /ip4/127.0.0.1/tcp/0)",
    )
    add_flags(parser, SwarmClientConfig)
    parser.add_argument(
        "--cache-dir",
        help="where the model's metadata-only copy for the local tokenizer lives (default $BATON_CACHE/client)",
    )
    parser.add_argument(
        "--remote-tokenizer", action="store_true",
        help="tokenize and detokenize on the route's first hop instead of locally (no worker binary needed)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    parser.add_argument("prompt", help="the prompt text")


def main(args: argparse.Namespace) -> int:
    import trio

    from agent.io.net.transport import TransportError

    from .outcome import GenerationError, SwarmError
    from .swarm import open_swarm_client

    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as error:  # argv bytes that are not UTF-8 arrive as lone surrogates
        bad = args.prompt[error.start]
        what = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"\\u{ord(bad):04x}"
        print(f"baton generate: the prompt is not valid UTF-8 text: {what} at character {error.start}", file=sys.stderr)
        return 2
    key = None
    if args.key:
        from agent.io.keys import KeyFileError, load_or_create_key

        try:
            key = load_or_create_key(args.key)
        except (KeyFileError, OSError) as error:
            print(f"baton generate: key {args.key}: {error}", file=sys.stderr)
            return 2
    try:
        config = SwarmClientConfig(**settings_from_args(SwarmClientConfig, args))
    except ValueError as error:
        print(f"baton generate: {error}", file=sys.stderr)
        return 2

    def show(text: str) -> None:
        print(text, end="", flush=True)

    async def run():
        async with open_swarm_client(
            args.tracker, key=key, config=config, listen_addrs=args.listen or ("/ip4/127.0.0.1/tcp/0",)
        ) as client:
            async with trio.open_nursery() as nursery:
                vocab = None if args.remote_tokenizer else await _local_vocab(nursery, client, args)
                result = await client.generate(
                    args.model, args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                    top_k=args.top_k, top_p=args.top_p, seed=args.seed, on_text=None if args.json else show,
                    vocab=vocab,
                )  # fmt: skip
                nursery.cancel_scope.cancel()  # the vocab worker
            return result

    try:
        result = trio.run(run)
    except BaseException as caught:
        leaves = cli_args.known_failures(caught, (GenerationError, SwarmError, TransportError, ValueError, OSError))
        status = 1 if any(isinstance(leaf, GenerationError) for leaf in leaves) else 2
        if not args.json:
            print(file=sys.stderr)
        for leaf in leaves:
            failed = getattr(leaf, "failed_peer_id", "")
            suffix = f" (failed peer: {failed})" if failed else ""
            print(f"baton generate: {leaf}{suffix}", file=sys.stderr)
        return status

    if args.json:
        print(json.dumps(result.to_json()))
    else:
        route_text = " -> ".join(f"{hop['node']}[{hop['begin']}, {hop['end']})" for hop in result.route)
        print()
        print(f"route:         {route_text}")
        print(
            f"tokens/s:      {result.tokens_per_s:.1f} decode, {result.prefill_tokens_per_s:.1f} prefill "
            f"({len(result.tokens)} tokens{', stopped by end of generation' if result.stopped_by_token else ''})"
        )
        if result.replans:
            resumed = ", ".join(f"{s:.2f} s" for s in result.resume_s)
            print(
                f"recovered:     {result.replans} lost hop(s); {result.resumes} replaced with the other hops' "
                f"caches kept{f' ({resumed})' if resumed else ''}, {result.replans - result.resumes} by a re-prefill"
            )
    return 0


async def _local_vocab(nursery, client, args: argparse.Namespace):
    """The model's vocabulary held here (``agent.io.worker.vocab``), or None when it cannot be (then
    the first hop tokenizes): tokenizing and detokenizing locally keeps every client path off
    the hops, so a lost hop only costs a replan of the steps."""
    from pathlib import Path

    from agent.io.worker.process import WorkerBinaryNotFound, find_worker_binary
    from agent.io.worker.vocab import VocabularyError, serve_vocabularies
    from agent.models import cache_dir

    try:
        find_worker_binary()
    except WorkerBinaryNotFound as error:
        print(f"baton generate: no local tokenizer ({error}); the first hop tokenizes", file=sys.stderr)
        return None
    folder = Path(args.cache_dir) if args.cache_dir else cache_dir() / "client"
    pool = await nursery.start(
        lambda task_status: serve_vocabularies(client.model_metadata, folder, task_status=task_status)
    )
    try:
        return await pool.get(args.model)
    except VocabularyError as error:
        print(f"baton generate: no local tokenizer ({error}); the first hop tokenizes", file=sys.stderr)
        return None


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="baton generate", description=__doc__.split("\n\n")[0])
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
