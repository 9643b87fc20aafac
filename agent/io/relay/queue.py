"""The relay's waiting line on trio: ``RelayQueue`` (one a relay) and its tickets.

Owns the waiting: a ticket's task sleeps until the line lets it try, the line's head retries by
itself, or its deadline passes (``agent.core.relay.waiting_line`` decides each); every change
to the line wakes the waiting tasks to look again. A ticket is what
``agent.io.client.swarm.SwarmClient.generate_tokens`` takes as its ``queue``.

Must not import the relay's app, completions or server.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import trio

from agent.core.relay.waiting_line import WaitingLine

__all__ = ["QueueTicket", "RelayQueue"]


class RelayQueue:
    """The line every request of a relay waits in for a free sequence."""

    def __init__(self, *, timeout_s: float, retry_min_s: float, retry_max_s: float) -> None:
        self.line = WaitingLine(timeout_s=timeout_s, retry_min_s=retry_min_s, retry_max_s=retry_max_s)
        self._clock = trio.current_time  # (trio's: the waits are trio's deadlines)
        self._changed = trio.Event()

    def _wake_all(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    @contextlib.contextmanager
    def ticket(self) -> Iterator[QueueTicket]:
        """A ticket for one generation, for as long as it runs (it leaves the line on exit, however
        the generation ended, freeing its place or its sequence for the next in line)."""
        ticket = QueueTicket(self, self.line.join(self._clock()))
        try:
            yield ticket
        finally:
            self.line.leave(ticket.number, self._clock())
            self._wake_all()

    @property
    def waiting(self) -> int:
        return self.line.waiting


class QueueTicket:
    """One generation's place in a ``RelayQueue`` (``SwarmClient.generate_tokens``'s ``queue``)."""

    def __init__(self, queue: RelayQueue, number: int) -> None:
        self._queue = queue
        self.number = number

    async def wait_turn(self) -> bool:
        """Wait until this generation may try to start its session: True; False when it has
        waited ``timeout_s`` without the line moving (refuse it as busy)."""
        queue, line = self._queue, self._queue.line
        while True:
            now = queue._clock()
            if line.may_try(self.number) or line.retry_due(self.number, now):
                return True
            if line.refused(self.number, now):
                return False
            changed = queue._changed
            with trio.move_on_at(line.wake_at(self.number)):
                await changed.wait()

    async def busy(self) -> bool:
        """Its try found no free sequence: back to its place; as ``wait_turn``."""
        self._queue.line.busy(self.number, self._queue._clock())
        self._queue._wake_all()
        return await self.wait_turn()

    def started(self) -> None:
        """Its session holds its sequences (its first token came)."""
        self._queue.line.started(self.number, self._queue._clock())
        self._queue._wake_all()
