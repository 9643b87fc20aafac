"""A worker refuses, at load and with a reason, what it cannot run with exact numbers.

Real worker processes on metadata-only GGUFs (hyperparameters + tokenizer, no tensors): the
architecture check for a partial range runs before any weight is read, so a file without
tensors tells that refusal apart from an ordinary load failure.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.io.worker.process import WorkerStartError, open_worker
from agent.testing.synthetic import write_metadata_only

pytestmark = [pytest.mark.worker, pytest.mark.timeout(120)]


@pytest.fixture
def gpt2_metadata(tmp_path: Path, smollm2_path: Path) -> Path:
    path = tmp_path / "gpt2-metadata.gguf"
    write_metadata_only(path, "gpt2", smollm2_path, n_layer=4)
    return path


async def test_partial_range_of_unsupported_architecture_is_refused(gpt2_metadata: Path) -> None:
    with pytest.raises(WorkerStartError) as caught:
        async with open_worker(gpt2_metadata, 0, 2, threads=1):
            pytest.fail("a worker for [0, 2) of a gpt2 model started")
    error = caught.value
    assert error.exit_code == 1
    assert "architecture 'gpt2' does not support ranged execution" in error.log_tail


async def test_whole_unsupported_model_fails_for_its_own_reason(gpt2_metadata: Path) -> None:
    # The whole model is not a range: it is not refused for its architecture, and this file
    # then fails on its (absent) tensors instead.
    with pytest.raises(WorkerStartError) as caught:
        async with open_worker(gpt2_metadata, 0, None, threads=1):
            pytest.fail("a worker started on a GGUF without tensors")
    assert "does not support ranged execution" not in caught.value.log_tail
    assert "token_embd.weight' not found" in caught.value.log_tail


async def test_range_past_the_last_block_is_refused(smollm2_path: Path) -> None:
    with pytest.raises(WorkerStartError) as caught:
        async with open_worker(smollm2_path, 3, 31, threads=1):
            pytest.fail("a worker for [3, 31) of a 30-block model started")
    assert caught.value.exit_code == 1
    assert "layer range [3, 31) is not a non-empty range within the model's 30 blocks" in caught.value.log_tail
