"""Model bytes are verified where they are used (issue 11, item 1), with real processes: a
node whose GGUF was changed in place (same size, same mtime, so a cached whole-file hash still
says it is the registered model) is refused before it serves, with the tensor named."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import trio

from agent.harness.local_swarm import LocalSwarm, LocalSwarmConfig
from agent.io.client import open_swarm_client
from agent.models import cached_sha256, model_path

pytestmark = pytest.mark.slow

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
