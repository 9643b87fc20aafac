"""``baton tracker``: run the tracker, list the models or nodes its database holds, or make invites.

  baton tracker serve --db PATH --key PATH [--listen MULTIADDR] [--addr-file PATH] [--no-relay]
                      [--register-model PATH[:ALIAS] ...] [--model-source ALIAS=URL ...]
                      [--serve-models [HOST:]PORT] [--models-base-url URL] [--heartbeat-interval-ms N]
                      [--heartbeat-timeout-ms N] [--admission-ttl-ms N]
                      [--registration-max-age-ms N] [--expected-pin COMMIT]
                      [--expected-patch-hash HASH] [--canary-interval-s S] [--canary-* ...]
  baton tracker models --db PATH
  baton tracker nodes --db PATH [--json]
  baton tracker invite --db PATH [--uses N] [--valid-hours H] [--note TEXT]
  baton tracker invites --db PATH

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

``invite`` makes a token that admits ``--uses`` new keys (default 1) for ``--valid-hours`` hours
(default a week) where the tracker runs with ``--require-invites``, and prints it (the
database keeps only its SHA-256: ``agent.core.wire.invites``); the new node or client passes it
as ``--invite TOKEN``. A running tracker sees a new invite at once. ``invites`` lists them (uses
left, expiry, note).

``serve``'s options are ``TrackerConfig``'s fields (``agent.io.tracker.config``), read back by
``tracker_config``.

Entry points: ``add_arguments(parser)`` fills a ``tracker`` sub-parser; ``main(args) -> int``
runs the parsed command. ``python -m agent.io.tracker.cli serve ...`` runs the same thing.
Only argument parsing, printing and opening resources live here.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
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
from agent.core.tracker.heartbeat import MAX_ERROR_CHARS
from agent.core.wire.swarm_wire import MAX_ADDR_CHARS, printable
from agent.io.settings import add_flags, settings_from_args
from agent.io.tracker.config import TrackerConfig, parse_host_port, parse_model_arg

__all__ = ["add_arguments", "build_parser", "main", "parse_model_arg", "tracker_config", "verifier_config"]

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``serve``, ``models``, ``nodes``, ``invite`` and ``invites`` sub-commands to ``parser`` (the ``tracker`` parser)."""
    commands = parser.add_subparsers(dest="tracker_command", required=True, metavar="COMMAND")
    serve = commands.add_parser("serve", help="run the tracker")
    add_flags(serve, TrackerConfig)

    models = commands.add_parser("models", help="list the registered models")
    models.add_argument("--db", required=True, help="the tracker's SQLite database")

    nodes = commands.add_parser("nodes", help="list the admitted nodes, their ranges and states")
    nodes.add_argument("--db", required=True, help="the tracker's SQLite database")
    nodes.add_argument("--json", action="store_true", help="print one JSON object")

    invite = commands.add_parser(
        "invite", help="make an invite: a token that admits new keys where the tracker runs with --require-invites"
    )
    invite.add_argument("--db", required=True, help="the tracker's SQLite database (created if missing)")
    invite.add_argument(
        "--uses", type=cli_args.positive_int, default=1, metavar="N", help="how many new keys it admits (default 1)"
    )
    invite.add_argument(
        "--valid-hours", type=cli_args.non_negative_float, default=168.0, metavar="H",
        help="hours it stays valid (default 168, a week; 0: for ever)",
    )  # fmt: skip
    invite.add_argument("--note", default="", help="whom it is for, shown by 'invites' (default: none)")

    invites = commands.add_parser("invites", help="list the invites: uses left, expiry, note (never the tokens)")
    invites.add_argument("--db", required=True, help="the tracker's SQLite database")


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
    if args.tracker_command == "invite":
        return _invite(args)
    if args.tracker_command == "invites":
        return _invites(args)
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


def _invite(args: argparse.Namespace) -> int:
    """Make an invite and print its token (the database keeps only its SHA-256)."""
    from agent.core.wire.invites import INVITE_RANDOM_BYTES, MAX_NOTE_CHARS, invite_sha256, new_invite
    from agent.io.tracker.store import StoreError, open_store

    if printable(args.note, MAX_NOTE_CHARS) != args.note:
        print(f"baton tracker invite: --note must be printable text of at most {MAX_NOTE_CHARS} characters",
              file=sys.stderr)  # fmt: skip
        return 2
    token = new_invite(os.urandom(INVITE_RANDOM_BYTES))
    now_ms = int(time.time() * 1000)
    expires_at_ms = now_ms + round(args.valid_hours * 3_600_000) if args.valid_hours else 0
    try:
        with open_store(args.db) as store:
            store.add_invite(invite_sha256(token), args.uses, expires_at_ms, args.note, now_ms)
    except StoreError as error:
        print(f"baton tracker invite: {error}", file=sys.stderr)
        return 2
    print(token)
    return 0


def _invites(args: argparse.Namespace) -> int:
    from agent.core.wire.invites import MAX_NOTE_CHARS

    rows = _read_store("invites", args.db, lambda store: store.invites())
    if rows is None:
        return 2
    table = [("SHA256", "USES LEFT", "EXPIRES (UTC)", "MADE (UTC)", "NOTE")]
    table += [
        (sha[:12], str(uses), _utc(expires) if expires else "never", _utc(made), printable(note, MAX_NOTE_CHARS))
        for sha, uses, expires, note, made in rows
    ]
    _print_table(table)
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


def tracker_config(args: argparse.Namespace) -> TrackerConfig:
    """``serve``'s settings from its flags, what nodes must run resolved (``--expected-pin``,
    else this checkout's), the canary policy made of the ``canary_*`` settings.

    Raises:
      ValueError: inconsistent values (the config or the policy says which).
    """
    settings = settings_from_args(TrackerConfig, args)
    pin, patch_hash = settings["expected_pin"], settings["expected_patch_hash"]
    if pin is None or patch_hash is None:
        from agent.runtime import expected_pin

        pin, patch_hash = pin or expected_pin()[0], patch_hash or expected_pin()[1]
    config = TrackerConfig(
        **settings, llama_cpp_commit=pin, patch_series_sha256=patch_hash,
        nonce_retention_ms=max(600_000, 2 * settings["registration_max_age_ms"]),
    )  # fmt: skip
    return dataclasses.replace(config, canary=_canary_policy(config))


def _canary_policy(config: TrackerConfig):
    """The ``CanaryPolicy`` of the ``canary_*`` settings (None: ``--canary-interval-s 0``)."""
    from agent.core.tracker.canary import CanaryPolicy

    if not config.canary_interval_s:
        return None
    return CanaryPolicy(
        interval_s=config.canary_interval_s,
        max_prompt_rows=config.canary_max_prompt_rows,
        min_decode_steps=min(1, config.canary_max_decode_steps),
        max_decode_steps=config.canary_max_decode_steps,
        refuse_after_failures=config.canary_refuse_after,
        cross_recipe_rel_error=config.canary_cross_recipe_rel_error,
        gate_new_ranges=config.canary_gate,
    )


def verifier_config(config: TrackerConfig):
    """The canary verifier's settings of the tracker's (a ``VerifierConfig``)."""
    from agent.io.tracker.verifier_api import VerifierConfig

    return VerifierConfig(
        threads=config.canary_threads, worker_wait=config.canary_worker_wait,
        persona_listen=_persona_listen(config.listen),
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
    from agent.io.tracker.gguf_info import GgufError
    from agent.io.tracker.store import StoreError, open_store

    try:
        config = tracker_config(args)
        logging.basicConfig(
            level=config.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s"
        )
        models = [parse_model_arg(text) for text in config.register_model]
        aliases = {alias for _, alias in models}
        hf_repos = dict(text.split("=", 1) for text in config.hf_repo)
        unknown = sorted(set(hf_repos) - aliases)
        if unknown:
            raise ValueError(f"--hf-repo names aliases that no --register-model gives: {', '.join(unknown)}")
        sources = dict(text.split("=", 1) for text in config.model_source)
        unknown = sorted(set(sources) - aliases)
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
        key = load_or_create_key(config.key_file)
        with open_store(config.db) as store:
            now_ms = int(time.time() * 1000)
            for entry in register_models(store, models, now_ms, hf_repos, sources):
                log.info(
                    "registered model %s (%s, %s, %d blocks)", entry.alias, entry.sha256[:12], entry.name, entry.n_layer
                )
            return trio.run(_serve_async, store, config, key)
    except (ValueError, OSError, KeyFileError, StoreError, GgufError) as error:
        print(f"baton tracker serve: {error}", file=sys.stderr)
        return 2


async def _serve_async(store, config: TrackerConfig, key) -> int:
    import trio

    from agent.io.net.p2p import RelayPolicy, open_p2p_transport
    from agent.io.tracker.service import serve_tracker

    async with (
        # closed until the tracker that decides who may use it runs
        open_p2p_transport(
            key, listen_addrs=[config.listen], enable_relay_hop=config.relay, relay_policy=RelayPolicy.closed()
        ) as transport,
        trio.open_nursery() as nursery,
    ):
        verifier = verifier_config(config)
        tracker = await nursery.start(
            functools.partial(serve_tracker, transport, store, config, key, verifier=verifier)
        )
        if config.serve_models is not None:
            from agent.io.model_http import ModelFileServer, serve_model_files

            files = {f"{m.sha256}.gguf": store.model_path(m.sha256) for m in store.models()}
            server = ModelFileServer({name: path for name, path in files.items() if path is not None})
            host, port = parse_host_port(config.serve_models)
            base_url = await nursery.start(serve_model_files, server, host, port)
            tracker.set_model_base_url(config.models_base_url or base_url)
            log.info("serving %d model files at %s/models/ (told to nodes: %s)", len(server.files), base_url,
                     tracker.model_files.model_base_url)  # fmt: skip
        transport.relay_policy = RelayPolicy(tracker.may_hold_relay_reservation, tracker.may_open_relay_circuit)
        # a peer not admitted yet may send admission-sized requests only (agent.core.wire.swarm_wire)
        transport.request_gate.is_admitted = tracker.may_open_relay_circuit
        addr = transport.listen_addrs[0]
        if config.addr_file:  # first, so that a reader of stdout finds the file in place
            _write_atomically(Path(config.addr_file), addr + "\n")
        print(f"tracker listening on {addr}", flush=True)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                log.info("received %s: stopping", signal.Signals(signum).name)
                break
        nursery.cancel_scope.cancel()
    return 0


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
