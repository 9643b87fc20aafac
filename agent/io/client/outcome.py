"""What a generation reports: its errors (``SwarmError``, ``GenerationError``), its result
(``GenerationResult``), the accounting that fills the result as steps complete (``Progress``:
tokens, step times, rows per hop), and routes as reports show them.

Must not import the client's I/O modules (``control``, ``steps``, ``session_run``, ``resume``,
``swarm``): they raise and fill what is defined here. No trio.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from agent._proto import swarm_pb2


class SwarmError(Exception):
    """A peer answered with an error (``code``: a ``swarm_pb2.Error.Code``), or an answer
    could not be used. ``peer_id``: who answered; ``work_bits``: the tracker asks a new
    identity for a proof of work of this many bits (``Error.work_bits``)."""

    def __init__(self, peer_id: str, code: int, message: str, *, work_bits: int = 0) -> None:
        super().__init__(f"{code_name(code)} from {peer_id}: {message}")
        self.peer_id = peer_id
        self.code = code
        self.message = message
        self.work_bits = work_bits


class GenerationError(Exception):
    """A generation failed; ``failed_peer_id`` names the hop at fault ("" if unknown)."""

    def __init__(self, message: str, *, failed_peer_id: str = "", step: int | None = None, code: int = 0) -> None:
        super().__init__(message)
        self.failed_peer_id = failed_peer_id
        self.step = step
        self.code = code  # the swarm_pb2.Error.Code a hop reported (0: none, e.g. a timeout)


@dataclasses.dataclass
class GenerationResult:
    """What ``SwarmClient.generate`` produced.

    ``tokens``: generated token ids (an end-of-generation token that stopped it included);
    ``text``: their text (without that token); ``route``: the hops of the last route used, as
    ``{"node", "begin", "end"}``; ``tokens_per_s``: decode steps per second of step time;
    ``hop_rows``: rows each hop processed, over every route used, as ``{"node", "begin",
    "end", "rows"}`` (the ledger's input); ``context_full``: the route's context filled up
    before the budget was spent; ``stopped_by_caller``: ``on_token`` ended it;
    ``node_rows``: the rows each hop says it computed (its own count, returned when the
    session is ended: a lost hop reports none), as ``hop_rows``;
    ``first_token_s``: from the first step sent to the first token; ``resumes``: how many of
    the ``replans`` replaced a lost hop while the other hops kept their caches (the others
    re-prefilled a new route); ``resume_s``: the time each resume took (lost hop named to
    rebuilt), in order; ``data_plane_steps``: the steps that went worker to worker (the rest
    went through the node agents: prompt chunks, and every step of a route a hop of which has
    no data plane); ``decode_tokens_per_s``: the tokens after the first over ``decode_wall_s``,
    the wall time from the first token to the last (``baton generate --json`` reports it with
    ``first_token_s``, and ``drafted_tokens`` / ``accepted_tokens``, 0 without speculation).
    """

    text: str
    tokens: list[int]
    prompt_tokens: list[int]
    route: list[dict]
    model_sha256: str
    prefill_s: float
    decode_s: float
    decode_steps: int
    stopped_by_token: bool
    replans: int = 0
    hop_rows: list[dict] = dataclasses.field(default_factory=list)
    context_full: bool = False
    stopped_by_caller: bool = False
    first_token_s: float = 0.0
    resumes: int = 0
    resume_s: list[float] = dataclasses.field(default_factory=list)
    node_rows: list[dict] = dataclasses.field(default_factory=list)
    #: tokens taken back (and generated again) because a peer that computed them failed an
    #: integrity check; ``on_token`` had seen them
    tokens_taken_back: int = 0
    data_plane_steps: int = 0
    #: of the data plane steps, those the first hop took from the last hop's greedy
    #: continuation before the owner's own copy came (the first hops' count)
    continued_steps: int = 0
    #: wall time from the first token to the last (the decode's), however many steps or
    #: trips around the route carried the tokens
    decode_wall_s: float = 0.0
    #: prompt tokens the hops copied from their prefix caches instead of computing them
    cached_tokens: int = 0
    #: tokens drafted for speculative decoding, and of them accepted by the route (0: none drafted)
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens after the first over the decode's wall time (0 with one token)."""
        return (len(self.tokens) - 1) / self.decode_wall_s if self.decode_wall_s > 0 and len(self.tokens) > 1 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return len(self.prompt_tokens) / self.prefill_s if self.prefill_s > 0 else 0.0

    def to_json(self) -> dict:
        return {
            "text": self.text,
            "tokens": list(self.tokens),
            "prompt_tokens": len(self.prompt_tokens),
            "route": [dict(hop) for hop in self.route],
            "model_sha256": self.model_sha256,
            "tokens_per_s": self.tokens_per_s,
            "first_token_s": self.first_token_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "stopped_by_token": self.stopped_by_token,
            "replans": self.replans,
            "resumes": self.resumes,
            "data_plane_steps": self.data_plane_steps,
            "continued_steps": self.continued_steps,
            "hop_rows": [dict(hop) for hop in self.hop_rows],
            "node_rows": [dict(hop) for hop in self.node_rows],
        }


def code_name(code: int) -> str:
    try:
        return swarm_pb2.Error.Code.Name(code)
    except ValueError:
        return f"code {code}"


def route_hops(route: swarm_pb2.Route) -> list[dict]:
    """A route's hops as ``{"node": peer id, "begin", "end"}`` (what reports show)."""
    return [{"node": hop.peer_id, "begin": hop.begin, "end": hop.end} for hop in route.hops]


def describe_route(route: swarm_pb2.Route) -> str:
    return " -> ".join(f"{hop.peer_id}[{hop.begin}, {hop.end})" for hop in route.hops)


@dataclasses.dataclass
class Progress:
    """Tokens chosen so far in one generation (over all its sessions), step time, and the rows
    each hop processed."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    data_plane_steps: int = 0
    continued_steps: int = 0
    first_token_s: float = 0.0
    rows: dict[tuple[str, int, int], int] = dataclasses.field(default_factory=dict)
    node_rows: dict[tuple[str, int, int], int] = dataclasses.field(default_factory=dict)
    started_at: float = dataclasses.field(default_factory=time.perf_counter)  # before the first step
    last_token_at: float = 0.0
    first_token_at: float = 0.0  # when the first token was taken (perf_counter)
    latest_token_at: float = 0.0  # when the latest was (last_token_at is reset by prefills)
    cached_tokens: int = 0  # prompt tokens the first session copied from the hops' prefix caches
    drafted_tokens: int = 0  # speculative decoding: tokens drafted, and of them accepted
    accepted_tokens: int = 0

    def add(self, token: int, elapsed_s: float, *, prefill: bool) -> None:
        """A token taken: a prefill's ``elapsed_s`` is its step's (the prompt's chunks, each
        step's own); a decode token counts the wall time since the token before it, the owner's
        own work between the two included (with greedy continuation the next step is under
        way meanwhile: its send-to-result time alone would leave that work out)."""
        now = time.perf_counter()
        if not self.tokens:  # every prefill chunk (and any replan) up to the first token
            self.first_token_s = now - self.started_at
            self.first_token_at = now
        self.latest_token_at = now
        self.tokens.append(token)
        if prefill:
            self.prefill_s += elapsed_s
        else:
            self.decode_s += now - self.last_token_at if self.last_token_at else elapsed_s
            self.decode_steps += 1
        self.last_token_at = 0.0 if prefill else now

    @property
    def decode_wall_s(self) -> float:
        """From the first token to the latest: the decode's wall time (its recoveries included)."""
        return self.latest_token_at - self.first_token_at if self.tokens else 0.0

    def interrupted(self) -> None:
        """A step failed: the next token's time is its own step's (a resume is not decoding)."""
        self.last_token_at = 0.0

    def add_rows(self, route: swarm_pb2.Route, n_rows: int) -> None:
        for hop in route.hops:
            key = (hop.peer_id, hop.begin, hop.end)
            self.rows[key] = self.rows.get(key, 0) + n_rows

    def add_node_rows(self, counted: Sequence[swarm_pb2.SessionRows]) -> None:
        for hop in counted:
            key = (hop.peer_id, hop.begin, hop.end)
            self.node_rows[key] = self.node_rows.get(key, 0) + hop.rows
            if hop.begin == 0:
                self.continued_steps += hop.continued_steps

    def hop_rows_list(self, *, nodes: bool = False) -> list[dict]:
        rows = self.node_rows if nodes else self.rows
        return [{"node": p, "begin": b, "end": e, "rows": n} for (p, b, e), n in rows.items()]
