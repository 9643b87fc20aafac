"""The vocab-only worker (``baton-worker --vocab-only``), the relay's local tokenizer.

Real worker processes: a vocab-only worker on a metadata-only sparse GGUF (the original's
first ``data_offset`` bytes, then a hole to the full size: ``agent.io.gguf_sparse``) must
tokenize exactly like a worker holding the real file, give the pieces that rebuild the text
its Detokenize gives, report the same vocabulary facts, and refuse (and survive) every call
that needs tensors.
"""

from __future__ import annotations

import codecs
import os
from pathlib import Path

import pytest
import trio

from agent.core.wire.worker_records import SeqInput, TokenAttr, Vocabulary
from agent.io.gguf_sparse import gguf_metadata_prefix, write_sparse_gguf
from agent.io.worker.client import AsyncWorkerClient
from agent.io.worker.error import WorkerError
from agent.io.worker.process import WorkerStartError, find_worker_binary, open_worker, worker_argv
from agent.models import cached_sha256

pytestmark = [pytest.mark.worker, pytest.mark.timeout(240)]

#: How much more than its metadata a sparse copy may occupy on disk (the last block, the
#: file system's own rounding).
DISK_SLACK_BYTES = 64 * 1024

REFUSAL = "this worker holds only the vocabulary (--vocab-only)"

TEXTS = [
    "Hello, world! The quick brown fox jumps over 13 lazy dogs.",
    "🙂👍🏽",
    "你好，世界",
    "mixed: naïve café 🙂 你好 end",
]

#: A chat turn written with the model's own special tokens (parsed only with parse_special).
SPECIAL_TEXT = {
    "smollm2": "<|im_start|>user\nHi there<|im_end|>\n",
    "gemma3": "<start_of_turn>user\nHi there<end_of_turn>\n",
}


async def metadata_only_copy(model: Path, dest: Path) -> Path:
    """A sparse copy of ``model`` holding only its metadata; checks that it really is sparse."""
    metadata = await trio.to_thread.run_sync(gguf_metadata_prefix, model)
    size = model.stat().st_size
    path = await trio.to_thread.run_sync(write_sparse_gguf, metadata, size, dest)
    st = path.stat()
    assert st.st_size == size
    assert st.st_blocks * 512 < len(metadata) + DISK_SLACK_BYTES, (st.st_blocks * 512, len(metadata))
    with open(path, "rb") as f:
        assert f.read(len(metadata)) == metadata
    return path


async def expect_refused(call, method: str) -> None:
    with pytest.raises(WorkerError) as caught:
        await call
    assert caught.value.code_name == "FAILED_PRECONDITION", str(caught.value)
    assert caught.value.message == REFUSAL
    assert caught.value.method == method


# --- no worker process needed --------------------------------------------------------------


def test_worker_argv_for_a_vocab_only_worker() -> None:
    argv = worker_argv("bin", "m.gguf", 0, None, "/tmp/w.sock", model_sha256="ab" * 32, vocab_only=True)
    assert argv == ["bin", "--model", "m.gguf", "--vocab-only", "--socket", "/tmp/w.sock", "--model-sha256", "ab" * 32]
    assert worker_argv("bin", "m.gguf", 0, None, "s")[3:5] == ["--layers", "0:"]
    with pytest.raises(ValueError, match="a vocab-only worker holds no layers"):
        worker_argv("bin", "m.gguf", 0, 10, "s", vocab_only=True)


def test_vocabulary_record_checks_its_lengths() -> None:
    vocab = Vocabulary(1, 2, (b"a", b"\xf0"), (4, 32), None, False, ())
    assert vocab.piece_bytes([1, 0, 0]) == b"\xf0aa"
    with pytest.raises(IndexError, match=r"token id 2 is outside \[0, 2\)"):
        vocab.piece_bytes([2])
    with pytest.raises(ValueError, match="needs as many pieces and attrs"):
        Vocabulary(1, 3, (b"a", b"b"), (4, 4), None, False, ())


async def test_binary_refuses_layers_with_vocab_only() -> None:
    argv = [str(find_worker_binary()), "--vocab-only", "--model", "m.gguf", "--layers", "0:", "--socket", "s"]
    result = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    assert result.returncode == 2
    assert b"--layers cannot be given with --vocab-only" in result.stderr
    no_layers = [str(find_worker_binary()), "--model", "m.gguf", "--socket", "s"]
    result = await trio.run_process(no_layers, capture_stdout=True, capture_stderr=True, check=False)
    assert result.returncode == 2
    assert b"--layers is required (unless --vocab-only)" in result.stderr


# --- real workers --------------------------------------------------------------------------


async def test_vocab_only_load_needs_the_full_file_size(smollm2_path: Path, tmp_path: Path) -> None:
    # llama.cpp checks every tensor's extent against the file size even for a vocab-only load:
    # a copy cut at data_offset is refused, which is why the metadata-only file is sparse.
    metadata = await trio.to_thread.run_sync(gguf_metadata_prefix, smollm2_path)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(metadata)
    with pytest.raises(WorkerStartError) as caught:
        async with open_worker(cut, 0, None, vocab_only=True, ready_timeout_s=60):
            pytest.fail("a vocab-only worker started on a file cut at data_offset")
    assert caught.value.exit_code == 1
    assert "cannot load the vocabulary of" in caught.value.log_tail
    assert "data is not within the file bounds" in caught.value.log_tail


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
async def test_vocab_only_worker_on_a_sparse_file_tokenizes_like_the_model(
    model: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    real: Path = request.getfixturevalue(f"{model}_path")
    sparse = await metadata_only_copy(real, tmp_path / f"{model}-metadata.gguf")
    model_sha256 = await trio.to_thread.run_sync(cached_sha256, real)
    texts = [*TEXTS, SPECIAL_TEXT[model]]

    async with (
        open_worker(real, 0, None, threads=1, ctx_size=64, max_sequences=1, batch_size=32) as normal,
        open_worker(sparse, 0, None, vocab_only=True, model_sha256=model_sha256) as vocab_worker,
    ):
        full: AsyncWorkerClient = normal.client
        client: AsyncWorkerClient = vocab_worker.client
        vocab = await client.vocabulary()
        full_vocab = await full.vocabulary()

        # (a) the same token ids, with and without BOS and parsed special tokens
        tokenized = {}
        for text in texts:
            for add_special in (False, True):
                for parse_special in (False, True):
                    ids = await client.tokenize(text, add_special=add_special, parse_special=parse_special)
                    want = await full.tokenize(text, add_special=add_special, parse_special=parse_special)
                    assert ids == want, (text, add_special, parse_special)
                    assert ids
                    tokenized[text, add_special, parse_special] = ids

        # (b) the pieces rebuild what the real model's Detokenize gives, token by token too
        for text in TEXTS:
            ids = tokenized[text, False, False]
            assert vocab.bos_token_id not in ids
            joined = vocab.piece_bytes(ids)
            assert joined == await full.detokenize(ids), text
            assert joined == await client.detokenize(ids), text
            if model == "smollm2":
                assert joined.decode("utf-8") == text
            decoder = codecs.getincrementaldecoder("utf-8")()
            streamed = "".join(decoder.decode(vocab.pieces[t]) for t in ids) + decoder.decode(b"", final=True)
            assert streamed == joined.decode("utf-8")
            # a run that ends inside a character comes back as its bytes, not as an error
            for cut in range(1, len(ids)):
                head = vocab.piece_bytes(ids[:cut])
                assert await client.detokenize(ids[:cut]) == head == await full.detokenize(ids[:cut]), (text, cut)
        partial = [
            cut
            for text in TEXTS
            for cut in range(1, len(tokenized[text, False, False]))
            if not _is_utf8(vocab.piece_bytes(tokenized[text, False, False][:cut]))
        ]
        # (SmolLM2's byte-level pieces split emoji; Gemma's vocabulary holds these characters whole)
        assert partial or model != "smollm2", "some run of the emoji and CJK texts ends inside a character"

        # (c) the vocabulary facts of the real model
        info = vocab_worker.info
        assert info.vocab_only and not normal.info.vocab_only
        assert info.architecture == normal.info.architecture
        assert info.n_vocab == normal.info.n_vocab == vocab.n_vocab == len(vocab.pieces)
        assert info.eog_token_ids == normal.info.eog_token_ids == vocab.eog_token_ids
        assert info.eog_token_ids
        assert info.model_sha256 == model_sha256
        assert (info.n_layer, info.weight_bytes, info.kv_bytes, info.n_seq_max, info.recipe_hash) == (0, 0, 0, 0, "")
        assert Path(info.model_path) == sparse
        assert vocab == full_vocab
        if vocab.add_bos:
            assert tokenized[TEXTS[0], True, False][0] == vocab.bos_token_id
        for t in info.eog_token_ids:
            if vocab.attrs[t] & TokenAttr.CONTROL:
                assert vocab.pieces[t] == b"", t  # never streamed as text

        # (d) everything that needs tensors is refused, and the worker keeps answering
        prompt = tokenized[TEXTS[0], True, False]
        await expect_refused(client.forward([SeqInput(0, list(range(len(prompt))), token_ids=prompt)]), "Forward")
        await expect_refused(client.remove_sequence(0), "RemoveSequence")
        await expect_refused(client.trim_sequence(0, 0), "TrimSequence")
        await expect_refused(client.copy_sequence(0, 1), "CopySequence")
        health = await client.health()
        assert health.ready and health.forward_calls == 0 and health.active_sequences == 0
        assert await client.tokenize(TEXTS[0]) == tokenized[TEXTS[0], True, False]
        assert vocab_worker.process.returncode is None
        assert (await client.info()) == info
    assert os.path.exists(sparse)  # the worker neither removed nor replaced it


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
