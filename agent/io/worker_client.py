"""gRPC client of one native shard worker (``protocol/worker.proto``) on a Unix socket.

Owns the channel, deadlines, the conversion between ``agent.core.worker_records`` and the
generated protobuf messages, and the mapping of gRPC failures onto ``WorkerError``.
``WorkerClient`` is synchronous; ``AsyncWorkerClient`` offers the same calls to trio code
by running them in worker threads (grpcio's asyncio API needs an asyncio loop and must
not be used under trio).

Makes no decisions (those live in ``agent.core``) and starts no processes
(``agent.io.worker_process`` does).
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np
import outcome
import trio
from google.protobuf.message import DecodeError

from agent._proto import worker_pb2, worker_pb2_grpc
from agent.core.boundary import (
    RESIDUAL,
    BoundaryError,
    BoundarySchema,
    WireDType,
    check_boundary_schema,
    decode_rows,
    encode_rows,
)
from agent.core.topk import TopLogits
from agent.core.worker_records import (
    SCHEMA_VERSION,
    BoundarySchemaInfo,
    ForwardTiming,
    SeqInput,
    SeqOutput,
    Vocabulary,
    WorkerHealth,
    WorkerInfo,
)
from agent.io import raw_socket

__all__ = [
    "AsyncWorkerClient",
    "ClientConfig",
    "SeqInput",
    "SeqOutput",
    "Vocabulary",
    "WorkerClient",
    "WorkerError",
    "WorkerHealth",
    "WorkerInfo",
]

T = TypeVar("T")

#: Largest gRPC message either way: a 512-row batch of logits over a 49152-token vocabulary
#: is 512 * 49152 * 4 bytes ~ 100 MB; twice that leaves room for bigger vocabularies.
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024


class WorkerError(Exception):
    """A worker call failed: ``code_name`` is the gRPC status name (``"INVALID_ARGUMENT"``,
    ``"UNAVAILABLE"``, ``"DEADLINE_EXCEEDED"``, ...) and ``message`` the worker's details."""

    def __init__(self, code_name: str, message: str, *, method: str = "") -> None:
        super().__init__(code_name, message)
        self.code_name = code_name
        self.message = message
        self.method = method

    def __str__(self) -> str:
        where = f"{self.method}: " if self.method else ""
        return f"{where}{self.code_name}: {self.message}"


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


# --- conversions (no I/O) ----------------------------------------------------------------


def _info_from_reply(reply: worker_pb2.InfoReply) -> WorkerInfo:
    b = reply.boundary
    return WorkerInfo(
        schema_version=reply.schema_version,
        architecture=reply.architecture,
        n_layer=reply.n_layer,
        n_embd=reply.n_embd,
        n_vocab=reply.n_vocab,
        layer_begin=reply.layer_begin,
        layer_end=reply.layer_end,
        takes_tokens=reply.takes_tokens,
        gives_logits=reply.gives_logits,
        boundary=BoundarySchemaInfo(
            version=b.version,
            name=b.name,
            n_embd=b.n_embd,
            dtype=int(b.dtype),
            streams=b.streams or 1,
            row_values=b.row_values,
        ),
        recipe_hash=reply.recipe_hash,
        model_sha256=reply.model_sha256,
        llama_cpp_commit=reply.llama_cpp_commit,
        patch_series_sha256=reply.patch_series_sha256,
        backend=reply.backend,
        weight_bytes=reply.weight_bytes,
        weight_buffer_bytes=reply.weight_buffer_bytes,
        kv_bytes=reply.kv_bytes,
        n_ctx_per_sequence=reply.n_ctx_per_sequence,
        n_seq_max=reply.n_seq_max,
        n_batch_max=reply.n_batch_max,
        model_path=reply.model_path,
        n_threads=reply.n_threads,
        eog_token_ids=tuple(reply.eog_token_ids),
        vocab_only=reply.vocab_only,
        data_port=reply.data_port,
        n_threads_decode=reply.n_threads_decode,
    )


def _health_from_reply(reply: worker_pb2.HealthReply) -> WorkerHealth:
    return WorkerHealth(
        schema_version=reply.schema_version,
        ready=reply.ready,
        forward_calls=reply.forward_calls,
        active_sequences=reply.active_sequences,
        data_plane_forwards=reply.data_plane_forwards,
        data_plane_steps=reply.data_plane_steps,
        data_plane_compute_us=reply.data_plane_compute_us,
    )


def _vocabulary_from_reply(reply: worker_pb2.VocabularyReply) -> Vocabulary:
    """Raises ValueError when the reply's pieces or attrs do not match its n_vocab."""
    return Vocabulary(
        schema_version=reply.schema_version,
        n_vocab=reply.n_vocab,
        pieces=tuple(reply.pieces),
        attrs=tuple(reply.attrs),
        bos_token_id=reply.bos_token_id if reply.bos_token_id >= 0 else None,
        add_bos=reply.add_bos,
        eog_token_ids=tuple(reply.eog_token_ids),
    )


def tokenize_request(text: str, add_special: bool, parse_special: bool) -> worker_pb2.TokenizeRequest:
    return worker_pb2.TokenizeRequest(
        schema_version=SCHEMA_VERSION, text=text, add_special=add_special, parse_special=parse_special
    )


def detokenize_request(
    token_ids: Sequence[int], remove_special: bool, unparse_special: bool
) -> worker_pb2.DetokenizeRequest:
    return worker_pb2.DetokenizeRequest(
        schema_version=SCHEMA_VERSION,
        token_ids=[int(t) for t in token_ids],
        remove_special=remove_special,
        unparse_special=unparse_special,
    )


def forward_request(entries: Sequence[SeqInput], info: WorkerInfo) -> worker_pb2.ForwardRequest:
    """Encode ``entries`` for a worker described by ``info``. An entry's ``boundary_bytes``
    (rows already checked) go as they are; other boundary rows are checked and encoded.

    Raises:
      ValueError: an entry is inconsistent in itself (``SeqInput.check``).
      agent.core.boundary.BoundaryError: boundary rows are not float32 ``[n, n_embd]`` or
        hold NaN/Inf. (To send such rows on purpose, build the protobuf yourself and use
        ``WorkerClient.call``.)
    """
    request = worker_pb2.ForwardRequest(schema_version=SCHEMA_VERSION)
    expected = info.boundary.schema
    width = info.boundary.width
    for entry in entries:
        entry.check()
        msg = request.entries.add()
        msg.seq_id = entry.seq_id
        msg.positions.extend(_ints(entry.positions))
        if entry.token_ids is not None:
            msg.token_ids.extend(_ints(entry.token_ids))
        else:
            if entry.boundary_schema is not None and entry.boundary_schema != expected:
                check_boundary_schema(entry.boundary_schema, expected)
            assert entry.boundary is not None  # check(): exactly one of token_ids, boundary
            msg.boundary = encode_rows(entry.boundary, width, WireDType.F32, checked_bytes=entry.boundary_bytes)
            msg.boundary_dtype = worker_pb2.DTYPE_F32
            msg.boundary_schema_version = expected.version
            msg.boundary_streams = expected.streams
        if entry.logit_rows:
            msg.logit_rows.extend(int(r) for r in entry.logit_rows)
        if entry.top_k:
            msg.top_k = int(entry.top_k)
    return request


def _ints(values: Sequence[int] | np.ndarray) -> list[int]:
    """``values`` as Python ints (numpy's in one call, not one by one)."""
    return values.tolist() if isinstance(values, np.ndarray) else [int(v) for v in values]


def forward_outputs(reply: worker_pb2.ForwardReply, info: WorkerInfo) -> list[SeqOutput]:
    """Decode a ForwardReply (boundary rows of width n_embd or logits of width n_vocab).
    F32 boundary rows stay a view of the reply's bytes, which the outputs carry too
    (``SeqOutput.boundary_bytes``) for the next hop.

    Raises:
      agent.core.boundary.BoundaryError: a byte length that does not match ``n_rows``, an
        unspecified reply dtype, or non-finite boundary rows.
    """
    outputs = []
    expected = info.boundary.schema
    width = info.boundary.width
    dtype = reply.dtype
    for out in reply.entries:
        boundary = logits = boundary_bytes = None
        schema = None
        data = out.boundary
        if data:
            version, streams = out.boundary_schema_version, out.boundary_streams
            declared = (version or RESIDUAL, streams or 1, info.n_embd)
            if declared == (expected.version, expected.streams, expected.n_embd):
                schema = expected
            else:
                schema = BoundarySchema.declared(version, streams, info.n_embd)
                check_boundary_schema(schema, expected)
            boundary = decode_rows(data, out.n_rows, width, dtype)
            if dtype == worker_pb2.DTYPE_F32:
                boundary_bytes = data
        if out.logits:
            logits = decode_rows(out.logits, out.n_rows, info.n_vocab, dtype, check_finite=False)
        outputs.append(
            SeqOutput(
                seq_id=out.seq_id,
                boundary=boundary,
                logits=logits,
                logit_rows=tuple(out.logit_rows),
                next_position=out.next_position,
                boundary_schema=schema,
                top=_top_from_output(out, info.n_vocab),
                boundary_bytes=boundary_bytes,
            )
        )
    return outputs


def _top_from_output(out: worker_pb2.SequenceOutput, n_vocab: int) -> tuple[TopLogits, ...]:
    """The per-row top-K of a SequenceOutput (empty when it carries none).

    Raises:
      BoundaryError: byte lengths that do not match ``n_rows x top_k``, or a row that is not a
        well-formed top-K (``TopLogits.check``).
    """
    if not out.top_k:
        return ()
    k, n_rows = out.top_k, out.n_rows
    if (
        len(out.top_token_ids) != n_rows * k * 4
        or len(out.top_logits) != n_rows * k * 4
        or len(out.log_sum_exp) != n_rows
    ):
        raise BoundaryError(
            f"top-{k} of {n_rows} rows: got {len(out.top_token_ids)} id bytes, {len(out.top_logits)} logit bytes "
            f"and {len(out.log_sum_exp)} log-sum-exps"
        )
    ids = np.frombuffer(out.top_token_ids, dtype="<i4").reshape(n_rows, k)
    values = np.frombuffer(out.top_logits, dtype="<f4").reshape(n_rows, k)
    rows = tuple(TopLogits(ids[r], values[r], float(out.log_sum_exp[r]), n_vocab) for r in range(n_rows))
    for row in rows:
        try:
            row.check()
        except ValueError as err:
            raise BoundaryError(f"top-{k} from the worker: {err}") from err
    return rows


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

    def health(self, *, timeout_s: float | None = None) -> WorkerHealth:
        reply = self.call("Health", worker_pb2.HealthRequest(schema_version=SCHEMA_VERSION), timeout_s)
        return _health_from_reply(reply)

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
    ) -> str:
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


_STATUS_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}
_PREFIX_BYTES = 4  # the Forward stream's frame prefix: a little-endian u32 length
_REPLY_BUFFER_BYTES = 1 << 20  # holds a decode step's full logits row (SmolLM2: 197 KB) and more
_REPLY_BUFFER_MAX_KEPT_BYTES = 16 << 20  # a bigger buffer (a long prefill's reply) is let go after use
_RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


#: an empty request: the worker answers it at once; it ends a run-ahead (protocol/worker.proto)
_BARRIER = worker_pb2.ForwardRequest(schema_version=SCHEMA_VERSION)


def _framed(request: worker_pb2.ForwardRequest) -> bytes:
    return len(payload := request.SerializeToString()).to_bytes(_PREFIX_BYTES, "little") + payload


class _StaleConnection(Exception):
    """The Forward stream's open connection broke before any reply byte: try a fresh one."""


class _ForwardStream:
    """Forward over the worker's Forward stream (``--forward-socket``; protocol/worker.proto,
    ``ForwardStreamReply``): one Unix-socket connection that a trio task awaits directly.

    Why: the gRPC call hands each Forward to a call thread and back (two wake-ups, ~0.35 ms
    a step in bench/results/compare.md's trace) and pays gRPC's per-call work on both sides;
    here the task writes a frame and sleeps in the event loop until the reply frame is read, on
    a raw non-blocking socket (``agent.io.raw_socket``: no scheduler pass per send or receive
    that need not wait), into one reused buffer that the reply is parsed from in place.

    One Forward at a time (a lock; the worker runs one at a time anyway), replies in order.
    A call that times out, is cancelled or sees the connection break closes the connection
    (a late reply must not be read as the next call's), and the next call connects again.
    """

    def __init__(self, path: str, max_reply_bytes: int) -> None:
        self.path = path
        self.max_reply_bytes = max_reply_bytes
        self._lock = trio.Lock()
        self._sock: socket.socket | None = None
        # replies are read into one buffer, grown to the largest reply (and shrunk back after
        # an outsized one) and parsed in place: no copy per receive, no fresh object per reply
        self._buffer = bytearray(_REPLY_BUFFER_BYTES)
        self._filled = 0  # bytes of the buffer that hold received data

    async def _fill(self, sock: socket.socket) -> bool:
        """Receive more of the reply; whether it had to wait. Raises BrokenResourceError
        when the worker closed the connection."""
        with memoryview(self._buffer) as view:
            received, waited = await raw_socket.receive_into(sock, view[self._filled :])
        if not received:
            raise trio.BrokenResourceError("the worker closed the Forward stream")
        self._filled += received
        return waited

    def _room_for(self, n: int) -> None:
        if len(self._buffer) < n:
            grown = bytearray(max(n, 2 * len(self._buffer)))
            grown[: self._filled] = memoryview(self._buffer)[: self._filled]  # (no interim copy)
            self._buffer = grown

    async def exchange(self, request: worker_pb2.ForwardRequest, timeout_s: float) -> worker_pb2.ForwardReply:
        data = _framed(request)
        try:
            with trio.fail_after(timeout_s):  # the wait for the lock counts too
                await raw_socket.acquire(self._lock)  # free: no scheduler pass before the send
                try:
                    frame = await self._exchange_locked(data)
                finally:
                    self._lock.release()
        except trio.TooSlowError:
            raise WorkerError("DEADLINE_EXCEEDED", f"no Forward reply within {timeout_s} s", method="Forward") from None
        return await self._reply_of(frame)

    async def _reply_of(self, frame: worker_pb2.ForwardStreamReply) -> worker_pb2.ForwardReply:
        if frame.code:
            if frame.code == _RESOURCE_EXHAUSTED:  # a frame over the worker's limit: it closed the connection
                await self.close()
            raise WorkerError(_STATUS_NAMES.get(frame.code, "UNKNOWN"), frame.message, method="Forward")
        return frame.reply

    async def run_ahead(
        self,
        request: worker_pb2.ForwardRequest,
        timeout_s: float,
        on_reply: Callable[[worker_pb2.ForwardReply], Awaitable[bool]],
    ) -> int:
        """``request`` (one entry asking for a run-ahead: ``SequenceInput.run_ahead_steps``)
        and its run: ``on_reply`` gets the request's reply, then each run-ahead step's, in
        order, and returns whether to go on. When it says stop while the worker has more, an
        empty request ends the run and the frames already sent are read and dropped. Returns
        the positions the sequence holds on the worker afterwards (the run's dropped steps
        included: trim them before going on from an earlier position). ``timeout_s`` bounds
        each frame's wait. A step's error ends the run and raises; so does anything that
        leaves the connection's state unknown (a timeout, a cancellation), which closes it."""
        data = _framed(request)
        try:
            with trio.fail_after(timeout_s):
                await raw_socket.acquire(self._lock)
            try:
                return await self._run_ahead_locked(data, timeout_s, on_reply)
            finally:
                self._lock.release()
        except trio.TooSlowError:
            raise WorkerError("DEADLINE_EXCEEDED", f"no Forward reply within {timeout_s} s", method="Forward") from None

    async def _run_ahead_locked(
        self, data: bytes, timeout_s: float, on_reply: Callable[[worker_pb2.ForwardReply], Awaitable[bool]]
    ) -> int:
        with trio.fail_after(timeout_s):
            frame = await self._exchange_locked(data)
        reply = await self._reply_of(frame)
        async with self._closed_on_failure():
            position = reply.entries[0].next_position if reply.entries else 0
            more = frame.run_ahead_more
            wanted = await on_reply(reply)
            while more and wanted:
                with trio.fail_after(timeout_s):
                    frame = await self._next_frame(self._sock)
                more = frame.run_ahead_more
                if not frame.run_ahead:
                    raise WorkerError("INTERNAL", "the worker answered a request nobody sent", method="Forward")
                reply = await self._reply_of(frame)  # a step's error ends the run: its frame is the last
                position = reply.entries[0].next_position
                wanted = await on_reply(reply)
            if more:  # the caller stopped first: end the run, drop its frames up to the barrier's answer
                with trio.fail_after(timeout_s):
                    if self._sock is None:  # closed while on_reply ran: as _next_frame says it
                        raise trio.ClosedResourceError("the Forward stream is closed")
                    await raw_socket.send_all(self._sock, _framed(_BARRIER))
                    while (frame := await self._next_frame(self._sock)).run_ahead:
                        if not frame.code and frame.reply.entries:
                            position = frame.reply.entries[0].next_position
        return position

    @contextlib.asynccontextmanager
    async def _closed_on_failure(self) -> AsyncIterator[None]:
        """Around a use of the connection: any failure leaves its state unknown (a reply half
        read, a run still going), so it is closed, and the next call connects again; a socket
        error is a WorkerError UNAVAILABLE."""
        try:
            yield
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as error:
            await self.close()
            raise WorkerError("UNAVAILABLE", f"Forward stream {self.path}: {error}", method="Forward") from None
        except BaseException:
            await self.close()
            raise

    async def _exchange_locked(self, data: bytes) -> worker_pb2.ForwardStreamReply:
        """One request and its reply. A connection that was already open and turns out broken
        before any reply byte (the worker closed it meanwhile) is replaced once: the request
        is sent again on a fresh one (a Forward the worker did run would be refused there,
        its positions no longer continuing the sequence; never applied twice)."""
        try:
            return await self._exchange_once(data, may_retry=self._sock is not None)
        except _StaleConnection:
            return await self._exchange_once(data, may_retry=False)

    async def _exchange_once(self, data: bytes, *, may_retry: bool) -> worker_pb2.ForwardStreamReply:
        """``_exchange_locked`` on the open connection (or a new one). Raises _StaleConnection
        (``may_retry`` only) when it broke before any reply byte; any other failure closes it."""
        async with self._closed_on_failure():
            if self._sock is None:
                self._sock = raw_socket.adopt(await trio.open_unix_socket(self.path))
                self._filled = 0
            sock = self._sock
            try:
                await raw_socket.send_all(sock, data)
                waited = False
                while self._filled < _PREFIX_BYTES:
                    waited = await self._fill(sock) or waited
            except (OSError, trio.BrokenResourceError) as error:
                if may_retry and not self._filled:
                    raise _StaleConnection from None
                raise WorkerError("UNAVAILABLE", f"Forward stream {self.path}: {error}", method="Forward") from None
            return await self._next_frame(sock, waited=waited)

    async def _next_frame(self, sock: socket.socket | None, *, waited: bool = False) -> worker_pb2.ForwardStreamReply:
        """The next frame from the worker (its first bytes may be in the buffer already).
        Bytes after it stay in the buffer only where the frame says more follow (a run-ahead's):
        a worker sends nothing unasked otherwise."""
        if sock is None:
            raise trio.ClosedResourceError("the Forward stream is closed")
        while self._filled < _PREFIX_BYTES:
            waited = await self._fill(sock) or waited
        size = int.from_bytes(self._buffer[:_PREFIX_BYTES], "little")
        if size > self.max_reply_bytes:
            raise WorkerError(
                "RESOURCE_EXHAUSTED",
                f"a Forward stream reply of {size} bytes is over {self.max_reply_bytes}",
                method="Forward",
            )
        end = _PREFIX_BYTES + size
        self._room_for(end)
        while self._filled < end:
            waited = await self._fill(sock) or waited
        try:
            with memoryview(self._buffer) as view:
                # protobuf parses any buffer; its stubs say bytes (a copy per frame to please them)
                frame = worker_pb2.ForwardStreamReply.FromString(view[_PREFIX_BYTES:end])  # type: ignore[arg-type]
        except DecodeError:
            raise WorkerError("INTERNAL", "the Forward stream reply does not parse", method="Forward") from None
        if self._filled > end:
            if not frame.run_ahead_more:  # (the worker sends one reply per request, and the run's frames)
                raise WorkerError("INTERNAL", "the worker sent bytes after its reply", method="Forward")
            self._buffer[: self._filled - end] = self._buffer[end : self._filled]
            self._filled -= end
        else:
            self._filled = 0
            if len(self._buffer) > _REPLY_BUFFER_MAX_KEPT_BYTES:
                self._buffer = bytearray(_REPLY_BUFFER_BYTES)
        if not waited:  # the reply was there at once: still a checkpoint, as trio expects
            await trio.lowlevel.checkpoint()
        return frame

    async def close(self) -> None:
        sock, self._sock = self._sock, None
        self._filled = 0
        if sock is not None:
            sock.close()
        await trio.lowlevel.cancel_shielded_checkpoint()  # (also called while a cancellation unwinds)


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

    async def health(self, *, timeout_s: float | None = None) -> WorkerHealth:
        return await self._typed(
            "Health", worker_pb2.HealthRequest(schema_version=SCHEMA_VERSION), _health_from_reply, timeout_s
        )

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
    ) -> str:
        request = detokenize_request(token_ids, remove_special, unparse_special)
        return (await self.call("Detokenize", request, timeout_s)).text

    async def vocabulary(self, *, timeout_s: float | None = None) -> Vocabulary:
        return await self._typed(
            "Vocabulary",
            worker_pb2.VocabularyRequest(schema_version=SCHEMA_VERSION),
            _vocabulary_from_reply,
            timeout_s,
        )
