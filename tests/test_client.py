"""The session owner's shell (agent.io.client) against a fake tracker and fake nodes on a
``MemoryNetwork``: hello, route, tokenize, the step loop, results pushed back, and every way
a step can fail (a hop's error result, a refused or unreachable first hop, no result in time,
results that are not the client's to take)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time

import numpy as np
import pytest
import trio
import trio.testing
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent._proto import swarm_pb2
from agent.core.net.identity import peer_id_from_public_key
from agent.core.node.policy import check_step_sender, push_unreachable
from agent.core.wire.admission import (
    AdmissionError,
    issue_admission,
    public_key_bytes,
    verify_admission,
    verify_client_hello,
)
from agent.core.wire.boundary import BoundarySchema
from agent.core.wire.step_requests import boundary_step_request
from agent.core.wire.step_results import step_result, step_result_error
from agent.core.wire.swarm_wire import (
    NODE_PROTOCOL,
    RESULT_PROTOCOL,
    STEP_PROTOCOL,
    TRACKER_PROTOCOL,
    WireError,
)
from agent.io.client import GenerationError, SwarmClientConfig, SwarmError, open_swarm_client
from agent.io.net.channel import open_channel_transport
from agent.io.net.transport import MemoryNetwork, TransportError

pytestmark = pytest.mark.unit

ALPHABET = "abcdefghijklmnop"  # the fake model's vocabulary: token i is ALPHABET[i]
N_VOCAB = len(ALPHABET)
EOG = ALPHABET.index("p")
N_EMBD = 4
N_LAYER = 30
MODEL_SHA = "5a" * 32
RECIPE = "recipe-1"
TTL_MS = 600_000


def now_ms() -> int:
    return time.time_ns() // 1_000_000  # admissions use the wall clock, also under MockClock


def new_key() -> tuple[Ed25519PrivateKey, str]:
    key = Ed25519PrivateKey.generate()
    return key, peer_id_from_public_key(public_key_bytes(key))


def fake_logits(last_token: int, position: int) -> np.ndarray:
    """The fake model: the next token is most likely ``last_token + 1``; a spread tail lets
    sampling pick others."""
    target = (last_token + 1) % N_VOCAB
    distance = np.abs(np.arange(N_VOCAB) - target)
    return (-1.5 * distance + 0.01 * (position % 3)).astype(np.float32)


def greedy_continuation(prompt: str, n: int) -> list[int]:
    tokens = [ALPHABET.index(c) for c in prompt]
    out = []
    for _ in range(n):
        tokens.append((tokens[-1] + 1) % N_VOCAB)
        out.append(tokens[-1])
        if tokens[-1] == EOG:
            break
    return out


class FakeTracker:
    """Client hello + route + list models; the route is whatever the test sets."""

    def __init__(self, transport, key: Ed25519PrivateKey) -> None:
        self.key, self.peer_id = key, transport.peer_id
        self.transport = transport
        self.transport.set_handler(TRACKER_PROTOCOL, self.handle)
        self.routes: list[swarm_pb2.Route] = []  # served in turn; the last one repeats
        self.route_error: swarm_pb2.Error | None = None
        self.refuse_hello: str | None = None
        self.public_key_override: bytes | None = None
        self.route_requests = 0
        self.handouts_ended: list[list[int]] = []  # session_ended reports, in order
        self.lost_reports: list[str] = []
        self.avoided: list[list[str]] = []  # avoid_peers of each route request
        self.withdrawn: dict[str, str] = {}  # peers that failed integrity checks -> why
        self.integrity_asked: list[list[str]] = []
        self.mismatches: list[swarm_pb2.ReportMismatchRequest] = []
        self.alternate: swarm_pb2.Route | None = None  # served to route requests that avoid peers

    @property
    def addr(self) -> str:
        return self.transport.listen_addrs[0]

    @property
    def public_key(self) -> bytes:
        return public_key_bytes(self.key)

    def admission(self, peer_id: str, role: int) -> swarm_pb2.SignedAdmission:
        now = now_ms()
        record = swarm_pb2.AdmissionRecord(
            schema_version=1, peer_id=peer_id, role=role, tracker_peer_id=self.peer_id,
            issued_at_ms=now, expires_at_ms=now + TTL_MS,
        )  # fmt: skip
        return issue_admission(self.key, record)

    async def handle(self, remote: str, payload: bytes) -> bytes:
        request = swarm_pb2.TrackerRequest.FromString(payload)
        reply = swarm_pb2.TrackerReply(schema_version=1)
        kind = request.WhichOneof("body")
        if kind == "client_hello":
            if self.refuse_hello:
                reply.error.CopyFrom(swarm_pb2.Error(code=swarm_pb2.Error.REFUSED, message=self.refuse_hello))
            else:
                verify_client_hello(request.client_hello, remote)
                reply.client_hello.admission.CopyFrom(self.admission(remote, swarm_pb2.ROLE_CLIENT))
                reply.client_hello.tracker_public_key = self.public_key_override or self.public_key
        elif kind == "report_lost_peer":
            self.lost_reports.append(request.report_lost_peer.peer_id)
            reply.report_lost_peer.confirmed = True
        elif kind == "integrity":
            self.integrity_asked.append(list(request.integrity.peer_ids))
            for peer in request.integrity.peer_ids:
                if peer in self.withdrawn:
                    reply.integrity.withdrawn.add(peer_id=peer, reason=self.withdrawn[peer])
        elif kind == "report_mismatch":
            self.mismatches.append(request.report_mismatch)
            reply.report_mismatch.checks_scheduled = 1
        elif kind == "route":
            self.route_requests += 1
            self.avoided.append(list(request.route.avoid_peers))
            if self.route_error is not None:
                reply.error.CopyFrom(self.route_error)
            elif request.route.avoid_peers and self.alternate is not None:
                reply.route.CopyFrom(self.alternate)
            else:
                route = self.routes[0] if len(self.routes) == 1 else self.routes.pop(0)
                reply.route.CopyFrom(route)
                reply.route.handout_id = self.route_requests  # a new one for every route handed out
        elif kind == "session_ended":
            self.handouts_ended.append(list(request.session_ended.handout_ids))
        return reply.SerializeToString()


@dataclasses.dataclass
class Behaviour:
    refuse_step: str | None = None  # ack every step with this error
    silent: bool = False  # ack, then never push anything
    duplicate_result: bool = False  # push every result twice
    freeze_after_steps: int | None = None  # then answer nothing at all (SIGSTOP)
    corrupt: bool = False  # (last hop) wrong logits: the next token is 2 ahead, not 1
    probes_missed: int = 0  # leave this many probes (touch / empty NodeRequests) unanswered
    first_result_delay_s: float = 0.0  # (last hop) push the result of step 0 this much later


class FakeNode:
    """Serves [begin, end) of the fake model: acks steps at once, works in the background."""

    def __init__(
        self, transport, key: Ed25519PrivateKey, tracker: FakeTracker, nursery: trio.Nursery, begin: int, end: int
    ) -> None:
        self.key, self.peer_id = key, transport.peer_id
        self.tracker = tracker
        self.begin, self.end = begin, end
        self.behaviour = Behaviour()
        self.transport = transport
        self.transport.set_handler(STEP_PROTOCOL, self.on_step)
        self.transport.set_handler(NODE_PROTOCOL, self.on_node)
        self.admission = tracker.admission(self.peer_id, swarm_pb2.ROLE_NODE)
        self.nursery = nursery
        self.ended: list[bytes] = []
        self.steps: list[swarm_pb2.StepRequest] = []
        self.result_acks: list[swarm_pb2.StepAck] = []

    def hop(self) -> swarm_pb2.Hop:
        return swarm_pb2.Hop(peer_id=self.peer_id, addrs=self.transport.listen_addrs, begin=self.begin, end=self.end)

    def check_sender(
        self, signed: swarm_pb2.SignedAdmission, remote: str, step: swarm_pb2.StepRequest | None = None
    ) -> str | None:
        """Why the sender may not send this (a node's rules: its admission, and for a
        ``step``, ``check_step_sender``), or None."""
        try:
            record = verify_admission(
                signed, self.tracker.public_key, remote, now_ms(), roles=[swarm_pb2.ROLE_NODE, swarm_pb2.ROLE_CLIENT]
            )
            if step is not None:
                check_step_sender(record.role, remote, step.begin, step.end, step.owner_peer_id)
        except AdmissionError as error:
            return error.reason
        except WireError as error:
            return error.message
        return None

    async def freeze_if_told(self) -> None:
        after = self.behaviour.freeze_after_steps
        if after is not None and len(self.steps) >= after:
            await trio.sleep_forever()

    async def on_step(self, remote: str, payload: bytes) -> bytes:
        await self.freeze_if_told()
        request = swarm_pb2.StepRequest.FromString(payload)
        ack = swarm_pb2.StepAck(schema_version=1)
        refusal = self.behaviour.refuse_step or self.check_sender(request.sender_admission, remote, request)
        if refusal:
            ack.error.CopyFrom(swarm_pb2.Error(code=swarm_pb2.Error.REFUSED, message=refusal))
            return ack.SerializeToString()
        self.steps.append(request)
        if not self.behaviour.silent:
            self.nursery.start_soon(self.work, request)
        return ack.SerializeToString()

    async def work(self, request: swarm_pb2.StepRequest) -> None:
        if request.token_ids:
            rows = np.zeros((len(request.positions), N_EMBD), np.float32)
            rows[:, 0] = request.token_ids
            rows[:, 1] = request.positions
        else:
            rows = np.frombuffer(request.boundary, np.float32).reshape(-1, N_EMBD)
        if request.rest:
            nxt = request.rest[0]
            forward = boundary_step_request(
                session_id=request.session_id, step=request.step, hops=request.rest, positions=request.positions,
                dtype=swarm_pb2.DTYPE_F32, schema=BoundarySchema.declared(0, 1, N_EMBD),
                recipe_hash=request.recipe_hash, model_sha256=request.model_sha256,
                owner_peer_id=request.owner_peer_id, owner_addrs=request.owner_addrs,
                sender_admission=self.admission, rows=rows, result_top_k=request.result_top_k,
                resume_step=request.resume_step,
            )  # fmt: skip
            try:
                await self.transport.request(
                    nxt.peer_id, nxt.addrs, STEP_PROTOCOL, forward.SerializeToString(), timeout_s=5
                )
            except TransportError as error:  # as a real node does: tell the owner who failed
                failure = push_unreachable(nxt.peer_id, str(error))
                await self.push_result(
                    request,
                    step_result_error(request.session_id, request.step, failure.code, failure.message,
                                      failure.failed_peer_id, self.admission),
                )  # fmt: skip
            return
        if request.step == 0 and self.behaviour.first_result_delay_s:
            await trio.sleep(self.behaviour.first_result_delay_s)
        logits = fake_logits(int(rows[-1, 0]) + self.behaviour.corrupt, int(rows[-1, 1]))
        result = step_result(request.session_id, request.step, logits, self.admission)
        await self.push_result(request, result)
        if self.behaviour.duplicate_result:
            await self.push_result(request, result)

    async def push_result(self, request: swarm_pb2.StepRequest, result: swarm_pb2.StepResult) -> None:
        raw = await self.transport.request(
            request.owner_peer_id, request.owner_addrs, RESULT_PROTOCOL, result.SerializeToString(), timeout_s=5
        )
        self.result_acks.append(swarm_pb2.StepAck.FromString(raw))

    async def on_node(self, remote: str, payload: bytes) -> bytes:
        await self.freeze_if_told()
        request = swarm_pb2.NodeRequest.FromString(payload)
        if request.WhichOneof("body") in (None, "touch") and self.behaviour.probes_missed > 0:
            self.behaviour.probes_missed -= 1  # as a lost packet on a lossy link: no answer in time
            await trio.sleep_forever()
        reply = swarm_pb2.NodeReply(schema_version=1)
        refusal = self.check_sender(request.sender_admission, remote)
        if refusal:
            reply.error.CopyFrom(swarm_pb2.Error(code=swarm_pb2.Error.REFUSED, message=refusal))
            return reply.SerializeToString()
        kind = request.WhichOneof("body")
        if kind == "tokenize":
            assert request.tokenize.model_sha256 == MODEL_SHA
            reply.token_ids.extend(ALPHABET.index(c) for c in request.tokenize.text)
            reply.eog_token_ids.append(EOG)
        elif kind == "detokenize":
            reply.text = "".join(ALPHABET[t] for t in request.detokenize.token_ids).encode()
        elif kind == "end_session":
            self.ended.append(bytes(request.end_session.session_id))
        return reply.SerializeToString()


LAYOUT = ((0, 10), (10, 20), (20, 30))


class Swarm:
    def __init__(self, nursery: trio.Nursery, network: MemoryNetwork | None = None, peers: list | None = None) -> None:
        """``peers``: the (transport, key) of each peer, in the order they are made (tracker,
        the nodes, the client), when they are not the network's plain memory transports."""
        self.network = network or MemoryNetwork()
        self.nursery = nursery
        self._peers = peers
        self.tracker = FakeTracker(*self.peer())
        self.nodes = [self.node(b, e) for b, e in LAYOUT]
        self.tracker.routes = [self.route(self.nodes)]
        self.client_transport, self.client_key = self.peer()
        self.client_peer_id = self.client_transport.peer_id

    def peer(self):
        if self._peers is not None:
            return self._peers.pop(0)
        key, peer_id = new_key()
        return self.network.add(peer_id), key

    def node(self, begin: int, end: int) -> FakeNode:
        return FakeNode(*self.peer(), self.tracker, self.nursery, begin, end)

    def route(self, nodes: list[FakeNode]) -> swarm_pb2.Route:
        return swarm_pb2.Route(
            model_sha256=MODEL_SHA, n_layer=N_LAYER, recipe_hash=RECIPE, hops=[n.hop() for n in nodes]
        )

    def client(self, config: SwarmClientConfig | None = None):
        return open_swarm_client(
            self.tracker.addr, key=self.client_key, transport=self.client_transport,
            config=config or SwarmClientConfig(replan_attempts=0),
        )  # fmt: skip


@pytest.fixture
async def swarm():
    async with trio.open_nursery() as nursery:
        yield Swarm(nursery)
        nursery.cancel_scope.cancel()


@pytest.fixture
async def channel_swarm():
    """``swarm`` with the direct channel (real TLS on loopback) in front of every peer's
    memory transport: the client's steps reach the first hop over it."""
    network = MemoryNetwork()
    async with contextlib.AsyncExitStack() as transports:
        peers = []
        for _ in range(2 + len(LAYOUT)):  # the tracker, the nodes, the client
            key, peer_id = new_key()
            peers.append((await transports.enter_async_context(open_channel_transport(key, network.add(peer_id))), key))
        async with trio.open_nursery() as nursery:
            yield Swarm(nursery, network, peers)
            nursery.cancel_scope.cancel()


# --- the happy path ----------------------------------------------------------------------------


async def test_greedy_generation_through_three_hops(swarm: Swarm) -> None:
    pieces: list[str] = []
    async with swarm.client() as client:
        result = await client.generate("smol", "abc", max_tokens=6, on_text=pieces.append)
    assert result.tokens == greedy_continuation("abc", 6) == [3, 4, 5, 6, 7, 8]
    assert result.text == "defghi" == "".join(pieces)
    assert result.prompt_tokens == [0, 1, 2]
    assert result.route == [{"node": n.peer_id, "begin": n.begin, "end": n.end} for n in swarm.nodes]
    assert result.decode_steps == 5 and result.tokens_per_s > 0
    assert not result.stopped_by_token
    first = swarm.nodes[0]
    # prefill, then one row per step at the next position; rest = the other hops
    assert [list(s.positions) for s in first.steps] == [[0, 1, 2], [3], [4], [5], [6], [7]]
    assert [list(s.token_ids) for s in first.steps] == [[0, 1, 2], [3], [4], [5], [6], [7]]
    assert all([h.peer_id for h in s.rest] == [swarm.nodes[1].peer_id, swarm.nodes[2].peer_id] for s in first.steps)
    assert {s.owner_peer_id for s in first.steps} == {swarm.client_peer_id}
    assert len({bytes(s.session_id) for s in first.steps}) == 1
    assert first.ended == [bytes(first.steps[0].session_id)]  # freed along the route
    assert all(not ack.error.code for n in swarm.nodes for ack in n.result_acks)
    assert swarm.tracker.handouts_ended == [[swarm.tracker.route_requests]]  # its route counts no more


async def test_a_prompt_longer_than_a_step_goes_in_chunks(swarm: Swarm) -> None:
    async with swarm.client(SwarmClientConfig(prefill_chunk_tokens=4)) as client:
        result = await client.generate("smol", "abcdefghij", max_tokens=3)
    assert result.tokens == greedy_continuation("abcdefghij", 3)
    positions = [list(s.positions) for s in swarm.nodes[0].steps]
    assert positions == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [10], [11]]
    assert [s.step for s in swarm.nodes[0].steps] == [0, 1, 2, 3, 4]
    assert result.decode_steps == 2 and result.hop_rows[0]["rows"] == 12


async def test_an_end_of_generation_token_stops_and_stays_out_of_the_text(swarm: Swarm) -> None:
    async with swarm.client() as client:
        result = await client.generate("smol", "mn", max_tokens=10)
    assert result.tokens == [ALPHABET.index("o"), EOG]
    assert result.stopped_by_token and result.text == "o"


async def test_seeded_sampling_is_reproducible_through_the_swarm(swarm: Swarm) -> None:
    async with swarm.client() as client:
        runs = [
            (await client.generate("smol", "a", max_tokens=12, temperature=1.5, top_k=8, top_p=0.95, seed=seed)).tokens
            for seed in (1, 1, 2, 3, 4)
        ]
        greedy = (await client.generate("smol", "a", max_tokens=12)).tokens
    assert runs[0] == runs[1]
    assert len({tuple(run) for run in runs[1:]} | {tuple(greedy)}) > 2  # seeds matter, it samples


async def test_invalid_sampling_parameters_are_refused_before_any_step(swarm: Swarm) -> None:
    async with swarm.client() as client:
        with pytest.raises(ValueError, match="top_p"):
            await client.generate("smol", "abc", top_p=0.0, temperature=1.0)
        with pytest.raises(ValueError, match="max_tokens"):
            await client.generate("smol", "abc", max_tokens=0)
    assert swarm.nodes[0].steps == []


# --- failures ------------------------------------------------------------------------------------


async def test_a_failed_hop_is_named(swarm: Swarm) -> None:
    swarm.network.down.add(swarm.nodes[2].peer_id)  # vanished: the middle hop cannot push to it
    async with swarm.client() as client:
        with pytest.raises(GenerationError, match=r"UNAVAILABLE: next hop \S+ unreachable") as caught:
            await client.generate("smol", "abc", max_tokens=4)
    assert caught.value.failed_peer_id == swarm.nodes[2].peer_id
    assert caught.value.step == 0
    assert swarm.nodes[0].ended  # the session is still ended on the route


async def test_a_first_hop_that_refuses_the_step_is_named(swarm: Swarm) -> None:
    swarm.nodes[0].behaviour.refuse_step = "recipe_hash mismatch"
    async with swarm.client() as client:
        with pytest.raises(GenerationError, match="refused the step: REFUSED: recipe_hash mismatch") as caught:
            await client.generate("smol", "abc", max_tokens=4)
    assert caught.value.failed_peer_id == swarm.nodes[0].peer_id
    # a live peer that refused still gets the end-session (it may hold the session's sequence)
    assert len(swarm.nodes[0].ended) == 1


async def test_over_the_channel_steps_leave_without_a_task_and_a_refusal_still_names_the_first_hop(
    channel_swarm: Swarm,
) -> None:
    # Once a channel connection to the first hop is open, the client sends each step with
    # request_soon and reads its ack in a callback; a step the hop refuses still ends the
    # generation with the hop named, as when the ack was awaited.
    swarm, first = channel_swarm, channel_swarm.nodes[0]
    async with swarm.client() as client:
        result = await client.generate("smol", "abc", max_tokens=6)
        assert result.tokens == greedy_continuation("abc", 6)
        sent_soon = swarm.client_transport.requests_sent_soon
        assert sent_soon == 6  # every step: tokenizing the prompt on the first hop dialled it
        steps_before = len(first.steps)

        def refuse_after_two(_text: str) -> None:
            if len(first.steps) - steps_before == 2:
                first.behaviour.refuse_step = "recipe_hash mismatch"

        with pytest.raises(GenerationError, match="refused the step: REFUSED: recipe_hash mismatch") as caught:
            await client.generate("smol", "abc", max_tokens=6, on_text=refuse_after_two)
    assert caught.value.failed_peer_id == first.peer_id and caught.value.step == 2
    assert swarm.client_transport.requests_sent_soon == sent_soon + 3  # the refused step too


async def test_an_unreachable_first_hop_is_named(swarm: Swarm) -> None:
    first, last = swarm.nodes[0], swarm.nodes[2]
    original_work = last.work

    async def work_then_first_vanishes(request: swarm_pb2.StepRequest) -> None:
        await original_work(request)
        swarm.network.down.add(first.peer_id)

    last.work = work_then_first_vanishes
    async with swarm.client() as client:
        with pytest.raises(GenerationError, match="step 1: first hop unreachable") as caught:
            await client.generate("smol", "abc", max_tokens=4)
        assert caught.value.failed_peer_id == first.peer_id
        # already gone before the generation starts: tokenizing on it fails
        with pytest.raises(
            GenerationError, match=f"tokenize on first hop {first.peer_id} failed: .*unreachable"
        ) as caught:
            await client.generate("smol", "abc", max_tokens=4)
        assert caught.value.failed_peer_id == first.peer_id


async def test_no_result_in_time_is_a_clear_error(swarm: Swarm, autojump_clock: trio.testing.MockClock) -> None:
    swarm.nodes[2].behaviour.silent = True
    async with swarm.client(SwarmClientConfig(step_timeout_s=7.0, replan_attempts=0)) as client:
        started = trio.current_time()
        with pytest.raises(
            GenerationError, match=r"no result for step 0 of session [0-9a-f]{32} within 7.0 s"
        ) as caught:
            await client.generate("smol", "abc", max_tokens=4)
        assert trio.current_time() - started == pytest.approx(7.0)
    assert swarm.nodes[0].peer_id in str(caught.value)  # the route is in the message


async def test_a_frozen_hop_is_named_by_its_step_deadline_reported_and_routed_around(
    swarm: Swarm, autojump_clock: trio.testing.MockClock
) -> None:
    spare = swarm.node(10, 20)
    frozen = swarm.nodes[1]
    swarm.tracker.routes = [swarm.route(swarm.nodes), swarm.route([swarm.nodes[0], spare, swarm.nodes[2]])]
    frozen.behaviour.freeze_after_steps = 4  # prefill and three decode steps, then nothing
    config = SwarmClientConfig(step_timeout_s=30.0, replan_attempts=1, min_step_deadline_s=1.0, probe_timeout_s=0.5)
    async with swarm.client(config) as client:
        started = trio.current_time()
        result = await client.generate("smol", "abc", max_tokens=8)
        elapsed = trio.current_time() - started
    assert result.tokens == greedy_continuation("abc", 8) and result.replans == 1
    # named after the 1 s deadline and a 0.5 s probe, not after the 30 s step timeout
    assert elapsed < 3.0
    assert swarm.tracker.lost_reports == [frozen.peer_id]
    assert [frozen.peer_id] in swarm.tracker.avoided  # the new route was asked to avoid it
    assert [hop["node"] for hop in result.route] == [swarm.nodes[0].peer_id, spare.peer_id, swarm.nodes[2].peer_id]


async def test_a_first_hop_frozen_before_it_acks_a_step_is_named_by_a_probe(
    swarm: Swarm, autojump_clock: trio.testing.MockClock
) -> None:
    spare = swarm.node(0, 10)
    frozen = swarm.nodes[0]
    swarm.tracker.routes = [swarm.route(swarm.nodes), swarm.route([spare, swarm.nodes[1], swarm.nodes[2]])]
    frozen.behaviour.freeze_after_steps = 4  # the fifth step is never acknowledged
    config = SwarmClientConfig(request_timeout_s=10.0, replan_attempts=1, min_step_deadline_s=1.0, probe_timeout_s=0.5)
    async with swarm.client(config) as client:
        started = trio.current_time()
        result = await client.generate_tokens("smol", [5, 6, 7], max_tokens=8)
        elapsed = trio.current_time() - started
    assert result.replans == 1 and len(result.tokens) == 8
    assert elapsed < 3.0  # the step deadline and a probe, not the 10 s request timeout
    assert swarm.tracker.lost_reports == [frozen.peer_id]


async def test_a_hop_lost_while_it_computes_the_prefill_is_named_by_a_probe(
    swarm: Swarm, autojump_clock: trio.testing.MockClock
) -> None:
    """A prefill has no measured step time: its hops are probed every ``probe_interval_s``
    while it waits, so a hop that acknowledged the prompt and then vanished is named in about
    that time, not after ``step_timeout_s``."""
    spare = swarm.node(20, 30)
    lost = swarm.nodes[2]
    swarm.tracker.routes = [swarm.route(swarm.nodes), swarm.route([swarm.nodes[0], swarm.nodes[1], spare])]
    lost.behaviour.silent = True  # takes the prompt, pushes nothing ...
    lost.behaviour.freeze_after_steps = 1  # ... and answers nothing after it
    config = SwarmClientConfig(step_timeout_s=30.0, replan_attempts=1, probe_interval_s=1.0, probe_timeout_s=0.5)
    async with swarm.client(config) as client:
        started = trio.current_time()
        result = await client.generate("smol", "abc", max_tokens=4)
        elapsed = trio.current_time() - started
    assert result.tokens == greedy_continuation("abc", 4) and result.replans == 1
    assert elapsed < 3.0  # one probe interval and one probe timeout
    assert swarm.tracker.lost_reports == [lost.peer_id]


async def test_a_hop_that_misses_one_probe_is_not_named(swarm: Swarm, autojump_clock: trio.testing.MockClock) -> None:
    """On a link that drops packets a probe can go unanswered by a live hop: it is probed
    again, with more time, before it is named, so a slow prefill on a lossy route goes on."""
    last = swarm.nodes[2]
    last.behaviour.first_result_delay_s = 2.8  # past the first probe round at 1 s
    last.behaviour.probes_missed = 1
    config = SwarmClientConfig(step_timeout_s=30.0, replan_attempts=0, probe_interval_s=1.0, probe_timeout_s=0.5)
    async with swarm.client(config) as client:
        result = await client.generate("smol", "abc", max_tokens=4)
    assert result.tokens == greedy_continuation("abc", 4) and result.replans == 0
    assert swarm.tracker.lost_reports == []


async def test_a_result_that_arrives_while_its_hops_are_probed_reaches_the_caller(
    swarm: Swarm, autojump_clock: trio.testing.MockClock
) -> None:
    """The session takes a result the moment it arrives; a probe round that then names a hop
    (here: a probe lost twice) must not drop that token from what the caller is given (it was
    generated, and the next step goes on from it)."""
    spare = swarm.node(20, 30)
    last = swarm.nodes[2]
    swarm.tracker.routes = [swarm.route(swarm.nodes), swarm.route([swarm.nodes[0], swarm.nodes[1], spare])]
    last.behaviour.first_result_delay_s = 1.2  # arrives during the probes of 1.0-2.5 s
    last.behaviour.probes_missed = 2
    config = SwarmClientConfig(step_timeout_s=30.0, replan_attempts=1, probe_interval_s=1.0, probe_timeout_s=0.5)
    streamed: list[int] = []

    async def on_token(token: int, _logits, _route) -> bool:
        streamed.append(token)
        return False

    async with swarm.client(config) as client:
        result = await client.generate_tokens(
            "smol", [ALPHABET.index(c) for c in "abc"], max_tokens=4, on_token=on_token
        )
    # the hop whose result came is not replaced (a resume would go on from the token the session
    # took, with the caller never given it)
    assert result.replans == 0 and swarm.tracker.lost_reports == []
    assert streamed == result.tokens == greedy_continuation("abc", 4)


async def test_with_the_tracker_gone_new_generations_use_the_last_route(swarm: Swarm) -> None:
    async with swarm.client() as client:
        first = await client.generate("smol", "abc", max_tokens=3)
        swarm.network.down.add(swarm.tracker.peer_id)  # the tracker vanished
        again = await client.generate("smol", "abc", max_tokens=3)
    assert again.tokens == first.tokens and again.route == first.route


async def test_the_route_error_from_the_tracker_is_raised(swarm: Swarm) -> None:
    swarm.tracker.route_error = swarm_pb2.Error(
        code=swarm_pb2.Error.UNAVAILABLE, message="no route for model smol: blocks [10, 20) have no ready node"
    )
    async with swarm.client() as client:
        with pytest.raises(SwarmError, match=r"UNAVAILABLE .*blocks \[10, 20\) have no ready node") as caught:
            await client.generate("smol", "abc")
    assert caught.value.code == swarm_pb2.Error.UNAVAILABLE


async def test_a_refused_hello_is_raised(swarm: Swarm) -> None:
    swarm.tracker.refuse_hello = "replayed registration: nonce seen"
    with pytest.raises(SwarmError, match=r"REFUSED .*replayed registration"):
        async with swarm.client():
            pass


async def test_a_tracker_key_of_another_peer_is_refused(swarm: Swarm) -> None:
    swarm.tracker.public_key_override = public_key_bytes(Ed25519PrivateKey.generate())
    with pytest.raises(SwarmError, match="public key belongs to"):
        async with swarm.client():
            pass


async def test_a_transport_given_without_its_key_is_refused(swarm: Swarm) -> None:
    with pytest.raises(ValueError, match="needs its key"):
        async with open_swarm_client(swarm.tracker.addr, transport=swarm.client_transport):
            pass
    with pytest.raises(ValueError, match="/p2p/"):
        async with open_swarm_client("/ip4/127.0.0.1/tcp/1", key=swarm.client_key, transport=swarm.client_transport):
            pass


async def test_replanning_moves_to_a_route_without_the_failed_peer(swarm: Swarm, nursery: trio.Nursery) -> None:
    spare = swarm.node(20, 30)
    last = swarm.nodes[2]
    healed = swarm.route([swarm.nodes[0], swarm.nodes[1], spare])
    original_work = last.work

    async def work_then_vanish(request: swarm_pb2.StepRequest) -> None:
        await original_work(request)
        if request.step == 1:  # gone after two steps; the tracker then routes around it
            swarm.network.down.add(last.peer_id)
            swarm.tracker.routes = [healed]

    last.work = work_then_vanish
    config = SwarmClientConfig(replan_attempts=1, replan_wait_s=5.0, route_poll_interval_s=0.01)
    async with swarm.client(config) as client:
        result = await client.generate("smol", "abc", max_tokens=5)
    assert result.tokens == greedy_continuation("abc", 5)
    assert result.replans == 1
    assert result.route[-1]["node"] == spare.peer_id
    sessions = list(dict.fromkeys(bytes(s.session_id) for s in swarm.nodes[0].steps))
    assert len(sessions) == 2
    resumed = [s for s in swarm.nodes[0].steps if bytes(s.session_id) == sessions[1]]
    # the new session's prefill is the prompt plus the two tokens chosen before the failure
    assert list(resumed[0].token_ids) == [0, 1, 2, 3, 4] and list(resumed[0].positions) == [0, 1, 2, 3, 4]
    assert [list(s.positions) for s in resumed[1:]] == [[5], [6]]
    assert swarm.nodes[0].ended == sessions  # both sessions were ended
    assert swarm.tracker.handouts_ended == [list(range(1, swarm.tracker.route_requests + 1))]  # every route it got


# --- results that are not the client's to take ----------------------------------------------------


async def result_ack(sender, result: swarm_pb2.StepResult | bytes, client_peer_id: str, addrs) -> swarm_pb2.StepAck:
    payload = result if isinstance(result, bytes) else result.SerializeToString()
    raw = await sender.transport.request(client_peer_id, addrs, RESULT_PROTOCOL, payload, timeout_s=5)
    return swarm_pb2.StepAck.FromString(raw)


async def test_the_result_handler_refuses_what_is_not_its_own(swarm: Swarm, nursery: trio.Nursery) -> None:
    outsider = swarm.node(20, 30)  # admitted, not on the route
    last = swarm.nodes[2]
    gate = trio.Event()
    in_flight = trio.Event()
    original_work = last.work

    async def held_work(request: swarm_pb2.StepRequest) -> None:
        in_flight.set()
        await gate.wait()
        await original_work(request)

    last.work = held_work
    acks: dict[str, swarm_pb2.StepAck] = {}

    async with swarm.client() as client:
        addrs = swarm.client_transport.listen_addrs

        async def probe() -> None:
            await in_flight.wait()
            session_id = bytes(last.steps[0].session_id)
            good = step_result(session_id, 0, fake_logits(2, 2), last.admission)
            acks["malformed"] = await result_ack(last, b"\xff\x00garbage", swarm.client_peer_id, addrs)
            acks["unknown session"] = await result_ack(
                last, step_result(os.urandom(16), 0, fake_logits(2, 2), last.admission), swarm.client_peer_id, addrs
            )
            acks["not on route"] = await result_ack(
                outsider, step_result(session_id, 0, fake_logits(2, 2), outsider.admission), swarm.client_peer_id, addrs
            )
            acks["not last hop"] = await result_ack(
                swarm.nodes[1], step_result(session_id, 0, fake_logits(2, 2), swarm.nodes[1].admission),
                swarm.client_peer_id, addrs,
            )  # fmt: skip
            client_admission = swarm.tracker.admission(last.peer_id, swarm_pb2.ROLE_CLIENT)
            acks["client role"] = await result_ack(
                last, step_result(session_id, 0, fake_logits(2, 2), client_admission), swarm.client_peer_id, addrs
            )
            stolen = step_result(session_id, 0, fake_logits(2, 2), last.admission)  # another peer's admission
            acks["stolen admission"] = await result_ack(outsider, stolen, swarm.client_peer_id, addrs)
            future = step_result(session_id, 3, fake_logits(2, 2), last.admission)
            acks["out of order"] = await result_ack(last, future, swarm.client_peer_id, addrs)
            v2 = step_result(session_id, 0, fake_logits(2, 2), last.admission)
            v2.schema_version = 2
            acks["schema"] = await result_ack(last, v2, swarm.client_peer_id, addrs)
            assert good.step == 0
            gate.set()

        nursery.start_soon(probe)
        last.behaviour.duplicate_result = True
        result = await client.generate("smol", "abc", max_tokens=3)

    assert result.tokens == greedy_continuation("abc", 3)  # none of the above disturbed it
    expected = {
        "malformed": (swarm_pb2.Error.INVALID_ARGUMENT, "malformed StepResult"),
        "unknown session": (swarm_pb2.Error.NOT_FOUND, "unknown session"),
        "not on route": (swarm_pb2.Error.REFUSED, "not on the route"),
        "not last hop": (swarm_pb2.Error.REFUSED, "not the last hop"),
        "client role": (swarm_pb2.Error.REFUSED, "admission role ROLE_CLIENT"),
        "stolen admission": (swarm_pb2.Error.REFUSED, "admission peer id mismatch"),
        "out of order": (swarm_pb2.Error.INVALID_ARGUMENT, "out-of-order result for step 3"),
        "schema": (swarm_pb2.Error.INVALID_ARGUMENT, "schema_version 2 is not supported"),
    }
    for name, (code, text) in expected.items():
        assert acks[name].error.code == code, (name, acks[name])
        assert text in acks[name].error.message, (name, acks[name].error.message)
    # every result was pushed twice: the first taken, the duplicate refused
    codes = [ack.error.code for ack in last.result_acks]
    assert len(codes) == 6
    assert codes[0::2] == [0, 0, 0]
    messages = [ack.error.message for ack in last.result_acks[1::2]]
    assert "duplicate result for step 0" in messages[0]
    assert "duplicate result for step 1" in messages[1]
    assert "unknown session" in messages[2] or "has ended" in messages[2]


async def test_malformed_logits_fail_the_generation_naming_the_last_hop(swarm: Swarm) -> None:
    last = swarm.nodes[2]

    async def corrupt_push(request: swarm_pb2.StepRequest, result: swarm_pb2.StepResult) -> None:
        result.checksum ^= 0xFFFF
        raw = await last.transport.request(
            request.owner_peer_id, request.owner_addrs, RESULT_PROTOCOL, result.SerializeToString(), timeout_s=5
        )
        last.result_acks.append(swarm_pb2.StepAck.FromString(raw))

    last.push_result = corrupt_push
    async with swarm.client() as client:
        with pytest.raises(GenerationError, match="checksum") as caught:
            await client.generate("smol", "abc", max_tokens=3)
    assert caught.value.failed_peer_id == last.peer_id
    assert "checksum" in last.result_acks[0].error.message


async def test_a_tracker_that_cannot_be_reached_raises_transport_error() -> None:
    network = MemoryNetwork()
    key, peer_id = new_key()
    transport = network.add(peer_id)
    _, tracker_id = new_key()
    with pytest.raises(TransportError, match="unreachable"):
        async with open_swarm_client(f"/memory/x/p2p/{tracker_id}", key=key, transport=transport):
            pass


async def test_the_client_over_libp2p(nursery: trio.Nursery) -> None:
    """The same exchange over the real transport (Noise, yamux): results reach the client at
    the address it listens on, and the fake nodes see the client's authenticated peer id."""
    from agent.io.net.p2p import open_p2p_transport

    async with contextlib.AsyncExitStack() as stack:
        keys = [Ed25519PrivateKey.generate() for _ in range(5)]
        transports = [await stack.enter_async_context(open_p2p_transport(key)) for key in keys]
        tracker = FakeTracker(transports[0], keys[0])
        nodes = [FakeNode(transports[i + 1], keys[i + 1], tracker, nursery, b, e) for i, (b, e) in enumerate(LAYOUT)]
        tracker.routes = [
            swarm_pb2.Route(model_sha256=MODEL_SHA, n_layer=N_LAYER, recipe_hash=RECIPE, hops=[n.hop() for n in nodes])
        ]
        async with open_swarm_client(tracker.addr, key=keys[4], transport=transports[4]) as client:
            result = await client.generate("smol", "abc", max_tokens=5)
        assert result.tokens == greedy_continuation("abc", 5)
        assert {s.owner_peer_id for s in nodes[0].steps} == {transports[4].peer_id}
        assert all(not ack.error.code for ack in nodes[2].result_acks)


# --- integrity: tokens computed through a withdrawn peer are taken back; spot checks -------------


async def test_tokens_computed_through_a_withdrawn_hop_are_taken_back_when_it_fails(swarm: Swarm) -> None:
    bad = swarm.nodes[2]
    bad.behaviour.corrupt = True
    spare = swarm.node(20, 30)
    healed = swarm.route([swarm.nodes[0], swarm.nodes[1], spare])
    original_work = bad.work

    async def work_then_withdrawn(request: swarm_pb2.StepRequest) -> None:
        await original_work(request)
        if request.step == 2:  # a canary caught it: withdrawn (it unloads, routes avoid it)
            swarm.tracker.withdrawn[bad.peer_id] = "failed canary-1"
            swarm.network.down.add(bad.peer_id)
            swarm.tracker.routes = [healed]

    bad.work = work_then_withdrawn
    config = SwarmClientConfig(replan_attempts=1, replan_wait_s=5.0, route_poll_interval_s=0.01)
    seen: list[int] = []

    async def on_token(token: int, _logits, _route) -> bool:
        seen.append(token)
        return False

    async with swarm.client(config) as client:
        result = await client.generate_tokens("smol", [0, 1, 2], max_tokens=6, on_token=on_token)
    # the three tokens the bad hop computed were taken back and generated again: the output
    # is what honest hops give
    assert result.tokens == greedy_continuation("abc", 6) and result.tokens_taken_back == 3
    assert seen[:3] == [4, 6, 8] and seen[3:] == result.tokens  # the caller saw the bad ones first
    sessions = list(dict.fromkeys(bytes(s.session_id) for s in swarm.nodes[0].steps))
    resumed = [s for s in swarm.nodes[0].steps if bytes(s.session_id) == sessions[1]]
    assert list(resumed[0].token_ids) == [0, 1, 2]  # redone from the prompt, not prompt + bad tokens
    assert bad.peer_id in swarm.tracker.integrity_asked[0]


async def test_a_generation_that_ended_through_a_withdrawn_hop_is_generated_again(swarm: Swarm) -> None:
    """A cheater that keeps serving after it was withdrawn: the owner asks the tracker about
    its route's peers when the generation ends, and redoes it around them."""
    bad = swarm.nodes[2]
    bad.behaviour.corrupt = True
    spare = swarm.node(20, 30)
    swarm.tracker.withdrawn[bad.peer_id] = "refused: failed 2 integrity checks"
    swarm.tracker.routes = [swarm.route(swarm.nodes), swarm.route([swarm.nodes[0], swarm.nodes[1], spare])]
    config = SwarmClientConfig(replan_attempts=1, replan_wait_s=5.0, route_poll_interval_s=0.01)
    async with swarm.client(config) as client:
        result = await client.generate_tokens("smol", [0, 1, 2], max_tokens=4)
        assert result.tokens == greedy_continuation("abc", 4) and result.tokens_taken_back == 4
        assert result.route[-1]["node"] == spare.peer_id and result.replans == 1
    # no replan left: the owner says so rather than return what the withdrawn hop computed
    async with swarm.client(dataclasses.replace(config, replan_attempts=0)) as client:
        with pytest.raises(GenerationError, match="failed integrity checks, and no replan is left"):
            await client.generate_tokens("smol", [0, 1, 2], max_tokens=2, route=swarm.route(swarm.nodes))
    async with swarm.client(dataclasses.replace(config, check_route_integrity=False)) as client:
        unchecked = await client.generate_tokens("smol", [0, 1, 2], max_tokens=2, route=swarm.route(swarm.nodes))
    assert unchecked.tokens == [4, 6]  # without asking, the bad tokens stay


async def test_a_spot_check_replays_a_session_on_other_hops_and_reports_a_mismatch(swarm: Swarm) -> None:
    others = [swarm.node(b, e) for b, e in LAYOUT]
    swarm.tracker.alternate = swarm.route(others)
    config = SwarmClientConfig(replan_attempts=0, spot_check_rate=1.0, check_route_integrity=False)
    async with swarm.client(config) as client:
        honest = await client.generate_tokens("smol", [0, 1, 2], max_tokens=4)
        stats = client.spot_checks.stats
        # every step was replayed on the other route (the same rows, another session) and agreed
        assert honest.tokens == greedy_continuation("abc", 4)
        assert (stats.sessions, stats.steps, stats.agreed, stats.mismatches) == (1, 4, 4, 0)
        assert stats.rows == 3 + 3  # the prompt, then one row a step
        shadow = list(dict.fromkeys(bytes(s.session_id) for s in others[0].steps))
        assert len(shadow) == 1 and others[0].ended == shadow
        assert [list(s.token_ids) for s in others[0].steps] == [[0, 1, 2], [3], [4], [5]]
        assert swarm.tracker.avoided[-1][0] in {n.peer_id for n in swarm.nodes}

        swarm.nodes[2].behaviour.corrupt = True  # the generation's last hop goes bad
        await client.generate_tokens("smol", [0, 1, 2], max_tokens=4)
    assert (stats.sessions, stats.mismatches) == (2, 1)
    (report,) = swarm.tracker.mismatches
    assert report.step == 0 and report.route_sha256 != report.shadow_sha256
    assert [h.peer_id for h in report.route] == [n.peer_id for n in swarm.nodes]
    assert [h.peer_id for h in report.shadow] == [n.peer_id for n in others]


async def test_a_spot_check_that_cannot_conclude_leaves_the_generation_alone(swarm: Swarm) -> None:
    config = SwarmClientConfig(replan_attempts=0, spot_check_rate=1.0, check_route_integrity=False)
    swarm.tracker.route_error = None
    async with swarm.client(config) as client:
        swarm.tracker.alternate = swarm.route([swarm.node(b, e) for b, e in LAYOUT])
        swarm.tracker.alternate.recipe_hash = "another-recipe"  # not comparable bit for bit
        result = await client.generate_tokens("smol", [0, 1, 2], max_tokens=3)
        assert result.tokens == greedy_continuation("abc", 3)
        stats = client.spot_checks.stats
        assert (stats.sessions, stats.inconclusive) == (0, 1) and "another recipe" in stats.last_inconclusive
    with pytest.raises(ValueError, match="spot_check_rate"):
        SwarmClientConfig(spot_check_rate=1.5)


async def test_a_failing_session_drops_its_spot_check_and_replans_as_without(swarm: Swarm) -> None:
    last = swarm.nodes[2]
    spare = swarm.node(20, 30)
    healed = swarm.route([swarm.nodes[0], swarm.nodes[1], spare])
    swarm.tracker.alternate = healed  # the spot check's route around a hop
    original_work = last.work

    async def work_then_vanish(request: swarm_pb2.StepRequest) -> None:
        await original_work(request)
        if request.step == 1 and bytes(request.session_id) == bytes(swarm.nodes[0].steps[0].session_id):
            swarm.network.down.add(last.peer_id)
            swarm.tracker.routes = [healed]

    last.work = work_then_vanish
    config = SwarmClientConfig(
        replan_attempts=1, replan_wait_s=5.0, route_poll_interval_s=0.01, spot_check_rate=1.0,
        check_route_integrity=False,
    )  # fmt: skip
    async with swarm.client(config) as client:
        result = await client.generate_tokens("smol", [0, 1, 2], max_tokens=5)
        stats = client.spot_checks.stats
    assert result.tokens == greedy_continuation("abc", 5) and result.replans == 1
    assert stats.mismatches == 0 and stats.sessions >= 1  # the second session was checked too
