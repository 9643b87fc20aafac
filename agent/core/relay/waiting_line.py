"""The relay's waiting line: requests that wait for a free sequence, served first come, first served.

Owns who may try to start a session when the swarm is busy, and when a waiting request is
refused. Every request of the relay, whatever its model or route, takes a ticket in one line:
- a ticket *tries* (its session's first step goes out) at once when nobody waits; otherwise it
  waits behind the tickets that came before it;
- a sequence that comes free (a session of the relay ended, or a try that will not use its
  chance left) lets the first waiting ticket try; so does the head's own retry timer
  (``retry_min_s``, doubling to ``retry_max_s``) while no try is out, for sequences freed by the
  swarm's other owners;
- a try that finds no free sequence (``busy``) goes back to its place: it keeps its arrival, so
  nobody who came after it overtakes it;
- a waiting ticket is refused only when the line has not moved (no ticket started a session)
  for ``timeout_s`` since it arrived or since the line last moved, whichever is later: while
  others start sessions, a request keeps its place however long the line.

Pure: ``now`` (seconds, any monotonic clock) comes in as an argument. Must not import trio,
clocks or agent.io (``agent.io.relay.queue`` is its shell).
"""

from __future__ import annotations

import dataclasses
import enum
import math

__all__ = ["TicketState", "WaitingLine"]


class TicketState(enum.Enum):
    WAITING = "waiting"  # in line, behind the tickets that came before it
    TRYING = "trying"  # its session's first step may go out / is out
    STARTED = "started"  # its session holds sequences: it left the line, and frees one when it leaves


@dataclasses.dataclass
class _Ticket:
    arrived: float
    state: TicketState
    retry_at: float  # the head retries by itself then (waiting)
    retry_s: float  # its next retry delay after a busy try
    chance: bool = False  # its try was let go by a freed sequence


class WaitingLine:
    """The line (see the module docstring). Tickets are ints, in arrival order."""

    def __init__(self, *, timeout_s: float, retry_min_s: float, retry_max_s: float) -> None:
        if timeout_s <= 0 or retry_min_s <= 0 or retry_max_s < retry_min_s:
            raise ValueError(
                f"need timeout_s > 0 and 0 < retry_min_s <= retry_max_s, got {timeout_s}, {retry_min_s}, {retry_max_s}"
            )
        self.timeout_s = timeout_s
        self.retry_min_s = retry_min_s
        self.retry_max_s = retry_max_s
        self._tickets: dict[int, _Ticket] = {}  # insertion order: arrival order
        self._next = 0
        self.moved_at = -math.inf  # when a ticket last started a session

    # --- what a ticket sees ----------------------------------------------------------------------

    def state(self, ticket: int) -> TicketState:
        return self._tickets[ticket].state

    def may_try(self, ticket: int) -> bool:
        return self._tickets[ticket].state is TicketState.TRYING

    @property
    def waiting(self) -> int:
        """How many tickets wait in line."""
        return sum(t.state is TicketState.WAITING for t in self._tickets.values())

    def position(self, ticket: int) -> int:
        """How many waiting tickets are ahead of ``ticket`` (0: it is the head)."""
        ahead = 0
        for other, t in self._tickets.items():
            if other == ticket:
                return ahead
            ahead += t.state is TicketState.WAITING
        raise KeyError(ticket)

    def deadline(self, ticket: int) -> float:
        """When a waiting ``ticket`` is refused unless the line moves before."""
        return max(self._tickets[ticket].arrived, self.moved_at) + self.timeout_s

    def refused(self, ticket: int, now: float) -> bool:
        """Whether waiting ``ticket`` has waited ``timeout_s`` without the line moving."""
        return self._tickets[ticket].state is TicketState.WAITING and now >= self.deadline(ticket)

    def wake_at(self, ticket: int) -> float:
        """When a waiting ``ticket`` must look again by itself: its deadline, or the head's retry
        while no try is out (a try's outcome changes the line, which wakes every ticket)."""
        t = self._tickets[ticket]
        if t.state is not TicketState.WAITING:
            return -math.inf
        if self._head() == ticket and not self._trying():
            return min(self.deadline(ticket), t.retry_at)
        return self.deadline(ticket)

    # --- what happens --------------------------------------------------------------------------

    def join(self, now: float) -> int:
        """A new request: its ticket, trying at once when nobody waits."""
        ticket = self._next
        self._next += 1
        state = TicketState.WAITING if self.waiting else TicketState.TRYING
        self._tickets[ticket] = _Ticket(now, state, now + self.retry_min_s, self.retry_min_s)
        return ticket

    def busy(self, ticket: int, now: float) -> None:
        """Its try found no free sequence: back to its place in line, to retry later.

        A try a freed sequence let go is retried once ``retry_min_s`` later and then only every
        ``retry_max_s`` (the relay's own sessions' ends wake it before): a node frees an ended
        session's sequence between two of its worker's calls, a moment after it answered the
        end, so such a try often comes a moment early. Any other busy try doubles the delay."""
        t = self._tickets[ticket]
        if t.state is TicketState.STARTED:  # a later session of it (a replan): it queues again, in its place
            t.retry_s = self.retry_min_s
        t.state = TicketState.WAITING
        t.retry_at = now + (self.retry_min_s if t.chance else t.retry_s)
        t.retry_s = self.retry_max_s if t.chance else min(2 * t.retry_s, self.retry_max_s)
        t.chance = False

    def started(self, ticket: int, now: float) -> None:
        """Its session holds its sequences: it leaves the line, which has moved."""
        self._tickets[ticket].state = TicketState.STARTED
        self.moved_at = now

    def retry_due(self, ticket: int, now: float) -> bool:
        """The head's own retry: True (it may try now) when ``ticket`` is the first waiting one,
        its retry time has come and no try is out (a try's outcome moves the line anyway; a
        retry beside a try let go by a freed sequence could take that sequence from it, and a
        later ticket would overtake an earlier one)."""
        t = self._tickets[ticket]
        if t.state is not TicketState.WAITING or self._head() != ticket or now < t.retry_at:
            return False
        if self._trying():
            return False
        t.state = TicketState.TRYING
        return True

    def leave(self, ticket: int, now: float) -> None:
        """The request ended (done, failed, refused or cancelled). A session that held sequences
        freed one, and a try that was let go unused gives its chance on: the first waiting
        ticket tries."""
        t = self._tickets.pop(ticket)
        if t.state is not TicketState.WAITING:
            self.freed(now)

    def freed(self, now: float) -> int | None:
        """A sequence came free: the first waiting ticket tries (returned; None: nobody waits)."""
        head = self._head()
        if head is None:
            return None
        t = self._tickets[head]
        t.state = TicketState.TRYING
        t.chance = True
        return head

    def _trying(self) -> bool:
        return any(t.state is TicketState.TRYING for t in self._tickets.values())

    def _head(self) -> int | None:
        return next((k for k, t in self._tickets.items() if t.state is TicketState.WAITING), None)
