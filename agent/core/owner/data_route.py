"""The owner's side of a route on the workers' data plane: where each hop's worker is, the keys,
the bind requests, and the translation between the owner's steps and results and the data
plane's frames (``agent.core.wire.data_frames``; protocol/swarm.proto ``DataPlaneBindRequest``).

Why: a step through the node agents costs each hop two Python processes' wake-ups and work
(~2 ms a hop on the benchmark machine); worker to worker it costs a TCP message and the
Forward (bench/results/data_plane.md). The node agents stay the control plane: they admit the
owner, lease the sequence, bind the session on their worker, and unbind it before anything
else touches it; the owner only sends STEPs to the first worker and takes RESULTs from the last.

Owns:
- ``data_plane_hosts``: each hop's host for its worker (the host of its direct channel address:
  a hop reachable only through the relay has none, and the route stays on the node path);
- ``RouteKeys``: one 32-byte key per hop for the STEPs it takes, the return key and the
  continue key, all fresh per session (made by the caller's ``random_bytes``);
- ``bind_request``: what the owner asks each hop's node (last hop first: each names where its
  output goes, which it learns from the next hop's answer);
- ``next_hop_refusal``: the node's side of a bind: where its worker is told to push the
  session's boundary rows must be the next hop the tracker lists (its peer, its range, its
  data plane's port, one of its addresses), so that an owner cannot turn a volunteer's worker
  into a client of any host and port it names;
- ``continue_request`` / ``continuation_steps`` / ``first_hop_refusal``: continuation, the last
  hop sending each next decode step straight to the first hop (protocol/worker.proto,
  ContinueSession), with its greedy token or, for a sampled session, the token it drew with the
  owner's parameters and seed (``drawn_token`` reads it off a RESULT): what the owner asks,
  how many steps its session may still use, and the last hop's node's check that the first
  hop is the one the tracker lists;
- ``data_step`` / ``result_scores`` / ``step_result``: the owner's ``StepRequest`` as a
  ``DataStep``; a successful ``DataResult``'s scores, which the session takes
  (``Session.receive_scores``) with the checks and the choice of the node path; and a
  ``DataResult`` as a ``StepResult`` (an error names the hop whose range refused the step).

Pure: no sockets, trio, clocks or randomness. Must not import agent.io.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import cast

import numpy as np

from agent._proto import swarm_pb2, worker_pb2
from agent.core.net.multiaddrs import parse_channel_multiaddr, same_host
from agent.core.owner.sampling import SamplingParams
from agent.core.wire.address_rate import counted_host
from agent.core.wire.data_frames import KEY_BYTES
from agent.core.wire.step_results import step_result_top
from agent.core.wire.swarm_wire import SCHEMA_VERSION, crc32, error, worker_error_code
from agent.core.wire.topk import TopLogits

__all__ = [
    "RouteKeys",
    "bind_request",
    "continuation_steps",
    "continue_request",
    "data_plane_hosts",
    "data_step",
    "drawn_token",
    "first_hop_refusal",
    "next_hop_refusal",
    "result_scores",
    "step_result",
    "success_step_result",
]

#: gRPC status codes a worker puts in DataResult.error_code, by name (worker_error_code maps
#: the names the swarm shares; anything else is INTERNAL)
_GRPC_NAMES = {
    3: "INVALID_ARGUMENT",
    5: "NOT_FOUND",
    8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION",
    13: "INTERNAL",
    14: "UNAVAILABLE",
}


def data_plane_hosts(route: swarm_pb2.Route) -> list[str] | None:
    """The host of each hop's direct channel address (its worker's data plane listens there),
    or None when a hop has none (reached only through the relay, or libp2p only)."""
    hosts = []
    for hop in route.hops:
        parsed = [p for p in map(parse_channel_multiaddr, hop.addrs) if p is not None]
        if not parsed:
            return None
        hosts.append(parsed[0][0])
    return hosts


@dataclasses.dataclass(frozen=True)
class RouteKeys:
    """The keys of one session on one route: ``step_keys[i]`` seals the STEPs hop ``i`` takes,
    ``return_key`` the RESULTs the last hop sends (and the owner's ATTACH), ``continue_key``
    the CONTINUE steps the last hop sends the first (greedy continuation)."""

    step_keys: tuple[bytes, ...]
    return_key: bytes
    continue_key: bytes

    @classmethod
    def new(cls, n_hops: int, random_bytes: Callable[[int], bytes]) -> RouteKeys:
        return cls(
            tuple(random_bytes(KEY_BYTES) for _ in range(n_hops)), random_bytes(KEY_BYTES), random_bytes(KEY_BYTES)
        )


def bind_request(
    route: swarm_pb2.Route,
    index: int,
    session_id: bytes,
    keys: RouteKeys,
    hosts: list[str],
    next_port: int,
    wire_dtype: int = 0,
) -> swarm_pb2.DataPlaneBindRequest:
    """The bind for hop ``index``: its step key, and where its output goes (the next hop's
    worker at ``hosts[index + 1]:next_port``, which that hop's bind answered, in the session's
    ``wire_dtype``; 0: F32) or, for the last hop, the return key; and the route's length (a
    first hop's decode groups follow it)."""
    hop = route.hops[index]
    request = swarm_pb2.DataPlaneBindRequest(
        session_id=session_id, model_sha256=route.model_sha256, begin=hop.begin, end=hop.end,
        step_key=keys.step_keys[index], route_hops=len(route.hops),
    )  # fmt: skip
    if index + 1 < len(route.hops):
        request.next_host = hosts[index + 1]
        request.next_port = next_port
        request.next_step_key = keys.step_keys[index + 1]
        request.next_peer_id = route.hops[index + 1].peer_id
        if wire_dtype and wire_dtype != swarm_pb2.DTYPE_F32:
            request.wire_dtype = cast(swarm_pb2.DType, wire_dtype)
    else:
        request.return_key = keys.return_key
    if index == 0:
        request.continue_key = keys.continue_key
    return request


def continue_request(
    route: swarm_pb2.Route,
    session_id: bytes,
    keys: RouteKeys,
    hosts: list[str],
    first_port: int,
    *,
    steps: int,
    stop_token_ids: Iterable[int],
    max_position: int,
    sampling: SamplingParams = SamplingParams(),
    draw_seed: int = 0,
) -> swarm_pb2.DataPlaneContinueRequest:
    """What the owner asks the last hop for continuation: after each decode step, send the next
    one (its token) to the first hop's worker at ``hosts[0]:first_port``, at most ``steps`` of
    them, none after a token of ``stop_token_ids`` or at ``max_position`` or beyond. Greedy
    ``sampling``: the token is the first of the top-K; otherwise the last hop draws it with
    ``sampling`` and the uniforms of ``draw_seed`` (``agent.core.owner.sampling.draw_uniform``)."""
    last = route.hops[-1]
    return swarm_pb2.DataPlaneContinueRequest(
        session_id=session_id, model_sha256=route.model_sha256, begin=last.begin, end=last.end,
        first_peer_id=route.hops[0].peer_id, first_host=hosts[0], first_port=first_port,
        continue_key=keys.continue_key, steps=steps, stop_token_ids=sorted(stop_token_ids), max_position=max_position,
        temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, draw_seed=draw_seed,
    )  # fmt: skip


def continuation_steps(max_new_tokens: int, generated: int, *, greedy: bool, top_k: int, drawn: bool = False) -> int:
    """The CONTINUE steps a session may use once ``generated`` tokens are out (0: do not ask):
    a greedy session whose results carry a top-K (the last worker's choice is its first entry,
    as the owner's is), or a sampled one whose last hop draws (``drawn``). Its first decode step
    on the data plane (the owner's) gives token ``generated + 1``, each continued step one more,
    up to ``max_new_tokens``. Never more (a step past the owner's end is work for nothing; one
    short is covered by the owner's own step)."""
    if not (drawn or (greedy and top_k >= 1)):
        return 0
    return max(0, max_new_tokens - generated - 1)


def next_hop_refusal(request: swarm_pb2.DataPlaneBindRequest, nodes: Sequence[swarm_pb2.NodeEntry]) -> str | None:
    """Why a node must not make ``request``'s bind, or None. Not the last hop (``next_port``
    set), the bind must name the next hop's peer id, and the tracker's node list (``nodes``,
    ``ListNodesReply``) must show that peer alive, READY on the model's range that begins where
    this one ends (assigned to it by the tracker, and through its first canary check where checks
    gate routes) with its worker's data plane at ``next_port``, and ``next_host`` the host of
    one of its direct addresses. The owner learns all of these from the tracker's route and the
    next node's bind answer; anything else it names is not a hop of a route."""
    if not request.next_port:
        return None  # the last hop: its RESULTs go back over the owner's own connection
    if not request.next_peer_id:
        return "the bind names no next hop (next_peer_id), so where its worker would send cannot be checked"
    return _hop_refusal(
        "the next hop", request.next_peer_id, request.model_sha256, request.end, request.next_host, request.next_port,
        nodes,
    )  # fmt: skip


def first_hop_refusal(request: swarm_pb2.DataPlaneContinueRequest, nodes: Sequence[swarm_pb2.NodeEntry]) -> str | None:
    """Why a last hop's node must not make ``request``'s continuation, or None: as
    ``next_hop_refusal``, for the first hop (the model's range from block 0) at
    ``first_host:first_port``, so that an owner cannot make a worker send anywhere else."""
    if not request.first_peer_id:
        return "the request names no first hop (first_peer_id), so where its worker would send cannot be checked"
    return _hop_refusal(
        "the first hop", request.first_peer_id, request.model_sha256, 0, request.first_host, request.first_port, nodes
    )


def _hop_refusal(
    what: str, peer: str, model_sha256: str, begin: int, host: str, port: int, nodes: Sequence[swarm_pb2.NodeEntry]
) -> str | None:
    """Why ``peer`` is not a live node serving ``model_sha256`` from block ``begin`` with its data
    plane at ``host:port`` by the tracker's list, or None."""
    entry = next((n for n in nodes if n.peer_id == peer), None)
    if entry is None or not entry.alive:
        return f"{what} {peer} is not a live node of the tracker"
    # the tracker's own word first: what it assigned, not what the node says it serves
    if not any(a.model_sha256 == model_sha256 and a.begin == begin for a in entry.assigned):
        return f"{what} {peer} is not assigned a range of model {model_sha256[:12]} from block {begin} by the tracker"
    serves = any(
        status.state == swarm_pb2.AssignmentStatus.READY
        and not status.awaiting_check  # a range not yet through its first canary check is not routed
        and status.assignment.model_sha256 == model_sha256
        and status.assignment.begin == begin
        and status.data_port == port
        for status in entry.serving
    )
    if not serves:
        return f"{what} {peer} serves no range of model {model_sha256[:12]} from block {begin} with its data plane at port {port}"
    hosts = {parsed[0] for parsed in map(parse_channel_multiaddr, entry.listen_addrs) if parsed is not None}
    if host not in hosts:
        return f"{host!r} is not an address of {what} {peer} (the tracker lists {sorted(hosts)})"
    # the addresses are the node's word; where the tracker hears it from is not: a node on
    # another machine cannot send a worker to a host but its own (one heard over loopback, on
    # the tracker's own machine, is the operator's, as for admission limits: taken as listed)
    if counted_host(entry.seen_host) and not same_host(host, entry.seen_host):
        return f"{host!r} is not where the tracker hears {what} {peer} from ({entry.seen_host})"
    return None


def data_step(
    step: int,
    positions: Sequence[int],
    token_ids: Sequence[int],
    top_k: int,
    *,
    every_row: bool = False,
    rewind: bool = False,
) -> worker_pb2.DataStep:
    """The STEP the first worker takes: what the owner's ``StepRequest`` to the first hop
    would carry (token ids at their positions, the top-K it wants back), and for speculative
    decoding whether every row's top-K comes back and whether the hops cut rejected rows
    first (``agent.core.owner.speculation``)."""
    return worker_pb2.DataStep(
        step=step, positions=positions, token_ids=token_ids, top_k=top_k, every_row=every_row, rewind=rewind
    )


def step_result(
    session_id: bytes, result: worker_pb2.DataResult, route: swarm_pb2.Route
) -> tuple[swarm_pb2.StepResult, str]:
    """``(StepResult, sender peer id)`` for a RESULT from the route's last worker (which opened
    under the return key: only that worker holds it). An error is sent as from the hop whose
    range refused the step (``error_layer_begin``), so the owner names that hop."""
    last = route.hops[-1].peer_id
    if result.error_code:
        failed = next((h.peer_id for h in route.hops if h.begin == result.error_layer_begin), last)
        name = _GRPC_NAMES.get(result.error_code, "INTERNAL")
        return (
            swarm_pb2.StepResult(
                schema_version=SCHEMA_VERSION,
                session_id=session_id,
                step=result.step,
                error=error(worker_error_code(name), f"worker: {name}: {result.error_message}"),
                failed_peer_id=failed,
            ),
            failed,
        )
    return success_step_result(session_id, result), last


def success_step_result(session_id: bytes, result: worker_pb2.DataResult) -> swarm_pb2.StepResult:
    """A successful ``DataResult`` as the ``StepResult`` the node path would bring (for a spot
    check, which replays ``StepResult``s; the owner itself takes ``result_scores``)."""
    if result.top_k:
        return step_result_top(session_id, result.step, _top_logits(result), swarm_pb2.SignedAdmission())
    return swarm_pb2.StepResult(
        schema_version=SCHEMA_VERSION,
        session_id=session_id,
        step=result.step,
        logits=result.logits,
        n_vocab=result.n_vocab,
        checksum=crc32(result.logits),
    )


def result_scores(result: worker_pb2.DataResult) -> np.ndarray | TopLogits:
    """The scores of a successful ``DataResult``: its top-K (checked, ``TopLogits.check``) or
    its full f32 row (a zero-copy view; the session checks it for finite values).

    Raises:
      ValueError: n_vocab 0, byte lengths that do not fit, or a malformed top-K.
    """
    if result.n_vocab < 1:
        raise ValueError("n_vocab is 0")
    if result.top_k:
        if result.logits:
            raise ValueError("the result carries both a logits row and top-k logits")
        top = _top_logits(result)
        top.check()
        return top
    if len(result.logits) != 4 * result.n_vocab:
        raise ValueError(
            f"{len(result.logits)} logits bytes for n_vocab {result.n_vocab} (expected {4 * result.n_vocab})"
        )
    return np.frombuffer(result.logits, dtype="<f4")


def result_rows(result: worker_pb2.DataResult) -> list[TopLogits]:
    """Each row's top-K of a successful RESULT to a step with ``every_row`` (checked,
    ``TopLogits.check``).

    Raises:
      ValueError: n_vocab 0, no top-K, or byte lengths that do not fit ``rows`` rows of it.
    """
    rows, k = int(result.rows), int(result.top_k)
    if result.n_vocab < 1:
        raise ValueError("n_vocab is 0")
    if rows < 1 or k < 1:
        raise ValueError(f"a result of every row's top-K with {rows} rows of the top {k}")
    if len(result.row_log_sum_exp) != rows:
        raise ValueError(f"{len(result.row_log_sum_exp)} log-sum-exps for {rows} rows")
    if len(result.top_token_ids) != 4 * rows * k or len(result.top_logits) != 4 * rows * k:
        raise ValueError(
            f"{len(result.top_token_ids)} top-k id bytes and {len(result.top_logits)} logit bytes"
            f" for {rows} rows of the top {k}"
        )
    ids = np.frombuffer(result.top_token_ids, dtype="<i4").reshape(rows, k)
    logits = np.frombuffer(result.top_logits, dtype="<f4").reshape(rows, k)
    out = []
    for row in range(rows):
        top = TopLogits(ids[row], logits[row], float(result.row_log_sum_exp[row]), int(result.n_vocab))
        top.check()
        out.append(top)
    return out


def drawn_token(result: worker_pb2.DataResult) -> int | None:
    """The token the last hop drew for the owner (``DataResult.drawn``), or None."""
    return int(result.drawn_token) if result.drawn else None


def _top_logits(result: worker_pb2.DataResult) -> TopLogits:
    if len(result.top_token_ids) != len(result.top_logits) or len(result.top_token_ids) % 4:
        raise ValueError(
            f"{len(result.top_token_ids)} top-k id bytes and {len(result.top_logits)} logit bytes do not pair up"
        )
    return TopLogits(
        np.frombuffer(result.top_token_ids, dtype="<i4"),
        np.frombuffer(result.top_logits, dtype="<f4"),
        float(result.log_sum_exp),
        int(result.n_vocab),
        # the drawn token's log-probability, for a token outside the K
        ((int(result.drawn_token), float(result.drawn_logprob)),) if result.drawn else (),
    )
