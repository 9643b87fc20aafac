"""agent.io.relay.metrics: every metric in the exposition, one registry per relay, recent tokens/s."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.io.relay.metrics import RelayMetrics

pytestmark = pytest.mark.unit


def samples(metrics: RelayMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``render()``, parsed back, keyed by (name, sorted labels)."""
    body, _ = metrics.render()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body.decode("utf-8"))
        for sample in family.samples
    }


def test_every_metric_appears_after_use_and_parses() -> None:
    metrics = RelayMetrics()
    metrics.observe_request("/v1/chat/completions", 200)
    metrics.observe_request("/v1/chat/completions", 200)
    metrics.observe_request("/v1/completions", 429)
    metrics.observe_tokens(prompt=12, completion=30)
    metrics.observe_tokens(prompt=3, completion=0)
    metrics.observe_time_to_first_token(0.3)
    metrics.observe_inter_token(0.004)
    metrics.observe_inter_token(0.04)
    metrics.session_started()
    metrics.session_started()
    metrics.session_ended()

    body, content_type = metrics.render()
    assert isinstance(body, bytes)
    assert content_type.startswith("text/plain")
    families = {family.name: family for family in text_string_to_metric_families(body.decode("utf-8"))}
    assert {
        "baton_relay_requests": "counter",
        "baton_relay_errors": "counter",
        "baton_relay_prompt_tokens": "counter",
        "baton_relay_completion_tokens": "counter",
        "baton_relay_time_to_first_token_seconds": "histogram",
        "baton_relay_inter_token_seconds": "histogram",
        "baton_relay_live_sessions": "gauge",
    }.items() <= {name: family.type for name, family in families.items()}.items()

    got = samples(metrics)
    assert got["baton_relay_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "200"))] == 2
    assert got["baton_relay_requests_total", (("endpoint", "/v1/completions"), ("status", "429"))] == 1
    assert got["baton_relay_errors_total", (("status", "429"),)] == 1
    assert ("baton_relay_errors_total", (("status", "200"),)) not in got
    assert got["baton_relay_prompt_tokens_total", ()] == 15
    assert got["baton_relay_completion_tokens_total", ()] == 30
    assert got["baton_relay_time_to_first_token_seconds_count", ()] == 1
    assert got["baton_relay_time_to_first_token_seconds_sum", ()] == pytest.approx(0.3)
    assert got["baton_relay_inter_token_seconds_count", ()] == 2
    assert got["baton_relay_live_sessions", ()] == 1


def test_inter_token_buckets_span_5_ms_to_5_s() -> None:
    metrics = RelayMetrics()
    for seconds in (0.004, 0.006, 4.0, 6.0):
        metrics.observe_inter_token(seconds)
    buckets = {
        float(dict(labels)["le"]): value
        for (name, labels), value in samples(metrics).items()
        if name == "baton_relay_inter_token_seconds_bucket"
    }
    assert min(buckets) == 0.005
    assert max(b for b in buckets if b != float("inf")) == 5.0
    assert buckets[0.005] == 1  # 4 ms
    assert buckets[5.0] == 3  # everything but 6 s
    assert buckets[float("inf")] == 4


def test_two_relays_do_not_share_counts() -> None:
    first, second = RelayMetrics(), RelayMetrics()
    first.observe_request("/v1/models", 200)
    first.observe_tokens(prompt=5, completion=7)
    first.session_started()

    got = samples(second)
    assert not any(name == "baton_relay_requests_total" for name, _ in got)
    assert got["baton_relay_prompt_tokens_total", ()] == 0
    assert got["baton_relay_completion_tokens_total", ()] == 0
    assert got["baton_relay_live_sessions", ()] == 0
    assert samples(first)["baton_relay_completion_tokens_total", ()] == 7


def test_token_counts_must_not_be_negative() -> None:
    metrics = RelayMetrics()
    with pytest.raises(ValueError):
        metrics.observe_tokens(prompt=-1, completion=0)
    with pytest.raises(ValueError):
        metrics.record_completion_tokens(-1, now_s=0.0)


def test_recent_tokens_per_s_counts_only_the_window() -> None:
    metrics = RelayMetrics(recent_retention_s=120.0)
    assert metrics.recent_tokens_per_s(now_s=1000.0) == 0.0
    metrics.record_completion_tokens(30, now_s=1000.0)
    metrics.record_completion_tokens(60, now_s=1030.0)
    metrics.record_completion_tokens(30, now_s=1059.0)

    # (1000, 1060]: the entry at exactly 1000 s has left the window
    assert metrics.recent_tokens_per_s(now_s=1060.0) == pytest.approx(90 / 60)
    assert metrics.recent_tokens_per_s(now_s=1059.0) == pytest.approx(120 / 60)
    assert metrics.recent_tokens_per_s(now_s=1059.0, window_s=10.0) == pytest.approx(30 / 10)
    assert metrics.recent_tokens_per_s(now_s=1100.0, window_s=120.0) == pytest.approx(120 / 120)
    assert metrics.recent_tokens_per_s(now_s=1200.0) == 0.0


def test_recent_tokens_are_pruned_past_the_retention() -> None:
    metrics = RelayMetrics(recent_retention_s=10.0)
    for second in range(1000):
        metrics.record_completion_tokens(1, now_s=float(second))
    assert len(metrics._recent) == 10
    assert metrics.recent_tokens_per_s(now_s=999.0, window_s=10.0) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        metrics.recent_tokens_per_s(now_s=999.0, window_s=11.0)
    with pytest.raises(ValueError):
        metrics.recent_tokens_per_s(now_s=999.0, window_s=0.0)


def test_each_range_s_prefix_cache_is_exposed_as_the_nodes_last_reported_it() -> None:
    metrics = RelayMetrics()
    cache = {
        "peer_id": "12D3KooWNode", "model": "smollm2", "begin": 0, "end": 10, "alive": True, "lookups": 10,
        "hits": 9, "hit_tokens": 4608, "hit_rate": 0.9, "used_bytes": 12 << 20, "budget_bytes": 64 << 20,
    }  # fmt: skip
    metrics.set_prefix_caches([cache, {**cache, "peer_id": "12D3KooWOther", "hits": 0, "hit_rate": 0.0}])
    families = {f.name: f.type for f in text_string_to_metric_families(metrics.render()[0].decode())}
    assert {
        "baton_node_prefix_cache_lookups": "counter",
        "baton_node_prefix_cache_hits": "counter",
        "baton_node_prefix_cache_hit_tokens": "counter",
        "baton_node_prefix_cache_hit_ratio": "gauge",
        "baton_node_prefix_cache_bytes": "gauge",
        "baton_node_prefix_cache_budget_bytes": "gauge",
    }.items() <= families.items()
    got = samples(metrics)
    labels = (("begin", "0"), ("end", "10"), ("model", "smollm2"), ("peer_id", "12D3KooWNode"))
    assert got["baton_node_prefix_cache_hits_total", labels] == 9
    assert got["baton_node_prefix_cache_hit_ratio", labels] == 0.9
    assert got["baton_node_prefix_cache_bytes", labels] == 12 << 20
    assert got["baton_node_prefix_cache_budget_bytes", labels] == 64 << 20
    assert got["baton_node_prefix_cache_hit_ratio", (*labels[:3], ("peer_id", "12D3KooWOther"))] == 0.0
    metrics.set_prefix_caches([])  # the tracker could not be asked: no series rather than stale ones
    assert not [key for key in samples(metrics) if key[0].startswith("baton_node_")]
