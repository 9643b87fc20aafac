"""Baton across machines: a tracker, three nodes and the relay, each on its own lab machine, 20 ms
round trip between every pair, SmolLM2 split in three. Greedy output must equal one unsplit
worker's through the relay and through an owner of its own; and stay equal with 2 % loss on
every link, with a node behind a 5 Mbit/s uplink, with a link cut mid-generation, and with a
machine switched off mid-generation (a spare machine takes its range over). A step's result
goes only to the host its owner sent it from.

One lab and swarm are shared by the module. The owners (the tests' clients) run in the relay's
machine; the unsplit reference worker runs on this host (Unix sockets only).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import socket
from collections.abc import Iterator

import openai
import pytest
import trio

from agent._proto import swarm_pb2
from agent.core.lab.topology import LinkChange, LinkSpec, MachineSpec, Topology
from agent.core.wire.step_requests import first_step_request
from agent.core.wire.swarm_wire import NODE_PROTOCOL, RESULT_PROTOCOL, SCHEMA_VERSION, STEP_PROTOCOL, parse_record
from agent.demo.local_demo import unsplit_greedy
from agent.demo.swarm_demo import node_memory_bytes, wait_for_coverage
from agent.harness.local_swarm import LocalSwarm, LocalSwarmConfig, Placement
from agent.io.client import SwarmClientConfig, open_swarm_client
from agent.io.lab.harness import Lab, running_lab
from agent.io.net.transport import ImmediateHandler
from agent.models import model_path

pytestmark = [pytest.mark.lab, pytest.mark.slow]

ALIAS = "smollm2"
ONE_WAY_MS = 10.0  # 20 ms round trip
NODES = ("n1", "n2", "n3")
SPARE = "n4"
MACHINES = ("tracker", "relay", *NODES, SPARE)
OWNER = "relay"  # the tests' clients run here, as the relay's own owner does
SETUP_TIMEOUT_S = 240.0
PROMPT = "Volunteer computing works because many people lend a little of their spare machines, and"
NEW_TOKENS = 24


@dataclasses.dataclass
class LabSwarm:
    lab: Lab
    swarm: LocalSwarm
    memory_bytes: int
    key: str
    prompt_tokens: list[int]
    reference: list[int]  # greedy tokens of one unsplit worker

    def owner_listen(self) -> list[str]:
        return [f"/ip4/{self.lab.address(OWNER)}/tcp/0"]

    def in_owner(self, async_fn, *args):
        """``trio.run(async_fn, *args)`` inside the owner's machine."""
        return self.lab.run_in(OWNER, lambda: trio.run(async_fn, *args))

    async def generate(self, on_token=None, **config: object):
        """One greedy generation of the module's prompt through a fresh owner (inside the
        owner's machine's trio run)."""
        async with open_swarm_client(
            self.swarm.tracker_addr, listen_addrs=self.owner_listen(), config=SwarmClientConfig(**config)
        ) as c:
            return await c.generate_tokens(ALIAS, self.prompt_tokens, max_tokens=NEW_TOKENS, on_token=on_token)


@pytest.fixture(scope="module")
def lab_swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabSwarm]:
    path = model_path(ALIAS)
    prompt_tokens, reference = trio.run(unsplit_greedy, path, PROMPT, NEW_TOKENS)
    topology = Topology(tuple(MachineSpec(m) for m in MACHINES), LinkSpec(delay_ms=ONE_WAY_MS))
    with running_lab(topology) as lab:
        placement = Placement(lab, {m: m for m in MACHINES})
        config = LocalSwarmConfig(model_path=path, model_alias=ALIAS, placement=placement)
        swarm = LocalSwarm(config, tmp_path_factory.mktemp("lab-swarm"))

        async def start() -> int:
            await swarm.start_tracker()
            async with open_swarm_client(swarm.tracker_addr, listen_addrs=[f"/ip4/{lab.address(OWNER)}/tcp/0"]) as c:
                (entry,) = [m for m in await c.list_models() if m.alias == ALIAS]
                memory = node_memory_bytes(entry.n_layer, entry.bytes_per_block, len(NODES))
                for name in NODES:
                    swarm.start_node(name, memory)
                await wait_for_coverage(c, swarm, ALIAS, timeout_s=SETUP_TIMEOUT_S)
            await swarm.start_relay()
            return memory

        try:
            memory = lab.run_in(OWNER, lambda: trio.run(start))
            key = swarm.add_relay_key("tests")
            yield LabSwarm(lab, swarm, memory, key, prompt_tokens, reference)
        finally:
            swarm.close_nowait()


def _links_used(lab: Lab) -> dict[tuple[str, str], int]:
    names = lab.topology.names
    return {(names[r["src"]], names[r["dst"]]): r["delivered"] for r in lab.stats()["links"]}


@pytest.mark.timeout(300)
def test_five_machines_at_20_ms_give_the_unsplit_tokens_through_the_relay_and_an_owner(lab_swarm: LabSwarm) -> None:
    lab = lab_swarm.lab
    before = _links_used(lab)

    def ask_relay() -> list[int]:
        with openai.OpenAI(base_url=f"{lab_swarm.swarm.relay_url}/v1", api_key=lab_swarm.key, max_retries=0) as client:
            response = client.completions.create(
                model=ALIAS, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0, extra_body={"return_token_ids": True}
            )
        return (response.choices[0].model_extra or {})["token_ids"]

    assert lab.run_in(OWNER, ask_relay) == lab_swarm.reference  # the HTTP client in the relay's machine too

    result = lab_swarm.in_owner(lab_swarm.generate)
    assert result.tokens == lab_swarm.reference and result.replans == 0
    # speculative decoding (the relay's default too, above): drafts verified a trip at a time,
    # rejected rows cut on every hop, the same tokens
    speculative = lab_swarm.in_owner(functools.partial(lab_swarm.generate, speculate_tokens=8))
    assert speculative.tokens == lab_swarm.reference and speculative.replans == 0
    assert speculative.accepted_tokens <= speculative.drafted_tokens
    hops = [h["node"] for h in result.route]
    assert len(hops) == 3
    # every hop pushed to the next across the lab: the nodes' machines carried the boundaries
    after = _links_used(lab)
    names = {lab_swarm.swarm.nodes[n].peer_id: n for n in NODES}
    route = [names[h] for h in hops]
    for a, b in itertools.pairwise(route):
        assert after[(a, b)] - before[(a, b)] >= NEW_TOKENS, (a, b)
    assert result.data_plane_steps > 0

    async def seen_hosts() -> dict[str, str]:
        async with open_swarm_client(lab_swarm.swarm.tracker_addr, listen_addrs=lab_swarm.owner_listen()) as c:
            return {names[n.peer_id]: n.seen_host for n in await c.list_nodes() if n.peer_id in names}

    # the tracker names where it heard each node from (binds send workers to that host only)
    assert lab_swarm.in_owner(seen_hosts) == {n: lab.address(n) for n in NODES}


@pytest.mark.timeout(300)
def test_two_percent_loss_on_every_link_gives_the_same_text(lab_swarm: LabSwarm) -> None:
    lab = lab_swarm.lab
    names = lab.topology.names
    lossy = LinkChange(loss_pct=2.0)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            lab.link(a, b, lossy)
    try:
        result = lab_swarm.in_owner(lab_swarm.generate)
        assert result.tokens == lab_swarm.reference
        lost = sum(r["drop_loss"] for r in lab.stats()["links"])
        assert lost > 0  # the run did meet the loss
    finally:
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                lab.link(a, b, LinkChange(loss_pct=0.0))


@pytest.mark.timeout(300)
def test_a_node_on_a_5_mbit_uplink_is_served(lab_swarm: LabSwarm) -> None:
    lab = lab_swarm.lab
    uplink_bps = 5_000_000
    fast = lab_swarm.in_owner(lab_swarm.generate)
    slow_node = next(n for n in NODES if lab_swarm.swarm.nodes[n].peer_id == fast.route[0]["node"])
    index = lab.topology.index(slow_node)

    def sent() -> tuple[int, int]:
        """(bytes delivered from the slow node, µs its packets spent on its uplink)"""
        counters = lab.stats()
        delivered = sum(r["delivered_bytes"] for r in counters["links"] if r["src"] == index)
        return delivered, counters["machines"][index]["uplink_wait_us"]

    lab.access(slow_node, uplink_mbit=uplink_bps / 1e6)  # the first hop: the prompt's boundary rows leave over it
    try:
        bytes_before, waited_before = sent()
        slow = lab_swarm.in_owner(lab_swarm.generate)
        bytes_after, waited_after = sent()
    finally:
        lab.access(slow_node)
    assert slow.tokens == lab_swarm.reference
    # The uplink was met, not bypassed: every byte the node sent waited at least its time at
    # 5 Mbit/s (a comparison of two first-token times would be noise: 17 rows are ~30 ms of it).
    sent_bytes = bytes_after - bytes_before
    assert sent_bytes > len(lab_swarm.prompt_tokens) * 576 * 2  # at least the prompt's rows, f16 at the least
    assert (waited_after - waited_before) / 1e6 >= 0.95 * sent_bytes * 8 / uplink_bps


@pytest.mark.timeout(120)
def test_a_steps_result_is_sent_only_to_the_host_its_owner_sent_from(lab_swarm: LabSwarm) -> None:
    """An owner that names another machine's host:port as its own address (to have a volunteer
    connect and send bytes there) is answered only at the host its step came from."""
    lab = lab_swarm.lab

    def listen() -> socket.socket:  # on the tracker's machine: somebody else's host
        sock = socket.create_server((lab.address("tracker"), 0))
        sock.setblocking(False)
        return sock

    target = lab.run_in("tracker", listen)
    target_port = target.getsockname()[1]

    async def body() -> swarm_pb2.StepResult:
        async with open_swarm_client(lab_swarm.swarm.tracker_addr, listen_addrs=lab_swarm.owner_listen()) as client:
            route = await client.route(ALIAS)
            got: list[swarm_pb2.StepResult] = []
            arrived = trio.Event()

            def take(_remote: str, payload: bytes) -> bytes:
                got.append(parse_record(swarm_pb2.StepResult, payload))
                arrived.set()
                return swarm_pb2.StepAck(schema_version=SCHEMA_VERSION).SerializeToString()

            client.transport.set_handler(RESULT_PROTOCOL, ImmediateHandler(take))
            forged = f"/ip4/{lab.address('tracker')}/tcp/{target_port}/tls/p2p/{client.peer_id}"
            session_id = os.urandom(16)
            request = first_step_request(
                session_id=session_id, step=0, hops=route.hops, token_ids=lab_swarm.prompt_tokens[:4],
                first_position=0, recipe_hash=route.recipe_hash, model_sha256=route.model_sha256,
                owner_peer_id=client.peer_id, owner_addrs=[forged, *client.transport.listen_addrs],
                sender_admission=client.admission, result_top_k=1,
            )  # fmt: skip
            first = route.hops[0]
            raw = await client.transport.request(
                first.peer_id, list(first.addrs), STEP_PROTOCOL, request.SerializeToString(), timeout_s=30
            )
            assert parse_record(swarm_pb2.StepAck, raw).error.code == 0
            with trio.fail_after(60):
                await arrived.wait()
            for hop in route.hops:  # (its sequences back for the module's other tests)
                end = swarm_pb2.NodeRequest(schema_version=SCHEMA_VERSION, sender_admission=client.admission)
                end.end_session.session_id = session_id
                await client.transport.request(
                    hop.peer_id, list(hop.addrs), NODE_PROTOCOL, end.SerializeToString(), timeout_s=30
                )
            return got[0]

    try:
        result = lab_swarm.in_owner(body)
        assert not result.HasField("error") or result.error.code == 0, result.error
        try:
            accepted, peer = target.accept()
        except BlockingIOError:
            pass  # nothing connected to the forged address
        else:
            accepted.close()
            pytest.fail(f"{peer} connected to the forged owner address")
    finally:
        target.close()


@pytest.mark.timeout(300)
def test_a_link_cut_mid_generation_resumes_with_the_same_text(lab_swarm: LabSwarm) -> None:
    lab = lab_swarm.lab
    ids = {lab_swarm.swarm.nodes[n].peer_id: n for n in NODES}
    state = {"tokens": 0, "cut": None}

    async def body():
        healed = trio.Event()

        async def on_token(_token: int, _logits, route) -> bool:
            state["tokens"] += 1
            if state["tokens"] == 6:
                a, b = ids[route.hops[0].peer_id], ids[route.hops[1].peer_id]
                state["cut"] = (a, b)
                lab.cut(a, b)  # between the first two hops, for longer than a step deadline
                nursery.start_soon(heal_after, a, b)
            return False

        async def heal_after(a: str, b: str) -> None:
            await trio.sleep(3.0)  # the outage itself: a link that stays down for 3 s
            lab.heal(a, b)
            healed.set()

        async with trio.open_nursery() as nursery:
            result = await lab_swarm.generate(on_token=on_token)
            await healed.wait()
        return result

    result = lab_swarm.in_owner(body)
    assert state["cut"] is not None
    assert result.tokens == lab_swarm.reference
    cut = lab.stats()["links"]
    assert sum(r["drop_down"] for r in cut) > 0  # packets met the cut


@pytest.mark.timeout(400)
def test_a_machine_switched_off_mid_generation_resumes_with_the_same_text(lab_swarm: LabSwarm) -> None:
    lab, swarm = lab_swarm.lab, lab_swarm.swarm
    ids = {swarm.nodes[n].peer_id: n for n in NODES}

    async def add_spare() -> None:
        # a standby: with one copy's worth of memory spare it holds nothing until a range is lost
        swarm.start_node(SPARE, lab_swarm.memory_bytes)
        async with open_swarm_client(swarm.tracker_addr, listen_addrs=lab_swarm.owner_listen()) as c:
            with trio.fail_after(SETUP_TIMEOUT_S):
                while swarm.nodes[SPARE].peer_id not in {n.peer_id for n in await c.list_nodes() if n.alive}:
                    swarm.check_alive()
                    await trio.sleep(0.2)

    lab_swarm.in_owner(add_spare)
    victim: dict[str, str] = {}

    async def on_token(_token: int, _logits, route) -> bool:
        name = ids[route.hops[1].peer_id]  # the middle hop
        victim["name"] = name
        lab.isolate(name)  # gone from the network at once: no reset, no goodbye
        await swarm.kill_node(name)
        return False

    async def body():
        count = {"n": 0}

        async def counted(token: int, logits, route) -> bool:
            count["n"] += 1
            return await on_token(token, logits, route) if count["n"] == 8 else False

        return await lab_swarm.generate(on_token=counted, replan_attempts=2, replan_wait_s=60.0)

    try:
        result = lab_swarm.in_owner(body)
    finally:
        if "name" in victim:
            lab.isolate(victim["name"], up=True)
    assert result.tokens == lab_swarm.reference
    assert result.replans >= 1
    assert swarm.nodes[SPARE].peer_id in [h["node"] for h in result.route]
