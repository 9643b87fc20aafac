// sampling (sampling.h): agent/core/owner/sampling.py's draw, step for step. Each function
// names the Python it follows; the comments say where the order of operations matters.
#include "sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace baton {

namespace {

// SplitMix64's increment and finaliser multipliers (agent/core/owner/sampling.py _SPLITMIX_*).
constexpr uint64_t kSplitMixGamma = 0x9E3779B97F4A7C15ULL;
constexpr uint64_t kSplitMixM1 = 0xBF58476D1CE4E5B9ULL;
constexpr uint64_t kSplitMixM2 = 0x94D049BB133111EBULL;

// _STRETCH_DROPS: a whole row's candidates are ordered a stretch (of logit / temperature
// below the peak) at a time.
constexpr double kStretchDrops[] = {6.0, 10.0, 16.0, 24.0, std::numeric_limits<double>::infinity()};

// Python's _check_row: one non-empty row, no NaN or +inf, not all -inf.
bool check_row(const float * row, size_t n, std::string * error) {
    if (n == 0) {
        *error = "sampling needs one non-empty logits row";
        return false;
    }
    bool any_finite_or_minus_inf = false;
    bool all_minus_inf = true;
    for (size_t i = 0; i < n; ++i) {
        const float v = row[i];
        if (std::isnan(v) || v == std::numeric_limits<float>::infinity()) {
            *error = "the logits hold NaN or +inf";
            return false;
        }
        any_finite_or_minus_inf = true;
        all_minus_inf = all_minus_inf && v == -std::numeric_limits<float>::infinity();
    }
    if (!any_finite_or_minus_inf || all_minus_inf) {
        *error = "every logit is -inf: no token can be chosen";
        return false;
    }
    return true;
}

// sampling_candidates from the ordered candidates (ids, logit / temperature), then draw_token's
// search: the finite ones kept, softmax from the first (the largest), the top_p prefix, and the
// stretch holding uniform * the last running sum.
// False (nothing finite to draw: Python fails there too) or true with *token.
bool draw_from_candidates(std::vector<int32_t> ids, std::vector<double> values, double top_p, double uniform,
                          int32_t * token) {
    size_t kept = 0;  // keep = np.isfinite(values)
    for (size_t i = 0; i < values.size(); ++i) {
        if (std::isfinite(values[i])) {
            ids[kept] = ids[i];
            values[kept] = values[i];
            ++kept;
        }
    }
    ids.resize(kept);
    values.resize(kept);
    if (kept == 0) {
        return false;
    }
    std::vector<double> probs(kept);
    for (size_t i = 0; i < kept; ++i) {
        probs[i] = std::exp(values[i] - values[0]);
    }
    const double total = pairwise_sum(probs.data(), kept);  // probs /= probs.sum()
    for (double & p : probs) {
        p /= total;
    }
    std::vector<double> cumulative(kept);
    if (top_p < 1.0) {
        std::partial_sum(probs.begin(), probs.end(), cumulative.begin());  // np.cumsum: in order
        size_t cut = static_cast<size_t>(std::lower_bound(cumulative.begin(), cumulative.end(), top_p) -
                                         cumulative.begin()) + 1;
        cut = std::min(cut, kept);
        ids.resize(cut);
        probs.resize(cut);
        cumulative.resize(cut);
        const double cut_total = pairwise_sum(probs.data(), cut);  // probs / probs.sum()
        for (double & p : probs) {
            p = p / cut_total;
        }
    }
    std::partial_sum(probs.begin(), probs.end(), cumulative.begin());
    const double target = uniform * cumulative.back();
    const size_t index =
        static_cast<size_t>(std::upper_bound(cumulative.begin(), cumulative.end(), target) - cumulative.begin());
    *token = ids[std::min(index, ids.size() - 1)];
    return true;
}

// _draw_from_row: a whole row with no top-k cut, ordered only a stretch at a time.
// False when no logit / temperature is finite (Python fails there too), else true with *token.
bool draw_from_row(const float * row, size_t n, const SamplingParams & params, double uniform, int32_t * token) {
    std::vector<double> values;
    std::vector<int32_t> candidates;  // the finite logits' ids (-inf is never drawn)
    values.reserve(n);
    candidates.reserve(n);
    for (size_t i = 0; i < n; ++i) {
        const double scaled = static_cast<double>(row[i]) / params.temperature;
        if (std::isfinite(scaled)) {
            values.push_back(scaled);
            candidates.push_back(static_cast<int32_t>(i));
        }
    }
    if (values.empty()) {
        return false;
    }
    const double peak = *std::max_element(values.begin(), values.end());
    std::vector<double> weights(values.size());
    for (size_t j = 0; j < values.size(); ++j) {
        weights[j] = std::exp(values[j] - peak);
    }
    const double total = pairwise_sum(weights.data(), weights.size());
    const bool by_top_p = params.top_p < 1.0;
    // top_p: the smallest prefix whose weight reaches top_p of the total is kept ("left");
    // without it the draw is over the total ("right")
    const double threshold = by_top_p ? params.top_p * total : uniform * total;
    std::vector<size_t> order;       // indices into values, in draw order
    std::vector<double> cumulative;  // their running sums
    double running = 0.0;
    double upper = std::numeric_limits<double>::infinity();
    for (const double drop : kStretchDrops) {
        const double lower = peak - drop;
        const size_t first = order.size();
        for (size_t j = 0; j < values.size(); ++j) {
            if (values[j] >= lower && values[j] < upper) {
                order.push_back(j);
            }
        }
        upper = lower;
        if (order.size() == first) {
            continue;
        }
        std::sort(order.begin() + static_cast<std::ptrdiff_t>(first), order.end(), [&](size_t a, size_t b) {
            return values[a] > values[b] || (values[a] == values[b] && a < b);  // np.lexsort((taken, -values))
        });
        for (size_t at = first; at < order.size(); ++at) {
            running = running + weights[order[at]];  // np.cumsum of [running, weights...]
            cumulative.push_back(running);
        }
        if (running > threshold || (by_top_p && running == threshold)) {
            break;
        }
    }
    size_t chosen = 0;
    if (by_top_p) {
        size_t cut = static_cast<size_t>(std::lower_bound(cumulative.begin(), cumulative.end(), threshold) -
                                         cumulative.begin()) + 1;
        cut = std::min(cut, order.size());
        const double target = uniform * cumulative[cut - 1];
        const size_t index = static_cast<size_t>(
            std::upper_bound(cumulative.begin(), cumulative.begin() + static_cast<std::ptrdiff_t>(cut), target) -
            cumulative.begin());
        chosen = order[std::min(index, cut - 1)];
    } else {
        const size_t index = static_cast<size_t>(
            std::upper_bound(cumulative.begin(), cumulative.end(), threshold) - cumulative.begin());
        chosen = order[std::min(index, order.size() - 1)];
    }
    *token = candidates[chosen];
    return true;
}

bool check_draw(const SamplingParams & params, double uniform, std::string * error) {
    *error = check_sampling_params(params);
    if (!error->empty()) {
        return false;
    }
    if (params.temperature > 0.0 && !(uniform >= 0.0 && uniform < 1.0)) {
        *error = "a uniform number in [0, 1) is needed";
        return false;
    }
    return true;
}

}  // namespace

std::string check_sampling_params(const SamplingParams & params) {
    if (!std::isfinite(params.temperature) || params.temperature < 0.0) {
        return "temperature must be a finite number >= 0";
    }
    if (!(params.top_p > 0.0 && params.top_p <= 1.0)) {
        return "top_p must be in (0, 1]";
    }
    return "";
}

double draw_uniform(uint64_t seed, int64_t position) {
    uint64_t z = seed + static_cast<uint64_t>(position + 1) * kSplitMixGamma;
    z = (z ^ (z >> 30)) * kSplitMixM1;
    z = (z ^ (z >> 27)) * kSplitMixM2;
    z ^= z >> 31;
    return static_cast<double>(z >> 11) * 0x1.0p-53;
}

double pairwise_sum(const double * a, size_t n) {
    if (n < 8) {
        double res = 0.;
        for (size_t i = 0; i < n; ++i) {
            res += a[i];
        }
        return res;
    }
    if (n <= 128) {
        double r[8];
        for (size_t j = 0; j < 8; ++j) {
            r[j] = a[j];
        }
        size_t i = 8;
        for (; i < n - (n % 8); i += 8) {
            for (size_t j = 0; j < 8; ++j) {
                r[j] += a[i + j];
            }
        }
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; ++i) {
            res += a[i];
        }
        return res;
    }
    size_t n2 = n / 2;
    n2 -= n2 % 8;
    return pairwise_sum(a, n2) + pairwise_sum(a + n2, n - n2);
}

bool draw_token(const float * row, size_t n, const SamplingParams & params, double uniform, int32_t * token,
                std::string * error) {
    if (!check_draw(params, uniform, error) || !check_row(row, n, error)) {
        return false;
    }
    if (params.temperature == 0.0) {  // np.argmax: the first of the largest
        *token = static_cast<int32_t>(std::max_element(row, row + n) - row);
        return true;
    }
    const size_t k = params.top_k;
    if (!(k > 0 && k < n)) {
        if (!draw_from_row(row, n, params, uniform, token)) {
            *error = "no logit over the temperature is finite";
            return false;
        }
        return true;
    }
    // sampling_candidates of a row: the k largest of logit / temperature, ties by the lowest id
    std::vector<double> scaled(n);
    for (size_t i = 0; i < n; ++i) {
        scaled[i] = static_cast<double>(row[i]) / params.temperature;
    }
    std::vector<int32_t> ids(n);
    std::iota(ids.begin(), ids.end(), 0);
    std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(k), ids.end(), [&](int32_t a, int32_t b) {
        return scaled[a] > scaled[b] || (scaled[a] == scaled[b] && a < b);
    });
    ids.resize(k);
    std::vector<double> values(k);
    for (size_t i = 0; i < k; ++i) {
        values[i] = scaled[ids[i]];
    }
    if (!draw_from_candidates(std::move(ids), std::move(values), params.top_p, uniform, token)) {
        *error = "no logit over the temperature is finite";
        return false;
    }
    return true;
}

bool draw_token_top_k(const int32_t * ids, const float * logits, size_t k, size_t n_vocab,
                      const SamplingParams & params, double uniform, int32_t * token, std::string * error) {
    if (!check_draw(params, uniform, error)) {
        return false;
    }
    if (k == 0 || k > n_vocab) {
        *error = "a top-k record of " + std::to_string(k) + " entries for a vocabulary of " + std::to_string(n_vocab);
        return false;
    }
    if (params.temperature == 0.0) {  // ordered: the first is the argmax
        *token = ids[0];
        return true;
    }
    const size_t cut = params.top_k;
    if (cut == 0 && k < n_vocab) {
        *error = "sampling without a top-k cut needs the full row, got only the top " + std::to_string(k);
        return false;
    }
    if (cut > k && k < n_vocab) {
        *error = "top_k " + std::to_string(cut) + " needs at least " + std::to_string(cut) + " logits, got the top " +
                 std::to_string(k);
        return false;
    }
    const size_t used = cut != 0 ? std::min(cut, k) : k;
    std::vector<int32_t> candidate_ids(ids, ids + used);
    std::vector<double> values(used);
    for (size_t i = 0; i < used; ++i) {
        values[i] = static_cast<double>(logits[i]) / params.temperature;
    }
    if (!draw_from_candidates(std::move(candidate_ids), std::move(values), params.top_p, uniform, token)) {
        *error = "no top-k logit over the temperature is finite";
        return false;
    }
    return true;
}

}  // namespace baton
