"""Greedy generation of one sequence, as a state machine the shell drives.

Owns: which rows a step sends (the prompt at prefill, then the last token), which token
comes next (argmax of the last row's logits), and when to stop (a stop token or the token
budget). The shell sends ``next_input()`` through the workers and hands the last range's
output to ``accept()``.

Pure: no I/O, clocks or randomness (sampling with a seeded generator belongs to the relay).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from agent.core.owner.parity import greedy_token
from agent.core.wire.worker_records import SeqInput, SeqOutput

__all__ = ["GreedyGeneration"]


class GreedyGeneration:
    """Greedy decoding of ``prompt`` as sequence ``seq_id``, at most ``max_new_tokens`` tokens.

    Loop: ``while not gen.finished: out = <forward gen.next_input()>; gen.accept(out)``.
    """

    def __init__(
        self,
        seq_id: int,
        prompt: Sequence[int],
        max_new_tokens: int,
        stop_tokens: Iterable[int] = (),
        *,
        top_k: int = 0,
    ) -> None:
        if not prompt:
            raise ValueError("the prompt has no tokens")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.seq_id = seq_id
        self.prompt_len = len(prompt)
        self.max_new_tokens = max_new_tokens
        self.stop_tokens = frozenset(stop_tokens)
        # > 0: ask the last range for the top-K only (greedy needs K >= 1: its first entry is
        # the argmax, lowest id on ties, as greedy_token of the full row)
        self.top_k = top_k
        self.tokens: list[int] = list(prompt)
        self.n_cached = 0  # tokens[:n_cached] are in the workers' caches
        self.stopped_by_token = False

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def finished(self) -> bool:
        return self.stopped_by_token or len(self.generated) >= self.max_new_tokens

    def next_input(self) -> SeqInput:
        """The rows not yet in the workers' caches, as a first-range entry."""
        if self.finished:
            raise ValueError(f"seq {self.seq_id}: generation is finished")
        return SeqInput(
            seq_id=self.seq_id,
            positions=range(self.n_cached, len(self.tokens)),
            token_ids=self.tokens[self.n_cached :],
            top_k=self.top_k,
        )

    def accept(self, output: SeqOutput) -> int:
        """Take the last range's output for ``next_input()``; return the chosen token."""
        if output.seq_id != self.seq_id:
            raise ValueError(f"output for seq {output.seq_id} given to seq {self.seq_id}")
        if output.top:
            token = int(output.top[-1].ids[0])
        elif output.logits is None or output.logits.shape[0] < 1:
            raise ValueError(f"seq {self.seq_id}: the output carries no logits")
        else:
            token = greedy_token(output.logits[-1])
        self.n_cached = len(self.tokens)
        self.tokens.append(token)
        if token in self.stop_tokens:
            self.stopped_by_token = True
        return token
