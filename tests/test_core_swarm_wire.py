"""Swarm wire codecs: protocol ids, checksums, step validation (every rule has a case that
breaks it and the error names what was wrong), next-hop / result builders, error replies."""

from __future__ import annotations

import re
import struct
import zlib

import numpy as np
import pytest

from agent._proto import swarm_pb2
from agent.core.net.multiaddrs import peer_id_from_multiaddr
from agent.core.wire.boundary import (
    RESIDUAL,
    RESIDUAL_STREAMS,
    BoundaryError,
    BoundarySchema,
    WireDType,
    decode_rows,
    encode_rows,
    wire_bytes,
)
from agent.core.wire.step_batch import batch_ack_accepts, step_batch_ack
from agent.core.wire.step_requests import encode_step_output, first_step_request, next_hop_request
from agent.core.wire.step_results import step_result, step_result_error, validate_step_result
from agent.core.wire.step_validation import RangeSpec, check_hops, validate_step
from agent.core.wire.swarm_wire import (
    NODE_PROTOCOL,
    RESULT_PROTOCOL,
    SCHEMA_VERSION,
    STEP_PROTOCOL,
    TRACKER_PROTOCOL,
    WireError,
    check_listen_addrs,
    crc32,
    node_reply_error,
    parse_record,
    printable,
    step_ack,
    step_ack_accepts,
    step_ack_error,
    token_checksum,
    tracker_reply_error,
)

pytestmark = pytest.mark.unit

Code = swarm_pb2.Error.Code
N_EMBD = 8
N_VOCAB = 100
SESSION = bytes(range(16))
ADMISSION = swarm_pb2.SignedAdmission(record=b"record", signature=b"sig")


def spec(begin: int, end: int, **overrides) -> RangeSpec:
    fields = dict(
        model_sha256="ab" * 32, begin=begin, end=end, n_layer=6, n_embd=N_EMBD, n_vocab=N_VOCAB,
        recipe_hash="cd" * 32, n_batch_max=4,
    )  # fmt: skip
    fields.update(overrides)
    return RangeSpec(**fields)


def hop(peer: str, begin: int, end: int) -> swarm_pb2.Hop:
    return swarm_pb2.Hop(peer_id=peer, addrs=[f"/memory/{peer}/p2p/{peer}"], begin=begin, end=end)


ROUTE = [hop("A", 0, 2), hop("B", 2, 4), hop("C", 4, 6)]


def token_step(token_ids=(1, 2, 3), *, first_position: int = 0, step: int = 0) -> swarm_pb2.StepRequest:
    return first_step_request(
        session_id=SESSION, step=step, hops=ROUTE, token_ids=list(token_ids), first_position=first_position,
        recipe_hash="cd" * 32, model_sha256="ab" * 32, owner_peer_id="owner", owner_addrs=["/memory/owner"],
        sender_admission=ADMISSION,
    )  # fmt: skip


def boundary_step(rows: np.ndarray, dtype: int = WireDType.F32, **fields) -> swarm_pb2.StepRequest:
    data = rows.astype("<f4" if dtype == WireDType.F32 else "<f2").tobytes()
    request = swarm_pb2.StepRequest(
        schema_version=1, session_id=SESSION, step=0, begin=2, end=4, positions=range(rows.shape[0]),
        boundary=data, dtype=dtype, n_embd=rows.shape[1], recipe_hash="cd" * 32, rest=[ROUTE[2]],
        owner_peer_id="owner", checksum=crc32(data), sender_admission=ADMISSION, model_sha256="ab" * 32,
    )  # fmt: skip
    for name, value in fields.items():
        setattr(request, name, value)
    return request


def rows_of(n: int) -> np.ndarray:
    return np.arange(n * N_EMBD, dtype=np.float32).reshape(n, N_EMBD) / 7


def expect(code: int, fragment: str, request: swarm_pb2.StepRequest, range_spec: RangeSpec) -> None:
    with pytest.raises(WireError) as caught:
        validate_step(request, range_spec)
    assert caught.value.code == code, str(caught.value)
    assert fragment in caught.value.message, caught.value.message


def test_protocol_ids_and_schema_version() -> None:
    assert (TRACKER_PROTOCOL, STEP_PROTOCOL, RESULT_PROTOCOL, NODE_PROTOCOL) == (
        "/baton/tracker/1.0.0", "/baton/step/1.0.0", "/baton/result/1.0.0", "/baton/node/1.0.0",
    )  # fmt: skip
    assert SCHEMA_VERSION == 1


def test_checksums_are_crc32_of_little_endian_bytes() -> None:
    assert token_checksum([1, 2, -3]) == zlib.crc32(struct.pack("<3i", 1, 2, -3))
    assert crc32(b"abc") == zlib.crc32(b"abc") and crc32(b"\xff" * 9) >= 0
    assert token_step().checksum == token_checksum([1, 2, 3])


def test_parse_record_refuses_garbage_and_other_schema_versions() -> None:
    with pytest.raises(WireError, match="malformed StepRequest") as caught:
        parse_record(swarm_pb2.StepRequest, b"\xff\xff\xff")
    assert caught.value.code == Code.INVALID_ARGUMENT
    data = swarm_pb2.StepRequest(schema_version=2).SerializeToString()
    with pytest.raises(WireError, match=r"schema_version 2 is not supported \(this peer speaks 1\)"):
        parse_record(swarm_pb2.StepRequest, data)
    with pytest.raises(WireError, match="schema_version 0"):
        parse_record(swarm_pb2.StepAck, b"")
    assert parse_record(swarm_pb2.StepRequest, token_step().SerializeToString()).session_id == SESSION


def test_valid_token_step() -> None:
    step = validate_step(token_step([5, 6, 7]), spec(0, 2))
    assert step.token_ids.tolist() == [5, 6, 7] and step.token_ids.dtype == np.int32
    assert step.positions.tolist() == [0, 1, 2] and step.n_rows == 3 and step.first_position == 0
    assert step.rows is None and step.dtype == WireDType.F32
    assert [h.peer_id for h in step.rest] == ["B", "C"] and step.owner_peer_id == "owner"
    later = validate_step(token_step([9], first_position=3, step=1), spec(0, 2))
    assert later.positions.tolist() == [3] and later.step == 1


def test_valid_boundary_steps_decode_without_copies() -> None:
    rows = rows_of(3)
    request = boundary_step(rows)
    step = validate_step(request, spec(2, 4))
    np.testing.assert_array_equal(step.rows, rows)
    assert not step.rows.flags.writeable, "F32 rows are a view of the received bytes"
    half = validate_step(boundary_step(rows, WireDType.F16), spec(2, 4))
    assert half.dtype == WireDType.F16 and half.rows.dtype == np.float32
    np.testing.assert_array_equal(half.rows, rows.astype(np.float16).astype(np.float32))


def test_every_step_rule_is_checked() -> None:
    rows = rows_of(2)
    nan_rows = rows.copy()
    nan_rows[1, 3] = np.nan
    bad = Code.INVALID_ARGUMENT
    cases = [
        (bad, "model_sha256", token_step(), spec(0, 2, model_sha256="ef" * 32)),
        (bad, "this range is [0, 3)", token_step(), spec(0, 3)),
        (bad, "recipe_hash", token_step(), spec(0, 2, recipe_hash="00" * 32)),
        (bad, "session_id has 3 bytes", _with(token_step(), session_id=b"abc"), spec(0, 2)),
        (bad, "owner_peer_id is empty", _with(token_step(), owner_peer_id=""), spec(0, 2)),
        (bad, "rest[0] covers blocks [3, 4)", _rest(token_step(), [hop("B", 3, 4), hop("C", 4, 6)]), spec(0, 2)),
        (bad, "rest[1] names no peer", _rest(token_step(), [hop("B", 2, 4), hop("", 4, 6)]), spec(0, 2)),
        (bad, "rest ends at block 4", _rest(token_step(), [hop("B", 2, 4)]), spec(0, 2)),
        (bad, "rest ends at block 2", _rest(token_step(), []), spec(0, 2)),
        (bad, "rest[0] covers blocks [2, 2)", _rest(token_step(), [hop("B", 2, 2), hop("C", 2, 6)]), spec(0, 2)),
        (bad, "no rows", _with(token_step([]), checksum=token_checksum([])), spec(0, 2)),
        (
            Code.RESOURCE_EXHAUSTED,
            "5 rows exceed this range's batch limit of 4",
            token_step([1, 2, 3, 4, 5]),
            spec(0, 2),
        ),
        (bad, "consecutive", _positions(token_step(), [0, 2, 3]), spec(0, 2)),
        (bad, "consecutive", _positions(token_step(), [-1, 0, 1]), spec(0, 2)),
        (bad, "step 0 (prefill) must start at position 0", token_step(first_position=2), spec(0, 2)),
        (bad, "take token ids, but the step carries boundary", _with(token_step(), boundary=b"\0" * 4), spec(0, 2)),
        (bad, "2 token ids but 3 positions", _positions(token_step([1, 2]), [0, 1, 2]), spec(0, 2)),
        (bad, "does not match the token ids", _with(token_step(), checksum=1), spec(0, 2)),
        (bad, f"token ids must be in [0, {N_VOCAB})", token_step([1, N_VOCAB]), spec(0, 2)),
        (bad, "token ids must be in", token_step([-1]), spec(0, 2)),
        (bad, "take boundary rows, but the step carries token ids", _tokens(boundary_step(rows), [1, 2]), spec(2, 4)),
        (
            bad,
            f"n_embd 4 does not match this model's width {N_EMBD}",
            boundary_step(np.ones((2, 4), np.float32)),
            spec(2, 4),
        ),
        (bad, "unsupported wire dtype 9", boundary_step(rows, dtype=9), spec(2, 4)),
        (bad, "boundary has 60 bytes, expected 2 rows x 8 x 4 bytes = 64", _short(boundary_step(rows)), spec(2, 4)),
        (bad, "does not match the boundary bytes", _with(boundary_step(rows), checksum=5), spec(2, 4)),
        (bad, "non-finite", boundary_step(nan_rows), spec(2, 4)),
        (bad, "non-finite", boundary_step(np.full((2, N_EMBD), np.inf, np.float32), WireDType.F16), spec(2, 4)),
    ]
    for code, fragment, request, range_spec in cases:
        expect(code, fragment, request, range_spec)


def _with(request: swarm_pb2.StepRequest, **fields) -> swarm_pb2.StepRequest:
    for name, value in fields.items():
        setattr(request, name, value)
    return request


def _rest(request: swarm_pb2.StepRequest, hops: list[swarm_pb2.Hop]) -> swarm_pb2.StepRequest:
    del request.rest[:]
    request.rest.extend(hops)
    return request


def _positions(request: swarm_pb2.StepRequest, positions: list[int]) -> swarm_pb2.StepRequest:
    del request.positions[:]
    request.positions.extend(positions)
    return request


def _tokens(request: swarm_pb2.StepRequest, tokens: list[int]) -> swarm_pb2.StepRequest:
    request.token_ids.extend(tokens)
    return request


def _short(request: swarm_pb2.StepRequest) -> swarm_pb2.StepRequest:
    request.boundary = request.boundary[:-4]
    request.checksum = crc32(request.boundary)
    return request


def test_check_hops_accepts_an_exact_chain() -> None:
    check_hops(ROUTE, 0, 6, "hops")
    check_hops([], 6, 6)
    with pytest.raises(WireError, match=r"hops ends at block 4"):
        check_hops(ROUTE[:2], 0, 6, "hops")


def test_next_hop_request_keeps_the_dtype_and_validates_downstream() -> None:
    first = validate_step(token_step([1, 2]), spec(0, 2))
    out = rows_of(2)
    request = next_hop_request(first, out, ADMISSION)
    assert (request.begin, request.end, request.dtype, request.n_embd) == (2, 4, WireDType.F32, N_EMBD)
    assert request.boundary == out.tobytes() and request.checksum == crc32(out.tobytes())
    assert [h.peer_id for h in request.rest] == ["C"] and list(request.positions) == [0, 1]
    assert request.sender_admission == ADMISSION and request.owner_peer_id == "owner"
    assert not request.token_ids
    middle = validate_step(request, spec(2, 4))
    np.testing.assert_array_equal(middle.rows, out)

    # F16 in -> F16 out, to the last range (no rest left).
    half = validate_step(boundary_step(out, WireDType.F16), spec(2, 4))
    request = next_hop_request(half, out * 2, ADMISSION)
    assert request.dtype == WireDType.F16 and len(request.boundary) == 2 * N_EMBD * 2 and not request.rest
    last = validate_step(request, spec(4, 6))
    np.testing.assert_array_equal(last.rows, (out * 2).astype(np.float16).astype(np.float32))

    with pytest.raises(BoundaryError, match="out of float16 range"):
        next_hop_request(half, np.full((2, N_EMBD), 1e6, np.float32), ADMISSION)
    with pytest.raises(BoundaryError, match="3 output rows for a step of 2 rows"):
        next_hop_request(first, rows_of(3), ADMISSION)


def test_f32_rows_pass_through_as_the_bytes_they_arrived_in() -> None:
    """A hop's F32 rows go on as bytes: validate_step keeps the received bytes (``wire_rows``,
    which ``rows`` views), and encode_step_output sends the worker's bytes as they are. Any
    other case (F16, bytes that do not match the rows) is encoded and checked as before."""
    out = rows_of(2)
    request = boundary_step(out)
    step = validate_step(request, spec(2, 4))
    assert step.wire_rows == request.boundary and step.wire_rows == out.tobytes()
    np.testing.assert_array_equal(np.frombuffer(step.wire_rows, "<f4").reshape(2, N_EMBD), step.rows)
    assert validate_step(boundary_step(out, WireDType.F16), spec(2, 4)).wire_rows is None
    assert validate_step(token_step([1, 2]), spec(0, 2)).wire_rows is None

    worker_bytes = (out * 3).tobytes()
    rows = np.frombuffer(worker_bytes, "<f4").reshape(2, N_EMBD)
    data, dtype = encode_step_output(step, rows, worker_bytes)
    assert data is worker_bytes and dtype == WireDType.F32  # not encoded again
    assert encode_step_output(step, rows) == (worker_bytes, WireDType.F32)  # the same bytes, encoded
    # rows that are not the step's count are refused, with their bytes or without
    with pytest.raises(BoundaryError, match="3 output rows for a step of 2 rows"):
        encode_step_output(step, rows_of(3), rows_of(3).tobytes())
    # an F16 step's output is converted whatever bytes come with it
    half = validate_step(boundary_step(out, WireDType.F16), spec(2, 4))
    data, dtype = encode_step_output(half, rows, worker_bytes)
    assert dtype == WireDType.F16 and data == rows.astype("<f2").tobytes()
    # without the bytes, non-finite rows are still refused
    bad = rows.copy()
    bad[1, 3] = np.nan
    with pytest.raises(BoundaryError, match="non-finite"):
        encode_step_output(step, bad)


STREAMS = 4
V4 = BoundarySchema(RESIDUAL_STREAMS, STREAMS, N_EMBD)  # DeepSeek V4: hc_mult streams per row


def v4_spec(begin: int, end: int) -> RangeSpec:
    return spec(begin, end, boundary=V4)


def v4_rows(n: int) -> np.ndarray:
    return np.arange(n * STREAMS * N_EMBD, dtype=np.float32).reshape(n, STREAMS * N_EMBD) / 7


def v4_step(rows: np.ndarray, dtype: int = WireDType.F32, **fields) -> swarm_pb2.StepRequest:
    request = boundary_step(rows, dtype, **fields)
    request.n_embd = N_EMBD
    if "boundary_schema_version" not in fields:
        request.boundary_schema_version = RESIDUAL_STREAMS
    if "boundary_streams" not in fields:
        request.boundary_streams = STREAMS
    return request


def test_boundary_schema_is_checked_at_every_hop() -> None:
    bad = Code.INVALID_ARGUMENT
    # A v2 (residual-streams) range takes rows of streams x n_embd values that declare v2.
    rows = v4_rows(2)
    got = validate_step(v4_step(rows), v4_spec(2, 4))
    assert got.rows.shape == (2, STREAMS * N_EMBD) and got.schema == V4
    np.testing.assert_array_equal(got.rows, rows)
    half = validate_step(v4_step(rows, WireDType.F16), v4_spec(2, 4))
    np.testing.assert_array_equal(half.rows, rows.astype(np.float16).astype(np.float32))

    # v1 rows (fields unset, as a sender older than schema 2 sends them) to a v2 range, and
    # v2 rows to a v1 range: refused, naming both schemas.
    v1_rows = rows_of(2)
    for request, range_spec in (
        (boundary_step(v1_rows), v4_spec(2, 4)),
        (boundary_step(v1_rows, boundary_schema_version=RESIDUAL, boundary_streams=1), v4_spec(2, 4)),
        (v4_step(rows), spec(2, 4)),
    ):
        with pytest.raises(WireError) as caught:
            validate_step(request, range_spec)
        message = caught.value.message
        assert caught.value.code == bad
        assert "residual/1 (1 stream x 8 values per token)" in message, message
        assert "residual-streams/2 (4 streams x 8 values per token)" in message, message
        assert "blocks [2, 4)" in message, message

    # The right version with a wrong stream count, and v2 rows of the wrong width.
    two_streams = v4_step(v4_rows(2)[:, : 2 * N_EMBD], boundary_streams=2)
    expect(bad, "boundary_streams 2 does not match", two_streams, v4_spec(2, 4))
    expect(bad, "boundary has 64 bytes, expected 2 rows x 32 x 4 bytes = 256", v4_step(v1_rows), v4_spec(2, 4))
    # A v1 range still takes rows without the fields (0 = unset reads as v1, one stream).
    assert validate_step(boundary_step(v1_rows), spec(2, 4)).schema == BoundarySchema(RESIDUAL, 1, N_EMBD)


def test_next_hop_request_carries_the_boundary_schema() -> None:
    # first range of a v2 model: token ids in, v2 rows out, declared for the next hop
    first = validate_step(token_step([1, 2]), v4_spec(0, 2))
    out = v4_rows(2)
    request = next_hop_request(first, out, ADMISSION)
    assert (request.boundary_schema_version, request.boundary_streams, request.n_embd) == (2, STREAMS, N_EMBD)
    assert len(request.boundary) == 2 * STREAMS * N_EMBD * 4
    middle = validate_step(request, v4_spec(2, 4))
    np.testing.assert_array_equal(middle.rows, out)
    # hop to hop: the schema and the dtype pass on unchanged
    onward = validate_step(next_hop_request(middle, out * 2, ADMISSION), v4_spec(4, 6))
    assert onward.schema == V4
    np.testing.assert_array_equal(onward.rows, out * 2)
    with pytest.raises(BoundaryError, match="expected width 32"):
        next_hop_request(middle, rows_of(2), ADMISSION)
    # v1 keeps declaring v1
    request = next_hop_request(validate_step(token_step([1, 2]), spec(0, 2)), rows_of(2), ADMISSION)
    assert (request.boundary_schema_version, request.boundary_streams) == (RESIDUAL, 1)
    with pytest.raises(WireError, match=r"residual/1 .* sent to a range that takes residual-streams/2"):
        validate_step(request, v4_spec(2, 4))


def test_step_results_round_trip_and_are_checked() -> None:
    logits = np.linspace(-3, 3, N_VOCAB, dtype=np.float32)
    result = step_result(SESSION, 4, logits, ADMISSION)
    assert (result.step, result.n_vocab, result.checksum) == (4, N_VOCAB, crc32(logits.tobytes()))
    parsed = parse_record(swarm_pb2.StepResult, result.SerializeToString())
    np.testing.assert_array_equal(validate_step_result(parsed, N_VOCAB), logits)
    with pytest.raises(WireError, match="n_vocab 100, expected 50"):
        validate_step_result(parsed, 50)
    parsed.checksum ^= 1
    with pytest.raises(WireError, match="does not match the logits"):
        validate_step_result(parsed)
    failed = step_result_error(SESSION, 4, Code.UNAVAILABLE, "next hop B unreachable", "B", ADMISSION)
    assert failed.failed_peer_id == "B" and not failed.logits
    with pytest.raises(WireError) as caught:
        validate_step_result(failed)
    assert caught.value.code == Code.UNAVAILABLE and caught.value.message == "next hop B unreachable"


def test_error_replies() -> None:
    ack = parse_record(swarm_pb2.StepAck, step_ack())
    assert ack.error.code == 0
    ack = parse_record(swarm_pb2.StepAck, step_ack_error(Code.REFUSED, "no"))
    assert (ack.error.code, ack.error.message) == (Code.REFUSED, "no")
    ack = parse_record(swarm_pb2.StepAck, step_ack(WireError(Code.NOT_FOUND, "gone")))
    assert (ack.error.code, ack.error.message) == (Code.NOT_FOUND, "gone")
    reply = parse_record(swarm_pb2.NodeReply, node_reply_error(Code.INTERNAL, "x"))
    assert reply.error.code == Code.INTERNAL
    reply = parse_record(swarm_pb2.TrackerReply, tracker_reply_error(Code.NOT_FOUND, "unknown node: register first"))
    assert reply.error.message == "unknown node: register first"
    assert str(WireError(Code.REFUSED, "bad")) == "REFUSED: bad"


def test_peer_id_from_multiaddr() -> None:
    assert peer_id_from_multiaddr("/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWabc") == "12D3KooWabc"
    assert peer_id_from_multiaddr("/memory/x/p2p/Qm/") == "Qm"
    for bad in ("/ip4/127.0.0.1/tcp/4001", "/p2p/", "12D3KooWabc"):
        with pytest.raises(ValueError, match="does not end with /p2p/<peer id>"):
            peer_id_from_multiaddr(bad)


def test_only_a_plain_acceptance_is_an_acceptance() -> None:
    # What a quiet request's receiver leaves unsent (confirmed in bulk): anything that says
    # more than "taken" (an error, a refused step of a batch, bytes that do not read) is sent.
    assert step_ack_accepts(step_ack())
    assert not step_ack_accepts(step_ack_error(Code.RESOURCE_EXHAUSTED, "busy"))
    assert not step_ack_accepts(b"") and not step_ack_accepts(b"garbage")
    taken, refused = step_ack(), step_ack_error(Code.NOT_FOUND, "unknown session")
    assert batch_ack_accepts(step_batch_ack([taken, taken, taken]))
    assert not batch_ack_accepts(step_batch_ack([taken, refused, taken]))
    assert not batch_ack_accepts(step_batch_ack([refused]))  # one error ack refuses the whole batch
    assert not batch_ack_accepts(step_batch_ack([]))
    assert not batch_ack_accepts(b"\xff\xff") and not batch_ack_accepts(step_ack())
    other_version = swarm_pb2.StepBatchAck(schema_version=SCHEMA_VERSION + 1, acks=[swarm_pb2.StepAck()])
    assert not batch_ack_accepts(other_version.SerializeToString())


# --- text a peer sent, made safe to show ------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("plain text, naïve café 你好 🙂", "plain text, naïve café 你好 🙂"),
        ("\x1b[2J\x1b[Hscreen cleared", "\\x1b[2J\\x1b[Hscreen cleared"),
        ("ok\n2026-12-07 tracker INFO forged line", "ok\\n2026-12-07 tracker INFO forged line"),
        ("evil\u202etxt.exe", "evil\\u202etxt.exe"),  # a bidi override
        ("a\x00b\x7fc", "a\\x00b\\x7fc"),
    ],
)
def test_printable_escapes_what_would_act_on_a_terminal_or_a_log(text: str, shown: str) -> None:
    assert printable(text, 1000) == shown


def test_printable_keeps_at_most_max_chars() -> None:
    assert printable("x" * 5000, 100) == "x" * 100 + "…"


def test_listen_addrs_are_a_few_printable_multiaddrs() -> None:
    check_listen_addrs(["/ip4/198.18.0.1/tcp/4001/p2p/12D3KooWx", "/ip6/::1/tcp/1"])
    for addrs, message in [
        (["/ip4/1.2.3.4/tcp/1\n"], "listen_addrs[0]"),
        (["/ip4/1.2.3.4/tcp/1", "/dns/é.example/tcp/1"], "listen_addrs[1]"),
        (["/" + "a" * 600], "at most 512 characters"),
        ([f"/ip4/1.2.3.4/tcp/{i}" for i in range(17)], "17 addresses, over 16"),
    ]:
        with pytest.raises(WireError, match=re.escape(message)):
            check_listen_addrs(addrs)


@pytest.mark.parametrize("wire", [WireDType.F16, WireDType.Q8])
def test_a_token_step_names_the_sessions_wire_dtype_and_every_hop_sends_in_it(wire: WireDType) -> None:
    request = first_step_request(
        session_id=SESSION, step=0, hops=ROUTE, token_ids=[1, 2], first_position=0, recipe_hash="cd" * 32,
        model_sha256="ab" * 32, owner_peer_id="owner", owner_addrs=[], sender_admission=ADMISSION, wire_dtype=wire,
    )  # fmt: skip
    assert request.dtype == wire
    first = validate_step(request, spec(0, 2))
    assert first.dtype == wire and first.rows is None
    out = rows_of(2)
    to_middle = next_hop_request(first, out, ADMISSION)
    assert to_middle.dtype == wire and len(to_middle.boundary) == wire_bytes(wire, 2, N_EMBD)
    middle = validate_step(to_middle, spec(2, 4))
    assert middle.dtype == wire and middle.wire_rows is None
    np.testing.assert_array_equal(middle.rows, decode_rows(encode_rows(out, N_EMBD, wire), 2, N_EMBD, wire))
    to_last = next_hop_request(middle, out * 3, ADMISSION)
    assert to_last.dtype == wire and validate_step(to_last, spec(4, 6)).dtype == wire
    # F32 (the default) leaves the field unset: what an older owner sends
    assert token_step().dtype == 0


def test_q8_rows_of_the_wrong_length_and_unknown_dtypes_are_refused_by_name() -> None:
    data = encode_rows(rows_of(2), N_EMBD, WireDType.Q8)
    step = boundary_step(rows_of(2), boundary=data[:-1], checksum=crc32(data[:-1]), dtype=WireDType.Q8)
    expect(
        Code.INVALID_ARGUMENT, f"boundary has {len(data) - 1} bytes, expected {len(data)}: 2 Q8 rows", step, spec(2, 4)
    )
    bad = token_step()
    bad.dtype = 7  # type: ignore[assignment]
    expect(
        Code.INVALID_ARGUMENT,
        "dtype: unsupported wire dtype 7: expected one of F32 (1), F16 (2), Q8 (3)",
        bad,
        spec(0, 2),
    )
