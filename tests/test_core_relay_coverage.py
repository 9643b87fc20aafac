"""The status page's coverage rule (agent.core.relay.coverage): assigned ranges only, READY ranges
of live nodes must reach every block."""

from __future__ import annotations

import pytest

from agent._proto import swarm_pb2
from agent.core.relay.coverage import model_coverage, prefix_caches

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

SHA = "ab" * 32
READY = swarm_pb2.AssignmentStatus.READY
LOADING = swarm_pb2.AssignmentStatus.LOADING


def _node(peer: str, begin: int, end: int, state: int, *, alive: bool = True, assigned: bool = True):
    a = swarm_pb2.Assignment(model_sha256=SHA, begin=begin, end=end)
    return swarm_pb2.NodeEntry(
        peer_id=peer, alive=alive, assigned=[a] if assigned else [],
        serving=[swarm_pb2.AssignmentStatus(assignment=a, state=state)],
    )  # fmt: skip


def test_ready_assigned_ranges_of_live_nodes_cover_the_model() -> None:
    entry = swarm_pb2.ModelEntry(sha256=SHA, n_layer=30)
    nodes = [_node("c", 20, 30, READY), _node("a", 0, 10, READY), _node("b", 10, 20, READY)]
    coverage, covered = model_coverage(entry, nodes)
    assert covered and [c["peer_id"] for c in coverage] == ["a", "b", "c"]


@pytest.mark.parametrize(
    "middle",
    [
        _node("b", 10, 20, LOADING),  # not READY
        _node("b", 10, 20, READY, alive=False),  # a dead node
        _node("b", 10, 20, READY, assigned=False),  # its own word only: not even listed
    ],
)
def test_a_gap_leaves_the_model_uncovered(middle: swarm_pb2.NodeEntry) -> None:
    entry = swarm_pb2.ModelEntry(sha256=SHA, n_layer=30)
    coverage, covered = model_coverage(entry, [_node("a", 0, 10, READY), middle, _node("c", 20, 30, READY)])
    assert not covered
    assert ("b" in [c["peer_id"] for c in coverage]) == bool(middle.assigned)


def test_the_served_context_is_the_smallest_a_live_ready_range_reports_else_the_gguf_s() -> None:
    from agent.core.relay.served_context import served_context

    entry = swarm_pb2.ModelEntry(sha256="m", n_layer=4, context_length=8192)

    def node(alive: bool, state, n_ctx: int, sha: str = "m") -> swarm_pb2.NodeEntry:
        status = swarm_pb2.AssignmentStatus(
            assignment=swarm_pb2.Assignment(model_sha256=sha, begin=0, end=4), state=state, n_ctx_per_sequence=n_ctx
        )
        return swarm_pb2.NodeEntry(alive=alive, serving=[status])

    ready, loading = swarm_pb2.AssignmentStatus.READY, swarm_pb2.AssignmentStatus.LOADING
    assert served_context(entry, []) == 8192
    assert served_context(entry, [node(True, ready, 0)]) == 8192  # an older node says nothing
    nodes = [node(True, ready, 2048), node(True, ready, 4096), node(False, ready, 512), node(True, loading, 256),
             node(True, ready, 128, sha="other")]  # fmt: skip
    assert served_context(entry, nodes) == 2048


def test_prefix_caches_of_ready_assigned_ranges_with_a_cache_only() -> None:
    entry = swarm_pb2.ModelEntry(sha256=SHA, alias="tiny", n_layer=30)
    nodes = [_node("b", 10, 20, READY), _node("a", 0, 10, READY), _node("c", 20, 30, LOADING)]
    nodes.append(_node("d", 0, 10, READY, assigned=False))  # its own word only
    for node, (lookups, hits) in zip(nodes, [(4, 4), (0, 0), (3, 1), (5, 5)], strict=True):
        status = node.serving[0]
        status.prefix_lookups, status.prefix_hits, status.prefix_hit_positions = lookups, hits, 64 * hits
        status.prefix_cache_used_bytes, status.prefix_cache_bytes = 100 * hits, 1000
    nodes.append(_node("e", 10, 20, READY))  # no prefix cache (budget 0)
    liar = _node("f", 20, 30, READY)
    liar.serving[0].prefix_lookups, liar.serving[0].prefix_hits, liar.serving[0].prefix_cache_bytes = 1, 9, 10
    caches = prefix_caches([entry], [*nodes, liar])
    assert [(c["peer_id"], c["model"], c["begin"], c["hit_rate"]) for c in caches] == [
        ("a", "tiny", 0, 0.0),  # no lookup yet
        ("b", "tiny", 10, 1.0),
        ("f", "tiny", 20, 1.0),  # 9 hits of 1 lookup: kept within [0, 1]
    ]
    assert caches[1] == {
        "peer_id": "b", "model": "tiny", "begin": 10, "end": 20, "alive": True, "lookups": 4, "hits": 4,
        "hit_tokens": 256, "hit_rate": 1.0, "used_bytes": 400, "budget_bytes": 1000,
    }  # fmt: skip
    assert prefix_caches([], nodes) == []  # an unregistered model's ranges are not shown
