// Boundary rows on the wire (wire_codec.h).
#include "wire_codec.h"

#include "ggml.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace baton {

namespace {

size_t q8_blocks(size_t row_values) { return (row_values + kQ8Block - 1) / kQ8Block; }

void encode_q8_row(const float * x, size_t n, unsigned char * out) {
    const size_t n_blocks = q8_blocks(n);
    int8_t * q = reinterpret_cast<int8_t *>(out + 9 * n_blocks);
    for (size_t b = 0; b < n_blocks; ++b) {
        const size_t begin = b * kQ8Block;
        const size_t end = std::min(n, begin + kQ8Block);
        size_t outlier = begin;  // the first of the largest |values|
        for (size_t i = begin; i < end; ++i) {
            if (std::fabs(x[i]) > std::fabs(x[outlier])) {
                outlier = i;
            }
        }
        float amax = 0.0f;  // of the others
        for (size_t i = begin; i < end; ++i) {
            if (i != outlier) {
                amax = std::max(amax, std::fabs(x[i]));
            }
        }
        const float d = amax / 127.0f;
        std::memcpy(out + 4 * b, &d, sizeof(float));
        std::memcpy(out + 4 * (n_blocks + b), &x[outlier], sizeof(float));
        out[8 * n_blocks + b] = static_cast<unsigned char>(outlier - begin);
        for (size_t i = begin; i < end; ++i) {
            // nearbyint rounds half to even in the default rounding mode, as numpy's rint
            const float r = d > 0.0f && i != outlier ? std::nearbyint(x[i] / d) : 0.0f;
            q[i] = static_cast<int8_t>(std::clamp(r, -127.0f, 127.0f));
        }
    }
}

}  // namespace

size_t q8_row_bytes(size_t row_values) { return 9 * q8_blocks(row_values) + row_values; }

size_t boundary_wire_bytes(BoundaryDType dtype, size_t n_rows, size_t row_values) {
    switch (dtype) {
        case BoundaryDType::kF32: return n_rows * row_values * 4;
        case BoundaryDType::kF16: return n_rows * row_values * 2;
        case BoundaryDType::kQ8: return n_rows * q8_row_bytes(row_values);
        case BoundaryDType::kF16S: return n_rows * (4 + 2 * row_values);
        default: return 0;
    }
}

bool encode_boundary_rows(const float * rows, size_t n_rows, size_t row_values, BoundaryDType dtype,
                          std::string * out) {
    const size_t n_values = n_rows * row_values;
    switch (dtype) {
        case BoundaryDType::kF32:
            out->assign(reinterpret_cast<const char *>(rows), n_values * sizeof(float));
            return true;
        case BoundaryDType::kF16: {
            std::vector<ggml_fp16_t> halves(n_values);
            ggml_fp32_to_fp16_row(rows, halves.data(), static_cast<int64_t>(n_values));
            for (size_t i = 0; i < n_values; ++i) {
                if (!std::isfinite(ggml_fp16_to_fp32(halves[i]))) {
                    return false;  // beyond f16's range
                }
            }
            out->assign(reinterpret_cast<const char *>(halves.data()), n_values * sizeof(ggml_fp16_t));
            return true;
        }
        case BoundaryDType::kF16S: {
            const size_t row_bytes = 4 + 2 * row_values;
            out->assign(n_rows * row_bytes, '\0');
            std::vector<float> scaled(row_values);
            std::vector<ggml_fp16_t> halves(row_values);
            for (size_t r = 0; r < n_rows; ++r) {
                const float * x = rows + r * row_values;
                float amax = 0.0f;
                for (size_t i = 0; i < row_values; ++i) {
                    amax = std::max(amax, std::fabs(x[i]));
                }
                int exponent = 0;
                std::frexp(amax, &exponent);
                const float s = std::ldexp(1.0f, std::max(exponent - kF16SLimitLog2, 0));
                for (size_t i = 0; i < row_values; ++i) {
                    scaled[i] = x[i] / s;
                }
                ggml_fp32_to_fp16_row(scaled.data(), halves.data(), static_cast<int64_t>(row_values));
                char * at = out->data() + r * row_bytes;
                std::memcpy(at, &s, sizeof(float));
                std::memcpy(at + 4, halves.data(), row_values * sizeof(ggml_fp16_t));
            }
            return true;
        }
        case BoundaryDType::kQ8: {
            const size_t row_bytes = q8_row_bytes(row_values);
            out->assign(n_rows * row_bytes, '\0');
            for (size_t r = 0; r < n_rows; ++r) {
                encode_q8_row(rows + r * row_values, row_values, reinterpret_cast<unsigned char *>(out->data()) + r * row_bytes);
            }
            return true;
        }
        default: return false;
    }
}

bool decode_boundary_rows(const void * data, size_t n_rows, size_t row_values, BoundaryDType dtype, float * dst) {
    const size_t n_values = n_rows * row_values;
    const unsigned char * p = static_cast<const unsigned char *>(data);
    switch (dtype) {
        case BoundaryDType::kF32: std::memcpy(dst, p, n_values * sizeof(float)); return true;
        case BoundaryDType::kF16: {
            std::vector<ggml_fp16_t> halves(n_values);  // the request bytes may be unaligned
            std::memcpy(halves.data(), p, n_values * sizeof(ggml_fp16_t));
            ggml_fp16_to_fp32_row(halves.data(), dst, static_cast<int64_t>(n_values));
            return true;
        }
        case BoundaryDType::kF16S: {
            const size_t row_bytes = 4 + 2 * row_values;
            std::vector<ggml_fp16_t> halves(row_values);
            for (size_t r = 0; r < n_rows; ++r) {
                float s;
                std::memcpy(&s, p + r * row_bytes, sizeof(float));
                std::memcpy(halves.data(), p + r * row_bytes + 4, row_values * sizeof(ggml_fp16_t));
                float * out = dst + r * row_values;
                ggml_fp16_to_fp32_row(halves.data(), out, static_cast<int64_t>(row_values));
                for (size_t i = 0; i < row_values; ++i) {
                    out[i] *= s;
                }
            }
            return true;
        }
        case BoundaryDType::kQ8: {
            const size_t n_blocks = q8_blocks(row_values);
            const size_t row_bytes = q8_row_bytes(row_values);
            for (size_t r = 0; r < n_rows; ++r) {
                const unsigned char * row = p + r * row_bytes;
                const int8_t * q = reinterpret_cast<const int8_t *>(row + 9 * n_blocks);
                float * out = dst + r * row_values;
                for (size_t b = 0; b < n_blocks; ++b) {
                    float d;
                    float outlier;
                    std::memcpy(&d, row + 4 * b, sizeof(float));
                    std::memcpy(&outlier, row + 4 * (n_blocks + b), sizeof(float));
                    const size_t end = std::min(row_values, (b + 1) * kQ8Block);
                    for (size_t i = b * kQ8Block; i < end; ++i) {
                        out[i] = static_cast<float>(q[i]) * d;
                    }
                    out[b * kQ8Block + row[8 * n_blocks + b]] = outlier;  // (find_non_finite_q8 took the index)
                }
            }
            return true;
        }
        default: return false;
    }
}

int64_t find_non_finite_f16s(const void * data, size_t n_rows, size_t row_values) {
    const unsigned char * p = static_cast<const unsigned char *>(data);
    const size_t row_bytes = 4 + 2 * row_values;
    for (size_t r = 0; r < n_rows; ++r) {
        float s;
        std::memcpy(&s, p + r * row_bytes, sizeof(float));
        if (!std::isfinite(s * 65504.0f)) {
            return static_cast<int64_t>(r * row_values);
        }
        const int64_t bad = find_non_finite_f16(p + r * row_bytes + 4, row_values);
        if (bad >= 0) {
            return static_cast<int64_t>(r * row_values) + bad;
        }
    }
    return -1;
}

int64_t find_non_finite_q8(const void * data, size_t n_rows, size_t row_values) {
    const unsigned char * p = static_cast<const unsigned char *>(data);
    const size_t n_blocks = q8_blocks(row_values);
    const size_t row_bytes = q8_row_bytes(row_values);
    for (size_t r = 0; r < n_rows; ++r) {
        const unsigned char * row = p + r * row_bytes;
        for (size_t b = 0; b < n_blocks; ++b) {
            float d;
            float outlier;
            std::memcpy(&d, row + 4 * b, sizeof(float));
            std::memcpy(&outlier, row + 4 * (n_blocks + b), sizeof(float));
            const size_t in_block = std::min(kQ8Block, row_values - b * kQ8Block);
            // int8 reaches -128; an index past the block would write past the row
            if (!std::isfinite(d * 128.0f) || !std::isfinite(outlier) || row[8 * n_blocks + b] >= in_block) {
                return static_cast<int64_t>(r * row_values + b * kQ8Block);
            }
        }
    }
    return -1;
}

}  // namespace baton
