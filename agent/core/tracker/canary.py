"""Canary checks: the tracker's decisions about checking what nodes compute.

A canary is a short generation the tracker's verifier (``agent.io.tracker.verifier``) runs
through one served range as if it were one hop of an ordinary session: random prompt tokens,
then a few decode steps, each step's output compared with a trusted reference (the tracker's
own worker of that range, from its copy of the registered GGUF). Ranges are bit-exact (a
split model gives the unsplit model's bytes, whatever the batch), so an honest node of the
reference's recipe returns the same bytes; across recipes (another backend) a declared bound
applies instead. See docs/INTEGRITY.md for why, and what a canary cannot see.

Owns:
- ``CanaryPolicy``: the rates, sizes and limits (every one a config field);
- ``CanarySchedule``: which served range is checked next and when: a newly READY range at
  once (and, with ``gate_new_ranges``, it is not routed until it passes), then again after a
  random delay (``next_delay_s``: uniform in [0.5, 1.5] x ``interval_s``, so a check comes at
  most 1.5 intervals after the last and cannot be predicted); ranges a spot-check report names
  at once (``prioritise``);
- ``plan_canary``: what one canary sends (random tokens, lengths, K);
- comparing outputs (``compare_rows``, ``compare_scores``) into an ``OutputMismatch``, the
  evidence an operator sees (which step, what was compared, expected vs returned sha256);
- ``after_failure``: a failed check withdraws the range; ``refuse_after_failures`` failures
  refuse the node.

Pure: numpy and the core's records; time (``now_s``) and random generators come in as
arguments. Must not import trio, grpc, libp2p, sockets, clocks or agent.io.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import math
import struct
from collections.abc import Iterable

import numpy as np

from agent.core.wire.topk import DEFAULT_RESULT_TOP_K, TopLogits

__all__ = [
    "CanaryPlan",
    "CanaryPolicy",
    "CanarySchedule",
    "FailureAction",
    "OutputMismatch",
    "RangeKey",
    "after_failure",
    "compare_rows",
    "compare_scores",
    "next_delay_s",
    "plan_canary",
    "scores_bytes",
]

#: (peer id, model sha256, begin, end): one range served by one node.
RangeKey = tuple[str, str, int, int]

_F32 = np.dtype("<f4")
_I32 = np.dtype("<i4")


@dataclasses.dataclass(frozen=True)
class CanaryPolicy:
    """How often and how the tracker checks served ranges.

    Fields:
      interval_s: mean time between two checks of one served range; each delay is drawn
        uniformly from [0.5, 1.5] x this (so the longest gap is 1.5 x). A newly READY range
        is checked at once.
      min_prompt_rows, max_prompt_rows: the canary's prompt length, drawn uniformly.
      min_decode_steps, max_decode_steps: decode steps after the prompt, drawn uniformly.
      result_top_k: the K a canary asks the last range for (what greedy owners ask:
        ``agent.core.wire.topk.DEFAULT_RESULT_TOP_K``); 0 = the full row.
      gate_new_ranges: a range that became READY is routed only once it passed a check.
      refuse_after_failures: this many failed checks (over its registrations) refuse a node;
        fewer withdraw the failing range (not assigned to the node again until it registers
        anew, and checked before it is routed again).
      retry_s: a check that could not conclude (the node refused the step, was busy, or did
        not answer in time) is tried again after this long.
      cross_recipe_rel_error: the bound for a node whose recipe differs from the reference's
        (another backend): relative RMS error of its output against the reference's. Within
        one recipe the bytes must be equal.
    """

    interval_s: float = 300.0
    min_prompt_rows: int = 1
    max_prompt_rows: int = 32
    min_decode_steps: int = 1
    max_decode_steps: int = 4
    result_top_k: int = DEFAULT_RESULT_TOP_K
    gate_new_ranges: bool = True
    refuse_after_failures: int = 2
    retry_s: float = 5.0
    cross_recipe_rel_error: float = 0.02

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")
        if not 1 <= self.min_prompt_rows <= self.max_prompt_rows:
            raise ValueError(
                f"prompt rows must satisfy 1 <= min <= max, got {self.min_prompt_rows}, {self.max_prompt_rows}"
            )
        if not 0 <= self.min_decode_steps <= self.max_decode_steps:
            raise ValueError(
                f"decode steps must satisfy 0 <= min <= max, got {self.min_decode_steps}, {self.max_decode_steps}"
            )
        if self.result_top_k < 0:
            raise ValueError(f"result_top_k must be >= 0, got {self.result_top_k}")
        if self.refuse_after_failures < 1:
            raise ValueError(f"refuse_after_failures must be >= 1, got {self.refuse_after_failures}")
        if not self.retry_s > 0:
            raise ValueError(f"retry_s must be > 0, got {self.retry_s}")
        if not self.cross_recipe_rel_error >= 0:
            raise ValueError(f"cross_recipe_rel_error must be >= 0, got {self.cross_recipe_rel_error}")

    @property
    def max_positions(self) -> int:
        """The most positions one canary holds on a node (prompt + decode steps)."""
        return self.max_prompt_rows + self.max_decode_steps


def next_delay_s(policy: CanaryPolicy, rng: np.random.Generator) -> float:
    """Seconds until a range's next periodic check: uniform in [0.5, 1.5] x ``interval_s``."""
    return float(policy.interval_s * rng.uniform(0.5, 1.5))


# --- the schedule ---------------------------------------------------------------------------


@dataclasses.dataclass
class _Watch:
    due_s: float
    passed: int = 0
    urgent: bool = True  # newly READY or named by a report: before any periodic check
    in_flight: bool = False


class CanarySchedule:
    """The served ranges the tracker watches and when each is checked next.

    The shell tells it which ranges are READY (``sync_node``, after every heartbeat), takes
    the next due range (``next_due``), says it ``started`` the check and how it ended
    (``passed`` / ``inconclusive`` / ``failed``). A range that stops being READY is
    forgotten: READY again later, it is new again (checked at once, gated until it passes).
    """

    def __init__(self, policy: CanaryPolicy) -> None:
        self.policy = policy
        self._watched: dict[RangeKey, _Watch] = {}

    def __contains__(self, key: RangeKey) -> bool:
        return key in self._watched

    def __len__(self) -> int:
        return len(self._watched)

    def sync_node(self, peer_id: str, ready: Iterable[tuple[str, int, int]], now_s: float) -> list[RangeKey]:
        """``peer_id`` serves exactly ``ready`` ((model, begin, end) READY ranges) now.
        Returns the ranges newly watched (due at once)."""
        keys = {(peer_id, model, begin, end) for model, begin, end in ready}
        for key in [k for k in self._watched if k[0] == peer_id and k not in keys]:
            del self._watched[key]
        new = sorted(keys - set(self._watched))
        for key in new:
            self._watched[key] = _Watch(due_s=now_s)
        return new

    def forget_node(self, peer_id: str) -> None:
        """The node is gone (dead, refused): nothing of it is watched."""
        for key in [k for k in self._watched if k[0] == peer_id]:
            del self._watched[key]

    def cleared(self, key: RangeKey) -> bool:
        """Whether ``key`` passed a check since it became READY (what gating routes by)."""
        watch = self._watched.get(key)
        return watch is not None and watch.passed > 0

    def passed_count(self, key: RangeKey) -> int:
        watch = self._watched.get(key)
        return 0 if watch is None else watch.passed

    def prioritise(self, peer_id: str, model_sha256: str | None, now_s: float) -> list[RangeKey]:
        """Check ``peer_id``'s ranges (of ``model_sha256``, or all) before any periodic
        check; returns those that will be (a check in flight already counts)."""
        keys = [k for k in self._watched if k[0] == peer_id and model_sha256 in (None, k[1])]
        for key in keys:
            watch = self._watched[key]
            if not watch.in_flight:
                watch.due_s, watch.urgent = min(watch.due_s, now_s), True
        return sorted(keys)

    def next_due(self, now_s: float) -> RangeKey | None:
        """The range to check now: urgent ones first (then the longest overdue), or None."""
        due = [(not w.urgent, w.due_s, k) for k, w in self._watched.items() if not w.in_flight and w.due_s <= now_s]
        return min(due)[2] if due else None

    def next_wakeup_s(self) -> float | None:
        """When the next check falls due (None: nothing watched, or all in flight)."""
        times = [w.due_s for w in self._watched.values() if not w.in_flight]
        return min(times) if times else None

    def started(self, key: RangeKey) -> None:
        self._watched[key].in_flight = True

    def passed(self, key: RangeKey, now_s: float, rng: np.random.Generator) -> None:
        """The check of ``key`` passed: the next one after a random delay. (A range forgotten
        while its check ran is left forgotten.)"""
        watch = self._watched.get(key)
        if watch is not None:
            watch.passed += 1
            watch.in_flight = watch.urgent = False
            watch.due_s = now_s + next_delay_s(self.policy, rng)

    def inconclusive(self, key: RangeKey, now_s: float) -> None:
        """The check could not conclude: try again after ``retry_s`` (urgency kept)."""
        watch = self._watched.get(key)
        if watch is not None:
            watch.in_flight = False
            watch.due_s = now_s + self.policy.retry_s

    def failed(self, key: RangeKey) -> None:
        """The check failed: the range is withdrawn, so it is no longer watched."""
        self._watched.pop(key, None)


# --- what a canary sends --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CanaryPlan:
    """One canary: ``prompt`` (token ids, step 0 at positions 0..), then ``decode_steps``
    steps of one row each (the reference's greedy token: the continuation a real greedy
    generation would take); the last range returns ``result_top_k`` (0: the full row)."""

    prompt: tuple[int, ...]
    decode_steps: int
    result_top_k: int

    @property
    def steps(self) -> int:
        return 1 + self.decode_steps


def plan_canary(
    policy: CanaryPolicy,
    rng: np.random.Generator,
    *,
    n_vocab: int,
    bos_token_id: int | None,
    n_ctx: int,
    full_row: bool = False,
) -> CanaryPlan:
    """A fresh canary: ``bos_token_id`` (when the model adds one) then random tokens; drawn
    anew every time, so a node cannot have seen it (nor memorised its answer).

    ``n_ctx``: the positions a sequence of the checked range holds (the plan fits in it).
    ``full_row``: ask for the full logits row (a node of another recipe is compared by
    ``cross_recipe_rel_error``, which needs every value, not a top-K that may order
    near-ties differently).

    Raises:
      ValueError: ``n_vocab`` < 1, or ``n_ctx`` too small for even a one-row canary.
    """
    if n_vocab < 1:
        raise ValueError(f"n_vocab must be >= 1, got {n_vocab}")
    if n_ctx < 1:
        raise ValueError(f"the checked range holds no positions (n_ctx {n_ctx})")
    rows = int(rng.integers(policy.min_prompt_rows, policy.max_prompt_rows + 1))
    decode = int(rng.integers(policy.min_decode_steps, policy.max_decode_steps + 1))
    rows = min(rows, n_ctx)
    decode = min(decode, n_ctx - rows)
    tokens = rng.integers(0, n_vocab, rows).tolist()
    if bos_token_id is not None and 0 <= bos_token_id < n_vocab:
        tokens[0] = bos_token_id
    return CanaryPlan(tuple(int(t) for t in tokens), decode, 0 if full_row else policy.result_top_k)


# --- comparing outputs ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OutputMismatch:
    """A node's output that differs from the reference's: the evidence (wire:
    ``swarm_pb2.IntegrityFailure`` without the check id, range and time)."""

    step: int
    output: str
    expected_sha256: str
    returned_sha256: str
    max_abs_diff: float
    detail: str


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def scores_bytes(scores: TopLogits | np.ndarray) -> bytes:
    """The canonical bytes of a last range's result: the f32 row, or the top-K ids (int32),
    their logits (f32) and the log-sum-exp (f64), little-endian: what two honest nodes of
    one recipe give bit for bit."""
    if isinstance(scores, TopLogits):
        return (
            np.ascontiguousarray(scores.ids, dtype=_I32).tobytes()
            + np.ascontiguousarray(scores.logits, dtype=_F32).tobytes()
            + struct.pack("<d", scores.log_sum_exp)
        )
    return np.ascontiguousarray(scores, dtype=_F32).tobytes()


def _rel_rms(expected: np.ndarray, returned: np.ndarray) -> float:
    e = expected.astype(np.float64)
    scale = math.sqrt(float(np.mean(e * e))) or 1.0
    return math.sqrt(float(np.mean((returned.astype(np.float64) - e) ** 2))) / scale


def _max_abs(expected: np.ndarray, returned: np.ndarray) -> float:
    if expected.shape != returned.shape:
        return math.inf
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(returned.astype(np.float64) - expected.astype(np.float64))
    return float(np.nanmax(diff)) if diff.size else 0.0


def _differing_rows(expected: np.ndarray, returned: np.ndarray) -> str:
    rows = np.flatnonzero(
        np.any(expected.reshape(expected.shape[0], -1) != returned.reshape(expected.shape[0], -1), axis=1)
    )
    shown = ", ".join(str(int(r)) for r in rows[:8])
    return f"rows {shown}{', ...' if rows.size > 8 else ''} of {expected.shape[0]} differ"


def compare_rows(
    step: int, expected: np.ndarray, returned: np.ndarray, *, rel_error: float | None = None
) -> OutputMismatch | None:
    """Boundary rows (float32 ``[n_rows, width]``) against the reference's: None when equal
    bit for bit (``rel_error`` None: same recipe) or within the relative RMS bound."""
    expected = np.ascontiguousarray(expected, dtype=_F32)
    returned = np.ascontiguousarray(returned, dtype=_F32)
    what = "boundary rows"
    if expected.shape != returned.shape:
        return OutputMismatch(
            step, what, _sha256(expected.tobytes()), _sha256(returned.tobytes()), math.inf,
            f"shape {tuple(returned.shape)}, expected {tuple(expected.shape)}",
        )  # fmt: skip
    if expected.tobytes() == returned.tobytes():
        return None
    if not np.isfinite(returned).all():
        detail = "the rows hold NaN or inf"
    elif rel_error is not None:
        error = _rel_rms(expected, returned)
        if error <= rel_error:
            return None
        detail = f"relative RMS error {error:.3g} exceeds the cross-recipe bound {rel_error:g}"
    else:
        detail = _differing_rows(expected, returned)
    return OutputMismatch(
        step, what, _sha256(expected.tobytes()), _sha256(returned.tobytes()), _max_abs(expected, returned), detail
    )


def compare_scores(
    step: int, expected: TopLogits | np.ndarray, returned: TopLogits | np.ndarray, *, rel_error: float | None = None
) -> OutputMismatch | None:
    """A last range's result (top-K or full row) against the reference's: None when equal
    bit for bit (``rel_error`` None), or (full rows only) within the relative RMS bound."""
    expected_bytes, returned_bytes = scores_bytes(expected), scores_bytes(returned)
    top = isinstance(expected, TopLogits)
    what = f"top-{expected.k} logits" if isinstance(expected, TopLogits) else "logits row"
    if expected_bytes == returned_bytes and isinstance(returned, TopLogits) == top:
        return None
    digests = (_sha256(expected_bytes), _sha256(returned_bytes))
    if isinstance(returned, TopLogits) != top:
        kind = "a top-K" if isinstance(returned, TopLogits) else "a full row"
        return OutputMismatch(step, what, *digests, math.inf, f"returned {kind}")
    if top:
        assert isinstance(expected, TopLogits) and isinstance(returned, TopLogits)
        if not np.array_equal(expected.ids, returned.ids):
            detail = f"token ids differ (expected {expected.ids[:5].tolist()}..., got {returned.ids[:5].tolist()}...)"
            return OutputMismatch(step, what, *digests, math.inf, detail)
        diff = max(_max_abs(expected.logits, returned.logits), abs(expected.log_sum_exp - returned.log_sum_exp))
        return OutputMismatch(step, what, *digests, diff, "same tokens, other values")
    row_e, row_r = np.asarray(expected, dtype=_F32), np.asarray(returned, dtype=_F32)
    if row_e.shape != row_r.shape:
        return OutputMismatch(step, what, *digests, math.inf, f"{row_r.size} values, {row_e.size} expected")
    if not np.isfinite(row_r).all():
        return OutputMismatch(step, what, *digests, _max_abs(row_e, row_r), "the row holds NaN or inf")
    if rel_error is None:
        return OutputMismatch(step, what, *digests, _max_abs(row_e, row_r), "values differ")
    error = _rel_rms(row_e, row_r)
    if error <= rel_error:
        return None
    return OutputMismatch(
        step, what, *digests, _max_abs(row_e, row_r),
        f"relative RMS error {error:.3g} exceeds the cross-recipe bound {rel_error:g}",
    )  # fmt: skip


# --- what a failure leads to ----------------------------------------------------------------


class FailureAction(enum.Enum):
    WITHDRAW = "withdraw"  # the range leaves routes; the node may serve again after registering anew
    REFUSE = "refuse"  # the node leaves the swarm; its registrations are refused


def after_failure(policy: CanaryPolicy, failures: int) -> FailureAction:
    """What ``failures`` failed checks of one node (this one included) lead to."""
    return FailureAction.REFUSE if failures >= policy.refuse_after_failures else FailureAction.WITHDRAW
