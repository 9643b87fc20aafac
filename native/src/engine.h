// Engine: the one thread that owns a worker's Shard (llama.cpp server's server_queue +
// update_slots shape). gRPC Forward and the sequence calls (service.cpp), the Forward stream
// (forward_stream.cpp, through the service) and the data plane (data_plane.h) only post work
// to its queue and wait for their answer; no other code touches the llama context.
//
// Why: three front doors used to share the context through several mutexes, a condition
// variable and a gather-timer thread, with an implicit lock order, and what ran next was
// decided by whoever won a lock. Now one loop asks one pure policy (HopScheduler, which sees
// the whole queue, the sessions and `now`) what runs next, runs it, and sleeps until new work
// or the policy's deadline: the deadline is the lock-step window's end that a timer thread
// used to keep.
//
// Owns: the queue (its mutex and condition variable are the only synchronisation around the
// shard), the scheduler's view of the data plane's bound sessions, the engine thread.
// Must not: run anything but shard work and the data plane's StepSink on its thread, or call
// out while holding its queue lock (the data plane posts while holding its own session lock:
// the one lock order is data plane -> engine queue, never back).
#pragma once

#include "hop_scheduler.h"
#include "shard.h"
#include "worker.pb.h"

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace baton {

// One data-plane step on its way through the engine (DataPlaneServer fills it, its StepSink
// computes it).
struct StepWork {
    std::string session_id;
    uint64_t generation = 0;  // its binding: unique in this worker (a rebind is a new one)
    uint32_t seq_id = 0;
    SchedulerTime read_at{};  // its frame read whole
    uint32_t wire = 0;        // QueuedItem::wire (wire_key)
    worker::v1::DataStep step;
};

// The wire dtypes of a step (the session's output rows, the rows it arrived in) as one key:
// steps of sessions with other wire dtypes never share a Forward (the recipe's rule).
inline uint32_t wire_key(BoundaryDType output, int arrived) {
    return (static_cast<uint32_t>(output) << 8) | (static_cast<uint32_t>(arrived) & 0xffu);
}

// Computes a batch of data-plane steps on the engine thread (DataPlaneServer).
class StepSink {
public:
    virtual ~StepSink() = default;
    // The steps of one batch, laid out as the scheduler decided. Must not throw (the engine
    // logs and drops an exception's batch) and must not post to the engine.
    virtual void run_steps(Shard & shard, std::vector<StepWork> && batch) = 0;
};

struct EngineConfig {
    std::chrono::milliseconds prefill_pace_max{1000};  // HopSchedulerConfig::prefill_pace_max
    std::chrono::milliseconds decoding_lapse{2500};    // HopSchedulerConfig::decoding_lapse
};

class Engine final {
public:
    // shard must outlive the engine. Starts the engine thread.
    Engine(Shard * shard, const EngineConfig & config);
    ~Engine();  // stop()

    Engine(const Engine &) = delete;
    Engine & operator=(const Engine &) = delete;

    // Finishes the batch in hand, answers every queued call kFailedPrecondition ("the worker is
    // stopping"), joins the thread. Idempotent. Thread-safe.
    void stop();

    // Runs job(shard) on the engine thread when the scheduler picks it and returns its answer
    // (kInternal for an exception). kind: kNodeForward (rows: its longest entry's positions;
    // more than one makes it a prompt chunk, paced) or kOperation. Blocks the caller.
    // Thread-safe; never call it from the engine thread (a StepSink).
    ShardStatus call(QueuedKind kind, uint32_t rows, const std::function<ShardStatus(Shard &)> & job);

    // The data plane's side. Thread-safe.
    // Where step batches go (nullptr: none; steps then are dropped). Returns once no batch is
    // being run by the previous sink, so that it may be destroyed.
    void set_step_sink(StepSink * sink);
    // A binding's scheduling facts: lock-step window and decode groups (BindSessionRequest).
    void bind(uint64_t generation, uint32_t gather_us, uint32_t groups);
    // Forgets a binding and drops its queued steps.
    void unbind(uint64_t generation);
    // Queues steps of bound bindings, together (refused ones carry an error: answered, not
    // computed); steps of a binding it does not know are dropped.
    void post_steps(std::vector<StepWork> && steps);
    // The connection a binding's steps came on is gone: lock-step does not wait for it (until
    // its next step).
    void peer_lost(uint64_t generation);

    // Engine work done so far (tests, logs).
    uint64_t batches() const;

private:
    struct Item {
        QueuedItem meta;
        std::function<void(Shard *)> job;  // kNodeForward / kOperation (nullptr: stopping)
        StepWork step;                     // kStep
    };

    void loop();
    // Runs one batch (the queue lock is not held).
    void run(std::vector<Item> & items);

    Shard * shard_;
    HopScheduler scheduler_;  // guarded by mu_
    mutable std::mutex mu_;   // guards everything below
    std::condition_variable wake_;       // new work, a session change, stop
    std::condition_variable sink_idle_;  // the sink's batch ended (set_step_sink waits)
    std::deque<Item> queue_;
    std::unordered_map<uint64_t, SessionView> sessions_;
    StepSink * sink_ = nullptr;
    bool in_steps_ = false;  // the engine thread is inside sink_->run_steps
    bool stopping_ = false;
    uint64_t batches_ = 0;
    std::thread thread_;
};

}  // namespace baton
