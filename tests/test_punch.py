"""agent.io.net.punch with agent.io.net.channel: two peers with no channel listener, reached through a
"relay" (a ``MemoryNetwork`` fallback), punch a direct TLS connection on loopback, with real
sockets; requests then take it both ways. The lab test (tests/test_lab_punch.py) does the
same through a stateful filter."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent._proto import swarm_pb2
from agent.core.wire.punch import PUNCH_PROTOCOL, PunchConfig, connect_request, sync_request
from agent.io.keys import peer_id_of
from agent.io.net.channel import ChannelTransport, open_channel_transport
from agent.io.net.channel_config import ChannelConfig
from agent.io.net.punch import simultaneous_open
from agent.io.net.transport import MemoryNetwork

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60), pytest.mark.trio]

ECHO = "/test/echo/1.0.0"
RELAY_ID = peer_id_of(Ed25519PrivateKey.generate())


def circuit(peer_id: str) -> str:
    return f"/ip4/127.0.0.1/tcp/4001/p2p/{RELAY_ID}/p2p-circuit/p2p/{peer_id}"


def config(**punch: object) -> ChannelConfig:
    # no listener: neither peer can be dialled, as behind NAT
    return ChannelConfig(listen_host=None, punch=PunchConfig(**{"allow_loopback": True, **punch}))  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def two_peers(
    config_a: ChannelConfig, config_b: ChannelConfig
) -> AsyncIterator[tuple[ChannelTransport, ChannelTransport, MemoryNetwork]]:
    net = MemoryNetwork()
    ka, kb = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    async with open_channel_transport(ka, net.add(peer_id_of(ka)), config_a) as a:
        async with open_channel_transport(kb, net.add(peer_id_of(kb)), config_b) as b:
            for peer in (a, b):

                async def echo(remote: str, payload: bytes, me: ChannelTransport = peer) -> bytes:
                    return b"%s:%s" % (me.peer_id.encode()[-4:], payload)

                peer.set_handler(ECHO, echo)
            yield a, b, net


async def wait_until(condition, timeout_s: float = 20.0) -> None:
    with trio.fail_after(timeout_s):
        while not condition():
            await trio.sleep(0.01)


async def test_two_peers_reached_only_through_the_relay_punch_a_direct_connection() -> None:
    async with two_peers(config(), config()) as (a, b, net):
        addrs = [circuit(b.peer_id)]
        # the first request goes through the relay and sets the punch off; it does not wait
        assert await a.request(b.peer_id, addrs, ECHO, b"one", timeout_s=5) == b"%s:one" % b.peer_id.encode()[-4:]
        assert a.fallback_requests == 1 and a.channel_requests == 0
        # the channel counts a punched connection when it takes it, the puncher books the
        # success after handing it over: wait for both
        await wait_until(lambda: (a.puncher.book.succeeded[b.peer_id], b.puncher.book.succeeded[a.peer_id]) == (1, 1))
        assert a.connections_punched == 1 and b.connections_punched == 1
        assert net.requests[PUNCH_PROTOCOL] == 2  # CONNECT and SYNC, relayed
        # now the direct connection carries the requests, both ways, with only the circuit address
        assert await a.request(b.peer_id, addrs, ECHO, b"two", timeout_s=5) == b"%s:two" % b.peer_id.encode()[-4:]
        assert (
            await b.request(a.peer_id, [circuit(a.peer_id)], ECHO, b"back", timeout_s=5)
            == b"%s:back" % a.peer_id.encode()[-4:]
        )
        assert a.channel_requests == 1 and b.channel_requests == 1 and b.fallback_requests == 0
        assert a.path_counts([ECHO]) == {b.peer_id: (1, 1)}
        assert b.path_counts([ECHO]) == {a.peer_id: (1, 0)}
        assert a.path_counts(["/other"]) == {}


async def test_a_peer_with_punching_off_stays_relayed_and_is_asked_again_only_after_the_backoff() -> None:
    async with two_peers(config(backoff_initial_s=3600.0), config(enabled=False)) as (a, b, net):
        addrs = [circuit(b.peer_id)]
        await a.request(b.peer_id, addrs, ECHO, b"one", timeout_s=5)
        await wait_until(lambda: a.puncher.book.failed[b.peer_id] == 1)
        assert a.puncher.book.in_flight == 0
        for _ in range(3):
            await a.request(b.peer_id, addrs, ECHO, b"again", timeout_s=5)
        assert net.requests[PUNCH_PROTOCOL] == 1  # refused once, not asked again within the backoff
        assert a.path_counts([ECHO]) == {b.peer_id: (0, 4)} and a.connections_punched == 0


async def test_bad_punch_requests_get_error_replies() -> None:
    async with two_peers(config(), config(allow_loopback=False)) as (a, b, _net):
        answer = b.puncher.answer

        def error(reply: bytes) -> str:
            record = swarm_pb2.PunchReply.FromString(reply)
            return swarm_pb2.Error.Code.Name(record.error.code) + ": " + record.error.message

        assert error(await answer(a.peer_id, b"\xff\xff")).startswith("INVALID_ARGUMENT: malformed")
        assert "loopback" in error(await answer(a.peer_id, connect_request(1, "127.0.0.1", 22)))
        assert "unicast" in error(await answer(a.peer_id, connect_request(1, "224.0.0.1", 5)))
        assert error(await answer(a.peer_id, sync_request(99))).startswith("NOT_FOUND")
        assert b.puncher.book.in_flight == 0


async def test_a_punched_connection_must_prove_the_expected_peer_id() -> None:
    """Both ends of a TCP connection taken as punched: the one that expected another peer id
    refuses it after the handshake, as a dial would."""
    async with two_peers(config(), config()) as (a, b, _net):
        someone_else = peer_id_of(Ed25519PrivateKey.generate())
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        outcome = {}
        async with trio.open_nursery() as nursery:

            async def server_side() -> None:
                stream = await listeners[0].accept()
                outcome["b"] = await b._adopt_punched(a.peer_id, stream, False)

            nursery.start_soon(server_side)
            client = await trio.open_tcp_stream("127.0.0.1", port)
            outcome["a"] = await a._adopt_punched(someone_else, client, True)
        await listeners[0].aclose()
        assert outcome["a"] is False and a.connections_punched == 0
        assert not a._has_connection(someone_else)


async def test_simultaneous_open_gives_up_after_its_window() -> None:
    from agent.io.net.punch import bound_socket

    listener = bound_socket("127.0.0.1")  # bound, never listening: every SYN is refused
    target = ("127.0.0.1", listener.getsockname()[1])
    try:
        from agent.core.wire.punch import PunchError

        with trio.fail_after(10), pytest.raises(PunchError, match=r"after [0-9]+ SYNs in 0.3 s"):
            await simultaneous_open(bound_socket("127.0.0.1"), target, window_s=0.3, interval_s=0.05)
    finally:
        listener.close()
