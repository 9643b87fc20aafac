// DataPlaneServer's compute (data_plane.h): run_steps, on the engine thread, checks and
// computes a batch the scheduler chose in one Forward, then seals each output for the next hop
// (or the owner), a last hop's draw and continuation, and the rows kept for a rebuild. Why
// its own file: the one part of the data plane that touches the shard.
#include "data_plane.h"

#include "data_plane_wire.h"
#include "fd_io.h"
#include "sealed.h"
#include "wire_codec.h"

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

void DataPlaneServer::run_steps(Shard & shard, std::vector<StepWork> && steps) {
    std::vector<Pending> batch = std::move(steps);
    // Compute: each entry checked alone first, so that one session's bad step is refused
    // alone; the rest in one Forward.
    std::vector<ShardStatus> status(batch.size());
    std::vector<ForwardOutput> outputs(batch.size());
    std::vector<DrawPlan> draws(batch.size());
    std::vector<BoundaryDType> wires(batch.size(), BoundaryDType::kF32);  // each output's dtype
    uint64_t compute_us = 0;
    const bool last_range = service_->gives_logits();
    {
        // Unbound since it was taken: not computed. (UnbindSession reads the sequence's
        // positions on the engine after unbinding, so it sees every step computed.)
        std::lock_guard<std::mutex> lock(mu_);
        for (size_t i = 0; i < batch.size(); ++i) {
            auto s = sessions_.find(batch[i].session_id);
            if (s == sessions_.end() || s->second.generation != batch[i].generation) {
                status[i] = ShardStatus::Precondition("unbound");
                continue;
            }
            wires[i] = s->second.wire_dtype;
            if (last_range && s->second.draw.temperature > 0.0 && batch[i].step.positions_size() == 1) {
                draws[i] = {true, s->second.draw, s->second.draw_seed};  // a sampled decode step: drawn here
            }
        }
    }
    [&] {
        const ForwardLimits limits = shard.limits();
        std::vector<int32_t> next(limits.n_seq_max);
        for (uint32_t q = 0; q < limits.n_seq_max; ++q) {
            next[q] = shard.next_position(q);
        }
        std::vector<ForwardEntry> entries;
        std::vector<size_t> index;
        for (size_t i = 0; i < batch.size(); ++i) {
            const v1::DataStep & st = batch[i].step;
            if (st.error_code() != 0 || !status[i].ok()) {
                continue;
            }
            ForwardEntry e;
            e.seq_id = batch[i].seq_id;
            e.positions.assign(st.positions().begin(), st.positions().end());
            e.token_ids.assign(st.token_ids().begin(), st.token_ids().end());
            e.boundary = st.boundary();
            e.boundary_dtype = static_cast<BoundaryDType>(st.boundary_dtype());
            e.boundary_schema_version = st.boundary_schema_version();
            e.boundary_streams = st.boundary_streams();
            e.top_k = st.top_k();
            if (st.every_row()) {
                if (st.top_k() == 0) {  // (refused where it is first seen: no range computes it)
                    status[i] = ShardStatus::Invalid("a step with every_row asks for the top-K of every row: top_k must be > 0");
                    continue;
                }
                for (int r = 0; r < st.positions_size(); ++r) {
                    e.logit_rows.push_back(static_cast<uint32_t>(r));
                }
            }
            if (st.rewind() && st.positions_size() > 0 && e.seq_id < next.size() && st.positions(0) < next[e.seq_id]) {
                // a verification's rejected draft rows: cut away before the step goes on from there
                int32_t held = 0;
                status[i] = shard.trim_sequence(e.seq_id, st.positions(0), &held);
                if (!status[i].ok()) {
                    continue;
                }
                next[e.seq_id] = held;
                rewind_kept_rows(batch[i], st.positions(0));
            }
            if (draws[i].draws) {
                // what the draw reads: the whole row, or its top-k cut (and at least what the step asked)
                const uint32_t cut = draws[i].sampling.top_k;
                e.top_k = cut == 0 ? 0 : std::max(cut, st.top_k());
            }
            status[i] = validate_forward(limits, {e}, next);
            if (status[i].ok()) {
                entries.push_back(std::move(e));
                index.push_back(i);
            }
        }
        if (entries.empty()) {
            return;
        }
        std::vector<ForwardOutput> outs;
        const auto started = std::chrono::steady_clock::now();
        const ShardStatus st = shard.forward(entries, &outs);
        compute_us = static_cast<uint64_t>(
            std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - started)
                .count());
        for (size_t j = 0; j < index.size(); ++j) {
            status[index[j]] = st;
            if (st.ok()) {
                outputs[index[j]] = std::move(outs[j]);
            }
        }
        if (st.ok()) {
            service_->count_forward();
            forwards_.fetch_add(1, std::memory_order_relaxed);
            steps_.fetch_add(index.size(), std::memory_order_relaxed);
            compute_us_.fetch_add(compute_us, std::memory_order_relaxed);
        }
    }();

    std::vector<Outgoing> outgoing;
    outgoing.reserve(batch.size());
    auto seal_into = [&](const Pending & pending, const std::string & body, bool to_owner) {
        Outgoing o;
        if (seal_output(pending, body, to_owner, &o)) {
            outgoing.push_back(std::move(o));
        }
        return std::chrono::steady_clock::now();  // the send (it wakes the receiver) is not the worker's
    };
    for (size_t i = 0; i < batch.size(); ++i) {
        v1::DataStep & st = batch[i].step;
        if (st.error_code() == 0 && !status[i].ok()) {
            st.set_error_code(grpc_code(status[i].code));
            st.set_error_message(status[i].message);
            st.set_error_layer_begin(service_->layer_begin());
        }
        const bool ok = st.error_code() == 0;
        std::chrono::steady_clock::time_point ready_at;
        if (service_->gives_logits()) {
            v1::DataResult result;
            result.set_step(st.step());
            result.set_n_vocab(service_->n_vocab());
            if (!ok) {
                result.set_error_code(st.error_code());
                result.set_error_message(st.error_message());
                result.set_error_layer_begin(st.error_layer_begin());
            } else {
                ForwardOutput & o = outputs[i];
                result.set_next_position(o.next_position);
                int32_t token = 0;
                bool continues = false;  // a decode step whose token is known here
                std::string draw_error;
                if (draws[i].draws) {
                    continues = draw_result(draws[i], st, o, &result, &token, &draw_error);
                    if (!continues) {
                        result.Clear();  // (the step fails: the owner hears why, nothing continues)
                        result.set_step(st.step());
                        result.set_n_vocab(service_->n_vocab());
                        result.set_error_code(grpc_code(ErrorCode::kInvalidArgument));
                        result.set_error_message("the last range could not draw the token: " + draw_error);
                        result.set_error_layer_begin(service_->layer_begin());
                    }
                } else if (o.top_k > 0 && st.positions_size() == 1 && o.top_token_ids.size() >= sizeof(int32_t)) {
                    std::memcpy(&token, o.top_token_ids.data(), sizeof(int32_t));  // greedy: the first of the top-K
                    continues = true;
                }
                if (continues) {
                    Outgoing next;  // (deliver writes the RESULTs to owners before it)
                    if (seal_continuation(batch[i], token, o.next_position, &next)) {
                        outgoing.push_back(std::move(next));
                        result.set_continued(true);
                    }
                }
                if (draws[i].draws) {
                    // draw_result filled the scores
                } else if (o.top_k > 0) {
                    result.set_top_k(o.top_k);
                    result.set_top_token_ids(std::move(o.top_token_ids));
                    result.set_top_logits(std::move(o.top_logits));
                    result.set_log_sum_exp(o.log_sum_exp.empty() ? 0.0 : o.log_sum_exp.back());
                    if (st.every_row()) {
                        result.set_rows(static_cast<uint32_t>(o.log_sum_exp.size()));
                        result.mutable_row_log_sum_exp()->Add(o.log_sum_exp.begin(), o.log_sum_exp.end());
                    }
                } else {
                    result.set_logits(std::move(o.logits));
                }
            }
            ready_at = seal_into(batch[i], result.SerializeAsString(), true);
        } else {
            v1::DataStep next;
            next.set_step(st.step());
            next.set_top_k(st.top_k());
            next.set_every_row(st.every_row());  // (both carried hop to hop, as top_k)
            next.set_rewind(st.rewind());
            if (!ok) {
                next.set_error_code(st.error_code());
                next.set_error_message(st.error_message());
                next.set_error_layer_begin(st.error_layer_begin());
            } else {
                ForwardOutput & o = outputs[i];
                if (wires[i] != BoundaryDType::kF32) {
                    // the session's wire dtype (f16 beyond its range: the step fails, named)
                    std::string encoded;
                    const size_t row_values = service_->boundary_schema().row_values();
                    const size_t n_rows = row_values == 0 ? 0 : o.boundary.size() / sizeof(float) / row_values;
                    if (!encode_boundary_rows(reinterpret_cast<const float *>(o.boundary.data()), n_rows, row_values,
                                              wires[i], &encoded)) {
                        next.set_error_code(grpc_code(ErrorCode::kInvalidArgument));
                        next.set_error_message("an output row is out of the wire dtype's range (plain f16: beyond 65504; F16S takes any)");
                        next.set_error_layer_begin(service_->layer_begin());
                        ready_at = seal_into(batch[i], next.SerializeAsString(), false);
                        continue;
                    }
                    o.boundary.swap(encoded);
                }
                keep_rows(batch[i], st.positions(0), o.boundary, wires[i]);
                next.mutable_positions()->CopyFrom(st.positions());
                next.set_boundary(std::move(o.boundary));
                next.set_boundary_dtype(static_cast<v1::DType>(wires[i]));
                next.set_boundary_schema_version(service_->boundary_schema().version);
                next.set_boundary_streams(service_->boundary_schema().streams);
            }
            ready_at = seal_into(batch[i], next.SerializeAsString(), false);
        }
        if (ok) {
            const auto in_worker = ready_at - batch[i].read_at;
            std::lock_guard<std::mutex> lock(mu_);
            auto s = sessions_.find(batch[i].session_id);
            if (s != sessions_.end() && s->second.generation == batch[i].generation) {
                s->second.rows += static_cast<uint64_t>(st.positions_size());
                s->second.steps += 1;
                s->second.compute_us += compute_us;
                s->second.in_worker_us += static_cast<uint64_t>(
                    std::chrono::duration_cast<std::chrono::microseconds>(in_worker).count());
            }
        }
    }
    deliver(outgoing);
}

bool DataPlaneServer::draw_result(const DrawPlan & plan, const v1::DataStep & st, ForwardOutput & o,
                                  v1::DataResult * result, int32_t * token, std::string * error) const {
    const size_t n_vocab = service_->n_vocab();
    // the token at the position after the step's row: its uniform (agent/core/owner/session.py)
    const double uniform = draw_uniform(plan.seed, static_cast<int64_t>(st.positions(0)) + 1);
    const size_t asked = std::min<size_t>(st.top_k(), n_vocab);
    if (o.top_k == 0) {  // the whole row: drawn from it, the asked top-K selected from it here
        if (o.logits.size() < n_vocab * sizeof(float)) {
            *error = "the Forward gave no logits row";
            return false;
        }
        // (a decode step has one logit row: the last n_vocab values)
        std::vector<float> row(n_vocab);
        std::memcpy(row.data(), o.logits.data() + o.logits.size() - n_vocab * sizeof(float), n_vocab * sizeof(float));
        if (!draw_token(row.data(), n_vocab, plan.sampling, uniform, token, error)) {
            return false;
        }
        double lse = 0.0;
        if (asked > 0) {
            std::string ids(asked * sizeof(int32_t), '\0');
            std::string values(asked * sizeof(float), '\0');
            if (!top_k_log_sum_exp(row.data(), n_vocab, asked, reinterpret_cast<int32_t *>(ids.data()),
                                   reinterpret_cast<float *>(values.data()), &lse)) {
                *error = "the row holds a NaN";
                return false;
            }
            result->set_top_k(static_cast<uint32_t>(asked));
            result->set_top_token_ids(std::move(ids));
            result->set_top_logits(std::move(values));
            result->set_log_sum_exp(lse);
        } else {
            lse = log_sum_exp(row.data(), n_vocab);
            result->set_logits(std::move(o.logits));
        }
        result->set_drawn_logprob(static_cast<double>(row[static_cast<size_t>(*token)]) - lse);
    } else {  // the top-k cut: drawn from the top-K the Forward selected (at least the cut)
        if (o.top_token_ids.size() < o.top_k * sizeof(int32_t) || o.top_logits.size() < o.top_k * sizeof(float)) {
            *error = "the Forward gave no top-k";
            return false;
        }
        std::vector<int32_t> ids(o.top_k);
        std::vector<float> values(o.top_k);
        std::memcpy(ids.data(), o.top_token_ids.data() + o.top_token_ids.size() - o.top_k * sizeof(int32_t),
                    o.top_k * sizeof(int32_t));
        std::memcpy(values.data(), o.top_logits.data() + o.top_logits.size() - o.top_k * sizeof(float),
                    o.top_k * sizeof(float));
        if (!draw_token_top_k(ids.data(), values.data(), o.top_k, n_vocab, plan.sampling, uniform, token, error)) {
            return false;
        }
        const double lse = o.log_sum_exp.empty() ? 0.0 : o.log_sum_exp.back();
        const size_t at = static_cast<size_t>(std::find(ids.begin(), ids.end(), *token) - ids.begin());
        result->set_drawn_logprob(static_cast<double>(values[at]) - lse);
        result->set_top_k(o.top_k);
        result->set_top_token_ids(std::move(o.top_token_ids));
        result->set_top_logits(std::move(o.top_logits));
        result->set_log_sum_exp(lse);
    }
    result->set_drawn(true);
    result->set_drawn_token(*token);
    return true;
}

void DataPlaneServer::keep_rows(const Pending & pending, int32_t first_position, const std::string & rows,
                                BoundaryDType wire) {
    std::lock_guard<std::mutex> lock(mu_);
    auto found = sessions_.find(pending.session_id);
    if (found == sessions_.end() || found->second.generation != pending.generation) {
        return;
    }
    Session & s = found->second;
    if (s.keep_max == 0 || s.kept_lost) {
        return;
    }
    if (s.kept_first < 0) {
        s.kept_first = first_position;
    }
    const size_t row_bytes = boundary_wire_bytes(wire, 1, service_->boundary_schema().row_values());
    const size_t held_rows = row_bytes == 0 ? 0 : s.kept.size() / row_bytes;
    if (static_cast<int64_t>(s.kept_first) + static_cast<int64_t>(held_rows) != first_position ||
        s.kept.size() + rows.size() > s.keep_max) {
        s.kept_lost = true;  // a gap, or over the budget: the node cannot rebuild from these
        std::string().swap(s.kept);
        std::vector<uint32_t>().swap(s.kept_steps);
        return;
    }
    s.kept.append(rows);
    s.kept_steps.push_back(row_bytes == 0 ? 0 : static_cast<uint32_t>(rows.size() / row_bytes));
}

void DataPlaneServer::rewind_kept_rows(const Pending & pending, int32_t first_position) {
    std::lock_guard<std::mutex> lock(mu_);
    auto found = sessions_.find(pending.session_id);
    if (found == sessions_.end() || found->second.generation != pending.generation) {
        return;
    }
    Session & s = found->second;
    if (s.keep_max == 0 || s.kept_lost || s.kept_first < 0) {
        return;
    }
    if (first_position < s.kept_first) {
        s.kept_lost = true;  // (rewound past the first kept row: a rebuild cannot start from these)
        std::string().swap(s.kept);
        std::vector<uint32_t>().swap(s.kept_steps);
        return;
    }
    const size_t row_bytes = boundary_wire_bytes(s.wire_dtype, 1, service_->boundary_schema().row_values());
    const size_t keep = static_cast<size_t>(first_position - s.kept_first);
    if (row_bytes == 0 || keep * row_bytes >= s.kept.size()) {
        return;
    }
    s.kept.resize(keep * row_bytes);
    size_t rows = 0;
    size_t n = 0;
    while (n < s.kept_steps.size() && rows + s.kept_steps[n] <= keep) {
        rows += s.kept_steps[n++];
    }
    s.kept_steps.resize(n);
    if (rows < keep) {
        s.kept_steps.push_back(static_cast<uint32_t>(keep - rows));  // the part of a step that stays
    }
}

bool DataPlaneServer::seal_output(const Pending & pending, const std::string & body, bool to_owner, Outgoing * out) {
    const std::string & sid = pending.session_id;
    std::string key;
    uint64_t counter = 0;
    {
        std::lock_guard<std::mutex> lock(mu_);
        auto s = sessions_.find(sid);
        if (s == sessions_.end() || s->second.generation != pending.generation) {
            return false;  // unbound while it was computed
        }
        counter = ++s->second.out_counter;
        key = to_owner ? s->second.return_key : s->second.next_step_key;
        out->host = s->second.next_host;
        out->port = s->second.next_port;
    }
    // a bound session's keys are 32 bytes (the service checks), so sealing cannot fail
    if (!sealed_frame(key, to_owner ? v1::DATA_FRAME_KIND_RESULT : v1::DATA_FRAME_KIND_STEP, sid, counter, body,
                      &out->frame)) {
        return false;
    }
    out->to_owner = to_owner;
    out->session_id = sid;
    out->generation = pending.generation;
    return true;
}

std::string DataPlaneServer::hello_frames(const std::vector<std::pair<std::string, uint64_t>> & sessions) {
    std::string hellos;
    for (const auto & [sid, generation] : sessions) {
        std::string key;
        uint64_t counter = 0;
        {
            std::lock_guard<std::mutex> lock(mu_);
            auto s = sessions_.find(sid);
            if (s == sessions_.end() || s->second.generation != generation || s->second.next_step_key.empty()) {
                continue;  // unbound meanwhile: its frames are not taken there either
            }
            counter = ++s->second.out_counter;  // a counter no STEP of the session uses
            key = s->second.next_step_key;
        }
        std::string hello;
        if (sealed_frame(key, v1::DATA_FRAME_KIND_HELLO, sid, counter, "", &hello)) {
            hellos += hello;
        }
    }
    return hellos;
}

bool DataPlaneServer::seal_continuation(const Pending & pending, int32_t token, int32_t position, Outgoing * out) {
    const std::string & sid = pending.session_id;
    std::string key;
    uint64_t counter = 0;
    v1::DataStep step;
    {
        std::lock_guard<std::mutex> lock(mu_);
        auto found = sessions_.find(sid);
        if (found == sessions_.end() || found->second.generation != pending.generation) {
            return false;
        }
        Session & s = found->second;
        const int32_t n_ctx = static_cast<int32_t>(service_->n_ctx_per_sequence());
        if (s.cont_key.empty() || s.cont_left == 0) {
            return false;
        }
        if (std::find(s.cont_stop.begin(), s.cont_stop.end(), token) != s.cont_stop.end() || position >= n_ctx ||
            (s.cont_max_position > 0 && position >= s.cont_max_position)) {
            s.cont_left = 0;  // the generation ends here: a step the owner still sends is its own
            return false;
        }
        --s.cont_left;
        ++s.continued_out;
        counter = ++s.cont_counter;
        key = s.cont_key;
        out->host = s.cont_host;
        out->port = s.cont_port;
    }
    step.set_step(pending.step.step() + 1);
    step.add_positions(position);
    step.add_token_ids(token);
    step.set_top_k(pending.step.top_k());
    if (!sealed_frame(key, v1::DATA_FRAME_KIND_CONTINUE, sid, counter, step.SerializeAsString(), &out->frame)) {
        return false;
    }
    out->continued = true;
    out->to_owner = false;
    out->session_id = sid;
    out->generation = pending.generation;
    return true;
}

}  // namespace baton
