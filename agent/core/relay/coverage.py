"""What the relay's status page says of a model's coverage: which nodes serve which of its
ranges, and whether READY ranges of live nodes cover every block; and of each range's prefix
cache (``prefix_caches``: its hits and bytes, for the page and ``/metrics``).

Owns, for ``agent.io.relay.server`` (which fetches the tracker's lists and renders the page):
only ranges the tracker assigned count (a node's own word that it serves a range nobody gave
it is not coverage), each in the state its node reports, sorted by range then peer.

Pure: no I/O. Must not import trio, sockets or agent.io.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agent._proto import swarm_pb2

__all__ = ["model_coverage", "prefix_caches"]


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


def prefix_caches(models: Sequence[swarm_pb2.ModelEntry], nodes: Sequence[swarm_pb2.NodeEntry]) -> list[dict[str, Any]]:
    """One dict per READY assigned range of a registered model whose node reports a prefix
    cache: ``peer_id``, ``model`` (alias, else sha256), ``begin``, ``end``, ``alive``, the
    worker's counters since it started (``lookups``: opens that asked for a cached prefix,
    ``hits``: those that copied one, ``hit_tokens``: the positions copied), ``hit_rate``
    (hits / lookups, 0 before any lookup) and the cache's ``used_bytes`` of ``budget_bytes``;
    sorted by model, range, then peer. The numbers are the node's word (as every figure of a
    heartbeat is): shown, never acted on; a rate is kept within [0, 1]."""
    names = {entry.sha256: entry.alias or entry.sha256 for entry in models}
    caches: list[dict[str, Any]] = []
    for node in nodes:
        assigned = {(a.model_sha256, a.begin, a.end) for a in node.assigned}
        for status in node.serving:
            a = status.assignment
            if (
                a.model_sha256 not in names
                or (a.model_sha256, a.begin, a.end) not in assigned
                or status.state != swarm_pb2.AssignmentStatus.READY
                or not status.prefix_cache_bytes
            ):
                continue
            lookups, hits = status.prefix_lookups, status.prefix_hits
            caches.append({
                "peer_id": node.peer_id, "model": names[a.model_sha256], "begin": a.begin, "end": a.end,
                "alive": node.alive, "lookups": lookups, "hits": hits, "hit_tokens": status.prefix_hit_positions,
                "hit_rate": min(1.0, hits / lookups) if lookups else 0.0,
                "used_bytes": status.prefix_cache_used_bytes, "budget_bytes": status.prefix_cache_bytes,
            })  # fmt: skip
    caches.sort(key=lambda c: (c["model"], c["begin"], c["end"], c["peer_id"]))
    return caches
