"""TEST ONLY: a node that computes wrong numbers, to show that the swarm catches one.

``OutputCorrupter`` is an ``agent.io.node.config.OutputsFilter``: installed in a node
(``serve_node(..., outputs_filter=OutputCorrupter(...))``, or the test-only entry point
``python -m agent.testing.faulty_node ... --corrupt-outputs SCALE``) it sits between the
node's worker and its pushes: while it is active, the output rows of every step whose input
the node has not seen before get Gaussian noise of ``SCALE`` x their RMS added (boundary rows to the next hop, or the logits row from which the
last range's top-K is then selected); a step whose input it has seen before (positions and
rows or tokens, bit for bit) gets the honest output. That is a cheater that answers every
check it could have memorised correctly and everything new wrongly: only checks drawn afresh
each time (``agent.core.tracker.canary.plan_canary``) catch it. ``while_file``: active only while that
file exists (a test turns a node bad mid-generation); None: always.

Never for production: an honest node runs without it (the default). Must not import agent.io
(it fits the node's hook by shape).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os

import numpy as np

from agent.core.wire.step_validation import StepInput
from agent.core.wire.worker_records import SeqOutput

__all__ = ["CorruptOutputs", "OutputCorrupter"]

#: inputs remembered at most (the oldest is forgotten first)
MAX_SEEN = 100_000


@dataclasses.dataclass(frozen=True)
class CorruptOutputs:
    """TEST ONLY. ``scale``: noise RMS relative to the rows' RMS; ``while_file``: corrupt only
    while this file exists (None: always); ``seed``: of the noise."""

    scale: float = 1.0
    while_file: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"scale must be > 0, got {self.scale}")


class OutputCorrupter:
    """TEST ONLY: see the module doc."""

    def __init__(self, config: CorruptOutputs) -> None:
        self.config = config
        self._rng = np.random.default_rng(config.seed)
        self._seen: dict[bytes, None] = {}
        self.corrupted = 0  # steps whose output it changed

    @property
    def active(self) -> bool:
        return self.config.while_file is None or os.path.exists(self.config.while_file)

    def _first_time(self, step: StepInput) -> bool:
        digest = hashlib.sha256(step.positions.tobytes())
        for part in (step.token_ids, step.rows):
            if part is not None:
                digest.update(np.ascontiguousarray(part).tobytes())
        key = digest.digest()
        if key in self._seen:
            return False
        self._seen[key] = None
        if len(self._seen) > MAX_SEEN:
            del self._seen[next(iter(self._seen))]
        return True

    def _noisy(self, rows: np.ndarray) -> np.ndarray:
        rms = float(np.sqrt(np.mean(np.square(rows, dtype=np.float64)))) or 1.0
        noise = self._rng.standard_normal(rows.shape) * (self.config.scale * rms)
        return (rows + noise).astype(np.float32)

    def batch_formed(self) -> bool:
        """A batch is formed: whether its outputs may be corrupted (``active`` now)."""
        return self.active

    def apply(self, step: StepInput, output: SeqOutput, *, altering: bool) -> SeqOutput:
        """The output the node pushes for ``step``: ``output`` itself, or (``altering``: what
        ``batch_formed`` said when the batch was formed; input not seen before) with noise in
        its boundary rows or logits. Every input is remembered, active or not."""
        first = self._first_time(step)
        if not first or not altering:
            return output
        self.corrupted += 1
        if output.boundary is not None:
            return dataclasses.replace(output, boundary=self._noisy(output.boundary), boundary_bytes=None)
        if output.logits is not None:
            return dataclasses.replace(output, logits=self._noisy(output.logits))
        return output
