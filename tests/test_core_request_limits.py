"""agent.core.net.request_limits and the swarm's limits (agent.core.wire.swarm_wire.request_limits):
which request a listener takes on its length prefix, by protocol, by peer and in all; and the
channel frame reader's head check (agent.core.net.frames)."""

from __future__ import annotations

import pytest

from agent.core.net.frames import (
    CHANNEL_HEAD_BYTES,
    REPLY,
    REQUEST,
    FrameReader,
    FrameTooLarge,
    encode_uvarint,
    peek_channel_head,
    request_header,
)
from agent.core.net.request_limits import InFlightRequests, RequestLimits
from agent.core.wire.swarm_wire import (
    IDLE_STEP_REQUEST_BYTES,
    MAX_ADMISSION_REQUEST_BYTES,
    MAX_TRACKER_REQUEST_BYTES,
    NODE_PROTOCOL,
    RESULT_PROTOCOL,
    STEP_PROTOCOL,
    STEPS_PROTOCOL,
    TRACKER_PROTOCOL,
    request_limits,
    step_request_bytes,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

MIB = 1 << 20
LIMITS = RequestLimits(
    default_bytes=64 * MIB,
    protocol_bytes={"/big": 16 * MIB, "/small": MIB},
    unadmitted_bytes={"/small": 1000},
    peer_in_flight_bytes=32 * MIB,
    unadmitted_peer_in_flight_bytes=2 * MIB,
    unadmitted_in_flight_bytes=3 * MIB,
    total_in_flight_bytes=64 * MIB,
)


def _never() -> bool:
    raise AssertionError("asked whether the peer is admitted, where that changes nothing")


def test_each_protocol_has_its_limit_and_a_smaller_one_before_admission() -> None:
    assert LIMITS.max_request_bytes("/small", admitted=True) == MIB
    assert LIMITS.max_request_bytes("/small", admitted=False) == 1000
    assert LIMITS.max_request_bytes("/big", admitted=False) == 16 * MIB  # no smaller bound given
    assert LIMITS.max_request_bytes("/other", admitted=True) == 64 * MIB
    assert LIMITS.largest_request_bytes(admitted=True) == 64 * MIB
    assert LIMITS.largest_request_bytes(admitted=False) == 16 * MIB
    with pytest.raises(ValueError, match="peer_in_flight_bytes must be positive"):
        RequestLimits(default_bytes=1, peer_in_flight_bytes=0)
    with pytest.raises(ValueError, match="limit of /x must be positive"):
        RequestLimits(default_bytes=1, protocol_bytes={"/x": 0})


def test_a_request_over_its_limit_is_refused_on_its_length_with_the_reason() -> None:
    flight = InFlightRequests(LIMITS)
    assert flight.take("p", "/small", 1000, _never) is None  # what anyone may send: nobody is asked
    reason = flight.take("p", "/small", 1001, lambda: False)
    assert reason is not None and reason.too_large
    assert str(reason) == (
        "a request of 1001 bytes on /small is over the limit of 1000 bytes for a peer that is not admitted"
    )
    assert flight.take("p", "/small", MIB, lambda: True) is None
    assert flight.take("q", "/small", MIB + 1, lambda: True) is not None
    assert flight.refused == 2
    assert flight.peer_bytes("p") == 1000 + MIB and flight.total_bytes == 1000 + MIB


def test_the_bytes_in_flight_are_bounded_per_peer_and_given_back() -> None:
    flight = InFlightRequests(LIMITS)
    stranger = lambda: False  # noqa: E731
    # ten big requests at once from one peer not admitted: the first is taken, the rest refused
    taken = [flight.take("x", "/big", 15 * MIB, stranger) for _ in range(10)]
    assert taken[0] is None and all(r is not None and not r.too_large and "in flight" in str(r) for r in taken[1:])
    assert flight.unadmitted_bytes == 15 * MIB
    # an admitted peer is not held up by it, up to its own bound
    assert flight.take("a", "/big", 16 * MIB, lambda: True) is None
    assert flight.take("a", "/big", 16 * MIB, lambda: True) is None
    assert "would pass the bound of 33554432" in str(flight.take("a", "/big", MIB, lambda: True))
    flight.give_back("x", 15 * MIB)
    assert flight.peer_bytes("x") == 0 and flight.unadmitted_bytes == 0
    assert flight.take("x", "/big", 15 * MIB, stranger) is None  # room again
    flight.give_back("x", 15 * MIB)
    flight.give_back("a", 16 * MIB)
    flight.give_back("a", 16 * MIB)
    assert flight.total_bytes == 0 and flight.peer_bytes("a") == 0


def test_peers_not_admitted_share_one_bound_and_everyone_another() -> None:
    flight = InFlightRequests(LIMITS)
    stranger = lambda: False  # noqa: E731
    assert flight.take("s1", "/big", 2 * MIB, stranger) is None
    assert flight.take("s2", "/big", MIB, stranger) is None
    reason = flight.take("s3", "/big", MIB, stranger)  # many keys cost nothing to make
    assert reason is not None and "not admitted are in flight" in str(reason)
    assert flight.take("a", "/big", 16 * MIB, lambda: True) is None
    assert flight.take("b", "/big", 16 * MIB, lambda: True) is None
    assert flight.take("c", "/big", 16 * MIB, lambda: True) is None
    assert "from all peers" in str(flight.take("d", "/big", 16 * MIB, lambda: True))


def test_the_swarm_limits_size_each_protocol() -> None:
    tracker = request_limits(64 * MIB)
    assert tracker.max_request_bytes(TRACKER_PROTOCOL, admitted=True) == MAX_TRACKER_REQUEST_BYTES
    assert tracker.max_request_bytes(TRACKER_PROTOCOL, admitted=False) == MAX_ADMISSION_REQUEST_BYTES
    assert tracker.max_request_bytes(RESULT_PROTOCOL, admitted=True) == 64 * MIB  # logits: the frame limit
    smollm2 = step_request_bytes(576, 512)
    assert 4 * MIB < smollm2 < 16 * MIB  # rows of f32 and the fields of a batch of one-row steps
    node = request_limits(64 * MIB, step_bytes=smollm2)
    for protocol_id in (STEP_PROTOCOL, STEPS_PROTOCOL):
        assert node.max_request_bytes(protocol_id, admitted=True) == smollm2
        assert node.max_request_bytes(protocol_id, admitted=False) == smollm2  # a hop's first step has rows
    assert node.max_request_bytes(NODE_PROTOCOL, admitted=False) < node.max_request_bytes(NODE_PROTOCOL, admitted=True)
    assert node.unadmitted_peer_in_flight_bytes == 2 * smollm2
    idle = request_limits(64 * MIB, step_bytes=IDLE_STEP_REQUEST_BYTES)
    assert idle.max_request_bytes(STEP_PROTOCOL, admitted=True) == IDLE_STEP_REQUEST_BYTES
    # a node of a huge model: never over the frame limit
    assert (
        request_limits(64 * MIB, step_bytes=step_request_bytes(16384, 4096)).max_request_bytes(
            STEPS_PROTOCOL, admitted=True
        )
        == 64 * MIB
    )


def _channel_frame(kind_header: bytes, payload_bytes: int) -> bytes:
    body_len = len(kind_header) + payload_bytes
    return encode_uvarint(body_len) + kind_header


def test_a_channel_frame_is_checked_on_its_head_before_room_is_made_for_it() -> None:
    seen: list[tuple[int, int, str | None, int]] = []

    def check(length: int, head: memoryview) -> bool:
        seen.append(peek_channel_head(length, head))
        if seen[-1][3] > 1000:
            raise FrameTooLarge(f"{seen[-1][3]} bytes on {seen[-1][2]}")
        return True

    reader = FrameReader(64 * MIB, check_head=check, head_bytes=CHANNEL_HEAD_BYTES)
    small = request_header(7, "/baton/step/1.0.0")
    reader.feed(_channel_frame(small, 10) + bytes(10))
    assert reader.next_frame() is not None
    assert seen == [(REQUEST, 7, "/baton/step/1.0.0", 10)]
    # a 60 MB request: its head is all the reader asks for, and the check refuses it
    reader.feed(encode_uvarint(len(small) + 60_000_000))
    assert reader.needed() == CHANNEL_HEAD_BYTES  # not 60 MB
    reader.feed(small + bytes(100))
    assert reader.needed() == CHANNEL_HEAD_BYTES - len(small) - 100
    with pytest.raises(FrameTooLarge, match=r"60000000 bytes on /baton/step/1\.0\.0"):
        reader.feed(bytes(200))
        reader.needed()
    with pytest.raises(FrameTooLarge):  # the reader stays broken
        reader.next_frame()
    # a short reply's head is the whole frame
    replies: list[tuple[int, int, str | None, int]] = []
    reader = FrameReader(64 * MIB, check_head=lambda n, head: not replies.append(peek_channel_head(n, head)),
                         head_bytes=CHANNEL_HEAD_BYTES)  # fmt: skip
    reader.feed(encode_uvarint(7) + bytes([REPLY]) + (9).to_bytes(4, "big") + b"ok")
    assert reader.next_frame() == bytes([REPLY]) + (9).to_bytes(4, "big") + b"ok"
    assert replies == [(REPLY, 9, None, 2)]


def test_a_frame_its_head_check_drops_is_let_go_as_it_arrives() -> None:
    def check(length: int, head: memoryview) -> bool:
        return bytes(head[:4]) != b"drop"

    reader = FrameReader(64 * MIB, check_head=check, head_bytes=8)
    big = encode_uvarint(50_000) + b"drop" + bytes(49_996)
    keep = encode_uvarint(6) + b"keep!!"
    reader.feed(keep + big[:1000])
    assert reader.next_frame() == b"keep!!"
    assert reader.next_frame() is None and reader.frames_dropped == 1
    assert reader.buffered == 0 and not reader.at_frame_boundary  # nothing of it kept
    reader.feed(big[1000:30_000])
    assert reader.buffered == 0 and reader.needed() == 1
    reader.feed(big[30_000:] + keep + big + keep)  # the rest, then frames after it
    assert reader.next_frame() == b"keep!!"
    assert reader.next_frame() == b"keep!!"  # a dropped frame in between, whole
    assert reader.next_frame() is None and reader.at_frame_boundary and reader.frames_dropped == 2


def test_a_peer_admitted_while_its_requests_are_in_flight_is_counted_right() -> None:
    flight = InFlightRequests(LIMITS)
    admitted = False
    assert flight.take("p", "/big", MIB, lambda: admitted) is None
    admitted = True
    assert flight.take("p", "/big", 4 * MIB, lambda: admitted) is None  # over a stranger's bound: admitted now
    assert flight.unadmitted_bytes == MIB and flight.peer_bytes("p") == 5 * MIB
    flight.give_back("p", 4 * MIB)
    assert flight.unadmitted_bytes == 0 and flight.peer_bytes("p") == MIB
    flight.give_back("p", MIB)
    assert flight.unadmitted_bytes == 0 and flight.total_bytes == 0 and flight.peer_bytes("p") == 0
