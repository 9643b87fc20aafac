"""``baton node``: run a node agent that serves layer ranges of local GGUF files to a swarm.

    baton node --tracker MULTIADDR [--model PATH ...] [--models-dir DIR] --key PATH
               [--listen MULTIADDR|none] [--relay] [--memory-bytes N] [--threads N] [--threads-decode N]
               [--worker-wait auto|spin|sleep] [--ctx-size N] [--max-sequences N]
               [--decode-groups N] [--decode-gather-ms MS] [--batch-window-ms MS]
               [--heartbeat-interval-ms N]
    baton node install | uninstall | status | doctor ...   (agent.io.node.service)

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

from agent import cli_args
from agent.core.node.scheduler import LOCK_STEP_GATHER_MS
from agent.core.node.worker_wait import AUTO, WAIT_CHOICES
from agent.io.gguf_sparse import check_gguf_magic
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
    """Add the ``baton node`` options to ``parser``."""
    from .service import add_subcommands

    add_subcommands(parser)
    parser.add_argument("--tracker", help="the tracker's multiaddr, ending /p2p/<peer id> (required)")
    parser.add_argument(
        "--model", action="append", default=[], metavar="PATH", help="a GGUF file this node offers (repeatable)"
    )
    parser.add_argument(
        "--models-dir", metavar="DIR",
        help="fetch the assigned ranges of models this node lacks into DIR (only their bytes, verified)",
    )  # fmt: skip
    parser.add_argument("--key", metavar="PATH", help="the node's Ed25519 key file (created if missing; required)")
    parser.add_argument(
        "--listen", default="/ip4/127.0.0.1/tcp/0", metavar="MULTIADDR",
        help="where to listen (default %(default)s); 'none': accept no direct connections (needs --relay)",
    )  # fmt: skip
    parser.add_argument(
        "--no-channel",
        action="store_true",
        help="send steps and results over libp2p only (no direct TLS channel; for comparisons)",
    )
    parser.add_argument(
        "--relay", action="store_true",
        help="be reachable through the tracker's circuit relay (for a node that cannot be dialled)",
    )  # fmt: skip
    parser.add_argument(
        "--no-punch", action="store_true",
        help="neither hole-punch toward peers reached through the relay nor answer their punches"
        " (they stay relayed; for comparisons)",
    )  # fmt: skip
    parser.add_argument(
        "--memory-bytes", type=cli_args.positive_int, metavar="N", help="usable memory offered (default: available RAM)"
    )
    parser.add_argument("--threads", type=cli_args.positive_int, help="threads per worker (default: the worker's)")
    parser.add_argument(
        "--threads-decode", type=cli_args.positive_int, metavar="N",
        help="threads of a worker Forward whose micro-batch is one row, a lone session's decode step (default:"
        " --threads). Nodes that share one machine's cores may decode a lone session faster with 1 (1.3-1.6x with"
        " three nodes of 2-thread workers on 2 cores); sessions decoding together keep --threads",
    )  # fmt: skip
    parser.add_argument(
        "--worker-wait", choices=WAIT_CHOICES, default=AUTO,
        help="how a worker's idle threads wait for work: spin (quickest for a worker alone on its machine), sleep"
        " (a microseconds' spin, then sleep: for nodes that share one machine's cores, where a spinning worker holds"
        " the cores the next hop needs) or auto (the default: sleep when another Baton node or worker already runs on"
        " this host, else spin; OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment are kept)",
    )  # fmt: skip
    parser.add_argument(
        "--no-data-plane", action="store_true",
        help="every step through this node: its workers do not take a session's steps straight from the hop before"
        " (by default they do, on the host of --listen, sealed with the session's keys)",
    )  # fmt: skip
    parser.add_argument("--ctx-size", type=cli_args.positive_int, help="positions per sequence (default: the worker's)")
    parser.add_argument(
        "--max-sequences", type=cli_args.positive_int, help="sequences per worker (default: the worker's)"
    )
    parser.add_argument(
        "--session-idle-timeout-s", type=cli_args.positive_float, default=5.0,
        help="free a session's sequences after this long without a step from its owner (default 5):"
        " an owner that crashed holds them no longer",
    )  # fmt: skip
    parser.add_argument(
        "--owner-max-share", type=cli_args.unit_interval, default=0.75,
        help="the share of a range's sequences one session owner may hold (default 0.75, so a peer sending"
        " step-0 frames cannot lock everyone out, while a relay, one owner for many users, keeps most; at least one)",
    )  # fmt: skip
    parser.add_argument(
        "--decode-groups", type=cli_args.non_negative_int, metavar="N",
        help="a first hop splits its sessions' decode steps into N groups, so that they are at different hops at"
        " once (0: off, every waiting decode step in the next Forward; 1: lock-step, with --decode-gather-ms). The"
        " default picks per route: lock-step when the route's next hop runs on this machine (nodes that share its"
        " cores gain nothing by computing at once), else the route's hops + 1",
    )  # fmt: skip
    parser.add_argument(
        "--batch-window-ms", type=cli_args.non_negative_float, default=0.0, metavar="MS",
        help="how long a range waits after a step arrives for the other steps of the upstream Forward to join it"
        " (default 0)",
    )  # fmt: skip
    parser.add_argument(
        "--decode-gather-ms", type=cli_args.non_negative_float, metavar="MS",
        help="how long a first hop holds a decode Forward until a full decode group waits (0: never; default:"
        f" {LOCK_STEP_GATHER_MS:g} in lock-step, else 0); with one decode group, lock-step: every decoding"
        " session in one Forward, for nodes that share one machine's cores",
    )  # fmt: skip
    parser.add_argument(
        "--heartbeat-interval-ms",
        type=cli_args.positive_int,
        metavar="MS",
        help="heartbeat interval (default: the tracker's)",
    )
    parser.add_argument(
        "--kept-rows-max-bytes", type=cli_args.non_negative_int, default=64 * 1024 * 1024, metavar="N",
        help="per session and range, the most bytes of output rows kept to rebuild a lost next hop"
        " (default 64 MiB; 0: keep none, a lost next hop then costs a re-prefill of the route)",
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

    if not args.tracker or not args.key:
        print("baton node: --tracker and --key are required", file=sys.stderr)
        return EXIT_SETUP
    listen = listen_addrs(args.listen)
    relay = getattr(args, "relay", False)
    models_dir = getattr(args, "models_dir", None)
    if not args.model and not models_dir:
        print("baton node: give --model PATH (a file you have) or --models-dir DIR (fetch ranges)", file=sys.stderr)
        return EXIT_SETUP
    if not listen and not relay:
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
        key = load_or_create_key(args.key)
    except (KeyFileError, OSError) as err:
        print(f"baton node: key {args.key}: {err}", file=sys.stderr)
        return EXIT_SETUP
    models = []
    for path in args.model:
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
        tracker=args.tracker,
        key=key,
        models=tuple(models),
        memory_bytes=args.memory_bytes,
        threads=args.threads,
        threads_decode=args.threads_decode,
        worker_wait=args.worker_wait,
        ctx_size=args.ctx_size,
        max_sequences=args.max_sequences,
        session_idle_timeout_s=args.session_idle_timeout_s,
        kept_rows_max_bytes=args.kept_rows_max_bytes,
        owner_max_share=args.owner_max_share,
        decode_groups=getattr(args, "decode_groups", None),
        decode_gather_ms=getattr(args, "decode_gather_ms", None),
        batch_window_ms=getattr(args, "batch_window_ms", 0.0),
        heartbeat_interval_ms=args.heartbeat_interval_ms,
        relay=relay,
        data_plane_host=None if getattr(args, "no_data_plane", False) else data_plane_host(listen),
        probe=probe,
        models_dir=os.path.abspath(models_dir) if models_dir else None,
    )
    code = 0
    try:
        no_channel = {"channel": False} if getattr(args, "no_channel", False) else {}
        if getattr(args, "no_punch", False):
            no_channel["punch"] = False
        async with open_transport(key, listen, **no_channel) as transport, trio.open_nursery() as nursery:
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
    if getattr(args, "node_command", None):
        from .service import main as service_main

        return service_main(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    return trio.run(functools.partial(run_until_signal, args, outputs_filter=outputs_filter))
