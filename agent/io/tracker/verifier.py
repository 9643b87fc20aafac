"""The tracker's verifier: canary checks of served ranges against a trusted reference.

Owns the I/O of the checks ``agent.core.tracker.canary`` decides: for the range due (``CanarySchedule``
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

This module runs the checks (``run_check``) and their loop (``serve_verifier``); beside it:
``agent.io.tracker.verifier_api`` (settings, outcomes, totals, ``CanaryHost``),
``agent.io.tracker.reference`` (``ReferencePool``), ``agent.io.tracker.personas`` (the fresh
identities and what they take).

Must not import ``agent.io.tracker.service`` (which imports this module): what the verifier
uses of the tracker is ``CanaryHost``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import TypedDict

import numpy as np
import trio

from agent._proto import swarm_pb2
from agent.core.tracker.canary import CanaryPlan, OutputMismatch, RangeKey, compare_rows, compare_scores, plan_canary
from agent.core.wire.boundary import WireDType
from agent.core.wire.step_requests import boundary_step_request, first_step_request
from agent.core.wire.step_results import result_scores
from agent.core.wire.step_validation import RangeSpec
from agent.core.wire.swarm_wire import NODE_PROTOCOL, SCHEMA_VERSION, STEP_PROTOCOL, WireError, parse_record
from agent.core.wire.topk import TopLogits
from agent.core.wire.worker_records import SeqInput, SeqOutput
from agent.io.net.transport import TransportError
from agent.io.tracker.personas import Inbox, Persona, libp2p_personas, open_personas
from agent.io.tracker.reference import ReferencePool
from agent.io.tracker.verifier_api import CanaryHost, CheckOutcome, OpenPersona, VerifierConfig, VerifierStats
from agent.io.worker.error import WorkerError
from agent.io.worker.process import WorkerBinaryNotFound, WorkerStartError

__all__ = ["run_check", "serve_verifier"]

log = logging.getLogger(__name__)

Code = swarm_pb2.Error.Code


class _CheckStats(TypedDict):
    """A canary's counters, as ``CheckOutcome`` names them."""

    steps: int
    rows: int
    node_s: float
    reference_s: float


class _Inconclusive(Exception):
    pass


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
    inbox = Inbox(peer_id, session_id, downstream)
    # personas: the owner (a client), a sender when the range is not first (an upstream node),
    # a next hop when it is not last
    count = 1 + (begin > 0) + (end < n_layer)
    async with open_personas(open_persona, count, inbox) as personas:
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
    inbox: Inbox,
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


async def _send_step(sender: Persona, hop: swarm_pb2.Hop, request: swarm_pb2.StepRequest, timeout_s: float) -> None:
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
    sender: Persona,
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
