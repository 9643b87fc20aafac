"""agent.core.wire.punch: when to punch, who answers, TLS roles, backoff, the wire records."""

from __future__ import annotations

import math

import pytest

from agent._proto import swarm_pb2
from agent.core.wire.punch import (
    PunchBook,
    PunchConfig,
    PunchError,
    address_refusal,
    connect_reply,
    connect_request,
    error_reply,
    is_tls_client,
    punch_relay_host,
    read_punch_reply,
    read_punch_request,
    sync_delay_s,
    sync_reply,
    sync_request,
)
from agent.core.wire.swarm_wire import WireError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

RELAY = "/ip4/198.18.0.1/tcp/4001/p2p/12D3KooWRelay"
CIRCUIT = f"{RELAY}/p2p-circuit/p2p/12D3KooWPeer"
CONFIG = PunchConfig(backoff_initial_s=10.0, backoff_max_s=35.0, max_in_flight=2)


def test_only_a_peer_reached_through_the_relay_alone_is_punched_toward() -> None:
    assert punch_relay_host([CIRCUIT]) == "198.18.0.1"
    assert punch_relay_host(["/memory/x/p2p/x", CIRCUIT]) == "198.18.0.1"
    assert punch_relay_host([CIRCUIT, "/ip4/198.18.0.3/tcp/5/tls/p2p/12D3KooWPeer"]) is None  # dial its channel
    assert punch_relay_host([CIRCUIT, "/ip4/198.18.0.3/tcp/5/p2p/12D3KooWPeer"]) is None  # libp2p dials it
    assert punch_relay_host(["/ip4/198.18.0.3/tcp/5/p2p/12D3KooWPeer"]) is None
    assert punch_relay_host([]) is None
    assert punch_relay_host(["/dns4/relay.example/tcp/1/p2p/R/p2p-circuit/p2p/P"]) is None  # no address to start from


def test_the_smaller_peer_id_is_the_tls_client_on_both_sides() -> None:
    assert is_tls_client("12D3KooWA", "12D3KooWB") and not is_tls_client("12D3KooWB", "12D3KooWA")


def test_the_initiator_waits_half_the_round_trip_bounded() -> None:
    assert sync_delay_s(0.04, 2.0) == pytest.approx(0.02)
    assert sync_delay_s(10.0, 2.0) == 2.0
    assert sync_delay_s(-1.0, 2.0) == 0.0
    assert sync_delay_s(math.inf, 2.0) == 2.0


def test_a_peer_cannot_make_this_one_connect_anywhere() -> None:
    assert address_refusal("198.18.0.3", 40000, allow_loopback=False) is None
    assert address_refusal("2001:db8::1", 40000, allow_loopback=False) is None
    assert "loopback" in address_refusal("127.0.0.1", 22, allow_loopback=False)
    assert address_refusal("127.0.0.1", 22, allow_loopback=True) is None
    for host in ("224.0.0.1", "0.0.0.0", "169.254.1.1", "240.0.0.1", "fe80::1", "::"):
        assert "unicast" in address_refusal(host, 40000, allow_loopback=True), host
    assert "not an IP address" in address_refusal("example.com", 1, allow_loopback=False)
    assert "not a TCP port" in address_refusal("198.18.0.3", 0, allow_loopback=False)
    assert "not a TCP port" in address_refusal("198.18.0.3", 65536, allow_loopback=False)


def test_a_failed_punch_backs_off_doubling_to_the_max_and_a_success_resets_it() -> None:
    book = PunchBook("12D3KooWA", CONFIG)
    assert book.start("P", now=0.0)
    assert not book.start("P", now=0.0)  # one at a time per peer
    book.initiated("P", 1.0, connected=False)
    assert not book.start("P", now=10.9) and book.next_try_at("P") == 11.0
    assert book.start("P", now=11.0)
    book.initiated("P", 12.0, connected=False)
    assert book.next_try_at("P") == 32.0  # 20 s
    assert book.start("P", now=32.0)
    book.initiated("P", 40.0, connected=False)
    assert book.next_try_at("P") == 75.0  # 40 s, capped at 35
    assert book.start("P", now=75.0)
    book.initiated("P", 80.0, connected=True)
    # the connection will end one day: the next punch waits the initial time, not the backoff
    assert book.next_try_at("P") == 90.0
    assert book.succeeded["P"] == 1 and book.failed["P"] == 3


def test_punches_in_flight_are_bounded_across_both_roles() -> None:
    book = PunchBook("12D3KooWA", CONFIG)
    assert book.start("P1", 0.0)
    assert book.answer("P2", 0.0) is None
    assert not book.start("P3", 0.0)
    assert "busy" in book.answer("P4", 0.0)
    book.answered("P2", 1.0, connected=True)
    assert book.start("P3", 1.0)


def test_crossing_punches_leave_the_smaller_peer_ids_one() -> None:
    small, big = "12D3KooWA", "12D3KooWB"
    small_book, big_book = PunchBook(small, CONFIG), PunchBook(big, CONFIG)
    assert small_book.start(big, 0.0) and big_book.start(small, 0.0)
    assert "smaller peer id" in small_book.answer(big, 0.0)  # refuses the bigger id's
    assert big_book.answer(small, 0.0) is None  # takes the smaller id's
    assert "already under way" in big_book.answer(small, 0.0)


def test_punching_off_refuses_and_never_starts() -> None:
    book = PunchBook("12D3KooWA", PunchConfig(enabled=False))
    assert not book.start("P", 0.0)
    assert "off" in book.answer("P", 0.0)
    assert "itself" in PunchBook("A", CONFIG).answer("A", 0.0)


def test_config_refuses_nonsense() -> None:
    for bad in ({"syn_window_s": 0.0}, {"syn_interval_s": math.nan}, {"max_in_flight": 0}, {"sync_delay_max_s": -1.0}):
        with pytest.raises(ValueError):
            PunchConfig(**bad)


def test_records_round_trip_with_their_version() -> None:
    connect = read_punch_request(connect_request(7, "198.18.0.2", 40001))
    assert connect.schema_version == 1 and connect.punch_id == 7
    assert (connect.connect.host, connect.connect.port) == ("198.18.0.2", 40001)
    assert read_punch_request(sync_request(7)).WhichOneof("body") == "sync"
    assert read_punch_reply(connect_reply("198.18.0.3", 40002), allow_loopback=False) == ("198.18.0.3", 40002)
    assert read_punch_reply(sync_reply(), allow_loopback=False) is None


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\xff\xff", "malformed"),
        (
            swarm_pb2.PunchRequest(schema_version=2, punch_id=1, sync=swarm_pb2.PunchSync()).SerializeToString(),
            "schema_version 2",
        ),
        (swarm_pb2.PunchRequest(schema_version=1, punch_id=1).SerializeToString(), "no body"),
        (swarm_pb2.PunchRequest(schema_version=1, sync=swarm_pb2.PunchSync()).SerializeToString(), "punch_id is 0"),
    ],
)
def test_bad_requests_get_a_clear_error(data: bytes, message: str) -> None:
    with pytest.raises(WireError, match=message):
        read_punch_request(data)


def test_refusals_and_bad_replies_end_the_punch() -> None:
    with pytest.raises(PunchError, match="refused: REFUSED: busy"):
        read_punch_reply(error_reply(swarm_pb2.Error.REFUSED, "busy"), allow_loopback=False)
    with pytest.raises(PunchError, match="unreadable"):
        read_punch_reply(b"\xff\xff", allow_loopback=False)
    with pytest.raises(PunchError, match="loopback"):
        read_punch_reply(connect_reply("127.0.0.1", 22), allow_loopback=False)
