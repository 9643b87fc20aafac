"""Layer ranges: contiguous transformer blocks ``[begin, end)`` in global numbering.

Owns the rules for cutting a model into ranges and the ``B:E`` text syntax shared with the
worker binary's ``--layers`` flag (``B:`` and ``B:-1`` mean "to the last block").
Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence

__all__ = ["LayerRange", "check_cover", "format_layers", "parse_cuts", "parse_layers", "ranges_from_cuts"]


@dataclasses.dataclass(frozen=True, order=True)
class LayerRange:
    """Blocks ``[begin, end)``; indices are global (never renumbered)."""

    begin: int
    end: int

    def __post_init__(self) -> None:
        for name in ("begin", "end"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"LayerRange.{name} must be an int, got {value!r}")
        if self.begin < 0:
            raise ValueError(f"LayerRange begin {self.begin} is negative")
        if self.end <= self.begin:
            raise ValueError(f"LayerRange [{self.begin}, {self.end}) is empty: end must be > begin")

    @property
    def n_layers(self) -> int:
        return self.end - self.begin

    @property
    def takes_tokens(self) -> bool:
        """The first range embeds token ids; every other one takes boundary rows."""
        return self.begin == 0

    def gives_logits(self, n_layer: int) -> bool:
        return self.end == n_layer

    def as_list(self) -> list[int]:
        return [self.begin, self.end]

    def __str__(self) -> str:
        return f"{self.begin}:{self.end}"


def _check_n_layer(n_layer: int) -> None:
    if not isinstance(n_layer, int) or isinstance(n_layer, bool) or n_layer < 1:
        raise ValueError(f"n_layer must be a positive int, got {n_layer!r}")


def ranges_from_cuts(n_layer: int, cuts: Iterable[int]) -> list[LayerRange]:
    """Split ``[0, n_layer)`` at ``cuts`` into contiguous ranges.

    ``ranges_from_cuts(30, [10, 20])`` is ``[0:10, 10:20, 20:30]``; no cuts gives the whole
    model as one range.

    Raises:
      ValueError: n_layer is not a positive int, or a cut is not an int, is outside
        ``0 < cut < n_layer``, repeats, or is out of order. The message names the cut.
    """
    _check_n_layer(n_layer)
    cuts = list(cuts)
    for i, cut in enumerate(cuts):
        if not isinstance(cut, int) or isinstance(cut, bool):
            raise ValueError(f"cut #{i} must be an int, got {cut!r}")
        if not 0 < cut < n_layer:
            raise ValueError(f"cut {cut} is out of bounds: cuts must satisfy 0 < cut < n_layer = {n_layer}")
        if i and cut == cuts[i - 1]:
            raise ValueError(f"cut {cut} appears twice: cuts must be unique")
        if i and cut < cuts[i - 1]:
            raise ValueError(f"cuts must be sorted ascending: {cut} comes after {cuts[i - 1]}")
    edges = [0, *cuts, n_layer]
    return [LayerRange(b, e) for b, e in itertools.pairwise(edges)]


def parse_cuts(text: str) -> list[int]:
    """Parse ``"10,20"`` into ``[10, 20]`` (syntax only; see ``ranges_from_cuts`` for the rules).

    An empty string means no cuts.
    """
    text = text.strip()
    if not text:
        return []
    cuts = []
    for part in text.split(","):
        part = part.strip()
        try:
            cuts.append(int(part))
        except ValueError:
            raise ValueError(f"cut {part!r} in {text!r} is not an integer") from None
    return cuts


def parse_layers(text: str, n_layer: int | None = None) -> tuple[int, int | None]:
    """Parse the ``--layers`` syntax: ``"B:E"``, or ``"B:"`` / ``"B:-1"`` for "to the end".

    Returns:
      ``(begin, end)``. ``end`` is None for an open end when ``n_layer`` is not given; with
      ``n_layer`` an open end becomes ``n_layer`` and the range is checked against it, so
      ``LayerRange(*parse_layers(text, n_layer))`` always works.

    Raises:
      ValueError: malformed text, negative begin, ``end <= begin``, or (with n_layer) a
        range past the model's last block.
    """
    if n_layer is not None:
        _check_n_layer(n_layer)
    if not isinstance(text, str) or text.count(":") != 1:
        raise ValueError(f"layers {text!r} must look like BEGIN:END, BEGIN: or BEGIN:-1")
    begin_text, end_text = (part.strip() for part in text.split(":"))
    try:
        begin = int(begin_text)
    except ValueError:
        raise ValueError(f"layers {text!r}: begin {begin_text!r} is not an integer") from None
    if begin < 0:
        raise ValueError(f"layers {text!r}: begin {begin} is negative")
    end: int | None
    if end_text in ("", "-1"):
        end = None
    else:
        try:
            end = int(end_text)
        except ValueError:
            raise ValueError(
                f"layers {text!r}: end {end_text!r} is not an integer (or empty / -1 for the end)"
            ) from None
        if end < 0:
            raise ValueError(f"layers {text!r}: end {end} is negative (only -1 means 'to the end')")
        if end <= begin:
            raise ValueError(f"layers {text!r}: end {end} must be greater than begin {begin}")
    if n_layer is not None:
        if end is None:
            end = n_layer
        if begin >= n_layer:
            raise ValueError(f"layers {text!r}: begin {begin} is past the last block (n_layer = {n_layer})")
        if end > n_layer:
            raise ValueError(f"layers {text!r}: end {end} is past n_layer = {n_layer}")
    return begin, end


def format_layers(begin: int, end: int | None) -> str:
    """The ``--layers`` text for ``[begin, end)``; ``end=None`` means to the last block."""
    return f"{begin}:" if end is None else f"{begin}:{end}"


def check_cover(n_layer: int, ranges: Sequence[LayerRange]) -> None:
    """Raise ValueError unless ``ranges`` tile ``[0, n_layer)`` in order without gaps."""
    _check_n_layer(n_layer)
    expected = 0
    for r in ranges:
        if r.begin != expected:
            raise ValueError(f"range {r} does not start where the previous one ended ({expected})")
        expected = r.end
    if expected != n_layer:
        raise ValueError(f"ranges end at {expected}, not at n_layer = {n_layer}")
