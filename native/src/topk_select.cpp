// topk_select: see topk_select.h.
#include "topk_select.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "llama.h"
#include "shard.h"

namespace baton {

bool parse_top_k_in_graph(const std::string & text, TopKInGraph * mode) {
    if (text == "auto") {
        *mode = TopKInGraph::kAuto;
    } else if (text == "on") {
        *mode = TopKInGraph::kOn;
    } else if (text == "off") {
        *mode = TopKInGraph::kOff;
    } else {
        return false;
    }
    return true;
}

bool top_k_in_graph_enabled(TopKInGraph mode, const std::string & backend, int32_t gpu_layers) {
    switch (mode) {
        case TopKInGraph::kOn:
            return true;
        case TopKInGraph::kOff:
            return false;
        case TopKInGraph::kAuto:
            break;
    }
    return backend != "CPU" && gpu_layers != 0;
}

uint32_t graph_top_k_for(const std::vector<ForwardEntry> & entries, uint32_t n_vocab) {
    uint32_t k = 0;
    for (const ForwardEntry & e : entries) {
        if (e.top_k == 0) {
            return 0;
        }
        k = std::max(k, std::min(e.top_k, n_vocab));
    }
    return k;
}

bool order_graph_candidates(const int32_t * cand_ids, const float * cand_logits, const float * cand_probs,
                            size_t n, size_t k, int32_t * ids_out, float * values_out, double * lse) {
    k = std::min(k, n);
    std::vector<size_t> order(n);
    for (size_t j = 0; j < n; ++j) {
        if (std::isnan(cand_logits[j])) {
            return false;
        }
        order[j] = j;
    }
    // select_top_k's order; the ids are distinct, so this order is total and k of n suffice
    auto better = [&](size_t a, size_t b) {
        return cand_logits[a] > cand_logits[b] || (cand_logits[a] == cand_logits[b] && cand_ids[a] < cand_ids[b]);
    };
    std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(), better);
    const size_t best = order[0];
    const double peak = static_cast<double>(cand_logits[best]);
    if (!std::isfinite(peak)) {
        *lse = peak;
    } else {
        const float p = cand_probs[best];
        if (std::isnan(p)) {
            return false;  // the softmax saw a NaN elsewhere in the row
        }
        // p = 1 / sum(exp(x - max)) rounded to float: lse = max + log(sum)
        *lse = peak - std::log(static_cast<double>(p));
    }
    for (size_t j = 0; j < k; ++j) {
        ids_out[j] = cand_ids[order[j]];
        values_out[j] = cand_logits[order[j]];
    }
    return true;
}

ShardStatus read_graph_top_k(llama_context * ctx, int32_t batch_index, size_t row, uint32_t seq_id,
                             uint32_t logit_row, ForwardOutput * o) {
    const llama_token * cand_ids = nullptr;
    const float * cand_logits = nullptr;
    const float * cand_probs = nullptr;
    const int32_t n = llama_get_logits_top_k_ith(ctx, batch_index, &cand_ids, &cand_logits, &cand_probs);
    const std::string where = "row " + std::to_string(logit_row) + " of seq " + std::to_string(seq_id);
    if (n < static_cast<int32_t>(o->top_k) || n <= 0) {
        return ShardStatus::Internal("no in-graph top-k for " + where);
    }
    const size_t k = o->top_k;
    std::vector<int32_t> ids(k);
    std::vector<float> values(k);
    double lse = 0.0;
    if (!order_graph_candidates(cand_ids, cand_logits, cand_probs, static_cast<size_t>(n), k, ids.data(),
                                values.data(), &lse)) {
        return ShardStatus::Internal("the logits of " + where + " hold a NaN: no top-k");
    }
    // little-endian hosts only, as the rest of the wire
    std::memcpy(&o->top_token_ids[row * k * sizeof(int32_t)], ids.data(), k * sizeof(int32_t));
    std::memcpy(&o->top_logits[row * k * sizeof(float)], values.data(), k * sizeof(float));
    o->log_sum_exp[row] = lse;
    return ShardStatus::Ok();
}

}  // namespace baton
