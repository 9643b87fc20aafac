"""Speculative decoding's owner half: drafts from the context's n-grams, the draft length that
adapts to what was accepted, and a session's verification steps (every kept draft is the
argmax of the row before it; the rows a verification rejected are cut away by the next step)."""

from __future__ import annotations

import numpy as np
import pytest

from agent.core.owner.session import ResultRefused, Session
from agent.core.owner.speculation import DraftIndex, DraftLength
from agent.core.wire.topk import TopLogits

pytestmark = pytest.mark.unit

SID = bytes(range(16))
N_VOCAB = 50


def test_a_draft_is_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    index = DraftIndex(min_ngram=2, max_ngram=3)
    index.extend([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3])
    # the suffix (1, 2, 3) occurred at the start: 4 and 5 followed it (not (2, 3) -> 7, later but shorter)
    assert index.draft(2) == (4, 5)
    assert index.draft(10) == (4, 5, 9, 2, 3, 7, 8, 1, 2, 3)
    index.extend([6])
    assert index.draft(3) == ()  # (3, 6) and (2, 3, 6) never occurred before
    assert index.draft(0) == ()


def test_the_context_s_own_suffix_is_not_its_own_match_and_the_index_follows_growth() -> None:
    index = DraftIndex(min_ngram=2, max_ngram=2)
    index.sync([5, 6])
    assert index.draft(4) == ()
    index.sync([5, 6, 7, 5, 6])
    assert index.draft(4) == (7, 5, 6)
    with pytest.raises(ValueError, match="shrank"):
        index.sync([5])
    with pytest.raises(ValueError, match="min_ngram"):
        DraftIndex(min_ngram=3, max_ngram=2)


def test_the_draft_length_is_the_one_of_the_most_tokens_a_second() -> None:
    length = DraftLength(8)
    assert length.wanted(100) == 8 and length.wanted(3) == 3  # nothing measured: a draft measures it
    assert length.wanted(0) == 0
    # a WAN on a CPU: 60 ms a continued token, 70 ms the owner's trip, 20 ms each row more
    length.trip(1, 0.060, by_owner=False)
    length.trip(1, 0.070, by_owner=True)
    length.trip(5, 0.150, by_owner=True)
    assert length.plain_s == 0.060 and length.verify_s == 0.070 and length.row_s == pytest.approx(0.020)
    for _ in range(10):
        length.observe(6, 3)  # copying in part: drafts kept halfway
    assert 0.7 < length.acceptance < 0.8
    assert length.wanted(100) in (2, 3)  # rows cost: not the longest draft
    for _ in range(10):
        length.observe(6, 6)  # copying: every draft kept
    assert length.wanted(100) == 8
    length.row_s = 0.0  # a GPU: a row more is nearly free
    assert length.wanted(100) == 8
    length.row_s = 0.020
    for _ in range(20):
        length.observe(4, 0)  # free writing: none kept
    assert length.acceptance < 0.5 and length.wanted(100) == 0  # no draft beats the last hop's own steps
    with pytest.raises(ValueError):
        length.observe(2, 3)


def test_runs_without_a_draft_grow_while_drafts_fail_and_start_again_after_one_is_kept() -> None:
    length = DraftLength(8, pause_tokens=4, max_pause_tokens=16)
    assert length.plain_run() == 4
    length.observe(3, 0)
    assert length.plain_run() == 8
    length.observe(3, 0)
    length.observe(3, 0)
    assert length.plain_run() == 16  # (at most max_pause_tokens)
    length.observe(3, 1)
    assert length.plain_run() == 4
    length.no_match()  # none matched: the text is not copying, as after a failed draft
    assert length.plain_run() == 8


def _top(best: int, k: int = 40) -> TopLogits:
    row = np.full(N_VOCAB, -5.0, dtype=np.float32)
    row[best] = 3.0
    return TopLogits.from_row(row, k)


def _decoding(prompt: list[int], max_new_tokens: int = 20, stop_tokens: tuple[int, ...] = ()) -> Session:
    """A greedy session whose prompt is in and whose first token (9) was taken."""
    s = Session(SID, prompt, max_new_tokens=max_new_tokens, stop_tokens=stop_tokens, n_vocab=N_VOCAB, top_k_at_least=4)
    step = s.next_step()
    assert s.receive_scores(step.step, lambda: _top(9), N_VOCAB) == 9
    return s


def test_a_verification_keeps_the_drafts_the_model_chose_and_its_own_next_token() -> None:
    s = _decoding([1, 2, 3])
    assert s.can_speculate
    step = s.next_verify_step([10, 11, 12])
    assert step.positions == (3, 4, 5, 6) and step.token_ids == (9, 10, 11, 12)
    assert step.every_row and not step.rewind
    # rows: after 9 -> 10 (kept), after 10 -> 11 (kept), after 11 -> 20 (not 12: the model's own)
    taken = s.receive_rows(step.step, lambda: [_top(10), _top(11), _top(20), _top(30)], N_VOCAB)
    assert taken == [10, 11, 20]
    assert s.tokens == [1, 2, 3, 9, 10, 11, 20]
    assert s.last_verified == (3, 2) and (s.drafted_tokens, s.accepted_tokens) == (3, 2)
    assert [t for t, _ in s.taken] == taken
    # the route holds positions 3..6; 6 held the rejected 12: the next step rewinds to 6
    assert s.cached_positions == 6
    plain = s.next_step()
    assert plain.positions == (6,) and plain.token_ids == (20,) and plain.rewind and not plain.every_row
    assert s.receive_scores(plain.step, lambda: _top(21), N_VOCAB) == 21
    assert not s.next_step().rewind


def test_a_wholly_accepted_draft_gives_one_token_more_and_no_rewind() -> None:
    s = _decoding([1, 2, 3])
    step = s.next_verify_step([10, 11])
    assert s.receive_rows(step.step, lambda: [_top(10), _top(11), _top(12)], N_VOCAB) == [10, 11, 12]
    following = s.next_verify_step([13])
    assert following.positions == (6, 7) and not following.rewind


def test_a_stop_token_or_the_budget_ends_a_verification_where_it_comes() -> None:
    s = _decoding([1, 2, 3], stop_tokens=(11,))
    step = s.next_verify_step([10, 11, 12])
    assert s.receive_rows(step.step, lambda: [_top(10), _top(11), _top(12), _top(13)], N_VOCAB) == [10, 11]
    assert s.finished and s.stopped_by_token
    budget = _decoding([1, 2, 3], max_new_tokens=3)  # 9 taken: room for 2 more, so a draft of 1
    step = budget.next_verify_step([10, 11, 12])
    assert step.token_ids == (9, 10)
    assert budget.receive_rows(step.step, lambda: [_top(10), _top(11)], N_VOCAB) == [10, 11]
    assert budget.finished and budget.generated == [9, 10, 11]


def test_a_verification_result_with_the_wrong_rows_fails_the_session() -> None:
    s = _decoding([1, 2, 3])
    step = s.next_verify_step([10, 11])
    with pytest.raises(ResultRefused, match="2 rows of top-K for a step of 3 rows") as refused:
        s.receive_rows(step.step, lambda: [_top(10), _top(11)], N_VOCAB)
    assert refused.value.fatal and s.failed
    other = _decoding([1, 2, 3])
    step = other.next_verify_step([10])
    with pytest.raises(ResultRefused, match="duplicate result") as stale:
        other.receive_rows(step.step - 1, lambda: [_top(10), _top(11)], N_VOCAB)
    assert not stale.value.fatal and other.awaiting


def test_only_a_plain_greedy_session_speculates() -> None:
    from agent.core.owner.sampling import SamplingParams

    sampled = Session(SID, [1, 2], max_new_tokens=8, sampling=SamplingParams(temperature=0.7), draw_seed=1)
    assert not sampled.may_speculate
    penalised = Session(SID, [1, 2], max_new_tokens=8, sampling=SamplingParams(repeat_penalty=1.3), top_k_at_least=4)
    assert not penalised.may_speculate
    greedy = Session(SID, [1, 2], max_new_tokens=8, top_k_at_least=4)
    assert greedy.may_speculate and not greedy.can_speculate  # (the prompt is not in yet)
    with pytest.raises(ValueError, match="no verification step now"):
        greedy.next_verify_step([3])


def test_only_a_route_that_can_cut_rows_away_speculates() -> None:
    from agent.core.owner.speculation import rewinds

    assert rewinds("llama") and rewinds("gemma3")
    assert not rewinds("deepseek4")  # its compressor state cannot be cut back
    assert not rewinds("")  # not known: not assumed


def test_a_run_drafts_only_when_the_next_step_is_the_owner_s_and_no_run_without_drafts_is_on() -> None:
    from agent.core.owner.speculation import Drafting

    s = _decoding([5, 6, 7, 5, 6])  # 9 taken: (6, 9) has no earlier occurrence
    drafting = Drafting(4)
    assert drafting.draft(s, continued=True) == ()  # the last hop sent the next step already
    assert drafting.draft(s, continued=False) == ()  # no match: a run without drafts follows
    assert drafting.plain_run(s) == 8  # (the run grew: no match counts as a failed look)
    assert drafting.plain_run(s) == 0  # a run is on
    step = s.next_step()
    assert drafting.took(s, step, 0.05, by_owner=True) == (0, 0)
    assert drafting.length.verify_s == 0.05
