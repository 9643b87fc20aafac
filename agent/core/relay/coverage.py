"""What the relay's status page says of a model's coverage: which nodes serve which of its
ranges, and whether READY ranges of live nodes cover every block.

Owns, for ``agent.io.relay.server`` (which fetches the tracker's lists and renders the page):
only ranges the tracker assigned count (a node's own word that it serves a range nobody gave
it is not coverage), each in the state its node reports, sorted by range then peer.

Pure: no I/O. Must not import trio, sockets or agent.io.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agent._proto import swarm_pb2

__all__ = ["model_coverage"]


def model_coverage(
    entry: swarm_pb2.ModelEntry, nodes: Sequence[swarm_pb2.NodeEntry]
) -> tuple[list[dict[str, Any]], bool]:
    """``(coverage, covered)`` of model ``entry``: one dict per assigned range a node reports
    (``peer_id``, ``begin``, ``end``, ``state`` name, ``alive``), and whether READY ranges of
    live nodes reach from block 0 to ``n_layer``."""
    coverage: list[dict[str, Any]] = []
    for node in nodes:
        assigned = {(a.model_sha256, a.begin, a.end) for a in node.assigned}
        for status in node.serving:
            a = status.assignment
            if a.model_sha256 != entry.sha256 or (a.model_sha256, a.begin, a.end) not in assigned:
                continue
            coverage.append({
                "peer_id": node.peer_id, "begin": a.begin, "end": a.end,
                "state": swarm_pb2.AssignmentStatus.State.Name(status.state), "alive": node.alive,
            })  # fmt: skip
    coverage.sort(key=lambda c: (c["begin"], c["end"], c["peer_id"]))
    reach = 0
    for begin, end in sorted((c["begin"], c["end"]) for c in coverage if c["state"] == "READY" and c["alive"]):
        if begin <= reach:
            reach = max(reach, end)
    return coverage, entry.n_layer > 0 and reach >= entry.n_layer
