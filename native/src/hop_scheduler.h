// HopScheduler: the one rule that decides what a worker's engine runs next (engine.h): a batch
// of queued work, or nothing until a deadline. Pure: no threads, no clock, no llama, no
// sockets. The engine passes what is queued, what it knows of the sessions and `now`; tests
// drive it on a fake clock (native/tests/hop_scheduler_tests.cpp).
//
// Why one pure function: the data plane's batching rules (lock-step holds, decode groups,
// prefill pacing) used to be spread over a combiner, a gather-timer thread and a condition
// variable that read steady_clock; they could only be tested by real-time tests that slept.
//
// Owns: every batching rule of a hop (see data_plane.h for why each exists):
// - Wire: only data-plane steps of sessions with the same wire dtypes share a Forward.
// - Shape: only data-plane steps of one shape share a Forward (decode rows with decode rows,
//   chunks with chunks of their length), at most row_budget rows, one step per session, a
//   session's steps in arrival order; a batch is laid out by ascending sequence id, so a
//   session's numbers do not depend on arrival order.
// - Lock-step (a session's gather window > 0): a decode batch is held until every session that
//   is decoding here has its step queued, at most the window of the first held step. A session
//   that missed a window (a straggler) is not waited for again until its next step arrives. A
//   session whose peer connection is gone is not waited for.
// - Decode groups: a decode batch takes at most ceil(D / groups) steps (D: the sessions
//   decoding here with groups set); the rest run in the batch right after.
// - Prefill pacing: while another session decodes here lately, prompt chunks (a node's Forward
//   of more than one row, or a data-plane step of more than one row: the prompt on the data
//   plane) take turns with decode Forwards: a chunk waits for a data-plane decode Forward decided
//   after it was queued and after the last chunk ran (at most prefill_pace_max from the later of
//   the two), and after a chunk a ready decode batch goes first. So no decode step waits behind
//   more than one chunk at a hop, also when a prompt's chunks arrive together (pipelined
//   prefill), and no chunk waits behind more than a decode Forward (and steps older than it).
//   A paced chunk neither runs nor ends a lock-step hold. With nobody decoding, chunks run at
//   once, back to back.
// - Everything else (node decode Forwards, sequence operations, refused steps) runs in
//   arrival order, one item a batch, except that refused steps never wait for a hold.
//
// Must not include: llama.h, grpc, protobuf, <thread>, <mutex>.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <unordered_set>
#include <variant>
#include <vector>

namespace baton {

// The engine's clock type; the scheduler never reads it, it is only told `now`.
using SchedulerClock = std::chrono::steady_clock;
using SchedulerTime = SchedulerClock::time_point;

struct HopSchedulerConfig {
    uint32_t row_budget = 512;  // rows one Forward may carry (ShardInfo::n_batch_max)
    // A node's prompt chunk waits at most this long for the next decode Forward (0: no pacing).
    std::chrono::milliseconds prefill_pace_max{1000};
    // A session counts as decoding here (for prefill pacing) while its last decode step is
    // younger than this. It must be longer than the gap between a live decoding session's steps
    // at this hop, and that gap can hold one paced chunk at this hop (up to prefill_pace_max)
    // plus the rest of the route's round trip, which itself may include a paced chunk at another
    // hop: two pace waits and half of one more for the steps themselves is the margin. A
    // session that stopped (or whose owner died with its lease still running) then holds
    // prompts back for this long at most.
    std::chrono::milliseconds decoding_lapse{2500};
};

// The default decoding_lapse for a pace (see HopSchedulerConfig::decoding_lapse: two pace
// waits and a half).
inline std::chrono::milliseconds default_decoding_lapse(std::chrono::milliseconds prefill_pace_max) {
    return prefill_pace_max * 5 / 2;
}

enum class QueuedKind {
    kStep,         // a data-plane step of a bound session
    kNodeForward,  // a node's Forward (gRPC or the Forward stream): its own batch
    kOperation,    // a sequence operation or a read of the context: its own batch
};

// What the scheduler sees of one queued item. The queue is in arrival order.
struct QueuedItem {
    QueuedKind kind = QueuedKind::kStep;
    uint64_t binding = 0;   // kStep: its session's binding (SessionView::binding)
    uint32_t seq_id = 0;    // kStep: the sequence it extends
    uint32_t rows = 0;      // kStep: its positions; kNodeForward: its longest entry's positions
    uint32_t wire = 0;      // kStep: its session's wire dtypes (engine.h wire_key): one a Forward
    bool refused = false;   // kStep: it carries an error (answered, not computed)
    SchedulerTime queued_at{};
    // HopScheduler::decode_forwards() when it was queued (a chunk's pacing waits for more)
    uint64_t decode_forwards_seen = 0;
};

// What the scheduler sees of one bound data-plane session.
struct SessionView {
    uint64_t binding = 0;           // unique per binding (a rebind is a new one)
    uint32_t gather_us = 0;         // lock-step window (0: off)
    uint32_t groups = 0;            // decode groups (0 or 1: off)
    bool decoding = false;          // its last step taken was one row and not refused
    SchedulerTime last_step_at{};   // when its last step was taken
    uint64_t steps_taken = 0;       // steps taken so far (a new one ends a straggler's waiver)
    bool peer_lost = false;         // the connection its steps came on is gone
};

using QueueView = std::vector<QueuedItem>;
using SessionsView = std::vector<SessionView>;

// Run these queue items (indices into the QueueView) as one batch, in this order.
struct RunBatch {
    std::vector<size_t> items;
};
// Nothing can run before deadline unless something new is queued.
struct HoldUntil {
    SchedulerTime deadline;
};
// Nothing is queued that can ever run without new input.
struct Idle {};
using Decision = std::variant<Idle, RunBatch, HoldUntil>;

class HopScheduler final {
public:
    explicit HopScheduler(const HopSchedulerConfig & config) : config_(config) {}

    // What runs next. A RunBatch is taken to run: the scheduler counts it (decode Forwards,
    // the last batch's kind), so call next() again only after removing its items from the
    // queue. Deterministic: the same inputs and state give the same decision.
    Decision next(const QueueView & queue, const SessionsView & sessions, SchedulerTime now);

    // Data-plane decode Forwards decided so far (a node's prefill chunk waits for one more).
    uint64_t decode_forwards() const { return decode_forwards_; }
    // Whether a lock-step hold is on (tests: a hold ended early leaves none behind).
    bool holding() const { return holding_; }
    const HopSchedulerConfig & config() const { return config_; }

private:
    struct StepsChoice {
        bool held = false;            // lock-step holds the steps until hold_until_
        std::vector<size_t> batch;    // the steps that run (empty: none)
        bool decode = false;          // the batch is decode rows
        bool computes = false;        // not every step in it is refused
    };
    // paced: per queue item, a chunk that waits for a decode Forward (it neither runs nor ends a hold)
    StepsChoice choose_steps(const QueueView & queue, const std::vector<bool> & paced,
                             const std::unordered_map<uint64_t, const SessionView *> & by_binding, SchedulerTime now);
    // Whether lock-step holds the first queued step now (it may start a hold, end one, waive
    // stragglers).
    bool hold_steps(const QueueView & queue, const std::vector<bool> & paced,
                    const std::unordered_map<uint64_t, const SessionView *> & by_binding, SchedulerTime now);
    bool decoding_now(const SessionView & s) const;  // decoding, not waived, peer not lost
    // decoding_now, stepped within decoding_lapse, and no chunk of its own queued (prefilling)
    bool decoding_lately(const SessionView & s, const std::unordered_set<uint64_t> & prefilling,
                         SchedulerTime now) const;
    // Whether a chunk may run now while others decode: a decode Forward was decided since it
    // was queued and since the last chunk ran, or prefill_pace_max passed since the later of
    // the two.
    bool chunk_turn(const QueuedItem & chunk, SchedulerTime now) const;
    void chunk_ran(SchedulerTime now);  // a chunk batch was decided

    HopSchedulerConfig config_;
    uint64_t decode_forwards_ = 0;
    bool last_was_chunk_ = false;    // the last batch decided was a prompt chunk (a node's or data-plane steps)
    uint64_t decode_forwards_at_chunk_ = 0;  // decode_forwards_ when the last chunk batch was decided
    SchedulerTime last_chunk_at_{};          // when the last chunk batch was decided
    bool holding_ = false;           // a lock-step hold is on, until hold_until_
    SchedulerTime hold_until_{};
    // stragglers: binding -> steps_taken when it missed a window (waived until it changes)
    std::unordered_map<uint64_t, uint64_t> waived_;
};

}  // namespace baton
