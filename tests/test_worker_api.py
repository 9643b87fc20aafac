"""The worker API against the real binary: Info accounting, every refusal of a bad request
(status code + message), and that a worker which refused bad requests still computes
exactly what it should.

The workers run with one thread and small contexts; each test starts the workers it needs
once and groups its checks, because starting processes is the expensive part.
"""

from __future__ import annotations

import math
import os
import re
import signal
import struct
import sys
from collections.abc import Awaitable
from pathlib import Path

import gguf
import numpy as np
import psutil
import pytest
import trio

from agent._proto import worker_pb2
from agent.core.owner.parity import max_abs_diff
from agent.core.wire.boundary import WireDType
from agent.core.wire.topk import WORKER_LOG_SUM_EXP_BOUND, select_top_k
from agent.core.wire.worker_records import SeqInput
from agent.harness.parity_run import compare_workers, make_prompts, open_workers
from agent.io.worker import process as worker_process
from agent.io.worker.client import AsyncWorkerClient, ClientConfig
from agent.io.worker.error import WorkerError
from agent.io.worker.process import WorkerBinaryNotFound, WorkerStartError, find_worker_binary, open_worker
from agent.models import sha256_file

pytestmark = pytest.mark.worker

TOLERANCE = 1e-4
REPO_ROOT = Path(__file__).resolve().parent.parent


# --- helpers -------------------------------------------------------------------------------


async def expect_error(call: Awaitable, code_name: str, *fragments: str) -> WorkerError:
    """Await ``call``; it must fail with ``code_name`` and a message holding every fragment."""
    with pytest.raises(WorkerError) as caught:
        await call
    error = caught.value
    assert error.code_name == code_name, str(error)
    for fragment in fragments:
        assert fragment in error.message, f"{fragment!r} not in {error.message!r}"
    return error


def forward_request(*entries: worker_pb2.SequenceInput, schema_version: int = 1) -> worker_pb2.ForwardRequest:
    return worker_pb2.ForwardRequest(schema_version=schema_version, entries=list(entries))


def boundary_entry(
    seq_id: int, positions: list[int], rows: np.ndarray, dtype: int = worker_pb2.DTYPE_F32, **fields
) -> worker_pb2.SequenceInput:
    raw = rows.astype("<f4").tobytes() if dtype != worker_pb2.DTYPE_F16 else rows.astype("<f2").tobytes()
    return worker_pb2.SequenceInput(seq_id=seq_id, positions=positions, boundary=raw, boundary_dtype=dtype, **fields)


_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_tensor_bytes(path: Path) -> dict[str, int]:
    """Tensor name -> byte size, from the GGUF header alone.

    ``gguf.GGUFReader`` parses every metadata value into numpy views, which takes ~10 s for
    Gemma-3's 262k-token vocabulary; this skips the metadata (``tests`` cross-checks it
    against GGUFReader on a small model).
    """
    data = path.read_bytes()
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", data, 0)
    assert magic == b"GGUF" and version >= 2, (magic, version)
    offset = 24

    def skip_value(value_type: int) -> None:
        nonlocal offset
        if value_type in _GGUF_SCALAR_BYTES:
            offset += _GGUF_SCALAR_BYTES[value_type]
        elif value_type == _GGUF_STRING:
            (length,) = struct.unpack_from("<Q", data, offset)
            offset += 8 + length
        elif value_type == _GGUF_ARRAY:
            item_type, count = struct.unpack_from("<IQ", data, offset)
            offset += 12
            if item_type in _GGUF_SCALAR_BYTES:
                offset += count * _GGUF_SCALAR_BYTES[item_type]
            else:
                for _ in range(count):
                    skip_value(item_type)
        else:
            raise AssertionError(f"unknown GGUF value type {value_type}")

    for _ in range(n_kv):
        skip_value(_GGUF_STRING)  # the key
        (value_type,) = struct.unpack_from("<I", data, offset)
        offset += 4
        skip_value(value_type)
    sizes = {}
    for _ in range(n_tensors):
        (length,) = struct.unpack_from("<Q", data, offset)
        name = data[offset + 8 : offset + 8 + length].decode()
        offset += 8 + length
        (n_dims,) = struct.unpack_from("<I", data, offset)
        dims = struct.unpack_from(f"<{n_dims}Q", data, offset + 4)
        ggml_type, _data_offset = struct.unpack_from("<IQ", data, offset + 4 + 8 * n_dims)
        offset += 4 + 8 * n_dims + 12
        block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
        sizes[name] = math.prod(dims) // block_size * type_size
    return sizes


def expected_weight_bytes(sizes: dict[str, int], begin: int, end: int, n_layer: int) -> int:
    """Sum of the GGUF sizes of the tensors a worker for [begin, end) must hold (each once)."""
    names = set()
    for name in sizes:
        match = re.match(r"blk\.(\d+)\.", name)
        if match and begin <= int(match.group(1)) < end:
            names.add(name)
    if begin == 0:
        names |= {n for n in sizes if n.startswith("token_embd.")}
    if end == n_layer:
        names |= {n for n in sizes if n.startswith(("output_norm.", "output."))}
        if "output.weight" not in sizes:  # tied embeddings: the head is token_embd.weight
            names.add("token_embd.weight")
    return sum(sizes[n] for n in names)


# --- no worker process needed --------------------------------------------------------------


def test_find_worker_binary_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-worker"
    monkeypatch.setenv("BATON_WORKER_BIN", str(missing))
    with pytest.raises(WorkerBinaryNotFound, match=r"\$BATON_WORKER_BIN = .*no-such-worker.* is not an executable"):
        find_worker_binary()
    fake = tmp_path / "worker"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("BATON_WORKER_BIN", str(fake))
    assert find_worker_binary() == fake


async def test_client_maps_grpc_failures_to_worker_error(tmp_path: Path) -> None:
    async with AsyncWorkerClient(str(tmp_path / "nobody.sock"), ClientConfig(timeout_s=5.0)) as client:
        error = await expect_error(client.health(), "UNAVAILABLE")
    assert error.method == "Health"
    assert str(error).startswith("Health: UNAVAILABLE: ")


def test_wire_dtype_matches_generated_stubs() -> None:
    assert WireDType.F32 == worker_pb2.DTYPE_F32
    assert WireDType.F16 == worker_pb2.DTYPE_F16
    assert WireDType.UNSPECIFIED == worker_pb2.DTYPE_UNSPECIFIED
    assert worker_pb2.SCHEMA_VERSION_CURRENT == 1


async def test_cli_worker_execs_the_binary_with_matching_flags(tmp_path: Path) -> None:
    fake = tmp_path / "fake-worker"
    argv_file = tmp_path / "argv"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$0" "$@" > {argv_file}\n')
    fake.chmod(0o755)
    env = {**os.environ, "BATON_WORKER_BIN": str(fake)}
    argv = [
        sys.executable, "-m", "agent.cli", "worker", "--model", "m.gguf", "--layers", "10:", "--socket", "/tmp/w.sock",
        "--ctx-size", "256", "--max-sequences", "3", "--batch-size", "32", "--threads", "2", "--gpu-layers", "0",
    ]  # fmt: skip
    result = await trio.run_process(argv, env=env, cwd=REPO_ROOT, capture_stderr=True, check=False)
    assert result.returncode == 0, result.stderr
    assert argv_file.read_text().splitlines() == [
        str(fake), "--model", "m.gguf", "--layers", "10:", "--socket", "/tmp/w.sock", "--ctx-size", "256",
        "--max-sequences", "3", "--batch-size", "32", "--threads", "2", "--gpu-layers", "0",
    ]  # fmt: skip

    bad = [sys.executable, "-m", "agent.cli", "worker", "--model", "m", "--layers", "5:3", "--socket", "s"]
    result = await trio.run_process(bad, env=env, cwd=REPO_ROOT, capture_stderr=True, check=False)
    assert result.returncode == 2
    assert b"end 3 must be greater than begin 5" in result.stderr


def test_gguf_tensor_bytes_agrees_with_gguf_reader(qwen3_tiny_path: Path) -> None:
    reader = gguf.GGUFReader(qwen3_tiny_path)
    sizes = gguf_tensor_bytes(qwen3_tiny_path)
    assert sizes == {t.name: int(t.n_bytes) for t in reader.tensors}
    assert len(sizes) == 69 and "output.weight" in sizes


def fake_worker(tmp_path: Path, body: str) -> Path:
    """A stand-in for the worker binary: a shell script that records its pid, then ``body``."""
    script = tmp_path / "fake-worker"
    script.write_text(f"#!/bin/sh\necho $$ > {tmp_path / 'pid'}\n{body}\n")
    script.chmod(0o755)
    return script


async def test_worker_that_exits_while_starting_reports_code_and_stderr(tmp_path: Path) -> None:
    fake = fake_worker(tmp_path, "echo 'cannot load: boom' >&2\nexit 3")
    with pytest.raises(WorkerStartError, match="worker exited with code 3 while starting") as caught:
        async with open_worker("model.gguf", 0, None, binary=fake):
            pytest.fail("the fake worker exits")
    assert caught.value.exit_code == 3
    assert caught.value.log_tail == "cannot load: boom"
    assert "cannot load: boom" in str(caught.value)


async def test_worker_that_never_gets_ready_is_stopped(tmp_path: Path) -> None:
    fake = fake_worker(tmp_path, "exec sleep 1000")
    with pytest.raises(WorkerStartError, match=r"worker not ready after 0.3 s") as caught:
        async with open_worker("model.gguf", 0, None, binary=fake, ready_timeout_s=0.3):
            pytest.fail("the fake worker never listens")
    # Stopped with SIGTERM and reaped before open_worker returned.
    assert caught.value.exit_code is None  # it was still running when the wait gave up
    pid_file = tmp_path / "pid"
    if pid_file.exists():  # absent only if the shell had not even started after 0.3 s
        assert not psutil.pid_exists(int(pid_file.read_text()))


async def test_cancelled_startup_terminates_then_kills(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The fake ignores SIGTERM (an ignored signal stays ignored across exec), so stopping it
    # needs the SIGKILL after the grace period. It says when its trap is set through a FIFO.
    fifo = tmp_path / "trap-set"
    os.mkfifo(fifo)
    fake = fake_worker(tmp_path, f"trap '' TERM\necho set > {fifo}\nexec sleep 1000")
    started: list[trio.Process] = []
    with trio.CancelScope() as scope:

        async def cancel_while_waiting(process: trio.Process, *args: object) -> None:
            started.append(process)
            assert await trio.to_thread.run_sync(fifo.read_text) == "set\n"
            scope.cancel()
            await trio.sleep_forever()

        monkeypatch.setattr(worker_process, "_wait_ready", cancel_while_waiting)
        async with open_worker("model.gguf", 0, None, binary=fake, stop_grace_s=0.2):
            pytest.fail("startup was cancelled")
    assert scope.cancelled_caught
    (process,) = started
    assert process.returncode == -signal.SIGKILL
    socket_dir = Path(process.args[process.args.index("--socket") + 1]).parent
    assert not socket_dir.exists(), "the private temp dir must be removed"


async def test_open_worker_refuses_a_socket_path_too_long(tmp_path: Path) -> None:
    fake = fake_worker(tmp_path, "exit 0")
    with pytest.raises(ValueError, match="longer than 107 bytes"):
        async with open_worker("model.gguf", 0, None, binary=fake, socket_path="/tmp/" + "x" * 120):
            pytest.fail("unreachable")


# --- real workers --------------------------------------------------------------------------


async def test_worker_that_cannot_load_reports_exit_code_and_log(smollm2_path: Path, tmp_path: Path) -> None:
    with pytest.raises(WorkerStartError) as caught:
        async with open_worker(smollm2_path, 0, 99, threads=1, ready_timeout_s=60):
            pytest.fail("a worker for blocks [0, 99) of a 30-block model must not start")
    assert caught.value.exit_code not in (None, 0)
    assert "99" in caught.value.log_tail, str(caught.value)

    with pytest.raises(WorkerStartError) as caught:
        async with open_worker(tmp_path / "missing.gguf", 0, None, threads=1, ready_timeout_s=60):
            pytest.fail("a worker without a model file must not start")
    assert caught.value.exit_code not in (None, 0)
    assert "missing.gguf" in caught.value.log_tail, str(caught.value)


@pytest.mark.slow
async def test_smollm2_info_accounts_exactly_the_owned_tensors_and_kv(smollm2_path: Path) -> None:
    sizes = gguf_tensor_bytes(smollm2_path)
    model_sha256 = await trio.to_thread.run_sync(sha256_file, smollm2_path)
    layers = [(0, 10), (10, 20), (20, 30), (0, 30)]
    async with open_workers(smollm2_path, layers, threads=1, ctx_size=128, max_sequences=2, batch_size=64) as handles:
        infos = [await h.client.info() for h in handles]
        healths = [await h.client.health() for h in handles]
        first = handles[0].client
        ids = await first.tokenize("Hello world", add_special=False)
        text = await first.detokenize(ids)
        no_tokens = await first.tokenize("", add_special=False)
        im_end = await first.tokenize("<|im_end|>", add_special=False, parse_special=True)
        model_paths = [h.info.model_path for h in handles]

    for (begin, end), info, health in zip(layers, infos, healths):
        where = f"[{begin}, {end})"
        assert info.schema_version == 1
        assert info.architecture == "llama"
        assert (info.n_layer, info.n_embd, info.n_vocab) == (30, 576, 49152)
        assert (info.layer_begin, info.layer_end) == (begin, end)
        assert info.takes_tokens == (begin == 0) and info.gives_logits == (end == 30)
        assert (info.boundary.version, info.boundary.name) == (1, "residual")
        assert info.boundary.n_embd == 576 and info.boundary.dtype == worker_pb2.DTYPE_F32
        assert info.model_sha256 == model_sha256
        assert re.fullmatch(r"[0-9a-f]{64}", info.recipe_hash)
        assert info.backend == "CPU"
        assert (info.n_ctx_per_sequence, info.n_seq_max, info.n_batch_max) == (128, 2, 64), where
        assert info.n_threads == 1
        assert info.weight_bytes == expected_weight_bytes(sizes, begin, end, 30), where
        assert info.weight_buffer_bytes > 0, where
        assert info.kv_bytes > 0, where
        assert health.ready and health.forward_calls == 0 and health.active_sequences == 0
        # SmolLM2-Instruct ends a turn with <|im_end|>: every range can tell a client so
        assert len(im_end) == 1 and im_end[0] in info.eog_token_ids, where

    # Same recipe on every worker of one model and build.
    assert len({i.recipe_hash for i in infos}) == 1
    # KV only for the owned layers: a uniform model's cache scales with the number of layers.
    full = infos[3]
    for info in infos[:3]:
        assert info.kv_bytes * full.n_layer == full.kv_bytes * (info.layer_end - info.layer_begin)
    # The split holds the whole model once, the embedding twice (input of the first range and
    # tied head of the last).
    token_embd = sizes["token_embd.weight"]
    assert sum(i.weight_bytes for i in infos[:3]) == full.weight_bytes + token_embd
    assert ids and text == b"Hello world" and no_tokens == []
    assert all(Path(p) == Path(smollm2_path) for p in model_paths)


@pytest.mark.slow
async def test_gemma3_middle_and_last_range_info(gemma3_path: Path) -> None:
    sizes = gguf_tensor_bytes(gemma3_path)
    assert "output.weight" not in sizes  # tied embeddings
    layers = [(4, 11), (11, 18)]
    async with open_workers(gemma3_path, layers, threads=1, ctx_size=64, max_sequences=1, batch_size=32) as handles:
        infos = [h.info for h in handles]
    for (begin, end), info in zip(layers, infos):
        assert info.architecture == "gemma3"
        assert info.n_layer == 18
        assert (info.layer_begin, info.layer_end) == (begin, end)
        assert not info.takes_tokens
        assert info.gives_logits == (end == 18)
        assert info.weight_bytes == expected_weight_bytes(sizes, begin, end, 18), (begin, end)
        assert info.kv_bytes > 0
    # The middle range holds no embedding, the last one holds it as its head.
    token_embd = sizes["token_embd.weight"]
    assert infos[1].weight_bytes > token_embd > 0


@pytest.mark.slow
async def test_copy_sequence_continues_like_the_source(qwen2_tiny_path: Path) -> None:
    async with open_worker(qwen2_tiny_path, 0, None, threads=1, ctx_size=64, max_sequences=3) as worker:
        client = worker.client
        prompt = [5, 6, 7, 8, 9]
        await client.forward([SeqInput(0, list(range(5)), token_ids=prompt)])
        assert await client.copy_sequence(0, 1) == 5
        await expect_error(client.copy_sequence(0, 1), "INVALID_ARGUMENT", "dst_seq_id 1 already holds 5 positions")
        await expect_error(client.copy_sequence(2, 0), "INVALID_ARGUMENT", "unknown sequence 2")
        out = await client.forward([SeqInput(0, [5], token_ids=[10]), SeqInput(1, [5], token_ids=[10])])
        assert [o.next_position for o in out] == [6, 6]
        assert max_abs_diff(out[0].logits, out[1].logits) <= TOLERANCE
        assert (await client.health()).active_sequences == 2


@pytest.mark.slow
async def test_bad_requests_are_refused_and_the_worker_still_computes_right(smollm2_path: Path) -> None:
    """Every bad request gets its status and a message naming the problem, changes nothing,
    and afterwards the same workers still match an unsplit worker."""
    options = dict(threads=1, ctx_size=64, max_sequences=2, batch_size=16)
    async with open_workers(smollm2_path, [(0, 10), (10, 30), (0, 30)], **options) as handles:
        first, rest, unsplit = (h.client for h in handles)
        info_first, info_rest = handles[0].info, handles[1].info
        n_embd, n_vocab = info_rest.n_embd, info_rest.n_vocab
        n_ctx, n_batch = info_first.n_ctx_per_sequence, info_first.n_batch_max
        assert n_batch == 16
        rows = np.random.default_rng(0).standard_normal((2, n_embd)).astype(np.float32)

        # Wrong schema_version, on every kind of call.
        for version in (0, 2):
            message = f"schema_version {version} is not supported"
            await expect_error(
                rest.call("Info", worker_pb2.InfoRequest(schema_version=version)), "INVALID_ARGUMENT", message
            )
            await expect_error(
                rest.call("Health", worker_pb2.HealthRequest(schema_version=version)), "INVALID_ARGUMENT", message
            )
            await expect_error(
                rest.call("Forward", forward_request(boundary_entry(0, [0, 1], rows), schema_version=version)),
                "INVALID_ARGUMENT",
                message,
            )
            await expect_error(
                rest.call("Tokenize", worker_pb2.TokenizeRequest(schema_version=version, text="hi")),
                "INVALID_ARGUMENT",
                message,
            )

        # Wrong row width: n_embd - 1 values per row.
        narrow = rows[:, :-1]
        await expect_error(
            rest.call("Forward", forward_request(boundary_entry(0, [0, 1], narrow))),
            "INVALID_ARGUMENT",
            "entry 0 (seq 0): row width: got",
            f"expected 2 rows x {n_embd} values x 4 bytes",
        )
        # Bytes for 3 rows but 2 positions.
        await expect_error(
            rest.call("Forward", forward_request(boundary_entry(0, [0, 1], np.vstack([rows, rows[:1]])))),
            "INVALID_ARGUMENT",
            "2 positions but 3 boundary rows",
        )

        # Wrong dtype: unspecified, and a value the enum does not have.
        for dtype in (worker_pb2.DTYPE_UNSPECIFIED, 7):
            await expect_error(
                rest.call("Forward", forward_request(boundary_entry(0, [0, 1], rows, dtype=dtype))),
                "INVALID_ARGUMENT",
                f"boundary_dtype {dtype} is not supported",
            )

        # NaN and Inf rows, in the second entry of a batch whose first entry is fine.
        for bad in (np.nan, np.inf):
            poisoned = rows.copy()
            poisoned[1, 5] = bad
            await expect_error(
                rest.call(
                    "Forward", forward_request(boundary_entry(0, [0, 1], rows), boundary_entry(1, [0, 1], poisoned))
                ),
                "INVALID_ARGUMENT",
                "entry 1 (seq 1): boundary value at row 1, column 5 is not finite",
            )

        # Positions that do not continue the (empty) sequence.
        await expect_error(
            first.forward([SeqInput(0, [1, 2], token_ids=[1, 2])]),
            "INVALID_ARGUMENT",
            "positions for seq 0 must start at 0 and increase by 1",
        )
        await expect_error(
            first.forward([SeqInput(0, [0, 2], token_ids=[1, 2])]),
            "INVALID_ARGUMENT",
            "(row 1 is wrong)",
        )

        # Unknown sequences: never used, or beyond the worker's sequence ids.
        await expect_error(first.remove_sequence(1), "INVALID_ARGUMENT", "unknown sequence 1")
        await expect_error(first.trim_sequence(1, 0), "INVALID_ARGUMENT", "unknown sequence 1")
        await expect_error(first.remove_sequence(9), "INVALID_ARGUMENT", "seq_id 9 is out of range", "sequences 0..1")
        await expect_error(
            first.forward([SeqInput(5, [0], token_ids=[1])]), "INVALID_ARGUMENT", "seq_id 5 is out of range"
        )
        await expect_error(
            first.forward([SeqInput(0, [0], token_ids=[1]), SeqInput(0, [1], token_ids=[2])]),
            "INVALID_ARGUMENT",
            "seq_id 0 appears more than once",
        )
        await expect_error(first.call("Forward", forward_request()), "INVALID_ARGUMENT", "empty request")

        # Batch over the limit: n_batch + 1 rows, in one entry and spread over two.
        too_many = list(range(n_batch + 1))
        await expect_error(
            first.forward([SeqInput(0, too_many, token_ids=[1] * len(too_many))]),
            "RESOURCE_EXHAUSTED",
            f"batch of {n_batch + 1} rows exceeds the limit of {n_batch}",
        )
        await expect_error(
            first.forward(
                [SeqInput(0, list(range(9)), token_ids=[1] * 9), SeqInput(1, list(range(8)), token_ids=[1] * 8)]
            ),
            "RESOURCE_EXHAUSTED",
            f"batch of 17 rows exceeds the limit of {n_batch}",
        )

        # Token ids to a range that takes boundary rows, boundary rows to the first range.
        await expect_error(
            rest.forward([SeqInput(0, [0], token_ids=[1])]),
            "INVALID_ARGUMENT",
            "range [10,30) takes boundary rows, not token ids",
        )
        await expect_error(
            first.call("Forward", forward_request(boundary_entry(0, [0, 1], rows))),
            "INVALID_ARGUMENT",
            "range [0,10) takes token ids, not boundary rows",
        )

        # logit_rows out of range (and repeated) on the last range.
        await expect_error(
            rest.forward([SeqInput(0, [0, 1], boundary=rows, logit_rows=[2])]),
            "INVALID_ARGUMENT",
            "logit_rows names row 2 but the entry has 2 rows",
        )
        await expect_error(
            rest.forward([SeqInput(0, [0, 1], boundary=rows, logit_rows=[1, 1])]),
            "INVALID_ARGUMENT",
            "logit_rows names row 1 twice",
        )

        # Token ids outside the vocabulary.
        for token in (n_vocab, -1):
            await expect_error(
                first.forward([SeqInput(0, [0], token_ids=[token])]),
                "INVALID_ARGUMENT",
                f"token id {token} at row 0 is outside [0, {n_vocab})",
            )
        await expect_error(first.detokenize([n_vocab]), "INVALID_ARGUMENT", f"token id {n_vocab}")

        # None of the refused requests left anything behind.
        for client in (first, rest):
            health = await client.health()
            assert health.active_sequences == 0 and health.forward_calls == 0

        # Context full: fill seq 1 to n_ctx positions in batches, then one more row.
        held = 0
        while held < n_ctx:
            n = min(n_batch, n_ctx - held)
            (out,) = await first.forward([SeqInput(1, list(range(held, held + n)), token_ids=[1] * n)])
            held = out.next_position
        assert held == n_ctx
        await expect_error(
            first.forward([SeqInput(1, [n_ctx - 1], token_ids=[1])]),
            "INVALID_ARGUMENT",
            f"positions for seq 1 must start at {n_ctx} and increase by 1",
        )
        await expect_error(
            first.forward([SeqInput(1, [n_ctx], token_ids=[1])]),
            "RESOURCE_EXHAUSTED",
            f"context full for seq 1: it holds {n_ctx} positions, 1 more exceed n_ctx_per_sequence {n_ctx}",
        )
        await expect_error(
            first.trim_sequence(1, n_ctx + 1), "INVALID_ARGUMENT", f"keep_positions {n_ctx + 1} for seq 1 must be in"
        )
        assert await first.trim_sequence(1, 3) == 3
        assert await first.remove_sequence(1) == 0
        assert (await first.health()).active_sequences == 0

        # The same workers still compute what the unsplit model computes.
        prompts = await make_prompts(unsplit, 1, 12)
        report = await compare_workers(unsplit, [first, rest], prompts, steps=6)
    assert report.tokens_equal, report.to_json()
    assert report.max_abs_diff <= TOLERANCE, report.to_json()
    assert len(report.step_max_abs_diff) == 7


@pytest.mark.slow
async def test_worker_top_k_equals_select_top_k_of_its_full_row(smollm2_path: Path) -> None:
    """SequenceInput.top_k: the worker's ids and logits are ``select_top_k`` of the very row it
    would have sent, bit for bit; its log-sum-exp is within the declared bound; K is clamped
    to n_vocab; the reply carries no full row."""
    prompt = [1, 504, 3458, 282, 2151, 28, 355, 1690]
    async with open_worker(smollm2_path, 0, None, threads=1, ctx_size=64, max_sequences=2) as worker:
        client, n_vocab = worker.client, worker.info.n_vocab
        positions = list(range(len(prompt)))
        rows = [2, 5, len(prompt) - 1]
        full = await client.forward([SeqInput(0, positions, token_ids=prompt, logit_rows=rows)])
        for k in (1, 40, n_vocab + 5):
            top = await client.forward([SeqInput(1, positions, token_ids=prompt, logit_rows=rows, top_k=k)])
            await client.remove_sequence(1)
            assert top[0].logits is None and top[0].logit_rows == tuple(rows) and top[0].n_rows == len(rows)
            assert len(top[0].top) == len(rows)
            for r, got in enumerate(top[0].top):
                ids, logits, lse = select_top_k(full[0].logits[r], k)
                assert got.k == min(k, n_vocab) and got.n_vocab == n_vocab
                assert np.array_equal(got.ids, ids)
                assert np.array_equal(got.logits.view(np.int32), logits.view(np.int32))  # bit for bit
                assert abs(got.log_sum_exp - lse) <= WORKER_LOG_SUM_EXP_BOUND, (got.log_sum_exp, lse)
        # decode rows too, and top_k = 0 still gives the full row
        step = await client.forward([SeqInput(0, [len(prompt)], token_ids=[int(full[0].logits[-1].argmax())])])
        assert step[0].logits.shape == (1, n_vocab) and step[0].top == ()
