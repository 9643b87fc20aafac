"""Hole punching's I/O: the relayed CONNECT / SYNC exchange, the bound ports, and the TCP
simultaneous open that gives two peers behind NAT a direct channel connection.

Owns: ``Puncher`` (started by ``agent.io.net.channel``: it punches toward a peer that a request
had to reach through the relay, in the background, and answers peers' punches on
``/baton/punch/1.0.0`` of the fallback transport), ``simultaneous_open`` and the socket
helpers. What to punch, when, which side is the TLS client and the backoff are
``agent.core.wire.punch``; the TLS handshake and serving the connection are the channel's
(``adopt``): a punched connection proves the peer id exactly as a dialled one does.

Nothing waits on a punch: the request that set it off went through the relay already, and
later ones keep going there until the punched connection is the channel's connection to
that peer.

The address each side names is its own address toward the other (the relay's host, for the
initiator): right where no address is translated (the lab's stateful filter; a firewall).
Behind a NAT that translates, a peer would need its address as the relay observes it
(libp2p's identify gives it; the tracker does not pass it on yet) and a NAT that keeps the
port, and no punch gets through a NAT whose mapping depends on the destination.
"""

from __future__ import annotations

import errno
import functools
import ipaddress
import logging
import math
import os
import secrets
import socket
from collections.abc import Awaitable, Callable, Sequence

import trio

from agent._proto import swarm_pb2
from agent.core.wire.punch import (
    PUNCH_PROTOCOL,
    PunchBook,
    PunchConfig,
    PunchError,
    address_refusal,
    connect_reply,
    connect_request,
    error_reply,
    is_tls_client,
    punch_relay_host,
    read_punch_reply,
    read_punch_request,
    sync_delay_s,
    sync_reply,
    sync_request,
)
from agent.core.wire.swarm_wire import WireError
from agent.io.net.transport import Transport, TransportError

__all__ = ["Puncher", "bound_socket", "local_host_toward", "simultaneous_open"]

log = logging.getLogger(__name__)

Code = swarm_pb2.Error.Code

#: ``adopt(peer_id, tcp, tls_client)``: make a punched TCP connection a channel connection
#: (TLS handshake, peer id checked, served); whether it became one.
Adopt = Callable[[str, trio.SocketStream, bool], Awaitable[bool]]


def local_host_toward(host: str) -> str:
    """This machine's address on the route to ``host`` (a UDP socket's connect picks the
    route and source address and sends nothing). Raises OSError (no route)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return str(probe.getsockname()[0])


def bound_socket(host: str, port: int = 0) -> socket.socket:
    """A non-blocking TCP socket bound to ``host:port`` (0: a fresh port) that another socket
    may bind again once it is closed: each SYN of a punch leaves from the same port, from a
    fresh socket. Raises OSError."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "SO_REUSEPORT"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _close(sock: socket.socket) -> None:
    trio.lowlevel.notify_closing(sock)  # type: ignore[arg-type]  # trio-typing's stale trio stubs
    sock.close()


async def simultaneous_open(
    sock: socket.socket, target: tuple[str, int], *, window_s: float, interval_s: float
) -> trio.SocketStream:
    """A TCP connection between ``sock``'s port (bound, non-blocking; this function owns
    ``sock``) and ``target``, whose peer does the same toward this port at about the same time.

    Two ways it forms, whichever comes first: this side's connect, when the SYNs cross (TCP's
    simultaneous open) or this side's SYN meets the peer's listener; or the peer's SYN at this
    side's listener on the same port (SO_REUSEPORT), once this side's own SYN opened its
    filter. The listener matters where a SYN that comes too early is answered with a reset
    (no filter, or a firewall that rejects): each side's connect attempts may then never
    overlap, while one side's SYN always finds the other's listener. Only a connection from
    ``target`` is taken from the listener; any other is closed at once.

    A SYN the peer's filter dropped is not what the kernel retries soon (1 s, then 3 s): an
    attempt not connected within ``interval_s`` is dropped and a fresh socket sends a fresh
    SYN from the same port, until ``window_s`` has passed.

    Raises:
      PunchError: no connection within ``window_s`` (the last error in the message).
      OSError: the port could not be bound again.
    """
    host, port = sock.getsockname()[:2]
    deadline = trio.current_time() + window_s
    try:
        listener = bound_socket(host, port)
    except BaseException:
        sock.close()
        raise
    opened: list[socket.socket] = []
    outcome = {"error": "no answer", "attempts": 0}
    try:
        listener.listen(4)
        with trio.move_on_at(deadline):
            async with trio.open_nursery() as racing:

                async def take(connect: Callable[[], Awaitable[socket.socket]]) -> None:
                    opened.append(await connect())
                    racing.cancel_scope.cancel()

                racing.start_soon(take, functools.partial(_accept_from, listener, target))
                racing.start_soon(take, functools.partial(_connect_repeatedly, sock, target, interval_s, outcome))
        sock = None  # type: ignore[assignment]  # _connect_repeatedly owned it
    finally:
        _close(listener)
        if sock is not None:
            sock.close()
    if not opened:
        raise PunchError(
            f"no connection to {target[0]}:{target[1]} after {outcome['attempts']} SYNs in {window_s} s"
            f" ({outcome['error']})"
        )
    for extra in opened[1:]:  # both ways at once: keep one
        extra.close()
    return trio.SocketStream(trio.socket.from_stdlib_socket(opened[0]))


async def _accept_from(listener: socket.socket, target: tuple[str, int]) -> socket.socket:
    """The first connection ``listener`` accepts from ``target``."""
    want = (ipaddress.ip_address(target[0]), target[1])
    while True:
        await trio.lowlevel.wait_readable(listener)  # type: ignore[arg-type]  # trio-typing's stale trio stubs
        try:
            conn, addr = listener.accept()
        except (BlockingIOError, InterruptedError):
            continue
        if (ipaddress.ip_address(addr[0]), addr[1]) == want:
            return conn
        log.info("punch: closed a connection from %s:%d, not the peer punching here", addr[0], addr[1])
        conn.close()


async def _connect_repeatedly(
    sock: socket.socket, target: tuple[str, int], interval_s: float, outcome: dict
) -> socket.socket:
    """Connect from ``sock``'s port to ``target``, a fresh socket and SYN every ``interval_s``,
    until cancelled; records the attempts and the last error in ``outcome``."""
    host, port = sock.getsockname()[:2]
    current: socket.socket | None = sock
    try:
        while True:
            attempt_end = trio.current_time() + interval_s
            if current is None:
                current = bound_socket(host, port)
            outcome["attempts"] += 1
            code = current.connect_ex(target)
            if code in (0, errno.EINPROGRESS, errno.EALREADY):
                with trio.move_on_at(attempt_end) as waiting:
                    await trio.lowlevel.wait_writable(current)  # type: ignore[arg-type]  # trio-typing's stale trio stubs
                    code = current.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if code == 0:
                        connected, current = current, None
                        return connected
                if waiting.cancelled_caught:
                    code = 0
                    outcome["error"] = f"no answer within {interval_s} s"
            if code:
                outcome["error"] = f"{errno.errorcode.get(code, code)}: {os.strerror(code)}"
            _close(current)
            current = None
            # refused at once (the peer's socket is not there yet): the next SYN in the next
            # slot, not in a tight loop
            await trio.sleep_until(attempt_end)
    finally:
        if current is not None:
            _close(current)


class Puncher:
    """One peer's hole punches, as initiator and as responder (see the module docstring).

    Made by ``agent.io.net.channel.open_channel_transport``, which runs ``serve`` and gives
    ``adopt``; ``connected(peer_id)`` says whether a channel connection to the peer is open
    already. Its handler answers ``PUNCH_PROTOCOL`` on ``fallback``.
    """

    def __init__(
        self,
        own_peer_id: str,
        fallback: Transport,
        config: PunchConfig,
        adopt: Adopt,
        connected: Callable[[str], bool],
    ) -> None:
        self.own_peer_id = own_peer_id
        self.config = config
        self.book = PunchBook(own_peer_id, config)
        self._fallback = fallback
        self._adopt = adopt
        self._connected = connected
        # jobs for the task that runs punches (``serve``): no nursery is kept here
        self._jobs_in, self._jobs = trio.open_memory_channel[tuple[Callable[..., Awaitable[None]], tuple]](math.inf)
        #: CONNECTs answered, waiting for their SYNC: (peer id, punch id) -> its event
        self._syncs: dict[tuple[str, int], trio.Event] = {}
        fallback.set_handler(PUNCH_PROTOCOL, self.answer)

    def punch_soon(self, peer_id: str, addrs: Sequence[str]) -> bool:
        """Start a punch toward ``peer_id`` (advertising ``addrs``) in the background when
        ``agent.core.wire.punch`` says so; whether one started. Never waits."""
        relay_host = punch_relay_host(addrs)
        if relay_host is None or self._connected(peer_id):
            return False
        if not self.book.start(peer_id, trio.current_time()):
            return False
        self._jobs_in.send_nowait((self._initiate, (peer_id, list(addrs), relay_host)))
        return True

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:  # type: ignore[name-defined]  # trio-typing's stale trio stubs
        """Run the punches (``punch_soon``'s and answered ones) until cancelled.

        Cancellation: every punch under way ends; its sockets close."""
        async with trio.open_nursery() as nursery:
            task_status.started()
            async for job, args in self._jobs:
                nursery.start_soon(job, *args)

    # -- initiator ---------------------------------------------------------------------------

    async def _initiate(self, peer_id: str, addrs: list[str], relay_host: str) -> None:
        connected = False
        try:
            connected = await self._punch_toward(peer_id, addrs, relay_host)
        except (TransportError, PunchError, OSError) as error:
            log.info("punch toward %s failed: %s: %s; it stays relayed", peer_id, type(error).__name__, error)
        except Exception:  # a bug here must not end the channel
            log.exception("punch toward %s failed", peer_id)
        finally:
            self.book.initiated(peer_id, trio.current_time(), connected=connected)
            if not connected:
                log.info("next punch toward %s not before %.1f s from now", peer_id,
                         self.book.next_try_at(peer_id) - trio.current_time())  # fmt: skip

    async def _punch_toward(self, peer_id: str, addrs: list[str], relay_host: str) -> bool:
        config = self.config
        own_host = local_host_toward(relay_host)
        sock: socket.socket | None = bound_socket(own_host)
        try:
            assert sock is not None
            punch_id = secrets.randbits(63) + 1
            sent_at = trio.current_time()
            reply = await self._fallback.request(
                peer_id, addrs, PUNCH_PROTOCOL, connect_request(punch_id, own_host, sock.getsockname()[1]),
                timeout_s=config.request_timeout_s,
            )  # fmt: skip
            rtt_s = trio.current_time() - sent_at
            target = read_punch_reply(reply, allow_loopback=config.allow_loopback)
            if target is None:
                raise PunchError("the peer answered CONNECT without its address")
            self._jobs_in.send_nowait((self._send_sync, (peer_id, addrs, punch_id)))
            await trio.sleep(sync_delay_s(rtt_s, config.sync_delay_max_s))
            opening, sock = sock, None
            tcp = await simultaneous_open(
                opening, target, window_s=config.syn_window_s, interval_s=config.syn_interval_s
            )
        finally:
            if sock is not None:
                sock.close()
        log.info(
            "punched a direct connection to %s (%s:%d; relayed round trip %.1f ms)", peer_id, *target, rtt_s * 1000
        )
        return await self._adopt(peer_id, tcp, is_tls_client(self.own_peer_id, peer_id))

    async def _send_sync(self, peer_id: str, addrs: list[str], punch_id: int) -> None:
        """SYNC, from its own task: the initiator's first SYN is timed from its sending, not
        from its reply."""
        try:
            read_punch_reply(
                await self._fallback.request(
                    peer_id, addrs, PUNCH_PROTOCOL, sync_request(punch_id), timeout_s=self.config.request_timeout_s
                ),
                allow_loopback=self.config.allow_loopback,
            )
        except (TransportError, PunchError) as error:  # the SYNs find out
            log.info("punch SYNC to %s: %s", peer_id, error)

    # -- responder ---------------------------------------------------------------------------

    async def answer(self, remote_peer_id: str, payload: bytes) -> bytes:
        """The ``PUNCH_PROTOCOL`` handler (the fallback transport authenticated
        ``remote_peer_id``). Never raises: a bad request gets an error reply."""
        try:
            request = read_punch_request(payload)
        except WireError as err:
            return error_reply(err.code, err.message)
        if request.WhichOneof("body") == "sync":
            waiting = self._syncs.get((remote_peer_id, request.punch_id))
            if waiting is None:
                return error_reply(Code.NOT_FOUND, "no punch of that id waits for its SYNC here")
            waiting.set()
            return sync_reply()
        target = (request.connect.host, request.connect.port)
        refusal = address_refusal(*target, allow_loopback=self.config.allow_loopback)
        if refusal is not None:
            return error_reply(Code.INVALID_ARGUMENT, refusal)
        now = trio.current_time()
        refusal = self.book.answer(remote_peer_id, now)
        if refusal is not None:
            return error_reply(Code.REFUSED, refusal)
        try:
            own_host = local_host_toward(target[0])
            sock = bound_socket(own_host)
        except OSError as err:
            self.book.answered(remote_peer_id, now, connected=False)
            return error_reply(Code.UNAVAILABLE, f"cannot punch from here: {err}")
        key = (remote_peer_id, request.punch_id)
        self._syncs[key] = trio.Event()
        self._jobs_in.send_nowait((self._respond, (remote_peer_id, key, sock, target)))
        return connect_reply(own_host, sock.getsockname()[1])

    async def _respond(self, peer_id: str, key: tuple[str, int], sock: socket.socket, target: tuple[str, int]) -> None:
        connected = False
        owned: socket.socket | None = sock
        try:
            with trio.move_on_after(self.config.sync_wait_s):
                await self._syncs[key].wait()
            if not self._syncs[key].is_set():
                log.info("punch from %s: no SYNC within %s s", peer_id, self.config.sync_wait_s)
                return
            owned = None
            tcp = await simultaneous_open(
                sock, target, window_s=self.config.syn_window_s, interval_s=self.config.syn_interval_s
            )
            log.info("punched a direct connection to %s (%s:%d), answering its punch", peer_id, *target)
            connected = await self._adopt(peer_id, tcp, is_tls_client(self.own_peer_id, peer_id))
        except (PunchError, OSError) as error:
            log.info("punch from %s failed: %s: %s", peer_id, type(error).__name__, error)
        except Exception:  # a bug here must not end the channel
            log.exception("punch from %s failed", peer_id)
        finally:
            self._syncs.pop(key, None)
            if owned is not None:
                owned.close()
            self.book.answered(peer_id, trio.current_time(), connected=connected)
