"""agent.core.net.frames, agent.core.net.multiaddrs, agent.core.peer_cert: pure codecs of the channel."""

from __future__ import annotations

import datetime

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.core.net import frames
from agent.core.net.frames import FrameError, FrameReader, FrameTooLarge, decode_uvarint, encode_uvarint
from agent.core.net.identity import peer_id_from_public_key
from agent.core.net.multiaddrs import (
    at_seen_host,
    channel_multiaddr,
    is_circuit,
    parse_channel_multiaddr,
    same_host,
    seen_first,
    tcp_hosts,
)
from agent.io.net.peer_cert import LIBP2P_TLS_OID, PeerCertError, make_peer_certificate, verify_peer_certificate

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_uvarint_round_trip() -> None:
    for value in (0, 1, 127, 128, 300, 1 << 32, (1 << 64) - 1):
        encoded = encode_uvarint(value)
        assert decode_uvarint(encoded + b"rest") == (value, len(encoded))
        assert decode_uvarint(encoded[:-1]) is None
    assert encode_uvarint(300) == b"\xac\x02"
    with pytest.raises(FrameError, match="longer than 10"):
        decode_uvarint(b"\xff" * 11)


def _frame(body: bytes) -> bytes:
    return frames.frame_prefix(len(body)) + body


def test_a_stream_writes_into_the_readers_space_and_frames_come_out_whole() -> None:
    # How the channel receives: decrypted straight into the reader's free space, any split
    # of the wire, a partial frame moved to the front when more room is needed, the buffer
    # kept between frames and given back after a frame bigger than keep_bytes.
    bodies = [b"a" * 10, b"b" * 5000, b"", b"c" * 70_000, b"d"]
    wire = b"".join(_frame(body) for body in bodies)
    for chunk in (1, 7, 4096, 100_000):
        reader = FrameReader(1 << 20, keep_bytes=64 * 1024)
        got, offset = [], 0
        while offset < len(wire):
            piece = wire[offset : offset + chunk]
            with reader.space(len(piece)) as free:
                assert len(free) >= len(piece)
                free[: len(piece)] = piece
            reader.commit(len(piece))
            offset += len(piece)
            while (body := reader.next_frame()) is not None:
                got.append(body)
        assert got == bodies and reader.at_frame_boundary
        with reader.space(16) as free:  # after a 70 KB frame, back to keep_bytes
            assert len(free) == 64 * 1024
    reader = FrameReader(100)
    with reader.space(10) as free:
        free[:4] = _frame(b"abc")
        free_bytes = len(free)
    with pytest.raises(ValueError, match="cannot commit"):
        reader.commit(free_bytes + 1)
    reader.commit(4)
    assert reader.next_frame() == b"abc"


def test_reader_splits_frames_fed_byte_by_byte() -> None:
    wire = _frame(b"one") + _frame(b"") + _frame(b"three" * 100)
    reader = FrameReader(1000)
    got = []
    for i in range(len(wire)):
        reader.feed(wire[i : i + 1])
        while (body := reader.next_frame()) is not None:
            got.append(body)
    assert got == [b"one", b"", b"three" * 100]
    assert reader.at_frame_boundary


def test_reader_refuses_an_oversize_prefix_before_the_body() -> None:
    reader = FrameReader(100)
    reader.feed(frames.frame_prefix(101))  # no body at all: refused on the prefix alone
    with pytest.raises(FrameTooLarge, match="101 bytes is over the limit of 100"):
        reader.next_frame()
    with pytest.raises(FrameTooLarge):  # the stream lost framing: stays refused
        reader.next_frame()


def test_needed_refuses_an_oversize_prefix_too() -> None:
    # the channel sizes its next receive by needed(): a prefix over the limit must raise
    # there as well, never ask for a buffer of that size
    reader = FrameReader(100)
    reader.feed(frames.frame_prefix(1 << 60))
    with pytest.raises(FrameTooLarge, match="over the limit"):
        reader.needed()
    with pytest.raises(FrameTooLarge):
        reader.next_frame()  # and the reader stays broken


def test_reader_names_truncation() -> None:
    reader = FrameReader(100)
    reader.feed(_frame(b"abcdef")[:-2])
    assert reader.next_frame() is None
    assert not reader.at_frame_boundary
    assert "2 bytes before the end" in str(reader.truncation_error())
    reader = FrameReader(100)
    reader.feed(b"\x80")
    assert "inside a length prefix" in str(reader.truncation_error())


def test_take_frame_parses_in_place_and_takes_the_frame_even_when_the_parse_fails() -> None:
    # A channel frame's payload is copied once, out of a view of the reader's buffer; the
    # view is released after the call (or the buffer could not be compacted or grown), and a
    # frame the parse refuses is still taken, so the next one comes out right.
    body = frames.request_header(9, "/baton/step/1.0.0") + b"x" * 3000
    reader = FrameReader(10_000)
    reader.feed(_frame(b"\x09bad!") + _frame(body) + _frame(b"tail")[:3])
    kept: list[memoryview] = []

    def keep(view: memoryview) -> memoryview:
        kept.append(view)
        return view

    with pytest.raises(FrameError, match="unknown channel frame kind 9"):
        reader.take_frame(frames.parse_channel_frame)
    frame = reader.take_frame(frames.parse_channel_frame)
    assert (frame.exchange_id, frame.protocol_id, frame.payload) == (9, "/baton/step/1.0.0", b"x" * 3000)
    assert type(frame.payload) is bytes
    reader.feed(_frame(b"tail")[3:] + _frame(b"z" * 50))
    assert reader.next_frame() == b"tail"
    reader.take_frame(keep)
    with pytest.raises(ValueError, match="released"):
        bytes(kept[0])  # the view a parse kept is dead: the buffer is free to change
    reader.feed(_frame(b"after"))  # and it still can
    assert reader.next_frame() == b"after" and reader.at_frame_boundary


def test_channel_frames_round_trip() -> None:
    body = frames.request_header(7, "/baton/step/1.0.0") + b"payload"
    frame = frames.parse_channel_frame(body)
    assert (frame.kind, frame.exchange_id, frame.protocol_id, frame.payload) == (
        frames.REQUEST,
        7,
        "/baton/step/1.0.0",
        b"payload",
    )
    reply = frames.parse_channel_frame(frames.reply_header(2**32 - 1) + b"r")
    assert (reply.kind_name, reply.exchange_id, reply.payload) == ("REPLY", 2**32 - 1, b"r")
    assert frames.parse_channel_frame(frames.error_header(3) + b"why").kind == frames.ERROR
    quiet = frames.parse_channel_frame(frames.request_header(9, "/baton/steps/1.0.0", quiet=True) + b"p")
    assert (quiet.kind_name, quiet.exchange_id, quiet.protocol_id, quiet.payload) == (
        "QUIET_REQUEST",
        9,
        "/baton/steps/1.0.0",
        b"p",
    )
    ids = [1, 2**32 - 1, 8, 8]  # in any order; a repeat is the peer's business
    taken = frames.parse_channel_frame(frames.taken_frame_body(ids))
    assert (taken.kind_name, taken.exchange_id) == ("TAKEN", 0)
    assert frames.read_taken_ids(taken.payload) == ids
    most = list(range(frames.MAX_TAKEN_IDS))
    assert frames.read_taken_ids(frames.parse_channel_frame(frames.taken_frame_body(most)).payload) == most
    for wrong in ([], [0] * (frames.MAX_TAKEN_IDS + 1), [2**32]):
        with pytest.raises(ValueError):
            frames.taken_frame_body(wrong)


@pytest.mark.parametrize(
    "payload",
    [b"", b"\x00\x00\x01", b"\x00" * 4 * (frames.MAX_TAKEN_IDS + 1)],
    ids=["no ids", "a partial id", "too many ids"],
)
def test_a_taken_frame_that_does_not_list_whole_ids_is_refused(payload: bytes) -> None:
    frame = frames.parse_channel_frame(b"\x05\x00\x00\x00\x00" + payload)
    with pytest.raises(FrameError, match="a TAKEN frame lists"):
        frames.read_taken_ids(frame.payload)


@pytest.mark.parametrize(
    "body, message",
    [
        (b"\x01\x00", "at least 5 bytes"),
        (b"\x09\x00\x00\x00\x01", "unknown channel frame kind 9"),
        (b"\x01\x00\x00\x00\x01", "ends before its protocol id"),
        (b"\x01\x00\x00\x00\x01\x05ab", "does not fit"),
        (b"\x01\x00\x00\x00\x01\x00", "does not fit"),
        (b"\x01\x00\x00\x00\x01\x01\xff", "not ASCII"),
        (b"\x04\x00\x00\x00\x01", "a QUIET_REQUEST frame ends before its protocol id"),
        (b"\x05\x00\x00\x00\x01\x00\x00\x00\x02", "a TAKEN frame names exchange id 0"),
    ],
)
def test_garbage_channel_frames_are_refused(body: bytes, message: str) -> None:
    with pytest.raises(FrameError, match=message):
        frames.parse_channel_frame(body)


def test_channel_multiaddrs() -> None:
    addr = channel_multiaddr("127.0.0.1", 4001, "12D3KooWabc")
    assert addr == "/ip4/127.0.0.1/tcp/4001/tls/p2p/12D3KooWabc"
    assert parse_channel_multiaddr(addr) == ("127.0.0.1", 4001, "12D3KooWabc")
    assert parse_channel_multiaddr(channel_multiaddr("::1", 5, "id")) == ("::1", 5, "id")
    for other in (
        "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWabc",  # libp2p
        "/ip4/127.0.0.1/tcp/4001/p2p/R/p2p-circuit/p2p/X",
        "/ip4/999.0.0.1/tcp/4001/tls/p2p/X",
        "/ip4/::1/tcp/4001/tls/p2p/X",
        "/ip4/127.0.0.1/tcp/0/tls/p2p/X",
        "/ip4/127.0.0.1/tcp/4001/tls/p2p/",
    ):
        assert parse_channel_multiaddr(other) is None, other
    assert is_circuit("/ip4/1.2.3.4/tcp/1/p2p/R/p2p-circuit/p2p/X")


def test_the_hosts_of_direct_tcp_addresses() -> None:
    addrs = [
        "/ip4/10.0.0.2/tcp/4001/p2p/X",  # libp2p
        "/ip4/1.2.3.4/tcp/1/p2p/R/p2p-circuit/p2p/X",  # through a relay: no host of its own
        "/ip6/::1/tcp/4002/tls/p2p/X",  # a channel
        "/ip4/10.0.0.3/udp/4001/quic",
        "/dns4/example.org/tcp/1/p2p/X",
        "garbage",
    ]
    assert tcp_hosts(addrs) == ["10.0.0.2", "::1"]
    assert tcp_hosts([]) == []


def test_a_peers_addresses_at_the_host_it_was_seen_at_come_first() -> None:
    assert same_host("10.0.0.2", "::ffff:10.0.0.2") and same_host("::1", "0:0:0:0:0:0:0:1")
    assert not same_host("10.0.0.2", "10.0.0.3") and not same_host("example.org", "10.0.0.2")
    addrs = ("/memory/A", "/ip4/10.0.0.9/tcp/1/tls/p2p/A", "/ip4/10.0.0.2/tcp/2/tls/p2p/A", "/ip4/10.0.0.2/tcp/3/p2p/A")
    assert seen_first(addrs, "10.0.0.2") == (addrs[2], addrs[3], addrs[0], addrs[1])
    assert seen_first(addrs, "") == addrs == seen_first(addrs, "192.0.2.1")


def test_only_the_direct_addresses_at_the_seen_host_are_kept_for_dialling_back() -> None:
    circuit = "/ip4/198.18.0.1/tcp/4001/p2p/R/p2p-circuit/p2p/A"
    addrs = (
        "/ip4/10.0.0.9/tcp/1/tls/p2p/A",
        "/ip4/10.0.0.2/tcp/2/tls/p2p/A",
        circuit,
        "/ip6/::ffff:10.0.0.2/tcp/3/p2p/A",
    )
    # another host's address is dropped, whatever its kind; the relay's circuit address stays
    assert at_seen_host(addrs, "10.0.0.2") == (addrs[1], circuit, addrs[3])
    assert at_seen_host(addrs, "10.0.0.7") == (circuit,)
    # the operator's own machine and an in-memory transport: as they are
    assert at_seen_host(addrs, "127.0.0.1") == addrs == at_seen_host(addrs, "") == at_seen_host(addrs, "::1")


def _cert(identity: Ed25519PrivateKey, cert_key=None) -> bytes:
    now = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    pem, _key = make_peer_certificate(
        identity, cert_key or ec.generate_private_key(ec.SECP256R1()), serial_number=9,
        not_before=now, not_after=now + datetime.timedelta(days=1),
    )  # fmt: skip
    return x509.load_pem_x509_certificate(pem).public_bytes(serialization.Encoding.DER)


def _peer_id(key: Ed25519PrivateKey) -> str:
    return peer_id_from_public_key(
        key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    )


def test_peer_certificate_names_its_identity() -> None:
    key = Ed25519PrivateKey.generate()
    assert verify_peer_certificate(_cert(key)) == _peer_id(key)


def test_a_certificate_claiming_another_identity_is_refused() -> None:
    """The extension of one certificate moved onto a certificate for another key: the
    signature covers the first certificate's key only, so the claim is refused."""
    victim, _attacker = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    victim_cert = x509.load_der_x509_certificate(_cert(victim))
    stolen = victim_cert.extensions.get_extension_for_oid(LIBP2P_TLS_OID).value
    attacker_key = ec.generate_private_key(ec.SECP256R1())
    forged = (
        x509.CertificateBuilder()
        .subject_name(victim_cert.subject).issuer_name(victim_cert.issuer)
        .public_key(attacker_key.public_key()).serial_number(1)
        .not_valid_before(victim_cert.not_valid_before_utc).not_valid_after(victim_cert.not_valid_after_utc)
        .add_extension(stolen, critical=False)
        .sign(attacker_key, hashes.SHA256())
    )  # fmt: skip
    with pytest.raises(PeerCertError, match="does not cover this certificate's key"):
        verify_peer_certificate(forged.public_bytes(serialization.Encoding.DER))


def test_certificates_without_or_with_a_broken_extension_are_refused() -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "x")])
    base = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(1).not_valid_before(datetime.datetime(2026, 1, 1))
        .not_valid_after(datetime.datetime(2027, 1, 1))
    )  # fmt: skip
    plain = base.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.DER)
    with pytest.raises(PeerCertError, match="no libp2p public key extension"):
        verify_peer_certificate(plain)
    broken = base.add_extension(x509.UnrecognizedExtension(LIBP2P_TLS_OID, b"\x30\x03\x04\x01\x00"), critical=False)
    with pytest.raises(PeerCertError):
        verify_peer_certificate(broken.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.DER))
    with pytest.raises(PeerCertError, match=r"not an X.509"):
        verify_peer_certificate(b"garbage")
