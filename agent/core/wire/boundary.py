"""Boundary codec: rows of a boundary tensor (numpy) <-> the bytes a worker sends.

Owns the wire layout of tensors crossing a range edge and of logits: row-major
``[n_rows, width]``, little-endian, float32 (``DTYPE_F32``) or float16 (``DTYPE_F16``).
Conversion is whole-array (``np.frombuffer`` / ``tobytes``), never per element in Python.

Pure: imports numpy only (no grpc, no generated stubs; ``WireDType`` mirrors the proto enum
by value, which ``tests/test_worker_api.py`` checks against the stubs).
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

__all__ = [
    "RESIDUAL",
    "RESIDUAL_STREAMS",
    "BoundaryError",
    "BoundarySchema",
    "WireDType",
    "check_boundary_schema",
    "decode_rows",
    "encode_rows",
    "itemsize",
]


class BoundaryError(ValueError):
    """Rows or bytes that do not match the boundary layout; the message says what is wrong."""


class WireDType(enum.IntEnum):
    """Element type of rows on the wire; values equal ``baton.worker.v1.DType``."""

    UNSPECIFIED = 0
    F32 = 1
    F16 = 2


#: Boundary schema versions (``BoundarySchema.version`` in protocol/worker.proto).
RESIDUAL = 1  # "residual": n_embd values per token
RESIDUAL_STREAMS = 2  # "residual-streams": streams x n_embd per token (hyper-connection models)

_SCHEMA_NAMES = {RESIDUAL: "residual", RESIDUAL_STREAMS: "residual-streams"}


@dataclasses.dataclass(frozen=True)
class BoundarySchema:
    """The layout of one boundary row: ``streams`` residual streams of ``n_embd`` values,
    stream-major, one row per token. Version 1 has one stream; version 2 (DeepSeek V4's
    hyper-connections) has ``hc_mult``."""

    version: int
    streams: int
    n_embd: int

    @property
    def name(self) -> str:
        return _SCHEMA_NAMES.get(self.version, f"unknown-{self.version}")

    @property
    def row_values(self) -> int:
        return self.streams * self.n_embd

    @classmethod
    def declared(cls, version: int, streams: int, n_embd: int) -> BoundarySchema:
        """A schema as a sender declared it; 0 (unset: a sender older than version 2) reads as 1."""
        return cls(version or RESIDUAL, streams or 1, n_embd)

    def __str__(self) -> str:
        plural = "stream" if self.streams == 1 else "streams"
        return f"{self.name}/{self.version} ({self.streams} {plural} x {self.n_embd} values per token)"


def check_boundary_schema(sent: BoundarySchema, expected: BoundarySchema) -> None:
    """Refuse rows of one schema sent to a range that takes another.

    Raises:
      BoundaryError: the versions differ (the message names both schemas) or the stream count
        or width differs.
    """
    if sent.version != expected.version:
        raise BoundaryError(f"boundary rows of schema {sent} sent to a range that takes {expected}")
    if sent.streams != expected.streams:
        raise BoundaryError(
            f"boundary_streams {sent.streams} does not match {expected}, which has {expected.streams} streams"
        )
    if sent.n_embd != expected.n_embd:
        raise BoundaryError(f"boundary rows of {sent.n_embd} values per stream sent to a range that takes {expected}")


_NUMPY_WIRE: dict[WireDType, np.dtype] = {
    WireDType.F32: np.dtype("<f4"),
    WireDType.F16: np.dtype("<f2"),
}


_F32_WIRE = _NUMPY_WIRE[WireDType.F32]
#: bytes per element of each wire dtype, by its number (the hot path's lookup)
WIRE_ITEMSIZE = {int(wire): numpy_dtype.itemsize for wire, numpy_dtype in _NUMPY_WIRE.items()}
_NUMPY_WIRE_BY_NUMBER = {int(wire): numpy_dtype for wire, numpy_dtype in _NUMPY_WIRE.items()}


def _wire_numpy_dtype(dtype: int) -> np.dtype:
    try:
        return _NUMPY_WIRE_BY_NUMBER[dtype]
    except (KeyError, TypeError):
        names = ", ".join(f"{d.name} ({d.value})" for d in _NUMPY_WIRE)
        raise BoundaryError(f"unsupported wire dtype {int(dtype)}: expected one of {names}") from None


def itemsize(dtype: int) -> int:
    """Bytes per element of a wire dtype. Raises BoundaryError for an unsupported one."""
    return _wire_numpy_dtype(dtype).itemsize


def _first_non_finite(rows: np.ndarray) -> tuple[int, int] | None:
    bad = ~np.isfinite(rows)
    if not bad.any():
        return None
    row, col = np.argwhere(bad)[0]
    return int(row), int(col)


def encode_rows(
    rows: np.ndarray, width: int, dtype: int = WireDType.F32, *, checked_bytes: bytes | None = None
) -> bytes:
    """Encode ``rows`` (float32 ``[n_rows, width]``) into wire bytes of ``dtype``.

    Args:
      rows: a 2-D float32 array (float16 is also accepted when encoding to F16).
      width: the row width the receiver expects (``n_embd`` of the boundary schema).
      dtype: ``WireDType.F32`` or ``WireDType.F16``.
      checked_bytes: the little-endian float32 bytes that ``rows`` views, already checked
        finite where they came in (a worker's reply, a received step): returned as they are
        for F32 when their length is the rows', so a hop's rows pass on as bytes, not checked
        and copied again. Anything else is encoded and checked as without them.

    Returns:
      ``n_rows * width * itemsize(dtype)`` bytes, row-major, little-endian.

    Raises:
      BoundaryError: rows are not 2-D, not float32, not ``width`` wide, hold NaN/Inf, or
        overflow float16 when encoding to F16.
    """
    wire = _wire_numpy_dtype(dtype)
    if not isinstance(rows, np.ndarray):
        raise BoundaryError(f"rows must be a numpy array, got {type(rows).__name__}")
    if rows.ndim != 2:
        raise BoundaryError(f"rows must be 2-D [n_rows, {width}], got shape {rows.shape}")
    allowed = (np.float32, np.float16) if wire.itemsize == 2 else (np.float32,)
    if rows.dtype.type not in allowed:
        expected = " or ".join(np.dtype(t).name for t in allowed)
        raise BoundaryError(f"rows have dtype {rows.dtype.name}, expected {expected}")
    if rows.shape[1] != width:
        raise BoundaryError(f"rows are {rows.shape[1]} wide, expected width {width}")
    if checked_bytes is not None and rows.dtype == wire == _F32_WIRE and len(checked_bytes) == rows.nbytes:
        return checked_bytes
    where = _first_non_finite(rows)
    if where is not None:
        raise BoundaryError(f"rows hold a non-finite value {rows[where]} at row {where[0]}, column {where[1]}")
    if rows.dtype == wire:
        return np.ascontiguousarray(rows).tobytes()
    with np.errstate(over="ignore"):
        converted = np.ascontiguousarray(rows, dtype=wire)
    where = _first_non_finite(converted)
    if where is not None:
        raise BoundaryError(
            f"value {rows[where]} at row {where[0]}, column {where[1]} is out of {wire.name} range"
            " (non-finite after conversion)"
        )
    return converted.tobytes()


def decode_rows(
    data: bytes,
    n_rows: int,
    width: int,
    dtype: int = WireDType.F32,
    *,
    check_finite: bool = True,
) -> np.ndarray:
    """Decode wire bytes into a float32 ``[n_rows, width]`` array.

    F32 data is returned as a read-only zero-copy view of ``data``; F16 data is converted
    into a new float32 array.

    Args:
      data: the bytes as received.
      n_rows, width: the expected shape (``width`` is ``n_embd`` for boundary rows,
        ``n_vocab`` for logits).
      dtype: the wire dtype the sender declared.
      check_finite: reject NaN/Inf (boundary rows); pass False for logits, which are
        compared rather than trusted.

    Raises:
      BoundaryError: unsupported dtype, negative shape, a byte length that is not
        ``n_rows * width * itemsize`` or (with check_finite) a NaN/Inf value.
    """
    wire = _wire_numpy_dtype(dtype)
    if n_rows < 0 or width <= 0:
        raise BoundaryError(f"bad shape [{n_rows}, {width}]: need n_rows >= 0 and width > 0")
    expected = n_rows * width * wire.itemsize
    if len(data) != expected:
        if len(data) % wire.itemsize:
            got = f"{len(data)} bytes (not a whole number of {wire.name} values)"
        else:
            got = f"{len(data)} bytes ({len(data) // wire.itemsize} {wire.name} values)"
        raise BoundaryError(
            f"got {got}, expected {expected} bytes = {n_rows} rows x {width} values x {wire.itemsize} bytes"
        )
    rows = np.frombuffer(data, dtype=wire).reshape(n_rows, width)
    if wire != np.float32:
        rows = rows.astype(np.float32)
    if check_finite:
        where = _first_non_finite(rows)
        if where is not None:
            raise BoundaryError(
                f"decoded rows hold a non-finite value {rows[where]} at row {where[0]}, column {where[1]}"
            )
    return rows
