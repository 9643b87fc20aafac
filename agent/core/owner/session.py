"""A client session: one generation owned by the client, as a state machine the shell drives.

Owns the decisions of a session owner (``baton generate``, later the relay):
- which rows each step sends: step 0 the whole prompt (positions ``0..n-1``), then one row per
  step, the last chosen token at the next position;
- whether a ``StepResult`` answers the step in flight (schema, session id, step number: stale,
  duplicate and out-of-order results are refused and change nothing), whether its sender may
  send it (a peer of the session's route; logits only from the last hop, an error from any
  hop), and whether its logits are well formed (width, checksum, finite values);
- the next token (``agent.core.owner.sampling``) and when to stop (an end-of-generation token, which
  is kept like ``GreedyGeneration`` keeps it, or ``max_new_tokens``);
- the ``StepRequest`` / ``EndSessionRequest`` records the shell sends for it.

Loop (the shell): ``while not s.finished: send(s.step_request(s.next_step(), ...)); result =
<StepResult pushed to the owner>; token = s.receive(result)``.

States: ``ready`` (may send the next step) -> ``awaiting`` (one step in flight) -> ``ready`` ...
-> ``finished``; ``failed`` after a hop reported an error, a malformed answer to the step in
flight, or ``fail()`` from the shell (e.g. a timeout). Both end states refuse everything, but
a failed session may be *resumed* (``resume``) on a route where a lost hop was replaced: its
cached positions are kept and the step that failed is sent again under the next step number
(``agent.core.owner.route_repair.resume_plan`` says which part of the route to replace and which hops keep their caches).

Pure: numpy and protobuf records (checksums and constants from ``agent.core.wire.swarm_wire``,
result scores from ``agent.core.wire.step_results``); the random generator comes in as an argument.
Must not import trio, grpc, libp2p, sockets, clocks or agent.io.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from agent._proto import swarm_pb2
from agent.core.owner.constrained import TokenMask, constrained_draw, draw_plan
from agent.core.owner.sampling import (
    SamplingParams,
    adjust_logits,
    adjusts_logits,
    checked_draw,
    choose_token,
    draw_uniform,
    drawn_seed,
    result_top_k_for,
)
from agent.core.wire.step_results import result_scores
from agent.core.wire.swarm_wire import SCHEMA_VERSION, SESSION_ID_BYTES, token_checksum
from agent.core.wire.topk import TopLogits, result_top_k

__all__ = [
    "SCHEMA_VERSION",
    "SESSION_ID_BYTES",
    "HopFailed",
    "OwnerStep",
    "ResultRefused",
    "Session",
    "SessionError",
]

_F32 = np.dtype("<f4")

READY = "ready"
AWAITING = "awaiting"
FINISHED = "finished"
FAILED = "failed"


class SessionError(Exception):
    """Base of the errors a session raises; ``code`` is a ``swarm_pb2.Error.Code``."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ResultRefused(SessionError):
    """A ``StepResult`` that does not answer the step in flight, or is malformed.

    ``fatal`` is False when the result simply is not ours to take (another session, a stale,
    duplicate or out-of-order step, a finished session): the session is unchanged. It is True
    when the result answers the step in flight but is malformed: the session has failed.
    """

    def __init__(self, code: int, message: str, *, fatal: bool) -> None:
        super().__init__(code, message)
        self.fatal = fatal


class HopFailed(SessionError):
    """A hop of the route reported that the step in flight failed (``StepResult.error``)."""

    def __init__(self, code: int, message: str, failed_peer_id: str) -> None:
        who = failed_peer_id or "an unnamed hop"
        super().__init__(code, f"hop {who} failed: {swarm_pb2.Error.Code.Name(code)}: {message}")
        self.failed_peer_id = failed_peer_id
        self.hop_message = message


@dataclasses.dataclass(frozen=True)
class OwnerStep:
    """The rows one step of the owner's session sends (a node's: ``step_validation.StepInput``)."""

    step: int
    positions: tuple[int, ...]
    token_ids: tuple[int, ...]
    #: a verification step (``Session.next_verify_step``): the last hop returns every row's top-K
    every_row: bool = False
    #: the route's caches hold positions past this step's first (rows a verification rejected):
    #: each hop cuts them away first (``DataStep.rewind``)
    rewind: bool = False


def _error(code_name: str) -> int:
    return swarm_pb2.Error.Code.Value(code_name)


class Session:
    """One generation of ``max_new_tokens`` at most from ``prompt`` (token ids).

    Args:
      session_id: 16 bytes chosen by the owner (random in the shell).
      prompt: the prompt's token ids (at least one).
      max_new_tokens: the token budget (>= 1).
      stop_tokens: end-of-generation token ids; choosing one ends the session.
      sampling: temperature / top-k / top-p (greedy by default).
      draw_seed: the seed of the token draws' uniforms (``draw_uniform(draw_seed, position)``,
        the last hop's too); or ``rng``, which gives one. Needed unless greedy.
      n_vocab: the expected logits width, if known; otherwise the first result fixes it.
      route_peer_ids: the peer ids of the route's hops, in order; when given, ``receive``
        takes a result only from one of them, and logits only from the last.
      top_k_at_least: ask the last hop for at least this many top logits (e.g. the owner's
        top_logprobs); the request's K is ``agent.core.wire.topk.result_top_k`` (0, the full row,
        when sampling has no top-k cut).
      output_start: where the generation's own tokens begin in ``prompt`` (a session resumed
        after a replan carries the tokens generated before it in its prompt): the penalties
        that count generated tokens start there. None: after the prompt.
      on_prompt_scores: called with each prefill chunk's last position and that row's scores
        (the distribution of the token after it), e.g. to score a prompt in one-row chunks;
        such a session asks for the full row (any prompt token's logprob is exact).
      max_step_rows: the most rows one step carries (a worker's batch): a longer prompt goes
        in chunks of this many rows, each a step of its own, so it pipelines down the route
        and is never refused for its length. None: the whole prompt in step 0.
    """

    def __init__(
        self,
        session_id: bytes,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        stop_tokens: Iterable[int] = (),
        sampling: SamplingParams = SamplingParams(),
        rng: np.random.Generator | None = None,
        draw_seed: int | None = None,
        n_vocab: int | None = None,
        route_peer_ids: Sequence[str] = (),
        top_k_at_least: int = 0,
        max_step_rows: int | None = None,
        output_start: int | None = None,
        on_prompt_scores: Callable[[int, np.ndarray | TopLogits], None] | None = None,
        constraint: TokenMask | None = None,
    ) -> None:
        if len(session_id) != SESSION_ID_BYTES:
            raise ValueError(f"a session id has {SESSION_ID_BYTES} bytes, got {len(session_id)}")
        if not prompt:
            raise ValueError("the prompt has no tokens")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not sampling.greedy and rng is None and draw_seed is None:
            raise ValueError(f"sampling at temperature {sampling.temperature} needs a random generator or a seed")
        if draw_seed is not None and not 0 <= draw_seed < 2**64:
            raise ValueError(f"draw_seed must be in [0, 2^64), got {draw_seed}")
        if n_vocab is not None and n_vocab < 1:
            raise ValueError(f"n_vocab must be >= 1, got {n_vocab}")
        if max_step_rows is not None and max_step_rows < 1:
            raise ValueError(f"max_step_rows must be >= 1, got {max_step_rows}")
        self.session_id = bytes(session_id)
        self.prompt_len = len(prompt)
        self.max_new_tokens = max_new_tokens
        self.stop_tokens = frozenset(int(t) for t in stop_tokens)
        self.sampling = sampling
        self.n_vocab = n_vocab
        self.tokens: list[int] = [int(t) for t in prompt]
        self.step = 0  # the next step to send, or the one in flight
        self.state = READY
        self.stopped_by_token = False
        self.stopped_by_caller = False
        # the scores the last token came from: the full row, or the top-K (``result_top_k``)
        self.last_logits: np.ndarray | TopLogits = np.zeros(0, dtype=_F32)
        self.constraint = constraint
        self.draw = draw_plan(
            constrained=constraint is not None,
            sampling=sampling,
            result_top_k=result_top_k_for(sampling, at_least=top_k_at_least),
        )
        self.result_top_k = self.draw.result_top_k
        self.output_start = len(self.tokens) if output_start is None else output_start
        self._on_prompt_scores = on_prompt_scores
        if on_prompt_scores is not None:
            self.result_top_k = 0
        self.failure: str | None = None
        self.route_peer_ids = tuple(route_peer_ids)
        self.max_step_rows = max_step_rows
        # the end (in tokens) of each step in flight, oldest first: steps self.step, self.step + 1,
        # ...; several only while prompt chunks pipeline down the route (``next_steps``)
        self._in_flight_ends: list[int] = []
        self.draw_seed = draw_seed if draw_seed is not None or rng is None else drawn_seed(rng)
        self.last_hop_draws = False  # (draw_at_last_hop)
        self._last_hop_draws_after_prefill = False  # asked while the prompt was still going in
        self._top_k_at_least = top_k_at_least
        self._n_cached = 0  # tokens[:_n_cached] are in the route's caches
        # positions the route's caches hold, rejected draft rows included
        self._route_held = 0
        self._draft: tuple[int, ...] = ()  # the draft of the verification step in flight
        #: speculative decoding: tokens drafted, and of them accepted (``receive_rows``)
        self.drafted_tokens = 0
        self.accepted_tokens = 0
        self.last_verified = (0, 0)  # (drafted, accepted) of the last verification step
        #: each token the last result gave, with the scores it was chosen from
        self.taken: list[tuple[int, np.ndarray | TopLogits]] = []

    # --- state -----------------------------------------------------------------------------

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def finished(self) -> bool:
        """No more steps: the budget is spent, a stop token came, or the session failed."""
        return self.state in (FINISHED, FAILED)

    @property
    def failed(self) -> bool:
        return self.state == FAILED

    @property
    def awaiting(self) -> bool:
        return self.state == AWAITING

    @property
    def session_hex(self) -> str:
        return self.session_id.hex()

    def stop(self) -> None:
        """End the session before its budget (the owner's own reason, e.g. a stop string).

        Raises:
          ValueError: a step is in flight, or the session has already ended.
        """
        if self.state != READY:
            raise ValueError(f"session {self.session_hex}: cannot stop while {self.state}")
        self.state = FINISHED
        self.stopped_by_caller = True

    def fail(self, reason: str) -> None:
        """Record that the session cannot go on (the shell gave up on it)."""
        if self.state != FINISHED:
            self.state = FAILED
            self.failure = reason

    @property
    def cached_positions(self) -> int:
        """Positions every hop of the route holds for sure (the steps answered so far)."""
        return self._n_cached

    def take_cached_prefix(self, positions: int) -> None:
        """The hops copied the prompt's first ``positions`` from their prefix caches: steps start there."""
        if self.step or self._in_flight_ends or self._n_cached or not 0 <= positions < self.prompt_len:
            raise ValueError(f"session {self.session_hex}: no cached prefix of {positions} now")
        self._n_cached = positions

    def rebuild_chunks(self, keep_positions: int, merge_rows: int = 16) -> list[tuple[int, int]]:
        """``(first position, rows)`` of the steps that rebuild a lost first hop from this
        session's tokens, in the shapes its steps had (``agent.core.node.kept_rows``: so the rebuilt
        cache is bit-exact): the prompt in its chunks of ``max_step_rows``, then the decoded
        positions joined in runs of at most ``merge_rows``.
        """
        chunks: list[tuple[int, int]] = []
        step_rows = self.max_step_rows or self.prompt_len
        at = 0
        while at < min(keep_positions, self.prompt_len):
            n = min(step_rows, self.prompt_len - at, keep_positions - at)
            chunks.append((at, n))
            at += n
        while at < keep_positions:
            n = min(merge_rows, keep_positions - at)
            chunks.append((at, n))
            at += n
        return chunks

    @property
    def resume_step(self) -> int:
        """The number a resume gives the step sent again: one past the highest step sent (with
        prompt chunks pipelined, later chunks than the failed one may have been sent)."""
        return self.step + max(1, len(self._in_flight_ends))

    def resume(self, route_peer_ids: Sequence[str]) -> int:
        """Go on after a failed step, on a route where the lost part was rebuilt up to
        ``cached_positions``: the step that failed is sent again, numbered ``resume_step``, one
        past the highest sent (a late answer to one sent before is then refused as stale).
        Returns that step number.

        Raises:
          ValueError: the session did not fail (a step in flight, ready, or finished).
        """
        if self.state != FAILED:
            raise ValueError(f"session {self.session_hex}: only a failed session is resumed, not a {self.state} one")
        self.step = self.resume_step
        self._in_flight_ends = []
        self._draft = ()
        self._route_held = self._n_cached  # (a resume cuts every hop to cached_positions)
        self.state = READY
        self.failure = None
        self.route_peer_ids = tuple(route_peer_ids)
        return self.step

    def draw_at_last_hop(self) -> None:
        """The route's last hop draws this sampled session's tokens from now on (its parameters
        and ``draw_seed``): results bring the token, with greedy's top-K, never the full row.
        ``draw_locally`` goes back (a new route, or one whose last hop does not draw).

        Raises:
          ValueError: the session is greedy (its last hop takes the first of the top-K anyway).
        """
        if self.sampling.greedy or self.draw_seed is None or self.draw.at_owner:
            raise ValueError(
                f"session {self.session_hex}: only a sampled session without penalties, logit_bias, min_p"
                " or a grammar is drawn at the last hop"
            )
        # the last hop draws decode steps only: the prompt's token is drawn here, from its row
        self._last_hop_draws_after_prefill = self.in_prefill
        if not self.in_prefill:
            self.last_hop_draws = True
            self.result_top_k = result_top_k(0.0, self.sampling.top_k, at_least=self._top_k_at_least)

    def draw_locally(self) -> None:
        self.last_hop_draws = self._last_hop_draws_after_prefill = False
        self.result_top_k = 0 if self._on_prompt_scores else self.draw.result_top_k

    # --- sending ---------------------------------------------------------------------------

    def next_step(self) -> OwnerStep:
        """The rows not yet in the route's caches; the session then awaits this step's result.

        Raises:
          ValueError: a step is already in flight, or the session has ended.
        """
        return self.next_steps(1)[0]

    def next_steps(self, max_steps: int) -> list[OwnerStep]:
        """Up to ``max_steps`` steps at once, numbered one after another: the prompt's chunks
        not yet in the route's caches (``max_step_rows`` each), so that they pipeline down the
        route, each hop computing a chunk while the next computes the one before; one step
        when the prompt is in (a decode step). The session then awaits their results, in
        order (each chunk's is checked, the last chunk's gives the first token).

        Raises:
          ValueError: a step is already in flight, the session has ended, or ``max_steps`` < 1.
        """
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        if self.state == AWAITING:
            raise ValueError(f"session {self.session_hex}: step {self.step} is still in flight")
        if self.finished:
            raise ValueError(f"session {self.session_hex}: the session has ended ({self.state})")
        self.state = AWAITING
        steps: list[OwnerStep] = []
        at = self._n_cached
        while at < len(self.tokens) and len(steps) < max_steps:
            end = len(self.tokens)
            if self.max_step_rows is not None:
                end = min(end, at + self.max_step_rows)
            steps.append(
                OwnerStep(
                    step=self.step + len(steps),
                    positions=tuple(range(at, end)),
                    token_ids=tuple(self.tokens[at:end]),
                    rewind=not steps and self._held_past(at),
                )
            )
            self._in_flight_ends.append(end)
            at = end
        self._route_held = at
        return steps

    @property
    def may_speculate(self) -> bool:
        """Whether this session's tokens can be drafted and verified at all: greedy without
        penalties or a grammar (each kept draft must be the token ``choose_token`` gives its
        row), top-K results (every row's full logits would cost more than the trip saves)."""
        return (
            self.sampling.greedy
            and self.constraint is None
            and not adjusts_logits(self.sampling)
            and self._on_prompt_scores is None
            and self.result_top_k > 0
        )

    @property
    def can_speculate(self) -> bool:
        """Whether a verification step may be sent now: ``may_speculate``, the prompt in, no
        step in flight, and room for a draft and the token after it."""
        return (
            self.may_speculate
            and self.state == READY
            and not self.in_prefill
            and self.max_new_tokens - len(self.generated) >= 2
        )

    def next_verify_step(self, draft: Sequence[int]) -> OwnerStep:
        """A decode step that carries ``draft`` after the last token: rows at the next
        ``1 + len(draft)`` positions, each row's top-K asked back (``receive_rows`` keeps the
        drafts the model agrees with). The draft is cut to leave room for the token after it.

        Raises:
          ValueError: no draft, or ``can_speculate`` is False.
        """
        if not self.can_speculate:
            raise ValueError(f"session {self.session_hex}: no verification step now ({self.state})")
        room = self.max_new_tokens - len(self.generated) - 1
        draft = tuple(int(t) for t in draft[:room])
        if not draft:
            raise ValueError("a verification step needs a draft")
        at = self._n_cached
        rows = tuple(self.tokens[at:]) + draft
        self.state = AWAITING
        self._draft = draft
        self._in_flight_ends.append(len(self.tokens))
        step = OwnerStep(
            step=self.step,
            positions=tuple(range(at, at + len(rows))),
            token_ids=rows,
            every_row=True,
            rewind=self._held_past(at),
        )
        self._route_held = at + len(rows)
        return step

    def _held_past(self, position: int) -> bool:
        return self._route_held > position

    @property
    def in_prefill(self) -> bool:
        """The step in flight (or the next) still carries prompt rows."""
        return self._n_cached < self.prompt_len

    def step_request(
        self,
        step_input: OwnerStep,
        route: swarm_pb2.Route,
        *,
        owner_peer_id: str,
        owner_addrs: Sequence[str],
        admission: swarm_pb2.SignedAdmission,
    ) -> swarm_pb2.StepRequest:
        """The ``StepRequest`` for ``step_input`` to the first hop of ``route``."""
        if not route.hops:
            raise ValueError("the route has no hops")
        first = route.hops[0]
        return swarm_pb2.StepRequest(
            schema_version=SCHEMA_VERSION,
            session_id=self.session_id,
            step=step_input.step,
            begin=first.begin,
            end=first.end,
            positions=step_input.positions,
            token_ids=step_input.token_ids,
            recipe_hash=route.recipe_hash,
            rest=list(route.hops[1:]),
            owner_peer_id=owner_peer_id,
            owner_addrs=list(owner_addrs),
            checksum=token_checksum(step_input.token_ids),
            sender_admission=admission,
            model_sha256=route.model_sha256,
            result_top_k=self.result_top_k,
        )

    # --- receiving -------------------------------------------------------------------------

    def check_sender(self, result: swarm_pb2.StepResult, sender_peer_id: str | None) -> None:
        """Whether ``sender_peer_id`` may send ``result``: a hop of the route, and the last hop
        for logits (any hop may report an error). No check when the route is not known.

        Raises:
          ResultRefused: (not fatal, ``REFUSED``) the sender is not on the route, or sends
            logits without being the last hop. The session is unchanged.
        """
        self._check_sender(sender_peer_id, failed=result.error.code != swarm_pb2.Error.CODE_UNSPECIFIED)

    def _check_sender(self, sender_peer_id: str | None, *, failed: bool) -> None:
        if not self.route_peer_ids:
            return
        if sender_peer_id not in self.route_peer_ids:
            raise ResultRefused(
                _error("REFUSED"),
                f"result from {sender_peer_id}, which is not on the route of this session",
                fatal=False,
            )
        last = self.route_peer_ids[-1]
        if not failed and sender_peer_id != last:
            raise ResultRefused(
                _error("REFUSED"), f"logits from {sender_peer_id}, which is not the last hop ({last})", fatal=False
            )

    def check_result(self, result: swarm_pb2.StepResult) -> None:
        """Whether ``result`` answers the step in flight (identity only, not content).

        Raises:
          ResultRefused: (not fatal) wrong schema or session, stale / duplicate /
            out-of-order step, or an ended session. The session is unchanged.
        """
        if result.schema_version != SCHEMA_VERSION:
            raise ResultRefused(
                _error("INVALID_ARGUMENT"),
                f"schema_version {result.schema_version} is not supported (this peer speaks {SCHEMA_VERSION})",
                fatal=False,
            )
        if bytes(result.session_id) != self.session_id:
            raise ResultRefused(
                _error("NOT_FOUND"),
                f"result for session {bytes(result.session_id).hex()} given to session {self.session_hex}",
                fatal=False,
            )
        self._check_step(result.step)

    def _check_step(self, step: int) -> None:
        if self.finished:
            raise ResultRefused(
                _error("INVALID_ARGUMENT"),
                f"session {self.session_hex} has ended ({self.state}): result for step {step} refused",
                fatal=False,
            )
        awaited = self.step if self.state == AWAITING else None
        if step == awaited:
            return
        last_answered = self.step - 1
        if step == last_answered:
            kind = "duplicate result"
        elif step < last_answered:
            kind = "stale result"
        else:
            kind = "out-of-order result"
        waiting = f"waiting for step {awaited}" if awaited is not None else "no step in flight"
        raise ResultRefused(
            _error("INVALID_ARGUMENT"),
            f"{kind} for step {step} of session {self.session_hex} ({waiting})",
            fatal=False,
        )

    def receive(self, result: swarm_pb2.StepResult, sender_peer_id: str | None = None) -> int | None:
        """Take the result of the step in flight: check it, choose the next token, advance.

        ``sender_peer_id``: the (authenticated) peer that pushed ``result``; checked against
        the route when the session knows it (``check_sender``).

        Returns:
          The chosen token (also appended to ``tokens``), or None for a prefill chunk that
          more of the prompt follows (its logits are checked, not sampled).

        Raises:
          ResultRefused: not ours (``fatal`` False, session unchanged; see ``check_result``) or
            malformed logits for the step in flight (``fatal`` True, session failed).
          HopFailed: the result reports a hop's error (session failed).
        """
        self.check_sender(result, sender_peer_id)
        self.check_result(result)
        if result.error.code != swarm_pb2.Error.CODE_UNSPECIFIED:
            error = HopFailed(result.error.code, result.error.message, result.failed_peer_id)
            self.fail(str(error))
            raise error
        return self._take(result.step, lambda: result_scores(result), int(result.n_vocab))

    def receive_scores(
        self,
        step: int,
        scores: Callable[[], np.ndarray | TopLogits],
        n_vocab: int,
        sender_peer_id: str | None = None,
        drawn: int | None = None,
    ) -> int | None:
        """Take a successful result of the step in flight that comes as scores rather than a
        ``StepResult``: the data plane's RESULT, which the owner opened under the session's
        return key (AES-GCM authenticates its session, counter and bytes, so it carries no
        checksum; building a ``StepResult`` from it only to take it apart again cost the owner
        ~0.04 ms a decode step more, measured in the swarm). The same checks of the sender and
        the step as ``receive``, and the same choice of the token.

        ``scores()`` makes the row or the top-K from the result's bytes (called once, after
        the identity checks); a ValueError from it is a malformed result.

        ``drawn``: the token the last hop drew (``draw_at_last_hop``), taken once checked
        (``agent.core.owner.sampling.checked_draw``).

        Returns and raises as ``receive`` (``HopFailed`` never: an error comes as a
        ``StepResult``).
        """
        self._check_sender(sender_peer_id, failed=False)
        self._check_step(step)
        return self._take(step, scores, n_vocab, drawn)

    def receive_rows(
        self, step: int, rows: Callable[[], Sequence[TopLogits]], n_vocab: int, sender_peer_id: str | None = None
    ) -> list[int]:
        """Take the result of the verification step in flight (``next_verify_step``): each
        row's top-K (``rows()``, called once after the identity checks). The drafts are kept up
        to the first that is not the greedy choice of the row before it; then the choice of
        the last kept row is taken too. A stop token or the budget ends it where it comes.

        Returns:
          The tokens taken, in order (also appended to ``tokens``; ``taken`` pairs each with
          its scores).

        Raises:
          ResultRefused: as ``receive_scores``; fatal too when the result has not one row per
            row of the step.
        """
        self._check_sender(sender_peer_id, failed=False)
        self._check_step(step)
        draft = self._draft
        try:
            if not draft:
                raise ValueError("a result with every row's top-K, for a step with no draft")
            scores = [self._logits(row, n_vocab) for row in rows()]
            if len(scores) != len(draft) + 1:
                raise ValueError(f"{len(scores)} rows of top-K for a step of {len(draft) + 1} rows")
            taken: list[tuple[int, np.ndarray | TopLogits]] = []
            context = list(self.tokens)
            for index, row in enumerate(scores):
                token = choose_token(row, self.sampling, 0.0, context, self.output_start)
                taken.append((token, row))
                context.append(token)
                if index == len(draft) or token != draft[index] or token in self.stop_tokens:
                    break
                if len(self.generated) + len(taken) >= self.max_new_tokens:
                    break
        except ValueError as bad:
            raise self._malformed(step, bad) from None
        self.n_vocab = n_vocab
        del self._in_flight_ends[0]
        self._draft = ()
        accepted = sum(1 for (token, _), drafted in zip(taken, draft) if token == drafted)
        self.drafted_tokens += len(draft)
        self.accepted_tokens += accepted
        self.last_verified = (len(draft), accepted)
        self.taken = taken
        self.tokens.extend(token for token, _ in taken)
        self.last_logits = taken[-1][1]
        self._n_cached = len(self.tokens) - 1
        self._after_token(taken[-1][0])
        return [token for token, _ in taken]

    def _malformed(self, step: int, bad: ValueError) -> ResultRefused:
        """Fail the session over a malformed result for ``step``; the error to raise."""
        message = f"malformed result for step {step} of session {self.session_hex}: {bad}"
        self.fail(message)
        return ResultRefused(_error("INVALID_ARGUMENT"), message, fatal=True)

    def _after_token(self, token: int) -> None:
        """The step is answered with ``token`` last: finished by a stop token or the budget."""
        self.step += 1
        if token in self.stop_tokens:
            self.stopped_by_token = True
            self.state = FINISHED
        elif len(self.generated) >= self.max_new_tokens:
            self.state = FINISHED
        else:
            self.state = READY

    def _take(
        self, step: int, scores: Callable[[], np.ndarray | TopLogits], n_vocab: int, drawn: int | None = None
    ) -> int | None:
        in_flight_end = self._in_flight_ends[0]
        chunk = in_flight_end < len(self.tokens)  # a prefill chunk: more prompt follows
        try:
            logits = self._logits(scores(), n_vocab)
            # a chunk's logits are checked, never sampled: no draw, so chunking changes no seed's tokens
            token = None if chunk else self._draw(logits, drawn, n_vocab)
        except ValueError as bad:
            raise self._malformed(step, bad) from None
        self.n_vocab = n_vocab
        del self._in_flight_ends[0]
        if token is None:
            if self._on_prompt_scores is not None:
                self._on_prompt_scores(in_flight_end - 1, logits)
            self._n_cached = in_flight_end
            self.step += 1
            self.state = AWAITING if self._in_flight_ends else READY  # later chunks are on their way
            return None
        self.last_logits = logits
        self.taken = [(token, logits)]
        self._n_cached = len(self.tokens)
        self.tokens.append(token)
        if self._last_hop_draws_after_prefill:
            self.draw_at_last_hop()  # the prompt's token is in: the decode steps are the last hop's
        self._after_token(token)
        return token

    def _draw(self, logits: np.ndarray | TopLogits, drawn: int | None, n_vocab: int) -> int:
        """The next token: the owner's draw, or the last hop's (``drawn``) once checked."""
        uniform = 0.0 if self.draw_seed is None else draw_uniform(self.draw_seed, len(self.tokens))
        if self.constraint is not None:
            return self._constrained_draw(logits, uniform)
        if drawn is None or self.sampling.greedy:
            return choose_token(logits, self.sampling, uniform, self.tokens, self.output_start)
        if not self.last_hop_draws:
            raise ValueError("the result brings a drawn token, but the session draws its tokens itself")
        return checked_draw(logits, self.sampling, uniform, drawn, n_vocab)

    def _constrained_draw(self, logits: np.ndarray | TopLogits, uniform: float) -> int:
        assert self.constraint is not None
        if adjusts_logits(self.sampling) and not isinstance(logits, TopLogits):
            # penalties and logit_bias first, then the grammar's mask (as llama.cpp orders them)
            logits = adjust_logits(logits, self.sampling, self.tokens, self.output_start)
        token = constrained_draw(logits, self.constraint.allowed(), self.sampling, uniform)
        if token is None:  # (a constrained session asks for full rows: draw_plan)
            raise ValueError("the grammar allows none of the top-K and no full row came")
        self.constraint.accept(token)
        return token

    def _logits(self, scores: np.ndarray | TopLogits, n_vocab: int) -> np.ndarray | TopLogits:
        if self.n_vocab is not None and n_vocab != self.n_vocab:
            raise ValueError(f"n_vocab {n_vocab}, expected {self.n_vocab}")
        if isinstance(scores, TopLogits):
            if self.result_top_k == 0 and scores.k < scores.n_vocab:
                raise ValueError(f"the full row was asked for, the result has the top {scores.k}")
            if scores.k < min(self.result_top_k, scores.n_vocab):
                raise ValueError(f"the top {self.result_top_k} were asked for, the result has {scores.k}")
        elif not np.isfinite(scores).all():
            raise ValueError("the logits hold NaN or inf")
        return scores
