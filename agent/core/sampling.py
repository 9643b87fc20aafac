"""Choosing the next token from one row of logits: greedy, or temperature + top-k + top-p.

Owns the sampling rules of a session owner (the only party that samples, DESIGN.md):
- temperature 0: greedy, the argmax (lowest index on ties), no randomness drawn;
- otherwise: logits / temperature, keep the ``top_k`` most likely tokens (0: all), then the
  smallest most-likely prefix whose probability reaches ``top_p`` (1.0: all), renormalise, and
  draw once from the caller's ``numpy.random.Generator`` (a seed makes a run reproducible).

Candidates are ordered by logit, ties by token id, so the draw does not depend on how numpy
happens to order equal values.

Pure: numpy only; the random generator is an argument. Must not import agent.io.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .topk import TopLogits, top_k_ids

__all__ = ["SamplingParams", "sample_token", "sampling_candidates"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How a session picks tokens. ``top_k`` 0 and ``top_p`` 1.0 switch those cuts off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: no cut), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check_row(logits: np.ndarray) -> np.ndarray:
    row = np.asarray(logits)
    if row.ndim != 1 or row.size == 0:
        raise ValueError(f"sampling needs one non-empty logits row, got shape {row.shape}")
    if np.isnan(row).any() or np.isposinf(row).any():
        raise ValueError("the logits hold NaN or +inf")
    if np.isneginf(row).all():
        raise ValueError("every logit is -inf: no token can be chosen")
    return row


def _top_k_of(top: TopLogits, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The first ``top_k`` entries of a top-K record (already in candidate order), as float64
    logits over temperature: the same numbers ``sampling_candidates`` gets from a full row."""
    k = params.top_k
    if k == 0 and top.k < top.n_vocab:
        raise ValueError(f"sampling without a top-k cut needs the full row, got only the top {top.k}")
    if k > top.k and top.k < top.n_vocab:
        raise ValueError(f"top_k {k} needs at least {k} logits, got the top {top.k}")
    n = min(k, top.k) if k else top.k
    return top.ids[:n].astype(np.int64), top.logits[:n].astype(np.float64) / params.temperature


def sampling_candidates(logits: np.ndarray | TopLogits, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The tokens a draw can pick and their probabilities (summing to 1), most likely first.

    ``logits``: the full row, or the top-K a last hop returned (exact for ``top_k`` <= K).

    Raises:
      ValueError: ``params`` is greedy, the row is empty, holds NaN / +inf, or is all -inf, or
        a top-K record has fewer entries than ``top_k`` (or ``top_k`` is 0).
    """
    if params.greedy:
        raise ValueError("greedy sampling has no candidate distribution")
    if isinstance(logits, TopLogits):
        ids, values = _top_k_of(logits, params)
    else:
        row = _check_row(logits).astype(np.float64) / params.temperature
        k = params.top_k
        # O(n): everything above the k-th largest logit, then the lowest ids among its ties
        ids = top_k_ids(row, k) if 0 < k < row.size else np.arange(row.size)
        values = row[ids]
        order = np.lexsort((ids, -values))  # by logit descending, then token id ascending
        ids = ids[order]
        values = values[order]
    keep = np.isfinite(values)
    ids, values = ids[keep], values[keep]
    probs = np.exp(values - values[0])
    probs /= probs.sum()
    if params.top_p < 1.0:
        cumulative = np.cumsum(probs)
        # the smallest prefix whose mass reaches top_p (always at least one token)
        cut = int(np.searchsorted(cumulative, params.top_p, side="left")) + 1
        ids, probs = ids[:cut], probs[:cut]
        probs = probs / probs.sum()
    return ids, probs


def sample_token(logits: np.ndarray | TopLogits, params: SamplingParams, rng: np.random.Generator | None) -> int:
    """The next token for one logits row ``[n_vocab]``.

    Greedy (temperature 0) needs no ``rng`` and draws nothing from it; otherwise exactly one
    uniform number is drawn from ``rng``.

    Raises:
      ValueError: bad row (see ``sampling_candidates``), or a non-greedy draw without ``rng``.
    """
    if params.greedy:
        if isinstance(logits, TopLogits):
            return int(logits.ids[0])  # ordered by logit, then lowest id: the argmax
        return int(np.argmax(_check_row(logits)))
    if rng is None:
        raise ValueError(f"sampling at temperature {params.temperature} needs a random generator")
    ids, probs = sampling_candidates(logits, params)
    cumulative = np.cumsum(probs)
    index = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    return int(ids[min(index, ids.size - 1)])
