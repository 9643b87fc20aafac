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

__all__ = ["DraftIndex", "DraftLength"]


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
    """How many tokens to draft for the next step, from how the last drafts fared.

    A draft wholly accepted doubles the next (up to ``max_tokens``): copying tends to go on. A
    draft cut short drafts one more than was kept: the match was that good. A draft of which
    nothing was kept still cost the route its rows, so after ``misses_to_pause`` of them in a
    row drafting pauses for ``pause_tokens`` tokens, doubling each time it is found wanting
    again (up to ``max_pause_tokens``), and comes back at one token.
    """

    max_tokens: int
    misses_to_pause: int = 2
    pause_tokens: int = 4
    max_pause_tokens: int = 64
    #: the next draft's length
    tokens: int = 0
    misses: int = 0
    paused_for: int = 0  # tokens left to decode without a draft
    next_pause: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.tokens == 0:
            self.tokens = max(1, self.max_tokens // 2)
        if self.next_pause == 0:
            self.next_pause = self.pause_tokens

    def wanted(self, budget: int) -> int:
        """The next draft's length, at most ``budget`` (0: no draft this step)."""
        if self.paused_for > 0:
            return 0
        return max(0, min(self.tokens, budget))

    def decoded_without_draft(self, tokens: int = 1) -> None:
        """``tokens`` were decoded by a step that carried no draft (paused, or no match)."""
        self.paused_for = max(0, self.paused_for - tokens)

    def observe(self, drafted: int, accepted: int) -> None:
        """A verification step kept ``accepted`` of its ``drafted`` tokens."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted {accepted} of {drafted} drafted")
        if drafted == 0:
            return
        if accepted == drafted:
            self.tokens = min(self.max_tokens, 2 * self.tokens)
            self.misses = 0
            self.next_pause = self.pause_tokens
        elif accepted > 0:
            self.tokens = min(self.max_tokens, accepted + 1)
            self.misses = 0
        else:
            self.tokens = 1
            self.misses += 1
            if self.misses >= self.misses_to_pause:
                self.paused_for = self.next_pause
                self.next_pause = min(self.max_pause_tokens, 2 * self.next_pause)
                self.misses = 0
