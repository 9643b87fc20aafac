"""The tracker's decisions about nodes as pure functions of events and ``now``: liveness
(agent.core.tracker.liveness) and what one heartbeat makes (agent.core.tracker.heartbeat)."""

from __future__ import annotations

import math

import pytest

from agent._proto import swarm_pb2
from agent.core.tracker.assignment import Assignment
from agent.core.tracker.heartbeat import admission_due, diff_assignment, read_report
from agent.core.tracker.liveness import Heard, Liveness
from agent.core.wire.swarm_wire import WireError

pytestmark = pytest.mark.unit

State = swarm_pb2.AssignmentStatus.State
M = "c" * 64


def status(begin: int, end: int, state: int, recipe: str = "", model: str = M) -> swarm_pb2.AssignmentStatus:
    return swarm_pb2.AssignmentStatus(
        assignment=swarm_pb2.Assignment(model_sha256=model, begin=begin, end=end), state=state, recipe_hash=recipe
    )


def test_nodes_are_alive_until_their_deadline_and_pending_after_a_restart_until_heard() -> None:
    live = Liveness(timeout_ms=1000).restored(["old"], now_ms=0)
    assert live.pending == {"old"} and live.alive == set() and live.live == {"old"}
    live, heard = live.heard("new", 100)
    assert heard == Heard(revived=True, newly_confirmed=True)
    live, heard = live.heard("new", 600)
    assert heard == Heard(revived=False, newly_confirmed=False)
    before = live
    live, heard = live.heard("old", 200)
    assert heard == Heard(revived=False, newly_confirmed=True)  # kept its ranges
    assert before.pending == {"old"}  # a value: the one before the heartbeat did not change
    assert live.alive == {"old", "new"} and live.next_sweep_in_ms(700) == 500
    assert live.swept(1199) == (live, ())
    live, dead = live.swept(1200)
    assert dead == ("old",)  # exactly at its deadline
    assert live.alive == {"new"} and "old" not in live
    live, heard = live.heard("old", 1300)
    assert heard.revived  # back after it was dead
    live, dead = live.swept(5000)
    assert dead == ("new", "old") and live.next_sweep_in_ms(5000) == math.inf
    assert live.without(["nobody"]) is live


def test_a_heartbeat_report_is_checked_and_new_failures_found_once() -> None:
    report = read_report("p", [status(0, 4, State.READY, "r"), status(4, 8, State.FAILED, model="d" * 64)], [])
    assert set(report.reported) == {Assignment(M, 0, 4, "p"), Assignment("d" * 64, 4, 8, "p")}
    assert report.newly_failed == {"d" * 64}
    assert read_report("p", [status(4, 8, State.FAILED, model="d" * 64)], ["d" * 64]).newly_failed == frozenset()
    with pytest.raises(WireError, match=r"serving\[1\]: assignment .* \[4, 4\) is not a model range"):
        read_report("p", [status(0, 4, State.READY), status(4, 4, State.READY)], [])
    with pytest.raises(WireError, match=r"serving\[0\]: state 0 is not LOADING"):
        read_report("p", [status(0, 4, State.STATE_UNSPECIFIED)], [])


def test_the_directives_are_the_diff_of_assigned_and_reported() -> None:
    reported = read_report("p", [status(0, 4, State.READY, "r"), status(4, 8, State.LOADING)], []).reported
    assigned = [
        (Assignment(M, 0, 4, "p"), True),
        (Assignment(M, 8, 12, "p"), True),
        (Assignment(M, 12, 16, "p"), False),
    ]
    diff = diff_assignment(reported, assigned)
    assert diff.load == (Assignment(M, 8, 12, "p"), Assignment(M, 12, 16, "p"))
    assert diff.unload == (Assignment(M, 4, 8, "p"),)
    assert diff.unreported == (Assignment(M, 8, 12, "p"),)  # its stored state is cleared
    assert diff.ready == ((M, 0, 4),)
    assert diff_assignment(reported, []).ready == ()  # READY but no longer assigned: not checked


def test_an_admission_is_refreshed_in_the_second_half_of_its_life() -> None:
    assert not admission_due(expires_at_ms=10_000, now_ms=4_999, ttl_ms=10_000)
    assert admission_due(expires_at_ms=10_000, now_ms=5_001, ttl_ms=10_000)
