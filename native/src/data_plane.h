// DataPlaneServer: the worker's data plane (--data-listen; protocol/worker.proto, DataFrame):
// a session's steps arrive from the worker before it on the route (or the owner), are computed
// here and leave for the next worker (or, from the last range, for the owner), without a node
// agent on the way. Why: a hop through two Python processes costs ~2 ms; worker to worker it
// costs a TCP message and one Forward (docs/PERFORMANCE.md, "The floor under a hop").
//
// Owns: the listening TCP socket; one thread per connection (accepted or dialled), which reads
// and checks frames; the table of bound sessions (keys, counters, where output goes);
// outbound connections, one per next-hop address, shared by the sessions that go there. Not
// the steps waiting to be computed: those wait in the engine's queue (engine.h), and the
// engine thread calls run_steps() here. Files, by job: data_plane.cpp (sessions and their
// frames), data_plane_connections.cpp (sockets, threads, delivery), data_plane_steps.cpp
// (computing a batch and sealing its outputs), data_plane_wire.{h,cpp} (framing, dialling).
//
// Batching: a connection thread takes every whole frame one read() brings, then posts the
// steps to the worker's engine (engine.h) together, so that steps that arrive together
// (several sessions' outputs of one Forward upstream) can share a Forward. The engine's one
// thread asks HopScheduler (hop_scheduler.h) what runs next and calls run_steps() here with a
// batch; the node's own Forwards go through the same engine, so they interleave. A batch is
// laid out by ascending sequence id, as the node's scheduler lays out its own
// (agent/core/node/scheduler.py: llama.cpp's per-sequence KV streams give other last bits in
// another order), so a session's numbers do not depend on arrival order.
//
// Lock-step (BindSessionRequest.decode_gather_us, a first hop's): a decode Forward is held
// until every session that is decoding here has its step queued, at most the window, so that
// the sessions travel the route as one convoy (one hop computes at a time, with every core:
// the mode for hops that share a machine). A session whose step missed a window is not waited
// for again until its next step comes; a session whose connection is gone is not waited for.
//
// Decode groups (BindSessionRequest.decode_groups, a first hop's): a decode Forward takes at
// most ceil(D / groups) of the queued decode steps (D: the sessions decoding here with groups
// set), the rest run in the Forward right after, so that on a route of S machines the groups
// are at different hops at once instead of travelling as one convoy.
//
// Prefill pacing (--prefill-pace-ms): while sessions decode here, a prompt chunk (rows > 1: a
// node's prefill Forward, or a data-plane step of a prompt, whose chunks come pipelined, many
// at once) starts right after the next decode Forward, one chunk a decode Forward, so chunks and
// decode Forwards alternate in step with the decoding sessions: each decode step waits behind
// at most one chunk at a hop, and the decoding sessions' inter-token gaps stay even
// (Sarathi-Serve's one chunk per iteration, as two Forwards, which keeps every session's bits
// those of its solo run). The rules themselves live in hop_scheduler.h, tested on a fake clock.
//
// Wire dtype (BindSessionRequest.wire_dtype): a range that is not the last sends its output
// rows in the session's wire dtype (wire_codec.h: F32, or F16S and Q8, which round within a
// declared bound) and keeps them as sent; the first range's choice is the session's, and steps
// of sessions with other wire dtypes never share a Forward (engine.h wire_key).
//
// Drawing at the last hop (ContinueSession with a temperature > 0): a sampled session's decode
// steps are computed for the draw (the whole row, or its top-k cut), the token drawn here as the
// owner would (sampling.h, the uniform of its position), and the RESULT carries it (drawn_token,
// drawn_logprob) beside the top-K the step asked for; the continuation goes on with it.
//
// Greedy continuation (ContinueSession, at a last hop): after a decode step's RESULT, the
// next step (its greedy token at the next position) goes straight to the first hop as a
// CONTINUE frame under a key only this worker seals with, so the owner's round trip is off
// the critical path. A first hop bound with a continue_key takes those frames beside the
// owner's STEPs; whichever copy of a step comes second (same number, position and token) is
// dropped without a word, so the owner may go on sending its own steps. A CONTINUE step more
// than a few steps ahead of the owner's own waits for them (the owner must read the RESULTs
// it is sent: one that stops reading stops its continuation, not the last worker).
//
// Errors: nothing a peer sends can throw out of a thread or stop another connection or
// session (see worker.proto for which refusals close a connection).
//
// Unproven connections: anyone who reaches the port can connect, but only a peer holding a
// bound session's key can make a frame open. An accepted connection that has not sent one
// (a STEP or ATTACH that opened) within DataPlaneLimits::unproven_timeout is closed, and when
// every connection slot is taken, a new connection takes the slot of the oldest unproven one:
// idle or garbage-sending connections cannot keep the hops of a route from reaching this
// worker. Connections this worker dialled are its own choice and count as proven. An
// unproven peer's NOTICE frames are not logged (they would let anyone fill the log).
//
// Proven before buffered: an unproven connection may announce no frame longer than
// DataPlaneLimits::unproven_frame_bytes (an owner's token step of the largest batch: 9 KB at a
// batch of 512); a longer length prefix ends it at once, after a NOTICE and a line in the log.
// Its reads take no more than that frame can need, so it holds at most that many bytes: all
// unproven connections together at most max_connections times it (2.4 MB at 256 slots), where
// each could make the worker hold a whole frame limit (5.4 MB for SmolLM2) before. A proven
// connection's frames may be as long as max_frame_bytes. A STEP with rows comes from the worker
// of the range before, on a connection it dialled: its first write there begins with a HELLO
// frame for each session it carries (data_wire: sealed under the session's next step_key, with
// a counter of its own outgoing ones, an empty body), which opens here and proves the
// connection before the rows arrive. A slow sender (a few bytes, then a stall) is closed by the
// unproven deadline like an idle one: the deadline counts from the connection's start, not from
// its last byte.
#pragma once

#include "engine.h"
#include "sampling.h"
#include "service.h"

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace baton {

// What BindSession asks (worker.proto BindSessionRequest, checked by the service).
struct DataBinding {
    std::string session_id;     // 16 bytes
    uint32_t seq_id = 0;
    std::string step_key;       // 32 bytes
    uint32_t next_step = 0;
    std::string next_host;      // not the last range
    uint16_t next_port = 0;
    std::string next_step_key;
    std::string return_key;     // the last range
    uint64_t keep_rows_max_bytes = 0;
    uint32_t decode_gather_us = 0;  // lock-step at a first hop (0: off)
    uint32_t decode_groups = 0;     // decode groups at a first hop (0 or 1: off)
    std::string continue_key;       // a first hop: CONTINUE frames open under it ("" : none taken)
    // Not the last range: the dtype its output rows go to the next range in, and are kept in
    // (the session's wire dtype, wire_codec.h).
    BoundaryDType wire_dtype = BoundaryDType::kF32;
};

// What ContinueSession asks (worker.proto ContinueSessionRequest, checked by the service).
struct DataContinuation {
    std::string session_id;
    std::string host;               // the first hop's data plane
    uint16_t port = 0;
    std::string continue_key;       // 32 bytes
    uint32_t steps = 0;
    std::vector<int32_t> stop_token_ids;
    int32_t max_position = 0;       // > 0: no step at this position or beyond
    SamplingParams sampling;        // temperature > 0: this range draws the tokens (sampling.h)
    uint64_t draw_seed = 0;         // the uniforms' seed (draw_uniform)
};

// The most decode groups a binding may ask for (worker.proto BindSessionRequest.decode_groups).
inline constexpr uint32_t kMaxDecodeGroups = 64;

struct DataSessionTotals {
    bool was_bound = false;
    uint64_t rows = 0;
    uint32_t steps = 0;
    uint32_t next_step = 0;
    uint32_t seq_id = 0;
    std::string kept_rows;       // output rows as sent (kept_rows_dtype) from kept_first_position on
    BoundaryDType kept_rows_dtype = BoundaryDType::kF32;
    std::vector<uint32_t> kept_step_rows;  // the rows of each step in kept_rows (a prompt chunk's whole)
    int32_t kept_first_position = 0;
    bool kept_rows_lost = false;
    uint64_t compute_us = 0;     // see worker.proto UnbindSessionReply
    uint64_t in_worker_us = 0;
    uint32_t continued_steps = 0;
    uint32_t duplicate_steps_dropped = 0;
    uint32_t continue_steps_waiting = 0;
};

// What the data plane computed since the worker started (HealthReply: the node's heartbeats
// count these Forwards beside its own).
struct DataPlaneCounts {
    uint64_t forwards = 0;
    uint64_t steps = 0;
    uint64_t compute_us = 0;
};

// What a DataPlaneServer accepts (worker flags, main.cpp).
struct DataPlaneLimits {
    size_t max_frame_bytes = 0;  // a frame's DataFrame, at most
    // ... on a connection not yet proven (see above; data_wire::unproven_frame_bytes)
    size_t unproven_frame_bytes = 0;
    // an accepted connection without a frame that opened is closed after this (see above)
    std::chrono::milliseconds unproven_timeout{30000};
    size_t max_connections = 256;  // accepted and dialled together
};

// "HOST:PORT" (IPv4, a name, or [IPv6]) into host and port. False + *error on bad input.
bool parse_host_port(const std::string & text, std::string * host, uint16_t * port, std::string * error);

class DataPlaneServer final : public StepSink {
public:
    // service must outlive the server. Its steps run on service->engine() (set by start()).
    DataPlaneServer(ShardWorkerService * service, const DataPlaneLimits & limits);
    ~DataPlaneServer() override;

    DataPlaneServer(const DataPlaneServer &) = delete;
    DataPlaneServer & operator=(const DataPlaneServer &) = delete;

    // Listens on host:port (port 0: any free one), starts accepting. "" or a one-line reason.
    std::string start(const std::string & host, uint16_t port);
    // The bound port (0 before start()).
    uint16_t port() const { return port_.load(std::memory_order_relaxed); }
    // Stops accepting, ends every connection, joins every thread. Idempotent.
    void stop();

    // Binds (or rebinds) a session; dials the next hop now, so that an unreachable one is a
    // refusal here and not a lost step later. "" or why not.
    std::string bind(const DataBinding & binding);
    // keep_bound: report only (no kept rows), the session stays bound.
    DataSessionTotals unbind(const std::string & session_id, bool keep_bound = false);
    // Greedy continuation at a last hop (see "Greedy continuation" below); dials the first
    // hop now. "" or why not (not bound here, set already, not reachable).
    std::string continue_session(const DataContinuation & continuation);
    DataPlaneCounts counts() const {
        return {forwards_.load(std::memory_order_relaxed), steps_.load(std::memory_order_relaxed),
                compute_us_.load(std::memory_order_relaxed)};
    }

    // The engine thread's part (StepSink): computes a batch and sends its outputs on.
    void run_steps(Shard & shard, std::vector<StepWork> && batch) override;

private:
    struct Connection {
        int fd = -1;
        std::string outbound_address;  // "host:port" when this worker dialled it, else ""
        std::mutex send_mu;            // one frame at a time on the socket
        std::atomic<bool> open{true};
        std::thread thread;            // its reader
        std::atomic<bool> finished{false};
        // a frame of a bound session opened on it (or this worker dialled it): see the header
        std::atomic<bool> proven{false};
        std::atomic<bool> evicted{false};  // its slot went to a newer connection
        std::chrono::steady_clock::time_point opened_at{};
        bool read_deadline_set = false;  // SO_RCVTIMEO is on (its reader's own)
        bool hello_sent = false;         // dialled: a write began with HELLOs (guarded by send_mu)
    };
    using Pending = StepWork;  // a step taken, on its way through the engine
    struct Session {
        uint32_t seq_id = 0;
        std::string step_key;
        uint32_t next_step = 0;           // the step the next STEP must carry
        uint64_t last_step_counter = 0;   // highest STEP counter taken (the first must be > 0)
        std::string next_host;
        uint16_t next_port = 0;
        std::string next_step_key;
        uint64_t out_counter = 0;         // the counter of the last STEP/RESULT sent
        std::string return_key;
        uint64_t last_attach_counter = 0;
        uint64_t last_hello_counter = 0;
        std::weak_ptr<Connection> sink;   // where RESULTs go (the owner's ATTACHed connection)
        std::string undelivered;          // RESULT frames made before the owner attached, in order
        uint64_t rows = 0;
        uint32_t steps = 0;
        uint64_t generation = 0;          // which binding (unique in the worker): a rebind drops steps queued before it
        BoundaryDType wire_dtype = BoundaryDType::kF32;  // of its output rows (DataBinding)
        uint64_t keep_max = 0;            // bytes of output rows to keep (0: none)
        std::string kept;                 // output rows of its steps, positions kept_first on
        std::vector<uint32_t> kept_steps; // rows of each step in kept (a rebuild keeps their shapes)
        int32_t kept_first = -1;          // -1: none kept yet
        bool kept_lost = false;           // over keep_max, or a gap: none are given back
        uint64_t compute_us = 0;          // UnbindSessionReply's timings
        uint64_t in_worker_us = 0;
        // the connection its last step came on (compared, never used: when it ends, the engine
        // hears that the session's peer is gone)
        const Connection * source = nullptr;
        // A first hop's side of greedy continuation: CONTINUE frames' key and counter, and the
        // last decode steps taken (step, position, token), so that the copy of one from the
        // other source is dropped.
        std::string continue_key;
        uint64_t last_continue_counter = 0;
        struct Taken {
            uint32_t step;
            int32_t position;
            int32_t token;
        };
        std::deque<Taken> taken;
        uint32_t owner_next_step = 0;     // one past the highest step the owner sent itself
        std::deque<Pending> parked;       // CONTINUE steps too far ahead of the owner's
        uint32_t duplicates_dropped = 0;
        uint32_t continued_in = 0;        // steps taken from CONTINUE frames
        // A last hop's side: where and under which key its CONTINUE steps go (no key: it does
        // not continue), and what is left.
        std::string cont_host;
        uint16_t cont_port = 0;
        std::string cont_key;
        uint64_t cont_counter = 0;
        uint32_t cont_left = 0;
        std::vector<int32_t> cont_stop;
        int32_t cont_max_position = 0;
        uint32_t continued_out = 0;
        SamplingParams draw;              // temperature > 0: its decode steps' tokens are drawn here
        uint64_t draw_seed = 0;
    };
    // How run_steps computes and answers one step of a batch (read under mu_ before the Forward).
    struct DrawPlan {
        bool draws = false;               // a sampled decode step at a last hop that draws
        SamplingParams sampling;
        uint64_t seed = 0;
    };
    // A drawn step's RESULT fields from its Forward output o (the whole row, or the top-k cut):
    // the token, its log-probability and the top-K the step asked for. False, with *error, when
    // the draw fails (a row it refuses).
    bool draw_result(const DrawPlan & plan, const worker::v1::DataStep & st, ForwardOutput & o,
                     worker::v1::DataResult * result, int32_t * token, std::string * error) const;

    void accept_loop();
    void serve(const std::shared_ptr<Connection> & conn);
    // With conn_mu_ held: whether a connection may be added, evicting the oldest unproven
    // accepted connection when every slot is taken.
    bool make_room();
    // Before a read on conn: false when it is unproven and out of time (then it is closed).
    bool set_read_deadline(Connection & conn);
    std::shared_ptr<Connection> add_connection(int fd, const std::string & outbound_address);
    std::shared_ptr<Connection> outbound(const std::string & host, uint16_t port, std::string * error);
    // With mu_ held: a STEP or CONTINUE that opened, for s: dropped as the second copy of a step,
    // parked (a CONTINUE too far ahead of the owner), or taken into *arrived (refused ones carry
    // their error); then the parked steps the owner caught up with.
    void take_step(Session & s, Pending && pending, bool parsed, bool continued, std::vector<Pending> * arrived);
    void enqueue_step(Session & s, Pending && pending, bool decode_step, bool continued,
                      std::vector<Pending> * arrived);
    // Posts the steps one read() brought to the engine, together (see "Batching").
    void post_arrived(std::vector<Pending> & arrived);
    // A connection ended: the sessions whose steps came on it have lost their peer.
    void connection_ended(const Connection * conn);
    // how far a CONTINUE step of s may run ahead of its owner's own steps (mu_ held)
    // One frame read off conn (its DataFrame bytes); false when the connection must end.
    // Steps it takes go to *arrived (posted by serve() once the read's frames are taken).
    bool handle_frame(const std::shared_ptr<Connection> & conn, const char * data, size_t size,
                      std::vector<Pending> * arrived);
    // One output of a Forward, sealed, on its way (deliver).
    struct Outgoing {
        std::string frame;  // whole, its length prefix included
        bool to_owner = false;
        bool continued = false;  // a CONTINUE step (sealed under the continue_key, not a step_key)
        std::string session_id;
        uint64_t generation = 0;
        std::string host;   // the next hop (not to_owner)
        uint16_t port = 0;
    };
    // Seals an output (a STEP for the next hop, or a RESULT for the owner) under the session's
    // next counter; false when there is nothing to send (unbound while it was computed).
    bool seal_output(const Pending & pending, const std::string & frame_body, bool to_owner, Outgoing * out);
    // A last hop after a decode step's result: the CONTINUE step for token at position, sealed,
    // when the session continues and may go on (steps left, not a stop token, below the limits).
    bool seal_continuation(const Pending & pending, int32_t token, int32_t position, Outgoing * out);
    // Sends a Forward's outputs, one write per connection (see data_plane.cpp).
    void deliver(std::vector<Outgoing> & outgoing);
    // The HELLO frames that begin the first write on a dialled connection (see "Proven before
    // buffered"): one for each session of sessions (id, generation) still bound, each under the
    // next counter of the session's outgoing frames.
    std::string hello_frames(const std::vector<std::pair<std::string, uint64_t>> & sessions);
    // Keeps a step's output rows as they were sent (wire: their dtype).
    void keep_rows(const Pending & pending, int32_t first_position, const std::string & rows, BoundaryDType wire);
    // A rewound step (DataStep.rewind): the kept rows from first_position on are dropped, the
    // last kept step cut to what is left of it.
    void rewind_kept_rows(const Pending & pending, int32_t first_position);

    ShardWorkerService * service_;
    Engine & engine_;  // the service's
    size_t max_frame_bytes_;
    size_t unproven_frame_bytes_;
    std::chrono::milliseconds unproven_timeout_;
    size_t max_connections_;
    uint64_t evictions_ = 0;  // guarded by conn_mu_
    std::atomic<uint64_t> unproven_refused_{0};  // unproven connections that announced too long a frame
    std::atomic<uint16_t> port_{0};
    int listen_fd_ = -1;
    std::thread accept_thread_;

    std::mutex conn_mu_;  // guards connections_, outbound_, stopping_
    std::list<std::shared_ptr<Connection>> connections_;
    std::unordered_map<std::string, std::shared_ptr<Connection>> outbound_;  // "host:port" -> open
    bool stopping_ = false;

    // guards sessions_ and next_generation_; held while posting to the engine (the one lock
    // order: this, then the engine's queue), so that a session's steps reach it in order
    std::mutex mu_;
    std::unordered_map<std::string, Session> sessions_;
    uint64_t next_generation_ = 0;
    std::atomic<uint64_t> forwards_{0};
    std::atomic<uint64_t> steps_{0};
    std::atomic<uint64_t> compute_us_{0};
};

}  // namespace baton
