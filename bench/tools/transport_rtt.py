"""Round-trip time of the libp2p transport against plain TCP, between two processes on loopback.

Owns: one benchmark. For each message size (8 KiB, 1 MiB) and each path, a server process
echoes every frame back; this process sends a frame and waits for the echo (one round trip
carries the message both ways). Both paths use the same framing (uvarint length + payload):
- ``libp2p``: ``agent.io.net.p2p.open_p2p_transport`` (TCP + Noise + yamux, one reused stream);
- ``channel``: the direct channel (``agent.io.net.channel``: TCP + TLS 1.3), its echo an
  ``ImmediateHandler`` answered in the frame reader, as a hop's step and result handlers are,
  each message sent with ``request_soon`` (no task; the reply taken in the frame reader),
  as a hop's pushes and the owner's steps are;
- ``tcp``: trio TCP sockets (TCP_NODELAY, trio's default), no encryption.

After a warm-up, each of ``--runs`` runs times ``exchanges`` round trips on every path in turn
(all servers are up at once; the order rotates from run to run, so that the machine's drift
falls on every path alike) and records their mean; the report gives median/min/max over runs and
libp2p/tcp ratios of the medians (with platform, CPU count, Python and library versions).
``run_benchmark(runs)`` returns that report (``bench/compare.py`` calls it: its "Boundary
transport alone" table, docs/PERFORMANCE.md); run alone, it prints the figures and writes the
JSON report only with ``--output``.

Usage: ``.venv/bin/python bench/tools/transport_rtt.py [--runs 7] [--output PATH]`` (well under 2 min).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager, contextmanager
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/: _bootstrap, common
import trio
from _bootstrap import REPO_ROOT
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.core.net.frames import decode_uvarint, encode_uvarint
from agent.io.cpu_policy import apply_cpu_policy
from agent.io.keys import peer_id_of
from agent.io.net.channel import open_channel_transport
from agent.io.net.channel_config import ChannelConfig
from agent.io.net.p2p import open_p2p_transport
from agent.io.net.transport import (
    ImmediateHandler,
    MemoryNetwork,
    TransportError,
)
from agent.io.process_memory import keep_freed_memory

PROTOCOL = "/baton/bench-echo/1.0.0"
PATHS = ["tcp", "libp2p", "channel"]
SIZES = {"8KiB": 8 * 1024, "1MiB": 1024 * 1024}
EXCHANGES = {"8KiB": 200, "1MiB": 20}  # per run
WARMUP = {"8KiB": 100, "1MiB": 10}
MAX_FRAME_BYTES = 64 << 20
SERVER_READY_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 30.0

RoundTrip = Callable[[bytes], Awaitable[bytes]]


# -- plain TCP with the same framing ---------------------------------------------------------


class _TcpFramer:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = bytearray()

    async def read_frame(self) -> bytes | None:
        while (decoded := decode_uvarint(self.buffer)) is None:
            chunk = await self.stream.receive_some(1 << 20)
            if not chunk:
                return None
            self.buffer += chunk
        length, used = decoded
        if length > MAX_FRAME_BYTES:
            raise ValueError(f"frame of {length} bytes")
        del self.buffer[:used]
        while len(self.buffer) < length:
            chunk = await self.stream.receive_some(max(length - len(self.buffer), 1 << 16))
            if not chunk:
                raise EOFError("stream ended inside a frame")
            self.buffer += chunk
        payload = bytes(self.buffer[:length])
        del self.buffer[:length]
        return payload

    async def write_frame(self, payload: bytes) -> None:
        await self.stream.send_all(encode_uvarint(len(payload)) + payload)


async def _serve_tcp() -> None:
    async def echo(stream: trio.SocketStream) -> None:
        framer = _TcpFramer(stream)
        while (frame := await framer.read_frame()) is not None:
            await framer.write_frame(frame)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, echo, 0)
        port = listeners[0].socket.getsockname()[1]
        print(f"127.0.0.1:{port}", flush=True)
        await _wait_for_stdin_eof()
        nursery.cancel_scope.cancel()


async def _serve_libp2p() -> None:
    async def echo(remote_peer_id: str, payload: bytes) -> bytes:
        return payload

    async with open_p2p_transport(Ed25519PrivateKey.generate(), max_frame_bytes=MAX_FRAME_BYTES) as transport:
        transport.set_handler(PROTOCOL, echo)
        print(transport.listen_addrs[0], flush=True)
        await _wait_for_stdin_eof()


async def _serve_channel() -> None:
    # answered in the frame reader, as a hop answers the steps and results it receives
    echo = ImmediateHandler(lambda _remote_peer_id, payload: payload)
    key = Ed25519PrivateKey.generate()
    fallback = MemoryNetwork().add(peer_id_of(key))  # never used: the client dials the channel
    async with open_channel_transport(key, fallback, ChannelConfig(max_frame_bytes=MAX_FRAME_BYTES)) as transport:
        transport.set_handler(PROTOCOL, echo)
        print(transport.channel_addrs[0], flush=True)
        await _wait_for_stdin_eof()


async def _wait_for_stdin_eof() -> None:
    """The parent closes our stdin to stop us (no signals, no sleeps)."""
    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    async with stdin:
        while await stdin.receive_some(1024):
            pass


# -- client ----------------------------------------------------------------------------------


async def _time_round_trips(round_trip, payload: bytes, exchanges: int) -> float:
    """The mean seconds of ``exchanges`` round trips of ``payload``."""
    started = time.perf_counter()
    for _ in range(exchanges):
        reply = await round_trip(payload)
    mean = (time.perf_counter() - started) / exchanges
    assert reply == payload
    return mean


@asynccontextmanager
async def _open_tcp_client(address: str) -> AsyncIterator[RoundTrip]:
    host, port = address.rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        framer = _TcpFramer(stream)

        async def round_trip(payload: bytes) -> bytes:
            await framer.write_frame(payload)
            reply = await framer.read_frame()
            assert reply is not None
            return reply

        yield round_trip


@asynccontextmanager
async def _open_libp2p_client(address: str, counters: dict[str, int]) -> AsyncIterator[RoundTrip]:
    peer_id = address.rsplit("/p2p/", 1)[1]
    async with open_p2p_transport(Ed25519PrivateKey.generate(), max_frame_bytes=MAX_FRAME_BYTES) as transport:

        async def round_trip(payload: bytes) -> bytes:
            return await transport.request(peer_id, [address], PROTOCOL, payload, timeout_s=REQUEST_TIMEOUT_S)

        yield round_trip
        counters["libp2p_streams_opened"] = transport.streams_opened


@asynccontextmanager
async def _open_channel_client(address: str, counters: dict[str, int]) -> AsyncIterator[RoundTrip]:
    peer_id = address.rsplit("/p2p/", 1)[1]
    key = Ed25519PrivateKey.generate()
    fallback = MemoryNetwork().add(peer_id_of(key))
    async with open_channel_transport(
        key, fallback, ChannelConfig(max_frame_bytes=MAX_FRAME_BYTES, listen_host=None)
    ) as transport:
        await transport.request(peer_id, [address], PROTOCOL, b"dial", timeout_s=REQUEST_TIMEOUT_S)

        async def round_trip(payload: bytes) -> bytes:
            # as a hop's steps and results travel: sent without a task, the reply taken in
            # the frame reader (request_soon), which wakes this task
            arrived = trio.Event()
            replies: list[bytes | TransportError] = []

            def on_reply(reply: bytes | TransportError) -> None:
                replies.append(reply)
                arrived.set()

            if not transport.request_soon(peer_id, PROTOCOL, payload, timeout_s=REQUEST_TIMEOUT_S, on_reply=on_reply):
                return await transport.request(peer_id, [address], PROTOCOL, payload, timeout_s=REQUEST_TIMEOUT_S)
            await arrived.wait()
            if isinstance(replies[0], TransportError):
                raise replies[0]
            return replies[0]

        yield round_trip
        assert transport.fallback_requests == 0
        counters["channel_connections_dialled"] = transport.connections_dialled


async def _measure_interleaved(
    addresses: dict[str, str], runs: int, counters: dict[str, int]
) -> dict[str, dict[str, list[float]]]:
    """``{path: {size name: [mean round trip of each run]}}``. The paths take turns: each
    run measures every path once, in an order that rotates from run to run, so a drift in
    the machine's speed (a shared VM's) lands on all of them alike."""
    async with AsyncExitStack() as stack:
        clients = {
            "tcp": await stack.enter_async_context(_open_tcp_client(addresses["tcp"])),
            "libp2p": await stack.enter_async_context(_open_libp2p_client(addresses["libp2p"], counters)),
            "channel": await stack.enter_async_context(_open_channel_client(addresses["channel"], counters)),
        }
        means: dict[str, dict[str, list[float]]] = {path: {name: [] for name in SIZES} for path in PATHS}
        for name, size in SIZES.items():
            payload = os.urandom(size)
            for path in PATHS:
                await _time_round_trips(clients[path], payload, WARMUP[name])
            for run in range(runs):
                for path in PATHS[run % len(PATHS) :] + PATHS[: run % len(PATHS)]:
                    means[path][name].append(await _time_round_trips(clients[path], payload, EXCHANGES[name]))
        return means


@contextmanager
def _running_server(kind: str) -> Iterator[str]:
    """A ``kind`` echo server process for the block; its address."""
    process, address = _start_server(kind)
    try:
        yield address
    finally:
        _stop_server(process)


def _start_server(kind: str) -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--serve", kind],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )
    assert process.stdout is not None
    line = process.stdout.readline().strip()  # the server prints its address once it listens
    if not line:
        _stop_server(process)
        raise RuntimeError(f"{kind} server exited before listening (rc={process.returncode})")
    return process, line


def _stop_server(process: subprocess.Popen[str]) -> None:
    assert process.stdin is not None
    process.stdin.close()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _summary(means: list[float]) -> dict[str, float]:
    return {
        "median_ms": statistics.median(means) * 1e3,
        "min_ms": min(means) * 1e3,
        "max_ms": max(means) * 1e3,
    }


def paired_ratios(paths: list[float], reference: list[float]) -> dict[str, float]:
    """Median/min/max over runs of each run's ``path / reference`` (the two measured in the
    same run, in turn)."""
    ratios = [a / b for a, b in zip(paths, reference, strict=True)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def run_benchmark(runs: int) -> dict[str, object]:
    """Measure both paths (``runs`` runs each after a warm-up) and return the report that
    ``main`` writes (also called by ``bench/compare.py``)."""
    started = time.perf_counter()
    counters: dict[str, int] = {}
    with ExitStack() as servers:
        addresses = {path: servers.enter_context(_running_server(path)) for path in PATHS}
        means = trio.run(_measure_interleaved, addresses, runs, counters)
    tcp, libp2p, channel = means["tcp"], means["libp2p"], means["channel"]
    streams_opened, channel_connections = counters["libp2p_streams_opened"], counters["channel_connections_dialled"]

    report: dict[str, object] = {
        "benchmark": "transport_rtt",
        "what": "echo round trip (message sent and returned) between two processes on loopback",
        "method": {
            "runs": runs,
            "exchanges_per_run": EXCHANGES,
            "warmup_exchanges": WARMUP,
            "statistic": "per run: mean round trip over its exchanges; reported: median/min/max over runs",
            "order": "the paths take turns within each run (rotating order), all servers up at once",
            "framing": "uvarint length prefix + payload on both paths",
            "libp2p": "agent.io.net.p2p (TCP + Noise + yamux, one reused stream)",
            "tcp": "trio TCP sockets, TCP_NODELAY, no encryption",
            "channel": "agent.io.net.channel (TCP + TLS 1.3 with libp2p-TLS certificates, exchange frames, one connection; request_soon, an ImmediateHandler echo)",
        },
        "machine": {
            "platform": platform.platform(),
            "machine": platform.machine(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "libp2p": version("libp2p"),
            "trio": version("trio"),
        },
        "results": {},
        "libp2p_streams_opened": streams_opened,
        "channel_connections_dialled": channel_connections,
    }
    results: dict[str, object] = {}
    for name in SIZES:
        tcp_summary, libp2p_summary = _summary(tcp[name]), _summary(libp2p[name])
        channel_summary = _summary(channel[name])
        results[name] = {
            "bytes": SIZES[name],
            "tcp": tcp_summary,
            "libp2p": libp2p_summary,
            "channel": channel_summary,
            "ratio_channel_over_tcp": channel_summary["median_ms"] / tcp_summary["median_ms"],
            # each run measured both paths seconds apart: its own ratio is free of the drift
            # between runs (median/min/max over runs)
            "ratio_channel_over_tcp_per_run": paired_ratios(channel[name], tcp[name]),
            "ratio_libp2p_over_tcp_per_run": paired_ratios(libp2p[name], tcp[name]),
            "channel_throughput_MB_per_s": 2 * SIZES[name] / (channel_summary["median_ms"] / 1e3) / 1e6,
            "ratio_libp2p_over_tcp": libp2p_summary["median_ms"] / tcp_summary["median_ms"],
            "libp2p_throughput_MB_per_s": 2 * SIZES[name] / (libp2p_summary["median_ms"] / 1e3) / 1e6,
            "tcp_throughput_MB_per_s": 2 * SIZES[name] / (tcp_summary["median_ms"] / 1e3) / 1e6,
        }
    report["results"] = results
    report["total_runtime_s"] = time.perf_counter() - started
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", choices=["tcp", "libp2p", "channel"], help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--output", type=Path, help="also write the JSON report here")
    args = parser.parse_args()
    keep_freed_memory()  # as every Baton process does (agent.cli); the TCP and libp2p paths too
    apply_cpu_policy()  # the same: its server processes inherit it, on every path alike
    if args.serve == "tcp":
        trio.run(_serve_tcp)
        return 0
    if args.serve == "libp2p":
        trio.run(_serve_libp2p)
        return 0
    if args.serve == "channel":
        trio.run(_serve_channel)
        return 0
    if args.runs < 5:
        parser.error("--runs must be at least 5")

    report = run_benchmark(args.runs)
    results = report["results"]
    assert isinstance(results, dict)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.output}")

    for name, entry in results.items():
        assert isinstance(entry, dict)
        print(
            f"{name:>5}: tcp median {entry['tcp']['median_ms']:.3f} ms "
            f"(min {entry['tcp']['min_ms']:.3f}, max {entry['tcp']['max_ms']:.3f}); "
            f"libp2p median {entry['libp2p']['median_ms']:.3f} ms "
            f"(min {entry['libp2p']['min_ms']:.3f}, max {entry['libp2p']['max_ms']:.3f}); "
            f"ratio {entry['ratio_libp2p_over_tcp']:.1f}x; channel median {entry['channel']['median_ms']:.3f} ms "
            f"({entry['ratio_channel_over_tcp']:.2f}x tcp; per run {entry['ratio_channel_over_tcp_per_run']['median']:.2f}x)"
        )
    print(f"took {report['total_runtime_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
