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


def sampling_candidates(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The tokens a draw can pick and their probabilities (summing to 1), most likely first.

    Raises:
      ValueError: ``params`` is greedy, or the row is empty, holds NaN / +inf, or is all -inf.
    """
    if params.greedy:
        raise ValueError("greedy sampling has no candidate distribution")
    row = _check_row(logits).astype(np.float64) / params.temperature
    n = row.size
    k = params.top_k
    if 0 < k < n:
        # O(n): the k-th largest logit, everything above it, then the lowest ids among its ties
        kth = -np.partition(-row, k - 1)[k - 1]
        above = np.flatnonzero(row > kth)
        ids = np.concatenate([above, np.flatnonzero(row == kth)[: k - above.size]])
    else:
        ids = np.arange(n)
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


def sample_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | None) -> int:
    """The next token for one logits row ``[n_vocab]``.

    Greedy (temperature 0) needs no ``rng`` and draws nothing from it; otherwise exactly one
    uniform number is drawn from ``rng``.

    Raises:
      ValueError: bad row (see ``sampling_candidates``), or a non-greedy draw without ``rng``.
    """
    if params.greedy:
        return int(np.argmax(_check_row(logits)))
    if rng is None:
        raise ValueError(f"sampling at temperature {params.temperature} needs a random generator")
    ids, probs = sampling_candidates(logits, params)
    cumulative = np.cumsum(probs)
    index = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    return int(ids[min(index, ids.size - 1)])
