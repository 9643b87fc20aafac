"""Where the outcome of a live session's step arrives: ``LiveSession`` (a result the last hop
pushed, or a rebuild's progress, handed to ``agent.core.owner.session.Session``, which decides whether
to take it) and ``DataPlane`` (the session's two worker connections on the data plane, read by
the owner's task itself while it waits).

Each turns what arrives into the step's outcome (a token, a ``GenerationError`` naming the hop
at fault) and the acknowledgement a sender gets; neither sends a step nor waits for one.

Must not import the client's request-making modules (``control``, ``steps``, ``session_run``,
``resume``, ``swarm``): they import this one.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable

import trio

from agent._proto import swarm_pb2, worker_pb2
from agent.core.owner.data_route import drawn_token, result_rows, step_result, success_step_result
from agent.core.owner.data_route import result_scores as data_result_scores  # (swarm_wire's takes a StepResult)
from agent.core.owner.session import HopFailed, ResultRefused, Session
from agent.core.wire.data_frames import DataFrameError, OwnerSession
from agent.core.wire.swarm_wire import error as wire_error
from agent.io.client.outcome import GenerationError, code_name
from agent.io.net.data_link import DataLink, DataLinkClosed

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Rebuild:
    """A rebuild in progress: the rebuilt part of the route (``peers``, answering from
    ``last_peer``) must report ``positions`` rebuilt for step ``step``."""

    step: int
    positions: int
    peers: frozenset[str]
    last_peer: str
    done: trio.Event = dataclasses.field(default_factory=trio.Event)
    error: str = ""


class LiveSession:
    """A live session: where the result handler delivers the outcome of its step in flight,
    or of its rebuild."""

    def __init__(self, session: Session, prefix_salt: bytes = b"") -> None:
        self.session = session
        self.prefix_salt = prefix_salt  # of its prompt's prefix block hashes (``prefix_seed``)
        self.arrived = trio.Event()
        # the token taken (a verification step's: the tokens), the error, or None (a prefill chunk)
        self.outcome: int | list[int] | BaseException | None = None
        self.rebuild: Rebuild | None = None
        # the last result the session took: a StepResult (node path) or a DataResult (data plane)
        self.result: swarm_pb2.StepResult | None = None
        self.data_result: worker_pb2.DataResult | None = None
        self.prefix_cached_tokens = 0  # of its prompt, copied from the hops' prefix caches

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
            return err("INVALID_ARGUMENT", f"no rebuild of step {result.step} is in progress")
        return self._settle(result.step, remote_peer_id, lambda: self.session.receive(result, remote_peer_id), result)

    def deliver_data(self, remote_peer_id: str, result: worker_pb2.DataResult) -> swarm_pb2.Error | None:
        """As ``deliver``, for a successful RESULT of the data plane (opened under the session's
        return key): its scores go to the session without a ``StepResult`` in between."""
        if result.rows:  # every row's top-K: a verification step (speculative decoding)
            return self._settle(
                result.step,
                remote_peer_id,
                lambda: self.session.receive_rows(
                    result.step, lambda: result_rows(result), int(result.n_vocab), remote_peer_id
                ),
                result,
            )
        return self._settle(
            result.step,
            remote_peer_id,
            lambda: self.session.receive_scores(
                result.step, lambda: data_result_scores(result), int(result.n_vocab), remote_peer_id,
                drawn_token(result),
            ),
            result,
        )  # fmt: skip

    @property
    def continued(self) -> bool:
        """The last hop sent the step after the last result taken itself (``DataResult.continued``)."""
        return self.data_result is not None and self.data_result.continued

    def taken_result(self) -> swarm_pb2.StepResult | None:
        """The last result the session took, as a ``StepResult`` (a spot check replays them)."""
        if self.data_result is not None:
            return success_step_result(self.session.session_id, self.data_result)
        return self.result

    def _settle(
        self,
        step: int,
        remote_peer_id: str,
        receive: Callable[[], int | list[int] | None],
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
    def _deliver_rebuild(rebuild: Rebuild, remote_peer_id: str, result: swarm_pb2.StepResult) -> swarm_pb2.Error | None:
        if rebuild.done.is_set():
            return err("INVALID_ARGUMENT", f"the rebuild for step {rebuild.step} is over")
        if result.error.code != swarm_pb2.Error.CODE_UNSPECIFIED:
            if remote_peer_id not in rebuild.peers:
                return err("REFUSED", f"{remote_peer_id} is not on the rebuilt part of the route")
            who = result.failed_peer_id or remote_peer_id
            rebuild.error = f"rebuild failed at {who}: {code_name(result.error.code)}: {result.error.message}"
            rebuild.done.set()
            return None
        if remote_peer_id != rebuild.last_peer:
            return err("REFUSED", f"rebuild results come from {rebuild.last_peer}, not {remote_peer_id}")
        if result.rebuilt_positions > rebuild.positions:
            rebuild.error = (
                f"{remote_peer_id} rebuilt {result.rebuilt_positions} positions, {rebuild.positions} were sent"
            )
            rebuild.done.set()
        elif result.rebuilt_positions == rebuild.positions:
            rebuild.done.set()
        return None


class DataPlane:
    """A session's route on the workers' data plane, owner side: STEPs go on ``to_first``,
    RESULTs come back on ``from_last`` (read by the owner's task itself while it waits: no
    task of its own), and a NOTICE (a worker refused a frame) on either."""

    #: how long a look for a NOTICE on the first hop's connection waits (past a step's deadline)
    NOTICE_LOOK_S = 0.01

    def __init__(self, owner: OwnerSession, route: swarm_pb2.Route, to_first: DataLink, from_last: DataLink) -> None:
        self.owner, self.route, self.to_first, self.from_last = owner, route, to_first, from_last
        self.touched_at = -math.inf
        #: a speculating session's continuation, re-armed a run at a time (its steps set then)
        self.continuation: swarm_pb2.DataPlaneContinueRequest | None = None

    async def send(self, live: LiveSession, step: worker_pb2.DataStep) -> None:
        """Send the step to the first hop's worker; a connection that fails fails the step,
        naming that hop (gone: the owner resumes around it)."""
        try:
            await self.to_first.send(self.owner.step_frame(step))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as why:
            self._fail(live, self.route.hops[0], f"the data plane connection failed: {why}")

    async def receive(self, live: LiveSession) -> None:
        """Read the last hop's connection until the step in flight has its outcome: a RESULT
        the session takes (one it refuses, e.g. stale, is dropped), or a failure naming the
        last hop (the connection ended, a NOTICE). Safe to cancel between frames and within one."""
        await self._receive(live, self.from_last, self.route.hops[-1])

    async def look_for_notice(self, live: LiveSession) -> None:
        """Whether the first hop's worker refused the step (a NOTICE waiting on its connection)."""
        with trio.move_on_after(self.NOTICE_LOOK_S):
            await self._receive(live, self.to_first, self.route.hops[0])

    async def _receive(self, live: LiveSession, link: DataLink, hop: swarm_pb2.Hop) -> None:
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
    def _fail(live: LiveSession, hop: swarm_pb2.Hop, why: str) -> None:
        step = live.session.step
        if live.arrived.is_set() or not live.session.awaiting:
            log.info("data plane of session %s: %s: %s", live.session.session_hex, hop.peer_id, why)
            return
        live.outcome = GenerationError(
            f"step {step}: data plane, {hop.peer_id}: {why}", failed_peer_id=hop.peer_id, step=step,
            code=swarm_pb2.Error.UNAVAILABLE,
        )  # fmt: skip
        live.arrived.set()


def err(code_name: str, message: str) -> swarm_pb2.Error:
    return wire_error(swarm_pb2.Error.Code.Value(code_name), message)
