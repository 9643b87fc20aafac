"""The relay's authentication and quotas: who sends a request (``authenticate``: a key's
name, limits and prefix salt from the ``Authorization: Bearer`` header, or the anonymous
pseudo-key's; the salts are ``agent.core.relay.prefix_salt``'s) and whether it may run now
(``admit``: the quota decision is ``agent.core.relay.quotas``'; 401 and 429 are raised as
``ApiError``), what it may spend once its prompt is known (``reserve``: its tokens
held against the key's day while it runs) and what it is charged when it ends (``settle``).

Must not import the relay's app, completions or server.
"""

from __future__ import annotations

import dataclasses

from starlette.requests import Request

from agent.core.relay import quotas
from agent.core.relay.openai_api import ApiError
from agent.core.relay.prefix_salt import anonymous_salt, key_salt

from .state import RelayState

__all__ = ["ANONYMOUS", "Principal", "admit", "authenticate", "reserve", "settle"]

ANONYMOUS = "anonymous"


@dataclasses.dataclass
class Principal:
    """Who sends a request: a key's name and limits, or the anonymous pseudo-key; and the salt
    of its prompts' prefix block hashes (whose cached prefixes it may reuse)."""

    name: str
    limits: quotas.KeyLimits
    prefix_salt: bytes


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def authenticate(state: RelayState, request: Request) -> Principal:
    key = _bearer(request)
    if key is None:
        if state.config.anonymous_tokens_per_day > 0:
            limits = quotas.KeyLimits(state.config.anonymous_tokens_per_day, None, None)
            return Principal(ANONYMOUS, limits, anonymous_salt(state.store.prefix_salt_secret))
        raise ApiError(
            401,
            "You didn't provide an API key. Send it in the Authorization header (Bearer auth): "
            "'Authorization: Bearer YOUR_KEY'; keys are made with 'baton relay keys add'.",
        )
    record = state.store.authenticate(key)
    if record is None:
        raise ApiError(401, "Incorrect API key provided.")
    if record.revoked:
        raise ApiError(401, f"The API key '{record.name}' has been revoked.")
    salt = key_salt(state.store.prefix_salt_secret, record.key_sha256, shareable=record.shareable_prefixes)
    return Principal(record.name, record.limits, salt)


def admit(state: RelayState, principal: Principal) -> None:
    """Check and take a quota slot for one request. Raises ApiError 429."""
    now = state.now_s()
    decision = quotas.decide(
        principal.limits,
        tokens_today=state.store.tokens_on(principal.name, quotas.day_of(now)) + state.reserved.get(principal.name, 0),
        request_times_s=state.store.requests_since(principal.name, now - 60.0),
        concurrent=state.concurrent.get(principal.name, 0),
        now_s=now,
    )
    if not decision.admitted:
        raise ApiError(429, decision.message, code=decision.limit, retry_after_s=decision.retry_after_s)
    state.store.record_request(principal.name, now)


def reserve(state: RelayState, principal: Principal, prompt_tokens: int, max_tokens: int) -> quotas.TokenBudget:
    """Hold an admitted request's prompt + ``max_tokens`` (capped by the tokens left) against its
    key's day until ``settle``. Raises ApiError 429 when the prompt leaves no token to generate."""
    now = state.now_s()
    budget = quotas.budget_tokens(
        principal.limits,
        tokens_today=state.store.tokens_on(principal.name, quotas.day_of(now)),
        tokens_reserved=state.reserved.get(principal.name, 0),
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        now_s=now,
    )
    if isinstance(budget, quotas.QuotaDecision):
        raise ApiError(429, budget.message, code=budget.limit, retry_after_s=budget.retry_after_s)
    state.reserved[principal.name] = state.reserved.get(principal.name, 0) + budget.reserved_tokens
    return budget


def settle(
    state: RelayState,
    principal: Principal,
    budget: quotas.TokenBudget,
    prompt_tokens: int,
    completion_tokens: int,
    *,
    client_left: bool,
) -> None:
    """Release a request's hold and charge what it used (``quotas.charged_tokens``), once, however
    it ended: a stream the client closed is charged the tokens it was sent."""
    state.reserved[principal.name] -= budget.reserved_tokens
    if not state.reserved[principal.name]:
        del state.reserved[principal.name]
    charged = quotas.charged_tokens(prompt_tokens, completion_tokens, client_left=client_left)
    if any(charged):
        state.store.add_usage(principal.name, quotas.day_of(state.now_s()), *charged)
