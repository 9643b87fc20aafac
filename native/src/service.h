// ShardWorkerService: baton.worker.v1.ShardWorker over one Shard (service.cpp), and serve_worker()
// (serve_worker.cpp), which loads the shard, listens on a Unix socket and runs until SIGTERM/SIGINT.
//
// Owns: protobuf <-> Shard translation, the Engine (engine.h: the one thread that touches the
// llama_context; every call that needs it is posted there), the error wrapper (no handler lets an exception escape; it becomes INTERNAL), the socket
// file's lifetime (stale file removed before bind, mode 0600, removed at exit) and signals.
// Must not contain model logic: validation and llama.cpp calls live in shard.cpp.
#pragma once

#include "engine.h"
#include "shard.h"
#include "worker.grpc.pb.h"

#include <atomic>
#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

namespace baton {

class DataPlaneServer;

class ShardWorkerService final : public baton::worker::v1::ShardWorker::Service {
public:
    // shard must outlive the service. Starts the engine, which owns the shard from now on.
    explicit ShardWorkerService(Shard * shard, const EngineConfig & engine_config = {});

    grpc::Status Info(grpc::ServerContext * context, const worker::v1::InfoRequest * request,
                      worker::v1::InfoReply * reply) override;
    grpc::Status Health(grpc::ServerContext * context, const worker::v1::HealthRequest * request,
                        worker::v1::HealthReply * reply) override;
    grpc::Status Forward(grpc::ServerContext * context, const worker::v1::ForwardRequest * request,
                         worker::v1::ForwardReply * reply) override;
    grpc::Status RemoveSequence(grpc::ServerContext * context, const worker::v1::RemoveSequenceRequest * request,
                                worker::v1::SequenceReply * reply) override;
    grpc::Status TrimSequence(grpc::ServerContext * context, const worker::v1::TrimSequenceRequest * request,
                              worker::v1::SequenceReply * reply) override;
    grpc::Status CopySequence(grpc::ServerContext * context, const worker::v1::CopySequenceRequest * request,
                              worker::v1::SequenceReply * reply) override;
    grpc::Status Tokenize(grpc::ServerContext * context, const worker::v1::TokenizeRequest * request,
                          worker::v1::TokenizeReply * reply) override;
    grpc::Status Detokenize(grpc::ServerContext * context, const worker::v1::DetokenizeRequest * request,
                            worker::v1::DetokenizeReply * reply) override;
    grpc::Status Vocabulary(grpc::ServerContext * context, const worker::v1::VocabularyRequest * request,
                            worker::v1::VocabularyReply * reply) override;

    grpc::Status BindSession(grpc::ServerContext * context, const worker::v1::BindSessionRequest * request,
                             worker::v1::BindSessionReply * reply) override;
    grpc::Status UnbindSession(grpc::ServerContext * context, const worker::v1::UnbindSessionRequest * request,
                               worker::v1::UnbindSessionReply * reply) override;
    grpc::Status ContinueSession(grpc::ServerContext * context, const worker::v1::ContinueSessionRequest * request,
                                 worker::v1::ContinueSessionReply * reply) override;
    grpc::Status PrefixLookup(grpc::ServerContext * context, const worker::v1::PrefixLookupRequest * request,
                              worker::v1::PrefixLookupReply * reply) override;
    grpc::Status OpenPrefix(grpc::ServerContext * context, const worker::v1::OpenPrefixRequest * request,
                            worker::v1::SequenceReply * reply) override;

    uint64_t forward_calls() const { return forward_calls_.load(std::memory_order_relaxed); }

    // For the data plane (data_plane.h): the engine its steps go through, a Forward it made
    // counted, and the shard's immutable facts.
    Engine & engine() { return engine_; }
    void count_forward() { forward_calls_.fetch_add(1, std::memory_order_relaxed); }
    uint32_t layer_begin() const { return shard_->info().layer_begin; }
    bool gives_logits() const { return shard_->info().gives_logits; }
    bool takes_tokens() const { return shard_->info().takes_tokens; }
    uint32_t n_ctx_per_sequence() const { return shard_->info().n_ctx_per_sequence; }
    uint32_t n_vocab() const { return shard_->info().n_vocab; }
    uint32_t n_batch_max() const { return shard_->info().n_batch_max; }
    const BoundarySchemaDesc & boundary_schema() const { return shard_->info().boundary; }
    // The data plane BindSession/UnbindSession act on (none: they answer FAILED_PRECONDITION)
    // and whose port Info reports. Set before serving; it must outlive the service's use.
    // Set once the data plane listens, while the gRPC server may already be answering.
    void set_data_plane(DataPlaneServer * data_plane) { data_plane_.store(data_plane, std::memory_order_release); }

private:
    // The data plane calls' common checks: the schema version, then a data plane to act on.
    ShardStatus data_plane_call(uint32_t schema_version, DataPlaneServer ** data_plane) const;
    // Runs op(&next_position) on the engine and fills a SequenceReply for reply_seq_id.
    template <typename Op>
    grpc::Status sequence_op(const char * method, uint32_t schema_version, uint32_t reply_seq_id,
                             worker::v1::SequenceReply * reply, Op op);

    Shard * shard_;  // info() and the vocabulary calls only (immutable / thread-safe); the rest: engine_
    Engine engine_;
    std::atomic<uint64_t> forward_calls_{0};  // successful Forward calls
    std::atomic<DataPlaneServer *> data_plane_{nullptr};
};

// Converts a Shard error into a gRPC status with the same message.
grpc::Status to_grpc_status(const ShardStatus & status);

// Message-size limits that fit one full batch (boundary rows in, boundary rows or logits out)
// and, out, the whole Vocabulary reply.
int max_receive_message_bytes(const ShardInfo & info);
int max_send_message_bytes(const ShardInfo & info);
// An upper bound of the Vocabulary reply's size (every piece, attr and EOG id, and framing).
uint64_t vocabulary_reply_bytes(const ShardInfo & info);

// Makes path free for bind(): removes a stale socket file, refuses to remove anything else or
// a socket a live process still accepts on. Returns "" or a one-line reason.
std::string free_socket_path(const std::string & path);

struct WorkerOptions {
    ShardConfig shard;
    std::string socket_path;  // listened on as unix:socket_path
    // Not empty: the Forward stream (forward_stream.h) also listens here.
    std::string forward_socket_path;
    // Not empty: the data plane (data_plane.h) listens on this host, at data_port (0: any).
    std::string data_host;
    uint16_t data_port = 0;
    uint32_t prefill_pace_ms = 1000;  // HopSchedulerConfig::prefill_pace_max (0: no pacing)
    uint32_t data_unproven_timeout_ms = 30000;  // DataPlaneLimits::unproven_timeout
    uint32_t data_max_connections = 256;        // DataPlaneLimits::max_connections
    // > 0: SIGHUP (the parent-death signal main() arms on Linux) stops the worker as SIGTERM
    // does, but only once getppid() differs from parent_pid; otherwise it is ignored.
    int parent_pid = 0;
};

// Loads the shard, serves it on unix:socket_path (and the Forward stream on
// forward_socket_path, when given) until SIGTERM/SIGINT (or the parent's death,
// see parent_pid), then shuts down,
// removes the socket file and returns 0. Returns 1 (after one line on stderr) if the shard
// cannot be loaded or the socket cannot be bound.
//
// Resource handling: blocks SIGTERM/SIGINT (and SIGHUP with parent_pid) in the calling thread
// (and so in every thread started after it) and handles them on a thread of its own; call
// before starting threads.
int serve_worker(const WorkerOptions & options);

}  // namespace baton
