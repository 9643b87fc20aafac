"""gRPC client of one native shard worker (``protocol/worker.proto``) on a Unix socket.

Owns the channel, deadlines, and the mapping of gRPC failures onto ``WorkerError``
(``agent.io.worker.error``); the conversions between ``agent.core.wire.worker_records`` and the
generated protobuf messages are ``agent.io.worker.messages``, and Forward over the worker's
Forward socket is ``agent.io.worker.stream``.
``WorkerClient`` is synchronous; ``AsyncWorkerClient`` offers the same calls to trio code
by running them in worker threads (grpcio's asyncio API needs an asyncio loop and must
not be used under trio).

Makes no decisions (those live in ``agent.core``) and starts no processes
(``agent.io.worker.process`` does).
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any, TypeVar

import grpc
import outcome
import trio

from agent._proto import worker_pb2, worker_pb2_grpc
from agent.core.wire.worker_records import (
    SCHEMA_VERSION,
    ForwardTiming,
    SeqInput,
    SeqOutput,
    Vocabulary,
    WorkerHealth,
    WorkerInfo,
)
from agent.io.worker.error import WorkerError
from agent.io.worker.messages import (
    _health_from_reply,
    _info_from_reply,
    _vocabulary_from_reply,
    detokenize_request,
    forward_outputs,
    forward_request,
    tokenize_request,
)
from agent.io.worker.stream import _ForwardStream

__all__ = [
    "AsyncWorkerClient",
    "ClientConfig",
    "SeqInput",
    "SeqOutput",
    "Vocabulary",
    "WorkerClient",
    "WorkerHealth",
    "WorkerInfo",
]

T = TypeVar("T")

#: Largest gRPC message either way: a 512-row batch of logits over a 49152-token vocabulary
#: is 512 * 49152 * 4 bytes ~ 100 MB; twice that leaves room for bigger vocabularies.
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    """Knobs of one client. ``timeout_s``: the deadline of every call unless a call gives
    its own. The reconnect backoff is kept short because the peer is a local process that
    may simply not be listening yet (gRPC's default starts at 1 s and grows to 120 s)."""

    timeout_s: float = 60.0
    call_threads: int = 2  # AsyncWorkerClient: long-lived threads making the blocking calls
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    min_reconnect_backoff_ms: int = 20
    max_reconnect_backoff_ms: int = 200

    def channel_options(self) -> list[tuple[str, Any]]:
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", self.min_reconnect_backoff_ms),
            ("grpc.min_reconnect_backoff_ms", self.min_reconnect_backoff_ms),
            ("grpc.max_reconnect_backoff_ms", self.max_reconnect_backoff_ms),
            # One channel per worker: do not share a subchannel with other clients in the process.
            ("grpc.use_local_subchannel_pool", 1),
        ]


def _rpc_error(method: str, error: grpc.RpcError) -> WorkerError:
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else None
    name = code.name if code is not None else "UNKNOWN"
    return WorkerError(name, details or str(error), method=method)


# --- the synchronous client --------------------------------------------------------------


class WorkerClient:
    """Blocking client of one worker listening on ``unix:socket_path``.

    Every request carries ``schema_version = 1`` and a deadline (``timeout_s`` of the call,
    else the client's: ``timeout_s`` here, else ``config.timeout_s``). Any gRPC failure
    raises ``WorkerError``.

    Resource handling:
      Owns one gRPC channel, created here (connecting lazily) and released by ``close()``
      or by leaving ``with WorkerClient(...)``. Calls after ``close()`` raise.

    Thread safety:
      Calls may be made from several threads at once (grpc channels are thread-safe); the
      worker serialises state-changing calls itself.
    """

    def __init__(self, socket_path: str, config: ClientConfig | None = None, *, timeout_s: float | None = None) -> None:
        config = config or ClientConfig()
        if timeout_s is not None:
            config = dataclasses.replace(config, timeout_s=timeout_s)
        self.socket_path = str(socket_path)
        self.config = config
        self._channel = grpc.insecure_channel(f"unix:{self.socket_path}", options=self.config.channel_options())
        self._stub = worker_pb2_grpc.ShardWorkerStub(self._channel)
        self._info: WorkerInfo | None = None

    # lifecycle
    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> WorkerClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def cached_info(self) -> WorkerInfo | None:
        """The last Info this client received (needed to encode and decode Forward rows)."""
        return self._info

    # raw access
    def start_call(self, method: str, request: Any, timeout_s: float | None = None) -> grpc.Future:
        """Start ``method`` (e.g. ``"Forward"``) with a prepared protobuf request without
        waiting; ``finish_call`` waits for it. Used by ``AsyncWorkerClient``."""
        rpc = getattr(self._stub, method)
        return rpc.future(request, timeout=self.config.timeout_s if timeout_s is None else timeout_s)

    @staticmethod
    def finish_call(method: str, future: grpc.Future) -> Any:
        """Wait for a started call; return its reply or raise ``WorkerError``."""
        try:
            return future.result()
        except grpc.FutureCancelledError:
            raise WorkerError("CANCELLED", "the call was cancelled by the client", method=method) from None
        except grpc.RpcError as error:
            raise _rpc_error(method, error) from None

    def blocking_call(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        """``call`` as one blocking gRPC call on this thread (no polling thread is started)."""
        rpc = getattr(self._stub, method)
        try:
            return rpc(request, timeout=self.config.timeout_s if timeout_s is None else timeout_s)
        except grpc.RpcError as error:
            raise _rpc_error(method, error) from None

    def call(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        """Send a prepared protobuf ``request`` to ``method`` and return the raw reply.

        Nothing is added or checked: this is how tests send malformed requests.
        """
        return self.finish_call(method, self.start_call(method, request, timeout_s))

    # typed calls
    def info(self, *, timeout_s: float | None = None) -> WorkerInfo:
        reply = self.call("Info", worker_pb2.InfoRequest(schema_version=SCHEMA_VERSION), timeout_s)
        self._info = _info_from_reply(reply)
        return self._info

    def health(self, *, timeout_s: float | None = None, prefix_tags_max: int = 0) -> WorkerHealth:
        """The worker's counts; with ``prefix_tags_max``, that many of its prefix cache's tags."""
        request = worker_pb2.HealthRequest(schema_version=SCHEMA_VERSION, prefix_tags_max=prefix_tags_max)
        return _health_from_reply(self.call("Health", request, timeout_s))

    def forward(self, entries: Sequence[SeqInput], *, timeout_s: float | None = None) -> list[SeqOutput]:
        """One Forward batch: ``entries`` (at most one per sequence) in, outputs in the same order."""
        info = self._info or self.info(timeout_s=timeout_s)
        reply = self.call("Forward", forward_request(entries, info), timeout_s)
        return forward_outputs(reply, info)

    def remove_sequence(self, seq_id: int, *, timeout_s: float | None = None) -> int:
        """Drop every cached position of ``seq_id``; returns the positions it holds after (0)."""
        request = worker_pb2.RemoveSequenceRequest(schema_version=SCHEMA_VERSION, seq_id=seq_id)
        return self.call("RemoveSequence", request, timeout_s).next_position

    def trim_sequence(self, seq_id: int, keep_positions: int, *, timeout_s: float | None = None) -> int:
        """Keep positions ``[0, keep_positions)`` of ``seq_id``; returns the positions it holds."""
        request = worker_pb2.TrimSequenceRequest(
            schema_version=SCHEMA_VERSION, seq_id=seq_id, keep_positions=keep_positions
        )
        return self.call("TrimSequence", request, timeout_s).next_position

    def copy_sequence(self, src_seq_id: int, dst_seq_id: int, *, timeout_s: float | None = None) -> int:
        """Copy the cache of ``src_seq_id`` into the empty ``dst_seq_id``; returns its positions."""
        request = worker_pb2.CopySequenceRequest(
            schema_version=SCHEMA_VERSION, src_seq_id=src_seq_id, dst_seq_id=dst_seq_id
        )
        return self.call("CopySequence", request, timeout_s).next_position

    def tokenize(
        self, text: str, *, add_special: bool = True, parse_special: bool = False, timeout_s: float | None = None
    ) -> list[int]:
        request = tokenize_request(text, add_special, parse_special)
        return list(self.call("Tokenize", request, timeout_s).token_ids)

    def detokenize(
        self,
        token_ids: Sequence[int],
        *,
        remove_special: bool = False,
        unparse_special: bool = False,
        timeout_s: float | None = None,
    ) -> bytes:
        """The tokens' pieces joined, as bytes: decode what is whole (it may end inside a character)."""
        request = detokenize_request(token_ids, remove_special, unparse_special)
        return self.call("Detokenize", request, timeout_s).text

    def vocabulary(self, *, timeout_s: float | None = None) -> Vocabulary:
        """The model's whole vocabulary (any worker, vocab-only or not)."""
        reply = self.call("Vocabulary", worker_pb2.VocabularyRequest(schema_version=SCHEMA_VERSION), timeout_s)
        return _vocabulary_from_reply(reply)


# --- the trio client ---------------------------------------------------------------------


class _CallThreads:
    """Long-lived threads that make blocking gRPC calls for trio tasks.

    Why: grpcio's ``future()`` starts a channel-polling thread for a call made while no other
    call is in flight, and waits for it on the calling (event-loop) thread: ~0.7 ms per
    Forward with the loop blocked (bench/results/compare.md). A blocking call drives its own
    completion queue on the thread that makes it, so these threads start once and each call
    costs a queue put and a wake-up of the trio task (``TrioToken.run_sync_soon``).
    """

    def __init__(self, n_threads: int) -> None:
        if n_threads < 1:
            raise ValueError(f"call_threads must be >= 1, got {n_threads}")
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._run, name=f"baton-worker-call-{i}", daemon=True) for i in range(n_threads)
        ]
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, deliver = job
            try:
                result: Any = (True, fn())
            except BaseException as error:  # handed to the waiting task
                result = (False, error)
            deliver(result)

    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on a call thread; the trio task sleeps meanwhile (the loop runs on).

        Cancellation: the task returns at once with ``trio.Cancelled``; ``fn`` runs on to its
        end (or deadline) and its result is dropped.
        """
        token = trio.lowlevel.current_trio_token()
        task = trio.lowlevel.current_task()
        state = {"waiting": True}

        def wake(result: Any) -> None:
            def reschedule() -> None:
                if state["waiting"]:
                    state["waiting"] = False
                    trio.lowlevel.reschedule(task, _outcome(result))

            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(reschedule)

        self._jobs.put((fn, wake))

        def abort(_raise_cancel: Any) -> trio.lowlevel.Abort:
            state["waiting"] = False
            return trio.lowlevel.Abort.SUCCEEDED

        return await trio.lowlevel.wait_task_rescheduled(abort)

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)


def _outcome(result: tuple[bool, Any]) -> Any:
    ok, value = result
    return outcome.Value(value) if ok else outcome.Error(value)


class AsyncWorkerClient:
    """The calls of ``WorkerClient`` for trio code.

    Each call is a blocking gRPC call made on one of ``config.call_threads`` long-lived
    threads (``_CallThreads``): no thread starts per call and the trio loop never blocks on
    the network or on grpcio.

    Resource handling:
      Wraps (and owns) one ``WorkerClient`` and its call threads; ``aclose()`` or leaving
      ``async with`` closes its channel and ends the threads.

    Cancellation:
      Every call is a checkpoint and may be cancelled: ``trio.Cancelled`` propagates at
      once, and the call in its thread runs on to its end or deadline (the worker may or may
      not have executed it; a Forward may have advanced its sequences), so after cancelling a
      state-changing call, treat those sequences' positions as unknown (read them back from
      a later reply, or remove the sequences).
    """

    def __init__(
        self,
        socket_path: str,
        config: ClientConfig | None = None,
        *,
        timeout_s: float | None = None,
        forward_socket_path: str | None = None,
    ) -> None:
        self.sync = WorkerClient(socket_path, config, timeout_s=timeout_s)
        self._threads = _CallThreads(self.sync.config.call_threads)
        self._stream = (
            _ForwardStream(forward_socket_path, self.sync.config.max_message_bytes) if forward_socket_path else None
        )
        #: the time of the last Forward that returned outputs (None before the first)
        self.last_forward: ForwardTiming | None = None

    @property
    def socket_path(self) -> str:
        return self.sync.socket_path

    @property
    def cached_info(self) -> WorkerInfo | None:
        return self.sync.cached_info

    async def aclose(self) -> None:
        self._threads.close()
        self.sync.close()
        if self._stream is not None:
            await self._stream.close()
        await trio.lowlevel.checkpoint()

    async def __aenter__(self) -> AsyncWorkerClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def call(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        """Send a prepared protobuf request; see ``WorkerClient.call``."""
        return await self._threads.call(lambda: self.sync.blocking_call(method, request, timeout_s))

    async def _typed(self, method: str, request: Any, decode: Callable[[Any], T], timeout_s: float | None) -> T:
        return decode(await self.call(method, request, timeout_s))

    async def info(self, *, timeout_s: float | None = None) -> WorkerInfo:
        reply = await self.call("Info", worker_pb2.InfoRequest(schema_version=SCHEMA_VERSION), timeout_s)
        info = _info_from_reply(reply)
        self.sync._info = info
        return info

    async def health(self, *, timeout_s: float | None = None, prefix_tags_max: int = 0) -> WorkerHealth:
        request = worker_pb2.HealthRequest(schema_version=SCHEMA_VERSION, prefix_tags_max=prefix_tags_max)
        return await self._typed("Health", request, _health_from_reply, timeout_s)

    async def forward(self, entries: Sequence[SeqInput], *, timeout_s: float | None = None) -> list[SeqOutput]:
        """One Forward: over the Forward stream when the worker has one, else the gRPC call
        (the same request, reply and errors either way)."""
        info = self.cached_info or await self.info(timeout_s=timeout_s)
        started_ns = time.monotonic_ns()  # a duration for the caller's figures, not a deadline
        request = forward_request(entries, info)
        if self._stream is not None:
            reply = await self._stream.exchange(request, self.sync.config.timeout_s if timeout_s is None else timeout_s)
        else:
            reply = await self.call("Forward", request, timeout_s)
        outputs = forward_outputs(reply, info)
        call_us = (time.monotonic_ns() - started_ns) // 1000
        self.last_forward = ForwardTiming(compute_us=reply.compute_us, call_us=call_us)
        return outputs

    async def forward_run_ahead(
        self,
        entry: SeqInput,
        steps: int,
        stop_token_ids: Collection[int],
        on_output: Callable[[SeqOutput], Awaitable[bool]],
        *,
        timeout_s: float | None = None,
    ) -> int:
        """``entry``'s Forward, then up to ``steps`` greedy decode steps that the worker runs by
        itself (``SequenceInput.run_ahead_steps``): each feeds the previous output's greedy token
        (``top[-1].ids[0]``) at the next position, as a caller stepping one Forward at a time
        would, and the run ends after a token in ``stop_token_ids`` or at the context's end.
        ``on_output`` gets each output in order and returns whether to go on. Returns the
        positions the sequence holds on the worker afterwards: steps the worker ran ahead past
        the caller's stop are in it (trim them before going on from an earlier position).

        For a worker holding the whole model, with ``entry.top_k`` > 0. Without a Forward
        stream the steps are the caller's own Forwards (the same outputs, one call each).

        Raises:
          WorkerError: a refusal (INVALID_ARGUMENT: the worker or the entry does not allow a
            run-ahead) or a step's failure; the steps before it were given to ``on_output``.
        """
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        info = self.cached_info or await self.info(timeout_s=timeout_s)
        timeout = self.sync.config.timeout_s if timeout_s is None else timeout_s
        if self._stream is None:
            return await self._stepped_run_ahead(entry, steps, frozenset(stop_token_ids), on_output, info, timeout)
        request = forward_request([entry], info)
        request.entries[0].run_ahead_steps = steps
        request.entries[0].stop_token_ids.extend(int(t) for t in stop_token_ids)

        async def on_reply(reply: worker_pb2.ForwardReply) -> bool:
            return await on_output(forward_outputs(reply, info)[0])

        return await self._stream.run_ahead(request, timeout, on_reply)

    async def _stepped_run_ahead(
        self,
        entry: SeqInput,
        steps: int,
        stop: frozenset[int],
        on_output: Callable[[SeqOutput], Awaitable[bool]],
        info: WorkerInfo,
        timeout_s: float,
    ) -> int:
        """``forward_run_ahead`` as one Forward per step (a worker without a Forward stream)."""
        if not (info.takes_tokens and info.gives_logits) or not entry.top_k:
            raise WorkerError(
                "INVALID_ARGUMENT", "run-ahead needs a worker holding the whole model and top_k > 0", method="Forward"
            )
        for left in range(steps, -1, -1):
            (out,) = await self.forward([entry], timeout_s=timeout_s)
            token = int(out.top[-1].ids[0])
            if not await on_output(out) or not left or token in stop or out.next_position >= info.n_ctx_per_sequence:
                return out.next_position
            entry = SeqInput(seq_id=entry.seq_id, positions=[out.next_position], token_ids=[token], top_k=entry.top_k)
        raise AssertionError("unreachable")

    async def remove_sequence(self, seq_id: int, *, timeout_s: float | None = None) -> int:
        request = worker_pb2.RemoveSequenceRequest(schema_version=SCHEMA_VERSION, seq_id=seq_id)
        return (await self.call("RemoveSequence", request, timeout_s)).next_position

    async def trim_sequence(self, seq_id: int, keep_positions: int, *, timeout_s: float | None = None) -> int:
        request = worker_pb2.TrimSequenceRequest(
            schema_version=SCHEMA_VERSION, seq_id=seq_id, keep_positions=keep_positions
        )
        return (await self.call("TrimSequence", request, timeout_s)).next_position

    async def copy_sequence(self, src_seq_id: int, dst_seq_id: int, *, timeout_s: float | None = None) -> int:
        request = worker_pb2.CopySequenceRequest(
            schema_version=SCHEMA_VERSION, src_seq_id=src_seq_id, dst_seq_id=dst_seq_id
        )
        return (await self.call("CopySequence", request, timeout_s)).next_position

    async def tokenize(
        self, text: str, *, add_special: bool = True, parse_special: bool = False, timeout_s: float | None = None
    ) -> list[int]:
        request = tokenize_request(text, add_special, parse_special)
        return list((await self.call("Tokenize", request, timeout_s)).token_ids)

    async def detokenize(
        self,
        token_ids: Sequence[int],
        *,
        remove_special: bool = False,
        unparse_special: bool = False,
        timeout_s: float | None = None,
    ) -> bytes:
        """The tokens' pieces joined, as bytes: decode what is whole (it may end inside a character)."""
        request = detokenize_request(token_ids, remove_special, unparse_special)
        return (await self.call("Detokenize", request, timeout_s)).text

    async def vocabulary(self, *, timeout_s: float | None = None) -> Vocabulary:
        return await self._typed(
            "Vocabulary",
            worker_pb2.VocabularyRequest(schema_version=SCHEMA_VERSION),
            _vocabulary_from_reply,
            timeout_s,
        )
