"""The owner's timeouts and limits: ``SwarmClientConfig``, the one place a client's tunables are
named (unit, default, why); those made with ``setting`` are ``baton generate``'s flags.

Must not import the client's other modules (they all read it).
"""

from __future__ import annotations

import dataclasses

from agent import cli_args
from agent.core.owner.wire_choice import WIRE_CHOICES
from agent.io.settings import setting


@dataclasses.dataclass(frozen=True)
class SwarmClientConfig:
    """Timeouts and limits of a client.

    ``request_timeout_s``: one control exchange (hello, route, tokenize, step ack, end session).
    ``step_timeout_s``: from sending a step until its result is pushed back.
    ``replan_attempts``: how many times one generation may move to a new route after a hop fails.
    ``replan_wait_s``: how long a replan waits for the tracker to offer a route without the
    failed peer (it notices a dead node after its heartbeat timeout).
    ``route_poll_interval_s``: pause between two route requests while waiting for a route
    (and the first pause while waiting for a free sequence).
    ``queue_timeout_s``: how long a new generation waits for a free sequence on its route.
    ``session_ended_timeout_s``: how long a finished generation spends telling the tracker its
    routes carry it no more (best effort: the hops' next heartbeats say it anyway).
    ``prefill_chunk_tokens``: a prompt (or a re-prefill) longer than this goes in chunks of
    this many rows, one step each (at most the workers' batch: 512 by default). 64, the
    prefix block size: a copied prefix ends on a chunk boundary (the rest is computed in the
    very chunks a session without the cache computes, so the tokens are the same), so with a
    chunk per block a cached prompt leaves at most a block to compute. On the lab at 20 ms a
    1,500-token prompt's first token came 0.90x as soon as in chunks of 512, 0.85x in chunks of
    128 (the chunks pipeline down the route; bench/results/wan_prefill_chunks.md), and a new
    session with that prompt cached had its first token 0.13x as soon as the first session in
    chunks of 64, 0.19x in chunks of 128 (bench/results/prefix.md, prefix_chunks_of_128.md).
    An accelerator computes a chunk of 64 rows less efficiently than one of 512: measure there.
    ``min_data_plane_step_deadline_s``: the same floor for a step that goes worker to worker,
    lower: no node on the way reports a lost next hop there (a worker that cannot reach the
    next one can only drop the step), so the owner's probes are what name it, and a probe that
    was not needed costs only a touch of each hop.
    ``step_deadline_factor`` / ``min_step_deadline_s``: a decode step that takes longer than
    this multiple of the measured decode step time (and at least the minimum) makes the owner
    probe the route's hops, each within ``probe_timeout_s``; one that does not answer is probed
    again, up to ``probe_attempts`` times, each attempt allowed one ``probe_timeout_s`` more (on
    a WAN link that drops packets one lost segment costs a TCP retransmission timeout, and a
    lost SYN a second: one missed probe is not a dead hop), and one that answers none is named
    as the failed peer (``step_timeout_s`` still bounds the wait when every hop answers).
    ``report_grace_s``: how long a replan waits for the tracker to take the lost-peer report
    once the new route is there (the tracker finishes its probe on its own).
    A prefill (chunk), or a decode before any was measured, has no measured time to go by: its
    hops are probed every ``probe_interval_s`` while it waits, and so is a decode past its
    deadline (a hop can die after answering a probe).
    ``resume``: a lost hop is replaced while the other hops keep their caches (False: every
    replan re-prefills a whole new route, e.g. to compare the two).
    ``data_plane``: once a session's prompt is in the route's caches, its decode steps go worker
    to worker (``agent.core.owner.data_route``) when every hop offers it (a hop reached only through
    the relay does not): the owner sends each step to the first hop's worker and takes its
    result from the last's, sealed with keys it gave the hops' nodes; the nodes only lease
    (renewed by the owner's touches every ``probe_interval_s``) and unbind. False: every step
    through the node agents.
    ``greedy_continuation``: a greedy session on the data plane asks its last hop to send each
    next decode step straight to the first hop (``DataPlaneContinueRequest``), which takes the
    first copy of each step, the last hop's or the owner's: the owner's round trip leaves the
    step's critical path. False: only the owner's steps.
    ``last_hop_draws``: a sampled session continues the same way, its last hop drawing each
    token with the session's parameters and seed (``agent.core.owner.sampling.draw_uniform``:
    the tokens the owner would draw) and returning it with greedy's top-K instead of the full
    row. False: the owner draws, from the full row where there is no top-k cut.
    ``prefill_on_data_plane``: a new session binds its route on the data plane before its first
    step (each hop's node opens it there: ``DataPlaneBindRequest.open_rows``), so that its
    prompt goes worker to worker too, as chunks of ``prefill_chunk_tokens`` rows. False: the
    prompt goes through the node agents and the session binds once it is in the caches.
    ``speculate_tokens``: a greedy session on the data plane drafts up to this many tokens from
    its own context (``agent.core.owner.speculation``) and sends them with its last token as one
    step, which one trip around the route verifies; such a session asks for no continuation.
    0: off.
    ``prefill_chunks_in_flight``: how many of a prompt's chunks the owner sends down the data
    plane before it waits for the first's result: with more than one, hop i computes chunk
    j + 1 while hop i + 1 computes chunk j (pipelined prefill: the time to the first token
    approaches the slowest hop's share of the prompt plus one trip, not the sum of every hop's
    share and every link). 1: one chunk per round trip (e.g. to compare the two).
    ``wire``: the dtype a session's boundary rows travel in between its hops
    (``agent.core.owner.wire_choice``): f32 (bit-identical to one unsplit worker), f16 (F16S: f16
    scaled per row, which carries any model's range) or q8 (within their declared logit bounds,
    ``agent.core.wire.boundary.WIRE_LOGIT_BOUNDS``), or auto:
    f16 on a route whose slowest link (``link_mbit``, the operator's or a benchmark's estimate;
    nothing in the swarm measures it) is below ``wire_f16_below_mbit``, q8 below
    ``wire_q8_below_mbit``, f32 otherwise and when the link is not known. Why 100 and 10: at
    100 Mbit/s a 512-token chunk of a 4096-wide model is 8 MB of f32 rows, 0.7 s a hop, about
    what one consumer GPU takes to compute it; below that the rows, not the compute, set the
    time to the first token, and f16 halves them. Below 10 Mbit/s even f16 rows take several
    times the compute, and q8 takes 0.56 of f16's bytes for a larger declared error.
    ``prefix_block_tokens``: a session whose prompt opens on the data plane names its prompt's
    whole blocks of this many tokens to every hop (``agent.core.owner.prefix_blocks``), asks each
    how many leading ones its prefix cache holds and copies the fewest, so that only the rest
    is prefilled (the copy ends on a ``prefill_chunk_tokens`` boundary: the same tokens as
    without); each hop keeps the blocks when the session ends. 0: never.
    ``prefix_route_tags``: a route request for a prompt names at most this many of its blocks
    (tags of their hashes, the deepest always: ``agent.core.owner.prefix_blocks.route_tags``),
    so that the tracker prefers hops whose caches hold them; 0: none. The hashes are seeded
    with the recipe of the owner's last route of the model: its first route names none.
    """

    request_timeout_s: float = setting(10.0, "limit on one control request (default 10)", parse=cli_args.positive_float)
    session_ended_timeout_s: float = 2.0
    step_timeout_s: float = setting(
        30.0, "limit on waiting for one step's result (default 30)", parse=cli_args.positive_float
    )
    replan_attempts: int = setting(
        3, "new routes one generation may move to after a hop fails (default 3)", parse=cli_args.non_negative_int
    )
    replan_wait_s: float = 20.0
    route_poll_interval_s: float = 0.25
    queue_timeout_s: float = setting(
        60.0,
        "while every sequence of the route is in use, wait this long for one (default 60)",
        parse=cli_args.positive_float,
    )
    prefill_chunk_tokens: int = 64
    step_deadline_factor: float = 10.0
    min_step_deadline_s: float = 1.0
    min_data_plane_step_deadline_s: float = 0.25
    probe_timeout_s: float = 0.5
    probe_attempts: int = 2
    report_grace_s: float = 0.2
    probe_interval_s: float = 1.0
    resume: bool = True
    data_plane: bool = True
    greedy_continuation: bool = True
    last_hop_draws: bool = True
    prefill_on_data_plane: bool = True
    prefill_chunks_in_flight: int = 64
    wire: str = setting(
        "f32", "boundary rows between hops: f32, f16, q8 or auto (by --link-mbit) (default f32)", choices=WIRE_CHOICES
    )
    link_mbit: float = setting(
        0.0,
        "the route's slowest link in Mbit/s, for --wire auto (default 0: unknown, f32)",
        parse=cli_args.non_negative_float,
    )
    wire_f16_below_mbit: float = setting(
        100.0, "--wire auto sends f16 over links slower than this (default 100)", parse=cli_args.positive_float
    )
    wire_q8_below_mbit: float = setting(
        10.0, "--wire auto sends q8 over links slower than this (default 10)", parse=cli_args.positive_float
    )
    prefix_block_tokens: int = 64
    prefix_route_tags: int = 32
    # (0 for a library user and tests; 8 for baton generate)
    speculate_tokens: int = setting(
        0,
        "speculative decoding: a greedy session drafts up to N tokens from its own context and one trip"
        " around the route verifies them, where the measured acceptance and trip times say it pays (default 8; 0: off)",
        parse=cli_args.non_negative_int,
        metavar="N",
        command_default=8,
    )
    # Integrity (agent/io/client/spot_check.py, docs/INTEGRITY.md): the share of sessions replayed
    # through a route of the same recipe around one of their hops and compared bit for bit,
    # how long a session that ended waits for its replay, and how long the tracker may take to
    # say whether a peer of the generation's routes failed a check (tokens computed through one
    # are taken back and generated again; False: never ask).
    # (0 for a library user, tests and the relay, which sets its own; 0.01 for baton generate)
    spot_check_rate: float = setting(
        0.0,
        "chance that the generation is replayed through a second route and compared (default 0.01)",
        parse=cli_args.probability,
        metavar="P",
        command_default=0.01,
    )
    spot_check_grace_s: float = 5.0
    # a new key's invite, where the tracker admits new keys only with one (--require-invites)
    invite: str = setting(
        "", "an invite from the tracker's operator, where the tracker admits new keys only with one (default: none)",
        metavar="TOKEN",
    )  # fmt: skip
    integrity_timeout_s: float = 1.0
    check_route_integrity: bool = True

    def __post_init__(self) -> None:
        for name in (
            "request_timeout_s", "step_timeout_s", "replan_wait_s", "route_poll_interval_s", "queue_timeout_s",
            "step_deadline_factor", "min_step_deadline_s", "min_data_plane_step_deadline_s", "probe_timeout_s", "report_grace_s", "probe_interval_s",
            "spot_check_grace_s", "integrity_timeout_s",
        ):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, got {self.prefill_chunk_tokens}")
        if self.speculate_tokens < 0:
            raise ValueError(f"speculate_tokens must be >= 0, got {self.speculate_tokens}")
        if self.prefill_chunks_in_flight < 1:
            raise ValueError(f"prefill_chunks_in_flight must be >= 1, got {self.prefill_chunks_in_flight}")
        if self.wire not in WIRE_CHOICES:
            raise ValueError(f"wire must be one of {', '.join(WIRE_CHOICES)}, got {self.wire!r}")
        if self.probe_attempts < 1:
            raise ValueError(f"probe_attempts must be >= 1, got {self.probe_attempts}")
        if self.replan_attempts < 0:
            raise ValueError(f"replan_attempts must be >= 0, got {self.replan_attempts}")
        if not 0.0 <= self.spot_check_rate <= 1.0:
            raise ValueError(f"spot_check_rate must be in [0, 1], got {self.spot_check_rate}")
