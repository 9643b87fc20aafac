"""Replacing a lost hop (``ResumingClient``): a route around the failed peers, the tracker told
about the lost one alongside (``_replan``); or, for the lost hop's blocks only, a route part of
the same recipe, the surviving hops kept at the positions answered so far (``resume_session``)
and the replacement rebuilt from the rows the hop before it kept (``replay``; from the owner's
own tokens when the first hop was lost), after which the session sends its failed step again
(``_resume``; the plan is ``agent.core.owner.route_repair.resume_plan``).

``ResumingClient`` extends ``SessionRunner`` (``agent.io.client.session_run``);
``SwarmClient`` (``agent.io.client.swarm``) builds on it and decides when to resume or replan.

Must not import ``swarm`` (it builds on this one).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

import trio
from google.protobuf.message import DecodeError

from agent._proto import swarm_pb2
from agent.core.owner.route_repair import resume_plan
from agent.core.owner.session import Session
from agent.core.wire.step_requests import first_step_request
from agent.core.wire.swarm_wire import STEP_PROTOCOL
from agent.io.client.live import LiveSession, Rebuild
from agent.io.client.outcome import GenerationError, Progress, SwarmError, describe_route
from agent.io.client.session_run import SessionRunner
from agent.io.net.transport import TransportError

log = logging.getLogger(__name__)


class ResumingClient(SessionRunner):
    """A ``SessionRunner`` that replaces lost hops (the base of ``SwarmClient``)."""

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

    async def _resume(
        self,
        model: str,
        live: LiveSession,
        route: swarm_pb2.Route,
        error: GenerationError,
        avoid: Sequence[str],
        progress: Progress,
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
        resume_step = session.resume_step
        keep = plan.keep_positions
        rebuild = Rebuild(
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
                resume_step=resume_step, wire_dtype=self.wire_dtype(route),
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
