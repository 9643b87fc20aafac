"""agent.core.relay.waiting_line (on a fake clock: ``now`` is an argument) and its trio shell
agent.io.relay.queue (on trio's MockClock): requests that wait for a free sequence are served
first come, first served, whatever their model or route, and one is refused only when it has
waited the timeout with the line not moving."""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing

from agent.core.relay.waiting_line import TicketState, WaitingLine
from agent.io.relay.queue import RelayQueue

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def line(timeout_s: float = 10.0) -> WaitingLine:
    return WaitingLine(timeout_s=timeout_s, retry_min_s=0.05, retry_max_s=1.0)


def test_a_request_tries_at_once_while_nobody_waits() -> None:
    w = line()
    a, b = w.join(0.0), w.join(0.0)
    assert w.may_try(a) and w.may_try(b), "nobody waits: both try"
    w.busy(a, 0.1)
    c = w.join(0.2)
    assert not w.may_try(c), "a came before c and waits: c waits behind it"
    assert w.position(a) == 0 and w.position(c) == 1


def test_freed_sequences_go_first_come_first_served_across_models() -> None:
    """The order is the arrival's, not the order the tries failed in, nor the model."""
    w = line()
    tickets = [w.join(0.0) for _ in range(4)]  # e.g. two of one model, two of another
    for t in reversed(tickets):  # their tries failed in reverse order
        w.busy(t, 0.1)
    late = w.join(0.2)
    served = []
    for k in range(5):
        head = w.freed(0.3 + k)
        assert head is not None
        served.append(head)
        w.started(head, 0.3 + k)
    assert served == [*tickets, late]
    assert w.freed(9.0) is None, "nobody waits"


def test_a_busy_try_keeps_its_place_and_nobody_overtakes_it() -> None:
    w = line()
    a = w.join(0.0)
    w.busy(a, 0.0)
    b = w.join(0.1)
    assert w.freed(0.2) == a
    w.busy(a, 0.25)  # the freed sequence went elsewhere (another owner was faster)
    assert w.state(a) is TicketState.WAITING and w.position(a) == 0
    assert w.freed(0.3) == a, "a is still first"
    assert w.state(b) is TicketState.WAITING


def test_only_the_head_retries_by_itself_with_a_doubling_delay() -> None:
    w = line()
    a, b = w.join(0.0), w.join(0.0)
    w.busy(a, 0.0)
    w.busy(b, 0.0)
    assert not w.retry_due(b, 5.0), "b is not the head: it waits for a freed sequence"
    assert w.wake_at(a) == pytest.approx(0.05)
    assert not w.retry_due(a, 0.04)
    assert w.retry_due(a, 0.05) and w.may_try(a)
    w.busy(a, 0.05)
    assert w.wake_at(a) == pytest.approx(0.15), "0.1 s after its second busy try"
    delays = []
    for _ in range(5):
        now = w.wake_at(a)
        assert w.retry_due(a, now)
        w.busy(a, now)
        delays.append(w.wake_at(a) - now)
    assert delays == pytest.approx([0.2, 0.4, 0.8, 1.0, 1.0]), "doubling, at most retry_max_s"
    assert w.wake_at(b) == w.deadline(b) == pytest.approx(10.0)


def test_a_try_a_freed_sequence_let_go_is_retried_soon_once_then_seldom() -> None:
    """A node frees an ended session's sequence a moment after it answered the end: the try it
    let go may come early; one quick retry, then the relay's own ends wake the line."""
    w = line()
    a = w.join(0.0)
    w.busy(a, 0.0)
    for _ in range(2):  # retries double: 0.05, 0.1, then 0.2
        now = w.wake_at(a)
        assert w.retry_due(a, now)
        w.busy(a, now)
    assert w.freed(0.2) == a
    w.busy(a, 0.25)  # early
    assert w.wake_at(a) == pytest.approx(0.3), "once retry_min_s later"
    assert w.retry_due(a, w.wake_at(a))
    w.busy(a, 0.3)
    assert w.wake_at(a) == pytest.approx(1.3), "then retry_max_s"


def test_the_head_does_not_retry_while_a_try_is_out() -> None:
    """Its retry could take the sequence a freed chance let another ticket try for."""
    w = line()
    a, b, c = w.join(0.0), w.join(0.0), w.join(0.0)
    for t in (a, b, c):
        w.busy(t, 0.0)
    assert w.freed(1.0) == a
    assert not w.retry_due(b, 1.0), "b is the head now, but a's try is out"
    assert w.wake_at(b) == w.deadline(b), "nor does it wake for its retry (a's outcome wakes it)"
    w.started(a, 1.1)
    assert w.retry_due(b, 1.1), "nothing is out: b retries (its retry time passed long ago)"


def test_a_request_is_refused_only_when_the_line_did_not_move_for_the_timeout() -> None:
    w = line(timeout_s=10.0)
    a, b = w.join(0.0), w.join(1.0)
    w.busy(a, 0.0)
    w.busy(b, 1.0)
    assert not w.refused(a, 9.9)
    assert w.freed(9.9) == a
    w.started(a, 9.9)  # the line moved
    assert not w.refused(b, 11.5), "b waited 10.5 s, but the line moved 1.6 s ago"
    assert w.deadline(b) == pytest.approx(19.9)
    assert w.refused(b, 19.9), "then 10 s without a start"
    c = w.join(19.0)
    assert w.deadline(c) == pytest.approx(29.0), "its own arrival is later than the last move"


def test_a_request_that_leaves_gives_its_chance_on() -> None:
    w = line()
    a, b, c = w.join(0.0), w.join(0.0), w.join(0.0)
    w.started(a, 0.1)
    w.busy(b, 0.1)
    w.busy(c, 0.1)
    w.leave(c, 0.2)  # a waiting request went away (its client closed): no sequence was freed
    assert w.state(b) is TicketState.WAITING
    w.leave(a, 0.3)  # a's session ended: its sequence is b's chance
    assert w.may_try(b)
    d = w.join(0.4)
    assert w.may_try(d), "nobody waits (b tries): d tries too"
    w.leave(b, 0.5)  # b's try ended unused (an error): its chance goes on, to nobody waiting
    assert w.waiting == 0


def test_a_started_request_that_finds_no_sequence_again_queues_in_its_arrival_place() -> None:
    """A replanned generation of a request that had started waits where it came in."""
    w = line()
    a = w.join(0.0)
    w.started(a, 0.1)
    b = w.join(0.2)
    assert w.may_try(b)
    w.busy(b, 0.3)
    w.busy(a, 0.4)
    assert w.position(a) == 0 and w.position(b) == 1


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        WaitingLine(timeout_s=0, retry_min_s=0.1, retry_max_s=1)
    with pytest.raises(ValueError, match="retry_min_s"):
        WaitingLine(timeout_s=1, retry_min_s=2, retry_max_s=1)
    assert line().moved_at == -math.inf


async def test_queue_serves_waiting_generations_in_arrival_order_and_refuses_when_stuck(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Three sequences' worth of generations: each ends 1 s after it started; the queue lets the
    waiting ones in, in order, as sequences come free, and refuses none while it moves."""
    queue = RelayQueue(timeout_s=5.0, retry_min_s=0.05, retry_max_s=1.0)
    free = 3
    order: list[int] = []
    refused: list[int] = []

    async def generation(index: int) -> None:
        nonlocal free
        with queue.ticket() as ticket:
            turn = await ticket.wait_turn()
            while turn:
                # the try's round trip: the others wait meanwhile (a waiting task that spun instead
                # would keep the autojump clock from moving: this test would time out)
                await trio.sleep(0.05)
                if free:
                    free -= 1
                    break
                turn = await ticket.busy()
            if not turn:
                refused.append(index)
                return
            ticket.started()
            order.append(index)
            await trio.sleep(1.0)
            free += 1

    async with trio.open_nursery() as nursery:
        for index in range(8):
            nursery.start_soon(generation, index)
            await trio.sleep(0.01)  # they arrive in this order
    assert order == list(range(8)) and not refused
    assert trio.current_time() < 4.0, "each freed sequence went to the next at once"

    free = 0  # no sequence ever comes free: refused after the timeout, not before
    started_at = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(generation, 8)
    assert refused == [8]
    assert trio.current_time() - started_at == pytest.approx(5.0, abs=0.2)
