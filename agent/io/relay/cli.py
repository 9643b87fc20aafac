"""``baton relay``: run the OpenAI-compatible relay, manage its API keys, show its ledger.

  baton relay serve --tracker MADDR --db PATH [--listen HOST:PORT] [--key PATH]
                    [--anonymous-tokens-per-day N] [--max-body-bytes N] [--body-timeout-s S]
                    [--request-timeout-s S]
                    [--step-timeout-s S] [--queue-timeout-s S] [--cache-dir DIR]
                    [--addr-file PATH] [--p2p-listen MADDR] [--log-level LEVEL]
  baton relay keys add NAME --db PATH [--tokens-per-day N] [--requests-per-minute N]
                    [--max-concurrent N]
  baton relay keys list --db PATH [--json]
  baton relay keys revoke NAME --db PATH
  baton relay ledger --db PATH [--json]

``keys add`` prints the new key alone on stdout (so ``KEY=$(baton relay keys add ...)``
works) and, on stderr, that it is shown only this once: the database keeps only its sha256.
``keys list`` shows names, limits, today's usage (UTC) and whether a key is revoked, never a
key. ``ledger`` shows each node's rows and credit (``rows * (end - begin) / n_layer`` summed
over its completions). ``serve`` is ``agent.io.relay.server.serve_main``.

Exit status: 0 done; 2 bad arguments, an unknown key name, a name already taken, or a database
that is missing (except for ``keys add``, which creates it) or unusable, with a one-line
message on stderr.

Entry points: ``add_arguments(parser)`` fills a ``relay`` sub-parser; ``main(args) -> int``
runs the parsed command. ``python -m agent.io.relay.cli keys list ...`` runs the same thing.
Only argument parsing, printing and opening resources live here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from agent import cli_args

__all__ = ["DEFAULT_LISTEN", "add_arguments", "build_parser", "default_cache_dir", "main", "parse_listen"]

DEFAULT_LISTEN = "127.0.0.1:8000"


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPV6]:PORT`` -> (host, port); port 0 asks for any free port.

    Raises:
      ValueError: no port, a port outside 0..65535, or an empty host.
    """
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"an IPv6 host goes in brackets, e.g. [::1]:8000, got {text!r}")
    port = int(port_text)
    if not host or port > 65535:
        raise ValueError(f"expected HOST:PORT with a port in 0..65535, got {text!r}")
    return host, port


def _listen_arg(text: str) -> str:
    try:
        parse_listen(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def default_cache_dir() -> Path:
    """``$BATON_CACHE/relay``, else ``~/.cache/baton/relay``."""
    from agent.models import cache_dir

    return cache_dir() / "relay"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``serve``, ``keys`` and ``ledger`` sub-commands to ``parser`` (the ``relay`` parser)."""
    commands = parser.add_subparsers(dest="relay_command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the OpenAI-compatible HTTP relay over the swarm")
    serve.add_argument("--tracker", required=True, help="the tracker's multiaddr, ending in /p2p/<peer id>")
    serve.add_argument("--db", required=True, help="the relay's SQLite database (created if missing)")
    serve.add_argument(
        "--listen", type=_listen_arg, default=DEFAULT_LISTEN, metavar="HOST:PORT",
        help=f"HTTP address (default {DEFAULT_LISTEN}; port 0: any free port, see --addr-file)",
    )  # fmt: skip
    serve.add_argument("--key", help="the relay's Ed25519 peer key file (default: a new key each run)")
    serve.add_argument(
        "--anonymous-tokens-per-day", type=cli_args.non_negative_int, default=0, metavar="N",
        help="tokens per UTC day for requests without an API key, all together (default 0: anonymous access off)",
    )  # fmt: skip
    serve.add_argument(
        "--max-body-bytes", type=cli_args.positive_int, default=1_048_576, metavar="N",
        help="largest request body (default 1048576)",
    )  # fmt: skip
    serve.add_argument(
        "--body-timeout-s", type=cli_args.positive_float, default=30.0, metavar="S",
        help="seconds a request body may take to arrive after its headers, else 408 (default 30)",
    )  # fmt: skip
    serve.add_argument(
        "--request-timeout-s", type=cli_args.positive_float, default=10.0, metavar="S",
        help="seconds one request to the tracker or a node may take (default 10)",
    )  # fmt: skip
    serve.add_argument(
        "--step-timeout-s", type=cli_args.positive_float, default=30.0, metavar="S",
        help="seconds one generation step may take in the swarm (default 30)",
    )  # fmt: skip
    serve.add_argument(
        "--queue-timeout-s", type=cli_args.positive_float, default=60.0, metavar="S",
        help="seconds a request may wait for a route before it is refused (default 60)",
    )  # fmt: skip
    serve.add_argument(
        "--cache-dir", type=Path, default=None, metavar="DIR",
        help="tokenizer and model metadata cache (default $BATON_CACHE/relay or ~/.cache/baton/relay)",
    )  # fmt: skip
    serve.add_argument(
        "--spot-check-rate", type=cli_args.probability, default=0.01, metavar="P",
        help="share of generations replayed through a second route and compared bit for bit (default 0.01)",
    )  # fmt: skip
    serve.add_argument("--addr-file", help='write "http://HOST:PORT" here once listening')
    serve.add_argument(
        "--p2p-listen", default="/ip4/127.0.0.1/tcp/0", metavar="MADDR",
        help="multiaddr of the relay's swarm side (default /ip4/127.0.0.1/tcp/0)",
    )  # fmt: skip
    serve.add_argument("--log-level", default="INFO", help="logging level on stderr (default INFO)")

    keys = commands.add_parser("keys", help="create, list and revoke API keys")
    key_commands = keys.add_subparsers(dest="keys_command", required=True, metavar="COMMAND")
    add = key_commands.add_parser("add", help="create an API key and print it (once)")
    add.add_argument("name", help="the key's name (letters, digits, . _ @ -; at most 64)")
    add.add_argument("--db", required=True, help="the relay's SQLite database (created if missing)")
    add.add_argument(
        "--tokens-per-day",
        type=cli_args.positive_int,
        metavar="N",
        help="tokens (prompt + generated) this key may use per UTC day (default: unlimited)",
    )
    add.add_argument(
        "--requests-per-minute",
        type=cli_args.positive_int,
        metavar="N",
        help="requests this key may start per minute (default: unlimited)",
    )
    add.add_argument(
        "--max-concurrent",
        type=cli_args.positive_int,
        metavar="N",
        help="requests this key may have running at once (default: unlimited)",
    )
    listing = key_commands.add_parser("list", help="list the keys (never the keys themselves)")
    listing.add_argument("--db", required=True, help="the relay's SQLite database")
    listing.add_argument("--json", action="store_true", help="print one JSON array")
    revoke = key_commands.add_parser("revoke", help="revoke the live key of that name")
    revoke.add_argument("name", help="the key's name, as given to keys add")
    revoke.add_argument("--db", required=True, help="the relay's SQLite database")

    ledger = commands.add_parser("ledger", help="each node's rows and credit")
    ledger.add_argument("--db", required=True, help="the relay's SQLite database")
    ledger.add_argument("--json", action="store_true", help="print one JSON array")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton relay", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return parser


def main(args: argparse.Namespace) -> int:
    """Run a parsed ``baton relay`` command; returns the exit status."""
    if args.relay_command == "serve":
        if args.cache_dir is None:
            args.cache_dir = default_cache_dir()
        from agent.io.relay.server import serve_main

        return serve_main(args)
    command = args.relay_command if args.relay_command == "ledger" else f"keys {args.keys_command}"
    from agent.io.relay.store import StoreError

    try:
        if command == "keys add":
            return _keys_add(args)
        if not Path(args.db).is_file():
            return _fail(command, f"no relay database at {args.db}")
        if command == "keys list":
            return _keys_list(args)
        if command == "keys revoke":
            return _keys_revoke(args)
        return _ledger(args)
    except (StoreError, ValueError, OSError) as error:
        return _fail(command, str(error))


def _fail(command: str, message: str) -> int:
    print(f"baton relay {command}: {message}", file=sys.stderr)
    return 2


def _keys_add(args: argparse.Namespace) -> int:
    from agent.core.relay.quotas import KeyLimits
    from agent.io.relay.store import open_relay_store

    limits = KeyLimits(
        tokens_per_day=args.tokens_per_day,
        requests_per_minute=args.requests_per_minute,
        max_concurrent=args.max_concurrent,
    )
    with open_relay_store(args.db) as store:
        api_key = store.create_key(args.name, limits)
    print(api_key, flush=True)
    print(
        f"created key {args.name!r} ({_describe_limits(limits)}). It is shown only this once: "
        "the relay stores only its sha256.",
        file=sys.stderr,
    )
    return 0


def _describe_limits(limits) -> str:
    parts = [
        f"{limits.tokens_per_day} tokens/day" if limits.tokens_per_day is not None else "",
        f"{limits.requests_per_minute} requests/minute" if limits.requests_per_minute is not None else "",
        f"{limits.max_concurrent} concurrent" if limits.max_concurrent is not None else "",
    ]
    return ", ".join(p for p in parts if p) or "unlimited"


def _utc_time(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _keys_list(args: argparse.Namespace) -> int:
    from agent.core.relay.quotas import day_of
    from agent.io.relay.store import open_relay_store

    today = day_of(time.time())
    with open_relay_store(args.db) as store:
        keys = [(key, store.usage_on(key.name, today)) for key in store.list_keys()]
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "name": key.name,
                        "limits": key.limits.as_dict(),
                        "day": today,
                        "prompt_tokens_today": usage.prompt_tokens,
                        "completion_tokens_today": usage.completion_tokens,
                        "tokens_today": usage.total_tokens,
                        "created_at_s": key.created_at_s,
                        "revoked": key.revoked,
                    }
                    for key, usage in keys
                ]
            )
        )
        return 0

    def limit(value: int | None) -> str:
        return "unlimited" if value is None else str(value)

    rows = [("NAME", "TOKENS/DAY", "REQUESTS/MIN", "CONCURRENT", f"TOKENS {today}", "CREATED (UTC)", "STATE")]
    rows += [
        (
            key.name,
            limit(key.limits.tokens_per_day),
            limit(key.limits.requests_per_minute),
            limit(key.limits.max_concurrent),
            str(usage.total_tokens),
            _utc_time(key.created_at_s),
            "revoked" if key.revoked else "live",
        )
        for key, usage in keys
    ]
    _print_table(rows)
    return 0


def _keys_revoke(args: argparse.Namespace) -> int:
    from agent.io.relay.store import open_relay_store

    with open_relay_store(args.db) as store:
        revoked = store.revoke_key(args.name)
    if not revoked:
        return _fail("keys revoke", f"no live key named {args.name!r}")
    print(f"revoked key {args.name!r}")
    return 0


def _ledger(args: argparse.Namespace) -> int:
    from agent.io.relay.store import open_relay_store

    with open_relay_store(args.db) as store:
        entries = store.ledger()
    if args.json:
        print(
            json.dumps(
                [
                    {"peer_id": e.peer_id, "rows": e.rows, "credit": e.credit, "completions": e.completions}
                    for e in entries
                ]
            )
        )
        return 0
    rows = [("PEER ID", "ROWS", "CREDIT", "COMPLETIONS")]
    rows += [(e.peer_id, str(e.rows), f"{e.credit:.3f}", str(e.completions)) for e in entries]
    _print_table(rows)
    return 0


def _print_table(rows: Sequence[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
