"""Top-K logits: what the last hop returns instead of the full row, and what it is exact for.

Owns:
- ``DEFAULT_RESULT_TOP_K`` (40, llama.cpp's default top_k) and ``result_top_k``: how many the
  owner asks for: greedy and top-k sampling get ``max(top_k, default, extra)``; sampling with
  no top-k cut (temperature > 0, top_k 0) needs the full row (0);
- ``select_top_k``: the K most likely tokens of a row, most likely first, ties broken by the
  lowest token id (the rule ``agent.core.owner.sampling`` uses, so the K set is exactly the top-K a
  full-row sampler would keep), and the row's log-sum-exp (float64);
- ``TopLogits``: that selection as a record (``from_row``, the full row kept as it is when K
  covers the vocabulary is not needed: a full row is just an ndarray).

Exact for: greedy (the first entry is the row's argmax, lowest id on ties); top-k sampling
with k <= K (the first k entries are the full row's top-k, same values, same order, so the
same draw picks the same token); top-p after such a top-k; log-probabilities (logit - lse)
of the K tokens. Not available: anything about a token outside the K (its logit is only
known to be <= the K-th), so an owner that needs those asks for the full row.

Pure: numpy. Must not import agent.io.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

__all__ = [
    "DEFAULT_RESULT_TOP_K",
    "WORKER_GRAPH_LOG_SUM_EXP_BOUND",
    "WORKER_LOG_SUM_EXP_BOUND",
    "TopLogits",
    "log_sum_exp",
    "result_top_k",
    "select_top_k",
    "top_k_ids",
]

DEFAULT_RESULT_TOP_K = 40

#: The native worker selects the top-K itself (``protocol/worker.proto``, SequenceInput.top_k):
#: its ids and logits equal ``select_top_k`` of the row bit for bit, its log-sum-exp (double,
#: max-shifted, numpy's pairwise sum) equals ``log_sum_exp`` of the row within this absolute
#: bound: numpy may use a SIMD exp that differs from libm's in the last bits
#: (tests/test_worker_api.py checks it on SmolLM2's rows).
WORKER_LOG_SUM_EXP_BOUND = 1e-9

#: A worker that selects the top-K inside llama.cpp's graph (``--top-k-in-graph``, on by
#: default where the logits come from an accelerator) gives the same ids and logits (ids of a
#: K-th value tied past K excepted: the backend's top-k keeps any of them), but its
#: log-sum-exp comes from the backend's float32 softmax: within this absolute bound of
#: ``log_sum_exp`` (tests/test_worker_top_k_in_graph.py on SmolLM2 and Gemma-3 rows).
WORKER_GRAPH_LOG_SUM_EXP_BOUND = 1e-4

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")


def result_top_k(temperature: float, top_k: int, *, default: int = DEFAULT_RESULT_TOP_K, at_least: int = 0) -> int:
    """K to ask the last hop for: 0 (the full row) when sampling with no top-k cut."""
    if temperature > 0 and top_k == 0:
        return 0
    return max(top_k, default, at_least, 1)


def top_k_ids(row: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest values of ``row`` (every value above the k-th, then the
    lowest indices among those equal to it), unordered. O(n)."""
    n = row.size
    if k >= n:
        return np.arange(n)
    kth = -np.partition(-row, k - 1)[k - 1]
    above = np.flatnonzero(row > kth)
    return np.concatenate([above, np.flatnonzero(row == kth)[: k - above.size]])


def log_sum_exp(row: np.ndarray) -> float:
    """``log(sum(exp(row)))`` in float64 (-inf entries contribute nothing)."""
    values = np.asarray(row, dtype=np.float64)
    peak = float(values.max())
    if not math.isfinite(peak):
        return peak
    return peak + math.log(float(np.exp(values - peak).sum()))


def select_top_k(row: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, float]:
    """``(ids int32, logits float32, log_sum_exp)``: the ``min(k, n)`` most likely entries of
    ``row``, ordered by logit descending then id ascending.

    Raises:
      ValueError: ``k`` < 1, or ``row`` is not one non-empty row.
    """
    values = np.asarray(row, dtype=_F32)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"top-k needs one non-empty row, got shape {values.shape}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    ids = top_k_ids(values, k)
    picked = values[ids]
    order = np.lexsort((ids, -picked))
    ids = ids[order]
    return ids.astype(_I32), values[ids], log_sum_exp(values)


@dataclasses.dataclass(frozen=True)
class TopLogits:
    """The K most likely tokens of one row of ``n_vocab`` logits (see the module doc).

    ``ids`` int32 ``[K]`` and ``logits`` float32 ``[K]``, most likely first, ties by lowest id;
    ``log_sum_exp`` over the whole row (float64).
    """

    ids: np.ndarray
    logits: np.ndarray
    log_sum_exp: float
    n_vocab: int
    #: ``(token, logprob)`` known beyond the K: the token a last hop drew for its owner
    #: (worker.proto ``DataResult.drawn_token``), which a draw with no top-k cut may take from
    #: outside them
    beyond: tuple[tuple[int, float], ...] = ()

    @classmethod
    def from_row(cls, row: np.ndarray, k: int) -> TopLogits:
        ids, logits, lse = select_top_k(row, k)
        return cls(ids, logits, lse, int(np.asarray(row).size))

    @property
    def k(self) -> int:
        return int(self.ids.size)

    def check(self) -> None:
        """Raises ValueError unless the record is well formed (as received from a peer).

        On Python lists: for the K of a reply (tens) that is ~4x faster than numpy calls,
        and it runs once a decode step (the values compare exactly as float32 do)."""
        if self.ids.ndim != 1 or self.ids.shape != self.logits.shape or self.ids.size == 0:
            raise ValueError(f"top-k ids {self.ids.shape} and logits {self.logits.shape} do not match")
        if self.ids.size > self.n_vocab:
            raise ValueError(f"{self.ids.size} top-k entries for a vocabulary of {self.n_vocab}")
        ids, values = self.ids.tolist(), self.logits.tolist()
        if min(ids) < 0 or max(ids) >= self.n_vocab:
            raise ValueError(f"top-k token ids must be in [0, {self.n_vocab})")
        if len(set(ids)) != len(ids):
            raise ValueError("top-k token ids repeat")
        if not all(map(math.isfinite, values)) or not math.isfinite(self.log_sum_exp):
            raise ValueError("the top-k logits or their log-sum-exp are not finite")
        for a, b, i, j in zip(values, values[1:], ids, ids[1:]):
            if not (a > b or (a == b and i < j)):
                raise ValueError("top-k entries are not ordered by logit (descending), then token id")
        if self.log_sum_exp < values[0]:
            raise ValueError("the log-sum-exp is below the largest logit")

    def logprob(self, token: int) -> float:
        """``logit - log_sum_exp`` of ``token``. Raises ValueError for a token outside the K."""
        hits = np.flatnonzero(self.ids == token)
        if hits.size == 0:
            for known, logprob in self.beyond:
                if known == token:
                    return logprob
            raise ValueError(f"token {token} is not among the top {self.k}: its log-probability is unknown here")
        return float(np.float64(self.logits[hits[0]]) - self.log_sum_exp)
