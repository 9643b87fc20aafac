"""Speculative decoding across the route, the owner's half: what to draft and how many.

A greedy session on the data plane may send, instead of one decode row, its last token and k
drafted tokens as one (k+1)-row step (``Session.next_verify_step``). One trip around the route
computes every row; the last hop returns each row's top-K (``DataStep.every_row``); the owner
keeps the drafts the model itself would have chosen, and the model's own token after the last
kept one (``Session.receive_rows``). Each hop cuts the rejected rows away when the next step
arrives (``DataStep.rewind``). A trip then gives between 1 and k+1 tokens, and greedy output is
exactly that of one token a trip: each kept token is the argmax of the row the model computed
for it, with the same tokens before it.

The drafts come from the session's own context (prompt lookup, as llama.cpp's ``lookup`` and
vLLM's n-gram proposer): the tokens that followed the latest earlier occurrence of the
context's last n tokens. It needs no second model, and pays where the output copies its
input (an edited code block, a quoted document, a summary that reuses phrases).

Pure: no clocks, no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from agent.core.owner.session import OwnerStep, Session

__all__ = ["DraftIndex", "DraftLength", "Drafting", "rewinds"]

#: architectures whose workers refuse a rewind: DeepSeek V4's compression windows and indexer
#: are running sums the pinned llama.cpp cannot cut back (beyond a rollback window that is off
#: by default: ``--rollback-positions``)
_NO_REWIND = frozenset({"deepseek4"})


def rewinds(architecture: str) -> bool:
    """Whether a route of ``architecture`` can cut a verification's rejected rows away (an
    unknown architecture, "": not assumed)."""
    return bool(architecture) and architecture not in _NO_REWIND


class DraftIndex:
    """Where each n-gram of a token sequence last occurred, for ``min_ngram <= n <= max_ngram``,
    kept as the sequence grows (``extend``): a draft is then one dictionary look-up per n, not
    a scan of the context (a 2,000-token context is scanned in ~2 ms of Python, a step's
    budget at these speeds).

    Only n-grams followed by a known token are indexed: the context's own last n tokens are
    never their own match.
    """

    def __init__(self, *, min_ngram: int = 2, max_ngram: int = 4) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        # n-gram -> the index of the token that followed its latest occurrence
        self._follower: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to the indexed sequence."""
        for token in tokens:
            self.tokens.append(int(token))
            end = len(self.tokens) - 1  # the new token follows the n-grams that end before it
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._follower[tuple(self.tokens[end - n : end])] = end

    def sync(self, tokens: Sequence[int]) -> None:
        """Index ``tokens``, a sequence that starts with the one indexed so far (a session's
        tokens, which only grow)."""
        if len(tokens) < len(self.tokens):
            raise ValueError(f"the sequence shrank from {len(self.tokens)} to {len(tokens)} tokens")
        self.extend(tokens[len(self.tokens) :])

    def draft(self, max_tokens: int) -> tuple[int, ...]:
        """Up to ``max_tokens`` tokens that followed the latest earlier occurrence of the
        longest suffix of the sequence (``max_ngram`` down to ``min_ngram`` tokens) seen before;
        empty when none was."""
        if max_tokens < 1:
            return ()
        size = len(self.tokens)
        for n in range(min(self.max_ngram, size), self.min_ngram - 1, -1):
            start = self._follower.get(tuple(self.tokens[size - n :]))
            if start is not None:
                return tuple(self.tokens[start : start + max_tokens])
        return ()


@dataclasses.dataclass
class DraftLength:
    """How many tokens to draft for the next step, from how the drafts fared and what trips cost.

    A trip of a verification step with k drafts gives ``1 + a + a^2 + ... + a^k`` tokens on
    average (``a``: the share of drafted tokens the route accepted, counted with ``decay``
    so that the estimate follows the text from copying to free writing and back) and costs
    ``verify_s + row_s * k`` (both measured: the owner's trip of one row, and what each row
    more adds; on a GPU a row more is nearly free, on a CPU it costs about a row's compute).
    A step without a draft costs ``plain_s`` (measured: with the last hop continuing it is one
    link less than the owner's trip). The draft length is the k of the most tokens a second,
    0 when no k beats no draft.

    When no draft pays (or none matched), the session goes on without one for ``plain_run``
    tokens, during which the last hop continues it by itself: a run that grows (doubling up to
    ``max_pause_tokens``) each time a draft is found wanting or none matched, and starts again
    from ``pause_tokens`` after one is kept.
    """

    max_tokens: int
    decay: float = 0.9
    pause_tokens: int = 4
    max_pause_tokens: int = 64
    #: drafted tokens the route accepted, and drafts it cut short (decayed counts; the prior
    #: is one of each: an acceptance of 1/2 until drafts were tried)
    accepted: float = 1.0
    cut_short: float = 1.0
    verify_s: float | None = None  # the owner's trip of one row (a moving average)
    row_s: float | None = None  # what each row more adds to a trip (None: not measured, taken as 0)
    plain_s: float | None = None  # a token without a draft
    next_pause: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.next_pause == 0:
            self.next_pause = self.pause_tokens

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.cut_short)

    def wanted(self, budget: int) -> int:
        """The next draft's length, at most ``budget`` (0: no draft this step)."""
        limit = min(self.max_tokens, budget)
        if limit < 1:
            return 0
        if self.verify_s is None:
            return limit  # nothing measured yet: a draft measures it
        a = self.acceptance
        # (no continued step measured: every step is the owner's trip)
        best, best_rate = 0, 1.0 / (self.plain_s if self.plain_s is not None else self.verify_s)
        tokens = 1.0
        for k in range(1, limit + 1):
            tokens += a**k
            rate = tokens / (self.verify_s + (self.row_s or 0.0) * k)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def plain_run(self) -> int:
        """Tokens to go without a draft (the last hop continuing) before the next look."""
        return self.next_pause

    def no_match(self) -> None:
        """A draft was wanted and the context offered none: the text is not copying now, and
        each look costs the owner's trip once a run (the runs grow as after a failed draft)."""
        self.next_pause = min(self.max_pause_tokens, 2 * self.next_pause)

    def observe(self, drafted: int, accepted: int) -> None:
        """A verification step kept ``accepted`` of its ``drafted`` tokens."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted {accepted} of {drafted} drafted")
        if drafted == 0:
            return
        self.accepted = self.decay * self.accepted + accepted
        self.cut_short = self.decay * self.cut_short + (1 if accepted < drafted else 0)
        if accepted == 0:
            self.next_pause = min(self.max_pause_tokens, 2 * self.next_pause)
        else:
            self.next_pause = self.pause_tokens

    def trip(self, rows: int, seconds: float, *, by_owner: bool) -> None:
        """A decode step of ``rows`` rows took ``seconds`` (from the result before it): one the
        owner sent (``by_owner``: its trip), or one the last hop continued."""
        if not by_owner:
            self.plain_s = _average(self.plain_s, seconds)
        elif rows == 1 or self.verify_s is None:
            self.verify_s = _average(self.verify_s, seconds)
        else:
            self.row_s = max(0.0, _average(self.row_s, (seconds - self.verify_s) / (rows - 1)))


def _average(old: float | None, new: float, weight: float = 0.3) -> float:
    return new if old is None else (1 - weight) * old + weight * new


class Drafting:
    """One session run's speculative decoding: the context's n-gram index (``DraftIndex``), the
    draft length that follows what the route accepted and what its trips cost (``DraftLength``),
    and the runs without a draft, during which the last hop continues the session (the owner
    decides again when a result says the last hop did not send the next step)."""

    def __init__(self, max_tokens: int) -> None:
        self.index = DraftIndex()
        self.length = DraftLength(max_tokens)
        self.plain_until = 0  # no draft before this many generated tokens

    def draft(self, session: Session, *, continued: bool) -> tuple[int, ...]:
        """The draft for the session's next step; empty: a plain decode step (always when the
        last hop sent that step already, ``continued``)."""
        if continued or not session.can_speculate or len(session.generated) < self.plain_until:
            return ()
        want = self.length.wanted(session.max_new_tokens - len(session.generated) - 1)
        if not want:
            return ()
        self.index.sync(session.tokens)
        draft = self.index.draft(want)
        if not draft:
            self.length.no_match()
        return draft

    def plain_run(self, session: Session) -> int:
        """After a step without a draft was chosen: how many steps go without one (0 while a
        run is on)."""
        if len(session.generated) < self.plain_until:
            return 0
        run = self.length.plain_run()
        self.plain_until = len(session.generated) + run
        return run

    def took(self, session: Session, step: OwnerStep, elapsed_s: float, *, by_owner: bool) -> tuple[int, int]:
        """A decode step's result was taken, ``elapsed_s`` after the result before it;
        ``(drafted, accepted)`` tokens of it."""
        self.length.trip(len(step.token_ids), elapsed_s, by_owner=by_owner)
        if not step.every_row:
            return 0, 0
        drafted, accepted = session.last_verified
        self.length.observe(drafted, accepted)
        return drafted, accepted
