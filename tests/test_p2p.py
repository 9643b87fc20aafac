"""The libp2p transport between real hosts on loopback: exchanges, stream reuse, limits, refusals."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from functools import partial

import multiaddr
import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from libp2p import new_host
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux

from agent.core.net.frames import decode_uvarint, encode_uvarint
from agent.core.wire.swarm_wire import MAX_TRACKER_REQUEST_BYTES, TRACKER_PROTOCOL
from agent.io.keys import peer_id_of
from agent.io.net.p2p import RelayPolicy, _libp2p_key_pair, open_p2p_transport
from agent.io.net.p2p_transport import P2PTransport
from agent.io.net.transport import TransportError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

ECHO = "/baton/test-echo/1.0.0"
TIMEOUT_S = 10.0


async def reverse(remote_peer_id: str, payload: bytes) -> bytes:
    return payload[::-1]


@contextlib.asynccontextmanager
async def two_peers(**options: object) -> AsyncIterator[tuple[P2PTransport, P2PTransport]]:
    async with open_p2p_transport(Ed25519PrivateKey.generate(), **options) as a:  # type: ignore[arg-type]
        async with open_p2p_transport(Ed25519PrivateKey.generate(), **options) as b:  # type: ignore[arg-type]
            yield a, b


def test_uvarint_round_trip() -> None:
    for value in (0, 1, 127, 128, 300, 16383, 16384, 64 << 20, 2**63 - 1):
        encoded = encode_uvarint(value)
        assert decode_uvarint(encoded + b"rest") == (value, len(encoded))
        assert decode_uvarint(encoded[:-1]) is None
    assert encode_uvarint(300) == b"\xac\x02"


async def test_round_trip_both_directions_with_authenticated_peer_ids() -> None:
    seen: list[tuple[str, str]] = []

    def handler_for(name: str):
        async def handler(remote_peer_id: str, payload: bytes) -> bytes:
            seen.append((name, remote_peer_id))
            return name.encode() + b":" + payload

        return handler

    key_a, key_b = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    with trio.fail_after(30):
        async with open_p2p_transport(key_a) as a, open_p2p_transport(key_b) as b:
            assert a.peer_id == peer_id_of(key_a) and b.peer_id == peer_id_of(key_b)
            a.set_handler(ECHO, handler_for("a"))
            b.set_handler(ECHO, handler_for("b"))
            assert await a.request(b.peer_id, b.listen_addrs, ECHO, b"hello", timeout_s=TIMEOUT_S) == b"b:hello"
            # b reaches a over the connection a opened: no address needed.
            assert await b.request(a.peer_id, [], ECHO, b"back", timeout_s=TIMEOUT_S) == b"a:back"
            assert await a.request(b.peer_id, b.listen_addrs, ECHO, b"", timeout_s=TIMEOUT_S) == b"b:"
    assert seen == [("b", a.peer_id), ("a", b.peer_id), ("b", a.peer_id)]


async def test_listen_addrs_are_loopback_with_bound_port_and_peer_id() -> None:
    with trio.fail_after(30):
        async with open_p2p_transport(Ed25519PrivateKey.generate()) as a:
            (addr,) = a.listen_addrs
            maddr = multiaddr.Multiaddr(addr)
            assert maddr.value_for_protocol("ip4") == "127.0.0.1"
            assert int(maddr.value_for_protocol("tcp")) > 0
            assert addr.endswith(f"/p2p/{a.peer_id}")


async def test_200_sequential_requests_reuse_one_stream() -> None:
    with trio.fail_after(60):
        async with two_peers() as (a, b):
            b.set_handler(ECHO, reverse)
            for index in range(200):
                payload = index.to_bytes(4, "big") * 100
                assert await a.request(b.peer_id, b.listen_addrs, ECHO, payload, timeout_s=TIMEOUT_S) == payload[::-1]
            assert a.streams_opened == 1
            assert b.streams_accepted == 1


async def test_50_concurrent_requests_all_answered_on_bounded_streams() -> None:
    count = 50
    arrived = 0
    all_arrived = trio.Event()

    async def gather_then_reply(remote_peer_id: str, payload: bytes) -> bytes:
        nonlocal arrived
        arrived += 1
        if arrived == count:
            all_arrived.set()
        await all_arrived.wait()  # every request is in flight at once
        return payload[::-1]

    replies: dict[int, bytes] = {}
    with trio.fail_after(60):
        async with two_peers(max_idle_streams_per_peer=8) as (a, b):
            b.set_handler(ECHO, gather_then_reply)

            async def one(index: int) -> None:
                replies[index] = await a.request(
                    b.peer_id, b.listen_addrs, ECHO, f"request {index}".encode(), timeout_s=TIMEOUT_S
                )

            async with trio.open_nursery() as nursery:
                for index in range(count):
                    nursery.start_soon(one, index)
            assert replies == {index: f"request {index}".encode()[::-1] for index in range(count)}
            assert a.streams_opened == count
            # A second burst reuses the 8 streams kept idle and opens the rest.
            arrived = 0
            all_arrived = trio.Event()
            async with trio.open_nursery() as nursery:
                for index in range(count):
                    nursery.start_soon(one, index)
            assert a.streams_opened == 2 * count - 8


async def test_concurrency_per_peer_is_bounded_and_excess_requests_wait() -> None:
    in_flight = 0
    peak = 0
    release = trio.Event()

    async def slow(remote_peer_id: str, payload: bytes) -> bytes:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        if in_flight == 4:
            release.set()
        await release.wait()
        in_flight -= 1
        return payload

    with trio.fail_after(60):
        async with two_peers(max_streams_per_peer=4, max_idle_streams_per_peer=4) as (a, b):
            b.set_handler(ECHO, slow)
            async with trio.open_nursery() as nursery:
                for index in range(12):
                    nursery.start_soon(
                        partial(a.request, timeout_s=TIMEOUT_S), b.peer_id, b.listen_addrs, ECHO, bytes([index])
                    )
            assert peak == 4
            assert a.streams_opened == 4


async def test_handler_exception_resets_stream_and_host_keeps_serving(caplog: pytest.LogCaptureFixture) -> None:
    async def fragile(remote_peer_id: str, payload: bytes) -> bytes:
        if payload == b"boom":
            raise RuntimeError("handler bug")
        return payload

    with trio.fail_after(30):
        async with two_peers() as (a, b):
            b.set_handler(ECHO, fragile)
            assert await a.request(b.peer_id, b.listen_addrs, ECHO, b"ok", timeout_s=TIMEOUT_S) == b"ok"
            with pytest.raises(TransportError) as raised:
                await a.request(b.peer_id, b.listen_addrs, ECHO, b"boom", timeout_s=TIMEOUT_S)
            assert raised.value.peer_id == b.peer_id
            assert await a.request(b.peer_id, b.listen_addrs, ECHO, b"next", timeout_s=TIMEOUT_S) == b"next"
            assert a.streams_opened == 2  # the reset stream was discarded, not reused
    assert "handler bug" in caplog.text


async def test_oversize_request_is_refused_without_reading_it() -> None:
    small = 1 << 20
    with trio.fail_after(30):
        async with open_p2p_transport(Ed25519PrivateKey.generate()) as a:
            async with open_p2p_transport(Ed25519PrivateKey.generate(), max_frame_bytes=small) as b:
                calls: list[int] = []

                async def record(remote_peer_id: str, payload: bytes) -> bytes:
                    calls.append(len(payload))
                    return b"ok"

                b.set_handler(ECHO, record)
                with pytest.raises(TransportError):
                    await a.request(b.peer_id, b.listen_addrs, ECHO, bytes(small + 1), timeout_s=TIMEOUT_S)
                assert calls == []
                assert await a.request(b.peer_id, b.listen_addrs, ECHO, bytes(small), timeout_s=TIMEOUT_S) == b"ok"
                assert calls == [small]
                # The sender refuses what its own limit forbids before sending anything.
                with pytest.raises(TransportError, match="over max_frame_bytes"):
                    await b.request(a.peer_id, a.listen_addrs, ECHO, bytes(small + 1), timeout_s=TIMEOUT_S)


async def test_oversize_reply_is_refused_by_the_requester() -> None:
    async def big_reply(remote_peer_id: str, payload: bytes) -> bytes:
        return bytes(int.from_bytes(payload, "big"))

    with trio.fail_after(30):
        async with open_p2p_transport(Ed25519PrivateKey.generate(), max_frame_bytes=4096) as a:
            async with open_p2p_transport(Ed25519PrivateKey.generate()) as b:
                b.set_handler(ECHO, big_reply)
                with pytest.raises(TransportError, match="over the limit of 4096 bytes"):
                    await a.request(b.peer_id, b.listen_addrs, ECHO, (4097).to_bytes(4, "big"), timeout_s=TIMEOUT_S)
                reply = await a.request(b.peer_id, b.listen_addrs, ECHO, (4096).to_bytes(4, "big"), timeout_s=TIMEOUT_S)
                assert reply == bytes(4096)


async def test_unsupported_protocol_is_a_transport_error() -> None:
    with trio.fail_after(30):
        async with two_peers() as (a, b):
            with pytest.raises(TransportError, match="could not open a stream"):
                await a.request(b.peer_id, b.listen_addrs, "/baton/nothing/1.0.0", b"x", timeout_s=TIMEOUT_S)


def _plaintext_only_host():
    key_pair = _libp2p_key_pair(Ed25519PrivateKey.generate())
    return new_host(
        key_pair=key_pair,
        sec_opt={TProtocol(PLAINTEXT_PROTOCOL_ID): InsecureTransport(key_pair)},
        muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
    )


async def test_plaintext_connection_is_refused_both_ways() -> None:
    called: list[str] = []

    async def record(remote_peer_id: str, payload: bytes) -> bytes:
        called.append(remote_peer_id)
        return payload

    with trio.fail_after(30):
        async with open_p2p_transport(Ed25519PrivateKey.generate(), connect_timeout_s=3.0) as ours:
            ours.set_handler(ECHO, record)
            plaintext = _plaintext_only_host()

            async def plaintext_handler(stream) -> None:
                called.append("plaintext host")
                await stream.reset()

            plaintext.set_stream_handler(TProtocol(ECHO), plaintext_handler)
            async with plaintext.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
                our_addr = multiaddr.Multiaddr(ours.listen_addrs[0].rsplit("/p2p/", 1)[0])
                with pytest.raises(Exception):  # noqa: B017 - any failure to connect will do
                    await plaintext.connect(PeerInfo(ID.from_base58(ours.peer_id), [our_addr]))
                with pytest.raises(Exception):  # noqa: B017
                    await plaintext.new_stream(ID.from_base58(ours.peer_id), [TProtocol(ECHO)])
                assert ID.from_base58(ours.peer_id) not in plaintext.get_network().connections
                plaintext_id = plaintext.get_id().to_base58()
                plaintext_addrs = [f"{addr}/p2p/{plaintext_id}" for addr in plaintext.get_transport_addrs()]
                with pytest.raises(TransportError, match="could not connect"):
                    await ours.request(plaintext_id, plaintext_addrs, ECHO, b"x", timeout_s=TIMEOUT_S)
    assert called == []


async def test_dialling_an_address_held_by_another_peer_fails_authentication() -> None:
    impostor_id = peer_id_of(Ed25519PrivateKey.generate())
    with trio.fail_after(30):
        async with two_peers() as (a, b):
            b.set_handler(ECHO, reverse)
            address = b.listen_addrs[0].rsplit("/p2p/", 1)[0]
            with pytest.raises(TransportError, match=r"could not connect.*upgrade security"):
                await a.request(impostor_id, [address], ECHO, b"x", timeout_s=TIMEOUT_S)
            with pytest.raises(TransportError, match="names another peer"):
                await a.request(impostor_id, b.listen_addrs, ECHO, b"x", timeout_s=TIMEOUT_S)


async def test_unreachable_peer_fails_fast_when_refused() -> None:
    with trio.socket.socket() as probe:  # a port that was free a moment ago: nothing listens
        await probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    missing = peer_id_of(Ed25519PrivateKey.generate())
    with trio.fail_after(30):
        async with open_p2p_transport(Ed25519PrivateKey.generate()) as a:
            started = trio.current_time()
            with pytest.raises(TransportError, match="could not connect"):
                await a.request(missing, [f"/ip4/127.0.0.1/tcp/{port}"], ECHO, b"x", timeout_s=TIMEOUT_S)
            assert trio.current_time() - started < TIMEOUT_S
            # Not blocked by libp2p's 60 s negative dial cache: the second try dials again.
            with pytest.raises(TransportError, match="could not connect"):
                await a.request(missing, [f"/ip4/127.0.0.1/tcp/{port}"], ECHO, b"x", timeout_s=TIMEOUT_S)
            with pytest.raises(TransportError, match="could not connect"):
                await a.request(missing, [], ECHO, b"x", timeout_s=TIMEOUT_S)


async def test_silent_peer_times_out_within_the_request_timeout() -> None:
    """A TCP listener that accepts and never speaks: the Noise handshake never completes."""

    async def hold(stream: trio.SocketStream) -> None:
        async with stream:
            await trio.sleep_forever()

    timeout_s = 1.0
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(partial(trio.serve_tcp, hold, 0, host="127.0.0.1"))
            port = listeners[0].socket.getsockname()[1]
            async with open_p2p_transport(Ed25519PrivateKey.generate(), connect_timeout_s=10.0) as a:
                started = trio.current_time()
                with pytest.raises(TransportError, match=r"within 1.0 s"):
                    await a.request(
                        peer_id_of(Ed25519PrivateKey.generate()),
                        [f"/ip4/127.0.0.1/tcp/{port}"],
                        ECHO,
                        b"x",
                        timeout_s=timeout_s,
                    )
                assert timeout_s <= trio.current_time() - started < timeout_s + 2.0
            nursery.cancel_scope.cancel()


async def test_vanished_peer_gives_transport_error_and_a_restarted_one_is_reached() -> None:
    key_b = Ed25519PrivateKey.generate()
    with trio.fail_after(60):
        async with open_p2p_transport(Ed25519PrivateKey.generate()) as a:
            async with open_p2p_transport(key_b) as b:
                b.set_handler(ECHO, reverse)
                addrs = b.listen_addrs
                assert await a.request(b.peer_id, addrs, ECHO, b"abc", timeout_s=TIMEOUT_S) == b"cba"
            with pytest.raises(TransportError):
                await a.request(peer_id_of(key_b), addrs, ECHO, b"abc", timeout_s=TIMEOUT_S)
            async with open_p2p_transport(key_b) as b_again:
                b_again.set_handler(ECHO, reverse)
                reply = await a.request(b_again.peer_id, b_again.listen_addrs, ECHO, b"xyz", timeout_s=TIMEOUT_S)
                assert reply == b"zyx"


async def test_bad_peer_ids_and_addresses_are_transport_errors() -> None:
    with trio.fail_after(30):
        async with open_p2p_transport(Ed25519PrivateKey.generate()) as a:
            with pytest.raises(TransportError, match="not a valid peer id"):
                await a.request("not-a-peer-id", [], ECHO, b"x", timeout_s=TIMEOUT_S)
            with pytest.raises(TransportError, match="bad multiaddr"):
                await a.request(
                    peer_id_of(Ed25519PrivateKey.generate()), ["/nonsense"], ECHO, b"x", timeout_s=TIMEOUT_S
                )
            with pytest.raises(TransportError, match="itself"):
                await a.request(a.peer_id, a.listen_addrs, ECHO, b"x", timeout_s=TIMEOUT_S)


async def test_configuration_is_checked() -> None:
    key = Ed25519PrivateKey.generate()
    with pytest.raises(ValueError, match="at most 240"):
        async with open_p2p_transport(key, max_streams_per_peer=250):
            pass
    with pytest.raises(ValueError, match="tcp"):
        async with open_p2p_transport(key, listen_addrs=["/ip4/127.0.0.1/udp/0/quic-v1"]):
            pass


async def test_node_reached_through_a_relay_reservation_on_the_tracker() -> None:
    seen: list[str] = []

    async def record(remote_peer_id: str, payload: bytes) -> bytes:
        seen.append(remote_peer_id)
        return b"relayed:" + payload

    with trio.fail_after(60):
        async with open_p2p_transport(Ed25519PrivateKey.generate(), enable_relay_hop=True) as tracker:
            async with open_p2p_transport(Ed25519PrivateKey.generate(), relay_addrs=tracker.listen_addrs) as node:
                node.set_handler(ECHO, record)
                _direct, circuit = node.listen_addrs
                assert circuit == f"{tracker.listen_addrs[0]}/p2p-circuit/p2p/{node.peer_id}"
                async with open_p2p_transport(Ed25519PrivateKey.generate()) as client:
                    # Only the circuit address: the client never learns the node's direct one.
                    reply = await client.request(node.peer_id, [circuit], ECHO, b"hi", timeout_s=TIMEOUT_S)
                    assert reply == b"relayed:hi"
                    reply = await client.request(node.peer_id, [circuit], ECHO, b"again", timeout_s=TIMEOUT_S)
                    assert reply == b"relayed:again"
                    assert client.streams_opened == 1
                    (connection,) = client.host.get_network().connections[ID.from_base58(node.peer_id)]
                    assert "p2p-circuit" in str(connection.get_transport_addresses())
                    assert seen == [client.peer_id, client.peer_id]  # end-to-end Noise: not the relay's id


async def test_relay_reservation_is_refused_by_a_peer_without_hop() -> None:
    with trio.fail_after(60):
        async with open_p2p_transport(Ed25519PrivateKey.generate()) as not_a_relay:
            with pytest.raises(TransportError, match="relay reservation failed"):
                async with open_p2p_transport(Ed25519PrivateKey.generate(), relay_addrs=not_a_relay.listen_addrs):
                    pass


async def test_the_relay_policy_decides_who_may_reserve_and_open_circuits() -> None:
    allowed_reserve: set[str] = set()
    allowed_connect: set[str] = set()
    policy = RelayPolicy(allowed_reserve.__contains__, allowed_connect.__contains__)
    node_key, client_key = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    node_id, client_id = peer_id_of(node_key), peer_id_of(client_key)
    with trio.fail_after(60):
        async with open_p2p_transport(
            Ed25519PrivateKey.generate(), enable_relay_hop=True, relay_policy=policy
        ) as relay:
            (relay_addr,) = relay.listen_addrs
            with pytest.raises(TransportError, match="refused the reservation"):
                async with open_p2p_transport(node_key, listen_addrs=(), relay_addrs=[relay_addr]):
                    pass
            allowed_reserve.add(node_id)
            async with open_p2p_transport(node_key, listen_addrs=(), relay_addrs=[relay_addr]) as node:
                node.set_handler(ECHO, reverse)
                (circuit,) = node.listen_addrs  # no direct address
                assert circuit == f"{relay_addr}/p2p-circuit/p2p/{node_id}"
                async with open_p2p_transport(client_key) as client:
                    with pytest.raises(TransportError, match="could not connect"):  # source not allowed
                        await client.request(node_id, [circuit], ECHO, b"abc", timeout_s=TIMEOUT_S)
                    allowed_connect.add(client_id)
                    assert await client.request(node_id, [circuit], ECHO, b"abc", timeout_s=TIMEOUT_S) == b"cba"
                async with open_p2p_transport(client_key) as client:
                    allowed_reserve.discard(node_id)  # e.g. its admission lapsed: unreachable at once
                    with pytest.raises(TransportError, match="could not connect"):
                        await client.request(node_id, [circuit], ECHO, b"abc", timeout_s=TIMEOUT_S)
                # and once its connection (and so its reservation) is gone, it cannot reserve again
                held = node._reserved_over[relay.peer_id]
                await relay.host.get_network().close_peer(ID.from_base58(node_id))
                with trio.fail_after(10):
                    while not held.is_closed:
                        await trio.sleep(0.01)
                with pytest.raises(TransportError, match="refused the reservation"):
                    await node.keep_relay_reservation(relay_addr)


async def test_a_relay_reservation_is_made_again_over_a_new_connection() -> None:
    with trio.fail_after(60):
        async with open_p2p_transport(Ed25519PrivateKey.generate(), enable_relay_hop=True) as relay:
            (relay_addr,) = relay.listen_addrs
            async with open_p2p_transport(Ed25519PrivateKey.generate(), listen_addrs=()) as node:
                node.set_handler(ECHO, reverse)
                circuit = await node.keep_relay_reservation(relay_addr)
                assert node.listen_addrs == [circuit]
                first = node._reserved_over[relay.peer_id]
                assert await node.keep_relay_reservation(relay_addr) == circuit  # held: nothing to do
                assert node._reserved_over[relay.peer_id] is first
                # The relay drops the connection, and with it the reservation (spec).
                await relay.host.get_network().close_peer(ID.from_base58(node.peer_id))
                with trio.fail_after(10):
                    while not first.is_closed:
                        await trio.sleep(0.01)
                assert await node.keep_relay_reservation(relay_addr) == circuit
                assert node._reserved_over[relay.peer_id] is not first
                assert node.listen_addrs == [circuit]
                async with open_p2p_transport(Ed25519PrivateKey.generate()) as client:
                    assert await client.request(node.peer_id, [circuit], ECHO, b"abc", timeout_s=TIMEOUT_S) == b"cba"


async def test_hosts_do_not_auto_dial_known_peers() -> None:
    # py-libp2p's AutoConnector would dial peerstore peers towards 200 connections.
    async with two_peers() as (a, b):
        b.set_handler(ECHO, reverse)
        assert await a.request(b.peer_id, b.listen_addrs, ECHO, b"xy", timeout_s=TIMEOUT_S) == b"yx"
        for transport in (a, b):
            assert transport.host.get_network().auto_connector._started is False


async def test_a_circuit_ending_leaves_other_circuits_to_the_same_peer_alone() -> None:
    # py-libp2p's relay closed the latest circuit to a peer whenever any circuit to it ended.
    with trio.fail_after(60):
        async with open_p2p_transport(Ed25519PrivateKey.generate(), enable_relay_hop=True) as relay:
            (relay_addr,) = relay.listen_addrs
            async with open_p2p_transport(
                Ed25519PrivateKey.generate(), listen_addrs=(), relay_addrs=[relay_addr]
            ) as node:
                node.set_handler(ECHO, reverse)
                protocol = relay._circuit.protocol
                relay_data = protocol._relay_data
                ended: list[str] = []  # relayed directions that finished

                async def counting(*args: object, **kwargs: object) -> None:
                    try:
                        await relay_data(*args, **kwargs)
                    finally:
                        ended.append(str(args[2]))

                protocol._relay_data = counting
                async with open_p2p_transport(Ed25519PrivateKey.generate()) as staying:
                    async with open_p2p_transport(Ed25519PrivateKey.generate()) as leaving:
                        assert (
                            await leaving.request(node.peer_id, node.listen_addrs, ECHO, b"ab", timeout_s=TIMEOUT_S)
                            == b"ba"
                        )
                        assert (
                            await staying.request(node.peer_id, node.listen_addrs, ECHO, b"cd", timeout_s=TIMEOUT_S)
                            == b"dc"
                        )
                        (circuit,) = staying.host.get_network().connections[ID.from_base58(node.peer_id)]
                    with trio.fail_after(10):  # the relay has wound up both directions of that circuit
                        while len(ended) < 2:
                            await trio.sleep(0.01)
                    assert not circuit.is_closed
                    assert (
                        await staying.request(node.peer_id, node.listen_addrs, ECHO, b"ef", timeout_s=TIMEOUT_S)
                        == b"fe"
                    )
                    assert staying.host.get_network().connections[ID.from_base58(node.peer_id)] == [circuit]


async def test_the_tracker_protocol_reads_no_request_over_its_own_bound() -> None:
    # anyone may reach a tracker before admission: its protocol's bound is what its records need,
    # not the transport's 64 MiB, and it is checked on the length prefix
    bound = MAX_TRACKER_REQUEST_BYTES
    with trio.fail_after(30):
        async with open_p2p_transport(Ed25519PrivateKey.generate()) as a:
            async with open_p2p_transport(Ed25519PrivateKey.generate()) as tracker:
                calls: list[int] = []

                async def record(remote_peer_id: str, payload: bytes) -> bytes:
                    calls.append(len(payload))
                    return b"ok"

                tracker.set_handler(TRACKER_PROTOCOL, record)
                tracker.set_handler(ECHO, record)
                with pytest.raises(TransportError):
                    await a.request(
                        tracker.peer_id, tracker.listen_addrs, TRACKER_PROTOCOL, bytes(bound + 1), timeout_s=TIMEOUT_S
                    )
                assert calls == []
                ok = await a.request(
                    tracker.peer_id, tracker.listen_addrs, TRACKER_PROTOCOL, bytes(bound), timeout_s=TIMEOUT_S
                )
                assert ok == b"ok" and calls == [bound]
                # a protocol that carries rows keeps the transport's bound
                assert (
                    await a.request(tracker.peer_id, tracker.listen_addrs, ECHO, bytes(4 * bound), timeout_s=TIMEOUT_S)
                    == b"ok"
                )


async def test_a_peer_not_admitted_sends_admission_sized_requests_and_few_bytes_at_once() -> None:
    # the tracker says who is admitted (``request_gate.is_admitted``); a stranger's request over
    # the admission size is refused on its length prefix, and so is a stream that would take
    # its bytes in flight over its bound, while the other streams are answered
    with trio.fail_after(30):
        async with open_p2p_transport(Ed25519PrivateKey.generate()) as a:
            async with open_p2p_transport(Ed25519PrivateKey.generate()) as tracker:
                admitted: set[str] = set()
                tracker.request_gate.is_admitted = admitted.__contains__
                release = trio.Event()
                calls: list[int] = []

                async def record(remote_peer_id: str, payload: bytes) -> bytes:
                    calls.append(len(payload))
                    if payload.startswith(b"wait"):
                        await release.wait()
                    return b"ok"

                tracker.set_handler(TRACKER_PROTOCOL, record)
                with pytest.raises(TransportError):
                    await a.request(
                        tracker.peer_id, tracker.listen_addrs, TRACKER_PROTOCOL, bytes(100_000), timeout_s=TIMEOUT_S
                    )
                assert calls == [] and tracker.request_gate.in_flight.refused == 1
                small = bytes(60_000)
                assert await a.request(tracker.peer_id, tracker.listen_addrs, TRACKER_PROTOCOL, small,
                                       timeout_s=TIMEOUT_S) == b"ok"  # fmt: skip
                # 256 KiB in flight at most: four waiting 60 kB requests, the fifth is refused
                outcomes: list[bytes | str] = []

                async def one() -> None:
                    addrs = tracker.listen_addrs
                    try:
                        outcomes.append(
                            await a.request(
                                tracker.peer_id, addrs, TRACKER_PROTOCOL, b"wait" + small, timeout_s=TIMEOUT_S
                            )
                        )
                    except TransportError as error:
                        outcomes.append(str(error))
                        release.set()  # the refusal came: let the others be answered

                async with trio.open_nursery() as nursery:
                    for _ in range(5):
                        nursery.start_soon(one)
                assert outcomes.count(b"ok") == 4 and len(outcomes) == 5
                assert tracker.request_gate.in_flight.total_bytes == 0
                admitted.add(a.peer_id)  # admitted: the protocol's own limit
                assert await a.request(tracker.peer_id, tracker.listen_addrs, TRACKER_PROTOCOL, bytes(100_000),
                                       timeout_s=TIMEOUT_S) == b"ok"  # fmt: skip
