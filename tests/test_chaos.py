"""Chaos on a real swarm: hops killed (SIGKILL) and frozen (SIGSTOP) at seeded random points of
prefill and decode, and the tracker killed mid-generation.

One swarm of real processes on loopback is shared by the tests of this module: a tracker and
six nodes of ten blocks of SmolLM2, so every range ([0, 10), [10, 20), [20, 30)) has two
copies and a route has a first, a middle and a last hop. The tracker's heartbeat timeout is
long (15 s): a quick recovery can only come from the fast path (the owner names the lost
peer, the tracker probes it and takes it out of routes). A killed or frozen node is restarted
(same key) after its round, and the next round waits until every range has two ready copies
again.

After a loss the owner replaces the lost hop only: the surviving hops keep their caches (the
nodes' own counters show each of them resumed the session it started, and started no other),
and the replacement is rebuilt from the rows the hop before it kept (or from the owner's
tokens for a first hop), in the shapes the lost range first computed them, so a resumed
generation's scores are bit-identical to an undisturbed run's (asserted: every token's top
logits and log-sum-exp). A loss before the first step was answered has nothing to keep: that
generation re-prefills a new route, in the same shapes. Either way the greedy tokens must
equal an undisturbed run's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import signal
import statistics
from collections.abc import Iterator

import numpy as np
import pytest
import trio

from agent._proto import swarm_pb2
from agent.demo.swarm_demo import wait_for_copies, wait_for_coverage
from agent.harness.local_swarm import LocalSwarm, LocalSwarmConfig
from agent.io.client import SwarmClientConfig, open_swarm_client
from agent.models import model_path

pytestmark = [pytest.mark.swarm, pytest.mark.slow]

ALIAS = "smollm2"
NODES = 6
BLOCKS_EACH = 10
HEARTBEAT_TIMEOUT_MS = 15_000
SETUP_TIMEOUT_S = 240.0
# long enough that a kill at a random point of the prompt lands in one of several chunks
PROMPT = (
    "Volunteer computing works because many people lend a little of their spare time and their "
    "machines to a common project. The machines come and go without warning: a laptop lid "
    "closes, a home router restarts, a game takes the GPU. A good system therefore"
)
NEW_TOKENS = 32
PREFILL_CHUNK_TOKENS = 16
SEED = 13


def _client_config(**overrides) -> SwarmClientConfig:
    fields = dict(replan_attempts=2, replan_wait_s=30.0, prefill_chunk_tokens=PREFILL_CHUNK_TOKENS)
    fields.update(overrides)
    return SwarmClientConfig(**fields)


@dataclasses.dataclass
class Chaos:
    swarm: LocalSwarm
    memory_bytes: int
    prompt_tokens: list[int]
    stop_tokens: list[int]
    reference: list[int]  # greedy tokens of an undisturbed run through the swarm
    reference_first_token_s: float
    reference_scores: list[tuple]  # each token's scores in that run (_scores)

    def name_of(self, peer_id: str) -> str:
        (name,) = [name for name, proc in self.swarm.nodes.items() if proc.peer_id == peer_id]
        return name


async def _start(swarm: LocalSwarm) -> Chaos:
    await swarm.start_tracker()
    async with open_swarm_client(swarm.tracker_addr, config=_client_config()) as c:
        (entry,) = [m for m in await c.list_models() if m.alias == ALIAS]
        memory = BLOCKS_EACH * entry.bytes_per_block + entry.bytes_per_block // 2
        for i in range(NODES):
            swarm.start_node(f"node-{i + 1}", memory)
        route = await wait_for_coverage(c, swarm, ALIAS, timeout_s=SETUP_TIMEOUT_S)
        await wait_for_copies(c, swarm, 2, timeout_s=SETUP_TIMEOUT_S)
        prompt_tokens, stop_tokens = await c.tokenize(route, PROMPT)
        assert len(prompt_tokens) > 2 * PREFILL_CHUNK_TOKENS
        scores: list[tuple] = []

        async def keep(_token: int, logits, _route) -> bool:
            scores.append(_scores(logits))
            return False

        run = await c.generate_tokens(
            ALIAS, prompt_tokens, max_tokens=NEW_TOKENS, stop_tokens=stop_tokens, on_token=keep
        )
        assert len(run.tokens) == NEW_TOKENS and not run.replans
        # The rounds read the nodes' session counters (heartbeats carry them, once a second)
        # before and after each: wait until this first session shows on its hops, or a round
        # that began before the next heartbeat would count it as its own (seen under a loaded
        # full suite: a first hop at 2 sessions started where its round expected 1).
        started = {(h["node"], h["begin"], h["end"]): (1, 0, 0) for h in run.route}
        counted = await _wait_counters(c, started, timeout_s=30.0)
        assert {key: counted.get(key) for key in started} == started, counted
    return Chaos(swarm, memory, prompt_tokens, stop_tokens, run.tokens, run.first_token_s, scores)


def _scores(logits) -> tuple:
    """A token's scores as comparable bytes: the top-K ids, logits and log-sum-exp (or the row)."""
    if isinstance(logits, np.ndarray):
        return (logits.tobytes(),)
    return (logits.ids.tobytes(), logits.logits.tobytes(), float(logits.log_sum_exp))


@pytest.fixture(scope="module")
def chaos(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chaos]:
    """The shared swarm (its processes outlive the ``trio.run`` that starts them)."""
    config = LocalSwarmConfig(
        model_path=model_path(ALIAS), model_alias=ALIAS, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS
    )
    swarm = LocalSwarm(config, tmp_path_factory.mktemp("chaos"))
    try:
        yield trio.run(_start, swarm)
    finally:
        swarm.close_nowait()


@dataclasses.dataclass
class Round:
    how: str  # SIGKILL or SIGSTOP
    position: str  # first, middle or last
    phase: str  # prefill or decode (where the signal was meant to land)
    landed: str = ""  # where it did land: before or after the first token
    gap_s: float = 0.0  # last token (or the first step sent) before the signal -> first token after
    resumed: bool = False  # the surviving hops kept their caches (else: a re-prefill)
    out_of_routes_s: float = 0.0  # signal -> the tracker no longer counts the victim alive


POSITIONS = {"first": 0, "middle": 1, "last": 2}


def _plan(rng: random.Random) -> list[Round]:
    # three kills per hop position: one in prefill, one in decode, one where the seed says
    kills = [
        Round("SIGKILL", position, phase)
        for position in POSITIONS
        for phase in ("prefill", "decode", rng.choice(["prefill", "decode"]))
    ]
    stops = [Round("SIGSTOP", position, "decode") for position in POSITIONS]
    rounds = kills + stops
    rng.shuffle(rounds)
    return rounds


Counters = dict[tuple[str, int, int], tuple[int, int, int]]


async def _counters(c) -> Counters:
    """(sessions started, resumed, rebuilt) of every READY range, as the nodes report them."""
    return {
        (n.peer_id, s.assignment.begin, s.assignment.end): (s.sessions_started, s.sessions_resumed, s.sessions_rebuilt)
        for n in await c.list_nodes()
        if n.alive
        for s in n.serving
        if s.state == swarm_pb2.AssignmentStatus.READY
    }


async def _wait_counters(c, expected: Counters, timeout_s: float = 10.0) -> Counters:
    """The nodes' counters once they equal ``expected`` for its keys (heartbeats carry them), or
    as they are at ``timeout_s``."""
    seen: Counters = {}
    with trio.move_on_after(timeout_s):
        while True:
            seen = await _counters(c)
            if all(seen.get(key) == value for key, value in expected.items()):
                return seen
            await trio.sleep(0.1)
    return seen


async def _run_round(c, chaos: Chaos, plan: Round, rng: random.Random) -> None:
    before = await _counters(c)
    route = await c.route(ALIAS)
    assert len(route.hops) == 3, [(h.begin, h.end) for h in route.hops]
    victim_id = route.hops[POSITIONS[plan.position]].peer_id
    victim = chaos.swarm.nodes[chaos.name_of(victim_id)]
    signum = getattr(signal, plan.how)
    at_token = rng.randint(2, NEW_TOKENS - 6)  # decode: after this many tokens
    prefill_delay_s = rng.uniform(0.1, 0.8) * chaos.reference_first_token_s
    tokens: list[int] = []
    scores: list[tuple] = []
    signalled: list[float] = []
    last_before = [0.0]
    first_after: list[float] = []

    left_routes = trio.Event()

    def send_signal() -> None:
        victim.signal_group(signum)
        signalled.append(trio.current_time())
        plan.landed = "decode" if tokens else "prefill"
        nursery.start_soon(watch_routes)

    async def watch_routes() -> None:
        # The tracker's own view, not a plain route request: routes balance load, so one
        # could pass the victim by while the generation is still on it. A node not alive in
        # the tracker's list is in no route it plans.
        while True:
            with contextlib.suppress(Exception):
                if not any(n.peer_id == victim_id and n.alive for n in await c.list_nodes()):
                    plan.out_of_routes_s = trio.current_time() - signalled[0]
                    left_routes.set()
                    return
            await trio.sleep(0.1)

    async def on_token(token: int, logits, _route) -> bool:
        now = trio.current_time()
        tokens.append(token)
        scores.append(_scores(logits))
        if signalled and not first_after:
            first_after.append(now)
        if not signalled:
            last_before[0] = now
            if plan.phase == "decode" and len(tokens) == at_token:
                send_signal()
        return False

    async def signal_in_prefill() -> None:
        await trio.sleep(prefill_delay_s)
        if not signalled:
            send_signal()

    async with trio.open_nursery() as nursery:
        last_before[0] = trio.current_time()
        if plan.phase == "prefill":
            nursery.start_soon(signal_in_prefill)
        result = await c.generate_tokens(
            ALIAS, chaos.prompt_tokens, max_tokens=NEW_TOKENS, stop_tokens=chaos.stop_tokens, on_token=on_token,
            route=route,
        )  # fmt: skip
        assert signalled, plan
        # named (a frozen hop too) and out of everyone's routes well before its heartbeat timeout
        with trio.move_on_at(signalled[0] + HEARTBEAT_TIMEOUT_MS / 1000 / 2):
            await left_routes.wait()
        nursery.cancel_scope.cancel()
    assert left_routes.is_set(), plan
    assert result.tokens == chaos.reference, plan
    assert result.replans == 1, plan
    assert victim_id not in [h["node"] for h in result.route], plan
    plan.resumed = bool(result.resumes)
    if plan.resumed:  # the rebuilt range computed the same numbers: bit for bit
        assert scores == chaos.reference_scores, plan
    if plan.landed == "decode":  # steps were answered: there was something to keep
        assert result.resumes == 1, plan
    if plan.resumed:
        # observed on the nodes: each surviving hop started this session once and resumed it;
        # the replacement was rebuilt, and started nothing
        survivors = [(h.peer_id, h.begin, h.end) for h in route.hops if h.peer_id != victim_id]
        (replacement,) = [(h["node"], h["begin"], h["end"]) for h in result.route if h["node"] != victim_id and
                          (h["node"], h["begin"], h["end"]) not in survivors]  # fmt: skip
        expected = {key: (before[key][0] + 1, before[key][1] + 1, before[key][2]) for key in survivors}
        old = before.get(replacement, (0, 0, 0))
        expected[replacement] = (old[0], old[1], old[2] + 1)
        after = await _wait_counters(c, expected)
        assert {key: after.get(key) for key in expected} == expected, plan
    for _ in range(3):  # and plain route requests (no avoid list) leave it out
        assert victim_id not in [h.peer_id for h in (await c.route(ALIAS)).hops], plan
    plan.gap_s = first_after[0] - last_before[0]
    # the machine comes back (same key): two copies of every range again
    name = victim.name
    await chaos.swarm.kill_node(name)
    chaos.swarm.start_node(name, chaos.memory_bytes)
    await wait_for_copies(c, chaos.swarm, 2, timeout_s=90.0)


@pytest.mark.timeout(300)
async def test_generations_survive_hops_killed_and_frozen_at_random_points(chaos: Chaos) -> None:
    rng = random.Random(SEED)
    rounds = _plan(rng)
    async with open_swarm_client(chaos.swarm.tracker_addr, config=_client_config()) as c:
        await wait_for_copies(c, chaos.swarm, 2, timeout_s=90.0)
        for plan in rounds:
            with trio.fail_after(120):
                await _run_round(c, chaos, plan, rng)
            print(f"chaos round: {plan}")
    assert sum(r.resumed for r in rounds) >= len(rounds) // 2, rounds  # most losses kept the survivors' caches
    kill_gaps = [r.gap_s for r in rounds if r.how == "SIGKILL"]
    stop_gaps = [r.gap_s for r in rounds if r.how == "SIGSTOP"]
    print(
        f"resume gaps: SIGKILL median {statistics.median(kill_gaps):.2f} s max {max(kill_gaps):.2f} s; "
        f"SIGSTOP median {statistics.median(stop_gaps):.2f} s max {max(stop_gaps):.2f} s"
    )
    assert {r.landed for r in rounds if r.how == "SIGKILL"} == {"prefill", "decode"}, rounds
    chaos.swarm.check_alive()


@pytest.mark.timeout(200)
async def test_a_tracker_killed_mid_generation_loses_nothing(chaos: Chaos) -> None:
    """Running sessions need no tracker; a new generation uses the last route and admission;
    the restarted tracker (same db, key, port) has every model, node and assignment back."""
    swarm = chaos.swarm
    async with open_swarm_client(swarm.tracker_addr, config=_client_config()) as c:
        await wait_for_copies(c, chaos.swarm, 2, timeout_s=90.0)
        models_before = [(m.sha256, m.alias, m.n_layer) for m in await c.list_models()]
        assigned_before = {(n.peer_id, a.begin, a.end) for n in await c.list_nodes() if n.alive for a in n.assigned}
        await c.route(ALIAS)
        killed = trio.Event()

        async def on_token(token: int, _logits, _route) -> bool:
            tokens.append(token)
            if len(tokens) == 8:
                await swarm.stop_tracker(kill=True)
                killed.set()
            return False

        tokens: list[int] = []
        running = await c.generate_tokens(
            ALIAS, chaos.prompt_tokens, max_tokens=NEW_TOKENS, stop_tokens=chaos.stop_tokens, on_token=on_token,
        )  # fmt: skip
        assert killed.is_set() and not swarm.tracker.alive
        assert running.tokens == chaos.reference and not running.replans
        # a new generation while the tracker is down: the last route, the current admission
        fresh = await c.generate_tokens(
            ALIAS, chaos.prompt_tokens, max_tokens=NEW_TOKENS, stop_tokens=chaos.stop_tokens
        )
        assert fresh.tokens == chaos.reference
        assert fresh.route == running.route  # the last route the tracker gave

        await swarm.start_tracker()  # same db, key and port
        assert [(m.sha256, m.alias, m.n_layer) for m in await c.list_models()] == models_before
        await wait_for_coverage(c, swarm, ALIAS, timeout_s=60)
        await wait_for_copies(c, chaos.swarm, 2, timeout_s=60.0)  # every node heard from again, with the ranges it had
        assigned_after = {(n.peer_id, a.begin, a.end) for n in await c.list_nodes() if n.alive for a in n.assigned}
        assert assigned_after == assigned_before
        again = await c.generate_tokens(
            ALIAS, chaos.prompt_tokens, max_tokens=NEW_TOKENS, stop_tokens=chaos.stop_tokens
        )
        assert again.tokens == chaos.reference
    swarm.check_alive()


@pytest.mark.timeout(120)
async def test_only_the_owner_resumes_or_replays_its_session_and_a_bad_resume_changes_nothing(chaos: Chaos) -> None:
    """Another admitted client cannot trim or replay someone's session; the owner's own resume
    past what a hop holds is refused; the generation goes on unchanged."""
    async with (
        open_swarm_client(chaos.swarm.tracker_addr, config=_client_config()) as owner,
        open_swarm_client(chaos.swarm.tracker_addr, config=_client_config()) as other,
    ):
        await wait_for_copies(owner, chaos.swarm, 2, timeout_s=90.0)
        route = await owner.route(ALIAS)
        answers: dict[str, swarm_pb2.NodeReply] = {}

        async def ask(client, name: str, hop: swarm_pb2.Hop, request: swarm_pb2.NodeRequest) -> None:
            request.schema_version = 1
            request.sender_admission.CopyFrom(client.admission)
            raw = await client.transport.request(
                hop.peer_id, list(hop.addrs), "/baton/node/1.0.0", request.SerializeToString(), timeout_s=10
            )
            answers[name] = swarm_pb2.NodeReply.FromString(raw)

        async def on_token(token: int, _logits, _route) -> bool:
            tokens.append(token)
            if len(tokens) != 3:
                return False
            (session_id,) = list(owner._live)  # the session in flight
            first, middle = route.hops[0], route.hops[1]

            def resume(keep: int, hop: swarm_pb2.Hop) -> swarm_pb2.NodeRequest:
                body = swarm_pb2.ResumeSessionRequest(
                    session_id=session_id, model_sha256=route.model_sha256, keep_positions=keep, next_step=99,
                    begin=hop.begin, end=hop.end,
                )  # fmt: skip
                return swarm_pb2.NodeRequest(resume_session=body)

            replay = swarm_pb2.ReplayRequest(
                session_id=session_id, model_sha256=route.model_sha256, begin=first.begin, end=first.end, positions=4,
                resume_step=99, to=[middle], max_rows=16,
            )  # fmt: skip
            await ask(other, "other resumes", first, resume(4, first))
            await ask(other, "other replays", first, swarm_pb2.NodeRequest(replay=replay))
            await ask(owner, "owner keeps too much", middle, resume(10_000, middle))
            return False

        tokens: list[int] = []
        result = await owner.generate_tokens(
            ALIAS, chaos.prompt_tokens, max_tokens=NEW_TOKENS, stop_tokens=chaos.stop_tokens, on_token=on_token,
            route=route,
        )  # fmt: skip
    refused, bad = swarm_pb2.Error.REFUSED, swarm_pb2.Error.INVALID_ARGUMENT
    assert answers["other resumes"].error.code == refused, answers
    assert "belongs to" in answers["other resumes"].error.message
    assert answers["other replays"].error.code == refused, answers
    assert answers["owner keeps too much"].error.code == bad, answers
    assert "10000 asked to keep" in answers["owner keeps too much"].error.message
    assert result.tokens == chaos.reference and not result.replans
