"""``baton relay``: run the OpenAI-compatible relay, manage its API keys, show its ledger.

  baton relay serve --tracker MADDR --db PATH [--listen HOST:PORT] [--key PATH]
                    [--anonymous-tokens-per-day N] [--max-body-bytes N] [--body-timeout-s S]
                    [--request-timeout-s S]
                    [--step-timeout-s S] [--queue-timeout-s S] [--cache-dir DIR]
                    [--addr-file PATH] [--p2p-listen MADDR] [--log-level LEVEL] [--config PATH]
  baton relay keys add NAME --db PATH [--tokens-per-day N] [--requests-per-minute N]
                    [--max-concurrent N] [--shareable-prefixes]
  baton relay keys list --db PATH [--json]
  baton relay keys revoke NAME --db PATH
  baton relay keys share NAME --db PATH
  baton relay keys unshare NAME --db PATH
  baton relay ledger --db PATH [--json]

``keys add`` prints the new key alone on stdout (so ``KEY=$(baton relay keys add ...)``
works) and, on stderr, that it is shown only this once: the database keeps only its sha256.
``keys list`` shows names, limits, today's usage (UTC) and whether a key is revoked, never a
key. A key's prompt prefixes are cached on the hops for its own requests only, unless it is
made with ``--shareable-prefixes`` or marked by ``keys share`` (``keys unshare`` makes it
private again): shareable keys reuse each other's cached prefixes (docs/SECURITY.md). ``ledger`` shows each node's rows and credit (``rows * (end - begin) / n_layer`` summed
over its completions). ``serve`` is ``agent.io.relay.server.serve_main``; its options are
``RelayConfig``'s fields (``agent.io.relay.config``), also read from ``--config PATH`` (TOML).

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
from agent.io.settings import add_flags

from .config import DEFAULT_LISTEN, RelayConfig, default_cache_dir, parse_listen

__all__ = ["DEFAULT_LISTEN", "add_arguments", "build_parser", "default_cache_dir", "main", "parse_listen"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``serve``, ``keys`` and ``ledger`` sub-commands to ``parser`` (the ``relay`` parser)."""
    commands = parser.add_subparsers(dest="relay_command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the OpenAI-compatible HTTP relay over the swarm")
    add_flags(serve, RelayConfig)
    serve.add_argument(
        "--config", metavar="PATH",
        help="read these options from a TOML file, each under its RelayConfig field name (--body-timeout-s:"
        " body_timeout_s); options given here win over the file's",
    )  # fmt: skip

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
    add.add_argument(
        "--shareable-prefixes",
        action="store_true",
        help="its prompts' prefixes share the hops' prefix caches with every other shareable key's (a public"
        " system prompt computed once; timing can tell such keys what the others sent). Default: its own only",
    )
    listing = key_commands.add_parser("list", help="list the keys (never the keys themselves)")
    listing.add_argument("--db", required=True, help="the relay's SQLite database")
    listing.add_argument("--json", action="store_true", help="print one JSON array")
    revoke = key_commands.add_parser("revoke", help="revoke the live key of that name")
    revoke.add_argument("name", help="the key's name, as given to keys add")
    revoke.add_argument("--db", required=True, help="the relay's SQLite database")
    for command, what in (
        ("share", "let the key's prompt prefixes share the prefix caches with every other shareable key's"),
        ("unshare", "keep the key's prompt prefixes to its own requests again (the default)"),
    ):
        marking = key_commands.add_parser(command, help=what)
        marking.add_argument("name", help="the key's name, as given to keys add")
        marking.add_argument("--db", required=True, help="the relay's SQLite database")

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
        if command in ("keys share", "keys unshare"):
            return _keys_share(args, command == "keys share")
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
        api_key = store.create_key(args.name, limits, shareable_prefixes=args.shareable_prefixes)
    print(api_key, flush=True)
    shared = ", shareable prefixes" if args.shareable_prefixes else ""
    print(
        f"created key {args.name!r} ({_describe_limits(limits)}{shared}). It is shown only this once: "
        "the relay stores only its sha256.",
        file=sys.stderr,
    )
    return 0


def _keys_share(args: argparse.Namespace, shareable: bool) -> int:
    from agent.io.relay.store import open_relay_store

    with open_relay_store(args.db) as store:
        marked = store.set_shareable_prefixes(args.name, shareable)
    command = "keys share" if shareable else "keys unshare"
    if not marked:
        return _fail(command, f"no live key named {args.name!r}")
    what = "shares its prompt prefixes with every other shareable key" if shareable else "keeps its prompt prefixes"
    print(f"key {args.name!r} {what} (from its next request)")
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
                        "shareable_prefixes": key.shareable_prefixes,
                    }
                    for key, usage in keys
                ]
            )
        )
        return 0

    def limit(value: int | None) -> str:
        return "unlimited" if value is None else str(value)

    rows = [
        ("NAME", "TOKENS/DAY", "REQUESTS/MIN", "CONCURRENT", f"TOKENS {today}", "CREATED (UTC)", "PREFIXES", "STATE")
    ]
    rows += [
        (
            key.name,
            limit(key.limits.tokens_per_day),
            limit(key.limits.requests_per_minute),
            limit(key.limits.max_concurrent),
            str(usage.total_tokens),
            _utc_time(key.created_at_s),
            "shareable" if key.shareable_prefixes else "own",
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
