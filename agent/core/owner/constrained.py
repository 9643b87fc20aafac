"""Where and from what a constrained session draws its tokens: the rules in one place.

A session under a grammar (``agent.core.owner.grammar.TokenConstraint``: structured output,
forced tool calls) draws every token at the owner, from scores masked by the grammar:
- ``draw_plan``: which scores the last hop sends and who draws. A constrained session asks for
  the full row every step and draws at the owner; the last hop never draws for it (no greedy
  continuation, no draw at the last hop), since the mask must apply to every token;
- ``constrained_draw``: the token drawn from the allowed ones (greedy: the likeliest allowed
  token, lowest id on ties, found among the allowed ids without copying the row);
- ``masked_scores``: the scores a draw may use once the grammar's mask is applied: the full
  row with refused tokens at -inf, or the top-K entries the grammar allows; None when it
  refuses every one of a top-K (then only the full row can say what comes next).

Why full rows for constrained sessions rather than a top-K with a full row on a miss: a miss
is only known once the step's result is in, and asking for the same step's full row again
would cost a second round trip over the route; a full row costs n_vocab * 4 bytes a step on
the last hop's link instead (measured in ``bench/structured.py``).

Pure: numpy only. Must not import trio, sockets, clocks or agent.io.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from agent.core.owner.sampling import SamplingParams, draw_token, draws_at_owner
from agent.core.wire.topk import TopLogits

__all__ = ["DrawPlan", "TokenMask", "constrained_draw", "draw_plan", "masked_scores"]


class TokenMask(Protocol):
    """A grammar a session's tokens keep to (``agent.core.owner.grammar.TokenConstraint``)."""

    def allowed(self) -> np.ndarray: ...

    def accept(self, token: int) -> None: ...

    def rollback(self, tokens: int) -> None: ...


@dataclasses.dataclass(frozen=True)
class DrawPlan:
    """``result_top_k``: what the last hop sends (0: the full row); ``continuation``: whether
    the last hop may send the next greedy step itself (the owner does not see each draw);
    ``at_owner``: whether every draw must be the owner's (a grammar, or what
    ``agent.core.owner.sampling.draws_at_owner`` keeps there), never a last hop's."""

    result_top_k: int
    continuation: bool
    at_owner: bool


def draw_plan(*, constrained: bool, sampling: SamplingParams, result_top_k: int) -> DrawPlan:
    """The draw plan of a session: ``result_top_k`` is what an unconstrained session would ask
    for (``agent.core.owner.sampling.result_top_k_for``). The one place that says where a
    session's tokens are drawn."""
    if constrained:
        return DrawPlan(result_top_k=0, continuation=False, at_owner=True)
    return DrawPlan(
        result_top_k=result_top_k,
        continuation=sampling.greedy and result_top_k >= 1,
        at_owner=draws_at_owner(sampling),
    )


def masked_scores(scores: np.ndarray | TopLogits, allowed: np.ndarray) -> np.ndarray | TopLogits | None:
    """``scores`` with only the tokens ``allowed`` (a bool mask ``[n_vocab]``) left to draw.

    A full row comes back as a float32 copy with refused tokens at -inf; a top-K as the
    entries the grammar allows (same order, same log-sum-exp, so logprobs stay the model's),
    or None when it allows none of them.

    Raises:
      ValueError: the mask's width is not the row's, or it allows no token at all.
    """
    if not allowed.any():
        raise ValueError("the grammar allows no token here")
    if isinstance(scores, TopLogits):
        if allowed.size != scores.n_vocab:
            raise ValueError(f"a mask of {allowed.size} tokens for a vocabulary of {scores.n_vocab}")
        keep = allowed[scores.ids]
        if not keep.any():
            return None
        return TopLogits(
            ids=scores.ids[keep],
            logits=scores.logits[keep],
            log_sum_exp=scores.log_sum_exp,
            n_vocab=scores.n_vocab,
        )
    row = np.asarray(scores)
    if allowed.size != row.size:
        raise ValueError(f"a mask of {allowed.size} tokens for a row of {row.size}")
    return np.where(allowed, row, np.float32(-np.inf)).astype(np.float32, copy=False)


def constrained_draw(
    scores: np.ndarray | TopLogits, allowed: np.ndarray, params: SamplingParams, uniform: float
) -> int | None:
    """The token drawn from ``scores`` among those ``allowed`` with the step's ``uniform``: as
    ``draw_token`` draws from ``masked_scores``, or None when a top-K holds no allowed token
    (the full row is needed).

    Raises:
      ValueError: as ``masked_scores``.
    """
    if params.greedy and not isinstance(scores, TopLogits):
        ids = np.flatnonzero(allowed)
        if ids.size == 0:
            raise ValueError("the grammar allows no token here")
        row = np.asarray(scores)
        if allowed.size != row.size:
            raise ValueError(f"a mask of {allowed.size} tokens for a row of {row.size}")
        return int(ids[int(np.argmax(row[ids]))])  # ids ascending: the lowest id among equal logits
    masked = masked_scores(scores, allowed)
    return None if masked is None else draw_token(masked, params, uniform)
