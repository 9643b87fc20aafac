// Boundary rows on the wire: the byte layouts of worker.proto DType (F32, F16, Q8) and the
// conversions between them and f32 rows, bit for bit what agent/core/wire/boundary.py does, so
// that a session's rows are the same numbers whether a node or a worker sent them.
//
// Q8: a row's values in blocks of kQ8Block (the last one shorter when the row is not a
// multiple); per block its largest |value| (the first of equals) is its outlier, sent as it is,
// the others scaled by d = max|others| / 127. The row: every block's f32 d, every block's f32
// outlier, every block's u8 outlier index, then every value as int8 rint(x / d) (half to even;
// 0 where d is 0 and at the outlier) clamped to [-127, 127]; decoded as q * d in f32, the
// outlier as sent.
// Every step is one f32 IEEE operation (no fused multiply-add can change it).
//
// F16S: each row, first its f32 scale s = 2^k, k = max(0, e - kF16SLimitLog2) where max|x| =
// m * 2^e, m in [0.5, 1) (frexp), then every value as f16 x / s (round to nearest even);
// decoded as f32(h) * s. A power of two divides exactly, so any row's range fits f16 with its 11
// bits (plain F16 refuses a row past 65504: Gemma-3's residual reaches 9.1e4).
#pragma once

#include "shard.h"

#include <cstddef>
#include <cstdint>
#include <string>

namespace baton {

inline constexpr size_t kQ8Block = 32;
inline constexpr int kF16SLimitLog2 = 15;

// Bytes of one Q8 row of row_values values.
size_t q8_row_bytes(size_t row_values);

// Bytes of n_rows rows of row_values values in dtype; 0 for a dtype the worker does not take.
size_t boundary_wire_bytes(BoundaryDType dtype, size_t n_rows, size_t row_values);

// f32 rows (n_rows x row_values, finite) as wire bytes of dtype (F32, F16 or Q8) into *out.
// False (nothing written) for another dtype, or an F16 value out of its range.
bool encode_boundary_rows(const float * rows, size_t n_rows, size_t row_values, BoundaryDType dtype,
                          std::string * out);

// Wire bytes of dtype (boundary_wire_bytes long, need not be aligned) into f32 rows at dst.
// False for a dtype the worker does not take.
bool decode_boundary_rows(const void * data, size_t n_rows, size_t row_values, BoundaryDType dtype, float * dst);

// F16S bytes with a non-finite value or a scale that is not finite at f16's largest value: the
// index of the first such value (a bad scale: its row's first), or -1.
int64_t find_non_finite_f16s(const void * data, size_t n_rows, size_t row_values);

// Q8 bytes whose decoded values could be non-finite (a scale that is NaN, Inf, or so large that
// 128 of it overflows; an outlier that is not finite) or whose outlier index is past its block:
// the index (row * row_values + column) of the first value of the first such block, or -1.
int64_t find_non_finite_q8(const void * data, size_t n_rows, size_t row_values);

}  // namespace baton
