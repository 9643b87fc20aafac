"""The tracker's settings (``TrackerConfig``) and its clock (``trio_unix_clock``).

Must not import the tracker's service, store or verifier: they import this module.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import trio

from agent.core.tracker.canary import CanaryPolicy

__all__ = ["TrackerConfig", "trio_unix_clock"]


@dataclasses.dataclass(frozen=True)
class TrackerConfig:
    """Tracker settings. ``llama_cpp_commit`` / ``patch_series_sha256``: what nodes must run
    (the CLI defaults them to ``agent.runtime.expected_pin()``)."""

    llama_cpp_commit: str
    patch_series_sha256: str
    heartbeat_interval_ms: int = 1000
    heartbeat_timeout_ms: int = 5000
    admission_ttl_ms: int = 600_000
    registration_max_age_ms: int = 60_000
    #: nonces are kept this long; must exceed registration_max_age_ms (older ones are stale anyway)
    nonce_retention_ms: int = 600_000
    #: estimated link latency per hop, for route planning
    hop_latency_s: float = 0.002
    #: how long a lost-peer probe waits for the peer to answer
    lost_peer_probe_timeout_s: float = 1.0
    #: a route handed out counts as a session on its hops until a heartbeat from the hop sent
    #: this long after it (by then the session shows in the node's own count, or never came)
    route_handout_grace_s: float = 2.0
    #: sessions one route's ranges take before routes go elsewhere (0: each worker's sequences)
    route_session_cap: int = 0
    #: read every registered file's metadata and hash its tensors when the tracker starts,
    #: so the first node to ask for a manifest does not wait (else: on the first request)
    prepare_manifests_at_start: bool = True
    #: canary checks of what nodes compute (``agent.core.tracker.canary``; run by
    #: ``agent.io.tracker.verifier``); None: no checks, every READY range is routed
    canary: CanaryPolicy | None = None
    #: an owner asking about a peer (``integrity``) hears of its failed checks this recent
    integrity_memory_ms: int = 3_600_000

    def __post_init__(self) -> None:
        for name in ("heartbeat_interval_ms", "heartbeat_timeout_ms", "admission_ttl_ms", "registration_max_age_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.heartbeat_timeout_ms <= self.heartbeat_interval_ms:
            raise ValueError(
                f"heartbeat_timeout_ms ({self.heartbeat_timeout_ms}) must exceed heartbeat_interval_ms "
                f"({self.heartbeat_interval_ms})"
            )
        if self.nonce_retention_ms <= self.registration_max_age_ms:
            raise ValueError("nonce_retention_ms must exceed registration_max_age_ms (or replays become possible)")


def trio_unix_clock() -> Callable[[], int]:
    """Unix time in ms that advances with ``trio.current_time()`` (so that a MockClock drives
    it), anchored to the wall clock when made. Call inside ``trio.run``."""
    wall_ms = time.time() * 1000.0
    start = trio.current_time()
    return lambda: round(wall_ms + (trio.current_time() - start) * 1000.0)
