"""The relay's Prometheus metrics (served at ``/metrics``) and its recent tokens/s figure.

Owns: one ``prometheus_client.CollectorRegistry`` per ``RelayMetrics``, never the process-global
one, so that several relays (or tests) in one process keep separate counts; the metric names and
buckets; a rolling count of completion tokens for the status page; the nodes' prefix cache
figures as the tracker's node list last gave them (``set_prefix_caches``: its counters are the
workers', since each started, so they are exposed as they are, not counted here). Time is
passed in (``now_s``, any monotonic clock in seconds): nothing here reads a clock.

Must not import trio, Starlette or anything of the relay's I/O: the server calls these methods.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

__all__ = [
    "INTER_TOKEN_BUCKETS_S",
    "TIME_TO_FIRST_TOKEN_BUCKETS_S",
    "RelayMetrics",
]

# Time to first token covers queueing, tokenization and a whole prompt's prefill along a route:
# tens of milliseconds on a warm loopback swarm, up to a minute for a long prompt on slow peers.
TIME_TO_FIRST_TOKEN_BUCKETS_S: tuple[float, ...] = (
    0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, math.inf,
)  # fmt: skip
# One decode step along a route: 5 ms (one local machine) to 5 s (many slow hops), roughly
# log-spaced so that each bucket holds a comparable share of a wide distribution.
INTER_TOKEN_BUCKETS_S: tuple[float, ...] = (
    0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, math.inf,
)  # fmt: skip


class RelayMetrics:
    """The relay's counters, histograms and gauge, in a registry of their own.

    Args:
      recent_retention_s: how far back ``record_completion_tokens`` entries are kept; the
        largest ``window_s`` that ``recent_tokens_per_s`` accepts.

    Not thread-safe as a whole: the recent-tokens deque is meant to be used from the relay's
    trio thread (the prometheus_client metrics themselves are thread-safe).
    """

    def __init__(self, *, recent_retention_s: float = 300.0) -> None:
        if not recent_retention_s > 0:
            raise ValueError(f"recent_retention_s must be > 0, got {recent_retention_s}")
        self.recent_retention_s = recent_retention_s
        self.registry = CollectorRegistry()
        self._requests = Counter(
            "baton_relay_requests_total",
            "HTTP requests answered, by endpoint (route template) and status code.",
            ("endpoint", "status"),
            registry=self.registry,
        )
        self._errors = Counter(
            "baton_relay_errors_total",
            "HTTP requests answered with a status code of 400 or more.",
            ("status",),
            registry=self.registry,
        )
        self._prompt_tokens = Counter(
            "baton_relay_prompt_tokens_total", "Prompt tokens of completed requests.", registry=self.registry
        )
        self._completion_tokens = Counter(
            "baton_relay_completion_tokens_total", "Tokens generated for completed requests.", registry=self.registry
        )
        self._time_to_first_token = Histogram(
            "baton_relay_time_to_first_token_seconds",
            "From a request's arrival to its first generated token.",
            buckets=TIME_TO_FIRST_TOKEN_BUCKETS_S,
            registry=self.registry,
        )
        self._inter_token = Histogram(
            "baton_relay_inter_token_seconds",
            "Between two consecutive generated tokens of one session.",
            buckets=INTER_TOKEN_BUCKETS_S,
            registry=self.registry,
        )
        self._live_sessions = Gauge("baton_relay_live_sessions", "Generations in progress.", registry=self.registry)
        self._prefix_caches = _PrefixCaches()
        self.registry.register(self._prefix_caches)
        # (now_s, tokens), oldest first; pruned to recent_retention_s on every call.
        self._recent: collections.deque[tuple[float, int]] = collections.deque()

    def observe_request(self, endpoint: str, status: int) -> None:
        """Count one answered request.

        ``endpoint`` must come from a small fixed set (the route template, e.g.
        ``/v1/chat/completions``), never the raw request path: every distinct value is a new
        time series.
        """
        self._requests.labels(endpoint=endpoint, status=str(status)).inc()
        if status >= 400:
            self._errors.labels(status=str(status)).inc()

    def observe_tokens(self, prompt: int, completion: int) -> None:
        """Add one request's prompt and completion token counts (each >= 0)."""
        if prompt < 0 or completion < 0:
            raise ValueError(f"token counts must be >= 0, got prompt={prompt} completion={completion}")
        self._prompt_tokens.inc(prompt)
        self._completion_tokens.inc(completion)

    def observe_time_to_first_token(self, seconds: float) -> None:
        self._time_to_first_token.observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self._inter_token.observe(seconds)

    def session_started(self) -> None:
        self._live_sessions.inc()

    def session_ended(self) -> None:
        self._live_sessions.dec()

    def set_prefix_caches(self, caches: Sequence[Mapping[str, Any]]) -> None:
        """The nodes' prefix caches to expose from now on, one per range
        (``agent.core.relay.coverage.prefix_caches``); empty: none (the tracker is not reachable)."""
        self._prefix_caches.caches = list(caches)

    def render(self) -> tuple[bytes, str]:
        """The registry in the Prometheus text format: ``(body, content_type)``."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def record_completion_tokens(self, n: int, now_s: float) -> None:
        """Note ``n`` tokens generated at ``now_s``, for ``recent_tokens_per_s``.

        Separate from ``observe_tokens`` (which counts a request once it is done) so that a
        stream can be recorded token by token while it runs.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        self._prune(now_s)
        if n:
            self._recent.append((now_s, n))

    def recent_tokens_per_s(self, now_s: float, window_s: float = 60.0) -> float:
        """Tokens recorded in ``(now_s - window_s, now_s]``, divided by ``window_s``.

        Always divides by the whole window, so the figure ramps up over the first ``window_s``
        after a relay starts instead of jumping on its first token.
        """
        if not 0 < window_s <= self.recent_retention_s:
            raise ValueError(f"window_s must be in (0, {self.recent_retention_s}], got {window_s}")
        self._prune(now_s)
        start_s = now_s - window_s
        total = sum(n for t_s, n in self._recent if start_s < t_s <= now_s)
        return total / window_s

    def _prune(self, now_s: float) -> None:
        oldest_s = now_s - self.recent_retention_s
        while self._recent and self._recent[0][0] <= oldest_s:
            self._recent.popleft()


class _PrefixCaches(Collector):
    """Each node range's prefix cache, labelled by node, model and range (one series each: a
    swarm's ranges are few). Its counters come from the workers as they are."""

    _LABELS = ("peer_id", "model", "begin", "end")

    def __init__(self) -> None:
        self.caches: list[Mapping[str, Any]] = []

    def collect(self) -> Iterator[Metric]:
        counters = (
            ("lookups", "baton_node_prefix_cache_lookups", "Sessions opened asking the range's cache for a prefix."),
            ("hits", "baton_node_prefix_cache_hits", "Sessions opened with a prefix copied from the range's cache."),
            ("hit_tokens", "baton_node_prefix_cache_hit_tokens", "Prompt positions copied instead of computed."),
        )
        gauges = (
            ("hit_rate", "baton_node_prefix_cache_hit_ratio", "Hits / lookups of the range's prefix cache so far."),
            ("used_bytes", "baton_node_prefix_cache_bytes", "KV bytes the range's prefix cache holds now."),
            ("budget_bytes", "baton_node_prefix_cache_budget_bytes", "KV bytes the range's prefix cache may hold."),
        )
        families: list[tuple[str, CounterMetricFamily | GaugeMetricFamily]] = [
            (field, CounterMetricFamily(name, text, labels=self._LABELS)) for field, name, text in counters
        ]
        families += [(field, GaugeMetricFamily(name, text, labels=self._LABELS)) for field, name, text in gauges]
        for cache in self.caches:
            labels = [str(cache["peer_id"]), str(cache["model"]), str(cache["begin"]), str(cache["end"])]
            for field, family in families:
                family.add_metric(labels, float(cache[field]))
        for _field, family in families:
            yield family
