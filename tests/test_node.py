"""The node agent over an in-memory network with REAL worker processes (tiny synthetic qwen2,
6 blocks, one thread each): registration and directives from a fake tracker, steps pushed
A [0, 3) -> B [3, 6) -> owner with logits equal to one unsplit worker, sessions merged into one
Forward, every bad step refused with an error ack while another session is unharmed, failures
after the ack reported to the owner, node requests, unload, re-registration, and the CLI.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numpy as np
import psutil
import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.protobuf.message import Message

from agent._proto import swarm_pb2
from agent.core.net.identity import peer_id_from_public_key
from agent.core.owner.parity import max_abs_diff
from agent.core.tracker.assignment import Assignment
from agent.core.tracker.heartbeat import diff_assignment, read_report
from agent.core.wire.admission import (
    AdmissionError,
    issue_admission,
    public_key_bytes,
    verify_admission,
    verify_signed_fingerprint,
)
from agent.core.wire.boundary import WireDType
from agent.core.wire.fingerprint import DeviceInfo, HostProbe
from agent.core.wire.step_batch import step_batch
from agent.core.wire.step_requests import first_step_request
from agent.core.wire.step_results import validate_step_result
from agent.core.wire.swarm_wire import (
    NODE_PROTOCOL,
    RESULT_PROTOCOL,
    SCHEMA_VERSION,
    STEP_PROTOCOL,
    STEPS_PROTOCOL,
    TRACKER_PROTOCOL,
    WireError,
    crc32,
    parse_record,
    step_ack,
    step_ack_error,
    tracker_reply_error,
)
from agent.core.wire.worker_records import SeqInput
from agent.io.net.channel import open_channel_transport
from agent.io.net.transport import MemoryNetwork, Transport
from agent.io.node import cli as node_cli
from agent.io.node.agent import Node, serve_node
from agent.io.node.config import LocalModel, NodeConfig, NodeError, NodeRefused
from agent.io.node.probe import ProbeConfig, probe_host
from agent.io.worker.client import AsyncWorkerClient
from agent.io.worker.process import count_other_nodes, open_worker
from agent.models import cached_sha256
from agent.runtime import expected_pin
from agent.testing.tiny_models import TINY_MODELS

pytestmark = pytest.mark.worker

Code = swarm_pb2.Error.Code
State = swarm_pb2.AssignmentStatus.State

PROBE = HostProbe(
    os="Linux test",
    cpu_model="test cpu",
    cpu_cores=2,
    ram_total_bytes=8 << 30,
    ram_available_bytes=4 << 30,
    devices=(DeviceInfo("CPU", "CPU", 8 << 30, 4 << 30),),
    llama_cpp_commit="pin",
    patch_series_sha256="patches",
    architectures=("qwen2",),
    decode_s_per_block=0.001,
    bandwidth_bytes_per_s=1e9,
)
CTX_SIZE = 64
MAX_SEQUENCES = 4
BATCH_SIZE = 16
RESULT_TIMEOUT_S = 30.0


def new_peer() -> tuple[Ed25519PrivateKey, str]:
    key = Ed25519PrivateKey.generate()
    return key, peer_id_from_public_key(public_key_bytes(key))


def now_ms() -> int:
    return time.time_ns() // 1_000_000


# --- a fake tracker ------------------------------------------------------------------------


class FakeTracker:
    """Admits nodes (or refuses them all with ``refuse``), answers heartbeats with LOAD /
    UNLOAD directives for ``assignments`` and records what nodes report."""

    def __init__(
        self,
        network: MemoryNetwork | None,
        *,
        heartbeat_interval_ms: int = 50,
        refuse: str | None = None,
        key: Ed25519PrivateKey | None = None,
        transport: Transport | None = None,
    ) -> None:
        """On ``network`` (a fresh key), or on a given ``transport`` of ``key`` (libp2p)."""
        if transport is None:
            assert network is not None
            key, peer_id = new_peer()
            transport = network.add(peer_id)
        assert key is not None
        self.key, self.peer_id = key, transport.peer_id
        self.public_key = public_key_bytes(self.key)
        self.addr = transport.listen_addrs[0]
        self.transport = transport
        self.transport.set_handler(TRACKER_PROTOCOL, self.handle)
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.refuse = refuse
        self.assignments: dict[str, set[tuple[str, int, int]]] = collections.defaultdict(set)
        self.statuses: dict[str, dict[tuple[str, int, int], swarm_pb2.AssignmentStatus]] = {}
        self.fingerprints: dict[str, swarm_pb2.Fingerprint] = {}
        self.registrations: collections.Counter[str] = collections.Counter()
        self.known: set[str] = set()
        self._changed = trio.Event()

    def admission(self, peer_id: str, role: int, *, ttl_ms: int = 600_000, key: Ed25519PrivateKey | None = None):
        now = now_ms()
        record = swarm_pb2.AdmissionRecord(
            schema_version=1, peer_id=peer_id, role=role, tracker_peer_id=self.peer_id,
            issued_at_ms=now, expires_at_ms=now + ttl_ms,
        )  # fmt: skip
        return issue_admission(key or self.key, record)

    async def handle(self, remote: str, data: bytes) -> bytes:
        request = parse_record(swarm_pb2.TrackerRequest, data)
        body = request.WhichOneof("body")
        if body == "register":
            signed = request.register.fingerprint
            fingerprint = verify_signed_fingerprint(signed, remote)
            self.fingerprints[remote] = fingerprint
            if self.refuse:
                return tracker_reply_error(Code.REFUSED, self.refuse)
            self.registrations[remote] += 1
            self.known.add(remote)
            self._notify()
            reply = swarm_pb2.TrackerReply(
                schema_version=SCHEMA_VERSION,
                register=swarm_pb2.RegisterReply(
                    admission=self.admission(remote, swarm_pb2.ROLE_NODE),
                    tracker_public_key=self.public_key,
                    heartbeat_interval_ms=self.heartbeat_interval_ms,
                    heartbeat_timeout_ms=5000,
                ),
            )
            return reply.SerializeToString()
        if body == "heartbeat":
            if remote not in self.known:
                return tracker_reply_error(Code.NOT_FOUND, "unknown node: register first")
            # the tracker's own rules: the report checked, LOAD/UNLOAD the diff with the assignments
            try:
                report = read_report(remote, request.heartbeat.serving, [])
            except WireError as err:  # as the tracker answers a bad report
                return tracker_reply_error(err.code, err.message)
            self.statuses[remote] = {(a.model_sha256, a.begin, a.end): s for a, s in report.reported.items()}
            assigned = [(Assignment(m, b, e, remote), False) for m, b, e in self.assignments[remote]]
            diff = diff_assignment(report.reported, assigned)
            directives = [
                swarm_pb2.Directive(kind=kind, assignment=_assignment((a.model_sha256, a.begin, a.end)))
                for kind, ranges in ((swarm_pb2.Directive.LOAD, diff.load), (swarm_pb2.Directive.UNLOAD, diff.unload))
                for a in ranges
            ]
            self._notify()
            reply = swarm_pb2.TrackerReply(
                schema_version=SCHEMA_VERSION, heartbeat=swarm_pb2.HeartbeatReply(directives=directives)
            )
            return reply.SerializeToString()
        return tracker_reply_error(Code.INVALID_ARGUMENT, f"fake tracker does not answer {body}")

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 60.0) -> None:
        with trio.fail_after(timeout_s):
            while not predicate():
                await self._changed.wait()

    def state(self, peer_id: str, key: tuple[str, int, int]) -> int | None:
        status = self.statuses.get(peer_id, {}).get(key)
        return None if status is None else status.state


def _assignment(key: tuple[str, int, int]) -> swarm_pb2.Assignment:
    return swarm_pb2.Assignment(model_sha256=key[0], begin=key[1], end=key[2])


# --- a fake session owner ------------------------------------------------------------------


class FakeOwner:
    """A client peer: CLIENT admission, a RESULT handler that checks the sender's NODE
    admission and files results per session."""

    def __init__(self, network: MemoryNetwork, tracker: FakeTracker) -> None:
        self.key, self.peer_id = new_peer()
        self.tracker = tracker
        self.transport = network.add(self.peer_id)
        self.transport.set_handler(RESULT_PROTOCOL, self.handle_result)
        self.admission = tracker.admission(self.peer_id, swarm_pb2.ROLE_CLIENT)
        self._channels: dict[bytes, tuple[trio.MemorySendChannel, trio.MemoryReceiveChannel]] = {}

    def _channel(self, session_id: bytes):
        if session_id not in self._channels:
            self._channels[session_id] = trio.open_memory_channel(math.inf)
        return self._channels[session_id]

    async def handle_result(self, remote: str, data: bytes) -> bytes:
        result = parse_record(swarm_pb2.StepResult, data)
        try:
            verify_admission(
                result.sender_admission, self.tracker.public_key, remote, now_ms(), roles=[swarm_pb2.ROLE_NODE]
            )
        except AdmissionError as err:
            return step_ack_error(Code.REFUSED, err.reason)
        self._channel(bytes(result.session_id))[0].send_nowait(result)
        return step_ack()

    async def result(self, session_id: bytes) -> swarm_pb2.StepResult:
        with trio.fail_after(RESULT_TIMEOUT_S):
            return await self._channel(session_id)[1].receive()

    def pending_results(self, session_id: bytes) -> int:
        return self._channel(session_id)[1].statistics().current_buffer_used

    async def send(self, peer_id: str, request: swarm_pb2.StepRequest | bytes) -> swarm_pb2.StepAck:
        data = request if isinstance(request, bytes) else request.SerializeToString()
        reply = await self.transport.request(peer_id, [], STEP_PROTOCOL, data, timeout_s=10.0)
        return parse_record(swarm_pb2.StepAck, reply)

    async def node_request(self, peer_id: str, **body) -> swarm_pb2.NodeReply:
        request = swarm_pb2.NodeRequest(schema_version=SCHEMA_VERSION, sender_admission=self.admission, **body)
        reply = await self.transport.request(peer_id, [], NODE_PROTOCOL, request.SerializeToString(), timeout_s=10.0)
        return parse_record(swarm_pb2.NodeReply, reply)


# --- the swarm under test ------------------------------------------------------------------


@dataclasses.dataclass
class Swarm:
    network: MemoryNetwork
    tracker: FakeTracker
    model: LocalModel
    nodes: dict[str, Node]
    owner: FakeOwner
    recipes: set[str]  # recipe hashes of the served ranges (one: same model, pin, backend)

    def hops(self, *names_and_ranges: tuple[str, int, int]) -> list[swarm_pb2.Hop]:
        return [
            swarm_pb2.Hop(
                peer_id=self.nodes[name].peer_id, addrs=self.nodes[name].transport.listen_addrs, begin=b, end=e
            )
            for name, b, e in names_and_ranges
        ]

    def served(self, name: str, begin: int, end: int):
        return self.nodes[name].ranges[(self.model.sha256, begin, end)]

    @property
    def recipe_hash(self) -> str:
        (recipe,) = self.recipes
        return recipe


def override(request: swarm_pb2.StepRequest, **fields) -> swarm_pb2.StepRequest:
    for name, value in fields.items():
        if isinstance(value, Message):
            getattr(request, name).CopyFrom(value)
        else:
            setattr(request, name, value)
    return request


def tiny_model(path: Path) -> LocalModel:
    return LocalModel(path=str(path), sha256=TINY_MODELS["qwen2-tiny"].sha256)


def node_config(fake_tracker: FakeTracker, key: Ed25519PrivateKey, model: LocalModel, **overrides) -> NodeConfig:
    fields = dict(
        tracker=fake_tracker.addr, key=key, models=(model,), threads=1, ctx_size=CTX_SIZE, max_sequences=MAX_SEQUENCES,
        batch_size=BATCH_SIZE, probe=PROBE, request_timeout_s=10.0, step_push_timeout_s=10.0,
        owner_max_share=1.0,  # these tests merge several sessions of one owner
    )  # fmt: skip
    fields.update(overrides)
    return NodeConfig(**fields)


@contextlib.asynccontextmanager
async def open_swarm(
    model_path: Path, layout: dict[str, list[tuple[int, int]]], *, channel: bool = False, **config_overrides
) -> AsyncIterator[Swarm]:
    """A fake tracker, one node per ``layout`` entry (its ranges assigned), all READY; with
    ``channel``, each node has the direct channel (real TLS on loopback) in front of its
    in-memory transport, so that the nodes' pushes to each other take it."""
    network = MemoryNetwork()
    tracker = FakeTracker(network)
    model = tiny_model(model_path)
    async with contextlib.AsyncExitStack() as transports:
        peers = {}
        for name, ranges in layout.items():
            key, peer_id = new_peer()
            tracker.assignments[peer_id] = {(model.sha256, b, e) for b, e in ranges}
            transport = network.add(peer_id)
            if channel:  # opened before the nodes' nursery, closed after it
                transport = await transports.enter_async_context(open_channel_transport(key, transport))
            peers[name] = key, transport
        async with trio.open_nursery() as nursery:
            nodes = {}
            for name, (key, transport) in peers.items():
                nodes[name] = await nursery.start(
                    serve_node, node_config(tracker, key, model, **config_overrides), transport
                )
            for node in nodes.values():
                for key in tracker.assignments[node.peer_id]:
                    await tracker.wait_for(lambda: tracker.state(node.peer_id, key) == State.READY)  # noqa: B023
            recipes = {served.info.recipe_hash for node in nodes.values() for served in node.ranges.values()}
            assert len(recipes) == 1, recipes
            yield Swarm(network, tracker, model, nodes, FakeOwner(network, tracker), recipes)
            nursery.cancel_scope.cancel()


@dataclasses.dataclass
class Seq:
    """One session as the owner sees it (greedy)."""

    session_id: bytes
    tokens: list[int]
    ref_seq_id: int
    step: int = 0
    n_cached: int = 0

    def request(self, swarm: Swarm, hops: list[swarm_pb2.Hop], **overrides) -> swarm_pb2.StepRequest:
        request = first_step_request(
            session_id=self.session_id, step=self.step, hops=hops, token_ids=self.tokens[self.n_cached :],
            first_position=self.n_cached, recipe_hash=swarm.recipe_hash, model_sha256=swarm.model.sha256,
            owner_peer_id=swarm.owner.peer_id, owner_addrs=swarm.owner.transport.listen_addrs,
            sender_admission=swarm.owner.admission,
        )  # fmt: skip
        return override(request, **overrides)

    def reference_entry(self) -> SeqInput:
        return SeqInput(
            seq_id=self.ref_seq_id,
            positions=range(self.n_cached, len(self.tokens)),
            token_ids=self.tokens[self.n_cached :],
        )

    def advance(self, logits: np.ndarray) -> None:
        self.n_cached = len(self.tokens)
        self.tokens.append(int(np.argmax(logits)))
        self.step += 1


async def run_step(swarm: Swarm, reference: AsyncWorkerClient, seqs: list[Seq], hops: list[swarm_pb2.Hop]) -> float:
    """Send one step of every session in ``seqs`` at once; compare each result with the
    reference worker running the same sessions in one batch; advance them. Returns the max
    abs logits difference."""
    acks: dict[bytes, swarm_pb2.StepAck] = {}

    async def send(seq: Seq) -> None:
        acks[seq.session_id] = await swarm.owner.send(hops[0].peer_id, seq.request(swarm, hops))

    async with trio.open_nursery() as nursery:
        for seq in seqs:
            nursery.start_soon(send, seq)
    for seq in seqs:
        assert acks[seq.session_id].error.code == 0, acks[seq.session_id].error.message
    # Nodes lay out a batch by sequence id and merge decode rows together and prefill chunks of
    # one length together (agent.core.node.scheduler); so does the reference.
    seqs = sorted(seqs, key=lambda seq: seq.ref_seq_id)
    expected_by_seq = {}
    for group in forward_groups(seqs):
        for seq, ref in zip(group, await reference.forward([seq.reference_entry() for seq in group]), strict=True):
            expected_by_seq[seq.ref_seq_id] = ref
    expected = [expected_by_seq[seq.ref_seq_id] for seq in seqs]
    worst = 0.0
    for seq, ref in zip(seqs, expected, strict=True):
        result = await swarm.owner.result(seq.session_id)
        assert result.step == seq.step
        logits = validate_step_result(result, n_vocab=ref.logits.shape[1])
        worst = max(worst, max_abs_diff(logits, ref.logits[-1]))
        seq.advance(ref.logits[-1])
    return worst


def forward_groups(seqs: list[Seq]) -> list[list[Seq]]:
    """The Forwards the node's scheduler makes of these steps: every decode row together, and
    prefill chunks of one length together (in sequence id order within each)."""
    groups: dict[int, list[Seq]] = {}
    for seq in seqs:
        rows = seq.reference_entry().n_rows
        groups.setdefault(1 if rows == 1 else rows, []).append(seq)
    return list(groups.values())


@contextlib.asynccontextmanager
async def open_reference(model_path: Path) -> AsyncIterator[AsyncWorkerClient]:
    async with open_worker(model_path, 0, None, threads=1, ctx_size=CTX_SIZE, max_sequences=MAX_SEQUENCES) as handle:
        yield handle.client


async def tokenize(swarm: Swarm, text: str) -> list[int]:
    reply = await swarm.owner.node_request(
        swarm.nodes["A"].peer_id,
        tokenize=swarm_pb2.TokenizeRequest(model_sha256=swarm.model.sha256, text=text, add_special=True),
    )
    assert reply.error.code == 0, reply.error.message
    assert list(reply.eog_token_ids), "the tokenizer reply names the end-of-generation tokens"
    return list(reply.token_ids)


LAYOUT = {"A": [(0, 3)], "B": [(3, 6)]}
ROUTE = (("A", 0, 3), ("B", 3, 6))


# --- tests ---------------------------------------------------------------------------------


async def test_split_route_equals_unsplit_and_merges_sessions(qwen2_tiny_path: Path) -> None:
    # decode groups off: this test merges two sessions into one Forward at every hop (the first
    # hop would otherwise run their decode steps in groups of one: three live sessions, two hops)
    async with (
        open_swarm(qwen2_tiny_path, LAYOUT, decode_groups=0) as swarm,
        open_reference(qwen2_tiny_path) as reference,
    ):
        tracker, a = swarm.tracker, swarm.nodes["A"]
        # Each node marks the host while it runs, so that the other nodes' workers (auto wait)
        # know they share its cores before this node's worker computes (agent.core.node.worker_wait).
        markers = [node.host_marker for node in swarm.nodes.values()]
        assert all(marker is not None and os.path.isdir(marker) for marker in markers)
        assert count_other_nodes(a.host_marker) >= len(markers) - 1
        # Registration carried a signed fingerprint with the node's model and peer id.
        fingerprint = tracker.fingerprints[a.peer_id]
        assert fingerprint.peer_id == a.peer_id and list(fingerprint.model_sha256s) == [swarm.model.sha256]
        assert fingerprint.usable_memory_bytes == PROBE.ram_available_bytes  # no --memory-bytes: available RAM
        assert fingerprint.decode_s_per_block == PROBE.decode_s_per_block
        assert list(fingerprint.listen_addrs) == a.transport.listen_addrs
        assert tracker.statuses[a.peer_id][(swarm.model.sha256, 0, 3)].recipe_hash == swarm.recipe_hash
        hops = swarm.hops(*ROUTE)
        served_a, served_b = swarm.served("A", 0, 3), swarm.served("B", 3, 6)

        # One session alone: prefill + decode steps, bit-identical to the unsplit worker.
        solo = Seq(os.urandom(16), await tokenize(swarm, "The quick brown fox jumps over"), ref_seq_id=0)
        for _ in range(4):
            assert await run_step(swarm, reference, [solo], hops) == 0.0
        assert served_a.forward_calls == 4 and served_b.forward_calls == 4

        # Two sessions sent at once: one Forward per step on each hop, still bit-identical.
        first = Seq(os.urandom(16), await tokenize(swarm, "Hello world, how are"), ref_seq_id=1)
        second = Seq(os.urandom(16), await tokenize(swarm, "Once upon a time"), ref_seq_id=2)
        health_a = await served_a.client.health()
        forwards_a = served_a.forward_calls
        batches = swarm.network.requests[STEPS_PROTOCOL]
        for step in range(4):
            calls = (served_a.forward_calls, served_b.forward_calls)
            forwards = len(forward_groups([first, second]))  # prompts of two lengths: two prefill Forwards
            assert await run_step(swarm, reference, [first, second], hops) == 0.0
            assert (served_a.forward_calls, served_b.forward_calls) == (calls[0] + forwards, calls[1] + forwards), step
            assert step == 0 or forwards == 1  # decode steps share one Forward
        assert served_a.largest_batch == 2 and served_b.largest_batch == 2
        # A pushed each shared decode Forward's two outputs to B in one StepBatch
        assert swarm.network.requests[STEPS_PROTOCOL] - batches == 3
        # A next hop from before /baton/steps: A falls back to pushing the steps one by one.
        swarm.nodes["B"].transport.set_handler(STEPS_PROTOCOL, None)
        singles = swarm.network.requests[STEP_PROTOCOL]
        assert await run_step(swarm, reference, [first, second], hops) == 0.0
        assert swarm.network.requests[STEP_PROTOCOL] - singles == 2 + 2  # the owner's two, A's two
        # the worker counts the same Forwards the node sent
        assert (
            await served_a.client.health()
        ).forward_calls == health_a.forward_calls + served_a.forward_calls - forwards_a

        # Detokenize through the node.
        reply = await swarm.owner.node_request(
            a.peer_id,
            detokenize=swarm_pb2.DetokenizeRequest(model_sha256=swarm.model.sha256, token_ids=solo.tokens[:3]),
        )
        assert reply.error.code == 0 and reply.text == await reference.detokenize(solo.tokens[:3])

        # end_session frees the sequence on A and is forwarded to B.
        assert (await served_b.client.health()).active_sequences == 3
        reply = await swarm.owner.node_request(
            a.peer_id, end_session=swarm_pb2.EndSessionRequest(session_id=solo.session_id, rest=hops[1:])
        )
        assert reply.error.code == 0, reply.error.message
        assert solo.session_id not in served_a.sessions and solo.session_id not in served_b.sessions
        for served in (served_a, served_b):
            with trio.fail_after(10):
                while (await served.client.health()).active_sequences != 2:
                    await trio.sleep(0.01)  # the serving task frees it between two Forwards
        # A step of the ended session is now unknown.
        ack = await swarm.owner.send(a.peer_id, solo.request(swarm, hops))
        assert ack.error.code == Code.NOT_FOUND and "unknown session" in ack.error.message
    assert not any(os.path.exists(marker) for marker in markers)  # the nodes removed theirs


async def test_over_the_channel_pushes_leave_from_the_serving_task_and_refusals_reach_the_owner(
    qwen2_tiny_path: Path,
) -> None:
    # With the direct channel, a node sends a push from its serving task once a connection to
    # the next hop is open (request_soon, quiet: the next hop answers only a refusal, and
    # confirms what it took in bulk): the outputs stay exact, and a step the next hop
    # refuses is still reported to its owner, naming that hop.
    async with open_swarm(qwen2_tiny_path, LAYOUT, channel=True) as swarm, open_reference(qwen2_tiny_path) as reference:
        a, b, owner = swarm.nodes["A"], swarm.nodes["B"], swarm.owner
        hops = swarm.hops(*ROUTE)
        solo = Seq(os.urandom(16), await tokenize(swarm, "The quick brown fox jumps over"), ref_seq_id=0)
        for _ in range(4):
            assert await run_step(swarm, reference, [solo], hops) == 0.0
        # the first push dialled B (from a task); the three after it left from the serving task
        assert a.transport.connections_dialled == 1 and a.transport.requests_sent_soon == 3
        assert a.transport.channel_requests == 4
        # B took those three without an ack each: it confirmed them in bulk (a TAKEN frame)
        connection = a.transport._connections[b.peer_id]
        with trio.fail_after(10):
            while connection.acceptances_confirmed < 3:  # a condition to reach, not a delay
                await trio.sleep(0.01)
        assert connection.acceptances_confirmed == 3 and not connection.pending

        # B no longer knows the session: it refuses A's push of the next step
        swarm.served("B", 3, 6).end_session(solo.session_id)
        ack = await owner.send(a.peer_id, solo.request(swarm, hops))
        assert ack.error.code == 0, ack.error.message
        result = await owner.result(solo.session_id)
        assert a.transport.requests_sent_soon == 4
        assert result.error.code == Code.NOT_FOUND and result.failed_peer_id == b.peer_id, result
        assert "refused the step" in result.error.message and "unknown session" in result.error.message


def admission_forged_by(key: Ed25519PrivateKey, tracker: FakeTracker, peer_id: str, role: int):
    return tracker.admission(peer_id, role, key=key)


async def test_bad_steps_are_refused_and_do_not_disturb_a_session(qwen2_tiny_path: Path) -> None:
    async with open_swarm(qwen2_tiny_path, LAYOUT) as swarm, open_reference(qwen2_tiny_path) as reference:
        a, b, owner, tracker = swarm.nodes["A"], swarm.nodes["B"], swarm.owner, swarm.tracker
        hops = swarm.hops(*ROUTE)
        served_a, served_b = swarm.served("A", 0, 3), swarm.served("B", 3, 6)
        good = Seq(os.urandom(16), await tokenize(swarm, "The quick brown fox"), ref_seq_id=0)
        assert await run_step(swarm, reference, [good], hops) == 0.0

        # A peer with a NODE admission that sends boundary rows straight to B.
        _relay_key, relay_id = new_peer()
        relay = swarm.network.add(relay_id)
        relay_admission = tracker.admission(relay_id, swarm_pb2.ROLE_NODE)
        n_embd = served_b.info.n_embd

        def boundary_step(rows: np.ndarray, *, dtype: int = WireDType.F32, **overrides) -> swarm_pb2.StepRequest:
            data = rows.astype("<f4" if dtype == WireDType.F32 else "<f2").tobytes()
            request = swarm_pb2.StepRequest(
                schema_version=1, session_id=os.urandom(16), step=0, begin=3, end=6, positions=range(rows.shape[0]),
                boundary=data, dtype=dtype, n_embd=rows.shape[1], recipe_hash=swarm.recipe_hash,
                owner_peer_id=owner.peer_id, checksum=crc32(data), sender_admission=relay_admission,
                model_sha256=swarm.model.sha256,
            )  # fmt: skip
            return override(request, **overrides)

        async def relay_send(request: swarm_pb2.StepRequest | bytes) -> swarm_pb2.StepAck:
            data = request if isinstance(request, bytes) else request.SerializeToString()
            return parse_record(
                swarm_pb2.StepAck, await relay.request(b.peer_id, [], STEP_PROTOCOL, data, timeout_s=10)
            )

        rows = np.ones((2, n_embd), dtype=np.float32)
        nan_rows = rows.copy()
        nan_rows[1, 5] = np.nan
        fresh = Seq(os.urandom(16), list(good.tokens[:4]), ref_seq_id=3)
        _other_key, other_id = new_peer()
        oversize = Seq(os.urandom(16), [1] * (BATCH_SIZE + 1), ref_seq_id=3)
        stranger_key, _ = new_peer()

        def wrong_checksum() -> swarm_pb2.StepRequest:
            request = fresh.request(swarm, hops)
            request.checksum ^= 1
            return request

        def no_admission() -> swarm_pb2.StepRequest:
            request = fresh.request(swarm, hops)
            request.ClearField("sender_admission")
            return request

        cases = [
            ("malformed bytes", lambda: owner.send(a.peer_id, b"\xff\xff\xff garbage"), Code.INVALID_ARGUMENT, "malformed StepRequest"),
            ("schema version", lambda: owner.send(a.peer_id, fresh.request(swarm, hops, schema_version=2)),
             Code.INVALID_ARGUMENT, "schema_version 2 is not supported (this peer speaks 1)"),
            ("wrong width", lambda: relay_send(boundary_step(np.ones((2, n_embd // 2), np.float32))),
             Code.INVALID_ARGUMENT, f"n_embd {n_embd // 2} does not match"),
            ("short boundary", lambda: relay_send(boundary_step(rows, boundary=rows.tobytes()[:-4], checksum=crc32(rows.tobytes()[:-4]))),
             Code.INVALID_ARGUMENT, "boundary has"),
            ("NaN rows", lambda: relay_send(boundary_step(nan_rows)), Code.INVALID_ARGUMENT, "non-finite"),
            ("bad dtype", lambda: relay_send(boundary_step(rows, dtype=7)), Code.INVALID_ARGUMENT, "unsupported wire dtype 7"),
            ("unknown session", lambda: owner.send(a.peer_id, dataclasses.replace(fresh, step=3, n_cached=2).request(swarm, hops)),
             Code.NOT_FOUND, "unknown session"),
            ("wrong recipe", lambda: owner.send(a.peer_id, fresh.request(swarm, hops, recipe_hash="0" * 64)),
             Code.INVALID_ARGUMENT, "recipe_hash"),
            ("bad checksum", lambda: owner.send(a.peer_id, wrong_checksum()), Code.INVALID_ARGUMENT, "checksum"),
            ("range not served", lambda: owner.send(a.peer_id, fresh.request(swarm, swarm.hops(("A", 0, 2), ("B", 2, 6)))),
             Code.NOT_FOUND, "does not serve"),
            ("oversize batch", lambda: owner.send(a.peer_id, oversize.request(swarm, hops)),
             Code.RESOURCE_EXHAUSTED, f"exceed this range's batch limit of {BATCH_SIZE}"),
            ("client to a later hop", lambda: owner.send(b.peer_id, boundary_step(rows, sender_admission=owner.admission)),
             Code.REFUSED, "a client may only send steps to the first hop"),
            ("no admission", lambda: owner.send(a.peer_id, no_admission()), Code.REFUSED, "sender admission: malformed admission"),
            ("forged admission", lambda: owner.send(a.peer_id, fresh.request(
                swarm, hops, sender_admission=admission_forged_by(stranger_key, tracker, owner.peer_id, swarm_pb2.ROLE_CLIENT))),
             Code.REFUSED, "bad tracker signature"),
            ("someone else's admission", lambda: relay_send(boundary_step(rows, sender_admission=tracker.admission(other_id, swarm_pb2.ROLE_NODE))),
             Code.REFUSED, "admission peer id mismatch"),
            ("expired admission", lambda: owner.send(a.peer_id, fresh.request(
                swarm, hops, sender_admission=tracker.admission(owner.peer_id, swarm_pb2.ROLE_CLIENT, ttl_ms=-1))),
             Code.REFUSED, "admission expired"),
            ("broken hop chain", lambda: owner.send(a.peer_id, fresh.request(swarm, swarm.hops(("A", 0, 3), ("B", 4, 6)))),
             Code.INVALID_ARGUMENT, "rest[0] covers blocks [4, 6)"),
            ("session hijack", lambda: owner.send(a.peer_id, good.request(swarm, hops, owner_peer_id=other_id)),
             Code.REFUSED, "its own sessions"),
            ("step out of order", lambda: owner.send(a.peer_id, dataclasses.replace(good, step=good.step + 1).request(swarm, hops)),
             Code.INVALID_ARGUMENT, "out of order"),
        ]  # fmt: skip
        calls = (served_a.forward_calls, served_b.forward_calls)
        for name, send, code, fragment in cases:
            ack = await send()
            assert ack.error.code == code, f"{name}: {ack.error}"
            assert fragment in ack.error.message, f"{name}: {fragment!r} not in {ack.error.message!r}"
        assert (served_a.forward_calls, served_b.forward_calls) == calls, "no refused step reached a worker"
        assert owner.pending_results(good.session_id) == 0

        # Node requests: every bad one gets an error reply naming the problem.
        stranger = FakeOwner(swarm.network, tracker)  # another admitted client

        async def node_raw(sender: FakeOwner, data: bytes) -> swarm_pb2.NodeReply:
            reply = await sender.transport.request(a.peer_id, [], NODE_PROTOCOL, data, timeout_s=10)
            return parse_record(swarm_pb2.NodeReply, reply)

        end_good = swarm_pb2.EndSessionRequest(session_id=good.session_id, rest=hops[1:])
        node_cases = [
            ("malformed", lambda: node_raw(owner, b"\xff\xff"), Code.INVALID_ARGUMENT, "malformed NodeRequest"),
            ("no admission", lambda: node_raw(owner, swarm_pb2.NodeRequest(schema_version=1).SerializeToString()),
             Code.REFUSED, "sender admission"),
            ("no body", lambda: owner.node_request(a.peer_id), Code.INVALID_ARGUMENT, "has no body"),
            ("unknown model", lambda: owner.node_request(a.peer_id, tokenize=swarm_pb2.TokenizeRequest(model_sha256="00" * 32)),
             Code.NOT_FOUND, "is not ready on this node"),
            ("bad token", lambda: owner.node_request(a.peer_id, detokenize=swarm_pb2.DetokenizeRequest(
                model_sha256=swarm.model.sha256, token_ids=[-5])), Code.INVALID_ARGUMENT, "token ids must be in"),
            ("short session id", lambda: owner.node_request(a.peer_id, end_session=swarm_pb2.EndSessionRequest(session_id=b"x")),
             Code.INVALID_ARGUMENT, "session_id has 1 bytes"),
            ("someone else's session", lambda: stranger.node_request(a.peer_id, end_session=end_good),
             Code.REFUSED, f"belongs to {owner.peer_id}"),
        ]  # fmt: skip
        for name, call, code, fragment in node_cases:
            reply = await call()
            assert reply.error.code == code, f"{name}: {reply.error}"
            assert fragment in reply.error.message, f"{name}: {fragment!r} not in {reply.error.message!r}"
        assert good.session_id in served_a.sessions and good.session_id in served_b.sessions

        # A StepBatch (what a hop pushes when one Forward gave several steps for the same next
        # hop): every step is checked on its own and answered in order; a batch that does not
        # parse, or holds no steps, gets one error ack; nothing refused reaches the worker.
        async def relay_batch(data: bytes) -> list[swarm_pb2.StepAck]:
            reply = await relay.request(b.peer_id, [], STEPS_PROTOCOL, data, timeout_s=10)
            return list(parse_record(swarm_pb2.StepBatchAck, reply).acks)

        batched_ok = boundary_step(rows)
        acks = await relay_batch(step_batch([
            b"\xff\xff\xff garbage", boundary_step(nan_rows).SerializeToString(), batched_ok.SerializeToString(),
        ]))  # fmt: skip
        assert [ack.error.code for ack in acks] == [Code.INVALID_ARGUMENT, Code.INVALID_ARGUMENT, 0], acks
        assert "malformed StepRequest" in acks[0].error.message and "non-finite" in acks[1].error.message
        assert validate_step_result(await owner.result(batched_ok.session_id)).shape == (served_b.info.n_vocab,)
        mixed = [
            boundary_step(rows),
            boundary_step(rows, sender_admission=tracker.admission(other_id, swarm_pb2.ROLE_NODE)),
        ]
        for data, fragment in (
            (b"\xff\xff", "malformed StepBatch"),
            (step_batch([]), "holds 1..4096 steps, got 0"),
            (step_batch([m.SerializeToString() for m in mixed]), "different sender admissions"),
        ):
            (ack,) = await relay_batch(data)
            assert ack.error.code == Code.INVALID_ARGUMENT and fragment in ack.error.message, ack
        assert owner.pending_results(good.session_id) == 0

        # The good session carries on, unharmed.
        for _ in range(3):
            assert await run_step(swarm, reference, [good], hops) == 0.0
        # And a relay's valid F16 step at B is served (and answered in logits to the owner).
        session_id = os.urandom(16)
        ack = await relay_send(boundary_step(rows, dtype=WireDType.F16, session_id=session_id))
        assert ack.error.code == 0, ack.error.message
        result = await owner.result(session_id)
        assert validate_step_result(result).shape == (served_b.info.n_vocab,)


async def test_failures_after_the_ack_go_to_the_owner(qwen2_tiny_path: Path) -> None:
    async with open_swarm(qwen2_tiny_path, LAYOUT) as swarm:
        a, b, owner = swarm.nodes["A"], swarm.nodes["B"], swarm.owner
        prompt = await tokenize(swarm, "The quick brown fox")

        # The next hop refuses: A pushes to itself for [3, 6), which it does not serve.
        seq = Seq(os.urandom(16), list(prompt), ref_seq_id=0)
        ack = await owner.send(a.peer_id, seq.request(swarm, swarm.hops(("A", 0, 3), ("A", 3, 6))))
        assert ack.error.code == 0, ack.error.message
        result = await owner.result(seq.session_id)
        assert result.error.code == Code.NOT_FOUND and result.failed_peer_id == a.peer_id
        assert "refused the step" in result.error.message and "does not serve" in result.error.message

        # B's worker dies: the owner hears it from B, and B reports the range FAILED.
        served_b = swarm.served("B", 3, 6)
        served_b.handle.process.kill()
        await served_b.handle.process.wait()
        seq = Seq(os.urandom(16), list(prompt), ref_seq_id=0)
        ack = await owner.send(a.peer_id, seq.request(swarm, swarm.hops(*ROUTE)))
        assert ack.error.code == 0, ack.error.message
        result = await owner.result(seq.session_id)
        # Either B took the step and its Forward failed, or B had already seen its worker exit
        # (a heartbeat came first) and refused it: B is named UNAVAILABLE either way.
        assert result.failed_peer_id == b.peer_id, result
        assert "worker Forward failed" in result.error.message or (
            "refused the step" in result.error.message and "is FAILED on this node" in result.error.message
        ), result.error
        assert result.error.code == Code.UNAVAILABLE, result.error
        b_range = (swarm.model.sha256, 3, 6)
        await swarm.tracker.wait_for(lambda: swarm.tracker.state(b.peer_id, b_range) == State.FAILED)
        assert "worker exited" in swarm.tracker.statuses[b.peer_id][b_range].error

        # The next hop is unreachable.
        swarm.network.down.add(b.peer_id)
        seq = Seq(os.urandom(16), list(prompt), ref_seq_id=0)
        ack = await owner.send(a.peer_id, seq.request(swarm, swarm.hops(*ROUTE)))
        assert ack.error.code == 0, ack.error.message
        result = await owner.result(seq.session_id)
        assert result.error.code == Code.UNAVAILABLE, result.error
        assert result.failed_peer_id == b.peer_id and "unreachable" in result.error.message
        assert result.step == 0 and not result.logits


async def test_unload_reload_failed_load_and_reregistration(qwen2_tiny_path: Path) -> None:
    async with open_swarm(qwen2_tiny_path, {"A": [(0, 3)]}) as swarm:
        tracker, a = swarm.tracker, swarm.nodes["A"]
        key = (swarm.model.sha256, 0, 3)
        served = a.ranges[key]
        process = served.handle.process

        # UNLOAD: the worker stops and the range is no longer reported.
        tracker.assignments[a.peer_id] = set()
        await tracker.wait_for(lambda: key not in tracker.statuses[a.peer_id])
        with trio.fail_after(10):
            await served.stopped.wait()
        assert process.returncode is not None
        ack = await swarm.owner.send(
            a.peer_id, Seq(os.urandom(16), [1, 2], 0).request(swarm, swarm.hops(("A", 0, 3), ("A", 3, 6)))
        )
        assert ack.error.code == Code.NOT_FOUND

        # LOAD of a model the node does not have: reported FAILED with the reason.
        missing = ("f" * 64, 0, 3)
        tracker.assignments[a.peer_id] = {missing}
        await tracker.wait_for(lambda: tracker.state(a.peer_id, missing) == State.FAILED)
        assert "is not on this node" in tracker.statuses[a.peer_id][missing].error

        # The tracker forgets the node: it registers again (fresh nonce) and reloads.
        tracker.known.discard(a.peer_id)
        tracker.assignments[a.peer_id] = {key}
        await tracker.wait_for(lambda: tracker.registrations[a.peer_id] == 2)
        await tracker.wait_for(lambda: tracker.state(a.peer_id, key) == State.READY)
        assert a.registrations == 2


async def test_idle_sessions_are_freed_on_the_nodes_clock(
    qwen2_tiny_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    # The node's leases run on trio's clock: this MockClock runs at wall speed (the workers are
    # real processes) and is jumped past the 60 s lease, so the test takes a second, not a minute.
    mock_clock.rate = 1.0
    async with open_swarm(
        qwen2_tiny_path, {"A": [(0, 6)]}, session_idle_timeout_s=60.0, session_sweep_interval_s=1.0
    ) as swarm:
        a = swarm.nodes["A"]
        served = swarm.served("A", 0, 6)
        seq = Seq(os.urandom(16), [1, 2, 3], ref_seq_id=0)
        hops = swarm.hops(("A", 0, 6))
        assert (await swarm.owner.send(a.peer_id, seq.request(swarm, hops))).error.code == 0
        result = await swarm.owner.result(seq.session_id)
        assert result.error.code == 0 and result.n_vocab == served.info.n_vocab

        async def sweep_after_jump(seconds: float) -> None:
            sweeps = a.sweeps
            mock_clock.jump(seconds)
            with trio.fail_after(10):
                while a.sweeps == sweeps:
                    await trio.sleep(0.01)  # the sweep task wakes on the jumped clock

        await sweep_after_jump(58.0)  # 58 s unused (+ under 1 s of real time): still leased
        assert seq.session_id in served.sessions
        assert (await served.client.health()).active_sequences == 1
        await sweep_after_jump(3.0)  # past 60 s: freed, also on the worker
        assert seq.session_id not in served.sessions
        with trio.fail_after(10):
            while (await served.client.health()).active_sequences:
                await trio.sleep(0.01)  # the serving task removes the sequence between Forwards
        assert served.sessions.free_count == MAX_SEQUENCES


async def test_the_batch_window_runs_on_the_nodes_clock(
    qwen2_tiny_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    # A one-hour batch window: the two steps wait for it together and share one Forward the
    # moment the (mock) clock passes it; on the wall clock this would take an hour.
    mock_clock.rate = 1.0
    async with open_swarm(qwen2_tiny_path, {"A": [(0, 6)]}, batch_window_ms=3_600_000.0) as swarm:
        a = swarm.nodes["A"]
        served = swarm.served("A", 0, 6)
        hops = swarm.hops(("A", 0, 6))
        seqs = [Seq(os.urandom(16), [1, 2, 3], ref_seq_id=0), Seq(os.urandom(16), [4, 5, 6], ref_seq_id=1)]
        for seq in seqs:
            assert (await swarm.owner.send(a.peer_id, seq.request(swarm, hops))).error.code == 0
        assert served.forward_calls == 0
        for _ in range(100):  # (a bounded loop: a fail_after would expire on the jumps)
            if served.in_forward or served.forward_calls:
                break  # no more jumps: the Forward's own deadline runs on this clock too
            mock_clock.jump(3600.0)  # again if the window began after the last jump
            await trio.sleep(0.01)
        assert served.in_forward or served.forward_calls, "the window never ended"
        for seq in seqs:
            with trio.fail_after(10):
                assert (await swarm.owner.result(seq.session_id)).error.code == 0
        assert served.forward_calls == 1 and served.largest_batch == 2


async def test_refused_registration_raises_with_the_reason() -> None:
    network = MemoryNetwork()
    tracker = FakeTracker(network, refuse="wrong llama.cpp pin: node runs 'pin'")
    key, peer_id = new_peer()
    config = node_config(tracker, key, LocalModel("/nowhere.gguf", "0" * 64))
    with pytest.raises(NodeRefused) as caught:
        await serve_node(config, network.add(peer_id))
    assert caught.value.reason == "wrong llama.cpp pin: node runs 'pin'"


async def test_a_tracker_unreachable_at_start_is_retried_with_backoff(autojump_clock, caplog) -> None:
    network = MemoryNetwork()
    tracker = FakeTracker(network, refuse="registered: stop here")
    network.down.add(tracker.transport.peer_id)
    key, peer_id = new_peer()
    config = node_config(
        tracker, key, LocalModel("/nowhere.gguf", "0" * 64), start_retry_initial_s=0.5, start_retry_max_s=4.0
    )
    started = trio.current_time()

    async def tracker_back_after_10_s() -> None:
        await trio.sleep(10)
        network.down.discard(tracker.transport.peer_id)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(tracker_back_after_10_s)
        with pytest.raises(NodeRefused, match="registered: stop here"):  # it got through
            await serve_node(config, network.add(peer_id))
    # tries at 0, 0.5, 1.5, 3.5, 7.5, then 11.5 s: the waits double up to the 4 s cap
    assert trio.current_time() - started == pytest.approx(11.5)
    waits = [r.getMessage() for r in caplog.records if "trying again in" in r.getMessage()]
    assert [w.rsplit("trying again in ", 1)[1] for w in waits] == ["0.5 s", "1.0 s", "2.0 s", "4.0 s", "4.0 s"]
    network.down.add(tracker.transport.peer_id)
    other_key, other_id = new_peer()
    with pytest.raises(NodeError, match="unreachable"):  # bounded when told to be
        await serve_node(
            node_config(tracker, other_key, LocalModel("/nowhere.gguf", "0" * 64), start_retry_timeout_s=2.0),
            network.add(other_id),
        )


async def test_node_requires_the_tracker_key_of_the_dialled_tracker() -> None:
    network = MemoryNetwork()
    tracker = FakeTracker(network)
    _, impostor_id = new_peer()
    network.peers[impostor_id] = tracker.transport  # answers as if it were the real tracker
    key, peer_id = new_peer()
    config = node_config(tracker, key, LocalModel("/nowhere.gguf", "0" * 64), tracker=f"/memory/x/p2p/{impostor_id}")
    with pytest.raises(NodeError, match="the tracker's key belongs to"):
        await serve_node(config, network.add(peer_id))


def test_probe_measures_this_host() -> None:
    probe = probe_host(
        ProbeConfig(reference_n_embd=128, decode_repeats=2, bandwidth_bytes=1 << 20, bandwidth_chunk_bytes=1 << 16)
    )
    commit, patches = expected_pin()
    assert (probe.llama_cpp_commit, probe.patch_series_sha256) == (commit, patches)
    assert any(d.backend == "CPU" for d in probe.devices) and "qwen2" in probe.architectures
    assert probe.cpu_cores >= 1 and 0 < probe.ram_available_bytes <= probe.ram_total_bytes
    assert 0 < probe.decode_s_per_block < 1 and probe.bandwidth_bytes_per_s > 1e6
    assert probe.os and probe.cpu_model


# --- CLI -----------------------------------------------------------------------------------


def parse_cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="baton node")
    node_cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_arguments(tmp_path: Path) -> None:
    args = parse_cli(["--tracker", "/ip4/1.2.3.4/tcp/1/p2p/Qm", "--model", "a.gguf", "--model", "b.gguf", "--key", "k"])
    assert args.model_files == ["a.gguf", "b.gguf"] and args.listen == "/ip4/127.0.0.1/tcp/0"
    assert args.memory_bytes is None and args.threads is None
    with pytest.raises(SystemExit):
        parse_cli(["--tracker", "/ip4/1.2.3.4/tcp/1/p2p/Qm", "--model", "a.gguf", "--key", "k", "--threads", "0"])
    assert args.relay is False
    hidden = parse_cli(
        ["--tracker", "/ip4/1.2.3.4/tcp/1/p2p/Qm", "--model", "a", "--key", "k", "--listen", "none", "--relay"]
    )
    assert hidden.relay is True and node_cli.listen_addrs(hidden.listen) == []
    assert node_cli.listen_addrs("") == [] and node_cli.listen_addrs("/ip4/0.0.0.0/tcp/9") == ["/ip4/0.0.0.0/tcp/9"]


async def test_cli_refuses_a_node_nobody_could_reach(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_cli(
        ["--tracker", "/ip4/1.2.3.4/tcp/1/p2p/Qm", "--model", "a", "--key", str(tmp_path / "k"), "--listen", "none"]
    )
    assert await node_cli.run(args) == node_cli.EXIT_SETUP
    assert "--listen none needs --relay" in capsys.readouterr().err


async def test_cli_refuses_a_model_that_is_not_gguf_before_hashing_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("# some notes, not a model\n")
    args = parse_cli(["--tracker", "/ip4/1.2.3.4/tcp/1/p2p/Qm", "--model", str(not_gguf), "--key", str(tmp_path / "k")])
    assert await node_cli.run(args) == node_cli.EXIT_SETUP
    err = capsys.readouterr().err
    assert f"baton node: model {not_gguf}: not a GGUF file (it starts with b'# so', not b'GGUF')" in err, err


async def test_cli_refuses_a_models_dir_that_cannot_be_a_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "models"
    a_file.write_text("")
    args = parse_cli(
        ["--tracker", "/ip4/1.2.3.4/tcp/1/p2p/Qm", "--models-dir", str(a_file), "--key", str(tmp_path / "k")]
    )
    assert await node_cli.run(args) == node_cli.EXIT_SETUP
    assert f"baton node: --models-dir {a_file}: it exists and is not a directory" in capsys.readouterr().err


async def test_relay_needs_a_transport_that_can_reserve() -> None:
    network = MemoryNetwork()
    key = Ed25519PrivateKey.generate()
    transport = network.add(peer_id_from_public_key(public_key_bytes(key)))
    with pytest.raises(ValueError, match="relay"):
        Node(NodeConfig(tracker="/ip4/1.2.3.4/tcp/1/p2p/12D3KooWTracker", key=key, relay=True), transport)


def test_model_hash_is_cached_in_a_sidecar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib

    from agent import models

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(1000))
    expected = hashlib.sha256(model.read_bytes()).hexdigest()
    monkeypatch.setattr(models, "_verified", {})
    assert models.cached_sha256(model) == expected
    sidecar = tmp_path / "m.gguf.sha256-ok"
    assert sidecar.exists()
    # A later process (no memory) trusts a sidecar that matches size and mtime (no re-hash) ...
    sidecar.write_text(sidecar.read_text().replace(expected, "a" * 64))
    monkeypatch.setattr(models, "_verified", {})
    assert models.cached_sha256(model) == "a" * 64
    # ... and not one that does not match the file.
    model.write_bytes(b"GGUF" + bytes(1001))
    assert models.cached_sha256(model) == hashlib.sha256(model.read_bytes()).hexdigest()


async def test_cli_main_reports_refusal_with_exit_code_3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    network = MemoryNetwork()
    tracker = FakeTracker(network, refuse="too little memory: 5 bytes")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(100))

    @contextlib.asynccontextmanager
    async def memory_transport(key, listen_addrs, channel=True, punch=True):
        yield network.add(peer_id_from_public_key(public_key_bytes(key)))

    monkeypatch.setattr(node_cli, "open_transport", memory_transport)
    monkeypatch.setattr(node_cli, "probe_host", lambda *a, **k: PROBE)
    args = parse_cli(["--tracker", tracker.addr, "--model", str(model), "--key", str(tmp_path / "keys" / "node.key")])
    code = await node_cli.run(args)
    assert code == 3
    out = capsys.readouterr()
    assert "node refused: too little memory: 5 bytes" in out.out + out.err
    # The tracker saw a signed registration that lists the model's hash.
    (fingerprint,) = tracker.fingerprints.values()
    assert list(fingerprint.model_sha256s) == [cached_sha256(model)]
    assert not tracker.registrations


async def test_cli_main_prints_admission_and_offers_the_given_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    network = MemoryNetwork()
    tracker = FakeTracker(network)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(100))
    peers: list[str] = []

    @contextlib.asynccontextmanager
    async def memory_transport(key, listen_addrs, channel=True, punch=True):
        peers.append(peer_id_from_public_key(public_key_bytes(key)))
        yield network.add(peers[-1])

    monkeypatch.setattr(node_cli, "open_transport", memory_transport)
    monkeypatch.setattr(node_cli, "probe_host", lambda *a, **k: PROBE)
    argv = ["--tracker", tracker.addr, "--model", str(model), "--key", str(tmp_path / "keys" / "node.key")]
    args = parse_cli([*argv, "--memory-bytes", "12345", "--heartbeat-interval-ms", "20"])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(node_cli.run, args)
        await tracker.wait_for(lambda: bool(peers) and peers[0] in tracker.statuses)
        nursery.cancel_scope.cancel()
    assert f"node {peers[0]} admitted" in capsys.readouterr().out
    assert tracker.fingerprints[peers[0]].usable_memory_bytes == 12345
    assert (tmp_path / "keys" / "node.key").stat().st_mode & 0o077 == 0


async def test_baton_node_stops_its_workers_on_sigterm(tmp_path: Path, qwen2_tiny_path: Path) -> None:
    """A real ``baton node`` process over libp2p, given a LOAD: SIGTERM stops its worker too."""
    from agent.io.net.p2p import open_p2p_transport

    tracker_key, _ = new_peer()
    async with open_p2p_transport(tracker_key) as transport:
        tracker = FakeTracker(None, key=tracker_key, transport=transport)
        argv = [
            sys.executable, "-m", "agent.cli", "node", "--tracker", tracker.addr, "--model", str(qwen2_tiny_path),
            "--key", str(tmp_path / "node.key"), "--threads", "1", "--ctx-size", "64", "--max-sequences", "2",
        ]  # fmt: skip
        # a node that runs beside the test's own tracker until the test ends it
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # noqa: ASYNC220
        try:
            await tracker.wait_for(lambda: bool(tracker.known), timeout_s=60)
            (peer_id,) = tracker.known
            key = (TINY_MODELS["qwen2-tiny"].sha256, 0, 6)
            tracker.assignments[peer_id] = {key}
            await tracker.wait_for(lambda: tracker.state(peer_id, key) == State.READY, timeout_s=60)
            workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if "baton-worker" in p.name()]
            assert len(workers) == 1
            proc.send_signal(signal.SIGTERM)
            out, _ = await trio.to_thread.run_sync(lambda: proc.communicate(timeout=30))
            assert proc.returncode == 0, out
            assert f"node {peer_id} admitted" in out and "directive LOAD" in out, out
            assert not workers[0].is_running(), "the worker was stopped with the node"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
