"""Attacks on a worker's data plane (``--data-listen``), made as an attacker would: anyone who can
reach the port can connect and send bytes, without any key. Real worker processes (SmolLM2 in
two ranges, chained worker to worker), real sockets on loopback.

- A flood of unproven frames: 60 connections each announce a 5 MB frame (under SmolLM2's whole-
  frame limit, 5.4 MB) and send all of it but its last byte, then hold. A worker that buffered
  every such frame before any of it had proven anything grew by a whole frame per connection
  (219 -> 641 MB); now a connection no frame has proven may announce only a token step's length
  (a few KB), and a longer prefix closes it at once. The attacked worker stays within +100 MB of
  its RSS, and a session runs over it while the attackers are connected and after.
- Slow senders: connections that announce a short frame and trickle its bytes are closed by the
  unproven deadline (counted from the connection's start), like idle ones, with a NOTICE.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from agent._proto import worker_pb2
from agent.core.wire.data_frames import OwnerSession, SessionKeys
from agent.io.net.data_link import DataLinkClosed, open_data_link
from agent.io.worker.process import WorkerHandle, open_worker

pytestmark = [pytest.mark.worker, pytest.mark.slow, pytest.mark.adversarial]

HOST = "127.0.0.1"
FLOOD_CONNECTIONS = 60
FLOOD_FRAME_BYTES = 5_000_000  # under SmolLM2's whole-frame limit at the default batch (5.4 MB)
RSS_GROWTH_MAX_BYTES = 100 << 20
# a prompt whose rows (8 x 576 f32 at the second range) are longer than an unproven frame may
# be: the first worker's connection to the second proves itself (HELLO) before they arrive
PROMPT = [1, 17, 42, 99, 7, 3, 250, 12]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _queues(port: int) -> dict[tuple[int, int], tuple[int, int]]:
    """Loopback TCP sockets (local port, remote port) -> (tx_queue, rx_queue), either end of
    port's connections (``/proc/net/tcp``)."""
    found = {}
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = int(fields[1].split(":")[1], 16), int(fields[2].split(":")[1], 16)
        if port in (local, remote):
            tx, rx = (int(q, 16) for q in fields[4].split(":"))
            found[(local, remote)] = (tx, rx)
    return found


async def wait_absorbed(port: int, client_ports: list[int]) -> None:
    """Until the worker at port has read every byte its attackers sent (or closed their
    connections): nothing waits in a client's send queue or the worker's receive queue. A
    condition polled, at most 60 s."""
    with trio.fail_after(60):
        while True:
            queues = _queues(port)
            if all(
                queues.get((p, port), (0, 0))[0] == 0 and queues.get((port, p), (0, 0))[1] == 0 for p in client_ports
            ):
                return
            await trio.sleep(0.05)


@contextlib.asynccontextmanager
async def open_two_ranges(model: Path, **flags) -> AsyncIterator[list[WorkerHandle]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(open_worker(model, begin, end, threads=1, data_listen=f"{HOST}:0", **flags))
            for begin, end in ((0, 15), (15, None))
        ]


async def run_session(chain: list[WorkerHandle], seq_id: int) -> None:
    """A session as the nodes and its owner run one: bound on both ranges, its prompt and one
    decode step sent to the first, the results read from the last."""
    keys = SessionKeys.new(os.urandom)
    second_key = os.urandom(32)
    first, second = chain
    await first.client.call(
        "BindSession",
        worker_pb2.BindSessionRequest(
            schema_version=1, session_id=keys.session_id, seq_id=seq_id, step_key=keys.first_step_key,
            next_host=HOST, next_port=second.info.data_port, next_step_key=second_key,
        ),
    )  # fmt: skip
    await second.client.call(
        "BindSession",
        worker_pb2.BindSessionRequest(
            schema_version=1, session_id=keys.session_id, seq_id=seq_id, step_key=second_key,
            return_key=keys.return_key,
        ),
    )  # fmt: skip
    session = OwnerSession(keys)
    async with (
        open_data_link(HOST, first.info.data_port) as to_first,
        open_data_link(HOST, second.info.data_port) as from_last,
    ):
        await from_last.send(session.attach_frame())
        for n, (positions, tokens) in enumerate([(list(range(len(PROMPT))), PROMPT), ([len(PROMPT)], [5])]):
            await to_first.send(
                session.step_frame(worker_pb2.DataStep(step=n, positions=positions, token_ids=tokens, top_k=4))
            )
            with trio.fail_after(60):
                result = session.open_result(await from_last.receive())
            assert result.error_code == 0, result.error_message
            assert result.next_position == positions[-1] + 1, result
    await first.client.call(
        "UnbindSession", worker_pb2.UnbindSessionRequest(schema_version=1, session_id=keys.session_id)
    )
    await second.client.call(
        "UnbindSession", worker_pb2.UnbindSessionRequest(schema_version=1, session_id=keys.session_id)
    )


@pytest.mark.timeout(300)
async def test_a_flood_of_unproven_frames_keeps_the_worker_within_its_memory_and_serving(smollm2_path) -> None:
    async with open_two_ranges(smollm2_path) as chain:
        target = chain[1]
        port = target.info.data_port
        await run_session(chain, seq_id=0)  # the worker's own allocations made, as in a swarm
        before = rss_bytes(target.process.pid)
        body = bytes(FLOOD_FRAME_BYTES - 1)  # all of the frame but its last byte
        held: list[trio.SocketStream] = []
        refused = 0

        async def flood() -> None:
            nonlocal refused
            stream = await trio.open_tcp_stream(HOST, port)
            try:
                await stream.send_all(struct.pack("<I", FLOOD_FRAME_BYTES) + body)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                refused += 1  # closed while still sending: the worker read the prefix and refused it
                await stream.aclose()
                return
            held.append(stream)

        async with contextlib.AsyncExitStack() as stack:
            async with trio.open_nursery() as nursery:
                for _ in range(FLOOD_CONNECTIONS):
                    nursery.start_soon(flood)
            for stream in held:
                stack.push_async_callback(stream.aclose)
            await wait_absorbed(port, [s.socket.getsockname()[1] for s in held])
            during = rss_bytes(target.process.pid)
            await run_session(chain, seq_id=1)  # while the attackers are connected
        await run_session(chain, seq_id=2)
        after = rss_bytes(target.process.pid)
        mb = 1 << 20
        print(
            f"flood: RSS {before / mb:.0f} MB before, {during / mb:.0f} MB under {FLOOD_CONNECTIONS} x "
            f"{FLOOD_FRAME_BYTES / 1e6:.0f} MB unproven frames ({refused} refused while sending), {after / mb:.0f} MB after"
        )
        assert during - before < RSS_GROWTH_MAX_BYTES, (
            f"the worker buffered the flood: RSS {before / mb:.0f} -> {during / mb:.0f} MB"
        )
        assert after - before < RSS_GROWTH_MAX_BYTES


@pytest.mark.timeout(120)
async def test_slow_senders_are_closed_by_the_unproven_deadline(qwen2_tiny_path) -> None:
    """Connections that announce a short frame (within what an unproven one may) and send its
    bytes one at a time never hold a slot past the unproven deadline, which counts from the
    connection's start, not from its last byte."""
    timeout_ms, senders = 2000, 8
    async with open_worker(
        qwen2_tiny_path, 0, None, threads=1, ctx_size=64, data_listen=f"{HOST}:0",
        extra_args=("--data-unproven-timeout-ms", str(timeout_ms)),
    ) as worker:  # fmt: skip
        port = worker.info.data_port
        before = rss_bytes(worker.process.pid)

        async def trickle() -> None:
            async with open_data_link(HOST, port) as link:
                sock: socket.socket = link._sock
                started = trio.current_time()
                notices = []
                with trio.fail_after(3 * timeout_ms / 1000):
                    async with trio.open_nursery() as nursery:

                        async def send_slowly() -> None:
                            with contextlib.suppress(OSError):
                                sock.send(struct.pack("<I", 1000))  # a frame an unproven connection may send
                                while True:
                                    sock.send(b"\0")  # one byte, then a stall: the attacker's pace
                                    await trio.sleep(0.1)

                        nursery.start_soon(send_slowly)
                        with contextlib.suppress(DataLinkClosed, OSError):  # closed (a reset: bytes were unread)
                            while True:
                                notices.append((await link.receive()).notice)
                        nursery.cancel_scope.cancel()
                assert trio.current_time() - started >= timeout_ms / 1000, "closed before its deadline"
                for notice in notices:
                    assert f"no frame of a session bound here opened within {timeout_ms} ms" in notice, notice

        async with trio.open_nursery() as nursery:
            for _ in range(senders):
                nursery.start_soon(trickle)
        assert rss_bytes(worker.process.pid) - before < RSS_GROWTH_MAX_BYTES
