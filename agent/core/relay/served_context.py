"""The context a model is served with: the positions a session can hold on the swarm.

Owns, for the relay's ``/v1/models`` and its prompt-length check: the smallest
``n_ctx_per_sequence`` that a live node reports for a READY range of the model (a route may
take any of them, so a prompt that fits is one that fits every range), else the GGUF's
``context_length`` (no node reports it yet: an older node, or none READY).

Pure: no I/O. Must not import trio, sockets or agent.io.
"""

from __future__ import annotations

from collections.abc import Sequence

from agent._proto import swarm_pb2

__all__ = ["served_context"]


def served_context(entry: swarm_pb2.ModelEntry, nodes: Sequence[swarm_pb2.NodeEntry]) -> int:
    """Positions one session of ``entry`` can hold (0: unknown)."""
    reported = [
        status.n_ctx_per_sequence
        for node in nodes
        if node.alive
        for status in node.serving
        if status.assignment.model_sha256 == entry.sha256
        and status.state == swarm_pb2.AssignmentStatus.READY
        and status.n_ctx_per_sequence > 0
    ]
    return min(reported) if reported else entry.context_length
