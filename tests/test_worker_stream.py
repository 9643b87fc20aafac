"""The worker's Forward stream (``--forward-socket``; protocol/worker.proto, ForwardStreamReply)
against the real binary: the same numbers and the same refusals as the gRPC Forward, and bad
frames (garbage, over the limit, truncated) answered or dropped without disturbing anyone else.
"""

from __future__ import annotations

import os
import signal
import stat

import numpy as np
import pytest
import trio

from agent._proto import worker_pb2
from agent.core.wire import boundary
from agent.core.wire.boundary import BoundaryError
from agent.core.wire.worker_records import SeqInput
from agent.io.worker.error import WorkerError
from agent.io.worker.messages import forward_request
from agent.io.worker.process import open_worker

pytestmark = [pytest.mark.worker, pytest.mark.timeout(120)]

PROMPT = [1, 17, 42, 99, 7, 3]


def prompt_request(seq_id: int, tokens: list[int]) -> worker_pb2.ForwardRequest:
    entry = worker_pb2.SequenceInput(
        seq_id=seq_id, positions=list(range(len(tokens))), token_ids=tokens, logit_rows=[len(tokens) - 1]
    )
    return worker_pb2.ForwardRequest(schema_version=1, entries=[entry])


async def read_frame(stream: trio.SocketStream) -> bytes | None:
    """One length-prefixed frame, prefix included (None: the peer closed first); no more."""
    data = b""
    while len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "little"):
        if not (more := await stream.receive_some(65536)):
            return None
        data += more
    assert len(data) == 4 + int.from_bytes(data[:4], "little"), "one frame at a time"
    return data


async def raw_exchange(stream: trio.SocketStream, frame: bytes) -> worker_pb2.ForwardStreamReply | None:
    """Send ``frame`` as it is; the reply frame, or None when the worker closed the connection."""
    await stream.send_all(frame)
    data = await read_frame(stream)
    return None if data is None else worker_pb2.ForwardStreamReply.FromString(data[4:])


def framed(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "little") + payload


async def test_forward_stream_equals_grpc_and_survives_bad_frames(qwen2_tiny_path) -> None:
    async with open_worker(qwen2_tiny_path, 0, None, threads=1, ctx_size=64, max_sequences=3) as worker:
        client = worker.client
        path = os.path.join(os.path.dirname(worker.socket_path), "forward.sock")
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, "the stream socket is owner-only"

        # The same Forward both ways: the same logits, bit for bit.
        over_stream = await client.forward([SeqInput(seq_id=0, positions=list(range(len(PROMPT))), token_ids=PROMPT)])
        over_grpc = await client.call("Forward", prompt_request(1, PROMPT))
        grpc_logits = np.frombuffer(over_grpc.entries[0].logits, dtype="<f4")
        assert over_stream[0].logits is not None
        assert np.array_equal(over_stream[0].logits[-1], grpc_logits)
        # Both ways the worker says how long it computed; the client's call took at least that.
        timing = client.last_forward
        assert timing is not None and 0 < timing.compute_us <= timing.call_us, timing
        assert over_grpc.compute_us > 0

        # A refusal comes back with the gRPC status name and the worker's message.
        with pytest.raises(WorkerError) as caught:
            await client.forward([SeqInput(seq_id=9, positions=[0], token_ids=[5])])
        assert caught.value.code_name == "INVALID_ARGUMENT" and "seq_id 9" in caught.value.message, caught.value
        assert client.last_forward is timing, "a refused Forward leaves the last one's time"

        async with await trio.open_unix_socket(path) as raw:
            # Garbage in a well-formed frame: INVALID_ARGUMENT, and the connection goes on.
            reply = await raw_exchange(raw, framed(b"\xff\xff\xff\xff\xff\xff"))
            assert reply is not None and reply.code == 3 and "not a ForwardRequest" in reply.message
            reply = await raw_exchange(raw, framed(prompt_request(2, PROMPT).SerializeToString()))
            assert reply is not None and reply.code == 0
            assert np.array_equal(np.frombuffer(reply.reply.entries[0].logits, dtype="<f4"), grpc_logits)
            # A frame over the limit: RESOURCE_EXHAUSTED, then the worker closes this connection.
            reply = await raw_exchange(raw, (0xFFFFFFF0).to_bytes(4, "little"))
            assert reply is not None and reply.code == 8 and "over the limit" in reply.message, reply
            assert await raw.receive_some(16) == b""
        # A truncated frame: the peer goes away inside it.
        async with await trio.open_unix_socket(path) as raw:
            await raw.send_all((1000).to_bytes(4, "little") + b"\x08\x01")

        # The client's own connection was never disturbed, and sequence 0 continues exactly as
        # over gRPC (sequence 1 took the same prompt there).
        step = [SeqInput(seq_id=0, positions=[len(PROMPT)], token_ids=[11])]
        after_stream = await client.forward(step)
        after_grpc = await client.call(
            "Forward",
            worker_pb2.ForwardRequest(
                schema_version=1,
                entries=[worker_pb2.SequenceInput(seq_id=1, positions=[len(PROMPT)], token_ids=[11])],
            ),
        )
        assert np.array_equal(after_stream[0].logits[-1], np.frombuffer(after_grpc.entries[0].logits, dtype="<f4"))

        # A deadline that passes: DEADLINE_EXCEEDED; a cancelled call: Cancelled. Either way the
        # client drops that connection (a late reply must not answer the next call), and the
        # next call connects again and computes right (on sequence 1: what became of sequence
        # 2 is unknown after an abandoned call).
        await client.remove_sequence(2)
        with pytest.raises(WorkerError) as caught:
            await client.forward([SeqInput(seq_id=2, positions=list(range(40)), token_ids=[5] * 40)], timeout_s=1e-6)
        assert caught.value.code_name == "DEADLINE_EXCEEDED", caught.value
        with trio.move_on_after(1e-6) as scope:
            await client.forward([SeqInput(seq_id=2, positions=list(range(40)), token_ids=[5] * 40)])
        assert scope.cancelled_caught
        await client.remove_sequence(1)
        again = await client.forward([SeqInput(seq_id=1, positions=list(range(len(PROMPT))), token_ids=PROMPT)])
        assert np.array_equal(again[0].logits[-1], grpc_logits)

        # The worker gone: UNAVAILABLE at once, not a hang.
        worker.process.send_signal(signal.SIGKILL)
        await worker.process.wait()
        with trio.fail_after(10), pytest.raises(WorkerError) as caught:
            await client.forward(step)
        assert caught.value.code_name == "UNAVAILABLE", caught.value


async def test_a_cancelled_forward_never_answers_the_next_call(smollm2_path) -> None:
    """The abandoned call is surely on the wire (cancelled 50 ms into a ~1 s prefill), so its
    reply would come first on a reused connection; the next call must get its own."""
    async with open_worker(smollm2_path, 0, None, threads=1, ctx_size=512, max_sequences=2) as worker:
        client = worker.client
        expected = await client.forward([SeqInput(seq_id=1, positions=list(range(len(PROMPT))), token_ids=PROMPT)])
        await client.remove_sequence(1)
        long_prompt = [(7 * i) % 1000 + 5 for i in range(400)]
        with trio.move_on_after(0.05) as scope:
            await client.forward([SeqInput(seq_id=0, positions=list(range(400)), token_ids=long_prompt)])
        assert scope.cancelled_caught, "the prefill finished within 50 ms: make it longer"
        again = await client.forward([SeqInput(seq_id=1, positions=list(range(len(PROMPT))), token_ids=PROMPT)])
        assert again[0].n_rows == 1 and again[0].seq_id == 1
        assert np.array_equal(again[0].logits[-1], expected[0].logits[-1])


async def test_replies_bigger_than_the_stream_buffer_come_whole_and_the_next_ones_too(smollm2_path) -> None:
    """A prompt's logits for every row (100 rows x 49,152 values: 19.7 MB) is more than the
    client's reply buffer holds (1 MiB, grown for it, then let go past 16 MiB): it must come
    whole and equal to the gRPC reply, and the small replies after it must be right too."""
    rows = 100
    tokens = [(11 * i) % 1000 + 5 for i in range(rows)]
    async with open_worker(smollm2_path, 0, None, threads=1, ctx_size=256, max_sequences=2) as worker:
        client = worker.client
        entry = SeqInput(seq_id=0, positions=list(range(rows)), token_ids=tokens, logit_rows=list(range(rows)))
        over_stream = await client.forward([entry])
        request = prompt_request(1, tokens)
        request.entries[0].logit_rows[:] = list(range(rows))
        over_grpc = await client.call("Forward", request)
        n_vocab = len(over_grpc.entries[0].logits) // 4 // rows
        assert over_stream[0].logits is not None and over_stream[0].logits.shape == (rows, n_vocab)
        assert over_stream[0].logits.nbytes > 16 << 20, "the reply must outgrow the buffer that is kept"
        want_rows = np.frombuffer(over_grpc.entries[0].logits, dtype="<f4").reshape(rows, n_vocab)
        assert np.array_equal(over_stream[0].logits, want_rows)
        for step in range(3):  # decode steps after it, on the buffer it was let go for
            got = await client.forward([SeqInput(seq_id=0, positions=[rows + step], token_ids=[42 + step])])
            want = await client.call(
                "Forward",
                worker_pb2.ForwardRequest(
                    schema_version=1,
                    entries=[worker_pb2.SequenceInput(seq_id=1, positions=[rows + step], token_ids=[42 + step])],
                ),
            )
            assert np.array_equal(got[0].logits[-1], np.frombuffer(want.entries[0].logits, dtype="<f4"))


async def test_a_connection_found_closed_is_replaced_once_then_the_call_fails(tmp_path) -> None:
    """The client's open connection closed by the worker before any reply byte: the request
    goes again on one fresh connection (and is answered there); a fresh one that closes too
    is UNAVAILABLE, not a third try. A bare peer speaking the stream's framing stands in for
    the worker here: the real one closes a connection only on a frame it refuses."""
    from agent.io.worker.stream import _ForwardStream

    path = str(tmp_path / "forward.sock")
    ok = worker_pb2.ForwardStreamReply(schema_version=1, reply=worker_pb2.ForwardReply(schema_version=1))
    # what each accepted connection does: answer this many requests, then close unanswered
    plan = [1, 1, 0]
    connections: list[int] = []

    async def serve(stream: trio.SocketStream) -> None:
        answers = plan[len(connections)]
        connections.append(answers)
        async with stream:
            for _ in range(answers):
                if await read_frame(stream) is None:
                    return
                await stream.send_all(framed(ok.SerializeToString()))
            await read_frame(stream)  # the next request: closed unanswered

    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await sock.bind(path)
    sock.listen(8)
    listener = trio.SocketListener(sock)
    client = _ForwardStream(path, 1 << 20)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, serve, [listener])
        request = prompt_request(0, PROMPT)
        with trio.fail_after(10):
            assert (await client.exchange(request, 5.0)).schema_version == 1  # connection 1
            assert (await client.exchange(request, 5.0)).schema_version == 1  # 1 closed: again on 2
            assert connections == [1, 1]
            with pytest.raises(WorkerError) as caught:
                await client.exchange(request, 5.0)  # 2 closed: again on 3, which closes too
        assert caught.value.code_name == "UNAVAILABLE" and connections == [1, 1, 0], (caught.value, connections)
        await client.close()
        nursery.cancel_scope.cancel()


async def test_boundary_rows_pass_between_workers_as_the_bytes_the_worker_sent(qwen2_tiny_path, monkeypatch) -> None:
    """A range's F32 output rows come with the reply's bytes (``SeqOutput.boundary_bytes``),
    and the next range's Forward sends such bytes as they are (``SeqInput.boundary_bytes``):
    the same logits as rows encoded afresh. Bytes that are not the entry's rows are not
    used: the rows are encoded (and checked) instead."""
    async with (
        open_worker(qwen2_tiny_path, 0, 1, threads=1, ctx_size=64, max_sequences=2) as first,
        open_worker(qwen2_tiny_path, 1, None, threads=1, ctx_size=64, max_sequences=2) as rest,
    ):
        (out,) = await first.client.forward([SeqInput(0, list(range(len(PROMPT))), token_ids=PROMPT)])
        assert out.boundary_bytes is not None and out.boundary_bytes == out.boundary.tobytes()
        info = await rest.client.info()
        positions = list(range(len(PROMPT)))
        passed = SeqInput(0, positions, boundary=out.boundary, boundary_bytes=out.boundary_bytes)
        with monkeypatch.context() as patched:
            checked = []
            patched.setattr(boundary, "_first_non_finite", lambda rows: checked.append(rows))
            assert forward_request([passed], info).entries[0].boundary == out.boundary_bytes
            assert not checked, "bytes that match the rows are sent as they are, not checked and encoded again"
        (via_bytes,) = await rest.client.forward([passed])
        (encoded,) = await rest.client.forward([SeqInput(1, positions, boundary=out.boundary)])
        np.testing.assert_array_equal(via_bytes.logits, encoded.logits)
        # bytes of another shape than the rows: the rows are encoded instead
        wrong = SeqInput(0, positions, boundary=out.boundary, boundary_bytes=out.boundary_bytes[:-4])
        assert forward_request([wrong], info).entries[0].boundary == out.boundary.tobytes()
        poisoned = out.boundary.copy()
        poisoned[0, 0] = np.inf
        with pytest.raises(BoundaryError, match="non-finite"):
            forward_request([SeqInput(0, positions, boundary=poisoned, boundary_bytes=b"\0" * 3)], info)
