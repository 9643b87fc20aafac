"""Stopping a trio command on SIGTERM as on Ctrl-C.

Owns one helper, ``run_until_stop_signal``, for commands that start processes of their own
(``baton demo``, ``baton relay serve``): SIGTERM is what ``kill``, systemd, docker stop and a
parent's lifeline (``agent.io.lifeline``) send, and Python's default for it ends the process
at once, skipping every ``finally`` that stops a child process or removes a temp dir.
"""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

__all__ = ["STOP_SIGNALS", "run_until_stop_signal"]

T = TypeVar("T")

#: What stops a command cleanly: kill / systemd / docker stop, and Ctrl-C.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


async def run_until_stop_signal(
    async_fn: Callable[[], Awaitable[T]], signals: tuple[int, ...] = STOP_SIGNALS
) -> tuple[T | None, int | None]:
    """Run ``async_fn()`` until it returns or one of ``signals`` arrives.

    Returns ``(its result, None)``, or ``(None, the signal)`` once a signal cancelled it.

    Raises:
      whatever ``async_fn`` raises, in an exception group (it runs in a nursery).

    Cancellation:
      A signal cancels ``async_fn``; its cleanup (``finally`` blocks, shielded stops of child
      processes) runs before this returns. A second signal during that cleanup is taken by the
      same receiver and changes nothing: the cleanup is not cut short.
    """
    result: T | None = None
    received: int | None = None
    with trio.open_signal_receiver(*signals) as receiver:  # type: ignore[arg-type]  # trio-typing's stale trio stubs
        async with trio.open_nursery() as nursery:

            async def run() -> None:
                nonlocal result
                result = await async_fn()
                nursery.cancel_scope.cancel()

            nursery.start_soon(run)
            async for signum in receiver:
                received = signum
                nursery.cancel_scope.cancel()
                break
    return result, received
