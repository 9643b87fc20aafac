"""The lifecycle of a node's ranges (``RangeRunner``): directives, and what the range book
(``agent.core.node.range_states``) decides about them performed. LOAD fetches the range's bytes
(``agent.io.node.fetch``) or checks a local file against the tracker's manifest, starts a
native worker (``agent.io.worker.process.open_worker``) for (model, begin, end) and reports
LOADING, then READY with the worker's recipe hash, or FAILED with the error; UNLOAD stops it;
a worker that dies is noticed.

Must not import ``data_plane``, ``sessions``, ``handlers`` or ``agent`` (they build on this
module).
"""

from __future__ import annotations

import logging

import trio

from agent._proto import swarm_pb2
from agent.core.node.kept_rows import KeptStore
from agent.core.node.range_states import (
    Action,
    FailPending,
    HeartbeatNow,
    Ignored,
    RangeKey,
    StartRange,
    StopRange,
    range_name,
)
from agent.core.node.scheduler import StepScheduler
from agent.core.node.sessions import SessionTable, trusted_reserve
from agent.core.wire.manifest import ManifestError
from agent.core.wire.step_validation import RangeSpec
from agent.io.worker.client import ClientConfig
from agent.io.worker.error import WorkerError
from agent.io.worker.process import WorkerBinaryNotFound, WorkerStartError, open_worker, wait_environment
from agent.models import sha256_file

from .batches import BatchServing
from .config import LocalModel, worker_config
from .fetch import (
    FetchError,
    FetchProgress,
    FetchRefused,
    ModelMismatch,
    fetch_range,
    model_file_path,
    verify_local_range,
)
from .state import ServedRange
from .tracker_link import TrackerLink

__all__ = ["RangeRunner"]

log = logging.getLogger(__name__)

Code = swarm_pb2.Error.Code
State = swarm_pb2.AssignmentStatus.State


def _data_listen(host: str | None) -> str | None:
    """The worker's ``--data-listen`` for ``NodeConfig.data_plane_host`` (any free port)."""
    if host is None:
        return None
    return f"[{host}]:0" if ":" in host else f"{host}:0"


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


class RangeRunner(BatchServing, TrackerLink):
    """Starts, serves and stops the node's ranges (a part of ``agent.io.node.agent.Node``)."""

    def _apply_directive(self, directive: swarm_pb2.Directive, nursery: trio.Nursery) -> None:
        a = directive.assignment
        key: RangeKey = (a.model_sha256, a.begin, a.end)
        kind = swarm_pb2.Directive.Kind.Name(directive.kind) if directive.kind in (1, 2) else str(directive.kind)
        log.info("directive %s %s", kind, range_name(key))
        actions = self.book.directive(directive.kind, key)
        entry = self.book.entry(key)
        if entry is not None and (key, entry.epoch) not in self._instances:
            self._instances[(key, entry.epoch)] = ServedRange(entry=entry, model=self.models.get(a.model_sha256))
        self._perform(actions, nursery)

    def _notice_worker_exits(self, nursery: trio.Nursery) -> None:
        """A READY range whose worker died while idle (a Forward notices it at once)."""
        for served in list(self._instances.values()):
            if (
                served.state == State.READY
                and served.handle is not None
                and (reason := self._exit_reason(served.handle))
            ):
                self._perform(self.book.worker_exited(served.key, served.entry.epoch, reason), nursery)

    def _perform(self, actions: list[Action], nursery: trio.Nursery) -> None:
        """Do what the range book decided."""
        for action in actions:
            if isinstance(action, StartRange):
                nursery.start_soon(self._run_range, self._instances[(action.key, action.epoch)], action, nursery)
            elif isinstance(action, StopRange):
                if (served := self._instances.get((action.key, action.epoch))) is not None:
                    served.cancel_scope.cancel()
            elif isinstance(action, FailPending):
                if (served := self._instances.get((action.key, action.epoch))) is not None:
                    leftover = served.in_forward + (served.scheduler.drain() if served.scheduler is not None else [])
                    served.in_forward = []
                    for _seq_id, step in leftover:
                        nursery.start_soon(
                            self._guarded, self._send_error, step, Code.UNAVAILABLE, action.message, self.peer_id
                        )
            elif isinstance(action, HeartbeatNow):
                self.heartbeat_soon()
            elif isinstance(action, Ignored):
                log.warning("%s", action.warning)
        for key, epoch in list(self._instances):  # instances the book no longer knows are gone
            if self.book.instance(key, epoch) is None:
                del self._instances[(key, epoch)]

    async def _run_range(self, served: ServedRange, start: StartRange, nursery: trio.Nursery) -> None:
        """Fetch or check the model of ``served``, start its worker and serve its batches until
        cancelled (UNLOAD) or until the worker dies; the range book hears why it stopped."""
        error = ""
        try:
            with served.cancel_scope:
                if start.fetch:
                    served.model = await self._fetch_model(served)
                    self._perform(self.book.fetched(start.key, start.epoch), nursery)
                elif start.verify_local:
                    await self._verify_local_model(served)
                error = await self._load_and_serve(served, nursery)
                log.warning("FAILED %s: %s", range_name(served.key), error)
        except (FetchRefused, FetchError, ManifestError, ModelMismatch) as err:
            error = _first_line(err)
            log.warning("FAILED %s: %s", range_name(served.key), err)
        except (WorkerStartError, WorkerBinaryNotFound, WorkerError, OSError, ValueError) as err:
            error = _first_line(err)
            log.warning("FAILED %s: %s", range_name(served.key), err)
        finally:
            served.handle = None
            self._perform(self.book.stopped(start.key, start.epoch, error), nursery)
            served.stopped.set()

    async def _verify_local_model(self, served: ServedRange) -> None:
        """Before a local file's range is served: its bytes for the range must be the ones the
        tracker's manifest names (per tensor), whatever the file's size and mtime say (a cached
        whole-file hash is trusted by those alone). Without a manifest (the tracker has none
        for this model), the whole file is hashed afresh against the registered sha256.

        Raises:
          ModelMismatch: a tensor (named) or the file differs from the registered model.
        """
        model = served.model
        assert model is not None
        _, begin, end = served.key
        try:
            manifest, _sources = await self._manifest(model.sha256)
        except (FetchError, ManifestError) as err:
            log.info(
                "%s: no manifest to check %s against (%s): hashing the whole file",
                range_name(served.key),
                model.path,
                err,
            )
            digest = await trio.to_thread.run_sync(sha256_file, model.path)
            if digest != model.sha256:
                raise ModelMismatch(
                    f"{model.path} hashes to {digest}, not the registered {model.sha256}: the file changed"
                ) from None
            return
        await trio.to_thread.run_sync(verify_local_range, model.path, manifest, begin, end)
        log.info("%s: the tensors of %s match the tracker's manifest", range_name(served.key), model.path)

    async def _fetch_model(self, served: ServedRange) -> LocalModel:
        """Fetch the bytes ``served``'s range needs into ``config.models_dir`` (the manifest
        from the tracker, checked against its key; the bytes from the first source that
        delivers them); progress goes into the range's heartbeat status.

        Raises:
          ManifestError: the tracker sent no usable manifest, or names no source.
          FetchRefused: a tensor hashed wrong on every attempt (names tensor and source).
          FetchError: no source could deliver.
        """
        model_sha256, begin, end = served.key
        assert self.config.models_dir is not None
        manifest, sources = await self._manifest(model_sha256)
        if not sources:
            raise ManifestError(f"the tracker names no source to fetch model {model_sha256} from")
        dest = model_file_path(self.config.models_dir, model_sha256)

        def progress(update: FetchProgress) -> None:
            served.fetch_progress = update

        errors: list[FetchError | FetchRefused] = []
        async with self._fetch_locks.setdefault(model_sha256, trio.Lock()):
            for url in sources:
                try:
                    log.info("fetching %s from %s into %s", range_name(served.key), url, dest)
                    await fetch_range(
                        manifest, [(begin, end)], url, dest, config=self.config.fetch, on_progress=progress
                    )
                    break
                except (FetchError, FetchRefused) as err:  # this source failed: try the next one
                    log.warning("%s: %s", range_name(served.key), err)
                    errors.append(err)
            else:
                refusals = [e for e in errors if isinstance(e, FetchRefused)]
                if refusals:
                    raise refusals[0]  # names the tensor and the source
                raise FetchError("; ".join(str(e) for e in errors))
        return LocalModel(path=str(dest), sha256=model_sha256)

    async def _load_and_serve(self, served: ServedRange, pushes: trio.Nursery) -> str:
        """Run the worker of ``served``; returns why it stopped serving (the worker died).
        Outputs are pushed in ``pushes`` (the node's nursery: a push under way when the range
        stops, e.g. UNLOAD, still reaches its next hop or owner).

        Raises:
          WorkerStartError, WorkerBinaryNotFound, OSError, ValueError: it could not start.
        """
        model = served.model
        assert model is not None
        _, begin, end = served.key
        cfg = self.config
        environment, wait = wait_environment(cfg.worker_wait, node_marker=self.host_marker)
        log.info("%s: the worker's idle threads %s", range_name(served.key), wait)
        async with open_worker(
            model.path, begin, end, config=worker_config(cfg), model_sha256=model.sha256,
            ready_timeout_s=cfg.worker_ready_timeout_s, stop_grace_s=cfg.worker_stop_grace_s,
            client_config=ClientConfig(timeout_s=cfg.worker_call_timeout_s),
            binary=cfg.worker_binary, environment=environment, data_listen=_data_listen(cfg.data_plane_host),
        ) as handle:  # fmt: skip
            info = handle.info
            if info.model_sha256 and info.model_sha256 != model.sha256:
                raise ValueError(f"worker loaded model {info.model_sha256}, expected {model.sha256}")
            if (info.layer_begin, info.layer_end) != (begin, end):
                raise ValueError(
                    f"worker serves blocks [{info.layer_begin}, {info.layer_end}), expected [{begin}, {end})"
                )
            served.handle, served.info = handle, info
            served.spec = RangeSpec(
                model_sha256=model.sha256, begin=begin, end=end, n_layer=info.n_layer, n_embd=info.n_embd,
                n_vocab=info.n_vocab, recipe_hash=info.recipe_hash, n_batch_max=min(info.n_batch_max, cfg.row_budget or info.n_batch_max),
                boundary=info.boundary.schema,
            )  # fmt: skip
            served.sessions = SessionTable(
                info.n_seq_max, info.n_ctx_per_sequence, max_per_owner=max(1, int(cfg.owner_max_share * info.n_seq_max)),
                reserve_for_trusted=trusted_reserve(info.n_seq_max, cfg.trusted_reserve_share, bool(cfg.trusted_owners)),
            )  # fmt: skip
            served.kept = KeptStore(cfg.kept_rows_max_bytes)
            self.allow_steps_of(served.spec)
            served.scheduler = StepScheduler(info.n_batch_max, info.n_seq_max, row_budget=served.spec.n_batch_max)
            self._perform(self.book.ready(served.key, served.entry.epoch, info.recipe_hash), pushes)
            log.info("READY %s (recipe %s)", range_name(served.key), info.recipe_hash[:12])
            return await self._serve_batches(served, handle, pushes)
