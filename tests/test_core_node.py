"""The node's decisions as pure state machines: the range lifecycle (agent.core.node.range_states),
the tracker link (agent.core.node.link) and the sender and failure rules (agent.core.node.policy)."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent._proto import swarm_pb2
from agent.core.net.identity import peer_id_from_public_key
from agent.core.node.link import (
    RegistrationInvalid,
    RegistrationRefused,
    next_retry_delay_s,
    read_heartbeat_reply,
    read_registration_reply,
)
from agent.core.node.policy import (
    BatchPeers,
    check_end_session_sender,
    check_session_owner,
    check_step_sender,
    forward_failure,
    push_groups,
    push_refused,
    push_unreachable,
    range_not_ready,
    sequence_not_held,
    worker_call_failed,
)
from agent.core.node.range_states import FailPending, HeartbeatNow, Ignored, RangeBook, StartRange, StopRange
from agent.core.wire.admission import issue_admission, public_key_bytes
from agent.core.wire.step_batch import (
    answer_step_batch,
    read_step_batch,
    read_step_batch_ack,
    step_batch,
    step_batch_ack,
)
from agent.core.wire.swarm_wire import (
    MAX_BATCH_STEPS,
    SCHEMA_VERSION,
    WireError,
    WorkerCall,
    step_ack,
    step_ack_error,
    worker_error_code,
)

pytestmark = pytest.mark.unit

State = swarm_pb2.AssignmentStatus.State
Code = swarm_pb2.Error.Code
LOAD, UNLOAD = swarm_pb2.Directive.LOAD, swarm_pb2.Directive.UNLOAD
LOCAL, REMOTE = "a" * 64, "b" * 64
KEY = (LOCAL, 0, 4)


def book(**overrides) -> RangeBook:
    fields = dict(fetches_models=False, verify_local_models=True, peer_id="12D3self")
    fields.update(overrides)
    return RangeBook([LOCAL], **fields)


def kinds(actions: list) -> list[type]:
    return [type(a) for a in actions]


# --- range lifecycle ------------------------------------------------------------------------


def test_load_starts_a_range_that_becomes_ready_and_unload_stops_it_and_fails_its_steps() -> None:
    b = book()
    actions = b.directive(LOAD, KEY)
    assert actions == [StartRange(KEY, 1, fetch=False, verify_local=True), HeartbeatNow()]
    assert b.entry(KEY).state == State.LOADING
    assert b.directive(LOAD, KEY) == []  # loading already
    assert b.ready(KEY, 1, "recipe") == [HeartbeatNow()]
    assert (b.entry(KEY).state, b.entry(KEY).recipe_hash) == (State.READY, "recipe")
    assert b.directive(LOAD, KEY) == []  # serving already
    assert b.directive(UNLOAD, KEY) == [StopRange(KEY, 1), HeartbeatNow()]
    assert KEY not in b and b.instance(KEY, 1) is not None  # its task is still ending
    actions = b.stopped(KEY, 1, "")
    assert kinds(actions) == [FailPending] and "stopped on 12D3self: unloaded" in actions[0].message
    assert b.instance(KEY, 1) is None
    assert b.directive(UNLOAD, KEY) == []


def test_a_range_that_can_never_load_here_fails_at_once_with_the_reason() -> None:
    b = book()
    assert b.directive(LOAD, (REMOTE, 0, 4)) == [HeartbeatNow()]
    assert b.entry((REMOTE, 0, 4)).state == State.FAILED
    assert "is not on this node" in b.entry((REMOTE, 0, 4)).error
    assert b.directive(LOAD, (LOCAL, 4, 4)) == [HeartbeatNow()]
    assert b.entry((LOCAL, 4, 4)).error == "bad range [4, 4)"
    assert b.directive(UNLOAD, (REMOTE, 0, 4)) == [HeartbeatNow()]  # no task to stop
    assert kinds(b.directive(7, KEY)) == [Ignored]


def test_a_missing_model_is_fetched_when_allowed_and_a_local_one_checked_when_asked() -> None:
    assert book(fetches_models=True).directive(LOAD, (REMOTE, 0, 4))[0] == StartRange(
        (REMOTE, 0, 4), 1, fetch=True, verify_local=False
    )
    assert book(verify_local_models=False).directive(LOAD, KEY)[0] == StartRange(
        KEY, 1, fetch=False, verify_local=False
    )


def test_a_failed_range_is_restarted_by_load_and_the_old_tasks_events_change_nothing() -> None:
    b = book()
    b.directive(LOAD, KEY)
    b.ready(KEY, 1, "recipe")
    assert b.worker_exited(KEY, 1, "worker exited with code 9") == [StopRange(KEY, 1), HeartbeatNow()]
    assert (b.entry(KEY).state, b.entry(KEY).error) == (State.FAILED, "worker exited with code 9")
    actions = b.directive(LOAD, KEY)  # the tracker assigns it again
    assert actions == [StopRange(KEY, 1), StartRange(KEY, 2, fetch=False, verify_local=True), HeartbeatNow()]
    assert b.ready(KEY, 1, "stale") == [] and b.worker_exited(KEY, 1, "stale") == []
    assert kinds(b.stopped(KEY, 1, "")) == [FailPending]  # the old instance's steps still get errors
    assert b.entry(KEY).state == State.LOADING and b.entry(KEY).epoch == 2
    assert b.stopped(KEY, 1, "") == []  # reported once


def test_a_task_that_fails_reports_failed_with_its_error() -> None:
    b = book()
    b.directive(LOAD, KEY)
    actions = b.stopped(KEY, 1, "ModelMismatch: tensor blk.0.attn_q.weight differs")
    assert kinds(actions) == [FailPending, HeartbeatNow]
    assert (b.entry(KEY).state, b.entry(KEY).error) == (
        State.FAILED,
        "ModelMismatch: tensor blk.0.attn_q.weight differs",
    )
    assert b.ready(KEY, 1, "late") == []  # a failed instance never becomes READY


# --- the tracker link -----------------------------------------------------------------------


TRACKER_KEY = Ed25519PrivateKey.generate()
TRACKER_ID = peer_id_from_public_key(public_key_bytes(TRACKER_KEY))
NODE_ID = "12D3KooWnode"
NOW_MS = 1_700_000_000_000


def admission(peer_id: str = NODE_ID, expires_ms: int = NOW_MS + 60_000) -> swarm_pb2.SignedAdmission:
    record = swarm_pb2.AdmissionRecord(
        schema_version=SCHEMA_VERSION,
        tracker_peer_id=TRACKER_ID,
        peer_id=peer_id,
        role=swarm_pb2.ROLE_NODE,
        issued_at_ms=NOW_MS - 1000,
        expires_at_ms=expires_ms,
    )
    return issue_admission(TRACKER_KEY, record)


def registered(**fields) -> swarm_pb2.TrackerReply:
    body = dict(admission=admission(), tracker_public_key=public_key_bytes(TRACKER_KEY), heartbeat_interval_ms=500)
    body.update(fields)
    return swarm_pb2.TrackerReply(register=swarm_pb2.RegisterReply(**body))


def read(reply: swarm_pb2.TrackerReply, own_interval: bool = False):
    return read_registration_reply(
        reply, tracker_peer_id=TRACKER_ID, peer_id=NODE_ID, now_ms=NOW_MS, own_heartbeat_interval=own_interval
    )


def test_a_registration_is_kept_only_from_the_tracker_dialled_with_a_usable_admission() -> None:
    ok = read(registered())
    assert ok.heartbeat_interval_ms == 500 and ok.tracker_public_key == public_key_bytes(TRACKER_KEY)
    assert read(registered(), own_interval=True).heartbeat_interval_ms is None
    with pytest.raises(RegistrationRefused, match="wrong pin"):
        read(swarm_pb2.TrackerReply(error=swarm_pb2.Error(code=Code.REFUSED, message="wrong pin")))
    with pytest.raises(RegistrationInvalid, match="INTERNAL"):
        read(swarm_pb2.TrackerReply(error=swarm_pb2.Error(code=Code.INTERNAL, message="boom")))
    other = Ed25519PrivateKey.generate()
    with pytest.raises(RegistrationInvalid, match="not to the tracker"):
        read(registered(tracker_public_key=public_key_bytes(other)))
    with pytest.raises(RegistrationInvalid, match="unusable admission"):
        read(registered(admission=admission(peer_id="12D3someoneelse")))
    with pytest.raises(RegistrationInvalid, match="unusable admission"):
        read(registered(admission=admission(expires_ms=NOW_MS - 1)))


def test_a_heartbeat_reply_gives_directives_a_verified_admission_or_a_new_registration() -> None:
    def beat(reply: swarm_pb2.TrackerReply):
        return read_heartbeat_reply(
            reply, tracker_public_key=public_key_bytes(TRACKER_KEY), peer_id=NODE_ID, now_ms=NOW_MS
        )

    forgot = beat(swarm_pb2.TrackerReply(error=swarm_pb2.Error(code=Code.NOT_FOUND, message="unknown node")))
    assert forgot.register_again and "registering again" in forgot.warning
    refused = beat(swarm_pb2.TrackerReply(error=swarm_pb2.Error(code=Code.INVALID_ARGUMENT, message="bad")))
    assert not refused.register_again and refused.directives == () and "heartbeat refused" in refused.warning
    reply = swarm_pb2.TrackerReply(heartbeat=swarm_pb2.HeartbeatReply(admission=admission()))
    reply.heartbeat.directives.add(kind=LOAD, assignment=swarm_pb2.Assignment(model_sha256=LOCAL, begin=0, end=4))
    good = beat(reply)
    assert good.admission == admission()
    assert [d.kind for d in good.directives] == [LOAD] and good.warning == ""
    reply.heartbeat.admission.CopyFrom(admission(peer_id="12D3someoneelse"))
    bad = beat(reply)
    assert bad.admission is None and "ignoring a refreshed admission" in bad.warning and len(bad.directives) == 1


def test_retry_delays_double_up_to_the_cap() -> None:
    delays = [0.5]
    for _ in range(6):
        delays.append(next_retry_delay_s(delays[-1], 4.0))
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0]


# --- sender rules and the failure policy ----------------------------------------------------


def test_clients_send_only_their_own_steps_to_first_hops_nodes_forward_any() -> None:
    check_step_sender(swarm_pb2.ROLE_CLIENT, "me", 0, 4, "me")
    check_step_sender(swarm_pb2.ROLE_NODE, "node", 4, 8, "someone")
    with pytest.raises(WireError, match="only send steps to the first hop") as caught:
        check_step_sender(swarm_pb2.ROLE_CLIENT, "me", 4, 8, "me")
    assert caught.value.code == Code.REFUSED
    with pytest.raises(WireError, match="of its own sessions"):
        check_step_sender(swarm_pb2.ROLE_CLIENT, "me", 0, 4, "someone")


def test_only_owners_end_resume_or_replay_their_sessions() -> None:
    sid = bytes(16)
    check_end_session_sender(swarm_pb2.ROLE_CLIENT, "me", sid, ["me", "me"])
    check_end_session_sender(swarm_pb2.ROLE_NODE, "node", sid, ["someone"])  # forwarded along a route
    with pytest.raises(WireError, match="belongs to someone"):
        check_end_session_sender(swarm_pb2.ROLE_CLIENT, "me", sid, ["me", "someone"])
    check_session_owner(swarm_pb2.ROLE_CLIENT, "me", sid, "me", KEY)
    with pytest.raises(WireError, match="unknown session") as caught:
        check_session_owner(swarm_pb2.ROLE_CLIENT, "me", sid, None, KEY)
    assert caught.value.code == Code.NOT_FOUND
    with pytest.raises(WireError, match="belongs to me"):
        check_session_owner(swarm_pb2.ROLE_NODE, "me", sid, "me", KEY)  # a node may not resume it


@pytest.mark.parametrize(
    ("code_name", "compute", "owner_request", "control"),
    [
        ("RESOURCE_EXHAUSTED", Code.RESOURCE_EXHAUSTED, Code.UNAVAILABLE, Code.UNAVAILABLE),
        ("UNAVAILABLE", Code.UNAVAILABLE, Code.UNAVAILABLE, Code.UNAVAILABLE),
        ("INVALID_ARGUMENT", Code.INVALID_ARGUMENT, Code.INVALID_ARGUMENT, Code.UNAVAILABLE),
        ("FAILED_PRECONDITION", Code.INTERNAL, Code.INVALID_ARGUMENT, Code.UNAVAILABLE),
        ("DEADLINE_EXCEEDED", Code.INTERNAL, Code.UNAVAILABLE, Code.UNAVAILABLE),
        ("", Code.INTERNAL, Code.UNAVAILABLE, Code.UNAVAILABLE),
    ],
)
def test_a_worker_failure_becomes_one_swarm_code_per_kind_of_call(
    code_name: str, compute: int, owner_request: int, control: int
) -> None:
    assert worker_error_code(code_name) == worker_error_code(code_name, WorkerCall.COMPUTE) == compute
    assert worker_error_code(code_name, WorkerCall.OWNER_REQUEST) == owner_request
    refusal = worker_call_failed(code_name, WorkerCall.CONTROL, "r[0, 4): could not trim")
    assert (refusal.code, refusal.message) == (control, "r[0, 4): could not trim")
    assert forward_failure(code_name, "x", "12D3self").code == compute  # the node's Forward asks the same
    assert sequence_not_held(code_name) == (code_name == "INVALID_ARGUMENT")


def test_failures_name_who_failed_and_busy_stays_busy() -> None:
    failure = forward_failure("RESOURCE_EXHAUSTED", "no KV room", "12D3self")
    assert (failure.code, failure.failed_peer_id, failure.end_session) == (Code.RESOURCE_EXHAUSTED, "12D3self", True)
    assert forward_failure("DEADLINE_EXCEEDED", "slow", "12D3self").code == Code.INTERNAL
    assert forward_failure("", "bad boundary", "12D3self").code == Code.INTERNAL
    unreachable = push_unreachable("12D3next", "connection refused")
    assert (unreachable.code, unreachable.failed_peer_id, unreachable.end_session) == (
        Code.UNAVAILABLE,
        "12D3next",
        False,
    )
    busy = push_refused("12D3next", Code.RESOURCE_EXHAUSTED, "all 4 sequences in use")
    assert busy.code == Code.RESOURCE_EXHAUSTED and "refused the step: all 4" in busy.message
    assert range_not_ready(KEY, None).code == Code.NOT_FOUND
    assert range_not_ready(KEY, State.LOADING).code == Code.UNAVAILABLE
    assert "is LOADING on this node" in range_not_ready(KEY, State.LOADING).message


def test_push_groups_keep_a_next_hop_s_steps_together_in_order():
    assert push_groups([]) == []
    assert push_groups(["b", None, "c", "b", None, "b", "c"]) == [[0, 3, 5], [1], [2, 6], [4]]
    assert push_groups([None, None]) == [[0], [1]]  # results: one message per owner and step


def test_a_hop_that_takes_single_steps_but_not_batches_gets_single_pushes_for_a_while():
    peers = BatchPeers(hold_ms=60_000)
    assert peers.batches_to("b", now_ms=0)
    # a failed batch whose steps the hop then refused singly too says nothing about batches
    peers.batch_failed("b", took_every_step_singly=False, now_ms=0)
    assert peers.batches_to("b", now_ms=1)
    peers.batch_failed("b", took_every_step_singly=True, now_ms=1_000)
    assert not peers.batches_to("b", now_ms=1_000) and not peers.batches_to("b", now_ms=60_999)
    assert peers.batches_to("c", now_ms=2_000)  # per peer
    assert peers.batches_to("b", now_ms=61_000)  # tried again: it may have been upgraded
    assert peers.batches_to("b", now_ms=61_001)
    with pytest.raises(ValueError, match="hold_ms"):
        BatchPeers(hold_ms=-1)


def test_step_batches_round_trip_and_refuse_what_they_cannot_carry():
    admission = swarm_pb2.SignedAdmission(record=b"r", signature=b"s")
    entries = [swarm_pb2.StepRequest(schema_version=1, step=i, sender_admission=admission) for i in range(2)]
    got = read_step_batch(step_batch([entries[0].SerializeToString(), b"\xff\xff", entries[1].SerializeToString()]))
    assert [s.step for s in (got[0], got[2])] == [0, 1]
    assert isinstance(got[1], WireError) and "malformed StepRequest" in got[1].message
    mixed = [
        entries[0],
        swarm_pb2.StepRequest(schema_version=1, sender_admission=swarm_pb2.SignedAdmission(record=b"x")),
    ]
    with pytest.raises(WireError, match="different sender admissions"):
        read_step_batch(step_batch([m.SerializeToString() for m in mixed]))
    for bad, fragment in ((step_batch([]), "got 0"), (step_batch([b"x"] * (MAX_BATCH_STEPS + 1)), "1..4096")):
        with pytest.raises(WireError, match=fragment):
            read_step_batch(bad)
    with pytest.raises(WireError, match="malformed StepBatch"):
        read_step_batch(b"\xff\xff")
    acks = read_step_batch_ack(step_batch_ack([step_ack(), step_ack_error(5, "busy")]), 2)
    assert [a.error.code for a in acks] == [0, 5] and acks[1].error.message == "busy"
    # one error ack refuses the whole batch; any other count is a bad answer
    whole = read_step_batch_ack(step_batch_ack([step_ack_error(4, "shutting down")]), 3)
    assert [a.error.message for a in whole] == ["shutting down"] * 3
    with pytest.raises(WireError, match="1 acks for 3 steps"):
        read_step_batch_ack(step_batch_ack([step_ack()]), 3)
    assert swarm_pb2.StepBatchAck.FromString(step_batch_ack([step_ack()])).schema_version == 1
    # answering a batch: each entry that parses gets its answer, in order; a bad entry its
    # own error; a batch refused as a whole one error ack
    seen = []

    def answer(request: swarm_pb2.StepRequest) -> bytes:
        seen.append(request.step)
        return step_ack_error(5, "busy") if request.step else step_ack()

    batch = step_batch([entries[0].SerializeToString(), b"\xff\xff", entries[1].SerializeToString()])
    acks = swarm_pb2.StepBatchAck.FromString(answer_step_batch(batch, answer)).acks
    assert seen == [0, 1] and [a.error.code for a in acks] == [0, Code.INVALID_ARGUMENT, 5]
    whole = swarm_pb2.StepBatchAck.FromString(answer_step_batch(step_batch([]), answer)).acks
    assert len(whole) == 1 and whole[0].error.code == Code.INVALID_ARGUMENT and seen == [0, 1]
