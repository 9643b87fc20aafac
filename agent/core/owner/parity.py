"""Parity: does a model split into ranges compute what the unsplit model computes?

Owns the decisions of a parity run, not its I/O: which rows each Forward batch carries
(``ParityRun.batch``), how the boundary rows of one range become the input of the next
(``next_hop_entries``, and ``through_wire`` for rows that crossed a hop in f16), how logits
are compared and which greedy token is fed next (``ParityRun.record``), when a scenario removes or trims a sequence, and the report.
The trio driver that talks to workers is ``agent.harness.parity_run``.

Steps: step 0 is the prefill (every sequence's prompt, in one batch); steps 1..``steps`` are
decode batches holding every live sequence. Every step's logits are compared, so a run
compares ``steps + 1`` batches and generates ``steps + 1`` tokens per sequence. The next
token is always the argmax of the *reference* (unsplit) logits and is fed to both sides, so
one early mismatch cannot make the rest of the comparison diverge; ``tokens_equal`` records
whether the candidate's argmax agreed at every step.

Pure: numpy only, no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from agent.core.wire.boundary import WireDType, decode_rows, encode_rows
from agent.core.wire.ranges import LayerRange
from agent.core.wire.worker_records import SeqInput, SeqOutput

__all__ = [
    "Edit",
    "ParityError",
    "ParityReport",
    "ParityRun",
    "Scenario",
    "build_prompts",
    "greedy_token",
    "greedy_tokens",
    "max_abs_diff",
    "next_hop_entries",
    "prompt_lengths",
    "through_wire",
]

#: Mismatched steps kept in a report (the count is always exact).
MAX_MISMATCHES_KEPT = 20


class ParityError(RuntimeError):
    """A worker's reply does not fit the run (wrong sequence, rows or positions)."""


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    """Largest ``|a - b|`` over all elements (0.0 for empty arrays).

    NaN anywhere in either array gives ``inf``: a NaN is never "close".

    Raises:
      ValueError: the shapes differ.
    """
    a = np.asarray(a)
    b = np.asarray(b)
    if a.shape != b.shape:
        raise ValueError(f"cannot compare shapes {a.shape} and {b.shape}")
    if a.size == 0:
        return 0.0
    diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
    if np.isnan(diff).any():
        return math.inf
    return float(diff.max())


def greedy_token(logits: np.ndarray) -> int:
    """The argmax of one logits row (the lowest index on ties)."""
    row = np.asarray(logits)
    if row.ndim != 1 or row.size == 0:
        raise ValueError(f"greedy_token needs one non-empty logits row, got shape {row.shape}")
    return int(np.argmax(row))


def greedy_tokens(logits: np.ndarray) -> list[int]:
    """The argmax of every row of ``[n_rows, n_vocab]`` logits."""
    rows = np.asarray(logits)
    if rows.ndim != 2 or rows.shape[1] == 0:
        raise ValueError(f"greedy_tokens needs [n_rows, n_vocab] logits, got shape {rows.shape}")
    return [int(t) for t in np.argmax(rows, axis=1)]


def prompt_lengths(sequences: int, prompt_tokens: int) -> list[int]:
    """Distinct, decreasing prompt lengths: ``prompt_tokens`` for sequence 0, then shorter.

    ``prompt_lengths(4, 40) == [40, 34, 28, 22]``; never below 1.
    """
    if sequences < 1:
        raise ValueError(f"sequences must be >= 1, got {sequences}")
    if prompt_tokens < 1:
        raise ValueError(f"prompt_tokens must be >= 1, got {prompt_tokens}")
    step = max(1, prompt_tokens // 6)
    return [max(1, prompt_tokens - i * step) for i in range(sequences)]


def build_prompts(prefix: Sequence[int], body: Sequence[int], lengths: Sequence[int]) -> list[list[int]]:
    """Deterministic prompts: ``prefix`` (e.g. BOS) then ``body`` repeated, cut to each length.

    Sequence ``i`` starts its body ``3 * i`` tokens in, so prompts differ in content as
    well as length.
    """
    if not body:
        raise ValueError("the prompt body has no tokens")
    prompts = []
    for i, length in enumerate(lengths):
        if length < 1:
            raise ValueError(f"prompt length {length} of sequence {i} must be >= 1")
        head = list(prefix)[:length]
        need = length - len(head)
        start = (3 * i) % len(body)
        cycled = [body[(start + k) % len(body)] for k in range(need)]
        prompts.append(head + cycled)
    return prompts


def through_wire(entries: Sequence[SeqInput], dtype: int) -> list[SeqInput]:
    """``entries`` with their boundary rows as the next hop decodes them after they crossed a
    swarm hop in wire ``dtype`` (``agent.core.wire.boundary.encode_rows`` then ``decode_rows``,
    what ``next_hop_request`` and ``validate_step`` do): unchanged for F32, rounded to the
    nearest float16 for F16. Token entries pass as they are.

    Raises:
      agent.core.wire.boundary.BoundaryError: rows out of the dtype's range.
    """
    if int(dtype) == int(WireDType.F32):
        return list(entries)
    out = []
    for entry in entries:
        if entry.boundary is not None:
            n_rows, width = entry.boundary.shape
            rows = decode_rows(encode_rows(entry.boundary, width, dtype), n_rows, width, dtype)
            entry = dataclasses.replace(entry, boundary=rows)
        out.append(entry)
    return out


def next_hop_entries(inputs: Sequence[SeqInput], outputs: Sequence[SeqOutput]) -> list[SeqInput]:
    """The entries for the next range: each output's boundary rows with the same sequence,
    positions, logit rows and top_k as the entry that produced them.

    Raises:
      ParityError: the outputs do not answer the inputs entry by entry with boundary rows.
    """
    if len(inputs) != len(outputs):
        raise ParityError(f"{len(inputs)} entries sent but {len(outputs)} returned")
    entries = []
    for sent, got in zip(inputs, outputs):
        if got.seq_id != sent.seq_id:
            raise ParityError(f"entry for seq {sent.seq_id} answered as seq {got.seq_id}")
        if got.boundary is None:
            raise ParityError(f"seq {sent.seq_id}: a range that is not last returned no boundary rows")
        if got.boundary.shape[0] != sent.n_rows:
            raise ParityError(f"seq {sent.seq_id}: sent {sent.n_rows} rows, got {got.boundary.shape[0]} boundary rows")
        entries.append(
            SeqInput(
                seq_id=sent.seq_id,
                positions=sent.positions,
                boundary=got.boundary,
                logit_rows=sent.logit_rows,
                boundary_schema=got.boundary_schema,
                top_k=sent.top_k,
            )
        )
    return entries


@dataclasses.dataclass(frozen=True)
class Scenario:
    """After step ``after_step`` (prefill = step 0), remove ``remove_seq`` and trim
    ``trim_by`` positions off ``trim_seq`` on every worker; the trimmed sequence then
    re-feeds the tokens it lost (from its history) in the next batch."""

    after_step: int
    remove_seq: int | None = None
    trim_seq: int | None = None
    trim_by: int = 0

    def check(self, sequences: int, steps: int) -> None:
        if not 0 <= self.after_step < steps:
            raise ValueError(f"scenario after_step {self.after_step} must be in [0, steps = {steps})")
        for name in ("remove_seq", "trim_seq"):
            seq = getattr(self, name)
            if seq is not None and not 0 <= seq < sequences:
                raise ValueError(f"scenario {name} {seq} is not a sequence of this run (0..{sequences - 1})")
        if self.remove_seq is not None and self.remove_seq == self.trim_seq:
            raise ValueError(f"scenario removes and trims the same sequence {self.remove_seq}")
        if self.trim_seq is not None and self.trim_by < 1:
            raise ValueError(f"scenario trim_by must be >= 1 when trim_seq is set, got {self.trim_by}")
        if self.remove_seq is None and self.trim_seq is None:
            raise ValueError("scenario neither removes nor trims a sequence")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Edit:
    """What to do on every worker between two steps."""

    remove: tuple[int, ...] = ()
    trim: tuple[tuple[int, int], ...] = ()  # (seq_id, keep_positions)


@dataclasses.dataclass
class ParityReport:
    """Outcome of a parity run. ``tokens[i]``: the tokens generated for sequence ``i``."""

    max_abs_diff: float
    tokens_equal: bool
    ranges: list[LayerRange]
    steps: int
    sequences: int
    tokens: list[list[int]]
    tolerance: float = 1e-4
    prompt_lengths: list[int] = dataclasses.field(default_factory=list)
    step_max_abs_diff: list[float] = dataclasses.field(default_factory=list)
    mismatches: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    mismatch_count: int = 0
    scenario: Scenario | None = None
    text: str | None = None
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.tokens_equal and self.max_abs_diff <= self.tolerance

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict: ``max_abs_diff`` (null if not finite), ``tokens_equal``,
        ``ranges`` as ``[[begin, end], ...]``, then the extras."""

        def number(x: float) -> float | None:
            return float(x) if math.isfinite(x) else None

        return {
            "max_abs_diff": number(self.max_abs_diff),
            "tokens_equal": self.tokens_equal,
            "ranges": [r.as_list() for r in self.ranges],
            "passed": self.passed,
            "tolerance": self.tolerance,
            "steps": self.steps,
            "sequences": self.sequences,
            "prompt_lengths": list(self.prompt_lengths),
            "tokens": [list(t) for t in self.tokens],
            "step_max_abs_diff": [number(x) for x in self.step_max_abs_diff],
            "mismatch_count": self.mismatch_count,
            "mismatches": list(self.mismatches),
            "scenario": None if self.scenario is None else self.scenario.to_json(),
            "text": self.text,
            **self.extras,
        }


@dataclasses.dataclass
class _Sequence:
    seq_id: int
    tokens: list[int]  # prompt + generated; tokens[:n_cached] are in the workers' caches
    prompt_len: int
    n_cached: int = 0
    live: bool = True


class ParityRun:
    """The state of one parity run, driven by a shell that owns the workers.

    Loop: ``while not run.finished: entries = run.batch(); <forward entries on both
    sides>; run.record(reference_logits, candidate_logits); if (edit :=
    run.pending_edit()): <apply on every worker>; run.apply_edit(edit)``.
    """

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        steps: int,
        scenario: Scenario | None = None,
        *,
        tolerance: float = 1e-4,
    ) -> None:
        if not prompts:
            raise ValueError("a parity run needs at least one prompt")
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if scenario is not None:
            scenario.check(len(prompts), steps)
        self.steps = steps
        self.scenario = scenario
        self.tolerance = tolerance
        self.step = 0
        self._seqs = [_Sequence(i, list(p), len(p)) for i, p in enumerate(prompts)]
        self._max_abs_diff = 0.0
        self._step_max: list[float] = []
        self._mismatches: list[dict[str, Any]] = []
        self._mismatch_count = 0
        self._edit_done = False

    @property
    def finished(self) -> bool:
        return self.step > self.steps

    @property
    def live_seq_ids(self) -> list[int]:
        return [s.seq_id for s in self._seqs if s.live]

    def tokens(self, seq_id: int) -> list[int]:
        """Prompt plus generated tokens of a sequence so far."""
        return list(self._seqs[seq_id].tokens)

    def generated(self, seq_id: int) -> list[int]:
        seq = self._seqs[seq_id]
        return seq.tokens[seq.prompt_len :]

    def batch(self) -> list[SeqInput]:
        """This step's entries: for every live sequence the tokens not yet in the caches
        (its prompt at step 0, its last token afterwards, more after a trim); logits of
        the last row only."""
        if self.finished:
            raise ParityError("the run is finished")
        entries = []
        for seq in self._seqs:
            if not seq.live:
                continue
            feed = seq.tokens[seq.n_cached :]
            entries.append(
                SeqInput(
                    seq_id=seq.seq_id,
                    positions=list(range(seq.n_cached, len(seq.tokens))),
                    token_ids=feed,
                    logit_rows=[len(feed) - 1],
                )
            )
        return entries

    def expected_next_positions(self) -> dict[int, int]:
        """What every live sequence holds after this step's batch."""
        return {s.seq_id: len(s.tokens) for s in self._seqs if s.live}

    def check_outputs(self, where: str, outputs: Sequence[SeqOutput], *, logits: bool) -> dict[int, np.ndarray]:
        """Check one worker's answer to this step's batch; return the logits row per sequence
        (``logits=True``) or ``{}``.

        Raises:
          ParityError: naming ``where``, when sequences, positions or rows do not match.
        """
        expected = self.expected_next_positions()
        got_ids = [o.seq_id for o in outputs]
        if got_ids != list(expected):
            raise ParityError(f"{where}: answered sequences {got_ids}, expected {list(expected)}")
        rows = {}
        for out in outputs:
            if out.next_position != expected[out.seq_id]:
                raise ParityError(
                    f"{where}: seq {out.seq_id} holds {out.next_position} positions, expected {expected[out.seq_id]}"
                )
            if logits:
                if out.logits is None or out.logits.shape[0] != 1:
                    shape = None if out.logits is None else out.logits.shape
                    raise ParityError(f"{where}: seq {out.seq_id} expected one logits row, got {shape}")
                rows[out.seq_id] = out.logits[0]
        return rows

    def record(self, reference: Mapping[int, np.ndarray], candidate: Mapping[int, np.ndarray]) -> dict[int, int]:
        """Compare this step's logits rows (one per live sequence), feed the reference's
        greedy token to every live sequence, and advance to the next step.

        Returns:
          The token chosen for each live sequence.
        """
        live = self.live_seq_ids
        if sorted(reference) != live or sorted(candidate) != live:
            raise ParityError(
                f"step {self.step}: logits for sequences {sorted(reference)} / {sorted(candidate)}, expected {live}"
            )
        step_max = 0.0
        chosen = {}
        for seq_id in live:
            ref_row = np.asarray(reference[seq_id])
            cand_row = np.asarray(candidate[seq_id])
            step_max = max(step_max, max_abs_diff(ref_row, cand_row))
            ref_token = greedy_token(ref_row)
            cand_token = greedy_token(cand_row)
            if ref_token != cand_token:
                self._mismatch_count += 1
                if len(self._mismatches) < MAX_MISMATCHES_KEPT:
                    self._mismatches.append(
                        {"step": self.step, "seq_id": seq_id, "reference": ref_token, "candidate": cand_token}
                    )
            seq = self._seqs[seq_id]
            seq.n_cached = len(seq.tokens)
            seq.tokens.append(ref_token)
            chosen[seq_id] = ref_token
        self._step_max.append(step_max)
        self._max_abs_diff = max(self._max_abs_diff, step_max)
        self.step += 1
        return chosen

    def pending_edit(self) -> Edit | None:
        """The scenario's edit, once, right after step ``after_step`` was recorded."""
        sc = self.scenario
        if sc is None or self._edit_done or self.step != sc.after_step + 1:
            return None
        remove = () if sc.remove_seq is None else (sc.remove_seq,)
        trim: tuple[tuple[int, int], ...] = ()
        if sc.trim_seq is not None:
            seq = self._seqs[sc.trim_seq]
            if sc.trim_by > seq.n_cached:
                raise ParityError(f"cannot trim {sc.trim_by} positions off seq {seq.seq_id}: it holds {seq.n_cached}")
            trim = ((seq.seq_id, seq.n_cached - sc.trim_by),)
        return Edit(remove=remove, trim=trim)

    def apply_edit(self, edit: Edit) -> None:
        """Record that ``edit`` was applied on every worker."""
        for seq_id in edit.remove:
            self._seqs[seq_id].live = False
            self._seqs[seq_id].n_cached = 0
        for seq_id, keep in edit.trim:
            self._seqs[seq_id].n_cached = keep
        self._edit_done = True

    def report(self, ranges: Sequence[LayerRange], *, text: str | None = None, **extras: Any) -> ParityReport:
        return ParityReport(
            max_abs_diff=self._max_abs_diff,
            tokens_equal=self._mismatch_count == 0,
            ranges=list(ranges),
            steps=self.steps,
            sequences=len(self._seqs),
            tokens=[self.generated(s.seq_id) for s in self._seqs],
            tolerance=self.tolerance,
            prompt_lengths=[s.prompt_len for s in self._seqs],
            step_max_abs_diff=list(self._step_max),
            mismatches=list(self._mismatches),
            mismatch_count=self._mismatch_count,
            scenario=self.scenario,
            text=text,
            extras=dict(extras),
        )
