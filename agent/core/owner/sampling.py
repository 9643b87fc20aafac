"""Choosing the next token from one row of logits: greedy, or temperature + top-k + top-p + min-p,
after the logit adjustments that need the session's history (penalties, ``logit_bias``).

Owns the sampling rules of a session (the owner draws, or the route's last hop draws for it
with the same rules: native/src/sampling.cpp, cross-tested in tests/test_sampling_native.py):
- temperature 0: greedy, the argmax (lowest index on ties), no randomness drawn;
- otherwise: logits / temperature, keep the ``top_k`` most likely tokens (0: all), then those
  whose probability is at least ``min_p`` times the most likely one's (0: all), then the
  smallest most-likely prefix whose probability reaches ``top_p`` (1.0: all), renormalise, and
  draw once with one uniform number in [0, 1): the caller's ``numpy.random.Generator``
  (``sample_token``) or a given one (``draw_token``);
- ``draw_uniform(seed, position)``: the uniform that draws a session's token at ``position``,
  a counter-based generator (SplitMix64) that the last hop computes identically in C++, so
  that a seed gives the same tokens whichever of the two draws;
- before either, ``adjust_logits``: ``logit_bias`` added, then llama.cpp's ``repeat_penalty``
  over the last ``repeat_last_n`` tokens of the context (prompt included), then OpenAI's
  ``frequency_penalty`` / ``presence_penalty`` over the generated tokens only (as vLLM reads
  them). These change tokens that may lie outside any top-K, and depend on the history, so a
  session with them asks for the full row and draws at the owner (``adjusts_logits``,
  ``draws_at_owner``: the last hop draws plain temperature / top-k / top-p only).

Candidates are ordered by logit, ties by token id, so the draw does not depend on how numpy
happens to order equal values.

Pure: numpy only; the random generator is an argument. Must not import agent.io.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from agent.core.wire.topk import TopLogits, result_top_k, top_k_ids

__all__ = [
    "SamplingParams",
    "adjust_logits",
    "adjusts_logits",
    "checked_draw",
    "choose_token",
    "draw_token",
    "draw_uniform",
    "drawn_seed",
    "draws_at_owner",
    "result_top_k_for",
    "sample_token",
    "sampling_candidates",
]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How a session picks tokens. ``top_k`` 0, ``top_p`` 1.0 and ``min_p`` 0 switch those cuts
    off; penalties 0 (``repeat_penalty`` 1.0) and an empty ``logit_bias`` (token id -> bias)
    leave the logits as they came. ``repeat_last_n``: -1 the whole context, 0 none."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: no cut), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty", "repeat_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.repeat_penalty <= 0:
            raise ValueError(f"repeat_penalty must be > 0 (1.0: off), got {self.repeat_penalty!r}")
        if not all(isinstance(t, int) and t >= 0 and math.isfinite(b) for t, b in self.logit_bias):
            raise ValueError("logit_bias must map token ids >= 0 to finite biases")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def adjusts_logits(params: SamplingParams) -> bool:
    """Whether ``params`` change the logits before the draw (penalties or ``logit_bias``).

    Such a session needs the full row (a bias may lift a token from outside any top-K, and a
    penalty's tokens are wherever the history put them) and the history (the tokens so far),
    so its tokens are drawn by the owner, never at the last hop: the one place that decides it.
    (A full-row session is never continued greedily by the last hop either:
    ``agent.core.owner.data_route.continuation_steps`` needs a top-K.)
    """
    return bool(
        params.logit_bias
        or params.presence_penalty
        or params.frequency_penalty
        or (params.repeat_penalty != 1.0 and params.repeat_last_n != 0)
    )


def draws_at_owner(params: SamplingParams) -> bool:
    """Whether a session's tokens must be drawn here, by its owner, rather than by a last hop
    that samples plain temperature / top-k / top-p itself: logit adjustments (they need the
    history, ``adjusts_logits``) and ``min_p`` (a cut only this module makes)."""
    return adjusts_logits(params) or params.min_p > 0


def result_top_k_for(params: SamplingParams, *, at_least: int = 0) -> int:
    """K to ask the last hop for (``agent.core.wire.topk.result_top_k``), 0 (the full row) when
    ``params`` adjust the logits (``adjusts_logits``)."""
    if adjusts_logits(params):
        return 0
    return result_top_k(params.temperature, params.top_k, at_least=at_least)


def adjust_logits(row: np.ndarray, params: SamplingParams, tokens: Sequence[int], output_start: int) -> np.ndarray:
    """``row`` (float32 ``[n_vocab]``) with ``params``' adjustments, as a new float32 row.

    ``tokens``: the context so far (prompt then generated tokens); ``tokens[output_start:]``
    are the generated ones. In llama.cpp's order: ``logit_bias`` added; ``repeat_penalty``
    for each distinct token of the last ``repeat_last_n`` (a positive logit divided by it, a
    negative one multiplied, as llama.cpp and CTRL do); then each generated token's
    ``frequency_penalty`` times its count and ``presence_penalty`` once (OpenAI's formula).

    Raises:
      ValueError: a ``logit_bias`` token is outside the row.
    """
    out = np.array(row, dtype=np.float32, copy=True)
    for token, bias in params.logit_bias:
        if token >= out.size:
            raise ValueError(f"logit_bias token {token} is outside a row of {out.size} logits")
        out[token] += np.float32(bias)
    if params.repeat_penalty != 1.0 and params.repeat_last_n != 0:
        window = tokens if params.repeat_last_n < 0 else tokens[-params.repeat_last_n :]
        seen = np.unique(np.asarray(window, dtype=np.int64))
        seen = seen[(seen >= 0) & (seen < out.size)]
        values = out[seen]
        penalty = np.float32(params.repeat_penalty)
        out[seen] = np.where(values > 0, values / penalty, values * penalty)
    if params.presence_penalty or params.frequency_penalty:
        generated = np.asarray(tokens[output_start:], dtype=np.int64)
        generated = generated[(generated >= 0) & (generated < out.size)]
        if generated.size:
            ids, counts = np.unique(generated, return_counts=True)
            out[ids] -= (counts * params.frequency_penalty + params.presence_penalty).astype(np.float32)
    return out


def choose_token(
    logits: np.ndarray | TopLogits,
    params: SamplingParams,
    uniform: float,
    tokens: Sequence[int] = (),
    output_start: int = 0,
) -> int:
    """``draw_token`` after ``adjust_logits`` when ``params`` adjust them (``tokens`` and
    ``output_start`` as there). The draw takes the same one uniform (greedy ignores it).

    Raises:
      ValueError: as ``draw_token``, or adjusting a top-K record (they need the full row).
    """
    if adjusts_logits(params):
        if isinstance(logits, TopLogits):
            raise ValueError("penalties and logit_bias need the full logits row, got only the top-K")
        logits = adjust_logits(_check_row(logits), params, tokens, output_start)
    return draw_token(logits, params, uniform)


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
    if params.min_p > 0:  # at least min_p of the peak's probability (the peak always stays)
        keep &= values >= values[0] + math.log(params.min_p)
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


_U64 = (1 << 64) - 1
#: SplitMix64 (Steele, Lea, Flood 2014; the seeding generator of xoshiro): the stream's
#: increment and the two multipliers of its finaliser
_SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
_SPLITMIX_M1 = 0xBF58476D1CE4E5B9
_SPLITMIX_M2 = 0x94D049BB133111EB


def draw_uniform(seed: int, position: int) -> float:
    """The uniform number in [0, 1) that draws a session's token at ``position``.

    The ``position + 1``-th output of a SplitMix64 stream seeded with ``seed`` (mod 2^64):
    ``z = seed + (position + 1) * 0x9E3779B97F4A7C15``, then ``z ^= z >> 30; z *= 0xBF58476D1CE4E5B9;
    z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31`` (all mod 2^64), and its top 53 bits
    over 2^53. Why counter-based: the last hop of a route draws a session's tokens for its
    owner (native/src/sampling.cpp ``draw_uniform``, the same bits), with no state to carry but
    the seed; and a token's uniform depends only on its position, so a step sent again after a
    failure, or a prompt prefilled again on a new route, draws as before.

    Raises:
      ValueError: ``position`` < 0.
    """
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    z = (seed + (position + 1) * _SPLITMIX_GAMMA) & _U64
    z = ((z ^ (z >> 30)) * _SPLITMIX_M1) & _U64
    z = ((z ^ (z >> 27)) * _SPLITMIX_M2) & _U64
    z ^= z >> 31
    return (z >> 11) * 2.0**-53


def drawn_seed(rng: np.random.Generator) -> int:
    """A draw seed (``draw_uniform``) from a generator: one 64-bit number."""
    return int(rng.integers(0, 2**64, dtype=np.uint64))


def sample_token(logits: np.ndarray | TopLogits, params: SamplingParams, rng: np.random.Generator | None) -> int:
    """The next token for one logits row ``[n_vocab]``.

    Greedy (temperature 0) needs no ``rng`` and draws nothing from it; otherwise exactly one
    uniform number is drawn from ``rng``: the token whose stretch of the candidates' cumulative
    probability (most likely first, as ``sampling_candidates`` orders them) holds it.

    Raises:
      ValueError: bad row (see ``sampling_candidates``), or a non-greedy draw without ``rng``.
    """
    if params.greedy:
        if isinstance(logits, TopLogits):
            return int(logits.ids[0])  # ordered by logit, then lowest id: the argmax
        return int(np.argmax(_check_row(logits)))
    if rng is None:
        raise ValueError(f"sampling at temperature {params.temperature} needs a random generator")
    return draw_token(logits, params, rng.random())


def draw_token(logits: np.ndarray | TopLogits, params: SamplingParams, uniform: float) -> int:
    """``sample_token`` with the uniform number given (``draw_uniform``): the token whose
    stretch of the candidates' cumulative probability holds ``uniform`` (greedy ignores it).

    native/src/sampling.cpp ``draw_token`` follows these steps operation for operation (the
    sums in the same order, numpy's pairwise sum where numpy sums): the two pick the same token
    except where ``uniform`` lies within rounding of a boundary between two tokens' stretches
    (numpy's exp and the C library's differ in the last bit of some values).

    Raises:
      ValueError: as ``sampling_candidates``, or ``uniform`` outside [0, 1).
    """
    if params.greedy:
        return sample_token(logits, params, None)
    if not 0.0 <= uniform < 1.0:
        raise ValueError(f"a uniform number in [0, 1) is needed, got {uniform!r}")
    if not isinstance(logits, TopLogits) and not 0 < params.top_k < np.asarray(logits).size:
        return _draw_from_row(_check_row(logits), params, uniform)
    ids, probs = sampling_candidates(logits, params)
    cumulative = np.cumsum(probs)
    index = int(np.searchsorted(cumulative, uniform * cumulative[-1], side="right"))
    return int(ids[min(index, ids.size - 1)])


def checked_draw(
    logits: np.ndarray | TopLogits, params: SamplingParams, uniform: float, drawn: int, n_vocab: int
) -> int:
    """``drawn``, the token a route's last hop drew for the owner with ``params`` and ``uniform``,
    once it is one that draw can pick: in the vocabulary and, where ``logits`` cover the draw
    (the whole row, or a top-K that holds the top-k cut), the token ``draw_token`` picks. A draw
    the owner cannot repeat (no top-k cut, a top-K short of the row) is taken as the last hop's
    logits are.

    Raises:
      ValueError: ``drawn`` is outside the vocabulary, or not the token the same draw gives.
    """
    if not 0 <= drawn < n_vocab:
        raise ValueError(f"the drawn token {drawn} is outside the vocabulary of {n_vocab}")
    repeatable = not isinstance(logits, TopLogits) or logits.k >= logits.n_vocab or 0 < params.top_k <= logits.k
    if repeatable and (own := draw_token(logits, params, uniform)) != drawn:
        raise ValueError(f"the last hop drew token {drawn}, the same draw from its scores gives {own}")
    return drawn


#: ``_draw_from_row`` orders a full row's candidates a stretch at a time: first those whose
#: logit / temperature is within the first of these of the peak (a weight of at least e^-6 of
#: the peak's), then within the next, and so on. Beyond 16 the weights left add up to at most
#: n_vocab * e^-16 of the peak's (0.5 % for 49,152 tokens): that few draws order the rest.
_STRETCH_DROPS = (6.0, 10.0, 16.0, 24.0, math.inf)


def _draw_from_row(row: np.ndarray, params: SamplingParams, uniform: float) -> int:
    """``sample_token`` over a whole row with no top-k cut, without ordering the whole row.

    The draw needs the candidates in order only up to where their cumulative weight passes
    the uniform's share of the total (or ``top_p``'s): a stretch of the most likely at a time
    is taken out (those within ``_STRETCH_DROPS`` of the peak, O(n)) and ordered. On SmolLM2's
    rows at temperature 1 the tokens within 8 of the peak, 1 to 505 of them, hold at least 96 %
    of the weight, so a draw seldom orders more than two stretches. Ordering all 49,152 logits
    took 6.4 ms a token, the owner's whole step at temperature 1 with no top-k (the relay's
    default). The weights (exp of logit / temperature less the peak) and their running sums are
    the ones ``sampling_candidates`` builds; only the total is summed in token order, so a draw
    can differ from ordering the whole row only where the uniform falls within the sums'
    rounding (a few ulps a term) of a boundary between two tokens."""
    scaled = row.astype(np.float64) / params.temperature
    finite = np.isfinite(scaled)  # -inf is never drawn (_check_row: not all of them)
    if params.min_p > 0:  # as sampling_candidates: at least min_p of the peak's probability
        finite &= scaled >= float(scaled[finite].max()) + math.log(params.min_p)
    candidates = None if finite.all() else np.flatnonzero(finite)
    values = scaled if candidates is None else scaled[candidates]
    peak = float(values.max())
    weights = np.exp(values - peak)
    total = float(weights.sum())
    # top_p: the smallest prefix whose weight reaches top_p of the total is kept, and the draw
    # is over its weight; without it the draw is over the total
    threshold, side = (params.top_p * total, "left") if params.top_p < 1.0 else (uniform * total, "right")
    ordered: list[np.ndarray] = []  # candidate indices (into values) in draw order, stretch by stretch
    sums: list[np.ndarray] = []  # their running sums
    running = 0.0
    upper = math.inf  # every candidate at or above this is ordered already
    for drop in _STRETCH_DROPS:
        # all of a stretch lies above every candidate left, so stretches follow in draw order
        lower = peak - drop
        taken = np.flatnonzero((values >= lower) & (values < upper))
        upper = lower
        if not taken.size:
            continue
        taken = taken[np.lexsort((taken, -values[taken]))]  # by logit descending, then token id
        running_sums = np.cumsum(np.concatenate(([running], weights[taken])))[1:]
        ordered.append(taken)
        sums.append(running_sums)
        running = float(running_sums[-1])
        if running > threshold or (side == "left" and running == threshold):
            break
    order = np.concatenate(ordered)
    cumulative = np.concatenate(sums)
    if params.top_p < 1.0:
        cut = min(int(np.searchsorted(cumulative, threshold, side="left")) + 1, order.size)
        cumulative = cumulative[:cut]
        index = int(np.searchsorted(cumulative, uniform * cumulative[-1], side="right"))
        chosen = int(order[min(index, cut - 1)])
    else:
        index = int(np.searchsorted(cumulative, threshold, side="right"))
        chosen = int(order[min(index, order.size - 1)])
    return chosen if candidates is None else int(candidates[chosen])
