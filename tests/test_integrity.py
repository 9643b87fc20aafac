"""Output integrity in an open swarm, with real processes (tracker, nodes, workers
through ``agent.harness.local_swarm``; the client over libp2p):

- model bytes are verified where they are used: a node whose GGUF was changed in place (same
  size, same mtime, so a cached whole-file hash still says it is the registered model) is
  refused before it serves, with the tensor named;
- a node that turns bad mid-generation (``python -m agent.testing.faulty_node``: noise on the
  outputs of steps it has not seen before) is caught by a canary within 1.5 canary intervals
  plus one check, withdrawn, and the generation routed through it moves and finishes with one
  unsplit worker's tokens;
- honest nodes of one recipe pass 1,000 canaries (merged into Forwards with live traffic whose
  every session is spot-checked through the other copy) without one false positive.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import trio

from agent.demo.local_demo import generate_through
from agent.demo.swarm_demo import wait_for_copies, wait_for_coverage
from agent.harness.local_swarm import LocalSwarm, LocalSwarmConfig
from agent.io.client import SwarmClientConfig, open_swarm_client
from agent.io.worker.process import open_worker
from agent.models import cached_sha256, model_path, sha256_file
from agent.testing.faulty_node import FAULTY_NODE_COMMAND

pytestmark = [pytest.mark.swarm, pytest.mark.slow]

ALIAS = "smollm2"
VICTIM = "blk.15.ffn_up.weight"


def _damage_in_place(path: Path, tensor: str) -> None:
    """Flip bytes inside ``tensor``, keeping the file's size and mtime."""
    from gguf import GGUFReader

    (offset,) = [int(t.data_offset) for t in GGUFReader(path).tensors if t.name == tensor]
    stat = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset + 100)
        data = f.read(8)
        f.seek(offset + 100)
        f.write(bytes(b ^ 0xFF for b in data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns


@pytest.mark.timeout(300)
async def test_a_file_changed_in_place_is_refused_before_serving_naming_the_tensor(tmp_path: Path) -> None:
    pristine = model_path("smollm2")
    copy = tmp_path / "damaged.gguf"
    shutil.copyfile(pristine, copy)
    registered = cached_sha256(pristine)
    assert await trio.to_thread.run_sync(cached_sha256, copy) == registered  # the hash cache now vouches for it
    _damage_in_place(copy, VICTIM)
    assert cached_sha256(copy) == registered  # ... and still does: size and mtime are unchanged

    swarm = LocalSwarm(LocalSwarmConfig(model_path=pristine, model_alias=ALIAS), tmp_path / "swarm")
    try:
        await swarm.start_tracker()
        async with open_swarm_client(swarm.tracker_addr) as client:
            (entry,) = [m for m in await client.list_models() if m.alias == ALIAS]
            whole_model = entry.n_layer * entry.bytes_per_block * 2
            node = swarm.start_node("damaged", whole_model, ["--model", str(copy)], model=False)
            failures = []
            with trio.fail_after(120):
                while not failures:
                    swarm.check_alive()
                    for listed in await client.list_nodes():
                        if listed.peer_id == node.peer_id:
                            failures = list(listed.load_failures)
                    await trio.sleep(0.2)
            # the tracker shows the operator the node's reason: the tensor that is wrong
            (failure,) = failures
            assert VICTIM in failure.error and "does not match the tracker's manifest" in failure.error, failure.error
            assert (failure.assignment.begin, failure.assignment.end) == (0, entry.n_layer)
            with pytest.raises(Exception, match="no ready node"):
                await client.route(ALIAS)
            assert " READY " not in node.log_tail()  # its worker never served
    finally:
        await swarm.aclose()


# --- canaries and spot checks ----------------------------------------------------------------------

PROMPT = "The capital of France is"
NEW_TOKENS = 40
SETUP_TIMEOUT_S = 240.0


async def _unsplit(path: Path, prompt: str, new_tokens: int) -> tuple[list[int], list[int]]:
    """(prompt tokens, greedy tokens) of one unsplit worker."""
    async with open_worker(path, 0, None, threads=1, max_sequences=1, model_sha256=sha256_file(path)) as single:
        tokens = await single.client.tokenize(prompt, add_special=True)
        run = await generate_through([single.client], tokens, new_tokens, stop_tokens=single.info.eog_token_ids)
        return tokens, run.tokens


@pytest.mark.timeout(420)
async def test_a_node_turning_bad_is_caught_withdrawn_and_its_generation_finishes_as_one_unsplit_worker(
    tmp_path: Path,
) -> None:
    interval_s = 1.0
    flag = tmp_path / "turn-bad"
    path = model_path(ALIAS)
    config = LocalSwarmConfig(
        model_path=path, model_alias=ALIAS, canary_interval_s=interval_s,
        tracker_args=("--canary-max-prompt-rows", "8", "--canary-max-decode-steps", "2"),
    )  # fmt: skip
    swarm = LocalSwarm(config, tmp_path / "swarm")
    try:
        prompt_tokens, expected = await _unsplit(path, PROMPT, NEW_TOKENS)
        await swarm.start_tracker()
        client_config = SwarmClientConfig(replan_attempts=2, replan_wait_s=60.0)
        async with open_swarm_client(swarm.tracker_addr, config=client_config) as client:
            (entry,) = [m for m in await client.list_models() if m.alias == ALIAS]
            memory = 15 * entry.bytes_per_block + entry.bytes_per_block // 2  # two copies of [0, 15) [15, 30)
            for name in ("honest-1", "honest-2", "honest-3"):
                swarm.start_node(name, memory)
            cheater = swarm.start_node(
                "cheater",
                memory,
                ["--corrupt-outputs", "1.0", "--corrupt-while-file", str(flag)],
                command=FAULTY_NODE_COMMAND,
            )
            # every range has two copies that passed their first check
            await wait_for_coverage(client, swarm, ALIAS, timeout_s=SETUP_TIMEOUT_S)
            nodes = await wait_for_copies(client, swarm, 2, timeout_s=SETUP_TIMEOUT_S, checked=True)
            (bad_range,) = [
                (s.assignment.begin, s.assignment.end) for n in nodes if n.peer_id == cheater.peer_id for s in n.serving
            ]
            twins = [
                n.peer_id
                for n in nodes
                for s in n.serving
                if n.peer_id != cheater.peer_id and (s.assignment.begin, s.assignment.end) == bad_range
            ]
            route = await client.route(ALIAS, avoid_peers=twins)  # a route through the cheater
            assert cheater.peer_id in [hop.peer_id for hop in route.hops]
            caught_after: list[float] = []

            async def turn_bad_after_five(token: int, _logits, _route) -> bool:
                if len(caught_after) == 0 and not flag.exists() and token is not None and turn_bad_after_five.n == 5:
                    flag.touch()  # the cheater's outputs go bad from here on, for checks and this generation
                    started = trio.current_time()
                    with trio.fail_after(60):
                        while not next(
                            n for n in await client.list_nodes() if n.peer_id == cheater.peer_id
                        ).integrity_failures:
                            swarm.check_alive()
                            await trio.sleep(0.05)
                    caught_after.append(trio.current_time() - started)
                turn_bad_after_five.n += 1
                return False

            turn_bad_after_five.n = 0
            result = await client.generate_tokens(
                ALIAS, prompt_tokens, max_tokens=NEW_TOKENS, on_token=turn_bad_after_five, route=route,
                stop_tokens=[],
            )  # fmt: skip
            # caught by a canary within 1.5 intervals and one check (a few seconds on a busy machine)
            (caught_s,) = caught_after
            assert caught_s < 1.5 * interval_s + 20.0, caught_s
            # moved: the tokens it computed were taken back and the generation redone elsewhere
            assert result.tokens == expected[: len(result.tokens)] and len(result.tokens) == NEW_TOKENS
            assert result.tokens_taken_back >= 5 and result.replans >= 1
            assert cheater.peer_id not in [hop["node"] for hop in result.route]
            nodes = {n.peer_id: n for n in await client.list_nodes()}
            failure = nodes[cheater.peer_id].integrity_failures[0]
            assert failure.check_id.startswith("canary-") and failure.expected_sha256 != failure.returned_sha256
            assert failure.output in ("boundary rows", "top-40 logits") and failure.max_abs_diff > 0
            assert not [a for a in nodes[cheater.peer_id].assigned], "withdrawn: assigned nothing"
            for name in ("honest-1", "honest-2", "honest-3"):
                honest = nodes[swarm.nodes[name].peer_id]
                assert not honest.integrity_failures and honest.checks_passed >= 1, honest
            # with the cheater out, a new generation goes around it and is right
            again = await client.generate_tokens(ALIAS, prompt_tokens, max_tokens=NEW_TOKENS, stop_tokens=[])
            assert again.tokens == expected and again.tokens_taken_back == 0
        # an operator sees it, with the evidence
        with trio.fail_after(60):
            listing = await trio.run_process(
                [sys.executable, "-m", "agent.cli", "tracker", "nodes", "--db", str(swarm.db_path)],
                capture_stdout=True, capture_stderr=True, check=True,
            )  # fmt: skip
        nodes_text = listing.stdout.decode()
        evidence = [line for line in nodes_text.splitlines() if f"{cheater.peer_id} INTEGRITY" in line]
        assert evidence and failure.check_id in evidence[0] and failure.expected_sha256 in evidence[0], nodes_text
    finally:
        await swarm.aclose()


@pytest.mark.timeout(900)
async def test_honest_nodes_of_one_recipe_pass_a_thousand_canaries_and_spot_checks(tmp_path: Path) -> None:
    path = model_path(ALIAS)
    config = LocalSwarmConfig(
        model_path=path, model_alias=ALIAS, canary_interval_s=0.001,  # back to back
        tracker_args=("--canary-max-prompt-rows", "12", "--canary-max-decode-steps", "2"),
    )  # fmt: skip
    swarm = LocalSwarm(config, tmp_path / "swarm")
    try:
        prompt_tokens, expected = await _unsplit(path, PROMPT, 16)
        await swarm.start_tracker()
        # every session is replayed through the other copy and compared bit for bit
        client_config = SwarmClientConfig(spot_check_rate=1.0, replan_attempts=0)
        async with open_swarm_client(swarm.tracker_addr, config=client_config) as client:
            (entry,) = [m for m in await client.list_models() if m.alias == ALIAS]
            memory = 15 * entry.bytes_per_block + entry.bytes_per_block // 2
            for i in range(4):
                swarm.start_node(f"node-{i + 1}", memory)
            await wait_for_coverage(client, swarm, ALIAS, timeout_s=SETUP_TIMEOUT_S)
            await wait_for_copies(client, swarm, 2, timeout_s=SETUP_TIMEOUT_S, checked=True)
            generations = 0
            with trio.fail_after(800):
                while True:
                    # live traffic, merged into the nodes' Forwards with the canaries
                    result = await client.generate_tokens(ALIAS, prompt_tokens, max_tokens=16, stop_tokens=[])
                    assert result.tokens == expected and result.tokens_taken_back == 0
                    generations += 1
                    nodes = await client.list_nodes()
                    swarm.check_alive()
                    assert not [f for n in nodes for f in n.integrity_failures], nodes
                    if sum(n.checks_passed for n in nodes) >= 1000:
                        break
            stats = client.spot_checks.stats
        assert stats.mismatches == 0 and stats.sessions == generations, stats
        assert stats.agreed >= generations * 16 - stats.inconclusive * 16, stats
    finally:
        await swarm.aclose()
