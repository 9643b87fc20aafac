"""The worker's data plane (``--data-listen``; protocol/worker.proto, DataFrame) against the
real binary: three range workers chained worker to worker give the unsplit worker's numbers,
bit for bit; every frame is sealed (a peer without the key, a changed byte, a replayed frame,
plaintext and garbage are refused, and nobody else's output changes); a step a range refuses
reaches the owner as a sealed error; sessions that arrive together share Forwards and still
get their solo numbers.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import numpy as np
import pytest
import trio

from agent._proto import worker_pb2
from agent.core.owner.parity import next_hop_entries, through_wire
from agent.core.owner.sampling import SamplingParams, draw_token, draw_uniform
from agent.core.wire import data_frames
from agent.core.wire.boundary import WireDType, encode_rows
from agent.core.wire.data_frames import DataFrameError, OwnerSession, SessionKeys
from agent.core.wire.topk import log_sum_exp, select_top_k
from agent.core.wire.worker_records import SeqInput
from agent.io.net.data_link import DataLink, DataLinkClosed, open_data_link
from agent.io.worker.error import WorkerError
from agent.io.worker.process import WorkerHandle, open_worker

T = TypeVar("T")

pytestmark = [pytest.mark.worker, pytest.mark.timeout(180)]

HOST = "127.0.0.1"
PROMPT = [1, 17, 42, 99, 7, 3]
CUTS = ((0, 2), (2, 4), (4, 6))


@contextlib.asynccontextmanager
async def open_chain(model, cuts=CUTS, **worker_args) -> AsyncIterator[list[WorkerHandle]]:
    async with contextlib.AsyncExitStack() as stack:
        workers = [
            await stack.enter_async_context(
                open_worker(model, begin, end, threads=1, ctx_size=64, data_listen=f"{HOST}:0", **worker_args)
            )
            for begin, end in cuts
        ]
        yield workers


async def bind_route(
    workers: list[WorkerHandle],
    seq_id: int,
    keep_rows_max_bytes: int = 0,
    decode_gather_us: int = 0,
    decode_groups: int = 0,
    continue_key: bytes = b"",
    wire_dtype: int = 0,
) -> OwnerSession:
    """Binds a new session on every range (the nodes' job in the swarm), keys from os.urandom;
    ``decode_gather_us``: the first range's lock-step hold; ``decode_groups``: its groups;
    ``continue_key``: the key of the CONTINUE frames the first range takes; ``wire_dtype``: the
    dtype of the rows between ranges."""
    keys = SessionKeys.new(os.urandom)
    step_keys = [keys.first_step_key] + [os.urandom(32) for _ in workers[1:]]
    for i, worker in enumerate(workers):
        request = worker_pb2.BindSessionRequest(
            schema_version=1, session_id=keys.session_id, seq_id=seq_id, step_key=step_keys[i],
            decode_gather_us=decode_gather_us if i == 0 else 0, decode_groups=decode_groups if i == 0 else 0,
            continue_key=continue_key if i == 0 else b"",
        )  # fmt: skip
        if i + 1 < len(workers):
            request.next_host = HOST
            request.next_port = workers[i + 1].info.data_port
            request.next_step_key = step_keys[i + 1]
            request.keep_rows_max_bytes = keep_rows_max_bytes
            request.wire_dtype = wire_dtype  # type: ignore[assignment]
        else:
            request.return_key = keys.return_key
        await worker.client.call("BindSession", request)
    return OwnerSession(keys)


def step(n: int, positions: list[int], tokens: list[int], top_k: int = 0) -> worker_pb2.DataStep:
    return worker_pb2.DataStep(step=n, positions=positions, token_ids=tokens, top_k=top_k)


async def result_of(session: OwnerSession, link: DataLink) -> worker_pb2.DataResult:
    with trio.fail_after(30):
        return session.open_result(await link.receive())


async def unsplit_logits(worker: WorkerHandle, seq_id: int, positions: list[int], tokens: list[int]) -> np.ndarray:
    out = await worker.client.forward([SeqInput(seq_id=seq_id, positions=positions, token_ids=tokens)])
    assert out[0].logits is not None
    return out[0].logits[-1]


async def test_a_chain_of_workers_equals_the_unsplit_worker_and_refuses_what_is_not_sealed(qwen2_tiny_path) -> None:
    async with (
        open_chain(qwen2_tiny_path) as chain,
        open_worker(qwen2_tiny_path, 0, None, threads=1, ctx_size=64) as whole,
    ):
        assert all(w.info.data_port > 0 for w in chain), "Info reports the bound port"
        assert whole.info.data_port == 0, "no data plane unless asked"
        first, last = chain[0].info.data_port, chain[-1].info.data_port
        session = await bind_route(chain, seq_id=0, keep_rows_max_bytes=1 << 20)
        async with open_data_link(HOST, first) as to_first, open_data_link(HOST, last) as from_last:
            await from_last.send(session.attach_frame())
            # the prompt: full logits row, bit for bit the unsplit worker's
            await to_first.send(session.step_frame(step(0, list(range(len(PROMPT))), PROMPT)))
            result = await result_of(session, from_last)
            assert result.error_code == 0, result.error_message
            expected = await unsplit_logits(whole, 0, list(range(len(PROMPT))), PROMPT)
            assert np.array_equal(np.frombuffer(result.logits, dtype="<f4"), expected)
            assert result.next_position == len(PROMPT) and result.n_vocab == expected.size

            # Attacks on the running session, each refused with a NOTICE on that connection:
            # a frame sealed with another key (a peer that does not hold the session's key)
            forged = data_frames.sealed_frame(
                data_frames.STEP, os.urandom(32), session.session_id, 1000, step(1, [6], [5]).SerializeToString()
            )
            async with open_data_link(HOST, first) as intruder:
                await intruder.send(forged)
                notice = await intruder.receive()
                assert notice.kind == data_frames.NOTICE and "does not open" in notice.notice, notice
                # the real step sealed right, then one changed byte in it
                good = bytearray(session.step_frame(step(1, [6], [11], top_k=8)))
                good[-1] ^= 1
                await intruder.send(bytes(good))
                notice = await intruder.receive()
                assert "does not open" in notice.notice, notice
                # a session nobody bound
                await intruder.send(data_frames.sealed_frame(data_frames.STEP, os.urandom(32), os.urandom(16), 1, b""))
                assert "is bound here" in (await intruder.receive()).notice
                # plaintext (a frame whose bytes are not a DataFrame): refused, connection closed
                await intruder.send(struct.pack("<I", 6) + b"\xff" * 6)
                assert "not a DataFrame" in (await intruder.receive()).notice
                with pytest.raises(DataLinkClosed):
                    await intruder.receive()
            # a frame over the limit: refused, connection closed; a truncated one: nothing
            async with open_data_link(HOST, first) as intruder:
                await intruder.send(struct.pack("<I", 0xFFFFFFF0))
                assert "over the limit" in (await intruder.receive()).notice
                with pytest.raises(DataLinkClosed):
                    await intruder.receive()
            async with open_data_link(HOST, first) as intruder:
                await intruder.send(struct.pack("<I", 1000) + b"\x08\x01")

            # The session goes on as if nothing happened: step 1 (top-8 this time). The
            # changed frame used counter 2, which the worker never took, so the owner's next
            # (3) is above the last taken (1).
            replay = session.step_frame(step(1, [6], [11], top_k=8))
            await to_first.send(replay)
            result = await result_of(session, from_last)
            assert result.error_code == 0, result.error_message
            row = await unsplit_logits(whole, 0, [6], [11])
            order = np.lexsort((np.arange(row.size), -row))[:8]
            assert np.array_equal(np.frombuffer(result.top_token_ids, dtype="<i4"), order)
            assert np.array_equal(np.frombuffer(result.top_logits, dtype="<f4"), row[order])
            # a copy of a frame already taken (a replay): refused; the session is unchanged
            async with open_data_link(HOST, first) as intruder:
                await intruder.send(replay)
                notice = await intruder.receive()
                assert "not above the last one taken" in notice.notice, notice

            # A step the first range refuses (positions that skip) reaches the owner sealed.
            await to_first.send(session.step_frame(step(2, [9], [5])))
            result = await result_of(session, from_last)
            assert result.error_code == 3 and "position" in result.error_message, result
            assert result.error_layer_begin == 0
            # a wrong step number: refused where it is first seen (the first range)
            await to_first.send(session.step_frame(step(7, [7], [5])))
            result = await result_of(session, from_last)
            assert result.error_code == 9 and "step 7 arrived where step 3" in result.error_message, result

            # A RESULT from anyone but the last range (sealed with another key) is refused.
            fake = worker_pb2.DataFrame()
            fake.ParseFromString(
                data_frames.sealed_frame(data_frames.RESULT, os.urandom(32), session.session_id, 99, b"")[4:]
            )
            with pytest.raises(DataFrameError, match="does not open"):
                session.open_result(fake)

        # A report leaves it bound (a node checks a resume against it first); binding it again
        # with the keys it has is refused: the worker's counters would start again under them.
        peek = await chain[0].client.call(
            "UnbindSession",
            worker_pb2.UnbindSessionRequest(schema_version=1, session_id=session.session_id, keep_bound=True),
        )
        assert peek.was_bound and peek.next_position == len(PROMPT) + 1 and not peek.kept_rows, peek
        with pytest.raises(WorkerError) as caught:
            await chain[-1].client.call(
                "BindSession",
                worker_pb2.BindSessionRequest(
                    schema_version=1, session_id=session.session_id, seq_id=0, step_key=os.urandom(32),
                    return_key=session.keys.return_key,
                ),
            )  # fmt: skip
        assert caught.value.code_name == "INVALID_ARGUMENT" and "fresh keys" in caught.value.message, caught.value
        # Unbinding says what the range computed (prompt + one step on the first range), where
        # the sequence stands, and gives back the output rows it kept: the rows the range's
        # Forward gives for those tokens, which the node keeps to rebuild a lost next hop.
        totals = await chain[0].client.call(
            "UnbindSession", worker_pb2.UnbindSessionRequest(schema_version=1, session_id=session.session_id)
        )
        assert totals.was_bound and totals.rows == len(PROMPT) + 1 and totals.steps == 2, totals
        assert 0 < totals.compute_us <= totals.in_worker_us, "the Forwards are part of the time in the worker"
        assert totals.next_position == len(PROMPT) + 1 and totals.next_step == 3, totals  # 2 refused, 7 out of order
        # (the same steps: the prompt, then one row; rows cut otherwise need not be equal)
        prompt_rows = await chain[0].client.forward(
            [SeqInput(seq_id=1, positions=list(range(len(PROMPT))), token_ids=PROMPT)]
        )
        step_rows = await chain[0].client.forward([SeqInput(seq_id=1, positions=[len(PROMPT)], token_ids=[11])])
        assert totals.kept_first_position == 0 and not totals.kept_rows_lost
        expected_rows = np.concatenate([prompt_rows[0].boundary, step_rows[0].boundary]).astype("<f4")
        assert totals.kept_rows == expected_rows.tobytes()
        assert list(totals.kept_step_rows) == [len(PROMPT), 1]  # each step's rows, a rebuild's shapes
        again = await chain[0].client.call(
            "UnbindSession", worker_pb2.UnbindSessionRequest(schema_version=1, session_id=session.session_id)
        )
        assert not again.was_bound and again.rows == 0
        # unbound: its frames are refused (the connection stays open for others)
        async with open_data_link(HOST, first) as late:
            await late.send(session.step_frame(step(8, [7], [5])))
            assert "is bound here" in (await late.receive()).notice


async def test_a_verification_step_gives_every_rows_top_k_and_a_rewind_cuts_what_it_rejected(qwen2_tiny_path) -> None:
    """Speculative decoding's worker half: a step with every_row returns the top-K of each of
    its rows; the next step, rewound, cuts the rejected rows on every range first (and from
    the rows kept for a rebuild), and gives the numbers of an unsplit worker cut the same way."""
    k = 4
    async with (
        open_chain(qwen2_tiny_path) as chain,
        open_worker(qwen2_tiny_path, 0, None, threads=1, ctx_size=64) as whole,
    ):
        session = await bind_route(chain, seq_id=0, keep_rows_max_bytes=1 << 20)
        n = len(PROMPT)
        draft = [11, 12, 13, 14]
        async with (
            open_data_link(HOST, chain[0].info.data_port) as to_first,
            open_data_link(HOST, chain[-1].info.data_port) as from_last,
        ):
            await from_last.send(session.attach_frame())
            await to_first.send(session.step_frame(step(0, list(range(n)), PROMPT, top_k=k)))
            assert (await result_of(session, from_last)).error_code == 0
            verify = worker_pb2.DataStep(
                step=1, positions=list(range(n, n + 4)), token_ids=draft, top_k=k, every_row=True
            )
            await to_first.send(session.step_frame(verify))
            result = await result_of(session, from_last)
            assert result.error_code == 0, result.error_message
            assert result.rows == 4 and result.top_k == k and len(result.row_log_sum_exp) == 4
            assert result.next_position == n + 4
            # the unsplit worker, the same rows in the same shapes
            await whole.client.forward([SeqInput(seq_id=0, positions=list(range(n)), token_ids=PROMPT, top_k=k)])
            (rows,) = await whole.client.forward(
                [SeqInput(seq_id=0, positions=list(range(n, n + 4)), token_ids=draft, logit_rows=[0, 1, 2, 3], top_k=k)]
            )
            ids = np.frombuffer(result.top_token_ids, dtype="<i4").reshape(4, k)
            logits = np.frombuffer(result.top_logits, dtype="<f4").reshape(4, k)
            for r, top in enumerate(rows.top):
                assert np.array_equal(ids[r], top.ids) and np.array_equal(logits[r], top.logits), r
                assert result.row_log_sum_exp[r] == top.log_sum_exp

            # Two drafts kept: position n + 2 on is cut on every range, and the step goes on there.
            kept = n + 2
            await to_first.send(
                session.step_frame(worker_pb2.DataStep(step=2, positions=[kept], token_ids=[20], top_k=k, rewind=True))
            )
            result = await result_of(session, from_last)
            assert result.error_code == 0, result.error_message
            assert result.next_position == kept + 1
            assert await whole.client.trim_sequence(0, kept) == kept
            (after,) = await whole.client.forward([SeqInput(seq_id=0, positions=[kept], token_ids=[20], top_k=k)])
            assert np.array_equal(np.frombuffer(result.top_token_ids, dtype="<i4"), after.top[0].ids)
            assert np.array_equal(np.frombuffer(result.top_logits, dtype="<f4"), after.top[0].logits)

            # Without rewind a step below the held positions is refused, as before; every_row
            # without a top-K is refused where it is first seen.
            await to_first.send(session.step_frame(step(3, [kept], [20], top_k=k)))
            assert (await result_of(session, from_last)).error_code == 3
            await to_first.send(
                session.step_frame(worker_pb2.DataStep(step=4, positions=[kept + 1], token_ids=[5], every_row=True))
            )
            refused = await result_of(session, from_last)
            assert refused.error_code == 3 and "top_k must be > 0" in refused.error_message, refused
            assert refused.error_layer_begin == 0  # (the first range: none computed it)

        # the rows kept for a rebuild: the prompt, the two kept of the four, the step after
        totals = await chain[0].client.call(
            "UnbindSession", worker_pb2.UnbindSessionRequest(schema_version=1, session_id=session.session_id)
        )
        assert totals.next_position == kept + 1 and not totals.kept_rows_lost
        assert list(totals.kept_step_rows) == [n, 2, 1]
        width = len(totals.kept_rows) // (kept + 1)
        assert width * (kept + 1) == len(totals.kept_rows)


async def test_sessions_that_arrive_together_share_forwards_and_keep_their_numbers(smollm2_path) -> None:
    """Bit for bit, with the bound the swarm's batching declares (0 on CPU, tests/test_batching.py)
    and for the same reason: only steps of one shape share a Forward. SmolLM2 (Q4_1), as there:
    the synthetic f32 models' products take another path for several rows than for one."""
    prompts = [[1, 17, 42, 99, 7, 3], [5, 9, 2], [8, 8, 8, 8]]
    async with (
        open_chain(smollm2_path, max_sequences=3, cuts=((0, 10), (10, 20), (20, 30))) as chain,
        open_worker(smollm2_path, 0, None, threads=1, ctx_size=64, max_sequences=3) as whole,
    ):
        sessions = [await bind_route(chain, seq_id=i) for i in range(len(prompts))]
        calls_before = (await chain[1].client.health()).forward_calls
        got: dict[int, list[np.ndarray]] = {i: [] for i in range(len(prompts))}
        async with (
            open_data_link(HOST, chain[0].info.data_port) as to_first,
            open_data_link(HOST, chain[-1].info.data_port) as from_last,
        ):
            for s in sessions:
                await from_last.send(s.attach_frame())
            tokens = {i: list(p) for i, p in enumerate(prompts)}
            for n in range(4):
                # every session's step n sent at once: they meet in the workers' queues
                frames = []
                for i, s in enumerate(sessions):
                    positions = list(range(len(prompts[i]))) if n == 0 else [len(tokens[i]) - 1]
                    feed = tokens[i] if n == 0 else tokens[i][-1:]
                    frames.append(s.step_frame(step(n, positions, feed)))
                await to_first.send(b"".join(frames))
                by_session = {s.session_id: i for i, s in enumerate(sessions)}
                for _ in sessions:
                    with trio.fail_after(30):
                        frame = await from_last.receive()
                    i = by_session[frame.session_id]
                    result = sessions[i].open_result(frame)
                    assert result.error_code == 0, result.error_message
                    row = np.frombuffer(result.logits, dtype="<f4")
                    got[i].append(row)
                    tokens[i].append(int(np.argmax(row)))
        calls = (await chain[1].client.health()).forward_calls - calls_before
        assert calls < 4 * len(prompts), f"{calls} Forwards for {4 * len(prompts)} steps: none were shared"
        for i, prompt in enumerate(prompts):
            positions = list(range(len(prompt)))
            expected = [await unsplit_logits(whole, i, positions, prompt)]
            for n in range(1, 4):
                expected.append(await unsplit_logits(whole, i, [len(prompt) + n - 1], [tokens[i][len(prompt) + n - 1]]))
            for n, (a, b) in enumerate(zip(got[i], expected, strict=True)):
                assert np.array_equal(a, b), f"session {i} step {n} differs from its solo run"


async def test_a_first_hop_with_decode_groups_caps_its_decode_forwards_and_keeps_the_numbers(smollm2_path) -> None:
    """BindSessionRequest.decode_groups: four sessions in two groups step their decode steps in
    one write; the worker computes them in two Forwards of two (ceil(4 / 2)), where without
    groups the same steps share one Forward, and every session's logits are the same both ways
    (only steps of one shape share a Forward, laid out by sequence id: SmolLM2 on the CPU gives
    a row the same bits in a Forward of two as of four, tests/test_batching.py)."""
    prompts = [[1, 17, 42, 99, 7, 3], [5, 9, 2], [8, 8, 8, 8], [4, 5]]
    async with open_worker(
        smollm2_path, 0, None, threads=1, ctx_size=64, max_sequences=8, data_listen=f"{HOST}:0"
    ) as worker:
        got: dict[int, list[np.ndarray]] = {}
        forwards: dict[int, list[int]] = {}
        for groups, first_seq in ((2, 0), (0, 4)):
            sessions = [await bind_route([worker], seq_id=first_seq + i, decode_groups=groups) for i in range(4)]
            forwards[groups] = []
            async with open_data_link(HOST, worker.info.data_port) as link:
                for s in sessions:
                    await link.send(s.attach_frame())
                tokens = {i: list(p) for i, p in enumerate(prompts)}
                for n in range(4):
                    before = (await worker.client.health()).data_plane_forwards
                    frames = []
                    for i, s in enumerate(sessions):  # every session's step n in one write: queued together
                        positions = list(range(len(prompts[i]))) if n == 0 else [len(tokens[i]) - 1]
                        frames.append(s.step_frame(step(n, positions, tokens[i] if n == 0 else tokens[i][-1:])))
                    await link.send(b"".join(frames))
                    by_session = {s.session_id: i for i, s in enumerate(sessions)}
                    for _ in sessions:
                        frame = await link.receive()
                        i = by_session[frame.session_id]
                        result = sessions[i].open_result(frame)
                        assert result.error_code == 0, result.error_message
                        row = np.frombuffer(result.logits, dtype="<f4")
                        got.setdefault(first_seq + i, []).append(row)
                        tokens[i].append(int(np.argmax(row)))
                    if n:  # (the prompts, of four lengths, take a Forward each either way)
                        forwards[groups].append((await worker.client.health()).data_plane_forwards - before)
            for s in sessions:  # (unbound: they no longer count as decoding here)
                await worker.client.call(
                    "UnbindSession", worker_pb2.UnbindSessionRequest(schema_version=1, session_id=s.session_id)
                )
        assert forwards == {2: [2, 2, 2], 0: [1, 1, 1]}, forwards
        for i in range(4):
            for n, (a, b) in enumerate(zip(got[i], got[4 + i], strict=True)):
                assert np.array_equal(a, b), f"session {i} step {n}: groups changed its logits"
        with pytest.raises(WorkerError, match="decode_groups 65 is over 64"):
            await bind_route([worker], seq_id=7, decode_groups=65)


@pytest.mark.parametrize("wire", [WireDType.F16S, WireDType.Q8], ids=["f16s", "q8"])
async def test_a_chain_with_a_lossy_wire_gives_the_numbers_of_the_python_codec(qwen2_tiny_path, wire) -> None:
    """Rows between ranges in the session's wire dtype: the workers encode and decode them as
    agent.core.wire.boundary does (the logits equal a chain fed the rows the Python codec makes),
    keep them as sent, and say so."""
    async with open_chain(qwen2_tiny_path) as chain:
        session = await bind_route(chain, seq_id=0, keep_rows_max_bytes=1 << 20, wire_dtype=wire)
        async with (
            open_data_link(HOST, chain[0].info.data_port) as to_first,
            open_data_link(HOST, chain[-1].info.data_port) as from_last,
        ):
            await from_last.send(session.attach_frame())
            await to_first.send(session.step_frame(step(0, list(range(len(PROMPT))), PROMPT)))
            result = await result_of(session, from_last)
            assert result.error_code == 0, result.error_message
        totals = await chain[0].client.call(
            "UnbindSession", worker_pb2.UnbindSessionRequest(schema_version=1, session_id=session.session_id)
        )
        # the same rows by hand, on sequence 1: each range's output through the Python codec
        hop = [SeqInput(seq_id=1, positions=list(range(len(PROMPT))), token_ids=PROMPT)]
        first_rows = None
        for worker in chain:
            out = await worker.client.forward(hop)
            if out[0].logits is not None:
                break
            first_rows = first_rows if first_rows is not None else out[0].boundary
            hop = through_wire(next_hop_entries(hop, out), wire)
        assert np.array_equal(np.frombuffer(result.logits, dtype="<f4"), out[0].logits[-1])
        assert first_rows is not None and totals.kept_rows_dtype == wire
        assert totals.kept_rows == encode_rows(first_rows, first_rows.shape[1], wire)  # kept as sent


async def test_bind_session_refuses_what_does_not_fit(qwen2_tiny_path) -> None:
    async with open_chain(qwen2_tiny_path) as chain:
        sid = os.urandom(16)
        cases = [
            (chain[0], dict(session_id=b"short", seq_id=0, step_key=os.urandom(32)), "16 bytes"),
            (chain[0], dict(session_id=sid, seq_id=9, step_key=os.urandom(32)), "n_seq_max"),
            (chain[0], dict(session_id=sid, seq_id=0, step_key=b"k"), "step_key"),
            (chain[0], dict(session_id=sid, seq_id=0, step_key=os.urandom(32)), "needs next_host"),
            (
                chain[-1],
                dict(session_id=sid, seq_id=0, step_key=os.urandom(32), next_host=HOST, next_port=1,
                     next_step_key=os.urandom(32)),
                "no next_host",
            ),
            (chain[-1], dict(session_id=sid, seq_id=0, step_key=os.urandom(32)), "return_key"),
            (
                chain[0],
                dict(session_id=sid, seq_id=0, step_key=os.urandom(32), next_host=HOST, next_port=1,
                     next_step_key=os.urandom(32), wire_dtype=9),
                "wire_dtype 9 is not supported",
            ),
        ]  # fmt: skip
        for worker, fields, reason in cases:
            with pytest.raises(WorkerError) as caught:
                await worker.client.call("BindSession", worker_pb2.BindSessionRequest(schema_version=1, **fields))
            assert caught.value.code_name == "INVALID_ARGUMENT" and reason in caught.value.message, caught.value
        # a next hop nobody listens on: refused now, not a lost step later
        with trio.socket.socket() as probe:
            await probe.bind((HOST, 0))
            closed_port = probe.getsockname()[1]
        with pytest.raises(WorkerError) as caught:
            await chain[0].client.call(
                "BindSession",
                worker_pb2.BindSessionRequest(
                    schema_version=1, session_id=sid, seq_id=0, step_key=os.urandom(32), next_host=HOST,
                    next_port=closed_port, next_step_key=os.urandom(32),
                ),
            )  # fmt: skip
        assert caught.value.code_name == "UNAVAILABLE" and "cannot connect" in caught.value.message, caught.value


async def _step_once(session: OwnerSession, to_first: DataLink, from_last: DataLink, n: int, positions, tokens) -> None:
    await to_first.send(session.step_frame(step(n, positions, tokens)))
    result = await result_of(session, from_last)
    assert result.error_code == 0, result.error_message


async def _poll_until(read: Callable[[], Awaitable[T]], done: Callable[[T], bool], *, timeout_s: float) -> T:
    """Reads observable worker state until ``done`` holds and returns it. Each read is a call to
    the worker, so the pause between reads is its round trip: no sleep decides anything."""
    with trio.fail_after(timeout_s):
        value = await read()
        while not done(value):
            value = await read()
        return value


async def _assert_held(link: DataLink, for_s: float, why: str) -> None:
    """Nothing arrives on ``link`` for ``for_s`` (a step the worker must be holding)."""
    with trio.move_on_after(for_s):
        await link.receive()
        pytest.fail(why)


async def test_a_lock_step_first_hop_holds_a_decode_step_until_every_decoding_session_steps(qwen2_tiny_path) -> None:
    """BindSessionRequest.decode_gather_us: the first range holds a decode Forward until every
    session decoding there has its step queued (one Forward for both here: without the hold,
    B's step, sent first, would run alone), for at most the window (a session that stops
    stepping is waited for once, then not until it steps again). Prompts are not held."""
    window_s = 3.0
    async with open_chain(qwen2_tiny_path, cuts=((0, 6),), max_sequences=2) as (worker,):
        a, b = [await bind_route([worker], seq_id=i, decode_gather_us=int(window_s * 1e6)) for i in range(2)]
        port = worker.info.data_port
        async with (
            open_data_link(HOST, port) as to_a, open_data_link(HOST, port) as from_a,
            open_data_link(HOST, port) as to_b, open_data_link(HOST, port) as from_b,
        ):  # fmt: skip
            await from_a.send(a.attach_frame())
            await from_b.send(b.attach_frame())
            n = len(PROMPT)
            with trio.fail_after(window_s / 2):  # neither prompt nor A's first decode step is held
                await _step_once(a, to_a, from_a, 0, list(range(n)), PROMPT)
                await _step_once(b, to_b, from_b, 0, list(range(n)), PROMPT)
                await _step_once(a, to_a, from_a, 1, [n], [5])  # B is not decoding yet
            before = await worker.client.health()
            await to_b.send(b.step_frame(step(1, [n], [5])))  # A decodes: B's step waits for A's
            await _assert_held(from_b, window_s / 4, "B's decode step ran before A's came")
            await to_a.send(a.step_frame(step(2, [n + 1], [6])))
            for session, link in ((a, from_a), (b, from_b)):
                assert (await result_of(session, link)).error_code == 0
            after = await worker.client.health()
            assert after.data_plane_forwards - before.data_plane_forwards == 1, (before, after)
            assert after.data_plane_steps - before.data_plane_steps == 2, (before, after)
            # B stops stepping: A's next step is held for the window, once
            started = trio.current_time()
            await _step_once(a, to_a, from_a, 3, [n + 2], [7])
            assert trio.current_time() - started >= window_s * 0.9, "held until the window ended"
            with trio.fail_after(window_s / 2):  # B is not waited for again
                await _step_once(a, to_a, from_a, 4, [n + 3], [8])


async def test_a_prefill_forward_takes_turns_with_the_data_planes_decode_forwards(qwen2_tiny_path) -> None:
    """--prefill-pace-ms: while a session decodes on the data plane, a node's prefill Forward
    (a prompt chunk) waits for the next decode Forward and runs right after it, so that chunks
    and decode steps alternate in step (each decode step waits behind one chunk, every time);
    with nobody decoding, chunks run at once. (The pace is long here, so that only a decode
    Forward can end the wait.)"""
    async with open_chain(qwen2_tiny_path, cuts=((0, 6),), extra_args=("--prefill-pace-ms", "30000")) as (worker,):
        session = await bind_route([worker], seq_id=0)
        port = worker.info.data_port
        chunk = [3, 4, 5, 6]
        async with open_data_link(HOST, port) as to_first, open_data_link(HOST, port) as from_last:
            await from_last.send(session.attach_frame())
            n = len(PROMPT)
            await _step_once(session, to_first, from_last, 0, list(range(n)), PROMPT)
            await _step_once(session, to_first, from_last, 1, [n], [5])  # decoding now
            for c in range(2):
                done = trio.Event()

                async def run_chunk(c: int = c, done: trio.Event = done) -> None:
                    positions = list(range(4 * c, 4 * c + 4))
                    await worker.client.forward([SeqInput(seq_id=1, positions=positions, token_ids=chunk)])
                    done.set()

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(run_chunk)
                    with trio.move_on_after(0.5):
                        await done.wait()
                    assert not done.is_set(), f"chunk {c} ran before the next decode Forward"
                    await _step_once(session, to_first, from_last, 2 + c, [n + 1 + c], [6])
                    with trio.fail_after(10):
                        await done.wait()
            await worker.client.call("UnbindSession", worker_pb2.UnbindSessionRequest(
                schema_version=1, session_id=session.session_id))  # fmt: skip
            with trio.fail_after(10):  # nobody decodes here now: a chunk does not wait
                await worker.client.forward([SeqInput(seq_id=1, positions=list(range(8, 12)), token_ids=chunk)])


async def test_a_hold_ended_by_a_chunk_leaves_no_hold_behind(qwen2_tiny_path) -> None:
    """A lock-step hold that a chunk ends early (the chunk, and the held step with it, run at
    once) leaves nothing behind: the next hold still holds (a stale hold would end it at once).
    The timing half (no deadline left behind, a new hold gets a window of its own) is proven on
    a fake clock: native/tests/hop_scheduler_tests.cpp, "a chunk, a refusal or a step nobody
    holds ends a hold at once". Pacing is off here: while A decodes, a paced chunk would wait
    for the convoy's decode Forward instead of ending the hold ("a paced chunk neither runs nor
    ends a lock-step hold")."""
    window_s = 2.0
    no_pacing = ("--prefill-pace-ms", "0")
    async with open_chain(qwen2_tiny_path, cuts=((0, 6),), max_sequences=3, extra_args=no_pacing) as (worker,):
        a, b = [await bind_route([worker], seq_id=i, decode_gather_us=int(window_s * 1e6)) for i in range(2)]
        c = await bind_route([worker], seq_id=2)  # not lock-step
        port = worker.info.data_port
        async with (
            open_data_link(HOST, port) as to_a, open_data_link(HOST, port) as from_a,
            open_data_link(HOST, port) as to_b, open_data_link(HOST, port) as from_b,
            open_data_link(HOST, port) as to_c, open_data_link(HOST, port) as from_c,
        ):  # fmt: skip
            for session, link in ((a, from_a), (b, from_b), (c, from_c)):
                await link.send(session.attach_frame())
            n = len(PROMPT)
            for session, to, frm in ((a, to_a, from_a), (b, to_b, from_b), (c, to_c, from_c)):
                await _step_once(session, to, frm, 0, list(range(n)), PROMPT)
            await _step_once(a, to_a, from_a, 1, [n], [5])  # A decodes
            await to_b.send(b.step_frame(step(1, [n], [5])))  # held for A's next step
            await _assert_held(from_b, window_s / 4, "B's decode step ran before A's came")
            await to_c.send(c.step_frame(step(1, [n, n + 1], [5, 6])))  # a chunk: everything runs
            with trio.fail_after(window_s / 2):  # well before the hold's end
                assert (await result_of(b, from_b)).error_code == 0
                assert (await result_of(c, from_c)).error_code == 0
            await to_a.send(a.step_frame(step(2, [n + 1], [6])))  # B decodes too: held for B
            await _assert_held(from_a, window_s / 4, "A's step ran at once: a stale hold ended the new one")
            await to_b.send(b.step_frame(step(2, [n + 1], [6])))
            for session, link in ((a, from_a), (b, from_b)):
                assert (await result_of(session, link)).error_code == 0


async def test_connections_that_prove_nothing_give_way_and_time_out(qwen2_tiny_path) -> None:
    """Anyone who reaches the data port can connect, but only a peer with a bound session's key
    makes a frame open. Connections that never do cannot keep a route's hops out: when every
    slot is taken, a new connection takes the oldest unproven one's, and an unproven connection
    is closed after the worker's timeout (with a NOTICE saying why); a proven one stays open."""
    timeout_ms, slots = 5000, 6
    limits = ("--data-unproven-timeout-ms", str(timeout_ms), "--data-max-connections", str(slots))
    async with open_chain(qwen2_tiny_path, extra_args=limits) as chain, contextlib.AsyncExitStack() as stack:
        middle = chain[1].info.data_port
        started = trio.current_time()
        idle = [await stack.enter_async_context(open_data_link(HOST, middle)) for _ in range(slots)]
        # Every slot of the middle worker is taken by an idle connection: the bind's two
        # connections there (the first worker dials it, it dials the last) take the two oldest
        # ones' slots, closed at once without a word.
        session = await bind_route(chain, seq_id=0)
        for link in idle[:2]:
            with trio.fail_after(timeout_ms / 1000 / 2), pytest.raises(DataLinkClosed):
                await link.receive()
        assert trio.current_time() - started < timeout_ms / 1000, "closed to make room, not by the timeout"
        async with (
            open_data_link(HOST, chain[0].info.data_port) as to_first,
            open_data_link(HOST, chain[-1].info.data_port) as from_last,
        ):
            await from_last.send(session.attach_frame())
            await to_first.send(session.step_frame(step(0, list(range(len(PROMPT))), PROMPT, top_k=4)))
            assert (await result_of(session, from_last)).error_code == 0
            # the other idle connections: closed when their time is out, each told why
            for link in idle[2:]:
                with trio.fail_after(3 * timeout_ms / 1000):
                    notice = await link.receive()
                    assert notice.kind == data_frames.NOTICE, notice
                    assert f"no frame of a session bound here opened within {timeout_ms} ms" in notice.notice
                    with pytest.raises(DataLinkClosed):
                        await link.receive()
            assert trio.current_time() - started >= timeout_ms / 1000
            # the route's connections proved themselves: still open past the timeout, and the
            # session goes on over them (the owner's two, and worker to worker)
            await to_first.send(session.step_frame(step(1, [len(PROMPT)], [11], top_k=4)))
            result = await result_of(session, from_last)
            assert result.error_code == 0 and result.next_position == len(PROMPT) + 1, result


async def test_an_unproven_connection_may_announce_only_a_short_frame(qwen2_tiny_path) -> None:
    """Proven before buffered: a connection on which no frame has opened may announce only an
    owner's token step of the worker's largest batch (its prefix is read first: a longer one
    ends the connection at once, with a NOTICE); once a frame opened on it (a HELLO, as a
    worker sends before its rows), its frames may be as long as the worker's frame limit. A
    replayed HELLO proves nothing."""
    async with open_chain(qwen2_tiny_path, cuts=((0, 6),)) as (worker,):
        session = await bind_route([worker], seq_id=0)
        port = worker.info.data_port
        unproven_bytes = worker.info.n_batch_max * 10 + 4096  # data_plane_bounds.h
        long_frame = struct.pack("<I", unproven_bytes + 1) + bytes(unproven_bytes + 1)
        hello = data_frames.sealed_frame(data_frames.HELLO, session.keys.first_step_key, session.session_id, 1, b"")
        async with open_data_link(HOST, port) as link:
            await link.send(long_frame[: data_frames.PREFIX_BYTES])
            notice = await link.receive()
            assert f"over the limit of {unproven_bytes} on a connection no frame has proven" in notice.notice, notice
            with pytest.raises(DataLinkClosed):
                await link.receive()
        async with open_data_link(HOST, port) as link:
            await link.send(hello + long_frame)
            # taken whole (the HELLO proved the connection), then refused for what it holds
            assert "the frame is not a DataFrame" in (await link.receive()).notice
        async with open_data_link(HOST, port) as link:
            await link.send(hello)
            assert "not above the last one taken" in (await link.receive()).notice
            await link.send(long_frame[: data_frames.PREFIX_BYTES])
            assert "on a connection no frame has proven" in (await link.receive()).notice


async def test_data_plane_connections_keep_alive(qwen2_tiny_path, idle_tcp_timer) -> None:
    """TCP keepalive on the worker's accepted connections: an idle one whose peer's machine
    vanished (no FIN: power, network) ends instead of holding its slot and thread for ever."""
    async with (
        open_chain(qwen2_tiny_path, cuts=((0, 6),)) as (worker,),
        open_data_link(HOST, worker.info.data_port) as link,
    ):
        # a frame for no session: its NOTICE says the worker's thread took the connection
        # (accepted and its options set), not only the kernel
        await link.send(data_frames.sealed_frame(data_frames.STEP, os.urandom(32), os.urandom(16), 1, b""))
        with trio.fail_after(10):
            assert "is bound here" in (await link.receive()).notice
        timer = await idle_tcp_timer(worker.info.data_port, link._sock.getsockname()[1])
        assert timer == 2, f"no keepalive timer on the worker's end (tr={timer})"


def _sampled(request: worker_pb2.ContinueSessionRequest, **sampling) -> worker_pb2.ContinueSessionRequest:
    for name, value in sampling.items():
        setattr(request, name, value)
    return request


def continue_request(
    session: OwnerSession, port: int, key: bytes, steps: int, stop=()
) -> worker_pb2.ContinueSessionRequest:
    return worker_pb2.ContinueSessionRequest(
        schema_version=1,
        session_id=session.session_id,
        host=HOST,
        port=port,
        continue_key=key,
        steps=steps,
        stop_token_ids=list(stop),
    )


def top_of(result: worker_pb2.DataResult) -> tuple[list[int], bytes]:
    return list(np.frombuffer(result.top_token_ids, dtype="<i4")), result.top_logits


async def test_a_last_range_continues_greedy_steps_to_the_first_and_the_second_copy_is_dropped(smollm2_path) -> None:
    """Greedy continuation (worker.proto ContinueSession): after each decode step the last range
    sends the next one (its greedy token) to the first range itself, under a key of its own; the
    results are the unsplit worker's stepped one at a time, bit for bit; it runs at most 4 steps
    ahead of the owner's own; the owner's copy of a step already taken is dropped without a
    word; the budget and a stop token end it; a CONTINUE frame without the key, or replayed, is
    refused."""
    top_k, budget, window, n_ref = 8, 5, 4, 9
    async with (
        open_chain(smollm2_path, ((0, 10), (10, 20), (20, 30))) as chain,
        open_worker(smollm2_path, 0, None, threads=1, ctx_size=64) as whole,
    ):
        # the reference: the unsplit worker, one Forward a step, the caller picking each token
        # (a real model: its tokens differ from step to step, so a wrong one would show)
        outs = [(await whole.client.forward([SeqInput(0, list(range(len(PROMPT))), PROMPT, top_k=top_k)]))[0]]
        while len(outs) < n_ref:
            last = outs[-1]
            token = int(last.top[-1].ids[0])
            outs.append((await whole.client.forward([SeqInput(0, [last.next_position], [token], top_k=top_k)]))[0])
        reference = [(list(o.top[-1].ids), np.asarray(o.top[-1].logits, dtype="<f4").tobytes()) for o in outs]
        tokens = [int(ids[0]) for ids, _ in reference]
        assert len(set(tokens)) > 3, tokens

        first_port, last_port = chain[0].info.data_port, chain[-1].info.data_port
        key = os.urandom(32)
        session = await bind_route(chain, seq_id=0, continue_key=key)

        async def first_peek() -> worker_pb2.UnbindSessionReply:
            return await chain[0].client.call("UnbindSession", worker_pb2.UnbindSessionRequest(
                schema_version=1, session_id=session.session_id, keep_bound=True))  # fmt: skip

        async def last_peek(of: OwnerSession) -> worker_pb2.UnbindSessionReply:
            return await chain[-1].client.call("UnbindSession", worker_pb2.UnbindSessionRequest(
                schema_version=1, session_id=of.session_id, keep_bound=True))  # fmt: skip

        # what cannot continue is refused with its reason
        refusals = [
            (chain[0], continue_request(session, first_port, key, budget), "INVALID_ARGUMENT", "only the last range"),
            (chain[-1], continue_request(session, first_port, key[:31], budget), "INVALID_ARGUMENT", "32-byte"),
            (chain[-1], worker_pb2.ContinueSessionRequest(
                schema_version=1, session_id=os.urandom(16), host=HOST, port=first_port, continue_key=key, steps=1,
            ), "FAILED_PRECONDITION", "is bound here"),
            # a sampled session's draw: parameters the owner's sampling refuses are refused here too
            (chain[-1], _sampled(continue_request(session, first_port, key, budget), temperature=-1.0),
             "INVALID_ARGUMENT", "temperature"),
            (chain[-1], _sampled(continue_request(session, first_port, key, budget), temperature=0.7, top_p=1.5),
             "INVALID_ARGUMENT", "top_p"),
        ]  # fmt: skip
        for worker, request, code, why in refusals:
            with pytest.raises(WorkerError) as caught:
                await worker.client.call("ContinueSession", request)
            assert caught.value.code_name == code and why in caught.value.message, caught.value
        with pytest.raises(WorkerError) as caught:  # only the first range takes a continue_key
            await chain[1].client.call("BindSession", worker_pb2.BindSessionRequest(
                schema_version=1, session_id=os.urandom(16), seq_id=1, step_key=os.urandom(32), next_host=HOST,
                next_port=last_port, next_step_key=os.urandom(32), continue_key=os.urandom(32),
            ))  # fmt: skip
        assert "only the first range takes a continue_key" in caught.value.message, caught.value
        await chain[-1].client.call("ContinueSession", continue_request(session, first_port, key, budget))
        with pytest.raises(WorkerError) as caught:
            await chain[-1].client.call("ContinueSession", continue_request(session, first_port, os.urandom(32), 3))
        assert (
            caught.value.code_name == "FAILED_PRECONDITION" and "one continue_key per binding" in caught.value.message
        )
        # the same key again re-arms it (the budget afresh: the owner's speculation between runs)
        await chain[-1].client.call("ContinueSession", continue_request(session, first_port, key, budget))

        async with open_data_link(HOST, first_port) as to_first, open_data_link(HOST, last_port) as from_last:
            await from_last.send(session.attach_frame())
            await to_first.send(session.step_frame(step(0, list(range(len(PROMPT))), PROMPT, top_k=top_k)))
            results = [await result_of(session, from_last)]  # a prompt is not continued: one result
            # the first decode step, the owner's: it and the continued steps come back, at most
            # `window` past the owner's own (the owner sends nothing more here, as if stopped)
            await to_first.send(session.step_frame(step(1, [len(PROMPT)], [tokens[0]], top_k=top_k)))
            results += [await result_of(session, from_last) for _ in range(1 + window)]
            # the last range sent step 6 on: the first holds it
            peek = await _poll_until(first_peek, lambda p: p.continue_steps_waiting > 0, timeout_s=30)
            assert peek.next_step == 2 + window, peek
            # the owner's copy of step 2 (taken from the last range already): dropped, no word;
            # it lets the held step go
            await to_first.send(session.step_frame(step(2, [len(PROMPT) + 1], [tokens[1]], top_k=top_k)))
            results.append(await result_of(session, from_last))
            assert [r.step for r in results] == list(range(2 + budget))
            assert all(r.error_code == 0 for r in results), [r.error_message for r in results]
            assert [top_of(r) for r in results] == reference[: 2 + budget], "the stepped unsplit worker's, bit for bit"
            # each result says whether the last range sent the next step itself: the prompt's
            # does not, the budget's steps do, the last of them does not (the owner's turn)
            assert [r.continued for r in results] == [False] + [True] * budget + [False], results
            # then the owner's step after the budget: taken, its result the reference's
            n = 2 + budget
            await to_first.send(session.step_frame(step(n, [len(PROMPT) + n - 1], [tokens[n - 1]], top_k=top_k)))
            after = await result_of(session, from_last)
            assert after.step == n and after.error_code == 0 and top_of(after) == reference[n], after

            # a CONTINUE frame without the key, and a copy of one the first range took: refused
            async with open_data_link(HOST, first_port) as intruder:
                body = step(n + 1, [len(PROMPT) + n], [tokens[n]], top_k=top_k).SerializeToString()
                await intruder.send(
                    data_frames.sealed_frame(data_frames.CONTINUE, os.urandom(32), session.session_id, 99, body)
                )
                assert "does not open" in (await intruder.receive()).notice
                await intruder.send(data_frames.sealed_frame(data_frames.CONTINUE, key, session.session_id, 1, body))
                assert "not above the last one taken" in (await intruder.receive()).notice

        first_totals, last_totals = [
            await worker.client.call("UnbindSession", worker_pb2.UnbindSessionRequest(
                schema_version=1, session_id=session.session_id))
            for worker in (chain[0], chain[-1])
        ]  # fmt: skip
        assert first_totals.continued_steps == budget and last_totals.continued_steps == budget
        assert first_totals.duplicate_steps_dropped == 1 and first_totals.steps == 3 + budget, first_totals
        for worker in chain:
            await worker.client.remove_sequence(0)

        # A stop token: the step that chose it is the last continued, for good (a key is never
        # used again: its nonces would repeat).
        stop_at = next(i for i in range(3, n_ref) if tokens[i] not in tokens[:i])
        key = os.urandom(32)
        session = await bind_route(chain, seq_id=0, continue_key=key)
        await chain[-1].client.call(
            "ContinueSession", continue_request(session, first_port, key, 100, stop=[tokens[stop_at], 99999])
        )
        async with open_data_link(HOST, first_port) as to_first, open_data_link(HOST, last_port) as from_last:
            # the owner attaches late (as a busy owner may): the results made before its ATTACH
            # are all kept, in order, not just the last one
            await to_first.send(session.step_frame(step(0, list(range(len(PROMPT))), PROMPT, top_k=top_k)))
            await to_first.send(session.step_frame(step(1, [len(PROMPT)], [tokens[0]], top_k=top_k)))
            await _poll_until(lambda: last_peek(session), lambda p: p.steps >= stop_at + 1, timeout_s=30)
            await from_last.send(session.attach_frame())
            results = [await result_of(session, from_last) for _ in range(stop_at + 1)]
            assert [top_of(r) for r in results] == reference[: stop_at + 1]
            # the owner's next step (past its stop token, as a test): taken, and not continued
            await to_first.send(
                session.step_frame(step(stop_at + 1, [len(PROMPT) + stop_at], [tokens[stop_at]], top_k=top_k))
            )
            assert (await result_of(session, from_last)).step == stop_at + 1
        totals = await chain[0].client.call(
            "UnbindSession", worker_pb2.UnbindSessionRequest(schema_version=1, session_id=session.session_id)
        )
        assert totals.continued_steps == stop_at - 1 and totals.duplicate_steps_dropped == 0, totals


@pytest.mark.timeout(240)
async def test_a_last_range_draws_a_sampled_sessions_tokens_as_its_owner_would(smollm2_path) -> None:
    """A sampled session's last range (ContinueSession with a temperature) draws each decode
    step's token itself: the token the owner's draw (agent/core/owner/sampling.py) gives on the
    unsplit worker's row with the same uniform (draw_uniform of the seed and the position), its
    log-probability, and the top-K the step asked for, the row's bit for bit; and it continues
    with that token. With no top-k cut (the whole row stays on the last range) and with one."""
    top_k, budget, seed = 8, 3, 2026
    async with (
        open_chain(smollm2_path, ((0, 10), (10, 20), (20, 30))) as chain,
        open_worker(smollm2_path, 0, None, threads=1, ctx_size=64) as whole,
    ):
        for params in (SamplingParams(temperature=0.8, top_p=0.95), SamplingParams(temperature=1.2, top_k=5)):
            # the reference: the unsplit worker's full rows, the owner drawing each token
            rows = [(await whole.client.forward([SeqInput(0, list(range(len(PROMPT))), PROMPT)]))[0].logits[-1]]
            tokens = [draw_token(rows[0], params, draw_uniform(seed, len(PROMPT)))]
            while len(rows) < 2 + budget:
                position = len(PROMPT) + len(rows) - 1
                out = (await whole.client.forward([SeqInput(0, [position], [tokens[-1]])]))[0]
                rows.append(out.logits[-1])
                tokens.append(draw_token(rows[-1], params, draw_uniform(seed, position + 1)))
            await whole.client.remove_sequence(0)

            key = os.urandom(32)
            session = await bind_route(chain, seq_id=0, continue_key=key)
            request = continue_request(session, chain[0].info.data_port, key, budget)
            request.temperature, request.top_k, request.top_p, request.draw_seed = (
                params.temperature, params.top_k, params.top_p, seed,
            )  # fmt: skip
            await chain[-1].client.call("ContinueSession", request)
            async with (
                open_data_link(HOST, chain[0].info.data_port) as to_first,
                open_data_link(HOST, chain[-1].info.data_port) as from_last,
            ):
                await from_last.send(session.attach_frame())
                await to_first.send(session.step_frame(step(0, list(range(len(PROMPT))), PROMPT, top_k=top_k)))
                prompt_result = await result_of(session, from_last)
                assert not prompt_result.drawn  # a prompt's last row: the owner draws the first token
                await to_first.send(session.step_frame(step(1, [len(PROMPT)], [tokens[0]], top_k=top_k)))
                results = [await result_of(session, from_last) for _ in range(1 + budget)]
            assert [r.step for r in results] == list(range(1, 2 + budget))
            assert all(r.error_code == 0 and r.drawn for r in results), [r.error_message for r in results]
            assert [r.drawn_token for r in results] == tokens[1 : 2 + budget], params
            for r, row in zip(results, rows[1:], strict=False):
                ids, logits, _ = select_top_k(row, max(top_k, params.top_k))
                assert top_of(r) == (list(ids), logits.astype("<f4").tobytes())
                assert r.drawn_logprob == pytest.approx(float(row[r.drawn_token]) - log_sum_exp(row), abs=1e-6)
            totals = await chain[0].client.call(
                "UnbindSession", worker_pb2.UnbindSessionRequest(schema_version=1, session_id=session.session_id)
            )
            assert totals.continued_steps == budget, totals
            for worker in chain:
                await worker.client.call(
                    "UnbindSession", worker_pb2.UnbindSessionRequest(schema_version=1, session_id=session.session_id)
                )
                await worker.client.remove_sequence(0)
