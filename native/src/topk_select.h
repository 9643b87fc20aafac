// topk_select: the last range's top-K and log-sum-exp selected inside llama.cpp's graph (patch
// 0010, llama_set_logits_top_k), so that K ids, K logits and K probabilities a row leave the
// device instead of the n_vocab-wide row that select_top_k and log_sum_exp read on the host.
//
// Owns: when a Forward may use the graph (graph_top_k_for), and turning llama's unordered
// candidates into select_top_k's order and a log-sum-exp (order_graph_candidates). The host
// path in shard.cpp stays the reference and the fallback; what differs is stated here.
// Must not include gRPC or protobuf; like Shard, not thread-safe (it reads the context).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

struct llama_context;

namespace baton {

struct ForwardEntry;
struct ForwardOutput;
struct ShardStatus;

// ShardConfig::top_k_in_graph (--top-k-in-graph auto|on|off).
enum class TopKInGraph : int {
    kAuto = 0,  // on when the logits come from an accelerator (top_k_in_graph_enabled)
    kOn = 1,    // also on the CPU backend (tests compare it with the host path there)
    kOff = 2,   // always the host path
};

// "auto", "on", "off" -> *mode; false for anything else.
bool parse_top_k_in_graph(const std::string & text, TopKInGraph * mode);

// Whether a shard selects in the graph. kAuto: when its backend is not "CPU" and it offloads
// layers (gpu_layers != 0; llama.cpp then puts the output head on the accelerator). On the CPU
// the host path's early-exit heap beats ggml_top_k's partial sort of every index.
bool top_k_in_graph_enabled(TopKInGraph mode, const std::string & backend, int32_t gpu_layers);

// The k one Forward asks the graph for: the largest top_k of its entries, clamped to n_vocab,
// so one graph serves entries of different K (each reads its own prefix of the ordered
// candidates). 0 (the full rows, the host path for every entry) when an entry asks for full
// rows: the graph gives one or the other for a whole decode.
uint32_t graph_top_k_for(const std::vector<ForwardEntry> & entries, uint32_t n_vocab);

// n candidates (ids, logits, softmax probabilities over the whole row; any order) -> the k <= n
// best by select_top_k's order (logit descending, id ascending) into ids_out / values_out, and
// the row's log-sum-exp from the best: logit - log(prob), in double. The ids and values are
// select_top_k's, bit for bit, whenever the k-th value is not also held by an id outside the
// candidates (ggml_top_k breaks that tie as it likes). The log-sum-exp comes from the backend's
// float softmax: within kGraphLogSumExpTolerance of log_sum_exp's. A non-finite best logit is
// returned as the log-sum-exp as it is, as log_sum_exp does. Returns false (nothing written
// but scratch) if a logit or the best probability is NaN: a row holding a NaN, as select_top_k
// refuses it.
bool order_graph_candidates(const int32_t * cand_ids, const float * cand_logits, const float * cand_probs,
                            size_t n, size_t k, int32_t * ids_out, float * values_out, double * lse);

// |graph lse - host lse| bound, absolute (logits are O(10), lse O(10)): the f32 sum of the
// softmax, rounded once more to 1/sum, against the host's double sum. Measured on CPU: see
// native/tests (worker_tests.cpp "in-graph top-K").
inline constexpr double kGraphLogSumExpTolerance = 1e-4;

// Row `row` of *o (its logit row logit_row, batch index batch_index) from the last decode's
// in-graph selection: o->top_k entries into top_token_ids / top_logits and log_sum_exp[row],
// which the caller sized. Internal error naming seq_id and logit_row if llama has no
// selection for that batch index or the row holds a NaN.
ShardStatus read_graph_top_k(llama_context * ctx, int32_t batch_index, size_t row, uint32_t seq_id,
                             uint32_t logit_row, ForwardOutput * o);

}  // namespace baton
