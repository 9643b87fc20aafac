"""``baton tracker``: run the tracker, or list the models or nodes its database holds.

  baton tracker serve --db PATH --key PATH [--listen MULTIADDR] [--addr-file PATH] [--no-relay]
                      [--register-model PATH[:ALIAS] ...] [--model-source ALIAS=URL ...]
                      [--serve-models [HOST:]PORT] [--models-base-url URL] [--heartbeat-interval-ms N]
                      [--heartbeat-timeout-ms N] [--admission-ttl-ms N]
                      [--registration-max-age-ms N] [--expected-pin COMMIT]
                      [--expected-patch-hash HASH] [--canary-interval-s S] [--canary-* ...]
  baton tracker models --db PATH
  baton tracker nodes --db PATH [--json]

``serve`` registers the given GGUF files (alias: ALIAS, else the file name without .gguf;
name: general.name), opens the libp2p host, prints ``tracker listening on <multiaddr>`` as its
first stdout line, writes that multiaddr to ``--addr-file`` (atomically: a temporary file
renamed into place) and serves until SIGINT / SIGTERM (exit 0).

Model distribution: a node without a model's file fetches only its ranges' bytes by HTTP
range requests (every byte checked against the tracker-signed manifest that
``model_metadata`` replies carry). ``--model-source ALIAS=URL`` registers a mirror of a model
(any HTTP server that honours ``Range``); ``--serve-models [HOST:]PORT`` makes the tracker serve
its registered files itself at ``http://HOST:PORT/models/<sha256>.gguf`` (HOST defaults to
127.0.0.1; ``--models-base-url`` is the address nodes are told when that differs, e.g. behind
NAT or a proxy).

Canary checks (``agent.core.tracker.canary``, docs/INTEGRITY.md): unless ``--canary-interval-s 0``, the
tracker's verifier checks every range a node reports READY at once (it is routed only once it
passed: ``--no-canary-gate`` routes it before) and then every ``--canary-interval-s`` on average
(each gap drawn from [0.5, 1.5] x that), with its own reference workers of the registered files
(``--canary-threads``, whose idle threads wait as ``--canary-worker-wait`` says; the worker binary
must be there). A failed check withdraws the range; ``--canary-refuse-after`` failed checks
refuse the node.

``models`` and ``nodes`` read the database (a running tracker's too: WAL allows readers).
``nodes`` prints each node's peer id, whether it was alive when the tracker last decided,
its last heartbeat, usable memory, addresses and ranges: every range it is assigned or its
last heartbeat reported, with the reported state (``-``: assigned, not reported loading),
``unassigned`` for a reported range the tracker did not give it, and the errors of FAILED
ranges below the table, the checks each node passed (CHECKS) and, below the table, every check it
failed with its evidence (the check, the range and step, what was compared, the expected and
returned sha256) and why it is refused. ``--json`` prints one JSON object ``{"nodes": [...]}`` with the
``NodeEntry`` fields (states by name).

The tracker is also a circuit relay v2 (unless ``--no-relay``): a node that cannot be dialled
(``baton node --relay``) reserves a slot on it and is reached at
``<tracker addr>/p2p-circuit/p2p/<node id>``. Only admitted nodes that are alive (or pending
after a restart) may hold a reservation or be the destination of a circuit; only such nodes and
admitted clients may open circuits (``Tracker.may_hold_relay_reservation`` /
``may_open_relay_circuit``).

Entry points: ``add_arguments(parser)`` fills a ``tracker`` sub-parser; ``main(args) -> int``
runs the parsed command. ``python -m agent.io.tracker.cli serve ...`` runs the same thing.
Only argument parsing, printing and opening resources live here.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from agent import cli_args
from agent.core.node.worker_wait import AUTO, WAIT_CHOICES
from agent.core.tracker.heartbeat import MAX_ERROR_CHARS
from agent.core.wire.swarm_wire import MAX_ADDR_CHARS, printable

__all__ = ["add_arguments", "build_parser", "main", "parse_model_arg"]

log = logging.getLogger(__name__)


def parse_model_arg(text: str) -> tuple[Path, str]:
    """``PATH[:ALIAS]`` -> (path, alias); the alias defaults to the file name without .gguf.
    A colon followed by something with a ``/`` is part of the path."""
    path_text, sep, alias = text.rpartition(":")
    if not sep or not alias or "/" in alias or not path_text:
        path_text, alias = text, ""
    path = Path(path_text)
    if not alias:
        alias = path.name.removesuffix(".gguf")
    return path, alias


def _model_arg(text: str) -> tuple[Path, str]:
    path, alias = parse_model_arg(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{path} is not a file")
    return path, alias


def _hf_repo_arg(text: str) -> tuple[str, str]:
    alias, sep, repo = text.partition("=")
    if not sep or not alias or repo.count("/") != 1 or repo.startswith("/") or repo.endswith("/"):
        raise argparse.ArgumentTypeError(f"expected ALIAS=ORG/NAME, got {text!r}")
    return alias, repo


def _source_arg(text: str) -> tuple[str, str]:
    alias, sep, url = text.partition("=")
    if not sep or not alias or not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected ALIAS=http(s)://..., got {text!r}")
    return alias, url


def _host_port_arg(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", text
    if not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected [HOST:]PORT, got {text!r}")
    return (host.strip("[]") or "127.0.0.1"), int(port)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``serve``, ``models`` and ``nodes`` sub-commands to ``parser`` (the ``tracker`` parser)."""
    commands = parser.add_subparsers(dest="tracker_command", required=True, metavar="COMMAND")
    serve = commands.add_parser("serve", help="run the tracker")
    serve.add_argument("--db", required=True, help="SQLite database (created if missing)")
    serve.add_argument("--key", required=True, help="Ed25519 key file (created if missing; fixes the peer id)")
    serve.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0", help="multiaddr (default /ip4/127.0.0.1/tcp/0)")
    serve.add_argument("--addr-file", help="write the full multiaddr (with /p2p/<id>) here once listening")
    serve.add_argument(
        "--no-relay", dest="relay", action="store_false",
        help="do not act as a circuit relay for nodes that cannot be dialled (default: relay for admitted nodes)",
    )  # fmt: skip
    serve.add_argument(
        "--register-model", action="append", default=[], type=_model_arg, metavar="PATH[:ALIAS]",
        help="register a GGUF model (repeatable)",
    )  # fmt: skip
    serve.add_argument(
        "--hf-repo", action="append", default=[], type=_hf_repo_arg, metavar="ALIAS=ORG/NAME",
        help="the Hugging Face repo of a registered model (default: what its GGUF metadata names)",
    )  # fmt: skip
    serve.add_argument(
        "--model-source", action="append", default=[], type=_source_arg, metavar="ALIAS=URL",
        help="an HTTP(S) URL serving a registered model's file with range requests (a mirror)",
    )  # fmt: skip
    serve.add_argument(
        "--serve-models", type=_host_port_arg, metavar="[HOST:]PORT",
        help="serve the registered model files over HTTP for nodes to fetch by range (HOST default 127.0.0.1)",
    )  # fmt: skip
    serve.add_argument("--models-base-url", metavar="URL", help="the base URL nodes reach --serve-models at")
    serve.add_argument(
        "--heartbeat-interval-ms",
        type=cli_args.positive_int,
        default=1000,
        metavar="MS",
        help="how often nodes send heartbeats, in ms (default 1000)",
    )
    serve.add_argument(
        "--heartbeat-timeout-ms",
        type=cli_args.positive_int,
        default=5000,
        metavar="MS",
        help="a node not heard for this many ms is dead and loses its ranges (default 5000)",
    )
    serve.add_argument(
        "--admission-ttl-ms",
        type=cli_args.positive_int,
        default=600_000,
        metavar="MS",
        help="how long a signed admission stays valid, in ms; nodes and clients renew it (default 600000: 10 min)",
    )
    serve.add_argument(
        "--registration-max-age-ms", type=cli_args.positive_int, default=60_000,
        help="fingerprint / hello timestamps must be this fresh (default 60000)",
    )  # fmt: skip
    serve.add_argument("--expected-pin", help="llama.cpp commit nodes must run (default: this checkout's)")
    serve.add_argument("--expected-patch-hash", help="patch series sha256 nodes must have (default: this checkout's)")
    serve.add_argument(
        "--canary-interval-s", type=cli_args.non_negative_float, default=300.0, metavar="S",
        help="mean seconds between two canary checks of one served range (default 300; 0: no checks)",
    )  # fmt: skip
    serve.add_argument(
        "--canary-max-prompt-rows", type=cli_args.positive_int, default=32, metavar="N",
        help="a canary's prompt has 1..N rows (default 32)",
    )  # fmt: skip
    serve.add_argument(
        "--canary-max-decode-steps", type=cli_args.non_negative_int, default=4, metavar="N",
        help="a canary has 1..N decode steps after its prompt (default 4)",
    )  # fmt: skip
    serve.add_argument(
        "--canary-refuse-after", type=cli_args.positive_int, default=2, metavar="N",
        help="refuse a node once its output failed N checks (default 2; fewer withdraw the range)",
    )  # fmt: skip
    serve.add_argument(
        "--canary-cross-recipe-rel-error", type=cli_args.non_negative_float, default=0.02, metavar="X",
        help="for a node of another recipe (backend): the relative RMS error allowed (default 0.02)",
    )  # fmt: skip
    serve.add_argument(
        "--canary-threads",
        type=cli_args.positive_int,
        default=1,
        metavar="N",
        help="CPU threads per reference worker (default 1)",
    )
    serve.add_argument(
        "--canary-worker-wait", choices=WAIT_CHOICES, default=AUTO,
        help="how a reference worker's idle threads wait for work, as a node's --worker-wait: spin, sleep (a"
        " microseconds' spin, then sleep) or auto (the default: sleep when a Baton node or worker already runs on this"
        " host, else spin; OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment are kept)",
    )  # fmt: skip
    serve.add_argument(
        "--no-canary-gate", dest="canary_gate", action="store_false",
        help="route a newly READY range before it passed its first check (default: only after)",
    )  # fmt: skip
    serve.add_argument("--log-level", default="INFO", help="logging level on stderr (default INFO)")

    models = commands.add_parser("models", help="list the registered models")
    models.add_argument("--db", required=True, help="the tracker's SQLite database")

    nodes = commands.add_parser("nodes", help="list the admitted nodes, their ranges and states")
    nodes.add_argument("--db", required=True, help="the tracker's SQLite database")
    nodes.add_argument("--json", action="store_true", help="print one JSON object")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton tracker", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return parser


def main(args: argparse.Namespace) -> int:
    """Run a parsed ``baton tracker`` command; returns the exit status."""
    if args.tracker_command == "models":
        return _models(args)
    if args.tracker_command == "nodes":
        return _nodes(args)
    return _serve(args)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _print_table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def _read_store(command: str, db: str, read):
    """``read(store)`` on the database at ``db``; None (after saying why on stderr) when there
    is none or it is not a tracker database."""
    from agent.io.tracker.store import StoreError, open_store

    if not Path(db).is_file():
        print(f"baton tracker {command}: no tracker database at {db}", file=sys.stderr)
        return None
    try:
        with open_store(db) as store:
            return read(store)
    except StoreError as error:
        print(f"baton tracker {command}: {error}", file=sys.stderr)
        return None


def _models(args: argparse.Namespace) -> int:
    models = _read_store("models", args.db, lambda store: store.models())
    if models is None:
        return 2
    rows = [("ALIAS", "NAME", "HF REPO", "SHA256", "ARCHITECTURE", "BLOCKS", "SIZE")]
    rows += [
        (m.alias, m.name, m.hf_repo or "-", m.sha256[:12], m.architecture, str(m.n_layer), _human_bytes(m.size_bytes))
        for m in models
    ]
    _print_table(rows)
    return 0


def _state_name(state: int) -> str:
    from agent._proto import swarm_pb2

    return swarm_pb2.AssignmentStatus.State.Name(state)


def _node_ranges(entry, aliases: dict[str, str]) -> list[tuple[str, str, str]]:
    """(range, state, error) for every range ``entry`` (a ``NodeEntry``) is assigned or
    reported serving, in (model, begin, end) order; range as ``alias[begin, end)``."""
    reported = {(s.assignment.model_sha256, s.assignment.begin, s.assignment.end): s for s in entry.serving}
    assigned = {(a.model_sha256, a.begin, a.end) for a in entry.assigned}
    ranges = []
    for key in sorted(assigned | set(reported)):
        sha, begin, end = key
        status = reported.get(key)
        state = "-" if status is None else _state_name(status.state)
        if status is not None and status.fetch_total_bytes and status.fetched_bytes < status.fetch_total_bytes:
            state += f" fetching {100 * status.fetched_bytes // status.fetch_total_bytes}%"
        if key not in assigned:
            state += " unassigned"
        ranges.append((f"{aliases.get(sha, sha[:12])}[{begin}, {end})", state, "" if status is None else status.error))
    return ranges


def _utc(ms: int) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _failure_json(failure) -> dict:
    return {
        "check_id": failure.check_id,
        "model_sha256": failure.assignment.model_sha256,
        "begin": failure.assignment.begin,
        "end": failure.assignment.end,
        "step": failure.step,
        "output": failure.output,
        "expected_sha256": failure.expected_sha256,
        "returned_sha256": failure.returned_sha256,
        "max_abs_diff": failure.max_abs_diff,
        "at_ms": failure.at_ms,
        "detail": failure.detail,
    }


def _failure_line(failure, aliases: dict[str, str]) -> str:
    """One failed check as an operator reads it."""
    a = failure.assignment
    return (
        f"INTEGRITY {failure.check_id} {aliases.get(a.model_sha256, a.model_sha256[:12])}[{a.begin}, {a.end}) "
        f"step {failure.step} at {_utc(failure.at_ms)}: {failure.output} differ: expected sha256 "
        f"{failure.expected_sha256 or '-'}, returned {failure.returned_sha256 or '-'}, largest difference "
        f"{failure.max_abs_diff:.3g} ({failure.detail})"
    )


def _node_json(entry) -> dict:
    return {
        "peer_id": entry.peer_id,
        "listen_addrs": list(entry.listen_addrs),
        "alive": entry.alive,
        "last_heartbeat_ms": entry.last_heartbeat_ms,
        "usable_memory_bytes": entry.usable_memory_bytes,
        "serving": [
            {
                "model_sha256": s.assignment.model_sha256,
                "begin": s.assignment.begin,
                "end": s.assignment.end,
                "state": _state_name(s.state),
                "error": s.error,
                "recipe_hash": s.recipe_hash,
                "fetched_bytes": s.fetched_bytes,
                "fetch_total_bytes": s.fetch_total_bytes,
            }
            for s in entry.serving
        ],
        "assigned": [{"model_sha256": a.model_sha256, "begin": a.begin, "end": a.end} for a in entry.assigned],
        "checks_passed": entry.checks_passed,
        "integrity_failures": [_failure_json(f) for f in entry.integrity_failures],
        "refused": entry.refused,
    }


def _nodes(args: argparse.Namespace) -> int:
    import json

    read = _read_store(
        "nodes", args.db, lambda store: (store.node_entries(), {m.sha256: m.alias for m in store.models()})
    )
    if read is None:
        return 2
    entries, aliases = read
    if args.json:
        print(json.dumps({"nodes": [_node_json(entry) for entry in entries]}, indent=2))
        return 0
    rows = [("PEER ID", "ALIVE", "LAST HEARTBEAT (UTC)", "MEMORY", "ADDRS", "CHECKS", "RANGES")]
    failures = []
    for entry in entries:
        ranges = _node_ranges(entry, aliases)
        rows.append((
            entry.peer_id,
            "yes" if entry.alive else "no",
            _utc(entry.last_heartbeat_ms),
            _human_bytes(entry.usable_memory_bytes),
            ",".join(printable(a, MAX_ADDR_CHARS) for a in entry.listen_addrs) or "-",
            _checks(entry),
            ", ".join(f"{name} {state}" for name, state, _ in ranges) or "-",
        ))  # fmt: skip
        failures += [(entry.peer_id, name, error) for name, _, error in ranges if error]
        failures += [(entry.peer_id, _failure_line(f, aliases), "") for f in entry.integrity_failures]
        if entry.refused:
            failures.append((entry.peer_id, "REFUSED", entry.refused))
    _print_table(rows)
    for peer_id, name, error in failures:
        # (checked at intake; escaped here too for what a database of an older tracker holds)
        error = printable(error, MAX_ERROR_CHARS)
        print(f"  {peer_id} {name}: {error}" if error else f"  {peer_id} {name}")
    return 0


def _checks(entry) -> str:
    """The CHECKS column: passed and failed checks, refused."""
    if entry.refused:
        return f"REFUSED ({len(entry.integrity_failures)} failed)"
    if entry.integrity_failures:
        return f"{entry.checks_passed} ok, {len(entry.integrity_failures)} FAILED"
    return f"{entry.checks_passed} ok" if entry.checks_passed else "-"


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def register_models(
    store,
    models: Sequence[tuple[Path, str]],
    now_ms: int,
    hf_repos: dict[str, str] | None = None,
    sources: dict[str, str] | None = None,
) -> list:
    """Read each GGUF and put its ``ModelEntry`` in ``store`` (synchronous; seconds per model).
    ``hf_repos`` maps an alias to its Hugging Face repo (else the GGUF's own metadata says);
    ``sources`` an alias to the URL nodes fetch it from by range."""
    from agent.core.tracker.registry import model_entry
    from agent.io.tracker.gguf_info import read_gguf_facts
    from agent.models import cached_sha256

    entries = []
    for path, alias in models:
        facts = read_gguf_facts(path)
        entry = model_entry(facts, cached_sha256(path), alias, hf_repo=(hf_repos or {}).get(alias, ""))
        store.put_model(entry, now_ms, path, (sources or {}).get(alias))
        entries.append(entry)
    return entries


def _canary_policy(args: argparse.Namespace):
    """The ``CanaryPolicy`` of ``serve``'s flags (None: ``--canary-interval-s 0``).

    Raises:
      ValueError: inconsistent values (the policy says which).
    """
    from agent.core.tracker.canary import CanaryPolicy

    interval_s = getattr(args, "canary_interval_s", 0.0)
    if not interval_s:
        return None
    return CanaryPolicy(
        interval_s=interval_s,
        max_prompt_rows=args.canary_max_prompt_rows,
        min_decode_steps=min(1, args.canary_max_decode_steps),
        max_decode_steps=args.canary_max_decode_steps,
        refuse_after_failures=args.canary_refuse_after,
        cross_recipe_rel_error=args.canary_cross_recipe_rel_error,
        gate_new_ranges=args.canary_gate,
    )


def verifier_config(args: argparse.Namespace):
    """The canary verifier's settings from ``serve``'s arguments (a ``VerifierConfig``)."""
    from agent.io.tracker.verifier_api import VerifierConfig

    return VerifierConfig(
        threads=getattr(args, "canary_threads", 1), worker_wait=getattr(args, "canary_worker_wait", AUTO),
        persona_listen=_persona_listen(args.listen),
    )  # fmt: skip


def _persona_listen(listen: str) -> str:
    """Where the verifier's fresh identities listen: the tracker's host, any port."""
    parts = listen.strip("/").split("/")
    if len(parts) >= 4 and parts[0] in ("ip4", "ip6") and parts[2] == "tcp":
        return f"/{parts[0]}/{parts[1]}/tcp/0"
    return "/ip4/127.0.0.1/tcp/0"


def _serve(args: argparse.Namespace) -> int:
    import trio

    from agent.io.keys import KeyFileError, load_or_create_key
    from agent.io.tracker.config import TrackerConfig
    from agent.io.tracker.gguf_info import GgufError
    from agent.io.tracker.store import StoreError, open_store

    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    if args.expected_pin is None or args.expected_patch_hash is None:
        from agent.runtime import expected_pin

        pin, patch_hash = expected_pin()
        args.expected_pin = args.expected_pin or pin
        args.expected_patch_hash = args.expected_patch_hash or patch_hash
    try:
        config = TrackerConfig(
            llama_cpp_commit=args.expected_pin,
            patch_series_sha256=args.expected_patch_hash,
            heartbeat_interval_ms=args.heartbeat_interval_ms,
            heartbeat_timeout_ms=args.heartbeat_timeout_ms,
            admission_ttl_ms=args.admission_ttl_ms,
            registration_max_age_ms=args.registration_max_age_ms,
            nonce_retention_ms=max(600_000, 2 * args.registration_max_age_ms),
            canary=_canary_policy(args),
        )
        hf_repos = dict(args.hf_repo)
        unknown = sorted(set(hf_repos) - {alias for _, alias in args.register_model})
        if unknown:
            raise ValueError(f"--hf-repo names aliases that no --register-model gives: {', '.join(unknown)}")
        sources = dict(getattr(args, "model_source", []) or [])
        unknown = sorted(set(sources) - {alias for _, alias in args.register_model})
        if unknown:
            raise ValueError(f"--model-source names aliases that no --register-model gives: {', '.join(unknown)}")
        if config.canary is not None:
            from agent.io.worker.process import find_worker_binary

            try:
                find_worker_binary()
            except FileNotFoundError as error:
                raise ValueError(
                    f"canary checks run the tracker's own workers ({error}); to run without output checks, "
                    "pass --canary-interval-s 0"
                ) from None
        key = load_or_create_key(args.key)
        with open_store(args.db) as store:
            now_ms = int(time.time() * 1000)
            for entry in register_models(store, args.register_model, now_ms, hf_repos, sources):
                log.info(
                    "registered model %s (%s, %s, %d blocks)", entry.alias, entry.sha256[:12], entry.name, entry.n_layer
                )
            return trio.run(_serve_async, args, store, config, key)
    except (ValueError, OSError, KeyFileError, StoreError, GgufError) as error:
        print(f"baton tracker serve: {error}", file=sys.stderr)
        return 2


async def _serve_async(args: argparse.Namespace, store, config, key) -> int:
    import trio

    from agent.io.net.p2p import RelayPolicy, open_p2p_transport
    from agent.io.tracker.service import serve_tracker

    relay = getattr(args, "relay", True)
    async with (
        # closed until the tracker that decides who may use it runs
        open_p2p_transport(
            key, listen_addrs=[args.listen], enable_relay_hop=relay, relay_policy=RelayPolicy.closed()
        ) as transport,
        trio.open_nursery() as nursery,
    ):
        verifier = verifier_config(args)
        tracker = await nursery.start(
            functools.partial(serve_tracker, transport, store, config, key, verifier=verifier)
        )
        if getattr(args, "serve_models", None) is not None:
            from agent.io.model_http import ModelFileServer, serve_model_files

            files = {f"{m.sha256}.gguf": store.model_path(m.sha256) for m in store.models()}
            server = ModelFileServer({name: path for name, path in files.items() if path is not None})
            host, port = args.serve_models
            base_url = await nursery.start(serve_model_files, server, host, port)
            tracker.set_model_base_url(args.models_base_url or base_url)
            log.info("serving %d model files at %s/models/ (told to nodes: %s)", len(server.files), base_url,
                     tracker.model_files.model_base_url)  # fmt: skip
        transport.relay_policy = RelayPolicy(tracker.may_hold_relay_reservation, tracker.may_open_relay_circuit)
        addr = transport.listen_addrs[0]
        if args.addr_file:  # first, so that a reader of stdout finds the file in place
            _write_atomically(Path(args.addr_file), addr + "\n")
        print(f"tracker listening on {addr}", flush=True)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                log.info("received %s: stopping", signal.Signals(signum).name)
                break
        nursery.cancel_scope.cancel()
    return 0


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
