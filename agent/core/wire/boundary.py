"""Boundary codec: rows of a boundary tensor (numpy) <-> the bytes a worker sends.

Owns the wire layout of tensors crossing a range edge and of logits: row-major
``[n_rows, width]``, little-endian, float32 (``DTYPE_F32``), float16 (``DTYPE_F16``) or
8-bit blocks (``DTYPE_Q8``: see ``encode_q8``), float16 scaled per row (``DTYPE_F16S``: see
``encode_f16s``), and each lossy dtype's declared error bound
(``WIRE_LOGIT_BOUNDS``). Conversion is whole-array (``np.frombuffer`` / ``tobytes``), never
per element in Python. The worker (native/src/wire_codec.cpp) encodes and decodes the same
bytes, bit for bit.

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
    "WIRE_LOGIT_BOUNDS",
    "BoundaryError",
    "BoundarySchema",
    "WireDType",
    "check_boundary_schema",
    "decode_rows",
    "encode_rows",
    "itemsize",
    "wire_bytes",
]


class BoundaryError(ValueError):
    """Rows or bytes that do not match the boundary layout; the message says what is wrong."""


class WireDType(enum.IntEnum):
    """Element type of rows on the wire; values equal ``baton.worker.v1.DType``."""

    UNSPECIFIED = 0
    F32 = 1
    F16 = 2
    Q8 = 3  # blocks of Q8_BLOCK values: a float32 scale and outlier each, int8 values (encode_q8)
    F16S = 4  # float16 with a power-of-two float32 scale per row (encode_f16s): any row's range


#: F16S scales a row down by a power of two until its largest value is below 2^15, half of
#: float16's range (plain F16 refuses a row past 65504: Gemma-3's residual holds 9.1e4 at block
#: 11); a power of two divides exactly, so every value keeps float16's 11 bits.
F16S_LIMIT_LOG2 = 15


#: Values per Q8 block (the last block of a row may be shorter). Why blocks and not one scale a
#: row: a residual row's values differ by orders of magnitude across channels; one scale a row
#: would round most of them to a step of the row's max / 127. 32 as ggml's q8_0; the scale is f32
#: (q8_0's is f16) so that no row's range can overflow or underflow it, and each block sends its
#: largest value as it is (``encode_q8``), for 9/32 byte a value over the int8s.
Q8_BLOCK = 32

#: The declared error bound of each lossy wire dtype a session may choose: the largest max
#: |logit difference| against F32 boundaries (bit-identical to one unsplit worker) that a route
#: may show. It grows with the prompt: through 3-hop splits of SmolLM2-135M (cuts 10, 20) and
#: Gemma-3-270M (cuts 4, 11), 4 sequences of about 40 tokens, 32 greedy steps
#: (tests/test_parity_wire.py) gave F16S 1.30 and 1.26, Q8 1.30 and 1.65; prompts of 40 to 2,000
#: tokens (bench/results/wire_bounds.md) up to 2.57 (F16S, at 2,000) and 3.87 (Q8, at 1,500) on Gemma-3; a
#: 1,500-token prompt through the lab (bench/results/wan_wire.md) 3.24 (F16S) and 4.35 (Q8) on
#: SmolLM2. Declared: about 2x the largest (room for other prompts and another CPU's kernel
#: order). For scale: on this CPU build the same F32 rows computed in chunks of other sizes move
#: a logit by up to 0.8 (SmolLM2) and 1.1 (Gemma-3) on a 700-token prompt. docs/PERFORMANCE.md,
#: "Boundaries sized for the link", has the rest. Plain F16 (the V4 tests' dtype) has no bound
#: here: it refuses rows past 65504 (Gemma-3's).
WIRE_LOGIT_BOUNDS: dict[int, float] = {WireDType.F16S: 6.5, WireDType.Q8: 9.0}


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
_Q8_CODE = int(WireDType.Q8)
_F16S_CODE = int(WireDType.F16S)
_F16 = np.dtype("<f2")
_SCALE = np.dtype("<f4")
_I8 = np.dtype("i1")


_F32_WIRE = _NUMPY_WIRE[WireDType.F32]
#: bytes per element of each wire dtype, by its number (the hot path's lookup)
WIRE_ITEMSIZE = {int(wire): numpy_dtype.itemsize for wire, numpy_dtype in _NUMPY_WIRE.items()}
_NUMPY_WIRE_BY_NUMBER = {int(wire): numpy_dtype for wire, numpy_dtype in _NUMPY_WIRE.items()}


def _unsupported(dtype: int) -> BoundaryError:
    names = ", ".join(f"{d.name} ({d.value})" for d in WireDType if d != WireDType.UNSPECIFIED)
    return BoundaryError(f"unsupported wire dtype {int(dtype)}: expected one of {names}")


def _wire_numpy_dtype(dtype: int) -> np.dtype:
    try:
        return _NUMPY_WIRE_BY_NUMBER[dtype]
    except (KeyError, TypeError):
        raise _unsupported(dtype) from None


def itemsize(dtype: int) -> int:
    """Bytes per element of F32 or F16. Raises BoundaryError for another dtype (Q8 has no
    fixed size per element: ``wire_bytes``)."""
    return _wire_numpy_dtype(dtype).itemsize


def q8_row_bytes(width: int) -> int:
    """Bytes of one Q8 row of ``width`` values: per block a float32 scale, a float32 outlier
    and its uint8 index, then the int8s."""
    return 9 * -(-width // Q8_BLOCK) + width


def wire_bytes(dtype: int, n_rows: int, width: int) -> int:
    """Bytes of ``n_rows`` rows of ``width`` values in wire ``dtype``.

    Raises:
      BoundaryError: an unsupported dtype (the message names those there are).
    """
    size = WIRE_ITEMSIZE.get(dtype)
    if size is not None:
        return n_rows * width * size
    if dtype == _Q8_CODE:
        return n_rows * q8_row_bytes(width)
    if dtype == _F16S_CODE:
        return n_rows * (4 + 2 * width)
    raise _unsupported(dtype)


def encode_f16s(rows: np.ndarray) -> bytes:
    """F16S bytes of finite float32 ``rows`` ``[n_rows, width]``.

    Each row: its scale ``s = 2^k`` (float32, little-endian), ``k = max(0, e - 15)`` where
    ``max|x| = m * 2^e`` with ``m`` in [0.5, 1) (``frexp``), then every value as float16
    ``x / s`` (round to nearest even). Decoded, a value is ``float32(h) * s``. A row below 2^15
    has ``s = 1``: its values are plain F16's. The worker's encoder gives the same bytes.
    """
    n_rows, width = rows.shape
    _, exponent = np.frexp(np.abs(rows).max(axis=1) if width else np.zeros(n_rows, np.float32))
    scales = np.ldexp(np.float32(1), np.maximum(exponent - F16S_LIMIT_LOG2, 0)).astype(_SCALE)
    out = np.empty((n_rows, 4 + 2 * width), np.uint8)
    out[:, :4] = scales.view(np.uint8).reshape(n_rows, 4)
    out[:, 4:] = (rows / scales[:, None].astype(np.float32)).astype(_F16).view(np.uint8)
    return out.tobytes()


def decode_f16s(data: bytes, n_rows: int, width: int) -> np.ndarray:
    """float32 ``[n_rows, width]`` of F16S bytes (``encode_f16s``); the length is the caller's check."""
    raw = np.frombuffer(data, np.uint8).reshape(n_rows, 4 + 2 * width)
    scales = raw[:, :4].copy().view(_SCALE).astype(np.float32)
    halves = raw[:, 4:].copy().view(_F16).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        return halves * scales


def encode_q8(rows: np.ndarray) -> bytes:
    """Q8 bytes of finite float32 ``rows`` ``[n_rows, width]``.

    Each row: its values in blocks of ``Q8_BLOCK`` (the last one shorter when ``width`` is not a
    multiple); per block its largest |value| (the first of equals) is the block's *outlier*,
    sent as it is, and the others are scaled by ``d = max|others| / 127``. The row's bytes:
    every block's ``d`` (float32, little-endian), every block's outlier (float32), every
    block's outlier index in the block (uint8), then every value as int8 ``q = rint(x / d)``
    (half to even; 0 where ``d`` is 0, and at the outlier), clamped to [-127, 127]. Decoded,
    a value is ``q * d`` (float32), the outlier itself: within ``d / 2``. Why an outlier per
    block: a residual row holds a few channels thousands of times the rest (Gemma-3: 1e4 at
    block 4 where the median is 2); scaled with them, their 31 neighbours would round to 0.
    Every operation is one float32 IEEE operation, so the worker's encoder
    (native/src/wire_codec.cpp) gives the same bytes.
    """
    n_rows, width = rows.shape
    n_blocks = -(-width // Q8_BLOCK)
    padded = np.zeros((n_rows, n_blocks * Q8_BLOCK), np.float32)
    padded[:, :width] = rows
    blocks = padded.reshape(n_rows, n_blocks, Q8_BLOCK)
    index = np.abs(blocks).argmax(axis=2)
    outliers = np.take_along_axis(blocks, index[:, :, None], axis=2)[:, :, 0]
    others = blocks.copy()
    np.put_along_axis(others, index[:, :, None], np.float32(0), axis=2)
    scales = np.abs(others).max(axis=2) / np.float32(127)
    divisor = np.where(scales > 0, scales, np.float32(1))
    with np.errstate(over="ignore", invalid="ignore"):
        q = np.clip(np.rint(others / divisor[:, :, None]), -127, 127).astype(_I8)
    out = np.empty((n_rows, q8_row_bytes(width)), np.uint8)
    out[:, : 4 * n_blocks] = scales.astype(_SCALE).view(np.uint8)
    out[:, 4 * n_blocks : 8 * n_blocks] = outliers.astype(_SCALE).view(np.uint8)
    out[:, 8 * n_blocks : 9 * n_blocks] = index.astype(np.uint8)
    out[:, 9 * n_blocks :] = q.reshape(n_rows, n_blocks * Q8_BLOCK)[:, :width].view(np.uint8)
    return out.tobytes()


def decode_q8(data: bytes, n_rows: int, width: int) -> np.ndarray:
    """float32 ``[n_rows, width]`` of Q8 bytes (``encode_q8``); the length is the caller's check.

    Raises:
      BoundaryError: an outlier index past its block's end.
    """
    n_blocks = -(-width // Q8_BLOCK)
    raw = np.frombuffer(data, np.uint8).reshape(n_rows, q8_row_bytes(width))
    scales = raw[:, : 4 * n_blocks].copy().view(_SCALE).astype(np.float32)
    outliers = raw[:, 4 * n_blocks : 8 * n_blocks].copy().view(_SCALE).astype(np.float32)
    index = raw[:, 8 * n_blocks : 9 * n_blocks].astype(np.int64)
    last = width - (n_blocks - 1) * Q8_BLOCK  # values in the last block
    if n_rows and (index.max(initial=0) >= Q8_BLOCK or index[:, -1].max(initial=0) >= last):
        row, block = np.argwhere((index >= Q8_BLOCK) | ((np.arange(n_blocks) == n_blocks - 1) & (index >= last)))[0]
        raise BoundaryError(f"Q8 row {row}, block {block}: outlier index {index[row, block]} is past the block's end")
    padded = np.zeros((n_rows, n_blocks * Q8_BLOCK), np.float32)
    padded[:, :width] = raw[:, 9 * n_blocks :].view(_I8)
    with np.errstate(over="ignore", invalid="ignore"):
        values = padded.reshape(n_rows, n_blocks, Q8_BLOCK) * scales[:, :, None]
    np.put_along_axis(values, index[:, :, None], outliers[:, :, None], axis=2)
    return values.reshape(n_rows, n_blocks * Q8_BLOCK)[:, :width]


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
      dtype: ``WireDType.F32``, ``F16`` or ``Q8``.
      checked_bytes: the little-endian float32 bytes that ``rows`` views, already checked
        finite where they came in (a worker's reply, a received step): returned as they are
        for F32 when their length is the rows', so a hop's rows pass on as bytes, not checked
        and copied again. Anything else is encoded and checked as without them.

    Returns:
      ``wire_bytes(dtype, n_rows, width)`` bytes, row-major, little-endian.

    Raises:
      BoundaryError: rows are not 2-D, not float32, not ``width`` wide, hold NaN/Inf, or
        overflow float16 when encoding to F16.
    """
    wire = _F32_WIRE if dtype in (_Q8_CODE, _F16S_CODE) else _wire_numpy_dtype(dtype)
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
    if (
        checked_bytes is not None
        and dtype not in (_Q8_CODE, _F16S_CODE)
        and rows.dtype == wire == _F32_WIRE
        and len(checked_bytes) == rows.nbytes
    ):
        return checked_bytes
    where = _first_non_finite(rows)
    if where is not None:
        raise BoundaryError(f"rows hold a non-finite value {rows[where]} at row {where[0]}, column {where[1]}")
    if dtype == _Q8_CODE:
        return encode_q8(rows)
    if dtype == _F16S_CODE:
        return encode_f16s(rows)
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

    F32 data is returned as a read-only zero-copy view of ``data``; F16 and Q8 data are
    converted into a new float32 array.

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
    if n_rows < 0 or width <= 0:
        raise BoundaryError(f"bad shape [{n_rows}, {width}]: need n_rows >= 0 and width > 0")
    if dtype == _Q8_CODE:
        expected = n_rows * q8_row_bytes(width)
        if len(data) != expected:
            raise BoundaryError(
                f"got {len(data)} bytes, expected {expected} bytes = {n_rows} Q8 rows x {q8_row_bytes(width)} bytes"
                f" ({width} values in blocks of {Q8_BLOCK}, a float32 scale each)"
            )
        rows = decode_q8(data, n_rows, width)
        return _checked(rows) if check_finite else rows
    if dtype == _F16S_CODE:
        expected = n_rows * (4 + 2 * width)
        if len(data) != expected:
            raise BoundaryError(
                f"got {len(data)} bytes, expected {expected} bytes = {n_rows} F16S rows x {4 + 2 * width} bytes"
                f" (a float32 scale, then {width} float16 values)"
            )
        rows = decode_f16s(data, n_rows, width)
        return _checked(rows) if check_finite else rows
    wire = _wire_numpy_dtype(dtype)
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
    return _checked(rows) if check_finite else rows


def _checked(rows: np.ndarray) -> np.ndarray:
    where = _first_non_finite(rows)
    if where is not None:
        raise BoundaryError(f"decoded rows hold a non-finite value {rows[where]} at row {where[0]}, column {where[1]}")
    return rows
