"""Pushing a range's outputs on (``Pushes``): each step's output to its next hop as a
``StepRequest`` (a group of them as one ``StepBatch``), or from the last range to the owner as a
``StepResult``; any failure after the ack goes to the owner as a ``StepResult`` error naming the
failed peer (``agent.core.node.policy``'s failure policy).

Hot path: a push group goes out from the serving task itself when the transport can
(``request_soon``), else from a task. Must not import the node's other mixins or ``agent``: it
builds on ``agent.io.node.state`` only (a hop this node runs too is answered through
``NodeState.handle_step`` / ``handle_node``).
"""

from __future__ import annotations

import functools
import logging

import trio

from agent._proto import swarm_pb2
from agent.core.node.policy import StepFailure, push_answered_badly, push_refused, push_unreachable
from agent.core.wire.boundary import BoundaryError
from agent.core.wire.step_batch import all_steps_taken, push_message, read_push_acks
from agent.core.wire.step_requests import encode_step_output, next_hop_request
from agent.core.wire.step_results import step_result, step_result_error, step_result_rebuilt, step_result_top
from agent.core.wire.step_validation import StepInput
from agent.core.wire.swarm_wire import RESULT_PROTOCOL, STEP_PROTOCOL, STEPS_PROTOCOL, WireError, parse_record
from agent.core.wire.worker_records import SeqOutput
from agent.io.net.transport import TransportError

from .state import NodeState, clock_ms

__all__ = ["Pushes"]

log = logging.getLogger(__name__)

Code = swarm_pb2.Error.Code


class Pushes(NodeState):
    """Sends outputs, results and errors on (a part of ``agent.io.node.agent.Node``)."""

    @staticmethod
    async def _guarded(fn, *args) -> None:
        """Run a push task; a bug in one must not take the node down (it is logged)."""
        try:
            await fn(*args)
        except Exception:
            log.exception("push task %s failed", getattr(fn, "__name__", fn))

    def _push_now(
        self, items: list[tuple[StepInput, SeqOutput, tuple[bytes, int] | None]], pushes: trio.Nursery
    ) -> bool:
        """Send one push group (``push_groups``) from the serving task itself: the next hop's
        steps, or a last range's top-K result to its owner. Over an open channel connection
        the message goes out at once, quiet (``ChannelTransport.request_soon``): the receiver
        answers only a refusal, and confirms what it took in bulk, so no ack wakes this
        process per step; only a refusal or a failure calls back, and starts a task to
        report it. Otherwise the message, already built, is sent from a task. False, with
        nothing done: the group takes the task path whole (a rebuild, a boundary that does
        not encode, a full logits row, a hop run by this node)."""
        step, output, _encoded = items[0]
        timeout_s = self.config.step_push_timeout_s
        if step.rest:
            hop = step.rest[0]
            if hop.peer_id == self.peer_id or (
                len(items) > 1 and not self._batch_peers.batches_to(hop.peer_id, clock_ms())
            ):
                return False
            try:
                steps = [(s, self._next_hop_bytes(s, o, e)) for s, o, e in items]
            except BoundaryError:
                return False
            protocol, data = push_message([serialized for _s, serialized in steps])
            taken = functools.partial(self._pushed, hop, steps, pushes)
            if not self._request_soon(hop.peer_id, protocol, data, timeout_s=timeout_s, on_reply=taken, quiet=True):
                pushes.start_soon(self._guarded, self._push_steps, hop, steps)
            return True
        if step.rebuild or not output.top:
            return False
        result = step_result_top(step.session_id, step.step, output.top[-1], self.admission).SerializeToString()
        taken = functools.partial(self._result_taken, step)
        if not self._request_soon(
            step.owner_peer_id, RESULT_PROTOCOL, result, timeout_s=timeout_s, on_reply=taken, quiet=True
        ):
            pushes.start_soon(self._guarded, self._send_result, step, result)
        return True

    def _pushed(
        self,
        hop: swarm_pb2.Hop,
        steps: list[tuple[StepInput, bytes]],
        pushes: trio.Nursery,
        reply: bytes | TransportError,
    ) -> None:
        """The next hop's answer to steps sent by ``_push_now``: nothing to do when it took
        them all; a task reports anything else, as ``_push_steps`` does."""
        if isinstance(reply, TransportError):
            pushes.start_soon(self._guarded, self._push_failed, hop, steps, reply)
        elif not all_steps_taken(reply, len(steps)):
            pushes.start_soon(self._guarded, self._push_answered, hop, steps, reply)

    @staticmethod
    def _result_taken(step: StepInput, reply: bytes | TransportError) -> None:
        """The owner's answer to a result sent by ``_push_now``; logged as ``_send_result`` does."""
        if isinstance(reply, TransportError):
            log.warning("result of step %d could not reach owner %s: %s", step.step, step.owner_peer_id, reply)
            return
        _log_result_ack(step, reply)

    async def _push(self, step: StepInput, output: SeqOutput, encoded: tuple[bytes, int] | None = None) -> None:
        """Send one step's output on: to the next hop, or (last range) to the owner; what
        ``_push_now`` does not send (a top-K result always goes through it)."""
        if step.rebuild and not step.rest:  # the last rebuilt range: no logits, just "done"
            result = step_result_rebuilt(step.session_id, step.resume_step, step.end_position, self.admission)
            await self._send_result(step, result)
            return
        if not step.rest:
            if output.logits is None or output.logits.shape[0] < 1:
                await self._send_error(step, Code.INTERNAL, "the last range returned no logits", self.peer_id)
                return
            result = step_result(step.session_id, step.step, output.logits[-1], self.admission, step.result_top_k)
            await self._send_result(step, result)
            return
        data = await self._next_hop_data(step, output, encoded)
        if data is not None:
            await self._push_steps(step.rest[0], [(step, data)])

    async def _push_batch(self, items: list[tuple[StepInput, SeqOutput, tuple[bytes, int] | None]]) -> None:
        """Send several steps' outputs on to their one next hop (``push_groups``) together."""
        steps, failed = [], []
        for step, output, encoded in items:
            try:
                steps.append((step, self._next_hop_bytes(step, output, encoded)))
            except BoundaryError as err:
                failed.append((step, err))
        async with trio.open_nursery() as each:
            for step, boundary_error in failed:
                each.start_soon(self._guarded, self._boundary_failed, step, boundary_error)
            if steps:
                each.start_soon(self._guarded, self._push_steps, items[0][0].rest[0], steps)

    async def _next_hop_data(
        self, step: StepInput, output: SeqOutput, encoded: tuple[bytes, int] | None
    ) -> bytes | None:
        """The serialized ``StepRequest`` for ``step``'s next hop; None once a failure was
        reported to the owner instead."""
        try:
            return self._next_hop_bytes(step, output, encoded)
        except BoundaryError as err:
            await self._boundary_failed(step, err)
            return None

    async def _boundary_failed(self, step: StepInput, err: BoundaryError) -> None:
        await self._send_error(step, Code.INTERNAL, f"boundary for the next hop: {err}", self.peer_id)

    def _next_hop_bytes(self, step: StepInput, output: SeqOutput, encoded: tuple[bytes, int] | None) -> bytes:
        """Raises BoundaryError."""
        if output.boundary is None:
            raise BoundaryError("the worker returned no boundary rows")
        if encoded is None:
            encoded = encode_step_output(step, output.boundary, output.boundary_bytes)
        return next_hop_request(step, output.boundary, self.admission, encoded=encoded).SerializeToString()

    async def _push_steps(self, hop: swarm_pb2.Hop, steps: list[tuple[StepInput, bytes]]) -> bool:
        """Push serialized steps to ``hop``: one alone on ``/baton/step``, several in one
        ``StepBatch``; each step the hop did not take is reported to its owner. True when the
        hop took them all."""
        if len(steps) > 1 and not self._batch_peers.batches_to(hop.peer_id, clock_ms()):
            return await self._push_each(hop, steps)
        try:
            reply = await self._send_to_hop(
                hop, *push_message([data for _step, data in steps]), self.config.step_push_timeout_s
            )
        except TransportError as err:
            return await self._push_failed(hop, steps, err)
        return await self._push_answered(hop, steps, reply)

    async def _push_failed(self, hop: swarm_pb2.Hop, steps: list[tuple[StepInput, bytes]], err: TransportError) -> bool:
        """``steps`` did not reach ``hop``: tried again one by one when they were a batch,
        else reported to their owners. True when the hop took them all after all."""
        if len(steps) > 1:
            # Not knowing /baton/steps (a peer from before it) reads differently on each
            # transport, so any failed batch is sent again step by step: each step then
            # gets the verdict a single push gets. If they all got through, the peer does
            # not take batches: it gets single pushes for a while.
            taken = await self._push_each(hop, steps)
            self._batch_peers.batch_failed(hop.peer_id, took_every_step_singly=taken, now_ms=clock_ms())
            return taken
        failure = push_unreachable(hop.peer_id, str(err))
        await self._fail_all([step for step, _d in steps], [failure] * len(steps))
        return False

    async def _push_answered(self, hop: swarm_pb2.Hop, steps: list[tuple[StepInput, bytes]], reply: bytes) -> bool:
        """Report to their owners the steps that ``hop``'s ``reply`` refused (or all of them,
        when the reply does not read). True when it took them all."""
        try:
            acks = read_push_acks(reply, len(steps))
        except WireError as err:
            failure = push_answered_badly(hop.peer_id, str(err))
            await self._fail_all([step for step, _d in steps], [failure] * len(steps))
            return False
        refused = [(step, ack) for (step, _d), ack in zip(steps, acks, strict=True) if ack.error.code]
        await self._fail_all(
            [step for step, _a in refused],
            [push_refused(hop.peer_id, ack.error.code, ack.error.message) for _s, ack in refused],
        )
        return not refused

    async def _push_each(self, hop: swarm_pb2.Hop, steps: list[tuple[StepInput, bytes]]) -> bool:
        """Push ``steps`` one by one, concurrently; True when the hop took every one."""
        taken = []

        async def one(step: StepInput, data: bytes) -> None:
            taken.append(await self._push_steps(hop, [(step, data)]))

        async with trio.open_nursery() as each:
            for step, data in steps:
                each.start_soon(self._guarded, one, step, data)
        return len(taken) == len(steps) and all(taken)

    async def _fail_all(self, steps: list[StepInput], failures: list[StepFailure]) -> None:
        """Report each failure to its step's owner, concurrently."""
        if len(steps) == 1:
            await self._fail(steps[0], failures[0])
            return
        async with trio.open_nursery() as each:
            for step, failure in zip(steps, failures, strict=True):
                each.start_soon(self._guarded, self._fail, step, failure)

    async def _send_to_hop(self, hop: swarm_pb2.Hop, protocol: str, data: bytes, timeout_s: float) -> bytes:
        """``data`` on ``protocol`` to ``hop``: handled here when this node runs that hop too.

        Raises:
          TransportError: the hop could not be reached.
        """
        if hop.peer_id == self.peer_id:
            handlers = {STEP_PROTOCOL: self.handle_step, STEPS_PROTOCOL: self.handle_steps}
            return await handlers.get(protocol, self.handle_node)(self.peer_id, data)
        return await self.transport.request(hop.peer_id, list(hop.addrs), protocol, data, timeout_s=timeout_s)

    async def _fail(self, step: StepInput, failure: StepFailure) -> None:
        await self._send_error(step, failure.code, failure.message, failure.failed_peer_id)

    async def _send_error(self, step: StepInput, code: int, message: str, failed_peer_id: str) -> None:
        log.info("step %d of session %s failed at %s: %s", step.step, step.session_id.hex(), failed_peer_id, message)
        result = step_result_error(step.session_id, step.step, code, message, failed_peer_id, self.admission)
        await self._send_result(step, result)

    async def _send_result(self, step: StepInput, result: swarm_pb2.StepResult | bytes) -> None:
        data = result if isinstance(result, bytes) else result.SerializeToString()
        try:
            reply = await self.transport.request(
                step.owner_peer_id, list(step.owner_addrs), RESULT_PROTOCOL, data,
                timeout_s=self.config.step_push_timeout_s,
            )  # fmt: skip
        except TransportError as err:
            log.warning("result of step %d could not reach owner %s: %s", step.step, step.owner_peer_id, err)
            return
        _log_result_ack(step, reply)


def _log_result_ack(step: StepInput, reply: bytes) -> None:
    """Log an owner's ack that refuses a result, or does not read."""
    try:
        ack = parse_record(swarm_pb2.StepAck, reply)
    except WireError as err:
        log.warning("result of step %d: owner %s answered badly: %s", step.step, step.owner_peer_id, err)
        return
    if ack.error.code:
        log.warning("owner %s refused the result of step %d: %s", step.owner_peer_id, step.step, ack.error.message)
