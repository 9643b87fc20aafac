"""agent.core.owner.spot_check: which sessions an owner spot-checks, the shadow's steps, comparing
results, and which tokens to take back after a peer failed an integrity check."""

from __future__ import annotations

import numpy as np
import pytest

from agent._proto import swarm_pb2
from agent.core.owner.spot_check import (
    RouteSegment,
    compare_results,
    hop_to_avoid,
    result_digest,
    rollback_point,
    sample,
    shadow_request,
)
from agent.core.wire.step_requests import first_step_request
from agent.core.wire.step_results import step_result

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def route(*peers: str, recipe: str = "r1") -> swarm_pb2.Route:
    """Hops of 10 blocks each, the last to block 30."""
    hops = [
        swarm_pb2.Hop(peer_id=p, addrs=[f"/memory/{p}"], begin=10 * i, end=10 * (i + 1)) for i, p in enumerate(peers)
    ]
    hops[-1].end = 30
    return swarm_pb2.Route(model_sha256="m" * 64, n_layer=30, recipe_hash=recipe, hops=hops)


def test_sessions_are_sampled_at_the_rate() -> None:
    rng = np.random.default_rng(0)
    assert not any(sample(0.0, rng) for _ in range(1000)) and all(sample(1.0, rng) for _ in range(1000))
    assert 900 < sum(sample(0.1, rng) for _ in range(10_000)) < 1100  # 3 standard deviations
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        sample(1.5, rng)
    picked = {hop_to_avoid(route("a", "b", "c"), rng) for _ in range(100)}
    assert picked == {"a", "b", "c"}


def test_the_shadow_sends_the_same_rows_along_another_route() -> None:
    original = first_step_request(
        session_id=b"s" * 16, step=3, hops=route("a", "b", "c").hops, token_ids=[5, 6], first_position=7,
        recipe_hash="r1", model_sha256="m" * 64, owner_peer_id="owner", owner_addrs=["/memory/owner"],
        sender_admission=swarm_pb2.SignedAdmission(record=b"x"), result_top_k=40,
    )  # fmt: skip
    other = route("x", "y")
    shadow = shadow_request(original, b"t" * 16, other)
    assert shadow.session_id == b"t" * 16 and (shadow.begin, shadow.end) == (0, 10)
    assert [h.peer_id for h in shadow.rest] == ["y"]
    assert list(shadow.token_ids) == [5, 6] and list(shadow.positions) == [7, 8] and shadow.step == 3
    assert shadow.checksum == original.checksum and shadow.result_top_k == 40 and shadow.owner_peer_id == "owner"
    assert original.session_id == b"s" * 16  # the original is left alone
    with pytest.raises(ValueError, match="model and recipe"):
        shadow_request(original, b"t" * 16, route("x", "y", recipe="r2"))


def test_results_must_agree_bit_for_bit() -> None:
    row = np.random.default_rng(1).standard_normal(64).astype(np.float32)
    a = step_result(b"s" * 16, 0, row, swarm_pb2.SignedAdmission(), top_k=8)
    b = step_result(b"t" * 16, 0, row.copy(), swarm_pb2.SignedAdmission(), top_k=8)
    assert compare_results(0, a, b) is None and result_digest(a) == result_digest(b)
    bent = row.copy()
    bent[int(np.argmax(row))] += 1e-3
    c = step_result(b"t" * 16, 0, bent, swarm_pb2.SignedAdmission(), top_k=8)
    mismatch = compare_results(0, a, c)
    assert mismatch is not None and mismatch.output == "top-8 logits" and result_digest(c) == mismatch.returned_sha256
    c.checksum ^= 1
    with pytest.raises(ValueError, match="checksum"):
        compare_results(0, a, c)


def test_tokens_are_taken_back_from_the_first_session_through_a_withdrawn_peer() -> None:
    segments = [
        RouteSegment(0, frozenset({"a", "b"})),
        RouteSegment(5, frozenset({"a", "c"})),
        RouteSegment(9, frozenset({"d", "c"})),
    ]
    assert rollback_point(segments, []) is None and rollback_point(segments, {"x"}) is None
    assert rollback_point(segments, {"c"}) == 5
    assert rollback_point(segments, {"d", "b"}) == 0
    assert rollback_point(segments, {"d"}) == 9
