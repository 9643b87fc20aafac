"""The verifier's reference: the tracker's own workers for the ranges it checks
(``ReferencePool``), started from the registered GGUF on first use and kept (at most
``VerifierConfig.max_reference_workers``, least recently used first out), shared by the ranges
that cut the model at the same blocks.

Resource handling: each worker runs in a task of the nursery the pool is given, which holds
its ``open_worker`` context until the worker is evicted or the nursery ends.

Must not import ``agent.io.tracker.service`` or the verifier's check loop (``verifier``).
"""

from __future__ import annotations

import logging

import trio

from agent.io.tracker.verifier_api import VerifierConfig
from agent.io.worker.client import ClientConfig
from agent.io.worker.process import WorkerHandle, open_worker, wait_environment

__all__ = ["ReferencePool"]

log = logging.getLogger(__name__)


class ReferencePool:
    """The tracker's reference workers by (model sha256, begin, end), started on first use.

    Each worker runs in a task of ``nursery`` that holds its ``open_worker`` context until it
    is evicted (least recently used beyond ``config.max_reference_workers``) or the nursery
    ends."""

    def __init__(self, nursery: trio.Nursery, config: VerifierConfig, ctx_size: int, batch_size: int) -> None:
        self._nursery = nursery
        self._config = config
        self._ctx_size = ctx_size
        self._batch_size = batch_size
        self._workers: dict[tuple[str, int, int], tuple[WorkerHandle, trio.Event]] = {}
        self._used: dict[tuple[str, int, int], float] = {}
        self._bos: dict[str, int | None] = {}

    def __len__(self) -> int:
        return len(self._workers)

    async def get(self, path: str, model_sha256: str, begin: int, end: int) -> WorkerHandle:
        """The running reference worker of ``[begin, end)`` (started now if needed).

        Raises:
          WorkerStartError, WorkerBinaryNotFound, OSError, ValueError: it could not start.
        """
        key = (model_sha256, begin, end)
        held = self._workers.get(key)
        if held is not None and held[0].process.poll() is not None:
            log.warning("reference worker [%d, %d) exited: %s", begin, end, held[0].log_tail(300))
            held[1].set()
            self._workers.pop(key, None)
            held = None
        if held is None:
            handle = await self._nursery.start(self._hold, key, path)
        else:
            handle = held[0]
        self._used[key] = trio.current_time()
        excess = len(self._workers) - self._config.max_reference_workers
        for old in sorted(self._workers, key=lambda k: self._used.get(k, 0.0))[: max(0, excess)]:
            if old != key:
                self._workers.pop(old)[1].set()
        return handle

    async def _hold(self, key: tuple[str, int, int], path: str, task_status: trio.TaskStatus[WorkerHandle]) -> None:  # type: ignore[name-defined]  # trio-typing's stale trio stubs
        """Start the worker of ``key`` and keep it until evicted. A failure to start is raised
        to ``get``; one after (the worker's exit) is logged: it must not end the verifier."""
        model_sha256, begin, end = key
        cfg = self._config
        stop = trio.Event()
        started = False
        try:
            # a reference worker on a host that runs nodes too must not spin on their cores
            environment, wait = wait_environment(cfg.worker_wait)
            log.info(
                "reference worker for model %s blocks [%d, %d): idle threads %s", model_sha256[:12], begin, end, wait
            )
            async with open_worker(
                path, begin, end, ctx_size=self._ctx_size, max_sequences=1, batch_size=self._batch_size,
                threads=cfg.threads, model_sha256=model_sha256, ready_timeout_s=cfg.worker_ready_timeout_s,
                client_config=ClientConfig(timeout_s=cfg.worker_call_timeout_s), binary=cfg.worker_binary,
                environment=environment,
            ) as handle:  # fmt: skip
                if handle.info.model_sha256 and handle.info.model_sha256 != model_sha256:
                    raise ValueError(
                        f"the reference worker loaded model {handle.info.model_sha256}, not {model_sha256}"
                    )
                self._workers[key] = (handle, stop)
                log.info("reference worker for model %s blocks [%d, %d) ready", model_sha256[:12], begin, end)
                task_status.started(handle)
                started = True
                await stop.wait()
        except Exception:
            if not started:
                raise
            log.exception("reference worker for model %s blocks [%d, %d) failed", model_sha256[:12], begin, end)
        finally:
            if self._workers.get(key, (None, None))[1] is stop:
                del self._workers[key]
            self._used.pop(key, None)

    async def bos_token(self, handle: WorkerHandle) -> int | None:
        """The BOS token the model's tokenizer adds (None: it adds none)."""
        sha = handle.info.model_sha256
        if sha not in self._bos:
            ids = await handle.client.tokenize("", add_special=True)
            self._bos[sha] = ids[0] if ids else None
        return self._bos[sha]
