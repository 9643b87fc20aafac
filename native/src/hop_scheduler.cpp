// HopScheduler: see hop_scheduler.h. Every rule here is a function of the queue, the sessions,
// `now` and the scheduler's own small state (a hold's deadline, waived stragglers, the count of
// decode Forwards, whether the last batch was a chunk).
#include "hop_scheduler.h"

#include <algorithm>
#include <optional>

namespace baton {

namespace {

using ByBinding = std::unordered_map<uint64_t, const SessionView *>;

const SessionView * find(const ByBinding & by_binding, uint64_t binding) {
    const auto found = by_binding.find(binding);
    return found == by_binding.end() ? nullptr : found->second;
}

// A prompt chunk: a node's Forward, or a data-plane step (the prompt on the data plane), of
// more than one row. A refused step is answered, not computed: never one.
bool is_chunk(const QueuedItem & item) {
    return item.rows > 1 && (item.kind == QueuedKind::kNodeForward || (item.kind == QueuedKind::kStep && !item.refused));
}

}  // namespace

bool HopScheduler::decoding_now(const SessionView & s) const {
    if (!s.decoding || s.peer_lost) {
        return false;  // a session whose connection is gone sends no step to wait for
    }
    const auto waived = waived_.find(s.binding);
    return waived == waived_.end() || waived->second != s.steps_taken;
}

bool HopScheduler::decoding_lately(const SessionView & s, const std::unordered_set<uint64_t> & prefilling,
                                   SchedulerTime now) const {
    // a session with a chunk of its own queued waits for that chunk, not the other way round
    return decoding_now(s) && prefilling.count(s.binding) == 0 && now - s.last_step_at < config_.decoding_lapse;
}

bool HopScheduler::chunk_turn(const QueuedItem & chunk, SchedulerTime now) const {
    // a decode Forward since the chunk came and since the last chunk ran, or its pace is out
    return decode_forwards_ > std::max(chunk.decode_forwards_seen, decode_forwards_at_chunk_) ||
           now >= std::max(chunk.queued_at, last_chunk_at_) + config_.prefill_pace_max;
}

bool HopScheduler::hold_steps(const QueueView & queue, const std::vector<bool> & paced, const ByBinding & by_binding,
                              SchedulerTime now) {
    size_t front = 0;
    while (front < queue.size() && (queue[front].kind != QueuedKind::kStep || paced[front])) {
        ++front;
    }
    if (front == queue.size()) {
        return false;
    }
    const SessionView * front_session = find(by_binding, queue[front].binding);
    if (front_session == nullptr || front_session->gather_us == 0 || queue[front].rows != 1 || queue[front].refused) {
        return false;  // not a lock-step decode step
    }
    std::unordered_set<uint64_t> waiting;
    for (size_t i = 0; i < queue.size(); ++i) {
        const QueuedItem & q = queue[i];
        if (q.kind != QueuedKind::kStep || paced[i]) {
            continue;  // a node's own Forward, or a paced chunk, runs beside a hold; it does not end one
        }
        const SessionView * s = find(by_binding, q.binding);
        if (s == nullptr) {
            continue;
        }
        if (q.rows != 1 || q.refused || s->gather_us == 0) {
            return false;  // a chunk, a refusal or a step nobody holds waits: everything runs now
        }
        waiting.insert(q.binding);
    }
    std::vector<uint64_t> missing;
    for (const auto & [binding, s] : by_binding) {
        if (s->gather_us != 0 && decoding_now(*s) && waiting.count(binding) == 0) {
            missing.push_back(binding);
        }
    }
    if (missing.empty()) {
        return false;  // every decoding session's step is here
    }
    if (!holding_) {
        holding_ = true;
        hold_until_ = now + std::chrono::microseconds(front_session->gather_us);
        return true;
    }
    if (now < hold_until_) {
        return true;
    }
    for (uint64_t binding : missing) {  // stragglers: waited for again once their next step comes
        waived_[binding] = find(by_binding, binding)->steps_taken;
    }
    return false;
}

HopScheduler::StepsChoice HopScheduler::choose_steps(const QueueView & queue, const std::vector<bool> & paced,
                                                     const ByBinding & by_binding, SchedulerTime now) {
    StepsChoice choice;
    if (hold_steps(queue, paced, by_binding, now)) {
        choice.held = true;
        return choice;
    }
    holding_ = false;  // whatever the reason the steps run now, no hold is left behind

    size_t decoding_grouped = 0;
    uint32_t groups = 0;
    for (const auto & [binding, s] : by_binding) {
        if (s->groups > 1 && decoding_now(*s)) {
            ++decoding_grouped;
            groups = std::max(groups, s->groups);
        }
    }
    const size_t group_cap = groups > 1 ? std::max<size_t>(1, (decoding_grouped + groups - 1) / groups) : 0;

    // After a batch of prompt chunks, decode steps go first when any wait (a session's next step
    // only): a prompt's chunks queued together at a hop (pipelined prefill) take turns with the
    // decoding sessions' steps instead of running all before them.
    bool decode_first = false;
    if (last_was_chunk_) {
        std::unordered_set<uint64_t> firsts;
        for (const QueuedItem & q : queue) {
            if (q.kind == QueuedKind::kStep && find(by_binding, q.binding) != nullptr &&
                firsts.insert(q.binding).second && q.rows == 1) {
                decode_first = true;
                break;
            }
        }
    }
    uint32_t shape_rows = 0;
    uint32_t shape_wire = 0;
    uint32_t rows = 0;
    std::unordered_set<uint64_t> seen;  // sessions with an earlier step in or left out
    for (size_t i = 0; i < queue.size(); ++i) {
        const QueuedItem & q = queue[i];
        if (q.kind != QueuedKind::kStep || find(by_binding, q.binding) == nullptr) {
            continue;
        }
        const bool first_of_session = seen.insert(q.binding).second;
        if (!first_of_session || paced[i]) {
            continue;  // one step a sequence a Forward, in order; a paced chunk waits for a decode Forward
        }
        if (decode_first && q.rows != 1) {
            continue;  // a chunk, after a chunk, while a decode step waits
        }
        if (!choice.batch.empty() &&
            (q.rows != shape_rows || q.wire != shape_wire || rows + q.rows > config_.row_budget ||
             (q.rows == 1 && group_cap != 0 && choice.batch.size() >= group_cap))) {
            continue;
        }
        if (choice.batch.empty()) {
            shape_rows = q.rows;
            shape_wire = q.wire;
        }
        rows += q.rows;
        choice.batch.push_back(i);
        choice.computes = choice.computes || !q.refused;
    }
    choice.decode = !choice.batch.empty() && shape_rows == 1;
    std::stable_sort(choice.batch.begin(), choice.batch.end(),
                     [&](size_t a, size_t b) { return queue[a].seq_id < queue[b].seq_id; });
    return choice;
}

void HopScheduler::chunk_ran(SchedulerTime now) {
    decode_forwards_at_chunk_ = decode_forwards_;
    last_chunk_at_ = now;
}

Decision HopScheduler::next(const QueueView & queue, const SessionsView & sessions, SchedulerTime now) {
    ByBinding by_binding;
    by_binding.reserve(sessions.size());
    for (const SessionView & s : sessions) {
        by_binding.emplace(s.binding, &s);
    }
    for (auto it = waived_.begin(); it != waived_.end();) {  // unbound, or stepped since
        const SessionView * s = find(by_binding, it->first);
        it = s == nullptr || s->steps_taken != it->second ? waived_.erase(it) : std::next(it);
    }

    // Prefill pacing: while others decode here, a chunk waits for a decode Forward (see chunk_turn).
    std::unordered_set<uint64_t> prefilling;  // bound sessions with a chunk of their own queued
    for (const QueuedItem & q : queue) {
        if (q.kind == QueuedKind::kStep && is_chunk(q)) {
            prefilling.insert(q.binding);
        }
    }
    std::optional<SchedulerTime> pace_wake;  // the earliest a paced chunk may run without a decode Forward
    bool decoding = false;
    if (config_.prefill_pace_max.count() > 0) {
        for (const auto & [binding, s] : by_binding) {
            if (decoding_lately(*s, prefilling, now)) {
                decoding = true;
                // or when its lapse ends (a session that stopped decoding holds no chunk back)
                const SchedulerTime lapse_end = s->last_step_at + config_.decoding_lapse;
                pace_wake = pace_wake ? std::min(*pace_wake, lapse_end) : lapse_end;
            }
        }
    }
    std::vector<bool> paced(queue.size(), false);
    for (size_t i = 0; i < queue.size() && decoding; ++i) {
        const QueuedItem & q = queue[i];
        if (is_chunk(q) && (q.kind != QueuedKind::kStep || find(by_binding, q.binding) != nullptr) &&
            !chunk_turn(q, now)) {
            paced[i] = true;
            const SchedulerTime pace_end = std::max(q.queued_at, last_chunk_at_) + config_.prefill_pace_max;
            pace_wake = std::min(*pace_wake, pace_end);
        }
    }
    const bool any_paced = std::find(paced.begin(), paced.end(), true) != paced.end();

    StepsChoice steps = choose_steps(queue, paced, by_binding, now);

    // The oldest node item that may run now.
    std::optional<size_t> node;
    std::optional<SchedulerTime> deadline;
    if (steps.held) {
        deadline = hold_until_;
    }
    if (any_paced) {
        deadline = deadline ? std::min(*deadline, *pace_wake) : *pace_wake;
    }
    for (size_t i = 0; i < queue.size() && !node; ++i) {
        if (queue[i].kind != QueuedKind::kStep && !paced[i]) {
            node = i;
        }
    }

    bool run_steps = !steps.batch.empty();
    if (run_steps && node) {
        // after a chunk a decode batch goes first (no decode step waits behind two chunks);
        // otherwise the older of the two
        const size_t first_step = *std::min_element(steps.batch.begin(), steps.batch.end());
        run_steps = (last_was_chunk_ && steps.decode) || first_step < *node;
    }
    if (run_steps) {
        if (steps.decode && steps.computes) {
            ++decode_forwards_;
        }
        last_was_chunk_ = !steps.decode;  // a data-plane prompt chunk, as a node's
        if (!steps.decode && steps.computes) {
            chunk_ran(now);
        }
        return RunBatch{std::move(steps.batch)};
    }
    if (node) {
        last_was_chunk_ = is_chunk(queue[*node]);
        if (last_was_chunk_) {
            chunk_ran(now);
        }
        return RunBatch{{*node}};
    }
    if (deadline) {
        return HoldUntil{*deadline};
    }
    return Idle{};
}

}  // namespace baton
