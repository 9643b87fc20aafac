// Engine: see engine.h.
#include "engine.h"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <future>
#include <memory>
#include <utility>

namespace baton {

namespace {

HopSchedulerConfig scheduler_config(const Shard & shard, const EngineConfig & config) {
    HopSchedulerConfig c;
    c.row_budget = shard.info().n_batch_max;
    c.prefill_pace_max = config.prefill_pace_max;
    c.decoding_lapse = config.decoding_lapse;
    return c;
}

ShardStatus stopping() { return ShardStatus::Precondition("the worker is stopping"); }

}  // namespace

Engine::Engine(Shard * shard, const EngineConfig & config)
    : shard_(shard), scheduler_(scheduler_config(*shard, config)) {
    thread_ = std::thread([this] { loop(); });
}

Engine::~Engine() { stop(); }

void Engine::stop() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        stopping_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) {
        thread_.join();
    }
}

ShardStatus Engine::call(QueuedKind kind, uint32_t rows, const std::function<ShardStatus(Shard &)> & job) {
    // shared: the engine thread may still be inside set_value when the caller returns
    auto answer = std::make_shared<std::promise<ShardStatus>>();
    std::future<ShardStatus> answered = answer->get_future();
    Item item;
    item.meta.kind = kind;
    item.meta.rows = rows;
    item.meta.queued_at = SchedulerClock::now();
    // (the caller blocks until the job ran, so job stays valid)
    item.job = [answer, &job](Shard * shard) {
        if (shard == nullptr) {
            answer->set_value(stopping());
            return;
        }
        try {
            answer->set_value(job(*shard));
        } catch (const std::exception & e) {
            answer->set_value(ShardStatus::Internal(e.what()));
        } catch (...) {
            answer->set_value(ShardStatus::Internal("unknown exception"));
        }
    };
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (stopping_) {
            return stopping();
        }
        item.meta.decode_forwards_seen = scheduler_.decode_forwards();
        queue_.push_back(std::move(item));
    }
    wake_.notify_all();
    return answered.get();
}

void Engine::set_step_sink(StepSink * sink) {
    std::unique_lock<std::mutex> lock(mu_);
    sink_ = sink;
    if (sink == nullptr) {
        queue_.erase(std::remove_if(queue_.begin(), queue_.end(),
                                    [](const Item & i) { return i.meta.kind == QueuedKind::kStep; }),
                     queue_.end());
        sessions_.clear();
        sink_idle_.wait(lock, [&] { return !in_steps_; });
    }
}

void Engine::bind(uint64_t generation, uint32_t gather_us, uint32_t groups) {
    std::lock_guard<std::mutex> lock(mu_);
    SessionView & s = sessions_[generation];
    s = SessionView{};
    s.binding = generation;
    s.gather_us = gather_us;
    s.groups = groups;
}

void Engine::unbind(uint64_t generation) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        sessions_.erase(generation);
        queue_.erase(std::remove_if(queue_.begin(), queue_.end(),
                                    [&](const Item & i) {
                                        return i.meta.kind == QueuedKind::kStep && i.meta.binding == generation;
                                    }),
                     queue_.end());
    }
    wake_.notify_all();  // a hold may have waited for it
}

void Engine::post_steps(std::vector<StepWork> && steps) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (sink_ == nullptr || stopping_) {
            return;  // the data plane is stopping
        }
        for (StepWork & work : steps) {
            const auto found = sessions_.find(work.generation);
            if (found == sessions_.end()) {
                continue;  // unbound meanwhile
            }
            SessionView & s = found->second;
            const bool refused = work.step.error_code() != 0;
            const uint32_t rows = static_cast<uint32_t>(work.step.positions_size());
            s.decoding = !refused && rows == 1;
            s.last_step_at = work.read_at;
            ++s.steps_taken;
            s.peer_lost = false;  // it steps: its peer is there
            Item item;
            item.meta.kind = QueuedKind::kStep;
            item.meta.binding = work.generation;
            item.meta.seq_id = work.seq_id;
            item.meta.rows = rows;
            item.meta.wire = work.wire;
            item.meta.refused = refused;
            item.meta.queued_at = work.read_at;
            item.meta.decode_forwards_seen = scheduler_.decode_forwards();  // (a chunk's pacing)
            item.step = std::move(work);
            queue_.push_back(std::move(item));
        }
    }
    wake_.notify_all();
}

void Engine::peer_lost(uint64_t generation) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        const auto found = sessions_.find(generation);
        if (found == sessions_.end()) {
            return;
        }
        found->second.peer_lost = true;
    }
    wake_.notify_all();
}

uint64_t Engine::batches() const {
    std::lock_guard<std::mutex> lock(mu_);
    return batches_;
}

void Engine::loop() {
    std::unique_lock<std::mutex> lock(mu_);
    QueueView view;
    SessionsView sessions;
    while (!stopping_) {
        view.clear();
        for (const Item & i : queue_) {
            view.push_back(i.meta);
        }
        sessions.clear();
        for (const auto & [generation, s] : sessions_) {
            sessions.push_back(s);
        }
        const Decision decision = scheduler_.next(view, sessions, SchedulerClock::now());
        if (const auto * hold = std::get_if<HoldUntil>(&decision)) {
            wake_.wait_until(lock, hold->deadline);  // the lock-step window's end, or a chunk's pace
            continue;
        }
        if (std::holds_alternative<Idle>(decision)) {
            wake_.wait(lock);
            continue;
        }
        const auto & chosen = std::get<RunBatch>(decision).items;
        std::vector<Item> items;
        items.reserve(chosen.size());
        for (size_t i : chosen) {
            items.push_back(std::move(queue_[i]));
        }
        std::vector<size_t> taken = chosen;
        std::sort(taken.rbegin(), taken.rend());
        for (size_t i : taken) {
            queue_.erase(queue_.begin() + static_cast<std::ptrdiff_t>(i));
        }
        ++batches_;
        const bool steps = items.front().meta.kind == QueuedKind::kStep;
        in_steps_ = steps;
        lock.unlock();
        run(items);
        lock.lock();
        if (steps) {
            in_steps_ = false;
            sink_idle_.notify_all();
        }
    }
    for (Item & i : queue_) {  // answer every caller still waiting
        if (i.job) {
            i.job(nullptr);
        }
    }
    queue_.clear();
}

void Engine::run(std::vector<Item> & items) {
    if (items.front().meta.kind != QueuedKind::kStep) {
        items.front().job(shard_);  // (a job answers its caller, exceptions included)
        return;
    }
    StepSink * sink = nullptr;
    {
        std::lock_guard<std::mutex> lock(mu_);
        sink = sink_;  // set_step_sink(nullptr) waits for this batch before it returns
    }
    if (sink == nullptr) {
        return;
    }
    std::vector<StepWork> batch;
    batch.reserve(items.size());
    for (Item & i : items) {
        batch.push_back(std::move(i.step));
    }
    try {
        sink->run_steps(*shard_, std::move(batch));
    } catch (const std::exception & e) {  // (e.g. bad_alloc) this batch is lost; the engine goes on
        std::fprintf(stderr, "baton-worker: engine: %s in a data-plane batch; its steps are dropped\n", e.what());
    } catch (...) {
        std::fprintf(stderr, "baton-worker: engine: unknown exception in a data-plane batch; its steps dropped\n");
    }
}

}  // namespace baton
