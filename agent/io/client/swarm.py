"""The session owner's shell: admission, routes, steps and results over the swarm transport.

Owns the I/O of a client (``baton generate``; later the relay): the hello that gets a CLIENT
admission from the tracker, route requests, tokenize / detokenize / end-session requests to a
route's first hop, sending each step's ``StepRequest`` to the first hop, and the
``/baton/result/1.0.0`` handler where the last hop pushes ``StepResult``. Every decision
(which rows a step sends, whether a result answers the step in flight, which token comes
next, when to stop) is made by ``agent.core.session.Session``.

A result is taken only from a peer with a valid NODE admission that is on the session's
route (logits only from its last hop; an error from any hop), for a live session, for the
step in flight; anything else gets an error ``StepAck`` and changes nothing.

When a hop fails (an error result, a refused or unreachable first hop, no result in time),
the generation either fails with a ``GenerationError`` naming the failed peer (a late step,
or an ack that does not come, makes the owner probe the hops: the first that does not answer is
named; none when every hop answers), or, while ``SwarmClientConfig.replan_attempts`` allow
and a peer was named:
- a peer that is gone or silent is *replaced*: the tracker plans a route part for its blocks
  only (same recipe, around every failed peer), the surviving hops keep their caches up to the
  positions answered so far (``resume_session``), and the replacement is rebuilt from the
  rows the hop before it kept (``replay``; the owner's own tokens when the first hop was
  lost); the step that failed is then sent again (``agent.core.session.resume_plan``);
- otherwise, or when that fails (rows over a hop's budget, no replacement), the owner waits
  for a route without that peer and continues with a new session whose prefill is the prompt
  plus the tokens chosen so far. (Both compute the same greedy tokens in practice, but a
  batched rebuild or prefill is not promised to be bit-identical to step-by-step decode.)

Must not hold a nursery on ``self``: the transport is opened by ``open_swarm_client``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.protobuf.message import DecodeError

from agent._proto import swarm_pb2, worker_pb2
from agent.core.admission import AdmissionError, AdmissionVerifier, make_client_hello, verify_admission
from agent.core.data_frames import DataFrameError, OwnerSession, SessionKeys
from agent.core.data_route import (
    RouteKeys,
    bind_request,
    continuation_steps,
    continue_request,
    data_plane_hosts,
    data_step,
    step_result,
    success_step_result,
)
from agent.core.data_route import result_scores as data_result_scores  # (step_results' takes a StepResult)
from agent.core.identity import peer_id_from_public_key
from agent.core.multiaddrs import peer_id_from_multiaddr
from agent.core.sampling import SamplingParams
from agent.core.session import HopFailed, ResultRefused, Session, end_session_request, resume_plan, surviving_hops
from agent.core.spot_check import RouteSegment, rollback_point
from agent.core.step_requests import first_step_request
from agent.core.swarm_wire import (
    NODE_PROTOCOL,
    RESULT_PROTOCOL,
    SCHEMA_VERSION,
    SESSION_ID_BYTES,
    STEP_PROTOCOL,
    TRACKER_PROTOCOL,
    step_ack,
    step_ack_accepts,
)
from agent.core.swarm_wire import (
    error as wire_error,
)
from agent.core.text_stream import TextStream
from agent.core.topk import TopLogits
from agent.io.client.spot_check import ResultTaker, SpotChecks, withdrawn_peers
from agent.io.data_link import DataLink, DataLinkClosed, open_data_link
from agent.io.transport import ImmediateHandler, Transport, TransportError

if TYPE_CHECKING:
    from agent.io.vocab import ModelVocab

__all__ = [
    "GenerationError",
    "GenerationResult",
    "SwarmClient",
    "SwarmClientConfig",
    "SwarmError",
    "describe_route",
    "open_swarm_client",
    "route_hops",
    "split_peer_addr",
]

log = logging.getLogger(__name__)

#: the route handouts of the generation running in this task (``generate_tokens``), reported
#: to the tracker when it ends (``agent.core.handouts``)
_GENERATION_HANDOUTS: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("handouts", default=None)


def _reporting_handouts(method):
    """Collect the route handouts a generation gets (``route()`` adds them) and report them
    ended to the tracker when it ends, however it ends."""

    @functools.wraps(method)
    async def generate(self, *args, **kwargs):
        route = kwargs.get("route")
        handouts = [route.handout_id] if route is not None and route.handout_id else []
        collecting = _GENERATION_HANDOUTS.set(handouts)
        try:
            return await method(self, *args, **kwargs)
        finally:
            _GENERATION_HANDOUTS.reset(collecting)
            with trio.CancelScope(shield=True):
                await self._sessions_ended(handouts)

    return generate


_NONCE_BYTES = 16
#: how many times one run of a session tries to bind its route on the data plane
_DATA_PLANE_TRIES = 2


@dataclasses.dataclass(frozen=True)
class SwarmClientConfig:
    """Timeouts and limits of a client.

    ``request_timeout_s``: one control exchange (hello, route, tokenize, step ack, end session).
    ``step_timeout_s``: from sending a step until its result is pushed back.
    ``replan_attempts``: how many times one generation may move to a new route after a hop fails.
    ``replan_wait_s``: how long a replan waits for the tracker to offer a route without the
    failed peer (it notices a dead node after its heartbeat timeout).
    ``route_poll_interval_s``: pause between two route requests while waiting for a route
    (and the first pause while waiting for a free sequence).
    ``queue_timeout_s``: how long a new generation waits for a free sequence on its route.
    ``session_ended_timeout_s``: how long a finished generation spends telling the tracker its
    routes carry it no more (best effort: the hops' next heartbeats say it anyway).
    ``prefill_chunk_tokens``: a prompt (or a re-prefill) longer than this goes in chunks of
    this many rows, one step each (at most the workers' batch: 512 by default).
    ``min_data_plane_step_deadline_s``: the same floor for a step that goes worker to worker,
    lower: no node on the way reports a lost next hop there (a worker that cannot reach the
    next one can only drop the step), so the owner's probes are what name it, and a probe that
    was not needed costs only a touch of each hop.
    ``step_deadline_factor`` / ``min_step_deadline_s``: a decode step that takes longer than
    this multiple of the measured decode step time (and at least the minimum) makes the owner
    probe the route's hops, each within ``probe_timeout_s``; one that does not answer is probed
    again, up to ``probe_attempts`` times, each attempt allowed one ``probe_timeout_s`` more (on
    a WAN link that drops packets one lost segment costs a TCP retransmission timeout, and a
    lost SYN a second: one missed probe is not a dead hop), and one that answers none is named
    as the failed peer (``step_timeout_s`` still bounds the wait when every hop answers).
    ``report_grace_s``: how long a replan waits for the tracker to take the lost-peer report
    once the new route is there (the tracker finishes its probe on its own).
    A prefill (chunk), or a decode before any was measured, has no measured time to go by: its
    hops are probed every ``probe_interval_s`` while it waits, and so is a decode past its
    deadline (a hop can die after answering a probe).
    ``resume``: a lost hop is replaced while the other hops keep their caches (False: every
    replan re-prefills a whole new route, e.g. to compare the two).
    ``data_plane``: once a session's prompt is in the route's caches, its decode steps go worker
    to worker (``agent.core.data_route``) when every hop offers it (a hop reached only through
    the relay does not): the owner sends each step to the first hop's worker and takes its
    result from the last's, sealed with keys it gave the hops' nodes; the nodes only lease
    (renewed by the owner's touches every ``probe_interval_s``) and unbind. False: every step
    through the node agents.
    ``greedy_continuation``: a greedy session on the data plane asks its last hop to send each
    next decode step straight to the first hop (``DataPlaneContinueRequest``), which takes the
    first copy of each step, the last hop's or the owner's: the owner's round trip leaves the
    step's critical path. False: only the owner's steps.
    """

    request_timeout_s: float = 10.0
    session_ended_timeout_s: float = 2.0
    step_timeout_s: float = 30.0
    replan_attempts: int = 3
    replan_wait_s: float = 20.0
    route_poll_interval_s: float = 0.25
    queue_timeout_s: float = 60.0
    prefill_chunk_tokens: int = 512
    step_deadline_factor: float = 10.0
    min_step_deadline_s: float = 1.0
    min_data_plane_step_deadline_s: float = 0.25
    probe_timeout_s: float = 0.5
    probe_attempts: int = 2
    report_grace_s: float = 0.2
    probe_interval_s: float = 1.0
    resume: bool = True
    data_plane: bool = True
    greedy_continuation: bool = True
    # Integrity (agent/io/client/spot_check.py, docs/INTEGRITY.md): the share of sessions replayed
    # through a route of the same recipe around one of their hops and compared bit for bit,
    # how long a session that ended waits for its replay, and how long the tracker may take to
    # say whether a peer of the generation's routes failed a check (tokens computed through one
    # are taken back and generated again; False: never ask).
    spot_check_rate: float = 0.0
    spot_check_grace_s: float = 5.0
    integrity_timeout_s: float = 1.0
    check_route_integrity: bool = True

    def __post_init__(self) -> None:
        for name in (
            "request_timeout_s", "step_timeout_s", "replan_wait_s", "route_poll_interval_s", "queue_timeout_s",
            "step_deadline_factor", "min_step_deadline_s", "min_data_plane_step_deadline_s", "probe_timeout_s", "report_grace_s", "probe_interval_s",
            "spot_check_grace_s", "integrity_timeout_s",
        ):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, got {self.prefill_chunk_tokens}")
        if self.probe_attempts < 1:
            raise ValueError(f"probe_attempts must be >= 1, got {self.probe_attempts}")
        if self.replan_attempts < 0:
            raise ValueError(f"replan_attempts must be >= 0, got {self.replan_attempts}")
        if not 0.0 <= self.spot_check_rate <= 1.0:
            raise ValueError(f"spot_check_rate must be in [0, 1], got {self.spot_check_rate}")


class SwarmError(Exception):
    """A peer answered with an error (``code``: a ``swarm_pb2.Error.Code``), or an answer
    could not be used. ``peer_id``: who answered."""

    def __init__(self, peer_id: str, code: int, message: str) -> None:
        super().__init__(f"{_code_name(code)} from {peer_id}: {message}")
        self.peer_id = peer_id
        self.code = code
        self.message = message


class GenerationError(Exception):
    """A generation failed; ``failed_peer_id`` names the hop at fault ("" if unknown)."""

    def __init__(self, message: str, *, failed_peer_id: str = "", step: int | None = None, code: int = 0) -> None:
        super().__init__(message)
        self.failed_peer_id = failed_peer_id
        self.step = step
        self.code = code  # the swarm_pb2.Error.Code a hop reported (0: none, e.g. a timeout)


@dataclasses.dataclass
class GenerationResult:
    """What ``SwarmClient.generate`` produced.

    ``tokens``: generated token ids (an end-of-generation token that stopped it included);
    ``text``: their text (without that token); ``route``: the hops of the last route used, as
    ``{"node", "begin", "end"}``; ``tokens_per_s``: decode steps per second of step time;
    ``hop_rows``: rows each hop processed, over every route used, as ``{"node", "begin",
    "end", "rows"}`` (the ledger's input); ``context_full``: the route's context filled up
    before the budget was spent; ``stopped_by_caller``: ``on_token`` ended it;
    ``node_rows``: the rows each hop says it computed (its own count, returned when the
    session is ended: a lost hop reports none), as ``hop_rows``;
    ``first_token_s``: from the first step sent to the first token; ``resumes``: how many of
    the ``replans`` replaced a lost hop while the other hops kept their caches (the others
    re-prefilled a new route); ``resume_s``: the time each resume took (lost hop named to
    rebuilt), in order; ``data_plane_steps``: the steps that went worker to worker (the rest
    went through the node agents: prompt chunks, and every step of a route a hop of which has
    no data plane).
    """

    text: str
    tokens: list[int]
    prompt_tokens: list[int]
    route: list[dict]
    model_sha256: str
    prefill_s: float
    decode_s: float
    decode_steps: int
    stopped_by_token: bool
    replans: int = 0
    hop_rows: list[dict] = dataclasses.field(default_factory=list)
    context_full: bool = False
    stopped_by_caller: bool = False
    first_token_s: float = 0.0
    resumes: int = 0
    resume_s: list[float] = dataclasses.field(default_factory=list)
    node_rows: list[dict] = dataclasses.field(default_factory=list)
    #: tokens taken back (and generated again) because a peer that computed them failed an
    #: integrity check; ``on_token`` had seen them
    tokens_taken_back: int = 0
    data_plane_steps: int = 0
    #: of the data plane steps, those the first hop took from the last hop's greedy
    #: continuation before the owner's own copy came (the first hops' count)
    continued_steps: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return len(self.prompt_tokens) / self.prefill_s if self.prefill_s > 0 else 0.0

    def to_json(self) -> dict:
        return {
            "text": self.text,
            "tokens": list(self.tokens),
            "prompt_tokens": len(self.prompt_tokens),
            "route": [dict(hop) for hop in self.route],
            "model_sha256": self.model_sha256,
            "tokens_per_s": self.tokens_per_s,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "stopped_by_token": self.stopped_by_token,
            "replans": self.replans,
            "resumes": self.resumes,
            "data_plane_steps": self.data_plane_steps,
            "continued_steps": self.continued_steps,
            "hop_rows": [dict(hop) for hop in self.hop_rows],
            "node_rows": [dict(hop) for hop in self.node_rows],
        }


def _code_name(code: int) -> str:
    try:
        return swarm_pb2.Error.Code.Name(code)
    except ValueError:
        return f"code {code}"


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def split_peer_addr(addr: str) -> tuple[str, list[str]]:
    """``(peer_id, [addr])`` of a multiaddr ending in ``/p2p/<peer id>``.

    Raises:
      ValueError: the address names no peer id.
    """
    return peer_id_from_multiaddr(addr), [addr]


def route_hops(route: swarm_pb2.Route) -> list[dict]:
    """A route's hops as ``{"node": peer id, "begin", "end"}`` (what reports show)."""
    return [{"node": hop.peer_id, "begin": hop.begin, "end": hop.end} for hop in route.hops]


def describe_route(route: swarm_pb2.Route) -> str:
    return " -> ".join(f"{hop.peer_id}[{hop.begin}, {hop.end})" for hop in route.hops)


@dataclasses.dataclass
class _Progress:
    """Tokens chosen so far in one generation (over all its sessions), step time, and the rows
    each hop processed."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    data_plane_steps: int = 0
    continued_steps: int = 0
    first_token_s: float = 0.0
    rows: dict[tuple[str, int, int], int] = dataclasses.field(default_factory=dict)
    node_rows: dict[tuple[str, int, int], int] = dataclasses.field(default_factory=dict)
    started_at: float = dataclasses.field(default_factory=time.perf_counter)  # before the first step
    last_token_at: float = 0.0

    def add(self, token: int, elapsed_s: float, *, prefill: bool) -> None:
        """A token taken: a prefill's ``elapsed_s`` is its step's (the prompt's chunks, each
        step's own); a decode token counts the wall time since the token before it, the owner's
        own work between the two included (with greedy continuation the next step is under
        way meanwhile: its send-to-result time alone would leave that work out)."""
        now = time.perf_counter()
        if not self.tokens:  # every prefill chunk (and any replan) up to the first token
            self.first_token_s = now - self.started_at
        self.tokens.append(token)
        if prefill:
            self.prefill_s += elapsed_s
        else:
            self.decode_s += now - self.last_token_at if self.last_token_at else elapsed_s
            self.decode_steps += 1
        self.last_token_at = 0.0 if prefill else now

    def interrupted(self) -> None:
        """A step failed: the next token's time is its own step's (a resume is not decoding)."""
        self.last_token_at = 0.0

    def add_rows(self, route: swarm_pb2.Route, n_rows: int) -> None:
        for hop in route.hops:
            key = (hop.peer_id, hop.begin, hop.end)
            self.rows[key] = self.rows.get(key, 0) + n_rows

    def add_node_rows(self, counted: Sequence[swarm_pb2.SessionRows]) -> None:
        for hop in counted:
            key = (hop.peer_id, hop.begin, hop.end)
            self.node_rows[key] = self.node_rows.get(key, 0) + hop.rows
            if hop.begin == 0:
                self.continued_steps += hop.continued_steps

    def hop_rows_list(self, *, nodes: bool = False) -> list[dict]:
        rows = self.node_rows if nodes else self.rows
        return [{"node": p, "begin": b, "end": e, "rows": n} for (p, b, e), n in rows.items()]


@dataclasses.dataclass
class _Rebuild:
    """A rebuild in progress: the rebuilt part of the route (``peers``, answering from
    ``last_peer``) must report ``positions`` rebuilt for step ``step``."""

    step: int
    positions: int
    peers: frozenset[str]
    last_peer: str
    done: trio.Event = dataclasses.field(default_factory=trio.Event)
    error: str = ""


class _LiveSession:
    """A live session: where the result handler delivers the outcome of its step in flight,
    or of its rebuild."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.arrived = trio.Event()
        self.outcome: int | BaseException | None = None
        self.rebuild: _Rebuild | None = None
        # the last result the session took: a StepResult (node path) or a DataResult (data plane)
        self.result: swarm_pb2.StepResult | None = None
        self.data_result: worker_pb2.DataResult | None = None

    def arm(self) -> None:
        self.arrived = trio.Event()
        self.outcome = None

    def deliver(self, remote_peer_id: str, result: swarm_pb2.StepResult) -> swarm_pb2.Error | None:
        """Hand ``result`` to the session (which decides whether to take it); the error to
        acknowledge with, or None."""
        rebuild = self.rebuild
        if rebuild is not None and result.step == rebuild.step:
            return self._deliver_rebuild(rebuild, remote_peer_id, result)
        if result.rebuilt_positions:  # a late answer to a rebuild that is over: not a step's result
            return _err("INVALID_ARGUMENT", f"no rebuild of step {result.step} is in progress")
        return self._settle(result.step, remote_peer_id, lambda: self.session.receive(result, remote_peer_id), result)

    def deliver_data(self, remote_peer_id: str, result: worker_pb2.DataResult) -> swarm_pb2.Error | None:
        """As ``deliver``, for a successful RESULT of the data plane (opened under the session's
        return key): its scores go to the session without a ``StepResult`` in between."""
        return self._settle(
            result.step,
            remote_peer_id,
            lambda: self.session.receive_scores(
                result.step, lambda: data_result_scores(result), int(result.n_vocab), remote_peer_id
            ),
            result,
        )  # fmt: skip

    def taken_result(self) -> swarm_pb2.StepResult | None:
        """The last result the session took, as a ``StepResult`` (a spot check replays them)."""
        if self.data_result is not None:
            return success_step_result(self.session.session_id, self.data_result)
        return self.result

    def _settle(
        self,
        step: int,
        remote_peer_id: str,
        receive: Callable[[], int | None],
        result: swarm_pb2.StepResult | worker_pb2.DataResult,
    ) -> swarm_pb2.Error | None:
        try:
            self.outcome = receive()
            if isinstance(result, worker_pb2.DataResult):
                self.result, self.data_result = None, result
            else:
                self.result, self.data_result = result, None
        except HopFailed as error:
            self.outcome = GenerationError(
                f"step {step}: {error}", failed_peer_id=error.failed_peer_id or remote_peer_id,
                step=step, code=error.code,
            )  # fmt: skip
        except ResultRefused as error:
            if not error.fatal:
                return wire_error(error.code, error.message)
            self.outcome = GenerationError(f"{error.message} (from {remote_peer_id})", failed_peer_id=remote_peer_id)
            self.arrived.set()
            return wire_error(error.code, error.message)
        self.arrived.set()
        return None

    @staticmethod
    def _deliver_rebuild(
        rebuild: _Rebuild, remote_peer_id: str, result: swarm_pb2.StepResult
    ) -> swarm_pb2.Error | None:
        if rebuild.done.is_set():
            return _err("INVALID_ARGUMENT", f"the rebuild for step {rebuild.step} is over")
        if result.error.code != swarm_pb2.Error.CODE_UNSPECIFIED:
            if remote_peer_id not in rebuild.peers:
                return _err("REFUSED", f"{remote_peer_id} is not on the rebuilt part of the route")
            who = result.failed_peer_id or remote_peer_id
            rebuild.error = f"rebuild failed at {who}: {_code_name(result.error.code)}: {result.error.message}"
            rebuild.done.set()
            return None
        if remote_peer_id != rebuild.last_peer:
            return _err("REFUSED", f"rebuild results come from {rebuild.last_peer}, not {remote_peer_id}")
        if result.rebuilt_positions > rebuild.positions:
            rebuild.error = (
                f"{remote_peer_id} rebuilt {result.rebuilt_positions} positions, {rebuild.positions} were sent"
            )
            rebuild.done.set()
        elif result.rebuilt_positions == rebuild.positions:
            rebuild.done.set()
        return None


class _DataPlane:
    """A session's route on the workers' data plane, owner side: STEPs go on ``to_first``,
    RESULTs come back on ``from_last`` (read by the owner's task itself while it waits: no
    task of its own), and a NOTICE (a worker refused a frame) on either."""

    #: how long a look for a NOTICE on the first hop's connection waits (past a step's deadline)
    NOTICE_LOOK_S = 0.01

    def __init__(self, owner: OwnerSession, route: swarm_pb2.Route, to_first: DataLink, from_last: DataLink) -> None:
        self.owner, self.route, self.to_first, self.from_last = owner, route, to_first, from_last
        self.touched_at = -math.inf

    async def send(self, live: _LiveSession, step: worker_pb2.DataStep) -> None:
        """Send the step to the first hop's worker; a connection that fails fails the step,
        naming that hop (gone: the owner resumes around it)."""
        try:
            await self.to_first.send(self.owner.step_frame(step))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as why:
            self._fail(live, self.route.hops[0], f"the data plane connection failed: {why}")

    async def receive(self, live: _LiveSession) -> None:
        """Read the last hop's connection until the step in flight has its outcome: a RESULT
        the session takes (one it refuses, e.g. stale, is dropped), or a failure naming the
        last hop (the connection ended, a NOTICE). Safe to cancel between frames and within one."""
        await self._receive(live, self.from_last, self.route.hops[-1])

    async def look_for_notice(self, live: _LiveSession) -> None:
        """Whether the first hop's worker refused the step (a NOTICE waiting on its connection)."""
        with trio.move_on_after(self.NOTICE_LOOK_S):
            await self._receive(live, self.to_first, self.route.hops[0])

    async def _receive(self, live: _LiveSession, link: DataLink, hop: swarm_pb2.Hop) -> None:
        while not live.arrived.is_set():
            try:
                frame = await link.receive()
            except (DataLinkClosed, DataFrameError, trio.BrokenResourceError, trio.ClosedResourceError, OSError) as why:
                self._fail(live, hop, f"the data plane connection ended: {why}")
                return
            try:
                result = self.owner.open_result(frame)
            except DataFrameError as why:
                self._fail(live, hop, str(why))
                return
            if result.error_code:
                failed, sender = step_result(self.owner.session_id, result, self.route)
                live.deliver(sender, failed)
            else:
                live.deliver_data(self.route.hops[-1].peer_id, result)

    @staticmethod
    def _fail(live: _LiveSession, hop: swarm_pb2.Hop, why: str) -> None:
        step = live.session.step
        if live.arrived.is_set() or not live.session.awaiting:
            log.info("data plane of session %s: %s: %s", live.session.session_hex, hop.peer_id, why)
            return
        live.outcome = GenerationError(
            f"step {step}: data plane, {hop.peer_id}: {why}", failed_peer_id=hop.peer_id, step=step,
            code=swarm_pb2.Error.UNAVAILABLE,
        )  # fmt: skip
        live.arrived.set()


def _err(code_name: str, message: str) -> swarm_pb2.Error:
    return wire_error(swarm_pb2.Error.Code.Value(code_name), message)


class SwarmClient:
    """A client admitted by a tracker (made by ``open_swarm_client``)."""

    def __init__(
        self,
        transport: Transport,
        key: Ed25519PrivateKey,
        tracker_peer_id: str,
        tracker_addrs: Sequence[str],
        config: SwarmClientConfig,
        now_ms: Callable[[], int] = _now_ms,
    ) -> None:
        self.transport = transport
        self.config = config
        self.tracker_peer_id = tracker_peer_id
        self.tracker_addrs = list(tracker_addrs)
        self.tracker_public_key = b""
        self._sender_admissions = AdmissionVerifier(b"")  # replaced once the tracker key is known
        self.admission = swarm_pb2.SignedAdmission()
        self._key = key
        self._now_ms = now_ms
        self._admission_record = swarm_pb2.AdmissionRecord()
        self._live: dict[bytes, ResultTaker] = {}  # a _LiveSession, or a spot check's shadow
        self._last_routes: dict[str, swarm_pb2.Route] = {}  # model -> the tracker's last route
        self._decode_step_s: float | None = None  # moving average of decode step time
        self.spot_checks = SpotChecks(self, config.spot_check_rate, config.spot_check_grace_s)
        # the ack goes out after the generation has sent its next step
        transport.set_handler(
            RESULT_PROTOCOL, ImmediateHandler(self._on_result, reply_later=True, is_acceptance=step_ack_accepts)
        )
        #: steps sent without a task when the transport can (``_send_step_soon``)
        self._request_soon = getattr(transport, "request_soon", None)

    @property
    def peer_id(self) -> str:
        return self.transport.peer_id

    # --- tracker -----------------------------------------------------------------------------

    async def _exchange(self, peer_id: str, addrs: Sequence[str], protocol: str, request, reply):
        """Send ``request`` on ``protocol``, parse the answer into ``reply`` (a message of the
        expected type) and raise ``SwarmError`` for an error reply or bytes that do not parse."""
        request.schema_version = SCHEMA_VERSION
        raw = await self.transport.request(
            peer_id, list(addrs), protocol, request.SerializeToString(), timeout_s=self.config.request_timeout_s
        )
        try:
            reply.ParseFromString(raw)
        except DecodeError:
            raise SwarmError(peer_id, swarm_pb2.Error.INTERNAL, f"malformed {type(reply).__name__}") from None
        if reply.error.code != swarm_pb2.Error.CODE_UNSPECIFIED:
            raise SwarmError(peer_id, reply.error.code, reply.error.message)
        return reply

    async def _tracker(self, request: swarm_pb2.TrackerRequest) -> swarm_pb2.TrackerReply:
        return await self._exchange(
            self.tracker_peer_id, self.tracker_addrs, TRACKER_PROTOCOL, request, swarm_pb2.TrackerReply()
        )

    async def hello(self) -> None:
        """Get a (new) CLIENT admission from the tracker.

        Raises:
          SwarmError: the tracker refused, or its key does not belong to its peer id.
          TransportError: the tracker could not be reached.
        """
        hello = make_client_hello(self._key, self._now_ms(), os.urandom(_NONCE_BYTES))
        reply = await self._tracker(swarm_pb2.TrackerRequest(client_hello=hello))
        if reply.WhichOneof("body") != "client_hello":
            raise SwarmError(self.tracker_peer_id, swarm_pb2.Error.INTERNAL, "the hello reply has no admission")
        tracker_key = bytes(reply.client_hello.tracker_public_key)
        try:
            key_peer_id = peer_id_from_public_key(tracker_key)
        except ValueError as error:
            raise SwarmError(self.tracker_peer_id, swarm_pb2.Error.INTERNAL, str(error)) from None
        if key_peer_id != self.tracker_peer_id:
            raise SwarmError(
                self.tracker_peer_id,
                swarm_pb2.Error.REFUSED,
                f"the tracker's public key belongs to {key_peer_id}, not to the tracker dialled",
            )
        try:
            record = verify_admission(
                reply.client_hello.admission, tracker_key, self.peer_id, self._now_ms(), roles=[swarm_pb2.ROLE_CLIENT]
            )
        except AdmissionError as error:
            raise SwarmError(self.tracker_peer_id, swarm_pb2.Error.INTERNAL, f"unusable admission: {error}") from None
        self.tracker_public_key = tracker_key
        self.admission = reply.client_hello.admission
        self._admission_record = record

    async def _fresh_admission(self) -> None:
        """Renew the admission past its half-life. While the tracker cannot be reached, an
        admission that has not expired is used as it is (running swarms do not need the
        tracker)."""
        record = self._admission_record
        half_life_ms = (record.expires_at_ms - record.issued_at_ms) // 2
        if not record.expires_at_ms or self._now_ms() >= record.issued_at_ms + half_life_ms:
            try:
                await self.hello()
            except TransportError as error:
                if not record.expires_at_ms or self._now_ms() >= record.expires_at_ms:
                    raise
                log.warning("the tracker cannot be reached (%s): keeping the current admission", error)

    async def route(
        self, model: str, *, avoid_peers: Sequence[str] = (), part: tuple[int, int, str] | None = None
    ) -> swarm_pb2.Route:
        """The tracker's route for ``model`` (alias, name or sha256), around ``avoid_peers``.
        ``part``: ``(begin, end, recipe hash)``: hops for blocks ``[begin, end)`` only, of that
        recipe (a replacement for a lost range).

        While the tracker cannot be reached, the last (whole) route it gave for ``model`` is
        used (if it avoids ``avoid_peers``), with a warning: running swarms do not need the
        tracker.

        Raises:
          SwarmError: e.g. UNAVAILABLE when some blocks have no ready node (or none without
            ``avoid_peers``), NOT_FOUND for an unknown model.
          TransportError: the tracker could not be reached and no route for ``model`` was seen.
        """
        request = swarm_pb2.RouteRequest(model=model, avoid_peers=list(avoid_peers))
        if part is not None:
            request.begin, request.end, request.recipe_hash = part
        try:
            reply = await self._tracker(swarm_pb2.TrackerRequest(route=request))
        except TransportError as error:
            last = self._last_routes.get(model)
            if part is not None or last is None or set(avoid_peers) & {hop.peer_id for hop in last.hops}:
                raise
            log.warning("the tracker cannot be reached (%s): using the last route it gave for %r", error, model)
            return last
        route = reply.route
        if reply.WhichOneof("body") != "route" or not route.hops:
            raise SwarmError(
                self.tracker_peer_id, swarm_pb2.Error.INTERNAL, f"the route reply for {model!r} has no hops"
            )
        if route.handout_id and (handouts := _GENERATION_HANDOUTS.get()) is not None:
            handouts.append(route.handout_id)
        if part is None:
            self._last_routes[model] = route
        return route

    async def report_lost_peer(self, peer_id: str, reason: str) -> bool:
        """Tell the tracker this owner lost ``peer_id``; True when the tracker confirmed it
        (its probe got no answer either) and took it out of routes. Best effort: a tracker
        that cannot be reached gives False."""
        request = swarm_pb2.ReportLostPeerRequest(peer_id=peer_id, reason=reason[:500])
        try:
            reply = await self._tracker(swarm_pb2.TrackerRequest(report_lost_peer=request))
        except (SwarmError, TransportError) as error:
            log.info("could not report the lost peer %s to the tracker: %s", peer_id, error)
            return False
        return reply.report_lost_peer.confirmed

    async def integrity(self, peer_ids: Sequence[str]) -> swarm_pb2.IntegrityReply:
        """Which of ``peer_ids`` the tracker says failed an integrity check lately."""
        reply = await self._tracker(swarm_pb2.TrackerRequest(integrity=swarm_pb2.IntegrityRequest(peer_ids=peer_ids)))
        return reply.integrity

    async def report_mismatch(self, report: swarm_pb2.ReportMismatchRequest) -> swarm_pb2.ReportMismatchReply:
        """Tell the tracker a spot check disagreed (it checks the peers the routes differ in)."""
        reply = await self._tracker(swarm_pb2.TrackerRequest(report_mismatch=report))
        return reply.report_mismatch

    async def list_models(self) -> list[swarm_pb2.ModelEntry]:
        reply = await self._tracker(swarm_pb2.TrackerRequest(list_models=swarm_pb2.ListModelsRequest()))
        return list(reply.list_models.models)

    async def model_metadata(self, model: str) -> swarm_pb2.ModelMetadataReply:
        """The registered GGUF's metadata bytes (everything before its tensors) and size.

        Raises:
          SwarmError: NOT_FOUND for an unknown model; UNAVAILABLE when the tracker cannot read it.
          TransportError: the tracker could not be reached.
        """
        request = swarm_pb2.TrackerRequest(model_metadata=swarm_pb2.ModelMetadataRequest(model=model))
        reply = await self._tracker(request)
        if reply.WhichOneof("body") != "model_metadata":
            raise SwarmError(
                self.tracker_peer_id, swarm_pb2.Error.INTERNAL, f"the metadata reply for {model!r} is empty"
            )
        return reply.model_metadata

    async def list_nodes(self) -> list[swarm_pb2.NodeEntry]:
        """The tracker's nodes: addresses, liveness, what each serves and was assigned."""
        reply = await self._tracker(swarm_pb2.TrackerRequest(list_nodes=swarm_pb2.ListNodesRequest()))
        return list(reply.list_nodes.nodes)

    async def wait_for_route(
        self, model: str, *, timeout_s: float, avoid_peers: Sequence[str] = (), part: tuple[int, int, str] | None = None
    ) -> swarm_pb2.Route:
        """Poll ``route(model)`` (or a ``part`` of it: see ``route``) until it succeeds
        without any of ``avoid_peers``.

        Raises:
          GenerationError: no such route within ``timeout_s`` (the last reason in the message).
        """
        avoid = set(avoid_peers)
        last = "no answer yet"
        with trio.move_on_after(timeout_s):
            while True:
                try:
                    route = await self.route(model, avoid_peers=sorted(avoid), part=part)
                except (SwarmError, TransportError) as error:
                    last = str(error)
                else:
                    bad = avoid & {hop.peer_id for hop in route.hops}
                    if not bad:
                        return route
                    last = f"the route still goes through {', '.join(sorted(bad))}"
                await trio.sleep(self.config.route_poll_interval_s)
        raise GenerationError(f"no route for {model!r} within {timeout_s} s: {last}", code=swarm_pb2.Error.UNAVAILABLE)

    # --- first hop -----------------------------------------------------------------------------

    async def _node(self, hop: swarm_pb2.Hop, request: swarm_pb2.NodeRequest) -> swarm_pb2.NodeReply:
        request.sender_admission.CopyFrom(self.admission)
        return await self._exchange(hop.peer_id, hop.addrs, NODE_PROTOCOL, request, swarm_pb2.NodeReply())

    async def tokenize(
        self, route: swarm_pb2.Route, text: str, *, add_special: bool = True
    ) -> tuple[list[int], list[int]]:
        """``(token ids, end-of-generation token ids)`` from the route's first hop."""
        reply = await self._node(
            route.hops[0],
            swarm_pb2.NodeRequest(
                tokenize=swarm_pb2.TokenizeRequest(model_sha256=route.model_sha256, text=text, add_special=add_special)
            ),
        )
        return list(reply.token_ids), list(reply.eog_token_ids)

    async def detokenize(self, route: swarm_pb2.Route, token_ids: Sequence[int]) -> str:
        reply = await self._node(
            route.hops[0],
            swarm_pb2.NodeRequest(
                detokenize=swarm_pb2.DetokenizeRequest(model_sha256=route.model_sha256, token_ids=list(token_ids))
            ),
        )
        return reply.text

    async def end_session(
        self, route: swarm_pb2.Route, session_id: bytes, *, lost_peers: Sequence[str] = ()
    ) -> list[swarm_pb2.SessionRows]:
        """Free ``session_id`` on every hop of ``route`` but the ``lost_peers`` (through the
        first of the others, which passes it on); the rows each hop says it computed for it."""
        hops = surviving_hops(route, lost_peers)
        if not hops:
            return []
        reply = await self._node(hops[0], end_session_request(session_id, route, self.admission, lost_peers))
        return list(reply.session_rows)

    # --- results -----------------------------------------------------------------------------

    def take_results(self, session_id: bytes, taker: ResultTaker) -> None:
        """From now on the results pushed for ``session_id`` go to ``taker`` (a spot check's
        shadow session: ``agent.io.client.spot_check``)."""
        self._live[session_id] = taker

    def stop_taking_results(self, session_id: bytes) -> None:
        """Results for ``session_id`` are refused again (an unknown session)."""
        del self._live[session_id]

    def _on_result(self, remote_peer_id: str, payload: bytes) -> bytes:
        """``/baton/result``: take a step's result (answered inline by the direct channel)."""
        try:
            return step_ack(self._take_result(remote_peer_id, payload))
        except Exception as error:  # a handler answers; it never tears the host down
            log.exception("result handler failed")
            return step_ack(_err("INTERNAL", f"{type(error).__name__}: {error}"))

    def _take_result(self, remote_peer_id: str, payload: bytes) -> swarm_pb2.Error | None:
        result = swarm_pb2.StepResult()
        try:
            result.ParseFromString(payload)
        except DecodeError:
            return _err("INVALID_ARGUMENT", "malformed StepResult: the bytes do not parse")
        if result.schema_version != SCHEMA_VERSION:
            return _err(
                "INVALID_ARGUMENT",
                f"schema_version {result.schema_version} is not supported (this peer speaks {SCHEMA_VERSION})",
            )
        if self._sender_admissions.tracker_public_key != self.tracker_public_key:
            self._sender_admissions = AdmissionVerifier(self.tracker_public_key)
        try:
            # every result of a route carries the same admissions: each signature is checked once
            self._sender_admissions.verify(
                result.sender_admission, remote_peer_id, self._now_ms(), roles=[swarm_pb2.ROLE_NODE]
            )
        except AdmissionError as error:
            return _err("REFUSED", f"sender admission refused: {error.reason}")
        live = self._live.get(bytes(result.session_id))
        if live is None:
            return _err("NOT_FOUND", f"unknown session {bytes(result.session_id).hex()}")
        return live.deliver(remote_peer_id, result)

    # --- generation ----------------------------------------------------------------------------

    async def generate(
        self,
        model: str,
        prompt: str,
        *,
        max_tokens: int = 48,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        on_text: Callable[[str], None] | None = None,
        route: swarm_pb2.Route | None = None,
        vocab: ModelVocab | None = None,
    ) -> GenerationResult:
        """Generate up to ``max_tokens`` tokens from ``prompt`` through the swarm.

        Args:
          model: alias, name or sha256 the tracker knows.
          prompt: the text. With ``vocab`` (the model's vocabulary held locally:
            ``agent.io.vocab``), it is tokenized here and the output detokenized here, piece by
            piece, so no token costs a round trip and no hop is asked for text; without, the
            route's first hop tokenizes (with special tokens, e.g. BOS) and detokenizes.
          temperature, top_k, top_p: sampling (temperature 0: greedy); see ``SamplingParams``.
          seed: seeds the random generator (same seed, same route results: same tokens).
          on_text: called with each new piece of text as it is decoded (whole UTF-8 characters).
          route: use this route instead of asking the tracker.

        Returns:
          A ``GenerationResult``.

        Raises:
          ValueError: bad sampling parameters or ``max_tokens``.
          SwarmError: the tracker or first hop refused a control request (no route, unknown model).
          GenerationError: a step failed and no replan was left; names the failed peer.

        Resource handling:
          Each session is ended on its route (best effort, within ``request_timeout_s``)
          before this returns or raises.

        Cancellation:
          Safe to cancel; the session is then ended on its route as above (shielded).
        """
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        await self._fresh_admission()
        if route is None:
            route = await self.route(model)
        if vocab is not None:
            return await self._generate_with_vocab(model, prompt, vocab, max_tokens, sampling, seed, on_text, route)
        prompt_tokens, stop_tokens = await self._tokenize_prompt(route, prompt)
        generated: list[int] = []
        shown = ""
        current_route = route

        async def stream(token: int, _logits, on_route: swarm_pb2.Route) -> bool:
            # detokenize the whole output: a token may end in the middle of a UTF-8 character
            nonlocal shown, current_route
            generated.append(token)
            current_route = on_route
            if on_text is None or token in stop_tokens:
                return False
            text = await self.detokenize(on_route, generated)
            if text.startswith(shown) and len(text) > len(shown):
                on_text(text[len(shown) :])
                shown = text
            return False

        result = await self.generate_tokens(
            model, prompt_tokens, max_tokens=max_tokens, stop_tokens=stop_tokens, sampling=sampling, seed=seed,
            on_token=stream, route=route,
        )  # fmt: skip
        final_tokens = result.tokens[:-1] if result.stopped_by_token else result.tokens
        text = await self.detokenize(current_route, final_tokens) if final_tokens else ""
        if on_text is not None and text.startswith(shown) and len(text) > len(shown):
            on_text(text[len(shown) :])
        result.text = text
        return result

    async def _generate_with_vocab(
        self,
        model: str,
        prompt: str,
        vocab: ModelVocab,
        max_tokens: int,
        sampling: SamplingParams,
        seed: int | None,
        on_text: Callable[[str], None] | None,
        route: swarm_pb2.Route,
    ) -> GenerationResult:
        prompt_tokens = await vocab.tokenize(prompt)
        if not prompt_tokens:
            raise ValueError("the prompt tokenizes to no tokens")
        eog = vocab.eog_token_ids
        text = TextStream()

        async def stream(token: int, _logits, _route) -> bool:
            if token not in eog:
                piece = text.feed(vocab.piece(token))
                if piece and on_text is not None:
                    on_text(piece)
            return False

        result = await self.generate_tokens(
            model, prompt_tokens, max_tokens=max_tokens, stop_tokens=sorted(eog), sampling=sampling, seed=seed,
            on_token=stream, route=route,
        )  # fmt: skip
        tail = text.finish()
        if tail and on_text is not None:
            on_text(tail)
        result.text = text.text
        return result

    async def _sessions_ended(self, handout_ids: list[int]) -> None:
        """Tell the tracker the routes handed out for a generation carry its session no more
        (so it stops counting them at once, not at the hops' next heartbeats); best effort."""
        if not handout_ids:
            return
        request = swarm_pb2.TrackerRequest(session_ended=swarm_pb2.SessionEndedRequest(handout_ids=handout_ids))
        with trio.move_on_after(self.config.session_ended_timeout_s):
            try:
                await self._tracker(request)
            except (SwarmError, TransportError) as error:
                log.info("could not tell the tracker the session ended: %s", error)

    @_reporting_handouts
    async def generate_tokens(
        self,
        model: str,
        prompt_tokens: Sequence[int],
        *,
        max_tokens: int,
        stop_tokens: Sequence[int] = (),
        sampling: SamplingParams = SamplingParams(),
        seed: int | None = None,
        on_token: Callable[[int, np.ndarray | TopLogits, swarm_pb2.Route], Awaitable[bool]] | None = None,
        route: swarm_pb2.Route | None = None,
        queue_timeout_s: float | None = None,
    ) -> GenerationResult:
        """Generate up to ``max_tokens`` token ids after ``prompt_tokens`` (tokenized by the caller).

        Args:
          on_token: awaited with each chosen token, its logits row (f32 ``[n_vocab]``, valid
            during the call; a ``TopLogits`` where the session asked for the top-K only) and
            the route it came from; returning True stops the generation there (e.g. a stop
            string was completed).
          queue_timeout_s: while the route's ranges have no free sequence (RESOURCE_EXHAUSTED
            at the first step), wait and try again for this long (default
            ``SwarmClientConfig.queue_timeout_s``): busy is not a failed hop.

        Returns:
          A ``GenerationResult`` with ``text`` empty (the caller detokenizes). A route whose
          context filled up (RESOURCE_EXHAUSTED after the first step) ends the generation
          there with ``context_full`` set.

        Raises:
          ValueError: an empty prompt or ``max_tokens`` < 1.
          SwarmError / GenerationError: as ``generate``.

        Resource handling / Cancellation: as ``generate``; however it ends, the tracker is
        told which route handouts it got (``session_ended``), shielded, for at most
        ``config.session_ended_timeout_s``.
        """
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if not prompt_tokens:
            raise ValueError("the prompt has no tokens")
        queue_timeout_s = self.config.queue_timeout_s if queue_timeout_s is None else queue_timeout_s
        rng = None if sampling.greedy else np.random.default_rng(seed)
        await self._fresh_admission()
        if route is None:
            route = await self.route(model)
        prompt = [int(t) for t in prompt_tokens]
        progress = _Progress()
        generated = progress.tokens
        replans = 0
        failed_peers: list[str] = []
        context_full = False
        stopped_by_caller = False
        busy_until = trio.current_time() + queue_timeout_s
        busy_wait_s = self.config.route_poll_interval_s

        resume_s: list[float] = []

        async def take(token: int, logits: np.ndarray | TopLogits) -> bool:
            assert route is not None  # planned above; replans only replace it
            return bool(on_token is not None and await on_token(token, logits, route))

        segments: list[RouteSegment] = []  # each session's route, for taking tokens back
        taken_back = 0
        while True:
            segments.append(RouteSegment(len(generated), frozenset(hop.peer_id for hop in route.hops)))
            session = Session(
                os.urandom(SESSION_ID_BYTES),
                prompt + generated,
                max_new_tokens=max_tokens - len(generated),
                stop_tokens=stop_tokens,
                sampling=sampling,
                rng=rng,
                route_peer_ids=[hop.peer_id for hop in route.hops],
                max_step_rows=self.config.prefill_chunk_tokens,
            )
            live = _LiveSession(session)
            self._live[session.session_id] = live
            lost: list[str] = []
            failure: GenerationError | None = None
            resume_failed = lost_reported = False
            try:
                async with self.spot_checks.watch(model, route) as spot:
                    while True:  # the session, and its resumes on routes with a lost hop replaced
                        try:
                            await self._run_session(live, route, progress, take, spot)
                            break
                        except GenerationError as error:
                            if not (error.failed_peer_id and error.code in (0, swarm_pb2.Error.UNAVAILABLE)):
                                raise
                            # gone or silent (not a live peer's refusal): nothing more waits on it
                            lost.append(error.failed_peer_id)
                            if replans >= self.config.replan_attempts:
                                raise
                            replans += 1
                            failed_peers.append(error.failed_peer_id)
                            log.warning("%s; replacing %s", error, error.failed_peer_id)
                            began = trio.current_time()
                            await self._fresh_admission()
                            resumed, reported = await self._resume(model, live, route, error, failed_peers, progress)
                            if resumed is None:
                                resume_failed, lost_reported = True, reported
                                raise
                            route = resumed
                            resume_s.append(trio.current_time() - began)
                            spot = None  # a spot check follows one route: it ends at a resume
                            segments.append(RouteSegment(len(generated), frozenset(hop.peer_id for hop in route.hops)))
            except GenerationError as error:
                failure = error
            finally:
                del self._live[session.session_id]
                with trio.CancelScope(shield=True):
                    with trio.move_on_after(self.config.request_timeout_s):
                        try:
                            progress.add_node_rows(await self.end_session(route, session.session_id, lost_peers=lost))
                        except (SwarmError, TransportError) as error:
                            log.info("could not end session %s: %s", session.session_hex, error)
            if failure is None:
                stopped_by_caller = session.stopped_by_caller
                redo = await self._take_back(segments, generated, failed_peers)
                if not redo:
                    break
                taken_back += redo  # computed through a peer that failed a check: generated again
                if replans >= self.config.replan_attempts:
                    raise GenerationError(
                        f"{redo} tokens were computed through {', '.join(failed_peers)}, which failed integrity "
                        "checks, and no replan is left", failed_peer_id=failed_peers[-1],
                    )  # fmt: skip
                replans += 1
                stopped_by_caller = False
                await self._fresh_admission()
                route = await self._replan(model, failed_peers[-1], "it failed an integrity check", failed_peers)
                continue
            exhausted = failure.code == swarm_pb2.Error.RESOURCE_EXHAUSTED
            if exhausted and failure.step == 0 and trio.current_time() < busy_until:
                # every sequence of some range is in use: wait for one, on any route
                log.info("%s; waiting %.2f s for a free sequence", failure, busy_wait_s)
                await trio.sleep(busy_wait_s)
                busy_wait_s = min(busy_wait_s * 2, 1.0)
                await self._fresh_admission()
                with contextlib.suppress(SwarmError, TransportError):
                    route = await self.route(model)
                continue
            if exhausted and failure.step:
                context_full = True  # the context of the route's sequences is full
                break
            if exhausted:  # still no free sequence when the queue time ran out: busy, not failed
                raise GenerationError(
                    f"no free sequence on route {describe_route(route)} within the queue timeout of "
                    f"{queue_timeout_s} s (the swarm is busy): {failure}",
                    failed_peer_id=failure.failed_peer_id,
                    step=0,
                    code=failure.code,
                ) from None
            if not resume_failed:
                if replans >= self.config.replan_attempts or not failure.failed_peer_id:
                    raise failure
                replans += 1
                failed_peers.append(failure.failed_peer_id)
            taken_back += await self._take_back(segments, generated, failed_peers)
            log.warning("%s; replanning without %s", failure, failure.failed_peer_id)
            await self._fresh_admission()
            # a failed resume may have told the tracker already
            route = await self._replan(
                model, failure.failed_peer_id, str(failure), failed_peers, report=not lost_reported
            )
        return GenerationResult(
            text="",
            tokens=list(generated),
            prompt_tokens=prompt,
            route=route_hops(route),
            model_sha256=route.model_sha256,
            prefill_s=progress.prefill_s,
            decode_s=progress.decode_s,
            decode_steps=progress.decode_steps,
            stopped_by_token=bool(generated) and generated[-1] in set(stop_tokens) and not stopped_by_caller,
            replans=replans,
            hop_rows=progress.hop_rows_list(),
            context_full=context_full,
            stopped_by_caller=stopped_by_caller,
            first_token_s=progress.first_token_s,
            resumes=len(resume_s),
            resume_s=resume_s,
            node_rows=progress.hop_rows_list(nodes=True),
            tokens_taken_back=taken_back,
            data_plane_steps=progress.data_plane_steps,
            continued_steps=progress.continued_steps,
        )

    async def _take_back(self, segments: list[RouteSegment], generated: list[int], avoid: list[str]) -> int:
        """Ask the tracker whether a peer of the generation's routes failed an integrity check
        (``check_route_integrity``); if one did, drop the tokens from the first session that went
        through it (and that session's record), add the peers to ``avoid``, and return how many
        tokens were dropped (0: none to redo)."""
        if not self.config.check_route_integrity:
            return 0
        withdrawn = await withdrawn_peers(self, set().union(*(segment.peers for segment in segments)))
        if not withdrawn:
            return 0
        avoid.extend(peer for peer in sorted(withdrawn) if peer not in avoid)
        cut = rollback_point(segments, withdrawn)
        assert cut is not None
        dropped = len(generated) - cut
        log.warning(
            "%s failed integrity checks (%s): taking back the %d tokens computed through them",
            ", ".join(sorted(withdrawn)), "; ".join(withdrawn.values()), dropped,
        )  # fmt: skip
        del generated[cut:]
        del segments[[segment.first_token for segment in segments].index(cut) :]
        return dropped

    async def _replan(
        self,
        model: str,
        lost_peer: str,
        reason: str,
        avoid: Sequence[str],
        part: tuple[int, int, str] | None = None,
        *,
        report: bool = True,
    ) -> swarm_pb2.Route:
        """A route around ``avoid``, while the tracker is told about ``lost_peer`` alongside:
        the route around it comes at once (the tracker plans around avoided peers), the report
        (the tracker probes the peer, which can take its probe timeout for a frozen one) only
        matters to everyone else's routes, so it is not waited for beyond ``report_grace_s``
        (the tracker carries on with a report it has received).

        Raises:
          GenerationError: no such route within ``replan_wait_s``.
        """
        reported = trio.Event()
        found: swarm_pb2.Route | None = None
        failure: GenerationError | None = None

        async def tell_tracker() -> None:
            try:
                if report:
                    with trio.move_on_after(self.config.request_timeout_s):
                        await self.report_lost_peer(lost_peer, reason)
            finally:
                reported.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(tell_tracker)
            try:
                found = await self.wait_for_route(
                    model, timeout_s=self.config.replan_wait_s, avoid_peers=avoid, part=part
                )
            except GenerationError as error:
                failure = error  # raised below as itself, not inside the nursery's group
            with trio.move_on_after(self.config.report_grace_s):
                await reported.wait()
            nursery.cancel_scope.cancel()
        if failure is not None:
            raise failure
        assert found is not None
        return found

    async def _tokenize_prompt(self, route: swarm_pb2.Route, prompt: str) -> tuple[list[int], list[int]]:
        first = route.hops[0].peer_id
        try:
            prompt_tokens, stop_tokens = await self.tokenize(route, prompt)
        except (SwarmError, TransportError) as error:
            raise GenerationError(f"tokenize on first hop {first} failed: {error}", failed_peer_id=first) from None
        if not prompt_tokens:
            raise ValueError("the prompt tokenizes to no tokens")
        return prompt_tokens, stop_tokens

    async def _run_session(
        self,
        live: _LiveSession,
        route: swarm_pb2.Route,
        progress: _Progress,
        take: Callable[[int, np.ndarray | TopLogits], Awaitable[bool]],
        spot=None,
    ) -> None:
        """Drive ``live.session`` over ``route`` to its end, appending its tokens to ``progress``.

        ``take(token, logits)`` is awaited with each token; True stops the session there.

        Raises:
          GenerationError: a step failed (naming the failed peer when known); the session has
            failed then (it may be resumed).
        """
        session = live.session
        first = route.hops[0]
        # where results come back: asked once per run, not per step (libp2p lists its
        # listeners' addresses afresh on each ask: ~20 us, measured, on every step's path)
        owner_addrs = self.transport.listen_addrs
        try:
            async with contextlib.AsyncExitStack() as stack:
                plane: _DataPlane | None = None
                # binds tried: the prompt is in the caches, decode worker to worker. A second try,
                # a step later: a hop rebuilt by a resume takes a bind once it took one step.
                plane_tries = 0 if self.config.data_plane else _DATA_PLANE_TRIES
                while not session.finished:
                    if plane is None and plane_tries < _DATA_PLANE_TRIES and not session.in_prefill:
                        plane_tries += 1
                        plane = await self._open_data_plane(stack, live, route)
                    live.arm()
                    step_input = session.next_step()
                    request = None
                    if plane is None or spot is not None:  # (the data plane needs no StepRequest)
                        request = session.step_request(
                            step_input, route, owner_peer_id=self.peer_id, owner_addrs=owner_addrs,
                            admission=self.admission,
                        )  # fmt: skip
                    prefill = session.in_prefill
                    started = time.perf_counter()
                    sent_at = trio.current_time()
                    if plane is not None:
                        await self._touch_due(plane, route, session.session_id, sent_at)
                        progress.data_plane_steps += 1
                        await plane.send(
                            live,
                            data_step(
                                step_input.step, step_input.positions, step_input.token_ids, session.result_top_k
                            ),
                        )
                    else:
                        assert request is not None  # made above: there is no data plane
                        if not self._send_step_soon(live, first, request):
                            await self._send_step(first, request, prefill=prefill)
                    await self._await_result(live, route, step_input.step, sent_at, prefill=prefill, plane=plane)
                    elapsed = time.perf_counter() - started
                    if isinstance(live.outcome, BaseException):
                        raise live.outcome
                    if spot is not None and request is not None and (taken := live.taken_result()) is not None:
                        spot.feed(request, taken)
                    progress.add_rows(route, len(step_input.token_ids))
                    if live.outcome is None:  # a prefill chunk: more of the prompt follows
                        progress.prefill_s += elapsed
                        continue
                    token = int(live.outcome)
                    if not prefill:
                        self._note_decode_step(elapsed)
                    progress.add(token, elapsed, prefill=prefill)
                    if await take(token, session.last_logits) and not session.finished:
                        session.stop()
        except GenerationError as error:
            session.fail(str(error))
            progress.interrupted()
            raise

    async def _open_data_plane(
        self, stack: contextlib.AsyncExitStack, live: _LiveSession, route: swarm_pb2.Route
    ) -> _DataPlane | None:
        """Move ``live.session``'s steps onto the workers' data plane of ``route``: bound on every
        hop, last first; the two connections open until ``stack`` closes. None, with the session
        still on the node path, when a hop cannot (no direct address, no data plane, a refusal):
        hops bound by then are unbound again."""
        hosts = data_plane_hosts(route)
        if hosts is None:
            log.debug("session %s: a hop of the route has no direct address: node path", live.session.session_hex)
            return None
        if self._request_soon is None:  # (no channel: the lease touches could not go without a task)
            return None
        session_id = live.session.session_id
        keys = RouteKeys.new(len(route.hops), os.urandom)
        ports: list[int] = [0] * len(route.hops)
        bound: list[swarm_pb2.Hop] = []
        try:
            for index in reversed(range(len(route.hops))):
                request = bind_request(route, index, session_id, keys, hosts, ports[index + 1] if bound else 0)
                bound.append(route.hops[index])  # (before the answer: a bind that timed out may have been made)
                reply = await self._node(route.hops[index], swarm_pb2.NodeRequest(data_plane_bind=request))
                ports[index] = reply.data_port
            owner = OwnerSession(SessionKeys(session_id, keys.step_keys[0], keys.return_key))
            with trio.fail_after(self.config.request_timeout_s):
                to_first = await stack.enter_async_context(open_data_link(hosts[0], ports[0]))
                from_last = await stack.enter_async_context(open_data_link(hosts[-1], ports[-1]))
                await from_last.send(owner.attach_frame(live.session.step))
        except (SwarmError, TransportError, OSError, trio.BrokenResourceError, trio.TooSlowError) as why:
            log.info("session %s stays on the node path: %s", live.session.session_hex, why)
            for hop in bound:
                with contextlib.suppress(SwarmError, TransportError):
                    await self._node(
                        hop,
                        swarm_pb2.NodeRequest(
                            data_plane_unbind=swarm_pb2.DataPlaneUnbindRequest(
                                session_id=session_id, model_sha256=route.model_sha256, begin=hop.begin, end=hop.end
                            )
                        ),
                    )
            return None
        plane = _DataPlane(owner, route, to_first, from_last)
        log.debug("session %s on the data plane of %s", live.session.session_hex, describe_route(route))
        if self.config.greedy_continuation:
            await self._continue_on_data_plane(live.session, route, keys, hosts, ports[0])
        return plane

    async def _continue_on_data_plane(
        self, session: Session, route: swarm_pb2.Route, keys: RouteKeys, hosts: list[str], first_port: int
    ) -> None:
        """Ask the last hop to send each next decode step of the greedy ``session`` straight to the
        first hop (``DataPlaneContinueRequest``). The owner's own steps still go (the first hop drops
        the copy that comes second), so a refusal only leaves the owner's round trip in each step."""
        steps = continuation_steps(
            session.max_new_tokens, len(session.generated), greedy=session.sampling.greedy, top_k=session.result_top_k
        )
        if steps == 0:
            return
        request = continue_request(
            route, session.session_id, keys, hosts, first_port,
            steps=steps, stop_token_ids=session.stop_tokens, max_position=0,
        )  # fmt: skip
        try:
            await self._node(route.hops[-1], swarm_pb2.NodeRequest(data_plane_continue=request))
        except (SwarmError, TransportError) as why:
            log.info("session %s: no greedy continuation: %s", session.session_hex, why)

    async def _touch_due(self, plane: _DataPlane, route: swarm_pb2.Route, session_id: bytes, now: float) -> None:
        """Renew the session's lease on every hop every ``probe_interval_s`` while its steps go
        worker to worker (the nodes see none of them): sent without waiting for the answers
        over the open channel connections (a hop that is gone shows as the step's failure), and
        awaited, as a probe, for a hop whose connection cannot take it at once."""
        if now - plane.touched_at < self.config.probe_interval_s:
            return
        plane.touched_at = now
        request = swarm_pb2.NodeRequest(schema_version=SCHEMA_VERSION, sender_admission=self.admission)
        request.touch.session_id = session_id
        data = request.SerializeToString()
        assert self._request_soon is not None  # (_open_data_plane checked)
        missed = [
            hop for hop in route.hops
            if not self._request_soon(
                hop.peer_id, NODE_PROTOCOL, data, timeout_s=self.config.request_timeout_s, on_reply=_ignore_reply
            )
        ]  # fmt: skip
        if missed:
            await self._silent_hop(swarm_pb2.Route(hops=missed), session_id)

    async def _resume(
        self,
        model: str,
        live: _LiveSession,
        route: swarm_pb2.Route,
        error: GenerationError,
        avoid: Sequence[str],
        progress: _Progress,
    ) -> tuple[swarm_pb2.Route | None, bool]:
        """Replace the lost hop of ``route`` and go on with ``live.session``: a route part for
        its blocks (same recipe, around ``avoid``), the other hops kept at the positions
        answered so far, the replacement rebuilt from what the hop before it sent (or from the
        owner's tokens). Returns the new route, with the session ready to send its failed step
        again, or None when the session cannot resume (nothing to keep, no replacement, a hop
        refuses, rows not kept): the caller re-prefills a new route then; and whether the lost
        peer was reported to the tracker.
        """
        session = live.session
        lost_peer = error.failed_peer_id
        plan = resume_plan(route, lost_peer, session.cached_positions) if self.config.resume else None
        if plan is None or not session.failed:
            log.info(
                "session %s cannot resume around %s (%d positions answered, %s): re-prefilling",
                session.session_hex, lost_peer, session.cached_positions, session.state,
            )  # fmt: skip
            return None, False
        try:
            part = await self._replan(
                model, lost_peer, str(error), avoid, part=(plan.begin, plan.end, route.recipe_hash)
            )
            new_route = plan.route_with(route, part.hops)
        except (GenerationError, ValueError) as why:
            log.info("no replacement for %s: %s", lost_peer, why)
            return None, True
        resume_step = session.step + 1
        keep = plan.keep_positions
        rebuild = _Rebuild(
            step=resume_step, positions=keep, peers=frozenset(h.peer_id for h in part.hops),
            last_peer=part.hops[-1].peer_id,
        )  # fmt: skip
        live.rebuild = rebuild
        problem = ""
        try:
            with trio.fail_after(self.config.step_timeout_s):
                async with trio.open_nursery() as nursery:
                    for hop in plan.survivors:
                        nursery.start_soon(
                            self._resume_hop, hop, route.model_sha256, session.session_id, keep, resume_step
                        )
                if plan.feeder is None:
                    await self._rebuild_first_hops(part.hops, route, session, keep, resume_step)
                else:
                    replay = swarm_pb2.ReplayRequest(
                        session_id=session.session_id, model_sha256=route.model_sha256, begin=plan.feeder.begin,
                        end=plan.feeder.end, positions=keep, resume_step=resume_step, to=list(part.hops),
                        max_rows=self.config.prefill_chunk_tokens, owner_addrs=self.transport.listen_addrs,
                    )  # fmt: skip
                    await self._node(plan.feeder, swarm_pb2.NodeRequest(replay=replay))
                async with trio.open_nursery() as nursery:  # the survivors' leases, while it rebuilds
                    nursery.start_soon(self._touch_while, rebuild.done, plan.survivors, session.session_id)
                    await rebuild.done.wait()
            problem = rebuild.error
        except trio.TooSlowError:
            problem = f"the rebuild of {keep} positions did not finish within {self.config.step_timeout_s} s"
        except (SwarmError, TransportError, GenerationError) as why:
            problem = str(why)
        except BaseExceptionGroup as group:  # the survivors' resumes run together
            matched, rest = group.split((SwarmError, TransportError))
            if rest is not None:
                raise
            assert matched is not None
            problem = "; ".join(str(e) for e in matched.exceptions)
        finally:
            live.rebuild = None
        if problem:
            log.warning("could not resume session %s around %s: %s", session.session_hex, lost_peer, problem)
            with trio.CancelScope(shield=True), trio.move_on_after(self.config.request_timeout_s):
                with contextlib.suppress(SwarmError, TransportError):
                    await self.end_session(part, session.session_id)  # what the rebuild opened
            return None, True
        session.resume([hop.peer_id for hop in new_route.hops])
        progress.add_rows(part, keep)  # the rebuild's rows count for the hops that computed them
        log.info(
            "session %s resumed at %d positions: %s replaced by %s", session.session_hex, keep, lost_peer,
            describe_route(part),
        )  # fmt: skip
        return new_route, True

    async def _touch_while(self, done: trio.Event, hops: Sequence[swarm_pb2.Hop], session_id: bytes) -> None:
        """Renew ``session_id``'s lease on ``hops`` every ``probe_interval_s`` until ``done``."""
        while not done.is_set():
            with trio.move_on_after(self.config.probe_interval_s):
                await done.wait()
                return
            await self._silent_hop(swarm_pb2.Route(hops=list(hops)), session_id)

    async def _resume_hop(self, hop: swarm_pb2.Hop, model_sha256: str, session_id: bytes, keep: int, step: int) -> None:
        body = swarm_pb2.ResumeSessionRequest(
            session_id=session_id, model_sha256=model_sha256, keep_positions=keep, next_step=step, begin=hop.begin,
            end=hop.end,
        )  # fmt: skip
        await self._node(hop, swarm_pb2.NodeRequest(resume_session=body))

    async def _rebuild_first_hops(
        self, hops: Sequence[swarm_pb2.Hop], route: swarm_pb2.Route, session: Session, keep: int, resume_step: int
    ) -> None:
        """The first hop was lost: its replacement is rebuilt from the owner's own tokens."""
        first = hops[0]
        for at, n_rows in session.rebuild_chunks(keep):
            request = first_step_request(
                session_id=session.session_id, step=resume_step, hops=hops, token_ids=session.tokens[at : at + n_rows],
                first_position=at, recipe_hash=route.recipe_hash, model_sha256=route.model_sha256,
                owner_peer_id=self.peer_id, owner_addrs=self.transport.listen_addrs, sender_admission=self.admission,
                resume_step=resume_step,
            )  # fmt: skip
            raw = await self.transport.request(
                first.peer_id, list(first.addrs), STEP_PROTOCOL, request.SerializeToString(),
                timeout_s=self.config.request_timeout_s,
            )  # fmt: skip
            ack = swarm_pb2.StepAck()
            try:
                ack.ParseFromString(raw)
            except DecodeError:
                raise SwarmError(first.peer_id, swarm_pb2.Error.INTERNAL, "malformed StepAck") from None
            if ack.error.code != swarm_pb2.Error.CODE_UNSPECIFIED:
                raise SwarmError(first.peer_id, ack.error.code, f"rebuild step refused: {ack.error.message}")

    def _note_decode_step(self, elapsed_s: float) -> None:
        average = self._decode_step_s
        self._decode_step_s = elapsed_s if average is None else 0.8 * average + 0.2 * elapsed_s

    def _step_deadline_s(self, *, prefill: bool, data_plane: bool = False) -> float:
        """How long a step may take before the owner looks for a silent hop: a multiple of the
        measured decode step time (``step_deadline_factor``, at least ``min_step_deadline_s``, or
        ``min_data_plane_step_deadline_s`` for a step that goes worker to worker);
        a prefill (chunk), or a decode before anything was measured, ``probe_interval_s`` (its
        time is unknown, so it is watched by probes rather than bounded)."""
        if prefill or self._decode_step_s is None:
            return min(self.config.probe_interval_s, self.config.step_timeout_s)
        floor = self.config.min_data_plane_step_deadline_s if data_plane else self.config.min_step_deadline_s
        deadline = max(floor, self.config.step_deadline_factor * self._decode_step_s)
        return min(deadline, self.config.step_timeout_s)

    async def _await_result(
        self,
        live: _LiveSession,
        route: swarm_pb2.Route,
        step: int,
        sent_at: float,
        *,
        prefill: bool,
        plane: _DataPlane | None = None,
    ) -> None:
        """Wait for the step's result; past its deadline, probe the hops (again every
        ``probe_interval_s``) and name the first silent one.

        Raises:
          GenerationError: a hop does not answer its probe (named, so the owner can replan
            around it), or no result within ``step_timeout_s`` although every hop answers.
        """
        give_up_at = sent_at + self.config.step_timeout_s
        look_at = sent_at + self._step_deadline_s(prefill=prefill, data_plane=plane is not None)
        while True:
            with trio.move_on_at(min(look_at, give_up_at)):
                if plane is None:
                    await live.arrived.wait()
                else:
                    await plane.receive(live)  # (the result comes on the owner's own connection)
                return
            if plane is not None:
                await plane.look_for_notice(live)  # the first worker may have refused the step
                if live.arrived.is_set():
                    return
            if trio.current_time() >= give_up_at:
                break
            silent = await self._silent_hop(route, live.session.session_id)
            if live.arrived.is_set():
                # the result came while the hops were probed: the session has taken its token, so
                # it must reach the caller (a hop that is gone shows again at the next step)
                return
            if silent is not None:
                message = (
                    f"no result for step {step} of session {live.session.session_hex} within "
                    f"{trio.current_time() - sent_at:.2f} s, and {silent} does not answer a probe"
                )
                live.session.fail(message)
                raise GenerationError(message, failed_peer_id=silent, step=step)
            look_at = max(look_at, trio.current_time()) + self.config.probe_interval_s
        message = (
            f"no result for step {step} of session {live.session.session_hex} within "
            f"{self.config.step_timeout_s} s (route {describe_route(route)}; every hop answers probes)"
        )
        live.session.fail(message)
        raise GenerationError(message, step=step)

    async def _silent_hop(self, route: swarm_pb2.Route, session_id: bytes = b"") -> str | None:
        """The first hop of ``route`` that does not answer any of ``probe_attempts`` probes
        (None when all do). A probe is a NodeRequest that a live node answers at once: a
        ``touch`` of ``session_id``, which renews the session's lease on the hop while the owner
        waits (a slow prefill, a rebuild), or without a body (INVALID_ARGUMENT) when none."""
        silent: dict[int, str] = {}

        async def probe(index: int, hop: swarm_pb2.Hop) -> None:
            request = swarm_pb2.NodeRequest(schema_version=SCHEMA_VERSION, sender_admission=self.admission)
            if session_id:
                request.touch.session_id = session_id
            data = request.SerializeToString()
            for attempt in range(self.config.probe_attempts):
                try:
                    await self.transport.request(
                        hop.peer_id, list(hop.addrs), NODE_PROTOCOL, data,
                        timeout_s=self.config.probe_timeout_s * (attempt + 1),
                    )  # fmt: skip
                    return
                except TransportError:
                    pass
            silent[index] = hop.peer_id

        async with trio.open_nursery() as nursery:
            for index, hop in enumerate(route.hops):
                nursery.start_soon(probe, index, hop)
        return silent[min(silent)] if silent else None

    def _send_step_soon(self, live: _LiveSession, first: swarm_pb2.Hop, request: swarm_pb2.StepRequest) -> bool:
        """Send a step to the first hop without a task, over a channel connection already
        open to it (``ChannelTransport.request_soon``, quiet: the hop answers only a refusal,
        and confirms its acceptances in bulk); a refusal (or no confirmation: the connection
        failed, or ``request_timeout_s`` passed) becomes the step's outcome, which ``_await_result`` then returns with. A first hop that goes
        silent is named by ``_await_result``'s probes, which try the hops in route order.
        False, with nothing sent: use ``_send_step``."""
        if self._request_soon is None:
            return False
        step = request.step
        arrived = live.arrived  # this attempt's: a step sent again after a failure gets another

        def acked(reply: bytes | TransportError) -> None:
            if live.arrived is not arrived or arrived.is_set():
                return  # the step's result came first (the hop took it), or this attempt is over
            error = _step_ack_error(first.peer_id, step, reply)
            if error is not None:
                live.outcome = error
                live.arrived.set()

        return self._request_soon(
            first.peer_id, STEP_PROTOCOL, request.SerializeToString(),
            timeout_s=self.config.request_timeout_s, on_reply=acked, quiet=True,
        )  # fmt: skip

    async def _send_step(self, first: swarm_pb2.Hop, request: swarm_pb2.StepRequest, *, prefill: bool) -> None:
        """Send a step to the first hop and check its ack. A first hop that has not acked by the
        step's deadline is probed (again every ``probe_interval_s``): a frozen one is named
        then, not after ``request_timeout_s``."""
        step = request.step
        raw = b""
        silent: list[str] = []
        unreachable: list[TransportError] = []

        async def send(cancel_scope: trio.CancelScope) -> None:
            nonlocal raw
            try:
                raw = await self.transport.request(
                    first.peer_id, list(first.addrs), STEP_PROTOCOL, request.SerializeToString(),
                    timeout_s=self.config.request_timeout_s,
                )  # fmt: skip
            except TransportError as error:
                unreachable.append(error)
            cancel_scope.cancel()

        async def watch(cancel_scope: trio.CancelScope) -> None:
            await trio.sleep(self._step_deadline_s(prefill=prefill))
            while True:
                found = await self._silent_hop(swarm_pb2.Route(hops=[first]), request.session_id)
                if found is not None:
                    silent.append(found)
                    cancel_scope.cancel()
                    return
                await trio.sleep(self.config.probe_interval_s)

        sent_at = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, nursery.cancel_scope)
            nursery.start_soon(watch, nursery.cancel_scope)
        if silent:
            raise GenerationError(
                f"step {step}: first hop {first.peer_id} did not acknowledge it within "
                f"{trio.current_time() - sent_at:.2f} s and does not answer a probe",
                failed_peer_id=first.peer_id, step=step,
            )  # fmt: skip
        error = _step_ack_error(first.peer_id, step, unreachable[0] if unreachable else raw)
        if error is not None:
            raise error


def _ignore_reply(_reply: bytes | TransportError) -> None:
    """A touch's answer: nothing to do (a hop that is gone fails the step instead)."""


def _step_ack_error(first_peer_id: str, step: int, reply: bytes | TransportError) -> GenerationError | None:
    """What the first hop's answer to ``step`` (its ``StepAck``, or the TransportError that
    ended the exchange) means for the session: None when the hop took the step."""
    if isinstance(reply, TransportError):
        return GenerationError(f"step {step}: first hop unreachable: {reply}", failed_peer_id=first_peer_id, step=step)
    ack = swarm_pb2.StepAck()
    try:
        ack.ParseFromString(reply)
    except DecodeError:
        return GenerationError(
            f"step {step}: malformed StepAck from {first_peer_id}", failed_peer_id=first_peer_id, step=step
        )
    if ack.error.code != swarm_pb2.Error.CODE_UNSPECIFIED:
        return GenerationError(
            f"step {step}: first hop {first_peer_id} refused the step: {_code_name(ack.error.code)}: {ack.error.message}",
            failed_peer_id=first_peer_id,
            step=step,
            code=ack.error.code,
        )
    return None


@contextlib.asynccontextmanager
async def open_swarm_client(
    tracker_addr: str,
    *,
    key: Ed25519PrivateKey | None = None,
    transport: Transport | None = None,
    config: SwarmClientConfig | None = None,
    listen_addrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
    now_ms: Callable[[], int] = _now_ms,
    channel: bool = True,
) -> AsyncIterator[SwarmClient]:
    """A client admitted by the tracker at ``tracker_addr`` (a multiaddr ending in /p2p/<id>).

    Args:
      key: the client's Ed25519 key; an ephemeral one when None (it must be the key of
        ``transport`` when one is given).
      transport: an open transport to use (tests: ``MemoryTransport``); by default libp2p
        listening on ``listen_addrs`` with the direct channel in front
        (``agent.io.peer_transport``; last hops push results to it).
      config: timeouts and limits.
      now_ms: the unix clock in ms (hello timestamps, admission expiry).
      channel: (own transport only) results come back over the direct channel
        (``agent.io.channel``) when the last hop can dial it; False: libp2p only.

    Raises:
      ValueError: a bad ``tracker_addr``, or ``transport`` given without its ``key``.
      SwarmError: the tracker refused the hello.
      TransportError: the tracker could not be reached.

    Resource handling:
      A transport opened here is closed on exit; a given one is left open (its RESULT
      handler stays installed but finds no sessions).
    """
    tracker_peer_id, tracker_addrs = split_peer_addr(tracker_addr)
    config = config or SwarmClientConfig()
    if transport is not None:
        if key is None:
            raise ValueError("a transport given to open_swarm_client needs its key")
        client = SwarmClient(transport, key, tracker_peer_id, tracker_addrs, config, now_ms)
        await client.hello()
        yield client
        return
    from agent.io.peer_transport import open_peer_transport

    key = key or Ed25519PrivateKey.generate()
    refused: SwarmError | TransportError | None = None
    async with open_peer_transport(key, listen_addrs, channel=channel) as p2p:
        client = SwarmClient(p2p, key, tracker_peer_id, tracker_addrs, config, now_ms)
        try:
            await client.hello()
        except (SwarmError, TransportError) as error:
            refused = error  # raised below, as itself: not wrapped by the transport's task group
        else:
            yield client
    if refused is not None:
        raise refused
