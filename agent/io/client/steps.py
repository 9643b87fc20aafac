"""The owner's steps on the node path: the ``/baton/result/1.0.0`` handler (a result is taken
only from a peer with a valid NODE admission, for a live session: ``LiveSession.deliver``),
sending a step to the first hop (without a task over an open channel connection, or awaited
with its ack watched), waiting for its result, and probing the hops when it is late: the
first hop that answers no probe is named as the failed peer (none when every hop answers).

``StepClient`` extends ``ControlClient`` (``agent.io.client.control``) with the live sessions;
``SessionRunner`` (``agent.io.client.session_run``) builds on it.

Must not import ``session_run``, ``resume`` or ``swarm`` (they build on this one).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.protobuf.message import DecodeError

from agent._proto import swarm_pb2
from agent.core.owner.recovery import decode_step_average, step_ack_failure, step_deadline_s
from agent.core.wire.admission import AdmissionError, AdmissionVerifier
from agent.core.wire.swarm_wire import (
    NODE_PROTOCOL,
    RESULT_PROTOCOL,
    SCHEMA_VERSION,
    STEP_PROTOCOL,
    step_ack,
    step_ack_accepts,
)
from agent.io.client.config import SwarmClientConfig
from agent.io.client.control import ControlClient, now_ms
from agent.io.client.live import DataPlane, LiveSession, err
from agent.io.client.outcome import GenerationError, describe_route
from agent.io.client.spot_check import ResultTaker, SpotChecks
from agent.io.net.transport import ImmediateHandler, Transport, TransportError

log = logging.getLogger(__name__)


class StepClient(ControlClient):
    """A ``ControlClient`` that sends steps and takes their results (the base of ``SessionRunner``)."""

    def __init__(
        self,
        transport: Transport,
        key: Ed25519PrivateKey,
        tracker_peer_id: str,
        tracker_addrs: Sequence[str],
        config: SwarmClientConfig,
        now_ms: Callable[[], int] = now_ms,
    ) -> None:
        super().__init__(transport, key, tracker_peer_id, tracker_addrs, config, now_ms)
        self._sender_admissions = AdmissionVerifier(b"")  # replaced once the tracker key is known
        self._live: dict[bytes, ResultTaker] = {}  # a LiveSession, or a spot check's shadow
        self._decode_step_s: float | None = None  # moving average of decode step time
        self.spot_checks = SpotChecks(self, config.spot_check_rate, config.spot_check_grace_s)
        # the ack goes out after the generation has sent its next step
        transport.set_handler(
            RESULT_PROTOCOL, ImmediateHandler(self._on_result, reply_later=True, is_acceptance=step_ack_accepts)
        )
        #: steps sent without a task when the transport can (``_send_step_soon``)
        self._request_soon = getattr(transport, "request_soon", None)

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
            return step_ack(err("INTERNAL", f"{type(error).__name__}: {error}"))

    def _take_result(self, remote_peer_id: str, payload: bytes) -> swarm_pb2.Error | None:
        result = swarm_pb2.StepResult()
        try:
            result.ParseFromString(payload)
        except DecodeError:
            return err("INVALID_ARGUMENT", "malformed StepResult: the bytes do not parse")
        if result.schema_version != SCHEMA_VERSION:
            return err(
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
            return err("REFUSED", f"sender admission refused: {error.reason}")
        live = self._live.get(bytes(result.session_id))
        if live is None:
            return err("NOT_FOUND", f"unknown session {bytes(result.session_id).hex()}")
        return live.deliver(remote_peer_id, result)

    def _note_decode_step(self, elapsed_s: float) -> None:
        self._decode_step_s = decode_step_average(self._decode_step_s, elapsed_s)

    def _step_deadline_s(self, *, prefill: bool, data_plane: bool = False) -> float:
        """How long a step may take before the owner looks for a silent hop
        (``agent.core.owner.recovery.step_deadline_s``)."""
        return step_deadline_s(self.config, self._decode_step_s, prefill=prefill, data_plane=data_plane)

    async def _await_result(
        self,
        live: LiveSession,
        route: swarm_pb2.Route,
        step: int,
        sent_at: float,
        *,
        prefill: bool,
        plane: DataPlane | None = None,
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

    def _send_step_soon(self, live: LiveSession, first: swarm_pb2.Hop, request: swarm_pb2.StepRequest) -> bool:
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


def _step_ack_error(first_peer_id: str, step: int, reply: bytes | TransportError) -> GenerationError | None:
    """What the first hop's answer to ``step`` (its ``StepAck``, or the TransportError that
    ended the exchange) means for the session: None when the hop took the step; whom it
    blames is ``agent.core.owner.recovery.step_ack_failure``'s."""
    if isinstance(reply, TransportError):
        failed = step_ack_failure(first_peer_id, step, b"", unreachable=str(reply))
    else:
        failed = step_ack_failure(first_peer_id, step, reply)
    if failed is None:
        return None
    return GenerationError(failed.message, failed_peer_id=failed.failed_peer_id, step=failed.step, code=failed.code)
