"""The tracker's verifier: canary checks of served ranges against a trusted reference.

Owns the I/O of the checks ``agent.core.canary`` decides: for the range due (``CanarySchedule``
held by the ``Tracker``), it runs a short generation through that one range as an ordinary
session would, and compares each step's output with the output of the tracker's own workers
(the reference), started from the registered GGUF the tracker hashed at registration.

What the checked node sees is an ordinary hop of an ordinary session (docs/INTEGRITY.md):
- the step comes from a fresh identity with a tracker-signed admission: for a first range a
  client (ROLE_CLIENT, the session's owner, as owners send to first hops), for any other
  range an upstream "node" (ROLE_NODE; its fingerprint digest is random, as a real one looks);
- the session has a random id, random prompt tokens (a first range) or the boundary rows the
  reference computes for them (any other range: real hidden states, not noise), then decode
  steps with the token a greedy generation would take;
- ``rest`` chains to the model's last block like every step's: a range that is not last pushes
  its boundary rows to the "next hop" named there, a fresh identity of the verifier that
  validates them as a node would (``validate_step``) and acks; the last range pushes its
  ``StepResult`` to the owner, another fresh identity. So the checked range is always the last
  hop the check goes through, and its output comes back without any field of its own;
- the session is ended as an owner ends one (through the sender, forwarded along ``rest``).

The reference for range ``[b, e)`` of a model of ``L`` blocks is a chain of the tracker's
workers ``[0, b)``, ``[b, e)``, ``[e, L)`` (the outer ones only where they exist): the first
makes the input rows, the middle the expected output, the last the logits whose greedy token
is the next decode step's. Workers are kept (``ReferencePool``, at most
``max_reference_workers``, least recently used first out) and shared by the ranges that cut
the model at the same blocks.

Resource handling: ``serve_verifier`` runs until cancelled; every reference worker and every
persona transport it opened is closed on the way out. Cancellation: cancel the enclosing
scope; a check in flight is dropped (its session on the node is freed by the node's idle
timeout).

Must not import ``agent.io.tracker.service`` (which imports this module): what the verifier
uses of the tracker is ``CanaryHost``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Protocol, TypedDict

import numpy as np
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent._proto import swarm_pb2
from agent.core.admission import public_key_bytes
from agent.core.boundary import WireDType
from agent.core.canary import (
    CanaryPlan,
    CanaryPolicy,
    CanarySchedule,
    OutputMismatch,
    RangeKey,
    compare_rows,
    compare_scores,
    plan_canary,
)
from agent.core.identity import peer_id_from_public_key
from agent.core.swarm_wire import (
    NODE_PROTOCOL,
    RESULT_PROTOCOL,
    SCHEMA_VERSION,
    STEP_PROTOCOL,
    STEPS_PROTOCOL,
    RangeSpec,
    WireError,
    answer_step_batch,
    boundary_step_request,
    first_step_request,
    node_reply_error,
    parse_record,
    result_scores,
    step_ack,
    step_ack_error,
    validate_step,
)
from agent.core.topk import TopLogits
from agent.core.worker_records import SeqInput, SeqOutput
from agent.core.worker_wait import AUTO, WAIT_CHOICES
from agent.io.transport import Transport, TransportError
from agent.io.worker_client import ClientConfig, WorkerError
from agent.io.worker_process import WorkerBinaryNotFound, WorkerHandle, WorkerStartError, open_worker, wait_environment

__all__ = [
    "CanaryHost",
    "CheckOutcome",
    "ReferencePool",
    "VerifierConfig",
    "VerifierStats",
    "run_check",
    "serve_verifier",
]

log = logging.getLogger(__name__)

Code = swarm_pb2.Error.Code

#: ``open_persona(key)``: an open transport whose identity is ``key`` (libp2p + the direct
#: channel in production, a ``MemoryTransport`` in unit tests).
OpenPersona = Callable[[Ed25519PrivateKey], AbstractAsyncContextManager[Transport]]


@dataclasses.dataclass(frozen=True)
class VerifierConfig:
    """The verifier's workers and deadlines (the canary policy is ``TrackerConfig.canary``).

    Fields:
      threads: threads of each reference worker.
      worker_wait: how a reference worker's idle threads wait (``agent.core.worker_wait``:
        auto, spin or sleep); auto sleeps after a short spin when nodes compute on this host.
      worker_binary: the baton-worker binary (None: ``find_worker_binary()``).
      worker_ready_timeout_s, worker_call_timeout_s: a reference worker's start and calls.
      max_reference_workers: reference workers kept at once (least recently used stopped
        first; at least 3, the chain of one check).
      step_timeout_s: how long a checked node may take to ack a canary step and push its output.
      persona_listen: where each fresh identity listens (nodes push outputs to it): the
        tracker's host, any port.
    """

    threads: int = 1
    worker_wait: str = AUTO
    worker_binary: str | None = None
    worker_ready_timeout_s: float = 120.0
    worker_call_timeout_s: float = 60.0
    max_reference_workers: int = 6
    step_timeout_s: float = 10.0
    persona_listen: str = "/ip4/127.0.0.1/tcp/0"

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.worker_wait not in WAIT_CHOICES:
            raise ValueError(f"worker_wait must be one of {', '.join(WAIT_CHOICES)}, got {self.worker_wait!r}")
        if self.max_reference_workers < 3:  # one check's chain: [0, b), [b, e), [e, L)
            raise ValueError(f"max_reference_workers must be >= 3, got {self.max_reference_workers}")
        for name in ("worker_ready_timeout_s", "worker_call_timeout_s", "step_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class _CheckStats(TypedDict):
    """A canary's counters, as ``CheckOutcome`` names them."""

    steps: int
    rows: int
    node_s: float
    reference_s: float


@dataclasses.dataclass(frozen=True)
class CheckOutcome:
    """How one canary ended: ``passed``, ``failed`` (``mismatch`` is the evidence) or
    ``inconclusive`` (``reason``: the node refused or was too slow, the reference could not
    run). ``rows``: rows the checked node processed; ``node_s`` / ``reference_s``: time spent
    waiting for it / computing the reference."""

    key: RangeKey
    check_id: str
    status: str
    mismatch: OutputMismatch | None = None
    reason: str = ""
    steps: int = 0
    rows: int = 0
    node_s: float = 0.0
    reference_s: float = 0.0


@dataclasses.dataclass
class VerifierStats:
    """Totals over the verifier's checks (the benchmark reads them)."""

    passed: int = 0
    failed: int = 0
    inconclusive: int = 0
    rows: int = 0
    node_s: float = 0.0
    reference_s: float = 0.0

    def add(self, outcome: CheckOutcome) -> None:
        setattr(self, outcome.status, getattr(self, outcome.status) + 1)
        self.rows += outcome.rows
        self.node_s += outcome.node_s
        self.reference_s += outcome.reference_s


class CanaryHost(Protocol):
    """What the verifier uses of the tracker (``agent.io.tracker.service.Tracker``, which
    imports this module: it is not imported here)."""

    @property
    def canary_policy(self) -> CanaryPolicy | None: ...
    @property
    def canaries(self) -> CanarySchedule | None: ...
    @property
    def verifier_stats(self) -> VerifierStats: ...

    async def changed(self) -> None:
        """Returns when the tracker's state changed (a range may have become due)."""
        ...

    async def canary_target(self, key: RangeKey) -> tuple[tuple[str, ...], str, int, str]:
        """The checked node's addresses, the range's recipe hash, the model's block count and
        its registered file. Raises LookupError when the range is no longer served."""
        ...

    def issue_persona_admission(self, peer_id: str, role: swarm_pb2.Role) -> swarm_pb2.SignedAdmission:
        """An admission for one of the verifier's fresh identities."""
        ...

    def record_check(self, outcome: CheckOutcome) -> object:
        """Act on a check's outcome."""
        ...


class _Inconclusive(Exception):
    pass


# --- the reference ---------------------------------------------------------------------------


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


# --- the personas ----------------------------------------------------------------------------


class _Inbox:
    """Where the personas of one check deliver what the checked node pushes: boundary rows
    (a ``StepRequest`` to the "next hop") or a ``StepResult`` (to the "owner"), by step."""

    def __init__(self, node_peer_id: str, session_id: bytes, downstream: RangeSpec | None) -> None:
        self.node_peer_id = node_peer_id
        self.session_id = session_id
        self.downstream = downstream
        self.step = -1
        self.arrived = trio.Event()
        self.rows: np.ndarray | None = None
        self.result: swarm_pb2.StepResult | None = None
        self.malformed = ""

    def expect(self, step: int) -> None:
        self.step, self.arrived = step, trio.Event()
        self.rows = self.result = None
        self.malformed = ""

    async def on_step(self, remote_peer_id: str, data: bytes) -> bytes:
        """The "next hop": validate the pushed step as a node would, take its rows, ack."""
        try:
            request = parse_record(swarm_pb2.StepRequest, data)
        except WireError as err:
            return step_ack(err)
        return self._take_step(remote_peer_id, request)

    async def on_steps(self, remote_peer_id: str, data: bytes) -> bytes:
        """``/baton/steps`` as a node answers it (a persona that did not would be a tell)."""
        return answer_step_batch(data, lambda request: self._take_step(remote_peer_id, request))

    def _take_step(self, remote_peer_id: str, request: swarm_pb2.StepRequest) -> bytes:
        """Check one pushed step, take its rows; its serialized ``StepAck``."""
        try:
            mine = remote_peer_id == self.node_peer_id and bytes(request.session_id) == self.session_id
            if not mine or self.downstream is None or request.step != self.step or self.arrived.is_set():
                raise WireError(
                    Code.NOT_FOUND, f"unknown session {bytes(request.session_id).hex()} at step {request.step}"
                )
            try:
                step = validate_step(request, self.downstream)
            except WireError as err:
                self.malformed = f"the pushed step is malformed: {err}"
                self.arrived.set()
                raise
            self.rows = np.array(step.rows, dtype=np.float32)
            self.arrived.set()
            return step_ack()
        except WireError as err:
            return step_ack(err)

    async def on_result(self, remote_peer_id: str, data: bytes) -> bytes:
        """The "owner": take the last range's result."""
        try:
            result = parse_record(swarm_pb2.StepResult, data)
        except WireError as err:
            return step_ack(err)
        if (
            remote_peer_id != self.node_peer_id
            or bytes(result.session_id) != self.session_id
            or result.step != self.step
        ):
            return step_ack_error(Code.NOT_FOUND, f"unknown session {bytes(result.session_id).hex()}")
        if not self.arrived.is_set():
            self.result = result
            self.arrived.set()
        return step_ack()


async def _on_node_request(remote_peer_id: str, data: bytes) -> bytes:
    """A persona answers node requests as a node does: a probe (no body) with the same
    INVALID_ARGUMENT, an end-session with success."""
    try:
        request = parse_record(swarm_pb2.NodeRequest, data)
    except WireError as err:
        return node_reply_error(err.code, err.message)
    body = request.WhichOneof("body")
    if body == "end_session":
        return swarm_pb2.NodeReply(schema_version=SCHEMA_VERSION).SerializeToString()
    if body is None:
        return node_reply_error(
            Code.INVALID_ARGUMENT, "the NodeRequest has no body (tokenize, detokenize or end_session)"
        )
    return node_reply_error(Code.NOT_FOUND, f"model {getattr(request, body).model_sha256!r} is not ready on this node")


@dataclasses.dataclass
class _Persona:
    key: Ed25519PrivateKey
    transport: Transport

    @property
    def peer_id(self) -> str:
        return self.transport.peer_id

    def hop(self, begin: int, end: int) -> swarm_pb2.Hop:
        return swarm_pb2.Hop(peer_id=self.peer_id, addrs=list(self.transport.listen_addrs), begin=begin, end=end)


@contextlib.asynccontextmanager
async def _personas(open_persona: OpenPersona, count: int, inbox: _Inbox) -> AsyncIterator[list[_Persona]]:
    async with contextlib.AsyncExitStack() as stack:
        personas = []
        for _ in range(count):
            key = Ed25519PrivateKey.generate()
            transport = await stack.enter_async_context(open_persona(key))
            if transport.peer_id != peer_id_from_public_key(public_key_bytes(key)):
                raise ValueError("open_persona returned a transport of another identity")
            transport.set_handler(STEP_PROTOCOL, inbox.on_step)
            transport.set_handler(STEPS_PROTOCOL, inbox.on_steps)
            transport.set_handler(RESULT_PROTOCOL, inbox.on_result)
            transport.set_handler(NODE_PROTOCOL, _on_node_request)
            personas.append(_Persona(key, transport))
        yield personas


def libp2p_personas(listen: str) -> OpenPersona:
    """Fresh identities on libp2p with the direct channel in front, as nodes and owners run."""

    def open_persona(key: Ed25519PrivateKey) -> AbstractAsyncContextManager[Transport]:
        from agent.io.peer_transport import open_peer_transport

        return open_peer_transport(key, [listen])

    return open_persona


# --- one check -------------------------------------------------------------------------------


def _greedy(scores: TopLogits | np.ndarray) -> int:
    return int(scores.ids[0]) if isinstance(scores, TopLogits) else int(np.argmax(scores))


def _last_scores(output: SeqOutput) -> TopLogits | np.ndarray:
    if output.top:
        return output.top[-1]
    if output.logits is None:
        raise _Inconclusive("the reference's last range returned no logits")
    return np.array(output.logits[-1], dtype=np.float32)


async def run_check(
    tracker: CanaryHost,
    key: RangeKey,
    pool: ReferencePool,
    config: VerifierConfig,
    open_persona: OpenPersona,
    rng: np.random.Generator,
) -> CheckOutcome:
    """One canary of ``key`` (peer, model, begin, end). Never raises but for cancellation.

    Resource handling: the personas it opens are closed, the session it opened on the
    checked node is ended (best effort) and the reference's sequences are removed."""
    check_id = f"canary-{os.urandom(6).hex()}"
    peer_id, model_sha256, begin, end = key
    stats: _CheckStats = {"steps": 0, "rows": 0, "node_s": 0.0, "reference_s": 0.0}
    try:
        mismatch = await _check(tracker, key, pool, config, open_persona, rng, stats)
    except _Inconclusive as why:
        log.info("%s of %s [%d, %d) on %s inconclusive: %s", check_id, model_sha256[:12], begin, end, peer_id, why)
        return CheckOutcome(key, check_id, "inconclusive", reason=str(why), **stats)
    except (WorkerStartError, WorkerBinaryNotFound, WorkerError, OSError, ValueError) as err:
        reason = f"the reference could not run: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
        log.warning("%s of %s [%d, %d) on %s: %s", check_id, model_sha256[:12], begin, end, peer_id, reason)
        return CheckOutcome(key, check_id, "inconclusive", reason=reason, **stats)
    except Exception as err:  # a bug here must not take the tracker down: logged, tried again later
        log.exception("%s of %s [%d, %d) on %s failed", check_id, model_sha256[:12], begin, end, peer_id)
        return CheckOutcome(key, check_id, "inconclusive", reason=f"{type(err).__name__}: {err}", **stats)
    if mismatch is not None:
        return CheckOutcome(key, check_id, "failed", mismatch=mismatch, **stats)
    return CheckOutcome(key, check_id, "passed", **stats)


async def _check(
    tracker: CanaryHost,
    key: RangeKey,
    pool: ReferencePool,
    config: VerifierConfig,
    open_persona: OpenPersona,
    rng: np.random.Generator,
    stats: _CheckStats,
) -> OutputMismatch | None:
    peer_id, model_sha256, begin, end = key
    try:
        node_addrs, recipe_hash, n_layer, path = await tracker.canary_target(key)
    except LookupError as why:
        raise _Inconclusive(str(why)) from None
    started = time.perf_counter()
    chain = ([(0, begin)] if begin > 0 else []) + [(begin, end)] + ([(end, n_layer)] if end < n_layer else [])
    refs = [await pool.get(path, model_sha256, b, e) for b, e in chain]
    ref = refs[1 if begin > 0 else 0]
    info = ref.info
    same_recipe = info.recipe_hash == recipe_hash
    policy = tracker.canary_policy
    assert policy is not None  # canaries run only under a policy (serve_verifier checks)
    rel_error = None if same_recipe else policy.cross_recipe_rel_error
    plan: CanaryPlan = plan_canary(
        policy, rng, n_vocab=info.n_vocab, bos_token_id=await pool.bos_token(refs[0]),
        n_ctx=info.n_ctx_per_sequence, full_row=not same_recipe and end == n_layer,
    )  # fmt: skip
    stats["reference_s"] += time.perf_counter() - started
    schema = info.boundary.schema
    downstream = None
    if end < n_layer:
        downstream = RangeSpec(
            model_sha256=model_sha256, begin=end, end=n_layer, n_layer=n_layer, n_embd=info.n_embd,
            n_vocab=info.n_vocab, recipe_hash=recipe_hash, n_batch_max=1 << 20, boundary=schema,
        )  # fmt: skip
    session_id = os.urandom(16)
    inbox = _Inbox(peer_id, session_id, downstream)
    # personas: the owner (a client), a sender when the range is not first (an upstream node),
    # a next hop when it is not last
    count = 1 + (begin > 0) + (end < n_layer)
    async with _personas(open_persona, count, inbox) as personas:
        owner = personas[0]
        sender = personas[1] if begin > 0 else owner
        next_hop = personas[-1] if end < n_layer else None
        rest = [next_hop.hop(end, n_layer)] if next_hop is not None else []
        owner_admission = tracker.issue_persona_admission(owner.peer_id, swarm_pb2.ROLE_CLIENT)
        sender_admission = (
            tracker.issue_persona_admission(sender.peer_id, swarm_pb2.ROLE_NODE) if begin > 0 else owner_admission
        )
        target_hop = swarm_pb2.Hop(peer_id=peer_id, addrs=list(node_addrs), begin=begin, end=end)
        sent_any = False
        try:
            tokens, first = list(plan.prompt), 0
            for step in range(plan.steps):
                positions = list(range(first, first + len(tokens)))
                t0 = time.perf_counter()
                rows_in = None
                if begin > 0:
                    (out,) = await refs[0].client.forward([SeqInput(0, positions, token_ids=tokens)])
                    rows_in = out.boundary
                # as the node's worker is asked (agent.io.node.batches._worker_top_k): a K that
                # covers the row is the full row
                top_k = plan.result_top_k if end == n_layer and plan.result_top_k < info.n_vocab else 0
                (out,) = await ref.client.forward([
                    SeqInput(0, positions, token_ids=None if begin > 0 else tokens, boundary=rows_in, top_k=top_k)
                ])  # fmt: skip
                if end < n_layer:
                    expected_rows = out.boundary
                    (last,) = await refs[-1].client.forward([SeqInput(0, positions, boundary=expected_rows, top_k=1)])
                    next_token = _greedy(_last_scores(last))
                else:
                    expected_scores = _last_scores(out)
                    next_token = _greedy(expected_scores)
                stats["reference_s"] += time.perf_counter() - t0

                if begin == 0:
                    request = first_step_request(
                        session_id=session_id, step=step, hops=[target_hop, *rest], token_ids=tokens,
                        first_position=first, recipe_hash=recipe_hash, model_sha256=model_sha256,
                        owner_peer_id=owner.peer_id, owner_addrs=owner.transport.listen_addrs,
                        sender_admission=sender_admission, result_top_k=plan.result_top_k,
                    )  # fmt: skip
                else:
                    assert rows_in is not None
                    request = boundary_step_request(
                        session_id=session_id, step=step, hops=[target_hop, *rest], rows=rows_in,
                        positions=positions, dtype=int(WireDType.F32), schema=schema, recipe_hash=recipe_hash,
                        model_sha256=model_sha256, owner_peer_id=owner.peer_id,
                        owner_addrs=owner.transport.listen_addrs, sender_admission=sender_admission,
                        result_top_k=plan.result_top_k,
                    )  # fmt: skip
                inbox.expect(step)
                t0 = time.perf_counter()
                await _send_step(sender, target_hop, request, config.step_timeout_s)
                sent_any = True
                with trio.move_on_after(config.step_timeout_s):
                    await inbox.arrived.wait()
                stats["node_s"] += time.perf_counter() - t0
                stats["steps"] += 1
                stats["rows"] += len(positions)
                if not inbox.arrived.is_set():
                    raise _Inconclusive(f"no output for step {step} within {config.step_timeout_s} s")
                mismatch = _compare(step, inbox, expected_rows if end < n_layer else None,
                                    None if end < n_layer else expected_scores, rel_error)  # fmt: skip
                if mismatch is not None:
                    return mismatch
                first += len(tokens)
                tokens = [next_token]
            return None
        finally:
            with trio.CancelScope(shield=True):
                for handle in refs:
                    with contextlib.suppress(WorkerError):
                        await handle.client.remove_sequence(0, timeout_s=config.worker_call_timeout_s)
                if sent_any:
                    await _end_session(sender, target_hop, session_id, rest, sender_admission, config.step_timeout_s)


def _compare(
    step: int,
    inbox: _Inbox,
    expected_rows: np.ndarray | None,
    expected_scores: TopLogits | np.ndarray | None,
    rel_error: float | None,
) -> OutputMismatch | None:
    if inbox.malformed:
        return OutputMismatch(step, "boundary rows", "", "", float("inf"), inbox.malformed)
    if expected_rows is not None:
        assert inbox.rows is not None
        return compare_rows(step, expected_rows, inbox.rows, rel_error=rel_error)
    result = inbox.result
    assert result is not None and expected_scores is not None
    if result.error.code:
        raise _Inconclusive(f"the node reported an error at step {step}: {result.error.message}")
    try:
        returned = result_scores(result)
    except ValueError as err:
        return OutputMismatch(step, "logits", "", "", float("inf"), f"the result is malformed: {err}")
    return compare_scores(step, expected_scores, returned, rel_error=rel_error)


async def _send_step(sender: _Persona, hop: swarm_pb2.Hop, request: swarm_pb2.StepRequest, timeout_s: float) -> None:
    try:
        raw = await sender.transport.request(
            hop.peer_id, list(hop.addrs), STEP_PROTOCOL, request.SerializeToString(), timeout_s=timeout_s
        )
        ack = parse_record(swarm_pb2.StepAck, raw)
    except (TransportError, WireError) as err:
        raise _Inconclusive(f"step {request.step} could not be sent: {err}") from None
    if ack.error.code:
        raise _Inconclusive(f"the node refused step {request.step}: {WireError(ack.error.code, ack.error.message)}")


async def _end_session(
    sender: _Persona,
    hop: swarm_pb2.Hop,
    session_id: bytes,
    rest: list[swarm_pb2.Hop],
    admission: swarm_pb2.SignedAdmission,
    timeout_s: float,
) -> None:
    request = swarm_pb2.NodeRequest(
        schema_version=SCHEMA_VERSION,
        sender_admission=admission,
        end_session=swarm_pb2.EndSessionRequest(session_id=session_id, rest=rest),
    )
    try:
        await sender.transport.request(
            hop.peer_id, list(hop.addrs), NODE_PROTOCOL, request.SerializeToString(), timeout_s=timeout_s
        )
    except TransportError as err:
        log.info("could not end canary session %s on %s: %s", session_id.hex(), hop.peer_id, err)


# --- the loop --------------------------------------------------------------------------------


async def serve_verifier(
    tracker: CanaryHost,
    config: VerifierConfig,
    *,
    open_persona: OpenPersona | None = None,
    rng: np.random.Generator | None = None,
    task_status: trio.TaskStatus[VerifierStats] = trio.TASK_STATUS_IGNORED,  # type: ignore[name-defined]  # trio-typing's stale trio stubs
) -> None:
    """Check the tracker's served ranges as its ``CanarySchedule`` says, one at a time, and
    hand every outcome to ``tracker.record_check``; runs until cancelled.

    Args:
      tracker: a running tracker (``Tracker``) with a canary policy.
      open_persona: how fresh identities get a transport (default: libp2p at
        ``config.persona_listen``).
      rng: draws the canaries' lengths and tokens (default: seeded from the OS).

    Started value: the tracker's ``VerifierStats`` (the totals of its checks).
    """
    policy = tracker.canary_policy
    schedule = tracker.canaries
    if policy is None or schedule is None:
        raise ValueError("the tracker has no canary policy")
    open_persona = open_persona or libp2p_personas(config.persona_listen)
    rng = rng or np.random.default_rng(int.from_bytes(os.urandom(16), "little"))
    ctx_size = max(256, -(-policy.max_positions // 256) * 256)
    async with trio.open_nursery() as nursery:
        pool = ReferencePool(nursery, config, ctx_size=ctx_size, batch_size=max(policy.max_prompt_rows, 1))
        task_status.started(tracker.verifier_stats)
        while True:
            key = schedule.next_due(trio.current_time())
            if key is None:
                wakeup = schedule.next_wakeup_s()
                with trio.move_on_at(wakeup if wakeup is not None else trio.current_time() + 3600.0):
                    await tracker.changed()
                continue
            schedule.started(key)
            tracker.record_check(await run_check(tracker, key, pool, config, open_persona, rng))
