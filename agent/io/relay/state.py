"""The state the relay's handlers share (``RelayState``: the swarm client, the store, the vocabularies, the metrics,
the waiting line, the tracker's model list cached).

Must not import the relay's app, completions or server (they import this module).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import trio

from agent._proto import swarm_pb2
from agent.core.relay.openai_api import ApiError
from agent.io.client import SwarmClient, SwarmError
from agent.io.net.transport import TransportError
from agent.io.worker.vocab import VocabularyPool

from .config import RelayConfig
from .metrics import RelayMetrics
from .queue import RelayQueue
from .store import RelayStore

__all__ = ["RelayConfig", "RelayState"]

log = logging.getLogger(__name__)


class RelayState:
    """What the app's handlers share (made by ``serve_relay``)."""

    def __init__(
        self,
        config: RelayConfig,
        client: SwarmClient,
        store: RelayStore,
        vocabularies: VocabularyPool,
        metrics: RelayMetrics,
        now_s: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.client = client
        self.store = store
        self.vocabularies = vocabularies
        self.metrics = metrics
        self.now_s = now_s
        self.concurrent: dict[str, int] = {}
        #: tokens held by each key's requests in flight (``auth.reserve``, until ``auth.settle``)
        self.reserved: dict[str, int] = {}
        self.live_sessions = 0
        #: the line requests wait in for a free sequence, first come, first served
        self.queue = RelayQueue(
            timeout_s=config.queue_timeout_s, retry_min_s=config.queue_retry_min_s, retry_max_s=config.queue_retry_max_s
        )
        self._models: list[swarm_pb2.ModelEntry] = []
        self._models_at = -math.inf
        self._models_lock = trio.Lock()
        self._nodes: list[swarm_pb2.NodeEntry] = []
        self._nodes_at = -math.inf
        self._nodes_lock = trio.Lock()

    async def models(self) -> list[swarm_pb2.ModelEntry]:
        """The tracker's registered models (cached ``models_cache_s``).

        Raises:
          ApiError: 503 when the tracker cannot be reached and nothing is cached.
        """
        async with self._models_lock:  # one request at a time refreshes; the others take its answer
            if trio.current_time() - self._models_at > self.config.models_cache_s:
                try:
                    self._models = await self.client.list_models()
                    self._models_at = trio.current_time()
                except (SwarmError, TransportError) as error:
                    if not self._models:
                        raise ApiError(503, f"the tracker cannot be reached: {error}") from None
                    log.warning("model list from the tracker failed, using the last one: %s", error)
        return self._models

    async def nodes(self) -> list[swarm_pb2.NodeEntry]:
        """The tracker's node list, cached as the models are (``models_cache_s``): the status page
        is open to anyone, so its hits cost the tracker one round trip a period, not one each.

        Raises:
          SwarmError, TransportError: the tracker cannot be reached (nothing cached is shown).
        """
        async with self._nodes_lock:
            if trio.current_time() - self._nodes_at > self.config.models_cache_s:
                self._nodes = await self.client.list_nodes()
                self._nodes_at = trio.current_time()
        return self._nodes

    async def model(self, name: str) -> swarm_pb2.ModelEntry:
        """The registered model ``name`` (alias, name or sha256). Raises ApiError 404."""
        for entry in await self.models():
            if name in (entry.alias, entry.name, entry.sha256) and name:
                return entry
        raise ApiError(404, f"The model '{name}' does not exist", param="model")
