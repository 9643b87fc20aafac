"""Session state machine and sampling (agent.core.owner.session, agent.core.owner.sampling). Pure, no I/O."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from agent._proto import swarm_pb2
from agent.core.owner.route_repair import end_session_request
from agent.core.owner.sampling import SamplingParams, draw_token, draw_uniform, sample_token, sampling_candidates
from agent.core.owner.session import HopFailed, OwnerStep, ResultRefused, Session
from agent.core.wire.swarm_wire import token_checksum
from agent.core.wire.topk import TopLogits

pytestmark = pytest.mark.unit

SID = bytes(range(16))
OTHER_SID = bytes(range(1, 17))


def logits_row(best: int, n_vocab: int = 8) -> np.ndarray:
    row = np.zeros(n_vocab, dtype=np.float32)
    row[best] = 5.0
    return row


def result(step: int, logits: np.ndarray | None = None, *, session_id: bytes = SID, **fields) -> swarm_pb2.StepResult:
    msg = swarm_pb2.StepResult(schema_version=1, session_id=session_id, step=step)
    if logits is not None:
        data = np.asarray(logits, dtype="<f4").tobytes()
        msg.logits = data
        msg.n_vocab = len(logits)
        msg.checksum = zlib.crc32(data)
    for name, value in fields.items():
        if name == "error":
            msg.error.CopyFrom(value)
        else:
            setattr(msg, name, value)
    return msg


# --- sampling ---------------------------------------------------------------------------------


def test_greedy_is_the_argmax_and_draws_nothing() -> None:
    rng = np.random.default_rng(0)
    state = rng.bit_generator.state
    logits = np.array([0.1, 3.0, -2.0, 3.0, 1.0], dtype=np.float32)
    assert sample_token(logits, SamplingParams(), rng) == 1  # lowest index on ties
    assert sample_token(logits, SamplingParams(temperature=0.0, top_k=2, top_p=0.5), None) == 1
    assert rng.bit_generator.state == state


def test_seeded_sampling_is_reproducible_and_the_seed_matters() -> None:
    logits = np.linspace(-1.0, 1.0, 50).astype(np.float32)
    params = SamplingParams(temperature=1.5, top_k=40, top_p=0.95)

    def draws(seed: int) -> list[int]:
        rng = np.random.default_rng(seed)
        return [sample_token(logits, params, rng) for _ in range(40)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    assert len(set(draws(7))) > 5  # it really samples


def test_top_k_keeps_exactly_the_k_most_likely_tokens() -> None:
    logits = np.array([0.0, 4.0, 1.0, 3.0, 2.0, 4.0], dtype=np.float32)
    ids, probs = sampling_candidates(logits, SamplingParams(temperature=1.0, top_k=3))
    assert ids.tolist() == [1, 5, 3]  # ties ordered by token id
    assert probs.sum() == pytest.approx(1.0)
    assert probs[0] == pytest.approx(probs[1])
    rng = np.random.default_rng(1)
    drawn = {sample_token(logits, SamplingParams(temperature=5.0, top_k=3), rng) for _ in range(300)}
    assert drawn == {1, 3, 5}
    # ties at the cut: the lowest token ids stay, whatever order numpy partitions them in
    flat = np.array([0.0, 2.0, 1.0, 1.0, 1.0, 1.0], dtype=np.float32)
    ids, _ = sampling_candidates(flat, SamplingParams(temperature=1.0, top_k=3))
    assert ids.tolist() == [1, 2, 3]


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs).astype(np.float32)
    ids, kept = sampling_candidates(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert ids.tolist() == [0, 1]  # 0.5 + 0.3 reaches 0.8
    assert kept == pytest.approx([0.5 / 0.8, 0.3 / 0.8], rel=1e-5)
    ids, _ = sampling_candidates(logits, SamplingParams(temperature=1.0, top_p=0.81))
    assert ids.tolist() == [0, 1, 2]
    ids, _ = sampling_candidates(logits, SamplingParams(temperature=1.0, top_p=0.1))
    assert ids.tolist() == [0]  # never empty
    rng = np.random.default_rng(3)
    assert {sample_token(logits, SamplingParams(temperature=1.0, top_p=0.8), rng) for _ in range(300)} == {0, 1}


def test_temperature_sharpens_and_flattens() -> None:
    logits = np.array([2.0, 1.0, 0.0], dtype=np.float32)
    _, cold = sampling_candidates(logits, SamplingParams(temperature=0.5))
    _, warm = sampling_candidates(logits, SamplingParams(temperature=2.0))
    assert cold[0] > warm[0]
    assert cold[0] == pytest.approx(np.exp(4) / (np.exp(4) + np.exp(2) + 1))


class _Uniforms:
    """Stands in for a ``numpy.random.Generator``: ``random()`` gives these values in turn."""

    def __init__(self, values) -> None:
        self.values = iter(values)

    def random(self) -> float:
        return next(self.values)


def _drawn_by_ordering_every_candidate(row: np.ndarray, params: SamplingParams, uniform: float) -> int:
    ids, probs = sampling_candidates(row, params)
    cumulative = np.cumsum(probs)
    return int(ids[min(int(np.searchsorted(cumulative, uniform * cumulative[-1], side="right")), ids.size - 1)])


def _rows_for_full_row_draws() -> list[np.ndarray]:
    rng = np.random.default_rng(11)
    rows = [
        (rng.standard_normal(49152) * 2.5).astype(np.float32),  # a vocabulary's width, weight spread wide
        np.round(rng.standard_normal(3000) * 4).astype(np.float32),  # ties everywhere, across every stretch
        rng.permutation(np.linspace(0.0, -60.0, 2000)).astype(np.float32),  # a stretch at every drop
        np.array([3.0, 3.0, 3.0], dtype=np.float32),
    ]
    masked = (rng.standard_normal(5000) * 6).astype(np.float32)
    masked[rng.integers(0, masked.size, 2000)] = -np.inf
    return [*rows, masked]


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=t, top_p=p) for t in (0.4, 1.0, 3.0) for p in (1.0, 0.97, 0.5)]
    + [SamplingParams(temperature=1.0, top_k=10**9)],
)
def test_a_full_row_draw_equals_ordering_every_candidate(params: SamplingParams) -> None:
    """With no top-k cut the owner orders a stretch of the likeliest candidates at a time, not
    the whole row (agent.core.owner.sampling._draw_from_row): the same token as ordering them all,
    for uniforms anywhere, out to the last stretches (at temperature 1, 1 - 1e-6 orders the
    third stretch or further on every row of more than 3 tokens, 1 - 1e-9 the last one on the
    masked row). Not right at 1: where the weights left fall within the sums' rounding (~n
    ulps), the two sums (one in token order here) may stop on different tokens."""
    uniforms = [*np.random.default_rng(3).random(40), 0.0, 0.5, 0.999, 1 - 1e-6, 1 - 1e-9]
    for row in _rows_for_full_row_draws():
        drawn = [sample_token(row, params, _Uniforms([u])) for u in uniforms]  # type: ignore[arg-type]
        assert drawn == [_drawn_by_ordering_every_candidate(row, params, u) for u in uniforms], (row.size, params)
        assert all(np.isfinite(row[drawn]))


def test_minus_infinity_is_never_drawn() -> None:
    logits = np.array([-np.inf, 0.0, -np.inf, 0.0], dtype=np.float32)
    rng = np.random.default_rng(5)
    assert {sample_token(logits, SamplingParams(temperature=1.0), rng) for _ in range(100)} == {1, 3}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite"),
        ({"temperature": float("inf")}, "temperature must be a finite"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
    ],
)
def test_invalid_sampling_params_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("logits", "message"),
    [
        (np.array([0.0, np.nan], np.float32), "NaN"),
        (np.array([0.0, np.inf], np.float32), r"\+inf"),
        (np.array([-np.inf, -np.inf], np.float32), "-inf"),
        (np.zeros((2, 2), np.float32), "one non-empty logits row"),
        (np.zeros(0, np.float32), "one non-empty logits row"),
    ],
)
def test_bad_logits_rows_are_refused(logits: np.ndarray, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sample_token(logits, SamplingParams(), None)
    with pytest.raises(ValueError, match=message):
        sample_token(logits, SamplingParams(temperature=1.0), np.random.default_rng(0))


def test_sampling_without_a_generator_is_refused() -> None:
    with pytest.raises(ValueError, match="random generator"):
        sample_token(np.zeros(3, np.float32), SamplingParams(temperature=1.0), None)
    with pytest.raises(ValueError, match="random generator"):
        Session(SID, [1], max_new_tokens=2, sampling=SamplingParams(temperature=1.0))


# --- session: steps and stopping ---------------------------------------------------------------


def test_prefill_then_one_row_per_step_at_the_next_position() -> None:
    s = Session(SID, [5, 6, 7], max_new_tokens=3)
    first = s.next_step()
    assert first == OwnerStep(step=0, positions=(0, 1, 2), token_ids=(5, 6, 7))
    assert s.awaiting
    assert s.receive(result(0, logits_row(4))) == 4
    assert s.next_step() == OwnerStep(step=1, positions=(3,), token_ids=(4,))
    assert s.receive(result(1, logits_row(2))) == 2
    assert s.next_step() == OwnerStep(step=2, positions=(4,), token_ids=(2,))
    s.receive(result(2, logits_row(1)))
    assert s.generated == [4, 2, 1]
    assert s.finished and not s.stopped_by_token
    with pytest.raises(ValueError, match="ended"):
        s.next_step()


def test_a_long_prompt_goes_in_chunks_that_are_checked_not_sampled() -> None:
    sampling = SamplingParams(temperature=1.0)
    chunked = Session(SID, list(range(10)), max_new_tokens=2, sampling=sampling, rng=np.random.default_rng(3),
                      max_step_rows=4)  # fmt: skip
    whole = Session(SID, list(range(10)), max_new_tokens=2, sampling=sampling, rng=np.random.default_rng(3))
    steps = []
    for k in range(3):
        step = chunked.next_step()
        steps.append((step.step, step.positions))
        assert chunked.in_prefill
        token = chunked.receive(result(k, logits_row(5)))
        assert (token is None) == (k < 2) and chunked.generated == ([] if k < 2 else [token])
    assert steps == [(0, (0, 1, 2, 3)), (1, (4, 5, 6, 7)), (2, (8, 9))]
    assert chunked.next_step() == OwnerStep(step=3, positions=(10,), token_ids=(chunked.tokens[10],))
    assert not chunked.in_prefill
    whole.next_step()
    # the chunks drew nothing: the first token is the one the unchunked session draws
    assert whole.receive(result(0, logits_row(5))) == chunked.generated[0]
    bad = Session(SID, list(range(10)), max_new_tokens=2, max_step_rows=4)
    bad.next_step()
    with pytest.raises(ResultRefused, match="malformed"):  # a chunk's logits are still checked
        bad.receive(result(0, np.full(8, np.nan, dtype=np.float32)))
    with pytest.raises(ValueError, match="max_step_rows"):
        Session(SID, [1], max_new_tokens=1, max_step_rows=0)


def test_prompt_chunks_sent_together_are_answered_in_order_and_only_the_last_gives_a_token() -> None:
    s = Session(SID, list(range(10)), max_new_tokens=2, max_step_rows=4)
    sent = s.next_steps(8)  # every chunk at once: they pipeline down the route
    assert [(x.step, x.positions) for x in sent] == [(0, (0, 1, 2, 3)), (1, (4, 5, 6, 7)), (2, (8, 9))]
    assert sent[1].token_ids == (4, 5, 6, 7)
    with pytest.raises(ValueError, match="still in flight"):
        s.next_steps(1)
    with pytest.raises(ResultRefused, match="out-of-order"):  # answered in order
        s.receive(result(1, logits_row(5)))
    assert s.receive(result(0, logits_row(5))) is None
    assert s.awaiting and s.cached_positions == 4  # the later chunks are still on their way
    assert s.receive(result(1, logits_row(5))) is None and s.awaiting
    assert s.receive(result(2, logits_row(5))) == 5 and not s.awaiting
    assert s.generated == [5] and s.cached_positions == 10
    # once the prompt is in, one decode step at a time whatever the window
    assert s.next_steps(8) == [OwnerStep(step=3, positions=(10,), token_ids=(5,))]
    with pytest.raises(ValueError, match="max_steps"):
        Session(SID, [1], max_new_tokens=1).next_steps(0)


def test_a_resume_mid_prefill_numbers_the_step_past_every_chunk_sent() -> None:
    s = Session(SID, list(range(10)), max_new_tokens=2, max_step_rows=4, route_peer_ids=["A", "B"])
    s.next_steps(3)  # steps 0, 1, 2
    s.receive(result(0, logits_row(5)), "B")
    s.fail("hop A lost")
    assert s.cached_positions == 4 and s.resume_step == 3
    assert s.resume(["A2", "B"]) == 3
    assert s.next_steps(3) == [
        OwnerStep(step=3, positions=(4, 5, 6, 7), token_ids=(4, 5, 6, 7)),
        OwnerStep(step=4, positions=(8, 9), token_ids=(8, 9)),
    ]
    with pytest.raises(ResultRefused, match="stale"):  # a late answer to a chunk sent before
        s.receive(result(1, logits_row(5)), "B")
    assert s.receive(result(3, logits_row(5)), "B") is None
    assert s.receive(result(4, logits_row(6)), "B") == 6


def test_an_end_of_generation_token_stops_and_is_kept() -> None:
    s = Session(SID, [1], max_new_tokens=10, stop_tokens=[7])
    s.next_step()
    s.receive(result(0, logits_row(3)))
    assert not s.finished
    s.next_step()
    s.receive(result(1, logits_row(7)))
    assert s.finished and s.stopped_by_token
    assert s.generated == [3, 7]


def test_one_step_in_flight_at_a_time() -> None:
    s = Session(SID, [1], max_new_tokens=4)
    s.next_step()
    with pytest.raises(ValueError, match="still in flight"):
        s.next_step()


def test_seeded_sessions_are_reproducible() -> None:
    rows = [np.sin(np.arange(64) * (k + 1)).astype(np.float32) for k in range(6)]

    def run(seed: int) -> list[int]:
        s = Session(
            SID, [1, 2], max_new_tokens=6, sampling=SamplingParams(temperature=1.0, top_k=20, top_p=0.9),
            rng=np.random.default_rng(seed),
        )  # fmt: skip
        for k, row in enumerate(rows):
            s.next_step()
            s.receive(result(k, row))
        return s.generated

    assert run(11) == run(11)
    assert run(11) != run(12)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"session_id": b"short", "prompt": [1], "max_new_tokens": 1}, "16 bytes"),
        ({"session_id": SID, "prompt": [], "max_new_tokens": 1}, "no tokens"),
        ({"session_id": SID, "prompt": [1], "max_new_tokens": 0}, "max_new_tokens"),
        ({"session_id": SID, "prompt": [1], "max_new_tokens": 1, "n_vocab": 0}, "n_vocab"),
    ],
)
def test_invalid_sessions_are_refused(kwargs: dict, message: str) -> None:
    session_id = kwargs.pop("session_id")
    prompt = kwargs.pop("prompt")
    with pytest.raises(ValueError, match=message):
        Session(session_id, prompt, **kwargs)


# --- session: results that are not ours --------------------------------------------------------


def started(n_steps_done: int = 0) -> Session:
    s = Session(SID, [1, 2], max_new_tokens=10)
    for k in range(n_steps_done):
        s.next_step()
        s.receive(result(k, logits_row(3)))
    s.next_step()
    return s


@pytest.mark.parametrize(
    ("msg", "message"),
    [
        (result(2, logits_row(1)), "duplicate result for step 2"),
        (result(1, logits_row(1)), "stale result for step 1"),
        (result(4, logits_row(1)), "out-of-order result for step 4"),
        (result(3, logits_row(1), session_id=OTHER_SID), "given to session"),
        (result(3, logits_row(1), schema_version=2), "schema_version 2 is not supported"),
    ],
)
def test_results_that_do_not_answer_the_step_in_flight_change_nothing(msg: swarm_pb2.StepResult, message: str) -> None:
    s = started(3)  # steps 0..2 answered, step 3 in flight
    before = (list(s.tokens), s.step, s.state)
    with pytest.raises(ResultRefused, match=message) as caught:
        s.receive(msg)
    assert not caught.value.fatal
    assert (list(s.tokens), s.step, s.state) == before
    assert s.receive(result(3, logits_row(6))) == 6  # the real answer is still taken


def test_a_result_when_nothing_is_in_flight_is_refused() -> None:
    s = Session(SID, [1], max_new_tokens=3)
    with pytest.raises(ResultRefused, match=r"out-of-order result for step 0 .*no step in flight"):
        s.receive(result(0, logits_row(1)))
    s.next_step()
    s.receive(result(0, logits_row(1)))
    with pytest.raises(ResultRefused, match="duplicate result for step 0"):
        s.receive(result(0, logits_row(1)))


def test_a_finished_session_refuses_results() -> None:
    s = Session(SID, [1], max_new_tokens=1)
    s.next_step()
    s.receive(result(0, logits_row(1)))
    with pytest.raises(ResultRefused, match="has ended"):
        s.receive(result(1, logits_row(1)))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda m: setattr(m, "checksum", m.checksum ^ 1), "checksum"),
        (lambda m: setattr(m, "n_vocab", 9), "logits bytes for n_vocab 9"),
        (lambda m: setattr(m, "n_vocab", 0), "n_vocab is 0"),
    ],
)
def test_malformed_logits_for_the_step_in_flight_fail_the_session(mutate, message: str) -> None:
    s = started(0)  # the width is not known yet
    msg = result(0, logits_row(2))
    mutate(msg)
    with pytest.raises(ResultRefused, match=message) as caught:
        s.receive(msg)
    assert caught.value.fatal
    assert s.finished and s.failure is not None and message.split()[0] in s.failure


def test_nan_logits_and_a_changed_width_fail_the_session() -> None:
    s = started(1)  # n_vocab 8 learnt from step 0
    with pytest.raises(ResultRefused, match="n_vocab 9, expected 8"):
        s.receive(result(1, logits_row(2, n_vocab=9)))
    s = started(0)
    bad = logits_row(2)
    bad[5] = np.nan
    with pytest.raises(ResultRefused, match="NaN or inf"):
        s.receive(result(0, bad))


def test_a_hop_error_names_the_failed_peer() -> None:
    s = started(2)
    error = swarm_pb2.Error(code=swarm_pb2.Error.UNAVAILABLE, message="next hop unreachable")
    with pytest.raises(HopFailed, match="hop QmBad failed: UNAVAILABLE: next hop unreachable") as caught:
        s.receive(result(2, error=error, failed_peer_id="QmBad"))
    assert caught.value.failed_peer_id == "QmBad"
    assert s.finished and s.state == "failed"
    with pytest.raises(ResultRefused, match="has ended"):
        s.receive(result(2, logits_row(1)))


def test_fail_ends_the_session() -> None:
    s = started(0)
    s.fail("no result within 30 s")
    assert s.finished and s.failure == "no result within 30 s"
    with pytest.raises(ValueError, match="ended"):
        s.next_step()


# --- records ------------------------------------------------------------------------------------


def test_step_request_and_end_session_records() -> None:
    route = swarm_pb2.Route(
        model_sha256="ab" * 32, n_layer=30, recipe_hash="r1",
        hops=[swarm_pb2.Hop(peer_id=f"p{i}", addrs=[f"/a/{i}"], begin=b, end=e)
              for i, (b, e) in enumerate([(0, 10), (10, 20), (20, 30)])],
    )  # fmt: skip
    admission = swarm_pb2.SignedAdmission(record=b"r", signature=b"s")
    s = Session(SID, [9, 8, 7], max_new_tokens=2)
    req = s.step_request(s.next_step(), route, owner_peer_id="me", owner_addrs=["/me"], admission=admission)
    assert (req.schema_version, req.session_id, req.step, req.begin, req.end) == (1, SID, 0, 0, 10)
    assert list(req.positions) == [0, 1, 2] and list(req.token_ids) == [9, 8, 7]
    assert [h.peer_id for h in req.rest] == ["p1", "p2"]
    assert (req.owner_peer_id, list(req.owner_addrs), req.recipe_hash, req.model_sha256) == (
        "me",
        ["/me"],
        "r1",
        "ab" * 32,
    )
    assert req.checksum == zlib.crc32(np.array([9, 8, 7], "<i4").tobytes()) == token_checksum([9, 8, 7])
    assert req.sender_admission == admission
    assert not req.boundary
    end = end_session_request(SID, route, admission)
    assert end.schema_version == 1 and end.end_session.session_id == SID
    assert [h.peer_id for h in end.end_session.rest] == ["p1", "p2"]


def test_prompt_scores_come_one_row_a_step_over_the_full_row_and_penalties_count_from_output_start() -> None:
    scored: list[tuple[int, int]] = []
    session = Session(
        SID, [3, 1, 4], max_new_tokens=2, max_step_rows=1, top_k_at_least=20,
        on_prompt_scores=lambda position, row: scored.append((position, int(np.argmax(row)))),
    )  # fmt: skip
    assert session.result_top_k == 0  # every prompt token's logprob is exact
    for step in range(3):
        assert session.next_step().positions == (step,)
        session.receive(result(step, logits_row(step + 2)))
    assert scored == [(0, 2), (1, 3)]  # the last prompt row is sampled, not scored
    assert session.generated == [4]
    # a session resumed with 2 generated tokens in its prompt: the presence penalty counts them
    penalised = Session(
        SID, [0, 5, 5], max_new_tokens=1, output_start=1, sampling=SamplingParams(presence_penalty=10.0)
    )
    assert penalised.result_top_k == 0
    penalised.next_step()
    row = logits_row(5)
    row[6] = 4.0
    assert penalised.receive(result(0, row)) == 6  # 5 was generated already: 5 - 10 < 4


# --- drawn at the last hop --------------------------------------------------------------------


def test_a_token_s_uniform_depends_on_the_seed_and_its_position_only() -> None:
    assert draw_uniform(0, 0) == float.fromhex("0x1.c4415072f63b9p-1")  # SplitMix64(0)'s first output
    assert draw_uniform(5, 9) == draw_uniform(5, 9) != draw_uniform(5, 10) != draw_uniform(6, 10)
    assert all(0.0 <= draw_uniform(2**64 - 1, p) < 1.0 for p in range(200))
    with pytest.raises(ValueError, match="position"):
        draw_uniform(1, -1)
    # a session draws its token at position p with draw_uniform(seed, p)
    row = np.sin(np.arange(64)).astype(np.float32)
    params = SamplingParams(temperature=1.0)
    s = Session(SID, [1, 2, 3], max_new_tokens=2, sampling=params, draw_seed=77)
    s.next_step()
    assert s.receive(result(0, row)) == draw_token(row, params, draw_uniform(77, 3))


def _top(row: np.ndarray, k: int, drawn: int | None = None) -> TopLogits:
    top = TopLogits.from_row(row, k)
    if drawn is None:
        return top
    return TopLogits(top.ids, top.logits, top.log_sum_exp, top.n_vocab, ((drawn, float(row[drawn]) - top.log_sum_exp),))


def test_a_session_drawn_at_the_last_hop_takes_the_drawn_tokens() -> None:
    rng = np.random.default_rng(4)
    rows = [rng.standard_normal(100).astype(np.float32) * 2 for _ in range(4)]
    params = SamplingParams(temperature=0.7)  # no top-k cut: the owner cannot repeat the draw
    own = Session(SID, [1], max_new_tokens=4, sampling=params, draw_seed=9)
    drawn = Session(SID, [1], max_new_tokens=4, sampling=params, draw_seed=9)
    assert drawn.result_top_k == 0  # the full row, while the owner draws
    drawn.next_step()
    drawn.receive(result(0, rows[0]))  # the first token: the owner's draw (the node path)
    drawn.draw_at_last_hop()
    assert drawn.last_hop_draws and drawn.result_top_k == 40  # greedy's K, never the row
    own.next_step()
    own.receive(result(0, rows[0]))
    for k, row in enumerate(rows[1:], start=1):
        own.next_step()
        token = own.receive(result(k, row))
        assert token is not None
        drawn.next_step()
        # the last hop's draw: the same uniform, the same row; its result carries the top-K
        taken = drawn.receive_scores(k, lambda row=row, token=token: _top(row, 40, token), 100, None, token)
        assert taken == token
    assert drawn.generated == own.generated
    assert drawn.last_logits.logprob(own.generated[-1]) == pytest.approx(
        float(rows[-1][own.generated[-1]]) - float(np.log(np.exp(rows[-1].astype(np.float64)).sum()))
    )


def test_a_drawn_token_is_checked_where_the_top_k_covers_the_cut() -> None:
    row = np.array([3.0, 2.9, 2.8, -5.0, 0.0], dtype=np.float32)
    params = SamplingParams(temperature=1.0, top_k=3)
    s = Session(SID, [1], max_new_tokens=4, sampling=params, draw_seed=1)
    s.next_step()
    s.receive(result(0, row))
    s.draw_at_last_hop()
    s.next_step()
    honest = draw_token(TopLogits.from_row(row, 5), params, draw_uniform(1, 2))
    assert s.receive_scores(1, lambda: TopLogits.from_row(row, 5), 5, None, honest) == honest
    s.next_step()
    with pytest.raises(ResultRefused, match="the same draw from its scores gives") as refused:
        s.receive_scores(2, lambda: TopLogits.from_row(row, 5), 5, None, 3)  # outside the top-3: never drawn
    assert refused.value.fatal and s.failed
    out_of_vocabulary = Session(SID, [1], max_new_tokens=3, sampling=SamplingParams(temperature=1.0), draw_seed=1)
    out_of_vocabulary.draw_at_last_hop()  # asked before the prompt is in: from the first decode step
    assert not out_of_vocabulary.last_hop_draws and out_of_vocabulary.result_top_k == 0
    out_of_vocabulary.next_step()
    out_of_vocabulary.receive(result(0, row))  # the prompt's token: the owner's draw
    assert out_of_vocabulary.last_hop_draws and out_of_vocabulary.result_top_k == 40
    out_of_vocabulary.next_step()
    with pytest.raises(ResultRefused, match="outside the vocabulary"):
        out_of_vocabulary.receive_scores(1, lambda: TopLogits.from_row(row, 5), 5, None, 5)
    # a result without the drawn token: the owner cannot draw from the top-K alone
    missing = Session(SID, [1], max_new_tokens=3, sampling=SamplingParams(temperature=1.0), draw_seed=1)
    missing.next_step()
    missing.receive(result(0, np.arange(50, dtype=np.float32)))
    missing.draw_at_last_hop()
    missing.next_step()
    with pytest.raises(ResultRefused, match="full row"):
        missing.receive_scores(1, lambda: TopLogits.from_row(np.arange(50, dtype=np.float32), 40), 50)
    with pytest.raises(ValueError, match="only a sampled session"):
        Session(SID, [1], max_new_tokens=2).draw_at_last_hop()
    own_draws = Session(SID, [1], max_new_tokens=2, sampling=SamplingParams(temperature=1.0), draw_seed=1)
    own_draws.next_step()
    with pytest.raises(ResultRefused, match="draws its tokens itself"):
        own_draws.receive_scores(0, lambda: TopLogits.from_row(row, 5), 5, None, 0)
