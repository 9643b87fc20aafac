"""Serving an ASGI app on Hypercorn's trio worker, bounded for clients that read nothing.

Owns the Hypercorn settings the relay and the model file server share: the bind address, no
access log, a short graceful stop, and a send timeout. (Not Hypercorn's ``read_timeout``: it
times every read of a connection, so a client waiting quietly for a long answer would be cut;
a request's headers are bounded by Hypercorn's keep-alive timer, which runs until they arrive.)
Hypercorn shields its socket writes from cancellation, so a timeout inside the app cannot end
a write to a client that takes no bytes (a stream nobody reads would hold its slot and file
descriptor for as long as the client keeps the socket open). The kernel can: TCP_USER_TIMEOUT
on the listening socket, which accepted sockets inherit, aborts a connection whose peer takes
no bytes (a zero window included) for that long. Linux has it; elsewhere the apps' own bounds
(responses in flight, concurrency per key) still hold.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import trio

__all__ = ["DEFAULT_SEND_TIMEOUT_S", "serve_asgi"]

#: a client that takes no bytes for this long loses its connection
DEFAULT_SEND_TIMEOUT_S = 30.0


async def serve_asgi(
    app: Any,
    host: str,
    port: int,
    *,
    send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
    graceful_timeout_s: float = 1.0,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,  # type: ignore[name-defined]  # trio-typing's stale trio stubs
) -> None:
    """Serve ``app`` at ``host:port`` until cancelled; started with the base URL
    (``http://host:port``, the real port when ``port`` is 0)."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    class BoundedConfig(Config):
        def create_sockets(self):  # type: ignore[no-untyped-def]
            sockets = super().create_sockets()
            if hasattr(socket, "TCP_USER_TIMEOUT"):
                for sock in sockets.insecure_sockets:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(send_timeout_s * 1000))
            return sockets

    config = BoundedConfig()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = graceful_timeout_s
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(lambda task_status: serve(app, config, task_status=task_status))
        task_status.started(binds[0])
