// CTest cases for HopScheduler (native/src/hop_scheduler.h) on a fake clock: every time is an
// offset from a fixed origin, so each timing rule is checked to the microsecond and nothing
// sleeps. `baton-hop-scheduler-tests [doctest options]`; no model, no threads.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include "hop_scheduler.h"

#include <algorithm>
#include <initializer_list>
#include <string>
#include <variant>
#include <vector>

namespace {

using baton::Decision;
using baton::HoldUntil;
using baton::HopScheduler;
using baton::HopSchedulerConfig;
using baton::Idle;
using baton::QueuedItem;
using baton::QueuedKind;
using baton::RunBatch;
using baton::SchedulerTime;
using baton::SessionView;
using std::chrono::microseconds;
using std::chrono::milliseconds;

constexpr uint32_t kWindowUs = 2000;  // a lock-step window

SchedulerTime at_ms(int64_t ms) { return SchedulerTime{} + std::chrono::hours(1) + milliseconds(ms); }

// A hop: bound sessions (binding = seq id + 100), its queue, and the scheduler, on a fake clock.
struct Hop {
    explicit Hop(HopSchedulerConfig config = {}) : scheduler(config) {}

    HopScheduler scheduler;
    std::vector<SessionView> sessions;
    std::vector<QueuedItem> queue;
    SchedulerTime now = at_ms(0);

    SessionView & session(uint32_t seq_id) {
        for (SessionView & s : sessions) {
            if (s.binding == seq_id + 100) {
                return s;
            }
        }
        FAIL("no session " << seq_id);
        return sessions.front();
    }
    void bind(uint32_t seq_id, uint32_t gather_us = 0, uint32_t groups = 0) {
        SessionView s;
        s.binding = seq_id + 100;
        s.gather_us = gather_us;
        s.groups = groups;
        sessions.push_back(s);
    }
    // Binds seq_ids lock-step and runs their first decode steps as one batch (then all decode).
    void decode_together(std::initializer_list<uint32_t> seq_ids, uint32_t gather_us) {
        for (uint32_t seq : seq_ids) {
            bind(seq, gather_us);
        }
        for (uint32_t seq : seq_ids) {
            step(seq);
        }
        CHECK(run().size() == seq_ids.size());
    }
    // A data-plane step arrives (what the engine records of it, as engine.cpp does).
    void step(uint32_t seq_id, uint32_t rows = 1, bool refused = false, uint32_t wire = 0) {
        SessionView & s = session(seq_id);
        s.decoding = rows == 1 && !refused;
        s.last_step_at = now;
        ++s.steps_taken;
        QueuedItem q;
        q.kind = QueuedKind::kStep;
        q.binding = s.binding;
        q.seq_id = seq_id;
        q.rows = rows;
        q.refused = refused;
        q.wire = wire;
        q.queued_at = now;
        q.decode_forwards_seen = scheduler.decode_forwards();
        queue.push_back(q);
    }
    // A node's own Forward (rows > 1: a prompt chunk).
    void node_forward(uint32_t rows) {
        QueuedItem q;
        q.kind = QueuedKind::kNodeForward;
        q.rows = rows;
        q.queued_at = now;
        q.decode_forwards_seen = scheduler.decode_forwards();
        queue.push_back(q);
    }
    void operation() {
        QueuedItem q;
        q.kind = QueuedKind::kOperation;
        q.queued_at = now;
        queue.push_back(q);
    }

    Decision next() { return scheduler.next(queue, sessions, now); }

    // Runs what the scheduler decides now: the items' descriptions ("s<seq>" for a step,
    // "chunk<rows>"/"node<rows>"/"op" for the rest) in batch order; fails on a hold or idle.
    std::vector<std::string> run() {
        const Decision d = next();
        const auto * batch = std::get_if<RunBatch>(&d);
        REQUIRE_MESSAGE(batch != nullptr, (std::holds_alternative<Idle>(d) ? "idle" : "held"));
        std::vector<std::string> names;
        for (size_t i : batch->items) {
            const QueuedItem & q = queue[i];
            names.push_back(q.kind == QueuedKind::kStep            ? "s" + std::to_string(q.seq_id)
                            : q.kind == QueuedKind::kOperation     ? std::string("op")
                            : q.rows > 1                           ? "chunk" + std::to_string(q.rows)
                                                                   : "node" + std::to_string(q.rows));
        }
        std::vector<size_t> taken = batch->items;
        std::sort(taken.rbegin(), taken.rend());
        for (size_t i : taken) {
            queue.erase(queue.begin() + static_cast<std::ptrdiff_t>(i));
        }
        return names;
    }
    // The deadline the scheduler holds until; fails when it decides otherwise.
    SchedulerTime held() {
        const Decision d = next();
        const auto * hold = std::get_if<HoldUntil>(&d);
        REQUIRE_MESSAGE(hold != nullptr, (std::holds_alternative<Idle>(d) ? "idle" : "ran"));
        return hold->deadline;
    }
};

using Names = std::vector<std::string>;

}  // namespace

TEST_CASE("an empty queue is idle, and a lone decode step runs now") {
    Hop hop;
    hop.bind(0);
    CHECK(std::holds_alternative<Idle>(hop.next()));
    hop.step(0);
    CHECK(hop.run() == Names{"s0"});
    CHECK(std::holds_alternative<Idle>(hop.next()));
}

TEST_CASE("a lone lock-step session is not held: it is every decoding session") {
    Hop hop;
    hop.bind(0, kWindowUs);
    hop.step(0, 5);  // its prompt
    CHECK(hop.run() == Names{"s0"});
    hop.step(0);
    CHECK(hop.run() == Names{"s0"});
    CHECK_FALSE(hop.scheduler.holding());
}

TEST_CASE("a batch is laid out by ascending sequence id, whatever the arrival order") {
    Hop hop;
    for (uint32_t seq : {3, 1, 2, 0}) {
        hop.bind(seq);
    }
    for (uint32_t seq : {3, 1, 2, 0}) {
        hop.step(seq);
    }
    CHECK(hop.run() == Names{"s0", "s1", "s2", "s3"});
}

TEST_CASE("shapes do not mix, a session's steps go one a batch in order, and the row budget holds") {
    // (pacing off: session 1 decodes, so its chunks would wait for its decode Forward)
    Hop hop(HopSchedulerConfig{/*row_budget=*/8, milliseconds(0), milliseconds(0)});
    for (uint32_t seq : {0, 1, 2, 3}) {
        hop.bind(seq);
    }
    hop.step(0, 4);
    hop.step(1, 1);
    hop.step(0, 1);  // session 0's next step: after its chunk
    hop.step(2, 4);
    hop.step(3, 4);  // over the budget with 0 and 2
    CHECK(hop.run() == Names{"s0", "s2"});
    CHECK(hop.run() == Names{"s0", "s1"});
    CHECK(hop.run() == Names{"s3"});
}

TEST_CASE("sessions with other wire dtypes never share a Forward") {
    Hop hop;
    for (uint32_t seq : {0, 1, 2}) {
        hop.bind(seq);
    }
    hop.step(0, 1, false, /*wire=*/0x101);
    hop.step(1, 1, false, /*wire=*/0x202);
    hop.step(2, 1, false, /*wire=*/0x101);
    CHECK(hop.run() == Names{"s0", "s2"});
    CHECK(hop.run() == Names{"s1"});
}

TEST_CASE("a convoy: a lock-step decode step is held until every decoding session's step is queued") {
    Hop hop;
    hop.decode_together({0, 1, 2}, kWindowUs);
    hop.step(2);
    hop.step(0);
    CHECK(hop.held() == at_ms(0) + microseconds(kWindowUs));  // the window from the first hold
    hop.now = at_ms(1);
    CHECK(hop.held() == at_ms(0) + microseconds(kWindowUs));  // the same hold, not a new one
    hop.step(1);  // the last one: the convoy runs at once, in seq id order
    CHECK(hop.run() == Names{"s0", "s1", "s2"});
    CHECK_FALSE(hop.scheduler.holding());
}

TEST_CASE("a straggler: a window ends without it, and it is not waited for again until its next step") {
    Hop hop;
    hop.decode_together({0, 1, 2}, kWindowUs);
    hop.step(0);
    hop.step(1);
    const SchedulerTime deadline = hop.held();
    hop.now = deadline - microseconds(1);
    CHECK(hop.held() == deadline);
    hop.now = deadline;  // the window ends without session 2
    CHECK(hop.run() == Names{"s0", "s1"});

    hop.now += milliseconds(5);
    hop.step(0);
    hop.step(1);
    CHECK(hop.run() == Names{"s0", "s1"});  // 2 is waived: not waited for

    hop.now += milliseconds(5);
    hop.step(2);  // the straggler's next step: it decodes again, and waits for the others
    const SchedulerTime second = hop.held();
    CHECK(second == hop.now + microseconds(kWindowUs));
    hop.step(1);
    hop.step(0);
    CHECK(hop.run() == Names{"s0", "s1", "s2"});

    hop.now += milliseconds(5);
    hop.step(0);
    hop.step(1);
    CHECK(hop.held() == hop.now + microseconds(kWindowUs));  // 2 is waited for again
    hop.step(2);
    CHECK(hop.run() == Names{"s0", "s1", "s2"});
}

TEST_CASE("a lost peer: a session whose connection is gone is not waited for") {
    Hop hop;
    hop.decode_together({0, 1}, kWindowUs);
    hop.session(1).peer_lost = true;
    hop.step(0);
    CHECK(hop.run() == Names{"s0"});  // at once: no window spent on it
    CHECK_FALSE(hop.scheduler.holding());
    hop.now += milliseconds(1);
    hop.step(1);  // it came back on a new connection (the engine clears the flag with its step)
    hop.session(1).peer_lost = false;
    hop.step(0);
    CHECK(hop.run() == Names{"s0", "s1"});
}

TEST_CASE("a chunk, a refusal or a step nobody holds ends a hold at once, and leaves no hold behind") {
    for (const bool chunk : {true, false}) {
        CAPTURE(chunk);
        // (pacing off: a paced chunk neither runs nor ends a hold, see "a paced chunk ...")
        Hop hop(HopSchedulerConfig{512, milliseconds(0), milliseconds(0)});
        hop.bind(0, kWindowUs);
        hop.bind(1, kWindowUs);
        hop.bind(2);  // not lock-step
        for (uint32_t seq : {0, 1, 2}) {
            hop.step(seq, 5);
        }
        hop.run();
        hop.step(0);
        hop.run();  // 0 decodes
        hop.step(1);
        const SchedulerTime first = hop.held();  // held for 0
        hop.now += microseconds(kWindowUs / 4);
        if (chunk) {
            hop.step(2, 2);
        } else {
            hop.step(2, 1, /*refused=*/true);
        }
        CHECK(hop.run() == (chunk ? Names{"s1"} : Names{"s1", "s2"}));
        if (chunk) {
            CHECK(hop.run() == Names{"s2"});
        }
        CHECK_FALSE(hop.scheduler.holding());
        CHECK(std::holds_alternative<Idle>(hop.next()));  // nothing waits on the old deadline
        hop.now = first + milliseconds(1);  // past the old hold's end
        CHECK(std::holds_alternative<Idle>(hop.next()));
        hop.step(0);  // a new hold, with a window of its own (a stale one would end it at once)
        CHECK(hop.held() == hop.now + microseconds(kWindowUs));
        hop.step(1);
        CHECK(hop.run() == Names{"s0", "s1"});
    }
}

TEST_CASE("data-plane prefill beside decode: no decode step waits more than one chunk") {
    Hop hop;  // pacing 1 s, lapse 2.5 s
    hop.bind(0);
    hop.bind(1);
    hop.step(1);
    CHECK(hop.run() == Names{"s1"});  // 1 decodes
    hop.now += milliseconds(5);
    for (int chunk = 0; chunk < 4; ++chunk) {
        hop.step(0, 128);  // 0's prompt, pipelined: every chunk at once
    }
    // no decode Forward since they came: they wait for one, at most prefill_pace_max
    CHECK(hop.held() == hop.now + milliseconds(1000));
    for (int chunk = 0; chunk < 4; ++chunk) {
        CAPTURE(chunk);
        hop.now += milliseconds(20);
        hop.step(1);  // came while the chunk before ran (or while the chunks waited)
        CHECK(hop.run() == Names{"s1"});  // before any chunk: it waited for one chunk at most
        CHECK(hop.run() == Names{"s0"});  // one chunk, right after the decode Forward
        if (chunk < 3) {
            // the next chunk waits for the next decode Forward (its pace from the chunk that ran)
            CHECK(hop.held() == hop.now + milliseconds(1000));
        }
    }
    CHECK(std::holds_alternative<Idle>(hop.next()));

    SUBCASE("at a later hop: a chunk that comes right after a decode step waits for the next one") {
        hop.now += milliseconds(20);
        hop.step(1);
        CHECK(hop.run() == Names{"s1"});
        hop.step(0, 128);  // the hop before computed it after that decode step
        CHECK(hop.held() == hop.now + milliseconds(1000));
        hop.now += milliseconds(20);
        hop.step(1);  // so the next decode step finds the hop free
        CHECK(hop.run() == Names{"s1"});
        CHECK(hop.run() == Names{"s0"});
    }
}

TEST_CASE("data-plane prefill beside decode: after a decode Forward a chunk goes, it is not starved") {
    Hop hop;
    hop.bind(0);
    hop.bind(1, 0, 2);  // decode groups of ceil(2 / 2) = 1 step: two decode Forwards a round
    hop.bind(2, 0, 2);
    hop.step(1);
    hop.step(2);
    CHECK(hop.run() == Names{"s1"});
    CHECK(hop.run() == Names{"s2"});
    for (int chunk = 0; chunk < 3; ++chunk) {
        hop.step(0, 64);
    }
    hop.step(1);  // every decoding session's next step is always queued
    hop.step(2);
    Names order;
    for (int batch = 0; batch < 6; ++batch) {
        const Names ran = hop.run();
        REQUIRE(ran.size() == 1);
        order.push_back(ran.front());
        if (ran.front() != "s0") {
            hop.step(ran.front() == "s1" ? 1 : 2);  // its next step, at once
        }
    }
    CHECK(order == Names{"s1", "s0", "s2", "s0", "s1", "s0"});
}

TEST_CASE("a paced data-plane chunk waits prefill_pace_max at most from the last chunk, and not past the lapse") {
    Hop hop;  // pacing 1 s, lapse 2.5 s
    hop.bind(0);
    hop.bind(1);
    hop.step(1);
    CHECK(hop.run() == Names{"s1"});  // 1 decodes, then stops stepping
    for (int chunk = 0; chunk < 4; ++chunk) {
        hop.step(0, 32);
    }
    CHECK(hop.held() == at_ms(1000));
    hop.now = at_ms(1000);
    CHECK(hop.run() == Names{"s0"});
    CHECK(hop.held() == at_ms(2000));  // from the chunk that ran, not from when it came
    hop.now = at_ms(2000);
    CHECK(hop.run() == Names{"s0"});
    CHECK(hop.held() == at_ms(2500));  // 1's lapse ends first
    hop.now = at_ms(2500);
    CHECK(hop.run() == Names{"s0"});  // nobody decodes lately: back to back
    CHECK(hop.run() == Names{"s0"});
}

TEST_CASE("a paced chunk neither runs nor ends a lock-step hold; it runs right after the convoy") {
    Hop hop;
    hop.bind(0);
    hop.decode_together({1, 2}, kWindowUs);
    hop.step(0, 16);  // 0's prompt chunk: paced (1 and 2 decode)
    hop.step(1);
    CHECK(hop.held() == hop.now + microseconds(kWindowUs));  // the convoy waits for 2's step
    hop.now += microseconds(kWindowUs / 2);
    hop.step(2);
    CHECK(hop.run() == Names{"s1", "s2"});
    CHECK(hop.run() == Names{"s0"});
}

TEST_CASE("a prompt's chunks run back to back when nobody else decodes, its own decode step after them") {
    Hop hop;
    hop.bind(0);
    hop.bind(1);
    hop.step(1, 8);  // another session's prompt: not decoding
    CHECK(hop.run() == Names{"s1"});
    for (int chunk = 0; chunk < 3; ++chunk) {
        hop.step(0, 64);  // pipelined
    }
    hop.step(0);  // (its own decode step, queued behind its chunks, does not pace them)
    CHECK(hop.run() == Names{"s0"});
    CHECK(hop.run() == Names{"s0"});
    CHECK(hop.run() == Names{"s0"});
    CHECK(hop.run() == Names{"s0"});
    CHECK(std::holds_alternative<Idle>(hop.next()));
}

TEST_CASE("decode groups: a decode batch takes at most ceil(D / groups) steps, the rest right after") {
    Hop hop;
    for (uint32_t seq : {0, 1, 2, 3, 4}) {
        hop.bind(seq, 0, 2);
        hop.step(seq, 3);
    }
    // their prompts: a chunk batch has no cap (and nobody decodes yet)
    CHECK(hop.run() == Names{"s0", "s1", "s2", "s3", "s4"});
    for (uint32_t seq : {4, 3, 2, 1, 0}) {
        hop.step(seq);
    }
    CHECK(hop.run() == Names{"s2", "s3", "s4"});  // ceil(5 / 2), in arrival order, laid out by seq id
    CHECK(hop.run() == Names{"s0", "s1"});
}

TEST_CASE("prefill beside decode: a node's chunk runs right after the next decode Forward") {
    const HopSchedulerConfig config{512, milliseconds(1000), milliseconds(2500)};
    Hop hop(config);
    hop.bind(0);
    hop.node_forward(4);  // nobody decodes here: it runs at once
    CHECK(hop.run() == Names{"chunk4"});

    hop.step(0);
    CHECK(hop.run() == Names{"s0"});  // 0 decodes
    hop.now += milliseconds(10);
    hop.node_forward(4);
    // it waits for the next decode Forward, at most prefill_pace_max
    CHECK(hop.held() == hop.now + milliseconds(1000));
    hop.node_forward(1);  // a node's decode Forward is not paced
    CHECK(hop.run() == Names{"node1"});
    hop.now += milliseconds(10);
    hop.step(0);
    CHECK(hop.run() == Names{"s0"});
    CHECK(hop.run() == Names{"chunk4"});  // right after it

    SUBCASE("no decode step waits behind more than one chunk") {
        hop.node_forward(4);  // queued before the step: it waits for the step's Forward
        hop.node_forward(4);
        hop.now += milliseconds(10);
        hop.step(0);
        CHECK(hop.run() == Names{"s0"});
        CHECK(hop.run() == Names{"chunk4"});
        hop.step(0);  // came during that chunk; the second chunk may run now too, but not first
        CHECK(hop.run() == Names{"s0"});
        CHECK(hop.run() == Names{"chunk4"});
    }
    SUBCASE("a chunk waits prefill_pace_max at most") {
        hop.now += milliseconds(100);
        hop.node_forward(4);
        const SchedulerTime deadline = hop.held();
        CHECK(deadline == hop.now + milliseconds(1000));
        hop.now = deadline;
        CHECK(hop.run() == Names{"chunk4"});
    }
    SUBCASE("a session that stopped decoding holds no chunk back past the lapse") {
        hop.now += milliseconds(2000);  // 0 last stepped 2 s ago: 0.5 s of its lapse is left
        hop.node_forward(4);
        const SchedulerTime deadline = hop.held();
        CHECK(deadline == hop.session(0).last_step_at + milliseconds(2500));
        hop.now = deadline;
        CHECK(hop.run() == Names{"chunk4"});
    }
    SUBCASE("a lost peer holds no chunk back") {
        hop.session(0).peer_lost = true;
        hop.node_forward(4);
        CHECK(hop.run() == Names{"chunk4"});
    }
}

TEST_CASE("pacing off (prefill_pace_max 0): a chunk never waits") {
    Hop hop(HopSchedulerConfig{512, milliseconds(0), milliseconds(0)});
    hop.bind(0);
    hop.step(0);
    hop.run();
    hop.node_forward(4);
    CHECK(hop.run() == Names{"chunk4"});
}

TEST_CASE("a hold holds data-plane steps only: operations and a node's Forwards run beside it") {
    Hop hop;
    hop.decode_together({0, 1}, kWindowUs);
    hop.step(0);  // held for 1
    const SchedulerTime deadline = hop.held();
    hop.operation();
    CHECK(hop.run() == Names{"op"});
    hop.node_forward(1);
    CHECK(hop.run() == Names{"node1"});
    CHECK(hop.held() == deadline);
    hop.step(1);
    CHECK(hop.run() == Names{"s0", "s1"});
}

TEST_CASE("steps and node items that may both run go in arrival order") {
    Hop hop;
    hop.bind(0);
    hop.operation();
    hop.step(0);
    hop.node_forward(1);
    CHECK(hop.run() == Names{"op"});
    CHECK(hop.run() == Names{"s0"});
    CHECK(hop.run() == Names{"node1"});
}
