// Row math of a range that gives logits: select_top_k, log_sum_exp, exp_shifted (shard.h).
// Pure functions on float rows, bit-for-bit the same on every x86-64 machine; split from
// shard.cpp because they need neither llama.cpp nor a context.
#include "shard.h"

#include "sampling.h"
#include "sha256.h"

#include "llama.h"
#include "llama-ext.h"  // llama_get_memory_breakdown (C++, exported)

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>
#include <sstream>
#include <thread>
#include <unordered_set>

#ifndef BATON_LLAMA_COMMIT
#define BATON_LLAMA_COMMIT "unknown"
#endif
#ifndef BATON_PATCH_SERIES_SHA256
#define BATON_PATCH_SERIES_SHA256 "unknown"
#endif

namespace baton {

// (pairwise_sum, numpy's pairwise summation: sampling.h, where the last hop's draw sums alike)

namespace {

// select_top_k's blocks: whether any of x[0, n) is above bar or NaN (!(v <= bar) is both). A
// branch-free reduction, so that it vectorizes (the AVX2 clone eight values at a time); the
// answer does not depend on the variant.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
bool any_above_or_nan(const float * x, size_t n, float bar) {
    int hit = 0;
    for (size_t i = 0; i < n; ++i) {
        hit |= !(x[i] <= bar);
    }
    return hit != 0;
}

}  // namespace

bool select_top_k(const float * row, size_t n, size_t k, int32_t * ids, float * values) {
    k = std::min(k, n);
    // A heap of the k best so far, the worst on top. Ids rise during the scan, so a later
    // value equal to the worst kept one loses the tie: only a strictly greater value enters.
    struct Item {
        float value;
        int32_t id;
    };
    auto better = [](const Item & a, const Item & b) { return a.value > b.value || (a.value == b.value && a.id < b.id); };
    std::vector<Item> heap;
    heap.reserve(k);
    auto scan = [&](size_t begin, size_t end) {
        for (size_t i = begin; i < end; ++i) {
            const float v = row[i];
            if (std::isnan(v)) {
                return false;
            }
            if (heap.size() < k) {
                heap.push_back({v, static_cast<int32_t>(i)});
                std::push_heap(heap.begin(), heap.end(), better);
            } else if (v > heap.front().value) {
                std::pop_heap(heap.begin(), heap.end(), better);
                heap.back() = {v, static_cast<int32_t>(i)};
                std::push_heap(heap.begin(), heap.end(), better);
            }
        }
        return true;
    };
    if (!scan(0, k)) {
        return false;
    }
    // Once the heap is full, a block with no value above the worst kept one and no NaN changes
    // nothing (the bar only rises): skip it after one vectorized test. A logit row's top-40 is
    // settled early, so nearly every block of a 49,152-entry row is skipped so.
    constexpr size_t kBlock = 64;
    for (size_t b = k; b < n; b += kBlock) {
        const size_t e = std::min(n, b + kBlock);
        if (any_above_or_nan(row + b, e - b, heap.front().value) && !scan(b, e)) {
            return false;
        }
    }
    std::sort(heap.begin(), heap.end(), better);
    for (size_t j = 0; j < k; ++j) {
        ids[j] = heap[j].id;
        values[j] = heap[j].value;
    }
    return true;
}

namespace {

// exp_shifted's constants: ln 2 split in two (fdlibm's: kLn2Hi has 32 significant bits, so
// k * kLn2Hi is exact for |k| < 2^11), and 1.5 * 2^52, which rounds a double to an integer in
// its low mantissa bits when added.
constexpr double kLog2e = 1.4426950408889634074;
constexpr double kLn2Hi = 6.93147180369123816490e-01;
constexpr double kLn2Lo = 1.90821492927058770002e-10;
constexpr double kShifter = 0x1.8p52;
constexpr int64_t kShifterBits = 0x4338000000000000LL;
constexpr double kExpUnderflow = -708.0;

// pairwise_sum of exp(a[i] - peak), the terms made a leaf (<= 128 values) at a time: the same
// sums in the same order as pairwise_sum over all the terms, with no n-long buffer.
double pairwise_exp_sum(const float * a, size_t n, double peak) {
    if (n <= 128) {
        double terms[128];
        exp_shifted(a, n, peak, terms);
        return pairwise_sum(terms, n);
    }
    size_t n2 = n / 2;
    n2 -= n2 % 8;
    return pairwise_exp_sum(a, n2, peak) + pairwise_exp_sum(a + n2, n - n2, peak);
}

}  // namespace

// Straight-line code, so that the compiler vectorizes it (libm's exp is one call per value:
// a 49,152-entry row took ~0.4 ms, once per row and step at the last hop). On x86-64 the AVX2
// clone and the baseline compute the same operations in the same order, without FMA (the
// worker core is built with -ffp-contract=off), so every machine gets the same bits.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define BATON_EXP_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define BATON_EXP_CLONES  // other targets: one variant, vectorized for the build's own ISA
#endif
BATON_EXP_CLONES void exp_shifted(const float * x, size_t n, double shift, double * out) {
    for (size_t i = 0; i < n; ++i) {
        const double v = static_cast<double>(x[i]) - shift;
        const double clamped = std::max(v, kExpUnderflow);  // 2^k stays a normal number
        const double kd = clamped * kLog2e + kShifter;
        const double k = kd - kShifter;                           // round(clamped / ln 2)
        const double r = (clamped - k * kLn2Hi) - k * kLn2Lo;     // |r| <= ~ln 2 / 2
        // exp(r) by its Taylor series to r^13 / 13! (the next term is below 2^-60 for |r| <= 0.35)
        double p = 1.0 / 6227020800.0;
        p = p * r + 1.0 / 479001600.0;
        p = p * r + 1.0 / 39916800.0;
        p = p * r + 1.0 / 3628800.0;
        p = p * r + 1.0 / 362880.0;
        p = p * r + 1.0 / 40320.0;
        p = p * r + 1.0 / 5040.0;
        p = p * r + 1.0 / 720.0;
        p = p * r + 1.0 / 120.0;
        p = p * r + 1.0 / 24.0;
        p = p * r + 1.0 / 6.0;
        p = p * r + 0.5;
        p = p * r + 1.0;
        p = p * r + 1.0;
        int64_t kd_bits;
        std::memcpy(&kd_bits, &kd, sizeof kd_bits);
        const int64_t scale_bits = (kd_bits - kShifterBits + 1023) << 52;  // 2^k
        double scale;
        std::memcpy(&scale, &scale_bits, sizeof scale);
        out[i] = p * scale * static_cast<double>(v >= kExpUnderflow);  // 0 below; NaN stays NaN
    }
}

namespace {

double log_sum_exp_at(const float * row, size_t n, double peak) {
    if (!std::isfinite(peak)) {
        return peak;
    }
    return peak + std::log(pairwise_exp_sum(row, n, peak));
}

}  // namespace

double log_sum_exp(const float * row, size_t n) {
    double peak = -std::numeric_limits<double>::infinity();
    for (size_t i = 0; i < n; ++i) {
        peak = std::max(peak, static_cast<double>(row[i]));
    }
    return log_sum_exp_at(row, n, peak);
}

bool top_k_log_sum_exp(const float * row, size_t n, size_t k, int32_t * ids, float * values, double * lse) {
    if (!select_top_k(row, n, k, ids, values)) {
        return false;
    }
    // values[0] is the row's max (no NaN: select_top_k refused it), which log_sum_exp finds
    // by its own scan; a float converts to double exactly, so the peak has the same bits.
    *lse = log_sum_exp_at(row, n, static_cast<double>(values[0]));
    return true;
}


}  // namespace baton
