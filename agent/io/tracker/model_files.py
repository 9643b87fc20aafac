"""The tracker's registered model files: the model list as peers see it (``has_source``), where
nodes may fetch a model's bytes (``source_urls``), and each file's metadata prefix and
tracker-signed manifest (``file_facts``: read and hashed once, in a thread, then kept in
memory), which answer ``model_metadata`` requests and the verifier's ``canary_target``.

Owns the ``--serve-models`` base URL (``model_base_url``) and the in-memory caches of metadata
and manifests; the registry itself is the store's.

Must not import ``agent.io.tracker.service`` (which holds a ``ModelFiles``) or the verifier.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent._proto import swarm_pb2
from agent.core.wire.manifest import ManifestError, build_manifest, sign_manifest
from agent.io.tracker.gguf_info import GgufError, read_registered_file
from agent.io.tracker.refusal import Refusal
from agent.io.tracker.store import TrackerStore

__all__ = ["ModelFiles"]

log = logging.getLogger(__name__)

Code = swarm_pb2.Error


class ModelFiles:
    """The registered models' files as the tracker serves their facts. Made by ``Tracker``
    (its ``model_files``); ``peer_id`` and ``key`` are the tracker's (they sign manifests)."""

    def __init__(self, store: TrackerStore, key: Ed25519PrivateKey, peer_id: str, clock: Callable[[], int]) -> None:
        self.store = store
        self._key = key
        self.peer_id = peer_id
        self._now_ms = clock
        #: model sha256 -> its GGUF's metadata prefix (read once, on the first request)
        self._metadata: dict[str, bytes] = {}
        self._manifests: dict[str, swarm_pb2.SignedManifest] = {}
        self._metadata_locks: dict[str, trio.Lock] = {}
        #: set when this tracker serves its registered files over HTTP (``--serve-models``):
        #: every registered model with a file then has the source ``<base>/models/<sha256>.gguf``
        self.model_base_url = ""

    def source_urls(self, sha256: str) -> list[str]:
        """Where nodes may fetch model ``sha256``'s bytes by range: its registered source, and
        this tracker's own model server when it runs and has the file."""
        urls = [url for url in [self.store.model_source(sha256)] if url]
        if self.model_base_url and self.store.model_path(sha256) is not None:
            urls.append(f"{self.model_base_url.rstrip('/')}/models/{sha256}.gguf")
        return urls

    def models(self) -> list[swarm_pb2.ModelEntry]:
        """The registered models, ``has_source`` filled in."""
        entries = self.store.models()
        for entry in entries:
            entry.has_source = bool(self.source_urls(entry.sha256))
        return entries

    async def model_metadata(self, request: swarm_pb2.ModelMetadataRequest) -> swarm_pb2.ModelMetadataReply:
        if not request.model:
            raise Refusal(Code.INVALID_ARGUMENT, "ModelMetadataRequest.model is empty (give an alias, name or sha256)")
        model = self.store.find_model(request.model)
        if model is None:
            raise Refusal(Code.NOT_FOUND, f"unknown model {request.model!r}")
        metadata, manifest = await self.file_facts(model)
        return swarm_pb2.ModelMetadataReply(
            model_sha256=model.sha256,
            name=model.name,
            alias=model.alias,
            architecture=model.architecture,
            n_layer=model.n_layer,
            size_bytes=model.size_bytes,
            metadata=b"" if request.without_metadata else metadata,
            context_length=model.context_length,
            manifest=manifest,
            source_urls=self.source_urls(model.sha256),
        )

    async def file_facts(self, model: swarm_pb2.ModelEntry) -> tuple[bytes, swarm_pb2.SignedManifest]:
        """The metadata prefix and the signed manifest of ``model``'s registered file: read
        (one pass: size and sha256 checked, tensors hashed) in a thread on the first request
        (concurrent first requests share one read), then from memory. A failed read is not
        remembered: the next request tries again (the file may be back)."""
        cached = self._metadata.get(model.sha256)
        if cached is not None:
            return cached, self._manifests[model.sha256]
        async with self._metadata_locks.setdefault(model.sha256, trio.Lock()):
            cached = self._metadata.get(model.sha256)
            if cached is not None:
                return cached, self._manifests[model.sha256]
            path = self.store.model_path(model.sha256)
            if path is None:
                raise Refusal(
                    Code.UNAVAILABLE,
                    f"model {model.alias} ({model.sha256[:12]}) has no registered file "
                    "(the database predates recorded paths): register it again with --register-model",
                )
            try:
                metadata, tensors = await trio.to_thread.run_sync(
                    read_registered_file, path, model.sha256, model.size_bytes
                )
                manifest = build_manifest(
                    model_sha256=model.sha256, size_bytes=model.size_bytes, metadata_size=len(metadata),
                    metadata_sha256=hashlib.sha256(metadata).hexdigest(), architecture=model.architecture,
                    n_layer=model.n_layer, tensors=tensors, tracker_peer_id=self.peer_id, now_ms=self._now_ms(),
                )  # fmt: skip
            except (OSError, GgufError, ManifestError) as error:
                log.warning("cannot read model %s: %s", model.alias, error)
                reason = str(error).replace(str(path), path.name)  # the tracker's directories stay private
                raise Refusal(
                    Code.UNAVAILABLE, f"the registered file of model {model.alias} cannot be read any more: {reason}"
                ) from None
            self._manifests[model.sha256] = sign_manifest(self._key, manifest)
            self._metadata[model.sha256] = metadata
            return metadata, self._manifests[model.sha256]

    async def prepare_manifests(self) -> None:
        """Read the metadata and hash the tensors of every registered model with a file, one
        at a time, so that the first node that asks does not wait for it (failures are logged;
        requests try again)."""
        for model in self.store.models():
            if self.store.model_path(model.sha256) is None:
                continue
            try:
                await self.file_facts(model)
            except Refusal as refusal:
                log.warning("model %s: %s", model.alias, refusal.message)
            else:
                log.info("manifest of model %s ready", model.alias)
