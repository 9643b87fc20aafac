"""Driving one session over one route to its end (``SessionRunner._run_session``): each step
sent, its result awaited, its token taken; once the prompt is in the route's caches, the decode
steps go worker to worker on the data plane when every hop offers it (bound here, last hop
first, with keys the owner makes: ``agent.core.owner.data_route``), the greedy continuation asked of
the last hop, and the session's lease renewed on the hops the node agents no longer hear from.

``SessionRunner`` extends ``StepClient`` (``agent.io.client.steps``); ``ResumingClient``
(``agent.io.client.resume``) builds on it.

Must not import ``resume`` or ``swarm`` (they build on this one).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import cast

import numpy as np
import trio

from agent._proto import swarm_pb2
from agent.core.owner.data_route import (
    RouteKeys,
    bind_request,
    continuation_steps,
    continue_request,
    data_plane_hosts,
    data_step,
)
from agent.core.owner.prefix_blocks import PrefixPlan, block_hashes, prefix_seed, usable_blocks
from agent.core.owner.sampling import draws_at_owner
from agent.core.owner.session import Session
from agent.core.owner.speculation import Drafting, rewinds
from agent.core.owner.wire_choice import choose_wire_dtype
from agent.core.wire.boundary import WireDType
from agent.core.wire.data_frames import OwnerSession, SessionKeys
from agent.core.wire.swarm_wire import NODE_PROTOCOL, SCHEMA_VERSION
from agent.core.wire.topk import TopLogits
from agent.io.client.live import DataPlane, LiveSession
from agent.io.client.outcome import GenerationError, Progress, SwarmError, describe_route
from agent.io.client.steps import StepClient
from agent.io.net.data_link import open_data_link
from agent.io.net.transport import TransportError

log = logging.getLogger(__name__)

#: how many times one run of a session tries to bind its route on the data plane
_DATA_PLANE_TRIES = 2


class SessionRunner(StepClient):
    """A ``StepClient`` that runs a session over a route (the base of ``ResumingClient``)."""

    async def _run_session(
        self,
        live: LiveSession,
        route: swarm_pb2.Route,
        progress: Progress,
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
        session.draw_locally()  # (each run starts on the node path: the owner draws until a last hop does)
        # speculative decoding (on the data plane; a spot check's shadow replays plain steps)
        drafting = None
        if self._speculates(session) and spot is None and await self._rewinds(route):
            drafting = Drafting(self.config.speculate_tokens)
        wire = self.wire_dtype(route)
        first = route.hops[0]
        # where results come back: asked once per run, not per step (libp2p lists its
        # listeners' addresses afresh on each ask: ~20 us, measured, on every step's path)
        owner_addrs = self.transport.listen_addrs
        try:
            async with contextlib.AsyncExitStack() as stack:
                plane: DataPlane | None = None
                # binds tried: the prompt is in the caches, decode worker to worker. A second try,
                # a step later: a hop rebuilt by a resume takes a bind once it took one step.
                plane_tries = 0 if self.config.data_plane else _DATA_PLANE_TRIES
                while not session.finished:
                    if (
                        plane is None
                        and plane_tries < _DATA_PLANE_TRIES
                        and (self.config.prefill_on_data_plane or not session.in_prefill)
                    ):
                        plane_tries += 1
                        # (a spot check's shadow replays the steps from position 0 on the node path)
                        plane = await self._open_data_plane(
                            stack, live, route, prefix_cache=spot is None, speculating=drafting is not None
                        )
                        if live.prefix_cached_tokens and not progress.tokens:
                            progress.cached_tokens = live.prefix_cached_tokens
                    continued_before = live.continued  # the last hop sends this step itself
                    live.arm()
                    prefill = session.in_prefill
                    # the prompt's chunks on the data plane go together (pipelined down the route,
                    # ``prefill_chunks_in_flight`` at most); any other step alone
                    window = self.config.prefill_chunks_in_flight if plane is not None and spot is None else 1
                    draft: tuple[int, ...] = ()
                    if drafting is not None and plane is not None and not prefill:
                        draft = drafting.draft(session, continued=continued_before)
                        if not draft and not continued_before and (run := drafting.plain_run(session)):
                            self._arm_continuation(plane, session, run)  # (the last hop steps meanwhile)
                    step_inputs = (
                        [session.next_verify_step(draft)] if draft else session.next_steps(window if prefill else 1)
                    )
                    step_input = step_inputs[0]
                    request = None
                    if plane is None or spot is not None:  # (the data plane needs no StepRequest)
                        request = session.step_request(
                            step_input, route, owner_peer_id=self.peer_id, owner_addrs=owner_addrs,
                            admission=self.admission,
                        )  # fmt: skip
                        if wire != WireDType.F32:
                            request.dtype = cast(swarm_pb2.DType, wire)
                    started = time.perf_counter()
                    sent_at = trio.current_time()
                    if plane is not None:
                        await self._touch_due(plane, route, session.session_id, sent_at)
                        for sent in step_inputs:
                            progress.data_plane_steps += 1
                            await plane.send(
                                live,
                                data_step(
                                    sent.step, sent.positions, sent.token_ids, session.result_top_k,
                                    every_row=sent.every_row, rewind=sent.rewind,
                                ),
                            )  # fmt: skip
                    else:
                        assert request is not None  # made above: there is no data plane
                        if not self._send_step_soon(live, first, request):
                            await self._send_step(first, request, prefill=prefill)
                    for index, step_input in enumerate(step_inputs):
                        if index:  # the next chunk's result: its wait counts from the one before
                            live.arm()
                            sent_at = trio.current_time()
                            assert plane is not None  # (several steps at once only on the data plane)
                            # the hops' leases, renewed while the chunks' results come in
                            await self._touch_due(plane, route, session.session_id, sent_at)
                        await self._await_result(live, route, step_input.step, sent_at, prefill=prefill, plane=plane)
                        elapsed = time.perf_counter() - started
                        started += elapsed
                        if isinstance(live.outcome, BaseException):
                            raise live.outcome
                        if spot is not None and request is not None and (taken := live.taken_result()) is not None:
                            spot.feed(request, taken)
                        progress.add_rows(route, len(step_input.token_ids))
                        if live.outcome is None:  # a prefill chunk: more of the prompt follows
                            progress.prefill_s += elapsed
                            continue
                        if not prefill:
                            self._note_decode_step(elapsed)
                        if drafting is not None and not prefill:
                            drafted, accepted = drafting.took(
                                session, step_input, elapsed, by_owner=not continued_before
                            )
                            progress.drafted_tokens += drafted
                            progress.accepted_tokens += accepted
                        for index, (token, logits) in enumerate(session.taken):
                            progress.add(token, elapsed if index == 0 else 0.0, prefill=prefill)
                            if await take(token, logits):
                                if not session.finished:
                                    session.stop()
                                break  # (a verification's later tokens are not the caller's)
        except GenerationError as error:
            session.fail(str(error))
            progress.interrupted()
            raise

    def wire_dtype(self, route: swarm_pb2.Route) -> WireDType:
        """The dtype of a session's boundary rows between the hops of ``route``
        (``SwarmClientConfig.wire``: one estimate of the link for every route, for now)."""
        del route  # (a route's own measured links would go here)
        config = self.config
        return choose_wire_dtype(
            config.wire, link_mbit=config.link_mbit, f16_below_mbit=config.wire_f16_below_mbit,
            q8_below_mbit=config.wire_q8_below_mbit,
        )  # fmt: skip

    async def _open_data_plane(
        self,
        stack: contextlib.AsyncExitStack,
        live: LiveSession,
        route: swarm_pb2.Route,
        *,
        prefix_cache: bool = True,
        speculating: bool = False,
    ) -> DataPlane | None:
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
        binds_since = trio.current_time()  # (each bind renews its hop's lease: no touch is due before)
        try:
            # a session that has sent nothing yet opens on each hop with its bind: its prompt then
            # goes worker to worker too (DataPlaneBindRequest.open_rows)
            session = live.session
            open_rows = len(session.tokens) if session.step == 0 and session.cached_positions == 0 else 0
            prefix = await self._prefix_plan(live, route) if open_rows and prefix_cache else None
            for index in reversed(range(len(route.hops))):
                request = bind_request(
                    route, index, session_id, keys, hosts, ports[index + 1] if bound else 0, self.wire_dtype(route)
                )
                request.open_rows = open_rows
                if prefix is not None:
                    request.prefix_block_hashes.extend(prefix.hashes)
                    request.prefix_block_tokens, request.prefix_blocks = prefix.block_tokens, prefix.blocks
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
            if prefix is not None and prefix.blocks:  # hops opened holding the prefix: step 0 opens them afresh
                for hop in bound:
                    with contextlib.suppress(SwarmError, TransportError):
                        end = swarm_pb2.EndSessionRequest(session_id=session_id)
                        await self._node(hop, swarm_pb2.NodeRequest(end_session=end))
            return None
        if prefix is not None and prefix.blocks:
            live.session.take_cached_prefix(prefix.positions)
            live.prefix_cached_tokens = prefix.positions
        plane = DataPlane(owner, route, to_first, from_last)
        # the binds just renewed every hop's lease: the first touch is due a probe interval after
        # them, not at the first step (a short generation then sends none: 3 requests fewer a chat)
        plane.touched_at = binds_since
        log.debug("session %s on the data plane of %s", live.session.session_hex, describe_route(route))
        live.session.draw_locally()  # (a new binding: its last hop draws only once asked)
        if self.config.greedy_continuation and speculating:
            # a speculating session's last hop continues it a run at a time (``Drafting``): its
            # verification steps go between the runs
            session = live.session
            plane.continuation = continue_request(
                route, session_id, keys, hosts, ports[0], steps=0, stop_token_ids=session.stop_tokens,
                max_position=0, sampling=session.sampling,
            )  # fmt: skip
        elif self.config.greedy_continuation:
            await self._continue_on_data_plane(live.session, route, keys, hosts, ports[0])
        return plane

    def _arm_continuation(self, plane: DataPlane, session: Session, run: int) -> None:
        """Ask the last hop to continue ``session`` for ``run`` steps from the next (sent without
        waiting: a late or refused answer only leaves those steps the owner's)."""
        if plane.continuation is None or self._request_soon is None:
            return
        generated = len(session.generated)
        steps = min(run, continuation_steps(session.max_new_tokens, generated, greedy=True, top_k=session.result_top_k))
        if steps < 1:
            return
        body = swarm_pb2.DataPlaneContinueRequest()
        body.CopyFrom(plane.continuation)
        body.steps = steps
        request = swarm_pb2.NodeRequest(
            schema_version=SCHEMA_VERSION, sender_admission=self.admission, data_plane_continue=body
        )
        last = plane.route.hops[-1]
        self._request_soon(
            last.peer_id, NODE_PROTOCOL, request.SerializeToString(), timeout_s=self.config.request_timeout_s,
            on_reply=_ignore_reply,
        )  # fmt: skip

    async def _rewinds(self, route: swarm_pb2.Route) -> bool:
        """Whether the route's workers can cut a verification's rejected rows away
        (``agent.core.owner.speculation.rewinds``: not DeepSeek V4's)."""
        try:
            return rewinds(await self.architecture(route.model_sha256))
        except (SwarmError, TransportError) as why:
            log.info("no speculation: the model's architecture is not known: %s", why)
            return False

    def _speculates(self, session: Session) -> bool:
        """Whether ``session`` drafts tokens on the data plane (``config.speculate_tokens``)."""
        return self.config.speculate_tokens > 0 and session.may_speculate

    async def _prefix_plan(self, live: LiveSession, route: swarm_pb2.Route) -> PrefixPlan | None:
        """The prompt's block hashes (under the session's salt) and the leading blocks every hop
        of ``route`` holds in its prefix cache (asked of all at once; a hop that cannot say holds
        none), cut to what ``usable_blocks`` allows. None: no whole block, or the cache is off here."""
        block_tokens = self.config.prefix_block_tokens
        session = live.session
        if not block_tokens or session.max_step_rows is None:
            return None  # (a prompt in one step: a copy would leave the rest to another batch's bits)
        seed = prefix_seed(route.model_sha256, route.recipe_hash, block_tokens, session.max_step_rows, live.prefix_salt)
        hashes = tuple(block_hashes(session.tokens[: session.prompt_len], block_tokens, seed))
        if not hashes:
            return None
        held = [len(hashes)] * len(route.hops)
        if any((hop.peer_id, hop.begin, hop.end) in self._no_prefix_cache for hop in route.hops):
            return PrefixPlan(hashes, block_tokens, 0)  # (no round trip where a hop has none)

        async def ask(index: int) -> None:
            hop = route.hops[index]
            lookup = swarm_pb2.PrefixLookupRequest(
                model_sha256=route.model_sha256, begin=hop.begin, end=hop.end, block_hashes=hashes,
                block_tokens=block_tokens,
            )  # fmt: skip
            try:
                reply = await self._node(hop, swarm_pb2.NodeRequest(prefix_lookup=lookup))
                held[index] = reply.prefix_blocks
            except (SwarmError, TransportError) as why:
                log.debug("session %s: no prefix lookup at %s: %s", session.session_hex, hop.peer_id, why)
                held[index] = 0
                if isinstance(why, SwarmError) and why.code == swarm_pb2.Error.REFUSED:
                    self._no_prefix_cache.add((hop.peer_id, hop.begin, hop.end))

        async with trio.open_nursery() as nursery:
            for index in range(len(route.hops)):
                nursery.start_soon(ask, index)
        blocks = usable_blocks(min(held), session.prompt_len, block_tokens, session.max_step_rows)
        return PrefixPlan(hashes, block_tokens, blocks)

    async def _continue_on_data_plane(
        self, session: Session, route: swarm_pb2.Route, keys: RouteKeys, hosts: list[str], first_port: int
    ) -> None:
        """Ask the last hop to send each next decode step of ``session`` straight to the first hop
        (``DataPlaneContinueRequest``): a greedy session's with its first top-K entry; a sampled
        one's (``config.last_hop_draws``) with the token the last hop draws for it, the same the
        owner would (its parameters and seed travel with the request; the session then takes the
        drawn tokens and asks for greedy's top-K instead of the full row). The owner's own steps
        still go (the first hop drops the copy that comes second), so a refusal only leaves the
        owner's round trip in each step, and the owner's own draws."""
        sampled = not session.sampling.greedy
        if sampled and (not self.config.last_hop_draws or draws_at_owner(session.sampling)):
            return  # (penalties, logit_bias and min_p need the owner's draw)
        if session.constraint is not None:  # (draw_plan) a grammar keeps every draw at the owner
            return
        # bound before its prompt is in (the prompt on the data plane): its prefill gives a token first
        generated = len(session.generated) + (1 if session.in_prefill else 0)
        steps = continuation_steps(
            session.max_new_tokens, generated, greedy=session.sampling.greedy,
            top_k=session.result_top_k, drawn=sampled,
        )  # fmt: skip
        if steps == 0:
            return
        request = continue_request(
            route, session.session_id, keys, hosts, first_port,
            steps=steps, stop_token_ids=session.stop_tokens, max_position=0,
            sampling=session.sampling, draw_seed=session.draw_seed or 0,
        )  # fmt: skip
        try:
            await self._node(route.hops[-1], swarm_pb2.NodeRequest(data_plane_continue=request))
        except (SwarmError, TransportError) as why:
            log.info("session %s: no continuation: %s", session.session_hex, why)
            return
        if sampled:
            session.draw_at_last_hop()

    async def _touch_due(self, plane: DataPlane, route: swarm_pb2.Route, session_id: bytes, now: float) -> None:
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


def _ignore_reply(_reply: bytes | TransportError) -> None:
    """A touch's answer: nothing to do (a hop that is gone fails the step instead)."""
