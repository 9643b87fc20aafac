"""Which wire dtype a session's boundary rows travel in between its hops (``StepRequest.dtype``,
``DataPlaneBindRequest.wire_dtype``): ``choose_wire_dtype``, from the owner's choice
(``baton generate --wire``, the relay's ``--wire``) and, for ``auto``, the route's link
bandwidth.

Why by bandwidth: a boundary row is ``4 * n_embd`` bytes in F32, half that in F16 and about a
quarter (``n_embd + 4 * n_embd / 32``) in Q8. On a fast link those bytes cost nothing next to
the compute, and F32 is bit-identical to one unsplit worker, so it stays the default; on a slow
link a prompt's rows dominate the time to the first token (1,500 tokens of a 576-wide model are
3.5 MB a hop in F32: 1.4 s at 20 Mbit/s), and the lossy dtypes trade a declared logit error
(``agent.core.wire.boundary.WIRE_LOGIT_BOUNDS``) for that time.

Nothing in the swarm measures a link's bandwidth yet (the fingerprint's is a loopback copy), so
``auto`` goes by the estimate it is given (``--link-mbit``: the slowest link of the route, as
its operator or a benchmark measured it); with none it keeps F32.

Pure: no I/O. Must not import trio, grpc, libp2p or agent.io.
"""

from __future__ import annotations

from agent.core.wire.boundary import WireDType

__all__ = ["WIRE_CHOICES", "choose_wire_dtype"]

#: the values of ``--wire``
WIRE_CHOICES = ("f32", "f16", "q8", "auto")

#: "f16" is F16S, float16 scaled per row by a power of two: plain F16 cannot carry every model
#: (Gemma-3's residual reaches 9.1e4, past float16's 65504), F16S carries any row with F16's bits
_FIXED = {"f32": WireDType.F32, "f16": WireDType.F16S, "q8": WireDType.Q8}


def choose_wire_dtype(choice: str, *, link_mbit: float, f16_below_mbit: float, q8_below_mbit: float) -> WireDType:
    """The wire dtype of a session's boundary rows.

    Args:
      choice: ``f32``, ``f16`` (F16S), ``q8`` (that one), or ``auto``: by ``link_mbit``.
      link_mbit: the route's slowest link in Mbit/s; 0 or less: unknown (``auto`` keeps F32).
      f16_below_mbit: ``auto`` takes F16 on a link slower than this.
      q8_below_mbit: ``auto`` takes Q8 on a link slower than this (a lower threshold).

    Raises:
      ValueError: an unknown choice.
    """
    fixed = _FIXED.get(choice)
    if fixed is not None:
        return fixed
    if choice != "auto":
        raise ValueError(f"wire must be one of {', '.join(WIRE_CHOICES)}, got {choice!r}")
    if link_mbit <= 0:
        return WireDType.F32
    if link_mbit < q8_below_mbit:
        return WireDType.Q8
    if link_mbit < f16_below_mbit:
        return WireDType.F16S
    return WireDType.F32
