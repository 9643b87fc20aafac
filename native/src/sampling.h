// sampling: drawing a session's next token from one row of logits, at the route's last hop, for
// its owner (worker.proto ContinueSessionRequest.temperature > 0). The rules are the owner's,
// agent/core/owner/sampling.py (draw_token, draw_uniform), followed operation for operation: the
// candidates ordered by logit descending then token id ascending, temperature, the top-k cut,
// the smallest most-likely prefix reaching top_p, one uniform number in [0, 1), the same sums
// in the same order (numpy's pairwise sum where numpy sums, sequential running sums where it
// takes cumsum), and for a whole row with no top-k cut the same stretch-by-stretch ordering.
// Bound: the two pick the same token except where the uniform lies within rounding of a
// boundary between two tokens' stretches (numpy's exp and the C library's differ in the last bit
// of some values); tests/test_sampling_native.py checks equal tokens over many random rows.
//
// Pure: no llama.cpp, gRPC, clocks or randomness (the uniform is an argument). Never throws.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace baton {

// How a session picks tokens (agent/core/owner/sampling.py SamplingParams): temperature 0 is
// greedy; top_k 0 and top_p 1 switch those cuts off.
struct SamplingParams {
    double temperature = 0.0;
    uint32_t top_k = 0;
    double top_p = 1.0;
};

// "" when the parameters are usable, else why not (naming the field): a finite temperature
// >= 0, top_p in (0, 1].
std::string check_sampling_params(const SamplingParams & params);

// The uniform number in [0, 1) that draws a session's token at `position`: the
// (position + 1)-th output of a SplitMix64 stream seeded with `seed`, its top 53 bits over 2^53
// (agent/core/owner/sampling.py draw_uniform: the same bits). position >= 0.
double draw_uniform(uint64_t seed, int64_t position);

// numpy's pairwise summation of doubles (numpy/_core/src/umath/loops_utils.h.src,
// DOUBLE_pairwise_sum): 8 partial sums up to 128 values, halves (multiples of 8) above. The
// same bits as numpy's sum of a contiguous float64 array.
double pairwise_sum(const double * a, size_t n);

// The token for one row of n logits (draw_token of the full row): greedy is the argmax (lowest
// id on ties) and ignores `uniform`. False, with *error, for a row that is empty, holds a NaN
// or +inf or only -inf, or bad parameters or uniform.
bool draw_token(const float * row, size_t n, const SamplingParams & params, double uniform, int32_t * token,
                std::string * error);

// The same from a top-K record (draw_token of agent.core.wire.topk.TopLogits): ids and logits
// of the k most likely of a row of n_vocab, already in candidate order (select_top_k's). Exact
// for top_k cuts <= k, or k == n_vocab; otherwise false, with *error (the row is needed).
bool draw_token_top_k(const int32_t * ids, const float * logits, size_t k, size_t n_vocab,
                      const SamplingParams & params, double uniform, int32_t * token, std::string * error);

}  // namespace baton
