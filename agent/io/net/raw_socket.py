"""Sends and receives on a raw non-blocking socket, awaited through trio's low-level waits.

Why not ``trio.SocketStream``: it yields to the scheduler after every send and receive that did
not have to wait, so each costs a whole scheduler pass (an ``epoll_wait`` and the run loop),
and it checks for conflicting callers. The messages of a decode step cross a node's sockets
several times (the previous hop's push, the worker's Forward, the next hop's push), so here a
send or receive that the kernel can take at once is one system call, and it waits
(``wait_writable`` / ``wait_readable``) only when it must.

A caller that may not wait at all (the kernel took or gave everything at once) must still
checkpoint where trio expects one; ``receive_into`` says whether it waited.
"""

from __future__ import annotations

import socket

import trio

__all__ = ["acquire", "adopt", "keep_alive", "receive_into", "send_all"]


#: TCP keepalive (the worker's data plane uses the same, native/src/data_plane.cpp): a peer
#: whose machine vanished without closing (power, network, a laptop's sleep) is found within
#: about idle + interval x count seconds, so an idle connection to it ends instead of staying.
KEEP_IDLE_S, KEEP_INTERVAL_S, KEEP_COUNT = 30, 10, 3


def keep_alive(sock: socket.socket) -> None:
    """Switch on TCP keepalive on ``sock`` with the intervals above (a socket that is not TCP,
    e.g. a socketpair in a test, is left as it is)."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if not hasattr(socket, "TCP_KEEPIDLE"):  # (macOS before Python 3.10: the system's intervals)
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEP_IDLE_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEP_INTERVAL_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEP_COUNT)


async def acquire(lock: trio.Lock | trio.Semaphore) -> None:
    """Take ``lock`` (for the socket send that follows); when it is free, without the
    scheduler pass that ``acquire`` makes even then: the send is the checkpoint, or the wait
    that follows it. A channel frame's send and a worker's Forward are on every hop's path."""
    try:
        lock.acquire_nowait()
    except trio.WouldBlock:
        await lock.acquire()


def adopt(stream: trio.SocketStream) -> socket.socket:
    """The socket of ``stream``, taken out of it (the stream is unusable after) and set
    non-blocking; its options (TCP_NODELAY) stay as they were."""
    sock = socket.socket(fileno=stream.socket.detach())
    sock.setblocking(False)
    return sock


async def send_all(sock: socket.socket, data: bytes | bytearray | memoryview) -> None:
    """All of ``data`` to ``sock``, waiting only while the kernel's buffer is full.

    Raises OSError as the socket does. Cut short (cancelled or failed), part of ``data`` may be
    on the wire: the caller must then stop trusting the byte stream."""
    view = memoryview(data)
    while view:
        try:
            sent = sock.send(view)
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)  # type: ignore[arg-type]  # trio-typing's stale trio stubs
            continue
        view = view[sent:]


async def receive_into(sock: socket.socket, buffer: memoryview) -> tuple[int, bool]:
    """``(bytes received into buffer, whether it waited)``; 0 bytes: the peer closed.

    Raises OSError as the socket does."""
    waited = False
    while True:
        try:
            return sock.recv_into(buffer), waited
        except BlockingIOError:
            waited = True
            await trio.lowlevel.wait_readable(sock)  # type: ignore[arg-type]  # trio-typing's stale trio stubs
