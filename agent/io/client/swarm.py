"""The session owner's generation loop: ``SwarmClient`` (``generate``, ``generate_tokens``) and
``open_swarm_client``.

A client (``baton generate``; the relay's swarm side) is built in layers, each a module with one
job and a subclass of the one before: ``control`` (tracker and first-hop control exchanges),
``steps`` (the result handler, sending steps, waiting for results, probing hops),
``session_run`` (one session over one route, on the data plane when it can), ``resume``
(replacing a lost hop), and this module: a generation's sessions, and what to do when one
fails. Every decision about a step (which rows it sends, whether a result answers it, which
token comes next, when to stop) is made by ``agent.core.owner.session.Session``; what to do after a
failed session by ``agent.core.owner.recovery``.

When a hop fails (an error result, a refused or unreachable first hop, no result in time),
the generation either fails with a ``GenerationError`` naming the failed peer (a late step,
or an ack that does not come, makes the owner probe the hops: the first that does not answer is
named; none when every hop answers), or, while ``SwarmClientConfig.replan_attempts`` allow
and a peer was named:
- a peer that is gone or silent is *replaced*: the tracker plans a route part for its blocks
  only (same recipe, around every failed peer), the surviving hops keep their caches up to the
  positions answered so far (``resume_session``), and the replacement is rebuilt from the
  rows the hop before it kept (``replay``; the owner's own tokens when the first hop was
  lost); the step that failed is then sent again (``agent.io.client.resume``);
- otherwise, or when that fails (rows over a hop's budget, no replacement), the owner waits
  for a route without that peer and continues with a new session whose prefill is the prompt
  plus the tokens chosen so far. (Both compute the same greedy tokens in practice, but a
  batched rebuild or prefill is not promised to be bit-identical to step-by-step decode.)
A busy route (no free sequence at the first step) is waited for up to ``queue_timeout_s``; a
context that fills up ends the generation with ``context_full``; tokens computed through a
peer that failed an integrity check are taken back and generated again.

Must not hold a nursery on ``self``: the transport is opened by ``open_swarm_client``.
Must not be imported by the client's other modules (it builds on them all).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent._proto import swarm_pb2
from agent.core.owner.constrained import TokenMask
from agent.core.owner.recovery import (
    ContextFull,
    Fail,
    Failure,
    RecoveryBudget,
    Replan,
    Resume,
    WaitFor,
    on_failure,
    replan_left,
    resumable,
)
from agent.core.owner.sampling import SamplingParams, drawn_seed
from agent.core.owner.session import Session
from agent.core.owner.spot_check import RouteSegment, rollback_point
from agent.core.owner.text_stream import TextStream, whole_utf8
from agent.core.wire.swarm_wire import SESSION_ID_BYTES
from agent.core.wire.topk import TopLogits
from agent.io.client.config import SwarmClientConfig
from agent.io.client.control import now_ms, reporting_handouts, split_peer_addr
from agent.io.client.live import LiveSession
from agent.io.client.outcome import GenerationError, GenerationResult, Progress, SwarmError, describe_route, route_hops
from agent.io.client.resume import ResumingClient
from agent.io.client.spot_check import withdrawn_peers
from agent.io.net.transport import Transport, TransportError

if TYPE_CHECKING:
    from agent.io.worker.vocab import ModelVocab

log = logging.getLogger(__name__)


class SequenceQueue(Protocol):
    """A line a generation waits in for a free sequence (the relay's, ``agent.io.relay.queue``):
    it replaces the generation's own waits and its queue timeout."""

    async def wait_turn(self) -> bool:
        """Wait until the generation may try to start a session; False: refuse it as busy."""
        ...

    async def busy(self) -> bool:
        """A try found no free sequence: wait for the next turn; False: refuse it as busy."""
        ...

    def started(self) -> None:
        """The generation's session holds its sequences (its first token came)."""
        ...


class SwarmClient(ResumingClient):
    """A client admitted by a tracker (made by ``open_swarm_client``)."""

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
            ``agent.io.worker.vocab``), it is tokenized here and the output detokenized here, piece by
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
        if vocab is not None:  # (tokenized here: the route request can name the prompt's prefix)
            return await self._generate_with_vocab(model, prompt, vocab, max_tokens, sampling, seed, on_text, route)
        if route is None:
            route = await self.route(model)
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
            text = whole_utf8(await self.detokenize(on_route, generated))
            if text.startswith(shown) and len(text) > len(shown):
                on_text(text[len(shown) :])
                shown = text
            return False

        result = await self.generate_tokens(
            model, prompt_tokens, max_tokens=max_tokens, stop_tokens=stop_tokens, sampling=sampling, seed=seed,
            on_token=stream, route=route,
        )  # fmt: skip
        final_tokens = result.tokens[:-1] if result.stopped_by_token else result.tokens
        text = (await self.detokenize(current_route, final_tokens)).decode("utf-8", "replace") if final_tokens else ""
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
        route: swarm_pb2.Route | None,
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

    @reporting_handouts
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
        prompt_scores: Callable[[int, np.ndarray | TopLogits], None] | None = None,
        constraint: TokenMask | None = None,
        queue: SequenceQueue | None = None,
        prefix_salt: bytes | None = None,
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
          prompt_scores: score the prompt: it goes one row a step, and this is called with
            each position and the scores of the token after it (a position may come again
            after a replan). One step a prompt token: for scoring short prompts, not for chat.
          constraint: a grammar every token keeps to (``agent.core.owner.grammar``): drawn by
            this owner from full rows, masked (``agent.core.owner.constrained``); it is advanced
            by each token and carried across resumes and replans.
          queue: a line to wait in for a free sequence, first come, first served with the
            other generations of its owner (the relay's); it decides when to try and when to
            give up as busy, in place of ``queue_timeout_s`` and the backoff.
          prefix_salt: the salt of the prompt's prefix block hashes: only generations under
            the same salt share the hops' prefix caches (the relay's per API key:
            ``agent.core.relay.prefix_salt``); None: this owner's own (``self.prefix_salt``).

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
        # the uniforms' seed (agent.core.owner.sampling.draw_uniform), the same for every session
        # of this generation: a token's draw depends on its position only, whoever draws it
        draw_seed = None if sampling.greedy else drawn_seed(np.random.default_rng(seed))
        if queue is not None and not await queue.wait_turn():  # (before the route: it may wait long)
            raise GenerationError(
                f"no free sequence for a generation of {model} while the line did not move (the swarm is busy)",
                step=0, code=swarm_pb2.Error.RESOURCE_EXHAUSTED,
            )  # fmt: skip
        await self._fresh_admission()
        prompt = [int(t) for t in prompt_tokens]
        if route is None:
            route = await self.route(model, prompt=prompt, prefix_salt=prefix_salt)
        progress = Progress()
        generated = progress.tokens
        replans = 0
        failed_peers: list[str] = []
        context_full = False
        stopped_by_caller = False
        busy_until = trio.current_time() + queue_timeout_s if queue is None else math.inf
        busy_wait_s = self.config.route_poll_interval_s

        resume_s: list[float] = []
        holds_sequences = False

        async def take(token: int, logits: np.ndarray | TopLogits) -> bool:
            nonlocal holds_sequences
            assert route is not None  # planned above; replans only replace it
            if queue is not None and not holds_sequences:
                holds_sequences = True
                queue.started()
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
                draw_seed=draw_seed,
                route_peer_ids=[hop.peer_id for hop in route.hops],
                max_step_rows=1 if prompt_scores is not None else self.config.prefill_chunk_tokens,
                output_start=len(prompt),
                on_prompt_scores=prompt_scores,
                constraint=constraint,
            )
            live = LiveSession(session, self.prefix_salt if prefix_salt is None else prefix_salt)
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
                            budget = RecoveryBudget(
                                replans, self.config.replan_attempts, busy_until, busy_wait_s, session_alive=True
                            )
                            plan = on_failure(_failure(error), trio.current_time(), budget)
                            if resumable(error.failed_peer_id, error.code):
                                lost.append(error.failed_peer_id)  # gone or silent: nothing more waits on it
                            if not isinstance(plan, Resume):
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
                if redo and constraint is not None:
                    constraint.rollback(redo)  # the grammar goes back with the tokens taken back
                if not redo:
                    break
                taken_back += redo  # computed through a peer that failed a check: generated again
                if not replan_left(replans, self.config.replan_attempts):
                    raise GenerationError(
                        f"{redo} tokens were computed through {', '.join(failed_peers)}, which failed integrity "
                        "checks, and no replan is left", failed_peer_id=failed_peers[-1],
                    )  # fmt: skip
                replans += 1
                stopped_by_caller = False
                await self._fresh_admission()
                route = await self._replan(model, failed_peers[-1], "it failed an integrity check", failed_peers)
                continue
            budget = RecoveryBudget(
                replans, self.config.replan_attempts, busy_until, busy_wait_s, resume_failed=resume_failed
            )
            plan = on_failure(_failure(failure), trio.current_time(), budget)
            if isinstance(plan, WaitFor):
                # every sequence of some range is in use: wait for one, on any route
                if queue is None:
                    log.info("%s; waiting %.2f s for a free sequence", failure, plan.delay_s)
                    await trio.sleep(plan.delay_s)
                    busy_wait_s = plan.next_delay_s
                else:
                    holds_sequences = False
                    if not await queue.busy():
                        raise GenerationError(
                            f"no free sequence on route {describe_route(route)} while the line did not move "
                            f"(the swarm is busy): {failure}",
                            failed_peer_id=failure.failed_peer_id, step=0, code=failure.code,
                        ) from None  # fmt: skip
                await self._fresh_admission()
                with contextlib.suppress(SwarmError, TransportError):
                    route = await self.route(model, prompt=prompt, prefix_salt=prefix_salt)
                continue
            if isinstance(plan, ContextFull):
                context_full = True  # the context of the route's sequences is full
                break
            if isinstance(plan, Fail) and plan.busy:  # no free sequence within the queue time: not failed
                raise GenerationError(
                    f"no free sequence on route {describe_route(route)} within the queue timeout of "
                    f"{queue_timeout_s} s (the swarm is busy): {failure}",
                    failed_peer_id=failure.failed_peer_id,
                    step=0,
                    code=failure.code,
                ) from None
            if not isinstance(plan, Replan):  # (a Resume is only planned for a live session)
                raise failure
            if plan.count:  # (a resume that failed counted its replan already)
                replans += 1
                failed_peers.append(failure.failed_peer_id)
            redone = await self._take_back(segments, generated, failed_peers)
            if redone and constraint is not None:
                constraint.rollback(redone)
            taken_back += redone
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
            decode_wall_s=progress.decode_wall_s,
            cached_tokens=progress.cached_tokens,
            drafted_tokens=progress.drafted_tokens,
            accepted_tokens=progress.accepted_tokens,
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

    async def _tokenize_prompt(self, route: swarm_pb2.Route, prompt: str) -> tuple[list[int], list[int]]:
        first = route.hops[0].peer_id
        try:
            prompt_tokens, stop_tokens = await self.tokenize(route, prompt)
        except (SwarmError, TransportError) as error:
            raise GenerationError(f"tokenize on first hop {first} failed: {error}", failed_peer_id=first) from None
        if not prompt_tokens:
            raise ValueError("the prompt tokenizes to no tokens")
        return prompt_tokens, stop_tokens


def _failure(error: GenerationError) -> Failure:
    return Failure(error.code, error.step, error.failed_peer_id)


@contextlib.asynccontextmanager
async def open_swarm_client(
    tracker_addr: str,
    *,
    key: Ed25519PrivateKey | None = None,
    transport: Transport | None = None,
    config: SwarmClientConfig | None = None,
    listen_addrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
    now_ms: Callable[[], int] = now_ms,
    channel: bool = True,
) -> AsyncIterator[SwarmClient]:
    """A client admitted by the tracker at ``tracker_addr`` (a multiaddr ending in /p2p/<id>).

    Args:
      key: the client's Ed25519 key; an ephemeral one when None (it must be the key of
        ``transport`` when one is given).
      transport: an open transport to use (tests: ``MemoryTransport``); by default libp2p
        listening on ``listen_addrs`` with the direct channel in front
        (``agent.io.net.peer_transport``; last hops push results to it).
      config: timeouts and limits.
      now_ms: the unix clock in ms (hello timestamps, admission expiry).
      channel: (own transport only) results come back over the direct channel
        (``agent.io.net.channel``) when the last hop can dial it; False: libp2p only.

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
    from agent.io.net.peer_transport import open_peer_transport

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
