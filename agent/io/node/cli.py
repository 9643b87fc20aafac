"""``baton node``: run a node agent that serves layer ranges of local GGUF files to a swarm.

    baton node --tracker MULTIADDR [--model PATH ...] [--models-dir DIR] --key PATH
               [--listen MULTIADDR|none] [--relay] [--memory-bytes N] [--threads N] [--threads-decode N]
               [--worker-wait auto|spin|sleep] [--ctx-size N] [--max-sequences N]
               [--decode-groups N] [--decode-gather-ms MS] [--batch-window-ms MS]
               [--heartbeat-interval-ms N] [--gpu-layers N] [--config PATH] ...
    baton node install | uninstall | status | doctor ...   (agent.io.node.service)

Every option is a ``NodeConfig`` field (``agent.io.node.config``; ``--help`` and docs/CLI.md list
them), and ``--config PATH`` reads them from a TOML file under the field names, the command
line winning (docs/OPERATIONS.md, "Config files").

``--model PATH`` serves a file the node already has. ``--models-dir DIR`` lets the node serve
models it lacks: for each range it is assigned it fetches only that range's bytes (the
metadata and the range's tensors) by HTTP range requests from the sources the tracker names,
into a sparse ``DIR/<sha256>.gguf``, each tensor checked against the tracker-signed manifest
before the range is reported READY (``agent.io.node.fetch``). At least one of the two.

A node that cannot be dialled (behind NAT) runs with ``--relay``: it reserves a slot on the
tracker's circuit relay and is reached at ``<tracker>/p2p-circuit/p2p/<node id>``;
``--listen none`` makes that its only address (it accepts no direct connections).

Prints ``node <peer id> admitted`` once the tracker admitted it, or ``node refused: <reason>``
and exits with code 3. Directives (LOAD / UNLOAD) and range states are logged on stderr.
Exit codes: 0 stopped (SIGTERM or Ctrl-C: workers are stopped first), 1 the tracker could not be reached or misbehaved, 2 bad local
set-up (key, model file, worker binary), 3 refused by the tracker.

Owns argument parsing, the model hashes (sha256, cached next to each model in a
``<file>.sha256-ok`` sidecar keyed by size and mtime, the format ``agent.models`` uses) and the
wiring of key, transport, probe and ``serve_node``. The lead wires ``baton node`` to
``add_arguments`` and ``main``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

import trio

from agent.io.gguf_sparse import check_gguf_magic
from agent.io.settings import SettingsError, add_flags, load_toml, settings_from_args
from agent.models import cached_sha256

from .agent import serve_node
from .config import LocalModel, NodeConfig, NodeError, NodeRefused, OutputsFilter
from .probe import probe_host

__all__ = [
    "EXIT_REFUSED",
    "add_arguments",
    "listen_addrs",
    "main",
    "open_transport",
    "run",
    "run_until_signal",
]

EXIT_UNREACHABLE = 1
EXIT_SETUP = 2
EXIT_REFUSED = 3

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``baton node`` options to ``parser``: ``NodeConfig``'s settings and ``--config``."""
    from .service import add_subcommands

    add_subcommands(parser)
    add_flags(parser, NodeConfig)
    parser.add_argument(
        "--config", metavar="PATH",
        help="read these options from a TOML file, each under its NodeConfig field name (--memory-bytes:"
        " memory_bytes; --model: model_files, a list; --key: key_file); options given here win over the file's",
    )  # fmt: skip


@contextlib.asynccontextmanager
async def open_transport(key, listen_addrs: Sequence[str], channel: bool = True, punch: bool = True) -> AsyncIterator:
    """libp2p (``agent.io.net.p2p``) with the direct channel in front (``agent.io.net.channel``;
    ``channel`` False: libp2p only; ``punch`` False: no hole punching); a seam for tests."""
    from agent.io.net.peer_transport import open_peer_transport

    async with open_peer_transport(key, listen_addrs, channel=channel, punch=punch) as transport:
        yield transport


_E = TypeVar("_E", bound=BaseException)


def _first_leaf(group: BaseExceptionGroup[_E]) -> _E:
    """The first exception inside (possibly nested) exception groups: ``except*`` keeps the
    nesting of the nurseries the error crossed (the transport's and ours)."""
    leaf: _E | BaseExceptionGroup[_E] = group
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    return leaf


def data_plane_host(listen: Sequence[str]) -> str | None:
    """The host of the first ``/ip4|ip6/<host>/tcp/...`` listen address: the workers' data
    plane listens there, as reachable as the node itself; None (no data plane) without one."""
    for addr in listen:
        parts = addr.split("/")
        if len(parts) > 4 and parts[1] in ("ip4", "ip6") and parts[3] == "tcp":
            return parts[2]
    return None


def listen_addrs(listen: str) -> list[str]:
    """``--listen``: one multiaddr, or none for ``none`` / an empty value."""
    listen = listen.strip()
    return [] if listen.lower() in ("", "none") else [listen]


async def run(args: argparse.Namespace, *, outputs_filter: OutputsFilter | None = None) -> int:
    """Run the node until cancelled; returns the exit code. ``outputs_filter``: a test hook
    (``serve_node``'s; ``agent.testing.faulty_node`` passes one), None for ``baton node``."""
    from agent.io.keys import KeyFileError, load_or_create_key
    from agent.io.worker.process import WorkerBinaryNotFound

    try:
        settings = settings_from_args(NodeConfig, args, load_toml(args.config, NodeConfig) if args.config else {})
    except SettingsError as err:
        print(f"baton node: --config {err}", file=sys.stderr)
        return EXIT_SETUP
    tracker, key_file, models_dir = settings["tracker"], settings["key_file"], settings["models_dir"]
    if not tracker or not key_file:
        print("baton node: --tracker and --key are required", file=sys.stderr)
        return EXIT_SETUP
    listen = listen_addrs(settings["listen"])
    if not settings["model_files"] and not models_dir:
        print("baton node: give --model PATH (a file you have) or --models-dir DIR (fetch ranges)", file=sys.stderr)
        return EXIT_SETUP
    if not listen and not settings["relay"]:
        print("baton node: --listen none needs --relay (nobody could reach this node)", file=sys.stderr)
        return EXIT_SETUP
    if models_dir:
        try:  # made now, so that a path that cannot be a directory is refused at once
            if os.path.exists(models_dir) and not os.path.isdir(models_dir):
                raise NotADirectoryError("it exists and is not a directory")
            os.makedirs(models_dir, exist_ok=True)
        except OSError as err:
            print(f"baton node: --models-dir {models_dir}: {err}", file=sys.stderr)
            return EXIT_SETUP
    try:
        key = load_or_create_key(key_file)
    except (KeyFileError, OSError) as err:
        print(f"baton node: key {key_file}: {err}", file=sys.stderr)
        return EXIT_SETUP
    models = []
    for path in settings["model_files"]:
        try:
            check_gguf_magic(path)  # before hashing it: a wrong file says so at once
            digest = await trio.to_thread.run_sync(cached_sha256, path)
        except ValueError as err:  # (names the file)
            print(f"baton node: model {err}", file=sys.stderr)
            return EXIT_SETUP
        except OSError as err:
            print(f"baton node: model {path}: {err}", file=sys.stderr)
            return EXIT_SETUP
        log.info("model %s sha256 %s", path, digest)
        models.append(LocalModel(path=os.path.abspath(path), sha256=digest))
    try:
        probe = await trio.to_thread.run_sync(probe_host)
    except (WorkerBinaryNotFound, OSError, ValueError) as err:
        print(f"baton node: probing this host failed: {err}", file=sys.stderr)
        return EXIT_SETUP
    config = NodeConfig(
        **{**settings, "models_dir": os.path.abspath(models_dir) if models_dir else None},
        key=key, models=tuple(models), probe=probe,
        data_plane_host=data_plane_host(listen) if settings["data_plane"] else None,
    )  # fmt: skip
    code = 0
    try:
        async with (
            open_transport(key, listen, channel=config.channel, punch=config.punch) as transport,
            trio.open_nursery() as nursery,
        ):
            node = await nursery.start(functools.partial(serve_node, config, transport, outputs_filter=outputs_filter))
            print(f"node {node.peer_id} admitted", flush=True)
            for addr in transport.listen_addrs:
                print(f"listening on {addr}", flush=True)
    except* NodeRefused as group:
        print(f"node refused: {_first_leaf(group).reason}", flush=True)
        code = EXIT_REFUSED
    except* NodeError as group:
        print(f"baton node: {_first_leaf(group)}", file=sys.stderr)
        code = EXIT_UNREACHABLE
    except* ValueError as group:
        print(f"baton node: {_first_leaf(group)}", file=sys.stderr)
        code = EXIT_SETUP
    return code


async def run_until_signal(args: argparse.Namespace, *, outputs_filter: OutputsFilter | None = None) -> int:
    """``run`` until it returns or SIGTERM / SIGINT arrives; a signal cancels it, so every
    worker process is stopped (SIGTERM, then SIGKILL) before the node exits with 0."""
    code = 0
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def node() -> None:
                nonlocal code
                code = await run(args, outputs_filter=outputs_filter)
                nursery.cancel_scope.cancel()

            nursery.start_soon(node)
            async for signum in signals:
                log.info("%s: stopping", signal.Signals(signum).name)
                nursery.cancel_scope.cancel()
                break
    return code


def main(args: argparse.Namespace, *, outputs_filter: OutputsFilter | None = None) -> int:
    """``baton node``: returns the exit code (0 after SIGTERM / Ctrl-C). ``outputs_filter``:
    see ``run``."""
    if args.node_command:
        from .service import main as service_main

        return service_main(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    return trio.run(functools.partial(run_until_signal, args, outputs_filter=outputs_filter))
