"""The worker's greedy run-ahead on its Forward stream (protocol/worker.proto,
``SequenceInput.run_ahead_steps``) against the real binary: the steps the worker makes by itself
are the Forwards a caller stepping one at a time would send, bit for bit; every way a run ends
(its budget, a stop token, the context, the caller) leaves the stream in step for the next call;
what cannot be run ahead is refused with a reason.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import trio

from agent._proto import worker_pb2
from agent.core.wire.worker_records import SeqInput, SeqOutput
from agent.demo.local_demo import generate_through
from agent.io.worker.client import AsyncWorkerClient
from agent.io.worker.error import WorkerError
from agent.io.worker.messages import forward_request
from agent.io.worker.process import open_worker

pytestmark = [pytest.mark.worker, pytest.mark.timeout(120)]

PROMPT = [1, 17, 42, 99, 7, 3]
TOP_K = 8
N_OUT = 12  # outputs: the prompt's and 11 decode steps


def prompt_entry(seq_id: int, top_k: int = TOP_K) -> SeqInput:
    return SeqInput(seq_id=seq_id, positions=list(range(len(PROMPT))), token_ids=PROMPT, top_k=top_k)


async def stepped(client: AsyncWorkerClient, seq_id: int, n: int) -> list[SeqOutput]:
    """``n`` outputs, one Forward each, the caller choosing each greedy token."""
    outs = [(await client.forward([prompt_entry(seq_id)]))[0]]
    while len(outs) < n:
        last = outs[-1]
        entry = SeqInput(
            seq_id=seq_id, positions=[last.next_position], token_ids=[int(last.top[-1].ids[0])], top_k=TOP_K
        )
        outs.append((await client.forward([entry]))[0])
    return outs


def same_bits(a: SeqOutput, b: SeqOutput) -> bool:
    (ra,), (rb,) = a.top, b.top
    return (
        a.next_position == b.next_position
        and np.array_equal(ra.ids, rb.ids)
        and np.array_equal(np.asarray(ra.logits).view("<u4"), np.asarray(rb.logits).view("<u4"))
        and ra.log_sum_exp == rb.log_sum_exp
    )


class Collect:
    """``on_output`` that keeps every output and says stop after ``keep`` of them."""

    def __init__(self, keep: int | None = None) -> None:
        self.outs: list[SeqOutput] = []
        self.keep = keep

    async def __call__(self, out: SeqOutput) -> bool:
        self.outs.append(out)
        return self.keep is None or len(self.outs) < self.keep


async def test_run_ahead_steps_equal_the_callers_own_forwards_bit_for_bit(smollm2_path) -> None:
    async with open_worker(smollm2_path, 0, None, threads=1, ctx_size=128, max_sequences=3) as worker:
        client = worker.client
        reference = await stepped(client, 0, N_OUT)
        calls_before = (await client.health()).forward_calls

        run = Collect()
        position = await client.forward_run_ahead(prompt_entry(1), N_OUT - 1, (), run)
        assert len(run.outs) == N_OUT, "the budget: the prompt's output and run_ahead_steps more"
        assert all(same_bits(a, b) for a, b in zip(run.outs, reference, strict=True))
        assert position == len(PROMPT) + N_OUT - 1
        assert (await client.health()).forward_calls - calls_before == N_OUT, "one Forward per output, no more"

        # Without a Forward stream the client makes the steps itself: the same outputs.
        async with AsyncWorkerClient(worker.socket_path) as grpc_only:
            stepped_run = Collect()
            await grpc_only.forward_run_ahead(prompt_entry(2), N_OUT - 1, (), stepped_run)
        assert all(same_bits(a, b) for a, b in zip(stepped_run.outs, reference, strict=True))

        # generate_through with run_ahead: the same greedy tokens as one Forward a step.
        for seq in (0, 1, 2):
            await client.remove_sequence(seq)
        one_by_one = await generate_through([client], PROMPT, N_OUT, top_k=TOP_K)
        ahead = await generate_through([client], PROMPT, N_OUT, top_k=TOP_K, run_ahead=True)
        assert ahead.tokens == one_by_one.tokens == [int(o.top[-1].ids[0]) for o in reference]
        assert ahead.decode_steps == N_OUT - 1 and ahead.decode_s > 0


async def test_every_way_a_run_ends_leaves_the_stream_in_step(smollm2_path) -> None:
    async with open_worker(smollm2_path, 0, None, threads=1, ctx_size=128, max_sequences=3) as worker:
        client = worker.client
        reference = await stepped(client, 0, N_OUT)
        tokens = [int(o.top[-1].ids[0]) for o in reference]
        # a stop token: the first whose first appearance is the fifth output or later
        at = next(i for i, t in enumerate(tokens) if i >= 4 and t not in tokens[:i])

        # A stop token: its output is the run's last, and nothing past it was decoded.
        run = Collect()
        position = await client.forward_run_ahead(prompt_entry(1), 100, (tokens[at], 99999), run)
        assert [int(o.top[-1].ids[0]) for o in run.outs] == tokens[: at + 1]
        assert position == len(PROMPT) + at

        # The caller stops after 3 while the worker runs on: the run's later frames are dropped,
        # the sequence holds whatever the worker reached, and the stream answers the next call.
        await client.remove_sequence(1)
        run = Collect(keep=3)
        position = await client.forward_run_ahead(prompt_entry(1), N_OUT - 1, (), run)
        assert len(run.outs) == 3 and all(same_bits(a, b) for a, b in zip(run.outs, reference, strict=False))
        assert len(PROMPT) + 2 <= position <= len(PROMPT) + N_OUT - 1, position
        await client.trim_sequence(1, len(PROMPT) + 2)
        (fourth,) = await client.forward(
            [SeqInput(seq_id=1, positions=[len(PROMPT) + 2], token_ids=[tokens[2]], top_k=TOP_K)]
        )
        assert same_bits(fourth, reference[3]), "after the barrier, the next call gets its own reply"

        # Cancelled mid-run: the connection is closed (its state unknown) and the next call
        # opens another; the worker's run ends on the closed socket.
        await client.remove_sequence(1)
        with trio.CancelScope() as scope:

            async def cancel_at_two(out: SeqOutput) -> bool:
                if out.next_position == len(PROMPT) + 1:
                    scope.cancel()
                await trio.lowlevel.checkpoint()
                return True

            await client.forward_run_ahead(prompt_entry(1), 1000, (), cancel_at_two)
        assert scope.cancelled_caught
        await client.remove_sequence(1)
        again = await stepped(client, 1, 3)
        assert all(same_bits(a, b) for a, b in zip(again, reference, strict=False))


async def test_a_run_ends_at_the_context(qwen2_tiny_path) -> None:
    async with open_worker(qwen2_tiny_path, 0, None, threads=1, ctx_size=64, max_sequences=1) as worker:
        client = worker.client
        n_ctx = (await client.info()).n_ctx_per_sequence
        run = Collect()
        position = await client.forward_run_ahead(prompt_entry(0), 10_000, (), run)
        assert position == n_ctx and run.outs[-1].next_position == n_ctx
        assert len(run.outs) == n_ctx - len(PROMPT) + 1, "every position of the context filled, none refused"
        await client.remove_sequence(0)
        (fresh,) = await client.forward([prompt_entry(0)])
        assert same_bits(fresh, run.outs[0]), "the stream answers the next call"


async def test_what_cannot_run_ahead_is_refused_with_a_reason(qwen2_tiny_path) -> None:
    async with open_worker(qwen2_tiny_path, 0, None, threads=1, ctx_size=64, max_sequences=2) as whole:
        client = whole.client
        info = await client.info()
        request = forward_request([prompt_entry(0)], info)
        request.entries[0].run_ahead_steps = 3
        with pytest.raises(WorkerError) as caught:
            await client.call("Forward", request)
        assert caught.value.code_name == "INVALID_ARGUMENT" and "Forward stream only" in caught.value.message

        # Over the stream itself (raw frames: the client sends only one entry): the reasons.
        refusals = {
            "top_k > 0": [prompt_entry(0, top_k=0)],
            "exactly one entry": [prompt_entry(0), prompt_entry(1)],
            "the last row's logits only": [dataclasses.replace(prompt_entry(0), logit_rows=[0, 5])],
        }
        stream = await trio.open_unix_socket(os.path.join(os.path.dirname(whole.socket_path), "forward.sock"))
        async with stream:
            for reason, entries in refusals.items():
                request = forward_request(entries, info)
                for entry in request.entries:
                    entry.run_ahead_steps = 3
                payload = request.SerializeToString()
                await stream.send_all(len(payload).to_bytes(4, "little") + payload)
                data = b""
                while len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "little"):
                    data += await stream.receive_some(65536)
                frame = worker_pb2.ForwardStreamReply.FromString(data[4:])
                assert frame.code == 3 and reason in frame.message, (reason, frame)  # INVALID_ARGUMENT
                assert not frame.run_ahead and not frame.run_ahead_more
        # nothing was computed, and the stream serves on
        assert (await client.health()).forward_calls == 0
        (out,) = await client.forward([prompt_entry(0)])
        assert out.next_position == len(PROMPT)

    async with open_worker(qwen2_tiny_path, 0, 3, threads=1, ctx_size=64, max_sequences=1) as first_half:
        with pytest.raises(WorkerError) as caught:
            await first_half.client.forward_run_ahead(prompt_entry(0), 3, (), Collect())
        assert caught.value.code_name == "INVALID_ARGUMENT" and "whole model" in caught.value.message
