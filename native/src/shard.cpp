// Shard: see shard.h; the llama_model / llama_context side (the pure rules are in shard_checks.cpp,
// the row math in shard_rows.cpp, the vocabulary in shard_vocab.cpp, the log capture in
// llama_log.cpp).
#include "shard.h"
#include "shard_vocab.h"

#include "sha256.h"
#include "wire_codec.h"

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
uint32_t max_sequences_limit() { return static_cast<uint32_t>(llama_max_parallel_sequences()); }

// ---------------------------------------------------------------------------------------------
// Shard

void Shard::ModelDeleter::operator()(llama_model * m) const { llama_model_free(m); }
void Shard::ContextDeleter::operator()(llama_context * c) const { llama_free(c); }

struct Shard::Batch {
    llama_batch batch;
    Batch(int32_t n_tokens, int32_t n_embd) : batch(llama_batch_init(n_tokens, n_embd, 1)) {}
    ~Batch() { llama_batch_free(batch); }
    Batch(const Batch &) = delete;
    Batch & operator=(const Batch &) = delete;
};

namespace {

void init_llama_backend_once() {
    static std::once_flag once;
    std::call_once(once, [] { llama_backend_init(); });
}

std::string with_llama_reason(const std::string & what) {
    const std::string reason = last_llama_errors();
    return reason.empty() ? what : what + ": " + reason;
}

// The backend that computes the model: its first offload device's registry name ("CUDA",
// "Vulkan", ...), or "CPU" when the model has no device besides the host.
std::string backend_name_of(const llama_model * model) {
    for (int32_t i = 0; i < llama_model_n_devices(model); ++i) {
        ggml_backend_dev_t dev = llama_model_get_device(model, i);
        if (dev == nullptr) {
            continue;
        }
        ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
        if (reg != nullptr && ggml_backend_reg_name(reg) != nullptr) {
            return ggml_backend_reg_name(reg);
        }
    }
    return "CPU";
}

// llama_token_to_piece(token, lstrip 0, special false): what llama.cpp's server streams.
// Loading stops (llama's progress callback returns false) once *cancel becomes true.
void set_cancel_callback(llama_model_params * mparams, const std::atomic<bool> * cancel) {
    if (cancel != nullptr) {
        mparams->progress_callback = [](float /*progress*/, void * user_data) {
            return !static_cast<const std::atomic<bool> *>(user_data)->load(std::memory_order_relaxed);
        };
        mparams->progress_callback_user_data = const_cast<std::atomic<bool> *>(cancel);
    }
}

void check_readable(const std::string & path) {
    std::FILE * f = std::fopen(path.c_str(), "rb");
    if (f == nullptr) {
        throw ShardLoadError("cannot open model " + path + ": " + std::strerror(errno));
    }
    std::fclose(f);
}

std::string lowercase(std::string text) {
    std::transform(text.begin(), text.end(), text.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    return text;
}

std::string model_meta(const llama_model * model, const char * key) {
    std::vector<char> buf(256);
    int32_t n = llama_model_meta_val_str(model, key, buf.data(), buf.size());
    if (n >= static_cast<int32_t>(buf.size())) {
        buf.resize(static_cast<size_t>(n) + 1);
        n = llama_model_meta_val_str(model, key, buf.data(), buf.size());
    }
    return n < 0 ? std::string() : std::string(buf.data());
}

}  // namespace

Shard::Shard(ShardConfig config) : config_(std::move(config)) {
    install_llama_log_capture();
    init_llama_backend_once();
    if (config_.vocab_only) {
        load_vocab_only();
        return;
    }

    if (config_.layer_begin < 0 || (config_.layer_end != -1 && config_.layer_end <= config_.layer_begin)) {
        throw ShardLoadError("bad layer range [" + std::to_string(config_.layer_begin) + "," +
                             std::to_string(config_.layer_end) + ")");
    }
    if (config_.max_sequences == 0 || config_.max_sequences > max_sequences_limit()) {
        throw ShardLoadError("max_sequences must be in [1, " + std::to_string(max_sequences_limit()) + "]");
    }
    if (config_.batch_size == 0 || config_.ctx_size_per_seq == 0) {
        throw ShardLoadError("batch_size and ctx_size_per_seq must be > 0");
    }
    check_readable(config_.model_path);

    std::string model_sha256 = config_.model_sha256;
    if (model_sha256.empty()) {
        try {
            model_sha256 = sha256_file_hex(config_.model_path);
        } catch (const std::exception & e) {
            throw ShardLoadError(e.what());
        }
    }
    model_sha256 = lowercase(std::move(model_sha256));

    const int32_t n_threads = config_.threads > 0
                                  ? config_.threads
                                  : static_cast<int32_t>(std::max(1u, std::thread::hardware_concurrency()));

    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = config_.gpu_layers;
    mparams.load_mode = config_.use_mmap ? LLAMA_LOAD_MODE_AUTO : LLAMA_LOAD_MODE_NONE;
    mparams.layer_begin = config_.layer_begin;
    mparams.layer_end = config_.layer_end;
    set_cancel_callback(&mparams, config_.cancel_load);

    const std::string asked = "[" + std::to_string(config_.layer_begin) + "," +
                              (config_.layer_end < 0 ? std::string("end") : std::to_string(config_.layer_end)) + ")";
    clear_llama_errors();
    model_.reset(llama_model_load_from_file(config_.model_path.c_str(), mparams));
    if (!model_) {
        throw ShardLoadError(with_llama_reason("cannot load layers " + asked + " of " + config_.model_path));
    }

    int32_t begin = 0;
    int32_t end = 0;
    llama_model_layer_range(model_.get(), &begin, &end);
    const int32_t n_layer = llama_model_n_layer(model_.get());
    const int32_t n_embd = llama_model_n_embd(model_.get());
    if (begin < 0 || end > n_layer || begin >= end) {
        throw ShardLoadError("llama.cpp reports layer range [" + std::to_string(begin) + "," + std::to_string(end) +
                             ") for a model of " + std::to_string(n_layer) + " blocks");
    }
    if (begin != config_.layer_begin || (config_.layer_end >= 0 && end != config_.layer_end)) {
        throw ShardLoadError("asked for layers " + asked + " but llama.cpp loaded [" + std::to_string(begin) + "," +
                             std::to_string(end) + ")");
    }
    const bool takes_tokens = begin == 0;
    const bool gives_logits = end == n_layer;
    const std::string arch = model_meta(model_.get(), "general.architecture");
    // A hyper-connection model (DeepSeek V4) keeps hc_mult residual streams between blocks:
    // its boundary is schema 2, streams x n_embd per row; every other model's is schema 1.
    const std::string hc_text = model_meta(model_.get(), (arch + ".hyper_connection.count").c_str());
    const uint32_t hc_streams = hc_text.empty() ? 1u : static_cast<uint32_t>(std::strtoul(hc_text.c_str(), nullptr, 10));
    const BoundarySchemaDesc schema = boundary_schema_for(hc_streams, static_cast<uint32_t>(n_embd));
    // The schema fixes the width of both edges; llama.cpp must agree with it.
    const int32_t row_values = static_cast<int32_t>(schema.row_values());
    if (!takes_tokens && llama_model_n_embd_inp(model_.get()) != row_values) {
        throw ShardLoadError("boundary schema " + schema.describe() + " needs the input width (" +
                             std::to_string(llama_model_n_embd_inp(model_.get())) + ") to be " +
                             std::to_string(row_values));
    }
    if (!gives_logits && llama_model_n_embd_out(model_.get()) != row_values) {
        throw ShardLoadError("boundary schema " + schema.describe() + " needs the output width (" +
                             std::to_string(llama_model_n_embd_out(model_.get())) + ") to be " +
                             std::to_string(row_values));
    }

    create_context(config_.max_sequences);
    uint32_t spares = 0;
    uint64_t bytes_per_sequence = 0;
    if (config_.prefix_cache_bytes > 0) {
        uint64_t kv_bytes = 0;
        for (const auto & buft_mem : llama_get_memory_breakdown(ctx_.get())) {
            kv_bytes += buft_mem.second.context;
        }
        bytes_per_sequence = kv_bytes / config_.max_sequences;
        if (schema.version == kBoundaryStreamsSchemaVersion || arch == "deepseek4") {
            // its compression-window state cannot be cut back to a block boundary (trim_sequence)
            info_.prefix_cache_off_reason = arch + " compression-window state cannot be cut back to a block boundary";
        } else if (bytes_per_sequence == 0 || config_.prefix_cache_bytes < bytes_per_sequence) {
            info_.prefix_cache_off_reason = "--prefix-cache-bytes is below one sequence's KV (" +
                                            std::to_string(bytes_per_sequence) + " bytes)";
        } else {
            const uint64_t room = max_sequences_limit() > config_.max_sequences
                                      ? max_sequences_limit() - config_.max_sequences : 0;
            spares = static_cast<uint32_t>(std::min<uint64_t>(config_.prefix_cache_bytes / bytes_per_sequence, room));
        }
        if (spares > 0) {
            create_context(config_.max_sequences + spares);  // the spares are whole sequences of it
        }
    }

    const uint32_t n_seq_max = config_.max_sequences;
    const int32_t n_threads_decode = config_.threads_decode > 0 ? config_.threads_decode : n_threads;
    vocab_ = llama_model_get_vocab(model_.get());

    uint64_t weight_buffer_bytes = 0;
    uint64_t kv_bytes = 0;
    for (const auto & buft_mem : llama_get_memory_breakdown(ctx_.get())) {
        weight_buffer_bytes += buft_mem.second.model;
        kv_bytes += buft_mem.second.context;
    }

    info_.architecture = arch;
    info_.boundary = schema;
    info_.n_layer = static_cast<uint32_t>(n_layer);
    info_.n_embd = static_cast<uint32_t>(n_embd);
    describe_vocabulary(vocab_, &info_);
    info_.layer_begin = static_cast<uint32_t>(begin);
    info_.layer_end = static_cast<uint32_t>(end);
    info_.takes_tokens = takes_tokens;
    info_.gives_logits = gives_logits;
    info_.model_sha256 = model_sha256;
    info_.llama_cpp_commit = built_llama_cpp_commit();
    info_.patch_series_sha256 = built_patch_series_sha256();
    info_.backend = backend_name_of(model_.get());
    top_k_in_graph_ = gives_logits && top_k_in_graph_enabled(config_.top_k_in_graph, info_.backend, config_.gpu_layers);
    info_.recipe_hash = compute_recipe_hash(info_.model_sha256, info_.llama_cpp_commit, info_.patch_series_sha256,
                                            info_.backend, schema.recipe_tag());
    info_.weight_bytes = llama_model_size(model_.get());
    info_.weight_buffer_bytes = weight_buffer_bytes;
    info_.kv_bytes = kv_bytes;
    info_.n_ctx_per_sequence = std::min(config_.ctx_size_per_seq, llama_n_ctx_seq(ctx_.get()));
    info_.n_seq_max = n_seq_max;
    info_.prefix_cache_sequences = spares;
    info_.prefix_cache_bytes = spares * bytes_per_sequence;
    info_.n_batch_max = std::min({config_.batch_size, llama_n_batch(ctx_.get()), llama_n_ubatch(ctx_.get())});
    info_.model_path = config_.model_path;
    info_.n_threads = static_cast<uint32_t>(n_threads);
    info_.n_threads_decode = static_cast<uint32_t>(n_threads_decode);

    batch_ = std::make_unique<Batch>(static_cast<int32_t>(info_.n_batch_max), takes_tokens ? 0 : row_values);
    next_positions_.assign(n_seq_max + spares, 0);
    prefix_ = PrefixCache(n_seq_max, spares);
}

void Shard::create_context(uint32_t n_sequences) {
    const std::string asked = std::to_string(config_.layer_begin) + ":" + std::to_string(config_.layer_end);
    const bool gives_logits = config_.layer_end < 0 || config_.layer_end == llama_model_n_layer(model_.get());
    const int32_t n_threads = config_.threads > 0
                                  ? config_.threads
                                  : static_cast<int32_t>(std::max(1u, std::thread::hardware_concurrency()));
    ctx_.reset();
    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = config_.ctx_size_per_seq * n_sequences;
    cparams.n_batch = config_.batch_size;
    cparams.n_ubatch = config_.batch_size;
    cparams.n_seq_max = n_sequences;
    const int32_t n_threads_decode = config_.threads_decode > 0 ? config_.threads_decode : n_threads;
    cparams.n_threads = n_threads_decode;  // llama.cpp: a micro-batch of one token
    cparams.n_threads_batch = n_threads;
    cparams.kv_unified = false;
    cparams.n_rs_seq = config_.rollback_positions;
    // A range that is not last outputs the residual of every row through the embeddings path.
    cparams.embeddings = !gives_logits;
    if (!gives_logits) {
        cparams.pooling_type = LLAMA_POOLING_TYPE_NONE;
    }
    clear_llama_errors();
    ctx_.reset(llama_init_from_model(model_.get(), cparams));
    if (!ctx_) {
        throw ShardLoadError(with_llama_reason("cannot create a context for layers " + asked + " of " +
                                               config_.model_path));
    }
    const uint32_t made = llama_n_seq_max(ctx_.get());
    if (made != n_sequences) {
        throw ShardLoadError("llama.cpp made a context for " + std::to_string(made) + " sequences, asked " +
                             std::to_string(n_sequences));
    }
}

void Shard::load_vocab_only() {
    check_readable(config_.model_path);

    // vocab_only stops llama.cpp's loader after the vocabulary: it still opens the file and
    // checks every tensor's extent against the file size (a metadata-only sparse file has
    // the full size), but reads no tensor data, creates no tensor and needs no backend.
    llama_model_params mparams = llama_model_default_params();
    mparams.vocab_only = true;
    mparams.n_gpu_layers = 0;
    mparams.load_mode = config_.use_mmap ? LLAMA_LOAD_MODE_AUTO : LLAMA_LOAD_MODE_NONE;
    set_cancel_callback(&mparams, config_.cancel_load);
    clear_llama_errors();
    model_.reset(llama_model_load_from_file(config_.model_path.c_str(), mparams));
    if (!model_) {
        throw ShardLoadError(with_llama_reason("cannot load the vocabulary of " + config_.model_path));
    }
    vocab_ = llama_model_get_vocab(model_.get());

    info_.vocab_only = true;
    info_.architecture = model_meta(model_.get(), "general.architecture");
    describe_vocabulary(vocab_, &info_);
    info_.model_sha256 = lowercase(config_.model_sha256);
    info_.llama_cpp_commit = built_llama_cpp_commit();
    info_.patch_series_sha256 = built_patch_series_sha256();
    info_.model_path = config_.model_path;
    // Nothing else: llama.cpp reads no hyperparameters (n_layer, n_embd) for a vocab-only
    // load, and there is no range, context, batch or recipe. Forward and the sequence calls
    // are refused.
}

Shard::~Shard() = default;

ForwardLimits Shard::limits() const {
    ForwardLimits l;
    l.layer_begin = info_.layer_begin;
    l.layer_end = info_.layer_end;
    l.takes_tokens = info_.takes_tokens;
    l.gives_logits = info_.gives_logits;
    l.n_embd = info_.n_embd;
    l.n_vocab = info_.n_vocab;
    l.n_seq_max = info_.n_seq_max;
    l.n_batch_max = info_.n_batch_max;
    l.n_ctx_per_sequence = info_.n_ctx_per_sequence;
    l.boundary = info_.boundary;
    return l;
}

int32_t Shard::next_position(uint32_t seq_id) const {
    return seq_id < next_positions_.size() ? next_positions_[seq_id] : 0;
}

void Shard::set_next_position(uint32_t seq_id, int32_t next) {
    next_positions_[seq_id] = next;
    // sessions only: the prefix cache's spares (ids from n_seq_max) are not active sequences
    const auto active = std::count_if(next_positions_.begin(), next_positions_.begin() + info_.n_seq_max,
                                      [](int32_t n) { return n > 0; });
    active_sequences_.store(static_cast<uint32_t>(active), std::memory_order_relaxed);
}

ShardStatus Shard::check_seq_id(const char * what, uint32_t seq_id) const {
    if (seq_id >= info_.n_seq_max) {
        return ShardStatus::Invalid(std::string(what) + " " + std::to_string(seq_id) +
                                    " is out of range: this worker holds sequences 0.." +
                                    std::to_string(info_.n_seq_max - 1));
    }
    return ShardStatus::Ok();
}

namespace {

// One logit row whose top-K and log-sum-exp a Forward returns: the row-th logit row of
// outputs[entry].
struct TopKRow {
    const float * logits;
    size_t entry;
    size_t row;
    size_t k;
};

// Every row's top-K and log-sum-exp, the rows spread over the Shard's threads (OpenMP: the
// pool ggml's CPU backend computes with, idle once llama_decode has returned). A 49,152-entry
// row takes ~0.1 ms of one core: on a GPU, at eight rows, half of a decode step
// (bench/results/gpu_check.md). Each row is computed alone, so no bit depends on the threads.
ShardStatus compute_top_k_rows(const std::vector<TopKRow> & rows, size_t n_vocab, uint32_t n_threads,
                               const std::vector<ForwardEntry> & entries, std::vector<ForwardOutput> * out) {
    const int64_t n = static_cast<int64_t>(rows.size());
    std::vector<char> ok(rows.size(), 0);
#if !defined(_OPENMP)
    (void) n_threads;  // the rows in turn
#else
    const int team = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(n_threads, n)));
#pragma omp parallel for num_threads(team) schedule(static) if (team > 1)
#endif
    for (int64_t t = 0; t < n; ++t) {
        const TopKRow & r = rows[static_cast<size_t>(t)];
        ForwardOutput & o = (*out)[r.entry];
        std::vector<int32_t> ids(r.k);
        std::vector<float> values(r.k);
        double lse = 0.0;
        if (!top_k_log_sum_exp(r.logits, n_vocab, r.k, ids.data(), values.data(), &lse)) {
            continue;
        }
        // little-endian hosts only, as the rest of the wire; each row fills its own slices
        std::memcpy(&o.top_token_ids[r.row * r.k * sizeof(int32_t)], ids.data(), r.k * sizeof(int32_t));
        std::memcpy(&o.top_logits[r.row * r.k * sizeof(float)], values.data(), r.k * sizeof(float));
        o.log_sum_exp[r.row] = lse;
        ok[static_cast<size_t>(t)] = 1;
    }
    for (size_t t = 0; t < rows.size(); ++t) {
        if (!ok[t]) {
            const ForwardOutput & o = (*out)[rows[t].entry];
            return ShardStatus::Internal("the logits of row " + std::to_string(o.logit_rows[rows[t].row]) +
                                         " of seq " + std::to_string(entries[rows[t].entry].seq_id) +
                                         " hold a NaN: no top-k");
        }
    }
    return ShardStatus::Ok();
}

}  // namespace

ShardStatus Shard::forward(const std::vector<ForwardEntry> & entries, std::vector<ForwardOutput> * outputs) {
    if (info_.vocab_only) {
        return ShardStatus::Precondition(kVocabOnlyRefusal);
    }
    ShardStatus st = validate_forward(limits(), entries, next_positions_);
    if (!st.ok()) {
        return st;
    }

    const size_t n_embd = info_.boundary.row_values();  // values per boundary row, both edges
    llama_batch & batch = batch_->batch;
    int32_t n = 0;
    std::vector<int32_t> first_row(entries.size());  // batch index of each entry's row 0
    for (size_t i = 0; i < entries.size(); ++i) {
        const ForwardEntry & e = entries[i];
        const int32_t n_rows = static_cast<int32_t>(e.positions.size());
        first_row[i] = n;
        for (int32_t r = 0; r < n_rows; ++r) {
            const int32_t k = n + r;
            batch.pos[k] = e.positions[r];
            batch.n_seq_id[k] = 1;
            batch.seq_id[k][0] = static_cast<llama_seq_id>(e.seq_id);
            batch.logits[k] = info_.gives_logits ? 0 : 1;
            if (info_.takes_tokens) {
                batch.token[k] = e.token_ids[r];
            }
        }
        if (info_.gives_logits) {
            if (e.logit_rows.empty()) {
                batch.logits[n + n_rows - 1] = 1;
            } else {
                for (uint32_t row : e.logit_rows) {
                    batch.logits[n + static_cast<int32_t>(row)] = 1;
                }
            }
        }
        if (!info_.takes_tokens) {
            float * dst = batch.embd + static_cast<size_t>(n) * n_embd;
            // (validate_forward took the dtype and the length)
            decode_boundary_rows(e.boundary.data(), static_cast<size_t>(n_rows), n_embd, e.boundary_dtype, dst);
        }
        n += n_rows;
    }
    batch.n_tokens = n;

    llama_memory_t mem = llama_get_memory(ctx_.get());
    auto roll_back = [&] {
        for (const ForwardEntry & e : entries) {
            llama_memory_seq_rm(mem, static_cast<llama_seq_id>(e.seq_id), next_positions_[e.seq_id], -1);
        }
    };

    // 0: the full rows come back (top-K, if asked, on the host below)
    const uint32_t graph_top_k = top_k_in_graph_ ? graph_top_k_for(entries, info_.n_vocab) : 0;
    if (info_.gives_logits) {
        llama_set_logits_top_k(ctx_.get(), static_cast<int32_t>(graph_top_k));
    }

    clear_llama_errors();
    const int32_t rc = llama_decode(ctx_.get(), batch);
    if (rc != 0) {
        roll_back();
        const std::string what = "llama_decode returned " + std::to_string(rc);
        if (rc == 1) {
            return ShardStatus::Exhausted(with_llama_reason(what + " (no KV cache slot for the batch)"));
        }
        return ShardStatus::Internal(with_llama_reason(what));
    }

    std::vector<ForwardOutput> out(entries.size());
    // The top-K rows: gathered here, computed after the loop, in parallel (TopKRow).
    std::vector<TopKRow> top_rows;
    for (size_t i = 0; i < entries.size(); ++i) {
        const ForwardEntry & e = entries[i];
        ForwardOutput & o = out[i];
        const uint32_t n_rows = static_cast<uint32_t>(e.positions.size());
        o.seq_id = e.seq_id;
        o.next_position = next_positions_[e.seq_id] + static_cast<int32_t>(n_rows);
        if (info_.gives_logits) {
            o.logit_rows = e.logit_rows.empty() ? std::vector<uint32_t>{n_rows - 1} : e.logit_rows;
            o.n_rows = static_cast<uint32_t>(o.logit_rows.size());
            const size_t n_vocab = info_.n_vocab;
            const size_t row_bytes = n_vocab * sizeof(float);
            const size_t k = std::min<size_t>(e.top_k, n_vocab);
            if (k > 0) {
                o.top_k = static_cast<uint32_t>(k);
                o.top_token_ids.resize(o.logit_rows.size() * k * sizeof(int32_t));
                o.top_logits.resize(o.logit_rows.size() * k * sizeof(float));
                o.log_sum_exp.resize(o.logit_rows.size());
            } else {
                o.logits.reserve(o.logit_rows.size() * row_bytes);  // appended below: no zero-fill first
            }
            for (size_t j = 0; j < o.logit_rows.size(); ++j) {
                if (graph_top_k > 0) {
                    const int32_t index = first_row[i] + static_cast<int32_t>(o.logit_rows[j]);
                    const ShardStatus gst = read_graph_top_k(ctx_.get(), index, j, e.seq_id, o.logit_rows[j], &o);
                    if (!gst.ok()) {
                        roll_back();
                        return gst;
                    }
                    continue;
                }
                const float * src = llama_get_logits_ith(ctx_.get(), first_row[i] + static_cast<int32_t>(o.logit_rows[j]));
                if (src == nullptr) {
                    roll_back();
                    return ShardStatus::Internal("no logits for row " + std::to_string(o.logit_rows[j]) + " of seq " +
                                                 std::to_string(e.seq_id));
                }
                if (k == 0) {
                    o.logits.append(reinterpret_cast<const char *>(src), row_bytes);
                    continue;
                }
                top_rows.push_back({src, i, j, k});
            }
        } else {
            o.n_rows = n_rows;
            const size_t row_bytes = n_embd * sizeof(float);
            o.boundary.resize(n_rows * row_bytes);
            for (uint32_t r = 0; r < n_rows; ++r) {
                const float * src = llama_get_embeddings_ith(ctx_.get(), first_row[i] + static_cast<int32_t>(r));
                if (src == nullptr) {
                    roll_back();
                    return ShardStatus::Internal("no boundary output for row " + std::to_string(r) + " of seq " +
                                                 std::to_string(e.seq_id));
                }
                std::memcpy(&o.boundary[r * row_bytes], src, row_bytes);
            }
        }
    }
    if (!top_rows.empty()) {
        const ShardStatus st = compute_top_k_rows(top_rows, info_.n_vocab, info_.n_threads, entries, &out);
        if (!st.ok()) {
            roll_back();
            return st;
        }
    }
    uint64_t rows = 0;
    for (size_t i = 0; i < out.size(); ++i) {
        set_next_position(out[i].seq_id, out[i].next_position);
        rows += entries[i].positions.size();
    }
    forward_rows_.fetch_add(rows, std::memory_order_relaxed);
    *outputs = std::move(out);
    return ShardStatus::Ok();
}

ShardStatus Shard::remove_sequence(uint32_t seq_id, int32_t * next_position) {
    if (info_.vocab_only) {
        return ShardStatus::Precondition(kVocabOnlyRefusal);
    }
    ShardStatus st = check_seq_id("seq_id", seq_id);
    if (!st.ok()) {
        return st;
    }
    if (next_positions_[seq_id] == 0) {
        prefix_.forget(seq_id);
        return ShardStatus::Invalid("unknown sequence " + std::to_string(seq_id));
    }
    keep_prefix(seq_id);  // its prompt's whole blocks, into a spare (when the cache is on)
    llama_memory_seq_rm(llama_get_memory(ctx_.get()), static_cast<llama_seq_id>(seq_id), -1, -1);
    set_next_position(seq_id, 0);
    *next_position = 0;
    return ShardStatus::Ok();
}

ShardStatus Shard::trim_sequence(uint32_t seq_id, int32_t keep_positions, int32_t * next_position) {
    if (info_.vocab_only) {
        return ShardStatus::Precondition(kVocabOnlyRefusal);
    }
    ShardStatus st = check_seq_id("seq_id", seq_id);
    if (!st.ok()) {
        return st;
    }
    const int32_t next = next_positions_[seq_id];
    if (next == 0) {
        return ShardStatus::Invalid("unknown sequence " + std::to_string(seq_id));
    }
    if (keep_positions < 0 || keep_positions > next) {
        return ShardStatus::Invalid("keep_positions " + std::to_string(keep_positions) + " for seq " +
                                    std::to_string(seq_id) + " must be in [0, " + std::to_string(next) + "]");
    }
    if (keep_positions < next) {
        clear_llama_errors();
        if (!llama_memory_seq_rm(llama_get_memory(ctx_.get()), static_cast<llama_seq_id>(seq_id), keep_positions, -1)) {
            if (info_.boundary.version == kBoundaryStreamsSchemaVersion || info_.architecture == "deepseek4") {
                // llama_kv_cache_dsv4::seq_rm: the compression windows (ratios 4 and 128) and the
                // indexer state are running sums that the pinned code cannot cut back; it can only
                // restore a snapshot from at most n_rs_seq positions ago, once until the next decode
                return ShardStatus::Precondition(
                    "cannot trim seq " + std::to_string(seq_id) + " from " + std::to_string(next) + " to " +
                    std::to_string(keep_positions) + " positions: " + info_.architecture +
                    " compression-window state cannot be cut back by llama.cpp; it keeps rollback snapshots for the last " +
                    std::to_string(config_.rollback_positions) +
                    " positions only (--rollback-positions), one rollback per sequence until it decodes again; "
                    "remove the sequence and run its prompt again instead");
            }
            return ShardStatus::Internal(with_llama_reason("llama.cpp cannot trim seq " + std::to_string(seq_id) +
                                                           " to " + std::to_string(keep_positions) + " positions"));
        }
    }
    set_next_position(seq_id, keep_positions);
    *next_position = keep_positions;
    return ShardStatus::Ok();
}

ShardStatus Shard::copy_sequence(uint32_t src_seq_id, uint32_t dst_seq_id, int32_t * next_position) {
    if (info_.vocab_only) {
        return ShardStatus::Precondition(kVocabOnlyRefusal);
    }
    ShardStatus st = check_seq_id("src_seq_id", src_seq_id);
    if (!st.ok()) {
        return st;
    }
    st = check_seq_id("dst_seq_id", dst_seq_id);
    if (!st.ok()) {
        return st;
    }
    if (next_positions_[src_seq_id] == 0) {
        return ShardStatus::Invalid("unknown sequence " + std::to_string(src_seq_id));
    }
    if (next_positions_[dst_seq_id] != 0) {
        return ShardStatus::Invalid("dst_seq_id " + std::to_string(dst_seq_id) + " already holds " +
                                    std::to_string(next_positions_[dst_seq_id]) +
                                    " positions; remove it first");
    }
    // With the non-unified KV cache every sequence has its own stream, so this copies the
    // whole stream buffer (deferred to the next decode's memory update) and resets dst's
    // cells: correct only because dst is empty, which is checked above.
    llama_memory_seq_cp(llama_get_memory(ctx_.get()), static_cast<llama_seq_id>(src_seq_id),
                        static_cast<llama_seq_id>(dst_seq_id), -1, -1);
    prefix_.forget(dst_seq_id);  // its blocks are src's session's, not named by any hashes here
    set_next_position(dst_seq_id, next_positions_[src_seq_id]);
    *next_position = next_positions_[dst_seq_id];
    return ShardStatus::Ok();
}

}  // namespace baton

