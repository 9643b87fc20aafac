"""The peer transport interface, and an in-memory implementation for unit tests.

Owns: the one primitive every swarm protocol uses, a request/response exchange of two frames
(bytes) with a peer on a protocol id, and the error it raises. The real implementation is
libp2p (``agent.io.net.p2p``: Noise, yamux, one connection per peer, streams reused); keeping
this interface small is what lets a faster direct path be measured against it later.

A handler gets ``(remote_peer_id, request_bytes)`` and returns the reply bytes. The remote
peer id is the one the transport authenticated (Noise), never one the peer claimed in the
payload. Handlers must answer errors with an error *reply*; an exception escaping a handler
is logged and the stream reset (the requester sees ``TransportError``), and the host keeps
serving.
"""

from __future__ import annotations

import collections
import contextvars
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import trio

__all__ = [
    "Handler",
    "ImmediateHandler",
    "MemoryNetwork",
    "MemoryTransport",
    "Transport",
    "TransportError",
    "remote_host",
    "set_remote_host",
]

log = logging.getLogger(__name__)

Handler = Callable[[str, bytes], Awaitable[bytes]]

#: The network address (IP, no port) a request being answered came from, as the transport saw
#: it; "" where unknown (the in-memory transport). A transport sets it in the task that reads
#: a connection or stream, so that handlers (and the tasks they start) see their request's:
#: per-address limits need it, and the ``Handler`` signature stays (peer id, bytes).
_REMOTE_HOST: contextvars.ContextVar[str] = contextvars.ContextVar("baton_remote_host", default="")


def remote_host() -> str:
    """Where the request this task answers came from (its IP address), or "" if unknown."""
    return _REMOTE_HOST.get()


def set_remote_host(host: str) -> None:
    """Say where the requests this task (and the tasks it starts) answers come from."""
    _REMOTE_HOST.set(host)


class ImmediateHandler:
    """A handler that answers at once: ``answer(remote_peer_id, request) -> reply`` awaits
    nothing and raises nothing (it answers errors with an error reply).

    A transport may call ``answer`` inline where it reads the request (the direct channel
    does, in its frame reader: no task is started per request, and requests that arrive
    together are all answered before any other task runs); any other transport awaits it as
    a ``Handler``. The steps and results of a decode step are answered this way: on every
    hop's path, a task started per message cost ~0.15 ms of a message's ~0.5 ms
    (bench/tools/hop_trace.py).

    ``reply_later``: the reply is not what the sender waits on next, the work that ``answer``
    woke is (a step's ack, while the step's Forward is what the route waits for): the
    channel's frame reader then sends the reply after two scheduler passes, once the tasks
    woken meanwhile have run, not before them (a send costs a system call and the kernel's
    loopback delivery, ~0.04 ms here, on every hop of every step), and the replies to the
    frames of one read go out in one write.

    ``is_acceptance(reply)``: whether ``reply`` says no more than "taken" (a step's ack with
    no error). A requester that asked to hear only the rest (the channel's ``request_soon``
    with ``quiet``) is then not sent the reply: the acceptance is confirmed in bulk, a little
    later (``agent.core.net.frames``, TAKEN). None: every reply is sent. Like ``answer``, it
    raises nothing.
    """

    __slots__ = ("answer", "is_acceptance", "reply_later")

    def __init__(
        self,
        answer: Callable[[str, bytes], bytes],
        *,
        reply_later: bool = False,
        is_acceptance: Callable[[bytes], bool] | None = None,
    ) -> None:
        self.answer = answer
        self.reply_later = reply_later
        self.is_acceptance = is_acceptance

    async def __call__(self, remote_peer_id: str, payload: bytes) -> bytes:
        # no checkpoint: answered as the channel answers it, before any other task runs
        return self.answer(remote_peer_id, payload)


class TransportError(Exception):
    """A peer could not be reached, the stream broke, or the reply did not arrive in time."""

    def __init__(self, peer_id: str, message: str) -> None:
        super().__init__(f"peer {peer_id}: {message}")
        self.peer_id = peer_id


class Transport(Protocol):
    @property
    def peer_id(self) -> str: ...

    @property
    def listen_addrs(self) -> list[str]:
        """Multiaddrs others dial this peer at, each ending in ``/p2p/<peer_id>``."""
        ...

    def set_handler(self, protocol_id: str, handler: Handler) -> None: ...

    async def request(
        self, peer_id: str, addrs: Sequence[str], protocol_id: str, payload: bytes, *, timeout_s: float
    ) -> bytes:
        """Send ``payload`` to ``peer_id`` (dialling ``addrs`` if not connected) on
        ``protocol_id`` and return its reply. Raises ``TransportError``."""
        ...


class MemoryNetwork:
    """Peers that reach each other by calling handlers directly (unit tests of shells)."""

    def __init__(self) -> None:
        self.peers: dict[str, MemoryTransport] = {}
        self.down: set[str] = set()  # peers that are unreachable (a vanished node)
        self.requests: collections.Counter[str] = collections.Counter()  # sent, by protocol id

    def add(self, peer_id: str) -> MemoryTransport:
        transport = MemoryTransport(self, peer_id)
        self.peers[peer_id] = transport
        return transport


class MemoryTransport:
    """``Transport`` over a ``MemoryNetwork``; frames are bytes, as on the wire."""

    def __init__(self, network: MemoryNetwork, peer_id: str) -> None:
        self._network = network
        self._peer_id = peer_id
        self._handlers: dict[str, Handler] = {}

    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def listen_addrs(self) -> list[str]:
        return [f"/memory/{self._peer_id}/p2p/{self._peer_id}"]

    def set_handler(self, protocol_id: str, handler: Handler) -> None:
        self._handlers[protocol_id] = handler

    async def request(
        self, peer_id: str, addrs: Sequence[str], protocol_id: str, payload: bytes, *, timeout_s: float
    ) -> bytes:
        self._network.requests[protocol_id] += 1
        remote = self._network.peers.get(peer_id)
        if remote is None or peer_id in self._network.down or self._peer_id in self._network.down:
            raise TransportError(peer_id, "unreachable")
        handler = remote._handlers.get(protocol_id)
        if handler is None:
            raise TransportError(peer_id, f"protocol {protocol_id} not supported")
        with trio.move_on_after(timeout_s) as scope:
            try:
                return await handler(self._peer_id, bytes(payload))
            except Exception as error:  # the real host resets the stream; so does this one
                log.exception("handler for %s failed", protocol_id)
                raise TransportError(peer_id, f"stream reset ({type(error).__name__})") from error
        assert scope.cancelled_caught
        raise TransportError(peer_id, f"no reply within {timeout_s} s")
