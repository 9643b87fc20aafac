"""Unit tests of the boundary codec (agent.core.wire.boundary): round trips and every refusal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from agent.core.wire.boundary import (
    WIRE_LOGIT_BOUNDS,
    BoundaryError,
    WireDType,
    decode_rows,
    encode_rows,
    itemsize,
    wire_bytes,
)

pytestmark = pytest.mark.worker


def _rows(n_rows: int = 3, width: int = 8, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n_rows, width)).astype(np.float32)


def test_f32_round_trip_is_exact_and_little_endian_row_major() -> None:
    rows = _rows()
    data = encode_rows(rows, 8)
    assert len(data) == 3 * 8 * 4
    # The wire layout is little-endian float32, row-major: the first 4 bytes are rows[0, 0].
    assert data[:4] == np.array([rows[0, 0]], dtype="<f4").tobytes()
    assert data[4 * 8 : 4 * 9] == np.array([rows[1, 0]], dtype="<f4").tobytes()
    back = decode_rows(data, 3, 8)
    assert back.dtype == np.float32
    assert back.shape == (3, 8)
    np.testing.assert_array_equal(back, rows)


def test_f32_encode_accepts_non_contiguous_rows() -> None:
    rows = _rows(4, 16)[:, ::2]
    assert not rows.flags.c_contiguous
    np.testing.assert_array_equal(decode_rows(encode_rows(rows, 8), 4, 8), rows)


def test_f32_decode_is_zero_copy_and_read_only() -> None:
    data = encode_rows(_rows(), 8)
    back = decode_rows(data, 3, 8)
    assert not back.flags.writeable


def test_empty_batch_round_trips() -> None:
    rows = np.zeros((0, 8), dtype=np.float32)
    assert encode_rows(rows, 8) == b""
    assert decode_rows(b"", 0, 8).shape == (0, 8)


def test_f16_round_trip_within_half_precision() -> None:
    rows = _rows(5, 32)
    data = encode_rows(rows, 32, WireDType.F16)
    assert len(data) == 5 * 32 * 2
    assert data[:2] == np.array([rows[0, 0]], dtype="<f2").tobytes()
    back = decode_rows(data, 5, 32, WireDType.F16)
    assert back.dtype == np.float32
    np.testing.assert_allclose(back, rows, rtol=1e-3, atol=1e-3)
    # Values that f16 represents exactly survive exactly.
    exact = np.array([[0.5, -2.0, 1024.0, 0.0]], dtype=np.float32)
    np.testing.assert_array_equal(decode_rows(encode_rows(exact, 4, WireDType.F16), 1, 4, WireDType.F16), exact)


def test_f16_encode_accepts_float16_rows() -> None:
    rows = _rows(2, 4).astype(np.float16)
    back = decode_rows(encode_rows(rows, 4, WireDType.F16), 2, 4, WireDType.F16)
    np.testing.assert_array_equal(back, rows.astype(np.float32))


def test_itemsize() -> None:
    assert itemsize(WireDType.F32) == 4
    assert itemsize(WireDType.F16) == 2
    with pytest.raises(BoundaryError, match="unsupported wire dtype"):
        itemsize(WireDType.UNSPECIFIED)


def test_wire_dtype_values_match_the_proto() -> None:
    # Values are fixed by protocol/worker.proto (DTYPE_F32 = 1, DTYPE_F16 = 2, DTYPE_Q8 = 3).
    assert (WireDType.UNSPECIFIED, WireDType.F32, WireDType.F16, WireDType.Q8) == (0, 1, 2, 3)


# --- encode refusals -----------------------------------------------------------------------


def test_encode_rejects_wrong_width() -> None:
    with pytest.raises(BoundaryError, match=r"rows are 7 wide, expected width 8"):
        encode_rows(_rows(3, 7), 8)


def test_encode_rejects_wrong_dtype() -> None:
    with pytest.raises(BoundaryError, match=r"dtype float64, expected float32"):
        encode_rows(_rows().astype(np.float64), 8)
    with pytest.raises(BoundaryError, match=r"dtype float16, expected float32"):
        encode_rows(_rows().astype(np.float16), 8, WireDType.F32)
    with pytest.raises(BoundaryError, match=r"dtype int32"):
        encode_rows(np.zeros((2, 8), dtype=np.int32), 8)


def test_encode_rejects_wrong_rank_and_type() -> None:
    with pytest.raises(BoundaryError, match=r"must be 2-D .* got shape \(8,\)"):
        encode_rows(np.zeros(8, dtype=np.float32), 8)
    with pytest.raises(BoundaryError, match=r"must be a numpy array, got list"):
        encode_rows([[0.0] * 8], 8)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_encode_rejects_non_finite(bad: float) -> None:
    rows = _rows()
    rows[2, 5] = bad
    with pytest.raises(BoundaryError, match=r"non-finite value .* at row 2, column 5"):
        encode_rows(rows, 8)
    with pytest.raises(BoundaryError, match=r"non-finite value .* at row 2, column 5"):
        encode_rows(rows, 8, WireDType.F16)


def test_encode_f16_rejects_overflow() -> None:
    rows = _rows()
    rows[1, 3] = 1e6  # finite in f32, inf in f16
    with pytest.raises(BoundaryError, match=r"row 1, column 3 is out of float16 range"):
        encode_rows(rows, 8, WireDType.F16)


@pytest.mark.parametrize("dtype", [WireDType.UNSPECIFIED, 7])
def test_encode_and_decode_reject_unsupported_dtype(dtype: int) -> None:
    with pytest.raises(BoundaryError, match=rf"unsupported wire dtype {int(dtype)}: expected one of F32 \(1\)"):
        encode_rows(_rows(), 8, dtype)
    with pytest.raises(BoundaryError, match=rf"unsupported wire dtype {int(dtype)}"):
        decode_rows(b"\0" * 96, 3, 8, dtype)


# --- decode refusals -----------------------------------------------------------------------


def test_decode_rejects_wrong_length_and_says_what_it_got() -> None:
    data = encode_rows(_rows(3, 8), 8)
    with pytest.raises(
        BoundaryError, match=r"got 96 bytes \(24 float32 values\), expected 128 bytes = 4 rows x 8 values x 4 bytes"
    ):
        decode_rows(data, 4, 8)
    with pytest.raises(BoundaryError, match=r"got 96 bytes \(24 float32 values\), expected 72 bytes = 3 rows x 6"):
        decode_rows(data, 3, 6)
    with pytest.raises(BoundaryError, match=r"got 95 bytes \(not a whole number of float32 values\), expected 96"):
        decode_rows(data[:-1], 3, 8)
    with pytest.raises(BoundaryError, match=r"got 96 bytes \(48 float16 values\), expected 32 bytes"):
        decode_rows(data, 2, 8, WireDType.F16)


def test_decode_rejects_bad_shape() -> None:
    with pytest.raises(BoundaryError, match=r"bad shape \[-1, 8\]"):
        decode_rows(b"", -1, 8)
    with pytest.raises(BoundaryError, match=r"bad shape \[1, 0\]"):
        decode_rows(b"", 1, 0)


def test_decode_rejects_non_finite_unless_told_not_to() -> None:
    values = np.zeros((2, 4), dtype="<f4")
    values[1, 2] = np.nan
    with pytest.raises(BoundaryError, match=r"non-finite value nan at row 1, column 2"):
        decode_rows(values.tobytes(), 2, 4)
    back = decode_rows(values.tobytes(), 2, 4, check_finite=False)
    assert np.isnan(back[1, 2])
    half = np.array([[np.inf, 0.0]], dtype="<f2")
    with pytest.raises(BoundaryError, match=r"non-finite value inf at row 0, column 0"):
        decode_rows(half.tobytes(), 1, 2, WireDType.F16)


def test_core_imports_no_io() -> None:
    # The pure core (every module of agent.core) must not pull in an I/O framework or the
    # shells, even indirectly. Protobuf messages (agent._proto.*_pb2) are plain records and
    # allowed; the gRPC stubs are not.
    code = (
        "import importlib, pkgutil, sys\n"
        "import agent.core\n"
        "for m in pkgutil.walk_packages(agent.core.__path__, 'agent.core.'):\n"
        "    importlib.import_module(m.name)\n"
        "bad = ['trio', 'grpc', 'libp2p', 'asyncio', 'agent.io', 'agent._proto.worker_pb2_grpc',\n"
        "       'agent._proto.swarm_pb2_grpc']\n"
        "print(','.join(m for m in bad if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_core_sources_import_no_clock_randomness_or_sockets() -> None:
    # Time and random generators are passed in; the core's own imports say so. (Libraries it
    # uses may import such modules internally; that is not the core reaching for them.)
    import ast

    import agent.core

    forbidden = {"time", "random", "socket", "subprocess", "threading", "datetime", "secrets", "os", "trio"}
    core_dir = Path(agent.core.__file__).parent
    offenders = []
    for source in sorted(core_dir.rglob("*.py")):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            offenders += [f"{source.relative_to(core_dir)}: {n}" for n in names if n.split(".")[0] in forbidden]
    assert offenders == []


def test_checked_bytes_pass_as_they_are_only_for_f32_rows_of_their_length() -> None:
    rows = _rows(2, 8)
    data = rows.tobytes()
    assert encode_rows(rows, 8, WireDType.F32, checked_bytes=data) is data  # not copied
    # to F16 the rows are converted whatever bytes come with them
    assert encode_rows(rows, 8, WireDType.F16, checked_bytes=data) == rows.astype("<f2").tobytes()
    # bytes of another length than the rows are not theirs: the rows are encoded
    assert encode_rows(rows, 8, WireDType.F32, checked_bytes=data[:-4]) == data
    # the rows' own shape and dtype are still checked first
    with pytest.raises(BoundaryError, match="expected width 4"):
        encode_rows(rows, 4, WireDType.F32, checked_bytes=data)
    with pytest.raises(BoundaryError, match="expected float32"):
        encode_rows(rows.astype(np.float64), 8, WireDType.F32, checked_bytes=data)


# --- Q8: blocks of 32 values, an f32 scale each ------------------------------------------------

#: Two rows of 40 values (a whole block and one of 8): the bytes native/tests/worker_tests.cpp
#: expects from the worker's encoder too, so the two encoders are checked against one another.
#: Row 0's outliers are -6.29 (block 0, index 0) and 100 (block 1, index 3). Row 1's first block
#: has the outlier 254 at index 10, scale 1.0 and ties (2.5 -> 2, 3.5 -> 4, -2.5 -> -2, 0.5 -> 0,
#: 1.5 -> 2: half to even); its second block is all zeros (scale 0, outlier 0 at index 0).
Q8_EXAMPLE_HEX = (
    "81ee3e3df943833dae47c9c00000c84200030081890099a1a9b1b9c0c8d0d8e0e8f0f8000810182028303840474f575f676f575c62006e73797f"
    "0000803f0000000000007e43000000000a007f0204fe000200000000000000000000000000000000000000000000000000000000000000000000"
)


def q8_example_rows() -> np.ndarray:
    x = (np.arange(40, dtype=np.float32) - 17) * np.float32(0.37)
    x[35], x[3] = 100.0, 0.0
    y = np.zeros(40, np.float32)
    y[:6] = [127, 2.5, 3.5, -2.5, 0.5, 1.5]
    y[10] = 254
    return np.stack([x, y])


def test_q8_bytes_are_the_declared_layout() -> None:
    rows = q8_example_rows()
    data = encode_rows(rows, 40, WireDType.Q8)
    assert data.hex() == Q8_EXAMPLE_HEX
    assert len(data) == wire_bytes(WireDType.Q8, 2, 40) == 2 * (2 * 9 + 40)
    # row 1: scales 1.0 and 0.0, outliers 254 and 0 at 10 and 0, then the int8 values
    row1 = data[58:]
    assert np.frombuffer(row1[:8], "<f4").tolist() == [1.0, 0.0]
    assert np.frombuffer(row1[8:16], "<f4").tolist() == [254.0, 0.0]
    assert list(row1[16:18]) == [10, 0]
    assert np.frombuffer(row1[18:30], "i1").tolist() == [127, 2, 4, -2, 0, 2, 0, 0, 0, 0, 0, 0]
    back = decode_rows(data, 2, 40, WireDType.Q8)
    assert back[0, 0] == rows[0, 0] and back[0, 35] == 100.0 and back[1, 10] == 254.0  # outliers exact


def test_q8_round_trip_within_half_a_step_of_each_block() -> None:
    rows = _rows(6, 100, seed=3) * 10
    rows[2, 7] = 3000.0  # an outlier: sent as it is, its neighbours keep their own step
    back = decode_rows(encode_rows(rows, 100, WireDType.Q8), 6, 100, WireDType.Q8)
    assert back.dtype == np.float32 and back.shape == (6, 100)
    for start in range(0, 100, 32):
        block = np.abs(rows[:, start : start + 32])
        second = np.sort(block, axis=1)[:, -2:-1]  # the largest after the outlier
        assert np.all(
            np.abs(back[:, start : start + 32] - rows[:, start : start + 32]) <= second / 127 / 2 * (1 + 1e-6)
        )
    assert back[2, 7] == 3000.0 and np.abs(back[2, :32] - rows[2, :32]).max() < 0.2  # not 3000's step (~12)
    zero = np.zeros((1, 40), np.float32)
    np.testing.assert_array_equal(decode_rows(encode_rows(zero, 40, WireDType.Q8), 1, 40, WireDType.Q8), zero)


def test_q8_refuses_bad_lengths_and_scales() -> None:
    data = encode_rows(_rows(2, 40), 40, WireDType.Q8)
    with pytest.raises(BoundaryError, match="expected 116 bytes = 2 Q8 rows x 58 bytes"):
        decode_rows(data[:-1], 2, 40, WireDType.Q8)
    bad = bytearray(data)
    bad[0:4] = np.array([np.inf], "<f4").tobytes()
    with pytest.raises(BoundaryError, match="non-finite"):
        decode_rows(bytes(bad), 2, 40, WireDType.Q8)
    bad = bytearray(data)
    bad[17] = 8  # row 0's second block holds 8 values
    with pytest.raises(BoundaryError, match="Q8 row 0, block 1: outlier index 8 is past the block's end"):
        decode_rows(bytes(bad), 2, 40, WireDType.Q8)
    with pytest.raises(BoundaryError, match="non-finite"):
        encode_rows(np.full((1, 40), np.nan, np.float32), 40, WireDType.Q8)


def test_wire_bytes_of_each_dtype() -> None:
    assert wire_bytes(WireDType.F32, 3, 576) == 3 * 576 * 4
    assert wire_bytes(WireDType.F16, 3, 576) == 3 * 576 * 2
    assert wire_bytes(WireDType.Q8, 3, 576) == 3 * (576 + 18 * 9)
    assert wire_bytes(WireDType.F16S, 3, 576) == 3 * (4 + 576 * 2)
    with pytest.raises(BoundaryError, match="expected one of F32 \\(1\\), F16 \\(2\\), Q8 \\(3\\), F16S \\(4\\)"):
        wire_bytes(9, 1, 8)


def test_every_lossy_dtype_declares_a_logit_bound() -> None:
    assert set(WIRE_LOGIT_BOUNDS) == {WireDType.F16S, WireDType.Q8}
    assert 0 < WIRE_LOGIT_BOUNDS[WireDType.F16S] <= WIRE_LOGIT_BOUNDS[WireDType.Q8]


def test_f16s_is_plain_f16_below_2_15_and_scales_a_row_past_it() -> None:
    rows = _rows(2, 8)
    rows[1, 2] = 90685.0  # past f16's 65504, as Gemma-3's residual at block 11
    data = encode_rows(rows, 8, WireDType.F16S)
    assert len(data) == wire_bytes(WireDType.F16S, 2, 8) == 2 * (4 + 16)
    assert np.frombuffer(data[0:4], "<f4")[0] == 1.0 and data[4:20] == rows[0].astype("<f2").tobytes()
    assert np.frombuffer(data[20:24], "<f4")[0] == 4.0  # 90685 < 2^17: scaled by 2^(17 - 15)
    back = decode_rows(data, 2, 8, WireDType.F16S)
    assert np.all(np.abs(back - rows) <= np.abs(rows) * 2.0**-11 + 4.0 * 2.0**-24)
    with pytest.raises(BoundaryError, match="expected 40 bytes = 2 F16S rows x 20 bytes"):
        decode_rows(data[:-2], 2, 8, WireDType.F16S)
