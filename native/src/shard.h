// Shard: one loaded layer range [layer_begin, layer_end) of one GGUF, its llama_context (KV
// cache for n_seq_max sequences) and the per-sequence position bookkeeping; or, vocab-only,
// just the GGUF's vocabulary (no tensors, no context: tokenizer calls only).
//
// Owns: the llama_model / llama_context / llama_batch lifetimes (RAII), the rules a Forward
// request must satisfy (pure free functions below, testable without a model), and the
// rollback of a failed decode. Knows nothing about gRPC or protobuf: service.cpp translates.
//
// Not thread-safe: a llama_context must be used by one thread at a time. In the worker, every
// non-const call runs on the Engine's one thread (engine.h). info() is immutable after
// construction and active_sequences() is atomic, so both may be read from any thread.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "prefix_cache.h"
#include "topk_select.h"

struct llama_model;
struct llama_context;
struct llama_vocab;

namespace baton {

// ---------------------------------------------------------------------------------------------
// Errors: a code (mapped 1:1 onto grpc::StatusCode by the service) and a message that names
// the entry / sequence and what was wrong.

enum class ErrorCode {
    kOk = 0,
    kInvalidArgument,
    kResourceExhausted,
    kFailedPrecondition,
    kInternal,
};

struct ShardStatus {
    ErrorCode code = ErrorCode::kOk;
    std::string message;

    bool ok() const { return code == ErrorCode::kOk; }
    static ShardStatus Ok() { return {}; }
    static ShardStatus Invalid(std::string m) { return {ErrorCode::kInvalidArgument, std::move(m)}; }
    static ShardStatus Exhausted(std::string m) { return {ErrorCode::kResourceExhausted, std::move(m)}; }
    static ShardStatus Internal(std::string m) { return {ErrorCode::kInternal, std::move(m)}; }
    static ShardStatus Precondition(std::string m) { return {ErrorCode::kFailedPrecondition, std::move(m)}; }
};

// Wire dtype of boundary rows; values equal baton.worker.v1.DType.
enum class BoundaryDType : int {
    kUnspecified = 0,
    kF32 = 1,
    kF16 = 2,
    kQ8 = 3,    // 8-bit blocks with an f32 scale each (wire_codec.h)
    kF16S = 4,  // f16 with a power-of-two f32 scale per row (wire_codec.h)
};

// Bytes per element of F32 or F16, 0 for another dtype (Q8 has no fixed size per element:
// wire_codec.h boundary_wire_bytes).
size_t boundary_dtype_size(BoundaryDType dtype);

// ---------------------------------------------------------------------------------------------
// Configuration and static description.

struct ShardConfig {
    std::string model_path;
    int32_t layer_begin = 0;
    int32_t layer_end = -1;           // -1: to the last block
    uint32_t ctx_size_per_seq = 4096; // positions one sequence may hold
    uint32_t max_sequences = 4;       // n_seq_max: sequence ids are [0, max_sequences)
    uint32_t batch_size = 512;        // rows one Forward may carry (n_batch = n_ubatch)
    int32_t threads = 0;              // 0: std::thread::hardware_concurrency()
    // Threads of a Forward whose micro-batch is one row (llama.cpp's n_threads; larger ones take
    // `threads`, llama.cpp's n_threads_batch); 0: `threads`. The numbers do not depend on it.
    int32_t threads_decode = 0;
    int32_t gpu_layers = -1;          // llama.cpp n_gpu_layers; -1: all
    bool use_mmap = true;
    // llama_context_params.n_rs_seq: rollback snapshots per sequence. A model whose cached
    // state cannot be cut back (DeepSeek V4's compressor state) can then be trimmed by at
    // most this many positions, once per sequence until it decodes again; 0: not at all.
    uint32_t rollback_positions = 0;
    std::string model_sha256;         // hex; empty: computed from the file at load (not vocab-only)
    // Load only the vocabulary (llama_model_params.vocab_only): no tensor is read, so a
    // metadata-only sparse GGUF serves; the layer range and the context fields are unused,
    // and an empty model_sha256 stays empty (the file is not hashed).
    bool vocab_only = false;
    // When set and it becomes true, loading stops (through llama's progress callback) and
    // the constructor throws ShardLoadError. Not owned; must outlive the constructor call.
    const std::atomic<bool> * cancel_load = nullptr;
    // Where a last range selects a Forward's top-K and log-sum-exp (topk_select.h): inside
    // llama.cpp's graph, so that only K values a row leave the device, or from the full rows on
    // the host. kAuto: the graph on an accelerator, the host on the CPU.
    TopKInGraph top_k_in_graph = TopKInGraph::kAuto;
    // The prefix cache (prefix_cache.h): at most this many bytes of KV for spare sequences that
    // keep ended sessions' prompt prefixes; 0: off. Each spare is one whole sequence of the
    // non-unified cache (its share of kv_bytes), so the spares are this divided by that, capped
    // by max_sequences_limit(); none for a model whose cache cannot be cut back (DeepSeek V4).
    uint64_t prefix_cache_bytes = 0;
};

// A boundary schema (BoundarySchema in worker.proto): version 1 "residual" (n_embd per
// row) or version 2 "residual-streams" (streams x n_embd per row, hyper-connection models).
struct BoundarySchemaDesc {
    uint32_t version = 1;
    uint32_t streams = 1;
    uint32_t n_embd = 0;

    uint32_t row_values() const { return streams * n_embd; }
    const char * name() const;
    // "residual/1 (1 stream x 64 f32 per token)": what refusals name
    std::string describe() const;
    // "residual/1", "residual-streams/2": the recipe's schema part
    std::string recipe_tag() const;
};

// The schema of a model: version 2 with `streams` streams when the GGUF says the model keeps
// hyper-connection streams (<arch>.hyper_connection.count > 1), version 1 otherwise.
BoundarySchemaDesc boundary_schema_for(uint32_t hc_streams, uint32_t n_embd);

// What Forward checks a boundary entry's declared schema against (0 = unset = 1).
ShardStatus check_boundary_schema(size_t entry, uint32_t seq_id, const BoundarySchemaDesc & expected,
                                  uint32_t declared_version, uint32_t declared_streams);

// What a loaded shard is; mirrors InfoReply. Immutable after load.
struct ShardInfo {
    std::string architecture;
    uint32_t n_layer = 0;
    uint32_t n_embd = 0;
    uint32_t n_vocab = 0;
    uint32_t layer_begin = 0;
    uint32_t layer_end = 0;
    bool takes_tokens = false;
    bool gives_logits = false;
    BoundarySchemaDesc boundary;         // the model's boundary schema (both edges)
    std::string recipe_hash;
    std::string model_sha256;
    std::string llama_cpp_commit;
    std::string patch_series_sha256;
    std::string backend;
    uint64_t weight_bytes = 0;
    uint64_t weight_buffer_bytes = 0;
    uint64_t kv_bytes = 0;
    uint32_t n_ctx_per_sequence = 0;
    uint32_t n_seq_max = 0;
    uint32_t n_batch_max = 0;
    std::string model_path;
    uint32_t n_threads = 0;
    uint32_t n_threads_decode = 0;       // a one-row micro-batch's (ShardConfig::threads_decode)
    std::vector<int32_t> eog_token_ids;  // end-of-generation tokens (EOS, EOT)
    bool vocab_only = false;             // then only architecture, n_vocab, eog ids, model path,
                                         // the build's fields and a given model_sha256 are set
    uint64_t vocabulary_piece_bytes = 0; // sum of every token's piece length (sizes the Vocabulary reply)
    // The prefix cache: spare sequences (ids n_seq_max .. n_seq_max + spares - 1, given to no
    // session) and the KV bytes they hold (within ShardConfig::prefix_cache_bytes; in kv_bytes).
    uint32_t prefix_cache_sequences = 0;
    uint64_t prefix_cache_bytes = 0;
    std::string prefix_cache_off_reason;  // why there are none although bytes were given
};

// The whole vocabulary (mirrors VocabularyReply): per token id, its piece
// (llama_token_to_piece with lstrip 0 and special false) and llama_token_attr flags.
struct ShardVocabulary {
    std::vector<std::string> pieces;
    std::vector<uint32_t> attrs;
    int32_t bos_token_id = -1;           // -1: none
    bool add_bos = false;
    std::vector<int32_t> eog_token_ids;
};

// What Forward and the sequence calls of a vocab-only shard answer (FAILED_PRECONDITION).
inline constexpr const char * kVocabOnlyRefusal = "this worker holds only the vocabulary (--vocab-only)";

// The worker protocol version (schema_version of every request and reply).
inline constexpr uint32_t kWorkerSchemaVersion = 1;
// The boundary schemas (BoundarySchema.name / version) and the wire dtype name.
inline constexpr const char * kBoundarySchemaName = "residual";
inline constexpr uint32_t kBoundarySchemaVersion = 1;
inline constexpr const char * kBoundaryStreamsSchemaName = "residual-streams";
inline constexpr uint32_t kBoundaryStreamsSchemaVersion = 2;
inline constexpr const char * kBoundaryWireDType = "f32";

// sha256 hex of "model_sha256\nllama_commit\npatch_sha256\nbackend\n<schema tag>\nf32";
// the schema tag is "residual/1" (so version-1 recipes are what they always were) or
// "residual-streams/2".
std::string compute_recipe_hash(const std::string & model_sha256, const std::string & llama_commit,
                                const std::string & patch_series_sha256, const std::string & backend,
                                const std::string & boundary_schema_tag = "residual/1");

// The llama.cpp commit and patch-series hash baked in at build time ("unknown" if not given).
const char * built_llama_cpp_commit();
const char * built_patch_series_sha256();

// {"llama_cpp_commit": ..., "patch_series_sha256": ..., "backends": [...], "devices": [...]}:
// what a node puts in its fingerprint (devices with total/free bytes as ggml reports them).
std::string runtime_version_json();

// ---------------------------------------------------------------------------------------------
// Forward: plain input/output records (the service fills them from / into protobuf).

struct ForwardEntry {
    uint32_t seq_id = 0;
    std::vector<int32_t> positions;
    std::vector<int32_t> token_ids;
    std::string_view boundary;        // points into the request; must outlive forward()
    BoundaryDType boundary_dtype = BoundaryDType::kUnspecified;
    uint32_t boundary_schema_version = 0;  // as declared by the sender; 0 = unset = 1
    uint32_t boundary_streams = 0;         // 0 = unset = 1
    std::vector<uint32_t> logit_rows; // empty: the entry's last row
    uint32_t top_k = 0;               // last range: > 0 returns each logit row's top-K, not the row
};

struct ForwardOutput {
    uint32_t seq_id = 0;
    uint32_t n_rows = 0;
    std::string boundary;             // f32 [n_rows, boundary.row_values()], ranges that are not last
    std::string logits;               // f32 [n_rows, n_vocab], the last range (top_k == 0)
    std::vector<uint32_t> logit_rows;
    int32_t next_position = 0;
    // The last range asked for top_k > 0: per logit row, select_top_k of the row instead of
    // the row. top_k = min(asked, n_vocab) entries a row.
    uint32_t top_k = 0;
    std::string top_token_ids;        // int32 [n_rows, top_k]
    std::string top_logits;           // f32 [n_rows, top_k]
    std::vector<double> log_sum_exp;  // [n_rows]
};

// The limits a Forward is checked against (from ShardInfo, separate so tests need no model).
struct ForwardLimits {
    uint32_t layer_begin = 0;
    uint32_t layer_end = 0;
    bool takes_tokens = false;
    bool gives_logits = false;
    uint32_t n_embd = 0;
    uint32_t n_vocab = 0;
    uint32_t n_seq_max = 0;
    uint32_t n_batch_max = 0;
    uint32_t n_ctx_per_sequence = 0;
    BoundarySchemaDesc boundary;      // rows are boundary.row_values() wide (n_embd when unset)
};

// ---------------------------------------------------------------------------------------------
// Pure validation helpers. Each returns Ok or an error naming what was wrong.

// schema_version must be the one this worker speaks (kWorkerSchemaVersion).
ShardStatus check_schema_version(uint32_t schema_version);

// positions must be next, next+1, ...; next is what the sequence already holds.
ShardStatus check_positions(uint32_t seq_id, const std::vector<int32_t> & positions, int32_t next);

// byte length of n_rows boundary rows of n_embd values of elem_size bytes.
ShardStatus check_boundary_bytes(size_t entry, uint32_t seq_id, size_t got_bytes, size_t n_rows,
                                 size_t n_embd, size_t elem_size);

// index of the first NaN/Inf value, or -1 when all are finite. data need not be aligned.
int64_t find_non_finite_f32(const void * data, size_t n_values);
int64_t find_non_finite_f16(const void * data, size_t n_values);

// index of the first entry whose seq_id already appeared earlier, or -1.
int64_t find_duplicate_seq_id(const std::vector<uint32_t> & seq_ids);

// total rows of one Forward against n_batch_max (RESOURCE_EXHAUSTED).
ShardStatus check_batch_rows(size_t total_rows, uint32_t n_batch_max);

// room in the sequence's context (RESOURCE_EXHAUSTED).
ShardStatus check_context_room(uint32_t seq_id, int32_t next, size_t n_rows, uint32_t n_ctx_per_sequence);

// The whole request, before anything touches the KV cache. next_positions[s] is what
// sequence s holds now (size n_seq_max).
ShardStatus validate_forward(const ForwardLimits & limits, const std::vector<ForwardEntry> & entries,
                             const std::vector<int32_t> & next_positions);

// The k = min(k, n) largest values of row[0, n), most likely first, ties by the lowest index
// (agent/core/wire/topk.py's select_top_k: the same ids and values, bit for bit), into ids[0, k)
// and values[0, k). Returns false (and writes nothing) if the row holds a NaN, which has no
// place in that order. n >= 1, k >= 1.
bool select_top_k(const float * row, size_t n, size_t k, int32_t * ids, float * values);

// select_top_k and log_sum_exp of one row in one call: the top value is the row's max, so the
// log-sum-exp needs no scan of its own. The same ids, values and bits as the two calls.
bool top_k_log_sum_exp(const float * row, size_t n, size_t k, int32_t * ids, float * values, double * lse);

// log(sum(exp(row))) in double, max-shifted, the sum pairwise as numpy's (agent/core/wire/topk.py's
// log_sum_exp), the terms by exp_shifted: equal to it within the bound tests/test_worker_api.py
// declares (the terms differ from numpy's exp in the last bit at most). A non-finite max is
// returned as it is.
double log_sum_exp(const float * row, size_t n);

// out[i] = exp(x[i] - shift) in double, for x[i] - shift <= 0: within 1 ulp of libm's exp
// (native/tests), exactly 1 at 0, and 0 below -708 (under 2^-1021: nothing next to the 1 of a
// max-shifted sum; libm gives subnormals down to -745). NaN gives NaN. The same bits on every
// x86-64 machine (a vectorized AVX2 variant and a baseline one, no FMA).
void exp_shifted(const float * x, size_t n, double shift, double * out);

// The most sequences one context can hold (llama_max_parallel_sequences()).
uint32_t max_sequences_limit();

// "B:E", "B:" or "B:-1" (to the end). Returns false and sets *error on bad input.
bool parse_layer_range(const std::string & text, int32_t * begin, int32_t * end, std::string * error);

// ---------------------------------------------------------------------------------------------
// llama.cpp log capture: llama's log goes through one process-wide callback that keeps the last
// ERROR lines (the reason a load failed), and forwards everything to stderr only when the
// environment variable BATON_LLAMA_LOG is set to a non-empty value other than "0".

void install_llama_log_capture();
std::string last_llama_errors();  // the kept ERROR lines joined with "; ", or ""
void clear_llama_errors();

// Thrown by Shard's constructor: a one-line reason the shard cannot be loaded.
struct ShardLoadError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// ---------------------------------------------------------------------------------------------

class Shard {
public:
    // Loads the model range and creates the context (vocab-only: loads the vocabulary only).
    // Throws ShardLoadError.
    explicit Shard(ShardConfig config);
    ~Shard();

    Shard(const Shard &) = delete;
    Shard & operator=(const Shard &) = delete;

    const ShardInfo & info() const { return info_; }
    ForwardLimits limits() const;
    uint32_t active_sequences() const { return active_sequences_.load(std::memory_order_relaxed); }

    // Positions sequence seq_id holds (0 if unknown). seq_id must be < n_seq_max.
    int32_t next_position(uint32_t seq_id) const;

    // One llama_decode over the request. On any error nothing changes (a failed decode is
    // rolled back). outputs is filled in request order on success. forward and the three
    // sequence calls answer kFailedPrecondition (kVocabOnlyRefusal) on a vocab-only shard.
    ShardStatus forward(const std::vector<ForwardEntry> & entries, std::vector<ForwardOutput> * outputs);

    ShardStatus remove_sequence(uint32_t seq_id, int32_t * next_position);
    ShardStatus trim_sequence(uint32_t seq_id, int32_t keep_positions, int32_t * next_position);
    ShardStatus copy_sequence(uint32_t src_seq_id, uint32_t dst_seq_id, int32_t * next_position);

    // The prefix cache (shard_prefix.cpp). prefix_lookup: how many leading blocks of `hashes`
    // (kPrefixHashBytes each, blocks of block_tokens) an entry holds; changes nothing.
    ShardStatus prefix_lookup(const std::vector<std::string> & hashes, uint32_t block_tokens, uint32_t * blocks) const;
    // A new session on empty sequence seq_id: copies exactly use_blocks leading blocks of
    // `hashes` from an entry (FAILED_PRECONDITION when none holds them any more: a miss the
    // caller must not hide, since the other hops copied as many), and remembers `hashes` (the
    // prompt's whole blocks) so that the sequence's blocks are kept at its removal.
    ShardStatus open_prefix(uint32_t seq_id, std::vector<std::string> hashes, uint32_t block_tokens,
                            uint32_t use_blocks, int32_t * next_position);
    // Thread-safe (atomics): the cache's counters and the rows of every Forward.
    PrefixCacheStats prefix_cache_stats() const;
    // Thread-safe (a snapshot under its own lock): PrefixCache::held_tags, at most max.
    std::vector<uint64_t> prefix_held_tags(size_t max) const;
    uint64_t forward_rows() const { return forward_rows_.load(std::memory_order_relaxed); }

    // Thread-safe (vocab is read-only): may be called without the caller's lock.
    ShardStatus tokenize(const std::string & text, bool add_special, bool parse_special,
                         std::vector<int32_t> * tokens) const;
    ShardStatus detokenize(const std::vector<int32_t> & tokens, bool remove_special, bool unparse_special,
                           std::string * text) const;
    // Thread-safe, like tokenize.
    ShardStatus vocabulary(ShardVocabulary * out) const;

private:
    struct ModelDeleter { void operator()(llama_model * m) const; };
    struct ContextDeleter { void operator()(llama_context * c) const; };
    struct Batch;  // owns a llama_batch (llama_batch_init / llama_batch_free)

    ShardStatus check_seq_id(const char * what, uint32_t seq_id) const;
    void load_vocab_only();  // the constructor's vocab-only path
    void set_next_position(uint32_t seq_id, int32_t next);
    void create_context(uint32_t n_sequences);   // ctx_ for n_sequences (sessions + spares)
    void keep_prefix(uint32_t seq_id);           // before seq_id is removed: into a spare
    void publish_prefix_stats();                 // prefix_ -> the atomics Health reads

    ShardConfig config_;
    ShardInfo info_;
    std::unique_ptr<llama_model, ModelDeleter> model_;
    std::unique_ptr<llama_context, ContextDeleter> ctx_;
    std::unique_ptr<Batch> batch_;
    const llama_vocab * vocab_ = nullptr;
    std::vector<int32_t> next_positions_;  // per seq id: positions held
    std::atomic<uint32_t> active_sequences_{0};
    bool top_k_in_graph_ = false;  // a last range selecting top-K in the graph (config + backend)
    PrefixCache prefix_{0, 0};
    std::atomic<uint64_t> forward_rows_{0};
    std::atomic<uint64_t> prefix_lookups_{0}, prefix_hits_{0}, prefix_hit_positions_{0}, prefix_kept_{0},
        prefix_evicted_{0}, prefix_positions_{0};
    std::atomic<uint32_t> prefix_entries_{0};
    mutable std::mutex prefix_tags_mutex_;
    std::vector<uint64_t> prefix_tags_;  // prefix_.held_tags(all), as last published
};

}  // namespace baton
