"""Argument types and error helpers shared by every ``baton`` command.

Owns: parsing of numbers, layer ranges and cuts from the command line into values (with an
``argparse.ArgumentTypeError`` that says what was wrong), and flattening trio's exception
groups into the leaf errors a command prints.
"""

from __future__ import annotations

import argparse
import math

__all__ = [
    "cuts",
    "layers",
    "leaf_errors",
    "non_negative_float",
    "non_negative_int",
    "positive_float",
    "positive_int",
    "probability",
    "unit_interval",
]


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def probability(text: str) -> float:
    """A number in [0, 1], e.g. a sampling rate."""
    value = float(text)
    if not (math.isfinite(value) and 0 <= value <= 1):
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def unit_interval(text: str) -> float:
    """A number in (0, 1], e.g. top-p."""
    value = float(text)
    if not (math.isfinite(value) and 0 < value <= 1):
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def layers(text: str) -> str:
    """``BEGIN:END`` (checked, returned as given)."""
    from agent.core.wire.ranges import parse_layers

    try:
        parse_layers(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def cuts(text: str) -> list[int]:
    """``C1,C2,...`` cut points."""
    from agent.core.wire.ranges import parse_cuts

    try:
        return parse_cuts(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def leaf_errors(error: BaseException) -> list[BaseException]:
    """The errors inside (nested) exception groups, or ``[error]``."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for sub in error.exceptions for leaf in leaf_errors(sub)]
    return [error]


def known_failures(caught: BaseException, known: tuple[type[BaseException], ...]) -> list[BaseException]:
    """The leaf errors of ``caught`` (what a command reports and exits non-zero on) when each is
    of a ``known`` type. Call it in an ``except BaseException`` block.

    Raises:
      ``caught`` itself: Ctrl-C, SystemExit, or any leaf of an unknown type (a bug: let it show).
    """
    if isinstance(caught, (KeyboardInterrupt, SystemExit)):
        raise caught
    leaves = leaf_errors(caught)
    if not all(isinstance(leaf, known) for leaf in leaves):
        raise caught
    return leaves
