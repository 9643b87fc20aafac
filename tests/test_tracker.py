"""The tracker service over in-memory transports, with a real SQLite file and trio's MockClock.

Covers: admission and every refusal reason, admissions that verify, heartbeat directives and
admission refresh, malformed requests (error replies, tracker keeps serving), the heartbeat
timeout at exactly the configured time with healing, restart without loss, routes once nodes
report READY, model metadata (a registered GGUF's prefix, cached, NOT_FOUND / UNAVAILABLE), the
node list (assignments, reported states, liveness) and ``baton tracker nodes``, store migration,
and the model registry (GGUF facts, bytes per block).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sqlite3
import stat

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent._proto import swarm_pb2
from agent.core.net.identity import peer_id_from_public_key
from agent.core.tracker.assignment import Assignment
from agent.core.tracker.registry import GgufFacts, bytes_per_block, model_entry
from agent.core.wire import admission as adm
from agent.core.wire.admission_work import solve_work
from agent.core.wire.invites import invite_sha256, new_invite
from agent.core.wire.swarm_wire import NODE_PROTOCOL, TRACKER_PROTOCOL
from agent.io.gguf_sparse import gguf_metadata_prefix
from agent.io.net.transport import MemoryNetwork
from agent.io.tracker.cli import parse_model_arg, register_models
from agent.io.tracker.config import TrackerConfig
from agent.io.tracker.gguf_info import GgufError, read_gguf_facts
from agent.io.tracker.service import serve_tracker
from agent.io.tracker.store import NodeRecord, StoreError, TrackerStore, open_store

pytestmark = pytest.mark.swarm

T0_MS = 1_800_000_000_000  # unix ms at trio time 0
PIN = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
PATCH = "c7" * 32
BPB = 1_000_000
MODEL = swarm_pb2.ModelEntry(
    sha256="aa" * 32, name="Tiny Model", alias="tiny", architecture="qwen2", n_layer=6, size_bytes=10**7,
    bytes_per_block=BPB,
)  # fmt: skip
# manifests are made on request here: the metadata tests move the file under the tracker
CONFIG = TrackerConfig(llama_cpp_commit=PIN, patch_series_sha256=PATCH, prepare_manifests_at_start=False)
READY, LOADING = swarm_pb2.AssignmentStatus.READY, swarm_pb2.AssignmentStatus.LOADING
FAILED = swarm_pb2.AssignmentStatus.FAILED
Code = swarm_pb2.Error


def now_ms() -> int:
    return T0_MS + round(trio.current_time() * 1000)


def key(seed: int) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(bytes([seed]) * 32)


def peer(k: Ed25519PrivateKey) -> str:
    return peer_id_from_public_key(adm.public_key_bytes(k))


TRACKER_KEY = key(100)
TRACKER = peer(TRACKER_KEY)


class Peer:
    """A node or client talking to the tracker over the memory network."""

    def __init__(self, net: MemoryNetwork, k: Ed25519PrivateKey) -> None:
        self.key = k
        self.peer_id = peer(k)
        self.transport = net.add(self.peer_id)
        self._nonce = 0

    async def raw(self, payload: bytes) -> swarm_pb2.TrackerReply:
        data = await self.transport.request(TRACKER, [], TRACKER_PROTOCOL, payload, timeout_s=10)
        reply = swarm_pb2.TrackerReply()
        reply.ParseFromString(data)
        assert reply.schema_version == 1
        return reply

    async def call(self, **body) -> swarm_pb2.TrackerReply:
        return await self.raw(swarm_pb2.TrackerRequest(schema_version=1, **body).SerializeToString())

    def nonce(self) -> bytes:
        self._nonce += 1
        return self._nonce.to_bytes(16, "big")

    def fingerprint(self, **overrides) -> swarm_pb2.Fingerprint:
        fields = {
            "schema_version": 1,
            "peer_id": self.peer_id,
            "llama_cpp_commit": PIN,
            "patch_series_sha256": PATCH,
            "created_at_ms": now_ms(),
            "nonce": self.nonce(),
            "usable_memory_bytes": 6 * BPB,
            "devices": [swarm_pb2.Device(backend="CPU", name="CPU", total_bytes=1 << 34, free_bytes=1 << 34)],
            "decode_s_per_block": 0.001,
            "listen_addrs": [f"/memory/{self.peer_id}"],
            "model_sha256s": [MODEL.sha256],
        }
        fields.update(overrides)
        return swarm_pb2.Fingerprint(**fields)

    async def register(self, work: bytes = b"", invite: str = "", **overrides) -> swarm_pb2.TrackerReply:
        signed = adm.sign_fingerprint(self.key, self.fingerprint(**overrides))
        return await self.call(register=swarm_pb2.RegisterRequest(fingerprint=signed, work=work, invite=invite))

    async def heartbeat(
        self, serving=(), recipe="recipe-1", state=READY, in_use: int = 0, total: int = 0
    ) -> swarm_pb2.TrackerReply:
        statuses = [
            swarm_pb2.AssignmentStatus(
                assignment=swarm_pb2.Assignment(model_sha256=MODEL.sha256, begin=b, end=e),
                state=state,
                recipe_hash=recipe if state == READY else "",
                sequences_in_use=in_use,
                sequences_total=total,
            )
            for b, e in serving
        ]
        return await self.call(
            heartbeat=swarm_pb2.HeartbeatRequest(peer_id=self.peer_id, sent_at_ms=now_ms(), serving=statuses)
        )


def ranges_of(directives, kind=swarm_pb2.Directive.LOAD) -> list[tuple[int, int]]:
    return sorted((d.assignment.begin, d.assignment.end) for d in directives if d.kind == kind)


@dataclasses.dataclass
class Harness:
    net: MemoryNetwork
    db_path: object
    store: TrackerStore
    tracker: object
    nursery: trio.Nursery
    config: TrackerConfig

    def peer(self, seed: int) -> Peer:
        return Peer(self.net, key(seed))


@contextlib.asynccontextmanager
async def running_tracker(db_path, net=None, config=CONFIG, models=(MODEL,), gguf_files=()):
    """A tracker on ``net`` over the database at ``db_path``, holding ``models`` (entries
    only, no file) and ``gguf_files`` ((path, alias): registered as ``baton tracker serve``
    does)."""
    net = net or MemoryNetwork()
    transport = net.add(TRACKER)
    with open_store(db_path) as store:
        for m in models:
            store.put_model(m, now_ms())
        register_models(store, list(gguf_files), now_ms())
        async with trio.open_nursery() as nursery:
            tracker = await nursery.start(
                lambda task_status: serve_tracker(
                    transport, store, config, TRACKER_KEY, clock=now_ms, task_status=task_status
                )
            )
            yield Harness(net, db_path, store, tracker, nursery, config)
            nursery.cancel_scope.cancel()


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "tracker.db"


# --- admission ----------------------------------------------------------------------------------


async def test_admitted_node_gets_a_valid_admission_and_load_directives(autojump_clock, db_path):
    async with running_tracker(db_path) as h:
        node = h.peer(1)
        reply = await node.register()
        assert reply.WhichOneof("body") == "register", reply.error
        reg = reply.register
        assert peer_id_from_public_key(reg.tracker_public_key) == TRACKER
        record = adm.verify_admission(
            reg.admission, reg.tracker_public_key, node.peer_id, now_ms(), roles=[swarm_pb2.ROLE_NODE]
        )
        assert record.expires_at_ms == now_ms() + 600_000 and record.tracker_peer_id == TRACKER
        assert (reg.heartbeat_interval_ms, reg.heartbeat_timeout_ms) == (1000, 5000)
        # a node that holds the whole model gets it all
        beat = await node.heartbeat()
        assert beat.WhichOneof("body") == "heartbeat", beat.error
        assert ranges_of(beat.heartbeat.directives) == [(0, 6)]
        assert not beat.heartbeat.HasField("admission")  # still fresh
        # once it reports the range, nothing more to do; a range it was not given is unloaded
        beat = await node.heartbeat(serving=[(0, 6), (2, 4)], state=LOADING)
        assert ranges_of(beat.heartbeat.directives) == []
        assert ranges_of(beat.heartbeat.directives, swarm_pb2.Directive.UNLOAD) == [(2, 4)]


async def test_client_hello_gets_a_client_admission_once_per_nonce(autojump_clock, db_path):
    async with running_tracker(db_path) as h:
        client = h.peer(2)
        hello = adm.make_client_hello(client.key, now_ms(), b"\x01" * 16)
        reply = await client.call(client_hello=hello)
        assert reply.WhichOneof("body") == "client_hello", reply.error
        record = adm.verify_admission(
            reply.client_hello.admission, reply.client_hello.tracker_public_key, client.peer_id, now_ms()
        )
        assert record.role == swarm_pb2.ROLE_CLIENT
        again = await client.call(client_hello=hello)
        assert again.error.code == Code.REFUSED and again.error.message.startswith("replayed registration")
        impostor = await h.peer(3).call(client_hello=hello)
        assert impostor.error.code == Code.REFUSED and impostor.error.message.startswith("peer id mismatch")
        await trio.sleep(61)
        stale = await client.call(client_hello=adm.make_client_hello(client.key, now_ms() - 60_001, b"\x02" * 16))
        assert stale.error.message.startswith("stale registration")


async def test_a_new_identity_brings_its_proof_of_work_where_the_tracker_asks(autojump_clock, db_path):
    config = dataclasses.replace(CONFIG, admission_work_bits=12)
    async with running_tracker(db_path, config=config) as h:
        node, client, other = h.peer(1), h.peer(2), h.peer(3)

        def public_key(peer: Peer) -> bytes:
            return peer.key.public_key().public_bytes_raw()

        refused = await node.register()
        assert refused.error.code == Code.REFUSED and refused.error.work_bits == 12, refused.error
        assert "a new identity needs a proof of work of 12 bits" in refused.error.message
        assert (await node.register(work=solve_work(public_key(other), 12))).error.work_bits == 12  # another key's
        assert (await node.register(work=solve_work(public_key(node), 12))).WhichOneof("body") == "register"
        assert (await node.register()).WhichOneof("body") == "register"  # a known identity: no work again

        hello = adm.make_client_hello(client.key, now_ms(), b"\x01" * 16)
        refused = await client.call(client_hello=hello)
        assert refused.error.code == Code.REFUSED and refused.error.work_bits == 12
        hello = adm.make_client_hello(client.key, now_ms(), b"\x02" * 16)
        hello.work = solve_work(public_key(client), 12)
        assert (await client.call(client_hello=hello)).WhichOneof("body") == "client_hello"
        renewal = adm.make_client_hello(client.key, now_ms(), b"\x03" * 16)
        assert (await client.call(client_hello=renewal)).WhichOneof("body") == "client_hello"


async def test_a_new_identity_needs_an_invite_where_the_tracker_asks(autojump_clock, db_path):
    config = dataclasses.replace(CONFIG, require_invites=True)
    async with running_tracker(db_path, config=config) as h:
        node, client, third = h.peer(1), h.peer(2), h.peer(3)
        refused = await node.register()
        assert refused.error.code == Code.REFUSED and "only with an invite" in refused.error.message
        token = new_invite(b"\x07" * 32)
        h.store.add_invite(invite_sha256(token), 2, now_ms() + 3_600_000, "alice", now_ms())
        forged = token[:-1] + ("A" if token[-1] != "A" else "B")
        assert "not one this tracker made" in (await node.register(invite=forged)).error.message
        assert "not a Baton invite" in (await node.register(invite="x" * 100_000)).error.message
        # refused for another reason: the invite keeps its use
        wrong_pin = await node.register(invite=token, llama_cpp_commit="0" * 40)
        assert wrong_pin.error.code == Code.REFUSED and "pin" in wrong_pin.error.message, wrong_pin.error
        assert h.store.invite(invite_sha256(token)).uses_left == 2
        assert (await node.register(invite=token)).WhichOneof("body") == "register"
        assert (await node.register()).WhichOneof("body") == "register"  # a known identity: none again
        hello = adm.make_client_hello(client.key, now_ms(), b"\x01" * 16)
        hello.invite = token
        assert (await client.call(client_hello=hello)).WhichOneof("body") == "client_hello"
        assert h.store.invite(invite_sha256(token)).uses_left == 0
        assert "used up" in (await third.register(invite=token)).error.message
        soon = new_invite(b"\x08" * 32)
        h.store.add_invite(invite_sha256(soon), 1, now_ms() + 1_000, "", now_ms())
        await trio.sleep(2)
        assert "expired" in (await third.register(invite=soon)).error.message


def test_invites_are_made_and_listed_by_the_cli_and_only_their_hash_is_kept(tmp_path, capsys):
    from agent.cli import main as baton

    db = tmp_path / "tracker.db"
    assert baton(["tracker", "invite", "--db", str(db), "--uses", "3", "--note", "bob's laptop"]) == 0
    token = capsys.readouterr().out.strip()
    assert token.startswith("baton-invite-") and len(token) > 50
    with open_store(db) as store:
        assert store.invite(invite_sha256(token)) is not None and store.invite(token) is None
        assert not any(token in str(row) for row in store.invites())
    assert token.encode() not in db.read_bytes()
    assert baton(["tracker", "invites", "--db", str(db)]) == 0
    listing = capsys.readouterr().out
    assert invite_sha256(token)[:12] in listing and "bob's laptop" in listing and " 3 " in listing
    assert baton(["tracker", "invite", "--db", str(db), "--note", "\x1b[2J"]) == 2
    assert "--note must be printable" in capsys.readouterr().err


async def test_only_admitted_live_nodes_may_use_the_relay(autojump_clock, db_path):
    config = dataclasses.replace(CONFIG, admission_ttl_ms=20_000)
    async with running_tracker(db_path, config=config) as h:
        tracker, node, client, stranger = h.tracker, h.peer(1), h.peer(2), h.peer(3)
        await node.register()
        hello = adm.make_client_hello(client.key, now_ms(), b"\x01" * 16)
        assert (await client.call(client_hello=hello)).WhichOneof("body") == "client_hello"
        assert tracker.may_hold_relay_reservation(node.peer_id) and tracker.may_open_relay_circuit(node.peer_id)
        # a client may open circuits but not be reached through the relay; a stranger neither
        assert not tracker.may_hold_relay_reservation(client.peer_id) and tracker.may_open_relay_circuit(client.peer_id)
        assert not tracker.may_hold_relay_reservation(stranger.peer_id)
        assert not tracker.may_open_relay_circuit(stranger.peer_id)
        # a node that missed its heartbeats loses the right, and gets it back with a heartbeat
        await tracker.wait_until(lambda: node.peer_id not in tracker.alive)
        assert not tracker.may_hold_relay_reservation(node.peer_id) and not tracker.may_open_relay_circuit(node.peer_id)
        assert (await node.heartbeat()).WhichOneof("body") == "heartbeat"
        assert tracker.may_hold_relay_reservation(node.peer_id)
        # an expired client admission counts for nothing
        await trio.sleep(20)
        assert not tracker.may_open_relay_circuit(client.peer_id)


def _tampered(node: Peer) -> swarm_pb2.SignedFingerprint:
    signed = adm.sign_fingerprint(node.key, node.fingerprint())
    signed.fingerprint = node.fingerprint(usable_memory_bytes=10**12).SerializeToString()
    return signed


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("tampered", "bad signature"),
        ("other_peer", "peer id mismatch"),
        ("schema", "unsupported fingerprint schema"),
        ("pin", "wrong llama.cpp pin"),
        ("patch", "wrong patch series"),
        ("stale", "stale registration"),
        ("future", "stale registration"),
        ("replay", "replayed registration"),
        ("memory", "too little memory"),
        ("backend", "no usable backend"),
    ],
)
async def test_refusals_carry_the_reason(autojump_clock, db_path, case, reason):
    async with running_tracker(db_path) as h:
        node = h.peer(1)
        overrides = {
            "schema": {"schema_version": 7},
            "pin": {"llama_cpp_commit": "f" * 40},
            "patch": {"patch_series_sha256": "0" * 64},
            "stale": {"created_at_ms": now_ms() - 60_001},
            "future": {"created_at_ms": now_ms() + 60_001},
            "memory": {"usable_memory_bytes": BPB - 1},
            "backend": {"devices": []},
        }.get(case, {})
        if case == "tampered":
            reply = await node.call(register=swarm_pb2.RegisterRequest(fingerprint=_tampered(node)))
        elif case == "other_peer":
            signed = adm.sign_fingerprint(node.key, node.fingerprint())
            reply = await h.peer(2).call(register=swarm_pb2.RegisterRequest(fingerprint=signed))
        elif case == "replay":
            signed = adm.sign_fingerprint(node.key, node.fingerprint())
            first = await node.call(register=swarm_pb2.RegisterRequest(fingerprint=signed))
            assert first.WhichOneof("body") == "register"
            reply = await node.call(register=swarm_pb2.RegisterRequest(fingerprint=signed))
        else:
            reply = await node.register(**overrides)
        assert reply.WhichOneof("body") is None
        assert reply.error.code == Code.REFUSED
        assert reply.error.message.startswith(reason + ":"), reply.error.message
        if case != "replay":
            assert h.store.node(node.peer_id) is None
            assert h.store.assignments() == []


async def test_memory_check_uses_the_smallest_registered_model(autojump_clock, db_path):
    small = swarm_pb2.ModelEntry(sha256="bb" * 32, alias="small", name="Small", n_layer=2, bytes_per_block=BPB // 10)
    async with running_tracker(db_path, models=(MODEL, small)) as h:
        reply = await h.peer(1).register(usable_memory_bytes=BPB // 10, model_sha256s=[small.sha256])
        assert reply.WhichOneof("body") == "register", reply.error


# --- malformed input ----------------------------------------------------------------------------


async def test_malformed_requests_get_error_replies_and_the_tracker_keeps_serving(autojump_clock, db_path):
    async with running_tracker(db_path) as h:
        node, other = h.peer(1), h.peer(2)
        cases = [
            (await node.raw(b"\xff\xff\xff\xff"), Code.INVALID_ARGUMENT, "malformed TrackerRequest"),
            (await node.raw(b""), Code.INVALID_ARGUMENT, "schema_version 0 is not supported (this peer speaks 1)"),
            (
                await node.raw(swarm_pb2.TrackerRequest(schema_version=2, list_models={}).SerializeToString()),
                Code.INVALID_ARGUMENT,
                "schema_version 2 is not supported (this peer speaks 1)",
            ),
            (await node.call(), Code.INVALID_ARGUMENT, "TrackerRequest has no body"),
            (await node.call(register=swarm_pb2.RegisterRequest()), Code.INVALID_ARGUMENT, "no fingerprint"),
            (await node.heartbeat(), Code.NOT_FOUND, "unknown node: register first"),
            (
                await other.call(heartbeat=swarm_pb2.HeartbeatRequest(peer_id=node.peer_id)),
                Code.REFUSED,
                "peer id mismatch",
            ),
            (
                await node.call(route=swarm_pb2.RouteRequest(model="")),
                Code.INVALID_ARGUMENT,
                "RouteRequest.model is empty",
            ),
            (await node.call(route=swarm_pb2.RouteRequest(model="nope")), Code.NOT_FOUND, "unknown model 'nope'"),
            (
                await node.call(client_hello=swarm_pb2.ClientHelloRequest()),
                Code.REFUSED,
                "bad signature: public_key has 0 bytes",
            ),
        ]
        assert (await node.register()).WhichOneof("body") == "register"
        cases += [
            (await node.heartbeat(serving=[(4, 4)]), Code.INVALID_ARGUMENT, "serving[0]: assignment"),
            (await node.heartbeat(serving=[(0, 6)], state=0), Code.INVALID_ARGUMENT, "serving[0]: state 0"),
        ]
        for reply, code, text in cases:
            assert reply.WhichOneof("body") is None
            assert reply.error.code == code, (reply.error, text)
            assert text in reply.error.message, (reply.error.message, text)
        listed = await node.call(list_models=swarm_pb2.ListModelsRequest())
        assert list(listed.list_models.models) == [MODEL]


async def test_an_internal_error_is_answered_not_raised(autojump_clock, db_path, monkeypatch):
    async with running_tracker(db_path) as h:

        def broken():
            raise RuntimeError("disk on fire")

        monkeypatch.setattr(h.store, "models", broken)
        reply = await h.peer(1).call(list_models=swarm_pb2.ListModelsRequest())
        assert reply.error.code == Code.INTERNAL and "disk on fire" in reply.error.message
        monkeypatch.undo()
        assert list((await h.peer(1).call(list_models={})).list_models.models) == [MODEL]


# --- liveness, healing, refresh -----------------------------------------------------------------


async def _beat_forever(node: Peer, serving, interval_s: float = 1.0, replies=None) -> None:
    while True:
        reply = await node.heartbeat(serving=serving())
        if replies is not None:
            replies.append(reply)
        await trio.sleep(interval_s)


async def test_heartbeat_timeout_marks_dead_at_exactly_the_timeout_and_heals(autojump_clock, db_path):
    async with running_tracker(db_path) as h:
        a, b = h.peer(1), h.peer(2)
        # B alone cannot hold the model (nothing assigned); with A the two split it 3 / 3.
        assert (await b.register(usable_memory_bytes=3 * BPB)).WhichOneof("body") == "register"
        assert h.store.assignments() == []
        assert (await a.register(usable_memory_bytes=6 * BPB)).WhichOneof("body") == "register"
        ranges = {row.assignment.peer_id: (row.assignment.begin, row.assignment.end) for row in h.store.assignments()}
        assert sorted(ranges.values()) == [(0, 3), (3, 6)] and set(ranges) == {a.peer_id, b.peer_id}
        range_a, range_b = ranges[a.peer_id], ranges[b.peer_id]

        h.nursery.start_soon(_beat_forever, a, lambda: [range_a])
        assert ranges_of((await b.heartbeat()).heartbeat.directives) == [range_b]
        last_b = trio.current_time()

        await trio.sleep_until(last_b + 4.999)
        assert b.peer_id in h.tracker.alive
        await h.tracker.wait_until(lambda: b.peer_id not in h.tracker.alive)
        assert trio.current_time() == pytest.approx(last_b + 5.0, abs=1e-9)
        assert not h.store.node(b.peer_id).alive
        # A keeps its range and takes over B's (it has room); B has nothing any more.
        assert [(r.assignment.peer_id, r.assignment.begin, r.assignment.end) for r in h.store.assignments()] == [
            (a.peer_id, 0, 3), (a.peer_id, 3, 6)
        ]  # fmt: skip
        beat = await a.heartbeat(serving=[range_a])
        assert ranges_of(beat.heartbeat.directives) == [range_b]
        # B comes back without re-registering: alive again, assignments recomputed (it keeps nothing).
        beat = await b.heartbeat()
        assert beat.WhichOneof("body") == "heartbeat" and b.peer_id in h.tracker.alive


async def test_admission_is_refreshed_when_half_its_ttl_is_left(autojump_clock, db_path):
    config = dataclasses.replace(CONFIG, admission_ttl_ms=8000)
    async with running_tracker(db_path, config=config) as h:
        node = h.peer(1)
        reg = (await node.register()).register
        refreshed_at = None
        for second in range(1, 7):
            await trio.sleep(1)
            beat = (await node.heartbeat(serving=[(0, 6)])).heartbeat
            if beat.HasField("admission"):
                refreshed_at = second
                record = adm.verify_admission(beat.admission, reg.tracker_public_key, node.peer_id, now_ms())
                assert record.expires_at_ms == now_ms() + 8000
                break
        assert refreshed_at == 5  # 3000 ms left < 4000 ms; at 4 s exactly 4000 ms were left
        assert h.store.node(node.peer_id).expires_at_ms == now_ms() + 8000


async def test_expired_admission_must_register_again(autojump_clock, db_path):
    config = dataclasses.replace(CONFIG, admission_ttl_ms=3000, heartbeat_timeout_ms=5000)
    async with running_tracker(db_path, config=config) as h:
        node = h.peer(1)
        await node.register()
        await trio.sleep(3)
        reply = await node.heartbeat()
        assert reply.error.code == Code.NOT_FOUND and "admission expired" in reply.error.message


async def test_a_range_that_failed_to_load_is_moved_elsewhere(autojump_clock, db_path):
    async with running_tracker(db_path) as h:
        a, b = h.peer(1), h.peer(2)
        await a.register(usable_memory_bytes=6 * BPB)
        await b.register(usable_memory_bytes=6 * BPB)
        assert sorted(r.assignment.peer_id for r in h.store.assignments()) == sorted([a.peer_id, b.peer_id])
        beat = await a.heartbeat(serving=[(0, 6)], state=swarm_pb2.AssignmentStatus.FAILED)
        assert ranges_of(beat.heartbeat.directives, swarm_pb2.Directive.UNLOAD) == [(0, 6)]
        assert [r.assignment.peer_id for r in h.store.assignments()] == [b.peer_id]
        # registering anew (e.g. after fixing the node) gives it another chance
        await a.register(usable_memory_bytes=6 * BPB)
        assert sorted(r.assignment.peer_id for r in h.store.assignments()) == sorted([a.peer_id, b.peer_id])


# --- output integrity ---------------------------------------------------------------------------


def _outcome(node: Peer, begin: int, end: int, status: str, step: int = 1):
    from agent.core.tracker.canary import OutputMismatch
    from agent.io.tracker.verifier_api import CheckOutcome

    mismatch = OutputMismatch(step, "boundary rows", "e" * 64, "f" * 64, 0.5, "rows 0 of 4 differ")
    return CheckOutcome(
        (node.peer_id, MODEL.sha256, begin, end), f"canary-{begin}{end}", status,
        mismatch=mismatch if status == "failed" else None,
    )  # fmt: skip


async def test_check_outcomes_gate_withdraw_and_refuse_nodes(autojump_clock, db_path, capsys):
    """What the tracker does with its verifier's outcomes (the verifier itself is
    tests/test_canary.py): a READY range is routed only once it passed; a failed check
    withdraws it at once (unassigned, unloaded, shown with its evidence, named to owners);
    the second failure refuses the node, also after a restart."""
    from agent.cli import main as baton
    from agent.core.tracker.canary import CanaryPolicy

    # the verifier finds no file for MODEL: its own checks are inconclusive, retried never
    config = dataclasses.replace(CONFIG, canary=CanaryPolicy(interval_s=1000.0, retry_s=1e6, refuse_after_failures=2))
    async with running_tracker(db_path, config=config) as h:
        a, b = h.peer(1), h.peer(2)
        await a.register(usable_memory_bytes=3 * BPB)
        await b.register(usable_memory_bytes=3 * BPB)
        first = {row.assignment.begin: row.assignment.peer_id for row in h.store.assignments()}[0]
        a, b = (a, b) if first == a.peer_id else (b, a)  # a serves [0, 3), b [3, 6)
        await a.heartbeat(serving=[(0, 3)])
        await b.heartbeat(serving=[(3, 6)])
        client = h.peer(3)
        assert (await client.call(client_hello=adm.make_client_hello(client.key, now_ms(), b"\x01" * 16))).client_hello
        with trio.fail_after(5):
            await h.tracker.wait_until(lambda: h.tracker.verifier_stats.inconclusive == 2)
        gated = await client.call(route={"model": "tiny"})
        assert gated.error.code == Code.UNAVAILABLE  # READY, not yet checked
        listed = {n.peer_id: n for n in (await client.call(list_nodes={})).list_nodes.nodes}
        assert listed[a.peer_id].serving[0].awaiting_check and listed[b.peer_id].serving[0].awaiting_check

        h.tracker.record_check(_outcome(a, 0, 3, "passed"))
        h.tracker.record_check(_outcome(b, 3, 6, "passed"))
        route = await client.call(route={"model": "tiny"})
        assert [hop.peer_id for hop in route.route.hops] == [a.peer_id, b.peer_id]
        listed = {n.peer_id: n for n in (await client.call(list_nodes={})).list_nodes.nodes}
        assert not listed[a.peer_id].serving[0].awaiting_check and listed[a.peer_id].checks_passed == 1
        nobody = await client.call(integrity={"peer_ids": [a.peer_id, b.peer_id]})
        assert list(nobody.integrity.withdrawn) == []

        # b's output fails a check: out of routes and assignments at once, told to unload
        h.tracker.record_check(_outcome(b, 3, 6, "failed", step=2))
        assert (await client.call(route={"model": "tiny"})).error.code == Code.UNAVAILABLE
        assert all(row.assignment.peer_id != b.peer_id for row in h.store.assignments())
        beat = await b.heartbeat(serving=[(3, 6)])
        assert ranges_of(beat.heartbeat.directives, swarm_pb2.Directive.UNLOAD) == [(3, 6)]
        (failure,) = {n.peer_id: n for n in (await client.call(list_nodes={})).list_nodes.nodes}[
            b.peer_id
        ].integrity_failures
        assert (failure.check_id, failure.step, failure.expected_sha256, failure.returned_sha256) == (
            "canary-36", 2, "e" * 64, "f" * 64,
        )  # fmt: skip
        told = await client.call(integrity={"peer_ids": [a.peer_id, b.peer_id, b.peer_id]})
        assert [(w.peer_id, w.reason) for w in told.integrity.withdrawn] == [
            (b.peer_id, "failed canary-36 (blocks [3, 6), step 2)")
        ]
        too_many = await client.call(integrity={"peer_ids": [str(i) for i in range(65)]})
        assert too_many.error.code == Code.INVALID_ARGUMENT

        # an owner's spot check disagreed on a route through a and another: a is checked next
        report = swarm_pb2.ReportMismatchRequest(
            model_sha256=MODEL.sha256, route=[swarm_pb2.Hop(peer_id=a.peer_id)], shadow=[swarm_pb2.Hop(peer_id="x")]
        )
        assert (await client.call(report_mismatch=report)).report_mismatch.checks_scheduled == 1
        stranger = await h.peer(4).call(report_mismatch=report)
        assert stranger.error.code == Code.REFUSED and "only an admitted session owner" in stranger.error.message

        # registering anew, b is assigned again and gated; passing its check clears it for owners
        await b.register(usable_memory_bytes=3 * BPB)
        await b.heartbeat(serving=[(3, 6)])
        await trio.sleep(0.01)
        h.tracker.record_check(_outcome(b, 3, 6, "passed"))
        assert list((await client.call(integrity={"peer_ids": [b.peer_id]})).integrity.withdrawn) == []
        # and it turns bad again: a second failure refuses it
        await b.register(usable_memory_bytes=3 * BPB)
        assert any(row.assignment.peer_id == b.peer_id for row in h.store.assignments())
        await b.heartbeat(serving=[(3, 6)])
        assert (await client.call(route={"model": "tiny"})).error.code == Code.UNAVAILABLE  # gated again
        h.tracker.record_check(_outcome(b, 3, 6, "failed"))
        assert b.peer_id not in h.tracker.alive
        assert (await b.heartbeat(serving=[(3, 6)])).error.code == Code.NOT_FOUND  # -> it registers again
        refused = await b.register(usable_memory_bytes=3 * BPB)
        assert refused.error.code == Code.REFUSED and "failed 2 integrity checks" in refused.error.message
    async with running_tracker(db_path, net=h.net, config=config) as h:  # restarted: b stays refused
        assert (await b.register(usable_memory_bytes=3 * BPB)).error.code == Code.REFUSED
    assert baton(["tracker", "nodes", "--db", str(db_path)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith(b.peer_id))
    assert "REFUSED (2 failed)" in row
    evidence = [line for line in out.splitlines() if line.startswith(f"  {b.peer_id} INTEGRITY")]
    assert len(evidence) == 2 and f"expected sha256 {'e' * 64}, returned {'f' * 64}" in evidence[0]
    assert "tiny[3, 6) step 2" in evidence[0] and "(rows 0 of 4 differ)" in evidence[0]
    assert f"  {b.peer_id} REFUSED: refused: the output of this node failed 2 integrity checks" in out
    assert baton(["tracker", "nodes", "--db", str(db_path), "--json"]) == 0
    nodes = {n["peer_id"]: n for n in json.loads(capsys.readouterr().out)["nodes"]}
    assert nodes[a.peer_id]["checks_passed"] == 1 and nodes[a.peer_id]["integrity_failures"] == []
    assert [f["check_id"] for f in nodes[b.peer_id]["integrity_failures"]] == ["canary-36", "canary-36"]
    assert nodes[b.peer_id]["refused"].startswith("refused: the output of this node failed 2")


# --- routes ---------------------------------------------------------------------------------------


async def test_route_once_nodes_report_ready(autojump_clock, db_path):
    async with running_tracker(db_path) as h:
        a, b = h.peer(1), h.peer(2)
        await a.register(usable_memory_bytes=3 * BPB)
        await b.register(usable_memory_bytes=3 * BPB)
        client = h.peer(3)
        reply = await client.call(route=swarm_pb2.RouteRequest(model="tiny"))
        assert reply.error.code == Code.UNAVAILABLE
        assert reply.error.message == "no route for model tiny: blocks [0, 6) have no ready node"
        by_begin = {row.assignment.begin: row.assignment for row in h.store.assignments()}
        first, second = ({a.peer_id: a, b.peer_id: b}[by_begin[begin].peer_id] for begin in (0, 3))
        assert (by_begin[0].end, by_begin[3].end) == (3, 6) and first is not second
        await first.heartbeat(serving=[(0, 3)])
        await second.heartbeat(serving=[(3, 6)], state=LOADING)
        reply = await client.call(route=swarm_pb2.RouteRequest(model="tiny"))
        assert reply.error.message == "no route for model tiny: blocks [3, 6) have no ready node"
        await second.heartbeat(serving=[(3, 6)])
        for name in ("tiny", "Tiny Model", MODEL.sha256):
            reply = await client.call(route=swarm_pb2.RouteRequest(model=name))
            assert reply.WhichOneof("body") == "route", reply.error
            route = reply.route
            assert [(hop.peer_id, hop.begin, hop.end) for hop in route.hops] == [
                (first.peer_id, 0, 3), (second.peer_id, 3, 6)
            ]  # fmt: skip
            assert list(route.hops[0].addrs) == [f"/memory/{first.peer_id}"]
            assert (route.model_sha256, route.n_layer, route.recipe_hash) == (MODEL.sha256, 6, "recipe-1")
            assert route.estimated_step_s == pytest.approx(6 * 0.001 + 2 * 0.002)
        # a node that restarts (reports nothing loaded) drops out of routes
        await second.heartbeat(serving=[])
        reply = await client.call(route=swarm_pb2.RouteRequest(model="tiny"))
        assert reply.error.code == Code.UNAVAILABLE


async def test_routes_pack_onto_one_copy_until_it_is_full_and_follow_live_sessions(autojump_clock, db_path):
    """Sessions share a route (they merge into one Forward at every hop) while its ranges have
    free sequences, counted from the nodes' own heartbeats plus the routes handed out since;
    a second copy takes sessions once the first is full; ends show in the next heartbeat, also
    after a tracker restart."""
    net = MemoryNetwork()
    async with running_tracker(db_path, net=net) as h:
        nodes = [h.peer(i) for i in (1, 2)]
        for n in nodes:
            await n.register()
        assert [(r.assignment.begin, r.assignment.end) for r in h.store.assignments()] == [(0, 6), (0, 6)]
        for n in nodes:
            await n.heartbeat(serving=[(0, 6)], total=2)
        client = h.peer(3)

        async def route_to() -> str:
            return (await client.call(route={"model": "tiny"})).route.hops[0].peer_id

        first = await route_to()
        # not yet in its heartbeat, the session handed out counts: the next goes with it
        assert await route_to() == first
        # its two sequences are taken now: the other copy opens
        (busy,) = [n for n in nodes if n.peer_id == first]
        (spare,) = [n for n in nodes if n.peer_id != first]
        await trio.sleep(h.config.route_handout_grace_s)
        await busy.heartbeat(serving=[(0, 6)], in_use=2, total=2)
        assert await route_to() == spare.peer_id
        # both sessions ended: the busy copy's heartbeat says so, and it packs again ...
        await trio.sleep(h.config.route_handout_grace_s)
        await busy.heartbeat(serving=[(0, 6)], in_use=1, total=2)
        await spare.heartbeat(serving=[(0, 6)], in_use=1, total=2)
        chosen = await route_to()
        assert chosen in (busy.peer_id, spare.peer_id)
    # ... and a restarted tracker routes by what the nodes report in their next heartbeats
    async with running_tracker(db_path, net=net, models=()) as h:
        for n in nodes:
            await n.heartbeat(serving=[(0, 6)], in_use=2 if n is busy else 1, total=2)
        assert (await client.call(route={"model": "tiny"})).route.hops[0].peer_id == spare.peer_id


async def test_an_owner_ending_its_session_frees_its_route_at_once(autojump_clock, db_path):
    """A route handed out counts on its hops until they report it, unless its owner reports
    the session ended first (only its owner may): a short generation between two heartbeats
    does not keep its route looking full."""
    async with running_tracker(db_path) as h:
        nodes = [h.peer(i) for i in (1, 2)]
        for n in nodes:
            await n.register()
            await n.heartbeat(serving=[(0, 6)], total=1)  # one sequence each
        owner, other = h.peer(3), h.peer(4)
        first = (await owner.call(route={"model": "tiny"})).route
        assert first.handout_id and first.hops[0].peer_id == min(n.peer_id for n in nodes)
        assert (await other.call(session_ended={"handout_ids": [first.handout_id]})).session_ended.counted == 0
        assert (await owner.call(session_ended={"handout_ids": [first.handout_id]})).session_ended.counted == 1
        assert (await owner.call(session_ended={"handout_ids": [first.handout_id]})).session_ended.counted == 0
        again = (await owner.call(route={"model": "tiny"})).route  # its copy is free again: no heartbeat needed
        assert again.hops[0].peer_id == first.hops[0].peer_id and again.handout_id != first.handout_id
        busy = (await owner.call(route={"model": "tiny"})).route  # not ended: that copy is full now
        assert busy.hops[0].peer_id != first.hops[0].peer_id


async def test_a_lost_peer_that_does_not_answer_a_probe_leaves_routes_at_once(autojump_clock, db_path):
    async with running_tracker(db_path) as h:
        nodes = [h.peer(i) for i in (1, 2)]
        for n in nodes:
            await n.register()
            await n.heartbeat(serving=[(0, 6)])
            # a live node answers the probe (a NodeRequest without a body) with an error
            n.transport.set_handler(NODE_PROTOCOL, _answer_node_probe)
        client = h.peer(3)
        alive, dead = nodes
        route = await client.call(route={"model": "tiny", "avoid_peers": [dead.peer_id]})
        assert [hop.peer_id for hop in route.route.hops] == [alive.peer_id]  # planned around it
        reply = await client.call(report_lost_peer={"peer_id": alive.peer_id, "reason": "reset"})
        assert reply.report_lost_peer.confirmed is False  # it answers: a report alone removes nobody
        assert alive.peer_id in h.tracker.alive
        h.net.down.add(dead.peer_id)
        started = trio.current_time()
        reply = await client.call(report_lost_peer={"peer_id": dead.peer_id, "reason": "connection refused"})
        assert reply.report_lost_peer.confirmed is True
        assert trio.current_time() - started < 1.0  # not the 5 s heartbeat timeout
        assert dead.peer_id not in h.tracker.alive
        for _ in range(3):
            route = await client.call(route={"model": "tiny"})
            assert [hop.peer_id for hop in route.route.hops] == [alive.peer_id]
        both = await client.call(route={"model": "tiny", "avoid_peers": [alive.peer_id]})
        assert both.error.code == Code.UNAVAILABLE and f"without {alive.peer_id}" in both.error.message
        empty = await client.call(report_lost_peer={"peer_id": ""})
        assert empty.error.code == Code.INVALID_ARGUMENT


async def _answer_node_probe(_remote: str, _payload: bytes) -> bytes:
    return swarm_pb2.NodeReply(
        schema_version=1, error=swarm_pb2.Error(code=Code.INVALID_ARGUMENT, message="the NodeRequest has no body")
    ).SerializeToString()


# --- restart ----------------------------------------------------------------------------------------


async def test_restart_keeps_nodes_models_and_assignments(autojump_clock, db_path):
    net = MemoryNetwork()
    async with running_tracker(db_path, net=net) as h:
        a, b, c = sorted((h.peer(i) for i in (1, 2, 3)), key=lambda p: p.peer_id)  # ranges go in peer id order
        for n in (a, b, c):
            await n.register(usable_memory_bytes=2 * BPB)
        before_assignments = h.store.assignments()
        assert [(r.assignment.peer_id, r.assignment.begin) for r in before_assignments] == [
            (a.peer_id, 0), (b.peer_id, 2), (c.peer_id, 4)
        ]  # fmt: skip
        hello_nonce = b"\x09" * 16
        assert (await a.call(client_hello=adm.make_client_hello(a.key, now_ms(), hello_nonce))).WhichOneof("body")
        used = adm.sign_fingerprint(a.key, a.fingerprint(usable_memory_bytes=2 * BPB))
        await a.call(register=swarm_pb2.RegisterRequest(fingerprint=used))
        before_nodes = h.store.nodes()
        before_assignments = h.store.assignments()

    # the tracker is down a second; everything comes back from the file
    await trio.sleep(1)
    async with running_tracker(db_path, net=net, models=()) as h:
        assert h.store.nodes() == before_nodes
        assert [m for m in h.store.models()] == [MODEL]
        assert [r.assignment for r in h.store.assignments()] == [r.assignment for r in before_assignments]
        assert h.tracker.pending == {a.peer_id, b.peer_id, c.peer_id} and h.tracker.alive == set()
        listed = (await a.call(list_nodes={})).list_nodes.nodes
        assert [(n.peer_id, n.alive, n.pending) for n in listed] == [(p.peer_id, False, True) for p in (a, b, c)]
        # seen nonces survive: a replay is still refused
        reply = await a.call(register=swarm_pb2.RegisterRequest(fingerprint=used))
        assert reply.error.message.startswith("replayed registration")
        # no route until the nodes heartbeat again, even though their ranges were READY
        reply = await a.call(route={"model": "tiny"})
        assert reply.error.code == Code.UNAVAILABLE
        # the first node to come back does not take over the others' ranges
        beat = await a.heartbeat(serving=[(0, 2)])
        assert ranges_of(beat.heartbeat.directives) == []
        await b.heartbeat(serving=[(2, 4)])
        await c.heartbeat(serving=[(4, 6)])
        route = (await a.call(route={"model": "tiny"})).route
        assert [(hop.peer_id, hop.begin, hop.end) for hop in route.hops] == [
            (a.peer_id, 0, 2), (b.peer_id, 2, 4), (c.peer_id, 4, 6)
        ]  # fmt: skip
        assert [r.assignment for r in h.store.assignments()] == [r.assignment for r in before_assignments]


async def test_a_pending_node_that_never_returns_is_marked_dead(autojump_clock, db_path):
    net = MemoryNetwork()
    async with running_tracker(db_path, net=net) as h:
        a, b = h.peer(1), h.peer(2)
        await a.register(usable_memory_bytes=6 * BPB)
        await b.register(usable_memory_bytes=6 * BPB)
        assert len(h.store.assignments()) == 2  # two copies
    async with running_tracker(db_path, net=net, models=()) as h:
        restarted = trio.current_time()
        h.nursery.start_soon(_beat_forever, a, lambda: [(0, 6)])
        await h.tracker.wait_until(lambda: b.peer_id not in h.tracker.pending)
        assert trio.current_time() == pytest.approx(restarted + 5.0, abs=1e-9)
        assert h.tracker.alive == {a.peer_id}
        assert [r.assignment.peer_id for r in h.store.assignments()] == [a.peer_id]


# --- model metadata ---------------------------------------------------------------------------------
# These run on trio's real clock: the tracker reads the file in a thread, and an autojumping
# MockClock would jump past the request's timeout while the thread works.


@pytest.fixture(scope="module")
def qwen2_tiny_prefix(qwen2_tiny_path) -> bytes:
    return gguf_metadata_prefix(qwen2_tiny_path)  # seconds: the reader parses every vocab string


async def test_model_metadata_is_the_registered_files_prefix(db_path, qwen2_tiny_path, qwen2_tiny_prefix, monkeypatch):
    async with running_tracker(db_path, gguf_files=[(qwen2_tiny_path, "qwen2-tiny")]) as h:
        client = h.peer(3)
        entry = h.store.find_model("qwen2-tiny")
        prefix = qwen2_tiny_prefix
        for name in ("qwen2-tiny", entry.name, entry.sha256):
            reply = await client.call(model_metadata=swarm_pb2.ModelMetadataRequest(model=name))
            assert reply.WhichOneof("body") == "model_metadata", reply.error
            meta = reply.model_metadata
            assert meta.metadata == prefix and meta.metadata.startswith(b"GGUF")
            assert (meta.model_sha256, meta.alias) == (entry.sha256, "qwen2-tiny")
            assert meta.name == "baton qwen2-tiny (synthetic)"
            assert (meta.architecture, meta.n_layer) == ("qwen2", 6)
            assert meta.size_bytes == qwen2_tiny_path.stat().st_size
            assert meta.context_length == 2048  # what agent.testing.synthetic writes
        assert entry.context_length == 2048  # the registry records it too (list_models)

        # read once: later requests are answered from memory
        def unreadable(*args):
            raise OSError("the disk is gone")

        monkeypatch.setattr("agent.io.tracker.model_files.read_registered_file", unreadable)
        reply = await client.call(model_metadata={"model": "qwen2-tiny"})
        assert reply.model_metadata.metadata == prefix

        for request, code, text in [
            ({"model": "nope"}, Code.NOT_FOUND, "unknown model 'nope'"),
            ({"model": ""}, Code.INVALID_ARGUMENT, "ModelMetadataRequest.model is empty"),
            # registered without a file (as by a tracker that did not record paths)
            ({"model": "tiny"}, Code.UNAVAILABLE, "model tiny (aaaaaaaaaaaa) has no registered file"),
        ]:
            reply = await client.call(model_metadata=request)
            assert reply.WhichOneof("body") is None
            assert reply.error.code == code and text in reply.error.message, reply.error


async def test_model_metadata_is_unavailable_while_the_file_cannot_be_read(
    db_path, tmp_path, qwen2_tiny_path, qwen2_tiny_prefix
):
    path = tmp_path / "models" / "tiny-copy.gguf"
    path.parent.mkdir()
    shutil.copyfile(qwen2_tiny_path, path)
    async with running_tracker(db_path, models=(), gguf_files=[(path, "copy")]) as h:
        client = h.peer(3)
        moved = path.rename(tmp_path / "elsewhere.gguf")
        reply = await client.call(model_metadata={"model": "copy"})
        assert reply.error.code == Code.UNAVAILABLE, reply
        message = reply.error.message
        assert message.startswith("the registered file of model copy cannot be read any more: ")
        assert "No such file" in message and "tiny-copy.gguf" in message
        assert str(tmp_path) not in message  # the tracker's directories are not sent to peers
        # another file in its place
        with open(path, "wb") as f:
            data = moved.read_bytes()
            f.write(data[:-1] + bytes([data[-1] ^ 0x01]))  # the last byte flipped: always another file
        reply = await client.call(model_metadata={"model": "copy"})
        assert reply.error.code == Code.UNAVAILABLE and "the file changed" in reply.error.message, reply.error
        # a failure is not remembered: once the file is back, the metadata is served
        moved.replace(path)
        reply = await client.call(model_metadata={"model": "copy"})
        assert reply.model_metadata.metadata == qwen2_tiny_prefix


# --- node list ----------------------------------------------------------------------------------------


def _ranges(entries) -> list[tuple[int, int, int, str]]:
    return [(s.assignment.begin, s.assignment.end, s.state, s.error) for s in entries]


async def test_list_nodes_shows_assignments_reported_states_and_liveness(autojump_clock, db_path, capsys):
    async with running_tracker(db_path) as h:
        a, b = sorted((h.peer(i) for i in (1, 2)), key=lambda p: p.peer_id)  # ranges go in peer id order
        await a.register(usable_memory_bytes=3 * BPB)
        await b.register(usable_memory_bytes=3 * BPB)
        registered_at = now_ms()
        await trio.sleep(1)
        await a.heartbeat(serving=[(0, 3)])
        b_heard_at = now_ms()
        await b.heartbeat(serving=[(3, 6)], state=LOADING)
        listed = await h.peer(3).call(list_nodes=swarm_pb2.ListNodesRequest())
        assert listed.WhichOneof("body") == "list_nodes", listed.error
        by_peer = {n.peer_id: n for n in listed.list_nodes.nodes}
        assert list(by_peer) == [a.peer_id, b.peer_id]
        na, nb = by_peer[a.peer_id], by_peer[b.peer_id]
        assert (na.alive, na.pending, nb.alive, nb.pending) == (True, False, True, False)
        assert list(na.listen_addrs) == [f"/memory/{a.peer_id}"] and na.usable_memory_bytes == 3 * BPB
        assert na.last_heartbeat_ms == nb.last_heartbeat_ms == b_heard_at == registered_at + 1000
        assert [(x.model_sha256, x.begin, x.end) for x in na.assigned] == [(MODEL.sha256, 0, 3)]
        assert [(x.begin, x.end) for x in nb.assigned] == [(3, 6)]
        assert _ranges(na.serving) == [(0, 3, READY, "")] and na.serving[0].recipe_hash == "recipe-1"
        assert _ranges(nb.serving) == [(3, 6, LOADING, "")]
        # asked for some peers only (a node checking a bind's next hop): those, and no others
        only_b = await h.peer(3).call(list_nodes=swarm_pb2.ListNodesRequest(peer_ids=[b.peer_id, "12D3KooWnobody"]))
        assert [n.peer_id for n in only_b.list_nodes.nodes] == [b.peer_id]
        assert _ranges(only_b.list_nodes.nodes[0].serving) == [(3, 6, LOADING, "")]

        # B fails to load: the report (with its error) shows although the range is taken back
        failed = swarm_pb2.AssignmentStatus(
            assignment=swarm_pb2.Assignment(model_sha256=MODEL.sha256, begin=3, end=6), state=FAILED,
            error="out of memory",
        )  # fmt: skip
        await b.call(heartbeat=swarm_pb2.HeartbeatRequest(peer_id=b.peer_id, serving=[failed]))
        na, nb = (await a.call(list_nodes={})).list_nodes.nodes
        assert _ranges(nb.serving) == [(3, 6, FAILED, "out of memory")] and list(nb.assigned) == []
        # A alone cannot hold the model: nothing new is assigned, but A keeps what it serves
        assert [(x.begin, x.end) for x in na.assigned] == [(0, 3)]
        assert _ranges(na.serving) == [(0, 3, READY, "")]  # until its next heartbeat says otherwise

        # B stops heartbeating: not alive once its timeout passes, its report forgotten
        h.nursery.start_soon(_beat_forever, a, lambda: [(0, 3)])
        await h.tracker.wait_until(lambda: b.peer_id not in h.tracker.alive)
        assert trio.current_time() == pytest.approx((b_heard_at - T0_MS) / 1000 + 5.0, abs=1e-9)
        na, nb = (await a.call(list_nodes={})).list_nodes.nodes
        assert (na.alive, nb.alive, nb.pending) == (True, False, False)
        assert list(nb.serving) == [] and list(nb.assigned) == [] and _ranges(na.serving) == [(0, 3, READY, "")]
        assert nb.last_heartbeat_ms == b_heard_at
        # ... and alive again with its next heartbeat
        await b.heartbeat()
        assert [n.alive for n in (await a.call(list_nodes={})).list_nodes.nodes] == [True, True]
        # a node that reports a range it was not given
        await b.heartbeat(serving=[(0, 6)], state=LOADING)
        h.nursery.cancel_scope.cancel()

    from agent.cli import main as baton

    assert baton(["tracker", "nodes", "--db", str(db_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "PEER",
        "ID",
        "ALIVE",
        "LAST",
        "HEARTBEAT",
        "(UTC)",
        "MEMORY",
        "ADDRS",
        "CHECKS",
        "RANGES",
    ]
    assert lines[1].startswith(a.peer_id) and lines[1].split()[1] == "yes"
    assert f"/memory/{a.peer_id}" in lines[1] and "2.9 MiB" in lines[1]
    assert lines[1].endswith("tiny[0, 3) READY")  # still assigned: kept while the model waits for a node
    assert lines[2].startswith(b.peer_id) and lines[2].endswith("tiny[0, 6) LOADING unassigned")
    assert len(lines) == 3

    assert baton(["tracker", "nodes", "--db", str(db_path), "--json"]) == 0
    nodes = json.loads(capsys.readouterr().out)["nodes"]
    assert [n["peer_id"] for n in nodes] == [a.peer_id, b.peer_id]
    assert nodes[0]["alive"] is True and nodes[0]["listen_addrs"] == [f"/memory/{a.peer_id}"]
    assert nodes[0]["usable_memory_bytes"] == 3 * BPB and isinstance(nodes[0]["last_heartbeat_ms"], int)
    assert [(x["begin"], x["end"]) for x in nodes[0]["assigned"]] == [(0, 3)]
    assert nodes[0]["serving"] == [
        {
            "model_sha256": MODEL.sha256,
            "begin": 0,
            "end": 3,
            "state": "READY",
            "error": "",
            "recipe_hash": "recipe-1",
            "fetched_bytes": 0,
            "fetch_total_bytes": 0,
        }
    ]
    assert nodes[1]["serving"][0]["state"] == "LOADING" and nodes[1]["assigned"] == []


def test_nodes_listing_shows_failures_and_refuses_a_missing_database(tmp_path, capsys):
    from agent.cli import main as baton

    db = tmp_path / "tracker.db"
    assert baton(["tracker", "nodes", "--db", str(db)]) == 2
    assert "no tracker database at" in capsys.readouterr().err
    with open_store(db) as store:
        store.put_model(MODEL, 0)
        k = key(1)
        fingerprint = swarm_pb2.Fingerprint(schema_version=1, peer_id=peer(k), usable_memory_bytes=BPB)
        signed = adm.sign_fingerprint(k, fingerprint)
        store.put_node(
            NodeRecord(
                peer_id=peer(k), public_key=adm.public_key_bytes(k), signed_fingerprint=signed,
                fingerprint=fingerprint, admission=swarm_pb2.SignedAdmission(), admitted_at_ms=T0_MS,
                expires_at_ms=T0_MS + 1, last_heartbeat_ms=T0_MS, alive=False, listen_addrs=(),
            )
        )  # fmt: skip
        store.replace_assignments([Assignment(MODEL.sha256, 0, 6, peer(k)), Assignment(MODEL.sha256, 0, 3, peer(k))])
        status = swarm_pb2.AssignmentStatus(
            assignment=swarm_pb2.Assignment(model_sha256=MODEL.sha256, begin=0, end=6), state=FAILED, error="boom"
        )
        store.record_heartbeat(peer(k), T0_MS, None, [status])
        store.mark_dead([peer(k)])
    assert baton(["tracker", "nodes", "--db", str(db)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:2] == [peer(k), "no"] and "2027-01-15 08:00:00" in lines[1]
    # no addresses, no checks; [0, 3) assigned but not reported
    assert " ".join(lines[1].split()).endswith("976.6 KiB - - tiny[0, 3) -, tiny[0, 6) FAILED")
    assert lines[2] == f"  {peer(k)} tiny[0, 6): boom" and len(lines) == 3
    assert baton(["tracker", "nodes", "--db", str(db), "--json"]) == 0
    [node] = json.loads(capsys.readouterr().out)["nodes"]
    assert (node["alive"], node["listen_addrs"], node["last_heartbeat_ms"]) == (False, [], T0_MS)
    assert node["assigned"] == [
        {"model_sha256": MODEL.sha256, "begin": 0, "end": 3}, {"model_sha256": MODEL.sha256, "begin": 0, "end": 6}
    ]  # fmt: skip
    assert [(s["state"], s["error"]) for s in node["serving"]] == [("FAILED", "boom")]


# --- store ------------------------------------------------------------------------------------------


def test_the_store_and_its_wal_are_owner_only_and_a_readable_file_is_refused(db_path):
    previous = os.umask(0)  # a permissive umask takes nothing away and adds nothing
    try:
        with open_store(db_path) as store:
            store.put_model(MODEL, 0, "/models/tiny.gguf")
            modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in db_path.parent.iterdir()}
    finally:
        os.umask(previous)
    assert "tracker.db-wal" in modes and set(modes.values()) == {0o600}, modes
    db_path.chmod(0o644)
    with pytest.raises(StoreError, match=r"tracker database .* has mode 0644; .*\(chmod 600 "):
        TrackerStore.open(db_path)


def test_store_refuses_another_schema_version(db_path):
    with open_store(db_path):
        pass
    connection = sqlite3.connect(db_path)
    connection.execute("UPDATE schema_version SET version = 99")
    connection.commit()
    connection.close()
    with pytest.raises(StoreError, match="schema version 99, this tracker speaks 5"):
        TrackerStore.open(db_path)


def test_store_migrates_a_version_1_file(db_path):
    with open_store(db_path) as store:
        store.put_model(MODEL, 0, "/models/tiny.gguf")
    connection = sqlite3.connect(db_path)  # back to the columns of a version 1 file
    connection.executescript(
        "CREATE TABLE models_v1 (sha256 TEXT PRIMARY KEY, alias TEXT NOT NULL UNIQUE, name TEXT NOT NULL, "
        "entry BLOB NOT NULL, registered_at_ms INTEGER NOT NULL); "
        "INSERT INTO models_v1 SELECT sha256, alias, name, entry, registered_at_ms FROM models; "
        "DROP TABLE models; ALTER TABLE models_v1 RENAME TO models; "
        "CREATE TABLE nodes_v1 (peer_id TEXT PRIMARY KEY, public_key BLOB NOT NULL, signed_fingerprint BLOB NOT NULL, "
        "admission BLOB NOT NULL, admitted_at_ms INTEGER NOT NULL, expires_at_ms INTEGER NOT NULL, "
        "last_heartbeat_ms INTEGER NOT NULL, alive INTEGER NOT NULL, listen_addrs TEXT NOT NULL); "
        "DROP TABLE nodes; ALTER TABLE nodes_v1 RENAME TO nodes; "
        "DROP TABLE integrity_failures; DROP TABLE node_integrity; DROP TABLE invites; "
        "UPDATE schema_version SET version = 1;"
    )
    connection.close()
    with open_store(db_path) as store:
        assert store._db.execute("SELECT version FROM schema_version").fetchone()[0] == 5
        assert store.models() == [MODEL] and store.model_path(MODEL.sha256) is None
        assert store.model_source(MODEL.sha256) == ""  # (version 3) no source recorded
        store.put_model(MODEL, 1, "/models/tiny.gguf")
        store.put_model(MODEL, 2)  # an update without a path keeps the recorded one
        assert str(store.model_path(MODEL.sha256)) == "/models/tiny.gguf"
        store.put_node(
            NodeRecord(
                peer_id="A", public_key=b"k", signed_fingerprint=swarm_pb2.SignedFingerprint(),
                fingerprint=swarm_pb2.Fingerprint(), admission=swarm_pb2.SignedAdmission(), admitted_at_ms=0,
                expires_at_ms=1, last_heartbeat_ms=0, alive=True, listen_addrs=("/memory/A",),
            )
        )  # fmt: skip
        assert [(n.peer_id, list(n.listen_addrs), list(n.serving)) for n in store.node_entries()] == [
            ("A", ["/memory/A"], [])
        ]
        # (version 4) integrity records, kept apart from the node's row
        store.add_check_passed("A")
        assert store.add_integrity_failure("A", swarm_pb2.IntegrityFailure(check_id="c1", at_ms=5)) == 1
        store.refuse_node("A", "failed 1 check")
        (entry,) = store.node_entries()
        assert (entry.checks_passed, entry.refused, [f.check_id for f in entry.integrity_failures]) == (
            1, "failed 1 check", ["c1"],
        )  # fmt: skip
        # (version 5) invites
        store.add_invite("ab" * 32, 1, 0, "", 0)
        assert store.invite("ab" * 32).uses_left == 1


def test_store_uses_wal_and_keeps_assignment_status(db_path):
    with open_store(db_path) as store:
        assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        a, b = Assignment("m", 0, 3, "A"), Assignment("m", 3, 6, "B")
        store.replace_assignments([a, b])
        assert store.set_status(a, READY, "r", "", 5)
        assert not store.set_status(Assignment("m", 0, 6, "A"), READY, "r", "", 5)
        store.replace_assignments([a, Assignment("m", 3, 6, "C")])
        rows = store.assignments()
        assert [(r.assignment, r.state, r.recipe_hash) for r in rows] == [
            (a, READY, "r"),
            (Assignment("m", 3, 6, "C"), 0, ""),
        ]


def test_store_alias_belongs_to_one_model(db_path):
    with open_store(db_path) as store:
        store.put_model(MODEL, 0)
        store.put_model(MODEL, 1)  # re-registering is fine
        with pytest.raises(StoreError, match="alias 'tiny' already names model"):
            store.put_model(swarm_pb2.ModelEntry(sha256="cc" * 32, alias="tiny"), 2)


def test_nonces_are_pruned_after_the_retention(db_path):
    with open_store(db_path) as store:
        store.add_nonce("A", b"n1", 1000)
        store.add_nonce("A", b"n2", 5000)
        assert store.prune_nonces(2000) == 1
        assert not store.nonce_seen("A", b"n1") and store.nonce_seen("A", b"n2")


# --- registry -----------------------------------------------------------------------------------------


def test_bytes_per_block_is_weights_plus_kv():
    facts = GgufFacts(
        name="x", architecture="llama", n_layer=30, n_embd=576, n_head=9, n_head_kv=3, key_length=64,
        value_length=64, block_tensor_bytes=66_493_440, size_bytes=98_362_432,
    )  # fmt: skip
    # 66493440 / 30 = 2216448 weight bytes; KV: 8192 tokens * 3 heads * (64 + 64) * 2 bytes = 6291456
    assert bytes_per_block(facts) == 2_216_448 + 6_291_456
    entry = model_entry(facts, "ab" * 32, "smol")
    assert (entry.alias, entry.n_layer, entry.size_bytes, entry.bytes_per_block) == ("smol", 30, 98_362_432, 8_507_904)


def test_register_a_real_gguf(db_path, qwen2_tiny_path):
    with open_store(db_path) as store:
        [entry] = register_models(store, [(qwen2_tiny_path, "qwen2-tiny")], 0)
        assert store.find_model("qwen2-tiny") == entry
        assert store.find_model(entry.sha256) == entry and store.find_model("baton qwen2-tiny (synthetic)") == entry
    assert (entry.architecture, entry.n_layer, entry.size_bytes) == ("qwen2", 6, qwen2_tiny_path.stat().st_size)
    # blk.* tensors 890880 bytes / 6 blocks + KV 8192 tokens * 2 kv heads * (16 + 16) * 2 bytes
    assert entry.bytes_per_block == 890_880 // 6 + 8192 * 2 * 32 * 2
    assert entry.hf_repo == ""  # the synthetic GGUF names no source repo


def test_registered_models_carry_their_hugging_face_repo(db_path, qwen2_tiny_path, capsys):
    with open_store(db_path) as store:
        [entry] = register_models(store, [(qwen2_tiny_path, "tiny")], 0, {"tiny": "baton/qwen2-tiny"})
        assert store.find_model("tiny").hf_repo == "baton/qwen2-tiny"
    assert entry.hf_repo == "baton/qwen2-tiny"
    from agent.cli import main as baton

    assert baton(["tracker", "models", "--db", str(db_path)]) == 0
    listing = capsys.readouterr().out
    assert "HF REPO" in listing and "baton/qwen2-tiny" in listing and "tiny" in listing
    with pytest.raises(SystemExit):
        baton(["tracker", "serve", "--db", str(db_path), "--key", "k", "--hf-repo", "no-slash"])


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(GgufError, match="not a GGUF file \\(it starts with b'not ', not b'GGUF'\\)"):
        read_gguf_facts(bad)
    cut = tmp_path / "cut.gguf"  # the magic, then not enough of a header
    cut.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 7)
    with pytest.raises(GgufError, match="not a readable GGUF file"):
        read_gguf_facts(cut)


def test_model_arg_parsing():
    assert parse_model_arg("/m/SmolLM2.Q4_1.gguf") == (parse_model_arg("/m/SmolLM2.Q4_1.gguf")[0], "SmolLM2.Q4_1")
    path, alias = parse_model_arg("/m/a.gguf:smol")
    assert (str(path), alias) == ("/m/a.gguf", "smol")
    path, alias = parse_model_arg("C:/m/a.gguf")
    assert (str(path), alias) == ("C:/m/a.gguf", "a")


def test_the_database_directory_is_made_and_a_path_that_cannot_be_a_database_is_a_clear_error(tmp_path, capsys):
    from agent.cli import main as baton

    nested = tmp_path / "state" / "tracker" / "tracker.db"
    with open_store(nested) as store:
        assert store.find_model("nothing") is None
    assert nested.is_file() and (nested.parent.stat().st_mode & 0o777) == 0o700
    a_directory = tmp_path / "a-directory.db"
    a_directory.mkdir()
    key = tmp_path / "tracker.key"
    assert baton(["tracker", "serve", "--db", str(a_directory), "--key", str(key), "--canary-interval-s", "0"]) == 2
    err = capsys.readouterr().err
    assert f"baton tracker serve: cannot open the database {a_directory}: it is a directory" in err, err
    not_a_database = tmp_path / "notes.db"
    not_a_database.write_text("not SQLite\n" * 100)
    not_a_database.chmod(0o600)  # (a file others may read is refused before it is read)
    assert baton(["tracker", "nodes", "--db", str(not_a_database)]) == 2
    err = capsys.readouterr().err
    assert f"{not_a_database}: not a Baton tracker database (file is not a database)" in err, err


async def test_route_requests_are_throttled_per_peer(autojump_clock, db_path):
    config = dataclasses.replace(CONFIG, route_requests_per_peer_per_s=3)
    async with running_tracker(db_path, config=config) as h:
        asker, other = h.peer(3), h.peer(4)
        for _ in range(3):  # (no node yet: answered "no route", and counted)
            reply = await asker.call(route=swarm_pb2.RouteRequest(model="tiny"))
            assert reply.error.code == Code.UNAVAILABLE
        reply = await asker.call(route=swarm_pb2.RouteRequest(model="tiny"))
        assert reply.error.code == Code.RESOURCE_EXHAUSTED
        assert "3 route requests this second already: ask again in" in reply.error.message
        reply = await other.call(route=swarm_pb2.RouteRequest(model="tiny"))
        assert reply.error.code == Code.UNAVAILABLE, "another peer is not throttled by it"
        await trio.sleep(1.0)
        reply = await asker.call(route=swarm_pb2.RouteRequest(model="tiny"))
        assert reply.error.code == Code.UNAVAILABLE, "a second later it is answered again"
