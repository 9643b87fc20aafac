// ShardWorkerService: see service.h (serve_worker() is in serve_worker.cpp).
#include "service.h"

#include "wire_codec.h"

#include "data_plane.h"
#include "sealed.h"  // the data plane's key and session id sizes

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <utility>

namespace baton {

namespace v1 = baton::worker::v1;

namespace {

constexpr uint32_t kSchemaVersion = v1::SCHEMA_VERSION_CURRENT;

grpc::StatusCode grpc_code(ErrorCode code) {
    switch (code) {
        case ErrorCode::kOk: return grpc::StatusCode::OK;
        case ErrorCode::kInvalidArgument: return grpc::StatusCode::INVALID_ARGUMENT;
        case ErrorCode::kResourceExhausted: return grpc::StatusCode::RESOURCE_EXHAUSTED;
        case ErrorCode::kFailedPrecondition: return grpc::StatusCode::FAILED_PRECONDITION;
        case ErrorCode::kInternal: return grpc::StatusCode::INTERNAL;
    }
    return grpc::StatusCode::INTERNAL;
}

// The one place where exceptions stop: every handler body runs inside it.
template <typename Body>
grpc::Status guarded(const char * rpc, Body && body) noexcept {
    try {
        return body();
    } catch (const std::exception & e) {
        return grpc::Status(grpc::StatusCode::INTERNAL, std::string(rpc) + ": " + e.what());
    } catch (...) {
        return grpc::Status(grpc::StatusCode::INTERNAL, std::string(rpc) + ": unknown exception");
    }
}

int clamp_to_int(uint64_t bytes) {
    return bytes > static_cast<uint64_t>(INT_MAX) ? INT_MAX : static_cast<int>(bytes);
}

constexpr uint64_t kMessageSlackBytes = 4ull << 20;  // ids, positions, framing, Tokenize text
constexpr uint64_t kPerRowOverheadBytes = 32;         // a position + a token id as varints, and tags
constexpr uint64_t kPerTokenVocabularyBytes = 16;     // a piece's tag + length varint, an attr and eog varint

}  // namespace

grpc::Status to_grpc_status(const ShardStatus & status) {
    if (status.ok()) {
        return grpc::Status::OK;
    }
    return grpc::Status(grpc_code(status.code), status.message);
}

int max_receive_message_bytes(const ShardInfo & info) {
    const uint64_t row = static_cast<uint64_t>(std::max(info.n_embd, info.boundary.row_values())) * sizeof(float) +
                         kPerRowOverheadBytes;
    return clamp_to_int(static_cast<uint64_t>(info.n_batch_max) * row + kMessageSlackBytes);
}

int max_send_message_bytes(const ShardInfo & info) {
    const uint64_t width = info.gives_logits ? info.n_vocab : std::max(info.n_embd, info.boundary.row_values());
    const uint64_t row = width * sizeof(float) + kPerRowOverheadBytes;
    const uint64_t forward = static_cast<uint64_t>(info.n_batch_max) * row + kMessageSlackBytes;
    // A Tokenize reply holds at most one token (<= 5 varint bytes + tag) per request byte.
    const uint64_t tokenize = 6ull * static_cast<uint64_t>(max_receive_message_bytes(info));
    return clamp_to_int(std::max({forward, tokenize, vocabulary_reply_bytes(info)}));
}

uint64_t vocabulary_reply_bytes(const ShardInfo & info) {
    return info.vocabulary_piece_bytes + static_cast<uint64_t>(info.n_vocab) * kPerTokenVocabularyBytes +
           kMessageSlackBytes;
}

ShardWorkerService::ShardWorkerService(Shard * shard, const EngineConfig & engine_config)
    : shard_(shard), engine_(shard, engine_config) {}

grpc::Status ShardWorkerService::Info(grpc::ServerContext *, const v1::InfoRequest * request, v1::InfoReply * reply) {
    return guarded("Info", [&] {
        ShardStatus st = check_schema_version(request->schema_version());
        if (!st.ok()) {
            return to_grpc_status(st);
        }
        const ShardInfo & info = shard_->info();  // immutable after load: no lock
        reply->set_schema_version(kSchemaVersion);
        reply->set_architecture(info.architecture);
        reply->set_n_layer(info.n_layer);
        reply->set_n_embd(info.n_embd);
        reply->set_n_vocab(info.n_vocab);
        reply->set_layer_begin(info.layer_begin);
        reply->set_layer_end(info.layer_end);
        reply->set_takes_tokens(info.takes_tokens);
        reply->set_gives_logits(info.gives_logits);
        if (!info.vocab_only) {  // a vocab-only worker has no edges, so no boundary schema
            v1::BoundarySchema * boundary = reply->mutable_boundary();
            boundary->set_version(info.boundary.version);
            boundary->set_name(info.boundary.name());
            boundary->set_n_embd(info.n_embd);
            boundary->set_dtype(v1::DTYPE_F32);
            boundary->set_streams(info.boundary.streams);
            boundary->set_row_values(info.boundary.row_values());
        }
        reply->set_recipe_hash(info.recipe_hash);
        reply->set_model_sha256(info.model_sha256);
        reply->set_llama_cpp_commit(info.llama_cpp_commit);
        reply->set_patch_series_sha256(info.patch_series_sha256);
        reply->set_backend(info.backend);
        reply->set_weight_bytes(info.weight_bytes);
        reply->set_weight_buffer_bytes(info.weight_buffer_bytes);
        reply->set_kv_bytes(info.kv_bytes);
        reply->set_n_ctx_per_sequence(info.n_ctx_per_sequence);
        reply->set_n_seq_max(info.n_seq_max);
        reply->set_n_batch_max(info.n_batch_max);
        reply->set_model_path(info.model_path);
        reply->set_n_threads(info.n_threads);
        reply->set_n_threads_decode(info.n_threads_decode);
        for (int32_t t : info.eog_token_ids) {
            reply->add_eog_token_ids(t);
        }
        reply->set_vocab_only(info.vocab_only);
        reply->set_prefix_cache_sequences(info.prefix_cache_sequences);
        reply->set_prefix_cache_bytes(info.prefix_cache_bytes);
        reply->set_prefix_cache_off_reason(info.prefix_cache_off_reason);
        DataPlaneServer * data_plane = data_plane_.load(std::memory_order_acquire);
        reply->set_data_port(data_plane != nullptr ? data_plane->port() : 0);
        return grpc::Status::OK;
    });
}

grpc::Status ShardWorkerService::Health(grpc::ServerContext *, const v1::HealthRequest * request,
                                        v1::HealthReply * reply) {
    // Lock-free so a probe is answered even while a long Forward holds the context.
    return guarded("Health", [&] {
        ShardStatus st = check_schema_version(request->schema_version());
        if (!st.ok()) {
            return to_grpc_status(st);
        }
        reply->set_schema_version(kSchemaVersion);
        reply->set_ready(true);  // the service exists only once the shard is loaded
        reply->set_forward_calls(forward_calls());
        reply->set_active_sequences(shard_->active_sequences());
        reply->set_forward_rows(shard_->forward_rows());
        const PrefixCacheStats prefix = shard_->prefix_cache_stats();
        reply->set_prefix_lookups(prefix.lookups);
        reply->set_prefix_hits(prefix.hits);
        reply->set_prefix_hit_positions(prefix.hit_positions);
        reply->set_prefix_kept(prefix.kept);
        reply->set_prefix_evicted(prefix.evicted);
        reply->set_prefix_entries(prefix.entries);
        reply->set_prefix_positions(prefix.positions);
        for (const uint64_t tag : shard_->prefix_held_tags(request->prefix_tags_max())) {
            reply->add_prefix_tags(tag);
        }
        if (DataPlaneServer * data_plane = data_plane_.load(std::memory_order_acquire); data_plane != nullptr) {
            const DataPlaneCounts counts = data_plane->counts();
            reply->set_data_plane_forwards(counts.forwards);
            reply->set_data_plane_steps(counts.steps);
            reply->set_data_plane_compute_us(counts.compute_us);
        }
        return grpc::Status::OK;
    });
}

grpc::Status ShardWorkerService::Forward(grpc::ServerContext * context, const v1::ForwardRequest * request,
                                         v1::ForwardReply * reply) {
    return guarded("Forward", [&] {
        ShardStatus st = check_schema_version(request->schema_version());
        if (!st.ok()) {
            return to_grpc_status(st);
        }
        // A run-ahead goes on after the reply, which a unary call cannot: the Forward stream
        // (context nullptr) serves it and has checked its rules before calling here.
        if (context != nullptr &&
            std::any_of(request->entries().begin(), request->entries().end(), [](const v1::SequenceInput & in) {
                return in.run_ahead_steps() > 0 || in.stop_token_ids_size() > 0;
            })) {
            return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                "run_ahead_steps and stop_token_ids are served on the Forward stream only");
        }
        std::vector<ForwardEntry> entries(static_cast<size_t>(request->entries_size()));
        for (int i = 0; i < request->entries_size(); ++i) {
            const v1::SequenceInput & in = request->entries(i);
            ForwardEntry & e = entries[static_cast<size_t>(i)];
            e.seq_id = in.seq_id();
            e.positions.assign(in.positions().begin(), in.positions().end());
            e.token_ids.assign(in.token_ids().begin(), in.token_ids().end());
            e.boundary = in.boundary();  // a view into the request, which outlives the call
            e.boundary_dtype = static_cast<BoundaryDType>(in.boundary_dtype());
            e.boundary_schema_version = in.boundary_schema_version();
            e.boundary_streams = in.boundary_streams();
            e.logit_rows.assign(in.logit_rows().begin(), in.logit_rows().end());
            e.top_k = in.top_k();
        }

        std::vector<ForwardOutput> outputs;
        std::chrono::steady_clock::duration compute{};
        uint32_t rows = 0;  // more than one for a sequence: a prompt chunk, paced by the engine
        for (const ForwardEntry & e : entries) {
            rows = std::max(rows, static_cast<uint32_t>(e.positions.size()));
        }
        st = engine_.call(QueuedKind::kNodeForward, rows, [&](Shard & shard) {
            const auto started = std::chrono::steady_clock::now();  // on the engine: no wait counted
            const ShardStatus forwarded = shard.forward(entries, &outputs);
            compute = std::chrono::steady_clock::now() - started;
            return forwarded;
        });
        if (!st.ok()) {
            return to_grpc_status(st);
        }
        forward_calls_.fetch_add(1, std::memory_order_relaxed);

        reply->set_schema_version(kSchemaVersion);
        reply->set_dtype(v1::DTYPE_F32);
        const auto compute_us = std::chrono::duration_cast<std::chrono::microseconds>(compute).count();
        reply->set_compute_us(static_cast<uint64_t>(compute_us));
        for (ForwardOutput & o : outputs) {
            v1::SequenceOutput * out = reply->add_entries();
            out->set_seq_id(o.seq_id);
            out->set_n_rows(o.n_rows);
            if (!o.boundary.empty()) {
                out->set_boundary(std::move(o.boundary));
                out->set_boundary_schema_version(shard_->info().boundary.version);
                out->set_boundary_streams(shard_->info().boundary.streams);
            }
            if (!o.logits.empty()) {
                out->set_logits(std::move(o.logits));
            }
            out->mutable_logit_rows()->Add(o.logit_rows.begin(), o.logit_rows.end());
            out->set_next_position(o.next_position);
            if (o.top_k > 0) {
                out->set_top_k(o.top_k);
                out->set_top_token_ids(std::move(o.top_token_ids));
                out->set_top_logits(std::move(o.top_logits));
                out->mutable_log_sum_exp()->Add(o.log_sum_exp.begin(), o.log_sum_exp.end());
            }
        }
        return grpc::Status::OK;
    });
}

// The three sequence operations differ only in the Shard call and the seq id they report.
template <typename Op>
grpc::Status ShardWorkerService::sequence_op(const char * method, uint32_t schema_version, uint32_t reply_seq_id,
                                             v1::SequenceReply * reply, Op op) {
    return guarded(method, [&] {
        ShardStatus st = check_schema_version(schema_version);
        int32_t next = 0;
        if (st.ok()) {
            st = engine_.call(QueuedKind::kOperation, 0, [&](Shard & shard) { return op(shard, &next); });
        }
        if (!st.ok()) {
            return to_grpc_status(st);
        }
        reply->set_schema_version(kSchemaVersion);
        reply->set_seq_id(reply_seq_id);
        reply->set_next_position(next);
        return grpc::Status::OK;
    });
}

grpc::Status ShardWorkerService::PrefixLookup(grpc::ServerContext *, const v1::PrefixLookupRequest * request,
                                              v1::PrefixLookupReply * reply) {
    return guarded("PrefixLookup", [&] {
        ShardStatus st = check_schema_version(request->schema_version());
        uint32_t blocks = 0;
        if (st.ok()) {
            const std::vector<std::string> hashes(request->block_hashes().begin(), request->block_hashes().end());
            st = engine_.call(QueuedKind::kOperation, 0, [&](Shard & shard) {
                return shard.prefix_lookup(hashes, request->block_tokens(), &blocks);
            });
        }
        if (!st.ok()) {
            return to_grpc_status(st);
        }
        reply->set_schema_version(kSchemaVersion);
        reply->set_blocks(blocks);
        return grpc::Status::OK;
    });
}

grpc::Status ShardWorkerService::OpenPrefix(grpc::ServerContext *, const v1::OpenPrefixRequest * request,
                                            v1::SequenceReply * reply) {
    return sequence_op("OpenPrefix", request->schema_version(), request->seq_id(), reply, [&](Shard & shard, int32_t * next) {
        std::vector<std::string> hashes(request->block_hashes().begin(), request->block_hashes().end());
        return shard.open_prefix(request->seq_id(), std::move(hashes), request->block_tokens(), request->use_blocks(), next);
    });
}

ShardStatus ShardWorkerService::data_plane_call(uint32_t schema_version, DataPlaneServer ** data_plane) const {
    ShardStatus st = check_schema_version(schema_version);
    if (!st.ok()) {
        return st;
    }
    *data_plane = data_plane_.load(std::memory_order_acquire);
    if (*data_plane == nullptr) {
        return ShardStatus::Precondition("this worker has no data plane (--data-listen)");
    }
    return ShardStatus::Ok();
}

grpc::Status ShardWorkerService::BindSession(grpc::ServerContext *, const v1::BindSessionRequest * request,
                                            v1::BindSessionReply * reply) {
    return guarded("BindSession", [&] {
        DataPlaneServer * data_plane = nullptr;
        if (const ShardStatus st = data_plane_call(request->schema_version(), &data_plane); !st.ok()) {
            return to_grpc_status(st);
        }
        const ShardInfo & info = shard_->info();
        if (info.vocab_only) {
            return to_grpc_status(ShardStatus::Precondition(kVocabOnlyRefusal));
        }
        if (request->session_id().size() != kDataSessionIdBytes) {
            return to_grpc_status(ShardStatus::Invalid("session_id must be 16 bytes, got " +
                                                       std::to_string(request->session_id().size())));
        }
        if (request->seq_id() >= info.n_seq_max) {
            return to_grpc_status(ShardStatus::Invalid("seq_id " + std::to_string(request->seq_id()) +
                                                       " is not below n_seq_max " + std::to_string(info.n_seq_max)));
        }
        if (request->step_key().size() != kDataKeyBytes) {
            return to_grpc_status(ShardStatus::Invalid("step_key must be 32 bytes"));
        }
        const bool has_next = request->next_port() != 0 || !request->next_host().empty();
        if (info.gives_logits == has_next) {
            return to_grpc_status(ShardStatus::Invalid(
                info.gives_logits ? "the last range sends results to the owner: no next_host/next_port"
                                  : "a range that is not the last needs next_host and next_port"));
        }
        if (has_next && (request->next_host().empty() || request->next_port() == 0 || request->next_port() > 65535 ||
                         request->next_step_key().size() != kDataKeyBytes)) {
            return to_grpc_status(ShardStatus::Invalid("next_host, a next_port of 1-65535 and a 32-byte "
                                                       "next_step_key go together"));
        }
        if (info.gives_logits != (request->return_key().size() == kDataKeyBytes) ||
            (!info.gives_logits && !request->return_key().empty())) {
            return to_grpc_status(ShardStatus::Invalid(info.gives_logits ? "the last range needs a 32-byte return_key"
                                                                         : "only the last range takes a return_key"));
        }
        if (!request->continue_key().empty() &&
            (!info.takes_tokens || request->continue_key().size() != kDataKeyBytes)) {
            return to_grpc_status(ShardStatus::Invalid(info.takes_tokens ? "continue_key must be 32 bytes"
                                                                         : "only the first range takes a continue_key"));
        }
        const auto wire = static_cast<BoundaryDType>(request->wire_dtype());
        if (wire != BoundaryDType::kUnspecified && boundary_wire_bytes(wire, 1, 1) == 0) {
            return to_grpc_status(ShardStatus::Invalid("wire_dtype " + std::to_string(request->wire_dtype()) +
                                                       " is not supported (DTYPE_F32, DTYPE_F16, DTYPE_Q8 or DTYPE_F16S)"));
        }
        if (request->decode_groups() > kMaxDecodeGroups) {
            return to_grpc_status(ShardStatus::Invalid("decode_groups " + std::to_string(request->decode_groups()) +
                                                       " is over " + std::to_string(kMaxDecodeGroups)));
        }
        DataBinding binding;
        binding.session_id = request->session_id();
        binding.seq_id = request->seq_id();
        binding.step_key = request->step_key();
        binding.next_step = request->next_step();
        binding.next_host = request->next_host();
        binding.next_port = static_cast<uint16_t>(request->next_port());
        binding.next_step_key = request->next_step_key();
        binding.return_key = request->return_key();
        binding.keep_rows_max_bytes = info.gives_logits ? 0 : request->keep_rows_max_bytes();
        binding.decode_gather_us = request->decode_gather_us();
        binding.decode_groups = request->decode_groups();
        binding.continue_key = request->continue_key();
        binding.wire_dtype = wire == BoundaryDType::kUnspecified ? BoundaryDType::kF32 : wire;
        const std::string refused = data_plane->bind(binding);
        if (refused.rfind("a binding must bring fresh keys", 0) == 0) {
            return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, refused);
        }
        if (!refused.empty()) {
            return grpc::Status(grpc::StatusCode::UNAVAILABLE, refused);
        }
        reply->set_schema_version(kSchemaVersion);
        return grpc::Status::OK;
    });
}

grpc::Status ShardWorkerService::UnbindSession(grpc::ServerContext *, const v1::UnbindSessionRequest * request,
                                              v1::UnbindSessionReply * reply) {
    return guarded("UnbindSession", [&] {
        DataPlaneServer * data_plane = nullptr;
        if (const ShardStatus st = data_plane_call(request->schema_version(), &data_plane); !st.ok()) {
            return to_grpc_status(st);
        }
        DataSessionTotals totals = data_plane->unbind(request->session_id(), request->keep_bound());
        reply->set_schema_version(kSchemaVersion);
        reply->set_was_bound(totals.was_bound);
        if (totals.was_bound) {
            // on the engine, after unbind: a step of it in a batch when it was unbound is counted
            int32_t next = 0;
            const ShardStatus read = engine_.call(QueuedKind::kOperation, 0, [&](Shard & shard) {
                next = shard.next_position(totals.seq_id);
                return ShardStatus::Ok();
            });
            if (!read.ok()) {
                return to_grpc_status(read);
            }
            reply->set_next_position(next);
        }
        reply->set_rows(totals.rows);
        reply->set_steps(totals.steps);
        reply->set_next_step(totals.next_step);
        reply->set_kept_rows(std::move(totals.kept_rows));
        reply->set_kept_first_position(totals.kept_first_position);
        reply->set_kept_rows_lost(totals.kept_rows_lost);
        if (totals.kept_rows_dtype != BoundaryDType::kF32) {
            reply->set_kept_rows_dtype(static_cast<v1::DType>(totals.kept_rows_dtype));
        }
        for (uint32_t rows : totals.kept_step_rows) {
            reply->add_kept_step_rows(rows);
        }
        reply->set_compute_us(totals.compute_us);
        reply->set_in_worker_us(totals.in_worker_us);
        reply->set_continued_steps(totals.continued_steps);
        reply->set_duplicate_steps_dropped(totals.duplicate_steps_dropped);
        reply->set_continue_steps_waiting(totals.continue_steps_waiting);
        return grpc::Status::OK;
    });
}

grpc::Status ShardWorkerService::ContinueSession(grpc::ServerContext *, const v1::ContinueSessionRequest * request,
                                                v1::ContinueSessionReply * reply) {
    return guarded("ContinueSession", [&] {
        DataPlaneServer * data_plane = nullptr;
        if (const ShardStatus st = data_plane_call(request->schema_version(), &data_plane); !st.ok()) {
            return to_grpc_status(st);
        }
        if (!shard_->info().gives_logits) {
            return to_grpc_status(ShardStatus::Invalid("only the last range continues a session"));
        }
        if (request->session_id().size() != kDataSessionIdBytes) {
            return to_grpc_status(ShardStatus::Invalid("session_id must be 16 bytes, got " +
                                                       std::to_string(request->session_id().size())));
        }
        if (request->host().empty() || request->port() == 0 || request->port() > 65535 ||
            request->continue_key().size() != kDataKeyBytes) {
            return to_grpc_status(ShardStatus::Invalid("a host, a port of 1-65535 and a 32-byte continue_key go together"));
        }
        DataContinuation c;
        c.session_id = request->session_id();
        c.host = request->host();
        c.port = static_cast<uint16_t>(request->port());
        c.continue_key = request->continue_key();
        c.steps = request->steps();
        c.stop_token_ids.assign(request->stop_token_ids().begin(), request->stop_token_ids().end());
        c.max_position = request->max_position();
        // a sampled session: this range draws its tokens (sampling.h); top_p 0 is unset (1)
        c.sampling.temperature = request->temperature();
        c.sampling.top_k = request->top_k();
        c.sampling.top_p = request->top_p() == 0.0 ? 1.0 : request->top_p();
        c.draw_seed = request->draw_seed();
        if (const std::string bad = check_sampling_params(c.sampling); !bad.empty()) {
            return to_grpc_status(ShardStatus::Invalid(bad));
        }
        const std::string refused = data_plane->continue_session(c);
        if (refused.rfind("the first hop's data plane", 0) == 0) {
            return grpc::Status(grpc::StatusCode::UNAVAILABLE, refused);
        }
        if (!refused.empty()) {
            return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, refused);
        }
        reply->set_schema_version(kSchemaVersion);
        return grpc::Status::OK;
    });
}

grpc::Status ShardWorkerService::RemoveSequence(grpc::ServerContext *, const v1::RemoveSequenceRequest * request,
                                                v1::SequenceReply * reply) {
    return sequence_op("RemoveSequence", request->schema_version(), request->seq_id(), reply,
                       [&](Shard & shard, int32_t * next) { return shard.remove_sequence(request->seq_id(), next); });
}

grpc::Status ShardWorkerService::TrimSequence(grpc::ServerContext *, const v1::TrimSequenceRequest * request,
                                              v1::SequenceReply * reply) {
    return sequence_op("TrimSequence", request->schema_version(), request->seq_id(), reply, [&](Shard & shard, int32_t * next) {
        return shard.trim_sequence(request->seq_id(), request->keep_positions(), next);
    });
}

grpc::Status ShardWorkerService::CopySequence(grpc::ServerContext *, const v1::CopySequenceRequest * request,
                                              v1::SequenceReply * reply) {
    return sequence_op("CopySequence", request->schema_version(), request->dst_seq_id(), reply, [&](Shard & shard, int32_t * next) {
        return shard.copy_sequence(request->src_seq_id(), request->dst_seq_id(), next);
    });
}

grpc::Status ShardWorkerService::Tokenize(grpc::ServerContext *, const v1::TokenizeRequest * request,
                                          v1::TokenizeReply * reply) {
    // The vocab is read-only and llama_tokenize is thread-safe: no lock.
    return guarded("Tokenize", [&] {
        ShardStatus st = check_schema_version(request->schema_version());
        std::vector<int32_t> tokens;
        if (st.ok()) {
            st = shard_->tokenize(request->text(), request->add_special(), request->parse_special(), &tokens);
        }
        if (!st.ok()) {
            return to_grpc_status(st);
        }
        reply->set_schema_version(kSchemaVersion);
        reply->mutable_token_ids()->Add(tokens.begin(), tokens.end());
        return grpc::Status::OK;
    });
}

grpc::Status ShardWorkerService::Vocabulary(grpc::ServerContext *, const v1::VocabularyRequest * request,
                                            v1::VocabularyReply * reply) {
    // Read-only vocabulary, like Tokenize: no lock.
    return guarded("Vocabulary", [&] {
        ShardStatus st = check_schema_version(request->schema_version());
        ShardVocabulary vocab;
        if (st.ok()) {
            st = shard_->vocabulary(&vocab);
        }
        if (!st.ok()) {
            return to_grpc_status(st);
        }
        reply->set_schema_version(kSchemaVersion);
        reply->set_n_vocab(static_cast<uint32_t>(vocab.pieces.size()));
        reply->mutable_pieces()->Reserve(static_cast<int>(vocab.pieces.size()));
        for (std::string & piece : vocab.pieces) {
            reply->add_pieces(std::move(piece));
        }
        reply->mutable_attrs()->Add(vocab.attrs.begin(), vocab.attrs.end());
        reply->set_bos_token_id(vocab.bos_token_id);
        reply->set_add_bos(vocab.add_bos);
        reply->mutable_eog_token_ids()->Add(vocab.eog_token_ids.begin(), vocab.eog_token_ids.end());
        return grpc::Status::OK;
    });
}

grpc::Status ShardWorkerService::Detokenize(grpc::ServerContext *, const v1::DetokenizeRequest * request,
                                            v1::DetokenizeReply * reply) {
    return guarded("Detokenize", [&] {
        ShardStatus st = check_schema_version(request->schema_version());
        std::string text;
        if (st.ok()) {
            const std::vector<int32_t> tokens(request->token_ids().begin(), request->token_ids().end());
            st = shard_->detokenize(tokens, request->remove_special(), request->unparse_special(), &text);
        }
        if (!st.ok()) {
            return to_grpc_status(st);
        }
        reply->set_schema_version(kSchemaVersion);
        reply->set_text(std::move(text));
        return grpc::Status::OK;
    });
}

}  // namespace baton
