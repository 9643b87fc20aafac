"""The data plane's pure parts: the seal and the frames (``agent.core.wire.data_frames``), the owner's
route plan and translations (``agent.core.owner.data_route``), and a node's sessions while they are
bound on its worker's data plane (``agent.core.node.sessions``). The native side and the swarm
are tested against real processes (tests/test_worker_data_plane.py, tests/test_swarm_e2e.py)."""

from __future__ import annotations

import itertools
import struct

import numpy as np
import pytest

from agent._proto import swarm_pb2, worker_pb2
from agent.core.node.policy import MAX_DATA_PLANE_DECODE_GROUPS, data_plane_decode_groups, data_plane_gather_us
from agent.core.node.sessions import SessionTable
from agent.core.owner.data_route import (
    RouteKeys,
    bind_request,
    continuation_steps,
    continue_request,
    data_plane_hosts,
    data_step,
    drawn_token,
    first_hop_refusal,
    next_hop_refusal,
    result_scores,
    step_result,
    success_step_result,
)
from agent.core.owner.sampling import SamplingParams
from agent.core.owner.session import ResultRefused, Session
from agent.core.wire import data_frames
from agent.core.wire.data_frames import DataFrameError, DataFrameReader, OwnerSession, SessionKeys
from agent.core.wire.step_results import result_scores as wire_scores
from agent.core.wire.swarm_wire import WireError
from agent.core.wire.topk import TopLogits, select_top_k

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

Code = swarm_pb2.Error.Code


def counting_bytes():
    """Deterministic 'random' bytes: each call a fresh pattern (no randomness in core tests)."""
    counter = itertools.count(1)
    return lambda n: bytes([next(counter) % 256]) * n


def test_a_sealed_frame_opens_only_with_its_key_kind_session_and_counter() -> None:
    key, sid = b"k" * 32, b"s" * 16
    sealed = data_frames.seal(key, data_frames.STEP, sid, 7, b"rows")
    assert len(sealed) == 4 + data_frames.TAG_BYTES and b"rows" not in sealed
    assert data_frames.open_sealed(key, data_frames.STEP, sid, 7, sealed) == b"rows"
    for args in (
        (b"K" * 32, data_frames.STEP, sid, 7),
        (key, data_frames.RESULT, sid, 7),
        (key, data_frames.STEP, b"t" * 16, 7),
        (key, data_frames.STEP, sid, 8),
    ):
        with pytest.raises(DataFrameError, match="does not open"):
            data_frames.open_sealed(*args, sealed)
    changed = bytes([sealed[0] ^ 1]) + sealed[1:]
    with pytest.raises(DataFrameError):
        data_frames.open_sealed(key, data_frames.STEP, sid, 7, changed)
    # the associated data is exactly what native/src/sealed.cpp binds (label, kind, session, counter)
    assert data_frames.frame_aad(1, sid, 2) == b"baton-data/1" + struct.pack("<I", 1) + sid + struct.pack("<Q", 2)


def test_the_reader_takes_whole_frames_as_they_come_and_refuses_what_is_not_one() -> None:
    frame = data_frames.sealed_frame(data_frames.STEP, b"k" * 32, b"s" * 16, 1, b"body")
    reader = DataFrameReader(max_frame_bytes=1024)
    for byte in frame[:-1]:  # one byte at a time: nothing until the frame is whole
        reader.feed(bytes([byte]))
        assert reader.next_frame() is None
    reader.feed(frame[-1:] + frame)
    first, second = reader.next_frame(), reader.next_frame()
    assert first is not None and first == second and first.counter == 1 and reader.next_frame() is None

    over = DataFrameReader(max_frame_bytes=16)
    over.feed(struct.pack("<I", 17))  # refused from the prefix, before the body is awaited
    with pytest.raises(DataFrameError, match="over the limit of 16"):
        over.next_frame()
    garbage = DataFrameReader(max_frame_bytes=1024)
    garbage.feed(struct.pack("<I", 4) + b"\xff\xff\xff\xff")
    with pytest.raises(DataFrameError, match="not a DataFrame"):
        garbage.next_frame()
    old = DataFrameReader(max_frame_bytes=1024)
    old.feed(data_frames.framed(worker_pb2.DataFrame(schema_version=2)))
    with pytest.raises(DataFrameError, match="schema_version 2"):
        old.next_frame()


def test_the_owner_takes_a_result_once_from_its_session_and_key_only() -> None:
    keys = SessionKeys.new(counting_bytes())
    owner = OwnerSession(keys)
    steps = [owner.step_frame(worker_pb2.DataStep(step=n)) for n in range(2)]
    counters = [worker_pb2.DataFrame.FromString(f[4:]).counter for f in steps]
    assert counters == [1, 2], "every STEP a new counter: no nonce is used twice under a key"

    def result_frame(
        counter: int, *, key: bytes = keys.return_key, sid: bytes = keys.session_id
    ) -> worker_pb2.DataFrame:
        body = worker_pb2.DataResult(step=0, n_vocab=3).SerializeToString()
        return worker_pb2.DataFrame.FromString(
            data_frames.sealed_frame(data_frames.RESULT, key, sid, counter, body)[4:]
        )

    assert owner.open_result(result_frame(5)).n_vocab == 3
    with pytest.raises(DataFrameError, match="not above the last one taken"):
        owner.open_result(result_frame(5))  # the same frame again
    with pytest.raises(DataFrameError, match="does not open"):
        owner.open_result(result_frame(6, key=b"x" * 32))
    with pytest.raises(DataFrameError, match="of session"):
        owner.open_result(result_frame(6, sid=b"y" * 16))
    notice = worker_pb2.DataFrame(schema_version=1, kind=data_frames.NOTICE, notice="no session is bound here")
    with pytest.raises(DataFrameError, match="refused a frame: no session is bound here"):
        owner.open_result(notice)
    assert owner.open_result(result_frame(6)).step == 0, "refusals changed nothing"


def _route(*addrs_per_hop: list[str]) -> swarm_pb2.Route:
    cuts = [(0, 10), (10, 20), (20, 30)][: len(addrs_per_hop)]
    return swarm_pb2.Route(
        model_sha256="ab" * 32,
        hops=[
            swarm_pb2.Hop(peer_id=f"peer{i}", begin=b, end=e, addrs=addrs)
            for i, ((b, e), addrs) in enumerate(zip(cuts, addrs_per_hop, strict=True))
        ],
    )


def test_a_route_is_on_the_data_plane_only_when_every_hop_has_a_direct_address() -> None:
    direct = [
        _route(["/ip4/10.0.0.1/tcp/4001/tls/p2p/peer0"], ["/ip4/10.0.0.2/tcp/4002/tls/p2p/peer1"]),
        _route(
            ["/ip4/10.0.0.1/tcp/9/p2p/peer0", "/ip6/::1/tcp/4001/tls/p2p/peer0"], ["/ip4/10.0.0.2/tcp/1/tls/p2p/peer1"]
        ),
    ]
    assert data_plane_hosts(direct[0]) == ["10.0.0.1", "10.0.0.2"]
    assert data_plane_hosts(direct[1]) == ["::1", "10.0.0.2"], "the channel address, not libp2p's"
    relayed = _route(["/ip4/10.0.0.1/tcp/4001/tls/p2p/peer0"], ["/ip4/10.0.0.9/tcp/1/p2p/t/p2p-circuit/p2p/peer1"])
    assert data_plane_hosts(relayed) is None


def test_each_hop_is_bound_with_its_key_and_where_its_output_goes() -> None:
    route = _route(*[[f"/ip4/10.0.0.{i}/tcp/400{i}/tls/p2p/peer{i}"] for i in range(3)])
    keys = RouteKeys.new(3, counting_bytes())
    assert len(set(keys.step_keys) | {keys.return_key, keys.continue_key}) == 5, "a key per hop, return, continue"
    hosts = data_plane_hosts(route)
    assert hosts is not None
    last = bind_request(route, 2, b"s" * 16, keys, hosts, next_port=0)
    assert (last.begin, last.end, last.step_key, last.return_key) == (20, 30, keys.step_keys[2], keys.return_key)
    assert not last.next_host and not last.next_port and not last.next_step_key and not last.next_peer_id
    middle = bind_request(route, 1, b"s" * 16, keys, hosts, next_port=7003)
    assert (middle.next_host, middle.next_port, middle.next_step_key) == ("10.0.0.2", 7003, keys.step_keys[2])
    assert middle.step_key == keys.step_keys[1] and not middle.return_key
    assert middle.next_peer_id == "peer2", "the next hop named, for its node to check"
    # the first hop takes the last hop's CONTINUE frames under the continue key; nobody else does
    assert bind_request(route, 0, b"s" * 16, keys, hosts, next_port=7001).continue_key == keys.continue_key
    assert not middle.continue_key and not last.continue_key


def test_a_greedy_session_continues_from_its_last_hop_to_its_first_within_its_budget() -> None:
    route = _route(*[[f"/ip4/10.0.0.{i}/tcp/400{i}/tls/p2p/peer{i}"] for i in range(3)])
    keys = RouteKeys.new(3, counting_bytes())
    hosts = data_plane_hosts(route)
    assert hosts is not None
    request = continue_request(route, b"s" * 16, keys, hosts, 7000, steps=5, stop_token_ids={7, 2}, max_position=0)
    assert (request.begin, request.end) == (20, 30), "asked of the last hop"
    assert (request.first_peer_id, request.first_host, request.first_port) == ("peer0", "10.0.0.0", 7000)
    assert request.continue_key == keys.continue_key and list(request.stop_token_ids) == [2, 7]
    # the first data plane step (the owner's) gives token generated + 1; each continued one more
    assert continuation_steps(max_new_tokens=10, generated=1, greedy=True, top_k=40) == 8
    assert continuation_steps(max_new_tokens=10, generated=9, greedy=True, top_k=40) == 0
    assert continuation_steps(max_new_tokens=10, generated=10, greedy=True, top_k=40) == 0
    # sampling the owner draws, or a full row (no top-K to take the greedy token from): the
    # owner's steps only; sampling the last hop draws continues as greedy does
    assert continuation_steps(max_new_tokens=10, generated=1, greedy=False, top_k=40) == 0
    assert continuation_steps(max_new_tokens=10, generated=1, greedy=True, top_k=0) == 0
    assert continuation_steps(max_new_tokens=10, generated=1, greedy=False, top_k=0, drawn=True) == 8
    assert request.temperature == 0.0 and request.draw_seed == 0  # greedy: nothing is drawn
    sampled = continue_request(
        route, b"s" * 16, keys, hosts, 7000, steps=5, stop_token_ids=(), max_position=0,
        sampling=SamplingParams(temperature=0.7, top_k=0, top_p=0.9), draw_seed=2**64 - 1,
    )  # fmt: skip
    assert (sampled.temperature, sampled.top_k, sampled.top_p, sampled.draw_seed) == (0.7, 0, 0.9, 2**64 - 1)

    first = _next_node(peer_id="peer0", begin=0, data_port=7000)
    first.listen_addrs[:] = ["/ip4/10.0.0.0/tcp/4000/tls/p2p/peer0"]
    assert first_hop_refusal(request, [first]) is None

    def refused(nodes: list[swarm_pb2.NodeEntry], why: str, **changes) -> None:
        changed = swarm_pb2.DataPlaneContinueRequest()
        changed.CopyFrom(request)
        for name, value in changes.items():
            setattr(changed, name, value)
        reason = first_hop_refusal(changed, nodes)
        assert reason is not None and why in reason, reason

    refused([first], "names no first hop", first_peer_id="")
    refused([_next_node()], "peer0 is not a live node")
    refused([first], "from block 0", first_peer_id="peer0", model_sha256="cd" * 32)
    refused([_next_node(peer_id="peer0", begin=10, data_port=7000)], "from block 0")
    refused([first], "at port 7009", first_port=7009)
    refused([first], "is not an address of the first hop peer0", first_host="10.0.0.7")
    first.seen_host = "10.0.0.5"
    refused([first], "is not where the tracker hears the first hop peer0 from (10.0.0.5)")


def _next_node(**changes) -> swarm_pb2.NodeEntry:
    """The tracker's entry of a route's third hop, READY on [20, 30) with its data plane at 7003."""
    status = swarm_pb2.AssignmentStatus(
        assignment=swarm_pb2.Assignment(model_sha256="ab" * 32, begin=20, end=30),
        state=swarm_pb2.AssignmentStatus.READY,
        data_port=7003,
    )
    entry = swarm_pb2.NodeEntry(
        peer_id="peer2", alive=True, serving=[status], assigned=[status.assignment],
        listen_addrs=["/ip4/10.0.0.9/tcp/9/p2p/peer2", "/ip4/10.0.0.2/tcp/4002/tls/p2p/peer2"],
    )  # fmt: skip
    for name, value in changes.items():
        if name in ("state", "data_port", "begin", "awaiting_check"):
            target = entry.serving[0] if name != "begin" else entry.serving[0].assignment
            setattr(target, name, value)
            if name == "begin":
                entry.assigned[0].begin = value
        elif name == "assigned":
            del entry.assigned[:]
        else:
            setattr(entry, name, value)
    return entry


def test_a_node_binds_only_toward_the_next_hop_the_tracker_lists() -> None:
    route = _route(*[[f"/ip4/10.0.0.{i}/tcp/400{i}/tls/p2p/peer{i}"] for i in range(3)])
    keys = RouteKeys.new(3, counting_bytes())
    hosts = data_plane_hosts(route)
    assert hosts is not None
    middle = bind_request(route, 1, b"s" * 16, keys, hosts, next_port=7003)
    other = swarm_pb2.NodeEntry(peer_id="peer7", alive=True)
    assert next_hop_refusal(middle, [other, _next_node()]) is None
    # the last hop sends nowhere but back over the owner's connection: nothing to check
    assert next_hop_refusal(bind_request(route, 2, b"s" * 16, keys, hosts, next_port=0), []) is None

    def refused(request: swarm_pb2.DataPlaneBindRequest, nodes: list[swarm_pb2.NodeEntry], why: str) -> None:
        reason = next_hop_refusal(request, nodes)
        assert reason is not None and why in reason, reason

    unnamed = swarm_pb2.DataPlaneBindRequest()
    unnamed.CopyFrom(middle)
    unnamed.next_peer_id = ""
    refused(unnamed, [_next_node()], "names no next hop")
    refused(middle, [other], "peer2 is not a live node")
    refused(middle, [_next_node(alive=False)], "peer2 is not a live node")
    refused(middle, [_next_node(state=swarm_pb2.AssignmentStatus.LOADING)], "serves no range")
    refused(middle, [_next_node(begin=21)], "from block 20")
    refused(middle, [_next_node(assigned=None)], "is not assigned a range of model ababababab")  # its word only
    refused(middle, [_next_node(awaiting_check=True)], "serves no range")  # not through its canary yet
    refused(middle, [_next_node(data_port=22)], "at port 7003")
    for host in ("10.0.0.9", "127.0.0.1", "example.org", ""):  # its libp2p address's host is not its channel's
        elsewhere = swarm_pb2.DataPlaneBindRequest()
        elsewhere.CopyFrom(middle)
        elsewhere.next_host = host
        refused(elsewhere, [_next_node()], "is not an address of the next hop peer2")
    other_model = swarm_pb2.DataPlaneBindRequest()
    other_model.CopyFrom(middle)
    other_model.model_sha256 = "cd" * 32
    refused(other_model, [_next_node()], "is not assigned a range of model cdcdcdcdcdcd")
    # the node's addresses are its own word: a host the tracker did not hear it from is refused,
    # even when the node lists it (a node pointing other nodes' workers at a third machine)
    assert next_hop_refusal(middle, [_next_node(seen_host="10.0.0.2")]) is None
    assert next_hop_refusal(middle, [_next_node(seen_host="::ffff:10.0.0.2")]) is None
    refused(middle, [_next_node(seen_host="10.0.0.66")], "is not where the tracker hears the next hop peer2 from")
    # heard over loopback, a node on the tracker's own machine (the operator's): as listed
    assert next_hop_refusal(middle, [_next_node(seen_host="127.0.0.1")]) is None


def test_results_come_to_the_session_as_the_node_path_would_bring_them() -> None:
    route = _route(*[[f"/ip4/10.0.0.{i}/tcp/400{i}/tls/p2p/peer{i}"] for i in range(3)])
    session = Session(b"s" * 16, [1, 2, 3], max_new_tokens=4, route_peer_ids=["peer0", "peer1", "peer2"])
    step_input = session.next_step()
    request = session.step_request(
        step_input, route, owner_peer_id="me", owner_addrs=[], admission=swarm_pb2.SignedAdmission()
    )
    step = data_step(request.step, request.positions, request.token_ids, request.result_top_k)
    assert (list(step.positions), list(step.token_ids), step.top_k) == ([0, 1, 2], [1, 2, 3], request.result_top_k)

    row = np.linspace(-1, 1, 64, dtype=np.float32)
    ids, top, lse = select_top_k(row, 40)
    result = worker_pb2.DataResult(
        step=0, n_vocab=64, top_k=40, top_token_ids=ids.astype("<i4").tobytes(), top_logits=top.astype("<f4").tobytes(),
        log_sum_exp=lse,
    )  # fmt: skip
    taken, sender = step_result(session.session_id, result, route)
    assert sender == "peer2"
    assert session.receive(taken, sender) == int(np.argmax(row))

    # an error names the hop whose range refused it (by its first block), and fails the session
    session.next_step()
    refused = worker_pb2.DataResult(step=1, error_code=8, error_message="context full", error_layer_begin=10)
    failed, sender = step_result(session.session_id, refused, route)
    assert sender == "peer1" and failed.failed_peer_id == "peer1"
    assert failed.error.code == Code.RESOURCE_EXHAUSTED and "context full" in failed.error.message
    unknown = worker_pb2.DataResult(step=1, error_code=99, error_message="?", error_layer_begin=5)
    failed, sender = step_result(session.session_id, unknown, route)
    assert sender == "peer2" and failed.error.code == Code.INTERNAL


def _top_result(step: int, row: np.ndarray, k: int = 40) -> worker_pb2.DataResult:
    ids, top, lse = select_top_k(row, k)
    return worker_pb2.DataResult(
        step=step, n_vocab=row.size, top_k=k, top_token_ids=ids.astype("<i4").tobytes(),
        top_logits=top.astype("<f4").tobytes(), log_sum_exp=lse,
    )  # fmt: skip


def test_scores_taken_straight_from_a_data_result_choose_as_the_step_result_would() -> None:
    """The owner takes a RESULT's scores without a StepResult in between (receive_scores): the
    same tokens as through ``step_result`` + ``receive``, for the top-K and the full row, and
    the same refusals (wrong sender, wrong step, malformed bytes)."""
    rng = np.random.default_rng(5)
    rows = [rng.standard_normal(64).astype(np.float32) for _ in range(4)]
    route = _route(*[[f"/ip4/10.0.0.{i}/tcp/400{i}/tls/p2p/peer{i}"] for i in range(3)])
    peers = ["peer0", "peer1", "peer2"]
    # greedy takes the top-40; sampling with no top-k asks for the full row (seeded alike)
    for sampling in (SamplingParams(), SamplingParams(temperature=0.8)):
        sessions = [
            Session(sid * 16, [1, 2, 3], max_new_tokens=4, route_peer_ids=peers, sampling=sampling,
                    rng=np.random.default_rng(9))
            for sid in (b"d", b"c")
        ]  # fmt: skip
        direct, converted = sessions
        for step, row in enumerate(rows):
            direct.next_step()
            converted.next_step()
            if direct.result_top_k:
                result = _top_result(step, row, direct.result_top_k)
            else:
                result = worker_pb2.DataResult(step=step, n_vocab=64, logits=row.astype("<f4").tobytes())
            got = direct.receive_scores(step, lambda result=result: result_scores(result), 64, "peer2")
            taken, sender = step_result(converted.session_id, result, route)
            assert got == converted.receive(taken, sender)
            # what a spot check replays: a well-formed StepResult (checksum) of the same scores
            replayed, direct_scores = wire_scores(success_step_result(direct.session_id, result)), result_scores(result)
            if isinstance(direct_scores, TopLogits):
                assert replayed.ids.tolist() == direct_scores.ids.tolist()
            np.testing.assert_array_equal(
                getattr(replayed, "logits", replayed), getattr(direct_scores, "logits", direct_scores)
            )
        assert direct.tokens == converted.tokens and direct.finished
    assert direct.result_top_k == 0 and direct.generated != [int(np.argmax(r)) for r in rows], "(sampled)"

    session = Session(b"s" * 16, [1, 2, 3], max_new_tokens=4, route_peer_ids=peers)
    session.next_step()
    good = _top_result(0, rows[0])
    for step, sender, why in (
        (0, "peer1", "not the last hop"),
        (0, "stranger", "not on the route"),
        (1, "peer2", "out-of-order"),
    ):
        with pytest.raises(ResultRefused, match=why) as refused:
            session.receive_scores(step, lambda: result_scores(good), 64, sender)
        assert not refused.value.fatal and session.awaiting, "not ours: the session is unchanged"
    bad = _top_result(0, rows[0])
    bad.top_logits = bad.top_logits[:-4]
    with pytest.raises(ResultRefused, match="do not pair up") as refused:
        session.receive_scores(0, lambda: result_scores(bad), 64, "peer2")
    assert refused.value.fatal and session.failure is not None


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: setattr(r, "n_vocab", 0), "n_vocab is 0"),
        (lambda r: setattr(r, "logits", b"\0" * 8), "both a logits row and top-k"),
        (lambda r: setattr(r, "top_token_ids", r.top_token_ids[:4] * 40), "repeat"),
        (lambda r: (r.ClearField("top_k"), r.ClearField("top_token_ids"), r.ClearField("top_logits"),
                    setattr(r, "logits", b"\0" * 12)), "12 logits bytes for n_vocab 64"),
    ],
)  # fmt: skip
def test_malformed_data_results_are_refused_with_what_is_wrong(mutate, message: str) -> None:
    result = _top_result(0, np.linspace(-1, 1, 64, dtype=np.float32))
    mutate(result)
    with pytest.raises(ValueError, match=message):
        result_scores(result)


def test_a_bound_session_takes_no_step_through_the_node_until_unbound() -> None:
    table = SessionTable(2, 64)
    sid = b"s" * 16
    table.accept(sid, 0, 0, 5, "owner", now_ms=0)
    with pytest.raises(WireError) as caught:
        table.bind_data_plane(sid, "owner", now_ms=1)
    assert caught.value.code == Code.UNAVAILABLE, "a step still in a Forward"
    table.done(sid, now_ms=2)
    with pytest.raises(WireError) as caught:
        table.bind_data_plane(sid, "someone else", now_ms=3)
    assert caught.value.code == Code.REFUSED
    with pytest.raises(WireError) as caught:
        table.bind_data_plane(b"t" * 16, "owner", now_ms=3)
    assert caught.value.code == Code.NOT_FOUND

    session = table.bind_data_plane(sid, "owner", now_ms=4)
    assert session.data_plane and session.last_used_ms == 4
    for refused in (
        lambda: table.accept(sid, 1, 5, 1, "owner", now_ms=5),
        lambda: table.resume(sid, 5, 3, "owner", now_ms=5),
    ):
        with pytest.raises(WireError) as caught:
            refused()
        assert caught.value.code == Code.INVALID_ARGUMENT and "data plane" in caught.value.message

    # a resume is checked against what the worker holds before the node unbinds for it
    with pytest.raises(WireError) as caught:
        table.check_resume_bound(sid, 9, 4, "owner", worker_next_position=8, worker_next_step=4)
    assert caught.value.code == Code.INVALID_ARGUMENT and "holds 8 positions, 9 asked" in caught.value.message
    with pytest.raises(WireError) as caught:
        table.check_resume_bound(sid, 6, 3, "owner", worker_next_position=8, worker_next_step=4)
    assert "step 3 was taken" in caught.value.message
    with pytest.raises(WireError) as caught:
        table.check_resume_bound(sid, 6, 4, "someone else", worker_next_position=8, worker_next_step=4)
    assert caught.value.code == Code.REFUSED
    table.check_resume_bound(sid, 6, 4, "owner", worker_next_position=8, worker_next_step=4)  # would be taken
    assert session.data_plane, "checking changes nothing"
    # the worker did steps 1-3 (positions 5-7): they come back into the session
    table.unbound(sid, next_step=4, next_position=8, rows=3, now_ms=9)
    assert (session.data_plane, session.next_step, session.next_position, session.rows) == (False, 4, 8, 8)
    table.accept(sid, 4, 8, 1, "owner", now_ms=10)  # and the node path goes on from there
    table.unbound(sid, next_step=99, next_position=99, rows=99, now_ms=11)  # not bound: ignored
    assert (session.next_step, session.rows) == (5, 9)


def test_a_session_that_ends_while_bound_is_unbound_before_its_sequence_is_freed() -> None:
    table = SessionTable(1, 64)
    bound, plain = b"b" * 16, b"p" * 16
    table.accept(bound, 0, 0, 4, "owner", now_ms=0)
    table.done(bound, now_ms=0)
    table.bind_data_plane(bound, "owner", now_ms=1)
    ended = table.end(bound)
    assert ended is not None and ended.data_plane
    assert table.take_unbinding() == [(bound, ended.seq_id)] and table.take_unbinding() == []
    assert table.take_closing() == [ended.seq_id]
    table.release(ended.seq_id)
    table.accept(plain, 0, 0, 4, "owner", now_ms=2)  # the sequence, reused
    table.end(plain)
    assert table.take_unbinding() == [], "a session that was not bound needs no unbinding"


def test_only_a_lock_step_first_hop_holds_data_plane_decode_steps() -> None:
    assert data_plane_gather_us(begin=0, decode_groups=1, decode_gather_ms=40.0) == 40_000, (
        "lock-step's first hop holds"
    )
    assert data_plane_gather_us(begin=10, decode_groups=1, decode_gather_ms=40.0) == 0, "only the first hop holds"
    assert data_plane_gather_us(begin=0, decode_groups=None, decode_gather_ms=40.0) == 0, "decode groups: no hold"
    assert data_plane_gather_us(begin=0, decode_groups=1, decode_gather_ms=0.0) == 0


def test_a_first_hop_keeps_its_nodes_decode_groups_on_the_data_plane() -> None:
    # auto: the route's hops + 1, as through the node (agent.core.node.scheduler.decode_group_cap)
    assert data_plane_decode_groups(begin=0, route_hops=3, decode_groups=None) == 4
    assert data_plane_decode_groups(begin=0, route_hops=3, decode_groups=2) == 2, "the node's own count"
    assert data_plane_decode_groups(begin=10, route_hops=3, decode_groups=None) == 0, "only the first hop splits"
    assert data_plane_decode_groups(begin=0, route_hops=1, decode_groups=None) == 0, "one hop: no pipeline to fill"
    assert data_plane_decode_groups(begin=0, route_hops=0, decode_groups=None) == 0, "an owner that does not say"
    assert data_plane_decode_groups(begin=0, route_hops=3, decode_groups=0) == 0, "off"
    assert data_plane_decode_groups(begin=0, route_hops=3, decode_groups=1) == 0, "lock-step: the hold, not a cap"
    # the owner names its route's length: it cannot make the worker split further than the bound
    assert data_plane_decode_groups(begin=0, route_hops=10_000, decode_groups=None) == MAX_DATA_PLANE_DECODE_GROUPS
    route = _route(*[[f"/ip4/10.0.0.{i}/tcp/400{i}/tls/p2p/peer{i}"] for i in range(3)])
    keys = RouteKeys.new(3, counting_bytes())
    assert bind_request(route, 0, b"s" * 16, keys, ["10.0.0.0", "10.0.0.1", "10.0.0.2"], 7001).route_hops == 3


def test_a_drawn_result_brings_its_token_and_its_log_probability() -> None:
    row = np.linspace(-3, 3, 64).astype(np.float32)
    top = row.argsort()[::-1][:4].copy()
    lse = float(np.log(np.exp(row.astype(np.float64)).sum()))
    result = _top_result(3, row, 4)
    assert drawn_token(result) is None and result_scores(result).beyond == ()
    result.drawn, result.drawn_token, result.drawn_logprob = True, 5, float(row[5]) - lse
    scores = result_scores(result)
    assert drawn_token(result) == 5 and 5 not in top
    assert scores.logprob(5) == pytest.approx(float(row[5]) - lse)  # outside the K, known all the same
    with pytest.raises(ValueError, match="not among the top"):
        scores.logprob(6)


def test_a_session_opened_by_its_bind_takes_its_prompt_on_the_data_plane_or_step_0_if_the_bind_fell_through() -> None:
    table = SessionTable(2, 64)
    sid = b"s" * 16
    opened = table.open_for_data_plane(sid, 40, "owner", now_ms=1)
    assert (opened.next_step, opened.next_position, opened.seq_id) == (0, 0, 0) and table.started == 1
    with pytest.raises(WireError) as caught:
        table.open_for_data_plane(sid, 40, "owner", now_ms=2)
    assert caught.value.code == Code.INVALID_ARGUMENT and "opened twice" in caught.value.message
    with pytest.raises(WireError) as caught:  # the context is checked for the whole prompt, as step 0's
        table.open_for_data_plane(b"t" * 16, 65, "owner", now_ms=2)
    assert caught.value.code == Code.RESOURCE_EXHAUSTED
    # the owner's bind fell through (another hop refused): its step 0 through the node opens nothing new
    with pytest.raises(WireError) as caught:
        table.accept(sid, 0, 0, 5, "someone else", now_ms=3)
    assert caught.value.code == Code.REFUSED
    session = table.accept(sid, 0, 0, 5, "owner", now_ms=3)
    assert session is opened and session.next_step == 1 and table.started == 1
    table.done(sid, now_ms=4)
    with pytest.raises(WireError) as caught:  # once it took a step, step 0 is a duplicate again
        table.accept(sid, 0, 0, 5, "owner", now_ms=5)
    assert "step 0 sent twice" in caught.value.message
