"""Unit tests of the boundary codec (agent.core.wire.boundary): round trips and every refusal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from agent.core.wire.boundary import (
    BoundaryError,
    WireDType,
    decode_rows,
    encode_rows,
    itemsize,
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
    # Values are fixed by protocol/worker.proto (DTYPE_F32 = 1, DTYPE_F16 = 2).
    assert (WireDType.UNSPECIFIED, WireDType.F32, WireDType.F16) == (0, 1, 2)


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
