"""What may share one worker Forward: the compatibility key of a step.

Owns the rule that steps are merged only when one Forward can run them all the same way as it
would run each alone: the same engine and recipe (``recipe_hash``: the worker's hash of the
model sha256, the llama.cpp pin, the patch series, the backend and the boundary schema), the
same model and blocks, the same boundary schema (rows of the same width and streams) and the
same wire dtype (a step's output goes on in the dtype it came in). The state layout (KV type,
context per sequence) belongs to the worker a range runs on, so steps of one scheduler share
it by construction; a node with two workers (two models, or two dtypes of one) has a scheduler
per worker, and their steps never meet.

The phase (prefill chunk or decode) is the other half of the rule, applied by the scheduler
(``agent.core.node.scheduler``): a Forward holds decode steps only, or prefill chunks of one row
count only, because llama.cpp cuts a batch of several sequences into micro-batches of equal
rows per sequence, which would recompute a chunk in other shapes next to rows of another length
and change its numbers.

Pure: no I/O. Must not import trio, grpc, libp2p or agent.io.
"""

from __future__ import annotations

import dataclasses

from agent.core.wire.step_validation import StepInput

__all__ = ["ForwardKey", "forward_key", "is_prefill"]


@dataclasses.dataclass(frozen=True, order=True)
class ForwardKey:
    recipe_hash: str
    model_sha256: str
    begin: int
    end: int
    boundary_version: int
    boundary_streams: int
    dtype: int


def forward_key(step: StepInput) -> ForwardKey:
    """The key two steps must share to be in one Forward."""
    schema = step.schema
    return ForwardKey(
        recipe_hash=step.recipe_hash,
        model_sha256=step.model_sha256,
        begin=step.begin,
        end=step.end,
        boundary_version=schema.version,
        boundary_streams=schema.streams,
        dtype=step.dtype,
    )


def is_prefill(n_rows: int) -> bool:
    """A step of more than one row is a prefill chunk (or a rebuild); one row is a decode step."""
    return n_rows > 1
