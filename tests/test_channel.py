"""agent.io.net.channel: the direct TLS channel, over real sockets on loopback.

Fallback peers are a ``MemoryNetwork`` (the channel must not need libp2p to be tested)."""

from __future__ import annotations

import contextlib
import functools
import socket
import ssl
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.core.net import frames
from agent.core.net.multiaddrs import channel_multiaddr, parse_channel_multiaddr
from agent.io.keys import peer_id_of
from agent.io.net.channel import open_channel_transport
from agent.io.net.channel_config import ChannelConfig
from agent.io.net.channel_tls import _TlsStream, tls_contexts
from agent.io.net.transport import ImmediateHandler, MemoryNetwork, TransportError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60), pytest.mark.trio]

ECHO = "/test/echo/1.0.0"


class Pair:
    def __init__(self, a, b, net: MemoryNetwork) -> None:
        self.a, self.b, self.net = a, b, net
        self.seen: list[tuple[str, bytes]] = []
        self.release = trio.Event()
        self.arrived = trio.Event()

        async def echo(remote: str, payload: bytes) -> bytes:
            self.seen.append((remote, payload))
            self.arrived.set()
            if payload.startswith(b"slow"):
                await self.release.wait()
            return b"echo:" + payload

        b.set_handler(ECHO, echo)


@pytest.fixture
async def pair():
    net = MemoryNetwork()
    ka, kb = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    async with open_channel_transport(ka, net.add(peer_id_of(ka)), ChannelConfig(max_frame_bytes=4096)) as a:
        async with open_channel_transport(kb, net.add(peer_id_of(kb)), ChannelConfig(max_frame_bytes=4096)) as b:
            yield Pair(a, b, net)


async def test_requests_are_pipelined_on_one_authenticated_connection(pair: Pair) -> None:
    a, b = pair.a, pair.b
    assert parse_channel_multiaddr(b.listen_addrs[0])[2] == b.peer_id
    replies = {}

    async def one(i: int) -> None:
        replies[i] = await a.request(b.peer_id, b.listen_addrs, ECHO, b"m%d" % i, timeout_s=10)

    async with trio.open_nursery() as nursery:
        for i in range(50):
            nursery.start_soon(one, i)
    assert replies == {i: b"echo:m%d" % i for i in range(50)}
    assert a.connections_dialled == 1 and b.connections_accepted == 1
    assert a.channel_requests == 50 and a.fallback_requests == 0
    assert {remote for remote, _ in pair.seen} == {a.peer_id}  # the id the certificate proved


async def test_a_slow_exchange_does_not_hold_up_others(pair: Pair) -> None:
    a, b = pair.a, pair.b
    async with trio.open_nursery() as nursery:
        slow = {}

        async def slow_one() -> None:
            slow["reply"] = await a.request(b.peer_id, b.listen_addrs, ECHO, b"slow", timeout_s=10)

        nursery.start_soon(slow_one)
        assert await a.request(b.peer_id, b.listen_addrs, ECHO, b"fast", timeout_s=10) == b"echo:fast"
        pair.release.set()
    assert slow["reply"] == b"echo:slow"


async def test_a_peer_with_another_key_cannot_answer_for_a_peer_id(pair: Pair) -> None:
    """B's channel address offered as X's: B proves to be B, so nothing is sent to it."""
    a, b = pair.a, pair.b
    x = peer_id_of(Ed25519PrivateKey.generate())
    host, port, _ = parse_channel_multiaddr(b.listen_addrs[0])
    with pytest.raises(TransportError, match="unreachable"):  # no channel; the fallback knows no X
        await a.request(x, [f"/ip4/{host}/tcp/{port}/tls/p2p/{x}"], ECHO, b"secret", timeout_s=5)
    assert pair.seen == [] and a.channel_requests == 0
    with pytest.raises(TransportError, match="names another peer"):
        await a.request(x, b.listen_addrs, ECHO, b"secret", timeout_s=5)


async def test_falls_back_when_there_is_no_channel(pair: Pair) -> None:
    a, b = pair.a, pair.b
    assert await a.request(b.peer_id, [f"/memory/{b.peer_id}/p2p/{b.peer_id}"], ECHO, b"x", timeout_s=5) == b"echo:x"
    assert a.fallback_requests == 1 and a.channel_requests == 0


async def _raw_tls(port: int, context: ssl.SSLContext) -> _TlsStream:
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    stream = _TlsStream(tcp, context, server_side=False)
    await stream.do_handshake()
    return stream


def _port(transport) -> int:
    return parse_channel_multiaddr(transport.listen_addrs[0])[1]


async def _closed_without_reply(receive) -> bool:
    with trio.fail_after(5):
        try:
            return await receive(1 << 16) == b""
        except (trio.BrokenResourceError, ssl.SSLError, OSError):
            return True


async def test_plaintext_is_refused(pair: Pair) -> None:
    b = pair.b
    async with await trio.open_tcp_stream("127.0.0.1", _port(b)) as tcp:
        body = frames.request_header(1, ECHO) + b"plain"
        await tcp.send_all(frames.frame_prefix(len(body)) + body)
        assert await _closed_without_reply(tcp.receive_some)
    assert pair.seen == [] and b.connections_refused == 1


async def test_a_client_without_a_peer_certificate_is_refused(pair: Pair) -> None:
    b = pair.b
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    context.set_alpn_protocols(["baton-channel/1"])
    tcp = await trio.open_tcp_stream("127.0.0.1", _port(b))
    stream = _TlsStream(tcp, context, server_side=False)
    try:
        await stream.do_handshake()
        body = frames.request_header(1, ECHO) + b"anonymous"
        await stream.send_all(frames.frame_prefix(len(body)) + body)
        assert await _closed_without_reply(stream.receive_some)
    except (ssl.SSLError, trio.BrokenResourceError):
        pass  # refused in the handshake itself
    finally:
        await stream.aclose()
    assert pair.seen == [] and b.connections_refused == 1


@pytest.mark.parametrize(
    "bad",
    [
        frames.frame_prefix(4097),  # over max_frame_bytes (4096): refused on the prefix
        frames.frame_prefix(6) + b"\x09\x00\x00\x00\x01x",  # unknown kind
        frames.frame_prefix(3) + b"\x01\x00\x00",  # too short for a header
        b"\xff" * 11,  # a length prefix that never ends
        frames.frame_prefix(7) + b"\x05\x00\x00\x00\x00ab",  # a TAKEN frame with half an exchange id
        frames.frame_prefix(100) + b"\x01\x00\x00\x00\x01",  # truncated: the peer closes mid-frame
    ],
    ids=["oversize", "garbage-kind", "short", "bad-prefix", "bad-taken", "truncated"],
)
async def test_bad_frames_close_that_connection_only(pair: Pair, bad: bytes) -> None:
    a, b = pair.a, pair.b
    async with trio.open_nursery() as nursery:
        in_flight = {}

        async def session() -> None:  # another session's exchange, in flight meanwhile
            in_flight["reply"] = await a.request(b.peer_id, b.listen_addrs, ECHO, b"slow session", timeout_s=10)

        nursery.start_soon(session)
        with trio.fail_after(5):
            await pair.arrived.wait()  # the handler holds the other session's request
        key = Ed25519PrivateKey.generate()
        _server, client = tls_contexts(key, 3600)
        rogue = await _raw_tls(_port(b), client)
        await rogue.send_all(bad)
        if bad.endswith(b"\x01\x00\x00\x00\x01"):
            await rogue.aclose()  # truncated frame: the TCP stream ends inside it
            with trio.fail_after(5):
                while b.frames_refused == 0:  # a condition to reach, not a delay to wait out
                    await trio.sleep(0.01)
        else:
            assert await _closed_without_reply(rogue.receive_some)
            await rogue.aclose()
        assert b.frames_refused == 1
        pair.release.set()
    assert in_flight["reply"] == b"echo:slow session"
    assert [payload for _, payload in pair.seen] == [b"slow session"]
    assert await a.request(b.peer_id, b.listen_addrs, ECHO, b"after", timeout_s=5) == b"echo:after"


async def test_oversize_requests_are_refused_locally(pair: Pair) -> None:
    with pytest.raises(TransportError, match="over max_frame_bytes"):
        await pair.a.request(pair.b.peer_id, pair.b.listen_addrs, ECHO, bytes(5000), timeout_s=5)


async def test_big_and_small_frames_sent_at_once_stay_whole() -> None:
    # A frame over the single-write size goes out in two parts (not copied into one buffer);
    # nothing else may be sent between them, though the connection has no lock of its own:
    # concurrent requests of both sizes, all on one connection, each echoed intact.
    net = MemoryNetwork()
    ka, kb = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    config = ChannelConfig(max_frame_bytes=1 << 22)

    async def echo(_remote: str, payload: bytes) -> bytes:
        return payload

    payloads = [(b"%03d" % i) * (100_000 if i % 2 else 10) for i in range(24)]  # 300 KB and 30 bytes
    replies: dict[int, bytes] = {}
    async with open_channel_transport(ka, net.add(peer_id_of(ka)), config) as a:
        async with open_channel_transport(kb, net.add(peer_id_of(kb)), config) as b:
            b.set_handler(ECHO, echo)

            async def one(i: int) -> None:
                replies[i] = await a.request(b.peer_id, b.listen_addrs, ECHO, payloads[i], timeout_s=30)

            async with trio.open_nursery() as nursery:
                for i in range(len(payloads)):
                    nursery.start_soon(one, i)
            assert b.frames_refused == 0 and a.connections_dialled == 1
    assert replies == dict(enumerate(payloads))


async def test_a_send_cut_short_ends_that_connection_and_the_next_request_dials_anew() -> None:
    # A request cancelled (its timeout) while its big frame is half on the wire: the rest of
    # that connection's byte stream can no longer be framed, so it is shut at once (the peer
    # sees a truncated frame, never a corrupt one) and the next request dials a new one,
    # even before the old connection's reader has noticed. The peer is a bare TLS server
    # that reads nothing on its first connection until the sender has given up.
    net = MemoryNetwork()
    ka, kb = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    b_id = peer_id_of(kb)
    server_context, _client = tls_contexts(kb, 3600)
    big = bytes(32 << 20)  # far more than loopback's socket buffers take unread
    gave_up = trio.Event()
    first_done = trio.Event()
    first: dict[str, object] = {}
    accepted = 0

    async def serve(tcp: trio.SocketStream) -> None:
        nonlocal accepted
        accepted += 1
        stream = _TlsStream(tcp, server_context, server_side=True)
        try:
            await stream.do_handshake()
            reader = frames.FrameReader(64 << 20)
            if accepted == 1:
                await gave_up.wait()
                try:
                    while data := await stream.receive_some():
                        reader.feed(data)
                except trio.BrokenResourceError:
                    pass  # no close_notify: the sender shut its socket
                first["whole_frames"] = reader.next_frame() is not None
                first["cut_inside_a_frame"] = not reader.at_frame_boundary and reader.needed() > 0
                first_done.set()
                return
            while (frame := reader.take_frame(frames.parse_channel_frame)) is None:
                reader.feed(await stream.receive_some())
            body = frames.reply_header(frame.exchange_id) + b"echo:" + frame.payload
            await stream.send_all(frames.frame_prefix(len(body)) + body)
            with contextlib.suppress(trio.BrokenResourceError):
                await stream.receive_some()  # until the client goes
        finally:
            await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
        addr = channel_multiaddr("127.0.0.1", listeners[0].socket.getsockname()[1], b_id)
        config = ChannelConfig(max_frame_bytes=64 << 20, listen_host=None)
        async with open_channel_transport(ka, net.add(peer_id_of(ka)), config) as a:
            with pytest.raises(TransportError, match="no reply"):
                await a.request(b_id, [addr], ECHO, big, timeout_s=1.0)
            gave_up.set()
            assert await a.request(b_id, [addr], ECHO, b"after", timeout_s=10) == b"echo:after"
            assert a.connections_dialled == 2
        with trio.fail_after(10):
            await first_done.wait()
        nursery.cancel_scope.cancel()
    assert first == {"whole_frames": False, "cut_inside_a_frame": True}


@contextlib.asynccontextmanager
async def _open_tls_pair() -> AsyncIterator[tuple[_TlsStream, _TlsStream]]:
    """A TLS client and server over a socket pair, handshake done (peer certificates both
    ways); both closed on exit."""
    server_context, _ = tls_contexts(Ed25519PrivateKey.generate(), 3600)
    _, client_context = tls_contexts(Ed25519PrivateKey.generate(), 3600)
    left, right = trio.socket.socketpair()
    client = _TlsStream(trio.SocketStream(left), client_context, server_side=False)
    server = _TlsStream(trio.SocketStream(right), server_context, server_side=True)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.do_handshake)
            nursery.start_soon(server.do_handshake)
        yield client, server
    finally:
        await client.aclose()
        await server.aclose()


async def test_tls_garbage_after_good_records_gives_the_records_then_an_error_every_time() -> None:
    # Bytes that are no TLS record, from the network behind the peer's back: what came before
    # them is delivered, then every receive raises at once (none waits for more bytes that
    # cannot help).
    async with _open_tls_pair() as (client, server):
        await server.send_all(b"before the garbage")
        # an application-data record header and 5 bytes of junk, past TLS onto the socket
        socket.socket.send(server._sock, b"\x17\x03\x03\x00\x05junk!")
        with trio.fail_after(5):
            received = b""
            while received != b"before the garbage":
                received += await client.receive_some()
            for _ in range(3):
                with pytest.raises(trio.BrokenResourceError, match="uncleanly"):
                    await client.receive_some()


async def test_a_big_frame_is_received_in_bounded_pieces() -> None:
    # However much has come, one receive decrypts at most max_bytes (256 KiB by default): the
    # frame reader checkpoints between receives, so a huge frame cannot hold the event loop.
    async with _open_tls_pair() as (client, server):
        data = bytes(range(256)) * 4096  # 1 MiB
        buffer = memoryview(bytearray(len(data)))
        received = 0
        # as much as the kernel lets the sender queue (more than 256 KiB) waits in the socket
        server._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.send_all, data)
            await trio.testing.wait_all_tasks_blocked()  # the sender waits on a full socket
            with trio.fail_after(10):
                while received < len(data):
                    got = await client.receive_into(buffer[received:])
                    assert 0 < got <= 256 * 1024
                    received += got
        assert bytes(buffer) == data
        buffer.release()


async def test_a_tls_close_notify_is_a_clean_end_on_every_receive() -> None:
    async with _open_tls_pair() as (client, server):
        await server.send_all(b"last words")
        with contextlib.suppress(ssl.SSLWantReadError):
            server._sock.unwrap()  # sends close_notify (then would wait for ours)
        with trio.fail_after(5):
            received = b""
            while data := await client.receive_some():
                received += data
            assert received == b"last words"
            assert await client.receive_some() == b""  # and again: no wait for the TCP end
            assert await client.receive_some() == b""


async def test_immediate_answers_stay_whole_when_the_reader_cannot_send_them_at_once() -> None:
    # An ImmediateHandler is answered in the frame reader, which never waits on a write: a big
    # reply goes out partly at once and the rest from the connection's writer, which holds the
    # stream until it is done; replies that find the stream held, or the writer with work,
    # queue behind it. Big and small replies at once, all on one connection, each whole and in
    # its own exchange (a reply sent ahead of the queue, leaving a rest behind it, would
    # deadlock the writer: this test hung so).
    net = MemoryNetwork()
    ka, kb = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    config = ChannelConfig(max_frame_bytes=1 << 23)
    payloads = [(b"%03d" % i) * (1_000_000 if i % 3 == 0 else 10) for i in range(24)]  # 3 MB and 30 bytes
    replies: dict[int, bytes] = {}
    async with open_channel_transport(ka, net.add(peer_id_of(ka)), config) as a:
        async with open_channel_transport(kb, net.add(peer_id_of(kb)), config) as b:
            b.set_handler(ECHO, ImmediateHandler(lambda _remote, payload: b"echo:" + payload))

            async def one(i: int) -> None:
                replies[i] = await a.request(b.peer_id, b.listen_addrs, ECHO, payloads[i], timeout_s=30)

            with trio.fail_after(30):
                async with trio.open_nursery() as nursery:
                    for i in range(len(payloads)):
                        nursery.start_soon(one, i)
            assert b.frames_refused == 0 and a.frames_refused == 0 and a.connections_dialled == 1
    assert replies == {i: b"echo:" + p for i, p in enumerate(payloads)}


@pytest.mark.parametrize("reply_later", [True, False])
async def test_a_reply_later_goes_out_after_the_task_its_request_woke(pair: Pair, reply_later: bool) -> None:
    # A step's ack (reply_later) leaves after the serving task it woke has run, so that the
    # Forward starts first; a plain immediate reply leaves at once, from the frame reader.
    # Seen from the requester's socket: has the reply reached it when the woken task runs?
    a, b = pair.a, pair.b
    woken = trio.Event()
    seen: list[bool] = []

    def answer(_remote: str, payload: bytes) -> bytes:
        woken.set()
        return b"ack:" + payload

    b.set_handler("/test/later/1.0.0", ImmediateHandler(answer, reply_later=reply_later))
    assert await a.request(b.peer_id, b.listen_addrs, ECHO, b"dial", timeout_s=10) == b"echo:dial"
    (connection,) = a._connections.values()

    async def woken_task() -> None:
        await woken.wait()
        # has b sent the reply? Then a's frame reader has taken it, or its bytes wait on a's
        # socket (loopback delivers them within b's send)
        if any(waiter.done is not None and waiter.done.is_set() for waiter in connection.pending.values()):
            seen.append(True)
            return
        try:
            socket.socket.recv(connection.stream._sock, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            seen.append(True)
        except BlockingIOError:
            seen.append(False)

    for round_ in range(5):
        woken = trio.Event()
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(woken_task)
                reply = await a.request(b.peer_id, b.listen_addrs, "/test/later/1.0.0", b"%d" % round_, timeout_s=10)
        assert reply == b"ack:%d" % round_
    assert seen == [not reply_later] * 5


async def test_the_later_replies_of_one_read_go_out_in_one_write_in_order(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Requests that arrive together (one read) are answered by reply_later handlers: their
    # replies leave in one write (one system call for all), each to its own exchange.
    a, b = pair.a, pair.b
    b.set_handler("/test/later/1.0.0", ImmediateHandler(lambda _remote, payload: b"ack:" + payload, reply_later=True))
    assert await a.request(b.peer_id, b.listen_addrs, ECHO, b"dial", timeout_s=10) == b"echo:dial"
    (requester,) = a._connections.values()
    writes: list[int] = []  # b's: parts per write
    send_nowait = type(requester.stream).send_nowait

    def counted(stream, *parts: bytes) -> list[memoryview] | None:
        if stream is not requester.stream:
            writes.append(len(parts))
        return send_nowait(stream, *parts)

    monkeypatch.setattr(type(requester.stream), "send_nowait", counted)
    replies: dict[int, bytes | TransportError] = {}
    done = trio.Event()

    def take(index: int):
        def on_reply(reply: bytes | TransportError) -> None:
            replies[index] = reply
            if len(replies) == 3:
                done.set()

        return on_reply

    # sent before b's reader runs (one process): b reads all three at once
    for index in range(3):
        assert a.request_soon(b.peer_id, "/test/later/1.0.0", b"%d" % index, timeout_s=10, on_reply=take(index))
    with trio.fail_after(10):
        await done.wait()
    assert replies == {i: b"ack:%d" % i for i in range(3)}
    assert writes == [1], "three replies, one write of one buffer"


async def test_an_immediate_handler_that_raises_answers_an_error_and_the_connection_serves_on(pair: Pair) -> None:
    a, b = pair.a, pair.b

    def answer(_remote: str, payload: bytes) -> bytes:
        if payload == b"bad":
            raise ValueError("a bug")
        return b"ok:" + payload

    b.set_handler("/test/now/1.0.0", ImmediateHandler(answer))
    with pytest.raises(TransportError, match=r"handler failed \(ValueError\)"):
        await a.request(b.peer_id, b.listen_addrs, "/test/now/1.0.0", b"bad", timeout_s=10)
    assert await a.request(b.peer_id, b.listen_addrs, "/test/now/1.0.0", b"good", timeout_s=10) == b"ok:good"
    assert a.connections_dialled == 1 and b.frames_refused == 0


async def test_a_peer_is_answered_over_its_own_connection_without_a_dial(pair: Pair) -> None:
    """An owner behind NAT names no address a node can dial: the node's requests to it (a step's
    result) go back over the connection the owner opened, and nothing is dialled."""
    a, b = pair.a, pair.b
    a.set_handler(ECHO, lambda _remote, payload: _echo_reply(payload))
    assert await a.request(b.peer_id, b.listen_addrs, ECHO, b"to b", timeout_s=10) == b"echo:to b"
    assert await b.request(a.peer_id, [], ECHO, b"back", timeout_s=10) == b"echo:back"
    replied = trio.Event()
    assert b.request_soon(a.peer_id, ECHO, b"soon", timeout_s=10, on_reply=lambda _reply: replied.set())
    with trio.fail_after(10):
        await replied.wait()
    assert b.connections_dialled == 0 and a.connections_accepted == 0 and b.fallback_requests == 0
    assert b.channel_requests == 2


async def _echo_reply(payload: bytes) -> bytes:
    return b"echo:" + payload


async def test_request_soon_answers_through_its_callback_or_says_it_sent_nothing() -> None:
    net = MemoryNetwork()
    ka, kb = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    release = trio.Event()

    async def echo(_remote: str, payload: bytes) -> bytes:
        if payload == b"never":
            await release.wait()
        return b"echo:" + payload

    config = ChannelConfig(deadline_check_interval_s=0.05)
    async with open_channel_transport(ka, net.add(peer_id_of(ka)), config) as a:
        async with open_channel_transport(kb, net.add(peer_id_of(kb)), config) as b:
            b.set_handler(ECHO, echo)
            outcomes: dict[str, bytes | TransportError] = {}
            arrived = {name: trio.Event() for name in ("reply", "late", "cut")}

            def outcome(name: str):
                def take(reply: bytes | TransportError) -> None:
                    outcomes[name] = reply
                    arrived[name].set()

                return take

            def soon(name: str, payload: bytes, timeout_s: float = 10) -> bool:
                return a.request_soon(b.peer_id, ECHO, payload, timeout_s=timeout_s, on_reply=outcome(name))

            # no connection open yet: nothing sent, no callback to come
            assert not soon("none", b"x") and a.requests_sent_soon == 0
            assert await a.request(b.peer_id, b.listen_addrs, ECHO, b"dial", timeout_s=10) == b"echo:dial"
            with trio.fail_after(10):
                assert soon("reply", b"now")
                await arrived["reply"].wait()
                assert outcomes["reply"] == b"echo:now"
                # no reply by the deadline: a TransportError, checked at the next interval
                assert soon("late", b"never", timeout_s=0.1)
                await arrived["late"].wait()
                assert isinstance(outcomes["late"], TransportError) and "no reply" in str(outcomes["late"])
                # the connection fails with the exchange in flight: a TransportError at once
                assert soon("cut", b"never")
                (connection,) = a._connections.values()
                await connection.stream.aclose()
                await arrived["cut"].wait()
                assert isinstance(outcomes["cut"], TransportError) and "channel closed" in str(outcomes["cut"])
            assert "none" not in outcomes and a.requests_sent_soon == 3
            release.set()


# -- quiet requests (channel version 2): only refusals are answered one by one ----------------

QUIET = "/test/quiet/1.0.0"


def _taking_handler(seen: list[bytes]) -> ImmediateHandler:
    """Takes every request but those starting with ``refuse``; b"ok" is its acceptance."""

    def answer(_remote: str, payload: bytes) -> bytes:
        seen.append(payload)
        return b"no" if payload.startswith(b"refuse") else b"ok"

    return ImmediateHandler(answer, reply_later=True, is_acceptance=lambda reply: reply == b"ok")


async def _until(condition, timeout_s: float = 10) -> None:
    with trio.fail_after(timeout_s):
        while not condition():  # a condition to reach, not a delay to wait out
            await trio.sleep(0.01)


class _Outcomes:
    """``on_reply`` callbacks by name, and an event per name set when its callback ran."""

    def __init__(self) -> None:
        self.got: dict[str, bytes | TransportError] = {}
        self.events: dict[str, trio.Event] = {}

    def __call__(self, name: str):
        self.events[name] = trio.Event()

        def take(reply: bytes | TransportError) -> None:
            self.got[name] = reply
            self.events[name].set()

        return take

    async def wait(self, *names: str) -> None:
        with trio.fail_after(10):
            for name in names:
                await self.events[name].wait()


@contextlib.asynccontextmanager
async def _open_two(config: ChannelConfig) -> AsyncIterator[tuple]:
    net = MemoryNetwork()
    ka, kb = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    async with open_channel_transport(ka, net.add(peer_id_of(ka)), config) as a:
        async with open_channel_transport(kb, net.add(peer_id_of(kb)), config) as b:
            yield a, b


async def test_quiet_requests_hear_only_refusals_and_acceptances_are_confirmed_in_bulk() -> None:
    async with _open_two(ChannelConfig(ack_delay_s=1.0)) as (a, b):
        seen: list[bytes] = []
        b.set_handler(QUIET, _taking_handler(seen))
        # a plain request gets every reply, acceptances included (and dials the connection)
        assert await a.request(b.peer_id, b.listen_addrs, QUIET, b"dial", timeout_s=10) == b"ok"
        (requester,) = a._connections.values()
        assert requester.quiet_requests  # both speak version 2
        outcomes = _Outcomes()
        for name in ("take 1", "take 2", "refuse 3", "take 4"):
            assert a.request_soon(b.peer_id, QUIET, name.encode(), timeout_s=10, on_reply=outcomes(name), quiet=True)
        # not quiet: its acceptance is a reply of its own, as always
        assert a.request_soon(b.peer_id, QUIET, b"take loud", timeout_s=10, on_reply=outcomes("loud"))
        await outcomes.wait("refuse 3", "loud")
        assert outcomes.got == {"refuse 3": b"no", "loud": b"ok"}  # the refusal at once
        assert requester.acceptances_confirmed == 0  # the acceptances: a second later, together
        await _until(lambda: requester.acceptances_confirmed == 3)
        assert list(outcomes.got) == ["refuse 3", "loud"], "an acceptance calls nothing"
        assert requester.pending == {}
        assert requester.taken_frames_received == 1  # the three in one frame
        assert seen == [b"dial", b"take 1", b"take 2", b"refuse 3", b"take 4", b"take loud"]


async def test_an_unconfirmed_quiet_request_still_ends_with_its_deadline_or_its_connection() -> None:
    config = ChannelConfig(ack_delay_s=60.0, deadline_check_interval_s=0.05)
    async with _open_two(config) as (a, b):
        seen: list[bytes] = []
        b.set_handler(QUIET, _taking_handler(seen))
        assert await a.request(b.peer_id, b.listen_addrs, QUIET, b"dial", timeout_s=10) == b"ok"
        (requester,) = a._connections.values()
        outcomes = _Outcomes()
        # b takes it but confirms only after a minute: past the deadline, a TransportError
        assert a.request_soon(b.peer_id, QUIET, b"take late", timeout_s=0.2, on_reply=outcomes("late"), quiet=True)
        await outcomes.wait("late")
        assert isinstance(outcomes.got["late"], TransportError) and "no reply" in str(outcomes.got["late"])
        # the connection breaks before b confirmed it: a TransportError at once
        assert a.request_soon(b.peer_id, QUIET, b"take cut", timeout_s=30, on_reply=outcomes("cut"), quiet=True)
        await _until(lambda: seen[-1:] == [b"take cut"])
        await requester.stream.aclose()
        await outcomes.wait("cut")
        assert isinstance(outcomes.got["cut"], TransportError) and "channel closed" in str(outcomes.got["cut"])
        assert requester.acceptances_confirmed == 0


async def _read_channel_frame(stream: _TlsStream, reader: frames.FrameReader) -> frames.ChannelFrame:
    with trio.fail_after(10):
        while (frame := reader.take_frame(frames.parse_channel_frame)) is None:
            data = await stream.receive_some(1 << 16)
            assert data, "the peer closed the connection"
            reader.feed(data)
    return frame


async def test_a_version_1_peer_is_sent_plain_requests_and_gets_every_reply() -> None:
    # A peer from before quiet requests negotiates baton-channel/1: a quiet request_soon
    # goes to it as a plain REQUEST, and its requests to us get their acceptances as replies.
    async with _open_two(ChannelConfig()) as (a, _b):
        old_key = Ed25519PrivateKey.generate()
        old_id = peer_id_of(old_key)
        server_context, _client = tls_contexts(old_key, 3600)
        server_context.set_alpn_protocols(["baton-channel/1"])
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        accepted: list[_TlsStream] = []
        ready = trio.Event()

        async def serve(tcp: trio.SocketStream) -> None:
            stream = _TlsStream(tcp, server_context, server_side=True)
            try:
                await stream.do_handshake()
                accepted.append(stream)
                ready.set()
                await trio.sleep_forever()
            finally:
                with trio.CancelScope(shield=True):
                    await stream.aclose()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, serve, listeners)
            seen: list[bytes] = []
            a.set_handler(QUIET, _taking_handler(seen))
            outcomes = _Outcomes()
            address = channel_multiaddr("127.0.0.1", port, old_id)
            async with trio.open_nursery() as dial:  # a dials the old peer with a plain request
                dial.start_soon(functools.partial(a.request, old_id, [address], QUIET, b"dial", timeout_s=10))
                with trio.fail_after(10):
                    await ready.wait()
                (old,) = accepted
                assert old.selected_alpn_protocol() == "baton-channel/1"
                reader = frames.FrameReader(1 << 20)
                frame = await _read_channel_frame(old, reader)
                assert (frame.kind, frame.payload) == (frames.REQUEST, b"dial")
                reply = frames.reply_header(frame.exchange_id) + b"ok"
                await old.send_all(frames.frame_prefix(len(reply)) + reply)
            (connection,) = a._connections.values()
            assert not connection.quiet_requests
            assert a.request_soon(old_id, QUIET, b"asked quietly", timeout_s=10, on_reply=outcomes("q"), quiet=True)
            frame = await _read_channel_frame(old, reader)
            assert (frame.kind, frame.payload) == (frames.REQUEST, b"asked quietly")
            reply = frames.reply_header(frame.exchange_id) + b"ok"
            await old.send_all(frames.frame_prefix(len(reply)) + reply)
            await outcomes.wait("q")
            assert outcomes.got == {"q": b"ok"}
            # the old peer's request to a: an acceptance is still its reply
            request = frames.request_header(1, QUIET) + b"take"
            await old.send_all(frames.frame_prefix(len(request)) + request)
            frame = await _read_channel_frame(old, reader)
            assert (frame.kind, frame.exchange_id, frame.payload) == (frames.REPLY, 1, b"ok")
            nursery.cancel_scope.cancel()


@contextlib.asynccontextmanager
async def _bounded_pair(**limits) -> AsyncIterator[Pair]:
    """A pair whose listener (b) has the given ``ChannelConfig`` bounds."""
    net = MemoryNetwork()
    ka, kb = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    async with open_channel_transport(ka, net.add(peer_id_of(ka)), ChannelConfig()) as a:
        async with open_channel_transport(kb, net.add(peer_id_of(kb)), ChannelConfig(**limits)) as b:
            yield Pair(a, b, net)


async def _echo_on(stream: _TlsStream, exchange_id: int) -> bytes:
    """One echo request on a raw TLS connection; its reply's bytes (b"" when it was closed)."""
    body = frames.request_header(exchange_id, ECHO) + b"raw"
    try:
        await stream.send_all(frames.frame_prefix(len(body)) + body)
        with trio.fail_after(5):
            return await stream.receive_some(1 << 16)
    except (trio.BrokenResourceError, ssl.SSLError, OSError):
        return b""


async def test_a_peer_over_its_bound_of_connections_is_refused_until_one_of_its_own_is_idle(
    mock_clock: trio.testing.MockClock,
) -> None:
    """Anyone can make a key: accepted connections of one peer id are bounded. Over the bound a
    new one is refused while the peer's others are in use, and takes the slot of the one idle
    longest once that one has been idle ``idle_evict_s`` (trio's MockClock, moved by hand)."""
    async with _bounded_pair(max_inbound_per_peer=2, idle_evict_s=30.0) as pair:
        b = pair.b
        _server, rogue_context = tls_contexts(Ed25519PrivateKey.generate(), 3600)
        r1 = await _raw_tls(_port(b), rogue_context)
        assert b"echo:raw" in await _echo_on(r1, 1)
        r2 = await _raw_tls(_port(b), rogue_context)
        assert b"echo:raw" in await _echo_on(r2, 1)
        r3 = await _raw_tls(_port(b), rogue_context)  # both in use: refused after its handshake
        assert await _echo_on(r3, 1) == b"" and b.connections_refused == 1
        assert b"echo:raw" in await _echo_on(r1, 3) and b"echo:raw" in await _echo_on(r2, 3)
        mock_clock.jump(31.0)
        assert b"echo:raw" in await _echo_on(r2, 5)  # r1 idle for 31 s, r2 not
        r4 = await _raw_tls(_port(b), rogue_context)
        assert b"echo:raw" in await _echo_on(r4, 1)
        assert await _echo_on(r1, 5) == b"" and b.connections_evicted == 1
        assert b"echo:raw" in await _echo_on(r2, 7)
        assert await pair.a.request(b.peer_id, b.listen_addrs, ECHO, b"a", timeout_s=5) == b"echo:a"
        for stream in (r1, r2, r3, r4):
            await stream.aclose()


async def test_over_the_bound_in_all_a_connection_is_refused_before_its_handshake(
    mock_clock: trio.testing.MockClock,
) -> None:
    """Over the bound of accepted connections in all, a new TCP connection is closed before
    its handshake while every other is in use (its dialler falls back to libp2p), and takes the
    slot of the one idle longest once that one has been idle ``idle_evict_s``."""
    async with _bounded_pair(max_inbound_connections=2, idle_evict_s=30.0) as pair:
        b = pair.b
        contexts = [tls_contexts(Ed25519PrivateKey.generate(), 3600)[1] for _ in range(3)]
        r1 = await _raw_tls(_port(b), contexts[0])
        assert b"echo:raw" in await _echo_on(r1, 1)
        r2 = await _raw_tls(_port(b), contexts[1])
        assert b"echo:raw" in await _echo_on(r2, 1)
        refused = _TlsStream(await trio.open_tcp_stream("127.0.0.1", _port(b)), contexts[2], server_side=False)
        try:
            with pytest.raises((ssl.SSLError, trio.BrokenResourceError, OSError)):
                await refused.do_handshake()
        finally:
            await refused.aclose()
        assert b.connections_refused == 1 and b.handshakes_in_progress == 0
        # a peer whose dial is refused this way reaches b through the fallback (libp2p here)
        assert await pair.a.request(b.peer_id, b.listen_addrs, ECHO, b"a", timeout_s=5) == b"echo:a"
        assert pair.a.fallback_requests == 1 and pair.a.channel_requests == 0
        mock_clock.jump(31.0)
        assert b"echo:raw" in await _echo_on(r2, 3)
        r3 = await _raw_tls(_port(b), contexts[2])
        assert b"echo:raw" in await _echo_on(r3, 1)
        assert await _echo_on(r1, 3) == b"" and b.connections_evicted == 1
        for stream in (r1, r2, r3):
            await stream.aclose()


async def test_requests_beyond_the_bound_in_flight_are_answered_busy_at_once() -> None:
    async with _bounded_pair(max_requests_in_flight=2) as pair:
        a, b = pair.a, pair.b
        arrived = {"slow": 0}
        both_arrived = trio.Event()

        async def slow_echo(remote: str, payload: bytes) -> bytes:
            arrived["slow"] += 1
            if arrived["slow"] == 2:
                both_arrived.set()
            await pair.release.wait()
            return b"echo:" + payload

        b.set_handler(ECHO, slow_echo)
        replies = []

        async def one(payload: bytes) -> None:
            replies.append(await a.request(b.peer_id, b.listen_addrs, ECHO, payload, timeout_s=10))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, b"s1")
            nursery.start_soon(one, b"s2")
            with trio.fail_after(5):
                await both_arrived.wait()
            with pytest.raises(TransportError, match="busy: 2 requests of this connection"):
                await a.request(b.peer_id, b.listen_addrs, ECHO, b"third", timeout_s=5)
            assert arrived["slow"] == 2 and b.requests_refused_busy == 1
            pair.release.set()
        assert sorted(replies) == [b"echo:s1", b"echo:s2"]
        assert await a.request(b.peer_id, b.listen_addrs, ECHO, b"after", timeout_s=5) == b"echo:after"
        assert a.connections_dialled == 1, "the busy answer left the connection as it was"


async def test_accepted_connections_in_their_handshake_are_bounded() -> None:
    async with _bounded_pair(max_handshakes=1) as pair:
        b = pair.b
        async with await trio.open_tcp_stream("127.0.0.1", _port(b)) as stalled:  # never says hello
            await stalled.send_all(b"\x16")  # (a byte of a record: the server is in its handshake)
            with trio.fail_after(5):
                while b.handshakes_in_progress == 0:  # a condition to reach, not a delay to wait out
                    await trio.sleep(0.01)
            async with await trio.open_tcp_stream("127.0.0.1", _port(b)) as second:
                assert await _closed_without_reply(second.receive_some)
            assert b.connections_refused == 1
        assert await pair.a.request(b.peer_id, b.listen_addrs, ECHO, b"ok", timeout_s=5) == b"echo:ok"


async def test_channel_connections_keep_alive(pair: Pair, idle_tcp_timer) -> None:
    """TCP keepalive on both ends of a channel connection (agent.io.net.raw_socket.keep_alive)."""
    a, b = pair.a, pair.b
    assert await a.request(b.peer_id, b.listen_addrs, ECHO, b"x", timeout_s=5) == b"echo:x"
    (connection,) = a._connections.values()
    local_port = connection.stream._sock.getsockname()[1]
    assert await idle_tcp_timer(_port(b), local_port) == 2, "the accepted end"
    assert await idle_tcp_timer(local_port, _port(b)) == 2, "the dialled end"


async def test_a_request_over_its_limit_closes_only_that_connection_before_it_is_read(pair: Pair) -> None:
    """The request limits (``request_gate``) are checked on a channel frame's head: a request
    over its protocol's limit for a peer that is not admitted is refused before room is made for
    it; its connection closes, and the sender's next request is served on a new one."""
    from agent.core.net.request_limits import RequestLimits

    a, b = pair.a, pair.b
    b.request_gate.limits = RequestLimits(default_bytes=4096, unadmitted_bytes={ECHO: 100})
    b.request_gate.is_admitted = lambda peer_id: False
    with pytest.raises(TransportError):
        await a.request(b.peer_id, b.listen_addrs, ECHO, bytes(200), timeout_s=10)
    assert pair.seen == [] and b.frames_refused == 1
    assert b.request_gate.in_flight.refused == 1
    assert await a.request(b.peer_id, b.listen_addrs, ECHO, b"small", timeout_s=10) == b"echo:small"
    b.request_gate.is_admitted = lambda peer_id: True  # admitted: the protocol's own limit
    assert await a.request(b.peer_id, b.listen_addrs, ECHO, bytes(200), timeout_s=10) == b"echo:" + bytes(200)
    assert b.request_gate.in_flight.total_bytes == 0  # every request's bytes given back


async def test_requests_answered_in_tasks_count_in_flight_per_peer(pair: Pair) -> None:
    from agent.core.net.request_limits import RequestLimits

    a, b = pair.a, pair.b
    b.request_gate.limits = RequestLimits(default_bytes=4096, peer_in_flight_bytes=1000)
    async with trio.open_nursery() as nursery:
        replies: list[bytes] = []

        async def slow_one() -> None:
            replies.append(await a.request(b.peer_id, b.listen_addrs, ECHO, b"slow" + bytes(600), timeout_s=10))

        nursery.start_soon(slow_one)
        await pair.arrived.wait()
        assert b.request_gate.in_flight.peer_bytes(a.peer_id) == 604
        # 604 + 604 > 1000: this request is refused (dropped as it arrives), the slow one goes on
        with pytest.raises(TransportError, match="refused: 604 bytes of this peer's requests are in flight"):
            await a.request(b.peer_id, b.listen_addrs, ECHO, b"more" + bytes(600), timeout_s=10)
        assert await a.request(b.peer_id, b.listen_addrs, ECHO, b"tiny", timeout_s=10) == b"echo:tiny"
        pair.release.set()
    assert replies == [b"echo:slow" + bytes(600)]
    assert b.request_gate.in_flight.total_bytes == 0 and a.connections_dialled == 1
