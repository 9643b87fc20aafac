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
(``resume_plan`` says which part of the route to replace and which hops keep their caches).

Pure: numpy and protobuf records (checksums and constants from ``agent.core.wire.swarm_wire``,
result scores from ``agent.core.wire.step_results``); the random generator comes in as an argument.
Must not import trio, grpc, libp2p, sockets, clocks or agent.io.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from agent._proto import swarm_pb2
from agent.core.owner.sampling import SamplingParams, sample_token
from agent.core.wire.step_results import result_scores
from agent.core.wire.swarm_wire import SCHEMA_VERSION, SESSION_ID_BYTES, token_checksum
from agent.core.wire.topk import TopLogits, result_top_k

__all__ = [
    "SCHEMA_VERSION",
    "SESSION_ID_BYTES",
    "HopFailed",
    "OwnerStep",
    "ResultRefused",
    "ResumePlan",
    "Session",
    "SessionError",
    "end_session_request",
    "resume_plan",
    "surviving_hops",
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
    """The rows one step of the owner's session sends to the first hop (a node's validated
    step is ``agent.core.wire.step_validation.StepInput``)."""

    step: int
    positions: tuple[int, ...]
    token_ids: tuple[int, ...]


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
      rng: the generator draws come from (needed unless greedy); seed it for reproducible runs.
      n_vocab: the expected logits width, if known; otherwise the first result fixes it.
      route_peer_ids: the peer ids of the route's hops, in order; when given, ``receive``
        takes a result only from one of them, and logits only from the last.
      top_k_at_least: ask the last hop for at least this many top logits (e.g. the owner's
        top_logprobs); the request's K is ``agent.core.wire.topk.result_top_k`` (0, the full row,
        when sampling has no top-k cut).
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
        n_vocab: int | None = None,
        route_peer_ids: Sequence[str] = (),
        top_k_at_least: int = 0,
        max_step_rows: int | None = None,
    ) -> None:
        if len(session_id) != SESSION_ID_BYTES:
            raise ValueError(f"a session id has {SESSION_ID_BYTES} bytes, got {len(session_id)}")
        if not prompt:
            raise ValueError("the prompt has no tokens")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not sampling.greedy and rng is None:
            raise ValueError(f"sampling at temperature {sampling.temperature} needs a random generator")
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
        self.result_top_k = result_top_k(sampling.temperature, sampling.top_k, at_least=top_k_at_least)
        self.failure: str | None = None
        self.route_peer_ids = tuple(route_peer_ids)
        self.max_step_rows = max_step_rows
        # the end (in tokens) of each step in flight, oldest first: steps self.step, self.step + 1,
        # ...; several only while prompt chunks pipeline down the route (``next_steps``)
        self._in_flight_ends: list[int] = []
        self._rng = rng
        self._n_cached = 0  # tokens[:_n_cached] are in the route's caches

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
        self.state = READY
        self.failure = None
        self.route_peer_ids = tuple(route_peer_ids)
        return self.step

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
                )
            )
            self._in_flight_ends.append(end)
            at = end
        return steps

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
        self, step: int, scores: Callable[[], np.ndarray | TopLogits], n_vocab: int, sender_peer_id: str | None = None
    ) -> int | None:
        """Take a successful result of the step in flight that comes as scores rather than a
        ``StepResult``: the data plane's RESULT, which the owner opened under the session's
        return key (AES-GCM authenticates its session, counter and bytes, so it carries no
        checksum; building a ``StepResult`` from it only to take it apart again cost the owner
        ~0.04 ms a decode step more, measured in the swarm). The same checks of the sender and
        the step as ``receive``, and the same choice of the token.

        ``scores()`` makes the row or the top-K from the result's bytes (called once, after
        the identity checks); a ValueError from it is a malformed result.

        Returns and raises as ``receive`` (``HopFailed`` never: an error comes as a
        ``StepResult``).
        """
        self._check_sender(sender_peer_id, failed=False)
        self._check_step(step)
        return self._take(step, scores, n_vocab)

    def _take(self, step: int, scores: Callable[[], np.ndarray | TopLogits], n_vocab: int) -> int | None:
        in_flight_end = self._in_flight_ends[0]
        chunk = in_flight_end < len(self.tokens)  # a prefill chunk: more prompt follows
        try:
            logits = self._logits(scores(), n_vocab)
            # a chunk's logits are checked, never sampled: no draw, so chunking changes no seed's tokens
            token = None if chunk else sample_token(logits, self.sampling, self._rng)
        except ValueError as bad:
            message = f"malformed result for step {step} of session {self.session_hex}: {bad}"
            self.fail(message)
            raise ResultRefused(_error("INVALID_ARGUMENT"), message, fatal=True) from None
        self.n_vocab = n_vocab
        del self._in_flight_ends[0]
        if token is None:
            self._n_cached = in_flight_end
            self.step += 1
            self.state = AWAITING if self._in_flight_ends else READY  # later chunks are on their way
            return None
        self.last_logits = logits
        self._n_cached = len(self.tokens)
        self.tokens.append(token)
        self.step += 1
        if token in self.stop_tokens:
            self.stopped_by_token = True
            self.state = FINISHED
        elif len(self.generated) >= self.max_new_tokens:
            self.state = FINISHED
        else:
            self.state = READY
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


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    """How a session goes on after losing a peer: hops ``[first_lost, last_lost]`` of the
    route (blocks ``[begin, end)``) are replaced by a route part the tracker plans; the other
    hops (``survivors``) keep their caches of ``keep_positions``; the replacement is rebuilt
    from the rows the hop before it kept (``feeder``), or from the owner's tokens when the
    first hop was lost (``feeder`` None)."""

    first_lost: int
    last_lost: int
    begin: int
    end: int
    keep_positions: int
    survivors: tuple[swarm_pb2.Hop, ...]
    feeder: swarm_pb2.Hop | None

    def route_with(self, route: swarm_pb2.Route, replacement: Sequence[swarm_pb2.Hop]) -> swarm_pb2.Route:
        """``route`` with the lost hops replaced by ``replacement`` (which must cover
        ``[begin, end)`` exactly).

        Raises:
          ValueError: the replacement does not cover the lost blocks.
        """
        at = self.begin
        for hop in replacement:
            if hop.begin != at or hop.end <= hop.begin:
                raise ValueError(f"the replacement hop [{hop.begin}, {hop.end}) does not continue at block {at}")
            at = hop.end
        if at != self.end or not replacement:
            raise ValueError(f"the replacement covers blocks [{self.begin}, {at}), not [{self.begin}, {self.end})")
        hops = list(route.hops[: self.first_lost]) + list(replacement) + list(route.hops[self.last_lost + 1 :])
        new = swarm_pb2.Route()
        new.CopyFrom(route)
        del new.hops[:]
        new.hops.extend(hops)
        return new


def resume_plan(route: swarm_pb2.Route, lost_peer: str, keep_positions: int) -> ResumePlan | None:
    """Whether a session that lost ``lost_peer`` can resume on ``route`` keeping
    ``keep_positions`` (None: re-prefill a new route instead): there must be something to keep,
    the lost peer's hops must be one contiguous part of the route, and some hop must survive."""
    lost = [i for i, hop in enumerate(route.hops) if hop.peer_id == lost_peer]
    if keep_positions < 1 or not lost or lost != list(range(lost[0], lost[-1] + 1)):
        return None
    first, last = lost[0], lost[-1]
    survivors = tuple(hop for i, hop in enumerate(route.hops) if not first <= i <= last)
    if not survivors:
        return None
    return ResumePlan(
        first_lost=first,
        last_lost=last,
        begin=route.hops[first].begin,
        end=route.hops[last].end,
        keep_positions=keep_positions,
        survivors=survivors,
        feeder=route.hops[first - 1] if first > 0 else None,
    )


def surviving_hops(route: swarm_pb2.Route, lost_peers: Iterable[str] = ()) -> list[swarm_pb2.Hop]:
    """The hops of ``route`` not run by a lost peer (where an end-session can still go)."""
    lost = set(lost_peers)
    return [hop for hop in route.hops if hop.peer_id not in lost]


def end_session_request(
    session_id: bytes,
    route: swarm_pb2.Route,
    admission: swarm_pb2.SignedAdmission,
    lost_peers: Iterable[str] = (),
) -> swarm_pb2.NodeRequest:
    """The ``NodeRequest`` to the first surviving hop that frees the session on every surviving
    hop of ``route``: a lost peer is skipped, so that ending a session never waits on it."""
    return swarm_pb2.NodeRequest(
        schema_version=SCHEMA_VERSION,
        sender_admission=admission,
        end_session=swarm_pb2.EndSessionRequest(
            session_id=bytes(session_id), rest=surviving_hops(route, lost_peers)[1:]
        ),
    )
