"""The tracker's canary checks in one process: the real tracker and its verifier, real node
agents with REAL worker processes (tiny synthetic qwen2, 6 blocks), over a ``MemoryNetwork``.

A node that corrupts what it has not seen before is caught by its first check, its range
withdrawn (not routed, not assigned to it again), the evidence shown in the node list;
registering anew it is checked before it is routed, fails again and is refused. Honest
nodes pass; a replayed canary would not catch the cheater, a fresh one does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent._proto import swarm_pb2
from agent.core.net.identity import peer_id_from_public_key
from agent.core.tracker.canary import CanaryPolicy
from agent.core.wire.admission import public_key_bytes
from agent.core.wire.fingerprint import DeviceInfo, HostProbe
from agent.io.net.transport import MemoryNetwork
from agent.io.node.agent import Node, serve_node
from agent.io.node.config import LocalModel, NodeConfig, NodeRefused
from agent.io.tracker.cli import register_models
from agent.io.tracker.config import TrackerConfig
from agent.io.tracker.reference import ReferencePool
from agent.io.tracker.service import Tracker, serve_tracker
from agent.io.tracker.store import open_store
from agent.io.tracker.verifier import run_check
from agent.io.tracker.verifier_api import VerifierConfig
from agent.testing.faulty import CorruptOutputs, OutputCorrupter
from agent.testing.tiny_models import TINY_MODELS

pytestmark = [pytest.mark.swarm, pytest.mark.slow]

State = swarm_pb2.AssignmentStatus.State
ALIAS = "qwen2-tiny"
PROBE = HostProbe(
    os="Linux test", cpu_model="test cpu", cpu_cores=2, ram_total_bytes=8 << 30, ram_available_bytes=4 << 30,
    devices=(DeviceInfo("CPU", "CPU", 8 << 30, 4 << 30),), llama_cpp_commit="pin", patch_series_sha256="patches",
    architectures=("qwen2",), decode_s_per_block=0.001, bandwidth_bytes_per_s=1e9,
)  # fmt: skip
VERIFIER = VerifierConfig(step_timeout_s=20.0)


def new_peer() -> tuple[Ed25519PrivateKey, str]:
    key = Ed25519PrivateKey.generate()
    return key, peer_id_from_public_key(public_key_bytes(key))


def memory_personas(network: MemoryNetwork):
    """``open_persona`` for the verifier: a fresh peer on the network, gone afterwards."""

    @contextlib.asynccontextmanager
    async def open_persona(key: Ed25519PrivateKey) -> AsyncIterator:
        peer_id = peer_id_from_public_key(public_key_bytes(key))
        try:
            yield network.add(peer_id)
        finally:
            network.peers.pop(peer_id, None)

    return open_persona


@dataclasses.dataclass
class Swarm:
    network: MemoryNetwork
    tracker: Tracker
    model: LocalModel
    nursery: trio.Nursery
    blocks_bytes: int

    @property
    def tracker_addr(self) -> str:
        return self.tracker.transport.listen_addrs[0]

    async def start_node(
        self, key: Ed25519PrivateKey, blocks: int, corrupt: CorruptOutputs | None = None, **overrides
    ) -> tuple[Node, trio.CancelScope, trio.Event]:
        """A node offering memory for ``blocks`` blocks, corrupting its outputs as ``corrupt``
        says (None: an honest node); cancel the scope to stop it (the event is set once it
        stopped)."""
        peer_id = peer_id_from_public_key(public_key_bytes(key))
        config = NodeConfig(
            tracker=self.tracker_addr, key=key, models=(self.model,), memory_bytes=blocks * self.blocks_bytes + 1,
            threads=1, ctx_size=128, max_sequences=4, batch_size=64, probe=PROBE, **overrides,
        )  # fmt: skip
        transport = self.network.peers.get(peer_id) or self.network.add(peer_id)
        scope = trio.CancelScope()
        stopped = trio.Event()

        async def run(task_status: trio.TaskStatus[Node]) -> None:
            try:
                with scope:
                    await serve_node(
                        config, transport, outputs_filter=OutputCorrupter(corrupt) if corrupt else None,
                        task_status=task_status,
                    )  # fmt: skip
            finally:
                stopped.set()

        return await self.nursery.start(run), scope, stopped

    def entry(self, peer_id: str) -> swarm_pb2.NodeEntry:
        (entry,) = [e for e in self.tracker.node_entries() if e.peer_id == peer_id]
        return entry

    def routable(self) -> list[tuple[str, int, int]]:
        """(peer, begin, end) of every range the tracker would route through."""
        entries = self.tracker.node_entries()
        return sorted(
            (e.peer_id, s.assignment.begin, s.assignment.end)
            for e in entries if e.alive for s in e.serving
            if s.state == State.READY and not s.awaiting_check and (e.peer_id, s.assignment.model_sha256) not in self.tracker.withdrawn
        )  # fmt: skip


@contextlib.asynccontextmanager
async def open_swarm(tmp_path: Path, model_path: Path, policy: CanaryPolicy) -> AsyncIterator[Swarm]:
    network = MemoryNetwork()
    key, peer_id = new_peer()
    config = TrackerConfig(
        llama_cpp_commit="pin", patch_series_sha256="patches", heartbeat_interval_ms=200, heartbeat_timeout_ms=5000,
        canary=policy,
    )  # fmt: skip
    with open_store(tmp_path / "tracker.db") as store:
        (entry,) = register_models(store, [(model_path, ALIAS)], int(time.time() * 1000))
        model = LocalModel(path=str(model_path), sha256=entry.sha256)
        async with trio.open_nursery() as nursery:
            tracker = await nursery.start(
                functools.partial(
                    serve_tracker, network.add(peer_id), store, config, key, verifier=VERIFIER,
                    open_persona=memory_personas(network),
                )
            )  # fmt: skip
            yield Swarm(network, tracker, model, nursery, entry.bytes_per_block)
            nursery.cancel_scope.cancel()


async def wait_for(swarm: Swarm, predicate, timeout_s: float = 60.0) -> None:
    with trio.fail_after(timeout_s):
        await swarm.tracker.wait_until(predicate)


@pytest.mark.timeout(240)
async def test_a_node_corrupting_what_it_has_not_seen_is_caught_withdrawn_then_refused(
    tmp_path: Path, qwen2_tiny_path: Path
) -> None:
    policy = CanaryPolicy(interval_s=0.5, max_prompt_rows=8, max_decode_steps=3, refuse_after_failures=2)
    async with open_swarm(tmp_path, qwen2_tiny_path, policy) as swarm:
        honest_key, honest = new_peer()
        cheater_key, cheater = new_peer()
        await swarm.start_node(honest_key, 3)
        corrupt = CorruptOutputs(scale=0.5)
        _, cheater_scope, cheater_stopped = await swarm.start_node(cheater_key, 3, corrupt)
        tracker = swarm.tracker

        # its first check (at READY, before any route goes through it) catches it
        await wait_for(swarm, lambda: swarm.entry(cheater).integrity_failures)
        (failure,) = swarm.entry(cheater).integrity_failures
        assert failure.check_id.startswith("canary-") and failure.output in ("boundary rows", "top-40 logits")
        assert len(failure.expected_sha256) == 64 and failure.expected_sha256 != failure.returned_sha256
        assert failure.max_abs_diff > 0 and not swarm.entry(cheater).refused
        assert (cheater, TINY_MODELS[ALIAS].sha256) in tracker.withdrawn
        # withdrawn: no longer assigned (the node unloads it), never routed
        await wait_for(swarm, lambda: not swarm.entry(cheater).assigned and not swarm.entry(cheater).serving)
        assert all(peer != cheater for peer, _, _ in swarm.routable())
        # the honest node keeps passing its checks
        await wait_for(swarm, lambda: swarm.entry(honest).checks_passed >= 3)
        assert not swarm.entry(honest).integrity_failures

        # registering anew, it is assigned again, checked before it is routed, and refused
        cheater_scope.cancel()
        await cheater_stopped.wait()
        with pytest.RaisesGroup(NodeRefused, allow_unwrapped=True, flatten_subgroups=True):
            await serve_node(
                NodeConfig(
                    tracker=swarm.tracker_addr, key=cheater_key, models=(swarm.model,),
                    memory_bytes=3 * swarm.blocks_bytes + 1, threads=1, ctx_size=128, max_sequences=4, probe=PROBE,
                ),
                swarm.network.peers[cheater],
                outputs_filter=OutputCorrupter(corrupt),
            )  # fmt: skip
        entry = swarm.entry(cheater)
        assert len(entry.integrity_failures) == 2 and "failed 2 integrity checks" in entry.refused
        assert entry.checks_passed == 0 and not entry.alive
        # and from then on its registrations are refused at once, with the reason
        with pytest.raises(NodeRefused, match="failed 2 integrity checks"):
            await serve_node(
                NodeConfig(tracker=swarm.tracker_addr, key=cheater_key, models=(swarm.model,), probe=PROBE),
                swarm.network.peers[cheater],
            )
        stats = tracker.verifier_stats
        assert stats.failed == 2 and stats.passed >= 3


@pytest.mark.timeout(240)
async def test_a_replayed_canary_would_pass_a_memorising_cheater_a_fresh_one_does_not(
    tmp_path: Path, qwen2_tiny_path: Path
) -> None:
    policy = CanaryPolicy(interval_s=3600.0, max_prompt_rows=8, max_decode_steps=2)
    flag = tmp_path / "corrupt"
    async with open_swarm(tmp_path, qwen2_tiny_path, policy) as swarm:
        key, peer = new_peer()
        await swarm.start_node(key, 6, CorruptOutputs(scale=0.5, while_file=str(flag)))
        await wait_for(swarm, lambda: swarm.entry(peer).checks_passed == 1)  # honest while the flag is absent
        (a,) = [s.assignment for s in swarm.entry(peer).serving]
        range_key = (peer, a.model_sha256, a.begin, a.end)
        async with trio.open_nursery() as nursery:
            pool = ReferencePool(nursery, VERIFIER, ctx_size=256, batch_size=8)
            check = functools.partial(
                run_check, swarm.tracker, range_key, pool, VERIFIER, memory_personas(swarm.network)
            )
            assert (await check(np.random.default_rng(7))).status == "passed"  # it sees canary 7
            flag.touch()  # from now on it corrupts what it has not seen
            replayed = await check(np.random.default_rng(7))
            fresh = await check(np.random.default_rng(8))
            nursery.cancel_scope.cancel()
        assert replayed.status == "passed", replayed  # it knew that one's answers
        assert fresh.status == "failed" and fresh.mismatch is not None and fresh.mismatch.step == 0, fresh


async def test_a_persona_answers_a_step_batch_as_a_node_does_and_takes_only_its_own_step() -> None:
    """The persona's ``/baton/steps``: one ack per step, in order; the expected step's rows are
    taken, another session's step and a step from another peer are NOT_FOUND, and a batch that
    does not parse gets one INVALID_ARGUMENT ack (a persona that answered otherwise would be a
    tell to a node that cheats only when it is not watched)."""
    from agent.core.wire.step_batch import step_batch
    from agent.core.wire.step_validation import RangeSpec
    from agent.core.wire.swarm_wire import crc32
    from agent.io.tracker.personas import Inbox

    Code = swarm_pb2.Error.Code
    session = bytes(range(16))
    downstream = RangeSpec(
        model_sha256="ab" * 32, begin=2, end=4, n_layer=6, n_embd=8, n_vocab=100, recipe_hash="cd" * 32, n_batch_max=4
    )

    def pushed(session_id: bytes, rows: np.ndarray) -> bytes:
        data = rows.astype("<f4").tobytes()
        return swarm_pb2.StepRequest(
            schema_version=1, session_id=session_id, step=3, begin=2, end=4, positions=[7], boundary=data, dtype=1,
            n_embd=8, recipe_hash="cd" * 32, owner_peer_id="owner", checksum=crc32(data), model_sha256="ab" * 32,
            rest=[swarm_pb2.Hop(peer_id="last", addrs=["/memory/last"], begin=4, end=6)],
            sender_admission=swarm_pb2.SignedAdmission(record=b"r", signature=b"s"),
        ).SerializeToString()  # fmt: skip

    rows = np.arange(8, dtype=np.float32).reshape(1, 8) / 3
    inbox = Inbox("node", session, downstream)
    inbox.expect(3)
    batch = step_batch([pushed(bytes(16), rows + 1), pushed(session, rows)])
    acks = swarm_pb2.StepBatchAck.FromString(await inbox.on_steps("stranger", batch)).acks
    assert [a.error.code for a in acks] == [Code.NOT_FOUND, Code.NOT_FOUND] and not inbox.arrived.is_set()
    acks = swarm_pb2.StepBatchAck.FromString(await inbox.on_steps("node", batch)).acks
    assert [a.error.code for a in acks] == [Code.NOT_FOUND, 0], acks
    assert inbox.arrived.is_set() and np.array_equal(inbox.rows, rows) and not inbox.malformed
    acks = swarm_pb2.StepBatchAck.FromString(await inbox.on_steps("node", b"\xff\xff")).acks
    assert len(acks) == 1 and acks[0].error.code == Code.INVALID_ARGUMENT
