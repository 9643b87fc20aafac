// DataPlaneServer's session table (data_plane.h): bind / unbind / continue_session, the frames
// that open under a session's keys (STEP, CONTINUE, ATTACH), the step-order and duplicate rules
// of greedy continuation, and posting the steps taken to the engine. Why its own file: what a
// session may do, not sockets or compute.
#include "data_plane.h"

#include "data_plane_wire.h"
#include "fd_io.h"
#include "sealed.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <utility>
#include <vector>

namespace baton {

namespace v1 = baton::worker::v1;
using namespace data_wire;  // the data plane's own helpers

namespace {

constexpr size_t kNoticeMaxLogBytes = 200;
// Decode steps a first hop remembers (continuation on): a copy from the other source comes
// within kContinueAheadSteps or so (the owner cannot fall further behind, see below).
constexpr size_t kTakenStepsKept = 64;
// How far a session's CONTINUE steps may run ahead of its owner's own steps at a first hop: a
// CONTINUE step this many past the owner's last waits until the owner catches up. Why: each
// continued step sends the owner a RESULT; an owner that stops reading (a laptop asleep, a
// stopped process) would otherwise fill its socket and block the last worker for everyone.
// Normally the owner's copy of a step comes within a step (it follows the RESULT), so a
// window of 4 never holds anything back.
constexpr uint32_t kContinueAheadSteps = 4;

}  // namespace

std::string DataPlaneServer::bind(const DataBinding & b) {
    if (b.next_port != 0) {
        std::string error;
        if (!outbound(b.next_host, b.next_port, &error)) {
            return "the next hop's data plane: " + error;
        }
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto previous = sessions_.find(b.session_id);
    if (previous != sessions_.end() &&
        (previous->second.step_key == b.step_key ||
         (!b.next_step_key.empty() && previous->second.next_step_key == b.next_step_key) ||
         (!b.return_key.empty() && previous->second.return_key == b.return_key) ||
         (!b.continue_key.empty() && previous->second.continue_key == b.continue_key))) {
        // its counters start again: the same key would seal under nonces already used
        return "a binding must bring fresh keys (these are the session's current ones)";
    }
    Session & s = sessions_[b.session_id];
    if (s.generation != 0) {
        engine_.unbind(s.generation);  // its queued steps are dropped
    }
    const uint64_t generation = ++next_generation_;
    s = Session{};
    s.generation = generation;
    s.seq_id = b.seq_id;
    s.step_key = b.step_key;
    s.next_step = b.next_step;
    s.next_host = b.next_host;
    s.next_port = b.next_port;
    s.next_step_key = b.next_step_key;
    s.return_key = b.return_key;
    s.keep_max = b.keep_rows_max_bytes;
    s.continue_key = b.continue_key;
    s.wire_dtype = b.wire_dtype;
    engine_.bind(generation, b.decode_gather_us, b.decode_groups);
    return "";
}

std::string DataPlaneServer::continue_session(const DataContinuation & c) {
    std::string error;
    if (!outbound(c.host, c.port, &error)) {  // reachable now, not a lost step later
        return "the first hop's data plane: " + error;
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto found = sessions_.find(c.session_id);
    if (found == sessions_.end()) {
        return "no session " + hex_of(c.session_id) + " is bound here";
    }
    Session & s = found->second;
    if (!s.cont_key.empty() && c.continue_key != s.cont_key) {
        // another key's counter would start again: one key per binding
        return "the session continues under another key already (one continue_key per binding)";
    }
    if (c.continue_key == s.step_key || c.continue_key == s.return_key) {
        return "the continue_key must be a key of its own";
    }
    // (a re-arm under the same key: the frames' counter goes on from where it is)
    s.cont_host = c.host;
    s.cont_port = c.port;
    s.cont_key = c.continue_key;
    s.cont_left = c.steps;
    s.cont_stop = c.stop_token_ids;
    s.cont_max_position = c.max_position;
    s.draw = c.sampling;
    s.draw_seed = c.draw_seed;
    return "";
}

DataSessionTotals DataPlaneServer::unbind(const std::string & session_id, bool keep_bound) {
    std::lock_guard<std::mutex> lock(mu_);
    DataSessionTotals totals;
    auto found = sessions_.find(session_id);
    if (found == sessions_.end()) {
        return totals;
    }
    totals.was_bound = true;
    totals.rows = found->second.rows;
    totals.steps = found->second.steps;
    totals.next_step = found->second.next_step;
    totals.seq_id = found->second.seq_id;
    totals.kept_rows_lost = found->second.kept_lost;
    totals.compute_us = found->second.compute_us;
    totals.in_worker_us = found->second.in_worker_us;
    totals.continued_steps = std::max(found->second.continued_in, found->second.continued_out);
    totals.duplicate_steps_dropped = found->second.duplicates_dropped;
    totals.continue_steps_waiting = static_cast<uint32_t>(found->second.parked.size());
    if (keep_bound) {
        return totals;
    }
    if (!found->second.kept_lost && found->second.kept_first >= 0) {
        totals.kept_rows.swap(found->second.kept);
        totals.kept_step_rows.swap(found->second.kept_steps);
        totals.kept_first_position = found->second.kept_first;
        totals.kept_rows_dtype = found->second.wire_dtype;
    }
    engine_.unbind(found->second.generation);  // its queued steps are dropped
    sessions_.erase(found);
    return totals;
}

bool DataPlaneServer::handle_frame(const std::shared_ptr<Connection> & conn, const char * data, size_t size,
                                   std::vector<Pending> * arrived) {
    auto refuse = [&](const std::string & session_id, const std::string & why, bool close) {
        const std::string notice = notice_frame(session_id, "data plane: " + why);
        std::lock_guard<std::mutex> lock(conn->send_mu);
        return write_full(conn->fd, notice.data(), notice.size()) && !close;
    };
    v1::DataFrame frame;
    if (!frame.ParseFromArray(data, static_cast<int>(size))) {
        return refuse("", "the frame is not a DataFrame; closing the connection", true);
    }
    if (frame.schema_version() != v1::SCHEMA_VERSION_CURRENT) {
        return refuse("", "DataFrame schema_version " + std::to_string(frame.schema_version()) +
                              " is not the one this worker speaks (1); closing the connection", true);
    }
    const std::string & sid = frame.session_id();
    const uint32_t kind = static_cast<uint32_t>(frame.kind());
    switch (frame.kind()) {
    case v1::DATA_FRAME_KIND_NOTICE:
        if (conn->proven.load()) {  // (anyone may connect: an unproven peer's notices would fill the log)
            std::fprintf(stderr, "baton-worker: data plane: the peer says: %s\n",
                         frame.notice().substr(0, kNoticeMaxLogBytes).c_str());
        }
        return true;
    case v1::DATA_FRAME_KIND_RESULT:
        return refuse(sid, "a worker takes no RESULT frames", false);
    case v1::DATA_FRAME_KIND_STEP:
    case v1::DATA_FRAME_KIND_ATTACH:
    case v1::DATA_FRAME_KIND_CONTINUE:
    case v1::DATA_FRAME_KIND_HELLO:
        break;
    default:
        return refuse(sid, "unknown frame kind " + std::to_string(kind) + "; closing the connection", true);
    }

    std::string plain;
    std::string undelivered;
    std::string refusal;  // written after mu_ is released: a peer that does not read blocks only itself
    {
        std::lock_guard<std::mutex> lock(mu_);
        refusal = [&]() -> std::string {
            auto found = sessions_.find(sid);
            if (found == sessions_.end()) {
                return "no session " + hex_of(sid) + " is bound here";
            }
            Session & s = found->second;
            const bool continued = frame.kind() == v1::DATA_FRAME_KIND_CONTINUE;
            const bool hello = frame.kind() == v1::DATA_FRAME_KIND_HELLO;  // sealed under the step_key
            const bool step = frame.kind() == v1::DATA_FRAME_KIND_STEP || continued;
            const std::string & key = continued ? s.continue_key : (step || hello) ? s.step_key : s.return_key;
            uint64_t & last = continued ? s.last_continue_counter
                              : step    ? s.last_step_counter
                              : hello   ? s.last_hello_counter
                                        : s.last_attach_counter;
            if (key.empty()) {
                return std::string(continued ? "CONTINUE" : step ? "STEP" : hello ? "HELLO" : "ATTACH") +
                       " frames are not taken for session " + hex_of(sid) + " here";
            }
            if (frame.counter() <= last) {
                return "counter " + std::to_string(frame.counter()) + " is not above the last one taken (" +
                                       std::to_string(last) + "): a replayed or stale frame";
            }
            if (!open_data_frame(key, kind, sid, frame.counter(), frame.sealed(), &plain)) {
                return "the frame does not open under session " + hex_of(sid) +
                                       "'s key (a peer without the key, or changed bytes)";
            }
            last = frame.counter();
            conn->proven.store(true);
            if (hello) {
                return "";  // it only proves the connection: longer frames may follow
            }
            if (!step) {
                v1::DataAttach attach;
                if (!attach.ParseFromString(plain)) {
                    return "the ATTACH body is not a DataAttach";
                }
                s.sink = conn;
                undelivered.swap(s.undelivered);
            } else {
                Pending pending;
                pending.session_id = sid;
                pending.generation = s.generation;
                pending.seq_id = s.seq_id;
                pending.read_at = std::chrono::steady_clock::now();
                const bool parsed = pending.step.ParseFromString(plain);
                pending.wire = wire_key(s.wire_dtype, pending.step.boundary_dtype());
                s.source = conn.get();
                take_step(s, std::move(pending), parsed, continued, arrived);
            }
            return "";
        }();
    }
    if (!refusal.empty()) {
        return refuse(sid, refusal, false);
    }
    if (!undelivered.empty()) {
        std::lock_guard<std::mutex> lock(conn->send_mu);
        write_full(conn->fd, undelivered.data(), undelivered.size());
    }
    return true;
}

void DataPlaneServer::take_step(Session & s, Pending && pending, bool parsed, bool continued,
                                std::vector<Pending> * arrived) {
    v1::DataStep & st = pending.step;
    const bool decode_step = parsed && st.error_code() == 0 && st.positions_size() == 1 && st.token_ids_size() == 1;
    if (!continued && parsed) {
        s.owner_next_step = std::max(s.owner_next_step, st.step() + 1);
    }
    if (decode_step && !s.continue_key.empty() && st.step() < s.next_step &&
        std::any_of(s.taken.begin(), s.taken.end(), [&](const Session::Taken & t) {
            return t.step == st.step() && t.position == st.positions(0) && t.token == st.token_ids(0);
        })) {
        ++s.duplicates_dropped;  // the other source's copy came first: nothing to do
    } else if (continued && decode_step && st.step() == s.next_step &&
               st.step() >= s.owner_next_step + kContinueAheadSteps) {
        s.parked.push_back(std::move(pending));  // the owner is behind: wait for it (see the header)
    } else {
        if (!parsed) {
            st.Clear();
            st.set_error_code(grpc_code(ErrorCode::kInvalidArgument));
            st.set_error_message("the STEP body is not a DataStep");
            st.set_error_layer_begin(service_->layer_begin());
        } else if (st.error_code() == 0 && st.step() != s.next_step) {
            const uint32_t got = st.step();
            st.Clear();
            st.set_step(got);
            st.set_error_code(grpc_code(ErrorCode::kFailedPrecondition));
            st.set_error_message("step " + std::to_string(got) + " arrived where step " +
                                 std::to_string(s.next_step) + " was expected");
            st.set_error_layer_begin(service_->layer_begin());
        }
        enqueue_step(s, std::move(pending), decode_step, continued, arrived);
    }
    // parked CONTINUE steps the owner has caught up with (or sent itself meanwhile)
    while (!s.parked.empty()) {
        Pending & p = s.parked.front();
        if (p.step.step() < s.next_step) {
            ++s.duplicates_dropped;  // the owner's copy was taken
        } else if (p.step.step() == s.next_step && p.step.step() < s.owner_next_step + kContinueAheadSteps) {
            enqueue_step(s, std::move(p), true, true, arrived);
        } else {
            break;
        }
        s.parked.pop_front();
    }
}

void DataPlaneServer::enqueue_step(Session & s, Pending && pending, bool decode_step, bool continued,
                                   std::vector<Pending> * arrived) {
    const v1::DataStep & st = pending.step;
    if (st.step() == s.next_step) {
        ++s.next_step;  // refused or not, the next one follows it
        if (!s.continue_key.empty() && decode_step) {
            s.taken.push_back({st.step(), st.positions(0), st.token_ids(0)});
            if (s.taken.size() > kTakenStepsKept) {
                s.taken.pop_front();
            }
            s.continued_in += continued ? 1 : 0;
        }
    }
    arrived->push_back(std::move(pending));
}

void DataPlaneServer::post_arrived(std::vector<Pending> & arrived) {
    if (arrived.empty()) {
        return;
    }
    {
        // Under mu_: a session's steps reach the engine in the order they were taken, and a
        // session unbound since (its binding's generation gone) is not posted.
        std::lock_guard<std::mutex> lock(mu_);
        std::vector<Pending> bound;
        bound.reserve(arrived.size());
        for (Pending & p : arrived) {
            const auto s = sessions_.find(p.session_id);
            if (s != sessions_.end() && s->second.generation == p.generation) {
                bound.push_back(std::move(p));
            }
        }
        engine_.post_steps(std::move(bound));
    }
    arrived.clear();
}

}  // namespace baton
