"""Relay quotas and ledger arithmetic: what an API key may do now, and what a node earned.

Owns:
- ``KeyLimits``: the three limits of one API key (tokens per UTC day, requests per minute,
  requests in flight; ``None`` = unlimited);
- ``decide``: admit or refuse one request from a key's usage, with the limit that refused it,
  a message naming that limit and its value, and how long until it frees (``retry_after_s``);
- UTC days: ``day_of(now_s) -> "YYYY-MM-DD"`` and ``next_day_start_s``;
- ``budget_tokens``: what an admitted request may spend of the key's day (its ``max_tokens``
  capped by the tokens left, counting those held by the key's requests in flight), and
  ``charged_tokens``: what it is charged when it ends, however it ends;
- ``credit_for_hops``: a completion's credit per node, ``rows * (end - begin) / n_layer``.

Pure: ``now_s`` (seconds since the Unix epoch, UTC) is an argument; no clock, randomness or
I/O. Must not import trio, sqlite3 or agent.io. The relay's store (``agent.io.relay.store``)
keeps the usage this module reads; the server performs the decision.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Final, Literal, NamedTuple

__all__ = [
    "ADMITTED",
    "DEFAULT_CONCURRENCY_RETRY_AFTER_S",
    "LIMIT_MAX_CONCURRENT",
    "LIMIT_REQUESTS_PER_MINUTE",
    "LIMIT_TOKENS_PER_DAY",
    "RPM_WINDOW_S",
    "SECONDS_PER_DAY",
    "HopRows",
    "KeyLimits",
    "Limit",
    "NodeCredit",
    "QuotaDecision",
    "TokenBudget",
    "budget_tokens",
    "charged_tokens",
    "credit_for_hops",
    "day_of",
    "decide",
    "next_day_start_s",
    "requests_in_window",
    "tokens_left",
]

SECONDS_PER_DAY = 86_400
#: ``requests_per_minute`` counts the requests of the last ``RPM_WINDOW_S`` seconds.
RPM_WINDOW_S = 60.0
#: A refused concurrent request has no known free time: ask the client to retry this soon.
DEFAULT_CONCURRENCY_RETRY_AFTER_S = 1.0

LIMIT_TOKENS_PER_DAY: Final = "tokens_per_day"
LIMIT_REQUESTS_PER_MINUTE: Final = "requests_per_minute"
LIMIT_MAX_CONCURRENT: Final = "max_concurrent"
Limit = Literal["tokens_per_day", "requests_per_minute", "max_concurrent"]


def _civil_from_days(days: int) -> tuple[int, int, int]:
    """(year, month, day) of ``days`` since 1970-01-01 in the proleptic Gregorian calendar
    (Howard Hinnant's days-to-civil arithmetic: the core reads no calendar module)."""
    z = days + 719468
    era = z // 146097
    doe = z - era * 146097
    yoe = (doe - doe // 1460 + doe // 36524 - doe // 146096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    day = doy - (153 * mp + 2) // 5 + 1
    month = mp + 3 if mp < 10 else mp - 9
    year = yoe + era * 400 + (1 if month <= 2 else 0)
    return year, month, day


@dataclasses.dataclass(frozen=True)
class KeyLimits:
    """The limits of one API key; ``None`` means unlimited, a number must be >= 1.

    A zero limit is refused here on purpose: a key that may do nothing is a revoked key, and
    "anonymous access off" is the server not admitting anonymous requests at all.
    """

    tokens_per_day: int | None = None
    requests_per_minute: int | None = None
    max_concurrent: int | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{field.name} must be an int or None, got {value!r}")
            if value < 1:
                raise ValueError(f"{field.name} must be >= 1 (or None: unlimited), got {value}")

    def as_dict(self) -> dict[str, int | None]:
        """``{"tokens_per_day": ..., "requests_per_minute": ..., "max_concurrent": ...}``."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class QuotaDecision:
    """``admitted``, or refused by ``limit`` with ``message``; retry after ``retry_after_s``."""

    admitted: bool
    limit: Limit | None = None
    message: str = ""
    retry_after_s: float = 0.0


ADMITTED = QuotaDecision(admitted=True)


def _check_now(now_s: float) -> None:
    if not math.isfinite(now_s):
        raise ValueError(f"now_s must be finite, got {now_s!r}")


def day_of(now_s: float) -> str:
    """The UTC day holding ``now_s`` as ``YYYY-MM-DD`` (a day starts at 00:00:00 UTC)."""
    _check_now(now_s)
    year, month, day = _civil_from_days(math.floor(now_s / SECONDS_PER_DAY))
    return f"{year:04d}-{month:02d}-{day:02d}"


def next_day_start_s(now_s: float) -> float:
    """The next 00:00:00 UTC strictly after ``now_s`` (when ``tokens_per_day`` resets)."""
    _check_now(now_s)
    return float((math.floor(now_s / SECONDS_PER_DAY) + 1) * SECONDS_PER_DAY)


def requests_in_window(request_times_s: Sequence[float], now_s: float) -> list[float]:
    """The times in ``(now_s - RPM_WINDOW_S, now_s]``, oldest first (others are ignored)."""
    return sorted(t for t in request_times_s if now_s - RPM_WINDOW_S < t <= now_s)


def tokens_left(limits: KeyLimits, tokens_today: int) -> int | None:
    """Tokens the key may still use today (0 when spent); ``None`` when unlimited.

    A request admitted with a few tokens left may overshoot the limit by its own size; the
    server can cap ``max_tokens`` with this.
    """
    if limits.tokens_per_day is None:
        return None
    return max(0, limits.tokens_per_day - tokens_today)


def decide(
    limits: KeyLimits,
    *,
    tokens_today: int,
    request_times_s: Sequence[float],
    concurrent: int,
    now_s: float,
    concurrency_retry_after_s: float = DEFAULT_CONCURRENCY_RETRY_AFTER_S,
) -> QuotaDecision:
    """Whether a key may start one more request at ``now_s``.

    Args:
      tokens_today: prompt + completion tokens the key used on ``day_of(now_s)``.
      request_times_s: the times of the key's earlier requests (those outside the last
        minute, or after ``now_s``, are ignored), not counting this one.
      concurrent: the key's requests in flight, not counting this one.
      concurrency_retry_after_s: the ``retry_after_s`` of a ``max_concurrent`` refusal.

    Returns:
      ``ADMITTED``, or the refusal whose limit frees last when several limits are reached
      (retrying earlier would be refused again); ties go to tokens, then rpm, then concurrency.
      ``retry_after_s`` > 0: tokens reset at the next UTC midnight; a minute slot frees when
      enough of the window's requests have aged out of it.
    """
    _check_now(now_s)
    refusals: list[QuotaDecision] = []
    if limits.tokens_per_day is not None and tokens_today >= limits.tokens_per_day:
        refusals.append(
            QuotaDecision(
                admitted=False,
                limit=LIMIT_TOKENS_PER_DAY,
                message=(
                    f"tokens_per_day limit of {limits.tokens_per_day} reached "
                    f"({tokens_today} used today; resets at 00:00 UTC)"
                ),
                retry_after_s=next_day_start_s(now_s) - now_s,
            )
        )
    if limits.requests_per_minute is not None:
        window = requests_in_window(request_times_s, now_s)
        if len(window) >= limits.requests_per_minute:
            # Admitted again once only limit - 1 remain: when window[len - limit] ages out.
            frees_at_s = window[len(window) - limits.requests_per_minute] + RPM_WINDOW_S
            refusals.append(
                QuotaDecision(
                    admitted=False,
                    limit=LIMIT_REQUESTS_PER_MINUTE,
                    message=(
                        f"requests_per_minute limit of {limits.requests_per_minute} reached "
                        f"({len(window)} requests in the last minute)"
                    ),
                    retry_after_s=frees_at_s - now_s,
                )
            )
    if limits.max_concurrent is not None and concurrent >= limits.max_concurrent:
        refusals.append(
            QuotaDecision(
                admitted=False,
                limit=LIMIT_MAX_CONCURRENT,
                message=(f"max_concurrent limit of {limits.max_concurrent} reached ({concurrent} requests in flight)"),
                retry_after_s=concurrency_retry_after_s,
            )
        )
    if not refusals:
        return ADMITTED
    latest = max(r.retry_after_s for r in refusals)
    return next(r for r in refusals if r.retry_after_s == latest)


@dataclasses.dataclass(frozen=True)
class TokenBudget:
    """What one admitted request may spend: ``max_tokens`` to generate, and ``reserved_tokens``
    (its prompt + ``max_tokens``) held against the key's day while it runs, so that requests in
    flight together cannot spend more than the key has left."""

    max_tokens: int
    reserved_tokens: int


def budget_tokens(
    limits: KeyLimits,
    *,
    tokens_today: int,
    tokens_reserved: int,
    prompt_tokens: int,
    max_tokens: int,
    now_s: float,
) -> TokenBudget | QuotaDecision:
    """The budget of a request the quota admitted (``decide``), once its prompt is known.

    ``tokens_today``: what the key was charged today; ``tokens_reserved``: what its requests in
    flight hold. ``max_tokens`` is capped by what is left after the prompt; a request whose
    prompt leaves no token to generate is refused (``tokens_per_day``) rather than run to be
    cut at once: before, a key with 100 tokens a day could spend 416.
    """
    _check_now(now_s)
    if prompt_tokens < 1 or max_tokens < 1:
        raise ValueError(f"prompt_tokens and max_tokens must be >= 1, got {prompt_tokens} and {max_tokens}")
    left = tokens_left(limits, tokens_today + tokens_reserved)
    if left is None:
        return TokenBudget(max_tokens, prompt_tokens + max_tokens)
    if left < prompt_tokens + 1:
        held = f", {tokens_reserved} of them held by requests in flight" if tokens_reserved else ""
        return QuotaDecision(
            admitted=False,
            limit=LIMIT_TOKENS_PER_DAY,
            message=(
                f"tokens_per_day limit of {limits.tokens_per_day}: this request needs at least "
                f"{prompt_tokens + 1} tokens (a prompt of {prompt_tokens} and one to generate), "
                f"{left} are left today ({tokens_today + tokens_reserved} used{held}; resets at 00:00 UTC)"
            ),
            retry_after_s=next_day_start_s(now_s) - now_s,
        )
    capped = min(max_tokens, left - prompt_tokens)
    return TokenBudget(capped, prompt_tokens + capped)


def charged_tokens(prompt_tokens: int, completion_tokens: int, *, client_left: bool) -> tuple[int, int]:
    """``(prompt, completion)`` tokens a request is charged when it ends, however it ends.

    Every generated token is charged, also when the client went away mid-stream or the swarm
    failed after it. The prompt is charged once a token was generated (the swarm computed it)
    or when the client chose to leave; a request the swarm failed before its first token costs
    nothing, as a refused one does.
    """
    if prompt_tokens < 0 or completion_tokens < 0:
        raise ValueError(f"token counts must be >= 0, got {prompt_tokens} and {completion_tokens}")
    charged_prompt = prompt_tokens if completion_tokens > 0 or client_left else 0
    return charged_prompt, completion_tokens


# --------------------------------------------------------------------------------------------
# Ledger


class HopRows(NamedTuple):
    """One hop of a completion's route: ``peer_id`` ran ``rows`` token rows through [begin, end)."""

    peer_id: str
    begin: int
    end: int
    rows: int


class NodeCredit(NamedTuple):
    """What one node earned for one completion."""

    peer_id: str
    rows: int
    credit: float


def credit_for_hops(hops: Sequence[tuple[str, int, int, int]], n_layer: int) -> list[NodeCredit]:
    """Each node's rows and credit for one completion, in the order nodes first appear.

    ``hops``: ``(peer_id, begin, end, rows)`` per hop (plain tuples or ``HopRows``). Credit is
    ``rows * (end - begin) / n_layer``: one row through the whole model earns 1. A node that
    served several hops (two ranges, or a range it took over after a failure) gets one entry
    with the sum of its rows and credits.

    Raises:
      ValueError: ``n_layer`` < 1, a range outside ``[0, n_layer)`` or empty, negative rows,
        or an empty peer id.
    """
    if isinstance(n_layer, bool) or not isinstance(n_layer, int) or n_layer < 1:
        raise ValueError(f"n_layer must be an int >= 1, got {n_layer!r}")
    rows_by_peer: dict[str, int] = {}
    row_layers_by_peer: dict[str, int] = {}
    for index, hop in enumerate(hops):
        peer_id, begin, end, rows = hop
        if not isinstance(peer_id, str) or not peer_id:
            raise ValueError(f"hop #{index}: peer_id must be a non-empty str, got {peer_id!r}")
        for name, value in (("begin", begin), ("end", end), ("rows", rows)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"hop #{index}: {name} must be an int, got {value!r}")
        if not 0 <= begin < end <= n_layer:
            raise ValueError(f"hop #{index}: range [{begin}, {end}) is not inside [0, {n_layer})")
        if rows < 0:
            raise ValueError(f"hop #{index}: rows must be >= 0, got {rows}")
        rows_by_peer[peer_id] = rows_by_peer.get(peer_id, 0) + rows
        row_layers_by_peer[peer_id] = row_layers_by_peer.get(peer_id, 0) + rows * (end - begin)
    # One division per node, on exact integers: no rounding accumulates across hops.
    return [NodeCredit(peer, rows_by_peer[peer], row_layers_by_peer[peer] / n_layer) for peer in rows_by_peer]
